"""The pod-mutating webhook, called by the real API server.

kopf serves elasticrun's handler on 127.0.0.1 with a certificate signed by the
test CA; the API server reaches it through a MutatingWebhookConfiguration with
``clientConfig.url`` (there is no Service network here), scoped by
namespaceSelector to this module's namespace so no other test's pod can ever
reach it, and deleted at teardown. kopf runs with the operator's
ServiceAccount token and the chart's RBAC. The webhook creates nothing
(admission without side effects): a missing ElasticRun is created by the first
node's handler from the injected PET_NNODES.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import secrets
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from elasticrun.api import crd
from elasticrun.api.kube import ApiError, run_path
from elasticrun.operator import webhook

from chartkit import (
    apply,
    by_kind,
    create_namespace,
    refusals,
    request_token,
    token_kubeconfig,
)
from conftest import ROOT, Cluster, wait_for
from controlplane.localcluster import clean_env, free_port, stop_pid

pytest_plugins = ("chartfixtures",)

OPERATOR_MODULE = Path(__file__).with_name("webhook_operator.py")
WEBHOOK_KINDS = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}


@dataclass
class Served:
    namespace: str
    configuration: str
    log: Path
    port: int
    ca: Path
    mode: str


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env") or []}


def pod_manifest(name: str, namespace: str, labels: dict[str, str] | None = None,
                 annotations: dict[str, str] | None = None,
                 containers: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels or {},
                     "annotations": annotations or {}},
        "spec": {"containers": containers or [
            {"name": "trainer", "image": "trainer:1", "command": ["torchrun", "train.py"]}]},
    }


def create_pod(cluster: Cluster, manifest: dict[str, Any], *extra: str
               ) -> subprocess.CompletedProcess[str]:
    """kubectl create, as a user would: stdout is the stored pod, stderr any warning."""
    return cluster.kubectl("create", "-f", "-", "-o", "json", *extra,
                           input=json.dumps(manifest), check=False)


def stored_pod(cluster: Cluster, manifest: dict[str, Any], *extra: str) -> dict[str, Any]:
    result = create_pod(cluster, manifest, *extra)
    assert result.returncode == 0, result.stderr
    pod: dict[str, Any] = json.loads(result.stdout)
    return pod


def operator_kubeconfig(cluster: Cluster, helm_template: Any, namespace: str,
                        workdir: Path) -> tuple[Path, list[dict[str, Any]]]:
    """Apply the chart's operator RBAC and return a kubeconfig holding its SA's token."""
    docs = [d for d in helm_template("wh", namespace, {
        "trainingNamespaces": [namespace], "operator": {"scope": "namespaces"},
        "fullnameOverride": f"wh-{namespace}"}) if d["kind"] in WEBHOOK_KINDS]
    apply(cluster, docs)
    sa = next(d for d in docs if d["kind"] == "ServiceAccount"
              and d["metadata"]["name"] == f"wh-{namespace}")
    token = request_token(cluster, namespace, sa["metadata"]["name"])
    return token_kubeconfig(cluster, token, workdir / "operator.kubeconfig", namespace), docs


@pytest.fixture(scope="module", params=["given-cert", "self-signed", "operator"])
def served(  # noqa: PLR0915 - three ways of serving the webhook, set up side by side
        request: pytest.FixtureRequest, cluster: Cluster, crds: None,
        helm_binary: Path) -> Iterator[Served]:
    """kopf serving the webhook, registered by URL, for this module's namespace.

    ``given-cert``: the test CA's certificate, as with cert-manager. ``self-signed``:
    the chart's default; the configuration is registered without a caBundle and
    the operator writes its own CA into it at start, with the chart's RBAC.
    ``operator``: the whole operator (``python -m elasticrun.operator``) with the
    chart's default flags, webhook included.
    """
    local = cluster.require_local()
    from chartkit import Helm

    workdir = Path(tempfile.mkdtemp(prefix="elasticrun-webhook-"))
    namespace = create_namespace(cluster, f"wh-{secrets.token_hex(4)}")
    helm = Helm(helm_binary, workdir)
    kubeconfig, rbac = operator_kubeconfig(cluster, helm.template, namespace, workdir)
    # The chart lets the operator patch exactly one configuration: use that name.
    (name,) = [rule["resourceNames"][0] for rule in by_kind(rbac, "ClusterRole")[0]["rules"]
               if rule.get("resourceNames")]
    port = free_port()
    flags = ["--webhook-port", str(port), "--webhook-addr", "127.0.0.1",
             "--webhook-host", "127.0.0.1"]
    ca_bundle: str | None = base64.b64encode((local.dir / "ca.crt").read_bytes()).decode()
    if request.param in ("self-signed", "operator"):
        flags += ["--webhook-self-signed", "127.0.0.1", "--webhook-cert-dir",
                  str(workdir / "certs"), "--webhook-configuration", name,
                  "--webhook-ca-check-seconds", "1"]
        ca_bundle = None
    else:
        flags += ["--webhook-cert", str(local.dir / "webhook.crt"),
                  "--webhook-key", str(local.dir / "webhook.key"),
                  "--webhook-ca", str(local.dir / "ca.crt")]
    client_config: dict[str, Any] = {"url": f"https://127.0.0.1:{port}{webhook.WEBHOOK_PATH}"}
    if ca_bundle:
        client_config["caBundle"] = ca_bundle
    configuration = {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [{
            "name": "pods.elasticrun.dev", "admissionReviewVersions": ["v1"],
            "sideEffects": "None", "failurePolicy": "Fail", "timeoutSeconds": 10,
            "reinvocationPolicy": "IfNeeded", "clientConfig": client_config,
            "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                       "resources": ["pods"], "scope": "Namespaced"}],
            "objectSelector": {"matchExpressions": [
                {"key": crd.RUN_LABEL, "operator": "Exists"}]},
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
        }],
    }
    log_path = workdir / "kopf.log"
    env = {**clean_env(), "KUBECONFIG": str(kubeconfig), "WEBHOOK_ARGS": shlex.join(flags),
           "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("handler", "operator", "tests"))}
    proc: subprocess.Popen[bytes] | None = None
    try:
        cluster.apply(configuration)  # before the operator starts, as with helm install
        argv = [sys.executable, "-m", "kopf", "run", "--standalone", "-n", namespace,
                "--verbose", str(OPERATOR_MODULE)]
        if request.param == "operator":
            argv = [sys.executable, "-m", "elasticrun.operator", "--namespace", namespace,
                    "--health-port", "0", "--metrics-port", "0", "--verbose", *flags]
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True, cwd=workdir)
        probe = pod_manifest("probe", namespace, {crd.RUN_LABEL: "probe"})
        running = proc

        def serving() -> bool:
            if running.poll() is not None:
                raise AssertionError(f"kopf exited:\n{log_path.read_text()[-3000:]}")
            result = create_pod(cluster, probe, "--dry-run=server")
            return result.returncode == 0 and "PET_RDZV_ID" in result.stdout

        wait_for(serving, 60, "the webhook to answer the API server", interval=0.5)
        if request.param in ("self-signed", "operator"):
            stored = cluster.client.request(
                "GET", f"/apis/admissionregistration.k8s.io/v1/"
                       f"mutatingwebhookconfigurations/{name}")
            generated = (workdir / "certs" / "ca.crt").read_bytes()
            assert base64.b64decode(stored["webhooks"][0]["clientConfig"]["caBundle"]) == \
                generated
        ca = workdir / "certs" / "ca.crt" if ca_bundle is None else local.dir / "ca.crt"
        yield Served(namespace, name, log_path, port, ca, request.param)
    except BaseException:
        print(log_path.read_text()[-5000:] if log_path.exists() else "(no kopf log)")
        raise
    finally:
        # A failurePolicy=Fail webhook left behind would block pods of later tests.
        with contextlib.suppress(ApiError):
            cluster.client.request(
                "DELETE", f"/apis/admissionregistration.k8s.io/v1/"
                          f"mutatingwebhookconfigurations/{name}")
        if proc is not None:
            stop_pid(proc.pid, timeout=10)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        for doc in by_kind(rbac, "ClusterRole") + by_kind(rbac, "ClusterRoleBinding"):
            cluster.kubectl("delete", doc["kind"].lower(), doc["metadata"]["name"],
                            "--ignore-not-found", check=False)
        with contextlib.suppress(ApiError):
            cluster.client.request("DELETE", f"/api/v1/namespaces/{namespace}")


# --------------------------------------------------------------------------- tests


def test_opted_in_pod_is_mutated_and_nothing_is_created(cluster: Cluster,
                                                        served: Served) -> None:
    ns = served.namespace
    manifest = pod_manifest(
        "llama-0", ns, {crd.RUN_LABEL: "llama"},
        {webhook.NNODES_ANNOTATION: "2:4", webhook.NPROC_ANNOTATION: "8"},
        containers=[
            {"name": "trainer", "image": "trainer:1", "command": ["torchrun", "train.py"]},
            {"name": "helper", "image": "helper:1",
             "env": [{"name": "PET_RDZV_BACKEND", "value": "c10d"}]}])
    result = create_pod(cluster, manifest)
    assert result.returncode == 0, result.stderr
    pod = json.loads(result.stdout)
    trainer, helper = pod["spec"]["containers"]
    env = env_of(trainer)
    assert env["PET_RDZV_BACKEND"] == "k8s"
    assert env["PET_RDZV_ID"] == "llama"
    assert env["PET_NNODES"] == "2:4"
    assert env["PET_NPROC_PER_NODE"] == "8"
    assert env["POD_NAME"] == {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}}
    assert env["POD_NAMESPACE"] == {"fieldRef": {"apiVersion": "v1",
                                                 "fieldPath": "metadata.namespace"}}
    assert env["POD_UID"] == {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.uid"}}
    assert env["POD_IP"] == {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}}
    assert env["PET_LOCAL_ADDR"] == "$(POD_IP)"
    assert trainer["command"] == ["torchrun", "train.py"]
    # The user's own value is kept (and they are told), everything else is added.
    helper_env = env_of(helper)
    assert helper_env["PET_RDZV_BACKEND"] == "c10d"
    assert helper_env["PET_RDZV_ID"] == "llama"
    assert "PET_RDZV_BACKEND='c10d'" in result.stderr
    # Admission has no side effects: no ElasticRun appears (the first node's handler
    # creates it from PET_NNODES, with the pod's own rights).
    listed = cluster.client.request("GET", f"/apis/{crd.API_VERSION}/namespaces/{ns}/"
                                           f"{crd.PLURAL}")
    assert "llama" not in [r["metadata"]["name"] for r in listed["items"]]
    # kopf and the webhook ran on the chart's operator token: nothing was refused.
    log = served.log.read_text()
    assert "created ElasticRun" not in log
    # RBAC's refusals as kopf logs them, and 403 status lines as urllib3 logs them (a
    # bare "403" would also match timestamps like 06:28:24,403).
    refused = refusals(log) + [line for line in log.splitlines() if 'HTTP/1.1" 403 ' in line]
    assert refused == [], "\n".join(refused[:10])


@pytest.mark.parametrize(("labels", "annotations", "message"), [
    ({crd.RUN_LABEL: "r"}, {webhook.NNODES_ANNOTATION: "5:2"},
     'has MIN 5 above MAX 2; write the smaller number first, e.g. "2:5"'),
    ({crd.RUN_LABEL: "r"}, {webhook.NNODES_ANNOTATION: "abc"},
     'write e.g. elasticrun.dev/nnodes: "2:4" (MIN:MAX) or "4" (a fixed size)'),
    ({crd.RUN_LABEL: "r"}, {webhook.NPROC_ANNOTATION: "lots"}, "is not a process count"),
    ({crd.RUN_LABEL: "My_Run"}, {}, "e.g. elasticrun.dev/run: my-run"),
])
def test_bad_opt_in_is_denied_with_what_to_write(cluster: Cluster, served: Served,
                                                 labels: dict[str, str],
                                                 annotations: dict[str, str],
                                                 message: str) -> None:
    name = f"bad-{secrets.token_hex(3)}"
    result = create_pod(cluster, pod_manifest(name, served.namespace, labels, annotations))
    assert result.returncode != 0
    assert "denied the request" in result.stderr
    assert message in result.stderr
    missing = cluster.kubectl("get", "pod", name, "-n", served.namespace, check=False)
    assert missing.returncode != 0


def test_pod_without_the_label_is_untouched(cluster: Cluster, served: Served) -> None:
    # Even a nonsense annotation is fine: without the label the webhook is never called.
    manifest = pod_manifest("web", served.namespace, {"app": "web"},
                            {webhook.NNODES_ANNOTATION: "abc"})
    pod = stored_pod(cluster, manifest)
    assert "env" not in pod["spec"]["containers"][0]


def test_reapplying_the_mutation_changes_nothing(cluster: Cluster, served: Served) -> None:
    labels = {crd.RUN_LABEL: "again"}
    first = stored_pod(cluster, pod_manifest("again-0", served.namespace, labels,
                                             {webhook.NNODES_ANNOTATION: "1:2"}))
    assert webhook.mutation_for(first) == []
    # Feed the mutated spec back through the API server and its webhook.
    again = pod_manifest("again-1", served.namespace, labels,
                         {webhook.NNODES_ANNOTATION: "1:2"},
                         containers=[{k: first["spec"]["containers"][0][k]
                                      for k in ("name", "image", "command", "env")}])
    second = stored_pod(cluster, again)
    assert second["spec"]["containers"][0]["env"] == first["spec"]["containers"][0]["env"]


def test_generated_names_are_mutated_like_workload_pods(cluster: Cluster,
                                                        served: Served) -> None:
    """Job and StatefulSet pods arrive with generateName; the name is unknown at admission."""
    manifest = pod_manifest("", served.namespace, {crd.RUN_LABEL: "job-run"})
    del manifest["metadata"]["name"]
    manifest["metadata"]["generateName"] = "job-run-"
    pod = stored_pod(cluster, manifest)
    assert pod["metadata"]["name"].startswith("job-run-")
    assert env_of(pod["spec"]["containers"][0])["PET_RDZV_ID"] == "job-run"


def test_dry_run_has_no_side_effect(cluster: Cluster, served: Served) -> None:
    manifest = pod_manifest("ghost-0", served.namespace, {crd.RUN_LABEL: "ghost"},
                            {webhook.NNODES_ANNOTATION: "3"})
    pod = stored_pod(cluster, manifest, "--dry-run=server")
    assert env_of(pod["spec"]["containers"][0])["PET_NNODES"] == "3:3"
    with pytest.raises(ApiError) as info:
        cluster.client.request("GET", run_path(served.namespace, "ghost"))
    assert info.value.not_found


def test_an_existing_run_keeps_its_spec(cluster: Cluster, served: Served) -> None:
    cluster.apply({"apiVersion": crd.API_VERSION, "kind": crd.KIND,
                   "metadata": {"name": "mine", "namespace": served.namespace},
                   "spec": {"minNodes": 1, "maxNodes": 1}})
    stored_pod(cluster, pod_manifest("mine-0", served.namespace, {crd.RUN_LABEL: "mine"},
                                     {webhook.NNODES_ANNOTATION: "2:8"}))
    run = cluster.client.request("GET", run_path(served.namespace, "mine"))
    assert (run["spec"]["minNodes"], run["spec"]["maxNodes"]) == (1, 1)



def test_forged_admission_review_creates_nothing(cluster: Cluster, served: Served) -> None:
    """Any pod that reaches the webhook port may send it a review of its own making.

    It names another namespace and asks for a sized run; the answer is only a
    patch for a pod nobody stores, and no ElasticRun appears anywhere.
    """
    import ssl
    import urllib.request

    victim = create_namespace(cluster, f"victim-{secrets.token_hex(3)}")
    pod = pod_manifest("forged-0", victim, {crd.RUN_LABEL: "forged"},
                       {webhook.NNODES_ANNOTATION: "2:2"})
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "00000000-0000-0000-0000-000000000001",
        "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"},
        "name": "forged-0", "namespace": victim, "operation": "CREATE",
        "userInfo": {"username": "system:admin", "groups": ["system:masters"]},
        "object": pod, "dryRun": False}}
    context = ssl.create_default_context(cafile=str(served.ca))
    request = urllib.request.Request(
        f"https://127.0.0.1:{served.port}{webhook.WEBHOOK_PATH}",
        data=json.dumps(review).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, context=context, timeout=10) as answer:
        response = json.load(answer)["response"]
    assert response["allowed"] is True and response.get("patch")  # a mutation, nothing more
    for namespace in (victim, served.namespace):
        listed = cluster.client.request(
            "GET", f"/apis/{crd.API_VERSION}/namespaces/{namespace}/{crd.PLURAL}")
        assert "forged" not in [r["metadata"]["name"] for r in listed["items"]], namespace
    assert "created ElasticRun" not in served.log.read_text()


def test_a_blanked_ca_bundle_is_repaired_by_the_operator(cluster: Cluster,
                                                         served: Served) -> None:
    """A re-apply of the chart's configuration (no caBundle) heals without a restart."""
    if served.mode != "operator":
        pytest.skip("the repair loop belongs to the operator process")
    path = f"/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/" \
           f"{served.configuration}"
    cluster.client.request("PATCH", path, body=[
        {"op": "remove", "path": "/webhooks/0/clientConfig/caBundle"}],
        content_type="application/json-patch+json")
    blanked = cluster.client.request("GET", path)
    assert not blanked["webhooks"][0]["clientConfig"].get("caBundle")
    wait_for(lambda: base64.b64decode(cluster.client.request("GET", path)["webhooks"][0]
                                      ["clientConfig"].get("caBundle") or "")
             == served.ca.read_bytes(), 10, "the operator to repair the caBundle")
    pod = stored_pod(cluster, pod_manifest("healed-0", served.namespace,
                                           {crd.RUN_LABEL: "healed"}), "--dry-run=server")
    assert env_of(pod["spec"]["containers"][0])["PET_RDZV_ID"] == "healed"
    assert "repaired the caBundle" in served.log.read_text()


def test_an_empty_run_label_is_filled_from_the_workload(cluster: Cluster,
                                                        served: Served) -> None:
    """A shared template carries ``elasticrun.dev/run: ""``; the API server still calls the
    webhook (objectSelector Exists), which names the run after the outermost workload and
    writes that name into the stored pod's label, the key the operator watches pods by.
    The nnodes annotation replaces the launcher's fixed PET_NNODES (Trainer's numNodes)."""
    labels = {crd.RUN_LABEL: "", "jobset.sigs.k8s.io/jobset-name": "tj",
              "batch.kubernetes.io/job-name": "tj-node-0"}
    manifest = pod_manifest("tj-node-0-0", served.namespace, labels,
                            {webhook.NNODES_ANNOTATION: "2:3"}, containers=[
                                {"name": "node", "image": "trainer:1",
                                 "command": ["torchrun", "train.py"],
                                 "env": [{"name": "PET_NNODES", "value": "3"},
                                         {"name": "PET_MASTER_ADDR", "value": "tj-node-0-0.tj"}]}])
    result = create_pod(cluster, manifest)
    assert result.returncode == 0, result.stderr
    pod = json.loads(result.stdout)
    assert pod["metadata"]["labels"][crd.RUN_LABEL] == "tj"
    env = env_of(pod["spec"]["containers"][0])
    assert (env["PET_RDZV_ID"], env["PET_NNODES"]) == ("tj", "2:3")
    assert env["PET_MASTER_ADDR"] == "tj-node-0-0.tj"
    assert "elasticrun.dev/nnodes makes it '2:3'" in result.stderr
    selected = cluster.kubectl("get", "pods", "-n", served.namespace, "-l",
                               f"{crd.RUN_LABEL}=tj", "-o", "name").stdout.split()
    assert selected == ["pod/tj-node-0-0"]


def test_an_empty_run_label_without_a_workload_is_denied(cluster: Cluster,
                                                         served: Served) -> None:
    result = create_pod(cluster, pod_manifest(f"bare-{secrets.token_hex(3)}", served.namespace,
                                              {crd.RUN_LABEL: ""}))
    assert result.returncode != 0
    assert "label elasticrun.dev/run is empty and the pod carries none of" in result.stderr
