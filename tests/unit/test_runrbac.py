"""The per-run Role and RoleBinding (elasticrun.operator.runrbac)."""

from __future__ import annotations

from elasticrun.api import crd
from elasticrun.api.naming import lease_name
from elasticrun.operator import runrbac


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
    # watch: a node of a large run watches its own Lease (by name) for its assignment.
    assert set(named["verbs"]) == {"get", "watch", "update", "patch", "delete"}
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
