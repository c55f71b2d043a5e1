"""A round's store is trusted only when its rank 0 announced it on its own genuine Lease."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from elasticrun.api import crd
from elasticrun.api.leases import JOIN_ANNOTATION, join_value
from elasticrun.api.model import StoreAddress, WaitingNode
from elasticrun.api.naming import label_value, lease_name
from elasticrun.api.stores import announced_store, announces, store_problem
from elasticrun.handler.store import StoreAddressError, bind_address

SINCE = dt.datetime(2026, 1, 1, 0, 0, 5, tzinfo=dt.UTC)
HONEST = StoreAddress("10.0.0.1", 29400)


def lease(run: str = "r", node: str = "a", uid: str = "uid-r", address: str = "10.0.0.1",
          port: int | None = 29400, since: dt.datetime = SINCE, next_port: int | None = None,
          **meta: Any) -> dict[str, Any]:
    join = WaitingNode(name=node, address=address, store_port=port, since=since,
                       next_store_port=next_port)
    metadata: dict[str, Any] = {
        "name": lease_name(run, node), "labels": {crd.RUN_LABEL: label_value(run)},
        "annotations": {crd.RUN_LABEL: run, crd.NODE_ANNOTATION: node,
                        JOIN_ANNOTATION: join_value(join)},
        "ownerReferences": [{"kind": crd.KIND, "name": run, "uid": uid}]}
    metadata.update(meta)
    return {"metadata": metadata, "spec": {"holderIdentity": f"{node}@1"}}


def test_the_store_rank0_announced_is_trusted() -> None:
    assert announced_store(lease(), "r", "uid-r", "a") == (HONEST, None)
    assert store_problem(HONEST, lease(), "r", "uid-r", "a", SINCE) is None
    assert store_problem(HONEST, lease(), "r", "uid-r", "a", None) is None


def test_the_next_rounds_store_rank0_announced_on_its_request_is_trusted_too() -> None:
    """A round that keeps rank 0's place meets at the store rank 0 announced for it, on
    the very request the round answers again; any other port is still refused."""
    following = StoreAddress("10.0.0.1", 29500)
    announcing = lease(next_port=29500)
    assert store_problem(following, announcing, "r", "uid-r", "a", SINCE) is None
    assert store_problem(HONEST, announcing, "r", "uid-r", "a", SINCE) is None
    assert store_problem(following, lease(), "r", "uid-r", "a", SINCE) == (
        "the round names store 10.0.0.1:29500, but rank 0 (a) announced 10.0.0.1:29400")
    assert store_problem(StoreAddress("10.0.0.9", 29500), announcing, "r", "uid-r", "a",
                         SINCE) is not None, "the next store is on rank 0's own address"
    later = dt.datetime(2026, 1, 1, 0, 1, tzinfo=dt.UTC)
    assert store_problem(following, announcing, "r", "uid-r", "a", later) is not None


def test_a_store_rank0_did_not_announce_is_refused_naming_both() -> None:
    forged = StoreAddress("127.0.0.1", 4444)
    problem = store_problem(forged, lease(), "r", "uid-r", "a", SINCE)
    assert problem == ("the round names store 127.0.0.1:4444, but rank 0 (a) announced "
                       "10.0.0.1:29400")


@pytest.mark.parametrize(("item", "why"), [
    (None, "rank 0 (a) has no Lease"),
    (lease(uid="uid-other"), "not owned by this run"),
    (lease(run="other"), "does not belong to run r"),
    (lease(node="b"), "does not belong to run r and node a"),
    (lease(port=None), "announces no store"),
    (lease(annotations={crd.RUN_LABEL: "r", crd.NODE_ANNOTATION: "a"}),
     "carries no readable join request"),
    (lease(since=SINCE + dt.timedelta(seconds=1)), "not the one this round answered"),
])
def test_only_rank0s_genuine_lease_and_the_request_this_round_answered_count(
        item: dict[str, Any] | None, why: str) -> None:
    problem = store_problem(HONEST, item, "r", "uid-r", "a", SINCE)
    assert problem is not None and why in problem, problem
    assert problem.startswith("the round names store 10.0.0.1:29400, but ")


def test_a_run_without_uid_trusts_no_store() -> None:
    assert store_problem(HONEST, lease(), "r", None, "a") is not None


def test_an_address_that_does_not_resolve_is_refused_not_bound_to_every_interface() -> None:
    assert bind_address("127.0.0.2") == "127.0.0.2"
    with pytest.raises(StoreAddressError) as info:
        bind_address("no-such-host.invalid")
    message = str(info.value)
    assert "'no-such-host.invalid' does not resolve" in message
    assert "never on all interfaces" in message
    assert "--rdzv-conf address=" in message and "POD_IP" in message


def test_a_request_announces_its_store_and_the_next_rounds_nothing_else() -> None:
    """The one rule the members' check and the operator's (before it tells slices) share."""
    join = WaitingNode(name="a", address="10.0.0.1", store_port=29400, since=SINCE,
                       next_store_port=29401)
    assert announces(join, HONEST) and announces(join, StoreAddress("10.0.0.1", 29401))
    assert not announces(join, StoreAddress("10.0.0.1", 29402))
    assert not announces(join, StoreAddress("10.6.6.6", 29400))
    assert not announces(join, None)
    assert not announces(WaitingNode(name="a", store_port=29400, since=SINCE), HONEST)
