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
   In the largest runs (:func:`~elasticrun.api.rounds.members_told_in_slices`)
   the operator's seal tells each member its rank in the run's slices
   instead of sending every node the whole roster.
3. **Wait** — on the narrow watch of :mod:`.watcher` (and, in the largest
   runs, the watch of the node's slice in :mod:`.mailbox`), never by
   polling.  From 256 nodes (:func:`~elasticrun.api.rounds.members_watch_quietly`)
   a member holding its round then watches only for that round's disturbance,
   one event of metadata (the watcher's quiet watch), and once woken only for
   the run to settle, the next seal or the run's end, sent once.

A node that joins beside a running round bumps ``signal`` once per round (a
JSON-patch ``test`` on the counters, so it conflicts only with another such
notice), which is how the members' ``num_nodes_waiting()`` becomes positive.

Which of these a node does next is decided by :func:`.step.next_action`, a
pure function; :class:`.executor.RoundExecutor` carries its actions out through
the run's gateway (:mod:`.session`), one ``next_rendezvous`` call at a time.  In
in-place mode the :class:`.follower.Follower` thread joins the next round
itself after a loss.  This module keeps torch's API, the node's set-up (its
session and its Lease) and the way out (``set_closed``, ``shutdown``).
"""


from __future__ import annotations

import datetime as dt
import functools
import logging
import threading
import time
from collections.abc import Callable

from torch.distributed import Store
from torch.distributed.elastic.rendezvous import (
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
)

from elasticrun.api import rounds
from elasticrun.api.change import ChangePolicy, change_status
from elasticrun.api.gateway import RunAccess, RunGateway
from elasticrun.api.kube import ApiConnectionError, ApiError, KubeClient
from elasticrun.api.model import (
    Assignment,
    ElasticRun,
    RunSpec,
    RunStatus,
    StoreAddress,
    now,
)
from elasticrun.handler import exitbarrier, step
from elasticrun.handler import settings as settings_mod
from elasticrun.handler.calls import ElasticRunForbiddenError, connect_client, who
from elasticrun.handler.executor import RoundExecutor, RunSucceededError, join_request
from elasticrun.handler.follower import Follower
from elasticrun.handler.lease import LeaseKeeper
from elasticrun.handler.mailbox import AssignmentWatch
from elasticrun.handler.session import RunSession
from elasticrun.handler.settings import RendezvousSettings
from elasticrun.handler.store import RoundStores, StoreAddressError
from elasticrun.handler.watcher import RunWatcher

__all__ = ["BACKEND", "ElasticRunForbiddenError", "K8sRendezvousHandler", "RunSucceededError",
           "create_handler"]

log = logging.getLogger(__name__)

BACKEND = "k8s"


class K8sRendezvousHandler(RendezvousHandler):
    """A torch ``RendezvousHandler`` whose shared state is an ElasticRun.

    Every request the node makes goes through one :class:`~elasticrun.api.gateway.RunAccess`:
    ``gateway`` replaces the one built from the settings' credentials (a test that
    wants to act between the node's calls, or the in-memory fake of the unit tests).

    The credentials are loaded, the client is made and the first round's store
    is started here, as torch's c10d handler connects to its store when it is
    made: parsing a kubeconfig, loading its certificates and starting a TCPStore
    cost a node milliseconds of CPU (and the store a reverse DNS query, see
    :mod:`.store`), which belong to torchrun's start and not to the first round
    every node waits on.  Missing or unusable credentials fail here with
    ``RendezvousConnectionError``, an address the store cannot serve on with
    ``RendezvousError``.
    """

    def __init__(self, settings: RendezvousSettings, client: KubeClient | None = None,
                 gateway: RunAccess | None = None) -> None:
        self.settings = settings
        if gateway is None and client is None:
            client = connect_client(settings)
        self._client = client
        self._gateway = gateway
        self._session: RunSession | None = None
        self._lease: LeaseKeeper | None = None
        self._executor: RoundExecutor | None = None
        self.stores = RoundStores()
        self._serve_store(self.stores.fresh)
        self._round = 0
        #: The join request the node's round answered (a kept place answers it again).
        self._since: dt.datetime | None = None
        #: The store this node announced for the round after ``_round`` (rank 0: see
        #: :meth:`_announce_next_store`); None until its Lease says so.
        self._next_store: StoreAddress | None = None
        #: How many rendezvous have begun (torchrun's and the follower's).
        self._calls = 0
        #: The store handed to torchrun by its last ``next_rendezvous()`` (where its
        #: agent keeps the exit barrier; in-place rounds of the follower do not move it).
        self._round_store: Store | None = None
        self._lock = threading.Lock()
        self._closing = False
        self._follower = Follower(settings, self._next_round, lambda: self._round,
                                  lambda: self._closing)

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
            assert self._session is not None
            self._follower.follow(self._session)
        return info

    def _next_round(self) -> RendezvousInfo:
        """One rendezvous: torchrun's call, or the in-place follower's."""
        with self._lock:
            self._calls += 1
            session = self._connect()
            run, woken = session.current()
            executor = self._round_executor(session, self._start_lease(session, run))
            self._serve_store(self.stores.for_round)
            started = time.monotonic()
            defer_until = (started + rounds.defer_seal_wait(run.spec)
                           if rounds.nodes_defer_seal(run.spec) else None)
            known = step.Knowledge(node=self.settings.node_name, run=run,
                                   previous_round=self._round, previous_since=self._since,
                                   next_store=self._next_store,
                                   join_deadline=started + run.spec.join_timeout,
                                   defer_until=defer_until, woken=woken)
            return executor.run(known)

    def _placed(self, assignment: Assignment, spec: RunSpec) -> None:
        """The executor's news: a round holds this node (before torch hears of it)."""
        self._round, self._since, self._next_store = assignment.round, assignment.since, None
        if assignment.rank == 0 and rounds.members_keep_places(spec) \
                and not self.settings.store_port and not self.settings.in_place:
            threading.Thread(target=self._announce_next_store, args=(self._calls, assignment),
                             daemon=True, name=f"elasticrun-next-{self.settings.node_name}"
                             ).start()

    def _announce_next_store(self, call: int, assignment: Assignment) -> None:
        """Rank 0 of a round: start the next round's store and announce it on the request
        the round answered, so that the next round keeps this node's place
        (:func:`~elasticrun.api.rounds.kept_places`) without a new request.

        One write to the node's own Lease, after torchrun's call has returned (it
        waits for the handler's lock); skipped once a later call has begun, whose
        request, not this one, the Lease then carries.  Best effort: without it
        this node asks again when the round re-forms, naming the same store.
        A pinned ``store_port`` serves one store at a time, so it announces none;
        nor does a node in in-place mode, whose agent keeps its exit barrier in the
        store of torchrun's last round while the follower re-forms the rounds
        after it (:class:`~elasticrun.handler.store.RoundStores` keeps one
        round's store beside the current one).
        """
        with self._lock:
            if call != self._calls or self._closing or self._lease is None \
                    or not self._lease.acquired or assignment.store is None \
                    or assignment.since is None:
                return
            try:
                self._serve_store(self.stores.fresh)
                port = self.stores.port
                announced = self._lease.announce(join_request(
                    self.settings, assignment.store.port, assignment.since, port))
            except ApiConnectionError as exc:
                # The write may have landed: the node then waits for the round that keeps
                # its place rather than ask for another at the same store, and asks once
                # the operator's wait is over if no such round comes.
                log.info("%s: announcing the next round's store: %s", self._who(), exc)
                announced = True
            except (RendezvousError, ApiError) as exc:
                log.info("%s: announcing the next round's store: %s", self._who(), exc)
                return
            if announced and port is not None:
                self._next_store = StoreAddress(self.settings.address, port)

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
            if run is None or not self._follower.restart_wanted:
                return 0
            return max(1, rounds.nodes_waiting(run, self._round, now=now()))
        if run is None or self._round == 0:
            return 0
        assert self._session is not None
        return rounds.nodes_waiting(run, self._round, now=now(),
                                    disturbed=self._session.watcher.disturbed(self._round))

    def shutdown(self) -> bool:
        """Leave the membership; never close the run for the others.

        A ``next_rendezvous()`` still blocked in this handler (a spare, say) is
        woken and fails with RendezvousClosedError instead of holding us up.
        """
        self._closing = True
        if self._session is not None:
            self._session.watcher.stop()
        mailbox = self.mailbox
        if mailbox is not None:
            mailbox.stop()
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
                self._leave_membership()
            except RendezvousError as exc:
                log.warning("%s: leaving the membership failed: %s", self._who(), exc)
            self._round_store = None
            if lease is not None:
                lease.release(self.settings.close_timeout)
            self.stores.close()
            self._round, self._since = 0, None
        finally:
            if locked:
                self._lock.release()
        return True

    # ------------------------------------------------------------------ properties

    @property
    def mailbox(self) -> AssignmentWatch | None:
        """The watch of our Lease for assignments (large runs), kept after the call ends."""
        return self._executor.mailbox if self._executor is not None else None

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

    # ------------------------------------------------------------------ set-up

    def _who(self) -> str:
        return who(self.settings)

    def _serve_store(self, start: Callable[[str, int], None]) -> None:
        """Start (or keep) this node's store on its address; one it cannot serve on is
        torch's RendezvousError, naming the run and the node."""
        try:
            start(self.settings.address, self.settings.store_port)
        except StoreAddressError as exc:
            raise RendezvousError(f"{self._who()}: {exc}") from exc

    def _connect(self) -> RunSession:
        if self._session is None:
            gateway = self._gateway
            if gateway is None:
                assert self._client is not None  # made with the handler
                gateway = RunGateway(self._client, self.settings.namespace,
                                     self.settings.run_name)
            self._session = RunSession(self.settings, gateway)
        return self._session

    def _start_lease(self, session: RunSession, run: ElasticRun) -> LeaseKeeper:
        """The keeper of the node's Lease: made once, with the run's timing."""
        if self._lease is None:
            self._lease = LeaseKeeper(session.gateway, self.settings.node_name,
                                      run.spec.heartbeat_timeout, run.spec.lease_renew_interval,
                                      run.uid, on_deleted=session.watcher.recheck)
        return self._lease

    def _round_executor(self, session: RunSession, lease: LeaseKeeper) -> RoundExecutor:
        """The executor of every ``next_rendezvous`` call: made once, after the Lease keeper."""
        if self._executor is None:
            self._executor = RoundExecutor(self.settings, session, lease, self.stores,
                                           lambda: self._closing, self._placed)
        return self._executor

    # ------------------------------------------------------------------ the way out

    def _round_finished(self) -> bool:
        """Whether this node's round passed torch's exit barrier (see :mod:`.exitbarrier`)."""
        store = self._round_store
        return store is not None and exitbarrier.passed(store)

    def _leave_membership(self) -> None:
        """Leave the run's membership, with the proof of the exit barrier where it counts.

        The proof is read from rank 0's store once, and only for a run that does
        not show its end yet (:func:`~elasticrun.api.rounds.leave_needs_proof`):
        the member out first marks the run ``Succeeded`` and then closes its
        store, so the others, reading the run first, find it finished and never
        ask a store that is gone (torch would log the refused connection with
        its stack on every one of them).
        """
        session = self._session
        if session is None:
            return
        node = self.settings.node_name
        proof = functools.cache(self._round_finished)

        def leave(run: ElasticRun) -> RunStatus | None:
            finished = rounds.leave_needs_proof(run.status, node) and proof()
            return rounds.leave(run.status, node, now(), finished=finished)

        change_status(session, leave, self._change_policy(), what="leave the membership")

    def _change_policy(self) -> ChangePolicy:
        """How long the node tries a change of the run on its way out: ``close_timeout``."""
        return ChangePolicy(seconds=self.settings.close_timeout)


def create_handler(params: RendezvousParameters) -> K8sRendezvousHandler:
    """The creator torch registers for ``--rdzv-backend=k8s``."""
    try:
        settings = settings_mod.from_parameters(
            run_id=params.run_id, endpoint=params.endpoint, min_nodes=params.min_nodes,
            max_nodes=params.max_nodes, local_addr=params.local_addr, conf=dict(params.config))
    except settings_mod.SettingsError as exc:
        raise ValueError(f"k8s rendezvous: {exc}") from exc
    return K8sRendezvousHandler(settings)
