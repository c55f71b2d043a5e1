"""Carries out what :func:`~elasticrun.operator.reconcile.reconcile` planned for one run.

Every write goes through :class:`~elasticrun.api.gateway.RunGateway` (the same
compare-and-set the nodes use) from a worker thread.  A lost compare-and-set is
not an error: the winner's write comes back as an event and the run is
reconciled again from it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from elasticrun.api.gateway import RunGateway
from elasticrun.api.kube import APPLY_PATCH, ApiConnectionError, ApiError, KubeClient
from elasticrun.api.leases import LeaseState, lease_state, owned_by
from elasticrun.api.model import Assignment, ElasticRun, InvalidRunError, RunStatus, now, parse_run
from elasticrun.api.ordering import newer, resource_version
from elasticrun.operator import netpol, runrbac
from elasticrun.operator.observer import COMPONENT, Observer
from elasticrun.operator.reconcile import Plan, repair
from elasticrun.operator.runstate import RunState

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (namespace, run)

#: Assignment writes in flight at once: a round of 2,048 members is told in
#: parallel, as the nodes wrote their joins, rather than one write after another.
ASSIGN_CONCURRENCY = 16
#: First pause (s) before a Lease whose deletion failed is tried again; doubles per failure.
DELETE_BACKOFF = 1.0
DELETE_BACKOFF_MAX = 60.0


class PlanExecutor:
    """The operator's writes.  ``accept`` keeps a copy the operator wrote (or read) as the
    newest; ``enqueue`` asks for another reconcile of a run."""

    def __init__(self, client: KubeClient, observer: Observer,
                 accept: Callable[[Key, dict[str, Any]], None],
                 enqueue: Callable[[Key], None], per_run_rbac: bool = False,
                 store_policy_port: int | None = None,
                 states: dict[Key, RunState] | None = None) -> None:
        self.client = client
        #: Give every run a NetworkPolicy of its own for this store port (0: any port;
        #: None: none), elasticrun.operator.netpol.
        self.store_policy_port = store_policy_port
        #: Give runs naming a ServiceAccount a Role of their own (elasticrun.operator.runrbac).
        self.per_run_rbac = per_run_rbac
        self.observer = observer
        self.accept = accept
        self.enqueue = enqueue
        #: The controller's run states (:class:`RunState`), where what was applied,
        #: told and repaired is kept.
        self.states: dict[Key, RunState] = {} if states is None else states
        #: Threads of their own: the default pool has cores + 4 threads, and a
        #: large round's assignments would queue behind each other there.
        self._assigners = ThreadPoolExecutor(ASSIGN_CONCURRENCY,
                                             thread_name_prefix="elasticrun-assign")

    def gateway(self, key: Key) -> RunGateway:
        return RunGateway(self.client, *key)

    def state(self, key: Key) -> RunState:
        return self.states.setdefault(key, RunState())

    def readable(self, key: Key) -> None:
        """The run's status reads again: a later invalid one is reported anew."""
        self.state(key).invalid_reported = None

    async def carry_out(self, run: ElasticRun, plan: Plan,
                        leases: Mapping[str, LeaseState] | None = None) -> ElasticRun | None:
        """Apply ``plan``; the run as written, or None when the plan is void (race, deletion).

        ``leases`` are the Leases the plan was decided from, each a genuine
        Lease of the run (:func:`~elasticrun.api.leases.owned_by`): a Lease is
        deleted or written only as that observed object (its name, its uid),
        never under a name computed from a node's.
        """
        leases = leases or {}
        key = (run.namespace, run.name)
        if plan.delete_run:
            await self.delete_run(run)
            return None
        if plan.status is not None:
            written = await self.write_status(run, plan.status)
            if written is None:
                return None  # lost the race; the winner's event re-queues us
            run = written
        gateway = self.gateway(key)
        if plan.assignments:
            await self.tell_members(gateway, key, plan.assignments, leases)
        for node in plan.delete_leases:
            lease = leases.get(node)
            if lease is not None and owned_by(lease, run.name, run.uid):
                await self.delete_lease(run, gateway, lease)
        if plan.remove_annotations:
            # Only after the status write took: a lost race must not eat the request.
            await asyncio.to_thread(gateway.remove_annotations, plan.remove_annotations)
        for type_, reason, message in plan.events:
            await self.observer.post_event(run, type_, reason, message)
        return run

    async def tell_members(self, gateway: RunGateway, key: Key,
                           assignments: list[tuple[str, Assignment]],
                           leases: Mapping[str, LeaseState]) -> None:
        """Write each member's assignment on its Lease, in parallel, each at most once.

        A write that fails is left for the next reconcile (the member's Lease
        event brings one); a member without a Lease is gone and will be removed.
        The write names the uid of the Lease observed, so it lands on that
        object or nowhere.
        """
        round_number = assignments[0][1].round
        state = self.state(key)
        told_round, told = state.told
        if told_round != round_number:
            told = set()
            state.told = (round_number, told)
        loop = asyncio.get_running_loop()

        async def tell(node: str, assignment: Assignment) -> None:
            lease = leases.get(node)
            if lease is None or lease.uid is None:
                return
            try:
                if await loop.run_in_executor(self._assigners, gateway.assign, node,
                                              assignment, lease.uid):
                    told.add(node)
            except (ApiError, ApiConnectionError) as exc:
                log.warning("%s/%s: telling %s its place in round %d failed: %s", *key,
                            node, round_number, exc)

        await asyncio.gather(*(tell(node, assignment) for node, assignment in assignments
                               if node not in told))

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

    async def repair(self, key: Key, raw: Mapping[str, Any], error: InvalidRunError,
                     min_round: int) -> None:
        """A hand-edited status the model cannot read: make every node re-form a round."""
        state = self.state(key)
        if state.invalid_reported == str(error):
            return
        state.invalid_reported = str(error)
        meta = raw.get("metadata") or {}
        log.warning("%s/%s: invalid status (%s); repairing", *key, error)
        status = repair(raw.get("status"), error, now(), int(meta.get("generation") or 0),
                        min_round=min_round)
        gateway = self.gateway(key)
        written = await asyncio.to_thread(gateway.replace_status, meta.get("resourceVersion"),
                                          status, COMPONENT)
        if written is None:
            # Our copy is stale.  While the status is unreadable nobody else
            # writes the run, so no newer event may come to re-queue it: read it.
            state.invalid_reported = None
            fresh = await asyncio.to_thread(gateway.read)
            if fresh is not None and newer(resource_version(fresh), resource_version(raw)):
                self.accept(key, fresh)
            self.enqueue(key)
            return
        self.accept(key, written)
        await self.observer.post_event(parse_run(written), "Warning", "InvalidStatus",
                                       f"status could not be read ({error}); the round is "
                                       "re-formed")

    async def ensure_rbac(self, run: ElasticRun, leases: Mapping[str, LeaseState]) -> None:
        """The run's own Role and RoleBinding, with its Leases (:func:`runrbac.lease_names`).

        Applied only when they change (a node's Lease appears), so a reconcile
        costs no RBAC write; a Lease event re-queues the run, and the node's
        Lease is in the Role before its first renewal.
        """
        account = run.annotations.get(runrbac.SERVICE_ACCOUNT_ANNOTATION)
        if not self.per_run_rbac or not account:
            return
        problem = runrbac.service_account_problem(account)
        await self.observer.report_once(run, runrbac.SERVICE_ACCOUNT_ANNOTATION,
                                        "InvalidServiceAccount", problem)
        if problem is not None:
            return  # nothing to apply; the rest of the run is reconciled as usual
        key = (run.namespace, run.name)
        names = runrbac.lease_names(run, leases)
        role = runrbac.role(run.name, run.namespace, run.uid, names)
        binding = runrbac.role_binding(run.name, run.namespace, run.uid, account)
        fingerprint = json.dumps([role, binding], sort_keys=True)
        state = self.state(key)
        if state.rbac_applied == fingerprint:
            return
        for manifest in (role, binding):
            await asyncio.to_thread(
                self.client.request, "PATCH",
                runrbac.path(manifest["kind"], run.namespace, run.name), body=manifest,
                query={"fieldManager": runrbac.MANAGER, "force": "true"},
                content_type=APPLY_PATCH)
        state.rbac_applied = fingerprint
        log.info("%s/%s: Role %s allows ServiceAccount %s this run and %d Lease(s)", *key,
                 runrbac.object_name(run.name), account, len(names))

    async def ensure_network_policy(self, run: ElasticRun) -> None:
        """The run's own NetworkPolicy (:mod:`.netpol`), applied only when it changes."""
        if self.store_policy_port is None:
            return
        key = (run.namespace, run.name)
        manifest = netpol.policy(run.name, run.namespace, run.uid, self.store_policy_port)
        fingerprint = json.dumps(manifest, sort_keys=True)
        state = self.state(key)
        if state.policy_applied == fingerprint:
            return
        await asyncio.to_thread(
            self.client.request, "PATCH", netpol.path(run.namespace, run.name), body=manifest,
            query={"fieldManager": netpol.MANAGER, "force": "true"}, content_type=APPLY_PATCH)
        state.policy_applied = fingerprint
        log.info("%s/%s: NetworkPolicy %s admits only the run's pods to %s", *key,
                 netpol.object_name(run.name),
                 f"port {self.store_policy_port}" if self.store_policy_port else "its pods")

    async def delete_run(self, run: ElasticRun) -> None:
        key = (run.namespace, run.name)
        await self.observer.post_event(
            run, "Normal", "Deleted", "TTL after finishing passed; deleting the run and its Leases")
        # The run goes last: should the operator stop half-way, the run is still
        # there, finished, and the next reconcile deletes what is left.
        gateway = self.gateway(key)
        for item in await asyncio.to_thread(gateway.leases):
            lease = lease_state(item)
            if owned_by(lease, run.name, run.uid) and lease.name:
                await self.delete_object(gateway.lease_path(lease.name), lease.uid)
        if self.per_run_rbac:  # owned by the run, but a cluster may run no garbage collector
            for kind in ("RoleBinding", "Role"):
                await self.delete_object(runrbac.path(kind, run.namespace, run.name))
        if self.store_policy_port is not None:
            await self.delete_object(netpol.path(run.namespace, run.name))
        await self.delete_object(gateway.path)

    async def delete_orphaned_leases(self, key: Key, uid: str | None) -> None:
        """Delete the Leases a deleted run owned, as the garbage collector would.

        Not only tidiness: a waiting node cannot see its run's deletion through
        its narrow watch, but its next Lease renewal finds the Lease gone and
        makes it look.  Leases of a run re-created under the same name have
        another owner uid and stay.
        """
        if not uid:
            return
        gateway = self.gateway(key)
        try:
            for item in await asyncio.to_thread(gateway.leases):
                lease = lease_state(item)
                if owned_by(lease, key[1], uid) and lease.name:
                    await self.delete_object(gateway.lease_path(lease.name), lease.uid)
        except (ApiError, ApiConnectionError) as exc:
            log.warning("deleting the Leases of deleted run %s/%s failed: %s", *key, exc)

    async def delete_lease(self, run: ElasticRun, gateway: RunGateway,
                           lease: LeaseState) -> None:
        """Delete one observed Lease of the run: that object (``preconditions.uid``) or none.

        A Lease that could not be deleted is tried again only after a back-off
        that doubles per failure (``DELETE_BACKOFF``), with one Warning Event,
        so an object the operator may not delete costs a few requests, not a
        loop.  A 404 or a 409 (gone, or another object under that name now) is
        the end of it.
        """
        assert lease.name is not None and lease.uid is not None
        key = (run.namespace, run.name)
        tried = self.state(key).delete_failures
        failures, retry_at = tried.get(lease.uid, (0, 0.0))
        clock = time.monotonic()
        if clock < retry_at:
            return
        try:
            await asyncio.to_thread(
                self.client.request, "DELETE", gateway.lease_path(lease.name),
                body=_preconditions(lease.uid))
        except ApiError as exc:
            if exc.not_found or exc.conflict:
                tried.pop(lease.uid, None)
                return
            backoff = min(DELETE_BACKOFF * 2 ** failures, DELETE_BACKOFF_MAX)
            tried[lease.uid] = (failures + 1, clock + backoff)
            log.warning("%s/%s: deleting Lease %s failed (%s); next try in %gs", *key,
                        lease.name, exc, backoff)
            if failures == 0:
                await self.observer.post_event(
                    run, "Warning", "LeaseNotDeleted",
                    f"Lease {lease.name} of node {lease.node} could not be deleted: "
                    f"{str(exc)[:200]}")
            return
        except ApiConnectionError as exc:
            log.warning("%s/%s: deleting Lease %s failed: %s", *key, lease.name, exc)
            return
        tried.pop(lease.uid, None)

    async def delete_object(self, path: str, uid: str | None = None) -> None:
        """DELETE (of the object with ``uid`` only, when given); an object already gone is
        fine, anything else is logged and left."""
        try:
            await asyncio.to_thread(self.client.request, "DELETE", path,
                                    body=_preconditions(uid) if uid else None)
        except ApiError as exc:
            if not exc.not_found:
                log.warning("DELETE %s failed: %s", path, exc)


def _preconditions(uid: str) -> dict[str, Any]:
    """DeleteOptions that delete the object with this uid, or nothing (409)."""
    return {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"uid": uid}}
