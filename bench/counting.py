"""Client-side request counters for torch's backends.

The API server has an audit log, so ``k8s`` is counted on the server.  torch's
``c10d`` store and the etcd v2 server have nothing like it, so their requests
are counted where the client makes them.  Both wrappers sit *below* torch's
rendezvous code and above the wire, so every call torch makes is seen and
nothing is counted that torch did not ask for:

* ``c10d``: a proxy around the ``TCPStore`` client that ``C10dRendezvousBackend``
  calls (``get``, ``compare_set``).  A ``compare_set`` whose answer is not the
  value we tried to write lost the race, exactly the test torch itself makes.
  The two bootstrap keys rank 0 publishes (master address and port) go through
  the unwrapped store and are *not* counted (2 ops per node per round).
* ``etcd-v2``: a proxy around python-etcd's urllib3 pool, so every HTTP request
  (rendezvous state and the ``EtcdStore`` bootstrap keys) is counted; a 412
  answer is a failed compare-and-swap (``prevIndex`` or ``prevExist`` lost).
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any


class OpCounter:
    """Thread-safe named counters; one per node, summed by the worker."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._counts[name] += amount

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class CountingStore:
    """Delegates every attribute to a c10d store; counts the methods called."""

    def __init__(self, store: Any, counter: OpCounter) -> None:
        self._store = store
        self._counter = counter

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._store, name)
        if not callable(target):
            return target
        counter = self._counter

        def call(*args: Any, **kwargs: Any) -> Any:
            counter.add("ops")
            counter.add(f"op:{name}")
            result = target(*args, **kwargs)
            if name == "compare_set" and len(args) >= 3:
                desired = args[2].encode() if isinstance(args[2], str) else bytes(args[2])
                if result != desired:
                    counter.add("lost_cas")
            return result

        return call


class CountingPool:
    """Delegates to a urllib3 pool; counts HTTP requests by method and 412 answers."""

    _METHODS = ("request", "request_encode_body", "request_encode_url", "urlopen")

    def __init__(self, pool: Any, counter: OpCounter) -> None:
        self._pool = pool
        self._counter = counter

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._pool, name)
        if name not in self._METHODS:
            return target
        counter = self._counter

        def call(method: str, *args: Any, **kwargs: Any) -> Any:
            counter.add("ops")
            counter.add(f"http:{method}")
            response = target(method, *args, **kwargs)
            if getattr(response, "status", 0) == 412:
                counter.add("lost_cas")
            return response

        return call
