"""Helpers for tests on the real node (fixtures are in nodefixtures.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from elasticrun.api.kube import ApiError

from conftest import Cluster, wait_for
from controlplane import localize

RELEASE, RELEASE_NAMESPACE = "elasticrun", "elasticrun-system"
OPERATOR_DEPLOYMENT = "elasticrun-operator"


def operator_pods(cluster: Cluster) -> list[dict[str, Any]]:
    """The chart's operator pods (two replicas with deploy/local/values.yaml), by name."""
    pods: list[dict[str, Any]] = cluster.client.request(
        "GET", f"/api/v1/namespaces/{RELEASE_NAMESPACE}/pods",
        query={"labelSelector": "app.kubernetes.io/component=operator"})["items"]
    return sorted(pods, key=lambda p: str(p["metadata"]["name"]))


def apply_example(cluster: Cluster, namespace: str, path: Path,
                  args: list[str] | None = None) -> list[dict[str, Any]]:
    """Apply an example as a user would, adapted to the local node (see localize)."""
    volumes = Path(cluster.require_local().dir) / "node" / "volumes" / namespace
    docs = localize.localize(localize.load(path), volumes)
    for doc in docs:
        spec = localize.pod_spec(doc)
        if spec is not None and args is not None:
            command = spec["containers"][0]["command"]
            script = command.index(f"{localize.EXAMPLES_IN_IMAGE}/train.py")
            spec["containers"][0]["command"] = [*command[:script + 1], *args]
    text = yaml.safe_dump_all(docs)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=text)
    return docs


def wait_pod_phase(cluster: Cluster, namespace: str, name: str, phases: set[str],
                   timeout: float) -> dict[str, Any]:
    def phase() -> dict[str, Any] | None:
        try:
            pod: dict[str, Any] = cluster.client.request(
                "GET", f"/api/v1/namespaces/{namespace}/pods/{name}")
        except ApiError:
            return None
        return pod if (pod.get("status") or {}).get("phase") in phases else None

    pod: dict[str, Any] = wait_for(phase, timeout, f"pod {name} to reach {phases}", interval=0.5)
    return pod
