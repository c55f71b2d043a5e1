"""Security: who can reach the TCPStore, what the webhook serves, what logs hold, who can write.

* The rank-0 TCPStore (which has no authentication) listens on the node's own
  address only, and the chart's optional NetworkPolicy admits only training
  pods to its port.
* The webhook serves TLS only; neither the operator's nor the handlers' logs
  (at DEBUG) contain a bearer token or a PEM block.
* With ``--per-run-rbac`` a pod of run A can write nothing of run B (real RBAC,
  TokenRequest tokens of two ServiceAccounts), and with the chart's admission
  policy it cannot create a Lease that counts for B either (docs/security.md).
* A Lease's own duration is not trusted (the run's heartbeat is), a Lease
  without the run's ownerReference counts for nobody, and every metric series
  of a deleted run goes with it.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousError

from elasticrun.api import crd, rounds, slices
from elasticrun.api.kube import (
    MERGE_PATCH,
    ApiError,
    KubeClient,
    lease_path,
    leases_path,
    load_credentials,
    run_path,
)
from elasticrun.api.leases import (
    JOIN_ANNOTATION,
    UNREACHABLE_ANNOTATION,
    run_leases_query,
    unreachable_value,
)
from elasticrun.api.model import format_time, now
from elasticrun.api.naming import lease_name
from elasticrun.handler.handler import ElasticRunForbiddenError
from elasticrun.operator import runrbac

from chaoskit import assert_all_ok, record, start_node
from chartkit import (
    Helm,
    account_client,
    apply,
    by_kind,
    delete_cluster_scoped,
    request_token,
    role_bound,
    token_kubeconfig,
)
from conftest import Cluster, ProcessGroup, consistently, wait_for
from controlplane.kubelet import Kubelet
from controlplane.operatorproc import OperatorProcess, free_port
from rdzv import AuditLog, read_run, rendezvous_all, spec_observed
from timings import RECONCILES, SHORT_HEARTBEAT, SHORT_RENEW, outlasting

pytest_plugins = ("chartfixtures",)
pytestmark = pytest.mark.slow


# --------------------------------------------------------------------------- the TCPStore


def _sockets() -> Iterator[tuple[str, str, str]]:
    """(local, remote, state) of every TCP socket of this machine, hex as the kernel
    writes them in /proc/net/tcp and tcp6."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            fields = line.split()
            yield fields[1], fields[2], fields[3]


def _listeners(port: int) -> list[str]:
    """Local addresses listening on ``port`` (hex decoded)."""
    found = []
    for local, _, state in _sockets():
        address, hex_port = local.split(":")
        if state != "0A" or int(hex_port, 16) != port:  # 0A = LISTEN
            continue
        if len(address) == 8:
            found.append(socket.inet_ntop(socket.AF_INET, bytes.fromhex(address)[::-1]))
        else:
            words = [bytes.fromhex(address[i:i + 8])[::-1] for i in range(0, 32, 8)]
            found.append(socket.inet_ntop(socket.AF_INET6, b"".join(words)))
    return found


def test_tcpstore_listens_on_the_node_address_only(make_handler: Any, cluster: Cluster,
                                                   namespace: str) -> None:
    # 127.0.0.2 is this machine too (all of 127/8 is loopback): a second "interface".
    handler = make_handler("bind", "solo", min_nodes=1, address="127.0.0.2")
    info = handler.next_rendezvous()
    host = handler.stores.host
    assert host is not None
    port = host.port
    assert _listeners(port) == ["127.0.0.2"], _listeners(port)
    assert (info.bootstrap_store_info.master_addr, info.bootstrap_store_info.master_port) == (
        "127.0.0.2", port)
    with socket.socket() as probe:  # the same port on another address of the machine
        assert probe.connect_ex(("127.0.0.1", port)) != 0
    info.store.set("k", "v")  # and it serves on its own address
    assert info.store.get("k") == b"v"
    record("TCPStore bound to the node's address", group="security",
           fault="a client on another address of the same machine connects to the store port",
           expected="refused: the store listens on the node's address (pod IP), not 0.0.0.0",
           observed=f"listening only on 127.0.0.2:{port} (/proc/net/tcp); 127.0.0.1:{port} "
                    "refused",
           recovery_seconds=None)


def test_network_policy_admits_only_training_pods_to_the_store_port(helm: Helm) -> None:
    port = 29400
    for isolate in (False, True):
        docs = helm.template("sec", "ops", {
            "trainingNamespaces": ["team-a"],
            "networkPolicy": {"enabled": True, "storePort": port, "isolate": isolate}})
        (policy,) = by_kind(docs, "NetworkPolicy")
        spec = policy["spec"]
        assert policy["metadata"]["namespace"] == "team-a"
        assert spec["policyTypes"] == ["Ingress"]
        assert spec["podSelector"] == {"matchExpressions": [
            {"key": crd.RUN_LABEL, "operator": "Exists"}]}
        for rule in spec["ingress"]:
            if rule.get("from") == [{"podSelector": spec["podSelector"]}]:
                continue  # from training pods of the namespace: any port
            assert "from" not in rule or not rule["from"], rule
            for allowed in rule.get("ports") or [{}]:  # open to all: never the store port
                low = allowed.get("port")
                high = allowed.get("endPort", low)
                if allowed.get("protocol", "TCP") == "TCP":
                    assert low is not None and not low <= port <= high, (isolate, allowed)
        if isolate:
            assert len(spec["ingress"]) == 1
    record("NetworkPolicy for the store port", group="security",
           fault="pods without the elasticrun.dev/run label try the store port",
           expected="only training pods of the namespace reach it (chart networkPolicy.enabled)",
           observed=f"rendered policy: TCP {port} only from pods with {crd.RUN_LABEL}; other "
                    "ports open unless isolate=true",
           recovery_seconds=None)


# --------------------------------------------------------------------------- webhook and logs


@pytest.fixture
def served_operator(cluster: Cluster, namespace: str, tmp_path: Path) -> Iterator[
        OperatorProcess]:
    """The operator with its webhook (self-signed certificate) and DEBUG logs."""
    port = free_port()
    op = OperatorProcess(cluster.kubeconfig, [namespace], tmp_path, extra_args=[
        "--verbose", "--per-run-rbac", "--webhook-port", str(port),
        "--webhook-addr", "127.0.0.1", "--webhook-self-signed", "127.0.0.1",
        "--webhook-cert-dir", str(tmp_path / "certs")])
    op.webhook_port = port  # type: ignore[attr-defined]
    op.start()
    try:
        yield op
    finally:
        op.stop()


def test_webhook_serves_tls_only_and_no_secret_reaches_a_log(
        served_operator: OperatorProcess, processes: ProcessGroup, cluster: Cluster,
        namespace: str, tmp_path: Path) -> None:
    port = served_operator.webhook_port  # type: ignore[attr-defined]
    ca = tmp_path / "certs"
    wait_for((ca / "ca.crt").exists, 20, "the operator's self-signed certificate")

    def listening() -> bool:
        with socket.socket() as probe:
            return probe.connect_ex(("127.0.0.1", port)) == 0

    wait_for(listening, 20, "the webhook server to listen")
    # Plain HTTP gets no HTTP answer at all.
    plain = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    with pytest.raises((http.client.HTTPException, ConnectionError, OSError)):
        plain.request("POST", "/elasticrun-pod-env", body=b"{}")
        plain.getresponse().read()
    plain.close()
    # TLS with the operator's CA works, and the certificate names the address.
    context = ssl.create_default_context(cafile=str(ca / "ca.crt"))
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        assert tls.version() in ("TLSv1.2", "TLSv1.3")
    # A rendezvous of two node processes logging at DEBUG, next to the operator.
    for name in ("n0", "n1"):
        start_node(processes, cluster.kubeconfig, namespace, "logs", name, tmp_path, "2:2",
                   "", "--rounds", "1", "-v")
    for proc in processes.procs:
        proc.wait(timeout=60)
        assert proc.returncode == 0
    assert read_run(cluster.client, namespace, "logs").status.round == 1
    # The admin token is ours only on the suite's own control plane.
    admin_token = cluster.local.state.token if cluster.local and cluster.local.state else None
    logs = {p.name: p.read_text(errors="replace") for p in tmp_path.glob("*.log")}
    assert "operator.log" in logs and any(n.startswith("node-") for n in logs)
    assert any("DEBUG" in text for text in logs.values())
    for name, text in logs.items():
        assert admin_token is None or admin_token not in text, name
        assert "BEGIN" not in text and "PRIVATE KEY" not in text, name
        assert not re.search(r"Bearer\s+\S{10,}", text), name
        assert not re.search(r"eyJ[\w-]{20,}\.[\w-]{20,}\.", text), name  # a JWT
    record("webhook TLS only; no secrets in logs", group="security",
           fault="plain HTTP to the webhook port; operator and handlers logging at DEBUG "
                 "through a rendezvous",
           expected="plain HTTP gets no answer; TLS >= 1.2 with the operator's CA; no token "
                    "or PEM block in any log",
           observed=f"plain HTTP refused, TLS ok; {sum(map(len, logs.values()))} bytes of "
                    f"logs in {len(logs)} files: no admin token, Bearer, JWT or 'BEGIN'",
           recovery_seconds=None)


# --------------------------------------------------------------------------- per-run RBAC


def _service_account(cluster: Cluster, namespace: str, name: str) -> None:
    cluster.client.request("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts", body={
        "apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}})


def _run(cluster: Cluster, namespace: str, name: str, account: str,
         max_nodes: int = 2) -> None:
    cluster.client.request("POST", f"/apis/{crd.API_VERSION}/namespaces/{namespace}/"
                           f"{crd.PLURAL}", body={
                               "apiVersion": crd.API_VERSION, "kind": crd.KIND,
                               "metadata": {"name": name, "annotations": {
                                   runrbac.SERVICE_ACCOUNT_ANNOTATION: account}},
                               "spec": {"minNodes": 2, "maxNodes": max_nodes,
                                        "lastCallTimeoutSeconds": 1,
                                        "heartbeatTimeoutSeconds": 4,
                                        "leaseRenewIntervalSeconds": 1}})


def _runs_with_own_accounts(cluster: Cluster, namespace: str, tmp_path: Path,
                            large_b: bool = False) -> dict[str, Path]:
    """run-a and run-b, each naming its own ServiceAccount; kubeconfigs with their tokens.

    ``large_b``: run-b has ``maxNodes`` 2,048, so its members are told their ranks in
    its slices.  Returns once the operator made the per-run Roles.
    """
    kubeconfigs = {}
    for run in ("run-a", "run-b"):
        _service_account(cluster, namespace, f"sa-{run}")
        _run(cluster, namespace, run, f"sa-{run}",
             max_nodes=rounds.TELL_IN_SLICES_FROM if large_b and run == "run-b" else 2)
        kubeconfigs[run] = token_kubeconfig(
            cluster, request_token(cluster, namespace, f"sa-{run}"),
            tmp_path / f"{run}.kubeconfig", namespace)

    def bound(run: str) -> bool:
        return _status(None, lambda: cluster.client.request(
            "GET", runrbac.path("RoleBinding", namespace, run))) == 200

    wait_for(lambda: bound("run-a") and bound("run-b"), 20,
             "the operator to create the per-run Roles")
    return kubeconfigs


def _status(code: int | None, action: Any) -> int:
    try:
        action()
    except ApiError as exc:
        return exc.status
    return 200 if code is None else code


@pytest.fixture
def chart_operator(cluster: Cluster, helm: Helm, namespace: str, tmp_path: Path,
                   request: pytest.FixtureRequest) -> Iterator[OperatorProcess]:
    """The operator on nothing but the chart's role with ``training.perRunRBAC``.

    RBAC lets nobody grant what they do not hold, so this also checks that the
    chart gives the operator every right the per-run Roles grant.
    """
    docs = [d for d in helm.template("sec", namespace, {
        "trainingNamespaces": [namespace], "fullnameOverride": namespace,
        "operator": {"scope": "namespaces"}, "webhook": {"enabled": False},
        "training": {"perRunRBAC": True}})
        if d["kind"] in {"ServiceAccount", "Role", "RoleBinding", "ClusterRole",
                         "ClusterRoleBinding"}]
    (deployment,) = by_kind(helm.template("sec", namespace, {
        "trainingNamespaces": [namespace], "operator": {"scope": "namespaces"},
        "training": {"perRunRBAC": True}}), "Deployment")
    assert "--per-run-rbac" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    request.addfinalizer(lambda: delete_cluster_scoped(cluster, docs))
    apply(cluster, docs)
    kubeconfig = token_kubeconfig(cluster, request_token(cluster, namespace, namespace),
                                  tmp_path / "operator.kubeconfig", namespace)
    op = OperatorProcess(kubeconfig, [namespace], tmp_path, extra_args=["--per-run-rbac"])
    op.start()
    try:
        yield op
    finally:
        op.stop()


def test_per_run_rbac_keeps_run_a_pods_out_of_run_b(
        chart_operator: OperatorProcess, make_handler: Any, cluster: Cluster,
        namespace: str, tmp_path: Path) -> None:
    started = time.monotonic()
    kubeconfigs = _runs_with_own_accounts(cluster, namespace, tmp_path, large_b=True)
    # Each run's pods, on nothing but their own ServiceAccount's token, form their rounds.
    # run-b is one of the largest runs (maxNodes 2,048): its members are told their ranks
    # in its slices, which they watch by name.
    for run, max_nodes in (("run-a", 2), ("run-b", rounds.TELL_IN_SLICES_FROM)):
        nodes = [make_handler(run, f"{run}-{i}", min_nodes=2, max_nodes=max_nodes,
                              kubeconfig=kubeconfigs[run], heartbeat_timeout=SHORT_HEARTBEAT,
                              lease_renew_interval=SHORT_RENEW, last_call_timeout=1)
                 for i in range(2)]
        assert_all_ok(rendezvous_all(nodes))
        if run == "run-b":
            assert all(n.mailbox is not None and n.mailbox.latest is not None
                       and n.mailbox.latest.round == 1 for n in nodes)
    formed = time.monotonic() - started
    assert read_run(cluster.client, namespace, "run-b").status.signal == 0  # told in slices
    # Renewals keep working by name: no Lease expires for longer than the heartbeat (the
    # operator that would remove its node watches them).
    consistently(lambda: all(read_run(cluster.client, namespace, run).status.lost_members
                             == () for run in ("run-a", "run-b")),
                 outlasting(SHORT_HEARTBEAT), "a member's Lease expired")
    a = KubeClient(load_credentials(str(kubeconfigs["run-a"])), timeout=10)
    raw_b = cluster.client.request("GET", run_path(namespace, "run-b"))
    slice_b = slices.slice_name(raw_b["metadata"]["uid"], slices.slice_index("run-b-0"))
    refused = {
        "get run-b": _status(None, lambda: a.request("GET", run_path(namespace, "run-b"))),
        "update run-b status": _status(None, lambda: a.request(
            "PUT", run_path(namespace, "run-b", "status"), body=raw_b)),
        "patch run-b": _status(None, lambda: a.request(
            "PATCH", run_path(namespace, "run-b"), body={"spec": {"closed": True}},
            content_type=MERGE_PATCH)),
        "patch run-b's Lease": _status(None, lambda: a.request(
            "PATCH", lease_path(namespace, lease_name("run-b", "run-b-0")),
            body={"spec": {"holderIdentity": "intruder"}},
            content_type=MERGE_PATCH)),
        "delete run-b's Lease": _status(None, lambda: a.request(
            "DELETE", lease_path(namespace, lease_name("run-b", "run-b-1")))),
        "watch run-b's Lease": _status(None, lambda: a.watch(
            leases_path(namespace),
            {"fieldSelector": f"metadata.name={lease_name('run-b', 'run-b-0')}"}, 1).close()),
        "watch run-b's slice": _status(None, lambda: a.watch(
            slices.slices_path(namespace), {"fieldSelector": f"metadata.name={slice_b}"},
            1).close()),
    }
    assert set(refused.values()) == {403}, refused
    # run-b's own pods read their slice, by name, and may not write it: only the operator
    # tells places.
    b = KubeClient(load_credentials(str(kubeconfigs["run-b"])), timeout=10)
    assert slices.read_place(b.request("GET", slices.slice_path(namespace, slice_b)),
                             "run-b", "run-b-0") is not None
    own = {
        "patch its slice": _status(None, lambda: b.request(
            "PATCH", slices.slice_path(namespace, slice_b), body={"spec": {"round": 9}},
            content_type=MERGE_PATCH)),
        "delete its slice": _status(None, lambda: b.request(
            "DELETE", slices.slice_path(namespace, slice_b))),
        "create a slice": _status(None, lambda: b.request(
            "POST", slices.slices_path(namespace), body={
                "apiVersion": crd.API_VERSION, "kind": crd.SLICE_KIND,
                "metadata": {"name": "forged"},
                "spec": {"run": "run-b", "round": 9, "worldSize": 1, "places": {}}})),
    }
    assert set(own.values()) == {403}, own
    # The handler says so in torch's terms, naming the missing permission.
    intruder = make_handler("run-b", "intruder", min_nodes=2, kubeconfig=kubeconfigs["run-a"],
                            api_timeout=5)
    with pytest.raises(ElasticRunForbiddenError, match="not allowed to"):
        intruder.next_rendezvous()
    # Its own run stays writable; run-b is untouched.
    assert _status(None, lambda: a.request("GET", run_path(namespace, "run-a"))) == 200
    after_b = read_run(cluster.client, namespace, "run-b")
    assert after_b.status.round == 1 and not after_b.closed
    refusals = re.findall(r'forbidden: User "[^"]+" cannot[^\n]*',
                          chart_operator.log_path.read_text(errors="replace"))
    assert refusals == [], refusals[:5]  # the chart's operator role sufficed
    record("per-run RBAC (--per-run-rbac)", group="security",
           fault="a pod of run A (its ServiceAccount token) reads and writes run B, its status "
                 "and its Leases",
           expected="403 for every one of them; each run's own pods form their rounds",
           observed=f"all {len(refused)} refused (403), run-b's own pods refused writing its "
                    f"slices ({len(own)} tries, 403), handler raised ElasticRunForbiddenError; "
                    "both runs "
                    f"formed on their own tokens ({formed:.1f}s incl. Role set-up); the "
                    "operator ran on the chart's role (perRunRBAC) without a 403",
           recovery_seconds=None)


# --------------------------------------------------------------------------- forged Leases

#: What an attacker writes into a Lease it wants counted: a duration of 2^31-1 s.
FOREVER = 2**31 - 1


@pytest.fixture
def lease_policy(cluster: Cluster, helm: Helm, request: pytest.FixtureRequest) -> None:
    """The chart's ValidatingAdmissionPolicy for Leases, enforced; removed at teardown."""
    docs = [d for d in helm.template("sec", "er-system")
            if d["kind"] in ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")]
    assert len(docs) == 2
    request.addfinalizer(lambda: delete_cluster_scoped(cluster, docs))
    apply(cluster, docs)
    probe_ns = request.getfixturevalue("namespace")

    def enforced() -> bool:
        # A Lease labelled for a run but naming none is refused once the policy is live.
        name = f"probe-{time.monotonic_ns()}"
        try:
            cluster.client.request("POST", f"/apis/coordination.k8s.io/v1/namespaces/"
                                           f"{probe_ns}/leases", body={
                "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": name, "labels": {crd.RUN_LABEL: "x"}}})
        except ApiError as exc:
            return exc.status == 403 and "must name its ElasticRun" in exc.message
        cluster.client.request("DELETE", lease_path(probe_ns, name))
        return False

    wait_for(enforced, 30, "the Lease admission policy to be enforced", interval=0.3)


def _forged_lease(run: str, node: str, uid: str | None, *, label: str | None = None,
                  name: str | None = None) -> dict[str, Any]:
    """A Lease as the attacker writes it: a join request, ownerReference, forever-duration."""
    stamp = format_time(now())
    join = {"address": "10.6.6.6", "storePort": 6666, "since": "2000-01-01T00:00:00.000000Z"}
    meta: dict[str, Any] = {
        "name": name or lease_name(run, node), "labels": {crd.RUN_LABEL: label or run},
        "annotations": {crd.RUN_LABEL: run, crd.NODE_ANNOTATION: node,
                        JOIN_ANNOTATION: json.dumps(join)}}
    if uid:
        meta["ownerReferences"] = [{"apiVersion": crd.API_VERSION, "kind": crd.KIND,
                                    "name": run, "uid": uid}]
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta,
            "spec": {"holderIdentity": node, "leaseDurationSeconds": FOREVER,
                     "acquireTime": stamp, "renewTime": stamp}}


def _refusal(action: Any) -> str:
    """The API server's message for a refused call ('' when it was allowed)."""
    try:
        action()
    except ApiError as exc:
        assert exc.status == 403, exc
        return exc.message
    return ""


def test_a_pod_of_run_a_cannot_join_stall_lead_or_close_run_b(
        chart_operator: OperatorProcess, lease_policy: None, make_handler: Any,
        cluster: Cluster, namespace: str, tmp_path: Path) -> None:
    """Issue 12's attack, on run A's own ServiceAccount token, with the chart's policy.

    Lease ``create`` is namespace-wide in RBAC; the admission policy asks the
    authorizer whether the writer may update the run a Lease names.
    """
    kubeconfigs = _runs_with_own_accounts(cluster, namespace, tmp_path)
    b_nodes = [make_handler("run-b", f"run-b-{i}", min_nodes=2, kubeconfig=kubeconfigs["run-b"],
                            heartbeat_timeout=4, lease_renew_interval=1) for i in range(2)]
    assert_all_ok(rendezvous_all(b_nodes))
    before = read_run(cluster.client, namespace, "run-b")
    a = KubeClient(load_credentials(str(kubeconfigs["run-a"])), timeout=10)
    leases = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"

    # Join (and stall) B with a never-expiring member; lead B by claiming the earliest since.
    evil = _forged_lease("run-b", "evil", before.uid)
    assert "may not update ElasticRun" in _refusal(lambda: a.request("POST", leases, body=evil))
    relabelled = _forged_lease("run-b", "evil", before.uid, label="run-a")
    assert "may not update ElasticRun" in _refusal(
        lambda: a.request("POST", leases, body=relabelled))
    squat = _forged_lease("run-a", "run-b-0", None, name=lease_name("run-b", "run-b-0") + "x")
    assert "is named run-a.run-b-0, not" in _refusal(
        lambda: a.request("POST", leases, body=squat))
    # A may write A, but a Lease of A must carry A's label: none rides on B's LISTs.
    decoy = _forged_lease("run-a", "decoy", before.uid, label="run-b")
    assert "must carry the label" in _refusal(lambda: a.request("POST", leases, body=decoy))
    # Change or delete B's members' Leases, close B.
    member = lease_path(namespace, lease_name("run-b", "run-b-0"))
    assert _refusal(lambda: a.request(
        "PATCH", member, body={"metadata": {"annotations": {JOIN_ANNOTATION: None}}},
        content_type="application/merge-patch+json"))
    assert _refusal(lambda: a.request("DELETE", member))
    assert _refusal(lambda: a.request(
        "PATCH", run_path(namespace, "run-b"), body={"spec": {"closed": True}},
        content_type="application/merge-patch+json"))
    # B goes on as it was: for a few reconciles (every write above was refused, so there
    # is nothing for the operator to act on) nobody waits, nobody was lost.

    def untouched() -> bool:
        now_b = read_run(cluster.client, namespace, "run-b")
        return (now_b.status.round == before.status.round and not now_b.closed
                and now_b.status.waiting == () and now_b.status.lost_members == ()
                and all(node.num_nodes_waiting() == 0 for node in b_nodes))

    consistently(untouched, RECONCILES, "run B changed")
    after = read_run(cluster.client, namespace, "run-b")
    assert after.status.round == before.status.round and not after.closed
    assert after.status.waiting == () and after.status.lost_members == ()
    assert [p.name for p in after.status.participants] == ["run-b-0", "run-b-1"]
    assert all(node.num_nodes_waiting() == 0 for node in b_nodes)
    record("forged Leases across runs (admission policy)", group="security",
           fault="a pod of run A (its token) creates a Lease for run B (never-expiring, "
                 "earliest since), relabels one, squats a node name, changes/deletes B's "
                 "Leases, closes B",
           expected="every write refused by RBAC or the policy (a Lease must carry its own "
                    "run's label); B untouched",
           observed="8 writes refused with the policy's or RBAC's message; B's round, "
                    "members and waiting set unchanged, num_nodes_waiting() 0",
           recovery_seconds=None)


def test_a_lease_claiming_to_live_forever_expires_with_the_runs_heartbeat(
        operator: OperatorProcess, make_handler: Any, cluster: Cluster,
        namespace: str) -> None:
    """Liveness is the run's heartbeatTimeoutSeconds, never the Lease's own duration.

    Written with the admin token, as a writer who may write the run would (the
    policy lets it through): a member's copy that is never renewed.
    """
    nodes = [make_handler("hb", f"hb-{i}", min_nodes=2, heartbeat_timeout=3,
                          lease_renew_interval=1) for i in range(2)]
    assert_all_ok(rendezvous_all(nodes))
    run = read_run(cluster.client, namespace, "hb")
    cluster.client.request("POST", f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases",
                           body=_forged_lease("hb", "ghost", run.uid))
    wait_for(lambda: "ghost" in read_run(cluster.client, namespace, "hb").status.waiting_names,
             10, "the forged request to be seen as waiting")
    seen = time.monotonic()
    wait_for(lambda: "ghost" not in read_run(cluster.client, namespace, "hb")
             .status.waiting_names, 10, "the never-renewed request to expire")
    gone_after = time.monotonic() - seen
    assert gone_after < 3 + 2  # the run's heartbeat (3 s) and a reconcile, not 2^31 s
    final = read_run(cluster.client, namespace, "hb")
    assert final.status.round == run.status.round and final.status.member_names == {
        "hb-0", "hb-1"}
    # Without an ownerReference a Lease is nobody's member, however it is labelled.
    cluster.client.request("POST", f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases",
                           body=_forged_lease("hb", "orphan", None))
    # The control is above: the forged request with an owner was seen as waiting at once.
    consistently(lambda: "orphan" not in read_run(cluster.client, namespace, "hb")
                 .status.waiting_names, RECONCILES, "a Lease without an owner counted")


def test_a_false_report_of_an_unreachable_rank0_removes_nobody(
        operator: OperatorProcess, make_handler: Any, cluster: Cluster,
        namespace: str) -> None:
    """A member's report is evidence the operator checks, never a verdict.

    A writer of the run (a buggy or hostile member; the admin token stands in for
    its own) reports the live rank 0 unreachable, again and again: the operator
    looks at rank 0's Lease, sees it renewed, and removes nobody.  The positive
    control: the same report standing, rank 0 stops renewing, and the operator
    removes it for the report (``StoreUnreachable``, after the 2 s suspicion
    window) well before its 6 s heartbeat would (``LeaseExpired``), so the report
    did reach the operator and was weighed.
    """
    heartbeat = 6  # the suspicion window is two renewals (2 s): the two reasons 4 s apart
    nodes = [make_handler("liar", f"liar-{i}", min_nodes=3, heartbeat_timeout=heartbeat,
                          lease_renew_interval=1) for i in range(3)]
    assert_all_ok(rendezvous_all(nodes))
    run = read_run(cluster.client, namespace, "liar")
    leader = next(p.name for p in run.status.participants if p.rank == 0)
    liar = next(p.name for p in run.status.participants if p.rank == 1)
    path = lease_path(namespace, lease_name("liar", liar))
    for _ in range(4):  # past the 2 s suspicion window, and a renewal of the report
        cluster.client.request("PATCH", path, body={"metadata": {"annotations": {
            UNREACHABLE_ANNOTATION: unreachable_value(leader, run.status.round)}}},
            content_type=MERGE_PATCH)
        time.sleep(1)
    final = read_run(cluster.client, namespace, "liar")
    assert final.status.round == run.status.round
    assert final.status.member_names == {"liar-0", "liar-1", "liar-2"}
    assert final.status.lost_members == ()
    assert all(node.num_nodes_waiting() == 0 for node in nodes)
    # The report still stands on the liar's Lease; now rank 0 does go quiet.
    next(n for n in nodes if n.settings.node_name == leader).lease.stop_renewing()
    quiet = time.monotonic()
    wait_for(lambda: read_run(cluster.client, namespace, "liar").status.lost_members, 15,
             "the reported rank 0 to be removed once its Lease went quiet")
    removed_after = time.monotonic() - quiet
    (lost,) = read_run(cluster.client, namespace, "liar").status.lost_members
    assert (lost.name, lost.reason) == (leader, rounds.LEADER_LOST), lost
    assert f"did not answer {liar}" in (lost.message or ""), lost.message
    assert removed_after < heartbeat, removed_after


def test_metric_series_of_deleted_runs_are_removed(operator: OperatorProcess,
                                                   cluster: Cluster, namespace: str) -> None:
    def series() -> int:
        return sum(1 for line in operator.metrics().splitlines()
                   if line.startswith("elasticrun_") and f'namespace="{namespace}"' in line)

    baseline = series()
    names = [f"m-{i}" for i in range(100)]
    for name in names:
        cluster.client.request("POST", f"/apis/{crd.API_VERSION}/namespaces/{namespace}/"
                                       f"{crd.PLURAL}", body={
            "apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": name},
            "spec": {"minNodes": 1}})
    wait_for(lambda: series() >= baseline + 3 * len(names), 60,
             "the operator to export the 100 runs")
    for name in names:
        cluster.client.request("DELETE", run_path(namespace, name))
    wait_for(lambda: series() == baseline, 60, "every series of the deleted runs to go")


def test_an_invalid_service_account_annotation_is_one_event_not_a_retry_loop(
        cluster: Cluster, namespace: str, tmp_path: Path) -> None:
    """The run is reconciled as usual; the bad annotation is reported once."""
    op = OperatorProcess(cluster.kubeconfig, [namespace], tmp_path,
                         extra_args=["--per-run-rbac"]).start()
    try:
        _run(cluster, namespace, "badsa", "Not_A_Name!")
        events = f"/api/v1/namespaces/{namespace}/events"

        def reported() -> list[dict[str, Any]]:
            items = cluster.client.request("GET", events)["items"]
            return [e for e in items if e.get("reason") == "InvalidServiceAccount"]

        wait_for(lambda: reported() != [], 20, "the InvalidServiceAccount Event")
        # Reconciled all the same: the operator wrote the run's status.
        wait_for(lambda: read_run(cluster.client, namespace, "badsa").status
                 .observed_generation is not None, 20, "the run's status")
        # An absence: a retry loop would post again within a few reconciles.
        consistently(lambda: len(reported()) == 1, RECONCILES,
                     "a second InvalidServiceAccount Event (a retry loop)")
        (event,) = reported()
        assert "is not a ServiceAccount name" in event["message"]
        assert event.get("count", 1) == 1
        log = op.log_path.read_text(errors="replace")
        assert log.count("is not a ServiceAccount name") == 1, log[-2000:]
        assert "retrying in" not in log, log[-2000:]  # the worker's failure path
    finally:
        op.stop()


def test_the_training_account_writes_only_elasticrun_leases(
        cluster: Cluster, helm: Helm, namespace: str, make_handler: Any, tmp_path: Path,
        request: pytest.FixtureRequest) -> None:
    """The shared training Role may write Leases; the chart's policies keep it to elasticrun's."""
    kinds = {"ServiceAccount", "Role", "RoleBinding", "ValidatingAdmissionPolicy",
             "ValidatingAdmissionPolicyBinding"}
    docs = [d for d in helm.template("tr", namespace, {
        "trainingNamespaces": [namespace], "fullnameOverride": namespace}) if d["kind"] in kinds]
    assert len(by_kind(docs, "ValidatingAdmissionPolicy")) == 3  # and the Lease names' (row 47)
    request.addfinalizer(lambda: delete_cluster_scoped(cluster, docs))
    apply(cluster, docs)
    kubeconfig = token_kubeconfig(cluster, request_token(cluster, namespace, "elasticrun-trainer"),
                                  tmp_path / "trainer.kubeconfig", namespace)
    trainer = KubeClient(load_credentials(str(kubeconfig)), timeout=10)
    leases = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
    cluster.client.request("POST", leases, body={
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": "other-controller-lock"},
        "spec": {"holderIdentity": "someone", "leaseDurationSeconds": 15}})
    lock = lease_path(namespace, "other-controller-lock")
    steal = {"spec": {"holderIdentity": "trainer"}}
    # Dry runs pass admission too: the wait for enforcement changes nothing.
    wait_for(lambda: "may write only elasticrun Leases" in _refusal(lambda: trainer.request(
        "PATCH", lock, body=steal, content_type="application/merge-patch+json",
        query={"dryRun": "All"})), 30, "the training-Lease policy to be enforced", interval=0.3)
    assert "may write only elasticrun Leases" in _refusal(lambda: trainer.request(
        "PATCH", lock, body=steal, content_type="application/merge-patch+json"))
    assert "may write only elasticrun Leases" in _refusal(lambda: trainer.request("DELETE", lock))
    squat = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
             "metadata": {"name": lease_name("victim", "node-0")},
             "spec": {"holderIdentity": "squatter", "leaseDurationSeconds": FOREVER}}
    assert "may write only elasticrun Leases" in _refusal(
        lambda: trainer.request("POST", leases, body=squat))
    held = cluster.client.request("GET", lock)
    assert held["spec"]["holderIdentity"] == "someone"
    # Its own Leases are elasticrun's: a rendezvous on the same token works.
    nodes = [make_handler("own", f"own-{i}", min_nodes=2, kubeconfig=kubeconfig,
                          last_call_timeout=0) for i in range(2)]
    assert_all_ok(rendezvous_all(nodes))


def test_an_unreadable_join_request_is_one_event_and_no_member(
        operator: OperatorProcess, make_handler: Any, cluster: Cluster,
        namespace: str) -> None:
    """A join annotation nested 2,000 deep (RecursionError in json): one Event, no loop."""
    nodes = [make_handler("deep", f"deep-{i}", min_nodes=2, heartbeat_timeout=4,
                          lease_renew_interval=1) for i in range(2)]
    assert_all_ok(rendezvous_all(nodes))
    run = read_run(cluster.client, namespace, "deep")
    crafted = _forged_lease("deep", "nested", run.uid)
    crafted["metadata"]["annotations"][JOIN_ANNOTATION] = "[" * 2000 + "]" * 2000
    cluster.client.request("POST", f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases",
                           body=crafted)
    events = f"/api/v1/namespaces/{namespace}/events"

    def reported() -> list[dict[str, Any]]:
        return [e for e in cluster.client.request("GET", events)["items"]
                if e.get("reason") == "UnreadableJoin"]

    wait_for(lambda: reported() != [], 15, "the UnreadableJoin Event")
    # The operator goes on reconciling the run: a drain is carried out as usual.
    cluster.client.request("PATCH", run_path(namespace, "deep"), body={"metadata": {
        "annotations": {crd.DRAIN_ANNOTATION: "deep-1"}}},
        content_type="application/merge-patch+json")
    wait_for(lambda: read_run(cluster.client, namespace, "deep").status.member_names
             == {"deep-0"}, 15, "the operator to drain deep-1")
    (event,) = reported()
    assert "nested deeper than" in event["message"] and event.get("count", 1) == 1
    current = read_run(cluster.client, namespace, "deep")
    assert "nested" not in current.status.member_names | current.status.waiting_names
    log = operator.log_path.read_text(errors="replace")
    assert "RecursionError" not in log and "retrying in" not in log, log[-2000:]


# --------------------------------------------------------------------------- Lease identity
#
# Issue 20, cases 2, 3, 6 and the node half of 7 (rows 40-49 of docs/security.md):
# names that collided stay apart and the operator acts on no other run's Lease; an
# unlabelled squat is an error naming the squatter; one crafted Lease costs the
# operator a handful of requests; a member removed while partitioned rejoins under
# per-run RBAC; another run's writer cannot put Leases into a run's LIST.

LONG_AGO = "2026-01-01T00:00:00.000000Z"


def _client(path: Path) -> KubeClient:
    return KubeClient(load_credentials(str(path)), timeout=10)


def _account(cluster: Cluster, namespace: str, tmp_path: Path, run: str, account: str
             ) -> Path:
    _service_account(cluster, namespace, account)
    _run(cluster, namespace, run, account)
    return token_kubeconfig(cluster, request_token(cluster, namespace, account),
                            tmp_path / f"{account}.kubeconfig", namespace)


def _role_leases(cluster: Cluster, namespace: str, run: str) -> set[str]:
    try:
        role = cluster.client.request("GET", runrbac.path("Role", namespace, run))
    except ApiError as exc:
        if exc.not_found:
            return set()
        raise
    return {name for rule in role["rules"] if rule["resources"] == ["leases"]
            for name in rule.get("resourceNames", [])}


def test_runs_whose_names_collided_stay_apart_and_the_operator_touches_no_other_runs_lease(
        chart_operator: OperatorProcess, lease_policy: None, make_handler: Any,
        cluster: Cluster, namespace: str, tmp_path: Path) -> None:
    """Run ``team``'s node ``b.b-0`` and run ``team.b``'s node ``b-0`` were both ``team.b.b-0``."""
    victim_config = _account(cluster, namespace, tmp_path, "team.b", "sa-victim")
    attacker_config = _account(cluster, namespace, tmp_path, "team", "sa-attacker")
    wait_for(lambda: all(role_bound(cluster, namespace, r) for r in ("team", "team.b")), 20,
             "the per-run Roles")
    victims = [make_handler("team.b", f"b-{i}", min_nodes=2, kubeconfig=victim_config,
                            heartbeat_timeout=4, lease_renew_interval=1, last_call_timeout=1)
               for i in range(2)]
    assert_all_ok(rendezvous_all(victims))
    victim_lease = lease_name("team.b", "b-0")
    assert victim_lease != lease_name("team", "b.b-0")
    before = cluster.client.request("GET", lease_path(namespace, victim_lease))
    attacker = _client(attacker_config)
    team = read_run(cluster.client, namespace, "team")
    leases = leases_path(namespace)

    # The attacker's Lease for its "node b.b-0", expired (the operator deletes such a
    # Lease), under the name the old encoding gave both and under any other name:
    # the policy holds a Lease to lease_name(run, node) exactly.
    for name in ("team.b.b-0", "team.anything", victim_lease):
        crafted = _forged_lease("team", "b.b-0", team.uid, name=name)
        crafted["spec"]["renewTime"] = LONG_AGO
        assert "is named team.<node>.<digest>, not" in _refusal(
            lambda c=crafted: attacker.request("POST", leases, body=c)), name
    own = _forged_lease("team", "b.b-0", team.uid)
    own["spec"]["renewTime"] = LONG_AGO
    assert _refusal(lambda: attacker.request("POST", leases, body=own)) == ""
    # The operator deletes that expired Lease of team (its own), and nothing of team.b.
    wait_for(lambda: _gone(cluster, namespace, lease_name("team", "b.b-0")), 15,
             "the operator to delete team's expired Lease")
    # Within a few reconciles of that deletion, team.b's Lease would go too if it were
    # taken for team's.
    consistently(lambda: cluster.client.request("GET", lease_path(namespace, victim_lease))
                 ["metadata"]["uid"] == before["metadata"]["uid"], RECONCILES,
                 "team.b's member Lease was deleted or replaced")
    after = cluster.client.request("GET", lease_path(namespace, victim_lease))
    assert after["metadata"]["uid"] == before["metadata"]["uid"]
    victim_run = read_run(cluster.client, namespace, "team.b")
    assert victim_run.status.member_names == {"b-0", "b-1"}
    assert victim_run.status.lost_members == ()
    # team's Role names none of team.b's Leases.
    assert not _role_leases(cluster, namespace, "team") & {
        lease_name("team.b", "b-0"), lease_name("team.b", "b-1")}
    record("colliding Lease names (issue 20, case 3)", group="security",
           fault="a writer of run team makes an expired Lease for its node b.b-0 under the "
                 "name of run team.b's node b-0 (team.b.b-0 in the old encoding)",
           expected="the names differ; the policy refuses any but lease_name(run, node); "
                    "the operator deletes only team's own Lease; team.b untouched",
           observed="3 names refused, team's own Lease deleted, team.b's member Lease kept "
                    "(same uid), no member lost, team's Role names none of team.b's Leases",
           recovery_seconds=None)


def _gone(cluster: Cluster, namespace: str, name: str) -> bool:
    try:
        cluster.client.request("GET", lease_path(namespace, name))
    except ApiError as exc:
        if exc.not_found:
            return True
        raise
    return False


def test_an_unlabelled_squat_on_a_nodes_lease_name_is_an_error_naming_it(
        chart_operator: OperatorProcess, lease_policy: None, make_handler: Any,
        cluster: Cluster, namespace: str, tmp_path: Path) -> None:
    """A ServiceAccount no policy lists takes a node's Lease name with an unlabelled Lease."""
    config = _account(cluster, namespace, tmp_path, "sq", "sa-sq")
    _service_account(cluster, namespace, "stranger")
    cluster.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                   "metadata": {"name": "stranger", "namespace": namespace},
                   "rules": [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                              "verbs": ["create"]}]})
    cluster.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                   "metadata": {"name": "stranger", "namespace": namespace},
                   "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                               "name": "stranger"},
                   "subjects": [{"kind": "ServiceAccount", "name": "stranger",
                                 "namespace": namespace}]})
    stranger = _client(token_kubeconfig(cluster, request_token(cluster, namespace, "stranger"),
                                        tmp_path / "stranger.kubeconfig", namespace))
    wait_for(lambda: role_bound(cluster, namespace, "sq"), 20, "the per-run Role")
    stranger.request("POST", leases_path(namespace), query={"fieldManager": "squatter-tool"},
                     body={"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                           "metadata": {"name": lease_name("sq", "sq-0")},
                           "spec": {"holderIdentity": "squatter"}})
    node = make_handler("sq", "sq-0", min_nodes=1, kubeconfig=config, api_timeout=5)
    started = time.monotonic()
    with pytest.raises(RendezvousError) as raised:
        node.next_rendezvous()
    message = str(raised.value)
    assert f"Lease name {namespace}/sq.sq-0 of node 'sq-0' is taken" in message
    assert "not a Lease of ElasticRun sq" in message
    assert "holder: squatter" in message and "written by: squatter-tool" in message
    assert time.monotonic() - started < 10  # an error at once, not a wait


def test_no_account_may_take_a_nodes_lease_name_with_an_unlabelled_lease(
        cluster: Cluster, helm: Helm, namespace: str, make_handler: Any, tmp_path: Path,
        request: pytest.FixtureRequest) -> None:
    """Issue 35, case C: an account no policy lists, holding only ``create`` on Leases,
    took node sq-0's Lease name with an unlabelled Lease, and the node failed with
    "the Lease name ... is taken".  With the chart's ``<release>-lease-names`` policy
    it is refused, in both shapes of the name; its other Leases are not."""
    kinds = {"ServiceAccount", "Role", "RoleBinding", "ValidatingAdmissionPolicy",
             "ValidatingAdmissionPolicyBinding"}
    docs = [d for d in helm.template("ln", namespace, {
        "trainingNamespaces": [namespace], "fullnameOverride": namespace}) if d["kind"] in kinds]
    names = {d["metadata"]["name"] for d in by_kind(docs, "ValidatingAdmissionPolicy")}
    assert any(name.endswith("-lease-names") for name in names), names
    request.addfinalizer(lambda: delete_cluster_scoped(cluster, docs))
    apply(cluster, docs)
    trainer = token_kubeconfig(cluster, request_token(cluster, namespace, "elasticrun-trainer"),
                               tmp_path / "trainer.kubeconfig", namespace)
    _service_account(cluster, namespace, "stranger")
    cluster.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                   "metadata": {"name": "stranger", "namespace": namespace},
                   "rules": [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                              "verbs": ["create", "get", "delete"]}]})
    cluster.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                   "metadata": {"name": "stranger", "namespace": namespace},
                   "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                               "name": "stranger"},
                   "subjects": [{"kind": "ServiceAccount", "name": "stranger",
                                 "namespace": namespace}]})
    stranger = _client(token_kubeconfig(cluster, request_token(cluster, namespace, "stranger"),
                                        tmp_path / "stranger.kubeconfig", namespace))

    def squat(name: str, dry_run: bool = False) -> str:
        return _refusal(lambda: stranger.request(
            "POST", leases_path(namespace), query={"dryRun": "All"} if dry_run else None,
            body={"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                  "metadata": {"name": name}, "spec": {"holderIdentity": "squatter"}}))

    wait_for(lambda: "may not update ElasticRun" in squat(lease_name("sq", "sq-0"), True), 30,
             "the Lease-name policy to be enforced", interval=0.3)
    plain = squat(lease_name("sq", "sq-0"))
    assert f"may not update ElasticRun {namespace}/sq, so it may not create a Lease under " \
        "sq.sq-0" in plain
    # The hashed shape (a dotted node, a dotted run): the run part unescaped is the run.
    hashed = lease_name("sq", "host.example.org")
    assert hashed.count(".") == 2
    assert f"ElasticRun {namespace}/sq, so" in squat(hashed)
    dotted = lease_name("team.b", "b-0")
    assert dotted.startswith("team-1b.")
    assert f"ElasticRun {namespace}/team.b, so" in squat(dotted)
    # Positive control: the same account's Leases of other shapes are not elasticrun's.
    for other in ("stranger-lock", "80807133.tutorial.kubebuilder.io", "a.b.c"):
        assert squat(other) == "", other
        stranger.request("DELETE", lease_path(namespace, other))
    # The node takes its own name and forms its round on the trainer's token.
    node = make_handler("sq", "sq-0", min_nodes=1, kubeconfig=trainer, last_call_timeout=0)
    assert_all_ok(rendezvous_all([node]))
    held = cluster.client.request("GET", lease_path(namespace, lease_name("sq", "sq-0")))
    assert held["metadata"]["labels"][crd.RUN_LABEL] == "sq"


def test_another_accounts_pod_named_like_a_podless_member_removes_nobody(
        chart_operator: OperatorProcess, make_handler: Any, pods: Kubelet, cluster: Cluster,
        namespace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 35, case A, on the chart's roles: the operator on its chart token, the run's
    nodes on the run's own ServiceAccount, another account that may only make Pods.

    pl-1 started without ``pod``/``POD_NAME``: a Pod ``pl-1`` with the run's label,
    created and deleted by that account, removed it (``PodDeleted``).  Now nobody is
    removed, after twice the run's heartbeat; deleting pl-0's own Pod still removes
    pl-0 (the positive control, the same kind of loss).
    """
    monkeypatch.delenv("POD_NAME", raising=False)
    monkeypatch.delenv("POD_UID", raising=False)
    config = _account(cluster, namespace, tmp_path, "pl", "sa-pl")
    wait_for(lambda: role_bound(cluster, namespace, "pl"), 20, "the per-run Role")
    uid = pods.create("pl-0", "pl")["metadata"]["uid"]
    conf = {"min_nodes": 2, "kubeconfig": config, "heartbeat_timeout": 4,
            "lease_renew_interval": 1, "last_call_timeout": 1}
    nodes = [make_handler("pl", "pl-0", pod="pl-0", pod_uid=uid, **conf),
             make_handler("pl", "pl-1", **conf)]
    assert_all_ok(rendezvous_all(nodes))
    sealed = read_run(cluster.client, namespace, "pl")
    assert {(p.name, p.pod) for p in sealed.status.participants} == {
        ("pl-0", "pl-0"), ("pl-1", None)}
    maker = account_client(cluster, namespace, "pod-maker",
                           [{"apiGroups": [""], "resources": ["pods"],
                             "verbs": ["create", "delete"]}], tmp_path)
    maker.request("POST", f"/api/v1/namespaces/{namespace}/pods", body={
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "pl-1", "labels": {crd.RUN_LABEL: "pl"}},
        "spec": {"schedulerName": "nobody", "containers": [
            {"name": "x", "image": "busybox", "command": ["sleep", "1"]}]}})
    maker.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/pl-1",
                  query={"gracePeriodSeconds": 0})
    time.sleep(2 * 4 + 2)  # twice the heartbeat, the timer pl-1's liveness rests on
    after = read_run(cluster.client, namespace, "pl")
    assert after.status.lost_members == ()
    assert after.status.member_names == {"pl-0", "pl-1"}
    assert after.status.round == sealed.status.round
    pods.delete("pl-0")
    wait_for(lambda: read_run(cluster.client, namespace, "pl").status.lost_members != (),
             10, "pl-0's loss")
    lost = read_run(cluster.client, namespace, "pl").status.lost_members
    assert [(m.name, m.reason) for m in lost] == [("pl-0", "PodDeleted")]


def test_one_crafted_lease_costs_the_operator_a_few_requests_not_a_loop(
        chart_operator: OperatorProcess, make_handler: Any, cluster: Cluster,
        namespace: str, tmp_path: Path) -> None:
    """Issue 20, case 2: 5,979 requests in 20 s from one expired Lease whose name and owner
    did not match.  Counted from the API server's audit log, as the operator's own user."""
    local = cluster.require_local()
    kubeconfigs = _runs_with_own_accounts(cluster, namespace, tmp_path)
    nodes = [make_handler("run-a", f"run-a-{i}", min_nodes=2, kubeconfig=kubeconfigs["run-a"],
                          heartbeat_timeout=4, lease_renew_interval=1, last_call_timeout=1)
             for i in range(2)]
    assert_all_ok(rendezvous_all(nodes))
    run = read_run(cluster.client, namespace, "run-a")
    audit = AuditLog(local.state.audit_log)  # type: ignore[union-attr]
    time.sleep(1)
    mark = audit.mark()
    # No admission policy here: what the operator itself does with such objects.
    crafted = [
        # labelled and annotated for run-a, node "ghost", under another name
        _forged_lease("run-a", "ghost", run.uid, name="run-a.ghost-elsewhere"),
        # under its computed name, owned by another (earlier) run of that name
        _forged_lease("run-a", "orphan", "0000-earlier-run"),
        # without an owner
        _forged_lease("run-a", "nobody", None),
    ]
    for lease in crafted:
        lease["spec"]["renewTime"] = LONG_AGO
        cluster.client.request("POST", leases_path(namespace), body=lease)
    window = 20.0
    time.sleep(window)
    operator_user = f"system:serviceaccount:{namespace}:{namespace}"
    mine = [e for e in audit.entries(namespace, since=mark) if e.user == operator_user]
    kinds: dict[str, int] = {}
    for entry in mine:
        kinds[entry.kind] = kinds.get(entry.kind, 0) + 1
    print(f"\noperator requests in {window:g}s after 3 crafted Leases: {kinds}")
    assert len(mine) <= 20, kinds
    assert not [e for e in mine if e.verb == "delete" and e.resource == "leases"], kinds
    # The crafted Leases are still there (not the operator's to delete) and count for nobody.
    current = read_run(cluster.client, namespace, "run-a")
    assert current.status.member_names == {"run-a-0", "run-a-1"}
    assert current.status.waiting == () and current.status.lost_members == ()
    for lease in crafted:
        assert not _gone(cluster, namespace, lease["metadata"]["name"])
    # The control: the same count sees the operator's requests when it has work (its
    # user, this namespace): the drain of a member is a write of run-a by it.
    drained = audit.mark()
    cluster.client.request("PATCH", run_path(namespace, "run-a"), body={"metadata": {
        "annotations": {crd.DRAIN_ANNOTATION: "run-a-1"}}}, content_type=MERGE_PATCH)
    wait_for(lambda: [e for e in audit.entries(namespace, since=drained)
                      if e.user == operator_user and e.resource == "elasticruns"
                      and e.verb in {"update", "patch"}], 15,
             f"the drain's write of run-a by {operator_user} in the audit log")
    record("one crafted Lease against the operator (issue 20, case 2)", group="security",
           fault="3 expired Leases labelled for a run: under another name, owned by another "
                 "uid, without an owner",
           expected="no request loop; none of them deleted under a computed name",
           observed=f"{len(mine)} operator requests in {window:g}s ({kinds})",
           recovery_seconds=None)


def test_a_member_removed_while_partitioned_rejoins_under_per_run_rbac(
        chart_operator: OperatorProcess, make_handler: Any, cluster: Cluster,
        namespace: str, tmp_path: Path) -> None:
    """Issue 20, case 6: its Lease deleted, the Role used to drop its name (403 on renewal)."""
    kubeconfigs = _runs_with_own_accounts(cluster, namespace, tmp_path)
    nodes = [make_handler("run-a", f"run-a-{i}", min_nodes=2, kubeconfig=kubeconfigs["run-a"],
                          heartbeat_timeout=4, lease_renew_interval=1, last_call_timeout=1)
             for i in range(2)]
    assert_all_ok(rendezvous_all(nodes))
    healed = nodes[1]
    keeper = healed.lease
    assert keeper is not None
    first = cluster.client.request("GET", lease_path(namespace, keeper.name))["metadata"]["uid"]
    keeper.stop_renewing()  # partitioned: alive, silent
    wait_for(lambda: [m.name for m in read_run(cluster.client, namespace, "run-a")
                      .status.lost_members] == ["run-a-1"], 15, "run-a-1 to be removed")
    wait_for(lambda: _gone(cluster, namespace, keeper.name), 10, "its Lease to be deleted")
    keeper.resume_renewing()  # the partition heals
    wait_for(lambda: not _gone(cluster, namespace, keeper.name), 10,
             "the healed node to create its Lease again")
    outcomes = rendezvous_all(nodes)
    assert_all_ok(outcomes)
    run = read_run(cluster.client, namespace, "run-a")
    assert run.status.round == 2 and run.status.member_names == {"run-a-0", "run-a-1"}
    assert sorted(p.rank for p in run.status.participants) == [0, 1]
    again = cluster.client.request("GET", lease_path(namespace, keeper.name))["metadata"]["uid"]
    assert again != first
    # What let it back: its name stayed in the run's Role while it had no Lease.
    assert keeper.name in _role_leases(cluster, namespace, "run-a")
    refusals = [line for line in chart_operator.log_path.read_text(errors="replace")
                .splitlines() if "cannot" in line and "forbidden" in line]
    assert refusals == [], refusals[:3]


def test_another_runs_writer_cannot_put_leases_into_a_runs_list(
        chart_operator: OperatorProcess, lease_policy: None, make_handler: Any,
        cluster: Cluster, namespace: str, tmp_path: Path) -> None:
    """Issue 20, case 7 (node half): 150 decoys of run B in run A's LIST (37 MB)."""
    kubeconfigs = _runs_with_own_accounts(cluster, namespace, tmp_path)
    nodes = [make_handler("run-a", f"run-a-{i}", min_nodes=2, kubeconfig=kubeconfigs["run-a"],
                          heartbeat_timeout=4, lease_renew_interval=1, last_call_timeout=1)
             for i in range(2)]
    assert_all_ok(rendezvous_all(nodes))
    b = _client(kubeconfigs["run-b"])
    run_b = read_run(cluster.client, namespace, "run-b")
    padding = "x" * 10_000
    refused = 0
    for i in range(150):
        decoy = _forged_lease("run-b", f"decoy-{i}", run_b.uid, label="run-a")
        decoy["metadata"]["annotations"]["padding"] = padding
        if "must carry the label" in _refusal(
                lambda d=decoy: b.request("POST", leases_path(namespace), body=d)):
            refused += 1
    assert refused == 150
    a = _client(kubeconfigs["run-a"])
    started = time.monotonic()
    listed = a.request("GET", leases_path(namespace), query=run_leases_query("run-a"))
    took = time.monotonic() - started
    size = len(json.dumps(listed))
    assert sorted(i["metadata"]["annotations"][crd.NODE_ANNOTATION]
                  for i in listed["items"]) == ["run-a-0", "run-a-1"]
    assert size < 20_000, size
    record("decoy Leases in another run's LIST (issue 20, case 7)", group="security",
           fault="run B's token creates 150 Leases of 10 kB labelled for run A",
           expected="refused by the policy; A's LIST holds A's Leases only",
           observed=f"150 refused; A's LIST: 2 items, {size} bytes, {took * 1000:.0f} ms",
           recovery_seconds=None)


# --------------------------------------------------------------------------- the round's store


def _established_to(port: int) -> int:
    """TCP connections on this machine whose remote end is ``port``."""
    return sum(1 for _, remote, state in _sockets()
               if state == "01" and int(remote.split(":")[1], 16) == port)  # 01 = ESTABLISHED


def _status_writer(cluster: Cluster, namespace: str, tmp_path: Path) -> KubeClient:
    """A ServiceAccount allowed to update ElasticRuns and their status, and nothing else
    (a user with kubectl rights on runs, or a pod of another run in a shared namespace)."""
    return account_client(cluster, namespace, "status-writer", [
        {"apiGroups": [crd.GROUP], "resources": [crd.PLURAL, f"{crd.PLURAL}/status"],
         "verbs": ["get", "list", "watch", "update", "patch"]}], tmp_path)


def test_nodes_refuse_a_store_their_rank0_did_not_announce(
        operator: OperatorProcess, make_handler: Any, cluster: Cluster, namespace: str,
        tmp_path: Path) -> None:
    """Issue 20, case 8: a writer of the run seals a round on the attacker's TCPStore.

    The attacker holds only ElasticRun rights (a real token).  It seals the
    waiting nodes' round itself, with their real join requests and ranks, and
    ``status.store`` pointing at its own TCPStore.  Rank 0 refuses (it serves
    its own store), the other member refuses (rank 0's Lease announces another
    store), nobody connects, and an honest round forms afterwards.
    """
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import RendezvousStateError

    from elasticrun.api.leases import lease_state
    from elasticrun.api.model import RunStatus

    from rdzv import is_waiting, start_rendezvous

    attacker = _status_writer(cluster, namespace, tmp_path)
    trap = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    keys_before = trap.num_keys()
    own_connections = _established_to(trap.port)  # the trap's own client, to its server
    a, b = (make_handler("victim", n, min_nodes=3) for n in ("a", "b"))
    boxes = [start_rendezvous(h) for h in (a, b)]
    wait_for(lambda: all(is_waiting(cluster.client, namespace, "victim", n) for n in "ab"), 15,
             "a and b to wait")
    joins = {n: lease_state(cluster.client.request(
        "GET", lease_path(namespace, lease_name("victim", n)))).join for n in "ab"}
    raw = attacker.request("GET", run_path(namespace, "victim"))
    honest = RunStatus.from_dict(raw.get("status"))
    forged = {**honest.to_dict(), "phase": "Running", "round": 1, "signal": honest.signal + 1,
              "participants": [
                  {"name": n, "rank": rank, "joinedRound": 1,
                   "since": format_time(joins[n].since)}  # type: ignore[union-attr]
                  for rank, n in enumerate("ab")],
              "waiting": [], "store": {"host": "127.0.0.1", "port": trap.port}}
    raw["status"] = forged
    attacker.request("PUT", run_path(namespace, "victim", "status"), body=raw)
    for thread, _ in boxes:
        thread.join(30)
    (_, box_a), (_, box_b) = boxes
    error_a, error_b = box_a.get("error"), box_b.get("error")
    assert isinstance(error_a, RendezvousStateError), box_a
    assert isinstance(error_b, RendezvousStateError), box_b
    announced = f"127.0.0.1:{joins['a'].store_port}"  # type: ignore[union-attr]
    assert f"round 1 makes this node rank 0 with store 127.0.0.1:{trap.port}, but it serves " \
           f"its store at {announced}" in str(error_a), error_a
    assert f"refusing the store of round 1: the round names store 127.0.0.1:{trap.port}, " \
           f"but rank 0 (a) announced {announced}. No connection was made" in str(error_b)
    assert "check who may update the ElasticRun victim" in str(error_b)
    assert trap.num_keys() == keys_before
    assert _established_to(trap.port) == own_connections
    # The honest path: a third node waits first, a and b come back, one round of three.
    c = make_handler("victim", "c", min_nodes=3)
    thread_c, box_c = start_rendezvous(c)
    wait_for(lambda: is_waiting(cluster.client, namespace, "victim", "c"), 15, "c to wait")
    outcomes = rendezvous_all([a, b])
    thread_c.join(30)
    assert_all_ok(outcomes)
    assert "info" in box_c, box_c
    infos = {"c": box_c["info"], **{n: o.info for n, o in outcomes.items()}}
    assert sorted(i.rank for i in infos.values()) == [0, 1, 2]
    assert {i.world_size for i in infos.values()} == {3}
    run = read_run(cluster.client, namespace, "victim")
    assert run.status.round == 2 and run.status.store is not None
    assert run.status.store.port != trap.port
    leader = next(i for i in infos.values() if i.rank == 0)
    leader.store.set("honest", "yes")
    assert all(i.store.get("honest") == b"yes" for i in infos.values())
    assert trap.num_keys() == keys_before and _established_to(trap.port) == own_connections
    record("status.store pointed at an attacker's TCPStore", group="security",
           fault="a writer of the run (ElasticRun rights only, real token) seals the waiting "
                 "nodes' round with status.store on its own TCPStore",
           expected="rank 0 and the member refuse with RendezvousStateError naming both "
                    "stores; no connection; an honest round forms after",
           observed=f"both refused; the attacker's store: {trap.num_keys() - keys_before} new "
                    "keys, 0 connections; round 2 formed with ranks 0-2 on rank 0's store",
           recovery_seconds=None)


# --------------------------------------------------------------------------- per-run policies

NP_VALUES = {"networkPolicy": {"enabled": True, "perRun": True, "storePort": 29400}}


def _admits_tcp(rule: dict[str, Any], port: int) -> bool:
    for allowed in rule.get("ports") or [{}]:
        low = allowed.get("port")
        high = allowed.get("endPort", low)
        if allowed.get("protocol", "TCP") == "TCP" and (low is None or low <= port <= high):
            return True
    return False


def _run_manifest(name: str) -> dict[str, Any]:
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": name},
            "spec": {"minNodes": 1}}


def test_per_run_network_policies_admit_only_the_runs_pods_to_its_store(
        cluster: Cluster, helm: Helm, namespace: str, tmp_path: Path,
        request: pytest.FixtureRequest) -> None:
    """Issue 20, case 8: run A's pods reach run B's store (a namespace policy cannot say
    "the same run").  With ``networkPolicy.perRun`` the chart's namespace policy leaves
    the store port out, and the operator, on nothing but the chart's role, gives each
    run a policy of its own (checked as stored: no CNI here enforces it)."""
    port = NP_VALUES["networkPolicy"]["storePort"]
    values = {"trainingNamespaces": [namespace], "fullnameOverride": namespace,
              "operator": {"scope": "namespaces"}, "webhook": {"enabled": False},
              **NP_VALUES}
    rendered = helm.template("sec", namespace, values)
    (deployment,) = by_kind(rendered, "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--per-run-network-policy={port}" in args
    (shared,) = by_kind(rendered, "NetworkPolicy")
    assert not any(_admits_tcp(rule, port) for rule in shared["spec"]["ingress"]), shared
    assert any(_admits_tcp(rule, port - 1) for rule in shared["spec"]["ingress"])
    (role,) = [d for d in by_kind(rendered, "Role")
               if d["metadata"]["name"] == f"{namespace}-operator"]
    policy_rules = [r for r in role["rules"] if "networkpolicies" in r["resources"]]
    assert policy_rules == [{"apiGroups": ["networking.k8s.io"],
                             "resources": ["networkpolicies"],
                             "verbs": ["create", "patch", "delete"]}]
    docs = [d for d in rendered if d["kind"] in {"ServiceAccount", "Role", "RoleBinding",
                                                  "ClusterRole", "ClusterRoleBinding"}]
    request.addfinalizer(lambda: delete_cluster_scoped(cluster, docs))
    apply(cluster, docs)
    kubeconfig = token_kubeconfig(cluster, request_token(cluster, namespace, namespace),
                                  tmp_path / "operator.kubeconfig", namespace)
    op = OperatorProcess(kubeconfig, [namespace], tmp_path,
                         extra_args=["--per-run-network-policy", str(port)])
    op.start()
    try:
        runs = {}
        for name in ("team-a", "team-b"):
            runs[name] = cluster.client.request(
                "POST", f"/apis/{crd.API_VERSION}/namespaces/{namespace}/{crd.PLURAL}",
                body=_run_manifest(name))["metadata"]["uid"]
        base = f"/apis/networking.k8s.io/v1/namespaces/{namespace}/networkpolicies"

        def made() -> Any:
            items = cluster.client.request("GET", base).get("items") or []
            own = [i for i in items if i["metadata"]["name"].startswith("elasticrun-store.")]
            return own if len(own) == 2 else None

        policies = {p["metadata"]["annotations"][crd.RUN_LABEL]: p
                    for p in wait_for(made, 20, "the operator to make the per-run policies")}
        for name, uid in runs.items():
            stored = policies[name]
            pods = {"matchLabels": {crd.RUN_LABEL: name}}
            assert stored["spec"]["podSelector"] == pods
            assert stored["spec"]["policyTypes"] == ["Ingress"]
            assert stored["spec"]["ingress"] == [
                {"from": [{"podSelector": pods}], "ports": [{"protocol": "TCP", "port": port}]}]
            (owner,) = stored["metadata"]["ownerReferences"]
            assert (owner["kind"], owner["name"], owner["uid"]) == (crd.KIND, name, uid)
        log_text = op.log_path.read_text(errors="replace")
        assert "forbidden" not in log_text, log_text[-2000:]
    finally:
        op.stop()
    record("per-run NetworkPolicy (networkPolicy.perRun)", group="security",
           fault="a pod of run A connects to run B's TCPStore (same namespace)",
           expected="the namespace policy leaves the store port out; each run's policy admits "
                    "only its own pods to it; owned by the run; the chart's role suffices",
           observed=f"2 runs, 2 policies: podSelector {crd.RUN_LABEL}=<run>, TCP {port} from "
                    "the same selector, ownerReference the run's uid; the namespace policy "
                    f"admits TCP {port} from nobody",
           recovery_seconds=None)


def test_no_per_run_network_policy_unless_enabled(
        operator: OperatorProcess, make_handler: Any, cluster: Cluster, namespace: str,
        helm: Helm) -> None:
    assert_all_ok(rendezvous_all([make_handler("plain", "solo")]))
    wait_for(lambda: spec_observed(cluster.client, namespace, "plain"), 10,
             "the operator to reconcile the run")
    consistently(lambda: cluster.client.request(
        "GET", f"/apis/networking.k8s.io/v1/namespaces/{namespace}/networkpolicies")
        .get("items") == [], RECONCILES, "a per-run NetworkPolicy without the flag")
    (deployment,) = by_kind(helm.template("sec", "ops"), "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not any(a.startswith("--per-run-network-policy") for a in args)
