"""Process facts the benchmark reads from /proc: CPU seconds, memory; and stopping by PID."""

from __future__ import annotations

import os
import time

from controlplane.localcluster import free_port, stop_pid

__all__ = ["cpu_seconds", "free_port", "machine", "rss_bytes", "stop_pid", "wait_quiet"]

_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (its own threads, not its children); 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return 0.0
    # Fields after the command name, which is in parentheses and may hold spaces.
    fields = text[text.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def wait_quiet(pid: int, bound: float, threshold: float = 0.05) -> None:
    """Wait until a process uses less than ``threshold`` CPU seconds per second (bounded)."""
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        before = cpu_seconds(pid)
        time.sleep(1.0)
        if cpu_seconds(pid) - before < threshold:
            return


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def machine() -> dict[str, object]:
    """What the numbers were measured on."""
    mem_kib = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f
                          if ln.startswith("model name")), "")
    except OSError:
        pass
    return {"nproc": os.cpu_count(), "memory_gib": round(mem_kib / 2**20, 1), "cpu": model,
            "kernel": os.uname().release}
