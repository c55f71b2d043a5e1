"""Node warnings (``--node-signal``): which signals a Node shows and what they mean for a run.

A cordon, a spot or maintenance notice, a GPU-health condition: the cluster
often says a node is going before it goes.  The operator reads the Nodes of a
run's pods (``spec.nodeName``) when node signals are enabled, and each
configured signal (a taint key, a label key and optional value, or a node
condition type and status) has a policy:

* ``observe``: a Warning Event naming the member and the signal, the run's
  ``NodeSignals`` condition, the ``elasticrun_node_signals`` gauge;
* ``exclude``: the node's entry is held back from the next rounds, as a
  drained node is (``status.excludedNodes``, read by
  :func:`elasticrun.api.rounds.eligible_waiting`);
* ``drain``: held back too, and a member on that Node leaves its round at once
  (reason ``NodeDraining``), so the survivors re-form before anything is evicted.

Everything here is pure.  A Node is an object the operator does not own, and
anyone who may label Nodes writes it: :func:`read_node` keeps a bounded number
of bounded keys, never raises, and ignores everything else.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from elasticrun.api import untrusted

Kind = Literal["taint", "label", "condition"]
Policy = Literal["observe", "exclude", "drain"]
KINDS: tuple[Kind, ...] = ("taint", "label", "condition")
#: Policies, weakest first: when several signals of one Node match, the strongest wins.
POLICIES: tuple[Policy, ...] = ("observe", "exclude", "drain")

#: What is read of one Node: at most this many taints, labels and conditions
#: (the rest is ignored), keys of at most MAX_KEY_CHARS (a label key: a
#: 253-character prefix, '/', a 63-character name) and values of MAX_VALUE_CHARS.
MAX_TAINTS = 64
MAX_LABELS = 256
MAX_CONDITIONS = 64
MAX_KEY_CHARS = 317
MAX_VALUE_CHARS = 63
#: At most this many signals may be configured.
MAX_SIGNALS = 64
#: A signal that went away still counts for this long after it was last seen,
#: so a Node whose taint flaps makes one Event and one exclusion, not one per flap.
HOLD_SECONDS = 10.0
@dataclass(frozen=True)
class Signal:
    """One configured signal; ``value`` None matches any value (label) or ``True``
    (condition)."""

    kind: Kind
    key: str
    value: str | None = None
    policy: Policy = "observe"

    @property
    def name(self) -> str:
        """What Events, the condition and the metric's ``signal`` label call it."""
        return f"{self.kind}:{self.key}" + (f"={self.value}" if self.value is not None else "")


#: The defaults, each with where it comes from (docs/integrations.md names them too).
DEFAULT_SIGNALS: tuple[Signal, ...] = (
    # kubectl cordon / drain, and the cluster autoscaler's scale-down.
    Signal("taint", "node.kubernetes.io/unschedulable", policy="exclude"),
    # AWS Node Termination Handler: spot interruption notice, rebalance
    # recommendation, ASG lifecycle termination, scheduled maintenance events.
    Signal("taint", "aws-node-termination-handler/spot-itn", policy="drain"),
    Signal("taint", "aws-node-termination-handler/rebalance-recommendation", policy="exclude"),
    Signal("taint", "aws-node-termination-handler/asg-lifecycle-termination", policy="drain"),
    Signal("taint", "aws-node-termination-handler/scheduled-maintenance", policy="exclude"),
    # GKE: preemption / spot termination notice taint, planned maintenance label.
    Signal("taint", "cloud.google.com/impending-node-termination", policy="drain"),
    Signal("label", "cloud.google.com/scheduled-maintenance-time", policy="observe"),
    # Azure (AKS) spot pools carry this taint on every node: a spot node, not a notice.
    Signal("taint", "kubernetes.azure.com/scalesetpriority", value="spot", policy="observe"),
    # Karpenter's disruption taint (a node being consolidated or expired).
    Signal("taint", "karpenter.sh/disrupted", policy="drain"),
    # A Node Problem Detector custom plugin or DCGM health check writing a GPU fault as
    # a node condition (names depend on that configuration: both common forms).
    Signal("condition", "GPUUnhealthy", value="True", policy="exclude"),
    Signal("condition", "GPUHealthy", value="False", policy="exclude"),
)


class SignalError(ValueError):
    """A ``--node-signal`` that cannot be read; the message says the form."""


def parse_signal(text: str) -> Signal:
    """``KIND:KEY[=VALUE]:POLICY``, e.g. ``taint:example.com/spot=:drain`` or
    ``condition:GPUHealthy=False:exclude``."""
    form = "expected KIND:KEY[=VALUE]:POLICY with KIND one of taint, label, condition " \
           "and POLICY one of observe, exclude, drain"
    kind, sep, rest = text.partition(":")
    key_value, sep2, policy = rest.rpartition(":")
    if not sep or not sep2 or kind not in KINDS or policy not in POLICIES:
        raise SignalError(f"{text!r}: {form}")
    key, eq, value = key_value.partition("=")
    if not key or len(key) > MAX_KEY_CHARS or len(value) > MAX_VALUE_CHARS:
        raise SignalError(f"{text!r}: the key must be 1..{MAX_KEY_CHARS} characters and "
                          f"the value at most {MAX_VALUE_CHARS}")
    return Signal(kind, key, value if eq else None, policy)


def configured(texts: Sequence[str], defaults: bool) -> tuple[Signal, ...]:
    """The signals to look for: the defaults (if asked), then ``texts``; a later
    signal of the same kind and key replaces an earlier one."""
    chosen: dict[tuple[str, str], Signal] = {}
    for signal in (*(DEFAULT_SIGNALS if defaults else ()), *map(parse_signal, texts)):
        chosen[(signal.kind, signal.key)] = signal
    if len(chosen) > MAX_SIGNALS:
        raise SignalError(f"at most {MAX_SIGNALS} node signals, {len(chosen)} given")
    return tuple(chosen.values())


@dataclass(frozen=True)
class NodeFacts:
    """What the operator keeps of one Node: bounded taint keys, labels and conditions."""

    taints: Mapping[str, str] = field(default_factory=dict)  # key -> value ('' if none)
    labels: Mapping[str, str] = field(default_factory=dict)
    conditions: Mapping[str, str] = field(default_factory=dict)  # type -> status


def _pairs(items: Iterable[Any], key: str, value: str, limit: int) -> dict[str, str]:
    found: dict[str, str] = {}
    for item in items:
        if len(found) >= limit:
            break
        entry = untrusted.mapping(item)
        name = untrusted.text(entry.get(key), MAX_KEY_CHARS)
        if name is not None:
            found.setdefault(name, untrusted.text(entry.get(value), MAX_VALUE_CHARS) or "")
    return found


def read_node(body: Any) -> NodeFacts:
    """The facts of a Node body, whatever it holds (never raises)."""
    obj = untrusted.mapping(body)
    meta, spec, status = (untrusted.mapping(obj.get(k)) for k in ("metadata", "spec", "status"))
    raw_labels = untrusted.mapping(meta.get("labels"))
    labels = _pairs(({"k": k, "v": v} for k, v in raw_labels.items()), "k", "v", MAX_LABELS)
    taints = spec.get("taints")
    conditions = status.get("conditions")
    return NodeFacts(
        taints=_pairs(taints if isinstance(taints, list) else (), "key", "value", MAX_TAINTS),
        labels=labels,
        conditions=_pairs(conditions if isinstance(conditions, list) else (), "type",
                          "status", MAX_CONDITIONS))


def _matches(signal: Signal, facts: NodeFacts) -> bool:
    if signal.kind == "condition":
        status = facts.conditions.get(signal.key)
        return status is not None and status == (signal.value or "True")
    found = (facts.taints if signal.kind == "taint" else facts.labels).get(signal.key)
    return found is not None and (signal.value is None or found == signal.value)


def shown(signals: Iterable[Signal], facts: NodeFacts) -> tuple[Signal, ...]:
    """The configured signals this Node shows, in the configured order."""
    return tuple(s for s in signals if _matches(s, facts))


def strongest(signals: Iterable[Signal]) -> Policy | None:
    """The policy that wins among ``signals``: drain > exclude > observe; None if none."""
    ranks = [POLICIES.index(s.policy) for s in signals]
    return POLICIES[max(ranks)] if ranks else None


class SignalMemory:
    """What each Node shows, held for :data:`HOLD_SECONDS` after it went away.

    A signal shows at once; it stops showing only once the Node has not shown
    it for the hold, so a flapping taint is one change, not one per flap.
    Times are the operator's own clock.
    """

    def __init__(self, hold: float = HOLD_SECONDS) -> None:
        self.hold = dt.timedelta(seconds=hold)
        #: Per Node, per signal: None while the Node shows it, else when it went away.
        self._seen: dict[str, dict[Signal, dt.datetime | None]] = {}

    def observe(self, node: str, signals: Iterable[Signal], now: dt.datetime) -> bool:
        """Record what ``node`` shows now; True when what it counts as showing changed."""
        before = self.showing(node, now)
        seen = self._seen.setdefault(node, {})
        current = set(signals)
        for signal, gone in list(seen.items()):
            if signal not in current and gone is None:
                seen[signal] = now
        for signal in current:
            seen[signal] = None
        kept = {s: gone for s, gone in seen.items() if self._held(gone, now)}
        if kept:
            self._seen[node] = kept
        else:
            del self._seen[node]
        return self.showing(node, now) != before

    def forget(self, node: str) -> None:
        self._seen.pop(node, None)

    def _held(self, gone: dt.datetime | None, now: dt.datetime) -> bool:
        return gone is None or now - gone < self.hold

    def showing(self, node: str, now: dt.datetime) -> tuple[Signal, ...]:
        """The signals ``node`` counts as showing at ``now``, by name."""
        seen = self._seen.get(node, {})
        return tuple(sorted((s for s, gone in seen.items() if self._held(gone, now)),
                            key=lambda s: s.name))

    def expires(self, node: str, now: dt.datetime) -> dt.datetime | None:
        """When the next signal ``node`` no longer shows stops counting; None if none."""
        ends = [gone + self.hold for gone in self._seen.get(node, {}).values()
                if gone is not None and gone + self.hold > now]
        return min(ends) if ends else None

    def prune(self, now: dt.datetime) -> None:
        """Drop signals past their hold (memory stays bounded by Nodes x signals)."""
        for node in list(self._seen):
            kept = {s: gone for s, gone in self._seen[node].items() if self._held(gone, now)}
            if kept:
                self._seen[node] = kept
            else:
                del self._seen[node]


@dataclass(frozen=True)
class Shown:
    """The signals the Node of one member or waiting node shows, as the operator holds them."""

    node: str
    signals: tuple[Signal, ...] = ()

    @property
    def policy(self) -> Policy | None:
        return strongest(self.signals)

    def describe(self) -> str:
        """``Node n shows taint:k (drain), label:l (observe)``, for Events and conditions."""
        shown_ = ", ".join(f"{s.name} ({s.policy})" for s in self.signals)
        return f"Node {self.node} shows {shown_}"


def excluded_pods(shown_by_pod: Mapping[str, Shown]) -> tuple[str, ...]:
    """The pods whose Node's strongest signal is ``exclude`` or ``drain``, sorted."""
    return tuple(sorted(pod for pod, s in shown_by_pod.items()
                        if s.policy in ("exclude", "drain")))


def draining(shown_by_pod: Mapping[str, Shown], members: Iterable[tuple[str, str]]
             ) -> list[str]:
    """The members, given as (name, pod), whose Node's strongest signal is ``drain``:
    they leave their round."""
    return sorted(name for name, pod in members
                  if (s := shown_by_pod.get(pod)) is not None and s.policy == "drain")


def counts(shown_by_pod: Mapping[str, Shown]) -> dict[str, int]:
    """How many of the run's pods show each signal (the ``elasticrun_node_signals`` gauge)."""
    found: dict[str, int] = {}
    for s in shown_by_pod.values():
        for signal in s.signals:
            found[signal.name] = found.get(signal.name, 0) + 1
    return found
