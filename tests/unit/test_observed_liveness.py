"""Liveness is what the reader observed, never a time a node wrote (issue 20, case 1).

A Lease counts as renewed when its reader sees its renewal change, timed by
the reader's clock (:class:`elasticrun.api.leases.RenewalClock`); the operator's
rules (``reconcile``) and the nodes' (``pending_joins``) judge by that time.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from elasticrun.api import crd, rounds
from elasticrun.api.leases import RenewalClock, lease_state, pending_joins
from elasticrun.api.model import (
    ElasticRun,
    Participant,
    RunSpec,
    RunStatus,
    StoreAddress,
    WaitingNode,
    format_time,
)
from elasticrun.operator.liveness import Loss, member_pod_loss, pod_loss
from elasticrun.operator.reconcile import Members, missing_leases, reconcile

T0 = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)
UID = "run-uid"
HEARTBEAT = 6.0
FAST = dt.timedelta(seconds=60)
FAR = dt.datetime(2199, 6, 1, tzinfo=dt.UTC)


def _at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def _lease(node: str, renewed: dt.datetime, version: int, *, uid: str = "lease-uid",
           join_since: dt.datetime | None = None) -> dict[str, Any]:
    annotations = {crd.NODE_ANNOTATION: node, crd.RUN_LABEL: "r"}
    if join_since is not None:
        annotations["elasticrun.dev/join"] = (
            f'{{"address": "10.0.0.9", "storePort": 29400, "since": "{format_time(join_since)}"}}')
    return {"metadata": {"name": f"r.{node}", "uid": uid, "resourceVersion": str(version),
                         "labels": {crd.RUN_LABEL: "r"}, "annotations": annotations,
                         "creationTimestamp": format_time(T0),
                         "ownerReferences": [{"kind": crd.KIND, "uid": UID}]},
            "spec": {"holderIdentity": f"{node}@1", "renewTime": format_time(renewed),
                     "leaseDurationSeconds": 2**31 - 1}}


def test_a_lease_first_seen_counts_as_renewed_then_whatever_its_renewtime_says() -> None:
    for written in (T0 + FAST, FAR, T0 - FAST):
        clock = RenewalClock()
        state = clock.observe("a", lease_state(_lease("a", written, 10)), T0)
        assert state.seen == T0 and clock.renewed_at("a") == T0
        assert not state.expired(_at(HEARTBEAT), HEARTBEAT)
        # Never renewed again: expired a heartbeat after it was first seen, 60 s fast or 2199.
        again = clock.observe("a", lease_state(_lease("a", written, 10)), _at(HEARTBEAT + 1))
        assert again.expired(_at(HEARTBEAT + 0.01), HEARTBEAT)
        assert again.expired_at(HEARTBEAT) == _at(HEARTBEAT)


def test_a_renewal_counts_when_the_reader_sees_it_change_not_when_it_was_written() -> None:
    clock = RenewalClock()
    clock.observe("a", lease_state(_lease("a", T0 + FAST, 10)), T0)
    # Renewed (another renewTime, newer copy): seen at the reader's time, 60 s fast or not.
    state = clock.observe("a", lease_state(_lease("a", T0 + FAST + dt.timedelta(seconds=1), 11)),
                          _at(2))
    assert state.seen == _at(2)
    # A newer copy with the same renewal (an annotation written, e.g. the operator's
    # assignment) is no renewal; neither is an older copy from a lagging watch.
    same = _lease("a", T0 + FAST + dt.timedelta(seconds=1), 12)
    assert clock.observe("a", lease_state(same), _at(4)).seen == _at(2)
    older = _lease("a", T0 + FAST, 10)
    assert clock.observe("a", lease_state(older), _at(5)).seen == _at(2)
    # The Lease deleted and created again is a new sighting.
    new = _lease("a", T0 + FAST + dt.timedelta(seconds=1), 20, uid="other")
    assert clock.observe("a", lease_state(new), _at(6)).seen == _at(6)


def test_an_unobserved_lease_counts_as_expired_and_memory_follows_the_leases() -> None:
    assert lease_state(_lease("a", FAR, 1)).expired(T0, HEARTBEAT)
    clock = RenewalClock()
    for node in ("a", "b", "c"):
        clock.observe(node, lease_state(_lease(node, T0, 1)), T0)
    clock.forget("a")
    clock.retain(lambda node: node != "b")
    assert len(clock) == 1 and clock.renewed_at("c") == T0 and clock.renewed_at("a") is None


def test_a_node_does_not_count_a_stale_join_request_as_pending_because_of_its_clock() -> None:
    clock = RenewalClock()
    ghost = _lease("ghost", FAR, 5, join_since=FAR)
    first = clock.observe("ghost", lease_state(ghost), T0)
    assert [w.name for w in pending_joins([first], RunStatus(), T0, UID, HEARTBEAT)] == ["ghost"]
    later = clock.observe("ghost", lease_state(ghost), _at(HEARTBEAT + 1))
    assert pending_joins([later], RunStatus(), _at(HEARTBEAT + 1), UID, HEARTBEAT) == ()


def _running() -> ElasticRun:
    members = tuple(Participant(name=n, rank=i, address="10.0.0.1", store_port=29400, pod=n)
                    for i, n in enumerate(("ghost", "b", "c")))
    status = RunStatus(phase="Running", round=1, signal=1, participants=members,
                       store=StoreAddress("10.0.0.1", 29400), sealed_at=FAR)
    return ElasticRun("r", "ns", RunSpec(min_nodes=2, max_nodes=3,
                                         heartbeat_timeout=int(HEARTBEAT)), status, "7",
                      uid=UID)


def _members(clock: RenewalClock, at: dt.datetime, renewals: dict[str, dt.datetime]
             ) -> Members:
    version = int((at - T0).total_seconds() * 10) + 100
    return Members(leases={n: clock.observe(n, lease_state(_lease(n, t, version)), at)
                           for n, t in renewals.items()})


def test_the_operator_removes_a_member_whose_lease_stops_changing_whatever_its_clock() -> None:
    run = _running()
    clock = RenewalClock()
    # ghost's renewTime says 2199 and never changes; b (60 s fast) and c keep renewing.
    for second in range(int(HEARTBEAT) + 1):
        at = _at(second)
        members = _members(clock, at, {"ghost": FAR, "b": at + FAST, "c": at})
        plan = reconcile(run, members, at)
        assert plan.status is None or plan.status.member_names == {"ghost", "b", "c"}
        assert plan.wake_at is not None and plan.wake_at <= _at(HEARTBEAT)
    at = _at(HEARTBEAT + 0.5)
    plan = reconcile(run, _members(clock, at, {"ghost": FAR, "b": at + FAST, "c": at}), at)
    assert plan.status is not None and plan.status.member_names == {"b", "c"}
    lost = plan.status.lost_members[-1]
    assert (lost.name, lost.reason) == ("ghost", "LeaseExpired")
    assert plan.delete_leases == ["ghost"]


def test_a_member_without_a_lease_is_timed_from_when_the_operator_saw_it_so() -> None:
    run = _running()  # sealedAt is in 2199: the node's word, not a time to count from
    leases = {"b": lease_state(_lease("b", T0, 1), seen=_at(10)),
              "c": lease_state(_lease("c", T0, 1), seen=_at(10))}
    assert missing_leases(run.status, leases) == {"ghost"}
    quiet = reconcile(run, Members(leases=leases, missing_since={"ghost": _at(5)}), _at(10))
    assert quiet.status is None or quiet.status.member_names == {"ghost", "b", "c"}
    assert quiet.wake_at == _at(5 + HEARTBEAT)
    plan = reconcile(run, Members(leases=leases, missing_since={"ghost": _at(5)}),
                     _at(5 + HEARTBEAT + 0.1))
    assert plan.status is not None and plan.status.member_names == {"b", "c"}
    assert plan.status.lost_members[-1].reason == "LeaseMissing"


def test_a_join_request_is_as_old_as_the_reader_saw_it_whatever_its_since() -> None:
    run = ElasticRun("r", "ns", RunSpec(min_nodes=2, max_nodes=2,
                                        heartbeat_timeout=int(HEARTBEAT)), RunStatus(), "7",
                     uid=UID)
    clock = RenewalClock()

    def members(at: dt.datetime) -> Members:
        # a's clock is right; b's runs 170 years ahead (since and renewTime in 2199).
        return Members(leases={
            "a": clock.observe("a", lease_state(_lease("a", at, 1, join_since=T0)), at),
            "b": clock.observe("b", lease_state(_lease("b", FAR, 1, join_since=FAR)), at)})

    first = reconcile(run, members(T0), T0)
    assert not first.sealed and first.wake_at is not None and first.wake_at <= _at(1.0)
    plan = reconcile(run, members(_at(1.0)), _at(1.0))
    assert plan.sealed and plan.status is not None
    assert [(p.name, p.rank) for p in plan.status.participants] == [("a", 0), ("b", 1)]


# --------------------------------------------------------------------------- a Pod is its uid


def _with_pods(uids: dict[str, str | None]) -> ElasticRun:
    members = tuple(Participant(name=n, rank=i, address="10.0.0.1", store_port=29400, pod=n,
                                pod_uid=uids.get(n)) for i, n in enumerate(("a", "b", "c")))
    status = RunStatus(phase="Running", round=1, signal=1, participants=members,
                       store=StoreAddress("10.0.0.1", 29400), sealed_at=T0)
    return ElasticRun("r", "ns", RunSpec(min_nodes=2, max_nodes=3), status, "7", uid=UID)


def _alive(at: dt.datetime) -> dict[str, Any]:
    return {n: lease_state(_lease(n, at, 1), seen=at) for n in ("a", "b", "c")}


def test_a_namesake_pods_deletion_removes_no_member_that_recorded_its_pods_uid() -> None:
    run = _with_pods({"a": "uid-a", "b": "uid-b", "c": "uid-c"})
    namesake = pod_loss({"metadata": {"name": "b", "uid": "uid-evil"}}, "DELETED")
    assert namesake is not None and namesake.pod_uid == "uid-evil"
    plan = reconcile(run, Members(leases=_alive(T0), pod_losses={"b": namesake},
                                  pod_losses_by_uid={"uid-evil": namesake}), T0)
    assert plan.status is None or plan.status.member_names == {"a", "b", "c"}
    real = pod_loss({"metadata": {"name": "b", "uid": "uid-b"}}, "DELETED")
    assert real is not None
    plan = reconcile(run, Members(leases=_alive(T0), pod_losses={"b": real},
                                  pod_losses_by_uid={"uid-b": real}), T0)
    assert plan.status is not None and plan.status.member_names == {"a", "c"}
    assert plan.status.lost_members[-1].reason == "PodDeleted"


def test_a_member_without_a_recorded_pod_uid_is_still_lost_by_its_pods_name() -> None:
    run = _with_pods({})  # a handler older than podUID
    plan = reconcile(run, Members(leases=_alive(T0),
                                  pod_losses={"b": Loss("PodDeleted", "pod b was deleted")}), T0)
    assert plan.status is not None and plan.status.member_names == {"a", "c"}


def test_a_member_is_tied_to_a_pod_only_when_it_named_one_and_by_uid_when_it_gave_one(
) -> None:
    """The one rule (issue 35, case A): no pod named, no Pod; a uid given, that uid only."""
    lost = Loss("PodDeleted", "pod b was deleted", pod_uid="uid-b")
    by_name, by_uid = {"b": lost}, {"uid-b": lost}
    # A node started outside a Pod (no pod, no POD_NAME): its node name is no pod name.
    assert member_pod_loss(None, None, by_name, by_uid) is None
    assert member_pod_loss("", None, by_name, by_uid) is None
    # A uid given: only that uid, whatever Pod of its name was lost.
    assert member_pod_loss("b", "uid-b", by_name, by_uid) is lost
    assert member_pod_loss("b", "uid-other", by_name, by_uid) is None
    assert member_pod_loss("renamed", "uid-b", {}, by_uid) is lost
    # A pod named without a uid (a handler older than podUID): by its pod's name.
    assert member_pod_loss("b", None, by_name, by_uid) is lost
    assert member_pod_loss("c", None, by_name, by_uid) is None


def test_a_namesake_pods_loss_removes_no_member_that_named_no_pod() -> None:
    """A node without ``pod`` is never lost through a Pod that shares its node name."""
    members = tuple(Participant(name=n, rank=i, address="10.0.0.1", store_port=29400)
                    for i, n in enumerate(("a", "b", "c")))
    status = RunStatus(phase="Running", round=1, signal=1, participants=members,
                       waiting=(WaitingNode("d", "10.0.0.4", 4, since=T0),),
                       store=StoreAddress("10.0.0.1", 29400), sealed_at=T0)
    run = ElasticRun("r", "ns", RunSpec(min_nodes=2, max_nodes=3, heartbeat_timeout=HEARTBEAT),
                     status, "7", uid=UID)
    alive = {**_alive(T0), "d": lease_state(_lease("d", T0, 1, join_since=T0), seen=T0)}
    for event in ("DELETED", None):
        namesake = {"metadata": {"name": "b", "uid": "uid-evil"}, "status": {"phase": "Failed"}}
        spare = {"metadata": {"name": "d", "uid": "uid-evil-d"}, "status": {"phase": "Failed"}}
        losses = [loss for loss in (pod_loss(namesake, event), pod_loss(spare, event)) if loss]
        assert len(losses) == 2
        plan = reconcile(run, Members(leases=alive, pod_losses={"b": losses[0], "d": losses[1]},
                                      pod_losses_by_uid={"uid-evil": losses[0],
                                                         "uid-evil-d": losses[1]}), T0)
        assert plan.status is None or (plan.status.member_names == {"a", "b", "c"}
                                       and plan.status.waiting_names == {"d"}
                                       and plan.status.lost_members == ())
    # The same member is still lost when its Lease stops: only the Pod tie is gone.
    late = _at(HEARTBEAT + 1)
    plan = reconcile(run, Members(leases={n: lease_state(_lease(n, T0, 1), seen=T0 if n == "b"
                                                        else late) for n in "abcd"}), late)
    assert plan.status is not None and "b" not in plan.status.member_names
    assert plan.status.lost_members[-1].reason == "LeaseExpired"


def test_the_pods_uid_travels_from_the_join_request_into_the_roster() -> None:
    join = WaitingNode.from_dict({"name": "a", "since": format_time(T0), "podUID": "uid-a",
                                  "pod": "a", "address": "10.0.0.1", "storePort": 1}, "join")
    run = ElasticRun("r", "ns", RunSpec(min_nodes=1, max_nodes=1), RunStatus(waiting=(join,)),
                     "7", uid=UID)
    sealed = rounds.seal_round(run, T0)
    assert sealed.participants[0].pod_uid == "uid-a"
    assert RunStatus.from_dict(sealed.to_dict()).participants[0].pod_uid == "uid-a"
