"""Security: who can reach the TCPStore, what the webhook serves, what logs hold, who can write.

* The rank-0 TCPStore (which has no authentication) listens on the node's own
  address only, and the chart's optional NetworkPolicy admits only training
  pods to its port.
* The webhook serves TLS only; neither the operator's nor the handlers' logs
  (at DEBUG) contain a bearer token or a PEM block.
* With ``--per-run-rbac`` a pod of run A can write nothing of run B (real RBAC,
  TokenRequest tokens of two ServiceAccounts).
"""

from __future__ import annotations

import dataclasses
import http.client
import re
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elasticrun.api import crd
from elasticrun.api.kube import (
    MERGE_PATCH,
    ApiError,
    KubeClient,
    lease_path,
    load_credentials,
    run_path,
)
from elasticrun.api.naming import lease_name
from elasticrun.handler.handler import ElasticRunForbiddenError
from elasticrun.operator import runrbac

from chaoskit import assert_all_ok, record, start_node
from chartkit import Helm, apply, by_kind, delete_cluster_scoped, request_token, token_kubeconfig
from conftest import Cluster, ProcessGroup, wait_for
from controlplane.operatorproc import OperatorProcess, free_port
from rdzv import read_run, rendezvous_all

pytest_plugins = ("chartfixtures",)
pytestmark = pytest.mark.slow


# --------------------------------------------------------------------------- the TCPStore


def _listeners(port: int) -> list[str]:
    """Local addresses listening on ``port`` (from /proc/net/tcp and tcp6, hex decoded)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
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
    handler = make_handler("bind", "solo", min_nodes=1)
    handler.settings = dataclasses.replace(handler.settings, address="127.0.0.2")
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
    assert cluster.local is not None
    admin_token = cluster.local.state.token  # type: ignore[union-attr]
    logs = {p.name: p.read_text(errors="replace") for p in tmp_path.glob("*.log")}
    assert "operator.log" in logs and any(n.startswith("node-") for n in logs)
    assert any("DEBUG" in text for text in logs.values())
    for name, text in logs.items():
        assert admin_token not in text, name
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


def _run(cluster: Cluster, namespace: str, name: str, account: str) -> None:
    cluster.client.request("POST", f"/apis/{crd.API_VERSION}/namespaces/{namespace}/"
                           f"{crd.PLURAL}", body={
                               "apiVersion": crd.API_VERSION, "kind": crd.KIND,
                               "metadata": {"name": name, "annotations": {
                                   runrbac.SERVICE_ACCOUNT_ANNOTATION: account}},
                               "spec": {"minNodes": 2, "heartbeatTimeoutSeconds": 4,
                                        "leaseRenewIntervalSeconds": 1}})


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
    kubeconfigs = {}
    for run in ("run-a", "run-b"):
        _service_account(cluster, namespace, f"sa-{run}")
        _run(cluster, namespace, run, f"sa-{run}")
        kubeconfigs[run] = token_kubeconfig(
            cluster, request_token(cluster, namespace, f"sa-{run}"),
            tmp_path / f"{run}.kubeconfig", namespace)
    started = time.monotonic()
    wait_for(lambda: _status(None, lambda: cluster.client.request(
        "GET", runrbac.path("RoleBinding", namespace, "run-b"))) == 200, 20,
        "the operator to create the per-run Roles")
    # Each run's pods, on nothing but their own ServiceAccount's token, form their rounds.
    for run in ("run-a", "run-b"):
        nodes = [make_handler(run, f"{run}-{i}", min_nodes=2, kubeconfig=kubeconfigs[run],
                              heartbeat_timeout=4, lease_renew_interval=1) for i in range(2)]
        assert_all_ok(rendezvous_all(nodes))
    formed = time.monotonic() - started
    # Renewals keep working by name: no Lease expires in a few renewal periods.
    time.sleep(3)
    for run in ("run-a", "run-b"):
        assert read_run(cluster.client, namespace, run).status.lost_members == ()
    a = KubeClient(load_credentials(str(kubeconfigs["run-a"])), timeout=10)
    raw_b = cluster.client.request("GET", run_path(namespace, "run-b"))
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
    }
    assert set(refused.values()) == {403}, refused
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
           observed=f"all 5 refused (403), handler raised ElasticRunForbiddenError; both runs "
                    f"formed on their own tokens ({formed:.1f}s incl. Role set-up); the "
                    "operator ran on the chart's role (perRunRBAC) without a 403",
           recovery_seconds=None)
