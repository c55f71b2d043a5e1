"""deploy/: the sample and example manifests, and the example training script.

The manifests are validated by the real API server (server-side dry run: the
workload controllers that would act on them do not exist here), and their pod
templates by the webhook's own decision code. train.py is then run the way the
webhook sets a pod up: real torchrun agents whose only configuration is the
injected PET_* / POD_* environment, talking to the API server with nothing but
the training ServiceAccount's token.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from podenv import kubelet_env

from elasticrun.api import crd
from elasticrun.api.kube import run_path
from elasticrun.operator import webhook

from chartkit import Helm, apply, request_token, token_kubeconfig
from conftest import ROOT, Cluster, ProcessGroup, wait_for
from controlplane.localcluster import clean_env

pytest_plugins = ("chartfixtures",)

DEPLOY = ROOT / "deploy"
EXAMPLES = sorted((DEPLOY / "examples").glob("*.yaml"))
TRAIN = DEPLOY / "examples" / "train.py"
TRAINER = "elasticrun-trainer"


def manifests(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def pod_templates(docs: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for doc in docs:
        if doc["kind"] == "Pod":
            yield doc
        elif doc["kind"] in ("Job", "StatefulSet", "Deployment"):
            yield {"metadata": doc["spec"]["template"]["metadata"],
                   "spec": doc["spec"]["template"]["spec"]}


def test_sample_elasticrun_is_accepted_as_written(cluster: Cluster, namespace: str) -> None:
    (sample,) = manifests(DEPLOY / "samples" / "elasticrun.yaml")
    sample["metadata"]["namespace"] = namespace
    stored = cluster.apply(sample)
    assert stored["spec"] == sample["spec"]  # every field is real: nothing pruned or defaulted
    # Every spec field of the CRD is shown (and so commented) in the sample.
    assert set(sample["spec"]) == set(crd.spec_properties())


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_valid_and_opt_in(cluster: Cluster, namespace: str, path: Path) -> None:
    docs = manifests(path)
    templates = list(pod_templates(docs))
    assert templates, f"{path.name} has no pod"
    for pod in templates:
        assert crd.RUN_LABEL in pod["metadata"]["labels"]
        plan = webhook.plan_mutation(pod)  # raises on an annotation the webhook would deny
        assert plan.ops and not plan.warnings
        assert pod["spec"]["serviceAccountName"] == TRAINER
        assert pod["spec"]["containers"][0]["command"][0] == "torchrun"
    # The chart creates this ServiceAccount in each training namespace; a cluster with
    # the ServiceAccount admission plugin (any real one) refuses pods naming a missing one.
    cluster.kubectl("create", "serviceaccount", "-n", namespace, TRAINER)
    dry = cluster.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", str(path),
                          check=False)
    assert dry.returncode == 0, dry.stderr


@pytest.mark.torchrun
def test_train_py_under_torchrun_with_only_the_injected_environment(
        cluster: Cluster, helm: Helm, namespace: str, processes: ProcessGroup,
        tmp_path: Path, request: pytest.FixtureRequest) -> None:
    docs = [d for d in helm.template("ex", namespace, {"trainingNamespaces": [namespace]})
            if d["kind"] in ("ServiceAccount", "Role", "RoleBinding")
            and d["metadata"]["namespace"] == namespace]
    apply(cluster, docs)
    token = request_token(cluster, namespace, TRAINER)
    kubeconfig = token_kubeconfig(cluster, token, tmp_path / "kubeconfig", namespace)
    checkpoint = tmp_path / "ckpt" / "run.pt"
    annotations = {webhook.NNODES_ANNOTATION: "2:2", webhook.NPROC_ANNOTATION: "1"}
    procs = []
    for node in ("ex-0", "ex-1"):
        pod = {"metadata": {"name": node, "labels": {crd.RUN_LABEL: "example"},
                            "annotations": annotations},
               "spec": {"containers": [{"name": "trainer", "image": "x"}]}}
        env = {**clean_env(), **kubelet_env(webhook.mutated(pod), namespace),
               "KUBECONFIG": str(kubeconfig), "CHECKPOINT": str(checkpoint),
               "PET_RDZV_CONF": "last_call_timeout=1,join_timeout=120",
               "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("handler", "operator"))}
        log = open(tmp_path / f"{node}.log", "wb")  # noqa: SIM115 - closed below
        request.addfinalizer(log.close)
        procs.append(processes.start(
            [sys.executable, "-m", "torch.distributed.run", str(TRAIN), "--epochs", "2",
             "--steps-per-epoch", "5"], env=env, stdout=log, stderr=subprocess.STDOUT,
            cwd=tmp_path))

    def finished() -> bool:
        return all(p.poll() is not None for p in procs)

    try:
        wait_for(finished, 240, "both torchrun agents to finish", interval=0.5)
    finally:
        logs = {n: (tmp_path / f"{n}.log").read_text(errors="replace")[-3000:]
                for n in ("ex-0", "ex-1")}
    assert [p.returncode for p in procs] == [0, 0], json.dumps(logs, indent=1)
    state = torch.load(checkpoint, weights_only=True)
    assert state["epoch"] == 2
    run = cluster.client.request("GET", run_path(namespace, "example"))
    assert run["status"]["round"] >= 1
    assert "epoch 2 done" in logs["ex-0"] + logs["ex-1"]


def test_kind_quick_start_names_the_real_files() -> None:
    """The README's commands point at files and values that exist."""
    text = (DEPLOY / "kind" / "README.md").read_text()
    for path in ("operator/Dockerfile", "deploy/examples/Dockerfile", "charts/elasticrun",
                 "deploy/examples/job.yaml"):
        assert path in text and (ROOT / path).exists(), path
    values = yaml.safe_load((ROOT / "charts" / "elasticrun" / "values.yaml").read_text())
    assert f"{values['image']['repository']}:0.1.0" in text
    assert "get er" in text and "-w" in text
