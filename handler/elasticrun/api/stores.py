"""Whether the store a round names is the one its rank 0 announced.

``status.store`` is written by whoever may write the run: its nodes, the
operator, and anyone else allowed to update it (a user, a pod of another run in
a namespace without per-run RBAC).  TCPStore has no authentication, so a member
that connects to a store it was merely told about hands its workers' rendezvous
to whoever listens there.  The round's rank 0 announces its store in its own
join request, on its own Lease (``elasticrun.dev/join``: address and store
port), which the admission policy lets only writers of that run create or
change.  A member therefore connects only to the store that rank 0's genuine
Lease announces: the Lease named for the run and rank 0, owned by the run's
uid, whose label and annotation name the run, carrying the join request this
round answered.  Once a round holds it, rank 0 announces on the same request
the store it serves for the next round (``nextStorePort``), where a round that
keeps its place meets (:func:`elasticrun.api.rounds.kept_places`): either store
is rank 0's.  A large run's slices are written only by the operator (where RBAC
is as the chart makes it), which makes this check itself before it tells a
round in them (``reconcile._vouched``), so that their members need not.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from elasticrun.api.leases import lease_run, lease_state
from elasticrun.api.model import StoreAddress, WaitingNode


def _show(store: StoreAddress | None) -> str:
    return "none" if store is None else f"{store.host}:{store.port}"


def announced_store(lease: Mapping[str, Any] | None, run: str, run_uid: str | None,
                    leader: str) -> tuple[StoreAddress | None, str | None]:
    """The store ``leader``'s Lease announces, and why none is trusted (or None).

    ``lease`` is what a GET of ``lease_name(run, leader)`` returned (None: no
    such Lease).  Read by the tolerant reader; never raises.
    """
    if lease is None:
        return None, f"rank 0 ({leader}) has no Lease"
    state = lease_state(lease)
    if lease_run(lease) != run or state.node != leader:
        return None, f"the Lease of rank 0 ({leader}) does not belong to run {run} and node " \
                     f"{leader} (its label, annotations or node name differ)"
    if run_uid is None or state.owner_uid != run_uid:
        return None, f"the Lease of rank 0 ({leader}) is not owned by this run (owner uid " \
                     f"{state.owner_uid}, run uid {run_uid})"
    join = state.join
    if join is None:
        return None, f"the Lease of rank 0 ({leader}) carries no readable join request"
    if not join.address or not join.store_port:
        return None, f"the join request of rank 0 ({leader}) announces no store"
    return StoreAddress(join.address, join.store_port), None


def announces(join: WaitingNode, store: StoreAddress | None) -> bool:
    """Whether rank 0's request ``join`` announces ``store``: the store it serves for the
    round that answers the request (address and store port), or the one it serves for
    the round after it (``nextStorePort``).  The one rule for members that check a
    round's store and for the operator before it tells a round in slices."""
    ports = {port for port in (join.store_port, join.next_store_port) if port}
    return store is not None and bool(join.address) and store.host == join.address \
        and store.port in ports


def store_problem(given: StoreAddress | None, lease: Mapping[str, Any] | None, run: str,
                  run_uid: str | None, leader: str,
                  answered: dt.datetime | None = None) -> str | None:
    """Why a member must not connect to ``given``, the store its round names; None to go on.

    ``answered`` is the join request of ``leader`` that the round holds (its
    ``since`` in ``status.participants``), when the member's copy of the run is
    of that round; the announcement must then come from that very request.  A
    copy of another round cannot say, and the address alone is compared.
    """
    announced, problem = announced_store(lease, run, run_uid, leader)
    join = lease_state(lease or {}).join
    if problem is None and answered is not None and join is not None \
            and join.since != answered:
        problem = f"the join request on the Lease of rank 0 ({leader}) is not the one " \
                  "this round answered"
    if problem is None and join is not None and not announces(join, given):
        problem = f"rank 0 ({leader}) announced {_show(announced)}"
    if problem is None:
        return None
    return f"the round names store {_show(given)}, but {problem}"
