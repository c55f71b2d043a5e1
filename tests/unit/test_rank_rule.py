"""Which rank each node of a new round gets (``rounds.order_for_ranks``).

Survivors keep their ranks; newcomers are ranked by their Pod's index, then by
the topology values of their Node, then by arrival; an indexed newcomer takes
the rank of its index where that rank is free.  Every case is a row: the
previous round, the waiting nodes, the round's size, and the names in rank
order (spares after the round's size).
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elasticrun.api import rounds
from elasticrun.api.leases import read_join
from elasticrun.api.model import (
    MAX_POD_INDEX,
    ElasticRun,
    Participant,
    RunSpec,
    RunStatus,
    WaitingNode,
)
from elasticrun.handler.settings import pod_index

from builders import T0


@dataclass(frozen=True)
class Node:
    """A waiting node of a row: its name, index and topology; arrival is its place in the row."""

    name: str
    index: int | None = None
    topology: tuple[str, ...] = ()


def arriving(*nodes: Node) -> list[WaitingNode]:
    """The nodes as waiting entries whose Leases were created one second apart, in order."""
    return [WaitingNode(name=n.name, since=T0, arrived=T0 + dt.timedelta(seconds=i),
                        index=n.index, topology=n.topology) for i, n in enumerate(nodes)]


def members(*names: str) -> tuple[Participant, ...]:
    """A previous round whose ranks are the names' places (None: a rank whose member left)."""
    return tuple(Participant(name=n, rank=r) for r, n in enumerate(names))


#: Topology values for the keys (topology.kubernetes.io/zone, kubernetes.io/hostname).
A1 = ("zone-a", "host-1")
A2 = ("zone-a", "host-2")
B3 = ("zone-b", "host-3")

CASES = [
    pytest.param((), arriving(Node("i3", 3), Node("i0", 0), Node("i2", 2), Node("i1", 1)), 4,
                 ["i0", "i1", "i2", "i3"], id="indexes 3,0,2,1 arriving in that order: by index"),
    pytest.param(members("i0", "i1", "i2", "i3"),
                 arriving(Node("i3", 3), Node("new-i2", 2), Node("i0", 0), Node("i1", 1)), 4,
                 ["i0", "i1", "new-i2", "i3"], id="a replacement for index 2 gets rank 2 back"),
    pytest.param(members("i0", "i1", "i2", "i3"),
                 arriving(Node("i0", 0), Node("i3", 3), Node("new-i2", 2)), 3,
                 ["i0", "i3", "new-i2"],
                 id="round of 3: the replacement takes rank 2, the survivor ranked 3 fills rank 1"),
    pytest.param(members("i0", "i1", "i2"),
                 arriving(Node("i1", 1), Node("i2", 2), Node("new-i0", 0)), 3,
                 ["new-i0", "i1", "i2"], id="rank 0 lost: its replacement takes rank 0 back"),
    pytest.param(members("a", "b"), arriving(Node("x", 0), Node("b"), Node("a")), 3,
                 ["a", "b", "x"],
                 id="survivors keep their ranks: an index claiming rank 0 goes to a free one"),
    pytest.param(members("a", "b"), arriving(Node("x", 0), Node("b"), Node("a")), 2,
                 ["a", "b", "x"], id="survivors first: a full round leaves the newcomer spare"),
    pytest.param(members("a", "b", "c", "d"), arriving(Node("d"), Node("a"), Node("n")), 3,
                 ["a", "d", "n"],
                 id="round of 3: the survivor ranked 3 fills rank 1 before the newcomer"),
    pytest.param((), arriving(Node("b1", topology=B3), Node("a1", topology=A2),
                              Node("b2", topology=B3), Node("a2", topology=A1)),
                 4, ["a2", "a1", "b1", "b2"],
                 id="no index: topology groups ranks by zone, then host, then arrival"),
    pytest.param((), arriving(Node("u"), Node("a", topology=A1),
                              Node("b", topology=B3)), 3,
                 ["a", "b", "u"], id="a node whose domain is unknown comes after the known ones"),
    pytest.param((), arriving(Node("u1", topology=A1), Node("i1", 1), Node("u2"),
                              Node("i0", 0), Node("i7", 7)), 5,
                 ["i0", "i1", "i7", "u1", "u2"],
                 id="mixed: indexes at their ranks, an index beyond the size next, then unindexed"),
    pytest.param(members("s0"), arriving(Node("u1"), Node("i2", 2), Node("u2"), Node("s0")), 4,
                 ["s0", "u1", "i2", "u2"], id="mixed: an index at its rank, unindexed around it"),
    pytest.param((), arriving(Node("i2", 2), Node("i1", 1)), 2, ["i1", "i2"],
                 id="no survivor: ranks in index order, compact, whatever index is missing"),
    pytest.param((), arriving(Node("first-1", 1), Node("i0", 0), Node("second-1", 1)), 3,
                 ["i0", "first-1", "second-1"],
                 id="duplicate index: the first to arrive takes it, the other the next free rank"),
    pytest.param((), arriving(Node("b-1", 1, B3), Node("a-1", 1, A1),
                              Node("i0", 0)),
                 3, ["i0", "a-1", "b-1"], id="duplicate index: topology before arrival"),
    pytest.param((), arriving(Node("huge", MAX_POD_INDEX), Node("i1", 1), Node("i0", 0)), 2,
                 ["i0", "i1", "huge"], id="above maxNodes the lowest indexes are admitted"),
]


@pytest.mark.parametrize(("previous", "waiting", "size", "expected"), CASES)
def test_the_rank_order_of_mixed_rounds(previous: tuple[Participant, ...],
                                        waiting: list[WaitingNode], size: int,
                                        expected: list[str]) -> None:
    order = rounds.order_for_ranks(previous, waiting, size)
    assert [w.name for w in order] == expected


def test_sealing_gives_the_ranks_of_the_rule_and_rank_0_hosts_the_store() -> None:
    nodes = [WaitingNode(name=f"i{i}", address=f"10.0.0.{i}", store_port=29400, since=T0,
                         arrived=T0 + dt.timedelta(seconds=k), index=i)
             for k, i in enumerate((3, 0, 2, 1))]
    run = ElasticRun("r", "ns", RunSpec(min_nodes=4, max_nodes=4), RunStatus(waiting=tuple(nodes)),
                     "1")
    status = rounds.seal_round(run, T0)
    assert [(p.name, p.rank) for p in status.participants] == [
        ("i0", 0), ("i1", 1), ("i2", 2), ("i3", 3)]
    assert status.store is not None and status.store.host == "10.0.0.0"


@pytest.mark.parametrize("index", [-1, True, "3", 1.5, MAX_POD_INDEX + 1, None, [2], {"i": 1}])
def test_an_absurd_index_is_no_index_and_the_request_still_joins(index: object) -> None:
    raw = f'{{"since": "2026-01-01T00:00:00Z", "index": {json.dumps(index)}}}'
    join, problem = read_join("n", raw, "lease n")
    assert problem is None and join is not None and join.index is None


def test_an_index_in_range_is_kept_in_the_request_and_the_status() -> None:
    raw = f'{{"since": "2026-01-01T00:00:00Z", "index": {MAX_POD_INDEX}}}'
    join, _ = read_join("n", raw, "lease n")
    assert join is not None and join.index == MAX_POD_INDEX
    assert WaitingNode.from_dict(join.to_dict(), "w").index == MAX_POD_INDEX


def test_topology_values_are_bounded_and_unknown_values_read_as_empty() -> None:
    entry = WaitingNode.from_dict({"name": "n", "topology": ["z" * 500, 7, "b", "c", "d", "e"]},
                                  "w")
    assert entry.topology == ("z" * 63, "", "b", "c")
    assert WaitingNode.from_dict({"name": "n", "topology": "zone-a"}, "w").topology == ()
    assert WaitingNode.from_dict(entry.to_dict(), "w").topology == entry.topology


@pytest.mark.parametrize(("conf", "environ", "expected"), [
    ({}, {"JOB_COMPLETION_INDEX": "3"}, 3),
    ({}, {"JOB_COMPLETION_INDEX": "3", "ELASTICRUN_POD_INDEX": "5"}, 5),
    ({"pod_index": "7"}, {"JOB_COMPLETION_INDEX": "3"}, 7),
    ({}, {"JOB_COMPLETION_INDEX": "-1"}, None),
    ({}, {"JOB_COMPLETION_INDEX": "9" * 30}, None),
    ({}, {"ELASTICRUN_POD_INDEX": ""}, None),
    ({}, {}, None),
])
def test_the_pod_index_comes_from_the_conf_then_the_environment(
        conf: dict[str, str], environ: dict[str, str], expected: int | None) -> None:
    assert pod_index(conf, environ) == expected


@given(st.lists(st.tuples(st.none() | st.integers(-2, 12), st.sampled_from(((), ("a",), ("b",)))),
                max_size=12),
       st.lists(st.booleans(), max_size=12), st.integers(0, 14))
def test_ranks_are_always_0_to_size_and_survivors_keep_ranks_that_exist(
        newcomers: list[tuple[int | None, tuple[str, ...]]], survived: list[bool],
        size: int) -> None:
    previous = members(*(f"m{r}" for r in range(len(survived))))
    back = [Node(f"m{r}") for r, ok in enumerate(survived) if ok]
    fresh = [Node(f"n{k}", i if i is None or i >= 0 else None, t)
             for k, (i, t) in enumerate(newcomers)]
    waiting = arriving(*fresh, *back)
    order = rounds.order_for_ranks(previous, waiting, size)
    assert sorted(w.name for w in order) == sorted(w.name for w in waiting)
    admitted = order[:size]
    slots = len(admitted)
    assert slots == min(size, len(waiting))
    rank = {w.name: r for r, w in enumerate(admitted)}
    survivors = [n.name for n in back]
    # Survivors are admitted before any newcomer, and keep every rank that still exists.
    assert set(survivors[:slots]) <= set(rank)
    for name in survivors:
        old = int(name[1:])
        if name in rank and old < slots:
            assert rank[name] == old


def test_a_join_request_carries_no_topology_and_a_sealer_takes_the_operators_values() -> None:
    raw = '{"since": "2026-01-01T00:00:00Z", "podUID": "u-b", "topology": ["zone-z"]}'
    join, _ = read_join("b", raw, "lease b")
    assert join is not None and join.topology == ()  # a Pod cannot know its Node's labels
    listed = [*arriving(Node("a")), join]
    stored = (WaitingNode(name="b", pod_uid="u-b", topology=A1),
              WaitingNode(name="a", pod_uid="another-pod", topology=B3))
    run = ElasticRun("r", "ns", RunSpec(min_nodes=2, max_nodes=2), RunStatus(waiting=stored), "1")
    merged = {w.name: w.topology for w in rounds.eligible_waiting(run, listed)}
    assert merged == {"a": (), "b": A1}  # a's stored entry is of another Pod: nothing taken
    status = rounds.seal_round(run, T0, listed)
    assert [p.name for p in status.participants] == ["b", "a"]  # b's known domain first
