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
import datetime as dt
import logging
from collections.abc import Coroutine, Iterable, Mapping
from typing import Any

from elasticrun.api import crd
from elasticrun.api.kube import KubeClient
from elasticrun.api.leases import LeaseState, lease_state
from elasticrun.api.model import ElasticRun, InvalidRunError, now, parse_run
from elasticrun.api.ordering import RoundMark, older
from elasticrun.operator.apihealth import ApiAvailability
from elasticrun.operator.executor import PlanExecutor
from elasticrun.operator.liveness import Loss, pod_loss, restart_count
from elasticrun.operator.metrics import Metrics
from elasticrun.operator.observer import COMPONENT, Observer
from elasticrun.operator.reconcile import Members, reconcile
from elasticrun.operator.workqueue import Key, WorkQueue

__all__ = ["COMPONENT", "Controller", "Key"]

log = logging.getLogger(__name__)


class Controller:
    def __init__(self, client: KubeClient, metrics: Metrics, workers: int = 2,
                 per_run_rbac: bool = False, store_policy_port: int | None = None) -> None:
        self.client = client
        self.metrics = metrics
        self.runs: dict[Key, dict[str, Any]] = {}
        self.pod_losses: dict[Key, dict[str, Loss]] = {}
        self.pod_restarts: dict[tuple[str, str], int] = {}
        self.lease_index: Mapping[Key, Iterable[tuple[str, LeaseState]]] | None = None
        #: The highest status.round seen per run: a round going back is repaired.
        self._round_marks: dict[Key, RoundMark] = {}
        self.queue = WorkQueue(self.reconcile, workers)
        self.observer = Observer(client, metrics)
        self.executor = PlanExecutor(client, self.observer, self._accept_written, self.enqueue,
                                     per_run_rbac, store_policy_port)
        self.api = ApiAvailability(client, on_change=metrics.api_changed)
        #: Side tasks that live as long as the controller: the API probe, the caBundle check.
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self.queue.start()
        self.keep(self.api.run())

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
            self.runs.pop(key, None)
            self._round_marks.pop(key, None)
            self.pod_losses.pop(key, None)
            self.observer.forget(key)
            self.executor.forget(key)
            self.observer.in_background(
                self.executor.delete_orphaned_leases(key, meta.get("uid")))
            return
        raw = dict(body)
        current = self.runs.get(key)
        if current is not None and older(raw, current):
            return  # our own write already gave us something newer
        self._accept(key, raw)
        self.enqueue(key)

    def pod_event(self, event_type: str, body: Mapping[str, Any]) -> None:
        meta = body.get("metadata") or {}
        namespace, pod = meta.get("namespace", ""), meta.get("name", "")
        labels = meta.get("labels") or {}
        run = (meta.get("annotations") or {}).get(crd.RUN_LABEL) or labels.get(crd.RUN_LABEL)
        if not run:
            return
        key = (namespace, run)
        first = self.pod_restarts.setdefault((namespace, pod), restart_count(body))
        loss = pod_loss(body, event_type, first)
        if event_type == "DELETED":
            self.pod_restarts.pop((namespace, pod), None)
        losses = self.pod_losses.setdefault(key, {})
        if loss is None:
            losses.pop(pod, None)
            return
        if pod not in losses:
            log.info("%s/%s: %s", namespace, run, loss.message)
        losses[pod] = loss
        self.enqueue(key)

    def lease_event(self, body: Mapping[str, Any]) -> None:
        meta = body.get("metadata") or {}
        run = (meta.get("annotations") or {}).get(crd.RUN_LABEL)
        if run:
            self.enqueue((meta.get("namespace", ""), run))

    def _accept(self, key: Key, raw: dict[str, Any]) -> None:
        """Keep ``raw`` as the newest copy of the run, and report what changed."""
        self.runs[key] = raw
        self.observer.observe(key, raw)

    def _accept_written(self, key: Key, raw: dict[str, Any]) -> None:
        """A copy the operator wrote; dropped if the run was deleted meanwhile, so that
        no state (or metric series) of a deleted run comes back."""
        if key in self.runs:
            self._accept(key, raw)

    # ------------------------------------------------------------------ reconcile

    def _indexed_leases(self, key: Key) -> dict[str, LeaseState]:
        leases: dict[str, LeaseState] = {}
        if self.lease_index is not None and key in self.lease_index:
            for node, state in self.lease_index[key]:
                leases[node] = state
        return leases

    async def _listed_leases(self, key: Key) -> dict[str, LeaseState]:
        leases = {}
        for item in await asyncio.to_thread(self.executor.gateway(key).leases):
            state = lease_state(item)
            if state.node:
                leases[state.node] = state
        return leases

    def _members(self, key: Key, leases: dict[str, LeaseState]) -> Members:
        return Members(leases=leases, pod_losses=dict(self.pod_losses.get(key, {})),
                       lease_clock_start=self.api.lease_clock_start(now()))

    async def reconcile(self, key: Key) -> None:
        raw = self.runs.get(key)
        if raw is None:
            return
        mark = self._round_marks.get(key, RoundMark())
        try:
            run = parse_run(raw)
            self._round_marks[key] = mark.advance(run)
        except InvalidRunError as exc:
            uid = (raw.get("metadata") or {}).get("uid")
            await self.executor.repair(key, raw, exc, min_round=mark.floor(uid))
            return
        self.executor.readable(key)
        await self.executor.ensure_network_policy(run)
        await self.executor.ensure_rbac(run, [n for n in self._indexed_leases(key)])
        indexed = self._indexed_leases(key)
        for node, state in indexed.items():
            await self.observer.report_once(run, node, "UnreadableJoin", state.problem)
        plan = reconcile(run, self._members(key, indexed), now())
        if plan.sealed or plan.delete_leases:
            # The Lease index comes from another watch than the run and may lag
            # behind it (always so right after a start).  Sealing a round or
            # removing a member acts on Lease data, so decide again from a
            # consistent LIST, which is at least as new as the run we hold.
            plan = reconcile(run, self._members(key, await self._listed_leases(key)), now())
        written = await self.executor.carry_out(run, plan)
        if written is None:
            return
        self._forget_stale_losses(key, written)
        if plan.wake_at is not None:
            self.schedule(key, plan.wake_at)

    def _forget_stale_losses(self, key: Key, run: ElasticRun) -> None:
        losses = self.pod_losses.get(key)
        if not losses:
            return
        referenced = {p.pod or p.name for p in run.status.participants}
        referenced |= {w.pod or w.name for w in run.status.waiting}
        for pod in list(losses):
            if pod not in referenced:
                del losses[pod]
