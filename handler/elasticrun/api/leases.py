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
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from elasticrun.api import crd, untrusted
from elasticrun.api.model import (
    InvalidRunError,
    RunStatus,
    WaitingNode,
    format_time,
)
from elasticrun.api.naming import label_value, lease_name
from elasticrun.api.rounds import arrival_key

#: Annotation on a node's Lease: its join request, as JSON (a waiting entry without the name).
JOIN_ANNOTATION = f"{crd.GROUP}/join"
#: Annotation on a node's Lease: the round's rank 0 whose TCPStore it could not reach,
#: as JSON ``{"node": ..., "round": R}``.  Evidence for the operator, never a verdict.
UNREACHABLE_ANNOTATION = f"{crd.GROUP}/unreachable"
#: One past the largest round a report may name: the status counters' maximum
#: (:func:`elasticrun.api.crd.counter_maximum`).
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
    #: ``spec.renewTime`` as the node wrote it, by the node's clock: a hint,
    #: never proof of life (:class:`RenewalClock` decides that).
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
    #: The Lease's own name, uid and resourceVersion (an etcd revision when numeric), as
    #: observed: the name and uid are what the operator deletes and writes; with
    #: ``renewed`` and ``holder``, the version tells a renewal from an old copy.
    name: str | None = None
    uid: str | None = None
    version: int | None = None
    #: When the reader saw the Lease's current renewal, by the reader's own clock
    #: (:meth:`RenewalClock.observe`).  None: not observed, which counts as expired.
    seen: dt.datetime | None = None

    def expired(self, now: dt.datetime, timeout: float,
                not_before: dt.datetime | None = None) -> bool:
        """Not seen renewed for ``timeout`` (the run's heartbeat); counted from no earlier
        than ``not_before``.

        ``not_before`` is when the holder could last start renewing again (the
        API server came back), so an outage is not mistaken for a dead holder.
        A Lease no reader has observed counts as expired: only what the reader
        saw change keeps a node alive, never a time written in the object.
        """
        expiry = self.expired_at(timeout, not_before)
        return expiry is None or now > expiry

    def expired_at(self, timeout: float,
                   not_before: dt.datetime | None = None) -> dt.datetime | None:
        """When the Lease expires, by the reader's clock; None when it was never observed."""
        if self.seen is None:
            return None
        start = self.seen if not_before is None else max(self.seen, not_before)
        return start + dt.timedelta(seconds=timeout)


@dataclass(frozen=True)
class _Sighting:
    """The renewal of one Lease a reader saw last, and when it saw it."""

    renewal: tuple[str | None, dt.datetime | None, str | None]
    version: int | None
    at: dt.datetime
    #: The join request (its ``since``) on the Lease, and when it was first seen.
    request: dt.datetime | None = None
    request_at: dt.datetime | None = None


@dataclass
class RenewalClock:
    """When this reader saw each Lease renewed, by its own clock.

    The rule of Kubernetes' node lifecycle controller: a Lease counts as
    renewed at the moment its reader sees the renewal *change* (another
    ``renewTime``, holder or object), never at the time written in it.  A
    node's clock is not the reader's (a dead node whose clock ran 60 s fast
    would stay alive for 60 s more), and neither is a time anyone can write
    (a ``renewTime`` in 2199 would make a member that never expires).  So a
    Lease first seen counts as renewed when it is first seen (a restarted
    operator gives every Lease one full heartbeat), and one that never
    changes expires a heartbeat later, whatever its ``renewTime`` says.
    An older copy (a lower resourceVersion, from a watch that lags behind a
    LIST) is no renewal.  Keys are the reader's (a node name, or the
    operator's (namespace, run, node)); :meth:`forget` and :meth:`retain`
    keep its memory to the Leases that exist.
    """

    _seen: dict[Hashable, _Sighting] = field(default_factory=dict)
    #: The last state observed per key and what it was answered with: the operator
    #: passes the same index entries again on every pass of a large run.
    _answered: dict[Hashable, tuple[LeaseState, LeaseState]] = field(default_factory=dict)

    def observe(self, key: Hashable, state: LeaseState, at: dt.datetime) -> LeaseState:
        """``state`` with ``seen`` set to when this reader first saw its current renewal,
        and its join request's ``noticed`` to when this reader first saw that request."""
        answered = self._answered.get(key)
        if answered is not None and answered[0] is state and key in self._seen:
            return answered[1]
        renewal = (state.uid, state.renewed, state.holder)
        request = state.join.since if state.join is not None else None
        last = self._seen.get(key)
        if last is None:
            sighting = _Sighting(renewal, state.version, at, request, at)
        elif state.version is not None and last.version is not None \
                and state.version <= last.version:
            sighting = last  # the same copy, or an older one
        else:  # a newer copy: renewed, or asking anew, only if that changed
            sighting = _Sighting(renewal, state.version,
                                 last.at if last.renewal == renewal else at, request,
                                 last.request_at if last.request == request else at)
        self._seen[key] = sighting
        join = state.join
        if join is not None and join.since == sighting.request:
            join = dataclasses.replace(join, noticed=sighting.request_at)
        observed = dataclasses.replace(state, seen=sighting.at, join=join)
        self._answered[key] = (state, observed)
        return observed

    def renewed_at(self, key: Hashable) -> dt.datetime | None:
        """When this reader last saw the Lease under ``key`` renewed (None: never seen)."""
        last = self._seen.get(key)
        return last.at if last is not None else None

    def forget(self, key: Hashable) -> None:
        self._seen.pop(key, None)
        self._answered.pop(key, None)

    def retain(self, keep: Callable[[Hashable], bool]) -> None:
        """Forget every key ``keep`` refuses (Leases deleted, runs gone)."""
        for key in [k for k in self._seen if not keep(k)]:
            self.forget(key)

    def __len__(self) -> int:
        return len(self._seen)


def suspicion_window(heartbeat: float, renew_interval: float) -> float:
    """How long a reported rank 0 may go without renewing its Lease before it counts as lost."""
    return min(heartbeat, SUSPECT_RENEWALS * renew_interval)


def run_leases_query(run: str) -> dict[str, str]:
    """The LIST query for a run's Leases (the label may be a hash of a long name)."""
    return {"labelSelector": f"{crd.RUN_LABEL}={label_value(run)}"}


def lease_run(lease: Mapping[str, Any]) -> str | None:
    """The run a Lease belongs to: its annotation, when the label and the name agree.

    Readers list Leases by label and key them by the annotations (the label may
    be a hash of a long name).  A Lease belongs to run R and node N only when
    its label is R's label value and its name is ``lease_name(R, N)``: one
    whose label names one run and whose annotation another belongs to neither,
    and one under another name is not the Lease anybody would act on by name.
    The admission policy, which checks the writer's right to the annotation's
    run (and the label and the name), so decides for every reader.
    """
    meta = untrusted.mapping(lease.get("metadata"))
    annotations = untrusted.mapping(meta.get("annotations"))
    run = untrusted.text(annotations.get(crd.RUN_LABEL))
    node = untrusted.text(annotations.get(crd.NODE_ANNOTATION))
    label = untrusted.mapping(meta.get("labels")).get(crd.RUN_LABEL)
    if run is None or node is None or label != label_value(run) \
            or meta.get("name") != lease_name(run, node):
        return None
    return run


def owned_by(state: LeaseState, run: str, run_uid: str | None) -> bool:
    """Whether a Lease read by :func:`lease_state` is a genuine Lease of this run.

    Its owner is the run (the uid, so an earlier run of the same name does not
    count) and its name is the one its node's Lease has: the only Leases the
    operator deletes or grants a Role for.  Callers
    take ``state`` from Leases :func:`lease_run` gave to ``run``.
    """
    return run_uid is not None and state.owner_uid == run_uid and state.node is not None \
        and state.name == lease_name(run, state.node) and state.uid is not None


def leases_of(listed: Mapping[str, Any], run: str) -> list[dict[str, Any]]:
    """The items of a LIST with :func:`run_leases_query` that belong to ``run``.

    The label alone cannot tell two long names with the same hash apart; the
    annotation holds the full name (:func:`lease_run`).
    """
    items = listed.get("items")
    return [item for item in items if isinstance(item, dict) and lease_run(item) == run] \
        if isinstance(items, list) else []


def join_value(node: WaitingNode) -> str:
    """The join annotation of ``node``'s Lease: its request, and the next round's store
    it announces (never part of the run's status)."""
    entry = node.to_dict()
    entry.pop("name", None)
    if node.next_store_port is not None:
        entry["nextStorePort"] = node.next_store_port
    return json.dumps(entry, sort_keys=True)


def join_annotations(join: WaitingNode | None) -> dict[str, str | None]:
    """The annotations of a node's Lease that ask to join the next round (``join``) or
    withdraw the request (None), as one merge patch sets them (None removes one).

    The same write withdraws any report of an unreachable rank 0
    (:data:`UNREACHABLE_ANNOTATION`): the report was about the round the node is
    leaving, whose store it no longer needs, and left standing it would go on
    counting against that rank 0 for as long as the round stands.
    """
    return {JOIN_ANNOTATION: join_value(join) if join is not None else None,
            UNREACHABLE_ANNOTATION: None}


def holder_identity(node: str, nonce: str) -> str:
    """The ``holderIdentity`` one agent of ``node`` writes: the node's name, then ``@nonce``.

    Readers take at most :data:`~elasticrun.api.untrusted.MAX_NAME_CHARS` characters
    of it, so the name is cut to leave room for the nonce: a node named with the
    full 253 characters must still read back as the live holder of its Lease, or a
    second agent under the same name would not be refused.  The nonce alone tells
    agents apart; the name is there for people reading the Lease.
    """
    return f"{node[:untrusted.MAX_NAME_CHARS - len(nonce) - 1]}@{nonce}"


def node_lease(run: str, node: str, holder: str, duration: int, owner_uid: str | None,
               renewed: dt.datetime, join: WaitingNode | None = None) -> dict[str, Any]:
    """A node's Lease as its agent creates (or takes over) it, renewed at ``renewed``.

    Named for the run and the node (:func:`~elasticrun.api.naming.lease_name`),
    labelled and annotated with both (:func:`lease_run` reads them back), owned by
    the run when its uid is known (deleting the run deletes its Leases), and
    carrying the join request ``join`` when the node asks to join at once.
    """
    stamp = format_time(renewed)
    meta: dict[str, Any] = {
        "name": lease_name(run, node),
        "labels": {crd.RUN_LABEL: label_value(run)},
        "annotations": {crd.NODE_ANNOTATION: node, crd.RUN_LABEL: run},
    }
    if join is not None:
        meta["annotations"][JOIN_ANNOTATION] = join_value(join)
    if owner_uid:
        meta["ownerReferences"] = [{
            "apiVersion": crd.API_VERSION, "kind": crd.KIND, "name": run,
            "uid": owner_uid, "blockOwnerDeletion": False}]
    return {
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta,
        "spec": {"holderIdentity": holder, "leaseDurationSeconds": duration,
                 "acquireTime": stamp, "renewTime": stamp},
    }


def read_join(node: str | None, raw: Any, where: str) -> tuple[WaitingNode | None, str | None]:
    """A join request from a Lease annotation, or None and why it was not readable."""
    if node is None or raw is None or raw == "":
        return None, None
    try:
        fields = untrusted.json_object(raw)
        # A Pod cannot read its Node's labels: topology values are the operator's
        # to fill into the run's waiting entry (``rounds.with_topology``), never the node's.
        join = WaitingNode.from_dict({**fields, "name": node, "topology": None}, where)
    except (untrusted.UnreadableError, InvalidRunError) as exc:
        return None, f"{where}: join request ignored: {exc}"
    if join.since is None:
        # ``since`` identifies the request: without it no round could ever answer it.
        return None, f"{where}: join request ignored: it has no since"
    return join, None


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
    node = untrusted.text(fields.get("node"))
    round_number = untrusted.counter(fields.get("round"), 1, MAX_COUNTER)
    if node is None or round_number is None:
        return None
    return Unreachable(node=node, round=round_number)


def lease_state(lease: Mapping[str, Any], seen: dt.datetime | None = None) -> LeaseState:
    """Read a Lease; anything unreadable counts as no request (see ``problem``).

    ``seen``: when the reader saw this renewal; readers that judge liveness go
    through a :class:`RenewalClock` instead.
    """
    meta = untrusted.mapping(lease.get("metadata"))
    spec = untrusted.mapping(lease.get("spec"))
    annotations = untrusted.mapping(meta.get("annotations"))
    node = untrusted.text(annotations.get(crd.NODE_ANNOTATION))
    name = untrusted.text(meta.get("name")) or "?"
    join, problem = read_join(node, annotations.get(JOIN_ANNOTATION), f"lease {name}")
    created = untrusted.read_time(meta.get("creationTimestamp"))
    version = _revision(meta.get("resourceVersion"))
    if join is not None:
        join = dataclasses.replace(join, arrived=created, written=version)
    refs = meta.get("ownerReferences")
    owners = [untrusted.text(ref.get("uid")) for ref in refs if isinstance(ref, Mapping)
              and ref.get("kind") == crd.KIND] if isinstance(refs, list) else []
    return LeaseState(node=node, holder=untrusted.text(spec.get("holderIdentity")),
                      renewed=untrusted.read_time(spec.get("renewTime")),
                      duration=untrusted.number(spec.get("leaseDurationSeconds")), join=join,
                      owner_uid=owners[0] if owners else None, created=created,
                      problem=problem,
                      unreachable=read_unreachable(annotations.get(UNREACHABLE_ANNOTATION)),
                      name=untrusted.text(meta.get("name")),
                      uid=untrusted.text(meta.get("uid")),
                      version=version, seen=seen)


def describe_object(obj: Mapping[str, Any]) -> str:
    """What an object found under a Lease name says about itself, bounded, for a message.

    The API server does not record who created an object; its field managers
    (the clients that wrote it), its labels, annotations and owners are what
    there is to go on.
    """
    meta = untrusted.mapping(obj.get("metadata"))
    spec = untrusted.mapping(obj.get("spec"))
    annotations = untrusted.mapping(meta.get("annotations"))
    refs = meta.get("ownerReferences")
    owners = [f"{untrusted.text(r.get('kind'), 40)}/{untrusted.text(r.get('name'), 80)}"
              for r in refs[:3] if isinstance(r, Mapping)] if isinstance(refs, list) else []
    fields = meta.get("managedFields")
    managers = sorted({untrusted.text(f.get("manager"), 80) or "?" for f in fields[:5]
                       if isinstance(f, Mapping)}) if isinstance(fields, list) else []
    parts = {
        "label run": untrusted.text(untrusted.mapping(meta.get("labels")).get(crd.RUN_LABEL)),
        "annotation run": untrusted.text(annotations.get(crd.RUN_LABEL)),
        "annotation node": untrusted.text(annotations.get(crd.NODE_ANNOTATION)),
        "owners": ", ".join(owners) or None,
        "holder": untrusted.text(spec.get("holderIdentity"), 80),
        "created": untrusted.text(meta.get("creationTimestamp"), 40),
        "written by": ", ".join(managers) or None,
    }
    return "; ".join(f"{k}: {v}" for k, v in parts.items() if v is not None) or "no metadata"


def _revision(value: Any) -> int | None:
    """A resourceVersion as an etcd revision; None when it is not a plain number."""
    if not isinstance(value, str) or not value.isdigit() or len(value) > 20:
        return None
    return int(value)


def holder_alive(current: Mapping[str, Any], run: str, owner_uid: str | None,
                 heartbeat: float, now: dt.datetime) -> str | None:
    """The live holder of an existing Lease a node wants for itself, or None.

    Only a genuine Lease of this run (same run, same owner uid) renewed within
    the run's heartbeat has a live holder; the Lease's own duration is chosen
    by whoever wrote it and is not trusted.  This is one read, so there is no
    renewal to see change: the written ``renewTime`` is taken as a hint that
    may make the Lease older, never newer than now (a time in the future, from
    a fast clock or a forged one, counts as a renewal just now).
    """
    state = lease_state(current)
    if lease_run(current) != run or (owner_uid is not None and state.owner_uid != owner_uid):
        return None
    if state.renewed is not None:
        state = dataclasses.replace(state, seen=min(state.renewed, now))
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
