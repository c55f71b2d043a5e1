#!/usr/bin/env python3
"""elasticrun's ``k8s`` backend against torch's ``c10d`` and ``etcd-v2``, in one run.

    python bench/run.py            # full: N = 2..128, 5 repetitions (make bench)
    python bench/run.py --quick    # smoke: N = 2, 4, 8, 2 repetitions (make bench-quick)
    python bench/run.py --only resize --column after   # one scenario, merged into the JSON

Every backend runs the same workload on the same machine: nodes are real
rendezvous handlers, as threads spread over a few worker processes.  Servers
(kube-apiserver + etcd, Debian's etcd with the v2 API) are started here and
stopped by PID at the end.  After the k8s formations of each N it measures
the floor (:mod:`bench.floor`) on the same API server, and the report divides
k8s's times by it.  Results: ``<out>/benchmarks.json`` and
``<out>/benchmarks.md`` with PNG plots beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# `python bench/run.py` puts bench/ on the path, not the package's parent.
sys.path.insert(0, str(ROOT))

from bench import backends, floor, report, resize, scenarios  # noqa: E402
from bench.pool import Pool  # noqa: E402
from bench.proc import machine  # noqa: E402


@dataclass(frozen=True)
class Plan:
    """How much to measure; ``--quick`` shrinks everything for CI."""

    sizes: tuple[int, ...] = (2, 4, 8, 16, 32, 64, 128)
    reps: int = 5
    event_reps: int = 5
    event_n: int = 8
    idle_seconds: float = 20.0
    workers: int = 4
    load_runs: int = 200
    load_members: int = 8
    load_window: float = 30.0
    load_losses: int = 3
    #: A formation not done by then is reported as not formed.
    formation_bound: float = 60.0
    #: Floor rounds (bench/floor.py) after each k8s formation size (7-10 s each on 2 cores),
    #: reported as their median: one round's formation at N = 32 measured 0.146 s in one
    #: run and 0.283 s in the next, so a single round moved k8s / floor by 2x on its own.
    floor_reps: int = 3

    @classmethod
    def quick(cls) -> Plan:
        return cls(sizes=(2, 4, 8), reps=2, event_reps=1, event_n=4, idle_seconds=4.0,
                   workers=2, load_runs=10, load_window=5.0, load_losses=1, floor_reps=1)


OPERATOR = ROOT / "operator" / "elasticrun" / "operator" / "__main__.py"
#: Lost-member settings for every backend: heartbeat every 1 s, dead after 3.
RECOVERY_KEEP_ALIVE = 1
#: Idle settings: k8s with a short Lease interval and watch timeout (extrapolated to
#: the defaults in the report); torch at its defaults (keep-alive 5 s).
IDLE_K8S = {"keep_alive": 1, "watch_timeout": 5}
IDLE_TORCH = {"keep_alive": 5}
#: The times of one floor round (:class:`bench.floor.Floor`), as its JSON rows name them.
FLOOR_PHASES = ("formation_s", "loss_s", "newcomer_s")


def ensure_setup() -> None:
    """Install what the benchmark needs outside the venv (Debian's etcd-server)."""
    subprocess.run(["bash", str(ROOT / "bench" / "setup.sh")], check=True)


def run_backend(name: str, plan: Plan, work: Path, log_dir: Path) -> dict[str, Any]:
    backend = backends.make(name, work)
    result: dict[str, Any] = {"counted_how": backend.counted_how, "errors": [], "load": []}
    started = time.monotonic()
    backend.start(log_dir)
    pool = Pool(plan.workers, log_dir, name)
    extra = scenarios.Extra(log_dir, name)

    def step(key: str, action: Callable[[], Any]) -> Any:
        began = time.monotonic()
        try:
            return action()
        except Exception as exc:  # recorded, the other steps still run
            result["errors"].append(f"{key}: {type(exc).__name__}: {exc}")
            traceback.print_exc()
            return None
        finally:
            # Other work on the machine skews every number: keep the load next to them.
            result["load"].append(round(os.getloadavg()[0], 2))
            print(f"  {name} {key}: {time.monotonic() - began:.1f}s", file=sys.stderr,
                  flush=True)

    try:
        result["versions"] = backend.versions()
        formation: list[dict[str, Any]] = []
        with operator_running(backend, log_dir) as operator:
            result["formation_operator"] = operator
            for n in plan.sizes:
                formation.extend(step(f"formation N={n}", functools.partial(
                    scenarios.formation, backend, pool, n, plan.reps,
                    plan.formation_bound)) or [])
                if isinstance(backend, backends.K8sBackend):
                    step(f"floor N={n}", functools.partial(
                        floor_rounds, backend, n, plan, log_dir, result.setdefault("floor", [])))
                if formation and not formation[-1]["formed"]:
                    break  # larger N would not form either; the report says where it stopped
        result["formation"] = formation
        recovery_timing = backends.Timing(plan.event_n - 1, plan.event_n,
                                          keep_alive=RECOVERY_KEEP_ALIVE)
        result["recovery"] = step("recovery", lambda: scenarios.recovery(
            backend, pool, extra, plan.event_n, plan.event_reps, recovery_timing))
        if isinstance(backend, backends.K8sBackend) and OPERATOR.exists():
            result["recovery_pod_deleted"] = step(
                "recovery (pod deleted, operator)", lambda: scenarios.recovery_pod_deleted(
                    backend, pool, extra, plan.event_n, plan.event_reps, recovery_timing,
                    log_dir))
        result["scale_up"] = step("scale-up", lambda: scenarios.scale_up(
            backend, pool, extra, plan.event_n, plan.event_reps))
        idle = IDLE_K8S if name == "k8s" else IDLE_TORCH
        idle_timing = backends.Timing(plan.event_n, plan.event_n, **idle)
        result["steady_state"] = step("steady state", lambda: scenarios.steady_state(
            backend, pool, plan.event_n, plan.idle_seconds, idle_timing))
        if isinstance(backend, backends.K8sBackend) and OPERATOR.exists():
            result["operator_load"] = step("operator at load", lambda: scenarios.operator_load(
                backend, plan.load_runs, plan.load_members, plan.load_window, plan.load_losses,
                log_dir))
    finally:
        extra.stop()
        pool.stop()
        backend.stop()
    result["seconds"] = time.monotonic() - started
    return result


@contextlib.contextmanager
def operator_running(backend: backends.Backend, log_dir: Path) -> Iterator[bool]:
    """The operator watching every namespace while the k8s formations run, as the Helm
    chart installs it; yields whether one runs (never for torch's backends).

    Runs of ``maxNodes`` >= ``rounds.DEFER_SEAL_FROM`` leave their seal to it:
    without one their nodes wait out ``rounds.defer_seal_wait`` before they list
    and seal themselves, the fallback for an operator that is down, not the path
    users take.
    """
    if not isinstance(backend, backends.K8sBackend) or not OPERATOR.exists():
        yield False
        return
    with backend.operator(log_dir):
        yield True


def floor_rounds(backend: backends.K8sBackend, n: int, plan: Plan, log_dir: Path,
                 rows: list[dict[str, Any]]) -> None:
    """The floor at ``n`` on the k8s backend's server, ``plan.floor_reps`` times, into ``rows``.

    Its clients are spread over as many processes as the formation's nodes were
    (the pool's workers that hold a node).  A phase that did not finish is an
    error of the run, after its row (with ``None`` for that phase) is kept.
    """
    for rep in range(plan.floor_reps):
        found = floor.on_server(backend, log_dir, n, min(plan.workers, n), f"n{n}-r{rep}")
        row = {**asdict(found), "rep": rep}
        rows.append(row)
        missing = [key for key in FLOOR_PHASES if row[key] is None]
        if missing or found.errors:
            raise RuntimeError(f"floor phases without a time: {missing or 'none'}; client "
                               f"errors: {list(found.errors) or 'none'}")


#: Changes that do not change what a benchmark measures: the pages the benchmarks
#: write (a second benchmark after a first one finds them changed) and the prose.
NOT_MEASURED = (":(exclude)docs", ":(exclude)*.md")


def commit(root: Path = ROOT) -> str:
    """The commit measured (``BENCH_COMMIT`` when run from an exported tree), marked
    ``+ uncommitted changes`` when a tracked file that runs differs from it."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                           capture_output=True, check=False)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                            *NOT_MEASURED], cwd=root,
                           text=True, capture_output=True, check=False).stdout.strip()
    return (found.stdout.strip() or "unknown") + (" + uncommitted changes" if dirty else "")


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for dist in ("torch", "kubernetes", "python-etcd", "elasticrun"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = "not installed"
    return found


def arguments(description: str) -> argparse.ArgumentParser:
    """The options every benchmark takes: ``--quick`` and ``--out``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="small N, 1-2 repetitions (CI)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory (default: docs/, or bench/out/quick with --quick)")
    return parser


def directories(args: argparse.Namespace, prefix: str) -> tuple[Path, Path, Path]:
    """(output, scratch, logs) of a benchmark run; scratch and logs are fresh."""
    out: Path = args.out or (ROOT / "bench" / "out" / "quick" if args.quick else ROOT / "docs")
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=prefix))
    log_dir = work / "logs"
    log_dir.mkdir()
    return out, work, log_dir


def header(command: str, quick: bool) -> dict[str, Any]:
    """What a benchmark JSON says about its run, before any number."""
    return {"command": command, "quick": quick,
            "plan": asdict(Plan.quick() if quick else Plan()), "machine": machine(),
            "versions": versions(), "commit": commit(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "backends": {}}


def only_resize(args: argparse.Namespace, command: str) -> int:
    """The resize scenario alone, kept in ``benchmarks.json`` under ``resize.<column>``.

    A whole ``make bench`` takes a quarter of an hour; this measures one column
    of the Resize section in a few minutes and renders the page again from the
    JSON, every other section from the numbers already there.
    """
    out, work, log_dir = directories(args, "elasticrun-bench-resize-")
    path = out / "benchmarks.json"
    plan = resize.ResizePlan.quick() if args.quick else resize.ResizePlan()
    data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {
        **header(command, args.quick), "seconds": 0.0}
    began = time.monotonic()
    column: dict[str, Any] = {"command": command, "quick": args.quick, "commit": commit(),
                              "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                              "machine": machine(), "reps": plan.reps}
    try:
        column["backends"] = resize.measure(args.backends.split(","), plan, work, log_dir)
    finally:
        column["seconds"] = time.monotonic() - began
    failed = any(b["errors"] for b in column["backends"].values())
    data.setdefault("resize", {})[args.column] = column
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    if failed:
        print(f"logs kept in {log_dir}", file=sys.stderr)
    else:
        shutil.rmtree(work, ignore_errors=True)
    report.write(data, out)
    print(f"wrote {out / 'benchmarks.md'} (resize, column {args.column}) in "
          f"{column['seconds']:.0f}s", file=sys.stderr)
    return 1 if failed else 0


#: Sections that ``--only`` measures in runs of their own, each column stamped with its
#: commit and date; a whole run does not measure them.
MEASURED_ALONE = ("resize",)


def measured_alone(path: Path) -> dict[str, Any]:
    """The sections of ``path`` (a ``benchmarks.json``) that a whole run carries over:
    :data:`MEASURED_ALONE`, which only ``--only`` measures, so that the page a whole
    run renders keeps them as they were measured."""
    if not path.exists():
        return {}
    previous = json.loads(path.read_text())
    return {key: previous[key] for key in MEASURED_ALONE if key in previous}


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__.splitlines()[0])
    parser.add_argument("--backends", default=",".join(backends.BACKENDS),
                        help="comma-separated subset of k8s,c10d,etcd-v2")
    parser.add_argument("--no-setup", action="store_true",
                        help="skip bench/setup.sh (etcd-server must already be installed)")
    parser.add_argument("--only", choices=("resize",), default=None,
                        help="run this scenario alone (k8s and c10d) and merge its results into "
                             "<out>/benchmarks.json, leaving the other scenarios' numbers as they "
                             "are; the page is rendered again from the merged JSON")
    parser.add_argument("--column", default="now",
                        help="with --only resize: the column the results are kept under "
                             "(e.g. before, after); a column measured again is replaced")
    args = parser.parse_args(argv)
    plan = Plan.quick() if args.quick else Plan()
    command = "make bench-quick" if args.quick else "make bench"
    if argv is not None or sys.argv[1:] not in ([], ["--quick"]):
        command = "python bench/run.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.only == "resize":
        return only_resize(args, command)
    if not args.no_setup:
        ensure_setup()
    out, work, log_dir = directories(args, "elasticrun-bench-")
    data: dict[str, Any] = {**header(command, args.quick),
                            **measured_alone(out / "benchmarks.json")}
    began = time.monotonic()
    failed = False
    try:
        for name in args.backends.split(","):
            print(f"benchmarking {name}", file=sys.stderr, flush=True)
            data["backends"][name] = run_backend(name, plan, work, log_dir)
            failed |= bool(data["backends"][name]["errors"])
    finally:
        data["seconds"] = time.monotonic() - began
        (out / "benchmarks.json").write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        if failed:
            print(f"logs kept in {log_dir}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    report.write(data, out)
    print(f"wrote {out / 'benchmarks.md'} in {data['seconds']:.0f}s", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
