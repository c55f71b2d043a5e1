"""The Helm chart: lint, render, and apply every object to the real API server.

Rendered objects are applied for real (server-side apply, not a dry run) into
fresh namespaces. Two things are adapted before applying, both because the
API server is shared by the whole test session: the webhook's namespaceSelector
is pinned to the test's namespace (a failurePolicy=Fail webhook that matched
other tests' pods would break them), and the CRDs, which the session already
installed from deploy/crds/, are compared and dry-run applied instead.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from elasticrun.api import crd

from chartkit import (
    CERT_MANAGER_KINDS,
    CHART,
    NAMESPACE_LABEL,
    Helm,
    apply_chart,
    by_kind,
    one,
)
from conftest import CRD_FILE, CRD_FILES, ROOT, SLICE_CRD_FILE, Cluster

#: The fixtures helm, helm_binary and extra_namespace.
pytest_plugins = ("chartfixtures",)

# --------------------------------------------------------------------------- lint & source


@pytest.mark.parametrize("values", [
    {},
    {"trainingNamespaces": ["a", "b"], "operator": {"scope": "namespaces"},
     "certManager": {"enabled": True}, "networkPolicy": {"enabled": True, "isolate": True}},
])
def test_helm_lint_passes_strict(helm: Helm, values: dict[str, Any]) -> None:
    args = ["lint", "--strict", str(CHART)]
    if values:
        args += ["--values", str(helm.values_file(values))]
    result = helm.run(*args)
    assert "0 chart(s) failed" in result.stdout
    # No warning at all: a symbolic link in files/ once made one on every run.
    assert "WARNING" not in result.stdout and result.stderr == "", result.stderr


#: Each CRD file of deploy/crds/ and the package data of elasticrun.api that links to it.
PACKAGED_CRDS = {CRD_FILE: "crd.yaml", SLICE_CRD_FILE: "slice_crd.yaml"}


def test_chart_crds_are_the_single_source_of_truth(helm: Helm) -> None:
    assert set(PACKAGED_CRDS) == set(CRD_FILES)
    rendered = {d["metadata"]["name"]: d
                for d in by_kind(helm.template("r", "er-system"), "CustomResourceDefinition")}
    # Both CRDs, in the order they are applied (the run's before its slices').
    assert list(rendered) == [crd.CRD_NAME, crd.SLICE_CRD_NAME]
    for path, package_data in PACKAGED_CRDS.items():
        copy = CHART / "files" / "crds" / path.name
        assert not copy.is_symlink() and copy.read_bytes() == path.read_bytes()
        source = yaml.safe_load(path.read_text())
        got = rendered[source["metadata"]["name"]]
        annotations = got["metadata"].pop("annotations")
        assert annotations == {"helm.sh/resource-policy": "keep"}
        assert got == source
        # The handler package ships the same file.
        packaged = ROOT / "handler" / "elasticrun" / "api" / package_data
        assert packaged.resolve() == path.resolve()
    assert rendered[crd.SLICE_CRD_NAME]["spec"]["names"]["kind"] == crd.SLICE_KIND
    assert rendered[crd.SLICE_CRD_NAME]["spec"]["names"]["plural"] == crd.SLICE_PLURAL
    assert rendered[crd.SLICE_CRD_NAME]["spec"]["scope"] == "Namespaced"


def test_crds_can_be_left_out_or_not_kept(helm: Helm) -> None:
    assert by_kind(helm.template("r", "x", {"crds": {"install": False}}),
                   "CustomResourceDefinition") == []
    loose = by_kind(helm.template("r", "x", {"crds": {"keep": False}}),
                    "CustomResourceDefinition")
    assert [d["metadata"]["name"] for d in loose] == [crd.CRD_NAME, crd.SLICE_CRD_NAME]
    assert all("annotations" not in d["metadata"] for d in loose)


def test_packaged_chart_carries_the_crd_contents(helm: Helm, tmp_path: Path) -> None:
    """A published chart carries both CRDs themselves (files/ holds copies, not links)."""
    helm.run("package", str(CHART), "--destination", str(tmp_path))
    (archive,) = tmp_path.glob("elasticrun-*.tgz")
    rendered = by_kind(documents_of(helm.run("template", "r", str(archive)).stdout),
                       "CustomResourceDefinition")
    assert [d["spec"] for d in rendered] == [
        yaml.safe_load(path.read_text())["spec"] for path in CRD_FILES]


def test_a_missing_crd_copy_fails_the_render_naming_it(helm: Helm, tmp_path: Path) -> None:
    chart = tmp_path / "elasticrun"
    shutil.copytree(CHART, chart)
    (chart / "files" / "crds" / SLICE_CRD_FILE.name).unlink()
    result = helm.run("template", "r", str(chart), check=False)
    assert result.returncode != 0
    assert (f"files/crds/{SLICE_CRD_FILE.name} is missing or empty: "
            "run `make chart-files`") in result.stderr
    # Without the CRDs in the chart the file is never read.
    assert helm.run("template", "r", str(chart), "--set", "crds.install=false").returncode == 0


def documents_of(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


# --------------------------------------------------------------------------- defaults


def test_default_render_is_secure_and_complete(helm: Helm) -> None:
    docs = helm.template("r", "er-system")
    kinds = sorted({d["kind"] for d in docs})
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                     "Deployment", "MutatingWebhookConfiguration", "PodDisruptionBudget", "Role",
                     "RoleBinding", "Service", "ServiceAccount",
                     "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    deployment = one(docs, "Deployment")
    spec = deployment["spec"]
    # Two replicas under leader election, rolled one at a time, kept by the PDB.
    assert spec["replicas"] == 2 and spec["strategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    assert one(docs, "PodDisruptionBudget")["spec"]["minAvailable"] == 1
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    (container,) = pod["containers"]
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert container["image"] == "elasticrun-operator:0.1.0"
    assert container["resources"]["requests"] and container["resources"]["limits"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    # Ready only while the webhook is served.
    assert container["readinessProbe"]["tcpSocket"] == {"port": "webhook"}
    assert "--webhook-ca-check-seconds=30" in container["args"]
    assert ports == {"health": 8081, "metrics": 8080, "webhook": 9443}
    args = container["args"]
    assert "--all-namespaces" in args and "--health-port=8081" in args
    assert "--reuse-port" not in args  # a pod network: every replica has its own ports
    # Default certificate: made by the operator, CA written into its own configuration.
    config = one(docs, "MutatingWebhookConfiguration")
    assert f"--webhook-configuration={config['metadata']['name']}" in args
    assert "--webhook-self-signed=r-elasticrun-webhook.er-system.svc" in args
    assert "--webhook-ca-secret=r-elasticrun-webhook-ca" in args  # shared by the replicas
    assert not any(v.get("secret") for v in pod["volumes"])  # read by the operator only
    assert {"--leader-elect", "--leader-elect-resource-name=r-elasticrun-operator-leader",
            "--leader-elect-lease-duration=15", "--leader-elect-renew-deadline=10",
            "--leader-elect-retry-period=2"} <= set(args)
    term = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term[0]["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    # The Lease and the CA Secret: by name in the release namespace, a Role not a ClusterRole.
    (role,) = by_kind(docs, "Role")
    assert role["metadata"]["namespace"] == "er-system"
    assert role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
         "resourceNames": ["r-elasticrun-operator-leader"], "verbs": ["get", "update"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {"apiGroups": [""], "resources": ["secrets"],
         "resourceNames": ["r-elasticrun-webhook-ca"], "verbs": ["get", "update"]},
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]}]
    (binding,) = by_kind(docs, "RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"][0]["name"] == pod["serviceAccountName"]
    (hook,) = config["webhooks"]
    assert hook["clientConfig"]["service"] == {
        "name": "r-elasticrun-webhook", "namespace": "er-system",
        "path": "/elasticrun-pod-env", "port": 443}
    assert hook["objectSelector"] == {"matchExpressions": [
        {"key": crd.RUN_LABEL, "operator": "Exists"}]}
    assert hook["rules"][0]["operations"] == ["CREATE"]
    assert hook["rules"][0]["resources"] == ["pods"]
    assert hook["sideEffects"] == "None"
    assert hook["namespaceSelector"]["matchExpressions"][0]["operator"] == "NotIn"
    service = one(docs, "Service")
    assert service["spec"]["selector"] == \
        deployment["spec"]["selector"]["matchLabels"]


def test_default_values_apply_to_the_real_api_server(
        cluster: Cluster, helm: Helm, namespace: str, request: pytest.FixtureRequest) -> None:
    docs = helm.template("dflt", namespace)
    apply_chart(cluster, docs, namespace, request)
    sa = cluster.kubectl("get", "serviceaccount", "dflt-elasticrun", "-n", namespace)
    assert "dflt-elasticrun" in sa.stdout


# --------------------------------------------------------------------------- non-default


def test_namespaced_operator_with_network_policy_applies(
        cluster: Cluster, helm: Helm, namespace: str,
        extra_namespace: Callable[[str], str],
        request: pytest.FixtureRequest) -> None:
    team_a, team_b = extra_namespace("team"), extra_namespace("team")
    values = {
        "trainingNamespaces": [team_a, team_b],
        "operator": {"scope": "namespaces", "extraArgs": ["--verbose"]},
        "training": {"allowCreateRuns": False,
                     # "v": helm reads an unquoted y as a boolean (the schema refuses it).
                     "serviceAccount": {"name": "trainer", "annotations": {"x": "v"}}},
        "networkPolicy": {"enabled": True, "storePort": 29500},
        "webhook": {"failurePolicy": "Ignore"},
        "image": {"repository": "registry.example/elasticrun-operator",
                  "digest": "sha256:" + "0" * 64},
        "fullnameOverride": "er",
    }
    docs = helm.template("rel", namespace, values)
    apply_chart(cluster, docs, namespace, request)

    cluster_role = one(docs, "ClusterRole")
    resources = {r for rule in cluster_role["rules"] for r in rule["resources"]}
    assert resources == {"customresourcedefinitions", "mutatingwebhookconfigurations",
                         "namespaces"}
    roles = {(r["metadata"]["namespace"], r["metadata"]["name"]) for r in by_kind(docs, "Role")}
    assert roles == {(team_a, "er-operator"), (team_b, "er-operator"),
                     (team_a, "er-training"), (team_b, "er-training"),
                     (namespace, "er-operator-replicas")}  # the leader Lease, the CA Secret
    training = one([r for r in by_kind(docs, "Role") if r["metadata"]["namespace"] == team_a],
                   "Role", "er-training")
    assert "create" not in training["rules"][0]["verbs"]
    container = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "registry.example/elasticrun-operator@sha256:" + "0" * 64
    assert [a for a in container["args"] if a.startswith("--namespace")] == [
        f"--namespace={team_a}", f"--namespace={team_b}"]
    assert container["args"][-1] == "--verbose"
    policy = yaml.safe_load(cluster.kubectl(
        "get", "networkpolicy", "er-store", "-n", team_a, "-o", "yaml").stdout)
    open_ports = policy["spec"]["ingress"][1]["ports"]
    assert {"protocol": "TCP", "port": 1, "endPort": 29499} in open_ports
    assert {"protocol": "TCP", "port": 29501, "endPort": 65535} in open_ports
    hook = one(docs, "MutatingWebhookConfiguration")["webhooks"][0]
    assert hook["failurePolicy"] == "Ignore"
    assert hook["namespaceSelector"]["matchExpressions"][0] == {
        "key": NAMESPACE_LABEL, "operator": "In", "values": [team_a, team_b]}


#: Every verb the operator needs on slices: server-side apply (create, patch, and
#: update), reading them back, and deleting them with their run on TTL cleanup.
OPERATOR_SLICE_VERBS = ["get", "list", "watch", "create", "update", "patch", "delete"]
#: What a verb that changes an object may be called (RBAC's write verbs, and "*").
WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection", "*"}


def slice_verbs(rules: list[dict[str, Any]]) -> set[str]:
    """Every verb ``rules`` grant on elasticrunslices, wildcards included."""
    verbs: set[str] = set()
    for rule in rules:
        if set(rule["apiGroups"]) & {"elasticrun.dev", "*"} and \
                set(rule["resources"]) & {crd.SLICE_PLURAL, "*"}:
            verbs |= set(rule["verbs"])
    return verbs


@pytest.mark.parametrize("scope", ["cluster", "namespaces"])
def test_only_the_operator_writes_slices_and_training_pods_read_them(
        helm: Helm, scope: str) -> None:
    docs = helm.template("r", "er-system", {"trainingNamespaces": ["team"],
                                            "operator": {"scope": scope}})
    operator = one(docs, "ClusterRole") if scope == "cluster" else \
        one(docs, "Role", "r-elasticrun-operator")
    assert [r for r in operator["rules"] if crd.SLICE_PLURAL in r["resources"]] == [
        {"apiGroups": [crd.GROUP], "resources": [crd.SLICE_PLURAL],
         "verbs": OPERATOR_SLICE_VERBS}]
    if scope == "namespaces":
        assert operator["metadata"]["namespace"] == "team"
        assert slice_verbs(one(docs, "ClusterRole")["rules"]) == set()
    training = one(docs, "Role", "r-elasticrun-training")
    assert training["metadata"]["namespace"] == "team"
    assert slice_verbs(training["rules"]) == {"get", "list", "watch"}
    assert not slice_verbs(training["rules"]) & WRITE_VERBS
    # Runs stay writable by training pods: the slice rule is a rule of its own.
    assert "patch" in next(r for r in training["rules"]
                           if r["resources"] == [crd.PLURAL])["verbs"]


def test_cert_manager_mode_mounts_the_issued_secret(
        cluster: Cluster, helm: Helm, namespace: str, request: pytest.FixtureRequest) -> None:
    docs = helm.template("cm", namespace, {"certManager": {"enabled": True}})
    kinds = [d["kind"] for d in docs if d["kind"] in CERT_MANAGER_KINDS]
    assert sorted(kinds) == ["Certificate", "Certificate", "Issuer", "Issuer"]
    certificate = one(docs, "Certificate", "cm-elasticrun-webhook")
    assert certificate["spec"]["dnsNames"] == [
        f"cm-elasticrun-webhook.{namespace}.svc",
        f"cm-elasticrun-webhook.{namespace}.svc.cluster.local"]
    config = one(docs, "MutatingWebhookConfiguration")
    assert config["metadata"]["annotations"] == {
        "cert-manager.io/inject-ca-from": f"{namespace}/cm-elasticrun-webhook"}
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "webhook-cert")
    assert volume["secret"]["secretName"] == certificate["spec"]["secretName"]
    args = pod["containers"][0]["args"]
    assert "--webhook-cert=/run/elasticrun/webhook/tls.crt" in args
    assert not any(a.startswith("--webhook-self-signed") for a in args)
    # With cert-manager the operator needs no right on webhook configurations at all.
    rules = one(docs, "ClusterRole")["rules"]
    assert not any("mutatingwebhookconfigurations" in r["resources"] for r in rules)
    # cert-manager's kinds need its CRDs, which this API server does not have; the rest applies.
    apply_chart(cluster, docs, namespace, request)
    # An external issuer replaces the chart's own CA chain.
    external = helm.template("cm", namespace, {"certManager": {
        "enabled": True, "issuerRef": {"kind": "ClusterIssuer", "name": "corp-ca"}}})
    assert [d["metadata"]["name"] for d in external if d["kind"] in CERT_MANAGER_KINDS] == [
        "cm-elasticrun-webhook"]
    assert one(external, "Certificate")["spec"]["issuerRef"] == {
        "kind": "ClusterIssuer", "name": "corp-ca"}


def test_webhook_can_be_switched_off(helm: Helm) -> None:
    docs = helm.template("r", "x", {"webhook": {"enabled": False}})
    assert by_kind(docs, "MutatingWebhookConfiguration") == []
    assert by_kind(docs, "Service") == []
    args = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not any(a.startswith("--webhook") for a in args)
    rules = one(docs, "ClusterRole")["rules"]
    assert not any("mutatingwebhookconfigurations" in r["resources"] for r in rules)


def test_the_training_runtime_is_optional_and_opts_its_pods_in(helm: Helm) -> None:
    assert by_kind(helm.template("r", "x", {}), "ClusterTrainingRuntime") == []
    docs = helm.template("r", "x", {"trainingRuntime": {
        "enabled": True, "podAnnotations": {"elasticrun.dev/nnodes": "1:8"}},
        "training": {"serviceAccount": {"name": "trainers"}}})
    runtime = one(docs, "ClusterTrainingRuntime")
    assert runtime["metadata"]["name"] == "torch-elastic-k8s"
    assert runtime["metadata"]["labels"]["trainer.kubeflow.org/framework"] == "torch"
    (job,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    assert job["name"] == "node"  # Trainer's torch plugin fills the container named node
    spec = job["template"]["spec"]
    # A lost pod fails no Job (so JobSet never restarts the others); disruptions never count.
    assert spec["backoffLimit"] == 6
    assert spec["podFailurePolicy"]["rules"] == [
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}]
    pod = spec["template"]
    assert pod["metadata"]["labels"] == {crd.RUN_LABEL: ""}
    assert pod["metadata"]["annotations"] == {"elasticrun.dev/nnodes": "1:8"}
    assert pod["spec"]["serviceAccountName"] == "trainers"
    assert pod["spec"]["restartPolicy"] == "Never"
    assert [c["name"] for c in pod["spec"]["containers"]] == ["node"]


@pytest.mark.parametrize(("values", "message"), [
    # The schema names a wrong type or value first (test_chart_schema.py has more).
    ({"operator": {"scope": "everything"}},
     "- at '/operator/scope': value must be one of 'cluster', 'namespaces'"),
    ({"operator": {"scope": "namespaces"}}, "operator.scope=namespaces needs trainingNamespaces"),
    ({"trainingNamespaces": ["Team_A"]}, "- at '/trainingNamespaces/0': 'Team_A' does not match"),
    ({"webhook": {"failurePolicy": "Maybe"}},
     "- at '/webhook/failurePolicy': value must be one of 'Fail', 'Ignore'"),
    ({"operator": {"leaderElection": {"enabled": False}}},
     "operator.replicas > 1 needs operator.leaderElection.enabled=true"),
    ({"operator": {"leaderElection": {"renewDeadline": 15}}},
     "operator.leaderElection needs retryPeriod x 1.2 < renewDeadline < leaseDuration"),
    ({"training": {"perRunRBAC": True}},
     "training.perRunRBAC=true needs operator.scope=namespaces (and trainingNamespaces)"),
    ({"training": {"perRunRBAC": True}, "operator": {"scope": "namespaces"},
      "trainingNamespaces": ["t"], "admissionPolicy": {"enabled": False}},
     "training.perRunRBAC=true needs admissionPolicy.enabled=true"),
    ({"networkPolicy": {"perRun": True}},
     "networkPolicy.perRun=true needs networkPolicy.enabled=true"),
    ({"networkPolicy": {"enabled": True, "perRun": True, "storePort": 0}},
     "networkPolicy.perRun=true with storePort 0 (not pinned) needs networkPolicy.isolate=true"),
])
def test_bad_values_fail_with_what_to_set(helm: Helm, values: dict[str, Any],
                                          message: str) -> None:
    result = helm.run("template", "r", str(CHART), "--values", str(helm.values_file(values)),
                      check=False)
    assert result.returncode != 0
    assert message in result.stderr


# --------------------------------------------------------------------------- helm itself


def test_helm_install_and_uninstall_against_the_real_api_server(
        cluster: Cluster, helm: Helm, namespace: str,
        extra_namespace: Callable[[str], str],
        request: pytest.FixtureRequest) -> None:
    """The real `helm install` path: NOTES, ownership, and a clean uninstall.

    The CRD is left out (the session installed it without Helm's ownership
    labels) and the webhook is pinned to this test's namespace.
    """
    team = extra_namespace("team")
    values = {"trainingNamespaces": [team], "crds": {"install": False},
              "webhook": {"namespaceSelector": {"matchLabels": {NAMESPACE_LABEL: namespace}}}}
    release = "inst"
    request.addfinalizer(lambda: helm.run("uninstall", release, "-n", namespace, "--wait=false",
                                          check=False))
    installed = helm.run("install", release, str(CHART), "-n", namespace,
                         "--values", str(helm.values_file(values)), timeout=180)
    assert "STATUS: deployed" in installed.stdout
    assert f"serviceAccountName: {'elasticrun-trainer'}" in installed.stdout
    assert f"kubectl -n {team} get er -w" in installed.stdout
    role = cluster.kubectl("get", "role", "inst-elasticrun-training", "-n", team, "-o", "yaml")
    assert yaml.safe_load(role.stdout)["metadata"]["annotations"][
        "meta.helm.sh/release-name"] == release
    cluster_role = f"inst-elasticrun-{namespace}-operator"[:63]
    assert cluster.kubectl("get", "clusterrole", cluster_role, check=False).returncode == 0
    helm.run("uninstall", release, "-n", namespace, timeout=180)
    gone = cluster.kubectl("get", "clusterrole", cluster_role, check=False)
    assert gone.returncode != 0 and "NotFound" in gone.stderr
    assert cluster.kubectl("get", "role", "inst-elasticrun-training", "-n", team,
                           check=False).returncode != 0


def test_helm_binary_assumes_the_tested_kubernetes(helm: Helm) -> None:
    """Without the build's ldflags helm would assume Kubernetes 1.20 and refuse the chart."""
    version = helm.run("version", "--short").stdout.strip()
    assert version.startswith("v3.")
    probe = helm.run("template", "r", str(CHART), "--show-only", "templates/deployment.yaml")
    assert "kind: Deployment" in probe.stdout
    assert os.access(helm.binary, os.X_OK)


def test_one_replica_runs_without_election_pdb_or_lease_rights(helm: Helm) -> None:
    docs = helm.template("r", "er-system", {
        "operator": {"replicas": 1, "leaderElection": {"enabled": False}},
        "certManager": {"enabled": True}})
    deployment = one(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not [a for a in args if a.startswith(("--leader-elect", "--webhook-ca-secret"))]
    # With one replica a PDB of minAvailable 1 would block every drain: none.
    assert by_kind(docs, "PodDisruptionBudget") == [] and by_kind(docs, "Role") == []


def test_the_local_values_run_two_replicas_sharing_the_nodes_ports(helm: Helm) -> None:
    """deploy/local/values.yaml: the chart's two replicas under election in the node's
    network namespace, where both bind the same ports (SO_REUSEPORT, --reuse-port)."""
    local = yaml.safe_load((ROOT / "deploy" / "local" / "values.yaml").read_text())
    deployment = one(helm.template("r", "er-system", local), "Deployment")
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True
    (container,) = pod["containers"]
    assert {"--reuse-port", "--leader-elect", "--health-port=18081", "--metrics-port=18080",
            "--webhook-port=19443"} <= set(container["args"])
    # No declared ports: the scheduler would take them for host ports and never place
    # the second replica on the node; probes and Services name the ports by number.
    assert "ports" not in container
    assert container["livenessProbe"]["httpGet"]["port"] == 18081
    assert container["readinessProbe"]["tcpSocket"]["port"] == 19443
    local["metrics"] = {"service": {"enabled": True}}
    services = {d["metadata"]["name"]: d["spec"]["ports"][0]["targetPort"]
                for d in helm.template("r", "er-system", local) if d["kind"] == "Service"}
    assert services == {"r-elasticrun-webhook": 19443, "r-elasticrun-metrics": 18080}


def test_webhook_availability_and_operator_network_policy_options(helm: Helm) -> None:
    docs = helm.template("r", "er-system", {
        "certManager": {"enabled": True},
        "operator": {"replicas": 2, "podDisruptionBudget": {"enabled": True},
                     "priorityClassName": "system-cluster-critical",
                     "networkPolicy": {"enabled": True, "metricsFrom": [
                         {"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]}}})
    deployment = one(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["template"]["spec"]["priorityClassName"] == \
        "system-cluster-critical"
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == \
        deployment["spec"]["selector"]["matchLabels"]
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert policy["spec"]["podSelector"]["matchLabels"] == \
        deployment["spec"]["selector"]["matchLabels"]
    rules = {r["ports"][0]["port"]: r.get("from") for r in policy["spec"]["ingress"]}
    assert rules == {8081: None, 9443: None, 8080: [
        {"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]}
    # Without metricsFrom the metrics port is closed to everyone.
    closed = helm.template("r", "er-system", {"operator": {"networkPolicy": {"enabled": True}}})
    (policy,) = [d for d in closed if d["kind"] == "NetworkPolicy"]
    assert {r["ports"][0]["port"] for r in policy["spec"]["ingress"]} == {8081, 9443}
