"""Topology-ordered ranks, the operator's half: a Node's values for the keys, the waiting
summary that carries them, and the ranks a sealer gives from it."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticrun.api.leases import LeaseState
from elasticrun.api.model import ElasticRun, RunSpec, RunStatus, WaitingNode
from elasticrun.operator import topology
from elasticrun.operator.reconcile import SEAL_GRACE, Members, reconcile

from builders import T0, idle_client

ZONE, HOST = "topology.kubernetes.io/zone", "kubernetes.io/hostname"
KEYS = (ZONE, HOST)


def node(name: str = "n1", **labels: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels}}


def test_a_nodes_values_follow_the_keys_order_and_a_missing_key_is_empty() -> None:
    body = {"metadata": {"labels": {HOST: "h1", ZONE: "zone-a", "other": "x"}}}
    assert topology.node_topology(body, KEYS) == ("zone-a", "h1")
    assert topology.node_topology(body, (HOST, ZONE)) == ("h1", "zone-a")
    assert topology.node_topology({"metadata": {"labels": {HOST: "h1"}}}, KEYS) == ("", "h1")
    # A Node with none of the keys is of an unknown domain: no values (ranked last).
    assert topology.node_topology({"metadata": {"labels": {"other": "x"}}}, KEYS) == ()
    assert topology.node_topology({"metadata": {"labels": {ZONE: "a"}}}, ()) == ()


def test_untrusted_values_are_bounded_and_never_raise() -> None:
    labels = {ZONE: "z" * 64, HOST: 7, "k3": "v3", "k4": "v4", "k5": "v5"}
    keys = (ZONE, HOST, "k3", "k4", "k5")
    # A value longer than a label's 63 characters or not a string is no value;
    # at most 4 keys are read (what a waiting entry keeps).
    assert topology.node_topology({"metadata": {"labels": labels}}, keys) == ("", "", "v3", "v4")
    for body in (None, [], "x", {"metadata": []}, {"metadata": {"labels": ["a"]}}):
        assert topology.node_topology(body, KEYS) == ()


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=70),
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.sampled_from(["metadata", "labels", ZONE, HOST]),
                                      inner, max_size=4), max_leaves=20))
def test_any_node_body_reads_to_bounded_values(body: Any) -> None:
    values = topology.node_topology(body, KEYS)
    assert len(values) in (0, 2) and all(isinstance(v, str) and len(v) <= 63 for v in values)


def test_keys_are_parsed_bounded_and_empty_means_off() -> None:
    assert topology.parse_keys("") == ()
    assert topology.parse_keys(f" {ZONE} , {HOST} ") == KEYS
    with pytest.raises(topology.TopologyKeyError, match="at most 4 keys, 5 given"):
        topology.parse_keys("a,b,c,d,e")
    with pytest.raises(topology.TopologyKeyError, match="named twice"):
        topology.parse_keys(f"{ZONE},{ZONE}")
    with pytest.raises(topology.TopologyKeyError, match=r"a label key of 1\.\.317"):
        topology.parse_keys("k" * 318)


def test_entries_get_their_pods_values_and_a_namesake_pod_gets_none() -> None:
    waiting = (WaitingNode("a", pod="pod-a", pod_uid="uid-a"),
               WaitingNode("b", pod="pod-b", pod_uid="uid-other"),
               WaitingNode("c", topology=("claimed",)),
               WaitingNode("d", pod="pod-d"))
    by_pod = {"pod-a": ("uid-a", ("zone-a", "h1")), "pod-b": ("uid-b", ("zone-b", "h2")),
              "pod-d": (None, ("zone-c",))}
    filled = topology.with_pod_topology(waiting, by_pod)
    assert [w.topology for w in filled] == [("zone-a", "h1"), (), (), ("zone-c",)]
    # Everything else of an entry is kept.
    assert dataclasses.replace(filled[0], topology=()) == waiting[0]


def _joins(run: ElasticRun, names: list[str]) -> dict[str, LeaseState]:
    """Join requests on Leases, arriving one second apart in ``names`` order."""
    leases = {}
    for i, name in enumerate(names):
        at = T0 + dt.timedelta(seconds=i)
        join = WaitingNode(name, "10.0.0.1", 100 + i, since=at, pod=f"pod-{name}",
                           pod_uid=f"uid-{name}", arrived=at)
        leases[name] = LeaseState(node=name, holder=name, renewed=at, duration=15, join=join,
                                  seen=T0 + dt.timedelta(seconds=5), owner_uid=run.uid)
    return leases


ARRIVALS = ["w1", "w2", "w3", "w4"]  # w1, w3 in zone-b; w2, w4 in zone-a
PLACED = {"pod-w1": ("uid-w1", ("zone-b", "h1")), "pod-w2": ("uid-w2", ("zone-a", "h2")),
          "pod-w3": ("uid-w3", ("zone-b", "h3")), "pod-w4": ("uid-w4", ("zone-a", "h4"))}


def _new_run(max_nodes: int) -> ElasticRun:
    return ElasticRun("r", "ns", RunSpec(min_nodes=4, max_nodes=max_nodes), RunStatus(),
                      "1", uid="uid-r")


def test_the_waiting_summary_carries_the_values_and_a_nodes_seal_uses_them() -> None:
    from elasticrun.api import rounds

    run = _new_run(max_nodes=8)
    at = T0 + dt.timedelta(seconds=10)
    plan = reconcile(run, Members(leases=_joins(run, ARRIVALS), topology=PLACED), at)
    assert plan.status is not None and not plan.sealed
    assert {w.name: w.topology for w in plan.status.waiting} == {
        "w1": ("zone-b", "h1"), "w2": ("zone-a", "h2"), "w3": ("zone-b", "h3"),
        "w4": ("zone-a", "h4")}
    # A node sealing from the join requests it listed takes them from the summary.
    stored = run.replace_status(plan.status)
    listed = [lease.join for lease in _joins(run, ARRIVALS).values() if lease.join]
    sealed = rounds.seal_round(stored, at, waiting=listed)
    assert {p.name: p.rank for p in sealed.participants} == {"w2": 0, "w4": 1, "w1": 2, "w3": 3}
    # Without topology keys the summary carries none, and ranks follow arrival.
    off = reconcile(run, Members(leases=_joins(run, ARRIVALS)), at).status
    assert off is not None and all(w.topology == () for w in off.waiting)
    plain = rounds.seal_round(run.replace_status(off), at, waiting=listed)
    assert {p.name: p.rank for p in plain.participants} == {"w1": 0, "w2": 1, "w3": 2, "w4": 3}


def test_the_operators_own_seal_groups_ranks_by_zone_then_host() -> None:
    run = _new_run(max_nodes=4)
    at = T0 + dt.timedelta(seconds=3 + SEAL_GRACE + 1)
    plan = reconcile(run, Members(leases=_joins(run, ARRIVALS), topology=PLACED), at)
    assert plan.sealed and plan.status is not None
    assert {p.name: p.rank for p in plan.status.participants} == {
        "w2": 0, "w4": 1, "w1": 2, "w3": 3}
    # A pod whose Node has no topology values is of an unknown domain: last.
    partial = {k: v for k, v in PLACED.items() if k != "pod-w2"}
    plan = reconcile(run, Members(leases=_joins(run, ARRIVALS), topology=partial), at)
    assert plan.status is not None
    assert {p.name: p.rank for p in plan.status.participants} == {
        "w4": 0, "w1": 1, "w3": 2, "w2": 3}


def test_the_controller_keeps_node_values_for_the_pods_bound_to_them() -> None:
    from elasticrun.operator.controller import Controller
    from elasticrun.operator.metrics import Metrics

    async def scenario() -> None:
        client = idle_client()
        off = Controller(client, Metrics())
        assert not off.reads_nodes and off.pods.topology(("ns", "r")) is None
        controller = Controller(client, Metrics(), topology_keys=KEYS)
        assert controller.reads_nodes and controller.node_signals is None
        controller.node_event("ADDED", node("n1", **{ZONE: "zone-a", HOST: "n1"}))
        controller.node_event("ADDED", node("n2", other="x"))
        for name, bound in (("p1", "n1"), ("p2", "n2"), ("p3", "n1")):
            controller.pod_event("ADDED", {
                "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}",
                             "labels": {"elasticrun.dev/run": "r"}},
                "spec": {"nodeName": bound}})
        assert controller.pods.topology(("ns", "r")) == {
            "p1": ("uid-p1", ("zone-a", "n1")), "p3": ("uid-p3", ("zone-a", "n1"))}
        controller.node_event("MODIFIED", node("n1", **{ZONE: "zone-b", HOST: "n1"}))
        controller.pod_event("DELETED", {
            "metadata": {"name": "p3", "namespace": "ns", "uid": "uid-p3",
                         "labels": {"elasticrun.dev/run": "r"}}, "spec": {"nodeName": "n1"}})
        assert controller.pods.topology(("ns", "r")) == {"p1": ("uid-p1", ("zone-b", "n1"))}
        controller.node_event("DELETED", node("n1"))
        assert controller.pods.topology(("ns", "r")) == {}
        await controller.stop()

    asyncio.run(scenario())


def test_the_operator_flag_is_off_by_default_and_refuses_bad_keys(
        capsys: pytest.CaptureFixture[str]) -> None:
    from elasticrun.operator.__main__ import parse_args

    assert parse_args([]).topology_keys == ()
    assert parse_args(["--topology-keys", f"{ZONE},{HOST}"]).topology_keys == KEYS
    with pytest.raises(SystemExit) as exited:
        parse_args(["--topology-keys", "a,b,c,d,e"])
    assert exited.value.code == 2
    assert "--topology-keys: 'a,b,c,d,e': at most 4 keys, 5 given" in capsys.readouterr().err
