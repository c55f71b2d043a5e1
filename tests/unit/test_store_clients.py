"""A node's client of rank 0's store: short to connect, patient once connected.

The node connects in short attempts so that it never waits on a dead rank 0,
but torch's agent then reads its worker ranks from that client, and rank 0
writes them only once every agent of the round reached the store: the client
must wait for the slowest peer, not for the attempt.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from elasticrun.handler.reach import ATTEMPT_SECONDS
from elasticrun.handler.store import RoundStores, StoreHost, connect

#: Longer than the connection attempt, far shorter than the operation timeout.
LATE = 3 * ATTEMPT_SECONDS


@pytest.fixture
def leader() -> Iterator[StoreHost]:
    host = StoreHost("127.0.0.1")
    yield host
    host.close()


def test_a_client_reached_in_a_short_attempt_waits_for_a_key_rank0_writes_later(
        leader: StoreHost) -> None:
    stores = RoundStores()
    stores.for_round("127.0.0.1")
    try:
        client = stores.store_for(1, "127.0.0.1", leader.port, timeout=ATTEMPT_SECONDS)
        writer = threading.Timer(LATE, leader.store.set, ("torchelastic/assigned_ranks/1",
                                                          "[1, 2, 1, 2]"))
        writer.start()
        started = time.monotonic()
        try:
            assert client.get("torchelastic/assigned_ranks/1") == b"[1, 2, 1, 2]"
        finally:
            writer.join()
        assert time.monotonic() - started >= LATE - 0.1  # it did wait for the late write
    finally:
        stores.close()


def test_a_store_nobody_serves_still_fails_within_the_attempt() -> None:
    with socket.socket() as probe:  # a port that was free a moment ago and is closed now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = time.monotonic()
    with pytest.raises((RuntimeError, OSError)):
        connect("127.0.0.1", port, timeout=ATTEMPT_SECONDS)
    assert time.monotonic() - started < 10 * ATTEMPT_SECONDS
