"""What ``kubectl elasticrun status`` and ``list`` show, as pure functions of parsed runs.

Names, reasons and messages in a run's status are written by nodes, and a node
can write any string the schema allows: everything shown goes through
:func:`printable`, so a control character in a node name (a terminal escape,
a carriage return that hides a line) is shown escaped, never interpreted by
the user's terminal, and a long string is cut.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from elasticrun.api import crd
from elasticrun.api.model import ElasticRun, format_time_seconds

#: Longest name or reason shown; messages get :data:`MESSAGE_CHARS`.
NAME_CHARS = 64
MESSAGE_CHARS = 160
NONE = "<none>"


def printable(value: object, limit: int = NAME_CHARS) -> str:
    """``value`` as text safe for a terminal: non-printable characters escaped, at most
    ``limit`` characters (cut with ``...``)."""
    text = str(value)
    shown = "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii")
                    for ch in text[:limit + 1])
    return shown if len(shown) <= limit else shown[:limit - 3] + "..."


def age(since: dt.datetime | None, now: dt.datetime) -> str:
    """How long ago, the way kubectl prints ages (``45s``, ``3m20s``, ``5h``, ``12d``)."""
    if since is None:
        return NONE
    seconds = max(0, int((now - since).total_seconds()))
    minutes, hours, days = seconds // 60, seconds // 3600, seconds // 86400
    if seconds < 120:
        return f"{seconds}s"
    if minutes < 10:
        big, small = f"{minutes}m", f"{seconds % 60}s" if seconds % 60 else ""
    elif hours < 3:
        big, small = f"{minutes}m", ""
    elif hours < 8:
        big, small = f"{hours}h", f"{minutes % 60}m" if minutes % 60 else ""
    elif hours < 48:
        big, small = f"{hours}h", ""
    else:
        big, small = f"{days}d", f"{hours % 24}h" if days < 8 and hours % 24 else ""
    return big + small


def when(value: dt.datetime | None, now: dt.datetime) -> str:
    """A time and how long ago it was: ``2026-12-01T16:40:02Z (35s ago)``."""
    if value is None:
        return NONE
    return f"{format_time_seconds(value)} ({age(value, now)} ago)"


def table(header: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "") -> list[str]:
    """Columns padded like ``kubectl get`` (three spaces apart; the last one unpadded)."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows,
                                                                       strict=True)]
    lines = []
    for row in (header, *rows):
        cells = [str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)]
        cells[-1] = str(row[-1])
        lines.append((indent + "   ".join(cells)).rstrip())
    return lines


@dataclass(frozen=True)
class Listed:
    """A run as ``list`` shows it: parsed, or the reason it could not be."""

    namespace: str
    name: str
    created: dt.datetime | None
    run: ElasticRun | None
    problem: str | None = None


# --------------------------------------------------------------------------- list


LIST_HEADER = ("NAME", "PHASE", "ROUND", "MEMBERS", "WAITING", "DESIRED", "MIN", "MAX", "LOST",
               "CLOSED", "AGE")


def _list_row(item: Listed, now: dt.datetime) -> list[str]:
    run = item.run
    if run is None:
        return [printable(item.name), "<invalid>", *["?"] * 8, age(item.created, now)]
    status = run.status
    return [printable(item.name), status.phase, str(status.round), str(len(status.participants)),
            str(len(status.waiting)),
            str(status.desired.size) if status.desired else NONE,
            str(run.spec.min_nodes), str(run.spec.max_nodes), str(len(status.lost_members)),
            "true" if run.spec.closed else "false", age(item.created, now)]


def runs_table(items: Sequence[Listed], now: dt.datetime, all_namespaces: bool = False) -> str:
    """``kubectl get er`` with the columns an operator of runs looks at first."""
    header = ("NAMESPACE", *LIST_HEADER) if all_namespaces else LIST_HEADER
    rows = [([printable(item.namespace)] if all_namespaces else []) + _list_row(item, now)
            for item in items]
    lines = table(header, rows)
    lines += [f"{printable(item.namespace)}/{printable(item.name)}: "
              f"{printable(item.problem, MESSAGE_CHARS)}" for item in items if item.problem]
    return "\n".join(lines)


# --------------------------------------------------------------------------- status


def _time_or_none(value: dt.datetime | None) -> str | None:
    return format_time_seconds(value) if value else None


def status_document(run: ElasticRun, created: dt.datetime | None) -> dict[str, Any]:
    """What the screen shows, as data (``-o json`` / ``-o yaml``)."""
    status, spec = run.status, run.spec
    leader = status.leader
    return {
        "name": run.name,
        "namespace": run.namespace,
        "created": _time_or_none(created),
        "phase": status.phase,
        "round": status.round,
        "reforming": status.degraded,
        "minNodes": spec.min_nodes,
        "maxNodes": spec.max_nodes,
        "closed": spec.closed,
        "desired": ({"size": status.desired.size, "source": status.desired.source,
                     "coming": status.desired.coming} if status.desired else None),
        "store": status.store.to_dict() if status.store else None,
        "leader": leader,
        "sealedAt": _time_or_none(status.sealed_at),
        "finishedAt": _time_or_none(status.finished_at),
        "restartRequested": crd.RESTART_ANNOTATION in run.annotations,
        "drained": sorted(run.drained),
        "members": [{"rank": p.rank, "name": p.name, "pod": p.pod, "joinedRound": p.joined_round,
                     "address": p.address}
                    for p in sorted(status.participants, key=lambda p: p.rank)],
        "waiting": [{"name": w.name, "pod": w.pod, "since": _time_or_none(w.since)}
                    for w in status.waiting],
        "lost": [{"name": m.name, "round": m.round, "reason": m.reason, "message": m.message,
                  "time": _time_or_none(m.time), "detectionSeconds": m.detection_seconds}
                 for m in status.lost_members],
        "conditions": [{"type": c.type, "status": c.status, "reason": c.reason,
                        "message": c.message,
                        "lastTransitionTime": _time_or_none(c.last_transition_time)}
                       for c in status.conditions],
    }


def _headline(run: ElasticRun, created: dt.datetime | None, now: dt.datetime) -> list[str]:
    status, spec = run.status, run.spec
    round_text = str(status.round)
    if status.degraded:
        round_text += " (being re-formed: members join the next round)"
    elif status.round == 0:
        round_text += " (no round formed yet)"
    lines = [
        f"Run:        {printable(run.namespace)}/{printable(run.name)}   (age {age(created, now)})",
        f"Phase:      {status.phase}",
        f"Round:      {round_text}",
        f"Size:       {spec.min_nodes}:{spec.max_nodes} (minNodes:maxNodes)"
        + ("   spec.closed: true" if spec.closed else ""),
    ]
    if status.desired is not None:
        source = f" from {printable(status.desired.source)}" if status.desired.source else ""
        lines.append(f"Desired:    {status.desired.size}{source} ({status.desired.coming} "
                     "coming)")
    if status.store is not None:
        leader = status.leader
        lines.append(f"Store:      {printable(status.store.host)}:{status.store.port}"
                     + (f" (rank 0: {printable(leader)})" if leader else " (rank 0 lost)"))
    if status.sealed_at is not None:
        lines.append(f"Sealed:     {when(status.sealed_at, now)}")
    if status.finished_at is not None:
        lines.append(f"Finished:   {when(status.finished_at, now)}")
    if run.drained:
        lines.append("Drained:    " + ", ".join(printable(n) for n in sorted(run.drained)))
    if crd.RESTART_ANNOTATION in run.annotations:
        lines.append(f"Restart:    requested ({crd.RESTART_ANNOTATION}), not yet consumed by "
                     "the operator")
    return lines


def _section(title: str, count: int, header: Sequence[str], rows: Sequence[Sequence[str]]
             ) -> list[str]:
    if not rows:
        return ["", f"{title}: none"]
    return ["", f"{title} ({count}):", *table(header, rows, indent="  ")]


def status_screen(run: ElasticRun, created: dt.datetime | None, now: dt.datetime) -> str:
    """One readable screen: the run, its ranks, who waits, who was lost and why, conditions."""
    status = run.status
    drained = run.drained
    members = [[str(p.rank), printable(p.name) + (" (drained)" if p.name in drained else ""),
                printable(p.pod) if p.pod else NONE, str(p.joined_round),
                printable(p.address) if p.address else NONE]
               for p in sorted(status.participants, key=lambda p: p.rank)]
    waiting = [[printable(w.name) + (" (drained)" if w.name in drained else ""),
                printable(w.pod) if w.pod else NONE,
                f"{age(w.since, now)} ago" if w.since else NONE]
               for w in status.waiting]
    lost = [[printable(m.name), str(m.round), printable(m.reason), when(m.time, now),
             printable(m.message, MESSAGE_CHARS) if m.message else ""]
            for m in status.lost_members]
    conditions = [[printable(c.type), c.status, printable(c.reason) if c.reason else "",
                   age(c.last_transition_time, now),
                   printable(c.message, MESSAGE_CHARS) if c.message else ""]
                  for c in status.conditions]
    lines = _headline(run, None if created is None else created, now)
    lines += _section("Ranks", len(members), ("RANK", "MEMBER", "POD", "JOINED", "ADDRESS"),
                      members)
    lines += _section("Waiting", len(waiting), ("NODE", "POD", "SINCE"), waiting)
    lines += _section("Lost", len(lost), ("NODE", "ROUND", "REASON", "TIME", "MESSAGE"), lost)
    lines += _section("Conditions", len(conditions),
                      ("TYPE", "STATUS", "REASON", "AGE", "MESSAGE"), conditions)
    return "\n".join(lines)
