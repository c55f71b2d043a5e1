"""Names and schema facts of elasticrun's CRDs, read from their one YAML source.

The YAML in ``deploy/crds/`` is the source of truth; this module ships links to
it as package data so that defaults and bounds used by the Python model can
never drift from what the API server enforces.
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Any

import yaml

GROUP = "elasticrun.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "ElasticRun"
PLURAL = "elasticruns"
CRD_NAME = f"{PLURAL}.{GROUP}"

#: The places of a sealed round in the largest runs, written only by the operator
#: (:mod:`elasticrun.api.slices`); a CRD of its own, ``slice_crd.yaml``.
SLICE_KIND = "ElasticRunSlice"
SLICE_PLURAL = "elasticrunslices"
SLICE_CRD_NAME = f"{SLICE_PLURAL}.{GROUP}"

#: Label carried by every object that belongs to a run (Leases, Pods).
RUN_LABEL = f"{GROUP}/run"
#: Annotation on a Lease naming the node that holds it (the full name, unhashed).
NODE_ANNOTATION = f"{GROUP}/node"
#: Annotation that asks the operator to start a new round now.
RESTART_ANNOTATION = f"{GROUP}/restart"
#: Annotation listing node names to keep out of the next rounds (comma separated).
DRAIN_ANNOTATION = f"{GROUP}/drain"


@cache
def crd_manifest() -> dict[str, Any]:
    """The ElasticRun CRD as the API server receives it."""
    return _packaged("crd.yaml")


@cache
def slice_crd_manifest() -> dict[str, Any]:
    """The ElasticRunSlice CRD as the API server receives it."""
    return _packaged("slice_crd.yaml")


def crd_manifests() -> list[dict[str, Any]]:
    """Every CRD elasticrun installs, in the order to apply them."""
    return [crd_manifest(), slice_crd_manifest()]


def _packaged(name: str) -> dict[str, Any]:
    text = resources.files("elasticrun.api").joinpath(name).read_text()
    manifest: dict[str, Any] = yaml.safe_load(text)
    return manifest


def _version_schema() -> dict[str, Any]:
    for version in crd_manifest()["spec"]["versions"]:
        if version["name"] == VERSION:
            schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
            return schema
    raise LookupError(f"CRD has no version {VERSION}")  # pragma: no cover


@cache
def spec_properties() -> dict[str, Any]:
    props: dict[str, Any] = _version_schema()["properties"]["spec"]["properties"]
    return props


def spec_default(field: str) -> Any:
    return spec_properties()[field].get("default")


def spec_maximum(field: str) -> int:
    return int(spec_properties()[field]["maximum"])


@cache
def status_properties() -> dict[str, Any]:
    props: dict[str, Any] = _version_schema()["properties"]["status"]["properties"]
    return props


@cache
def counter_maximum() -> int:
    """The largest value of every integer counter in the status (round, signal, ranks, ...).

    One number for all of them, kept in the CRD (``status.round``'s ``maximum``)
    so that the schema and the model refuse the same values; the unit tests
    check that every integer of the status schema carries it.
    """
    return int(status_properties()["round"]["maximum"])
