"""status.desired from the workload owning the run's pods: the real operator, a real API server.

No Job controller runs here: the test creates the Job (or StatefulSet) and the
Pod objects it would own, and patches the Job as Kueue or a user would.
"""

from __future__ import annotations

import time

from owned import create_job, create_owned_pod, patch_job

from elasticrun.api.model import RunSpec, new_run_manifest

from conftest import Cluster, Kubelet, OperatorProcess, wait_for
from rdzv import read_run


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
                   want: tuple[int, str | None, int], timeout: float = 10) -> float:
    """Seconds until the status says ``want`` (bounded)."""
    started = time.monotonic()
    wait_for(lambda: _desired(cluster, namespace, run) == want, timeout,
             f"status.desired, desiredFrom, coming = {want} "
             f"(last: {_desired(cluster, namespace, run)})")
    return time.monotonic() - started


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
