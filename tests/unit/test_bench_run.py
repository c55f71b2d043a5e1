"""``make bench``'s harness (bench/run.py): the sections a whole run carries over, and when
a block starts using the operator it started (bench/backends.py)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from bench import proc, run


def test_a_whole_make_bench_keeps_the_sections_measured_alone(tmp_path: Path) -> None:
    """``--only resize`` columns survive a whole run, which does not measure them: the page
    it renders keeps its Resize section, each column with its own commit."""
    path = tmp_path / "benchmarks.json"
    assert run.measured_alone(path) == {}
    resize = {"after": {"commit": "abc1234", "backends": {}}}
    path.write_text(json.dumps({"commit": "old", "backends": {"k8s": {}}, "resize": resize}))
    assert run.measured_alone(path) == {"resize": resize}
    path.write_text(json.dumps({"commit": "old", "backends": {}}))
    assert run.measured_alone(path) == {}


def test_the_commit_measured_is_marked_only_for_changes_that_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``make bench-scale`` after ``make bench`` finds the pages the first one wrote changed,
    and the prose with them: neither runs, so the stamp is the commit alone.  A changed
    source file is measured, so it is marked."""
    monkeypatch.delenv("BENCH_COMMIT", raising=False)

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=tmp_path, check=True, text=True,
                              capture_output=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "docs").mkdir()
    for name in ("docs/benchmarks.md", "README.md", "code.py"):
        (tmp_path / name).write_text("before\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = git("rev-parse", "--short", "HEAD")
    (tmp_path / "docs" / "benchmarks.md").write_text("after\n")
    (tmp_path / "README.md").write_text("after\n")
    assert run.commit(tmp_path) == head
    (tmp_path / "code.py").write_text("after\n")
    assert run.commit(tmp_path) == f"{head} + uncommitted changes"


def test_a_started_operator_is_used_once_it_is_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """``K8sBackend.operator`` waits (``proc.wait_quiet``) until a second passes with less
    than the threshold of CPU, so its start-up is in no block's measurement."""
    readings = iter([0.0, 0.9, 0.9, 1.5, 1.5, 1.52])  # busy, busy, then idle
    clock = [0.0]
    monkeypatch.setattr(proc, "cpu_seconds", lambda _pid: next(readings))
    monkeypatch.setattr(proc.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    monkeypatch.setattr(proc.time, "monotonic", lambda: clock[0])
    proc.wait_quiet(1, bound=60.0)
    assert clock[0] == 3.0  # the third second was the quiet one

    busy = iter(float(i) for i in range(1000))
    monkeypatch.setattr(proc, "cpu_seconds", lambda _pid: next(busy))
    clock[0] = 0.0
    proc.wait_quiet(1, bound=5.0)
    assert clock[0] == 5.0  # never idle: given up at the bound
