"""The operator's intake: the newest ElasticRun bodies, Leases, and one reconcile per run.

kopf delivers the watch events (ElasticRuns, Pods, Nodes, Leases); the
controller keeps what they say in one :class:`~.runstate.RunState` per run
(Pods and Nodes through :class:`~.podintake.PodIntake`), queues the run
(:mod:`.workqueue`), decides with the pure
:func:`~elasticrun.operator.reconcile.reconcile`, and hands the plan to
:class:`~.executor.PlanExecutor`, which carries it out.
:class:`~.observer.Observer` turns every change of a run into Events and
metrics, whoever wrote it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import datetime as dt
import gc
import logging
import time
from collections.abc import Coroutine, Iterable, Mapping
from typing import Any

from elasticrun.api import rounds
from elasticrun.api.gateway import OperatorGateway
from elasticrun.api.kube import KubeClient
from elasticrun.api.leases import LeaseState, lease_run, lease_state, owned_by
from elasticrun.api.model import (
    ElasticRun,
    InvalidRunError,
    RunSpec,
    WaitingNode,
    now,
    parse_run,
)
from elasticrun.api.ordering import older
from elasticrun.operator.apihealth import ApiAvailability
from elasticrun.operator.executor import PlanExecutor
from elasticrun.operator.metrics import Metrics
from elasticrun.operator.nodesignals import (
    Shown,
    Signal,
    counts,
)
from elasticrun.operator.observer import COMPONENT, Observer
from elasticrun.operator.ownerreader import OwnerReader
from elasticrun.operator.owners import (
    NO_OWNER,
    Ownership,
    PodView,
)
from elasticrun.operator.podintake import PodIntake
from elasticrun.operator.reconcile import (
    Members,
    missing_leases,
    plan_repair,
    reconcile,
    repair_due,
)
from elasticrun.operator.runobjects import Settings
from elasticrun.operator.runstate import RunState
from elasticrun.operator.workqueue import Key, WorkQueue

__all__ = ["COMPONENT", "Controller", "Key"]

log = logging.getLogger(__name__)

#: After this many Lease deletions, freed memory is handed back once no Lease was
#: deleted for TRIM_QUIET_SECONDS (kopf lets go of an object's last body a few
#: seconds after its deletion); see ``_release_memory``.
TRIM_AFTER_DELETIONS = 100
TRIM_QUIET_SECONDS = 8.0
TRIM_CHECK_SECONDS = 2.0

#: In runs whose nodes leave the seal to the operator, the Lease events of a
#: window this many seconds per ``maxNodes`` long are gathered into one
#: reconcile (``WorkQueue.enqueue_within``), up to :data:`LEASE_EVENT_WINDOW`.
#: A reconcile of such a run is O(maxNodes) on the event loop (tens of
#: milliseconds at 2,048 nodes) and a join burst brings a Lease event every few
#: milliseconds: one reconcile per event kept the loop busy with passes that
#: decided nothing, while the events of the last joins, which the seal waits
#: for, queued behind them (measured with 2,048 simulated nodes on 2 busy cores:
#: the seal 11 s and 17 s after the last join; 2 s with a 0.2 s window, at half
#: the operator's CPU).  A window in proportion to the pass keeps the passes of
#: a burst to the same share of the loop at every size, and the seal, which
#: comes up to one window after the event that allows it, as soon after it as
#: that share allows: 6.4 ms at 64 nodes, 0.1 s at 1,024.
LEASE_EVENT_WINDOW_PER_NODE = 0.0001
#: The longest window, reached from 2,000 nodes.
LEASE_EVENT_WINDOW = 0.2


def lease_event_window(raw: Mapping[str, Any]) -> float | None:
    """How long a Lease event of this run may wait for others, or None: at once.

    Only runs whose nodes defer the seal (:func:`rounds.nodes_defer_seal`) wait;
    smaller runs' reconciles are cheap, and their nodes seal themselves.
    """
    try:
        spec = RunSpec.from_dict(raw.get("spec"))
    except InvalidRunError:
        return None
    if not rounds.nodes_defer_seal(spec):
        return None
    return min(LEASE_EVENT_WINDOW, LEASE_EVENT_WINDOW_PER_NODE * spec.max_nodes)


def release_freed_memory() -> None:
    """Collect garbage and ask glibc to return free heap pages (a no-op elsewhere)."""
    gc.collect()
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        return


class Controller:
    def __init__(self, client: KubeClient, metrics: Metrics, workers: int = 2,
                 per_run_rbac: bool = False, store_policy_port: int | None = None,
                 node_signals: tuple[Signal, ...] | None = None,
                 topology_keys: tuple[str, ...] = ()) -> None:
        self.client = client
        self.metrics = metrics
        #: What the operator keeps of each run (:class:`RunState`): forgetting a run
        #: is one ``pop``.
        self.states: dict[Key, RunState] = {}
        #: The workloads that own the run's pods, read by name (the source of status.desired).
        self.owners = OwnerReader(client)
        #: What the run's pods and their Nodes say.
        self.pods = PodIntake(self.states, self.owners, self.enqueue, node_signals,
                              topology_keys)
        self.lease_index: Mapping[Key, Iterable[tuple[str, LeaseState]]] | None = None
        #: Lease deletions since memory was last handed back, and when the last one came.
        self._deleted_leases = 0
        self._last_deletion = 0.0
        self.queue = WorkQueue(self.reconcile, workers)
        #: The executor's and the observer's requests, over the controller's client (the
        #: fenced one under leader election).
        access = OperatorGateway(client)
        self.observer = Observer(access, metrics)
        #: The flags that add objects beside each run (its Role, its NetworkPolicy).
        self.settings = Settings(per_run_rbac, store_policy_port)
        self.executor = PlanExecutor(access, self.observer, self._accept_written, self.enqueue,
                                     self.states, self._retry)
        self.api = ApiAvailability(client, on_change=metrics.api_changed)
        #: Side tasks that live as long as the controller: the API probe, the caBundle check.
        self._tasks: list[asyncio.Task[None]] = []

    def held(self, key: Key) -> RunState | None:
        """The run's state if the operator holds the run, else None."""
        state = self.states.get(key)
        return state if state is not None and state.held else None

    @property
    def reads_nodes(self) -> bool:
        return self.pods.reads_nodes

    @property
    def node_signals(self) -> tuple[Signal, ...] | None:
        return self.pods.node_signals

    @property
    def topology_keys(self) -> tuple[str, ...]:
        return self.pods.topology_keys

    @property
    def pod_index(self) -> Mapping[Key, Iterable[PodView]] | None:
        return self.pods.pod_index

    @pod_index.setter
    def pod_index(self, index: Mapping[Key, Iterable[PodView]] | None) -> None:
        self.pods.pod_index = index

    def pod_event(self, event_type: str, body: Mapping[str, Any]) -> None:
        self.pods.pod_event(event_type, body)

    def node_event(self, event_type: str, body: Mapping[str, Any]) -> None:
        self.pods.node_event(event_type, body)

    def start(self, decide: bool = True) -> None:
        """Start observing; and deciding too unless ``decide`` is False (a replica under
        leader election, which calls :meth:`lead` once it holds the Lease)."""
        if decide:
            self.queue.start()
        self.keep(self.api.run())
        self.keep(self._release_memory())

    async def lead(self) -> None:
        """Start deciding: the work queue runs and every run held is reconciled, so what
        a previous leader left half done is seen again from the API server's state."""
        self.queue.start()
        for key, state in list(self.states.items()):
            if state.held:
                self.enqueue(key)

    async def follow(self) -> None:
        """Stop deciding: in-flight reconciles are cancelled and timers dropped; the
        watches, indexes and renewal clocks go on, so a take-over starts warm."""
        await self.queue.stop()
        self.queue = WorkQueue(self.reconcile, self.queue.workers)

    async def _release_memory(self) -> None:
        """Give memory back to the system after many Leases were deleted.

        Anyone who may create Leases can make the operator read thousands of
        large ones; once they are deleted, everything the operator kept of them
        is dropped, but the C allocator holds on to the freed pages until it is
        asked to trim (measured: 17 MiB of 45 MiB after 2,000 junk Leases).
        """
        while True:
            await asyncio.sleep(TRIM_CHECK_SECONDS)
            if self._deleted_leases >= TRIM_AFTER_DELETIONS \
                    and time.monotonic() - self._last_deletion >= TRIM_QUIET_SECONDS:
                self._deleted_leases = 0
                await asyncio.to_thread(release_freed_memory)

    def keep(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` until the controller stops."""
        self._tasks.append(asyncio.create_task(work))

    async def stop(self) -> None:
        await self.queue.stop()
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def enqueue(self, key: Key) -> None:
        self.queue.enqueue(key)

    def schedule(self, key: Key, when: dt.datetime) -> None:
        self.queue.schedule(key, when)

    def _retry(self, key: Key, within: float) -> None:
        """Reconcile ``key`` within ``within`` seconds; a wake-up planned meanwhile
        (:meth:`schedule`) does not cancel it."""
        self.queue.enqueue_within(key, within)

    # ------------------------------------------------------------------ inputs from kopf

    def run_event(self, event_type: str, body: Mapping[str, Any]) -> None:
        meta = body.get("metadata") or {}
        key = (meta.get("namespace", ""), meta.get("name", ""))
        if event_type == "DELETED":
            self.states.pop(key, None)
            self.observer.forget(key)
            self.owners.forget(key)
            self.observer.in_background(
                self.executor.delete_orphaned_leases(key, meta.get("uid")))
            return
        if self._accept(key, dict(body)):
            self.enqueue(key)

    def lease_event(self, body: Mapping[str, Any], event_type: str = "") -> None:
        """A Lease changed: note when the operator saw it (if its run exists), queue the run.

        Only Leases of runs the operator holds are remembered, so Leases naming
        no run cost no memory; a deleted Lease is forgotten.
        """
        if event_type == "DELETED":
            self._deleted_leases += 1
            self._last_deletion = time.monotonic()
        run = lease_run(body)
        if not run:
            return
        meta = body.get("metadata") or {}
        key = (str(meta.get("namespace") or ""), run)
        state = lease_state(body)
        held = self.held(key)
        clock = held.renewals if held is not None else None
        if state.node is not None and clock is not None:
            if event_type == "DELETED":
                clock.forget(state.node)
            else:
                clock.observe(state.node, state, now())
        window = held.lease_window if held is not None else None
        if window is None:
            self.enqueue(key)
        else:
            self.queue.enqueue_within(key, window)

    def _accept(self, key: Key, raw: dict[str, Any]) -> bool:
        """Keep ``raw`` as the newest copy of the run, and report what changed; False
        (and nothing kept) when the copy held is newer.

        The watch and the operator's own writes deliver copies in either order: the
        event of a user's change made just after a status write can come in before
        the write's response, and that response must not hide the change (the run
        would be reconciled from a spec the user has already replaced, until some
        later event).
        """
        state = self.states.setdefault(key, RunState())
        if state.raw is not None and older(raw, state.raw):
            return False
        state.raw = raw
        state.lease_window = lease_event_window(raw)
        self.observer.observe(key, raw)
        return True

    def _accept_written(self, key: Key, raw: dict[str, Any]) -> None:
        """A copy the operator wrote; dropped if the run was deleted meanwhile, so that
        no state (or metric series) of a deleted run comes back."""
        if self.held(key) is not None:
            self._accept(key, raw)

    # ------------------------------------------------------------------ reconcile

    def _indexed_leases(self, key: Key, run: ElasticRun) -> dict[str, LeaseState]:
        """The run's genuine Leases in the index (owner uid and name: ``owned_by``).

        Anything else labelled for the run is nobody's member: it is neither
        counted, nor deleted, nor a reason to look at the run again.
        """
        leases: dict[str, LeaseState] = {}
        if self.lease_index is not None and key in self.lease_index:
            for node, state in self.lease_index[key]:
                if owned_by(state, run.name, run.uid):
                    leases[node] = state
        return leases

    async def _listed_leases(self, key: Key, uid: str | None) -> dict[str, LeaseState]:
        """The Leases of the run ``key`` with ``uid`` (``owned_by``) from one consistent LIST,
        at least as new as the copy of the run it is read for."""
        leases = {}
        for item in await asyncio.to_thread(self.executor.gateway(key).leases):
            state = lease_state(item)
            if state.node and owned_by(state, key[1], uid):
                leases[state.node] = state
        return leases

    async def _requests(self, key: Key, uid: str | None) -> list[WaitingNode]:
        """The join requests on the Leases of a run whose status is unreadable: its repair
        records those it cannot place as spent (:func:`.reconcile.repair`)."""
        leases = await self._listed_leases(key, uid)
        return [state.join for state in leases.values() if state.join is not None]

    def _members(self, key: Key, run: ElasticRun, leases: dict[str, LeaseState],
                 owned: Ownership = NO_OWNER,
                 node_signals: Mapping[str, Shown] | None = None,
                 topology: Mapping[str, tuple[str | None, tuple[str, ...]]] | None = None
                 ) -> Members:
        """What the operator knows of the run's members, timed by its own clock.

        Every Lease goes through :attr:`renewals` (one not seen before counts
        as renewed now), and a member without a Lease is timed from when the
        operator first saw it so, not from a time a node wrote.
        """
        at = now()
        # A run deleted meanwhile keeps nothing (a throwaway state).
        held = self.held(key) or RunState()
        observed = {node: held.renewals.observe(node, state, at)
                    for node, state in leases.items()}
        missing = missing_leases(run.status, observed)
        for name in missing:
            held.missing.setdefault(name, at)
        for gone in [name for name in held.missing if name not in missing]:
            del held.missing[gone]
        losses = held.pod_losses
        return Members(leases=observed,
                       pod_losses={pod: loss for (pod, _), loss in losses.items()},
                       pod_losses_by_uid={uid: loss for (_, uid), loss in losses.items()
                                          if uid is not None},
                       missing_since={name: held.missing.get(name, at) for name in missing},
                       lease_clock_start=self.api.lease_clock_start(at), ownership=owned,
                       node_signals=node_signals, topology=topology)

    async def reconcile(self, key: Key) -> None:
        held = self.held(key)
        if held is None or held.raw is None:
            return
        raw, mark = held.raw, held.mark
        try:
            run = parse_run(raw)
            held.mark = mark.advance(run)
        except InvalidRunError as exc:
            if repair_due(exc, held.invalid_reported):
                uid = (raw.get("metadata") or {}).get("uid")
                uid = uid if isinstance(uid, str) else None
                fix = plan_repair(raw, exc, now(), mark.floor(uid), await self._requests(key, uid))
                await self.executor.repair(key, raw, fix, str(exc))
            return
        held.invalid_reported = None  # readable again: a later invalid status is repaired
        indexed = self._indexed_leases(key, run)
        owned = await self.pods.ownership(key)
        found = self.pods.shown(key)
        if found is not None:
            self.metrics.node_signals(run.namespace, run.name, counts(found))
        placed = self.pods.topology(key)
        members = self._members(key, run, indexed, owned, found, placed)
        plan = reconcile(run, members, now(), self.settings, held.done)
        if plan.sealed or plan.lease_decided:
            # The Lease index comes from another watch than the run and may lag
            # behind it (always so right after a start).  A seal, or a removal for
            # what the Leases say, is decided again from a consistent LIST, which
            # is at least as new as the run we hold; the first plan only said that
            # one is needed.  A member whose Pod is gone is removed as decided:
            # every survivor waits for that write, and it reads no Lease.
            listed = await self._listed_leases(key, run.uid)
            members = self._members(key, run, listed, owned, found, placed)
            plan = reconcile(run, members, now(), self.settings, held.done)
            indexed.update(listed)
        held.renewals.retain(lambda node: node in indexed)
        written = await self.executor.carry_out(run, plan, members.leases)
        if written is None:
            return
        self._forget_stale_losses(key, written)
        wake = plan.wake_at
        refresh = self.owners.due_in(key)
        if refresh is not None:
            owners_at = now() + dt.timedelta(seconds=refresh)
            wake = owners_at if wake is None else min(wake, owners_at)
        signals_at = self.pods.signal_wake(found) if found else None
        if signals_at is not None:
            wake = signals_at if wake is None else min(wake, signals_at)
        if wake is not None:
            self.schedule(key, wake)

    def _forget_stale_losses(self, key: Key, run: ElasticRun) -> None:
        state = self.states.get(key)
        losses = state.pod_losses if state is not None else None
        if not losses:
            return
        status = run.status
        pods = [(p.pod, p.pod_uid) for p in status.participants if p.pod]
        pods += [(w.pod, w.pod_uid) for w in status.waiting if w.pod]
        referenced = {pod for pod, _ in pods}
        uids = {uid for _, uid in pods if uid is not None}
        for pod, uid in list(losses):
            if pod not in referenced and uid not in uids:
                del losses[(pod, uid)]
