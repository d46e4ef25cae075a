"""CPU: the phase-timing instrument (include/ep_core/phase_timing.cuh, issue 17) compiles into every kernel
configuration when EP_CORE_PHASE_TIMING=1 (direct, FP8, deterministic paths, hybrid) and is absent by default."""

from __future__ import annotations

import os
import shutil

import pytest
from ep_core.kernels import _source
from ep_core.kernels._source import KERNEL_NAMES, compile_kernels
from ep_core.kernels.plan import KernelConfig

ep_jit = pytest.importorskip("ep_jit")

SYMBOL = b"ep_core_phase_ts"


def _have_nvcc() -> bool:
    home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    return shutil.which("nvcc") is not None or os.path.exists(os.path.join(home, "bin", "nvcc"))


@pytest.fixture(autouse=True)
def _cache(shared_jit_cache):
    """These tests check the artifacts only: one cache for the test process (conftest.py)."""


def test_env_switch(monkeypatch) -> None:
    monkeypatch.delenv(_source.PHASE_TIMING_ENV, raising=False)
    assert not _source.phase_timing_enabled()
    monkeypatch.setenv(_source.PHASE_TIMING_ENV, "0")
    assert not _source.phase_timing_enabled()
    monkeypatch.setenv(_source.PHASE_TIMING_ENV, "1")
    assert _source.phase_timing_enabled()


@pytest.mark.skipif(not _have_nvcc(), reason="nvcc not found")
@pytest.mark.parametrize(
    "cfg",
    [
        KernelConfig(8, 8, 7168),
        KernelConfig(1, 8, 7168),
        KernelConfig(2, 6, 512, 1, 4),
        KernelConfig(4, 8, 1024, num_scaleup_ranks=2),
    ],
    ids=["ep8-bf16", "ep1-bf16", "ep2-fp8", "hybrid-2x2"],
)
def test_phase_timing_compiles(cfg: KernelConfig, monkeypatch) -> None:
    monkeypatch.setenv(_source.PHASE_TIMING_ENV, "1")
    art = compile_kernels(cfg, arch="sm_90a")
    data = art.cubin_path.read_bytes()
    assert data[:4] == b"\x7fELF"
    assert SYMBOL in data
    assert set(KERNEL_NAMES) <= set(art.kernel_names)
    assert art.name.endswith("_phases")  # its own cache entry, never mixed with the plain build


@pytest.mark.skipif(not _have_nvcc(), reason="nvcc not found")
def test_phase_timing_off_by_default(monkeypatch) -> None:
    monkeypatch.delenv(_source.PHASE_TIMING_ENV, raising=False)
    art = compile_kernels(KernelConfig(8, 8, 7168), arch="sm_90a")
    assert SYMBOL not in art.cubin_path.read_bytes()
