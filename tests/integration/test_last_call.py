"""The last call keeps torch's promise: every node that asks within it is in the round.

Joins write the nodes' own Leases, never the run, so a node that slept through
the last call on an unchanged run still held the listing it made when the call
opened: three nodes started together on a run 2:4 formed a round of two, 2 s
after the second join, in most tries, and the third waited for its join
timeout.  Each try here starts three nodes at once (handlers made by torch's
own registry, as torchrun makes them; no operator) and asserts one round of
all three.
"""

from __future__ import annotations

from typing import Any

from elasticrun.api.model import now

from conftest import TEST_NODE_CONF, Cluster
from rdzv import read_run, rendezvous_all

TRIES = 20
LAST_CALL = 2
NODES = ("n0", "n1", "n2")


def registry_handler(cluster: Cluster, namespace: str, run: str, node: str) -> Any:
    """A handler as torchrun builds it: ``--rdzv-backend=k8s --nnodes=2:4``."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    conf = {**TEST_NODE_CONF, "last_call_timeout": LAST_CALL, "namespace": namespace,
            "node_name": node, "kubeconfig": str(cluster.kubeconfig)}
    params = RendezvousParameters(backend="k8s", endpoint="", run_id=run, min_nodes=2,
                                  max_nodes=4, local_addr="127.0.0.1",
                                  **{k: str(v) for k, v in conf.items()})
    return get_rendezvous_handler(params)


def test_three_nodes_started_together_form_one_round_of_all_three_every_time(
        cluster: Cluster, namespace: str) -> None:
    for attempt in range(TRIES):
        run = f"together-{attempt}"
        handlers = [registry_handler(cluster, namespace, run, node) for node in NODES]
        try:
            started = now()
            outcomes = rendezvous_all(handlers, timeout=40)
            errors = {n: repr(o.error) for n, o in outcomes.items() if o.error}
            assert not errors, f"try {attempt}: {errors}"
            final = read_run(cluster.client, namespace, run)
            sizes = {n: o.world_size for n, o in outcomes.items()}
            assert sizes == dict.fromkeys(NODES, 3), f"try {attempt}: {sizes}"
            assert sorted(o.rank for o in outcomes.values()) == [0, 1, 2]
            assert (final.status.round, final.status.member_names) == (1, frozenset(NODES)), \
                f"try {attempt}: round {final.status.round} of {sorted(final.status.member_names)}"
            # It was the last call that sealed it (maxNodes is 4), not a shortcut.
            assert final.status.sealed_at is not None
            assert (final.status.sealed_at - started).total_seconds() >= LAST_CALL - 0.5
        finally:
            for handler in handlers:
                handler.shutdown()
