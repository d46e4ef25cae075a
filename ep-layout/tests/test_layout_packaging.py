"""The wheel: pure, exact file list, working get_include()/get_cmake_dir(); the downstream CMake example builds."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import ep_layout
import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1]
VERSION = ep_layout.__version__
DIST_INFO = f"ep_layout-{VERSION}.dist-info"

EXPECTED_WHEEL_FILES = {
    "ep_layout/__init__.py",
    "ep_layout/__main__.py",
    "ep_layout/_checks.py",
    "ep_layout/_locations.py",
    "ep_layout/_math.py",
    "ep_layout/buffer_composition.py",
    "ep_layout/buffer_layout.py",
    "ep_layout/errors.py",
    "ep_layout/py.typed",
    "ep_layout/token_layout.py",
    "ep_layout/version.py",
    "ep_layout/workspace_layout.py",
    "ep_layout/include/ep_layout/buffer_composition.cuh",
    "ep_layout/include/ep_layout/buffer_layout.cuh",
    "ep_layout/include/ep_layout/config.cuh",
    "ep_layout/include/ep_layout/ep_layout.cuh",
    "ep_layout/include/ep_layout/math.cuh",
    "ep_layout/include/ep_layout/token_layout.cuh",
    "ep_layout/include/ep_layout/version.cuh",
    "ep_layout/include/ep_layout/workspace_layout.cuh",
    "ep_layout/share/cmake/ep_layout/ep_layoutConfig.cmake",
    "ep_layout/share/cmake/ep_layout/ep_layoutConfigVersion.cmake",
    "ep_layout/share/cmake/ep_layout/ep_layoutTargets.cmake",
    f"{DIST_INFO}/METADATA",
    f"{DIST_INFO}/WHEEL",
    f"{DIST_INFO}/RECORD",
    f"{DIST_INFO}/entry_points.txt",
    f"{DIST_INFO}/licenses/LICENSE",  # the Apache-2.0 text every wheel carries
}


def _tool(name: str) -> str | None:
    """`name` from PATH or from this interpreter's bin directory (pip-installed cmake/ninja)."""
    local = Path(sys.executable).parent / name
    return shutil.which(name) or (str(local) if local.is_file() else None)


def test_wheel_is_pure_python(built_wheel: Path) -> None:
    assert built_wheel.name == f"ep_layout-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(built_wheel) as zf:
        wheel_meta = zf.read(f"{DIST_INFO}/WHEEL").decode()
    assert "Root-Is-Purelib: true" in wheel_meta
    assert [line for line in wheel_meta.splitlines() if line.startswith("Tag:")] == ["Tag: py3-none-any"]


def test_wheel_file_list_is_exact(built_wheel: Path) -> None:
    with zipfile.ZipFile(built_wheel) as zf:
        names = {n for n in zf.namelist() if not n.endswith("/")}
    assert names == EXPECTED_WHEEL_FILES, (
        f"missing: {sorted(EXPECTED_WHEEL_FILES - names)}, unexpected: {sorted(names - EXPECTED_WHEEL_FILES)}"
    )


def test_wheel_headers_and_modules_equal_the_source(built_wheel: Path) -> None:
    with zipfile.ZipFile(built_wheel) as zf:
        for name in zf.namelist():
            if name.startswith("ep_layout/include/"):
                source = PACKAGE_DIR / name.removeprefix("ep_layout/")
            elif name.startswith("ep_layout/") and name.endswith(".py"):
                source = PACKAGE_DIR / "src" / name
            else:
                continue
            assert zf.read(name) == source.read_bytes(), name


def test_wheel_metadata(built_wheel: Path) -> None:
    with zipfile.ZipFile(built_wheel) as zf:
        metadata = zf.read(f"{DIST_INFO}/METADATA").decode()
        entry_points = zf.read(f"{DIST_INFO}/entry_points.txt").decode()
    assert f"Version: {VERSION}" in metadata
    assert "Requires-Dist" not in metadata  # ep-layout depends on nothing
    assert "Requires-Python: >=3.10" in metadata
    assert "[cmake.root]" in entry_points and "ep_layout = ep_layout" in entry_points


def test_sdist_has_the_build_inputs(built_sdist: Path) -> None:
    prefix = f"ep_layout-{VERSION}/"
    with tarfile.open(built_sdist) as tf:
        names = {n.removeprefix(prefix) for n in tf.getnames()}
    headers = {f"include/ep_layout/{p.name}" for p in (PACKAGE_DIR / "include" / "ep_layout").glob("*.cuh")}
    sources = {
        f"src/ep_layout/{p.name}" for p in (PACKAGE_DIR / "src" / "ep_layout").iterdir() if p.is_file()
    }
    required = {"pyproject.toml", "CMakeLists.txt", "cmake/ep_layoutConfig.cmake.in", "README.md", "PKG-INFO"}
    assert required | headers | sources <= names, sorted((required | headers | sources) - names)
    assert not any(n.startswith("build/") for n in names)


def _installed_python(site: Path, *args: str) -> str:
    """Run `python -m ep_layout ...` against the unpacked wheel only (no source tree on the path)."""
    env = {**os.environ, "PYTHONPATH": str(site)}
    proc = subprocess.run(
        [sys.executable, "-m", "ep_layout", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=site,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_installed_package_finds_its_files(unpacked_wheel: Path) -> None:
    pkg = unpacked_wheel / "ep_layout"
    assert _installed_python(unpacked_wheel, "--include-dir") == str(pkg / "include")
    assert _installed_python(unpacked_wheel, "--includes") == f"-I{pkg / 'include'}"
    assert _installed_python(unpacked_wheel, "--cmakedir") == str(pkg / "share" / "cmake" / "ep_layout")
    assert _installed_python(unpacked_wheel, "--version") == f"ep-layout {VERSION} (layout 1.0)"


def test_source_tree_get_include() -> None:
    include = Path(ep_layout.get_include())
    assert (include / "ep_layout" / "ep_layout.cuh").is_file()


@pytest.mark.parametrize("how", ["ep_layout_DIR", "CMAKE_PREFIX_PATH"])
def test_downstream_example_builds(
    how: str, unpacked_wheel: Path, nvcc: str, run_cmd, tmp_path: Path
) -> None:
    cmake = _tool("cmake")
    if cmake is None:
        pytest.skip("cmake not found (PATH or this interpreter's bin directory)")
    pkg = unpacked_wheel / "ep_layout"
    # ep_layout_DIR: what `python -m ep_layout --cmakedir` prints; CMAKE_PREFIX_PATH: the package directory, which
    # is what scikit-build-core's `cmake.root` entry point hands to downstream builds.
    locate = (
        f"-Dep_layout_DIR={pkg / 'share' / 'cmake' / 'ep_layout'}"
        if how == "ep_layout_DIR"
        else f"-DCMAKE_PREFIX_PATH={pkg}"
    )
    build = tmp_path / "build"
    configure = [cmake, "-S", str(PACKAGE_DIR / "examples" / "downstream"), "-B", str(build), locate]
    configure += [f"-DCMAKE_CUDA_COMPILER={nvcc}", "-DCMAKE_CUDA_ARCHITECTURES=90a"]
    ninja = _tool("ninja")
    if ninja is not None:
        configure += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
    out = run_cmd(configure).stdout
    assert f"ep_layout {VERSION}: headers in {pkg / 'include'}" in out
    if how == "ep_layout_DIR":  # one full compile is enough; the other way only proves find_package
        run_cmd([cmake, "--build", str(build), "-j", "1"])
        exe = build / "gather_tokens"
        assert exe.is_file()
        # The host part needs no GPU: it prints the sizes computed by the same headers.
        expected = ep_layout.size_hint_bytes(8, 4096, 7168, 8)
        assert f"size hint {expected} B" in subprocess.run([str(exe)], capture_output=True, text=True).stdout
