"""What the operator keeps of one run between reconciles, in one object.

The controller (intake, liveness timing) and the executor (what it applied and
told) both keep memory per run; holding it in one :class:`RunState` per key
means a deleted run is forgotten with one ``pop`` and nothing of it is left in
a dictionary someone forgot to clear.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from elasticrun.api.leases import RenewalClock
from elasticrun.api.ordering import RoundMark
from elasticrun.operator.liveness import Loss
from elasticrun.operator.runobjects import Done
from elasticrun.operator.workqueue import Key

__all__ = ["Key", "RunState"]


@dataclass
class RunState:
    """One run's memory.  ``raw`` is None while only the run's pods were seen (pod
    events may come before the run's); such a state holds pod facts only."""

    #: The newest copy of the run (from an event or the operator's own write).
    raw: dict[str, Any] | None = None
    #: How long a Lease event of the run may wait for others (``controller.
    #: lease_event_window`` of ``raw``): read once per copy, not once per Lease event.
    lease_window: float | None = None
    #: The highest status.round seen: a round going back is repaired.
    mark: RoundMark = field(default_factory=RoundMark)
    #: Pod losses by (pod name, pod uid): a namesake Pod's events neither make nor
    #: hide another Pod's loss.
    pod_losses: dict[tuple[str, str | None], Loss] = field(default_factory=dict)
    #: When the operator saw each Lease of the run renewed, by node: liveness is what
    #: the operator observed, never the time a node wrote.
    renewals: RenewalClock = field(default_factory=RenewalClock)
    #: When the operator first saw each member or waiting node without a Lease.
    missing: dict[str, dt.datetime] = field(default_factory=dict)
    #: The Node of each of the run's pods (``spec.nodeName``), by pod name; kept only
    #: while Nodes are read.
    pod_nodes: dict[str, str] = field(default_factory=dict)
    #: The uid of each of those pods, by pod name: a waiting entry of another Pod of
    #: that name gets none of this Pod's topology.
    pod_uids: dict[str, str] = field(default_factory=dict)
    #: What the operator did for the run: the objects it last applied, the problems it
    #: reported (an input of :func:`~.reconcile.reconcile`).
    done: Done = field(default_factory=Done)
    #: The status error last repaired: the same error is not repaired twice.
    invalid_reported: str | None = None
    #: Leases whose deletion failed: by uid, (failures, monotonic retry time).
    delete_failures: dict[str, tuple[int, float]] = field(default_factory=dict)

    @property
    def held(self) -> bool:
        """Whether the operator holds the run itself (not only its pods)."""
        return self.raw is not None

    @property
    def idle(self) -> bool:
        """Nothing worth keeping: the run is not held and none of its pods says anything."""
        return not self.held and not self.pod_losses and not self.pod_nodes \
            and not self.pod_uids
