"""The pure round rules (elasticrun.api.rounds): what any sealer, node or operator, decides."""

from __future__ import annotations

import dataclasses
import datetime as dt
from dataclasses import replace

from elasticrun.api import rounds
from elasticrun.api.leases import LeaseState, pending_joins
from elasticrun.api.model import (
    LostMember,
    RunSpec,
    RunStatus,
    StoreAddress,
    WaitingNode,
)

from builders import T0, at, run, sealed, waiting

# --------------------------------------------------------------------------- decide_seal


def test_below_min_nodes_never_seals() -> None:
    decision = rounds.decide_seal(run(RunStatus(waiting=waiting("a"))), at(999))
    assert not decision.seal_now and decision.deadline is None
    assert "1 of at least 2" in decision.reason


def test_max_nodes_seals_at_once_without_waiting_for_last_call() -> None:
    decision = rounds.decide_seal(run(RunStatus(waiting=waiting("a", "b", "c", "d"))), at(4))
    assert decision.seal_now and "maxNodes" in decision.reason


def test_spares_beside_a_full_healthy_round_never_seal_one_of_their_own() -> None:
    """A run 1:2 with a third pod (desired above maxNodes): the spare waits past every
    last call; sealing would make a round of the spare alone and supersede both
    healthy members, whose rejoin would supersede the spare, round after round."""
    full = sealed("a", "b").replace(store=StoreAddress("10.0.0.0", 29400),
                                    waiting=waiting("c", since=0))
    for spares in (full, full.replace(waiting=waiting("c", "d", since=0))):
        decision = rounds.decide_seal(run(spares, min_nodes=1, max_nodes=2, last_call=5),
                                      at(999))
        assert not decision.seal_now and decision.deadline is None
        assert "full and healthy" in decision.reason
        assert rounds.nodes_waiting(run(spares, min_nodes=1, max_nodes=2), 1, now=at(999)) == 0
    # A member back (its workers failed: the round is re-forming, with no operator to
    # see the other one die): the last call bounds the wait for the rest, as before.
    rejoining = full.replace(waiting=(*waiting("a", since=1), *full.waiting))
    late = rounds.decide_seal(run(rejoining, min_nodes=1, max_nodes=2, last_call=5), at(999))
    assert late.seal_now and "last call" in late.reason
    # Once the round re-forms (a member lost), the spare is admitted beside the survivor.
    degraded = rounds.remove_member(full, "b", "PodDeleted", at(10))
    assert degraded is not None
    back = degraded.replace(waiting=(*waiting("a", since=11), *degraded.waiting))
    decision = rounds.decide_seal(run(back, min_nodes=1, max_nodes=2, last_call=5), at(12))
    assert decision.seal_now
    sealed_ = rounds.seal_round(run(back, min_nodes=1, max_nodes=2), at(12))
    assert [(p.name, p.rank) for p in sealed_.participants] == [("a", 0), ("c", 1)]


def test_after_a_loss_survivors_keep_their_places_for_a_last_call_from_the_loss() -> None:
    """A member lost beside a spare that waited since long ago: the survivor, whose
    workers restart on the news, gets the last call from the loss to ask again; a
    spare sealing alone at once would supersede it one round later."""
    full = sealed("a", "b").replace(waiting=waiting("c", since=0))
    degraded = rounds.remove_member(full, "b", "PodDeleted", at(100))
    assert degraded is not None
    early = rounds.decide_seal(run(degraded, min_nodes=1, max_nodes=2, last_call=5), at(101))
    assert not early.seal_now and early.deadline == at(105)
    back = degraded.replace(waiting=(*waiting("a", since=102), *degraded.waiting))
    both = rounds.decide_seal(run(back, min_nodes=1, max_nodes=2, last_call=5), at(102))
    assert both.seal_now and "remaining members" in both.reason
    # The survivor never came back: the spare seals once the grace has passed.
    alone = rounds.decide_seal(run(degraded, min_nodes=1, max_nodes=2, last_call=5), at(105))
    assert alone.seal_now and alone.last_call == at(105)
    # A loss time from a clock in the future grants nothing: today's rule.
    ahead = degraded.replace(lost_members=tuple(
        dataclasses.replace(m, time=at(10_000)) for m in degraded.lost_members))
    assert rounds.decide_seal(run(ahead, min_nodes=1, max_nodes=2, last_call=5),
                              at(101)).seal_now


def test_a_member_back_before_any_loss_is_seen_gives_the_others_a_last_call() -> None:
    """No operator saw the loss yet: one member is back (its collective failed), the other
    is on its way (or dead); the spare waits a last call from the first return."""
    full = sealed("a", "b").replace(waiting=waiting("c", since=0))
    back = full.replace(waiting=(*waiting("a", since=200), *full.waiting))
    early = rounds.decide_seal(run(back, min_nodes=1, max_nodes=2, last_call=5), at(201))
    assert not early.seal_now and early.deadline == at(205)
    both = back.replace(waiting=(*back.waiting, *waiting("b", since=202)))
    assert rounds.decide_seal(run(both, min_nodes=1, max_nodes=2, last_call=5),
                              at(202)).seal_now
    late = rounds.decide_seal(run(back, min_nodes=1, max_nodes=2, last_call=5), at(205))
    assert late.seal_now
    assert [p.name for p in rounds.seal_round(run(back, min_nodes=1, max_nodes=2),
                                              at(205)).participants] == ["a", "c"]


def test_a_finished_member_ends_the_run_a_left_one_re_forms_it() -> None:
    full = sealed("a", "b").replace(waiting=waiting("c", since=0),
                                    store=StoreAddress("10.0.0.0", 29400))
    done = rounds.leave(full, "a", at(50), finished=True)
    assert done is not None and done.phase == "Succeeded" and done.finished_at == at(50)
    assert done.signal > full.signal and done.restart_round == 0
    assert [(m.name, m.reason) for m in done.lost_members] == [("a", rounds.FINISHED)]
    assert done.member_names == {"a", "b"}  # the finished round keeps its roster
    # Whichever rank proves it (here rank 0), the status stays one the model accepts.
    for leaver in ("a", "b"):
        proved = rounds.leave(full, leaver, at(50), finished=True)
        assert proved is not None
        assert RunStatus.from_dict(proved.to_dict()).member_names == {"a", "b"}
    # The rest leave a finished run as it is; the spare is told by the signal.
    assert rounds.leave(done, "b", at(51), finished=True) is None
    assert rounds.leave(done, "b", at(51), finished=False) is None
    assert rounds.decide_seal(run(done, min_nodes=1, max_nodes=2), at(99)).seal_now is False
    # Without the exit barrier's proof it is a departure: the round re-forms.
    left = rounds.leave(full, "a", at(50), finished=False)
    assert left is not None and left.phase == "Degraded" and left.restart_round == 1
    assert [(m.name, m.reason) for m in left.lost_members] == [("a", rounds.LEFT)]
    # A spare (not a member) has nothing to prove: its leaving is a withdrawal.
    spare = rounds.leave(full, "c", at(50), finished=True)
    assert spare is not None and spare.phase == "Running" and not spare.waiting
    # The proof counts, and so is asked for, exactly where the outcomes above differ.
    assert [rounds.leave_needs_proof(full, n) for n in ("a", "b", "c")] == [True, True, False]
    assert [rounds.leave_needs_proof(done, n) for n in ("a", "b", "c")] == [False] * 3


def test_last_call_counts_from_the_min_nodes_th_arrival() -> None:
    status = RunStatus(waiting=waiting("a", "b", "c"))  # arrivals at 0, 1, 2 s
    early = rounds.decide_seal(run(status, last_call=30), at(30))
    assert not early.seal_now and early.deadline == at(31)  # 2nd arrival + 30 s
    late = rounds.decide_seal(run(status, last_call=30), at(31))
    assert late.seal_now and late.last_call == at(31)  # the sealer lists after it
    fast = rounds.decide_seal(run(RunStatus(waiting=waiting("a", "b", "c", "d"))), at(0))
    assert fast.seal_now and fast.last_call is None


def test_all_survivors_back_seal_at_once_but_spares_do_not_replace_them() -> None:
    status = sealed("a", "b", "c").replace(restart_round=1, waiting=waiting("c", "a"))
    # b (a member) is not back yet: two of three plus nothing else, wait for last call.
    assert not rounds.decide_seal(run(status), at(5)).seal_now
    back = status.replace(waiting=waiting("c", "a", "b"))
    assert rounds.decide_seal(run(back), at(5)).seal_now
    # A spare arriving first does not seal in the place of a member still on its way.
    spare = status.replace(waiting=waiting("c", "a", "x", "y"))
    assert not rounds.decide_seal(run(spare, max_nodes=4), at(5)).seal_now


def test_closed_and_drained_nodes_are_not_sealed() -> None:
    status = RunStatus(waiting=waiting("a", "b", "c", "d"))
    assert not rounds.decide_seal(run(status, closed=True), at(99)).seal_now
    drained = run(status, annotations={"elasticrun.dev/drain": "c, d"})
    assert [w.name for w in rounds.eligible_waiting(drained)] == ["a", "b"]
    assert not rounds.decide_seal(drained, at(1)).seal_now  # 2 eligible < max 4: last call


# --------------------------------------------------------------------------- ranks


def test_order_for_ranks_keeps_survivors_at_their_ranks_newcomers_fill_by_arrival() -> None:
    previous = sealed("b", "a", "c").participants  # b was rank 0, c rank 2; a is gone
    order = rounds.order_for_ranks(previous, (*waiting("z", "y", since=10), *waiting("c", "b")))
    assert [w.name for w in order] == ["b", "z", "c", "y"]


def test_order_for_ranks_breaks_arrival_ties_by_name() -> None:
    same = tuple(WaitingNode(name=n, since=T0) for n in ("node-10", "node-2", "node-1"))
    assert [w.name for w in rounds.order_for_ranks((), same)] == ["node-1", "node-10", "node-2"]


def test_seal_round_moves_waiting_into_a_new_round_with_rank_0_hosting_the_store() -> None:
    status = sealed("a", "b").replace(restart_round=1, waiting=waiting("n", "b", "a"))
    new = rounds.seal_round(run(status, max_nodes=2), at(7))
    assert new.round == 2 and new.signal == status.signal + 1 and new.phase == "Running"
    assert [(p.name, p.rank) for p in new.participants] == [("a", 0), ("b", 1)]
    assert [w.name for w in new.waiting] == ["n"]  # beyond maxNodes: still a spare
    leader = next(w for w in status.waiting if w.name == "a")  # its join request
    assert new.store is not None and (new.store.host, new.store.port) == (
        leader.address, leader.store_port)
    # The roster is compact: the round's one address is status.store.
    assert all(p.address is None and p.store_port is None for p in new.participants)
    assert {p.joined_round for p in new.participants} == {0}  # kept from round 1
    assert new.sealed_at == at(7)
    RunStatus.from_dict(new.to_dict())  # what is written reads back


# --------------------------------------------------------------------------- losses, waiting


def test_remove_member_marks_the_round_and_signals_once() -> None:
    status = sealed("a", "b", "c")
    one = rounds.remove_member(status, "b", "LeaseExpired", at(1))
    assert one is not None and one.degraded and one.signal == status.signal + 1
    assert one.member_names == {"a", "c"}
    assert [(m.name, m.reason) for m in one.lost_members] == [("b", "LeaseExpired")]
    two = rounds.remove_member(one, "c", "PodDeleted", at(2))
    assert two is not None and two.signal == one.signal  # already told: no second signal
    assert rounds.remove_member(two, "nobody", "x", at(3)) is None


def test_nodes_waiting_reports_losses_and_newcomers_but_not_spares_of_a_full_round() -> None:
    full = sealed("a", "b")
    assert rounds.nodes_waiting(run(full, max_nodes=2), 1, now=at(1)) == 0
    spare = full.replace(waiting=waiting("s"))
    assert rounds.nodes_waiting(run(spare, max_nodes=2), 1, now=at(1)) == 0  # no room
    assert rounds.nodes_waiting(run(spare, max_nodes=3), 1, now=at(1)) == 1  # room: re-form
    lost = rounds.remove_member(full, "b", "PodFailed", at(1))
    assert lost is not None
    assert rounds.nodes_waiting(run(lost, max_nodes=2), 1, now=at(1)) >= 1
    newer = sealed("a", "b", round_=2)
    assert rounds.nodes_waiting(run(newer, max_nodes=2), 1, now=at(1)) >= 1  # superseded


# --------------------------------------------------------------------------- join requests


RUN_UID = "this-run"
HEARTBEAT = 30.0


def _lease(name: str, since: float, renewed: float = 0.0,
           duration: float = HEARTBEAT) -> LeaseState:
    (join,) = waiting(name, since=since)
    return LeaseState(node=name, holder=name, renewed=at(renewed), duration=duration, join=join,
                      owner_uid=RUN_UID, seen=at(renewed))


def pending(leases: list[LeaseState], status: RunStatus, when: dt.datetime
            ) -> tuple[WaitingNode, ...]:
    return pending_joins(leases, status, when, RUN_UID, HEARTBEAT)


def test_a_membership_answers_its_request_and_every_older_one() -> None:
    # Round 2 holds a's and b's second requests (a at 10 s, b at 10 s); the reader's
    # copy of a's Lease still carries its first request (0 s), b's its second, c waits.
    status = sealed("a", "b", round_=2)
    status = status.replace(participants=tuple(
        replace(p, since=at(10)) for p in status.participants))
    leases = [_lease("a", 0), _lease("b", 10), _lease("c", 11)]
    assert [w.name for w in pending(leases, status, at(12))] == ["c"]
    # A request newer than the membership is a node back for the next round.
    assert [w.name for w in pending([_lease("a", 20)], status, at(21))] == ["a"]


def test_a_lost_membership_answers_its_request_but_not_a_later_one() -> None:
    lost = LostMember(name="a", round=1, reason="LeaseExpired", time=at(5), since=at(1))
    status = sealed("b").replace(lost_members=(lost,))
    assert pending([_lease("a", 1)], status, at(6)) == ()
    assert [w.name for w in pending([_lease("a", 7)], status, at(8))] == ["a"]


def test_expired_leases_and_other_runs_do_not_wait() -> None:
    expired = _lease("a", 0, renewed=0)
    assert pending([expired], RunStatus(), at(31)) == ()
    other = replace(_lease("b", 0), owner_uid="old-run")
    assert pending([other], RunStatus(), at(1)) == ()
    assert [w.name for w in pending([_lease("b", 0)], RunStatus(), at(1))] == ["b"]


def test_a_lease_counts_only_for_its_owner_and_only_within_the_runs_heartbeat() -> None:
    # The attack of issue 12: a copy of a member's Lease claiming 2^31 s of life.
    forever = _lease("evil", 0, renewed=0, duration=float(2**31 - 1))
    assert [w.name for w in pending([forever], RunStatus(), at(HEARTBEAT))] == ["evil"]
    assert pending([forever], RunStatus(), at(HEARTBEAT + 0.1)) == ()  # the run's heartbeat
    unowned = replace(_lease("evil", 0), owner_uid=None)
    assert pending([unowned], RunStatus(), at(1)) == ()  # no ownerReference: not a member
    assert pending_joins([_lease("a", 0)], RunStatus(), at(1), None, HEARTBEAT) == ()


def test_newcomers_are_ordered_by_the_servers_lease_creation_not_their_claimed_since() -> None:
    # "early" claims to have asked in the year 2000; the API server created its Lease last.
    claimed = WaitingNode(name="early", since=dt.datetime(2000, 1, 1, tzinfo=dt.UTC),
                          arrived=at(5))
    honest = WaitingNode(name="honest", since=at(1), arrived=at(1))
    leases = [replace(_lease(w.name, 0), join=w) for w in (claimed, honest)]
    assert [w.name for w in pending(leases, RunStatus(), at(6))] == ["honest", "early"]
    new = rounds.seal_round(run(RunStatus(waiting=(claimed, honest)), max_nodes=2), at(6))
    assert [p.name for p in new.participants] == ["honest", "early"]


def test_nodes_leave_sealing_to_the_operator_from_64_nodes_on_and_wait_longer_for_more() -> None:
    small, large, huge = RunSpec(min_nodes=2, max_nodes=63), RunSpec(max_nodes=64), \
        RunSpec(max_nodes=2048)
    assert not rounds.nodes_defer_seal(small)
    assert rounds.nodes_defer_seal(large) and rounds.nodes_defer_seal(huge)
    assert rounds.DEFER_SEAL_BASE < rounds.defer_seal_wait(large) < rounds.defer_seal_wait(huge)


def test_a_deferring_node_waits_for_the_operator_to_tell_a_round_at_the_slowest_rate() -> None:
    """The node told last must hear from the operator before its own wait runs out, or it
    lists the run's Leases and seals: measured at 2,048 nodes, the seal 2 s after the last
    join and the assignments written at 120/s at the slowest."""
    for size in (256, 1024, 2048):
        wait = rounds.defer_seal_wait(RunSpec(max_nodes=size))
        assert wait >= 2.0 + size / 120.0
    assert rounds.defer_seal_wait(RunSpec(max_nodes=2048)) < 30.0  # no operator: still forms


# --------------------------------------------------------------------------- told in slices


def test_a_seal_told_on_the_leases_leaves_the_signal() -> None:
    base = run(RunStatus(signal=3, waiting=waiting("a", "b")), max_nodes=rounds.TELL_IN_SLICES_FROM)
    assert rounds.seal_round(base, at(0)).signal == 4
    quiet = rounds.seal_round(base, at(0), in_slices=True)
    assert quiet.signal == 3 and quiet.round == 1
    assert rounds.members_told_in_slices(base.spec)
    below = run(RunStatus(), max_nodes=rounds.TELL_IN_SLICES_FROM - 1).spec
    assert not rounds.members_told_in_slices(below) and rounds.members_watch_quietly(below)


def test_members_watch_quietly_from_quiet_watch_from_nodes() -> None:
    assert rounds.members_watch_quietly(run(RunStatus(), max_nodes=rounds.QUIET_WATCH_FROM).spec)
    assert not rounds.members_watch_quietly(
        run(RunStatus(), max_nodes=rounds.QUIET_WATCH_FROM - 1).spec)


def test_a_member_told_on_its_lease_hears_of_nobody_waiting_from_an_older_copy() -> None:
    # The copy predates round 2, which the node learned of in its slice; the
    # waiting summary in it is the requests round 2 answered.
    older = run(sealed("a", "b").replace(waiting=waiting("a", "b"), restart_round=1))
    assert rounds.nodes_waiting(older, 1, now=at(1)) > 0
    assert rounds.nodes_waiting(older, 2, now=at(1)) == 0


def test_a_members_assignment_is_its_place_in_the_round() -> None:
    status = sealed("a", "b", "c", round_=3).replace(store=StoreAddress("10.0.0.0", 29400))
    mine = status.assignment("c")
    assert mine is not None
    assert (mine.round, mine.rank, mine.world_size, mine.leader) == (3, 2, 3, "a")
    assert mine.store == StoreAddress("10.0.0.0", 29400)
    assert status.assignment("z") is None
    assert status.leader == "a"
    everyone = status.assignments()
    assert list(everyone) == ["a", "b", "c"] and everyone["c"] == mine


# --------------------------------------------------------------------------- changes of a run


def test_closing_moves_the_signal_and_says_why_once() -> None:
    """:func:`rounds.close`: the one rule, whoever closes (a node's set_closed, the operator)."""
    forming = RunStatus(phase="Forming", signal=4, waiting=waiting("a"))
    before = dataclasses.replace(run(forming, closed=True), generation=7)
    closed = rounds.close(before, at(60))
    assert closed is not None and closed.phase == rounds.CLOSED
    assert closed.signal == 5 and closed.finished_at == at(60)
    assert closed.observed_generation == 7
    condition = closed.condition(rounds.CLOSED_CONDITION)
    assert condition is not None and (condition.status, condition.reason) == (
        "True", rounds.CLOSED_BY_SPEC)
    assert condition.last_transition_time == at(60) and condition.observed_generation == 7
    complete = closed.condition(rounds.ROUND_COMPLETE)
    assert complete is not None and (complete.status, complete.reason) == (
        "False", rounds.ROUND_CLOSED)
    assert closed.waiting == forming.waiting  # nothing else changes
    # Idempotent: a closed run, and a finished one, stay as they are.
    assert rounds.close(before.replace_status(closed), at(61)) is None
    succeeded = sealed("a", "b").replace(phase="Succeeded", finished_at=at(50))
    assert rounds.close(run(succeeded, closed=True), at(61)) is None


def test_leaving_twice_changes_nothing_the_second_time() -> None:
    full = sealed("a", "b")
    left = rounds.leave(full, "a", at(5), finished=False)
    assert left is not None and left.phase == "Degraded" and "a" not in left.member_names
    assert [(m.name, m.reason) for m in left.lost_members] == [("a", rounds.LEFT)]
    assert rounds.leave(left, "a", at(6), finished=False) is None
    assert rounds.leave(left, "stranger", at(6), finished=True) is None


def test_a_removal_for_one_round_is_nothing_in_another_and_nothing_twice() -> None:
    full = sealed("a", "b", round_=3)
    removed = rounds.remove_member(full, "a", rounds.LEADER_LOST, at(5), in_round=3)
    assert removed is not None and removed.member_names == {"b"}
    assert removed.lost_members[-1].reason == rounds.LEADER_LOST
    assert rounds.remove_member(full, "a", rounds.LEADER_LOST, at(5), in_round=2) is None
    assert rounds.remove_member(removed, "a", rounds.LEADER_LOST, at(6), in_round=3) is None


# --------------------------------------------------------------------------- stableRound


def _healthy() -> RunStatus:
    return sealed("a", "b", "c", round_=3).replace(store=StoreAddress("10.0.0.0", 29400),
                                                   join_notice=2, restart_round=2)


def test_a_healthy_round_is_its_own_stable_round_and_every_write_carries_it() -> None:
    status = _healthy()
    assert status.stable_round == 3
    assert status.to_dict()["stableRound"] == 3
    assert RunStatus().stable_round == 0  # no round yet: nothing to be stable


def test_every_disturbance_of_a_round_moves_its_stable_round_off_it() -> None:
    status, base = _healthy(), run(_healthy(), max_nodes=256)
    lost = rounds.remove_member(status, "b", rounds.LEASE_EXPIRED, at(1))
    left = rounds.leave(status, "c", at(1), finished=False)
    restarted = rounds.request_restart(status)
    superseded = rounds.seal_round(base.replace_status(status.replace(
        waiting=waiting("a", "b", "c", "d"))), at(1), in_slices=True)
    assert lost is not None and left is not None and restarted is not None
    disturbed = {"lost": lost, "left": left, "restart": restarted,
                 "announced": status.replace(join_notice=3), "superseded": superseded}
    assert {why: s.stable_round for why, s in disturbed.items()} == {
        "lost": 0, "left": 0, "restart": 0, "announced": 0, "superseded": 4}
    assert all(s.to_dict()["stableRound"] != 3 for s in disturbed.values())
    # The seal told in slices left the signal alone: stableRound is what moved.
    assert superseded.signal == status.signal


def test_writes_that_leave_a_round_undisturbed_keep_its_stable_round() -> None:
    status = _healthy()
    summary = status.replace(waiting=waiting("d"), waiting_count=1)  # a spare's request
    spare_gone = rounds.remove_member(summary, "d", rounds.LEASE_EXPIRED, at(1))
    assert spare_gone is not None
    assert summary.stable_round == spare_gone.stable_round == 3


def test_a_closed_or_finished_run_keeps_its_rounds_number_so_no_member_is_woken() -> None:
    closed = rounds.close(run(_healthy()), at(1))
    finished = rounds.leave(_healthy(), "a", at(1), finished=True)
    assert closed is not None and finished is not None
    assert closed.stable_round == finished.stable_round == 3


def test_a_disturbed_round_settles_only_with_the_next_seal_or_the_runs_end() -> None:
    """What a woken member's watch for the run to settle selects (``stableRound!=0``): not
    the disturbance, nor a write while the round re-forms; the next seal, told by
    broadcast or on the Leases, and the end of the run, closed or finished."""
    lost = rounds.remove_member(_healthy(), "b", rounds.LEASE_EXPIRED, at(1))
    assert lost is not None
    re_forming = lost.replace(waiting=waiting("a", "c"), waiting_count=2)
    base = run(re_forming)
    next_round = rounds.seal_round(base, at(2))
    told = rounds.seal_round(base, at(2), in_slices=True)
    closed = rounds.close(base, at(2))
    finished = rounds.leave(lost, "a", at(2), finished=True)
    assert closed is not None and finished is not None
    assert (lost.stable_round, re_forming.stable_round) == (0, 0)
    assert {why: s.to_dict()["stableRound"] for why, s in {
        "next round": next_round, "told": told, "closed": closed, "finished": finished,
    }.items()} == {"next round": 4, "told": 4, "closed": 3, "finished": 3}


def test_a_stable_round_written_by_anyone_else_is_never_read() -> None:
    raw = _healthy().to_dict()
    for forged in (7, "garbage", None, -1):
        parsed = RunStatus.from_dict({**raw, "stableRound": forged})
        assert parsed == RunStatus.from_dict(raw) and parsed.to_dict()["stableRound"] == 3
    lost = {**rounds.remove_member(_healthy(), "b", rounds.LEASE_EXPIRED, at(1)).to_dict(),
            "stableRound": 3}  # a forged "undisturbed"
    assert RunStatus.from_dict(lost).stable_round == 0


def test_a_member_told_by_its_quiet_watch_reports_a_waiting_node_from_an_older_copy() -> None:
    # The copy predates round 2 (told in a slice); the quiet watch said round 2 is
    # disturbed, which this copy cannot show.
    older = run(sealed("a", "b"), max_nodes=256)
    assert rounds.nodes_waiting(older, 2, now=at(1)) == 0
    assert rounds.nodes_waiting(older, 2, now=at(1), disturbed=True) == 1
    closed = run(sealed("a", "b"), max_nodes=256, closed=True)
    assert rounds.nodes_waiting(closed, 2, now=at(1), disturbed=True) == 0
