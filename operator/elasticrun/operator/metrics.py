"""Prometheus metrics of the operator (served on ``--metrics-port``, default 8080).

Names follow Prometheus conventions; every series is labelled by namespace and
run so a dashboard can follow one training job.
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from elasticrun.api import rounds
from elasticrun.api.model import PHASES
from elasticrun.operator import listen

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
#: The ``reason`` label's values are :data:`elasticrun.api.rounds.LOSS_REASONS`.
#: The reason comes from ``status.lostMembers``, which nodes can write, so any other
#: value is counted as ``Other`` and a pod cannot grow the series without bound.
OTHER = "Other"


def reason_label(reason: str) -> str:
    """The ``reason`` label for a lost member's reason: itself if elasticrun records it
    (:data:`~elasticrun.api.rounds.LOSS_REASONS`), else ``Other``."""
    return reason if reason in rounds.LOSS_REASONS else OTHER


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        labels = ("namespace", "run")
        self.rounds = Counter("elasticrun_rounds_total", "Rounds sealed.", labels,
                              registry=self.registry)
        self.round_duration = Histogram(
            "elasticrun_round_duration_seconds",
            "From the first node waiting to the round sealed.", labels,
            buckets=LATENCY_BUCKETS, registry=self.registry)
        self.detection = Histogram(
            "elasticrun_failure_detection_seconds",
            "From a member's loss (pod deleted/failed, lease expired) to its removal.",
            ("namespace", "run", "reason"), buckets=LATENCY_BUCKETS, registry=self.registry)
        self.members = Gauge("elasticrun_members", "Members of the current round.", labels,
                             registry=self.registry)
        self.waiting = Gauge("elasticrun_waiting_nodes", "Nodes waiting for the next round.",
                             labels, registry=self.registry)
        self.lost = Counter("elasticrun_members_lost_total", "Members removed, by reason.",
                            ("namespace", "run", "reason"), registry=self.registry)
        self.round = Gauge("elasticrun_round", "The current round number.", labels,
                           registry=self.registry)
        self.phase = Gauge("elasticrun_run_phase",
                           "1 for the run's current phase, 0 for the others (one series "
                           "per phase, so an alert can ask how long a run stayed in one).",
                           ("namespace", "run", "phase"), registry=self.registry)
        self.api_reachable = Gauge(
            "elasticrun_apiserver_reachable",
            "1 while the operator's /readyz probe of the API server succeeds.",
            registry=self.registry)
        self.api_outages = Counter(
            "elasticrun_apiserver_outages_total",
            "Times the API server became unreachable; Lease expiry restarts after each.",
            registry=self.registry)
        self.leader = Gauge(
            "elasticrun_operator_leader",
            "1 while this replica holds the leader Lease and reconciles (always 1 without "
            "--leader-elect).", registry=self.registry)
        self.signals = Gauge(
            "elasticrun_node_signals",
            "Members and waiting nodes of the run whose Node shows the signal (--node-signal).",
            ("namespace", "run", "signal"), registry=self.registry)
        #: The signal series set per run, so that one whose count fell to nothing is removed.
        self._signal_series: dict[tuple[str, str], frozenset[str]] = {}
        self.api_reachable.set(1)
        self.leader.set(1)

    def api_changed(self, reachable: bool) -> None:
        self.api_reachable.set(1 if reachable else 0)
        if not reachable:
            self.api_outages.inc()

    def leading(self, leading: bool) -> None:
        self.leader.set(1 if leading else 0)

    def serve(self, port: int, addr: str = "0.0.0.0", *, reuse_port: bool = False) -> None:
        """Serve the registry; ``reuse_port``: share the port (see ``listen``)."""
        if reuse_port:
            listen.serve_metrics(self.registry, addr, port)
        else:
            start_http_server(port, addr=addr, registry=self.registry)

    def lost_member(self, namespace: str, run: str, reason: str,
                    detection_seconds: float | None) -> None:
        """Count a removed member (and how long detecting it took) under a bounded reason."""
        label = reason_label(reason)
        self.lost.labels(namespace=namespace, run=run, reason=label).inc()
        if detection_seconds is not None:
            self.detection.labels(namespace=namespace, run=run, reason=label).observe(
                detection_seconds)

    def run_phase(self, namespace: str, run: str, phase: str) -> None:
        """Set the run's phase series: 1 for ``phase``, 0 for every other known phase."""
        for known in PHASES:
            self.phase.labels(namespace=namespace, run=run, phase=known).set(
                1 if known == phase else 0)

    def node_signals(self, namespace: str, run: str, counts: dict[str, int]) -> None:
        """Set the run's signal series; a signal no node shows any more loses its series.

        The ``signal`` label is the name of a configured signal (the operator's own
        flags), never a string read from a Node, so the series stay bounded.
        """
        key = (namespace, run)
        for gone in self._signal_series.get(key, frozenset()) - counts.keys():
            with contextlib.suppress(KeyError):
                self.signals.remove(namespace, run, gone)
        for signal, count in counts.items():
            self.signals.labels(namespace=namespace, run=run, signal=signal).set(count)
        if counts:
            self._signal_series[key] = frozenset(counts)
        else:
            self._signal_series.pop(key, None)

    def forget(self, namespace: str, run: str) -> None:
        """Remove every series of a deleted run."""
        self.node_signals(namespace, run, {})
        for metric in (self.members, self.waiting, self.round, self.rounds,
                       self.round_duration):
            with contextlib.suppress(KeyError):
                metric.remove(namespace, run)
        for by_reason in (self.lost, self.detection):
            for reason in (*sorted(rounds.LOSS_REASONS), OTHER):
                with contextlib.suppress(KeyError):
                    by_reason.remove(namespace, run, reason)
        for phase in PHASES:
            with contextlib.suppress(KeyError):
                self.phase.remove(namespace, run, phase)
