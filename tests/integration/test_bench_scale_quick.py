"""``bench/scale.py --quick`` works: simulated and real nodes in one round, the floor beside it,
a newcomer and a loss in that round, and a frozen member in a run of its own.

The quick mode runs the real harness (its own control plane and operator,
simulated-node processes, bench workers, c10d) at small N.  Timings are never
asserted: only that every round formed with the right size, that the request
counts are the protocol's, and that the page is written and embedded in
``benchmarks.md``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from elasticrun.api import crd, rounds
from elasticrun.api.slices import SLICE_COUNT

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def scale_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("bench-scale-quick")
    shutil.copy(ROOT / "docs" / "benchmarks.json", out / "benchmarks.json")
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "scale.py"), "--quick",
                          "--out", str(out)], capture_output=True, text=True, timeout=540,
                         check=False, cwd=ROOT)
    assert run.returncode == 0, f"bench/scale.py --quick failed:\n{run.stderr[-4000:]}"
    return out, json.loads((out / "benchmarks-scale.json").read_text())


def test_mixed_rounds_of_simulated_and_real_nodes_form_with_linear_requests(
        scale_run: tuple[Path, dict[str, Any]]) -> None:
    _, data = scale_run
    assert data["errors"] == []
    rows = data["mixed"]
    assert [r["n"] for r in rows] == list(data["plan"]["mixed_sizes"])
    for row in rows:
        assert row["formed"] and row["worlds"] == [row["n"]], row
        assert row["real"] + row["simulated"] == row["n"] and row["real"] > 0
        assert row["rank0_real"], row  # the real handlers reach a real TCPStore
        assert 0 < row["writes"] <= 2 * row["n"] + 5, row
        assert row["by_kind"]["create leases"] == row["n"], row
        assert row["bytes_sent"] > 0 and row["object_bytes"] > 0, row


def test_each_mixed_round_has_the_floor_beside_it(
        scale_run: tuple[Path, dict[str, Any]]) -> None:
    out, data = scale_run
    for row in data["mixed"]:
        assert row["floor_errors"] == [], row
        assert row["floor_reps"] == data["plan"]["floor_reps"] == len(row["floor_rounds"]), row
        assert all(row[key] is not None and row[key] > 0
                   for key in ("floor_s", "floor_loss_s", "floor_newcomer_s")), row
    page = (out / "benchmarks-scale.md").read_text()
    assert "### Against the floor" in page and "| ours / floor |" in page


def test_each_mixed_round_admits_a_newcomer_and_times_it_until_everyone_held_the_round(
        scale_run: tuple[Path, dict[str, Any]]) -> None:
    out, data = scale_run
    for row in data["mixed"]:
        assert row["newcomer_errors"] == [], row
        assert row["newcomer_admitted"] and row["newcomer_worlds"] == [row["n"] + 1], row
        assert row["newcomer_held"] == row["n"] + 1, row  # every member, and the newcomer
        assert row["newcomer_s"] is not None and row["newcomer_s"] > 0, row
    page = (out / "benchmarks-scale.md").read_text()
    assert "| newcomer (ours) | newcomer (floor) | ours / floor |" in page
    assert "`maxNodes = N + 1`" in page


def test_each_mixed_round_times_a_loss_until_every_survivor_knew(
        scale_run: tuple[Path, dict[str, Any]]) -> None:
    out, data = scale_run
    for row in data["mixed"]:
        assert row["loss_members"] == row["n"] + 1, row  # the round the newcomer joined
        assert row["loss_told"] == row["n"], row  # every survivor, real and simulated
        assert row["loss_s"] is not None and row["loss_s"] > 0, row
        assert row["loss_real_s"] is not None and 0 < row["loss_real_s"] <= row["loss_s"], row
    page = (out / "benchmarks-scale.md").read_text()
    assert "| loss (ours) |" in page


def test_the_large_runs_ways_of_telling_members_form_admit_and_lose_at_a_small_n(
        scale_run: tuple[Path, dict[str, Any]]) -> None:
    """The quiet watch and the settled rejoin (from ``QUIET_WATCH_FROM``), and the places
    told in slices (from ``TELL_IN_SLICES_FROM``), of simulated nodes and real handlers,
    which the mixed rounds of the quick run are too small to take."""
    out, data = scale_run
    rows = data["regimes"]
    assert [r["max_nodes"] for r in rows] == [rounds.QUIET_WATCH_FROM,
                                              rounds.TELL_IN_SLICES_FROM]
    n = min(data["plan"]["mixed_sizes"])
    for row in rows:
        assert row["n"] == n and row["errors"] == [], row
        assert row["formed"] and row["worlds"] == [n] and row["rank0_real"], row
        assert row["newcomer_errors"] == [] and row["newcomer_worlds"] == [n + 1], row
        assert row["newcomer_held"] == n + 1, row  # every member rejoined, and the newcomer
        assert row["loss_told"] == n and row["loss_s"] is not None, row
    broadcast, in_slices = rows

    def slice_writes(row: dict[str, Any]) -> int:
        written = {f"{verb} {crd.SLICE_PLURAL}" for verb in ("create", "update", "patch")}
        return sum(count for kind, count in row["by_kind"].items() if kind in written)

    # Places by the seal's broadcast: no slice written; in slices (the formation counted):
    # one write of each slice a member hashes into.  The operator writes no Lease in either.
    assert slice_writes(broadcast) == 0, broadcast
    assert 0 < slice_writes(in_slices) <= min(n, SLICE_COUNT), in_slices
    for row in rows:
        assert not [k for k in row["by_kind"] if k.startswith("patch leases (operator)")], row
    # Every member but rank 0 checks the store of a round told in the status against
    # rank 0's Lease; one told in its slice takes the store the operator checked.
    assert broadcast["by_kind"].get("get leases", 0) >= n - 1, broadcast
    assert in_slices["by_kind"].get("get leases", 0) == 0, in_slices
    page = (out / "benchmarks-scale.md").read_text()
    assert "### Large runs' ways at a small N" in page


def test_a_frozen_member_is_removed_after_the_heartbeat_and_the_survivors_reform(
        scale_run: tuple[Path, dict[str, Any]]) -> None:
    out, data = scale_run
    assert [r["n"] for r in data["frozen"]] == list(data["plan"]["frozen_sizes"])
    for row in data["frozen"]:
        assert row["formed"] and row["errors"] == [], row
        assert (row["heartbeat_s"], row["renew_s"]) == (2, 1), row
        assert row["removed_reason"] == "LeaseExpired" and row["lost_others"] == [], row
        # Never before its heartbeat: the operator counts from the renewal it saw.
        assert row["removed_s"] is not None and row["removed_s"] >= row["heartbeat_s"] - 0.05
        assert row["told_s"] is not None and row["survivors_round_s"] is not None, row
        assert 0 < row["told_s"] <= row["survivors_round_s"], row
        assert row["survivors_worlds"] == [row["n"] - 1], row
    page = (out / "benchmarks-scale.md").read_text()
    assert "### Frozen member" in page and "| survivors' round |" in page


def test_real_rounds_are_measured_as_is_and_dns_neutral_for_both_backends(
        scale_run: tuple[Path, dict[str, Any]]) -> None:
    _, data = scale_run
    for key in ("real", "c10d"):
        assert {r["dns"] for r in data[key]} == {"as-is", "neutral"}, key
        assert all(r["formed"] and r["build_s"] > 0 for r in data[key]), key


def test_the_page_is_written_and_embedded_in_benchmarks_md(
        scale_run: tuple[Path, dict[str, Any]]) -> None:
    out, _ = scale_run
    page = (out / "benchmarks-scale.md").read_text()
    for heading in ("## Targets", "## Server work per round", "## Formation with every node"):
        assert heading in page
    assert (out / "bench-scale.png").read_bytes().startswith(b"\x89PNG")
    embedded = (out / "benchmarks.md").read_text()
    assert "## Formation latency" in embedded and "### Server work per round" in embedded
