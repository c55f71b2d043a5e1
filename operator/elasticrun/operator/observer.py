"""Events and metrics for what changed in a run, whoever wrote it (node or operator)."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Coroutine, Mapping
from typing import Any

from elasticrun.api import crd, rounds
from elasticrun.api.gateway import OperatorAccess
from elasticrun.api.kube import ApiConnectionError, ApiError
from elasticrun.api.model import (
    ElasticRun,
    InvalidRunError,
    RunStatus,
    format_time_seconds,
    now,
    parse_run,
)
from elasticrun.operator.elector import NotLeaderError
from elasticrun.operator.metrics import Metrics
from elasticrun.operator.reconcile import lost_since

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (namespace, run)
COMPONENT = "elasticrun-operator"


class Observer:
    """Compares each copy of a run with the last one seen, and reports the difference."""

    def __init__(self, access: OperatorAccess, metrics: Metrics) -> None:
        self.access = access
        self.metrics = metrics
        self._seen: dict[Key, RunStatus] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._instance = socket.gethostname()

    def forget(self, key: Key) -> None:
        self._seen.pop(key, None)
        self.metrics.forget(*key)

    def observe(self, key: Key, raw: Mapping[str, Any]) -> None:
        try:
            run = parse_run(raw)
        except InvalidRunError:
            return
        status = run.status
        old = self._seen.get(key)
        self._seen[key] = status
        labels = {"namespace": key[0], "run": key[1]}
        self.metrics.members.labels(**labels).set(len(status.participants))
        self.metrics.waiting.labels(**labels).set(len(status.waiting))
        self.metrics.round.labels(**labels).set(status.round)
        self.metrics.run_phase(*key, status.phase)
        if old is None:
            return  # first sight (e.g. after a restart): nothing to report twice
        if status.round > old.round and status.participants:
            self._sealed(run, labels)
        for lost in lost_since(old, status):
            self.metrics.lost_member(*key, lost.reason, lost.detection_seconds)
            kind = "Normal" if lost.reason in rounds.DEPARTURES else "Warning"
            self.post_soon(run, kind, "MemberLost",
                           f"round {lost.round}: {lost.name} removed ({lost.reason}"
                           f"{': ' + lost.message if lost.message else ''})")

    def _sealed(self, run: ElasticRun, labels: dict[str, str]) -> None:
        status = run.status
        self.metrics.rounds.labels(**labels).inc()
        started = [p.since for p in status.participants if p.since]
        if started and status.sealed_at:
            self.metrics.round_duration.labels(**labels).observe(
                max(0.0, (status.sealed_at - min(started)).total_seconds()))
        leader = status.participants[0].name
        self.post_soon(run, "Normal", "RoundSealed",
                       f"round {status.round}: {len(status.participants)} members, "
                       f"rank 0 = {leader}")

    # ------------------------------------------------------------------ Events

    def post_soon(self, run: ElasticRun, type_: str, reason: str, message: str) -> None:
        self.in_background(self.post_event(run, type_, reason, message))

    def in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)  # keep a reference until it is done
        task.add_done_callback(self._background.discard)

    async def post_event(self, run: ElasticRun, type_: str, reason: str, message: str) -> None:
        stamp = format_time_seconds(now())
        event = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{run.name}.", "namespace": run.namespace},
            "involvedObject": {"apiVersion": crd.API_VERSION, "kind": crd.KIND,
                               "name": run.name, "namespace": run.namespace, "uid": run.uid,
                               "resourceVersion": run.resource_version},
            "type": type_, "reason": reason, "message": message[:1024],
            "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
            "source": {"component": COMPONENT},
            "reportingComponent": f"{crd.GROUP}/operator", "reportingInstance": self._instance,
        }
        try:
            await asyncio.to_thread(self.access.post_event, run.namespace, event)
        except NotLeaderError:
            log.debug("not posting event %s for %s/%s: not the leader", reason, run.namespace,
                      run.name)
        except (ApiError, ApiConnectionError) as exc:
            log.warning("posting event %s for %s/%s failed: %s", reason, run.namespace,
                        run.name, exc)
