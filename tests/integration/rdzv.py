"""Helpers for driving several handlers as nodes, and for reading the API server's books."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elasticrun.api.gateway import RunGateway
from elasticrun.api.kube import ApiConnectionError, ApiError, KubeClient, run_path, runs_path
from elasticrun.api.model import ElasticRun, RunSpec, parse_run

from conftest import TEST_NODE_CONF, Cluster
from controlplane.apiserver import AuditEntry, AuditLog, count_writes, metric


@dataclass
class Outcome:
    node: str
    rank: int | None = None
    world_size: int | None = None
    info: Any = None
    error: BaseException | None = None


def rendezvous_all(handlers: Sequence[Any], timeout: float = 60) -> dict[str, Outcome]:
    """``next_rendezvous()`` on every handler at once, in threads; outcomes by node name."""
    outcomes: dict[str, Outcome] = {}
    lock = threading.Lock()

    def node(handler: Any) -> None:
        name = handler.settings.node_name
        try:
            info = handler.next_rendezvous()
            result = Outcome(name, info.rank, info.world_size, info)
        except BaseException as exc:
            result = Outcome(name, error=exc)
        with lock:
            outcomes[name] = result

    threads = [threading.Thread(target=node, args=(h,), daemon=True) for h in handlers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    missing = [h.settings.node_name for h in handlers if h.settings.node_name not in outcomes]
    assert not missing, f"nodes still in next_rendezvous after {timeout}s: {missing}"
    return outcomes


def start_rendezvous(handler: Any) -> tuple[threading.Thread, dict[str, Any]]:
    """``next_rendezvous()`` in the background; the dict gets 'info' or 'error'."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["info"] = handler.next_rendezvous()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


class RoundLog:
    """Watches the run and records when each round was sealed and with whom."""

    def __init__(self, client: KubeClient, namespace: str, run: str) -> None:
        self.client, self.namespace, self.run = client, namespace, run
        self.rounds: dict[int, tuple[float, frozenset[str]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        rv = ""
        while not self._stop.is_set():
            try:
                for event in self.client.watch(
                        runs_path(self.namespace),
                        {"fieldSelector": f"metadata.name={self.run}", "resourceVersion": rv},
                        5):
                    if event.get("type") in ("ADDED", "MODIFIED"):
                        run = parse_run(event["object"])
                        rv = run.resource_version
                        if run.status.participants and run.status.round not in self.rounds:
                            self.rounds[run.status.round] = (time.monotonic(),
                                                             run.status.member_names)
            except (ApiError, ApiConnectionError):
                self._stop.wait(0.2)

    def first_round_after(self, moment: float, without: str) -> tuple[int, float] | None:
        for number, (sealed, members) in sorted(self.rounds.items()):
            if sealed > moment and without not in members:
                return number, sealed - moment
        return None

    def stop(self) -> None:
        self._stop.set()


def start_torchrun_agent(processes: Any, kubeconfig: Path, workdir: Path, node: str, *,
                         run: str, nnodes: str, conf: str, max_restarts: int,
                         script: Path, script_args: Sequence[str]) -> subprocess.Popen[Any]:
    """One real torchrun agent (``--rdzv-backend=k8s``, one gloo worker, on 127.0.0.1) as
    node ``node``, its output in ``workdir/<node>.log``; ``processes`` stops it by PID."""
    from controlplane.localcluster import clean_env

    env = {**clean_env(), "KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1"}
    argv = [str(Path(sys.executable).parent / "torchrun"), f"--nnodes={nnodes}",
            "--nproc-per-node=1", "--rdzv-backend=k8s", f"--rdzv-id={run}",
            f"--rdzv-conf=node_name={node},{conf}", f"--max-restarts={max_restarts}",
            "--monitor-interval=0.1", "--local-addr=127.0.0.1", str(script), *script_args]
    log = open(workdir / f"{node}.log", "wb")  # noqa: SIM115 - closed with the process
    return processes.start(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=workdir)


def read_run(client: KubeClient, namespace: str, name: str) -> ElasticRun:
    return parse_run(client.request("GET", run_path(namespace, name)))


# --------------------------------------------------------------------------- audit log, metrics

# One reader of the API server's audit log and /metrics, shared with the benchmarks.
__all__ = ["AuditEntry", "AuditLog", "count_writes", "metric"]


def watch_events(metrics_text: Callable[[], str]) -> float:
    return metric(metrics_text(), "apiserver_watch_events_total", group="elasticrun.dev")


def is_waiting(client: KubeClient, namespace: str, run: str, node: str) -> bool:
    """Whether ``node`` has asked to join and no round has answered it yet.

    The request lives on the node's own Lease; False while there is none.
    """
    from elasticrun.api.kube import lease_path
    from elasticrun.api.leases import lease_state, pending_joins
    from elasticrun.api.model import now
    from elasticrun.api.naming import lease_name

    try:
        lease = client.request("GET", lease_path(namespace, lease_name(run, node)))
        current = read_run(client, namespace, run)
    except ApiError as exc:
        if exc.not_found:
            return False
        raise
    at = now()  # one read: the Lease counts as seen renewed as it is read
    return any(w.name == node for w in
               pending_joins([lease_state(lease, seen=at)], current.status, at, current.uid,
                             current.spec.heartbeat_timeout))


def run_deleted(client: KubeClient, namespace: str, run: str) -> bool:
    """Whether the ElasticRun is gone (for bounded waits on deletion)."""
    try:
        client.request("GET", run_path(namespace, run))
    except ApiError as exc:
        if exc.not_found:
            return True
        raise
    return False


def spec_observed(client: KubeClient, namespace: str, run: str) -> bool:
    """Whether the operator has reconciled the run's latest spec (``status.observedGeneration``):
    the premise of a check that a spec change does nothing more."""
    current = read_run(client, namespace, run)
    return current.status.observed_generation == current.generation


def operator_round(operator: Any, run: str) -> float:
    """The round the operator last saw for ``run`` (its ``elasticrun_round`` gauge)."""
    return metric(operator.metrics(), "elasticrun_round", run=run)


def make_run(cluster: Cluster, namespace: str, name: str, min_nodes: int, max_nodes: int,
             last_call: int) -> None:
    """The run as a user's manifest creates it (the handlers find it there)."""
    spec = RunSpec(min_nodes=min_nodes, max_nodes=max_nodes,
                   join_timeout=int(TEST_NODE_CONF["join_timeout"]),
                   last_call_timeout=last_call,
                   heartbeat_timeout=int(TEST_NODE_CONF["heartbeat_timeout"]),
                   lease_renew_interval=int(TEST_NODE_CONF["lease_interval"]))
    assert RunGateway(cluster.client, namespace, name).create(spec) is not None


@dataclass
class Agent:
    """A member's torch agent: re-joins whenever ``num_nodes_waiting()`` is positive."""

    handler: Any
    #: (round, world size) of every round this agent's node was in, in order.
    rounds: list[tuple[int, int]] = field(default_factory=list)
    error: BaseException | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def start(self, first: tuple[int, int]) -> None:
        self.rounds.append(first)
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        try:
            while not self.stop.is_set():
                if self.handler.num_nodes_waiting() > 0:
                    info = self.handler.next_rendezvous()
                    run = self.handler.watcher.latest
                    self.rounds.append((run.status.round if run else -1, info.world_size))
                self.stop.wait(0.1)  # torch's monitor interval
        except BaseException as exc:
            self.error = exc

    def halt(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(30)
