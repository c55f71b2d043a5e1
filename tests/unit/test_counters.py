"""Bounded counters: one maximum for every integer of the status, in the schema and the model.

A status write of ``round: 2**63-1`` used to be accepted and left the run
unable to seal; a remembered absurd round then undid an admin's reset.
"""

from __future__ import annotations

from typing import Any

import pytest

from elasticrun.api import crd, leases
from elasticrun.api.model import (
    CONDITIONS_KEPT,
    MAX_TOPOLOGY_VALUES,
    Condition,
    InvalidRunError,
    RunStatus,
    next_signal,
    parse_run,
)
from elasticrun.api.ordering import ABSURD_ROUND, RoundMark
from elasticrun.operator.reconcile import repair

from builders import T0

MAX = crd.counter_maximum()


def _integers(schema: dict[str, Any], path: str) -> list[tuple[str, dict[str, Any]]]:
    found: list[tuple[str, dict[str, Any]]] = []
    if schema.get("type") == "integer":
        found.append((path, schema))
    for name, sub in (schema.get("properties") or {}).items():
        found += _integers(sub, f"{path}.{name}")
    if "items" in schema:
        found += _integers(schema["items"], f"{path}[]")
    return found


def _lists(schema: dict[str, Any], path: str) -> list[tuple[str, dict[str, Any]]]:
    found = [(path, schema)] if schema.get("type") == "array" else []
    for name, sub in (schema.get("properties") or {}).items():
        found += _lists(sub, f"{path}.{name}")
    if "items" in schema:
        found += _lists(schema["items"], f"{path}[]")
    return found


def test_every_integer_of_the_status_has_the_one_counter_maximum() -> None:
    status = {"type": "object", "properties": crd.status_properties()}
    counters = [(path, s) for path, s in _integers(status, "status")
                if not path.endswith(("port", "storePort"))]
    assert {p for p, _ in counters} >= {"status.round", "status.signal", "status.joinNotice",
                                        "status.restartRound", "status.memberCount",
                                        "status.waitingCount", "status.observedGeneration",
                                        "status.participants[].rank",
                                        "status.participants[].joinedRound",
                                        "status.lostMembers[].round",
                                        "status.conditions[].observedGeneration"}
    for path, schema in counters:
        assert schema.get("maximum") == MAX == 2**31 - 1, path
    assert leases.MAX_COUNTER == MAX + 1  # the Lease reader's exclusive bound is the same


def test_every_list_of_the_status_has_max_items() -> None:
    status = {"type": "object", "properties": crd.status_properties()}
    sizes = {path: s.get("maxItems") for path, s in _lists(status, "status")}
    assert sizes == {"status.participants": 2048, "status.waiting": 4096,
                     "status.lostMembers": 16, "status.conditions": CONDITIONS_KEPT,
                     "status.excludedPods": 4096,
                     "status.waiting[].topology": MAX_TOPOLOGY_VALUES}
    assert sizes["status.participants"] >= crd.spec_maximum("maxNodes")


@pytest.mark.parametrize(("status", "field"), [
    ({"round": MAX + 1}, "status.round"),
    ({"signal": 2**63 - 1}, "status.signal"),
    ({"observedGeneration": MAX + 1}, "status.observedGeneration"),
    ({"round": 1, "restartRound": 1, "phase": "Degraded",
      "participants": [{"name": "a", "rank": MAX + 1}]}, "status.participants[0].rank"),
])
def test_a_counter_past_the_maximum_is_refused_naming_the_bound(
        status: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRunError, match=rf"must be <= {MAX}") as info:
        RunStatus.from_dict(status)
    assert info.value.field == field


def test_a_round_at_the_maximum_is_refused_because_no_round_can_follow() -> None:
    with pytest.raises(InvalidRunError, match="no round can follow it") as info:
        RunStatus.from_dict({"round": MAX, "signal": MAX})
    assert "write a lower round" in str(info.value)
    assert RunStatus.from_dict({"round": MAX - 1, "signal": MAX}).round == MAX - 1


def test_the_signal_wraps_instead_of_passing_the_maximum() -> None:
    assert next_signal(7) == 8
    assert next_signal(MAX) == 1 != MAX


def test_repair_of_a_round_at_the_maximum_starts_again_from_the_defended_round() -> None:
    raw = {"round": MAX, "signal": MAX, "joinNotice": 3, "restartRound": 0}
    fixed = RunStatus.from_dict(repair(raw, ValueError("x"), T0, 2**40, min_round=4))
    assert (fixed.round, fixed.restart_round, fixed.signal) == (4, 4, 1)
    assert fixed.observed_generation == MAX  # generation is int64; the status field is not
    assert RunStatus.from_dict(repair(raw, ValueError("x"), T0, 1)).round == 0


def test_conditions_written_are_bounded() -> None:
    many = tuple(Condition(type=f"T{i}", status="True") for i in range(CONDITIONS_KEPT + 5))
    written = RunStatus(conditions=many).to_dict()["conditions"]
    assert [c["type"] for c in written] == [f"T{i}" for i in range(5, CONDITIONS_KEPT + 5)]


def _run(round_: int, rv: int, uid: str = "u") -> Any:
    status: dict[str, Any] = {"round": round_, "signal": round_ % MAX}
    return parse_run({"metadata": {"name": "r", "namespace": "ns", "uid": uid,
                                   "resourceVersion": str(rv)}, "status": status})


def test_an_absurd_mark_defends_nothing_so_an_admins_sane_round_is_a_reset() -> None:
    mark = RoundMark().advance(_run(MAX - 1, 10))
    assert mark.floor("u") == 0
    reset = mark.advance(_run(5, 11))
    assert reset == RoundMark("u", 5)
    # From the reset on, the sane round is defended again: a stale copy of round 5
    # written after round 6 is refused as before.
    with pytest.raises(InvalidRunError, match="went back from 6 to 5"):
        reset.advance(_run(6, 12)).advance(_run(5, 13))


def test_a_round_below_the_absurd_line_is_still_defended() -> None:
    mark = RoundMark().advance(_run(ABSURD_ROUND - 1, 10))
    with pytest.raises(InvalidRunError, match="went back"):
        mark.advance(_run(5, 11))
    assert RoundMark().advance(_run(ABSURD_ROUND, 10)).advance(_run(5, 11)).highest == 5
