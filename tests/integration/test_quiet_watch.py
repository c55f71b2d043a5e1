"""A member's quiet watch of a large run, as the real API server serves it.

``status.stableRound`` is a selectable field of the CRD; a member of round R
watches the run's metadata with ``status.stableRound!=R``
(``RunGateway.watch_round``).  The API server must send it nothing while the
round stays undisturbed, whatever else is written, and one small event (the
run's metadata, never the roster) when the round loses a member.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from elasticrun.api import rounds
from elasticrun.api.gateway import RunGateway
from elasticrun.api.kube import lease_path, leases_path
from elasticrun.api.model import (
    Participant,
    RunSpec,
    RunStatus,
    StoreAddress,
    WaitingNode,
    now,
    parse_run,
)
from elasticrun.handler.watcher import RunWatcher

from conftest import Cluster, wait_for

MEMBERS = 256
#: Bound on the events the watch is given to arrive in.
BOUND = 10.0


def sealed_round(members: int) -> RunStatus:
    """Round 1 of ``members`` nodes, each with a roster entry as long as a real one."""
    return RunStatus(phase="Running", round=1, signal=1, store=StoreAddress("10.0.0.1", 29400),
                     sealed_at=now(), participants=tuple(
                         Participant(name=f"node-{i:04d}", rank=i, pod=f"job-worker-{i}-a1b2c",
                                     pod_uid=f"0b6c1a8e-1f1d-4c36-9c55-{i:012d}", since=now())
                         for i in range(members)))


def collecting(watch: Any) -> tuple[list[tuple[str, dict[str, Any]]], threading.Thread]:
    """The events ``watch`` sends (bookmarks apart), gathered by a thread of their own."""
    events: list[tuple[str, dict[str, Any]]] = []

    def collect() -> None:
        for event in watch:
            if event.get("type") != "BOOKMARK":
                events.append((str(event["type"]), event["object"]))

    reader = threading.Thread(target=collect, daemon=True)
    reader.start()
    return events, reader


def write(gateway: RunGateway, status: RunStatus) -> dict[str, Any]:
    current = gateway.read()
    assert current is not None
    written = gateway.replace_status(current["metadata"]["resourceVersion"], status.to_dict(),
                                     "elasticrun-tests")
    assert written is not None
    return written


def test_a_loss_sends_one_small_event_to_a_quiet_member_and_nothing_else_does(
        cluster: Cluster, namespace: str) -> None:
    gateway = RunGateway(cluster.client, namespace, "quiet")
    assert gateway.create(RunSpec(min_nodes=1, max_nodes=MEMBERS)) is not None
    status = sealed_round(MEMBERS)
    full = write(gateway, status)
    assert full["status"]["stableRound"] == 1
    events: list[tuple[str, int, dict[str, Any]]] = []
    watch = gateway.watch_round(1, 30)

    def collect() -> None:
        for event in watch:
            if event.get("type") != "BOOKMARK":
                events.append((str(event["type"]), len(json.dumps(event)), event["object"]))

    reader = threading.Thread(target=collect, daemon=True)
    reader.start()
    watcher = RunWatcher(gateway, watch_timeout=30)
    watcher.offer(full)
    watcher.start()
    try:
        watcher.watch_quietly(1)
        # Undisturbed: a Lease renewed, a spare's request summarised, the same status again.
        cluster.client.request("POST", leases_path(namespace), body={
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": "quiet.node-0001"}, "spec": {"holderIdentity": "node-0001"}})
        cluster.client.request("PATCH", lease_path(namespace, "quiet.node-0001"),
                               body={"spec": {"renewTime": "2026-01-01T00:00:00.000000Z"}},
                               content_type="application/merge-patch+json")
        write(gateway, status.replace(waiting=(
            WaitingNode(name="spare", address="10.0.0.9", store_port=1, since=now()),)))
        write(gateway, status)
        time.sleep(1.0)
        assert events == []
        assert not watcher.disturbed(1)
        # The loss: one event, the run's metadata only, and the watcher says so.
        lost = rounds.remove_member(status, "node-0007", rounds.LEASE_EXPIRED, now())
        assert lost is not None
        written = write(gateway, lost)
        wait_for(lambda: events, BOUND, "the loss's event")
        wait_for(lambda: watcher.disturbed(1), BOUND, "the watcher to hear of the loss")
        time.sleep(0.5)
    finally:
        watch.close()
        watcher.stop()
        reader.join(BOUND)
    assert len(events) == 1
    kind, size, obj = events[0]
    assert (kind, obj["kind"], obj["metadata"]["resourceVersion"]) == (
        "ADDED", "PartialObjectMetadata", written["metadata"]["resourceVersion"])
    assert "status" not in obj and "spec" not in obj
    roster = len(json.dumps(written))
    assert roster > 40_000 and size < 4_000, (roster, size)
    # The watcher holds the copy from before: the member reads the run when it asks again,
    # no older than the event (from the API server's cache), and finds the loss.
    assert watcher.latest is not None and parse_run(full).resource_version == \
        watcher.latest.resource_version
    assert watcher.disturbed_version == written["metadata"]["resourceVersion"]
    read = gateway.read(not_older_than=watcher.disturbed_version)
    assert read is not None and parse_run(read).status.restart_round == 1


def test_the_watch_for_the_end_sends_nothing_while_the_run_goes_on_and_metadata_once_closed(
        cluster: Cluster, namespace: str) -> None:
    """A rejoining member's watch (``RunGateway.watch_end``): the API server takes its
    selector (every phase of a run that goes on, each as ``!=``) and sends nothing for
    a loss, a re-formed round or a degraded phase, then the run's metadata once closed."""
    gateway = RunGateway(cluster.client, namespace, "ending")
    assert gateway.create(RunSpec(min_nodes=1, max_nodes=MEMBERS)) is not None
    status = sealed_round(8)
    write(gateway, status)
    watch = gateway.watch_end(30)
    events, reader = collecting(watch)
    try:
        lost = rounds.remove_member(status, "node-0003", rounds.LEASE_EXPIRED, now())
        assert lost is not None
        write(gateway, lost.replace(phase="Degraded"))
        write(gateway, sealed_round(7).replace(round=2, signal=2))
        time.sleep(1.0)
        assert events == []
        closed = rounds.close(parse_run(gateway.read() or {}), now())
        assert closed is not None
        written = write(gateway, closed)
        wait_for(lambda: events, BOUND, "the close's event")
        time.sleep(0.5)
    finally:
        watch.close()
        reader.join(BOUND)
    assert len(events) == 1
    kind, obj = events[0]
    assert (kind, obj["kind"], obj["metadata"]["resourceVersion"]) == (
        "ADDED", "PartialObjectMetadata", written["metadata"]["resourceVersion"])


def test_the_watch_for_the_run_to_settle_sends_the_next_seal_once_and_nothing_before(
        cluster: Cluster, namespace: str) -> None:
    """A woken member's watch (``RunGateway.watch_settled``): the API server takes its
    selector (``status.stableRound!=0``) and sends nothing for the disturbance, nor for
    writes while the round re-forms, then the whole run as the next seal wrote it;
    opened on a run that has already settled, the run as it is now."""
    gateway = RunGateway(cluster.client, namespace, "settling")
    assert gateway.create(RunSpec(min_nodes=1, max_nodes=MEMBERS)) is not None
    status = sealed_round(8)
    write(gateway, status)
    lost = rounds.remove_member(status, "node-0003", rounds.LEASE_EXPIRED, now())
    assert lost is not None
    write(gateway, lost)
    watch = gateway.watch_settled(30)
    events, reader = collecting(watch)
    try:
        write(gateway, lost.replace(phase="Degraded", waiting=(
            WaitingNode(name="node-0001", address="10.0.0.2", store_port=29401, since=now()),)))
        time.sleep(1.0)
        assert events == []  # positive control below: the same watch sends the seal
        resealed = write(gateway, sealed_round(7).replace(round=2, signal=3))
        wait_for(lambda: events, BOUND, "the seal's event")
    finally:
        watch.close()  # the watcher closes it at its first event
        reader.join(BOUND)
    kind, obj = events[0]
    assert (kind, obj["kind"], obj["metadata"]["resourceVersion"]) == (
        "ADDED", "ElasticRun", resealed["metadata"]["resourceVersion"])
    assert parse_run(obj).status.assignment("node-0006") is not None  # the roster, whole
    late = gateway.watch_settled(30)
    try:
        first = next(e for e in late if e.get("type") != "BOOKMARK")
    finally:
        late.close()
    assert (first["type"], parse_run(first["object"]).status.round) == ("ADDED", 2)
