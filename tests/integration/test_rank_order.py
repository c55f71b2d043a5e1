"""Ranks by pod index with real handlers, the real operator and the real API server.

The Pods are played (no kubelet): each carries the completion index annotation
an Indexed Job's controller writes, and its node is given the value the
kubelet would put in ``JOB_COMPLETION_INDEX`` (a downward-API ``fieldRef`` of
that annotation), through ``--rdzv-conf pod_index``.
"""

from __future__ import annotations

import time
from typing import Any

from conftest import Cluster, Kubelet, OperatorProcess, wait_for
from rdzv import is_waiting, read_run, rendezvous_all, start_rendezvous

#: The annotation an Indexed Job's controller writes on each of its Pods.
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"


def _indexed_pod(pods: Kubelet, name: str, run: str, index: int) -> int:
    """A played Pod of ``run`` with its completion index; the index its node reads."""
    pods.create(name, run)
    annotations = {COMPLETION_INDEX: str(index)}
    pod = pods.client.request("PATCH", pods.path(name),
                              body={"metadata": {"annotations": annotations}},
                              content_type="application/merge-patch+json")
    return int(pod["metadata"]["annotations"][COMPLETION_INDEX])


def _ranks(outcomes: dict[str, Any]) -> dict[str, int | None]:
    errors = {n: o.error for n, o in outcomes.items() if o.error}
    assert not errors, errors
    return {n: o.rank for n, o in outcomes.items()}


def test_indexes_arriving_3_0_2_1_get_ranks_by_index_and_a_replacement_takes_its_rank_back(
        operator: OperatorProcess, make_handler: Any, pods: Kubelet, cluster: Cluster,
        namespace: str) -> None:
    run = "indexed"
    # Names sort in arrival order, so ranking by arrival (or by name) would give 3,0,2,1.
    arrivals = [("arrive-1", 3), ("arrive-2", 0), ("arrive-3", 2), ("arrive-4", 1)]
    nodes: dict[str, Any] = {}
    boxes: dict[str, dict[str, Any]] = {}
    for name, index in arrivals:
        node = make_handler(run, name, min_nodes=4, max_nodes=4, pod=name,
                            pod_index=_indexed_pod(pods, name, run, index))
        nodes[name] = node
        _, boxes[name] = start_rendezvous(node)
        if name != arrivals[-1][0]:
            wait_for(lambda n=name: is_waiting(cluster.client, namespace, run, n), 20,
                     f"{name} to ask to join")
    wait_for(lambda: all(boxes.values()), 30, "the first round")
    assert not [b["error"] for b in boxes.values() if "error" in b]
    ranks = {name: box["info"].rank for name, box in boxes.items()}
    assert ranks == {"arrive-2": 0, "arrive-4": 1, "arrive-3": 2, "arrive-1": 3}, ranks

    # The index-2 Pod is deleted: the operator removes its member, the survivors re-form
    # with the replacement Pod the Job would create for index 2.
    pods.delete("arrive-3")
    survivors = [nodes["arrive-1"], nodes["arrive-2"], nodes["arrive-4"]]
    deleted = time.monotonic()
    wait_for(lambda: all(h.num_nodes_waiting() >= 1 for h in survivors), 15,
             "the survivors to see the index-2 Pod's loss")
    nodes["arrive-3"].lease.stop_renewing()  # the deleted Pod's node stops renewing, as it would
    lost = [m for m in read_run(cluster.client, namespace, run).status.lost_members
            if m.name == "arrive-3"]
    assert lost and lost[0].reason == "PodDeleted", lost
    replacement = make_handler(run, "replacement", min_nodes=4, max_nodes=4, pod="replacement",
                               pod_index=_indexed_pod(pods, "replacement", run, 2))
    second = _ranks(rendezvous_all([*survivors, replacement]))
    print(f"\nround 2 sealed {time.monotonic() - deleted:.2f}s after the deletion")
    assert second == {"arrive-2": 0, "arrive-4": 1, "replacement": 2, "arrive-1": 3}, second
    status = read_run(cluster.client, namespace, run).status
    assert status.round == 2
    assert {p.name: p.rank for p in status.participants} == second

