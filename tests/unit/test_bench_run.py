"""``make bench``'s harness (bench/run.py): the sections a whole run carries over."""

from __future__ import annotations

import json
from pathlib import Path

from bench import run


def test_a_whole_make_bench_keeps_the_sections_measured_alone(tmp_path: Path) -> None:
    """``--only resize`` columns survive a whole run, which does not measure them: the page
    it renders keeps its Resize section, each column with its own commit."""
    path = tmp_path / "benchmarks.json"
    assert run.measured_alone(path) == {}
    resize = {"after": {"commit": "abc1234", "backends": {}}}
    path.write_text(json.dumps({"commit": "old", "backends": {"k8s": {}}, "resize": resize}))
    assert run.measured_alone(path) == {"resize": resize}
    path.write_text(json.dumps({"commit": "old", "backends": {}}))
    assert run.measured_alone(path) == {}
