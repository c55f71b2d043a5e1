"""values.schema.json: a mistyped value fails helm with the path and what was wanted.

Helm validates the merged values against the schema before it renders or talks
to the cluster, for install, upgrade, template and lint alike; ``helm install``
is run here against the real API server to show that nothing is created. The
free maps (labels, annotations, relabelings, resources, affinity) take any keys.
"""

from __future__ import annotations

import json
import re
import tarfile
from pathlib import Path

import pytest
import yaml

from chartkit import CHART, Helm
from conftest import ROOT, Cluster

#: The fixtures helm, helm_binary and extra_namespace.
pytest_plugins = ("chartfixtures",)

#: (--set argument, the path helm names, what the schema says of it)
MISTYPED = [
    ("operator.replicas=two", "/operator/replicas", "got string, want integer"),
    ("operator.replicas=0", "/operator/replicas", "minimum: got 0, want 1"),
    ("operator.scope=all", "/operator/scope", "value must be one of 'cluster', 'namespaces'"),
    ("webhook.failurePolicy=fail", "/webhook/failurePolicy",
     "value must be one of 'Fail', 'Ignore'"),
    ("webhook.port=99999", "/webhook/port", "maximum: got 99,999, want 65,535"),
    ("crds.install=yes", "/crds/install", "got string, want boolean"),
    ("image.pullPolicy=sometimes", "/image/pullPolicy",
     "value must be one of 'Always', 'IfNotPresent', 'Never'"),
    ("image.digest=latest", "/image/digest", "'latest' does not match pattern"),
    ("trainingNamespaces[0]=Team_A", "/trainingNamespaces/0",
     "'Team_A' does not match pattern"),
    ("trainingNamespace=a", "", "additional properties 'trainingNamespace' not allowed"),
    ("webhook.failurPolicy=Fail", "/webhook", "additional properties 'failurPolicy' not allowed"),
    ("certManager.duration=90days", "/certManager/duration",
     "'90days' does not match pattern"),
    # The operator block, its leader election, PodDisruptionBudget and NetworkPolicy.
    ("operator.replica=2", "/operator", "additional properties 'replica' not allowed"),
    ("operator.livenessProbe.periodSeconds=0", "/operator/livenessProbe/periodSeconds",
     "minimum: got 0, want 1"),
    ("operator.leaderElection.leaseDuration=fifteen", "/operator/leaderElection/leaseDuration",
     "'fifteen' does not match pattern"),
    ("operator.leaderElection.renewDeadline=7200", "/operator/leaderElection/renewDeadline",
     "maximum: got 7,200, want 3,600"),
    ("operator.leaderElection.enable=true", "/operator/leaderElection",
     "additional properties 'enable' not allowed"),
    ("operator.podDisruptionBudget.minAvailable=half",
     "/operator/podDisruptionBudget/minAvailable", "'half' does not match pattern"),
    ("operator.podDisruptionBudget.minAvailable=-1",
     "/operator/podDisruptionBudget/minAvailable", "minimum: got -1, want 0"),
    ("operator.networkPolicy.enabled=on", "/operator/networkPolicy/enabled",
     "got string, want boolean"),
    ("operator.networkPolicy.metricsFrom[0].podSelecter.x=y",
     "/operator/networkPolicy/metricsFrom/0", "additional properties 'podSelecter' not allowed"),
    # Node warnings.
    ("nodeSignals.enabled=yes", "/nodeSignals/enabled", "got string, want boolean"),
    ("nodeSignals.signals[0].kind=annotation", "/nodeSignals/signals/0/kind",
     "value must be one of 'taint', 'label', 'condition'"),
    ("nodeSignals.signals[0].kind=taint", "/nodeSignals/signals/0",
     "missing properties 'key', 'policy'"),
    # Ranks by topology.
    ("rankOrder.topologyKeys={a,b,c,d,e}", "/rankOrder/topologyKeys", "maxItems: got 5, want 4"),
    ("rankOrder.topologyKey=zone", "/rankOrder",
     "additional properties 'topologyKey' not allowed"),
    # The monitoring kit.
    ("metrics.prometheus.enabled=true", "/metrics",
     "additional properties 'prometheus' not allowed"),
    ("metrics.service.port=0", "/metrics/service/port", "minimum: got 0, want 1"),
    ("metrics.serviceMonitor.enabled=yes", "/metrics/serviceMonitor/enabled",
     "got string, want boolean"),
    ("metrics.serviceMonitor.interval=30", "/metrics/serviceMonitor/interval",
     "got number, want string"),
    ("metrics.podMonitor.scrapeTimeout=10 s", "/metrics/podMonitor/scrapeTimeout",
     "'10 s' does not match pattern"),
    ("metrics.podMonitor.honorLabels=maybe", "/metrics/podMonitor/honorLabels",
     "got string, want boolean"),
    ("metrics.prometheusRule.stalledFor=ten", "/metrics/prometheusRule/stalledFor",
     "'ten' does not match pattern"),
    ("metrics.prometheusRule.membersLost.threshold=-1",
     "/metrics/prometheusRule/membersLost/threshold", "minimum: got -1, want 0"),
    ("metrics.prometheusRule.runbookBaseURL=docs", "/metrics/prometheusRule/runbookBaseURL",
     "'docs' does not match pattern"),
    ("metrics.prometheusRule.additionalRules[0].alert=X",
     "/metrics/prometheusRule/additionalRules/0", "missing property 'expr'"),
    ("metrics.dashboard.enabld=true", "/metrics/dashboard",
     "additional properties 'enabld' not allowed"),
    ("metrics.dashboard.label=a/b/c", "/metrics/dashboard/label",
     "'a/b/c' does not match pattern"),
]


@pytest.mark.parametrize(("setting", "where", "message"), MISTYPED,
                         ids=[m[0] for m in MISTYPED])
def test_a_mistyped_value_fails_template_with_the_schemas_message(
        helm: Helm, setting: str, where: str, message: str) -> None:
    done = helm.run("template", "r", str(CHART), "--set", setting, check=False)
    assert done.returncode == 1
    assert "values don't meet the specifications of the schema" in done.stderr
    assert f"- at '{where}': {message}" in done.stderr, done.stderr
    assert done.stdout == ""


def test_helm_install_with_a_mistyped_value_fails_and_creates_nothing(
        helm: Helm, cluster: Cluster, namespace: str) -> None:
    done = helm.run("install", "typo", str(CHART), "-n", namespace,
                    "--set", "operator.replicas=two", check=False, timeout=60)
    assert done.returncode == 1
    assert "- at '/operator/replicas': got string, want integer" in done.stderr, done.stderr
    listed = helm.run("list", "-n", namespace, "-a", "-o", "json")
    assert json.loads(listed.stdout) == []
    assert cluster.kubectl("get", "deployments,serviceaccounts", "-n", namespace,
                           "-l", "app.kubernetes.io/instance=typo", "-o", "name").stdout == ""


@pytest.mark.parametrize("values", [
    ROOT / "charts" / "elasticrun" / "values.yaml",
    ROOT / "deploy" / "local" / "values.yaml",
], ids=["defaults", "local"])
def test_the_committed_values_meet_the_schema(helm: Helm, values: Path) -> None:
    helm.run("template", "r", str(CHART), "-f", str(values))


#: Documents whose ```yaml blocks of chart values (a top-level key of values.yaml) are examples.
DOCUMENTED = ["charts/elasticrun/README.md", "README.md", "docs/integrations.md"]


def documented_values() -> list[tuple[str, str]]:
    """Every ```yaml block of DOCUMENTED whose keys are all top-level keys of values.yaml."""
    keys = set(yaml.safe_load((CHART / "values.yaml").read_text()))
    found = []
    for name in DOCUMENTED:
        for block in re.findall(r"^```yaml\n(.*?)^```", (ROOT / name).read_text(), re.M | re.S):
            loaded = yaml.safe_load(block)
            if isinstance(loaded, dict) and loaded and set(loaded) <= keys:
                found.append((name, block))
    return found


def test_the_documented_values_are_found() -> None:
    """The monitoring and node-signal examples are among the blocks checked below."""
    tops = {next(iter(yaml.safe_load(block))) for _, block in documented_values()}
    assert {"metrics", "nodeSignals"} <= tops


@pytest.mark.parametrize(("document", "block"), documented_values(),
                         ids=[f"{d}:{next(iter(yaml.safe_load(b)))}"
                              for d, b in documented_values()])
def test_the_documented_values_meet_the_schema(helm: Helm, tmp_path: Path, document: str,
                                               block: str) -> None:
    values = tmp_path / "values.yaml"
    values.write_text(block)
    helm.run("template", "r", str(CHART), "-f", str(values))


def test_every_documented_key_is_in_the_schema() -> None:
    """values.yaml and the schema name the same keys (the open objects aside)."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def walk(value: object, node: dict[str, object], path: str) -> None:
        props = node.get("properties")
        if not isinstance(value, dict) or not isinstance(props, dict):
            return
        assert set(value) <= set(props), f"{path}: {set(value) - set(props)} not in the schema"
        for key, sub in value.items():
            walk(sub, props[key], f"{path}.{key}")   # type: ignore[arg-type]

    walk(values, schema, "values")


def test_the_free_maps_take_any_key(helm: Helm) -> None:
    helm.run("template", "r", str(CHART),
             "--set", "metrics.serviceMonitor.enabled=true",
             "--set", "metrics.serviceMonitor.labels.release=kube-prometheus-stack",
             "--set", "metrics.serviceMonitor.relabelings[0].action=drop",
             "--set", "operator.resources.limits.cpu=1",
             "--set", "operator.affinity.nodeAffinity.x=y",
             "--set", "operator.leaderElection.retryPeriod=1.5")


def test_helm_package_carries_the_schema_and_real_files_and_warns_of_nothing(
        helm: Helm, tmp_path: Path) -> None:
    # Nothing on stderr: helm reports a symbolic link in the chart there on every run.
    assert helm.run("template", "r", str(CHART)).stderr == ""
    done = helm.run("package", str(CHART), "--destination", str(tmp_path))
    assert done.stderr == "", done.stderr
    (archive,) = tmp_path.glob("elasticrun-*.tgz")
    with tarfile.open(archive) as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert members["elasticrun/values.schema.json"].isfile()
        for name in ("files/crds/elasticrun.dev_elasticruns.yaml",
                     "files/crds/elasticrun.dev_elasticrunslices.yaml",
                     "files/admission/elasticrun-leases.yaml"):
            assert members[f"elasticrun/{name}"].isfile()
    linted = helm.run("lint", "--strict", str(archive))
    assert "0 chart(s) failed" in linted.stdout
    assert "WARNING" not in linted.stdout and linted.stderr == "", linted.stderr
    refused = helm.run("template", "r", str(archive), "--set", "operator.replicas=two",
                       check=False)
    assert "- at '/operator/replicas': got string, want integer" in refused.stderr
