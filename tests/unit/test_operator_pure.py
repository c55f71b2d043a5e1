"""The operator's pure decisions: liveness from Pods, and reconcile's plans and repairs."""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any

import pytest

from elasticrun.api import rounds, slices
from elasticrun.api.kube import ApiConnectionError, ApiError
from elasticrun.api.leases import LeaseState, Unreachable, pending_joins
from elasticrun.api.model import (
    LOST_MEMBERS_KEPT,
    Assignment,
    ElasticRun,
    InvalidRunError,
    RunSpec,
    RunStatus,
    StoreAddress,
    WaitingNode,
    format_time,
)
from elasticrun.operator import runobjects
from elasticrun.operator.apihealth import ApiAvailability
from elasticrun.operator.liveness import Loss, pod_loss, restart_count
from elasticrun.operator.reconcile import (
    SEAL_GRACE,
    Members,
    lost_since,
    reconcile,
    repair,
    set_condition,
)

from builders import T0, at, joined_leases, running_run


def pod(status: dict[str, Any] | None = None, **meta: Any) -> dict[str, Any]:
    return {"metadata": {"name": "p0", **meta}, "status": status or {"phase": "Running"}}


def container(state: dict[str, Any], restarts: int = 0, **extra: Any) -> dict[str, Any]:
    return {"containerStatuses": [{"name": "trainer", "restartCount": restarts,
                                   "state": state, **extra}], "phase": "Running"}


# --------------------------------------------------------------------------- liveness


def test_a_running_pod_is_alive() -> None:
    assert pod_loss(pod(container({"running": {}})), "MODIFIED", 0) is None


@pytest.mark.parametrize(("body", "event", "reason"), [
    (pod(), "DELETED", "PodDeleted"),
    (pod(deletionTimestamp="2026-01-01T00:00:30Z", deletionGracePeriodSeconds=30),
     "MODIFIED", "PodDeleted"),
    (pod({"phase": "Failed", "reason": "Evicted"}), "MODIFIED", "PodFailed"),
    (pod({"phase": "Succeeded"}), "MODIFIED", "PodSucceeded"),
    (pod(container({"terminated": {"exitCode": 137, "reason": "OOMKilled"}})), "MODIFIED",
     "ContainerTerminated"),
    (pod({"conditions": [{"type": "DisruptionTarget", "status": "True",
                          "reason": "PreemptionByScheduler"}]}), "MODIFIED", "PodDisrupted"),
])
def test_pod_losses_are_named(body: dict[str, Any], event: str, reason: str) -> None:
    loss = pod_loss(body, event, 0)
    assert loss is not None and loss.reason == reason and "p0" in loss.message


def test_deletion_is_dated_from_the_request_not_the_grace_period_end() -> None:
    loss = pod_loss(pod(deletionTimestamp="2026-01-01T00:00:30Z",
                        deletionGracePeriodSeconds=30), "MODIFIED")
    assert loss is not None and loss.since == T0


def test_a_restarted_container_is_a_loss_only_after_the_first_sight() -> None:
    body = pod(container({"running": {}}, restarts=2, lastState={
        "terminated": {"finishedAt": "2026-01-01T00:00:05Z"}}))
    assert restart_count(body) == 2
    assert pod_loss(body, "MODIFIED", first_restart_count=2) is None
    loss = pod_loss(body, "MODIFIED", first_restart_count=1)
    assert loss is not None and loss.reason == "ContainerRestarted"
    assert loss.since == T0 + dt.timedelta(seconds=5)


# --------------------------------------------------------------------------- reconcile


def test_closing_by_spec_closes_the_status_and_signals_everyone() -> None:
    run = running_run(RunSpec(min_nodes=2, max_nodes=3, closed=True))
    plan = reconcile(run, Members(), T0)
    assert plan.status is not None and plan.status.phase == "Closed"
    assert plan.status.signal == run.status.signal + 1
    closed = plan.status.condition("Closed")
    assert closed is not None and closed.status == "True" and closed.observed_generation == 3


def test_a_run_a_member_marked_succeeded_gets_its_conditions_once_and_no_new_signal() -> None:
    finished = rounds.leave(running_run().status, "a", T0, finished=True)
    assert finished is not None
    run = running_run(**{f.name: getattr(finished, f.name)
                         for f in dataclasses.fields(finished)})
    plan = reconcile(run, Members(), T0 + dt.timedelta(seconds=1))
    assert plan.status is not None and plan.status.phase == "Succeeded"
    assert plan.status.signal == run.status.signal  # the member already told everyone
    succeeded = plan.status.condition("Succeeded")
    assert succeeded is not None and (succeeded.status, succeeded.reason) == (
        "True", "ExitBarrierPassed")
    assert [e[1] for e in plan.events] == ["Succeeded"]
    again = reconcile(run.replace_status(plan.status), Members(), T0 + dt.timedelta(seconds=2))
    assert again.status is None and not again.events


def test_a_member_whose_pod_failed_is_removed_and_the_round_marked() -> None:
    run = running_run()
    loss = Loss("PodFailed", "pod b failed", T0 - dt.timedelta(seconds=2))
    plan = reconcile(run, Members(pod_losses={"b": loss}), T0)
    assert plan.status is not None
    assert plan.status.member_names == {"a", "c"} and plan.status.degraded
    lost = lost_since(run.status, plan.status)
    assert [(m.name, m.reason, m.detection_seconds) for m in lost] == [("b", "PodFailed", 2.0)]
    degraded = plan.status.condition("Degraded")
    assert degraded is not None and degraded.status == "True" and "b" in (degraded.message or "")
    # Decided from the Pod alone: carried out without listing the Leases first.
    assert plan.delete_leases == ["b"] and not plan.lease_decided


#: Whatever duration a Lease claims (here 2^31-1 s), liveness is the run's heartbeat.
CLAIMED_FOREVER = float(2**31 - 1)
HEARTBEAT_10 = RunSpec(min_nodes=2, max_nodes=3, heartbeat_timeout=10)


def _leases(renewed: dict[str, dt.datetime],
            duration: float = CLAIMED_FOREVER) -> dict[str, LeaseState]:
    return {n: LeaseState(node=n, holder=n, renewed=t, duration=duration, seen=t)
            for n, t in renewed.items()}


def test_a_lease_not_renewed_for_the_runs_heartbeat_removes_its_member() -> None:
    run = running_run(HEARTBEAT_10)
    leases = _leases({"a": T0, "b": T0 - dt.timedelta(seconds=11), "c": T0})
    plan = reconcile(run, Members(leases=leases), T0)
    assert plan.status is not None and plan.status.member_names == {"a", "c"}
    assert plan.status.lost_members[-1].reason == "LeaseExpired"
    assert plan.delete_leases == ["b"] and plan.lease_decided


def test_after_an_api_outage_every_lease_gets_a_full_duration_to_be_renewed() -> None:
    # The API server was down from T0-30s to T0-2s: nobody could renew, every
    # Lease is 30 s old.  Counted from the API server's return, none has expired.
    run = running_run(HEARTBEAT_10)
    stale = _leases(dict.fromkeys("abc", T0 - dt.timedelta(seconds=30)))
    back = T0 - dt.timedelta(seconds=2)
    plan = reconcile(run, Members(leases=stale, lease_clock_start=back), T0)
    assert plan.status is None or plan.status.member_names == {"a", "b", "c"}
    assert plan.delete_leases == []
    assert plan.wake_at == back + dt.timedelta(seconds=10)  # look again when that ends
    # A holder that still has not renewed a full duration after the return is gone.
    later = T0 + dt.timedelta(seconds=9)
    renewed = {**stale, **_leases({"a": later, "c": later})}
    plan = reconcile(run, Members(leases=renewed, lease_clock_start=back), later)
    assert plan.status is not None and plan.status.member_names == {"a", "c"}
    assert plan.status.lost_members[-1].name == "b"


def test_api_availability_tracks_the_last_return_of_the_api_server() -> None:
    changes: list[bool] = []
    api = ApiAvailability(client=None, on_change=changes.append)  # type: ignore[arg-type]
    started = api.since
    assert started is not None
    api.record(True, T0)  # still reachable: nothing changes
    assert api.since == started and changes == []
    api.record(False, T0)
    assert api.since is None and api.lease_clock_start(T0) == T0  # down: nothing expires
    api.record(False, T0 + dt.timedelta(seconds=5))
    api.record(True, T0 + dt.timedelta(seconds=9))
    assert api.since == T0 + dt.timedelta(seconds=9) and changes == [False, True]
    assert api.lease_clock_start(T0 + dt.timedelta(seconds=20)) == T0 + dt.timedelta(seconds=9)


def test_set_condition_keeps_the_transition_time_unless_the_status_flips() -> None:
    first = set_condition((), "Ready", True, "A", "m", T0, 1)
    later = set_condition(first, "Ready", True, "B", "m2", T0 + dt.timedelta(seconds=9), 2)
    assert later[0].last_transition_time == T0 and later[0].reason == "B"
    flipped = set_condition(later, "Ready", False, "C", "m3", T0 + dt.timedelta(seconds=20), 2)
    assert flipped[0].last_transition_time == T0 + dt.timedelta(seconds=20)


def test_a_round_a_node_sealed_reports_itself_and_leaves_the_operator_nothing_to_write() -> None:
    """The seal writes the round's conditions with the round (rounds.round_conditions),
    so no second status write follows each seal only to report it, while the
    members read the sealed run and reach the store."""
    leases = joined_leases(["a", "b"], T0)
    before = ElasticRun("r", "ns", RunSpec(min_nodes=2, max_nodes=2),
                        RunStatus(phase="Pending", observed_generation=3), "5", generation=3,
                        uid="uid")
    sealed = rounds.seal_round(before, at(1), tuple(
        lease.join for lease in leases.values() if lease.join is not None))
    reported = [("RoundComplete", "True", "Sealed", "round 1: 2 members, rank 0 = a"),
                ("Degraded", "False", "AllMembersAlive", "all members of round 1 are alive")]
    assert [(c.type, c.status, c.reason, c.message) for c in sealed.conditions] == reported
    assert {(c.last_transition_time, c.observed_generation) for c in sealed.conditions} == {
        (at(1), 3)}
    stored = RunStatus.from_dict(sealed.to_dict())  # as the operator reads it back
    assert reconcile(before.replace_status(stored), Members(leases=leases), at(2)).status is None
    # The same round sealed without them: the operator writes them.
    bare = before.replace_status(stored.replace(conditions=()))
    written = reconcile(bare, Members(leases=leases), at(2)).status
    assert written is not None
    assert [(c.type, c.status, c.reason, c.message) for c in written.conditions] == reported


# --------------------------------------------------------------------------- repair


def _live_lease(name: str, since: dt.datetime) -> LeaseState:
    """The Lease of a live node (renewed at T0) whose join request was made at ``since``."""
    join = WaitingNode(name=name, address="10.0.0.1", store_port=29400, since=since)
    return LeaseState(node=name, holder=name, renewed=T0, duration=10, join=join,
                      owner_uid="uid", seen=T0)


def test_repair_of_duplicate_ranks_keeps_round_and_readable_waiting_and_reforms() -> None:
    broken = {"phase": "Running", "round": 4, "signal": 9,
              "participants": [{"name": "a", "rank": 0}, {"name": "b", "rank": 0}],
              "waiting": [{"name": "w", "address": "10.0.0.9"}, {"name": 7}]}
    with pytest.raises(InvalidRunError) as error:
        RunStatus.from_dict(broken)
    repaired = RunStatus.from_dict(repair(broken, error.value, T0, 5))
    assert repaired.round == 4 and repaired.signal == 10  # forward, never back
    assert repaired.restart_round == 4 and repaired.degraded
    # Both members keep their places, ranked 0..1, and the requests they answered.
    assert [(p.name, p.rank) for p in repaired.participants] == [("a", 0), ("b", 1)]
    assert [w.name for w in repaired.waiting] == ["w"]  # the unreadable entry is dropped
    condition = repaired.condition("Degraded")
    assert condition is not None and condition.reason == "InvalidStatus"
    assert str(error.value) in (condition.message or "")


def test_repair_of_an_unreadable_status_type() -> None:
    repaired = RunStatus.from_dict(repair("garbage", ValueError("x"), T0, 1))
    assert repaired.round == 0 and repaired.phase == "Forming"


def test_repair_of_a_round_that_went_back_moves_it_forward_again() -> None:
    went_back = {"phase": "Running", "round": 1, "signal": 4,
                 "participants": [{"name": "a", "rank": 0}], "store": {"host": "h", "port": 1}}
    error = InvalidRunError("status.round", "went back from 3 to 1")
    repaired = RunStatus.from_dict(repair(went_back, error, T0, 2, min_round=3))
    assert repaired.round == 3 and repaired.degraded and repaired.restart_round == 3
    assert [p.name for p in repaired.participants] == ["a"]
    assert repaired.signal == 5


def test_a_repair_keeps_the_requests_the_members_answered() -> None:
    """The members' Leases still carry the requests their round answered: after the
    repair those are spent, and only a newer request of theirs waits."""
    answered = T0 - dt.timedelta(minutes=5)
    broken = {"phase": "Running", "round": 2, "signal": 3,
              "participants": [
                  {"name": "a", "rank": 0, "joinedRound": 1, "since": format_time(answered)},
                  {"name": "b", "rank": 0, "joinedRound": 2, "since": format_time(answered)},
                  {"name": "c", "rank": "one"}]}
    with pytest.raises(InvalidRunError) as error:
        RunStatus.from_dict(broken)
    repaired = RunStatus.from_dict(repair(broken, error.value, T0, 1))
    assert [(p.name, p.rank, p.joined_round) for p in repaired.participants] == [
        ("a", 0, 1), ("b", 1, 2)]

    stale = [_live_lease(name, answered) for name in ("a", "b")]
    assert pending_joins(stale, repaired, T0, "uid", 30) == ()
    assert [w.name for w in pending_joins([_live_lease("a", T0)], repaired, T0, "uid", 30)] == ["a"]


def test_a_repair_records_the_requests_it_cannot_place_as_spent() -> None:
    """A member whose entry the edit removed keeps its answered request on its Lease:
    the repair records it as spent, so no seal takes it before the member asks again.
    A request the status answers or keeps waiting stays as it is."""
    answered, asked = T0 - dt.timedelta(minutes=5), T0 - dt.timedelta(seconds=1)
    earlier = {"name": "d", "round": 1, "reason": rounds.LEFT, "since": format_time(answered)}
    broken = {"phase": "Running", "round": 2, "signal": 3, "store": {"host": "h", "port": 1},
              "participants": [
                  {"name": "a", "rank": 0, "joinedRound": 1, "since": format_time(answered)},
                  {"name": "c", "rank": 2, "joinedRound": 1, "since": format_time(answered)}],
              "waiting": [{"name": "w", "since": format_time(asked)}],
              "lostMembers": [earlier, {"name": 7}]}
    with pytest.raises(InvalidRunError, match=r"status\.lostMembers") as error:
        RunStatus.from_dict(broken)

    leases = [_live_lease("a", answered), _live_lease("b", answered), _live_lease("c", answered),
              _live_lease("d", answered), _live_lease("w", asked)]
    requests = [state.join for state in leases if state.join is not None]
    repaired = RunStatus.from_dict(repair(broken, error.value, T0, 1, requests=requests))
    assert [(m.name, m.reason, m.since) for m in repaired.lost_members] == [
        ("d", rounds.LEFT, answered), ("b", rounds.STATUS_UNREADABLE, answered)]
    assert repaired.lost_members[1].round == 2 and repaired.lost_members[1].time == T0
    assert [w.name for w in pending_joins(leases, repaired, T0, "uid", 30)] == ["w"]
    # Positive control: without the Leases' requests, b's answered request waits again.
    unrecorded = RunStatus.from_dict(repair(broken, error.value, T0, 1))
    assert [w.name for w in pending_joins(leases, unrecorded, T0, "uid", 30)] == ["b", "w"]
    # b's next request is its own, and waits.
    again = [*leases[:1], _live_lease("b", T0), *leases[2:]]
    assert sorted(w.name for w in pending_joins(again, repaired, T0, "uid", 30)) == ["b", "w"]


def test_a_repair_keeps_the_newest_spent_requests_the_status_holds() -> None:
    requests = [WaitingNode(name=f"n{i:02}", since=T0 - dt.timedelta(seconds=i))
                for i in range(LOST_MEMBERS_KEPT + 4)]
    repaired = RunStatus.from_dict(repair({"round": 3}, ValueError("x"), T0, 1,
                                          requests=requests))
    assert len(repaired.lost_members) == LOST_MEMBERS_KEPT
    assert {m.name for m in repaired.lost_members} == {f"n{i:02}" for i in
                                                      range(LOST_MEMBERS_KEPT)}


class _Answers:
    """A KubeClient stand-in for the probe: raises or answers what it is given."""

    def __init__(self, outcome: Exception | None) -> None:
        self.outcome = outcome

    def request(self, method: str, path: str, **_: Any) -> dict[str, Any]:
        assert (method, path) == ("GET", "/readyz")
        if self.outcome is not None:
            raise self.outcome
        return {}


@pytest.mark.parametrize(("outcome", "reachable"), [
    (None, True),
    (ApiConnectionError("connection refused"), False),
    (ApiError(500, "InternalError", "readyz check failed: etcd", {}), False),
    (ApiError(503, "ServiceUnavailable", "not ready", {}), False),
    # Refused is still an answer: a hardened cluster must not freeze Lease expiry.
    (ApiError(403, "Forbidden", 'User "op" cannot get path "/readyz"', {}), True),
])
def test_the_probe_counts_only_a_missing_or_unwell_server_as_unreachable(
        outcome: Exception | None, reachable: bool) -> None:
    api = ApiAvailability(client=_Answers(outcome))  # type: ignore[arg-type]
    assert api.probe() is reachable


# --------------------------------------------------------------------------- reported rank 0

#: Heartbeat 10 s, renewed every second: a reported rank 0 is lost after 2 quiet seconds.
RENEW_1 = RunSpec(min_nodes=2, max_nodes=3, heartbeat_timeout=10, lease_renew_interval=1)


def _reported(leader_renewed: dt.datetime, *, about: str = "a", round_: int = 1,
              reporter: str = "b") -> dict[str, LeaseState]:
    leases = _leases({"a": leader_renewed, "b": T0, "c": T0})
    leases[reporter] = dataclasses.replace(leases.get(reporter) or _leases({reporter: T0})[
        reporter], unreachable=Unreachable(node=about, round=round_))
    return leases


def test_a_reported_rank0_whose_lease_went_quiet_is_removed_before_its_heartbeat() -> None:
    run = running_run(RENEW_1)
    plan = reconcile(run, Members(leases=_reported(T0 - dt.timedelta(seconds=2.5))), T0)
    assert plan.status is not None and plan.status.member_names == {"b", "c"}
    lost = plan.status.lost_members[-1]
    assert (lost.name, lost.reason) == ("a", "StoreUnreachable")
    assert "did not answer b" in (lost.message or "")
    assert plan.delete_leases == ["a"]


def test_a_reported_rank0_that_still_renews_is_kept_and_looked_at_again() -> None:
    run = running_run(RENEW_1)
    renewed = T0 - dt.timedelta(seconds=0.5)
    plan = reconcile(run, Members(leases=_reported(renewed)), T0)
    assert plan.status is None or plan.status.member_names == {"a", "b", "c"}
    assert plan.delete_leases == []
    assert plan.wake_at == renewed + dt.timedelta(seconds=2.05)


@pytest.mark.parametrize(("about", "round_", "reporter"), [
    ("b", 1, "c"),      # not rank 0: nobody connects to it
    ("a", 0, "b"),      # an older round's report
    ("a", 1, "x"),      # from a node that is not a member
])
def test_reports_that_do_not_concern_the_current_rank0_change_nothing(
        about: str, round_: int, reporter: str) -> None:
    run = running_run(RENEW_1)
    leases = _reported(T0 - dt.timedelta(seconds=2.5), about=about, round_=round_,
                       reporter=reporter)
    plan = reconcile(run, Members(leases=leases), T0)
    assert plan.status is None or plan.status.member_names == {"a", "b", "c"}


def test_after_an_api_outage_a_reported_rank0_gets_its_quiet_time_again() -> None:
    run = running_run(RENEW_1)
    back = T0 - dt.timedelta(seconds=1)
    plan = reconcile(run, Members(leases=_reported(T0 - dt.timedelta(seconds=30)),
                                  lease_clock_start=back), T0)
    assert plan.status is None or plan.status.member_names == {"a", "b", "c"}


def test_an_expired_lease_of_a_node_already_removed_is_deleted() -> None:
    # An operator stopped between writing a removal and deleting the Lease.
    run = running_run(HEARTBEAT_10)
    leases = _leases({"a": T0, "b": T0, "c": T0, "gone": T0 - dt.timedelta(seconds=11)})
    plan = reconcile(run, Members(leases=leases), T0)
    assert plan.delete_leases == ["gone"] and plan.lease_decided
    assert plan.status is None or plan.status.member_names == {"a", "b", "c"}
    live = _leases({"a": T0, "b": T0, "c": T0, "between-rounds": T0})
    kept = reconcile(run, Members(leases=live), T0)
    assert kept.delete_leases == [] and not kept.lease_decided


@pytest.mark.parametrize("size", [3, 64])
def test_the_operator_seals_at_once_where_nodes_leave_it_the_seal(size: int) -> None:
    """Small runs: nodes seal, the operator waits SEAL_GRACE.  Large runs: nobody to wait for."""
    names = [f"n{i:03d}" for i in range(size)]
    run = ElasticRun("r", "ns", RunSpec(min_nodes=size, max_nodes=size), RunStatus(), "7",
                     uid="uid")
    plan = reconcile(run, Members(leases=joined_leases(names, T0)), T0)
    if size < rounds.DEFER_SEAL_FROM:
        assert not plan.sealed and plan.wake_at == T0 + dt.timedelta(seconds=SEAL_GRACE)
    else:
        assert plan.sealed and plan.status is not None and plan.status.round == 1
        assert [p.name for p in plan.status.participants] == names


def _places(plan_tell: list[slices.Slice]) -> dict[str, Assignment | None]:
    """Every node's place as the planned slices tell it."""
    return {node: slices.read_place(piece.manifest("r", "ns", "uid"), "r", node)
            for piece in plan_tell for node in piece.places}


@pytest.mark.parametrize("size", [3, 64, rounds.QUIET_WATCH_FROM, rounds.TELL_IN_SLICES_FROM])
def test_in_the_largest_runs_the_seal_leaves_the_signal_and_tells_the_round_in_slices(
        size: int) -> None:
    names = [f"n{i:04d}" for i in range(size)]
    run = ElasticRun("r", "ns", RunSpec(min_nodes=size, max_nodes=size), RunStatus(signal=4),
                     "7", uid="uid")
    leases = joined_leases(names, T0)
    plan = reconcile(run, Members(leases=leases), T0 + dt.timedelta(seconds=SEAL_GRACE))
    assert plan.sealed and plan.status is not None
    if size < rounds.TELL_IN_SLICES_FROM:
        assert plan.status.signal == 5 and plan.tell == []
        return
    assert plan.status.signal == 4  # nobody's run watch fires with the whole roster
    assert len(plan.tell) == slices.SLICE_COUNT  # 2,048 names fill every slice
    assert all(piece.round == 1 for piece in plan.tell)
    assert all(slices.slice_index(node) == piece.index
               for piece in plan.tell for node in piece.places)
    places = _places(plan.tell)
    assert sorted(places) == names  # each member once, in the slice its name hashes into
    first = places["n0000"]
    assert first is not None
    assert (first.round, first.rank, first.world_size, first.leader) == (1, 0, size, "n0000")
    assert first.store == StoreAddress("10.0.0.1", 29400) and first.since == T0
    assert sorted(p.rank for p in places.values() if p is not None) == list(range(size))


def _sealed_largest_run() -> tuple[RunSpec, dict[str, LeaseState], RunStatus]:
    """A run of the largest size (told in slices), its Leases, and the operator's seal of
    its first round."""
    size = rounds.TELL_IN_SLICES_FROM
    spec = RunSpec(min_nodes=size, max_nodes=size)
    leases = joined_leases([f"n{i:04d}" for i in range(size)], T0)
    status = reconcile(ElasticRun("r", "ns", spec, RunStatus(), "7", uid="uid"),
                       Members(leases=leases), T0).status
    assert status is not None
    return spec, leases, status


def test_a_restarted_operator_writes_every_slice_again_and_a_running_one_only_those_not_told(
        ) -> None:
    spec, leases, status = _sealed_largest_run()
    run = ElasticRun("r", "ns", spec, status, "8", uid="uid")
    later = T0 + dt.timedelta(seconds=1)
    restarted = reconcile(run, Members(leases=leases), later)  # nothing done yet
    assert [piece.index for piece in restarted.tell] == list(range(slices.SLICE_COUNT))
    done = runobjects.NOTHING_DONE
    for piece in restarted.tell[:-3]:
        done = done.wrote(piece)
    plan = reconcile(run, Members(leases=leases), later, done=done)
    assert plan.tell == restarted.tell[-3:]  # the same slices, whole
    for piece in plan.tell:
        done = done.wrote(piece)
    assert reconcile(run, Members(leases=leases), later, done=done).tell == []
    # Slices told of an earlier round count for nothing in this one.
    older = runobjects.Done(told=(status.round - 1, frozenset(range(slices.SLICE_COUNT))))
    assert len(reconcile(run, Members(leases=leases), later, done=older).tell) \
        == slices.SLICE_COUNT


def test_no_slice_tells_a_store_its_rank_0_did_not_announce() -> None:
    """Members take a place told in a slice without checking its store themselves, so the
    operator checks it once: a status a node sealed with another store (anyone who may
    write the run could), or whose rank 0 has asked again since, tells nothing."""
    spec, leases, status = _sealed_largest_run()
    assert status.store == StoreAddress("10.0.0.1", 29400)
    later = T0 + dt.timedelta(seconds=1)

    def told(store: StoreAddress, leader_since: dt.datetime = T0) -> int:
        run = ElasticRun("r", "ns", spec, status.replace(store=store), "8", uid="uid")
        rank_0 = dataclasses.replace(leases["n0000"], join=dataclasses.replace(
            leases["n0000"].join, since=leader_since))
        return len(reconcile(run, Members(leases={**leases, "n0000": rank_0}), later).tell)

    assert told(StoreAddress("10.0.0.1", 29400)) == slices.SLICE_COUNT  # the control
    assert told(StoreAddress("10.6.6.6", 29400)) == 0
    assert told(StoreAddress("10.0.0.1", 29401)) == 0
    assert told(StoreAddress("10.0.0.1", 29400), leader_since=later) == 0


def test_a_re_forming_round_is_told_nothing() -> None:
    spec, leases, status = _sealed_largest_run()
    degraded = rounds.request_restart(status)
    assert degraded is not None
    run = ElasticRun("r", "ns", spec, degraded, "8", uid="uid")
    assert reconcile(run, Members(leases=leases), T0).tell == []


def test_the_operator_closes_a_run_as_a_closing_node_does() -> None:
    """One rule for closing (:func:`rounds.close`): the operator's write on ``spec.closed``
    is the status a node's ``set_closed`` writes."""
    run = running_run(RunSpec(min_nodes=2, max_nodes=3, closed=True))
    plan = reconcile(run, Members(), T0)
    assert plan.status is not None and plan.status == rounds.close(run, T0)
    assert ("Normal", "Closed", "run closed (spec.closed=true)") in plan.events
