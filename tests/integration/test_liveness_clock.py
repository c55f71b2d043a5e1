"""Liveness believes neither a node's clock nor a Pod's name (issue 20, cases 1 and 5).

Against the real operator and API server.

A Lease counts as renewed when its reader sees it change, timed by the
reader's clock.  These tests write a node's Lease by hand, as a node whose
clock runs 60 s fast or reads 2199 would (the admin token stands in for a
writer of the run: the admission policy lets the run's own writers through),
and check that the dead node is removed within the heartbeat of its last
renewal and that a ghost from 2199 is neither kept nor stops the real nodes.
A member's Pod is the one whose uid it recorded when it joined: another
user's Pod of the same name, with the run's label, removes nobody.
"""

from __future__ import annotations

import datetime as dt
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from elasticrun.api import crd
from elasticrun.api.gateway import RunGateway
from elasticrun.api.kube import (
    MERGE_PATCH,
    ApiError,
    KubeClient,
    lease_path,
    leases_path,
)
from elasticrun.api.leases import JOIN_ANNOTATION
from elasticrun.api.model import format_time, now
from elasticrun.api.naming import label_value, lease_name
from elasticrun.operator.controller import TRIM_CHECK_SECONDS, TRIM_QUIET_SECONDS

from chaoskit import assert_all_ok
from chartkit import account_client
from conftest import Cluster, consistently, wait_for
from controlplane.kubelet import Kubelet
from controlplane.operatorproc import OperatorProcess
from rdzv import is_waiting, read_run, rendezvous_all, spec_observed, start_rendezvous
from timings import RECONCILES, outlasting

pytestmark = pytest.mark.slow

HEARTBEAT = 6
FAR = dt.datetime(2199, 6, 1, tzinfo=dt.UTC)


class SkewedNode:
    """A node's Lease written by hand, by a clock that reads ``offset`` ahead (or ``fixed``)."""

    def __init__(self, client: KubeClient, namespace: str, run: str, node: str, uid: str,
                 *, offset: dt.timedelta = dt.timedelta(0), fixed: dt.datetime | None = None,
                 store_port: int = 1) -> None:
        self.client, self.namespace, self.run, self.node = client, namespace, run, node
        self.offset, self.fixed, self.uid, self.port = offset, fixed, uid, store_port
        self.path = lease_path(namespace, lease_name(run, node))
        self.renewals = 0

    def clock(self) -> dt.datetime:
        base = self.fixed if self.fixed is not None else now()
        return base + self.offset + dt.timedelta(microseconds=self.renewals)

    def join(self) -> None:
        stamp = format_time(self.clock())
        request = {"address": "127.0.0.1", "storePort": self.port, "since": stamp}
        self.client.request("POST", leases_path(self.namespace), body={
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": lease_name(self.run, self.node),
                         "labels": {crd.RUN_LABEL: label_value(self.run)},
                         "annotations": {crd.RUN_LABEL: self.run, crd.NODE_ANNOTATION: self.node,
                                         JOIN_ANNOTATION: json.dumps(request)},
                         "ownerReferences": [{"apiVersion": crd.API_VERSION, "kind": crd.KIND,
                                              "name": self.run, "uid": self.uid}]},
            "spec": {"holderIdentity": f"{self.node}@skewed", "leaseDurationSeconds": HEARTBEAT,
                     "acquireTime": stamp, "renewTime": stamp}})

    def renew(self) -> None:
        self.renewals += 1
        self.client.request("PATCH", self.path, body={"spec": {
            "renewTime": format_time(self.clock())}}, content_type=MERGE_PATCH)


def _start_waiting(make_handler: Any, cluster: Cluster, namespace: str, run: str,
                   names: list[str], **conf: Any
                   ) -> tuple[list[Any], list[tuple[threading.Thread, dict[str, Any]]]]:
    nodes = [make_handler(run, name, **conf) for name in names]
    started = [start_rendezvous(node) for node in nodes]
    for name in names:
        wait_for(lambda name=name: is_waiting(cluster.client, namespace, run, name), 20,
                 f"{name} to ask to join")
    return nodes, started


def _announce(cluster: Cluster, namespace: str, run: str) -> None:
    """Bump the run's signal, as a joining agent does, so the waiting nodes list again.

    The patch tests the status's counters, which exist once the operator has
    written the run's first status: a JSON-patch ``test`` of a missing field
    fails like a moved one (422), so under load, when the operator starts
    slowly, the announce waits for that status first.
    """
    wait_for(lambda: spec_observed(cluster.client, namespace, run), 30,
             "the operator's first status of the run")
    gateway = RunGateway(cluster.client, namespace, run)
    for _ in range(10):
        if gateway.announce(read_run(cluster.client, namespace, run).status) is not None:
            return
    raise AssertionError("the announce kept failing its tests")


@pytest.mark.parametrize("clock", ["60s-fast", "year-2199"])
def test_a_dead_node_is_removed_within_the_heartbeat_whatever_its_clock(
        operator: OperatorProcess, make_handler: Any, cluster: Cluster, namespace: str,
        clock: str) -> None:
    run_name = f"skew-{clock[:3].rstrip('-')}"
    conf = {"min_nodes": 3, "max_nodes": 3, "heartbeat_timeout": HEARTBEAT,
            "lease_renew_interval": 1, "last_call_timeout": 1}
    real, started = _start_waiting(make_handler, cluster, namespace, run_name, ["a", "b"],
                                   **conf)
    run = read_run(cluster.client, namespace, run_name)
    assert run.uid is not None
    skewed = SkewedNode(cluster.client, namespace, run_name, "skewed", run.uid,
                        offset=dt.timedelta(seconds=60) if clock == "60s-fast"
                        else dt.timedelta(0), fixed=FAR if clock == "year-2199" else None)
    skewed.join()
    # As a node's agent does, it tells the waiting nodes it is there.
    _announce(cluster, namespace, run_name)
    for thread, _ in started:
        thread.join(30)
    outcomes = [box for _, box in started]
    assert all("info" in box for box in outcomes), outcomes
    assert sorted((box["info"].rank, box["info"].world_size) for box in outcomes) == [
        (0, 3), (1, 3)]
    sealed = read_run(cluster.client, namespace, run_name)
    assert [(p.name, p.rank) for p in sealed.status.participants] == [
        ("a", 0), ("b", 1), ("skewed", 2)]
    for _ in range(3):  # alive for a while, then the node dies
        time.sleep(1)
        skewed.renew()
    died = time.monotonic()

    def lost() -> bool:
        return "skewed" in {m.name for m in read_run(cluster.client, namespace, run_name)
                            .status.lost_members}

    wait_for(lost, HEARTBEAT + 10, "the dead node to be removed")
    removed_after = time.monotonic() - died
    final = read_run(cluster.client, namespace, run_name)
    assert [(m.name, m.reason) for m in final.status.lost_members] == [
        ("skewed", "LeaseExpired")]
    assert removed_after < HEARTBEAT + 2, removed_after
    assert removed_after > HEARTBEAT - 1, removed_after  # it was alive while it renewed
    # The survivors and a newcomer form the next round: survivors keep their ranks.
    again = rendezvous_all([*real, make_handler(run_name, "c", **conf)], timeout=30)
    assert_all_ok(again)
    assert {name: (o.rank, o.world_size) for name, o in again.items()} == {
        "a": (0, 3), "b": (1, 3), "c": (2, 3)}


def test_a_ghost_lease_renewed_in_2199_is_neither_kept_nor_stalls_the_real_nodes(
        operator: OperatorProcess, make_handler: Any, cluster: Cluster,
        namespace: str) -> None:
    """The issue's ghost: sealed as rank 0 with store port 1, renewTime in 2199, never renewed.

    Before, it never expired: the three real nodes raised RendezvousConnectionError.
    """
    run_name = "ghost2199"
    conf = {"min_nodes": 3, "max_nodes": 4, "heartbeat_timeout": HEARTBEAT,
            "lease_renew_interval": 1, "last_call_timeout": 1}
    cluster.client.request("POST", f"/apis/{crd.API_VERSION}/namespaces/{namespace}/"
                                   f"{crd.PLURAL}", body={
        "apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": run_name},
        "spec": {"minNodes": 3, "maxNodes": 4, "heartbeatTimeoutSeconds": HEARTBEAT,
                 "leaseRenewIntervalSeconds": 1, "lastCallTimeoutSeconds": 1}})
    run = read_run(cluster.client, namespace, run_name)
    assert run.uid is not None
    SkewedNode(cluster.client, namespace, run_name, "ghost", run.uid, fixed=FAR,
               store_port=1).join()  # created first: rank 0 of any round it is in
    nodes = [make_handler(run_name, f"real-{i}", **conf) for i in range(3)]
    started = time.monotonic()
    outcomes = rendezvous_all(nodes, timeout=60)
    assert_all_ok(outcomes)
    assert sorted((o.rank, o.world_size) for o in outcomes.values()) == [(0, 3), (1, 3), (2, 3)]
    final = read_run(cluster.client, namespace, run_name)
    assert final.status.member_names == {"real-0", "real-1", "real-2"}
    assert time.monotonic() - started < 4 * HEARTBEAT
    # The ghost is gone for good: its Lease deleted, never waiting again.
    wait_for(lambda: "ghost" not in {
        lease.get("metadata", {}).get("annotations", {}).get(crd.NODE_ANNOTATION)
        for lease in cluster.client.request("GET", leases_path(namespace))["items"]},
        HEARTBEAT + 5, "the ghost's Lease to be deleted")

    def settled() -> bool:
        last = read_run(cluster.client, namespace, run_name)
        return (last.status.round == final.status.round
                and "ghost" not in last.status.waiting_names | last.status.member_names)

    consistently(settled, RECONCILES, "the ghost's deletion moved the round or it came back")


def _pod_maker(cluster: Cluster, namespace: str, tmp_path: Path) -> KubeClient:
    """Another user of the namespace: a ServiceAccount that may create and delete Pods."""
    return account_client(cluster, namespace, "pod-maker",
                          [{"apiGroups": [""], "resources": ["pods"],
                            "verbs": ["create", "delete", "get"]}], tmp_path)


def _gone(cluster: Cluster, path: str) -> bool:
    try:
        cluster.client.request("GET", path)
    except ApiError as exc:
        if exc.not_found:
            return True
        raise
    return False


def test_a_namesake_pod_of_another_user_removes_no_member(
        operator: OperatorProcess, make_handler: Any, pods: Kubelet, cluster: Cluster,
        namespace: str, tmp_path: Path) -> None:
    """Members record their Pod's uid (POD_UID); only that Pod's events are their loss.

    p0 and p1 run in Pods of their names.  m2's Pod is not in this namespace
    under its recorded name (as for a node whose Pod lives elsewhere), so
    another user can create a Pod of that name, with the run's label, and
    delete it: before, that removed m2 (``PodDeleted``).
    """
    run_name = "podid"
    uids = {name: pods.create(name, run_name)["metadata"]["uid"] for name in ("p0", "p1")}
    uids["m2-pod"] = "5f0c5a8e-0000-4000-8000-000000000002"
    conf = {"min_nodes": 3, "max_nodes": 3, "heartbeat_timeout": HEARTBEAT,
            "lease_renew_interval": 1, "last_call_timeout": 1}
    nodes = [make_handler(run_name, node, pod=pod, pod_uid=uids[pod], **conf)
             for node, pod in (("p0", "p0"), ("p1", "p1"), ("m2", "m2-pod"))]
    assert_all_ok(rendezvous_all(nodes, timeout=30))
    sealed = read_run(cluster.client, namespace, run_name)
    assert {p.name: p.pod_uid for p in sealed.status.participants} == {
        "p0": uids["p0"], "p1": uids["p1"], "m2": uids["m2-pod"]}
    other = _pod_maker(cluster, namespace, tmp_path)
    other.request("POST", f"/api/v1/namespaces/{namespace}/pods", body={
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "m2-pod", "labels": {crd.RUN_LABEL: run_name}},
        "spec": {"schedulerName": "nobody", "containers": [
            {"name": "x", "image": "busybox", "command": ["sleep", "1"]}]}})
    other.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/m2-pod",
                  query={"gracePeriodSeconds": 0})
    wait_for(lambda: _gone(cluster, pods.path("m2-pod")), 10, "the namesake Pod to be deleted")

    def kept() -> bool:
        after = read_run(cluster.client, namespace, run_name)
        return (after.status.lost_members == () and after.status.round == sealed.status.round
                and after.status.member_names == {"p0", "p1", "m2"})

    # A Pod loss is acted on as its event arrives (the control below shows it): a few
    # reconciles are longer than that.
    consistently(kept, RECONCILES, "the namesake Pod's deletion removed a member")
    # The member's own Pod still counts: deleting p1's Pod removes p1 at once.
    pods.delete("p1")
    wait_for(lambda: read_run(cluster.client, namespace, run_name).status.lost_members != (),
             10, "p1's loss")
    lost = read_run(cluster.client, namespace, run_name).status.lost_members
    assert [(m.name, m.reason) for m in lost] == [("p1", "PodDeleted")]


def _pod_gone(client: KubeClient, namespace: str, pod: str) -> bool:
    try:
        client.request("GET", f"/api/v1/namespaces/{namespace}/pods/{pod}")
    except ApiError as exc:
        return exc.status == 404
    return False


def test_a_namesake_pod_removes_no_member_that_named_no_pod(
        operator: OperatorProcess, make_handler: Any, pods: Kubelet, cluster: Cluster,
        namespace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node started without ``pod``/``POD_NAME`` has no Pod (issue 35, case A).

    q1 runs outside any Pod: its node name was read as a pod name, so another
    user who may create Pods made one named ``q1`` with the run's label and
    deleted it, and the operator removed q1 (``PodDeleted``).  Now no Pod is
    q1's: nobody is removed, even after the heartbeat (the Lease timer q1's
    liveness rests on) has passed several times.  The positive control is the
    same kind of loss for a member that named its Pod: deleting q0's own Pod
    removes q0 with ``PodDeleted`` at once.
    """
    monkeypatch.delenv("POD_NAME", raising=False)
    monkeypatch.delenv("POD_UID", raising=False)
    run_name = "nopod"
    q0_uid = pods.create("q0", run_name)["metadata"]["uid"]
    conf = {"min_nodes": 2, "max_nodes": 2, "heartbeat_timeout": HEARTBEAT,
            "lease_renew_interval": 1, "last_call_timeout": 1}
    nodes = [make_handler(run_name, "q0", pod="q0", pod_uid=q0_uid, **conf),
             make_handler(run_name, "q1", **conf)]
    assert_all_ok(rendezvous_all(nodes, timeout=30))
    sealed = read_run(cluster.client, namespace, run_name)
    assert {(p.name, p.pod, p.pod_uid) for p in sealed.status.participants} == {
        ("q0", "q0", q0_uid), ("q1", None, None)}
    other = _pod_maker(cluster, namespace, tmp_path)
    for phase in ("created and deleted", "created, failed and deleted"):
        made = other.request("POST", f"/api/v1/namespaces/{namespace}/pods", body={
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "q1", "labels": {crd.RUN_LABEL: run_name}},
            "spec": {"schedulerName": "nobody", "containers": [
                {"name": "x", "image": "busybox", "command": ["sleep", "1"]}]}})
        assert made["metadata"]["name"] == "q1", phase
        if "failed" in phase:  # the kubelet's word, as a node's kubelet could say it
            pods.set_status("q1", {"phase": "Failed", "reason": "Evicted"})
            time.sleep(1)
        other.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/q1",
                      query={"gracePeriodSeconds": 0})
        wait_for(lambda: _pod_gone(other, namespace, "q1"), 10, "the namesake Pod to go")
    # Longer than every timer the member's liveness now depends on: its Lease's heartbeat
    # (6 s), with the operator's reconcile after it.
    time.sleep(2 * HEARTBEAT + 2)
    after = read_run(cluster.client, namespace, run_name)
    assert after.status.lost_members == ()
    assert after.status.member_names == {"q0", "q1"}
    assert after.status.round == sealed.status.round
    pods.delete("q0")
    wait_for(lambda: read_run(cluster.client, namespace, run_name).status.lost_members != (),
             10, "q0's loss")
    lost = read_run(cluster.client, namespace, run_name).status.lost_members
    assert [(m.name, m.reason) for m in lost] == [("q0", "PodDeleted")]


# --------------------------------------------------------------------------- junk Leases


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def _settled_rss(pid: int, seconds: float = 20) -> float:
    """The operator's RSS once it stopped changing by more than 1 MiB a second (bounded)."""
    deadline, last = time.monotonic() + seconds, _rss_mib(pid)
    while time.monotonic() < deadline:
        time.sleep(1)
        current = _rss_mib(pid)
        if abs(current - last) < 1:
            return current
        last = current
    return last


JUNK = 2000


def test_junk_leases_bound_the_operators_events_and_memory(
        operator: OperatorProcess, cluster: Cluster, namespace: str) -> None:
    """2,000 labelled Leases nobody needs: half with unreadable join requests for a real
    run, half naming runs that do not exist, each carrying 4 KiB.  Before, the operator
    posted an Event for each and kept what it learnt of them after they were deleted."""
    from concurrent.futures import ThreadPoolExecutor

    from elasticrun.operator.runobjects import PROBLEM_EVENTS_PER_RUN

    admin = cluster.client
    admin.request("POST", f"/apis/{crd.API_VERSION}/namespaces/{namespace}/{crd.PLURAL}", body={
        "apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": "junkrun"},
        "spec": {"minNodes": 2}})
    run = read_run(admin, namespace, "junkrun")
    # The operator has taken the run up (its status written) before the baseline.
    wait_for(lambda: spec_observed(admin, namespace, "junkrun"), 10, "the run's status")
    baseline = _settled_rss(operator.pid)
    padding = "p" * 4096

    def junk(i: int) -> None:
        run_name = "junkrun" if i % 2 == 0 else f"nosuchrun-{i}"
        admin.request("POST", leases_path(namespace), body={
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": f"{run_name}.junk-{i}",
                         "labels": {crd.RUN_LABEL: label_value(run_name)},
                         "annotations": {crd.RUN_LABEL: run_name,
                                         crd.NODE_ANNOTATION: f"junk-{i}",
                                         JOIN_ANNOTATION: "not json " + padding[:2000],
                                         "example.com/padding": padding},
                         "ownerReferences": [{"apiVersion": crd.API_VERSION, "kind": crd.KIND,
                                              "name": "junkrun", "uid": run.uid}]},
            "spec": {"holderIdentity": f"junk-{i}", "renewTime": format_time(now())}})

    started = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(junk, range(JUNK)))
    created_in = time.monotonic() - started
    peak = _settled_rss(operator.pid, 60)

    def unreadable_events() -> int:
        items = admin.request("GET", f"/api/v1/namespaces/{namespace}/events",
                              query={"fieldSelector": "reason=UnreadableJoin"})["items"]
        return len(items)

    wait_for(lambda: unreadable_events() >= PROBLEM_EVENTS_PER_RUN + 1, 60,
             "the capped UnreadableJoin Events and their summary")
    def capped() -> bool:
        got = unreadable_events()
        assert got == PROBLEM_EVENTS_PER_RUN + 1, (
            f"{got} UnreadableJoin Events: more than {PROBLEM_EVENTS_PER_RUN} and the summary")
        return True

    # The cap holds while the operator works through the rest of the 2,000 Leases.
    consistently(capped, outlasting(RECONCILES), "more UnreadableJoin Events than the cap",
                 interval=0.5)
    events = unreadable_events()
    admin.request("DELETE", leases_path(namespace),
                  query={"labelSelector": crd.RUN_LABEL})
    wait_for(lambda: not admin.request("GET", leases_path(namespace),
                                       query={"labelSelector": crd.RUN_LABEL})["items"],
             60, "the junk Leases to be deleted")
    # Freed memory is handed back once the operator saw no Lease deleted for
    # TRIM_QUIET_SECONDS, checked every TRIM_CHECK_SECONDS. Nothing outside the operator
    # shows the trim, and an RSS read before it (the deletions' events still arriving)
    # says nothing about it: the window outlasts the timer, counted from the last
    # deletion the API server made, plus the events' delivery.
    time.sleep(outlasting(TRIM_QUIET_SECONDS + TRIM_CHECK_SECONDS) + 3)
    after = _settled_rss(operator.pid, 60)
    print(f"\noperator RSS: baseline {baseline:.1f} MiB, with {JUNK} junk Leases {peak:.1f} "
          f"MiB, after deleting them {after:.1f} MiB; UnreadableJoin Events {events}; "
          f"created in {created_in:.1f}s")
    assert events == PROBLEM_EVENTS_PER_RUN + 1, events
    assert after < baseline + 40, (baseline, peak, after)
    # The run itself is untouched and still reconciled.
    final = read_run(admin, namespace, "junkrun")
    assert final.status.member_names == frozenset() and final.status.waiting == ()
