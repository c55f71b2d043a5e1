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

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from owned import create_job, create_owned_pod, patch_job

from elasticrun.api.gateway import RunGateway
from elasticrun.api.kube import MERGE_PATCH, run_path
from elasticrun.api.model import RunSpec

from conftest import TEST_NODE_CONF, Cluster, Kubelet, OperatorProcess, wait_for
from rdzv import read_run, rendezvous_all, start_rendezvous

#: A last call long enough that a round formed well inside it did not wait for it.
LONG_LAST_CALL = 30


def _ok(outcomes: dict[str, Any]) -> None:
    errors = {n: o.error for n, o in outcomes.items() if o.error}
    assert not errors, errors


def make_run(cluster: Cluster, namespace: str, name: str, min_nodes: int, max_nodes: int,
             last_call: int) -> None:
    """The run as a user's manifest creates it (the handlers find it there)."""
    spec = RunSpec(min_nodes=min_nodes, max_nodes=max_nodes,
                   join_timeout=int(TEST_NODE_CONF["join_timeout"]),
                   last_call_timeout=last_call,
                   heartbeat_timeout=int(TEST_NODE_CONF["heartbeat_timeout"]),
                   lease_renew_interval=int(TEST_NODE_CONF["lease_interval"]))
    assert RunGateway(cluster.client, namespace, name).create(spec) is not None


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


def desire(cluster: Cluster, namespace: str, name: str, size: int) -> None:
    """Write ``status.desired`` as the operator does for a Job of ``size`` pods."""
    cluster.client.request("PATCH", run_path(namespace, name, "status"),
                           body={"status": {"desired": size, "desiredFrom": "Job/train"}},
                           content_type=MERGE_PATCH)
    desired_size(cluster, namespace, name, size)


@dataclass
class Agent:
    """A member's torch agent: re-joins whenever ``num_nodes_waiting()`` is positive."""

    handler: Any
    #: (round, world size) of every round this agent's node was in, in order.
    rounds: list[tuple[int, int]] = field(default_factory=list)
    error: BaseException | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def start(self, first: tuple[int, int]) -> None:
        self.rounds.append(first)
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        try:
            while not self.stop.is_set():
                if self.handler.num_nodes_waiting() > 0:
                    info = self.handler.next_rendezvous()
                    run = self.handler.watcher.latest
                    self.rounds.append((run.status.round if run else -1, info.world_size))
                self.stop.wait(0.1)  # torch's monitor interval
        except BaseException as exc:
            self.error = exc

    def halt(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(30)


def _agents(handlers: list[Any], outcomes: dict[str, Any], round_: int) -> list[Agent]:
    agents = [Agent(h) for h in handlers]
    for agent in agents:
        agent.start((round_, outcomes[agent.handler.settings.node_name].world_size))
    return agents


def test_first_round_forms_as_soon_as_the_jobs_pods_have_joined(
        operator: OperatorProcess, make_handler: Any, cluster: Cluster, namespace: str,
        pods: Kubelet) -> None:
    make_run(cluster, namespace, "want4", 2, 8, LONG_LAST_CALL)
    job = create_job(cluster.client, namespace, "want4", "want4", parallelism=4)
    names = [f"want4-{i}" for i in range(4)]
    job_pods(pods, job, "want4", names)
    desired_size(cluster, namespace, "want4", 4)  # the operator read the Job
    handlers = [make_handler("want4", name, min_nodes=2, max_nodes=8, pod=name,
                             last_call_timeout=LONG_LAST_CALL) for name in names]
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
    assert {p.pod for p in run.status.participants} == set(names)
    assert run.status.desired is not None and run.status.desired.source == "Job/want4"
    assert formed < LONG_LAST_CALL / 3, formed


def test_without_desired_the_first_round_waits_the_last_call(
        make_handler: Any, cluster: Cluster, namespace: str) -> None:
    last_call = 2
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
    make_run(cluster, namespace, "grow", 2, 4, LONG_LAST_CALL)
    job = create_job(cluster.client, namespace, "grow", "grow", parallelism=2)
    job_pods(pods, job, "grow", ["grow-0", "grow-1"])
    desired_size(cluster, namespace, "grow", 2)
    conf = {"min_nodes": 2, "max_nodes": 4, "last_call_timeout": LONG_LAST_CALL}
    members = [make_handler("grow", name, pod=name, **conf) for name in ("grow-0", "grow-1")]
    first = rendezvous_all(members)
    _ok(first)
    agents = _agents(members, first, 1)
    try:
        # The Job's parallelism patched to 4 (Kueue admitted the slice): two more pods.
        patch_job(cluster.client, namespace, "grow", parallelism=4, completions=4)
        job_pods(pods, job, "grow", ["grow-2", "grow-3"])
        desired_size(cluster, namespace, "grow", 4)
        c_thread, c_box = start_rendezvous(make_handler("grow", "grow-2", pod="grow-2", **conf))
        time.sleep(1.0)  # the second new agent starts about a second later
        d_started = time.monotonic()
        d_thread, d_box = start_rendezvous(make_handler("grow", "grow-3", pod="grow-3", **conf))
        c_thread.join(60)
        d_thread.join(60)
        formed = time.monotonic() - d_started
        wait_for(lambda: all(len(a.rounds) >= 2 for a in agents) or any(
            a.error for a in agents), 30, "the members to re-join")
    finally:
        for agent in agents:
            agent.halt()
    print(f"\nscale-up 2 -> 4: round of 4 formed {formed:.2f}s after the 4th agent started; "
          f"rounds seen: {({a.handler.settings.node_name: a.rounds for a in agents})}")
    assert all(a.error is None for a in agents), [a.error for a in agents]
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
    leaver = next(h for h in nodes if first[h.settings.node_name].rank == 3)
    survivors = [h for h in nodes if h is not leaver]
    started = time.monotonic()
    assert leaver.shutdown() is True
    wait_for(lambda: all(h.num_nodes_waiting() >= 1 for h in survivors), 10,
             "survivors to see the departure")
    second = rendezvous_all(survivors, timeout=60)
    reformed = time.monotonic() - started
    print(f"\nscale-down 4 -> 3: round of 3 formed {reformed:.2f}s after the pod left")
    _ok(second)
    assert sorted(o.rank for o in second.values()) == [0, 1, 2]
    assert {o.world_size for o in second.values()} == {3}
    run = read_run(cluster.client, namespace, "shrink")
    assert run.status.round == 2 and leaver.settings.node_name not in run.status.member_names
    assert run.status.lost_members[-1].reason == "Left"
    assert reformed < LONG_LAST_CALL / 3, reformed


def test_scale_down_by_pod_deletion_the_operator_removes_it_and_the_survivors_reform(
        operator: OperatorProcess, make_handler: Any, cluster: Cluster, namespace: str,
        pods: Kubelet) -> None:
    make_run(cluster, namespace, "cut", 2, 4, LONG_LAST_CALL)
    job = create_job(cluster.client, namespace, "cut", "cut", parallelism=4)
    names = [f"cut-{i}" for i in range(4)]
    job_pods(pods, job, "cut", names)
    desired_size(cluster, namespace, "cut", 4)
    nodes = [make_handler("cut", name, min_nodes=2, max_nodes=4, pod=name,
                          last_call_timeout=LONG_LAST_CALL) for name in names]
    first = rendezvous_all(nodes)
    _ok(first)
    # parallelism 4 -> 3: the Job controller deletes a pod; its agent never says goodbye.
    patch_job(cluster.client, namespace, "cut", parallelism=3, completions=3)
    desired_size(cluster, namespace, "cut", 3)
    gone = next(h for h in nodes if first[h.settings.node_name].rank == 2)
    survivors = [h for h in nodes if h is not gone]
    started = time.monotonic()
    pods.delete(gone.settings.node_name)
    wait_for(lambda: all(h.num_nodes_waiting() >= 1 for h in survivors), 10,
             "survivors to see the operator remove the deleted pod's member")
    second = rendezvous_all(survivors, timeout=60)
    reformed = time.monotonic() - started
    print(f"\nscale-down 4 -> 3 by pod deletion: round of 3 formed {reformed:.2f}s after "
          "the deletion")
    _ok(second)
    assert sorted(o.rank for o in second.values()) == [0, 1, 2]
    assert {o.world_size for o in second.values()} == {3}
    run = read_run(cluster.client, namespace, "cut")
    assert run.status.round == 2 and gone.settings.node_name not in run.status.member_names
    assert run.status.lost_members[-1].reason == "PodDeleted"
    assert reformed < LONG_LAST_CALL / 3, reformed
