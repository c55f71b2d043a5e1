"""Assignment slices: a sealed round's places, told in a fixed number of objects.

In the largest runs (:func:`elasticrun.api.rounds.members_told_in_slices`) the
operator's seal does not move the run's ``signal``, which would send the whole
roster to every node.  It writes each member's place into one of
:data:`SLICE_COUNT` ``ElasticRunSlice`` objects instead, the one the member's
name hashes into (:func:`slice_index`), and each member watches that one slice
by name.  As an EndpointSlice holds part of a Service's endpoints, a slice
holds part of a round: a round of 2,048 members costs the operator 32 writes
rather than one per member, and a member receives the places of about 64.

What every member of a round shares (the round, its world size, its store and
its rank 0) is written once in a slice; each place holds only what is the
member's own, its rank and the join request it answers.  Every member
receives its whole slice, so a place's bytes are paid once per member of the
slice: about 60 bytes, where a whole encoded assignment is about 200.

Slices are named after the run's uid (:func:`slice_name`): two runs never
share one, and a run created again under an old name never reads the slices of
the run before it.  Only the operator may write them (the chart's RBAC; pods
get, list and watch), each is owned by its run, and a member still reads its
slice as it reads anything on the API server: tolerantly, for its own run and
its own join request only (:func:`read_place`).
"""

from __future__ import annotations

import datetime as dt
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, NamedTuple

from elasticrun.api import crd, untrusted
from elasticrun.api.model import Assignment, StoreAddress, format_time
from elasticrun.api.naming import label_value

#: Slices per run.  With the CRD's 2,048 nodes, about 64 places in each: a member's
#: event stays a few kilobytes, and the operator's writes per round stay few.
SLICE_COUNT = 32
#: One past the largest round, rank or world size a slice may name: the status
#: counters' maximum (:func:`elasticrun.api.crd.counter_maximum`).
_COUNTER_END = crd.counter_maximum() + 1


@lru_cache(maxsize=8192)
def slice_index(node: str) -> int:
    """The slice ``node``'s place is told in: a stable hash of its name, the same in
    every process and every Python (not :func:`hash`, which is salted per process)."""
    digest = hashlib.sha256(node.encode()).digest()
    return int.from_bytes(digest[:4], "big") % SLICE_COUNT


def slice_name(run_uid: str, index: int) -> str:
    """The name of slice ``index`` of the run with ``run_uid`` (a uid is a valid name)."""
    return f"{run_uid}-{index:02d}"


def slice_names(run_uid: str) -> list[str]:
    """Every slice name of the run with ``run_uid``: what a per-run Role grants."""
    return [slice_name(run_uid, index) for index in range(SLICE_COUNT)]


def slices_path(namespace: str) -> str:
    return f"/apis/{crd.API_VERSION}/namespaces/{namespace}/{crd.SLICE_PLURAL}"


def slice_path(namespace: str, name: str) -> str:
    return f"{slices_path(namespace)}/{name}"


class Place(NamedTuple):
    """A member's own part of its assignment: its rank, and the join request it answers."""

    rank: int
    since: dt.datetime | None

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank,
                **({"since": format_time(self.since)} if self.since else {})}


@dataclass(frozen=True)
class Slice:
    """Slice ``index`` as round ``round`` fills it: the round's shared terms once, and by
    node the member's own :class:`Place`."""

    index: int
    round: int
    world_size: int
    store: StoreAddress | None
    leader: str | None
    places: Mapping[str, Place]

    def manifest(self, run: str, namespace: str, run_uid: str) -> dict[str, Any]:
        """The slice as the operator applies it: the whole slice, owned by the run and
        labelled with it (``kubectl get elasticrunslices -l elasticrun.dev/run=...``);
        a node of an earlier round that is not in this one is no longer in it."""
        spec: dict[str, Any] = {"run": run, "round": self.round, "worldSize": self.world_size}
        if self.store is not None:
            spec["store"] = self.store.to_dict()
        if self.leader is not None:
            spec["leader"] = self.leader
        spec["places"] = {node: place.to_dict() for node, place in self.places.items()}
        return {
            "apiVersion": crd.API_VERSION, "kind": crd.SLICE_KIND,
            "metadata": {
                "name": slice_name(run_uid, self.index), "namespace": namespace,
                "labels": {crd.RUN_LABEL: label_value(run),
                           "app.kubernetes.io/managed-by": "elasticrun-operator"},
                "ownerReferences": [{"apiVersion": crd.API_VERSION, "kind": crd.KIND,
                                     "name": run, "uid": run_uid,
                                     "blockOwnerDeletion": False}],
            },
            "spec": spec,
        }


def due(assignments: Mapping[str, Assignment], told: frozenset[int]) -> list[Slice]:
    """The slices of a sealed round still to write, ``told`` those written already: each
    slice that places a member of the round, with every place it holds.

    ``assignments`` are one round's, as :meth:`~elasticrun.api.model.RunStatus.assignments`
    derives them from the status: they share the round, its world size, its store and
    its rank 0, which each slice holds once.  A slice no member hashes into is not
    written; what it holds (places of an earlier round) answers no request of this one.
    """
    if not assignments:
        return []
    terms = next(iter(assignments.values()))
    by_slice: dict[int, dict[str, Place]] = {}
    for node, assignment in assignments.items():
        index = slice_index(node)
        if index not in told:
            by_slice.setdefault(index, {})[node] = Place(assignment.rank, assignment.since)
    return [Slice(index, terms.round, terms.world_size, terms.store, terms.leader, places)
            for index, places in sorted(by_slice.items())]


def read_place(obj: Any, run: str, node: str) -> Assignment | None:
    """``node``'s place in run ``run`` as a slice (an event's object) tells it; None when
    the slice is not the run's, holds no place of the node's, or holds one that cannot
    be read whole (a round, world size, store, rank 0, and a rank within the world).

    Only the operator writes slices, but the reader stays the tolerant one: a
    value it cannot read is no place, never an exception.
    """
    spec = untrusted.mapping(untrusted.mapping(obj).get("spec"))
    if untrusted.text(spec.get("run")) != run:
        return None
    mine = untrusted.mapping(untrusted.mapping(spec.get("places")).get(node))
    store = untrusted.mapping(spec.get("store"))
    host, port = untrusted.text(store.get("host")), untrusted.counter(store.get("port"), 1, 65536)
    round_number = untrusted.counter(spec.get("round"), 1, _COUNTER_END)
    world = untrusted.counter(spec.get("worldSize"), 1, _COUNTER_END)
    rank = untrusted.counter(mine.get("rank"), 0, _COUNTER_END)
    leader, since = untrusted.text(spec.get("leader")), untrusted.read_time(mine.get("since"))
    if host is None or port is None or round_number is None or world is None \
            or rank is None or leader is None or since is None or rank >= world:
        return None
    return Assignment(round=round_number, rank=rank, world_size=world,
                      store=StoreAddress(host, port), leader=leader, since=since)
