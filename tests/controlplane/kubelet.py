"""Plays kubelet for Pod objects on an API server that has none.

A lone kube-apiserver stores Pods but nothing runs them: this marks them
Running with the node's address, fails or restarts their containers, and
deletes them at once (an unbound pod is removed without a grace period).

Where a real pod is what a test means (a Job's pods, a deletion the kubelet
carries out, an eviction, a crashed container), the test runs on the real
node instead (``tests/integration/test_realnode.py``).  This stays for tests
that need a pod state at an exact moment, which a real kubelet cannot be made
to produce on demand: a container restart counted while the agent is mid-
round, a ``Failed`` phase, a ``DisruptionTarget`` condition without the
deletion that follows it, hundreds of pods for the operator's load test; and
for the demo and benchmarks, which run their nodes as local processes so they
need no node at all.
"""

from __future__ import annotations

from typing import Any

from elasticrun.api import crd
from elasticrun.api.kube import KubeClient

STARTED = "2026-01-01T00:00:00Z"
UNSCHEDULED = "elasticrun-tests-no-scheduler"


class Kubelet:
    def __init__(self, client: KubeClient, namespace: str) -> None:
        self.client = client
        self.namespace = namespace

    def path(self, name: str, sub: str = "") -> str:
        base = f"/api/v1/namespaces/{self.namespace}/pods/{name}"
        return f"{base}/{sub}" if sub else base

    def create(self, name: str, run: str, ip: str = "127.0.0.1") -> dict[str, Any]:
        """A training pod of ``run``, already Running at ``ip``."""
        body = {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "labels": {crd.RUN_LABEL: run}},
                # A scheduler nobody runs: on a cluster with a real node the pod is
                # never bound, so no kubelet overwrites the status this class sets.
                "spec": {"schedulerName": UNSCHEDULED,
                         "containers": [{"name": "trainer", "image": "trainer:latest",
                                         "command": ["torchrun", "train.py"]}]}}
        self.client.request("POST", f"/api/v1/namespaces/{self.namespace}/pods", body=body)
        return self.set_status(name, {
            "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
            "conditions": [{"type": "Ready", "status": "True"}],
            "containerStatuses": [{"name": "trainer", "image": "trainer:latest",
                                   "imageID": "", "ready": True, "restartCount": 0,
                                   "started": True, "state": {"running": {"startedAt": STARTED}}}]})

    def set_status(self, name: str, status: dict[str, Any]) -> dict[str, Any]:
        return self.client.request("PATCH", self.path(name, "status"), body={"status": status},
                                   content_type="application/merge-patch+json")

    def delete(self, name: str) -> None:
        self.client.request("DELETE", self.path(name), query={"gracePeriodSeconds": 0})
