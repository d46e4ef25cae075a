"""V1 low-latency mode's CUDA kernels (``ep_torch.legacy.ll_kernels``, ``ep_core.ll_pack``, ``include/ep_core/ll_pack.cuh``).

CPU: the kernels compile for sm_90a through ep_jit with nvcc; the FP8 helpers the pack kernel uses (torch's e4m3
conversion, the scale, NaN-propagating amax), compiled for the host, equal ``legacy.reference.fp8_cast_reference``;
every kernel's own code, run on host threads with CUDA's names shimmed (``ll_pack_emulation.cpp``, g++), equals the
torch composition on emulated dispatch outputs (rows in V1's order and shuffled by key).
GPU (marker ``gpu``): every output of the kernel path (packed rows, FP8 bytes and scales, recv_count, src_info,
layout_range, lane_slot/lane_ok, the weighted combine for every lane grouping) bitwise equal to the torch
composition (``ll_use_kernels=False``), at the test's small sizes and at the benchmark's (T=128, hidden 7168, top-8
of 256), EP1 loopback, two processes sharing the GPU, and four as two emulated nodes (hybrid rows); with ep's
deterministic dispatch underneath and without (``ll_deterministic=False``), bf16 rows also against
``legacy.reference.ll_expected_rows``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
from ep_torch.launch import spawn
from ep_torch.legacy.reference import fp8_cast_reference


def _have_nvcc() -> bool:
    home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    return shutil.which("nvcc") is not None or os.path.exists(os.path.join(home, "bin", "nvcc"))


def _nvcc() -> str:
    home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    path = os.path.join(home, "bin", "nvcc")
    return path if os.path.exists(path) else str(shutil.which("nvcc"))


needs_nvcc = pytest.mark.skipif(not _have_nvcc(), reason="nvcc not found")


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_ll_kernels_compile(arch, tmp_path, monkeypatch):
    ep_jit = pytest.importorskip("ep_jit")
    from ep_torch.legacy.ll_kernels import KERNEL_NAMES, compile_ll_kernels

    monkeypatch.setenv("EPKIT_JIT_CACHE_DIR", str(tmp_path / "jit"))
    ep_jit.clear_memo()
    art = compile_ll_kernels(arch=arch)
    assert art.cubin_path.read_bytes()[:4] == b"\x7fELF"
    assert set(KERNEL_NAMES) <= set(art.kernel_names)


_HOST_CAST = r"""
#include <ep_core/ll_pack.cuh>
#include <cstdio>
#include <vector>
// stdin: rows, hidden, round_scale (int32), then rows*hidden bf16 bits; stdout: e4m3 bytes, then fp32 scales
int main() {
  int rows, hidden, rs;
  if (fread(&rows, 4, 1, stdin) != 1 || fread(&hidden, 4, 1, stdin) != 1 || fread(&rs, 4, 1, stdin) != 1) return 2;
  std::vector<uint16_t> x((size_t)rows * hidden);
  if (fread(x.data(), 2, x.size(), stdin) != x.size()) return 3;
  std::vector<uint8_t> q(x.size());
  std::vector<float> s((size_t)rows * (hidden / 128));
  for (int r = 0; r < rows; ++r)
    for (int g = 0; g < hidden / 128; ++g) {
      float f[128], amax = 0.0f;
      for (int i = 0; i < 128; ++i) {
        f[i] = ep_ll::u2f((uint32_t)x[(size_t)r * hidden + g * 128 + i] << 16);
        amax = ep_ll::nan_max(amax, fabsf(f[i]));
      }
      const float scale = ep_ll::fp8_scale(amax, rs != 0);
      s[(size_t)r * (hidden / 128) + g] = scale;
      for (int i = 0; i < 128; ++i)
        q[(size_t)r * hidden + g * 128 + i] = (uint8_t)ep_ll::e4m3_bits(ep_ll::div_rn(f[i], scale));
    }
  fwrite(q.data(), 1, q.size(), stdout);
  fwrite(s.data(), 4, s.size(), stdout);
  return 0;
}
"""


@needs_nvcc
@pytest.mark.parametrize("round_scale", [False, True])
def test_ll_fp8_helpers_equal_reference(round_scale, tmp_path):
    """The pack kernel's per-group cast, its helpers compiled for the host: bitwise fp8_cast_reference on groups
    of very different magnitudes (e4m3 denormals, zeros, the 1e-4 amax floor, exact powers of two)."""
    from ep_torch.legacy.ll_kernels import get_include

    src = tmp_path / "cast.cu"
    src.write_text(_HOST_CAST)
    exe = tmp_path / "cast"
    subprocess.run(
        [_nvcc(), "-std=c++17", "-O2", "-I", get_include(), str(src), "-o", str(exe)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    rng = np.random.default_rng(5)
    rows, hidden = 64, 1024
    groups = hidden // 128
    mag = 2.0 ** rng.integers(-30, 40, size=(rows, groups, 1))
    spread = 2.0 ** rng.integers(-24, 1, size=(rows, groups, 128))  # denormal e4m3 outputs inside a group
    x = (rng.standard_normal((rows, groups, 128)) * mag * spread).astype(np.float32).reshape(rows, hidden)
    x[0] = 0.0  # amax floor
    x[1, :128] = 2.0 ** np.arange(-64, 64)  # exact powers of two (scale with no mantissa bits)
    bits = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    header = np.array([rows, hidden, int(round_scale)], dtype=np.int32).tobytes()
    proc = subprocess.run(
        [str(exe)], input=header + bits.tobytes(), capture_output=True, timeout=60, check=True
    )
    q = np.frombuffer(proc.stdout[: rows * hidden], dtype=np.uint8).reshape(rows, hidden)
    s = np.frombuffer(proc.stdout[rows * hidden :], dtype=np.float32).reshape(rows, groups)
    rq, rs = fp8_cast_reference(bits, round_scale, False)
    assert np.array_equal(s.view(np.int32), rs.view(np.int32)), "scales differ"
    bad = np.argwhere(q != rq)
    assert not bad.size, f"e4m3 byte {tuple(bad[0])}: {q[tuple(bad[0])]:#x} != {rq[tuple(bad[0])]:#x}"


def _emulator(tmp_path_factory) -> str:
    """ll_pack_emulation.cpp (the kernels on host threads, CUDA's names shimmed) built with g++ -std=c++20."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not found")
    from ep_torch.legacy.ll_kernels import get_include

    exe = tmp_path_factory.mktemp("ll_emu") / "ll_emu"
    src = os.path.join(os.path.dirname(__file__), "ll_pack_emulation.cpp")
    proc = subprocess.run(
        [gxx, "-std=c++20", "-O1", "-pthread", "-I", get_include(), src, "-o", str(exe)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0 and "barrier" in proc.stderr:
        pytest.skip("g++ without C++20 <barrier>")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return str(exe)


@pytest.fixture(scope="module")
def ll_emulator(tmp_path_factory):
    return _emulator(tmp_path_factory)


def _emulated_dispatch_inputs(rng, by_key: bool, n: int, m: int, k: int, h: int, epr: int, nv: int):
    """What ep's dispatch hands the epilogue: rows [n*m, h], local lanes (-1 = not here, distinct per row), source
    keys (V1's order, or shuffled like hybrid / non-deterministic rows), garbage past the true count ``nv``."""
    rows = n * m
    keys = np.sort(rng.choice(rows, size=nv, replace=False))
    if by_key:
        keys = rng.permutation(keys)
    meta = np.full((rows, k + 2), -7, dtype=np.int32)
    meta[:nv, 0] = keys
    meta[nv:, 0] = rng.integers(0, rows, rows - nv)
    idx = rng.integers(-1, epr, size=(rows, k)).astype(np.int64)
    for r in range(rows):
        seen: set = set()
        for j in range(k):
            if idx[r, j] in seen:
                idx[r, j] = -1
            seen.add(int(idx[r, j]))
    mag = 2.0 ** rng.integers(-20, 20, size=(rows, h // 128, 1))
    x = (rng.standard_normal((rows, h // 128, 128)) * mag).reshape(rows, h).astype(np.float32)
    return torch.from_numpy(x).to(torch.bfloat16), idx, meta


@pytest.mark.parametrize("by_key", [False, True], ids=["rows-in-order", "rows-by-key"])
@pytest.mark.parametrize("seed", [0, 1])
def test_ll_kernels_emulated_equal_torch(ll_emulator, tmp_path, seed, by_key):
    """The kernels' own code run on the CPU (ll_pack_emulation.cpp) against the torch composition: layout
    (lane_slot, lane_ok, src_info, recv_count, layout_range), bf16 rows, FP8 rows and scales in all three modes,
    the wide-row gather, and the weighted sum in one group and in two chained through the fp32 accumulator."""
    import types

    from ep_torch.legacy.low_latency import ll_dispatch, weighted_lane_sum

    n, m, k, h, epr, nv, t = 2, 8, 4, 512, 4, 12, 6
    rows = slots = n * m
    rng = np.random.default_rng(seed)
    x, idx, meta = _emulated_dispatch_inputs(rng, by_key, n, m, k, h, epr, nv)
    ep_handle = types.SimpleNamespace(
        psum_num_recv_tokens_per_scaleup_rank=torch.tensor([nv - 3, nv], dtype=torch.int32),
        recv_src_metadata=torch.from_numpy(meta),
    )
    inner = types.SimpleNamespace(
        num_ranks=n,
        num_max_tokens_per_rank=m,
        num_scaleup_ranks=n,
        dispatch=lambda *a, **kw: (x, torch.from_numpy(idx), None, ep_handle, None),
    )
    gen = torch.Generator().manual_seed(seed)
    y = (torch.randn(epr, slots, h, generator=gen) * 5).to(torch.bfloat16)
    yc = (torch.randn(t, k, h, generator=gen) * 50).to(torch.bfloat16)
    tk = torch.from_numpy(rng.integers(-1, 16, size=(t, k)).astype(np.int64))
    tk[0] = -1
    w = torch.rand(t, k, generator=gen)
    arrays = {"recv_x": x.view(torch.int16), "recv_idx": torch.from_numpy(idx), "meta": torch.from_numpy(meta),
              "y": y.view(torch.int16), "yc": yc.view(torch.int16), "topk": tk, "w": w}  # fmt: skip
    for name, a in arrays.items():
        a.contiguous().numpy().tofile(tmp_path / name)
    args = [rows, k, h, epr, n, m, nv, int(by_key), t]
    subprocess.run([ll_emulator, str(tmp_path), *map(str, args)], check=True, timeout=300)

    def got(name: str, dtype) -> np.ndarray:
        return np.fromfile(tmp_path / name, dtype=dtype)

    def dispatch(fp8: bool, rs: bool, ue: bool):
        dummy = torch.zeros(1, h, dtype=torch.bfloat16), torch.zeros(1, k, dtype=torch.int64)
        return ll_dispatch(inner, *dummy, m, epr * n, fp8, rs, ue, use_kernels=False, rows_ordered=not by_key)

    recv, cnt, hd = dispatch(False, False, False)
    assert np.array_equal(got("recv_count", np.int32), cnt.numpy()), "recv_count"
    assert np.array_equal(got("src_info", np.int32), hd[0].numpy().ravel()), "src_info"
    assert np.array_equal(got("layout_range", np.int64), hd[1].numpy().ravel()), "layout_range"
    assert np.array_equal(got("lane_slot", np.int64), hd.lane_slot.numpy().ravel()), "lane_slot"
    assert np.array_equal(got("lane_ok", np.uint8), hd.lane_ok.numpy().ravel().astype(np.uint8)), "lane_ok"
    packed = got("packed", np.uint16).reshape(epr, slots, h)
    for e in range(epr):
        c = int(cnt[e])
        assert np.array_equal(packed[e, :c], _u8(recv[e, :c]).view(np.uint16)), f"bf16 rows of expert {e}"
    for mode, (rs, ue) in enumerate(((False, False), (True, False), (True, True))):
        (q, s), cnt2, _ = dispatch(True, rs, ue)
        groups = h // 512 if ue else h // 128
        gq = got(f"q{mode}", np.uint8).reshape(epr, slots, h)
        gs = got(f"s{mode}", np.uint32).reshape(epr, groups, slots).transpose(0, 2, 1)
        for e in range(epr):
            c = int(cnt2[e])
            assert np.array_equal(gq[e, :c], _u8(q[e, :c])), f"fp8 mode {mode} expert {e}"
            assert np.array_equal(gs[e, :c], _u8(s[e, :c]).view(np.uint32)), f"scales mode {mode} expert {e}"
    slot = hd.lane_slot.clamp(max=epr * slots - 1)
    want = torch.where(
        hd.lane_ok[:, 1:].reshape(-1, 1),
        y.reshape(-1, h).index_select(0, slot[:, 1:].reshape(-1)),
        torch.zeros((), dtype=torch.bfloat16),
    )  # lanes [1, K) of each real row (the emulator gathers lane0 = 1)
    wide = got("wide", np.uint16).reshape(rows, k - 1, h)[:nv]
    assert np.array_equal(wide, _u8(want.view(rows, k - 1, h)[:nv]).view(np.uint16)), "gather"
    ref = _u8(weighted_lane_sum(yc, tk, w)).view(np.uint16).ravel()
    assert np.array_equal(got("wsum", np.uint16), ref), "weighted sum, one group"
    assert np.array_equal(got("wsum2", np.uint16), ref), "weighted sum, two groups through the accumulator"


def test_ll_kernels_emulated_aborted_dispatch_stays_in_bounds(ll_emulator, tmp_path):
    """Rows of an aborted dispatch (its outputs are undefined: source keys and lanes out of range) get no slot: every
    lane of every row below the count is written once, in bounds, and only rows with a valid key and lane are
    packed (before the guard such garbage made the layout kernel index shared memory out of bounds)."""
    n, m, k, h, epr, nv, t = 2, 8, 4, 512, 4, 12, 6
    rows = slots = n * m
    rng = np.random.default_rng(7)
    x, idx, meta = _emulated_dispatch_inputs(rng, False, n, m, k, h, epr, nv)
    meta[2, 0], meta[5, 0], meta[7, 0] = 10**6, -5, n * m  # keys past M*N, negative, one past the end
    idx[3, 0], idx[4, :] = epr + 3, 1 << 40  # local experts past E_local
    y = np.zeros((epr, slots, h), dtype=np.int16)
    arrays = {"recv_x": x.view(torch.int16).numpy(), "recv_idx": idx, "meta": meta, "y": y,
              "yc": np.zeros((t, k, h), dtype=np.int16), "topk": np.full((t, k), -1, dtype=np.int64),
              "w": np.zeros((t, k), dtype=np.float32)}  # fmt: skip
    for name, a in arrays.items():
        np.ascontiguousarray(a).tofile(tmp_path / name)
    for by_key in (0, 1):
        args = [rows, k, h, epr, n, m, nv, by_key, t]
        subprocess.run([ll_emulator, str(tmp_path), *map(str, args)], check=True, timeout=300)
        slot = np.fromfile(tmp_path / "lane_slot", dtype=np.int64).reshape(rows, k)
        ok = np.fromfile(tmp_path / "lane_ok", dtype=np.uint8).reshape(rows, k).astype(bool)
        dump = epr * slots
        assert ((slot >= 0) & (slot <= dump)).all(), (
            f"by_key={by_key}: a lane slot out of bounds or unwritten"
        )
        assert (slot[ok] < dump).all() and (slot[~ok] == dump).all()
        for r in (2, 4, 5, 7):
            assert not ok[r].any(), f"by_key={by_key}: garbage row {r} was packed"
        assert not ok[3, 0]
        counts = np.fromfile(tmp_path / "recv_count", dtype=np.int32)
        assert counts.sum() == ok.sum()


# ---------------------------------------------------------------------------------------------------------------------
# GPU: the kernel path against the torch composition


SMALL = {"T": 5, "H": 512, "K": 3, "E": 8, "M": 8}
BENCH = {"T": 128, "H": 7168, "K": 8, "E": 256, "M": 128}


def _inputs(rank: int, cfg: dict, seed: int, idx_dtype: torch.dtype):
    t, h, k, e = cfg["T"], cfg["H"], cfg["K"], cfg["E"]
    g = torch.Generator().manual_seed(1000 * seed + rank)
    mag = 2.0 ** torch.randint(-12, 10, (h // 128,), generator=g).float()
    x = (torch.randn(t, h, generator=g) * mag.repeat_interleave(128)).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    idx[0, 1] = -1
    idx[t - 1] = -1  # a token that selects nothing
    w = torch.rand(t, k, generator=g)
    return x, idx.to(idx_dtype), w


def _u8(t: torch.Tensor) -> np.ndarray:
    # copied into fresh row-major strides first: a slice whose last dimension has size 1 counts as contiguous with
    # any stride there (so .contiguous() keeps it), and a dtype view needs stride 1
    t = t.detach().cpu()
    return torch.empty(t.shape, dtype=t.dtype).copy_(t).view(torch.uint8).numpy()


def _same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    ga, gb = _u8(a), _u8(b)
    bad = np.argwhere(ga != gb)
    assert not bad.size, (
        f"{what}: kernels differ from the torch path at byte {tuple(bad[0])} ({len(bad)} bytes)"
    )


def _check_reference(recv: torch.Tensor, cnt: torch.Tensor, rank: int, n: int, cfg: dict, what: str) -> None:
    """bf16 packed rows against legacy.reference.ll_expected_rows (V1's order), independent of either path."""
    from ep_torch.legacy.reference import ll_expected_rows

    inputs = [_inputs(r, cfg, 0, torch.int64) for r in range(n)]
    want = ll_expected_rows([i[1].numpy() for i in inputs], rank, cfg["E"])
    for j, rows in enumerate(want):
        assert int(cnt[j]) == len(rows), f"{what}: recv_count[{j}]={int(cnt[j])}, want {len(rows)}"
        if rows:
            ref = torch.stack([inputs[s][0][tok] for s, tok in rows])
            _same(recv[j, : len(rows)], ref, f"{what}: expert {j} rows vs ll_expected_rows")


def _compare(rank: int, n: int, cfg: dict, idx_dtype: torch.dtype, det: bool = True) -> None:
    from ep_torch.legacy import Buffer

    dev = torch.device("cuda", 0)
    t, h, k, e, m = cfg["T"], cfg["H"], cfg["K"], cfg["E"], cfg["M"]
    epr = e // n
    buf = Buffer(None, 0, int(1e8), low_latency_mode=True, explicitly_destroy=True, transport="ipc",
                 ll_deterministic=det)  # fmt: skip
    x, idx, w = (a.to(dev) for a in _inputs(rank, cfg, 0, idx_dtype))
    where = f"EP{n} rank {rank} T={t} H={h} K={k} E={e} idx {idx_dtype} deterministic={det}"
    for fp8, rs, ue in ((False, False, False), (True, False, False), (True, True, False), (True, True, True)):
        out = {}
        for use in (False, True):
            buf.ll_use_kernels = use
            out[use] = buf.low_latency_dispatch(x, idx, m, e, use_fp8=fp8, round_scale=rs, use_ue8m0=ue)
        torch.cuda.synchronize()
        (r0, c0, h0, _, _), (r1, c1, h1, _, _) = out[False], out[True]
        what = f"{where} fp8={fp8} round_scale={rs} ue8m0={ue}"
        _same(c0, c1, f"{what}: recv_count")
        if not fp8:
            _check_reference(r1, c1, rank, n, cfg, what)
        for i, name in enumerate(("src_info", "layout_range")):
            _same(h0[i], h1[i], f"{what}: {name}")
        assert tuple(h0[2:]) == tuple(h1[2:]), what
        if det:
            _same(h0.lane_slot, h1.lane_slot, f"{what}: lane_slot")
            _same(h0.lane_ok, h1.lane_ok, f"{what}: lane_ok")
        else:  # lane_slot is indexed by received row, whose order differs between two non-deterministic dispatches:
            # the slots the lanes fill (each once) must be the same set
            filled = [torch.sort(h.lane_slot[h.lane_ok].flatten()).values for h in (h0, h1)]
            _same(filled[0], filled[1], f"{what}: slots filled by the lanes")
        parts0 = r0 if fp8 else (r0,)
        parts1 = r1 if fp8 else (r1,)
        for p0, p1, name in zip(parts0, parts1, ("rows", "scales")):
            assert p0.shape == p1.shape and p0.stride() == p1.stride() and p0.dtype == p1.dtype, (
                f"{what}: {name} {p0.shape}/{p0.stride()} vs {p1.shape}/{p1.stride()}"
            )
            for j in range(epr):
                cnt = int(c0[j])
                _same(p0[j, :cnt], p1[j, :cnt], f"{what}: {name} of expert {j}")
    # combine: random expert outputs, every lane grouping, kernels vs torch (each on its own dispatch's handle)
    g = torch.Generator(device=dev).manual_seed(77 + rank)
    y = (torch.randn(epr, n * m, h, generator=g, device=dev) * 3).to(torch.bfloat16)
    handles = {}
    for use in (False, True):
        buf.ll_use_kernels = use
        handles[use] = buf.low_latency_dispatch(x, idx, m, e, use_fp8=False)[2]
    for group in sorted({0, 1, 2, k}):
        buf.ll_lanes_per_combine = group
        res = {}
        for use in (False, True):
            buf.ll_use_kernels = use
            res[use] = buf.low_latency_combine(y, idx, w, handles[use])[0]
        _same(res[False], res[True], f"{where}: combine lanes={group}")
        buf.ll_use_kernels = (
            True  # the kernels' combine on the torch path's handle, and out= (non-contiguous)
        )
        cross = buf.low_latency_combine(y, idx, w, handles[False])[0]
        _same(res[False], cross, f"{where}: combine lanes={group} on the torch handle")
        out_t = torch.empty(h, t, dtype=torch.bfloat16, device=dev).t()
        got = buf.low_latency_combine(y, idx, w, handles[True], out=out_t)[0]
        assert got is out_t
        _same(res[False], out_t, f"{where}: combine lanes={group} into a non-contiguous out=")
    buf.ll_lanes_per_combine = 0
    dist.barrier()
    buf.destroy()


def _by_key_cpu(rank: int, n: int) -> None:
    """CPU reference backend: the torch packing with rows ordered by key (``ll_deterministic=False``) equals V1's
    order and the deterministic buffer's results (layout, handle, combine)."""
    from ep_torch.legacy import Buffer

    cfg = SMALL
    x, idx, w = _inputs(rank, cfg, 0, torch.int64)
    res = {}
    for det in (True, False):
        buf = Buffer(None, 0, int(1e8), low_latency_mode=True, explicitly_destroy=True, ll_deterministic=det)
        recv, cnt, handle, _, _ = buf.low_latency_dispatch(x, idx, cfg["M"], cfg["E"], use_fp8=False)
        _check_reference(recv, cnt, rank, n, cfg, f"cpu deterministic={det}")
        y = (recv.float() * 1.5).to(torch.bfloat16)
        comb = buf.low_latency_combine(y, idx, w, handle)[0]
        res[det] = (handle[0], handle[1], handle.lane_slot, comb)
        dist.barrier()
        buf.destroy()
    for a, b, name in zip(res[True], res[False], ("src_info", "layout_range", "lane_slot", "combine")):
        _same(a, b, f"cpu rank {rank}: {name} with and without ep's deterministic rows")


def test_ll_rows_by_key_cpu():
    _spawn("_by_key_cpu", 2)


def _kernels_vs_torch_gpu(rank: int, n: int) -> None:
    torch.cuda.set_device(0)
    os.environ.setdefault("EPKIT_NVLINK_GBS", "450")  # no NVLink to detect between processes on one GPU
    _compare(rank, n, SMALL, torch.int64)
    _compare(rank, n, SMALL, torch.int32)
    _compare(rank, n, SMALL, torch.int64, det=False)  # ep's rows in any order: the packing orders them by key
    if n <= 2:
        _compare(rank, n, BENCH, torch.int64)
        _compare(rank, n, BENCH, torch.int64, det=False)


def _spawn(worker: str, ranks: int, env: dict | None = None, limit: float = 600.0) -> None:
    from ep_torch_testing import run_script  # loaded by conftest.py

    env = {**os.environ, **(env or {})}
    code, out = run_script(__file__, [worker, str(ranks)], limit, what=f"{worker} x{ranks}: ", env=env)
    assert code == 0, out[-4000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("ranks", [1, 2])
def test_ll_kernels_equal_torch_gpu(ranks):
    _spawn("_kernels_vs_torch_gpu", ranks)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_ll_kernels_equal_torch_hybrid_gpu():
    """Four processes on one GPU as two emulated nodes: hybrid rows (grouped by region), V1's packed order."""
    # emulated nodes have no NIC to detect (a machine may list one without a rate): the planner's RDMA figure
    env = {"EPKIT_SCALEUP_RANKS": "2", "EPKIT_RDMA_GBS": os.environ.get("EPKIT_RDMA_GBS", "50")}
    _spawn("_kernels_vs_torch_gpu", 4, env, limit=300.0)


if __name__ == "__main__":
    from ep_torch_testing import spawn_cpu

    worker = sys.argv[1]  # the GPU ranks start afresh (a forked process cannot use CUDA)
    (spawn if "gpu" in worker else spawn_cpu)(globals()[worker], int(sys.argv[2]))
