"""Header discovery for the JIT: NCCL's device headers and ep_nccl_gin/device.cuh."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import ep_nccl_gin
import pytest
from ep_nccl_gin import NcclHeadersNotFoundError, NcclVersion, NcclVersionError


def _wheel_include() -> Path | None:
    spec = importlib.util.find_spec("nvidia.nccl")
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        if (Path(loc) / "include" / "nccl_device.h").is_file():
            return Path(loc) / "include"
    return None


needs_wheel = pytest.mark.skipif(_wheel_include() is None, reason="no nvidia-nccl wheel installed")


def _fake_headers(d: Path, code: int) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "nccl.h").write_text(f"#pragma once\n#define NCCL_VERSION_CODE {code}\n")
    (d / "nccl_device.h").write_text("#pragma once\n")
    return d


def test_own_include_dir_holds_device_header() -> None:
    d = Path(ep_nccl_gin.own_include_dir())
    assert (d / "ep_nccl_gin" / "device.cuh").is_file()


@needs_wheel
def test_nccl_include_dir_is_the_wheels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EPKIT_NCCL_INCLUDE_DIR", raising=False)
    d = Path(ep_nccl_gin.nccl_include_dir())
    assert (d / "nccl.h").is_file() and (d / "nccl_device.h").is_file()
    assert (d / "nccl_device" / "lsa_barrier.h").is_file()
    dirs = ep_nccl_gin.include_dirs()
    assert dirs == [str(d), ep_nccl_gin.own_include_dir()]


@needs_wheel
def test_headers_of_the_loaded_library_match_its_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EPKIT_NCCL_INCLUDE_DIR", raising=False)
    if not ep_nccl_gin.is_available():
        pytest.skip("no loadable NCCL library")
    loaded = ep_nccl_gin.load()
    d = ep_nccl_gin.nccl_include_dir()
    if loaded.path:
        assert Path(d).resolve() == (Path(loaded.path).resolve().parent.parent / "include").resolve()
    assert ep_nccl_gin.nccl_header_version(d) == loaded.runtime


def test_env_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = ep_nccl_gin.load().runtime if ep_nccl_gin.is_available() else NcclVersion(2, 28, 9)
    good = _fake_headers(tmp_path / "good", runtime.code)
    monkeypatch.setenv("EPKIT_NCCL_INCLUDE_DIR", str(good))
    assert ep_nccl_gin.nccl_include_dir() == str(good)
    assert ep_nccl_gin.include_dirs()[0] == str(good)
    assert ep_nccl_gin.nccl_header_version() == runtime

    monkeypatch.setenv("EPKIT_NCCL_INCLUDE_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(NcclHeadersNotFoundError, match="EPKIT_NCCL_INCLUDE_DIR"):
        ep_nccl_gin.nccl_include_dir()


def test_include_dirs_enforces_the_header_library_rule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not ep_nccl_gin.is_available():
        pytest.skip("the rule is checked against a loaded library")
    runtime = ep_nccl_gin.load().runtime
    other = NcclVersion(2, 28, 9) if runtime != NcclVersion(2, 28, 9) else NcclVersion(2, 28, 7)
    monkeypatch.setenv("EPKIT_NCCL_INCLUDE_DIR", str(_fake_headers(tmp_path / "old", other.code)))
    with pytest.raises(NcclVersionError, match=str(other)):
        ep_nccl_gin.include_dirs()
    assert ep_nccl_gin.include_dirs(check=False)[0] == str(tmp_path / "old")


def test_no_headers_anywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    from ep_nccl_gin import headers

    monkeypatch.delenv("EPKIT_NCCL_INCLUDE_DIR", raising=False)
    for finder in ("_from_loaded_library", "_from_pathfinder", "_from_wheel_namespace"):
        monkeypatch.setattr(headers, finder, lambda: None)
    with pytest.raises(NcclHeadersNotFoundError, match=r"ep-nccl-gin\[cu13\]"):
        ep_nccl_gin.nccl_include_dir()
