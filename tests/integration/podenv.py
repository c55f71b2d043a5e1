"""A container's environment as the kubelet would resolve it for a pod on this machine.

Tests that run real torchrun agents as processes hand them the environment the
webhook's mutation would give a real container: downward-API fields resolved,
``$(VAR)`` references expanded from variables defined earlier.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any


def kubelet_env(pod: Mapping[str, Any], namespace: str | None = None) -> dict[str, str]:
    """The first container's environment; the pod's namespace unless ``namespace`` is given."""
    meta = pod["metadata"]
    name = meta["name"]
    fields = {"metadata.name": name,
              "metadata.namespace": namespace or meta["namespace"],
              "metadata.uid": meta.get("uid") or f"uid-{name}",
              "status.podIP": "127.0.0.1"}
    fields.update({f"metadata.annotations['{k}']": v
                   for k, v in (meta.get("annotations") or {}).items()})
    env: dict[str, str] = {}
    for item in pod["spec"]["containers"][0].get("env") or []:
        if "valueFrom" in item:
            value = fields[item["valueFrom"]["fieldRef"]["fieldPath"]]
        else:  # $(VAR) expands only from variables defined earlier, as in the kubelet
            value = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                           lambda m: env.get(m.group(1), m.group(0)), item.get("value", ""))
        env[item["name"]] = value
    return env
