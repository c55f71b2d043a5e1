"""``make bench-quick`` works: all three backends measured, output well formed.

This runs the real benchmark in its quick mode (its own control plane, Debian's
etcd for torch's etcd-v2 backend, worker processes), so a change that breaks
the benchmark is caught in CI rather than at the next ``make bench``.  Timings
are never asserted: only that every number is there and positive.
"""

# ruff: noqa: RUF001 - the page uses multiplication signs

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = ("k8s", "c10d", "etcd-v2")
#: The times of one floor round (bench/floor.py), each until every client that should knew.
FLOOR_PHASES = ("formation_s", "loss_s", "newcomer_s")
FORMATION_KEYS = ("n", "rep", "latency_s", "requests", "writes", "lost_cas", "server_cpu_s",
                  "client_cpu_s")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    setup = subprocess.run(["bash", str(ROOT / "bench" / "setup.sh")], capture_output=True,
                           text=True, timeout=600, check=False)
    if setup.returncode != 0:
        pytest.fail("bench/setup.sh could not provide an etcd with the v2 API (it installs "
                    f"Debian's etcd-server with apt-get, as root):\n{setup.stderr[-2000:]}")
    out = tmp_path_factory.mktemp("bench-quick")
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "run.py"), "--quick", "--no-setup",
                          "--out", str(out)], capture_output=True, text=True, timeout=840,
                         check=False, cwd=ROOT)
    assert run.returncode == 0, f"bench/run.py --quick failed:\n{run.stderr[-4000:]}"
    return out, json.loads((out / "benchmarks.json").read_text())


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and value > 0


def test_all_backends_measured_without_errors(quick_run: tuple[Path, dict[str, Any]]) -> None:
    _, data = quick_run
    assert {"command", "machine", "versions", "plan", "backends", "seconds"} <= set(data)
    assert set(data["backends"]) == set(BACKENDS)
    for name in BACKENDS:
        assert data["backends"][name]["errors"] == [], name


def test_formation_numbers_are_positive(quick_run: tuple[Path, dict[str, Any]]) -> None:
    _, data = quick_run
    sizes = data["plan"]["sizes"]
    for name in BACKENDS:
        rows = data["backends"][name]["formation"]
        assert sorted({r["n"] for r in rows}) == sorted(sizes), name
        for row in rows:
            assert set(FORMATION_KEYS) <= set(row), (name, row)
            assert _positive(row["latency_s"]) and _positive(row["requests"]), (name, row)
            assert row["lost_cas"] >= 0, (name, row)
    for row in data["backends"]["k8s"]["formation"]:
        # one watch event per node and round: the narrow watch at work
        assert _positive(row["watch_events"]) and _positive(row["watch_bytes"]), row
        assert _positive(row["writes"]), row


def test_events_and_steady_state_are_reported(quick_run: tuple[Path, dict[str, Any]]) -> None:
    _, data = quick_run
    for name in BACKENDS:
        result = data["backends"][name]
        recovery, scale = result["recovery"], result["scale_up"]
        assert recovery and scale, name
        assert all(_positive(r["new_round_s"]) for r in scale), name
        if name == "k8s":
            assert all(_positive(r["seen_all_s"]) and _positive(r["new_round_s"])
                       for r in recovery)
        else:
            assert all(_positive(r["reentry_to_round_s"]) for r in recovery), name
        assert _positive(result["steady_state"]["requests_per_member_minute"]), name


def test_operator_measured_when_present(quick_run: tuple[Path, dict[str, Any]]) -> None:
    _, data = quick_run
    k8s = data["backends"]["k8s"]
    if not (ROOT / "operator" / "elasticrun" / "operator" / "__main__.py").exists():
        pytest.skip("no operator in this tree")
    pod = k8s["recovery_pod_deleted"]
    assert pod and all(_positive(r["seen_all_s"]) and _positive(r["new_round_s"]) for r in pod)
    load = k8s["operator_load"]
    assert _positive(load["rss_mib"]) and _positive(load["startup_s"])
    assert len(load["pod_loss_s"]) == load["losses"] and all(map(_positive, load["pod_loss_s"]))


def test_the_floor_is_measured_beside_every_k8s_formation(
        quick_run: tuple[Path, dict[str, Any]]) -> None:
    out, data = quick_run
    rows = data["backends"]["k8s"]["floor"]
    assert sorted(r["n"] for r in rows) == sorted(data["plan"]["sizes"]
                                                  * data["plan"]["floor_reps"])
    for row in rows:
        assert row["errors"] == [], row
        assert all(_positive(row[phase]) for phase in FLOOR_PHASES), row
    text = (out / "benchmarks.md").read_text()
    header = "| N | k8s | c10d | etcd-v2 | floor | k8s / floor | k8s / c10d |"
    table = text.split(header)[1].split("\n\n")[0].splitlines()[2:]
    assert len(table) == len(data["plan"]["sizes"]), table
    for line in table:
        floor, ratio = line.split(" | ")[4:6]
        assert floor.endswith(" s") and ratio.endswith("×"), line
    target = next(line for line in text.splitlines()
                  if line.startswith("| k8s formation ≤ 1.5× the floor at every N |"))
    assert target.split(" | ")[1].startswith(("met", "missed")), target
    # The loss and the newcomer at the scenarios' N (one of the formation sizes): the
    # k8s rows hold a ratio to the floor, which only a floor time beside theirs makes.
    recovery = text.split("## Recovery")[1].split("## Scale-up")[0]
    scale_up = text.split("## Scale-up")[1].split("## Steady state")[0]
    for section, row in ((recovery, "| k8s | shutdown() |"), (scale_up, "| k8s |")):
        line = next(line for line in section.splitlines() if line.startswith(row))
        assert line.count("×") == 1, line


def test_report_and_plots_written(quick_run: tuple[Path, dict[str, Any]]) -> None:
    out, _ = quick_run
    text = (out / "benchmarks.md").read_text()
    for heading in ("## Formation latency", "## Requests per round", "## Watch traffic",
                    "## Recovery", "## Scale-up", "## Steady state", "## Targets"):
        assert heading in text
    for png in ("bench-formation-latency.png", "bench-requests.png", "bench-recovery.png"):
        data = (out / png).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) < 200_000, png
