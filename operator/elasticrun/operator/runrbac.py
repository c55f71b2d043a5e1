"""Per-run RBAC (opt-in, ``--per-run-rbac``): a pod of run A cannot write run B.

The chart's training Role lets every training pod of a namespace write every
ElasticRun and Lease in it.  With ``--per-run-rbac`` the operator gives each
run that names its ServiceAccount in the annotation
``elasticrun.dev/service-account`` a Role of its own, limited by
``resourceNames`` to that run and to its nodes' Leases, and a RoleBinding for
that ServiceAccount (bind it to nothing else).

What RBAC cannot limit by name, and how it is handled:

* ``create`` of Leases: RBAC never checks ``resourceNames`` on create (the name
  is not known to the authorizer before the object exists), so ``create`` on
  leases is granted namespace-wide.  A node creates its Lease first; the
  operator sees it (its Lease index), and adds the name to the Role before the
  node's first renewal, so every later write of the node is by name.  The
  names of the nodes the run's status holds stay in the Role after their
  Lease is deleted (:func:`lease_names`), so a removed node finds its Lease
  gone (404) and creates it again.  A pod can create a Lease under another
  run's node name before that node does (a squatter: the admission policy
  refuses it for labelled Leases; an unlabelled one makes that node fail with
  LeaseNameTakenError naming it), but it can never change or delete a Lease
  that already exists, nor any other run's status.
* ``list`` of Leases: the handler lists its run's Leases by label to read the
  join requests, and a label-selected list cannot be limited by name either;
  Leases hold node names and addresses, nothing secret.
* ``list``/``watch`` of the run itself are limited by name: the handler watches
  with ``fieldSelector=metadata.name=RUN``, which the authorizer checks against
  ``resourceNames``.  So are those of the run's slices, in the runs told in
  slices (:mod:`elasticrun.api.slices`), which the Role lets the pods read and
  never write: each member watches its one slice by name.

The Role and RoleBinding are owned by the run (ownerReferences), so the garbage
collector removes them with it; the operator also deletes them on TTL cleanup.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from typing import Any

from elasticrun.api import crd
from elasticrun.api.leases import LeaseState, owned_by
from elasticrun.api.model import ElasticRun
from elasticrun.api.naming import lease_name

#: Annotation on an ElasticRun naming the ServiceAccount its pods run as.
SERVICE_ACCOUNT_ANNOTATION = f"{crd.GROUP}/service-account"
RBAC = "rbac.authorization.k8s.io"
MANAGER = "elasticrun-operator"


_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def service_account_problem(account: str) -> str | None:
    """Why ``account`` cannot name a ServiceAccount (the annotation's value), or None.

    Checked before anything is applied: an invalid name would be refused by
    the API server on every reconcile of the run.
    """
    if len(account) <= 253 and _SUBDOMAIN.fullmatch(account):
        return None
    return (f"annotation {SERVICE_ACCOUNT_ANNOTATION}={account[:80]!r} is not a ServiceAccount "
            "name (a DNS subdomain of at most 253 characters); no per-run Role was made")


def object_name(run: str) -> str:
    """Name of the run's Role and RoleBinding (a valid name for any run name)."""
    name = f"elasticrun-run.{run}"
    if len(name) <= 253:
        return name
    return f"elasticrun-run.{run[:200]}.{hashlib.sha256(run.encode()).hexdigest()[:16]}"


def _meta(run: str, namespace: str, uid: str | None) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": object_name(run), "namespace": namespace,
        "labels": {"app.kubernetes.io/managed-by": "elasticrun-operator"},
        "annotations": {crd.RUN_LABEL: run},
    }
    if uid:
        meta["ownerReferences"] = [{"apiVersion": crd.API_VERSION, "kind": crd.KIND,
                                    "name": run, "uid": uid, "blockOwnerDeletion": False}]
    return meta


def lease_names(run: ElasticRun, leases: Mapping[str, LeaseState]) -> list[str]:
    """The Lease names the run's Role grants: its genuine Leases, and its nodes' names.

    A Lease the operator observed counts only if it is a genuine Lease of the
    run (:func:`~elasticrun.api.leases.owned_by`): a Role never names an
    object of another run.  The names of the nodes the run's status still
    holds (members, waiting nodes, the last lost members, ``LOST_MEMBERS_KEPT``
    at most) stay granted after their Lease is deleted: a removed node's next
    renewal then finds its Lease gone (404, which makes it create the Lease
    again) instead of being refused (403 tells it nothing, and ``create``
    alone does not help a node that writes by name).  A name whose object is
    observed and is not the run's is left out.
    """
    names = {lease.name for lease in leases.values()
             if lease.name and owned_by(lease, run.name, run.uid)}
    status = run.status
    nodes = {p.name for p in status.participants} | {w.name for w in status.waiting}
    nodes |= {m.name for m in status.lost_members}
    for node in nodes:
        observed = leases.get(node)
        if observed is None or owned_by(observed, run.name, run.uid):
            names.add(lease_name(run.name, node))
    return sorted(names)


def role(run: str, namespace: str, uid: str | None, names: Iterable[str],
         slice_names: Iterable[str] = ()) -> dict[str, Any]:
    """The run's Role: this run, its status, the Leases named (:func:`lease_names`), and
    reading the slices named (:func:`~elasticrun.api.slices.slice_names`, in runs told
    in slices)."""
    leases = sorted(set(names))
    rules: list[dict[str, Any]] = [
        {"apiGroups": [crd.GROUP], "resources": [crd.PLURAL], "resourceNames": [run],
         "verbs": ["get", "list", "watch", "patch", "update"]},
        {"apiGroups": [crd.GROUP], "resources": [f"{crd.PLURAL}/status"],
         "resourceNames": [run], "verbs": ["get", "patch", "update"]},
        # Not limitable by name (see the module docstring).
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
         "verbs": ["create", "list"]},
    ]
    if leases:
        rules.append({"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                      "resourceNames": leases,
                      "verbs": ["get", "update", "patch", "delete"]})
    if slice_names:
        # Read only: the operator alone writes a run's slices.
        rules.append({"apiGroups": [crd.GROUP], "resources": [crd.SLICE_PLURAL],
                      "resourceNames": sorted(slice_names), "verbs": ["get", "list", "watch"]})
    return {"apiVersion": f"{RBAC}/v1", "kind": "Role", "metadata": _meta(run, namespace, uid),
            "rules": rules}


def role_binding(run: str, namespace: str, uid: str | None,
                 service_account: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{RBAC}/v1", "kind": "RoleBinding",
        "metadata": _meta(run, namespace, uid),
        "roleRef": {"apiGroup": RBAC, "kind": "Role", "name": object_name(run)},
        "subjects": [{"kind": "ServiceAccount", "name": service_account,
                      "namespace": namespace}],
    }


def path(kind: str, namespace: str, run: str) -> str:
    plural = {"Role": "roles", "RoleBinding": "rolebindings"}[kind]
    return f"/apis/{RBAC}/v1/namespaces/{namespace}/{plural}/{object_name(run)}"
