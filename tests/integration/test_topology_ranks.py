"""Ranks grouped by the Node's topology (``--topology-keys``), real operator and real handlers.

Played, because the API-server-only bed has no kubelet and no scheduler: the
Nodes are Node objects the test creates with zone and hostname labels, and the
run's pods are Pod objects bound to them with ``spec.nodeName`` (no index), their
status written by the test as a kubelet would.  Real: the operator process and
its Node and Pod watches, the handlers (``POD_NAME`` = those pods), the waiting
summary the operator writes and the round the handlers seal from it.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from owned import pod_on

from elasticrun.api.kube import ApiError

from conftest import Cluster, Kubelet, running_operator, wait_for
from rdzv import is_waiting, make_run, read_run, start_rendezvous

ZONE, HOST = "topology.kubernetes.io/zone", "kubernetes.io/hostname"
#: Long enough for the operator's summary (written once the joins are quiet for a
#: second) to reach the nodes before one of them seals at the last call.
LAST_CALL = 6


@pytest.fixture
def zoned_nodes(cluster: Cluster) -> Iterator[dict[str, str]]:
    """Four Node objects, two per zone (cluster-scoped, removed at teardown): by the pod
    that goes on each, its Node's name."""
    prefix = f"topo-{secrets.token_hex(3)}"
    placed = {"arrive-1": ("zone-b", "b1"), "arrive-2": ("zone-a", "a1"),
              "arrive-3": ("zone-b", "b2"), "arrive-4": ("zone-a", "a2")}
    made: dict[str, str] = {}
    for pod, (zone, suffix) in placed.items():
        name = f"{prefix}-{suffix}"
        cluster.client.request("POST", "/api/v1/nodes", body={
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {ZONE: zone, HOST: name}}})
        made[pod] = name
    yield made
    for name in made.values():
        with contextlib.suppress(ApiError):
            cluster.client.request("DELETE", f"/api/v1/nodes/{name}")


@pytest.mark.parametrize("keys", [True, False], ids=["topology-keys", "without"])
def test_newcomers_without_an_index_are_ranked_by_zone_and_host_with_topology_keys(
        cluster: Cluster, namespace: str, tmp_path: Path, request: pytest.FixtureRequest,
        make_handler: Any, pods: Kubelet, zoned_nodes: dict[str, str], keys: bool) -> None:
    run = "zoned"
    args = ["--topology-keys", f"{ZONE},{HOST}"] if keys else []
    with running_operator(cluster, namespace, tmp_path, request, args) as op:
        make_run(cluster, namespace, run, 4, 5, LAST_CALL)
        boxes: dict[str, dict[str, Any]] = {}
        # Arrivals interleave the zones: b, a, b, a (names sort in arrival order).
        for pod, node in zoned_nodes.items():
            pod_on(cluster, pods, pod, run, node)
            _, boxes[pod] = start_rendezvous(
                make_handler(run, pod, min_nodes=4, max_nodes=5, pod=pod))
            wait_for(lambda p=pod: is_waiting(cluster.client, namespace, run, p), 20,
                     f"{pod} to ask to join")
        wanted = {"arrive-1": ("zone-b", zoned_nodes["arrive-1"]),
                  "arrive-2": ("zone-a", zoned_nodes["arrive-2"]),
                  "arrive-3": ("zone-b", zoned_nodes["arrive-3"]),
                  "arrive-4": ("zone-a", zoned_nodes["arrive-4"])} if keys else {
            pod: () for pod in zoned_nodes}

        def summary() -> dict[str, tuple[str, ...]]:
            status = read_run(cluster.client, namespace, run).status
            return {w.name: w.topology for w in status.waiting}

        # Before the last call passes, the operator's summary holds every entry, with
        # its Node's values in the keys' order (none without keys).
        wait_for(lambda: summary() == wanted or all(boxes.values()), LAST_CALL - 1,
                 f"the waiting summary {wanted} (last: {summary()})")
        assert not all(boxes.values()), "sealed before the summary was checked"
        assert summary() == wanted
        wait_for(lambda: all(boxes.values()), 30, "the first round")
        assert not [b["error"] for b in boxes.values() if "error" in b]
        ranks = {pod: box["info"].rank for pod, box in boxes.items()}
        log = op.log_tail(200)
    if keys:
        # zone-a first, then zone-b; within a zone by hostname.
        assert ranks == {"arrive-2": 0, "arrive-4": 1, "arrive-1": 2, "arrive-3": 3}, ranks
        assert f"topology keys: {ZONE}, {HOST}" in log
    else:
        assert ranks == {"arrive-1": 0, "arrive-2": 1, "arrive-3": 2, "arrive-4": 3}, ranks
        assert "topology keys" not in log
    status = read_run(cluster.client, namespace, run).status
    assert status.round == 1
    assert {p.name: p.rank for p in status.participants} == ranks
