"""DeepEP 2.5's ``defer_epilogue=True`` and ``borrow_recv=True`` on CUDA tensors (issue 42), marker ``gpu``.

One rank over nccl (``EPBuffer``, a child process): a deferred dispatch (plain, expanded with alignment, no CPU
sync, cached; split: the call launches the dispatch kernel, the wait runs the rest) and a deferred combine (with and
without weights, with a bias and a pair; split: the call launches the send part, the wait the reduce) hand over at
``current_stream_wait()`` (waited on another stream too; a combine's ``x`` dropped before the wait) bitwise what the
ordinary call returns (a deterministic buffer: the same row order); the buffer refuses a call while a deferred
dispatch or combine waits (the CPU backend too); the host time of a CPU-sync dispatch call behind queued compute, ordinary and deferred (printed; the
deferred call must return sooner). A borrowed receive view holds the ordinary dispatch's rows (compared in source
order), its ids and weights outlive it, the buffer refuses dispatch / combine / destroy / ``lb_*`` while it is out,
a cached dispatch and a combine of its handle work after ``release()``, and (DeepEP's own test's pattern)
``release(*readers)`` keeps the rows alive for delayed readers on other streams while the next dispatch runs. A
loopback group of 2 ranks: deferred no-CPU-sync dispatches and deferred combines against the ordinary calls
(through the combine: rows past the count are undefined without a CPU sync), and deferred CPU-sync dispatches
(every rank launches before any waits for its counts). On CUDA the borrowed view is the receive region lent in place
(``view.in_place``; one rank: every row its own, put into the region from ``x``); 2 processes sharing the GPU over
ipc: the view's rows (the peer's where its kernel put them, this rank's own from ``x``) bitwise the ordinary
dispatch's, a delayed reader passed to ``release`` keeps them while every rank dispatches again, a combine of them.

The same bodies run on the CPU reference backend (1 gloo rank; a CPU loopback group; 2 gloo ranks) without the ``gpu`` marker,
which checks the tests themselves where no GPU is."""

from __future__ import annotations

import os
import sys

import pytest
import torch

T, M, H, K, E = 40, 64, 256, 4, 8


def _inputs(seed: int, t: int, dev: torch.device, rank: int = 0):
    g = torch.Generator().manual_seed(100 * seed + rank)
    x = (torch.randn(t, H, generator=g) * 3).bfloat16()
    rows = [torch.randperm(E, generator=g)[:K] for _ in range(t)]
    idx = torch.stack(rows).to(torch.int64) if rows else torch.zeros(0, K, dtype=torch.int64)
    idx[::3, 1] = -1
    if t > 5:
        idx[5] = -1  # a token that goes nowhere
    w = torch.rand(t, K, generator=g)
    return x.to(dev), idx.to(dev), w.to(dev)


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is b
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same(u, v) for u, v in zip(a, b, strict=True))
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    if a.dtype.is_floating_point:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def _count(handle) -> int:
    """The defined rows of a dispatch of `handle`: without a CPU sync the rows past the received count are
    undefined; expanded (zero-padded here) every row up to the expanded count."""
    if handle.do_expand:
        return handle.num_expanded_tokens
    return int(handle.psum_num_recv_tokens_per_scaleup_rank[-1])


def _host_time(buf, x, idx, w, kw) -> None:
    """The host time of a CPU-sync dispatch call behind 20-odd ms of queued compute: the ordinary call waits for the
    counts, hence for the queued work; the deferred one returns after launching (it waits at the event's wait)."""
    import time

    times = {}
    for deferred in (False, True, False, True):
        torch.cuda.synchronize()
        torch.cuda._sleep(40_000_000)  # compute queued on the current stream before the call
        t0 = time.perf_counter()
        if deferred:
            ev = buf.dispatch(x, idx, w, **kw, async_with_compute_stream=True, defer_epilogue=True)
            t1 = time.perf_counter()
            ev.current_stream_wait()
        else:
            buf.dispatch(x, idx, w, **kw)
            t1 = time.perf_counter()
        torch.cuda.synchronize()
        times["deferred" if deferred else "ordinary"] = (t1 - t0) * 1e3
    print(f"CPU-sync dispatch call, host ms behind queued compute: {times}")
    assert times["deferred"] < times["ordinary"], times


def _deferred_combine(buf, handle, y, weights, side, cuda: bool) -> None:
    """A deferred combine (split on CUDA: the send part at the call, the reduce at the wait) against the ordinary
    one: with a bias and a pair of them; waited on another stream behind queued work; its `x` dropped by the caller
    and its memory offered to new tensors before the wait (the pending reduce still reads it: kept)."""
    t = handle.num_tokens
    g = torch.Generator().manual_seed(7)
    bias = (torch.randn(t, H, generator=g) * 2).bfloat16().to(y.device)
    for b in (bias, (bias, (bias.float() * -0.5).bfloat16())):
        ref = buf.combine(y, handle, topk_weights=weights, bias=b)
        ev = buf.combine(
            y, handle, topk_weights=weights, bias=b, async_with_compute_stream=True, defer_epilogue=True
        )
        out = ev.current_stream_wait()
        assert _same(out[0], ref[0]) and _same(out[1], ref[1]), "deferred combine with bias"
    ref = buf.combine(y, handle, topk_weights=weights)
    mine = y.clone()
    ev = buf.combine(mine, handle, topk_weights=weights, async_with_compute_stream=True, defer_epilogue=True)
    del mine
    junk = [torch.full_like(y, 7.0) for _ in range(4)]  # would take the memory of a freed `mine`
    if cuda:
        with torch.cuda.stream(side):
            torch.cuda._sleep(2_000_000)  # the reduce follows the waiting stream's work
            out = ev.wait()
        torch.cuda.current_stream().wait_stream(side)
    else:
        out = ev.wait()
    assert _same(out[0], ref[0]) and _same(out[1], ref[1]), "deferred combine waited on another stream"
    del junk


def _one_rank() -> None:
    """The one-rank body (module doc), on this process's default group: CUDA (nccl) or the CPU reference (gloo)."""
    import ep_torch
    import torch.distributed as dist

    cuda = dist.get_backend() == "nccl"
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    x, idx, w = _inputs(1, T, dev)
    kw = dict(num_experts=E, num_sms=8)

    # ---- defer_epilogue: bitwise the ordinary call (a deterministic buffer)
    buf = ep_torch.EPBuffer(
        dist.group.WORLD, num_max_tokens_per_rank=M, hidden=H, num_topk=K, deterministic=True,
        explicitly_destroy=True,
    )  # fmt: skip
    side = torch.cuda.Stream(dev) if cuda else None
    for extra in (
        {},
        {"do_expand": True, "expert_alignment": 4, "do_zero_padding": True},
        {"do_cpu_sync": False},
    ):
        ref = buf.dispatch(x, idx, w, **kw, **extra)
        ev = buf.dispatch(x, idx, w, **kw, **extra, async_with_compute_stream=True, defer_epilogue=True)
        assert isinstance(ev, ep_torch.EventOverlap), type(ev)
        got = ev.current_stream_wait()
        assert len(got) == 4 and ev.current_stream_wait() is None, "the outputs once"
        assert got[3].topk_idx is idx
        rows = _count(got[3])
        for a, b in zip(ref[:3], got[:3], strict=True):
            assert _same(a if a is None else a[:rows], b if b is None else b[:rows]), extra
        for name in ("psum_num_recv_tokens_per_expert", "num_unaligned_recv_tokens_per_expert"):
            assert _same(getattr(ref[3], name), getattr(got[3], name)), (name, extra)
        handle = got[3]
        # a cached dispatch, deferred, waited on another stream
        # (an expanded dispatch's padding rows are defined only with do_zero_padding: the cached calls ask for it
        # as the first did, else the two calls' fresh outputs differ there)
        pad = {"do_zero_padding": True} if extra.get("do_zero_padding") else {}
        cached = buf.dispatch(x, handle=handle, topk_weights=w, **pad)
        ev = buf.dispatch(
            x, handle=handle, topk_weights=w, **pad, async_with_compute_stream=True, defer_epilogue=True
        )
        if cuda:
            with torch.cuda.stream(side):
                got_c = ev.wait()
            torch.cuda.current_stream().wait_stream(side)
        else:
            got_c = ev.wait()
        assert got_c[3] is handle
        for a, b in zip(cached[:3], got_c[:3], strict=True):
            assert _same(a if a is None else a[:rows], b if b is None else b[:rows]), ("cached", extra)
        # combine, with and without weights
        y = (got[0].float() * 0.5 + 1).bfloat16()
        for weights in (None,) if extra.get("do_expand") else (None, got[2]):
            ref_c = buf.combine(y, handle, topk_weights=weights)
            ev = buf.combine(
                y, handle, topk_weights=weights, async_with_compute_stream=True, defer_epilogue=True
            )
            out = ev.current_stream_wait()
            assert len(out) == 2 and _same(out[0], ref_c[0]) and _same(out[1], ref_c[1]), ("combine", extra)
        _deferred_combine(buf, handle, y, got[2] if not extra else None, side, cuda)
    with pytest.raises(ValueError, match="async_with_compute_stream"):
        buf.dispatch(x, idx, w, **kw, defer_epilogue=True)
    # until the wait the buffer refuses other calls (the pending dispatch owns the rank's count words)
    ev = buf.dispatch(x, idx, w, **kw, async_with_compute_stream=True, defer_epilogue=True)
    with pytest.raises(RuntimeError, match="deferred dispatch"):
        buf.dispatch(x, idx, w, **kw)
    ev.current_stream_wait()
    ev = buf.combine(y, handle, async_with_compute_stream=True, defer_epilogue=True)
    for call in (lambda: buf.dispatch(x, idx, w, **kw), lambda: buf.combine(y, handle), buf.destroy):
        with pytest.raises(RuntimeError, match="deferred combine"):
            call()
    ev.current_stream_wait()
    if cuda:
        _host_time(buf, x, idx, w, kw)
    buf.destroy()

    # ---- borrow_recv (deterministic and not): the ordinary rows, in source order
    for deterministic in (False, True):
        buf = ep_torch.EPBuffer(
            dist.group.WORLD, num_max_tokens_per_rank=M, hidden=H, num_topk=K, deterministic=deterministic,
            lb_allocation_plan_or_num_bytes=ep_torch.get_num_allocation_alignment(), explicitly_destroy=True,
        )  # fmt: skip
        for weights in (None, w):
            bkw = dict(topk_idx=idx, topk_weights=weights, **kw)
            ref = buf.dispatch(x, **bkw)
            view, r_idx, r_w, handle, _ = buf.dispatch(x, borrow_recv=True, **bkw)
            assert isinstance(view, ep_torch.DispatchRecvView)
            # CUDA lends the receive region (no copy epilogue for the rows); one rank: every row is its own, put
            # into the region from x
            assert view.in_place == cuda, view.copy_reason
            payload = view.slab.index_select(0, view.row_indices)
            if cuda:
                assert view.copied_rows == payload.shape[0] and view.slab.stride()[0] > H
            if deterministic:  # the same row order: bitwise as it stands
                assert _same(payload, ref[0])
            mine = handle.recv_src_metadata[:, 0].long().argsort()
            theirs = ref[3].recv_src_metadata[:, 0].long().argsort()
            assert _same(payload[mine], ref[0][theirs]) and _same(r_idx[mine], ref[1][theirs])
            assert r_w is None if weights is None else _same(r_w[mine], ref[2][theirs])
            with pytest.raises(RuntimeError, match="DispatchRecvView"):
                buf.dispatch(x, **bkw)
            with pytest.raises(RuntimeError, match="DispatchRecvView"):
                buf.combine(payload, handle)
            with pytest.raises(RuntimeError, match="DispatchRecvView"):
                buf.destroy()
            view.release()
            with pytest.raises(RuntimeError, match="released"):
                view.slab  # noqa: B018
            replay = buf.dispatch(x, handle=handle, topk_weights=weights)
            assert _same(replay[0], payload), "a cached dispatch of the handle: the view's rows"
            buf.dispatch(
                (x.float() + 1).bfloat16(), **bkw
            )  # overwrites the receive region, not the ids/weights
            assert _same(r_idx[mine], ref[1][theirs])
            ones = torch.ones_like(replay[0])
            combined = buf.combine(ones, handle)[0]
            want = (idx >= 0).any(1).to(torch.bfloat16)[:, None].expand(T, H)  # one rank: 1 where it went
            assert _same(combined, want)

        # async on the comm stream, waited on a third stream; release(*readers) protects delayed readers
        bkw = dict(
            topk_idx=idx, topk_weights=w, **kw, async_with_compute_stream=True, allocate_on_comm_stream=True
        )
        ref = buf.dispatch(x, topk_idx=idx, topk_weights=w, **kw)
        view, d_idx, d_w, d_handle, event = buf.dispatch(x, borrow_recv=True, **bkw)
        with pytest.raises(RuntimeError, match="wait"):
            view.row_indices  # noqa: B018
        mine = d_handle.recv_src_metadata[:, 0].long().argsort()
        theirs = ref[3].recv_src_metadata[:, 0].long().argsort()
        if cuda:
            ready = torch.cuda.Stream(dev)
            with torch.cuda.stream(ready):
                torch.cuda._sleep(4_000_000)
                event.current_stream_wait()
            readers = [torch.cuda.Stream(dev), torch.cuda.Stream(dev)]
            delayed = []
            for reader, delay in zip(readers, (4_000_000, 64_000_000), strict=True):
                with torch.cuda.stream(reader):
                    torch.cuda._sleep(delay)
                    delayed.append(view.slab.index_select(0, view.row_indices))
            view.release(*readers)
            late = not readers[-1].query()
            buf.dispatch((x.float() + 1).bfloat16(), topk_idx=idx, topk_weights=w, **kw)
            for reader, rows in zip(readers, delayed, strict=True):
                reader.synchronize()
                assert _same(rows[mine], ref[0][theirs]), "a delayed reader saw the next dispatch's rows"
            print(f"delayed reader still running at release: {late}")
        else:
            event.current_stream_wait()
            rows = view.slab.index_select(0, view.row_indices)
            view.release()
            assert _same(rows[mine], ref[0][theirs])
        assert _same(d_idx[mine], ref[1][theirs]) and _same(d_w[mine], ref[2][theirs])

        # DeepEP's refusals (ValueError, before any launch), and lb_* while a view is out
        bkw = dict(topk_idx=idx, topk_weights=w, **kw)
        for extra in (
            dict(do_expand=True), dict(defer_epilogue=True, async_with_compute_stream=True), dict(do_cpu_sync=False),
        ):  # fmt: skip
            with pytest.raises(ValueError, match="borrow_recv"):
                buf.dispatch(x, borrow_recv=True, **(bkw | extra))
        with pytest.raises(ValueError, match="borrow_recv"):
            buf.dispatch(x, handle=ref[3], borrow_recv=True)
        with pytest.raises(ValueError, match="bfloat16"):
            buf.dispatch(x.float(), borrow_recv=True, **bkw)
        view, *_ = buf.dispatch(x, borrow_recv=True, **bkw)
        with pytest.raises(RuntimeError, match="DispatchRecvView"):
            buf.lb_reduce_grads(None, None, None)
        if cuda:
            with pytest.raises(ValueError, match="consumer_streams"):
                view.release(torch.cuda.Stream(dev), "s")
        view.release()
        assert len(buf.dispatch(x, **bkw)) == 5
        if cuda:
            torch.cuda.synchronize()
        buf.destroy()
    print("one rank ok")


def _loopback(device: str) -> None:
    """2 ranks of a loopback group: deferred no-CPU-sync dispatches and deferred combines against the ordinary."""
    from ep_torch.loopback import LoopbackGroup

    group = LoopbackGroup(2, device=device, gpu_timeout_secs=20)
    dev = group.device
    bufs = group.elastic_buffers(num_max_tokens_per_rank=M, hidden=H, num_topk=K)
    data = [_inputs(2, T - 3 * r, dev, r) for r in range(2)]
    kw = dict(num_experts=E, do_cpu_sync=False, do_handle_copy=False)

    def dispatch(r, **extra):
        x, idx, w = data[r]
        return bufs[r].dispatch(x, topk_idx=idx, topk_weights=w, **(kw | extra))

    ref = group.run(dispatch)
    evs = group.run(lambda r: dispatch(r, async_with_compute_stream=True, defer_epilogue=True))
    got = group.run(lambda r: evs[r].current_stream_wait())
    # rows past the count are undefined without a CPU sync: compared through the combine of each call's rows
    c_ref = group.run(lambda r: bufs[r].combine(ref[r][0], ref[r][3]))
    c_got = group.run(
        lambda r: bufs[r].combine(got[r][0], got[r][3], async_with_compute_stream=True, defer_epilogue=True)
    )
    c_got = group.run(lambda r: c_got[r].current_stream_wait())
    for r in range(2):
        assert got[r][3].topk_idx is data[r][1]
        assert _same(c_ref[r][0], c_got[r][0]), f"rank {r}: deferred dispatch + combine differ"
    # a CPU-sync dispatch, deferred: every rank launches before any waits for its counts (which a loopback group
    # needs: an ordinary CPU-sync dispatch is not run there)
    evs = group.run(
        lambda r: dispatch(r, async_with_compute_stream=True, defer_epilogue=True, do_cpu_sync=True)
    )
    got = group.run(lambda r: evs[r].current_stream_wait())
    c_got = group.run(lambda r: bufs[r].combine(got[r][0], got[r][3]))
    for r in range(2):
        assert got[r][0].shape[0] == got[r][3].num_recv_tokens, "exact rows after the CPU sync"
        assert _same(c_ref[r][0], c_got[r][0]), f"rank {r}: deferred CPU-sync dispatch + combine differ"
    for b in bufs:
        b.destroy()
    group.close()
    print("loopback ok")


def _two(rank: int, n: int, device: str = "cpu") -> None:
    """2 processes (sharing the GPU over ipc; gloo ranks of the CPU reference): a borrowed view in place holds the
    ordinary dispatch's rows, the peer's (read where the peer's kernel put them) and this rank's own (put there from
    x: ``copied_rows``); a delayed reader on another stream passed to ``release`` keeps its rows while every rank
    dispatches again (the peer's next dispatch waits at its entry barrier for this rank's, which waits for the
    reader); a combine of the rows after the release is the ordinary one."""
    import ep_torch
    import torch.distributed as dist

    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(0)  # every process on the one GPU: ipc (NCCL refuses two ranks on one GPU)
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    x, idx, w = _inputs(3, T - 5 * rank, dev, rank)
    kw = dict(topk_idx=idx, topk_weights=w, num_experts=E)
    for deterministic in (False, True):
        buf = ep_torch.EPBuffer(
            dist.group.WORLD, num_max_tokens_per_rank=M, hidden=H, num_topk=K, deterministic=deterministic,
            explicitly_destroy=True, transport="ipc" if cuda else "reference",
        )  # fmt: skip
        ref = buf.dispatch(x, **kw)
        view, r_idx, r_w, handle, _ = buf.dispatch(x, borrow_recv=True, **kw)
        assert view.in_place == cuda, view.copy_reason
        payload = view.slab.index_select(0, view.row_indices)
        mine = handle.recv_src_metadata[:, 0].long().argsort()
        theirs = ref[3].recv_src_metadata[:, 0].long().argsort()
        assert _same(payload[mine], ref[0][theirs]), f"rank {rank}: the view's rows"
        assert _same(r_idx[mine], ref[1][theirs]) and _same(r_w[mine], ref[2][theirs])
        if deterministic:
            assert _same(payload, ref[0]), f"rank {rank}: deterministic rows in order"
        own = int((handle.recv_src_metadata[:, 0] // M == rank).sum())
        assert view.copied_rows == (own if cuda else payload.shape[0])
        assert 0 < own < payload.shape[0], "rows from both ranks (the test's routing)"
        if cuda:
            reader = torch.cuda.Stream(dev)
            with torch.cuda.stream(reader):
                torch.cuda._sleep(50_000_000)
                late = view.slab.index_select(0, view.row_indices)
            view.release(reader)
        else:
            late = view.slab.index_select(0, view.row_indices)
            view.release()
        buf.dispatch((x.float() + 1).bfloat16(), **kw)  # overwrites the region (every rank)
        if cuda:
            reader.synchronize()
        assert _same(late, payload), f"rank {rank}: a delayed reader saw the next dispatch's rows"
        want = buf.combine(ref[0], ref[3])[0]
        assert _same(buf.combine(payload, handle)[0], want), f"rank {rank}: combine of the view's rows"
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        buf.destroy()
    print(f"rank {rank}: two ok")


def _two_cpu(rank: int, n: int) -> None:
    _two(rank, n, "cpu")


def _two_cuda(rank: int, n: int) -> None:
    _two(rank, n, "cuda")


def _script(args: list[str], limit: float) -> None:
    from ep_torch_testing import run_script  # loaded by conftest.py

    env = {k: v for k, v in os.environ.items() if k not in ("EPKIT_SCALEUP_RANKS", "EPKIT_TORCH_TRANSPORT")}
    code, out = run_script(__file__, args, limit, env=env, what=" ".join(args) + ": ")
    assert code == 0, out[-4000:]


def test_bodies_on_cpu_reference():
    _script(["one", "gloo"], 240)
    _script(["loopback", "cpu"], 240)
    _script(["two", "cpu"], 240)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_gpu_ipc_two_processes_borrow():
    _script(["two", "cuda"], 180)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_gpu_nccl_one_rank():
    _script(["one", "nccl"], 240)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_gpu_loopback_two_ranks():
    _script(["loopback", "cuda"], 180)


if __name__ == "__main__":
    what, how = sys.argv[1], sys.argv[2]
    if what == "loopback":
        _loopback(how)
    elif what == "two":
        from ep_torch.launch import spawn

        spawn(_two_cuda if how == "cuda" else _two_cpu, 2)
    else:
        import torch.distributed as dist
        from ep_torch.launch import free_port, init_rank

        init_rank(0, 1, free_port(), how)
        try:
            _one_rank()
        finally:
            dist.destroy_process_group()
