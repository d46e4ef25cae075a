"""EPBuffer's zero-copy dispatch on the reference backend (N ranks in threads): `dispatch(..., zero_copy=True)`
returns the deterministic dispatch's rows as views of the executor's own memory, bf16 `recv_x` is the memory of
`combine_buffer(handle)` (the expert writes its outputs over its inputs, then a zero-copy combine), and the handle is
an ordinary one; the refusals name the argument, and a refusal on one rank reaches its peers instead of leaving them
waiting."""

from __future__ import annotations

import ep_core as ec
import numpy as np
import pytest
from ep_core import reference, routing
from ep_core.errors import EPConfigError, EPMismatchError, EPPeerError
from ep_core.handle import ARRAY_FIELDS
from ep_core.reference_executor import ReferenceTransport

N, M, H, E, K = 3, 8, 64, 12, 4
TOKENS = [8, 5, 0]
OUTPUTS = ("recv_x", "recv_sf", "recv_topk_idx", "recv_topk_weights")


def _buffer(boot, transport="reference"):
    return ec.EPBuffer(
        boot, transport=transport, num_max_tokens_per_rank=M, hidden=H, num_topk=K, explicitly_destroy=True
    )


def _x(inp, r):
    x = ec.host_array(inp.xs[r], "float8_e4m3fn" if inp.sfs is not None else "bfloat16")
    return x if inp.sfs is None else (x, ec.host_array(inp.sfs[r]))


def _dispatch(buf, inp, r, **kw):
    return buf.dispatch(
        _x(inp, r), ec.host_array(inp.topk_idxs[r]), ec.host_array(inp.topk_weights[r]), num_experts=E, **kw
    )


def _bits(a):
    """An array's bits (floats as unsigned ints of their size: bitwise comparison), None as None."""
    if a is None:
        return None
    b = np.array(ec.to_numpy(a))
    return b.view(f"u{b.dtype.itemsize}") if b.dtype.kind == "f" else b


def _same(a, b) -> bool:
    a, b = _bits(a), _bits(b)
    return (a is None and b is None) or (a is not None and b is not None and np.array_equal(a, b))


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("cpu_sync", [True, False])
def test_zero_copy_dispatch_equals_the_deterministic_dispatch(cpu_sync: bool, fp8: bool) -> None:
    inp = routing.make_inputs(
        N, TOKENS, H, E, K, seed=5, masked_ratio=0.25, fp8=fp8, num_sf_packs=2 if fp8 else 0
    )

    def rank_fn(r, boot):
        buf = _buffer(boot)
        try:
            want = _dispatch(buf, inp, r, do_cpu_sync=cpu_sync)
            got = _dispatch(buf, inp, r, do_cpu_sync=cpu_sync, zero_copy=True)
            for name in OUTPUTS:
                assert _same(getattr(got, name), getattr(want, name)), f"rank {r}: {name}"
                assert (getattr(got, name) is None) == (name == "recv_sf" and not fp8)
            assert got.recv_x.dtype == ("float8_e4m3fn" if fp8 else "bfloat16")
            for name in ARRAY_FIELDS:  # an ordinary handle, the deterministic dispatch's
                assert _same(getattr(got.handle, name), getattr(want.handle, name)), name
            assert got.handle.num_recv_tokens == want.handle.num_recv_tokens
            # an ordinary handle: a cached dispatch repeats its rows
            again = buf.dispatch(_x(inp, r), handle=got.handle)
            assert _same(again.recv_x, want.recv_x)
            return got.recv_x.shape[0]
        finally:
            buf.destroy()

    rows = ec.ThreadGroup(N, timeout_secs=60).run(rank_fn)
    ref = reference.dispatch(
        inp.x_args,
        inp.topk_idxs,
        inp.topk_weights,
        num_experts=E,
        num_max_tokens_per_rank=M,
        do_cpu_sync=cpu_sync,
    )
    assert rows == [o.recv_x.shape[0] for o in ref]


def test_recv_x_is_the_combine_buffer_and_a_zero_copy_round_trip_is_the_combine() -> None:
    inp = routing.make_inputs(N, TOKENS, H, E, K, seed=7, masked_ratio=0.25)

    def rank_fn(r, boot):
        buf = _buffer(boot)
        try:
            out = _dispatch(buf, inp, r, zero_copy=True)
            zc = buf.combine_buffer(out.handle)
            assert zc.ptr == out.recv_x.ptr and zc.shape == out.recv_x.shape  # the same memory
            x = ec.to_numpy(out.recv_x)
            y = x.copy()  # the "expert" (identity here), computed from its inputs ...
            ec.to_numpy(zc)[:] = y  # ... and written over them
            got = buf.combine(zc, out.handle, zero_copy=True)
            want = buf.combine(ec.host_array(y, "bfloat16"), out.handle)
            # the next zero-copy dispatch's rows take the same place (valid until then)
            assert _dispatch(buf, inp, r, zero_copy=True).recv_x.ptr == out.recv_x.ptr
            return np.array(ec.to_numpy(got.combined_x)), np.array(ec.to_numpy(want.combined_x))
        finally:
            buf.destroy()

    for r, (got, want) in enumerate(ec.ThreadGroup(N, timeout_secs=60).run(rank_fn)):
        assert np.array_equal(got, want), f"rank {r}"


def test_refusals_name_the_argument_and_reach_the_peers() -> None:
    inp = routing.make_inputs(N, TOKENS, H, E, K, seed=6, fp8=True, num_sf_packs=2)

    def rank_fn(r, boot):
        buf = _buffer(boot)
        try:
            out = _dispatch(buf, inp, r)
            with pytest.raises(TypeError, match="zero_copy: expected a bool"):
                _dispatch(buf, inp, r, zero_copy=1)
            with pytest.raises(ValueError, match=f"zero_copy: not with a cached dispatch .*rank {r}"):
                buf.dispatch(_x(inp, r), handle=out.handle, zero_copy=True)
            with pytest.raises(
                ValueError, match=r"zero_copy: the non-expanded layout only \(do_expand=False\)"
            ):
                _dispatch(buf, inp, r, do_expand=True, zero_copy=True)
            with pytest.raises(ValueError, match="zero_copy: row-major scales only"):
                _dispatch(buf, inp, r, use_tma_aligned_col_major_sf=True, zero_copy=True)
            # rank 1 asks for the expanded layout: it raises, and its peers raise EPPeerError naming it
            try:
                _dispatch(buf, inp, r, do_expand=r == 1, zero_copy=True)
            except EPPeerError as e:
                assert "rank 1" in str(e)
                return "peer"
            except ValueError as e:
                assert r == 1 and "zero_copy: the non-expanded layout only" in str(e)
                return "refused"
            return "ran"
        finally:
            buf.destroy()

    assert ec.ThreadGroup(N, timeout_secs=60).run(rank_fn, raise_first=False) == ["peer", "refused", "peer"]


def test_ranks_that_disagree_on_zero_copy_all_raise() -> None:
    inp = routing.make_inputs(N, TOKENS, H, E, K, seed=8)

    def rank_fn(r, boot):
        buf = _buffer(boot)
        try:
            with pytest.raises(EPMismatchError, match="zero_copy differs"):
                _dispatch(buf, inp, r, zero_copy=r != 2)
            buf.reset()  # out of step after a disagreement (issue 41): every rank resets, then it works
            out = _dispatch(buf, inp, r, zero_copy=True)
            return out.recv_x.shape
        finally:
            buf.destroy()

    assert len(ec.ThreadGroup(N, timeout_secs=60).run(rank_fn)) == N


@pytest.mark.parametrize("hybrid", [True, False])
def test_several_nvlink_domains_are_refused(hybrid: bool) -> None:
    inp = routing.make_inputs(2, [4, 3], H, 8, K, seed=9)

    def rank_fn(r, boot):
        buf = ec.EPBuffer(
            boot,
            transport=ReferenceTransport(num_nvlink_ranks=1),
            num_max_tokens_per_rank=M,
            hidden=H,
            num_topk=K,
            allow_hybrid_mode=hybrid,
            explicitly_destroy=True,
        )
        try:
            with pytest.raises(ValueError, match="zero_copy: direct mode within one NVLink domain only"):
                buf.dispatch(
                    ec.host_array(inp.xs[r], "bfloat16"),
                    ec.host_array(inp.topk_idxs[r]),
                    num_experts=8,
                    zero_copy=True,
                )
        finally:
            buf.destroy()

    ec.ThreadGroup(2, timeout_secs=60).run(rank_fn)


def test_an_executor_without_a_zero_copy_dispatch_refuses() -> None:
    inp = routing.make_inputs(1, [4], H, 4, K, seed=10)
    buf = _buffer(ec.LocalBootstrap())
    try:
        buf.executor.zero_copy_dispatch = False  # as an executor that does not offer it
        with pytest.raises(
            EPConfigError, match="zero_copy: the executor ReferenceExecutor has no zero-copy dispatch"
        ):
            buf.dispatch(
                ec.host_array(inp.xs[0], "bfloat16"),
                ec.host_array(inp.topk_idxs[0]),
                num_experts=4,
                zero_copy=True,
            )
    finally:
        buf.destroy()


# --------------------------------------------------------------------------------------------------------------------
# the GPU executor's road, driver mocked (`ep-core/benchmarks/bench_host_cpu.py`'s)


@pytest.fixture
def mocked_gpu(monkeypatch):
    """An EPBuffer over the mocked GPU executor, and the names of the kernels it launches."""
    import sys
    from pathlib import Path

    from ep_core.kernels import _cuda
    from ep_core.kernels import prepared_launch as pl
    from ep_core.kernels import rank_driver as kex

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_host_cpu as b

    launched: list = []
    native = pl._native_launch

    def recorded_native(launch):  # a prepared launch's words reach the (mocked) native launch, on every road
        call = native(launch)

        def recorded(stream, values, *pairs):
            launched.append(launch.name)
            return call(stream, values, *pairs)

        return recorded

    monkeypatch.setattr(pl, "_native_launch", recorded_native)
    monkeypatch.setattr(pl.PreparedLaunch, "launch", lambda self, words, stream: launched.append(self.name))
    asked: list = []
    counter = [1 << 40]

    def alloc(shape, dtype):
        asked.append((tuple(shape), dtype))
        counter[0] += 1 << 24
        return ec.DeviceArray(counter[0], shape, dtype, device="cuda")

    class Kernels(b._FakeKernels):
        dispatch_zero_copy = combine_zero_copy = b._FakeKernel()

    with b._MockedGpu():
        monkeypatch.setattr(kex, "load_kernels", lambda config: Kernels)
        monkeypatch.setattr(_cuda, "current_device", lambda: 0)  # the views' device
        buf = ec.EPBuffer(
            ec.LocalBootstrap(),
            transport=b._MockedTransport(),
            num_max_tokens_per_rank=M,
            hidden=H,
            num_topk=K,
        )
        yield buf, alloc, asked, launched


@pytest.mark.parametrize("cpu_sync", [False, True])
def test_gpu_executor_returns_the_ranks_views(mocked_gpu, cpu_sync: bool) -> None:
    buf, alloc, asked, launched = mocked_gpu
    x, idx, w = alloc((M, H), "bfloat16"), alloc((M, K), "int64"), alloc((M, K), "float32")
    kw = dict(num_experts=4, num_sms=4, do_cpu_sync=cpu_sync, allocator=alloc)
    # ordinary dispatches first (the second a repeat): their prepared entry must not serve the zero-copy one
    buf.dispatch(x, idx, w, **kw)
    buf.dispatch(x, idx, w, **kw)
    for _ in range(3):  # the first call records the repeat that serves the next (no CPU sync)
        asked.clear()
        launched.clear()
        res = buf.dispatch(x, idx, w, zero_copy=True, **kw)
        assert launched == ["ep_dispatch_zero_copy_impl"]  # no copy epilogue, first call or repeat
        # a no-sync call's repeat serves the next calls; a CPU-sync call takes the full path each time
        assert (buf.executor.rank.last_repeat is None) is cpu_sync
        rows = res.handle.num_recv_tokens if cpu_sync else 1 * M
        assert res.recv_x.shape == (rows, H) and res.recv_topk_idx.shape == (rows, K)
        assert res.recv_topk_weights.shape == (rows, K) and res.recv_sf is None
        # the outputs are the rank's views, not the allocator's arrays (it made the handle's only)
        assert [a for a in asked if a[1] in ("bfloat16", "float32")] == []
        assert all(
            a.owner is buf.executor.rank for a in (res.recv_x, res.recv_topk_idx, res.recv_topk_weights)
        )
        # in the request's dtypes, as an ordinary dispatch's arrays: bf16 data is "bfloat16", not numpy's uint16
        assert (res.recv_x.dtype, res.recv_topk_idx.dtype, res.recv_topk_weights.dtype) == (
            "bfloat16",
            "int64",
            "float32",
        )
        # bf16 recv_x: the combine buffer's memory
        assert res.recv_x.ptr == buf.combine_buffer(res.handle).ptr
    # the zero-copy combine of the handle: the zero-copy kernel each time, its repeat from the second call on
    from ep_core.kernels.op_plan import CombinePlan as RepeatCombine

    y = buf.combine_buffer(res.handle)
    for _ in range(3):
        launched.clear()
        out = buf.combine(y, res.handle, num_sms=4, allocator=alloc, zero_copy=True)
        assert launched == ["ep_combine_zero_copy_impl"] and out.combined_x.shape == (M, H)
    plan = buf.executor.rank.last_repeat
    assert isinstance(plan, RepeatCombine) and plan.zero_copy
