"""The three backends behind one interface: make a run, measure a window, clean up.

A *run* is what one repetition uses: its own ElasticRun in its own namespace
(``k8s``), its own TCPStore host port (``c10d``), or its own run id
(``etcd-v2``), so that no measurement can see another's requests.

A *window* is measured the same way for all three: the coordinator opens it
just before the nodes start and closes it after they finish; the backend says
what it counted in between (server-side for ``k8s``, client-side otherwise)
and how much CPU its server used.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elasticrun.api.kube import ApiError, run_path, runs_path
from elasticrun.api.model import RunSpec, new_run_manifest

from bench.pool import Pool
from bench.proc import cpu_seconds, free_port, wait_quiet
from bench.servers import CRD_FILES, ControlPlane, EtcdV2Server
from controlplane import apiserver
from controlplane.operatorproc import OperatorProcess

BACKENDS = ("k8s", "c10d", "etcd-v2")
#: torch's opt-out of sharing rank 0's TCPStore with the workers ("1" = off).
SHARE_STORE_OFF = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
#: How long a started operator may take to become idle before a block uses it anyway.
OPERATOR_SETTLE_BOUND = 60.0
_serial = itertools.count(1)


@dataclass(frozen=True)
class Timing:
    """The rendezvous timeouts of a run, in whole seconds (all backends take ints)."""

    min_nodes: int
    max_nodes: int
    last_call: int = 1
    join: int = 300
    #: k8s Lease renewal / torch keep-alive interval.
    keep_alive: int = 60
    keep_alive_attempts: int = 3
    #: k8s only: the server ends each watch after this long.
    watch_timeout: int = 300


@dataclass
class Run:
    backend: str
    name: str
    endpoint: str
    conf: dict[str, Any]
    timing: Timing
    host_node: str | None = None
    namespace: str | None = None
    #: k8s: every node runs in a Pod of its own name, which the operator watches.
    pods: bool = False
    #: Environment of the nodes' processes; torch reads its store-sharing switch per call.
    env: dict[str, str] = field(default_factory=lambda: {SHARE_STORE_OFF: "0"})


@dataclass
class Window:
    """What a backend remembers when a measurement window opens."""

    run: Run
    started: float
    audit_offset: int = 0
    watch: dict[str, float] = field(default_factory=dict)
    server_cpu: float = 0.0
    client: dict[str, int] = field(default_factory=dict)
    client_cpu: float = 0.0


class Backend(ABC):
    name: str
    #: How requests are counted, said in the report next to the numbers.
    counted_how: str

    def start(self, log_dir: Path) -> None:  # optional
        """Start the servers this backend needs."""
        return None

    def stop(self) -> None:  # optional
        """Stop them, by PID."""
        return None

    @abstractmethod
    def new_run(self, timing: Timing, nodes: list[str]) -> Run: ...

    def end_run(self, run: Run) -> None:  # optional
        """Release what the run held on the server side."""
        return None

    def server_pids(self) -> dict[str, int]:
        return {}

    def quiesce(self, bound: float = 120.0) -> float:
        """Wait (bounded) until the servers are idle again; seconds waited.

        A round that did not form leaves queued requests behind; the next
        measurement must not pay for them.
        """
        began = time.monotonic()
        while time.monotonic() - began < bound:
            before = self.server_cpu()
            time.sleep(1.0)
            if self.server_cpu() - before < 0.1:
                break
        return time.monotonic() - began

    def versions(self) -> dict[str, str]:
        return {}

    def server_cpu(self) -> float:
        return sum(cpu_seconds(pid) for pid in self.server_pids().values())

    def open_window(self, run: Run, pool: Pool) -> Window:
        window = Window(run, time.monotonic(), server_cpu=self.server_cpu(),
                        client_cpu=sum(cpu_seconds(pid) for pid in pool.pids))
        window.client = _client_counters(pool)
        return window

    def close_window(self, window: Window, pool: Pool) -> dict[str, Any]:
        """Requests, lost compare-and-sets, watch traffic and CPU of the window."""
        counters = _client_counters(pool)
        delta = {k: v - window.client.get(k, 0) for k, v in counters.items()}
        return {
            "requests": delta.get("ops", 0),
            "writes": sum(v for k, v in delta.items()
                          if k in ("op:compare_set", "op:set", "http:PUT", "http:POST",
                                   "http:DELETE")),
            "lost_cas": delta.get("lost_cas", 0),
            "by_kind": {k: v for k, v in sorted(delta.items()) if ":" in k},
            "server_cpu_s": self.server_cpu() - window.server_cpu,
            "client_cpu_s": sum(cpu_seconds(pid) for pid in pool.pids) - window.client_cpu,
        }


def run_spec(timing: Timing) -> RunSpec:
    """The ElasticRun spec of a k8s run with ``timing``."""
    return RunSpec(min_nodes=timing.min_nodes, max_nodes=timing.max_nodes,
                   join_timeout=timing.join, last_call_timeout=timing.last_call,
                   heartbeat_timeout=timing.keep_alive * timing.keep_alive_attempts,
                   lease_renew_interval=timing.keep_alive)


def _client_counters(pool: Pool) -> dict[str, int]:
    total: dict[str, int] = {}
    for answer in pool.all("counters"):
        for key, value in answer["counters"].items():
            total[key] = total.get(key, 0) + int(value)
    return total


def _torch_conf(timing: Timing) -> dict[str, Any]:
    return {"join_timeout": timing.join, "last_call_timeout": timing.last_call,
            "keep_alive_interval": timing.keep_alive,
            "keep_alive_max_attempt": timing.keep_alive_attempts,
            "read_timeout": 60, "close_timeout": 10}


class C10dBackend(Backend):
    name = "c10d"
    counted_how = ("client side: every call C10dRendezvousBackend makes on its TCPStore "
                   "(get, compare_set), through a counting proxy; a compare_set whose answer "
                   "is not the value written is a lost CAS. The 2 bootstrap keys per node "
                   "(master address/port) are not counted.")

    def new_run(self, timing: Timing, nodes: list[str]) -> Run:
        return Run(self.name, f"bench-{next(_serial)}", f"127.0.0.1:{free_port()}",
                   _torch_conf(timing), timing, host_node=nodes[0])


class EtcdV2Backend(Backend):
    name = "etcd-v2"
    counted_how = ("client side: every HTTP request of python-etcd's urllib3 pool (rendezvous "
                   "state and EtcdStore bootstrap keys), through a counting proxy; a 412 answer "
                   "is a lost CAS (prevIndex/prevExist failed).")

    def __init__(self) -> None:
        self.server: EtcdV2Server | None = None

    def start(self, log_dir: Path) -> None:
        self.server = EtcdV2Server(log_dir)
        self.server.start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()

    def new_run(self, timing: Timing, nodes: list[str]) -> Run:
        assert self.server is not None
        return Run(self.name, f"bench-{next(_serial)}", self.server.endpoint,
                   _torch_conf(timing), timing)

    def server_pids(self) -> dict[str, int]:
        return {"etcd": self.server.pid} if self.server else {}

    def versions(self) -> dict[str, str]:
        return {"etcd (etcd-v2 backend)": EtcdV2Server.version()}


class K8sBackend(Backend):
    name = "k8s"
    counted_how = ("server side: the API server's audit log (Metadata level), requests on the "
                   "run's ElasticRun, slices and Leases in its namespace, once per auditID; a "
                   "409 is a lost CAS. Writes = create/update/patch/delete, Lease renewals apart.")

    def __init__(self, directory: Path, crd_files: Sequence[Path] = CRD_FILES) -> None:
        self.directory = directory
        self.crd_files = tuple(crd_files)
        self.cp: ControlPlane | None = None

    def start(self, log_dir: Path) -> None:
        self.cp = ControlPlane(self.directory, self.crd_files)
        self.cp.start()

    def stop(self) -> None:
        if self.cp is not None:
            self.cp.stop()

    @property
    def control_plane(self) -> ControlPlane:
        assert self.cp is not None
        return self.cp

    @contextlib.contextmanager
    def operator(self, log_dir: Path, namespaces: Sequence[str] = ()
                 ) -> Iterator[OperatorProcess]:
        """The operator on this control plane for the block, as the Helm chart runs it
        (every namespace unless ``namespaces`` are named), with four workers; stopped
        by its PID however the block ends, a start that failed half-way included.

        The block begins once the operator is idle (bounded by
        :data:`OPERATOR_SETTLE_BOUND`): its start-up, the first listings and a pass
        over every run the server still holds from earlier steps, is no part of
        what a block measures (it was 1 s of the operator's CPU inside the first
        Pod-deleted round of ``make bench``).
        """
        operator = OperatorProcess(Path(self.control_plane.kubeconfig), namespaces, log_dir,
                                   ["--workers", "4"])
        try:
            operator.start()
            wait_quiet(operator.pid, OPERATOR_SETTLE_BOUND)
            yield operator
        finally:
            operator.stop()

    def new_run(self, timing: Timing, nodes: list[str]) -> Run:
        cp = self.control_plane
        namespace = f"bench-{next(_serial)}-{int(time.time()) % 100000}"
        cp.api.request("POST", "/api/v1/namespaces", body={
            "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
        # Created ahead, as `kubectl apply` or the operator would; not counted.
        cp.api.request("POST", runs_path(namespace),
                       body=new_run_manifest("run", namespace, run_spec(timing)))
        conf = {"kubeconfig": cp.kubeconfig, "create_run": "false", "join_timeout": timing.join,
                "last_call_timeout": timing.last_call, "lease_interval": timing.keep_alive,
                "heartbeat_timeout": timing.keep_alive * timing.keep_alive_attempts,
                "watch_timeout": timing.watch_timeout, "api_timeout": 60, "close_timeout": 10}
        return Run(self.name, "run", f"{namespace}/run", conf, timing, namespace=namespace)

    def set_last_call(self, run: Run, seconds: int) -> None:
        """Set the run's ``spec.lastCallTimeoutSeconds``: nodes and the operator read it from
        the run, and every seal is fenced by the run's resourceVersion, so no round is sealed
        from a copy older than this change."""
        assert run.namespace
        self.control_plane.api.request(
            "PATCH", run_path(run.namespace, run.name),
            body={"spec": {"lastCallTimeoutSeconds": seconds}},
            content_type="application/merge-patch+json")

    def end_run(self, run: Run) -> None:
        """Delete the ElasticRun first, so that shutting the nodes down is cheap."""
        assert run.namespace
        try:
            self.control_plane.api.request("DELETE", run_path(run.namespace, run.name))
        except ApiError as exc:
            if not exc.not_found:
                raise

    def server_pids(self) -> dict[str, int]:
        return self.control_plane.pids if self.cp else {}

    def versions(self) -> dict[str, str]:
        return self.control_plane.versions()

    def open_window(self, run: Run, pool: Pool) -> Window:
        cp = self.control_plane
        window = Window(run, time.monotonic(), audit_offset=apiserver.AuditLog(
            cp.audit_log).mark(), watch=_server_bytes(cp.metrics()),
            server_cpu=self.server_cpu(), client_cpu=sum(cpu_seconds(p) for p in pool.pids))
        return window

    def close_window(self, window: Window, pool: Pool) -> dict[str, Any]:
        cp = self.control_plane
        assert window.run.namespace
        events = apiserver.AuditLog(cp.audit_log).events_since(window.audit_offset)
        counted = apiserver.tally(events, window.run.namespace)
        watch = apiserver.diff(_server_bytes(cp.metrics()), window.watch)
        return {
            "requests": counted.total,
            "writes": counted.writes,
            "lost_cas": counted.conflicts,
            "rejected_tests": counted.rejected_tests,
            "lease_renewals": counted.lease_renewals,
            "by_kind": dict(sorted(counted.by_kind.items())),
            "watch_events": watch["events"],
            "watch_bytes": watch["bytes"],
            "response_bytes": watch["response_bytes"],
            "server_cpu_s": self.server_cpu() - window.server_cpu,
            "client_cpu_s": sum(cpu_seconds(pid) for pid in pool.pids) - window.client_cpu,
        }


def _server_bytes(metrics: str) -> dict[str, float]:
    """Watch events of the run's group and response bytes of its objects, as counted so far."""
    return {**apiserver.watch_counters(metrics),
            "response_bytes": apiserver.response_bytes(metrics)}


def make(name: str, work_dir: Path) -> Backend:
    if name == "k8s":
        return K8sBackend(work_dir / "controlplane")
    if name == "c10d":
        return C10dBackend()
    if name == "etcd-v2":
        return EtcdV2Backend()
    raise ValueError(f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}")
