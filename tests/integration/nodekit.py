"""Helpers for tests on the real node (fixtures are in nodefixtures.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import yaml

from elasticrun.api.kube import ApiError

from conftest import Cluster, wait_for
from controlplane import localize
from rdzv import read_run

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


def lost_reasons(cluster: Cluster, namespace: str, run: str, member: str) -> list[str]:
    """The reasons ``member`` was removed from ``run`` for, oldest first."""
    lost = read_run(cluster.client, namespace, run).status.lost_members
    return [m.reason for m in lost if m.name == member]


def delete_member(cluster: Cluster, namespace: str, run: str, member: str) -> float:
    """Delete a member's pod and wait until the operator removes it (PodDeleted, once).

    Returns the seconds from the delete to the removal."""
    deleted = time.monotonic()
    cluster.kubectl("delete", "pod", "-n", namespace, member, "--wait=false")
    reasons = wait_for(lambda: lost_reasons(cluster, namespace, run, member), 60,
                       f"the operator to remove {member}")
    assert reasons == ["PodDeleted"], reasons
    return time.monotonic() - deleted
