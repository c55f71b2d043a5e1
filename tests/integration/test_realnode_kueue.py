"""Kueue v0.19.0 on the real node: admission, quota, elastic Jobs, and a run that follows them.

Kueue's own controller (controlplane.addons, ``CLUSTER_ADDONS=kueue``) admits
Jobs from a LocalQueue of the test bed's ClusterQueue (CPU quota
``KUEUE_CPU_QUOTA``).  The smoke tests run ``sleep`` pods and assert on the
Workload objects and the pods; the end-to-end test runs the recipe
``deploy/integrations/kueue-elastic-job.yaml`` (an elastic Indexed Job, run
``2:4``) with ``deploy/examples/train.py``, resizes it 2 -> 4 -> 3 through
Kueue, and asserts the rounds, the restarts and the Job's end.  Times are
printed; outcomes and bounds that separate following the desired size from
waiting the last call are asserted, not speed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import Cluster, consistently, wait_for
from controlplane import addons, localize
from nodekit import (
    INTEGRATIONS,
    TRAINING,
    condition,
    create_run,
    elastic_run,
    logs,
    pods_of,
    round_with,
    with_args,
)
from rdzv import read_run
from timings import RECONCILES

pytest_plugins = ("nodefixtures",)
pytestmark = [pytest.mark.node, pytest.mark.addons, pytest.mark.slow]

RECIPE = INTEGRATIONS / "kueue-elastic-job.yaml"
#: The LocalQueue the recipe names, made in each test's namespace.
QUEUE = "user-queue"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
ELASTIC = "kueue.x-k8s.io/elastic-job"
#: The scheduling gate of the pods of an elastic Job's slice not yet admitted.
GATE = "kueue.x-k8s.io/elastic-job"
INDEX = "batch.kubernetes.io/job-completion-index"
WORKLOADS = "/apis/kueue.x-k8s.io/v1beta2/namespaces/{ns}/workloads"
JOB = "/apis/batch/v1/namespaces/{ns}/jobs/{name}"
#: The end-to-end run's last call: long, so that a round sealed by the desired
#: size (seconds) and one sealed by the last call cannot be mistaken.
LAST_CALL = 20
#: 4th join -> round of 4, and pod deletion -> round of 3: bounds well under LAST_CALL.
SCALE_UP_BOUND = 6.0
SCALE_DOWN_BOUND = 6.0


@pytest.fixture
def queue_namespace(kueue_cluster: Cluster, node_namespace: str) -> Iterator[str]:
    """A node namespace with the LocalQueue ``user-queue`` of the test bed's ClusterQueue."""
    kueue_cluster.kubectl("apply", "--server-side", "-f", "-",
                          input=yaml.safe_dump(addons.local_queue(node_namespace, QUEUE)))
    yield node_namespace


def sleeper(name: str, pods: int, cpu: str, volumes: Path, *, elastic: bool = False
            ) -> dict[str, Any]:
    """A queued Job of ``pods`` sleeping pods requesting ``cpu`` each, suspended until admitted."""
    job: dict[str, Any] = {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": name, "labels": {QUEUE_LABEL: QUEUE},
                     "annotations": {ELASTIC: "true"} if elastic else {}},
        "spec": {"suspend": True, "parallelism": pods, "backoffLimit": 0, "template": {"spec": {
            "restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "sleep", "image": "local", "command": ["sleep", "600"]}]}}}}
    (doc,) = localize.localize([job], volumes)
    doc["spec"]["template"]["spec"]["containers"][0]["resources"] = {"requests": {"cpu": cpu}}
    return doc


def create_job(cluster: Cluster, namespace: str, job: dict[str, Any]) -> dict[str, Any]:
    created: dict[str, Any] = cluster.client.request(
        "POST", f"/apis/batch/v1/namespaces/{namespace}/jobs", body=job)
    return created


def get_job(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    job: dict[str, Any] = cluster.client.request("GET", JOB.format(ns=namespace, name=name))
    return job


def resize(cluster: Cluster, namespace: str, name: str, *, parallelism: int,
           completions: int | None = None) -> None:
    spec: dict[str, int] = {"parallelism": parallelism}
    if completions is not None:
        spec["completions"] = completions
    cluster.client.request("PATCH", JOB.format(ns=namespace, name=name), body={"spec": spec},
                           content_type="application/merge-patch+json")


def workloads_of(cluster: Cluster, namespace: str, job: str) -> list[dict[str, Any]]:
    """The Job's Workload objects (its slices, for an elastic Job), oldest first."""
    items = cluster.client.request("GET", WORKLOADS.format(ns=namespace))["items"]
    mine = [w for w in items if any(o.get("kind") == "Job" and o.get("name") == job
                                    for o in w["metadata"].get("ownerReferences") or [])]
    return sorted(mine, key=lambda w: (w["metadata"]["creationTimestamp"], w["metadata"]["name"]))


def cond(obj: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in (obj.get("status") or {}).get("conditions") or []
                 if c.get("type") == kind), None)


def admitted(workload: dict[str, Any]) -> bool:
    return condition(workload, "Admitted")


def pod_count(workload: dict[str, Any]) -> int:
    return sum(int(ps["count"]) for ps in workload["spec"]["podSets"])


def gates(pod: dict[str, Any]) -> list[str]:
    return [g["name"] for g in pod["spec"].get("schedulingGates") or []]


def live_pods(cluster: Cluster, namespace: str, job: str) -> list[dict[str, Any]]:
    return [p for p in pods_of(cluster, namespace, f"batch.kubernetes.io/job-name={job}")
            if not p["metadata"].get("deletionTimestamp")]


# --------------------------------------------------------------------------- smoke tests


def test_kueue_admits_a_queued_job_and_holds_one_above_the_quota(
        kueue_cluster: Cluster, queue_namespace: str, tmp_path: Path) -> None:
    cluster, ns = kueue_cluster, queue_namespace
    create_job(cluster, ns, sleeper("small", 1, "200m", tmp_path))
    create_job(cluster, ns, sleeper("big", 1, "2", tmp_path))  # above the quota of 1 CPU
    wait_for(lambda: get_job(cluster, ns, "small")["spec"].get("suspend") is False, 60,
             "Kueue to unsuspend the small Job", interval=0.2)
    (small,) = wait_for(lambda: [w for w in workloads_of(cluster, ns, "small") if admitted(w)],
                        30, "the small Job's admitted Workload", interval=0.2)
    assert small["status"]["admission"]["clusterQueue"] == addons.KUEUE_CLUSTER_QUEUE
    assert small["spec"]["queueName"] == QUEUE and pod_count(small) == 1
    wait_for(lambda: len(live_pods(cluster, ns, "small")) == 1, 60, "the small Job's pod")

    def pending() -> dict[str, Any] | None:
        found = workloads_of(cluster, ns, "big")
        reserved = cond(found[0], "QuotaReserved") if found else None
        return found[0] if reserved and reserved["status"] == "False" else None

    big = wait_for(pending, 60, "the big Job's Workload to be evaluated", interval=0.2)
    message = cond(big, "QuotaReserved")["message"]  # type: ignore[index]
    print(f"\nbig Job's Workload: {message}")
    assert "insufficient quota for cpu" in message and addons.KUEUE_FLAVOR in message, message
    assert not admitted(big)
    job = get_job(cluster, ns, "big")
    assert job["spec"]["suspend"] is True
    assert pods_of(cluster, ns, "batch.kubernetes.io/job-name=big") == []


def test_an_elastic_jobs_new_pods_wait_behind_the_gate_until_their_slice_is_admitted(
        kueue_cluster: Cluster, queue_namespace: str, tmp_path: Path) -> None:
    """2 pods of 250m and a 500m blocker fill the quota; scaled to 4, the new pods are
    gated while the new slice is pending, and ungated once the blocker is gone."""
    cluster, ns = kueue_cluster, queue_namespace
    create_job(cluster, ns, sleeper("elastic", 2, "250m", tmp_path, elastic=True))
    wait_for(lambda: [w for w in workloads_of(cluster, ns, "elastic") if admitted(w)], 60,
             "the elastic Job's admitted Workload", interval=0.2)
    create_job(cluster, ns, sleeper("blocker", 1, "500m", tmp_path))
    wait_for(lambda: [w for w in workloads_of(cluster, ns, "blocker") if admitted(w)], 60,
             "the blocker's admitted Workload", interval=0.2)
    template = get_job(cluster, ns, "elastic")["spec"]["template"]["spec"]
    assert GATE in gates({"spec": template}), template.get("schedulingGates")
    first = wait_for(lambda: (pods := live_pods(cluster, ns, "elastic")) and len(pods) == 2
                     and not any(gates(p) for p in pods) and pods, 60,
                     "the first two pods, ungated", interval=0.2)
    old = {p["metadata"]["name"] for p in first}

    resize(cluster, ns, "elastic", parallelism=4)

    def new_gated() -> list[dict[str, Any]] | None:
        pods = live_pods(cluster, ns, "elastic")
        new = [p for p in pods if p["metadata"]["name"] not in old]
        return new if len(new) == 2 and all(gates(p) == [GATE] for p in new) else None

    new = wait_for(new_gated, 60, "two new pods behind the gate", interval=0.2)

    def slice_pending() -> list[dict[str, Any]] | None:
        found = workloads_of(cluster, ns, "elastic")
        reserved = cond(found[-1], "QuotaReserved") if len(found) == 2 else None
        return found if reserved and reserved["status"] == "False" else None

    slices = wait_for(slice_pending, 60, "the new slice to be pending on quota", interval=0.2)
    assert [pod_count(w) for w in slices] == [2, 4] and admitted(slices[0])
    # Nothing lifts the gate while the quota is held (the control follows: freeing the
    # quota lifts it).
    consistently(lambda: all(gates(p) == [GATE] for p in live_pods(cluster, ns, "elastic")
                             if p["metadata"]["name"] not in old),
                 RECONCILES, "a gate lifted while the quota is held", interval=0.2)

    cluster.client.request("DELETE", JOB.format(ns=ns, name="blocker"),
                           query={"propagationPolicy": "Background"})

    def ungated() -> list[dict[str, Any]] | None:
        pods = live_pods(cluster, ns, "elastic")
        return pods if len(pods) == 4 and not any(gates(p) for p in pods) else None

    pods = wait_for(ungated, 60, "Kueue to lift the gates of the new slice", interval=0.2)
    assert {p["metadata"]["name"] for p in pods} == old | {p["metadata"]["name"] for p in new}
    slices = workloads_of(cluster, ns, "elastic")
    live = [w for w in slices if not condition(w, "Finished")]
    assert [pod_count(w) for w in live] == [4] and admitted(live[0]), [
        (w["metadata"]["name"], (w.get("status") or {}).get("conditions")) for w in slices]
    assert any(pod_count(w) == 2 and condition(w, "Finished") for w in slices)


def test_the_kueue_recipe_is_accepted_and_gated_by_kueues_webhook(
        kueue_cluster: Cluster, queue_namespace: str) -> None:
    """deploy/integrations/kueue-elastic-job.yaml as written, through Kueue's webhooks."""
    cluster, ns = kueue_cluster, queue_namespace
    dry = cluster.kubectl("apply", "--dry-run=server", "-n", ns, "-f", str(RECIPE),
                          "-o", "yaml", check=False)
    assert dry.returncode == 0, dry.stderr
    listed = yaml.safe_load(dry.stdout)
    (job,) = [d for d in listed.get("items") or [listed] if d["kind"] == "Job"]
    assert job["metadata"]["annotations"][ELASTIC] == "true"
    assert GATE in gates({"spec": job["spec"]["template"]["spec"]})


# --------------------------------------------------------------------------- end to end


def apply_recipe(cluster: Cluster, namespace: str, args: list[str]) -> dict[str, Any]:
    """The recipe, localized like the other integrations, its CPU request kept for Kueue."""
    volumes = Path(cluster.require_local().dir) / "node" / "volumes" / namespace
    (original,) = [d for d in localize.load(RECIPE) if d["kind"] == "Job"]
    (job,) = localize.localize([original], volumes)  # the claim becomes a host directory
    container = job["spec"]["template"]["spec"]["containers"][0]
    container["command"] = with_args(container["command"], args)
    container["resources"] = original["spec"]["template"]["spec"]["containers"][0]["resources"]
    return create_job(cluster, namespace, job)


def worker_starts(cluster: Cluster, namespace: str, pod: str) -> int:
    """train.py's ``starting at epoch`` lines of a pod: one per start of its worker (torch's
    ``TORCHELASTIC_RESTART_COUNT`` counts failures only, not membership restarts)."""
    return logs(cluster, namespace, pod).count("starting at epoch")


def trained_in(cluster: Cluster, namespace: str, pod: str, world: int) -> bool:
    return f"/{world} epoch" in logs(cluster, namespace, pod)


def scale_up(cluster: Cluster, namespace: str, run: str, first: Any) -> tuple[Any, set[str]]:
    """2 -> 4: Kueue admits the new slice, its gates lift, one round of 4; returns it and
    the new members."""
    old = {p.name for p in first.status.participants}
    resize(cluster, namespace, run, parallelism=4, completions=4)
    four = wait_for(lambda: (pods := live_pods(cluster, namespace, run)) and len(pods) == 4
                    and not any(gates(p) for p in pods) and pods, 120,
                    "the 4 pods, ungated", interval=0.2)
    slices = [w for w in workloads_of(cluster, namespace, run) if not condition(w, "Finished")]
    assert [pod_count(w) for w in slices] == [4] and admitted(slices[0])
    second = wait_for(lambda: round_with(cluster, namespace, run, 4, after=first.status.round),
                      180, "a round of 4", interval=0.05)
    assert second.status.sealed_at
    fourth_join = max(p.since for p in second.status.participants if p.since)
    up = (second.status.sealed_at - fourth_join).total_seconds()
    newest = max(p.since for p in second.status.participants if p.name not in old and p.since)
    print(f"{run}: 4th join -> round {second.status.round} of 4 after {up:.2f}s "
          f"(rounds {first.status.round} -> {second.status.round}; the last new node joined "
          f"{(second.status.sealed_at - newest).total_seconds():.2f}s before it)")
    assert sorted(p.rank for p in second.status.participants) == [0, 1, 2, 3]
    names = {p["metadata"]["name"] for p in four}
    assert {p.name for p in second.status.participants} == names
    new = names - old
    wait_for(lambda: all(trained_in(cluster, namespace, pod, 4) for pod in names), 180,
             "training in the world of 4", interval=1)
    # Exactly one restart of the two old members (two worker starts); the new ones started once.
    starts = {pod: worker_starts(cluster, namespace, pod) for pod in names}
    print(f"{run}: worker starts per pod {starts}")
    assert starts == {pod: 2 if pod in old else 1 for pod in names}, starts
    assert up < SCALE_UP_BOUND, f"the round of 4 was sealed {up:.2f}s after the 4th join"
    return second, new


def scale_down(cluster: Cluster, namespace: str, run: str, second: Any) -> None:
    """4 -> 3: the Job controller deletes the pod of index 3, a round of 3 forms."""
    pods = live_pods(cluster, namespace, run)
    (victim,) = [p["metadata"]["name"] for p in pods if p["metadata"]["annotations"][INDEX] == "3"]
    resize(cluster, namespace, run, parallelism=3, completions=3)

    def deleting() -> float | None:
        pods = {p["metadata"]["name"]: p for p in pods_of(
            cluster, namespace, f"batch.kubernetes.io/job-name={run}")}
        pod = pods.get(victim)
        return time.time() if pod is None or pod["metadata"].get("deletionTimestamp") else None

    deleted_at = wait_for(deleting, 60, f"the Job controller to delete {victim}", interval=0.05)
    third = wait_for(lambda: round_with(cluster, namespace, run, 3, after=second.status.round,
                                        without=victim), 120, "a round of 3", interval=0.05)
    assert third.status.sealed_at
    down = third.status.sealed_at.timestamp() - deleted_at
    print(f"{run}: pod {victim} deleted -> round {third.status.round} of 3 after {down:.2f}s")
    assert sorted(p.rank for p in third.status.participants) == [0, 1, 2]
    assert down < SCALE_DOWN_BOUND, f"the round of 3 was sealed {down:.2f}s after the deletion"
    wait_for(lambda: [pod_count(w) for w in workloads_of(cluster, namespace, run)
                      if not condition(w, "Finished")] == [3], 60,
             "Kueue's workload to shrink to 3")


@pytest.mark.timeout(900)
def test_a_kueue_elastic_job_resized_2_4_3_costs_one_round_each(
        kueue_cluster: Cluster, queue_namespace: str) -> None:
    cluster, ns, run = kueue_cluster, queue_namespace, "llama-kq"
    body = elastic_run(run, 2, 4)
    body["spec"]["lastCallTimeoutSeconds"] = LAST_CALL
    create_run(cluster, ns, body)
    apply_recipe(cluster, ns, TRAINING)

    first = wait_for(lambda: round_with(cluster, ns, run, 2), 240, "a round of 2",
                     interval=0.1)
    joined = max(p.since for p in first.status.participants if p.since)
    assert first.status.sealed_at
    formed = (first.status.sealed_at - joined).total_seconds()
    print(f"\n{run}: 2nd join -> round {first.status.round} of 2 after {formed:.2f}s")
    # The Job's parallelism says 2 are coming: no last-call wait for more.
    assert formed < SCALE_UP_BOUND, f"the round of 2 was sealed {formed:.2f}s after the 2nd join"
    rank0 = first.status.participants[0].name
    wait_for(lambda: "epoch 3 done" in logs(cluster, ns, rank0), 180,
             "training in the round of 2", interval=1)
    second, _ = scale_up(cluster, ns, run, first)
    scale_down(cluster, ns, run, second)

    def finished() -> dict[str, Any] | None:
        job = get_job(cluster, ns, run)
        return job if condition(job, "Complete") or condition(job, "Failed") else None

    job = wait_for(finished, 600, "the Job to finish", interval=1)
    status = job["status"]
    print(f"{run}: Job {[c['type'] for c in status['conditions'] if c['status'] == 'True']}, "
          f"succeeded {status.get('succeeded')}, failed {status.get('failed', 0)}")
    assert condition(job, "Complete"), status
    assert (status.get("succeeded"), status.get("failed", 0)) == (3, 0), status
    phases = {p["metadata"]["name"]: p["status"].get("phase")
              for p in pods_of(cluster, ns, f"batch.kubernetes.io/job-name={run}")}
    assert "Failed" not in phases.values(), phases
    assert read_run(cluster.client, ns, run).status.phase == "Succeeded"
