"""ep_core.bucket_bf16 (host side of include/ep_core/bucket_bf16.cuh, DeepEP 2.5's bf16 reduce-scatter): the
parameter table equals the header's signatures; the numpy steps against a pure-Python model of DeepEP's rounding;
the kernels' loops and device functions on the host (bucket_bf16_emu.cpp, g++) bit for bit against the numpy steps
on every rank (NaN, infinities, subnormals, carries, random bit patterns; partial tiles; 16-byte aligned tensors and
4-byte aligned ones; several entries); and the kernels compile for sm_90a (nvcc). On the GPU: ep-torch's
test_torch_bucket_gpu.py."""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
from ep_core import bucket_bf16
from ep_core.bf16 import stochastic_bits


def test_signatures_match_the_header(header_signatures):
    text, found = header_signatures("bucket_bf16.cuh")
    assert found == bucket_bf16.SIGNATURES
    assert f"kBlockThreads = {bucket_bf16.BLOCK_THREADS};" in text


def _model_bits(values: np.ndarray, first_quad: int) -> list[int]:
    """DeepEP's rounding element by element with Python ints (its kernel's hash, written out)."""
    out = []
    bits = [int(b) for b in values.view(np.uint32)]
    for i in range(len(bits) // 4):
        b = bits[4 * i : 4 * i + 4]
        h = (
            b[0] * 0x5671D42B + b[1] * 0x9995E499 + b[2] * 0xACE1B8A5 + b[3] * 0xE153538D + first_quad + i
        ) & 0xFFFFFFFF
        h ^= h >> 23
        h = (h * 0x7FEB352D) & 0xFFFFFFFF
        h ^= h >> 16
        h1 = (h * 0x846CA68B) & 0xFFFFFFFF
        h1 ^= h1 >> 11
        h2 = (h * 0xD35A2D97) & 0xFFFFFFFF
        h2 ^= h2 >> 11
        for k, rnd in enumerate((h1 & 0xFFFF, h1 >> 16, h2 & 0xFFFF, h2 >> 16)):
            out.append(0x7FFF if (b[k] & 0x7FFFFFFF) > 0x7F800000 else (b[k] + rnd) >> 16)
    return out


def _values(count: int, seed: int) -> np.ndarray:
    g = np.random.default_rng(seed)
    x = (g.standard_normal(count) * 10).astype(np.float32)
    spec = np.array(
        [
            0.0,
            -0.0,
            np.inf,
            -np.inf,
            3.3961514e38,
            -3.3961514e38,
            1e-45,
            -1e-45,
            1e-40,
            np.nan,
            -np.nan,
            1.0,
            *(2**-130, 65504.0, -7.0, 1.0 + 2**-9),
        ],
        dtype=np.float32,
    )
    for at in range(0, count - 48, max(48, count // 5)):
        x[at : at + 16] = spec
        x[at + 16 : at + 48] = g.integers(0, 2**32, 32, dtype=np.uint64).astype(np.uint32).view(np.float32)
    return x


def test_stochastic_bits_equal_the_model():
    x = _values(4096, 1)
    assert stochastic_bits(x).tolist() == _model_bits(x, 0)
    assert stochastic_bits(x[1024:], 256).tolist() == _model_bits(x[1024:], 256)  # the quads' place counts
    assert stochastic_bits(x[:8], 2**32 - 1).tolist() == _model_bits(x[:8], 2**32 - 1)  # uint32 wrap


def test_pack_and_reduce_are_deepep_arithmetic():
    n, m = 3, 40000
    xs = [_values(n * m, 10 + r) for r in range(n)]
    sent = [stochastic_bits(x) for x in xs]
    packed = [x.copy() for x in xs]
    for r in range(n):
        bucket_bf16.pack(packed[r], r, n)
        for q in range(n):
            shard = packed[r][q * m : (q + 1) * m]
            if q == r:
                assert np.array_equal(shard.view(np.uint32), xs[r][q * m : (q + 1) * m].view(np.uint32))
            else:
                assert np.array_equal(bucket_bf16.packed(shard, m, n), sent[r][q * m : (q + 1) * m])
    # the reduce adds the peers in the order given, in float32
    own = np.array([1.0, 2**24, -1.0, np.inf], np.float32)
    peers = [
        np.array([0x3F80, 0x3F80, 0x3F80, 0x0000], np.uint16),
        np.array([0x3F80] * 3 + [0xFF80], np.uint16),
    ]
    got = bucket_bf16.reduce(own, peers, 0.5)
    assert got[:3].tolist() == [1.5, 2**23, 0.5] and np.isnan(got[3])  # 2**24 + 1 + 1 rounds back each time


def _emu(tmp_path: Path) -> Path:
    from ep_core.kernels._source import get_include

    exe = tmp_path / "emu"
    src = Path(__file__).with_name("bucket_bf16_emu.cpp")
    cmd = ["g++", "-std=c++17", "-O1", "-Wno-unknown-pragmas", f"-I{get_include()}", str(src), "-o", str(exe)]
    subprocess.run(cmd, check=True, timeout=120)
    return exe


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit for bit, NaN meets NaN (the payload of a NaN sum is the hardware's)."""
    nan = np.isnan(a)
    return bool(
        np.array_equal(nan, np.isnan(b)) and np.array_equal(a[~nan].view(np.uint32), b[~nan].view(np.uint32))
    )


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize(
    ("n", "ms", "shift", "scale", "blocks", "threads"),
    [
        (1, [64], 0, 2.0, 1, 7),
        (2, [32768 + 4104, 8], 0, 0.25, 3, 1000),  # a partial tile; a shard of one group
        (3, [520, 72], 4, 1.0, 2, 33),  # 4-byte aligned tensors: the element-wise loads
        (4, [4096 * 3 + 8], 12, 3.0, 5, 512),
        (9, [16384 + 16], 0, 0.5, 2, 4096),  # beyond 8 ranks: 16384 a tile
    ],
)
def test_the_kernels_on_the_host_equal_the_numpy_steps(tmp_path, n, ms, shift, scale, blocks, threads):
    exe = _emu(tmp_path)
    offs, at = [], 256
    for m in ms:
        offs.append(at + shift)
        at += -(-(4 * n * m + shift) // 256) * 256
    data = [[_values(n * m, 100 * r + e) for e, m in enumerate(ms)] for r in range(n)]
    bits = struct.unpack("<i", struct.pack("<f", scale))[0]
    head = np.array(
        [n, len(ms), blocks, threads, bits & 0xFFFFFFFF] + [v for p in zip(offs, ms) for v in p], np.int64
    )
    stdin = head.tobytes() + b"".join(x.tobytes() for row in data for x in row)
    out = subprocess.run([str(exe)], input=stdin, capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr
    got = np.frombuffer(out.stdout, np.float32)
    want = [[x.copy() for x in row] for row in data]
    for r in range(n):
        for x in want[r]:
            bucket_bf16.pack(x, r, n)
    for r in range(n):
        for e, m in enumerate(ms):
            peers = [bucket_bf16.packed(want[(r - p) % n][e][r * m : (r + 1) * m], m, n) for p in range(1, n)]
            want[r][e][r * m : (r + 1) * m] = bucket_bf16.reduce(
                data[r][e][r * m : (r + 1) * m], peers, scale
            )
    flat = np.concatenate([x for row in want for x in row])
    assert got.size == flat.size
    assert _same(got, flat)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_the_kernels_compile_for_sm_90a(tmp_path, monkeypatch):
    ep_jit = pytest.importorskip("ep_jit")
    monkeypatch.setenv("EPKIT_JIT_CACHE_DIR", str(tmp_path / "jit"))
    ep_jit.clear_memo()
    art = bucket_bf16.compile_bucket_bf16(arch="sm_90a")
    assert art.cubin_path.read_bytes()[:4] == b"\x7fELF"
    assert set(bucket_bf16.KERNEL_NAMES) <= set(art.kernel_names)


def test_launch_passes_the_signatures(monkeypatch):
    """`launch`'s argument lists pass `KernelSet.args`' checks (what reaches the driver), the scale as its fp32 bits."""
    calls = []
    kernels = bucket_bf16._KERNELS
    monkeypatch.setattr(
        kernels, "launch", lambda name, grid, block, values, **kw: calls.append((name, grid, values))
    )
    pytest.importorskip("ep_jit")
    for kind in ("pack", "reduce"):
        bucket_bf16.launch(kind, 1 << 40, 2, 1 << 41, 1 << 42, 3, 9, 0.1, num_sms=0, device=0, stream=0)
    for name, grid, values in calls:
        assert grid == 1 and len(kernels.args(name, values)) == len(bucket_bf16.SIGNATURES[name])
    assert calls[0][2] == [1 << 40, 2, 1 << 42, 3, 9, 16384]
    assert calls[1][2] == [1 << 40, 2, 1 << 41, 3, 9, 16384, struct.unpack("<i", struct.pack("<f", 0.1))[0]]
