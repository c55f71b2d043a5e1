"""Workloads and the Pod objects they own, on an API server without their controllers.

A lone kube-apiserver stores a Job or a StatefulSet but runs no controller,
so the test makes its pods itself: Pod objects labelled for the run, with the
workload as their controller ``ownerReference``, as the Job controller would
make them.  The operator reads the workload by name from the pods'
ownerReferences (``status.desired``); handlers can play those pods by name
(``make_handler(..., pod=name)``).
"""

from __future__ import annotations

from typing import Any

from elasticrun.api import crd
from elasticrun.api.kube import KubeClient

from conftest import Cluster
from controlplane.kubelet import UNSCHEDULED, Kubelet

#: Kueue's gate on the new pods of an elastic Job until their slice is admitted.
ELASTIC_GATE = "kueue.x-k8s.io/elastic-job"


def _template(run: str) -> dict[str, Any]:
    return {"metadata": {"labels": {crd.RUN_LABEL: run}},
            "spec": {"restartPolicy": "Never", "schedulerName": UNSCHEDULED,
                     "containers": [{"name": "trainer", "image": "trainer:latest"}]}}


def create_job(client: KubeClient, namespace: str, name: str, run: str, parallelism: int,
               completions: int | None = None, **spec: Any) -> dict[str, Any]:
    """A batch/v1 Job (nothing runs it here); returns it as stored."""
    body = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
            "spec": {"parallelism": parallelism,
                     "completions": completions if completions is not None else parallelism,
                     "completionMode": "Indexed", "template": _template(run), **spec}}
    return client.request("POST", f"/apis/batch/v1/namespaces/{namespace}/jobs", body=body)


def create_statefulset(client: KubeClient, namespace: str, name: str, run: str,
                       replicas: int) -> dict[str, Any]:
    template = _template(run)
    template["metadata"]["labels"]["app"] = name
    template["spec"]["restartPolicy"] = "Always"
    body = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": name},
            "spec": {"replicas": replicas, "serviceName": name,
                     "selector": {"matchLabels": {"app": name}}, "template": template}}
    return client.request("POST", f"/apis/apps/v1/namespaces/{namespace}/statefulsets",
                          body=body)


def patch_job(client: KubeClient, namespace: str, name: str, **spec: Any) -> dict[str, Any]:
    return client.request("PATCH", f"/apis/batch/v1/namespaces/{namespace}/jobs/{name}",
                          body={"spec": spec}, content_type="application/merge-patch+json")


def owner_reference(owner: dict[str, Any]) -> dict[str, Any]:
    """The controller ownerReference a workload's controller puts on the pods it makes."""
    meta = owner["metadata"]
    return {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": meta["name"],
            "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}


def create_owned_pod(pods: Kubelet, name: str, run: str, owner: dict[str, Any] | None,
                     gated: bool = False, running: bool = True,
                     ip: str = "127.0.0.1") -> dict[str, Any]:
    """A pod of ``run`` whose controller is ``owner``: gated (Kueue), Pending, or Running."""
    meta: dict[str, Any] = {"name": name, "labels": {crd.RUN_LABEL: run}}
    if owner is not None:
        meta["ownerReferences"] = [owner_reference(owner)]
    spec: dict[str, Any] = {"schedulerName": UNSCHEDULED,
                            "containers": [{"name": "trainer", "image": "trainer:latest"}]}
    if gated:
        spec["schedulingGates"] = [{"name": ELASTIC_GATE}]
    created = pods.client.request("POST", f"/api/v1/namespaces/{pods.namespace}/pods",
                                  body={"apiVersion": "v1", "kind": "Pod", "metadata": meta,
                                        "spec": spec})
    if not running or gated:
        return created
    return pods.set_status(name, {
        "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
        "conditions": [{"type": "Ready", "status": "True"}],
        "containerStatuses": [{"name": "trainer", "image": "trainer:latest", "imageID": "",
                               "ready": True, "restartCount": 0, "started": True,
                               "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}}]})


def pod_on(cluster: Cluster, pods: Kubelet, name: str, run: str, node: str) -> None:
    """A Running training pod of ``run`` bound to ``node`` (the test plays its kubelet)."""
    cluster.client.request("POST", f"/api/v1/namespaces/{pods.namespace}/pods", body={
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {"elasticrun.dev/run": run}},
        "spec": {"nodeName": node,
                 "containers": [{"name": "trainer", "image": "trainer:latest"}]}})
    pods.set_status(name, {
        "phase": "Running", "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}],
        "conditions": [{"type": "Ready", "status": "True"}],
        "containerStatuses": [{"name": "trainer", "image": "trainer:latest", "imageID": "",
                               "ready": True, "restartCount": 0, "started": True,
                               "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}}]})
