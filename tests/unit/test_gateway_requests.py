"""The requests the gateways send: method, path, body, query, content type.

The node's Lease, its run watch and its Lease watch (``RunGateway``), and the
operator executor's applies, deletions and Events (``OperatorGateway``), went
straight to the client before they went through a gateway; these pin the
requests as they were (literal paths, not the helpers that build them), and
the protocol outcomes each method answers itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import pytest

from elasticrun.api.gateway import OperatorGateway, RunGateway, readable_lease
from elasticrun.api.kube import APPLY_PATCH, JSON, MERGE_PATCH, ApiError

LEASES = "/apis/coordination.k8s.io/v1/namespaces/ns/leases"
RUNS = "/apis/elasticrun.dev/v1alpha1/namespaces/ns/elasticruns"


class RecordingClient:
    """A client that records each request and answers ``{}`` or the error it is given."""

    def __init__(self, error: ApiError | None = None) -> None:
        self.credentials = SimpleNamespace(host="https://api")
        self.sent: list[tuple[Any, ...]] = []
        self.error = error

    def request(self, method: str, path: str, *, body: Any = None,
                query: Mapping[str, Any] | None = None, content_type: str = JSON,
                timeout: float | None = None) -> dict[str, Any]:
        self.sent.append((method, path, body, query, content_type, timeout))
        if self.error is not None:
            raise self.error
        return {}

    def watch(self, path: str, query: Mapping[str, Any], timeout_seconds: int,
              accept: str = JSON) -> str:
        self.sent.append(("WATCH", path, dict(query), timeout_seconds)
                         + ((accept,) if accept != JSON else ()))
        return "stream"


def gateway(error: ApiError | None = None) -> tuple[RunGateway, RecordingClient]:
    client = RecordingClient(error)
    return RunGateway(client, "ns", "r"), client  # type: ignore[arg-type]


def test_a_nodes_own_lease_requests() -> None:
    access, client = gateway()
    manifest = {"metadata": {"name": "r.a"}}
    access.create_lease(manifest)
    access.replace_lease("a", manifest)
    access.patch_lease("a", {"metadata": {"annotations": {"x": None}}}, 2.0)
    access.patch_lease("a", {"spec": {"renewTime": "t"}})
    access.delete_lease("a", 3.0)
    assert client.sent == [
        ("POST", LEASES, manifest, None, JSON, None),
        ("PUT", f"{LEASES}/r.a", manifest, None, JSON, None),
        ("PATCH", f"{LEASES}/r.a", {"metadata": {"annotations": {"x": None}}}, None,
         MERGE_PATCH, 2.0),
        ("PATCH", f"{LEASES}/r.a", {"spec": {"renewTime": "t"}}, None, MERGE_PATCH, None),
        ("DELETE", f"{LEASES}/r.a", None, None, JSON, 3.0),
    ]



class ObjectGetRefused(RecordingClient):
    """A client whose GETs of one Lease by name are refused (403), as a per-run Role that
    does not name that Lease yet refuses them; its LISTs answer one item."""

    def request(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        super().request(method, path, **kwargs)
        if path.startswith(f"{LEASES}/"):
            raise ApiError(403, "Forbidden", "leases \"r.a\" is forbidden", {})
        return {"items": [{"metadata": {"name": "r.a"}}]}


def test_a_lease_is_read_by_a_get_and_listed_by_name_where_the_get_is_refused() -> None:
    access, client = gateway()
    assert readable_lease(access, "a") == {}
    assert client.sent == [("GET", f"{LEASES}/r.a", None, None, JSON, None)]
    refused = ObjectGetRefused()
    access = RunGateway(refused, "ns", "r")  # type: ignore[arg-type]
    assert readable_lease(access, "a") == {"metadata": {"name": "r.a"}}
    assert refused.sent == [("GET", f"{LEASES}/r.a", None, None, JSON, None),
                            ("GET", LEASES, None, {"fieldSelector": "metadata.name=r.a"},
                             JSON, None)]
    access, client = gateway(ApiError(500, "InternalError", "etcd", {}))
    with pytest.raises(ApiError, match="etcd"):  # any other failure is the caller's
        readable_lease(access, "a")
    assert len(client.sent) == 1

def test_the_run_watch_and_the_slice_watch() -> None:
    access, client = gateway()
    assert access.watch_run(3, "7", 300) == "stream"
    assert access.watch_slice("uid-07", None, 60) == "stream"
    assert client.sent == [
        ("WATCH", RUNS, {"fieldSelector": "metadata.name=r,status.signal!=3",
                         "resourceVersion": "7"}, 300),
        ("WATCH", "/apis/elasticrun.dev/v1alpha1/namespaces/ns/elasticrunslices",
         {"fieldSelector": "metadata.name=uid-07", "resourceVersion": None}, 60),
    ]


def test_the_quiet_watch_of_a_member_asks_for_metadata_from_now() -> None:
    access, client = gateway()
    assert access.watch_round(4, 300) == "stream"
    access.read()
    access.read(not_older_than="9")  # after its event: from the API server's cache
    assert client.sent == [
        ("WATCH", RUNS, {"fieldSelector": "metadata.name=r,status.stableRound!=4"}, 300,
         "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"),
        ("GET", f"{RUNS}/r", None, None, JSON, None),
        ("GET", f"{RUNS}/r", None, {"resourceVersion": "9"}, JSON, None),
    ]


def test_the_watch_of_a_rejoining_member_asks_for_metadata_once_the_run_ended() -> None:
    access, client = gateway()
    assert access.watch_end(300) == "stream"
    assert client.sent == [
        ("WATCH", RUNS, {"fieldSelector": "metadata.name=r,status.phase!=Pending,"
                         "status.phase!=Forming,status.phase!=Running,status.phase!=Degraded"},
         300, "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"),
    ]


@pytest.mark.parametrize(("status", "answers"), [
    (404, {"patch_lease": None, "delete_lease": False}),
    (409, {"create_lease": None}),
])
def test_the_outcomes_the_gateway_answers_itself(status: int, answers: dict[str, Any]) -> None:
    access, _ = gateway(ApiError(status, "", "", {}))
    calls = {"create_lease": lambda: access.create_lease({"metadata": {"name": "r.a"}}),
             "patch_lease": lambda: access.patch_lease("a", {}),
             "delete_lease": lambda: access.delete_lease("a")}
    for name, call in calls.items():
        if name in answers:
            assert call() == answers[name]
        else:
            with pytest.raises(ApiError):
                call()


def test_the_operators_requests() -> None:
    """The executor's requests, as they went straight to the client before the
    operator's gateway (``OperatorGateway``) sent them."""
    client = RecordingClient()
    access = OperatorGateway(client)  # type: ignore[arg-type]
    manifest = {"kind": "Role", "metadata": {"name": "r-elasticrun"}}
    role = "/apis/rbac.authorization.k8s.io/v1/namespaces/ns/roles/r-elasticrun"
    access.apply(role, manifest, "elasticrun-rbac")
    access.delete(f"{LEASES}/r.a", "uid-a")
    access.delete(role)
    access.post_event("ns", {"reason": "Deleted"})
    run = access.run("ns", "r")
    run.remove_annotations(["x", "y"])
    assert (run.path, run.lease_path("r.a")) == (f"{RUNS}/r", f"{LEASES}/r.a")
    assert client.sent == [
        ("PATCH", role, manifest, {"fieldManager": "elasticrun-rbac", "force": "true"},
         APPLY_PATCH, None),
        ("DELETE", f"{LEASES}/r.a", {"apiVersion": "v1", "kind": "DeleteOptions",
                                     "preconditions": {"uid": "uid-a"}}, None, JSON, None),
        ("DELETE", role, None, None, JSON, None),
        ("POST", "/api/v1/namespaces/ns/events", {"reason": "Deleted"}, None, JSON, None),
        ("PATCH", f"{RUNS}/r", {"metadata": {"annotations": {"x": None, "y": None}}}, None,
         MERGE_PATCH, None),
    ]
