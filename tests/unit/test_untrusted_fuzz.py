"""Property: nothing a pod can write makes a handler or the operator raise or loop.

Leases and their join annotations are written by pods, and so are the status
fields nodes write.  Every shape below reaches the same readers the handler and
the operator use (``lease_state``, ``pending_joins``, ``parse_run``) and then
the pure decisions both take (``decide_seal``, ``seal_round``, ``reconcile``):
deep nesting, huge numbers, times at the edges of what Python can represent,
wrong types, 256 KiB values.  The only exception allowed out is
``InvalidRunError`` from the status parser (the handler's RendezvousStateError,
the operator's repair).
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elasticrun.api import crd, rounds, untrusted
from elasticrun.api.leases import (
    JOIN_ANNOTATION,
    UNREACHABLE_ANNOTATION,
    Unreachable,
    lease_run,
    lease_state,
    pending_joins,
    read_unreachable,
)
from elasticrun.api.model import (
    ElasticRun,
    InvalidRunError,
    Participant,
    RunSpec,
    RunStatus,
    StoreAddress,
    parse_run,
)
from elasticrun.api.slices import due, read_place
from elasticrun.operator.liveness import pod_loss
from elasticrun.operator.metrics import OTHER, Metrics, reason_label
from elasticrun.operator.reconcile import Members, reconcile

NOW = dt.datetime(2026, 11, 30, 12, tzinfo=dt.UTC)
UID = "uid-b"
#: Times at the edges: Python's limits, offsets that push past them in UTC, garbage.
EXTREME_TIMES = [
    "9999-12-31T23:59:59.999999Z", "9999-12-31T23:59:59-23:59", "0001-01-01T00:00:00+23:59",
    "0001-01-01T00:00:00Z", "1970-01-01T00:00:00Z", "2026-11-30T12:00:00Z",
    "2026-02-30T00:00:00Z", "99999-01-01T00:00:00Z", "", "now", "9" * 300,
]
HUGE_NUMBERS = [2**31 - 1, 2**63, 10**400, -(10**400), 1e308, -1e308, 0, -1]
DEEP = "[" * 100_000 + "]" * 100_000
SCALARS = st.one_of(
    st.none(), st.booleans(), st.sampled_from(HUGE_NUMBERS), st.integers(),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
    st.sampled_from(EXTREME_TIMES),
)
JSON = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8)


def _join_text(fields: dict[str, Any]) -> str:
    return json.dumps(fields, default=str)


JOIN_FIELDS = st.fixed_dictionaries({}, optional={
    "address": JSON, "storePort": st.one_of(st.sampled_from(HUGE_NUMBERS), JSON),
    "since": st.one_of(st.sampled_from(EXTREME_TIMES), JSON), "pod": JSON,
})
ANNOTATION = st.one_of(
    JOIN_FIELDS.map(_join_text),
    st.sampled_from([DEEP, '{"a":' * 5000 + "1" + "}" * 5000, "x" * 256 * 1024,
                     json.dumps({"address": "y" * 256 * 1024}), "null", "[]", "1e999",
                     "{", '{"since": "9999-12-31T23:59:59-23:59", "storePort": 1}']),
    JSON,
)


def _lease(node: Any, join: Any, renew: Any, duration: Any, owner: Any,
           created: Any, unreachable: Any = None) -> dict[str, Any]:
    return {
        "metadata": {
            "name": f"run-b.{node}", "creationTimestamp": created,
            "labels": {crd.RUN_LABEL: "run-b"},
            "annotations": {crd.RUN_LABEL: "run-b", crd.NODE_ANNOTATION: node,
                            JOIN_ANNOTATION: join, UNREACHABLE_ANNOTATION: unreachable},
            "ownerReferences": owner,
        },
        "spec": {"holderIdentity": node, "renewTime": renew, "leaseDurationSeconds": duration},
    }


LEASES = st.builds(
    _lease,
    node=st.one_of(st.sampled_from(["n0", "n1", "evil", "y" * 300]), JSON),
    join=ANNOTATION,
    renew=st.one_of(st.sampled_from(EXTREME_TIMES), JSON),
    duration=st.one_of(st.sampled_from(HUGE_NUMBERS), JSON),
    owner=st.one_of(st.just([{"kind": crd.KIND, "uid": UID}]), JSON),
    created=st.one_of(st.sampled_from(EXTREME_TIMES), JSON),
    unreachable=st.one_of(st.sampled_from(['{"node": "n0", "round": 1}',
                                           '{"node": "n0", "round": 1e999}']),
                          ANNOTATION),
)
#: Whole objects of any shape, as a Lease LIST could in theory return them.
ANYTHING = st.one_of(JSON, st.dictionaries(st.sampled_from(["metadata", "spec"]), JSON))


def _run(status: RunStatus, **spec: Any) -> ElasticRun:
    return ElasticRun("run-b", "ns", RunSpec(**{"min_nodes": 2, "max_nodes": 3, **spec}),
                      status, "9", uid=UID)


def _running() -> RunStatus:
    members = tuple(Participant(name=f"n{i}", rank=i, address="10.0.0.1", store_port=100 + i,
                                since=NOW) for i in range(2))
    return RunStatus(phase="Running", round=1, signal=1, participants=members,
                     store=StoreAddress("10.0.0.1", 100), sealed_at=NOW)


def _decide_everything(leases: list[Any]) -> None:
    """Every decision handler and operator take from these Leases, at several times."""
    states = [lease_state(item, seen=NOW) for item in leases]
    by_node = {s.node: s for s in states if s.node}
    for status in (RunStatus(), _running()):
        for when in (NOW, untrusted.LATEST, untrusted.EARLIEST):
            pending = pending_joins(states, status, when, UID, 15)
            view = _run(status.replace(waiting=pending))
            decision = rounds.decide_seal(view, when)
            if decision.seal_now:
                rounds.seal_round(view, when)
            rounds.order_for_ranks(status.participants, pending)
            rounds.nodes_waiting(view, 1, now=when)
            for large in (False, True):
                sized = (_run(status, max_nodes=rounds.TELL_IN_SLICES_FROM) if large
                         else _run(status))
                plan = reconcile(sized, Members(leases=by_node), when)
                if plan.status is not None:
                    RunStatus.from_dict(plan.status.to_dict())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(LEASES, max_size=4))
def test_crafted_leases_never_make_a_reader_or_a_decision_raise(leases: list[Any]) -> None:
    _decide_everything(leases)


@settings(max_examples=100, deadline=None)
@given(st.lists(ANYTHING, max_size=3))
def test_leases_of_any_shape_are_read_without_raising(items: list[Any]) -> None:
    for item in items:
        if isinstance(item, dict):
            lease_state(item)
            lease_run(item)
    _decide_everything([i for i in items if isinstance(i, dict)])


def _joining(join: str) -> dict[str, Any]:
    """n0's live Lease of the run, carrying the join annotation ``join``."""
    return _lease("n0", join, "2026-11-30T12:00:00Z", 15, [{"kind": crd.KIND, "uid": UID}],
                  "2026-11-30T12:00:00Z")


@pytest.mark.parametrize(("join", "why"), [
    (DEEP, "200000 characters, more than the 4096 a request may have"),
    ("x" * 256 * 1024, "262144 characters, more than the 4096 a request may have"),
    ('{"since": 1e999}', "expected an RFC 3339 time, found inf"),
    ("[1]", "expected a JSON object, found list"),
])
def test_an_unreadable_join_request_is_no_request_and_says_why(join: str, why: str) -> None:
    state = lease_state(_joining(join), seen=NOW)
    assert state.join is None
    assert state.problem is not None and "join request ignored" in state.problem
    assert why in state.problem, state.problem
    assert pending_joins([state], RunStatus(), NOW, UID, 15) == ()


def test_a_year_9999_join_request_is_clamped_and_waits() -> None:
    state = lease_state(_joining('{"since": "9999-12-31T23:59:59-23:59", "storePort": 1}'),
                        seen=NOW)
    assert state.problem is None and state.join is not None
    assert state.join.since == untrusted.LATEST
    assert [w.name for w in pending_joins([state], RunStatus(), NOW, UID, 15)] == ["n0"]


def test_extreme_times_are_clamped_not_overflowed() -> None:
    assert untrusted.read_time("9999-12-31T23:59:59-23:59") == untrusted.LATEST
    assert untrusted.read_time("0001-01-01T00:00:00+23:59") == untrusted.EARLIEST
    assert untrusted.read_time("2026-11-30T12:00:00Z") == NOW
    assert untrusted.read_time("9" * 300) is None and untrusted.read_time(12) is None
    far = untrusted.LATEST + dt.timedelta(seconds=2**31)  # the largest timeout we add
    assert far.year < dt.MAXYEAR


def test_a_status_written_with_year_9999_times_is_reconciled_without_overflow() -> None:
    raw = {"metadata": {"name": "run-b", "namespace": "ns", "uid": UID},
           "spec": {"minNodes": 2},
           "status": {"phase": "Forming", "waiting": [
               {"name": "n0", "since": "9999-12-31T23:59:59.999999Z"}],
               "sealedAt": "9999-12-31T23:59:59-23:59",
               "lostMembers": [{"name": "x", "round": 0, "reason": "r" * 64,
                                "detectionSeconds": 10**400}]}}
    run = parse_run(raw)
    assert run.status.waiting[0].since == untrusted.LATEST
    plan = reconcile(run, Members(), NOW)
    assert plan.wake_at is None or plan.wake_at <= untrusted.LATEST + dt.timedelta(days=1)
    with pytest.raises(InvalidRunError, match=r"status\.sealedAt"):
        parse_run({**raw, "status": {"sealedAt": "not a time"}})


def test_metric_reasons_come_from_a_fixed_set() -> None:
    assert reason_label("LeaseExpired") == "LeaseExpired"
    assert reason_label("x" * 64) == OTHER
    # Every reason elasticrun records keeps its own series: those of a Pod's end too.
    assert all(reason_label(reason) == reason for reason in rounds.LOSS_REASONS)
    failed = pod_loss({"metadata": {"name": "p"}, "status": {"phase": "Failed"}}, "MODIFIED")
    assert failed is not None and reason_label(failed.reason) == rounds.POD_FAILED
    metrics = Metrics()
    for i in range(50):
        metrics.lost_member("ns", "run-b", f"crafted-{i}", 1.0)
    samples = {s.labels.get("reason") for m in metrics.registry.collect()
               for s in m.samples if s.name == "elasticrun_members_lost_total"}
    assert samples == {OTHER}


@pytest.mark.parametrize("raw", [
    "", "{}", "[]", "null", '{"node": "a"}', '{"node": "a", "round": "1"}',
    '{"node": "a", "round": true}', '{"node": "a", "round": -1}',
    '{"node": "a", "round": 1e400}', '{"node": "a", "round": 99999999999}',
    '{"node": "", "round": 1}', '{"node": {"x": 1}, "round": 1}', "x" * 600, 7,
    '{"node": "a", "round": 1, "more": {"deep": [1]}}'])
def test_an_unreadable_unreachable_report_is_no_report(raw: Any) -> None:
    assert read_unreachable(raw) is None


def test_a_readable_unreachable_report_is_read() -> None:
    assert read_unreachable('{"node": "n0", "round": 3}') == Unreachable("n0", 3)


GOOD_PLACE = {"rank": 1, "since": "2026-01-01T00:00:00.000000Z"}


def _slice(run: Any = "run-b", round_number: Any = 1, world: Any = 2,
           store: Any = None, leader: Any = "n0", place: Any = None) -> dict[str, Any]:
    """A slice of run-b's round 1 placing n1, each field replaceable."""
    return {"metadata": {"name": f"{UID}-00"},
            "spec": {"run": run, "round": round_number, "worldSize": world,
                     "store": {"host": "10.0.0.1", "port": 100} if store is None else store,
                     "leader": leader, "places": {"n1": GOOD_PLACE if place is None else place}}}


@pytest.mark.parametrize("obj", [
    {}, [], "x" * 2000, 7, {"spec": None}, {"spec": {"places": []}},
    _slice(place={"rank": 2, "since": GOOD_PLACE["since"]}),  # rank outside the world
    _slice(place={"rank": True, "since": GOOD_PLACE["since"]}),
    _slice(place={"rank": 1}),  # no request it answers
    _slice(place={"rank": 1, "since": "soon"}),
    _slice(place="rank 1"),
    _slice(round_number=0), _slice(round_number=99999999999), _slice(round_number=True),
    _slice(store={"host": "10.0.0.1", "port": 70000}), _slice(store={"host": "", "port": 1}),
    _slice(store=[]), _slice(leader={"x": 1}), _slice(leader=""),
    _slice(world={"deep": {"er": [1]}}), _slice(world=0),
])
def test_an_unreadable_slice_place_is_no_place(obj: Any) -> None:
    assert read_place(obj, "run-b", "n1") is None


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(ANYTHING, st.builds(
    _slice, run=st.one_of(st.just("run-b"), JSON), round_number=st.one_of(st.just(1), JSON),
    world=st.one_of(st.just(2), JSON), store=st.one_of(st.none(), JSON),
    leader=st.one_of(st.just("n0"), JSON), place=st.one_of(st.none(), ANNOTATION, JSON))))
def test_a_slice_of_any_shape_gives_a_place_of_its_round_or_none(obj: Any) -> None:
    place = read_place(obj, "run-b", "n1")
    if place is not None:
        assert obj["spec"]["run"] == "run-b"
        assert place.round == obj["spec"]["round"] and place.rank < place.world_size


def test_a_slice_tells_a_node_only_its_own_place_of_its_own_run() -> None:
    place = read_place(_slice(), "run-b", "n1")
    assert place is not None and (place.round, place.rank, place.world_size) == (1, 1, 2)
    assert place.store == StoreAddress("10.0.0.1", 100) and place.leader == "n0"
    assert read_place(_slice(), "run-a", "n1") is None  # another run's slice
    assert read_place(_slice(), "run-b", "n0") is None  # no place of this node


def test_a_rounds_places_read_back_as_the_status_derives_them() -> None:
    status = _running()
    written = {node: read_place(piece.manifest("run-b", "ns", UID), "run-b", node)
               for piece in due(status.assignments(), frozenset()) for node in piece.places}
    assert written == status.assignments() and written
