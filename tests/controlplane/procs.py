"""Processes by PID: how every part of the local cluster is started and stopped.

Each process runs in a session of its own and is stopped by its PID, never by
name: other clusters, other test sessions and the machine's own processes
share this machine.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

#: kube-apiserver drains open watches on SIGTERM; a test cluster need not wait long.
STOP_TIMEOUT = 5.0


def clean_env() -> dict[str, str]:
    """The environment without proxies: the API server calls webhooks through them."""
    env = {k: v for k, v in os.environ.items()
           if k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    return env


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - not ours
        return True
    # A zombie still answers kill(0): reap it if it is our child, and count any
    # zombie (someone else's child, not reaped yet) as dead.
    with contextlib.suppress(ChildProcessError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc: trust kill(0)
    return stat.rpartition(")")[2].split()[0] != "Z"


def stop_pid(pid: int, timeout: float = STOP_TIMEOUT) -> None:
    """SIGTERM, a bounded wait, then SIGKILL: only the PID we started."""
    if not pid_alive(pid):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (from /proc), children before grandchildren."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        parents.setdefault(ppid, []).append(int(entry))
    found: list[int] = []
    todo = [pid]
    while todo:
        children = parents.get(todo.pop(0), [])
        found += children
        todo += children
    return found


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signal ``pid`` and all its descendants, even those in sessions of their own.

    torchrun starts each worker in a new session, so killing the agent's process
    group would leave its workers training on as orphans; a node that dies takes
    everything it ran with it.
    """
    for target in [pid, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(target, sig)


def processes_naming(directory: Path) -> list[int]:
    """Processes whose command line or environment names ``directory``.

    etcd and kube-apiserver are started with paths inside their control plane's
    directory, and everything a test starts against it (the operator, node
    agents, torchrun and its workers) carries its kubeconfig path.  Matching on
    that, not on recorded PIDs alone, also guards against PID reuse.
    """
    needle = str(directory).encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if needle in (proc / "cmdline").read_bytes() or \
                    needle in (proc / "environ").read_bytes():
                found.append(int(proc.name))
        except OSError:
            continue  # gone, or not ours to read
    return found
