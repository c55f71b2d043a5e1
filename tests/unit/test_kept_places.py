"""Members keep their places where the operator seals: the rule (``rounds``), a member's
side (``step``) and the operator's seal (``reconcile``).

Rank 0 announces the next round's store on its request once a round holds it (or,
before that, asks again naming it); the operator then seals a round that must
re-form at once, keeping every member it saw renew its Lease lately, and the
member, which wrote nothing, knows its place by the request its previous round
answered.
"""

from __future__ import annotations

import dataclasses
import datetime as dt

import pytest

from elasticrun.api import crd, rounds
from elasticrun.api.leases import LeaseState
from elasticrun.api.model import ElasticRun, RunSpec, RunStatus, StoreAddress, WaitingNode
from elasticrun.handler import step
from elasticrun.handler.step import Knowledge, next_action
from elasticrun.operator.reconcile import Members, reconcile

from builders import CLOCK, JOIN_TIMEOUT, T0, at, joined_leases

KEEPS = rounds.DEFER_SEAL_FROM
NAMES = ["n0", "n1", "n2"]
#: When the members of round 1 come back (rank 0's new request, the newcomer's).
BACK = at(30)


def _spec(max_nodes: int = KEEPS) -> RunSpec:
    return RunSpec(min_nodes=2, max_nodes=max_nodes)


def _round_one(max_nodes: int = KEEPS) -> ElasticRun:
    """Round 1 of n0 (rank 0), n1, n2, each answering its request of T0."""
    fresh = ElasticRun("r", "ns", _spec(max_nodes), RunStatus(), "7", uid="uid")
    joins = [lease.join for lease in joined_leases(NAMES, T0).values()]
    status = rounds.seal_round(fresh, T0, [j for j in joins if j is not None])
    return ElasticRun("r", "ns", _spec(max_nodes), status, "8", uid="uid")


@pytest.mark.parametrize(("max_nodes", "keeps"), [
    (rounds.DEFER_SEAL_FROM - 1, False), (rounds.DEFER_SEAL_FROM, True),
    (rounds.QUIET_WATCH_FROM - 1, True), (rounds.QUIET_WATCH_FROM, True),
    (rounds.TELL_IN_SLICES_FROM - 1, True), (rounds.TELL_IN_SLICES_FROM, False)])
def test_places_are_kept_where_the_operator_seals_and_does_not_write_every_lease(
        max_nodes: int, keeps: bool) -> None:
    assert rounds.members_keep_places(_spec(max_nodes)) is keeps


@pytest.mark.parametrize(("heartbeat", "renew", "keeps"), [
    (15, 5, True), (3, 1, True), (2, 1, False), (14, 5, False), (60, 5, True)])
def test_places_are_kept_only_where_the_heartbeat_spans_the_keep_window_and_one_renewal(
        heartbeat: int, renew: int, keeps: bool) -> None:
    """Nodes that stopped together have missed two renewals when the first of them is
    found lost: none of them is kept, so no agent waits in torch's barrier for them."""
    spec = RunSpec(min_nodes=2, max_nodes=KEEPS, heartbeat_timeout=heartbeat,
                   lease_renew_interval=renew)
    assert rounds.keep_window(spec) == 2 * renew
    assert rounds.members_keep_places(spec) is keeps
    if keeps:
        assert heartbeat - renew >= rounds.keep_window(spec)


# --------------------------------------------------------------------------- the rule


def test_no_place_is_kept_before_rank_0_asks_again() -> None:
    run = _round_one()
    newcomer = WaitingNode(name="n3", since=BACK)
    assert rounds.kept_places(run, NAMES, BACK, [newcomer]) == []


#: The store rank 0 (n0) announces for round 2.
NEXT = StoreAddress("10.0.0.1", 29500)


def test_once_rank_0_announced_the_next_store_a_round_that_must_form_keeps_every_place(
        ) -> None:
    run = _round_one()
    newcomer = WaitingNode(name="n3", since=BACK)
    kept = rounds.kept_places(run, NAMES, BACK, [newcomer], leader_next=NEXT)
    assert [(w.name, w.since, w.address, w.store_port) for w in kept] == [
        ("n0", T0, "10.0.0.1", 29500), ("n1", T0, None, None), ("n2", T0, None, None)]
    status = rounds.seal_round(run, BACK, [newcomer, *kept])
    assert status.store == NEXT
    assert [(p.name, p.rank, p.since) for p in status.participants] == [
        ("n0", 0, T0), ("n1", 1, T0), ("n2", 2, T0), ("n3", 3, BACK)]
    # A loss re-forms the round as well; the survivors keep their places.
    lost = rounds.remove_member(run.status, "n2", rounds.POD_DELETED, BACK)
    assert lost is not None
    lost_run = dataclasses.replace(run, status=lost)
    assert [w.name for w in rounds.kept_places(lost_run, NAMES, BACK, [],
                                               leader_next=NEXT)] == ["n0", "n1"]


@pytest.mark.parametrize("why", ["undisturbed", "rank 0 not live", "spare", "drained"])
def test_no_place_is_kept_while_the_round_need_not_form_or_rank_0_cannot_be_kept(
        why: str) -> None:
    run, live, waiting = _round_one(), NAMES, [WaitingNode(name="n3", since=BACK)]
    if why == "undisturbed":
        waiting = []
    elif why == "rank 0 not live":
        live = ["n1", "n2"]
    elif why == "spare":  # a full round: torchrun would not restart the members for it
        names = [f"m{i}" for i in range(KEEPS)]
        joins = [lease.join for lease in joined_leases(names, T0).values()]
        fresh = ElasticRun("r", "ns", _spec(), RunStatus(), "7", uid="uid")
        status = rounds.seal_round(fresh, T0, [j for j in joins if j is not None])
        run, live = dataclasses.replace(fresh, status=status), names
    else:
        run = dataclasses.replace(run, annotations={crd.DRAIN_ANNOTATION: "n0"})
    assert rounds.kept_places(run, live, BACK, waiting, leader_next=NEXT) == []


def test_once_rank_0_asks_every_other_live_member_keeps_the_request_it_answered() -> None:
    run = _round_one()
    asking = [WaitingNode(name="n0", address="10.0.0.1", store_port=1, since=BACK),
              WaitingNode(name="n3", since=BACK)]
    kept = rounds.kept_places(run, ["n0", "n1", "n2"], BACK, asking)
    assert [(w.name, w.since, w.asked_at) for w in kept] == [("n1", T0, BACK), ("n2", T0, BACK)]
    # Not live, or asking itself: no kept place.
    assert [w.name for w in rounds.kept_places(run, ["n0", "n2"], BACK, asking)] == ["n2"]
    n1_asks = [*asking, WaitingNode(name="n1", since=BACK)]
    assert [w.name for w in rounds.kept_places(run, NAMES, BACK, n1_asks)] == ["n2"]
    # A member held back (drained) is not kept.
    drained = dataclasses.replace(run, annotations={crd.DRAIN_ANNOTATION: "n2"})
    assert [w.name for w in rounds.kept_places(drained, NAMES, BACK, asking)] == ["n1"]


def test_a_round_sealed_with_kept_places_keeps_every_rank() -> None:
    run = _round_one()
    asking = [WaitingNode(name="n0", address="10.0.0.9", store_port=7, since=BACK),
              WaitingNode(name="n3", address="10.0.0.3", store_port=3, since=BACK)]
    waiting = [*asking, *rounds.kept_places(run, NAMES, BACK, asking)]
    assert rounds.decide_seal(run, BACK, waiting).seal_now
    status = rounds.seal_round(run, BACK, waiting)
    assert [(p.name, p.rank, p.since) for p in status.participants] == [
        ("n0", 0, BACK), ("n1", 1, T0), ("n2", 2, T0), ("n3", 3, BACK)]
    assert (status.store.host, status.store.port) == ("10.0.0.9", 7)  # type: ignore[union-attr]


def test_a_member_missing_holds_the_seal_back_rather_than_finding_the_last_call_over() -> None:
    """n2 neither kept nor back: the kept n1 counts from now, so the round waits for n2's
    own request (or its loss) instead of sealing without it at once."""
    run = _round_one()
    asking = [WaitingNode(name="n0", since=BACK, noticed=BACK)]
    waiting = [*asking, *rounds.kept_places(run, ["n1"], BACK, asking)]
    decision = rounds.decide_seal(run, BACK, waiting)
    assert not decision.seal_now and decision.deadline is not None and decision.deadline > BACK


# --------------------------------------------------------------------------- a member


def _member(status: RunStatus, node: str = "n1", max_nodes: int = KEEPS,
            previous_since: dt.datetime | None = T0) -> Knowledge:
    """Member ``node`` of round 1 at the start of its next call, before it asked."""
    return Knowledge(node=node, run=ElasticRun("r", "ns", _spec(max_nodes), status, "9"),
                     previous_round=1, join_deadline=CLOCK + JOIN_TIMEOUT,
                     defer_until=CLOCK + 10, previous_since=previous_since)


def _disturbed(status: RunStatus) -> RunStatus:
    """Round ``status.round`` told of a waiting node (``joinNotice``)."""
    return status.replace(join_notice=status.round)


def test_a_member_of_a_disturbed_round_waits_for_its_place_instead_of_asking() -> None:
    status = _disturbed(_round_one().status)
    assert next_action(_member(status), T0, CLOCK) == step.Wait(CLOCK + 10)
    # Past the operator's wait it asks, as every node does.
    assert next_action(_member(status), T0, CLOCK + 10) == step.Join()


@pytest.mark.parametrize("why", ["undisturbed", "rank 0", "rank 0 lost", "nodes seal",
                                 "told by lease"])
def test_a_member_asks_where_its_place_cannot_be_kept(why: str) -> None:
    status, node, max_nodes = _disturbed(_round_one().status), "n1", KEEPS
    if why == "undisturbed":  # its own request is what tells the others
        status = _round_one().status
    elif why == "rank 0":  # its request names the next round's store
        node = "n0"
    elif why == "rank 0 lost":
        status = rounds.remove_member(status, "n0", rounds.POD_DELETED, T0) or status
        assert status.leader is None
    elif why == "nodes seal":
        max_nodes = rounds.DEFER_SEAL_FROM - 1
    else:
        max_nodes = rounds.TELL_IN_SLICES_FROM
    assert next_action(_member(status, node, max_nodes), T0, CLOCK) == step.Join()
    # The positive control: where the place can be kept, the member waits.
    assert next_action(_member(_disturbed(_round_one().status)), T0, CLOCK) == step.Wait(
        CLOCK + 10)


QUIET = rounds.QUIET_WATCH_FROM


def _woken(node: str = "n1") -> Knowledge:
    """Member ``node`` of round 1 of a run its members watch quietly, woken by that watch:
    its copy shows round 1 undisturbed, the disturbance came at resourceVersion 10."""
    return _member(_round_one(QUIET).status, node, QUIET).replace(woken="10")


def _read(status: RunStatus) -> ElasticRun:
    """The run a woken member read, newer than the disturbance that woke it."""
    return ElasticRun("r", "ns", _spec(QUIET), status, "11")


def test_a_woken_member_reads_the_run_before_it_asks_again() -> None:
    """Its copy cannot say what disturbed the round: the seal that keeps its place, or what
    keeps none (rank 0 lost); the copy it reads decides, as any member's does."""
    assert _woken().stale
    assert next_action(_woken(), T0, CLOCK) == step.Read()
    # Past the operator's wait it asks without reading.
    assert next_action(_woken(), T0, CLOCK + 10) == step.Join()
    # The run it read: the round re-forms with its rank 0 (it waits for its place) ...
    disturbed = _woken().replace(run=_read(_disturbed(_round_one(QUIET).status)))
    assert not disturbed.stale
    assert next_action(disturbed, T0, CLOCK) == step.Wait(CLOCK + 10)
    # ... or without it (it asks at once).
    lost = rounds.remove_member(_round_one(QUIET).status, "n0", rounds.POD_DELETED, T0)
    assert lost is not None and lost.leader is None
    assert next_action(_woken().replace(run=_read(lost)), T0, CLOCK) == step.Join()


def test_a_woken_member_asks_at_once_where_its_place_cannot_be_kept() -> None:
    # Rank 0 before it announced the next store, and once it has (the positive control).
    assert next_action(_woken("n0"), T0, CLOCK) == step.Join()
    assert next_action(_woken("n0").replace(next_store=NEXT), T0, CLOCK) == step.Read()
    # A copy that shows the round disturbed is no woken member's: it says what happened.
    disturbed = _woken().replace(run=_member(_disturbed(_round_one(QUIET).status), "n1",
                                             QUIET).run)
    assert not rounds.may_keep_place(disturbed.run, "n1", 1, woken=True)
    assert rounds.may_keep_place(disturbed.run, "n1", 1)
    # Where the operator tells members in slices no place is kept.
    told = _member(_round_one(rounds.TELL_IN_SLICES_FROM).status, "n1",
                   rounds.TELL_IN_SLICES_FROM).replace(woken="10")
    assert next_action(told, T0, CLOCK) == step.Join()


def test_a_woken_member_takes_the_settled_round_that_keeps_its_place() -> None:
    run = _round_one(QUIET)
    newcomer = [WaitingNode(name="n3", since=BACK)]
    second = rounds.seal_round(run, BACK, [*newcomer, *rounds.kept_places(
        run, NAMES, BACK, newcomer, leader_next=NEXT)])
    assert second.stable_round == 2
    settled = _woken().replace(run=_read(second))
    assert not settled.stale
    action = next_action(settled, BACK, CLOCK)
    assert isinstance(action, step.Complete)
    assert (action.assignment.round, action.assignment.rank) == (2, 1)
    # A settled round without it: it asks.
    without = rounds.seal_round(run, BACK, [*newcomer, *rounds.kept_places(
        run, ["n0", "n2"], BACK, newcomer, leader_next=NEXT)])
    dropped = settled.replace(run=_read(without))
    assert next_action(dropped, BACK, CLOCK) == step.Join()


def test_a_member_takes_the_newer_round_that_answers_its_previous_request_again() -> None:
    run = _round_one()
    asking = [WaitingNode(name="n0", address="10.0.0.9", store_port=7, since=BACK)]
    second = rounds.seal_round(run, BACK, [*asking, *rounds.kept_places(run, NAMES, BACK,
                                                                        asking)])
    action = next_action(_member(second), BACK, CLOCK)
    assert isinstance(action, step.Complete)
    assert (action.assignment.round, action.assignment.rank) == (2, 1)
    # A round that answers another request of this node is not a kept place.
    assert next_action(_member(second, previous_since=at(1)), BACK, CLOCK) == step.Join()
    # Rank 0's previous request answered again is a restored status, not rank 0's round.
    restored = run.status.replace(round=2, signal=2)
    assert next_action(_member(restored, "n0"), BACK, CLOCK) == step.Join()


def test_a_member_that_asked_as_its_place_was_kept_takes_the_place_for_its_new_request(
        ) -> None:
    """Its wait ran out just as the operator kept its place: the round's other members
    would wait for it in torch's barrier, so it takes the place, recorded as answering
    the request it made (which re-forms the round at once, and which the next round
    keeps)."""
    run = _round_one()
    asking = [WaitingNode(name="n0", address="10.0.0.9", store_port=7, since=BACK)]
    second = rounds.seal_round(run, BACK, [*asking, *rounds.kept_places(run, NAMES, BACK,
                                                                        asking)])
    own = WaitingNode(name="n1", since=at(31))
    asked = _member(second).replace(joined=True, own=own)
    action = next_action(asked, BACK, CLOCK)
    assert isinstance(action, step.Complete)
    assert (action.assignment.round, action.assignment.rank, action.assignment.since) == (
        2, 1, at(31))
    # A round that answers neither request is still not its round.
    assert not isinstance(next_action(asked.replace(previous_since=at(1)), BACK, CLOCK),
                          step.Complete)


def test_rank_0_waits_for_its_kept_place_once_it_announced_the_next_store() -> None:
    status = _disturbed(_round_one().status)
    announced = _member(status, "n0").replace(next_store=NEXT)
    assert next_action(announced, T0, CLOCK) == step.Wait(CLOCK + 10)
    assert next_action(_member(status, "n0"), T0, CLOCK) == step.Join()  # not yet announced
    run = _round_one()
    second = rounds.seal_round(run, BACK, [WaitingNode(name="n3", since=BACK),
                                           *rounds.kept_places(run, NAMES, BACK, [
                                               WaitingNode(name="n3", since=BACK)],
                                               leader_next=NEXT)])
    action = next_action(_member(second, "n0").replace(next_store=NEXT), BACK, CLOCK)
    assert isinstance(action, step.Complete)
    assert (action.assignment.round, action.assignment.rank, action.assignment.store) == (
        2, 0, NEXT)
    # At any other store the round is not rank 0's to take.
    elsewhere = StoreAddress("10.0.0.1", 29600)
    assert next_action(_member(second, "n0").replace(next_store=elsewhere), BACK,
                       CLOCK) == step.Join()


# --------------------------------------------------------------------------- the operator


def _back(leases: dict[str, LeaseState], now: dt.datetime,
          *asking: str) -> dict[str, LeaseState]:
    """``leases`` renewed at ``now``; the nodes ``asking`` with a request made then."""
    back = {name: dataclasses.replace(lease, seen=now) for name, lease in leases.items()}
    for name in asking:
        join = back[name].join
        assert join is not None
        back[name] = dataclasses.replace(back[name], join=dataclasses.replace(
            join, since=now, address="10.0.0.9", store_port=7))
    return back


def test_the_operator_seals_once_rank_0_asks_keeping_every_live_members_place() -> None:
    run = _round_one()
    leases = joined_leases([*NAMES, "n3"], T0)
    waiting_for_rank_0 = reconcile(run, Members(leases=_back(leases, BACK, "n3")), BACK)
    assert not waiting_for_rank_0.sealed
    plan = reconcile(run, Members(leases=_back(leases, BACK, "n0", "n3")), BACK)
    assert plan.sealed and plan.status is not None
    assert [(p.name, p.rank, p.since) for p in plan.status.participants] == [
        ("n0", 0, BACK), ("n1", 1, T0), ("n2", 2, T0), ("n3", 3, BACK)]
    assert plan.status.signal == run.status.signal + 1


def test_the_operator_keeps_only_members_it_saw_renew_within_the_keep_window() -> None:
    run = _round_one()
    window = rounds.keep_window(run.spec)
    assert window < run.spec.heartbeat_timeout  # n2 is quiet, not yet lost
    later = BACK + dt.timedelta(seconds=window + 1)
    leases = _back(joined_leases([*NAMES, "n3"], T0), later, "n0", "n3")
    leases["n2"] = dataclasses.replace(leases["n2"], seen=BACK)
    plan = reconcile(run, Members(leases=leases), later)
    assert not plan.sealed  # n2 neither kept nor lost: it asks once its wait is over
    leases["n2"] = dataclasses.replace(leases["n2"], seen=later)
    assert reconcile(run, Members(leases=leases), later).sealed


def _announcing(leases: dict[str, LeaseState],
                port: int | None = NEXT.port) -> dict[str, LeaseState]:
    """``leases`` with n0's request announcing the next round's store at ``port``."""
    join = leases["n0"].join
    assert join is not None
    return {**leases, "n0": dataclasses.replace(leases["n0"], join=dataclasses.replace(
        join, next_store_port=port))}


def test_the_operator_seals_a_newcomers_round_at_once_once_rank_0_announced_its_store(
        ) -> None:
    run = _round_one()
    leases = _back(joined_leases([*NAMES, "n3"], T0), BACK, "n3")
    plan = reconcile(run, Members(leases=_announcing(leases)), BACK)
    assert plan.sealed and plan.status is not None
    assert plan.status.store == NEXT
    assert [(p.name, p.rank, p.since) for p in plan.status.participants] == [
        ("n0", 0, T0), ("n1", 1, T0), ("n2", 2, T0), ("n3", 3, BACK)]
    # No announcement, or one on a Lease this run does not own: rank 0 must ask.
    foreign = _announcing(leases)
    foreign["n0"] = dataclasses.replace(foreign["n0"], owner_uid="another")
    for unannounced in (_announcing(leases, port=None), foreign):
        assert not reconcile(run, Members(leases=unannounced), BACK).sealed
    # With nothing to re-form for, the announcement seals nothing.
    quiet = _announcing(_back(joined_leases(NAMES, T0), BACK))
    assert not reconcile(run, Members(leases=quiet), BACK).sealed


@pytest.mark.parametrize("max_nodes", [rounds.DEFER_SEAL_FROM - 1, rounds.TELL_IN_SLICES_FROM])
def test_the_operator_keeps_no_place_elsewhere(max_nodes: int) -> None:
    run = _round_one(max_nodes)
    leases = _back(joined_leases([*NAMES, "n3"], T0), BACK + dt.timedelta(seconds=5),
                   "n0", "n3")
    plan = reconcile(run, Members(leases=leases), BACK + dt.timedelta(seconds=5))
    assert not plan.sealed  # n1 and n2 must ask again


# --------------------------------------------------------------------------- in-place mode


def test_a_follower_takes_a_kept_place_in_place_and_restarts_for_a_newcomer() -> None:
    """In-place mode: the operator may seal the round that keeps a member's place before
    that member's follower looks; the follower joins it in place (no worker restart),
    while a newer round that admitted a newcomer, or formed without the node, restarts."""
    run = _round_one()
    lost = rounds.remove_member(run.status, "n2", rounds.POD_DELETED, BACK)
    assert lost is not None
    lost_run = dataclasses.replace(run, status=lost)
    asking = [WaitingNode(name="n0", address="10.0.0.9", store_port=7, since=BACK)]
    kept = rounds.seal_round(lost_run, BACK, [*asking, *rounds.kept_places(
        lost_run, ["n0", "n1"], BACK, asking)])
    kept_run = dataclasses.replace(run, status=kept)
    assert [(p.name, p.rank) for p in kept.participants] == [("n0", 0), ("n1", 1)]
    assert step.in_place_move(kept_run, 1, BACK, node="n1") == "follow"
    assert step.in_place_move(kept_run, 1, BACK) == "restart"  # positive control: no node
    with_newcomer = rounds.seal_round(lost_run, BACK, [
        *asking, WaitingNode(name="n3", since=BACK),
        *rounds.kept_places(lost_run, ["n0", "n1"], BACK, asking)])
    assert step.in_place_move(dataclasses.replace(run, status=with_newcomer), 1, BACK,
                              node="n1") == "restart"
    assert step.in_place_move(kept_run, 1, BACK, node="n2") == "restart"  # formed without it
    small = _round_one(rounds.DEFER_SEAL_FROM - 1)
    assert step.in_place_move(dataclasses.replace(small, status=kept), 1, BACK,
                              node="n1") == "restart"  # no place is kept there


# --------------------------------------------------------------------------- the notice


def test_a_newcomer_leaves_the_notice_to_the_operator_while_it_defers() -> None:
    """Where places are kept the operator seals the newcomer's round, or announces it;
    the newcomer announces itself only once its wait for the operator is over."""
    run = _round_one()
    own = WaitingNode(name="n3", since=BACK)
    newcomer = Knowledge(node="n3", run=run, previous_round=0,
                         join_deadline=CLOCK + JOIN_TIMEOUT, joined=True, own=own,
                         defer_until=CLOCK + 10)
    assert rounds.newcomers_defer_announce(run.spec)
    assert next_action(newcomer, BACK, CLOCK) == step.Wait(CLOCK + 10)
    assert next_action(newcomer.replace(pending=(own,), listed=True, listed_at=BACK), BACK,
                       CLOCK + 10) == step.Announce()
    # Positive control: from 2,048 nodes no place is kept, and it announces while deferring.
    quiet = dataclasses.replace(run, spec=_spec(rounds.TELL_IN_SLICES_FROM))
    assert next_action(newcomer.replace(run=quiet), BACK, CLOCK) == step.Announce()


def test_the_operator_announces_a_newcomer_it_cannot_seal_at_once() -> None:
    run = _round_one()
    leases = _back(joined_leases([*NAMES, "n3"], T0), BACK, "n3")
    plan = reconcile(run, Members(leases=leases), BACK)  # rank 0 announced no store yet
    assert not plan.sealed and plan.status is not None
    assert (plan.status.join_notice, plan.status.signal) == (1, run.status.signal + 1)
    assert plan.status.stable_round == 0
    # Sealing at once instead, it writes no notice.
    sealed_plan = reconcile(run, Members(leases=_announcing(leases)), BACK)
    assert sealed_plan.sealed and sealed_plan.status is not None
    assert sealed_plan.status.join_notice == 0
    # Nor where the newcomer tells the members itself.
    small = _round_one(rounds.DEFER_SEAL_FROM - 1)
    plan = reconcile(small, Members(leases=leases), BACK)
    assert plan.status is None or plan.status.signal == small.status.signal
