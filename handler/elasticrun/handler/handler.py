"""``K8sRendezvousHandler``: torch's elastic rendezvous over an ElasticRun's status.

One round, as a node sees it:

1. **Join** — the node writes its request (address, store port, time) into an
   annotation of its own Lease: one write to an object nobody else writes, so
   joins never contend (see :mod:`elasticrun.api.leases` for the measurement
   that chose this over entries in the ElasticRun).  One consistent LIST of
   the run's Leases then tells it who else is waiting.
2. **Seal** — when the rules in :mod:`elasticrun.api.rounds` say so (max or desired size
   reached, all survivors back, last call passed), one compare-and-set replaces
   the ElasticRun's status: waiting nodes become participants with ranks,
   ``round`` and ``signal`` move.  Whoever's request made the rule true tries;
   losers watch.  The operator does the same from its Lease index as a
   backstop, so a round completes with or without it.  In large runs
   (:func:`~elasticrun.api.rounds.nodes_defer_seal`) the roles swap: nodes skip
   the LIST and leave the seal to the operator, and list and seal themselves
   only if no round came within :func:`~elasticrun.api.rounds.defer_seal_wait`.
   From 256 nodes (:func:`~elasticrun.api.rounds.members_told_by_lease`) the
   operator's seal tells each member its rank on the member's own Lease
   instead of sending every node the whole roster.
3. **Wait** — on the narrow watch of :mod:`.watcher` (and, from 256 nodes, the
   watch of the node's own Lease in :mod:`.mailbox`), never by polling.

A node that joins beside a running round bumps ``signal`` once per round (a
JSON-patch ``test`` on the counters, so it conflicts only with another such
notice), which is how the members' ``num_nodes_waiting()`` becomes positive.

Which of these a node does next is decided by :func:`.step.next_action`, a
pure function; ``next_rendezvous`` is the loop that carries its actions out
through the run's gateway (:mod:`.session`).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import threading
import time
from pathlib import Path

from torch.distributed import PrefixStore, Store
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from elasticrun.api import rounds
from elasticrun.api.change import ChangePolicy, change_status
from elasticrun.api.gateway import RunAccess, RunGateway
from elasticrun.api.kube import KubeClient
from elasticrun.api.leases import lease_state
from elasticrun.api.model import (
    Assignment,
    ElasticRun,
    StoreAddress,
    WaitingNode,
    now,
)
from elasticrun.api.policy import retry_delay
from elasticrun.api.roundfile import (
    ROUND_FILE_VARIABLE,
    Round,
    RoundFileError,
    decode_lost,
    lost_file,
    write_round,
)
from elasticrun.api.stores import store_problem
from elasticrun.handler import exitbarrier, step
from elasticrun.handler import settings as settings_mod
from elasticrun.handler.calls import ElasticRunForbiddenError, connect_client, who
from elasticrun.handler.lease import LeaseKeeper, NodeNameInUseError
from elasticrun.handler.mailbox import AssignmentWatch
from elasticrun.handler.reach import REPORT_TIMEOUT, reach_store
from elasticrun.handler.session import RunSession
from elasticrun.handler.settings import RendezvousSettings
from elasticrun.handler.store import RoundStores, StoreAddressError
from elasticrun.handler.watcher import RunWatcher

__all__ = ["BACKEND", "ElasticRunForbiddenError", "K8sRendezvousHandler", "RunSucceededError",
           "create_handler"]

log = logging.getLogger(__name__)

BACKEND = "k8s"
#: How long a member looks again at a store its rank 0 did not announce before it
#: refuses it: the honest mismatch (rank 0 left, or re-joined for the next round)
#: ends the round, which the member's watch shows within this.
STORE_CHECK_SECONDS = 5.0
#: In-place mode: the longest the follower goes without looking at the run and the lost
#: file (the watch wakes it at once; this covers the file and timers such as a last call).
FOLLOW_INTERVAL = 0.2


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


class K8sRendezvousHandler(RendezvousHandler):
    """A torch ``RendezvousHandler`` whose shared state is an ElasticRun.

    Every request the node makes goes through one :class:`~elasticrun.api.gateway.RunAccess`:
    ``gateway`` replaces the one built from the settings' credentials (a test that
    wants to act between the node's calls, or the in-memory fake of the unit tests).
    """

    def __init__(self, settings: RendezvousSettings, client: KubeClient | None = None,
                 gateway: RunAccess | None = None) -> None:
        self.settings = settings
        self._client = client
        self._gateway = gateway
        self._session: RunSession | None = None
        self._lease: LeaseKeeper | None = None
        self._mailbox: AssignmentWatch | None = None
        self.stores = RoundStores()
        self._round = 0
        #: The store handed to torchrun by its last ``next_rendezvous()`` (where its
        #: agent keeps the exit barrier; in-place rounds of the follower do not move it).
        self._round_store: Store | None = None
        self._lock = threading.Lock()
        self._closing = False
        self._follower: threading.Thread | None = None
        #: In-place mode: the follower saw a newcomer; num_nodes_waiting() asks for a restart.
        self._restart_wanted = False

    # ------------------------------------------------------------------ torch API

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True

    def get_run_id(self) -> str:
        return self.settings.run_name

    def next_rendezvous(self) -> RendezvousInfo:
        info = self._next_round()
        self._round_store = info.store  # torchrun's exit barrier is kept in it
        if self.settings.in_place:
            self._restart_wanted = False
            self._follow()
        return info

    def _next_round(self) -> RendezvousInfo:
        """One rendezvous: torchrun's call, or the in-place follower's (:meth:`_following`)."""
        with self._lock:
            session = self._connect()
            run = session.current()
            self._start_lease(session, run)
            try:
                self.stores.fresh(self.settings.address, self.settings.store_port)
            except StoreAddressError as exc:
                raise RendezvousError(f"{self._who()}: {exc}") from exc
            started = time.monotonic()
            defer_until = (started + rounds.defer_seal_wait(run.spec)
                           if rounds.nodes_defer_seal(run.spec) else None)
            known = step.Knowledge(node=self.settings.node_name, run=run,
                                   previous_round=self._round,
                                   join_deadline=started + run.spec.join_timeout,
                                   defer_until=defer_until)
            try:
                return self._rendezvous(session, known)
            finally:
                if self._mailbox is not None:
                    self._mailbox.stop()

    def _rendezvous(self, session: RunSession, known: step.Knowledge) -> RendezvousInfo:
        """Carry out :func:`step.next_action` until a round holds this node."""
        while True:
            action = step.next_action(known, now(), time.monotonic())
            if isinstance(action, step.Complete):
                info = self._complete(session, known.run, action.assignment, known.own)
                if info is not None:
                    return info
                # The round ended before its store answered: join the next one.
                run = session.watcher.latest or session.read_or_raise()
                known = known.replace(run=run, previous_round=action.assignment.round,
                                      joined=False)
                continue
            known = self._carry_out(session, known, action)

    def is_closed(self) -> bool:
        run = self._connect().cached_or_read()
        return run is not None and run.closed

    def set_closed(self) -> None:
        """Close the run for everybody; waiting and late nodes get RendezvousClosedError."""
        session = self._connect()
        session.call("close the run", session.gateway.close, self.settings.close_timeout)
        # Write the closed status ourselves (the operator's rule), so that waiting nodes
        # hear it even with no operator.
        change_status(session, lambda run: rounds.close(run, now()), self._change_policy(),
                      what="close the run")

    def num_nodes_waiting(self) -> int:
        run = self._session.watcher.latest if self._session is not None else None
        if self.settings.in_place:
            # A lost member: the follower re-forms the round and the workers stay. A
            # newcomer: the follower asks torchrun to restart them, as without in-place mode.
            if run is None or not self._restart_wanted:
                return 0
            return max(1, rounds.nodes_waiting(run, self._round, now=now()))
        if run is None or self._round == 0:
            return 0
        return rounds.nodes_waiting(run, self._round, now=now())

    def shutdown(self) -> bool:
        """Leave the membership; never close the run for the others.

        A ``next_rendezvous()`` still blocked in this handler (a spare, say) is
        woken and fails with RendezvousClosedError instead of holding us up.
        """
        self._closing = True
        if self._session is not None:
            self._session.watcher.stop()
        if self._mailbox is not None:
            self._mailbox.stop()
        locked = self._lock.acquire(timeout=self.settings.close_timeout)
        try:
            # Our join request goes first, so no node can take it for a new one
            # once we have left; the Lease goes last, so the operator never sees
            # a member without one (it would record a loss, not a departure).
            # If the request cannot be withdrawn, the Lease goes first instead.
            lease = self._lease
            if lease is not None and not lease.withdraw_join(self.settings.close_timeout):
                lease.release(self.settings.close_timeout)
                lease = None
            try:
                self._leave_membership(self._round_finished())
            except RendezvousError as exc:
                log.warning("%s: leaving the membership failed: %s", self._who(), exc)
            if lease is not None:
                lease.release(self.settings.close_timeout)
            self.stores.close()
            self._round = 0
        finally:
            if locked:
                self._lock.release()
        return True

    # ------------------------------------------------------------------ in-place mode

    def _follow(self) -> None:
        """Start following the run (once): in-place mode joins each next round itself."""
        if self._follower is None or not self._follower.is_alive():
            self._follower = threading.Thread(target=self._following, daemon=True,
                                              name=f"elasticrun-follow-{self.settings.node_name}")
            self._follower.start()

    def _following(self) -> None:
        """While the agent runs: whenever this node's round lost a member
        (:func:`step.in_place_move` says ``follow``), rendezvous again and tell the
        workers through the round file. The workers keep running meanwhile."""
        failures = 0
        while not self._closing:
            session = self._session
            if session is None:
                return
            seen = session.watcher.version
            run = session.watcher.latest
            if run is not None and not self._restart_wanted \
                    and self._in_place_move(session, run) == "follow":
                log.info("%s: round %d must be re-formed; joining the next one in place",
                         self._who(), self._round)
                try:
                    self._next_round()
                    failures = 0
                except RendezvousClosedError as exc:
                    log.info("%s: no longer following the run: %s", self._who(), exc)
                    return
                except RendezvousError as exc:
                    failures += 1
                    log.warning("%s: following the run: %s", self._who(), exc)
                    time.sleep(retry_delay(failures))
                continue
            waited = time.monotonic()
            session.watcher.wait(seen, FOLLOW_INTERVAL)
            if session.watcher.version == seen and time.monotonic() - waited < 0.01:
                time.sleep(FOLLOW_INTERVAL)  # a stopped watch returns at once: do not spin

    def _in_place_move(self, session: RunSession, run: ElasticRun) -> step.InPlaceMove:
        """:func:`step.in_place_move`, with one LIST of the join requests once the round
        must change; a ``restart`` is kept for ``num_nodes_waiting()`` until torchrun's
        next rendezvous."""
        lost = self._lost_round()
        move = step.in_place_move(run, self._round, now(), lost)
        if move == "stay":
            return move
        try:
            pending = session.pending(run)
        except RendezvousError as exc:
            log.warning("%s: listing the join requests: %s", self._who(), exc)
            return "stay"
        move = step.in_place_move(run, self._round, now(), lost,
                                  step.has_newcomers(run, pending))
        if move == "restart":
            log.info("%s: a newcomer is waiting; torchrun restarts the workers", self._who())
            self._restart_wanted = True
        return move

    def _lost_round(self) -> int:
        """The round whose group the node's workers reported failed (0: none, or unreadable)."""
        path = self.settings.round_file
        if path is None:
            return 0
        try:
            return decode_lost(lost_file(Path(path)).read_bytes())
        except FileNotFoundError:
            return 0
        except (OSError, RoundFileError) as exc:
            log.debug("%s: ignoring the lost file: %s", self._who(), exc)
            return 0

    @property
    def mailbox(self) -> AssignmentWatch | None:
        """The watch of our Lease for assignments (large runs), kept after the call ends."""
        return self._mailbox

    @property
    def watcher(self) -> RunWatcher | None:
        """The watch cache of the run (None before the first rendezvous)."""
        return self._session.watcher if self._session is not None else None

    @property
    def lease(self) -> LeaseKeeper | None:
        """The keeper of the node's Lease (None before the first rendezvous)."""
        return self._lease

    @property
    def round(self) -> int:
        """The round this node last completed (0 before its first, and after shutdown)."""
        return self._round

    # ------------------------------------------------------------------ the executor

    def _carry_out(self, session: RunSession, known: step.Knowledge,
                   action: step.Action) -> step.Knowledge:
        """Do one action of :func:`step.next_action`; what the node knows afterwards."""
        run = known.run
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
        if isinstance(action, step.Join):
            own = self._join()
            session.check_watch()  # the join found our Lease deleted with the run
            session.watcher.start()  # once; what num_nodes_waiting() reads from
            if rounds.members_told_by_lease(run.spec):
                self._watch_assignments(session)
            return known.replace(joined=True, own=own, listed=False)
        if isinstance(action, step.List):
            listed_at = now()
            return known.replace(pending=session.pending(run), listed=True, listed_at=listed_at)
        if isinstance(action, step.Seal):
            run = self._seal(session, known, action.reason) or session.read_or_raise()
            return known.replace(run=run, listed=False)
        if isinstance(action, step.Announce):
            return known.replace(run=session.announce(run))
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
        return self._wait(session, known, action.until)

    def _wait(self, session: RunSession, known: step.Knowledge, until: float) -> step.Knowledge:
        """Wait for a newer run or a new assignment on our Lease, or until ``until``."""
        seen = session.watcher.version  # before reading the Lease's news: none is missed
        offered = self._mailbox.latest if self._mailbox is not None else None
        if offered != known.offered:
            return known.replace(offered=offered)
        changed = session.wait_for_change(known.run, until, lambda: self._closing, seen)
        offered = self._mailbox.latest if self._mailbox is not None else None
        if changed is known.run:
            return known.replace(offered=offered)
        return known.replace(run=changed, listed=False, offered=offered)

    # ------------------------------------------------------------------ set-up

    def _who(self) -> str:
        return who(self.settings)

    def _connect(self) -> RunSession:
        if self._session is None:
            gateway = self._gateway
            if gateway is None:
                if self._client is None:
                    self._client = connect_client(self.settings)
                gateway = RunGateway(self._client, self.settings.namespace,
                                     self.settings.run_name)
            self._session = RunSession(self.settings, gateway)
        return self._session

    def _start_lease(self, session: RunSession, run: ElasticRun) -> None:
        if self._lease is None:
            self._lease = LeaseKeeper(session.gateway, self.settings.node_name,
                                      run.spec.heartbeat_timeout, run.spec.lease_renew_interval,
                                      run.uid, on_deleted=session.watcher.recheck)

    def _watch_assignments(self, session: RunSession) -> None:
        """Watch our Lease for the operator's assignments (large runs), until the call ends."""
        if (self._mailbox is None or self._mailbox.stopped) and self._lease is not None:
            self._mailbox = AssignmentWatch(session.gateway, self.settings.node_name,
                                            session.watcher.poke, self.settings.watch_timeout)
            self._mailbox.start()

    # ------------------------------------------------------------------ operations

    def _join(self) -> WaitingNode:
        """Ask for the next round: one write to our own Lease, never contended."""
        lease, session = self._lease, self._session
        assert lease is not None and session is not None
        entry = WaitingNode(name=self.settings.node_name, address=self.settings.address,
                            store_port=self.stores.port, since=now(), pod=self.settings.pod,
                            pod_uid=self.settings.pod_uid, index=self.settings.pod_index)
        try:
            if lease.acquired:
                session.call("join the run", lambda: lease.set_join(entry))
            else:
                session.call("take the node's Lease", lambda: lease.acquire(entry))
                lease.start()
        except NodeNameInUseError as exc:
            raise RendezvousError(f"{self._who()}: {exc}") from exc
        return entry

    def _seal(self, session: RunSession, known: step.Knowledge,
              reason: str) -> ElasticRun | None:
        """One compare-and-set; None when someone else wrote first."""
        status = rounds.seal_round(known.run, now(), known.pending)
        written = session.replace_status(known.run, status)
        if written is not None:
            log.info("%s: sealed round %d with %d nodes (%s)", self._who(), written.status.round,
                     len(written.status.participants), reason)
        return written

    def _leave_waiting(self) -> None:
        """Withdraw our join request (clear the annotation on our Lease)."""
        lease, session = self._lease, self._session
        if lease is None or session is None or not lease.acquired:
            return
        try:
            session.call("leave the waiting list", lambda: lease.set_join(None),
                         self.settings.close_timeout)
        except RendezvousError as exc:
            log.debug("leaving the waiting list: %s", exc)

    def _round_finished(self) -> bool:
        """Whether this node's round passed torch's exit barrier (see :mod:`.exitbarrier`)."""
        store, self._round_store = self._round_store, None
        return store is not None and exitbarrier.passed(store)

    def _leave_membership(self, finished: bool) -> None:
        session = self._session
        if session is None:
            return
        node = self.settings.node_name
        change_status(session, lambda run: rounds.leave(run.status, node, now(),
                                                        finished=finished),
                      self._change_policy(), what="leave the membership")

    def _change_policy(self) -> ChangePolicy:
        """How long the node tries a change of the run on its way out: ``close_timeout``."""
        return ChangePolicy(seconds=self.settings.close_timeout)

    def _report_unreachable(self, leader: str, round_number: int) -> None:
        if self._lease is not None and self._lease.acquired:
            self._lease.report_unreachable(leader, round_number,
                                           min(REPORT_TIMEOUT, self.settings.close_timeout))

    def _complete(self, session: RunSession, run: ElasticRun, assignment: Assignment,
                  own: WaitingNode | None = None) -> RendezvousInfo | None:
        """torch's view of the round, or None when it ended before its store answered."""
        round_number, rank = assignment.round, assignment.rank
        if assignment.store is None:
            raise RendezvousStateError(f"{self._who()}: round {round_number} was sealed without "
                                       "a store address (status.store); the rank-0 node did not "
                                       "publish its TCPStore port")
        host, port = assignment.store.host, assignment.store.port
        latest = session.watcher.latest or run
        if not self._store_announced(session, latest, assignment, own):
            return None
        base = reach_store(session, self.stores, latest, assignment, self._report_unreachable)
        if base is None:
            return None
        self._round = round_number
        if self.settings.in_place:
            self._tell_workers(Round(round_number, rank, assignment.world_size, host, port))
        store = PrefixStore(f"torch.rendezvous.{self.settings.run_name}.{round_number}", base)
        log.info("%s: round %d, rank %d of %d, store %s:%d", self._who(), round_number, rank,
                 assignment.world_size, host, port)
        return RendezvousInfo(store, rank, assignment.world_size,
                              RendezvousStoreInfo(master_addr=host, master_port=port))


    def _tell_workers(self, round_: Round) -> None:
        """In-place mode: the node's place in the round, in the file its workers poll
        (``elasticrun.inplace``), whose path they inherit through the environment."""
        path = self.settings.round_file
        assert path is not None
        try:
            write_round(Path(path), round_)
            # The workers' report of an earlier round's failure is answered by this round.
            lost_file(Path(path)).unlink(missing_ok=True)
        except OSError as exc:
            raise RendezvousError(f"{self._who()}: cannot write the round file {path} for the "
                                  f"workers ({exc}); set --rdzv-conf round_file=<a writable "
                                  "path>") from exc
        os.environ[ROUND_FILE_VARIABLE] = path

    def _store_announced(self, session: RunSession, run: ElasticRun, assignment: Assignment,
                         request: WaitingNode | None) -> bool:
        """Whether the round's store is the one its rank 0 announced; False: not our round.

        Rank 0 serves its own store; anyone else reads rank 0's Lease (one
        LIST by name) and compares (:func:`elasticrun.api.stores.store_problem`).
        A round that does not answer this call's join ``request`` (a status
        written by hand from an older round), or whose rank 0 has moved on
        (its request withdrawn or replaced by a newer one), is not this node's
        round: it joins the next one.  A round that answers rank 0's current
        request with a store rank 0 did not announce is refused before any
        connection is made, with torch's RendezvousStateError.
        """
        given, leader, round_number = assignment.store, assignment.leader, assignment.round
        # Every seal records the request it answers: a round holding an older
        # request of this node was written from an older round (a hand edit, a
        # restore, the repair of a status whose roster was unreadable).
        stale = request is not None and assignment.since is not None \
            and assignment.since != request.since
        if assignment.rank == 0:
            return self._own_store(given, round_number, stale)
        if leader is None:
            return True  # the round lost its rank 0: reach_store joins the next one
        # Rank 0's request in this round; a copy that predates the round (a member
        # told on its Lease) has none, and is read afresh only if the store differs.
        member = run.status.participant(leader) if run.status.round == round_number else None
        answered, read_afresh = (member.since if member is not None else None), member is None
        deadline = time.monotonic() + STORE_CHECK_SECONDS
        while True:
            lease = session.call("read rank 0's Lease",
                                 lambda: session.gateway.listed_lease(leader))
            problem = store_problem(given, lease, self.settings.run_name, run.uid, leader,
                                    answered)
            if problem is not None and read_afresh:
                answered, read_afresh = self._answered(session, run, leader, round_number), False
                problem = store_problem(given, lease, self.settings.run_name, run.uid, leader,
                                        answered)
            if problem is None:
                return True
            join = lease_state(lease).join if lease is not None else None
            if stale or join is None or join.since != answered:
                log.warning("%s: not connecting to the store of round %d (%s); %s, joining "
                            "the next round", self._who(), round_number, problem,
                            "it answers an earlier request of this node" if stale
                            else "rank 0 has moved on")
                return False
            session.check_watch()
            latest = session.watcher.latest or run
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
                                    lambda: self._closing)

    def _own_store(self, given: StoreAddress | None, round_number: int, stale: bool) -> bool:
        """Rank 0's check: the round names the store this node serves for this call."""
        own = StoreAddress(self.settings.address, self.stores.port or 0)
        if given == own:
            return True
        if stale:
            log.warning("%s: round %d answers an earlier request of this node and names "
                        "another store than its own; joining the next round", self._who(),
                        round_number)
            return False
        raise RendezvousStateError(
            f"{self._who()}: round {round_number} makes this node rank 0 with store "
            f"{given.host if given else None}:{given.port if given else None}, but it "
            f"serves its store at {own.host}:{own.port} and announced that on its Lease; "
            "status.store was written by someone else: check who may update the "
            f"ElasticRun {self.settings.run_name} and its status")

    @staticmethod
    def _answered(session: RunSession, run: ElasticRun, leader: str,
                  round_number: int) -> dt.datetime | None:
        """The join request of ``leader`` that round ``round_number`` holds (its ``since``),
        from a fresh read of the run (one GET of the whole roster: only when the store
        a member was told differs from what rank 0 announces)."""
        run = session.read() or run
        member = run.status.participant(leader) if run.status.round == round_number else None
        return member.since if member is not None else None


def create_handler(params: RendezvousParameters) -> K8sRendezvousHandler:
    """The creator torch registers for ``--rdzv-backend=k8s``."""
    try:
        settings = settings_mod.from_parameters(
            run_id=params.run_id, endpoint=params.endpoint, min_nodes=params.min_nodes,
            max_nodes=params.max_nodes, local_addr=params.local_addr, conf=dict(params.config))
    except settings_mod.SettingsError as exc:
        raise ValueError(f"k8s rendezvous: {exc}") from exc
    return K8sRendezvousHandler(settings)
