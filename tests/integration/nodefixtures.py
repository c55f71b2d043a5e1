"""Fixtures for tests on the real node: load with `pytest_plugins = ("nodefixtures",)`.

``node_cluster`` is a second, complete local cluster (kubelet, containerd,
scheduler, controller-manager) started once per session, the first time a test
asks for it, with the chart installed as a user would (``helm install`` with
``deploy/local/values.yaml``): the operator runs as the chart's Deployment, in
a pod.  Its teardown stops everything and fails the session if anything is
left: a process, a mount, a pod cgroup, a host path, or a changed kernel
tunable.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from elasticrun.api.kube import ApiError, KubeClient, load_credentials

from chartkit import Helm, apply, build_helm
from conftest import CRD_FILES, ROOT, Cluster
from controlplane import addons
from controlplane.localcluster import NODE, LocalControlPlane
from controlplane.node import host_paths, read_tunables
from nodekit import RELEASE, RELEASE_NAMESPACE

LOCAL_VALUES = ROOT / "deploy" / "local" / "values.yaml"


@pytest.fixture(scope="session")
def node_cluster() -> Iterator[Cluster]:
    if os.environ.get("ELASTICRUN_TEST_KUBECONFIG"):
        pytest.skip("needs the local node (its image and mounts); run on the suite's own cluster")
    if os.geteuid() != 0:
        pytest.skip("the local node needs root (a mount namespace, cgroups)")
    tunables, paths = read_tunables(), host_paths()
    workdir = Path(tempfile.mkdtemp(prefix="elasticrun-node-"))
    # The JobSet, Trainer and Kueue controllers join the node when they are built
    # (make addons).
    built = [name for name, module_dir in (("kubeflow", "addons"), ("kueue", "kueue"))
             if addons.cached_bin(module_dir)]
    local = LocalControlPlane(workdir, owner_pid=os.getpid(), mode=NODE,
                              addons=",".join(built))
    try:
        state = local.start()
        client = KubeClient(load_credentials(str(state.kubeconfig)), timeout=30)
        cluster = Cluster(state.kubeconfig, client, local)
        for path in CRD_FILES:
            cluster.apply(yaml.safe_load(path.read_text()))
        install_chart(cluster, workdir)
        yield cluster
        client.close()
    finally:
        node = local.node if local.state else None
        local.stop()
        left = node.leftovers() if node else []
        shutil.rmtree(workdir, ignore_errors=True)
    assert not left, f"the stopped node left {left}"
    assert host_paths() <= paths, f"the node created host paths {host_paths() - paths}"
    assert read_tunables() == tunables, "the node changed the machine's kernel tunables"


def install_chart(cluster: Cluster, workdir: Path) -> None:
    """``helm install`` of the chart with the local values; waits for an Available operator."""
    helm = Helm(build_helm(), workdir / "helm", cluster.kubeconfig)
    helm.run("install", RELEASE, str(ROOT / "charts" / "elasticrun"), "-f", str(LOCAL_VALUES),
             "-n", RELEASE_NAMESPACE, "--create-namespace", "--wait", "--timeout", "180s",
             timeout=200)


@pytest.fixture
def node_namespace(node_cluster: Cluster) -> Iterator[str]:
    """A fresh namespace on the node cluster with the chart's training ServiceAccount."""
    name = f"n-{secrets.token_hex(4)}"
    node_cluster.client.request("POST", "/api/v1/namespaces", body={
        "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    helm = Helm(build_helm(), Path(tempfile.mkdtemp(prefix="elasticrun-helm-")))
    try:
        docs = [d for d in helm.template(RELEASE, RELEASE_NAMESPACE,
                                         {"trainingNamespaces": [name]})
                if d["kind"] in ("ServiceAccount", "Role", "RoleBinding")
                and d["metadata"].get("namespace") == name]
    finally:
        shutil.rmtree(helm.home, ignore_errors=True)
    apply(node_cluster, docs)
    yield name
    with contextlib.suppress(ApiError):
        node_cluster.client.request("DELETE", f"/api/v1/namespaces/{name}")


@pytest.fixture
def addons_cluster(node_cluster: Cluster) -> Cluster:
    """The node cluster, with the JobSet and Kubeflow Trainer controllers running."""
    return _with_addon(node_cluster, "trainer", "the JobSet and Kubeflow Trainer controllers")


@pytest.fixture
def kueue_cluster(node_cluster: Cluster) -> Cluster:
    """The node cluster, with Kueue's controller and its ClusterQueue (controlplane.addons)."""
    return _with_addon(node_cluster, "kueue", "Kueue's controller")


def _with_addon(node_cluster: Cluster, name: str, what: str) -> Cluster:
    local = node_cluster.local
    if local is None or local.state is None or name not in local.state.addon_pids:
        pytest.skip(f"{what} is not built: run `make addons` "
                    "(tests/controlplane/build-addons.sh, a few minutes once)")
    return node_cluster
