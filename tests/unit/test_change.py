"""The one compare-and-set loop (elasticrun.api.change), over a fake of the store it uses.

The fake answers the way a node's :class:`~elasticrun.handler.session.RunSession`
does: ``None`` from ``read`` for a deleted run (404), ``None`` from
``replace_status`` for a lost compare-and-set (409).  Time is a fake clock that
the injected ``sleep`` advances, so no test sleeps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
from fakegateway import FakeApiServer, FakeGateway
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from elasticrun.api import rounds
from elasticrun.api.change import ChangePolicy, change_status
from elasticrun.api.model import ElasticRun, RunStatus
from elasticrun.handler.session import RunSession
from elasticrun.handler.settings import from_parameters

from builders import at, run, sealed


class Clock:
    """Monotonic seconds that move only when the loop sleeps."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class FakeStore:
    """A run's store: every read returns the stored run (None: deleted), every write
    wins unless a conflict is scripted for it; resourceVersions count the writes."""

    def __init__(self, stored: ElasticRun | None, conflicts: int = 0) -> None:
        self.stored = stored
        self.conflicts = conflicts
        self.reads: list[float | None] = []
        self.writes: list[RunStatus] = []

    def read(self, bound: float | None = None) -> ElasticRun | None:
        self.reads.append(bound)
        return self.stored

    def replace_status(self, current: ElasticRun, status: RunStatus,
                       bound: float | None = None) -> ElasticRun | None:
        self.writes.append(status)
        assert self.stored is not None
        if self.conflicts:
            # Someone else wrote first: their write moved the resourceVersion.
            self.conflicts -= 1
            version = str(int(self.stored.resource_version) + 1)
            self.stored = dataclasses.replace(self.stored, resource_version=version)
            return None
        assert current.resource_version == self.stored.resource_version
        version = str(int(self.stored.resource_version) + 1)
        self.stored = dataclasses.replace(self.stored.replace_status(status),
                                          resource_version=version)
        return self.stored


def leave_a(current: ElasticRun) -> RunStatus | None:
    return rounds.leave(current.status, "a", at(10), finished=False)


def exact(longest: float) -> float:
    """No jitter: the loop pauses the longest pause the policy allows."""
    return longest


def loop(store: FakeStore, clock: Clock, policy: ChangePolicy,
         operation: Callable[[ElasticRun], RunStatus | None] = leave_a,
         **kwargs: Any) -> ElasticRun | None:
    return change_status(store, operation, policy, clock=clock, sleep=clock.sleep,
                         jitter=exact, **kwargs)


def test_a_lost_compare_and_set_is_applied_again_to_the_winners_run_after_a_pause() -> None:
    store, clock = FakeStore(run(sealed("a", "b")), conflicts=1), Clock()
    written = loop(store, clock, ChangePolicy(attempts=6, seconds=None))
    assert written is not None and written.status.member_names == {"b"}
    assert len(store.reads) == 2 and len(store.writes) == 2
    assert clock.sleeps == [ChangePolicy().pauses[0]]  # one pause, between the two tries


def test_the_pauses_grow_and_are_jittered_up_to_the_policys() -> None:
    store, clock = FakeStore(run(sealed("a", "b")), conflicts=3), Clock()
    drawn: list[float] = []

    def half(longest: float) -> float:
        drawn.append(longest)
        return longest / 2

    policy = ChangePolicy(attempts=None, seconds=30.0, pauses=(0.1, 0.2))
    written = change_status(store, leave_a, policy, clock=clock, sleep=clock.sleep,
                            jitter=half)
    assert written is not None
    assert drawn == [0.1, 0.2, 0.2] and clock.sleeps == [0.05, 0.1, 0.1]


def test_attempts_run_out_with_every_compare_and_set_lost() -> None:
    store, clock = FakeStore(run(sealed("a", "b")), conflicts=100), Clock()
    assert loop(store, clock, ChangePolicy(attempts=3, seconds=None, pauses=(0.1, 0.2))) is None
    assert len(store.writes) == 3 and clock.sleeps == [0.1, 0.2]


def test_a_deadline_ends_the_loop_and_each_call_gets_what_is_left_of_it() -> None:
    store, clock = FakeStore(run(sealed("a", "b")), conflicts=100), Clock()
    assert loop(store, clock, ChangePolicy(attempts=None, seconds=1.0, pauses=(0.3,))) is None
    assert clock.sleeps == [0.3, 0.3, 0.3]  # a fourth pause would pass the deadline
    assert store.reads == pytest.approx([1.0, 0.7, 0.4, 0.1])


def test_a_deleted_run_has_nothing_to_change() -> None:
    store, clock = FakeStore(None), Clock()
    assert loop(store, clock, ChangePolicy()) is None
    assert store.writes == [] and clock.sleeps == []


def test_nothing_to_change_writes_nothing() -> None:
    """An operation that returns None (the member left already) ends the loop at once."""
    left = leave_a(run(sealed("a", "b")))
    assert left is not None
    store, clock = FakeStore(run(left)), Clock()
    assert loop(store, clock, ChangePolicy()) is None
    assert store.writes == [] and len(store.reads) == 1


def test_a_held_copy_saves_the_first_read() -> None:
    held = run(sealed("a", "b"))
    store, clock = FakeStore(held, conflicts=1), Clock()
    assert loop(store, clock, ChangePolicy(), run=held) is not None
    assert len(store.reads) == 1 and len(store.writes) == 2


def test_a_policy_needs_a_bound() -> None:
    with pytest.raises(ValueError, match="bound"):
        ChangePolicy(attempts=None, seconds=None)
    with pytest.raises(ValueError, match="at least 1"):
        ChangePolicy(attempts=0)


def test_an_unreachable_api_server_is_torchs_connection_error_within_the_policys_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Through a node's session: the loop's remaining time bounds each call, and the
    session maps the outage to RendezvousConnectionError (no retry past the bound)."""
    monkeypatch.setenv("POD_NAMESPACE", "team")
    monkeypatch.setenv("POD_NAME", "trainer-3")
    monkeypatch.setenv("POD_IP", "10.1.2.3")
    settings = from_parameters(run_id="run", endpoint="", min_nodes=1, max_nodes=2,
                               local_addr=None, conf={})
    unreachable = FakeGateway(FakeApiServer(), "run")
    unreachable.fail_next("*", 100, "connection")
    session = RunSession(settings, unreachable)
    clock = Clock()
    with pytest.raises(RendezvousConnectionError, match=r"did not answer within 0s"):
        change_status(session, leave_a, ChangePolicy(seconds=0.01), clock=clock,
                      sleep=clock.sleep, jitter=exact)
    assert clock.sleeps == []
