"""The watches for one event (quiet, settled, end) are paced against a server that ends them
at once, and that pacing never holds back the watch a node switches to.

A woken member rejoins and waits on the settled watch; a pause meant for a
server that keeps ending the quiet watch must not stand between the two.  The
pause is made a minute long here, so a watch that waited it out could not
open within the tests' bound.
"""

from __future__ import annotations

import time

import pytest
from fakegateway import FakeApiServer, FakeGateway

from elasticrun.handler import watcher as watcher_mod
from elasticrun.handler.watcher import RunWatcher

from builders import quiet_spec, sealed
from conftest import wait_for

RUN_NAME = "r"
#: How long a test waits for a watch to open before it counts as held back.
BOUND = 5.0
#: The pause of the tests that switch: far beyond BOUND.
LONG_PAUSE = 60.0


@pytest.fixture
def server() -> FakeApiServer:
    server = FakeApiServer("ns")
    server.seed_run(RUN_NAME, quiet_spec(), sealed("a", "b", round_=1))
    return server


def test_a_quiet_watch_the_server_ends_at_once_is_opened_again_only_after_a_pause(
        server: FakeApiServer) -> None:
    gateway = FakeGateway(server, RUN_NAME)
    watcher = RunWatcher(gateway, watch_timeout=0)  # every watch ends as it opens
    watcher.watch_quietly(1)
    watcher.start()
    try:
        # Positive control: the watch is opened again.
        wait_for(lambda: gateway.reached["watch_round"] >= 2, BOUND, "the quiet watch again",
                 interval=0.01)
        began, first = time.monotonic(), gateway.reached["watch_round"]
        time.sleep(10 * watcher_mod.QUIET_REOPEN_AFTER)
        opened = gateway.reached["watch_round"] - first
        assert 1 <= opened <= (time.monotonic() - began) / watcher_mod.QUIET_REOPEN_AFTER + 1
        assert not watcher.disturbed(1)
    finally:
        watcher.stop()


def test_a_switch_ends_the_pause_of_a_watch_the_server_ended(
        server: FakeApiServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(watcher_mod, "QUIET_REOPEN_AFTER", LONG_PAUSE)
    gateway = FakeGateway(server, RUN_NAME)
    watcher = RunWatcher(gateway, watch_timeout=0)
    watcher.watch_quietly(1)
    watcher.start()
    try:
        wait_for(lambda: gateway.reached["watch_round"], BOUND, "the quiet watch",
                 interval=0.01)
        time.sleep(0.3)
        assert gateway.reached["watch_round"] == 1  # pausing, not opening it again
        watcher.watch_for_settled()
        wait_for(lambda: gateway.reached["watch_settled"], BOUND, "the settled watch",
                 interval=0.01)
    finally:
        watcher.stop()


def test_a_quiet_watch_that_told_its_news_at_once_leaves_no_pause_before_the_next_watch(
        server: FakeApiServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The round is disturbed before the quiet watch opens: its news comes with the opening,
    and the member's rejoin switches to the settled watch at once.

    A switch ends a pause (the test above), so how soon the settled watch opens
    cannot tell whether a pause followed the news: the pauses the watcher takes
    are counted instead."""
    monkeypatch.setattr(watcher_mod, "QUIET_REOPEN_AFTER", LONG_PAUSE)
    gateway = FakeGateway(server, RUN_NAME)
    watcher = RunWatcher(gateway, watch_timeout=300)
    pauses: list[int] = []
    pause = watcher._pause

    def counted(mode: int, until: float) -> None:
        pauses.append(mode)
        pause(mode, until)

    monkeypatch.setattr(watcher, "_pause", counted)
    watcher.watch_quietly(1)  # the run holds round 1, undisturbed: no news
    watcher.start()
    try:
        # Positive control: a quiet watch the server ends without its news is paused after.
        wait_for(lambda: server.watches, BOUND, "the quiet watch open", interval=0.01)
        server.end_watches()
        wait_for(lambda: pauses, BOUND, "a pause after the ended watch", interval=0.01)
        watcher.watch_quietly(2)  # round 2 shows as disturbed as the watch opens
        wait_for(lambda: watcher.disturbed(2), BOUND, "round 2 disturbed", interval=0.01)
        assert watcher.disturbed_version == server.run(RUN_NAME)["metadata"]["resourceVersion"]
        watcher.watch_for_settled()
        wait_for(lambda: gateway.reached["watch_settled"], BOUND, "the settled watch",
                 interval=0.01)
        # The watch's thread decides on a pause before it opens the next watch: with the
        # settled watch open, a pause after round 2's news would have been counted.
        assert len(pauses) == 1
    finally:
        watcher.stop()
