"""A benchmark worker process: holds a share of the nodes as threads.

Run as ``python -m bench.worker``.  It reads one JSON command per line on stdin
and answers one JSON line on stdout (logs go to stderr).  Nodes are real
rendezvous handlers built through the same creator functions torchrun uses;
many nodes per process keep 128 nodes affordable on two cores, at the price
that their client-side CPU is serialised by the GIL, for every backend alike.

Times are ``time.monotonic()``, which on Linux is the system-wide
``CLOCK_MONOTONIC``: the coordinator compares them across processes.
"""

from __future__ import annotations

import datetime
import gc
import json
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.counting import CountingPool, CountingStore, OpCounter

log = logging.getLogger("bench.worker")

#: Bound on a blocking command (shutdown of many nodes, collect).
COMMAND_BOUND = 300.0


@dataclass
class Node:
    name: str
    handler: Any
    counter: OpCounter | None


def _params(backend: str, spec: dict[str, Any], node: str) -> Any:
    from torch.distributed.elastic.rendezvous import RendezvousParameters  # noqa: PLC0415

    conf = {k: str(v) for k, v in spec.get("conf", {}).items()}
    if backend == "k8s":
        conf["node_name"] = node
        if spec.get("pods"):
            conf["pod"] = node  # the node runs in the Pod of its own name
    elif backend == "c10d":
        conf["is_host"] = "1" if node == spec.get("host_node") else "0"
    return RendezvousParameters(backend=backend, endpoint=spec["endpoint"], run_id=spec["run"],
                                min_nodes=int(spec["min"]), max_nodes=int(spec["max"]),
                                local_addr="127.0.0.1", **conf)


def _import_backend(backend: str) -> None:
    """Import what building a node of ``backend`` needs (torch, the handler)."""
    if backend == "k8s":
        import elasticrun.handler.handler  # noqa: F401, PLC0415
    else:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous  # noqa: F401, PLC0415


def build_node(backend: str, spec: dict[str, Any], name: str) -> Node:
    """One node's handler, made the way torch's registry makes it, plus its counter."""
    params = _params(backend, spec, name)
    if backend == "k8s":
        from elasticrun.handler.handler import create_handler  # noqa: PLC0415

        return Node(name, create_handler(params), None)
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous  # noqa: PLC0415

    counter = OpCounter()
    rdzv_backend: Any
    store: Any
    if backend == "c10d":
        from torch.distributed.elastic.rendezvous import (  # noqa: PLC0415
            c10d_rendezvous_backend,
        )

        rdzv_backend, store = c10d_rendezvous_backend.create_backend(params)
        # The backend calls getattr(self._store, op): count every such call.
        rdzv_backend._store = CountingStore(rdzv_backend._store, counter)
    elif backend == "etcd-v2":
        from torch.distributed.elastic.rendezvous import (  # noqa: PLC0415
            etcd_rendezvous_backend,
        )

        rdzv_backend, store = etcd_rendezvous_backend.create_backend(params)
        # Backend and EtcdStore share this one client: count its HTTP requests.
        store.client.http = CountingPool(store.client.http, counter)
    else:
        raise ValueError(f"unknown backend {backend!r}")
    handler = dynamic_rendezvous.create_handler(store, rdzv_backend, params)
    return Node(name, handler, counter)


class Worker:
    """The nodes of this process and the background tasks they run."""

    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}
        self.backend = ""
        self._results: list[dict[str, Any]] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ commands

    def build(self, msg: dict[str, Any]) -> dict[str, Any]:
        self.backend = msg["backend"]
        os.environ.update(msg.get("env") or {})
        _import_backend(self.backend)  # once per process: not part of building a node
        started = time.monotonic()
        for name in msg["nodes"]:
            self.nodes[name] = build_node(self.backend, msg, name)
        return {"built": len(msg["nodes"]), "seconds": time.monotonic() - started}

    def _selected(self, msg: dict[str, Any]) -> list[Node]:
        names = msg.get("nodes")
        return list(self.nodes.values()) if names is None else [self.nodes[n] for n in names]

    def _spawn(self, target: Any, node: Node, *args: Any) -> None:
        thread = threading.Thread(target=target, args=(node, *args), daemon=True,
                                  name=f"{target.__name__.strip('_')}:{node.name}")
        self._threads.append(thread)
        thread.start()

    def _record(self, result: dict[str, Any]) -> None:
        with self._lock:
            self._results.append(result)

    def rendezvous(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Start ``next_rendezvous()`` on the nodes at ``start_at``; results via collect."""
        gate = threading.Event()
        nodes = self._selected(msg)
        for node in nodes:
            self._spawn(self._rendezvous_one, node, gate)
        _sleep_until(float(msg.get("start_at", 0)))
        gate.set()
        return {"started": len(nodes)}

    def _rendezvous_one(self, node: Node, gate: threading.Event) -> None:
        gate.wait()
        result: dict[str, Any] = {"kind": "rendezvous", "node": node.name,
                                  "t_start": time.monotonic()}
        result.update(_next_rendezvous(node))
        self._record(result)

    def watch(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Ask ``num_nodes_waiting()`` like torch's agent; optionally re-rendezvous when > 0.

        It asks every ``interval`` and, for a handler with a cache
        (:func:`_news`), at once when the cache changes: ``t_seen`` is when the
        node knew, as the floor's clients record the event that tells them,
        not when a poll next looked (which would add up to ``interval`` that
        is torch's agent's, the same for every backend).
        """
        nodes = self._selected(msg)
        for node in nodes:
            self._spawn(self._watch_one, node, float(msg["until"]), float(msg["interval"]),
                        bool(msg.get("rejoin", False)))
        return {"started": len(nodes)}

    def _watch_one(self, node: Node, until: float, interval: float, rejoin: bool) -> None:
        result: dict[str, Any] = {"kind": "watch", "node": node.name, "t_seen": None,
                                  "polls": 0}
        try:
            while time.monotonic() < until:
                result["polls"] += 1
                wait = _news(node)
                if node.handler.num_nodes_waiting() > 0:
                    result["t_seen"] = time.monotonic()
                    break
                wait(interval)
        except Exception as exc:  # reported to the coordinator
            result["watch_error"] = f"{type(exc).__name__}: {exc}"
        if rejoin and (result["t_seen"] is not None or "watch_error" in result):
            result["t_start"] = time.monotonic()
            result.update(_next_rendezvous(node))
        self._record(result)

    def agent(self, msg: dict[str, Any]) -> dict[str, Any]:
        """torchrun's agent loop on the selected nodes, each round recorded.

        A node with a time in ``start_at`` first calls ``next_rendezvous()`` then
        (a newcomer); the others are members of a running round.  Every node
        then polls ``num_nodes_waiting()`` every ``interval`` and re-rendezvous
        when it is > 0, as torch's agent restarts its workers, until its round
        has ``target`` nodes and ``settle`` seconds passed without a signal, or
        ``until``.  ``fallback_at``: a member never signalled re-enters by
        itself then, as it would once its collective timed out.
        """
        nodes = self._selected(msg)
        starts = {str(k): float(v) for k, v in (msg.get("start_at") or {}).items()}
        fallback = msg.get("fallback_at")
        for node in nodes:
            self._spawn(self._agent_one, node, starts.get(node.name), float(msg["until"]),
                        float(msg["interval"]), int(msg["target"]), float(msg["settle"]),
                        None if fallback is None else float(fallback))
        return {"started": len(nodes)}

    def _agent_one(self, node: Node, start_at: float | None, until: float, interval: float,
                   target: int, settle: float, fallback_at: float | None) -> None:
        rounds: list[dict[str, Any]] = []
        result: dict[str, Any] = {"kind": "agent", "node": node.name, "rounds": rounds,
                                  "polls": 0}

        def enter(cause: str) -> bool:
            entry: dict[str, Any] = {"cause": cause, "t_start": time.monotonic()}
            entry.update(_next_rendezvous(node))
            rounds.append(entry)
            return "error" not in entry

        going = True
        if start_at is not None:
            _sleep_until(start_at)
            going = enter("start")
        quiet_until: float | None = None
        while going and time.monotonic() < until:
            now = time.monotonic()
            if rounds and rounds[-1].get("world") == target:
                quiet_until = quiet_until or now + settle
                if now >= quiet_until:
                    break
            try:
                result["polls"] += 1
                waiting = node.handler.num_nodes_waiting()
            except Exception as exc:  # reported to the coordinator
                result["watch_error"] = f"{type(exc).__name__}: {exc}"
                break
            if waiting > 0:
                going, quiet_until = enter("signal"), None
            elif fallback_at is not None and not rounds and now >= fallback_at:
                going, quiet_until = enter("fallback"), None
            else:
                time.sleep(interval)
        self._record(result)

    def last_call(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Set the last call of the selected torch handlers to ``seconds``.

        torch keeps it in each handler's settings (the node that sees the
        ``min_nodes``-th join sets the deadline from its own); the k8s handler
        reads it from the run's spec, which the coordinator patches instead.
        """
        changed = 0
        for node in self._selected(msg):
            settings = getattr(node.handler, "_settings", None)
            if node.counter is not None and settings is not None:
                settings.timeout._set_timeouts(
                    last_call=datetime.timedelta(seconds=float(msg["seconds"])))
                changed += 1
        return {"changed": changed}

    def collect(self, msg: dict[str, Any]) -> dict[str, Any]:
        deadline = time.monotonic() + float(msg.get("timeout", COMMAND_BOUND))
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._threads = [t for t in self._threads if t.is_alive()]
        with self._lock:
            results, self._results = self._results, []
        return {"results": results, "pending": len(self._threads),
                "stuck": _stacks(self._threads)}

    def shutdown(self, msg: dict[str, Any]) -> dict[str, Any]:
        nodes = self._selected(msg)
        times = _parallel(nodes, lambda n: n.handler.shutdown())
        if msg.get("forget"):
            for node in nodes:
                self.nodes.pop(node.name, None)
        return {"times": times}

    def teardown(self, _msg: dict[str, Any]) -> dict[str, Any]:
        """Shut every node down and forget it, with whatever its threads still report.

        Nothing of one repetition may leak into the next: results that arrive
        after a failed repetition are dropped here, not handed to the next one.
        """
        times = _parallel(list(self.nodes.values()), _release)
        self.nodes.clear()
        deadline = time.monotonic() + 30
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._threads = [t for t in self._threads if t.is_alive()]
        with self._lock:
            self._results = []
        gc.collect()
        return {"shut_down": len(times), "lingering_threads": len(self._threads)}

    def counters(self, _msg: dict[str, Any]) -> dict[str, Any]:
        total: dict[str, int] = {}
        for node in self.nodes.values():
            if node.counter is not None:
                for key, value in node.counter.snapshot().items():
                    total[key] = total.get(key, 0) + value
        return {"counters": total}


def _release(node: Node) -> None:
    """End a node after a repetition without charging the next one for it.

    k8s: ``shutdown()`` (its run is deleted first, so this is a few cheap
    requests).  torch's handlers: ``shutdown()`` would close the run with a
    compare-and-set storm on the shared state that nobody reads any more (every
    repetition has its own run), so only their keep-alive timer is stopped.
    """
    stop_heartbeats = getattr(node.handler, "_stop_heartbeats", None)
    if node.counter is not None and callable(stop_heartbeats):
        stop_heartbeats()
    else:
        node.handler.shutdown()


def _stacks(busy: list[threading.Thread]) -> dict[str, list[str]]:
    """Where each ``busy`` thread is now, innermost frame last; every thread's stack goes
    to the log.

    A node still busy when its round should have formed is the one failure a
    benchmark cannot explain afterwards: its stack, and those of its handler's
    own threads (watches, keep-alive), taken while it still sits there, say
    which call it waits in.
    """
    if not busy:
        return {}
    frames = sys._current_frames()
    stacks: dict[str, list[str]] = {}
    for thread in threading.enumerate():
        frame = frames.get(thread.ident or -1)
        if frame is None:
            continue
        stacks[thread.name] = [f"{f.filename}:{f.lineno} {f.name}: {(f.line or '').strip()}"
                               for f in traceback.extract_stack(frame)]
        log.warning("%s %s:\n  %s", "busy" if thread in busy else "thread", thread.name,
                    "\n  ".join(stacks[thread.name]))
    return {t.name: stacks[t.name] for t in busy if t.name in stacks}


def _next_rendezvous(node: Node) -> dict[str, Any]:
    try:
        info = node.handler.next_rendezvous()
    except Exception as exc:  # reported to the coordinator
        return {"t_done": time.monotonic(), "error": f"{type(exc).__name__}: {exc}"}
    return {"t_done": time.monotonic(), "rank": info.rank, "world": info.world_size}


def _parallel(nodes: list[Node], action: Any) -> dict[str, float]:
    """Run ``action(node)`` for all nodes at once (bounded); seconds each took."""
    times: dict[str, float] = {}
    lock = threading.Lock()

    def one(node: Node) -> None:
        started = time.monotonic()
        try:
            action(node)
        except Exception:  # a failed shutdown must not stop the others
            log.warning("%s: %s", node.name, traceback.format_exc(limit=3))
        with lock:
            times[node.name] = time.monotonic() - started

    threads = [threading.Thread(target=one, args=(n,), daemon=True) for n in nodes]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + COMMAND_BOUND
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return times


def _news(node: Node) -> Callable[[float], None]:
    """A wait of at most its argument's seconds that ends early when the k8s handler's
    cache changes after now (the cache ``num_nodes_waiting()`` reads); a plain
    sleep for a handler without one (torch's)."""
    watcher = getattr(node.handler, "watcher", None)
    if watcher is None:
        return time.sleep
    seen = watcher.version

    def wait(seconds: float) -> None:
        watcher.wait(seen, seconds)
    return wait


def _sleep_until(moment: float) -> None:
    delay = moment - time.monotonic()
    if delay > 0:
        time.sleep(delay)


def main() -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    worker = Worker()
    commands = {"build": worker.build, "rendezvous": worker.rendezvous, "watch": worker.watch,
                "agent": worker.agent, "last_call": worker.last_call,
                "collect": worker.collect, "shutdown": worker.shutdown,
                "teardown": worker.teardown, "counters": worker.counters}
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["cmd"] == "exit":
            break
        try:
            reply = {"id": msg["id"], "ok": True, **commands[msg["cmd"]](msg)}
        except Exception as exc:  # the coordinator decides what to do
            reply = {"id": msg["id"], "ok": False,
                     "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=5)}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
