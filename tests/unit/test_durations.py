"""``make durations``: the page made from a JUnit report (tests/durations.py)."""

from __future__ import annotations

from pathlib import Path

import durations

#: pytest's own shape (xunit2), with the tier property conftest adds, and one case of an
#: older report without it.
REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites name="pytest tests"><testsuite name="pytest" errors="1" failures="1"
 skipped="1" tests="6" time="80.0">
<testcase classname="tests.unit.test_policy" name="test_a" time="0.250">
 <properties><property name="tier" value="unit"/></properties></testcase>
<testcase classname="tests.unit.test_policy" name="test_b[x]" time="0.050"/>
<testcase classname="tests.integration.test_operator" name="test_c" time="12.000">
 <properties><property name="tier" value="integration"/></properties>
 <failure message="boom">trace</failure></testcase>
<testcase classname="tests.integration.test_crd" name="test_d" time="3.000">
 <properties><property name="tier" value="integration"/></properties>
 <error message="fixture">trace</error></testcase>
<testcase classname="tests.integration.test_chaos" name="test_e" time="64.700">
 <properties><property name="tier" value="e2e"/></properties></testcase>
<testcase classname="tests.integration.test_realnode" name="test_f" time="0.001">
 <properties><property name="tier" value="e2e"/></properties>
 <skipped type="pytest.skip" message="needs root">skip</skipped></testcase>
</testsuite></testsuites>
"""


def test_cases_carry_tier_seconds_and_outcome() -> None:
    cases = {c.test: c for c in durations.parse(REPORT)}
    assert len(cases) == 6
    assert cases["tests.unit.test_policy::test_b[x]"] == durations.Case(
        "tests.unit.test_policy::test_b[x]", "unit", 0.05, "passed")  # tier from the folder
    assert [(c.tier, c.outcome) for c in cases.values()] == [
        ("unit", "passed"), ("unit", "passed"), ("integration", "failed"),
        ("integration", "error"), ("e2e", "passed"), ("e2e", "skipped")]


def test_the_page_has_totals_counts_and_the_slowest_first() -> None:
    page = durations.render(durations.parse(REPORT), ".reports/junit.xml", slowest=3)
    assert "| unit | 2 | 2 | 0 | 0 | 0.3s |" in page
    assert "| integration | 2 | 0 | 2 | 0 | 15.0s |" in page
    assert "| e2e | 2 | 1 | 0 | 1 | 1m05s |" in page
    assert "| **all** | 6 | 3 | 2 | 1 | 1m20s |" in page
    slowest = [line for line in page.splitlines() if line.startswith("| 1 |")
               or line.startswith("| 2 |") or line.startswith("| 3 |")]
    assert slowest == [
        "| 1 | 64.7 | e2e | `tests.integration.test_chaos::test_e` |",
        "| 2 | 12.0 | integration | `tests.integration.test_operator::test_c` |",
        "| 3 | 3.0 | integration | `tests.integration.test_crd::test_d` |",
    ]
    assert "The 3 slowest tests" in page


def test_main_writes_the_page_and_says_when_there_is_no_report(tmp_path: Path) -> None:
    report, page = tmp_path / "junit.xml", tmp_path / "page.md"
    assert durations.main(["--report", str(report), "--out", str(page)]) == 1
    report.write_text(REPORT)
    assert durations.main(["--report", str(report), "--out", str(page)]) == 0
    assert page.read_text().startswith("# Test durations\n")
    assert f"from `{report}`" in page.read_text()
