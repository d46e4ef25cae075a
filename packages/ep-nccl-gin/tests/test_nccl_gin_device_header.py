"""ep_nccl_gin/device.cuh compiles with nvcc for sm_90a against the installed NCCL wheel's headers, and its
Context layout is what DevComm.context_bytes() packs."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import ep_nccl_gin
import pytest

KERNEL = r"""
#include <ep_nccl_gin/device.cuh>

extern "C" __global__ void nccl_gin_probe(ep_nccl_gin::Context ctx, unsigned long long* out) {
  ep_nccl_gin::Transport t(ctx);
  unsigned int* local = reinterpret_cast<unsigned int*>(ctx.base);
  unsigned int* mine = t.sym_ptr(local, t.rank());
  if (mine != nullptr) mine[threadIdx.x] = threadIdx.x;
  t.barrier(blockIdx.x);
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    out[0] = t.is_lsa_peer(t.num_ranks() - 1);
    t.put(ctx.base + 256, ctx.base, 128, 0);
    t.put_signal(ctx.base + 256, ctx.base, 128, 0, 0);
    t.put_value(reinterpret_cast<unsigned long long*>(ctx.base), 7ull, 0);
    t.signal(0, 1, 2);
    t.wait(0, 1);
    out[1] = t.read_signal(1);
    out[2] = t.try_wait(1, 3, 1000000ull);
    t.reset_signal(1);
    t.flush();
  }
}
"""

LAYOUT = r"""
#include <cstdio>
#include <ep_nccl_gin/device.cuh>
int main() {
  std::printf("%zu %zu %zu %zu %zu\n", sizeof(ncclDevComm), offsetof(ep_nccl_gin::Context, window),
              offsetof(ep_nccl_gin::Context, base), offsetof(ep_nccl_gin::Context, num_bytes),
              sizeof(ep_nccl_gin::Context));
  return 0;
}
"""


def _wheel_present() -> bool:
    spec = importlib.util.find_spec("nvidia.nccl")
    return spec is not None and bool(spec.submodule_search_locations)


pytestmark = pytest.mark.skipif(not _wheel_present(), reason="no nvidia-nccl wheel installed")


def _nvcc() -> str:
    found = shutil.which("nvcc")
    if found is None:
        try:
            from cuda.pathfinder import find_nvidia_binary_utility

            found = find_nvidia_binary_utility("nvcc")
        except Exception:
            found = None
    if found is None:
        pytest.fail(
            "nvcc not found (PATH or cuda.pathfinder): the CUDA toolkit is needed to build ep-nccl-gin too"
        )
    return found


def _include_flags() -> list[str]:
    return [f"-I{d}" for d in ep_nccl_gin.include_dirs()]


def test_device_header_compiles_for_sm90a(tmp_path: Path) -> None:
    src = tmp_path / "probe.cu"
    src.write_text(KERNEL)
    out = tmp_path / "probe.cubin"
    proc = subprocess.run(
        [_nvcc(), "-std=c++17", "-arch=sm_90a", "-cubin", *_include_flags(), str(src), "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert out.stat().st_size > 0
    assert b"nccl_gin_probe" in out.read_bytes()


def test_context_layout_matches_host_packing(tmp_path: Path) -> None:
    src = tmp_path / "layout.cu"
    src.write_text(LAYOUT)
    exe = tmp_path / "layout"
    proc = subprocess.run(
        [_nvcc(), "-std=c++17", *_include_flags(), str(src), "-o", str(exe)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60, check=True)
    devcomm, window, base, num_bytes, total = map(int, run.stdout.split())
    pad = (-devcomm) % 8
    assert (window, base, num_bytes, total) == (
        devcomm + pad,
        devcomm + pad + 8,
        devcomm + pad + 16,
        devcomm + pad + 24,
    )
    if ep_nccl_gin.is_available():
        from ep_nccl_gin import _impl

        loaded = ep_nccl_gin.load()
        if loaded.header == loaded.runtime:
            # The extension and the JIT see the same headers: the struct sizes agree.
            assert _impl.dev_comm_header_size() == devcomm


def test_device_header_compiles_through_ep_jit() -> None:
    ep_jit = pytest.importorskip("ep_jit")
    art = ep_jit.compile(
        KERNEL, name="nccl_gin_probe", include_dirs=ep_nccl_gin.include_dirs(), arch="sm_90a"
    )
    assert Path(art.cubin_path).stat().st_size > 0
