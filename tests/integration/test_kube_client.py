"""The handler's REST client against the real API server: its TLS connections."""

from __future__ import annotations

from elasticrun.api.kube import KubeClient, load_credentials

from conftest import Cluster


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
