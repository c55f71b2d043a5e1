"""The operator's executor over the in-memory API server: its rules, seen in what lands.

:class:`~elasticrun.operator.executor.PlanExecutor` carries out a plan through
:class:`~elasticrun.api.gateway.OperatorAccess`; here that is
:class:`fakegateway.FakeOperatorGateway`, so every rule is asserted on the
objects the server holds afterwards and on the order of its writes (its
``history``, one revision per write): the status write fenced by the run's
resourceVersion, nothing written after a lost one; a round's slices written
whole, each kept as told once it took; Lease deletions of
the observed object only, and never of a Lease that is not the run's own; a
deletion plan's Events before its deletions, the run last; the run's objects
kept as applied only once the apply took; the planned repair of an unreadable
status.  Plans come from the pure :func:`reconcile` where that is how the
operator makes them, else are built directly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
from typing import Any

import pytest
from fakegateway import LEASE, RUN, FakeApiServer, FakeOperatorGateway

from elasticrun.api import crd
from elasticrun.api.kube import ApiConnectionError
from elasticrun.api.leases import (
    LeaseState,
    lease_state,
    node_lease,
)
from elasticrun.api.model import (
    Assignment,
    ElasticRun,
    InvalidRunError,
    RunSpec,
    RunStatus,
    StoreAddress,
    parse_run,
)
from elasticrun.api.naming import lease_name
from elasticrun.api.slices import Place, Slice, read_place, slice_name, slice_path
from elasticrun.operator import runrbac
from elasticrun.operator.executor import ASSIGN_RETRY_SECONDS, PlanExecutor
from elasticrun.operator.metrics import Metrics
from elasticrun.operator.observer import Observer
from elasticrun.operator.reconcile import Members, Plan, plan_repair, reconcile
from elasticrun.operator.runobjects import Settings

from builders import T0

KEY = ("ns", "r")
BOTH = Settings(per_run_rbac=True, store_policy_port=29500)
ACCOUNT = {runrbac.SERVICE_ACCOUNT_ANNOTATION: "trainer"}


@dataclasses.dataclass
class Bed:
    """One run on a fake server, and an executor writing to it."""

    server: FakeApiServer
    access: FakeOperatorGateway
    executor: PlanExecutor
    accepted: list[dict[str, Any]]
    enqueued: list[tuple[str, str]]
    #: The reconciles asked for within some seconds: (run, seconds).
    retried: list[tuple[tuple[str, str], float]]

    def run(self) -> ElasticRun:
        return parse_run(self.server.run("r"))

    def lease(self, node: str, owner_uid: str | None = None) -> LeaseState:
        """``node``'s Lease created on the server (owned by the run unless ``owner_uid``
        says otherwise), as the operator observes it."""
        uid = owner_uid or self.run().uid
        created = self.server.create((LEASE, lease_name("r", node)),
                                     node_lease("r", node, node, 10, uid, T0))
        return lease_state(created)

    def replace_lease(self, node: str) -> dict[str, Any]:
        """Another object under ``node``'s Lease name (its agent re-created it)."""
        self.server.delete((LEASE, lease_name("r", node)))
        return self.server.create((LEASE, lease_name("r", node)),
                                  node_lease("r", node, node, 10, self.run().uid, T0))

    def stored_lease(self, node: str) -> dict[str, Any] | None:
        return self.server.lease_of("r", node)

    def carry_out(self, run: ElasticRun, plan: Plan,
                  leases: dict[str, LeaseState] | None = None) -> ElasticRun | None:
        return asyncio.run(self.executor.carry_out(run, plan, leases))

    def reasons(self) -> list[str]:
        return [event["reason"] for event in self.server.events()]

    def writes(self, since: int = 0) -> list[tuple[str, str, str]]:
        """Every write after revision ``since``, in order: (what, kind, name); what is
        "created", "changed" or "deleted"."""
        return [("deleted" if new is None else "created" if old is None else "changed",
                 kind, name)
                for revision, (kind, name), old, new in self.server.history if revision > since]

    def revision(self) -> int:
        return self.server.history[-1][0] if self.server.history else 0


def bed(spec: RunSpec | None = None, annotations: dict[str, str] | None = None) -> Bed:
    """Run ``r`` (``annotations`` on it) on a fresh server, and an executor for it."""
    server = FakeApiServer("ns")
    server.seed_run("r", spec or RunSpec(min_nodes=1, max_nodes=4))
    if annotations:
        server.update((RUN, "r"), lambda run: {**run, "metadata": {
            **run["metadata"], "annotations": dict(annotations)}})
    access = FakeOperatorGateway(server)
    accepted: list[dict[str, Any]] = []
    enqueued: list[tuple[str, str]] = []
    retried: list[tuple[tuple[str, str], float]] = []
    executor = PlanExecutor(access, Observer(access, Metrics()),
                            lambda key, raw: accepted.append(raw), enqueued.append,
                            retry=lambda key, seconds: retried.append((key, seconds)))
    return Bed(server, access, executor, accepted, enqueued, retried)


def told(rank: int = 0, round_: int = 2) -> Assignment:
    """A member's place in round ``round_``."""
    return Assignment(round=round_, rank=rank, world_size=4,
                      store=StoreAddress("10.0.0.1", 29400), leader="a", since=T0)


def holds(b: Bed, path: str, manifest: dict[str, Any]) -> bool:
    """Whether the server holds ``manifest`` at ``path`` (its metadata aside)."""
    stored = b.server.objects.get(b.server.key_of(path))
    return stored is not None and {k: v for k, v in stored.items() if k != "metadata"} == \
        {k: v for k, v in manifest.items() if k != "metadata"}


def place_in(b: Bed, index: int, node: str) -> Assignment | None:
    """``node``'s place as slice ``index`` of run ``r`` on the server tells it."""
    stored = b.server.objects.get(
        b.server.key_of(slice_path("ns", slice_name(b.run().uid or "", index))))
    return read_place(stored, "r", node)


def piece(index: int, *places: tuple[str, Assignment]) -> Slice:
    """Slice ``index`` of the places' round (the terms of its first), holding ``places``."""
    terms = places[0][1]
    return Slice(index, terms.round, terms.world_size, terms.store, terms.leader,
                 {node: Place(place.rank, place.since) for node, place in places})


# --------------------------------------------------------------------------- the status write


def test_the_status_write_is_fenced_and_the_plan_is_carried_out_after_it_in_order() -> None:
    b = bed(annotations={"elasticrun.dev/restart": "1", "keep": "x"})
    leases = {"a": b.lease("a"), "b": b.lease("b")}
    run = b.run()
    status = RunStatus(phase="Running", round=2, signal=2)
    plan = Plan(status=status, tell=[piece(3, ("a", told()))], delete_leases=["b"],
                remove_annotations=["elasticrun.dev/restart"],
                events=[("Normal", "RoundSealed", "round 2")])
    since = b.revision()
    written = b.carry_out(run, plan, leases)
    stored = b.server.run("r")
    assert written is not None and written.status == parse_run(stored).status
    assert stored["status"] == status.to_dict()
    # Fenced by the copy planned from: the write is that copy's successor.
    assert int(stored["metadata"]["resourceVersion"]) > int(run.resource_version or 0)
    assert [parse_run(raw) for raw in b.accepted] == [written]  # the copy as written
    assert place_in(b, 3, "a") == told()
    assert b.stored_lease("b") is None
    assert b.server.run("r")["metadata"]["annotations"] == {"keep": "x"}
    assert b.reasons() == ["RoundSealed"]
    lease_b = lease_name("r", "b")
    events = [(what, name) for what, kind, name in b.writes(since) if kind.endswith("/events")]
    assert [(what, name) for what, kind, name in b.writes(since)
            if not kind.endswith("/events")] == [
        ("changed", "r"), ("created", slice_name(run.uid or "", 3)), ("deleted", lease_b),
        ("changed", "r")]
    assert b.writes(since)[-1][1].endswith("/events") and len(events) == 1


def test_a_lost_status_write_returns_none_and_nothing_is_written_after_it() -> None:
    b = bed(annotations={"elasticrun.dev/restart": "1"})
    leases = {"a": b.lease("a"), "b": b.lease("b")}
    run = b.run()
    # Another writer's compare-and-set lands between the plan and its write.
    winner = RunStatus(phase="Running", round=5, signal=5).to_dict()
    b.server.update((RUN, "r"), lambda stored: {**stored, "status": winner},
                    run.resource_version)
    since = b.revision()
    watch = b.server.watch((RUN, "r"), lambda _: True, run.resource_version, 1)
    plan = Plan(status=RunStatus(phase="Running", round=2, signal=2),
                tell=[piece(3, ("a", told()))], delete_leases=["b"],
                remove_annotations=["elasticrun.dev/restart"],
                events=[("Normal", "RoundSealed", "round 2")])
    assert b.carry_out(run, plan, leases) is None
    assert b.server.run("r")["status"] == winner
    assert b.writes(since) == []  # no slice, deletion, annotation or Event after it
    assert b.accepted == [] and b.access.run(*KEY).reached == {"replace_status": 1}
    # What reconciles the run again: the winner's write, on the run's watch from the
    # copy the plan was made from.
    assert [(e["type"], e["object"]["status"]) for e in watch] == [("MODIFIED", winner)]


def test_a_lost_repair_reads_the_run_again_and_requeues_it_then_the_repair_lands() -> None:
    b = bed()
    b.server.update((RUN, "r"), lambda run: {**run, "status": {"round": "x"}})
    raw = b.server.run("r")
    with pytest.raises(InvalidRunError) as info:
        parse_run(raw)
    error = info.value
    fix = plan_repair(raw, error, T0, 0)
    # Someone else writes the run meanwhile (still unreadable: no event would re-queue it).
    b.server.update((RUN, "r"), lambda run: {**run, "status": {"round": "y"}})
    asyncio.run(b.executor.repair(KEY, raw, fix, str(error)))
    fresh = b.server.run("r")
    assert fresh["status"] == {"round": "y"}
    assert b.enqueued == [KEY] and b.accepted == [fresh]
    assert b.executor.state(KEY).invalid_reported is None and b.reasons() == []
    again = plan_repair(fresh, error, T0, 0)
    asyncio.run(b.executor.repair(KEY, fresh, again, str(error)))
    repaired = b.server.run("r")
    assert repaired["status"] == again.status and parse_run(repaired).status.round == 0
    assert b.accepted[-1] == repaired and b.enqueued == [KEY]
    assert b.executor.state(KEY).invalid_reported == str(error)
    assert b.reasons() == ["InvalidStatus"]


# --------------------------------------------------------------------------- slices


def test_a_rounds_slices_are_written_whole_owned_by_the_run_and_kept_as_told() -> None:
    b = bed()
    run = b.run()
    assert run.uid is not None
    b.carry_out(run, Plan(tell=[piece(1, ("a", told(rank=0)), ("b", told(rank=1))),
                                piece(7, ("c", told(rank=2)))]))
    assert (place_in(b, 1, "a"), place_in(b, 1, "b")) == (told(rank=0), told(rank=1))
    assert place_in(b, 7, "c") == told(rank=2) and place_in(b, 7, "a") is None
    stored = b.server.objects[b.server.key_of(slice_path("ns", slice_name(run.uid, 7)))]
    assert stored["metadata"]["ownerReferences"] == [{
        "apiVersion": crd.API_VERSION, "kind": crd.KIND, "name": "r", "uid": run.uid,
        "blockOwnerDeletion": False}]
    assert stored["metadata"]["labels"][crd.RUN_LABEL] == "r"
    assert b.executor.state(KEY).done.slices_told(2) == {1, 7}
    # The next round's slice replaces the whole slice: a place of round 2 is gone.
    b.carry_out(run, Plan(tell=[piece(1, ("b", told(rank=0, round_=3)))]))
    assert place_in(b, 1, "a") is None and place_in(b, 1, "b") == told(rank=0, round_=3)
    assert b.executor.state(KEY).done.slices_told(3) == {1}
    assert b.executor.state(KEY).done.slices_told(2) == frozenset()


def test_a_slice_that_failed_is_not_kept_as_told_and_its_run_is_reconciled_again() -> None:
    b = bed()
    run = b.run()
    b.access.fail_next("apply")
    b.carry_out(run, Plan(tell=[piece(1, ("a", told()))]))
    assert place_in(b, 1, "a") is None
    # The failed write brings no event: the executor asks for the next pass itself.
    assert b.retried == [(KEY, ASSIGN_RETRY_SECONDS)]
    assert b.executor.state(KEY).done.slices_told(2) == frozenset()
    b.carry_out(run, Plan(tell=[piece(1, ("a", told()))]))
    assert place_in(b, 1, "a") == told()
    assert b.executor.state(KEY).done.slices_told(2) == {1}
    assert b.retried == [(KEY, ASSIGN_RETRY_SECONDS)]  # nothing failed since


# --------------------------------------------------------------------------- Lease deletions


def test_lease_deletions_name_the_observed_uid_and_spare_what_is_not_the_runs() -> None:
    b = bed()
    leases = {"a": b.lease("a"), "c": b.lease("c"), "x": b.lease("x", owner_uid="uid-other")}
    replaced = b.replace_lease("c")
    run = b.run()
    b.carry_out(run, Plan(delete_leases=["a", "c", "x", "ghost"]), leases)
    assert b.stored_lease("a") is None
    assert b.stored_lease("c") == replaced  # another object now: the server said 409
    assert b.stored_lease("x") is not None  # not the run's own: never asked to delete
    assert b.access.calls["delete"] == 2
    # A 409 is the end of it: no back-off kept, no Warning.
    assert b.executor.state(KEY).delete_failures == {} and b.reasons() == []


# --------------------------------------------------------------------------- the TTL deletion


def _finished(b: Bed) -> None:
    finished = RunStatus(phase="Closed", finished_at=T0 - dt.timedelta(seconds=1)).to_dict()
    b.server.update((RUN, "r"), lambda run: {**run, "status": finished,
                                             "spec": {**run["spec"], "closed": True}})


def test_a_deletion_posts_its_events_first_then_deletes_leases_objects_and_the_run_last() -> None:
    b = bed(RunSpec(min_nodes=1, max_nodes=4, ttl_seconds_after_finished=0),
            annotations=ACCOUNT)
    live = b.run()
    setup = reconcile(live, Members(), T0, BOTH)
    b.carry_out(live, dataclasses.replace(setup, status=None))  # its Role, its NetworkPolicy
    for node in ("a", "b"):
        b.lease(node)
    b.lease("x", owner_uid="uid-other")
    _finished(b)
    run = b.run()
    plan = reconcile(run, Members(), T0, BOTH, b.executor.state(KEY).done)
    assert plan.delete_run and [e[1] for e in plan.events] == ["Deleted"]
    assert plan.apply == [] and len(plan.delete_objects) == 3
    since = b.revision()
    assert b.carry_out(run, plan) is None
    writes = b.writes(since)
    assert writes[0][0] == "created" and writes[0][1].endswith("/events")
    assert b.reasons() == ["Deleted"]
    deleted = [b.server.key_of(path) for path in plan.delete_objects]
    assert sorted(writes[1:3]) == [("deleted", LEASE, lease_name("r", n)) for n in "ab"]
    assert writes[3:] == [("deleted", kind, name) for kind, name in deleted] + [
        ("deleted", RUN, "r")]
    assert b.stored_lease("x") is not None  # not the run's own


# --------------------------------------------------------------------------- applied objects


def test_an_object_is_kept_as_applied_only_once_its_apply_took() -> None:
    b = bed(annotations=ACCOUNT)
    leases = {"a": b.lease("a")}
    run = b.run()
    members = Members(leases=leases)
    plan = reconcile(run, members, T0, BOTH)
    assert [item.slot for item in plan.apply] == ["policy", "rbac"]
    # The NetworkPolicy's apply takes, the Role's fails (the server unreachable).
    b.access.on_next("apply", lambda: None)
    b.access.on_next("apply", lambda: b.access.fail_next("apply"))
    with pytest.raises(ApiConnectionError):
        b.carry_out(run, plan, leases)
    policy, rbac = plan.apply
    assert holds(b, *policy.manifests[0])
    assert b.server.key_of(rbac.manifests[0][0]) not in b.server.objects
    done = b.executor.state(KEY).done
    assert (done.policy, done.rbac) == (policy.fingerprint, None)
    # The next pass applies what did not take, and only that.
    retry = reconcile(run, members, T0, BOTH, done)
    assert retry.apply == [rbac]
    b.carry_out(run, retry, leases)
    assert all(holds(b, path, manifest) for path, manifest in rbac.manifests)
    done = b.executor.state(KEY).done
    assert (done.policy, done.rbac) == (policy.fingerprint, rbac.fingerprint)
    assert reconcile(run, members, T0, BOTH, done).apply == []
