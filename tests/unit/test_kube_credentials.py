"""Loading credentials (``kube.load_credentials``) from several threads of one process."""

from __future__ import annotations

import base64
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from kubernetes.config import kube_config

from elasticrun.api.kube import load_credentials

CA = b"-----BEGIN CERTIFICATE-----\nnot parsed by the loader\n-----END CERTIFICATE-----\n"


def _kubeconfig(path: Path) -> Path:
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {
            "server": "https://127.0.0.1:6443",
            "certificate-authority-data": base64.b64encode(CA).decode()}}],
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
