"""One retry-and-error policy for every API call elasticrun makes.

:func:`classify` says what a failed call means; the handler maps that to
torch's error types and retries for up to ``api_timeout``, the operator maps it
to how soon a run is reconciled again.  Outcomes that are part of the protocol
(a lost compare-and-set, a failed JSON-patch test, an object already gone) are
answered by :class:`~elasticrun.api.gateway.RunGateway` itself and never get here.
"""

from __future__ import annotations

import enum

from elasticrun.api.errors import ApiConnectionError, ApiError

#: Pauses between retries of a failing call (the last one repeats).
RETRY_DELAYS = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
#: Statuses that say "try again": overload, and the API server's own upstream failures.
TRANSIENT_STATUSES = frozenset({429, 500, 502, 503, 504})
#: How soon the operator reconciles a run again after a failed API call, and after a bug.
REQUEUE_AFTER_API_ERROR = 1.0
REQUEUE_AFTER_ERROR = 5.0


class Failure(enum.Enum):
    TRANSIENT = "transient"  # unreachable or overloaded: retry
    FORBIDDEN = "forbidden"  # RBAC: retrying cannot help
    NOT_FOUND = "not found"
    CONFLICT = "conflict"
    REFUSED = "refused"  # any other answer: the request itself is wrong


def classify(exc: ApiError | ApiConnectionError) -> Failure:
    if isinstance(exc, ApiConnectionError):
        return Failure.TRANSIENT
    if exc.not_found:
        return Failure.NOT_FOUND
    if exc.conflict:
        return Failure.CONFLICT
    if exc.forbidden:
        return Failure.FORBIDDEN
    if exc.status in TRANSIENT_STATUSES:
        return Failure.TRANSIENT
    return Failure.REFUSED


def retry_delay(attempt: int) -> float:
    """The pause after failed attempt number ``attempt`` (0-based)."""
    return RETRY_DELAYS[min(attempt, len(RETRY_DELAYS) - 1)]


def requeue_delay(exc: Exception) -> float:
    """How long the operator waits before reconciling a run whose reconcile raised ``exc``."""
    if isinstance(exc, ApiError | ApiConnectionError):
        return REQUEUE_AFTER_API_ERROR
    return REQUEUE_AFTER_ERROR
