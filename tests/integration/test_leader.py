"""Two real operator processes under leader election, against the real API server.

Short election timings (lease 4 s, renew deadline 3 s, retry 0.5 s) keep the
tests quick; the rules are the same as with client-go's defaults.  Each
replica's requests are told apart in the audit log by its user agent, which
carries its Lease holder name.
"""

from __future__ import annotations

import base64
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elasticrun.api import crd
from elasticrun.api.gateway import RunGateway
from elasticrun.api.kube import OPERATOR_USER_AGENT, ApiError, delete_preconditions, lease_path
from elasticrun.api.model import format_time, now, parse_run
from elasticrun.operator import webhook
from elasticrun.operator.elector import LEASE_NAME

from chartkit import (
    Helm,
    account_client,
    apply,
    by_kind,
    delete_cluster_scoped,
    refusals,
    request_token,
    token_kubeconfig,
)
from conftest import Cluster, consistently, wait_for
from controlplane.operatorproc import OperatorProcess, free_port
from leaderkit import (
    WRITES,
    agent_of,
    by_agent,
    events,
    holder,
    mutated_on_dry_run,
    only_written_by,
    run_writes,
)
from rdzv import AuditLog, metric, read_run, rendezvous_all
from timings import RECONCILES

pytest_plugins = ("chartfixtures",)

LEASE = 4.0
DEADLINE = 3.0
RETRY = 0.5


def election_args(namespace: str) -> list[str]:
    return ["--leader-elect", "--leader-elect-resource-namespace", namespace,
            "--leader-elect-lease-duration", str(LEASE),
            "--leader-elect-renew-deadline", str(DEADLINE),
            "--leader-elect-retry-period", str(RETRY)]


def start_replicas(cluster: Cluster, namespace: str, tmp_path: Path,
                   count: int) -> list[OperatorProcess]:
    replicas = []
    for i in range(count):
        directory = tmp_path / f"replica-{i}"
        directory.mkdir()
        replicas.append(OperatorProcess(cluster.kubeconfig, [namespace], directory,
                                        extra_args=election_args(namespace)).start())
    return replicas


@pytest.fixture
def replicas(cluster: Cluster, namespace: str, tmp_path: Path,
             request: pytest.FixtureRequest) -> Iterator[list[OperatorProcess]]:
    started = start_replicas(cluster, namespace, tmp_path, 2)
    try:
        yield started
    finally:
        for op in started:
            if op.proc is not None:
                os.kill(op.pid, signal.SIGCONT)  # a stopped process cannot take SIGTERM
            op.stop()
        report = getattr(request.node, "rep_call", None)
        if report is not None and report.failed:
            for i, op in enumerate(started):
                print(f"\n--- replica {i} log ---\n{op.log_tail(60)}")


def leading(op: OperatorProcess) -> float | None:
    try:
        return metric(op.metrics(), "elasticrun_operator_leader")
    except OSError:
        return None


def the_leader(replicas: list[OperatorProcess], timeout: float = 20) -> OperatorProcess:
    def one() -> OperatorProcess | None:
        flags = [leading(op) for op in replicas]
        return replicas[flags.index(1.0)] if sorted(flags) == [0.0, 1.0] else None
    found: OperatorProcess = wait_for(one, timeout, "exactly one replica to lead")
    return found


def silence(cluster: Cluster, namespace: str, node: Any, name: str) -> None:
    """The node stops renewing its Lease (alive, partitioned); wait until it is removed."""
    node.lease.stop_renewing()
    wait_for(lambda: any(m.name == name for m in
                         read_run(cluster.client, namespace, "ha").status.lost_members),
             20, f"{name} to be removed")


def test_one_of_two_replicas_reconciles_a_stopped_leader_is_replaced_and_stays_fenced(
        replicas: list[OperatorProcess], make_handler: Any, cluster: Cluster,
        namespace: str) -> None:
    local = cluster.require_local()
    audit = AuditLog(local.state.audit_log)  # type: ignore[union-attr]
    mark = audit.mark()
    leader = the_leader(replicas)
    follower = next(op for op in replicas if op is not leader)
    first_holder = holder(cluster.client, namespace)
    assert first_holder is not None
    # Both serve /healthz (and metrics: read above).
    for op in replicas:
        op.healthz()

    nodes = [make_handler("ha", f"n{i}", min_nodes=2, max_nodes=3, heartbeat_timeout=2,
                          lease_renew_interval=1) for i in range(3)]
    assert {o.rank for o in rendezvous_all(nodes).values()} == {0, 1, 2}
    silence(cluster, namespace, nodes[1], "n1")  # only the leader may remove it
    lost = [m for m in read_run(cluster.client, namespace, "ha").status.lost_members]
    assert [(m.name, m.reason) for m in lost] == [("n1", "LeaseExpired")]
    wait_for(lambda: events(cluster, namespace, "MemberLost"), 10, "a MemberLost Event")
    # A second writer would post its copies as it reacts to the same changes: within a
    # few reconciles.
    consistently(lambda: len([m for m in events(cluster, namespace, "MemberLost")
                              if "n1" in m]) == 1
                 and len([m for m in events(cluster, namespace, "RoundSealed")
                          if m.startswith("round 1:")]) == 1,
                 RECONCILES, "a second MemberLost or RoundSealed Event")
    only_written_by(audit, namespace, mark, first_holder)
    survivors = [nodes[0], nodes[2]]
    assert {o.rank for o in rendezvous_all(survivors).values()} == {0, 1}

    # The leader freezes (SIGSTOP, as a node under memory pressure or a paused VM).
    os.kill(leader.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    wait_for(lambda: leading(follower) == 1.0, LEASE + 2 * RETRY + 4,
             "the follower to take the Lease over")
    took = time.monotonic() - stopped
    new_holder = holder(cluster.client, namespace)
    assert new_holder not in (None, first_holder)
    print(f"\ntake-over {took:.2f}s after SIGSTOP (lease {LEASE:g}s, retry {RETRY:g}s)")
    # The last renewal seen at most a jittered poll after it was made, the take-over
    # at the expiry; the rest is slack for a machine shared with other tests.
    assert took <= LEASE + 1.2 * RETRY + 2

    # A loss after the take-over is still detected, by the new leader.
    switched = audit.mark()
    silence(cluster, namespace, nodes[2], "n2")
    assert new_holder is not None
    only_written_by(audit, namespace, switched, new_holder)

    # The old leader resumes: it must not write (its renew deadline is long past).
    resumed = audit.mark()
    os.kill(leader.pid, signal.SIGCONT)
    wait_for(lambda: leading(leader) == 0.0, 10, "the resumed old leader to report 0")
    # Another change to act on, acted on by the new leader (silence waits for it): the
    # old one would write as it reacts to the same change, within a few reconciles.
    silence(cluster, namespace, survivors[0], "n0")

    def old_leader_quiet() -> bool:
        old = by_agent(audit, namespace, resumed).get(agent_of(first_holder), [])
        assert run_writes(old) == [], [(e.kind, e.name, e.code) for e in old]
        return True

    # Each look reads the audit log: every half second.
    consistently(old_leader_quiet, RECONCILES, "the resumed old leader wrote the run",
                 interval=0.5)
    old = by_agent(audit, namespace, resumed).get(agent_of(first_holder), [])
    # Its one write attempt is on the election Lease, refused (its copy is stale).
    assert all(e.code >= 400 for e in old if e.verb in WRITES), [(e.kind, e.code) for e in old]
    assert holder(cluster.client, namespace) == new_holder
    assert leading(leader) == 0.0 and leading(follower) == 1.0
    for op in replicas:
        op.healthz()

    # A clean stop (SIGTERM, as in a rolling update) releases the Lease: the other
    # replica takes it at its next poll, well within a lease duration.
    follower.stop()
    released = time.monotonic()
    assert holder(cluster.client, namespace) != new_holder
    assert "leader election: released Lease" in follower.log_path.read_text(errors="replace")
    wait_for(lambda: leading(leader) == 1.0, LEASE, "the other replica to take the released "
             "Lease")
    print(f"hand-over {time.monotonic() - released:.2f}s after a clean stop")


def test_a_stale_leaders_late_writes_are_refused_by_the_api_server(
        make_handler: Any, cluster: Cluster, namespace: str) -> None:
    """docs/security.md row 81: what fences a write the old leader had already sent when
    it froze, through the operator's own gateway and DeleteOptions: the status
    compare-and-set on the resourceVersion it decided on, the Lease deletion on the uid
    it observed."""
    nodes = [make_handler("fence", f"f{i}", min_nodes=2, lease_renew_interval=1)
             for i in range(2)]
    assert {o.rank for o in rendezvous_all(nodes).values()} == {0, 1}
    gateway = RunGateway(cluster.client, namespace, "fence")
    stale = parse_run(gateway.read())  # the copy the old leader decided on
    observed = gateway.lease("f1")
    assert observed is not None
    old_uid = observed["metadata"]["uid"]

    # Meanwhile the new leader wrote the run, and f1's Lease was re-created (deleted,
    # then made again by its node's next renewal).
    gateway.close()
    fresh = read_run(cluster.client, namespace, "fence")
    cluster.client.request("DELETE", gateway.lease_path(observed["metadata"]["name"]))
    renewed = wait_for(lambda: (gateway.lease("f1") or {}).get("metadata", {}).get("uid")
                       not in (None, old_uid) and gateway.lease("f1"), 15,
                       "f1 to re-create its Lease")

    # The old leader's late writes: a seal of a round from its copy, the deletion of the
    # Lease it observed.
    late = {**stale.status.to_dict(), "round": stale.status.round + 1}
    assert gateway.replace_status(stale.resource_version, late, "elasticrun-operator") is None
    with pytest.raises(ApiError) as refused:
        cluster.client.request("DELETE", gateway.lease_path(observed["metadata"]["name"]),
                               body=delete_preconditions(old_uid))
    assert refused.value.status == 409
    after = read_run(cluster.client, namespace, "fence")
    assert after.status.round == fresh.status.round == stale.status.round
    assert after.resource_version == fresh.resource_version
    kept = gateway.lease("f1")
    assert kept is not None and kept["metadata"]["uid"] == renewed["metadata"]["uid"]


def test_a_lease_writer_cannot_crash_or_spin_the_elector_and_it_recovers(
        cluster: Cluster, namespace: str, tmp_path: Path,
        request: pytest.FixtureRequest) -> None:
    """docs/security.md rows 78-82: a ServiceAccount that may write Leases in the
    operator's namespace writes garbage into the leader Lease, holds it, deletes it."""
    local = cluster.require_local()
    audit = AuditLog(local.state.audit_log)  # type: ignore[union-attr]
    intruder = account_client(cluster, namespace, "lease-writer", [{
        "apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
        "verbs": ["get", "list", "create", "update", "patch", "delete"]}], tmp_path)
    (op,) = start_replicas(cluster, namespace, tmp_path, 1)
    request.addfinalizer(op.stop)
    wait_for(lambda: leading(op) == 1.0, 10, "the single replica to lead")
    path = lease_path(namespace, LEASE_NAME)

    def overwrite(spec: dict[str, Any], **meta: Any) -> None:
        current = intruder.request("GET", path)
        intruder.request("PUT", path, body={
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": LEASE_NAME, "namespace": namespace,
                         "resourceVersion": current["metadata"]["resourceVersion"], **meta},
            "spec": spec})

    def requests_in(window: float) -> list[Any]:
        start = audit.mark()
        time.sleep(window)
        return [e for e in audit.entries(namespace, since=start)
                if e.user_agent.startswith(OPERATOR_USER_AGENT) and e.resource == "leases"
                and e.name == LEASE_NAME]

    # Row 78: an unreadable holder (4,000 characters) and absurd numbers: the Lease
    # counts as free, the operator takes it back at once; bounded requests.
    overwrite({"holderIdentity": "x" * 4000, "leaseDurationSeconds": 2**31 - 1,
               "leaseTransitions": 2**31 - 1, "renewTime": "9999-12-31T23:59:59.999999Z"},
              annotations={"junk": "y" * 100_000})
    wait_for(lambda: holder(cluster.client, namespace) not in (None, "x" * 4000), 10,
             "the operator to take the garbage Lease back")
    assert leading(op) == 1.0
    window = 6.0
    seen = requests_in(window)
    print(f"\noperator requests on the election Lease in {window:g}s after garbage: "
          f"{len(seen)}")
    assert len(seen) <= 2 * window / RETRY + 4, [e.kind for e in seen]

    # Row 79: another holder, renewed by the intruder: the operator stops reconciling
    # (and says so) but does not spin; its leaseDurationSeconds is not believed.
    overwrite({"holderIdentity": "intruder", "leaseDurationSeconds": 2**31 - 1,
               "renewTime": "2099-01-01T00:00:00.000000Z"})
    wait_for(lambda: leading(op) == 0.0, DEADLINE + 3, "the operator to stand down")
    held_until = time.monotonic() + 4
    polls = audit.mark()
    while time.monotonic() < held_until:
        # A renewal must change the object (an identical PUT leaves it as it is).
        overwrite({"holderIdentity": "intruder", "leaseDurationSeconds": 2**31 - 1,
                   "renewTime": format_time(now())})
        assert leading(op) == 0.0
        time.sleep(1)
    spent = [e for e in audit.entries(namespace, since=polls)
             if e.user_agent.startswith(OPERATOR_USER_AGENT) and e.resource == "leases"
             and e.name == LEASE_NAME]
    print(f"operator requests on it in 4s while another holder renews: {len(spent)}")
    assert len(spent) <= 2 * 4 / RETRY + 4, [e.kind for e in spent]
    # The intruder stops renewing: a lease duration later (by the operator's clock,
    # whatever the Lease claims) the operator leads again.
    stopped = time.monotonic()
    wait_for(lambda: leading(op) == 1.0, LEASE + 2 * RETRY + 3, "the operator to take over")
    assert time.monotonic() - stopped >= LEASE - 1.5
    # Row 81: the Lease deleted: created again.
    intruder.request("DELETE", path)
    wait_for(lambda: holder(cluster.client, namespace) not in (None, "intruder"), 10,
             "the operator to create the Lease again")
    assert leading(op) == 1.0
    assert op.proc is not None and op.proc.poll() is None  # never crashed
    op.healthz()
    assert "Traceback" not in op.log_path.read_text(errors="replace")


WEBHOOKS = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"


def test_both_replicas_serve_the_webhook_with_certificates_of_one_shared_ca(
        cluster: Cluster, helm: Helm, namespace: str, tmp_path: Path,
        request: pytest.FixtureRequest) -> None:
    """The chart's default (self-signed, two replicas), on the chart's roles alone: each
    replica signs its serving certificate with the CA kept in the chart's Secret, so
    the one caBundle trusts both; their 1 s caBundle checks never flip it."""
    release = namespace
    docs = helm.template("ha", namespace, {
        "trainingNamespaces": [namespace], "fullnameOverride": release,
        "operator": {"scope": "namespaces"}})
    rbac = [d for d in docs if d["kind"] in {"ServiceAccount", "Role", "RoleBinding",
                                               "ClusterRole", "ClusterRoleBinding"}]
    request.addfinalizer(lambda: delete_cluster_scoped(cluster, rbac))
    apply(cluster, rbac)
    (deployment,) = by_kind(docs, "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert deployment["spec"]["replicas"] == 2
    secret = next(a.split("=", 1)[1] for a in args if a.startswith("--webhook-ca-secret="))
    lease_name = next(a.split("=", 1)[1] for a in args
                      if a.startswith("--leader-elect-resource-name="))
    (config_name,) = [r["resourceNames"][0] for r in by_kind(rbac, "ClusterRole")[0]["rules"]
                      if r.get("resourceNames")]
    kubeconfig = token_kubeconfig(cluster, request_token(cluster, namespace, release),
                                  tmp_path / "operator.kubeconfig", namespace)
    ports = [free_port(), free_port()]
    configuration = {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": config_name},
        "webhooks": [{
            "name": f"r{i}.pods.elasticrun.dev", "admissionReviewVersions": ["v1"],
            "sideEffects": "None", "failurePolicy": "Fail", "timeoutSeconds": 5,
            "reinvocationPolicy": "IfNeeded",
            "clientConfig": {"url": f"https://127.0.0.1:{port}{webhook.WEBHOOK_PATH}"},
            "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                       "resources": ["pods"], "scope": "Namespaced"}],
            "objectSelector": {"matchExpressions": [
                {"key": crd.RUN_LABEL, "operator": "Exists"}]},
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
        } for i, port in enumerate(ports)],
    }
    # A failurePolicy=Fail configuration left behind would block later tests' pods.
    request.addfinalizer(lambda: cluster.client.request("DELETE", f"{WEBHOOKS}/{config_name}"))
    cluster.apply(configuration)
    replicas = []
    for i, port in enumerate(ports):
        directory = tmp_path / f"replica-{i}"
        directory.mkdir()
        op = OperatorProcess(kubeconfig, [namespace], directory, extra_args=[
            *election_args(namespace), "--leader-elect-resource-name", lease_name,
            "--webhook-port", str(port), "--webhook-addr", "127.0.0.1",
            "--webhook-self-signed", "127.0.0.1", "--webhook-cert-dir", str(directory / "certs"),
            "--webhook-configuration", config_name, "--webhook-ca-check-seconds", "1",
            "--webhook-ca-secret", secret, "--webhook-ca-secret-namespace", namespace])
        request.addfinalizer(op.stop)
        replicas.append(op.start())
    the_leader(replicas)
    wait_for(lambda: mutated_on_dry_run(cluster, namespace)[0], 30,
             "both replicas' webhooks to answer", interval=0.5)
    stored = cluster.client.request("GET", f"/api/v1/namespaces/{namespace}/secrets/{secret}")
    shared = base64.b64decode(stored["data"]["ca.crt"])
    for op in replicas:
        assert (op.log_path.parent / "certs" / "ca.crt").read_bytes() == shared
    # Several caBundle checks of both replicas: the bundle stays, every call is served.
    for _ in range(6):
        time.sleep(0.5)
        served, error = mutated_on_dry_run(cluster, namespace)
        assert served, error
        config = cluster.client.request("GET", f"{WEBHOOKS}/{config_name}")
        assert {base64.b64decode(h["clientConfig"]["caBundle"])
                for h in config["webhooks"]} == {shared}
    for op in replicas:
        text = op.log_path.read_text(errors="replace")
        assert refusals(text) == [], refusals(text)[:5]
        assert "repaired the caBundle" not in text


def test_replicas_in_one_network_namespace_share_the_health_and_metrics_ports(
        cluster: Cluster, namespace: str, tmp_path: Path,
        request: pytest.FixtureRequest) -> None:
    """--reuse-port (the chart's with hostNetwork, as on the local node): two replicas
    bind the same /healthz and /metrics ports; each connection reaches one of them, and
    the ports outlive the replica that stops."""
    replicas: list[OperatorProcess] = []
    for i in range(2):
        directory = tmp_path / f"shared-{i}"
        directory.mkdir()
        op = OperatorProcess(cluster.kubeconfig, [namespace], directory,
                             extra_args=[*election_args(namespace), "--reuse-port"])
        if replicas:
            op.metrics_port, op.health_port = replicas[0].metrics_port, replicas[0].health_port
        request.addfinalizer(op.stop)
        replicas.append(op.start())

    def answers() -> list[float | None]:
        """The leader flag of whichever replica took each of 30 new connections."""
        return [leading(replicas[0]) for _ in range(30)]

    def both() -> list[float | None] | None:
        got = answers()
        return got if set(got) == {0.0, 1.0} else None

    # Both replicas answer on the one port: the leader's 1 and the follower's 0.
    seen = wait_for(both, 20, "both replicas to answer on the shared metrics port",
                    interval=0.5)
    print(f"\nshared port: {seen.count(1.0)} of {len(seen)} connections reached the leader")
    for op in replicas:
        assert op.proc is not None and op.proc.poll() is None, op.log_tail()
        assert op.healthz() == "{}"
    # The leader stops: the same port keeps answering, now only the new leader.
    name = holder(cluster.client, namespace)
    (leader,) = [op for op in replicas
                 if f"leader election: {name} holds Lease" in op.log_tail(400)]
    leader.stop()
    wait_for(lambda: set(answers()) == {1.0}, LEASE + 2 * RETRY + 4,
             "the follower alone to answer, leading, on the shared port", interval=0.5)
    assert all(replicas[0].healthz() == "{}" for _ in range(10))

