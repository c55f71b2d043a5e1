"""When the operator lists a run's Leases before it acts (``Controller.reconcile``).

Its Lease index comes from another watch than the run and may lag behind it,
so a plan that acts on what the Leases say (a seal, a removal for a Lease's
silence) is decided again from a consistent listing.  A member whose Pod is
gone is removed as decided: every survivor waits for that write, and the
decision reads no Lease.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Mapping
from typing import Any

from elasticrun.api import crd
from elasticrun.api.leases import LeaseState, lease_state, node_lease
from elasticrun.api.model import ElasticRun, RunSpec, new_run_manifest, now
from elasticrun.operator.controller import Controller
from elasticrun.operator.metrics import Metrics
from elasticrun.operator.reconcile import Plan

from builders import idle_client, running_run

KEY = ("ns", "r")
UID = "run-uid"
HEARTBEAT = 10


def _decided(lost_pod: str | None, silent: str | None) -> tuple[int, Plan, set[str]]:
    """One pass over a running round of a, b, c: how often it listed the Leases first, its
    plan, and the Leases the plan was decided from (which it deletes and writes).

    ``lost_pod``: that member's Pod was deleted.  ``silent``: that member's Lease
    has not changed for longer than the heartbeat, as the operator saw it.
    """
    listings: list[Any] = []
    plans: list[tuple[Plan, set[str]]] = []

    async def scenario() -> None:
        controller = Controller(idle_client(), Metrics())
        run = running_run(RunSpec(min_nodes=2, max_nodes=3, heartbeat_timeout=HEARTBEAT))
        manifest = new_run_manifest("r", "ns", run.spec)
        manifest["metadata"].update(uid=UID, resourceVersion="7")
        manifest["status"] = run.status.to_dict()
        controller.run_event("ADDED", manifest)
        leases = {node: lease_state(_namespaced(node_lease("r", node, node, HEARTBEAT, UID,
                                                           now()))) for node in "abc"}
        held = controller.held(KEY)
        assert held is not None
        if silent is not None:  # first seen by the operator long ago, unchanged since
            long_ago = now() - dt.timedelta(seconds=2 * HEARTBEAT)
            controller.api.record(False, long_ago)  # the API server reachable since then
            controller.api.record(True, long_ago)
            held.renewals.observe(silent, leases[silent], long_ago)
        controller.lease_index = {KEY: list(leases.items())}
        if lost_pod is not None:
            controller.pod_event("DELETED", {"metadata": {
                "name": lost_pod, "namespace": "ns", "uid": f"uid-{lost_pod}",
                "labels": {crd.RUN_LABEL: "r"}}})

        async def listed(key: tuple[str, str], uid: str | None) -> dict[str, LeaseState]:
            listings.append((key, uid))
            return leases

        async def carry_out(run: ElasticRun, plan: Plan,
                            leases: Mapping[str, LeaseState] | None = None) -> ElasticRun | None:
            plans.append((plan, set(leases or {})))
            return None

        controller._listed_leases = listed  # type: ignore[method-assign]
        controller.executor.carry_out = carry_out  # type: ignore[method-assign]
        await controller.reconcile(KEY)
        await controller.stop()

    asyncio.run(scenario())
    assert len(plans) == 1
    return len(listings), *plans[0]


def _namespaced(lease: dict[str, Any]) -> dict[str, Any]:
    """The Lease as the API server stores it."""
    meta = lease["metadata"]
    meta.update(namespace="ns", uid=f"lease-uid-{meta['name']}", resourceVersion="5")
    return lease


def test_a_member_whose_pod_is_gone_is_removed_without_listing_the_leases() -> None:
    listed, plan, leases = _decided(lost_pod="b", silent=None)
    assert listed == 0 and leases == {"a", "b", "c"}  # from the index
    assert plan.status is not None and plan.status.member_names == {"a", "c"}
    assert plan.status.lost_members[-1].reason == "PodDeleted"
    assert plan.delete_leases == ["b"]


def test_a_member_whose_lease_went_silent_is_removed_as_a_listing_of_the_leases_says() -> None:
    """The control: the same removal for a Lease's silence lists the Leases first."""
    listed, plan, _ = _decided(lost_pod=None, silent="b")
    assert listed == 1
    assert plan.status is not None and plan.status.member_names == {"a", "c"}
    assert plan.status.lost_members[-1].reason == "LeaseExpired"


def test_nothing_lost_nothing_listed() -> None:
    listed, plan, _ = _decided(lost_pod=None, silent=None)
    assert listed == 0
    assert plan.status is None or plan.status.member_names == {"a", "b", "c"}
