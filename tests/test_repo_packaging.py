"""Building a pure-Python package's wheel prints no warning (issue 16, point 8).

scikit-build-core warns when the deprecated tool.scikit-build.metadata table is used under a >= 1.0 policy, and when it
has no CMake version to go by and no CMakeLists.txt to read one from; ep-layout's CMake run warned too
(GNUInstallDirs with no language enabled). Each build calls the backend directly in a child process, so what is
checked is exactly what the backend and CMake print, not pip's own notices.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Pure-Python wheels (py3-none-any), fast to build (about 2 s each). ep-layout runs CMake (headers-only install).
PURE = ["ep-layout", "ep-jit", "ep-core", "ep-torch"]

_BUILD = """
import sys
import zipfile
from scikit_build_core.build import build_wheel
print(build_wheel(sys.argv[1], config_settings={"build-dir": sys.argv[2]}))
"""


@pytest.mark.parametrize("package", PURE)
def test_pure_wheel_builds_without_warnings(package: str, tmp_path: Path) -> None:
    skbuild = pytest.importorskip("scikit_build_core")
    if int(skbuild.__version__.split(".")[0]) < 1:
        pytest.skip(f"scikit-build-core {skbuild.__version__} < 1.0 (the packages require >= 1.0)")
    if package == "ep-layout" and shutil.which("cmake") is None:
        pytest.importorskip("cmake", reason="ep-layout's wheel runs CMake")
    out = tmp_path / "dist"
    proc = subprocess.run(
        [sys.executable, "-c", _BUILD, str(out), str(tmp_path / "build")],
        cwd=ROOT / package,
        capture_output=True,
        text=True,
        timeout=120,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    wheel = proc.stdout.strip().splitlines()[-1]
    assert wheel.endswith("-py3-none-any.whl"), log
    assert (out / wheel).is_file()
    noisy = [line for line in log.splitlines() if "warning" in line.lower()]
    assert not noisy, f"{package}: the wheel build warned:\n" + "\n".join(noisy)


# The wheels that `nox -s build` wrote: the build session runs these tests with EP_WHEEL_DIR=dist (unset, they skip,
# so that a stale dist/ never fails another session).
WHEEL_DIR = Path(os.environ["EP_WHEEL_DIR"]) if os.environ.get("EP_WHEEL_DIR") else None
NATIVE = ["ep_symmem", "ep_nccl_gin", "ep_launch"]


def _built_wheels(dist: str) -> list[Path]:
    if WHEEL_DIR is None:
        pytest.skip("EP_WHEEL_DIR is not set (`nox -s build` sets it)")
    wheels = sorted(WHEEL_DIR.glob(f"{dist}-*.whl"))
    assert wheels, f"no {dist} wheel in {WHEEL_DIR}"
    return wheels


@pytest.mark.parametrize("dist", NATIVE)
def test_native_wheels_are_manylinux_without_cuda_or_nccl_inside(dist: str) -> None:
    """PyPI refuses a plain linux_x86_64 tag: `nox -s build` repairs the native wheels with auditwheel. libcuda and
    libnccl are loaded at run time (the driver's, the nvidia-nccl wheel's), so they must not be vendored."""
    for wheel in _built_wheels(dist):
        platform = wheel.name.removesuffix(".whl").split("-")[-1]
        assert platform.startswith("manylinux_") and platform.endswith("_x86_64"), wheel.name
        with zipfile.ZipFile(wheel) as z:
            (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/WHEEL")]
            tags = [t for t in z.read(meta).decode().splitlines() if t.startswith("Tag: ")]
            vendored = [n for n in z.namelist() if "libcuda.so" in n or "libnccl.so" in n]
        assert tags and all(t.endswith(platform) for t in tags), (wheel.name, tags)
        assert not vendored, f"{wheel.name} vendors {vendored}"


@pytest.mark.parametrize("dist", ["ep_layout", "ep_jit", "ep_core", "ep_torch"])
def test_pure_wheels_stay_py3_none_any(dist: str) -> None:
    for wheel in _built_wheels(dist):
        assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
