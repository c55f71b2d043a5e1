"""The run's phase as a metric: one series per known phase, gone with the run."""

from __future__ import annotations

from elasticrun.api.model import PHASES
from elasticrun.operator.metrics import Metrics


def _phases(metrics: Metrics) -> dict[tuple[str, str, str], float]:
    return {(s.labels["namespace"], s.labels["run"], s.labels["phase"]): s.value
            for m in metrics.registry.collect() for s in m.samples
            if s.name == "elasticrun_run_phase"}


def test_the_current_phase_is_1_and_every_other_known_phase_0() -> None:
    metrics = Metrics()
    metrics.run_phase("ns", "a", "Degraded")
    assert _phases(metrics) == {("ns", "a", p): (1.0 if p == "Degraded" else 0.0)
                                for p in PHASES}
    metrics.run_phase("ns", "a", "Running")
    assert {k[2] for k, v in _phases(metrics).items() if v == 1} == {"Running"}


def test_an_unknown_phase_adds_no_series() -> None:
    """The phase label takes only elasticrun's six phases, whatever a status says."""
    metrics = Metrics()
    for i in range(50):
        metrics.run_phase("ns", "b", f"crafted-{i}")
    assert set(_phases(metrics)) == {("ns", "b", p) for p in PHASES}
    assert set(_phases(metrics).values()) == {0.0}


def test_forgetting_a_run_removes_its_phase_series() -> None:
    metrics = Metrics()
    metrics.run_phase("ns", "a", "Running")
    metrics.run_phase("ns", "keep", "Forming")
    metrics.forget("ns", "a")
    assert {k[1] for k in _phases(metrics)} == {"keep"}
