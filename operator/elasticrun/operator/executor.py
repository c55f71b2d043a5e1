"""Carries out what :func:`~elasticrun.operator.reconcile.reconcile` planned for one run.

The plan decides; the executor writes, in the plan's order, and reports what
became of each write (the run as written, the objects applied, a lost
compare-and-set), never deciding anything itself.  Every request goes through
the :class:`~elasticrun.api.gateway.OperatorAccess` it is given, from a worker
thread: per run its :class:`~elasticrun.api.gateway.RunControl` (the same
compare-and-set the nodes use), beside it the run's own objects and Events
(:class:`~elasticrun.api.gateway.OperatorGateway` over the operator's client;
in its unit tests the in-memory fake of ``tests/fakegateway.py``).  A lost
compare-and-set is not an error: the winner's write comes back as an event and
the run is reconciled again from it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from elasticrun.api.gateway import OperatorAccess, RunControl
from elasticrun.api.kube import ApiConnectionError, ApiError
from elasticrun.api.leases import LeaseState, owned_by
from elasticrun.api.model import ElasticRun, RunStatus, parse_run
from elasticrun.api.ordering import newer, resource_version
from elasticrun.api.slices import Slice, slice_name, slice_path
from elasticrun.operator.deletions import Deleter
from elasticrun.operator.observer import COMPONENT, Observer
from elasticrun.operator.reconcile import Plan, Repair
from elasticrun.operator.runobjects import Apply
from elasticrun.operator.runstate import Key, RunState

log = logging.getLogger(__name__)

#: Slice writes in flight at once: a round's slices are written in parallel, not
#: one after another.
ASSIGN_CONCURRENCY = 16

#: A run whose slice writes failed is reconciled again this soon.  A write that
#: did not land brings no event to wake the run, and the members it places, told
#: nothing, would wait for the next renewal of some Lease (a minute apart in
#: large runs) while their own wait for the operator runs out.
ASSIGN_RETRY_SECONDS = 1.0

#: The field manager of the operator's slice writes (server-side apply).
SLICE_MANAGER = "elasticrun-operator"


class PlanExecutor:
    """The operator's writes, through ``access``.  ``accept`` keeps a copy the operator
    wrote (or read) as the newest; ``enqueue`` asks for another reconcile of a run;
    ``states`` are the controller's run states, where what was applied, told and
    reported is kept; ``retry`` asks for a reconcile of a run within some seconds
    (by default at once, through ``enqueue``)."""

    def __init__(self, access: OperatorAccess, observer: Observer,
                 accept: Callable[[Key, dict[str, Any]], None],
                 enqueue: Callable[[Key], None],
                 states: dict[Key, RunState] | None = None,
                 retry: Callable[[Key, float], None] | None = None) -> None:
        self.access = access
        self.observer = observer
        self.accept = accept
        self.enqueue = enqueue
        self.retry = retry or (lambda key, _: enqueue(key))
        self.states: dict[Key, RunState] = {} if states is None else states
        self.deleter = Deleter(access, observer, self.states)
        #: Threads of their own: the default pool has cores + 4 threads, and a
        #: round's slices would queue behind each other there.
        self._assigners = ThreadPoolExecutor(ASSIGN_CONCURRENCY,
                                             thread_name_prefix="elasticrun-assign")

    def gateway(self, key: Key) -> RunControl:
        return self.access.run(*key)

    def state(self, key: Key) -> RunState:
        return self.states.setdefault(key, RunState())

    async def carry_out(self, run: ElasticRun, plan: Plan,
                        leases: Mapping[str, LeaseState] | None = None) -> ElasticRun | None:
        """Apply ``plan``; the run as written, or None when the plan is void (race, deletion).

        ``leases`` are the Leases the plan was decided from, each a genuine
        Lease of the run (:func:`~elasticrun.api.leases.owned_by`): a Lease is
        deleted only as that observed object (its name, its uid),
        never under a name computed from a node's.
        """
        leases = leases or {}
        key = (run.namespace, run.name)
        for item in plan.apply:
            await self.apply(key, item)
        await self.report(run, plan)
        if plan.delete_run:
            await self.post_events(run, plan.events)  # while the run is there to name
            await self.deleter.delete_run(run, plan.delete_objects)
            return None
        if plan.status is not None:
            written = await self.write_status(run, plan.status)
            if written is None:
                return None  # lost the race; the winner's event re-queues us
            run = written
        gateway = self.gateway(key)
        if plan.tell:
            await self.tell_members(run, plan.tell)
        for node in plan.delete_leases:
            lease = leases.get(node)
            if lease is not None and owned_by(lease, run.name, run.uid):
                await self.deleter.delete_lease(run, lease)
        if plan.remove_annotations:
            # Only after the status write took: a lost race must not eat the request.
            await asyncio.to_thread(gateway.remove_annotations, plan.remove_annotations)
        await self.post_events(run, plan.events)
        return run

    async def post_events(self, run: ElasticRun, events: list[tuple[str, str, str]]) -> None:
        for type_, reason, message in events:
            await self.observer.post_event(run, type_, reason, message)

    async def report(self, run: ElasticRun, plan: Plan) -> None:
        """The plan's problem Events; the run's problem memory becomes the plan's."""
        key = (run.namespace, run.name)
        state = self.state(key)
        state.done = dataclasses.replace(state.done, problems=plan.report.problems)
        for problem in plan.report.logged:
            log.debug("%s/%s: %s", *key, problem)
        for _, _, problem in plan.report.events:
            log.warning("%s/%s: %s", *key, problem)
        await self.post_events(run, plan.report.events)

    async def apply(self, key: Key, item: Apply) -> None:
        """Server-side apply of one of the run's own objects; kept as applied once it took."""
        for path, manifest in item.manifests:
            await asyncio.to_thread(self.access.apply, path, manifest, item.manager)
        state = self.state(key)
        state.done = state.done.applied(item)
        log.info("%s/%s: %s", *key, item.note)

    async def tell_members(self, run: ElasticRun, tell: list[Slice]) -> None:
        """Write the slices ``tell``, in parallel, each kept as told once it took.

        A write that fails is left for the next reconcile, asked for
        :data:`ASSIGN_RETRY_SECONDS` later: no event of a slice brings one (the
        operator does not watch its own writes), and the members it places
        would wait for the next renewal of some Lease to wake the run.
        """
        key = (run.namespace, run.name)
        state = self.state(key)
        uid = run.uid
        if uid is None:
            return
        loop = asyncio.get_running_loop()
        failed: list[int] = []

        async def write(piece: Slice) -> None:
            path = slice_path(run.namespace, slice_name(uid, piece.index))
            try:
                await loop.run_in_executor(self._assigners, self.access.apply, path,
                                           piece.manifest(run.name, run.namespace, uid),
                                           SLICE_MANAGER)
            except (ApiError, ApiConnectionError) as exc:
                failed.append(piece.index)
                log.warning("%s/%s: writing slice %d of round %d failed: %s", *key,
                            piece.index, piece.round, exc)
                return
            state.done = state.done.wrote(piece)

        await asyncio.gather(*(write(piece) for piece in tell))
        if failed:
            self.retry(key, ASSIGN_RETRY_SECONDS)

    async def write_status(self, run: ElasticRun, status: RunStatus) -> ElasticRun | None:
        key = (run.namespace, run.name)
        try:
            raw = await asyncio.to_thread(self.gateway(key).replace_status,
                                          run.resource_version, status.to_dict(), COMPONENT)
        except ApiError as exc:
            if exc.not_found:
                return None
            raise
        if raw is None:
            return None
        self.accept(key, raw)
        return parse_run(raw)

    async def repair(self, key: Key, raw: Mapping[str, Any], plan: Repair,
                     error: str) -> None:
        """Write the planned repair of a hand-edited status the model cannot read.

        The error is kept as repaired once the write took; a lost write leaves it
        unrepaired and, as nobody else writes the run while its status is
        unreadable (no newer event may come to re-queue it), reads the run again.
        """
        meta = raw.get("metadata") or {}
        log.warning("%s/%s: invalid status (%s); repairing", *key, error)
        gateway = self.gateway(key)
        self.state(key).invalid_reported = error
        written = await asyncio.to_thread(gateway.replace_status, meta.get("resourceVersion"),
                                          plan.status, COMPONENT)
        if written is None:
            self.state(key).invalid_reported = None
            fresh = await asyncio.to_thread(gateway.read)
            if fresh is not None and newer(resource_version(fresh), resource_version(raw)):
                self.accept(key, fresh)
            self.enqueue(key)
            return
        self.accept(key, written)
        await self.post_events(parse_run(written), [plan.event])

    async def delete_orphaned_leases(self, key: Key, uid: str | None) -> None:
        await self.deleter.delete_orphaned_leases(key, uid)
