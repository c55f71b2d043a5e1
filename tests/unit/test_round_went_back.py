"""A status whose round goes backwards is refused: the handler remembers the highest round.

Each copy of such a status is well typed and self-consistent, so the parser
cannot tell; only a reader that remembers can (a status restored from an old
backup, or ``kubectl edit`` of ``status.round``).
"""

from __future__ import annotations

from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousStateError

from elasticrun.api.model import InvalidRunError, RunSpec
from elasticrun.handler.handler import K8sRendezvousHandler
from elasticrun.handler.settings import RendezvousSettings
from elasticrun.handler.watcher import RunWatcher


def raw(round_: int, rv: int, uid: str = "uid-1") -> dict[str, Any]:
    status: dict[str, Any] = {"round": round_, "signal": round_}
    if round_:
        status |= {"phase": "Running", "store": {"host": "10.0.0.1", "port": 29400},
                   "participants": [{"name": "a", "rank": 0}]}
    return {"metadata": {"name": "r", "namespace": "ns", "resourceVersion": str(rv),
                         "uid": uid}, "spec": {"minNodes": 1}, "status": status}


def watcher() -> RunWatcher:
    return RunWatcher(client=None, namespace="ns", name="r")  # type: ignore[arg-type]


def test_round_going_back_is_refused_and_kept_for_waiters() -> None:
    w = watcher()
    assert w.offer(raw(3, 10)).status.round == 3
    with pytest.raises(InvalidRunError, match=r"went back from 3 to 1") as info:
        w.offer(raw(1, 11))
    assert info.value.field == "status.round"
    with pytest.raises(InvalidRunError):
        w.check()  # a node waiting on the watch learns it too
    assert w.latest is not None and w.latest.status.round == 3  # the bad copy is not cached


def test_forward_and_stale_copies_are_fine() -> None:
    w = watcher()
    w.offer(raw(2, 10))
    assert w.offer(raw(1, 9)).status.round == 2  # an older read: ignored, not an error
    assert w.offer(raw(5, 12)).status.round == 5
    w.check()


def test_a_recreated_run_starts_again_from_round_0() -> None:
    w = watcher()
    w.offer(raw(4, 10))
    assert w.offer(raw(0, 20, uid="uid-2")).status.round == 0
    assert w.offer(raw(1, 22, uid="uid-2")).status.round == 1
    with pytest.raises(InvalidRunError, match="went back from 1 to 0"):
        w.offer(raw(0, 23, uid="uid-2"))


def test_handler_maps_it_to_rendezvous_state_error_naming_the_field() -> None:
    settings = RendezvousSettings(run_name="r", namespace="ns", node_name="a",
                                  address="127.0.0.1", pod=None, requested_spec=RunSpec())
    handler = K8sRendezvousHandler(settings)
    handler._watcher = watcher()
    handler._accept(raw(3, 10))
    with pytest.raises(RendezvousStateError,
                       match=r"node 'a'.*status\.round: went back from 3 to 2"):
        handler._accept(raw(2, 11))
