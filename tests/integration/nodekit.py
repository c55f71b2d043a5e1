"""Helpers for tests on the real node (fixtures are in nodefixtures.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import yaml

from elasticrun.api.kube import ApiError
from elasticrun.api.model import ElasticRun

from conftest import ROOT, Cluster, wait_for
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


# --------------------------------------------------------------------------- runs of the examples

EXAMPLES = ROOT / "deploy" / "examples"
#: Long enough to delete a member mid-run and re-form; about a minute on 2 cores.
LONG_TRAINING = ["--epochs", "300", "--steps-per-epoch", "10"]
INTEGRATIONS = ROOT / "deploy" / "integrations"
TRAIN_IN_IMAGE = f"{localize.EXAMPLES_IN_IMAGE}/train.py"
#: Long enough for a loss and a replacement (300 epochs end in about 25 s on three
#: nodes here, before a replacement pod is up).
TRAINING = ["--epochs", "2000", "--steps-per-epoch", "10"]


def elastic_run(name: str, min_nodes: int, max_nodes: int) -> dict[str, Any]:
    """The run an example's pods join, created up front with short timeouts for tests."""
    return {"apiVersion": "elasticrun.dev/v1alpha1", "kind": "ElasticRun",
            "metadata": {"name": name},
            "spec": {"minNodes": min_nodes, "maxNodes": max_nodes, "lastCallTimeoutSeconds": 2,
                     "heartbeatTimeoutSeconds": 6, "leaseRenewIntervalSeconds": 2}}


def create_run(cluster: Cluster, namespace: str, body: dict[str, Any]) -> None:
    cluster.client.request("POST", f"/apis/elasticrun.dev/v1alpha1/namespaces/{namespace}"
                                   "/elasticruns", body=body)


def round_with(cluster: Cluster, namespace: str, run: str, members: int,
               after: int = 0, without: str | None = None,
               including: str | None = None) -> ElasticRun | None:
    current = read_run(cluster.client, namespace, run)
    names = {p.name for p in current.status.participants}
    if (current.status.round > after and len(names) == members and without not in names
            and (including is None or including in names)):
        return current
    return None


def pods_of(cluster: Cluster, namespace: str, selector: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = cluster.client.request(
        "GET", f"/api/v1/namespaces/{namespace}/pods", query={"labelSelector": selector})["items"]
    return items


def logs(cluster: Cluster, namespace: str, pod: str) -> str:
    return cluster.kubectl("logs", "-n", namespace, pod, "--tail=400", check=False).stdout


def with_args(command: list[str], args: list[str]) -> list[str]:
    return [*command[:command.index(TRAIN_IN_IMAGE) + 1], *args]


def condition(obj: dict[str, Any], kind: str) -> bool:
    return any(c.get("type") == kind and c.get("status") == "True"
               for c in (obj.get("status") or {}).get("conditions") or [])
