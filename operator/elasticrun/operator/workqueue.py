"""The operator's work queue: each run at most once in it, woken by events and deadlines.

A run is never reconciled by two workers at once: the queue holds each key at
most once, and a key woken while a worker reconciles it waits until that
reconcile is over, then goes into the queue once.  Two passes at once would
both act on the same Lease index: two status writes of which one must lose,
and every member of a large run told its place twice.  A reconcile that
raises is tried again after the delay :func:`elasticrun.api.policy.requeue_delay`
gives for its error.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from collections.abc import Awaitable, Callable

from elasticrun.api.kube import ApiConnectionError, ApiError
from elasticrun.api.model import now
from elasticrun.api.policy import requeue_delay

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (namespace, run)


class WorkQueue:
    def __init__(self, work: Callable[[Key], Awaitable[None]], workers: int = 2) -> None:
        self.work = work
        self.workers = workers
        self._queue: asyncio.Queue[Key] | None = None
        self._queued: set[Key] = set()
        #: Keys a worker is reconciling, and those of them woken meanwhile.
        self._active: set[Key] = set()
        self._dirty: set[Key] = set()
        self._timers: dict[Key, asyncio.TimerHandle] = {}
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._queue = asyncio.Queue()
        self._tasks = [asyncio.create_task(self._worker(), name=f"elasticrun-worker-{i}")
                       for i in range(self.workers)]

    async def stop(self) -> None:
        for timer in self._timers.values():
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
            delay = requeue_delay(exc)
            log.warning("reconciling %s/%s failed: %s; retrying in %gs", *key, exc, delay)
            self.schedule(key, now() + dt.timedelta(seconds=delay))
        except Exception as exc:
            delay = requeue_delay(exc)
            log.exception("reconciling %s/%s failed; retrying in %gs", *key, delay)
            self.schedule(key, now() + dt.timedelta(seconds=delay))
