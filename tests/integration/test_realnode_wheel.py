"""On the real node, a Job's pods run torchrun from the built wheel, not from the checkout.

The local image runs whatever the node mounts at ``/opt/elasticrun/project``
(the checkout, read-only) with the checkout's sources on its PYTHONPATH. Here
the wheel is installed into a fresh venv inside the checkout (so the node's
mount carries it to the pods, at the same absolute path), and the Job's
container runs that venv's interpreter with PYTHONPATH emptied: the agent
loads the handler through the installed wheel's entry point, and every
process reports the file it imported elasticrun from. The webhook (the chart's
operator, a pod) configures the pods as for any Job.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from elasticrun.api.model import parse_run

from conftest import ROOT, Cluster, wait_for
from controlplane import localize
from wheelkit import AGENT, WORKER, FreshVenv, build_dists, fresh_venv, reports

pytest_plugins = ("nodefixtures",)
pytestmark = [pytest.mark.node, pytest.mark.torchrun]

#: Inside the checkout: the only host directory besides /usr that pods see.
VENV = ROOT / ".wheel-venv"
RUN = "from-wheel"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FreshVenv]:
    work = tmp_path_factory.mktemp("wheel")
    shutil.rmtree(VENV, ignore_errors=True)
    dists = build_dists(work / "build")
    venv = fresh_venv(VENV, dists.wheel, work / "wheelhouse")
    (VENV / "agent.py").write_text(AGENT)
    (VENV / "worker.py").write_text(WORKER)
    try:
        yield venv
    finally:
        shutil.rmtree(VENV, ignore_errors=True)


def job(venv: FreshVenv, volumes: Path) -> list[dict[str, Any]]:
    """deploy/examples/job.yaml on the local node, its container running the wheel's venv."""
    docs = localize.localize(localize.load(ROOT / "deploy" / "examples" / "job.yaml"), volumes)
    (workload,) = [d for d in docs if d["kind"] == "Job"]
    workload["metadata"]["name"] = RUN
    template = workload["spec"]["template"]
    template["metadata"]["labels"]["elasticrun.dev/run"] = RUN
    template["metadata"]["annotations"]["elasticrun.dev/nnodes"] = "2"
    template["metadata"]["annotations"]["elasticrun.dev/nproc-per-node"] = "1"
    container = template["spec"]["containers"][0]
    container["command"] = [str(venv.python), str(VENV / "agent.py"), str(VENV / "worker.py")]
    # The image's PYTHONPATH names the checkout's sources: empty it.
    container["env"] = [*container.get("env", []), {"name": "PYTHONPATH", "value": ""},
                        {"name": "PATH", "value": f"{venv.root / 'bin'}:/usr/bin:/bin"}]
    return docs


def test_a_job_runs_its_round_from_the_wheel(node_cluster: Cluster, node_namespace: str,
                                            installed: FreshVenv) -> None:
    ns = node_namespace
    volumes = Path(node_cluster.require_local().dir) / "node" / "volumes" / ns
    node_cluster.kubectl("apply", "-n", ns, "-f", "-",
                         input=yaml.safe_dump_all(job(installed, volumes)))

    def finished() -> str | None:
        got = node_cluster.client.request("GET", f"/apis/batch/v1/namespaces/{ns}/jobs/{RUN}")
        for c in (got.get("status") or {}).get("conditions") or []:
            if c["type"] in ("Complete", "Failed") and c["status"] == "True":
                return str(c["type"])
        return None

    state = wait_for(finished, 300, "the Job to finish", interval=1)
    pods = node_cluster.client.request("GET", f"/api/v1/namespaces/{ns}/pods",
                                       query={"labelSelector": f"job-name={RUN}"})["items"]
    text = {p["metadata"]["name"]: node_cluster.kubectl(
        "logs", "-n", ns, p["metadata"]["name"], check=False).stdout for p in pods}
    assert state == "Complete", text
    # One try each: both pods succeeded the first time.
    assert sorted(p["status"]["phase"] for p in pods) == ["Succeeded", "Succeeded"], text
    workers = [w for log in text.values() for w in reports(log, "WORKER")]
    assert sorted(w["rank"] for w in workers) == [0, 1], text
    assert {w["world_size"] for w in workers} == {2}
    assert {w["sum"] for w in workers} == {3}
    for worker in workers:
        assert all(Path(f).is_relative_to(installed.site_packages) for f in worker["files"])
        # Nothing of the checkout's sources (the image's PYTHONPATH names them).
        assert not any(Path(p).name in ("handler", "operator") for p in worker["path"]), \
            worker["path"]
    agents = [a for log in text.values() for a in reports(log, "AGENT")]
    assert len(agents) == 2, text
    for modules in agents:
        assert all(f is not None and Path(f).is_relative_to(installed.site_packages)
                   for f in modules.values()), modules
    # The pods were the webhook's: torchrun took its rendezvous from the injected PET_*.
    pod = pods[0]
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["PET_RDZV_BACKEND"] == "k8s" and env["PET_RDZV_ID"] == RUN
    run = parse_run(node_cluster.client.request(
        "GET", f"/apis/elasticrun.dev/v1alpha1/namespaces/{ns}/elasticruns/{RUN}"))
    assert run.status.round >= 1
