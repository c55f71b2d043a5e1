#!/usr/bin/env python3
"""Rounds of 64 to 2,048 nodes: what the API server does per round, and formation times.

    python bench/scale.py            # make bench-scale: N = 64 .. 2,048 (under 20 min)
    python bench/scale.py --quick    # smoke: N = 8, 16, one of each

Three measurements, one control plane, one operator (large runs leave the seal
to it, :func:`elasticrun.api.rounds.nodes_defer_seal`):

* **mixed rounds**: N nodes of which a sample are real handlers (threads in
  bench workers) and the rest simulated nodes (:mod:`bench.simnode`, asyncio,
  the same requests on the wire); the server's requests, bytes and CPU per round.
* **real rounds**: every node a real handler, as-is and with reverse DNS
  neutralised (:mod:`bench.dnsshim`), formation with and without building the
  handlers.
* **c10d**: torch's own backend on the same rounds, as-is and DNS-neutral,
  at the sizes where it completes.

Each mixed round then admits a newcomer (a real handler; the run has room for
N + 1) and loses a member of the round it joined, beside the floor
(:mod:`bench.floor`) on the same server: each of its phases the median of
:attr:`Plan.floor_reps` rounds after the mixed round (:func:`floor_fields`),
since one round alone is too noisy to divide by; and in runs of their own, with
the shortest heartbeat, a **frozen member** stops renewing its Lease: its
removal and the survivors' next round are timed.

Results: ``<out>/benchmarks-scale.json`` and ``<out>/benchmarks-scale.md`` with
a log-log plot; ``<out>/benchmarks.md`` embeds the latter (:mod:`bench.report`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from elasticrun.api import crd, rounds  # noqa: E402
from elasticrun.api.change import change_status  # noqa: E402
from elasticrun.api.gateway import RunGateway  # noqa: E402
from elasticrun.api.kube import lease_path, run_path  # noqa: E402
from elasticrun.api.model import ElasticRun, RunStatus, now, parse_run  # noqa: E402
from elasticrun.api.naming import lease_name  # noqa: E402
from elasticrun.handler.session import SEAL_MANAGER  # noqa: E402

from bench import backends, dnsshim, floor, report, scale_report, scenarios  # noqa: E402
from bench.backends import K8sBackend, Run, Timing  # noqa: E402
from bench.membership import monotonic_of, removal, until_all  # noqa: E402
from bench.pool import Pool, worker_env  # noqa: E402
from bench.proc import cpu_seconds, machine, stop_pid  # noqa: E402
from bench.run import FLOOR_PHASES, arguments, commit, directories, versions  # noqa: E402
from bench.servers import crd_files  # noqa: E402
from bench.stats import summary  # noqa: E402
from controlplane import apiserver  # noqa: E402


@dataclass(frozen=True)
class Plan:
    mixed_sizes: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048)
    #: Real handlers in each mixed round (the rest are simulated).
    sample: int = 16
    real_sizes: tuple[int, ...] = (64, 128, 256)
    c10d_sizes: tuple[int, ...] = (64, 128, 256)
    #: Sizes at which ``--baseline`` measures the protocol before this one.
    baseline_sizes: tuple[int, ...] = (128, 256)
    #: Sizes of the frozen member (:func:`frozen_round`): every node renews every second.
    #: From ``rounds.DEFER_SEAL_FROM`` on, so that nodes leave the seal to the operator, as
    #: simulated nodes always do.
    frozen_sizes: tuple[int, ...] = (64, 128)
    reps: int = 2
    workers: int = 4
    sim_processes: int = 4
    formation_bound: float = 120.0
    #: Floor rounds (:mod:`bench.floor`) after each mixed round, reported as their median
    #: per phase, as ``make bench`` does (:attr:`bench.run.Plan.floor_reps`): there, one
    #: round's formation at N = 32 measured 0.146 s in one run and 0.283 s in the next, so
    #: a single round can move ours / floor by 2x on its own.
    floor_reps: int = 3
    #: ``maxNodes`` of one more mixed round each, of the smallest mixed size
    #: (:func:`regimes`): the ways a large run tells its members, which the mixed
    #: rounds reach only at their own sizes, run at a small N.
    regimes: tuple[int, ...] = ()

    @classmethod
    def quick(cls) -> Plan:
        return cls(mixed_sizes=(8, 16), sample=2, real_sizes=(8,), c10d_sizes=(8,),
                   baseline_sizes=(8,), frozen_sizes=(8,), reps=1, workers=2, sim_processes=2,
                   formation_bound=60.0, floor_reps=1,
                   regimes=(rounds.QUIET_WATCH_FROM, rounds.TELL_IN_SLICES_FROM))


#: Simulated nodes renew their Lease at the run's interval, from its creation on; the
#: benchmark's runs renew every two minutes, so that neither a formation's window nor
#: the newcomer's and the loss's after it hold renewals (at 2,048 nodes they take ~1 min).
TIMING_KEEP_ALIVE = 120
#: The real handlers of a mixed round join this long before the simulated ones:
#: rank 0 hosts the round's TCPStore, which the real handlers connect to, and
#: only a real handler serves one.  Newcomers are ranked by their Lease's
#: creationTimestamp (whole seconds), so more than a second makes rank 0 real.
REAL_HEAD_START = 1.5
#: Bound on the survivors' learning of a loss (:func:`loss_round`).
LOSS_BOUND = 30.0
#: The newcomer of every mixed round (:func:`newcomer_round`), a real handler.
NEWCOMER = "node-new"
#: Between a frozen-member run's formation and the freeze: every Lease renewed once.
FROZEN_SETTLE = 2.0
#: The mixed row's field for the median of each floor phase (:data:`bench.run.FLOOR_PHASES`),
#: the names ``bench/scale_report.py`` reads.
FLOOR_FIELDS = dict(zip(FLOOR_PHASES, ("floor_s", "floor_loss_s", "floor_newcomer_s"),
                        strict=True))


def has_room(n: int) -> bool:
    """Whether a round of ``n`` can admit a newcomer: the CRD caps ``maxNodes``."""
    return n < crd.spec_maximum("maxNodes")


def mixed_timing(n: int, max_nodes: int | None = None) -> Timing:
    """A mixed round's run: room for the newcomer (:func:`has_room`), and no last call.

    ``maxNodes = N + 1`` (or ``max_nodes``, a larger run's, :func:`regimes`)
    admits the newcomer into the round; with ``minNodes = N`` and
    ``lastCallTimeoutSeconds = 0`` the N-th request seals the first round as
    ``maxNodes = N`` would, without a last call to wait out.  No owner sets a
    target (``status.desired``), so :func:`~elasticrun.api.rounds.announce_due`
    holds no newcomer back.  The newcomer asks under :func:`newcomer_timing`.
    """
    if max_nodes is None:
        max_nodes = n + 1 if has_room(n) else n
    return Timing(n, max_nodes, last_call=0, keep_alive=TIMING_KEEP_ALIVE)


def newcomer_timing(n: int, bound: float) -> Timing:
    """The mixed round's run once its round of N formed, when the newcomer asks: a last call
    as long as the phase's ``bound``.

    The members keep their places in the round the newcomer joins for one last
    call from the first of them to ask again
    (:func:`~elasticrun.api.rounds.decide_seal`, ``_reforming_since``).  With
    the formation's last call of 0 that grace is none: the newcomer and N - 1
    members back are ``minNodes``, which seals a round of N without the last
    member, a real handler that its worker's thread was slower to bring back
    on a busy machine, or any simulated one.  That member then waits for a
    round of N + 1 which only another restart of every member would form, and
    the members of this phase ask again once.  No time measured includes the
    last call: the round seals the moment every member is back (the rule's
    first case), and a member not back within ``bound`` fails the phase anyway.
    """
    return replace(mixed_timing(n), last_call=math.ceil(bound))


def frozen_timing(n: int) -> Timing:
    """A frozen-member run: the CRD's shortest renewal (1 s) and heartbeat (2 s: it must
    exceed the renewal), and ``minNodes = N - 1`` so that the survivors form a round alone.

    The first round seals at ``maxNodes`` (all N arrive within the last call).
    """
    return Timing(n - 1, n, last_call=5, keep_alive=1, keep_alive_attempts=2)


class SimNodes:
    """Processes of simulated nodes (``python -m bench.simnode``), stopped by PID."""

    def __init__(self, count: int, log_dir: Path, tag: str) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        #: Which process plays each node.
        self.where: dict[str, subprocess.Popen[str]] = {}
        self.logs = [open(log_dir / f"sim-{tag}-{i}.log", "ab")  # noqa: SIM115 - closed in stop
                     for i in range(count)]
        for log in self.logs:
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "bench.simnode"], cwd=ROOT, env=worker_env(),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                start_new_session=True, bufsize=1))
        self.results: list[dict[str, Any]] = []
        #: ``change`` lines: a formed node saw its round change (:mod:`bench.simnode`).
        self.changes: list[dict[str, Any]] = []
        #: ``formed`` lines: a member that rejoined after a change holds the next round.
        self.reformations: list[dict[str, Any]] = []
        #: ``frozen`` lines: a node told to freeze stopped; when its last renewal was written.
        self.frozen: list[dict[str, Any]] = []
        self._changed = threading.Condition()
        self._expected = 0

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def start(self, shares: list[list[str]], config: dict[str, Any]) -> None:
        for proc, share in zip(self.procs, shares, strict=True):
            assert proc.stdin is not None
            proc.stdin.write(json.dumps({**config, "nodes": share}) + "\n")
            proc.stdin.flush()
            self.where.update(dict.fromkeys(share, proc))
            self._expected += len(share)
            threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        """Every line of one process: its nodes' formations, then the members' changes."""
        assert proc.stdout is not None
        kinds = {"change": self.changes, "formed": self.reformations, "frozen": self.frozen}
        for line in proc.stdout:
            with self._changed:
                got = json.loads(line)
                kinds.get(got.get("event"), self.results).append(got)
                self._changed.notify_all()

    def _wait(self, enough: Any, bound: float) -> None:
        deadline = time.monotonic() + bound
        with self._changed:
            while not enough() and time.monotonic() < deadline:
                self._changed.wait(min(0.1, max(0.0, deadline - time.monotonic())))

    def collect(self, bound: float) -> list[dict[str, Any]]:
        """The formation of every simulated node (those that reported within ``bound``)."""
        self._wait(lambda: len(self.results) >= self._expected, bound)
        with self._changed:
            return list(self.results)

    def changed(self, who: set[str], held: int, bound: float) -> dict[str, float]:
        """When each of ``who`` learnt that its round ``held`` changed (those that did within
        ``bound``)."""
        def told() -> dict[str, float]:
            return {c["node"]: float(c["t"]) for c in self.changes
                    if c["node"] in who and c.get("round") == held}
        self._wait(lambda: len(told()) >= len(who), bound)
        with self._changed:
            return told()

    def reformed(self, who: set[str], bound: float) -> dict[str, dict[str, Any]]:
        """The next round of each of ``who`` after its change (those reported within ``bound``,
        errors included)."""
        def held() -> dict[str, dict[str, Any]]:
            return {r["node"]: r for r in self.reformations if r["node"] in who}
        self._wait(lambda: len(held()) >= len(who), bound)
        with self._changed:
            return held()

    def freeze(self, node: str, bound: float) -> float | None:
        """Make ``node`` stop renewing and watching; when its last renewal was written."""
        proc = self.where[node]
        assert proc.stdin is not None
        proc.stdin.write(json.dumps({"freeze": node}) + "\n")
        proc.stdin.flush()

        def answer() -> list[dict[str, Any]]:
            return [f for f in self.frozen if f["node"] == node]
        self._wait(lambda: bool(answer()), bound)
        with self._changed:
            got = answer()
        return got[0]["t_renewed"] if got else None

    def stop(self) -> None:
        for proc in self.procs:
            if proc.stdin is not None and not proc.stdin.closed:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                stop_pid(proc.pid, timeout=5)
        for log in self.logs:
            log.close()


def _server_state(backend: K8sBackend) -> dict[str, float]:
    text = backend.control_plane.metrics()
    watch = {g: apiserver.watch_counters(text, g) for g in apiserver.RUN_GROUPS}
    return {"response_bytes": apiserver.response_bytes(text),
            "watch_bytes": sum(w["bytes"] for w in watch.values()),
            "watch_events": sum(w["events"] for w in watch.values()),
            "server_cpu_s": backend.server_cpu()}


def _object_facts(backend: K8sBackend, run: Run) -> dict[str, Any]:
    """Size of the ElasticRun as stored once the round formed, and its field managers."""
    assert run.namespace is not None
    raw = backend.control_plane.api.request("GET", run_path(run.namespace, run.name))
    managers = (raw.get("metadata") or {}).get("managedFields") or []
    return {"object_bytes": len(json.dumps(raw, separators=(",", ":"))),
            "field_managers": sorted({str(m.get("manager")) for m in managers}),
            "managed_fields_entries": len(managers)}


class _RunStatus:
    """The run's status as :func:`~elasticrun.api.change.change_status` reads and writes it,
    over the coordinator's client: the departing node's writes, made for it."""

    def __init__(self, gateway: RunGateway) -> None:
        self.gateway = gateway

    def read(self, bound: float | None = None) -> ElasticRun | None:
        raw = self.gateway.read()
        return None if raw is None else parse_run(raw)

    def replace_status(self, run: ElasticRun, status: RunStatus,
                       bound: float | None = None) -> ElasticRun | None:
        raw = self.gateway.replace_status(run.resource_version, status.to_dict(), SEAL_MANAGER)
        return None if raw is None else parse_run(raw)


def lose_member(backend: K8sBackend, run: Run, node: str) -> None:
    """``node`` is lost the way a handler's ``shutdown()`` loses it when its join request
    cannot be withdrawn: its Lease deleted (as the floor's loss), then its departure
    (:func:`~elasticrun.api.rounds.leave`) written in one compare-and-set.

    The operator would count a deleted Lease as a loss only after the run's
    heartbeat (``LeaseMissing``, minutes in these runs), and a loss it sees at
    once needs a Pod; the departure is what tells the survivors here, as the
    k8s recovery benchmark's ``shutdown()`` trigger does.
    """
    assert run.namespace is not None
    gateway = RunGateway(backend.control_plane.api, run.namespace, run.name)
    backend.control_plane.api.request(
        "DELETE", lease_path(run.namespace, lease_name(run.name, node)))
    change_status(_RunStatus(gateway),
                  lambda current: rounds.leave(current.status, node, now(), finished=False),
                  what=f"remove {node}")


def loss_round(backend: K8sBackend, pools: list[Pool], sims: SimNodes, run: Run,
               results: list[dict[str, Any]], real: set[str]) -> dict[str, Any]:
    """A simulated member (never rank 0) of the round ``results`` hold is lost: seconds until
    every survivor knew.

    A survivor knows when its ``num_nodes_waiting()`` becomes positive: the
    simulated ones from their run watch, the real handlers (``real``, in
    ``pools``) as the worker's ``watch`` asks it: whenever their cache changes.
    """
    ranks = {r["node"]: r.get("rank") for r in results}
    held = max(int(r["round"]) for r in results if "round" in r)
    victim = next(name for name in sorted(ranks, reverse=True)
                  if name not in real and ranks[name] != 0)
    survivors = set(ranks) - {victim}
    for pool in pools:
        pool.all("watch", until=time.monotonic() + LOSS_BOUND,
                 interval=scenarios.DETECT_POLL, rejoin=False)
    lost_at = time.monotonic()
    lose_member(backend, run, victim)
    simulated = sims.changed(survivors - real, held, LOSS_BOUND)
    workers = [w for pool in pools for w in pool.workers]
    polled = {r["node"]: r["t_seen"] for r in scenarios.collect(workers, LOSS_BOUND + 5)
              if r.get("kind") == "watch" and r.get("t_seen") is not None}
    told = {**simulated, **polled}
    return {"loss_s": until_all(told, survivors, lost_at),
            "loss_real_s": until_all(polled, real, lost_at),
            "loss_told": len(told), "loss_victim": victim, "loss_members": len(ranks)}


def newcomer_round(pool: Pool, late: Pool, sims: SimNodes, members: list[dict[str, Any]],
                   real: set[str], bound: float) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A real handler (:data:`NEWCOMER`, in ``late``) asks to join the formed round of
    ``members``: seconds from its ``next_rendezvous()`` until every member and it hold the
    next round, and what each holds then.

    The members learn of it as torch's agents do (``num_nodes_waiting()``: the
    real handlers poll it, the simulated nodes watch the run) and ask again
    at once; the round seals when all of them are back (see the page).
    """
    everyone = {r["node"] for r in members} | {NEWCOMER}
    pool.all("watch", until=time.monotonic() + bound, interval=scenarios.DETECT_POLL,
             rejoin=True)
    asked = time.monotonic() + scenarios.START_DELAY
    late.all("rendezvous", start_at=asked)
    errors: list[str] = []
    try:
        handlers = scenarios.collect([*pool.workers, *late.workers], bound)
    except scenarios.ScenarioError as exc:
        handlers, errors = [], [str(exc)]
    held = [*handlers, *sims.reformed(everyone - real - {NEWCOMER}, bound).values()]
    errors += [f"{r['node']}: {r['error']}" for r in held if "error" in r]
    placed = {r["node"]: r for r in held if "rank" in r}
    row = {"newcomer_s": until_all({k: r["t_done"] for k, r in placed.items()}, everyone,
                                   asked) if not errors else None,
           "newcomer_worlds": sorted({int(r["world"]) for r in placed.values()}),
           "newcomer_admitted": NEWCOMER in placed, "newcomer_held": len(placed),
           "newcomer_errors": errors[:3]}
    return row, list(placed.values())


def mixed_round(backend: K8sBackend, pool: Pool, late: Pool, log_dir: Path, n: int,
                sample: int, sim_processes: int, operator_pid: int, bound: float,
                max_nodes: int | None = None) -> dict[str, Any]:
    """One round of ``n`` nodes: ``sample`` real handlers, the rest simulated; then a
    newcomer (``late``'s one real handler) joins it, and one member of the next round is lost.
    ``max_nodes``: the run's, when not :func:`mixed_timing`'s own.
    """
    nodes = scenarios.node_names(n)
    real = nodes[:: max(1, n // sample)][:sample]
    simulated = [name for name in nodes if name not in set(real)]
    timing = mixed_timing(n, max_nodes)
    run = backend.new_run(timing, nodes)
    sims = SimNodes(sim_processes, log_dir, f"n{n}")
    try:
        scenarios.build(pool, run, real)
        scenarios.build(late, run, [NEWCOMER])
        audit = apiserver.AuditLog(backend.control_plane.audit_log)
        offset = audit.mark()
        before = _server_state(backend)
        op_cpu = cpu_seconds(operator_pid)
        clients = sum(cpu_seconds(p) for p in [*pool.pids, *sims.pids])
        # Every simulated process is connected and waiting by then.
        start = time.monotonic() + 1.0 + REAL_HEAD_START
        assert run.namespace is not None
        sims.start([simulated[i::sim_processes] for i in range(sim_processes)],
                   {"kubeconfig": backend.control_plane.kubeconfig, "namespace": run.namespace,
                    "run": run.name, "start_at": start,
                    "renew_interval": TIMING_KEEP_ALIVE,
                    "rejoins": 1 if timing.max_nodes > n else 0})  # for the newcomer
        pool.all("rendezvous", start_at=start - REAL_HEAD_START)
        real_results = scenarios.collect(pool.workers, bound)
        sim_results = sims.collect(bound)
        results = real_results + sim_results
        errors = [f"{r['node']}: {r['error']}" for r in results if "error" in r]
        formed = len(results) == n and not errors
        time.sleep(scenarios.SETTLE)
        after = _server_state(backend)
        counted = apiserver.tally(audit.events_since(offset), run.namespace)
        row: dict[str, Any] = {
            "n": n, "max_nodes": timing.max_nodes, "real": len(real),
            "simulated": len(simulated), "formed": formed,
            "errors": errors[:3],
            "latency_s": max(r["t_done"] for r in results) - start if formed else None,
            "first_done_s": min(r["t_done"] for r in results) - start if results else None,
            "real_latency_s": (max(r["t_done"] for r in real_results) - start
                               if formed else None),
            "worlds": sorted({r.get("world") for r in results if "world" in r}),
            "rank0_real": any(r.get("rank") == 0 for r in real_results),
            "requests": counted.total, "writes": counted.writes,
            "lost_cas": counted.conflicts, "by_kind": dict(sorted(counted.by_kind.items())),
            "operator_cpu_s": cpu_seconds(operator_pid) - op_cpu,
            "client_cpu_s": sum(cpu_seconds(p) for p in [*pool.pids, *sims.pids]) - clients,
            **{key: after[key] - before[key] for key in after},
        }
        row["bytes_sent"] = row["response_bytes"] + row["watch_bytes"]
        if formed:
            row.update(_object_facts(backend, run))
            if timing.max_nodes <= n:  # no room for a newcomer: the loss in the round of N
                row.update(loss_round(backend, [pool], sims, run, results, set(real)))
                return row
            backend.set_last_call(run, newcomer_timing(n, bound).last_call)
            joined, held = newcomer_round(pool, late, sims, results, set(real), bound)
            row.update(joined)
            if joined["newcomer_s"] is not None:
                row.update(loss_round(backend, [pool, late], sims, run, held,
                                      {*real, NEWCOMER}))
        return row
    finally:
        scenarios.teardown(backend, run, [*pool.workers, *late.workers])
        sims.stop()
        backend.quiesce(30)


def floor_fields(rounds: Sequence[floor.Floor]) -> dict[str, Any]:
    """Floor rounds at one N as a mixed row's fields (:data:`FLOOR_FIELDS`).

    Each phase is the median of the rounds that timed it, and None if none did:
    a phase that one round did not finish within the floor's bound leaves the
    others' times standing, as ``make bench``'s report does with its floor rows.
    ``floor_rounds`` keeps every round's times, so a median over fewer rounds
    than ``floor_reps`` shows; ``floor_errors`` keeps every round's client
    errors, each named by its round.
    """
    fields: dict[str, Any] = {}
    for phase, field in FLOOR_FIELDS.items():
        found = summary(getattr(f, phase) for f in rounds)
        fields[field] = None if found is None else found["median"]
    fields["floor_reps"] = len(rounds)
    fields["floor_rounds"] = [{phase: getattr(f, phase) for phase in FLOOR_FIELDS}
                              for f in rounds]
    fields["floor_errors"] = [f"round {i}: {error}" for i, f in enumerate(rounds)
                              for error in f.errors]
    return fields


def floor_rounds(backend: K8sBackend, log_dir: Path, n: int, processes: int, reps: int
                 ) -> dict[str, Any]:
    """The floor (:mod:`bench.floor`) at ``n`` on the same server, ``reps`` rounds one after
    the other, as a mixed row's fields (:func:`floor_fields`)."""
    return floor_fields([floor.on_server(backend, log_dir, n, processes, f"n{n}-r{rep}")
                         for rep in range(reps)])


def mixed(plan: Plan, backend: K8sBackend, log_dir: Path, operator_pid: int
          ) -> list[dict[str, Any]]:
    pool = Pool(plan.workers, log_dir, "mixed")
    late = Pool(1, log_dir, "mixed-late")
    rows = []
    try:
        for n in plan.mixed_sizes:
            began = time.monotonic()
            row = mixed_round(backend, pool, late, log_dir, n, plan.sample, plan.sim_processes,
                              operator_pid, plan.formation_bound)
            row.update(floor_rounds(backend, log_dir, n, plan.sim_processes, plan.floor_reps))
            rows.append(row)
            print(f"  mixed N={n}: formed={row['formed']} latency={row['latency_s']} "
                  f"floor={row['floor_s']} newcomer={row.get('newcomer_s')} "
                  f"floor newcomer={row['floor_newcomer_s']} loss={row.get('loss_s')} "
                  f"floor loss={row['floor_loss_s']} ({time.monotonic() - began:.0f}s)",
                  file=sys.stderr, flush=True)
            if not row["formed"]:
                break
    finally:
        pool.stop()
        late.stop()
    return rows


def regimes(plan: Plan, backend: K8sBackend, log_dir: Path, operator_pid: int
            ) -> list[dict[str, Any]]:
    """A mixed round of the plan's smallest size in a run of each of ``plan.regimes`` as
    its ``maxNodes``: formation, newcomer and loss, without the floor.

    How a run tells its members depends on its ``maxNodes``, not on how many
    nodes came (:func:`~elasticrun.api.rounds.members_watch_quietly`,
    :func:`~elasticrun.api.rounds.members_told_in_slices`), so a small round of
    a large run takes the large run's way: the quiet watch and the settled
    rejoin, or places told in slices, of the simulated nodes and the real
    handlers alike.
    """
    if not plan.regimes:
        return []
    pool = Pool(plan.workers, log_dir, "regime")
    late = Pool(1, log_dir, "regime-late")
    n = min(plan.mixed_sizes)
    rows = []
    try:
        for max_nodes in plan.regimes:
            row = mixed_round(backend, pool, late, log_dir, n, plan.sample, plan.sim_processes,
                              operator_pid, plan.formation_bound, max_nodes)
            rows.append(row)
            print(f"  regime maxNodes={max_nodes} N={n}: formed={row['formed']} "
                  f"newcomer={row.get('newcomer_s')} loss={row.get('loss_s')}",
                  file=sys.stderr, flush=True)
    finally:
        pool.stop()
        late.stop()
    return rows


def frozen_round(backend: K8sBackend, log_dir: Path, n: int, processes: int, bound: float
                 ) -> dict[str, Any]:
    """A member of a formed round of ``n`` simulated nodes stops renewing its Lease.

    Times (a) from its last renewal until the operator removed it from the
    round (``LeaseExpired``, the time in the run's ``lostMembers``), against
    the run's heartbeat, and (b) from that removal until every survivor holds
    the next round (each asks again as soon as its run watch shows the loss).
    The run renews at the CRD's shortest interval and expires at its shortest
    heartbeat (:func:`frozen_timing`), so every node renews every second.
    """
    nodes = scenarios.node_names(n)
    timing = frozen_timing(n)
    run = backend.new_run(timing, nodes)
    sims = SimNodes(processes, log_dir, f"frozen-n{n}")
    row: dict[str, Any] = {"n": n, "heartbeat_s": timing.keep_alive * timing.keep_alive_attempts,
                           "renew_s": timing.keep_alive}
    try:
        assert run.namespace is not None
        start = time.monotonic() + 1.0
        sims.start([nodes[i::processes] for i in range(processes)],
                   {"kubeconfig": backend.control_plane.kubeconfig, "namespace": run.namespace,
                    "run": run.name, "start_at": start, "renew_interval": timing.keep_alive,
                    "rejoins": 1})
        results = sims.collect(bound)
        row["errors"] = [f"{r['node']}: {r['error']}" for r in results if "error" in r][:3]
        row["formed"] = len(results) == n and not row["errors"]
        if not row["formed"]:
            return row
        time.sleep(FROZEN_SETTLE)
        ranks = {r["node"]: r["rank"] for r in results}
        victim = max(name for name in ranks if ranks[name] != 0)
        survivors = set(ranks) - {victim}
        renewed = sims.freeze(victim, bound)
        told = sims.changed(survivors, max(int(r["round"]) for r in results),
                            timing.keep_alive * timing.keep_alive_attempts + bound)
        held = sims.reformed(survivors, bound)
        current = parse_run(backend.control_plane.api.request(
            "GET", run_path(run.namespace, run.name)))
        lost = removal(current, victim)
        removed = None if lost is None or lost.time is None else \
            monotonic_of(lost.time, time.time(), time.monotonic())
        placed = {name: r["t_done"] for name, r in held.items() if "rank" in r}
        row.update({
            "victim": victim, "removed_reason": lost.reason if lost else None,
            "removed_s": removed - renewed if removed is not None and renewed is not None
            else None,
            "told_s": until_all(told, survivors, removed) if removed is not None else None,
            "survivors_round_s": until_all(placed, survivors, removed)
            if removed is not None else None,
            "survivors_worlds": sorted({int(r["world"]) for r in held.values() if "world" in r}),
            "lost_others": sorted(m.name for m in current.status.lost_members
                                  if m.name != victim)})
        row["errors"] += [f"{k}: {r['error']}" for k, r in held.items() if "error" in r][:3]
        return row
    finally:
        scenarios.teardown(backend, run, [])
        sims.stop()
        backend.quiesce(30)


def frozen(plan: Plan, backend: K8sBackend, log_dir: Path) -> list[dict[str, Any]]:
    rows = []
    for n in plan.frozen_sizes:
        row = frozen_round(backend, log_dir, n, plan.sim_processes, plan.formation_bound)
        rows.append(row)
        print(f"  frozen N={n}: removed after {row.get('removed_s')} s "
              f"(heartbeat {row['heartbeat_s']} s), survivors' round "
              f"{row.get('survivors_round_s')} s after", file=sys.stderr, flush=True)
    return rows


def real_rounds(plan: Plan, backend: backends.Backend, sizes: tuple[int, ...], log_dir: Path,
                dns: str) -> list[dict[str, Any]]:
    """Formation with every node a real handler (``backend``), as-is or DNS-neutral."""
    env = dnsshim.environment() if dns == "neutral" else None
    pool = Pool(plan.workers, log_dir, f"{backend.name}-{dns}", env)
    rows: list[dict[str, Any]] = []
    try:
        for n in sizes:
            began = time.monotonic()
            got = scenarios.formation(backend, pool, n, plan.reps, plan.formation_bound)
            rows.extend({**r, "dns": dns, "backend": backend.name} for r in got)
            print(f"  {backend.name} {dns} N={n}: "
                  f"{[round(r['latency_s'], 2) if r['latency_s'] else None for r in got]} "
                  f"({time.monotonic() - began:.0f}s)", file=sys.stderr, flush=True)
            if got and not got[-1]["formed"]:
                break
    finally:
        pool.stop()
    return rows


@contextlib.contextmanager
def _python_path(value: str) -> Iterator[None]:
    """``PYTHONPATH`` for the processes started inside (the operator reads os.environ)."""
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = value
    try:
        yield
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


def baseline(plan: Plan, rev: str, work: Path, log_dir: Path) -> list[dict[str, Any]]:
    """The protocol before this one, same harness: ``rev``'s handler, operator and CRDs.

    ``rev`` is taken from git into a scratch folder (``git archive``), given its
    own control plane, and measured on real rounds of :attr:`Plan.baseline_sizes`,
    DNS-neutral, so that the report can say where the time and the bytes went.
    """
    tree = work / f"baseline-{rev}"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True,
                             check=True, timeout=60).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True, timeout=60)
    paths = os.pathsep.join(map(str, [ROOT, tree / "handler", tree / "operator", ROOT / "tests"]))
    backend = K8sBackend(work / "controlplane-baseline", crd_files(tree))
    rows: list[dict[str, Any]] = []
    try:
        backend.start(log_dir)
        with _python_path(paths), backend.operator(log_dir):  # ``rev``'s operator
            pool = Pool(plan.workers, log_dir, f"baseline-{rev}",
                        {**dnsshim.environment(), "PYTHONPATH": paths})
            try:
                for n in plan.baseline_sizes:
                    got = scenarios.formation(backend, pool, n, 1, plan.formation_bound)
                    rows.extend({**r, "dns": "neutral", "backend": "k8s", "rev": rev}
                                for r in got)
                    print(f"  baseline {rev} N={n}: {[r['latency_s'] for r in got]}",
                          file=sys.stderr, flush=True)
            finally:
                pool.stop()
    finally:
        backend.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__.splitlines()[0])
    parser.add_argument("--baseline", default=None, metavar="REV",
                        help="also measure the protocol of git revision REV (before this one)")
    args = parser.parse_args(argv)
    plan = Plan.quick() if args.quick else Plan()
    out, work, log_dir = directories(args, "elasticrun-scale-")
    data: dict[str, Any] = {
        "command": "make bench-scale" if not args.quick else "python bench/scale.py --quick",
        "quick": args.quick, "plan": asdict(plan), "machine": machine(),
        "versions": versions(), "commit": commit(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "errors": [], "load": {}}
    began = time.monotonic()

    def step(key: str, action: Any) -> Any:
        try:
            return action()
        except Exception as exc:  # recorded; the other measurements still run
            data["errors"].append(f"{key}: {type(exc).__name__}: {exc}")
            traceback.print_exc()
            return []
        finally:
            data["load"][key] = round(os.getloadavg()[0], 2)

    k8s = K8sBackend(work / "controlplane")
    try:
        k8s.start(log_dir)
        data["versions"].update(k8s.versions())
        with k8s.operator(log_dir) as operator:
            data["mixed"] = step("mixed", lambda: mixed(plan, k8s, log_dir, operator.pid))
            data["regimes"] = step("regimes", lambda: regimes(plan, k8s, log_dir, operator.pid))
            data["frozen"] = step("frozen", lambda: frozen(plan, k8s, log_dir))
            data["real"] = step("k8s as-is", lambda: real_rounds(
                plan, k8s, plan.real_sizes, log_dir, "as-is"))
            data["real"] += step("k8s DNS-neutral", lambda: real_rounds(
                plan, k8s, plan.real_sizes, log_dir, "neutral"))
    finally:
        k8s.stop()
    if args.baseline:
        data["baseline"] = step(f"baseline {args.baseline}", lambda: baseline(
            plan, args.baseline, work, log_dir))
    c10d = backends.make("c10d", work)
    data["c10d"] = step("c10d as-is", lambda: real_rounds(
        plan, c10d, plan.c10d_sizes, log_dir, "as-is"))
    data["c10d"] += step("c10d DNS-neutral", lambda: real_rounds(
        plan, c10d, plan.c10d_sizes, log_dir, "neutral"))
    data["seconds"] = time.monotonic() - began
    (out / "benchmarks-scale.json").write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    scale_report.write(data, out)
    if (out / "benchmarks.json").exists():
        report.main([str(out)])  # benchmarks.md embeds the new scale section
    print(f"wrote {out / scale_report.PAGE} in {data['seconds']:.0f}s (logs: {log_dir})",
          file=sys.stderr)
    return 1 if data["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
