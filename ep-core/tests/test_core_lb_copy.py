"""ep_core.lb_copy (host side of include/ep_core/lb_copy.cuh, DeepEP 2.5's load balancing over symmetric memory):
the parameter table equals the header's signatures, the address tables of every rank of a domain, run by a model of
the kernels over numpy "memories", give bitwise ``ep_core.load_balance``'s oracles, the span functions on the host
(g++, every thread one after another) against a plain copy and a sequential fp32 sum, and the kernels compile for
sm_90a (nvcc). On the GPU: ep-torch's test_torch_lb_symmetric_gpu.py."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from ep_core import lb_copy
from ep_core.errors import EPValueError
from ep_core.load_balance import (
    check_redundancy_mapping,
    lb_routes,
    prefetch_reference,
    reduce_grads_reference,
)


def test_signatures_match_the_header(header_signatures):
    text, found = header_signatures("lb_copy.cuh")
    assert found == lb_copy.SIGNATURES
    assert f"kBlockThreads = {lb_copy.BLOCK_THREADS};" in text


class _Memory:
    """Every rank's arrays at fake addresses (rank r's LB region at ``(r + 1) << 40``, its experts' memory at
    ``(r + 1) << 40 | 1 << 36``): reads and writes of the tables' addresses."""

    def __init__(self) -> None:
        self.arrays: list[tuple[int, np.ndarray]] = []

    def add(self, base: int, arr: np.ndarray) -> int:
        self.arrays.append((base, arr.view(np.uint8).reshape(-1)))
        return base

    def at(self, addr: int, nbytes: int) -> np.ndarray:
        for base, a in self.arrays:
            if base <= addr and addr + nbytes <= base + a.size:
                return a[addr - base : addr - base + nbytes]
        raise AssertionError(f"address {addr:#x} + {nbytes} maps no array")


def _mapping(nvl: int, num_local: int, slots: int, seed: int) -> np.ndarray:
    g = np.random.default_rng(seed)
    m = g.integers(-1, nvl * num_local, size=(nvl, slots)).astype(np.int32)
    m[0, 0] = m[nvl - 1, 1] = 0  # one expert in two rows
    m[0, 1] = 0  # and twice in one row
    return check_redundancy_mapping(m, nvl, num_local)


@pytest.mark.parametrize(("nvl", "num_local", "slots"), [(2, 3, 4), (4, 2, 5), (1, 3, 2)])
def test_tables_give_the_oracles(nvl, num_local, slots):
    g = np.random.default_rng(nvl * 10 + slots)
    m = _mapping(nvl, num_local, slots, nvl + slots) if nvl > 1 else np.array([[-1, -1]], dtype=np.int64)
    hidden, per = 12, 48  # fp32 gradients [hidden]; weights of 48 bytes an expert
    lb = [(r + 1) << 40 for r in range(nvl)]
    mem = _Memory()
    regions = [np.zeros(4096, dtype=np.uint8) for _ in range(nvl)]
    for r in range(nvl):
        mem.add(lb[r], regions[r])
    red_off, grad_off = 256, 1024  # the redundant weights and the redundant gradients inside each region
    experts = [g.integers(0, 256, size=(num_local, per), dtype=np.uint8) for _ in range(nvl)]
    grads = [g.standard_normal((num_local, hidden)).astype(np.float32) for _ in range(nvl)]
    red_grads = [g.standard_normal((slots, hidden)).astype(np.float32) for _ in range(nvl)]
    start = [g.integers(0, 256, size=(slots, per), dtype=np.uint8) for _ in range(nvl)]
    for r in range(nvl):
        mem.add(lb[r] | 1 << 36, experts[r])
        mem.add(lb[r] | 2 << 36, grads[r])
        regions[r][red_off : red_off + slots * per] = start[r].reshape(-1)
        regions[r][grad_off : grad_off + slots * hidden * 4] = red_grads[r].view(np.uint8).reshape(-1)
    routes = [lb_routes(m, r, num_local) for r in range(nvl)]

    # prefetch: every rank's tasks (the kernel: each task one copy)
    for r in range(nvl):
        tasks = lb_copy.prefetch_tasks(routes[r], [(lb[r] + red_off, lb[r] | 1 << 36, per)], lb)
        assert tasks.shape == (int((m // num_local == r).sum() if nvl > 1 else 0), 3)
        for dst, src, n in tasks:
            mem.at(int(dst), int(n))[:] = mem.at(int(src), int(n))
    want = prefetch_reference(start, experts, m)
    for r in range(nvl):
        got = regions[r][red_off : red_off + slots * per].reshape(slots, per)
        assert np.array_equal(got, want[r]), r

    # reduce: every owner's table (the kernel: per entry, the sources added in order)
    want_g = reduce_grads_reference(red_grads, grads, m)
    for r in range(nvl):
        flat, entries = lb_copy.reduce_table(
            routes[r], lb[r] | 2 << 36, lb[r] + grad_off, hidden * 4, num_local, lb
        )
        table, srcs = flat[: 3 * entries].reshape(-1, 3), flat[3 * entries :]
        for dst, first, count in table:
            acc = mem.at(int(dst), hidden * 4).view(np.float32)
            for a in srcs[first : first + count]:
                acc[:] = (acc + mem.at(int(a), hidden * 4).view(np.float32)).astype(np.float32)
    for r in range(nvl):
        assert np.array_equal(grads[r].view(np.uint32), want_g[r].view(np.uint32)), r


def test_tables_refuse_a_short_base_list():
    routes = lb_routes(np.array([[1], [0]]), 0, 1)
    with pytest.raises(EPValueError, match="lb_bases"):
        lb_copy.prefetch_tasks(routes, [(0, 0, 16)], [0])
    with pytest.raises(EPValueError, match="lb_bases"):
        lb_copy.reduce_table(routes, 0, 0, 16, 1, [0, 1, 2])


def test_bad_launches_are_refused():
    kw = dict(
        sync_table=0, rank=0, num_ranks=2, generation=1, timeout_ms=1, herr=0, num_sms=2, device=0, stream=0
    )
    with pytest.raises(EPValueError, match="kind"):
        lb_copy.launch("move", 0, 0, **kw)
    with pytest.raises(EPValueError, match="generation 0"):
        lb_copy.launch("copy", 0, 0, **{**kw, "generation": 0})


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_the_span_functions_on_the_host(tmp_path: Path):
    """The copy and reduce threads are independent (no barrier between them), so running each thread of a grid one
    after another on the host (lb_copy_emu.cpp) checks the indexing: vectors over the grid, the unrolled loop and
    its tail, the unaligned fallbacks, and the reduce's order (bitwise the sequential sum)."""
    from ep_core.kernels._source import get_include

    exe = tmp_path / "emu"
    src = Path(__file__).with_name("lb_copy_emu.cpp")
    cmd = ["g++", "-std=c++17", "-O1", "-Wno-unknown-pragmas", f"-I{get_include()}", str(src), "-o", str(exe)]
    subprocess.run(cmd, check=True, timeout=120)
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_the_kernels_compile_for_sm_90a(tmp_path, monkeypatch):
    ep_jit = pytest.importorskip("ep_jit")
    monkeypatch.setenv("EPKIT_JIT_CACHE_DIR", str(tmp_path / "jit"))
    ep_jit.clear_memo()
    art = lb_copy.compile_lb_copy(arch="sm_90a")
    assert art.cubin_path.read_bytes()[:4] == b"\x7fELF"
    assert set(lb_copy.KERNEL_NAMES) <= set(art.kernel_names)
