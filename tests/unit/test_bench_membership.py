"""The scale benchmark's reading of its members: who knew when, removals, places in a round."""

from __future__ import annotations

import dataclasses
from typing import Any

from elasticrun.api.model import LostMember

from bench.membership import monotonic_of, removal, until_all
from bench.simnode import placed_in
from builders import T0, at, running_run


def test_until_all_is_the_last_of_the_set_to_report() -> None:
    times = {"a": 10.5, "b": 12.0, "c": 11.0, "other": 99.0}
    assert until_all(times, {"a", "b", "c"}, since=10.0) == 2.0  # "other" is not asked


def test_until_all_is_none_while_one_of_the_set_has_not_reported() -> None:
    assert until_all({"a": 10.5}, {"a", "b"}, since=10.0) is None
    assert until_all({"a": 10.5}, set(), since=10.0) is None


def test_removal_is_the_nodes_last_record() -> None:
    lost = (LostMember("b", 1, "Left", time=at(1)), LostMember("c", 1, "LeaseExpired", time=at(2)),
            LostMember("b", 2, "LeaseExpired", time=at(3)))
    run = running_run(lost_members=lost)
    found = removal(run, "b")
    assert found is not None and (found.round, found.reason, found.time) == (
        2, "LeaseExpired", at(3))
    assert removal(run, "a") is None


def test_a_wall_time_is_put_on_the_monotonic_clock_by_one_reading_of_both() -> None:
    wall_now = T0.timestamp() + 10.0
    assert monotonic_of(at(7.5), wall_now, monotonic_now=500.0) == 497.5


def _status(round_: int, *names: str) -> dict[str, Any]:
    run = running_run()
    participants = tuple(dataclasses.replace(run.status.participants[0], name=n, rank=i)
                         for i, n in enumerate(names))
    return {"status": run.status.replace(round=round_, participants=participants).to_dict()}


def test_a_node_is_placed_by_a_round_after_the_one_it_held_that_holds_it() -> None:
    # With the round's rank 0, whose Lease the node reads before it holds the round.
    assert placed_in(_status(2, "a", "b", "new"), "new", held=1) == {
        "rank": 2, "world": 3, "round": 2, "leader": "a"}
    assert placed_in(_status(1, "b", "a"), "b", held=0) == {
        "rank": 0, "world": 2, "round": 1, "leader": "b"}


def test_the_round_it_held_or_one_without_it_places_nobody() -> None:
    assert placed_in(_status(1, "a", "b"), "b", held=1) is None  # its old round
    assert placed_in(_status(2, "a", "b"), "c", held=1) is None  # not admitted
    assert placed_in({}, "a", held=0) is None  # no round yet
