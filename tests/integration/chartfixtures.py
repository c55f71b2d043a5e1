"""Fixtures for the chart, RBAC and webhook tests: load with `pytest_plugins = ("chartfixtures",)`.

They live here, not in a tests/integration/conftest.py, which would clash with
the top-level `conftest` module the tests import from.
"""

from __future__ import annotations

import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from chartkit import Helm, build_helm, create_namespace
from conftest import Cluster

# tests/integration/conftest.py would clash with the top-level `conftest` module.


@pytest.fixture(scope="session")
def helm_binary() -> Path:
    return build_helm()


@pytest.fixture
def helm(helm_binary: Path, cluster: Cluster) -> Iterator[Helm]:
    home = Path(tempfile.mkdtemp(prefix="elasticrun-helm-"))
    try:
        yield Helm(helm_binary, home, cluster.kubeconfig)
    finally:
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
def extra_namespace(cluster: Cluster, crds: None) -> Callable[[str], str]:
    """Make more fresh namespaces in one test (e.g. two training namespaces)."""

    def make(prefix: str = "t") -> str:
        return create_namespace(cluster, f"{prefix}-{secrets.token_hex(4)}")

    return make
