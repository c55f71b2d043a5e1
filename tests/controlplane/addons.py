"""JobSet, Kubeflow Trainer and Kueue on the local cluster: their own controllers, as processes.

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

Kueue (v0.19.0, ``cmd/kueue``, its own wrapper module ``kueue/``) is applied
the same way from its chart (``charts/kueue``: RBAC, the manager's
configuration, the webhook configurations), with these differences:

- its CRDs are the module's ``config/components/crd/bases/`` as shipped, not the
  chart's copies, which add a conversion webhook behind the chart's Service
  (only ``v1beta2`` is used here, the stored version, so nothing is converted);
- no APIService: the on-demand visibility API (an aggregated API server behind
  a Service, which would leave the API server's discovery incomplete and
  namespaces undeletable while unreachable) is off (feature gate
  ``VisibilityOnDemand=false``);
- its configuration manages ``batch/job`` only (the chart's list names Ray,
  MPI, AppWrapper, LeaderWorkerSet, ... whose CRDs are not installed here);
- with its certificate management off it reads its metrics certificate from
  the fixed path ``/etc/kueue/metrics/certs`` and exits without one: it runs in
  a private mount namespace whose ``/etc`` is an overlay of the machine's
  (:data:`_KUEUE_NS`), so the machine's ``/etc`` is never written;
- a ResourceFlavor and a ClusterQueue (:data:`KUEUE_QUEUES`, CPU quota
  :data:`KUEUE_CPU_QUOTA`, every namespace) are created with it; a test makes
  the LocalQueue in its namespace (:func:`local_queue`).

    CLUSTER_ADDONS=kubeflow make cluster      # both; CLUSTER_ADDONS=jobset for JobSet only
    CLUSTER_ADDONS=kueue make cluster         # Kueue; CLUSTER_ADDONS=kubeflow,kueue for all
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
BUNDLES = {"jobset": ("jobset",), "kubeflow": ("jobset", "trainer"), "kueue": ("kueue",)}
#: Kueue's queues in the test bed: one flavor, one ClusterQueue open to every
#: namespace with a CPU quota a test can exhaust (a LocalQueue per test namespace).
KUEUE_FLAVOR = "elasticrun-flavor"
KUEUE_CLUSTER_QUEUE = "elasticrun-queue"
KUEUE_CPU_QUOTA = "1"
KUEUE_QUEUES: list[dict[str, Any]] = [
    {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor",
     "metadata": {"name": KUEUE_FLAVOR}},
    {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue",
     "metadata": {"name": KUEUE_CLUSTER_QUEUE},
     "spec": {"namespaceSelector": {}, "resourceGroups": [{
         "coveredResources": ["cpu"],
         "flavors": [{"name": KUEUE_FLAVOR, "resources": [
             {"name": "cpu", "nominalQuota": KUEUE_CPU_QUOTA}]}]}]}},
]


def local_queue(namespace: str, name: str = "elasticrun") -> dict[str, Any]:
    """A LocalQueue of the test bed's ClusterQueue in ``namespace``."""
    return {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"clusterQueue": KUEUE_CLUSTER_QUEUE}}


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
    #: the wrapper module (under tests/controlplane) that pins it: its build cache key
    module_dir: str = "addons"
    #: CRDs read from this directory of the module instead of the chart's
    crds: str = ""


JOBSET = Addon("jobset", "sigs.k8s.io/jobset", "charts/jobset", "jobset", "jobset-system",
               "jobset", "jobset-controller", "jobset-controller-config")
TRAINER = Addon("trainer", "github.com/kubeflow/trainer/v2", "charts/kubeflow-trainer",
                "kubeflow-trainer", "kubeflow-system", "trainer-controller-manager",
                "kubeflow-trainer-controller-manager", "kubeflow-trainer-config",
                ("jobset.install=false",))
KUEUE = Addon("kueue", "sigs.k8s.io/kueue", "charts/kueue", "kueue", "kueue-system", "kueue",
              "kueue-controller-manager", "kueue-manager-config", module_dir="kueue",
              crds="config/components/crd/bases")
ADDONS = {a.name: a for a in (JOBSET, TRAINER, KUEUE)}


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


def cached_bin(module_dir: str = "addons") -> Path | None:
    """The directory ``build-addons.sh`` fills for one wrapper module (``addons``: JobSet
    and Trainer, ``kueue``), if it holds every binary of it (nothing is built)."""
    import hashlib
    import re

    group = [a for a in ADDONS.values() if a.module_dir == module_dir]
    explicit = os.environ.get("ADDONS_BIN")
    if explicit:
        out = Path(explicit)
    else:
        gomod = (HERE / module_dir / "go.mod").read_text()

        def version(module: str) -> str:
            found = re.search(rf"^\s*(?:require\s+)?{re.escape(module)} (v[0-9.]+)", gomod, re.M)
            return found.group(1) if found else "?"

        digest = hashlib.sha256((HERE / module_dir / "go.sum").read_bytes()).hexdigest()[:12]
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        key = "-".join(f"{a.name}-{version(a.module)}" for a in group)
        out = cache / "elasticrun" / "addons" / f"{key}-{digest}"
    return out if all((out / a.binary).is_file() for a in group) else None


def build(addons: Sequence[Addon]) -> dict[str, Path]:
    """Each add-on's cached binary directory (``build-addons.sh``, one call per wrapper
    module), building what is missing."""
    dirs: dict[str, Path] = {}
    for module_dir in dict.fromkeys(a.module_dir for a in addons):
        group = [a for a in addons if a.module_dir == module_dir]
        explicit = os.environ.get("ADDONS_BIN")
        if explicit and all((Path(explicit) / a.binary).exists() for a in group):
            out = Path(explicit)
        else:
            run = subprocess.run(["bash", str(HERE / "build-addons.sh"),
                                  *(a.name for a in group)],
                                 check=True, stdout=subprocess.PIPE, text=True)
            out = Path(run.stdout.strip().splitlines()[-1])
        dirs.update((a.name, out) for a in group)
    return dirs


def module_path(module: str, module_dir: str = "addons") -> Path:
    """The module's directory in the Go module cache (downloaded by the build)."""
    out = subprocess.run(["go", "list", "-m", "-json", module], cwd=HERE / module_dir,
                         check=True,
                         capture_output=True, text=True,
                         env={**os.environ, "GOTOOLCHAIN": "local", "GOFLAGS": "-mod=readonly"})
    return Path(json.loads(out.stdout)["Dir"])


def render(addon: Addon, helm: Path, workdir: Path) -> list[dict[str, Any]]:
    """The add-on's chart from its module, rendered with the release's name and namespace."""
    chart = workdir / "chart"
    shutil.rmtree(chart, ignore_errors=True)
    source = module_path(addon.module, addon.module_dir)
    shutil.copytree(source / addon.chart, chart)
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
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    if addon.crds:
        docs = [d for d in docs if d["kind"] != "CustomResourceDefinition"]
        docs += [yaml.safe_load(path.read_text())
                 for path in sorted((source / addon.crds).glob("*.yaml"))]
    return docs


#: What the test bed does not apply from a chart (see the module docstring): the
#: controller runs as a process, and nothing may need a Service that leads to it.
DROPPED_KINDS = ("Deployment", "APIService")


def adapt(docs: list[dict[str, Any]], port: int, ca_pem: bytes) -> list[dict[str, Any]]:
    """What runs on this machine (see the module docstring): no Deployment, webhooks by URL."""
    import base64

    bundle = base64.b64encode(ca_pem).decode()
    kept = []
    for doc in docs:
        if doc["kind"] in DROPPED_KINDS:
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
    if addon is JOBSET or addon is KUEUE:
        config["webhook"]["certDir"] = str(cert_dir)
        config.setdefault("internalCertManagement", {})["enable"] = False
    if addon is KUEUE:
        config["integrations"] = {"frameworks": ["batch/job"]}
        config.setdefault("featureGates", {})["VisibilityOnDemand"] = False
    elif addon is not JOBSET:
        config.setdefault("certManagement", {})["enable"] = False
    return config


@dataclass
class Running:
    name: str
    pid: int
    webhook_port: int
    health_port: int


def start(addons: Sequence[Addon], cluster_dir: Path, client: Any, kubectl: Any,
          helm: Path, bins: dict[str, Path], free_port: Any) -> list[Running]:
    """Apply each add-on's objects, start its controller, wait until its webhook answers.

    ``client`` is the admin KubeClient; ``kubectl(*args, input=...)`` runs kubectl as admin;
    ``bins`` is :func:`build`'s directory of each add-on.
    """
    started: list[Running] = []
    try:
        for addon in addons:
            started.append(_start_one(addon, cluster_dir, client, kubectl, helm,
                                      bins[addon.name], free_port))
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
    argv = [str(bin_dir / addon.binary), f"--config={d / 'config.yaml'}", "--zap-log-level=2"]
    if addon is KUEUE:
        argv = [*_kueue_namespace(d, certs), *argv]
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                            env=env, start_new_session=True, cwd=d)
    log.close()
    running = Running(addon.name, proc.pid, webhook_port, health_port)
    try:
        _wait_serving(running, d / "controller.log")
        if hooks:
            kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
                    input=yaml.safe_dump_all(hooks))
        if addon is KUEUE:
            kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump_all(KUEUE_QUEUES))
    except BaseException:
        stop([running])
        raise
    return running


#: Kueue with its own certificate management off reads its metrics server's
#: certificate from the fixed path /etc/kueue/metrics/certs (cmd/kueue/main.go)
#: and exits without it.  It runs in a private mount namespace whose /etc is an
#: overlay of the machine's, written in the cluster's directory, holding the
#: cluster's serving certificate there; the machine's /etc is never written.
#: ``exec`` keeps one PID from unshare to kueue, so it is stopped by its PID.
_KUEUE_NS = """set -eu
mount -n -t overlay overlay -o "lowerdir=/etc,upperdir=$1/upper,workdir=$1/work" /etc
mkdir -p /etc/kueue/metrics/certs
cp "$2/tls.crt" "$2/tls.key" /etc/kueue/metrics/certs/
shift 2
exec "$@"
"""


def _kueue_namespace(d: Path, certs: Path) -> list[str]:
    """The command prefix that starts Kueue in its mount namespace (see :data:`_KUEUE_NS`)."""
    etc = d / "etc"
    for sub in ("upper", "work"):
        (etc / sub).mkdir(parents=True, exist_ok=True)
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", _KUEUE_NS, "kueue-ns",
            str(etc), str(certs)]


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


__all__ = ["ADDONS", "BUNDLES", "JOBSET", "KUEUE", "KUEUE_CLUSTER_QUEUE", "KUEUE_CPU_QUOTA",
           "KUEUE_QUEUES", "TRAINER", "Addon", "Running", "adapt", "build", "cached_bin",
           "controller_config", "local_queue", "module_path", "render", "start", "stop",
           "wanted"]
