"""The images cannot be built here (no Docker engine), so check what a build would need.

Every COPY source must exist in the repository (and not be filtered out by the
Dockerfile's own .dockerignore), the base image must be pinned, the user must
be a numeric non-root one (the kubelet checks runAsNonRoot against it), and the
operator's entry point must resolve to real code.
"""

from __future__ import annotations

import ast
import fnmatch
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = [ROOT / "operator" / "Dockerfile", ROOT / "deploy" / "examples" / "Dockerfile"]


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    out = []
    for raw in text.splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def ignored(path: str, dockerfile: Path) -> bool:
    """BuildKit's <Dockerfile>.dockerignore semantics, for the patterns we use."""
    rules = Path(f"{dockerfile}.dockerignore").read_text().splitlines()
    excluded = False
    for rule in (r.strip() for r in rules):
        if not rule or rule.startswith("#"):
            continue
        negate = rule.startswith("!")
        pattern = rule.lstrip("!").rstrip("/")
        if fnmatch.fnmatch(path.rstrip("/"), pattern) or path.startswith(pattern + "/"):
            excluded = not negate
    return excluded


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_copy_sources_exist_and_reach_the_build(dockerfile: Path) -> None:
    copies = [args for word, args in instructions(dockerfile) if word == "COPY"]
    assert copies
    for args in copies:
        if args.startswith("--from="):
            continue
        *sources, _dest = args.split()
        for source in sources:
            assert (ROOT / source).exists(), f"{dockerfile.name}: COPY {source} is missing"
            assert not ignored(source, dockerfile), f"{source} is excluded by .dockerignore"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_base_image_is_pinned_and_user_is_numeric_non_root(dockerfile: Path) -> None:
    steps = instructions(dockerfile)
    args = dict(a.split("=", 1) for w, a in steps if w == "ARG" and "=" in a)
    images = [a for w, a in steps if w == "FROM"]
    assert images, f"{dockerfile} has no FROM the parser found"
    for image in images:
        ref = image.split()[0]
        ref = args.get(ref.strip("${}"), ref)
        # an exact patch-level tag (3.11.13-...) or a digest; never :latest or :3.11
        assert re.search(r"@sha256:[0-9a-f]{64}$|:\d+\.\d+\.\d+[-\w.]*$", ref), ref
    (user,) = [a for w, a in steps if w == "USER"]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0


def test_operator_entry_point_exists() -> None:
    steps = instructions(ROOT / "operator" / "Dockerfile")
    (entry,) = [a for w, a in steps if w == "ENTRYPOINT"]
    command = ast.literal_eval(entry)[0]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, function = scripts[command].partition(":")
    assert module == "elasticrun.operator.__main__"
    source = ROOT / "operator" / "elasticrun" / "operator" / "__main__.py"
    tree = ast.parse(source.read_text())
    assert any(isinstance(n, ast.FunctionDef) and n.name == function for n in tree.body)
    # `pip install .[operator]` is what the image runs; the extra must exist.
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert "operator" in extras and any(d.startswith("kopf") for d in extras["operator"])
    assert any(w == "RUN" and ".[operator]" in a for w, a in steps)
