"""The metric-name reader the chart's monitoring tests compare with a live /metrics."""

from __future__ import annotations

import pytest

from controlplane.promql import exposed_names, grafana_promql, grafana_query_names, metric_names


@pytest.mark.parametrize(("expr", "names"), [
    ("up", {"up"}),
    ('elasticrun_apiserver_reachable == 0', {"elasticrun_apiserver_reachable"}),
    ('max by (namespace, run) (elasticrun_run_phase{phase="Degraded"}) == 1',
     {"elasticrun_run_phase"}),
    # Aggregation clause after the expression; label lists never count as names.
    ("sum(rate(a_total[5m])) without (reason, le) / on (namespace) group_left (run) b",
     {"a_total", "b"}),
    ("(max by (namespace, run) (w) > 0 unless on (namespace, run) max(p) == 1)\n"
     "or on (namespace, run) max by (namespace, run) (q{x=~\"a|b\"}) == 1", {"w", "p", "q"}),
    # Strings, matchers with braces and commas in values, offsets, numbers, durations.
    ('x{a="}", b=~"(c,d)"} offset 5m > 1e+3 and y @ start() unless z[1h:30s] bool < Inf',
     {"x", "y", "z"}),
    ('{__name__="named_by_matcher", job="j"}', {"named_by_matcher"}),
    # Grafana variables inside and outside brackets.
    ('histogram_quantile(0.95, max by (le) (rate(h_bucket{run=~"$run"}[$__rate_interval])))',
     {"h_bucket"}),
    ("rate(c_total[${__range}]) * $factor", {"c_total"}),
    ("# just a comment\nvec:recorded:rule", {"vec:recorded:rule"}),
    ("", set()),
    ('unterminated{a="', {"unterminated"}),
])
def test_metric_names(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_grafana_label_values_names_only_its_series() -> None:
    assert grafana_query_names("label_values(elasticrun_round, namespace)") == {
        "elasticrun_round"}
    assert grafana_query_names('label_values(m{namespace=~"$namespace", a=","}, run)') == {"m"}
    assert grafana_query_names("label_values(namespace)") == set()
    assert grafana_query_names("sum(x)") == {"x"}


def test_grafana_queries_become_plain_promql() -> None:
    assert grafana_promql('rate(x{run=~"$run"}[$__rate_interval]) / ${__range}') == \
        'rate(x{run=~"$run"}[5m]) / 5m'
    assert grafana_promql('label_values(m{a=","}, run)') == 'm{a=","}'
    assert grafana_promql("label_values(namespace)") is None


def test_exposed_names_reads_the_text_format() -> None:
    text = ("# HELP a_total Things.\n# TYPE a_total counter\n"
            'a_total{namespace="n",run="r"} 1.0\na_created{namespace="n"} 1.7e9\n'
            'h_bucket{le="+Inf"} 2\nplain 0\n\n')
    assert exposed_names(text) == {"a_total", "a_created", "h_bucket", "plain"}
