#!/usr/bin/env python3
"""Turn the chaos tests' measurements into docs/reliability.md.

    ELASTICRUN_RELIABILITY_JSON=/tmp/rel.jsonl make test \
        PYTEST_ARGS="tests/integration/test_chaos.py tests/integration/test_worst_moments.py \
                     tests/integration/test_bad_input.py tests/integration/test_security.py"
    python tests/reliability_report.py /tmp/rel.jsonl > docs/reliability.md

Each line of the input is one row recorded by ``chaoskit.record`` after a test
checked its outcome; a scenario recorded twice (a re-run) keeps its last row.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GROUPS = (("fault", "Faults"), ("bad input", "Bad input"), ("security", "Security"))
HEADER = """# Reliability and security under faults and bad input

Every row is a test against a real kube-apiserver and etcd on 127.0.0.1
(`tests/integration/test_chaos.py`, `test_worst_moments.py`, `test_bad_input.py`,
`test_security.py`):
the fault is injected for real (SIGKILL of node processes and of the operator,
the API server or etcd stopped and restarted, objects edited or deleted with
kubectl), the test asserts the outcome (ranks, world sizes, membership, error
types and messages, what the API server stored), and then records what it saw.
Liveness settings are shortened for the tests (heartbeat 2 s, Lease renewed every
1 s); with the defaults (15 s, 5 s) a silent node is detected 13 s later.

Recovery is measured in the test run, from the fault to the state named in the
row (for example: the survivors' next round formed, or the operator's repair
written). "Lost" is what any node or the stored ElasticRun lost: the goal is
nothing. Regenerate with `tests/reliability_report.py` (see its docstring).
"""


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render(rows: list[dict[str, object]], commit: str) -> str:
    latest: dict[str, dict[str, object]] = {}
    for row in rows:
        latest[str(row["scenario"])] = row
    out = [HEADER, f"Measured at commit `{commit}`.\n"]
    for group, title in GROUPS:
        chosen = [r for r in latest.values() if r.get("group", "fault") == group]
        if not chosen:
            continue
        out.append(f"## {title}\n")
        out.append("| scenario | fault | expected | observed | recovery | lost |")
        out.append("|---|---|---|---|---|---|")
        for r in chosen:
            seconds = r.get("recovery_seconds")
            recovery = f"{float(seconds):.2f} s" if isinstance(seconds, int | float) else "-"
            out.append("| " + " | ".join(_cell(r[k]) for k in (
                "scenario", "fault", "expected", "observed")) + f" | {recovery} | "
                f"{_cell(r.get('lost', 'nothing'))} |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="JSON lines written by the tests")
    parser.add_argument("--commit", default=None, help="commit measured (default: HEAD)")
    args = parser.parse_args(argv)
    rows = [json.loads(line) for line in args.results.read_text().splitlines() if line.strip()]
    if not rows:
        print(f"{args.results}: no measurements", file=sys.stderr)
        return 1
    commit = args.commit or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
        check=False).stdout.strip() or "unknown"
    sys.stdout.write(render(rows, commit))
    return 0


if __name__ == "__main__":
    sys.exit(main())
