"""Helpers for the chaos, bad-input and security tests: node processes and measurements.

Nodes run as real processes (``node_agent.py``) so a SIGKILL is a real one.
Each test that measures a fault records one row with :func:`record`; the rows
are appended as JSON lines to the file named by ``ELASTICRUN_RELIABILITY_JSON``
(nothing is written when it is unset), and ``tests/reliability_report.py``
turns them into ``docs/reliability.md``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elasticrun.api.kube import run_path
from elasticrun.api.model import ElasticRun

from conftest import ROOT, Cluster, ProcessGroup, wait_for
from controlplane.localcluster import clean_env

AGENT = Path(__file__).with_name("node_agent.py")
RESULTS_ENV = "ELASTICRUN_RELIABILITY_JSON"


def record(scenario: str, *, fault: str, expected: str, observed: str,
           recovery_seconds: float | None, lost: str = "nothing",
           group: str = "fault") -> None:
    """One row of docs/reliability.md, measured by the test that just passed its checks."""
    row = {"group": group, "scenario": scenario, "fault": fault, "expected": expected,
           "observed": observed, "recovery_seconds": recovery_seconds, "lost": lost,
           "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]}
    print(f"\nreliability: {json.dumps(row)}")
    path = os.environ.get(RESULTS_ENV)
    if path:
        with open(path, "a") as out:
            out.write(json.dumps(row) + "\n")


class NodeProcess:
    """A ``node_agent.py`` process; its JSON lines are collected by a reader thread."""

    def __init__(self, proc: subprocess.Popen[str], node: str, log_path: Path) -> None:
        self.proc = proc
        self.node = node
        self.log_path = log_path
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            with self._lock:
                self.events.append(event)

    def of(self, kind: str) -> list[dict[str, Any]]:
        with self._lock:
            return [e for e in self.events if e["event"] == kind]

    def rendezvous(self) -> list[dict[str, Any]]:
        return self.of("rendezvous")

    def wait_event(self, kind: str, timeout: float, count: int = 1,
                   where: Callable[[dict[str, Any]], bool] = lambda e: True) -> dict[str, Any]:
        """The ``count``-th event of ``kind`` matching ``where``; fails on an early exit."""

        def got() -> dict[str, Any] | None:
            found = [e for e in self.of(kind) if where(e)]
            if len(found) >= count:
                return found[count - 1]
            if self.proc.poll() is not None and kind != "error":
                self._reader.join(2)
                found = [e for e in self.of(kind) if where(e)]
                if len(found) >= count:
                    return found[count - 1]
                raise AssertionError(f"node {self.node} exited ({self.proc.returncode}) "
                                     f"before {kind}: {self.events}\n{self.log_tail()}")
            return None

        event: dict[str, Any] = wait_for(got, timeout, f"{self.node}: {kind} #{count}")
        return event

    def kill(self) -> float:
        """SIGKILL, by PID; returns the moment it was sent."""
        moment = time.time()
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        return moment

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def start_node(processes: ProcessGroup, kubeconfig: Path, namespace: str, run: str,
               node: str, log_dir: Path, nnodes: str = "1:1", conf: str = "",
               *extra: str) -> NodeProcess:
    log_path = log_dir / f"node-{node[:60]}.log"
    env = {**clean_env(), "PYTHONPATH": os.pathsep.join(
        str(ROOT / p) for p in ("handler", "operator", "tests"))}
    with open(log_path, "ab") as log:
        proc = processes.start(
            [sys.executable, str(AGENT), "--kubeconfig", str(kubeconfig), "--namespace",
             namespace, "--run", run, "--node", node, "--nnodes", nnodes, "--conf", conf,
             *extra],
            stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    return NodeProcess(proc, node, log_path)


def assert_all_ok(outcomes: dict[str, Any]) -> None:
    """Every node's rendezvous succeeded; otherwise the first errors, in full."""
    errors = {n: f"{type(o.error).__name__}: {o.error}" for n, o in outcomes.items() if o.error}
    assert not errors, "\n".join(f"{n}: {e}" for n, e in sorted(errors.items())[:5])


def raw_run(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    return cluster.client.request("GET", run_path(namespace, name))


def assert_consistent(run: ElasticRun) -> None:
    """What every reader must be able to rely on after a fault: nothing half-written."""
    status = run.status
    ranks = sorted(p.rank for p in status.participants)
    if status.participants and not status.degraded:
        assert ranks == list(range(len(ranks))), ranks
        assert status.store is not None
    assert len(status.member_names) == len(status.participants)
