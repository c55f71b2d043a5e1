"""Adapt the user-facing example manifests to the local single-node cluster.

What a user's cluster has and ours lacks, changed the way a kustomize overlay
would, leaving everything else as written (labels, annotations, commands,
ServiceAccount, restart policy):

- the image: ``localhost/elasticrun:dev`` (never pulled), with the machine's
  ``/usr`` and ``/opt/elasticrun`` mounted read-only (see ``image.py``) and the
  examples directory at ``/app``, where ``deploy/examples/Dockerfile`` puts
  ``train.py``;
- the network: ``hostNetwork`` (no pod network here), so a pinned TCPStore port
  would collide between members on the one node: the pin and the container
  ports go, and every rank 0 takes a free port;
- storage: no provisioner, so each PersistentVolumeClaim becomes a host
  directory (one node: every member sees the same checkpoint);
- resources: two cores for all members, so requests and limits go.

Pod templates of Jobs, StatefulSets, JobSets and Kubeflow Trainer runtimes are
adapted; a TrainJob's own ``spec.trainer.image`` becomes the local image and
the claims its ``runtimePatches`` mount become host directories.

    python -m controlplane.localize deploy/examples/job.yaml --volumes DIR | kubectl apply -f -
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from controlplane.image import IMAGE, MOUNT_ROOT

WORKLOADS = ("Job", "StatefulSet", "Deployment", "ReplicaSet", "DaemonSet")
EXAMPLES_IN_IMAGE = "/app"
_HOST_MOUNTS = [("host-usr", "/usr"), ("elasticrun-local", str(MOUNT_ROOT))]


def pod_spec(doc: dict[str, Any]) -> dict[str, Any] | None:
    if doc.get("kind") == "Pod":
        spec: dict[str, Any] = doc["spec"]
        return spec
    if doc.get("kind") in WORKLOADS:
        spec = doc["spec"]["template"]["spec"]
        return spec
    return None


def pod_specs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Every pod spec a document holds: workloads', a JobSet's and a Trainer runtime's Jobs."""
    single = pod_spec(doc)
    if single is not None:
        return [single]
    if doc.get("kind") == "JobSet":
        jobset: dict[str, Any] = doc["spec"]
    elif doc.get("kind") in ("ClusterTrainingRuntime", "TrainingRuntime"):
        jobset = doc["spec"]["template"]["spec"]
    else:
        return []
    return [job["template"]["spec"]["template"]["spec"]
            for job in jobset.get("replicatedJobs") or []]


def _claims_to_host(volumes: list[dict[str, Any]], volumes_dir: Path) -> None:
    for volume in volumes:
        claim = volume.pop("persistentVolumeClaim", None)
        if claim is not None:
            volume["hostPath"] = {"path": str(volumes_dir / claim["claimName"]),
                                  "type": "DirectoryOrCreate"}


def _trainjob(doc: dict[str, Any], volumes_dir: Path) -> None:
    """A TrainJob's own image and the claims its runtimePatches mount."""
    trainer = doc["spec"].get("trainer") or {}
    if trainer.get("image"):
        trainer["image"] = IMAGE
    for patch in doc["spec"].get("runtimePatches") or []:
        jobset = ((patch.get("trainingRuntimeSpec") or {}).get("template") or {}).get("spec")
        for job in (jobset or {}).get("replicatedJobs") or []:
            pod = (((job.get("template") or {}).get("spec") or {}).get("template") or {})
            _claims_to_host((pod.get("spec") or {}).get("volumes") or [], volumes_dir)


def localize_pod(spec: dict[str, Any], volumes_dir: Path) -> None:
    """Change one pod spec in place (see the module docstring)."""
    spec["hostNetwork"] = True
    spec["dnsPolicy"] = "ClusterFirstWithHostNet"
    volumes = spec.setdefault("volumes", [])
    _claims_to_host(volumes, volumes_dir)
    volumes += [{"name": name, "hostPath": {"path": path, "type": "Directory"}}
                for name, path in _HOST_MOUNTS]
    volumes.append({"name": "examples", "hostPath": {
        "path": str(MOUNT_ROOT / "project" / "deploy" / "examples"), "type": "Directory"}})
    for container in spec["containers"]:
        container["image"] = IMAGE
        container["imagePullPolicy"] = "Never"
        container.pop("ports", None)
        container.pop("resources", None)
        container["env"] = [e for e in container.get("env", [])
                            if not (e["name"] == "PET_RDZV_CONF"
                                    and "store_port" in e.get("value", ""))]
        mounts = container.setdefault("volumeMounts", [])
        mounts += [{"name": name, "mountPath": path, "readOnly": True}
                   for name, path in _HOST_MOUNTS]
        mounts.append({"name": "examples", "mountPath": EXAMPLES_IN_IMAGE, "readOnly": True})


def localize(docs: Iterable[dict[str, Any]], volumes_dir: Path) -> list[dict[str, Any]]:
    """The documents for the local node: claims dropped, pod specs changed."""
    out = []
    for original in docs:
        if not original or original.get("kind") == "PersistentVolumeClaim":
            continue
        doc = copy.deepcopy(original)
        for spec in pod_specs(doc):
            localize_pod(spec, volumes_dir)
        if doc.get("kind") == "TrainJob":
            _trainjob(doc, volumes_dir)
        out.append(doc)
    return out


def load(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("manifest", type=Path)
    parser.add_argument("--volumes", type=Path, required=True,
                        help="host directory that stands in for PersistentVolumeClaims")
    args = parser.parse_args(argv)
    yaml.safe_dump_all(localize(load(args.manifest), args.volumes.resolve()), sys.stdout,
                       sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
