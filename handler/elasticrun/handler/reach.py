"""Reaching the round's TCPStore without ever waiting on a dead rank 0.

Connecting to rank 0's store is the one place where ``next_rendezvous()``
waits on a peer instead of the run.  torch's TCPStore client would wait out
its whole timeout for a leader that died right after the round was sealed, so
the node tries in short attempts and, between them, looks at its watch: as
soon as the round is superseded (the operator removed the dead leader, a newer
round was sealed, the run was closed) it gives up and joins the next round.
The wait is bounded by the run's heartbeat timeout: by then a dead leader's
Lease has expired, and without an operator the node removes the leader itself
(the same compare-and-set the operator would write).  A leader whose Lease is
still renewed but whose store does not answer is a network problem, reported
as such.
"""

from __future__ import annotations

import logging
import time

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from elasticrun.api import rounds
from elasticrun.api.leases import lease_state
from elasticrun.api.model import ElasticRun, now
from elasticrun.handler import step
from elasticrun.handler.session import RunSession
from elasticrun.handler.store import RoundStores

log = logging.getLogger(__name__)

#: One connection attempt to rank 0's store; the run is looked at between attempts.
ATTEMPT_SECONDS = 1.0
#: Reason recorded when a node removes a leader whose store and Lease both went silent.
LEADER_LOST = "LeaseExpired"


def reach_store(session: RunSession, stores: RoundStores, run: ElasticRun,
                rank: int) -> dist.Store | None:
    """The round's store, or None when the round was superseded before it answered."""
    status = run.status
    assert status.store is not None
    host, port = status.store.host, status.store.port
    node = session.settings.node_name
    leader = next(p.name for p in status.participants if p.rank == 0)
    started = time.monotonic()
    deadline = started + run.spec.heartbeat_timeout
    attempts, error = 0, ""
    while True:
        attempt = min(ATTEMPT_SECONDS, max(0.1, deadline - time.monotonic()))
        try:
            return stores.store_for(rank, host, port, timeout=attempt)
        except (RuntimeError, OSError) as exc:
            attempts += 1
            error = (str(exc).splitlines() or [repr(exc)])[0]
        session.check_watch()
        latest = session.watcher.latest or run
        why = step.superseded(latest, status.round, node, leader)
        if why is not None:
            log.info("%s: round %d ended before its store at %s:%d answered (%s); joining "
                     "the next round", session.who, status.round, host, port, why)
            return None
        if time.monotonic() < deadline:
            continue
        silent_for = time.monotonic() - started
        remaining = _leader_lease_remaining(session, latest, leader)
        if remaining is None:
            _remove_leader(session, latest, leader, host, port, silent_for)
            return None
        if remaining > 0 and silent_for < 2 * run.spec.heartbeat_timeout:
            deadline = time.monotonic() + remaining  # the Lease may yet run out
            continue
        raise RendezvousConnectionError(
            f"{session.who}: cannot reach rank 0's TCPStore ({leader}) at {host}:{port} for "
            f"round {status.round}: {attempts} attempts over {silent_for:.1f}s (the run's "
            f"heartbeatTimeoutSeconds is {run.spec.heartbeat_timeout}), last error: {error}. "
            f"{leader} still renews its Lease, so it is alive: check that pods can reach each "
            "other on that port (NetworkPolicy, firewall)")


def _leader_lease_remaining(session: RunSession, run: ElasticRun, leader: str) -> float | None:
    """Seconds until the leader's Lease expires by the run's heartbeat; None if it has."""
    listed = session.call("list the run's Leases", session.gateway.leases)
    heartbeat = run.spec.heartbeat_timeout
    for item in listed:
        state = lease_state(item)
        if state.node != leader or state.owner_uid != run.uid:
            continue
        expiry = state.expired_at(heartbeat)
        if expiry is None:
            return None
        remaining = (expiry - now()).total_seconds()
        return remaining if remaining > 0 else None
    return None


def _remove_leader(session: RunSession, run: ElasticRun, leader: str, host: str, port: int,
                   silent_for: float) -> None:
    """Take a leader that stopped answering and renewing out of the round (no operator).

    Whether this write or someone else's wins, the round is over: the caller
    joins the next one.
    """
    status = rounds.remove_member(
        run.status, leader, LEADER_LOST, now(),
        message=f"its TCPStore at {host}:{port} did not answer for {silent_for:.1f}s and its "
                f"Lease was not renewed for {run.spec.heartbeat_timeout}s",
        detection_seconds=silent_for)
    if status is not None and session.replace_status(run, status) is not None:
        log.warning("%s: removed rank 0 (%s) from round %d: its store and its Lease went "
                    "silent", session.who, leader, run.status.round)


