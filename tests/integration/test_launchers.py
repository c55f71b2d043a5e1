"""Launchers' pods, as torchrun sees them: real agents with the environment a launcher's
controller writes into its pods, mutated by the webhook's own pure function.

Each test builds the container a controller would create (the variables read from
its source: Kubeflow Trainer v2.3.0 ``pkg/runtime/framework/plugins/torch/torch.go``,
training-operator v1.8.1 ``pkg/controller.v1/pytorch/envvar.go`` and ``elastic.go``),
applies :func:`elasticrun.operator.webhook.mutated` to it, resolves the downward-API
fields as the kubelet would, and starts ``torchrun`` with exactly that environment
and the container's command: no rendezvous flag on the command line.  The run, its
rounds and ranks are then read from the API server.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from podenv import kubelet_env

from elasticrun.api.kube import runs_path
from elasticrun.api.model import parse_run
from elasticrun.operator import webhook

from conftest import ROOT, Cluster, ProcessGroup, wait_for
from controlplane.localcluster import clean_env

pytestmark = pytest.mark.torchrun
TRAIN = ROOT / "deploy" / "examples" / "train.py"
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
#: Short timings so a round forms within seconds (a user sets PET_RDZV_CONF the same way:
#: it is not among Trainer's reserved names, and PyTorchJob writes it from rdzvConf).
RDZV_CONF = "last_call_timeout=2,join_timeout=90,heartbeat_timeout=4,lease_interval=1"


def trainjob_container(trainjob: str, num_nodes: int) -> dict[str, Any]:
    """The ``node`` container Trainer's torch plugin writes for a TrainJob."""
    return {"name": "node", "image": "trainer:1",
            "command": ["torchrun", str(TRAIN), "--epochs", "2", "--steps-per-epoch", "20"],
            "env": [{"name": "PET_RDZV_CONF", "value": RDZV_CONF},  # spec.trainer.env
                    {"name": "PET_NNODES", "value": str(num_nodes)},
                    {"name": "PET_NPROC_PER_NODE", "value": "1"},
                    {"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {
                        "fieldPath": COMPLETION_INDEX}}},
                    {"name": "PET_MASTER_ADDR", "value": f"{trainjob}-node-0-0.{trainjob}"},
                    {"name": "PET_MASTER_PORT", "value": "29500"}]}


PYTORCHJOB = ROOT / "deploy" / "integrations" / "pytorchjob.yaml"


def pytorchjob_v1_worker(job: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A worker pod's metadata and container as the v1.8.1 controller writes them for
    ``job`` (worker-only, so no MASTER_ADDR or RANK): ``setPodEnv`` adds
    PYTHONUNBUFFERED, ``ElasticEnvVarGenerator`` the endpoint (``<job>-worker-0`` and
    the ``pytorchjob-port``), backend, MIN:MAX, maxRestarts, nProcPerNode and the
    rdzvConf pairs.  The command runs this checkout's train.py, for a short time."""
    name, policy = job["metadata"]["name"], job["spec"]["elasticPolicy"]
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    container = dict(worker["spec"]["containers"][0])
    port = next(p["containerPort"] for p in container["ports"]
                if p["name"] == "pytorchjob-port")
    conf = ",".join(f"{c['key']}={c['value']}" for c in policy.get("rdzvConf") or [])
    container["command"] = ["torchrun", str(TRAIN), "--epochs", "2", "--steps-per-epoch", "20"]
    container["env"] = [
        *container.get("env", []),
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        {"name": "PET_RDZV_ENDPOINT", "value": f"{name}-worker-0:{port}"},
        {"name": "PET_RDZV_BACKEND", "value": policy["rdzvBackend"]},
        {"name": "PET_NNODES", "value": f"{policy['minReplicas']}:{policy['maxReplicas']}"},
        {"name": "PET_MAX_RESTARTS", "value": str(policy["maxRestarts"])},
        {"name": "PET_NPROC_PER_NODE", "value": str(policy["nProcPerNode"])},
        # the test's short timings, as rdzvConf would give them
        {"name": "PET_RDZV_CONF", "value": conf or RDZV_CONF}]
    return worker["metadata"], container


def launcher_pod(name: str, namespace: str, labels: dict[str, str],
                 annotations: dict[str, str], container: dict[str, Any],
                 index: int | None = None) -> dict[str, Any]:
    if index is not None:
        annotations = {**annotations, "batch.kubernetes.io/job-completion-index": str(index)}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": labels,
                         "annotations": annotations},
            "spec": {"containers": [container]}}


def start_pod(processes: ProcessGroup, cluster: Cluster, pod: Mapping[str, Any],
              workdir: Path) -> subprocess.Popen[Any]:
    """Run the mutated pod's container as a local process: its command, its environment."""
    command = list(pod["spec"]["containers"][0]["command"])
    assert command[0] == "torchrun"
    argv = [str(Path(sys.executable).parent / "torchrun"), *command[1:],
            "--checkpoint", str(workdir / "checkpoint.pt")]
    env = {**clean_env(), "KUBECONFIG": str(cluster.kubeconfig), "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1", **kubelet_env(pod)}
    log = open(workdir / f"{pod['metadata']['name']}.log", "wb")  # noqa: SIM115
    return processes.start(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=workdir)


def worker_ranks(workdir: Path, name: str) -> set[str]:
    """``rank R/W`` prefixes the example's workers log with (dist.get_rank, world size)."""
    text = (workdir / f"{name}.log").read_text(errors="replace")
    return set(re.findall(r" rank (\d+/\d+) epoch \d+ done", text))


def logs(workdir: Path) -> list[tuple[str, str]]:
    return [(log.name, log.read_text(errors="replace")[-3000:]) for log in workdir.glob("*.log")]


def test_a_trainjob_pod_rendezvouses_through_k8s_whatever_rank_and_master_it_was_given(
        cluster: Cluster, namespace: str, processes: ProcessGroup, tmp_path: Path) -> None:
    """TrainJob numNodes 3 with ``elasticrun.dev/nnodes: "2:3"``: pod 0 is gone (its
    ``PET_MASTER_ADDR`` names it), pods 1 and 2 form a round of 2 with ranks 0 and 1.

    The run's size comes from the annotation, not Trainer's ``PET_NNODES=3`` (with
    3:3 the two would wait for a third node); torchrun reads ``PET_NODE_RANK`` and
    ``PET_MASTER_*`` only for its static rendezvous, so neither the completion index
    2 (outside a world of 2) nor the unresolvable master host matters.
    """
    labels = {webhook.RUN_LABEL: "", "jobset.sigs.k8s.io/jobset-name": "tj",
              "batch.kubernetes.io/job-name": "tj-node-0"}
    pods = {}
    for index in (1, 2):
        raw = launcher_pod(f"tj-node-0-{index}-x", namespace, labels,
                           {webhook.NNODES_ANNOTATION: "2:3"}, trainjob_container("tj", 3),
                           index)
        pods[index] = webhook.mutated(raw)
        assert pods[index]["metadata"]["labels"][webhook.RUN_LABEL] == "tj"
        env = kubelet_env(pods[index])
        assert (env["PET_NNODES"], env["PET_NODE_RANK"]) == ("2:3", str(index))
        assert env["PET_MASTER_ADDR"] == "tj-node-0-0.tj"
    agents = {i: start_pod(processes, cluster, pod, tmp_path) for i, pod in pods.items()}
    for proc in agents.values():
        assert proc.wait(timeout=240) == 0, logs(tmp_path)
    run = parse_run(cluster.client.request("GET", f"{runs_path(namespace)}/tj"))
    assert (run.spec.min_nodes, run.spec.max_nodes) == (2, 3)
    assert run.status.round >= 1
    names = {pods[i]["metadata"]["name"] for i in pods}
    ranks = {worker_ranks(tmp_path, name).pop() for name in sorted(names)}
    assert ranks == {"0/2", "1/2"}
    # torchrun itself says it saw Trainer's master address and did not use it.
    text = (tmp_path / "tj-node-0-2-x.log").read_text(errors="replace")
    assert "master_addr is only used for static rdzv_backend" in text


def test_a_pytorchjob_v1_worker_with_rdzv_backend_k8s_rendezvouses_through_k8s(
        cluster: Cluster, namespace: str, processes: ProcessGroup, tmp_path: Path) -> None:
    """docs/integrations.md's PyTorchJob: ``PET_RDZV_ENDPOINT=<job>-worker-0:23456``
    (always injected by the v1 controller) is a store address the k8s backend ignores;
    two of its workers (minReplicas 2) train in a world of 2."""
    (job,) = [d for d in yaml.safe_load_all(PYTORCHJOB.read_text()) if d]
    meta, container = pytorchjob_v1_worker(job)
    pods = [webhook.mutated(launcher_pod(
        f"llama-v1-worker-{i}", namespace,
        {**meta["labels"], "training.kubeflow.org/job-name": "llama-v1",
         "training.kubeflow.org/replica-type": "worker",
         "training.kubeflow.org/replica-index": str(i)},
        {}, container)) for i in range(2)]
    for pod in pods:
        env = kubelet_env(pod)
        assert env["PET_RDZV_ENDPOINT"] == "llama-v1-worker-0:23456"
        assert (env["PET_RDZV_BACKEND"], env["PET_RDZV_ID"]) == ("k8s", "llama-v1")
    agents = [start_pod(processes, cluster, pod, tmp_path) for pod in pods]
    wait_for(lambda: all(worker_ranks(tmp_path, p["metadata"]["name"]) for p in pods), 180,
             "both workers to finish an epoch", 0.2)
    for proc in agents:
        assert proc.wait(timeout=240) == 0, logs(tmp_path)
    ranks = {worker_ranks(tmp_path, p["metadata"]["name"]).pop() for p in pods}
    assert ranks == {"0/2", "1/2"}
    run = parse_run(cluster.client.request("GET", f"{runs_path(namespace)}/llama-v1"))
    assert run.status.round >= 1


def indexed_job_container() -> dict[str, Any]:
    """A plain Indexed Job's container: the run's size from the annotation alone."""
    return {"name": "trainer", "image": "trainer:1",
            "command": ["torchrun", str(TRAIN), "--epochs", "1", "--steps-per-epoch", "10"],
            "env": [{"name": "PET_RDZV_CONF", "value": RDZV_CONF},
                    {"name": "PET_NPROC_PER_NODE", "value": "1"}]}


def test_a_node_arriving_at_a_succeeded_run_exits_0(
        cluster: Cluster, namespace: str, operator: Any, processes: ProcessGroup,
        tmp_path: Path) -> None:
    """Indexed Job, completions 3, nnodes 2:2: indexes 0 and 1 train and finish, the
    operator marks the run Succeeded, index 2 starts after that.  Its agent must exit 0
    (a Job counts any other status as a failed pod) and run no worker."""
    labels = {webhook.RUN_LABEL: "", "batch.kubernetes.io/job-name": "late"}

    def job_pod(index: int) -> dict[str, Any]:
        return webhook.mutated(launcher_pod(f"late-{index}-x", namespace, labels,
                                            {webhook.NNODES_ANNOTATION: "2"},
                                            indexed_job_container(), index))

    first = [start_pod(processes, cluster, job_pod(i), tmp_path) for i in (0, 1)]
    for proc in first:
        assert proc.wait(timeout=240) == 0, logs(tmp_path)
    wait_for(lambda: parse_run(cluster.client.request(
        "GET", f"{runs_path(namespace)}/late")).status.phase == "Succeeded", 30,
        "the operator to mark the run Succeeded")
    late = start_pod(processes, cluster, job_pod(2), tmp_path)
    assert late.wait(timeout=120) == 0, logs(tmp_path)
    assert not worker_ranks(tmp_path, "late-2-x")  # no worker ever started
    run = parse_run(cluster.client.request("GET", f"{runs_path(namespace)}/late"))
    assert run.status.phase == "Succeeded"
    assert "late-2-x" not in run.status.member_names
