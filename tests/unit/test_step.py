"""``next_rendezvous`` decisions (elasticrun.handler.step), without a server.

Each case is one the integration tests reach through the API server: first
join, completion, a vanished request, the sealing rules, the join notice, the
last-call stagger and the join timeout.
"""

from __future__ import annotations

import dataclasses
import datetime as dt

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elasticrun.api import rounds
from elasticrun.api.model import Assignment, RunStatus, StoreAddress, WaitingNode
from elasticrun.handler import step
from elasticrun.handler.step import Knowledge, next_action

from builders import CLOCK, JOIN_TIMEOUT, OWN_SINCE, at, defers, knows, run, sealed, waiting


def completes(action: step.Action, rank: int) -> bool:
    return isinstance(action, step.Complete) and action.assignment.rank == rank


def test_the_first_step_joins_unless_the_run_is_closed() -> None:
    assert next_action(knows(RunStatus(), joined=False), at(0), CLOCK) == step.Join()
    closed = Knowledge(node="a", run=run(RunStatus(), closed=True), previous_round=0,
                       join_deadline=CLOCK + 1)
    assert next_action(closed, at(0), CLOCK) == step.Closed()


def test_a_closed_run_ends_the_call_even_while_waiting() -> None:
    finished = RunStatus(phase="Succeeded", round=1)
    assert next_action(knows(finished, pending=waiting("a")), at(0), CLOCK) == step.Closed()


def test_a_newer_round_that_holds_the_node_completes_it_with_its_rank() -> None:
    known = knows(sealed("b", "a"), pending=(), previous_round=0)
    assert completes(next_action(known, at(0), CLOCK), 1)


def test_a_round_holding_an_earlier_request_of_the_node_does_not_complete_the_call() -> None:
    """A status restored by hand, or a round sealed with the request a failed call
    left: the node waits with this call's request, which no round has answered."""
    status = sealed("b", "a")
    own = WaitingNode(name="a", address="10.0.0.1", store_port=29401, since=OWN_SINCE)
    earlier = dataclasses.replace(status.participants[1], since=OWN_SINCE - dt.timedelta(1))
    held = knows(status.replace(participants=(status.participants[0], earlier))).replace(
        own=own, pending=(own,))
    assert not isinstance(next_action(held, at(0), CLOCK), step.Complete)
    answered = held.replace(run=run(status.replace(participants=(
        status.participants[0], dataclasses.replace(earlier, since=OWN_SINCE)))))
    assert completes(next_action(answered, at(0), CLOCK), 1)
    # A round that does not say which request it answers still counts.
    assert completes(next_action(held.replace(run=run(status)), at(0), CLOCK), 1)


def test_the_round_the_node_was_in_does_not_complete_the_call() -> None:
    known = knows(sealed("a", "b"), pending=waiting("a"), previous_round=1)
    assert not isinstance(next_action(known, at(0), CLOCK), step.Complete)


def test_a_node_lists_the_requests_once_per_change_of_the_run() -> None:
    assert next_action(knows(RunStatus(), listed=False), at(0), CLOCK) == step.List()


def test_a_deferring_node_neither_lists_nor_seals_until_its_wait_ends() -> None:
    known = defers(RunStatus(), wait=10.0)
    assert next_action(known, at(0), CLOCK) == step.Wait(until=CLOCK + 10.0)
    # Even with every request listed, sealing stays the operator's.
    full = known.replace(pending=waiting("a", "b", "c", "d"), listed=True)
    assert next_action(full, at(0), CLOCK) == step.Wait(until=CLOCK + 10.0)


def test_a_deferring_node_lists_and_seals_itself_once_the_operator_is_late() -> None:
    known = defers(RunStatus(), wait=10.0)
    assert next_action(known, at(10), CLOCK + 10.0) == step.List()
    listed = known.replace(pending=waiting("a", "b", "c", "d"), listed=True)
    assert isinstance(next_action(listed, at(10), CLOCK + 10.0), step.Seal)


def test_a_late_deferring_node_gives_the_operator_its_wait_again_once_all_joined() -> None:
    """Its own wait ran out while others still joined: the operator seals only now, and
    tells every member one write each, so the node seals only a full wait after it
    found the round complete (or at its join deadline, whichever comes first)."""
    known = defers(RunStatus(), wait=10.0)
    wait = rounds.defer_seal_wait(known.run.spec)
    # maxNodes (4) joined, this node ("a") last: its seal's turn is the first.
    listed = known.replace(pending=waiting("b", "c", "d", "a"), listed=True,
                           listed_at=at(40))
    held = next_action(listed, at(41), CLOCK + 41.0)
    assert held == step.Wait(until=CLOCK + 40.0 + wait)
    assert isinstance(next_action(listed, at(40 + wait), CLOCK + 40.0 + wait), step.Seal)
    # A node that asked first takes its seal's turn after that wait, not within it.
    first = listed.replace(pending=waiting("a", "b", "c", "d"))
    turn = next_action(first, at(41), CLOCK + 41.0)
    assert isinstance(turn, step.Wait)
    assert turn.until == pytest.approx(CLOCK + 40.0 + wait + 3 * step.SEAL_TURN_STEP)
    late = listed.replace(join_deadline=CLOCK + 42.0)
    assert next_action(late, at(41), CLOCK + 41.0) == step.Wait(until=CLOCK + 42.0)
    assert isinstance(next_action(late, at(42), CLOCK + 42.0), step.Seal)


def test_a_deferring_node_completes_the_operators_round() -> None:
    assert completes(next_action(defers(sealed("b", "a")), at(0), CLOCK), 1)


def test_a_deferring_newcomer_beside_a_round_with_room_still_announces_itself() -> None:
    running = sealed("a", "b")
    assert next_action(defers(running, node="c", max_nodes=3), at(0), CLOCK) == step.Announce()
    told = running.replace(join_notice=1, signal=2)
    assert next_action(defers(told, node="c", max_nodes=3), at(0), CLOCK) == \
        step.Wait(until=CLOCK + 10.0)


def test_a_deferring_node_times_out_at_its_join_deadline() -> None:
    known = defers(RunStatus(), wait=2 * JOIN_TIMEOUT)
    assert next_action(known, at(0), CLOCK) == step.Wait(until=CLOCK + JOIN_TIMEOUT)
    assert next_action(known, at(60), CLOCK + JOIN_TIMEOUT) == step.TimedOut()


def test_a_request_that_vanished_is_made_again() -> None:
    known = knows(RunStatus(), pending=waiting("b"))  # our Lease expired or was removed
    assert next_action(known, at(0), CLOCK) == step.Join()


def test_max_nodes_seals_at_once() -> None:
    known = knows(RunStatus(), pending=waiting("a", "b", "c", "d"))
    action = next_action(known, at(4), CLOCK)
    assert isinstance(action, step.Seal) and "maxNodes (4)" in action.reason


def test_survivors_all_back_seal_at_once_despite_the_last_call() -> None:
    known = knows(sealed("a", "b"), pending=waiting("b", "a"), previous_round=1,
                  max_nodes=3)
    action = next_action(known, at(1), CLOCK)
    assert isinstance(action, step.Seal) and "remaining members" in action.reason


def test_below_min_nodes_the_node_waits_for_the_join_deadline() -> None:
    known = knows(RunStatus(), pending=waiting("a"))
    assert next_action(known, at(0), CLOCK) == step.Wait(until=CLOCK + JOIN_TIMEOUT)


def test_during_the_last_call_nodes_wake_staggered_by_arrival() -> None:
    pending = waiting("a", "b")  # a at 0 s, b at 1 s: the window runs from b's arrival
    first = next_action(knows(RunStatus(), "a", pending), at(1), CLOCK)
    second = next_action(knows(RunStatus(), "b", pending), at(1), CLOCK)
    assert first == step.Wait(until=CLOCK + 30)
    assert second == step.Wait(until=CLOCK + 30 + step.LAST_CALL_STAGGER)


def test_the_last_call_never_waits_past_the_join_deadline() -> None:
    known = knows(RunStatus(), pending=waiting("a", "b"), last_call=300)
    assert next_action(known, at(1), CLOCK) == step.Wait(until=CLOCK + JOIN_TIMEOUT)


def test_a_passed_last_call_seals_from_a_listing_made_after_it() -> None:
    known = knows(RunStatus(), pending=waiting("a", "b")).replace(listed_at=at(31))
    action = next_action(known, at(31), CLOCK)
    assert isinstance(action, step.Seal) and action.reason.startswith("last call (30s)")


def test_a_listing_made_during_the_last_call_is_listed_again_before_the_seal() -> None:
    # Joins write Leases, not the run: a node that slept through the window on an
    # unchanged run holds the listing it made when the window opened, which misses
    # the nodes that asked later within it (they must be in the round: torch's promise).
    during = knows(RunStatus(), pending=waiting("a", "b")).replace(listed_at=at(1))
    assert next_action(during, at(31.5), CLOCK + 30.5) == step.List()
    after = during.replace(pending=waiting("a", "b", "c"), listed_at=at(31.5))
    action = next_action(after, at(31.5), CLOCK + 30.5)
    assert isinstance(action, step.Seal) and "with 3 nodes" in action.reason


def test_fast_seals_need_no_second_listing() -> None:
    # maxNodes and every survivor back are decided by who is there, not by a window.
    full = knows(RunStatus(), pending=waiting("a", "b", "c", "d")).replace(listed_at=at(0))
    assert isinstance(next_action(full, at(40), CLOCK + 40), step.Seal)


def test_a_newcomer_beside_a_round_with_room_announces_itself_once() -> None:
    running = sealed("a", "b")
    known = knows(running, node="c", pending=waiting("c"), max_nodes=3)
    assert next_action(known, at(0), CLOCK) == step.Announce()
    told = running.replace(join_notice=1, signal=2)
    assert next_action(knows(told, node="c", pending=waiting("c"), max_nodes=3), at(0),
                       CLOCK) == step.Wait(until=CLOCK + JOIN_TIMEOUT)


def test_a_spare_beside_a_full_round_does_not_disturb_it() -> None:
    known = knows(sealed("a", "b"), node="s", pending=waiting("s"), max_nodes=2)
    assert next_action(known, at(0), CLOCK) == step.Wait(until=CLOCK + JOIN_TIMEOUT)


def test_a_round_already_reforming_needs_no_notice() -> None:
    degraded = sealed("a", "b").replace(phase="Degraded", restart_round=1)
    known = knows(degraded, node="c", pending=waiting("c"), max_nodes=3)
    assert next_action(known, at(0), CLOCK) == step.Wait(until=CLOCK + JOIN_TIMEOUT)


def test_past_the_join_deadline_the_call_times_out() -> None:
    known = knows(RunStatus(), pending=waiting("a"))
    assert next_action(known, at(60), CLOCK + JOIN_TIMEOUT) == step.TimedOut()


def test_sealing_wins_over_the_join_deadline() -> None:
    known = knows(RunStatus(), pending=waiting("a", "b", "c", "d"))
    assert isinstance(next_action(known, at(99), CLOCK + 99), step.Seal)


def test_a_member_removed_because_its_pod_is_going_asks_for_no_round() -> None:
    deleted = rounds.remove_member(sealed("a", "b"), "a", rounds.POD_DELETED, at(0),
                                   "pod a deleted")
    assert deleted is not None
    again = knows(deleted, node="a", joined=False, previous_round=1)
    assert next_action(again, at(1), CLOCK) == step.PodGone("PodDeleted: pod a deleted")
    # A restarted container runs again in the same Pod: it asks again.
    restarted = rounds.remove_member(sealed("a", "b"), "a", rounds.CONTAINER_RESTARTED, at(0))
    assert restarted is not None
    assert next_action(knows(restarted, node="a", joined=False, previous_round=1), at(1),
                       CLOCK) == step.Join()
    # A new agent under the same name (a StatefulSet's new Pod) held no earlier round,
    # and neither did the survivor.
    assert next_action(knows(deleted, node="a", joined=False), at(1), CLOCK) == step.Join()
    assert next_action(knows(deleted, node="b", joined=False, previous_round=1), at(1),
                       CLOCK) == step.Join()
    # A removal from an earlier round says nothing about this one.
    assert next_action(knows(deleted, node="a", joined=False, previous_round=2), at(1),
                       CLOCK) == step.Join()


def test_a_seal_due_at_once_is_tried_first_by_the_node_that_asked_last() -> None:
    # Four nodes started together all list the complete set: d asked last, so its
    # listing surely holds everyone; the others leave it a turn each, and would
    # find its round on their watch instead of losing a compare-and-set.
    pending = waiting("a", "b", "c", "d")
    turns = {me: next_action(knows(RunStatus(), node=me, pending=pending).replace(
        listed_at=at(0)), at(0), CLOCK) for me in "abcd"}
    assert isinstance(turns["d"], step.Seal) and "maxNodes (4) reached" in turns["d"].reason
    assert turns["c"] == step.Wait(until=CLOCK + step.SEAL_TURN_STEP)
    assert turns["b"] == step.Wait(until=CLOCK + 2 * step.SEAL_TURN_STEP)
    assert turns["a"] == step.Wait(until=CLOCK + 3 * step.SEAL_TURN_STEP)


def test_seal_turns_follow_the_order_the_api_server_wrote_the_requests_in() -> None:
    # d's clock says it asked last, but the server wrote c's Lease last: c's listing is
    # the one surely complete, so c seals at once and d takes the next turn.
    written = {"a": 11, "b": 12, "c": 15, "d": 14}
    pending = tuple(dataclasses.replace(w, written=written[w.name])
                    for w in waiting("a", "b", "c", "d"))
    turns = {me: next_action(knows(RunStatus(), node=me, pending=pending).replace(
        listed_at=at(0)), at(0), CLOCK) for me in "abcd"}
    assert isinstance(turns["c"], step.Seal)
    assert turns["d"] == step.Wait(until=CLOCK + step.SEAL_TURN_STEP)
    assert turns["b"] == step.Wait(until=CLOCK + 2 * step.SEAL_TURN_STEP)
    # Read without revisions (the status summary), the claimed times order them.
    assert rounds.seal_turn(knows(RunStatus(), pending=waiting("a", "b", "c", "d")).run,
                            "d", waiting("a", "b", "c", "d")) == 0


def test_a_node_whose_turn_passed_on_an_unchanged_run_seals_from_its_listing() -> None:
    known = knows(RunStatus(), node="b", pending=waiting("a", "b", "c", "d")).replace(
        listed_at=at(0))
    later = 2 * step.SEAL_TURN_STEP
    assert isinstance(next_action(known, at(later), CLOCK + later), step.Seal)


def test_seal_turns_are_capped_so_a_dead_last_joiner_delays_the_round_only_briefly() -> None:
    pending = waiting(*"abcdefgh")
    run_ = knows(RunStatus(), pending=pending, max_nodes=8).run
    turns = [rounds.seal_turn(run_, name, pending) for name in "abcdefgh"]
    assert turns == [3, 3, 3, 3, 3, 2, 1, 0]
    assert rounds.seal_turn(run_, "stranger", pending) == rounds.SEAL_TURNS


def test_survivors_back_after_a_loss_take_turns_too() -> None:
    back = waiting("a", "b")  # b asked again last
    first = next_action(knows(sealed("a", "b"), node="b", pending=back, previous_round=1
                              ).replace(listed_at=at(0)), at(0), CLOCK)
    second = next_action(knows(sealed("a", "b"), node="a", pending=back, previous_round=1
                               ).replace(listed_at=at(0)), at(0), CLOCK)
    assert isinstance(first, step.Seal) and "remaining members" in first.reason
    assert second == step.Wait(until=CLOCK + step.SEAL_TURN_STEP)


def test_a_passed_last_call_is_not_held_by_seal_turns() -> None:
    known = knows(RunStatus(), node="a", pending=waiting("a", "b")).replace(listed_at=at(31))
    assert isinstance(next_action(known, at(31), CLOCK + 31), step.Seal)


NAMES = st.lists(st.sampled_from("abcdef"), unique=True, max_size=6)


@given(names=NAMES, me=st.sampled_from("abcdef"), elapsed=st.floats(0, 120),
       min_nodes=st.integers(1, 4), extra=st.integers(0, 3), last_call=st.integers(0, 40))
def test_every_state_gets_one_consistent_action(names: list[str], me: str, elapsed: float,
                                                min_nodes: int, extra: int,
                                                last_call: int) -> None:
    known = knows(RunStatus(), node=me, pending=waiting(*names), min_nodes=min_nodes,
                  max_nodes=min_nodes + extra, last_call=last_call
                  ).replace(listed_at=at(elapsed))
    clock = CLOCK + elapsed
    action = next_action(known, at(elapsed), clock)
    if me not in names:
        assert action == step.Join()
    elif len(names) < min_nodes:
        # Never a round below minNodes: wait for more, or give up at the deadline.
        expected = step.TimedOut() if clock >= known.join_deadline \
            else step.Wait(until=known.join_deadline)
        assert action == expected
    elif isinstance(action, step.Wait):
        assert clock <= action.until <= known.join_deadline
        if len(names) >= min_nodes + extra:
            # At maxNodes only a turn of the seal holds a node back, never for long.
            assert rounds.seal_turn(known.run, me, known.pending) > 0
            assert action.until <= clock + step.SEAL_TURN_STEP * rounds.SEAL_TURNS
    else:
        assert isinstance(action, step.Seal | step.TimedOut)


@given(members=st.lists(st.sampled_from("abcdef"), unique=True, min_size=1, max_size=6),
       previous=st.integers(0, 3), round_=st.integers(1, 4))
def test_completion_needs_a_newer_round_that_holds_the_node(members: list[str], previous: int,
                                                           round_: int) -> None:
    known = knows(sealed(*members, round_=round_), node="a", pending=waiting("a"),
                  previous_round=previous, max_nodes=6)
    action = next_action(known, at(0), CLOCK)
    if "a" in members and round_ > previous:
        assert completes(action, members.index("a"))
    else:
        assert not isinstance(action, step.Complete)


def test_knowledge_reports_rank_only_for_a_newer_round() -> None:
    known = knows(sealed("b", "a", round_=2), previous_round=2)
    assert known.assignment is None
    newer = known.replace(previous_round=1).assignment
    assert newer is not None and newer.rank == 1


# --------------------------------------------------------------------------- superseded rounds


def test_a_round_that_still_holds_both_the_node_and_its_leader_is_not_superseded() -> None:
    assert step.superseded(run(sealed("lead", "a", "b")), 1, "a", "lead") is None


def test_a_round_is_superseded_when_its_leader_is_removed() -> None:
    current = sealed("lead", "a", "b")
    without = current.replace(participants=current.participants[1:])
    assert step.superseded(run(without), 1, "a", "lead") == \
        "its rank 0, lead, was removed from it"


def test_a_round_is_superseded_by_a_newer_round_removal_closing_or_deletion() -> None:
    status = sealed("lead", "a", "b")
    assert step.superseded(run(sealed("a", "b", round_=2)), 1, "a", "lead") == \
        "round 2 replaced it"
    assert step.superseded(run(status.replace(participants=status.participants[:1]
                                              + status.participants[2:])), 1, "a", "lead") \
        == "this node was removed from it"
    assert step.superseded(run(status, closed=True), 1, "a", "lead") == "the run was closed"
    assert step.superseded(None, 1, "a", "lead") == "the run was deleted"


def test_after_a_superseded_round_the_node_joins_again_and_never_completes_it() -> None:
    # What the executor knows once it gave up on round 1's store.
    known = knows(sealed("lead", "a", "b"), previous_round=1, joined=False)
    assert next_action(known, at(0), CLOCK) == step.Join()
    joined = known.replace(joined=True, pending=waiting("a"))
    assert not isinstance(next_action(joined, at(0), CLOCK), step.Complete)


# --------------------------------------------------------------------------- told in a slice


def _offer(round_: int = 1, rank: int = 2, since: dt.datetime = OWN_SINCE) -> Assignment:
    return Assignment(round=round_, rank=rank, world_size=64, leader="lead",
                      store=StoreAddress("10.0.0.1", 29400), since=since)


def test_a_deferring_node_completes_with_the_assignment_on_its_lease() -> None:
    known = defers(RunStatus(), max_nodes=64).replace(offered=_offer())
    action = next_action(known, at(0), CLOCK)
    assert isinstance(action, step.Complete) and action.assignment == _offer()


def test_an_assignment_of_an_earlier_request_or_round_is_stale() -> None:
    known = defers(RunStatus(), max_nodes=64)
    other_request = known.replace(offered=_offer(since=OWN_SINCE - dt.timedelta(seconds=9)))
    assert isinstance(next_action(other_request, at(0), CLOCK), step.Wait)
    # The node was in round 1 already, or its copy of the run is at round 1.
    assert isinstance(next_action(known.replace(offered=_offer(), previous_round=1),
                                  at(0), CLOCK), step.Wait)
    at_round_1 = known.replace(run=run(sealed("lead", "b"), max_nodes=64), offered=_offer())
    assert not isinstance(next_action(at_round_1, at(0), CLOCK), step.Complete)


def test_the_run_it_holds_wins_over_its_lease() -> None:
    known = defers(sealed("b", "a", round_=2), max_nodes=64).replace(
        offered=_offer(round_=2, rank=0))
    assert completes(next_action(known, at(0), CLOCK), 1)


def test_a_copy_of_the_run_older_than_the_round_supersedes_nothing() -> None:
    older = run(sealed("lead", "a"))
    assert step.superseded(older, 2, "a", "lead") is None
    assert step.superseded(run(sealed("lead", "a"), closed=True), 2, "a", "lead") == \
        "the run was closed"
    assert step.superseded(older, 1, "a", None) == "it has lost its rank 0"


def test_a_member_woken_from_a_stale_copy_neither_announces_nor_lists_until_it_reads() -> None:
    """Its quiet watch saw round 1 disturbed at version 5; it holds version 1."""
    fresh = defers(sealed("a", "b")).replace(previous_round=1)
    assert next_action(fresh, at(0), CLOCK) == step.Announce()  # what a fresh copy says
    stale = fresh.replace(woken="5")
    assert stale.stale
    assert next_action(stale, at(0), CLOCK) == step.Wait(until=CLOCK + 10.0)
    # Past its wait it lists nothing from that copy: it reads the run afresh.
    assert next_action(stale, at(9), CLOCK + 9.9) == step.Wait(until=CLOCK + 10.0)
    assert next_action(stale, at(10), CLOCK + 10.0) == step.Read()
    assert next_action(stale.replace(defer_until=None), at(0), CLOCK) == step.Read()
    assert next_action(stale, at(60), CLOCK + JOIN_TIMEOUT) == step.TimedOut()
    # A copy as new as the disturbance is not stale: the node goes on as any other.
    read = stale.replace(run=dataclasses.replace(stale.run, resource_version="5"))
    assert not read.stale
    assert next_action(read, at(10), CLOCK + 10.0) == step.List()


def test_a_member_woken_from_a_stale_copy_completes_only_from_its_lease() -> None:
    stale = defers(sealed("lead", "a"), max_nodes=64).replace(previous_round=1, woken="5")
    assert isinstance(next_action(stale, at(0), CLOCK), step.Wait)  # its copy's round 1
    assert isinstance(next_action(stale.replace(offered=_offer(round_=1)), at(0), CLOCK),
                      step.Wait)
    action = next_action(stale.replace(offered=_offer(round_=2)), at(0), CLOCK)
    assert isinstance(action, step.Complete) and action.assignment == _offer(round_=2)


def test_a_member_whose_pod_is_going_withdraws_a_request_it_made_before_it_knew() -> None:
    deleted = rounds.remove_member(sealed("a", "b"), "a", rounds.POD_DELETED, at(0),
                                   "pod a deleted")
    assert deleted is not None
    joined = knows(deleted, node="a", previous_round=1)
    assert next_action(joined, at(1), CLOCK) == step.PodGone("PodDeleted: pod a deleted")
