"""The operator's work queue, without a server: one entry per run, retries after failures."""

from __future__ import annotations

import asyncio
import datetime as dt

from elasticrun.api.kube import ApiConnectionError
from elasticrun.api.model import now
from elasticrun.operator.workqueue import BACKOFF_CAP_SECONDS, Backoff, Key, WorkQueue


def test_a_run_is_queued_once_however_often_it_is_woken() -> None:
    done: list[Key] = []

    async def scenario() -> None:
        gate = asyncio.Event()

        async def work(key: Key) -> None:
            await gate.wait()
            done.append(key)

        queue = WorkQueue(work, workers=1)
        queue.start()
        queue.enqueue(("ns", "a"))
        await asyncio.sleep(0)  # the worker takes "a" and blocks on the gate
        for _ in range(3):
            queue.enqueue(("ns", "b"))
        gate.set()
        await asyncio.sleep(0.05)
        await queue.stop()

    asyncio.run(scenario())
    assert done == [("ns", "a"), ("ns", "b")]


def test_a_failed_reconcile_is_tried_again() -> None:
    calls: list[Key] = []

    async def scenario() -> None:
        async def work(key: Key) -> None:
            calls.append(key)
            if len(calls) == 1:
                raise ApiConnectionError("refused")

        queue = WorkQueue(work, workers=1)
        queue.start()
        queue.enqueue(("ns", "r"))
        await asyncio.sleep(1.3)  # retried after REQUEUE_AFTER_API_ERROR (1 s)
        await queue.stop()

    asyncio.run(scenario())
    assert calls == [("ns", "r"), ("ns", "r")]


def test_a_later_timer_replaces_an_earlier_one() -> None:
    calls: list[Key] = []

    async def scenario() -> None:
        async def work(key: Key) -> None:
            calls.append(key)

        queue = WorkQueue(work, workers=1)
        queue.start()
        queue.schedule(("ns", "r"), now() + dt.timedelta(seconds=0.1))
        queue.schedule(("ns", "r"), now() + dt.timedelta(seconds=30))
        await asyncio.sleep(0.3)
        await queue.stop()

    asyncio.run(scenario())
    assert calls == []


def test_a_run_woken_while_it_is_reconciled_waits_and_is_reconciled_once_more() -> None:
    running: list[Key] = []
    overlaps: list[Key] = []
    calls: list[Key] = []

    async def scenario() -> None:
        gate, holding, again = asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def work(key: Key) -> None:
            if key in running:
                overlaps.append(key)
            running.append(key)
            calls.append(key)
            holding.set()
            if len(calls) > 1:
                again.set()
            await gate.wait()
            running.remove(key)

        queue = WorkQueue(work, workers=3)
        queue.start()
        queue.enqueue(("ns", "r"))
        await asyncio.wait_for(holding.wait(), 1)  # a worker holds "r"
        for _ in range(3):
            queue.enqueue(("ns", "r"))  # idle workers must not take it meanwhile
        await asyncio.sleep(0.05)  # long enough for an idle worker to have taken it
        assert calls == [("ns", "r")]
        gate.set()
        await asyncio.wait_for(again.wait(), 1)  # woken meanwhile: reconciled once more
        await asyncio.sleep(0.05)  # and only once
        await queue.stop()

    asyncio.run(scenario())
    assert overlaps == []
    assert calls == [("ns", "r"), ("ns", "r")]


def test_a_runs_failures_back_off_per_run_up_to_the_cap_and_a_success_resets() -> None:
    at = now()
    backoff = Backoff(clock=lambda: at, cap=BACKOFF_CAP_SECONDS)

    def pauses(key: Key, count: int, base: float) -> list[float]:
        return [(backoff.failed(key, base) - at).total_seconds() for _ in range(count)]

    assert pauses(("ns", "r"), 4, 1.0) == [1.0, 2.0, 4.0, 8.0]
    assert pauses(("ns", "other"), 2, 5.0) == [5.0, 10.0]  # its own count
    assert pauses(("ns", "r"), 8, 1.0)[-1] == BACKOFF_CAP_SECONDS
    backoff.succeeded(("ns", "r"))
    assert pauses(("ns", "r"), 1, 1.0) == [1.0]
    assert backoff.failures(("ns", "other")) == 2


def test_the_queue_backs_a_failing_run_off_and_forgets_it_once_it_succeeds() -> None:
    calls: list[Key] = []
    at = now()
    backoff = Backoff(clock=lambda: at)

    async def scenario() -> None:
        async def work(key: Key) -> None:
            calls.append(key)
            if len(calls) < 3:
                raise ApiConnectionError("refused")

        queue = WorkQueue(work, workers=1, backoff=backoff)
        queue.start()
        for expected in (1, 2):
            queue.enqueue(("ns", "r"))  # an event wakes it at once, as always
            await asyncio.sleep(0.05)
            assert backoff.failures(("ns", "r")) == expected
        queue.enqueue(("ns", "r"))
        await asyncio.sleep(0.05)
        assert backoff.failures(("ns", "r")) == 0
        await queue.stop()

    asyncio.run(scenario())
    assert len(calls) == 3
