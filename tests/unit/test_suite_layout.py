"""The suite's own layout: rules that otherwise only a whole-suite run would find."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_module_has_a_name_of_its_own() -> None:
    """pytest imports test modules by basename (there are no ``__init__.py`` files), so two
    ``test_x.py`` in ``unit/`` and ``integration/`` stop the whole suite at collection; a
    targeted run of either one never shows it."""
    names = Counter(path.name for path in TESTS.rglob("test_*.py")
                    if ".venv" not in path.parts)
    assert sorted(name for name, count in names.items() if count > 1) == []


def _imported(path: Path) -> set[str]:
    """The top-level names of the modules ``path`` imports (anywhere in it)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def _sources(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*.py") if ".venv" not in p.parts and "go" not in p.parts]


def test_test_modules_share_helpers_through_kits_never_through_each_other() -> None:
    """A helper two test modules need lives in a kit (``tests/unit/builders.py``, ``rdzv``,
    ``nodekit``...), so a test module stays free to change its own helpers."""
    found = {f"{p.relative_to(TESTS)} imports {name}" for p in _sources(TESTS)
             for name in _imported(p) if name.startswith("test_")}
    assert sorted(found) == []


def test_tests_and_benchmarks_share_the_test_bed_not_each_other() -> None:
    """What both need is in ``controlplane`` (or the product): tests import ``bench`` only
    to test bench's own code, and bench imports no test module."""
    bench_tests = {p for p in (TESTS / "unit").glob("test_bench_*.py")}
    found = {str(p.relative_to(TESTS)) for p in _sources(TESTS)
             if "bench" in _imported(p) and p not in bench_tests}
    assert sorted(found) == []
    test_modules = {p.stem for folder in (TESTS, TESTS / "unit", TESTS / "integration")
                    for p in folder.glob("*.py")}
    bench = TESTS.parent / "bench"
    found = {f"{p.relative_to(bench)} imports {name}" for p in _sources(bench)
             for name in _imported(p) & test_modules}
    assert sorted(found) == []


def test_the_operator_the_tests_start_runs_this_checkouts_code() -> None:
    """``OperatorProcess`` puts the checkout this process imports ``elasticrun`` from first
    on the operator's path, whichever checkout a shared virtualenv's editable install names."""
    from conftest import ROOT
    from controlplane import operatorproc

    assert operatorproc._sources() == [str(ROOT / "handler"), str(ROOT / "operator")]
