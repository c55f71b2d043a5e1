"""The handler's side of the retry-and-error policy: API failures as torch's errors.

:func:`elasticrun.api.policy.classify` says what a failure means; here
transient failures are retried for up to ``api_timeout`` seconds and then
become ``RendezvousConnectionError``, missing permissions become
:class:`ElasticRunForbiddenError`, and any other refusal
``RendezvousStateError``.  Every message says which run and node, what the
node was doing, and what to check.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousStateError,
)

from elasticrun.api.kube import ApiConnectionError, ApiError, KubeClient, load_credentials
from elasticrun.api.policy import Failure, classify, retry_delay
from elasticrun.handler.settings import RendezvousSettings

_T = TypeVar("_T")


class ElasticRunForbiddenError(RendezvousError):
    """The node's ServiceAccount lacks a permission the rendezvous needs."""


def who(settings: RendezvousSettings) -> str:
    """How every message of the handler names the run and the node."""
    return f"rendezvous {settings.namespace}/{settings.run_name}, node {settings.node_name!r}"


def connect_client(settings: RendezvousSettings) -> KubeClient:
    """A client with the pod's credentials (or the kubeconfig's), pointed at ``api_server``."""
    try:
        credentials = load_credentials(settings.kubeconfig, settings.context)
    except Exception as exc:
        raise RendezvousConnectionError(
            f"{who(settings)}: no Kubernetes credentials ({exc}); run inside a pod with a "
            "ServiceAccount, or set KUBECONFIG or --rdzv-conf kubeconfig=PATH") from exc
    if settings.api_server:
        credentials = type(credentials)(**{**credentials.__dict__, "host": settings.api_server})
    try:
        return KubeClient(credentials, settings.request_timeout)
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        raise RendezvousConnectionError(
            f"{who(settings)}: cannot use the Kubernetes credentials' certificates (CA "
            f"{credentials.ca_file}, client certificate {credentials.cert_file}): {exc}") from exc


class ApiCalls:
    """Runs API calls for one node under the policy; ``host`` is named in outage errors."""

    def __init__(self, settings: RendezvousSettings, host: str) -> None:
        self.settings = settings
        self.host = host

    def __call__(self, what: str, action: Callable[[], _T], bound: float | None = None) -> _T:
        """Run ``action``, retrying outages for up to ``bound`` (default ``api_timeout``) s."""
        bound = self.settings.api_timeout if bound is None else bound
        deadline = time.monotonic() + bound
        attempt = 0
        while True:
            try:
                return action()
            except (ApiConnectionError, ApiError) as exc:
                self._raise_unless_transient(what, exc)
                error: Exception = exc
            delay = retry_delay(attempt)
            if time.monotonic() + delay > deadline:
                raise RendezvousConnectionError(
                    f"{who(self.settings)}: cannot {what}: the Kubernetes API server "
                    f"({self.host}) did not answer within {bound:.0f}s: {error}. Check that "
                    "it is reachable from the pod and that KUBECONFIG or the in-cluster "
                    "configuration is right") from error
            time.sleep(delay)
            attempt += 1

    def _raise_unless_transient(self, what: str, exc: ApiConnectionError | ApiError) -> None:
        failure = classify(exc)
        if failure is Failure.TRANSIENT:
            return
        if failure is Failure.FORBIDDEN:
            assert isinstance(exc, ApiError)
            raise ElasticRunForbiddenError(
                f"{who(self.settings)}: not allowed to {what}: {exc.message}. Bind the pod's "
                "ServiceAccount to the elasticrun training Role (get/list/watch/create/"
                "patch/update on elasticruns and elasticruns/status, and leases)") from exc
        raise RendezvousStateError(f"{who(self.settings)}: the API server refused to "
                                   f"{what}: {exc}") from exc
