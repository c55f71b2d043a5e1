"""The operator as a real process against the real API server; the tests play kubelet."""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousClosedError

from elasticrun.api import crd, slices
from elasticrun.api.kube import lease_path, leases_path
from elasticrun.api.naming import lease_name

from conftest import Cluster, Kubelet, OperatorProcess, consistently, wait_for
from rdzv import (
    Outcome,
    is_waiting,
    metric,
    read_run,
    rendezvous_all,
    run_deleted,
    start_rendezvous,
)
from timings import MARGIN, SHORT_HEARTBEAT, SHORT_RENEW, outlasting


def _ok(outcomes: dict[str, Any]) -> None:
    errors = {n: o.error for n, o in outcomes.items() if o.error}
    assert not errors, errors


def _pod_nodes(make_handler: Any, pods: Kubelet, run: str, names: list[str],
               **kw: Any) -> list[Any]:
    for name in names:
        pods.create(name, run)
    return [make_handler(run, name, pod=name, **kw) for name in names]


def _lost(cluster: Cluster, namespace: str, run: str, name: str) -> Any:
    for lost in read_run(cluster.client, namespace, run).status.lost_members:
        if lost.name == name:
            return lost
    return None


def _events(cluster: Cluster, namespace: str, reason: str) -> list[str]:
    got = cluster.client.request("GET", f"/api/v1/namespaces/{namespace}/events",
                                 query={"fieldSelector": f"reason={reason}"})
    return [e["message"] for e in got.get("items") or []]


LOSSES = {
    "PodDeleted": lambda pods, name: pods.delete(name),
    "PodFailed": lambda pods, name: pods.set_status(name, {"phase": "Failed",
                                                           "reason": "Error"}),
    "ContainerTerminated": lambda pods, name: pods.set_status(name, {"containerStatuses": [{
        "name": "trainer", "image": "trainer:latest", "imageID": "", "ready": False,
        "restartCount": 0, "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled",
                                                    "finishedAt": "2026-01-01T00:00:01Z"}}}]}),
    "ContainerRestarted": lambda pods, name: pods.set_status(name, {"containerStatuses": [{
        "name": "trainer", "image": "trainer:latest", "imageID": "", "ready": True,
        "restartCount": 1, "state": {"running": {"startedAt": "2026-01-01T00:00:02Z"}},
        "lastState": {"terminated": {"exitCode": 1, "finishedAt": "2026-01-01T00:00:01Z"}}}]}),
    "PodDisrupted": lambda pods, name: pods.set_status(name, {"conditions": [
        {"type": "Ready", "status": "True"},
        {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI",
         "message": "evicted for node maintenance"}]}),
}


@pytest.mark.parametrize("reason", list(LOSSES))
def test_pod_loss_removes_member_and_signals_survivors(
        reason: str, operator: OperatorProcess, make_handler: Any, pods: Kubelet,
        cluster: Cluster, namespace: str) -> None:
    nodes = _pod_nodes(make_handler, pods, "pods", ["p0", "p1", "p2"], min_nodes=2,
                       max_nodes=3)
    first = rendezvous_all(nodes)
    _ok(first)
    victim = nodes[2]
    started = time.monotonic()
    LOSSES[reason](pods, "p2")
    survivors = nodes[:2]
    wait_for(lambda: all(h.num_nodes_waiting() >= 1 for h in survivors), 15,
             f"survivors to see the {reason}")
    seen = time.monotonic() - started
    lost = _lost(cluster, namespace, "pods", "p2")
    assert lost is not None and lost.reason == reason, lost
    assert lost.round == 1
    victim.lease.stop_renewing()  # the dead node stops renewing, as it would
    second = rendezvous_all(survivors)
    _ok(second)
    formed = time.monotonic() - started
    print(f"\n{reason}: survivors saw it after {seen:.3f}s, new round after {formed:.3f}s")
    assert {o.rank for o in second.values()} == {0, 1}
    run = read_run(cluster.client, namespace, "pods")
    assert run.status.round == 2 and "p2" not in run.status.member_names
    wait_for(lambda: any("p2" in m and reason in m
                         for m in _events(cluster, namespace, "MemberLost")), 10,
             f"a MemberLost event naming p2 and {reason}")


def test_expired_lease_removes_a_silent_member(operator: OperatorProcess, make_handler: Any,
                                               cluster: Cluster, namespace: str) -> None:
    nodes = [make_handler("quiet", f"n{i}", min_nodes=3, heartbeat_timeout=2,
                          lease_renew_interval=1) for i in range(3)]
    _ok(rendezvous_all(nodes))
    nodes[1].lease.stop_renewing()  # a partitioned node: alive, silent
    started = time.monotonic()
    wait_for(lambda: nodes[0].num_nodes_waiting() >= 1 and nodes[2].num_nodes_waiting() >= 1,
             15, "survivors to see the expired lease")
    print(f"\nlease expiry seen after {time.monotonic() - started:.2f}s (heartbeat 2s)")
    lost = _lost(cluster, namespace, "quiet", "n1")
    assert lost is not None and lost.reason == "LeaseExpired"
    assert lost.detection_seconds is not None and lost.detection_seconds >= 0


def test_round_completes_with_operator_killed_and_restart_loses_nothing(
        operator: OperatorProcess, make_handler: Any, cluster: Cluster, namespace: str) -> None:
    # A short heartbeat: the window in which the restarted operator must remove nobody
    # outlasts it, so a wrong LeaseExpired would show inside it.
    conf = {"min_nodes": 2, "max_nodes": 3, "heartbeat_timeout": SHORT_HEARTBEAT,
            "lease_renew_interval": SHORT_RENEW}
    nodes = [make_handler("restart", f"n{i}", **conf) for i in range(2)]
    _ok(rendezvous_all(nodes))
    operator.kill()
    # With the operator gone, a late node still gets a round: the nodes seal it.
    late = make_handler("restart", "n2", **conf)
    thread, box = start_rendezvous(late)
    wait_for(lambda: all(h.num_nodes_waiting() >= 1 for h in nodes), 10,
             "members to see the late node without an operator")
    _ok(rendezvous_all(nodes))
    thread.join(30)
    assert box.get("info") is not None and box["info"].world_size == 3, box
    before = read_run(cluster.client, namespace, "restart")
    operator.start()
    # Let the restarted operator see everything; it must not remove anyone.
    wait_for(lambda: metric(operator.metrics(), "elasticrun_members", run="restart") == 3, 15,
             "the restarted operator to report 3 members")

    def unchanged() -> bool:
        after = read_run(cluster.client, namespace, "restart")
        return (after.status.member_names == before.status.member_names
                and after.status.round == before.status.round == 2
                and after.status.lost_members == before.status.lost_members
                and all(h.num_nodes_waiting() == 0 for h in [*nodes, late]))

    window = outlasting(SHORT_HEARTBEAT)
    consistently(unchanged, window, "the restarted operator changed the round")
    # The control: the same operator does remove a member that stops renewing, within
    # such a window, so the window above would have shown a wrong removal.
    late.lease.stop_renewing()
    silent = time.monotonic()
    wait_for(lambda: _lost(cluster, namespace, "restart", "n2"), window + MARGIN,
             "the restarted operator to remove a silent member")
    print(f"\nthe silent member removed {time.monotonic() - silent:.2f}s after its last "
          f"renewal (heartbeat {SHORT_HEARTBEAT}s, window {window}s)")
    assert _lost(cluster, namespace, "restart", "n2").reason == "LeaseExpired"


def test_kubectl_close_fails_waiting_and_late_nodes(operator: OperatorProcess,
                                                    make_handler: Any, cluster: Cluster,
                                                    namespace: str) -> None:
    waiting = make_handler("close", "w", min_nodes=2)
    thread, box = start_rendezvous(waiting)
    wait_for(lambda: is_waiting(cluster.client, namespace, "close", "w"), 10, "a waiting node")
    cluster.kubectl("patch", "er", "close", "-n", namespace, "--type", "merge", "-p",
                    '{"spec":{"closed":true}}')
    thread.join(20)
    assert isinstance(box.get("error"), RendezvousClosedError), box
    with pytest.raises(RendezvousClosedError):
        make_handler("close", "late", min_nodes=2).next_rendezvous()
    # The nodes go by spec.closed; the operator writes the closed status on its own
    # reconcile, which may come after them (a clean-clone run read "Pending" here).
    wait_for(lambda: read_run(cluster.client, namespace, "close").status.phase == "Closed",
             10, "the operator's closed status")
    run = read_run(cluster.client, namespace, "close")
    assert run.status.condition("Closed").status == "True"  # type: ignore[union-attr]


def test_force_round_drain_and_live_resize(operator: OperatorProcess, make_handler: Any,
                                          cluster: Cluster, namespace: str) -> None:
    nodes = [make_handler("ops", f"n{i}", min_nodes=2, max_nodes=3) for i in range(3)]
    first = rendezvous_all(nodes)
    _ok(first)
    # 1. Force a new round.
    cluster.kubectl("annotate", "er", "ops", "-n", namespace, f"{crd.RESTART_ANNOTATION}=now")
    wait_for(lambda: all(h.num_nodes_waiting() >= 1 for h in nodes), 10,
             "members to be asked for a new round")
    second = rendezvous_all(nodes)
    _ok(second)
    assert {n: o.rank for n, o in second.items()} == {n: o.rank for n, o in first.items()}
    wait_for(lambda: crd.RESTART_ANNOTATION not in read_run(
        cluster.client, namespace, "ops").annotations, 10, "the annotation to be consumed")
    # 2. Drain n1: it leaves the round and, joining again, waits without being admitted.
    cluster.kubectl("annotate", "er", "ops", "-n", namespace, f"{crd.DRAIN_ANNOTATION}=n1")
    wait_for(lambda: nodes[0].num_nodes_waiting() >= 1, 10, "the drain to restart the round")
    _thread, box = start_rendezvous(nodes[1])
    third = rendezvous_all([nodes[0], nodes[2]])
    _ok(third)
    assert {o.world_size for o in third.values()} == {2}
    # n1 asked again and waits, unadmitted (its request is on its Lease; the
    # status.waiting summary follows a moment later).
    wait_for(lambda: is_waiting(cluster.client, namespace, "ops", "n1"), 10, "n1 waiting")
    assert _lost(cluster, namespace, "ops", "n1").reason == "Drained"
    # 3. Undrain and lower maxNodes live: the next round takes 2, n1 stays a spare.
    cluster.kubectl("annotate", "er", "ops", "-n", namespace, f"{crd.DRAIN_ANNOTATION}-")
    cluster.kubectl("patch", "er", "ops", "-n", namespace, "--type", "merge", "-p",
                    '{"spec":{"maxNodes":2}}')
    cluster.kubectl("annotate", "er", "ops", "-n", namespace, f"{crd.RESTART_ANNOTATION}=again")
    wait_for(lambda: nodes[0].num_nodes_waiting() >= 1, 10, "the forced round")
    fourth = rendezvous_all([nodes[0], nodes[2]])
    _ok(fourth)
    assert {o.world_size for o in fourth.values()} == {2}
    assert "info" not in box  # n1 is still a spare
    run = read_run(cluster.client, namespace, "ops")
    assert run.status.member_names == {"n0", "n2"}
    assert is_waiting(cluster.client, namespace, "ops", "n1")
    wait_for(lambda: read_run(cluster.client, namespace, "ops").status.waiting_node("n1"), 10,
             "the operator to list the spare in status.waiting")


def test_conditions_events_and_kubectl_wait(operator: OperatorProcess, make_handler: Any,
                                            cluster: Cluster, namespace: str) -> None:
    nodes = [make_handler("visible", f"n{i}", min_nodes=2) for i in range(2)]
    outcomes = rendezvous_all(nodes)
    _ok(outcomes)
    cluster.kubectl("wait", "--for=condition=RoundComplete", "er/visible", "-n", namespace,
                    "--timeout=20s")
    leader = next(n for n, o in outcomes.items() if o.rank == 0)
    wait_for(lambda: _events(cluster, namespace, "RoundSealed"), 10, "a RoundSealed event")
    assert f"round 1: 2 members, rank 0 = {leader}" in _events(cluster, namespace,
                                                               "RoundSealed")
    run = read_run(cluster.client, namespace, "visible")
    cond = run.status.condition("RoundComplete")
    assert cond is not None and cond.observed_generation == run.generation
    table = cluster.kubectl("get", "er", "visible", "-n", namespace, "--no-headers").stdout
    assert table.split()[1:5] == ["Running", "1", "2", "0"], table
    described = cluster.kubectl("describe", "er", "visible", "-n", namespace).stdout
    assert "RoundSealed" in described


def test_succeeded_after_all_members_leave_then_ttl_cleanup(
        operator: OperatorProcess, make_handler: Any, cluster: Cluster, namespace: str) -> None:
    cluster.client.request("POST", f"/apis/{crd.API_VERSION}/namespaces/{namespace}/"
                           f"{crd.PLURAL}", body={
                               "apiVersion": crd.API_VERSION, "kind": crd.KIND,
                               "metadata": {"name": "done"},
                               "spec": {"minNodes": 2, "ttlSecondsAfterFinished": 2}})
    nodes = [make_handler("done", f"n{i}", min_nodes=2) for i in range(2)]
    _ok(rendezvous_all(nodes))
    for h in nodes:
        h.shutdown()
    wait_for(lambda: read_run(cluster.client, namespace, "done").status.phase == "Succeeded",
             10, "the run to succeed")
    succeeded = read_run(cluster.client, namespace, "done")
    assert succeeded.closed and succeeded.status.finished_at is not None

    wait_for(lambda: run_deleted(cluster.client, namespace, "done"), 15,
             "the TTL to delete the run")
    # Not before its TTL: the deletion is seen (within a poll of it) no earlier than
    # finishedAt + ttlSecondsAfterFinished, which a deletion at once would fail.
    seen = dt.datetime.now(dt.UTC)
    assert seen >= succeeded.status.finished_at + dt.timedelta(seconds=2), (
        seen, succeeded.status.finished_at)
    leases = cluster.client.request("GET", leases_path(namespace))["items"]
    assert [lease["metadata"]["name"] for lease in leases] == []


def test_metrics_endpoint_serves_named_series(operator: OperatorProcess, make_handler: Any,
                                              cluster: Cluster, namespace: str) -> None:
    nodes = [make_handler("metered", f"n{i}", min_nodes=3) for i in range(3)]
    _ok(rendezvous_all(nodes))
    nodes[2].shutdown()
    wait_for(lambda: metric(operator.metrics(), "elasticrun_members_lost_total",
                            run="metered", reason="Left") == 1, 10, "the loss to be counted")
    text = operator.metrics()
    assert metric(text, "elasticrun_rounds_total", run="metered") == 1
    assert metric(text, "elasticrun_members", run="metered") == 2
    assert metric(text, "elasticrun_waiting_nodes", run="metered") == 0
    assert metric(text, "elasticrun_round", run="metered") == 1
    assert metric(text, "elasticrun_round_duration_seconds_count", run="metered") == 1
    assert 0 <= metric(text, "elasticrun_round_duration_seconds_sum", run="metered") < 60


class _Counted:
    """Counts the calls of one ``RunGateway`` request (``leases``: a LIST of the run's
    Leases; ``read``: a GET of the run) that handlers of this process make."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, request: str) -> None:
        from elasticrun.api.gateway import RunGateway

        self.count = 0
        original = getattr(RunGateway, request)

        def counted(gateway: RunGateway, *args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return original(gateway, *args, **kwargs)

        monkeypatch.setattr(RunGateway, request, counted)


def _form_deferring(make_handler: Any, monkeypatch: pytest.MonkeyPatch, run: str,
                    wait: float) -> int:
    """Form a round of 3 nodes that defer their seal for ``wait`` s; LISTs they made."""
    from elasticrun.api import rounds

    monkeypatch.setattr(rounds, "DEFER_SEAL_FROM", 3)
    monkeypatch.setattr(rounds, "DEFER_SEAL_BASE", wait)
    monkeypatch.setattr(rounds, "DEFER_SEAL_PER_NODE", 0.0)
    lists = _Counted(monkeypatch, "leases")
    outcomes = rendezvous_all([make_handler(run, f"n{i}", min_nodes=3) for i in range(3)])
    _ok(outcomes)
    assert sorted(o.rank for o in outcomes.values() if o.rank is not None) == [0, 1, 2]
    assert {o.world_size for o in outcomes.values()} == {3}
    return lists.count


def test_deferring_nodes_never_list_the_leases_and_the_operator_seals(
        operator: OperatorProcess, make_handler: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The large-run protocol at small N: nodes write their request, the operator seals."""
    assert _form_deferring(make_handler, monkeypatch, "deferred", wait=120.0) == 0


def test_deferring_nodes_seal_themselves_when_no_operator_does(
        make_handler: Any, cluster: Cluster, namespace: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert _form_deferring(make_handler, monkeypatch, "unattended", wait=0.5) >= 1
    assert read_run(cluster.client, namespace, "unattended").status.round == 1


def _form_three(make_handler: Any, run: str, max_nodes: int, **conf: Any
                ) -> tuple[list[Any], dict[str, Outcome]]:
    """Three nodes of ``run`` (at least 2, at most ``max_nodes``, a last call of 2 s, and
    ``conf``) formed in one round, ranked 0 to 2: the handlers, and their outcomes by
    node name."""
    nodes = [make_handler(run, f"n{i}", min_nodes=2, max_nodes=max_nodes,
                          last_call_timeout=2, **conf) for i in range(3)]
    outcomes = rendezvous_all(nodes)
    _ok(outcomes)
    assert sorted(o.rank for o in outcomes.values()) == [0, 1, 2]
    return nodes, outcomes


def test_the_largest_runs_tell_each_member_its_place_in_its_slice(
        operator: OperatorProcess, make_handler: Any, cluster: Cluster, namespace: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """maxNodes 2,048: the operator's seal leaves the signal alone, so no node receives the
    roster; each learns its rank from its slice, in the first round and after a loss."""
    from elasticrun.api import rounds

    lists = _Counted(monkeypatch, "leases")
    nodes, outcomes = _form_three(make_handler, "told", rounds.TELL_IN_SLICES_FROM)
    ranks = {name: o.rank for name, o in outcomes.items()}
    assert {o.world_size for o in outcomes.values()} == {3}
    run = read_run(cluster.client, namespace, "told")
    assert run.status.round == 1 and run.status.signal == 0
    assert {p.name: p.rank for p in run.status.participants} == ranks
    assert lists.count == 0
    for node in nodes:
        # No copy of the sealed roster reached the node: its cache still holds round 0.
        assert node.watcher is not None and node.watcher.latest is not None
        assert node.watcher.latest.status.round == 0
        assert node.mailbox is not None and node.mailbox.latest is not None
        told = node.mailbox.latest
        assert (told.round, told.rank, told.world_size) == (1, ranks[node.settings.node_name], 3)
        assert told.leader == run.status.participants[0].name
    # A loss moves the signal (every survivor must hear of it); the next round is
    # told in the slices again.
    leaving = next(n for n in nodes if ranks[n.settings.node_name] == 2)
    leaving.shutdown()
    survivors = [n for n in nodes if n is not leaving]
    wait_for(lambda: all(n.num_nodes_waiting() > 0 for n in survivors), 15,
             "the survivors to hear of the loss")
    again = rendezvous_all(survivors)
    _ok(again)
    assert sorted(o.rank for o in again.values()) == [0, 1]
    assert {o.world_size for o in again.values()} == {2}
    run = read_run(cluster.client, namespace, "told")
    assert run.status.round == 2 and run.status.signal == 1
    assert all(n.mailbox is not None and n.mailbox.latest is not None
               and n.mailbox.latest.round == 2 for n in survivors)
    assert all(n.num_nodes_waiting() == 0 for n in survivors)


def test_a_quiet_run_tells_its_members_by_the_seals_broadcast_and_they_rejoin_on_it(
        operator: OperatorProcess, make_handler: Any, cluster: Cluster, namespace: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """maxNodes 256: the operator's seal moves the signal and every node receives the run
    with it; holding its round, each member watches it quietly, hears of a loss in one
    event of metadata, and learns its next place from one event, the run as the next
    seal settled it: no read of the run, no LIST, no slice.  (A
    heartbeat of two renewals keeps no place, so the members ask again; below, they
    keep their places.)"""
    from elasticrun.api import rounds
    from elasticrun.api.model import RunSpec

    lists, reads = _Counted(monkeypatch, "leases"), _Counted(monkeypatch, "read")
    conf = {"heartbeat_timeout": 10, "lease_renew_interval": 5}
    assert not rounds.members_keep_places(RunSpec(
        min_nodes=2, max_nodes=rounds.QUIET_WATCH_FROM, **conf))
    nodes, outcomes = _form_three(make_handler, "quiet", rounds.QUIET_WATCH_FROM, **conf)
    ranks = {name: o.rank for name, o in outcomes.items()}
    run = read_run(cluster.client, namespace, "quiet")
    assert run.status.round == 1 and run.status.signal == 1
    for node in nodes:
        assert node.mailbox is None and node.watcher is not None
        latest = node.watcher.latest
        assert latest is not None and latest.status.round == 1  # the seal's broadcast
        wait_for(lambda node=node: node.watcher.quiet_round == 1, 15, "the quiet watch")
    leaving = next(n for n in nodes if ranks[n.settings.node_name] == 2)
    survivors = [n for n in nodes if n is not leaving]
    seen = {n.settings.node_name: n.watcher.events_received for n in survivors}
    leaving.shutdown()  # its departure is a status write, read and written by the leaver
    wait_for(lambda: all(n.num_nodes_waiting() > 0 for n in survivors), 15,
             "the survivors to hear of the loss")
    lists.count, reads.count = 0, 0
    assert {n.settings.node_name: n.watcher.events_received - seen[n.settings.node_name]
            for n in survivors} == {n.settings.node_name: 1 for n in survivors}
    again = rendezvous_all(survivors)
    _ok(again)
    assert sorted(o.rank for o in again.values()) == [0, 1]
    assert {o.world_size for o in again.values()} == {2}
    run = read_run(cluster.client, namespace, "quiet")
    assert run.status.round == 2 and run.status.signal > 1
    for node in survivors:
        name = node.settings.node_name
        # The loss, then the settled run: two events in all.
        assert node.watcher.events_received - seen[name] == 2
        assert node.watcher.latest.status.round == 2
        assert node.mailbox is None
    told_in_slices = cluster.client.request("GET", slices.slices_path(namespace), query={
        "labelSelector": f"{crd.RUN_LABEL}=quiet"})
    assert told_in_slices["items"] == []  # told by the broadcast alone
    assert (reads.count, lists.count) == (0, 0)
    for node in survivors:
        wait_for(lambda node=node: node.watcher.quiet_round == 2, 15, "the quiet watch again")
    assert all(n.num_nodes_waiting() == 0 for n in survivors)


def _requests(cluster: Cluster, namespace: str, run: str, names: list[str]) -> dict[str, Any]:
    """The join request on each node's Lease (its ``since``)."""
    from elasticrun.api.leases import lease_state

    found = {}
    for name in names:
        lease = cluster.client.request("GET", lease_path(namespace, lease_name(run, name)))
        join = lease_state(lease).join
        found[name] = join.since if join is not None else None
    return found


def _next_store(cluster: Cluster, namespace: str, run: str, node: str) -> Any:
    """The store ``node``'s request announces for the next round (None: none)."""
    from elasticrun.api.leases import lease_state
    from elasticrun.api.model import StoreAddress

    lease = cluster.client.request("GET", lease_path(namespace, lease_name(run, node)))
    join = lease_state(lease).join
    if join is None or join.next_store_port is None or not join.address:
        return None
    return StoreAddress(join.address, join.next_store_port)


def _newcomers_round(make_handler: Any, cluster: Cluster, namespace: str, run: str,
                     max_nodes: int) -> tuple[list[Any], Any, Any, dict[str, Any]]:
    """Three nodes form ``run``, then a fourth asks and every member comes back for it: the
    members and the newcomer, the two rounds' statuses, and the members' requests on their
    Leases as the first round sealed them.  Where places are kept, the newcomer asks once
    rank 0 announced the next round's store."""
    from elasticrun.api import rounds
    from elasticrun.api.model import RunSpec

    nodes, _ = _form_three(make_handler, run, max_nodes)
    names = [n.settings.node_name for n in nodes]
    first = read_run(cluster.client, namespace, run).status
    asked = _requests(cluster, namespace, run, names)
    assert asked == {p.name: p.since for p in first.participants}
    if rounds.members_keep_places(RunSpec(min_nodes=2, max_nodes=max_nodes)):
        assert first.leader is not None
        wait_for(lambda: _next_store(cluster, namespace, run, first.leader), 15,
                 "rank 0's announcement of the next round's store")
    newcomer = make_handler(run, "n3", min_nodes=2, max_nodes=max_nodes, last_call_timeout=2)
    thread, box = start_rendezvous(newcomer)
    wait_for(lambda: all(n.num_nodes_waiting() > 0 for n in nodes), 15,
             "the members to hear of the newcomer")
    again = rendezvous_all(nodes)
    thread.join(30)
    _ok(again)
    assert "info" in box, box
    second = read_run(cluster.client, namespace, run).status
    assert second.round == 2
    assert {p.name: p.rank for p in second.participants} == {
        **{p.name: p.rank for p in first.participants}, "n3": 3}
    assert {o.world_size for o in again.values()} == {box["info"].world_size} == {4}
    return [*nodes, newcomer], first, second, asked


def test_members_keep_their_places_in_the_rounds_the_operator_seals(
        operator: OperatorProcess, make_handler: Any, cluster: Cluster,
        namespace: str) -> None:
    """maxNodes 64 (the operator seals): rank 0 announces the next round's store once a
    round holds it, and for a newcomer and after a loss no member asks again: each keeps
    its place, which answers the request of its first round again, and the round meets at
    the store rank 0 announced."""
    from elasticrun.api import rounds
    from elasticrun.api.model import RunSpec

    assert rounds.members_keep_places(RunSpec(min_nodes=2, max_nodes=rounds.DEFER_SEAL_FROM))
    nodes, first, second, asked = _newcomers_round(make_handler, cluster, namespace, "kept",
                                                   rounds.DEFER_SEAL_FROM)
    leader = first.leader
    members = [p.name for p in first.participants]
    assert {name: second.participant(name).since  # type: ignore[union-attr]
            for name in members} == asked
    assert _requests(cluster, namespace, "kept", members) == asked
    assert second.store is not None and first.store is not None
    assert second.store != first.store and second.store.host == first.store.host
    # A loss: once rank 0 announced round 3's store, the survivors' round keeps every place,
    # the newcomer's too.
    wait_for(lambda: _next_store(cluster, namespace, "kept", leader) not in (None, second.store),
             15, "rank 0's announcement of round 3's store")
    announced = _next_store(cluster, namespace, "kept", leader)
    # The announcing request is the one rounds 1 and 2 answered, naming round 2's store.
    assert _store_port(cluster, namespace, "kept", leader) == second.store.port
    leaving = next(n for n in nodes if second.participant(n.settings.node_name).rank == 2)
    survivors = [n for n in nodes if n is not leaving]
    before = _requests(cluster, namespace, "kept", [n.settings.node_name for n in survivors])
    leaving.shutdown()
    wait_for(lambda: all(n.num_nodes_waiting() > 0 for n in survivors), 15,
             "the survivors to hear of the loss")
    again = rendezvous_all(survivors)
    _ok(again)
    third = read_run(cluster.client, namespace, "kept").status
    assert third.round == 3 and third.leader == leader and third.store == announced
    assert sorted(p.rank for p in third.participants) == [0, 1, 2]
    assert {o.world_size for o in again.values()} == {3}
    stayed = [n.settings.node_name for n in survivors]
    assert _requests(cluster, namespace, "kept", stayed) == before
    assert {n: third.participant(n).since for n in stayed} == before  # type: ignore[union-attr]
    assert before[leader] == asked[leader], "rank 0 never asked again"


def test_quiet_members_keep_their_places_and_ask_again_once_rank_0_is_lost(
        operator: OperatorProcess, make_handler: Any, cluster: Cluster, namespace: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """maxNodes 256 (members watch their round quietly): when the operator finds a
    member's Lease expired, its one write removes the member and seals the survivors'
    round keeping every place, rank 0's at the store it announced; each survivor, woken
    by its quiet watch, which sends the whole run where places are kept, finds its place
    kept there and takes it, writing and reading nothing.  Once rank 0 itself is lost no
    place can be kept: the run re-forms, and the survivors see so in that event and ask
    again (the positive control)."""
    from elasticrun.api import rounds

    reads = _Counted(monkeypatch, "read")
    conf = {"min_nodes": 2, "max_nodes": rounds.QUIET_WATCH_FROM, "last_call_timeout": 2,
            "heartbeat_timeout": 3, "lease_renew_interval": 1}
    nodes = [make_handler("calm", f"n{i}", **conf) for i in range(4)]
    _ok(rendezvous_all(nodes))
    first = read_run(cluster.client, namespace, "calm").status
    leader = first.leader
    assert leader is not None and rounds.members_keep_places(read_run(
        cluster.client, namespace, "calm").spec)
    wait_for(lambda: _next_store(cluster, namespace, "calm", leader), 15,
             "rank 0's announcement of the next round's store")
    announced = _next_store(cluster, namespace, "calm", leader)
    by_rank = {first.participant(n.settings.node_name).rank: n  # type: ignore[union-attr]
               for n in nodes}
    for node in nodes:
        wait_for(lambda node=node: node.watcher.quiet_round == 1, 15, "the quiet watch")
    reads.count = 0
    by_rank[3].lease.stop_renewing()  # a partitioned node: alive, silent
    survivors = [by_rank[0], by_rank[1], by_rank[2]]
    names = [n.settings.node_name for n in survivors]
    before = _requests(cluster, namespace, "calm", names)
    wait_for(lambda: all(n.num_nodes_waiting() > 0 for n in survivors), 15,
             "the survivors to hear of the expired Lease")
    second = rendezvous_all(survivors)
    _ok(second)
    assert reads.count == 0, "the quiet watch sent each survivor the run"
    run = read_run(cluster.client, namespace, "calm").status
    assert run.round == 2 and run.leader == leader and run.store == announced
    assert {p.name: p.rank for p in run.participants} == {
        name: first.participant(name).rank for name in names}  # type: ignore[union-attr]
    assert {o.world_size for o in second.values()} == {3}
    assert _requests(cluster, namespace, "calm", names) == before, "no survivor asked"
    # Rank 0 lost: the run re-forms, and the survivors ask again.
    for node in survivors:
        wait_for(lambda node=node: node.watcher.quiet_round == 2, 15, "the quiet watch")
    by_rank[0].lease.stop_renewing()
    rest = [by_rank[1], by_rank[2]]
    wait_for(lambda: all(n.num_nodes_waiting() > 0 for n in rest), 15,
             "the survivors to hear of rank 0's expired Lease")
    third = rendezvous_all(rest)
    _ok(third)
    assert reads.count == 0
    stayed = [n.settings.node_name for n in rest]
    asked = _requests(cluster, namespace, "calm", stayed)
    assert all(asked[name] != before[name] for name in stayed), (before, asked)
    final = read_run(cluster.client, namespace, "calm").status
    assert final.round == 3 and sorted(p.rank for p in final.participants) == [0, 1]
    assert {final.participant(name).since for name in stayed} == {  # type: ignore[union-attr]
        asked[name] for name in stayed}


def _store_port(cluster: Cluster, namespace: str, run: str, node: str) -> int | None:
    """The store port ``node``'s request names."""
    from elasticrun.api.leases import lease_state

    lease = cluster.client.request("GET", lease_path(namespace, lease_name(run, node)))
    join = lease_state(lease).join
    return join.store_port if join is not None else None


def test_members_ask_again_in_the_rounds_nodes_seal(
        make_handler: Any, cluster: Cluster, namespace: str) -> None:
    """The positive control of the test above: below ``DEFER_SEAL_FROM`` every member
    writes a new request for the newcomer's round, and the round answers those."""
    from elasticrun.api import rounds
    from elasticrun.api.model import RunSpec

    assert not rounds.members_keep_places(RunSpec(min_nodes=2, max_nodes=8))
    _, first, second, asked = _newcomers_round(make_handler, cluster, namespace, "asked", 8)
    names = [p.name for p in first.participants]
    now_asked = _requests(cluster, namespace, "asked", names)
    assert all(now_asked[name] != asked[name] for name in names), (asked, now_asked)
    assert {name: second.participant(name).since  # type: ignore[union-attr]
            for name in names} == now_asked
