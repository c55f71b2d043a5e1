"""Loading credentials (``kube.load_credentials``) from several threads of one process."""

from __future__ import annotations

import base64
import dataclasses
import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from kubernetes.config import kube_config
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from elasticrun.api.kube import load_credentials
from elasticrun.handler.calls import connect_client
from elasticrun.handler.handler import K8sRendezvousHandler
from elasticrun.handler.settings import from_parameters

CA = b"-----BEGIN CERTIFICATE-----\nnot parsed by the loader\n-----END CERTIFICATE-----\n"


def _kubeconfig(path: Path, ca: bytes = CA) -> Path:
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {
            "server": "https://127.0.0.1:6443",
            "certificate-authority-data": base64.b64encode(ca).decode()}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}))
    return path


def test_threads_loading_one_kubeconfig_each_get_its_certificate_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The official loader names the file of an inline certificate before it writes it;
    here its write is slowed so that a second load lands in between, as two handlers of
    one process starting at once did (their client then found the CA file empty)."""
    monkeypatch.setattr(kube_config, "_temp_files", {})  # a fresh process: nothing written

    def slow_open(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.3)
        return open(*args, **kwargs)  # the loader closes it

    monkeypatch.setattr(kube_config, "open", slow_open, raising=False)
    config = str(_kubeconfig(tmp_path / "kubeconfig"))
    seen: list[bytes] = []

    def load() -> None:
        ca_file = load_credentials(config).ca_file
        assert ca_file is not None
        seen.append(Path(ca_file).read_bytes())  # as the client's TLS context would read it

    threads = [threading.Thread(target=load) for _ in range(2)]
    for thread in threads:
        thread.start()
        time.sleep(0.05)  # the second starts while the first writes
    for thread in threads:
        thread.join(10)
    assert seen == [CA, CA]


def test_a_certificate_the_client_cannot_use_is_a_connection_error_naming_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The client loads the CA once, at its start: a bad one ends the call at once, in
    torch's error for credentials, naming the file."""
    monkeypatch.setattr(kube_config, "_temp_files", {})
    config = _kubeconfig(tmp_path / "kubeconfig", ca=b"not a certificate\n")
    settings = from_parameters(run_id="run", endpoint="", min_nodes=1, max_nodes=2,
                               local_addr="127.0.0.1",
                               conf={"namespace": "ns", "node_name": "a",
                                     "kubeconfig": str(config)})
    with pytest.raises(RendezvousConnectionError,
                       match=r"node 'a'.*cannot use the Kubernetes credentials' certificates "
                             r"\(CA /.*\).*(certificate|PEM|no start line)"):
        connect_client(settings)
    good = _kubeconfig(tmp_path / "good", ca=_real_ca(tmp_path))
    client = connect_client(dataclasses.replace(settings, kubeconfig=str(good)))
    assert client.credentials.host == "https://127.0.0.1:6443"  # positive control


def test_a_handler_loads_its_credentials_when_it_is_made(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As torch's c10d handler connects to its store when it is made, ours loads its
    credentials then: unusable ones fail the construction, in torch's error for
    credentials; usable ones are loaded once, before any round."""
    monkeypatch.setattr(kube_config, "_temp_files", {})
    settings = from_parameters(run_id="run", endpoint="", min_nodes=1, max_nodes=2,
                               local_addr="127.0.0.1",
                               conf={"namespace": "ns", "node_name": "a",
                                     "kubeconfig": str(tmp_path / "missing")})
    with pytest.raises(RendezvousConnectionError, match=r"node 'a'.*no Kubernetes credentials"):
        K8sRendezvousHandler(settings)
    loads: list[str | None] = []
    monkeypatch.setattr("elasticrun.handler.calls.load_credentials",
                        lambda path, context: loads.append(path) or load_credentials(path))
    good = str(_kubeconfig(tmp_path / "good", ca=_real_ca(tmp_path)))
    handler = K8sRendezvousHandler(dataclasses.replace(settings, kubeconfig=good))
    try:
        assert loads == [good]
        assert handler.stores.port is not None  # the first round's store, started too
    finally:
        handler.shutdown()


def _real_ca(tmp_path: Path) -> bytes:
    """A self-signed certificate, made with openssl (as the local control plane's are)."""
    key, cert = tmp_path / "ca.key", tmp_path / "ca.crt"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=test-ca"],
                   check=True, capture_output=True, timeout=60)
    return cert.read_bytes()
