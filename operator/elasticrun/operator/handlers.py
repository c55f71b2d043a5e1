"""kopf registrations: thin handlers that hand events to the controller.

Nothing here decides anything.  The handlers are coroutines so that they run
on the operator's event loop, where the controller's queue lives (kopf runs
plain functions in worker threads).  The ElasticRun handler is an ``on.event``
handler on purpose: kopf's daemons and change handlers would put a finalizer
and progress annotations on every run, so deleting a run would hang whenever
the operator is down, and every node would pay for the operator's bookkeeping
writes.  The Lease index is pre-populated by kopf before any ElasticRun event
is handled, so a restarted operator never mistakes "not listed yet" for "gone";
so is the index of the run's owned pods.
"""

from __future__ import annotations

from typing import Any

import kopf

from elasticrun.api import crd
from elasticrun.api.leases import LeaseState, lease_run, lease_state
from elasticrun.operator.controller import Controller, Key
from elasticrun.operator.owners import PodView, pod_run, pod_view


def _controller(memo: kopf.Memo) -> Controller:
    controller = memo.get("controller")
    if not isinstance(controller, Controller):  # pragma: no cover - wiring error
        raise kopf.PermanentError("the elasticrun controller is not in kopf's memo")
    return controller


@kopf.index("coordination.k8s.io", "v1", "leases", labels={crd.RUN_LABEL: kopf.PRESENT})
def leases_by_run(*, body: kopf.Body, namespace: str | None, **_: Any
                  ) -> dict[Key, tuple[str, LeaseState]] | None:
    run, state = lease_run(body), lease_state(body)
    if not run or not state.node:
        return None
    return {(namespace or "", run): (state.node, state)}


@kopf.index("", "v1", "pods", labels={crd.RUN_LABEL: kopf.PRESENT})
def owned_pods_by_run(*, body: kopf.Body, namespace: str | None, **_: Any
                      ) -> dict[Key, PodView] | None:
    """The run's pods that have a controller (the source of ``status.desired``).

    An index, like the Leases', so that a restarted operator has listed the
    pods before it reconciles a run, and never reads "no pods yet" as "no owner".
    """
    run, view = pod_run(body), pod_view(body)
    if not run or view is None or view.owner is None:
        return None
    return {(namespace or "", run): view}


@kopf.on.event("coordination.k8s.io", "v1", "leases", labels={crd.RUN_LABEL: kopf.PRESENT})
async def lease_changed(*, type: str, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    _controller(memo).lease_event(body, type or "")


@kopf.on.event(crd.GROUP, crd.VERSION, crd.PLURAL)
async def run_changed(*, type: str, body: kopf.Body, memo: kopf.Memo, **kwargs: Any) -> None:
    controller = _controller(memo)
    controller.lease_index = kwargs["leases_by_run"]
    controller.pod_index = kwargs["owned_pods_by_run"]
    controller.run_event(type or "", body)


@kopf.on.event("", "v1", "pods", labels={crd.RUN_LABEL: kopf.PRESENT})
async def pod_changed(*, type: str, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    _controller(memo).pod_event(type or "", body)


async def node_changed(*, type: str, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A Node changed (registered by ``__main__`` only with ``--node-signals`` or
    ``--topology-keys``)."""
    _controller(memo).node_event(type or "", body)
