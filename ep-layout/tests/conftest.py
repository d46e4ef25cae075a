"""Shared fixtures of the ep-layout tests: the C++ dump program and the built wheel (each built once per session)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1]
INCLUDE_DIR = PACKAGE_DIR / "include"


def find_cxx() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def find_nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    return None


def run_checked(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    """Run `cmd`; on failure, fail the test with the command and its full output."""
    proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)  # type: ignore[call-overload]
    if proc.returncode != 0:
        pytest.fail(
            f"command failed ({proc.returncode}): {' '.join(map(str, cmd))}\n"
            f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}",
            pytrace=False,
        )
    return proc


class LayoutDump:
    """tests/cpp/layout_dump.cpp running once for the session; `query` sends a batch and returns its answers."""

    _CHUNK = 256  # requests per write: far below the 64 KiB pipe buffer, so write-then-read cannot deadlock

    def __init__(self, exe: Path) -> None:
        self._proc = subprocess.Popen([str(exe)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def query(self, requests: list[str]) -> list[str]:
        stdin, stdout = self._proc.stdin, self._proc.stdout
        assert stdin is not None and stdout is not None
        answers: list[str] = []
        for start in range(0, len(requests), self._CHUNK):
            chunk = requests[start : start + self._CHUNK]
            stdin.write("".join(f"{r}\n" for r in chunk))
            stdin.flush()
            for request in chunk:
                answer = stdout.readline()
                if not answer:
                    raise RuntimeError(f"layout_dump exited while answering {request!r}")
                answers.append(answer.rstrip("\n"))
        return answers

    def close(self) -> None:
        if self._proc.stdin:
            self._proc.stdin.close()
        self._proc.wait(timeout=30)


@pytest.fixture(scope="session")
def run_cmd():
    """`run_checked` as a fixture (test modules cannot import conftest under --import-mode=importlib)."""
    return run_checked


@pytest.fixture(scope="session")
def cxx() -> str:
    found = find_cxx()
    if found is None:
        pytest.skip("no host C++ compiler (g++/c++ or $CXX) on PATH")
    return found


@pytest.fixture(scope="session")
def nvcc() -> str:
    found = find_nvcc()
    if found is None:
        pytest.skip("nvcc not found (PATH, $CUDA_HOME, /usr/local/cuda)")
    return found


@pytest.fixture(scope="session")
def layout_dump(cxx: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LayoutDump]:
    exe = tmp_path_factory.mktemp("layout_dump") / "layout_dump"
    src = PACKAGE_DIR / "tests" / "cpp" / "layout_dump.cpp"
    run_checked(
        [
            cxx,
            "-std=c++17",
            "-O1",
            "-Wall",
            "-Wextra",
            "-Werror",
            f"-I{INCLUDE_DIR}",
            str(src),
            "-o",
            str(exe),
        ]
    )
    dump = LayoutDump(exe)
    yield dump
    dump.close()


@pytest.fixture(scope="session")
def built_dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`python -m build` of this source tree: an sdist, then the wheel built FROM that sdist (so the wheel tests
    also prove the sdist is complete). No isolation: uses this env's scikit-build-core."""
    pytest.importorskip(
        "build", reason="the `build` package (ep-layout's test group) is needed to build the wheel"
    )
    pytest.importorskip("scikit_build_core", reason="scikit-build-core (ep-layout's test group) is needed")
    out = tmp_path_factory.mktemp("wheel")
    run_checked(
        [
            sys.executable,
            "-m",
            "build",
            "--no-isolation",
            "--outdir",
            str(out / "dist"),
            f"-Cbuild-dir={out / 'build'}",
            str(PACKAGE_DIR),
        ]
    )
    return out / "dist"


@pytest.fixture(scope="session")
def built_wheel(built_dist: Path) -> Path:
    wheels = sorted(built_dist.glob("*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="session")
def built_sdist(built_dist: Path) -> Path:
    sdists = sorted(built_dist.glob("*.tar.gz"))
    assert len(sdists) == 1, sdists
    return sdists[0]


@pytest.fixture(scope="session")
def unpacked_wheel(built_wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel extracted into a directory that works as a site-packages (what `pip install` lays down)."""
    site = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(built_wheel) as zf:
        zf.extractall(site)
    return site
