"""The operator's work queue, without a server: one entry per run, retries after failures."""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools

import pytest

from elasticrun.api.kube import ApiConnectionError
from elasticrun.api.leases import node_lease
from elasticrun.api.model import RunSpec, new_run_manifest, now
from elasticrun.api.rounds import DEFER_SEAL_FROM
from elasticrun.operator.controller import LEASE_EVENT_WINDOW, Controller, lease_event_window
from elasticrun.operator.metrics import Metrics
from elasticrun.operator.workqueue import BACKOFF_CAP_SECONDS, Backoff, Key, WorkQueue

from builders import idle_client


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
    seen: list[list[Key]] = []

    async def scenario() -> None:
        async def work(key: Key) -> None:
            calls.append(key)

        queue = WorkQueue(work, workers=1)
        queue.start()
        queue.schedule(("ns", "r"), now() + dt.timedelta(seconds=0.1))
        queue.schedule(("ns", "r"), now() + dt.timedelta(seconds=30))
        await asyncio.sleep(0.3)  # three times the replaced timer
        seen.append(list(calls))
        # Positive control: the same queue runs a timer that is not replaced, once.
        queue.schedule(("ns", "r"), now() + dt.timedelta(seconds=0.1))
        await asyncio.sleep(0.3)
        await queue.stop()

    asyncio.run(scenario())
    assert seen == [[]]
    assert calls == [("ns", "r")]


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


def test_a_burst_within_a_window_is_one_reconcile_and_a_steady_stream_is_not_held_back() -> None:
    calls: list[float] = []

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        began = loop.time()

        async def work(key: Key) -> None:
            calls.append(loop.time() - began)

        queue = WorkQueue(work, workers=1)
        queue.start()
        for _ in range(50):  # a burst: gathered into one pass at the window's end
            queue.enqueue_within(("ns", "r"), 0.2)
        await asyncio.sleep(0.1)
        assert calls == []
        await asyncio.sleep(0.2)
        assert len(calls) == 1
        # Events every 50 ms for 0.9 s: the window never moves, so a pass every 0.2 s,
        # never two within one window, and never held back for the whole stream.
        calls.clear()
        for _ in range(18):
            queue.enqueue_within(("ns", "r"), 0.2)
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        await queue.stop()

    asyncio.run(scenario())
    assert len(calls) >= 4
    assert all(later - earlier >= 0.2 - 0.01 for earlier, later in itertools.pairwise(calls))


def test_a_large_runs_lease_events_are_gathered_and_a_small_runs_go_at_once() -> None:
    """In runs whose nodes defer the seal, a join burst costs one reconcile per window;
    in smaller runs every Lease event still queues the run at once."""
    passes: dict[str, list[float]] = {"large": [], "small": []}

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        began = loop.time()
        controller = Controller(idle_client(), Metrics())

        async def record(key: Key) -> None:
            passes[key[1]].append(loop.time() - began)
            await asyncio.sleep(0.01)  # a pass takes a while: events meanwhile wait

        controller.queue = WorkQueue(record, workers=2)
        controller.queue.start()
        for name, size in (("large", 2048), ("small", DEFER_SEAL_FROM - 1)):
            manifest = new_run_manifest(name, "ns", RunSpec(min_nodes=1, max_nodes=size))
            manifest["metadata"].update(uid=f"uid-{name}", resourceVersion="1")
            controller.run_event("ADDED", manifest)
        for i in range(40):
            for name in ("large", "small"):
                lease = node_lease(name, f"n{i}", f"n{i}", 10, f"uid-{name}", now())
                lease["metadata"]["namespace"] = "ns"
                controller.lease_event(lease, "ADDED")
            await asyncio.sleep(0.001)
        await asyncio.sleep(LEASE_EVENT_WINDOW + 0.1)
        await controller.queue.stop()

    asyncio.run(scenario())
    # The run's own event queues it at once; its 40 Lease events, one pass at the window's end.
    first, *gathered = passes["large"]
    assert first < LEASE_EVENT_WINDOW / 2
    assert len(gathered) == 1 and gathered[0] >= LEASE_EVENT_WINDOW
    # The small run: a pass after the run's event, then again and again while events come.
    assert len(passes["small"]) >= 3 and passes["small"][1] < LEASE_EVENT_WINDOW / 2


@pytest.mark.parametrize(("max_nodes", "window"), [
    (DEFER_SEAL_FROM - 1, None), (DEFER_SEAL_FROM, 0.0064), (256, 0.0256), (1024, 0.1024),
    (2000, 0.2), (2048, LEASE_EVENT_WINDOW)])
def test_a_runs_lease_events_wait_in_proportion_to_its_size(max_nodes: int,
                                                             window: float | None) -> None:
    """A pass over the run costs O(maxNodes): its Lease events wait in proportion, up to
    ``LEASE_EVENT_WINDOW``; runs whose nodes seal themselves not at all."""
    manifest = new_run_manifest("r", "ns", RunSpec(min_nodes=1, max_nodes=max_nodes))
    assert lease_event_window(manifest) == pytest.approx(window)
