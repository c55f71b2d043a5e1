"""Fixtures: a real control plane per test session, a namespace per test.

By default the session starts its own etcd + kube-apiserver on 127.0.0.1 (built
once by ``tests/controlplane/build.sh`` and cached).  Set
``ELASTICRUN_TEST_KUBECONFIG`` to run the same suite against an existing cluster
(for example kind); tests that need to stop or reconfigure the API server, or
read its audit log, are skipped there.  ``KUBECONFIG`` is deliberately not used,
so the suite never touches whatever cluster a developer's shell points at.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from controlplane.localcluster import LocalControlPlane, stop_pid
from elasticrun.api import crd
from elasticrun.api.kube import ApiError, KubeClient, load_credentials

ROOT = Path(__file__).resolve().parent.parent
CRD_FILE = ROOT / "deploy" / "crds" / "elasticrun.dev_elasticruns.yaml"
KUBECTL = str(Path(sys.executable).parent / "kubectl") \
    if (Path(sys.executable).parent / "kubectl").exists() else (shutil.which("kubectl") or "kubectl")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "/integration/" in str(item.path):
            item.add_marker(pytest.mark.integration)


@dataclass
class Cluster:
    """How tests reach the API server, as admin."""

    kubeconfig: Path
    client: KubeClient
    local: LocalControlPlane | None

    def kubectl(self, *args: str, check: bool = True, input: str | None = None,
                timeout: float = 60) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        return subprocess.run([KUBECTL, *args], env=env, capture_output=True, text=True,
                              check=check, input=input, timeout=timeout)

    def apply(self, manifest: dict[str, Any], manager: str = "elasticrun-tests"
              ) -> dict[str, Any]:
        """Server-side apply of one object (namespaced or not), like kubectl apply."""
        return self.client.request("PATCH", object_path(manifest), body=manifest,
                                   query={"fieldManager": manager, "force": "true"},
                                   content_type="application/apply-patch+yaml")

    def require_local(self) -> LocalControlPlane:
        if self.local is None:
            pytest.skip("needs the suite's own control plane (not an external cluster)")
        return self.local


def object_path(manifest: dict[str, Any]) -> str:
    """The REST path of a manifest's object, for the built-in kinds tests use."""
    api_version: str = manifest["apiVersion"]
    kind: str = manifest["kind"]
    meta = manifest["metadata"]
    plural = {
        "Namespace": "namespaces", "ServiceAccount": "serviceaccounts", "Role": "roles",
        "RoleBinding": "rolebindings", "ClusterRole": "clusterroles",
        "ClusterRoleBinding": "clusterrolebindings", "Pod": "pods", "Lease": "leases",
        "ElasticRun": crd.PLURAL, "CustomResourceDefinition": "customresourcedefinitions",
        "Secret": "secrets", "ConfigMap": "configmaps", "Service": "services",
        "Deployment": "deployments", "Job": "jobs", "StatefulSet": "statefulsets",
        "NetworkPolicy": "networkpolicies",
        "MutatingWebhookConfiguration": "mutatingwebhookconfigurations",
        "ValidatingWebhookConfiguration": "validatingwebhookconfigurations",
    }[kind]
    prefix = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    ns = meta.get("namespace")
    if ns:
        return f"{prefix}/namespaces/{ns}/{plural}/{meta['name']}"
    return f"{prefix}/{plural}/{meta['name']}"


def wait_for(condition: Callable[[], Any], timeout: float, what: str,
             interval: float = 0.05) -> Any:
    """Bounded wait for ``condition()`` to return something truthy; returns it."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    external = os.environ.get("ELASTICRUN_TEST_KUBECONFIG")
    if external:
        client = KubeClient(load_credentials(external), timeout=30)
        yield Cluster(Path(external), client, None)
        client.close()
        return
    workdir = Path(tempfile.mkdtemp(prefix="elasticrun-cp-"))
    local = LocalControlPlane(workdir)
    try:
        state = local.start()
        client = KubeClient(load_credentials(str(state.kubeconfig)), timeout=30)
        yield Cluster(state.kubeconfig, client, local)
        client.close()
    finally:
        local.stop()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def crds(cluster: Cluster) -> None:
    manifest = yaml.safe_load(CRD_FILE.read_text())
    cluster.apply(manifest)

    def established() -> bool:
        got = cluster.client.request(
            "GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd.CRD_NAME}")
        return any(c["type"] == "Established" and c["status"] == "True"
                   for c in (got.get("status") or {}).get("conditions") or [])

    wait_for(established, 30, "the ElasticRun CRD to be Established")
    # The new resource is served a moment after Established; wait until a list works.
    wait_for(lambda: _lists(cluster.client), 30, "elasticruns to be served")


def _lists(client: KubeClient) -> bool:
    try:
        client.request("GET", f"/apis/{crd.GROUP}/{crd.VERSION}/{crd.PLURAL}")
    except ApiError:
        return False
    return True


@pytest.fixture
def namespace(cluster: Cluster, crds: None) -> Iterator[str]:
    """A fresh namespace per test (a lone API server never finishes deleting one)."""
    name = f"t-{secrets.token_hex(4)}"
    cluster.client.request("POST", "/api/v1/namespaces",
                           body={"apiVersion": "v1", "kind": "Namespace",
                                 "metadata": {"name": name}})
    yield name
    with contextlib.suppress(ApiError):
        cluster.client.request("DELETE", f"/api/v1/namespaces/{name}")


class ProcessGroup:
    """Processes a test starts; every one is stopped by its PID at teardown."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[Any]] = []

    def start(self, argv: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        proc = subprocess.Popen(argv, start_new_session=True, **kwargs)
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in self.procs:
            stop_pid(proc.pid, timeout=10)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)


@pytest.fixture
def processes() -> Iterator[ProcessGroup]:
    group = ProcessGroup()
    try:
        yield group
    finally:
        group.stop_all()


# --------------------------------------------------------------------------- handlers


@pytest.fixture
def make_handler(cluster: Cluster, namespace: str) -> Iterator[Callable[..., Any]]:
    """Build K8sRendezvousHandlers as nodes of one namespace; all shut down at teardown."""
    from elasticrun.api.model import RunSpec
    from elasticrun.handler.handler import K8sRendezvousHandler
    from elasticrun.handler.settings import RendezvousSettings

    made: list[K8sRendezvousHandler] = []

    def make(run: str, node: str, min_nodes: int = 1, max_nodes: int | None = None,
             kubeconfig: Path | None = None, **overrides: Any) -> K8sRendezvousHandler:
        spec = RunSpec(min_nodes=min_nodes, max_nodes=max_nodes or min_nodes,
                       join_timeout=overrides.pop("join_timeout", 60),
                       last_call_timeout=overrides.pop("last_call_timeout", 1),
                       heartbeat_timeout=overrides.pop("heartbeat_timeout", 15),
                       lease_renew_interval=overrides.pop("lease_renew_interval", 5))
        settings = RendezvousSettings(
            run_name=run, namespace=overrides.pop("namespace", namespace), node_name=node,
            address="127.0.0.1", pod=overrides.pop("pod", None), requested_spec=spec,
            kubeconfig=str(kubeconfig or cluster.kubeconfig),
            api_timeout=overrides.pop("api_timeout", 20),
            close_timeout=overrides.pop("close_timeout", 10), **overrides)
        handler = K8sRendezvousHandler(settings)
        made.append(handler)
        return handler

    yield make
    for handler in made:
        with contextlib.suppress(Exception):
            handler.shutdown()


# --------------------------------------------------------------------------- operator


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class OperatorProcess:
    """``python -m elasticrun.operator`` as a real process, scoped to namespaces."""

    def __init__(self, cluster: Cluster, namespaces: list[str], log_dir: Path,
                 extra_args: tuple[str, ...] = ()) -> None:
        self.cluster = cluster
        self.namespaces = namespaces
        self.log_path = log_dir / "operator.log"
        self.extra_args = extra_args
        self.metrics_port = free_port()
        self.health_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> OperatorProcess:
        import urllib.request

        argv = [sys.executable, "-m", "elasticrun.operator", "--kubeconfig",
                str(self.cluster.kubeconfig), "--metrics-addr", "127.0.0.1",
                "--metrics-port", str(self.metrics_port), "--health-addr", "127.0.0.1",
                "--health-port", str(self.health_port), *self.extra_args]
        for ns in self.namespaces:
            argv += ["--namespace", ns]
        env = {**os.environ, "KUBECONFIG": str(self.cluster.kubeconfig)}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)

        def healthy() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"operator exited:\n{self.log_tail()}")
            try:
                opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
                with opener.open(f"http://127.0.0.1:{self.health_port}/healthz", timeout=1):
                    return True
            except OSError:
                return False

        wait_for(healthy, 60, "the operator's /healthz", interval=0.2)
        return self

    def kill(self) -> None:
        """SIGKILL: no clean-up at all, as when its node dies."""
        if self.proc is not None:
            stop_pid(self.proc.pid, timeout=0)
            self.proc.wait(timeout=10)
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            stop_pid(self.proc.pid, timeout=10)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)
            self.proc = None

    def metrics(self) -> str:
        import urllib.request

        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return str(r.read().decode())

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"


@pytest.fixture
def operator(cluster: Cluster, namespace: str, tmp_path: Path,
             request: pytest.FixtureRequest) -> Iterator[OperatorProcess]:
    op = OperatorProcess(cluster, [namespace], tmp_path).start()
    try:
        yield op
    finally:
        op.stop()
        report = getattr(request.node, "rep_call", None)
        if report is not None and report.failed:
            print(f"\n--- operator log ---\n{op.log_tail(80)}")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


# --------------------------------------------------------------------------- pods (no kubelet)


class Pods:
    """Plays kubelet for Pod objects: create, mark Running, fail, delete."""

    def __init__(self, cluster: Cluster, namespace: str) -> None:
        self.client = cluster.client
        self.namespace = namespace

    def path(self, name: str, sub: str = "") -> str:
        base = f"/api/v1/namespaces/{self.namespace}/pods/{name}"
        return f"{base}/{sub}" if sub else base

    def create(self, name: str, run: str) -> dict[str, Any]:
        body = {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "labels": {crd.RUN_LABEL: run}},
                "spec": {"containers": [{"name": "trainer", "image": "trainer:latest",
                                         "command": ["torchrun", "train.py"]}]}}
        self.client.request("POST", f"/api/v1/namespaces/{self.namespace}/pods", body=body)
        return self.set_status(name, {
            "phase": "Running", "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}],
            "conditions": [{"type": "Ready", "status": "True"}],
            "containerStatuses": [{"name": "trainer", "image": "trainer:latest",
                                   "imageID": "", "ready": True, "restartCount": 0,
                                   "started": True, "state": {"running": {
                                       "startedAt": "2026-01-01T00:00:00Z"}}}]})

    def set_status(self, name: str, status: dict[str, Any]) -> dict[str, Any]:
        return self.client.request("PATCH", self.path(name, "status"), body={"status": status},
                                   content_type="application/merge-patch+json")

    def delete(self, name: str) -> None:
        self.client.request("DELETE", self.path(name), query={"gracePeriodSeconds": 0})


@pytest.fixture
def pods(cluster: Cluster, namespace: str) -> Pods:
    return Pods(cluster, namespace)
