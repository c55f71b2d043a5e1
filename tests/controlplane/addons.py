"""JobSet and Kubeflow Trainer on the local cluster: their own controllers, as processes.

The binaries come from ``build-addons.sh`` (the wrapper module ``addons/``); the
objects they need (CRDs, ServiceAccount, RBAC, webhook configurations) are their
own Helm charts, read from the same Go module cache and rendered with the
project's helm (``tests/helmtool/build.sh``).  Applied as rendered, except:

- no Deployment: the controller runs as a process on 127.0.0.1, started and
  stopped by its PID like the control plane, with a kubeconfig holding a token
  of the chart's own ServiceAccount, so it has exactly the chart's RBAC;
- the webhook configurations call ``https://127.0.0.1:PORT/PATH`` with the
  cluster CA as ``caBundle`` instead of the chart's Service: there is no pod
  network, and EndpointSlices refuse loopback addresses, so a Service could not
  lead to the process.  The serving certificate is the cluster's own webhook
  certificate (``make_pki``: IP 127.0.0.1), which is what their certificate
  rotators (cert-controller) would otherwise generate;
- their configuration file is the chart's ConfigMap with the built-in
  certificate management and leader election off, the webhook, health and
  metrics servers on this machine's loopback;
- Trainer's chart names JobSet and LWS as sub-charts to fetch from a registry;
  its copy here has no ``dependencies`` (JobSet is installed from its own
  module, LWS is not used);
- on this one node every pod shares the host's network, and Trainer gives each
  node pod ``containerPort: 29500`` (a host port under ``hostNetwork``), so the
  scheduler and kubelet would admit one pod per TrainJob: a
  MutatingAdmissionPolicy of the test bed (:data:`LOCAL_NODE_PORTS`) drops the
  ports of a JobSet's host-network containers that declare 29500 (torchrun with
  the k8s backend listens on a free port; nothing uses 29500).

``TMPDIR`` points each process at a directory of its own, so controller-runtime's
default certificate directory (``$TMPDIR/k8s-webhook-server/serving-certs``) and
anything else they write under the temp directory stays in the cluster's.

    CLUSTER_ADDONS=kubeflow make cluster      # both; CLUSTER_ADDONS=jobset for JobSet only
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from controlplane.procs import clean_env, pid_alive, stop_pid

HERE = Path(__file__).resolve().parent
MODULE_DIR = HERE / "addons"
READY_TIMEOUT = 120.0
#: What ``CLUSTER_ADDONS`` may name, and what each name starts.
BUNDLES = {"jobset": ("jobset",), "kubeflow": ("jobset", "trainer")}


#: A JobSet's host-network pod with Trainer's port (its pods carry no Trainer label).
_TRAINER_POD = ("has(object.spec.hostNetwork) && object.spec.hostNetwork && "
                "has(object.metadata.labels) && "
                "'jobset.sigs.k8s.io/jobset-name' in object.metadata.labels && "
                "object.spec.containers.exists(c, has(c.ports) && "
                "c.ports.exists(p, p.containerPort == 29500))")
#: The test bed's own policy for Trainer's pods (see the module docstring).
LOCAL_NODE_PORTS: list[dict[str, Any]] = [
    {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingAdmissionPolicy",
     "metadata": {"name": "elasticrun-local-node-trainer-ports"},
     "spec": {
         "matchConstraints": {"resourceRules": [{
             "apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
             "resources": ["pods"]}]},
         "matchConditions": [{"name": "trainer-pod-on-the-host-network",
                              "expression": _TRAINER_POD}],
         "failurePolicy": "Fail", "reinvocationPolicy": "Never",
         "mutations": [{"patchType": "JSONPatch", "jsonPatch": {"expression": (
             "[0, 1, 2, 3, 4, 5, 6, 7].filter(i, i < object.spec.containers.size() && "
             "has(object.spec.containers[i].ports) && "
             "object.spec.containers[i].ports.exists(p, p.containerPort == 29500))"
             ".map(i, JSONPatch{op: 'remove', "
             "path: '/spec/containers/' + string(i) + '/ports'})")}}]}},
    {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingAdmissionPolicyBinding",
     "metadata": {"name": "elasticrun-local-node-trainer-ports"},
     "spec": {"policyName": "elasticrun-local-node-trainer-ports"}},
]


@dataclass(frozen=True)
class Addon:
    name: str
    module: str
    chart: str
    release: str
    namespace: str
    binary: str
    service_account: str
    #: key of the chart's ConfigMap that holds the controller's configuration
    config_map: str
    helm_values: tuple[str, ...] = ()


JOBSET = Addon("jobset", "sigs.k8s.io/jobset", "charts/jobset", "jobset", "jobset-system",
               "jobset", "jobset-controller", "jobset-controller-config")
TRAINER = Addon("trainer", "github.com/kubeflow/trainer/v2", "charts/kubeflow-trainer",
                "kubeflow-trainer", "kubeflow-system", "trainer-controller-manager",
                "kubeflow-trainer-controller-manager", "kubeflow-trainer-config",
                ("jobset.install=false",))
ADDONS = {a.name: a for a in (JOBSET, TRAINER)}


def wanted(spec: str) -> list[Addon]:
    """``CLUSTER_ADDONS``' value (``kubeflow``, ``jobset``, comma-separated) as add-ons."""
    names: list[str] = []
    for word in (w.strip() for w in spec.split(",")):
        if not word:
            continue
        if word not in BUNDLES:
            raise ValueError(f"CLUSTER_ADDONS={spec!r}: unknown add-on {word!r}; "
                             f"known: {', '.join(BUNDLES)}")
        names += [n for n in BUNDLES[word] if n not in names]
    return [ADDONS[n] for n in names]


def cached_bin() -> Path | None:
    """The directory ``build-addons.sh`` fills, if it holds every binary (nothing is built)."""
    import hashlib
    import re

    explicit = os.environ.get("ADDONS_BIN")
    if explicit:
        out = Path(explicit)
    else:
        gomod = (MODULE_DIR / "go.mod").read_text()

        def version(module: str) -> str:
            found = re.search(rf"^\s*(?:require\s+)?{re.escape(module)} (v[0-9.]+)", gomod, re.M)
            return found.group(1) if found else "?"

        digest = hashlib.sha256((MODULE_DIR / "go.sum").read_bytes()).hexdigest()[:12]
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        out = (cache / "elasticrun" / "addons" /
               f"jobset-{version(JOBSET.module)}-trainer-{version(TRAINER.module)}-{digest}")
    return out if all((out / a.binary).is_file() for a in ADDONS.values()) else None


def build(addons: Sequence[Addon]) -> Path:
    """The cached binaries (``build-addons.sh``), building what is missing."""
    explicit = os.environ.get("ADDONS_BIN")
    if explicit and all((Path(explicit) / a.binary).exists() for a in addons):
        return Path(explicit)
    out = subprocess.run(["bash", str(HERE / "build-addons.sh"), *(a.name for a in addons)],
                         check=True, stdout=subprocess.PIPE, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def module_path(module: str) -> Path:
    """The module's directory in the Go module cache (downloaded by the build)."""
    out = subprocess.run(["go", "list", "-m", "-json", module], cwd=MODULE_DIR, check=True,
                         capture_output=True, text=True,
                         env={**os.environ, "GOTOOLCHAIN": "local", "GOFLAGS": "-mod=readonly"})
    return Path(json.loads(out.stdout)["Dir"])


def render(addon: Addon, helm: Path, workdir: Path) -> list[dict[str, Any]]:
    """The add-on's chart from its module, rendered with the release's name and namespace."""
    chart = workdir / "chart"
    shutil.rmtree(chart, ignore_errors=True)
    shutil.copytree(module_path(addon.module) / addon.chart, chart)
    for path in [chart, *chart.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)  # the module cache is read-only
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    if meta.pop("dependencies", None) is not None:
        (chart / "Chart.yaml").write_text(yaml.safe_dump(meta))
    argv = [str(helm), "template", addon.release, str(chart), "-n", addon.namespace,
            "--include-crds",
            *[arg for value in addon.helm_values for arg in ("--set", value)]]
    env = {**clean_env(), "HELM_CACHE_HOME": str(workdir / "helm"),
           "HELM_CONFIG_HOME": str(workdir / "helm"), "HELM_DATA_HOME": str(workdir / "helm")}
    out = subprocess.run(argv, check=True, capture_output=True, text=True, env=env)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def adapt(docs: list[dict[str, Any]], port: int, ca_pem: bytes) -> list[dict[str, Any]]:
    """What runs on this machine (see the module docstring): no Deployment, webhooks by URL."""
    import base64

    bundle = base64.b64encode(ca_pem).decode()
    kept = []
    for doc in docs:
        if doc["kind"] == "Deployment":
            continue
        if doc["kind"] in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
            for hook in doc.get("webhooks") or []:
                path = (hook["clientConfig"].get("service") or {}).get("path", "/")
                hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}",
                                        "caBundle": bundle}
        kept.append(doc)
    return kept


def controller_config(addon: Addon, docs: list[dict[str, Any]], *, webhook_port: int,
                      health_port: int, cert_dir: Path) -> dict[str, Any]:
    """The chart's controller configuration, pointed at this machine."""
    cm = next(d for d in docs if d["kind"] == "ConfigMap"
              and d["metadata"]["name"] == addon.config_map)
    config: dict[str, Any] = yaml.safe_load(cm["data"]["controller_manager_config.yaml"])
    config.setdefault("leaderElection", {})["leaderElect"] = False
    config["webhook"] = {**(config.get("webhook") or {}), "port": webhook_port,
                         "host": "127.0.0.1"}
    config.setdefault("metrics", {})["bindAddress"] = "0"
    config.setdefault("health", {})["healthProbeBindAddress"] = f"127.0.0.1:{health_port}"
    if addon is JOBSET:
        config["webhook"]["certDir"] = str(cert_dir)
        config.setdefault("internalCertManagement", {})["enable"] = False
    else:
        config.setdefault("certManagement", {})["enable"] = False
    return config


@dataclass
class Running:
    name: str
    pid: int
    webhook_port: int
    health_port: int


def start(addons: Sequence[Addon], cluster_dir: Path, client: Any, kubectl: Any,
          helm: Path, bin_dir: Path, free_port: Any) -> list[Running]:
    """Apply each add-on's objects, start its controller, wait until its webhook answers.

    ``client`` is the admin KubeClient; ``kubectl(*args, input=...)`` runs kubectl as admin.
    """
    started: list[Running] = []
    try:
        for addon in addons:
            started.append(_start_one(addon, cluster_dir, client, kubectl, helm, bin_dir,
                                      free_port))
    except BaseException:
        stop(started)
        raise
    return started


def _start_one(addon: Addon, cluster_dir: Path, client: Any, kubectl: Any, helm: Path,
               bin_dir: Path, free_port: Any) -> Running:
    d = cluster_dir / "addons" / addon.name
    tmp = d / "tmp"
    certs = tmp / "k8s-webhook-server" / "serving-certs"
    certs.mkdir(parents=True, exist_ok=True)
    shutil.copy(cluster_dir / "webhook.crt", certs / "tls.crt")
    shutil.copy(cluster_dir / "webhook.key", certs / "tls.key")
    webhook_port, health_port = free_port(), free_port()
    docs = render(addon, helm, d)
    config = controller_config(addon, docs, webhook_port=webhook_port, health_port=health_port,
                               cert_dir=certs)
    (d / "config.yaml").write_text(yaml.safe_dump(config))
    objects = adapt(docs, webhook_port, (cluster_dir / "ca.crt").read_bytes())
    if addon is TRAINER:
        objects += LOCAL_NODE_PORTS
    kubectl("create", "namespace", addon.namespace, check=False)
    crds = [o for o in objects if o["kind"] == "CustomResourceDefinition"]
    rest = [o for o in objects if o["kind"] != "CustomResourceDefinition"]
    # Webhook configurations last: they must not call a webhook that is not serving yet.
    hooks = [o for o in rest if o["kind"].endswith("WebhookConfiguration")]
    rest = [o for o in rest if o not in hooks]
    for batch in (crds, rest):
        if batch:
            kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
                    input=yaml.safe_dump_all(batch))
    if crds:
        kubectl("wait", "--for=condition=Established", "--timeout=60s",
                *[f"crd/{c['metadata']['name']}" for c in crds])
    kubeconfig = _service_account_kubeconfig(client, cluster_dir, addon, d)
    log = open(d / "controller.log", "ab")  # noqa: SIM115 - owned by the child
    env = {**clean_env(), "KUBECONFIG": str(kubeconfig), "TMPDIR": str(tmp)}
    proc = subprocess.Popen([str(bin_dir / addon.binary), f"--config={d / 'config.yaml'}",
                             "--zap-log-level=2"], stdout=log, stderr=subprocess.STDOUT,
                            env=env, start_new_session=True, cwd=d)
    log.close()
    running = Running(addon.name, proc.pid, webhook_port, health_port)
    try:
        _wait_serving(running, d / "controller.log")
        if hooks:
            kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
                    input=yaml.safe_dump_all(hooks))
    except BaseException:
        stop([running])
        raise
    return running


def _service_account_kubeconfig(client: Any, cluster_dir: Path, addon: Addon,
                                d: Path) -> Path:
    """A kubeconfig with a day-long token of the chart's ServiceAccount for the add-on."""
    review = client.request(
        "POST", f"/api/v1/namespaces/{addon.namespace}/serviceaccounts/"
                f"{addon.service_account}/token",
        body={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
              "spec": {"expirationSeconds": 86400}})
    admin = yaml.safe_load((cluster_dir / "kubeconfig").read_text())
    admin["users"] = [{"name": addon.service_account,
                       "user": {"token": review["status"]["token"]}}]
    admin["contexts"][0]["context"].update(user=addon.service_account,
                                           namespace=addon.namespace)
    path = d / "kubeconfig"
    path.write_text(json.dumps(admin, indent=2))
    path.chmod(0o600)
    return path


def _wait_serving(running: Running, log: Path) -> None:
    """Until the controller's readiness endpoint answers 200 and its webhook accepts TLS."""
    import socket
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + READY_TIMEOUT
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    while time.monotonic() < deadline:
        if not pid_alive(running.pid):
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
            raise RuntimeError(f"{running.name} exited during start-up:\n{tail}")
        try:
            with opener.open(f"http://127.0.0.1:{running.health_port}/readyz", timeout=2):
                pass
            with socket.create_connection(("127.0.0.1", running.webhook_port), timeout=2):
                return
        except (urllib.error.URLError, OSError):
            time.sleep(0.3)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
    raise TimeoutError(f"{running.name} not ready within {READY_TIMEOUT:.0f}s:\n{tail}")


def stop(running: Sequence[Running]) -> None:
    for r in reversed(list(running)):
        stop_pid(r.pid)


__all__ = ["ADDONS", "BUNDLES", "JOBSET", "TRAINER", "Addon", "Running", "adapt", "build",
           "cached_bin",
           "controller_config", "module_path", "render", "start", "stop", "wanted"]
