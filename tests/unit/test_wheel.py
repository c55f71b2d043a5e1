"""The wheel and sdist a user installs: license, console scripts, a plugin without torch.

Both are built by ``python -m build --no-isolation`` (tests/wheelkit.py) from a
copy of the sources, offline, with the venv's setuptools: a few seconds. The
wheel is built from the sdist, as a release builds it, so a file the sdist
forgets is missing from the wheel too. tests/integration/test_wheel_install.py
installs the wheel into a fresh venv and runs a torchrun round from it.
"""

from __future__ import annotations

import email
import hashlib
import os
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from wheelkit import Dists, build_dists

ROOT = Path(__file__).resolve().parents[2]
#: sha256 of the Apache License 2.0 as the ASF publishes it (LICENSE-2.0.txt).
APACHE_2_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> Dists:
    return build_dists(tmp_path_factory.mktemp("dists"))


@pytest.fixture(scope="module")
def wheel(dists: Dists) -> Iterator[zipfile.ZipFile]:
    with zipfile.ZipFile(dists.wheel) as archive:
        yield archive


#: The CRDs the package ships (elasticrun.api's package data, links in the checkout)
#: and the file of deploy/crds/ each must be a copy of.
PACKAGED_CRDS = {"crd.yaml": "elasticrun.dev_elasticruns.yaml",
                 "slice_crd.yaml": "elasticrun.dev_elasticrunslices.yaml"}


def test_the_packaged_crds_are_links_to_every_crd_in_deploy() -> None:
    api, crds = ROOT / "handler" / "elasticrun" / "api", ROOT / "deploy" / "crds"
    assert set(PACKAGED_CRDS.values()) == {p.name for p in crds.glob("*.yaml")}
    for name, source in PACKAGED_CRDS.items():
        assert (api / name).is_symlink() and (api / name).resolve() == (crds / source)


def test_the_sdist_carries_the_license_and_the_crds_as_real_files(dists: Dists) -> None:
    stem = dists.sdist.name.removesuffix(".tar.gz")
    texts: dict[str, bytes] = {}
    with tarfile.open(dists.sdist) as tar:
        members = {m.name.removeprefix(stem + "/"): m for m in tar.getmembers()
                   if m.name != stem}
        for name in PACKAGED_CRDS:
            crd = members[f"handler/elasticrun/api/{name}"]
            assert crd.isfile(), f"the sdist must hold {name}, not the link to deploy/crds"
            texts[name] = tar.extractfile(crd).read()  # type: ignore[union-attr]
        license_text = tar.extractfile(members["LICENSE"]).read()  # type: ignore[union-attr]
    for name, source in PACKAGED_CRDS.items():
        assert texts[name] == (ROOT / "deploy" / "crds" / source).read_bytes(), name
    assert license_text == (ROOT / "LICENSE").read_bytes()
    assert {"pyproject.toml", "README.md", "PKG-INFO"} <= set(members)
    # Only the packages and their metadata: no tests, charts or caches.
    tops = {name.split("/")[0] for name in members}
    assert tops <= {"LICENSE", "README.md", "PKG-INFO", "pyproject.toml", "setup.cfg",
                    "elasticrun.egg-info", "handler", "operator"}, tops


def test_the_wheel_holds_exactly_the_five_packages(wheel: zipfile.ZipFile) -> None:
    tops = {n.split("/")[0] for n in wheel.namelist()}
    assert tops == {"elasticrun", "elasticrun-0.1.0.dist-info"}
    packages = {"/".join(n.split("/")[:2]) for n in wheel.namelist()
                if n.startswith("elasticrun/")}
    assert packages == {"elasticrun/api", "elasticrun/handler", "elasticrun/inplace",
                        "elasticrun/cli", "elasticrun/operator"}
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in wheel.namelist())


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


def test_the_wheel_carries_both_crds_identical_to_deploy(wheel: zipfile.ZipFile) -> None:
    for name, source in PACKAGED_CRDS.items():
        assert wheel.read(f"elasticrun/api/{name}") == \
            (ROOT / "deploy" / "crds" / source).read_bytes(), name


#: Refuses every import of the packages the plugin must not need.
_REFUSE = """
import sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "kopf", "prometheus_client", "cryptography") \\
                or name.startswith("elasticrun.operator") or name.startswith("elasticrun.handler"):
            raise ImportError("the plugin imported " + name)
sys.meta_path.insert(0, Refuse())
"""
#: The plugin run with those imports refused.
_WITHOUT_EXTRAS = _REFUSE + """
from elasticrun.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def _python(code: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """``code`` run by this venv's interpreter on this checkout's sources: the venv's
    editable install may name another checkout's."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "handler")}
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          timeout=60, check=False, env=env)


def test_the_plugin_needs_only_the_handlers_dependencies() -> None:
    # Positive control: an import the plugin must not make is refused.
    refused = _python(_REFUSE + "import elasticrun.handler.settings")
    assert refused.returncode == 1
    assert "ImportError: the plugin imported elasticrun.handler" in refused.stderr
    for argv in (["--help"], ["resize", "--help"]):
        done = _python(_WITHOUT_EXTRAS, *argv)
        assert done.returncode == 0, done.stderr
        assert "usage: kubectl elasticrun" in done.stdout
    # A real verb too: it gets as far as loading credentials, without torch or kopf.
    done = _python(_WITHOUT_EXTRAS, "status", "r", "--kubeconfig", "/nonexistent")
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("error: cannot load credentials from kubeconfig /nonexistent")
