"""JobSet and Kubeflow Trainer on the real node: a deleted pod is replaced, nobody restarts.

The real controllers (JobSet v0.12.0, Trainer v2.3.0, controlplane.addons) make
the Jobs and pods from the manifests in ``deploy/integrations/`` as
docs/integrations.md gives them (localized for this node like the examples);
the chart's operator removes the deleted member, the survivors re-form without
it, and the replacement the Job controller creates joins the next round.  The
same TrainJob on Trainer's own ``torch-distributed`` runtime, with the same
deletion, is the comparison docs/integrations.md puts beside it.
Times are printed; outcomes are asserted.
"""

from __future__ import annotations

import math
import re
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from elasticrun.operator.reconcile import DESIRED_ABOVE_MAX, DESIRED_CONDITION

from chartkit import Helm, build_helm
from conftest import ROOT, Cluster, consistently, wait_for
from controlplane import addons, localize
from controlplane.node import NODE_IP
from nodekit import (
    INTEGRATIONS,
    RELEASE,
    RELEASE_NAMESPACE,
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
from timings import outlasting

pytest_plugins = ("nodefixtures",)
pytestmark = [pytest.mark.node, pytest.mark.slow]

def apply_integration(cluster: Cluster, namespace: str, path: Path,
                      args: list[str]) -> list[dict[str, Any]]:
    """Apply a recipe of docs/integrations.md as a user would, adapted to the local node."""
    volumes = Path(cluster.require_local().dir) / "node" / "volumes" / namespace
    docs = localize.localize(localize.load(path), volumes)
    for doc in docs:
        if doc["kind"] == "TrainJob":
            doc["spec"]["trainer"]["command"] = with_args(doc["spec"]["trainer"]["command"], args)
        for spec in localize.pod_specs(doc):
            spec["containers"][0]["command"] = with_args(spec["containers"][0]["command"], args)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump_all(docs))
    return docs


def install_runtime(cluster: Cluster, tmp_path: Path) -> None:
    """The chart's ClusterTrainingRuntime (trainingRuntime.enabled), localized."""
    (tmp_path / "helm").mkdir()
    helm = Helm(build_helm(), tmp_path / "helm")
    docs = [d for d in helm.template(RELEASE, RELEASE_NAMESPACE,
                                     {"trainingRuntime": {"enabled": True}})
            if d["kind"] == "ClusterTrainingRuntime"]
    assert [d["metadata"]["name"] for d in docs] == ["torch-elastic-k8s"]
    local = localize.localize(docs, tmp_path / "volumes")
    cluster.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump_all(local))


def pod_identity(cluster: Cluster, namespace: str, selector: str) -> dict[str, tuple[str, int]]:
    return {p["metadata"]["name"]: (p["metadata"]["uid"], sum(
        c.get("restartCount", 0) for c in (p.get("status") or {}).get("containerStatuses") or []))
        for p in pods_of(cluster, namespace, selector)}


def lose_one_and_replace(cluster: Cluster, namespace: str, run: str, selector: str
                         ) -> tuple[str, dict[str, tuple[str, int]], float]:
    """Round of 3; delete a pod; round of 2; the replacement makes a round of 3 again.

    Returns the deleted pod's name, the survivors' (UID, restart count) and the
    wall-clock time of the deletion (for :func:`training_resumed`)."""
    first = wait_for(lambda: round_with(cluster, namespace, run, 3), 240,
                     "the three pods in one round", interval=0.5)
    rank0 = first.status.participants[0].name
    wait_for(lambda: "epoch 3 done" in logs(cluster, namespace, rank0), 180,
             "training to be under way", interval=1)
    victim = max(first.status.participants, key=lambda p: p.rank).name
    before = pod_identity(cluster, namespace, selector)
    survivors = {name: ident for name, ident in before.items() if name != victim}
    assert len(survivors) == 2, before
    deleted, deleted_at = time.monotonic(), time.time()
    cluster.kubectl("delete", "pod", "-n", namespace, victim, "--wait=false")
    second = wait_for(lambda: round_with(cluster, namespace, run, 2, after=first.status.round,
                                         without=victim), 60,
                      "a round of the two survivors", interval=0.05)
    took = time.monotonic() - deleted
    print(f"\n{run}: pod {victim} deleted -> round {second.status.round} of 2 after {took:.2f}s")
    assert set(second.status.member_names) == set(survivors)
    assert took < 5.0, f"the survivors re-formed only after {took:.2f}s"
    third = wait_for(lambda: round_with(cluster, namespace, run, 3, after=second.status.round,
                                        without=victim), 240,
                     "the replacement pod in a round of 3", interval=0.1)
    newcomer = set(third.status.member_names) - set(survivors)
    print(f"{run}: replacement {sorted(newcomer)} joined round {third.status.round} "
          f"{time.monotonic() - deleted:.2f}s after the deletion")
    return victim, survivors, deleted_at


#: train.py's lines: a worker starting (after a restart too), and an epoch it finished.
WORKER_STARTED = "starting at epoch"
EPOCH_DONE = re.compile(r" rank \d+/(\d+) epoch \d+ done")
#: The container runtime's RFC 3339 time of a log line (nanoseconds, UTC).
LOG_STAMP = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?Z")


def training_resumed(cluster: Cluster, namespace: str, selector: str,
                     since: float) -> dict[int, float]:
    """Seconds from ``since`` until a worker started after it finished an epoch, per world size.

    Read from the pods' current containers (``kubectl logs --timestamps``: the
    runtime's time of each line), so polling adds nothing to it.  Lines of a
    worker that was already running at ``since`` do not count: training has
    resumed when a worker of the new world (an elastic restart, a restarted
    container or a replacement pod) has completed an epoch.
    """
    start = datetime.fromtimestamp(math.floor(since) - 1, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    first: dict[int, float] = {}
    for pod in pods_of(cluster, namespace, selector):
        out = cluster.kubectl("logs", "-n", namespace, pod["metadata"]["name"], "--timestamps",
                              f"--since-time={start}", check=False).stdout
        started = False
        for line in out.splitlines():
            stamp, _, text = line.partition(" ")
            parsed = LOG_STAMP.fullmatch(stamp)
            if parsed is None:
                continue
            at = datetime.fromisoformat(parsed.group(1)).replace(tzinfo=UTC).timestamp() + float(
                f"0.{parsed.group(2) or 0}")
            if at < since:
                continue
            if WORKER_STARTED in text:
                started = True
            elif started and (done := EPOCH_DONE.search(text)):
                world = int(done.group(1))
                first[world] = min(first.get(world, math.inf), at - since)
    return first


@pytest.mark.addons
def test_a_jobset_replaces_a_deleted_pod_without_restarting_the_others(
        addons_cluster: Cluster, node_namespace: str) -> None:
    cluster, ns, run = addons_cluster, node_namespace, "llama-js"
    create_run(cluster, ns, elastic_run(run, 2, 3))
    apply_integration(cluster, ns, INTEGRATIONS / "jobset.yaml", TRAINING)
    selector = f"jobset.sigs.k8s.io/jobset-name={run}"
    victim, survivors, _ = lose_one_and_replace(cluster, ns, run, selector)
    path = f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{ns}/jobsets/{run}"
    wait_for(lambda: condition(cluster.client.request("GET", path), "Completed"), 400,
             "the JobSet to complete", interval=1)
    done = cluster.client.request("GET", path)
    assert (done["status"].get("restarts") or 0) == 0
    after = pod_identity(cluster, ns, selector)
    assert {name: after[name] for name in survivors} == survivors
    assert victim not in after
    assert read_run(cluster.client, ns, run).status.phase == "Succeeded"


@pytest.mark.addons
def test_a_trainjob_on_the_chart_runtime_replaces_a_deleted_node(
        addons_cluster: Cluster, node_namespace: str, tmp_path: Path) -> None:
    cluster, ns, run = addons_cluster, node_namespace, "llama-tj"
    install_runtime(cluster, tmp_path)
    create_run(cluster, ns, elastic_run(run, 2, 3))
    apply_integration(cluster, ns, INTEGRATIONS / "trainjob.yaml", TRAINING)
    selector = f"jobset.sigs.k8s.io/jobset-name={run}"
    _, survivors, deleted_at = lose_one_and_replace(cluster, ns, run, selector)
    pod = cluster.client.request("GET", f"/api/v1/namespaces/{ns}/pods/{next(iter(survivors))}")
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert (env["PET_NNODES"], env["PET_RDZV_BACKEND"], env["PET_RDZV_ID"]) == ("2:3", "k8s", run)
    assert pod["metadata"]["labels"]["elasticrun.dev/run"] == run
    path = f"/apis/trainer.kubeflow.org/v1alpha1/namespaces/{ns}/trainjobs/{run}"
    wait_for(lambda: condition(cluster.client.request("GET", path), "Complete"), 400,
             "the TrainJob to complete", interval=1)
    jobset = cluster.client.request(
        "GET", f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{ns}/jobsets/{run}")
    assert (jobset["status"].get("restarts") or 0) == 0
    after = pod_identity(cluster, ns, selector)
    assert {name: after[name] for name in survivors} == survivors
    assert read_run(cluster.client, ns, run).status.phase == "Succeeded"
    # Measured as for the stock runtime below (docs/integrations.md, side by side).
    resumed = training_resumed(cluster, ns, selector, deleted_at)
    print(f"{run}: training resumed {fmt_resumed(resumed)} after the deletion")
    assert set(resumed) == {2, 3} and resumed[2] < resumed[3], resumed


def fmt_resumed(resumed: dict[int, float]) -> str:
    return ", ".join(f"in a world of {w} {s:.2f}s" for w, s in sorted(resumed.items()))


def install_stock_runtime(cluster: Cluster, tmp_path: Path, trainjob: str) -> None:
    """Trainer v2.3.0's own ``torch-distributed`` runtime, from the module, localized.

    As the module ships it (``manifests/base/runtimes/torch_distributed.yaml``),
    with what this node needs: :func:`localize.localize` (the local image and its
    host mounts, ``hostNetwork``), and, since there is no cluster DNS here, the
    master address Trainer gives every node (``<trainjob>-node-0-0.<trainjob>``,
    pod 0 behind JobSet's headless Service) as a host alias for the node's
    address, which is pod 0's address under ``hostNetwork``.
    """
    source = (addons.module_path(addons.TRAINER.module) / "manifests" / "base" / "runtimes"
              / "torch_distributed.yaml")
    docs = localize.localize(localize.load(source), tmp_path / "volumes")
    assert [d["metadata"]["name"] for d in docs] == [STOCK_RUNTIME]
    for spec in localize.pod_specs(docs[0]):
        spec["hostAliases"] = [{"ip": NODE_IP,
                                "hostnames": [f"{trainjob}-node-0-0.{trainjob}"]}]
    cluster.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump_all(docs))


STOCK_RUNTIME = "torch-distributed"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"


@pytest.mark.addons
def test_the_same_trainjob_on_the_stock_torch_runtime_restarts_its_nodes(
        addons_cluster: Cluster, node_namespace: str, tmp_path: Path) -> None:
    """deploy/integrations/trainjob.yaml with ``runtimeRef: torch-distributed``, nothing else
    changed: static rendezvous (the TCPStore on pod 0), JobSet's defaults."""
    cluster, ns, run = addons_cluster, node_namespace, "llama-tj"
    install_stock_runtime(cluster, tmp_path, run)
    docs = localize.load(INTEGRATIONS / "trainjob.yaml")
    for doc in docs:
        if doc["kind"] == "TrainJob":
            doc["spec"]["runtimeRef"]["name"] = STOCK_RUNTIME
    manifest = tmp_path / "trainjob-stock.yaml"
    manifest.write_text(yaml.safe_dump_all(docs))
    apply_integration(cluster, ns, manifest, TRAINING)
    selector = f"jobset.sigs.k8s.io/jobset-name={run}"

    def by_index() -> dict[str, str] | None:
        pods = pods_of(cluster, ns, selector)
        if len(pods) != 3 or any((p.get("status") or {}).get("phase") != "Running"
                                 for p in pods):
            return None
        return {p["metadata"]["annotations"][COMPLETION_INDEX]: p["metadata"]["name"]
                for p in pods}

    nodes = wait_for(by_index, 240, "three Running node pods", interval=0.5)
    wait_for(lambda: "rank 0/3 epoch 3 done" in logs(cluster, ns, nodes["0"]), 180,
             "training to be under way", interval=1)
    pod = cluster.client.request("GET", f"/api/v1/namespaces/{ns}/pods/{nodes['0']}")
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert (env["PET_NNODES"], env["PET_MASTER_ADDR"]) == ("3", f"{run}-node-0-0.{run}")
    assert "PET_RDZV_BACKEND" not in env and "elasticrun.dev/run" not in pod["metadata"]["labels"]
    victim = nodes["2"]
    before = pod_identity(cluster, ns, selector)
    survivors = {name: ident for name, ident in before.items() if name != victim}
    deleted_at = time.time()
    cluster.kubectl("delete", "pod", "-n", ns, victim, "--wait=false")
    resumed = wait_for(lambda: (r := training_resumed(cluster, ns, selector, deleted_at))
                       and 3 in r and r, 300, "training to resume in a world of 3",
                       interval=2)
    print(f"\n{run} (stock): pod {victim} deleted -> training resumed "
          f"{fmt_resumed(resumed)} after the deletion")
    path = f"/apis/trainer.kubeflow.org/v1alpha1/namespaces/{ns}/trainjobs/{run}"

    def finished() -> dict[str, Any] | None:
        job: dict[str, Any] = cluster.client.request("GET", path)
        return job if condition(job, "Complete") or condition(job, "Failed") else None

    trainjob = wait_for(finished, 400, "the TrainJob to finish", interval=1)
    jobset = cluster.client.request(
        "GET", f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{ns}/jobsets/{run}")
    job = cluster.client.request("GET", f"/apis/batch/v1/namespaces/{ns}/jobs/{run}-node-0")
    after = pod_identity(cluster, ns, selector)
    print(f"{run} (stock): TrainJob {[c['type'] for c in trainjob['status']['conditions']]}, "
          f"JobSet restarts {jobset['status'].get('restarts') or 0}, Job failed "
          f"{job['status'].get('failed', 0)} of backoffLimit {job['spec'].get('backoffLimit')}, "
          f"survivors { {n: (before[n], after.get(n)) for n in survivors} }, pods now {after}")
    assert condition(trainjob, "Complete"), trainjob["status"]
    assert (jobset["status"].get("restarts") or 0) == 0
    # The deleted pod is the Job's one failure; Kubernetes' default backoffLimit absorbs it.
    assert (job["status"].get("failed", 0), job["spec"].get("backoffLimit")) == (1, 6)
    # Every survivor's container was restarted in its pod (same UID, restartPolicy
    # OnFailure), and training came back only when all three were up again.
    assert {n: after[n][0] for n in survivors} == {n: uid for n, (uid, _) in survivors.items()}
    assert all(after[n][1] > restarts for n, (_, restarts) in survivors.items()), after
    assert victim not in after and len(after) == 3
    assert set(resumed) == {3}, resumed


def test_an_indexed_job_whose_last_index_comes_after_success_ends_complete(
        node_cluster: Cluster, node_namespace: str) -> None:
    """completions 3, parallelism 2, nnodes 2: indexes 0 and 1 train; index 2 starts
    when one of them has finished, finds the run Succeeded and exits 0."""
    cluster, ns, run = node_cluster, node_namespace, "llama-ix"
    apply_integration(cluster, ns, INTEGRATIONS / "indexed-job.yaml",
                      ["--epochs", "100", "--steps-per-epoch", "10"])
    path = f"/apis/batch/v1/namespaces/{ns}/jobs/{run}"

    def finished() -> dict[str, Any] | None:
        job: dict[str, Any] = cluster.client.request("GET", path)
        return job if condition(job, "Complete") or condition(job, "Failed") else None

    job = wait_for(finished, 300, "the Job to finish", interval=1)
    status = job["status"]
    assert condition(job, "Complete"), status
    assert (status.get("succeeded"), status.get("failed", 0)) == (3, 0), status
    final = read_run(cluster.client, ns, run)
    assert final.status.phase == "Succeeded"
    index = "batch.kubernetes.io/job-completion-index"
    pods = pods_of(cluster, ns, f"batch.kubernetes.io/job-name={run}")
    late = [p["metadata"]["name"] for p in pods if p["metadata"]["annotations"].get(index) == "2"]
    assert len(late) == 1 and late[0] not in {m.name for m in final.status.lost_members}, late


# --------------------------------------------------------------------------- the owner's size

RUN_LABEL, NNODES = "elasticrun.dev/run", "elasticrun.dev/nnodes"
#: The first-formation test's last calls: with the Job's size read, long (a round sealed
#: seconds after the 4th join did not wait for it); without, short (the test waits it out).
OWNED_LAST_CALL, UNOWNED_LAST_CALL = 30, 8
#: 4th join -> the round of 4's ``sealedAt``, for the Job whose size the operator reads.
FIRST_ROUND_BOUND = 3.0
#: The over-maxNodes run's last call: its round of 2 is the owner's target's, not minNodes'.
SPARE_LAST_CALL = 12
#: A few epochs: enough to see every member train in its world, over in seconds.
SHORT_TRAINING = ["--epochs", "5", "--steps-per-epoch", "10"]


def training_job(cluster: Cluster, namespace: str, run: str, nnodes: str, pods: int,
                 args: list[str]) -> dict[str, Any]:
    """deploy/examples/job.yaml, localized, as the Job of ``pods`` pods of the run ``run``."""
    volumes = Path(cluster.require_local().dir) / "node" / "volumes" / namespace
    (job,) = localize.localize(
        [d for d in localize.load(ROOT / "deploy" / "examples" / "job.yaml")
         if d["kind"] == "Job"], volumes)
    job["metadata"]["name"] = run
    job["spec"].update(parallelism=pods, completions=pods)
    template = job["spec"]["template"]
    template["metadata"]["labels"][RUN_LABEL] = run
    template["metadata"]["annotations"][NNODES] = nnodes
    # One worker per pod: the workers' world is the round's.
    template["metadata"]["annotations"]["elasticrun.dev/nproc-per-node"] = "1"
    container = template["spec"]["containers"][0]
    container["command"] = with_args(container["command"], args)
    for env in container["env"]:
        if env["name"] == "CHECKPOINT":
            env["value"] = f"/checkpoints/{run}.pt"
    return job


def create_job(cluster: Cluster, namespace: str, job: dict[str, Any]) -> None:
    cluster.client.request("POST", f"/apis/batch/v1/namespaces/{namespace}/jobs", body=job)


def first_round(cluster: Cluster, namespace: str, run: str, timeout: float) -> Any:
    """The run as it was when its first round was sealed (polled every 50 ms)."""
    return wait_for(lambda: (r := read_run(cluster.client, namespace, run)).status.round >= 1
                    and r, timeout, f"the first round of {run}", interval=0.05)


def joins(current: Any) -> list[float]:
    """Seconds from each member's join (``since``) to the round's ``sealedAt``, earliest first."""
    assert current.status.sealed_at is not None
    return sorted((current.status.sealed_at - p.since).total_seconds()
                  for p in current.status.participants if p.since)


def pods_succeeded(cluster: Cluster, namespace: str, selector: str, count: int) -> None:
    """Bounded: ``count`` pods of ``selector``, all ended, none of them failed."""
    def ended() -> dict[str, str] | None:
        phases = {p["metadata"]["name"]: (p.get("status") or {}).get("phase", "")
                  for p in pods_of(cluster, namespace, selector)}
        return phases if len(phases) == count and all(
            ph in ("Succeeded", "Failed") for ph in phases.values()) else None

    phases = wait_for(ended, 180, f"the {count} pods of {selector} to end", interval=1)
    assert set(phases.values()) == {"Succeeded"}, phases


def test_a_job_of_4_forms_its_first_round_at_the_4th_join_and_bare_pods_wait_the_last_call(
        node_cluster: Cluster, node_namespace: str) -> None:
    """Run 2:8.  An Indexed Job of 4 (the operator reads its parallelism): the round of 4
    is sealed at the 4th join, not at the last call (30 s), ranked by completion index.
    The same 4 pods as bare Pods with the run's label (no owner to read): the round waits
    the last call (8 s) after the 2nd join."""
    cluster, ns = node_cluster, node_namespace
    owned, bare = "want4", "bare4"
    body = elastic_run(owned, 2, 8)
    body["spec"]["lastCallTimeoutSeconds"] = OWNED_LAST_CALL
    create_run(cluster, ns, body)
    indexed = training_job(cluster, ns, owned, "2:8", 4, SHORT_TRAINING)
    indexed["spec"]["completionMode"] = "Indexed"
    create_job(cluster, ns, indexed)
    formed = first_round(cluster, ns, owned, 180)
    assert formed.status.desired is not None and formed.status.desired.source == f"Job/{owned}"
    assert formed.status.desired.size == 4
    waited = joins(formed)
    print(f"\n{owned}: run 2:8, Job of 4, last call {OWNED_LAST_CALL}s: 4th join -> round "
          f"{formed.status.round} of {len(formed.status.participants)} after {waited[0]:.2f}s "
          f"(2nd join -> seal {waited[-2]:.2f}s)")
    assert formed.status.round == 1 and sorted(p.rank for p in formed.status.participants) == [
        0, 1, 2, 3], formed.status.participants
    assert waited[0] < FIRST_ROUND_BOUND, f"sealed {waited[0]:.2f}s after the 4th join"
    # Ranks follow the completion index, whatever order the kubelet started the pods in.
    indexes = {p["metadata"]["name"]: int(p["metadata"]["annotations"][COMPLETION_INDEX])
               for p in pods_of(cluster, ns, f"batch.kubernetes.io/job-name={owned}")}
    assert {p.pod: p.rank for p in formed.status.participants} == indexes
    names = set(indexes)
    pods_succeeded(cluster, ns, f"batch.kubernetes.io/job-name={owned}", 4)
    for pod in names:  # every member trained in the world of 4, and only in it
        out = logs(cluster, ns, pod)
        assert "/4 epoch 5 done" in out and out.count(WORKER_STARTED) == 1, out[-2000:]
    assert read_run(cluster.client, ns, owned).status.phase == "Succeeded"

    body = elastic_run(bare, 2, 8)
    body["spec"]["lastCallTimeoutSeconds"] = UNOWNED_LAST_CALL
    create_run(cluster, ns, body)
    template = training_job(cluster, ns, bare, "2:8", 4, SHORT_TRAINING)["spec"]["template"]
    for i in range(4):
        cluster.client.request("POST", f"/api/v1/namespaces/{ns}/pods", body={
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {**template["metadata"], "name": f"{bare}-{i}"},
            "spec": template["spec"]})
    unowned = first_round(cluster, ns, bare, 180)
    waited = joins(unowned)
    print(f"{bare}: run 2:8, 4 bare Pods, last call {UNOWNED_LAST_CALL}s: 2nd join -> round "
          f"{unowned.status.round} of {len(unowned.status.participants)} after "
          f"{waited[-2]:.2f}s (last join -> seal {waited[0]:.2f}s)")
    assert unowned.status.desired is None
    assert unowned.status.round == 1 and len(unowned.status.participants) >= 2
    # Sealed by the last call, counted from the 2nd join (the reader's clock, not the pod's).
    assert waited[-2] >= UNOWNED_LAST_CALL - 1.5, waited
    pods_succeeded(cluster, ns, f"{RUN_LABEL}={bare}", 4)


def over_max_nodes(cluster: Cluster, ns: str, run: str) -> tuple[set[str], str]:
    """Run 1:2, a Job of 3: a round of 2, the third pod a spare; the Warning Event and the
    DesiredMismatch condition; DESIRED 3 in ``kubectl get er``.  Returns the members' pods
    and the spare's."""
    body = elastic_run(run, 1, 2)
    body["spec"]["lastCallTimeoutSeconds"] = SPARE_LAST_CALL
    create_run(cluster, ns, body)
    create_job(cluster, ns, training_job(cluster, ns, run, "1:2", 3,
                                         ["--epochs", "2400", "--steps-per-epoch", "10"]))
    formed = first_round(cluster, ns, run, 180)
    assert formed.status.round == 1 and len(formed.status.participants) == 2, formed.status
    members = {p.pod for p in formed.status.participants}
    selector = f"batch.kubernetes.io/job-name={run}"

    def spare() -> str | None:
        current = read_run(cluster.client, ns, run)
        taken = {p.pod for p in current.status.participants}
        waiting = [w.pod for w in current.status.waiting if w.pod and w.pod not in taken]
        return waiting[0] if current.status.round == 1 and len(waiting) == 1 else None

    spared = wait_for(spare, 120, "the third pod to wait as a spare", interval=0.2)
    assert spared not in members and {spared} | members == {
        p["metadata"]["name"] for p in pods_of(cluster, ns, selector)}
    current = read_run(cluster.client, ns, run)
    found = current.status.condition(DESIRED_CONDITION)
    assert found is not None and (found.status, found.reason) == ("True", DESIRED_ABOVE_MAX)
    events = wait_for(lambda: cluster.client.request(
        "GET", f"/api/v1/namespaces/{ns}/events",
        query={"fieldSelector": f"reason={DESIRED_ABOVE_MAX}"}).get("items"), 30,
        "the Warning Event")
    assert [(e["type"], e["message"]) for e in events] == [(
        "Warning", f"Job/{run} asks for 3 nodes, more than maxNodes (2): 1 pod(s) will wait "
                   "as spares and hold their quota")]
    table = cluster.kubectl("get", "er", run, "-n", ns).stdout.splitlines()
    print(f"\n{run}: spare {spared}, members {sorted(members)}\n" + "\n".join(table))
    header, row = table[0].split(), table[1].split()
    assert dict(zip(header, row, strict=False))["DESIRED"] == "3", table
    return members, spared


def test_a_job_above_max_nodes_warns_shows_desired_and_is_deleted_cleanly(
        node_cluster: Cluster, node_namespace: str) -> None:
    cluster, ns, run = node_cluster, node_namespace, "over2"
    over_max_nodes(cluster, ns, run)
    cluster.client.request("DELETE", f"/apis/batch/v1/namespaces/{ns}/jobs/{run}",
                           query={"propagationPolicy": "Background"})
    wait_for(lambda: not pods_of(cluster, ns, f"batch.kubernetes.io/job-name={run}"), 90,
             "the Job's pods to be gone", interval=1)


def test_a_job_above_max_nodes_keeps_its_round_and_its_spare_exits_cleanly(
        node_cluster: Cluster, node_namespace: str) -> None:
    cluster, ns, run = node_cluster, node_namespace, "over2"
    members, spared = over_max_nodes(cluster, ns, run)
    selector = f"batch.kubernetes.io/job-name={run}"
    # Past the last call counted from the spare's join, the members still train in round 1:
    # the spare (enough for minNodes on its own) sealed no round of its own.
    (joined,) = [w.since for w in read_run(cluster.client, ns, run).status.waiting
                 if w.pod == spared and w.since]
    def training() -> bool:
        still = read_run(cluster.client, ns, run)
        assert still.status.phase == "Running", "training ended before the spare's last call"
        return (still.status.round, {p.pod for p in still.status.participants}) == (1, members)

    consistently(training, max(0.0, joined.timestamp() + outlasting(SPARE_LAST_CALL) + 1
                               - time.time()),
                 "the spare sealed a round of its own", interval=0.5)

    def finished() -> dict[str, Any] | None:
        job: dict[str, Any] = cluster.client.request("GET", f"/apis/batch/v1/namespaces/{ns}"
                                                            f"/jobs/{run}")
        return job if condition(job, "Complete") or condition(job, "Failed") else None

    status = wait_for(finished, 300, "the Job to finish", interval=1)["status"]
    pod_logs = {name: cluster.kubectl("logs", name, "-n", ns, check=False).stdout
                for name in (*sorted(members), spared)}
    every_log = "\n".join(f"--- {name}\n{text[-3000:]}" for name, text in pod_logs.items())
    assert (status.get("succeeded"), status.get("failed", 0)) == (3, 0), \
        f"{status}\n{every_log}"
    final = read_run(cluster.client, ns, run)
    print(f"{run}: Job succeeded {status.get('succeeded')}, failed {status.get('failed', 0)}; "
          f"run {final.status.phase} at round {final.status.round}")
    assert (final.status.phase, final.status.round) == ("Succeeded", 1), every_log
    assert "the run already succeeded" in pod_logs[spared], every_log
    assert "starting at epoch" not in pod_logs[spared], every_log  # no worker of the spare
    pods_succeeded(cluster, ns, selector, 3)  # the spare too: exit status 0
