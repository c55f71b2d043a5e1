"""What the run's pods and their Nodes say, for the controller's reconciles.

kopf's Pod and Node events come here: a Pod's loss (by pod name and uid), its
owner (for ``status.desired``), its Node (``spec.nodeName``, while Nodes are
read), and what each Node shows (``--node-signals``) or where it sits
(``--topology-keys``).  Facts about a run's pods live in the run's
:class:`~.runstate.RunState`, which exists before the run is seen and is
dropped again while the run is not held and its pods say nothing.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from elasticrun.api import untrusted
from elasticrun.api.model import now
from elasticrun.operator.liveness import pod_loss, restart_count
from elasticrun.operator.nodesignals import Shown, Signal, SignalMemory, read_node, shown
from elasticrun.operator.ownerreader import OwnerReader
from elasticrun.operator.owners import NO_OWNER, Ownership, PodView, ownership, pod_run, pod_view
from elasticrun.operator.runstate import Key, RunState
from elasticrun.operator.topology import node_topology

log = logging.getLogger(__name__)


class PodIntake:
    def __init__(self, states: dict[Key, RunState], owners: OwnerReader,
                 enqueue: Callable[[Key], None], node_signals: tuple[Signal, ...] | None = None,
                 topology_keys: tuple[str, ...] = ()) -> None:
        #: The controller's run states.
        self.states = states
        self.owners = owners
        self.enqueue = enqueue
        #: The restart count first seen per Pod, by (namespace, uid or name).
        self.pod_restarts: dict[tuple[str, str], int] = {}
        #: The run's owned pods as last seen, by uid (or name): what tells a pod set
        #: change (the owners are read again) from a status update.  Pods outlive
        #: their run's deletion, so this is kept apart from the run's state.
        self.run_pods: dict[Key, dict[str, PodView]] = {}
        #: kopf's index of the runs' owned pods (``handlers.owned_pods_by_run``), listed
        #: before any run is reconciled: the pods a reconcile counts.
        self.pod_index: Mapping[Key, Iterable[PodView]] | None = None
        #: The configured node signals; None when the operator does not read Nodes.
        self.node_signals = node_signals
        #: What each Node shows, held against flapping (only Nodes showing something).
        self.signal_memory = SignalMemory()
        #: The configured topology keys (``--topology-keys``); () when off.
        self.topology_keys = topology_keys
        #: The topology values of each Node that has any, by Node name.
        self.node_topology: dict[str, tuple[str, ...]] = {}

    @property
    def reads_nodes(self) -> bool:
        """Whether the operator watches Nodes: for node signals, for topology keys, or both."""
        return self.node_signals is not None or bool(self.topology_keys)

    def pods_state(self, key: Key) -> RunState:
        """The run's state for a pod fact (made if need be; :meth:`tidy` drops it again)."""
        return self.states.setdefault(key, RunState())

    def tidy(self, key: Key) -> None:
        """Drop the state of a run not held once its pods say nothing any more."""
        state = self.states.get(key)
        if state is not None and state.idle:
            del self.states[key]

    def pod_event(self, event_type: str, body: Mapping[str, Any]) -> None:
        meta = body.get("metadata") or {}
        namespace, pod = meta.get("namespace", ""), meta.get("name", "")
        run = pod_run(body)
        if not run:
            return
        key = (namespace, run)
        uid = meta.get("uid") if isinstance(meta.get("uid"), str) and meta.get("uid") else None
        pod_key = (pod, uid)
        self._track_pod(key, event_type, uid or pod, body)
        self._track_node(key, event_type, pod, uid, body)
        first = self.pod_restarts.setdefault((namespace, uid or pod), restart_count(body))
        loss = pod_loss(body, event_type, first)
        if event_type == "DELETED":
            self.pod_restarts.pop((namespace, uid or pod), None)
        if loss is None:
            state = self.states.get(key)
            if state is not None:
                state.pod_losses.pop(pod_key, None)
                self.tidy(key)
            return
        losses = self.pods_state(key).pod_losses
        if pod_key not in losses:
            log.info("%s/%s: %s", namespace, run, loss.message)
        losses[pod_key] = loss
        self.enqueue(key)

    def _track_pod(self, key: Key, event_type: str, pod_key: str,
                   body: Mapping[str, Any]) -> None:
        """Keep the pod for the run's desired size; a pod added or gone, or its owner
        changed, has the run's owners read again.

        Only pods with a controller are kept: a pod nobody owns gives no size
        and is never counted as coming.
        """
        pods = self.run_pods.get(key, {})
        old = pods.get(pod_key)
        view = None if event_type == "DELETED" else pod_view(body)
        if view is not None and view.owner is None:
            view = None
        if old == view:
            return
        if view is None:
            pods.pop(pod_key, None)
            if not pods:
                self.run_pods.pop(key, None)
        else:
            self.run_pods[key] = pods
            pods[pod_key] = view
        if old is None or view is None or old.owner != view.owner or old.live != view.live:
            self.owners.invalidate(key)
        self.enqueue(key)

    def _track_node(self, key: Key, event_type: str, pod: str, uid: str | None,
                    body: Mapping[str, Any]) -> None:
        """Keep the pod's Node (``spec.nodeName``) and uid while Nodes are read; a pod
        that moved to another Node has its run looked at again."""
        if not self.reads_nodes or not pod:
            return
        state = self.pods_state(key)
        if event_type == "DELETED" or uid is None:
            state.pod_uids.pop(pod, None)
        else:
            state.pod_uids[pod] = uid
        nodes = state.pod_nodes
        spec = untrusted.mapping(body.get("spec"))
        node = None if event_type == "DELETED" else untrusted.text(spec.get("nodeName"))
        if nodes.get(pod) == node:
            self.tidy(key)
            return
        if node is None:
            nodes.pop(pod, None)
        else:
            nodes[pod] = node
        self.tidy(key)
        self.enqueue(key)

    def node_event(self, event_type: str, body: Mapping[str, Any]) -> None:
        """A Node changed: its topology values are kept, what it shows is held
        (:class:`SignalMemory`), and the runs with a pod on it are looked at again when
        either changed."""
        name = untrusted.text(untrusted.mapping(body.get("metadata")).get("name"))
        if name is None or not self.reads_nodes:
            return
        changed = False
        if self.topology_keys:
            values = () if event_type == "DELETED" else node_topology(body, self.topology_keys)
            changed = self.node_topology.get(name, ()) != values
            if values:
                self.node_topology[name] = values
            else:
                self.node_topology.pop(name, None)
        if self.node_signals is not None:
            signals = () if event_type == "DELETED" else shown(self.node_signals,
                                                               read_node(body))
            changed = self.signal_memory.observe(name, signals, now()) or changed
        if not changed:
            return
        for key, state in list(self.states.items()):
            if name in state.pod_nodes.values():
                self.enqueue(key)

    def shown(self, key: Key) -> dict[str, Shown] | None:
        """What the Node of each of the run's pods shows, by pod (pods on a Node that
        shows nothing are left out)."""
        if self.node_signals is None:
            return None
        at = now()
        found: dict[str, Shown] = {}
        state = self.states.get(key)
        for pod, node in (state.pod_nodes if state else {}).items():
            signals = self.signal_memory.showing(node, at)
            if signals:
                found[pod] = Shown(node, signals)
        return found

    def topology(self, key: Key) -> dict[str, tuple[str | None, tuple[str, ...]]] | None:
        """Per pod of the run, its uid and its Node's topology values (pods on a Node
        without any are left out); None when no topology keys are configured."""
        if not self.topology_keys:
            return None
        state = self.states.get(key) or RunState()
        return {pod: (state.pod_uids.get(pod), values) for pod, node in state.pod_nodes.items()
                if (values := self.node_topology.get(node))}

    def signal_wake(self, found: Mapping[str, Shown]) -> dt.datetime | None:
        """When a held signal of the run's Nodes stops counting (the run is looked at then)."""
        at = now()
        ends = [e for s in found.values() if (e := self.signal_memory.expires(s.node, at))]
        return min(ends) if ends else None

    async def ownership(self, key: Key) -> Ownership:
        """What the owners of the run's live pods say (read by name, cached per run)."""
        if self.pod_index is not None:
            pods = list(self.pod_index.get(key, ()))
        else:
            pods = list(self.run_pods.get(key, {}).values())
        refs = {p.owner for p in pods if p.owner is not None and p.live}
        if not refs:
            self.owners.forget(key)
            return NO_OWNER
        return ownership(pods, await asyncio.to_thread(self.owners.resolve, key, refs))

