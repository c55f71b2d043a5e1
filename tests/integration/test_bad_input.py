"""Bad input against the real API server: each gets a clear error, and nothing is corrupted.

Hand-edited status (wrong types, well-typed nonsense, a round going back),
spec changes in the middle of a round, names at Kubernetes' limits, and two
agents that claim the same node name.
"""

from __future__ import annotations

import copy
import functools
import json
import subprocess
import time
from collections.abc import Callable
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousStateError,
)

from elasticrun.api import crd, rounds
from elasticrun.api.kube import ApiError, lease_path, run_path, runs_path
from elasticrun.api.model import InvalidRunError
from elasticrun.api.naming import lease_name
from elasticrun.operator.reconcile import SEAL_GRACE

from chaoskit import assert_all_ok, raw_run, record
from conftest import Cluster, OperatorProcess, consistently, wait_for
from rdzv import (
    Outcome,
    is_waiting,
    operator_round,
    read_run,
    rendezvous_all,
    spec_observed,
    start_rendezvous,
)
from timings import LAST_CALL, RECONCILES, outlasting

pytestmark = pytest.mark.slow


def _edit_status(cluster: Cluster, namespace: str, name: str,
                 edit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """What ``kubectl edit --subresource=status`` does: read, edit, write the whole object.

    Like kubectl, it starts again from a fresh read when someone wrote in between
    (409); returns the status as it was read for the edit that took.
    """
    for _ in range(20):
        raw = raw_run(cluster, namespace, name)
        before = copy.deepcopy(raw["status"])
        edit(raw["status"])
        try:
            cluster.client.request("PUT", run_path(namespace, name, "status"), body=raw)
        except ApiError as exc:
            if exc.conflict:
                continue
            raise
        return before
    raise AssertionError(f"could not edit {name}: 20 conflicts in a row")


def _repair_events(cluster: Cluster, namespace: str, run: str) -> list[str]:
    """Messages of the operator's InvalidStatus Events for ``run`` (the repair's record)."""
    got = cluster.client.request("GET", f"/api/v1/namespaces/{namespace}/events",
                                 query={"fieldSelector": "reason=InvalidStatus"})
    return [e["message"] for e in got.get("items") or []
            if e["involvedObject"].get("name") == run]


def _form(make_handler: Any, run: str, names: list[str], **kw: Any) -> dict[str, Any]:
    handlers = [make_handler(run, n, min_nodes=len(names), **kw) for n in names]
    outcomes = rendezvous_all(handlers)
    assert_all_ok(outcomes)
    return {h.settings.node_name: h for h in handlers}


# --------------------------------------------------------------------------- wrong types


@pytest.mark.parametrize(("patch", "field"), [
    ({"round": "three"}, "status.round"),
    ({"participants": [{"name": "a", "rank": "zero"}]}, "status.participants[0].rank"),
    ({"store": {"host": "10.0.0.1", "port": 70000}}, "status.store.port"),
    ({"phase": "Exploded"}, "status.phase"),
])
def test_wrongly_typed_status_is_rejected_by_the_schema_naming_the_field(
        patch: dict[str, Any], field: str, make_handler: Any, cluster: Cluster,
        namespace: str) -> None:
    _form(make_handler, "typed", ["a", "b"])
    before = raw_run(cluster, namespace, "typed")
    result = cluster.kubectl("patch", "er", "typed", "-n", namespace, "--subresource=status",
                             "--type=merge", "-p", json.dumps({"status": patch}), check=False)
    assert result.returncode != 0
    assert "Invalid value" in result.stderr and field in result.stderr, result.stderr
    after = raw_run(cluster, namespace, "typed")
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    assert after["status"] == before["status"]
    record(f"status with a wrong type ({field})", group="bad input",
           fault=f"kubectl patch --subresource=status {json.dumps(patch)}",
           expected="422 from the schema naming the field; nothing stored",
           observed="rejected: " + next(line.strip() for line in result.stderr.splitlines()
                                         if field in line)[:140],
           recovery_seconds=None)


# --------------------------------------------------------------------------- well-typed nonsense


def _duplicate_ranks(status: dict[str, Any]) -> None:
    for p in status["participants"]:
        p["rank"] = 0


def _missing_participant(status: dict[str, Any]) -> None:
    status["participants"] = [p for p in status["participants"] if p["rank"] != 1]


NONSENSE = {
    "duplicate ranks": (_duplicate_ranks, r"status\.participants: duplicate ranks \[0\]"),
    "participant missing from a sealed round": (
        _missing_participant, r"status\.participants: ranks of sealed round 1 must be 0\.\.1"),
}


@pytest.mark.parametrize("case", list(NONSENSE))
def test_well_typed_nonsense_raises_state_error_and_the_operator_repairs(
        case: str, operator: OperatorProcess, make_handler: Any, cluster: Cluster,
        namespace: str) -> None:
    edit, message = NONSENSE[case]
    nodes = _form(make_handler, "nonsense", ["a", "b", "c"])
    # The operator repairs within milliseconds; stopped, it lets the handler meet the edit.
    operator.stop()
    before = _edit_status(cluster, namespace, "nonsense", edit)  # accepted
    round_before = before["round"]
    edited_out = sorted({p["name"] for p in before["participants"]}
                        - {p["name"] for p in raw_run(cluster, namespace, "nonsense")["status"]
                           ["participants"]})
    assert edited_out or case == "duplicate ranks"
    late = make_handler("nonsense", "late", min_nodes=3)
    with pytest.raises(RendezvousStateError, match=message) as info:
        late.next_rendezvous()
    assert f"rendezvous {namespace}/nonsense, node 'late'" in str(info.value)
    assert "edited by hand" in str(info.value)
    operator.start()
    edited = time.monotonic()

    def repaired() -> Any:
        try:
            run = read_run(cluster.client, namespace, "nonsense")
        except InvalidRunError:
            return None  # not yet
        return run if _repair_events(cluster, namespace, "nonsense") else None

    run = wait_for(repaired, 15, "the operator to repair the status")
    took = time.monotonic() - edited
    assert run.status.round >= round_before
    (event,) = _repair_events(cluster, namespace, "nonsense")
    assert message.split(":")[0].replace("\\", "") in event, event
    # The members hear the repair (a re-formation) and form a consistent round again.
    wait_for(lambda: all(h.num_nodes_waiting() >= 1 for h in nodes.values()), 15,
             "members to be asked to re-form")
    again = rendezvous_all(list(nodes.values()))
    assert_all_ok(again)
    assert sorted(o.rank for o in again.values()) == [0, 1, 2]
    final = read_run(cluster.client, namespace, "nonsense")
    # The repair keeps the readable members and the requests they answered, and records
    # the requests it cannot place (the member the edit removed) as spent: no seal takes
    # one before its node asks again, so one round re-forms all three.
    assert final.status.round == round_before + 1
    assert [(m.name, m.reason) for m in final.status.lost_members] == [
        (name, rounds.STATUS_UNREADABLE) for name in edited_out]
    record(f"hand-edited status: {case}", group="bad input",
           fault=f"kubectl edit --subresource=status: {case} (well typed, schema accepts it)",
           expected="RendezvousStateError naming the field; the operator marks the run Degraded "
                    "(InvalidStatus) and re-forms it",
           observed=f"RendezvousStateError '{str(info.value).split(': ', 1)[1][:70]}...'; "
                    f"repaired {took:.1f}s after the operator (re)started; round "
                    f"{final.status.round} re-formed with ranks 0-2",
           recovery_seconds=round(took, 2))


def _round_two(make_handler: Any, cluster: Cluster, namespace: str, run: str) -> list[Any]:
    """a, b form round 1; c arrives late and round 2 holds all three."""
    a, b = (make_handler(run, n, min_nodes=2, max_nodes=3, last_call_timeout=LAST_CALL)
            for n in ("a", "b"))
    assert_all_ok(rendezvous_all([a, b]))
    c = make_handler(run, "c", min_nodes=2, max_nodes=3, last_call_timeout=LAST_CALL)
    thread, box = start_rendezvous(c)
    wait_for(lambda: a.num_nodes_waiting() > 0, 10, "members to hear of c")
    assert_all_ok(rendezvous_all([a, b]))
    thread.join(30)
    assert box["info"].world_size == 3
    return [a, b, c]


def _set_round_back(cluster: Cluster, namespace: str, run: str) -> None:
    """Round 2 -> 1, consistent on its own (as a restore of an old copy would be)."""

    def back(status: dict[str, Any]) -> None:
        assert status["round"] == 2
        status["round"] = 1
        for p in status["participants"]:
            p["joinedRound"] = 1
        status["signal"] += 1

    _edit_status(cluster, namespace, run, back)


def test_round_going_back_is_refused_by_the_members(make_handler: Any, cluster: Cluster,
                                                    namespace: str) -> None:
    a, _, _ = _round_two(make_handler, cluster, namespace, "backwards")
    _set_round_back(cluster, namespace, "backwards")
    wait_for(lambda: a.watcher.error is not None, 10, "a's watch to deliver the edit")
    with pytest.raises(RendezvousStateError,
                       match=r"status\.round: went back from 2 to 1") as info:
        a.next_rendezvous()
    assert f"rendezvous {namespace}/backwards, node 'a'" in str(info.value)
    record("hand-edited status: round going backwards (nodes)", group="bad input",
           fault="status.round set from 2 back to 1, consistent on its own (no operator)",
           expected="members that saw round 2 raise RendezvousStateError naming status.round",
           observed=f"RendezvousStateError '...{str(info.value).split(': ', 2)[2][:60]}...'",
           recovery_seconds=None)


def test_round_going_back_is_moved_forward_by_the_operator(
        operator: OperatorProcess, make_handler: Any, cluster: Cluster,
        namespace: str) -> None:
    nodes = _round_two(make_handler, cluster, namespace, "forward")
    edited = time.monotonic()
    _set_round_back(cluster, namespace, "forward")

    def repaired() -> Any:
        run = read_run(cluster.client, namespace, "forward")
        return run if run.status.round >= 2 and _repair_events(cluster, namespace,
                                                                "forward") else None

    run = wait_for(repaired, 15, "the operator to move the round forward again")
    took = time.monotonic() - edited
    (event,) = _repair_events(cluster, namespace, "forward")
    assert "went back from 2 to 1" in event, event
    round_repaired = run.status.round
    assert sorted(p.name for p in run.status.participants) == ["a", "b", "c"]
    # The members keep their places, and with them the requests round 2 answered, which
    # are still on their Leases: nothing is sealed from those (three of maxNodes 3 would
    # be sealed at once) before the members ask again.
    consistently(lambda: read_run(cluster.client, namespace, "forward").status.round
                 == round_repaired, outlasting(SEAL_GRACE + LAST_CALL),
                 "no round is sealed from the requests the repaired round answered")
    again = rendezvous_all(nodes)  # the positive control: asked again, they form a round
    assert_all_ok(again)
    assert sorted(o.rank for o in again.values()) == [0, 1, 2]
    # One round of all three, or, when one member comes back later than the 1 s last call
    # after the other two, a round of two and then one of all three.
    final = read_run(cluster.client, namespace, "forward").status.round
    assert round_repaired < final <= round_repaired + 2
    record("hand-edited status: round going backwards (operator)", group="bad input",
           fault="status.round set from 2 back to 1 while the operator runs",
           expected="the operator marks the run Degraded (InvalidStatus), moves the round "
                    "forward and has it re-formed",
           observed=f"repaired in {took:.1f}s (round {round_repaired}, restart); round "
                    f"{round_repaired + 1} formed with ranks 0-2",
           recovery_seconds=round(took, 2))


# --------------------------------------------------------------------------- spec changes


def test_max_nodes_lowered_below_the_members_takes_effect_next_round(
        operator: OperatorProcess, make_handler: Any, cluster: Cluster,
        namespace: str) -> None:
    nodes = [make_handler("shrink", f"n{i}", min_nodes=1, max_nodes=3) for i in range(3)]
    first = rendezvous_all(nodes)
    assert_all_ok(first)
    refused = cluster.kubectl("patch", "er", "shrink", "-n", namespace, "--type=merge", "-p",
                              '{"spec":{"minNodes":3,"maxNodes":2}}', check=False)
    assert refused.returncode != 0
    assert "maxNodes must be greater than or equal to minNodes" in refused.stderr
    cluster.kubectl("patch", "er", "shrink", "-n", namespace, "--type=merge", "-p",
                    '{"spec":{"maxNodes":2}}')
    # The running round is not torn down by a spec change: the operator has seen it, and
    # a few reconciles later nobody was asked to re-join ...
    wait_for(lambda: spec_observed(cluster.client, namespace, "shrink"), 10,
             "the operator to see maxNodes 2")
    consistently(lambda: all(h.num_nodes_waiting() == 0 for h in nodes)
                 and read_run(cluster.client, namespace, "shrink").status.round == 1,
                 RECONCILES, "the spec change restarted the running round")
    # ... the next round takes two: the old ranks 0 and 1, and the third waits as a spare.
    changed = time.monotonic()
    cluster.kubectl("annotate", "er", "shrink", "-n", namespace, f"{crd.RESTART_ANNOTATION}=now")
    keep = [h for h in nodes if first[h.settings.node_name].rank < 2]
    spare = next(h for h in nodes if first[h.settings.node_name].rank == 2)
    thread, box = start_rendezvous(spare)
    second = rendezvous_all(keep)
    assert_all_ok(second)
    took = time.monotonic() - changed
    for h in keep:
        assert second[h.settings.node_name].rank == first[h.settings.node_name].rank
        assert second[h.settings.node_name].world_size == 2
    wait_for(lambda: is_waiting(cluster.client, namespace, "shrink", spare.settings.node_name),
             10, "the third node to wait as a spare")
    assert "info" not in box and "error" not in box
    run = read_run(cluster.client, namespace, "shrink")
    assert len(run.status.participants) == 2 and run.status.round == 2
    spare.set_closed()  # let the spare go
    thread.join(20)
    assert isinstance(box.get("error"), RendezvousClosedError), box
    record("spec.maxNodes lowered below the members", group="bad input",
           fault="maxNodes 3 -> 2 while 3 members run (and maxNodes < minNodes, refused)",
           expected="the CEL rule refuses max < min with a message; the running round is kept; "
                    "the next round takes 2 (ranks kept), the third waits as a spare",
           observed=f"refused with the CEL message; next round of 2 formed {took:.1f}s after "
                    "the restart request, ranks 0 and 1 kept; third node waiting",
           recovery_seconds=round(took, 2))


def test_closed_then_reopened(operator: OperatorProcess, make_handler: Any, cluster: Cluster,
                              namespace: str) -> None:
    first = _form(make_handler, "reopen", ["a", "b"])
    cluster.kubectl("patch", "er", "reopen", "-n", namespace, "--type=merge", "-p",
                    '{"spec":{"closed":true}}')
    wait_for(lambda: read_run(cluster.client, namespace, "reopen").status.phase == "Closed",
             10, "the run to close")
    with pytest.raises(RendezvousClosedError, match="run is closed"):
        make_handler("reopen", "late", min_nodes=2).next_rendezvous()
    reopened = time.monotonic()
    cluster.kubectl("patch", "er", "reopen", "-n", namespace, "--type=merge", "-p",
                    '{"spec":{"closed":false}}')
    wait_for(lambda: read_run(cluster.client, namespace, "reopen").status.phase != "Closed",
             10, "the operator to reopen the run")
    wait_for(lambda: all(h.num_nodes_waiting() >= 1 for h in first.values()), 10,
             "members to be asked to re-form")
    again = rendezvous_all(list(first.values()))
    assert_all_ok(again)
    took = time.monotonic() - reopened
    assert sorted(o.rank for o in again.values()) == [0, 1]
    run = read_run(cluster.client, namespace, "reopen")
    assert run.status.round == 2 and not run.closed
    record("run closed, then reopened", group="bad input",
           fault="spec.closed true, a late node, then spec.closed false",
           expected="the late node gets RendezvousClosedError; after reopening, members form a "
                    "new round",
           observed=f"RendezvousClosedError; round 2 formed {took:.1f}s after reopening",
           recovery_seconds=round(took, 2))


# --------------------------------------------------------------------------- names


def test_names_at_kubernetes_limits(operator: OperatorProcess, make_handler: Any,
                                    cluster: Cluster, namespace: str) -> None:
    run_name = ".".join(["a-1" + "b" * 59 + "9", "c" * 63, "0-" + "d" * 61, "e" * 58 + "-z1"])
    assert len(run_name) == 253
    nodes = ["n." + "x" * 120 + "-" + "y" * 128 + ".9", "0-" + "q.r-" * 62 + "zz1"]
    assert all(len(n) <= 253 for n in nodes) and len(nodes[0]) == 253
    cluster.client.request("POST", runs_path(namespace), body={
        "apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": run_name},
        "spec": {"minNodes": 2, "heartbeatTimeoutSeconds": 2, "leaseRenewIntervalSeconds": 1}})
    handlers = [make_handler(run_name, n, min_nodes=2) for n in nodes]
    outcomes = rendezvous_all(handlers)
    assert_all_ok(outcomes)
    assert sorted(o.rank for o in outcomes.values()) == [0, 1]
    run = read_run(cluster.client, namespace, run_name)
    assert run.status.member_names == set(nodes)
    for node in nodes:
        lease = cluster.client.request("GET", lease_path(namespace, lease_name(run_name, node)))
        assert lease["metadata"]["annotations"][crd.NODE_ANNOTATION] == node
        assert len(lease["metadata"]["name"]) <= 253
        assert len(lease["metadata"]["labels"][crd.RUN_LABEL]) <= 63
    # The operator maps the hashed Leases back to the members: a silent one is removed.
    handlers[1].lease.stop_renewing()
    wait_for(lambda: handlers[0].num_nodes_waiting() >= 1, 15,
             "the operator to notice the silent member of the long-named run")
    lost = read_run(cluster.client, namespace, run_name).status.lost_members[-1]
    assert (lost.name, lost.reason) == (nodes[1], "LeaseExpired")
    record("names at Kubernetes' limits", group="bad input",
           fault="run name of 253 characters (a DNS subdomain with dots and dashes); node "
                 "names of up to 253 characters with dots and dashes",
           expected="a round forms; Lease names and labels are hashed down to valid values; "
                    "the operator still maps Leases to members",
           observed="round of 2 formed; Lease names <= 253, labels <= 63; a silent member was "
                    "removed as LeaseExpired",
           recovery_seconds=None)


def test_two_agents_with_the_same_node_name(make_handler: Any, cluster: Cluster,
                                            namespace: str) -> None:
    first = make_handler("twins", "same", min_nodes=2)
    thread, box = start_rendezvous(first)
    wait_for(lambda: is_waiting(cluster.client, namespace, "twins", "same"), 10,
             "the first agent waiting")
    second = make_handler("twins", "same", min_nodes=2)
    with pytest.raises(RendezvousError, match="already used by a live agent") as info:
        second.next_rendezvous()
    assert "give every agent its own name" in str(info.value)
    # The first agent is unaffected: with a differently named peer it forms the round.
    peer = make_handler("twins", "other", min_nodes=2)
    joined = rendezvous_all([peer])
    assert_all_ok(joined)
    thread.join(30)
    assert box.get("info") is not None, box
    assert {box["info"].rank, joined["other"].rank} == {0, 1}
    assert read_run(cluster.client, namespace, "twins").status.member_names == {"same", "other"}
    record("two agents with the same node name", group="bad input",
           fault="a second agent starts with a node name a live agent holds",
           expected="the second gets a clear RendezvousError; the first is unaffected",
           observed=f"RendezvousError: '...{str(info.value).split(': ', 1)[1][:80]}...'; the "
                    "first agent formed its round",
           recovery_seconds=None)


# --------------------------------------------------------------------------- poisoned counters


def _patch_status(cluster: Cluster, namespace: str, run: str,
                  status: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """What an admin (or a poisoner) does: kubectl patch of the status, unfenced."""
    return cluster.kubectl("patch", "er", run, "-n", namespace, "--subresource=status",
                           "--type=merge", "-p", json.dumps({"status": status}), check=False)


def _one_after_the_other(cluster: Cluster, namespace: str, run: str,
                         handlers: list[Any]) -> dict[str, Outcome]:
    """``next_rendezvous()`` on each handler once the previous one waits; all outcomes.

    Members of a round an admin reset (its roster kept) come back this way, its
    rank 0 first: the reset round answers an earlier request of each, so each
    waits with its new one for the next round, which is sealed once all of them
    are back (with a last call longer than their return).
    """
    started = {}
    for handler in handlers:
        name = handler.settings.node_name
        started[name] = start_rendezvous(handler)
        if handler is not handlers[-1]:
            wait_for(functools.partial(is_waiting, cluster.client, namespace, run, name), 10,
                     f"{name} to wait")
    outcomes = {}
    for name, (thread, box) in started.items():
        thread.join(40)
        assert "info" in box, (name, box)
        outcomes[name] = Outcome(name, box["info"].rank, box["info"].world_size, box["info"])
    assert_all_ok(outcomes)
    return outcomes


def test_a_poisoned_round_is_bounded_and_an_admins_reset_is_kept(
        operator: OperatorProcess, make_handler: Any, cluster: Cluster,
        namespace: str) -> None:
    """Issue 20, case 4: ``round: 2**63-1`` used to kill the run for good.

    The schema now refuses it.  The largest round a run can hold (the schema's
    maximum less one) is an absurd mark nobody defends: members and the
    operator that saw it take an admin's ``round: 5`` as the reset it is, and a
    round forms after it.  A round at the maximum itself (no round can follow)
    is repaired by the operator back to the round it still defends.
    """
    top = crd.counter_maximum()
    a, b = (make_handler("poisoned", n, min_nodes=2, max_nodes=3, last_call_timeout=10)
            for n in ("a", "b"))
    assert_all_ok(rendezvous_all([a, b]))
    refused = _patch_status(cluster, namespace, "poisoned", {"round": 2**63 - 1})
    assert refused.returncode != 0
    assert f"status.round: Invalid value: {2**63 - 1}: round in body should be less than or " \
           f"equal to {top}" in refused.stderr, \
        refused.stderr
    assert read_run(cluster.client, namespace, "poisoned").status.round == 1

    signal = read_run(cluster.client, namespace, "poisoned").status.signal
    poisoned = _patch_status(cluster, namespace, "poisoned",
                             {"round": top - 1, "signal": signal + 1})
    assert poisoned.returncode == 0, poisoned.stderr
    wait_for(lambda: all(h.watcher.latest.status.round == top - 1 for h in (a, b)), 10,
             "the members to see the poisoned round")
    # The operator sees it too (its round mark holds it from its next reconcile on): the
    # reset below is then one the operator must take, not a round it never saw go up.
    wait_for(lambda: operator_round(operator, "poisoned") == top - 1, 10,
             "the operator to see the poisoned round")
    reset = _patch_status(cluster, namespace, "poisoned", {"round": 5, "signal": signal + 2})
    assert reset.returncode == 0, reset.stderr
    wait_for(lambda: all(h.watcher.latest.status.round == 5 for h in (a, b)), 10,
             "the members to take the reset")
    wait_for(lambda: operator_round(operator, "poisoned") == 5, 10,
             "the operator to see the reset")
    # A "repair" back to the poisoned round would show within a few reconciles; the
    # control is below: a round at the maximum is repaired, by the same operator.
    consistently(lambda: read_run(cluster.client, namespace, "poisoned").status.round == 5
                 and _repair_events(cluster, namespace, "poisoned") == [],
                 RECONCILES, "the operator undid the admin's reset")
    assert all(h.watcher.error is None for h in (a, b))
    c = make_handler("poisoned", "c", min_nodes=2, max_nodes=3, last_call_timeout=10)
    fresh = [a, b, c]
    again = _one_after_the_other(cluster, namespace, "poisoned", [c, a, b])
    assert sorted(o.rank for o in again.values()) == [0, 1, 2]
    assert {o.world_size for o in again.values()} == {3}
    formed = read_run(cluster.client, namespace, "poisoned").status.round
    assert 5 < formed < 10 and all(h.round == formed for h in fresh)

    # A round at the maximum: no round can follow it, so the operator repairs it to
    # the round it defends (the one just formed) and the members re-form after it.
    signal = read_run(cluster.client, namespace, "poisoned").status.signal
    assert _patch_status(cluster, namespace, "poisoned",
                         {"round": top, "signal": signal + 1}).returncode == 0

    def repaired() -> Any:
        try:
            run = read_run(cluster.client, namespace, "poisoned")
        except InvalidRunError:
            return None
        return run if _repair_events(cluster, namespace, "poisoned") else None

    run = wait_for(repaired, 15, "the operator to repair the round at the maximum")
    assert run.status.round == formed and run.status.degraded
    (event,) = _repair_events(cluster, namespace, "poisoned")
    assert "no round can follow it" in event, event
    wait_for(lambda: all(h.num_nodes_waiting() >= 1 for h in fresh), 15,
             "members to be asked to re-form")
    last = rendezvous_all(fresh)
    assert_all_ok(last)
    assert sorted(o.rank for o in last.values()) == [0, 1, 2]
    final = read_run(cluster.client, namespace, "poisoned").status.round
    assert formed < final < formed + 4 and all(h.round == final for h in fresh)
    record("poisoned counter (status.round)", group="bad input",
           fault=f"status.round 2**63-1, then {top - 1} (members and operator saw it), then "
                 f"an admin's round 5; later {top}",
           expected="2**63-1 refused by the schema; the admin's reset kept; a round at the "
                    "maximum repaired; rounds form after each",
           observed=f"schema: '...less than or equal to {top}'; reset to 5 kept, round 6 "
                    f"round {formed} formed with ranks 0-2 by the two members that saw the "
                    f"poison and a fresh node; round {top} repaired "
                    f"to {formed}, round {final} formed",
           recovery_seconds=None)
