"""The operator's plan carries everything it does; the executor only carries it out.

Its own objects (Role, RoleBinding, NetworkPolicy), the problem Events, the
repair of an unreadable status and the TTL deletion with its ``Deleted`` Event
are decided by the pure :func:`reconcile` (:mod:`elasticrun.operator.runobjects`)
from what the operator already did for the run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
from typing import Any

from elasticrun.api.gateway import OperatorGateway
from elasticrun.api.leases import LeaseState
from elasticrun.api.model import ElasticRun, InvalidRunError, RunSpec, RunStatus
from elasticrun.api.naming import lease_name
from elasticrun.operator import netpol, runobjects, runrbac
from elasticrun.operator.executor import PlanExecutor
from elasticrun.operator.reconcile import Members, plan_repair, reconcile, repair_due
from elasticrun.operator.runobjects import (
    PROBLEM_EVENTS_PER_RUN,
    UNREADABLE_JOIN,
    Done,
    Problems,
    Settings,
    report,
)

from builders import T0

BOTH = Settings(per_run_rbac=True, store_policy_port=29500)
ACCOUNT = {runrbac.SERVICE_ACCOUNT_ANNOTATION: "trainer"}


def _run(annotations: dict[str, str] | None = None, **status: Any) -> ElasticRun:
    return ElasticRun("r", "ns", RunSpec(min_nodes=1, max_nodes=3, ttl_seconds_after_finished=0),
                      RunStatus(**status), "7", uid="uid-r", annotations=annotations or {})


def _lease(node: str, problem: str | None = None) -> LeaseState:
    return LeaseState(node=node, holder=node, renewed=T0, duration=5, owner_uid="uid-r",
                      name=lease_name("r", node), uid=f"uid-{node}", seen=T0, problem=problem)


def _applied(done: Done, plan_apply: list[runobjects.Apply]) -> Done:
    for item in plan_apply:
        done = done.applied(item)
    return done


def test_the_runs_objects_are_planned_once_until_they_change() -> None:
    run = _run(ACCOUNT)
    plan = reconcile(run, Members(leases={"a": _lease("a")}), T0, BOTH)
    assert [a.slot for a in plan.apply] == ["policy", "rbac"]
    paths = [path for a in plan.apply for path, _ in a.manifests]
    assert paths == [netpol.path("ns", "r"), runrbac.path("Role", "ns", "r"),
                     runrbac.path("RoleBinding", "ns", "r")]
    done = _applied(Done(), plan.apply)
    assert reconcile(run, Members(leases={"a": _lease("a")}), T0, BOTH, done).apply == []
    # A new Lease changes the Role only.
    again = reconcile(run, Members(leases={"a": _lease("a"), "b": _lease("b")}), T0, BOTH,
                      done)
    assert [a.slot for a in again.apply] == ["rbac"]
    # Without the flags, nothing beside the run.
    assert reconcile(run, Members(), T0).apply == []


def test_an_invalid_service_account_is_one_event_and_no_role() -> None:
    run = _run({runrbac.SERVICE_ACCOUNT_ANNOTATION: "Not A Name"})
    plan = reconcile(run, Members(), T0, BOTH)
    assert [a.slot for a in plan.apply] == ["policy"]
    assert [e[1] for e in plan.report.events] == ["InvalidServiceAccount"]
    done = Done(problems=plan.report.problems)
    assert reconcile(run, Members(), T0, BOTH, done).report.events == []


def test_unreadable_joins_are_reported_once_each_up_to_the_cap_then_summarised() -> None:
    leases = {f"n{i}": _lease(f"n{i}", problem=f"n{i}: unreadable")
              for i in range(PROBLEM_EVENTS_PER_RUN + 5)}
    plan = reconcile(_run(), Members(leases=leases), T0)
    reasons = [e[1] for e in plan.report.events]
    assert reasons == [UNREADABLE_JOIN] * (PROBLEM_EVENTS_PER_RUN + 1)
    assert "further ones are only logged" in plan.report.events[-1][2]
    assert len(plan.report.logged) == 5
    done = Done(problems=plan.report.problems)
    assert reconcile(_run(), Members(leases=leases), T0, BOTH, done).report.events == []
    # Leases gone: their problems are forgotten (after this pass, which still counts
    # them), and the next pass reports a new one again.
    fresh = {"x": _lease("x", problem="x: unreadable")}
    later = reconcile(_run(), Members(leases=fresh), T0, BOTH, done)
    assert later.report.events == [] and later.report.logged == ["x: unreadable"]
    assert later.report.problems == Problems()
    again = reconcile(_run(), Members(leases=fresh), T0, BOTH,
                      Done(problems=later.report.problems))
    assert again.report.events == [("Warning", UNREADABLE_JOIN, "x: unreadable")]
    assert set(again.report.problems.reported) == {(UNREADABLE_JOIN, "x")}


def test_a_problem_that_went_away_is_reported_anew_when_it_comes_back() -> None:
    first = report(Problems(), UNREADABLE_JOIN, {"a": "bad"})
    assert len(first.events) == 1
    assert report(first.problems, UNREADABLE_JOIN, {"a": "worse"}).events == []
    gone = report(first.problems, UNREADABLE_JOIN, {"a": None})
    assert len(report(gone.problems, UNREADABLE_JOIN, {"a": "bad"}).events) == 1


def test_the_ttl_deletion_plans_its_deleted_event_and_the_runs_objects() -> None:
    run = _run(phase="Closed", finished_at=T0 - dt.timedelta(seconds=1))
    run = dataclasses.replace(run, spec=dataclasses.replace(run.spec, closed=True))
    plan = reconcile(run, Members(), T0, BOTH)
    assert plan.delete_run
    assert [e[1] for e in plan.events] == ["Deleted"]
    assert plan.delete_objects == [runrbac.path("RoleBinding", "ns", "r"),
                                   runrbac.path("Role", "ns", "r"), netpol.path("ns", "r")]
    assert reconcile(run, Members(), T0).delete_objects == []


def test_the_same_invalid_status_is_repaired_once() -> None:
    raw = {"metadata": {"name": "r", "namespace": "ns", "generation": 4},
           "status": {"round": "x"}}
    error = InvalidRunError("status.round", "not a number")
    fix = plan_repair(raw, error, T0, 2)
    assert fix.status["round"] == 2 and fix.status["observedGeneration"] == 4
    assert fix.event[:2] == ("Warning", "InvalidStatus")
    assert repair_due(error, None)
    assert not repair_due(error, str(error))
    assert repair_due(InvalidRunError("status.signal", "other"), str(error))


class _Client:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def request(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        self.calls.append((method, path))
        return {"items": []} if method == "GET" else {}


class _Observer:
    def __init__(self) -> None:
        self.events: list[str] = []

    async def post_event(self, run: ElasticRun, type_: str, reason: str, message: str) -> None:
        self.events.append(reason)


def test_the_executor_posts_the_planned_deleted_event_then_deletes_what_the_plan_says() -> None:
    client, observer = _Client(), _Observer()
    executor = PlanExecutor(OperatorGateway(client), observer,  # type: ignore[arg-type]
                            lambda k, r: None, lambda k: None)
    run = _run(phase="Closed", finished_at=T0 - dt.timedelta(seconds=1))
    run = dataclasses.replace(run, spec=dataclasses.replace(run.spec, closed=True))
    plan = reconcile(run, Members(), T0, BOTH)
    assert asyncio.run(executor.carry_out(run, plan)) is None
    assert observer.events == ["Deleted"]
    deleted = [path for method, path in client.calls if method == "DELETE"]
    assert deleted[:-1] == plan.delete_objects and deleted[-1].endswith("/elasticruns/r")
    # The executor applies exactly what the plan names, and keeps it as applied.
    client.calls.clear()
    live = _run(ACCOUNT)
    plan = reconcile(live, Members(), T0, BOTH)
    asyncio.run(executor.carry_out(live, dataclasses.replace(plan, status=None)))
    patched = [path for method, path in client.calls if method == "PATCH"]
    assert patched == [path for a in plan.apply for path, _ in a.manifests]
    assert executor.state(("ns", "r")).done == _applied(Done(), plan.apply)
