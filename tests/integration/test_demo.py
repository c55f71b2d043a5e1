"""`make demo`, run non-interactively in bounded time: its outcome, not its prose."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = pytest.mark.torchrun


def processes_mentioning(text: str) -> list[str]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{entry}: {cmdline[:200]}")
    return found


def test_demo_trains_loses_a_node_admits_a_new_one_and_cleans_up(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    summary_file = tmp_path / "summary.json"
    # The newcomer starts at epoch 9 and is admitted once its agent is up and the
    # members restart for it (about 8 s here); 15 epochs after it (the default demo
    # has 14) leave it that time on a loaded machine: with 7, training ended first.
    result = subprocess.run(
        [sys.executable, str(ROOT / "demo" / "run_demo.py"), "--epochs", "24",
         "--steps-per-epoch", "150", "--kill-at", "4", "--join-at", "9", "--timeout", "240",
         "--workdir", str(workdir), "--summary-json", str(summary_file), "--no-color"],
        capture_output=True, text=True, timeout=600, check=False)
    print(result.stdout[-4000:])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    story = json.loads(summary_file.read_text())
    assert story["success"] is True
    assert story["epochs_done"] == 24
    rounds = story["rounds"]
    killed, joined = story["killed"], story["joined"]
    assert killed and joined == "node-3"
    assert len(rounds[0]["members"]) == 3 and killed in rounds[0]["members"]
    # The kill produced a round without that node, the newcomer joined a later one.
    after_kill = [r for r in rounds if killed not in r["members"]]
    assert after_kill and len(after_kill[0]["members"]) == 2
    with_new = [r for r in rounds if joined in r["members"]]
    assert with_new and with_new[0]["round"] > after_kill[0]["round"]
    assert sorted(with_new[-1]["members"]) == sorted(
        set(rounds[0]["members"]) - {killed} | {joined})
    # Survivors kept their relative order (rank 0 stayed rank 0).
    leader = min(rounds[0]["ranks"], key=rounds[0]["ranks"].get)
    if leader != killed:
        assert after_kill[0]["ranks"][leader] == 0
    assert any(lost["name"] == killed and lost["reason"] == "PodDeleted"
               for lost in story["lost"])
    assert story["recovery_seconds"] is not None and story["admission_seconds"] is not None
    # What users feel: training stands still from the kill until rank 0's workers take a
    # step in the survivors' round, which forms first; and again from the members' notice
    # of the newcomer until a step in its round.
    back_after_loss = story["training_back_after_loss"]
    assert back_after_loss is not None and back_after_loss > story["recovery_seconds"], story
    assert story["told_at"] is not None and story["training_back_after_admission"] is not None
    assert f"training back {back_after_loss:.2f}s after the kill" in result.stdout
    # Success is not loss: the first member out of the last round found it past torch's
    # exit barrier and marked the run Succeeded (the others leave a finished run as it is),
    # and nothing but the kill is recorded as a loss.
    assert len(story["left"]) == 1 and story["left"][0] in with_new[-1]["members"], story
    assert [lost["name"] for lost in story["lost"]] == [killed], story["lost"]
    assert set(story["exit_codes"]) == set(rounds[0]["members"]) - {killed} | {joined}
    assert all(code == 0 for code in story["exit_codes"].values())
    for expected in ("round 1 sealed", f"killing {killed}", "removed from round",
                     "kubectl get er -n demo -w", "training finished"):
        assert expected in result.stdout
    assert processes_mentioning(str(workdir)) == []
