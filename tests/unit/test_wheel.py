"""The wheel a user installs: its license, its console scripts, a plugin without torch.

The wheel is built from a copy of the sources (so the checkout gains no
``build/``), offline, with the venv's setuptools: about two seconds.
"""

from __future__ import annotations

import email
import hashlib
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: sha256 of the Apache License 2.0 as the ASF publishes it (LICENSE-2.0.txt).
APACHE_2_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "handler", "operator", "deploy/crds")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[zipfile.ZipFile]:
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    for name in SOURCES:
        source, target = ROOT / name, src / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(source, target)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--no-index", "-q", "-w", str(work / "dist"), str(src)],
                   check=True, capture_output=True, timeout=240)
    (built,) = (work / "dist").glob("elasticrun-*.whl")
    with zipfile.ZipFile(built) as archive:
        yield archive


def _dist_info(wheel: zipfile.ZipFile, name: str) -> str:
    (path,) = [n for n in wheel.namelist() if n.endswith(f".dist-info/{name}")]
    return wheel.read(path).decode()


def test_the_license_file_is_the_unmodified_apache_2_text() -> None:
    text = (ROOT / "LICENSE").read_bytes()
    assert hashlib.sha256(text).hexdigest() == APACHE_2_SHA256
    assert text.decode().split("\n")[1:3] == [
        " " * 33 + "Apache License", " " * 27 + "Version 2.0, January 2004"]


def test_the_wheel_names_its_license_and_carries_the_file(wheel: zipfile.ZipFile) -> None:
    metadata = email.message_from_string(_dist_info(wheel, "METADATA"))
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata.get_all("License-File") == ["LICENSE"]
    assert _dist_info(wheel, "licenses/LICENSE").encode() == (ROOT / "LICENSE").read_bytes()


def test_the_wheel_installs_the_kubectl_plugin_and_its_package(wheel: zipfile.ZipFile) -> None:
    scripts = _dist_info(wheel, "entry_points.txt")
    assert "kubectl-elasticrun = elasticrun.cli.main:main" in scripts.splitlines()
    assert "elasticrun-operator = elasticrun.operator.__main__:main" in scripts.splitlines()
    names = set(wheel.namelist())
    assert {"elasticrun/cli/main.py", "elasticrun/cli/verbs.py", "elasticrun/cli/screen.py",
            "elasticrun/api/crd.yaml"} <= names


#: Refuses every import of the packages the plugin must not need, then runs it.
_WITHOUT_EXTRAS = """
import sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "kopf", "prometheus_client", "cryptography") \\
                or name.startswith("elasticrun.operator") or name.startswith("elasticrun.handler"):
            raise ImportError("the plugin imported " + name)
sys.meta_path.insert(0, Refuse())
from elasticrun.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_the_plugin_needs_only_the_handlers_dependencies() -> None:
    for argv in (["--help"], ["resize", "--help"]):
        done = subprocess.run([sys.executable, "-c", _WITHOUT_EXTRAS, *argv],
                              capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        assert "usage: kubectl elasticrun" in done.stdout
    # A real verb too: it gets as far as loading credentials, without torch or kopf.
    done = subprocess.run([sys.executable, "-c", _WITHOUT_EXTRAS, "status", "r",
                           "--kubeconfig", "/nonexistent"], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("error: cannot load credentials from kubeconfig /nonexistent")
