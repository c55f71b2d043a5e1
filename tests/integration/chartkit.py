"""Helpers for testing the Helm chart and its RBAC against the real API server.

helm is built from its Go module by tests/helmtool/build.sh (cached, so only
the first run pays); rendered objects are applied with ``kubectl apply
--server-side``, exactly what a GitOps user does with ``helm template``.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import json
import os
import re
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from elasticrun.api import crd
from elasticrun.api.kube import ApiError, KubeClient, load_credentials
from elasticrun.operator import runrbac

from conftest import CRD_FILES, ROOT, Cluster

CHART = ROOT / "charts" / "elasticrun"
HELM_BUILD = ROOT / "tests" / "helmtool" / "build.sh"
#: Built-in cluster-scoped kinds the chart renders; tests delete them afterwards
#: because, unlike namespaces, they are shared by every test on the API server.
CLUSTER_SCOPED = {"ClusterRole", "ClusterRoleBinding", "MutatingWebhookConfiguration",
                  "CustomResourceDefinition", "ValidatingAdmissionPolicy",
                  "ValidatingAdmissionPolicyBinding"}


def build_helm() -> Path:
    """The helm binary; built on first use (a few minutes), then cached."""
    out = subprocess.run(["bash", str(HELM_BUILD)], check=True, stdout=subprocess.PIPE,
                         text=True, timeout=1800)
    path = Path(out.stdout.strip().splitlines()[-1])
    assert path.is_file() and os.access(path, os.X_OK), f"build.sh printed {path}"
    return path


@dataclass
class Helm:
    binary: Path
    home: Path
    kubeconfig: Path | None = None

    def run(self, *args: str, check: bool = True,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
        # Own config/cache/data homes: never read or write the developer's helm state.
        env = {**os.environ, "HELM_CONFIG_HOME": str(self.home / "config"),
               "HELM_CACHE_HOME": str(self.home / "cache"),
               "HELM_DATA_HOME": str(self.home / "data")}
        env.pop("KUBECONFIG", None)
        if self.kubeconfig is not None:
            env["KUBECONFIG"] = str(self.kubeconfig)
        result = subprocess.run([str(self.binary), *args], env=env, capture_output=True,
                                text=True, timeout=timeout, check=False)
        if check and result.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed ({result.returncode}):\n"
                                 f"{result.stdout}\n{result.stderr}")
        return result

    def values_file(self, values: Mapping[str, Any], name: str = "values") -> Path:
        path = self.home / f"{name}-{abs(hash(json.dumps(values, sort_keys=True)))}.yaml"
        path.write_text(yaml.safe_dump(dict(values)))
        return path

    def template(self, release: str, namespace: str, values: Mapping[str, Any] | None = None,
                 *extra: str) -> list[dict[str, Any]]:
        args = ["template", release, str(CHART), "--namespace", namespace]
        if values:
            args += ["--values", str(self.values_file(values))]
        return documents(self.run(*args, *extra).stdout)


def documents(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def by_kind(docs: Iterable[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc["kind"] == kind]


def one(docs: Iterable[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in by_kind(docs, kind) if name is None or d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def apply(cluster: Cluster, docs: list[dict[str, Any]], manager: str = "chart-test") -> str:
    """Server-side apply, for real (not a dry run); returns kubectl's report.

    Sent as JSON: kubectl reads YAML 1.1, where an unquoted ``y`` that PyYAML
    writes for the string "y" would turn into a boolean.
    """
    text = json.dumps({"apiVersion": "v1", "kind": "List", "items": docs})
    result = cluster.kubectl("apply", "--server-side", f"--field-manager={manager}",
                             "--force-conflicts", "-f", "-", input=text, check=False)
    assert result.returncode == 0, f"apply failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def delete_cluster_scoped(cluster: Cluster, docs: Iterable[dict[str, Any]]) -> None:
    """Remove what a test applied outside its namespaces (the CRD is shared: kept)."""
    for doc in docs:
        if doc["kind"] in CLUSTER_SCOPED and doc["kind"] != "CustomResourceDefinition":
            cluster.kubectl("delete", doc["kind"].lower(), doc["metadata"]["name"],
                            "--ignore-not-found", "--wait=false", check=False)


def create_namespace(cluster: Cluster, name: str) -> str:
    with contextlib.suppress(ApiError):
        cluster.client.request("POST", "/api/v1/namespaces", body={
            "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    return name


def request_token(cluster: Cluster, namespace: str, service_account: str,
                  seconds: int = 3600) -> str:
    """A TokenRequest token, as the kubelet would project into the pod."""
    got = cluster.client.request(
        "POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{service_account}/token",
        body={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
              "spec": {"expirationSeconds": seconds}})
    token: str = got["status"]["token"]
    return token


def token_kubeconfig(cluster: Cluster, token: str, path: Path,
                     namespace: str = "default") -> Path:
    """A kubeconfig for the same API server and CA, authenticated only by ``token``."""
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    server = admin["clusters"][0]["cluster"]
    ca_data = server.get("certificate-authority-data")
    if ca_data is None and server.get("certificate-authority"):
        ca_data = base64.b64encode(Path(server["certificate-authority"]).read_bytes()).decode()
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "sa",
        "clusters": [{"name": "c", "cluster": {"server": server["server"],
                                               "certificate-authority-data": ca_data}}],
        "users": [{"name": "sa", "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": "c", "user": "sa",
                                                 "namespace": namespace}}],
    }
    path.write_text(json.dumps(config))
    path.chmod(0o600)
    return path


def can_i(cluster: Cluster, user: str, verb: str, resource: str, *,
          namespace: str | None = None, name: str | None = None) -> bool:
    """``kubectl auth can-i`` as ``user`` (impersonated by the admin): a SubjectAccessReview."""
    args = ["auth", "can-i", verb, f"{resource}/{name}" if name else resource, f"--as={user}"]
    args += ["-n", namespace] if namespace else ["--all-namespaces"]
    result = cluster.kubectl(*args, check=False)
    answer = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert answer in ("yes", "no"), f"can-i {args}: {result.stdout}{result.stderr}"
    return answer == "yes"


def service_account(namespace: str, name: str) -> str:
    return f"system:serviceaccount:{namespace}:{name}"


def refusals(log_text: str) -> list[str]:
    """Log lines where RBAC refused a request: 'is forbidden: User "..." cannot <verb> ...'.

    kopf and our clients log refused calls and retry instead of failing, so a
    right the chart forgot shows up here first.
    """
    return [line for line in log_text.splitlines()
            if re.search(r'forbidden: User "[^"]+" cannot', line)]


def account_client(cluster: Cluster, namespace: str, name: str,
                   rules: list[dict[str, Any]], directory: Path) -> KubeClient:
    """A client for a new ServiceAccount ``name`` that holds a Role of ``rules`` only.

    Attacker tests play another user of the namespace with a real token: the
    API server authenticates and authorizes it exactly as it would that pod.
    """
    admin = cluster.client
    admin.request("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts", body={
        "apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}})
    rbac = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}"
    admin.request("POST", f"{rbac}/roles", body={
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
        "metadata": {"name": name}, "rules": rules})
    admin.request("POST", f"{rbac}/rolebindings", body={
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]})
    kubeconfig = token_kubeconfig(cluster, request_token(cluster, namespace, name),
                                  directory / f"{name}.kubeconfig", namespace)
    return KubeClient(load_credentials(str(kubeconfig)), timeout=10)


def role_bound(cluster: Cluster, namespace: str, run: str) -> bool:
    """Whether the operator made the per-run RoleBinding of ``run`` (``--per-run-rbac``)."""
    try:
        cluster.client.request("GET", runrbac.path("RoleBinding", namespace, run))
    except ApiError as exc:
        if exc.not_found:
            return False
        raise
    return True


# --------------------------------------------------------------------------- the chart applied

NAMESPACE_LABEL = "kubernetes.io/metadata.name"
CERT_MANAGER_KINDS = {"Certificate", "Issuer"}


def pin_webhook(docs: list[dict[str, Any]], namespace: str) -> list[dict[str, Any]]:
    """A copy whose webhook can only ever see pods of ``namespace``."""
    out = copy.deepcopy(docs)
    for config in by_kind(out, "MutatingWebhookConfiguration"):
        for hook in config["webhooks"]:
            hook["namespaceSelector"] = {"matchExpressions": [
                {"key": NAMESPACE_LABEL, "operator": "In", "values": [namespace]}]}
    return out


def apply_chart(cluster: Cluster, docs: list[dict[str, Any]], namespace: str,
                request: pytest.FixtureRequest) -> None:
    """Apply everything but the CRDs (checked against the live ones) and cert-manager kinds."""
    request.addfinalizer(lambda: delete_cluster_scoped(cluster, docs))
    for doc in by_kind(docs, "CustomResourceDefinition"):
        assert_same_as_live_crd(cluster, doc)
    rest = [d for d in pin_webhook(docs, namespace)
            if d["kind"] != "CustomResourceDefinition" and d["kind"] not in CERT_MANAGER_KINDS]
    apply(cluster, rest)
    for doc in rest:
        meta = doc["metadata"]
        where = ["-n", meta["namespace"]] if meta.get("namespace") else []
        kind = doc["kind"].lower() if "/" not in doc["apiVersion"] else \
            f"{doc['kind'].lower()}.{doc['apiVersion'].split('/')[0]}"
        got = cluster.kubectl("get", kind, meta["name"], *where, "-o", "yaml")
        live = yaml.safe_load(got.stdout)
        assert live["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm", meta
    if any(d["kind"] == "Deployment" for d in rest):
        deployment = one(rest, "Deployment")
        got = yaml.safe_load(cluster.kubectl(
            "get", "deployment", deployment["metadata"]["name"], "-n",
            deployment["metadata"]["namespace"], "-o", "yaml").stdout)
        # What the API server stored is what the chart meant (nothing pruned or rejected).
        spec = got["spec"]["template"]["spec"]["containers"][0]
        assert spec["args"] == deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def crd_sources() -> dict[str, dict[str, Any]]:
    """deploy/crds/'s CRDs by name (elasticruns.elasticrun.dev, ...)."""
    sources = [yaml.safe_load(path.read_text()) for path in CRD_FILES]
    return {source["metadata"]["name"]: source for source in sources}


def assert_same_as_live_crd(cluster: Cluster, rendered: dict[str, Any]) -> None:
    name = rendered["metadata"]["name"]
    assert name in {crd.CRD_NAME, crd.SLICE_CRD_NAME}, name
    live = yaml.safe_load(cluster.kubectl("get", "crd", name, "-o", "yaml").stdout)
    assert rendered["spec"] == crd_sources()[name]["spec"]
    for key in ("group", "names", "scope"):
        assert live["spec"][key] == rendered["spec"][key]
    assert [v["name"] for v in live["spec"]["versions"]] == \
        [v["name"] for v in rendered["spec"]["versions"]]
    dry = cluster.kubectl("apply", "--server-side", "--dry-run=server", "--force-conflicts",
                          "--field-manager=chart-test", "-f", "-",
                          input=yaml.safe_dump(rendered), check=False)
    assert dry.returncode == 0, dry.stderr
