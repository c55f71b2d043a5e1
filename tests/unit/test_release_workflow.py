"""The release workflow: actionlint finds nothing in it, and it publishes what the README says.

actionlint is built from its Go module (tests/actionlint/build.sh, cached like
helm). It checks the workflow's syntax, expressions and contexts, job `needs`,
and the inputs of the well-known actions used here against their metadata.
shellcheck and pyflakes are turned off so the result is the same on every
machine (neither is installed here).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / ".github" / "workflows" / "release.yaml"


@pytest.fixture(scope="module")
def actionlint() -> Path:
    done = subprocess.run(["bash", str(ROOT / "tests" / "actionlint" / "build.sh")],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    return Path(done.stdout.strip())


def lint(actionlint: Path, *files: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(actionlint), "-no-color", "-oneline", "-shellcheck=",
                           "-pyflakes=", *map(str, files)], capture_output=True, text=True,
                          timeout=120, check=False, cwd=ROOT)


@pytest.fixture(scope="module")
def workflow() -> dict[Any, Any]:
    loaded: dict[Any, Any] = yaml.safe_load(WORKFLOW.read_text())
    return loaded


def test_actionlint_finds_nothing_in_the_workflows(actionlint: Path) -> None:
    files = sorted((ROOT / ".github" / "workflows").glob("*.y*ml"))
    assert WORKFLOW in files
    done = lint(actionlint, *files)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


@pytest.mark.parametrize(("old", "new", "complaint"), [
    ("needs: dists\n", "needs: dist\n", 'job "pypi" needs job "dist" which does not exist'),
    ("          tags: ${{", "          tag: ${{", 'input "tag" is not defined in action'),
    ("${{ needs.version.outputs.version }}", "${{ needs.version.outputs.release }}",
     'property "release" is not defined'),
])
def test_actionlint_reports_a_broken_copy(actionlint: Path, tmp_path: Path, old: str, new: str,
                                          complaint: str) -> None:
    """The linter really runs: each mistake in a copy is reported."""
    text = WORKFLOW.read_text()
    assert old in text
    broken = tmp_path / ".github" / "workflows" / "release.yaml"
    broken.parent.mkdir(parents=True)
    broken.write_text(text.replace(old, new, 1))
    done = lint(actionlint, broken)
    assert done.returncode == 1
    assert complaint in done.stdout, done.stdout


def test_it_runs_on_version_tags_with_read_only_defaults(workflow: dict[Any, Any]) -> None:
    # PyYAML reads the key `on` as True.
    assert workflow[True] == {"push": {"tags": ["v*.*.*"]}}
    assert workflow["permissions"] == {"contents": "read"}


def test_pypi_uses_trusted_publishing_and_no_token(workflow: dict[Any, Any]) -> None:
    job = workflow["jobs"]["pypi"]
    assert job["permissions"] == {"id-token": "write"}
    assert job["environment"]["name"] == "pypi"
    (publish,) = [s for s in job["steps"] if s.get("uses", "").startswith(
        "pypa/gh-action-pypi-publish@")]
    assert "with" not in publish, "trusted publishing needs no password or token input"
    dists = workflow["jobs"]["dists"]["steps"]
    assert any(s.get("run", "").startswith("python -m build") for s in dists)


def test_both_images_are_built_from_their_dockerfiles(workflow: dict[Any, Any]) -> None:
    job = workflow["jobs"]["images"]
    images = {m["image"]: m["dockerfile"] for m in job["strategy"]["matrix"]["include"]}
    assert images == {"elasticrun-operator": "operator/Dockerfile",
                      "elasticrun-trainer": "deploy/examples/Dockerfile"}
    assert all((ROOT / f).is_file() for f in images.values())
    assert job["permissions"]["packages"] == "write"


def test_the_chart_is_pushed_as_an_oci_artifact_naming_the_published_images(
        workflow: dict[Any, Any]) -> None:
    runs = "\n".join(s.get("run", "") for s in workflow["jobs"]["chart"]["steps"])
    assert re.search(r'helm push "elasticrun-\$VERSION\.tgz" "oci://\$REGISTRY/', runs)
    assert "helm lint --strict charts/elasticrun" in runs
    # The two sed patterns each match exactly one line of the chart's values.
    values = (ROOT / "charts" / "elasticrun" / "values.yaml").read_text().splitlines()
    for pattern in (r"^  repository: elasticrun-operator$", r"^  image: elasticrun-trainer:[^ ]+$"):
        assert pattern.replace("$", "\\$") in runs
        assert len([v for v in values if re.match(pattern, v)]) == 1, pattern


def test_the_version_check_reads_what_the_files_hold() -> None:
    """The workflow's sed expressions find the version in pyproject and Chart.yaml."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    chart = (ROOT / "charts" / "elasticrun" / "Chart.yaml").read_text()
    (package,) = re.findall(r'(?m)^version = "([^"]+)"$', pyproject)
    (version,) = re.findall(r"(?m)^version: ([^ ]+)$", chart)
    (app,) = re.findall(r'(?m)^appVersion: "([^"]+)"$', chart)
    assert package == version == app
