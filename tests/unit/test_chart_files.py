"""The chart's files/ are copies of deploy/, never links, and never stale.

deploy/ is the one source of the CRDs and the admission policy (kubectl apply,
the wheel). The chart reads its own copies because helm warns about symbolic
links on every render and a chart pulled from a registry holds only what was
packaged; `make chart-files` refreshes them.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FILES = ROOT / "charts" / "elasticrun" / "files"


def _listed() -> list[str]:
    """The copies the Makefile's chart-files target makes."""
    (line,) = [ln for ln in (ROOT / "Makefile").read_text().splitlines()
               if ln.startswith("CHART_FILES :=")]
    return line.split(":=", 1)[1].split()


@pytest.mark.parametrize("name", _listed())
def test_each_chart_file_is_a_real_copy_of_its_source(name: str) -> None:
    copy, source = FILES / name, ROOT / "deploy" / name
    assert not copy.is_symlink(), f"{copy} is a link: run `make chart-files`"
    assert copy.read_bytes() == source.read_bytes(), \
        f"{copy.relative_to(ROOT)} differs from deploy/{name}: run `make chart-files`"


def test_the_chart_reads_only_files_the_target_copies() -> None:
    read = set()
    for template in (ROOT / "charts" / "elasticrun" / "templates").glob("*"):
        # A path the template reads: ``.Files.Get "files/..."``, or an item of a
        # list it ranges over (the CRDs); a fail message is never a bare quoted path.
        read |= set(re.findall(r'"files/([^"\s]+)"', template.read_text()))
    on_disk = {str(p.relative_to(FILES)) for p in FILES.rglob("*") if not p.is_dir()}
    assert read == set(_listed()) == on_disk


def test_every_crd_in_deploy_is_copied_into_the_chart() -> None:
    crds = {f"crds/{p.name}" for p in (ROOT / "deploy" / "crds").glob("*.yaml")}
    assert crds == {"crds/elasticrun.dev_elasticruns.yaml",
                    "crds/elasticrun.dev_elasticrunslices.yaml"}
    assert crds <= set(_listed())
