"""The local overlay of the examples and the local image's path links (no cluster)."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from conftest import ROOT
from controlplane import localize
from controlplane.image import IMAGE, MOUNT_ROOT, path_links

EXAMPLES = ROOT / "deploy" / "examples"


def test_job_example_is_adapted_and_otherwise_kept(tmp_path: Path) -> None:
    original = localize.load(EXAMPLES / "job.yaml")
    docs = localize.localize(original, tmp_path)
    assert [d["kind"] for d in docs] == ["Job"]  # the claim became a host directory
    (job,) = docs
    spec = job["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert spec["hostNetwork"] is True
    assert container["image"] == IMAGE and container["imagePullPolicy"] == "Never"
    assert "ports" not in container and "resources" not in container
    assert all(e["name"] != "PET_RDZV_CONF" for e in container["env"])  # the pinned port
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["checkpoints"]["hostPath"]["path"] == str(tmp_path / "llama-job-checkpoints")
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/usr"]["readOnly"] and mounts[str(MOUNT_ROOT)]["readOnly"]
    assert mounts[localize.EXAMPLES_IN_IMAGE]["readOnly"]
    # What the user wrote and the webhook reads stays as written.
    (before,) = [d for d in original if d["kind"] == "Job"]
    template = before["spec"]["template"]
    assert job["spec"]["template"]["metadata"] == template["metadata"]
    assert container["command"] == template["spec"]["containers"][0]["command"]
    assert spec["serviceAccountName"] == template["spec"]["serviceAccountName"]
    assert before["spec"]["template"]["spec"].get("hostNetwork") is None  # input untouched


def test_every_example_pod_runs_train_py_from_the_mounted_examples(tmp_path: Path) -> None:
    """Every example runs pods, so each must yield one: a reader that found none would
    otherwise check nothing."""
    examples = sorted(EXAMPLES.glob("*.yaml"))
    checked: set[Path] = set()
    for path in examples:
        for doc in localize.localize(localize.load(path), tmp_path):
            for spec in localize.pod_specs(doc):
                command = spec["containers"][0]["command"]
                assert f"{localize.EXAMPLES_IN_IMAGE}/train.py" in command, (path.name, command)
                checked.add(path)
    assert examples and checked == set(examples)
    assert (EXAMPLES / "train.py").exists()


def test_image_links_only_paths_outside_usr() -> None:
    links = path_links(Path("/root/.pyenv/versions/3.11.7"), Path("/work/checkout"))
    assert links == {"/root/.pyenv/versions/3.11.7": str(MOUNT_ROOT / "python"),
                     "/work/checkout": str(MOUNT_ROOT / "project")}
    assert path_links(Path("/usr"), Path("/srv/x")) == {"/srv/x": str(PurePosixPath(
        MOUNT_ROOT / "project"))}
