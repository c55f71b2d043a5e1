"""Property: the status parser reads anything or says which field is wrong, never crashes.

A status can be edited by hand (``kubectl edit --subresource=status``) into any
shape the schema lets through, and an object from another version of the
operator can carry anything.  Every reader goes through
:func:`elasticrun.api.model.parse_run`; if it raised anything but
``InvalidRunError`` (a ``KeyError``, ``TypeError``, an ``AttributeError``), the
handler would hand torch an arbitrary exception instead of
``RendezvousStateError`` naming the field.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from elasticrun.api.model import InvalidRunError, RunStatus, parse_run

SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-2**63, max_value=2**63),
    st.floats(allow_nan=True), st.text(max_size=12),
    st.sampled_from(["Running", "Degraded", "True", "2026-01-01T00:00:00Z", "", "0", "-1",
                     "2026-13-45T99:00:00Z", "x" * 300]),
)
JSON = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)

MEMBER_KEYS = ["name", "rank", "address", "storePort", "joinedRound", "pod", "since"]
STATUS_KEYS = ["phase", "round", "signal", "joinNotice", "restartRound", "participants",
               "waiting", "store", "lostMembers", "conditions", "sealedAt", "finishedAt",
               "waitingCount", "observedGeneration", "memberCount"]


def _entries(keys: list[str]) -> st.SearchStrategy[Any]:
    """Objects shaped like list entries: the known keys with arbitrary values, or anything."""
    entry = st.dictionaries(st.sampled_from(keys), JSON, max_size=len(keys))
    return st.one_of(st.lists(st.one_of(entry, JSON), max_size=4), JSON)


PLAUSIBLE = st.fixed_dictionaries({}, optional={
    "phase": st.one_of(st.sampled_from(["Pending", "Forming", "Running", "Degraded", "Closed",
                                        "Succeeded", "Bogus"]), JSON),
    "round": st.one_of(st.integers(min_value=-3, max_value=5), JSON),
    "signal": st.one_of(st.integers(min_value=-1, max_value=5), JSON),
    "joinNotice": st.one_of(st.integers(min_value=0, max_value=5), JSON),
    "restartRound": st.one_of(st.integers(min_value=0, max_value=5), JSON),
    "participants": _entries(MEMBER_KEYS),
    "waiting": _entries(["name", "address", "storePort", "since", "pod"]),
    "store": st.one_of(st.dictionaries(st.sampled_from(["host", "port"]), JSON), JSON),
    "lostMembers": _entries(["name", "round", "reason", "message", "time",
                             "detectionSeconds"]),
    "conditions": _entries(["type", "status", "reason", "message", "lastTransitionTime",
                            "observedGeneration"]),
    "sealedAt": JSON, "finishedAt": JSON, "waitingCount": JSON, "observedGeneration": JSON,
})


def _reads_or_names_a_field(status: Any) -> None:
    try:
        parsed = RunStatus.from_dict(status)
    except InvalidRunError as exc:
        assert exc.field.startswith("status"), exc.field
        assert exc.problem
        return
    # What was read is consistent enough to round-trip through the writer.
    again = RunStatus.from_dict(parsed.to_dict())
    assert again.round == parsed.round and again.participants == parsed.participants


@settings(max_examples=150, deadline=None)
@given(PLAUSIBLE)
def test_plausible_status_is_read_or_rejected_naming_the_field(status: dict[str, Any]) -> None:
    _reads_or_names_a_field(status)


@settings(max_examples=100, deadline=None)
@given(JSON)
def test_any_json_status_is_read_or_rejected(status: Any) -> None:
    _reads_or_names_a_field(status)


@settings(max_examples=150, deadline=None)
@given(st.fixed_dictionaries({}, optional={
    "metadata": st.one_of(st.fixed_dictionaries({"name": st.text(max_size=5)}, optional={
        "namespace": JSON, "resourceVersion": JSON, "generation": JSON, "uid": JSON,
        "annotations": JSON}), JSON),
    "spec": st.one_of(st.dictionaries(st.sampled_from(
        ["minNodes", "maxNodes", "joinTimeoutSeconds", "lastCallTimeoutSeconds",
         "heartbeatTimeoutSeconds", "leaseRenewIntervalSeconds", "closed",
         "ttlSecondsAfterFinished"]), JSON), JSON),
    "status": PLAUSIBLE,
}))
def test_parse_run_never_raises_anything_else(obj: dict[str, Any]) -> None:
    try:
        run = parse_run(obj)
    except InvalidRunError as exc:
        assert exc.field.split(".")[0].split("[")[0] in ("metadata", "spec", "status"), exc
        return
    assert run.spec.min_nodes <= run.spec.max_nodes


def test_a_well_formed_sealed_status_reads() -> None:
    stamp = dt.datetime(2026, 1, 1, tzinfo=dt.UTC).isoformat()
    status = RunStatus.from_dict({
        "phase": "Running", "round": 2, "signal": 3,
        "participants": [{"name": "a", "rank": 0, "address": "10.0.0.1", "storePort": 29400},
                         {"name": "b", "rank": 1}],
        "store": {"host": "10.0.0.1", "port": 29400}, "sealedAt": stamp})
    assert [p.name for p in status.participants] == ["a", "b"] and status.round == 2
