"""The local node's one image, written as an OCI image layout: no registry, no Docker.

``localhost/elasticrun:dev`` carries almost nothing: a root filesystem skeleton,
a non-root user, the sandbox ``/pause`` process, and symbolic links from this
machine's interpreter and checkout to ``/opt/elasticrun/python`` and
``/opt/elasticrun/project``.  Pods mount the machine's ``/usr`` and
``/opt/elasticrun`` read-only (the node's mount namespace binds the real
directories there), so torch and elasticrun run from the project's virtualenv
with every absolute path in it intact, and the committed manifests in
``deploy/local/`` name the same paths on every machine.

containerd imports the tar into its ``k8s.io`` namespace; pods use it with
``imagePullPolicy: Never``, and containerd's sandbox image is pinned to it, so
nothing is ever pulled.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path, PurePosixPath

IMAGE = "localhost/elasticrun:dev"
#: Where the node's mount namespace binds the interpreter and the checkout.
MOUNT_ROOT = PurePosixPath("/opt/elasticrun")
#: The image user for pods that run as non-root without naming a uid.
USER_ID = 1000
_EPOCH = "2026-01-01T00:00:00Z"


def _entry(name: str, kind: bytes = tarfile.DIRTYPE, mode: int = 0o755,
           size: int = 0, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.size, info.linkname = kind, mode, size, link
    info.mtime = 0
    return info


def _digest(blob: bytes) -> str:
    return "sha256:" + hashlib.sha256(blob).hexdigest()


def root_layer(pause: bytes, links: dict[str, str]) -> bytes:
    """One uncompressed layer: skeleton, users, /pause and the path links."""
    files = {
        "etc/passwd": "root:x:0:0:root:/root:/bin/sh\n"
                      "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
                      f"trainer:x:{USER_ID}:{USER_ID}:trainer:/tmp:/bin/sh\n",
        "etc/group": f"root:x:0:\nnogroup:x:65534:\ntrainer:x:{USER_ID}:\n",
        "etc/nsswitch.conf": "passwd: files\ngroup: files\nhosts: files dns\n",
    }
    dirs = {"usr", "etc", "tmp", "proc", "sys", "dev", "run", "var", "var/tmp", "root", "home",
            str(MOUNT_ROOT).lstrip("/")}
    for path in links:
        parent = PurePosixPath(path.lstrip("/")).parent
        dirs.update(str(p) for p in [parent, *parent.parents] if str(p) != ".")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in sorted(dirs):
            tar.addfile(_entry(d, mode=0o1777 if d.endswith("tmp") else 0o755))
        for name, target in [("bin", "usr/bin"), ("lib", "usr/lib"), ("lib64", "usr/lib64"),
                             ("sbin", "usr/sbin")]:
            tar.addfile(_entry(name, tarfile.SYMTYPE, 0o777, link=target))
        for name, text in files.items():
            data = text.encode()
            tar.addfile(_entry(name, tarfile.REGTYPE, 0o644, len(data)), io.BytesIO(data))
        tar.addfile(_entry("pause", tarfile.REGTYPE, 0o755, len(pause)), io.BytesIO(pause))
        for path, target in sorted(links.items()):
            tar.addfile(_entry(path.lstrip("/"), tarfile.SYMTYPE, 0o777, link=target))
    return buf.getvalue()


def path_links(python_prefix: Path, project: Path) -> dict[str, str]:
    """This machine's interpreter and checkout, linked to where pods mount them.

    A path under ``/usr`` needs no link (pods mount ``/usr`` itself).
    """
    links = {}
    for path, name in ((python_prefix, "python"), (project, "project")):
        if not PurePosixPath(path).is_relative_to("/usr"):
            links[str(path)] = str(MOUNT_ROOT / name)
    return links


def write_image(out: Path, pause: Path, python_prefix: Path, project: Path,
                name: str = IMAGE) -> str:
    """Write the OCI layout tar for ``name``; returns the manifest digest."""
    venv_bin = MOUNT_ROOT / "project" / ".venv" / "bin"
    # The editable install points at the checkout's own path, which a pod's volume
    # can hide (an emptyDir on /tmp, with the checkout under /tmp): the sources
    # are found through the stable mount first.
    sources = ":".join(str(MOUNT_ROOT / "project" / d) for d in ("handler", "operator"))
    layer = root_layer(pause.read_bytes(), path_links(python_prefix, project))
    config = json.dumps({
        "architecture": "amd64", "os": "linux", "created": _EPOCH,
        "config": {"Entrypoint": ["/pause"], "WorkingDir": "/",
                   "Env": [f"PATH={venv_bin}:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
                           f"PYTHONPATH={sources}"]},
        "rootfs": {"type": "layers", "diff_ids": [_digest(layer)]},
        "history": [{"created": _EPOCH, "created_by": "tests/controlplane/image.py"}],
    }, sort_keys=True).encode()
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": _digest(config), "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": _digest(layer), "size": len(layer)}],
    }, sort_keys=True).encode()
    index = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": _digest(manifest), "size": len(manifest),
            "platform": {"architecture": "amd64", "os": "linux"},
            "annotations": {"io.containerd.image.name": name,
                            "org.opencontainers.image.ref.name": name.rpartition(":")[2]}}],
    }, sort_keys=True).encode()
    with tarfile.open(out, "w") as tar:
        def add(path: str, data: bytes) -> None:
            tar.addfile(_entry(path, tarfile.REGTYPE, 0o644, len(data)), io.BytesIO(data))
        tar.addfile(_entry("blobs"))
        tar.addfile(_entry("blobs/sha256"))
        add("oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        for blob in (layer, config, manifest):
            add(f"blobs/sha256/{_digest(blob)[7:]}", blob)
        add("index.json", index)
    return _digest(manifest)
