"""The built wheel, installed in a fresh virtualenv, runs a torchrun round on the real API server.

Nothing of the checkout is on the agents' or the workers' path: they run the
fresh venv's interpreter, from a directory outside the checkout, with no
PYTHONPATH, and each reports where it imported elasticrun from. torchrun finds
the ``k8s`` backend through the entry point in the installed wheel's metadata.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from elasticrun.api.kube import runs_path
from elasticrun.api.model import parse_run

from conftest import ROOT, Cluster, ProcessGroup
from controlplane.procs import clean_env
from wheelkit import AGENT, WORKER, Dists, FreshVenv, build_dists, fresh_venv, reports

pytestmark = pytest.mark.torchrun


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> Dists:
    return build_dists(tmp_path_factory.mktemp("dists"))


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory, dists: Dists) -> Iterator[FreshVenv]:
    work = tmp_path_factory.mktemp("installed")
    yield fresh_venv(work / "venv", dists.wheel, work / "wheelhouse")


def test_the_operator_extra_installs_what_the_operator_image_checks(
        dists: Dists, tmp_path: Path) -> None:
    """operator/Dockerfile's build stage: `pip install .[operator]`, then its import check."""
    venv = fresh_venv(tmp_path / "venv", dists.wheel, tmp_path / "wheelhouse",
                      extras=("operator",), with_torch=False)
    check = ("import elasticrun.operator.webhook, elasticrun.api.crd as c; "
             "print(' '.join(m['metadata']['name'] for m in c.crd_manifests())); "
             "import elasticrun.operator.__main__ as m; print(m.__file__)")
    done = subprocess.run([str(venv.python), "-c", check], capture_output=True, text=True,
                          timeout=120, env=venv.env(), cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stderr
    names, main_file = done.stdout.strip().splitlines()
    # Both CRDs, read from the installed package's data (real files, not links).
    assert names.split() == ["elasticruns.elasticrun.dev", "elasticrunslices.elasticrun.dev"]
    assert Path(main_file).is_relative_to(venv.site_packages)
    entry = subprocess.run([str(venv.root / "bin" / "elasticrun-operator"), "--help"],
                           capture_output=True, text=True, timeout=120, env=venv.env(),
                           check=False)
    assert entry.returncode == 0, entry.stderr
    assert entry.stdout.startswith("usage: elasticrun-operator")


def test_the_fresh_venv_holds_the_wheel_and_none_of_the_checkout(installed: FreshVenv) -> None:
    done = subprocess.run(
        [str(installed.python), "-c",
         "import json, sys, elasticrun.handler, elasticrun.cli.main as m, yaml, kubernetes; "
         "from importlib.metadata import entry_points, distribution; "
         "print(json.dumps({'file': elasticrun.handler.__file__, 'path': sys.path, "
         "'eps': [e.value for e in entry_points(group='torchrun.handlers')], "
         "'installer': distribution('elasticrun').read_text('INSTALLER')}))"],
        capture_output=True, text=True, timeout=120, env=installed.env(), cwd=installed.root,
        check=False)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert Path(seen["file"]).is_relative_to(installed.site_packages)
    assert not any(p.startswith(str(ROOT)) for p in seen["path"]), seen["path"]
    assert seen["eps"] == ["elasticrun.handler:get_rendezvous_handler_creator"]
    assert seen["installer"].strip() == "pip"
    # The console scripts pip wrote run the installed package.
    plugin = subprocess.run([str(installed.root / "bin" / "kubectl-elasticrun"), "--help"],
                            capture_output=True, text=True, timeout=60, env=installed.env(),
                            check=False)
    assert plugin.returncode == 0 and "usage: kubectl elasticrun" in plugin.stdout


def test_torchrun_from_the_installed_wheel_forms_a_round_of_two(
        installed: FreshVenv, cluster: Cluster, namespace: str, processes: ProcessGroup,
        tmp_path: Path) -> None:
    (tmp_path / "agent.py").write_text(AGENT)
    (tmp_path / "worker.py").write_text(WORKER)
    env = {**clean_env(), **installed.env(), "KUBECONFIG": str(cluster.kubeconfig),
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("PYTHONPATH", None)
    agents = {}
    for node in ("node-0", "node-1"):
        conf = f"namespace={namespace},node_name={node},last_call_timeout=2,lease_interval=1"
        argv = [str(installed.python), str(tmp_path / "agent.py"), "--nnodes=2",
                "--nproc-per-node=1", "--rdzv-backend=k8s", "--rdzv-id=wheel",
                f"--rdzv-conf={conf}", "--monitor-interval=0.1", "--local-addr=127.0.0.1",
                str(tmp_path / "worker.py")]
        log = open(tmp_path / f"{node}.log", "w")  # noqa: SIM115 - closed with the process
        agents[node] = (processes.start(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                        cwd=tmp_path), log)
    for node, (proc, log) in agents.items():
        code = proc.wait(timeout=240)
        log.close()
        assert code == 0, (node, (tmp_path / f"{node}.log").read_text()[-3000:])
    text = {n: (tmp_path / f"{n}.log").read_text() for n in agents}
    workers = [w for n in agents for w in reports(text[n], "WORKER")]
    assert sorted(w["rank"] for w in workers) == [0, 1]
    assert {w["world_size"] for w in workers} == {2}
    assert {w["sum"] for w in workers} == {3}   # 1 + 2: the all_reduce went through
    for worker in workers:
        assert all(Path(f).is_relative_to(installed.site_packages) for f in worker["files"])
        assert not any(p.startswith(str(ROOT)) for p in worker["path"]), worker["path"]
    # The agents loaded the handler (through the entry point) from the fresh venv too.
    loaded = [a for n in agents for a in reports(text[n], "AGENT")]
    assert len(loaded) == 2
    for modules in loaded:
        assert all(f is not None and Path(f).is_relative_to(installed.site_packages)
                   for f in modules.values()), modules
    run = parse_run(cluster.client.request("GET", f"{runs_path(namespace)}/wheel"))
    assert run.status.round >= 1
    assert {m.name for m in run.status.lost_members} | run.status.member_names \
        == {"node-0", "node-1"}
