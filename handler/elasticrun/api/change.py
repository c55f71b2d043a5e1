"""The one loop that changes a run's status: read, decide, compare-and-set, again.

A change of a run that must land although others write the same status
(closing the run, a member leaving, removing a silent rank 0) is a pure
operation of :mod:`elasticrun.api.rounds` carried out here: read the run,
apply the operation, write the result fenced by the resourceVersion read.  A
lost compare-and-set (someone wrote first) is not an error: the run is read
again and the operation applied to the winner's status, which may leave
nothing to change (the operator removed the same member, the run was closed
meanwhile).  Between attempts the loop pauses a random time up to the
policy's next pause ("full jitter"), so writers that lost together do not
collide again together.

The loop knows nothing of how a call fails: the store it is given answers
"no such run" and "someone wrote first" as ``None`` and raises everything
else, already mapped to its caller's errors (a node's
:class:`~elasticrun.handler.session.RunSession` turns an unreachable API
server into torch's ``RendezvousConnectionError`` within the bound it is
given).  The operator's reconcile writes at most once per pass and learns of
a lost write from the winner's event, so it needs no loop; it applies the
same operations (:func:`elasticrun.api.rounds.close`).
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from elasticrun.api.model import ElasticRun, RunStatus
from elasticrun.api.policy import RETRY_DELAYS

log = logging.getLogger(__name__)

#: How long one change is tried by default, in seconds (the handler passes its
#: ``close_timeout``, whose default this is).
CHANGE_SECONDS = 30.0

#: A pure change of the run: the new status, or None when there is nothing to change.
Operation = Callable[[ElasticRun], RunStatus | None]


@dataclass(frozen=True)
class ChangePolicy:
    """How hard one change of a run's status is tried.

    The loop stops at whichever bound comes first: ``attempts`` compare-and-sets
    (None: no count), or ``seconds`` from its start (None: no time bound beyond
    each call's own); one of them must be set.  With a time bound, each read and
    write is given what is left of it, so an unreachable API server ends the
    change within ``seconds``.  After the n-th lost compare-and-set the loop
    pauses a random time up to ``pauses[n]`` (the last one repeats), the pauses
    of every other retry (:data:`elasticrun.api.policy.RETRY_DELAYS`).

    A change bounded by time alone keeps trying while others win: in a mass
    exit every member's departure must land for the run to succeed.
    """

    attempts: int | None = None
    seconds: float | None = CHANGE_SECONDS
    pauses: tuple[float, ...] = RETRY_DELAYS

    def __post_init__(self) -> None:
        if self.attempts is None and self.seconds is None:
            raise ValueError("a change needs a bound: attempts or seconds")
        if self.attempts is not None and self.attempts < 1:
            raise ValueError(f"attempts must be at least 1, not {self.attempts}")

    def pause(self, lost: int) -> float:
        """The longest pause after lost compare-and-set number ``lost`` (0-based)."""
        return self.pauses[min(lost, len(self.pauses) - 1)] if self.pauses else 0.0


class StatusStore(Protocol):
    """What the loop needs of a run's store; ``bound``: seconds a call may take, None:
    the store's own default."""

    def read(self, bound: float | None = None) -> ElasticRun | None:
        """The run as stored; None when there is none."""

    def replace_status(self, run: ElasticRun, status: RunStatus,
                       bound: float | None = None) -> ElasticRun | None:
        """Compare-and-set of ``status`` over ``run``; None when someone wrote first."""


def full_jitter(longest: float) -> float:
    """A pause drawn evenly from 0 to ``longest``."""
    return random.uniform(0.0, longest)


def change_status(store: StatusStore, operation: Operation,
                  policy: ChangePolicy = ChangePolicy(), run: ElasticRun | None = None, *,
                  what: str = "change the run's status",
                  clock: Callable[[], float] = time.monotonic,
                  sleep: Callable[[float], None] = time.sleep,
                  jitter: Callable[[float], float] = full_jitter) -> ElasticRun | None:
    """Apply ``operation`` to the stored run until a compare-and-set of its result wins.

    Returns the run as written; None when there is nothing to write (no run,
    or the operation changes nothing) or when the policy's bounds ran out
    with every compare-and-set lost.  ``run``: a copy the caller already
    holds, used for the first attempt instead of a read.  What the store
    raises propagates.
    """
    deadline = None if policy.seconds is None else clock() + policy.seconds
    attempts = itertools.count() if policy.attempts is None else range(policy.attempts)
    for attempt in attempts:
        if attempt:
            pause = jitter(policy.pause(attempt - 1))
            if deadline is not None and clock() + pause >= deadline:
                break
            sleep(pause)
        bound = None if deadline is None else max(0.0, deadline - clock())
        current = run if attempt == 0 and run is not None else store.read(bound)
        if current is None:
            return None
        status = operation(current)
        if status is None:
            return None
        written = store.replace_status(current, status, bound)
        if written is not None:
            return written
    log.info("could not %s: every compare-and-set was lost (%s)", what, policy)
    return None
