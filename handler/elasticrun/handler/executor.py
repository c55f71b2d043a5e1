"""Carrying out :func:`.step.next_action`'s actions: one ``next_rendezvous`` call's requests.

:class:`RoundExecutor` is to :class:`~elasticrun.handler.handler.K8sRendezvousHandler`
what torch's ``_RendezvousOpExecutor`` is to its ``DynamicRendezvousHandler``: the
handler sets up the node's link to the run (session, Lease, stores) and answers
torch's API; the executor takes :func:`.step.next_action`'s answer, makes the
requests it stands for (join on the node's Lease, list, seal, announce, wait),
updates what the node knows, and asks again until a round holds the node.  On
``Complete`` it checks the round's store against what rank 0 announced, reaches it
(:mod:`.reach`), and in in-place mode tells the node's workers the round
(:func:`tell_workers`).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from torch.distributed import PrefixStore
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousInfo,
    RendezvousStateError,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from elasticrun.api import rounds
from elasticrun.api.gateway import readable_lease
from elasticrun.api.leases import lease_state
from elasticrun.api.model import (
    Assignment,
    ElasticRun,
    RunSpec,
    StoreAddress,
    WaitingNode,
    now,
)
from elasticrun.api.roundfile import ROUND_FILE_VARIABLE, Round, lost_file, write_round
from elasticrun.api.stores import store_problem
from elasticrun.handler import step
from elasticrun.handler.calls import who
from elasticrun.handler.lease import LeaseKeeper, NodeNameInUseError
from elasticrun.handler.mailbox import AssignmentWatch
from elasticrun.handler.reach import REPORT_TIMEOUT, reach_store
from elasticrun.handler.session import RunSession
from elasticrun.handler.settings import RendezvousSettings
from elasticrun.handler.store import RoundStores

log = logging.getLogger(__name__)

#: How long a member looks again at a store its rank 0 did not announce before it
#: refuses it: the honest mismatch (rank 0 left, or re-joined for the next round)
#: ends the round, which the member's watch shows within this.
STORE_CHECK_SECONDS = 5.0


class RunSucceededError(RendezvousClosedError, SystemExit):
    """The run this node came to join has already succeeded: the node's work is done.

    A late node (a Job's replacement pod, an index started after training
    finished) must not fail its workload: a Job counts an exit status other than
    0 as a failed pod.  torch's own ``RendezvousGracefulExitError`` does not help:
    the agent then returns no result and torchrun still exits 1.  This exception
    is a ``SystemExit`` with code 0, which torchrun's ``@record`` entry point
    turns into exit status 0 once the agent and the handler have shut down (no
    worker runs during a rendezvous); for code that drives the handler itself it
    is still the ``RendezvousClosedError`` a finished run always raised.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.code = 0


def tell_workers(settings: RendezvousSettings, round_: Round) -> None:
    """In-place mode: the node's place in the round, in the file its workers poll
    (``elasticrun.inplace``), whose path they inherit through the environment."""
    path = settings.round_file
    assert path is not None
    try:
        write_round(Path(path), round_)
        # The workers' report of an earlier round's failure is answered by this round.
        lost_file(Path(path)).unlink(missing_ok=True)
    except OSError as exc:
        raise RendezvousError(f"{who(settings)}: cannot write the round file {path} for the "
                              f"workers ({exc}); set --rdzv-conf round_file=<a writable "
                              "path>") from exc
    os.environ[ROUND_FILE_VARIABLE] = path


def join_request(settings: RendezvousSettings, store_port: int | None, since: dt.datetime,
                 next_store_port: int | None = None) -> WaitingNode:
    """This node's join request as its Lease carries it: who asks, where its store for the
    round listens, since when; and, once a round holds it as rank 0, where its store for
    the round after listens (``next_store_port``)."""
    return WaitingNode(name=settings.node_name, address=settings.address,
                       store_port=store_port, since=since, pod=settings.pod,
                       pod_uid=settings.pod_uid, index=settings.pod_index,
                       next_store_port=next_store_port)


class RoundExecutor:
    """Carries out :func:`.step.next_action` for the node's ``next_rendezvous`` calls.

    One per handler, made once the node has its session and its Lease keeper;
    :meth:`run` is one call.  ``closing`` says that ``shutdown()`` has begun: the
    call then carries out no further action.  ``placed`` hears the assignment as
    soon as a round holds the node (the handler's ``round``, and the request it
    answers).  The watch of the node's slice (:attr:`mailbox`, large runs)
    runs while a call does.
    """

    def __init__(self, settings: RendezvousSettings, session: RunSession, lease: LeaseKeeper,
                 stores: RoundStores, closing: Callable[[], bool],
                 placed: Callable[[Assignment, RunSpec], None]) -> None:
        self.settings = settings
        self.session = session
        self.lease = lease
        self.stores = stores
        self._closing = closing
        self._placed = placed
        #: The watch of our Lease for assignments (large runs), kept after the call ends.
        self.mailbox: AssignmentWatch | None = None

    def _who(self) -> str:
        return who(self.settings)

    def run(self, known: step.Knowledge) -> RendezvousInfo:
        """Carry out :func:`step.next_action` until a round holds this node."""
        session = self.session
        try:
            while True:
                action = step.next_action(known, now(), time.monotonic())
                if self._closing() and not isinstance(action, step.Closed):
                    # Bounds every loop of requests that never waits (a seal that keeps
                    # losing, a request that keeps vanishing) once shutdown() has begun.
                    raise RendezvousClosedError(f"{self._who()}: the agent is shutting down")
                if isinstance(action, step.Complete):
                    self._watch()
                    round_number = action.assignment.round
                    if known.woken is not None:
                        # What ends the new round comes from its quiet watch while the
                        # node reaches the store (RunSession.newest reads the run then).
                        session.follow(known.run.spec, stale=True, holding=round_number)
                    info = self._complete(known.run, action.assignment, action.vouched)
                    if info is not None:
                        session.follow(known.run.spec, stale=False, holding=round_number)
                        return info
                    # The round ended before its store answered: join the next one.
                    run = session.watcher.latest or session.read_or_raise()
                    known = known.replace(run=run, previous_round=round_number,
                                          previous_since=action.assignment.since, joined=False)
                    session.follow(run.spec, stale=known.stale)
                    continue
                known = self._carry_out(known, action)
        finally:
            if self.mailbox is not None:
                self.mailbox.stop()

    def _carry_out(self, known: step.Knowledge, action: step.Action) -> step.Knowledge:
        """Do one action of :func:`step.next_action`; what the node knows afterwards."""
        run, session = known.run, self.session
        if isinstance(action, step.Closed):
            self._leave_waiting()
            if run.status.phase == "Succeeded":
                # A warning, so that torchrun's default log level shows why a node (a
                # spare, a late replacement) ran no worker and still exited 0.
                log.warning("%s: the run already succeeded; nothing to do, exiting with "
                            "status 0", self._who())
                raise RunSucceededError(f"{self._who()}: the run already succeeded "
                                        f"(round {run.status.round})")
            raise RendezvousClosedError(f"{self._who()}: the run is closed "
                                        f"(phase {run.status.phase}, spec.closed="
                                        f"{str(run.spec.closed).lower()})")
        if isinstance(action, step.PodGone):
            # torchrun's agent ends, as the kubelet's signal would end it a moment later;
            # a request made from a stale copy, before the node knew, is withdrawn.
            if known.joined:
                self._leave_waiting()
            raise RendezvousClosedError(
                f"{self._who()}: removed from round {known.previous_round} because its Pod "
                f"is going ({action.message}); not asking for another round")
        if isinstance(action, step.Join):
            return self._ask(known)
        if isinstance(action, step.List):
            listed_at = now()
            pending = session.pending(run)
            self._watch()
            return known.replace(pending=pending, listed=True, listed_at=listed_at)
        if isinstance(action, step.Seal):
            run = self._seal(known, action.reason) or session.read_or_raise()
            return known.replace(run=run, listed=False)
        if isinstance(action, step.Announce):
            return known.replace(run=session.announce(run))
        if isinstance(action, step.Read):
            fresh = known.replace(run=session.read_or_raise(known.woken), listed=False)
            if fresh.kept is None:  # a kept place's quiet watch comes with Complete
                session.follow(fresh.run.spec, stale=fresh.stale)
            return fresh
        if isinstance(action, step.TimedOut):
            self._leave_waiting()
            raise RendezvousTimeoutError(
                f"{self._who()}: no round formed within the join timeout "
                f"({run.spec.join_timeout}s); "
                f"{len(known.pending if known.listed else run.status.waiting)} of at least "
                f"{run.spec.min_nodes} nodes were waiting. Check that the other nodes "
                f"are starting (kubectl get er {self.settings.run_name} -n "
                f"{self.settings.namespace})")
        assert isinstance(action, step.Wait)
        return self._wait(known, action.until)

    def _wait(self, known: step.Knowledge, until: float) -> step.Knowledge:
        """Wait for a newer run or a new assignment in our slice, or until ``until``."""
        session = self.session
        self._watch()
        seen = session.watcher.version  # before reading the slice's news: none is missed
        offered = self.mailbox.latest if self.mailbox is not None else None
        if offered != known.offered:
            return known.replace(offered=offered)
        changed = session.wait_for_change(known.run, until, self._closing, seen)
        offered = self.mailbox.latest if self.mailbox is not None else None
        if changed is known.run:
            return known.replace(offered=offered)
        updated = known.replace(run=changed, listed=False, offered=offered)
        if known.stale and updated.assignment is None:
            # A copy that places the node is followed as its round (on ``Complete``),
            # without a full watch opened in between.
            session.follow(changed.spec, stale=updated.stale)
        return updated

    def _watch(self) -> None:
        """Start the run's watch (once), which ``num_nodes_waiting()`` reads from.

        Not at the join but after the listing that follows it, or before the
        first wait: the watch takes a connection of its own (a TLS handshake)
        and this process's CPU, and the listing that may complete the round,
        whose seal every node waits for, goes first on the connection the call
        already holds.  The watch starts from the copy the node holds, so it
        misses no change made in between.
        """
        self.session.watcher.start()

    def _watch_assignments(self, run: ElasticRun) -> None:
        """Watch our slice of ``run`` for the operator's assignments (large runs), until
        the call ends; a run created again under its name has slices of its own."""
        mailbox = self.mailbox
        if mailbox is not None and not mailbox.stopped and mailbox.run_uid == run.uid:
            return
        if mailbox is not None:
            mailbox.stop()
        if run.uid is None:
            return  # a run not yet stored has no slices; the next request looks again
        session = self.session
        self.mailbox = AssignmentWatch(session.gateway, self.settings.node_name, run.uid,
                                       session.watcher.poke, self.settings.watch_timeout)
        self.mailbox.start()

    # ------------------------------------------------------------------ requests

    def _ask(self, known: step.Knowledge) -> step.Knowledge:
        """Join, and watch for the answer: a member woken from a stale copy for the run
        to settle (from now, opened as the request is written), in its slice in the
        largest runs."""
        session, spec = self.session, known.run.spec
        if known.stale:
            session.follow(spec, stale=True)
        own = self._join()
        session.check_watch()  # the join found our Lease deleted with the run
        if rounds.members_told_in_slices(spec):
            self._watch_assignments(known.run)
        return known.replace(joined=True, own=own, listed=False)

    def _join(self) -> WaitingNode:
        """Ask for the next round: one write to our own Lease, never contended."""
        lease, session = self.lease, self.session
        entry = join_request(self.settings, self.stores.port, now())
        try:
            if lease.acquired:
                session.call("join the run", lambda: lease.set_join(entry))
            else:
                session.call("take the node's Lease", lambda: lease.acquire(entry))
                lease.start()
        except NodeNameInUseError as exc:
            raise RendezvousError(f"{self._who()}: {exc}") from exc
        return entry

    def _seal(self, known: step.Knowledge, reason: str) -> ElasticRun | None:
        """One compare-and-set; None when someone else wrote first."""
        status = rounds.seal_round(known.run, now(), known.pending)
        written = self.session.replace_status(known.run, status)
        if written is not None:
            log.info("%s: sealed round %d with %d nodes (%s)", self._who(), written.status.round,
                     len(written.status.participants), reason)
        return written

    def _leave_waiting(self) -> None:
        """Withdraw our join request (clear the annotation on our Lease)."""
        lease = self.lease
        if not lease.acquired:
            return
        try:
            self.session.call("leave the waiting list", lambda: lease.set_join(None),
                              self.settings.close_timeout)
        except RendezvousError as exc:
            log.debug("leaving the waiting list: %s", exc)

    def _report_unreachable(self, leader: str, round_number: int) -> None:
        if self.lease.acquired:
            self.lease.report_unreachable(leader, round_number,
                                          min(REPORT_TIMEOUT, self.settings.close_timeout))

    # ------------------------------------------------------------------ the round

    def _complete(self, run: ElasticRun, assignment: Assignment,
                  vouched: bool) -> RendezvousInfo | None:
        """torch's view of the round, or None when it ended before its store answered.

        ``vouched``: the place was told in the node's slice (:attr:`.step.Complete.vouched`).
        """
        round_number, rank = assignment.round, assignment.rank
        if assignment.store is None:
            raise RendezvousStateError(f"{self._who()}: round {round_number} was sealed without "
                                       "a store address (status.store); the rank-0 node did not "
                                       "publish its TCPStore port")
        host, port = assignment.store.host, assignment.store.port
        latest = self.session.watcher.latest or run
        if not self._store_announced(latest, assignment, vouched):
            return None
        base = reach_store(self.session, self.stores, latest, assignment,
                           self._report_unreachable)
        if base is None:
            return None
        self._placed(assignment, run.spec)
        if self.settings.in_place:
            tell_workers(self.settings, Round(round_number, rank, assignment.world_size, host,
                                              port))
        store = PrefixStore(f"torch.rendezvous.{self.settings.run_name}.{round_number}", base)
        log.info("%s: round %d, rank %d of %d, store %s:%d", self._who(), round_number, rank,
                 assignment.world_size, host, port)
        return RendezvousInfo(store, rank, assignment.world_size,
                              RendezvousStoreInfo(master_addr=host, master_port=port))

    def _store_announced(self, run: ElasticRun, assignment: Assignment,
                         vouched: bool) -> bool:
        """Whether the round's store is the one its rank 0 announced; False: not our round.

        The round answers this call's request (:attr:`.step.Knowledge.assignment`
        takes no other).  Rank 0 serves its own store.  A place told in the node's
        slice (``vouched``) needs no look: the operator, the slices' only writer,
        compared the round's store with rank 0's Lease before it told it, and a
        read by every member at once would be the last burst of a large round.
        Any other member compares it with rank 0's Lease
        (:func:`elasticrun.api.stores.store_problem`): the copy in this node's
        last listing of the Leases where that shows the very request the round
        answered (a request is replaced, never rewritten), else one read
        (:func:`~elasticrun.api.gateway.readable_lease`).  A round whose rank 0
        has moved on (its request withdrawn or replaced by a newer one, which rank
        0 itself takes no round of) is not this node's round: it joins the next
        one (a vouched member learns that from its watch, or from a store that
        does not answer, :func:`~elasticrun.handler.reach.reach_store`).  A round
        that answers rank 0's current request with a store rank 0 did not
        announce is refused before any connection is made, with torch's
        RendezvousStateError.
        """
        session = self.session
        given, leader, round_number = assignment.store, assignment.leader, assignment.round
        if assignment.rank == 0:
            return self._own_store(given, round_number)
        if vouched or leader is None:
            return True  # the operator looked; or the round lost its rank 0 (reach_store)
        # Rank 0's request in this round; a copy of another round (one that superseded
        # it) has none, and the run is read afresh only if the store differs.
        member = run.status.participant(leader) if run.status.round == round_number else None
        answered, read_afresh = (member.since if member is not None else None), member is None
        listed = session.listed.get(leader)
        if answered is not None and listed is not None and store_problem(
                given, listed, self.settings.run_name, run.uid, leader, answered) is None:
            return True
        deadline = time.monotonic() + STORE_CHECK_SECONDS
        while True:
            lease = session.call("read rank 0's Lease",
                                 lambda: readable_lease(session.gateway, leader))
            problem = store_problem(given, lease, self.settings.run_name, run.uid, leader,
                                    answered)
            if problem is not None and read_afresh:
                answered, read_afresh = _answered(session, run, leader, round_number), False
                problem = store_problem(given, lease, self.settings.run_name, run.uid, leader,
                                        answered)
            if problem is None:
                return True
            join = lease_state(lease).join if lease is not None else None
            if join is None or join.since != answered:
                log.warning("%s: not connecting to the store of round %d (%s); rank 0 has "
                            "moved on, joining the next round", self._who(), round_number,
                            problem)
                return False
            session.check_watch()
            latest = session.newest(run, round_number)
            if step.superseded(latest, round_number, self.settings.node_name,
                               leader) is not None:
                return False
            if time.monotonic() >= deadline:
                raise RendezvousStateError(
                    f"{self._who()}: refusing the store of round {round_number}: {problem}. "
                    "No connection was made: status.store (or this node's assignment) was "
                    "written by someone other than rank 0; check who may update the "
                    f"ElasticRun {self.settings.run_name} and its status (per-run RBAC, "
                    "the admission policy)")
            session.wait_for_change(latest, min(deadline, time.monotonic() + 0.5),
                                    self._closing)

    def _own_store(self, given: StoreAddress | None, round_number: int) -> bool:
        """Rank 0's check: the round names the store this node serves for this call."""
        own = StoreAddress(self.settings.address, self.stores.port or 0)
        if given == own:
            return True
        raise RendezvousStateError(
            f"{self._who()}: round {round_number} makes this node rank 0 with store "
            f"{given.host if given else None}:{given.port if given else None}, but it "
            f"serves its store at {own.host}:{own.port} and announced that on its Lease; "
            "status.store was written by someone else: check who may update the "
            f"ElasticRun {self.settings.run_name} and its status")


def _answered(session: RunSession, run: ElasticRun, leader: str,
              round_number: int) -> dt.datetime | None:
    """The join request of ``leader`` that round ``round_number`` holds (its ``since``),
    from a fresh read of the run (one GET of the whole roster: only when the store
    a member was told differs from what rank 0 announces)."""
    run = session.read() or run
    member = run.status.participant(leader) if run.status.round == round_number else None
    return member.since if member is not None else None
