"""Every header compiles on its own with g++ (host) and nvcc (sm_90a device code); the umbrella with NVRTC."""

from __future__ import annotations

from pathlib import Path

import pytest

INCLUDE_DIR = Path(__file__).resolve().parents[1] / "include"

EXPECTED_HEADERS = [
    "buffer_composition.cuh",
    "buffer_layout.cuh",
    "config.cuh",
    "ep_layout.cuh",
    "math.cuh",
    "token_layout.cuh",
    "version.cuh",
    "workspace_layout.cuh",
]

# Device code touching every struct, getter and template of the umbrella, with compile-time checks.
DEVICE_USE = r"""
#include <ep_layout/ep_layout.cuh>

namespace el = ep_layout;

static_assert(EP_LAYOUT_VERSION_MAJOR >= 1, "version");
static_assert(el::make_dispatch_token_layout(7168, 2, 0, 8).get_num_bytes<true>() == 14496, "token");
static_assert(el::WorkspaceLayout::get_num_aligned_bytes() == 14 * 1024 * 1024, "workspace");

__global__ void use_layouts(const el::TokenLayout token, const el::DirectDispatchBuffers direct,
                            const el::HybridCombineBuffers hybrid, el::WorkspaceLayout workspace, long long* out) {
    extern __shared__ __align__(128) unsigned char smem[];
    const el::BufferLayout<true> staged(token, 1, 4, smem);
    unsigned char* slot = staged.get_token_buffer<unsigned char>(threadIdx.x % 4);
    token.get_topk_idx_ptr(slot)[0] = 1;
    token.get_topk_weights_ptr(slot)[0] = 0.5f;
    token.get_src_token_idx_ptr(slot)[0] = 2;
    token.get_linked_list_idx_ptr(slot)[0] = 3;
    token.get_sf_ptr(slot)[0] = 4u;
    token.get_hidden_ptr<int4>(slot)[0] = make_int4(0, 0, 0, 0);
    *token.get_mbarrier_ptr(slot) = 0;
    const el::BufferLayout<> recv = direct.recv.get_rank_buffer(blockIdx.x).get_channel_buffer<8>(threadIdx.x);
    const int* ids = token.get_topk_idx_ptr(static_cast<const void*>(recv.get_token_buffer(0)));
    atomicAdd(workspace.get_barrier_signal_ptr(0, blockIdx.x), ids[0]);
    atomicAdd(workspace.get_channel_tail_ptr(threadIdx.x, blockIdx.x, 8), 1);
    atomicAdd(reinterpret_cast<unsigned long long*>(workspace.get_rank_count_recv_ptr()), el::kCountValidFlag | 1);
    el::ErrorRecord* err = workspace.get_error_record_ptr();
    if (atomicCAS(&err->abort_flag, 0, static_cast<int>(el::ErrorKind::kTimeout)) == 0) err->rank = blockIdx.x;
    workspace.get_reserved_ptr()[threadIdx.x] = 0;
    out[0] = hybrid.get_num_bytes() + direct.get_num_bytes() + token.get_num_bytes<false, long long>() +
             el::size_hint_bytes(el::Topology(16, 8, true), 128, 4096, 8, true, false) +
             el::workspace_region_offset(el::WorkspaceRegion::kReserved);
}
"""


def test_header_set_is_complete() -> None:
    assert sorted(p.name for p in (INCLUDE_DIR / "ep_layout").glob("*")) == EXPECTED_HEADERS


@pytest.mark.parametrize("header", EXPECTED_HEADERS)
def test_header_compiles_alone_with_host_compiler(run_cmd, cxx: str, header: str, tmp_path: Path) -> None:
    src = tmp_path / "tu.cpp"
    # Included twice: #pragma once must hold.
    src.write_text(
        f"#include <ep_layout/{header}>\n#include <ep_layout/{header}>\nint main() {{ return 0; }}\n"
    )
    flags = ["-std=c++17", "-Wall", "-Wextra", "-Wpedantic", "-Werror", "-fsyntax-only"]
    run_cmd([cxx, *flags, f"-I{INCLUDE_DIR}", str(src)])


def test_umbrella_compiles_as_cxx20(run_cmd, cxx: str, tmp_path: Path) -> None:
    src = tmp_path / "tu.cpp"
    src.write_text("#include <ep_layout/ep_layout.cuh>\nint main() { return 0; }\n")
    run_cmd([cxx, "-std=c++20", "-Wall", "-Wextra", "-Werror", "-fsyntax-only", f"-I{INCLUDE_DIR}", str(src)])


@pytest.mark.parametrize("header", EXPECTED_HEADERS)
def test_header_compiles_alone_with_nvcc(run_cmd, nvcc: str, header: str, tmp_path: Path) -> None:
    src = tmp_path / "tu.cu"
    src.write_text(f"#include <ep_layout/{header}>\n__global__ void k(int* p) {{ *p = 1; }}\n")
    run_cmd(
        [
            nvcc,
            "-std=c++17",
            "-arch=sm_90a",
            "-Werror",
            "all-warnings",
            f"-I{INCLUDE_DIR}",
            "-c",
            str(src),
            "-o",
            str(tmp_path / "tu.o"),
        ]
    )


def test_layouts_usable_in_device_code_with_nvcc(run_cmd, nvcc: str, tmp_path: Path) -> None:
    src = tmp_path / "use.cu"
    src.write_text(DEVICE_USE)
    run_cmd(
        [nvcc, "-std=c++17", "-arch=sm_90a", f"-I{INCLUDE_DIR}", "-c", str(src), "-o", str(tmp_path / "u.o")]
    )


def _load_nvrtc():
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings is not installed")
    try:
        err, major, minor = nvrtc.nvrtcVersion()
    except (
        Exception
    ) as exc:  # the bindings are there but libnvrtc is not (no toolkit, no nvidia-cuda-nvrtc wheel)
        pytest.skip(f"cuda-bindings present but libnvrtc could not be loaded: {exc}".splitlines()[0])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS
    return nvrtc, (major, minor)


def test_umbrella_compiles_with_nvrtc() -> None:
    nvrtc, _ = _load_nvrtc()
    # The headers come from disk through the include path (as ep-jit compiles them); no host standard library.
    err, prog = nvrtc.nvrtcCreateProgram(DEVICE_USE.encode(), b"use.cu", 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS
    opts = [b"--std=c++17", b"--gpu-architecture=sm_90a", f"--include-path={INCLUDE_DIR}".encode()]
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    _, size = nvrtc.nvrtcGetProgramLogSize(prog)
    log = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, log)
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, log.decode(errors="replace")
    err, cubin_size = nvrtc.nvrtcGetCUBINSize(prog)
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS and cubin_size > 0
    nvrtc.nvrtcDestroyProgram(prog)
