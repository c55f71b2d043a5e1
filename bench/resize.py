"""Resize: a running round grows or shrinks, side by side with torch's ``c10d``.

    python bench/run.py --only resize --column before   # this scenario alone, merged
                                                        # into docs/benchmarks.json

Every node runs torch's agent loop (``agent`` in ``bench.worker``): it polls
``num_nodes_waiting()`` every 0.1 s and re-enters ``next_rendezvous()`` when it
is > 0, each entry recorded.  From those records :func:`outcome` computes the
two numbers a user pays for a resize: how long after the last new agent
started (or after the pod was deleted) every node holds the round of the new
size, and how many times the old members restarted their workers for it.

On ``k8s`` the operator runs, and the run's pods are Pod objects on the API
server, named as the nodes' ``POD_NAME``.  With an owner (``owner``), they
belong to a ``batch/v1`` Job, whose ``spec.parallelism`` the scenario patches
as Kueue or a user would; no Job controller runs, the pods are played here.
Without one (``no owner``), the same pods carry only the run label.  ``c10d``
has neither: its last call is all it has to wait for newcomers with.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.backends import SHARE_STORE_OFF, Backend, K8sBackend, Run, Timing
from bench.pool import Pool, WorkerProcess
from bench.scenarios import (
    Extra,
    ScenarioError,
    _build_fields,
    build,
    collect,
    node_names,
    teardown,
)

#: torch's default last call, for every backend: the wait a newcomer-less rule falls back on.
LAST_CALL = 30
#: The last call the round before a resize forms with (then :data:`LAST_CALL`).
SETUP_LAST_CALL = 1
#: torchrun's agent looks at ``num_nodes_waiting()`` this often (``--monitor-interval``).
MONITOR_INTERVAL = 0.1
#: New pods exist this long before their agents start (a real pod also pulls, imports torch).
LEAD = 1.0
#: After a round of the new size, a node keeps watching this long for a further restart.
SETTLE = 1.5
#: Lost-member settings of the scale-down: keep-alive every 1 s, dead after 3.
DOWN_KEEP_ALIVE = 1
#: Bound on one resize, after its last agent started.
BOUND = LAST_CALL + 45.0
JOB = "trainer"


@dataclass(frozen=True)
class Case:
    """One resize: the run's bounds, the round before and the size it goes to."""

    key: str
    kind: str  # "up" | "down" | "first"
    min_nodes: int
    max_nodes: int
    before: int  # members of the running round (0: first formation)
    after: int  # world size of the round the resize ends in
    spacing: float = 1.0  # seconds between the new agents' starts
    title: str = ""

    @property
    def newcomers(self) -> int:
        return max(0, self.after - self.before)


CASES = (
    Case("up-2-4", "up", 2, 4, 2, 4, 1.0, "scale-up 2 → 4, run `2:4`"),
    Case("up-2-4-of-8", "up", 2, 8, 2, 4, 1.0, "scale-up 2 → 4, run `2:8`"),
    Case("up-2-8", "up", 2, 8, 2, 8, 1.0, "scale-up 2 → 8, run `2:8`"),
    Case("down-4-3", "down", 2, 4, 4, 3, 0.0, "scale-down 4 → 3, run `2:4`"),
    Case("first-4", "first", 2, 8, 0, 4, 0.5, "first formation, Job of 4, run `2:8`"),
)
#: How each backend is run: k8s with and without an owner, c10d as it is.
VARIANTS = {"k8s": ("owner", "no owner"), "c10d": ("c10d",)}


@dataclass(frozen=True)
class ResizePlan:
    reps: int = 2
    workers: int = 2
    cases: tuple[Case, ...] = CASES

    @classmethod
    def quick(cls) -> ResizePlan:
        return cls(reps=1)


# --------------------------------------------------------------------------- pure


def outcome(records: Iterable[dict[str, Any]], members: Collection[str],
            newcomers: Collection[str], target: int, t_from: float) -> dict[str, Any]:
    """What one resize cost, from the agents' records (``agent`` in ``bench.worker``).

    ``members`` were in the running round (for a scale-down: the survivors),
    ``newcomers`` start during the resize; ``t_from`` is the last newcomer's
    start, or the moment the pod was deleted.  Every entry of a member's
    ``next_rendezvous()`` is one restart of its workers.  The resize is done
    when every node's last round has ``target`` nodes; ``round_s`` is when the
    last of them returned from it.
    """
    by_node = {r["node"]: r for r in records if r.get("kind") == "agent"}
    expected = [*members, *newcomers]
    errors = [f"{n}: {e['error']}" for n in expected for e in by_node.get(n, {}).get("rounds", [])
              if "error" in e]
    errors += [f"{n}: {by_node[n]['watch_error']}" for n in expected
               if "watch_error" in by_node.get(n, {})]
    errors += [f"{n}: no record" for n in expected if n not in by_node]
    rounds = {n: by_node[n]["rounds"] for n in expected if n in by_node}
    last = {n: r[-1] for n, r in rounds.items() if r}
    formed = not errors and len(last) == len(expected) and all(
        e.get("world") == target for e in last.values())
    row: dict[str, Any] = {"formed": formed, "members": len(members),
                           "newcomers": len(newcomers), "target": target}
    if errors:
        row["errors"] = errors[:5]
    if formed:
        row["round_s"] = max(e["t_done"] for e in last.values()) - t_from
    restarts = [len(rounds.get(m, [])) for m in members]
    if restarts:
        row["restarts"], row["restarts_min"] = max(restarts), min(restarts)
    extra = [len(rounds[n]) - 1 for n in newcomers if rounds.get(n)]
    if extra:
        row["newcomer_restarts"] = max(extra)
    row["sizes"] = sorted({int(e["world"]) for m in members for e in rounds.get(m, [])
                           if "world" in e})
    firsts = [rounds[m][0] for m in members if rounds.get(m)]
    seen = [e["t_start"] - t_from for e in firsts if e["cause"] == "signal"]
    row["signalled"] = len(seen)
    if seen and len(seen) == len(members):
        row["seen_all_s"] = max(seen)
    fallback = [e["t_start"] for e in firsts if e["cause"] == "fallback"]
    if fallback and formed:
        row["reentry_to_round_s"] = max(e["t_done"] for e in last.values()) - min(fallback)
    return row


def starts(newcomers: Sequence[str], first: float, spacing: float) -> dict[str, float]:
    """Each newcomer's start, ``spacing`` apart from ``first``."""
    return {name: first + i * spacing for i, name in enumerate(newcomers)}


# --------------------------------------------------------------------------- k8s owner


@dataclass
class Pods:
    """The run's Pod objects and, with ``owned``, the Job they belong to.

    Pods are made Running by :class:`controlplane.kubelet.Kubelet`, then given
    the Job as their controller owner, as the Job controller would have.
    """

    backend: K8sBackend
    run: Run
    owned: bool
    job_uid: str = ""
    names: list[str] = field(default_factory=list)

    @property
    def _namespace(self) -> str:
        assert self.run.namespace is not None
        return self.run.namespace

    def _jobs(self) -> str:
        return f"/apis/batch/v1/namespaces/{self._namespace}/jobs"

    def kubelet(self) -> Any:
        from controlplane.kubelet import Kubelet  # noqa: PLC0415 - k8s only

        return Kubelet(self.backend.control_plane.api, self._namespace)

    def job(self, parallelism: int) -> None:
        """An Indexed Job of ``parallelism`` = ``completions``, as Kueue's elastic Jobs are."""
        if not self.owned:
            return
        from elasticrun.api import crd  # noqa: PLC0415

        from controlplane.kubelet import UNSCHEDULED  # noqa: PLC0415

        body = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": JOB},
                "spec": {"parallelism": parallelism, "completions": parallelism,
                         "completionMode": "Indexed",
                         # The run label on the template: the Job makes this run's pods.
                         "template": {"metadata": {"labels": {crd.RUN_LABEL: self.run.name}},
                                      "spec": {
                             "restartPolicy": "Never", "schedulerName": UNSCHEDULED,
                             "containers": [{"name": "trainer", "image": "trainer:latest"}]}}}}
        made = self.backend.control_plane.api.request("POST", self._jobs(), body=body)
        self.job_uid = made["metadata"]["uid"]

    def scale(self, parallelism: int) -> None:
        """Patch the Job's size (completions with it: an elastic Indexed Job keeps them equal)."""
        if self.owned:
            self.backend.control_plane.api.request(
                "PATCH", f"{self._jobs()}/{JOB}", body={"spec": {
                    "parallelism": parallelism, "completions": parallelism}},
                content_type="application/merge-patch+json")

    def add(self, names: Iterable[str]) -> None:
        kubelet = self.kubelet()
        for name in names:
            kubelet.create(name, self.run.name)
            self.names.append(name)
            if self.owned:
                self.backend.control_plane.api.request(
                    "PATCH", kubelet.path(name), body={"metadata": {"ownerReferences": [{
                        "apiVersion": "batch/v1", "kind": "Job", "name": JOB,
                        "uid": self.job_uid, "controller": True,
                        "blockOwnerDeletion": True}]}},
                    content_type="application/merge-patch+json")

    def delete(self, name: str) -> None:
        self.kubelet().delete(name)

    def desired(self) -> int | None:
        """The desired size in the run's status (None when the operator wrote none)."""
        from elasticrun.api.kube import run_path  # noqa: PLC0415
        from elasticrun.api.model import parse_run  # noqa: PLC0415

        status = parse_run(self.backend.control_plane.api.request(
            "GET", run_path(self._namespace, self.run.name))).status
        return status.desired.size if status.desired is not None else None


# --------------------------------------------------------------------------- scenario


def _on_workers(workers: Sequence[WorkerProcess], shares: Sequence[Sequence[str]],
                names: Collection[str]) -> list[tuple[WorkerProcess, list[str]]]:
    """The workers holding any of ``names``, each with its part of them."""
    out = []
    for worker, share in zip(workers, shares, strict=True):
        mine = [n for n in share if n in names]
        if mine:
            out.append((worker, mine))
    return out


def _send_all(parts: Sequence[tuple[WorkerProcess, list[str]]], cmd: str,
              **fields: Any) -> None:
    ids = [(w, w.send(cmd, nodes=names, **fields)) for w, names in parts]
    for worker, msg_id in ids:
        worker.receive(msg_id, 60)


def _form(parts: Sequence[tuple[WorkerProcess, list[str]]], world: int, what: str) -> None:
    """The running round the resize starts from."""
    _send_all(parts, "rendezvous", start_at=time.monotonic() + 0.3)
    results = collect([w for w, _ in parts])
    bad = [r for r in results if r.get("world") != world]
    if bad:
        raise ScenarioError(f"{what}: {bad[0].get('node')} got {bad[0]}")


@dataclass
class Setting:
    """One repetition's run, its nodes and where they are."""

    case: Case
    run: Run
    pods: Pods | None
    members: list[str]  # in the round before that stay in it
    newcomers: list[str]
    victim: str | None  # the member whose pod is deleted (scale-down)
    victim_worker: WorkerProcess | None
    parts: list[tuple[WorkerProcess, list[str]]]  # pool workers and their nodes


def _set_up(backend: Backend, pool: Pool, extra: Extra, case: Case, variant: str) -> Setting:
    """The run, its owner and pods, the nodes built and the round before formed.

    The round before forms with a last call of :data:`SETUP_LAST_CALL`; then
    every node gets :data:`LAST_CALL`, as if the run had started with it long ago.
    """
    nodes = node_names(max(case.before, case.after))
    down = case.kind == "down"
    timing = Timing(case.min_nodes, case.max_nodes,
                    last_call=SETUP_LAST_CALL if case.before else LAST_CALL,
                    keep_alive=DOWN_KEEP_ALIVE if down else 60)
    run = backend.new_run(timing, nodes)
    pods = Pods(backend, run, variant == "owner") if isinstance(backend, K8sBackend) else None
    run.env = {SHARE_STORE_OFF: "0" if pods else "1"}  # see scenarios.scale_up
    run.pods = pods is not None
    victim = nodes[-1] if down else None
    setting = Setting(case, run, pods, [n for n in nodes[:case.before] if n != victim],
                      nodes[case.before:case.after], victim, extra.get() if down else None, [])
    if pods is not None:
        pods.job(case.after if case.kind == "first" else case.before)
        pods.add(nodes[:case.before or case.after])
    shares = build(pool, run, [n for n in nodes if n != victim])
    setting.parts = _on_workers(pool.workers, shares, nodes)
    if setting.victim_worker is not None and victim is not None:
        setting.victim_worker.call("build", nodes=[victim], **_build_fields(run))
    if case.before:
        before = _on_workers(pool.workers, shares, nodes[:case.before])
        if setting.victim_worker is not None and victim is not None:
            before.append((setting.victim_worker, [victim]))
        _form(before, case.before, f"{backend.name} {case.key} set-up")
        if pods is not None:
            pods.backend.set_last_call(run, LAST_CALL)
        else:
            _send_all(setting.parts, "last_call", seconds=LAST_CALL)
    return setting


def _resize(s: Setting, bound: float) -> dict[str, Any]:
    """Start the agents, resize, and read what they went through."""
    case, pods = s.case, s.pods
    first = time.monotonic() + LEAD
    if case.kind == "up" and pods is not None:
        pods.scale(case.after)
        pods.add(s.newcomers)
    when = starts(s.newcomers, first, case.spacing)
    t_from = max(when.values()) if when else first
    fallback = None
    if case.kind == "down" and pods is None:  # never signalled: re-enter after the expiry
        fallback = first + DOWN_KEEP_ALIVE * 3 + 2.0
    until = t_from + bound
    watching = [(w, [n for n in names if n in {*s.members, *s.newcomers}])
                for w, names in s.parts]
    watching = [(w, names) for w, names in watching if names]
    for worker, names in watching:
        worker.call("agent", nodes=names, until=until, interval=MONITOR_INTERVAL,
                    target=case.after, settle=SETTLE, fallback_at=fallback,
                    start_at={n: when[n] for n in names if n in when})
    if s.victim is not None and s.victim_worker is not None:
        time.sleep(max(0.0, first - time.monotonic()))
        t_from = time.monotonic()
        if pods is not None:
            pods.scale(case.after)
            pods.delete(s.victim)
        os.kill(s.victim_worker.pid, signal.SIGKILL)
    records = collect([w for w, _ in watching], until - time.monotonic() + 30)
    row = outcome(records, s.members, s.newcomers, case.after, t_from)
    if pods is not None:
        row["desired_in_status"] = pods.desired()
    return row


def resize_once(backend: Backend, pool: Pool, extra: Extra, case: Case, variant: str
                ) -> dict[str, Any]:
    """One repetition of ``case``: set up, form the round before, resize, read the records."""
    setting: Setting | None = None
    try:
        setting = _set_up(backend, pool, extra, case, variant)
        return _resize(setting, BOUND)
    finally:
        if setting is not None:
            teardown(backend, setting.run, [w for w in [*pool.workers, extra.worker]
                                            if w is not None and w.alive()])
        if case.kind == "down":
            extra.stop()


def run_backend(backend: Backend, plan: ResizePlan, log_dir: Any,
                errors: list[str]) -> list[dict[str, Any]]:
    """Every case and variant of ``plan`` on one backend (started and stopped by the caller)."""
    import sys  # noqa: PLC0415

    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        pool = Pool(plan.workers, log_dir, f"{backend.name}-resize")
        stack.callback(pool.stop)
        extra = Extra(log_dir, f"{backend.name}-resize")
        stack.callback(extra.stop)
        if isinstance(backend, K8sBackend):
            stack.enter_context(backend.operator(log_dir))
        for case in plan.cases:
            for variant in VARIANTS[backend.name]:
                for rep in range(plan.reps):
                    began = time.monotonic()
                    row: dict[str, Any] = {"case": case.key, "variant": variant, "rep": rep}
                    try:
                        row.update(resize_once(backend, pool, extra, case, variant))
                    except Exception as exc:  # recorded; the other cases still run
                        row.update(formed=False, errors=[f"{type(exc).__name__}: {exc}"])
                        pool.restart()
                    if not row["formed"]:
                        errors.append(f"{case.key} ({variant}) rep {rep}: "
                                      f"{(row.get('errors') or ['did not form'])[0]}")
                    row["load"] = round(os.getloadavg()[0], 2)
                    rows.append(row)
                    print(f"  {backend.name} {case.key} ({variant}) rep {rep}: "
                          f"{time.monotonic() - began:.1f}s, round after "
                          f"{row.get('round_s', float('nan')):.2f}s, restarts "
                          f"{row.get('restarts')}", file=sys.stderr, flush=True)
    return rows


def measure(names: Sequence[str], plan: ResizePlan, work: Any, log_dir: Any
            ) -> dict[str, Any]:
    """The resize scenario on each backend of ``names`` that has variants, one after another."""
    from bench import backends  # noqa: PLC0415

    out: dict[str, Any] = {}
    for name in names:
        if name not in VARIANTS:
            continue
        backend = backends.make(name, work)
        errors: list[str] = []
        backend.start(log_dir)
        try:
            versions = backend.versions()
            rows = run_backend(backend, plan, log_dir, errors)
        finally:
            backend.stop()
        out[name] = {"rows": rows, "errors": errors, "versions": versions}
    return out
