"""The benchmark worker's ``watch`` (bench/worker.py): when a node counts as knowing of a
change, beside the floor's clients, which record the event that tells them."""

from __future__ import annotations

import time
from typing import Any

from fakegateway import FakeApiServer, FakeGateway

from elasticrun.handler.watcher import RunWatcher

from bench.worker import Node, Worker
from conftest import wait_for

#: Far longer than the change takes to be noticed below.
INTERVAL = 5.0


class _Handler:
    """A handler whose news comes in its watcher's cache, as the k8s handler's does."""

    def __init__(self, watcher: RunWatcher | None) -> None:
        self.watcher = watcher
        self.waiting = 0
        self.asked = 0

    def num_nodes_waiting(self) -> int:
        self.asked += 1
        return self.waiting


def _watched(handler: Any, change: Any) -> dict[str, Any]:
    worker = Worker()
    node = Node("n", handler, None)
    worker.nodes["n"] = node
    worker.watch({"until": time.monotonic() + 2 * INTERVAL, "interval": INTERVAL})
    # Once the node has asked, a change is news to it: the cache's version it waits
    # past was taken before it asked.
    wait_for(lambda: handler.asked == 1, INTERVAL / 2, "the node's first question",
             interval=0.01)
    changed_at = time.monotonic()
    change()
    results = worker.collect({"timeout": 3 * INTERVAL})["results"]
    assert len(results) == 1
    return {**results[0], "changed_at": changed_at}


def test_a_node_knows_when_its_cache_changes_not_when_a_poll_next_looks() -> None:
    watcher = RunWatcher(FakeGateway(FakeApiServer("ns"), "r"))
    handler = _Handler(watcher)

    def news() -> None:
        handler.waiting = 1
        watcher.poke()

    result = _watched(handler, news)
    assert result["t_seen"] is not None
    assert result["t_seen"] - result["changed_at"] < INTERVAL / 2
    assert result["polls"] == 2


def test_a_handler_without_a_cache_is_asked_every_interval() -> None:
    """The control: torch's handlers have no cache to wait on; the poll sees the change."""
    handler = _Handler(None)
    result = _watched(handler, lambda: setattr(handler, "waiting", 1))
    assert result["t_seen"] is not None
    assert result["t_seen"] - result["changed_at"] > INTERVAL / 2
    assert result["polls"] == 2

