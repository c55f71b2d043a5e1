"""The coordinator's side of the workers: start, command and stop them by PID.

Every call has a bound; a worker that does not answer in time is an error the
benchmark reports, never a hang.  Workers are started in their own session and
stopped by their PID only.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.proc import stop_pid

ROOT = Path(__file__).resolve().parent.parent


class WorkerError(RuntimeError):
    """A worker failed a command, died, or did not answer within the bound."""


def source_paths() -> list[Path]:
    """Where this checkout's code lives: the bench, the handler, the operator, test helpers."""
    return [ROOT, ROOT / "handler", ROOT / "operator", ROOT / "tests"]


def worker_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    # The handler of this checkout, not whatever the venv's editable install points at.
    env["PYTHONPATH"] = os.pathsep.join([*map(str, source_paths()),
                                         env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    return env


class WorkerProcess:
    """One ``python -m bench.worker`` child and a thread reading its answers."""

    _ids = itertools.count(1)

    def __init__(self, name: str, log_dir: Path, env: Mapping[str, str] | None = None) -> None:
        self.name = name
        self._log = open(log_dir / f"{name}.log", "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.worker"], cwd=ROOT, env={**worker_env(), **(env or {})},
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
            start_new_session=True, text=True, bufsize=1)
        self.pid = self.proc.pid
        self._answers: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.strip()
            if line.startswith("{"):
                self._answers.put(json.loads(line))
        self._answers.put(None)

    def send(self, cmd: str, **fields: Any) -> int:
        msg_id = next(self._ids)
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"id": msg_id, "cmd": cmd, **fields}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise WorkerError(f"{self.name} (pid {self.pid}) is gone: {exc}") from exc
        return msg_id

    def receive(self, msg_id: int, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerError(f"{self.name} (pid {self.pid}) did not answer within "
                                  f"{timeout:.0f}s")
            try:
                answer = self._answers.get(timeout=remaining)
            except queue.Empty:
                continue
            if answer is None:
                raise WorkerError(f"{self.name} (pid {self.pid}) exited "
                                  f"(code {self.proc.poll()})")
            if answer.get("id") != msg_id:
                continue  # a late answer to a command that already timed out
            if not answer.get("ok"):
                raise WorkerError(f"{self.name}: {answer.get('error')}")
            return answer

    def call(self, cmd: str, timeout: float = 120.0, **fields: Any) -> dict[str, Any]:
        return self.receive(self.send(cmd, **fields), timeout)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.alive():
            try:
                self.send("exit")
                self.proc.wait(timeout=10)
            except (WorkerError, subprocess.TimeoutExpired):
                pass
        stop_pid(self.pid, timeout=5)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        self._log.close()


class Pool:
    """A fixed set of workers; nodes are dealt to them round-robin.

    ``env`` is added to every worker's environment from its start (``LD_PRELOAD``
    must be there before the process runs).
    """

    def __init__(self, size: int, log_dir: Path, prefix: str,
                 env: Mapping[str, str] | None = None) -> None:
        self._log_dir, self._prefix, self._restarts, self._env = log_dir, prefix, 0, env
        self.workers = [WorkerProcess(f"{prefix}-w{i}", log_dir, env) for i in range(size)]

    def restart(self) -> None:
        """Stop every worker by PID and start fresh ones.

        For nodes stuck in a round that will not form: waiting for each of them
        to give up costs minutes and measures nothing.
        """
        for worker in self.workers:
            stop_pid(worker.pid, timeout=5)
            worker.stop()
        self._restarts += 1
        self.workers = [WorkerProcess(f"{self._prefix}-w{i}.{self._restarts}", self._log_dir,
                                      self._env) for i in range(len(self.workers))]

    def deal(self, nodes: Sequence[str]) -> list[list[str]]:
        shares: list[list[str]] = [[] for _ in self.workers]
        for i, node in enumerate(nodes):
            shares[i % len(self.workers)].append(node)
        return shares

    def all(self, cmd: str, timeout: float = 120.0, per_worker: Sequence[dict[str, Any]] | None
            = None, **fields: Any) -> list[dict[str, Any]]:
        """Send to every worker at once, then wait for every answer."""
        ids = []
        for i, worker in enumerate(self.workers):
            extra = per_worker[i] if per_worker is not None else {}
            ids.append(worker.send(cmd, **fields, **extra))
        return [w.receive(i, timeout) for w, i in zip(self.workers, ids, strict=True)]

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self.workers]

    def stop(self) -> None:
        for worker in self.workers:
            worker.stop()
