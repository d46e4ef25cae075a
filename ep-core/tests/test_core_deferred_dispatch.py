"""CPU: DeepEP 2.5's deferred dispatch through the GPU executor, driver mocked (`ep-core/benchmarks/bench_host_cpu.py`'s).

`EPBuffer.launch_dispatch_deferred` (over `GpuExecutor.launch_dispatch_deferred`) launches the dispatch kernel alone;
the `finish(stream)` it returns launches the copy epilogue and returns the `DispatchResult` (a new handle keeping
the caller's routing; a cached dispatch's handle the one given), for CPU sync or not; a CPU sync waits for its
counts in `finish`, not in the call. An executor without the split
(the reference backend) and a zero-copy request are refused naming `defer_epilogue`."""

from __future__ import annotations

import sys
from pathlib import Path

import ep_core
import pytest
from ep_core.kernels import prepared_launch as pl
from ep_core.requests import DispatchArgs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_host_cpu as b

T, H, K, E = 8, 64, 2, 8


@pytest.fixture
def mocked(monkeypatch):
    """An EPBuffer over the mocked GPU executor, and the kernel names of every launch it makes."""
    launched: list = []
    native = pl._native_launch

    def recorded_native(launch):
        call = native(launch)

        def recorded(stream, values, *pairs):
            launched.append(launch.name)
            return call(stream, values, *pairs)

        return recorded

    monkeypatch.setattr(pl, "_native_launch", recorded_native)
    monkeypatch.setattr(pl.PreparedLaunch, "launch", lambda self, words, stream: launched.append(self.name))
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
