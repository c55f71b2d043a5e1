"""Installing CRDs on a control plane: apply them, then wait until each is served.

One helper for the tests, the benchmarks (which may install another revision's
CRDs) and the demo.  A CRD is usable only once the API server serves its
resource, which comes after ``Established``: a LIST of the resource first
answers 404 while its handler is set up, then 429 "storage is (re)initializing"
while its watch cache fills.  That cache is filled again after the API server
restarts (it sets a CRD's storage up on the resource's first request) and after
its watch of etcd broke (etcd restarted), so whatever restarts either waits
again (:func:`wait_until_served`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml

from elasticrun.api.kube import APPLY_PATCH, ApiError, KubeClient

CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
#: Between two looks at a CRD not served yet.
INTERVAL = 0.1


class CrdNotServedError(TimeoutError):
    """A CRD was not Established and served within the bound; the message names it."""


def read_manifests(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """The CRD manifests in the YAML files ``paths``, in their order."""
    manifests: list[dict[str, Any]] = [yaml.safe_load(path.read_text()) for path in paths]
    return manifests


def install_crds(client: KubeClient, manifests: Sequence[dict[str, Any]], *, manager: str,
                 timeout: float) -> None:
    """Apply ``manifests`` (server-side, as field manager ``manager``, taking over fields
    another manager set) and wait until each is served, ``timeout`` seconds at most."""
    for manifest in manifests:
        client.request("PATCH", f"{CRD_PATH}/{manifest['metadata']['name']}", body=manifest,
                       query={"fieldManager": manager, "force": "true"},
                       content_type=APPLY_PATCH)
    wait_until_served(client, manifests, timeout)


def wait_until_served(client: KubeClient, manifests: Sequence[dict[str, Any]],
                      timeout: float) -> None:
    """Wait until every CRD of ``manifests`` is Established and a LIST of its resource
    answers, ``timeout`` seconds at most for all of them; :class:`CrdNotServedError`
    names the first that is not, and why."""
    deadline = time.monotonic() + timeout
    for manifest in manifests:
        name = manifest["metadata"]["name"]
        while (problem := _not_served(client, manifest)) is not None:
            if time.monotonic() > deadline:
                raise CrdNotServedError(f"the CRD {name} was not served within "
                                        f"{timeout:.0f}s: {problem}")
            time.sleep(INTERVAL)


def _not_served(client: KubeClient, manifest: dict[str, Any]) -> str | None:
    """Why the CRD of ``manifest`` cannot be used yet; None once it can.  An error status
    is an answer to wait on (the CRD is being set up); a server that cannot be reached
    is not, and raises."""
    spec = manifest["spec"]
    try:
        got = client.request("GET", f"{CRD_PATH}/{manifest['metadata']['name']}")
    except ApiError as exc:
        return f"reading it: {exc}"
    if not any(c.get("type") == "Established" and c.get("status") == "True"
               for c in (got.get("status") or {}).get("conditions") or []):
        return "not Established"
    # The version objects are stored in, which the CRD serves.
    version = next(v["name"] for v in spec["versions"] if v.get("storage"))
    path = f"/apis/{spec['group']}/{version}/{spec['names']['plural']}"
    try:
        client.request("GET", path)
    except ApiError as exc:
        return f"LIST {path}: {exc}"
    return None
