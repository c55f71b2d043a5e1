"""The operator's intake: the newest ElasticRun bodies, Pod losses, and one reconcile per run.

kopf delivers the watch events (ElasticRuns, Pods, Leases); the controller
keeps what they say, queues the run (:mod:`.workqueue`), decides with the pure
:func:`~elasticrun.operator.reconcile.reconcile`, and hands the plan to
:class:`~.executor.PlanExecutor`.  :class:`~.observer.Observer` turns every
change of a run into Events and metrics, whoever wrote it.
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

from elasticrun.api import untrusted
from elasticrun.api.kube import KubeClient
from elasticrun.api.leases import LeaseState, lease_run, lease_state, owned_by
from elasticrun.api.model import ElasticRun, InvalidRunError, now, parse_run
from elasticrun.api.ordering import older
from elasticrun.operator.apihealth import ApiAvailability
from elasticrun.operator.executor import PlanExecutor
from elasticrun.operator.liveness import pod_loss, restart_count
from elasticrun.operator.metrics import Metrics
from elasticrun.operator.nodesignals import (
    Shown,
    Signal,
    SignalMemory,
    counts,
    read_node,
    shown,
)
from elasticrun.operator.observer import COMPONENT, Observer
from elasticrun.operator.ownerreader import OwnerReader
from elasticrun.operator.owners import (
    NO_OWNER,
    Ownership,
    PodView,
    ownership,
    pod_run,
    pod_view,
)
from elasticrun.operator.reconcile import Members, missing_leases, reconcile
from elasticrun.operator.runstate import RunState
from elasticrun.operator.topology import node_topology
from elasticrun.operator.workqueue import Key, WorkQueue

__all__ = ["COMPONENT", "Controller", "Key"]

log = logging.getLogger(__name__)

#: After this many Lease deletions, freed memory is handed back once no Lease was
#: deleted for TRIM_QUIET_SECONDS (kopf lets go of an object's last body a few
#: seconds after its deletion); see ``_release_memory``.
TRIM_AFTER_DELETIONS = 100
TRIM_QUIET_SECONDS = 8.0
TRIM_CHECK_SECONDS = 2.0


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
        #: The restart count first seen per Pod, by (namespace, uid or name).
        self.pod_restarts: dict[tuple[str, str], int] = {}
        #: The run's owned pods as last seen, by uid (or name): what tells a pod set
        #: change (the owners are read again) from a status update.
        self.run_pods: dict[Key, dict[str, PodView]] = {}
        #: kopf's index of the runs' owned pods (``handlers.owned_pods_by_run``), listed
        #: before any run is reconciled: the pods a reconcile counts.
        self.pod_index: Mapping[Key, Iterable[PodView]] | None = None
        #: The workloads that own the run's pods, read by name (the source of status.desired).
        self.owners = OwnerReader(client)
        self.lease_index: Mapping[Key, Iterable[tuple[str, LeaseState]]] | None = None
        #: Lease deletions since memory was last handed back, and when the last one came.
        self._deleted_leases = 0
        self._last_deletion = 0.0
        self.queue = WorkQueue(self.reconcile, workers)
        self.observer = Observer(client, metrics)
        self.executor = PlanExecutor(client, self.observer, self._accept_written, self.enqueue,
                                     per_run_rbac, store_policy_port, self.states)
        self.api = ApiAvailability(client, on_change=metrics.api_changed)
        #: The configured node signals; None when the operator does not read Nodes.
        self.node_signals = node_signals
        #: What each Node shows, held against flapping (only Nodes showing something).
        self.signal_memory = SignalMemory()
        #: The configured topology keys (``--topology-keys``); () when off.
        self.topology_keys = topology_keys
        #: The topology values of each Node that has any, by Node name.
        self.node_topology: dict[str, tuple[str, ...]] = {}
        #: Side tasks that live as long as the controller: the API probe, the caBundle check.
        self._tasks: list[asyncio.Task[None]] = []

    def held(self, key: Key) -> RunState | None:
        """The run's state if the operator holds the run, else None."""
        state = self.states.get(key)
        return state if state is not None and state.held else None

    def _pods_state(self, key: Key) -> RunState:
        """The run's state for a pod fact (made if need be; :meth:`_tidy` drops it again)."""
        return self.states.setdefault(key, RunState())

    def _tidy(self, key: Key) -> None:
        """Drop the state of a run not held once its pods say nothing any more."""
        state = self.states.get(key)
        if state is not None and state.idle:
            del self.states[key]

    @property
    def reads_nodes(self) -> bool:
        """Whether the operator watches Nodes: for node signals, for topology keys, or both."""
        return self.node_signals is not None or bool(self.topology_keys)

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
        raw = dict(body)
        current = self.held(key)
        if current is not None and current.raw is not None and older(raw, current.raw):
            return  # our own write already gave us something newer
        self._accept(key, raw)
        self.enqueue(key)

    def pod_event(self, event_type: str, body: Mapping[str, Any]) -> None:
        meta = body.get("metadata") or {}
        namespace, pod = meta.get("namespace", ""), meta.get("name", "")
        run = pod_run(body)
        if not run:
            return
        key = (namespace, run)
        uid = meta.get("uid") if isinstance(meta.get("uid"), str) and meta.get("uid") else None
        pod_key = (pod, uid)
        self._track_pod(key, event_type, uid or pod, body)
        self._track_node(key, event_type, pod, uid, body)
        first = self.pod_restarts.setdefault((namespace, uid or pod), restart_count(body))
        loss = pod_loss(body, event_type, first)
        if event_type == "DELETED":
            self.pod_restarts.pop((namespace, uid or pod), None)
        if loss is None:
            state = self.states.get(key)
            if state is not None:
                state.pod_losses.pop(pod_key, None)
                self._tidy(key)
            return
        losses = self._pods_state(key).pod_losses
        if pod_key not in losses:
            log.info("%s/%s: %s", namespace, run, loss.message)
        losses[pod_key] = loss
        self.enqueue(key)

    def _track_pod(self, key: Key, event_type: str, pod_key: str,
                   body: Mapping[str, Any]) -> None:
        """Keep the pod for the run's desired size; a pod added or gone, or its owner
        changed, has the run's owners read again.

        Only pods with a controller are kept: a pod nobody owns gives no size
        and is never counted as coming.
        """
        pods = self.run_pods.get(key, {})
        old = pods.get(pod_key)
        view = None if event_type == "DELETED" else pod_view(body)
        if view is not None and view.owner is None:
            view = None
        if old == view:
            return
        if view is None:
            pods.pop(pod_key, None)
            if not pods:
                self.run_pods.pop(key, None)
        else:
            self.run_pods[key] = pods
            pods[pod_key] = view
        if old is None or view is None or old.owner != view.owner or old.live != view.live:
            self.owners.invalidate(key)
        self.enqueue(key)

    def _track_node(self, key: Key, event_type: str, pod: str, uid: str | None,
                    body: Mapping[str, Any]) -> None:
        """Keep the pod's Node (``spec.nodeName``) and uid while Nodes are read; a pod
        that moved to another Node has its run looked at again."""
        if not self.reads_nodes or not pod:
            return
        state = self._pods_state(key)
        if event_type == "DELETED" or uid is None:
            state.pod_uids.pop(pod, None)
        else:
            state.pod_uids[pod] = uid
        nodes = state.pod_nodes
        spec = untrusted.mapping(body.get("spec"))
        node = None if event_type == "DELETED" else untrusted.text(spec.get("nodeName"))
        if nodes.get(pod) == node:
            self._tidy(key)
            return
        if node is None:
            nodes.pop(pod, None)
        else:
            nodes[pod] = node
        self._tidy(key)
        self.enqueue(key)

    def node_event(self, event_type: str, body: Mapping[str, Any]) -> None:
        """A Node changed: its topology values are kept, what it shows is held
        (:class:`SignalMemory`), and the runs with a pod on it are looked at again when
        either changed."""
        name = untrusted.text(untrusted.mapping(body.get("metadata")).get("name"))
        if name is None or not self.reads_nodes:
            return
        changed = False
        if self.topology_keys:
            values = () if event_type == "DELETED" else node_topology(body, self.topology_keys)
            changed = self.node_topology.get(name, ()) != values
            if values:
                self.node_topology[name] = values
            else:
                self.node_topology.pop(name, None)
        if self.node_signals is not None:
            signals = () if event_type == "DELETED" else shown(self.node_signals,
                                                               read_node(body))
            changed = self.signal_memory.observe(name, signals, now()) or changed
        if not changed:
            return
        for key, state in list(self.states.items()):
            if name in state.pod_nodes.values():
                self.enqueue(key)

    def _shown(self, key: Key) -> dict[str, Shown] | None:
        """What the Node of each of the run's pods shows, by pod (pods on a Node that
        shows nothing are left out)."""
        if self.node_signals is None:
            return None
        at = now()
        found: dict[str, Shown] = {}
        state = self.states.get(key)
        for pod, node in (state.pod_nodes if state else {}).items():
            signals = self.signal_memory.showing(node, at)
            if signals:
                found[pod] = Shown(node, signals)
        return found

    def _topology(self, key: Key) -> dict[str, tuple[str | None, tuple[str, ...]]] | None:
        """Per pod of the run, its uid and its Node's topology values (pods on a Node
        without any are left out); None when no topology keys are configured."""
        if not self.topology_keys:
            return None
        state = self.states.get(key) or RunState()
        return {pod: (state.pod_uids.get(pod), values) for pod, node in state.pod_nodes.items()
                if (values := self.node_topology.get(node))}

    async def _report_signals(self, run: ElasticRun, found: Mapping[str, Shown],
                              leases: Mapping[str, LeaseState]) -> None:
        """One Warning Event per (pod, signal) while it shows, naming the member or
        waiting node on that pod, and the run's signal gauge."""
        key = (run.namespace, run.name)
        entries = {p.pod: f"member {p.name}" for p in run.status.participants if p.pod}
        for joining in [w for w in run.status.waiting] + [
                s.join for s in leases.values() if s.join is not None]:
            if joining.pod:
                entries.setdefault(joining.pod, f"waiting node {joining.name}")
        subjects: set[str] = set()
        for pod, entry in sorted(found.items()):
            who = entries.get(pod, "no node yet")
            for signal in entry.signals:
                subject = f"{pod} {signal.name}"
                subjects.add(subject)
                await self.observer.report_once(
                    run, subject, "NodeSignal",
                    f"pod {pod} ({who}) on Node {entry.node} shows {signal.name} "
                    f"({signal.policy})")
        self.observer.retain_problems(key, "NodeSignal", subjects)
        self.metrics.node_signals(run.namespace, run.name, counts(found))

    def _signal_wake(self, found: Mapping[str, Shown]) -> dt.datetime | None:
        """When a held signal of the run's Nodes stops counting (the run is looked at then)."""
        at = now()
        ends = [e for s in found.values() if (e := self.signal_memory.expires(s.node, at))]
        return min(ends) if ends else None

    async def _ownership(self, key: Key) -> Ownership:
        """What the owners of the run's live pods say (read by name, cached per run)."""
        if self.pod_index is not None:
            pods = list(self.pod_index.get(key, ()))
        else:
            pods = list(self.run_pods.get(key, {}).values())
        refs = {p.owner for p in pods if p.owner is not None and p.live}
        if not refs:
            self.owners.forget(key)
            return NO_OWNER
        return ownership(pods, await asyncio.to_thread(self.owners.resolve, key, refs))

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
        self.enqueue(key)

    def _accept(self, key: Key, raw: dict[str, Any]) -> None:
        """Keep ``raw`` as the newest copy of the run, and report what changed."""
        self._pods_state(key).raw = raw
        self.observer.observe(key, raw)

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

    async def _listed_leases(self, key: Key, run: ElasticRun) -> dict[str, LeaseState]:
        leases = {}
        for item in await asyncio.to_thread(self.executor.gateway(key).leases):
            state = lease_state(item)
            if state.node and owned_by(state, run.name, run.uid):
                leases[state.node] = state
        return leases

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
            uid = (raw.get("metadata") or {}).get("uid")
            await self.executor.repair(key, raw, exc, min_round=mark.floor(uid))
            return
        self.executor.readable(key)
        await self.executor.ensure_network_policy(run)
        indexed = self._indexed_leases(key, run)
        await self.executor.ensure_rbac(run, indexed)
        for node, state in indexed.items():
            await self.observer.report_once(run, node, "UnreadableJoin", state.problem)
        self.observer.retain_problems(key, "UnreadableJoin", set(indexed))
        owned = await self._ownership(key)
        found = self._shown(key)
        if found is not None:
            await self._report_signals(run, found, indexed)
        placed = self._topology(key)
        members = self._members(key, run, indexed, owned, found, placed)
        plan = reconcile(run, members, now())
        if plan.sealed or plan.delete_leases:
            # The Lease index comes from another watch than the run and may lag
            # behind it (always so right after a start).  Sealing a round or
            # removing a member acts on Lease data, so decide again from a
            # consistent LIST, which is at least as new as the run we hold.
            listed = await self._listed_leases(key, run)
            members = self._members(key, run, listed, owned, found, placed)
            plan = reconcile(run, members, now())
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
        signals_at = self._signal_wake(found) if found else None
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
