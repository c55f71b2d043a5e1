"""Helpers for tests of the operator's leader election (test_leader, test_realnode_leader).

Each replica's requests are told apart in the audit log by its user agent,
which carries its Lease holder name.
"""

from __future__ import annotations

import json
from typing import Any

from elasticrun.api import crd
from elasticrun.api.kube import OPERATOR_USER_AGENT, ApiError, KubeClient, lease_path
from elasticrun.operator.elector import LEASE_NAME

from conftest import Cluster
from rdzv import AuditLog

WRITES = {"create", "update", "patch", "delete"}


def holder(client: KubeClient, namespace: str) -> str | None:
    try:
        got = client.request("GET", lease_path(namespace, LEASE_NAME))
    except ApiError:
        return None
    value = (got.get("spec") or {}).get("holderIdentity")
    return value if isinstance(value, str) else None


def by_agent(audit: AuditLog, namespace: str, since: int) -> dict[str, list[Any]]:
    """The operators' requests by user agent (one per replica)."""
    found: dict[str, list[Any]] = {}
    for entry in audit.entries(namespace, since=since):
        if entry.user_agent.startswith(OPERATOR_USER_AGENT):
            found.setdefault(entry.user_agent, []).append(entry)
    return found


def agent_of(holder_name: str) -> str:
    return f"{OPERATOR_USER_AGENT} ({holder_name})"


def run_writes(entries: list[Any]) -> list[str]:
    """The writes of runs and Events among ``entries``.

    A request the fence cut between its headers and its body (a replica frozen
    in between, refused when it resumed) reached the server without its body,
    which answers 500 for it and writes nothing: not a write.
    """
    return [e.kind for e in entries if e.verb in WRITES and not e.cut_short
            and e.resource in {"elasticruns", "events"}]


def events(cluster: Cluster, namespace: str, reason: str) -> list[str]:
    got = cluster.client.request("GET", f"/api/v1/namespaces/{namespace}/events",
                                 query={"fieldSelector": f"reason={reason}"})
    return [e["message"] for e in got.get("items") or []]


def only_written_by(audit: AuditLog, namespace: str, since: int, holder_name: str) -> None:
    """The runs and Events of ``namespace`` were written since ``since``, by that holder only."""
    writes = {agent: run_writes(entries) for agent, entries in
              by_agent(audit, namespace, since).items()}
    assert writes.get(agent_of(holder_name)), writes
    assert [w for agent, w in writes.items() if agent != agent_of(holder_name) and w] == [], \
        writes


def mutated_on_dry_run(cluster: Cluster, namespace: str, run: str = "probe") -> tuple[bool, str]:
    """Create a pod opted into ``run`` with --dry-run=server: every webhook of the
    configuration must answer (failurePolicy Fail) and the pod comes back mutated
    (torchrun's k8s backend and the run's id in its environment)."""
    probe = {"apiVersion": "v1", "kind": "Pod",
             "metadata": {"name": "probe", "namespace": namespace,
                          "labels": {crd.RUN_LABEL: run}},
             "spec": {"containers": [{"name": "trainer", "image": "trainer:1",
                                      "command": ["torchrun", "train.py"]}]}}
    result = cluster.kubectl("create", "-f", "-", "-o", "json", "--dry-run=server",
                             input=json.dumps(probe), check=False)
    if result.returncode != 0:
        return False, result.stderr
    pod = json.loads(result.stdout)
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0].get("env") or []}
    mutated = (env.get("PET_RDZV_BACKEND") == "k8s" and env.get("PET_RDZV_ID") == run
               and pod["metadata"]["labels"].get(crd.RUN_LABEL) == run)
    return mutated, "" if mutated else f"not mutated: env {env}"
