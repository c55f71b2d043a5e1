"""Which copy of a run is newer, and the rule that rounds only move forward.

Handler and operator both keep the newest ElasticRun they know and refuse a
status whose round went back; both answer those questions here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from elasticrun.api.model import ElasticRun, InvalidRunError


def newer(candidate: str, current: str) -> bool:
    """Whether resourceVersion ``candidate`` is after ``current``.

    resourceVersions are opaque, but on every API server backed by etcd they
    are its revision numbers; when they are not numeric, trust the later write.
    """
    if candidate.isdigit() and current.isdigit():
        return int(candidate) > int(current)
    return candidate != current


def resource_version(raw: Mapping[str, Any]) -> str:
    """The resourceVersion of an object as the API server returned it ("" if none)."""
    return str((raw.get("metadata") or {}).get("resourceVersion") or "")


def older(raw: Mapping[str, Any], than: Mapping[str, Any]) -> bool:
    """Whether ``raw`` is a strictly older copy than ``than`` (both numbered by etcd)."""
    candidate, current = resource_version(raw), resource_version(than)
    return candidate.isdigit() and current.isdigit() and int(candidate) < int(current)


@dataclass(frozen=True)
class RoundMark:
    """The highest ``status.round`` seen of one object (by uid): rounds never go back.

    Each copy of the status reads fine on its own, so only a reader that
    remembers can tell: a status restored from an old backup or edited by hand
    would otherwise hand out ranks of a round the members already left.  A
    re-created run (another uid) starts again from 0.
    """

    uid: str | None = None
    highest: int = 0

    def floor(self, uid: str | None) -> int:
        """The lowest round a copy of object ``uid`` may hold."""
        return self.highest if uid == self.uid else 0

    def advance(self, run: ElasticRun) -> RoundMark:
        """The mark after accepting ``run``; raises InvalidRunError if its round went back."""
        highest = self.floor(run.uid)
        if run.status.round < highest:
            raise InvalidRunError(
                "status.round", f"went back from {highest} to {run.status.round} "
                f"(resourceVersion {run.resource_version}); rounds only move forward, so the "
                "status was edited by hand or restored from an old copy")
        return RoundMark(run.uid, max(highest, run.status.round))
