"""The exit-barrier check (elasticrun.handler.exitbarrier) against torch's own barrier."""

from __future__ import annotations

import threading
import time

import pytest

torch_dist = pytest.importorskip("torch.distributed")


def round_store() -> object:
    """A store shaped like the one the handler hands torch: a prefix over a shared store."""
    return torch_dist.PrefixStore("torch.rendezvous.run.1", torch_dist.HashStore())


def test_the_key_is_the_one_torchs_exit_barrier_leaves_once_every_agent_arrived() -> None:
    from torch.distributed.elastic.agent.server import api as agent_api
    from torch.distributed.elastic.utils import store as store_util

    from elasticrun.handler import exitbarrier

    assert exitbarrier.BARRIER_PREFIX == agent_api._TERMINAL_STATE_SYNC_ID
    store = round_store()
    assert not exitbarrier.passed(store)
    # Two agents: the first to arrive alone proves nothing (the other still trains).
    first = threading.Thread(target=store_util.barrier, daemon=True,
                             kwargs={"store": store, "world_size": 2,
                                     "key_prefix": agent_api._TERMINAL_STATE_SYNC_ID,
                                     "barrier_timeout": 30})
    first.start()
    deadline = time.monotonic() + 10
    while not store.check([exitbarrier.BARRIER_PREFIX + "/num_members"]):
        assert time.monotonic() < deadline, "the first agent never arrived"
        time.sleep(0.01)
    assert not exitbarrier.passed(store)
    store_util.barrier(store, 2, agent_api._TERMINAL_STATE_SYNC_ID, barrier_timeout=30)
    first.join(10)
    assert exitbarrier.passed(store)


class Broken(torch_dist.Store):  # type: ignore[misc]
    def check(self, keys: list[str]) -> bool:
        raise RuntimeError("Connection reset by peer")


class Frozen(torch_dist.Store):  # type: ignore[misc]
    def check(self, keys: list[str]) -> bool:
        time.sleep(30)
        return True


def test_a_store_that_fails_or_hangs_is_no_proof_and_no_wait() -> None:
    from elasticrun.handler import exitbarrier

    assert not exitbarrier.passed(Broken())
    started = time.monotonic()
    assert not exitbarrier.passed(Frozen(), timeout=0.2)
    assert time.monotonic() - started < 2
