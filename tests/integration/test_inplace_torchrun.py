"""In-place mode end to end: three torchrun agents (``--rdzv-conf in_place=1``) run
``train_inplace.py``; one node is killed and the survivors' workers train on in the
same processes. No operator: the survivors' workers report the failed round, their
agents' followers re-form it (the last call passes without the dead node). Then a
node is added, which restarts the workers through torchrun, as without in-place mode.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from elasticrun.api.kube import runs_path
from elasticrun.api.model import parse_run

from conftest import ROOT, Cluster, ProcessGroup, wait_for
from controlplane.localcluster import clean_env, kill_tree

pytestmark = pytest.mark.torchrun
TRAIN = ROOT / "deploy" / "examples" / "train_inplace.py"
LINE = re.compile(r"step (\d+) loss \S+ rank (\d+)/(\d+) round (\S+) pid (\d+)")


def start_agent(processes: ProcessGroup, cluster: Cluster, namespace: str, node: str,
                workdir: Path) -> subprocess.Popen[Any]:
    env = {**clean_env(), "KUBECONFIG": str(cluster.kubeconfig), "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "handler")}
    conf = (f"namespace={namespace},node_name={node},last_call_timeout=3,"
            f"heartbeat_timeout=4,lease_interval=1,in_place=1,"
            f"round_file={workdir / (node + '.round.json')}")
    argv = [str(Path(sys.executable).parent / "torchrun"), "--nnodes=2:3", "--nproc-per-node=1",
            "--rdzv-backend=k8s", "--rdzv-id=inplace-e2e", f"--rdzv-conf={conf}",
            "--max-restarts=0", "--monitor-interval=0.1", "--local-addr=127.0.0.1", str(TRAIN),
            "--steps", "100000", "--sleep", "0.05", "--log-every", "10", "--timeout", "10",
            "--checkpoint", str(workdir / "checkpoint.pt"), "--checkpoint-every", "50"]
    log = open(workdir / f"{node}.log", "wb")  # noqa: SIM115 - closed with the process
    return processes.start(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=workdir)


def progress(workdir: Path, node: str) -> list[tuple[int, int, int, int]]:
    """(step, world size, round, worker pid) of each progress line of ``node``'s worker."""
    path = workdir / f"{node}.log"
    if not path.exists():
        return []
    found = []
    for match in LINE.finditer(path.read_text(errors="replace")):
        step, _rank, world, round_, pid = match.groups()
        found.append((int(step), int(world), int(round_) if round_.isdigit() else 0, int(pid)))
    return found


def test_survivors_train_on_in_the_same_processes(
        cluster: Cluster, namespace: str, processes: ProcessGroup, tmp_path: Path) -> None:
    agents = {f"node-{i}": start_agent(processes, cluster, namespace, f"node-{i}", tmp_path)
              for i in range(3)}
    wait_for(lambda: all(progress(tmp_path, n) and progress(tmp_path, n)[-1][0] >= 20
                         for n in agents), 240, "three workers past step 20", 0.2)
    run = parse_run(cluster.client.request("GET", f"{runs_path(namespace)}/inplace-e2e"))
    victim = max(run.status.participants, key=lambda p: p.rank).name
    survivors = [n for n in agents if n != victim]
    pids = {n: progress(tmp_path, n)[-1][3] for n in survivors}
    kill_tree(agents[victim].pid)
    wait_for(lambda: all(any(world == 2 for _, world, _, _ in progress(tmp_path, n))
                         for n in survivors), 120, "the survivors training with two", 0.2)
    for n in survivors:
        assert {pid for *_, pid in progress(tmp_path, n)} == {pids[n]}, "no worker restart"
    fresh = start_agent(processes, cluster, namespace, "node-3", tmp_path)
    trio = [*survivors, "node-3"]
    wait_for(lambda: all(any(world == 3 for _, world, _, _ in progress(tmp_path, n))
                         for n in trio), 240, "training with three", 0.2)
    joined = max(progress(tmp_path, n)[-1][0] for n in trio)
    wait_for(lambda: all(progress(tmp_path, n)[-1][0] >= joined + 30 for n in trio), 120,
             "the three to train on", 0.2)
    assert all(progress(tmp_path, n)[-1][1] == 3 for n in trio)
    assert all(p.poll() is None for p in (*[agents[n] for n in survivors], fresh))
