"""A narrow watch on one ElasticRun, and the cache every node question is answered from.

The watch uses the field selector ``status.signal!=S`` where ``S`` is the signal
the node has already seen.  The object does not match while nothing a node must
act on has happened, so the API server sends nothing for the joins of other
nodes; when the signal moves, the object starts to match and exactly one event
arrives, after which the watch is re-opened with the new value.  That keeps the
events delivered per round linear in the number of nodes instead of quadratic.

``num_nodes_waiting()`` is polled every 0.1 s by torch's agent; it reads this
cache and never costs an API request.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from elasticrun.api.gateway import RunAccess
from elasticrun.api.kube import ApiConnectionError, ApiError
from elasticrun.api.model import ElasticRun, InvalidRunError, parse_run
from elasticrun.api.ordering import RoundMark, newer

log = logging.getLogger(__name__)

RECONNECT_DELAYS = (0.1, 0.2, 0.5, 1.0, 2.0)


class RunDeletedError(Exception):
    """The ElasticRun was deleted while this node belonged to it."""


class RunWatcher:
    """Keeps the newest known ElasticRun and wakes up whoever waits for a change.

    The narrow watch cannot see the run being deleted: a deleted object keeps
    the signal the node has seen, so it never matched the selector and the API
    server sends no DELETED event.  Deleting a run deletes its Leases (they are
    owned by it; the garbage collector and the operator both delete them), and
    the node's Lease renewal calls :meth:`recheck` when it finds its Lease gone,
    so a deletion is noticed within a renewal interval.  As a backstop, whenever
    the server ends a quiet watch (every ``watch_timeout`` seconds) the watcher
    reads the object once.
    """

    def __init__(self, access: RunAccess, watch_timeout: int = 300) -> None:
        self.access = access
        self.namespace = access.namespace
        self.name = access.name
        self.watch_timeout = watch_timeout
        self._cond = threading.Condition()
        self._latest: ElasticRun | None = None
        self._version = 0
        self._error: Exception | None = None
        self._disconnected_since: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._current_watch: Any = None
        #: Events received (for tests and benchmarks of the fan-out).
        self.events_received = 0
        #: Watch requests opened, and re-lists after 410 Gone (for the chaos tests).
        self.watches_opened = 0
        self.resyncs = 0
        #: The highest status.round seen of the object: rounds never go back.
        self._round_mark = RoundMark()

    # ------------------------------------------------------------------ cache

    @property
    def latest(self) -> ElasticRun | None:
        return self._latest

    @property
    def version(self) -> int:
        return self._version

    @property
    def disconnected_for(self) -> float:
        since = self._disconnected_since
        return 0.0 if since is None else time.monotonic() - since

    def offer(self, raw: dict[str, Any]) -> ElasticRun:
        """Accept an object read or written by anyone, if it is newer than the cache.

        Raises InvalidRunError for a status that cannot be read, or whose round
        went back; the error is also kept, so a waiting node learns about it.
        """
        try:
            run = parse_run(raw)
        except InvalidRunError as exc:
            self._fail(exc)
            raise
        with self._cond:
            current = self._latest
            if current is None or newer(run.resource_version, current.resource_version):
                try:
                    self._round_mark = self._round_mark.advance(run)
                except InvalidRunError as error:
                    self._error = error
                    self._version += 1
                    self._cond.notify_all()
                    raise
                self._latest = run
                self._error = None
                self._version += 1
                self._cond.notify_all()
            accepted = self._latest
        assert accepted is not None
        return accepted

    def _fail(self, error: Exception) -> None:
        with self._cond:
            self._error = error
            self._version += 1
            self._cond.notify_all()

    def wait(self, seen_version: int, timeout: float) -> None:
        """Block until the cache changes after ``seen_version``, or ``timeout`` passes."""
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cond:
            while self._version == seen_version and not self._stop.is_set():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                self._cond.wait(remaining)

    def poke(self) -> None:
        """Wake whoever waits, for news that came another way (the node's own Lease)."""
        with self._cond:
            self._version += 1
            self._cond.notify_all()

    @property
    def stopped(self) -> bool:
        """Whether :meth:`stop` ran: the watch is over for good (a wait returns at once)."""
        return self._stop.is_set()

    @property
    def error(self) -> Exception | None:
        """What the watch learned that makes waiting pointless (:meth:`check` raises it)."""
        return self._error

    def check(self) -> None:
        """Raise what the watch learned that makes waiting pointless."""
        if self._error is not None:
            raise self._error

    # ------------------------------------------------------------------ thread

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name=f"elasticrun-watch-{self.name}")
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        watch = self._current_watch
        if watch is not None:
            watch.close()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def _relist(self) -> ElasticRun | None:
        raw = self.access.read()
        if raw is None:
            self._fail(RunDeletedError(f"ElasticRun {self.namespace}/{self.name} was deleted"))
            return None
        return self.offer(raw)

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                run = self._latest or self._relist()
                if run is None:
                    # Deleted: look again later, a re-created run starts clean.
                    self._stop.wait(1.0)
                    self._relist()
                    continue
                self._watch_once(run)
                failures = 0
                self._disconnected_since = None
            except (ApiConnectionError, ApiError) as exc:
                if self._stop.is_set():
                    return
                if isinstance(exc, ApiError) and exc.gone:
                    self._gone()
                    continue
                if self._disconnected_since is None:
                    self._disconnected_since = time.monotonic()
                delay = RECONNECT_DELAYS[min(failures, len(RECONNECT_DELAYS) - 1)]
                failures += 1
                log.debug("watch of %s failed (%s); again in %.1fs", self.name, exc, delay)
                with self._cond:
                    self._version += 1  # let waiters check their connection deadline
                    self._cond.notify_all()
                self._stop.wait(delay)
            except InvalidRunError:
                # Kept in _error for waiters; wait for the next change.
                self._stop.wait(0.5)
                self._relist_quietly()

    def recheck(self) -> bool:
        """Read the run now (from any thread), on a hint that it may be gone; False if it is."""
        self._relist_quietly()
        return not isinstance(self._error, RunDeletedError)

    def _relist_quietly(self) -> None:
        try:
            self._relist()
        except (ApiError, ApiConnectionError, InvalidRunError) as exc:
            log.debug("re-list of %s failed: %s", self.name, exc)

    def _gone(self) -> None:
        """410 Gone: our resourceVersion was compacted; read the object afresh."""
        self.resyncs += 1
        with self._cond:
            self._latest = None
        self._relist()

    def _watch_once(self, run: ElasticRun) -> None:
        watch = self.access.watch_run(run.status.signal, run.resource_version,
                                      self.watch_timeout)
        self._current_watch = watch
        self.watches_opened += 1
        if self._stop.is_set():  # stop() ran while the request was being opened
            watch.close()
            return
        self._disconnected_since = None
        try:
            for event in watch:
                kind = event.get("type")
                obj = event.get("object") or {}
                if kind == "BOOKMARK":
                    continue
                if kind == "ERROR":
                    code = int(obj.get("code") or 0)
                    raise ApiError(code, str(obj.get("reason", "")), str(obj.get("message", "")),
                                   obj)
                self.events_received += 1
                if kind == "DELETED":
                    # Deleted, or left the selection (signal back to what we saw).
                    self._relist()
                    return
                self.offer(obj)
                return  # re-open with the new signal value
        finally:
            self._current_watch = None
            watch.close()
        if not self._stop.is_set():
            self._relist()  # the server ended a quiet watch: see whether the run still exists

