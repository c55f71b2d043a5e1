"""The handler's REST client against the real API server: its TLS connections."""

from __future__ import annotations

import pytest

from elasticrun.api.kube import KubeClient, lease_path, leases_path, load_credentials

from conftest import Cluster, wait_for
from rdzv import AuditEntry, AuditLog


def test_a_clients_new_connections_resume_its_tls_session(cluster: Cluster) -> None:
    """Each watch a node re-opens is a new connection; resumed, its handshake costs the API
    server no RSA signature (kube.ResumingContext)."""
    client = KubeClient(load_credentials(str(cluster.kubeconfig)), connections=2)
    other = KubeClient(load_credentials(str(cluster.kubeconfig)), connections=2)
    try:
        assert client.credentials.host.startswith("https://")
        client.request("GET", "/version")
        # The first connection of a client is a full handshake.
        assert (client.tls.handshakes, client.tls.resumed) == (1, 0)
        # A watch takes the kept-alive connection; a request beside it needs a new one.
        watch = client.watch("/api/v1/namespaces", {"limit": 1}, 5)
        try:
            client.request("GET", "/version")
        finally:
            watch.close()
        assert (client.tls.handshakes, client.tls.resumed) == (2, 1)
        for _ in range(3):
            client.close()  # the next request needs a new connection
            client.request("GET", "/version")
        assert (client.tls.handshakes, client.tls.resumed) == (5, 4)
        # Sessions are a client's own: another client starts with a full handshake.
        other.request("GET", "/version")
        assert (other.tls.handshakes, other.tls.resumed) == (1, 0)
    finally:
        client.close()
        other.close()


class _FrozenError(Exception):
    """What the fence raises for the piece sent after the freeze."""


def test_a_request_the_fence_cuts_at_its_body_writes_nothing(
        cluster: Cluster, namespace: str) -> None:
    """The operator's fence (``request_checked``) asks before each piece goes out: a replica
    frozen after its headers left is refused its body when it resumes.  The API server then
    answers the headers it read with 500 and writes nothing; the audit log's readers tell
    that request from a write (``AuditEntry.cut_short``)."""
    local = cluster.require_local()
    audit = AuditLog(local.state.audit_log)  # type: ignore[union-attr]
    mark = audit.mark()
    client = KubeClient(load_credentials(str(cluster.kubeconfig)))
    lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
             "metadata": {"name": "fenced", "namespace": namespace},
             "spec": {"holderIdentity": "before"}}
    path = lease_path(namespace, "fenced")
    created = client.request("POST", leases_path(namespace), body=lease)
    pieces: list[int] = []

    def leader_until_the_headers_left() -> None:
        pieces.append(1)
        if len(pieces) > 1:
            raise _FrozenError("no longer the leader")

    changed = {**lease, "metadata": {**lease["metadata"],
                                     "resourceVersion": created["metadata"]["resourceVersion"]},
               "spec": {"holderIdentity": "after"}}
    with pytest.raises(_FrozenError):
        client.request_checked(leader_until_the_headers_left, "PUT", path, body=changed)
    assert len(pieces) == 2  # the headers went out; the body was refused
    assert client.request("GET", path)["spec"]["holderIdentity"] == "before"
    client.request("PUT", path, body=changed)  # positive control: the same write, whole
    assert client.request("GET", path)["spec"]["holderIdentity"] == "after"

    def updates() -> list[AuditEntry]:
        return [e for e in audit.entries(namespace, since=mark)
                if e.kind == "update leases" and e.name == "fenced"]

    wait_for(lambda: len(updates()) == 2, 10, "both updates in the audit log")
    cut, whole = sorted(updates(), key=lambda e: e.code, reverse=True)
    assert (cut.code, cut.cut_short) == (500, True), cut
    assert (whole.code, whole.cut_short) == (200, False), whole
