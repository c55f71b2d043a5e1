"""Faults against the real control plane: nodes, the operator, the API server and etcd fail.

Each test injects one fault, checks the outcome (ranks, world sizes,
membership, errors) and records what happened and how long recovery took with
:func:`chaoskit.record`, from which ``docs/reliability.md`` is generated.
Nodes that must be SIGKILLed are real processes (``node_agent.py``); the
others are handler threads.  Timeouts are shortened (heartbeat 2 s, renewal
every 1 s) so that every test stays bounded; the protocol is the same.
"""

from __future__ import annotations

import datetime as dt
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
)

from elasticrun.api import crd
from elasticrun.api.kube import ApiError, lease_path, run_path, runs_path
from elasticrun.api.leases import lease_state
from elasticrun.api.model import now
from elasticrun.api.naming import lease_name

from chaoskit import assert_all_ok, assert_consistent, raw_run, record, start_node
from conftest import Cluster, OperatorProcess, ProcessGroup, consistently, wait_for
from controlplane.localcluster import LocalControlPlane
from rdzv import is_waiting, metric, read_run, rendezvous_all, start_rendezvous
from timings import outlasting

pytestmark = pytest.mark.slow

#: Short liveness settings for every chaos run (the spec's own fields).
FAST = {"heartbeatTimeoutSeconds": 2, "leaseRenewIntervalSeconds": 1}
FAST_CONF = "heartbeat_timeout=2,lease_interval=1"


def create_run(cluster: Cluster, namespace: str, name: str, **spec: Any) -> None:
    cluster.client.request("POST", runs_path(namespace), body={
        "apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": name},
        "spec": spec})


def _waiting(cluster: Cluster, namespace: str, run: str, *nodes: str) -> set[str]:
    """Which of ``nodes`` have asked to join and not been answered yet."""
    return {n for n in nodes if is_waiting(cluster.client, namespace, run, n)}


# --------------------------------------------------------------------------- nodes killed


def test_node_sigkilled_mid_join_is_dropped_from_waiting(
        operator: OperatorProcess, processes: ProcessGroup, cluster: Cluster,
        namespace: str, tmp_path: Path) -> None:
    create_run(cluster, namespace, "midjoin", minNodes=3, maxNodes=3, **FAST)
    start = lambda name: start_node(processes, cluster.kubeconfig, namespace,  # noqa: E731
                                    "midjoin", name, tmp_path, "3:3", FAST_CONF)
    n0, n1 = start("n0"), start("n1")
    wait_for(lambda: _waiting(cluster, namespace, "midjoin", "n0", "n1") == {"n0", "n1"}, 30,
             "n0 and n1 waiting")
    killed_at = n1.kill()
    wait_for(lambda: _waiting(cluster, namespace, "midjoin", "n0", "n1") == {"n0"}, 15,
             "the dead node's join request to lapse with its Lease")
    dropped = time.time() - killed_at
    n2, n3 = start("n2"), start("n3")
    rounds = {n.node: n.wait_event("rendezvous", 60) for n in (n0, n2, n3)}
    formed = time.time() - killed_at
    assert sorted(e["rank"] for e in rounds.values()) == [0, 1, 2]
    assert {e["world"] for e in rounds.values()} == {3}
    run = read_run(cluster.client, namespace, "midjoin")
    assert run.status.member_names == {"n0", "n2", "n3"} and run.status.round == 1
    assert n1.rendezvous() == []
    record("node SIGKILLed mid-join",
           fault="SIGKILL of a waiting node (2 of minNodes 3 waiting)",
           expected="its join request (on its Lease) stops counting when the Lease expires; "
                    "the round forms without it",
           observed=f"request gone {dropped:.1f}s after the kill (heartbeat 2s); round 1 "
                    "sealed with n0, n2, n3 (ranks 0-2)",
           recovery_seconds=round(dropped, 2))
    assert formed < 60


@pytest.mark.parametrize("point", ["before-seal", "after-seal"])
def test_node_sigkilled_mid_seal(point: str, operator: OperatorProcess,
                                 processes: ProcessGroup, cluster: Cluster, namespace: str,
                                 tmp_path: Path) -> None:
    """The node whose join reached maxNodes dies just before, or just after, its seal write."""
    run = f"midseal-{point}"
    create_run(cluster, namespace, run, minNodes=2, maxNodes=3, lastCallTimeoutSeconds=60,
               **FAST)
    start = lambda name, *extra: start_node(  # noqa: E731
        processes, cluster.kubeconfig, namespace, run, name, tmp_path, "2:3", FAST_CONF,
        *extra)
    n0, n1 = start("n0"), start("n1")
    wait_for(lambda: _waiting(cluster, namespace, run, "n0", "n1") == {"n0", "n1"}, 30,
             "n0 and n1 waiting (last call of 60s running)")
    sealer = start("n2", "--die-at", point)
    died = sealer.wait_event("dying", 30)
    sealer.proc.wait(timeout=10)
    killed_at = died["t"]
    assert sealer.proc.returncode == -9  # a real SIGKILL
    # Whoever sealed (the dead node, or the operator's backstop a second later),
    # the survivors end up in a round without it.
    second = {n.node: n.wait_event("rendezvous", 45, where=lambda e: e["world"] == 2)
              for n in (n0, n1)}
    recovered = max(e["t"] for e in second.values()) - killed_at
    assert sorted(e["rank"] for e in second.values()) == [0, 1]
    final = read_run(cluster.client, namespace, run)
    assert final.status.member_names == {"n0", "n1"}
    assert_consistent(final)
    first_rounds = {n.node: [e["round"] for e in n.rendezvous()] for n in (n0, n1)}
    if point == "after-seal":
        # The dead node's seal took: round 1 had it, and round 2 re-formed without it.
        assert all(r == [1, 2] for r in first_rounds.values()), first_rounds
        assert [m.name for m in final.status.lost_members] == ["n2"]
    record(f"node SIGKILLed mid-seal ({point.replace('-', ' ')} write)",
           fault=f"SIGKILL of the node sealing the round, {point.replace('-', ' ')} "
                 "compare-and-set",
           expected="a consistent round is sealed (by the node or the operator's backstop); "
                    "the dead member is removed when its Lease expires; survivors re-form",
           observed=f"survivors' rounds {sorted({r for rs in first_rounds.values() for r in rs})}; "
                    f"final round {final.status.round} = n0, n1 (ranks 0, 1)",
           recovery_seconds=round(recovered, 2))


@pytest.mark.parametrize("signal_", ["pod status", "Lease only"])
def test_node_sigkilled_mid_training(signal_: str, operator: OperatorProcess, pods: Any,
                                     processes: ProcessGroup, cluster: Cluster,
                                     namespace: str, tmp_path: Path) -> None:
    run = "training" if signal_ == "pod status" else "silent"
    create_run(cluster, namespace, run, minNodes=2, maxNodes=3, lastCallTimeoutSeconds=30,
               **FAST)
    nodes = []
    for name in ("n0", "n1", "n2"):
        pods.create(name, run)
        nodes.append(start_node(processes, cluster.kubeconfig, namespace, run, name, tmp_path,
                                "2:3", FAST_CONF, "--pod", name))
    first = {n.node: n.wait_event("rendezvous", 60) for n in nodes}
    assert sorted(e["rank"] for e in first.values()) == [0, 1, 2]
    victim = next(n for n in nodes if first[n.node]["rank"] == 1)
    survivors = [n for n in nodes if n is not victim]
    killed_at = victim.kill()
    if signal_ == "pod status":
        # The kubelet reports the container killed (exit 137) within a second or so.
        pods.set_status(victim.node, {"containerStatuses": [{
            "name": "trainer", "image": "trainer:latest", "imageID": "", "ready": False,
            "restartCount": 0, "state": {"terminated": {
                "exitCode": 137, "reason": "Error",
                "finishedAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}}}]})
    restarts = [n.wait_event("restart", 20) for n in survivors]
    noticed = max(e["t"] for e in restarts) - killed_at
    second = {n.node: n.wait_event("rendezvous", 30, count=2) for n in survivors}
    recovered = max(e["t"] for e in second.values()) - killed_at
    for n in survivors:
        # Stable ranks: the old rank 0 stays 0, the old rank 2 moves up to 1.
        assert second[n.node]["rank"] == (0 if first[n.node]["rank"] == 0 else 1)
        assert second[n.node]["world"] == 2 and second[n.node]["round"] == 2
    final = read_run(cluster.client, namespace, run)
    lost = final.status.lost_members[-1]
    assert lost.name == victim.node
    assert lost.reason == ("ContainerTerminated" if signal_ == "pod status" else "LeaseExpired")
    record(f"node SIGKILLed mid-training ({signal_})",
           fault="SIGKILL of rank 1 of 3 while the round runs"
                 + (" (kubelet reports exit 137)" if signal_ == "pod status"
                    else " (pod looks alive: a partition or lost machine)"),
           expected="survivors' num_nodes_waiting() > 0, new round of 2, ranks kept",
           observed=f"removed as {lost.reason}; survivors restarted after {noticed:.1f}s; "
                    "round 2 of 2, rank 0 kept",
           recovery_seconds=round(recovered, 2))


# --------------------------------------------------------------------------- the operator


def test_operator_sigkilled_mid_round_and_restarted(
        operator: OperatorProcess, processes: ProcessGroup, cluster: Cluster,
        namespace: str, tmp_path: Path) -> None:
    create_run(cluster, namespace, "oprestart", minNodes=2, maxNodes=3,
               lastCallTimeoutSeconds=60, **FAST)
    start = lambda name: start_node(processes, cluster.kubeconfig, namespace,  # noqa: E731
                                    "oprestart", name, tmp_path, "2:3", FAST_CONF)
    n0 = start("n0")
    wait_for(lambda: _waiting(cluster, namespace, "oprestart", "n0") == {"n0"}, 30, "n0 waiting")
    operator.kill()
    killed_at = time.time()
    n1, n2 = start("n1"), start("n2")
    first = {n.node: n.wait_event("rendezvous", 60) for n in (n0, n1, n2)}
    formed = max(e["t"] for e in first.values()) - killed_at
    assert sorted(e["rank"] for e in first.values()) == [0, 1, 2]
    before = read_run(cluster.client, namespace, "oprestart")
    restarted = time.monotonic()
    operator.start()
    back = time.monotonic() - restarted
    # The restarted operator sees the same members, removes nobody ...
    wait_for(lambda: "elasticrun_members{namespace=" in operator.metrics(), 15,
             "the restarted operator to observe the run")

    def unchanged() -> bool:
        after = read_run(cluster.client, namespace, "oprestart")
        return (after.status.member_names == before.status.member_names
                and after.status.round == before.status.round == 1
                and after.status.lost_members == ())

    # Longer than the heartbeat: a wrong removal would show within it (the control
    # follows: a killed member is removed).
    consistently(unchanged, outlasting(FAST["heartbeatTimeoutSeconds"]),
                 "the restarted operator changed the round")
    # ... and does its job again: a silent member is removed and the others re-form.
    victim = next(n for n in (n0, n1, n2) if first[n.node]["rank"] == 2)
    victim.kill()
    survivors = [n for n in (n0, n1, n2) if n is not victim]
    second = {n.node: n.wait_event("rendezvous", 30, count=2) for n in survivors}
    assert sorted(e["rank"] for e in second.values()) == [0, 1]
    assert read_run(cluster.client, namespace, "oprestart").status.lost_members[-1].reason \
        == "LeaseExpired"
    record("operator SIGKILLed mid-round, restarted",
           fault="SIGKILL of the operator with 1 of 3 nodes waiting; restart after the round",
           expected="nodes seal the round themselves; the restarted operator removes nobody "
                    "and resumes liveness",
           observed=f"round 1 of 3 sealed by the nodes {formed:.1f}s after the kill; restarted "
                    f"operator healthy in {back:.1f}s, kept all 3 members, then removed a "
                    "killed member (LeaseExpired)",
           recovery_seconds=round(formed, 2))


def test_rounds_form_with_no_operator_at_all(make_handler: Any, cluster: Cluster,
                                             namespace: str) -> None:
    make = lambda n: make_handler("nooperator", n, min_nodes=2, max_nodes=3,  # noqa: E731
                                  last_call_timeout=1)
    a, b = make("a"), make("b")
    started = time.monotonic()
    assert_all_ok(rendezvous_all([a, b]))
    c = make("c")
    thread, box = start_rendezvous(c)
    wait_for(lambda: a.num_nodes_waiting() > 0 and b.num_nodes_waiting() > 0, 10,
             "members to hear of the late node")
    second = rendezvous_all([a, b])
    thread.join(30)
    assert_all_ok(second)
    took = time.monotonic() - started
    assert box["info"].world_size == 3 and box["info"].rank == 2
    assert {o.rank for o in second.values()} == {0, 1}
    raw = raw_run(cluster, namespace, "nooperator")
    managers = {m["manager"] for m in raw["metadata"].get("managedFields") or []}
    assert "elasticrun-operator" not in managers
    assert "elasticrun-seal" in managers
    assert raw["status"]["round"] == 2
    record("operator absent for whole rounds",
           fault="no operator running",
           expected="nodes seal rounds themselves (one compare-and-set each)",
           observed="round 1 (2 nodes) and round 2 (3 nodes, late joiner) sealed by the nodes",
           recovery_seconds=round(took, 2))


# --------------------------------------------------------------------------- API server, etcd


def _two_of_three_waiting(make_handler: Any, cluster: Cluster, namespace: str, run: str
                          ) -> tuple[Any, list[Any], list[Any]]:
    """Nodes a and b waiting for a round of 3, patient with outages (api_timeout 60 s)."""
    make = lambda n: make_handler(run, n, min_nodes=3, api_timeout=60)  # noqa: E731
    nodes = [make("a"), make("b")]
    threads = [start_rendezvous(h) for h in nodes]
    wait_for(lambda: _waiting(cluster, namespace, run, "a", "b") == {"a", "b"}, 20,
             "a and b waiting")
    return make, nodes, threads


def test_apiserver_restarted_mid_rendezvous(
        operator: OperatorProcess, make_handler: Any, cluster: Cluster, namespace: str,
        local_control_plane: LocalControlPlane) -> None:
    make, (a, b), threads = _two_of_three_waiting(make_handler, cluster, namespace, "apirestart")
    stopped = time.monotonic()
    local_control_plane.stop_apiserver()
    try:
        time.sleep(3)  # the outage itself: nothing to wait for, it is the fault
    finally:
        local_control_plane.start_apiserver()  # waits for /readyz
    restored = time.monotonic()
    outage = restored - stopped
    c = make("c")
    outcomes = rendezvous_all([c], timeout=60)
    for thread, _ in threads:
        thread.join(60)
    done = time.monotonic() - restored
    assert_all_ok(outcomes)
    boxes = [box for _, box in threads]
    assert all("info" in box for box in boxes), boxes
    ranks = sorted([box["info"].rank for box in boxes] + [outcomes["c"].rank])
    assert ranks == [0, 1, 2]
    assert {box["info"].world_size for box in boxes} == {3}
    resynced = sum(h.watcher.resyncs for h in (a, b))
    run = read_run(cluster.client, namespace, "apirestart")
    assert run.status.round == 1 and run.status.lost_members == ()
    record("kube-apiserver stopped and restarted mid-rendezvous",
           fault=f"API server down for {outage:.1f}s with 2 of 3 nodes waiting (etcd kept)",
           expected="handlers reconnect, resume their watches (re-list after 410 Gone), the "
                    "round completes; the operator removes nobody",
           observed=f"round 1 of 3 sealed {done:.1f}s after the API server was back; "
                    f"{resynced} watch re-list(s) after 410; no member lost",
           recovery_seconds=round(done, 2))


def _renewed_since(cluster: Cluster, namespace: str, run: str, node: str,
                   moment: dt.datetime) -> bool:
    lease = cluster.client.request("GET", lease_path(namespace, lease_name(run, node)))
    renewed = lease_state(lease).renewed
    return renewed is not None and renewed > moment


def test_apiserver_down_longer_than_the_heartbeat_removes_nobody(
        operator: OperatorProcess, processes: ProcessGroup, cluster: Cluster, namespace: str,
        tmp_path: Path, local_control_plane: LocalControlPlane) -> None:
    """A control-plane upgrade must not restart training: no Lease can be renewed meanwhile.

    Node b is also slow to come back (SIGSTOPped until 3 s after the API server
    returned, as a node whose connection takes a while to re-establish), so its
    Lease is stale for longer than the heartbeat timeout when the operator looks
    again: counted from the outage's end, it still has time to renew.
    """
    create_run(cluster, namespace, "upgrade", minNodes=2, maxNodes=2,
               heartbeatTimeoutSeconds=8, leaseRenewIntervalSeconds=2)
    a, b = (start_node(processes, cluster.kubeconfig, namespace, "upgrade", n, tmp_path, "2:2",
                       "heartbeat_timeout=8,lease_interval=2,api_timeout=60") for n in "ab")
    assert sorted(n.wait_event("rendezvous", 60)["rank"] for n in (a, b)) == [0, 1]
    os.kill(b.proc.pid, signal.SIGSTOP)
    try:
        local_control_plane.stop_apiserver()
        try:
            time.sleep(10)  # the outage, longer than the heartbeat timeout: it is the fault
        finally:
            local_control_plane.start_apiserver()  # waits for /readyz
        time.sleep(3)  # b is slow to come back; the operator has looked again meanwhile
    finally:
        resumed = now()
        os.kill(b.proc.pid, signal.SIGCONT)
    assert metric(operator.metrics(), "elasticrun_apiserver_outages_total") >= 1
    wait_for(lambda: metric(operator.metrics(), "elasticrun_apiserver_reachable") == 1, 15,
             "the operator to see the API server back")
    # Once both have renewed after b came back, no Lease is stale any more: a wrong
    # removal (the operator looks within a second of an expiry) would be done by then.
    wait_for(lambda: all(_renewed_since(cluster, namespace, "upgrade", n, resumed)
                         for n in "ab"), 15, "a and b to renew their Leases")
    after = read_run(cluster.client, namespace, "upgrade")
    assert after.status.lost_members == (), after.status.lost_members
    assert after.status.round == 1 and after.status.member_names == {"a", "b"}
    assert [n.of("restart") for n in (a, b)] == [[], []]  # training was never interrupted
    record("kube-apiserver down longer than the heartbeat timeout",
           fault="API server down for 10s (heartbeatTimeoutSeconds 8), one node back only 3s "
                 "after it",
           expected="no Lease counts as expired until its holder had a heartbeat timeout of "
                    "reachable API server: nobody is removed, training is not restarted",
           observed="round 1 kept both members; no restart, no member lost",
           recovery_seconds=None)


def test_etcd_briefly_stopped(make_handler: Any, cluster: Cluster, namespace: str,
                              local_control_plane: LocalControlPlane) -> None:
    make, _, threads = _two_of_three_waiting(make_handler, cluster, namespace, "etcdgap")
    local_control_plane.stop_etcd()
    try:
        c = make("c")
        joining = start_rendezvous(c)
        time.sleep(2)  # the outage: c's first calls meet an API server without etcd
    finally:
        local_control_plane.start_etcd()
    restored = time.monotonic()
    for thread, _ in [*threads, joining]:
        thread.join(60)
    done = time.monotonic() - restored
    boxes = [box for _, box in [*threads, joining]]
    assert all("info" in box for box in boxes), boxes
    assert sorted(box["info"].rank for box in boxes) == [0, 1, 2]
    assert read_run(cluster.client, namespace, "etcdgap").status.round == 1
    record("etcd briefly stopped",
           fault="etcd down for ~2s while 2 nodes wait and a third joins",
           expected="API calls fail and are retried within api_timeout; the round completes",
           observed=f"round 1 of 3 sealed {done:.1f}s after etcd was back",
           recovery_seconds=round(done, 2))


def test_apiserver_unreachable_longer_than_join_timeout(
        make_handler: Any, cluster: Cluster, namespace: str,
        local_control_plane: LocalControlPlane) -> None:
    a = make_handler("unreachable", "a", min_nodes=2, join_timeout=5, api_timeout=3)
    thread, box = start_rendezvous(a)
    wait_for(lambda: is_waiting(cluster.client, namespace, "unreachable", "a"), 20,
             "a waiting")
    stopped = time.monotonic()
    local_control_plane.stop_apiserver()
    try:
        thread.join(30)
        failed_after = time.monotonic() - stopped
        error = box.get("error")
        assert isinstance(error, RendezvousConnectionError), box
        message = str(error)
        assert f"rendezvous {namespace}/unreachable, node 'a'" in message
        assert "API server" in message and "3s" in message, message
        assert failed_after < 15, failed_after
    finally:
        local_control_plane.start_apiserver()
    # Nothing half-written: the stored object reads, and a's entry is all it holds.
    stored = read_run(cluster.client, namespace, "unreachable")
    assert stored.status.round == 0 and stored.status.participants == ()
    assert stored.status.waiting_names <= {"a"}
    # torch's launcher calls shutdown() after the error; the request goes, and a
    # new attempt forms a round normally.
    a.shutdown()
    assert not is_waiting(cluster.client, namespace, "unreachable", "a")
    b = make_handler("unreachable", "b", min_nodes=2)
    again = make_handler("unreachable", "a2", min_nodes=2)
    assert_all_ok(rendezvous_all([b, again]))
    record("API server unreachable longer than the join timeout",
           fault="API server down for longer than api_timeout (3s) and join_timeout (5s)",
           expected="RendezvousConnectionError naming run, node and API server; the ElasticRun "
                    "stays readable and whole",
           observed=f"RendezvousConnectionError after {failed_after:.1f}s: '..."
                    f"{message.split(': ', 1)[1][:90]}...'; stored status parsed, no partial "
                    "round; a new attempt formed a round once the server was back",
           recovery_seconds=None, lost="nothing (the waiting entry is withdrawn by shutdown())")


# --------------------------------------------------------------------------- scale, short watches


def test_128_nodes_join_at_once_with_watches_closed_every_2s(
        make_handler: Any, cluster: Cluster, namespace: str) -> None:
    """128 nodes, min=max=128; the API server ends every watch after 2 s.

    The handler asks for ``timeoutSeconds`` on each watch, and the API server
    honours that over its ``--min-request-timeout`` (which only applies when a
    client gives none), so ``watch_timeout=2`` is how the server is made to
    close every node's watch many times during the test.
    """
    n = 128
    handlers = [make_handler("crowd", f"node-{i:03d}", min_nodes=n, watch_timeout=2,
                             api_timeout=60, join_timeout=150) for i in range(n)]
    started = time.monotonic()
    first = rendezvous_all(handlers, timeout=200)
    formed = time.monotonic() - started
    assert_all_ok(first)
    assert sorted(o.rank for o in first.values()) == list(range(n))
    assert {o.world_size for o in first.values()} == {n}
    run = read_run(cluster.client, namespace, "crowd")
    assert run.status.round == 1 and len(run.status.participants) == n
    # Let the server end every node's watch at least twice more, then send signals.
    opened = [h.watcher.watches_opened for h in handlers]
    wait_for(lambda: all(h.watcher.watches_opened >= o + 2
                         for h, o in zip(handlers, opened, strict=True)),
             30, "the server to end every node's watch twice more")
    leaver = handlers[-1]
    leaver.shutdown()
    signalled = time.monotonic()
    rest = handlers[:-1]
    wait_for(lambda: all(h.num_nodes_waiting() >= 1 for h in rest), 30,
             "all 127 others to see the member leave")
    seen = time.monotonic() - signalled
    rest[0].set_closed()
    wait_for(lambda: all(h.watcher.latest.closed for h in rest), 30,
             "all 127 to see the run closed")
    # Exactly once: no node was handed a round twice or skipped one, and each
    # watch delivered each signal once however often it was re-opened (the seal,
    # the leave, the close: at most 3 events, not one per reconnection).
    assert all(h.round == 1 for h in rest)
    events = sorted(h.watcher.events_received for h in rest)
    assert events[-1] <= 3, events[-10:]
    reopened = sum(h.watcher.watches_opened for h in rest) - sum(opened[:-1])
    record("128 nodes join at once; watches closed every 2s",
           fault="128 handler threads (min=max=128) join at once; the server ends every "
                 "watch after 2s",
           expected="one round of 128 (ranks 0-127); later signals reach every node exactly "
                    "once",
           observed=f"round 1 of 128 formed in {formed:.1f}s; after {reopened} watch re-opens "
                    f"a member left and all 127 saw it in {seen:.2f}s, then the close; <= "
                    f"{events[-1]} watch events per node",
           recovery_seconds=round(seen, 2))


# --------------------------------------------------------------------------- the run deleted


def test_a_lease_deleted_with_its_run_is_not_taken_again(
        make_handler: Any, cluster: Cluster, namespace: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The run, and with it the node's Lease, deleted between the node's join and its
    first LIST (the garbage collector and the operator delete a run's Leases with it).

    The node finds its request gone and writes it again; its Lease must not be
    made anew for a run that no longer exists (nothing would ever delete it, and
    the node would wait out its join timeout on a run nobody can see).
    """
    from elasticrun.handler.session import RunSession

    listing = RunSession.pending
    deleted: list[float] = []

    def pending(session: RunSession, run: Any) -> Any:
        if not deleted:
            cluster.client.request("DELETE", run_path(namespace, "gone"))
            cluster.client.request("DELETE", lease_path(namespace, lease_name("gone", "a")))
            deleted.append(time.monotonic())
        return listing(session, run)

    monkeypatch.setattr(RunSession, "pending", pending)
    # A status as the operator writes it: the node's narrow watch then cannot see the
    # deletion (a run without status.signal matches status.signal!=0, and would).
    create_run(cluster, namespace, "gone", minNodes=2, heartbeatTimeoutSeconds=10,
               leaseRenewIntervalSeconds=5)
    raw = cluster.client.request("GET", run_path(namespace, "gone"))
    raw["status"] = {"phase": "Pending", "round": 0, "signal": 0}
    cluster.client.request("PUT", run_path(namespace, "gone", "status"), body=raw)
    node = make_handler("gone", "a", min_nodes=2, join_timeout=30)
    thread, box = start_rendezvous(node)
    thread.join(20)
    error = box.get("error")
    assert isinstance(error, RendezvousClosedError), box
    assert "deleted" in str(error), error
    with pytest.raises(ApiError) as lease:
        cluster.client.request("GET", lease_path(namespace, lease_name("gone", "a")))
    assert lease.value.not_found


def test_run_deleted_mid_round_then_recreated(operator: OperatorProcess, make_handler: Any,
                                              cluster: Cluster, namespace: str) -> None:
    make = lambda n, **kw: make_handler("deleted", n, min_nodes=3,  # noqa: E731
                                        heartbeat_timeout=2, lease_renew_interval=1,
                                        **kw)  # the default watch_timeout (300 s)
    a, b = make("a"), make("b")
    threads = [start_rendezvous(h) for h in (a, b)]
    wait_for(lambda: _waiting(cluster, namespace, "deleted", "a", "b") == {"a", "b"}, 20,
             "a and b waiting")
    deleted_at = time.monotonic()
    cluster.kubectl("delete", "er", "deleted", "-n", namespace, "--wait=false")
    for thread, _ in threads:
        thread.join(30)
    failed = time.monotonic() - deleted_at
    for _, box in threads:
        error = box.get("error")
        assert isinstance(error, RendezvousClosedError), box
        assert "deleted" in str(error) and "re-create" in str(error), error
    # torch's launcher shuts the failed agents down; their pods restart as new agents.
    for h in (a, b):
        h.shutdown()
    # Re-created: a new run starts clean, and the restarted agents form round 1 in it.
    create_run(cluster, namespace, "deleted", minNodes=2, **FAST)
    fresh = read_run(cluster.client, namespace, "deleted")
    assert fresh.status.round == 0 and fresh.status.participants == ()
    again, c = make("a"), make("c")
    outcomes = rendezvous_all([again, c], timeout=60)
    assert_all_ok(outcomes)
    got = {h.settings.node_name: (h.round, outcomes[h.settings.node_name].rank,
                                  outcomes[h.settings.node_name].world_size) for h in (again, c)}
    assert {r for r, _, _ in got.values()} == {1}, got  # one new round, the same for both
    assert sorted(rank for _, rank, _ in got.values()) == [0, 1], got
    assert {w for _, _, w in got.values()} == {2}, got
    run = read_run(cluster.client, namespace, "deleted")
    assert run.status.member_names == {"a", "c"}, run.status
    assert run.status.round == 1 and run.status.lost_members == (), run.status
    assert run.uid == fresh.uid  # the re-created object, not a leftover
    record("ElasticRun deleted mid-round, then re-created",
           fault="kubectl delete er with 2 of 3 nodes waiting",
           expected="every waiting node fails with an error that says the run was deleted; a "
                    "re-created run starts clean",
           observed=f"both waiting nodes got RendezvousClosedError ('... was deleted ... "
                    f"re-create it') after {failed:.1f}s; re-created run sealed round 1",
           recovery_seconds=round(failed, 2))


def test_dead_nodes_join_request_does_not_leak_into_a_recreated_run(
        make_handler: Any, processes: ProcessGroup, cluster: Cluster, namespace: str,
        tmp_path: Path) -> None:
    """A node SIGKILLed while waiting leaves a live-looking Lease behind (until it expires).

    If the run is deleted and re-created within that window, the dead node's
    join request belongs to the old run and must not make it a member of the
    new one (its Lease names the old run's uid as its owner).
    """
    create_run(cluster, namespace, "ghost", minNodes=2, maxNodes=2,
               heartbeatTimeoutSeconds=30, leaseRenewIntervalSeconds=5)
    dead = start_node(processes, cluster.kubeconfig, namespace, "ghost", "n0", tmp_path, "2:2")
    wait_for(lambda: is_waiting(cluster.client, namespace, "ghost", "n0"), 30, "n0 waiting")
    dead.kill()
    cluster.kubectl("delete", "er", "ghost", "-n", namespace)
    create_run(cluster, namespace, "ghost", minNodes=2, maxNodes=2,
               heartbeatTimeoutSeconds=30, leaseRenewIntervalSeconds=5)
    started = time.monotonic()
    nodes = [make_handler("ghost", n, min_nodes=2) for n in ("n1", "n2")]
    outcomes = rendezvous_all(nodes, timeout=60)
    assert_all_ok(outcomes)
    took = time.monotonic() - started
    assert sorted(o.rank for o in outcomes.values()) == [0, 1]
    assert {h.round for h in nodes} == {1}
    run = read_run(cluster.client, namespace, "ghost")
    assert run.status.member_names == {"n1", "n2"}, run.status
    record("SIGKILLed node's stale join vs a re-created run",
           fault="a waiting node SIGKILLed, the run deleted and re-created while the dead "
                 "node's Lease is still unexpired",
           expected="the dead node's request (owned by the old run) is ignored; the new "
                    "run's first round holds only live nodes",
           observed=f"round 1 of the new run = n1, n2 after {took:.1f}s",
           recovery_seconds=round(took, 2))
