"""The suite's own layout: rules that otherwise only a whole-suite run would find."""

from __future__ import annotations

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
