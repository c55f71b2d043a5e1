"""The artifacts a user installs, built and installed the way a user would, offline.

``build_dists`` runs ``python -m build`` (sdist, then the wheel built from that
sdist, as a release does) on a copy of the sources, so the checkout gains no
``build/`` or ``*.egg-info``. ``--no-isolation``: the build uses this venv's
setuptools (the test extra pins the build-system's floor) instead of fetching
one, so it needs no network.

``fresh_venv`` installs the wheel into a new virtualenv without the system's or
this venv's site-packages. pip resolves the wheel's own requirements from a
wheelhouse and nothing else (``--no-index``): a requirement the wheel forgets
is an ImportError there. The wheelhouse is repacked from the distributions
installed in this venv (their RECORD files), so it needs no index either.
torch, the optional ``torch`` extra, is the exception: its CUDA build with its
nvidia libraries is about 5 GB, too much to repack and unpack per test run, so
its requirement closure (minus anything the wheel itself requires) is linked
into a directory that a ``.pth`` file adds to the fresh venv's path.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
#: What the sdist is made from (pyproject's package-dir, readme, license; the
#: CRDs that handler/elasticrun/api/crd.yaml and slice_crd.yaml link to).
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "handler", "operator", "deploy/crds")


@dataclass(frozen=True)
class Dists:
    wheel: Path
    sdist: Path


def build_dists(work: Path) -> Dists:
    """``python -m build --no-isolation`` on a copy of the sources; about five seconds."""
    src, out = work / "src", work / "dist"
    for name in SOURCES:
        source, target = ROOT / name, src / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(source, target)
    done = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out),
                           str(src)], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (wheel,) = out.glob("elasticrun-*-py3-none-any.whl")
    (sdist,) = out.glob("elasticrun-*.tar.gz")
    return Dists(wheel, sdist)


def requirement_closure(names: list[str], extras: tuple[str, ...] = ()) -> set[str]:
    """Canonical names of ``names`` and everything they require, as installed here."""
    env = default_environment()
    seen: set[str] = set()
    todo = [(n, extras) for n in names]
    while todo:
        name, wanted = todo.pop()
        key = canonicalize_name(name)
        if key in seen and not wanted:
            continue
        seen.add(key)
        for line in metadata.distribution(name).requires or []:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({**env, "extra": e})
                                         for e in ("", *wanted)):
                todo.append((req.name, tuple(req.extras)))
    return seen


def wheel_requirements(wheel: Path, extras: tuple[str, ...] = ()) -> list[str]:
    """The names a wheel's METADATA requires (without extras, or with ``extras``)."""
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        lines = archive.read(name).decode().splitlines()
    env = default_environment()
    reqs = [Requirement(line.split(":", 1)[1]) for line in lines
            if line.startswith("Requires-Dist:")]
    return [r.name for r in reqs
            if r.marker is None or any(r.marker.evaluate({**env, "extra": e}) for e in extras)]


def _site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def _record_line(path: str, data: bytes) -> list[str]:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return [path, f"sha256={digest}", str(len(data))]


def repack(name: str, out: Path) -> Path:
    """A wheel of the installed distribution ``name`` (its files inside site-packages)."""
    dist = metadata.distribution(name)
    site = _site_packages()
    info = next(p for p in (dist.files or []) if p.parts[0].endswith(".dist-info"))
    tags = [ln.split(":", 1)[1].strip() for ln in
            (dist.read_text("WHEEL") or "Tag: py3-none-any").splitlines()
            if ln.startswith("Tag:")] or ["py3-none-any"]
    parts = [sorted({t.split("-")[i] for t in tags}) for i in range(3)]
    tag = "-".join(".".join(p) for p in parts)
    stem = f"{re.sub(r'[-_.]+', '_', dist.metadata['Name'])}-{dist.version}"
    target = out / f"{stem}-{tag}.whl"
    rows: list[list[str]] = []
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as archive:
        for rel in dist.files or []:
            path = site / rel
            if ".." in rel.parts or rel.name == "RECORD" or "__pycache__" in rel.parts \
                    or not path.is_file():
                continue
            data = path.read_bytes()
            archive.writestr(str(rel), data)
            rows.append(_record_line(str(rel), data))
        record = f"{info.parts[0]}/RECORD"
        text = io.StringIO()
        csv.writer(text, lineterminator="\n").writerows([*rows, [record, "", ""]])
        archive.writestr(record, text.getvalue())
    return target


@dataclass(frozen=True)
class FreshVenv:
    root: Path

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    @property
    def site_packages(self) -> Path:
        return next(self.root.glob("lib/python*/site-packages"))

    def env(self) -> dict[str, str]:
        """The environment to run it in: nothing that points back at the checkout."""
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "PYTHONSTARTUP")}
        env["PATH"] = f"{self.root / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}"
        return env


def fresh_venv(root: Path, wheel: Path, wheelhouse: Path, extras: tuple[str, ...] = (),
               with_torch: bool = True) -> FreshVenv:
    """A new venv (no system site-packages) with ``wheel[extras]`` installed by pip, offline."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True,
                   timeout=120)
    venv = FreshVenv(root)
    needed = requirement_closure(wheel_requirements(wheel, extras))
    wheelhouse.mkdir(parents=True, exist_ok=True)
    for name in sorted(needed):
        repack(name, wheelhouse)
    # This venv's pip installs into the new one (--python), from the wheelhouse only.
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv.python), "install",
                           "--no-index", "--find-links", str(wheelhouse), "--no-cache-dir",
                           "--quiet", f"{wheel}[{','.join(extras)}]" if extras else str(wheel)],
                          capture_output=True, text=True, timeout=300, check=False,
                          env={k: v for k, v in venv.env().items() if k != "PIP_FIND_LINKS"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    if with_torch:
        overlay = root / "torch-overlay"
        overlay.mkdir()
        site = _site_packages()
        for name in sorted(requirement_closure(["torch"]) - needed):
            for rel in {p.parts[0] for p in metadata.distribution(name).files or []
                        if ".." not in p.parts}:
                if rel != "__pycache__" and not rel.endswith(".pth") \
                        and not (overlay / rel).exists() and (site / rel).exists():
                    (overlay / rel).symlink_to(site / rel)
        (venv.site_packages / "zz-torch-overlay.pth").write_text(f"{overlay}\n")
    return venv


#: The agent: torchrun itself, reporting at exit which elasticrun it ran.
AGENT = """
import atexit, json, runpy, sys
def report():
    mods = {n: getattr(sys.modules.get(n), "__file__", None)
            for n in ("elasticrun.handler.handler", "elasticrun.api.model")}
    print("AGENT " + json.dumps(mods), flush=True)
atexit.register(report)
sys.argv[0] = "torchrun"
runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
"""

#: A worker: one all_reduce over gloo, then what it is and where it came from.
WORKER = """
import json, sys
import torch, torch.distributed as dist
import elasticrun, elasticrun.handler
dist.init_process_group("gloo")
total = torch.tensor([dist.get_rank() + 1])
dist.all_reduce(total)
print("WORKER " + json.dumps({
    "rank": dist.get_rank(), "world_size": dist.get_world_size(), "sum": int(total),
    "files": [elasticrun.handler.__file__, *elasticrun.__path__],
    "path": sys.path}), flush=True)
dist.destroy_process_group()
"""


def reports(text: str, tag: str) -> list[dict[str, Any]]:
    """The JSON reports AGENT and WORKER print, from a log."""
    return [json.loads(line.split(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(tag + " ")]
