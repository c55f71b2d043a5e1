"""The operator as a real process (``python -m elasticrun.operator``), for tests and the demo."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from controlplane.localcluster import stop_pid

START_TIMEOUT = 60.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _get(url: str, timeout: float = 5.0) -> str:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=timeout) as response:
        return str(response.read().decode())


def _sources() -> list[str]:
    """Where this process imports ``elasticrun`` from, for the operator's ``PYTHONPATH``.

    A test runs the operator of the code it tests: a virtualenv's editable
    install names one checkout, and a second checkout (a git worktree) that
    shares it would otherwise start that one's operator.
    """
    import elasticrun.api

    handler = Path(elasticrun.api.__file__).resolve().parents[2]
    return [str(handler), str(handler.parent / "operator")]


class OperatorProcess:
    """Scoped to ``namespaces``; metrics and health on free loopback ports."""

    def __init__(self, kubeconfig: Path, namespaces: Sequence[str], log_dir: Path,
                 extra_args: Sequence[str] = ()) -> None:
        self.kubeconfig = kubeconfig
        self.namespaces = list(namespaces)
        self.log_path = log_dir / "operator.log"
        self.extra_args = list(extra_args)
        self.metrics_port = free_port()
        self.health_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError("the operator is not running")
        return self.proc.pid

    def start(self) -> OperatorProcess:
        argv = [sys.executable, "-m", "elasticrun.operator", "--kubeconfig", str(self.kubeconfig),
                "--metrics-addr", "127.0.0.1", "--metrics-port", str(self.metrics_port),
                "--health-addr", "127.0.0.1", "--health-port", str(self.health_port),
                *self.extra_args]
        for ns in self.namespaces:
            argv += ["--namespace", ns]
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig),
               "PYTHONPATH": os.pathsep.join(
                   [*_sources(), *filter(None, [os.environ.get("PYTHONPATH")])])}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the operator exited during start-up:\n{self.log_tail()}")
            try:
                _get(f"http://127.0.0.1:{self.health_port}/healthz", timeout=1)
                return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the operator was not healthy within {START_TIMEOUT:.0f}s:\n"
                                   f"{self.log_tail()}")
            time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL: no clean-up at all, as when its node dies."""
        if self.proc is not None:
            stop_pid(self.proc.pid, timeout=0)
            self.proc.wait(timeout=10)
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            stop_pid(self.proc.pid, timeout=10)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)
            self.proc = None

    def metrics(self) -> str:
        return _get(f"http://127.0.0.1:{self.metrics_port}/metrics")

    def healthz(self) -> str:
        return _get(f"http://127.0.0.1:{self.health_port}/healthz", timeout=2)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"
