"""The package graph is the one of DESIGN.md §1, and each package's declared dependencies follow it."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent


def load_pyproject(path: Path) -> dict:
    with open(path / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


# DESIGN.md §1: dist name -> (directory, import name, internal runtime dependencies, optional internal dependencies)
GRAPH = {
    "ep-layout": ("ep-layout", "ep_layout", set(), set()),
    "ep-jit": ("ep-jit", "ep_jit", set(), set()),
    "ep-symmem": ("packages/ep-symmem", "ep_symmem", set(), set()),
    "ep-nccl-gin": ("packages/ep-nccl-gin", "ep_nccl_gin", set(), set()),
    "ep-launch": ("packages/ep-launch", "ep_launch", set(), set()),
    "ep-core": ("ep-core", "ep_core", {"ep-layout", "ep-jit", "ep-symmem", "ep-launch"}, {"ep-nccl-gin"}),
    "ep-torch": ("ep-torch", "ep_torch", {"ep-core"}, set()),
}


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=~!;]", requirement, maxsplit=1)[0].lower()


@pytest.mark.parametrize("dist", list(GRAPH))
def test_declared_internal_dependencies_follow_the_design(dist: str) -> None:
    path, _, deps, optional = GRAPH[dist]
    project = load_pyproject(ROOT / path)["project"]
    internal = {_name(r) for r in project.get("dependencies", [])} & set(GRAPH)
    assert internal == deps
    extras = {_name(r) for reqs in project.get("optional-dependencies", {}).values() for r in reqs}
    assert extras & set(GRAPH) == optional
    for requirement in project.get("dependencies", []):
        if _name(requirement) in GRAPH:
            assert "~=" in requirement, f"{dist}: sibling {requirement!r} must use a compatible range (~=)"


@pytest.mark.parametrize("dist", list(GRAPH))
def test_installed_version_matches_dunder_version(dist: str) -> None:
    module = importlib.import_module(GRAPH[dist][1])
    assert module.__version__ == importlib.metadata.version(dist)
    assert isinstance(module.__all__, (list, tuple)) and module.__all__


@pytest.mark.parametrize("dist", ["ep-layout", "ep-jit", "ep-symmem", "ep-nccl-gin", "ep-launch", "ep-core"])
def test_lower_layers_never_import_torch(dist: str) -> None:
    """Only ep-torch may import torch; importing any other package must leave it unloaded."""
    module = GRAPH[dist][1]
    code = f"import sys, {module}; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0, (
        f"{module} imported torch"
    )


@pytest.mark.parametrize("dist", list(GRAPH))
def test_every_package_has_its_files(dist: str) -> None:
    path = ROOT / GRAPH[dist][0]
    for name in ("pyproject.toml", "README.md", "CHANGELOG.md", "tests"):
        assert (path / name).exists(), f"{dist} lacks {name}"
    assert (path / "src" / GRAPH[dist][1] / "py.typed").exists()


def test_one_license_for_every_package() -> None:
    licenses = {
        dist: load_pyproject(ROOT / path)["project"].get("license") for dist, (path, *_) in GRAPH.items()
    }
    assert set(map(str, licenses.values())) == {str({"text": "Apache-2.0"})}, licenses


def _imported_siblings(src: Path) -> dict[str, set[str]]:
    """Sibling packages' import names each module under ``src`` imports (any scope: lazy imports count too)."""
    names = {imp for _, imp, *_ in GRAPH.values()}
    found: dict[str, set[str]] = {}
    for path in src.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods = [node.module]
            else:
                continue
            for mod in mods:
                top = mod.split(".")[0]
                if top in names:
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


@pytest.mark.parametrize("dist", list(GRAPH))
def test_sources_import_only_declared_siblings(dist: str) -> None:
    """The graph holds for the code too, not only for pyproject: a package imports itself and the siblings it
    declares (runtime or optional), nothing else, so installing it with only its dependencies works."""
    path, imp, deps, optional = GRAPH[dist]
    allowed = {imp} | {GRAPH[d][1] for d in deps | optional}
    stray = {
        m: sorted(files) for m, files in _imported_siblings(ROOT / path / "src").items() if m not in allowed
    }
    assert not stray, f"{dist} imports undeclared siblings: {stray}"
