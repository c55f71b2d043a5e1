"""The node's slice of its run, watched for the place the operator tells it there.

In the largest runs (:func:`elasticrun.api.rounds.members_told_in_slices`) the
operator's seal does not move the run's ``signal``: sending the whole roster to
every node is the one part of a round whose bytes grow as N².  It writes the
round's places into the run's slices instead (:mod:`elasticrun.api.slices`),
about 64 places in each.  This watch selects the node's one slice by name, which
the API server's watch cache dispatches by name, so a node receives the events
of its slice and of no other object: one per round that places a member of it.
It runs only while ``next_rendezvous()`` waits for a round.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from elasticrun.api import untrusted
from elasticrun.api.gateway import RunAccess
from elasticrun.api.kube import ApiConnectionError, ApiError
from elasticrun.api.model import Assignment
from elasticrun.api.slices import read_place, slice_index, slice_name
from elasticrun.handler.watcher import RECONNECT_DELAYS

log = logging.getLogger(__name__)


class AssignmentWatch:
    """Keeps ``node``'s place as its slice of the run with ``run_uid`` last told it, and
    calls ``on_change`` when it moves."""

    def __init__(self, access: RunAccess, node: str, run_uid: str,
                 on_change: Callable[[], None], watch_timeout: int = 300) -> None:
        self.access = access
        self.node = node
        self.run_uid = run_uid
        self.slice = slice_name(run_uid, slice_index(node))
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
                                            name=f"elasticrun-mailbox-{self.slice}")
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
        resource_version: str | None = None  # none: the server starts with the slice as it is
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
                log.debug("watch of slice %s failed (%s); again in %.1fs", self.slice, exc, delay)
                self._stop.wait(delay)

    def _watch_once(self, resource_version: str | None) -> str | None:
        """Follow the slice until the server ends the watch; the version to go on from."""
        watch = self.access.watch_slice(self.slice, resource_version, self.watch_timeout)
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
                assignment = None if event.get("type") == "DELETED" else \
                    read_place(obj, self.access.name, self.node)
                if assignment != self._latest:
                    self._latest = assignment
                    self.on_change()
        finally:
            self._current = None
            watch.close()
        return resource_version
