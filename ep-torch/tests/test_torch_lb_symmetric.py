"""The symmetric road of ``EPBuffer.lb_prefetch_weights`` / ``lb_reduce_grads`` (issue 42) without a GPU: which
road a buffer takes (``_symmetric_refusal``: the same verdict on every rank), and ``_SymmetricLB``'s calls for every
rank of a domain in one process, with host tensors as the ranks' LB regions and ``ep_core.lb_copy.launch`` replaced
by a model of the kernels that follows the tables' real addresses (ctypes): bitwise ``ep_core.load_balance``'s
oracles, the barriers' generations, the table cache; and one rank through ``LoadBalance``'s calls with the
allocation modelled too (the region, the grid, a recorded timeout, ``destroy``). The kernels themselves: ep-core's test_core_lb_copy.py (host
emulation, compile) and test_torch_lb_symmetric_gpu.py (GPU)."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from ep_core import lb_copy
from ep_core.load_balance import (
    check_redundancy_mapping,
    lb_routes,
    prefetch_reference,
    reduce_grads_reference,
)
from ep_torch import load_balance

L, R, H, PER = 3, 4, 16, 64  # local experts, slots, gradient hidden, weight bytes per expert
calls: list = []  # the modelled launches: (kind, generation, blocks)


def _model_launch(kind, table, count, *, hidden=0, generation, **kw):
    """The kernels on host memory: ``table`` is the address of the (host) table."""
    calls.append((kind, generation, kw["num_sms"]))
    if not count:
        return
    if kind == "copy":
        rows = np.ctypeslib.as_array((ctypes.c_int64 * (3 * count)).from_address(table)).reshape(-1, 3)
        for dst, src, n in rows:
            ctypes.memmove(int(dst), int(src), int(n))
        return
    n = int(np.ctypeslib.as_array((ctypes.c_int64 * (3 * count)).from_address(table))[2::3].sum())
    flat = np.ctypeslib.as_array((ctypes.c_int64 * (3 * count + n)).from_address(table))
    srcs = flat[3 * count :]
    for dst, first, cnt in flat[: 3 * count].reshape(-1, 3):
        acc = np.ctypeslib.as_array((ctypes.c_float * hidden).from_address(int(dst)))
        for a in srcs[first : first + cnt]:
            acc[:] = acc + np.ctypeslib.as_array((ctypes.c_float * hidden).from_address(int(a)))


def _sym(rank: int, regions: list[torch.Tensor]) -> load_balance._SymmetricLB:
    """A ``_SymmetricLB`` over host tensors (no allocation, no device): the tables stay host tensors."""
    sym = object.__new__(load_balance._SymmetricLB)
    sym.rank, sym.num_ranks = rank, len(regions)
    sym.bases = [int(t.data_ptr()) for t in regions]
    sym.storage = regions[rank]
    sym.generation, sym._tables, sym.last_launch = 0, {}, None
    sym.sync = sym.herr = torch.zeros(4, dtype=torch.int64)
    sym.timeout_ms, sym.ordinal, sym.device = 1000, 0, torch.device("cpu")
    sym._table = lambda kind, rows: _host_table(sym, kind, rows)
    return sym


def _host_table(sym, kind, rows):
    key = rows.tobytes()
    last = sym._tables.get(kind)
    if last is not None and last[0] == key:
        return last[1]
    t = torch.from_numpy(np.ascontiguousarray(rows).reshape(-1).copy())
    sym._tables[kind] = (key, t)
    return t


@pytest.mark.parametrize("nvl", [2, 4])
def test_every_rank_of_a_domain_gives_the_oracles(nvl, monkeypatch):
    monkeypatch.setattr(lb_copy, "launch", _model_launch)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=0))
    calls.clear()
    g = torch.Generator().manual_seed(nvl)
    m = torch.randint(-1, nvl * L, (nvl, R), generator=g, dtype=torch.int32)
    m[0, 0] = m[nvl - 1, 1] = 0
    m[0, 1] = 0
    mapping = check_redundancy_mapping(m.numpy(), nvl, L)
    regions = [torch.zeros(8192, dtype=torch.uint8) for _ in range(nvl)]
    red_w = [r[256 : 256 + R * PER].view(R, PER) for r in regions]  # the slots' weights
    red_g = [r[4096 : 4096 + R * H * 4].view(torch.float32).view(R, H) for r in regions]  # the slots' grads
    experts = [torch.randint(0, 256, (L, PER), generator=g, dtype=torch.uint8) for _ in range(nvl)]
    grads = [torch.randn(L, H, generator=g) for _ in range(nvl)]
    for r in range(nvl):
        red_w[r].copy_(torch.randint(0, 256, (R, PER), generator=g, dtype=torch.uint8))
        red_g[r].copy_(torch.randn(R, H, generator=g))
    start_w = [t.numpy().copy() for t in red_w]
    start_g = [t.numpy().copy() for t in grads]
    syms = [_sym(r, regions) for r in range(nvl)]
    for r in range(nvl):  # every rank queues its call (the barriers order them on the GPU)
        syms[r].prefetch(lb_routes(mapping, r, L), [(red_w[r], experts[r])], 3)
    want = prefetch_reference(start_w, [e.numpy() for e in experts], mapping)
    for r in range(nvl):
        assert np.array_equal(red_w[r].numpy(), want[r]), r
    slot_grads = [t.numpy().copy() for t in red_g]
    for r in range(nvl):
        syms[r].reduce(lb_routes(mapping, r, L), red_g[r], grads[r], 5)
    want_g = reduce_grads_reference(slot_grads, start_g, mapping)
    for r in range(nvl):
        assert np.array_equal(grads[r].numpy().view(np.uint32), want_g[r].view(np.uint32)), r
    # one barrier generation per call on every rank, the grid as asked
    assert [c for c in calls if c[0] == "copy"] == [("copy", 1, 3)] * nvl
    assert [c for c in calls if c[0] == "reduce"] == [("reduce", 2, 5)] * nvl
    assert syms[0].last_launch[0] == "reduce" and syms[0].last_launch[1] == 5
    # the same call again reuses the table
    table = syms[0]._tables["copy"][1]
    syms[0].prefetch(lb_routes(mapping, 0, L), [(red_w[0], experts[0])], 3)
    assert syms[0]._tables["copy"][1] is table and syms[0].generation == 3


def test_the_road_a_buffer_takes():
    from ep_core.transports.nccl import NcclStorage

    def buf(device="cuda", storage=None, n=2, nvl=2):
        rt = SimpleNamespace(storage=storage)
        return SimpleNamespace(device=torch.device(device), _rt=lambda: rt, num_ranks=n, num_nvlink_ranks=nvl)

    mapped = SimpleNamespace(peer_bases=lambda n: [0] * n, array_device="cuda")
    assert load_balance._symmetric_refusal(buf(storage=mapped)) == ""
    assert "CPU backend" in load_balance._symmetric_refusal(buf("cpu", mapped))
    assert "does not map" in load_balance._symmetric_refusal(buf(storage=SimpleNamespace()))
    assert "hybrid" in load_balance._symmetric_refusal(buf(storage=mapped, n=4, nvl=2))
    short = SimpleNamespace(peer_bases=lambda n: [0] * n, lsa_size=2)
    assert NcclStorage.lsa_team_short(short, 4)
    assert "LSA team" in load_balance._symmetric_refusal(buf(storage=short, n=4, nvl=4))


def test_one_rank_end_to_end_with_a_modelled_allocation(monkeypatch):
    """``LoadBalance`` of one rank (the benchmark's stand-in for ``EPBuffer``) on the symmetric road, its allocation a
    host tensor and its kernels the model: the region is the allocation's, the calls give the oracles, a recorded
    timeout raises ``EPTimeoutError`` naming the peer at the next call, ``destroy`` closes the allocation."""
    from ep_core import side_allocation
    from ep_core.bootstrap import LocalBootstrap
    from ep_core.errors import EPTimeoutError
    from ep_torch import BufferAllocator
    from ep_torch.load_balance import LoadBalance

    num = 2 << 20
    memory = torch.zeros(num + 2 * num, dtype=torch.uint8)
    closed = []
    alloc = SimpleNamespace(peer_ptr=lambda r: memory.data_ptr(), close=lambda: closed.append(1))
    monkeypatch.setattr(side_allocation, "create_exchanged", lambda boot, n, **kw: (alloc, ""))
    monkeypatch.setattr(lb_copy, "launch", _model_launch)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=0))
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda d: SimpleNamespace(multi_processor_count=132)
    )
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    monkeypatch.setattr(load_balance, "_symmetric_refusal", lambda buf: "")
    monkeypatch.setenv("EPKIT_NVLINK_GBS", "450")
    calls.clear()

    class Runtime:  # the buffer below LoadBalance: its own destroy
        def destroy(self) -> None:
            pass

    class OneRank(LoadBalance, Runtime):
        def __init__(self, plan: BufferAllocator) -> None:
            self.bootstrap = LocalBootstrap()
            self.device, self.rank_idx, self.num_ranks, self.num_nvlink_ranks, self.group = (
                torch.device("cpu"), 0, 1, 1, None,
            )  # fmt: skip
            self._init_lb(plan, plan.num_bytes)

        def _rt(self):
            return SimpleNamespace(config=SimpleNamespace(num_gpu_timeout_secs=100), destroyed=False)

    plan = BufferAllocator()
    slots = plan.allocate((R, PER // 4), torch.float32)
    rg = plan.allocate((R, H), torch.float32)
    lb = OneRank(plan)
    assert lb.lb_path == "symmetric" and lb.lb_path_reason == ""
    assert lb.lb_storage.data_ptr() == memory.data_ptr() == slots.data_ptr()
    experts = torch.randn(L, PER // 4)
    mapping = torch.tensor([[2, 0, -1, 2]], dtype=torch.int32)
    slots.fill_(7.0)
    lb.lb_prefetch_weights(slots, experts, mapping)
    want = prefetch_reference([np.full((R, PER // 4), 7.0, np.float32)], [experts.numpy()], mapping.numpy())[
        0
    ]
    assert np.array_equal(slots.numpy(), want)
    grads, red = torch.randn(L, H), torch.randn(R, H)
    rg.copy_(red)
    want_g = reduce_grads_reference([red.numpy()], [grads.numpy().copy()], mapping.numpy())[0]
    lb.lb_reduce_grads(rg, grads, mapping, num_sms=500)
    assert np.array_equal(grads.numpy().view(np.uint32), want_g.view(np.uint32))
    assert calls == [
        ("copy", 1, lb.lb_get_theoretical_num_sms()),
        ("reduce", 2, 132),
    ]  # 500 SMs: the device's
    lb._lb_sym.herr[:] = torch.tensor([1, 0, 3, 1])
    with pytest.raises(EPTimeoutError, match="waiting for rank 3"):
        lb.lb_prefetch_weights(slots, experts, mapping)
    sym = lb._lb_sym
    lb.destroy()
    assert closed == [1] and lb.lb_storage is None and lb._lb_sym is None and sym.alloc is None
