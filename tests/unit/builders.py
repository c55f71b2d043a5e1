"""Builders the unit tests share: runs, statuses, a node's knowledge, Leases, a client.

One home for each, so a test of the operator and a test of a node build the
same run the same way; a test module imports them from here, never from
another test module.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any

from elasticrun.api import rounds
from elasticrun.api.kube import Credentials, KubeClient
from elasticrun.api.leases import LeaseState
from elasticrun.api.model import (
    ElasticRun,
    Participant,
    RunSpec,
    RunStatus,
    StoreAddress,
    WaitingNode,
)
from elasticrun.handler.step import Knowledge

#: The time every test starts at.
T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
#: When the node under test (``defers``) asked to join.
OWN_SINCE = dt.datetime(2026, 1, 1, 0, 0, 5, tzinfo=dt.UTC)
CLOCK = 1000.0  # monotonic seconds at the start of next_rendezvous
JOIN_TIMEOUT = 60.0


def at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


# --------------------------------------------------------------------------- runs


def waiting(*names: str, since: float = 0.0) -> tuple[WaitingNode, ...]:
    return tuple(WaitingNode(name=n, address=f"10.0.0.{i}", store_port=29400 + i,
                             since=at(since + i)) for i, n in enumerate(names))


def run(status: RunStatus, min_nodes: int = 2, max_nodes: int = 4, last_call: int = 30,
        closed: bool = False, annotations: dict[str, str] | None = None) -> ElasticRun:
    spec = RunSpec(min_nodes=min_nodes, max_nodes=max_nodes, last_call_timeout=last_call,
                   closed=closed)
    return ElasticRun("r", "ns", spec, status, "1", annotations=annotations or {})


def sealed(*names: str, round_: int = 1) -> RunStatus:
    return RunStatus(phase="Running", round=round_, signal=round_, participants=tuple(
        Participant(name=n, rank=i, address=f"10.0.0.{i}", store_port=29400 + i)
        for i, n in enumerate(names)))


def running_run(spec: RunSpec | None = None, **status: Any) -> ElasticRun:
    """Round 1 of members a, b, c (each on the pod of its name), as the operator reads it."""
    participants = tuple(Participant(name=n, rank=i, address="10.0.0.1", store_port=1 + i,
                                     pod=n) for i, n in enumerate(("a", "b", "c")))
    base = RunStatus(phase="Running", round=1, signal=1, participants=participants,
                     store=StoreAddress("10.0.0.1", 1), sealed_at=T0)
    return ElasticRun("r", "ns", spec or RunSpec(min_nodes=2, max_nodes=3),
                      base.replace(**status), "7", generation=3)


# --------------------------------------------------------------------------- a node's view


def knows(status: RunStatus, node: str = "a", pending: tuple[WaitingNode, ...] = (),
          previous_round: int = 0, joined: bool = True, listed: bool = True,
          **spec: int) -> Knowledge:
    return Knowledge(node=node, run=run(status, **spec), previous_round=previous_round,
                     join_deadline=CLOCK + JOIN_TIMEOUT, pending=pending, joined=joined,
                     listed=listed)


def defers(status: RunStatus, node: str = "a", wait: float = 10.0, **spec: int) -> Knowledge:
    """A node of a large run that joined and leaves sealing to the operator for ``wait`` s."""
    own = WaitingNode(name=node, address="10.0.0.9", store_port=29400, since=OWN_SINCE)
    return knows(status, node, listed=False, **spec).replace(defer_until=CLOCK + wait, own=own)


# --------------------------------------------------------------------------- the operator's view


def joined_leases(names: list[str], at: dt.datetime) -> dict[str, LeaseState]:
    """The Leases of nodes that asked to join at ``at``, as the operator's index holds them."""
    join = {n: WaitingNode(name=n, address="10.0.0.1", store_port=29400, since=at)
            for n in names}
    return {n: LeaseState(node=n, holder=n, renewed=at, duration=10, join=join[n],
                          owner_uid="uid", seen=at) for n in names}


def idle_client() -> KubeClient:
    """A client that never connects: for a Controller whose I/O a test does not reach."""
    return KubeClient(Credentials(host="https://127.0.0.1:1", ca_file=None, cert_file=None,
                                  key_file=None, verify=False, config=None),
                      timeout=1.0, user_agent="ua")


def large_spec() -> RunSpec:
    """A run whose operator tells members in slices (the largest runs), formed by
    one node."""
    return RunSpec(min_nodes=1, max_nodes=rounds.TELL_IN_SLICES_FROM, join_timeout=60,
                   last_call_timeout=1, heartbeat_timeout=30, lease_renew_interval=10)


def quiet_spec() -> RunSpec:
    """A run whose members watch their rounds quietly and learn their places from the
    seal's broadcast (maxNodes 256), asking again when disturbed: its heartbeat spans
    two renewals, so no place is kept (``rounds.members_keep_places``)."""
    quiet = dataclasses.replace(large_spec(), max_nodes=rounds.QUIET_WATCH_FROM,
                                heartbeat_timeout=20)
    assert rounds.members_watch_quietly(quiet) and not rounds.members_told_in_slices(quiet)
    assert not rounds.members_keep_places(quiet)
    return quiet
