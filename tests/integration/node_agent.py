#!/usr/bin/env python3
"""One rendezvous node as a real process, so that chaos tests can SIGKILL it for real.

It builds a ``K8sRendezvousHandler`` from its arguments and behaves like torch's
elastic agent: ``next_rendezvous()``, then "train" while polling
``num_nodes_waiting()`` every 0.1 s (torch's monitor interval), and rendezvous
again as soon as that is positive.  Every outcome is one JSON line on stdout::

    {"event": "ready", "node": ..., "pid": ...}                     handler built
    {"event": "rendezvous", "node": ..., "round": R, "rank": r, "world": w, "t": ...}
    {"event": "restart", "node": ..., "round": R, "waiting": n, "t": ...}
    {"event": "error", "node": ..., "type": "RendezvousClosedError", "message": ..., "t": ...}

``--die-at`` makes the process SIGKILL *itself* at an exact point of the
protocol (a real SIGKILL: no ``finally``, no shutdown, the Lease is left to
expire), which is how a test kills a node mid-seal deterministically:

* ``after-join``: the node wrote its first join request and dies before anything else;
* ``before-seal``: the node computed a seal and dies before its compare-and-set;
* ``after-seal``: its compare-and-set was written, and it dies before using it;
* ``leader-after-rendezvous``: if it became rank 0 of the run's first round, it dies as soon as
  ``next_rendezvous()`` returned (a preempted pod: its TCPStore is gone, nobody
  was told);
* ``leader-at-admission``: as rank 0 of the first round, it dies the moment it
  hears that a late node waits (the round is about to re-form to admit it);
* ``leader-in-exit-barrier``: with ``--rounds``, as rank 0 of the first round it
  dies while the others wait in torch's exit barrier (its store goes with it).

``--use-store`` makes it use each round's store the way torch's agent and
workers do (a write and a read by every member); if that fails, it calls
``next_rendezvous()`` again, as torch's agent does when its workers fail::

    {"event": "store", "node": ..., "round": R, "ok": true|false, "t": ...}

With ``--rounds`` the node stops after that many rounds the way torch's agent
does when its workers succeeded: torch's own exit barrier on the round's
store (an error there is logged, not raised, as in torch), then ``shutdown()``::

    {"event": "exit-barrier", "node": ..., "ok": true|false, "t": ...}
    {"event": "shutdown", "node": ..., "t": ...}

    python tests/integration/node_agent.py --kubeconfig K --namespace NS --run R \
        --node n0 --nnodes 2:3 [--rounds 2] [--conf heartbeat_timeout=2,...]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
for extra in (ROOT / "handler", ROOT / "operator"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

import torch.distributed.elastic.utils.store as store_util  # noqa: E402

from elasticrun.api.gateway import RunGateway  # noqa: E402
from elasticrun.api.kube import KubeClient  # noqa: E402
from elasticrun.api.leases import JOIN_ANNOTATION  # noqa: E402
from elasticrun.handler.calls import connect_client  # noqa: E402
from elasticrun.handler.handler import K8sRendezvousHandler  # noqa: E402
from elasticrun.handler.settings import RendezvousSettings, from_parameters  # noqa: E402

#: The agent's timing unless --conf says otherwise: short, for tests.
TEST_CONF = {"join_timeout": "60", "last_call_timeout": "1", "heartbeat_timeout": "15",
             "lease_interval": "5", "close_timeout": "10"}

DIE_POINTS = ("before-seal", "after-seal")
DIES_AFTER_JOIN = "after-join"
LEADER_DIES = "leader-after-rendezvous"
LEADER_DIES_AT_ADMISSION = "leader-at-admission"
LEADER_DIES_IN_EXIT_BARRIER = "leader-in-exit-barrier"
LEADER_POINTS = (LEADER_DIES, LEADER_DIES_AT_ADMISSION, LEADER_DIES_IN_EXIT_BARRIER)
#: torch's default exit barrier timeout (``--exit-barrier-timeout``... of the agent).
EXIT_BARRIER_TIMEOUT = 300.0
#: How long rank 0 lets the others enter the exit barrier before it dies there.
BARRIER_ENTRY = 1.0
#: How long a member's first use of the round's store may take before it counts as failed.
STORE_USE_TIMEOUT = 10.0


def emit(event: str, node: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "node": node, "t": time.time(), **fields}), flush=True)


def parse_conf(text: str) -> dict[str, str]:
    conf: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = item.partition("=")
        conf[key.strip()] = value.strip()
    return conf


def settings_from(args: argparse.Namespace) -> RendezvousSettings:
    """The settings torchrun would give the handler for these arguments."""
    low, _, high = args.nnodes.partition(":")
    conf = {**TEST_CONF, **parse_conf(args.conf), "namespace": args.namespace,
            "node_name": args.node, "kubeconfig": args.kubeconfig, "pod": args.pod or ""}
    return from_parameters(run_id=args.run, endpoint="", min_nodes=int(low),
                           max_nodes=int(high or low), local_addr=args.address, conf=conf)


class DyingGateway(RunGateway):
    """A gateway that SIGKILLs its own process around the node's seal compare-and-set."""

    def __init__(self, settings: RendezvousSettings, point: str) -> None:
        super().__init__(connect_client(settings), settings.namespace, settings.run_name)
        self.node = settings.node_name
        self.point = point

    def replace_status(self, resource_version: str | None, status: Mapping[str, Any],
                       manager: str) -> dict[str, Any] | None:
        sealed_round = int(status.get("round") or 0)
        sealing = sealed_round > self._stored_round()
        if sealing and self.point == "before-seal":
            self._die(sealed_round)
        written = super().replace_status(resource_version, status, manager)
        if sealing and written is not None and self.point == "after-seal":
            self._die(sealed_round)
        return written

    def _stored_round(self) -> int:
        stored = self.read() or {}
        return int((stored.get("status") or {}).get("round") or 0)

    def _die(self, sealed_round: int) -> None:
        die(self.node, self.point, sealed_round)


class JoinThenDie(KubeClient):
    """A client that SIGKILLs its process right after the node's join request was written:
    the first write that puts a join annotation on a Lease (its create, or the patch of
    its annotations) and succeeds."""

    def __init__(self, settings: RendezvousSettings) -> None:
        connected = connect_client(settings)
        super().__init__(connected.credentials, connected.timeout, connected.user_agent)
        self.node = settings.node_name

    def request(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        answer = super().request(method, path, **kwargs)
        body = kwargs.get("body")
        meta = body.get("metadata") if isinstance(body, dict) else None
        annotations = (meta.get("annotations") if isinstance(meta, dict) else None) or {}
        if "/leases" in path and annotations.get(JOIN_ANNOTATION):
            die(self.node, DIES_AFTER_JOIN, 0)
        return answer


def build(args: argparse.Namespace) -> K8sRendezvousHandler:
    settings = settings_from(args)
    if args.die_at == DIES_AFTER_JOIN:
        return K8sRendezvousHandler(settings, client=JoinThenDie(settings))
    if args.die_at in DIE_POINTS:
        return K8sRendezvousHandler(settings, gateway=DyingGateway(settings, args.die_at))
    return K8sRendezvousHandler(settings)


def settle(info: Any, bound: float = 15.0) -> None:
    """Before a node that stops after its last round leaves: every peer reached the store.

    Rank 0 hosts the round's TCPStore and closes it on shutdown; a peer still
    connecting (it learns of the round a moment later, through its watch)
    would otherwise wait out torch's connect timeout.  Every node counts
    itself in; rank 0 waits, bounded, until all have.
    """
    key = "elasticrun.test.settled"
    info.store.add(key, 1)
    if info.rank != 0:
        return
    deadline = time.monotonic() + bound
    while info.store.add(key, 0) < info.world_size and time.monotonic() < deadline:
        time.sleep(0.02)


def exit_barrier(info: Any, node: str) -> bool:
    """torch's agent at the end of training: its own barrier, errors logged, not raised."""
    try:
        store_util.barrier(store=info.store, world_size=info.world_size,
                           key_prefix="elasticrun.test.exit", barrier_timeout=EXIT_BARRIER_TIMEOUT)
    except Exception as exc:  # torch's _exit_barrier logs every error
        emit("exit-barrier", node, ok=False,
             message=str(exc).splitlines()[0] if str(exc) else repr(exc))
        return False
    emit("exit-barrier", node, ok=True)
    return True


def die(node: str, point: str, round_number: int) -> None:
    emit("dying", node, point=point, round=round_number)
    os.kill(os.getpid(), signal.SIGKILL)


def use_store(info: Any, node: str) -> bool:
    """Every member writes its key and reads rank 0's, through the round's store."""
    try:
        info.store.set_timeout(dt.timedelta(seconds=STORE_USE_TIMEOUT))
        info.store.set(f"elasticrun.test.node.{info.rank}", node)
        info.store.get("elasticrun.test.node.0")
    except (RuntimeError, OSError) as exc:
        emit("store-error", node, message=str(exc).splitlines()[0] if str(exc) else repr(exc))
        return False
    return True


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--node", required=True)
    parser.add_argument("--pod", default=None)
    parser.add_argument("--address", default="127.0.0.1")
    parser.add_argument("--nnodes", default="1:1", help="MIN:MAX, as torchrun's --nnodes")
    parser.add_argument("--conf", default="", help="key=value,... as --rdzv-conf")
    parser.add_argument("--rounds", type=int, default=0,
                        help="stop (with shutdown()) after this many rounds; 0: never")
    parser.add_argument("--die-at", default=None,
                        choices=(*DIE_POINTS, DIES_AFTER_JOIN, *LEADER_POINTS))
    parser.add_argument("--use-store", action="store_true",
                        help="use each round's store; rendezvous again if that fails")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="DEBUG logs on stderr (the security tests grep them)")
    return parser.parse_args(argv)


def finish(info: Any, node: str, die_at: str | None, leader: bool) -> None:
    """The end of training: the exit barrier (torch's, or ``settle``) before shutdown."""
    if die_at != LEADER_DIES_IN_EXIT_BARRIER:
        settle(info)
        return
    if leader:
        time.sleep(BARRIER_ENTRY)
        die(node, LEADER_DIES_IN_EXIT_BARRIER, 1)
    exit_barrier(info, node)


def agent_loop(handler: K8sRendezvousHandler, args: argparse.Namespace) -> int:
    """torch's agent, as far as the rendezvous sees it; the exit code."""
    node, done = args.node, 0
    while not args.rounds or done < args.rounds:
        try:
            info = handler.next_rendezvous()
        except Exception as exc:  # reported, as torch's agent would
            emit("error", node, type=type(exc).__name__, message=str(exc))
            return 1
        done += 1
        emit("rendezvous", node, round=handler.round, rank=info.rank,
             world=info.world_size, store=[info.bootstrap_store_info.master_addr,
                                           info.bootstrap_store_info.master_port])
        first_leader = info.rank == 0 and handler.round == 1
        if args.die_at == LEADER_DIES and first_leader:
            die(node, LEADER_DIES, handler.round)
        if args.use_store:
            ok = use_store(info, node)
            emit("store", node, round=handler.round, ok=ok)
            if not ok:
                continue  # the workers failed: torch's agent re-enters the rendezvous
        if args.rounds and done >= args.rounds:
            finish(info, node, args.die_at, first_leader)
            break
        # Training: torch's monitor loop asks every 0.1 s whether to re-form.
        while (waiting := handler.num_nodes_waiting()) == 0:
            time.sleep(0.1)
        if args.die_at == LEADER_DIES_AT_ADMISSION and first_leader:
            die(node, LEADER_DIES_AT_ADMISSION, handler.round)
        emit("restart", node, round=handler.round, waiting=waiting)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    handler = build(args)
    emit("ready", args.node, pid=os.getpid())
    try:
        return agent_loop(handler, args)
    finally:
        if args.rounds:
            handler.shutdown()
            emit("shutdown", args.node)


if __name__ == "__main__":
    sys.exit(main())
