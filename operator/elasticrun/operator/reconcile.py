"""What the operator should do with one ElasticRun, as a pure function.

``reconcile`` takes the run, what Kubernetes says about its members, the time,
the operator's settings and what it already did for the run, and returns a
:class:`Plan`: the objects beside the run to apply (:mod:`.runobjects`), problem
Events, at most one compare-and-set of the status, assignments, Lease and run
deletion, annotation clean-up and Events.  The executor carries plans out;
everything decided here is unit-testable without a cluster, and an operator
restarted mid-round decides from the API server's state alone.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from elasticrun.api import crd, rounds, slices, stores
from elasticrun.api.leases import LeaseState, pending_joins, suspicion_window
from elasticrun.api.model import (
    LOST_MEMBERS_KEPT,
    Condition,
    Desired,
    ElasticRun,
    LostMember,
    Participant,
    RunStatus,
    StoreAddress,
    WaitingNode,
    capped,
    next_signal,
    set_condition,
)
from elasticrun.operator import nodesignals, runobjects, topology
from elasticrun.operator.liveness import Loss, member_pod_loss
from elasticrun.operator.owners import NO_OWNER, Ownership, coming

_T = TypeVar("_T")

#: The handlers seal within milliseconds of the write that made a round
#: sealable; the operator waits this long before doing it itself, so it is a
#: backstop (operator-less rounds still form) rather than a racing writer.
SEAL_GRACE = 1.0
#: How long a waiting or sealed entry may lack a Lease before it counts as gone
#: (covers a node that died between joining and creating its Lease, without
#: misreading a Lease the operator's watch has not delivered yet).
MISSING_LEASE_GRACE_FACTOR = 1.0
#: Look at a reported rank 0 again this soon after its Lease's quiet time is up.
SUSPECT_RECHECK = dt.timedelta(seconds=0.05)
#: Look at a run again this soon at the earliest for a Lease that expired already
#: (one that could not be deleted must not make a loop).
EXPIRED_LEASE_RECHECK = dt.timedelta(seconds=1)

#: The condition saying the owner's desired size does not fit the run (True) or
#: fits again (False), with its reasons.
DESIRED_CONDITION = "DesiredMismatch"
DESIRED_ABOVE_MAX = "DesiredAboveMaxNodes"
DESIRED_BELOW_MIN = "DesiredBelowMinNodes"
SEVERAL_OWNERS = "SeveralOwners"
DESIRED_FITS = "DesiredFits"
NO_DESIRED_SIZE = "NoDesiredSize"


@dataclass(frozen=True)
class Members:
    """What Kubernetes says about the nodes of one run."""

    #: The run's Leases by node, each with ``seen``: when the operator saw its
    #: current renewal (:class:`~elasticrun.api.leases.RenewalClock`).
    leases: Mapping[str, LeaseState] = field(default_factory=dict)
    #: Losses seen on Pods, by pod name: they count only for a member that
    #: named its Pod and recorded no Pod uid (a handler older than ``podUID``),
    #: because a Pod's name is anyone's to take (:func:`member_pod_loss`).
    pod_losses: Mapping[str, Loss] = field(default_factory=dict)
    #: Losses seen on Pods, by the Pod's uid: a member that recorded its Pod's
    #: uid when it joined is lost only through that very Pod.
    pod_losses_by_uid: Mapping[str, Loss] = field(default_factory=dict)
    #: When the operator first saw each member or waiting node without a Lease,
    #: by its own clock (the times in the status are written by nodes).
    missing_since: Mapping[str, dt.datetime] = field(default_factory=dict)
    #: No Lease counts as expired before its duration has passed since this
    #: time: when the API server last became reachable (elasticrun.operator.apihealth).
    lease_clock_start: dt.datetime | None = None
    #: What the owners of the run's pods say (:mod:`elasticrun.operator.owners`):
    #: the source of ``status.desired``.
    ownership: Ownership = NO_OWNER
    #: What the Node of each of the run's pods shows, by pod name (only pods whose
    #: Node shows a signal); None when node signals are off (``status.excludedPods``
    #: is then left as it is).
    node_signals: Mapping[str, nodesignals.Shown] | None = None
    #: Per pod name, the Pod's uid and the topology values of its Node
    #: (:func:`elasticrun.operator.topology.node_topology`); None when no topology
    #: keys are configured (the waiting entries then carry none).
    topology: Mapping[str, tuple[str | None, tuple[str, ...]]] | None = None


@dataclass
class Plan:
    status: RunStatus | None = None
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    remove_annotations: list[str] = field(default_factory=list)
    #: Nodes whose Leases to delete: lost nodes, so that a stale join request
    #: cannot bring them back, and a restarted agent can take its name again.
    delete_leases: list[str] = field(default_factory=list)
    delete_run: bool = False
    wake_at: dt.datetime | None = None
    sealed: bool = False
    #: Whether the plan removes a member or deletes a Lease for what the Leases say
    #: (:data:`rounds.LEASE_LOSSES`, an expired Lease); the controller decides such a
    #: plan, and a seal, again from a consistent listing.  A removal for what a Pod
    #: said is carried out as decided: it reads no Lease.
    lease_decided: bool = False
    #: The run's slices to write with the places of its sealed round, in the runs
    #: told in slices (after ``status``, if any, is written).
    tell: list[slices.Slice] = field(default_factory=list)
    #: The run's own objects to apply, before anything else (they changed).
    apply: list[runobjects.Apply] = field(default_factory=list)
    #: Problem Events, posted whatever becomes of the status write, and the run's
    #: problem memory after them.
    report: runobjects.Report = field(default_factory=runobjects.Report)
    #: With ``delete_run``: the run's own objects, deleted before it.
    delete_objects: list[str] = field(default_factory=list)

    def wake(self, when: dt.datetime | None) -> None:
        if when is not None and (self.wake_at is None or when < self.wake_at):
            self.wake_at = when


def _losses(run: ElasticRun, members: Members, now: dt.datetime
            ) -> list[tuple[str, Loss]]:
    """Members and waiting nodes that Kubernetes says are gone."""
    status, spec = run.status, run.spec
    found: list[tuple[str, Loss]] = []
    entries: list[tuple[str, str | None, str | None]] = [
        (p.name, p.pod, p.pod_uid) for p in status.participants]
    entries += [(w.name, w.pod, w.pod_uid) for w in status.waiting]
    grace = _missing_grace(spec.heartbeat_timeout)
    for name, pod, pod_uid in entries:
        since = members.missing_since.get(name)
        pod_loss = member_pod_loss(pod, pod_uid, members.pod_losses,
                                   members.pod_losses_by_uid)
        if pod_loss is not None:
            found.append((name, pod_loss))
            continue
        lease = members.leases.get(name)
        if lease is not None and lease.expired(now, spec.heartbeat_timeout,
                                               members.lease_clock_start):
            found.append((name, Loss(rounds.LEASE_EXPIRED, f"{name} did not renew its Lease for "
                                     f"{spec.heartbeat_timeout}s",
                                     lease.expired_at(spec.heartbeat_timeout,
                                                      members.lease_clock_start))))
        elif lease is None and since is not None and now - since > grace:
            found.append((name, Loss(rounds.LEASE_MISSING, f"{name} has no Lease",
                                     since + grace)))
    suspect = _suspected_leader(run, members, now)
    if suspect is not None and suspect.name not in {name for name, _ in found}:
        loss = _unreachable_loss(run, members, suspect, now)
        if loss is not None:
            found.append((suspect.name, loss))
    return found


def _missing_grace(heartbeat: float) -> dt.timedelta:
    return dt.timedelta(seconds=heartbeat * MISSING_LEASE_GRACE_FACTOR)


def missing_leases(status: RunStatus, leases: Mapping[str, LeaseState]) -> set[str]:
    """Members and waiting nodes without a Lease (the controller times how long each is)."""
    names = status.member_names | {w.name for w in status.waiting}
    return {name for name in names if name not in leases}


@dataclass(frozen=True)
class Suspect:
    """The round's rank 0, reported unreachable by the members in ``reporters``."""

    name: str
    reporters: tuple[str, ...]


def _suspected_leader(run: ElasticRun, members: Members, now: dt.datetime) -> Suspect | None:
    """Rank 0 of the current round, if a live member of that round reports its store dead.

    A report is a pod's word, so it only makes the operator look at rank 0's
    Lease sooner (:func:`_unreachable_loss`); it never removes anyone by itself.
    """
    status = run.status
    leader = status.leader
    if leader is None:
        return None
    member_names = status.member_names
    reporters = tuple(sorted(
        name for name, lease in members.leases.items()
        if lease.unreachable is not None and lease.unreachable.node == leader
        and lease.unreachable.round == status.round and name != leader
        and name in member_names and lease.owner_uid == run.uid
        and not lease.expired(now, run.spec.heartbeat_timeout, members.lease_clock_start)))
    return Suspect(leader, reporters) if reporters else None


def _suspect_silent_at(run: ElasticRun, members: Members, suspect: Suspect
                       ) -> dt.datetime | None:
    """When the suspect's Lease has been quiet for the suspicion window (None: no Lease)."""
    lease = members.leases.get(suspect.name)
    if lease is None:
        return None
    spec = run.spec
    return lease.expired_at(suspicion_window(spec.heartbeat_timeout, spec.lease_renew_interval),
                            members.lease_clock_start)


def _unreachable_loss(run: ElasticRun, members: Members, suspect: Suspect,
                      now: dt.datetime) -> Loss | None:
    """A reported rank 0 whose Lease also went quiet (or is gone) is lost now."""
    who = ", ".join(suspect.reporters)
    if suspect.name not in members.leases:
        return Loss(rounds.LEADER_LOST, f"{suspect.name}'s TCPStore did not answer {who}, "
                    "and it has no Lease", now)
    silent_at = _suspect_silent_at(run, members, suspect)
    if silent_at is None or now <= silent_at:
        return None
    window = suspicion_window(run.spec.heartbeat_timeout, run.spec.lease_renew_interval)
    return Loss(rounds.LEADER_LOST, f"{suspect.name}'s TCPStore did not answer {who}, and it "
                f"did not renew its Lease for {window:g}s", silent_at)


def _phase(status: RunStatus) -> str:
    if status.round == 0:
        return "Forming" if status.waiting else "Pending"
    return "Degraded" if status.degraded else "Running"


def reconcile(run: ElasticRun, members: Members, now: dt.datetime,
              settings: runobjects.Settings = runobjects.NO_SETTINGS,
              done: runobjects.Done = runobjects.NOTHING_DONE) -> Plan:
    """Everything the operator does for the run: its objects and problem reports
    (:mod:`.runobjects`, from ``settings`` and what was ``done``), then the run's rules."""
    plan = _rules(run, members, now, done)
    plan.apply = runobjects.applies(run, members.leases, settings, done)
    plan.report = runobjects.problem_reports(run, members.leases, members.node_signals,
                                             settings, done.problems)
    if plan.delete_run:
        plan.delete_objects = runobjects.owned_paths(run, settings)
    return plan


def _rules(run: ElasticRun, members: Members, now: dt.datetime,
           done: runobjects.Done) -> Plan:
    """The rules below, in order; each one may end the pass with its own plan.

    A new rule goes where its order matters: before ``_seal_backstop`` if it
    changes who may be sealed, after it if it only reports.
    """
    plan = Plan()
    if _is_finished(run.status, run.spec.closed):
        if run.status.phase == "Succeeded" and run.status.condition("Succeeded") is None:
            return _record_success(run, now, plan)
        return _expire(run, now, plan)
    if run.spec.closed:
        return _close(run, now, plan)
    new = _reopen(run, now, plan)
    new = new.replace(waiting=pending_joins(members.leases.values(), new, now, run.uid,
                                            run.spec.heartbeat_timeout))
    new = _topology(new, members)  # before the seal: ranks read it
    new = _remove_lost(run, new, members, now, plan)
    _collect_dead_leases(run, new, members, now, plan)
    new = _drain(run, new, now)
    new = _node_signals(run, new, members, now)
    new = _forced_round(run, new, plan)
    if _all_members_finished(new):
        return _succeed(run, new, now, plan)
    new = _desired(new, members)  # before the seal: its rules read the owner's size
    new = _seal_backstop(run, new, members, now, plan)
    _lease_wakeups(run, new, members, now, plan)
    plan.tell = _slices_due(run, new, members, done)
    material = new
    new = _desired_condition(run, _coming(new, members), members, now)
    new = _finish(_conditions(run, new.replace(phase=_phase(new)), now), run.generation)
    plan = _write_or_wait(run.status, material, new, now, plan)
    plan.events += desired_events(run.status, plan.status)
    return plan


# --------------------------------------------------------------------------- finished runs


def _is_finished(status: RunStatus, closed: bool) -> bool:
    return (status.phase in ("Closed", "Succeeded") and closed) or status.phase == "Succeeded"


def _expire(run: ElasticRun, now: dt.datetime, plan: Plan) -> Plan:
    """A finished run is deleted once its TTL after finishing has passed."""
    spec, status = run.spec, run.status
    if spec.ttl_seconds_after_finished is not None and status.finished_at is not None:
        expiry = status.finished_at + dt.timedelta(seconds=spec.ttl_seconds_after_finished)
        if now >= expiry:
            plan.delete_run = True
            ttl = spec.ttl_seconds_after_finished
            plan.events.append(("Normal", "Deleted",
                                f"TTL of {ttl}s after {status.phase.lower()} passed"))
        else:
            plan.wake(expiry)
    return plan


def _close(run: ElasticRun, now: dt.datetime, plan: Plan) -> Plan:
    """``spec.closed``: the run is finished for every node, waiting or late
    (:func:`rounds.close`, the status a closing node writes too)."""
    plan.status = rounds.close(run, now)
    if plan.status is None:
        return plan
    plan.events.append(("Normal", "Closed", "run closed (spec.closed=true)"))
    plan.wake(now)  # TTL bookkeeping on the next pass
    return plan


def _reopen(run: ElasticRun, now: dt.datetime, plan: Plan) -> RunStatus:
    """Reopened by the user (closed, then ``spec.closed`` false): every node forms a new round."""
    new = run.status
    if new.phase != "Closed":
        return new
    new = new.replace(phase="Forming", finished_at=None, signal=next_signal(new.signal),
                      restart_round=new.round if new.round and not new.degraded
                      else new.restart_round)
    new = new.replace(conditions=set_condition(new.conditions, "Closed", False, "Reopened",
                                               "spec.closed was set back to false", now,
                                               run.generation))
    plan.events.append(("Normal", "Reopened", "run reopened (spec.closed=false)"))
    return new


# --------------------------------------------------------------------------- membership


def _remove_lost(run: ElasticRun, new: RunStatus, members: Members, now: dt.datetime,
                 plan: Plan) -> RunStatus:
    """Members and waiting nodes Kubernetes says are gone leave; their Leases are deleted."""
    for name, loss in _losses(run.replace_status(new), members, now):
        detection = (now - loss.since).total_seconds() if loss.since else None
        removed = rounds.remove_member(new, name, loss.reason, now, message=loss.message,
                                       detection_seconds=max(0.0, detection)
                                       if detection is not None else None)
        if removed is not None:
            new = removed  # the MemberLost Event is posted when the removal is observed
            plan.delete_leases.append(name)
            plan.lease_decided |= loss.reason in rounds.LEASE_LOSSES
    return new


def _collect_dead_leases(run: ElasticRun, new: RunStatus, members: Members, now: dt.datetime,
                         plan: Plan) -> None:
    """Expired Leases of nodes that are neither members nor waiting are deleted.

    Removing a member writes the status first and deletes its Lease after; an
    operator that stopped in between finishes the job here, from the API
    server's state alone.
    """
    present = new.member_names | {w.name for w in new.waiting}
    for name, lease in sorted(members.leases.items()):
        if name not in present and name not in plan.delete_leases and lease.expired(
                now, run.spec.heartbeat_timeout, members.lease_clock_start):
            plan.delete_leases.append(name)
            plan.lease_decided = True


def _drain(run: ElasticRun, new: RunStatus, now: dt.datetime) -> RunStatus:
    """Members named in the drain annotation leave the round."""
    for name in sorted(run.drained & new.member_names):
        removed = rounds.remove_member(new, name, rounds.DRAINED, now,
                                       message=f"drained by annotation {crd.DRAIN_ANNOTATION}")
        if removed is not None:
            new = removed
    return new


#: The run condition saying which of its nodes' Nodes show a configured signal.
NODE_SIGNALS_CONDITION = "NodeSignals"
#: At most this many entries are named in the condition's message.
NODE_SIGNALS_NAMED = 8


def _node_signals(run: ElasticRun, new: RunStatus, members: Members,
                  now: dt.datetime) -> RunStatus:
    """What the Nodes of the run's pods show: ``excludedPods`` (exclude and drain),
    members on a draining Node leave (``NodeDraining``), and the ``NodeSignals``
    condition naming the members and waiting nodes concerned.

    The exclusion is by pod, so a pod on an excluded Node is held back from the
    moment the operator sees it there, before its node joins; and it is written
    with the removal, in one status write, so a node sealing the survivors'
    round already holds the drained member back.
    """
    shown = members.node_signals
    if shown is None:
        return new
    pods = {pod: s for pod, s in shown.items() if s.signals}
    entries = [(p.name, p.pod) for p in new.participants if p.pod]
    entries += [(w.name, w.pod) for w in new.waiting if w.pod]
    relevant = {name: pods[pod] for name, pod in entries if pod in pods}
    new = new.replace(excluded_pods=nodesignals.excluded_pods(pods))
    for name in nodesignals.draining(pods, ((p.name, p.pod)
                                            for p in new.participants if p.pod)):
        member = new.participant(name)
        pod = (member.pod if member else None) or name
        removed = rounds.remove_member(new, name, rounds.NODE_DRAINING, now,
                                       message=f"pod {pod}: {pods[pod].describe()}")
        if removed is not None:
            new = removed
    if not relevant and new.condition(NODE_SIGNALS_CONDITION) is None:
        return new
    named = sorted(relevant)[:NODE_SIGNALS_NAMED]
    message = "; ".join(f"{name}: {relevant[name].describe()}" for name in named)
    if len(relevant) > len(named):
        message += f"; and {len(relevant) - len(named)} more"
    reason, text = ("NodeSignalsShown", message) if relevant else (
        "NoNodeSignals", "no member's or waiting node's Node shows a configured signal")
    return new.replace(conditions=set_condition(new.conditions, NODE_SIGNALS_CONDITION,
                                                bool(relevant), reason, text, now,
                                                run.generation))


def _topology(new: RunStatus, members: Members) -> RunStatus:
    """The waiting summary with each entry's topology values, as the operator read them
    from the Node of the entry's Pod; untouched when no topology keys are configured."""
    if members.topology is None:
        return new
    return new.replace(waiting=topology.with_pod_topology(new.waiting, members.topology))


def _forced_round(run: ElasticRun, new: RunStatus, plan: Plan) -> RunStatus:
    """The restart annotation re-forms the running round, once (the annotation is removed)."""
    if crd.RESTART_ANNOTATION not in run.annotations:
        return new
    plan.remove_annotations.append(crd.RESTART_ANNOTATION)
    restarted = rounds.request_restart(new)
    if restarted is None:
        return new
    plan.events.append(("Normal", "RoundRestart",
                        f"round {restarted.round} restart requested by annotation"))
    return restarted


def _all_members_finished(new: RunStatus) -> bool:
    current_lost = [m for m in new.lost_members if m.round == new.round]
    return (new.round > 0 and not new.participants and not new.waiting and bool(current_lost)
            and all(m.reason in rounds.DEPARTURES for m in current_lost))


def _succeed(run: ElasticRun, new: RunStatus, now: dt.datetime, plan: Plan) -> Plan:
    """Every member of the round left after finishing: the run succeeded."""
    count = len([m for m in new.lost_members if m.round == new.round])
    new = new.replace(phase="Succeeded", finished_at=now, signal=next_signal(new.signal))
    return _succeeded(run, new, "AllMembersLeft",
                      f"all {count} members of round {new.round} finished", now, plan)


def _record_success(run: ElasticRun, now: dt.datetime, plan: Plan) -> Plan:
    """A member marked the run Succeeded on its way out (its round passed torch's exit
    barrier, :func:`rounds.leave`): the conditions say so, once."""
    status = run.status
    return _succeeded(run, status, "ExitBarrierPassed",
                      f"every member of round {status.round} passed the exit barrier", now,
                      plan)


def _succeeded(run: ElasticRun, new: RunStatus, reason: str, message: str,
               now: dt.datetime, plan: Plan) -> Plan:
    generation = run.generation
    conditions = set_condition(new.conditions, "Succeeded", True, reason, message, now,
                               generation)
    conditions = set_condition(conditions, rounds.ROUND_COMPLETE, False, "Finished",
                               "the run finished", now, generation)
    plan.status = _finish(new.replace(conditions=conditions), generation)
    plan.events.append(("Normal", "Succeeded", message))
    plan.wake(now)
    return plan


# --------------------------------------------------------------------------- sealing


def _seal_backstop(run: ElasticRun, new: RunStatus, members: Members, now: dt.datetime,
                   plan: Plan) -> RunStatus:
    """Seal what the nodes should have sealed, ``SEAL_GRACE`` after they could have.

    Where nodes leave sealing to the operator (:func:`rounds.nodes_defer_seal`),
    there is nobody to give a grace to: it seals as soon as the rules allow,
    with the members whose places it keeps (:func:`_kept`) counted as back;
    where it keeps places, a newcomer it cannot seal at once it announces to
    the members itself (:func:`rounds.newcomers_defer_announce`).
    """
    candidate = run.replace_status(new)
    waiting = (*new.waiting, *_kept(candidate, members, now))
    decision = rounds.decide_seal(candidate, now, waiting)
    grace = dt.timedelta(seconds=0 if rounds.nodes_defer_seal(run.spec) else SEAL_GRACE)
    if decision.seal_now:
        newest = max((w.asked_at for w in new.waiting if w.asked_at), default=None)
        ready_at = (newest + grace) if newest else now
        if decision.deadline is None and now < ready_at:
            plan.wake(ready_at)
        else:
            plan.sealed = True
            return rounds.seal_round(candidate, now, waiting,
                                     in_slices=rounds.members_told_in_slices(run.spec))
    elif decision.deadline is not None:
        plan.wake(decision.deadline + grace)
    if not plan.sealed and rounds.newcomers_defer_announce(run.spec) \
            and rounds.announce_needed(candidate, now, new.waiting):
        return rounds.announced(new)
    return new


def _kept(run: ElasticRun, members: Members, now: dt.datetime) -> list[WaitingNode]:
    """The members whose places the next round keeps (:func:`rounds.kept_places`).

    Alive by what the operator saw: a Lease of this run, with a join request,
    seen renewed within :func:`rounds.keep_window`, never by a time written in
    it.  A member that froze within that window is placed in a round it will
    never reach, as one that froze just after asking again would be
    (:func:`rounds.members_keep_places` says why nodes that stopped together
    are not).
    """
    spec = run.spec
    if not rounds.members_keep_places(spec):
        return []
    window = rounds.keep_window(spec)
    live = [p.name for p in run.status.participants
            if (lease := members.leases.get(p.name)) is not None
            and lease.owner_uid == run.uid and lease.join is not None
            and not lease.expired(now, window)]
    return rounds.kept_places(run, live, now, leader_next=_next_store(run, members))


def _next_store(run: ElasticRun, members: Members) -> StoreAddress | None:
    """The store rank 0 announced for the next round, on the request its round answered
    (``nextStorePort``), from its Lease of this run; None where it announced none."""
    join = _leader_request(run, run.status, members)
    if join is None or not join.address or join.next_store_port is None:
        return None
    return StoreAddress(join.address, join.next_store_port)


def _leader_request(run: ElasticRun, status: RunStatus, members: Members) -> WaitingNode | None:
    """The join request of ``status``'s rank 0 that its round answered, as rank 0's Lease of
    this run carries it; None when that Lease carries another one, or none."""
    leader = status.leader
    member = status.participant(leader) if leader is not None else None
    lease = members.leases.get(leader) if leader is not None else None
    join = lease.join if lease is not None and lease.owner_uid == run.uid else None
    if member is None or join is None or join.since != member.since:
        return None
    return join


def _vouched(run: ElasticRun, status: RunStatus, members: Members) -> bool:
    """Whether the round's store is one its rank 0 announced, on its own Lease, on the
    request the round answered: what a member told in a slice takes without a check.

    A member told in the run's status reads rank 0's Lease itself before it
    connects (anyone who may write the run could have written ``status.store``).
    Only the operator writes slices, so it makes that check once for the round,
    from the Leases it holds, and tells no slice of a round that fails it (a
    status a node sealed with a forged store): its members learn the round from
    the status, which moved ``signal``, and refuse the store themselves.
    """
    join = _leader_request(run, status, members)
    return join is not None and stores.announces(join, status.store)


def _slices_due(run: ElasticRun, new: RunStatus, members: Members,
                done: runobjects.Done) -> list[slices.Slice]:
    """The slices that do not yet tell the members of a sealed round their places.

    Only in the runs whose seal leaves ``signal`` alone
    (:func:`rounds.members_told_in_slices`), and only for a round whose store
    its rank 0 announced (:func:`_vouched`): just after the operator's seal
    every slice with a member; after a write that failed, that slice; after a
    restart (nothing done yet), every slice again, which changes nothing where
    the killed operator had written it.  A member that has moved on to another
    request finds its place in the slice answering an earlier one, and waits on.
    """
    if not rounds.members_told_in_slices(run.spec) or new.round == 0 or new.degraded \
            or not _vouched(run, new, members):
        return []
    return slices.due(new.assignments(), done.slices_told(new.round))


def _lease_wakeups(run: ElasticRun, new: RunStatus, members: Members, now: dt.datetime,
                   plan: Plan) -> None:
    """Look again when a Lease can expire, a request goes stale, or a join times out."""
    spec = run.spec
    for lease in members.leases.values():
        expiry = lease.expired_at(spec.heartbeat_timeout, members.lease_clock_start)
        # An expiry already past was acted on in this pass (its member removed, its
        # Lease deleted): should the Lease stay, look again later, never at once.
        if expiry is not None:
            plan.wake(expiry if expiry >= now else now + EXPIRED_LEASE_RECHECK)
    grace = _missing_grace(spec.heartbeat_timeout)
    for name in missing_leases(new, members.leases):
        since = members.missing_since.get(name)
        due = since + grace if since is not None else now + grace
        plan.wake(due if due >= now else now + EXPIRED_LEASE_RECHECK)
    suspect = _suspected_leader(run.replace_status(new), members, now)
    silent_at = _suspect_silent_at(run, members, suspect) if suspect is not None else None
    if silent_at is not None:
        plan.wake(silent_at + SUSPECT_RECHECK)
    for w in new.waiting:
        # Only a time still ahead is worth a timer.
        asked = w.asked_at
        stalled_at = asked + dt.timedelta(seconds=spec.join_timeout) if asked else None
        if stalled_at is not None and stalled_at > now:
            plan.wake(stalled_at)


# --------------------------------------------------------------------------- desired size


def _desired(new: RunStatus, members: Members) -> RunStatus:
    """``status.desired`` and ``desiredFrom`` from the owner of the run's pods.

    A new size or source is a change worth writing at once (nodes deciding a
    seal read it); ``coming`` alone is bookkeeping (:func:`_coming`), so it is
    carried over here from the status when the size and source stay.
    """
    owned = members.ownership
    if owned.size is None:
        return new.replace(desired=None)
    old = new.desired
    kept = old.coming if old is not None and (old.size, old.source) == (
        owned.size, owned.source) else 0
    return new.replace(desired=Desired(size=owned.size, source=owned.source, coming=kept))


def _coming(new: RunStatus, members: Members) -> RunStatus:
    """``status.coming``: the owner's pods that have not asked to join yet.

    A pod has asked when a member, a waiting entry or a join request on a
    Lease names it: by its uid when the node recorded one, else by pod name.
    """
    if new.desired is None:
        return new
    entries = [(p.pod, p.pod_uid) for p in new.participants if p.pod]
    entries += [(w.pod, w.pod_uid) for w in new.waiting if w.pod]
    entries += [(lease.join.pod, lease.join.pod_uid)
                for lease in members.leases.values()
                if lease.join is not None and lease.join.pod]
    uids = {uid for _, uid in entries if uid is not None}
    names = {pod for pod, uid in entries if uid is None}
    return new.replace(desired=dataclasses.replace(
        new.desired, coming=coming(members.ownership.pods, names, uids)))


def desired_problem(run: ElasticRun, new: RunStatus, members: Members
                    ) -> tuple[str, str] | None:
    """Why the owner's desired size does not fit the run, as (reason, message); None if
    it fits (or no owner says)."""
    conflict = members.ownership.conflict
    if conflict:
        return SEVERAL_OWNERS, (f"the run's pods belong to {len(conflict)} workloads "
                                f"({', '.join(conflict[:4])}): no desired size is followed")
    desired, spec = new.desired, run.spec
    if desired is None:
        return None
    if desired.size > spec.max_nodes:
        spares = desired.size - spec.max_nodes
        return DESIRED_ABOVE_MAX, (
            f"{desired.source} asks for {desired.size} nodes, more than maxNodes "
            f"({spec.max_nodes}): {spares} pod(s) will wait as spares and hold their quota")
    if desired.size < spec.min_nodes:
        return DESIRED_BELOW_MIN, (
            f"{desired.source} asks for {desired.size} nodes, fewer than minNodes "
            f"({spec.min_nodes}): the run cannot form a round")
    return None


def _desired_condition(run: ElasticRun, new: RunStatus, members: Members,
                       now: dt.datetime) -> RunStatus:
    """The ``DesiredMismatch`` condition: True with the reason while the size does not
    fit; once there, False when it fits again."""
    problem = desired_problem(run, new, members)
    if problem is None and new.condition(DESIRED_CONDITION) is None:
        return new
    fits = (DESIRED_FITS, "the owner's desired size fits minNodes..maxNodes")
    reason, message = problem or (fits if new.desired is not None else (
        NO_DESIRED_SIZE, "no workload owning the run's pods gives a size"))
    return new.replace(conditions=set_condition(new.conditions, DESIRED_CONDITION,
                                                problem is not None, reason, message, now,
                                                run.generation))


def desired_events(old: RunStatus, written: RunStatus | None) -> list[tuple[str, str, str]]:
    """One Warning Event when the status about to be written turns the ``DesiredMismatch``
    condition on, or changes its reason or message: per change, never per reconcile."""
    if written is None:
        return []
    after = written.condition(DESIRED_CONDITION)
    if after is None or after.status != "True":
        return []
    before = old.condition(DESIRED_CONDITION)
    if before is not None and before.status == "True" and (before.reason, before.message) == (
            after.reason, after.message):
        return []
    return [("Warning", after.reason or DESIRED_CONDITION, after.message or "")]


# --------------------------------------------------------------------------- reporting


def _conditions(run: ElasticRun, new: RunStatus, now: dt.datetime) -> RunStatus:
    """The round's conditions (:func:`~elasticrun.api.rounds.round_conditions`) and
    Stalled, for ``kubectl describe``."""
    spec, generation = run.spec, run.generation
    conditions = rounds.round_conditions(new, now, generation)
    stalled = [w for w in new.waiting
               if w.asked_at and (now - w.asked_at).total_seconds() > spec.join_timeout]
    if stalled or new.condition("Stalled"):
        conditions = set_condition(
            conditions, "Stalled", bool(stalled), "JoinTimeout" if stalled else "Progressing",
            f"{len(stalled)} node(s) waited longer than joinTimeoutSeconds "
            f"({spec.join_timeout}s) for a round of at least {spec.min_nodes}" if stalled
            else "no node waits past the join timeout", now, generation)
    return new.replace(conditions=conditions)


def _write_or_wait(status: RunStatus, material: RunStatus, new: RunStatus, now: dt.datetime,
                   plan: Plan) -> Plan:
    """Write ``new`` if membership changed; bookkeeping alone waits for a quiet moment."""
    if new == status:
        return plan
    if material.replace(waiting=status.waiting) != status:
        plan.status = new
        return plan
    # Only bookkeeping changed (the waiting summary, phase, counts, conditions).  While nodes
    # are still joining, writing it would bump the resourceVersion under their
    # seal; wait until the waiting set has been quiet for a moment.
    newest = max((w.asked_at for w in new.waiting if w.asked_at), default=None)
    quiet_at = newest + dt.timedelta(seconds=SEAL_GRACE) if newest else now
    if now >= quiet_at:
        plan.status = new
    else:
        plan.wake(quiet_at)
    return plan


def _finish(new: RunStatus, generation: int) -> RunStatus:
    """Counts and observedGeneration, which every status write carries."""
    return new.replace(observed_generation=generation, waiting_count=len(new.waiting))


def lost_since(old: RunStatus, new: RunStatus) -> list[LostMember]:
    """Lost-member records in ``new`` that ``old`` did not have (for Events and metrics)."""
    seen = {(m.name, m.round, m.reason, m.time) for m in old.lost_members}
    return [m for m in new.lost_members if (m.name, m.round, m.reason, m.time) not in seen]


@dataclass(frozen=True)
class Repair:
    """The status to write in place of an unreadable one, and the Event once it took."""

    status: dict[str, object]
    event: tuple[str, str, str]


def repair_due(error: Exception, repaired: str | None) -> bool:
    """Whether an unreadable status is repaired: not when this very error was repaired
    already (``repaired``: the last one), so a status nobody can fix costs one write,
    not one per reconcile."""
    return repaired != str(error)


def plan_repair(raw: Mapping[str, object], error: Exception, now: dt.datetime,
                min_round: int, requests: Iterable[WaitingNode] = ()) -> Repair:
    """The repair of a run whose status the model cannot read (:func:`repair`), and its
    Event; ``requests`` are the join requests on the run's own Leases."""
    meta = raw.get("metadata")
    meta = meta if isinstance(meta, Mapping) else {}
    generation = meta.get("generation")
    status = repair(raw.get("status"), error, now,
                    generation if isinstance(generation, int) else 0, min_round=min_round,
                    requests=requests)
    return Repair(status, ("Warning", "InvalidStatus",
                           f"status could not be read ({error}); the round is re-formed"))


def repair(raw_status: object, error: Exception, now: dt.datetime, generation: int,
           min_round: int = 0, requests: Iterable[WaitingNode] = ()) -> dict[str, object]:
    """A readable status to replace one the model rejects, losing nothing that is safe.

    The round number (at least ``min_round``, the highest the operator saw and
    still defends, :meth:`~elasticrun.api.ordering.RoundMark.floor`) and the
    signal move forward (never back), waiting entries, members and lost
    members that are readable are kept (:func:`_readable_roster`), and the
    current round is marked for restart, so every member re-joins and a
    consistent round is sealed again.  The join requests on the run's Leases
    (``requests``) that the repaired status neither holds nor keeps waiting are
    recorded as spent (:func:`_spent_requests`).  A round no round can follow (at
    the counters' maximum, or beyond it in a CRD without one) is not kept: the
    run starts again from ``min_round``.  The error goes into the ``Degraded``
    condition for ``kubectl describe``.
    """
    status = raw_status if isinstance(raw_status, dict) else {}

    def count(key: str) -> int:
        value = status.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) \
            and 0 <= value <= crd.counter_maximum() else 0

    raw_round = count("round")
    round_ = max(raw_round if raw_round < crd.counter_maximum() else 0, min_round)
    generation = capped(generation)
    waiting: dict[str, WaitingNode] = {}
    for node in _readable(status.get("waiting"), WaitingNode.from_dict, "status.waiting[]"):
        waiting.setdefault(node.name, node)
    roster = _readable_roster(status.get("participants"), round_) if round_ else []
    lost = _readable(status.get("lostMembers"), LostMember.from_dict, "status.lostMembers[]")
    lost += _spent_requests(requests, [*roster, *waiting.values(), *lost], round_, now)
    condition = Condition(type="Degraded", status="True", reason="InvalidStatus",
                          message=f"status could not be read ({error}); round {round_} is "
                                  "re-formed", last_transition_time=now,
                          observed_generation=generation)
    repaired: dict[str, object] = {
        "phase": "Degraded" if round_ else "Forming",
        "round": round_,
        "signal": next_signal(count("signal")),
        "joinNotice": round_,
        "restartRound": round_,
        "memberCount": len(roster),
        "waitingCount": len(waiting),
        "participants": [p.to_dict() for p in roster],
        "waiting": [w.to_dict() for w in waiting.values()],
        "lostMembers": [m.to_dict() for m in lost[-LOST_MEMBERS_KEPT:]],
        "conditions": [condition.to_dict()],
        "observedGeneration": generation,
    }
    repaired["stableRound"] = RunStatus.from_dict(repaired).stable_round
    return repaired


def _readable(raw: object, read: Callable[[object, str], _T], path: str) -> list[_T]:
    """The entries of a status list the model can read; anything else is dropped."""
    entries: list[_T] = []
    for item in raw if isinstance(raw, list) else []:
        try:
            entries.append(read(item, path))
        except ValueError:
            continue
    return entries


def _spent_requests(requests: Iterable[WaitingNode],
                    kept: Sequence[Participant | WaitingNode | LostMember], round_: int,
                    now: dt.datetime) -> list[LostMember]:
    """The join requests a repaired status must record as answered, as lost memberships.

    A request on a Lease is pending unless the status answers it
    (:func:`~elasticrun.api.leases.pending_joins`), and a repair cannot tell
    a member whose entry was unreadable from a node that asked after the last
    status write.  Taken for pending, the member's request could be sealed
    into the repaired round's successor before the member asks again; the
    member would refuse that round (:func:`elasticrun.handler.step.answers`)
    and its peers would start without it.  Taken for spent, a node that was
    really waiting finds its request unanswered and absent from the pending
    ones, and makes it again (:func:`elasticrun.handler.step.next_action`): a
    write instead of a broken round.  The status holds the newest
    :data:`LOST_MEMBERS_KEPT` records; beyond that many unreadable members, the
    rest may take one more round to re-form.
    """
    answered: dict[str, dt.datetime] = {}
    for entry in kept:
        if entry.since is not None:
            answered[entry.name] = max(entry.since, answered.get(entry.name, entry.since))
    spent: list[LostMember] = []
    for request in sorted(requests, key=rounds.arrival_key):
        latest = answered.get(request.name)
        if request.since is None or (latest is not None and request.since <= latest):
            continue
        answered[request.name] = request.since
        spent.append(LostMember(
            name=request.name, round=round_, reason=rounds.STATUS_UNREADABLE, time=now,
            since=request.since,
            message="its request predates the repair of an unreadable status; it asks again"))
    return spent


def _readable_roster(raw: object, round_: int) -> list[Participant]:
    """The readable members of a repaired round, each name once, ranked 0..k-1 in their order.

    The round is marked for restart, so they re-join and the seal prefers their
    old places.  Kept, their entries still hold the join requests their
    memberships answered (``since``): without them the requests left on the
    members' Leases would look pending (:func:`~elasticrun.api.leases.pending_joins`)
    and be sealed into a round of their own before the members are back.
    """
    members: dict[str, Participant] = {}
    for member in _readable(raw, Participant.from_dict, "status.participants[]"):
        members.setdefault(member.name, member)
    ordered = sorted(members.values(), key=lambda p: (p.rank, p.name))
    return [dataclasses.replace(p, rank=rank, joined_round=min(p.joined_round, round_))
            for rank, p in enumerate(ordered)]
