"""Rounds that follow the owner's desired size (``status.desired``), without a server.

The target is ``min(desired, maxNodes)`` when the desired size reaches
``minNodes`` (:func:`elasticrun.api.rounds.target_size`): the first round seals
as soon as the target has joined, a scale-up restarts the members once for
all the new nodes, a scale-down re-forms at once; with no target the rules are
today's, decision for decision (the table at the end).
"""

from __future__ import annotations

import dataclasses
import datetime as dt

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elasticrun.api import rounds, untrusted
from elasticrun.api.leases import LeaseState
from elasticrun.api.model import Desired, ElasticRun, RunStatus, WaitingNode
from elasticrun.handler import step
from elasticrun.handler.step import next_action
from elasticrun.operator.owners import NO_OWNER, Ownership
from elasticrun.operator.reconcile import SEAL_GRACE, Members, reconcile

from builders import CLOCK, at, defers, joined_leases, knows, run, sealed, waiting

LAST_CALL = 30


def wants(status: RunStatus, size: int | None) -> RunStatus:
    """``status`` as the operator leaves it when the owner asks for ``size`` nodes."""
    return status.replace(desired=None if size is None else Desired(size=size, source="Job/j"))


def spec_run(status: RunStatus, size: int | None, min_nodes: int = 2,
             max_nodes: int = 8) -> ElasticRun:
    return run(wants(status, size), min_nodes=min_nodes, max_nodes=max_nodes,
               last_call=LAST_CALL)


def newcomers(*names: str, start: float) -> tuple[WaitingNode, ...]:
    """Requests made at ``start``, ``start + 1``, ... (seconds)."""
    return tuple(WaitingNode(name=n, address=f"10.0.1.{i}", store_port=29500 + i,
                             since=at(start + i)) for i, n in enumerate(names))


# --------------------------------------------------------------------------- the target


@pytest.mark.parametrize(("size", "min_nodes", "max_nodes", "target"), [
    (4, 2, 8, 4),          # the owner's count
    (12, 2, 8, 8),         # capped at maxNodes: more would be spares
    (2, 2, 8, 2),          # exactly minNodes
    (1, 2, 8, None),       # below minNodes: cannot form, ignored
    (0, 1, 8, None),       # scaled to zero
    (None, 2, 8, None),    # no owner says
    (2**31 - 1, 2, 4, 4),  # absurd: still maxNodes
])
def test_the_target_is_the_desired_size_capped_at_max_and_ignored_below_min(
        size: int | None, min_nodes: int, max_nodes: int, target: int | None) -> None:
    assert rounds.target_size(spec_run(RunStatus(), size, min_nodes, max_nodes)) == target


# --------------------------------------------------------------------------- first formation


def test_first_formation_seals_as_soon_as_the_target_has_joined() -> None:
    four = spec_run(RunStatus(waiting=waiting("a", "b", "c", "d")), 4)
    decision = rounds.decide_seal(four, at(3))  # the 4th asked at 3 s: no last call
    assert decision.seal_now and "desired size (4)" in decision.reason
    status = rounds.seal_round(four, at(3))
    assert [p.rank for p in status.participants] == [0, 1, 2, 3]
    assert status.desired == Desired(size=4, source="Job/j")  # carried through the seal


def test_below_the_target_the_last_call_stands() -> None:
    three = spec_run(RunStatus(waiting=waiting("a", "b", "c")), 4)
    early = rounds.decide_seal(three, at(5))
    assert not early.seal_now and early.deadline == at(1 + LAST_CALL)  # 2nd arrival + 30 s
    assert rounds.decide_seal(three, at(1 + LAST_CALL)).seal_now


def test_a_target_capped_at_max_nodes_seals_at_max() -> None:
    four = spec_run(RunStatus(waiting=waiting("a", "b", "c", "d")), 10, max_nodes=4)
    decision = rounds.decide_seal(four, at(3))
    assert decision.seal_now and "maxNodes (4)" in decision.reason


def test_a_desired_size_below_min_nodes_is_ignored() -> None:
    two = spec_run(RunStatus(waiting=waiting("a", "b")), 1, min_nodes=2)
    decision = rounds.decide_seal(two, at(2))
    assert not decision.seal_now and decision.deadline == at(1 + LAST_CALL)


def test_a_round_with_none_of_its_members_left_forms_like_the_first() -> None:
    gone = rounds.remove_member(sealed("x"), "x", "PodDeleted", at(0))
    assert gone is not None
    decision = rounds.decide_seal(spec_run(gone.replace(waiting=waiting("a", "b", "c")), 3),
                                  at(2))
    assert decision.seal_now and "desired size (3)" in decision.reason


def test_the_first_step_of_the_target_th_node_is_the_seal() -> None:
    known = knows(wants(RunStatus(), 4), node="d", pending=waiting("a", "b", "c", "d"),
                  max_nodes=8)
    action = next_action(known, at(3), CLOCK)
    assert isinstance(action, step.Seal) and "desired size" in action.reason


def on_leases(r: ElasticRun, joined: dict[str, dt.datetime], members: tuple[str, ...] = ()
              ) -> tuple[ElasticRun, Members]:
    """``r`` as the operator holds it (its uid), and the Leases of ``joined`` and ``members``."""
    leases = {}
    for name, when in joined.items():
        leases.update(joined_leases([name], when))
    for name in members:
        leases[name] = LeaseState(node=name, holder=name, renewed=at(99), duration=10,
                                  owner_uid="uid", seen=at(99))
    # The owner the operator reads the size from (it does so before its seal).
    desired = r.status.desired
    ownership = Ownership(size=desired.size, source=desired.source) if desired else NO_OWNER
    return dataclasses.replace(r, uid="uid"), Members(leases=leases, ownership=ownership)


def test_the_operator_backstop_seals_at_the_target_after_its_grace() -> None:
    four, members = on_leases(spec_run(RunStatus(), 4),
                              {n: at(i) for i, n in enumerate("abcd")})
    waits = reconcile(four, members, at(3))
    assert not waits.sealed and waits.wake_at == at(3 + SEAL_GRACE)
    seals = reconcile(four, members, at(3 + SEAL_GRACE))
    assert seals.sealed and seals.status is not None and seals.status.round == 1
    assert len(seals.status.participants) == 4


# --------------------------------------------------------------------------- scale-up


def scale_up(*names: str, start: float = 100.0, size: int = 4) -> ElasticRun:
    """Members a, b running round 1; ``names`` waiting beside it from ``start`` on."""
    return spec_run(sealed("a", "b").replace(waiting=newcomers(*names, start=start)), size)


def test_scale_up_holds_the_first_newcomer_until_the_target_or_the_window() -> None:
    one = scale_up("c")
    assert rounds.announce_due(one, at(100)) == at(100 + LAST_CALL)
    assert not rounds.announce_needed(one, at(101))
    assert rounds.nodes_waiting(one, 1, now=at(101)) == 0  # members keep training
    assert not rounds.decide_seal(one, at(101)).seal_now
    # The window ends: the members hear of it, as they would have at once without a target.
    assert rounds.announce_needed(one, at(100 + LAST_CALL))
    assert rounds.nodes_waiting(one, 1, now=at(100 + LAST_CALL)) == 1


def test_scale_up_announces_when_members_and_newcomers_reach_the_target() -> None:
    two = scale_up("c", "d")  # c at 100 s, d at 101 s
    assert rounds.announce_due(two, at(101)) == at(101)
    assert rounds.announce_needed(two, at(101))
    assert rounds.nodes_waiting(two, 1, now=at(101)) == 2


def test_scale_up_seals_once_with_everyone_when_the_members_are_back() -> None:
    run_ = scale_up("c", "d")
    status = run_.status.replace(join_notice=1, signal=2,
                                 waiting=(*run_.status.waiting, *waiting("a", "b", since=103)))
    back = run_.replace_status(status)
    decision = rounds.decide_seal(back, at(104))
    assert decision.seal_now and "remaining members" in decision.reason
    sealed_ = rounds.seal_round(back, at(104))
    assert [(p.name, p.rank) for p in sealed_.participants] == [
        ("a", 0), ("b", 1), ("c", 2), ("d", 3)]


def test_newcomers_do_not_seal_without_the_members_they_just_told() -> None:
    # No 4th node comes: c and d are announced at c's window end (130 s); a round
    # without the members waits a last call from then, not from d's arrival.
    two = spec_run(sealed("a", "b").replace(waiting=newcomers("c", "d", start=100)), 5)
    assert rounds.announce_due(two, at(101)) == at(130)
    held = rounds.decide_seal(two, at(129))
    assert not held.seal_now and held.deadline == at(130)
    after = rounds.decide_seal(two, at(131))  # d's own last call (131 s) is not enough
    assert not after.seal_now and after.deadline == at(130 + LAST_CALL)
    assert rounds.decide_seal(two, at(130 + LAST_CALL)).seal_now


def test_a_held_newcomer_wakes_at_the_window_end_to_announce() -> None:
    known = knows(wants(sealed("a", "b"), 4), node="c", pending=newcomers("c", start=100),
                  max_nodes=8)
    assert next_action(known, at(110), CLOCK) == step.Wait(until=CLOCK + 20)
    assert next_action(known, at(130), CLOCK + 20) == step.Announce()


def test_a_deferring_newcomer_counts_the_others_in_the_summary() -> None:
    # Large runs: the node does not list; its own request (at 5 s) and the operator's summary.
    # (From 2,048 nodes: below that, where places are kept, the operator announces.)
    large = rounds.TELL_IN_SLICES_FROM
    summary = sealed("a", "b").replace(waiting=newcomers("c", start=4))
    alone = defers(wants(sealed("a", "b"), 4), node="d", max_nodes=large, wait=60)
    assert next_action(alone, at(6), CLOCK) == step.Wait(until=CLOCK + LAST_CALL - 1)
    beside = defers(wants(summary, 4), node="d", max_nodes=large, wait=60)
    assert next_action(beside, at(6), CLOCK) == step.Announce()


def test_spares_beyond_max_nodes_never_restart_a_full_round() -> None:
    full = spec_run(sealed("a", "b").replace(waiting=newcomers("s", start=0)), 6, max_nodes=2)
    assert rounds.announce_due(full, at(99)) is None
    assert not rounds.announce_needed(full, at(99))
    assert rounds.nodes_waiting(full, 1, now=at(99)) == 0


def test_the_operator_wakes_when_the_hold_ends() -> None:
    r = spec_run(sealed("a", "b"), 4)
    # Leases that outlive the window, so the only timer is the hold's.
    r = dataclasses.replace(r, spec=dataclasses.replace(r.spec, heartbeat_timeout=600,
                                                        join_timeout=600))
    held, members = on_leases(r, {"c": at(100)}, ("a", "b"))
    plan = reconcile(held, members, at(101))
    assert not plan.sealed and plan.wake_at == at(100 + LAST_CALL + SEAL_GRACE)
    assert plan.status is None or plan.status.round == 1


# --------------------------------------------------------------------------- scale-down


def test_scale_down_survivors_reform_at_once_under_a_lower_target() -> None:
    four = sealed("a", "b", "c", "d")
    left = rounds.remove_member(four, "d", "Left", at(0), message="the agent shut down")
    assert left is not None and left.degraded
    for size in (3, 2, 4, None):  # the owner's count, lowered, stale, or unknown
        back = spec_run(left.replace(waiting=waiting("a", "b", "c", since=1)), size)
        assert rounds.nodes_waiting(back, 1, now=at(1)) >= 1
        decision = rounds.decide_seal(back, at(3))
        assert decision.seal_now and "all 3 remaining members" in decision.reason, size
        assert [p.name for p in rounds.seal_round(back, at(3)).participants] == ["a", "b", "c"]


def test_a_lowered_target_does_not_restart_a_running_round() -> None:
    four = spec_run(sealed("a", "b", "c", "d"), 3)
    assert rounds.nodes_waiting(four, 1, now=at(1)) == 0
    assert not rounds.announce_needed(four, at(1))


# --------------------------------------------------------------------------- no target: today


def _decisions(status: RunStatus, now: dt.datetime, size: int | None
               ) -> tuple[object, ...]:
    r = spec_run(status, size, max_nodes=4)
    decision = rounds.decide_seal(r, now)
    return (decision.seal_now, decision.deadline, rounds.announce_needed(r, now),
            rounds.nodes_waiting(r, 1, now=now))


TODAY = [
    # (status, now, what today's rules decide: seal, deadline, announce, nodes_waiting)
    (RunStatus(waiting=waiting("a")), at(99), (False, None, False, 0)),
    (RunStatus(waiting=waiting("a", "b")), at(5), (False, at(31), False, 0)),
    (RunStatus(waiting=waiting("a", "b", "c")), at(31), (True, None, False, 0)),
    (RunStatus(waiting=waiting("a", "b", "c", "d")), at(3), (True, None, False, 0)),
    (sealed("a", "b").replace(waiting=newcomers("c", start=100)), at(100),
     (False, None, True, 1)),
    (sealed("a", "b").replace(waiting=newcomers("c", "d", start=100)), at(101),
     (False, at(131), True, 2)),
    (sealed("a", "b").replace(waiting=newcomers("c", "d", start=100)), at(131),
     (True, None, True, 2)),
    (sealed("a", "b").replace(restart_round=1, waiting=waiting("a", "b")), at(2),
     (True, None, False, 2)),
    (sealed("a", "b", "c", "d").replace(waiting=newcomers("s", start=0)), at(9),
     (False, None, False, 0)),
]


@pytest.mark.parametrize(("status", "now", "today"), TODAY)
@pytest.mark.parametrize("size", [None, 1])
def test_without_a_target_the_decisions_are_todays(status: RunStatus, now: dt.datetime,
                                                   today: tuple[object, ...],
                                                   size: int | None) -> None:
    assert _decisions(status, now, size) == today


# --------------------------------------------------------------------------- forged sizes


def test_a_forged_huge_desired_size_costs_at_most_todays_last_call() -> None:
    """Row 85: the target is maxNodes; nothing waits longer than one last call."""
    huge = 2**31 - 1
    first = spec_run(RunStatus(waiting=waiting("a", "b", "c", "d")), huge)
    decision = rounds.decide_seal(first, at(3))
    assert not decision.seal_now and decision.deadline == at(1 + LAST_CALL)  # as today
    beside = spec_run(sealed("a", "b").replace(waiting=newcomers("c", start=100)), huge,
                      max_nodes=4)
    assert rounds.announce_due(beside, at(100)) == at(100 + LAST_CALL)
    assert rounds.nodes_waiting(beside, 1, now=at(100 + LAST_CALL)) == 1


def test_a_forged_small_desired_size_seals_no_round_the_writer_could_not() -> None:
    """Row 86: below minNodes it is ignored; at minNodes a round of minNodes seals at once,
    as the writer could seal it itself (row 53)."""
    for forged in (0, 1):
        low = spec_run(RunStatus(waiting=waiting("a", "b")), forged)
        assert rounds.decide_seal(low, at(2)).deadline == at(1 + LAST_CALL)
    at_min = spec_run(RunStatus(waiting=waiting("a", "b")), 2)
    assert rounds.decide_seal(at_min, at(2)).seal_now


# --------------------------------------------------------------------------- any input


TIMES = st.sampled_from([untrusted.EARLIEST, at(0), at(99), at(100), at(130), at(10**6),
                         untrusted.LATEST])


@given(size=st.one_of(st.none(), st.integers(0, 2**31 - 1)), members=st.integers(0, 4),
       asked=st.lists(TIMES, max_size=5), now=TIMES, degraded=st.booleans(),
       notice=st.booleans())
def test_any_desired_size_and_times_decide_without_error_or_a_wake_in_the_past(
        size: int | None, members: int, asked: list[dt.datetime], now: dt.datetime,
        degraded: bool, notice: bool) -> None:
    """Whatever a writer put in ``status.desired`` and whatever times requests claim, the
    rules answer, and a deadline they give is ahead of ``now`` (a wake that is never a loop)."""
    status = sealed(*"abcd"[:members]) if members else RunStatus()
    if members and degraded:
        status = status.replace(restart_round=1)
    if members and notice:
        status = status.replace(join_notice=1)
    pending = tuple(WaitingNode(name=f"n{i}", since=when) for i, when in enumerate(asked))
    r = spec_run(status.replace(waiting=pending), size, max_nodes=4)
    decision = rounds.decide_seal(r, now)
    assert decision.seal_now or decision.deadline is None or decision.deadline > now
    due = rounds.announce_due(r, now)
    assert due is None or due >= min(now, *(w.since for w in pending if w.since))
    assert rounds.nodes_waiting(r, 1, now=now) >= 0
    rounds.announce_needed(r, now)
