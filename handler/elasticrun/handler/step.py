"""What a node does next in ``next_rendezvous``, as a pure function.

:func:`next_action` looks at what the node knows (:class:`Knowledge`: the
newest run it holds, the join requests it listed, its previous round, its join
deadline, until when it leaves sealing to the operator) and the time, and
returns one :class:`Action`.  The handler's executor carries the action out
through the gateway, updates the knowledge, and asks again, until an action
returns a round or raises.  Every decision of
the rendezvous is here, so unit tests reach them without an API server.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from dataclasses import dataclass
from typing import Literal

from elasticrun.api import rounds
from elasticrun.api.model import Assignment, ElasticRun, StoreAddress, WaitingNode
from elasticrun.api.ordering import newer

#: Stagger between nodes that all hold a last-call timer, so that one seals and
#: the rest see its signal before their own timer fires.
LAST_CALL_STAGGER = 0.05
#: Between the turns of a seal that is due at once
#: (:func:`~elasticrun.api.rounds.seal_turn`): the first turn, the node that asked
#: last, seals at once; each later turn is a backup for a first one that died,
#: and it must come after the members' watches delivered a healthy seal, or it
#: loses a compare-and-set and reads the run again.  Measured at 32 nodes on
#: 2 cores (nine rounds twice): the seal took up to 150 ms to reach the last
#: member, so 50 ms turns lost 0 to 21 writes a round, 100 ms turns 0 to 2,
#: and 200 ms none.  A dead first turn costs the round this long.
SEAL_TURN_STEP = 0.2


@dataclass(frozen=True)
class Knowledge:
    """Everything a node's next step depends on, apart from the time."""

    node: str
    #: The newest copy of the run this node holds.
    run: ElasticRun
    #: The round this node belonged to when ``next_rendezvous`` was called (0: none).
    previous_round: int
    #: When ``next_rendezvous`` gives up (monotonic clock).
    join_deadline: float
    #: The join requests no round has answered yet, as last listed from the Leases.
    pending: tuple[WaitingNode, ...] = ()
    #: Whether this call has written its join request yet.
    joined: bool = False
    #: Whether ``pending`` was listed since ``run`` last changed.
    listed: bool = False
    #: When (wall time) the listing of ``pending`` began.
    listed_at: dt.datetime | None = None
    #: Until when (monotonic) this node leaves sealing to the operator and does
    #: not list the Leases; None when it seals itself
    #: (:func:`~elasticrun.api.rounds.nodes_defer_seal`).
    defer_until: float | None = None
    #: The join request this call wrote.
    own: WaitingNode | None = None
    #: The assignment last read from the node's slice (the largest runs:
    #: :func:`~elasticrun.api.rounds.members_told_in_slices`).
    offered: Assignment | None = None
    #: The resourceVersion at which the member's quiet watch saw its previous round
    #: disturbed, when this call began from a copy older than that (:attr:`stale`).
    woken: str | None = None
    #: The join request this node's previous round answered (its ``since`` there): a
    #: newer round answering it again kept the node's place (:attr:`kept`).
    previous_since: dt.datetime | None = None
    #: The store this node announced on that request for the round after its previous
    #: one (rank 0, :func:`~elasticrun.api.rounds.kept_places`), once its Lease says so.
    next_store: StoreAddress | None = None

    def replace(self, **changes: object) -> Knowledge:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @property
    def stale(self) -> bool:
        """Whether ``run`` predates the disturbance of ``previous_round`` that woke this call.

        Such a copy says nothing about what disturbed the round (a loss, this
        node's own removal, a newer round), and its counters are behind: the
        node acts on it only as a member rejoining, which learns its place from
        the run once it settles (or, in the largest runs, in its slice).  Any
        copy read or sent since is at least as new.
        """
        return self.woken is not None and newer(self.woken, self.run.resource_version)

    @property
    def assignment(self) -> Assignment | None:
        """This node's place in a round newer than its previous one, if it has one.

        The run it holds says so, or else its Lease does: either counts when it
        answers the join request of this call (:func:`answers`) and names a
        round newer than any the node knows of.  An assignment of an earlier
        request, or of a round the run has moved past, is stale: the node waits
        with the request it made, which no round has answered yet.
        """
        status = self.run.status
        if status.round > self.previous_round:
            mine = status.assignment(self.node)
            if mine is not None and answers(mine, self.own):
                return mine
        offered, own = self.offered, self.own
        if offered is not None and own is not None and offered.since == own.since \
                and offered.round > max(self.previous_round, status.round):
            return offered
        return None

    @property
    def kept(self) -> Assignment | None:
        """This node's place kept in a newer round: one that answers again the request this
        node's previous round answered (:attr:`previous_since`).

        A sealer that keeps a member's place writes that request
        (:func:`~elasticrun.api.rounds.kept_places`).  Rank 0's place is kept
        only at the store it announced for that round (:attr:`next_store`): any
        other round that answers rank 0's previous request is a status restored
        by hand, not rank 0's to take; a member it places finds that rank 0
        moved on when it checks the round's store.  A node whose wait ran out
        and that asked just as the operator kept its place takes the place all
        the same: the round's other members would wait for it in torch's
        barrier after the rendezvous until the store's timeout.  Its new
        request, still on its Lease, re-forms that round at once (a member
        asking again), so the place is recorded as answering the new request,
        which the next round keeps.
        """
        run = self.run
        if self.previous_since is None or not rounds.members_keep_places(run.spec) \
                or run.status.round <= self.previous_round:
            return None
        mine = run.status.assignment(self.node)
        if mine is None or mine.since != self.previous_since:
            return None
        if mine.rank == 0 and (self.next_store is None or mine.store != self.next_store):
            return None
        if self.joined and self.own is not None:
            return dataclasses.replace(mine, since=self.own.since)
        return mine

    @property
    def requested(self) -> bool:
        """Whether this node's join request is among the pending ones."""
        return any(w.name == self.node for w in self.pending)


def answers(assignment: Assignment, request: WaitingNode | None) -> bool:
    """Whether a round's ``assignment`` answers the join ``request`` of this call.

    Every seal records the request it answers (``since``), so a round that holds
    an earlier one was written from an older round (a hand edit, a restore, the
    repair of a status whose roster was unreadable) or sealed with a request
    that a failed call left on the Lease.  Such a round is no node's to take:
    the other nodes read the newer request on this node's Lease, and a rank 0
    that has moved on makes every member wait for the next round, so this node
    does too.  Without either timestamp the round counts.
    """
    return request is None or assignment.since is None or assignment.since == request.since


@dataclass(frozen=True)
class Closed:
    """The run is closed or finished: withdraw the request, raise RendezvousClosedError."""


@dataclass(frozen=True)
class PodGone:
    """The node's Pod is going (``message``): ask for no round, raise RendezvousClosedError."""

    message: str


@dataclass(frozen=True)
class Join:
    """Write (or write again) this node's join request."""


@dataclass(frozen=True)
class List:
    """List the pending join requests from the run's Leases (one consistent LIST)."""


@dataclass(frozen=True)
class Complete:
    """A round holds this node: hand torch its rank and the store."""

    assignment: Assignment
    #: The node's slice tells it this place: only the operator writes slices, and it
    #: tells none whose store rank 0 did not announce, so the node need not look.
    vouched: bool = False


@dataclass(frozen=True)
class Seal:
    """Compare-and-set the pending requests into the next round."""

    reason: str


@dataclass(frozen=True)
class Announce:
    """Tell the running round's members, once per round, that a node waits."""


@dataclass(frozen=True)
class TimedOut:
    """The join timeout passed: withdraw the request, raise RendezvousTimeoutError."""


@dataclass(frozen=True)
class Read:
    """Read the run afresh, no older than the disturbance that woke the node: its copy is
    stale, and its place may be kept or its wait for its place ran out."""


@dataclass(frozen=True)
class Wait:
    """Wait for the run to change, or until ``until`` (monotonic), then look again."""

    until: float


Action = Closed | PodGone | Join | List | Complete | Seal | Announce | TimedOut | Read | Wait


def next_action(  # noqa: PLR0911 - one return per action, in the order of the rules
        known: Knowledge, now: dt.datetime, clock: float) -> Action:
    """The next step of ``next_rendezvous``; ``now`` is wall time, ``clock`` monotonic.

    In order: a closed run ends the call, and so does the node's removal from its
    previous round because its Pod is going (:func:`~elasticrun.api.rounds.pod_gone`);
    the first step joins; a round that
    holds this node completes it; while the operator seals, the node only makes
    sure a running round hears of it and waits, and a node woken from a stale
    copy (:attr:`Knowledge.stale`) only waits for its place, and past its wait
    reads a fresh copy; otherwise it lists the pending
    requests once per change of the run, makes a request that vanished (its
    Lease removed or expired) again, and applies torch's sealing rules
    (:func:`~elasticrun.api.rounds.decide_seal`) to the listed requests (a
    seal at the end of the last call from a listing made after it; a seal due
    at once in its turn, :func:`~elasticrun.api.rounds.seal_turn`; a node that
    deferred to the operator gives it its wait again from the listing that
    allows the seal, :func:`_operator_ready`); a
    running round hears of us once; past the deadline the call fails; otherwise
    it waits for a change or for the last call (staggered by arrival).
    """
    run, pending = known.run, known.pending
    if run.closed:
        return Closed()
    gone = rounds.pod_gone(run.status, known.node, known.previous_round)
    if gone is not None:
        # Also after joining: a stale copy cannot show the removal, a fresh one does
        # (read when the join found the node's Lease deleted), and the request goes.
        return PodGone(f"{gone.reason}: {gone.message or 'its Pod is gone'}")
    if not known.joined:
        return _first(known, clock)
    assignment = known.assignment or known.kept
    if assignment is not None:
        return Complete(assignment, vouched=assignment == known.offered)
    if known.stale:
        return _rejoining(known, clock)
    if known.defer_until is not None and clock < known.defer_until:
        return _deferring(known, known.defer_until, now, clock)
    if not known.listed:
        return List()
    if not known.requested:
        return Join()
    decision = rounds.decide_seal(run, now, pending)
    if decision.seal_now:
        return _sealing(known, decision, now, clock)
    if rounds.announce_needed(run, now, pending):
        return Announce()
    if clock >= known.join_deadline:
        return TimedOut()
    wake_at = known.join_deadline
    if decision.deadline is not None:
        stagger = LAST_CALL_STAGGER * rounds.arrival_index(run, known.node, pending)
        wait = (decision.deadline - now).total_seconds() + stagger
        wake_at = min(wake_at, clock + max(0.0, wait))
    return Wait(wake_at)


def _first(known: Knowledge, clock: float) -> Action:
    """Before this call's request: take a kept place, wait for one, or ask.

    A member of a re-forming round whose place the operator keeps
    (:func:`~elasticrun.api.rounds.may_keep_place`) writes nothing and waits
    for the seal, for as long as a deferring node gives the operator; past
    that, or once its place can no longer be kept, it asks as every node does.
    A member woken by its quiet watch whose copy still predates the
    disturbance (:attr:`Knowledge.stale`; where places are kept the event
    itself is the whole run, so that is rare) cannot say whether its place can
    be kept (its rank 0 lost?): it reads the run first (:class:`Read`, no older
    than the disturbance) and decides from that copy.
    """
    kept = known.kept
    if kept is not None:
        return Complete(kept)
    if known.defer_until is None:
        return Join()
    until = min(known.defer_until, known.join_deadline)
    if clock >= until or not rounds.may_keep_place(
            known.run, known.node, known.previous_round,
            announced=known.next_store is not None, woken=known.stale):
        return Join()
    return Read() if known.stale else Wait(until)


def _sealing(known: Knowledge, decision: rounds.SealDecision, now: dt.datetime,
             clock: float) -> Action:
    """A seal is due: list once more, wait (for the operator, or for this node's
    turn), or seal."""
    if decision.last_call is not None and (
            known.listed_at is None or known.listed_at < decision.last_call):
        # Joins write Leases, not the run, so a listing made while the window
        # was open misses the nodes that asked later within it.
        return List()
    until = _seal_at(known, decision, now, clock)
    return Seal(decision.reason) if until is None else Wait(until)


def _seal_at(known: Knowledge, decision: rounds.SealDecision, now: dt.datetime,
             clock: float) -> float | None:
    """Until when (monotonic) this node holds back a seal that is due; None: seal now.

    From its listing (for a node that deferred, from when the operator has had
    its wait again, :func:`_operator_ready`), a seal due at once waits for the
    node's turn (:func:`~elasticrun.api.rounds.seal_turn`), so that a node that
    waited out its turn on an unchanged run (no one sealed) seals from that same
    listing.  Past the join deadline sealing still wins: the node seals rather
    than time out.
    """
    start = _operator_ready(known) or known.listed_at
    if start is None or clock >= known.join_deadline:
        return None
    turn = rounds.seal_turn(known.run, known.node, known.pending) \
        if decision.last_call is None else 0
    due = (start - now).total_seconds() + SEAL_TURN_STEP * turn
    if due <= 0:
        return None
    return min(known.join_deadline, clock + due)


def _operator_ready(known: Knowledge) -> dt.datetime | None:
    """When a deferring node whose wait ran out may seal a round its listing found complete.

    Its wait counts from its own start, but the operator can seal only once the
    last request is in, and then tells the members one write each: a node that
    started long before the last one would otherwise seal as the operator does,
    and send every node the whole roster.  So the operator gets
    :func:`~elasticrun.api.rounds.defer_seal_wait` again from the listing that
    found the round complete; a node's own seal after that (fenced by the run it
    holds) loses to the operator's, if it came, and reads its place there.
    """
    if known.defer_until is None or known.listed_at is None:
        return None
    return known.listed_at + dt.timedelta(seconds=rounds.defer_seal_wait(known.run.spec))


def _deferring(known: Knowledge, defer_until: float, now: dt.datetime, clock: float) -> Action:
    """A node that leaves the seal to the operator: it only announces itself, or waits.

    It lists nothing: it goes by its own request, and where the owner gives a
    target (:func:`~elasticrun.api.rounds.target_size`) also by the
    operator's summary of the others (``status.waiting``), since the newcomers
    together decide when the members are told; it wakes when they are due
    (:func:`~elasticrun.api.rounds.announce_due`).  Where members keep their
    places the operator tells them (:func:`~elasticrun.api.rounds.newcomers_defer_announce`).
    """
    run = known.run
    own = (known.own,) if known.own is not None else ()
    seen = own if rounds.target_size(run) is None else (
        *own, *(w for w in run.status.waiting if w.name != known.node))
    if rounds.announce_needed(run, now, seen) \
            and not rounds.newcomers_defer_announce(run.spec):
        return Announce()
    if clock >= known.join_deadline:
        return TimedOut()
    wake_at = min(defer_until, known.join_deadline)
    due = rounds.announce_due(run, now, seen)
    if due is not None:
        wake_at = min(wake_at, clock + max(0.0, (due - now).total_seconds()))
    return Wait(wake_at)


def _rejoining(known: Knowledge, clock: float) -> Action:
    """A member woken from a stale copy (:attr:`Knowledge.stale`): it waits for its place (the
    run as the operator's seal settled it, or in the largest runs its Lease) while the
    operator seals, and past that wait reads the run afresh.

    It never lists against, seals from or announces from that copy: the
    members heard of the disturbance that woke it, and the copy's counters are
    behind it (an announce would fail its test: a 422 and a read).
    """
    if clock >= known.join_deadline:
        return TimedOut()
    if known.defer_until is not None and clock < known.defer_until:
        return Wait(min(known.defer_until, known.join_deadline))
    return Read()


def superseded(  # noqa: PLR0911 - one return per reason
        run: ElasticRun | None, round_number: int, node: str, leader: str | None) -> str | None:
    """Why round ``round_number`` can no longer work for ``node``, or None if it still can.

    A node that is still connecting to its round's store asks this between
    attempts: once the round is over (the leader or this node removed, a newer
    round sealed, the run closed or deleted), waiting for the leader's store is
    pointless and the node joins the next round instead.  A copy of the run
    older than the round (a node told of its round in its slice) says nothing
    against it: whatever ended the round would have reached the node's watch.
    """
    if run is None:
        return "the run was deleted"
    if run.closed:
        return "the run was closed"
    if leader is None:
        return "it has lost its rank 0"
    status = run.status
    if status.round < round_number:
        return None
    if status.round != round_number:
        return f"round {status.round} replaced it"
    if status.participant(node) is None:
        return "this node was removed from it"
    if status.participant(leader) is None:
        return f"its rank 0, {leader}, was removed from it"
    return None


#: In-place mode's answer to a change of the node's round (:func:`in_place_move`).
InPlaceMove = Literal["stay", "follow", "restart"]


def has_newcomers(run: ElasticRun, pending: tuple[WaitingNode, ...]) -> bool:
    """Whether a node outside the current round is waiting to join (its join requests
    from one LIST of the Leases, ``pending``, or the status's waiting list)."""
    members = run.status.member_names
    eligible = rounds.eligible_waiting(run, pending) + rounds.eligible_waiting(run)
    return any(w.name not in members for w in eligible)


def kept_in_newer_round(run: ElasticRun, my_round: int, node: str) -> bool:
    """Whether the run's round, newer than ``my_round``, holds ``node`` among members of
    ``my_round`` only: a round the operator sealed keeping its members' places
    (:func:`~elasticrun.api.rounds.members_keep_places`) before this node's follower
    looked, which the node takes in place (:attr:`Knowledge.kept`)."""
    status = run.status
    if not rounds.members_keep_places(run.spec) or status.round <= my_round \
            or status.participant(node) is None:
        return False
    return all(0 < p.joined_round <= my_round for p in status.participants)


def in_place_move(run: ElasticRun, my_round: int, now: dt.datetime, lost_round: int = 0,
                  newcomers: bool = False, node: str | None = None) -> InPlaceMove:
    """In-place mode: what a member of ``my_round`` does about the run as it is now.

    Nothing (``stay``) unless torchrun would restart the workers without
    in-place mode: ``num_nodes_waiting() > 0`` (a member lost or rejoining, a
    newcomer announced), or the node's own workers reported that their group
    failed in this round (``lost_round``; torchrun would have seen them fail).
    Then ``follow`` (the node's follower joins the next round, the workers
    re-form in place) unless a newcomer is waiting (:func:`has_newcomers`, which
    needs a LIST, so the caller asks only once this says the round must change)
    or a newer round formed without this node (``node``): ``restart``, as
    without in-place mode, because a newcomer's torchrun agent assigns its
    workers' ranks together with every other agent of its round, which a
    follower does not take part in.  A newer round that kept this node's
    place among its old peers (:func:`kept_in_newer_round`; the operator may
    seal it before the follower looks) is followed.
    """
    if my_round <= 0:
        return "stay"
    if lost_round < my_round and rounds.nodes_waiting(run, my_round, now=now) == 0:
        return "stay"
    kept = node is not None and kept_in_newer_round(run, my_round, node)
    if newcomers or (run.status.round > my_round and not kept):
        return "restart"
    return "follow"
