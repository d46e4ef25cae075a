"""Building a pure-Python package's wheel prints no warning (issue 16, point 8).

scikit-build-core warns when the deprecated tool.scikit-build.metadata table is used under a >= 1.0 policy, and when it
has no CMake version to go by and no CMakeLists.txt to read one from; ep-layout's CMake run warned too
(GNUInstallDirs with no language enabled). Each build calls the backend directly in a child process, so what is
checked is exactly what the backend and CMake print, not pip's own notices.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Pure-Python wheels (py3-none-any), fast to build (about 2 s each). ep-layout runs CMake (headers-only install).
PURE = ["ep-layout", "ep-jit", "ep-core", "ep-torch"]

_BUILD = """
import sys
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
