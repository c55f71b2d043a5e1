"""``python -m elasticrun.operator`` / ``elasticrun-operator``: run the operator.

Without ``--leader-elect`` this process decides on its own (one replica; kopf
peering is never used).  With it, any number of replicas run: each serves the
webhook, ``/healthz`` and metrics and observes every run, and the one holding
the Lease ``--leader-elect-resource-name`` in ``--leader-elect-resource-namespace``
reconciles (:mod:`elasticrun.operator.elector`).  Nothing is lost while no
replica leads: nodes keep sealing rounds by themselves, and the next leader
catches up from the API server's state.
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
from elasticrun.operator import (  # handlers: importing registers them with kopf
    elector,
    handlers,
    listen,
    nodesignals,
    topology,
    webhook,
    webhookcert,
)
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
    parser.add_argument("--reuse-port", action="store_true",
                        help="bind the health and metrics ports with SO_REUSEPORT, as the "
                             "webhook's always is: replicas sharing one network namespace "
                             "(hostNetwork pods on one node) share the ports, and each "
                             "connection reaches one of them")
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
    parser.add_argument("--node-signals", action="store_true",
                        help="read the Nodes of the runs' pods (a cluster-wide watch of Nodes) "
                             "and act on the default node signals (docs/integrations.md)")
    parser.add_argument("--node-signal", action="append", default=[],
                        metavar="KIND:KEY[=VALUE]:POLICY",
                        help="a node signal to act on (kind taint, label or condition; policy "
                             "observe, exclude or drain); repeatable, replaces a default of "
                             "the same kind and key; implies --node-signals")
    parser.add_argument("--no-default-node-signals", action="store_true",
                        help="only the --node-signal ones, not the defaults")
    parser.add_argument("--topology-keys", type=_topology_keys, default=(), metavar="KEY[,KEY...]",
                        help="rank newcomers without a pod index by these labels of their "
                             "Node, broadest domain first (e.g. topology.kubernetes.io/zone,"
                             "kubernetes.io/hostname; at most 4): a cluster-wide watch of Nodes "
                             "(docs/integrations.md); empty (the default): off")
    parser.add_argument("--workers", type=int, default=2,
                        help="runs reconciled in parallel (default 2)")
    parser.add_argument("--kubeconfig", default=None,
                        help="kubeconfig for the operator's own writes (default: in-cluster, "
                             "else KUBECONFIG)")
    webhook.add_webhook_arguments(parser)
    add_election_arguments(parser)
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.leader_elect:
        problem = election_timing(args).problem()
        if problem:
            parser.error(problem)
        if not args.leader_elect_resource_namespace:
            parser.error("--leader-elect needs --leader-elect-resource-namespace "
                         "(or POD_NAMESPACE): the namespace of the operator's Lease")
    return args


def node_signals(args: argparse.Namespace) -> tuple[nodesignals.Signal, ...] | None:
    """The configured node signals; None when Nodes are not read (exits 2 on a bad one)."""
    if not (args.node_signals or args.node_signal):
        return None
    try:
        return nodesignals.configured(args.node_signal, not args.no_default_node_signals)
    except nodesignals.SignalError as exc:
        raise SystemExit(f"elasticrun-operator: --node-signal {exc}") from exc


def _topology_keys(text: str) -> tuple[str, ...]:
    try:
        return topology.parse_keys(text)
    except topology.TopologyKeyError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def watch_nodes(signals: tuple[nodesignals.Signal, ...] | None,
                topology_keys: tuple[str, ...] = ()) -> None:
    """Register the one Node watch only when node signals or topology keys are on:
    without either the operator neither needs nor uses any right on Nodes."""
    if signals is None and not topology_keys:
        return
    kopf.on.event("", "v1", "nodes")(handlers.node_changed)
    if signals is not None:
        log.info("node signals: %s", ", ".join(f"{s.name} ({s.policy})" for s in signals))
    if topology_keys:
        log.info("topology keys: %s", ", ".join(topology_keys))


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"{text}: expected seconds in (0, 3600]")
    return value


def add_election_arguments(parser: argparse.ArgumentParser) -> None:
    """client-go's flag names and defaults, so the chart reads like other controllers'."""
    parser.add_argument("--leader-elect", action="store_true",
                        default=os.environ.get("ELASTICRUN_LEADER_ELECT") == "true",
                        help="run as one of several replicas: reconcile only while holding "
                             "the leader Lease (every replica serves the webhook and metrics)")
    parser.add_argument("--leader-elect-resource-namespace",
                        default=os.environ.get("POD_NAMESPACE", ""),
                        help="namespace of the leader Lease (default: $POD_NAMESPACE)")
    parser.add_argument("--leader-elect-resource-name", default=elector.LEASE_NAME,
                        help=f"name of the leader Lease (default {elector.LEASE_NAME})")
    defaults = elector.Timing()
    parser.add_argument("--leader-elect-lease-duration", type=_seconds,
                        default=defaults.lease_duration,
                        help="seconds a follower waits, by its own clock, after the last change "
                             "of the Lease it saw before taking it over (default 15)")
    parser.add_argument("--leader-elect-renew-deadline", type=_seconds,
                        default=defaults.renew_deadline,
                        help="seconds after its last successful renewal at which a leader stops "
                             "reconciling (default 10; less than the lease duration)")
    parser.add_argument("--leader-elect-retry-period", type=_seconds,
                        default=defaults.retry_period,
                        help="seconds between two attempts to renew or acquire (default 2)")


def election_timing(args: argparse.Namespace) -> elector.Timing:
    return elector.Timing(lease_duration=args.leader_elect_lease_duration,
                          renew_deadline=args.leader_elect_renew_deadline,
                          retry_period=args.leader_elect_retry_period)


def operator_identity() -> str:
    """The name kopf knows this operator by.

    Left to itself kopf asks ``getpass.getuser()``, which raises for a uid that
    has no passwd entry: the operator's own image user on a platform that
    assigns arbitrary uids, or any distroless image.
    """
    return os.environ.get("POD_NAME") or socket.gethostname()


def main(argv: Sequence[str] | None = None) -> int:  # noqa: PLR0915 - the wiring, in one place
    args = parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        # kopf logs every handled event at INFO; the controller logs what matters.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    metrics = Metrics()
    me = elector.identity(operator_identity())
    # The holder name in the user agent: the audit log tells replicas apart.
    agent = f"{OPERATOR_USER_AGENT} ({me})"
    # Connections: the workers' writes, plus a large round's slices in parallel.
    client = KubeClient.from_config(args.kubeconfig, timeout=15, user_agent=agent,
                                    connections=ASSIGN_CONCURRENCY + 8)
    candidate: elector.Elector | None = None
    decider = client
    if args.leader_elect:
        # Its own connections: a renewal never queues behind the workers' requests.
        candidate = elector.Elector(
            KubeClient.from_config(args.kubeconfig, timeout=15, user_agent=agent, connections=2),
            args.leader_elect_resource_namespace, me, election_timing(args),
            name=args.leader_elect_resource_name, on_change=metrics.leading)
        decider = elector.FencedClient(client, candidate.may_write)
        metrics.leading(False)
    controller = Controller(decider, metrics,
                            workers=args.workers, per_run_rbac=args.per_run_rbac,
                            store_policy_port=args.per_run_network_policy,
                            node_signals=node_signals(args), topology_keys=args.topology_keys)
    watch_nodes(controller.node_signals, controller.topology_keys)
    if candidate is not None:
        candidate.on_lead, candidate.on_follow = controller.lead, controller.follow

    @kopf.on.startup()
    async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.posting.level = logging.WARNING
        settings.watching.server_timeout = 300
        settings.watching.client_timeout = 330
        settings.watching.connect_timeout = 10
        settings.networking.request_timeout = 30
        settings.persistence.finalizer = "elasticrun.dev/operator"
        if args.health_port and args.reuse_port:
            # kopf binds its liveness endpoint without SO_REUSEPORT: a shared one is served here.
            controller.keep(await listen.serve_health(args.health_addr, args.health_port))
        if args.webhook_port:
            # Making the certificate and patching the webhook configuration block.
            # Every replica serves the webhook: its set-up is not fenced.
            ca = await asyncio.to_thread(webhook.setup_webhook, settings, args, client)
            if ca is not None and args.webhook_ca_check_seconds > 0:
                controller.keep(webhookcert.keep_ca_bundle(
                    client, args.webhook_configuration, ca,
                    args.webhook_ca_check_seconds))
        if args.metrics_port:
            metrics.serve(args.metrics_port, args.metrics_addr, reuse_port=args.reuse_port)
            log.info("metrics on %s:%d/metrics", args.metrics_addr, args.metrics_port)
        controller.start(decide=candidate is None)
        if candidate is not None:
            controller.keep(candidate.run())

    @kopf.on.cleanup()
    async def cleanup(**_: Any) -> None:
        await controller.stop()
        if candidate is not None:
            await candidate.stop()
            await asyncio.to_thread(candidate.release)

    liveness = (f"http://{args.health_addr}:{args.health_port}/healthz"
                if args.health_port and not args.reuse_port else None)
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
        client.close()
        if candidate is not None:
            candidate.client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
