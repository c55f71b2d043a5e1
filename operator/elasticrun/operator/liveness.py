"""When is a member gone?  Read from Pods and Leases, never guessed from timeouts alone.

Kubernetes knows first that a node is gone: a Pod deleted, evicted (the
``DisruptionTarget`` condition), failed, or whose container died or restarted.
A Lease that stops being renewed catches the rest (a lost machine, a network
partition), where the Pod object can look healthy for minutes.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from elasticrun.api import rounds
from elasticrun.api.model import MAX_POD_UID, parse_time


@dataclass(frozen=True)
class Loss:
    """Why a member is gone, and since when (for failure-detection latency)."""

    reason: str
    message: str
    since: dt.datetime | None = None
    #: The uid of the Pod that revealed the loss (None: not from a Pod, or unknown).
    pod_uid: str | None = None


def pod_loss(pod: Mapping[str, Any], event_type: str | None = None,
             first_restart_count: int | None = None) -> Loss | None:
    """The loss a Pod event reveals (with the Pod's uid), or None while the Pod looks alive.

    ``first_restart_count`` is the container restart count the operator saw when
    it first met the pod; a higher count means the training container restarted
    (the agent inside lost its state and will join again as a new node).
    """
    loss = _pod_loss(pod, event_type, first_restart_count)
    uid = (pod.get("metadata") or {}).get("uid")
    if loss is None or not isinstance(uid, str) or not uid:
        return loss
    return dataclasses.replace(loss, pod_uid=uid[:MAX_POD_UID])


def _pod_loss(  # noqa: PLR0911 - one return per kind of loss, in the order they are checked
        pod: Mapping[str, Any], event_type: str | None,
        first_restart_count: int | None) -> Loss | None:
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    name = meta.get("name", "?")
    if event_type == "DELETED":
        return Loss(rounds.POD_DELETED, f"pod {name} was deleted", _deletion_requested(meta))
    if meta.get("deletionTimestamp"):
        return Loss(rounds.POD_DELETED, f"pod {name} is being deleted", _deletion_requested(meta))
    for condition in status.get("conditions") or []:
        if condition.get("type") == "DisruptionTarget" and condition.get("status") == "True":
            why = f"{condition.get('reason', 'disruption')}: {condition.get('message', '')}"
            return Loss(rounds.POD_DISRUPTED, f"pod {name}: {why}".rstrip(": "),
                        parse_time(condition.get("lastTransitionTime")))
    if status.get("phase") == "Failed":
        return Loss(rounds.POD_FAILED, f"pod {name} failed: {status.get('reason') or ''} "
                    f"{status.get('message') or ''}".strip(), _finished_at(status))
    if status.get("phase") == "Succeeded":
        return Loss(rounds.POD_SUCCEEDED, f"pod {name} completed", _finished_at(status))
    for container in status.get("containerStatuses") or []:
        terminated = (container.get("state") or {}).get("terminated")
        if terminated:
            return Loss(rounds.CONTAINER_TERMINATED,
                        f"pod {name}: container {container.get('name')} terminated "
                        f"(exit code {terminated.get('exitCode')}, "
                        f"{terminated.get('reason') or 'no reason'})",
                        parse_time(terminated.get("finishedAt")))
    if first_restart_count is not None and restart_count(pod) > first_restart_count:
        last = _last_termination(status)
        return Loss(rounds.CONTAINER_RESTARTED, f"pod {name}: a container restarted "
                    f"({restart_count(pod)} restarts)", last)
    return None


def member_pod_loss(pod: str | None, pod_uid: str | None,
                    by_name: Mapping[str, Loss], by_uid: Mapping[str, Loss]) -> Loss | None:
    """The Pod loss that is this member's, if any: the one rule that ties a member to a Pod.

    A member is tied to a Pod only when it named one (``pod``, from ``POD_NAME``
    or ``--rdzv-conf pod``): its node name is never read as a pod name, because
    a node started outside a Pod (or outside the webhook) has no Pod, and anyone
    who may create Pods could make and delete one of that name with the run's
    label.  A member that gave its Pod's uid is matched by that uid only (Pod
    names are reused, uids never are); the name alone counts only for a member
    that gave no uid (a handler older than ``podUID``), as weak as it always was.
    """
    if not pod:
        return None
    if pod_uid is not None:
        return by_uid.get(pod_uid)
    return by_name.get(pod)


def restart_count(pod: Mapping[str, Any]) -> int:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return sum(int(c.get("restartCount") or 0) for c in statuses)


def _deletion_requested(meta: Mapping[str, Any]) -> dt.datetime | None:
    deleted = parse_time(meta.get("deletionTimestamp"))
    if deleted is None:
        return None
    grace = float(meta.get("deletionGracePeriodSeconds") or 0)
    return deleted - dt.timedelta(seconds=grace)


def _finished_at(status: Mapping[str, Any]) -> dt.datetime | None:
    times = [parse_time(((c.get("state") or {}).get("terminated") or {}).get("finishedAt"))
             for c in status.get("containerStatuses") or []]
    known = [t for t in times if t is not None]
    return max(known) if known else None


def _last_termination(status: Mapping[str, Any]) -> dt.datetime | None:
    times = [parse_time(((c.get("lastState") or {}).get("terminated") or {}).get("finishedAt"))
             for c in status.get("containerStatuses") or []]
    known = [t for t in times if t is not None]
    return max(known) if known else None
