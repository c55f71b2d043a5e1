"""The resize benchmark's counting: restarts and the time to the round, from agents' records."""

from __future__ import annotations

from typing import Any

import pytest

from bench.resize import outcome, starts


def _entry(cause: str, t_start: float, t_done: float, world: int) -> dict[str, Any]:
    return {"cause": cause, "t_start": t_start, "t_done": t_done, "rank": 0, "world": world}


def _agent(node: str, *rounds: dict[str, Any]) -> dict[str, Any]:
    return {"kind": "agent", "node": node, "rounds": list(rounds), "polls": 3}


def test_two_newcomers_a_second_apart_cost_today_two_restarts() -> None:
    """Each newcomer makes its own round: members restart twice, the first newcomer once."""
    records = [
        _agent("m0", _entry("signal", 10.1, 10.2, 3), _entry("signal", 11.1, 11.3, 4)),
        _agent("m1", _entry("signal", 10.1, 10.2, 3), _entry("signal", 11.1, 11.25, 4)),
        _agent("n0", _entry("start", 10.0, 10.2, 3), _entry("signal", 11.1, 11.2, 4)),
        _agent("n1", _entry("start", 11.0, 11.3, 4)),
        {"kind": "rendezvous", "node": "m0", "world": 2},  # not an agent's record
    ]
    row = outcome(records, ["m0", "m1"], ["n0", "n1"], target=4, t_from=11.0)
    assert row["formed"] is True
    assert row["round_s"] == pytest.approx(0.3)
    assert (row["restarts"], row["restarts_min"], row["newcomer_restarts"]) == (2, 2, 1)
    assert row["sizes"] == [3, 4]
    assert row["signalled"] == 2
    assert row["seen_all_s"] == pytest.approx(-0.9)  # signalled by the first newcomer
    assert "errors" not in row


def test_one_restart_for_all_newcomers() -> None:
    records = [_agent("m0", _entry("signal", 11.05, 11.1, 4)),
               _agent("m1", _entry("signal", 11.06, 11.12, 4)),
               _agent("n0", _entry("start", 10.0, 11.1, 4)),
               _agent("n1", _entry("start", 11.0, 11.1, 4))]
    row = outcome(records, ["m0", "m1"], ["n0", "n1"], target=4, t_from=11.0)
    assert (row["formed"], row["restarts"], row["newcomer_restarts"]) == (True, 1, 0)
    assert row["round_s"] == pytest.approx(0.12)
    assert row["seen_all_s"] == pytest.approx(0.06)


def test_a_node_whose_last_round_has_the_wrong_size_is_not_formed() -> None:
    records = [_agent("m0", _entry("signal", 10.1, 10.2, 3)),
               _agent("n0", _entry("start", 10.0, 10.2, 3)),
               _agent("n1", _entry("start", 11.0, 12.0, 4))]
    row = outcome(records, ["m0"], ["n0", "n1"], target=4, t_from=11.0)
    assert row["formed"] is False
    assert "round_s" not in row
    assert row["restarts"] == 1


def test_errors_and_missing_records_are_reported_and_not_formed() -> None:
    failed = {"cause": "signal", "t_start": 10.0, "t_done": 10.5,
              "error": "RendezvousTimeoutError: no round"}
    records = [_agent("m0", failed), {**_agent("m1"), "watch_error": "ApiError: 500"}]
    row = outcome(records, ["m0", "m1"], ["n0"], target=2, t_from=10.0)
    assert row["formed"] is False
    assert row["errors"] == ["m0: RendezvousTimeoutError: no round", "m1: ApiError: 500",
                             "n0: no record"]
    assert (row["restarts"], row["restarts_min"]) == (1, 0)


def test_members_never_signalled_reenter_by_themselves() -> None:
    """c10d's survivors of a lost member: no signal, a re-entry timed on its own."""
    records = [_agent("m0", _entry("fallback", 15.0, 15.4, 3)),
               _agent("m1", _entry("fallback", 15.0, 15.5, 3)),
               _agent("m2", _entry("fallback", 15.01, 15.3, 3))]
    row = outcome(records, ["m0", "m1", "m2"], [], target=3, t_from=10.0)
    assert row["formed"] is True
    assert row["signalled"] == 0 and "seen_all_s" not in row
    assert row["round_s"] == pytest.approx(5.5)
    assert row["reentry_to_round_s"] == pytest.approx(0.5)
    assert row["restarts"] == 1 and "newcomer_restarts" not in row


def test_first_formation_has_no_members_to_restart() -> None:
    records = [_agent(f"n{i}", _entry("start", 10.0 + i / 2, 40.0 + i / 100, 4))
               for i in range(4)]
    row = outcome(records, [], [f"n{i}" for i in range(4)], target=4, t_from=11.5)
    assert row["formed"] is True
    assert row["round_s"] == pytest.approx(28.53)
    assert "restarts" not in row and row["newcomer_restarts"] == 0


def test_starts_are_spaced_from_the_first() -> None:
    assert starts(["a", "b", "c"], 5.0, 0.5) == {"a": 5.0, "b": 5.5, "c": 6.0}
    assert starts([], 5.0, 1.0) == {}
