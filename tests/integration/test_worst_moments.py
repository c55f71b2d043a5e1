"""Failures at the worst moment: a rank 0 that dies right after its round was sealed.

The survivors have been told the round (rank, world size, rank 0's store) and
rank 0 is gone with its TCPStore, without a shutdown: a preempted pod.  Every
node runs as torch's agent would (``node_agent.py --use-store``): it uses the
round's store and, if that fails, calls ``next_rendezvous()`` again.  Nobody
may hang on the dead store or raise; every survivor must end in one working
round without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from chaoskit import NodeProcess, record, start_node
from conftest import Cluster, ProcessGroup, wait_for
from rdzv import read_run

pytestmark = pytest.mark.slow

#: The issue's set-up: a short heartbeat, renewed every second.
CONF = "heartbeat_timeout=3,lease_interval=1,last_call_timeout=1,join_timeout=60"
RUN = "worst"


def start_four(processes: ProcessGroup, cluster: Cluster, namespace: str,
               tmp_path: Path) -> list[NodeProcess]:
    return [start_node(processes, cluster.kubeconfig, namespace, RUN, f"w{i}", tmp_path, "3:4",
                       CONF, "--use-store", "--die-at", "leader-after-rendezvous")
            for i in range(4)]


def working_round(node: NodeProcess, after: int) -> dict[str, Any] | None:
    """The node's latest round after ``after`` in which it used the store."""
    used = [e for e in node.of("store") if e["ok"] and e["round"] > after]
    return used[-1] if used else None


@pytest.mark.parametrize("with_operator", [True, False], ids=["operator", "no-operator"])
def test_rank0_lost_right_after_sealing(with_operator: bool, request: pytest.FixtureRequest,
                                        cluster: Cluster, namespace: str,
                                        processes: ProcessGroup, tmp_path: Path) -> None:
    if with_operator:
        request.getfixturevalue("operator")
    nodes = start_four(processes, cluster, namespace, tmp_path)
    started = min(n.wait_event("ready", 30)["t"] for n in nodes)
    leader = wait_for(lambda: next((n for n in nodes if n.of("dying")), None), 60,
                      "rank 0 of the first round to vanish")
    died = leader.of("dying")[0]
    first_round = died["round"]
    survivors = [n for n in nodes if n is not leader]

    # Well within 45 s of the start, as the issue asks: the bound of the wait.
    bound = max(1.0, 45 - (died["t"] - started))
    finals = [wait_for(lambda n=n: working_round(n, first_round), bound,
                       f"{n.node} to use the store of a round without {leader.node}")
              for n in survivors]
    rounds = {f["round"] for f in finals}
    if len(rounds) > 1:  # one survivor was quicker: wait for the others to join it
        last = max(rounds)
        finals = [wait_for(lambda n=n: working_round(n, last - 1), 30,
                           f"{n.node} in round {last}") for n in survivors]
    (final_round,) = {f["round"] for f in finals}
    recovered = max(f["t"] for f in finals) - died["t"]

    for node in survivors:
        assert not node.of("error"), (node.node, node.of("error"))
        (joined,) = [e for e in node.rendezvous() if e["round"] == final_round]
        assert joined["world"] == 3
    ranks = sorted(e["rank"] for n in survivors for e in n.rendezvous()
                   if e["round"] == final_round)
    assert ranks == [0, 1, 2]
    run = read_run(cluster.client, namespace, RUN)
    assert {p.name for p in run.status.participants} == {n.node for n in survivors}
    # The dead leader is out either as a recorded loss (its Lease expired first) or
    # because the survivors re-formed by the last-call rule before that.
    lost = [m for m in run.status.lost_members if m.name == leader.node]
    how = f"recorded as {lost[-1].reason}" if lost else f"left out of round {final_round}"
    print(f"\nrank 0 ({leader.node}) gone after sealing round {first_round}: every survivor "
          f"used round {final_round}'s store {recovered:.2f}s later "
          f"({'with' if with_operator else 'without'} the operator; heartbeat 3 s)")
    record(f"rank 0 killed right after sealing ({'operator' if with_operator else 'no operator'})",
           fault="4 nodes (3:4), heartbeat 3 s; rank 0 SIGKILLed as next_rendezvous() returned "
                 "(its TCPStore gone, no shutdown); survivors use the store and re-enter on "
                 "failure, as torch's agent does",
           expected="nobody hangs on the dead store or raises; the 3 survivors in one round "
                    "with a working store within heartbeat + 2 s",
           observed=f"round {final_round} of 3, every survivor used its store; rank 0 {how}",
           recovery_seconds=recovered)


