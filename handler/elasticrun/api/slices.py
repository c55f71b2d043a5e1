"""Assignment slices: a sealed round's places, told in a fixed number of objects.

In the largest runs (:func:`elasticrun.api.rounds.members_told_in_slices`) the
operator's seal does not move the run's ``signal``, which would send the whole
roster to every node.  It writes each member's
:class:`~elasticrun.api.model.Assignment` into one of :data:`SLICE_COUNT`
``ElasticRunSlice`` objects instead, the one the member's name hashes into
(:func:`slice_index`), and each member watches that one slice by name.  As an
EndpointSlice holds part of a Service's endpoints, a slice holds part of a
round: a round of 2,048 members costs the operator 32 writes rather than one
per member, and a member receives the places of about 64.

Slices are named after the run's uid (:func:`slice_name`): two runs never
share one, and a run created again under an old name never reads the slices of
the run before it.  Only the operator may write them (the chart's RBAC; pods
get, list and watch), each is owned by its run, and a member still reads its
slice as it reads anything on the API server: tolerantly, for its own run and
its own join request only (:func:`read_place`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from elasticrun.api import crd, untrusted
from elasticrun.api.leases import assignment_value, read_assignment
from elasticrun.api.model import Assignment
from elasticrun.api.naming import label_value

#: Slices per run.  With the CRD's 2,048 nodes, about 64 places in each: a member's
#: event stays a few kilobytes, and the operator's writes per round stay few.
SLICE_COUNT = 32


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


@dataclass(frozen=True)
class Slice:
    """Slice ``index`` as round ``round`` fills it: by node, the place encoded as the
    reader reads it (:func:`~elasticrun.api.leases.assignment_value`)."""

    index: int
    round: int
    places: Mapping[str, str]

    def manifest(self, run: str, namespace: str, run_uid: str) -> dict[str, Any]:
        """The slice as the operator applies it: the whole slice, owned by the run and
        labelled with it (``kubectl get elasticrunslices -l elasticrun.dev/run=...``);
        a node of an earlier round that is not in this one is no longer in it."""
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
            "spec": {"run": run, "round": self.round, "assignments": dict(self.places)},
        }


def due(round_number: int, assignments: Iterable[tuple[str, Assignment]],
        told: frozenset[int]) -> list[Slice]:
    """The slices of round ``round_number`` still to write, ``told`` those written already:
    each slice that places a member of the round, with every place it holds.

    A slice no member hashes into is not written; what it holds (places of an
    earlier round) answers no request of this one.
    """
    members = [(node, assignment) for node, assignment in assignments
               if slice_index(node) not in told]
    by_slice: dict[int, dict[str, str]] = {}
    for node, assignment in members:
        by_slice.setdefault(slice_index(node), {})[node] = assignment_value(assignment)
    return [Slice(index, round_number, places) for index, places in sorted(by_slice.items())]


def read_place(obj: Any, run: str, node: str) -> Assignment | None:
    """``node``'s place in run ``run`` as a slice (an event's object) tells it; None when
    the slice is not the run's, holds no place of the node's, or holds one that is not
    of the slice's round.

    Only the operator writes slices, but the reader stays the tolerant one: a
    value it cannot read is no place, never an exception.
    """
    spec = untrusted.mapping(untrusted.mapping(obj).get("spec"))
    if untrusted.text(spec.get("run")) != run:
        return None
    place = read_assignment(untrusted.mapping(spec.get("assignments")).get(node))
    round_number = spec.get("round")
    if place is None or isinstance(round_number, bool) or place.round != round_number:
        return None
    return place
