"""The one Python model of an ElasticRun's spec and status.

Handler and operator both read the object through :func:`parse_run` and write
status through :meth:`RunStatus.to_dict`, so a field means the same thing on
both sides.  Parsing is strict: the API server's schema guarantees types only
for objects it validated, while a hand-edited status can be well typed and
still nonsense (duplicate ranks, a hole in a sealed round).  Anything that
cannot be trusted raises :class:`InvalidRunError` naming the field, which the
handler turns into torch's ``RendezvousStateError``.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from elasticrun.api import crd, untrusted

PHASES = ("Pending", "Forming", "Running", "Degraded", "Closed", "Succeeded")
FINISHED_PHASES = ("Closed", "Succeeded")
LOST_MEMBERS_KEPT = 16
#: Most conditions and waiting entries a status keeps (the CRD's ``maxItems``).
CONDITIONS_KEPT = 16
WAITING_KEPT = 4096


class InvalidRunError(ValueError):
    """An ElasticRun field holds something the model cannot read."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def format_time(value: dt.datetime) -> str:
    """RFC 3339 with microseconds, as the API server keeps them in date-time strings."""
    return value.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def format_time_seconds(value: dt.datetime) -> str:
    """RFC 3339 in whole seconds, as core/v1 Events keep their timestamps."""
    return value.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: Any) -> dt.datetime | None:
    """An RFC 3339 time from an object we do not own (Pods, Leases); None if unreadable.

    Clamped to a sane window (:func:`elasticrun.api.untrusted.read_time`).
    """
    return untrusted.read_time(value)


# --------------------------------------------------------------------------- readers

_T = TypeVar("_T")


def _mapping(value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise InvalidRunError(path, f"expected an object, found {type(value).__name__}")
    return value


def _list(value: Any, path: str) -> Sequence[Any]:
    if value is None:
        return ()
    if not isinstance(value, list | tuple):
        raise InvalidRunError(path, f"expected a list, found {type(value).__name__}")
    return value


def _int(obj: Mapping[str, Any], key: str, path: str, default: int | None = None,
         minimum: int | None = 0) -> int:
    value = obj.get(key, default)
    if value is None:
        raise InvalidRunError(f"{path}.{key}", "is missing")
    # bool is an int in Python; in the schema it is not.
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRunError(f"{path}.{key}", f"expected an integer, found {value!r}")
    if minimum is not None and value < minimum:
        raise InvalidRunError(f"{path}.{key}", f"must be >= {minimum}, found {value}")
    return value


def _opt_int(obj: Mapping[str, Any], key: str, path: str, minimum: int = 0) -> int | None:
    if obj.get(key) is None:
        return None
    return _int(obj, key, path, minimum=minimum)


def _count(obj: Mapping[str, Any], key: str, path: str, default: int | None = None) -> int:
    """A counter of the status (round, signal, rank, ...): 0..``crd.counter_maximum()``.

    The schema refuses larger values; a CRD installed before it had a maximum
    does not, so the model refuses them too, naming the bound.
    """
    value = _int(obj, key, path, default)
    if value > crd.counter_maximum():
        raise InvalidRunError(f"{path}.{key}", f"must be <= {crd.counter_maximum()} (the "
                              f"schema's maximum for counters), found {value}")
    return value


def _opt_count(obj: Mapping[str, Any], key: str, path: str) -> int | None:
    return None if obj.get(key) is None else _count(obj, key, path)


def next_signal(signal: int) -> int:
    """The signal after ``signal``: any other value wakes the watchers, so it wraps to 1.

    Nodes watch with ``status.signal!=S`` and only ever ask whether it changed,
    so a signal at the counters' maximum goes on instead of failing every write.
    """
    return signal + 1 if signal < crd.counter_maximum() else 1


def capped(value: int) -> int:
    """``value`` no larger than the counters' maximum (``metadata.generation`` is int64)."""
    return min(value, crd.counter_maximum())


def _str(obj: Mapping[str, Any], key: str, path: str, default: str | None = None) -> str:
    value = obj.get(key, default)
    if not isinstance(value, str) or (value == "" and default is None):
        raise InvalidRunError(f"{path}.{key}", f"expected a non-empty string, found {value!r}")
    return value


def _opt_str(obj: Mapping[str, Any], key: str, path: str) -> str | None:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidRunError(f"{path}.{key}", f"expected a string, found {value!r}")
    return value


#: Longest Pod uid accepted (a UUID is 36 characters; the CRD allows 64).
MAX_POD_UID = 64


def _pod_uid(obj: Mapping[str, Any], path: str) -> str | None:
    value = _opt_str(obj, "podUID", path)
    if value is not None and not 0 < len(value) <= MAX_POD_UID:
        raise InvalidRunError(f"{path}.podUID", f"expected 1 to {MAX_POD_UID} characters")
    return value


#: The largest pod index a waiting entry keeps (the CRD's int32 maximum); any
#: other value of ``index`` reads as no index.
MAX_POD_INDEX = 2**31 - 1
#: At most this many topology values per entry, each cut to a label value's 63 characters.
MAX_TOPOLOGY_VALUES = 4
MAX_TOPOLOGY_CHARS = 63


def _pod_index(obj: Mapping[str, Any]) -> int | None:
    """A waiting entry's pod index, tolerantly: anything but a whole number in
    0..:data:`MAX_POD_INDEX` is no index, never an error (the entry still joins,
    ranked by what else it says)."""
    value = obj.get("index")
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_POD_INDEX:
        return None
    return value


def _topology(obj: Mapping[str, Any]) -> tuple[str, ...]:
    """A waiting entry's topology values, tolerantly: a list of at most
    :data:`MAX_TOPOLOGY_VALUES` strings, each cut to :data:`MAX_TOPOLOGY_CHARS`;
    a value that is not a string reads as "" (its domain is unknown)."""
    value = obj.get("topology")
    if not isinstance(value, list):
        return ()
    return tuple(item[:MAX_TOPOLOGY_CHARS] if isinstance(item, str) else ""
                 for item in value[:MAX_TOPOLOGY_VALUES])


def _bool(obj: Mapping[str, Any], key: str, path: str, default: bool) -> bool:
    value = obj.get(key, default)
    if not isinstance(value, bool):
        raise InvalidRunError(f"{path}.{key}", f"expected true or false, found {value!r}")
    return value


def _time(obj: Mapping[str, Any], key: str, path: str) -> dt.datetime | None:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidRunError(f"{path}.{key}", f"expected an RFC 3339 time, found {value!r}")
    parsed = untrusted.read_time(value)
    if parsed is None:
        raise InvalidRunError(f"{path}.{key}",
                              f"expected an RFC 3339 time, found {value[:64]!r}")
    # Status is written by nodes: a time in year 9999 is clamped, never left to
    # overflow the first time a timeout is added to it.
    return parsed


def _port(obj: Mapping[str, Any], key: str, path: str) -> int | None:
    port = _opt_int(obj, key, path, minimum=1)
    if port is not None and port > 65535:
        raise InvalidRunError(f"{path}.{key}", f"must be a TCP port (1-65535), found {port}")
    return port


def _drop_none(values: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in values.items() if value is not None}


# --------------------------------------------------------------------------- spec


@dataclass(frozen=True)
class RunSpec:
    """What the user asked for; defaults come from the CRD schema."""

    min_nodes: int = field(default_factory=lambda: int(crd.spec_default("minNodes")))
    max_nodes: int = field(default_factory=lambda: int(crd.spec_default("minNodes")))
    join_timeout: int = field(default_factory=lambda: int(crd.spec_default("joinTimeoutSeconds")))
    last_call_timeout: int = field(
        default_factory=lambda: int(crd.spec_default("lastCallTimeoutSeconds")))
    heartbeat_timeout: int = field(
        default_factory=lambda: int(crd.spec_default("heartbeatTimeoutSeconds")))
    lease_renew_interval: int = field(
        default_factory=lambda: int(crd.spec_default("leaseRenewIntervalSeconds")))
    closed: bool = False
    ttl_seconds_after_finished: int | None = None

    @classmethod
    def from_dict(cls, spec: Any) -> RunSpec:
        obj = _mapping(spec if spec is not None else {}, "spec")
        defaults = cls()
        min_nodes = _int(obj, "minNodes", "spec", defaults.min_nodes, minimum=1)
        max_nodes = _int(obj, "maxNodes", "spec", min_nodes, minimum=1)
        if max_nodes < min_nodes:
            raise InvalidRunError("spec.maxNodes", f"{max_nodes} is below minNodes {min_nodes}")
        return cls(
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            join_timeout=_int(obj, "joinTimeoutSeconds", "spec", defaults.join_timeout, 1),
            last_call_timeout=_int(obj, "lastCallTimeoutSeconds", "spec",
                                   defaults.last_call_timeout, 0),
            heartbeat_timeout=_int(obj, "heartbeatTimeoutSeconds", "spec",
                                   defaults.heartbeat_timeout, 1),
            lease_renew_interval=_int(obj, "leaseRenewIntervalSeconds", "spec",
                                      defaults.lease_renew_interval, 1),
            closed=_bool(obj, "closed", "spec", False),
            ttl_seconds_after_finished=_opt_int(obj, "ttlSecondsAfterFinished", "spec"),
        )

    def to_dict(self) -> dict[str, Any]:
        return _drop_none({
            "minNodes": self.min_nodes,
            "maxNodes": self.max_nodes,
            "joinTimeoutSeconds": self.join_timeout,
            "lastCallTimeoutSeconds": self.last_call_timeout,
            "heartbeatTimeoutSeconds": self.heartbeat_timeout,
            "leaseRenewIntervalSeconds": self.lease_renew_interval,
            "closed": self.closed,
            "ttlSecondsAfterFinished": self.ttl_seconds_after_finished,
        })


# --------------------------------------------------------------------------- status parts


@dataclass(frozen=True)
class StoreAddress:
    host: str
    port: int

    def to_dict(self) -> dict[str, Any]:
        return {"host": self.host, "port": self.port}


@dataclass(frozen=True)
class Participant:
    name: str
    rank: int
    address: str | None = None
    store_port: int | None = None
    joined_round: int = 0
    pod: str | None = None
    #: The join request this membership answered (the node's ``since``): a node
    #: whose Lease still carries it is a member, not waiting.
    since: dt.datetime | None = None
    #: The uid of the member's Pod, as its handler read it (downward API ``POD_UID``):
    #: only an event of that very Pod is the member's loss, not one of a namesake.
    pod_uid: str | None = None

    @classmethod
    def from_dict(cls, obj: Any, path: str) -> Participant:
        item = _mapping(obj, path)
        return cls(
            name=_str(item, "name", path),
            rank=_count(item, "rank", path),
            address=_opt_str(item, "address", path),
            store_port=_port(item, "storePort", path),
            joined_round=_count(item, "joinedRound", path, 0),
            pod=_opt_str(item, "pod", path),
            since=_time(item, "since", path),
            pod_uid=_pod_uid(item, path),
        )

    def to_dict(self) -> dict[str, Any]:
        return _drop_none({
            "name": self.name, "rank": self.rank, "address": self.address,
            "storePort": self.store_port, "joinedRound": self.joined_round, "pod": self.pod,
            "since": format_time(self.since) if self.since else None, "podUID": self.pod_uid,
        })


@dataclass(frozen=True)
class Assignment:
    """What a member must know of a sealed round: its place in it, and where to meet.

    Derived from the status (:meth:`RunStatus.assignment`).  In the largest runs the
    operator also writes it into the run's slices, so that a member learns its
    rank from one small object instead of the whole roster (see
    :func:`elasticrun.api.rounds.members_told_in_slices`).
    """

    round: int
    rank: int
    world_size: int
    #: None only in a status sealed without one (an error the handler reports).
    store: StoreAddress | None
    #: The round's rank 0, whose Lease a member looks at when its store is silent;
    #: None once a re-forming round has lost it.
    leader: str | None
    #: The join request this assignment answers (the member's ``since``).
    since: dt.datetime | None = None

    def to_dict(self) -> dict[str, Any]:
        return _drop_none({
            "round": self.round, "rank": self.rank, "worldSize": self.world_size,
            "store": self.store.to_dict() if self.store else None, "leader": self.leader,
            "since": format_time(self.since) if self.since else None,
        })


@dataclass(frozen=True)
class WaitingNode:
    """A node's request to be in the next round; each node writes only its own."""

    name: str
    address: str | None = None
    store_port: int | None = None
    since: dt.datetime | None = None
    pod: str | None = None
    #: The uid of the node's Pod (see :attr:`Participant.pod_uid`).
    pod_uid: str | None = None
    #: When the API server created the node's Lease (``creationTimestamp``):
    #: what orders newcomers, because ``since`` is whatever the node claims.
    #: Read from the Lease, never stored in the status, not part of equality.
    arrived: dt.datetime | None = field(default=None, compare=False)
    #: When the reader first saw this request, by the reader's own clock
    #: (:class:`elasticrun.api.leases.RenewalClock`): how old the request is,
    #: because ``since`` is the node's clock.  Never stored, not part of equality.
    noticed: dt.datetime | None = field(default=None, compare=False)
    #: The resourceVersion (an etcd revision) of the Lease that carries the request, as
    #: listed: its last write, in a formation the request itself, in the API server's
    #: order of writes (:func:`elasticrun.api.rounds.seal_turn`).  Never stored, not
    #: part of equality.
    written: int | None = field(default=None, compare=False)
    #: The Pod's index in its workload (an Indexed Job's completion index, a
    #: StatefulSet's ordinal), as the node says in its join request: orders
    #: newcomers, and is the rank an indexed newcomer takes where it is free
    #: (:func:`elasticrun.api.rounds.order_for_ranks`).  Untrusted and bounded
    #: (:func:`_pod_index`); only ever reorders ranks within the run.
    index: int | None = None
    #: The values of the configured topology keys of the node's Node, in the
    #: keys' order ("" for a key the Node lacks): orders newcomers without an
    #: index, so that a domain's nodes get consecutive ranks.  Bounded
    #: (:func:`_topology`).
    topology: tuple[str, ...] = ()
    #: The port of the store the node serves for the round after the one this request
    #: got it (rank 0's announcement, :func:`elasticrun.api.rounds.kept_places`): that
    #: round keeps rank 0's place without a new request.  Only on the node's Lease,
    #: not part of equality: the request is the same.
    next_store_port: int | None = field(default=None, compare=False)

    @property
    def asked_at(self) -> dt.datetime | None:
        """How old the request is, as this reader knows it: when it noticed it, else ``since``."""
        return self.noticed or self.since

    @classmethod
    def from_dict(cls, obj: Any, path: str) -> WaitingNode:
        item = _mapping(obj, path)
        return cls(
            name=_str(item, "name", path),
            address=_opt_str(item, "address", path),
            store_port=_port(item, "storePort", path),
            since=_time(item, "since", path),
            pod=_opt_str(item, "pod", path),
            pod_uid=_pod_uid(item, path),
            index=_pod_index(item),
            topology=_topology(item),
            next_store_port=_port(item, "nextStorePort", path),
        )

    def to_dict(self) -> dict[str, Any]:
        return _drop_none({
            "name": self.name, "address": self.address, "storePort": self.store_port,
            "since": format_time(self.since) if self.since else None, "pod": self.pod,
            "podUID": self.pod_uid, "index": self.index,
            "topology": list(self.topology) if self.topology else None,
        })


@dataclass(frozen=True)
class LostMember:
    name: str
    round: int
    reason: str
    message: str | None = None
    time: dt.datetime | None = None
    detection_seconds: float | None = None
    #: The join request of the membership that ended, so that a stale request
    #: still on the node's Lease is never taken for a new one.
    since: dt.datetime | None = None

    @classmethod
    def from_dict(cls, obj: Any, path: str) -> LostMember:
        item = _mapping(obj, path)
        detection = item.get("detectionSeconds")
        if detection is not None and (isinstance(detection, bool)
                                      or not isinstance(detection, int | float)):
            raise InvalidRunError(f"{path}.detectionSeconds", f"expected a number, found "
                                  f"{detection!r}")
        return cls(
            name=_str(item, "name", path),
            round=_count(item, "round", path),
            reason=_str(item, "reason", path),
            message=_opt_str(item, "message", path),
            time=_time(item, "time", path),
            detection_seconds=untrusted.number(detection) if detection is not None else None,
            since=_time(item, "since", path),
        )

    def to_dict(self) -> dict[str, Any]:
        return _drop_none({
            "name": self.name, "round": self.round, "reason": self.reason,
            "message": self.message, "time": format_time(self.time) if self.time else None,
            "detectionSeconds": self.detection_seconds,
            "since": format_time(self.since) if self.since else None,
        })


@dataclass(frozen=True)
class Condition:
    type: str
    status: str
    reason: str | None = None
    message: str | None = None
    last_transition_time: dt.datetime | None = None
    observed_generation: int | None = None

    @classmethod
    def from_dict(cls, obj: Any, path: str) -> Condition:
        item = _mapping(obj, path)
        status = _str(item, "status", path)
        if status not in ("True", "False", "Unknown"):
            raise InvalidRunError(f"{path}.status", f"expected True, False or Unknown, found "
                                  f"{status!r}")
        return cls(
            type=_str(item, "type", path),
            status=status,
            reason=_opt_str(item, "reason", path),
            message=_opt_str(item, "message", path),
            last_transition_time=_time(item, "lastTransitionTime", path),
            observed_generation=_opt_count(item, "observedGeneration", path),
        )

    def to_dict(self) -> dict[str, Any]:
        return _drop_none({
            "type": self.type, "status": self.status, "reason": self.reason,
            "message": self.message,
            "lastTransitionTime": (format_time(self.last_transition_time)
                                   if self.last_transition_time else None),
            "observedGeneration": (capped(self.observed_generation)
                                   if self.observed_generation is not None else None),
        })


def set_condition(conditions: tuple[Condition, ...], type_: str, status: bool, reason: str,
                  message: str, now: dt.datetime, generation: int) -> tuple[Condition, ...]:
    """Replace one condition, keeping lastTransitionTime unless its status flips."""
    value = "True" if status else "False"
    old = next((c for c in conditions if c.type == type_), None)
    since = old.last_transition_time if old and old.status == value else now
    new = Condition(type=type_, status=value, reason=reason, message=message,
                    last_transition_time=since, observed_generation=generation)
    if old == new:
        return conditions
    rest = tuple(c for c in conditions if c.type != type_)
    return (*rest, new)


# --------------------------------------------------------------------------- status


@dataclass(frozen=True)
class Desired:
    """How many nodes the owner of the run's pods asks for, as the operator read it.

    ``size`` is the owner's own count (Job ``parallelism``, StatefulSet
    ``replicas``, JobSet replicas x parallelism, TrainJob ``numNodes``);
    ``source`` names the owner as ``Kind/name``; ``coming`` counts that owner's
    pods which exist but have not asked to join yet (gated, Pending, starting).
    Only the operator writes it; nodes carry it through their replace of the status.
    """

    size: int
    source: str | None = None
    coming: int = 0

    @classmethod
    def from_status(cls, obj: Mapping[str, Any]) -> Desired | None:
        size = _opt_count(obj, "desired", "status")
        if size is None:
            return None
        return cls(size=size, source=_opt_str(obj, "desiredFrom", "status"),
                   coming=_count(obj, "coming", "status", 0))

    def to_status(self) -> dict[str, Any]:
        return _drop_none({"desired": capped(self.size), "desiredFrom": self.source,
                           "coming": capped(self.coming)})



@dataclass(frozen=True)
class RunStatus:
    """Membership state of a run: one explicit object, replaced whole on every seal."""

    phase: str = "Pending"
    round: int = 0
    signal: int = 0
    join_notice: int = 0
    restart_round: int = 0
    participants: tuple[Participant, ...] = ()
    waiting: tuple[WaitingNode, ...] = ()
    store: StoreAddress | None = None
    lost_members: tuple[LostMember, ...] = ()
    conditions: tuple[Condition, ...] = ()
    sealed_at: dt.datetime | None = None
    finished_at: dt.datetime | None = None
    waiting_count: int | None = None
    observed_generation: int | None = None
    #: The owner's desired size (see :class:`Desired`); None when no owner says.
    desired: Desired | None = None
    #: The run's pods on a Node showing an ``exclude`` or ``drain`` signal
    #: (``--node-signal``): a member or waiting node whose ``pod`` is one of them is
    #: held back from the next rounds.  By pod, because the operator knows a pod's
    #: Node before its node joins.  Only the operator writes it; nodes carry it
    #: through their replace of the status.
    excluded_pods: tuple[str, ...] = ()

    # ------------------------------------------------------------------ derived views

    @property
    def member_names(self) -> frozenset[str]:
        return frozenset(p.name for p in self.participants)

    @property
    def waiting_names(self) -> frozenset[str]:
        return frozenset(w.name for w in self.waiting)

    def participant(self, name: str) -> Participant | None:
        return next((p for p in self.participants if p.name == name), None)

    def waiting_node(self, name: str) -> WaitingNode | None:
        return next((w for w in self.waiting if w.name == name), None)

    @property
    def leader(self) -> str | None:
        """Rank 0 of the current round (None once a re-forming round has lost it)."""
        return next((p.name for p in self.participants if p.rank == 0), None)

    def assignment(self, name: str) -> Assignment | None:
        """``name``'s place in the current round; None when it is not a member."""
        me = self.participant(name)
        return None if me is None else self._assignment_of(me, self.leader)

    def assignments(self) -> dict[str, Assignment]:
        """Every member's place in the current round, by name, in rank order."""
        leader = self.leader
        return {p.name: self._assignment_of(p, leader)
                for p in sorted(self.participants, key=lambda p: p.rank)}

    def _assignment_of(self, member: Participant, leader: str | None) -> Assignment:
        return Assignment(round=self.round, rank=member.rank,
                          world_size=len(self.participants), store=self.store, leader=leader,
                          since=member.since)

    @property
    def degraded(self) -> bool:
        """The current round must be re-formed (lost member, drain or restart)."""
        return self.round > 0 and self.restart_round >= self.round

    @property
    def stable_round(self) -> int:
        """The current round while nothing disturbed it, else 0: ``status.stableRound``.

        Disturbed: it must re-form (a loss, a drain, a restart asked for:
        :attr:`degraded`), or a waiting node was announced to it
        (``joinNotice``).  A round superseded by a newer one is no longer the
        current round, so its number is no longer the value either: round R is
        disturbed exactly when this is not R, the one rule that
        ``rounds.nodes_waiting`` and ``rounds.announce_needed`` read too.  A closed or
        finished run keeps its round's number, whatever happened to it: its
        members are never told to restart (``rounds.nodes_waiting``), so waking
        them would only have them re-read the run for nothing.  The
        value is written with every status (:meth:`to_dict`) and never read
        back: it exists so that a member of round R can watch the run with the
        field selector ``status.stableRound!=R`` (a selectable field of the
        CRD) and receive one event, of metadata only, when R is disturbed
        (:mod:`elasticrun.handler.watcher`).  A value another writer left
        there is a wake-up at most, never a membership fact: the member that
        wakes reads the run before it acts.
        """
        if self.phase in FINISHED_PHASES:
            return self.round
        if self.round == 0 or self.degraded or self.join_notice >= self.round:
            return 0
        return self.round

    def condition(self, type_: str) -> Condition | None:
        return next((c for c in self.conditions if c.type == type_), None)

    # ------------------------------------------------------------------ (de)serialisation

    @classmethod
    def from_dict(cls, status: Any) -> RunStatus:
        obj = _mapping(status if status is not None else {}, "status")
        phase = obj.get("phase", "Pending")
        if phase not in PHASES:
            raise InvalidRunError("status.phase", f"expected one of {', '.join(PHASES)}, "
                                  f"found {phase!r}")
        participants = tuple(
            Participant.from_dict(item, f"status.participants[{i}]")
            for i, item in enumerate(_list(obj.get("participants"), "status.participants")))
        waiting = tuple(
            WaitingNode.from_dict(item, f"status.waiting[{i}]")
            for i, item in enumerate(_list(obj.get("waiting"), "status.waiting")))
        lost = tuple(
            LostMember.from_dict(item, f"status.lostMembers[{i}]")
            for i, item in enumerate(_list(obj.get("lostMembers"), "status.lostMembers")))
        conditions = tuple(
            Condition.from_dict(item, f"status.conditions[{i}]")
            for i, item in enumerate(_list(obj.get("conditions"), "status.conditions")))
        store = None
        if obj.get("store") is not None:
            raw = _mapping(obj["store"], "status.store")
            port = _port(raw, "port", "status.store")
            if port is None:
                raise InvalidRunError("status.store.port", "is missing")
            store = StoreAddress(host=_str(raw, "host", "status.store"), port=port)
        parsed = cls(
            phase=phase,
            round=_count(obj, "round", "status", 0),
            signal=_count(obj, "signal", "status", 0),
            join_notice=_count(obj, "joinNotice", "status", 0),
            restart_round=_count(obj, "restartRound", "status", 0),
            participants=participants,
            waiting=waiting,
            store=store,
            lost_members=lost,
            conditions=conditions,
            sealed_at=_time(obj, "sealedAt", "status"),
            finished_at=_time(obj, "finishedAt", "status"),
            waiting_count=_opt_count(obj, "waitingCount", "status"),
            observed_generation=_opt_count(obj, "observedGeneration", "status"),
            desired=Desired.from_status(obj),
            excluded_pods=tuple(
                _str({"pod": item}, "pod", f"status.excludedPods[{i}]")
                for i, item in enumerate(_list(obj.get("excludedPods"),
                                               "status.excludedPods"))),
        )
        parsed._check_consistent()
        return parsed

    def _check_consistent(self) -> None:
        """Reject well-typed nonsense that would make nodes disagree on ranks."""
        if self.round >= crd.counter_maximum():
            raise InvalidRunError(
                "status.round", f"is {self.round}, the schema's maximum, so no round can "
                "follow it; it was written by hand: write a lower round (kubectl patch "
                "elasticrun NAME --subresource=status --type=merge -p "
                "'{\"status\":{\"round\":0}}'), or let the operator repair it")
        names = [p.name for p in self.participants]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise InvalidRunError("status.participants", f"duplicate member names {dup}")
        waiting = [w.name for w in self.waiting]
        if len(set(waiting)) != len(waiting):
            dup = sorted({n for n in waiting if waiting.count(n) > 1})
            raise InvalidRunError("status.waiting", f"duplicate node names {dup}")
        ranks = sorted(p.rank for p in self.participants)
        if len(set(ranks)) != len(ranks):
            dup_ranks = sorted({r for r in ranks if ranks.count(r) > 1})
            raise InvalidRunError("status.participants", f"duplicate ranks {dup_ranks}")
        if self.participants and self.round == 0:
            raise InvalidRunError("status.round", "is 0 but the round has participants")
        if self.participants and not self.degraded and ranks != list(range(len(ranks))):
            raise InvalidRunError(
                "status.participants",
                f"ranks of sealed round {self.round} must be 0..{len(ranks) - 1}, found {ranks} "
                "(a member is missing without the round being marked for restart)")
        for p in self.participants:
            if p.joined_round > self.round:
                raise InvalidRunError("status.participants",
                                      f"{p.name} joined round {p.joined_round}, after the "
                                      f"current round {self.round}")
        if self.participants and not self.degraded and self.store is None:
            raise InvalidRunError("status.store", f"is missing while round {self.round} has "
                                  "members")
        if self.restart_round > self.round:
            raise InvalidRunError("status.restartRound", f"{self.restart_round} is after the "
                                  f"current round {self.round}")

    def to_dict(self) -> dict[str, Any]:
        """The whole status, as written by a compare-and-set replace of ``/status``."""
        return _drop_none({
            "phase": self.phase,
            "round": self.round,
            "signal": self.signal,
            "joinNotice": self.join_notice,
            "restartRound": self.restart_round,
            "stableRound": self.stable_round,
            "memberCount": len(self.participants),
            "waitingCount": len(self.waiting),
            "participants": [p.to_dict() for p in self.participants],
            "waiting": [w.to_dict() for w in self.waiting[:WAITING_KEPT]],
            "store": self.store.to_dict() if self.store else None,
            "lostMembers": [m.to_dict() for m in self.lost_members],
            "conditions": [c.to_dict() for c in self.conditions[-CONDITIONS_KEPT:]],
            "sealedAt": format_time(self.sealed_at) if self.sealed_at else None,
            "finishedAt": format_time(self.finished_at) if self.finished_at else None,
            "observedGeneration": (capped(self.observed_generation)
                                   if self.observed_generation is not None else None),
            **(self.desired.to_status() if self.desired else {}),
            "excludedPods": list(self.excluded_pods[:WAITING_KEPT]) or None,
        })

    def replace(self, **changes: Any) -> RunStatus:
        return dataclasses.replace(self, **changes)


# --------------------------------------------------------------------------- the object


@dataclass(frozen=True)
class ElasticRun:
    """A parsed ElasticRun with the ``resourceVersion`` that fences writes to it."""

    name: str
    namespace: str
    spec: RunSpec
    status: RunStatus
    resource_version: str
    generation: int = 0
    uid: str | None = None
    annotations: Mapping[str, str] = field(default_factory=dict)

    @property
    def closed(self) -> bool:
        return self.spec.closed or self.status.phase in FINISHED_PHASES

    def replace_status(self, status: RunStatus) -> ElasticRun:
        return dataclasses.replace(self, status=status)

    @property
    def drained(self) -> frozenset[str]:
        raw = self.annotations.get(crd.DRAIN_ANNOTATION, "")
        return frozenset(n.strip() for n in raw.split(",") if n.strip())

    def held_back(self, entries: Iterable[Participant | WaitingNode]) -> frozenset[str]:
        """The names of ``entries`` that stay waiting, unadmitted: drained by the user's
        annotation, or on a pod the operator excluded (``status.excludedPods``).

        Only an entry that named its Pod is on a pod: a node name is never read
        as a pod name, or a namesake Pod on an excluded Node would hold back a
        node that has no Pod at all."""
        drained, excluded = self.drained, frozenset(self.status.excluded_pods)
        return frozenset(e.name for e in entries
                         if e.name in drained or (e.pod is not None and e.pod in excluded))


def parse_run(obj: Mapping[str, Any]) -> ElasticRun:
    """Read an ElasticRun as returned by the API server (a dict)."""
    meta = _mapping(obj.get("metadata"), "metadata")
    annotations = meta.get("annotations") or {}
    return ElasticRun(
        name=_str(meta, "name", "metadata"),
        namespace=_str(meta, "namespace", "metadata", default=""),
        spec=RunSpec.from_dict(obj.get("spec")),
        status=RunStatus.from_dict(obj.get("status")),
        resource_version=str(meta.get("resourceVersion", "")),
        generation=_int(meta, "generation", "metadata", 0),
        uid=_opt_str(meta, "uid", "metadata"),
        annotations=dict(_mapping(annotations, "metadata.annotations")),
    )


def new_run_manifest(name: str, namespace: str, spec: RunSpec,
                     labels: Mapping[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": crd.API_VERSION,
        "kind": crd.KIND,
        "metadata": _drop_none({"name": name, "namespace": namespace,
                                "labels": dict(labels) if labels else None}),
        "spec": spec.to_dict(),
    }
