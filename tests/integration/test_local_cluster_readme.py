"""The README's "Local cluster" walkthrough, typed as written, in order.

The commands are read from the README's first ``bash`` block under
``## Local cluster`` and run in one bash session from the checkout, with
``.venv/bin`` first on ``PATH`` (where ``make setup`` puts ``kubectl``).  One
adaptation: the walkthrough's ``kubectl ... get er ... -w`` watches forever, so
the test stops watching at the first ``Succeeded`` (bounded).  The cluster is
the README's own, in ``.cluster/``: the test is skipped if one is running there
already, and stops it at the end whatever happens.  There is one node cluster
per machine (port 443), so this file sorts before ``test_realnode*.py``, whose
session cluster holds the port until the session ends.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = [pytest.mark.node, pytest.mark.slow]
README = ROOT / "README.md"
CLUSTER_DIR = ROOT / ".cluster"
WATCH_TIMEOUT = 400
NOT_IN_A_USERS_SHELL = {"KUBECONFIG", "CONTROLPLANE_BIN", "RUNTIME_BIN", "MAKEFLAGS",
                        "MAKELEVEL", "MFLAGS", "ELASTICRUN_TEST_KUBECONFIG"}


def walkthrough() -> list[str]:
    """The command lines of the README's Local cluster block (continuations joined)."""
    text = README.read_text()
    section = text.split("\n## Local cluster\n", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "README's Local cluster section has no bash block"
    return block.group(1).replace("\\\n", " ").strip().splitlines()


def bounded(line: str) -> str:
    """A watching command, stopped at the first Succeeded line it prints.

    A watch that ends before it (kubectl's ``get -w`` exits on a 410 when its
    list predates the server's watch cache) is started again, as its user
    would type it again, until ``WATCH_TIMEOUT``.
    """
    if not re.search(r"\s-w(\s|$)", line.split("#", 1)[0]):
        return line
    command = line.split("#", 1)[0].strip()
    # The watch never ends by itself: read it until Succeeded, then stop it by its PID.
    return (f"found=0; end=$((SECONDS + {WATCH_TIMEOUT}))\n"
            'while [ $found = 0 ] && [ $SECONDS -lt $end ]; do\n'
            f'  exec {{fd}}< <(exec timeout $((end - SECONDS)) {command} 2>&1); pid=$!\n'
            '  while IFS= read -r row <&"$fd"; do echo "$row"; '
            'case $row in *Succeeded*) found=1; break;; esac; done\n'
            '  exec {fd}<&-; kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true\n'
            '  [ $found = 1 ] || sleep 1\n'
            'done\n'
            f"[ $found = 1 ] || {{ echo 'no Succeeded within {WATCH_TIMEOUT}s'; false; }}")


def port_busy(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def test_the_readme_local_cluster_walkthrough_runs_as_typed(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("the local node needs root (a mount namespace, cgroups)")
    if (CLUSTER_DIR / "state.json").exists() or port_busy(443):
        pytest.skip("a node cluster is running already (.cluster or port 443); the "
                    "walkthrough needs its own")
    lines = walkthrough()
    assert lines[0].startswith("make cluster") and lines[-1].startswith("make cluster-down")
    script = "set -euo pipefail\n" + "".join(
        f"echo '+ {line.split('#', 1)[0].strip()}'\n{bounded(line)}\n" for line in lines)
    # A user's shell: none of the variables `make test` sets for pytest (a Makefile
    # variable that came from the environment is exported again to the nested make).
    env = {k: v for k, v in os.environ.items() if k not in NOT_IN_A_USERS_SHELL}
    env["PATH"] = f"{ROOT / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["HOME"] = env.get("HOME", str(tmp_path))
    try:
        result = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, text=True, check=False,
                                capture_output=True, timeout=1200)
    finally:
        subprocess.run(["make", "cluster-down"], cwd=ROOT, env=env, capture_output=True,
                       check=False, timeout=180)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-6000:]
    assert re.search(r"elasticrun-node\s+Ready", result.stdout), out[-3000:]
    assert "pod/elasticrun-smoke created" in result.stdout, out[-3000:]
    assert re.search(r"llama-job .*Succeeded", result.stdout), out[-3000:]
    assert not (CLUSTER_DIR / "state.json").exists()
