"""Health and metrics listeners that replicas sharing one network namespace can share.

kopf binds the webhook's port with ``SO_REUSEPORT``, but its liveness endpoint
and prometheus_client's metrics server without it.  With ``--reuse-port`` the
operator binds ``/healthz`` and ``/metrics`` here with ``SO_REUSEPORT`` too, so
that several replicas in one network namespace (``hostNetwork`` pods on one
node, as on the local test node, which has no pod network) listen on the same
three ports; the kernel hands each new connection to one of the listening
replicas, and a replica that stops takes only its own listeners away.

What that costs, and why it is off by default: a probe or a scrape on such a
node reaches *a* replica, not the one kubelet or Prometheus meant, so a hung
replica's liveness probe may be answered by the other one.  With a pod network
every replica has its own ports and nothing here is used.

The ``/healthz`` answer is the one kopf's endpoint gives without probe
handlers (none are registered): an empty JSON object, served by the operator's
event loop, so a blocked loop stops answering.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from aiohttp import web
from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

HEALTH_PATH = "/healthz"


async def _healthy(_: web.Request) -> web.Response:
    return web.json_response({})


async def serve_health(addr: str, port: int) -> Coroutine[Any, Any, None]:
    """Bind ``GET /healthz`` on ``addr:port`` with SO_REUSEPORT; the work that serves it.

    Binding happens here, so a port held by a listener without SO_REUSEPORT
    raises OSError in the caller (the startup handler, which kopf retries); the
    returned coroutine serves until it is cancelled, then closes the listener.
    """
    app = web.Application()
    app.add_routes([web.get(HEALTH_PATH, _healthy)])
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=1.0, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, addr, port, reuse_port=True).start()
    except BaseException:
        await runner.cleanup()
        raise
    return _until_cancelled(runner)


async def _until_cancelled(runner: web.AppRunner) -> None:
    try:
        await asyncio.Event().wait()
    finally:
        await asyncio.shield(runner.cleanup())


class _ReusePortServer(ThreadingWSGIServer):
    allow_reuse_port = True


class _QuietHandler(WSGIRequestHandler):
    """No access log line per scrape."""

    def log_message(self, format: str, *args: Any) -> None:
        return


def serve_metrics(registry: CollectorRegistry, addr: str, port: int) -> None:
    """Serve ``registry`` on ``addr:port`` (IPv4) with SO_REUSEPORT, from a daemon thread."""
    server = make_server(addr, port, make_wsgi_app(registry), _ReusePortServer,
                         handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
