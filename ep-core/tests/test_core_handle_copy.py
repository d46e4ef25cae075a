"""CPU: a new handle's copy of the routing (`do_handle_copy`) through the GPU executor, driver mocked
(`ep-core/benchmarks/bench_host_cpu.py`'s).

The copy is an array of topk_idx's shape and dtype from the request's allocator (`GpuExecutor._routing_copy`),
and the dispatch kernel fills it in its send phase: the launch carries its pointer in `OpArgs::topk_idx_copy`
(no copy of its own on the stream). Checked here: the words of the full path's launch and of the repeats, CPU sync
or not, int64 and int32 routing; a cached dispatch carries none; `RankDriver.launch_dispatch` refuses a copy of
another shape or dtype, or one given with a handle, naming `topk_idx_copy`."""

from __future__ import annotations

import sys
from pathlib import Path

import ep_core
import pytest
from ep_core.kernels import prepared_launch as pl
from ep_core.kernels._args import OP_ARGS_FIELDS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_host_cpu as b

SLOT_COPY, SLOT_IDX = OP_ARGS_FIELDS.index("topk_idx_copy"), OP_ARGS_FIELDS.index("topk_idx")
T, H, K, E = 8, 64, 2, 8


@pytest.fixture
def mocked(monkeypatch):
    """An EPBuffer over the mocked GPU executor, and the words of every dispatch launch it makes."""
    launched: list = []
    native = pl._native_launch

    def record(self, words):
        if self.name == "ep_dispatch_impl":
            launched.append(words)

    def recorded_native(launch):  # a prepared launch's words reach the (mocked) native launch, on every road
        call = native(launch)

        def recorded(stream, values, *pairs):
            record(launch, launch.patch(values))
            return call(stream, values, *pairs)

        return recorded

    monkeypatch.setattr(pl, "_native_launch", recorded_native)
    monkeypatch.setattr(pl.PreparedLaunch, "launch", lambda self, words, stream: record(self, words))
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


@pytest.mark.parametrize("idx_dtype", ["int64", "int32"])
def test_the_dispatch_launch_carries_the_handles_copy(mocked, idx_dtype: str) -> None:
    buf, alloc, launched = mocked
    x, w = alloc((T, H), "bfloat16"), alloc((T, K), "float32")
    for do_cpu_sync in (False, False, True, True):  # the full path, then a repeat, of each
        idx = alloc((T, K), idx_dtype)
        launched.clear()
        h = buf.dispatch(x, idx, w, num_experts=E, num_sms=4, do_cpu_sync=do_cpu_sync, allocator=alloc).handle
        copy = h.topk_idx
        assert copy is not idx and copy.ptr != idx.ptr
        assert (copy.shape, copy.dtype) == ((T, K), idx_dtype)
        assert [(wd[SLOT_COPY], wd[SLOT_IDX]) for wd in launched] == [(copy.ptr, idx.ptr)]
        launched.clear()
        buf.dispatch(x, handle=h, num_sms=4, allocator=alloc)  # cached: no new handle, no copy
        assert [wd[SLOT_COPY] for wd in launched] in ([], [0])  # a lone rank's cached dispatch: epilogue only
        launched.clear()
        h2 = buf.dispatch(
            x, idx, w, num_experts=E, num_sms=4, do_cpu_sync=False, do_handle_copy=False, allocator=alloc
        ).handle
        assert h2.topk_idx is idx and [wd[SLOT_COPY] for wd in launched] == [0]


@pytest.mark.parametrize(
    "bad, match",
    [
        (((T, K + 1), "int64"), r"topk_idx_copy: expected a contiguous int64 \(8, 2\) array"),
        (((T, K), "int32"), r"topk_idx_copy: expected a contiguous int64"),
    ],
)
def test_launch_dispatch_refuses_a_copy_of_another_shape_or_dtype(mocked, bad, match: str) -> None:
    buf, alloc, _ = mocked
    rank = buf._executor.rank
    x, idx = alloc((T, H), "bfloat16"), alloc((T, K), "int64")
    with pytest.raises(ep_core.EPValueError, match=match):
        rank.dispatch(x, idx, num_experts=E, do_cpu_sync=False, topk_idx_copy=alloc(*bad))


def test_launch_dispatch_refuses_a_copy_with_a_handle(mocked) -> None:
    buf, alloc, _ = mocked
    x, idx = alloc((T, H), "bfloat16"), alloc((T, K), "int64")
    h = buf.dispatch(x, idx, num_experts=E, num_sms=4, do_cpu_sync=False, allocator=alloc).handle
    with pytest.raises(ep_core.EPValueError, match="topk_idx_copy: a cached dispatch makes no new handle"):
        buf._executor.rank.dispatch(x, handle=h, num_sms=4, topk_idx_copy=alloc((T, K), "int64"))
