"""A hot spare's whole life: real torchrun agents on a run 1:2, the operator, no node.

Three agents on a run of at most two: two members train, the third waits as a
spare.  What a user choosing a hot spare is promised:

* beside the full, healthy round the spare waits, listed as waiting; it never
  seals a round, the members never restart, round 1 keeps its number for as
  long as they train (checked for longer than the spare's last call);
* when the members finish, their round has passed torch's exit barrier, the
  first member out marks the run ``Succeeded``, and the spare exits 0 without
  a worker ever starting (``RunSucceededError``);
* when a member is lost, the spare takes its place in the next round and the
  survivor restarts once.

The workers train until the test writes a stop file (``held_train.py``), so no
window depends on how fast the machine trains.
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from elasticrun.api import rounds
from elasticrun.api.model import ElasticRun

from conftest import Cluster, OperatorProcess, ProcessGroup, consistently, wait_for
from controlplane.localcluster import kill_tree
from rdzv import RoundLog, read_run, start_torchrun_agent
from timings import outlasting

pytestmark = pytest.mark.torchrun
TRAIN = Path(__file__).with_name("held_train.py")
RUN = "spare"
LAST_CALL = 3
WORKER_STARTED = "starting at epoch"


def start_agent(processes: ProcessGroup, cluster: Cluster, namespace: str, node: str,
                workdir: Path) -> subprocess.Popen[Any]:
    return start_torchrun_agent(
        processes, cluster.kubeconfig, workdir, node, run=RUN, nnodes="1:2",
        conf=f"namespace={namespace},last_call_timeout={LAST_CALL},heartbeat_timeout=10,"
             "lease_interval=2",
        max_restarts=3, script=TRAIN,
        script_args=["--stop-file", str(workdir / "stop"),
                     "--checkpoint", str(workdir / "checkpoint.pt")])


def stop_training(workdir: Path) -> int:
    """Tell the workers to stop after their current epoch; the last epoch logged so far."""
    logged = last_epoch(workdir)
    (workdir / "stop").touch()
    return logged


def assert_training_ended(workdir: Path, stopped_at: int) -> None:
    """Rank 0 logged an epoch after the stop, its last, and the checkpoint holds that epoch."""
    import torch

    final = torch.load(workdir / "checkpoint.pt", weights_only=True)["epoch"]
    assert final == last_epoch(workdir) > stopped_at, (final, stopped_at)


def log_of(workdir: Path, node: str) -> str:
    return (workdir / f"{node}.log").read_text(errors="replace")


def last_epoch(workdir: Path) -> int:
    best = 0
    for line in "\n".join(log_of(workdir, n) for n in ("m0", "m1", "s")
                          if (workdir / f"{n}.log").exists()).splitlines():
        if " epoch " in line and " done, loss " in line and "rank 0/" in line:
            best = max(best, int(line.split(" epoch ")[1].split()[0]))
    return best


def logs(workdir: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                     for p in sorted(workdir.glob("*.log")))


def start_members_and_spare(processes: ProcessGroup, cluster: Cluster, namespace: str,
                            workdir: Path) -> tuple[dict[str, subprocess.Popen[Any]],
                                                    ElasticRun]:
    """Round 1 of m0 and m1 training, then the spare listed as waiting beside it."""
    agents = {n: start_agent(processes, cluster, namespace, n, workdir) for n in ("m0", "m1")}
    wait_for(lambda: last_epoch(workdir) >= 1, 120, "round 1 to train an epoch", 0.2)
    agents["s"] = start_agent(processes, cluster, namespace, "s", workdir)

    def spare_waits() -> ElasticRun | None:
        run = read_run(cluster.client, namespace, RUN)
        return run if any(w.name == "s" for w in run.status.waiting) else None

    waiting = wait_for(spare_waits, 60, "the spare to be listed as waiting")
    return agents, waiting


def test_a_spare_beside_a_healthy_round_waits_and_exits_0_when_the_members_finish(
        cluster: Cluster, namespace: str, processes: ProcessGroup, operator: OperatorProcess,
        tmp_path: Path) -> None:
    rounds_seen = RoundLog(cluster.client, namespace, RUN)
    try:
        agents, waiting = start_members_and_spare(processes, cluster, namespace, tmp_path)
        assert (waiting.status.round, waiting.status.member_names) == (1, {"m0", "m1"})

        def healthy() -> bool:
            run = read_run(cluster.client, namespace, RUN)
            return (run.status.round, run.status.phase, run.status.member_names) == \
                (1, "Running", {"m0", "m1"}) and any(w.name == "s" for w in run.status.waiting)

        # Past the spare's last call (counted from its join) with margin, round 1 trains on.
        consistently(healthy, outlasting(LAST_CALL) + 2,
                     "round 1 of m0 and m1 with the spare waiting")
        stopped_at = stop_training(tmp_path)
        codes = {n: p.wait(timeout=120) for n, p in agents.items()}
        assert codes == {"m0": 0, "m1": 0, "s": 0}, logs(tmp_path)
    finally:
        rounds_seen.stop()
    assert_training_ended(tmp_path, stopped_at)
    final = read_run(cluster.client, namespace, RUN)
    assert (final.status.phase, final.status.round) == ("Succeeded", 1), \
        (final.status, logs(tmp_path))
    assert sorted(rounds_seen.rounds) == [1], "a round other than the members' ran"
    finished = [(m.name, m.reason) for m in final.status.lost_members]
    assert len(finished) == 1 and finished[0][1] == rounds.FINISHED, finished
    spare = log_of(tmp_path, "s")
    assert "the run already succeeded" in spare, spare[-2000:]
    assert WORKER_STARTED not in spare, "a worker of the spare started"
    for member in ("m0", "m1"):  # one start each: no restart for the spare's sake
        assert log_of(tmp_path, member).count(WORKER_STARTED) == 1, logs(tmp_path)

    def recorded() -> bool:
        condition = read_run(cluster.client, namespace, RUN).status.condition("Succeeded")
        return condition is not None and condition.reason == "ExitBarrierPassed"

    wait_for(recorded, 30, "the operator's Succeeded condition")


def test_a_lost_member_is_replaced_by_the_spare_with_one_restart_of_the_survivor(
        cluster: Cluster, namespace: str, processes: ProcessGroup, operator: OperatorProcess,
        tmp_path: Path) -> None:
    rounds_seen = RoundLog(cluster.client, namespace, RUN)
    try:
        agents, _ = start_members_and_spare(processes, cluster, namespace, tmp_path)
        run = read_run(cluster.client, namespace, RUN)
        victim = max(run.status.participants, key=lambda p: p.rank).name
        survivor = ({"m0", "m1"} - {victim}).pop()
        kill_tree(agents.pop(victim).pid, signal.SIGKILL)
        second = wait_for(lambda: rounds_seen.rounds.get(2), 120, "round 2")
        assert second[1] == {survivor, "s"}, second
        before = last_epoch(tmp_path)
        wait_for(lambda: last_epoch(tmp_path) > before, 120, "round 2 to train an epoch", 0.2)
        stopped_at = stop_training(tmp_path)
        codes = {n: p.wait(timeout=120) for n, p in agents.items()}
        assert codes == {survivor: 0, "s": 0}, logs(tmp_path)
    finally:
        rounds_seen.stop()
    assert_training_ended(tmp_path, stopped_at)
    final = read_run(cluster.client, namespace, RUN)
    assert (final.status.phase, final.status.round) == ("Succeeded", 2), final.status
    assert sorted(rounds_seen.rounds) == [1, 2]
    # The survivor's workers started twice: at round 1 and once for round 2.
    assert log_of(tmp_path, survivor).count(WORKER_STARTED) == 2, logs(tmp_path)
    assert log_of(tmp_path, "s").count(WORKER_STARTED) == 1, logs(tmp_path)
