"""A narrow watch on one ElasticRun, and the cache every node question is answered from.

The watch uses the field selector ``status.signal!=S`` where ``S`` is the signal
the node has already seen.  The object does not match while nothing a node must
act on has happened, so the API server sends nothing for the joins of other
nodes; when the signal moves, the object starts to match and exactly one event
arrives, after which the watch is re-opened with the new value.  That keeps the
events delivered per round linear in the number of nodes instead of quadratic.

A member of a large run (:func:`~elasticrun.api.rounds.members_told_in_slices`)
that holds round R watches *quietly* instead (:meth:`RunWatcher.watch_quietly`):
metadata only, with ``status.stableRound!=R``
(:attr:`~elasticrun.api.model.RunStatus.stable_round`).  A signal would send
every member the whole run, roster included (178 kB at 2,048 nodes), when all
it needs is one bit, "round R is disturbed"; the quiet watch's first event is
that bit, about 1 kB at any size.  The watcher keeps it
(:meth:`RunWatcher.disturbed`) and stops watching until the node's next
``next_rendezvous()``.  Where its place may be kept
(:func:`~elasticrun.api.rounds.members_keep_places`) the event carries the
whole run instead (``watch_quietly(whole=True)``), kept in the cache: the
member needs it to find its place, often sealed by the very write that woke
it, and a watch event is encoded once for all members where a read is encoded
once per member.  Otherwise the call rejoins without reading the run, so it
holds a copy from before the disturbance, whose signal every later status
write moves past: a signal watch from it would send the whole run on each,
starting with the disturbance itself.  It waits instead for the run to settle
(:meth:`RunWatcher.watch_for_settled`: the whole run, once, when a newer round
is sealed or the run has ended), or, in the largest runs, whose members the
operator tells in slices, for the run's end only
(:meth:`RunWatcher.watch_for_end`: metadata only, the run closed or finished,
after which it reads the run once).  The member watches its new round quietly
once it holds it, or the run fully once it holds a copy as new as the
disturbance (:meth:`RunWatcher.watch_fully`).  Which watch fits what the node
holds is one rule, :meth:`~elasticrun.handler.session.RunSession.follow`.  The
quiet, settled and end watches are one watch for one event, whichever it waits
for: its first event is the news, and nothing is watched after it until the
node switches.

``num_nodes_waiting()`` is polled every 0.1 s by torch's agent; it reads this
cache and never costs an API request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any, Literal

from elasticrun.api.gateway import EventStream, RunAccess
from elasticrun.api.kube import ApiConnectionError, ApiError
from elasticrun.api.model import ElasticRun, InvalidRunError, parse_run
from elasticrun.api.ordering import RoundMark, newer

log = logging.getLogger(__name__)

RECONNECT_DELAYS = (0.1, 0.2, 0.5, 1.0, 2.0)
#: A watch for one event that ended sooner than this is opened again only this much later.
QUIET_REOPEN_AFTER = 0.1

#: What the node watches the run for: every move of its signal (the full watch), or
#: one event: its round disturbed (quiet), the run settled, or the run ended.
Watching = Literal["full", "quiet", "settled", "end"]


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
    the server ends an idle narrow watch (every ``watch_timeout`` seconds) the
    watcher reads the object once; a watch for one event (the quiet, settled and
    end watches of a large run's member) is opened again without that read (N
    reads of the roster every few minutes), leaving deletion to the Lease renewal.
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
        #: What the run is watched for, the round watched quietly (0: none), and whether
        #: the watch for one event is told its news: the round disturbed (the quiet
        #: watch), the run settled or ended (the others).  Once told, nothing is
        #: watched until the next switch, which clears it.
        self._watching: Watching = "full"
        self._quiet_round = 0
        self._quiet_whole = False
        self._told = False
        #: The resourceVersion of the run in the quiet watch's event.
        self._disturbed_version: str | None = None
        #: Moves on every switch between the watches; a watch opened before a switch
        #: ends without the re-read that follows a watch the server ended.
        self._mode = 0
        self._mode_changed = threading.Event()

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
        """Wake whoever waits, for news that came another way (the node's slice)."""
        with self._cond:
            self._version += 1
            self._cond.notify_all()

    # ------------------------------------------------------------------ quiet watch

    def watch_quietly(self, round_number: int, whole: bool = False) -> None:
        """From now on watch only for round ``round_number`` being disturbed
        (:meth:`RunGateway.watch_round`): the node holds it in a large run.  ``whole``:
        the event carries the whole run, kept in the cache."""
        self._quiet_whole = whole
        self._switch("quiet", round_number)

    def watch_fully(self) -> None:
        """Back to the full watch (``status.signal!=S``) from the cached run; what the
        quiet watch said is forgotten, so only from a copy at least as new as what
        it said (the cached copy predates a disturbance it reported)."""
        self._switch("full")

    def watch_for_settled(self) -> None:
        """From now on watch only for the run to settle (:meth:`RunGateway.watch_settled`),
        and keep the run it sends: the node rejoins from a copy older than its round's
        disturbance, and learns its place from the seal of the next round."""
        self._switch("settled")

    def watch_for_end(self) -> None:
        """From now on watch only for the run's end (:meth:`RunGateway.watch_end`), and
        read the run once when it comes: the node rejoins from a copy older than
        its round's disturbance, and learns its place in its slice."""
        self._switch("end")

    @property
    def quiet_round(self) -> int:
        """The round watched quietly; 0 while the watch is the full one."""
        return self._quiet_round

    def disturbed(self, round_number: int) -> bool:
        """Whether the quiet watch of ``round_number`` said that the round is disturbed."""
        return self._told and self._quiet_round == round_number > 0

    @property
    def disturbed_version(self) -> str | None:
        """The run's resourceVersion in the quiet watch's event: a read of the run at least
        that new shows the disturbance (None before one came)."""
        return self._disturbed_version if self.disturbed(self._quiet_round) else None

    def _switch(self, watching: Watching, quiet_round: int = 0) -> None:
        with self._cond:
            if (watching, quiet_round) == (self._watching, self._quiet_round) \
                    and not self._told:
                return  # watching so already
            self._watching = watching
            self._quiet_round = quiet_round
            self._told = False
            self._mode += 1
        self._mode_changed.set()
        watch = self._current_watch
        if watch is not None:
            watch.close()

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
        self._mode_changed.set()
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
                with self._cond:  # one mode's settings, whatever switch comes next
                    mode, watching, quiet_round, told = (self._mode, self._watching,
                                                         self._quiet_round, self._told)
                if watching != "full" and told:
                    # Told: nothing more to learn until the node switches the watch.
                    self._mode_changed.wait(self.watch_timeout)
                    self._mode_changed.clear()
                    continue
                if watching != "full":
                    self._watch_for_one(watching, quiet_round, mode)
                    failures = 0
                    self._disconnected_since = None
                    continue
                run = self._latest or self._relist()
                if run is None:
                    # Deleted: look again later, a re-created run starts clean.
                    self._stop.wait(1.0)
                    self._relist()
                    continue
                self._watch_once(run, mode)
                failures = 0
                self._disconnected_since = None
            except (ApiConnectionError, ApiError) as exc:
                if self._stop.is_set():
                    return
                if isinstance(exc, ApiError) and exc.gone:
                    if self._watching == "full":  # the others start from now
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

    def _opened(self, watch: EventStream, mode: int) -> bool:
        """Keep ``watch`` as the one :meth:`stop` and a switch close; False (and closed)
        when either ran while the request was being opened."""
        self._current_watch = watch
        self.watches_opened += 1
        if self._stop.is_set() or self._mode != mode:
            watch.close()
            return False
        self._disconnected_since = None
        return True

    def _events(self, watch: EventStream) -> Iterator[tuple[str, dict[str, Any]]]:
        """``watch``'s events as (type, object), bookmarks skipped, an ERROR raised."""
        for event in watch:
            kind = str(event.get("type"))
            obj = event.get("object") or {}
            if kind == "BOOKMARK":
                continue
            if kind == "ERROR":
                code = int(obj.get("code") or 0)
                raise ApiError(code, str(obj.get("reason", "")), str(obj.get("message", "")),
                               obj)
            self.events_received += 1
            yield kind, obj

    def _watch_for_one(self, watching: Watching, quiet_round: int, mode: int) -> None:
        """One of the watches for one event (:meth:`_watch_for_news`), paced by
        ``QUIET_REOPEN_AFTER``: a watch the server ended at once without its news is
        not opened again at once.  A watch that told its news, or that a switch
        ended, is not paced: the next watch is the one the node switches to, and
        it opens at once (a woken member's rejoin waits on it)."""
        opened = time.monotonic()
        self._watch_for_news(watching, quiet_round, mode)
        with self._cond:
            again = self._mode == mode and not self._told
        if again and time.monotonic() - opened < QUIET_REOPEN_AFTER:
            self._pause(mode, opened + QUIET_REOPEN_AFTER)

    def _pause(self, mode: int, until: float) -> None:
        """Wait until ``until`` (monotonic), or until a switch away from ``mode`` or
        :meth:`stop`, whichever comes first."""
        while not self._stop.is_set():
            # Cleared before the mode is read: a switch after the read sets it again.
            self._mode_changed.clear()
            remaining = until - time.monotonic()
            if self._mode != mode or remaining <= 0:
                return
            self._mode_changed.wait(remaining)

    def _watch_for_news(self, watching: Watching, quiet_round: int, mode: int) -> None:
        """One watch for one event: the quiet watch of ``quiet_round``, the watch for the
        run to settle, or for its end.  Its first event is the news, after which nothing
        is watched until the next switch.

        The quiet watch's event is the run as metadata, or whole where
        :meth:`watch_quietly` asked for it (then kept in the cache too); its
        resourceVersion is kept (:attr:`disturbed_version`); a DELETED event is no
        news there: the run is read, and the round watched again.  The settled run
        comes whole and is kept in the cache; the end comes as metadata, and the
        run is read once (so is a deleted run, whichever of the two saw it go).
        Each wakes whoever waits.  A watch the server ended is opened again
        without a read: a deleted run is noticed by the Lease renewal
        (:meth:`recheck`).
        """
        whole = self._quiet_whole
        if watching == "quiet":
            watch = self.access.watch_round(quiet_round, self.watch_timeout, whole)
        elif watching == "settled":
            watch = self.access.watch_settled(self.watch_timeout)
        else:
            watch = self.access.watch_end(self.watch_timeout)
        if not self._opened(watch, mode):
            return
        try:
            for kind, obj in self._events(watch):
                if watching == "quiet" and kind == "DELETED":
                    # Deleted, or the field went back to our round (never written so).
                    self._relist()
                    return
                if (watching == "settled" or (watching == "quiet" and whole)) \
                        and kind != "DELETED":
                    self.offer(obj)
                elif watching != "quiet":
                    self._relist()
                with self._cond:
                    if self._mode == mode:
                        self._told = True
                        if watching == "quiet":  # offer and _relist wake the others' waiters
                            version = (obj.get("metadata") or {}).get("resourceVersion")
                            self._disturbed_version = str(version) if version else None
                            self._version += 1
                            self._cond.notify_all()
                return
        finally:
            self._current_watch = None
            watch.close()

    def _watch_once(self, run: ElasticRun, mode: int) -> None:
        watch = self.access.watch_run(run.status.signal, run.resource_version,
                                      self.watch_timeout)
        if not self._opened(watch, mode):
            return
        try:
            for kind, obj in self._events(watch):
                if kind == "DELETED":
                    # Deleted, or left the selection (signal back to what we saw).
                    self._relist()
                    return
                self.offer(obj)
                return  # re-open with the new signal value
        finally:
            self._current_watch = None
            watch.close()
        if not self._stop.is_set() and self._mode == mode:
            self._relist()  # the server ended an idle watch: see whether the run still exists

