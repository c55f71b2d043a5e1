"""The node's own Lease, watched for the assignment the operator writes there.

In the largest runs (:func:`elasticrun.api.rounds.members_told_by_lease`) the
operator's seal does not move the run's ``signal``: sending the whole roster to
every node is the one part of a round whose bytes grow as N².  It writes each
member's place in the round on the member's Lease instead.  This watch selects
that one Lease by name, which the API server's watch cache dispatches by name,
so a node receives its own Lease's events and nobody else's: its renewals, its
join request, and its assignment.  It runs only while ``next_rendezvous()`` waits
for a round; a running member's renewals need no echo.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from elasticrun.api import untrusted
from elasticrun.api.gateway import RunAccess
from elasticrun.api.kube import ApiConnectionError, ApiError
from elasticrun.api.leases import ASSIGNMENT_ANNOTATION, read_assignment
from elasticrun.api.model import Assignment
from elasticrun.api.naming import lease_name
from elasticrun.handler.watcher import RECONNECT_DELAYS

log = logging.getLogger(__name__)


class AssignmentWatch:
    """Keeps the assignment last written on ``node``'s Lease, and calls ``on_change`` when
    it moves."""

    def __init__(self, access: RunAccess, node: str,
                 on_change: Callable[[], None], watch_timeout: int = 300) -> None:
        self.access = access
        self.node = node
        self.lease = lease_name(access.name, node)
        self.on_change = on_change
        self.watch_timeout = watch_timeout
        self._latest: Assignment | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._current: Any = None
        #: Events received (for tests of the fan-out).
        self.events_received = 0

    @property
    def latest(self) -> Assignment | None:
        return self._latest

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name=f"elasticrun-mailbox-{self.lease}")
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        watch = self._current
        if watch is not None:
            watch.close()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        failures = 0
        resource_version: str | None = None  # none: the server starts with the Lease as it is
        while not self._stop.is_set():
            try:
                resource_version = self._watch_once(resource_version)
                failures = 0
            except (ApiConnectionError, ApiError) as exc:
                if self._stop.is_set():
                    return
                if isinstance(exc, ApiError) and exc.gone:
                    resource_version = None
                    continue
                delay = RECONNECT_DELAYS[min(failures, len(RECONNECT_DELAYS) - 1)]
                failures += 1
                log.debug("watch of lease %s failed (%s); again in %.1fs", self.lease, exc, delay)
                self._stop.wait(delay)

    def _watch_once(self, resource_version: str | None) -> str | None:
        """Follow the Lease until the server ends the watch; the version to go on from."""
        watch = self.access.watch_lease(self.node, resource_version, self.watch_timeout)
        self._current = watch
        try:
            if self._stop.is_set():
                return resource_version
            for event in watch:
                obj = untrusted.mapping(event.get("object"))
                if event.get("type") == "ERROR":
                    raise ApiError(int(obj.get("code") or 0), str(obj.get("reason", "")),
                                   str(obj.get("message", "")), dict(obj))
                meta = untrusted.mapping(obj.get("metadata"))
                resource_version = untrusted.text(meta.get("resourceVersion")) \
                    or resource_version
                if event.get("type") == "BOOKMARK":
                    continue
                self.events_received += 1
                annotations = untrusted.mapping(meta.get("annotations"))
                assignment = None if event.get("type") == "DELETED" else \
                    read_assignment(annotations.get(ASSIGNMENT_ANNOTATION))
                if assignment != self._latest:
                    self._latest = assignment
                    self.on_change()
        finally:
            self._current = None
            watch.close()
        return resource_version
