"""The chart's two operator replicas on the real node: the leader's pod deleted mid-run.

The chart is installed with ``deploy/local/values.yaml`` (``nodefixtures``): two
replicas under leader election, both in the node's network namespace, sharing
the health, metrics and webhook ports (``--reuse-port``).  A Job's torchrun
pods train; the leader's pod is deleted; the other replica must hold the Lease
within the lease duration, keep the webhook answering and still remove a member
lost after the switch, and no replica may write a run or post an Event the
other already did.  The API-server-only cases (a frozen leader, fencing, the
shared CA) are in ``test_leader.py``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from elasticrun.api.model import ElasticRun

from conftest import Cluster, consistently, wait_for
from controlplane.node import NODE_NAME
from leaderkit import agent_of, by_agent, holder, mutated_on_dry_run, run_writes
from nodekit import (
    EXAMPLES,
    LONG_TRAINING,
    RELEASE_NAMESPACE,
    apply_example,
    create_run,
    delete_member,
    elastic_run,
    logs,
    lost_reasons,
    operator_pods,
    round_with,
)
from rdzv import AuditLog
from timings import RECONCILES, outlasting

pytest_plugins = ("nodefixtures",)
pytestmark = [pytest.mark.node, pytest.mark.slow]

#: The chart's operator.leaderElection.leaseDuration (seconds).
LEASE_DURATION = 15.0


@pytest.fixture
def operator_logs_on_failure(node_cluster: Cluster,
                             request: pytest.FixtureRequest) -> Iterator[None]:
    """The operator pods' states and log tails when the test failed."""
    yield
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        for pod in operator_pods(node_cluster):
            name = pod["metadata"]["name"]
            print(f"\n--- {name}: {(pod.get('status') or {}).get('conditions')}\n"
                  f"{logs(node_cluster, RELEASE_NAMESPACE, name)[-4000:]}")


def ready_operators(cluster: Cluster, without: str = "") -> list[str] | None:
    """The names of two Ready, not terminating operator pods (other than ``without``)."""
    names = [p["metadata"]["name"] for p in operator_pods(cluster)
             if p["metadata"]["name"] != without and not p["metadata"].get("deletionTimestamp")
             and any(c["type"] == "Ready" and c["status"] == "True"
                     for c in (p.get("status") or {}).get("conditions") or [])]
    return names if len(names) == 2 else None


def started(cluster: Cluster) -> bool:
    """Two Ready replicas that both finished their start-up (elector and listeners up:
    the operator logs its metrics address last).  Ready alone says little on this
    node: the readiness probe's port is shared, so a replica whose own webhook is not
    up yet passes it on the other's."""
    names = ready_operators(cluster) or []
    return len(names) == 2 and all(
        "metrics on " in logs(cluster, RELEASE_NAMESPACE, name) for name in names)


def pod_of(holder_name: str) -> str:
    """The pod a Lease holder name belongs to (``elector.identity``: ``POD_NAME_suffix``)."""
    return holder_name.rsplit("_", 1)[0]


def messages(cluster: Cluster, namespace: str, reason: str) -> list[str]:
    """Every Event of ``reason`` in ``namespace``, once per posting (counts included)."""
    got = cluster.client.request("GET", f"/api/v1/namespaces/{namespace}/events",
                                 query={"fieldSelector": f"reason={reason}"})
    return [e["message"] for e in got.get("items") or [] for _ in range(e.get("count") or 1)]


def writers(audit: AuditLog, namespace: str, since: int) -> dict[str, list[str]]:
    """The operators' writes of runs since ``since``, by user agent (one per replica)."""
    return {agent: writes for agent, entries in by_agent(audit, namespace, since).items()
            if (writes := run_writes(entries))}


def delete_the_leader(cluster: Cluster, namespace: str, run: str, leader_pod: str,
                      first_holder: str) -> tuple[float, str, list[float]]:
    """Delete the leader's pod; until another replica holds the Lease, the deleted
    pod is gone and its replacement is Ready, create an opted-in pod (dry run) every
    0.2 s, each of which must come back mutated.  The take-over time, the new holder,
    and when each probe was sent.

    The node is cordoned until the take-over: the Deployment's replacement pod stays
    Pending meanwhile, so the Lease can only go to the surviving replica (a
    replacement that starts within a retry period could otherwise win it first)."""
    cluster.kubectl("cordon", NODE_NAME)
    try:
        deleted = time.monotonic()
        cluster.kubectl("delete", "pod", "-n", RELEASE_NAMESPACE, leader_pod, "--wait=false")
        took: float | None = None
        new_holder: str | None = None
        probes: list[float] = []
        while True:
            since = time.monotonic() - deleted
            served, error = mutated_on_dry_run(cluster, namespace, run)
            assert served, f"{since:.2f}s after the delete: {error}"
            probes.append(since)
            if new_holder is None:
                current = holder(cluster.client, RELEASE_NAMESPACE)
                if current not in (None, first_holder):
                    took, new_holder = time.monotonic() - deleted, current
                    cluster.kubectl("uncordon", NODE_NAME)  # the replacement may start
            gone = leader_pod not in {p["metadata"]["name"] for p in operator_pods(cluster)}
            if took is not None and new_holder is not None and gone and started(cluster):
                # The old pod's process has exited (its listeners closed) and the
                # replacement replica has joined the shared ports: both run again.
                return took, new_holder, probes
            assert since < LEASE_DURATION + 150, "the switch did not finish"
            time.sleep(0.2)
    finally:
        cluster.kubectl("uncordon", NODE_NAME)


@pytest.mark.timeout(600)  # the node's start, a run forming twice, the switch
def test_the_leaders_pod_deleted_mid_run_the_other_replica_takes_over(
        node_cluster: Cluster, node_namespace: str, operator_logs_on_failure: None) -> None:
    ns, run = node_namespace, "llama-job"
    cluster = node_cluster
    local = cluster.require_local()
    assert local.state is not None
    audit = AuditLog(local.state.audit_log)
    wait_for(lambda: ready_operators(cluster), 180, "both operator replicas Ready", interval=1)
    first_holder = wait_for(lambda: holder(cluster.client, RELEASE_NAMESPACE), 60,
                            "a replica to hold the leader Lease", interval=0.5)
    leader_pod = pod_of(first_holder)
    (follower_pod,) = [n for n in ready_operators(cluster) or [] if n != leader_pod]
    wait_for(lambda: started(cluster), 120, "both replicas to finish their start-up",
             interval=1)
    mark = audit.mark()

    # A run of real torchrun pods forms (the Job's two pods, mutated by the webhook).
    create_run(cluster, ns, elastic_run(run, 2, 4))
    apply_example(cluster, ns, EXAMPLES / "job.yaml", LONG_TRAINING)
    first: ElasticRun = wait_for(lambda: round_with(cluster, ns, run, 2), 240,
                                 "the Job's two pods in one round", interval=0.5)
    assert sorted(p.rank for p in first.status.participants) == [0, 1]
    survivor, victim = (p.name for p in first.status.participants)
    wait_for(lambda: "epoch 2 done" in logs(cluster, ns, survivor), 180,
             "training to be under way", interval=1)

    # While both ran, only the leader wrote runs.
    before = writers(audit, ns, mark)
    assert set(before) == {agent_of(first_holder)}, before
    # The leader's pod is deleted; a pod created at any moment of the switch is mutated.
    before_switch = audit.mark()
    took, new_holder, probes = delete_the_leader(cluster, ns, run, leader_pod, first_holder)
    print(f"\nleader pod {leader_pod} deleted -> {pod_of(new_holder)} holds the Lease after "
          f"{took:.2f}s (lease duration {LEASE_DURATION:g}s); {len(probes)} pods created "
          f"over {probes[-1]:.1f}s, every one mutated")
    assert pod_of(new_holder) == follower_pod
    assert took <= LEASE_DURATION
    # Since the delete: the old leader (until it stopped) and the new one, nobody else.
    after_delete = set(writers(audit, ns, before_switch))
    assert after_delete <= {agent_of(first_holder), agent_of(new_holder)}, after_delete

    # A member lost after the switch is still removed, by the new leader alone.
    switched = audit.mark()
    print(f"member {victim} deleted -> removed after "
          f"{delete_member(cluster, ns, run, victim):.2f}s")
    # minNodes 2: the survivor and the Job's replacement pod (mutated by the webhook) re-form.
    reformed: ElasticRun = wait_for(
        lambda: round_with(cluster, ns, run, 2, after=first.status.round, without=victim,
                           including=survivor), 240,
        f"a round of {survivor} and the replacement of {victim}", interval=0.5)
    assert sorted(p.rank for p in reformed.status.participants) == [0, 1]
    assert len(reformed.status.participants) == 2  # the world size torchrun gets
    # A second writer would still post as it reacts to the same changes: a few reconciles
    # (the pods here are real, the machine busy: a margin more).
    consistently(lambda: lost_reasons(cluster, ns, run, victim) == ["PodDeleted"],
                 outlasting(RECONCILES), f"{victim} removed twice")
    assert lost_reasons(cluster, ns, run, victim) == ["PodDeleted"]  # removed once
    writes = writers(audit, ns, switched)
    assert set(writes) == {agent_of(new_holder)}, writes
    # Each removal and each seal reported once, by whichever replica led at the time.
    lost_events = [m for m in messages(cluster, ns, "MemberLost") if f" {victim} " in m]
    assert len(lost_events) == 1, lost_events
    sealed = messages(cluster, ns, "RoundSealed")
    assert len(sealed) == len(set(sealed)), sealed
    assert any(m.startswith(f"round {reformed.status.round}:") for m in sealed), sealed

