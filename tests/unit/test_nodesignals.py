"""Node signals as pure decisions: what a Node shows, which policy wins, what a run does."""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticrun.api import rounds
from elasticrun.api.leases import LeaseState
from elasticrun.api.model import ElasticRun, RunStatus, WaitingNode
from elasticrun.operator import nodesignals as ns
from elasticrun.operator.metrics import Metrics
from elasticrun.operator.reconcile import NODE_SIGNALS_CONDITION, Members, reconcile

from builders import T0, running_run

CORDON = ns.Signal("taint", "node.kubernetes.io/unschedulable", policy="exclude")
SPOT = ns.Signal("taint", "example.com/spot-itn", policy="drain")
MAINTENANCE = ns.Signal("label", "cloud.google.com/scheduled-maintenance-time")
GPU = ns.Signal("condition", "GPUHealthy", "False", "exclude")
SIGNALS = (CORDON, SPOT, MAINTENANCE, GPU)


def node(taints: Any = (), labels: Any = None, conditions: Any = ()) -> dict[str, Any]:
    return {"metadata": {"name": "n1", "labels": labels or {}},
            "spec": {"taints": list(taints)}, "status": {"conditions": list(conditions)}}


def test_a_node_shows_the_configured_taints_labels_and_conditions() -> None:
    body = node(taints=[{"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"},
                        {"key": "other", "effect": "NoSchedule"}],
                labels={"cloud.google.com/scheduled-maintenance-time": "1700000000"},
                conditions=[{"type": "GPUHealthy", "status": "False"},
                            {"type": "Ready", "status": "True"}])
    assert ns.shown(SIGNALS, ns.read_node(body)) == (CORDON, MAINTENANCE, GPU)
    healthy = node(conditions=[{"type": "GPUHealthy", "status": "True"}])
    assert ns.shown(SIGNALS, ns.read_node(healthy)) == ()


def test_a_value_must_match_when_the_signal_names_one() -> None:
    spot = ns.Signal("taint", "kubernetes.azure.com/scalesetpriority", "spot")
    assert ns.shown([spot], ns.read_node(node(taints=[
        {"key": "kubernetes.azure.com/scalesetpriority", "value": "spot"}]))) == (spot,)
    assert ns.shown([spot], ns.read_node(node(taints=[
        {"key": "kubernetes.azure.com/scalesetpriority", "value": "regular"}]))) == ()
    # A condition without a value means status True.
    ready = ns.Signal("condition", "MemoryPressure")
    assert ns.shown([ready], ns.read_node(node(conditions=[
        {"type": "MemoryPressure", "status": "True"}]))) == (ready,)


@pytest.mark.parametrize(("policies", "wins"), [
    ((), None), (("observe",), "observe"), (("observe", "exclude"), "exclude"),
    (("drain", "observe"), "drain"), (("exclude", "drain", "observe"), "drain"),
])
def test_the_strongest_policy_wins(policies: tuple[ns.Policy, ...], wins: str | None) -> None:
    signals = [ns.Signal("taint", f"k{i}", policy=p) for i, p in enumerate(policies)]
    assert ns.strongest(signals) == wins


def test_absurd_nodes_are_bounded_and_never_raise() -> None:
    many = node(taints=[{"key": f"t{i}"} for i in range(10_000)],
                labels={f"l{i}": "v" for i in range(10_000)},
                conditions=[{"type": f"C{i}", "status": "True"} for i in range(10_000)])
    facts = ns.read_node(many)
    assert (len(facts.taints), len(facts.labels), len(facts.conditions)) == (
        ns.MAX_TAINTS, ns.MAX_LABELS, ns.MAX_CONDITIONS)
    long_key = "k" * 100_000
    assert ns.read_node(node(taints=[{"key": long_key}], labels={long_key: "v"})) == ns.NodeFacts()
    long_value = ns.read_node(node(labels={"l": "v" * 10_000}))
    assert long_value.labels == {"l": ""}
    junk: Any
    for junk in (None, 3, "x", [], {"spec": {"taints": "no"}}, {"metadata": {"labels": [1]}},
                 {"spec": {"taints": [None, 1, {"key": 5}]}},
                 {"status": {"conditions": {"type": "GPUHealthy"}}}):
        assert ns.shown(SIGNALS, ns.read_node(junk)) == ()


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                    lambda kids: st.lists(kids, max_size=4)
                    | st.dictionaries(st.sampled_from(
                        ["metadata", "spec", "status", "labels", "taints", "conditions",
                         "key", "value", "type", "status", "name"]), kids, max_size=4),
                    max_leaves=30))
def test_any_node_body_reads_without_error(body: Any) -> None:
    facts = ns.read_node(body)
    assert ns.strongest(ns.shown(SIGNALS, facts)) in (None, *ns.POLICIES)


def test_signals_are_parsed_and_a_later_one_replaces_a_default() -> None:
    assert ns.parse_signal("condition:GPUHealthy=False:drain") == ns.Signal(
        "condition", "GPUHealthy", "False", "drain")
    assert ns.parse_signal("taint:example.com/spot:exclude") == ns.Signal(
        "taint", "example.com/spot", None, "exclude")
    chosen = ns.configured(["taint:node.kubernetes.io/unschedulable:drain"], defaults=True)
    cordon = [s for s in chosen if s.key == "node.kubernetes.io/unschedulable"]
    assert cordon == [ns.Signal("taint", "node.kubernetes.io/unschedulable", None, "drain")]
    assert len(chosen) == len(ns.DEFAULT_SIGNALS)
    assert ns.configured([], defaults=False) == ()
    for bad in ("taint:k", "pod:k:drain", "taint:k:evict", ":k:drain", "taint::drain",
                f"label:{'k' * 400}:observe"):
        with pytest.raises(ns.SignalError, match=r"KIND:KEY|characters"):
            ns.parse_signal(bad)
    with pytest.raises(ns.SignalError, match="at most"):
        ns.configured([f"label:k{i}:observe" for i in range(ns.MAX_SIGNALS + 1)], False)


def test_a_flapping_signal_is_one_change_per_hold() -> None:
    memory = ns.SignalMemory(hold=10)
    at = T0
    changes = 0
    for i in range(200):  # on and off every 50 ms for 10 s
        at = T0 + dt.timedelta(milliseconds=50 * i)
        changes += memory.observe("n1", (CORDON,) if i % 2 == 0 else (), at)
    assert changes == 1 and memory.showing("n1", at) == (CORDON,)
    gone = memory.expires("n1", at)
    assert gone is not None and gone > at
    assert memory.showing("n1", gone) == ()
    # Shown without a further event for an hour: still showing.
    memory.observe("n2", (SPOT,), T0)
    assert memory.showing("n2", T0 + dt.timedelta(hours=1)) == (SPOT,)
    assert memory.expires("n2", T0 + dt.timedelta(hours=1)) is None
    # Gone and past its hold: forgotten at the next event, memory bounded.
    memory.observe("n2", (), T0)
    memory.observe("n2", (), T0 + dt.timedelta(seconds=11))
    assert memory.showing("n2", T0 + dt.timedelta(seconds=11)) == ()
    assert "n2" not in memory._seen


def _run_with_spares(**status: Any) -> ElasticRun:
    waiting = (WaitingNode("d", "10.0.0.4", 4, since=T0, pod="d"),
               WaitingNode("e", "10.0.0.5", 5, since=T0, pod="e"))
    return running_run(waiting=waiting, **status)


def test_drain_removes_the_member_at_once_and_holds_it_back_with_the_exclusion() -> None:
    run = running_run()
    shown = {"b": ns.Shown("node-b", (SPOT, MAINTENANCE))}
    plan = reconcile(run, Members(node_signals=shown), T0)
    assert plan.status is not None
    assert plan.status.member_names == {"a", "c"} and plan.status.degraded
    lost = plan.status.lost_members[-1]
    assert (lost.name, lost.reason) == ("b", "NodeDraining")
    assert "node-b" in (lost.message or "") and "example.com/spot-itn" in (lost.message or "")
    assert plan.status.excluded_pods == ("b",)
    condition = plan.status.condition(NODE_SIGNALS_CONDITION)
    assert condition is not None and condition.status == "True"
    assert "b: Node node-b shows" in (condition.message or "")
    assert "pod b: Node node-b" in (lost.message or "")
    # b comes back as waiting: the survivors' round is sealed without it.
    back = run.replace_status(plan.status.replace(waiting=(
        WaitingNode("a", "10.0.0.1", 1, since=T0, pod="a"),
        WaitingNode("b", "10.0.0.2", 2, since=T0, pod="b"),
        WaitingNode("c", "10.0.0.3", 3, since=T0, pod="c"))))
    assert rounds.decide_seal(back, T0).seal_now
    sealed = rounds.seal_round(back, T0)
    assert {p.name: p.rank for p in sealed.participants} == {"a": 0, "c": 1}
    assert sealed.waiting_names == {"b"}


def test_a_namesake_pod_on_a_signalled_node_drains_or_holds_back_no_node_without_a_pod(
) -> None:
    """A member or spare that named no Pod is on no Node: a Pod of its node name, made
    by anyone who may create Pods on a draining or excluded Node, changes nothing."""
    podless = tuple(dataclasses.replace(p, pod=None) for p in running_run().status.participants)
    spare = WaitingNode("d", "10.0.0.4", 4, since=T0)
    run = running_run(participants=podless, waiting=(spare,))
    shown = {"b": ns.Shown("node-b", (SPOT,)), "d": ns.Shown("node-d", (SPOT,))}
    plan = reconcile(run, Members(node_signals=shown), T0)
    assert plan.status is not None
    assert plan.status.member_names == {"a", "b", "c"} and plan.status.lost_members == ()
    assert run.replace_status(plan.status).held_back(plan.status.waiting) == frozenset()
    # The excluded pods are still the Pods' (a node that named pod "d" is held back).
    named = WaitingNode("e", "10.0.0.5", 5, since=T0, pod="d")
    assert run.replace_status(plan.status).held_back((spare, named)) == {"e"}


def test_exclude_keeps_a_spare_waiting_while_another_is_admitted() -> None:
    members = running_run().status.participants[:2]
    back = tuple(WaitingNode(p.name, "10.0.0.1", 1 + p.rank, since=T0, pod=p.name)
                 for p in members)
    run = _run_with_spares(participants=members, restart_round=1)
    run = run.replace_status(run.status.replace(waiting=back + run.status.waiting,
                                                excluded_pods=("d",)))
    assert rounds.decide_seal(run, T0).seal_now
    sealed = rounds.seal_round(run, T0)
    assert [p.name for p in sorted(sealed.participants, key=lambda p: p.rank)] == ["a", "b", "e"]
    assert sealed.waiting_names == {"d"}
    assert [w.name for w in rounds.eligible_waiting(run)] == ["a", "b", "e"]
    # Without the exclusion d, the earlier arrival by name, takes the place.
    free = rounds.seal_round(run.replace_status(run.status.replace(excluded_pods=())), T0)
    assert sealed.waiting_names != free.waiting_names == {"e"}


def test_a_node_on_an_excluded_pod_is_held_back_whatever_its_name() -> None:
    run = _run_with_spares(participants=running_run().status.participants[:2],
                           restart_round=1)
    renamed = (WaitingNode("a", "10.0.0.1", 1, since=T0, pod="a"),
               WaitingNode("b", "10.0.0.2", 2, since=T0, pod="b"),
               WaitingNode("node-x", "10.0.0.4", 4, since=T0, pod="d"))
    run = run.replace_status(run.status.replace(waiting=renamed, excluded_pods=("d",)))
    assert [w.name for w in rounds.eligible_waiting(run)] == ["a", "b"]
    # A member on an excluded pod is not waited for when the round re-forms.
    held = run.replace_status(run.status.replace(excluded_pods=("b",),
                                                 waiting=renamed[:1]))
    assert not rounds.decide_seal(held, T0).seal_now  # one of minNodes 2 eligible
    assert run.held_back(run.status.participants) == frozenset()
    assert held.held_back(held.status.participants) == {"b"}


def test_exclude_is_written_for_waiting_nodes_and_members_but_nobody_leaves() -> None:
    run = dataclasses.replace(_run_with_spares(), uid="uid-r")
    leases = {w.name: LeaseState(node=w.name, holder=w.name, renewed=T0, duration=15,
                                 join=w, seen=T0, owner_uid="uid-r")
              for w in run.status.waiting}
    shown = {"d": ns.Shown("node-d", (CORDON,)), "a": ns.Shown("node-a", (GPU,)),
             "c": ns.Shown("node-c", (MAINTENANCE,)), "gone": ns.Shown("x", (SPOT,))}
    plan = reconcile(run, Members(leases=leases, node_signals=shown), T0)
    assert plan.status is not None
    # Observe is not held; a pod of the run whose node has not joined yet is.
    assert plan.status.excluded_pods == ("a", "d", "gone")
    assert plan.status.member_names == {"a", "b", "c"} and not plan.status.degraded


def test_the_exclusion_and_condition_clear_when_the_node_shows_nothing() -> None:
    run = running_run()
    held = reconcile(run, Members(node_signals={"a": ns.Shown("n", (CORDON,))}), T0).status
    assert held is not None and held.excluded_pods == ("a",)
    cleared = reconcile(run.replace_status(held), Members(node_signals={}), T0).status
    assert cleared is not None and cleared.excluded_pods == ()
    condition = cleared.condition(NODE_SIGNALS_CONDITION)
    assert condition is not None and condition.status == "False"
    # Off: the operator leaves the field alone and adds no condition.
    off = reconcile(running_run(excluded_pods=("a",)), Members(), T0)
    assert off.status is None or off.status.excluded_pods == ("a",)
    untouched = reconcile(running_run(), Members(), T0).status
    assert untouched is None or untouched.condition(NODE_SIGNALS_CONDITION) is None


def test_the_excluded_pods_round_trip_through_the_status() -> None:
    status = RunStatus(excluded_pods=("a", "b"))
    assert RunStatus.from_dict(status.to_dict()).excluded_pods == ("a", "b")
    assert "excludedNodes" not in RunStatus().to_dict()


def test_the_signal_gauge_names_configured_signals_and_drops_cleared_ones() -> None:
    metrics = Metrics()
    shown = {"a": ns.Shown("n", (CORDON, SPOT)), "b": ns.Shown("m", (CORDON,))}
    metrics.node_signals("ns", "r", ns.counts(shown))

    def value(signal: str) -> float | None:
        return metrics.registry.get_sample_value(
            "elasticrun_node_signals", {"namespace": "ns", "run": "r", "signal": signal})

    assert value(CORDON.name) == 2 and value(SPOT.name) == 1
    metrics.node_signals("ns", "r", ns.counts({"a": ns.Shown("n", (SPOT,))}))
    assert value(CORDON.name) is None and value(SPOT.name) == 1
    metrics.forget("ns", "r")
    assert value(SPOT.name) is None
