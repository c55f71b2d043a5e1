"""The operator's work queue: each run at most once in it, woken by events and deadlines.

A run is never reconciled by two workers at once: the queue holds each key at
most once, and a key woken while a worker reconciles it waits until that
reconcile is over, then goes into the queue once.  Two passes at once would
both act on the same Lease index: two status writes of which one must lose,
and every member of a large run told its place twice.  A reconcile that
raises is tried again after a back-off of its own run (:class:`Backoff`): the
delay :func:`elasticrun.api.policy.requeue_delay` gives for its error, doubled
per failure of that run in a row, up to :data:`BACKOFF_CAP_SECONDS`, and
forgotten once the run's reconcile succeeds (controller-runtime's per-item
exponential rate limiter).  One run that always fails costs a request every
few minutes, not every second, and delays no other run.

A burst of events of one run can also be gathered into one reconcile
(:meth:`WorkQueue.enqueue_within`): a large run's thousands of Lease events
would otherwise start as many O(N) reconciles back to back, each holding the
event loop, on which the operator also takes in the very events it waits for.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from elasticrun.api.kube import ApiConnectionError, ApiError
from elasticrun.api.model import now
from elasticrun.api.policy import requeue_delay

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (namespace, run)

#: The longest pause between reconciles of a run that keeps failing.
BACKOFF_CAP_SECONDS = 300.0


@dataclass
class Backoff:
    """Per-run retry times after failed reconciles: each failure in a row doubles the
    pause (from the error's base delay) up to ``cap``; a success starts again."""

    clock: Callable[[], dt.datetime] = now
    cap: float = BACKOFF_CAP_SECONDS
    _failures: dict[Key, int] = field(default_factory=dict)

    def failed(self, key: Key, base: float) -> dt.datetime:
        """When to reconcile ``key`` again after one more failure (base: the first pause)."""
        failures = self._failures.get(key, 0)
        self._failures[key] = failures + 1
        return self.clock() + dt.timedelta(seconds=self.delay(base, failures))

    def delay(self, base: float, failures: int) -> float:
        """The pause after ``failures`` earlier failures in a row."""
        return min(base * 2.0 ** min(failures, 32), self.cap)

    def succeeded(self, key: Key) -> None:
        self._failures.pop(key, None)

    def failures(self, key: Key) -> int:
        return self._failures.get(key, 0)


class WorkQueue:
    def __init__(self, work: Callable[[Key], Awaitable[None]], workers: int = 2,
                 backoff: Backoff | None = None) -> None:
        self.work = work
        self.workers = workers
        self.backoff = backoff or Backoff()
        self._queue: asyncio.Queue[Key] | None = None
        self._queued: set[Key] = set()
        #: Keys a worker is reconciling, and those of them woken meanwhile.
        self._active: set[Key] = set()
        self._dirty: set[Key] = set()
        self._timers: dict[Key, asyncio.TimerHandle] = {}
        #: Keys to be queued once their gathering window ends (:meth:`enqueue_within`).
        self._gathering: dict[Key, asyncio.TimerHandle] = {}
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._queue = asyncio.Queue()
        self._tasks = [asyncio.create_task(self._worker(), name=f"elasticrun-worker-{i}")
                       for i in range(self.workers)]

    async def stop(self) -> None:
        for timer in [*self._timers.values(), *self._gathering.values()]:
            timer.cancel()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def enqueue(self, key: Key) -> None:
        if key in self._active:
            self._dirty.add(key)
            return
        if self._queue is None or key in self._queued:
            return
        self._queued.add(key)
        self._queue.put_nowait(key)

    def enqueue_within(self, key: Key, window: float) -> None:
        """Enqueue ``key`` at the latest ``window`` seconds from now, with every other
        call made meanwhile: one reconcile for a burst of events.

        The first call of a burst opens the window and later calls never extend
        it, so a steady stream of events still gets a reconcile every ``window``.
        """
        if self._queue is None or key in self._queued or key in self._gathering:
            return
        loop = asyncio.get_running_loop()
        self._gathering[key] = loop.call_later(window, self._gathered, key)

    def _gathered(self, key: Key) -> None:
        self._gathering.pop(key, None)
        self.enqueue(key)

    def schedule(self, key: Key, when: dt.datetime) -> None:
        """Enqueue ``key`` at ``when``, replacing the key's earlier timer."""
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
            self._active.add(key)
            try:
                await self._work_on(key)
            finally:
                self._active.discard(key)
                if key in self._dirty:
                    self._dirty.discard(key)
                    self.enqueue(key)

    async def _work_on(self, key: Key) -> None:
        try:
            await self.work(key)
        except (ApiError, ApiConnectionError) as exc:
            retry = self.backoff.failed(key, requeue_delay(exc))
            log.warning("reconciling %s/%s failed: %s; retrying in %.1fs", *key, exc,
                        (retry - now()).total_seconds())
            self.schedule(key, retry)
        except Exception as exc:
            retry = self.backoff.failed(key, requeue_delay(exc))
            log.exception("reconciling %s/%s failed; retrying in %.1fs", *key,
                          (retry - now()).total_seconds())
            self.schedule(key, retry)
        else:
            self.backoff.succeeded(key)
