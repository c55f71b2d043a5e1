"""The scale benchmark's reading of its members: who knew when, removals, places in a round."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from elasticrun.api import slices
from elasticrun.api.kube import Credentials
from elasticrun.api.leases import JOIN_ANNOTATION, UNREACHABLE_ANNOTATION, read_join
from elasticrun.api.model import Assignment, LostMember, StoreAddress, WaitingNode
from elasticrun.api.naming import lease_name

from bench import simnode
from bench.membership import monotonic_of, removal, until_all
from bench.simnode import Connection, Shared, SimNode, join_patch, placed_in
from builders import T0, at, running_run


def test_until_all_is_the_last_of_the_set_to_report() -> None:
    times = {"a": 10.5, "b": 12.0, "c": 11.0, "other": 99.0}
    assert until_all(times, {"a", "b", "c"}, since=10.0) == 2.0  # "other" is not asked


def test_until_all_is_none_while_one_of_the_set_has_not_reported() -> None:
    assert until_all({"a": 10.5}, {"a", "b"}, since=10.0) is None
    assert until_all({"a": 10.5}, set(), since=10.0) is None


def test_removal_is_the_nodes_last_record() -> None:
    lost = (LostMember("b", 1, "Left", time=at(1)), LostMember("c", 1, "LeaseExpired", time=at(2)),
            LostMember("b", 2, "LeaseExpired", time=at(3)))
    run = running_run(lost_members=lost)
    found = removal(run, "b")
    assert found is not None and (found.round, found.reason, found.time) == (
        2, "LeaseExpired", at(3))
    assert removal(run, "a") is None


def test_a_wall_time_is_put_on_the_monotonic_clock_by_one_reading_of_both() -> None:
    wall_now = T0.timestamp() + 10.0
    assert monotonic_of(at(7.5), wall_now, monotonic_now=500.0) == 497.5


def _status(round_: int, *names: str) -> dict[str, Any]:
    run = running_run()
    participants = tuple(dataclasses.replace(run.status.participants[0], name=n, rank=i)
                         for i, n in enumerate(names))
    return {"status": run.status.replace(round=round_, participants=participants).to_dict()}


def test_a_node_is_placed_by_a_round_after_the_one_it_held_that_holds_it() -> None:
    # With the round's rank 0, whose Lease the node reads before it holds the round.
    assert placed_in(_status(2, "a", "b", "new"), "new", held=1) == {
        "rank": 2, "world": 3, "round": 2, "leader": "a"}
    assert placed_in(_status(1, "b", "a"), "b", held=0) == {
        "rank": 0, "world": 2, "round": 1, "leader": "b"}


def test_the_round_it_held_or_one_without_it_places_nobody() -> None:
    assert placed_in(_status(1, "a", "b"), "b", held=1) is None  # its old round
    assert placed_in(_status(2, "a", "b"), "c", held=1) is None  # not admitted
    assert placed_in({}, "a", held=0) is None  # no round yet


RUN, NAMESPACE, UID, NODE = "run", "ns", "0b6f3c1e-5d2a-4c8e-9f10-3a7b2c4d5e6f", "node-0042"
SINCE = at(5)


class _NoAuth:
    def auth_settings(self) -> dict[str, Any]:
        return {}


def _node() -> SimNode:
    shared = Shared("127.0.0.1", 6443, None, Credentials("https://127.0.0.1:6443", None, None,
                                                         None, True, _NoAuth()), NAMESPACE, RUN)
    node = SimNode(shared, NODE, 29500)
    node.run_uid = UID
    return node


def _slice(place: Assignment, run: str = RUN, node: str = NODE) -> dict[str, Any]:
    """The node's slice as the operator writes it, holding ``place``."""
    [piece] = slices.due({node: place}, frozenset())
    return piece.manifest(run, NAMESPACE, UID)


def _place(since: Any = SINCE, round_: int = 3) -> Assignment:
    return Assignment(round=round_, rank=5, world_size=8,
                      store=StoreAddress("10.0.0.7", 29500), leader="node-0001", since=since)


def _told(events: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
          ) -> tuple[dict[str, Any], list[tuple[Connection, str, dict[str, Any]]]]:
    """What ``SimNode._from_slice`` takes from a watch that sends ``events``, and the watches
    it opened (connection, path, query)."""
    opened: list[tuple[Connection, str, dict[str, Any]]] = []

    async def lines(connection: Connection, path: str, query: dict[str, Any],
                    accept: str = "") -> AsyncIterator[bytes]:
        opened.append((connection, path, query))
        for event in events:
            yield json.dumps(event).encode()

    monkeypatch.setattr(simnode, "watch_lines", lines)
    node = _node()
    told = asyncio.run(node._from_slice(WaitingNode(name=NODE, since=SINCE)))
    assert [c for c, _, _ in opened] == [node.mailbox]
    return told, opened


def test_a_node_watches_its_own_slice_by_name_from_how_it_is_now(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _, opened = _told([{"type": "ADDED", "object": _slice(_place())}], monkeypatch)
    [(_, path, query)] = opened
    assert path == f"/apis/elasticrun.dev/v1alpha1/namespaces/{NAMESPACE}/elasticrunslices"
    index = slices.slice_index(NODE)
    assert query == {"fieldSelector": f"metadata.name={UID}-{index:02d}"}


def test_a_node_takes_the_place_its_slice_tells_for_its_request(
        monkeypatch: pytest.MonkeyPatch) -> None:
    told, _ = _told([{"type": "MODIFIED", "object": _slice(_place())}], monkeypatch)
    assert {k: v for k, v in told.items() if k != "t_done"} == {
        "rank": 5, "world": 8, "round": 3, "leader": "node-0001", "vouched": True}


@pytest.mark.parametrize("event", [
    {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "4712"}}},
    {"type": "MODIFIED", "object": _slice(_place(), run="other")},  # another run's
    {"type": "MODIFIED", "object": _slice(dataclasses.replace(_place(), world_size=5))},  # no rank
    {"type": "MODIFIED", "object": _slice(_place(since=at(1), round_=2))},  # its last request's
    {"type": "MODIFIED", "object": _slice(_place(), node="node-0043")},  # another node's place
    {"type": "DELETED", "object": _slice(_place())},
], ids=["bookmark", "other-run", "other-round", "other-since", "other-node", "deleted"])
def test_a_slice_event_that_does_not_answer_the_request_is_not_its_place(
        event: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConnectionError, match="slice watch ended"):
        _told([event], monkeypatch)
    told, _ = _told([event, {"type": "MODIFIED", "object": _slice(_place())}], monkeypatch)
    assert (told["round"], told["rank"]) == (3, 5)  # the next event that answers it


def test_the_join_patch_asks_again_and_withdraws_only_an_unreachable_report() -> None:
    join = WaitingNode(name=NODE, address="127.0.0.1", store_port=29500, since=SINCE)
    annotations = join_patch(join)["metadata"]["annotations"]
    assert set(annotations) == {JOIN_ANNOTATION, UNREACHABLE_ANNOTATION}
    assert annotations[UNREACHABLE_ANNOTATION] is None
    assert read_join(NODE, annotations[JOIN_ANNOTATION], "test") == (join, None)


@pytest.mark.parametrize(("place", "reads"), [
    ({"rank": 5, "leader": "node-0001", "vouched": True}, 0),  # told in its slice
    ({"rank": 5, "leader": "node-0001"}, 1),  # told in the status: it checks, as handlers do
    ({"rank": 0, "leader": NODE}, 0),  # rank 0 serves the store
])
def test_a_node_reads_its_rank_0s_lease_only_where_a_handler_would(
        place: dict[str, Any], reads: int) -> None:
    read: list[tuple[str, str]] = []

    class Requests:
        async def request(self, method: str, path: str) -> None:
            read.append((method, path))

    node = _node()
    node.requests = Requests()  # type: ignore[assignment]
    asyncio.run(node.check_store(place))
    assert len(read) == reads and "t_done" in place
    assert all(path.endswith(f"/leases/{lease_name(RUN, 'node-0001')}") for _, path in read)
