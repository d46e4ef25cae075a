"""CPU: DeepEP 2.5's deferred dispatch and combine through the GPU executor, driver mocked
(`ep-core/benchmarks/bench_host_cpu.py`'s).

Dispatch: `EPBuffer.launch_dispatch_deferred` (over `GpuExecutor.launch_dispatch_deferred`) launches the dispatch
kernel alone; the `finish(stream)` it returns launches the copy epilogue and returns the `DispatchResult` (a new
handle keeping the caller's routing; a cached dispatch's handle the one given), for CPU sync or not; a CPU sync waits
for its counts in `finish`, not in the call.

Combine: `EPBuffer.launch_combine_deferred` (over `GpuExecutor.launch_combine_deferred`) launches the send-only
kernel of a split combine (also where the ordinary combine is one launch); `finish(stream)` orders the comm stream
after `stream`, allocates the outputs, launches the reduce-only kernel and orders `stream` after it. The two
launches are the ordinary split combine's: the same packed words and per-call words but the outputs (allocated at
the finish; none in the send part) and the envelope's sequence number.

An executor without the split (the reference backend) and a zero-copy request are refused naming
`defer_epilogue`."""

from __future__ import annotations

import sys
from pathlib import Path

import ep_core
import pytest
from ep_core.kernels import prepared_launch as pl
from ep_core.kernels._args import FLAGS, OP_ARGS_FIELDS
from ep_core.kernels.rank_driver import RankDriver
from ep_core.requests import CombineArgs, DispatchArgs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_host_cpu as b

T, H, K, E = 8, 64, 2, 8


class _Log(list):
    """The kernel names of the launches; `raw`: each launch as `(PreparedLaunch, its words)`, and each stream-order
    pair as `("record_wait", on, waiter)`."""

    raw: list


@pytest.fixture
def mocked(monkeypatch):
    """An EPBuffer over the mocked GPU executor, and the kernel names of every launch it makes (`_Log`)."""
    launched = _Log()
    launched.raw = []
    native = pl._native_launch

    def recorded_native(launch):
        call = native(launch)

        def recorded(stream, values, *pairs):
            launched.append(launch.name)
            launched.raw.append((launch, launch.patch(values)))
            return call(stream, values, *pairs)

        return recorded

    def fresh(self, words, stream):  # a launch shape's first call: its words as packed
        launched.append(self.name)
        launched.raw.append((self, list(words)))

    def record_wait(event, on, waiter):
        launched.raw.append(("record_wait", on, waiter))
        return 0

    monkeypatch.setattr(pl, "_native_launch", recorded_native)
    monkeypatch.setattr(pl.PreparedLaunch, "launch", fresh)
    monkeypatch.setattr(b._FakeNative, "record_wait", staticmethod(record_wait))
    counter = [1 << 40]

    def alloc(shape, dtype):
        counter[0] += 1 << 24
        return ep_core.DeviceArray(counter[0], shape, dtype, device="cuda")

    with b._MockedGpu():
        buf = ep_core.EPBuffer(
            ep_core.LocalBootstrap(),
            transport=b._MockedTransport(),
            num_max_tokens_per_rank=T,
            hidden=H,
            num_topk=K,
        )
        yield buf, alloc, launched


def _args(x, idx, w, alloc, **kw) -> DispatchArgs:
    fields = dict.fromkeys(DispatchArgs._fields)
    fields.update(
        x=x, topk_idx=idx, topk_weights=w, num_experts=E, num_sms=4, num_qps=0, async_with_compute_stream=True,
        allocate_on_comm_stream=False, do_handle_copy=False, do_expand=False, do_zero_padding=False,
        use_tma_aligned_col_major_sf=False, allocator=alloc, stream=0, zero_copy=False,
    )  # fmt: skip
    fields.update(kw)
    return DispatchArgs(**fields)


@pytest.mark.parametrize("do_cpu_sync", [False, True])
def test_the_call_launches_the_dispatch_and_the_wait_the_epilogue(mocked, do_cpu_sync: bool) -> None:
    buf, alloc, launched = mocked
    x, w, idx = alloc((T, H), "bfloat16"), alloc((T, K), "float32"), alloc((T, K), "int64")
    rank = buf._executor.rank
    sync = rank._sync_counts

    def counted(*a):  # the CPU sync's wait for the counts: at the finish, not in the call
        launched.append("sync")
        return sync(*a)

    rank._sync_counts = counted
    finish = buf.launch_dispatch_deferred(_args(x, idx, w, alloc, do_cpu_sync=do_cpu_sync))
    assert launched == ["ep_dispatch_impl"]
    res = finish(0)
    wait = ["sync"] if do_cpu_sync else []
    assert launched == ["ep_dispatch_impl", *wait, "ep_dispatch_copy_epilogue_impl"]
    assert res.handle.topk_idx is idx and res.recv_x.shape[1] == H
    # a cached dispatch of that handle, deferred: the handle given back (a lone rank: the epilogue does it all)
    launched.clear()
    finish = buf.launch_dispatch_deferred(_args(x, None, w, alloc, handle=res.handle, num_experts=None))
    again = finish(0)
    assert again.handle is res.handle and launched[-1] == "ep_dispatch_copy_epilogue_impl"


def test_refusals(mocked) -> None:
    buf, alloc, launched = mocked
    x, idx = alloc((T, H), "bfloat16"), alloc((T, K), "int64")
    with pytest.raises(ep_core.EPConfigError, match="defer_epilogue"):
        buf.launch_dispatch_deferred(_args(x, idx, None, alloc, zero_copy=True))
    ref = ep_core.EPBuffer(
        ep_core.LocalBootstrap(), transport="reference", num_max_tokens_per_rank=T, hidden=H, num_topk=K
    )
    with pytest.raises(ep_core.EPConfigError, match="defer_epilogue"):
        ref.launch_dispatch_deferred(_args(x, idx, None, None))
    assert launched == []


# ---------------------------------------------------------------------------------------------------- combine
_FLAGS, _ENV = OP_ARGS_FIELDS.index("flags"), OP_ARGS_FIELDS.index("envelope")
_OUT = (OP_ARGS_FIELDS.index("combined_x"), OP_ARGS_FIELDS.index("combined_weights"))
_SPLIT = FLAGS["combine_send_only"] | FLAGS["combine_reduce_only"]


def _handle(buf, alloc):
    """A no-sync dispatch's handle (its worst-case rows: T) and expert outputs for its combine."""
    x, w, idx = alloc((T, H), "bfloat16"), alloc((T, K), "float32"), alloc((T, K), "int64")
    handle = buf.dispatch(x, idx, w, num_experts=E, num_sms=4, do_cpu_sync=False, allocator=alloc).handle
    rows = handle.recv_src_metadata.shape[0]
    return handle, alloc((rows, H), "bfloat16"), alloc((rows, K), "float32")


def _combine_args(y, handle, w, alloc, **kw) -> CombineArgs:
    return CombineArgs(y, handle, w, async_with_compute_stream=True, allocator=alloc, **kw)


@pytest.mark.parametrize("weights", [False, True])
def test_the_combine_call_launches_the_send_part_and_the_wait_the_reduce(mocked, weights: bool) -> None:
    buf, alloc, launched = mocked
    handle, y, w = _handle(buf, alloc)
    w = w if weights else None
    ordinary = buf.combine(y, handle, w, allocator=alloc)  # one launch here (no wider reduce grid, one rank)
    del launched.raw[:]
    finish = buf.launch_combine_deferred(_combine_args(y, handle, w, alloc, defer_epilogue=True))
    send_only, reduce_only = FLAGS["combine_send_only"], FLAGS["combine_reduce_only"]
    assert len(launched.raw) == 1, "the call: the send part alone"
    sent = launched.raw[0][1]
    assert sent[_FLAGS] & _SPLIT == send_only
    assert sent[_OUT[0]] == sent[_OUT[1]] == 0, "the send part writes no output"
    res = finish(7)  # waited on another stream: the reduce after its work, that stream after the reduce
    wait, (launch, words), signal = launched.raw[1:]
    assert wait == ("record_wait", 7, 0) and signal == ("record_wait", 0, 7)
    assert launch.name == "ep_combine_impl" and words[_FLAGS] & _SPLIT == reduce_only
    assert words[_ENV] == 0, "the reduce is no collective launch"
    assert words[_OUT[0]] == res.combined_x.ptr and res.combined_x.shape == ordinary.combined_x.shape
    if weights:
        assert words[_OUT[1]] == res.combined_topk_weights.ptr
        assert res.combined_topk_weights.shape == ordinary.combined_topk_weights.shape
    else:
        assert words[_OUT[1]] == 0 and res.combined_topk_weights is None
    assert res.event is not None


def test_the_deferred_combine_launches_the_ordinary_split_combines_words(mocked, monkeypatch) -> None:
    """Against the ordinary combine split in two (`combine_split` forced): the same two launch shapes' packed words
    and the same per-call words, but for the outputs and the send part's envelope (its sequence number)."""
    buf, alloc, launched = mocked
    handle, y, w = _handle(buf, alloc)
    monkeypatch.setattr(RankDriver, "combine_split", lambda self, cfg, geo, t: True)
    for _ in range(2):  # a fresh pack, then the kept launch shape's patched words
        del launched.raw[:]
        buf.combine(y, handle, w, allocator=alloc)
        ordinary = [e for e in launched.raw if e[0] != "record_wait"]
        del launched.raw[:]
        buf.launch_combine_deferred(_combine_args(y, handle, w, alloc, defer_epilogue=True))(0)
        deferred = [e for e in launched.raw if e[0] != "record_wait"]
        assert [e[0].name for e in ordinary] == [e[0].name for e in deferred] == ["ep_combine_impl"] * 2
        for i, ((a, wa), (d, wd)) in enumerate(zip(ordinary, deferred)):
            assert a.grid == d.grid and a.block == d.block and a.shared_mem == d.shared_mem
            assert a.cooperative == d.cooperative
            skip = {*_OUT, _ENV} if i == 0 else set(_OUT)
            assert [v for j, v in enumerate(wa) if j not in skip] == [
                v for j, v in enumerate(wd) if j not in skip
            ]
        assert deferred[0][1][_ENV] != 0 and deferred[1][1][_ENV] == 0


def test_combine_refusals(mocked) -> None:
    buf, alloc, launched = mocked
    handle, y, _ = _handle(buf, alloc)
    del launched[:]
    with pytest.raises(ep_core.EPConfigError, match="defer_epilogue"):
        buf.launch_combine_deferred(_combine_args(y, handle, None, alloc, zero_copy=True))
    with pytest.raises(ep_core.EPValueError, match="out_dtype"):
        buf.launch_combine_deferred(_combine_args(y, handle, None, alloc, out_dtype="float32"))
    assert launched == []


def test_a_combine_without_a_separate_reduce_runs_whole_at_the_call(mocked, monkeypatch) -> None:
    """A cross-node (or hybrid) combine has no reduce-only launch: the deferred call runs the whole combine (no split
    flag), the finish launches nothing and hands the call's outputs over."""
    from ep_core.kernels.plan import KernelConfig

    buf, alloc, launched = mocked
    handle, y, w = _handle(buf, alloc)
    monkeypatch.setattr(KernelConfig, "is_direct_xnode", property(lambda self: True))
    del launched.raw[:]
    finish = buf.launch_combine_deferred(_combine_args(y, handle, w, alloc, defer_epilogue=True))
    ((launch, words),) = launched.raw
    assert words[_FLAGS] & _SPLIT == 0 and words[_OUT[0]] != 0 and words[_OUT[1]] != 0
    res = finish(0)
    assert [e[0] for e in launched.raw] == [launch, "record_wait"]
    assert res.combined_x.ptr == words[_OUT[0]] and res.combined_topk_weights.ptr == words[_OUT[1]]
