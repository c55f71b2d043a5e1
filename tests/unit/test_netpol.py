"""The per-run NetworkPolicy the operator makes (elasticrun.operator.netpol)."""

from __future__ import annotations

from elasticrun.api import crd
from elasticrun.api.naming import label_value
from elasticrun.operator import netpol
from elasticrun.operator.__main__ import parse_args


def test_the_runs_pods_admit_the_store_port_from_the_runs_pods_only() -> None:
    policy = netpol.policy("team-b", "ns", "uid-b", 29400)
    own = {"matchLabels": {crd.RUN_LABEL: "team-b"}}
    assert policy["spec"] == {"podSelector": own, "policyTypes": ["Ingress"],
                              "ingress": [{"from": [{"podSelector": own}],
                                           "ports": [{"protocol": "TCP", "port": 29400}]}]}
    assert policy["metadata"]["ownerReferences"] == [
        {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "name": "team-b", "uid": "uid-b",
         "blockOwnerDeletion": False}]
    assert policy["metadata"]["namespace"] == "ns"
    assert netpol.path("ns", "team-b") == ("/apis/networking.k8s.io/v1/namespaces/ns/"
                                           "networkpolicies/elasticrun-store.team-b")


def test_an_unpinned_store_port_admits_the_runs_pods_on_every_port() -> None:
    (rule,) = netpol.policy("r", "ns", "u", 0)["spec"]["ingress"]
    assert rule == {"from": [{"podSelector": {"matchLabels": {crd.RUN_LABEL: "r"}}}]}


def test_long_run_names_give_valid_names_and_the_label_value_pods_carry() -> None:
    run = "x" * 253
    policy = netpol.policy(run, "ns", "u", 1)
    assert len(policy["metadata"]["name"]) <= 253
    assert policy["spec"]["podSelector"] == {"matchLabels": {crd.RUN_LABEL: label_value(run)}}
    assert netpol.object_name(run) != netpol.object_name(run[:-1] + "y")


def test_the_operator_flag_takes_a_tcp_port_or_nothing() -> None:
    assert parse_args([]).per_run_network_policy is None
    assert parse_args(["--per-run-network-policy", "0"]).per_run_network_policy == 0
    assert parse_args(["--per-run-network-policy=29400"]).per_run_network_policy == 29400
