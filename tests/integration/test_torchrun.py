"""torchrun end to end: real agents with ``--rdzv-backend=k8s``, gloo on the CPU, no operator.

Without the operator nobody removes a killed node at once: the survivors'
collectives fail, their agents restart the workers, and the round re-forms
once the last-call window has passed.  This is the floor users get when the
operator is down; test_demo.py shows the fast path with it.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from elasticrun.api.kube import runs_path
from elasticrun.api.model import parse_run
from elasticrun.api.rounds import FINISHED

from conftest import ROOT, Cluster, ProcessGroup, wait_for
from controlplane.localcluster import kill_tree
from rdzv import RoundLog, start_torchrun_agent

pytestmark = pytest.mark.torchrun
TRAIN = ROOT / "deploy" / "examples" / "train.py"
EPOCHS = 30


def start_agent(processes: ProcessGroup, cluster: Cluster, namespace: str, node: str,
                workdir: Path) -> subprocess.Popen[Any]:
    return start_torchrun_agent(
        processes, cluster.kubeconfig, workdir, node, run="e2e", nnodes="2:3",
        conf=f"namespace={namespace},last_call_timeout=3,heartbeat_timeout=4,lease_interval=1",
        max_restarts=10, script=TRAIN,
        script_args=["--epochs", str(EPOCHS), "--steps-per-epoch", "300",
                     "--checkpoint", str(workdir / "checkpoint.pt")])


def last_epoch(workdir: Path) -> int:
    best = 0
    for log in workdir.glob("node-*.log"):
        for line in log.read_text(errors="replace").splitlines():
            if " epoch " in line and " done, loss " in line and "rank 0/" in line:
                best = max(best, int(line.split(" epoch ")[1].split()[0]))
    return best


def test_three_agents_train_lose_one_and_admit_a_fresh_one(
        cluster: Cluster, namespace: str, processes: ProcessGroup, tmp_path: Path) -> None:
    rounds = RoundLog(cluster.client, namespace, "e2e")
    try:
        agents = {f"node-{i}": start_agent(processes, cluster, namespace, f"node-{i}", tmp_path)
                  for i in range(3)}
        wait_for(lambda: last_epoch(tmp_path) >= 3, 180, "training to reach epoch 3", 0.2)
        first = rounds.rounds[min(rounds.rounds)]
        assert first[1] == frozenset(agents)
        # Kill a member that is not rank 0: agent and workers, no clean-up at all.
        run = parse_run(cluster.client.request(
            "GET", f"{runs_path(namespace)}/e2e"))
        victim = max(run.status.participants, key=lambda p: p.rank).name
        killed_at = time.monotonic()
        kill_tree(agents[victim].pid)
        reformed = wait_for(lambda: rounds.first_round_after(killed_at, victim), 120,
                            "a round without the killed node")
        print(f"\nkilled {victim}; round {reformed[0]} re-formed without it after "
              f"{reformed[1]:.2f}s (no operator: gloo failure + last call of 3s)")
        epoch_at_kill = last_epoch(tmp_path)
        wait_for(lambda: last_epoch(tmp_path) >= epoch_at_kill + 2, 180,
                 "training to go on after the loss", 0.2)
        started = time.monotonic()
        fresh = start_agent(processes, cluster, namespace, "node-3", tmp_path)
        admitted = wait_for(lambda: next((n for n, (t, m) in rounds.rounds.items()
                                          if t > started and "node-3" in m), None), 180,
                            "the fresh node to be admitted")
        print(f"node-3 admitted in round {admitted} {rounds.rounds[admitted][0] - started:.2f}s "
              "after it started")
        survivors = [p for name, p in agents.items() if name != victim] + [fresh]
        for proc in survivors:
            assert proc.wait(timeout=240) == 0, [
                (log.name, log.read_text(errors="replace")[-2000:])
                for log in tmp_path.glob("node-*.log")]
    finally:
        rounds.stop()
    assert last_epoch(tmp_path) == EPOCHS
    final = parse_run(cluster.client.request("GET", f"{runs_path(namespace)}/e2e"))
    assert final.status.round >= 3
    assert rounds.rounds[admitted][1] == frozenset(agents) - {victim} | {"node-3"}
    # The first member out found its round past torch's exit barrier: the run succeeded,
    # and the others left a finished run as it was.
    assert final.status.phase == "Succeeded"
    left = [(m.name, m.reason) for m in final.status.lost_members
            if m.round == final.status.round]
    assert [reason for _, reason in left] == [FINISHED], left
    assert left[0][0] in frozenset(agents) - {victim} | {"node-3"}
    assert not final.spec.closed  # the agents' shutdown left the run open for others
