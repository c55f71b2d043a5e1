"""What a failed request to the API server was: answered with an error, or not answered.

The exceptions :class:`~elasticrun.api.kube.KubeClient` raises, in a module of
their own so that the pure rules about them (:mod:`elasticrun.api.policy`) and
whoever stands in for the client import no HTTP client.  Callers of the client
keep naming them through :mod:`elasticrun.api.kube`, which re-exports them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class ApiError(Exception):
    """The API server answered with an error status."""

    def __init__(self, status: int, reason: str, message: str, body: Mapping[str, Any]) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message
        self.body = body

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def conflict(self) -> bool:
        return self.status == 409

    @property
    def forbidden(self) -> bool:
        return self.status == 403

    @property
    def gone(self) -> bool:
        return self.status == 410


class ApiConnectionError(Exception):
    """The API server could not be reached (refused, reset, timed out, TLS)."""
