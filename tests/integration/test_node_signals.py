"""Node signals (``--node-signal``) with the real operator and real handlers on the real API server.

Played, because the API-server-only bed has no kubelet and no scheduler: the
Nodes are Node objects the test creates and taints (nothing else writes them:
no node controller runs), and the run's pods are Pod objects bound to them
with ``spec.nodeName``, their status written by the test as a kubelet would
(``conftest.Kubelet``).  Real: the operator process, its watches of Nodes,
Pods, Leases and runs, the handlers (``POD_NAME`` = those pods) and every
round they form through the API server.  Nothing is evicted in this bed, so
"before anything is evicted" is shown by the order of the test's steps: the
survivors' round is sealed while every pod still exists.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from owned import pod_on

from elasticrun.api.kube import MERGE_PATCH, ApiError
from elasticrun.api.model import now

from conftest import (
    Cluster,
    Kubelet,
    OperatorProcess,
    consistently,
    running_operator,
    wait_for,
)
from rdzv import Agent, is_waiting, make_run, read_run, rendezvous_all, start_rendezvous
from timings import HEARTBEAT, LAST_CALL, RECONCILES, outlasting

#: The signals of these tests, one per policy (keys nobody else sets on these Nodes).
NOTICE = "example.com/maintenance-notice"
SPOT = "example.com/spot-itn"
CORDON = "example.com/cordoned"
SIGNAL_ARGS = ["--node-signal", f"taint:{NOTICE}:observe", "--node-signal", f"taint:{SPOT}:drain",
               "--node-signal", f"taint:{CORDON}:exclude", "--no-default-node-signals"]


@pytest.fixture
def signal_operator(cluster: Cluster, namespace: str, tmp_path: Path,
                    request: pytest.FixtureRequest) -> Iterator[OperatorProcess]:
    with running_operator(cluster, namespace, tmp_path, request, SIGNAL_ARGS) as op:
        yield op


@pytest.fixture
def nodes(cluster: Cluster) -> Iterator[Callable[[str], str]]:
    """Node objects (cluster-scoped, so removed at teardown); returns the Node's name."""
    made: list[str] = []
    prefix = f"sig-{secrets.token_hex(3)}"

    def make(suffix: str) -> str:
        name = f"{prefix}-{suffix}"
        cluster.client.request("POST", "/api/v1/nodes", body={
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}}})
        made.append(name)
        return name

    yield make
    for name in made:
        with contextlib.suppress(ApiError):
            cluster.client.request("DELETE", f"/api/v1/nodes/{name}")


def taint(cluster: Cluster, node: str, *keys: str) -> None:
    cluster.client.request("PATCH", f"/api/v1/nodes/{node}", content_type=MERGE_PATCH, body={
        "spec": {"taints": [{"key": k, "effect": "NoSchedule"} for k in keys]}})


def signal_events(cluster: Cluster, namespace: str) -> list[str]:
    got = cluster.client.request("GET", f"/api/v1/namespaces/{namespace}/events",
                                 query={"fieldSelector": "reason=NodeSignal"})
    return [e.get("message", "") for e in got.get("items", [])]


def _ok(outcomes: dict[str, Any]) -> None:
    errors = {n: o.error for n, o in outcomes.items() if o.error}
    assert not errors, errors


def _formed(cluster: Cluster, namespace: str, pods: Kubelet, make_handler: Any, run: str,
            placed: dict[str, str], min_nodes: int, max_nodes: int) -> dict[str, Any]:
    """A run whose pods (name -> Node) are played and whose handlers form round 1."""
    make_run(cluster, namespace, run, min_nodes, max_nodes, 1)
    for pod, node in placed.items():
        pod_on(cluster, pods, pod, run, node)
    handlers = {pod: make_handler(run, pod, min_nodes=min_nodes, max_nodes=max_nodes, pod=pod)
                for pod in placed}
    outcomes = rendezvous_all(list(handlers.values()))
    _ok(outcomes)
    assert read_run(cluster.client, namespace, run).status.round == 1
    return handlers


def test_a_taint_to_observe_is_one_warning_event_a_condition_and_a_metric(
        signal_operator: OperatorProcess, make_handler: Any, cluster: Cluster,
        namespace: str, pods: Kubelet, nodes: Callable[[str], str]) -> None:
    a, b = nodes("a"), nodes("b")
    _formed(cluster, namespace, pods, make_handler, "obs", {"obs-0": a, "obs-1": b}, 2, 2)
    started = time.monotonic()
    taint(cluster, a, NOTICE)
    wait_for(lambda: signal_events(cluster, namespace), 10, "the NodeSignal Event")
    seen = time.monotonic() - started
    print(f"\nobserve: taint of Node {a} -> Warning Event in {seen:.3f}s")
    assert seen < HEARTBEAT / 5, seen
    # A flapping taint: off and on again, and more taints changed on the Node.
    for _ in range(5):
        taint(cluster, a)
        taint(cluster, a, NOTICE, "example.com/unrelated")
    # An Event per flap would follow each change at once; the first one above shows the
    # operator posts them.
    consistently(lambda: len(signal_events(cluster, namespace)) == 1, RECONCILES,
                 "a NodeSignal Event per flap")
    events = signal_events(cluster, namespace)
    assert len(events) == 1, events
    assert "member obs-0" in events[0] and f"taint:{NOTICE} (observe)" in events[0], events
    assert a in events[0]
    run = read_run(cluster.client, namespace, "obs")
    condition = run.status.condition("NodeSignals")
    assert condition is not None and condition.status == "True", run.status.conditions
    assert "obs-0" in (condition.message or "") and "obs-1" not in (condition.message or "")
    # Observe only: the round, its members and ranks stay.
    assert run.status.round == 1 and run.status.member_names == {"obs-0", "obs-1"}
    assert run.status.excluded_pods == ()
    series = f'elasticrun_node_signals{{namespace="{namespace}",run="obs",signal="taint:{NOTICE}"}}'
    wait_for(lambda: f"{series} 1.0" in signal_operator.metrics(), 5, series)


def test_a_drain_signal_removes_the_member_and_the_survivors_seal_a_new_round(
        signal_operator: OperatorProcess, make_handler: Any, cluster: Cluster,
        namespace: str, pods: Kubelet, nodes: Callable[[str], str]) -> None:
    a, b, c = nodes("a"), nodes("b"), nodes("c")
    placed = {"drn-0": a, "drn-1": b, "drn-2": c}
    handlers = _formed(cluster, namespace, pods, make_handler, "drn", placed, 2, 3)
    first = read_run(cluster.client, namespace, "drn").status
    doomed = next(p.name for p in first.participants if p.pod == "drn-1")
    # The survivors' agents re-join when told; the doomed node's agent is left idle.
    agents = [Agent(handlers[p]) for p in ("drn-0", "drn-2")]
    for agent in agents:
        agent.start((1, 3))
    try:
        started = time.monotonic()
        taint(cluster, b, SPOT)
        wait_for(lambda: read_run(cluster.client, namespace, "drn").status.round == 2
                 and not read_run(cluster.client, namespace, "drn").status.degraded, 30,
                 "the survivors' round 2")
        reformed = time.monotonic() - started
        wait_for(lambda: all(len(a.rounds) >= 2 for a in agents) or any(
            a.error for a in agents), 30, "both survivors to complete round 2")
    finally:
        for agent in agents:
            agent.halt()
    print(f"\ndrain: taint of Node {b} -> survivors' round 2 sealed in {reformed:.3f}s")
    assert all(a.error is None for a in agents), [a.error for a in agents]
    status = read_run(cluster.client, namespace, "drn").status
    assert status.member_names == {"drn-0", "drn-2"}
    assert sorted(p.rank for p in status.participants) == [0, 1]
    assert [a.rounds[-1] for a in agents] == [(2, 2), (2, 2)]
    lost = [m for m in status.lost_members if m.name == doomed]
    assert [m.reason for m in lost] == ["NodeDraining"], status.lost_members
    assert b in (lost[0].message or "") and SPOT in (lost[0].message or "")
    assert status.excluded_pods == ("drn-1",)
    # Nothing was evicted meanwhile: every pod is still there.
    for pod in placed:
        assert cluster.client.request("GET", pods.path(pod))["metadata"]["name"] == pod
    assert reformed < HEARTBEAT, reformed


def test_an_excluded_spare_stays_waiting_while_a_spare_elsewhere_is_admitted(
        signal_operator: OperatorProcess, make_handler: Any, cluster: Cluster,
        namespace: str, pods: Kubelet, nodes: Callable[[str], str]) -> None:
    a, b, x, y = nodes("a"), nodes("b"), nodes("x"), nodes("y")
    handlers = _formed(cluster, namespace, pods, make_handler, "exc",
                       {"exc-0": a, "exc-1": b}, 2, 3)
    taint(cluster, x, CORDON)
    # The spare's pod is on the cordoned Node before its node joins, as a pod starts
    # before its agent does: the operator holds it back by pod.
    pod_on(cluster, pods, "exc-x", "exc", x)
    wait_for(lambda: read_run(cluster.client, namespace, "exc").status.excluded_pods
             == ("exc-x",), 10, "the spare's pod excluded")
    pod_on(cluster, pods, "exc-y", "exc", y)
    agents = [Agent(handlers[p]) for p in ("exc-0", "exc-1")]
    for agent in agents:
        agent.start((1, 2))
    try:
        x_thread, x_box = start_rendezvous(
            make_handler("exc", "exc-x", min_nodes=2, max_nodes=3, pod="exc-x"))
        wait_for(lambda: is_waiting(cluster.client, namespace, "exc", "exc-x"), 20,
                 "the excluded spare to ask to join")

        def held() -> bool:
            status = read_run(cluster.client, namespace, "exc").status
            return status.round == 1 and status.member_names == {"exc-0", "exc-1"}

        # Longer than the run's last call: nobody restarts for it (the control: the spare
        # elsewhere, next, is admitted).
        consistently(held, outlasting(LAST_CALL), "the excluded spare was admitted")
        y_thread, y_box = start_rendezvous(
            make_handler("exc", "exc-y", min_nodes=2, max_nodes=3, pod="exc-y"))
        y_thread.join(60)
        wait_for(lambda: all(len(a.rounds) >= 2 for a in agents) or any(
            a.error for a in agents), 30, "the members to re-join")
    finally:
        for agent in agents:
            agent.halt()
    assert "info" in y_box, y_box
    assert y_box["info"].world_size == 3
    status = read_run(cluster.client, namespace, "exc").status
    assert status.round == 2 and status.member_names == {"exc-0", "exc-1", "exc-y"}
    assert sorted(p.rank for p in status.participants) == [0, 1, 2]
    assert x_thread.is_alive() and "info" not in x_box, x_box
    assert is_waiting(cluster.client, namespace, "exc", "exc-x")
    print(f"\nexclude: round 2 = {sorted(status.member_names)}, exc-x still waiting "
          f"(at {now().isoformat()})")
