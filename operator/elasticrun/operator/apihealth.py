"""Since when the API server has been reachable, as the operator sees it.

Nodes renew their Leases through the API server.  While it is down (a control
plane upgrade, an etcd hiccup) no node can renew, so when it comes back every
Lease of every run looks expired at once, and an operator that believed them
would remove every member of every run and restart all training.  Like the
node lifecycle controller, which gives nodes a grace period after it could not
observe them, the operator counts a Lease as expired only when its holder had
a full Lease duration *of reachable API server* to renew it: the expiry clock
starts again when the API server is back (and when the operator starts, since
it cannot know what happened before).

A short GET of ``/readyz`` once a second is enough: an outage shorter than a
probe interval costs a node at most one renewal, far less than a Lease duration.
``/readyz`` fails while etcd is down, which is exactly when Leases cannot be
written, and every authenticated user may read it (``system:public-info-viewer``).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Callable

from elasticrun.api.kube import ApiConnectionError, ApiError, KubeClient
from elasticrun.api.model import now

log = logging.getLogger(__name__)

#: Seconds between two probes of ``/readyz``.
PROBE_INTERVAL = 1.0
#: A probe slower than this counts as a failed one.
PROBE_TIMEOUT = 2.0


class ApiAvailability:
    def __init__(self, client: KubeClient, on_change: Callable[[bool], None] | None = None,
                 interval: float = PROBE_INTERVAL, timeout: float = PROBE_TIMEOUT) -> None:
        self.client = client
        self.on_change = on_change
        self.interval = interval
        self.timeout = timeout
        self._since: dt.datetime | None = now()
        self._refused_logged = False

    @property
    def since(self) -> dt.datetime | None:
        """When the API server last became reachable; None while it is not."""
        return self._since

    def lease_clock_start(self, at: dt.datetime) -> dt.datetime:
        """The earliest time a Lease's expiry may be counted from, at time ``at``."""
        return self._since or at

    def record(self, reachable: bool, at: dt.datetime) -> None:
        if reachable == (self._since is not None):
            return
        self._since = at if reachable else None
        if self.on_change is not None:
            self.on_change(reachable)
        if reachable:
            log.info("the API server is reachable again; Lease expiry counts from now")
        else:
            log.warning("the API server is unreachable; no member is removed for an "
                        "expired Lease until it is back and its holder had time to renew")

    def probe(self) -> bool:
        """One GET of ``/readyz``: whether the API server is reachable and well.

        Unreachable or answering 5xx is not; any other answer, a refusal
        included, is (it answered)."""
        try:
            self.client.request("GET", "/readyz", timeout=self.timeout)
        except ApiConnectionError:
            return False
        except ApiError as exc:
            if exc.status >= 500:
                return False  # not ready: etcd or the server itself is unwell
            # Answered, but not allowed to say more (a cluster without the default
            # system:public-info-viewer binding): reachable is all we can tell.
            if not self._refused_logged:
                log.warning("GET /readyz was refused (%s); API outages are seen from "
                            "connection errors only", exc)
                self._refused_logged = True
        return True

    async def run(self) -> None:
        while True:
            reachable = await asyncio.to_thread(self.probe)
            self.record(reachable, now())
            await asyncio.sleep(self.interval)
