"""CPU: RankDriver's prepared launches (ep_core.kernels.prepared_launch). The CUDA driver is mocked; the fake
kernels record the packed `OpArgs` bytes of every launch.

- a repeated call of one shape hits, and its bytes (new pointers patched into the kept words) equal those of a
  fresh pack of the same call (the cache cleared, the same launch number and pointers);
- a change of any input that shapes the launch misses the cache (and packs afresh);
- a new handle's int32 arrays carved from one allocation (ep_core.kernels.array_block): disjoint, aligned,
  C-contiguous views of the allocator's array type, a new block per dispatch.
"""

from __future__ import annotations

import itertools
import math
import os
import random
from types import SimpleNamespace

import ep_layout
import numpy as np
import pytest
from ep_core.device_array import DeviceArray as CoreArray
from ep_core.handle import BLOCK_PARTS
from ep_core.kernels import _cuda, array_block, prepared_launch
from ep_core.kernels import rank_driver as rank_driver_mod
from ep_core.kernels._args import OP_ARGS_FIELDS, pack_op_args
from ep_core.kernels._cuda import DeviceView
from ep_core.kernels.array_block import ALIGN_WORDS, carve, int32_block
from ep_core.kernels.prepared_launch import OP_ARGS_STRUCT, PlanCache, PreparedLaunch
from ep_core.kernels.rank_driver import RankDriver, RankResources

N, M, HIDDEN, TOPK, EXPERTS = 2, 64, 256, 4, 16


class FakeWords:
    def __init__(self, count: int) -> None:
        self.array = np.zeros(count, np.int32)
        self.device_ptr = 0x7F00_0000_0000

    def read(self) -> tuple[int, ...]:
        return tuple(int(v) for v in self.array)

    def clear(self) -> None:
        self.array[:] = 0


class FakeKernel:
    def __init__(self, name: str, log: list) -> None:
        self.name = name
        self.log = log

    def max_active_blocks_per_sm(self, block: int, shared_mem: int = 0) -> int:
        return 1

    def launch(self, grid, block, args, shared_mem=0, stream=0, cooperative=False, pdl=False):
        (arg,) = args
        self.log.append((self.name, grid, block, shared_mem, stream, cooperative, pdl, bytes(arg.value)))


@pytest.fixture
def launches(monkeypatch):
    log: list = []
    kernels = SimpleNamespace(
        dispatch=FakeKernel("dispatch", log),
        epilogue=FakeKernel("epilogue", log),
        combine=FakeKernel("combine", log),
        combine_zero_copy=FakeKernel("combine_zero_copy", log),
        dispatch_zero_copy=FakeKernel("dispatch_zero_copy", log),
    )
    monkeypatch.setattr(_cuda, "num_device_sms", lambda: 132)
    monkeypatch.setattr(_cuda, "current_device", lambda: 0)
    monkeypatch.setattr(_cuda, "device_attribute", lambda name: 1_980_000)
    monkeypatch.setattr(_cuda, "MappedWords", FakeWords)
    monkeypatch.setattr(
        rank_driver_mod, "PinnedBuffer", lambda n: SimpleNamespace(array=np.zeros(n, np.uint8))
    )
    monkeypatch.setattr(_cuda, "memset", lambda *a, **k: None)
    monkeypatch.setattr(_cuda, "copy_device", lambda *a, **k: None)
    monkeypatch.setattr(_cuda, "copy_to_host", _fake_counts)
    monkeypatch.setattr(_cuda, "DeviceBuffer", lambda nbytes: SimpleNamespace(ptr=0x6000_0000, nbytes=nbytes))
    monkeypatch.setattr(rank_driver_mod, "load_kernels", lambda config: kernels)
    return log


def _fake_counts(host: np.ndarray, ptr: int, stream) -> None:
    """CPU-sync counts: 3 rows per expert (the last psum entry is the total). A copy longer than the prefix sums
    spans a handle block from them to the counts (`RankDriver._copy_counts`' one copy): the sums first."""
    words = host.view(np.int32)
    words[:] = 3
    if len(words) >= N and len(words) != EXPERTS // N:  # the scale-up prefix sums (alone, or a block's span)
        words[:N] = np.arange(1, N + 1) * 12


class Allocator:
    """Distinct pointers per allocation, replayable from a mark (so a second run gets the same pointers)."""

    def __init__(self) -> None:
        self.next = 1 << 40

    def __call__(self, shape, dtype, strides=None) -> DeviceView:
        self.next += 1 << 24
        return DeviceView(self.next, tuple(shape), np.dtype(dtype), strides)


def make_rank(alloc: Allocator, *, num_ranks: int = N, on_device: int = 1, **kw) -> RankDriver:
    stream = SimpleNamespace(handle=0x5000, synchronize=lambda timeout=None: True)
    res = RankResources(0, num_ranks, 0x1000_0000, 1 << 30, 0x2000, stream, num_ranks_on_device=on_device)
    rank = RankDriver(res, num_max_tokens_per_rank=M, allocator=alloc, **kw)
    rank.read_error = lambda: (np.zeros(ep_layout.NUM_ERROR_RECORD_BYTES, np.uint8), np.zeros(4, np.int64))
    return rank


_PTR = [1 << 41]


def arr(shape, dtype, strides=None) -> DeviceView:
    _PTR[0] += 1 << 24
    return DeviceView(_PTR[0], tuple(shape), np.dtype(dtype), strides)


def inputs(
    t: int = 32, hidden: int = HIDDEN, k: int = TOPK, idx_dtype=np.int64, fp8: bool = False, stride=None
):
    x = arr((t, hidden), np.uint8 if fp8 else np.uint16, None if stride is None else (stride, 1))
    sf = arr((t, hidden // 128), np.float32) if fp8 else None
    return x, sf, arr((t, k), idx_dtype), arr((t, k), np.float32)


def replay(rank: RankDriver, alloc: Allocator, log: list, call) -> list:
    """The launches of `call()` twice: through the rank's prepared launches, then packed afresh (cache cleared)
    with the same launch number, scratch and allocations; returns the first run's launches after checking both."""
    step, mark, n = rank._num_collective_launches, alloc.next, len(log)
    call()
    hit = log[n:]
    rank.plans.clear()
    rank._num_collective_launches, alloc.next = step, mark
    n = len(log)
    call()
    fresh = log[n:]
    assert hit == fresh
    return hit


def dispatch(rank, x, sf, idx, w, **kw):
    return rank.dispatch(x, idx, w, sf=sf, **kw)


def test_patch_equals_a_fresh_pack() -> None:
    rng = random.Random(7)
    dynamic = ("x", "topk_idx", "recv_x", "envelope", "num_out_rows")
    args = {name: rng.randrange(0, 1 << 40) for name in OP_ARGS_FIELDS}
    launch = PreparedLaunch.pack(None, "k", 1, 1, 0, False, args, dynamic)
    assert OP_ARGS_STRUCT.pack(*launch.words) == pack_op_args(**args)
    for _ in range(20):
        values = [rng.randrange(0, 1 << 64) for _ in dynamic]  # pointers above 2**63 wrap as in pack_op_args
        new = dict(args, **dict(zip(dynamic, values)))
        assert OP_ARGS_STRUCT.pack(*launch.patch(values)) == pack_op_args(**new)
    assert OP_ARGS_STRUCT.pack(*launch.words) == pack_op_args(**args)  # the kept words are not modified


def test_repeated_calls_hit_and_patch_only_their_pointers(launches) -> None:
    alloc = Allocator()
    rank = make_rank(alloc)
    x, sf, idx, w = inputs()
    first = dispatch(rank, x, sf, idx, w, num_experts=EXPERTS, do_cpu_sync=False, num_sms=8)
    misses = rank.plans.misses
    assert misses == 1
    for _ in range(3):  # new inputs and outputs each time: the same shape
        x, sf, idx, w = inputs()
        out = replay(
            rank,
            alloc,
            launches,
            lambda x=x, sf=sf, idx=idx, w=w: dispatch(
                rank, x, sf, idx, w, num_experts=EXPERTS, do_cpu_sync=False, num_sms=8
            ),
        )
        assert [e[0] for e in out] == ["dispatch", "epilogue"]
        words = OP_ARGS_STRUCT.unpack(out[0][-1])
        assert (
            words[OP_ARGS_FIELDS.index("x")] == x.ptr and words[OP_ARGS_FIELDS.index("topk_idx")] == idx.ptr
        )
    # a hit, measured without the replay's cleared cache
    rank.plans.misses = 0
    dispatch(rank, *inputs(), num_experts=EXPERTS, do_cpu_sync=False, num_sms=8)
    assert rank.plans.misses == 0
    # CPU sync (the epilogue's row count comes from the counts), cached dispatch, combine
    x, sf, idx, w = inputs()
    replay(rank, alloc, launches, lambda: dispatch(rank, x, sf, idx, w, num_experts=EXPERTS, num_sms=8))
    handle = first.handle
    x2 = arr(x.shape, np.uint16)
    out = replay(rank, alloc, launches, lambda: rank.dispatch(x2, handle=handle, num_sms=8))
    assert [e[0] for e in out] == ["dispatch", "epilogue"]
    recv = arr((handle.num_recv_tokens, HIDDEN), np.uint16)
    for _ in range(2):
        cw = arr((handle.num_recv_tokens, TOPK), np.float32)
        bias = arr((handle.num_tokens, HIDDEN), np.uint16)
        out = replay(
            rank,
            alloc,
            launches,
            lambda cw=cw, bias=bias: rank.combine(recv, handle, topk_weights=cw, bias=bias),
        )
        assert [e[0] for e in out] == ["combine"]
    replay(rank, alloc, launches, lambda: rank.combine(recv, handle))  # no weights, no bias: null pointers


_BASE = dict(t=32, hidden=HIDDEN, k=TOPK, idx_dtype=np.int64, fp8=False, stride=None)
_DISPATCH_CHANGES = {
    "num_tokens": ({"t": 16}, {}),
    "hidden": ({"hidden": 512}, {}),
    "topk": ({"k": 2}, {}),
    "int32 topk_idx": ({"idx_dtype": np.int32}, {}),
    "fp8": ({"fp8": True}, {}),
    "x row stride": ({"stride": HIDDEN + 64}, {}),
    "num_experts": ({}, {"num_experts": 32}),
    "num_sms": ({}, {"num_sms": 4}),
    "expert_alignment": ({}, {"expert_alignment": 4}),
    "deterministic": ({}, {"deterministic": True}),
    "do_expand": ({}, {"do_expand": True}),
    "do_zero_padding": ({}, {"do_expand": True, "do_zero_padding": True}),
}


@pytest.mark.parametrize("change", sorted(_DISPATCH_CHANGES))
def test_a_dispatch_shape_change_misses(launches, change: str) -> None:
    alloc = Allocator()
    rank = make_rank(alloc)
    base_kw = dict(num_experts=EXPERTS, do_cpu_sync=False, num_sms=8)
    dispatch(rank, *inputs(**_BASE), **base_kw)
    dispatch(rank, *inputs(**_BASE), **base_kw)
    assert rank.plans.misses == 1
    shape, kw = _DISPATCH_CHANGES[change]
    xs = inputs(**{**_BASE, **shape})
    dispatch(rank, *xs, **{**base_kw, **kw})
    assert rank.plans.misses == 2, change
    replay(rank, alloc, launches, lambda: dispatch(rank, *xs, **{**base_kw, **kw}))


@pytest.mark.parametrize("change", ["timeout_cycles", "skip_scaleout_signal", "num_ranks_on_device"])
def test_a_rank_setting_change_misses(launches, change: str) -> None:
    """Settings of the rank that enter the launch (tests and the hybrid debug flag change them on a live rank)."""
    rank = make_rank(Allocator())
    kw = dict(num_experts=EXPERTS, do_cpu_sync=False, num_sms=8)
    dispatch(rank, *inputs(), **kw)
    if change == "timeout_cycles":
        rank.timeout_cycles += 1
    elif change == "skip_scaleout_signal":
        rank.debug_skip_scaleout_signal = True
    else:
        rank.num_ranks_on_device = 2
        rank.cooperative = False
    n = len(launches)
    dispatch(rank, *inputs(), **kw)
    assert rank.plans.misses == 2
    if change == "timeout_cycles":
        words = OP_ARGS_STRUCT.unpack(launches[n][-1])
        assert words[OP_ARGS_FIELDS.index("timeout_cycles")] == rank.timeout_cycles


@pytest.mark.parametrize("change", ["num_sms", "allow_multiple_reduction", "hidden", "expand handle"])
def test_a_combine_shape_change_misses(launches, change: str) -> None:
    alloc = Allocator()
    rank = make_rank(alloc)
    kw = dict(num_experts=EXPERTS, do_cpu_sync=False, num_sms=8)
    handle = dispatch(rank, *inputs(), **kw).handle
    recv = arr((handle.num_recv_tokens, HIDDEN), np.uint16)
    rank.combine(recv, handle)
    rank.combine(recv, handle)
    misses = rank.plans.misses
    ckw: dict = {}
    if change == "num_sms":
        ckw["num_sms"] = 4
    elif change == "allow_multiple_reduction":
        ckw["allow_multiple_reduction"] = False
    elif change == "hidden":
        recv = arr((handle.num_recv_tokens, 2 * HIDDEN), np.uint16)
    else:
        handle = dispatch(rank, *inputs(), **kw, do_expand=True).handle
        misses = rank.plans.misses
        recv = arr((handle.num_expanded_tokens, HIDDEN), np.uint16)
    rank.combine(recv, handle, **ckw)
    assert rank.plans.misses == misses + 1
    replay(rank, alloc, launches, lambda: rank.combine(recv, handle, **ckw))


def test_the_plan_cache_counts_launches_only_and_clears_when_full(monkeypatch) -> None:
    """One cache per rank (issue 45): launch entries are misses; plans and SM counts are kept without counting; a
    full cache starts over (a lost entry is only prepared again)."""
    cache = PlanCache()
    token = object()
    cache.put(("dispatch", 1), "launch")
    cache.keep(token, "plan")
    computed = []
    assert cache.sms(8, 2, lambda: computed.append(1) or 5) == 5
    assert cache.sms(8, 2, lambda: computed.append(1) or 6) == 5 and computed == [1]
    assert (cache.misses, cache.get(token), cache.get(("sms", 8, 2)), cache.launches()) == (
        1,
        "plan",
        5,
        ["launch"],
    )
    monkeypatch.setattr(prepared_launch, "_MAX_ENTRIES", 3)
    cache.put(("combine", 2), "other")
    assert (cache.misses, len(cache), cache.get(token), cache.launches()) == (2, 1, None, ["other"])


def test_a_direct_callers_planner_sm_count_is_an_entry_but_no_miss(launches, monkeypatch) -> None:
    from ep_core import planner

    calls = []
    monkeypatch.setattr(planner, "get_theoretical_num_sms", lambda *a, **k: calls.append(a) or 7)
    rank = make_rank(Allocator())
    assert rank._planner_sms(EXPERTS, 2) == rank._planner_sms(EXPERTS, 2) == 7 and len(calls) == 1
    assert (rank.plans.get(("sms", EXPERTS, 2)), rank.plans.misses, rank.plans.launches()) == (7, 0, [])


def test_a_failed_occupancy_check_stores_nothing(launches, monkeypatch) -> None:
    """The occupancy verdict is part of the prepared launch: a shape that does not fit raises on every call."""
    rank = make_rank(Allocator())
    from ep_core.errors import EPConfigError

    monkeypatch.setattr(FakeKernel, "max_active_blocks_per_sm", lambda self, block, shared_mem=0: 0)
    for _ in range(2):
        with pytest.raises(EPConfigError, match="does not fit"):
            dispatch(rank, *inputs(), num_experts=EXPERTS, do_cpu_sync=False, num_sms=8)
    assert rank.plans.launches() == []


# ------------------------------------------------------------------------------------ handle arrays in one block
SHAPES = [(32, 8), (2,), (16,), (16,), (128, 10), (0, 8)]


def _check_layout(ptrs: list[int], base: int) -> None:
    ends = []
    for p, shape in zip(ptrs, SHAPES):
        if math.prod(shape) == 0:  # no memory: numpy and torch may report any address
            continue
        assert (p - base) % (4 * ALIGN_WORDS) == 0
        ends.append((p, p + 4 * math.prod(shape)))
    for (_, end), (start, _) in itertools.pairwise(ends):
        assert end <= start  # disjoint, in order


def test_core_arrays_view_one_block() -> None:
    blocks = []

    def allocate(shape, dtype):
        blocks.append(CoreArray(1 << 40, shape, dtype, device="cuda", device_id=3))
        return blocks[-1]

    views = int32_block(allocate, SHAPES)
    assert len(blocks) == 1 and blocks[0].dtype == "int32"
    for v, shape in zip(views, SHAPES):
        want = CoreArray(v.ptr, shape, "int32", device="cuda", device_id=3)
        assert (v.shape, v.strides, v.dtype, v.device, v.device_id) == (
            want.shape,
            want.strides,
            want.dtype,
            want.device,
            want.device_id,
        )
        assert v.owner is blocks[0]  # the views keep the block alive
        assert v.__cuda_array_interface__["strides"] is None  # C-contiguous
    _check_layout([v.ptr for v in views], blocks[0].ptr)
    assert blocks[0].shape[0] * 4 >= views[-2].ptr + 4 * 128 * 10 - blocks[0].ptr


def test_numpy_and_torch_arrays_view_one_block() -> None:
    for make in (lambda shape, dtype: np.full(shape, -7, dtype),):
        views = int32_block(make, SHAPES)
        assert [v.shape for v in views] == SHAPES and all(v.flags.c_contiguous for v in views)
        base = views[0].ctypes.data
        _check_layout([v.ctypes.data for v in views], base)
        views[1][:] = 5  # disjoint: writing one leaves the others
        assert (views[0] == -7).all() and (views[2] == -7).all()
    torch = pytest.importorskip("torch")
    views = int32_block(lambda shape, dtype: torch.full(shape, -7, dtype=getattr(torch, dtype)), SHAPES)
    assert [tuple(v.shape) for v in views] == SHAPES and all(v.is_contiguous() for v in views)
    _check_layout([v.data_ptr() for v in views], views[0].data_ptr())
    views[4].fill_(1)
    assert int(views[4].sum()) == 1280 and (views[3] == -7).all() and (views[0] == -7).all()


def test_other_array_types_fall_back() -> None:
    assert int32_block(lambda shape, dtype: object(), SHAPES) is None


def test_default_carves_only_offered_blocks() -> None:
    """By default the executor carves no block itself (its DeviceArray views' owner is the block); an allocator's
    own `int32_block` (ep_torch's torch allocator) is used."""
    if os.environ.get("EPKIT_HANDLE_BLOCK") is None:
        assert array_block.MODE == "offered"
        assert not array_block.use_block(True) and not array_block.use_block(False)
        assert array_block.use_offered()


@pytest.mark.parametrize(
    ("mode", "own", "want", "offered"),
    [
        ("offered", True, False, True),
        ("auto", True, True, True),
        ("auto", False, False, True),
        ("1", False, True, True),
        ("0", True, False, False),
    ],
)
def test_mode(monkeypatch, mode: str, own: bool, want: bool, offered: bool) -> None:
    monkeypatch.setattr(array_block, "MODE", mode)
    assert array_block.use_block(own) is want
    assert array_block.use_offered() is offered


class BlockAllocator(Allocator):
    """An allocator offering `int32_block` over its own pointers (as GpuExecutor's does for its default one)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = 0

    def int32_block(self, shapes):
        self.blocks += 1
        return int32_block(lambda shape, dtype: CoreArray(self(shape, np.int32).ptr, shape, dtype), shapes)


@pytest.mark.parametrize("do_cpu_sync", [False, True])
def test_rank_driver_takes_the_handle_arrays_from_one_block(launches, do_cpu_sync: bool) -> None:
    alloc = BlockAllocator()
    rank = make_rank(alloc)
    x, _, idx, w = inputs()
    out = rank.dispatch(x, idx, w, num_experts=EXPERTS, do_cpu_sync=do_cpu_sync, num_sms=8)
    h = out.handle
    assert alloc.blocks == 1
    arrays = [
        h.dst_buffer_slot_idx,
        h.psum_num_recv_tokens_per_scaleup_rank,
        h.psum_num_recv_tokens_per_expert,
        h.num_unaligned_recv_tokens_per_expert,
    ]
    shapes = [(32, TOPK), (N,), (EXPERTS // N,), (EXPERTS // N,)]
    if not do_cpu_sync:  # the metadata's rows are known at launch: in the block too
        arrays.append(h.recv_src_metadata)
        shapes.append((N * M, TOPK + 2))
    assert all(type(a) is CoreArray for a in arrays)
    assert [a.shape for a in arrays] == shapes
    assert len({id(a.owner) for a in arrays}) == 1
    words = OP_ARGS_STRUCT.unpack(launches[0][-1])
    for field, a in zip(("dst_slot", "psum_rank", "psum_expert", "unaligned_expert"), arrays):
        assert words[OP_ARGS_FIELDS.index(field)] == a.ptr
    epi = OP_ARGS_STRUCT.unpack(launches[1][-1])
    assert epi[OP_ARGS_FIELDS.index("src_metadata")] == h.recv_src_metadata.ptr
    # a second dispatch gets a new block: the first handle's arrays are never reused
    x, _, idx, w = inputs()
    h2 = rank.dispatch(x, idx, w, num_experts=EXPERTS, do_cpu_sync=False, num_sms=8).handle
    assert alloc.blocks == 2 and h2.dst_buffer_slot_idx.owner is not h.dst_buffer_slot_idx.owner


# ------------------------------------------------------------------------------------ repeated calls (kernels.op_plan)
def _same_call(rank, alloc, log, run):
    """`run(repeat)` twice from the same launch number and allocation mark: through the recorded repeat (True) and
    through the full path (False); returns both (launches, result)."""
    step, mark = rank._num_collective_launches, alloc.next
    out = []
    for repeat in (True, False):
        rank._num_collective_launches, alloc.next = step, mark
        n = len(log)
        res = run(repeat)
        out.append((log[n:], res))
    return out


def _fields(res) -> tuple:
    h = getattr(res, "handle", None)
    arrays = tuple(getattr(res, f) for f in res.__dataclass_fields__ if f not in ("handle", "event"))
    return arrays, None if h is None else tuple(vars(h).items())


_REPEAT_DISPATCHES = {
    "bf16": ({}, {}),
    "fp8": ({"fp8": True}, {}),
    "fp8 col-major scales": ({"fp8": True}, {"use_tma_aligned_col_major_sf": True}),
    "expand": ({}, {"do_expand": True, "expert_alignment": 4}),
    "zero padding": ({}, {"do_expand": True, "do_zero_padding": True}),
    "int32 ids": ({"idx_dtype": np.int32}, {}),
    "no weights": ({}, {"weights": False}),
    "cpu sync": ({}, {"do_cpu_sync": True}),
    "cpu sync, expand": ({}, {"do_cpu_sync": True, "do_expand": True, "expert_alignment": 4}),
}


@pytest.mark.parametrize("case", sorted(_REPEAT_DISPATCHES))
def test_a_repeat_equals_the_full_path(launches, case: str) -> None:
    """A recorded plan (ep_core.kernels.op_plan) launches the same bytes and returns the same outputs and handle
    as the full path: for a dispatch without CPU sync, a cached dispatch with its handle, and a combine."""
    from ep_core.kernels.op_plan import CombinePlan as RepeatCombine
    from ep_core.kernels.op_plan import DispatchPlan as RepeatDispatch

    alloc = Allocator()
    rank = make_rank(alloc)
    shape, kw = _REPEAT_DISPATCHES[case]
    kw = dict(kw)
    weights = kw.pop("weights", True)
    kw.setdefault("do_cpu_sync", False)
    kw.update(num_experts=EXPERTS, num_sms=8)
    x, sf, idx, w = inputs(**shape)
    w = w if weights else None
    first = rank.dispatch(x, idx, w, sf=sf, record=True, **kw)
    plan = rank.last_repeat
    assert isinstance(plan, RepeatDispatch)
    for _ in range(2):
        x, sf, idx, w = inputs(**shape)
        w = w if weights else None

        def run(repeat, x=x, sf=sf, idx=idx, w=w):
            if repeat:
                ptr = [0 if a is None else a.ptr for a in (sf, idx, w)]
                return plan.run(x.ptr, ptr[0], ptr[1], ptr[2], 0, None, idx)
            return rank.dispatch(x, idx, w, sf=sf, **kw)

        (rep, a), (full, b) = _same_call(rank, alloc, launches, run)
        assert rep == full and [e[0] for e in rep] == ["dispatch", "epilogue"]
        assert _fields(a) == _fields(b)
        assert (a.handle in rank._unconfirmed) is not kw["do_cpu_sync"]
        assert rank._handle_launch[a.handle] == rank._num_collective_launches
    # the cached dispatch of that handle
    handle = first.handle
    ckw = {k: v for k, v in kw.items() if k in ("num_sms", "use_tma_aligned_col_major_sf", "do_zero_padding")}
    x2, sf2, _, _ = inputs(**shape)
    rank.dispatch(x2, handle=handle, sf=sf2, record=True, **ckw)
    cplan = rank.last_repeat
    assert isinstance(cplan, RepeatDispatch) and cplan.cached

    def cached(repeat):
        if repeat:
            return cplan.run(x2.ptr, 0 if sf2 is None else sf2.ptr, 0, 0, 0, handle, None)
        return rank.dispatch(x2, handle=handle, sf=sf2, **ckw)

    (rep, a), (full, b) = _same_call(rank, alloc, launches, cached)
    assert rep == full and _fields(a) == _fields(b) and a.handle is handle
    # the combine, with weights and a bias
    rows = handle.num_expanded_tokens if handle.do_expand else handle.num_recv_tokens
    recv = arr((rows, HIDDEN), np.uint16)
    cw = arr((rows,) if handle.do_expand else (rows, TOPK), np.float32)
    bias = arr((handle.num_tokens, HIDDEN), np.uint16)
    rank.combine(recv, handle, topk_weights=cw, bias=bias, record=True)
    comb = rank.last_repeat
    assert isinstance(comb, RepeatCombine)

    def combine(repeat):
        if repeat:
            return comb.run(recv.ptr, cw.ptr, bias.ptr, 0, handle)
        return rank.combine(recv, handle, topk_weights=cw, bias=bias)

    (rep, a), (full, b) = _same_call(rank, alloc, launches, combine)
    assert rep == full and [e[0] for e in rep] == ["combine"] and _fields(a) == _fields(b)


@pytest.mark.parametrize("fp8", (False, True), ids=("bf16", "fp8"))
def test_a_zero_copy_repeat_equals_the_full_path(launches, fp8: bool) -> None:
    """A no-sync zero-copy dispatch records a repeat that launches the same bytes (the zero-copy kernel alone, the
    handle's metadata among its words) and returns the same views and handle as the full path; a CPU-sync one
    records none (its handle keeps a slice of the metadata)."""
    from ep_core.kernels.op_plan import DispatchPlan as RepeatDispatch

    alloc = Allocator()
    rank = make_rank(alloc)
    kw = dict(num_experts=EXPERTS, num_sms=8, do_cpu_sync=False, zero_copy=True)
    x, sf, idx, w = inputs(fp8=fp8)
    rank.dispatch(x, idx, w, sf=sf, record=True, **kw)
    plan = rank.last_repeat
    assert isinstance(plan, RepeatDispatch) and plan.zero_copy

    def views(res) -> list:
        outs = (res.recv_x, res.recv_sf, res.recv_topk_idx, res.recv_topk_weights)
        return [None if v is None else (type(v), v.ptr, v.shape, v.dtype) for v in outs]

    for _ in range(2):
        x, sf, idx, w = inputs(fp8=fp8)

        def run(repeat, x=x, sf=sf, idx=idx, w=w):
            if repeat:
                return plan.run(x.ptr, 0 if sf is None else sf.ptr, idx.ptr, w.ptr, 0, None, idx)
            return rank.dispatch(x, idx, w, sf=sf, **kw)

        (rep, a), (full, b) = _same_call(rank, alloc, launches, run)
        assert rep == full and [e[0] for e in rep] == ["dispatch_zero_copy"]
        assert views(a) == views(b) and a.recv_x.ptr == rank.combine_buffer(a.handle, HIDDEN).ptr
        assert tuple(vars(a.handle).items()) == tuple(vars(b.handle).items())
        assert (
            a.handle in rank._unconfirmed and rank._handle_launch[a.handle] == rank._num_collective_launches
        )
    rank.dispatch(x, idx, w, sf=sf, record=True, **{**kw, "do_cpu_sync": True})
    assert rank.last_repeat is None


def test_a_zero_copy_combine_repeat_equals_the_full_path(launches) -> None:
    """A recorded zero-copy combine launches the same bytes as the full path (the zero-copy kernel, the handle's
    slots among its words) and declines (None: the full path, which names the error) an x that is not the buffer."""
    from ep_core.kernels.op_plan import CombinePlan as RepeatCombine

    alloc = Allocator()
    rank = make_rank(alloc, epilogue_sms=132)
    x, _, ti, w = inputs()
    handle = rank.dispatch(x, ti, w, num_experts=EXPERTS, num_sms=8, do_cpu_sync=False).handle
    buf = rank.combine_buffer(handle, HIDDEN)
    rank.combine(buf, handle, zero_copy=True, record=True)
    plan = rank.last_repeat
    assert isinstance(plan, RepeatCombine) and plan.zero_copy and plan.buffer_ptr == buf.ptr

    def run(repeat):
        if repeat:
            return plan.run(buf.ptr, 0, 0, 0, handle)
        return rank.combine(buf, handle, zero_copy=True)

    (rep, a), (full, b) = _same_call(rank, alloc, launches, run)
    assert rep == full and [e[0] for e in rep] == ["combine_zero_copy"] and _fields(a) == _fields(b)
    assert plan.run(buf.ptr + 2, 0, 0, 0, handle) is None


def test_a_repeat_declines_what_its_key_does_not_cover(launches) -> None:
    """A changed scratch, the skip-signal test flag, a handle whose topk_idx changed dtype or became strided, and
    a CPU-sync dispatch: the repeat does nothing (None) and leaves the call to the full path."""
    from ep_layout import ErrorKind

    alloc = Allocator()
    rank = make_rank(alloc)
    kw = dict(num_experts=EXPERTS, do_cpu_sync=False, num_sms=8)
    x, _, idx, w = inputs()
    handle = rank.dispatch(x, idx, w, record=True, **kw).handle
    plan = rank.last_repeat
    rank.dispatch(x, handle=handle, num_sms=8, record=True)
    cplan = rank.last_repeat
    n = len(launches)
    rank._last_scratch += 4096
    assert plan.run(x.ptr, 0, idx.ptr, w.ptr, 0, None, idx) is None
    rank._last_scratch -= 4096
    rank.debug_skip_scaleout_signal = True
    assert plan.run(x.ptr, 0, idx.ptr, w.ptr, 0, None, idx) is None
    rank.debug_skip_scaleout_signal = False
    handle.topk_idx = arr(idx.shape, np.int32)
    assert cplan.run(x.ptr, 0, 0, 0, 0, handle, None) is None
    handle.topk_idx = arr(idx.shape, np.int64, (2 * TOPK, 1))  # strided rows: the full path refuses it
    assert cplan.run(x.ptr, 0, 0, 0, 0, handle, None) is None
    assert len(launches) == n  # nothing was launched
    handle.topk_idx = idx
    assert cplan.run(x.ptr, 0, 0, 0, 0, handle, None) is not None
    # the failure guard and a failed handle still raise on a repeat
    rank.fail_unconfirmed_handles()
    from ep_core.errors import EPStateError

    with pytest.raises(EPStateError, match="no-sync dispatch"):
        cplan.run(x.ptr, 0, 0, 0, 0, handle, None)
    rank.dispatch(x, idx, w, record=True, num_experts=EXPERTS, num_sms=8)  # CPU sync: repeated too
    assert rank.last_repeat.cpu_sync
    rank._status.array[0] = int(ErrorKind.TIMEOUT)
    with pytest.raises(Exception, match=r"kernel|timed out|failed"):
        plan.run(x.ptr, 0, idx.ptr, w.ptr, 0, None, idx)


def test_the_epilogue_is_a_programmatic_dependent_launch_where_safe(launches, monkeypatch) -> None:
    """No CPU sync between the two launches and every rank's dispatch and epilogue grids fit the GPU together
    (helper-latency's request, issue 17): the epilogue launches with PDL; after a CPU sync, with ranks sharing the
    GPU whose grids would not fit twice, or with EPKIT_EPILOGUE_PDL=0, it does not."""

    def pdl_of_epilogue(rank, **kw):
        n = len(launches)
        rank.dispatch(*inputs()[0:1], inputs()[2], inputs()[3], num_experts=EXPERTS, num_sms=8, **kw)
        (epi,) = [e for e in launches[n:] if e[0] == "epilogue"]
        return epi[6]

    rank = make_rank(Allocator())
    assert pdl_of_epilogue(rank, do_cpu_sync=False) is True
    assert pdl_of_epilogue(rank, do_cpu_sync=False) is True  # the kept launch (a hit) too
    assert pdl_of_epilogue(rank) is False  # CPU sync
    shared = make_rank(Allocator())
    shared.num_ranks_on_device, shared.cooperative = 2, False
    assert pdl_of_epilogue(shared, do_cpu_sync=False) is True  # 2 ranks x 2 grids of 8 blocks fit 132 SMs
    monkeypatch.setattr(FakeKernel, "max_active_blocks_per_sm", lambda self, block, shared_mem=0: 1)
    crowded = make_rank(Allocator())
    crowded.num_ranks_on_device, crowded.cooperative = 16, False
    monkeypatch.setattr(crowded, "device_sms", 200)  # 16 ranks x 8 SMs fit, twice that does not
    assert pdl_of_epilogue(crowded, do_cpu_sync=False) is False
    monkeypatch.setattr(rank_driver_mod, "EPILOGUE_PDL", False)
    assert pdl_of_epilogue(make_rank(Allocator()), do_cpu_sync=False) is False


# ------------------------------------------------------------------------------------ the native launch path
def test_the_cuda_python_fallback_is_announced_once(monkeypatch) -> None:
    """Without a usable ep_launch the executor says so once (a RuntimeWarning naming the reason) and
    `native_launch_status()` keeps the reason; EPKIT_NATIVE_LAUNCH=0 chooses that path without a warning."""
    import warnings

    ep_launch = pytest.importorskip("ep_launch")
    monkeypatch.setattr(_cuda, "_native", [])
    monkeypatch.setattr(ep_launch, "available", lambda: False)
    monkeypatch.setattr(ep_launch, "unavailable_reason", lambda: "no driver here")
    monkeypatch.delenv("EPKIT_NATIVE_LAUNCH", raising=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert _cuda.native_launch() is None
        assert _cuda.native_launch() is None
    assert len(seen) == 1 and issubclass(seen[0].category, RuntimeWarning)
    assert "no driver here" in str(seen[0].message) and "cuda-python" in str(seen[0].message)
    assert _cuda.native_launch_status().startswith("cuda-python fallback") and "no driver here" in (
        _cuda.native_launch_status()
    )
    monkeypatch.setattr(_cuda, "_native", [])
    monkeypatch.setenv("EPKIT_NATIVE_LAUNCH", "0")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert _cuda.native_launch() is None
    assert not seen and "EPKIT_NATIVE_LAUNCH=0" in _cuda.native_launch_status()
    monkeypatch.setattr(_cuda, "_native", [])
    monkeypatch.delenv("EPKIT_NATIVE_LAUNCH")
    monkeypatch.setattr(ep_launch, "available", lambda: True)
    assert _cuda.native_launch() is ep_launch and _cuda.native_launch_status().startswith("ep_launch")


def test_native_words_equal_the_python_patch() -> None:
    """The C++ `Launch` patches the words exactly as `PreparedLaunch.patch` (what a hit launches either way)."""
    ep_launch = pytest.importorskip("ep_launch")
    rng = random.Random(11)
    dynamic = ("x", "topk_idx", "recv_x", "envelope", "num_out_rows", "x")
    args = {name: rng.randrange(0, 1 << 40) for name in OP_ARGS_FIELDS}
    launch = PreparedLaunch.pack(None, "k", 1, 1, 0, False, args, dynamic)
    native = ep_launch.Launch(0, 1, 1, 0, False, OP_ARGS_STRUCT.pack(*launch.words), list(launch.slots))
    for _ in range(20):
        values = tuple(rng.randrange(0, 1 << 64) for _ in dynamic)
        assert native.patched(values) == OP_ARGS_STRUCT.pack(*launch.patch(values))


def test_a_repeats_envelope_equals_pack_envelope() -> None:
    """The repeat continues its fields' CRC over the handle's launch number and sets the sequence number into it:
    the same word as `pack_envelope` for any sequence and launch number."""
    from ep_core.kernels._envelope import OP_COMBINE, pack_envelope
    from ep_core.kernels.op_plan import _Envelopes

    rng = random.Random(3)
    fields = (7168, 8, 256, 128, 5)
    env = _Envelopes(OP_COMBINE, fields)
    for _ in range(200):
        seq, launch = (
            rng.randrange(0, 1 << 30),
            rng.choice([-1, 0, 1, 77, 1 << 20, rng.randrange(-(1 << 40), 1 << 40)]),
        )
        assert env.word(seq, launch) == pack_envelope(OP_COMBINE, seq, (*fields, launch))


@pytest.mark.parametrize("case", ["bf16", "fp8 col-major scales", "cpu sync, expand"])
def test_a_repeat_through_the_requests_allocator_equals_the_full_path(launches, case: str) -> None:
    """GpuExecutor hands the repeat the request's own allocator (`allocate(shape, dtype_name)`) instead of its
    numpy-dtype wrapper: the same allocations (shapes, names, the scales' [P, ld] storage), bytes and results."""
    from ep_core.kernels.gpu_executor import GpuExecutor

    names = {"bfloat16": np.uint16, "float8_e4m3fn": np.uint8}
    calls: list = []
    alloc = Allocator()

    def raw(shape, name):
        calls.append((tuple(shape), name))
        return alloc(tuple(shape), names.get(name, name))

    x_name = "float8_e4m3fn" if "fp8" in case else "bfloat16"
    gex = GpuExecutor.__new__(GpuExecutor)
    gex._allocators = {}
    rank = make_rank(alloc)
    rank._allocator = gex._allocator(SimpleNamespace(allocator=raw), x_name)
    shape, kw = _REPEAT_DISPATCHES[case]
    kw = dict(kw)
    kw.setdefault("do_cpu_sync", False)
    kw.update(num_experts=EXPERTS, num_sms=8)
    x, sf, idx, w = inputs(**shape)
    first = rank.dispatch(x, idx, w, sf=sf, record=True, **kw)
    plan = rank.last_repeat
    x, sf, idx, w = inputs(**shape)

    def run(repeat):
        n = len(calls)
        if repeat:
            res = plan.run(x.ptr, 0 if sf is None else sf.ptr, idx.ptr, w.ptr, 0, None, idx, raw, x_name)
        else:
            res = rank.dispatch(x, idx, w, sf=sf, **kw)
        return res, calls[n:]

    (rep, (a, ca)), (full, (b, cb)) = _same_call(rank, alloc, launches, run)
    assert rep == full and ca == cb and _fields(a) == _fields(b)
    handle = first.handle
    rows = handle.num_expanded_tokens if handle.do_expand else handle.num_recv_tokens
    recv = arr((rows, HIDDEN), np.uint16)
    cw = arr((rows,) if handle.do_expand else (rows, TOPK), np.float32)
    rank.combine(recv, handle, topk_weights=cw, record=True)
    comb = rank.last_repeat

    def combine(repeat):
        n = len(calls)
        if repeat:
            return comb.run(recv.ptr, cw.ptr, 0, 0, handle, raw), calls[n:]
        return rank.combine(recv, handle, topk_weights=cw), calls[n:]

    (rep, (a, ca)), (full, (b, cb)) = _same_call(rank, alloc, launches, combine)
    assert rep == full and ca == cb and _fields(a) == _fields(b)


def test_a_repeat_issues_the_stream_pairs_with_its_first_and_last_launch(launches, monkeypatch) -> None:
    """GpuExecutor's enter / leave pairs ride on a repeat's native launches: the dispatch kernel first waits for the
    caller's stream, the caller's stream waits for the last launch (the epilogue's; the combine's own)."""
    calls: list = []

    class Native:
        class Launch:
            def __init__(self, func, grid, block, smem, coop, words, slots, pdl=False) -> None:
                self.name = "?"

            def __call__(self, stream, values, wait_event=0, wait_on=0, signal_event=0, signal_to=0):
                calls.append((self.name, stream, wait_event, wait_on, signal_event, signal_to))
                return 0

        @staticmethod
        def record_wait(event, on, waiter):
            calls.append(("record_wait", event, on, waiter))
            return 0

    class NativeKernel(FakeKernel):
        _func = 1

        def _opt_in_smem(self, shared_mem) -> None:
            pass

    kernels = SimpleNamespace(
        dispatch=NativeKernel("dispatch", launches),
        epilogue=NativeKernel("epilogue", launches),
        combine=NativeKernel("combine", launches),
    )
    monkeypatch.setattr(rank_driver_mod, "load_kernels", lambda config: kernels)
    monkeypatch.setattr(_cuda, "native_launch", lambda: Native)
    rank = make_rank(Allocator())
    x, _, idx, w = inputs()
    kw = dict(num_experts=EXPERTS, num_sms=8)
    first = rank.dispatch(x, idx, w, record=True, do_cpu_sync=False, **kw)
    plan = rank.last_repeat
    prepared = plan.prepared
    prepared.main.native.name = "dispatch"
    prepared.epilogue_pdl.native.name = "epilogue"
    enter, leave = SimpleNamespace(handle=0xE1), SimpleNamespace(handle=0xE2)
    comm, caller = rank.stream.handle, 0x7777
    assert plan.run(x.ptr, 0, idx.ptr, w.ptr, 0, None, idx, None, "", (enter, caller), (leave, caller))
    assert calls == [
        ("dispatch", comm, 0xE1, caller, 0, 0),
        ("epilogue", comm, 0, 0, 0xE2, caller),
    ]
    calls.clear()
    recv = arr((first.handle.num_recv_tokens, HIDDEN), np.uint16)
    rank.combine(recv, first.handle, record=True)
    comb = rank.last_repeat
    comb.prepared.main.native.name = "combine"
    assert comb.run(recv.ptr, 0, 0, 0, first.handle, None, (enter, caller), (leave, caller))
    assert calls == [("combine", comm, 0xE1, caller, 0xE2, caller)]
    # a split combine (its reduce on a wider grid): the send launch waits, the reduce launch signals
    rank.epilogue_sms = 132
    rank.plans.clear()
    rank.combine(recv, first.handle, record=True)
    split = rank.last_repeat
    split.prepared.main.native.name, split.prepared.epilogue.native.name = "send", "reduce"
    calls.clear()
    assert split.run(recv.ptr, 0, 0, 0, first.handle, None, (enter, caller), (leave, caller))
    assert calls == [("send", comm, 0xE1, caller, 0, 0), ("reduce", comm, 0, 0, 0xE2, caller)]
    rank.epilogue_sms = 0
    # a CPU-sync dispatch that received no rows: the leave pair after the dispatch kernel, on its own
    rank.dispatch(x, idx, w, record=True, **kw)  # the full path, with rows: it keeps the epilogue
    sync = rank.last_repeat
    monkeypatch.setattr(rank_driver_mod.RankDriver, "_sync_counts", lambda self, epr, a: (0, 0, [0] * epr))
    sync.prepared.main.native.name = "dispatch"
    calls.clear()
    assert sync.run(x.ptr, 0, idx.ptr, w.ptr, 0, None, idx, None, "", (enter, caller), (leave, caller))
    assert calls == [("dispatch", comm, 0xE1, caller, 0, 0), ("record_wait", 0xE2, comm, caller)]


def test_epilogue_pdl_only_where_every_block_fits_at_one_per_sm():
    """The copy epilogue runs as a programmatic dependent launch only where its early blocks cannot keep a rank that
    shares the GPU out: all ranks' dispatch + epilogue blocks within the device's SMs (EP8 at 16 SMs per rank on a
    132-SM GPU is not), always for a rank alone on its GPU, never after a CPU sync."""
    from types import SimpleNamespace as NS

    from ep_core.kernels import rank_driver

    def pdl(n: int, grid: int, sync: bool = False, alone: bool = False, epilogue_sms: int = 0) -> bool:
        rank = NS(num_ranks_on_device=n, device_sms=132, epilogue_sms=epilogue_sms)
        p = NS(do_cpu_sync=sync, geometry=NS(grid=grid), epilogue_only=alone)
        return rank_driver.RankDriver._epilogue_pdl(rank, p)

    assert rank_driver.EPILOGUE_PDL
    assert pdl(1, 132) and pdl(8, 8) and pdl(4, 16)
    assert not pdl(8, 16) and not pdl(2, 67) and not pdl(1, 16, sync=True)
    assert not pdl(1, 16, alone=True)  # no dispatch kernel to depend on
    # a wider epilogue (prefer_overlap_with_compute=False) counts with its own grid
    assert pdl(1, 8, epilogue_sms=132) and pdl(2, 8, epilogue_sms=58) and pdl(8, 4, epilogue_sms=4)
    assert not pdl(8, 8, epilogue_sms=16) and not pdl(2, 8, epilogue_sms=66)


def test_the_epilogue_runs_on_the_ranks_share_without_overlap(launches) -> None:
    """`epilogue_sms` (a buffer's prefer_overlap_with_compute=False: the rank's share of the GPU) widens the copy
    epilogue's grid, never below the op's; its launch is otherwise the same, so is the dispatch's (the combine's
    reduce moves too: the next test). 0 keeps every kernel on the op's SMs; a count outside 0..share is refused."""
    from ep_core.errors import EPValueError
    from ep_core.kernels.plan import check_epilogue_sms, epilogue_share

    assert epilogue_share(True, 132, 1) == 0 and epilogue_share(False, 132, 1) == 132
    assert epilogue_share(False, 132, 8) == 16 and epilogue_share(False, 132, 3) == 44
    for bad in (-1, 133, True, 8.0):
        with pytest.raises(EPValueError, match="epilogue_sms"):
            check_epilogue_sms(bad, 132, 1)
    with pytest.raises(EPValueError, match="at most this rank's share"):
        check_epilogue_sms(17, 132, 8)

    def grids(epilogue_sms: int, num_sms: int) -> dict:
        stream = SimpleNamespace(handle=0x5000, synchronize=lambda timeout=None: True)
        res = RankResources(0, N, 0x1000_0000, 1 << 30, 0x2000, stream, num_ranks_on_device=1)
        rank = RankDriver(res, num_max_tokens_per_rank=M, allocator=Allocator(), epilogue_sms=epilogue_sms)
        rank.read_error = lambda: (
            np.zeros(ep_layout.NUM_ERROR_RECORD_BYTES, np.uint8),
            np.zeros(4, np.int64),
        )
        x, _, idx, w = inputs()
        n = len(launches)
        first = rank.dispatch(x, idx, w, num_experts=EXPERTS, num_sms=num_sms, do_cpu_sync=False)
        rank.combine(arr((first.handle.num_recv_tokens, HIDDEN), np.uint16), first.handle)
        return [(e[0], e[1], e[2], e[3], e[6]) for e in launches[n:]]

    op = grids(0, 8)
    assert [e[:2] for e in op] == [("dispatch", 8), ("epilogue", 8), ("combine", 8)]
    wide = grids(132, 8)
    assert [e[:2] for e in wide] == [("dispatch", 8), ("epilogue", 132), ("combine", 8), ("combine", 132)]
    assert wide[1][2:] == op[1][2:]  # the epilogue's block, shared memory and PDL
    assert wide[0] == op[0] and wide[2] == op[2]
    assert [e[1] for e in grids(4, 8)] == [8, 8, 8]  # never fewer than the op's SMs: no wider grid, no split


def test_a_lone_ranks_cached_dispatch_is_its_copy_epilogue_alone(launches, monkeypatch) -> None:
    """A rank with no peer: a cached dispatch launches only the copy epilogue (a plain launch: there is no dispatch
    kernel to depend on) with the words the epilogue of the two-launch form gets, through the full path and the
    recorded repeat alike, and counts the dispatch launch it skipped. Nothing to copy, a peer, or no handle: the
    dispatch kernel is launched as before."""
    alloc = Allocator()
    stream = SimpleNamespace(handle=0x5000, synchronize=lambda timeout=None: True)
    res = RankResources(0, 1, 0x1000_0000, 1 << 30, 0x2000, stream, num_ranks_on_device=1)
    rank = RankDriver(res, num_max_tokens_per_rank=M, allocator=alloc)
    rank.read_error = lambda: (np.zeros(ep_layout.NUM_ERROR_RECORD_BYTES, np.uint8), np.zeros(4, np.int64))
    assert rank.epilogue_only(True, 5, False) and rank.epilogue_only(True, 0, True)
    assert not rank.epilogue_only(True, 0, False) and not rank.epilogue_only(False, 5, False)
    assert not make_rank(Allocator()).epilogue_only(True, 5, False)  # a rank with a peer
    x, sf, idx, w = inputs(fp8=True)
    n = len(launches)
    handle = rank.dispatch(x, idx, w, sf=sf, num_experts=EXPERTS, do_cpu_sync=False, num_sms=8).handle
    assert [(e[0], e[6]) for e in launches[n:]] == [("dispatch", False), ("epilogue", True)]
    x2, sf2, _, _ = inputs(fp8=True)
    rank.dispatch(x2, handle=handle, sf=sf2, num_sms=8, record=True)
    plan = rank.last_repeat
    assert plan is not None and plan.cached

    def cached(repeat):
        if repeat:
            return plan.run(x2.ptr, sf2.ptr, 0, 0, 0, handle, None)
        return rank.dispatch(x2, handle=handle, sf=sf2, num_sms=8)

    step, mark = rank._num_collective_launches, alloc.next
    (rep, a), (full, b) = _same_call(rank, alloc, launches, cached)
    assert rep == full and [(e[0], e[6]) for e in full] == [("epilogue", False)]
    assert _fields(a) == _fields(b) and a.handle is handle
    assert rank._num_collective_launches == step + 1  # the skipped dispatch launch still counts
    # the two-launch form of the same call: its epilogue gets the same words
    monkeypatch.setattr(RankDriver, "epilogue_only", lambda self, cached, rows, zero_padding: False)
    rank._num_collective_launches, alloc.next = step, mark
    (_, _), (two, _) = _same_call(rank, alloc, launches, cached)
    assert [e[0] for e in two] == ["dispatch", "epilogue"] and two[1][7] == full[0][7]


def test_the_combine_splits_its_reduce_onto_the_ranks_share_without_overlap(launches) -> None:
    """With `epilogue_sms` wider than the op's grid the direct combine is two launches on the rank's stream: entry,
    send and exit on the op's grid (the send-only flag, the envelope: collective), then the reduce on the wider grid
    (the reduce-only flag, envelope 0). Every other word equals the one-launch combine's; a recorded repeat issues
    the same two launches as the full path. Without a wider grid: one launch, no split flag."""
    from ep_core.kernels._args import FLAGS

    idx = OP_ARGS_FIELDS.index
    split_flags = FLAGS["combine_send_only"] | FLAGS["combine_reduce_only"]

    def combine_launches(epilogue_sms: int) -> tuple[list, list, int]:
        stream = SimpleNamespace(handle=0x5000, synchronize=lambda timeout=None: True)
        res = RankResources(0, N, 0x1000_0000, 1 << 30, 0x2000, stream, num_ranks_on_device=1)
        alloc = Allocator()
        rank = RankDriver(res, num_max_tokens_per_rank=M, allocator=alloc, epilogue_sms=epilogue_sms)
        rank.read_error = lambda: (
            np.zeros(ep_layout.NUM_ERROR_RECORD_BYTES, np.uint8),
            np.zeros(4, np.int64),
        )
        x, _, ti, w = inputs()
        handle = rank.dispatch(x, ti, w, num_experts=EXPERTS, num_sms=8, do_cpu_sync=False).handle
        recv = arr((handle.num_recv_tokens, HIDDEN), np.uint16)
        rank.combine(recv, handle, record=True)  # the launch shape's first call (a fresh pack)
        plan = rank.last_repeat
        step = rank._num_collective_launches
        (rep, _), (full, _) = _same_call(
            rank,
            alloc,
            launches,
            lambda r: plan.run(recv.ptr, 0, 0, 0, handle) if r else rank.combine(recv, handle),
        )
        assert rep == full
        return full, [OP_ARGS_STRUCT.unpack(e[7]) for e in full], rank._num_collective_launches - step

    one, one_words, one_step = combine_launches(0)
    assert [(e[0], e[1]) for e in one] == [("combine", 8)] and one_words[0][idx("flags")] & split_flags == 0
    two, words, step = combine_launches(132)
    assert [(e[0], e[1]) for e in two] == [("combine", 8), ("combine", 132)]
    assert step == one_step == 1  # only the send launch is collective
    send, reduce = words
    assert send[idx("flags")] == one_words[0][idx("flags")] | FLAGS["combine_send_only"]
    assert reduce[idx("flags")] == one_words[0][idx("flags")] | FLAGS["combine_reduce_only"]
    assert send[idx("envelope")] == one_words[0][idx("envelope")] != 0 and reduce[idx("envelope")] == 0
    for (
        name
    ) in OP_ARGS_FIELDS:  # one call's words: the same pointers, outputs included (the reduce writes them)
        if name not in ("flags", "envelope"):
            assert send[idx(name)] == reduce[idx(name)], name
    assert two[1][2:4] == two[0][2:4] and two[1][5] is False  # same block and shared memory; not cooperative


def test_a_lone_rank_splits_its_combine_only_past_one_round_of_tokens() -> None:
    """A rank without peers reduces its own rows in place: its combine is split only when the op's warps cannot take
    every token in one round; a rank with peers always (where the wider grid is wider); never for hybrid or
    cross-node combines, nor without a wider grid."""
    from types import SimpleNamespace as NS

    from ep_core.kernels.plan import KernelConfig, LaunchGeometry

    cfg = KernelConfig(1, 8, 7168)
    geo = LaunchGeometry(16, cfg.num_threads, 0)
    warps = 16 * cfg.num_warps

    def split(num_ranks: int, tokens: int, epilogue_sms: int = 132, config=cfg) -> bool:
        rank = NS(epilogue_sms=epilogue_sms, num_ranks=num_ranks)
        return RankDriver.combine_split(rank, config, geo, tokens)

    assert not split(1, 128) and not split(1, warps) and split(1, warps + 1) and split(1, 4096)
    assert split(8, 128) and split(2, 1)
    assert not split(8, 4096, epilogue_sms=16) and not split(8, 4096, epilogue_sms=0)
    assert not split(4, 4096, config=KernelConfig(4, 8, 1024, num_scaleup_ranks=2))
    assert not split(4, 4096, config=KernelConfig(4, 8, 1024, num_nvlink_ranks=2))


@pytest.mark.parametrize("mode", ["hybrid", "direct_xnode"])
def test_hybrid_and_cross_node_widen_the_epilogue_but_keep_one_combine_launch(launches, mode: str) -> None:
    """2 emulated nodes x 2 ranks sharing the GPU without overlap (`epilogue_sms` = 132 // 4): the copy epilogue on
    that share instead of the op's 2 SMs, with the dispatch's block and shared memory; the hybrid or cross-node
    combine one launch on the op's grid, without the split flags (`RankDriver.combine_split`)."""
    from ep_core.kernels._args import FLAGS
    from ep_core.kernels.plan import epilogue_share

    share = epilogue_share(False, 132, 4)
    nodes = {"hybrid": {"num_scaleup_ranks": 2}, "direct_xnode": {"num_nvlink_ranks": 2}}[mode]
    rank = make_rank(Allocator(), num_ranks=4, on_device=4, epilogue_sms=share, **nodes)
    x, _, idx, w = inputs()
    n = len(launches)
    handle = rank.dispatch(x, idx, w, num_experts=EXPERTS, num_sms=2, do_cpu_sync=False).handle
    rank.combine(arr((handle.num_recv_tokens, HIDDEN), np.uint16), handle)
    (cfg,) = rank._configs.values()
    assert getattr(cfg, f"is_{mode}"), cfg
    got = launches[n:]
    assert [e[:2] for e in got] == [("dispatch", 2), ("epilogue", share), ("combine", 2)]
    assert got[1][2:4] == got[0][2:4]
    flags = OP_ARGS_STRUCT.unpack(got[2][7])[OP_ARGS_FIELDS.index("flags")]
    assert flags & (FLAGS["combine_send_only"] | FLAGS["combine_reduce_only"]) == 0


# ------------------------------------------------------- a repeat's new handle over one unviewed block (ep_core.handle)
def _offering(alloc: Allocator):
    """The request-side allocator of GpuExecutor's wrapper: ep_core arrays over `alloc`'s pointers, offering both
    the eager block (the full path's) and the unviewed one (a repeat's)."""

    def raw(shape, dtype):
        return CoreArray(alloc(tuple(shape), np.int32).ptr, tuple(shape), dtype, device="cuda")

    class Wrapper:
        def __call__(self, shape, dtype, strides=None):
            return alloc(shape, dtype, strides)

        def int32_block(self, shapes):
            return int32_block(raw, shapes)

        def handle_block(self, shapes):
            return carve(raw, shapes)

    return Wrapper()


_BLOCK_FIELDS = (
    "dst_buffer_slot_idx",
    "psum_num_recv_tokens_per_scaleup_rank",
    "psum_num_recv_tokens_per_expert",
    "num_unaligned_recv_tokens_per_expert",
    "recv_src_metadata",
)


def _arrays(h) -> tuple:
    return tuple((getattr(h, f).ptr, tuple(getattr(h, f).shape)) for f in _BLOCK_FIELDS)


@pytest.mark.parametrize("do_cpu_sync", [False, True])
def test_a_repeats_new_handle_keeps_its_block_and_launches_the_full_paths_bytes(
    launches, do_cpu_sync
) -> None:
    alloc = Allocator()
    rank = make_rank(alloc)
    rank._allocator = _offering(alloc)
    kw = dict(num_experts=EXPERTS, num_sms=8, do_cpu_sync=do_cpu_sync)
    x, _, idx, w = inputs()
    rank.dispatch(x, idx, w, record=True, **kw)
    plan = rank.last_repeat
    x, _, idx, w = inputs()

    def run(repeat):
        if repeat:
            return plan.run(x.ptr, 0, idx.ptr, w.ptr, 0, None, idx)
        return rank.dispatch(x, idx, w, **kw)

    copies: list = []
    real_copy = _cuda.copy_to_host

    def counted(host, ptr, stream):
        copies.append((ptr, host.nbytes))
        real_copy(host, ptr, stream)

    _cuda.copy_to_host = counted
    try:
        (rep, a), (full, b) = _same_call(rank, alloc, launches, run)
    finally:
        _cuda.copy_to_host = real_copy
    assert rep == full and [e[0] for e in rep] == ["dispatch", "epilogue"]
    parts = vars(a.handle)[BLOCK_PARTS]
    if do_cpu_sync:  # the repeat copies its block's prefix sums and counts at once, the full path one by one
        assert len(copies) == 3 and copies[0][0] == parts[0].ptrs[1]
        assert a.handle.num_recv_tokens == b.handle.num_recv_tokens == 24
        assert a.handle.num_recv_tokens_per_expert_list == b.handle.num_recv_tokens_per_expert_list
    assert parts[0].views == [None] * len(parts[0].shapes)  # nothing viewed by the dispatch
    # every EPHandle field is set on the block handle or held in its block (a field added to EPHandle must be
    # added to `DispatchPlan._block_handle`'s too, which bypasses the dataclass constructor)
    import dataclasses

    from ep_core.handle import EPHandle

    assert {f.name for f in dataclasses.fields(EPHandle)} <= set(vars(a.handle)) | set(parts[1])
    assert ("recv_src_metadata" in vars(a.handle)) is do_cpu_sync  # a CPU-sync handle's rows came later
    # the fingerprint's shortcut (no field read or set since the dispatch) reads what its loop reads
    from ep_core import validation

    assert parts[3] is not None
    fast = validation._block_arrays(a.handle, parts)
    slow = validation._block_arrays(a.handle, (*parts[:2], -1, parts[3]))
    assert fast[1] == slow[1] and all(x is y for x, y in zip(fast[0], slow[0]))
    handle = a.handle
    assert rank._handle_launch[handle] == rank._handle_launch[b.handle]
    # its combine and cached dispatch read the block's pointers, as the full path reads the views
    recv = arr((handle.num_recv_tokens, HIDDEN), np.uint16)
    rank.combine(recv, b.handle, record=True)
    comb = rank.last_repeat
    rep_c = _run_logged(rank, alloc, launches, lambda: comb.run(recv.ptr, 0, 0, 0, handle))
    full_c = _run_logged(rank, alloc, launches, lambda: comb.run(recv.ptr, 0, 0, 0, b.handle))
    assert rep_c == full_c and parts[0].views == [None] * len(parts[0].shapes)
    x2, _, _, _ = inputs()
    rank.dispatch(x2, handle=b.handle, num_sms=8, record=True)
    cplan = rank.last_repeat
    assert cplan.cached
    rep_d = _run_logged(rank, alloc, launches, lambda: cplan.run(x2.ptr, 0, 0, 0, 0, handle, None))
    full_d = _run_logged(rank, alloc, launches, lambda: cplan.run(x2.ptr, 0, 0, 0, 0, b.handle, None))
    assert rep_d == full_d and parts[0].views == [None] * len(parts[0].shapes)
    assert _arrays(handle) == _arrays(b.handle)  # read now: the same pointers and shapes as the full path's


def _run_logged(rank, alloc, log: list, fn) -> list:
    """`fn()`'s launch bytes, from one launch number and allocation mark (the same envelopes and outputs)."""
    rank._num_collective_launches, alloc.next = 1000, 1 << 46
    n = len(log)
    fn()
    return [entry[-1] for entry in log[n:]]


def test_a_zero_copy_combine_reads_the_combine_buffer_in_one_launch(launches) -> None:
    """`combine(buffer, handle, zero_copy=True)`: the zero-copy kernel, one launch even where the ordinary combine
    splits its reduce off (nothing is sent), `comb_x` = the buffer (the receive region's start, one bf16 row per
    received row), `dst_slot` = the handle's slots, the zero-copy flag in the flags and the envelope (ranks that
    disagree meet a mismatch, not each other's buffers); repeats hit the prepared launch and equal a fresh pack."""
    from ep_core.kernels._args import FLAGS

    idx = OP_ARGS_FIELDS.index
    stream = SimpleNamespace(handle=0x5000, synchronize=lambda timeout=None: True)
    res = RankResources(0, N, 0x1000_0000, 1 << 30, 0x2000, stream, num_ranks_on_device=1)
    alloc = Allocator()
    rank = RankDriver(res, num_max_tokens_per_rank=M, allocator=alloc, epilogue_sms=132)
    rank.read_error = lambda: (np.zeros(ep_layout.NUM_ERROR_RECORD_BYTES, np.uint8), np.zeros(4, np.int64))
    x, _, ti, w = inputs()
    handle = rank.dispatch(x, ti, w, num_experts=EXPERTS, num_sms=8, do_cpu_sync=False).handle
    buf = rank.combine_buffer(handle, HIDDEN)
    assert buf.shape == (handle.recv_src_metadata.shape[0], HIDDEN) and buf.dtype == "bfloat16"
    assert buf.ptr == res.base + ep_layout.WorkspaceLayout.NUM_ALIGNED_BYTES  # the receive region
    plain = rank.combine(arr(buf.shape, np.uint16), handle)
    n = len(launches)
    out = replay(rank, alloc, launches, lambda: rank.combine(buf, handle, zero_copy=True))
    assert [(e[0], e[1]) for e in out] == [("combine_zero_copy", 8)]
    words = OP_ARGS_STRUCT.unpack(out[0][7])
    assert words[idx("comb_x")] == buf.ptr
    assert words[idx("dst_slot")] == handle.dst_buffer_slot_idx.ptr
    assert words[idx("flags")] & FLAGS["combine_zero_copy"]
    assert not words[idx("flags")] & (FLAGS["combine_send_only"] | FLAGS["combine_reduce_only"])
    plain_words = [OP_ARGS_STRUCT.unpack(e[7]) for e in launches[n - 2 : n]]
    assert [e[0] for e in launches[n - 2 : n]] == ["combine", "combine"]  # the ordinary one splits here
    assert words[idx("envelope")] not in (0, plain_words[0][idx("envelope")])
    assert plain.combined_x is not None and rank.last_repeat is None
    misses = rank.plans.misses
    rank.combine(buf, handle, zero_copy=True)
    assert rank.plans.misses == misses


def test_zero_copy_refusals_name_the_argument(launches) -> None:
    """Before any launch: weights (nothing comes back to gather them from), an array that is not the buffer, an
    expanded handle, a hidden size the receive region cannot hold."""
    alloc = Allocator()
    rank = make_rank(alloc)
    x, _, ti, w = inputs()
    handle = rank.dispatch(x, ti, w, num_experts=EXPERTS, num_sms=8, do_cpu_sync=False).handle
    buf = rank.combine_buffer(handle, HIDDEN)
    n = len(launches)
    with pytest.raises(ValueError, match="topk_weights: a zero-copy combine"):
        rank.combine(buf, handle, topk_weights=arr((buf.shape[0], TOPK), np.float32), zero_copy=True)
    with pytest.raises(ValueError, match="x: a zero-copy combine reads rank 0's combine buffer"):
        rank.combine(arr(buf.shape, np.uint16), handle, zero_copy=True)
    with pytest.raises(ValueError, match=r"got \(\d+, 256\) at a ndarray"):  # host memory: the same message
        rank.check_zero_copy(np.zeros(buf.shape, np.uint16), handle)
    assert len(launches) == n
    expanded = rank.dispatch(
        x, ti, w, num_experts=EXPERTS, num_sms=8, do_cpu_sync=False, do_expand=True
    ).handle
    n = len(launches)
    with pytest.raises(ValueError, match="handle: a zero-copy combine needs the handle of a non-expanded"):
        rank.combine_buffer(expanded, HIDDEN)
    with pytest.raises(ValueError, match="hidden: expected a positive int"):
        rank.combine_buffer(handle, 0)
    small = RankDriver(
        RankResources(0, N, 0x1000_0000, 1 << 12, 0x2000, rank.stream, num_ranks_on_device=1),
        num_max_tokens_per_rank=M,
        allocator=alloc,
    )
    # as if small's dispatch made it: the region's size is the point here
    handle._ep_owner = small.state.owner
    with pytest.raises(ValueError, match=r"zero_copy: \d+ rows of 256 bf16 need"):
        small.combine_buffer(handle, HIDDEN)
    assert len(launches) == n


def test_zero_copy_is_direct_mode_only(launches) -> None:
    alloc = Allocator()
    stream = SimpleNamespace(handle=0x5000, synchronize=lambda timeout=None: True)
    res = RankResources(0, 4, 0x1000_0000, 1 << 30, 0x2000, stream, num_ranks_on_device=1)
    rank = RankDriver(res, num_max_tokens_per_rank=M, allocator=alloc, num_scaleup_ranks=2)
    rank.read_error = lambda: (np.zeros(ep_layout.NUM_ERROR_RECORD_BYTES, np.uint8), np.zeros(4, np.int64))
    x, _, ti, w = inputs()
    handle = rank.dispatch(x, ti, w, num_experts=EXPERTS, num_sms=8, do_cpu_sync=False).handle
    with pytest.raises(ValueError, match="zero_copy: direct mode within one NVLink domain only"):
        rank.combine_buffer(handle, HIDDEN)
    n = len(launches)
    with pytest.raises(ValueError, match="zero_copy: direct mode within one NVLink domain only"):
        rank.dispatch(x, ti, w, num_experts=EXPERTS, num_sms=8, zero_copy=True)
    assert len(launches) == n


@pytest.mark.parametrize("sync", (True, False), ids=("sync", "nosync"))
@pytest.mark.parametrize("fp8", (False, True), ids=("bf16", "fp8"))
def test_a_zero_copy_dispatch_is_one_launch_and_views_of_the_region(launches, fp8: bool, sync: bool) -> None:
    """`dispatch(..., zero_copy=True)`: the zero-copy kernel alone (no copy epilogue), deterministic slots, the
    zero-copy flag in the flags and the envelope; the outputs are views of the receive region where
    `ZeroCopyRows` puts them (recv_x at its start: the combine buffer's rows), the handle's metadata the array the
    kernel fills (its first rows after a CPU sync); repeats hit the prepared launch and equal a fresh pack."""
    from ep_core.kernels._args import FLAGS

    idx = OP_ARGS_FIELDS.index
    alloc = Allocator()
    rank = make_rank(alloc)
    x, sf, ti, w = inputs(fp8=fp8)
    ordinary = dispatch(
        rank, x, sf, ti, w, num_experts=EXPERTS, num_sms=8, deterministic=True, do_cpu_sync=sync
    )
    n = len(launches)
    res: list = []
    call = lambda: res.append(  # noqa: E731
        dispatch(rank, x, sf, ti, w, num_experts=EXPERTS, num_sms=8, do_cpu_sync=sync, zero_copy=True)
    )
    out = replay(rank, alloc, launches, call)
    assert [(e[0], e[1]) for e in out] == [("dispatch_zero_copy", 8)]
    words = OP_ARGS_STRUCT.unpack(out[0][7])
    plain = OP_ARGS_STRUCT.unpack(launches[n - 2][7])  # the ordinary dispatch's kernel, then its epilogue
    assert [e[0] for e in launches[n - 2 : n]] == ["dispatch", "epilogue"]
    assert words[idx("flags")] & FLAGS["dispatch_zero_copy"] and words[idx("flags")] & FLAGS["deterministic"]
    assert words[idx("envelope")] not in (0, plain[idx("envelope")])
    got = res[-1]
    region = words[idx("recv_region")]
    z = rank.zero_copy_rows(rank._config(HIDDEN, 1 if fp8 else 2, HIDDEN // 128 if fp8 else 0, TOPK))
    rows = N * 12 if sync else N * M  # _fake_counts: 12 rows per source
    assert got.recv_x.ptr == region and got.recv_x.shape == (rows, HIDDEN)
    assert got.recv_x.dtype == ("uint8" if fp8 else "uint16")
    assert got.recv_topk_idx.ptr == region + z.topk_idx_offset and got.recv_topk_idx.shape == (rows, TOPK)
    assert got.recv_topk_weights.ptr == region + z.weights_offset and got.recv_topk_weights.dtype == "float32"
    if fp8:
        assert got.recv_sf.ptr == region + z.sf_offset and got.recv_sf.shape == (rows, HIDDEN // 128)
    else:
        assert got.recv_sf is None
    meta = got.handle.recv_src_metadata
    assert meta.shape == (rows, TOPK + 2) and meta.ptr == words[idx("src_metadata")]
    assert got.handle.num_recv_tokens == ordinary.handle.num_recv_tokens
    assert rank.last_repeat is None
    misses = rank.plans.misses
    dispatch(rank, x, sf, ti, w, num_experts=EXPERTS, num_sms=8, do_cpu_sync=sync, zero_copy=True)
    assert rank.plans.misses == misses
    buf = rank.combine_buffer(got.handle, HIDDEN)
    assert buf.ptr == got.recv_x.ptr  # an expert writes its outputs over the rows it has read


def test_zero_copy_dispatch_refusals_name_the_argument(launches) -> None:
    """Before any launch: a cached handle, the expanded layout, column-major scales, a region too small."""
    alloc = Allocator()
    rank = make_rank(alloc)
    x, sf, ti, w = inputs(fp8=True)
    handle = dispatch(rank, x, sf, ti, w, num_experts=EXPERTS, num_sms=8, do_cpu_sync=False).handle
    n = len(launches)
    with pytest.raises(ValueError, match="zero_copy: not with a cached dispatch"):
        rank.dispatch((x, sf), None, w, handle=handle, zero_copy=True)
    with pytest.raises(ValueError, match="zero_copy: the non-expanded layout only"):
        dispatch(rank, x, sf, ti, w, num_experts=EXPERTS, do_expand=True, zero_copy=True)
    with pytest.raises(ValueError, match="zero_copy: row-major scales only"):
        dispatch(rank, x, sf, ti, w, num_experts=EXPERTS, use_tma_aligned_col_major_sf=True, zero_copy=True)
    cfg = rank._config(HIDDEN, 1, HIDDEN // 128, TOPK)
    need = rank.zero_copy_rows(cfg).num_bytes
    small = RankDriver(  # a receive region one byte short
        RankResources(0, N, 0x1000_0000, need - 1, 0x2000, rank.stream, num_ranks_on_device=1),
        num_max_tokens_per_rank=M,
        allocator=alloc,
    )
    with pytest.raises(
        ValueError, match=rf"zero_copy: the outputs of 2 x 64 rows need {need} bytes, rank 0's"
    ):
        dispatch(small, x, sf, ti, w, num_experts=EXPERTS, zero_copy=True)
    assert len(launches) == n
