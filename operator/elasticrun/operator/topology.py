"""Topology-ordered ranks (``--topology-keys``): the values of a Node's topology labels.

Newcomers without a pod index are ranked by the topology values of their Node
(:func:`elasticrun.api.rounds.newcomer_key`), so that the nodes of one domain
(a zone, a block or rack, a host) get consecutive ranks.  A Pod cannot read its
Node's labels, so the operator reads them (the Node watch it holds for node
signals) and writes them into the waiting entry of that Pod,
``status.waiting[].topology``, the one home nodes read them from
(:func:`elasticrun.api.rounds.with_topology`).

Everything here is pure.  A Node's labels are anyone's who may label Nodes:
:func:`node_topology` reads only the configured keys, bounds each value, and
never raises.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from elasticrun.api import untrusted
from elasticrun.api.model import MAX_TOPOLOGY_CHARS, MAX_TOPOLOGY_VALUES, WaitingNode
from elasticrun.operator.nodesignals import MAX_KEY_CHARS


class TopologyKeyError(ValueError):
    """A ``--topology-keys`` value that cannot be used; the message says why."""


def parse_keys(text: str) -> tuple[str, ...]:
    """``KEY[,KEY...]``, broadest domain first; empty means off.

    At most :data:`~elasticrun.api.model.MAX_TOPOLOGY_VALUES` keys (what a
    waiting entry keeps), each a label key of 1..317 characters, no repeats.
    """
    keys = tuple(k.strip() for k in text.split(",") if k.strip())
    if len(keys) > MAX_TOPOLOGY_VALUES:
        raise TopologyKeyError(f"{text!r}: at most {MAX_TOPOLOGY_VALUES} keys, {len(keys)} given")
    for key in keys:
        if len(key) > MAX_KEY_CHARS or any(c.isspace() for c in key):
            raise TopologyKeyError(f"{key!r}: a label key of 1..{MAX_KEY_CHARS} characters "
                                   "without spaces")
    if len(set(keys)) != len(keys):
        raise TopologyKeyError(f"{text!r}: a key is named twice")
    return keys


def node_topology(body: Any, keys: Sequence[str]) -> tuple[str, ...]:
    """The values of ``keys`` among a Node body's labels, in the keys' order ("" for a
    key the Node lacks or holds a value that is not a bounded string); () when the Node
    has none of them, so that its pods count as of an unknown domain (ranked last)."""
    labels = untrusted.mapping(untrusted.mapping(untrusted.mapping(body).get("metadata"))
                               .get("labels"))
    values = tuple(untrusted.text(labels.get(key), MAX_TOPOLOGY_CHARS) or ""
                   for key in keys[:MAX_TOPOLOGY_VALUES])
    return values if any(values) else ()


def with_pod_topology(waiting: Sequence[WaitingNode],
                      by_pod: Mapping[str, tuple[str | None, tuple[str, ...]]]
                      ) -> tuple[WaitingNode, ...]:
    """The waiting entries, each with the topology values of its Pod's Node.

    ``by_pod`` is what the operator saw: per pod name, the Pod's uid and the
    values of the Node it is bound to.  An entry names its pod (``pod``; an
    entry that named none has no Pod and gets no values, whatever Pod shares
    its node name) and that Pod's uid; when both the entry and the watch know a
    uid and they differ, the entry is of another Pod of that name and gets no
    values.  The operator's values replace whatever the entry held: a node
    never writes topology (``leases.read_join`` drops it).
    """
    filled = []
    for entry in waiting:
        uid, values = by_pod.get(entry.pod, (None, ())) if entry.pod else (None, ())
        if uid is not None and entry.pod_uid is not None and uid != entry.pod_uid:
            values = ()
        filled.append(entry if entry.topology == values else
                      dataclasses.replace(entry, topology=values))
    return tuple(filled)
