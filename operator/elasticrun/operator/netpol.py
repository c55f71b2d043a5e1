"""Per-run NetworkPolicies (opt-in, ``--per-run-network-policy``): run A cannot reach B's store.

The chart's namespace-wide policy admits every training pod (label
``elasticrun.dev/run`` present) to the TCPStore port, because one
NetworkPolicy cannot say "the same label value as the pod it protects".  With
``networkPolicy.perRun`` the chart leaves the store port out of that policy
and the operator makes one policy per run: the run's pods (label
``elasticrun.dev/run=<label value of the run>``) accept the store port only
from the run's own pods.  NetworkPolicies only ever add what they allow, so
the two together admit the store port from the run's pods alone.

When the store port is not pinned (``store_port`` 0: each node picks a free
port per round), the store cannot be told from any other port: the run's
pods then accept every port from the run's pods, and the chart requires
``isolate`` so that the namespace-wide policy opens nothing else.

The policy is owned by the run (ownerReferences), so the garbage collector
removes it with the run; the operator also deletes it on TTL cleanup.
Enforcement is the CNI's; the API server stores the policy either way.
"""

from __future__ import annotations

import hashlib
from typing import Any

from elasticrun.api import crd
from elasticrun.api.naming import label_value

NETWORKING = "networking.k8s.io"
MANAGER = "elasticrun-operator"


def object_name(run: str) -> str:
    """Name of the run's NetworkPolicy (a valid object name for any run name)."""
    name = f"elasticrun-store.{run}"
    if len(name) <= 253:
        return name
    return f"elasticrun-store.{run[:200]}.{hashlib.sha256(run.encode()).hexdigest()[:16]}"


def policy(run: str, namespace: str, uid: str | None, store_port: int) -> dict[str, Any]:
    """The run's NetworkPolicy: its pods accept ``store_port`` (0: any port) from its pods."""
    pods = {"matchLabels": {crd.RUN_LABEL: label_value(run)}}
    rule: dict[str, Any] = {"from": [{"podSelector": pods}]}
    if store_port:
        rule["ports"] = [{"protocol": "TCP", "port": store_port}]
    meta: dict[str, Any] = {
        "name": object_name(run), "namespace": namespace,
        "labels": {"app.kubernetes.io/managed-by": MANAGER},
        "annotations": {crd.RUN_LABEL: run},
    }
    if uid:
        meta["ownerReferences"] = [{"apiVersion": crd.API_VERSION, "kind": crd.KIND,
                                    "name": run, "uid": uid, "blockOwnerDeletion": False}]
    return {"apiVersion": f"{NETWORKING}/v1", "kind": "NetworkPolicy", "metadata": meta,
            "spec": {"podSelector": pods, "policyTypes": ["Ingress"], "ingress": [rule]}}


def path(namespace: str, run: str) -> str:
    return f"/apis/{NETWORKING}/v1/namespaces/{namespace}/networkpolicies/{object_name(run)}"
