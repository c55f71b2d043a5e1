"""The scale benchmark's mixed rounds: the runs' timings seal the rounds each phase times.

Each phase's round is decided by the product's own rule
(:func:`elasticrun.api.rounds.decide_seal`) on the run the benchmark sets up:
the first round of N at once, and the newcomer's round of N + 1 with every
member of the round of N in it, whichever member is the last to ask again.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import yaml

from elasticrun.api.model import ElasticRun, WaitingNode
from elasticrun.api.rounds import decide_seal, members_told_in_slices, members_watch_quietly

from bench import scale_report
from bench.backends import Timing, run_spec
from bench.scale import NEWCOMER, Plan, mixed_timing, newcomer_timing
from bench.servers import CRD_FILES, ROOT, crd_files
from builders import at, sealed

SIZES = [*Plan.quick().mixed_sizes, 1024]


def _members(n: int) -> list[str]:
    return [f"node-{i:03d}" for i in range(n)]


def _run(timing: Timing, n: int, round_: int) -> ElasticRun:
    status = sealed(*_members(n), round_=round_) if round_ else sealed(round_=0)
    return ElasticRun("run", "ns", run_spec(timing), status, "1")


def _asked(names: list[str], start: float, gap: float = 0.1) -> list[WaitingNode]:
    """Requests of ``names``, ``gap`` seconds apart from ``start`` on, as a sealer lists them."""
    return [WaitingNode(name=name, address="127.0.0.1", store_port=20000 + i,
                        since=at(start + i * gap), arrived=at(start + i * gap),
                        noticed=at(start + i * gap))
            for i, name in enumerate(names)]


@pytest.mark.parametrize("n", SIZES)
def test_the_first_round_of_n_seals_at_its_nth_request_without_a_last_call(n: int) -> None:
    requests = _asked(_members(n), 0.0)
    decision = decide_seal(_run(mixed_timing(n), n, 0), at(n * 0.1), requests)
    assert decision.seal_now, decision


@pytest.mark.parametrize("n", SIZES)
def test_the_newcomers_round_holds_the_last_member_to_ask_again(n: int) -> None:
    """The newcomer and every member but one are back: ``minNodes`` of them, and the slowest
    member's place is kept for as long as the phase waits for it."""
    bound = Plan.quick().formation_bound
    timing = newcomer_timing(n, bound)
    back = _asked([NEWCOMER, *_members(n)[:-1]], 0.0)
    assert len(back) == timing.min_nodes
    run = _run(timing, n, 1)
    for later in (1.0, 5.0, bound - 1.0):
        decision = decide_seal(run, at(n * 0.1 + later), back)
        assert not decision.seal_now, (later, decision)
    everyone = _asked([NEWCOMER, *_members(n)], 0.0)
    decision = decide_seal(run, at(n * 0.1 + bound - 1.0), everyone)
    assert decision.seal_now and decision.reason == f"all {n} remaining members of round 1 are back"


@pytest.mark.parametrize("n", SIZES)
def test_the_newcomers_round_seals_the_moment_every_member_is_back(n: int) -> None:
    """No time the phase measures waits on its last call."""
    timing = newcomer_timing(n, Plan().formation_bound)
    everyone = _asked([NEWCOMER, *_members(n)], 0.0)
    last = everyone[-1].asked_at
    assert last is not None
    decision = decide_seal(_run(timing, n, 1), last, everyone)
    assert decision.seal_now, decision


def test_the_newcomer_phase_changes_only_the_last_call_of_the_mixed_run() -> None:
    assert newcomer_timing(16, 60.0) == dataclasses.replace(mixed_timing(16), last_call=60)
    assert newcomer_timing(16, 59.5).last_call == 60


def _telling(timing: Timing) -> tuple[bool, bool]:
    spec = run_spec(timing)
    return members_watch_quietly(spec), members_told_in_slices(spec)


def test_the_quick_plan_reaches_every_way_a_run_tells_its_members() -> None:
    """The suite runs ``--quick``: its small rounds must take the full watch, the quiet watch
    with the seal's broadcast, and the places told in slices, or a broken one goes
    unnoticed until ``make bench-scale``."""
    quick = Plan.quick()
    ways = {_telling(mixed_timing(n)) for n in quick.mixed_sizes}
    regimes = {_telling(mixed_timing(min(quick.mixed_sizes), m)) for m in quick.regimes}
    assert ways == {(False, False)}
    assert regimes == {(True, False), (True, True)}
    assert all(mixed_timing(8, m).max_nodes == m for m in quick.regimes)


def test_the_regimes_table_names_each_runs_ways_by_the_rules() -> None:
    """The page names a run's ways from ``rounds``' own rules, so it cannot drift from them."""
    quick = Plan.quick()
    named = {scale_report._ways(m) for m in quick.regimes}
    assert len(named) == len(quick.regimes)
    assert scale_report._ways(min(quick.mixed_sizes) + 1) not in named
    assert "slices" in scale_report._ways(max(quick.regimes))


def test_the_operators_slice_writes_are_its_writes_of_slices_alone() -> None:
    by_kind = {"create elasticrunslices": 2, "patch elasticrunslices": 30,
               "patch elasticrunslices -> 409": 4, "watch elasticrunslices": 64,
               "patch leases": 64, "patch elasticruns/status": 1}
    assert scale_report.slice_writes(by_kind) == 32
    assert scale_report.slice_writes({}) == 0


def test_a_control_plane_of_this_tree_serves_both_crds() -> None:
    assert crd_files(ROOT) == CRD_FILES
    kinds = [yaml.safe_load(path.read_text())["spec"]["names"]["kind"] for path in CRD_FILES]
    assert kinds == ["ElasticRun", "ElasticRunSlice"]


def test_a_tree_without_the_slice_crd_serves_the_elasticrun_crd_alone(tmp_path: Path) -> None:
    """A baseline revision from before slices: its own ElasticRun CRD, and nothing else."""
    crds = tmp_path / "deploy" / "crds"
    crds.mkdir(parents=True)
    shutil.copy(CRD_FILES[0], crds)
    assert crd_files(tmp_path) == (crds / CRD_FILES[0].name,)
    shutil.copy(CRD_FILES[1], crds)
    assert crd_files(tmp_path) == (crds / CRD_FILES[0].name, crds / CRD_FILES[1].name)
