"""The suite's own rules (tests/conftest.py): which tier a test is in, when a skip of a
node test fails the run, and ``consistently``."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from conftest import consistently, skip_fails_run, tier

TESTS = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(("path", "markers", "expected"), [
    ("unit/test_rounds.py", set(), "unit"),
    ("integration/test_operator.py", {"integration"}, "integration"),
    ("integration/test_chaos.py", {"integration", "slow"}, "e2e"),
    ("integration/test_torchrun.py", {"integration", "torchrun"}, "e2e"),
    ("integration/test_realnode.py", {"integration", "node", "slow"}, "e2e"),
    ("integration/test_realnode_launchers.py", {"node", "addons"}, "e2e"),
    ("integration/test_bench_quick.py", {"slow", "timeout"}, "e2e"),
])
def test_tier(path: str, markers: set[str], expected: str) -> None:
    assert tier(TESTS / path, markers) == expected



@pytest.mark.parametrize(("markers", "env", "euid", "fails"), [
    ({"node", "slow"}, {"CI": "true"}, 0, True),
    ({"addons"}, {"CI": "TRUE"}, 0, True),
    ({"node"}, {"CI": "true"}, 1000, False),  # not root: the node cannot run here
    ({"node"}, {}, 0, False),  # a developer's machine
    ({"node"}, {"CI": "false"}, 0, False),
    ({"slow"}, {"CI": "true"}, 0, False),  # not a claim about the node
    ({"torchrun"}, {"CI": "true"}, 0, False),
    (set(), {"CI": "true"}, 0, False),
])
def test_a_skip_fails_the_run_only_for_node_tests_under_ci_as_root(
        markers: set[str], env: dict[str, str], euid: int, fails: bool) -> None:
    assert skip_fails_run(markers, env, euid) is fails


def test_consistently_polls_for_the_whole_window() -> None:
    calls: list[float] = []
    started = time.monotonic()
    consistently(lambda: calls.append(time.monotonic()) or True, 0.3, "never", interval=0.05)
    assert time.monotonic() - started >= 0.3
    assert len(calls) >= 4 and calls[-1] - started >= 0.3  # looked again at the end


def test_consistently_fails_with_what_at_the_first_false() -> None:
    answers = iter([True, True, False])
    started = time.monotonic()
    with pytest.raises(AssertionError, match="a member was removed"):
        consistently(lambda: next(answers), 10, "a member was removed", interval=0.01)
    assert time.monotonic() - started < 1  # at once, not at the end of the window
