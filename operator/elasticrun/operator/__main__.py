"""``python -m elasticrun.operator`` / ``elasticrun-operator``: run the operator.

One replica by default, without kopf peering: every decision is a
compare-and-set on the API server, so a second replica would only race, and
nothing is lost while the single one restarts (nodes keep sealing rounds by
themselves; the operator catches up from the API server's state).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
from collections.abc import Sequence
from typing import Any, cast

import kopf

from elasticrun.api.kube import OPERATOR_USER_AGENT, KubeClient
from elasticrun.operator import handlers, webhook, webhookcert  # noqa: F401 - handlers: importing registers them
from elasticrun.operator.controller import Controller
from elasticrun.operator.executor import ASSIGN_CONCURRENCY
from elasticrun.operator.metrics import Metrics

log = logging.getLogger("elasticrun.operator")


def _tcp_port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port (0-65535; 0: not pinned)")
    return port


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="elasticrun-operator", description=__doc__)
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[],
                       help="watch this namespace (repeatable; globs allowed)")
    scope.add_argument("-A", "--all-namespaces", action="store_true",
                       help="watch the whole cluster (the default when no namespace is given)")
    parser.add_argument("--metrics-port", type=int,
                        default=int(os.environ.get("ELASTICRUN_METRICS_PORT", "8080")),
                        help="Prometheus metrics port (0 disables; default 8080)")
    parser.add_argument("--metrics-addr", default="0.0.0.0")
    parser.add_argument("--health-port", type=int,
                        default=int(os.environ.get("ELASTICRUN_HEALTH_PORT", "8081")),
                        help="liveness/readiness endpoint port, /healthz (0 disables)")
    parser.add_argument("--health-addr", default="0.0.0.0")
    parser.add_argument("--per-run-rbac", action="store_true",
                        help="give each ElasticRun annotated elasticrun.dev/service-account=SA "
                             "a Role limited to that run and its Leases, bound to SA (the "
                             "operator needs patch/delete on roles and rolebindings, and "
                             "itself every right it grants: RBAC forbids escalation)")
    parser.add_argument("--per-run-network-policy", type=_tcp_port, default=None, metavar="PORT",
                        help="give each ElasticRun a NetworkPolicy that admits only its own "
                             "pods to the TCPStore port PORT (0: the store port is not "
                             "pinned, so to every port); the operator needs create/patch/"
                             "delete on networkpolicies")
    parser.add_argument("--workers", type=int, default=2,
                        help="runs reconciled in parallel (default 2)")
    parser.add_argument("--kubeconfig", default=None,
                        help="kubeconfig for the operator's own writes (default: in-cluster, "
                             "else KUBECONFIG)")
    webhook.add_webhook_arguments(parser)
    parser.add_argument("-v", "--verbose", action="store_true")
    return parser.parse_args(argv)


def operator_identity() -> str:
    """The name kopf knows this operator by.

    Left to itself kopf asks ``getpass.getuser()``, which raises for a uid that
    has no passwd entry: the operator's own image user on a platform that
    assigns arbitrary uids, or any distroless image.
    """
    return os.environ.get("POD_NAME") or socket.gethostname()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        # kopf logs every handled event at INFO; the controller logs what matters.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    metrics = Metrics()
    # Connections: the workers' writes, plus a large round's assignments in parallel.
    client = KubeClient.from_config(args.kubeconfig, timeout=15, user_agent=OPERATOR_USER_AGENT,
                                    connections=ASSIGN_CONCURRENCY + 8)
    controller = Controller(client, metrics,
                            workers=args.workers, per_run_rbac=args.per_run_rbac,
                            store_policy_port=args.per_run_network_policy)

    @kopf.on.startup()
    async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.posting.level = logging.WARNING
        settings.watching.server_timeout = 300
        settings.watching.client_timeout = 330
        settings.watching.connect_timeout = 10
        settings.networking.request_timeout = 30
        settings.persistence.finalizer = "elasticrun.dev/operator"
        if args.webhook_port:
            # Making the certificate and patching the webhook configuration block.
            ca = await asyncio.to_thread(webhook.setup_webhook, settings, args,
                                         controller.client)
            if ca is not None and args.webhook_ca_check_seconds > 0:
                controller.keep(webhookcert.keep_ca_bundle(
                    controller.client, args.webhook_configuration, ca,
                    args.webhook_ca_check_seconds))
        if args.metrics_port:
            metrics.serve(args.metrics_port, args.metrics_addr)
            log.info("metrics on %s:%d/metrics", args.metrics_addr, args.metrics_port)
        controller.start()

    @kopf.on.cleanup()
    async def cleanup(**_: Any) -> None:
        await controller.stop()

    liveness = (f"http://{args.health_addr}:{args.health_port}/healthz"
                if args.health_port else None)
    clusterwide = args.all_namespaces or not args.namespace
    try:
        kopf.run(standalone=True, clusterwide=clusterwide,
                 namespaces=() if clusterwide else tuple(args.namespace),
                 liveness_endpoint=liveness, memo=kopf.Memo(controller=controller),
                 # kopf types this as its private NewType of str.
                 identity=cast(Any, operator_identity()))
    except KeyboardInterrupt:  # pragma: no cover - interactive use
        return 130
    finally:
        controller.client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
