"""The ElasticRun and ElasticRunSlice CRDs, as the real API server enforces them."""

from __future__ import annotations

import datetime as dt
import json
import threading
from typing import Any

import pytest

from elasticrun.api import crd, slices
from elasticrun.api.kube import APPLY_PATCH, ApiError, run_path, runs_path
from elasticrun.api.model import Assignment, RunSpec, StoreAddress, parse_run

from conftest import Cluster


def er(name: str, namespace: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND,
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}


def create(cluster: Cluster, namespace: str, name: str, **spec: Any) -> dict[str, Any]:
    return cluster.client.request("POST", runs_path(namespace), body=er(name, namespace, **spec))


def rejection(cluster: Cluster, namespace: str, **spec: Any) -> str:
    with pytest.raises(ApiError) as info:
        create(cluster, namespace, "bad", **spec)
    assert info.value.status == 422, info.value
    return info.value.message


def test_crd_is_established_and_served(cluster: Cluster, crds: None) -> None:
    got = cluster.client.request(
        "GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd.CRD_NAME}")
    assert got["spec"]["names"]["shortNames"] == ["er"]
    assert {"Established", "NamesAccepted"} <= {
        c["type"] for c in got["status"]["conditions"] if c["status"] == "True"}


def test_valid_run_gets_schema_defaults(cluster: Cluster, namespace: str) -> None:
    created = create(cluster, namespace, "defaults", minNodes=2, maxNodes=4)
    spec = created["spec"]
    assert spec == {"minNodes": 2, "maxNodes": 4, "joinTimeoutSeconds": 600,
                    "lastCallTimeoutSeconds": 30, "heartbeatTimeoutSeconds": 15,
                    "leaseRenewIntervalSeconds": 5, "closed": False}
    # The Python model reads the same defaults from the same YAML.
    assert parse_run(created).spec == RunSpec(min_nodes=2, max_nodes=4)


def test_kubectl_get_er_shows_printer_columns(cluster: Cluster, namespace: str) -> None:
    create(cluster, namespace, "cols", minNodes=2, maxNodes=3)
    out = cluster.kubectl("get", "er", "-n", namespace).stdout
    header = out.splitlines()[0].split()
    assert header == ["NAME", "PHASE", "ROUND", "MEMBERS", "WAITING", "DESIRED", "MIN", "MAX",
                      "AGE"]
    row = out.splitlines()[1].split()
    assert row[0] == "cols" and row[-3:-1] == ["2", "3"]


@pytest.mark.parametrize(("spec", "expected"), [
    ({"minNodes": 3, "maxNodes": 2}, "maxNodes must be greater than or equal to minNodes"),
    ({"minNodes": 0}, "spec.minNodes in body should be greater than or equal to 1"),
    ({"minNodes": 1, "joinTimeoutSeconds": -5},
     "spec.joinTimeoutSeconds in body should be greater than or equal to 1"),
    ({"minNodes": 1, "lastCallTimeoutSeconds": -1},
     "spec.lastCallTimeoutSeconds in body should be greater than or equal to 0"),
    ({"minNodes": "two"}, 'spec.minNodes in body must be of type integer: "string"'),
    ({"minNodes": 1, "maxNodes": 5000},
     "spec.maxNodes in body should be less than or equal to 2048"),
    ({"minNodes": 1, "closed": "yes"}, 'spec.closed in body must be of type boolean: "string"'),
    ({"minNodes": 1, "heartbeatTimeoutSeconds": 5, "leaseRenewIntervalSeconds": 5},
     "leaseRenewIntervalSeconds must be smaller than heartbeatTimeoutSeconds"),
])
def test_invalid_runs_are_rejected_with_a_clear_message(
        cluster: Cluster, namespace: str, spec: dict[str, Any], expected: str) -> None:
    assert expected in rejection(cluster, namespace, **spec)


def test_cel_message_names_the_field(cluster: Cluster, namespace: str) -> None:
    message = rejection(cluster, namespace, minNodes=3, maxNodes=2)
    assert "spec.maxNodes" in message


def test_unknown_fields_are_pruned(cluster: Cluster, namespace: str) -> None:
    body = er("pruned", namespace, minNodes=1, shinyNewField=True)
    created = cluster.client.request("POST", runs_path(namespace), body=body)
    assert "shinyNewField" not in created["spec"]
    stored = cluster.client.request("GET", run_path(namespace, "pruned"))
    assert "shinyNewField" not in stored["spec"]


def test_status_is_written_only_through_the_subresource(cluster: Cluster,
                                                        namespace: str) -> None:
    created = create(cluster, namespace, "sub", minNodes=1)
    created["status"] = {"round": 7, "signal": 3}
    cluster.client.request("PUT", run_path(namespace, "sub"), body=created)
    assert "status" not in cluster.client.request("GET", run_path(namespace, "sub"))
    fresh = cluster.client.request("GET", run_path(namespace, "sub"))
    fresh["status"] = {"round": 7, "signal": 3}
    written = cluster.client.request("PUT", run_path(namespace, "sub", "status"), body=fresh)
    assert written["status"]["round"] == 7
    # and a status write cannot change the spec
    written["spec"]["minNodes"] = 9
    again = cluster.client.request("PUT", run_path(namespace, "sub", "status"), body=written)
    assert again["spec"]["minNodes"] == 1


def test_concurrent_server_side_applies_to_waiting_both_survive(cluster: Cluster,
                                                                namespace: str) -> None:
    create(cluster, namespace, "ssa", minNodes=1, maxNodes=64)
    errors: list[Exception] = []

    def join(node: str) -> None:
        body = {"apiVersion": crd.API_VERSION, "kind": crd.KIND,
                "metadata": {"name": "ssa", "namespace": namespace},
                "status": {"waiting": [{"name": node, "address": "127.0.0.1"}]}}
        try:
            cluster.client.request("PATCH", run_path(namespace, "ssa", "status"), body=body,
                                   query={"fieldManager": f"node-{node}", "force": "true"},
                                   content_type=APPLY_PATCH)
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(f"n{i}",)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    got = cluster.client.request("GET", run_path(namespace, "ssa"))
    assert sorted(w["name"] for w in got["status"]["waiting"]) == sorted(
        f"n{i}" for i in range(16))
    managers = {m["manager"] for m in got["metadata"]["managedFields"]}
    assert {f"node-n{i}" for i in range(16)} <= managers


def test_a_sealed_roster_is_one_managed_field_however_many_members(cluster: Cluster,
                                                                   namespace: str) -> None:
    """Every node receives the status with each seal; per-member managedFields would double it."""
    fresh = create(cluster, namespace, "roster", minNodes=64, maxNodes=64)
    fresh["status"] = {"round": 1, "signal": 1, "phase": "Running",
                       "store": {"host": "10.0.0.1", "port": 29400},
                       "participants": [{"name": f"n{i:02d}", "rank": i, "joinedRound": 1}
                                        for i in range(64)]}
    written = cluster.client.request("PUT", run_path(namespace, "roster", "status"), body=fresh,
                                     query={"fieldManager": "elasticrun-seal"})
    assert [p["rank"] for p in written["status"]["participants"]] == list(range(64))
    seal = next(m for m in written["metadata"]["managedFields"]
                if m["manager"] == "elasticrun-seal")
    assert seal["fieldsV1"]["f:status"]["f:participants"] == {}
    assert parse_run(written).status.store is not None


def test_stale_resource_version_gets_409(cluster: Cluster, namespace: str) -> None:
    created = create(cluster, namespace, "cas", minNodes=1)
    first = json.loads(json.dumps(created))
    first["status"] = {"round": 1}
    cluster.client.request("PUT", run_path(namespace, "cas", "status"), body=first)
    stale = json.loads(json.dumps(created))
    stale["status"] = {"round": 2}
    with pytest.raises(ApiError) as info:
        cluster.client.request("PUT", run_path(namespace, "cas", "status"), body=stale)
    assert info.value.status == 409
    assert cluster.client.request("GET", run_path(namespace, "cas"))["status"]["round"] == 1


def test_status_schema_rejects_wrong_types(cluster: Cluster, namespace: str) -> None:
    created = create(cluster, namespace, "types", minNodes=1)
    created["status"] = {"round": "seven", "participants": [{"name": "a", "rank": -1}]}
    with pytest.raises(ApiError) as info:
        cluster.client.request("PUT", run_path(namespace, "types", "status"), body=created)
    assert info.value.status == 422
    assert "status.round" in info.value.message
    assert "status.participants[0].rank" in info.value.message


def test_signal_field_selector_filters_watch_and_list(cluster: Cluster, namespace: str) -> None:
    created = create(cluster, namespace, "sel", minNodes=1)
    created["status"] = {"signal": 4}
    cluster.client.request("PUT", run_path(namespace, "sel", "status"), body=created)
    same = cluster.client.request("GET", runs_path(namespace),
                                  query={"fieldSelector": "status.signal!=4"})
    other = cluster.client.request("GET", runs_path(namespace),
                                   query={"fieldSelector": "status.signal!=3"})
    assert [i["metadata"]["name"] for i in same["items"]] == []
    assert [i["metadata"]["name"] for i in other["items"]] == ["sel"]


def test_model_round_trips_what_the_server_accepts(cluster: Cluster, namespace: str) -> None:
    created = create(cluster, namespace, "rt", minNodes=2, maxNodes=3)
    status = {
        "phase": "Running", "round": 3, "signal": 5, "joinNotice": 2, "restartRound": 2,
        "memberCount": 2, "waitingCount": 1,
        "participants": [
            {"name": "a", "rank": 0, "address": "10.0.0.1", "storePort": 2000, "joinedRound": 1,
             "pod": "a"},
            {"name": "b", "rank": 1, "address": "10.0.0.2", "storePort": 2001,
             "joinedRound": 3}],
        "waiting": [{"name": "c", "address": "10.0.0.3", "storePort": 2002,
                     "since": "2026-01-02T03:04:05.000006Z"}],
        "store": {"host": "10.0.0.1", "port": 2000},
        "lostMembers": [{"name": "d", "round": 2, "reason": "PodDeleted", "message": "gone",
                         "time": "2026-01-02T03:04:05.000000Z", "detectionSeconds": 0.25}],
        "conditions": [{"type": "RoundComplete", "status": "True", "reason": "Sealed",
                        "message": "round 3", "observedGeneration": 1,
                        "lastTransitionTime": "2026-01-02T03:04:05.000000Z"}],
        "sealedAt": "2026-01-02T03:04:05.000000Z",
        "observedGeneration": 1,
        # Derived (RunStatus.stable_round): round 3, neither re-forming nor announced to.
        "stableRound": 3,
    }
    created["status"] = status
    stored = cluster.client.request("PUT", run_path(namespace, "rt", "status"), body=created)
    parsed = parse_run(stored)
    assert parsed.status.to_dict() == stored["status"]
    assert parsed.status.participant("b") is not None
    assert parsed.status.participant("b").rank == 1  # type: ignore[union-attr]


# --------------------------------------------------------------------------- slices


def test_slice_crd_is_established_and_served(cluster: Cluster, namespace: str) -> None:
    got = cluster.client.request(
        "GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd.SLICE_CRD_NAME}")
    assert got["spec"]["scope"] == "Namespaced"
    assert got["spec"]["names"]["kind"] == crd.SLICE_KIND
    assert {"Established", "NamesAccepted"} <= {
        c["type"] for c in got["status"]["conditions"] if c["status"] == "True"}
    assert cluster.client.request("GET", slices.slices_path(namespace))["items"] == []


def _place(rank: int) -> Assignment:
    """A member's place in round 3, answering its join request of ``SINCE``."""
    return Assignment(round=3, rank=rank, world_size=2, store=StoreAddress("10.0.0.1", 29400),
                      leader="a", since=SINCE)


SINCE = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)


def test_an_operator_slice_is_stored_as_written_and_read_by_name(
        cluster: Cluster, namespace: str) -> None:
    run = create(cluster, namespace, "sliced", minNodes=2, maxNodes=2)
    uid = run["metadata"]["uid"]
    by_slice = slices.due({"a": _place(0), "b": _place(1)}, frozenset())
    for piece in by_slice:
        cluster.client.request(
            "PATCH", slices.slice_path(namespace, slices.slice_name(uid, piece.index)),
            body=piece.manifest("sliced", namespace, uid),
            query={"fieldManager": "elasticrun-operator", "force": "true"},
            content_type=APPLY_PATCH)
    name = slices.slice_name(uid, slices.slice_index("b"))
    stored = cluster.client.request("GET", slices.slice_path(namespace, name))
    assert stored["spec"]["run"] == "sliced" and stored["spec"]["round"] == 3
    assert stored["metadata"]["ownerReferences"][0]["uid"] == uid
    assert slices.read_place(stored, "sliced", "b") == _place(1)
    # The spec is one field to server-side apply: every member's event carries the
    # slice's managedFields, which name no place.
    [managed] = stored["metadata"]["managedFields"]
    assert managed["manager"] == "elasticrun-operator" and managed["fieldsV1"]["f:spec"] == {}
    # What a member watches: its own slice by name, nothing else of the run's.
    listed = cluster.client.request("GET", slices.slices_path(namespace),
                                    query={"fieldSelector": f"metadata.name={name}"})
    assert [i["metadata"]["name"] for i in listed["items"]] == [name]
    labelled = cluster.client.request("GET", slices.slices_path(namespace),
                                      query={"labelSelector": f"{crd.RUN_LABEL}=sliced"})
    assert len(labelled["items"]) == len(by_slice)
    out = cluster.kubectl("get", crd.SLICE_PLURAL, name, "-n", namespace).stdout
    assert out.splitlines()[0].split() == ["NAME", "RUN", "ROUND", "WORLD", "LEADER", "AGE"]
    assert out.splitlines()[1].split()[:5] == [name, "sliced", "3", "2", "a"]


@pytest.mark.parametrize(("spec", "expected"), [
    ({"run": "r", "round": 0, "worldSize": 1, "places": {}},
     "spec.round in body should be greater than or equal to 1"),
    ({"run": "r", "round": 1, "worldSize": 1}, "spec.places: Required value"),
    ({"run": "r", "round": 1, "places": {}}, "spec.worldSize: Required value"),
    ({"run": "r", "round": 1, "worldSize": 1, "places": {"a": {"rank": -1}}},
     "spec.places.a.rank in body should be greater than or equal to 0"),
    ({"run": "r", "round": 1, "worldSize": 1, "places": {"a": {"since": "2026-01-01T00:00:00Z"}}},
     "spec.places.a.rank: Required value"),
    ({"run": "r", "round": 1, "worldSize": 1, "places": {"a": {"rank": 0, "since": "soon"}}},
     "spec.places.a.since in body must be of type date-time"),
    ({"run": "r", "round": 1, "worldSize": 1, "places": {"a": "x"}},
     'spec.places.a in body must be of type object: "string"'),
    ({"run": "r", "round": 1, "worldSize": 1, "places": {}, "store": {"host": "h", "port": 0}},
     "spec.store.port in body should be greater than or equal to 1"),
])
def test_invalid_slices_are_rejected(cluster: Cluster, namespace: str, spec: dict[str, Any],
                                     expected: str) -> None:
    body = {"apiVersion": crd.API_VERSION, "kind": crd.SLICE_KIND,
            "metadata": {"name": "bad", "namespace": namespace}, "spec": spec}
    with pytest.raises(ApiError) as info:
        cluster.client.request("POST", slices.slices_path(namespace), body=body)
    assert info.value.status == 422, info.value
    assert expected in info.value.message
