"""The floor: the cheapest rendezvous this API server allows, measured beside ours.

N clients each create their own Lease once and wait for one watch event of one
object, the *board* (a ConfigMap), which a single writer updates once, after its
watch of the Leases has shown all N.  No ranks, no store, no run object, no
operator: what any protocol on this API server must at least do for N nodes to
learn that all N are there.  A loss and a newcomer are the same exchange: the
writer sees one Lease deleted (or one more created) and updates the board once,
and every client's board watch delivers it.

Clients start as :mod:`bench.simnode`'s nodes do (read, create, watch from the
resourceVersion read, one connection for requests and one for the watch), many
to an asyncio process (``python -m bench.floor``: one JSON line in, one line per
client and board update out).  The writer is one more such process
(``--writer``), as the operator is a process of its own.  :func:`measure` drives
one size and returns the three times; the benchmarks report ours divided by them.

    python -m bench.floor --sizes 2,8,32,128    # the floor alone, on a fresh API server
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elasticrun.api.kube import MERGE_PATCH, leases_path

from bench.simnode import HttpError, Shared, Tickets, shared_from, watch_lines

if TYPE_CHECKING:
    from bench.backends import K8sBackend

#: The Leases of one floor round carry this label (its value: the round's tag).
LABEL = "bench.elasticrun.dev/floor"
#: Bound on every wait of the coordinator, and on a client's whole life.
BOUND = 120.0
#: Pause between the phases, so that one phase's stragglers are not the next one's load.
SETTLE = 1.0
#: From the coordinator's go to the clients' start: every process reads it in time.
LEAD = 0.5


def board_path(namespace: str, name: str = "") -> str:
    base = f"/api/v1/namespaces/{namespace}/configmaps"
    return f"{base}/{name}" if name else base


def _say(line: dict[str, Any]) -> None:
    """One line to the coordinator."""
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()


def _round_of(obj: dict[str, Any]) -> int:
    return int((obj.get("data") or {}).get("round", "0"))


# --------------------------------------------------------------------------- the clients


async def _client(shared: Shared, config: dict[str, Any], name: str,
                  out: asyncio.Queue[dict[str, Any]]) -> None:
    """One client: read the board, create its Lease, report each board update it sees."""
    ns, board, last = config["namespace"], config["board"], int(config["rounds"])
    tickets = Tickets()  # a process of its own, as a node is (simnode.Tickets)
    requests, watch = shared.connection(tickets), shared.connection(tickets)
    await asyncio.sleep(max(0.0, float(config["start_at"]) - time.monotonic()))
    await out.put({"node": name, "t_start": time.monotonic()})
    try:
        read = json.loads(await requests.request("GET", board_path(ns, board)))
        seen = _round_of(read)
        await requests.request("POST", leases_path(ns), {
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": f"floor-{name}", "labels": {LABEL: config["tag"]}},
            "spec": {"holderIdentity": name, "leaseDurationSeconds": 60}})
        query = {"fieldSelector": f"metadata.name={board}",
                 "resourceVersion": read["metadata"]["resourceVersion"]}
        async for line in watch_lines(watch, board_path(ns), query):
            now = _round_of(shared.parse(line).get("object") or {})
            if now > seen:
                seen = now
                await out.put({"node": name, "round": now, "t": time.monotonic()})
                if now >= last:
                    return
    except (HttpError, OSError, asyncio.IncompleteReadError, ValueError) as exc:
        await out.put({"node": name, "error": f"{type(exc).__name__}: {exc}"})
    finally:
        requests.close()
        watch.close()


async def _clients(config: dict[str, Any]) -> None:
    """Start this process's clients at the coordinator's ``start_at``; pass on their lines."""
    shared = shared_from(config["kubeconfig"], config["namespace"], "")
    _say({"ready": True})
    start = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    config = {**config, **json.loads(start)}
    out: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    tasks = [asyncio.create_task(_client(shared, config, name, out))
             for name in config["nodes"]]
    done = asyncio.create_task(asyncio.wait_for(asyncio.gather(*tasks), BOUND))
    while not (done.done() and out.empty()):
        with contextlib.suppress(TimeoutError):
            _say(await asyncio.wait_for(out.get(), 0.5))
    with contextlib.suppress(Exception):
        await done


# --------------------------------------------------------------------------- the writer


def next_board_round(board_round: int, changed: bool, size: int, n: int) -> int:
    """The board's round once the Lease set is ``size`` Leases (``changed``: not the set
    it was at the last look).

    Round 1 is the first time all ``n`` are there; from then on every change of
    the set (a loss, a newcomer) is one more round.
    """
    if board_round == 0:
        return 1 if size >= n else 0
    return board_round + 1 if changed else board_round


#: How many times the writer lists the Leases again after the server ended its watch.
#: The API server closes a watcher that falls behind a burst of events (on 2 cores,
#: 256 Leases created at once were enough); an informer lists again, and so do we.
RELISTS = 20


async def _writer(config: dict[str, Any]) -> None:
    """The one writer: bump the board once per change of the Lease set, from the first full one.

    Round 1 when all ``n`` Leases are there; after that, every Lease created or
    deleted is one more round.  Each update is one merge patch.  A watch the
    server ends is followed by a new listing and a watch from it, as an
    informer does; a change seen only in the new listing counts as one.
    """
    ns, n = config["namespace"], int(config["n"])
    shared = shared_from(config["kubeconfig"], ns, "")
    tickets = Tickets()
    requests, watch = shared.connection(tickets), shared.connection(tickets)
    selector = f"{LABEL}={config['tag']}"
    board_round = 0
    names: set[str] | None = None

    async def publish(value: int) -> None:
        await requests.request("PATCH", board_path(ns, config["board"]),
                               {"data": {"round": str(value)}}, MERGE_PATCH)
        _say({"round": value, "t": time.monotonic()})

    async def look(changed: bool, size: int) -> None:
        nonlocal board_round
        following = next_board_round(board_round, changed, size, n)
        if following != board_round:
            board_round = following
            await publish(board_round)

    for _ in range(RELISTS + 1):
        listed = json.loads(await requests.request(
            "GET", f"{leases_path(ns)}?labelSelector={selector}"))
        before, names = names, {item["metadata"]["name"] for item in listed.get("items") or ()}
        if before is None:
            _say({"ready": True})  # the watch starts at the listing: nothing after it is missed
        await look(before is not None and names != before, len(names))
        query = {"labelSelector": selector,
                 "resourceVersion": listed["metadata"]["resourceVersion"]}
        # A watch refused (410: the listing is too old) or cut: list again.
        with contextlib.suppress(HttpError, OSError, asyncio.IncompleteReadError):
            async for line in watch_lines(watch, leases_path(ns), query):
                event = json.loads(line)
                name = ((event.get("object") or {}).get("metadata") or {}).get("name")
                # One membership test per event: the writer keeps up with a burst of N.
                kind = event.get("type")
                added = kind == "ADDED" and isinstance(name, str) and name not in names
                deleted = kind == "DELETED" and name in names
                if added:
                    names.add(str(name))
                elif deleted:
                    names.discard(name)
                await look(added or deleted, len(names))
        watch.close()
        watch = shared.connection(tickets)


# --------------------------------------------------------------------------- the coordinator


#: Notified whenever any child's reader thread adds a line, so one wait covers them all.
_LINES = threading.Condition()


class _Proc:
    """One ``python -m bench.floor`` child; its lines, read by a thread."""

    def __init__(self, args: list[str], config: dict[str, Any], log: Path,
                 env: dict[str, str]) -> None:
        self.log = log.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.floor", *args], cwd=Path(__file__).parent.parent,
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
            start_new_session=True, bufsize=1)
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(config) + "\n")
        self.proc.stdin.flush()
        self.lines: list[dict[str, Any]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def ready(self, bound: float = BOUND) -> None:
        """Wait until the child has started (imports done, config read)."""
        deadline = time.monotonic() + bound
        with _LINES:
            while not any(line.get("ready") for line in self.lines):
                if time.monotonic() >= deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"a floor process did not start; see {self.log.name}")
                _LINES.wait(0.1)

    def go(self, start_at: float) -> None:
        """Tell a client process when its clients start (monotonic, shared by all processes)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"start_at": start_at}) + "\n")
        self.proc.stdin.flush()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with _LINES:
                self.lines.append(json.loads(line))
                _LINES.notify_all()

    def stop(self) -> None:
        from bench.proc import stop_pid  # noqa: PLC0415 - the coordinator's side only

        with contextlib.suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            stop_pid(self.proc.pid, timeout=5)
        self.log.close()


@dataclass(frozen=True)
class Floor:
    """One floor round: seconds until every client knew, per phase (None: it did not)."""

    n: int
    formation_s: float | None
    loss_s: float | None
    newcomer_s: float | None
    errors: tuple[str, ...] = ()


def _wait_lines(procs: list[_Proc], enough: Any, bound: float) -> list[dict[str, Any]]:
    deadline = time.monotonic() + bound
    with _LINES:
        while True:
            lines = [line for p in procs for line in p.lines]
            if enough(lines) or time.monotonic() >= deadline:
                return lines
            _LINES.wait(max(0.0, deadline - time.monotonic()))


def measure(api: Any, kubeconfig: str, namespace: str, n: int, processes: int, log_dir: Path,
            env: dict[str, str], tag: str = "") -> Floor:
    """Formation, a loss and a newcomer of ``n`` floor clients in ``namespace`` (it exists).

    ``api`` is a :class:`~elasticrun.api.kube.KubeClient` of the coordinator: it
    creates the board and deletes the lost client's Lease (the fault, not a
    client's request).  Each time runs until the last client that should know
    saw the board's update: from the start of the clients, from the deletion,
    and from the newcomer's start.
    """
    tag = tag or f"n{n}"
    board = f"floor-{tag}"
    api.request("POST", board_path(namespace), body={
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": board},
        "data": {"round": "0"}})
    names = [f"{tag}-{i:05d}" for i in range(n)]
    common = {"kubeconfig": kubeconfig, "namespace": namespace, "board": board, "tag": tag}
    writer = _Proc(["--writer"], {**common, "n": n}, log_dir / f"floor-{tag}-writer.log", env)
    procs = [_Proc([], {**common, "nodes": names[i::processes], "rounds": 3},
                   log_dir / f"floor-{tag}-{i}.log", env) for i in range(processes)]
    errors: list[str] = []
    try:
        for proc in [writer, *procs]:
            proc.ready()
        start = time.monotonic() + LEAD
        for proc in procs:
            proc.go(start)
        def at(round_: int, who: set[str]) -> Any:
            def enough(lines: list[dict[str, Any]]) -> bool:
                return {x["node"] for x in lines if x.get("round") == round_} >= who \
                    or any("error" in x for x in lines)
            return enough

        lines = _wait_lines(procs, at(1, set(names)), BOUND)
        done = [x["t"] for x in lines if x.get("round") == 1]
        formation = max(done) - start if len(done) == n else None
        time.sleep(SETTLE)
        lost, survivors = names[-1], set(names[:-1])
        lost_at = time.monotonic()
        api.request("DELETE", f"{leases_path(namespace)}/floor-{lost}")
        lines = _wait_lines(procs, at(2, survivors), BOUND)
        told = [x["t"] for x in lines if x.get("round") == 2 and x["node"] in survivors]
        loss = max(told) - lost_at if len(told) == len(survivors) else None
        time.sleep(SETTLE)
        newcomer = f"{tag}-late"
        late = _Proc([], {**common, "nodes": [newcomer], "rounds": 3},
                     log_dir / f"floor-{tag}-late.log", env)
        procs.append(late)
        late.ready()
        late.go(time.monotonic() + LEAD)
        everyone = {*survivors, newcomer}
        lines = _wait_lines(procs, at(3, everyone), BOUND)
        started = [x["t_start"] for x in late.lines if "t_start" in x]
        knew = [x["t"] for x in lines if x.get("round") == 3 and x["node"] in everyone]
        joined = max(knew) - started[0] if started and len(knew) == len(everyone) else None
        errors = [f"{x['node']}: {x['error']}" for x in lines if "error" in x]
        return Floor(n, formation, loss, joined, tuple(errors[:3]))
    finally:
        for proc in [*procs, writer]:
            proc.stop()
        with contextlib.suppress(Exception):
            api.request("DELETE", board_path(namespace, board))


#: Numbers the namespaces of one process's floors: a deleted one lingers while it terminates.
_serial = itertools.count()


def on_server(backend: K8sBackend, log_dir: Path, n: int, processes: int, tag: str = ""
              ) -> Floor:
    """The floor at ``n`` on a benchmark's own API server, in a namespace of its own.

    Both benchmarks measure it right after their own round of ``n``, so that the
    two times share a server, its caches and the machine's load; the namespace
    is deleted after, and the server left to settle before the next measurement.
    """
    from bench.pool import worker_env  # noqa: PLC0415 - the coordinator's side only

    api = backend.control_plane.api
    namespace = f"floor-{n}-{next(_serial)}-{int(time.time()) % 100000}"
    api.request("POST", "/api/v1/namespaces", body={
        "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    try:
        return measure(api, str(backend.control_plane.kubeconfig), namespace, n, processes,
                       log_dir, worker_env(), tag)
    finally:
        api.request("DELETE", f"/api/v1/namespaces/{namespace}")
        backend.quiesce(30)


# --------------------------------------------------------------------------- entry points


def _standalone(sizes: list[int], processes: int) -> int:
    """The floor alone, on a fresh control plane of the benchmarks (:class:`K8sBackend`)."""
    import tempfile  # noqa: PLC0415

    from bench.backends import K8sBackend  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="floor-") as work:
        backend = K8sBackend(Path(work) / "controlplane")
        backend.start(Path(work))
        try:
            print("| N | formation | loss | newcomer |\n|---|---|---|---|")
            for n in sizes:
                f = on_server(backend, Path(work), n, processes)
                cells = [f"{v:.3f} s" if v is not None else "—"
                         for v in (f.formation_s, f.loss_s, f.newcomer_s)]
                print(f"| {n} | {' | '.join(cells)} |" + (f" {f.errors}" if f.errors else ""),
                      flush=True)
        finally:
            backend.stop()
    return 0


async def _until_stdin_closes(work: Any) -> None:
    """Run ``work`` until it ends, or until the coordinator closes our stdin."""
    task = asyncio.ensure_future(work)
    closed = asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await asyncio.wait([task, closed], timeout=BOUND * 3, return_when=asyncio.FIRST_COMPLETED)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, HttpError, OSError):
        await task


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--writer", action="store_true", help="(child) the one writer")
    parser.add_argument("--sizes", help="measure the floor alone at these N (comma-separated)")
    parser.add_argument("--processes", type=int, default=4, help="client processes")
    args = parser.parse_args(argv)
    if args.sizes:
        return _standalone([int(s) for s in args.sizes.split(",")], args.processes)
    config = json.loads(sys.stdin.readline())
    with contextlib.suppress(KeyboardInterrupt):
        # The clients end by themselves (the last round, or BOUND); the writer when told.
        asyncio.run(_until_stdin_closes(_writer(config)) if args.writer else _clients(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
