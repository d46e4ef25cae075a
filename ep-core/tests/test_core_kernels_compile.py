"""CPU: the kernel sources compile for sm_90a through the real JIT path (ep_jit.compile with nvcc), for bf16 and
FP8 dispatch, several rank counts and top-k, and the nccl transport (LSA pointers) when NCCL headers exist."""

from __future__ import annotations

import shutil

import pytest
from ep_core.kernels._source import (
    DISPATCH_ZERO_COPY_KERNEL,
    KERNEL_NAMES,
    ZERO_COPY_KERNEL,
    compile_kernels,
    kernel_source,
)
from ep_core.kernels.plan import KernelConfig

ep_jit = pytest.importorskip("ep_jit")


def _have_nvcc() -> bool:
    import os

    home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    return shutil.which("nvcc") is not None or os.path.exists(os.path.join(home, "bin", "nvcc"))


pytestmark = pytest.mark.skipif(not _have_nvcc(), reason="nvcc not found")


@pytest.fixture(autouse=True)
def _cache(shared_jit_cache):
    """These tests check the artifacts only: one cache for the test process (conftest.py)."""


@pytest.mark.parametrize(
    "cfg",
    [
        KernelConfig(8, 8, 7168),
        KernelConfig(2, 6, 512, 1, 4),
        KernelConfig(1, 32, 256),
    ],
    ids=["ep8-bf16-h7168", "ep2-fp8-k6", "ep1-k32"],
)
def test_kernels_compile_sm90a(cfg: KernelConfig) -> None:
    art = compile_kernels(cfg, arch="sm_90a")
    data = art.cubin_path.read_bytes()
    assert data[:4] == b"\x7fELF"
    for name in KERNEL_NAMES:  # the names DeepEP-style profilers look up (test_core_kernel_names)
        assert name.encode() in data
    assert set(KERNEL_NAMES) <= set(art.kernel_names)
    assert ZERO_COPY_KERNEL in art.kernel_names  # direct mode: the zero-copy combine too
    assert DISPATCH_ZERO_COPY_KERNEL in art.kernel_names  # and the zero-copy dispatch


def test_nccl_transport_compiles() -> None:
    pytest.importorskip("ep_nccl_gin")
    try:
        import ep_nccl_gin

        ep_nccl_gin.include_dirs(check=False)
    except Exception as e:  # no NCCL headers on this machine
        pytest.skip(f"no NCCL device headers: {e}")
    cfg = KernelConfig(4, 8, 1024, transport="nccl")
    assert "EP_CORE_WITH_NCCL" in kernel_source(cfg)
    art = compile_kernels(cfg, arch="sm_90a")
    assert art.cubin_path.read_bytes()[:4] == b"\x7fELF"


@pytest.mark.parametrize(
    "cfg",
    [
        KernelConfig(4, 8, 1024, num_scaleup_ranks=2),
        KernelConfig(16, 8, 512, 1, 4, num_scaleup_ranks=8),
    ],
    ids=["hybrid-2x2-bf16", "hybrid-2x8-fp8"],
)
def test_hybrid_kernels_compile_sm90a(cfg: KernelConfig) -> None:
    """The hybrid kernels (include/ep_core/hybrid.cuh) with the emulated scale-out put, under the same names."""
    assert cfg.is_hybrid and cfg.scaleout == "emulated"
    src = kernel_source(cfg)
    assert "hybrid" in src
    assert cfg.defines()["EP_CORE_NUM_SCALEUP_RANKS"] == cfg.num_scaleup_ranks
    art = compile_kernels(cfg, arch="sm_90a")
    assert art.cubin_path.read_bytes()[:4] == b"\x7fELF"
    assert set(KERNEL_NAMES) <= set(art.kernel_names)
    assert ZERO_COPY_KERNEL not in art.kernel_names  # direct mode only
    assert "_su" in art.cubin_path.parent.name


def test_hybrid_gin_scaleout_compiles() -> None:
    """The GIN scale-out put (NCCL GIN puts and strong VA signals) builds against the NCCL wheel's device headers;
    it is never run here (no RDMA NIC)."""
    pytest.importorskip("ep_nccl_gin")
    try:
        import ep_nccl_gin

        ep_nccl_gin.include_dirs(check=False)
    except Exception as e:  # no NCCL headers on this machine
        pytest.skip(f"no NCCL device headers: {e}")
    cfg = KernelConfig(8, 8, 1024, transport="nccl", num_scaleup_ranks=4)
    assert cfg.scaleout == "gin" and cfg.defines()["EP_CORE_SCALEOUT"] == "ep_core::GinScaleout"
    art = compile_kernels(cfg, arch="sm_90a")
    assert art.cubin_path.read_bytes()[:4] == b"\x7fELF"
    assert set(KERNEL_NAMES) <= set(art.kernel_names)
