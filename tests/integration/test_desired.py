"""status.desired from the workload owning the run's pods: the real operator, a real API server.

No workload controller runs here: the test creates the Job (StatefulSet, JobSet,
TrainJob) and the Pod objects it would own, and patches the Job as Kueue or a
user would.  JobSet's and Trainer's CRDs come from the Go module cache of the
add-ons build (``tests/controlplane/addons.py``), without their controllers.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from owned import create_job, create_owned_pod, create_statefulset, patch_job

from elasticrun.api import crd
from elasticrun.api.model import RunSpec, new_run_manifest
from elasticrun.operator.ownerreader import OWNER_REFRESH
from elasticrun.operator.reconcile import (
    DESIRED_ABOVE_MAX,
    DESIRED_CONDITION,
    DESIRED_FITS,
    SEVERAL_OWNERS,
)

from chartkit import account_client
from conftest import Cluster, Kubelet, OperatorProcess, consistently, wait_for
from controlplane.kubelet import UNSCHEDULED
from rdzv import read_run, rendezvous_all
from timings import outlasting


def _create_run(cluster: Cluster, namespace: str, name: str, min_nodes: int,
                max_nodes: int) -> None:
    cluster.client.request(
        "POST", f"/apis/elasticrun.dev/v1alpha1/namespaces/{namespace}/elasticruns",
        body=new_run_manifest(name, namespace, RunSpec(min_nodes=min_nodes,
                                                       max_nodes=max_nodes)))


def _desired(cluster: Cluster, namespace: str, run: str) -> tuple[int, str | None, int] | None:
    desired = read_run(cluster.client, namespace, run).status.desired
    return None if desired is None else (desired.size, desired.source, desired.coming)


def _until_desired(cluster: Cluster, namespace: str, run: str,
                   want: tuple[int, str | None, int] | None, timeout: float = 10) -> float:
    """Seconds until the status says ``want`` (bounded)."""
    started = time.monotonic()
    wait_for(lambda: _desired(cluster, namespace, run) == want, timeout,
             f"status.desired, desiredFrom, coming = {want} "
             f"(last: {_desired(cluster, namespace, run)})")
    return time.monotonic() - started


def _events(cluster: Cluster, namespace: str, reason: str) -> list[str]:
    got = cluster.client.request("GET", f"/api/v1/namespaces/{namespace}/events",
                                 query={"fieldSelector": f"reason={reason}"})
    return [e["message"] for e in got.get("items") or []]


def _condition(cluster: Cluster, namespace: str, run: str) -> tuple[str, str | None] | None:
    found = read_run(cluster.client, namespace, run).status.condition(DESIRED_CONDITION)
    return None if found is None else (found.status, found.reason)


def test_a_jobs_parallelism_is_the_runs_desired_size_and_follows_a_patch(
        operator: OperatorProcess, cluster: Cluster, namespace: str, pods: Kubelet) -> None:
    _create_run(cluster, namespace, "train", 2, 4)
    job = create_job(cluster.client, namespace, "train", "train", parallelism=2)
    for name in ("train-0", "train-1"):
        create_owned_pod(pods, name, "train", job)
    _until_desired(cluster, namespace, "train", (2, "Job/train", 2))
    # Kueue's scale-up: parallelism 2 -> 4, the new pods appear gated.
    patch_job(cluster.client, namespace, "train", parallelism=4, completions=4)
    started = time.monotonic()
    for name in ("train-2", "train-3"):
        create_owned_pod(pods, name, "train", job, gated=True)
    _until_desired(cluster, namespace, "train", (4, "Job/train", 4))
    seen = time.monotonic() - started
    print(f"\nscale-up 2 -> 4 in status.desired {seen:.3f}s after the new pods")
    assert seen < 2.0, f"status.desired followed the new pods only after {seen:.2f}s"
    # Scale-down: parallelism 4 -> 3 and the pod deleted; the deletion has it read at once.
    patch_job(cluster.client, namespace, "train", parallelism=3, completions=3)
    started = time.monotonic()
    pods.delete("train-3")
    _until_desired(cluster, namespace, "train", (3, "Job/train", 3))
    seen = time.monotonic() - started
    print(f"scale-down 4 -> 3 in status.desired {seen:.3f}s after the deletion")
    assert seen < 2.0, f"status.desired followed the deletion only after {seen:.2f}s"
    # A patch that makes no pod (yet) is seen within the refresh (3 s) plus a reconcile.
    patch_job(cluster.client, namespace, "train", parallelism=2, completions=2)
    _until_desired(cluster, namespace, "train", (2, "Job/train", 3), timeout=8)


def test_coming_counts_the_owners_pods_until_their_nodes_join(
        operator: OperatorProcess, cluster: Cluster, namespace: str, pods: Kubelet,
        make_handler: Any) -> None:
    job = create_job(cluster.client, namespace, "join", "join", parallelism=3)
    created = {name: create_owned_pod(pods, name, "join", job) for name in ("join-0", "join-1")}
    create_owned_pod(pods, "join-2", "join", job, gated=True)
    nodes = [make_handler("join", name, min_nodes=2, max_nodes=4, pod=name,
                          pod_uid=created[name]["metadata"]["uid"]) for name in created]
    outcomes = rendezvous_all(nodes)
    assert not {n: o.error for n, o in outcomes.items() if o.error}
    assert {o.rank for o in outcomes.values()} == {0, 1}
    # The two members are not coming; the gated pod is.
    _until_desired(cluster, namespace, "join", (3, "Job/join", 1))


def test_desired_above_max_nodes_is_one_warning_event_a_condition_and_the_desired_column(
        operator: OperatorProcess, cluster: Cluster, namespace: str, pods: Kubelet) -> None:
    _create_run(cluster, namespace, "big", 2, 4)
    job = create_job(cluster.client, namespace, "big", "big", parallelism=6)
    for i in range(6):
        create_owned_pod(pods, f"big-{i}", "big", job, gated=i >= 4)
    _until_desired(cluster, namespace, "big", (6, "Job/big", 6))
    wait_for(lambda: _condition(cluster, namespace, "big") == ("True", DESIRED_ABOVE_MAX), 10,
             "the DesiredMismatch condition")
    wait_for(lambda: _events(cluster, namespace, DESIRED_ABOVE_MAX), 10, "the Warning Event")
    (message,) = _events(cluster, namespace, DESIRED_ABOVE_MAX)
    assert message == ("Job/big asks for 6 nodes, more than maxNodes (4): 2 pod(s) will wait "
                       "as spares and hold their quota")
    table = cluster.kubectl("get", "er", "big", "-n", namespace).stdout.splitlines()
    header, row = table[0].split(), table[1].split()
    assert dict(zip(header, row, strict=False))["DESIRED"] == "6", table
    # Reconciles go on (the owner is read again every OWNER_REFRESH seconds): still one
    # Event, and the condition holds, for longer than that period.  The control: the
    # change below is one the operator reports.
    consistently(lambda: len(_events(cluster, namespace, DESIRED_ABOVE_MAX)) == 1
                 and _condition(cluster, namespace, "big") == ("True", DESIRED_ABOVE_MAX),
                 outlasting(OWNER_REFRESH), "a second DesiredMismatch Event")
    # The size fits again: the condition clears.
    patch_job(cluster.client, namespace, "big", parallelism=4, completions=4)
    for i in (4, 5):
        pods.delete(f"big-{i}")
    wait_for(lambda: _condition(cluster, namespace, "big") == ("False", DESIRED_FITS), 10,
             "the condition to clear")
    # The size clears the condition; each deleted pod leaves `coming` as its own event is
    # seen, which may be a reconcile later.
    _until_desired(cluster, namespace, "big", (4, "Job/big", 4))
    assert len(_events(cluster, namespace, DESIRED_ABOVE_MAX)) == 1


def test_a_statefulsets_replicas_and_pods_of_two_owners(
        operator: OperatorProcess, cluster: Cluster, namespace: str, pods: Kubelet) -> None:
    _create_run(cluster, namespace, "sts", 1, 4)
    sts = create_statefulset(cluster.client, namespace, "sts", "sts", replicas=3)
    for i in range(3):
        create_owned_pod(pods, f"sts-{i}", "sts", sts, running=i == 0)
    _until_desired(cluster, namespace, "sts", (3, "StatefulSet/sts", 3))
    # A pod of another workload in the same run: no size is followed, and the condition says why.
    job = create_job(cluster.client, namespace, "other", "sts", parallelism=1)
    create_owned_pod(pods, "other-0", "sts", job)
    _until_desired(cluster, namespace, "sts", None)
    wait_for(lambda: _condition(cluster, namespace, "sts") == ("True", SEVERAL_OWNERS), 10,
             "the SeveralOwners condition")
    wait_for(lambda: _events(cluster, namespace, SEVERAL_OWNERS), 10, "its Warning Event")
    assert "Job/other, StatefulSet/sts" in _events(cluster, namespace, SEVERAL_OWNERS)[0]
    pods.delete("other-0")
    _until_desired(cluster, namespace, "sts", (3, "StatefulSet/sts", 3))


# --------------------------------------------------------------------------- JobSet, TrainJob


def _addon_crd(module: str, relative: str) -> Path:
    if shutil.which("go") is None:
        pytest.skip("go is not installed: the add-on CRDs come from the Go module cache")
    from controlplane import addons

    try:
        path = addons.module_path(module) / relative
    except Exception as exc:
        pytest.skip(f"{module} is not in the Go module cache ({exc}): run make addons")
    if not path.exists():
        pytest.skip(f"{path} is missing")
    return path


@pytest.fixture(scope="module")
def launcher_crds(cluster: Cluster) -> None:
    """The JobSet and TrainJob CRDs (served, no controllers)."""
    from controlplane import addons

    files = [_addon_crd(addons.JOBSET.module, "charts/jobset/crds/jobset.x-k8s.io_jobsets.yaml"),
             _addon_crd(addons.TRAINER.module,
                        "manifests/base/crds/trainer.kubeflow.org_trainjobs.yaml")]
    for path in files:
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                    "crd/jobsets.jobset.x-k8s.io", "crd/trainjobs.trainer.kubeflow.org")

    def served() -> bool:
        return cluster.kubectl("get", "jobsets,trainjobs", "-A", check=False).returncode == 0

    wait_for(served, 30, "jobsets and trainjobs to be served")


def _owned_by(owner: dict[str, Any]) -> list[dict[str, Any]]:
    meta = owner["metadata"]
    return [{"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": meta["name"],
             "uid": meta["uid"], "controller": True}]


def _trainjob_chain(cluster: Cluster, namespace: str, pods: Kubelet, name: str,
                    trainer: dict[str, Any]) -> None:
    """A TrainJob, its JobSet (1 x parallelism 2), the JobSet's Job and its 2 pods, as
    Trainer, JobSet and the Job controller would make them, all in run ``name``."""
    client = cluster.client
    _create_run(cluster, namespace, name, 1, 8)
    trainjob = client.request(
        "POST", f"/apis/trainer.kubeflow.org/v1alpha1/namespaces/{namespace}/trainjobs",
        body={"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
              "metadata": {"name": name},
              "spec": {"runtimeRef": {"name": "torch-distributed"}, "trainer": trainer}})
    replicated = {"name": "node", "replicas": 1,
                  "template": {"spec": {"parallelism": 2, "completions": 2, "template": {
                      "spec": {"restartPolicy": "Never", "containers": [
                          {"name": "node", "image": "trainer:latest"}]}}}}}
    jobset = client.request(
        "POST", f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{namespace}/jobsets",
        body={"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
              "metadata": {"name": name, "ownerReferences": _owned_by(trainjob)},
              "spec": {"replicatedJobs": [replicated]}})
    job = create_job(client, namespace, f"{name}-node-0", name, parallelism=2)
    job = client.request("PATCH", f"/apis/batch/v1/namespaces/{namespace}/jobs/{name}-node-0",
                         body={"metadata": {"ownerReferences": _owned_by(jobset)}},
                         content_type="application/merge-patch+json")
    for i in range(2):
        create_owned_pod(pods, f"{name}-node-0-{i}", name, job)


def test_a_trainjob_over_a_jobset_over_jobs_gives_the_outermost_size(
        launcher_crds: None, operator: OperatorProcess, cluster: Cluster, namespace: str,
        pods: Kubelet) -> None:
    _trainjob_chain(cluster, namespace, pods, "tj", {"numNodes": 3})
    _until_desired(cluster, namespace, "tj", (3, "TrainJob/tj", 2))
    # Without numNodes the runtime's count is what Trainer put in the JobSet: the JobSet says.
    _trainjob_chain(cluster, namespace, pods, "rt", {})
    _until_desired(cluster, namespace, "rt", (2, "JobSet/rt", 2))


# --------------------------------------------------------------------------- forged owners


def test_a_pod_with_forged_owner_references_does_not_resize_another_run(
        operator: OperatorProcess, cluster: Cluster, namespace: str, pods: Kubelet,
        tmp_path: Path) -> None:
    """A user who may create pods and read Jobs (a real token) adds a pod to run "victim"
    naming another run's Job, by its real uid, as its controller: the victim's size stays."""
    _create_run(cluster, namespace, "victim", 2, 4)
    victim = create_job(cluster.client, namespace, "victim", "victim", parallelism=2)
    for name in ("victim-0", "victim-1"):
        create_owned_pod(pods, name, "victim", victim)
    other = create_job(cluster.client, namespace, "big", "other-run", parallelism=7)
    _until_desired(cluster, namespace, "victim", (2, "Job/victim", 2))
    attacker = account_client(cluster, namespace, "pod-maker", [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "get"]},
        {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["get"]}], tmp_path)
    try:
        read = attacker.request("GET", f"/apis/batch/v1/namespaces/{namespace}/jobs/big")
        assert read["metadata"]["uid"] == other["metadata"]["uid"]
        forged = {"apiVersion": "batch/v1", "kind": "Job", "name": "big",
                  "uid": read["metadata"]["uid"], "controller": True}
        attacker.request("POST", f"/api/v1/namespaces/{namespace}/pods", body={
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "forged-0", "labels": {crd.RUN_LABEL: "victim"},
                         "ownerReferences": [forged]},
            "spec": {"schedulerName": UNSCHEDULED,
                     "containers": [{"name": "trainer", "image": "trainer:latest"}]}})
    finally:
        attacker.close()
    # A genuine pod of the victim's Job after the forged one (one watch, in order): once
    # the status moves, the operator has looked at both.
    create_owned_pod(pods, "victim-2", "victim", victim, gated=True)
    wait_for(lambda: _desired(cluster, namespace, "victim") != (2, "Job/victim", 2), 10,
             "the operator to see the pods")
    assert _desired(cluster, namespace, "victim") == (2, "Job/victim", 3)
    assert "names Job/big as its controller" in operator.log_tail(200)
    assert _condition(cluster, namespace, "victim") is None
    assert _events(cluster, namespace, SEVERAL_OWNERS) == []

