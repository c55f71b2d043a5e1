"""elasticrun on a real node: the examples as a user applies them, and the failures pods meet.

Everything here is real: the Job and StatefulSet controllers make the pods, the
scheduler places them, the webhook (the chart's operator, itself a pod)
mutates them, kubelet + containerd + runc run `torchrun --rdzv-backend=k8s`
in them, and kubelet kills them.  Times are printed, not asserted.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from elasticrun.api import rounds, slices
from elasticrun.api.kube import ApiError, lease_path, leases_path, run_path
from elasticrun.api.model import ElasticRun

from conftest import ROOT, Cluster, wait_for
from controlplane.node import NODE_IP, NODE_NAME, host_paths, read_tunables
from nodekit import (
    EXAMPLES,
    LONG_TRAINING,
    OPERATOR_DEPLOYMENT,
    RELEASE_NAMESPACE,
    apply_example,
    create_run,
    delete_member,
    elastic_run,
    logs,
    operator_pods,
    pods_of,
    round_with,
    wait_pod_phase,
)
from rdzv import read_run

pytest_plugins = ("nodefixtures",)
pytestmark = [pytest.mark.node, pytest.mark.slow]

# --------------------------------------------------------------------------- the node


def test_one_ready_node_runs_the_smoke_pod(node_cluster: Cluster, node_namespace: str) -> None:
    nodes = node_cluster.client.request("GET", "/api/v1/nodes")["items"]
    assert [n["metadata"]["name"] for n in nodes] == [NODE_NAME]
    assert {"type": "InternalIP", "address": NODE_IP} in nodes[0]["status"]["addresses"]
    tunables = read_tunables()
    node_cluster.kubectl("apply", "-n", node_namespace, "-f",
                         str(ROOT / "deploy" / "local" / "smoke-pod.yaml"))
    pod = wait_pod_phase(node_cluster, node_namespace, "elasticrun-smoke",
                         {"Succeeded", "Failed"}, 120)
    out = logs(node_cluster, node_namespace, "elasticrun-smoke")
    assert pod["status"]["phase"] == "Succeeded", out
    assert f"torch {torch.__version__}" in out and "elasticrun.handler from" in out
    assert pod["status"]["podIP"] == NODE_IP  # the TCPStore address stays on loopback
    # kubelet is running and has not touched the machine's kernel tunables.
    assert read_tunables() == tunables
    assert not host_paths() & {"/var/lib/kubelet", "/run/containerd", "/opt/elasticrun"}


def test_the_chart_operator_runs_as_a_pod(node_cluster: Cluster) -> None:
    deployment = node_cluster.client.request(
        "GET", f"/apis/apps/v1/namespaces/{RELEASE_NAMESPACE}/deployments/{OPERATOR_DEPLOYMENT}")
    available = {c["type"]: c["status"] for c in deployment["status"]["conditions"]}
    assert available["Available"] == "True"
    pods = operator_pods(node_cluster)
    assert len(pods) == deployment["spec"]["replicas"] == 2  # deploy/local/values.yaml
    for pod in pods:
        assert pod["spec"]["nodeName"] == NODE_NAME
        assert pod["spec"]["securityContext"]["runAsUser"] == 65532
        assert [c["restartCount"] for c in pod["status"]["containerStatuses"]] == [0]
    webhooks = node_cluster.client.request(
        "GET", "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations",
        query={"labelSelector": "app.kubernetes.io/name=elasticrun,"
                                "app.kubernetes.io/component=webhook"})["items"]
    (config,) = webhooks
    assert config["webhooks"][0]["clientConfig"]["caBundle"]  # the operator wrote its CA


# --------------------------------------------------------------------------- the examples


def test_job_example_trains_through_a_deleted_pod(node_cluster: Cluster,
                                                 node_namespace: str) -> None:
    ns, run = node_namespace, "llama-job"
    # maxNodes 2,048 makes it one of the largest runs: the chart's operator seals without
    # moving the signal and tells each pod its rank in the run's slices, which the pods
    # may only read (the chart's training Role).
    create_run(node_cluster, ns, elastic_run(run, 2, rounds.TELL_IN_SLICES_FROM))
    apply_example(node_cluster, ns, EXAMPLES / "job.yaml", LONG_TRAINING)
    first = wait_for(lambda: round_with(node_cluster, ns, run, 2), 180,
                     "the Job's two pods in one round", interval=0.5)
    assert first.status.signal == 0
    assert first.uid is not None
    for member in first.status.participants:
        # The operator writes the round's slices after its status write: wait for each
        # member's, bounded.
        def told_in_slice(name: str = member.name, uid: str = first.uid) -> Any:
            path = slices.slice_path(ns, slices.slice_name(uid, slices.slice_index(name)))
            try:
                return slices.read_place(node_cluster.client.request("GET", path), run, name)
            except ApiError as exc:
                if exc.not_found:
                    return None
                raise

        told = wait_for(told_in_slice, 30, f"{member.name}'s place in its slice")
        assert (told.round, told.rank, told.world_size) == (first.status.round, member.rank, 2)
    victim = first.status.participants[-1].name
    survivor = first.status.participants[0].name
    # The Job controller made these pods; the API server sent them to the webhook.
    pod = node_cluster.client.request("GET", f"/api/v1/namespaces/{ns}/pods/{survivor}")
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["PET_RDZV_BACKEND"] == "k8s" and env["PET_RDZV_ID"] == run
    assert pod["metadata"]["ownerReferences"][0]["kind"] == "Job"
    wait_for(lambda: "epoch 5 done" in logs(node_cluster, ns, survivor), 120,
             "training to be under way", interval=1)

    deleted = time.monotonic()
    print(f"\npod {victim} deleted -> removed from the run after "
          f"{delete_member(node_cluster, ns, run, victim):.2f}s")
    # minNodes is 2: the survivor waits for the Job controller's replacement pod,
    # which the next round admits.
    reformed = wait_for(lambda: round_with(node_cluster, ns, run, 2, after=first.status.round,
                                           without=victim, including=survivor), 180,
                        f"a round of the survivor and the replacement of {victim}",
                        interval=0.1)
    print(f"round {reformed.status.round} (survivor + replacement) after "
          f"{time.monotonic() - deleted:.2f}s")
    assert reformed.status.signal == 1  # moved by the loss only, not by either seal

    def complete() -> bool:
        job = node_cluster.client.request("GET", f"/apis/batch/v1/namespaces/{ns}/jobs/{run}")
        return any(c["type"] == "Complete" and c["status"] == "True"
                   for c in (job.get("status") or {}).get("conditions") or [])

    wait_for(complete, 300, "the Job to complete", interval=1)
    checkpoint = node_cluster.require_local().dir / "node" / "volumes" / ns / \
        "llama-job-checkpoints" / "llama-job.pt"
    assert torch.load(checkpoint, weights_only=True)["epoch"] == 300
    final = read_run(node_cluster.client, ns, run)
    summary = [(m.name, m.round, m.reason, m.message) for m in final.status.lost_members]
    assert final.status.phase == "Succeeded", (final.status.conditions, summary)
    # The first member out found its round past torch's exit barrier and marked the run
    # Succeeded; the others left a finished run as it was.
    assert [m.reason for m in final.status.lost_members if m.name != victim] == ["Finished"], \
        summary


def start_statefulset(cluster: Cluster, namespace: str, run: str) -> ElasticRun:
    """The StatefulSet example, training for as long as a test needs; its first round."""
    create_run(cluster, namespace, elastic_run(run, 1, 4))
    apply_example(cluster, namespace, EXAMPLES / "statefulset.yaml",
                  ["--epochs", "100000", "--steps-per-epoch", "10"])
    first: ElasticRun = wait_for(lambda: round_with(cluster, namespace, run, 2), 180,
                                 "the StatefulSet's two pods in one round", interval=0.5)
    return first


def test_statefulset_scale_up_eviction_and_a_crashed_container(
        node_cluster: Cluster, node_namespace: str) -> None:
    ns, run = node_namespace, "llama-sts"
    first = start_statefulset(node_cluster, ns, run)

    # kubectl scale: the new pod joins the next round.
    node_cluster.kubectl("scale", "statefulset", "-n", ns, run, "--replicas=3")
    scaled = wait_for(lambda: round_with(node_cluster, ns, run, 3, after=first.status.round,
                                         including=f"{run}-2"), 180,
                      "a round of three after the scale-up", interval=0.5)

    # The Eviction API (a drain): DisruptionTarget, then deletion.
    evicted = time.monotonic()
    node_cluster.client.request(
        "POST", f"/api/v1/namespaces/{ns}/pods/{run}-2/eviction",
        body={"apiVersion": "policy/v1", "kind": "Eviction",
              "metadata": {"name": f"{run}-2", "namespace": ns}})
    after_eviction = wait_for(
        lambda: round_with(node_cluster, ns, run, 2, after=scaled.status.round,
                           without=f"{run}-2"), 60, "a round without the evicted pod",
        interval=0.1)
    print(f"\nevicted -> round {after_eviction.status.round} after "
          f"{time.monotonic() - evicted:.2f}s")
    reasons = [m.reason for m in after_eviction.status.lost_members if m.name == f"{run}-2"]
    assert reasons and reasons[-1] in ("PodDisrupted", "PodDeleted"), reasons

    # A container that dies (SIGKILL, like the OOM killer): kubelet restarts it,
    # the operator takes the node out and the restarted agent joins again.
    victim = f"{run}-1"
    before = wait_for(lambda: round_with(node_cluster, ns, run, 3, including=victim), 180,
                      "the evicted pod's successor back in a round of three", interval=0.5)
    agent = torchrun_process(victim)
    killed = time.monotonic()
    os.kill(agent, signal.SIGKILL)

    def crash_recorded() -> list[str]:
        lost = read_run(node_cluster.client, ns, run).status.lost_members
        return [m.reason for m in lost if m.name == victim and m.round == before.status.round]

    reasons = wait_for(crash_recorded, 60, f"the operator to remove the crashed {victim}")
    print(f"container killed -> removed after {time.monotonic() - killed:.2f}s: {reasons}")
    assert reasons[-1] in ("ContainerTerminated", "ContainerRestarted"), reasons
    back = wait_for(lambda: round_with(node_cluster, ns, run, 3, after=before.status.round,
                                       including=victim), 180,
                    f"the restarted {victim} back in a round", interval=0.5)
    assert restart_count(node_cluster, ns, victim) >= 1
    print(f"restarted container back in round {back.status.round} after "
          f"{time.monotonic() - killed:.2f}s")

    # Rank 0 deleted as soon as its round is seen sealed: its TCPStore goes with it.
    # The others' torchrun must re-rendezvous in place, not exit.
    sealed = wait_for(lambda: round_with(node_cluster, ns, run, 3, after=back.status.round - 1),
                      180, "a round of three", interval=0.05)
    leader = next(p.name for p in sealed.status.participants if p.rank == 0)
    survivors = [p.name for p in sealed.status.participants if p.name != leader]
    restarts = {name: restart_count(node_cluster, ns, name) for name in survivors}
    deleted = time.monotonic()
    node_cluster.kubectl("delete", "pod", "-n", ns, leader, "--wait=false")
    without = wait_for(lambda: round_with(node_cluster, ns, run, 2, after=sealed.status.round,
                                          without=leader), 60,
                       f"a round of the two others after rank 0 ({leader}) was deleted",
                       interval=0.05)
    took = time.monotonic() - deleted
    assert {p.name for p in without.status.participants} == set(survivors)
    assert sorted(p.rank for p in without.status.participants) == [0, 1]
    lost = [m.reason for m in without.status.lost_members
            if m.name == leader and m.round == sealed.status.round]
    assert lost and lost[-1] in ("PodDeleted", "Left"), lost
    assert {name: restart_count(node_cluster, ns, name) for name in survivors} == restarts
    print(f"rank 0 ({leader}) deleted right after round {sealed.status.round} was sealed -> "
          f"round {without.status.round} of the other two after {took:.2f}s ({lost[-1]}); "
          "no container restarted")


def restart_count(cluster: Cluster, namespace: str, pod: str) -> int:
    body = cluster.client.request("GET", f"/api/v1/namespaces/{namespace}/pods/{pod}")
    count: int = body["status"]["containerStatuses"][0]["restartCount"]
    return count


def torchrun_process(pod: str) -> int:
    """The PID (on this machine) of the torchrun agent running in ``pod``."""
    def find() -> int | None:
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                environ = (proc / "environ").read_bytes().split(b"\0")
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if f"POD_NAME={pod}".encode() in environ and b"torchrun" in cmdline:
                return int(proc.name)
        return None

    pid: int = wait_for(find, 30, f"torchrun in pod {pod}")
    return pid


# --------------------------------------------------------------------------- clean-up


def test_deleting_a_namespace_with_a_live_run_removes_everything(
        node_cluster: Cluster, node_namespace: str) -> None:
    ns, run = node_namespace, "llama-sts"
    start_statefulset(node_cluster, ns, run)
    assert node_cluster.client.request("GET", leases_path(ns))["items"]

    started = time.monotonic()
    node_cluster.client.request("DELETE", f"/api/v1/namespaces/{ns}")

    def gone() -> bool:
        try:
            node_cluster.client.request("GET", f"/api/v1/namespaces/{ns}")
        except ApiError as exc:
            return exc.status == 404
        return False

    wait_for(gone, 180, f"namespace {ns} to be deleted (nothing may hold a finalizer)",
             interval=0.5)
    print(f"\nnamespace with a live run deleted in {time.monotonic() - started:.2f}s")


def test_leases_are_garbage_collected_without_the_operator(
        node_cluster: Cluster, node_namespace: str) -> None:
    ns, run = node_namespace, "tiny"
    create_run(node_cluster, ns, elastic_run(run, 2, 2))
    apply_example(node_cluster, ns, EXAMPLES / "pods.yaml",
                  ["--epochs", "100000", "--steps-per-epoch", "10"])
    joined = wait_for(lambda: round_with(node_cluster, ns, run, 2), 180, "a round of two",
                      interval=0.5)
    leases = node_cluster.client.request("GET", leases_path(ns))["items"]
    names = {p.name for p in joined.status.participants}
    owned = [lease["metadata"]["name"] for lease in leases
             if any(ref.get("uid") == joined.uid
                    for ref in lease["metadata"].get("ownerReferences") or [])]
    assert len(owned) == len(names), (owned, names)

    scale_operator(node_cluster, 0)
    try:
        node_cluster.client.request("DELETE", run_path(ns, run))

        def collected() -> bool:
            for name in owned:
                try:
                    node_cluster.client.request("GET", lease_path(ns, name))
                except ApiError as exc:
                    if exc.status != 404:
                        raise
                else:
                    return False
            return True

        wait_for(collected, 120, "the garbage collector to delete the run's Leases",
                 interval=0.5)
    finally:
        scale_operator(node_cluster, 2)  # deploy/local/values.yaml's replicas


def scale_operator(cluster: Cluster, replicas: int) -> None:
    path = f"/apis/apps/v1/namespaces/{RELEASE_NAMESPACE}/deployments/{OPERATOR_DEPLOYMENT}"
    cluster.client.request("PATCH", f"{path}/scale", body={"spec": {"replicas": replicas}},
                           content_type="application/merge-patch+json")

    def settled() -> bool:
        status = cluster.client.request("GET", path).get("status") or {}
        pods = pods_of(cluster, RELEASE_NAMESPACE, "app.kubernetes.io/component=operator")
        return (status.get("availableReplicas") or 0) == replicas and len(pods) == replicas

    wait_for(settled, 120, f"the operator at {replicas} replicas", interval=0.5)
