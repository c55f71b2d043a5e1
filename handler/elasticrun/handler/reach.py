"""Reaching the round's TCPStore without ever waiting on a dead rank 0.

Connecting to rank 0's store is the one place where ``next_rendezvous()``
waits on a peer instead of the run.  torch's TCPStore client would wait out
its whole timeout for a leader that died right after the round was sealed, so
the node tries in short attempts and, between them, looks at its watch: as
soon as the round is superseded (the leader removed, a newer round sealed, the
run closed) it gives up and joins the next round.

A store that does not answer while rank 0's Lease has missed a renewal (one
GET of that Lease tells) is evidence that rank 0 is gone, and the node passes
it on at once: it reports the leader on its own Lease
(:data:`~elasticrun.api.leases.UNREACHABLE_ANNOTATION`), where the operator
sees it and looks at the leader's Lease again the moment it could count as
lost, instead of when its heartbeat runs out.  The evidence alone removes
nobody: a leader is taken out of the round once its Lease has been quiet for
the suspicion window
(:func:`~elasticrun.api.leases.suspicion_window`, two renewals), by the
operator or, the same compare-and-set, by the node itself when no operator
did it first.  A leader that keeps renewing but whose store does not answer
is a network problem, reported as such after twice the heartbeat timeout.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from elasticrun.api import rounds
from elasticrun.api.change import ChangePolicy, change_status
from elasticrun.api.leases import lease_state, suspicion_window
from elasticrun.api.model import Assignment, ElasticRun, RunStatus, now
from elasticrun.handler import step
from elasticrun.handler.session import RunSession
from elasticrun.handler.store import RoundStores

log = logging.getLogger(__name__)

#: One connection attempt to rank 0's store; the run is looked at between attempts,
#: so this bounds how long a node keeps trying a round that was already replaced.
ATTEMPT_SECONDS = 0.5
#: Rank 0's Lease is read at most this often while its store does not answer.
MIN_LOOK = 0.1
#: The report of an unreachable leader may hold up the next attempt at most this long.
REPORT_TIMEOUT = 2.0

#: Tells the operator that this node could not reach ``leader``'s store in round ``round``.
Report = Callable[[str, int], None]


def reach_store(session: RunSession, stores: RoundStores, run: ElasticRun,
                assignment: Assignment, report: Report) -> dist.Store | None:
    """The round's store, or None when the round was superseded before it answered.

    ``run`` is the newest copy the node holds, which may predate the round when
    the node was told of it in its slice.
    """
    spec, round_number, rank = run.spec, assignment.round, assignment.rank
    assert assignment.store is not None
    host, port = assignment.store.host, assignment.store.port
    node = session.settings.node_name
    leader = assignment.leader
    why = step.superseded(run, round_number, node, leader)
    if why is not None or leader is None:
        log.info("%s: round %d ended before this node reached its store (%s); joining the "
                 "next round", session.who, round_number, why)
        return None
    window = suspicion_window(spec.heartbeat_timeout, spec.lease_renew_interval)
    started = time.monotonic()
    look_at, give_up_at = started, started + 2 * spec.heartbeat_timeout
    attempts, error, reported = 0, "", False
    while True:
        try:
            return stores.store_for(rank, host, port, timeout=ATTEMPT_SECONDS)
        except (RuntimeError, OSError) as exc:
            attempts += 1
            error = (str(exc).splitlines() or [repr(exc)])[0]
        session.check_watch()
        latest = session.newest(run, round_number)
        why = step.superseded(latest, round_number, node, leader)
        if why is not None:
            log.info("%s: round %d ended before its store at %s:%d answered (%s); joining "
                     "the next round", session.who, round_number, host, port, why)
            return None
        if time.monotonic() < look_at:
            continue
        quiet = _quiet_for(session, latest, leader)
        if quiet >= window:
            _remove_leader(session, latest, round_number, leader, host, port,
                           time.monotonic() - started, window)
            return None
        if quiet >= spec.lease_renew_interval and not reported:
            report(leader, round_number)  # a renewal missed, and its store silent
            reported = True
        if time.monotonic() >= give_up_at:
            raise RendezvousConnectionError(
                f"{session.who}: cannot reach rank 0's TCPStore ({leader}) at {host}:{port} "
                f"for round {round_number}: {attempts} attempts over "
                f"{time.monotonic() - started:.1f}s (twice the run's heartbeatTimeoutSeconds "
                f"of {spec.heartbeat_timeout}), last error: {error}. {leader} still renews its "
                "Lease, so it is alive: check that pods can reach each other on that port "
                "(NetworkPolicy, firewall)")
        look_at = time.monotonic() + max(MIN_LOOK, min(window - quiet, spec.lease_renew_interval))


def _quiet_for(session: RunSession, run: ElasticRun, leader: str) -> float:
    """Seconds since this node saw the leader's Lease renewed (one GET); infinite without one.

    Timed by this node's clock across the session's reads (the leader's own
    ``renewTime`` is the leader's clock): a Lease first read now counts as
    renewed now.  A Lease that is not this run's (another owner) counts as none.
    """
    item = session.call("read rank 0's Lease", lambda: session.gateway.lease(leader))
    state = session.observe(lease_state(item)) if item is not None else None
    if state is None or state.owner_uid != run.uid or state.seen is None:
        return math.inf
    return max(0.0, (now() - state.seen).total_seconds())


def _remove_leader(session: RunSession, run: ElasticRun, round_number: int, leader: str,
                   host: str, port: int, silent_for: float, window: float) -> None:
    """Take a leader whose store and Lease both went silent out of the round.

    The operator writes the same removal when it runs, with the same rule
    (:func:`rounds.remove_member` for round ``round_number`` only); a lost
    compare-and-set is applied again to the winner's status, where the leader
    is usually out already and nothing is left to write.  Either way the round
    is over and the caller joins the next one.  A copy older than the round is
    read afresh first: the removal is made to the round itself.
    """
    message = (f"its TCPStore at {host}:{port} did not answer for {silent_for:.1f}s and its "
               f"Lease was not renewed for {window:g}s")

    def remove(current: ElasticRun) -> RunStatus | None:
        return rounds.remove_member(current.status, leader, rounds.LEADER_LOST, now(),
                                    message=message, detection_seconds=silent_for,
                                    in_round=round_number)

    held = run if run.status.round >= round_number else None
    if change_status(session, remove, ChangePolicy(seconds=session.settings.close_timeout),
                     held, what=f"remove rank 0 ({leader})") is not None:
        log.warning("%s: removed rank 0 (%s) from round %d: its store and its Lease went "
                    "silent", session.who, leader, round_number)
