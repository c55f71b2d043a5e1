"""The resize benchmark's counting (restarts, the time to the round, from agents' records) and
what the bench worker reports of its nodes."""

# The rendered page uses en dashes and times signs.
# ruff: noqa: RUF001

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from bench import scenarios
from bench.resize import outcome, starts
from bench.worker import Node, Worker


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


class _Info:
    def __init__(self, world: int) -> None:
        self.rank, self.world_size = 0, world


class _Handler:
    """A handler whose ``num_nodes_waiting()`` answers from a script, then 0."""

    def __init__(self, waiting: list[int], worlds: list[int]) -> None:
        self.waiting, self.worlds = waiting, worlds
        self.entries = 0

    def num_nodes_waiting(self) -> int:
        return self.waiting.pop(0) if self.waiting else 0

    def next_rendezvous(self) -> _Info:
        self.entries += 1
        return _Info(self.worlds.pop(0))


def _run_agent(handler: _Handler, **fields: Any) -> dict[str, Any]:
    worker = Worker()
    worker.nodes["m0"] = Node("m0", handler, None)
    now = time.monotonic()
    worker.agent({"nodes": ["m0"], "until": now + 5, "interval": 0.01, "settle": 0.2,
                  **{k: (now + v if k == "fallback_at" else v) for k, v in fields.items()}})
    [result] = worker.collect({"timeout": 10})["results"]
    return result


def test_the_agent_loop_restarts_on_each_signal_until_the_target_holds() -> None:
    handler = _Handler([0, 1, 0, 0, 2], [3, 4])
    result = _run_agent(handler, target=4)
    assert [e["cause"] for e in result["rounds"]] == ["signal", "signal"]
    assert [e["world"] for e in result["rounds"]] == [3, 4]
    assert handler.entries == 2


def test_a_newcomer_enters_first_and_a_silent_member_falls_back() -> None:
    newcomer = _run_agent(_Handler([], [4]), target=4,
                          start_at={"m0": time.monotonic() + 0.05})
    assert [e["cause"] for e in newcomer["rounds"]] == ["start"]
    silent = _run_agent(_Handler([], [3]), target=3, fallback_at=0.1)
    assert [(e["cause"], e["world"]) for e in silent["rounds"]] == [("fallback", 3)]


def _row(case: str, variant: str, round_s: float, restarts: int, **extra: Any) -> dict[str, Any]:
    return {"case": case, "variant": variant, "formed": True, "round_s": round_s,
            "restarts": restarts, "members": 2, "newcomers": 2, "signalled": 2, "load": 1.0,
            **extra}


def test_the_resize_section_shows_each_column_and_the_ratio_to_c10d() -> None:
    from bench import resize_report

    assert resize_report.section({"backends": {}}) == []
    k8s = [_row("up-2-4", "owner", 0.4, 1, desired_in_status=4, target=4),
           _row("up-2-4", "owner", 0.6, 1, desired_in_status=None, target=4),
           _row("up-2-4", "no owner", 0.3, 2)]
    c10d = [_row("up-2-4", "c10d", 2.0, 1),
            _row("down-4-3", "c10d", 36.0, 1, signalled=0, reentry_to_round_s=31.0)]
    column = {"commit": "abc", "reps": 2, "backends": {"k8s": {"rows": k8s, "errors": []},
                                                       "c10d": {"rows": c10d, "errors": []}}}
    text = "\n".join(resize_report.section({"resize": {"after": column}}))
    assert ("| scale-up 2 → 4, run `2:4` | 0.50 s (0.40 s–0.60 s), 1 restart | 0.30 s, "
            "2 restarts | 2.00 s, 1 restart | 0.25× |") in text
    assert ("| scale-down 4 → 3, run `2:4` | – | – | 36.0 s, 1 restart (not signalled; "
            "re-entry → round 31.0 s) | – |") in text
    assert "equal to the Job's parallelism after the resize in 1 of 2 repetitions" in text
    assert "What the owner buys: `before` → `after`" not in text  # one column only


class _Stuck:
    """A handler whose ``next_rendezvous()`` waits until the test lets it go."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def next_rendezvous(self) -> _Info:
        self.release.wait(10)
        return _Info(1)


def test_a_node_still_busy_at_collect_is_reported_with_where_it_waits() -> None:
    handler = _Stuck()
    worker = Worker()
    worker.nodes["m0"] = Node("m0", handler, None)
    worker.rendezvous({"start_at": 0})
    try:
        busy = worker.collect({"timeout": 0.2})
        assert busy["pending"] == 1 and busy["results"] == []
        assert list(busy["stuck"]) == ["rendezvous_one:m0"]
        assert any(frame.endswith("next_rendezvous: self.release.wait(10)")
                   for frame in busy["stuck"]["rendezvous_one:m0"])
        where = scenarios._where(busy["stuck"])
        assert where.startswith("; rendezvous_one:m0 sits in:") and "release.wait" in where
    finally:
        handler.release.set()
    done = worker.collect({"timeout": 10})  # positive control: nothing busy, nothing reported
    assert done["pending"] == 0 and done["stuck"] == {} and scenarios._where({}) == ""
    assert [r["world"] for r in done["results"]] == [1]


class _Answering:
    """A worker that answers every command with ``answer``."""

    name = "w0"

    def __init__(self, answer: dict[str, Any]) -> None:
        self.answer = answer

    def send(self, cmd: str, **fields: Any) -> int:
        return 1

    def receive(self, msg_id: int, timeout: float) -> dict[str, Any]:
        return self.answer


def test_a_round_that_did_not_form_names_the_node_that_failed_and_where_the_others_wait(
        ) -> None:
    """One node's error ends its call while the others wait for it: the error says both."""
    answer = {"pending": 3, "results": [{"node": "node-004", "error": "SSLError: no CA"}],
              "stuck": {"rendezvous_one:node-000": ["a.py:1 f: x", "b.py:2 g: wait()"]}}
    with pytest.raises(scenarios.ScenarioError) as caught:
        scenarios.collect([_Answering(answer)], 60)  # type: ignore[list-item]
    assert str(caught.value) == (
        "w0: 3 nodes still busy after 60s (1 failed, first node-004: SSLError: no CA); "
        "rendezvous_one:node-000 sits in:\n    a.py:1 f: x\n    b.py:2 g: wait()")
    formed = {"pending": 0, "results": [{"node": "node-000", "t_done": 1.0}], "stuck": {}}
    assert scenarios.collect([_Answering(formed)], 60) == formed["results"]  # type: ignore[list-item]
