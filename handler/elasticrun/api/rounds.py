"""Pure round logic shared by the handler and the operator.

Everything that decides membership lives here as functions of (run, time), with
no I/O, so that a node sealing a round while the operator is down computes
exactly what the operator would have, and so it can be unit tested.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from elasticrun.api import untrusted
from elasticrun.api.model import (
    FINISHED_PHASES,
    LOST_MEMBERS_KEPT,
    Condition,
    ElasticRun,
    LostMember,
    Participant,
    RunSpec,
    RunStatus,
    StoreAddress,
    WaitingNode,
    next_signal,
    set_condition,
)

#: From this ``maxNodes`` on, nodes leave sealing to the operator (see :func:`nodes_defer_seal`).
DEFER_SEAL_FROM = 64
#: How long a deferring node gives the operator before it lists and seals itself:
#: this much, plus :data:`DEFER_SEAL_PER_NODE` for each of ``maxNodes``.  The
#: base covers the operator's seal after the last join (2 s measured at 2,048
#: nodes); the per-node part one assignment write per member at 100 writes/s,
#: below the slowest rate the operator was measured telling a round (120/s with
#: 2,048 simulated nodes on 2 loaded cores, 260/s less loaded), so that even the
#: member told last hears from the operator before it lists and seals itself.
DEFER_SEAL_BASE = 5.0
DEFER_SEAL_PER_NODE = 0.010
#: From this ``maxNodes`` on, the members of a round watch it quietly
#: (see :func:`members_watch_quietly`).
QUIET_WATCH_FROM = 256
#: From this ``maxNodes`` on, the operator's seal tells members in the run's slices
#: (see :func:`members_told_in_slices`).
TELL_IN_SLICES_FROM = 2048


def nodes_defer_seal(spec: RunSpec) -> bool:
    """Whether waiting nodes leave sealing to the operator, rather than list and seal.

    To seal, a node must know every pending request, which costs it one LIST of
    the run's Leases; if every joiner lists, a round of N nodes makes the API
    server serve N² Leases (at 256 nodes that LIST is most of its work).  The
    operator already holds those Leases in its index, from one watch, so for
    large runs nodes only write their request and wait for the operator's
    seal.  Small runs keep the node's own seal: their LISTs are cheap, and a
    node's seal is one round trip sooner than the operator's.  Either way the
    other side is the backstop: the operator seals what nodes did not, and a
    node lists and seals itself after :func:`defer_seal_wait`, so rounds still
    form without an operator.
    """
    return spec.max_nodes >= DEFER_SEAL_FROM


def defer_seal_wait(spec: RunSpec) -> float:
    """Seconds a deferring node waits for the operator's seal before it lists and seals.

    Long enough for the operator to index ``maxNodes`` join requests on a busy
    machine, short enough that a run whose operator is down still forms.
    """
    return DEFER_SEAL_BASE + DEFER_SEAL_PER_NODE * spec.max_nodes


def members_told_in_slices(spec: RunSpec) -> bool:
    """Whether the operator's seal tells each member its place in the run's slices.

    A seal that moves ``signal`` sends the whole status, roster included, to
    every waiting node's watch: N copies of an O(N) object, the one cost of a
    round that grows as N² (8 MB a round at 256 nodes, 99 MB at 1,024, 387 MB
    at 2,048).  The API server encodes it once for all of them.  Telling the
    members in slices (:mod:`elasticrun.api.slices`) costs the operator one
    write per slice, :data:`~elasticrun.api.slices.SLICE_COUNT` at most, and
    each member a watch of its slice and the connection it holds.  Measured
    on one 2-core machine, where bytes cost nothing on the wire, with one
    write per member instead of slices (scale benchmark's mixed rounds,
    2026-12-07): the broadcast formed 256 nodes in 1.9 s against 2.9-4.5 s,
    1,024 in 8.1-9.9 s against 12.2-13.7 s; at 2,048, 32 slices formed the
    round in 15.0-16.8 s against 22.4-23.6 s with a write per member (a
    prototype, same hour).  So the largest runs, from
    :data:`TELL_IN_SLICES_FROM` nodes, have the operator leave ``signal``
    alone and write each member's place into its slice, which the member
    watches (26 MB a round in all at 2,048): there a seal's 387 MB would
    take seconds on a control plane's network.  What every node must act on
    (a loss, a closed run, a newcomer's notice) still moves ``signal``, and
    so does a seal written by a node (the fallback where the operator is
    down), which cannot write slices.

    Not below 2,048 yet: slices carry no kept place (:func:`members_keep_places`,
    whose rounds a newcomer re-forms in one status write), and on one machine
    they gained no time at 1,024 (compact slices against the broadcast, two
    interleaved formations each, 2026-12-07: 7.3 s and 8.3 s against 7.3 s
    and 6.8 s), though they sent 11 MB against 100 MB.
    """
    return spec.max_nodes >= TELL_IN_SLICES_FROM


def members_watch_quietly(spec: RunSpec) -> bool:
    """Whether a member holding a round watches it quietly, for one bit: "disturbed".

    A member's full watch is sent the whole run each time the signal moves: a
    loss then sends N copies of an O(N) roster before any survivor knows
    (measured at 2,048 nodes: 3.2 s until every survivor knew, 0.9 s quietly).
    From :data:`QUIET_WATCH_FROM` nodes a member of round R watches its
    metadata only, for ``status.stableRound`` off R (about 1 kB an event at any
    size), and once woken waits for the run to settle
    (:meth:`~elasticrun.handler.session.RunSession.follow`), so it is sent the
    whole run once a round, with the next seal.  Where members keep their
    places (:func:`members_keep_places`) the event is the whole run, which the
    member needs to find its place: one copy a round all the same.
    """
    return spec.max_nodes >= QUIET_WATCH_FROM


#: How many renewal intervals a member may go unseen by the sealer and still keep its
#: place (:func:`keep_window`).
KEEP_RENEWALS = 2


def keep_window(spec: RunSpec) -> float:
    """Seconds since the sealer last saw a member's Lease renewed within which it keeps
    the member's place (:func:`kept_places`): a live member renews once an interval, and
    the window lets one renewal be late."""
    return KEEP_RENEWALS * spec.lease_renew_interval


def members_keep_places(spec: RunSpec) -> bool:
    """Whether the members of a re-forming round keep their places without asking again.

    Where the operator seals (:func:`nodes_defer_seal`), a disturbed round used
    to wait for every member to write a new request on its Lease and for all N
    to reach the operator: at 64 and 128 nodes a newcomer's round took 11 and
    18 times the floor's newcomer, nearly all of it those N writes.  A member
    whose workers torchrun restarts is coming back, and the operator sees its
    Lease renewed: so the operator seals the next round as soon as it must
    form (:func:`nodes_waiting`), every member it saw renew keeping its place
    and rank (:func:`kept_places`).  The next round needs a fresh store (a
    store that outlives its round hands new workers the addresses of old ones,
    pytorch/pytorch#135712, :class:`~elasticrun.handler.store.RoundStores`):
    rank 0 starts it as soon as a round holds it, and announces it on its
    request (``nextStorePort``); until the operator has seen that, rank 0 asks
    again with that store, and the round seals once it has.  Each member,
    waiting meanwhile instead of writing (:func:`may_keep_place`), knows its
    kept place by the request its previous round answered.  A member woken by
    its quiet watch (:func:`members_watch_quietly`) learns only that its round
    is disturbed, not whether it lost its rank 0, in which case nothing can be
    kept: so where places are kept that watch sends the whole run, encoded
    once for all members, and the member decides from it as every other
    member does from the run it holds (a member left with an older copy reads
    the run first, no older than the disturbance).  The operator's seal that
    keeps places is often the disturbance itself (the loss and the seal in
    one status write), whose event then holds the member's place.  Not where
    the operator tells
    members in slices (:func:`members_told_in_slices`): its seal writes the
    round's slices all the same.

    A place kept for a member that froze shortly before would hold every
    other agent in torch's barrier after the rendezvous (its store waits for
    each agent's part) until the store's timeout.  So places are kept only
    where the heartbeat spans the :func:`keep_window` and one renewal more:
    nodes that stopped together (a switch, a rack) are found lost when the
    first of them passes the heartbeat, and the others have missed two
    renewals by then, so none of them is kept.  Shorter heartbeats keep no
    place (the CRD's defaults, 15 s and 5 s, span three renewals and do).
    """
    return nodes_defer_seal(spec) and not members_told_in_slices(spec) \
        and spec.heartbeat_timeout >= keep_window(spec) + spec.lease_renew_interval


def may_keep_place(run: ElasticRun, node: str, previous_round: int, *,
                   announced: bool = False, woken: bool = False) -> bool:
    """Whether ``node``, a member of ``previous_round``, waits for the seal to keep its
    place rather than ask again (:func:`members_keep_places`).

    Only while the round it held is the run's current one and disturbed
    (``stableRound`` 0: a loss, a restart, an announced node), still holds the
    node, which is not held back, and still has its rank 0.  ``woken``: the
    node's quiet watch said that the round is disturbed, which ``run``, a copy
    from before, cannot show (its round is stable there); the node then reads
    the run, and decides again from that copy (:func:`members_keep_places`).
    Rank 0 itself
    waits only once its Lease announces the next round's store (``announced``);
    before that it asks again, naming that store.  A member whose own workers
    failed in a round nothing else disturbed asks again: its request is what
    tells the others.
    """
    status = run.status
    if not members_keep_places(run.spec) or run.closed or previous_round <= 0 \
            or status.round != previous_round \
            or status.stable_round != (previous_round if woken else 0):
        return False
    me = status.participant(node)
    return me is not None and (me.rank != 0 or announced) and status.leader is not None \
        and not run.held_back((me,))


def kept_places(run: ElasticRun, live: Collection[str], now: dt.datetime,
                waiting: Waiting = None, leader_next: StoreAddress | None = None
                ) -> list[WaitingNode]:
    """The members whose places the next round keeps, as waiting entries (none: ask again).

    Once the round must form again (:func:`nodes_waiting`: a loss, a member's
    new request, a newcomer due) and its rank 0 either asks again (its request
    among ``waiting``) or is in ``live`` and announced the next round's store
    (``leader_next``, from the request its membership answered), every
    member that is in ``live``, not held back and not asking itself keeps its
    place: an entry with the request its membership answered (``since``), so
    that the next round answers that request again, which is how the member
    tells its kept place from a stale round
    (:attr:`elasticrun.handler.step.Knowledge.kept`); its old rank is kept by
    :func:`order_for_ranks`, and a kept rank 0's entry names ``leader_next``,
    the next round's store.  ``live``: the members the sealer saw renew their
    Leases within the :func:`keep_window`, by its own clock: only the operator
    knows (:func:`members_keep_places`).  A kept member
    counts as back from ``now``, never earlier: a member neither kept nor
    asking holds the seal back until it asks or is lost, as it would if every
    member had to ask, instead of finding the round's last call long over.
    """
    status = run.status
    leader = status.leader
    if not members_keep_places(run.spec) or run.closed or leader is None:
        return []
    asking = {w.name for w in eligible_waiting(run, waiting)}
    held = run.held_back(status.participants)
    if leader not in asking and (
            leader_next is None or leader not in live or leader in held
            or nodes_waiting(run, status.round, waiting, now=now) == 0):
        return []
    kept = [WaitingNode(name=p.name, since=p.since, pod=p.pod, pod_uid=p.pod_uid, noticed=now)
            for p in status.participants
            if p.name in live and p.name not in asking and p.name not in held]
    if leader_next is None:
        return kept
    return [dataclasses.replace(w, address=leader_next.host, store_port=leader_next.port)
            if w.name == leader else w for w in kept]


@dataclass(frozen=True)
class SealDecision:
    """Whether the waiting set should become the next round, or when to look again."""

    seal_now: bool
    reason: str
    #: When to look again (no seal yet).
    deadline: dt.datetime | None = None
    #: For a seal that rests on the last call: when that call ended.  torch's
    #: promise is that every node that asked within it is in the round, so a
    #: sealer counts the requests it listed at or after this moment, never an
    #: older listing (:func:`elasticrun.handler.step.next_action`).
    last_call: dt.datetime | None = None


Waiting = Sequence[WaitingNode] | None
"""The join requests a decision is about.  ``None`` means the run's stored
``status.waiting``; a node passes the requests it listed from the Leases, which
are newer than the stored summary."""


def _waiting(run: ElasticRun, waiting: Waiting) -> Sequence[WaitingNode]:
    return run.status.waiting if waiting is None else with_topology(waiting, run.status.waiting)


def with_topology(listed: Sequence[WaitingNode], stored: Sequence[WaitingNode]
                  ) -> Sequence[WaitingNode]:
    """The listed join requests, each with the topology values of the run's stored
    waiting entry for the same node and Pod (name and podUID).

    ``status.waiting[].topology`` is the one home of a waiting node's topology:
    only the operator can read Nodes, so it fills the values into the entry it
    summarises, and a node sealing from the join requests it listed (which
    never carry topology) takes them from there.  An entry of another Pod of
    the same name gives nothing.
    """
    known = {(w.name, w.pod_uid): w.topology for w in stored if w.topology}
    if not known:
        return listed
    return [w if w.topology or (w.name, w.pod_uid) not in known
            else dataclasses.replace(w, topology=known[(w.name, w.pod_uid)]) for w in listed]


def eligible_waiting(run: ElasticRun, waiting: Waiting = None) -> list[WaitingNode]:
    """Waiting nodes that may be admitted (drained nodes and nodes on an excluded pod stay
    waiting, unadmitted: :meth:`ElasticRun.held_back`)."""
    entries = _waiting(run, waiting)
    held = run.held_back(entries)
    return [w for w in entries if w.name not in held]


def target_size(run: ElasticRun) -> int | None:
    """How many nodes a round should hold, as the owner of the run's pods says; None: no say.

    ``min(desired, maxNodes)`` when the operator wrote ``status.desired`` and
    it reaches ``minNodes``; a desired size below ``minNodes`` cannot form a
    round, so it is ignored and today's rules stand (the operator reports it
    on the run).  The size is capped at ``maxNodes``: an owner asking for more
    than the run admits makes spares, never a larger round.
    """
    desired = run.status.desired
    if desired is None or desired.size < run.spec.min_nodes:
        return None
    return min(desired.size, run.spec.max_nodes)


def _arrivals(nodes: Iterable[WaitingNode], now: dt.datetime) -> list[dt.datetime]:
    """When each request was made, by the reader's clock where it noticed it, never later
    than ``now``, earliest first."""
    return sorted(min(w.asked_at or now, now) for w in nodes)


def announce_due(run: ElasticRun, now: dt.datetime, waiting: Waiting = None
                 ) -> dt.datetime | None:
    """When the members of the running round are to hear of the newcomers; None: no rule holds them.

    With a target (:func:`target_size`), the members of a healthy round
    restart once for all the new nodes: the newcomers are held back until
    members + newcomers reach the target, or until the last call, counted from
    when the first of them was noticed, has passed, whichever comes first.
    None when there is no target, no healthy round, no newcomer, or the round
    is full (spares beyond ``maxNodes`` never restart it): today's rules.
    """
    status = run.status
    target = target_size(run)
    if target is None or status.round == 0 or status.degraded \
            or len(status.participants) >= run.spec.max_nodes:
        return None
    members = status.member_names
    arrivals = _arrivals((w for w in eligible_waiting(run, waiting) if w.name not in members),
                         now)
    if not arrivals:
        return None
    window = arrivals[0] + dt.timedelta(seconds=run.spec.last_call_timeout)
    needed = max(1, target - len(members))
    if len(arrivals) >= needed:
        return min(arrivals[needed - 1], window)
    return window


def decide_seal(  # noqa: PLR0911 - one return per rule, in their order
        run: ElasticRun, now: dt.datetime, waiting: Waiting = None) -> SealDecision:
    """torch's rules, with survivors first, fast paths, and the owner's target.

    * every remaining member of the current round is waiting again, and there are
      at least ``minNodes``: seal at once.  Waiting out the last call here would
      only add the whole window to every recovery and scale-up.
    * no current round (or none of it left) and ``maxNodes`` waiting, or the
      owner's target (:func:`target_size`): seal at once.
    * beside a healthy round whose members are not told of the newcomers yet
      (:func:`announce_due`): no seal before they are; from then on a last call
      of its own, so members who restart at the announcement keep their places.
      Spares beside a full, healthy round never seal one of their own: they
      wait for it to re-form.
    * otherwise, with ``minNodes`` waiting: seal once the last-call window, counted
      from the moment the ``minNodes``-th node arrived, has passed.  While members
      of the current round are still on their way back, spares do not take their
      places just because they were quicker: survivors keep priority, for a last
      call counted from when the round began to re-form (:func:`_reforming_since`).
    """
    spec, status = run.spec, run.status
    if run.closed:
        return SealDecision(False, "run is closed")
    eligible = eligible_waiting(run, waiting)
    count = len(eligible)
    announced = announce_due(run, now, waiting)
    if count < spec.min_nodes:
        # Not enough for a round, but the members may have to hear of the newcomers.
        return SealDecision(False, f"{count} of at least {spec.min_nodes} nodes waiting",
                            announced if announced is not None and now < announced else None)
    members = status.member_names - run.held_back(status.participants) if status.round > 0 \
        else frozenset()
    names = {w.name for w in eligible}
    if members and members <= names:
        return SealDecision(True, f"all {len(members)} remaining members of round "
                                  f"{status.round} are back")
    if not members and count >= spec.max_nodes:
        return SealDecision(True, f"maxNodes ({spec.max_nodes}) reached")
    target = target_size(run)
    if not members and target is not None and count >= target:
        return SealDecision(True, f"the desired size ({target}) has joined")
    deadline = _arrivals(eligible, now)[spec.min_nodes - 1] \
        + dt.timedelta(seconds=spec.last_call_timeout)
    if members and announced is not None:
        if now < announced:
            return SealDecision(False, "newcomers held for the desired size", announced)
        deadline = max(deadline, announced + dt.timedelta(seconds=spec.last_call_timeout))
    reforming = _reforming_since(status, [w for w in eligible if w.name in members], now)
    if members and reforming is not None:
        deadline = max(deadline, reforming + dt.timedelta(seconds=spec.last_call_timeout))
    if members and not members & names and not status.degraded \
            and len(status.participants) >= spec.max_nodes:
        # A full, healthy round is never told of spares (nodes_waiting), so while none
        # of its members is back its members are training: a round sealed now would be
        # the spares alone, superseding every healthy member, whose rejoin would in
        # turn supersede the spares, round after round.  Once a member is back the
        # round is re-forming, and the last call below bounds the wait for the rest.
        return SealDecision(False, f"round {status.round} is full and healthy: spares wait "
                                   "for it to re-form")
    if now >= deadline:
        return SealDecision(True, f"last call ({spec.last_call_timeout}s) passed with {count} "
                                  "nodes", last_call=deadline)
    return SealDecision(False, "last call", deadline)


def _reforming_since(status: RunStatus, back: Sequence[WaitingNode], now: dt.datetime
                     ) -> dt.datetime | None:
    """When the running round began to re-form: its first loss, or the first of its
    members to ask again, whichever came first; None when neither happened.

    The members learn of it then (a loss moves the signal; a member whose
    workers failed took the others' collective down with it), and their agents
    ask again within a moment.  Spares waiting since long before must not seal
    in their place just because the spares' own last call passed long ago, or
    the members' return would supersede that round at once.  A loss's time is
    the remover's clock (the operator's or a member's): one in the future
    counts as no time at all, so a skewed clock can shorten the members'
    grace, never hold a round back.
    """
    losses = [m.time for m in status.lost_members
              if status.degraded and m.round == status.round
              and m.time is not None and m.time <= now]
    returns = _arrivals(back, now)
    return min([*losses, *returns[:1]], default=None)


def arrival_key(node: WaitingNode) -> tuple[dt.datetime, str]:
    """Newcomers' order: when the API server created their Lease, then the name.

    ``since`` is what the node itself claims, so it only stands in for entries
    read back from the status summary (which carries no server time).
    """
    return (node.arrived or node.since or untrusted.LATEST, node.name)


def newcomer_key(node: WaitingNode) -> tuple[bool, int, bool, tuple[str, ...],
                                             tuple[dt.datetime, str]]:
    """Newcomers' order: by pod index, then by topology, then by arrival (:func:`arrival_key`).

    Indexed nodes come first, lowest index first (a workload numbers its pods
    the way its scheduler placed them: Kueue's topology-aware scheduling gives
    consecutive indexes to one domain); then nodes without an index, grouped
    by their topology values (nodes whose domain is unknown last); ties by
    arrival, then name, so the order is total and every reader computes it.
    """
    return (node.index is None, node.index or 0, not node.topology, node.topology,
            arrival_key(node))


def order_for_ranks(previous: Iterable[Participant], waiting: Iterable[WaitingNode],
                    size: int | None = None) -> list[WaitingNode]:
    """The waiting nodes in rank order: the first ``size`` (all by default) are the
    round's ranks 0..size-1, the rest, in order, are spares.

    Who is admitted: survivors (members of ``previous``) first, by old rank,
    then newcomers by :func:`newcomer_key`, up to ``size``.  Without a
    survivor (a first round, or every member gone) the ranks are that order:
    consecutive indexes stay consecutive even when some index is missing.
    With survivors, each admitted node's rank comes from three passes over
    the round's slots 0..size-1:

    1. every survivor takes its old rank, where that rank is a slot of the new
       round (so the old rank 0 stays rank 0 whenever it is alive, and keeps
       hosting the store; torch's lexicographic order does not promise that,
       pytorch/pytorch#67615);
    2. every indexed newcomer, in key order, takes the slot of its index where
       that slot is still free: a replacement for a lost member of the same
       index gets the lost member's rank back, when ranks were given by index;
    3. the rest (survivors whose old rank is beyond the new size, then
       newcomers whose slot was taken or out of range, or who have no index),
       in the order above, fill the free slots from the lowest up.

    A duplicate index or a rank claimed twice goes to the first claimant in
    this order; the others are placed in pass 3, so ranks are always 0..size-1.
    """
    old_rank = {p.name: p.rank for p in previous}
    waiting = list(waiting)
    survivors = sorted((w for w in waiting if w.name in old_rank),
                       key=lambda w: (old_rank[w.name], w.name))
    newcomers = sorted((w for w in waiting if w.name not in old_rank), key=newcomer_key)
    queue = survivors + newcomers
    if not survivors:
        return queue
    slots = len(queue) if size is None else max(0, min(size, len(queue)))
    ranked: list[WaitingNode | None] = [None] * slots
    unplaced: list[WaitingNode] = []
    for node in queue[:slots]:
        wanted = old_rank.get(node.name, node.index)
        if wanted is not None and 0 <= wanted < slots and ranked[wanted] is None:
            ranked[wanted] = node
        else:
            unplaced.append(node)
    fill = iter(unplaced)
    ordered = [node if node is not None else next(fill) for node in ranked]
    return ordered + queue[slots:]


def seal_round(run: ElasticRun, now: dt.datetime, waiting: Waiting = None,
               in_slices: bool = False) -> RunStatus:
    """The status after moving up to ``maxNodes`` waiting nodes into a new round.

    The nodes not admitted stay in ``status.waiting``.  A member's entry holds
    what readers of the roster need (name, rank, round joined, Pod, the request
    it answered); the round's one address, rank 0's store, is ``status.store``.
    ``in_slices``: the sealer tells the members in the run's slices
    (:func:`members_told_in_slices`), so ``signal`` stays; otherwise every node
    receives the whole status with the seal.
    """
    status = run.status
    ordered = order_for_ranks(status.participants, eligible_waiting(run, waiting),
                              run.spec.max_nodes)
    admitted = ordered[: run.spec.max_nodes]
    admitted_names = {w.name for w in admitted}
    new_round = status.round + 1
    joined = {p.name: p.joined_round for p in status.participants}
    participants = tuple(
        Participant(
            name=w.name,
            rank=rank,
            joined_round=joined.get(w.name, new_round),
            pod=w.pod,
            since=w.since,
            pod_uid=w.pod_uid,
        )
        for rank, w in enumerate(admitted)
    )
    leader = admitted[0]
    store = (StoreAddress(leader.address, leader.store_port)
             if leader.address and leader.store_port else None)
    sealed = status.replace(
        phase="Running",
        round=new_round,
        signal=status.signal if in_slices else next_signal(status.signal),
        participants=participants,
        waiting=tuple(w for w in _waiting(run, waiting) if w.name not in admitted_names),
        store=store,
        sealed_at=now,
    )
    return sealed.replace(conditions=round_conditions(sealed, now, run.generation))


#: A member's agent shut down without proof that its round finished training
#: (its workers failed for good, or it stopped before the round's exit barrier).
LEFT = "Left"
#: A member's agent shut down after its round's exit barrier: torch's agents pass
#: it only once every member's workers succeeded, so the run succeeded.
FINISHED = "Finished"
#: What the operator saw of a member's Pod (``elasticrun.operator.liveness``).
POD_DELETED = "PodDeleted"
POD_DISRUPTED = "PodDisrupted"
POD_FAILED = "PodFailed"
POD_SUCCEEDED = "PodSucceeded"
CONTAINER_TERMINATED = "ContainerTerminated"
CONTAINER_RESTARTED = "ContainerRestarted"
#: A member's Lease was not renewed for the heartbeat, or is gone.
LEASE_EXPIRED = "LeaseExpired"
LEASE_MISSING = "LeaseMissing"
#: A member named in the run's drain annotation, or on a Node whose signal drains.
DRAINED = "Drained"
NODE_DRAINING = "NodeDraining"
#: A node whose join request the repair of an unreadable status recorded as spent
#: (``elasticrun.operator.reconcile.repair``): it asks again.
STATUS_UNREADABLE = "StatusUnreadable"
#: Reasons of a member that went away on its own, not lost to a failure.
DEPARTURES = (LEFT, FINISHED, POD_SUCCEEDED)
#: Pod losses after which that Pod (that uid) never runs a container again: it is
#: being deleted, evicted, or has ended.  A container that terminated or restarted
#: may run again in the same Pod.
POD_GONE = frozenset({POD_DELETED, POD_DISRUPTED, POD_FAILED, POD_SUCCEEDED})
#: A rank 0 taken out of its round because its store did not answer and its Lease
#: stayed quiet for the suspicion window (removed by a member or the operator).
LEADER_LOST = "StoreUnreachable"
#: Losses read from the run's Leases (one not renewed, one missing, rank 0's reported
#: silent): the operator decides them from a consistent listing of the Leases, not
#: from the index its watch keeps, which may lag behind the run.
LEASE_LOSSES = frozenset({LEASE_EXPIRED, LEASE_MISSING, LEADER_LOST})
#: Every reason elasticrun itself records in ``status.lostMembers``; the status is
#: writable by nodes, so a reader bounds what it does with any other value.
LOSS_REASONS = frozenset({
    POD_DELETED, POD_DISRUPTED, POD_FAILED, POD_SUCCEEDED, CONTAINER_TERMINATED,
    CONTAINER_RESTARTED, LEASE_EXPIRED, LEASE_MISSING, LEADER_LOST, LEFT, FINISHED,
    DRAINED, NODE_DRAINING, STATUS_UNREADABLE})

#: The phase of a run closed by ``spec.closed`` (torch's ``set_closed``).
CLOSED = "Closed"
#: The condition a closed run carries, and its reason while ``spec.closed`` holds.
CLOSED_CONDITION = "Closed"
CLOSED_BY_SPEC = "ClosedBySpec"
#: The condition that says whether the round is complete, and its reason in a closed run.
ROUND_COMPLETE = "RoundComplete"
ROUND_CLOSED = "Closed"
#: Its reasons while the run is not closed: the round is sealed, or being re-formed.
ROUND_SEALED = "Sealed"
ROUND_REFORMING = "Reforming"
#: The condition that says whether a member of the round is lost, and its reasons.
DEGRADED = "Degraded"
ALL_MEMBERS_ALIVE = "AllMembersAlive"
MEMBER_LOST = "MemberLost"
RESTART_REQUESTED = "RestartRequested"


def round_conditions(status: RunStatus, now: dt.datetime, generation: int
                     ) -> tuple[Condition, ...]:
    """``status``'s conditions with what they say of its round, for ``kubectl describe``.

    ``RoundComplete`` and ``Degraded``, while the run is ``Running`` or
    ``Degraded``, observed at the run's ``generation``; other conditions, and
    those of other phases, as they are.  A seal writes them with its round, so
    that no second write follows each seal only to report it; the operator
    keeps them true after every other change.
    """
    conditions = status.conditions
    if status.phase == "Running":
        conditions = set_condition(conditions, ROUND_COMPLETE, True, ROUND_SEALED,
                                   f"round {status.round}: {len(status.participants)} members, "
                                   f"rank 0 = {status.leader or '-'}", now, generation)
        conditions = set_condition(conditions, DEGRADED, False, ALL_MEMBERS_ALIVE,
                                   f"all members of round {status.round} are alive", now,
                                   generation)
    elif status.phase == "Degraded":
        last = status.lost_members[-1] if status.lost_members else None
        lost_now = last is not None and last.round == status.round
        why = f"{last.name}: {last.reason}" if last is not None and lost_now \
            else "restart requested"
        conditions = set_condition(conditions, ROUND_COMPLETE, False, ROUND_REFORMING,
                                   f"round {status.round} is being re-formed ({why})", now,
                                   generation)
        conditions = set_condition(conditions, DEGRADED, True,
                                   MEMBER_LOST if lost_now else RESTART_REQUESTED,
                                   f"round {status.round}: {why}", now, generation)
    return conditions


def close(run: ElasticRun, now: dt.datetime) -> RunStatus | None:
    """The status of a run closed for every node; None when it is finished already.

    The one rule for whoever closes the run: a node (torch's ``set_closed``,
    after it set ``spec.closed``) or the operator (on ``spec.closed``).  The
    phase becomes :data:`CLOSED`, ``finishedAt`` is ``now`` (the TTL after
    finishing counts from here) and the signal moves, so waiting nodes hear it
    even with no operator; the conditions say why, for ``kubectl describe``,
    observed at the run's generation.  A finished run (closed already, or
    ``Succeeded``) stays as it is: closing a run that succeeded changes
    nothing about it.
    """
    status, generation = run.status, run.generation
    if status.phase in FINISHED_PHASES:
        return None
    conditions = set_condition(status.conditions, CLOSED_CONDITION, True, CLOSED_BY_SPEC,
                               "spec.closed is true: waiting and late nodes are refused",
                               now, generation)
    conditions = set_condition(conditions, ROUND_COMPLETE, False, ROUND_CLOSED,
                               "the run is closed", now, generation)
    return status.replace(phase=CLOSED, signal=next_signal(status.signal), finished_at=now,
                          conditions=conditions, observed_generation=generation)


def leave(status: RunStatus, name: str, now: dt.datetime, *, finished: bool
          ) -> RunStatus | None:
    """The status after member ``name``'s agent shut down; None when nothing changes.

    A finished run stays as it is: the members that leave after the first
    one's success leave nothing to re-form.  A member that passed its round's
    exit barrier (``finished``) proves that every member's workers succeeded,
    so the run is ``Succeeded`` at once, its signal moved: a spare still
    waiting exits without running a round, and no member is told to restart.
    The finished round keeps its roster (what ``kubectl get er`` shows of a
    finished run); the member that proved it is recorded as :data:`FINISHED`.
    Otherwise the member is removed (:data:`LEFT`) like any loss, and its
    round re-forms.
    """
    if status.phase in FINISHED_PHASES:
        return None
    member = status.participant(name)
    if not finished or member is None:
        return remove_member(status, name, LEFT, now, message="the agent shut down")
    done = LostMember(name=name, round=status.round, reason=FINISHED, time=now,
                      since=member.since,
                      message="the agent shut down after its round's exit barrier")
    return status.replace(
        phase="Succeeded",
        signal=next_signal(status.signal),
        finished_at=now,
        lost_members=(*status.lost_members, done)[-LOST_MEMBERS_KEPT:],
    )


def leave_needs_proof(status: RunStatus, name: str) -> bool:
    """Whether :func:`leave` of ``name`` turns on its proof that its round passed the exit
    barrier: only for a member of a run that has not ended."""
    return status.phase not in FINISHED_PHASES and status.participant(name) is not None


def remove_member(status: RunStatus, name: str, reason: str, now: dt.datetime,
                  message: str | None = None,
                  detection_seconds: float | None = None,
                  in_round: int | None = None) -> RunStatus | None:
    """The status without ``name``; None when it is neither member nor waiting, or
    when the removal is meant for round ``in_round`` and the run is in another one.

    Removing a member marks the round for restart and bumps the signal, which is
    what makes every survivor's ``num_nodes_waiting()`` positive.  ``in_round``
    ties a removal to the round its evidence is about (a rank 0 whose store did
    not answer in that round): once the round was replaced, there is nothing
    to remove it from.
    """
    if in_round is not None and status.round != in_round:
        return None
    member = status.participant(name)
    waiting = status.waiting_node(name)
    if member is None and waiting is None:
        return None
    lost = LostMember(name=name, round=status.round, reason=reason, message=message, time=now,
                      detection_seconds=detection_seconds,
                      since=member.since if member is not None else
                      waiting.since if waiting is not None else None)
    remaining_waiting = tuple(w for w in status.waiting if w.name != name)
    if member is None:
        return status.replace(waiting=remaining_waiting)
    return status.replace(
        phase="Degraded",
        participants=tuple(p for p in status.participants if p.name != name),
        waiting=remaining_waiting,
        restart_round=status.round,
        # Members were already told when the round first lost someone; telling
        # them again for every further loss would make a mass exit quadratic.
        signal=status.signal if status.degraded else next_signal(status.signal),
        lost_members=(*status.lost_members, lost)[-LOST_MEMBERS_KEPT:],
    )


def request_restart(status: RunStatus) -> RunStatus | None:
    """Mark the current round for re-formation (forced round, drain); None if nothing runs."""
    if status.round == 0 or status.degraded:
        return None
    return status.replace(phase="Degraded", restart_round=status.round,
                          signal=next_signal(status.signal))


def nodes_waiting(run: ElasticRun, my_round: int, waiting: Waiting = None, *,
                  now: dt.datetime, disturbed: bool = False) -> int:
    """What ``num_nodes_waiting()`` reports to a member of ``my_round`` at ``now``.

    A round that lost a member or was superseded reports at least one waiting
    node: that is the only hook that makes a healthy torch agent restart its
    workers, so survivors re-form at once instead of hanging in a collective
    (pytorch/pytorch#111646).  Spares beyond ``maxNodes`` are not counted while
    the round is full, or the members would restart forever; newcomers held for
    the owner's target (:func:`announce_due`) are not counted before they are due,
    so the members restart once for all of them.  ``disturbed``: the member's
    quiet watch said that ``status.stableRound`` moved off ``my_round``
    (:attr:`~elasticrun.api.model.RunStatus.stable_round`: lost a member, a node
    announced, superseded), which ``run``, a copy from before, cannot show.
    """
    status = run.status
    if run.closed:
        # A closed or finished run admits nobody: a restart would only fail.
        return 0
    if disturbed:
        return max(1, len(eligible_waiting(run, waiting)))
    if my_round > status.round:
        # Told of its round in its slice: this copy predates the round, and
        # anything that happened to the round since would have moved the signal,
        # or, watched quietly, ``disturbed``.
        return 0
    eligible = eligible_waiting(run, waiting)
    if my_round and status.stable_round != my_round:
        # Superseded, lost a member, or a node announced that it is waiting.
        return max(1, len(eligible))
    members = status.member_names
    rejoining = sum(1 for w in eligible if w.name in members)
    newcomers = len(eligible) - rejoining
    has_room = len(status.participants) < run.spec.max_nodes
    due = announce_due(run, now, waiting)
    told = due is None or now >= due
    return rejoining + (newcomers if has_room and told else 0)


def arrival_index(run: ElasticRun, node: str, waiting: Waiting = None) -> int:
    """``node``'s place in the rank order of the next round (last if it is not waiting)."""
    ordered = order_for_ranks(run.status.participants, _waiting(run, waiting))
    names = [w.name for w in ordered]
    return names.index(node) if node in names else len(names)


def pod_gone(status: RunStatus, node: str, round_number: int) -> LostMember | None:
    """How ``node``'s membership of ``round_number`` ended, if it ended with its Pod gone.

    The operator removes a member whose Pod is deleted as soon as it sees the
    deletion, which moves the signal: the member's own agent sees that too,
    before the kubelet stops it, and would ask for the next round.  Its Pod
    is going, so its request is not made: a round sealed with it would break
    again when its container stops, and restart every survivor a second time.
    """
    if round_number <= 0:
        return None
    return next((m for m in reversed(status.lost_members)
                 if m.name == node and m.round == round_number and m.reason in POD_GONE),
                None)


#: Nodes that may try an immediate seal before the rest (:func:`seal_turn`).
SEAL_TURNS = 3


def seal_turn(run: ElasticRun, node: str, waiting: Waiting = None) -> int:
    """``node``'s turn to try a seal that is due at once, 0 first, at most :data:`SEAL_TURNS`.

    When a round is complete every node that lists the requests sees it, and
    nodes started together list at once: if each of them compared-and-set,
    all but one would lose (a 409 and a read each).  The node that asked last
    is the one whose listing is surely complete, so it goes first, and the
    others take turns after it by how recently they asked, each a moment
    later, and usually find the round already sealed.  Turns are counted on
    the revision of the Lease that carries each request (``written``): the
    API server's order of the writes, the same for every reader of one
    listing, so the first turn is the node whose request was written last
    and whose own listing, made after it, holds every other.  ``since``, the
    time each node claims, orders only entries read without a revision (the
    status summary): two nodes' clocks can put their requests the other way
    round, and then the node the server wrote last waited out a turn.
    Capped, so that nodes beyond the first few share the last turn: a node
    that asked and then died delays the round by a few turns at most.
    """
    entries = sorted(eligible_waiting(run, waiting), key=_turn_key, reverse=True)
    names = [w.name for w in entries]
    return min(names.index(node), SEAL_TURNS) if node in names else SEAL_TURNS


def _turn_key(node: WaitingNode) -> tuple[int, dt.datetime, str]:
    return (-1 if node.written is None else node.written,
            node.since or node.arrived or untrusted.EARLIEST, node.name)


def announced(status: RunStatus) -> RunStatus:
    """``status`` once the members of its round are told that a node waits: ``joinNotice``
    set to the round, the signal moved (what a waiting node's announce patch writes,
    :func:`elasticrun.api.gateway.announce_patch`, and the operator where places are
    kept, :func:`newcomers_defer_announce`)."""
    return status.replace(join_notice=status.round, signal=next_signal(status.signal))


def newcomers_defer_announce(spec: RunSpec) -> bool:
    """Whether a waiting node leaves telling the members to the operator while it defers.

    Where members keep their places (:func:`members_keep_places`), the
    operator seals the round a newcomer's request re-forms as soon as the
    request is in; a notice written before that seal sends every member the
    whole run once more, just ahead of the seal, which it delays (measured at
    64 nodes: the notice's fan-out, then the seal's write 50 ms later).  So
    there the operator announces the newcomer itself, only when it cannot
    seal at once (rank 0 has not announced the next round's store yet, a
    member it cannot keep), and a newcomer announces itself only once its
    wait for the operator is over, as where no operator runs.
    """
    return members_keep_places(spec)


def announce_needed(run: ElasticRun, now: dt.datetime, waiting: Waiting = None) -> bool:
    """Whether a waiting node should tell the members of the running round about itself.

    Once per round (``joinNotice``), not while the round already re-forms, not
    for a spare beside a full round (its members would have nothing to do),
    and not before the newcomers held for the owner's target are due
    (:func:`announce_due`).
    """
    status = run.status
    if status.stable_round == 0:
        # No round, or it is disturbed already: it re-forms, or it was announced to.
        return False
    return nodes_waiting(run, status.round, waiting, now=now) > 0
