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

import datetime as dt
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from elasticrun.api import crd
from elasticrun.api.model import InvalidRunError, RunStatus, WaitingNode, parse_time
from elasticrun.api.naming import label_value

#: Annotation on a node's Lease: its join request, as JSON (a waiting entry without the name).
JOIN_ANNOTATION = f"{crd.GROUP}/join"


@dataclass(frozen=True)
class LeaseState:
    node: str | None
    holder: str | None
    renewed: dt.datetime | None
    duration: float
    join: WaitingNode | None = None
    #: uid of the ElasticRun the Lease belongs to (its ownerReference).
    owner_uid: str | None = None

    def expired(self, now: dt.datetime, not_before: dt.datetime | None = None) -> bool:
        """Not renewed for its duration; with ``not_before``, counted from no earlier than that.

        ``not_before`` is when the holder could last start renewing again (the
        API server came back), so an outage is not mistaken for a dead holder.
        """
        expiry = self.expired_at(not_before)
        return expiry is not None and now > expiry

    def expired_at(self, not_before: dt.datetime | None = None) -> dt.datetime | None:
        if self.renewed is None:
            return None
        start = self.renewed if not_before is None else max(self.renewed, not_before)
        return start + dt.timedelta(seconds=self.duration)


def run_leases_query(run: str) -> dict[str, str]:
    """The LIST query for a run's Leases (the label may be a hash of a long name)."""
    return {"labelSelector": f"{crd.RUN_LABEL}={label_value(run)}"}


def leases_of(listed: Mapping[str, Any], run: str) -> list[dict[str, Any]]:
    """The items of a LIST with :func:`run_leases_query` that belong to ``run``.

    The label alone cannot tell two long names with the same hash apart; the
    annotation holds the full name.
    """
    return [item for item in listed.get("items") or []
            if ((item.get("metadata") or {}).get("annotations") or {})
            .get(crd.RUN_LABEL) == run]


def join_value(node: WaitingNode) -> str:
    entry = node.to_dict()
    entry.pop("name", None)
    return json.dumps(entry, sort_keys=True)


def lease_state(lease: Mapping[str, Any]) -> LeaseState:
    """Read a Lease; a malformed join request counts as no request."""
    meta = lease.get("metadata") or {}
    spec = lease.get("spec") or {}
    annotations = meta.get("annotations") or {}
    node = annotations.get(crd.NODE_ANNOTATION)
    join = None
    raw = annotations.get(JOIN_ANNOTATION)
    if node and raw:
        try:
            fields = json.loads(raw)
            join = WaitingNode.from_dict({**fields, "name": node}, f"lease {meta.get('name')}")
        except (ValueError, TypeError, InvalidRunError):
            join = None
    owners = [ref.get("uid") for ref in meta.get("ownerReferences") or []
              if ref.get("kind") == crd.KIND]
    return LeaseState(node=node, holder=spec.get("holderIdentity"),
                      renewed=parse_time(spec.get("renewTime")),
                      duration=float(spec.get("leaseDurationSeconds") or 0), join=join,
                      owner_uid=owners[0] if owners else None)


def pending_joins(leases: Iterable[LeaseState], status: RunStatus, now: dt.datetime,
                  run_uid: str | None = None) -> tuple[WaitingNode, ...]:
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
    Leases of an earlier run of the same name (another owner uid) never count.
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
        if join is None or lease.expired(now):
            continue
        latest = answered.get(join.name)
        if latest is not None and join.since is not None and join.since <= latest:
            continue
        if run_uid and lease.owner_uid and lease.owner_uid != run_uid:
            continue
        waiting[join.name] = join
    return tuple(sorted(waiting.values(),
                        key=lambda w: (w.since or dt.datetime.max.replace(tzinfo=dt.UTC),
                                       w.name)))
