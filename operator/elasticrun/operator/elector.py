"""Leader election: every replica serves the webhook, ``/healthz`` and metrics; one decides.

Why an elector of our own: the official client installed with elasticrun
(``kubernetes`` 37) has ``kubernetes.leaderelection`` with a ``LeaseLock``, but
it is synchronous (``time.sleep`` loops in threads, callbacks in another
thread, while the controller's work queue lives on kopf's event loop), times
expiry with ``time.time()`` (a wall clock that jumps), returns for good after
one lost term and has no stop or release; none of that can gate a write at the
instant it is sent.  This one is one ``coordination.k8s.io/v1`` Lease and a
loop on kopf's event loop, with client-go's rules and defaults (lease duration
15 s, renew deadline 10 s, retry period 2 s):

* **Acquire** a Lease that does not exist (POST), that has no holder (a
  released or unreadable one), or whose record did not change for a lease
  duration *by this replica's own clock* (:class:`Sighting`: the rule of
  :class:`elasticrun.api.leases.RenewalClock`; the holder's ``renewTime`` and
  ``leaseDurationSeconds`` are written by whoever may write Leases in the
  namespace and are never trusted).  A follower polls every retry period and
  once more at the expiry it computed, so it takes over within a lease
  duration and a (jittered) retry period of the last renewal.  Every write is
  a PUT with the resourceVersion read, so two candidates never both win (409
  for one).
* **Renew** every retry period.  The leader counts its leadership from the
  moment it *sent* its last successful renewal; once that is a renew deadline
  old it stops deciding (:meth:`Elector.may_write` turns false at that instant,
  checked synchronously before every write, so also in a process resumed after
  SIGSTOP before its loop ran; the controller's work queue is then stopped).
  Another replica saw that renewal only after it was sent and waits a full
  lease duration from then, so the old leader stops at least
  ``lease_duration - renew_deadline`` (5 s) before anyone can start.
* **Fencing** of what a stale leader already had in flight (a request sent
  just before a SIGSTOP lands after the resume): status writes are PUTs with
  the resourceVersion the decision read, so one against a run the new leader
  wrote since is refused with 409; Lease deletions carry ``preconditions.uid``;
  anything else that lands is a write on state the new leader re-reads
  level-based from its watches (it reconciles every run it holds when it
  starts leading) and corrects like any node's, or, a slice of an older
  round, one no member takes (its places answer requests they no longer
  wait on; a member whose place it overwrote is told by the run once its
  wait for the operator ends).
* **Garbage** in the Lease (holder of the wrong type, a huge string, spec
  missing): read through :mod:`elasticrun.api.untrusted`; no holder means
  free, anything else waits for a lease duration of no change.  Every pass
  sleeps at least a retry period, and after failed requests a back-off
  doubling to :data:`MAX_BACKOFF`, so nothing in the Lease makes a hot loop.

Observation (kopf's watches, the Lease index, renewal clocks, metrics) runs on
every replica: a replica that takes over has warm indexes and has already
timed every member's Lease, so a loss is detected a heartbeat after it
happened, not a heartbeat after the take-over.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import math
import random
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from elasticrun.api import untrusted
from elasticrun.api.kube import (
    JSON,
    ApiConnectionError,
    ApiError,
    KubeClient,
    lease_path,
    leases_path,
)
from elasticrun.api.model import format_time, now

log = logging.getLogger(__name__)

LEASE_NAME = "elasticrun-operator-leader"
#: The longest pause between two passes after failed requests.
MAX_BACKOFF = 30.0
#: Followers spread their polls by up to this fraction of the retry period (client-go's 1.2).
JITTER = 0.2
#: Reads and writes of one release on a clean stop, when a renewal of ours keeps landing first.
RELEASE_ATTEMPTS = 3
#: Methods that do not change anything: never fenced.
READS = frozenset({"GET", "HEAD"})


# --------------------------------------------------------------------------- pure part


@dataclass(frozen=True)
class Timing:
    """client-go's three durations, in seconds."""

    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0

    def problem(self) -> str | None:
        """Why these durations cannot keep one leader, or None."""
        if not self.retry_period > 0:
            return "the retry period must be positive"
        if not self.renew_deadline > self.retry_period * (1 + JITTER):
            return (f"the renew deadline ({self.renew_deadline:g}s) must be longer than "
                    f"{1 + JITTER:g} x the retry period ({self.retry_period:g}s)")
        if not self.lease_duration > self.renew_deadline:
            return (f"the lease duration ({self.lease_duration:g}s) must be longer than the "
                    f"renew deadline ({self.renew_deadline:g}s): a leader that stops renewing "
                    "must stop deciding before another replica may start")
        return None


@dataclass(frozen=True)
class LeaderLease:
    """What the elector uses of the Lease, read tolerantly (anyone may have written it)."""

    holder: str | None
    transitions: int
    version: str | None
    #: Every field a renewal changes: a new value is a renewal, by the reader's clock.
    record: tuple[Any, ...]
    acquired: str | None


def read_leader_lease(body: Any) -> LeaderLease:
    meta = untrusted.mapping(untrusted.mapping(body).get("metadata"))
    spec = untrusted.mapping(untrusted.mapping(body).get("spec"))
    transitions = untrusted.number(spec.get("leaseTransitions"))
    holder = untrusted.text(spec.get("holderIdentity"))
    renewed = untrusted.text(spec.get("renewTime"), untrusted.MAX_TIME_CHARS)
    version = untrusted.text(meta.get("resourceVersion"), 64)
    return LeaderLease(
        holder=holder,
        transitions=int(transitions) if 0 <= transitions < 2**31 else 0,
        version=version,
        record=(holder, renewed, version, untrusted.text(meta.get("uid"), 64)),
        acquired=untrusted.text(spec.get("acquireTime"), untrusted.MAX_TIME_CHARS))


@dataclass
class Sighting:
    """When this replica first saw the Lease's current record, by its own monotonic clock."""

    record: tuple[Any, ...] | None = None
    at: float = 0.0

    def observe(self, lease: LeaderLease | None, at: float) -> float:
        record = lease.record if lease is not None else None
        if record != self.record or self.record is None:
            self.record, self.at = record, at
        return self.at


Action = Literal["create", "renew", "acquire", "wait"]


@dataclass(frozen=True)
class Move:
    action: Action
    #: For ``wait``: the monotonic time at which the holder's Lease counts as expired.
    expires_at: float | None = None


def next_move(me: str, lease: LeaderLease | None, first_seen: float, at: float,
              timing: Timing) -> Move:
    """What a candidate does with the Lease it just read (None: there is none)."""
    if lease is None:
        return Move("create")
    if lease.holder == me:
        return Move("renew")
    if lease.holder is None:
        return Move("acquire")
    expires_at = first_seen + timing.lease_duration
    if at >= expires_at:
        return Move("acquire")
    return Move("wait", expires_at)


def still_leading(renewed_at: float | None, at: float, timing: Timing) -> bool:
    """A leader decides only while its last successful renewal, counted from when it was
    sent, is younger than the renew deadline."""
    return renewed_at is not None and at - renewed_at < timing.renew_deadline


def lease_spec(me: str, lease: LeaderLease | None, move: Action, wall: dt.datetime,
               timing: Timing) -> dict[str, Any]:
    """The spec this replica writes for ``move`` (create, renew or acquire)."""
    stamp = format_time(wall)
    taking = move != "renew" or lease is None
    transitions = lease.transitions if lease is not None else 0
    if taking and lease is not None and lease.holder not in (None, me):
        transitions += 1
    return {
        "holderIdentity": me,
        "leaseDurationSeconds": max(1, math.ceil(timing.lease_duration)),
        "acquireTime": stamp if taking or lease is None or lease.acquired is None
        else lease.acquired,
        "renewTime": stamp,
        "leaseTransitions": min(transitions, 2**31 - 1),
    }


def pause(failures: int, timing: Timing, leading: bool, jitter: float = 0.0) -> float:
    """Seconds until the next pass: the retry period (followers jittered), doubling after
    failed requests up to :data:`MAX_BACKOFF` or the lease duration (a follower that was
    cut off still takes over about a lease duration after it is back); a leader keeps its
    retry period so it can still renew before its deadline."""
    if leading or failures == 0:
        return timing.retry_period * (1.0 if leading else 1.0 + JITTER * jitter)
    ceiling = max(timing.retry_period, min(MAX_BACKOFF, timing.lease_duration))
    return min(ceiling, timing.retry_period * 2.0 ** min(failures, 16))


def identity(base: str) -> str:
    """The holder name: the pod's name (or host name) and a random suffix, so that a
    restarted pod of the same name is a new candidate."""
    return f"{base[:200]}_{secrets.token_hex(4)}"


# --------------------------------------------------------------------------- I/O


class NotLeaderError(ApiConnectionError):
    """A write refused in the operator itself: this replica is not (or no longer) the leader."""


class FencedClient(KubeClient):
    """The controller's client: every request that is not a read asks ``may_write``, in
    the thread that sends it, when it is called and again as its bytes go out.

    The second ask (:meth:`KubeClient.request_checked`) is the one that fences: a
    replica frozen after the first ask, building the body or waiting for a
    connection, resumes past its renew deadline and is refused there, before the
    API server has seen a byte.
    """

    def __init__(self, inner: KubeClient, may_write: Callable[[], bool]) -> None:
        # The same connections as ``inner``: no second pool.
        self.credentials = inner.credentials
        self.timeout = inner.timeout
        self.user_agent = inner.user_agent
        self._pool = inner._pool
        self.may_write = may_write

    def request(self, method: str, path: str, *, body: Any = None,
                query: Mapping[str, Any] | None = None, content_type: str = JSON,
                timeout: float | None = None) -> dict[str, Any]:
        if method.upper() in READS:
            return super().request(method, path, body=body, query=query,
                                   content_type=content_type, timeout=timeout)

        def fence() -> None:
            if not self.may_write():
                raise NotLeaderError(f"{method} {path}: this replica is not the leader")

        fence()
        return self.request_checked(fence, method, path, body=body, query=query,
                                    content_type=content_type, timeout=timeout)


@dataclass
class Elector:
    """One candidate; :meth:`run` until cancelled, :meth:`release` on a clean stop."""

    client: KubeClient
    namespace: str
    me: str
    timing: Timing = field(default_factory=Timing)
    name: str = LEASE_NAME
    on_lead: Callable[[], Awaitable[None]] | None = None
    on_follow: Callable[[], Awaitable[None]] | None = None
    on_change: Callable[[bool], None] | None = None
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        self._sighting = Sighting()
        self._renewed_at: float | None = None
        self._leading = False
        self._lease: LeaderLease | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._transitions = asyncio.Lock()
        self._pending: set[asyncio.Task[None]] = set()
        #: Set by :meth:`stop`: a pass still in its thread writes nothing more.
        self._stopped = False
        #: When the holder's Lease expires by this replica's clock (a follower polls then).
        self._expires_at: float | None = None
        #: Requests sent, for tests and logs.
        self.requests = 0

    @property
    def leading(self) -> bool:
        return self.may_write()

    def may_write(self) -> bool:
        """True only while this replica holds a renewal younger than the renew deadline."""
        return self._leading and still_leading(self._renewed_at, self.clock(), self.timing)

    def _request(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        self.requests += 1
        # A renewal that arrives after the deadline renews nothing this replica relies on.
        return self.client.request(method, path, body=body,
                                   timeout=max(0.5, self.timing.renew_deadline / 2))

    def _read(self) -> LeaderLease | None:
        try:
            return read_leader_lease(self._request("GET", lease_path(self.namespace, self.name)))
        except ApiError as exc:
            if exc.not_found:
                return None
            raise

    def _write(self, move: Action, lease: LeaderLease | None) -> LeaderLease:
        spec = lease_spec(self.me, lease, move, now(), self.timing)
        body: dict[str, Any] = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                                "metadata": {"name": self.name, "namespace": self.namespace},
                                "spec": spec}
        if lease is None:
            return read_leader_lease(self._request("POST", leases_path(self.namespace), body))
        body["metadata"]["resourceVersion"] = lease.version
        return read_leader_lease(
            self._request("PUT", lease_path(self.namespace, self.name), body))

    def _try(self) -> bool:
        """One pass, in a thread: read (unless renewing what we wrote), decide, write.
        True when this replica holds the Lease afterwards."""
        self._expires_at = None
        if self._stopped:
            return False
        lease = self._lease if self._leading and self._lease is not None else self._read()
        at = self.clock()
        move = next_move(self.me, lease, self._sighting.observe(lease, at), at, self.timing)
        if move.action == "wait" or self._stopped:
            self._lease = lease
            self._expires_at = move.expires_at
            return False
        sent = self.clock()
        try:
            written = self._write(move.action, lease)
        except ApiError as exc:
            if exc.conflict or exc.status == 422:
                self._lease = None  # someone wrote first (or the copy was unusable): read again
                return False
            raise
        self._lease = written
        self._sighting.observe(written, self.clock())
        self._renewed_at = sent
        return True

    async def run(self) -> None:
        failures = 0
        while True:
            try:
                held = await asyncio.wait_for(asyncio.to_thread(self._try),
                                              timeout=self.timing.renew_deadline)
                failures = 0
            except (ApiError, ApiConnectionError, TimeoutError) as exc:
                failures += 1
                held = False
                self._lease = None
                log.warning("leader election: %s (attempt %d)", exc or "timed out", failures)
            except Exception:  # a bug must not end the election: back off and go on
                failures += 1
                held = False
                self._lease = None
                log.exception("leader election: pass %d failed", failures)
            if held and still_leading(self._renewed_at, self.clock(), self.timing):
                self._became(True)
            elif self._leading and (not self.may_write() or self._lost_to_another()):
                self._became(False)
            delay = pause(failures, self.timing, self._leading, random.random())
            if self._expires_at is not None and failures == 0:
                # Take over at the expiry, not up to a retry period later; a wait
                # always ends after ``at``, so this is never a zero pause in a loop.
                delay = min(delay, max(0.0, self._expires_at - self.clock()))
            await asyncio.sleep(delay)

    def _lost_to_another(self) -> bool:
        return self._lease is not None and self._lease.holder != self.me

    def _became(self, leading: bool) -> None:
        """Change state now (the gate and the metric), run the callbacks in order."""
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        if leading and self._renewed_at is not None:
            delay = max(0.0, self._renewed_at + self.timing.renew_deadline - self.clock())
            self._deadline = asyncio.get_running_loop().call_later(delay, self._expired)
        if leading == self._leading:
            return
        self._leading = leading
        if leading:
            log.info("leader election: %s holds Lease %s/%s; reconciling", self.me,
                     self.namespace, self.name)
        else:
            log.warning("leader election: %s stopped leading (no renewal of %s/%s within "
                        "%gs, or another holder); not reconciling", self.me, self.namespace,
                        self.name, self.timing.renew_deadline)
        if self.on_change is not None:
            self.on_change(leading)
        callback = self.on_lead if leading else self.on_follow
        if callback is not None:
            task = asyncio.get_running_loop().create_task(self._in_order(callback))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    def _expired(self) -> None:
        self._deadline = None
        if self._leading and not self.may_write():
            self._lease = None
            self._became(False)

    async def _in_order(self, callback: Callable[[], Awaitable[None]]) -> None:
        async with self._transitions:
            await callback()

    async def stop(self) -> None:
        """Stop deciding at once and wait for the callbacks (the work queue stopped)."""
        self._stopped = True
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        if self._leading:
            self._leading = False
            if self.on_change is not None:
                self.on_change(False)
            if self.on_follow is not None:
                await self._in_order(self.on_follow)
        for task in list(self._pending):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def release(self) -> None:
        """Give the Lease up (no holder) so another replica takes over at its next poll;
        call after :meth:`stop`.

        The Lease is read afresh, not taken from this replica's copy: under load a
        renewal that timed out leaves no copy, and one still in flight when the
        election was cancelled lands after it, so a release fenced by the copy's
        resourceVersion would be refused (409).  Bounded (:data:`RELEASE_ATTEMPTS`)
        and best effort: a failure only means the others wait for the lease duration.
        """
        if self._renewed_at is None:
            return  # never held
        for _ in range(RELEASE_ATTEMPTS):
            try:
                lease = self._read()
                if lease is None or lease.holder != self.me:
                    return
                body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                        "metadata": {"name": self.name, "namespace": self.namespace,
                                     "resourceVersion": lease.version},
                        "spec": {"holderIdentity": None, "leaseDurationSeconds": 1,
                                 "leaseTransitions": lease.transitions,
                                 "renewTime": format_time(now())}}
                self._request("PUT", lease_path(self.namespace, self.name), body)
                log.info("leader election: released Lease %s/%s", self.namespace, self.name)
                return
            except ApiError as exc:
                if exc.conflict:
                    continue  # our last renewal landed in between: read it and try again
                failure: Exception = exc
            except ApiConnectionError as exc:
                failure = exc
            log.warning("leader election: releasing Lease %s/%s failed: %s", self.namespace,
                        self.name, failure)
            return
        log.warning("leader election: releasing Lease %s/%s: it changed under every try",
                    self.namespace, self.name)
