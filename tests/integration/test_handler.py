"""K8sRendezvousHandler against the real API server; nodes are threads with their own names."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousStateError,
    RendezvousTimeoutError,
)

from elasticrun.api import rounds
from elasticrun.api.kube import run_path
from elasticrun.api.model import now

from conftest import Cluster, wait_for
from controlplane.localcluster import LocalControlPlane
from rdzv import (
    AuditLog,
    count_writes,
    is_waiting,
    read_run,
    rendezvous_all,
    start_rendezvous,
    watch_events,
)


def _ok(outcomes: dict[str, Any]) -> None:
    errors = {n: o.error for n, o in outcomes.items() if o.error}
    assert not errors, errors


@pytest.mark.parametrize("n", [2, 8, 32])
def test_concurrent_joins_get_ranks_0_to_n_minus_1_and_share_a_store(
        make_handler: Any, cluster: Cluster, namespace: str, n: int) -> None:
    handlers = [make_handler("join", f"node-{i}", min_nodes=n) for i in range(n)]
    outcomes = rendezvous_all(handlers, timeout=120)
    _ok(outcomes)
    assert sorted(o.rank for o in outcomes.values()) == list(range(n))
    assert {o.world_size for o in outcomes.values()} == {n}
    run = read_run(cluster.client, namespace, "join")
    assert run.status.round == 1 and run.status.phase == "Running"
    assert {p.name: p.rank for p in run.status.participants} == {
        name: o.rank for name, o in outcomes.items()}
    # One store for the round: what one node writes, another reads.
    first, last = outcomes["node-0"].info, outcomes[f"node-{n - 1}"].info
    first.store.set("greeting", f"from rank {first.rank}")
    assert last.store.get("greeting") == f"from rank {first.rank}".encode()
    # Everybody bootstraps from rank 0's TCPStore, as published in status.store.
    assert run.status.store is not None
    addresses = {(o.info.bootstrap_store_info.master_addr, o.info.bootstrap_store_info.master_port)
                 for o in outcomes.values()}
    assert addresses == {(run.status.store.host, run.status.store.port)}
    # ... which rank 0 serves: the port it published in its join request.
    rank0 = next(h for h in handlers if outcomes[h.settings.node_name].rank == 0)
    assert rank0.stores.port == run.status.store.port


def test_round_seals_at_once_at_max(make_handler: Any, cluster: Cluster, namespace: str) -> None:
    handlers = [make_handler("atmax", f"n{i}", min_nodes=2, max_nodes=3, last_call_timeout=300)
                for i in range(3)]
    outcomes = rendezvous_all(handlers, timeout=60)  # would take 300 s if it waited
    _ok(outcomes)
    assert sorted(o.rank for o in outcomes.values()) == [0, 1, 2]


def test_late_node_is_admitted_next_round_and_survivors_keep_ranks(
        make_handler: Any, cluster: Cluster, namespace: str) -> None:
    a, b = (make_handler("late", name, min_nodes=2, max_nodes=3, last_call_timeout=1)
            for name in ("a", "b"))
    first = rendezvous_all([a, b])
    _ok(first)
    assert a.num_nodes_waiting() == 0 and b.num_nodes_waiting() == 0

    c = make_handler("late", "c", min_nodes=2, max_nodes=3, last_call_timeout=1)
    thread, box = start_rendezvous(c)
    wait_for(lambda: a.num_nodes_waiting() > 0 and b.num_nodes_waiting() > 0, 10,
             "members to see the late node waiting")
    assert is_waiting(cluster.client, namespace, "late", "c")

    second = rendezvous_all([a, b])
    thread.join(30)
    _ok(second)
    assert "info" in box, box
    assert second["a"].rank == first["a"].rank
    assert second["b"].rank == first["b"].rank
    assert box["info"].rank == 2 and box["info"].world_size == 3
    run = read_run(cluster.client, namespace, "late")
    assert run.status.round == 2 and run.status.waiting == ()
    assert not is_waiting(cluster.client, namespace, "late", "c")


def test_spare_beyond_max_waits_visibly_without_restarting_members(
        make_handler: Any, cluster: Cluster, namespace: str) -> None:
    a, b = (make_handler("spare", name, min_nodes=2, max_nodes=2) for name in ("a", "b"))
    first = rendezvous_all([a, b])
    _ok(first)
    spare = make_handler("spare", "s", min_nodes=2, max_nodes=2, join_timeout=5)
    thread, box = start_rendezvous(spare)
    wait_for(lambda: is_waiting(cluster.client, namespace, "spare", "s"), 10,
             "the spare's waiting entry")
    assert a.num_nodes_waiting() == 0 and b.num_nodes_waiting() == 0
    # A member leaves: the spare takes its place in the next round.
    b.shutdown()
    wait_for(lambda: a.num_nodes_waiting() > 0, 10, "the survivor to see the loss")
    again = rendezvous_all([a])
    thread.join(30)
    _ok(again)
    assert box.get("info") is not None, box
    # The survivor keeps its rank (rank 0 or 1, as the first round's arrivals fell);
    # the spare takes the leaver's.
    assert again["a"].rank == first["a"].rank and box["info"].rank == first["b"].rank
    assert again["a"].world_size == box["info"].world_size == 2


def test_member_shutdown_makes_survivors_reform_without_it(
        make_handler: Any, cluster: Cluster, namespace: str) -> None:
    nodes = [make_handler("leave", f"n{i}", min_nodes=2, max_nodes=3) for i in range(3)]
    first = rendezvous_all(nodes)
    _ok(first)
    leaver = next(h for h in nodes if first[h.settings.node_name].rank == 1)
    survivors = [h for h in nodes if h is not leaver]
    assert leaver.shutdown() is True
    wait_for(lambda: all(h.num_nodes_waiting() >= 1 for h in survivors), 10,
             "survivors to see num_nodes_waiting() >= 1")
    run = read_run(cluster.client, namespace, "leave")
    assert run.status.lost_members[-1].name == leaver.settings.node_name
    assert run.status.lost_members[-1].reason == "Left"
    assert not run.closed, "an agent's shutdown must not close the run for the others"
    second = rendezvous_all(survivors)
    _ok(second)
    # The old rank 0 stays rank 0; the old rank 2 moves up to 1.
    for h in survivors:
        name = h.settings.node_name
        assert second[name].rank == (0 if first[name].rank == 0 else 1)
        assert second[name].world_size == 2


def test_member_removed_by_a_peer_or_operator_signals_survivors(
        make_handler: Any, cluster: Cluster, namespace: str) -> None:
    nodes = [make_handler("removed", f"n{i}", min_nodes=3) for i in range(3)]
    _ok(rendezvous_all(nodes))
    run = read_run(cluster.client, namespace, "removed")
    status = rounds.remove_member(run.status, "n2", "PodDeleted", now())
    assert status is not None
    body = {"apiVersion": "elasticrun.dev/v1alpha1", "kind": "ElasticRun",
            "metadata": {"name": "removed", "resourceVersion": run.resource_version},
            "status": status.to_dict()}
    cluster.client.request("PUT", run_path(namespace, "removed", "status"), body=body)
    wait_for(lambda: nodes[0].num_nodes_waiting() >= 1 and nodes[1].num_nodes_waiting() >= 1,
             10, "survivors to see the removal")


def test_set_closed_fails_waiting_and_late_nodes(make_handler: Any, cluster: Cluster,
                                                 namespace: str) -> None:
    waiting = make_handler("closing", "w", min_nodes=2)
    thread, box = start_rendezvous(waiting)
    wait_for(lambda: is_waiting(cluster.client, namespace, "closing", "w"), 10,
             "the node to be waiting")
    closer = make_handler("closing", "closer", min_nodes=2)
    closer.set_closed()
    thread.join(20)
    assert isinstance(box.get("error"), RendezvousClosedError), box
    assert "closed" in str(box["error"])
    assert closer.is_closed()
    late = make_handler("closing", "late", min_nodes=2)
    with pytest.raises(RendezvousClosedError, match="run is closed"):
        late.next_rendezvous()
    run = read_run(cluster.client, namespace, "closing")
    assert run.status.phase == "Closed" and run.spec.closed
    assert not is_waiting(cluster.client, namespace, "closing", "w")  # withdrew its request


def test_join_deadline_raises_timeout_and_withdraws(make_handler: Any, cluster: Cluster,
                                                    namespace: str) -> None:
    alone = make_handler("lonely", "only", min_nodes=2, join_timeout=2)
    with pytest.raises(RendezvousTimeoutError, match="join timeout") as info:
        alone.next_rendezvous()
    assert f"{namespace}/lonely" in str(info.value)
    assert "'only'" in str(info.value)
    assert not is_waiting(cluster.client, namespace, "lonely", "only")


def test_unreachable_api_server_raises_connection_error_within_bound(
        make_handler: Any, tmp_path: Path) -> None:
    config = {"apiVersion": "v1", "kind": "Config", "current-context": "x",
              "clusters": [{"name": "x", "cluster": {"server": "https://127.0.0.1:9",
                                                     "insecure-skip-tls-verify": True}}],
              "users": [{"name": "x", "user": {"token": "t"}}],
              "contexts": [{"name": "x", "context": {"cluster": "x", "user": "x"}}]}
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps(config))
    handler = make_handler("nowhere", "n", kubeconfig=path, api_timeout=2)
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match="did not answer within 2s") as info:
        handler.next_rendezvous()
    assert "127.0.0.1:9" in str(info.value)
    assert time.monotonic() - started < 30  # bounded, not a hang


def test_api_server_stopped_mid_wait_raises_connection_error(
        make_handler: Any, cluster: Cluster, namespace: str,
        local_control_plane: LocalControlPlane) -> None:
    local = local_control_plane
    waiting = make_handler("outage", "w", min_nodes=2, api_timeout=3)
    thread, box = start_rendezvous(waiting)
    wait_for(lambda: is_waiting(cluster.client, namespace, "outage", "w"), 10,
             "the node to be waiting")
    local.stop_apiserver()
    try:
        thread.join(30)
        assert isinstance(box.get("error"), RendezvousConnectionError), box
        assert "api_timeout" in str(box["error"]) or "did not answer" in str(box["error"])
    finally:
        local.start_apiserver()


def test_hand_broken_status_raises_state_error_naming_the_field(
        make_handler: Any, cluster: Cluster, namespace: str) -> None:
    nodes = [make_handler("broken", f"n{i}", min_nodes=2) for i in range(2)]
    _ok(rendezvous_all(nodes))
    raw = cluster.client.request("GET", run_path(namespace, "broken"))
    for p in raw["status"]["participants"]:
        p["rank"] = 0  # well typed, accepted by the schema, nonsense
    cluster.client.request("PUT", run_path(namespace, "broken", "status"), body=raw)
    late = make_handler("broken", "late", min_nodes=2)
    with pytest.raises(RendezvousStateError, match=r"status\.participants: duplicate ranks"):
        late.next_rendezvous()


def test_writes_per_round_are_linear(make_handler: Any, cluster: Cluster,
                                     namespace: str) -> None:
    local = cluster.require_local()
    n = 16
    handlers = [make_handler("writes", f"n{i}", min_nodes=n) for i in range(n)]
    _ok(rendezvous_all(handlers, timeout=120))
    entries = AuditLog(local.state.audit_log).entries(namespace)  # type: ignore[union-attr]
    writes = count_writes(entries)
    total = sum(writes.values())
    conflicts = sum(1 for e in entries if e.code == 409)
    print(f"\nwrites for one round of {n}: {dict(writes)}; conflicts: {conflicts}")
    # One write per node: its Lease, created with its join request.  Nothing
    # else of a node touches the shared ElasticRun until one of them seals.
    assert writes["create leases"] == n
    assert writes["patch elasticruns/status"] == 0
    assert writes["update elasticruns/status"] == 1  # the seal
    assert total <= 2 * n + 5


def test_watch_events_per_round_grow_linearly(make_handler: Any, cluster: Cluster,
                                              namespace: str) -> None:
    local = cluster.require_local()
    per_round: dict[int, float] = {}
    for n in (8, 16, 32):
        handlers = [make_handler(f"fanout-{n}", f"n{i}", min_nodes=n) for i in range(n)]
        before = watch_events(local.metrics)
        _ok(rendezvous_all(handlers, timeout=120))
        # The watches deliver the seal asynchronously; let them land before counting.
        wait_for(lambda hs=handlers: all(h.watcher.latest.status.round == 1 for h in hs), 10,
                 "every watch to deliver the sealed round")
        per_round[n] = watch_events(local.metrics) - before
        for h in handlers:
            h.shutdown()
    print(f"\nwatch events per round: {per_round}")
    for n, events in per_round.items():
        assert events <= 2 * n + 4, per_round
    # Quadratic fan-out would multiply by 16 from 8 to 32 nodes; linear by 4.
    assert per_round[32] / per_round[8] <= 6, per_round


def test_round_seals_after_last_call_when_min_reached(make_handler: Any, cluster: Cluster,
                                                     namespace: str) -> None:
    handlers = [make_handler("lc2", f"n{i}", min_nodes=2, max_nodes=4, last_call_timeout=2)
                for i in range(2)]
    started = time.monotonic()
    outcomes = rendezvous_all(handlers)
    waited = time.monotonic() - started
    _ok(outcomes)
    run = read_run(cluster.client, namespace, "lc2")
    assert sorted(o.rank for o in outcomes.values()) == [0, 1]
    assert len(run.status.participants) == 2 and run.spec.max_nodes == 4
    # Two of at most four arrived: the round is sealed only once the window has passed.
    assert waited >= 1.9, waited
