"""The webhook's pure decisions: which pods, which variables, which messages.

The same functions run inside the kopf handler that tests/integration/test_webhook.py
drives through the real API server; here every edge case is cheap.
"""

from __future__ import annotations

import copy
import ssl
import subprocess
from pathlib import Path
from typing import Any

import jsonpatch
import kopf
import pytest

from elasticrun.operator import webhook
from elasticrun.operator.webhookcert import ca_bundle_patch, generate_serving_cert


def pod(labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None,
        containers: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "p", "namespace": "ns", "labels": labels or {},
                     "annotations": annotations or {}},
        "spec": {"containers": containers if containers is not None else [
            {"name": "trainer", "image": "img", "command": ["torchrun", "train.py"]}]},
    }


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_opted_in_pod_gets_the_whole_environment_in_every_container() -> None:
    p = pod({webhook.RUN_LABEL: "llama"}, {webhook.NNODES_ANNOTATION: "2:4",
                                            webhook.NPROC_ANNOTATION: "8"},
            containers=[{"name": "a", "image": "i", "command": ["torchrun", "train.py"]},
                        {"name": "b", "image": "i", "env": [{"name": "X", "value": "1"}]}])
    out = webhook.mutated(p)
    for container in out["spec"]["containers"]:
        env = env_of(container)
        assert env["PET_RDZV_BACKEND"] == "k8s"
        assert env["PET_RDZV_ID"] == "llama"
        assert env["PET_NNODES"] == "2:4"
        assert env["PET_NPROC_PER_NODE"] == "8"
        assert env["POD_NAME"] == {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}}
        assert env["POD_NAMESPACE"]["fieldRef"]["fieldPath"] == "metadata.namespace"
        assert env["POD_UID"] == {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.uid"}}
        assert env["POD_IP"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert env["PET_LOCAL_ADDR"] == "$(POD_IP)"
        names = [e["name"] for e in container["env"]]
        # $(POD_IP) only expands from variables defined before it.
        assert names.index("POD_IP") < names.index("PET_LOCAL_ADDR")
    assert out["spec"]["containers"][0]["command"] == ["torchrun", "train.py"]
    assert env_of(out["spec"]["containers"][1])["X"] == "1"


def test_without_annotations_only_backend_id_restarts_and_pod_identity_are_set() -> None:
    env = env_of(webhook.mutated(pod({webhook.RUN_LABEL: "r"}))["spec"]["containers"][0])
    assert set(env) == {"PET_RDZV_BACKEND", "PET_RDZV_ID", "PET_MAX_RESTARTS", "POD_NAME",
                        "POD_NAMESPACE", "POD_UID", "POD_IP", "PET_LOCAL_ADDR"}
    assert env["PET_MAX_RESTARTS"] == str(webhook.DEFAULT_MAX_RESTARTS)


def test_a_statefulset_pod_reads_its_index_from_its_label_and_a_job_pod_gets_none() -> None:
    labels = {webhook.RUN_LABEL: "r", webhook.POD_INDEX_LABEL: "3"}
    env = env_of(webhook.mutated(pod(labels))["spec"]["containers"][0])
    assert env["ELASTICRUN_POD_INDEX"] == {"fieldRef": {
        "apiVersion": "v1", "fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}
    job_pod = pod({webhook.RUN_LABEL: "r", "batch.kubernetes.io/job-completion-index": "3"})
    assert "ELASTICRUN_POD_INDEX" not in env_of(webhook.mutated(job_pod)["spec"]["containers"][0])


def test_a_containers_own_max_restarts_is_kept() -> None:
    """torchrun's default of 0 restarts is replaced, a value the user wrote is not."""
    spec = pod({webhook.RUN_LABEL: "r"})
    spec["spec"]["containers"][0]["env"] = [{"name": "PET_MAX_RESTARTS", "value": "2"}]
    env = env_of(webhook.mutated(spec)["spec"]["containers"][0])
    assert env["PET_MAX_RESTARTS"] == "2"


def test_a_single_count_means_a_fixed_size() -> None:
    out = webhook.mutated(pod({webhook.RUN_LABEL: "r"}, {webhook.NNODES_ANNOTATION: "3"}))
    assert env_of(out["spec"]["containers"][0])["PET_NNODES"] == "3:3"


def test_user_values_win_and_are_reported() -> None:
    user_env = [{"name": "PET_RDZV_BACKEND", "value": "c10d"},
                {"name": "POD_IP", "value": "10.1.2.3"}]
    p = pod({webhook.RUN_LABEL: "r"},
            containers=[{"name": "t", "image": "i", "env": copy.deepcopy(user_env)}])
    plan = webhook.plan_mutation(p)
    out = jsonpatch.apply_patch(p, plan.ops)
    env = out["spec"]["containers"][0]["env"]
    assert env[:2] == user_env  # untouched, still first
    assert env_of(out["spec"]["containers"][0])["PET_RDZV_ID"] == "r"
    assert [e["name"] for e in env].count("POD_IP") == 1
    assert len(plan.warnings) == 1 and "PET_RDZV_BACKEND='c10d'" in plan.warnings[0]
    assert all(op["op"] == "add" for op in plan.ops)


def test_mutation_is_idempotent() -> None:
    p = pod({webhook.RUN_LABEL: "r"}, {webhook.NNODES_ANNOTATION: "1:2"})
    once = webhook.mutated(p)
    assert webhook.mutation_for(once) == []
    assert webhook.mutated(once) == once


def test_pod_without_the_label_is_never_touched() -> None:
    p = pod({"app": "web"}, {webhook.NNODES_ANNOTATION: "nonsense"})
    assert webhook.mutation_for(p) == []
    assert webhook.read_opt_in(p["metadata"]["labels"], p["metadata"]["annotations"]) is None


@pytest.mark.parametrize(("annotations", "expected"), [
    ({webhook.NNODES_ANNOTATION: "5:2"}, 'write the smaller number first, e.g. "2:5"'),
    ({webhook.NNODES_ANNOTATION: "abc"}, 'write e.g. elasticrun.dev/nnodes: "2:4"'),
    ({webhook.NNODES_ANNOTATION: "1:2:3"}, "is not a node count"),
    ({webhook.NNODES_ANNOTATION: "0:2"}, "MIN must be at least 1"),
    ({webhook.NNODES_ANNOTATION: "²"}, "is not a node count"),
    ({webhook.NNODES_ANNOTATION: "1:9999"}, 'limit of 2048 nodes; write e.g. "1:2048"'),
    ({webhook.NPROC_ANNOTATION: "many"}, 'a whole number of at least 1 (e.g. "8")'),
    ({webhook.NPROC_ANNOTATION: "0"}, "is not a process count"),
])
def test_bad_annotations_are_refused_with_what_to_write(annotations: dict[str, str],
                                                        expected: str) -> None:
    with pytest.raises(webhook.OptInError) as info:
        webhook.plan_mutation(pod({webhook.RUN_LABEL: "r"}, annotations))
    assert expected in str(info.value)


@pytest.mark.parametrize("name", ["My_Run", "run.v2", "-x", "a" * 64])
def test_run_label_must_be_a_dns_label(name: str) -> None:
    with pytest.raises(webhook.OptInError) as info:
        webhook.read_opt_in({webhook.RUN_LABEL: name}, {})
    message = str(info.value)
    assert "lower-case letters, digits and '-'" in message
    suggestion = message.rsplit(f"{webhook.RUN_LABEL}: ", 1)[1]
    assert webhook.read_opt_in({webhook.RUN_LABEL: suggestion}, {}) is not None


@pytest.mark.parametrize("value", ["auto", "gpu", "cpu", "xpu", "16"])
def test_nproc_words_torchrun_knows_are_accepted(value: str) -> None:
    assert webhook.parse_nproc_per_node(value) == value


def test_configure_webhook_refuses_to_run_without_a_certificate() -> None:
    with pytest.raises(ValueError, match="--webhook-cert"):
        webhook.configure_webhook(kopf.OperatorSettings(), addr="127.0.0.1", port=1, host=None,
                                  certfile=None, pkeyfile=None, cafile=None, managed=None)


def test_self_signed_certificate_verifies_for_its_names(tmp_path: Path) -> None:
    cert = generate_serving_cert(tmp_path, ["svc.ns.svc", "127.0.0.1"])
    assert cert.pkeyfile.stat().st_mode & 0o077 == 0
    for name in ("svc.ns.svc", "127.0.0.1"):
        result = subprocess.run(
            ["openssl", "verify", "-CAfile", str(cert.cafile), "-verify_hostname" if "svc" in name
             else "-verify_ip", name, "-purpose", "sslserver", str(cert.certfile)],
            capture_output=True, text=True, check=False)
        assert result.returncode == 0, result.stdout + result.stderr
    wrong = subprocess.run(["openssl", "verify", "-CAfile", str(cert.cafile), "-verify_hostname",
                            "other.ns.svc", str(cert.certfile)], capture_output=True, check=False)
    assert wrong.returncode != 0
    ctx = ssl.create_default_context(purpose=ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert.certfile, cert.pkeyfile)  # key matches the certificate


def test_ca_bundle_patch_guards_each_entry_by_name_and_skips_current_ones() -> None:
    config = {"webhooks": [{"name": "a", "clientConfig": {"caBundle": "NEW"}},
                           {"name": "b", "clientConfig": {"service": {"name": "s"}}}]}
    ops = ca_bundle_patch(config, "NEW")
    assert ops == [{"op": "test", "path": "/webhooks/1/name", "value": "b"},
                   {"op": "add", "path": "/webhooks/1/clientConfig/caBundle", "value": "NEW"}]
    patched = jsonpatch.apply_patch(config, ops)
    assert ca_bundle_patch(patched, "NEW") == []


# --------------------------------------------------------------------------- launchers

TRAINJOB = "trainer.kubeflow.org/trainjob-name"
JOBSET = "jobset.sigs.k8s.io/jobset-name"
JOB = "batch.kubernetes.io/job-name"


@pytest.mark.parametrize(("labels", "run"), [
    ({TRAINJOB: "tj", JOBSET: "tj", JOB: "tj-node-0"}, "tj"),
    ({JOBSET: "js", JOB: "js-workers-0"}, "js"),
    ({JOB: "plain", "batch.kubernetes.io/controller-uid": "u"}, "plain"),
    # The outermost workload names the run whatever the other labels say.
    ({TRAINJOB: "outer", JOBSET: "middle", JOB: "inner"}, "outer"),
])
def test_an_empty_run_label_is_filled_from_the_outermost_workload(labels: dict[str, str],
                                                                   run: str) -> None:
    p = pod({webhook.RUN_LABEL: "", **labels})
    out = webhook.mutated(p)
    # The label on the stored pod is the run name: the operator keys its pod watch by it.
    assert out["metadata"]["labels"][webhook.RUN_LABEL] == run
    assert env_of(out["spec"]["containers"][0])["PET_RDZV_ID"] == run
    assert {k: v for k, v in out["metadata"]["labels"].items()
            if k != webhook.RUN_LABEL} == labels
    assert webhook.mutation_for(out) == []  # idempotent once filled


def test_a_named_run_label_is_never_replaced_by_the_workload() -> None:
    out = webhook.mutated(pod({webhook.RUN_LABEL: "mine", JOBSET: "js"}))
    assert out["metadata"]["labels"][webhook.RUN_LABEL] == "mine"
    assert env_of(out["spec"]["containers"][0])["PET_RDZV_ID"] == "mine"


@pytest.mark.parametrize(("labels", "expected"), [
    ({}, "carries none of trainer.kubeflow.org/trainjob-name, jobset.sigs.k8s.io/jobset-name, "
         "batch.kubernetes.io/job-name to name the run after; write the run name into the "
         "label, e.g. elasticrun.dev/run: my-run"),
    ({JOB: "train.v2"}, "taken from batch.kubernetes.io/job-name: 'train.v2' is not a valid "
                        "ElasticRun name; write one into the label, e.g. "
                        "elasticrun.dev/run: train-v2"),
    ({JOBSET: "A" * 70}, "is not a valid ElasticRun name"),
])
def test_an_empty_run_label_without_a_usable_workload_name_is_refused(
        labels: dict[str, str], expected: str) -> None:
    with pytest.raises(webhook.OptInError) as info:
        webhook.plan_mutation(pod({webhook.RUN_LABEL: "", **labels}))
    assert expected in str(info.value)


def test_the_nnodes_annotation_wins_over_a_launcher_set_pet_nnodes() -> None:
    # What Trainer's torch plugin puts in a TrainJob's trainer container (numNodes: 3).
    trainer_env = [{"name": "PET_NNODES", "value": "3"},
                   {"name": "PET_NPROC_PER_NODE", "value": "1"},
                   {"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {
                       "fieldPath": "metadata.annotations['batch.kubernetes.io/"
                                    "job-completion-index']"}}},
                   {"name": "PET_MASTER_ADDR", "value": "tj-node-0-0.tj"},
                   {"name": "PET_MASTER_PORT", "value": "29400"}]
    p = pod({webhook.RUN_LABEL: "", JOBSET: "tj", JOB: "tj-node-0"},
            {webhook.NNODES_ANNOTATION: "2:3"},
            containers=[{"name": "node", "image": "i", "env": copy.deepcopy(trainer_env)}])
    plan = webhook.plan_mutation(p)
    out = jsonpatch.apply_patch(p, plan.ops)
    env = env_of(out["spec"]["containers"][0])
    assert env["PET_NNODES"] == "2:3"
    assert [e["name"] for e in out["spec"]["containers"][0]["env"]].count("PET_NNODES") == 1
    # The launcher's rank and master stay; torchrun ignores them with the k8s backend.
    assert env["PET_MASTER_ADDR"] == "tj-node-0-0.tj" and env["PET_NODE_RANK"] is not None
    assert env["PET_RDZV_BACKEND"] == "k8s" and env["PET_RDZV_ID"] == "tj"
    assert plan.warnings == ["container 'node' sets PET_NNODES='3'; elasticrun.dev/nnodes "
                             "makes it '2:3'"]
    assert webhook.mutation_for(out) == []


def test_without_the_annotation_a_launcher_set_pet_nnodes_stays() -> None:
    p = pod({webhook.RUN_LABEL: "r"},
            containers=[{"name": "n", "image": "i", "env": [{"name": "PET_NNODES",
                                                             "value": "1:4"}]}])
    plan = webhook.plan_mutation(p)
    assert env_of(jsonpatch.apply_patch(p, plan.ops)["spec"]["containers"][0])[
        "PET_NNODES"] == "1:4"
    assert plan.warnings == []
