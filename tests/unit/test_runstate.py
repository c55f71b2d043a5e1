"""One state object per run: a deleted run leaves nothing of itself in the controller."""

from __future__ import annotations

import asyncio
from typing import Any

from elasticrun.api import crd
from elasticrun.operator.controller import Controller
from elasticrun.operator.metrics import Metrics
from elasticrun.operator.runstate import RunState

from builders import idle_client


def _pod(name: str, phase: str = "Running", **spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}",
                         "labels": {crd.RUN_LABEL: "r"}},
            "spec": spec, "status": {"phase": phase}}


def test_a_deleted_run_is_forgotten_in_one_pop_and_its_pods_alone_keep_no_state() -> None:
    async def scenario() -> None:
        controller = Controller(idle_client(), Metrics(), topology_keys=("zone",))
        run = {"metadata": {"name": "r", "namespace": "ns", "uid": "u1",
                            "resourceVersion": "1"}, "spec": {"minNodes": 1}}
        controller.run_event("ADDED", run)
        controller.pod_event("ADDED", _pod("p0", nodeName="n1"))
        controller.pod_event("MODIFIED", _pod("p1", phase="Failed", nodeName="n1"))
        state = controller.states[("ns", "r")]
        assert state.held and state.pod_nodes == {"p0": "n1", "p1": "n1"}
        assert list(state.pod_losses) == [("p1", "uid-p1")]
        controller.run_event("DELETED", run)
        assert controller.states == {}
        await controller.stop()
        # Pods of a run the operator does not hold: kept while they say something,
        # dropped once they say nothing.
        plain = Controller(idle_client(), Metrics())
        plain.pod_event("ADDED", _pod("p0"))
        assert plain.states == {}
        plain.pod_event("MODIFIED", _pod("p0", phase="Failed"))
        assert not plain.states[("ns", "r")].held
        plain.pod_event("MODIFIED", _pod("p0"))
        assert plain.states == {}
        await plain.stop()

    asyncio.run(scenario())


def test_a_state_without_the_run_or_pod_facts_is_idle() -> None:
    assert RunState().idle and not RunState().held
    assert not RunState(raw={}).idle
    assert not RunState(pod_nodes={"p": "n"}).idle
    first, second = RunState(), RunState()
    first.delete_failures["uid-a"] = (1, 0.0)
    assert second.delete_failures == {}  # no shared default


def test_the_response_of_a_status_write_never_hides_a_newer_watched_copy() -> None:
    """The watch can deliver a user's change (resourceVersion 3) before the response
    of the operator's status write (2) reaches the reconcile that made it: the run is
    reconciled again from 3, not from the older written copy."""
    async def scenario() -> None:
        controller = Controller(idle_client(), Metrics())
        key = ("ns", "r")

        def copy(version: str, closed: bool) -> dict[str, Any]:
            return {"metadata": {"name": "r", "namespace": "ns", "uid": "u1",
                                 "resourceVersion": version},
                    "spec": {"minNodes": 1, "closed": closed}}

        controller.run_event("ADDED", copy("1", False))
        controller.run_event("MODIFIED", copy("3", True))
        controller.executor.accept(key, copy("2", False))  # the write's late response
        held = controller.states[key].raw
        assert held is not None and held["metadata"]["resourceVersion"] == "3"
        assert held["spec"]["closed"] is True
        # An older event is not kept either; a newer written copy is.
        controller.run_event("MODIFIED", copy("2", False))
        assert controller.states[key].raw == copy("3", True)
        controller.executor.accept(key, copy("4", True))
        assert controller.states[key].raw == copy("4", True)
        await controller.stop()

    asyncio.run(scenario())
