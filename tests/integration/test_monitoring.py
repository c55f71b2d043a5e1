"""The chart's monitoring kit: metrics Service, ServiceMonitor or PodMonitor,
PrometheusRule and Grafana dashboard.

The monitoring objects are applied to the real API server with the
prometheus-operator CRDs installed (fetched from its Go module by
``tests/controlplane/build-monitoring-crds.sh``), and every series the alerts
and the dashboard read is looked up on a live operator's ``/metrics`` after it
handled a run that lost a member.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from chartkit import CHART, Helm, apply_chart, by_kind, one
from conftest import ROOT, Cluster, Kubelet, OperatorProcess, wait_for
from controlplane.promql import exposed_names, grafana_promql, metric_names
from rdzv import metric, rendezvous_all

#: The fixtures helm, helm_binary and extra_namespace.
pytest_plugins = ("chartfixtures",)

MONITORING_BUILD = ROOT / "tests" / "controlplane" / "build-monitoring.sh"
MONITORING_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
ALERTS = ["ElasticRunStalled", "ElasticRunDegraded", "ElasticRunMembersLostFast",
          "ElasticRunOperatorAPIServerUnreachable"]
#: Every part of the kit, with the options a platform team sets.
FULL = {"metrics": {
    "service": {"enabled": True, "port": 9090, "annotations": {"team": "ml"},
                "labels": {"tier": "infra"}},
    "serviceMonitor": {
        "enabled": True, "labels": {"release": "kube-prometheus-stack"}, "interval": "15s",
        "scrapeTimeout": "10s",
        "relabelings": [{"action": "replace", "targetLabel": "cluster", "replacement": "c1"}],
        "metricRelabelings": [{"action": "drop", "sourceLabels": ["__name__"],
                               "regex": "python_.*"}]},
    "prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack"},
                       "alertLabels": {"team": "ml"},
                       "runbookBaseURL": "https://git.example/elasticrun/README.md",
                       "additionalRules": [{"alert": "ElasticRunNoMembers",
                                            "expr": "max(elasticrun_members) < 1",
                                            "for": "30m", "labels": {"severity": "info"}}]},
    "dashboard": {"enabled": True, "annotations": {"grafana_folder": "Training"}},
}}


@pytest.fixture(scope="session")
def monitoring_bin() -> Path:
    """The prometheus-operator CRDs and promql-check (built once, then cached)."""
    out = subprocess.run(["bash", str(MONITORING_BUILD)], check=True, stdout=subprocess.PIPE,
                         text=True, timeout=1800)
    return Path(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def monitoring_crds(cluster: Cluster, monitoring_bin: Path) -> None:
    """ServiceMonitor, PodMonitor and PrometheusRule served by the session's API server."""
    files = sorted(monitoring_bin.glob("monitoring.coreos.com_*.yaml"))
    assert len(files) == 3, files
    for path in files:
        applied = cluster.kubectl("apply", "--server-side", "--field-manager=monitoring-test",
                                  "--force-conflicts", "-f", str(path), check=False)
        assert applied.returncode == 0, applied.stderr
        name = yaml.safe_load(path.read_text())["metadata"]["name"]
        cluster.kubectl("wait", "--for=condition=Established", f"crd/{name}",
                        "--timeout=30s")
    for plural in ("servicemonitors", "podmonitors", "prometheusrules"):
        wait_for(lambda p=plural: cluster.kubectl(
            "get", f"{p}.monitoring.coreos.com", "-A", check=False).returncode == 0,
            30, f"{plural} to be served")


@pytest.fixture(scope="session")
def promql_check(monitoring_bin: Path) -> Callable[[list[str]], list[dict[str, Any]]]:
    """Prometheus' own parser: each expression's parse error or the metric names it reads."""

    def check(exprs: list[str]) -> list[dict[str, Any]]:
        done = subprocess.run([str(monitoring_bin / "promql-check")], input=json.dumps(exprs),
                              capture_output=True, text=True, timeout=60, check=True)
        results: list[dict[str, Any]] = json.loads(done.stdout)
        return results

    return check


def live(cluster: Cluster, doc: dict[str, Any]) -> dict[str, Any]:
    group = doc["apiVersion"].split("/")[0]
    got = cluster.kubectl("get", f"{doc['kind'].lower()}.{group}", doc["metadata"]["name"],
                          "-n", doc["metadata"]["namespace"], "-o", "json")
    stored: dict[str, Any] = json.loads(got.stdout)
    return stored


def queries(docs: list[dict[str, Any]], with_additional: bool = False) -> dict[str, str]:
    """Each alert's and each dashboard query's PromQL, by where it is."""
    found: dict[str, str] = {}
    for rule in one(docs, "PrometheusRule")["spec"]["groups"][0]["rules"]:
        if with_additional or rule["alert"] in ALERTS:
            found[f"alert {rule['alert']}"] = rule["expr"]
    dashboard = json.loads(one(docs, "ConfigMap")["data"]["elasticrun.json"])
    grafana = [(f"panel {p['title']} {t['refId']}", t["expr"])
               for p in dashboard["panels"] for t in p["targets"]]
    grafana += [(f"variable {v['name']}", v["query"]["query"])
                for v in dashboard["templating"]["list"] if v["type"] == "query"]
    for where, query in grafana:
        promql = grafana_promql(query)
        assert promql is not None, f"{where} names no series: {query}"
        found[where] = promql
    return found


# --------------------------------------------------------------------------- rendering


@pytest.mark.parametrize("monitor", ["serviceMonitor", "podMonitor"])
def test_helm_lint_passes_strict_with_the_monitoring_kit(helm: Helm, monitor: str) -> None:
    metrics: dict[str, Any] = json.loads(json.dumps(FULL["metrics"]))
    metrics["serviceMonitor"]["enabled"] = monitor == "serviceMonitor"
    metrics["podMonitor"] = {"enabled": monitor == "podMonitor"}
    result = helm.run("lint", "--strict", str(CHART), "--values",
                      str(helm.values_file({"metrics": metrics})))
    assert "0 chart(s) failed" in result.stdout


def test_monitoring_is_off_by_default(helm: Helm) -> None:
    docs = helm.template("r", "er-system")
    assert not [d for d in docs if d["kind"] in MONITORING_KINDS]
    assert [d["metadata"]["name"] for d in by_kind(docs, "Service")] == ["r-elasticrun-webhook"]
    assert by_kind(docs, "ConfigMap") == []


def test_the_monitors_scrape_the_operators_metrics_port(helm: Helm) -> None:
    docs = helm.template("r", "er-system", FULL)
    deployment = one(docs, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "metrics", "containerPort": 8080, "protocol": "TCP"} in container["ports"]
    service = one(docs, "Service", "r-elasticrun-metrics")
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"}]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["metadata"]["labels"]["tier"] == "infra"
    assert service["metadata"]["annotations"] == {"team": "ml"}
    monitor = one(docs, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= \
        service["metadata"]["labels"].items()
    # The webhook's Service is not selected.
    webhook = one(docs, "Service", "r-elasticrun-webhook")
    assert not monitor["spec"]["selector"]["matchLabels"].items() <= \
        webhook["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["er-system"]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint == {
        "port": "metrics", "path": "/metrics", "scheme": "http", "interval": "15s",
        "scrapeTimeout": "10s", "honorLabels": True,
        "relabelings": FULL["metrics"]["serviceMonitor"]["relabelings"],
        "metricRelabelings": FULL["metrics"]["serviceMonitor"]["metricRelabelings"]}
    # The PodMonitor selects the operator pods by the same labels the Deployment sets.
    pods = helm.template("r", "er-system", {"metrics": {"podMonitor": {
        "enabled": True, "namespace": "monitoring", "interval": "1m", "honorLabels": False}}})
    assert by_kind(pods, "ServiceMonitor") == []
    assert [s["metadata"]["name"] for s in by_kind(pods, "Service")] == ["r-elasticrun-webhook"]
    pod_monitor = one(pods, "PodMonitor")
    assert pod_monitor["metadata"]["namespace"] == "monitoring"
    assert pod_monitor["spec"]["namespaceSelector"] == {"matchNames": ["er-system"]}
    assert pod_monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pod_monitor["spec"]["podMetricsEndpoints"] == [
        {"port": "metrics", "path": "/metrics", "scheme": "http", "interval": "1m",
         "honorLabels": False}]


def test_the_alerts_carry_severity_summary_description_and_runbook(helm: Helm) -> None:
    docs = helm.template("r", "er-system", FULL)
    rule = one(docs, "PrometheusRule")
    (group,) = rule["spec"]["groups"]
    rules = {r["alert"]: r for r in group["rules"]}
    assert list(rules) == [*ALERTS, "ElasticRunNoMembers"]
    for name in ALERTS:
        alert = rules[name]
        assert alert["labels"] == {"severity": alert["labels"]["severity"], "team": "ml"}
        assert alert["labels"]["severity"] in {"warning", "critical"}
        notes = alert["annotations"]
        assert set(notes) == {"summary", "description", "runbook", "runbook_url"}, name
        assert notes["runbook_url"] == \
            f"https://git.example/elasticrun/README.md#runbook-{name.lower()}"
        assert f"#runbook-{name.lower()}" in notes["runbook"]
    # Each runbook entry the alerts point at exists in the chart README.
    readme = (CHART / "README.md").read_text()
    for name in ALERTS:
        assert f"### Runbook: {name}" in readme, name
    assert rules["ElasticRunStalled"]["for"] == "10m"
    assert rules["ElasticRunOperatorAPIServerUnreachable"]["labels"]["severity"] == "critical"
    assert "[10m]" in rules["ElasticRunMembersLostFast"]["expr"]
    assert rules["ElasticRunMembersLostFast"]["expr"].rstrip().endswith("> 3")
    # Thresholds are values; no runbook_url without a base URL.
    tuned = one(helm.template("r", "x", {"metrics": {"prometheusRule": {
        "enabled": True, "stalledFor": "30m", "membersLost": {"threshold": 10, "window": "1h"},
        "apiServerUnreachableSeverity": "warning"}}}), "PrometheusRule")
    tuned_rules = {r["alert"]: r for r in tuned["spec"]["groups"][0]["rules"]}
    assert tuned_rules["ElasticRunStalled"]["for"] == "30m"
    assert "[1h]" in tuned_rules["ElasticRunMembersLostFast"]["expr"]
    assert tuned_rules["ElasticRunMembersLostFast"]["expr"].rstrip().endswith("> 10")
    assert tuned_rules["ElasticRunOperatorAPIServerUnreachable"]["labels"] == {
        "severity": "warning"}
    assert "runbook_url" not in tuned_rules["ElasticRunDegraded"]["annotations"]


def test_the_dashboard_is_labelled_for_the_grafana_sidecar(helm: Helm) -> None:
    docs = helm.template("r", "er-system", FULL)
    config_map = one(docs, "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "Training"}
    dashboard = json.loads(config_map["data"]["elasticrun.json"])
    assert dashboard["uid"] == "elasticrun-runs" and dashboard["panels"]
    source = json.loads((CHART / "dashboards" / "elasticrun.json").read_text())
    assert dashboard == source
    relabelled = one(helm.template("r", "er-system", {"metrics": {"dashboard": {
        "enabled": True, "label": "dashboards.example/grafana", "labelValue": "true",
        "namespace": "grafana"}}}), "ConfigMap")
    assert relabelled["metadata"]["namespace"] == "grafana"
    assert relabelled["metadata"]["labels"]["dashboards.example/grafana"] == "true"
    assert "grafana_dashboard" not in relabelled["metadata"]["labels"]


@pytest.mark.parametrize(("values", "message"), [
    ({"metrics": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}}},
     "metrics.serviceMonitor.enabled and metrics.podMonitor.enabled are both true: keep one"),
    ({"metrics": {"podMonitor": {"enabled": True}}, "operator": {"metricsPort": 0}},
     "need operator.metricsPort > 0"),
])
def test_contradictory_monitoring_values_fail_with_what_to_keep(
        helm: Helm, values: dict[str, Any], message: str) -> None:
    result = helm.run("template", "r", str(CHART), "--values", str(helm.values_file(values)),
                      check=False)
    assert result.returncode != 0
    assert message in result.stderr


# --------------------------------------------------------------------------- the API server


@pytest.mark.parametrize("monitor", ["serviceMonitor", "podMonitor"])
def test_monitoring_objects_apply_to_the_real_api_server(
        cluster: Cluster, helm: Helm, namespace: str, monitoring_crds: None,
        extra_namespace: Callable[[str], str], monitor: str,
        request: pytest.FixtureRequest) -> None:
    """What the API server stores is what the chart rendered (nothing pruned or refused)."""
    elsewhere = extra_namespace("mon")
    metrics: dict[str, Any] = json.loads(json.dumps(FULL["metrics"]))
    metrics["serviceMonitor"]["enabled"] = monitor == "serviceMonitor"
    metrics["podMonitor"] = {**metrics["serviceMonitor"], "enabled": monitor == "podMonitor",
                             "namespace": elsewhere}
    metrics["prometheusRule"]["namespace"] = elsewhere
    docs = helm.template("mon", namespace, {"metrics": metrics})
    kinds = {d["kind"] for d in docs}
    assert {"PrometheusRule", "ConfigMap", monitor[0].upper() + monitor[1:]} <= kinds
    apply_chart(cluster, docs, namespace, request)
    for doc in docs:
        if doc["kind"] in MONITORING_KINDS:
            stored = live(cluster, doc)
            assert stored["spec"] == doc["spec"], doc["kind"]
            assert stored["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert one(docs, "PrometheusRule")["metadata"]["namespace"] == elsewhere
    dashboard = one(docs, "ConfigMap")
    got = json.loads(cluster.kubectl("get", "configmap", dashboard["metadata"]["name"], "-n",
                                     namespace, "-o", "json").stdout)
    assert got["data"] == dashboard["data"]


def test_a_monitor_the_crd_refuses_is_reported(
        cluster: Cluster, helm: Helm, namespace: str, monitoring_crds: None) -> None:
    """The CRDs really check what is applied: a mistyped relabel action is refused."""
    docs = helm.template("bad", namespace, {"metrics": {"serviceMonitor": {
        "enabled": True, "relabelings": [{"action": "relabel", "targetLabel": "x"}]}}})
    monitor = one(docs, "ServiceMonitor")
    result = cluster.kubectl("apply", "--server-side", "--field-manager=chart-test", "-f", "-",
                             input=json.dumps(monitor), check=False)
    assert result.returncode != 0
    assert "action" in result.stderr and "Unsupported value" in result.stderr, result.stderr


# --------------------------------------------------------------------------- live series


def test_alert_and_dashboard_queries_name_only_exported_series(
        helm: Helm, operator: OperatorProcess, make_handler: Any, pods: Kubelet,
        cluster: Cluster, namespace: str,
        promql_check: Callable[[list[str]], list[dict[str, Any]]]) -> None:
    """Every series an alert or a dashboard query reads is on a live operator's /metrics
    once it has seen a run form, lose a member to a deleted pod and re-form."""
    names = ["m0", "m1", "m2"]
    for name in names:
        pods.create(name, "watched")
    nodes = [make_handler("watched", name, pod=name, min_nodes=2, max_nodes=3)
             for name in names]
    first = rendezvous_all(nodes)
    assert not {n: o.error for n, o in first.items() if o.error}
    pods.delete("m2")
    wait_for(lambda: metric(operator.metrics(), "elasticrun_members_lost_total",
                            run="watched", reason="PodDeleted") == 1, 15,
             "the deleted pod's member to be counted as lost")
    nodes[2].lease.stop_renewing()  # the dead node stops renewing, as it would
    second = rendezvous_all(nodes[:2])
    assert {o.rank for o in second.values()} == {0, 1}
    wait_for(lambda: metric(operator.metrics(), "elasticrun_round", run="watched") == 2,
             15, "the second round to be seen")
    text = operator.metrics()
    exported = exposed_names(text)
    exprs = queries(helm.template("r", "er-system", FULL), with_additional=True)
    parsed = promql_check(list(exprs.values()))
    # The names by Prometheus' parser, and by the tokenizer (the two agree: see below).
    read = {where: set(result["metrics"]) | metric_names(expr)
            for (where, expr), result in zip(exprs.items(), parsed, strict=True)}
    assert len(read) >= 10 and all(read.values()), read
    missing = {where: sorted(found - exported) for where, found in read.items()
               if found - exported}
    assert not missing, f"series not exported by the operator: {missing}"
    assert metric(text, "elasticrun_run_phase", run="watched", phase="Running") == 1
    assert metric(text, "elasticrun_run_phase", run="watched", phase="Degraded") == 0
    assert metric(text, "elasticrun_rounds_total", run="watched") >= 1
    # honorLabels keeps the series' own labels over the target's: they are only these,
    # and `namespace` is the run's real namespace, so no series can pass for another's.
    labels = {(key, value) for line in text.splitlines() if line.startswith("elasticrun_")
              for key, value in re.findall(r'([A-Za-z_][A-Za-z0-9_]*)="([^"]*)"', line)}
    assert {key for key, _ in labels} <= {"namespace", "run", "reason", "phase", "le"}
    assert {value for key, value in labels if key == "namespace"} == {namespace}
    # Every series the operator documents is used somewhere, the new phase series included.
    used = set().union(*read.values())
    assert {"elasticrun_run_phase", "elasticrun_waiting_nodes", "elasticrun_members_lost_total",
            "elasticrun_apiserver_reachable", "elasticrun_failure_detection_seconds_bucket",
            "elasticrun_round_duration_seconds_bucket"} <= used


def test_every_query_parses_and_the_tokenizer_reads_what_prometheus_reads(
        helm: Helm, promql_check: Callable[[list[str]], list[dict[str, Any]]]) -> None:
    """Prometheus' parser accepts every alert and dashboard query (the API server's CRD
    checks no PromQL), and names the same series as ``controlplane.promql``."""
    exprs = queries(helm.template("r", "er-system", FULL), with_additional=True)
    results = promql_check(list(exprs.values()))
    errors = {where: r["error"] for where, r in zip(exprs, results, strict=True)
              if r.get("error")}
    assert not errors, errors
    disagree = {where: (sorted(r["metrics"]), sorted(metric_names(expr)))
                for (where, expr), r in zip(exprs.items(), results, strict=True)
                if set(r["metrics"]) != metric_names(expr)}
    assert not disagree, disagree
    # The checker does report a broken expression and a misnamed series.
    broken, typo = promql_check(["max by (run) (elasticrun_waiting_nodes > 0",
                                 "max by (run) (elasticrun_waiting_node) > 0"])
    assert "unclosed left parenthesis" in broken["error"]
    assert typo["metrics"] == ["elasticrun_waiting_node"]
