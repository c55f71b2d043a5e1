"""The operator's deletions: one observed Lease, a deleted run's Leases, a finished run.

Every deletion names the object observed (``preconditions.uid``) where there is
one, so a Lease re-created under the same name meanwhile is left alone; an
object already gone is fine.
"""

from __future__ import annotations

import asyncio
import logging
import time

from elasticrun.api.gateway import OperatorAccess, RunControl
from elasticrun.api.kube import ApiConnectionError, ApiError
from elasticrun.api.leases import LeaseState, lease_state, owned_by
from elasticrun.api.model import ElasticRun
from elasticrun.operator.observer import Observer
from elasticrun.operator.runstate import Key, RunState

log = logging.getLogger(__name__)

#: First pause (s) before a Lease whose deletion failed is tried again; doubles per failure.
DELETE_BACKOFF = 1.0
DELETE_BACKOFF_MAX = 60.0


class Deleter:
    """Carries out the deletions of plans; ``states`` is where failed Lease deletions are
    remembered (:attr:`RunState.delete_failures`)."""

    def __init__(self, access: OperatorAccess, observer: Observer,
                 states: dict[Key, RunState]) -> None:
        self.access = access
        self.observer = observer
        self.states = states

    def gateway(self, key: Key) -> RunControl:
        return self.access.run(*key)

    async def delete_run(self, run: ElasticRun, objects: list[str]) -> None:
        """Delete the run's Leases, its own ``objects`` (paths), then the run.

        The run goes last: should the operator stop half-way, the run is still
        there, finished, and the next reconcile deletes what is left.
        """
        gateway = self.gateway((run.namespace, run.name))
        for item in await asyncio.to_thread(gateway.leases):
            lease = lease_state(item)
            if owned_by(lease, run.name, run.uid) and lease.name:
                await self.delete_object(gateway.lease_path(lease.name), lease.uid)
        for path in objects:
            await self.delete_object(path)
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

    async def delete_lease(self, run: ElasticRun, lease: LeaseState) -> None:
        """Delete one observed Lease of the run: that object (``preconditions.uid``) or none.

        A Lease that could not be deleted is tried again only after a back-off
        that doubles per failure (``DELETE_BACKOFF``), with one Warning Event,
        so an object the operator may not delete costs a few requests, not a
        loop.  A 404 or a 409 (gone, or another object under that name now) is
        the end of it.
        """
        assert lease.name is not None and lease.uid is not None
        key = (run.namespace, run.name)
        tried = self.states.setdefault(key, RunState()).delete_failures
        failures, retry_at = tried.get(lease.uid, (0, 0.0))
        clock = time.monotonic()
        if clock < retry_at:
            return
        try:
            await asyncio.to_thread(self.access.delete, self.gateway(key).lease_path(lease.name),
                                    lease.uid)
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
            await asyncio.to_thread(self.access.delete, path, uid)
        except ApiError as exc:
            if not exc.not_found:
                log.warning("DELETE %s failed: %s", path, exc)
