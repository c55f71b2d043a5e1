"""The operator's work queue: one reconcile at a time per run, woken by events and deadlines.

kopf delivers the watch events (ElasticRuns, Pods, Leases); this module keeps
the newest ElasticRun bodies, queues runs to reconcile, runs the pure
:func:`~elasticrun.operator.reconcile.reconcile`, and carries out its plan:
one compare-and-set of the status, Events, annotation clean-up, deletion.
A run is never reconciled by two workers at once (the queue holds each key at
most once), and a lost compare-and-set is simply reconciled again from the
next event.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import logging
import socket
from collections.abc import Coroutine, Iterable, Mapping
from typing import Any

from elasticrun.api import crd
from elasticrun.api.kube import (
    APPLY_PATCH,
    ApiConnectionError,
    ApiError,
    KubeClient,
    lease_path,
    leases_path,
    run_path,
)
from elasticrun.api.leases import LeaseState, lease_state, leases_of, run_leases_query
from elasticrun.api.model import (
    ElasticRun,
    InvalidRunError,
    RunStatus,
    format_time,
    now,
    parse_run,
)
from elasticrun.api.naming import lease_name
from elasticrun.operator import runrbac
from elasticrun.operator.apihealth import ApiAvailability
from elasticrun.operator.liveness import Loss, pod_loss, restart_count
from elasticrun.operator.metrics import Metrics
from elasticrun.operator.reconcile import Members, lost_since, reconcile, repair

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (namespace, run)
COMPONENT = "elasticrun-operator"


class Controller:
    def __init__(self, client: KubeClient, metrics: Metrics, workers: int = 2,
                 per_run_rbac: bool = False) -> None:
        self.client = client
        self.metrics = metrics
        self.workers = workers
        #: Give runs naming a ServiceAccount a Role of their own (elasticrun.operator.runrbac).
        self.per_run_rbac = per_run_rbac
        self._rbac_applied: dict[Key, str] = {}
        self.runs: dict[Key, dict[str, Any]] = {}
        self.pod_losses: dict[Key, dict[str, Loss]] = {}
        self.pod_restarts: dict[tuple[str, str], int] = {}
        self.lease_index: Mapping[Key, Iterable[tuple[str, LeaseState]]] | None = None
        self._seen: dict[Key, RunStatus] = {}
        self._invalid_reported: dict[Key, str] = {}
        #: The last problem reported per (run, node or ServiceAccount annotation): one Event each.
        self._problems_reported: dict[tuple[Key, str], str] = {}
        #: (uid, highest status.round seen) per run: a round going back is repaired.
        self._highest_round: dict[Key, tuple[str | None, int]] = {}
        self._queue: asyncio.Queue[Key] | None = None
        self._queued: set[Key] = set()
        self._timers: dict[Key, asyncio.TimerHandle] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[None]] = set()
        self._instance = socket.gethostname()
        self.api = ApiAvailability(client, on_change=metrics.api_changed)

    # ------------------------------------------------------------------ queue

    def start(self) -> None:
        self._queue = asyncio.Queue()
        self._tasks += [asyncio.create_task(self._worker(), name=f"elasticrun-worker-{i}")
                        for i in range(self.workers)]
        self._tasks.append(asyncio.create_task(self.api.run(), name="elasticrun-api-probe"))

    def keep(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` until the controller stops (a side task, e.g. the caBundle check)."""
        self._tasks.append(asyncio.create_task(work))

    async def stop(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def enqueue(self, key: Key) -> None:
        if self._queue is None or key in self._queued:
            return
        self._queued.add(key)
        self._queue.put_nowait(key)

    def schedule(self, key: Key, when: dt.datetime) -> None:
        delay = max(0.0, (when - now()).total_seconds())
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        loop = asyncio.get_running_loop()
        self._timers[key] = loop.call_later(delay, self.enqueue, key)

    async def _worker(self) -> None:
        assert self._queue is not None
        while True:
            key = await self._queue.get()
            self._queued.discard(key)
            try:
                await self.reconcile(key)
            except (ApiError, ApiConnectionError) as exc:
                log.warning("reconciling %s/%s failed: %s; retrying in 1s", *key, exc)
                self.schedule(key, now() + dt.timedelta(seconds=1))
            except Exception:
                log.exception("reconciling %s/%s failed; retrying in 5s", *key)
                self.schedule(key, now() + dt.timedelta(seconds=5))

    # ------------------------------------------------------------------ inputs from kopf

    def run_event(self, event_type: str, body: Mapping[str, Any]) -> None:
        meta = body.get("metadata") or {}
        key = (meta.get("namespace", ""), meta.get("name", ""))
        if event_type == "DELETED":
            self.runs.pop(key, None)
            self._seen.pop(key, None)
            self._highest_round.pop(key, None)
            self._rbac_applied.pop(key, None)
            self.pod_losses.pop(key, None)
            self._problems_reported = {k: v for k, v in self._problems_reported.items()
                                       if k[0] != key}
            self.metrics.forget(*key)
            self._in_background(self._delete_orphaned_leases(key, meta.get("uid")))
            return
        raw = dict(body)
        current = self.runs.get(key)
        if current is not None and _rv(current) > _rv(raw) > 0:
            return  # our own write already gave us something newer
        self.runs[key] = raw
        self.observe(key, raw)
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

    # ------------------------------------------------------------------ reconcile

    def _members(self, key: Key) -> Members:
        leases: dict[str, LeaseState] = {}
        if self.lease_index is not None and key in self.lease_index:
            for node, state in self.lease_index[key]:
                leases[node] = state
        return self._members_from(key, leases)

    def _members_from(self, key: Key, leases: dict[str, LeaseState]) -> Members:
        return Members(leases=leases, pod_losses=dict(self.pod_losses.get(key, {})),
                       lease_clock_start=self.api.lease_clock_start(now()))

    async def _listed_members(self, key: Key) -> Members:
        leases = {}
        for item in await self._run_leases(*key):
            state = lease_state(item)
            if state.node:
                leases[state.node] = state
        return self._members_from(key, leases)

    async def reconcile(self, key: Key) -> None:
        raw = self.runs.get(key)
        if raw is None:
            return
        try:
            run = parse_run(raw)
            self._check_round(key, run)
        except InvalidRunError as exc:
            await self._repair(key, raw, exc)
            return
        self._invalid_reported.pop(key, None)
        if self.per_run_rbac:
            await self._ensure_rbac(key, run)
        members = self._members(key)
        for node, state in members.leases.items():
            await self._report_once(run, node, "UnreadableJoin", state.problem)
        plan = reconcile(run, members, now())
        if plan.sealed or plan.delete_leases:
            # The Lease index comes from another watch than the run and may lag
            # behind it (always so right after a start).  Sealing a round or
            # removing a member acts on Lease data, so decide again from a
            # consistent LIST, which is at least as new as the run we hold.
            plan = reconcile(run, await self._listed_members(key), now())
        if plan.delete_run:
            await self._delete(run)
            return
        if plan.status is not None:
            written = await self._write_status(run, plan.status)
            if written is None:
                return  # lost the race; the winner's event re-queues us
            run = written
        for node in plan.delete_leases:
            await self._delete_object(lease_path(run.namespace, lease_name(run.name, node)))
        if plan.remove_annotations:
            # Only after the status write took: a lost race must not eat the request.
            patch = {"metadata": {"annotations": dict.fromkeys(plan.remove_annotations)}}
            await asyncio.to_thread(self.client.request, "PATCH", run_path(*key), body=patch,
                                    content_type="application/merge-patch+json")
        for type_, reason, message in plan.events:
            await self._post_event(run, type_, reason, message)
        self._forget_stale_losses(key, run)
        if plan.wake_at is not None:
            self.schedule(key, plan.wake_at)

    async def _ensure_rbac(self, key: Key, run: ElasticRun) -> None:
        """The run's own Role and RoleBinding, with the Leases its nodes created so far.

        Applied only when they change (a node's Lease appears), so a reconcile
        costs no RBAC write; a Lease event re-queues the run, and the node's
        Lease is in the Role before its first renewal.
        """
        account = run.annotations.get(runrbac.SERVICE_ACCOUNT_ANNOTATION)
        if not account:
            return
        problem = runrbac.service_account_problem(account)
        await self._report_once(run, runrbac.SERVICE_ACCOUNT_ANNOTATION, "InvalidServiceAccount",
                                problem)
        if problem is not None:
            return  # nothing to apply; the rest of the run is reconciled as usual
        nodes = [node for node, _ in self.lease_index.get(key, ())] \
            if self.lease_index is not None else []
        role = runrbac.role(run.name, run.namespace, run.uid, nodes)
        binding = runrbac.role_binding(run.name, run.namespace, run.uid, account)
        fingerprint = json.dumps([role, binding], sort_keys=True)
        if self._rbac_applied.get(key) == fingerprint:
            return
        for manifest in (role, binding):
            await asyncio.to_thread(
                self.client.request, "PATCH",
                runrbac.path(manifest["kind"], run.namespace, run.name), body=manifest,
                query={"fieldManager": runrbac.MANAGER, "force": "true"},
                content_type=APPLY_PATCH)
        self._rbac_applied[key] = fingerprint
        log.info("%s/%s: Role %s allows ServiceAccount %s this run and %d Lease(s)", *key,
                 runrbac.object_name(run.name), account, len(set(nodes)))

    async def _report_once(self, run: ElasticRun, subject: str, reason: str,
                           problem: str | None) -> None:
        """One Warning Event per new problem with something a pod wrote; nothing is retried."""
        key = ((run.namespace, run.name), subject)
        if problem is None:
            self._problems_reported.pop(key, None)
            return
        if self._problems_reported.get(key) == problem:
            return
        self._problems_reported[key] = problem
        log.warning("%s/%s: %s", run.namespace, run.name, problem)
        await self._post_event(run, "Warning", reason, problem)

    async def _write_status(self, run: ElasticRun, status: RunStatus) -> ElasticRun | None:
        key = (run.namespace, run.name)
        body = {"apiVersion": crd.API_VERSION, "kind": crd.KIND,
                "metadata": {"name": run.name, "namespace": run.namespace,
                             "resourceVersion": run.resource_version},
                "status": status.to_dict()}
        try:
            raw = await asyncio.to_thread(
                self.client.request, "PUT", run_path(*key, "status"), body=body,
                query={"fieldManager": COMPONENT})
        except ApiError as exc:
            if exc.conflict or exc.not_found:
                return None
            raise
        if key not in self.runs:
            return None  # deleted while we wrote: keep no state (or metric series) for it
        self.runs[key] = raw
        self.observe(key, raw)
        return parse_run(raw)

    def _check_round(self, key: Key, run: ElasticRun) -> None:
        """Rounds only move forward: a lower one (a status restored or edited) is invalid.

        Each such status reads fine on its own; members that saw the higher
        round refuse it, so it is repaired like an unreadable one, from the
        highest round this operator saw (forgotten when it restarts; the
        handlers still refuse).
        """
        uid, highest = self._highest_round.get(key, (None, 0))
        if uid != run.uid:
            highest = 0
        if run.status.round < highest:
            raise InvalidRunError("status.round", f"went back from {highest} to "
                                  f"{run.status.round}; rounds only move forward")
        self._highest_round[key] = (run.uid, max(highest, run.status.round))

    async def _repair(self, key: Key, raw: Mapping[str, Any], error: InvalidRunError) -> None:
        """A hand-edited status the model cannot read: make every node re-form a round."""
        if self._invalid_reported.get(key) == str(error):
            return
        self._invalid_reported[key] = str(error)
        meta = raw.get("metadata") or {}
        log.warning("%s/%s: invalid status (%s); repairing", *key, error)
        uid, highest = self._highest_round.get(key, (None, 0))
        status = repair(raw.get("status"), error, now(), int(meta.get("generation") or 0),
                        min_round=highest if uid == meta.get("uid") else 0)
        body = {"apiVersion": crd.API_VERSION, "kind": crd.KIND,
                "metadata": {"name": key[1], "namespace": key[0],
                             "resourceVersion": meta.get("resourceVersion")},
                "status": status}
        try:
            written = await asyncio.to_thread(self.client.request, "PUT",
                                              run_path(*key, "status"), body=body,
                                              query={"fieldManager": COMPONENT})
        except ApiError as exc:
            if exc.conflict:
                # Our copy is stale.  While the status is unreadable nobody else
                # writes the run, so no newer event may come to re-queue it: read it.
                self._invalid_reported.pop(key, None)
                fresh = await asyncio.to_thread(self.client.request, "GET", run_path(*key))
                if _rv(fresh) > _rv(self.runs.get(key) or {}):
                    self.runs[key] = fresh
                self.enqueue(key)
                return
            raise
        self.runs[key] = written
        await self._post_event(parse_run(written), "Warning", "InvalidStatus",
                               f"status could not be read ({error}); the round is re-formed")

    async def _delete(self, run: ElasticRun) -> None:
        key = (run.namespace, run.name)
        await self._post_event(run, "Normal", "Deleted",
                               "TTL after finishing passed; deleting the run and its Leases")
        # The run goes last: should the operator stop half-way, the run is still
        # there, finished, and the next reconcile deletes what is left.
        for lease in await self._run_leases(*key):
            await self._delete_object(lease_path(run.namespace, lease["metadata"]["name"]))
        if self.per_run_rbac:  # owned by the run, but a cluster may run no garbage collector
            for kind in ("RoleBinding", "Role"):
                await self._delete_object(runrbac.path(kind, run.namespace, run.name))
        await self._delete_object(run_path(*key))

    async def _delete_orphaned_leases(self, key: Key, uid: str | None) -> None:
        """Delete the Leases a deleted run owned, as the garbage collector would.

        Not only tidiness: a waiting node cannot see its run's deletion through
        its narrow watch, but its next Lease renewal finds the Lease gone and
        makes it look.  Leases of a run re-created under the same name have
        another owner uid and stay.
        """
        if not uid:
            return
        try:
            for item in await self._run_leases(*key):
                if lease_state(item).owner_uid == uid:
                    await self._delete_object(lease_path(key[0], item["metadata"]["name"]))
        except (ApiError, ApiConnectionError) as exc:
            log.warning("deleting the Leases of deleted run %s/%s failed: %s", *key, exc)

    async def _delete_object(self, path: str) -> None:
        """DELETE; an object already gone is fine, anything else is logged and left."""
        try:
            await asyncio.to_thread(self.client.request, "DELETE", path)
        except ApiError as exc:
            if not exc.not_found:
                log.warning("DELETE %s failed: %s", path, exc)

    async def _run_leases(self, namespace: str, run: str) -> list[dict[str, Any]]:
        """The run's Leases, from a consistent LIST."""
        listed = await asyncio.to_thread(self.client.request, "GET", leases_path(namespace),
                                         query=run_leases_query(run))
        return leases_of(listed, run)

    def _forget_stale_losses(self, key: Key, run: ElasticRun) -> None:
        losses = self.pod_losses.get(key)
        if not losses:
            return
        referenced = {p.pod or p.name for p in run.status.participants}
        referenced |= {w.pod or w.name for w in run.status.waiting}
        for pod in list(losses):
            if pod not in referenced:
                del losses[pod]

    # ------------------------------------------------------------------ observation

    def observe(self, key: Key, raw: Mapping[str, Any]) -> None:
        """Events and metrics for what changed, whoever wrote it (node or operator)."""
        try:
            run = parse_run(raw)
        except InvalidRunError:
            return
        status = run.status
        old = self._seen.get(key)
        self._seen[key] = status
        labels = {"namespace": key[0], "run": key[1]}
        self.metrics.members.labels(**labels).set(len(status.participants))
        self.metrics.waiting.labels(**labels).set(len(status.waiting))
        self.metrics.round.labels(**labels).set(status.round)
        if old is None:
            return  # first sight (e.g. after a restart): nothing to report twice
        if status.round > old.round and status.participants:
            self.metrics.rounds.labels(**labels).inc()
            started = [p.since for p in status.participants if p.since]
            if started and status.sealed_at:
                self.metrics.round_duration.labels(**labels).observe(
                    max(0.0, (status.sealed_at - min(started)).total_seconds()))
            leader = status.participants[0].name
            self._post_soon(run, "Normal", "RoundSealed",
                            f"round {status.round}: {len(status.participants)} members, "
                            f"rank 0 = {leader}")
        for lost in lost_since(old, status):
            self.metrics.lost_member(*key, lost.reason, lost.detection_seconds)
            self._post_soon(run, "Warning" if lost.reason != "Left" else "Normal", "MemberLost",
                            f"round {lost.round}: {lost.name} removed ({lost.reason}"
                            f"{': ' + lost.message if lost.message else ''})")

    def _post_soon(self, run: ElasticRun, type_: str, reason: str, message: str) -> None:
        self._in_background(self._post_event(run, type_, reason, message))

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)  # keep a reference until it is done
        task.add_done_callback(self._background.discard)

    async def _post_event(self, run: ElasticRun, type_: str, reason: str, message: str) -> None:
        stamp = format_time(now())
        event = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{run.name}.", "namespace": run.namespace},
            "involvedObject": {"apiVersion": crd.API_VERSION, "kind": crd.KIND,
                               "name": run.name, "namespace": run.namespace, "uid": run.uid,
                               "resourceVersion": run.resource_version},
            "type": type_, "reason": reason, "message": message[:1024],
            "firstTimestamp": stamp.split(".")[0] + "Z", "lastTimestamp":
                stamp.split(".")[0] + "Z", "count": 1,
            "source": {"component": COMPONENT},
            "reportingComponent": f"{crd.GROUP}/operator", "reportingInstance": self._instance,
        }
        try:
            await asyncio.to_thread(self.client.request, "POST",
                                    f"/api/v1/namespaces/{run.namespace}/events", body=event)
        except (ApiError, ApiConnectionError) as exc:
            log.warning("posting event %s for %s/%s failed: %s", reason, run.namespace,
                        run.name, exc)


def _rv(raw: Mapping[str, Any]) -> int:
    value = str((raw.get("metadata") or {}).get("resourceVersion") or "0")
    return int(value) if value.isdigit() else 0
