"""LogFMT-10 (``low_latency_combine(use_logfmt=True)``, issue 44): the numpy model ``ep_torch.legacy.logfmt`` (error
bound, nearest level, zeros, signs, all-equal / >= 1 / Inf / NaN groups kept in bf16, tiny and subnormal
magnitudes, chunking), its torch twin bitwise equal to it, the CPU backend's combine on 2 and 4 gloo ranks bitwise
against ``legacy.reference.ll_combine_reference(use_logfmt=True)``, and, marker ``gpu``, the native kernels
(``ep_lln_combine_*_logfmt``) and the CUDA adapter bitwise against the same model."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
from ep_core.errors import EPValueError
from ep_torch.launch import spawn
from ep_torch.legacy import logfmt
from ep_torch.legacy.reference import bf16_to_f32, f32_to_bf16, ll_combine_reference

# worst relative error of an encoded value above the clip: half a level of the widest step (32 / 510 in log2)
_BOUND = 2.0 ** (32.0 / 510 / 2) - 1 + 1e-6


def _rows(rng: np.random.Generator, r: int, h: int, scale: float = 0.1) -> np.ndarray:
    return f32_to_bf16((rng.standard_normal((r, h)) * scale).astype(np.float32))


def _b16(v: float) -> int:
    return int(f32_to_bf16(np.array([v], np.float32))[0])


def _u32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def _cast_mask(bits: np.ndarray) -> np.ndarray:
    enc = logfmt.encode(bits)
    return np.repeat(enc.cast, logfmt.chunk_size(bits.shape[-1]), axis=-1)


# ---------------------------------------------------------------------------------------------------------------------
# the model


@pytest.mark.parametrize("h", [512, 1024, 1536, 7168])
def test_roundtrip_error_bound_and_nearest_level(h):
    rng = np.random.default_rng(h)
    bits = _rows(rng, 16, h)
    x = bf16_to_f32(bits).astype(np.float64)
    got = logfmt.roundtrip(bits).astype(np.float64)
    assert _cast_mask(bits).all(), "magnitudes below 1 with a spread: every chunk is encoded"
    rel = np.abs(got - x) / np.abs(x)
    assert rel.max() <= _BOUND, rel.max()
    assert rel.max() > 1e-3, "the values were really encoded (LogFMT-10 is coarser than bf16)"
    # the decoded value is the level nearest in the linear domain (up to float32 evaluation)
    enc = logfmt.encode(bits)
    meta = enc.meta.astype(np.int64)
    amax, amin = meta & 0xFFFF, meta >> 16
    lmax = np.log2(bf16_to_f32(amax.astype(np.uint16)).astype(np.float64))
    lmin = np.maximum(np.log2(bf16_to_f32(amin.astype(np.uint16)).astype(np.float64)), lmax - 32)
    step = np.repeat((lmax - lmin) / 510, 128, axis=-1)
    lm = np.repeat(lmin, 128, axis=-1)
    level = np.floor((np.log2(np.abs(x)) - lm) / step)
    lo, hi = 2.0 ** (lm + level * step), 2.0 ** (lm + (level + 1) * step)
    best = np.where(np.abs(np.abs(x) - lo) <= np.abs(hi - np.abs(x)), lo, hi)
    close = np.abs(np.abs(got) - best) <= 1e-5 * best  # float32 lmin + c * step: ~1e-6 relative
    tie = np.abs(np.abs(np.abs(x) - lo) - np.abs(hi - np.abs(x))) <= 1e-5 * np.abs(x)
    assert (close | tie).all(), np.argwhere(~(close | tie))[:3]


def test_torch_twin_equals_numpy_bitwise():
    rng = np.random.default_rng(5)
    for h in (512, 1536, 2048):
        bits = np.concatenate([_rows(rng, 40, h, s) for s in (1e-3, 0.2, 0.9, 3.0, 1e-38)])
        bits[0, :200] = 0
        bits[1, 3] = 0x7FC0  # NaN
        bits[2, 7] = 0xFF80  # -Inf
        bits[3, :128] = 0x3E80  # one all-equal group
        bits[4, 17] = 0x8000  # -0
        bits[5, :] = rng.integers(0, 1 << 16, h)  # any bits
        want = logfmt.roundtrip(bits)
        got = logfmt.roundtrip_torch(torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16))
        assert got.dtype == torch.float32
        assert np.array_equal(_u32(got.numpy()), _u32(want)), h


def test_zeros_and_signs():
    rng = np.random.default_rng(1)
    bits = _rows(rng, 4, 1024)
    bits[:, ::7] = 0
    bits[:, 1::11] = 0x8000  # -0
    got = logfmt.roundtrip(bits)
    x = bf16_to_f32(bits)
    assert _cast_mask(bits).all(), "a group with zeros is still encoded (lmin = lmax - 32)"
    assert (got[x == 0] == 0).all()
    assert (np.signbit(got) == np.signbit(x)).all(), "the sign bit travels (also -0)"
    nz = x != 0
    assert (np.abs(got[nz] - x[nz]) <= _BOUND * np.abs(x[nz])).all()


def test_plain_groups_keep_their_chunk_exact():
    """All-zero, all-equal, >= 1, Inf and NaN groups send their whole chunk (1024 channels here) as bf16."""
    rng = np.random.default_rng(2)
    bits = _rows(rng, 6, 4096)
    bits[0, 0:128] = 0  # all zero: chunk 0
    bits[1, 1024:1152] = f32_to_bf16(np.full(128, -0.375, np.float32))  # all equal magnitude: chunk 1
    bits[1, 1024:1152:2] ^= 0x8000  # (signs differ, magnitudes equal)
    bits[2, 2100] = _b16(1.0)  # amax >= 1: chunk 2
    bits[3, 3000] = 0x7F80  # +Inf: chunk 2
    bits[4, 10] = 0x7FC1  # NaN: chunk 0
    bits[5, 4095] = _b16(-300.0)  # chunk 3
    plain = {(0, 0), (1, 1), (2, 2), (3, 2), (4, 0), (5, 3)}
    enc = logfmt.encode(bits)
    assert {tuple(v) for v in np.argwhere(~enc.cast)} == plain
    got, x = logfmt.roundtrip(bits), bf16_to_f32(bits)
    for r, c in plain:
        s = slice(1024 * c, 1024 * (c + 1))
        assert np.array_equal(_u32(got[r, s]), _u32(x[r, s])), (r, c)
    assert np.isnan(got[4, 10]) and _u32(got[4, 10:11])[0] == 0x7FC10000, "NaN payload kept"
    for r in range(6):  # the other chunks are encoded
        for c in range(4):
            if (r, c) not in plain:
                s = slice(1024 * c, 1024 * (c + 1))
                assert not np.array_equal(_u32(got[r, s]), _u32(x[r, s])), (r, c)


def test_chunk_size_follows_hidden():
    assert [logfmt.chunk_size(h) for h in (512, 1024, 1536, 2560, 7168)] == [512, 1024, 512, 512, 1024]
    rng = np.random.default_rng(3)
    bits = _rows(rng, 1, 1536)
    bits[0, 600] = _b16(2.0)
    assert logfmt.encode(bits).cast.tolist() == [[True, False, True]]
    for bad in (128, 384, 1000):
        with pytest.raises(EPValueError, match="hidden % 512"):
            logfmt.roundtrip(np.zeros((1, bad), np.uint16))


def test_tiny_and_subnormal_magnitudes():
    rng = np.random.default_rng(4)
    for scale in (1e-20, 1e-37, 1e-39):  # 1e-39: bf16 subnormals, decoded to fp32 subnormals
        bits = _rows(rng, 4, 512, scale)
        x = bf16_to_f32(bits).astype(np.float64)
        got = logfmt.roundtrip(bits).astype(np.float64)
        assert _cast_mask(bits).all(), scale
        nz = x != 0
        enc = logfmt.encode(bits)
        amax = bf16_to_f32((enc.meta & 0xFFFF).astype(np.uint16)).astype(np.float64)
        big = nz & (np.abs(x) >= np.repeat(amax, 128, -1) * 2.0**-31)
        # levels below 2**-126 are fp32 subnormals: an absolute error of half an fp32 subnormal step on top
        err = np.abs(got - x)
        assert (err[big] <= _BOUND * np.abs(x[big]) + 2.0**-150).all(), scale
        assert (np.sign(got[big]) == np.sign(x[big])).all()
    bits = np.zeros((1, 512), np.uint16)
    bits[0, ::128] = _b16(0.5)  # every group of the chunk castable (an all-zero group would keep it plain)
    bits[0, 1] = _b16(0.5 * 2.0**-40)  # below the clip (amax * 2**-32): zero
    bits[0, 2] = _b16(0.5 * 2.0**-32)  # the clip itself: the lowest level
    got = logfmt.roundtrip(bits)[0]
    assert got[1] == 0 and abs(got[2] / (0.5 * 2.0**-32) - 1) < 1e-6 and abs(got[0] / 0.5 - 1) < 1e-6


def test_extremes_of_a_group_are_exact_levels():
    """amax and amin are levels themselves (codes 511 and 1): decoded within the float32 evaluation."""
    rng = np.random.default_rng(6)
    bits = _rows(rng, 8, 1024, 0.3)
    x = bf16_to_f32(bits).reshape(8, 8, 128)
    got = logfmt.roundtrip(bits).reshape(8, 8, 128)
    a = np.abs(x)
    for idx in (a.argmax(-1), a.argmin(-1)):
        want = np.take_along_axis(x, idx[..., None], -1)
        have = np.take_along_axis(got, idx[..., None], -1)
        assert (np.abs(have / want - 1) < 1e-6).all()


def test_log2_and_exp2_of_the_model():
    b = np.arange(1, 0x7F80)  # every positive finite bf16
    want = np.log2(bf16_to_f32(b.astype(np.uint16)).astype(np.float64))
    assert np.abs(logfmt.log2_bf16(b) - want).max() < 2e-5  # one fp32 rounding of |log2| <= 133
    y = np.linspace(-170, -1e-3, 200001).astype(np.float32)
    got = logfmt.exp2_model(y).astype(np.float64)
    ref = np.exp2(y.astype(np.float64))
    normal = ref >= 2.0**-126
    assert (np.abs(got / ref - 1)[normal] < 2e-7).all()
    assert (np.abs(got - ref)[~normal] <= 2.0**-150 + 2e-7 * ref[~normal]).all()  # + half a subnormal step


def test_reference_combine_with_logfmt():
    rng = np.random.default_rng(8)
    t, k, h = 6, 4, 1024
    y = _rows(rng, t * k, h).reshape(t, k, h)
    idx = rng.integers(-1, 8, (t, k))
    w = rng.random((t, k)).astype(np.float32)
    got = ll_combine_reference(y, idx, w, use_logfmt=True)
    dec = logfmt.roundtrip(y)
    acc = np.zeros((t, h), np.float32)
    for j in range(k):
        acc = np.where(
            (idx[:, j] >= 0)[:, None], (acc + (dec[:, j] * w[:, j : j + 1]).astype(np.float32)), acc
        )
    assert np.array_equal(got, f32_to_bf16(acc.astype(np.float32)))
    assert not np.array_equal(got, ll_combine_reference(y, idx, w))


# ---------------------------------------------------------------------------------------------------------------------
# the native kernels' arithmetic (ep_core/ll_logfmt.cuh), compiled for the host: the send's group words, chunk
# decision and 5-word packing, then the receive's decoding, bitwise equal to the model

_HOST_LOGFMT = r"""
#include <ep_core/ll_logfmt.cuh>
#include <cstdio>
#include <vector>
int main(int argc, char** argv) {
  const int rows = atoi(argv[1]), hidden = atoi(argv[2]);
  std::vector<uint16_t> in((size_t)rows * hidden);
  std::vector<float> out((size_t)rows * hidden);
  FILE* f = fopen(argv[3], "rb");
  if (fread(in.data(), 2, in.size(), f) != in.size()) return 2;
  fclose(f);
  const int ch = ep_lfmt::chunk_size(hidden), groups = hidden / 128;
  for (int r = 0; r < rows; ++r) {
    const uint16_t* x = in.data() + (size_t)r * hidden;
    std::vector<uint32_t> meta(groups);
    for (int g = 0; g < groups; ++g) {
      uint32_t amax = 0, amin = 0xFFFF;
      for (int i = 0; i < 128; ++i) {
        const uint32_t a = x[g * 128 + i] & 0x7FFFu;
        amax = a > amax ? a : amax;
        amin = a < amin ? a : amin;
      }
      meta[g] = amax | (amin << 16);
    }
    for (int c0 = 0; c0 < hidden; c0 += ch) {
      bool enc = true;
      for (int g = c0 / 128; g < (c0 + ch) / 128; ++g) enc = enc && ep_lfmt::group_ok(meta[g]);
      for (int u = c0; u < c0 + ch; u += 16) {
        if (!enc) {
          for (int i = 0; i < 16; ++i) out[(size_t)r * hidden + u + i] = ep_ll::u2f((uint32_t)x[u + i] << 16);
          continue;
        }
        const ep_lfmt::Params q = ep_lfmt::params(meta[u / 128]);
        uint32_t words[8], packed[5];
        for (int i = 0; i < 8; ++i) words[i] = x[u + 2 * i] | ((uint32_t)x[u + 2 * i + 1] << 16);
        ep_lfmt::pack16(words, q, packed);
        for (int i = 0; i < 16; ++i) out[(size_t)r * hidden + u + i] = ep_lfmt::unpack_one(packed, i, q);
      }
    }
  }
  fwrite(out.data(), 4, out.size(), stdout);
  return 0;
}
"""


def _nvcc() -> str | None:
    import os
    import shutil

    home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    path = os.path.join(home, "bin", "nvcc")
    return path if os.path.exists(path) else shutil.which("nvcc")


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found")
def test_native_arithmetic_equals_model_on_host(tmp_path):
    from ep_core.kernels._source import get_include

    src = tmp_path / "lf.cu"
    src.write_text(_HOST_LOGFMT)
    exe = tmp_path / "lf"
    subprocess.run([_nvcc(), "-std=c++17", "-O2", "-I", get_include(), str(src), "-o", str(exe)], check=True)
    rng = np.random.default_rng(11)
    for h in (1024, 1536):
        bits = np.concatenate([_rows(rng, 24, h, s) for s in (1e-3, 0.2, 0.9, 3.0, 1e-38, 1e-40)])
        bits[0, :300] = 0
        bits[1, 3] = 0x7FC0
        bits[2, :128] = 0x3E80
        bits[3, 17] = 0x8000
        bits[4, :] = rng.integers(0, 1 << 16, h)
        bits[5, 1::2] = 0x0001  # the smallest subnormal
        path = tmp_path / "in.bin"
        bits.astype(np.uint16).tofile(path)
        run = subprocess.run(
            [str(exe), str(bits.shape[0]), str(h), str(path)], capture_output=True, check=True
        )
        got = np.frombuffer(run.stdout, dtype=np.float32).reshape(bits.shape)
        want = logfmt.roundtrip(bits)
        bad = np.argwhere(_u32(got) != _u32(want))
        assert not bad.size, (
            f"h={h}: {len(bad)} differ, first {tuple(bad[0])}: {got[tuple(bad[0])]} {want[tuple(bad[0])]}"
        )


_WARP_EMULATION = r"""
// ep_lfmt::encode_chunk_warp (the native send's per-warp code) on 32 host threads, std::barrier for the warp
// collectives, then ep_lfmt::load8 (the receive's) for every 8 channels: the slot bytes and group words as the
// kernels write and read them.
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

struct dim3e { unsigned x = 1, y = 1, z = 1; };
thread_local dim3e threadIdx, blockIdx;
dim3e blockDim, gridDim;
static std::barrier<>* g_warp;
static unsigned g_vals[32];

#define EP_LL_HOST_EMULATION 1
#define EP_LL_DYNAMIC_SMEM(type, name) static type name[65536]
#define __global__
#define __device__
#define __host__
#define __shared__ static
#define __launch_bounds__(...)
struct int4 { int x, y, z, w; };
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
struct float4 { float x, y, z, w; };
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline int4 make_int4(int a, int b, int c, int d) { return {a, b, c, d}; }
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline void __syncthreads() { g_warp->arrive_and_wait(); }
inline unsigned exchange(unsigned v, unsigned src_lane) {
  g_warp->arrive_and_wait();
  g_vals[threadIdx.x] = v;
  g_warp->arrive_and_wait();
  const unsigned r = g_vals[src_lane];
  g_warp->arrive_and_wait();
  return r;
}
inline unsigned __ballot_sync(unsigned, bool pred) {
  unsigned r = 0;
  for (unsigned l = 0; l < 32; ++l) r |= (exchange(pred ? 1u : 0u, l) & 1u) << l;
  return r;
}
inline bool __all_sync(unsigned m, bool pred) { return __ballot_sync(m, !pred) == 0u; }
inline unsigned __shfl_xor_sync(unsigned, unsigned v, int d) { return exchange(v, threadIdx.x ^ (unsigned)d); }
inline float __shfl_xor_sync(unsigned, float v, int d) {
  return __uint_as_float(exchange(__float_as_uint(v), threadIdx.x ^ (unsigned)d));
}
inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
struct __nv_bfloat162 { uint16_t x, y; };
inline __nv_bfloat162 __floats2bfloat162_rn(float, float) { return {0, 0}; }

#include <ep_core/ll_logfmt.cuh>

int main(int argc, char** argv) {
  const int rows = atoi(argv[1]), hidden = atoi(argv[2]);
  std::vector<uint16_t> in((size_t)rows * hidden);
  FILE* f = fopen(argv[3], "rb");
  if (fread(in.data(), 2, in.size(), f) != in.size()) return 2;
  fclose(f);
  const int nch = hidden / ep_lfmt::chunk_size(hidden), groups = hidden / 128;
  std::vector<float> out((size_t)rows * hidden);
  std::vector<uint8_t> slot(hidden * 2 + 64);
  std::vector<uint32_t> meta(groups);
  blockDim = {32, 1, 1};
  for (int r = 0; r < rows; ++r) {
    std::memset(slot.data(), 0xA5, slot.size());  // stale bytes: an encoded chunk leaves 6/16 of its span alone
    for (auto& m : meta) m = 0xDEADBEEFu;
    const uint4* src = reinterpret_cast<const uint4*>(in.data() + (size_t)r * hidden);
    std::barrier<> wb(32);
    g_warp = &wb;
    std::vector<std::thread> ts;
    for (unsigned t = 0; t < 32; ++t)
      ts.emplace_back([&, t] {
        threadIdx = {t, 0, 0};
        for (int c = 0; c < nch; ++c) ep_lfmt::encode_chunk_warp(src, slot.data(), meta.data(), hidden, c, (int)t);
      });
    for (auto& t : ts) t.join();
    for (int c = 0; c < hidden / 8; ++c) ep_lfmt::load8(slot.data(), meta.data(), hidden, c, &out[(size_t)r * hidden + 8 * c]);
  }
  fwrite(out.data(), 4, out.size(), stdout);
  return 0;
}
"""


def test_native_warp_code_equals_model_on_host_threads(tmp_path):
    """The native send's warp code (group reduction over lanes, group words, chunk decision, 5-word packing at the
    chunk's offset) and the receive's decoding, run on host threads: bitwise the model, for both chunk sizes."""
    import shutil

    from ep_core.kernels._source import get_include

    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not found")
    src = tmp_path / "warp.cpp"
    src.write_text(_WARP_EMULATION)
    exe = tmp_path / "warp"
    proc = subprocess.run(
        [gxx, "-std=c++20", "-O1", "-pthread", "-I", get_include(), str(src), "-o", str(exe)],
        capture_output=True,
        text=True,
    )
    if proc.returncode and "barrier" in proc.stderr:
        pytest.skip("g++ without C++20 <barrier>")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rng = np.random.default_rng(12)
    for h in (1024, 1536, 2048):
        bits = np.concatenate([_rows(rng, 6, h, s) for s in (1e-3, 0.2, 3.0, 1e-39)])
        bits[0, :300] = 0
        bits[1, 700] = 0x7FC0
        bits[2, 128:256] = 0x3E80
        bits[3, :] = rng.integers(0, 1 << 16, h)
        path = tmp_path / "in.bin"
        bits.astype(np.uint16).tofile(path)
        run = subprocess.run(
            [str(exe), str(bits.shape[0]), str(h), str(path)], capture_output=True, check=True
        )
        got = np.frombuffer(run.stdout, dtype=np.float32).reshape(bits.shape)
        want = logfmt.roundtrip(bits)
        assert not logfmt.encode(bits).cast.all() and logfmt.encode(bits).cast.any(), "both kinds of chunk"
        bad = np.argwhere(_u32(got) != _u32(want))
        assert not bad.size, (
            f"h={h}: {len(bad)} differ, first {tuple(bad[0])}: {got[tuple(bad[0])]} {want[tuple(bad[0])]}"
        )


# ---------------------------------------------------------------------------------------------------------------------
# V1 Buffer on the CPU backend (gloo ranks) and, marker gpu, on CUDA

T, K, E, M = 6, 3, 8, 8


def _inputs(rank: int, h: int, seed: int = 0):
    """bf16 x with 128-channel groups of different magnitude below 1 (encoded), one group above 1 (its chunk plain)
    and some zeros; top-k with masked lanes and a token selecting nothing."""
    g = torch.Generator().manual_seed(4000 * seed + rank)
    mag = torch.tensor([2.0**-12, 0.05, 0.3, 1e-30])[(torch.arange(h) // 128) % 4]
    x = torch.randn(T, h, generator=g) * mag
    x[1, 130] = 3.0
    x[2, ::5] = 0
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    idx[0, 1] = -1
    idx[T - 1] = -1
    w = torch.rand(T, K, generator=g)
    return x.to(torch.bfloat16), idx, w


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16)


def _coef(e: int) -> float:
    return 1.0 + e / 8.0


def _expert(recv: torch.Tensor, rank: int, epr: int) -> torch.Tensor:
    g = torch.arange(epr, device=recv.device) + rank * epr
    return (recv.float() * (1.0 + g.float() / 8.0)[:, None, None]).to(torch.bfloat16)


def _combine_ref(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> np.ndarray:
    t, h = x.shape
    xf = bf16_to_f32(_bits(x))
    y = np.zeros((t, K, h), dtype=np.uint16)
    for i in range(t):
        for k in range(K):
            if idx[i, k] >= 0:
                y[i, k] = f32_to_bf16((xf[i] * np.float32(_coef(int(idx[i, k])))).astype(np.float32))
    return ll_combine_reference(y, idx.numpy(), w.numpy(), use_logfmt=True)


def _logfmt_checks(rank: int, n: int, device: str = "cpu", native: bool = False) -> None:
    from ep_torch.legacy import Buffer

    dev = torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    epr = E // n
    buf = Buffer(None, 0, int(1e8), low_latency_mode=True, num_qps_per_rank=epr, explicitly_destroy=True,
                 transport="ipc" if device == "cuda" else None, ll_native=native)  # fmt: skip
    for h in (1024, 1536):
        x, idx, w = (a.to(dev) for a in _inputs(rank, h))
        ref = _combine_ref(x.cpu(), idx.cpu(), w.cpu())
        for hook_mode in (False, True):
            recv, _, handle, _, hook = buf.low_latency_dispatch(
                x, idx, M, E, use_fp8=False, return_recv_hook=hook_mode
            )
            if hook_mode:
                hook()
            assert (buf._ll_region is not None) == native, (
                "the native kernels ran (ll_native), else the adapter"
            )
            y = _expert(recv, rank, epr)
            comb, _, hook2 = buf.low_latency_combine(
                y, idx, w, handle, use_logfmt=True, return_recv_hook=hook_mode
            )
            if hook_mode:
                hook2()
            bad = np.argwhere(_bits(comb) != ref)
            assert not bad.size, (
                f"logfmt combine h={h} hook={hook_mode} rank {rank}: {len(bad)} differ, {bad[0]}"
            )
        plain, _, _ = buf.low_latency_combine(y, idx, w, handle)
        assert not np.array_equal(_bits(plain), ref), "use_logfmt changes the numbers"
        out = torch.empty(T, h, dtype=torch.bfloat16, device=dev)
        comb, ev, _ = buf.low_latency_combine(y, idx, w, handle, use_logfmt=True, async_finish=True, out=out)
        ev.current_stream_wait()
        assert comb is out and np.array_equal(_bits(out), ref), "async + out="
        zbuf = buf.get_next_low_latency_combine_buffer(handle)
        zbuf.copy_(y)
        comb, _, _ = buf.low_latency_combine(zbuf, idx, w, handle, use_logfmt=True, zero_copy=True)
        assert np.array_equal(_bits(comb), ref), "zero_copy"
    # hidden not a multiple of 512: refused before any communication (every rank alike)
    x, idx, w = _inputs(rank, 1024)
    x = x[:, :384].contiguous().to(dev)
    recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx.to(dev), M, E, use_fp8=False)
    with pytest.raises(EPValueError, match="use_logfmt=True needs hidden % 512"):
        buf.low_latency_combine(recv, idx.to(dev), w.to(dev), handle, use_logfmt=True)
    dist.barrier()
    buf.destroy()


def _spawn(worker: str, ranks: int, limit: float = 300.0) -> None:
    from ep_torch_testing import run_script  # loaded by conftest.py

    code, out = run_script(__file__, [worker, str(ranks)], limit, what=f"{worker} x{ranks}: ")
    assert code == 0, out[-4000:]


@pytest.mark.parametrize("ranks", [2, 4])
def test_logfmt_combine_cpu(ranks):
    _spawn("_logfmt_checks", ranks)


def _logfmt_checks_gpu(rank: int, n: int, native: bool = False) -> None:
    import os

    torch.cuda.set_device(0)
    os.environ.setdefault("EPKIT_NVLINK_GBS", "450")
    _logfmt_checks(rank, n, "cuda", native)


def _logfmt_checks_gpu_native(rank: int, n: int) -> None:
    _logfmt_checks_gpu(rank, n, native=True)


@pytest.mark.parametrize("worker", ["_logfmt_checks_gpu", "_logfmt_checks_gpu_native"])
@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_logfmt_combine_gpu(ranks, worker):
    """ipc transport, processes sharing the GPU: the CUDA adapter (torch twin) and the native kernels
    (``ll_native=True``) bitwise against the model."""
    _spawn(worker, ranks)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_roundtrip_torch_cuda_equals_numpy():
    rng = np.random.default_rng(9)
    bits = np.concatenate([_rows(rng, 64, 7168, s) for s in (1e-3, 0.2, 3.0, 1e-38)])
    got = logfmt.roundtrip_torch(torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).cuda())
    assert np.array_equal(_u32(got.cpu().numpy()), _u32(logfmt.roundtrip(bits)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("n,e,h", [(1, 288, 7168), (8, 64, 1536), (2, 32, 1024)])
def test_logfmt_native_loopback_gpu(n, e, h, monkeypatch):
    """The native kernels over the loopback domain (every row through the buffer, encoded), plain combine, hook
    split and a CUDA graph replay: bitwise against ``ll_combine_reference(use_logfmt=True)``."""
    from ep_torch.cuda_graph import avoid_record_stream
    from ep_torch.loopback import LoopbackGroup

    monkeypatch.setenv("EPKIT_NVLINK_GBS", "450")
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    epr = e // n
    group = LoopbackGroup(n, device="cuda", gpu_timeout_secs=20.0, timeout_secs=60.0)
    v1 = group.v1_buffers(0, int(1e8), low_latency_mode=True, explicitly_destroy=True, ll_native=True)

    def inputs(r, seed=0):
        g = torch.Generator().manual_seed(77 * seed + r)
        x, _, w = _inputs(r, h, seed)
        idx = torch.stack([torch.randperm(e, generator=g)[:K] for _ in range(T)])
        idx[0, 1] = -1
        idx[3, 2] = idx[3, 0]
        return x, idx, w

    def ref(r, seed=0):
        x, idx, w = inputs(r, seed)
        xf = bf16_to_f32(_bits(x))
        y = np.zeros((T, K, h), dtype=np.uint16)
        for i in range(T):
            for k in range(K):
                if idx[i, k] >= 0:
                    c = np.float32(1.0 + float(int(idx[i, k])) / 8.0)
                    y[i, k] = f32_to_bf16((xf[i] * c).astype(np.float32))
        return ll_combine_reference(y, idx.numpy(), w.numpy(), use_logfmt=True)

    inp = [tuple(a.to(dev) for a in inputs(r)) for r in range(n)]
    result: list = [None] * n

    def step(r, hook=False):
        recv, _, handle, _, hk = v1[r].low_latency_dispatch(inp[r][0], inp[r][1], M, e, use_fp8=False)
        c, _, hk = v1[r].low_latency_combine(
            _expert(recv, r, epr), inp[r][1], inp[r][2], handle, use_logfmt=True, return_recv_hook=hook
        )
        result[r] = (c, hk)

    group.run(step)
    assert v1[0]._ll_region is not None, "the native kernels ran"
    for r in range(n):
        assert np.array_equal(_bits(result[r][0]), ref(r)), f"EP{n} h={h} rank {r}: logfmt combine"
    group.run(lambda r: step(r, hook=True))
    group.run(lambda r: result[r][1]())
    for r in range(n):
        assert np.array_equal(_bits(result[r][0]), ref(r)), f"EP{n} h={h} rank {r}: logfmt combine hook"
    group.run(step)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with avoid_record_stream(), torch.cuda.graph(graph):
        group.run(step)
    for seed in (1, 2):
        for r in range(n):
            for dst, src in zip(inp[r], inputs(r, seed)):
                dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        for r in range(n):
            assert np.array_equal(_bits(result[r][0]), ref(r, seed)), f"EP{n} graph {seed} rank {r}"
    del graph
    group.run(lambda r: v1[r].destroy())
    group.close()


if __name__ == "__main__":
    if sys.argv[1] == "_logfmt_checks":  # CPU ranks: forked from this script (ep_torch_testing.spawn_cpu)
        from ep_torch_testing import spawn_cpu

        spawn_cpu(globals()[sys.argv[1]], int(sys.argv[2]))
    else:
        spawn(globals()[sys.argv[1]], int(sys.argv[2]))
