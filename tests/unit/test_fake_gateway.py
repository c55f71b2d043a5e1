"""The in-memory gateways keep the API server's contract the handler and the operator rely on.

The executor's unit tests are only as good as the fake under them: these pin
the resourceVersion fencing, the 404s, the announce patch's ``test`` semantics,
the watch events, the uid that fences the operator's deletions, its applies
and Events, and the fault injection (``tests/fakegateway.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
from fakegateway import LEASE, RUN, FakeApiServer, FakeGateway, FakeOperatorGateway

from elasticrun.api import crd
from elasticrun.api.kube import ApiConnectionError, ApiError
from elasticrun.api.model import RunSpec, RunStatus
from elasticrun.api.naming import label_value, lease_name
from elasticrun.api.slices import slice_path


def run_with(status: RunStatus | None = None) -> tuple[FakeApiServer, FakeGateway]:
    server = FakeApiServer()
    server.seed_run("r", RunSpec(min_nodes=1, max_nodes=2), status)
    return server, FakeGateway(server, "r")


def rv(obj: dict[str, Any] | None) -> int:
    assert obj is not None
    return int(obj["metadata"]["resourceVersion"])


def lease(node: str) -> dict[str, Any]:
    return {"metadata": {"name": lease_name("r", node),
                         "labels": {crd.RUN_LABEL: label_value("r")},
                         "annotations": {crd.NODE_ANNOTATION: node, crd.RUN_LABEL: "r"}},
            "spec": {"holderIdentity": node}}


def test_every_write_gets_a_higher_resource_version_across_objects() -> None:
    server, gateway = run_with()
    first = gateway.read()
    created = gateway.create_lease(lease("a"))
    patched = gateway.patch_lease("a", {"spec": {"holderIdentity": "b"}})
    closed = server.run("r")
    gateway.close()
    assert rv(first) < rv(created) < rv(patched) < rv(server.run("r"))
    assert rv(closed) == rv(first)  # a read changes nothing
    assert server.run("r")["spec"]["closed"] is True


def test_a_stale_status_write_is_the_conflict_the_real_gateway_answers_with_none() -> None:
    _, gateway = run_with()
    read = gateway.read()
    assert read is not None
    written = gateway.replace_status(read["metadata"]["resourceVersion"], {"round": 1}, "m")
    assert written is not None and written["status"] == {"round": 1}
    assert gateway.replace_status(read["metadata"]["resourceVersion"], {"round": 2}, "m") is None
    assert gateway.read()["status"] == {"round": 1}  # type: ignore[index]


def test_missing_objects_are_404s_answered_as_the_real_gateway_does() -> None:
    server = FakeApiServer()
    gateway = FakeGateway(server, "gone")
    assert gateway.read() is None
    assert gateway.lease("a") is None and gateway.listed_lease("a") is None
    assert gateway.patch_lease("a", {"spec": {}}) is None
    assert gateway.delete_lease("a") is False
    with pytest.raises(ApiError) as info:
        gateway.replace_status("1", {}, "m")
    assert info.value.not_found
    assert gateway.create(RunSpec()) is not None and gateway.create(RunSpec()) is None
    assert "status" not in server.run("gone")  # a create never writes the status


def test_the_announce_test_fails_on_a_moved_counter_and_on_a_missing_one() -> None:
    _, gateway = run_with(RunStatus(round=1, signal=3, join_notice=0))
    raw = gateway.read()
    assert raw is not None
    stale = RunStatus(round=1, signal=2, join_notice=0)
    assert gateway.announce(stale) is None
    announced = gateway.announce(RunStatus(round=1, signal=3, join_notice=0))
    assert announced is not None
    assert (announced["status"]["signal"], announced["status"]["joinNotice"]) == (4, 1)
    bare = FakeApiServer()
    bare.create((RUN, "r"), {"metadata": {"name": "r"}, "spec": {}})
    assert FakeGateway(bare, "r").announce(RunStatus()) is None  # no status: the test fails
    bare.update((RUN, "r"), lambda run: {**run, "status": {"signal": 0}})
    assert FakeGateway(bare, "r").announce(RunStatus()) is None  # no joinNotice: it fails too
    assert "joinNotice" not in bare.run("r")["status"]  # all or nothing


def test_the_narrow_watch_sends_added_when_the_signal_moves_and_nothing_before() -> None:
    server, gateway = run_with(RunStatus(signal=1))
    start = gateway.read()
    assert start is not None
    watch = gateway.watch_run(1, start["metadata"]["resourceVersion"], 5)
    gateway.create_lease(lease("a"))  # another object: not this watch's
    gateway.patch_lease("a", {"spec": {"holderIdentity": "x"}})
    same = gateway.replace_status(start["metadata"]["resourceVersion"],
                                  {"signal": 1, "round": 0}, "m")
    moved = gateway.replace_status(same["metadata"]["resourceVersion"],  # type: ignore[index]
                                   {"signal": 2, "round": 1}, "m")
    back = gateway.replace_status(moved["metadata"]["resourceVersion"],  # type: ignore[index]
                                  {"signal": 1, "round": 1}, "m")
    server.delete((RUN, "r"))
    events = iter(watch)
    seen = [next(events) for _ in range(2)]
    watch.close()
    assert [(e["type"], rv(e["object"])) for e in seen] == [("ADDED", rv(moved)),
                                                             ("DELETED", rv(back))]
    assert list(events) == []  # closed: the stream ends


def test_the_quiet_watch_sends_metadata_once_the_round_is_disturbed_from_now_on() -> None:
    _, gateway = run_with(RunStatus(round=2, signal=1).replace(
        participants=(), restart_round=1))
    stable = gateway.read()
    assert stable is not None and stable["status"]["stableRound"] == 2
    watch = gateway.watch_round(2, 5)  # undisturbed now: nothing first
    also = gateway.watch_round(3, 5)  # another round: what is there now comes first
    renewed = gateway.replace_status(stable["metadata"]["resourceVersion"],
                                     {**stable["status"], "waitingCount": 1}, "m")
    disturbed = gateway.replace_status(renewed["metadata"]["resourceVersion"],  # type: ignore[index]
                                       {**stable["status"], "stableRound": 0}, "m")
    events = iter(watch)
    first = next(events)
    watch.close()
    assert (first["type"], rv(first["object"])) == ("ADDED", rv(disturbed))
    assert first["object"] == {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                               "metadata": disturbed["metadata"]}  # type: ignore[index]
    assert next(iter(also))["object"]["metadata"]["resourceVersion"] == \
        stable["metadata"]["resourceVersion"]
    also.close()


def test_the_watch_for_the_end_sends_metadata_once_the_run_is_closed_or_finished() -> None:
    _, gateway = run_with(RunStatus(phase="Running", round=2, signal=1))
    running = gateway.read()
    assert running is not None
    watch = gateway.watch_end(5)  # running now: nothing first
    degraded = gateway.replace_status(str(rv(running)),
                                      {**running["status"], "phase": "Degraded"}, "m")
    closed = gateway.replace_status(str(rv(degraded)), {**running["status"], "phase": "Closed"},
                                    "m")
    first = next(iter(watch))
    watch.close()
    assert (first["type"], first["object"]) == ("ADDED", {
        "kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
        "metadata": closed["metadata"]})  # type: ignore[index]
    succeeded = gateway.replace_status(str(rv(closed)),
                                       {**running["status"], "phase": "Succeeded"}, "m")
    after = gateway.watch_end(5)  # finished already: what is there now comes first
    assert rv(next(iter(after))["object"]) == rv(succeeded)
    after.close()


def test_a_watch_replays_from_its_version_in_order_and_ends_on_time() -> None:
    server, gateway = run_with()
    operator = FakeOperatorGateway(server)
    path = slice_path("ns", "u-00")

    def write(round_number: int) -> None:
        operator.apply(path, {"metadata": {"name": "u-00"}, "spec": {"round": round_number}},
                       "m")

    write(1)
    after = server.get(server.key_of(path))
    write(2)
    server.delete(server.key_of(path))
    events = list(gateway.watch_slice("u-00", str(rv(after)), 0))
    assert [e["type"] for e in events] == ["MODIFIED", "DELETED"]
    assert events[0]["object"]["spec"] == {"round": 2}
    assert list(gateway.watch_slice("u-01", str(rv(after)), 0)) == []  # by name: another one
    write(3)
    assert [e["type"] for e in gateway.watch_slice("u-00", None, 0)] == ["ADDED"]  # as it is
    server.compact()
    assert [e["object"]["code"] for e in gateway.watch_slice("u-00", str(rv(after)), 0)] \
        == [410]


def test_injected_faults_hit_the_next_calls_of_a_method_then_stop() -> None:
    server, gateway = run_with()
    current = gateway.read()
    assert current is not None
    gateway.fail_next("read", 2)
    for _ in range(2):
        with pytest.raises(ApiConnectionError):
            gateway.read()
    assert gateway.read() is not None
    gateway.fail_next("replace_status", error="conflict")
    assert gateway.replace_status(current["metadata"]["resourceVersion"], {}, "m") is None
    gateway.fail_next("patch_lease", error="conflict")
    with pytest.raises(ApiError) as info:  # no protocol answer for a 409 there: raised
        gateway.patch_lease("a", {})
    assert info.value.conflict
    gateway.fail_next("*", 1)
    with pytest.raises(ApiConnectionError):
        gateway.leases()
    gateway.on_next("read", lambda: server.update((RUN, "r"), lambda run: run))
    assert rv(gateway.read()) > rv(current)  # the hook's write landed first
    assert gateway.calls["read"] == 5


def test_the_operators_deletions_reach_the_object_with_the_uid_named_or_nothing() -> None:
    server, _ = run_with()
    operator = FakeOperatorGateway(server)
    gateway = operator.run("ns", "r")
    assert gateway is operator.run("ns", "r")  # one per run: its faults are the run's
    first = gateway.create_lease(lease("a"))
    assert first is not None
    old_uid = first["metadata"]["uid"]
    # The Lease re-created under its name: a new uid, which the old one does not reach.
    gateway.delete_lease("a")
    gateway.create_lease(lease("a"))
    new = server.get((LEASE, "r.a"))
    assert new["metadata"]["uid"] != old_uid
    with pytest.raises(ApiError) as info:
        operator.delete(gateway.lease_path("r.a"), old_uid)
    assert info.value.conflict
    assert server.get((LEASE, "r.a")) == new  # not deleted
    operator.delete(gateway.lease_path("r.a"), new["metadata"]["uid"])
    assert server.lease_of("r", "a") is None
    with pytest.raises(ApiError) as info:
        operator.delete(gateway.lease_path("r.a"))
    assert info.value.not_found


def test_an_apply_creates_or_replaces_keeping_the_uid_and_events_get_generated_names() -> None:
    server, gateway = run_with()
    operator = FakeOperatorGateway(server)
    path = "/apis/rbac.authorization.k8s.io/v1/namespaces/ns/roles/r-elasticrun"
    operator.apply(path, {"kind": "Role", "metadata": {"name": "r-elasticrun"}, "rules": []},
                   "m")
    created = server.get(server.key_of(path))
    operator.apply(path, {"kind": "Role", "metadata": {"name": "r-elasticrun"}, "rules": [1]},
                   "m")
    replaced = server.get(server.key_of(path))
    assert replaced["metadata"]["uid"] == created["metadata"]["uid"]
    assert rv(replaced) > rv(created)
    assert replaced["rules"] == [1]
    assert replaced["metadata"]["managedFields"] == [{"manager": "m", "operation": "Apply"}]
    for reason in ("A", "B"):
        operator.post_event("ns", {"metadata": {"generateName": "r."}, "reason": reason})
    events = server.events()
    assert [e["reason"] for e in events] == ["A", "B"]
    assert events[0]["metadata"]["name"] != events[1]["metadata"]["name"]
    assert all(e["metadata"]["name"].startswith("r.") for e in events)
    # A run's path names the run; removing annotations is an unfenced merge.
    server.update((RUN, "r"), lambda run: {**run, "metadata": {
        **run["metadata"], "annotations": {"x": "1", "y": "2"}}})
    gateway.remove_annotations(["x"])
    assert server.run("r")["metadata"]["annotations"] == {"y": "2"}
    operator.delete(gateway.path)
    with pytest.raises(ApiError):
        server.run("r")
    operator.fail_next("apply")
    with pytest.raises(ApiConnectionError):
        operator.apply(path, {"metadata": {"name": "r-elasticrun"}}, "m")
    assert operator.calls["apply"] == 3 and operator.reached["apply"] == 2
