"""The floor benchmark (bench/floor.py): when its one writer updates the board, and how
``make bench`` (bench/run.py) and ``make bench-scale`` (bench/scale.py) measure it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench import floor, run, scale, scale_report
from bench.floor import Floor, next_board_round


def test_the_first_round_waits_for_all_n_leases() -> None:
    assert next_board_round(0, True, 3, 4) == 0
    assert next_board_round(0, True, 4, 4) == 1
    assert next_board_round(0, False, 5, 4) == 1  # listed all at once, and more


def test_every_change_after_the_first_round_is_one_more_round() -> None:
    assert next_board_round(1, True, 3, 4) == 2  # a loss
    assert next_board_round(2, True, 4, 4) == 3  # a newcomer
    assert next_board_round(3, False, 4, 4) == 3  # a renewal, a second ADDED of a name: nothing
    # A loss and a newcomer seen together in a new listing: the set changed, its size not.
    assert next_board_round(3, True, 4, 4) == 4


def test_make_bench_keeps_an_incomplete_floor_round_and_reports_it(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """bench/run.py's floor rounds: as many client processes as the formation's nodes had
    workers, one tag per repetition, and a phase without a time an error after its row."""
    server = object()
    asked: list[tuple[int, int, str]] = []

    def on_server(backend: Any, log_dir: Path, n: int, processes: int, tag: str = "") -> Floor:
        assert backend is server and log_dir == tmp_path
        asked.append((n, processes, tag))
        return Floor(n, 0.2, None if tag.endswith("r1") else 0.05, 0.1)

    monkeypatch.setattr(floor, "on_server", on_server)
    rows: list[dict[str, Any]] = []
    with pytest.raises(RuntimeError, match=r"floor phases without a time: \['loss_s'\]"):
        run.floor_rounds(server, 2, run.Plan(workers=4, floor_reps=2), tmp_path, rows)
    assert asked == [(2, 2, "n2-r0"), (2, 2, "n2-r1")]
    assert [(r["rep"], r["formation_s"], r["loss_s"], r["newcomer_s"]) for r in rows] == [
        (0, 0.2, 0.05, 0.1), (1, 0.2, None, 0.1)]


def test_make_bench_scale_takes_each_floor_phase_as_the_median_of_the_rounds_timing_it() -> None:
    """A round without a loss leaves the other two rounds' median; every round's errors stay."""
    rounds = [Floor(8, 0.3, 0.02, 0.1), Floor(8, 0.1, None, 0.4, ("floor-3: gone",)),
              Floor(8, 0.2, 0.06, 0.2)]
    fields = scale.floor_fields(rounds)
    assert (fields["floor_s"], fields["floor_newcomer_s"]) == (0.2, 0.2)
    assert fields["floor_loss_s"] == pytest.approx(0.04)
    assert fields["floor_reps"] == 3
    assert fields["floor_errors"] == ["round 1: floor-3: gone"]
    assert fields["floor_rounds"][1] == {"formation_s": 0.1, "loss_s": None, "newcomer_s": 0.4}
    assert scale.floor_fields([Floor(8, 0.3, None, None)])["floor_loss_s"] is None


def test_make_bench_scale_runs_the_plans_floor_rounds_one_tag_each(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    server = object()
    asked: list[tuple[int, int, str]] = []

    def on_server(backend: Any, log_dir: Path, n: int, processes: int, tag: str = "") -> Floor:
        assert backend is server and log_dir == tmp_path
        asked.append((n, processes, tag))
        return Floor(n, 0.1 * len(asked), 0.05, 0.1)

    monkeypatch.setattr(floor, "on_server", on_server)
    fields = scale.floor_rounds(server, tmp_path, 64, 4, scale.Plan().floor_reps)
    assert asked == [(64, 4, "n64-r0"), (64, 4, "n64-r1"), (64, 4, "n64-r2")]
    assert fields["floor_s"] == pytest.approx(0.2)
    assert scale.Plan.quick().floor_reps == 1


def test_the_scale_page_says_how_many_floor_rounds_its_times_are_the_median_of() -> None:
    row = {"n": 64, "formed": True, "latency_s": 0.5, "floor_s": 0.3}
    assert "the median of 3 rounds per N" in "\n".join(
        scale_report._floor_table([{**row, "floor_reps": 3}]))
    once = "\n".join(scale_report._floor_table([row]))  # written before floor_reps
    assert "one round per N" in once and "median" not in once
