"""A status whose round goes backwards is refused: the handler remembers the highest round.

Each copy of such a status is well typed and self-consistent, so the parser
cannot tell; only a reader that remembers can (a status restored from an old
backup, or ``kubectl edit`` of ``status.round``).
"""

from __future__ import annotations

from typing import Any

import pytest
from fakegateway import FakeApiServer, FakeGateway
from torch.distributed.elastic.rendezvous import RendezvousStateError

from elasticrun.api.gateway import RunGateway
from elasticrun.api.kube import Credentials, KubeClient
from elasticrun.api.model import InvalidRunError, parse_run
from elasticrun.api.ordering import RoundMark
from elasticrun.handler.session import RunSession
from elasticrun.handler.settings import from_parameters
from elasticrun.handler.watcher import RunWatcher


def raw(round_: int, rv: int, uid: str = "uid-1") -> dict[str, Any]:
    status: dict[str, Any] = {"round": round_, "signal": round_}
    if round_:
        status |= {"phase": "Running", "store": {"host": "10.0.0.1", "port": 29400},
                   "participants": [{"name": "a", "rank": 0}]}
    return {"metadata": {"name": "r", "namespace": "ns", "resourceVersion": str(rv),
                         "uid": uid}, "spec": {"minNodes": 1}, "status": status}


def watcher() -> RunWatcher:
    return RunWatcher(FakeGateway(FakeApiServer("ns"), "r"))


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


def test_the_mark_is_per_object_and_only_moves_up() -> None:
    mark = RoundMark().advance(parse_run(raw(3, 10)))
    assert (mark.floor("uid-1"), mark.floor("uid-2")) == (3, 0)
    assert mark.advance(parse_run(raw(5, 11))).highest == 5
    assert mark.advance(parse_run(raw(0, 30, uid="uid-2"))) == RoundMark("uid-2", 0)
    with pytest.raises(InvalidRunError, match="resourceVersion 12"):
        mark.advance(parse_run(raw(2, 12)))


def test_handler_maps_it_to_rendezvous_state_error_naming_the_field() -> None:
    settings = from_parameters(run_id="r", endpoint="ns", min_nodes=1, max_nodes=1,
                               local_addr="127.0.0.1", conf={"node_name": "a"})
    offline = KubeClient(Credentials(host="https://192.0.2.1:6443", ca_file=None, cert_file=None,
                                     key_file=None, verify=False, config=None))
    session = RunSession(settings, RunGateway(offline, "ns", "r"))
    session.accept(raw(3, 10))
    with pytest.raises(RendezvousStateError,
                       match=r"node 'a'.*status\.round: went back from 3 to 2"):
        session.accept(raw(2, 11))
