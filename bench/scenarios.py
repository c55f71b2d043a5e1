"""The workloads, identical for every backend: formation, recovery, scale-up, idle.

Each function drives the workers through one backend and returns plain dicts
(one per repetition) for the JSON and the report.  Every wait is bounded.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.backends import SHARE_STORE_OFF, Backend, K8sBackend, Run, Timing
from bench.pool import Pool, WorkerError, WorkerProcess
from bench.proc import cpu_seconds, rss_bytes, wait_quiet

#: Lead time between "go" and the start, so that every worker is waiting on it.
START_DELAY = 0.3
#: After the last node returns, watches re-open and the server logs them.
SETTLE = 0.7
#: Poll interval of num_nodes_waiting() while timing detection (torch's agent polls at 0.1 s);
#: the k8s handler's is asked at every change of its cache as well (``bench.worker``).
DETECT_POLL = 0.02
#: Bound on one rendezvous of the benchmark.
ROUND_BOUND = 240.0


class ScenarioError(RuntimeError):
    """A repetition went wrong (a node failed, a round had the wrong size)."""


@dataclass
class Extra:
    """A worker of its own, for a node that is killed or arrives late."""

    log_dir: Path
    prefix: str
    worker: WorkerProcess | None = None

    def get(self) -> WorkerProcess:
        if self.worker is None or not self.worker.alive():
            if self.worker is not None:
                self.worker.stop()
            self.worker = WorkerProcess(f"{self.prefix}-extra", self.log_dir)
        return self.worker

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.stop()
            self.worker = None


def node_names(n: int, prefix: str = "node") -> list[str]:
    return [f"{prefix}-{i:03d}" for i in range(n)]


def _build_fields(run: Run) -> dict[str, Any]:
    return {"backend": run.backend, "run": run.name, "endpoint": run.endpoint,
            "min": run.timing.min_nodes, "max": run.timing.max_nodes, "conf": run.conf,
            "host_node": run.host_node, "env": run.env, "pods": run.pods}


def build(pool: Pool, run: Run, nodes: Sequence[str]) -> list[list[str]]:
    """Build the nodes on the workers; the c10d store host first, as it must listen first."""
    shares = pool.deal(nodes)
    fields = _build_fields(run)
    first = [i for i, share in enumerate(shares) if run.host_node in share]
    for i in first:
        pool.workers[i].call("build", timeout=120, nodes=shares[i], **fields)
    pool.all("build", timeout=300,
             per_worker=[{"nodes": [] if i in first else share} for i, share in enumerate(shares)],
             **fields)
    return shares


def collect(workers: Sequence[WorkerProcess], bound: float = ROUND_BOUND
            ) -> list[dict[str, Any]]:
    ids = [w.send("collect", timeout=bound) for w in workers]
    results: list[dict[str, Any]] = []
    for worker, msg_id in zip(workers, ids, strict=True):
        answer = worker.receive(msg_id, bound + 30)
        if answer["pending"]:
            failed = [f"{r['node']}: {r['error']}" for r in answer["results"] if "error" in r]
            raise ScenarioError(
                f"{worker.name}: {answer['pending']} nodes still busy after {bound:.0f}s"
                + (f" ({len(failed)} failed, first {failed[0]})" if failed else "")
                + _where(answer.get("stuck") or {}))
        results.extend(answer["results"])
    return results


def _where(stuck: dict[str, list[str]]) -> str:
    """The innermost frames of the first busy node (the worker's log has every stack)."""
    if not stuck:
        return ""
    name = min(stuck)
    return f"; {name} sits in:\n    " + "\n    ".join(stuck[name][-8:])


def _check(results: list[dict[str, Any]], world: int, what: str) -> None:
    errors = [f"{r['node']}: {r['error']}" for r in results if "error" in r]
    if errors:
        raise ScenarioError(f"{what}: {len(errors)} nodes failed, e.g. {errors[0]}")
    sizes = {r.get("world") for r in results if "t_done" in r}
    if sizes != {world}:
        raise ScenarioError(f"{what}: expected rounds of {world} nodes, got sizes {sizes}")


def _form(pool: Pool, workers: Sequence[WorkerProcess], world: int, what: str) -> None:
    start = time.monotonic() + START_DELAY
    ids = [w.send("rendezvous", start_at=start) for w in workers]
    for worker, msg_id in zip(workers, ids, strict=True):
        worker.receive(msg_id, 30)
    _check(collect(workers), world, what)


def teardown(backend: Backend, run: Run, workers: Sequence[WorkerProcess]) -> None:
    """Delete the run (its nodes stop waiting), then shut every node down."""
    backend.end_run(run)
    ids = [w.send("teardown") for w in workers if w.alive()]
    for worker, msg_id in zip([w for w in workers if w.alive()], ids, strict=True):
        worker.receive(msg_id, 330)


# --------------------------------------------------------------------------- formation


def formation(backend: Backend, pool: Pool, n: int, reps: int, bound: float = ROUND_BOUND
              ) -> list[dict[str, Any]]:
    """From all N nodes built to the last ``next_rendezvous()`` returning; min = max = N.

    A round that has not formed within ``bound`` seconds is a result, not a crash:
    the row says so (``formed: false``, with the requests the server saw meanwhile),
    the run is deleted so that its nodes give up, and no further repetition at
    this N is attempted.
    """
    out = []
    for rep in range(reps):
        nodes = node_names(n)
        run = backend.new_run(Timing(n, n), nodes)
        try:
            built = time.monotonic()
            build(pool, run, nodes)
            built = time.monotonic() - built
            window = backend.open_window(run, pool)
            start = time.monotonic() + START_DELAY
            pool.all("rendezvous", start_at=start)
            try:
                results = collect(pool.workers, bound)
            except ScenarioError as exc:
                measured = backend.close_window(window, pool)
                pool.restart()
                backend.end_run(run)
                backend.quiesce()
                out.append({"n": n, "rep": rep, "formed": False, "bound_s": bound,
                            "latency_s": None, "why": str(exc), **measured})
                break
            done = max(r["t_done"] for r in results)
            _check(results, n, f"{backend.name} formation of {n}")
            time.sleep(SETTLE)
            measured = backend.close_window(window, pool)
        finally:
            teardown(backend, run, pool.workers)
        out.append({"n": n, "rep": rep, "formed": True, "latency_s": done - start,
                    "build_s": built,
                    "first_done_s": min(r["t_done"] for r in results) - start, **measured})
    return out


# --------------------------------------------------------------------------- recovery


def recovery(backend: Backend, pool: Pool, extra: Extra, n: int, reps: int,
             timing: Timing) -> list[dict[str, Any]]:
    """A member is lost; do the survivors hear of it, and how soon is the next round formed?

    ``k8s`` (handler-only trigger): the lost member's handler calls ``shutdown()``;
    survivors poll ``num_nodes_waiting()`` and re-rendezvous as soon as it is > 0.
    torch's backends: the member's process is killed (SIGKILL).  Survivors poll
    ``num_nodes_waiting()`` for the heartbeat expiry plus 2 s; torch never makes
    it positive for them (the dead node leaves no wait-list entry), so they then
    re-enter ``next_rendezvous()`` themselves, as they would once their
    collective timed out, and the time from that re-entry to the round is timed.
    """
    graceful = backend.name == "k8s"
    expiry = timing.keep_alive * timing.keep_alive_attempts
    window_s = 10.0 if graceful else expiry + 2.0
    out = []
    for rep in range(reps):
        nodes = node_names(n)
        run = backend.new_run(timing, nodes)
        victim = extra.get()
        try:
            out.append(_recover_once(backend, pool, victim, run, nodes, rep, graceful,
                                     window_s))
        finally:
            teardown(backend, run, [*pool.workers, victim])
            if not graceful:
                extra.stop()  # its process was killed; the next repetition gets a new one
    return out


def _recover_once(backend: Backend, pool: Pool, victim: WorkerProcess, run: Run,
                  nodes: list[str], rep: int, graceful: bool, window_s: float
                  ) -> dict[str, Any]:
    n = len(nodes)
    victim_name = nodes[-1]
    build(pool, run, nodes[:-1])
    victim.call("build", nodes=[victim_name], **_build_fields(run))
    _form(pool, [*pool.workers, victim], n, f"{backend.name} recovery set-up")
    window = backend.open_window(run, pool)
    until = time.monotonic() + window_s
    pool.all("watch", until=until, interval=DETECT_POLL, rejoin=graceful)
    t_lost = time.monotonic()
    if graceful:
        victim.call("shutdown", nodes=[victim_name], forget=True)
    else:
        os.kill(victim.pid, signal.SIGKILL)
    watched = collect(pool.workers, window_s + ROUND_BOUND)
    seen = [r["t_seen"] - t_lost for r in watched if r.get("t_seen") is not None]
    row: dict[str, Any] = {"n": n, "rep": rep, "survivors": n - 1, "signalled": len(seen),
                           "window_s": window_s, "trigger": "shutdown()" if graceful
                           else "SIGKILL"}
    if seen:
        row["seen_first_s"], row["seen_all_s"] = min(seen), max(seen)
    if graceful:
        _check(watched, n - 1, f"{backend.name} recovery")
        row["new_round_s"] = max(r["t_done"] for r in watched) - t_lost
    else:
        start = time.monotonic() + START_DELAY
        pool.all("rendezvous", start_at=start)
        rejoined = collect(pool.workers)
        _check(rejoined, n - 1, f"{backend.name} recovery re-entry")
        row["reentry_to_round_s"] = max(r["t_done"] for r in rejoined) - start
        row["reentered_after_s"] = start - t_lost
    time.sleep(SETTLE)
    row.update(backend.close_window(window, pool))
    return row


# --------------------------------------------------------------------------- scale-up


def scale_up(backend: Backend, pool: Pool, extra: Extra, n: int, reps: int
             ) -> list[dict[str, Any]]:
    """A late node calls ``next_rendezvous()``: members see it, the N+1 round forms.

    torch's backends run with rank 0's store sharing switched off here.  With it
    on (the default), the late node waits for the bootstrap keys of the new
    round, which the old rank 0 never writes (it keeps its first round's
    bootstrap info), and fails after the store timeout: 60 s for c10d, 300 s
    for etcd-v2.  The report says so; timing that would time only the bug.
    """
    out = []
    for rep in range(reps):
        nodes = node_names(n + 1)
        run = backend.new_run(Timing(n, n + 1, keep_alive=60), nodes)
        if backend.name != "k8s":
            run.env = {SHARE_STORE_OFF: "1"}
        late_worker = extra.get()
        try:
            out.append(_scale_once(backend, pool, late_worker, run, nodes, rep))
        finally:
            teardown(backend, run, [*pool.workers, late_worker])
    return out


def _scale_once(backend: Backend, pool: Pool, late_worker: WorkerProcess, run: Run,
                nodes: list[str], rep: int) -> dict[str, Any]:
    n = len(nodes) - 1
    late = nodes[-1]
    build(pool, run, nodes[:-1])
    late_worker.call("build", nodes=[late], **_build_fields(run))
    _form(pool, pool.workers, n, f"{backend.name} scale-up set-up")
    window = backend.open_window(run, pool)
    pool.all("watch", until=time.monotonic() + 30, interval=DETECT_POLL, rejoin=True)
    t_arrive = time.monotonic() + 0.05
    late_worker.call("rendezvous", start_at=t_arrive)
    results = collect([*pool.workers, late_worker])
    _check(results, n + 1, f"{backend.name} scale-up")
    seen = [r["t_seen"] - t_arrive for r in results if r.get("t_seen") is not None]
    time.sleep(SETTLE)
    row: dict[str, Any] = {
        "n": n, "rep": rep, "members": n, "signalled": len(seen),
        "seen_first_s": min(seen) if seen else None,
        "seen_all_s": max(seen) if len(seen) == n else None,
        "new_round_s": max(r["t_done"] for r in results) - t_arrive,
        **backend.close_window(window, pool)}
    return row


# --------------------------------------------------------------------------- steady state


def steady_state(backend: Backend, pool: Pool, n: int, seconds: float, timing: Timing,
                 ) -> dict[str, Any]:
    """Members of a formed round idle for ``seconds``, polling like torch's agent (0.1 s)."""
    nodes = node_names(n)
    run = backend.new_run(timing, nodes)
    try:
        build(pool, run, nodes)
        _form(pool, pool.workers, n, f"{backend.name} steady-state set-up")
        window = backend.open_window(run, pool)
        begun = time.monotonic()
        pool.all("watch", until=begun + seconds, interval=0.1, rejoin=False)
        results = collect(pool.workers, seconds + 60)
        elapsed = time.monotonic() - begun
        measured = backend.close_window(window, pool)
    finally:
        teardown(backend, run, pool.workers)
    signalled = sum(1 for r in results if r.get("t_seen") is not None)
    errors = [r["watch_error"] for r in results if "watch_error" in r]
    if signalled or errors:
        raise WorkerError(f"{backend.name} idle: {signalled} spurious signals, errors {errors[:1]}")
    minutes = elapsed / 60
    return {"n": n, "seconds": elapsed, "keep_alive_s": timing.keep_alive,
            "watch_timeout_s": timing.watch_timeout,
            "requests_per_member_minute": measured["requests"] / n / minutes,
            "server_cpu_s_per_minute": measured["server_cpu_s"] / minutes, **measured}


# --------------------------------------------------------------------------- pod deletion


def recovery_pod_deleted(backend: K8sBackend, pool: Pool, extra: Extra, n: int, reps: int,
                         timing: Timing, log_dir: Path) -> list[dict[str, Any]]:
    """k8s with the operator: the lost member's Pod is deleted and its process killed.

    Nothing in the handler says goodbye; the operator sees the Pod go (a watch
    event), removes the member with one compare-and-set and bumps the signal.
    Pods are real Pod objects whose status the benchmark sets, as a kubelet would.
    """
    from controlplane.kubelet import Kubelet  # noqa: PLC0415 - only this scenario needs it

    cp = backend.control_plane
    out = []
    with backend.operator(log_dir) as operator:
        op_pid = operator.pid
        for rep in range(reps):
            nodes = node_names(n)
            run = backend.new_run(timing, nodes)
            run.pods = True
            assert run.namespace is not None
            kubelet = Kubelet(cp.api, run.namespace)
            for node in nodes:
                kubelet.create(node, run.name)
            victim = extra.get()
            try:
                build(pool, run, nodes[:-1])
                victim.call("build", nodes=[nodes[-1]], **_build_fields(run))
                _form(pool, [*pool.workers, victim], n, "k8s pod-deletion set-up")
                window = backend.open_window(run, pool)
                cpu_before = cpu_seconds(op_pid)
                pool.all("watch", until=time.monotonic() + 10, interval=DETECT_POLL, rejoin=True)
                t_lost = time.monotonic()
                kubelet.delete(nodes[-1])
                os.kill(victim.pid, signal.SIGKILL)
                watched = collect(pool.workers, 10 + ROUND_BOUND)
                _check(watched, n - 1, "k8s pod-deletion recovery")
                seen = [r["t_seen"] - t_lost for r in watched if r.get("t_seen") is not None]
                time.sleep(SETTLE)
                out.append({"n": n, "rep": rep, "survivors": n - 1, "signalled": len(seen),
                            "trigger": "Pod deleted", "window_s": 10.0,
                            "seen_first_s": min(seen) if seen else None,
                            "seen_all_s": max(seen) if len(seen) == n - 1 else None,
                            "new_round_s": max(r["t_done"] for r in watched) - t_lost,
                            "operator_cpu_s": cpu_seconds(op_pid) - cpu_before,
                            "operator_rss_mib": rss_bytes(op_pid) / 2**20,
                            **backend.close_window(window, pool)})
            finally:
                teardown(backend, run, [*pool.workers, victim])
                extra.stop()
    return out


# --------------------------------------------------------------------------- operator at load


def operator_load(
        backend: K8sBackend, runs: int, members: int, window_s: float, losses: int,
        log_dir: Path) -> dict[str, Any]:
    """The operator watching ``runs`` running rounds of ``members`` each, then losing pods.

    Members are simulated on the API server, not run as handlers (1,600 handlers do
    not fit two cores): each run gets a sealed status, and every member its Pod
    (Running, as a kubelet would report it) and its Lease, made by the handler's own
    LeaseKeeper.  Leases are long (600 s), so none expires during the measurement.
    Measured: the operator's start-up until idle, its CPU over an idle window, its
    memory, and how long one pod deletion takes to show in the run's status.
    """
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

    from elasticrun.api.gateway import RunGateway  # noqa: PLC0415
    from elasticrun.api.kube import run_path  # noqa: PLC0415
    from elasticrun.api.model import (  # noqa: PLC0415
        Participant,
        RunStatus,
        StoreAddress,
        now,
        parse_run,
    )
    from elasticrun.handler.lease import LeaseKeeper  # noqa: PLC0415

    from controlplane.kubelet import Kubelet  # noqa: PLC0415

    cp = backend.control_plane
    namespace = f"bench-load-{int(time.time()) % 100000}"
    cp.api.request("POST", "/api/v1/namespaces", body={
        "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    kubelet = Kubelet(cp.api, namespace)
    names = [f"load-{i:03d}" for i in range(runs)]

    def populate(name: str) -> None:
        from elasticrun.api.model import RunSpec, new_run_manifest  # noqa: PLC0415

        spec = RunSpec(min_nodes=members, max_nodes=members, join_timeout=600,
                       last_call_timeout=1, heartbeat_timeout=600, lease_renew_interval=300)
        created = cp.api.request("POST", f"/apis/elasticrun.dev/v1alpha1/namespaces/{namespace}"
                                 "/elasticruns", body=new_run_manifest(name, namespace, spec))
        nodes = [f"{name}-m{j}" for j in range(members)]
        for node in nodes:
            kubelet.create(node, name)
            LeaseKeeper(RunGateway(cp.api, namespace, name), node, 600, 300,
                        created["metadata"]["uid"]).acquire(None)
        participants = tuple(Participant(name=node, rank=j, address="127.0.0.1",
                                         store_port=20000 + j, joined_round=1, pod=node)
                             for j, node in enumerate(nodes))
        status = RunStatus(phase="Running", round=1, signal=1, participants=participants,
                           store=StoreAddress("127.0.0.1", 20000), sealed_at=now())
        cp.api.request("PUT", run_path(namespace, name, "status"), body={
            "apiVersion": "elasticrun.dev/v1alpha1", "kind": "ElasticRun",
            "metadata": {"name": name, "namespace": namespace,
                         "resourceVersion": created["metadata"]["resourceVersion"]},
            "status": status.to_dict()})

    began = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(populate, names))
    populated_s = time.monotonic() - began
    started = time.monotonic()
    with backend.operator(log_dir, [namespace]) as operator:
        pid = operator.pid
        wait_quiet(pid, bound=180.0)
        startup_s = time.monotonic() - started
        startup_cpu = cpu_seconds(pid)
        cpu0, t0 = cpu_seconds(pid), time.monotonic()
        time.sleep(window_s)
        idle_cpu = (cpu_seconds(pid) - cpu0) / (time.monotonic() - t0)
        rss = rss_bytes(pid)
        detect = []
        for k in range(losses):
            name = names[(k * runs) // max(1, losses)]
            victim = f"{name}-m{members - 1 - k % members}"
            t_lost = time.monotonic()
            kubelet.delete(victim)
            deadline = t_lost + 30
            while time.monotonic() < deadline:
                status = parse_run(cp.api.request("GET", run_path(namespace, name))).status
                if status.participant(victim) is None:
                    detect.append(time.monotonic() - t_lost)
                    break
                time.sleep(0.02)
            time.sleep(1.0)
    return {"runs": runs, "members": members, "objects": runs * (1 + 2 * members),
            "populate_s": populated_s, "startup_s": startup_s, "startup_cpu_s": startup_cpu,
            "idle_cpu_fraction": idle_cpu, "idle_window_s": window_s,
            "rss_mib": rss / 2**20, "pod_loss_s": detect, "losses": losses}
