"""Rounds that follow the owner's desired size, with real handlers on the real API server.

Where the operator runs, the owner is real: a Job and the Pod objects it owns
(``owned``), whose names the handlers use as their ``POD_NAME``, and the
operator writes ``status.desired`` from the Job's parallelism.  Without an
operator the test writes ``status.desired`` itself through the status
subresource, as the operator would; the nodes carry it through their own
status writes.  A member's agent is played by a thread that, like torch's,
polls ``num_nodes_waiting()`` and calls ``next_rendezvous()`` again when it
is positive.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from owned import create_job, create_owned_pod, patch_job

from elasticrun.api import crd
from elasticrun.api.kube import MERGE_PATCH, KubeClient, load_credentials, run_path
from elasticrun.api.model import RunSpec, new_run_manifest
from elasticrun.operator import runrbac

from chartkit import request_token, role_bound, token_kubeconfig
from conftest import Cluster, Kubelet, OperatorProcess, wait_for
from rdzv import Agent, make_run, read_run, rendezvous_all, start_rendezvous

#: A last call long enough that a round formed well inside it did not wait for it.
LONG_LAST_CALL = 30


def _ok(outcomes: dict[str, Any]) -> None:
    errors = {n: o.error for n, o in outcomes.items() if o.error}
    assert not errors, errors


def desired_size(cluster: Cluster, namespace: str, name: str, size: int) -> None:
    """Wait (bounded) until the run's ``status.desired`` says ``size``."""
    wait_for(lambda: (d := read_run(cluster.client, namespace, name).status.desired)
             is not None and d.size == size, 10,
             f"status.desired {size} "
             f"(last: {read_run(cluster.client, namespace, name).status.desired})")


def job_pods(pods: Kubelet, job: dict[str, Any], run: str, names: list[str]) -> None:
    """The Running pods of ``job`` that the handlers named ``names`` play."""
    for name in names:
        create_owned_pod(pods, name, run, job)


def job_run(cluster: Cluster, namespace: str, pods: Kubelet, make_handler: Any, run: str,
            min_nodes: int, max_nodes: int, parallelism: int
            ) -> tuple[dict[str, Any], list[Any]]:
    """A run with a long last call, its Job, the Job's Running pods and a handler playing
    each (``POD_NAME``), once the operator has read the Job into ``status.desired``."""
    make_run(cluster, namespace, run, min_nodes, max_nodes, LONG_LAST_CALL)
    job = create_job(cluster.client, namespace, run, run, parallelism=parallelism)
    names = [f"{run}-{i}" for i in range(parallelism)]
    job_pods(pods, job, run, names)
    desired_size(cluster, namespace, run, parallelism)
    return job, [make_handler(run, name, min_nodes=min_nodes, max_nodes=max_nodes, pod=name,
                              last_call_timeout=LONG_LAST_CALL) for name in names]


def desire(cluster: Cluster, namespace: str, name: str, size: int) -> None:
    """Write ``status.desired`` as the operator does for a Job of ``size`` pods."""
    cluster.client.request("PATCH", run_path(namespace, name, "status"),
                           body={"status": {"desired": size, "desiredFrom": "Job/train"}},
                           content_type=MERGE_PATCH)
    desired_size(cluster, namespace, name, size)


def _agents(handlers: list[Any], outcomes: dict[str, Any], round_: int) -> list[Agent]:
    agents = [Agent(h) for h in handlers]
    for agent in agents:
        agent.start((round_, outcomes[agent.handler.settings.node_name].world_size))
    return agents


def _while_members_run(agents: list[Agent], scale: Callable[[], float]) -> float:
    """``scale()`` (the seconds it measured) while the members' agents run; then, bounded,
    until every member re-joined once.  The agents are stopped; their errors fail the test."""
    try:
        measured = scale()
        wait_for(lambda: all(len(a.rounds) >= 2 for a in agents) or any(
            a.error for a in agents), 30, "the members to re-join")
    finally:
        for agent in agents:
            agent.halt()
    assert all(a.error is None for a in agents), [a.error for a in agents]
    return measured


def test_first_round_forms_as_soon_as_the_jobs_pods_have_joined(
        operator: OperatorProcess, make_handler: Any, cluster: Cluster, namespace: str,
        pods: Kubelet) -> None:
    _job, handlers = job_run(cluster, namespace, pods, make_handler, "want4", 2, 8,
                             parallelism=4)
    names = {h.settings.node_name for h in handlers}
    started = time.monotonic()
    outcomes = rendezvous_all(handlers, timeout=60)
    formed = time.monotonic() - started
    print(f"\nrun 2:8, Job of 4, last call {LONG_LAST_CALL}s: round of 4 formed in "
          f"{formed:.2f}s")
    _ok(outcomes)
    assert sorted(o.rank for o in outcomes.values()) == [0, 1, 2, 3]
    assert {o.world_size for o in outcomes.values()} == {4}
    run = read_run(cluster.client, namespace, "want4")
    assert run.status.round == 1 and len(run.status.participants) == 4
    assert {p.pod for p in run.status.participants} == names
    assert run.status.desired is not None and run.status.desired.source == "Job/want4"
    assert formed < LONG_LAST_CALL / 3, formed


def test_without_desired_the_first_round_waits_the_last_call(
        make_handler: Any, cluster: Cluster, namespace: str) -> None:
    # Long enough that four joins land inside it on a loaded machine (at 2 s, under a
    # load of 10 on two cores, the last two once came after it; at 6 s, once in the
    # whole suite, the fourth).
    last_call = 15
    make_run(cluster, namespace, "nowant", 2, 8, last_call)
    handlers = [make_handler("nowant", f"n{i}", min_nodes=2, max_nodes=8,
                             last_call_timeout=last_call) for i in range(4)]
    started = time.monotonic()
    outcomes = rendezvous_all(handlers, timeout=60)
    waited = time.monotonic() - started
    print(f"\nrun 2:8, no desired, last call {last_call}s: round formed in {waited:.2f}s")
    _ok(outcomes)
    assert sorted(o.rank for o in outcomes.values()) == [0, 1, 2, 3]
    assert read_run(cluster.client, namespace, "nowant").status.desired is None
    # Four of at most eight: sealed only once the window has passed.
    assert waited >= last_call - 0.1, waited


def test_scale_up_restarts_the_members_once_for_all_the_new_nodes(
        operator: OperatorProcess, make_handler: Any, cluster: Cluster, namespace: str,
        pods: Kubelet) -> None:
    job, members = job_run(cluster, namespace, pods, make_handler, "grow", 2, 4,
                           parallelism=2)
    conf = {"min_nodes": 2, "max_nodes": 4, "last_call_timeout": LONG_LAST_CALL}
    first = rendezvous_all(members)
    _ok(first)
    agents = _agents(members, first, 1)
    boxes: list[dict[str, Any]] = []

    def grow() -> float:
        # The Job's parallelism patched to 4 (Kueue admitted the slice): two more pods.
        patch_job(cluster.client, namespace, "grow", parallelism=4, completions=4)
        job_pods(pods, job, "grow", ["grow-2", "grow-3"])
        desired_size(cluster, namespace, "grow", 4)
        threads = [start_rendezvous(make_handler("grow", "grow-2", pod="grow-2", **conf))]
        time.sleep(1.0)  # the second new agent starts about a second later
        started = time.monotonic()
        threads.append(start_rendezvous(make_handler("grow", "grow-3", pod="grow-3", **conf)))
        for thread, box in threads:
            thread.join(60)
            boxes.append(box)
        return time.monotonic() - started

    formed = _while_members_run(agents, grow)
    c_box, d_box = boxes
    print(f"\nscale-up 2 -> 4: round of 4 formed {formed:.2f}s after the 4th agent started; "
          f"rounds seen: {({a.handler.settings.node_name: a.rounds for a in agents})}")
    assert "info" in c_box and "info" in d_box, (c_box, d_box)
    assert {c_box["info"].world_size, d_box["info"].world_size} == {4}
    # Round 1 of two, then round 2 of four: one restart, no round of three between.
    for agent in agents:
        assert agent.rounds == [(1, 2), (2, 4)], agent.rounds
    run = read_run(cluster.client, namespace, "grow")
    assert run.status.round == 2
    assert [p.name for p in sorted(run.status.participants, key=lambda p: p.rank)] == [
        "grow-0", "grow-1", "grow-2", "grow-3"]
    assert formed < LONG_LAST_CALL / 3, formed


def test_a_scale_up_short_of_the_desired_size_is_announced_when_the_last_call_ends(
        make_handler: Any, cluster: Cluster, namespace: str) -> None:
    """Desired 4, but only one new pod comes: the members hear of it one last call later."""
    last_call = 3
    make_run(cluster, namespace, "short", 2, 4, last_call)
    desire(cluster, namespace, "short", 2)
    conf = {"min_nodes": 2, "max_nodes": 4, "last_call_timeout": last_call}
    members = [make_handler("short", name, **conf) for name in ("a", "b")]
    first = rendezvous_all(members)
    _ok(first)
    agents = _agents(members, first, 1)
    box: dict[str, Any] = {}

    def grow() -> float:
        desire(cluster, namespace, "short", 4)
        started = time.monotonic()
        thread, got = start_rendezvous(make_handler("short", "c", **conf))
        thread.join(30)
        box.update(got)
        return time.monotonic() - started

    formed = _while_members_run(agents, grow)
    print(f"\nscale-up 2 -> 3 of a desired 4, last call {last_call}s: round of 3 formed "
          f"{formed:.2f}s after the new agent started")
    assert "info" in box and box["info"].world_size == 3, box
    for agent in agents:
        assert agent.rounds == [(1, 2), (2, 3)], agent.rounds
    # Held for the window (the node's own timer ends it), then one restart at once.
    assert last_call - 0.5 <= formed < last_call + 10, formed


def _reform_without(cluster: Cluster, namespace: str, run_name: str, nodes: list[Any],
                    first: dict[str, Any], rank: int, leave: Callable[[Any], None],
                    reason: str, how: str) -> None:
    """The member of ``rank`` leaves by ``leave``; the survivors form the next round at once."""
    leaver = next(h for h in nodes if first[h.settings.node_name].rank == rank)
    survivors = [h for h in nodes if h is not leaver]
    started = time.monotonic()
    leave(leaver)
    wait_for(lambda: all(h.num_nodes_waiting() >= 1 for h in survivors), 10,
             f"survivors to see the departure ({how})")
    second = rendezvous_all(survivors, timeout=60)
    reformed = time.monotonic() - started
    print(f"\nscale-down 4 -> 3 ({how}): round of 3 formed {reformed:.2f}s after the pod left")
    _ok(second)
    assert sorted(o.rank for o in second.values()) == [0, 1, 2]
    assert {o.world_size for o in second.values()} == {3}
    run = read_run(cluster.client, namespace, run_name)
    assert run.status.round == 2 and leaver.settings.node_name not in run.status.member_names
    assert run.status.lost_members[-1].reason == reason
    assert reformed < LONG_LAST_CALL / 3, reformed


def test_scale_down_the_survivors_reform_at_once(
        make_handler: Any, cluster: Cluster, namespace: str) -> None:
    make_run(cluster, namespace, "shrink", 2, 4, LONG_LAST_CALL)
    desire(cluster, namespace, "shrink", 4)
    nodes = [make_handler("shrink", f"n{i}", min_nodes=2, max_nodes=4,
                          last_call_timeout=LONG_LAST_CALL) for i in range(4)]
    first = rendezvous_all(nodes)
    _ok(first)
    assert {o.world_size for o in first.values()} == {4}
    # The Job's parallelism lowered to 3: the owner's count drops, then its pod is
    # deleted and the agent's shutdown on SIGTERM leaves the membership.
    desire(cluster, namespace, "shrink", 3)
    _reform_without(cluster, namespace, "shrink", nodes, first, 3,
                    lambda h: h.shutdown(), "Left", "the agent's shutdown")


def test_scale_down_by_pod_deletion_the_operator_removes_it_and_the_survivors_reform(
        operator: OperatorProcess, make_handler: Any, cluster: Cluster, namespace: str,
        pods: Kubelet) -> None:
    _job, nodes = job_run(cluster, namespace, pods, make_handler, "cut", 2, 4, parallelism=4)
    first = rendezvous_all(nodes)
    _ok(first)
    # parallelism 4 -> 3: the Job controller deletes a pod; its agent never says goodbye.
    patch_job(cluster.client, namespace, "cut", parallelism=3, completions=3)
    desired_size(cluster, namespace, "cut", 3)
    _reform_without(cluster, namespace, "cut", nodes, first, 2,
                    lambda h: pods.delete(h.settings.node_name), "PodDeleted",
                    "the pod deleted, seen by the operator")


def test_a_pods_forged_desired_size_restarts_nobody_and_the_operator_restores_the_owners(
        make_handler: Any, cluster: Cluster, namespace: str, pods: Kubelet,
        tmp_path: Path) -> None:
    """Rows 85-86: a pod of the run (W) writes ``status.desired`` with its own token."""
    cluster.client.request("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts", body={
        "apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "trainer"}})
    spec = RunSpec(min_nodes=2, max_nodes=4, last_call_timeout=LONG_LAST_CALL,
                   heartbeat_timeout=15, lease_renew_interval=5)
    manifest = new_run_manifest("forge", namespace, spec)
    manifest["metadata"]["annotations"] = {runrbac.SERVICE_ACCOUNT_ANNOTATION: "trainer"}
    cluster.client.request("POST", f"/apis/{crd.API_VERSION}/namespaces/{namespace}/"
                           f"{crd.PLURAL}", body=manifest)
    op = OperatorProcess(cluster.kubeconfig, [namespace], tmp_path,
                         extra_args=["--per-run-rbac"]).start()
    try:
        wait_for(lambda: role_bound(cluster, namespace, "forge"), 20, "the per-run Role")
        kubeconfig = token_kubeconfig(cluster, request_token(cluster, namespace, "trainer"),
                                      tmp_path / "trainer.kubeconfig", namespace)
        job = create_job(cluster.client, namespace, "forge", "forge", parallelism=2)
        names = ["forge-0", "forge-1"]
        job_pods(pods, job, "forge", names)
        desired_size(cluster, namespace, "forge", 2)
        members = [make_handler("forge", name, min_nodes=2, max_nodes=4, pod=name,
                                kubeconfig=kubeconfig, last_call_timeout=LONG_LAST_CALL)
                   for name in names]
        _ok(rendezvous_all(members))
        attacker = KubeClient(load_credentials(str(kubeconfig)), timeout=10)
        try:
            for forged in (2**31 - 1, 1, 0):
                # The run's own pods may write its status: the write is accepted...
                written = attacker.request(
                    "PATCH", run_path(namespace, "forge", "status"),
                    body={"status": {"desired": forged, "desiredFrom": "Job/x"}},
                    content_type=MERGE_PATCH)
                assert written["status"]["desired"] == forged
                started = time.monotonic()
                # ... the operator puts the owner's count back on its next pass ...
                desired_size(cluster, namespace, "forge", 2)
                restored = time.monotonic() - started
                print(f"\nforged status.desired {forged}: the Job's 2 back in {restored:.2f}s")
                # ... and the running round of two never restarted for it.
                assert all(h.num_nodes_waiting() == 0 for h in members)
                run = read_run(cluster.client, namespace, "forge")
                assert run.status.round == 1 and run.status.member_names == set(names)
                assert run.status.desired is not None
                assert run.status.desired.source == "Job/forge"
        finally:
            attacker.close()
    finally:
        op.stop()
