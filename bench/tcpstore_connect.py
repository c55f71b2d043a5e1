"""How long TCPStore clients take to connect when many connect at once.

    python -m bench.tcpstore_connect --clients 64 --processes 4 [--address IP]

torch formats the peer address of every TCPStore connection with
``getnameinfo()``, a reverse DNS query (pytorch/pytorch#159007).  Where the
resolver drops bursts of queries, some connections wait out glibc's 5 s
timeout; this prints how many.  Run it with ``RES_OPTIONS='timeout:1
attempts:1'`` to see the delay follow the resolver's timeout, or inside a pod
to check a cluster's DNS before a large job.  Nothing here uses elasticrun's
protocol: the server is the same TCPStore a rank-0 node hosts.
"""

from __future__ import annotations

import argparse
import datetime as dt
import multiprocessing as mp
import sys
import threading
import time
from multiprocessing.queues import Queue
from typing import Any

import torch.distributed as dist

from elasticrun.handler.store import StoreHost

#: Bound on one connection; a connection slower than this is reported as failed.
CONNECT_TIMEOUT = 60.0


def _clients(address: str, port: int, count: int, start_at: float,
             results: Queue[list[float]]) -> None:
    """``count`` threads that connect at ``start_at`` (wall clock, shared by all processes)."""
    took: list[float] = []
    lock = threading.Lock()

    def connect() -> None:
        time.sleep(max(0.0, start_at - time.time()))
        started = time.monotonic()
        try:
            store = dist.TCPStore(address, port, is_master=False, use_libuv=True,
                                  timeout=dt.timedelta(seconds=CONNECT_TIMEOUT))
            store.get("ready")
            elapsed = time.monotonic() - started
        except RuntimeError:
            elapsed = float("inf")
        with lock:
            took.append(elapsed)

    threads = [threading.Thread(target=connect) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(CONNECT_TIMEOUT + 10)
    results.put(took)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--address", default="127.0.0.1",
                        help="the address the server binds and clients connect to")
    args = parser.parse_args(argv)
    host = StoreHost(args.address)
    host.store.set("ready", "1")
    results: Queue[list[float]] = mp.Queue()
    start_at = time.time() + 2.0  # every process imported torch and is waiting
    share = [args.clients // args.processes + (i < args.clients % args.processes)
             for i in range(args.processes)]
    procs: list[Any] = [mp.Process(target=_clients,
                                   args=(args.address, host.port, n, start_at, results))
                        for n in share if n]
    for proc in procs:
        proc.start()
    took = sorted(t for _ in procs for t in results.get(timeout=CONNECT_TIMEOUT + 30))
    for proc in procs:
        proc.join(10)
    slow = [t for t in took if t > 1.0]
    print(f"{len(took)} clients connecting at once to {args.address}:{host.port}: "
          f"median {took[len(took) // 2]:.3f} s, max {took[-1]:.3f} s, "
          f"{len(slow)} slower than 1 s" + (f" (from {min(slow):.2f} s)" if slow else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
