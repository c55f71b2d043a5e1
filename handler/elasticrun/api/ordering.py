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


#: Rounds from this one on are never defended by a :class:`RoundMark`: no run gets
#: there by sealing (2^30 rounds are 34 years at one round a second), so such a
#: round was written by hand, and defending it would keep the run from being reset.
ABSURD_ROUND = 2**30


@dataclass(frozen=True)
class RoundMark:
    """The highest ``status.round`` seen of one object (by uid): rounds never go back.

    Each copy of the status reads fine on its own, so only a reader that
    remembers can tell: a status restored from an old backup or edited by hand
    would otherwise hand out ranks of a round the members already left.  A
    re-created run (another uid) starts again from 0.

    A stale copy in flight (a slow GET, a lagging watch) never gets here: its
    resourceVersion is older, and readers keep the newest copy.  What the mark
    refuses is a *new* write that lowers the round, which is what a stale writer
    does (a restore, an edit from an old copy).  An admin resetting a poisoned
    run does the same, so the two are told apart by what the mark remembers:
    a round below :data:`ABSURD_ROUND` is one the run reached and is defended;
    a round at or above it (up to the schema's maximum, where no round can
    follow) could only have been written by hand, so the mark holds no floor
    and the first sane round written after it is taken as the reset it is.
    Both sides apply this, the operator (which would otherwise "repair" the
    reset back to the poisoned value) and every node.  A sane round that must
    start again from 0 is a new run: delete and re-create it.
    """

    uid: str | None = None
    highest: int = 0

    def floor(self, uid: str | None) -> int:
        """The lowest round a copy of object ``uid`` may hold (0 once the mark is absurd)."""
        return self.highest if uid == self.uid and self.highest < ABSURD_ROUND else 0

    def advance(self, run: ElasticRun) -> RoundMark:
        """The mark after accepting ``run``; raises InvalidRunError if its round went back."""
        floor = self.floor(run.uid)
        if run.status.round < floor:
            raise InvalidRunError(
                "status.round", f"went back from {floor} to {run.status.round} "
                f"(resourceVersion {run.resource_version}); rounds only move forward, so the "
                "status was edited by hand or restored from an old copy")
        # Past the check the round is at least what the mark defends; below an
        # absurd mark it is the reset, and the mark starts again from it.
        return RoundMark(run.uid, run.status.round)
