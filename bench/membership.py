"""What the scale benchmark reads from its members' reports and the run: pure, no I/O.

Members report monotonic times (``time.monotonic()`` is one clock for every
process of the machine); the operator records a removal in the run's status
by wall time.  These helpers put both on one clock and say when the last of a
set of members knew.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping

from elasticrun.api.model import ElasticRun, LostMember


def until_all(times: Mapping[str, float], who: Iterable[str], since: float) -> float | None:
    """Seconds from ``since`` until the last of ``who`` reported (``times``: node → when);
    None when one of them did not report."""
    wanted = set(who)
    if not wanted or not wanted <= set(times):
        return None
    return max(times[name] for name in wanted) - since


def removal(run: ElasticRun, node: str) -> LostMember | None:
    """The run's record of ``node``'s last removal from a round (None: never removed)."""
    found = [m for m in run.status.lost_members if m.name == node]
    return found[-1] if found else None


def monotonic_of(wall: dt.datetime, wall_now: float, monotonic_now: float) -> float:
    """``wall`` on the monotonic clock, given one reading of both clocks taken together."""
    return wall.timestamp() - wall_now + monotonic_now
