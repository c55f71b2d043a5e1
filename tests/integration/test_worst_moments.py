"""Failures at the worst moment: a node, the operator or the API server gone when it hurts most.

Every node runs as torch's agent would (``node_agent.py --use-store``): it uses
each round's store and, if that fails, calls ``next_rendezvous()`` again.  The
faults land where a node waits on something other than the run's watch (rank
0's store right after sealing, the exit barrier), or where one writer is half
way through (a seal, a removal).  Nobody may hang or raise; every survivor must
end in one working round, and each test records its recovery time for
``docs/reliability.md``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from elasticrun.api.kube import ApiError, lease_path
from elasticrun.api.naming import lease_name

from chaoskit import NodeProcess, record, start_node
from conftest import Cluster, OperatorProcess, ProcessGroup, consistently, wait_for
from controlplane.localcluster import LocalControlPlane
from rdzv import is_waiting, metric, read_run
from timings import outlasting

pytestmark = pytest.mark.slow

#: The issue's set-up: a short heartbeat, renewed every second.
HEARTBEAT = 3
CONF = f"heartbeat_timeout={HEARTBEAT},lease_interval=1,last_call_timeout=1,join_timeout=60"
WHO = {"operator": "with the operator", "pod-deleted": "with the operator, Pod deleted",
       "no-operator": "without the operator"}


def start(processes: ProcessGroup, cluster: Cluster, namespace: str, run: str, tmp_path: Path,
          names: list[str], nnodes: str, *extra: str, conf: str = CONF) -> list[NodeProcess]:
    return [start_node(processes, cluster.kubeconfig, namespace, run, name, tmp_path, nnodes,
                       conf, "--use-store", *extra) for name in names]


def working_round(node: NodeProcess, after: int) -> dict[str, Any] | None:
    """The node's latest round after ``after`` in which it used the store."""
    used = [e for e in node.of("store") if e["ok"] and e["round"] > after]
    return used[-1] if used else None


def one_working_round(survivors: list[NodeProcess], after: int, bound: float) -> tuple[int, float]:
    """The round every survivor used after round ``after``, and when the last one did."""
    finals = [wait_for(lambda n=n: working_round(n, after), bound,
                       f"{n.node} to use the store of a round after {after}") for n in survivors]
    rounds = {f["round"] for f in finals}
    if len(rounds) > 1:  # one survivor was quicker: wait for the others to join it
        last = max(rounds)
        finals = [wait_for(lambda n=n: working_round(n, last - 1), 30,
                           f"{n.node} in round {last}") for n in survivors]
    (final_round,) = {f["round"] for f in finals}
    return final_round, max(f["t"] for f in finals)


def assert_round_of(survivors: list[NodeProcess], final_round: int, cluster: Cluster,
                    namespace: str, run: str) -> None:
    """The survivors, and only they, hold ranks 0..n-1 of ``final_round``; nobody raised."""
    for node in survivors:
        assert not node.of("error"), (node.node, node.of("error"))
        (joined,) = [e for e in node.rendezvous() if e["round"] == final_round]
        assert joined["world"] == len(survivors)
    ranks = sorted(e["rank"] for n in survivors for e in n.rendezvous()
                   if e["round"] == final_round)
    assert ranks == list(range(len(survivors)))
    status = read_run(cluster.client, namespace, run).status
    assert status.round == final_round
    assert {p.name for p in status.participants} == {n.node for n in survivors}


def dying(nodes: list[NodeProcess], timeout: float, what: str
          ) -> tuple[NodeProcess, dict[str, Any]]:
    """The node that killed itself at its die point, and its last word."""
    node: NodeProcess = wait_for(lambda: next((n for n in nodes if n.of("dying")), None),
                                 timeout, what)
    return node, node.of("dying")[0]


def how_out(cluster: Cluster, namespace: str, run: str, node: str, final_round: int) -> str:
    lost = [m for m in read_run(cluster.client, namespace, run).status.lost_members
            if m.name == node]
    return f"recorded as {lost[-1].reason}" if lost else f"left out of round {final_round}"


# --------------------------------------------------------------------------- rank 0 killed


@pytest.mark.parametrize("signal_", ["operator", "pod-deleted", "no-operator"])
def test_rank0_lost_right_after_sealing(signal_: str, request: pytest.FixtureRequest,
                                        cluster: Cluster, namespace: str,
                                        processes: ProcessGroup, tmp_path: Path) -> None:
    names = [f"w{i}" for i in range(4)]
    extra: list[str] = []
    pods = None
    if signal_ != "no-operator":
        request.getfixturevalue("operator")
    if signal_ == "pod-deleted":
        pods = request.getfixturevalue("pods")
        for name in names:
            pods.create(name, "worst")
    nodes = [start_node(processes, cluster.kubeconfig, namespace, "worst", name, tmp_path,
                        "3:4", CONF, "--use-store", "--die-at", "leader-after-rendezvous",
                        *(["--pod", name] if pods is not None else extra))
             for name in names]
    started = min(n.wait_event("ready", 30)["t"] for n in nodes)
    leader, died = dying(nodes, 60, "rank 0 of the first round to vanish")
    if pods is not None:
        pods.delete(leader.node)  # preempted: the kubelet's last word on the pod
    survivors = [n for n in nodes if n is not leader]

    # Well within 45 s of the start, as the issue asks: the bound of the wait.
    bound = max(1.0, 45 - (died["t"] - started))
    final_round, last = one_working_round(survivors, died["round"], bound)
    recovered = last - died["t"]
    assert_round_of(survivors, final_round, cluster, namespace, "worst")
    how = how_out(cluster, namespace, "worst", leader.node, final_round)
    if signal_ == "pod-deleted":
        assert how == "recorded as PodDeleted"
    print(f"\nrank 0 ({leader.node}) gone after sealing round {died['round']}: every survivor "
          f"used round {final_round}'s store {recovered:.2f}s later ({WHO[signal_]}; "
          "heartbeat 3 s)")
    record(f"rank 0 killed right after sealing ({WHO[signal_]})",
           fault="4 nodes (3:4), heartbeat 3 s, renewal 1 s; rank 0 SIGKILLed as "
                 "next_rendezvous() returned (its TCPStore gone, no shutdown)"
                 + ("; its Pod deleted" if pods is not None else "")
                 + "; survivors use the store and re-enter on failure, as torch's agent does",
           expected="nobody hangs on the dead store or raises; the 3 survivors in one round "
                    "with a working store within heartbeat + 2 s"
                    + (" (2 s with the Pod deleted)" if pods is not None else ""),
           observed=f"round {final_round} of 3, every survivor used its store; rank 0 {how}",
           recovery_seconds=round(recovered, 2))


def test_rank0_lost_while_a_late_node_is_admitted(operator: OperatorProcess, cluster: Cluster,
                                                  namespace: str, processes: ProcessGroup,
                                                  tmp_path: Path) -> None:
    first = start(processes, cluster, namespace, "admit", tmp_path, ["a0", "a1", "a2"], "3:4",
                  "--die-at", "leader-at-admission")
    for node in first:
        node.wait_event("store", 60)
    late = start(processes, cluster, namespace, "admit", tmp_path, ["a3"], "3:4")[0]
    leader, died = dying(first, 30, "rank 0 to vanish as the late node is announced")
    survivors = [n for n in first if n is not leader] + [late]
    final_round, last = one_working_round(survivors, 1, 45)
    recovered = last - died["t"]
    assert_round_of(survivors, final_round, cluster, namespace, "admit")
    how = how_out(cluster, namespace, "admit", leader.node, final_round)
    print(f"\nrank 0 ({leader.node}) gone while a3 was admitted: round {final_round} of 3 "
          f"working {recovered:.2f}s later")
    record("rank 0 killed while a late node is admitted",
           fault="round of 3 (3:4) running, a 4th node joins; rank 0 SIGKILLed the moment it "
                 "hears of it (num_nodes_waiting() > 0), before re-joining",
           expected="the other 2 members and the late node form a round of 3 with a working "
                    "store; nobody raises",
           observed=f"round {final_round} of 3 (2 members + the late node), every node used "
                    f"its store; rank 0 {how}",
           recovery_seconds=round(recovered, 2))


def test_rank0_lost_during_the_exit_barrier(operator: OperatorProcess, cluster: Cluster,
                                            namespace: str, processes: ProcessGroup,
                                            tmp_path: Path) -> None:
    nodes = start(processes, cluster, namespace, "barrier", tmp_path, ["b0", "b1", "b2"],
                  "3:3", "--rounds", "1", "--die-at", "leader-in-exit-barrier")
    leader, died = dying(nodes, 60, "rank 0 to vanish in the exit barrier")
    survivors = [n for n in nodes if n is not leader]
    # torch's exit barrier waits up to 300 s; a dead rank 0 must not hold the others that long.
    done = [n.wait_event("shutdown", 30) for n in survivors]
    recovered = max(e["t"] for e in done) - died["t"]
    for node in survivors:
        (barrier,) = node.of("exit-barrier")
        assert barrier["ok"] is False  # it could not complete without rank 0 ...
        assert node.proc.wait(10) == 0  # ... and the agent still exits as having succeeded
        assert not node.of("error")

    def recorded() -> dict[str, str] | None:
        status = read_run(cluster.client, namespace, "barrier").status
        reasons = {m.name: m.reason for m in status.lost_members}
        return reasons if len(reasons) == 3 else None

    reasons = wait_for(recorded, 15, "every member of round 1 recorded as gone")
    assert {reasons[n.node] for n in survivors} == {"Left"}
    assert reasons[leader.node] in ("LeaseExpired", "LeaseMissing")
    print(f"\nrank 0 ({leader.node}) gone in the exit barrier: the others exited "
          f"{recovered:.2f}s later; rank 0 {reasons[leader.node]}")
    record("rank 0 killed during the exit barrier",
           fault="round of 3 finished training; rank 0 SIGKILLed while the others wait in "
                 "torch's exit barrier (timeout 300 s) on its store",
           expected="the others leave at once (their barrier fails, as torch logs it) and are "
                    "recorded as Left; only rank 0 is recorded lost",
           observed=f"both exited 0 {recovered:.2f}s after the kill, recorded Left; rank 0 "
                    f"recorded as {reasons[leader.node]}",
           recovery_seconds=round(recovered, 2))


# --------------------------------------------------------------------------- other ranks, operator


def test_member_lost_between_its_join_and_the_seal(operator: OperatorProcess, cluster: Cluster,
                                                   namespace: str, processes: ProcessGroup,
                                                   tmp_path: Path) -> None:
    # No last call within the test: only the 4th request (maxNodes) makes the round sealable.
    conf = CONF.replace("last_call_timeout=1", "last_call_timeout=60")
    early = start(processes, cluster, namespace, "between", tmp_path, ["j0", "j1", "j2"], "3:4",
                  conf=conf)
    wait_for(lambda: all(is_waiting(cluster.client, namespace, "between", n.node)
                         for n in early), 30, "the first three waiting")
    (victim,) = start(processes, cluster, namespace, "between", tmp_path, ["j3"], "3:4",
                      "--die-at", "after-join", conf=conf)
    killed = victim.wait_event("dying", 30)["t"]

    def round_of_survivors() -> int | None:
        """A round sealed with the three (not round 1 with j3 removed from it)."""
        status = read_run(cluster.client, namespace, "between").status
        names = {p.name for p in status.participants}
        return status.round if names == {n.node for n in early} and not status.degraded \
            else None

    survivors_round = wait_for(round_of_survivors, 30, "a round of the three live nodes")
    final_round, last = one_working_round(early, survivors_round - 1, 30)
    recovered = last - killed
    assert_round_of(early, final_round, cluster, namespace, "between")
    how = how_out(cluster, namespace, "between", "j3", final_round)
    sealed_with_j3 = any(e["world"] == 4 for n in early for e in n.rendezvous())
    print(f"\nj3 gone between its join and the seal: round {final_round} of 3 working "
          f"{recovered:.2f}s later; j3 {how}"
          f" (round 1 was sealed with it: {sealed_with_j3})")
    record("non-zero rank killed between its join and the seal",
           fault="3 nodes waiting (3:4); the 4th writes its join request, which makes the "
                 "round sealable, and is SIGKILLed before it seals",
           expected="the round sealed with the dead node is re-formed without it: the 3 live "
                    "nodes end in one working round of 3; nobody raises",
           observed=f"round {final_round} of 3, every node used its store; j3 {how}"
                    + (" after round 1 was sealed with it" if sealed_with_j3 else ""),
           recovery_seconds=round(recovered, 2))


def test_operator_killed_while_removing_a_member(operator: OperatorProcess, cluster: Cluster,
                                                 namespace: str, processes: ProcessGroup,
                                                 tmp_path: Path) -> None:
    nodes = start(processes, cluster, namespace, "opkill", tmp_path, ["o0", "o1", "o2"], "2:3")
    first = {n.node: n.wait_event("store", 60) for n in nodes}
    victim = next(n for n in nodes if n.rendezvous()[0]["rank"] == 2)
    survivors = [n for n in nodes if n is not victim]
    killed = victim.kill()

    def removal_written() -> bool:
        return any(m.name == victim.node
                   for m in read_run(cluster.client, namespace, "opkill").status.lost_members)

    wait_for(removal_written, 30, "the operator's removal of the killed member", interval=0.01)
    operator.kill()  # right after its status write, before or while it deletes the Lease
    restarted_at = time.time()
    operator.start()
    final_round, last = one_working_round(survivors, max(e["round"] for e in first.values()),
                                          45)
    recovered = last - killed
    assert_round_of(survivors, final_round, cluster, namespace, "opkill")
    status = read_run(cluster.client, namespace, "opkill").status
    assert [m.name for m in status.lost_members] == [victim.node]  # recorded once

    def lease_gone() -> bool:
        try:
            cluster.client.request("GET", lease_path(namespace, lease_name("opkill",
                                                                           victim.node)))
        except ApiError as exc:
            return exc.not_found
        return False

    wait_for(lease_gone, 20, "the restarted operator to delete the dead member's Lease")
    tidy = time.time() - restarted_at
    print(f"\noperator killed as it removed {victim.node}: survivors in round {final_round} "
          f"{recovered:.2f}s after the kill; Lease deleted {tidy:.2f}s after the restart")
    record("operator SIGKILLed while removing a member",
           fault="rank 2 of 3 SIGKILLed; the operator SIGKILLed the moment its removal is "
                 "written (before or while it deletes the member's Lease), then restarted",
           expected="the survivors re-form once; the loss is recorded once; the restarted "
                    "operator finishes the removal (the dead member's Lease is deleted)",
           observed=f"round {final_round} of 2, every survivor used its store; 1 lost record; "
                    f"Lease deleted {tidy:.1f}s after the restart",
           recovery_seconds=round(recovered, 2))


# --------------------------------------------------------------------------- the API server


def test_apiserver_restarted_while_a_round_is_sealed(
        operator: OperatorProcess, cluster: Cluster, namespace: str, processes: ProcessGroup,
        tmp_path: Path, local_control_plane: LocalControlPlane) -> None:
    local = local_control_plane
    # 3 of 3:4 waiting seal when the last call of 3 s, counted from the 3rd arrival, ends.
    conf = CONF.replace("last_call_timeout=1", "last_call_timeout=3")
    nodes = start(processes, cluster, namespace, "apiseal", tmp_path, ["s0", "s1", "s2"], "3:4",
                  conf=conf)
    wait_for(lambda: all(is_waiting(cluster.client, namespace, "apiseal", n.node)
                         for n in nodes), 30, "all three waiting")
    all_waiting = time.monotonic()
    time.sleep(2.0)  # the last call ends 2.9-3 s after the 3rd arrival: inside the outage
    assert read_run(cluster.client, namespace, "apiseal").status.round == 0
    stopping, stopping_clock = time.time(), time.monotonic()
    local.stop_apiserver()
    stopped = time.monotonic()
    try:
        time.sleep(3)  # the outage itself (as long as the heartbeat): it is the fault
    finally:
        local.start_apiserver()  # waits for /readyz
    back = time.time()
    outage = time.monotonic() - stopped
    final_round, last = one_working_round(nodes, 0, 60)
    recovered = last - back
    assert final_round == 1  # one round, sealed once the API server was back
    assert_round_of(nodes, final_round, cluster, namespace, "apiseal")
    # The operator counts Lease expiry again from the API server's return, once it saw
    # it back: a wrong removal shows within a heartbeat of that.
    wait_for(lambda: metric(operator.metrics(), "elasticrun_apiserver_reachable") == 1, 15,
             "the operator to see the API server back")

    def kept() -> bool:
        status = read_run(cluster.client, namespace, "apiseal").status
        return status.round == 1 and status.lost_members == ()

    consistently(kept, outlasting(HEARTBEAT), "a member removed for the outage")
    status = read_run(cluster.client, namespace, "apiseal").status
    assert status.round == 1 and status.lost_members == ()
    assert status.sealed_at is not None
    sealed = status.sealed_at.timestamp()
    assert sealed >= stopping  # the fault hit the seal: it was written after the stop began
    print(f"\nAPI server stopping {stopping_clock - all_waiting:.1f}s after all waited, down "
          f"{outage:.1f}s; sealed {sealed - stopping:+.2f}s after the stop began, "
          f"{sealed - back:+.2f}s after the return; every node used round 1's store "
          f"{recovered:.2f}s after the return")
    record("kube-apiserver restarted while a round is being sealed",
           fault=f"API server down for {outage:.1f}s (etcd kept) across the moment the last "
                 "call lets 3 waiting nodes (3:4) seal; their compare-and-sets fail",
           expected="the seal is retried once the API server is back: one round of 3 with a "
                    "working store; nobody is removed for the outage",
           observed=f"round 1 of 3 sealed {sealed - back:.1f}s after the return (retried), "
                    "every node used its store; no member lost",
           recovery_seconds=round(recovered, 2))
