"""Each node's Lease: its liveness and its request to join the next round.

Joining writes only the node's own object, an annotation on its Lease, so N
nodes joining at once never contend.  Writing one shared object instead costs
the API server O(N^2) work, because it re-applies every losing patch on the
newer object: 128 simultaneous joins on one ElasticRun took over 30 s and hit
the server's 504 request timeout, while 128 joins on their own Leases plus a
consistent LIST each took 0.4 s on the same machine.  Whoever seals a round
(a node, or the operator from its Lease index) reads the join requests from
the run's Leases.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from elasticrun.api import crd, untrusted
from elasticrun.api.model import Assignment, InvalidRunError, RunStatus, StoreAddress, WaitingNode
from elasticrun.api.naming import label_value
from elasticrun.api.rounds import arrival_key

#: Annotation on a node's Lease: its join request, as JSON (a waiting entry without the name).
JOIN_ANNOTATION = f"{crd.GROUP}/join"
#: Annotation on a node's Lease: the round's rank 0 whose TCPStore it could not reach,
#: as JSON ``{"node": ..., "round": R}``.  Evidence for the operator, never a verdict.
UNREACHABLE_ANNOTATION = f"{crd.GROUP}/unreachable"
#: Annotation on a member's Lease in a large run: its place in the round just
#: sealed (:class:`~elasticrun.api.model.Assignment` as JSON), written by the
#: operator after its seal so that the member need not read the whole roster.
ASSIGNMENT_ANNOTATION = f"{crd.GROUP}/assignment"
#: One past the largest round, rank or world size a report or an assignment may
#: name: the status counters' maximum (:func:`elasticrun.api.crd.counter_maximum`).
MAX_COUNTER = crd.counter_maximum() + 1
#: A rank 0 reported unreachable is lost once it has not renewed its Lease for this
#: many renewal intervals (at most the heartbeat timeout): two independent signals,
#: its store refusing a member and its Lease going quiet, instead of waiting for the
#: heartbeat alone.
SUSPECT_RENEWALS = 2


@dataclass(frozen=True)
class Unreachable:
    """A member's report that it could not reach ``node``'s TCPStore in round ``round``."""

    node: str
    round: int


@dataclass(frozen=True)
class LeaseState:
    """What a Lease says about its node, read by :func:`lease_state` (never raises)."""

    node: str | None
    holder: str | None
    renewed: dt.datetime | None
    #: The Lease's own ``leaseDurationSeconds``: informational only.  Whoever
    #: writes the Lease chooses it, so liveness uses the run's heartbeat instead.
    duration: float
    join: WaitingNode | None = None
    #: uid of the ElasticRun the Lease belongs to (its ownerReference).
    owner_uid: str | None = None
    #: When the API server created the Lease: orders newcomers.
    created: dt.datetime | None = None
    #: Why a join request on the Lease was not readable (for one Event).
    problem: str | None = None
    #: The rank 0 this node reports unreachable, if it does.
    unreachable: Unreachable | None = None
    #: The node's place in a round, as the operator last told it.
    assignment: Assignment | None = None

    def expired(self, now: dt.datetime, timeout: float,
                not_before: dt.datetime | None = None) -> bool:
        """Not renewed for ``timeout`` (the run's heartbeat); counted from no earlier than
        ``not_before``.

        ``not_before`` is when the holder could last start renewing again (the
        API server came back), so an outage is not mistaken for a dead holder.
        """
        expiry = self.expired_at(timeout, not_before)
        return expiry is not None and now > expiry

    def expired_at(self, timeout: float,
                   not_before: dt.datetime | None = None) -> dt.datetime | None:
        if self.renewed is None:
            return None
        start = self.renewed if not_before is None else max(self.renewed, not_before)
        return start + dt.timedelta(seconds=timeout)


def suspicion_window(heartbeat: float, renew_interval: float) -> float:
    """How long a reported rank 0 may go without renewing its Lease before it counts as lost."""
    return min(heartbeat, SUSPECT_RENEWALS * renew_interval)


def run_leases_query(run: str) -> dict[str, str]:
    """The LIST query for a run's Leases (the label may be a hash of a long name)."""
    return {"labelSelector": f"{crd.RUN_LABEL}={label_value(run)}"}


def lease_run(lease: Mapping[str, Any]) -> str | None:
    """The run a Lease belongs to: its annotation, when the label agrees with it.

    Readers list Leases by label and key them by the annotation (the label may
    be a hash of a long name).  A Lease whose label names one run and whose
    annotation another belongs to neither, so the admission policy, which
    checks the writer's right to the annotation's run, decides for every reader.
    """
    meta = untrusted.mapping(lease.get("metadata"))
    run = untrusted.text(untrusted.mapping(meta.get("annotations")).get(crd.RUN_LABEL))
    label = untrusted.mapping(meta.get("labels")).get(crd.RUN_LABEL)
    if run is None or label != label_value(run):
        return None
    return run


def leases_of(listed: Mapping[str, Any], run: str) -> list[dict[str, Any]]:
    """The items of a LIST with :func:`run_leases_query` that belong to ``run``.

    The label alone cannot tell two long names with the same hash apart; the
    annotation holds the full name (:func:`lease_run`).
    """
    items = listed.get("items")
    return [item for item in items if isinstance(item, dict) and lease_run(item) == run] \
        if isinstance(items, list) else []


def join_value(node: WaitingNode) -> str:
    entry = node.to_dict()
    entry.pop("name", None)
    return json.dumps(entry, sort_keys=True)


def read_join(node: str | None, raw: Any, where: str) -> tuple[WaitingNode | None, str | None]:
    """A join request from a Lease annotation, or None and why it was not readable."""
    if node is None or raw is None or raw == "":
        return None, None
    try:
        fields = untrusted.json_object(raw)
        join = WaitingNode.from_dict({**fields, "name": node}, where)
    except (untrusted.UnreadableError, InvalidRunError) as exc:
        return None, f"{where}: join request ignored: {exc}"
    if join.since is None:
        # ``since`` identifies the request: without it no round could ever answer it.
        return None, f"{where}: join request ignored: it has no since"
    return join, None


def _counter(value: Any, minimum: int, maximum: int = MAX_COUNTER) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value < maximum:
        return None
    return value


def unreachable_value(node: str, round_number: int) -> str:
    return json.dumps({"node": node, "round": round_number}, sort_keys=True)


def read_unreachable(raw: Any) -> Unreachable | None:
    """A report from a Lease annotation; anything unreadable is no report."""
    if raw is None or raw == "":
        return None
    try:
        fields = untrusted.json_object(raw, limit=512, max_depth=1)
    except untrusted.UnreadableError:
        return None
    node, round_number = untrusted.text(fields.get("node")), _counter(fields.get("round"), 1)
    if node is None or round_number is None:
        return None
    return Unreachable(node=node, round=round_number)


def assignment_value(assignment: Assignment) -> str:
    return json.dumps(assignment.to_dict(), sort_keys=True, separators=(",", ":"))


def read_assignment(raw: Any) -> Assignment | None:
    """An assignment from a Lease annotation; anything unreadable or inconsistent is none.

    Written by the operator, but on an object pods may write too, so it is read
    like any other untrusted value: bounded, and never an exception.
    """
    if raw is None or raw == "":
        return None
    try:
        fields = untrusted.json_object(raw, limit=1024, max_depth=2)
    except untrusted.UnreadableError:
        return None
    store = untrusted.mapping(fields.get("store"))
    host, port = untrusted.text(store.get("host")), _counter(store.get("port"), 1, 65536)
    round_number, rank = _counter(fields.get("round"), 1), _counter(fields.get("rank"), 0)
    world = _counter(fields.get("worldSize"), 1)
    leader = untrusted.text(fields.get("leader"))
    since = untrusted.read_time(fields.get("since"))
    if host is None or port is None or round_number is None or rank is None \
            or world is None or leader is None or since is None or rank >= world:
        return None
    return Assignment(round=round_number, rank=rank, world_size=world,
                      store=StoreAddress(host, port), leader=leader, since=since)


def lease_state(lease: Mapping[str, Any]) -> LeaseState:
    """Read a Lease; anything unreadable counts as no request (see ``problem``)."""
    meta = untrusted.mapping(lease.get("metadata"))
    spec = untrusted.mapping(lease.get("spec"))
    annotations = untrusted.mapping(meta.get("annotations"))
    node = untrusted.text(annotations.get(crd.NODE_ANNOTATION))
    name = untrusted.text(meta.get("name")) or "?"
    join, problem = read_join(node, annotations.get(JOIN_ANNOTATION), f"lease {name}")
    created = untrusted.read_time(meta.get("creationTimestamp"))
    if join is not None:
        join = dataclasses.replace(join, arrived=created)
    refs = meta.get("ownerReferences")
    owners = [untrusted.text(ref.get("uid")) for ref in refs if isinstance(ref, Mapping)
              and ref.get("kind") == crd.KIND] if isinstance(refs, list) else []
    return LeaseState(node=node, holder=untrusted.text(spec.get("holderIdentity")),
                      renewed=untrusted.read_time(spec.get("renewTime")),
                      duration=untrusted.number(spec.get("leaseDurationSeconds")), join=join,
                      owner_uid=owners[0] if owners else None, created=created,
                      problem=problem,
                      unreachable=read_unreachable(annotations.get(UNREACHABLE_ANNOTATION)),
                      assignment=read_assignment(annotations.get(ASSIGNMENT_ANNOTATION)))


def holder_alive(current: Mapping[str, Any], run: str, owner_uid: str | None,
                 heartbeat: float, now: dt.datetime) -> str | None:
    """The live holder of an existing Lease a node wants for itself, or None.

    Only a genuine Lease of this run (same run, same owner uid) renewed within
    the run's heartbeat has a live holder; the Lease's own duration is chosen
    by whoever wrote it and is not trusted.
    """
    state = lease_state(current)
    if lease_run(current) != run or (owner_uid is not None and state.owner_uid != owner_uid):
        return None
    if state.holder is None or state.renewed is None or state.expired(now, heartbeat):
        return None
    return state.holder


def pending_joins(leases: Iterable[LeaseState], status: RunStatus, now: dt.datetime,
                  run_uid: str | None, heartbeat: float) -> tuple[WaitingNode, ...]:
    """The nodes waiting for a round: live Leases whose join request no round answered yet.

    A request is answered when a member holds it, or when a membership that
    held it ended (the node left or was removed, its Lease not yet deleted).
    A membership also answers every *older* request of the same node: a reader
    whose Leases are older than the run it holds (the operator's Lease watch
    lagging behind its ElasticRun watch) must see a member's previous request
    as spent, not as a node waiting for the next round.  Both timestamps come
    from the agent of that name, and its next request follows the answered one
    by at least a rendezvous (or a pod restart, if it moved to another machine):
    far more than the clock skew between machines.
    A Lease counts only when it is owned by this run (``run_uid``; Leases of
    an earlier run of the same name, or of nobody, never count) and was renewed
    within the run's ``heartbeat`` (never the duration the Lease claims).
    Newcomers are ordered by when the API server created their Lease, not by
    the ``since`` their node wrote.
    """
    answered: dict[str, dt.datetime] = {}
    held = [(p.name, p.since) for p in status.participants]
    held += [(m.name, m.since) for m in status.lost_members]
    for name, since in held:
        if since is not None:
            answered[name] = max(since, answered.get(name, since))
    waiting: dict[str, WaitingNode] = {}
    for lease in leases:
        join = lease.join
        if join is None or lease.expired(now, heartbeat):
            continue
        latest = answered.get(join.name)
        if latest is not None and join.since is not None and join.since <= latest:
            continue
        if run_uid is None or lease.owner_uid != run_uid:
            continue
        waiting[join.name] = join
    return tuple(sorted(waiting.values(), key=arrival_key))
