"""The per-run Role and RoleBinding (elasticrun.operator.runrbac)."""

from __future__ import annotations

from typing import Any

from elasticrun.api import crd, rounds, slices
from elasticrun.api.model import ElasticRun, RunSpec, RunStatus
from elasticrun.api.naming import lease_name
from elasticrun.operator import runobjects, runrbac


def test_role_names_the_run_and_its_leases_and_grants_create_without_names() -> None:
    role = runrbac.role("train", "team", "uid-1",
                        [lease_name("train", "n1"), lease_name("train", "n0")])
    by_resource: dict[tuple[str, ...], list[dict[str, object]]] = {}
    for rule in role["rules"]:
        by_resource.setdefault(tuple(rule["resources"]), []).append(rule)
    (run_rule,) = by_resource[(crd.PLURAL,)]
    assert run_rule["resourceNames"] == ["train"] and "delete" not in run_rule["verbs"]
    assert "create" not in run_rule["verbs"]
    (status_rule,) = by_resource[(f"{crd.PLURAL}/status",)]
    assert status_rule["resourceNames"] == ["train"]
    unnamed, named = by_resource[("leases",)]
    assert "resourceNames" not in unnamed and set(unnamed["verbs"]) == {"create", "list"}
    assert named["resourceNames"] == sorted({lease_name("train", "n0"),
                                             lease_name("train", "n1")})
    # By name: a node renews, asks and withdraws on its own Lease, reads rank 0's; no
    # node watches a Lease (places come by the run or its slices).
    assert set(named["verbs"]) == {"get", "update", "patch", "delete"}
    assert role["metadata"]["ownerReferences"][0]["uid"] == "uid-1"


def test_no_lease_rule_by_name_before_a_node_has_one() -> None:
    role = runrbac.role("train", "team", None, [])
    assert all("resourceNames" not in r for r in role["rules"]
               if r["resources"] == ["leases"])
    assert "ownerReferences" not in role["metadata"]


def test_binding_and_names_stay_valid_for_long_runs() -> None:
    run = "r" * 253
    binding = runrbac.role_binding(run, "team", "u", "trainer")
    assert binding["roleRef"]["name"] == runrbac.object_name(run)
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "trainer",
                                    "namespace": "team"}]
    assert len(runrbac.object_name(run)) <= 253
    assert runrbac.object_name("short") == "elasticrun-run.short"


def test_an_invalid_service_account_name_is_a_problem_not_an_apply() -> None:
    assert runrbac.service_account_problem("trainer") is None
    assert runrbac.service_account_problem("team.trainer-1") is None
    for bad in ("Trainer", "trainer_1", "-x", "x" * 254, "a..b", ""):
        problem = runrbac.service_account_problem(bad)
        assert problem is not None and "is not a ServiceAccount name" in problem, bad


def _role_applied(max_nodes: int) -> dict[str, Any]:
    """The Role the operator applies for run ``train`` of ``max_nodes`` naming its account."""
    run = ElasticRun("train", "team", RunSpec(min_nodes=2, max_nodes=max_nodes), RunStatus(),
                     "1", uid="uid-1",
                     annotations={runrbac.SERVICE_ACCOUNT_ANNOTATION: "trainer"})
    (item,) = runobjects.applies(run, {}, runobjects.Settings(per_run_rbac=True),
                                 runobjects.NOTHING_DONE)
    (role,) = [m for _, m in item.manifests if m["kind"] == "Role"]
    return role


def test_a_run_told_in_slices_may_read_its_own_slices_by_name_and_write_none() -> None:
    sliced = [r for r in _role_applied(rounds.TELL_IN_SLICES_FROM)["rules"]
              if r["resources"] == [crd.SLICE_PLURAL]]
    assert sliced == [{"apiGroups": [crd.GROUP], "resources": [crd.SLICE_PLURAL],
                       "resourceNames": sorted(slices.slice_names("uid-1")),
                       "verbs": ["get", "list", "watch"]}]
    # A run told by the broadcast has no slices to read.
    assert not [r for r in _role_applied(rounds.TELL_IN_SLICES_FROM - 1)["rules"]
                if r["resources"] == [crd.SLICE_PLURAL]]
