"""ep_torch's per-call shortcuts keep the semantics: tensors that need no grad reach ep-core as they are (no
detached alias per call), tensors that need grad are detached, and a handle never holds the caller's topk_idx
object with do_handle_copy=True."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ep_torch.buffer import _plain


def test_plain_passes_plain_tensors_and_detaches_grad_ones():
    a = torch.zeros(3, 4)
    assert _plain(a) is a
    g = torch.zeros(3, 4, requires_grad=True)
    d = _plain(g)
    assert d is not g and not d.requires_grad and d.data_ptr() == g.data_ptr()
    t = _plain((a, g))
    assert isinstance(t, tuple) and t[0] is a and not t[1].requires_grad
    assert _plain(None) is None and _plain([a]) == [a] and _plain(5) == 5


@pytest.fixture
def one_rank_group():
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    from ep_torch.launch import free_port, init_rank

    init_rank(0, 1, free_port(), "gloo")
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tokens", [0, 1, 6])
def test_handle_topk_idx_is_never_the_callers_object(one_rank_group, tokens):
    from ep_torch import ElasticBuffer

    hidden, experts, k = 64, 8, 2
    buf = ElasticBuffer(
        one_rank_group, num_max_tokens_per_rank=8, hidden=hidden, num_topk=k, transport="reference"
    )
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    idx = torch.rand(tokens, experts, generator=g).topk(k, dim=1).indices
    w = torch.rand(tokens, k, generator=g)
    recv_x, recv_idx, recv_w, handle, _ = buf.dispatch(x, idx, w, num_experts=experts)
    assert handle.topk_idx is not idx and torch.equal(handle.topk_idx, idx)
    assert recv_x.shape[0] == recv_idx.shape[0] == recv_w.shape[0] == tokens  # one rank: one row per token
    _, _, _, handle2, _ = buf.dispatch(x, idx, w, num_experts=experts, do_handle_copy=False)
    assert handle2.topk_idx is idx  # DeepEP: without a copy the handle keeps the caller's tensor
    combined, _, _ = buf.combine(recv_x, handle)
    assert combined.shape == (tokens, hidden)
    # a cached dispatch with the same tensors, twice (the validated handle is reused)
    for _ in range(2):
        again, _, _, h3, _ = buf.dispatch(x, handle=handle)
        assert h3 is handle and torch.equal(again, recv_x)


def test_allocator_block_views_are_disjoint_aligned_tensors():
    """ep_torch's allocator offers `int32_block`: one torch.empty carved into C-contiguous int32 tensors of the
    requested shapes, each on a 256-byte boundary, disjoint (writing one leaves the others)."""
    from ep_core.kernels.array_block import ALIGN_WORDS
    from ep_torch import ElasticBuffer

    buf = ElasticBuffer.__new__(ElasticBuffer)
    buf._allocators = {}
    allocate = buf._allocator(torch.device("cpu"))
    assert buf._allocator(torch.device("cpu")) is allocate  # one per device
    shapes = ((6, 4), (1,), (8,), (8,), (0, 6), (24, 6))
    for key in (shapes, [list(s) for s in shapes]):  # a repeat's tuple key, or the full path's list
        views = allocate.int32_block(key)
        assert [tuple(v.shape) for v in views] == [tuple(s) for s in shapes]
        assert all(v.dtype == torch.int32 and v.is_contiguous() for v in views)
        base = views[0].data_ptr()
        assert len({v.untyped_storage().data_ptr() for v in views}) == 1  # one allocation
        for v in views:
            assert v.numel() == 0 or (v.data_ptr() - base) % (4 * ALIGN_WORDS) == 0
        for v in views:
            v.fill_(-1)
        views[2].fill_(7)
        assert all((v == -1).all() for i, v in enumerate(views) if i != 2) and (views[2] == 7).all()


@pytest.mark.parametrize(
    "shapes",
    [((), (3,), (2, 5)), ((0,), (0, 6)), ((0, 4), (64,), (1,), (65, 1))],
)
def test_allocator_block_edge_shapes(shapes):
    """The block's split (`array_block.int32_block`): 0-D, empty and all-empty shapes, sizes at and past a multiple
    of the 64-word alignment; every view has its shape, is contiguous, starts aligned and is disjoint."""
    from ep_core.kernels.array_block import ALIGN_WORDS
    from ep_torch import ElasticBuffer

    buf = ElasticBuffer.__new__(ElasticBuffer)
    buf._allocators = {}
    views = buf._allocator(torch.device("cpu")).int32_block(shapes)
    assert [tuple(v.shape) for v in views] == [tuple(s) for s in shapes]
    assert all(v.dtype == torch.int32 and v.is_contiguous() for v in views)
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1
    base = views[0].untyped_storage().data_ptr()  # an empty view may report a null data_ptr()
    for i, v in enumerate(views):
        assert v.numel() == 0 or (v.data_ptr() - base) % (4 * ALIGN_WORDS) == 0
        v.fill_(i)
    assert all((v == i).all() for i, v in enumerate(views))


@pytest.mark.parametrize("mode", ["offered", "0"])
def test_mocked_gpu_dispatch_takes_handle_arrays_from_one_block(one_rank_group, monkeypatch, mode):
    """Through the GPU executor (driver mocked, bench_host_cpu's), a new handle's int32 arrays are views of one
    torch allocation by default, one allocation each with EPKIT_HANDLE_BLOCK=0; first call (full path) and repeats."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "ep-core" / "benchmarks"))
    import bench_host_cpu as b
    from ep_core.kernels import array_block
    from ep_torch import buffer as tbuf

    monkeypatch.setattr(array_block, "MODE", mode)
    monkeypatch.setattr(tbuf, "make_core_transport", lambda choice: b._CpuMockedTransport())
    with b._MockedGpu():
        buf = tbuf.ElasticBuffer(None, num_max_tokens_per_rank=8, hidden=64, num_topk=2)
        x = torch.ones(8, 64, dtype=torch.bfloat16)
        idx = torch.arange(16, dtype=torch.int64).reshape(8, 2) % 8
        for do_cpu_sync in (False, False, False):  # the full path, then repeats
            h = buf.dispatch(x, topk_idx=idx, num_experts=8, num_sms=4, do_cpu_sync=do_cpu_sync)[3]
            arrays = [
                h.psum_num_recv_tokens_per_scaleup_rank,
                h.psum_num_recv_tokens_per_expert,
                h.num_unaligned_recv_tokens_per_expert,
                h.recv_src_metadata,
                h.dst_buffer_slot_idx,
            ]
            storages = {a.untyped_storage().data_ptr() for a in arrays}
            assert len(storages) == (1 if mode == "offered" else 5)
            assert all(a.dtype == torch.int32 and a.is_contiguous() for a in arrays)


class _Stop(Exception):
    pass


def _recording_buffer():
    """An ElasticBuffer whose ep_core runtime only records the argument record it is given (then stops)."""
    import contextlib
    import types

    from ep_torch import ElasticBuffer

    calls: list = []

    def record(args, lane=None):  # (`lane`: the plan to keep, none here)
        calls.append(args)
        raise _Stop

    core = types.SimpleNamespace(
        announcing=lambda op: contextlib.nullcontext(),
        destroyed=False,
        _destroyed=False,
        run_dispatch=record,
        run_combine=record,
    )
    buf = ElasticBuffer.__new__(ElasticBuffer)
    buf.__dict__.update(
        _core=core, runtime=core, _cuda=False, _device_index=None, device=torch.device("cpu"), _allocators={}
    )
    return buf, calls


@pytest.mark.parametrize("zero_copy", [False, True], ids=["ordinary", "zero-copy"])
@pytest.mark.parametrize("op", ["dispatch", "combine"])
def test_each_argument_reaches_ep_cores_record_in_its_own_field(op, zero_copy):
    """`ElasticBuffer.dispatch` / `combine` build ep_core's argument record (`DispatchArgs` / `CombineArgs`, whose
    fields are `ep_core.EPBuffer.dispatch` / `combine`'s parameters in their order) once and pass it to
    `run_dispatch` / `run_combine` (issue 45): changing any one argument must change exactly the field of its name
    (a swap of num_sms / num_qps or of two flags fails here). `zero_copy=True` is the record's last field."""
    import inspect

    import ep_core
    from ep_core.requests import CombineArgs, DispatchArgs
    from ep_torch import ElasticBuffer
    from ep_torch.event import EventHandle

    # `zero_copy` (the last, keyword-only parameter of dispatch and combine on both): the record's last field
    core_names = [n for n in inspect.signature(getattr(ep_core.EPBuffer, op)).parameters if n != "zero_copy"][
        1:
    ]
    # `defer_epilogue` / `borrow_recv` / `out_dtype` (issue 42) are ep_torch's own: `borrow_recv` never reaches
    # ep-core's record; a combine's `out_dtype` / `defer_epilogue` are its last two fields (ep_torch runs their
    # roads: unset on the ordinary road)
    own = ("zero_copy", "defer_epilogue", "borrow_recv", "out_dtype")
    framework = ("out_dtype", "defer_epilogue") if op == "combine" else ()
    names = [n for n in inspect.signature(getattr(ElasticBuffer, op)).parameters if n not in own][1:]
    assert names == core_names[:-2]  # DeepEP's order is ep_core's, plus ep_core's allocator and stream
    buf, calls = _recording_buffer()
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    base = (
        {"x": x, "topk_idx": torch.zeros(4, 2, dtype=torch.int64)}
        if op == "dispatch"
        else {"x": x, "handle": object()}
    )
    changed = {
        "topk_idx": torch.ones(4, 2, dtype=torch.int64),
        "handle": object(),
        "topk_weights": torch.ones(4, 2),
        "cumulative_local_expert_recv_stats": torch.zeros(4, dtype=torch.int32),
        "bias": torch.zeros(4, 64, dtype=torch.bfloat16),
        "num_experts": 8,
        "num_max_tokens_per_rank": 9,
        "expert_alignment": 3,
        "num_sms": 5,
        "num_qps": 6,
        "previous_event": EventHandle(device="cpu"),
        "previous_event_before_epilogue": object(),
        "do_cpu_sync": False,
    }

    if zero_copy:
        base["zero_copy"] = True

    record = DispatchArgs if op == "dispatch" else CombineArgs
    assert list(record._fields) == [*core_names, "zero_copy", *framework]

    def positional(**kwargs) -> tuple:
        with pytest.raises(_Stop):
            getattr(buf, op)(**{**base, **kwargs})
        got = calls.pop()
        assert type(got) is record and got.zero_copy is zero_copy  # the field after the signature's
        assert got[len(core_names) + 1 :] == (None, False)[: len(framework)]
        return got[: len(core_names)]

    ref = positional()
    assert len(ref) == len(core_names)
    assert callable(ref[core_names.index("allocator")]) and ref[core_names.index("stream")] == 0
    for name in names[1:]:
        default = inspect.signature(getattr(ElasticBuffer, op)).parameters[name].default
        value = changed.get(name, not default if isinstance(default, bool) else None)
        assert value is not None, name
        got = positional(**{name: value})
        moved = [core_names[i] for i, (a, b) in enumerate(zip(ref, got)) if a is not b]
        assert moved == [name], (name, moved)


@pytest.mark.parametrize("op", ["dispatch", "combine"])
def test_zero_copy_takes_ep_cores_own_road(op):
    """`zero_copy=True` is keyword-only and last on both surfaces (DeepEP's positional order unchanged) and reaches
    ep_core's one road with the record's `zero_copy` field set (`run_dispatch` / `run_combine`: its request cache
    keys and repeats), never an express lane."""
    import inspect

    import ep_core
    from ep_torch import ElasticBuffer

    for cls in (ElasticBuffer, ep_core.EPBuffer):
        last = list(inspect.signature(getattr(cls, op)).parameters.values())[-1]
        assert (
            last.name == "zero_copy" and last.kind is inspect.Parameter.KEYWORD_ONLY and last.default is False
        )
    buf, calls = _recording_buffer()
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    with pytest.raises(_Stop):
        if op == "dispatch":
            buf.dispatch(x, torch.zeros(4, 2, dtype=torch.int64), num_experts=8, zero_copy=True)
        else:
            buf.combine(x, object(), zero_copy=True)
    assert len(calls) == 1 and calls[0].zero_copy is True
    with pytest.raises(TypeError):  # keyword-only: one positional argument more is refused
        getattr(buf, op)(*([None] * (len(inspect.signature(getattr(ElasticBuffer, op)).parameters) - 1)))


@pytest.mark.parametrize("tokens", [0, 8])
def test_mocked_gpu_dispatch_copies_the_routing_into_the_handle(one_rank_group, monkeypatch, tokens):
    """Through the GPU executor (driver mocked, bench_host_cpu's), the handle's topk_idx is ep-core's copy of the
    caller's (an allocator tensor of its own, whose pointer the dispatch launch carries in `OpArgs::topk_idx_copy`:
    the kernel fills it, emulated here) for the full path and the repeats, CPU sync or not; do_handle_copy=False
    keeps the caller's tensor; an empty routing is an alias, never the caller's object."""
    import ctypes
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "ep-core" / "benchmarks"))
    import bench_host_cpu as b
    from ep_core.kernels import prepared_launch as pl
    from ep_core.kernels._args import OP_ARGS_FIELDS
    from ep_torch import buffer as tbuf

    copies: list = []
    slot_copy, slot_idx = OP_ARGS_FIELDS.index("topk_idx_copy"), OP_ARGS_FIELDS.index("topk_idx")
    native = pl._native_launch

    def kernel(name, words):  # the dispatch kernel's send phase, on the mocked (CPU) tensors
        if name == "ep_dispatch_impl" and words[slot_copy]:
            copies.append((words[slot_copy], words[slot_idx]))
            ctypes.memmove(words[slot_copy], words[slot_idx], tokens * 2 * 8)

    def emulated_native(launch):  # a prepared launch's words reach the (mocked) native launch, on every road
        call = native(launch)

        def emulated(stream, values, *pairs):
            kernel(launch.name, launch.patch(values))
            return call(stream, values, *pairs)

        return emulated

    monkeypatch.setattr(pl, "_native_launch", emulated_native)
    monkeypatch.setattr(pl.PreparedLaunch, "launch", lambda self, words, stream: kernel(self.name, words))
    monkeypatch.setattr(tbuf, "make_core_transport", lambda choice: b._CpuMockedTransport())
    with b._MockedGpu():
        buf = tbuf.ElasticBuffer(None, num_max_tokens_per_rank=8, hidden=64, num_topk=2)
        x = torch.ones(tokens, 64, dtype=torch.bfloat16)
        for do_cpu_sync in (False, False, True, True):  # the full path, then a repeat, of each
            idx = torch.arange(2 * tokens, dtype=torch.int64).reshape(tokens, 2) % 8
            copies.clear()
            h = buf.dispatch(x, topk_idx=idx, num_experts=8, num_sms=4, do_cpu_sync=do_cpu_sync)[3]
            assert h.topk_idx is not idx and torch.equal(h.topk_idx, idx)
            if tokens:
                assert h.topk_idx.untyped_storage().data_ptr() != idx.untyped_storage().data_ptr()
                assert copies == [(h.topk_idx.data_ptr(), idx.data_ptr())]
                idx.fill_(-1)  # the caller's tensor changes after the call: the handle's does not
                assert not torch.equal(h.topk_idx, idx)
            else:
                assert copies == []
            h2 = buf.dispatch(
                x, topk_idx=idx, num_experts=8, num_sms=4, do_cpu_sync=False, do_handle_copy=False
            )[3]
            assert h2.topk_idx is idx


def test_mocked_gpu_repeat_handle_keeps_its_block_until_a_field_is_read(one_rank_group, monkeypatch):
    """Through the GPU executor (driver mocked, bench_host_cpu's), a repeated dispatch's new handle keeps its int32
    arrays in one block with no view made (`ep_core.handle`), through its combine and cached dispatch; a field read
    is a view of that block, and reading keeps the handle's validated record; a field replaced by a wrong array is
    checked again at the next combine, which names it."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "ep-core" / "benchmarks"))
    import bench_host_cpu as b
    from ep_core import validation
    from ep_core.errors import EPValueError
    from ep_core.handle import BLOCK_PARTS
    from ep_torch import buffer as tbuf

    monkeypatch.setattr(tbuf, "make_core_transport", lambda choice: b._CpuMockedTransport())
    checks: list = []
    real = validation._check_handle_arrays
    monkeypatch.setattr(validation, "_check_handle_arrays", lambda *a: checks.append(a[2]) or real(*a))
    with b._MockedGpu():
        buf = tbuf.ElasticBuffer(None, num_max_tokens_per_rank=8, hidden=64, num_topk=2)
        x = torch.ones(8, 64, dtype=torch.bfloat16)
        idx = torch.arange(16, dtype=torch.int64).reshape(8, 2) % 8
        kw = dict(num_experts=8, num_sms=4, do_cpu_sync=False)
        first = buf.dispatch(x, topk_idx=idx, **kw)[3]
        assert BLOCK_PARTS not in vars(first)  # the full path views its block at once
        recv = torch.ones(first.num_recv_tokens, 64, dtype=torch.bfloat16)
        buf.combine(recv, first, num_sms=4)  # the full paths of the combine and the cached dispatch
        buf.dispatch(x, handle=first, num_sms=4)
        h = buf.dispatch(x, topk_idx=idx, **kw)[3]
        block = vars(h)[BLOCK_PARTS][0]
        buf.combine(recv, h, num_sms=4)
        buf.dispatch(x, handle=h, num_sms=4)
        assert block.views == [None] * len(block.shapes) and h not in checks
        meta = h.recv_src_metadata
        assert meta.dtype == torch.int32 and meta.data_ptr() in block.ptrs
        assert meta.untyped_storage().data_ptr() == block.array.untyped_storage().data_ptr()
        buf.combine(recv, h, num_sms=4)
        assert h not in checks  # reading a field kept the record
        h.psum_num_recv_tokens_per_expert = torch.zeros(3, dtype=torch.int32)
        with pytest.raises(EPValueError, match="psum_num_recv_tokens_per_expert"):
            buf.combine(recv, h, num_sms=4)
        assert h in checks


def test_an_async_dispatch_keeps_its_handles_tensors_with_the_outputs():
    """`async_with_compute_stream=True` records the new handle's tensors on the streams like the outputs: the routing
    copy the kernel writes and the int32 arrays, a repeated dispatch's still in their block."""
    from ep_core.handle import BLOCK_PARTS, EPHandle
    from ep_core.kernels.array_block import carve
    from ep_torch.buffer import _handle_tensors

    idx = torch.zeros(4, 2, dtype=torch.int64)
    plain = EPHandle(False, 8, 1, 4, 4, idx, 0, 0, [], *[torch.zeros(2, dtype=torch.int32)] * 5)
    got = _handle_tensors(plain)
    assert got[0] is idx and len(got) == 6
    block = carve(lambda shape, dtype: torch.zeros(shape, dtype=getattr(torch, dtype)), ((2,), (3,)))
    lazy = EPHandle.__new__(EPHandle)
    vars(lazy).update(topk_idx=idx, token_metadata_at_forward=None)
    vars(lazy)[BLOCK_PARTS] = (block, {"recv_src_metadata": 0}, 3, None)
    assert _handle_tensors(lazy) == (idx, block.array)
