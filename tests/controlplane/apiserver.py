"""What the API server itself says it did: its audit log and its ``/metrics``.

One reader of each, for the benchmarks and the tests.  The audit log is the
ground truth for ``k8s`` requests: every request the server received for
``elasticrun.dev`` objects and Leases, logged at Metadata level by
:class:`LocalControlPlane`.  A long request (a watch) is logged at two stages,
so requests are counted once per ``auditID``.

Watch traffic comes from the server's own counters
(``apiserver_watch_events_total`` and the ``apiserver_watch_events_sizes``
histogram), which count what it *sent*: one event per watcher per change.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elasticrun.api import crd
from elasticrun.api.kube import OPERATOR_USER_AGENT

WRITE_VERBS = frozenset({"create", "update", "patch", "delete", "deletecollection"})
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


@dataclass(frozen=True)
class AuditEntry:
    """One request, as the API server logged it."""

    verb: str
    resource: str
    subresource: str
    name: str
    code: int
    user: str
    user_agent: str = ""
    #: The response's message, for a failure.
    message: str = ""

    @property
    def cut_short(self) -> bool:
        """The client stopped sending before the API server had read the request's body
        (500, the read of the body failed): nothing of it was carried out."""
        return self.code == 500 and (self.message.startswith("read tcp ")
                                     or "unexpected EOF" in self.message)

    @property
    def kind(self) -> str:
        """``verb resource[/subresource]``."""
        return f"{self.verb} {self.resource}{'/' + self.subresource if self.subresource else ''}"


@dataclass
class RequestTally:
    """Requests of one window, by kind; ``writes`` excludes Lease renewals."""

    total: int = 0
    writes: int = 0
    conflicts: int = 0
    rejected_tests: int = 0
    lease_renewals: int = 0
    by_kind: Counter[str] = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        return {"total": self.total, "writes": self.writes, "conflicts": self.conflicts,
                "rejected_tests": self.rejected_tests, "lease_renewals": self.lease_renewals,
                "by_kind": dict(sorted(self.by_kind.items()))}


class AuditLog:
    """Reads the JSON-lines audit log incrementally, from a remembered offset."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def mark(self) -> int:
        try:
            return self.path.stat().st_size
        except FileNotFoundError:
            return 0

    def events_since(self, offset: int) -> list[dict[str, Any]]:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return []
        if size < offset:  # rotated (200 MB): the window is lost, say so by raising
            raise RuntimeError(f"audit log {self.path} was rotated during a measurement")
        with open(self.path, "rb") as f:
            f.seek(offset)
            data = f.read()
        events = []
        for line in data.splitlines():
            if line.strip():
                try:
                    events.append(json.loads(line))
                except ValueError:
                    continue  # a line still being written
        return events

    def entries(self, namespace: str, since: int = 0) -> list[AuditEntry]:
        """The requests of ``namespace`` logged after offset ``since``."""
        return audit_entries(self.events_since(since), namespace)


def audit_entries(events: Iterable[dict[str, Any]], namespace: str) -> list[AuditEntry]:
    """The requests of one namespace, once per auditID (a watch is logged at two stages)."""
    seen: dict[str, dict[str, Any]] = {}
    for event in events:
        ref = event.get("objectRef") or {}
        if ref.get("namespace") != namespace:
            continue
        audit_id = str(event.get("auditID"))
        # Keep the final stage when both are present (it has the response code).
        if audit_id not in seen or event.get("stage") == "ResponseComplete":
            seen[audit_id] = event
    entries = []
    for event in seen.values():
        ref = event.get("objectRef") or {}
        entries.append(AuditEntry(
            verb=str(event.get("verb")), resource=str(ref.get("resource") or ""),
            subresource=str(ref.get("subresource") or ""), name=str(ref.get("name") or ""),
            code=int((event.get("responseStatus") or {}).get("code") or 0),
            user=str((event.get("user") or {}).get("username") or ""),
            user_agent=str(event.get("userAgent") or ""),
            message=str((event.get("responseStatus") or {}).get("message") or "")))
    return entries


def count_writes(entries: Iterable[AuditEntry], resource: str | None = None,
                 succeeded_only: bool = True) -> Counter[str]:
    """Writes by kind (``verb resource[/subresource]``), optionally of one resource."""
    counts: Counter[str] = Counter()
    for e in entries:
        if e.verb not in WRITE_VERBS or (resource and e.resource != resource):
            continue
        if succeeded_only and not 200 <= e.code < 300:
            continue
        counts[e.kind] += 1
    return counts


def tally(events: Iterable[dict[str, Any]], namespace: str) -> RequestTally:
    """Count the requests of one namespace (one run per namespace), once per auditID.

    Lease renewals (a node's ``patch`` of its Lease) are steady-state traffic,
    counted apart from ``writes``; creating and deleting a Lease are writes, and
    so would be a patch of a Lease by the operator, which writes none, counted as
    ``patch leases (operator)`` should it ever.
    """
    result = RequestTally()
    for entry in audit_entries(events, namespace):
        code = entry.code
        result.total += 1
        by_operator = entry.user_agent.startswith(OPERATOR_USER_AGENT)
        kind = entry.kind + (" (operator)" if by_operator and entry.resource == "leases" else "")
        result.by_kind[kind + (f" -> {code}" if code >= 400 else "")] += 1
        if entry.resource == "leases" and not entry.subresource and entry.verb == "patch" \
                and not by_operator:
            result.lease_renewals += 1
        elif entry.verb in WRITE_VERBS:
            result.writes += 1
        if code == 409:
            result.conflicts += 1
        elif code == 422 and entry.verb == "patch":
            result.rejected_tests += 1
    return result


# --------------------------------------------------------------------------- metrics


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if not match:
            continue
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group(2) or ""))
        try:
            samples.append((match.group(1), labels, float(match.group(3))))
        except ValueError:
            continue
    return samples


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    return sum(value for sample, got, value in parse_metrics(text)
               if sample == name and all(got.get(k) == v for k, v in labels.items()))


def watch_counters(text: str, group: str = crd.GROUP) -> dict[str, float]:
    """Watch events sent and their bytes, summed over the group's resources."""
    events = size_sum = size_count = 0.0
    for name, labels, value in parse_metrics(text):
        if labels.get("group") != group:
            continue
        if name == "apiserver_watch_events_total":
            events += value
        elif name == "apiserver_watch_events_sizes_sum":
            size_sum += value
        elif name == "apiserver_watch_events_sizes_count":
            size_count += value
    return {"events": events, "bytes": size_sum, "sized_events": size_count}


def diff(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {key: after[key] - before.get(key, 0.0) for key in after}


#: The API groups of a run's objects: its ElasticRun, and its Leases.
RUN_GROUPS = (crd.GROUP, "coordination.k8s.io")


def response_bytes(text: str, groups: Sequence[str] = RUN_GROUPS) -> float:
    """Bytes of the responses (not watch events) the API server sent for ``groups``."""
    return sum(value for name, labels, value in parse_metrics(text)
               if name == "apiserver_response_sizes_sum" and labels.get("group") in groups)
