"""The chart's roles, checked by the real API server's authorizer.

Questions go through SubjectAccessReview (``kubectl auth can-i --as``), and the
training pod's role is also exercised for real: a rendezvous run by handlers
that hold nothing but a TokenRequest token of the training ServiceAccount.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from owned import create_job, create_owned_pod, pod_on

from elasticrun.api import crd
from elasticrun.api.model import Desired
from elasticrun.api.naming import lease_name
from elasticrun.handler.handler import ElasticRunForbiddenError

from chartkit import (
    Helm,
    apply,
    by_kind,
    can_i,
    delete_cluster_scoped,
    one,
    refusals,
    request_token,
    service_account,
    token_kubeconfig,
)
from conftest import ROOT, Cluster, Kubelet, ProcessGroup, wait_for
from controlplane.localcluster import clean_env, free_port
from rdzv import read_run, rendezvous_all, run_deleted, start_rendezvous

pytest_plugins = ("chartfixtures",)

TRAINER = "elasticrun-trainer"
SLICES = f"{crd.SLICE_PLURAL}.{crd.GROUP}"
#: The workloads whose size the operator reads by name (status.desired): get only.
OWNER_KINDS = ("jobs.batch", "statefulsets.apps", "jobsets.jobset.x-k8s.io",
               "trainjobs.trainer.kubeflow.org")


def may(cluster: Cluster, user: str, verb: str, kind: str, namespace: str | None = None
        ) -> bool:
    """A SubjectAccessReview for ``kind`` (``plural.group``), asked of the API server
    directly: kubectl's can-i cannot name a resource whose CRD is not installed."""
    plural, group = kind.split(".", 1)
    attributes = {"verb": verb, "resource": plural, "group": group,
                  **({"namespace": namespace} if namespace else {})}
    review = cluster.client.request(
        "POST", "/apis/authorization.k8s.io/v1/subjectaccessreviews",
        body={"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
              "spec": {"user": user, "resourceAttributes": attributes}})
    return bool(review["status"].get("allowed"))


def install_rbac(cluster: Cluster, helm: Helm, release_ns: str, values: dict[str, Any],
                 request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    """Apply the chart's ServiceAccounts and roles (nothing else is needed to ask)."""
    docs = [d for d in helm.template("rb", release_ns, {**values, "fullnameOverride": release_ns})
            if d["kind"] in {"ServiceAccount", "Role", "RoleBinding", "ClusterRole",
                             "ClusterRoleBinding"}]
    request.addfinalizer(lambda: delete_cluster_scoped(cluster, docs))
    apply(cluster, docs)
    return docs


def listed_rules(cluster: Cluster, user: str, namespace: str) -> dict[str, set[str]]:
    """``kubectl auth can-i --list``: resource -> verbs, minus what any ServiceAccount has.

    The baseline (system:basic-user, ClusterTrustBundle readers, ...) is asked
    from the server for a ServiceAccount bound to nothing, not hard-coded.
    """
    mine = _rules(cluster, user, namespace)
    baseline = _rules(cluster, service_account(namespace, "bound-to-nothing"), namespace)
    return {k: v - baseline.get(k, set()) for k, v in mine.items()
            if v - baseline.get(k, set())}


def _rules(cluster: Cluster, user: str, namespace: str) -> dict[str, set[str]]:
    out = cluster.kubectl("auth", "can-i", "--list", f"--as={user}", "-n", namespace).stdout
    rules: dict[str, set[str]] = {}
    for line in out.splitlines()[1:]:
        match = re.match(r"^(\S+)\s+\[(.*?)\]\s+\[(.*?)\]\s+\[(.*?)\]\s*$", line)
        if not match or not match.group(1) or match.group(1).startswith("["):
            continue  # non-resource URL rows
        rules.setdefault(match.group(1), set()).update(match.group(4).split())
    return rules


# --------------------------------------------------------------------------- training pods


def test_training_service_account_has_exactly_the_handlers_rights(
        cluster: Cluster, helm: Helm, namespace: str,
        extra_namespace: Callable[[str], str], request: pytest.FixtureRequest) -> None:
    other = extra_namespace("other")
    install_rbac(cluster, helm, namespace, {"trainingNamespaces": [namespace]}, request)
    trainer = service_account(namespace, TRAINER)

    assert listed_rules(cluster, trainer, namespace) == {
        "elasticruns.elasticrun.dev": {"get", "list", "watch", "create", "patch", "update"},
        "elasticruns.elasticrun.dev/status": {"get", "patch", "update"},
        "elasticrunslices.elasticrun.dev": {"get", "list", "watch"},
        "leases.coordination.k8s.io": {"get", "list", "watch", "create", "patch", "update",
                                       "delete"},
    }
    # The same questions one by one, as SubjectAccessReviews.
    for verb in ("get", "watch", "patch"):
        assert can_i(cluster, trainer, verb, "elasticruns.elasticrun.dev", namespace=namespace)
        assert can_i(cluster, trainer, verb, "elasticruns.elasticrun.dev/status",
                     namespace=namespace)
    for verb in ("create", "update", "delete"):
        assert can_i(cluster, trainer, verb, "leases.coordination.k8s.io", namespace=namespace)
    for verb in ("get", "list", "watch"):
        assert can_i(cluster, trainer, verb, SLICES, namespace=namespace), verb
    # ... and nothing more: only the operator writes slices.
    for verb in ("create", "update", "patch", "delete", "deletecollection"):
        assert not can_i(cluster, trainer, verb, SLICES, namespace=namespace), verb
    assert not can_i(cluster, trainer, "delete", "elasticruns.elasticrun.dev",
                     namespace=namespace)
    assert not can_i(cluster, trainer, "deletecollection", "leases.coordination.k8s.io",
                     namespace=namespace)
    for resource in ("secrets", "pods", "configmaps", "serviceaccounts"):
        assert not can_i(cluster, trainer, "get", resource, namespace=namespace), resource
    assert not can_i(cluster, trainer, "create", "serviceaccounts/token", namespace=namespace)
    for verb, resource in (("get", "elasticruns.elasticrun.dev"),
                           ("create", "leases.coordination.k8s.io"),
                           ("get", "pods"), ("get", "secrets")):
        assert not can_i(cluster, trainer, verb, resource, namespace=other), (verb, resource)
    assert not can_i(cluster, trainer, "list", "elasticruns.elasticrun.dev")  # cluster-wide


def test_runs_can_be_made_uncreatable_by_nodes(
        cluster: Cluster, helm: Helm, namespace: str, request: pytest.FixtureRequest) -> None:
    install_rbac(cluster, helm, namespace, {"trainingNamespaces": [namespace],
                                            "training": {"allowCreateRuns": False}}, request)
    trainer = service_account(namespace, TRAINER)
    assert not can_i(cluster, trainer, "create", "elasticruns.elasticrun.dev",
                     namespace=namespace)
    assert can_i(cluster, trainer, "patch", "elasticruns.elasticrun.dev/status",
                 namespace=namespace)


def test_handler_with_only_the_training_token_completes_a_rendezvous(
        cluster: Cluster, helm: Helm, namespace: str, make_handler: Callable[..., Any],
        extra_namespace: Callable[[str], str], tmp_path: Path,
        request: pytest.FixtureRequest) -> None:
    install_rbac(cluster, helm, namespace, {"trainingNamespaces": [namespace]}, request)
    token = request_token(cluster, namespace, TRAINER)
    kubeconfig = token_kubeconfig(cluster, token, tmp_path / "trainer.kubeconfig", namespace)
    # The run does not exist yet: the first node creates it with the training role.
    handlers = [make_handler("sa-run", f"node-{i}", min_nodes=2, max_nodes=2,
                             kubeconfig=kubeconfig, last_call_timeout=0) for i in range(2)]
    outcomes = rendezvous_all(handlers, timeout=60)
    assert all(o.error is None for o in outcomes.values()), outcomes
    assert sorted(o.rank for o in outcomes.values()) == [0, 1]
    assert {o.world_size for o in outcomes.values()} == {2}
    run = cluster.client.request(
        "GET", f"/apis/elasticrun.dev/v1alpha1/namespaces/{namespace}/elasticruns/sa-run")
    assert run["status"]["round"] == 1
    # Leases were written with the same token (one per member).
    leases = cluster.client.request(
        "GET", f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases")
    assert len(leases["items"]) >= 2

    # The same token is refused in a namespace the chart did not list.
    elsewhere = extra_namespace("other")
    stranger = make_handler("sa-run", "node-x", min_nodes=1, kubeconfig=kubeconfig,
                            namespace=elsewhere, api_timeout=5)
    with pytest.raises(ElasticRunForbiddenError) as info:
        stranger.next_rendezvous()
    assert elsewhere in str(info.value) or "forbidden" in str(info.value).lower()


# --------------------------------------------------------------------------- operator


def test_operator_cluster_role_reads_no_secrets_and_writes_only_its_webhook(
        cluster: Cluster, helm: Helm, namespace: str, request: pytest.FixtureRequest) -> None:
    docs = install_rbac(cluster, helm, namespace, {}, request)
    operator = service_account(namespace, namespace)  # fullnameOverride = namespace
    for verb in ("get", "list", "watch"):
        assert not can_i(cluster, operator, verb, "secrets"), verb
        assert not can_i(cluster, operator, verb, "secrets", namespace=namespace), verb
        assert can_i(cluster, operator, verb, "pods")
    # Replicas: the shared webhook CA and the leader Lease, by name, in its namespace only.
    ca, leader = f"{namespace}-webhook-ca", f"{namespace}-operator-leader"
    for verb in ("get", "update"):
        assert can_i(cluster, operator, verb, "secrets", namespace=namespace, name=ca), verb
        assert not can_i(cluster, operator, verb, "secrets", namespace=namespace,
                         name="another"), verb
        assert can_i(cluster, operator, verb, "leases.coordination.k8s.io",
                     namespace=namespace, name=leader), verb
    assert not can_i(cluster, operator, "update", "leases.coordination.k8s.io",
                     namespace=namespace, name="another")
    assert can_i(cluster, operator, "create", "leases.coordination.k8s.io", namespace=namespace)
    assert can_i(cluster, operator, "create", "secrets", namespace=namespace)
    assert not can_i(cluster, operator, "create", "secrets", namespace="default")
    assert not can_i(cluster, operator, "create", "leases.coordination.k8s.io",
                     namespace="default")
    for verb in ("create", "delete", "patch"):
        assert not can_i(cluster, operator, verb, "pods"), verb
    for kind in OWNER_KINDS:
        assert may(cluster, operator, "get", kind, namespace), kind
        for verb in ("list", "watch", "patch", "update", "delete", "create"):
            assert not may(cluster, operator, verb, kind, namespace), (verb, kind)
            assert not may(cluster, operator, verb, kind), (verb, kind)
    for verb in ("get", "list", "watch", "patch", "update", "delete"):
        assert can_i(cluster, operator, verb, "elasticruns.elasticrun.dev"), verb
    # Slices: written by server-side apply, deleted with their run on TTL cleanup.
    for verb in ("get", "list", "watch", "create", "patch", "update", "delete"):
        assert can_i(cluster, operator, verb, SLICES), verb
    assert not can_i(cluster, operator, "deletecollection", SLICES)
    # The webhook writes nothing, so the operator never creates runs.
    assert not can_i(cluster, operator, "create", "elasticruns.elasticrun.dev")
    assert can_i(cluster, operator, "update", "elasticruns.elasticrun.dev/status")
    assert can_i(cluster, operator, "delete", "leases.coordination.k8s.io")
    for verb in ("create", "patch", "update"):  # a member's Lease is the member's to write
        assert not can_i(cluster, operator, verb, "leases.coordination.k8s.io"), verb
    assert can_i(cluster, operator, "create", "events")
    assert not can_i(cluster, operator, "list", "namespaces")  # kopf needs none cluster-wide
    assert can_i(cluster, operator, "watch", "customresourcedefinitions.apiextensions.k8s.io")
    assert not can_i(cluster, operator, "update",
                     "customresourcedefinitions.apiextensions.k8s.io")
    (config_name,) = [r["resourceNames"][0] for r in by_kind(docs, "ClusterRole")[0]["rules"]
                      if "resourceNames" in r]
    webhooks = "mutatingwebhookconfigurations.admissionregistration.k8s.io"
    assert can_i(cluster, operator, "patch", webhooks, name=config_name)
    assert not can_i(cluster, operator, "patch", webhooks, name="someone-elses")
    assert not can_i(cluster, operator, "create", webhooks)
    assert not can_i(cluster, operator, "create", "clusterroles.rbac.authorization.k8s.io")


def test_namespaced_operator_sees_only_its_namespaces(
        cluster: Cluster, helm: Helm, namespace: str,
        extra_namespace: Callable[[str], str], request: pytest.FixtureRequest) -> None:
    team, other = extra_namespace("team"), extra_namespace("other")
    install_rbac(cluster, helm, namespace, {"trainingNamespaces": [team],
                                            "operator": {"scope": "namespaces"}}, request)
    operator = service_account(namespace, namespace)
    assert can_i(cluster, operator, "watch", "pods", namespace=team)
    assert can_i(cluster, operator, "patch", "elasticruns.elasticrun.dev/status",
                 namespace=team)
    assert can_i(cluster, operator, "create", SLICES, namespace=team)
    for resource in ("pods", "elasticruns.elasticrun.dev", "leases.coordination.k8s.io",
                     SLICES):
        assert not can_i(cluster, operator, "list", resource, namespace=other), resource
        assert not can_i(cluster, operator, "list", resource), resource
    for kind in OWNER_KINDS:
        assert may(cluster, operator, "get", kind, team), kind
        assert not may(cluster, operator, "get", kind, other), kind
        assert not may(cluster, operator, "list", kind, team), kind
    assert not can_i(cluster, operator, "get", "secrets", namespace=team)
    assert can_i(cluster, operator, "watch", "namespaces")  # kopf's namespace patterns


@pytest.mark.parametrize("scope", ["cluster", "namespaces"])
def test_operator_does_its_work_on_the_chart_role_alone(
        cluster: Cluster, helm: Helm, namespace: str, processes: ProcessGroup,
        tmp_path: Path, request: pytest.FixtureRequest, scope: str) -> None:
    """The real operator, on nothing but its ServiceAccount's token: never refused.

    It watches runs, pods and Leases, writes status, posts Events and deletes a
    finished run with its Leases; any verb the chart forgot shows up as a 403
    in its log (kopf retries and logs refused calls instead of failing), and the
    work it could not do fails the assertions on the outcome.
    """
    install_rbac(cluster, helm, namespace, {
        "trainingNamespaces": [namespace], "operator": {"scope": scope},
        "webhook": {"enabled": False}}, request)  # the webhook's rights: test_webhook.py
    log_path = _chart_operator(cluster, namespace, processes, tmp_path, scope)
    # A run whose pod a Job owns: its size is read with the chart's rights.
    job = create_job(cluster.client, namespace, "sized", "sized", parallelism=3)
    create_owned_pod(Kubelet(cluster.client, namespace), "sized-0", "sized", job)
    cluster.apply({"apiVersion": crd.API_VERSION, "kind": crd.KIND,
                   "metadata": {"name": "sized", "namespace": namespace},
                   "spec": {"minNodes": 1, "maxNodes": 4}})
    wait_for(lambda: read_run(cluster.client, namespace, "sized").status.desired == Desired(
        3, "Job/sized", 1), 30, "status.desired from the Job, on the chart's role")
    _closed_run_is_reported_and_deleted(cluster, namespace)
    text = log_path.read_text(errors="replace")
    # RBAC's refusals read 'is forbidden: User "..." cannot <verb> ...'. (A cluster-wide
    # operator also meets earlier tests' runs in namespaces stuck Terminating, where
    # the API server forbids new Events for another reason.)
    refused = refusals(text)
    assert refused == [], "\n".join(refused[:10])


def test_an_operator_that_may_not_read_owners_keeps_todays_rules_and_logs_it_once(
        cluster: Cluster, helm: Helm, namespace: str, processes: ProcessGroup,
        tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """The chart's Role without the owner rows (an older chart): every get of the Job is
    a 403, which is logged once, gives no desired size, and stops nothing else."""
    install_rbac(cluster, helm, namespace, {
        "trainingNamespaces": [namespace], "operator": {"scope": "namespaces"},
        "webhook": {"enabled": False}}, request)
    path = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/roles/{namespace}-operator"
    role = cluster.client.request("GET", path)
    groups = {kind.split(".", 1)[1] for kind in OWNER_KINDS}
    role["rules"] = [r for r in role["rules"] if not set(r["apiGroups"]) & groups]
    cluster.client.request("PUT", path, body=role)
    operator = service_account(namespace, namespace)
    assert not may(cluster, operator, "get", "jobs.batch", namespace)
    log_path = _chart_operator(cluster, namespace, processes, tmp_path, "namespaces")
    pods = Kubelet(cluster.client, namespace)
    job = create_job(cluster.client, namespace, "unsized", "unsized", parallelism=2)
    for i in range(2):
        create_owned_pod(pods, f"unsized-{i}", "unsized", job)
    cluster.apply({"apiVersion": crd.API_VERSION, "kind": crd.KIND,
                   "metadata": {"name": "unsized", "namespace": namespace},
                   "spec": {"minNodes": 1, "maxNodes": 4}})
    wait_for(lambda: "Job unsized (403)" in log_path.read_text(errors="replace"), 30,
             "the operator to log the refused read of the Job")
    # More pods, more reconciles (and the owner's refresh): still one line, no size.
    for i in range(2, 4):
        create_owned_pod(pods, f"unsized-{i}", "unsized", job)
    _closed_run_is_reported_and_deleted(cluster, namespace)
    assert read_run(cluster.client, namespace, "unsized").status.desired is None
    text = log_path.read_text(errors="replace")
    refused = refusals(text)
    assert len(refused) == 1 and "may not read Job unsized (403)" in refused[0], refused


def _chart_operator(cluster: Cluster, namespace: str, processes: ProcessGroup,
                    tmp_path: Path, scope: str, extra: Sequence[str] = ()) -> Path:
    """The real operator on its chart ServiceAccount's token alone, healthy; its log."""
    token = request_token(cluster, namespace, namespace)  # fullnameOverride = namespace
    kubeconfig = token_kubeconfig(cluster, token, tmp_path / "operator.kubeconfig", namespace)
    port = free_port()
    scope_args = ["--all-namespaces"] if scope == "cluster" else ["--namespace", namespace]
    log_path = tmp_path / "operator.log"
    with open(log_path, "wb") as log:
        proc = processes.start(
            [sys.executable, "-m", "elasticrun.operator", *scope_args, "--health-port",
             str(port), "--health-addr", "127.0.0.1", "--metrics-port", "0",
             "--kubeconfig", str(kubeconfig), "--verbose",
             # The chart's default: leader election on its Lease in its namespace.
             "--leader-elect", "--leader-elect-resource-namespace", namespace,
             "--leader-elect-resource-name", f"{namespace}-operator-leader", *extra],
            stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
            env={**clean_env(), "KUBECONFIG": str(kubeconfig),
                 "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("handler", "operator"))})

    def healthy() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"operator exited:\n{log_path.read_text()[-3000:]}")
        try:
            with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
                    f"http://127.0.0.1:{port}/healthz", timeout=2) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    wait_for(healthy, 60, "the operator's /healthz", interval=0.2)
    return log_path


def _closed_run_is_reported_and_deleted(cluster: Cluster, namespace: str) -> None:
    """The operator's ordinary work: a closed run is reported, TTL-deleted with its Lease."""
    # A labelled pod and Lease to watch, and a closed run that must be reported and deleted.
    cluster.apply({"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"name": "done-0", "namespace": namespace,
                                "labels": {crd.RUN_LABEL: "done"}},
                   "spec": {"containers": [{"name": "c", "image": "x"}]}})
    done = cluster.apply({"apiVersion": crd.API_VERSION, "kind": crd.KIND,
                          "metadata": {"name": "done", "namespace": namespace},
                          "spec": {"minNodes": 1, "ttlSecondsAfterFinished": 0}})
    # The run's own Lease (owned by it, under its node's name): the operator deletes
    # only such Leases with a run.
    cluster.apply({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                   "metadata": {"name": lease_name("done", "done-0"), "namespace": namespace,
                                "labels": {crd.RUN_LABEL: "done"},
                                "annotations": {crd.RUN_LABEL: "done",
                                                crd.NODE_ANNOTATION: "done-0"},
                                "ownerReferences": [{
                                    "apiVersion": crd.API_VERSION, "kind": crd.KIND,
                                    "name": "done", "uid": done["metadata"]["uid"]}]},
                   "spec": {"holderIdentity": "done-0", "leaseDurationSeconds": 15}})
    cluster.apply({"apiVersion": crd.API_VERSION, "kind": crd.KIND,
                   "metadata": {"name": "done", "namespace": namespace},
                   "spec": {"minNodes": 1, "closed": True, "ttlSecondsAfterFinished": 0}})

    wait_for(lambda: run_deleted(cluster.client, namespace, "done"), 60,
             "the operator to close and TTL-delete the run", interval=0.2)
    leader = cluster.client.request(
        "GET", f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/"
               f"{namespace}-operator-leader")
    assert leader["spec"]["holderIdentity"]  # it led: the Lease rights are enough
    events = cluster.client.request("GET", f"/api/v1/namespaces/{namespace}/events")
    reasons = {e["reason"] for e in events["items"]
               if e["involvedObject"].get("name") == "done"}
    assert {"Closed", "Deleted"} <= reasons, reasons
    leases = cluster.client.request(
        "GET", f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases")
    assert [lease["metadata"]["name"] for lease in leases["items"]] == [
        f"{namespace}-operator-leader"]


@pytest.mark.parametrize("enabled", [True, False], ids=["nodeSignals", "without"])
def test_node_signals_read_nodes_through_the_charts_cluster_role_only_when_enabled(
        cluster: Cluster, helm: Helm, namespace: str, processes: ProcessGroup,
        tmp_path: Path, request: pytest.FixtureRequest, enabled: bool) -> None:
    """scope=namespaces: with nodeSignals the chart adds a ClusterRole to get, list and
    watch Nodes (and nothing else cluster-wide), the operator on its token alone watches
    them without a refusal and reports a tainted Node; without it there is no right on
    Nodes, and the operator (no --node-signals) asks for none."""
    values: dict[str, Any] = {
        "trainingNamespaces": [namespace], "operator": {"scope": "namespaces"},
        "webhook": {"enabled": False}}
    if enabled:
        values["nodeSignals"] = {"enabled": True, "defaults": False, "signals": [
            {"kind": "taint", "key": "example.com/notice", "policy": "observe"}]}
    docs = install_rbac(cluster, helm, namespace, values, request)
    operator = service_account(namespace, namespace)
    node_roles = [d for d in by_kind(docs, "ClusterRole")
                  if any("nodes" in r.get("resources", []) for r in d["rules"])]
    for verb in ("get", "list", "watch"):
        assert can_i(cluster, operator, verb, "nodes") is enabled, verb
    for verb in ("update", "patch", "delete"):
        assert not can_i(cluster, operator, verb, "nodes"), verb
    if not enabled:
        assert node_roles == []
        log_path = _chart_operator(cluster, namespace, processes, tmp_path, "namespaces")
        _closed_run_is_reported_and_deleted(cluster, namespace)
        text = log_path.read_text(errors="replace")
        assert refusals(text) == [] and "node signals:" not in text
        assert "topology keys:" not in text
        return
    assert [r["rules"] for r in node_roles] == [[{
        "apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]}]]
    args = one(helm.template("rb", namespace, {**values, "fullnameOverride": namespace}),
               "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    signal_args = [a for a in args if "node-signal" in a]
    assert signal_args == ["--node-signals", "--no-default-node-signals",
                           "--node-signal=taint:example.com/notice:observe"], args
    log_path = _chart_operator(cluster, namespace, processes, tmp_path, "namespaces",
                               signal_args)
    node = f"rbac-{namespace}"
    cluster.client.request("POST", "/api/v1/nodes", body={
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": node},
        "spec": {"taints": [{"key": "example.com/notice", "effect": "NoSchedule"}]}})
    request.addfinalizer(lambda: cluster.client.request("DELETE", f"/api/v1/nodes/{node}"))
    cluster.apply({"apiVersion": crd.API_VERSION, "kind": crd.KIND,
                   "metadata": {"name": "watched", "namespace": namespace},
                   "spec": {"minNodes": 1, "maxNodes": 2}})
    cluster.apply({"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"name": "watched-0", "namespace": namespace,
                                "labels": {crd.RUN_LABEL: "watched"}},
                   "spec": {"nodeName": node, "containers": [{"name": "c", "image": "x"}]}})

    def reported() -> bool:
        events = cluster.client.request("GET", f"/api/v1/namespaces/{namespace}/events",
                                        query={"fieldSelector": "reason=NodeSignal"})
        return any("watched-0" in e.get("message", "") for e in events["items"])

    wait_for(reported, 30, "the NodeSignal Event of the pod on the tainted Node")
    text = log_path.read_text(errors="replace")
    assert refusals(text) == [], refusals(text)[:5]
    assert "node signals: taint:example.com/notice (observe)" in text


def test_topology_keys_read_nodes_through_the_same_cluster_role_and_fill_the_summary(
        cluster: Cluster, helm: Helm, namespace: str, processes: ProcessGroup,
        tmp_path: Path, request: pytest.FixtureRequest, pods: Kubelet,
        make_handler: Callable[..., Any]) -> None:
    """scope=namespaces, nodeSignals off, rankOrder.topologyKeys set: the chart renders the
    one Nodes ClusterRole (get, list, watch) and ``--topology-keys``, and the operator on
    its token alone watches Nodes without a refusal and writes the zone of a waiting
    node's Node into its entry."""
    zone = "topology.kubernetes.io/zone"
    values: dict[str, Any] = {
        "trainingNamespaces": [namespace], "operator": {"scope": "namespaces"},
        "webhook": {"enabled": False}, "rankOrder": {"topologyKeys": [zone]}}
    docs = install_rbac(cluster, helm, namespace, values, request)
    operator = service_account(namespace, namespace)
    node_roles = [d for d in by_kind(docs, "ClusterRole")
                  if any("nodes" in r.get("resources", []) for r in d["rules"])]
    assert [r["rules"] for r in node_roles] == [[{
        "apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]}]]
    for verb in ("get", "list", "watch"):
        assert can_i(cluster, operator, verb, "nodes"), verb
    for verb in ("update", "patch", "delete"):
        assert not can_i(cluster, operator, verb, "nodes"), verb
    args = one(helm.template("rb", namespace, {**values, "fullnameOverride": namespace}),
               "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    node_args = [a for a in args if "node-signal" in a or "topology" in a]
    assert node_args == [f"--topology-keys={zone}"], args
    log_path = _chart_operator(cluster, namespace, processes, tmp_path, "namespaces",
                               node_args)
    node = f"rbac-topo-{namespace}"
    cluster.client.request("POST", "/api/v1/nodes", body={
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": node, "labels": {zone: "zone-rbac"}}})
    request.addfinalizer(lambda: cluster.client.request("DELETE", f"/api/v1/nodes/{node}"))
    cluster.apply({"apiVersion": crd.API_VERSION, "kind": crd.KIND,
                   "metadata": {"name": "placed", "namespace": namespace},
                   "spec": {"minNodes": 2, "maxNodes": 2}})
    pod_on(cluster, pods, "placed-0", "placed", node)
    start_rendezvous(make_handler("placed", "placed-0", min_nodes=2, max_nodes=2,
                                  pod="placed-0"))

    def entry() -> tuple[str, ...] | None:
        waiting = read_run(cluster.client, namespace, "placed").status.waiting
        return next((w.topology for w in waiting if w.name == "placed-0"), None)

    wait_for(lambda: entry() == ("zone-rbac",), 30,
             f"the waiting entry with its Node's zone (last: {entry()})")
    text = log_path.read_text(errors="replace")
    assert refusals(text) == [], refusals(text)[:5]
    assert f"topology keys: {zone}" in text and "node signals:" not in text
