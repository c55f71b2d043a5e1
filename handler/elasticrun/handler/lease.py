"""The node's Lease: its liveness signal, and where it asks to join a round.

One ``coordination.k8s.io`` Lease per node, renewed from a background thread.
The operator removes a member whose Lease stops being renewed ("lease
expired"): that is what catches a lost node or a network partition, where the
pod object may look healthy for minutes.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from typing import Any

from elasticrun.api.gateway import RunAccess, readable_lease
from elasticrun.api.kube import ApiConnectionError, ApiError
from elasticrun.api.leases import (
    JOIN_ANNOTATION,
    UNREACHABLE_ANNOTATION,
    describe_object,
    holder_alive,
    holder_identity,
    join_annotations,
    join_value,
    lease_run,
    node_lease,
    unreachable_value,
)
from elasticrun.api.model import WaitingNode, format_time, now
from elasticrun.api.naming import lease_name

log = logging.getLogger(__name__)

class NodeNameInUseError(RuntimeError):
    """Another live agent already holds this node name's Lease."""


class LeaseNameTakenError(NodeNameInUseError):
    """The node's Lease name is held by an object that is not a Lease of its run.

    Lease names are deterministic (:func:`~elasticrun.api.naming.lease_name`),
    so anyone who may create Leases in the namespace can take one first; the
    admission policy refuses that for labelled Leases and for the training
    accounts it lists.  The node neither overwrites such an object (it is not
    the run's) nor waits on it silently: the error names the object and what
    it says about itself, for whoever must delete it.
    """


class LeaseKeeper:
    """Creates, renews and releases one node's Lease, through its run's gateway."""

    def __init__(self, access: RunAccess, node: str,
                 duration: int, interval: float, owner_uid: str | None,
                 on_deleted: Callable[[], bool] | None = None) -> None:
        self.access = access
        #: Called when a renewal or a join finds the Lease gone; False means the
        #: run is gone too, and the Lease is not taken again.  The Lease is owned by
        #: the run, so that is how a deleted run shows itself first: the
        #: garbage collector (or the operator) deletes its Leases, while the
        #: node's narrow watch of the run cannot see the deletion.
        self.on_deleted = on_deleted
        self.namespace = access.namespace
        self.run = access.name
        self.node = node
        self.name = lease_name(self.run, node)
        self.holder = holder_identity(node, uuid.uuid4().hex[:8])
        self.duration = duration
        self.interval = interval
        self.owner_uid = owner_uid
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.acquired = False

    def _manifest(self, join: WaitingNode | None = None) -> dict[str, Any]:
        return node_lease(self.run, self.node, self.holder, self.duration, self.owner_uid,
                          now(), join)

    def acquire(self, join: WaitingNode | None = None) -> None:
        """Take the Lease (asking to join at once), refusing a name a live agent holds."""
        if self.access.create_lease(self._manifest(join)) is not None:
            self.acquired = True
            return
        current = self._existing()
        if lease_run(current) != self.run:
            raise LeaseNameTakenError(
                f"the Lease name {self.namespace}/{self.name} of node {self.node!r} is taken "
                f"by an object that is not a Lease of ElasticRun {self.run} "
                f"({describe_object(current)}); delete it, and list the ServiceAccount that "
                "made it in the chart's admissionPolicy.trainingServiceAccounts so that it "
                "cannot do so again")
        holder = holder_alive(current, self.run, self.owner_uid, self.duration, now())
        if holder is not None and holder != self.holder:
            raise NodeNameInUseError(
                f"node name {self.node!r} is already used by a live agent ({holder}, Lease "
                f"{self.namespace}/{self.name} renewed within the run's heartbeat of "
                f"{self.duration}s); give every agent its own name (POD_NAME, or --rdzv-conf "
                "node_name=...)")
        manifest = self._manifest(join)
        manifest["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
        self.access.replace_lease(self.node, manifest)
        self.acquired = True

    def _existing(self) -> dict[str, Any]:
        """The object that holds our Lease's name (after a 409 on create).

        With per-run RBAC the node may ``get`` only Leases the operator granted
        by name, and an object squatting the name is not one of them; ``list``
        is granted namespace-wide, so a LIST selected by name reads it instead
        (:func:`~elasticrun.api.gateway.readable_lease`).
        """
        current = readable_lease(self.access, self.node)
        if current is None:
            # Deleted between the create's 409 and this read.
            raise ApiError(404, "NotFound", f"leases {self.name!r} not found", {})
        return current

    def set_join(self, join: WaitingNode | None) -> None:
        """Ask to join the next round (or withdraw): one write to our own object.

        The same write withdraws a report of an unreachable rank 0, which
        belonged to the round this node is leaving.
        """
        annotated = self._annotate(join_annotations(join))
        # Removed (e.g. by the operator as lost): take it again, unless it went
        # with the run; a Lease made now would outlive the run it names.
        if not annotated and join is not None and not self._gone_with_run():
            self.acquire(join)

    def announce(self, join: WaitingNode) -> bool:
        """Write ``join`` again, the request a round answered, now with the store this node
        serves for the next round (``next_store_port``); False: the Lease is gone."""
        return self._annotate({JOIN_ANNOTATION: join_value(join)})

    def report_unreachable(self, leader: str, round_number: int, timeout: float) -> None:
        """Tell the operator that ``leader``'s store did not answer us (best effort).

        A report that does not get through only means the leader's loss is
        noticed by its Lease expiring instead.
        """
        try:
            if not self._annotate({UNREACHABLE_ANNOTATION: unreachable_value(leader,
                                                                             round_number)},
                                  timeout):
                log.info("lease %s: reporting %s unreachable failed: the Lease is gone",
                         self.name, leader)
        except (ApiError, ApiConnectionError) as exc:
            log.info("lease %s: reporting %s unreachable failed: %s", self.name, leader, exc)

    def withdraw_join(self, timeout: float) -> bool:
        """Withdraw our join request, keeping the Lease; False if that failed."""
        try:
            self._annotate({JOIN_ANNOTATION: None}, timeout)
        except (ApiError, ApiConnectionError):
            return False
        return True

    def _annotate(self, values: dict[str, str | None], timeout: float | None = None) -> bool:
        """One merge patch of our Lease's annotations (None removes one); False: no Lease."""
        return self.access.patch_lease(self.node, {"metadata": {"annotations": values}},
                                       timeout) is not None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._renew_loop, daemon=True,
                                        name=f"elasticrun-lease-{self.node}")
        self._thread.start()

    def stop_renewing(self) -> None:
        """Stop renewing and keep the Lease: the node looks partitioned (alive, silent),
        and the operator removes it once the Lease expires.  :meth:`release` is how a
        node leaves; :meth:`resume_renewing` ends the silence."""
        self._stop.set()

    def resume_renewing(self) -> None:
        """Renew again after :meth:`stop_renewing` (a partition that heals)."""
        self._stop.clear()
        self.start()

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                renewed = self.access.patch_lease(
                    self.node, {"spec": {"renewTime": format_time(now()),
                                         "holderIdentity": self.holder}})
            except (ApiError, ApiConnectionError) as exc:
                log.warning("renewing lease %s failed: %s", self.name, exc)
                continue
            if renewed is None:
                if self._gone_with_run():
                    log.warning("lease %s was deleted with its ElasticRun", self.name)
                    continue
                log.warning("lease %s was deleted; re-creating it", self.name)
                self._try(self.acquire)

    def _gone_with_run(self) -> bool:
        """Our Lease is gone: whether its run went too (``on_deleted`` says False)."""
        return self.on_deleted is not None and not self.on_deleted()

    @staticmethod
    def _try(action: Any) -> None:
        try:
            action()
        except (ApiError, ApiConnectionError, NodeNameInUseError) as exc:
            log.warning("lease: %s", exc)

    def release(self, timeout: float) -> None:
        """Stop renewing and delete the Lease, so the operator sees the node leave at once."""
        self._stop.set()
        if self._thread:
            self._thread.join(timeout)
        try:
            self.access.delete_lease(self.node, timeout)
        except (ApiError, ApiConnectionError) as exc:
            log.warning("releasing lease %s failed: %s", self.name, exc)
