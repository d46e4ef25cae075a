"""DeepEP 2.5's ``dispatch(..., borrow_recv=True)`` and ``ep_torch.DispatchRecvView`` on the CPU reference backend
(issue 42), 2 and 4 gloo ranks: the view's rows (``slab.index_select(0, row_indices)``) are bitwise the ordinary
dispatch's ``recv_x`` (the view lends the ordinary dispatch's rows); the other outputs equal, and outlive the view;
the buffer refuses dispatch / combine / destroy while the view is out and serves again after ``release()``; an
async dispatch's view is readable after its event's wait; DeepEP's refusals (``ValueError``) come before any
launch. The CUDA runs: ``test_torch_defer_borrow_gpu.py``."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is b
    bits = (lambda t: t.contiguous().view(torch.uint8)) if a.dtype.is_floating_point else (lambda t: t)
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def _ranks(rank: int, n: int) -> None:
    import ep_torch

    g = torch.Generator().manual_seed(5 + rank)
    tokens, hidden, topk, experts = 11 + rank, 64, 2, 2 * n
    x = (torch.randn(tokens, hidden, generator=g) * 4).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)]).to(torch.int64)
    idx[::5] = -1
    w = torch.rand(tokens, topk, generator=g)
    for deterministic in (False, True):
        buf = ep_torch.EPBuffer(
            dist.group.WORLD, num_max_tokens_per_rank=16, hidden=hidden, deterministic=deterministic,
            explicitly_destroy=True,
        )  # fmt: skip
        for weights in (None, w):
            kw = dict(topk_idx=idx, topk_weights=weights, num_experts=experts)
            ref = buf.dispatch(x, **kw)
            view, r_idx, r_w, handle, event = buf.dispatch(x, borrow_recv=True, **kw)
            assert isinstance(view, ep_torch.DispatchRecvView)
            # the CPU backend copies, and says so (in place: CUDA, test_torch_defer_borrow_gpu.py)
            assert not view.in_place and "CPU reference" in view.copy_reason
            assert view.copied_rows == ref[0].shape[0] and "copied" in repr(view)
            assert _same(view.slab.index_select(0, view.row_indices), ref[0])
            assert _same(r_idx, ref[1]) and _same(r_w, ref[2])
            assert _same(handle.recv_src_metadata, ref[3].recv_src_metadata)
            with pytest.raises(RuntimeError, match="DispatchRecvView"):
                buf.dispatch(x, **kw)
            with pytest.raises(RuntimeError, match="DispatchRecvView"):
                buf.combine(ref[0], handle)
            with pytest.raises(RuntimeError, match="DispatchRecvView"):
                buf.destroy()
            payload = view.slab.index_select(0, view.row_indices)
            view.release()
            with pytest.raises(RuntimeError, match="released"):
                view.slab  # noqa: B018
            # the buffer serves again: a cached dispatch of the handle, a combine of the rows
            replay = buf.dispatch(x, handle=handle, topk_weights=weights)
            assert _same(replay[0], payload)
            # the view's ids and weights are the caller's (copied out of the receive region): a later dispatch of
            # other rows leaves them as they were
            buf.dispatch((x.float() + 1).bfloat16(), **kw)
            assert _same(r_idx, ref[1]) and _same(r_w, ref[2])
            combined = buf.combine(payload, handle)
            assert _same(combined[0], buf.combine(ref[0], ref[3])[0])

            # async: readable after the event's wait
            view, *_, event = buf.dispatch(x, borrow_recv=True, async_with_compute_stream=True, **kw)
            with pytest.raises(RuntimeError, match="wait"):
                view.row_indices  # noqa: B018
            event.current_stream_wait()
            assert _same(view.slab.index_select(0, view.row_indices), ref[0])
            view.release()

        # DeepEP's refusals (ValueError), nothing launched: the buffer still works
        kw = dict(topk_idx=idx, topk_weights=w, num_experts=experts)
        _, _, _, handle, _ = buf.dispatch(x, **kw)
        for extra in (
            dict(do_expand=True), dict(defer_epilogue=True, async_with_compute_stream=True),
            dict(do_cpu_sync=False), dict(zero_copy=True),
        ):  # fmt: skip
            with pytest.raises(ValueError, match="borrow_recv"):
                buf.dispatch(x, borrow_recv=True, **(kw | extra))
        with pytest.raises(ValueError, match="borrow_recv"):
            buf.dispatch(x, handle=handle, borrow_recv=True)
        with pytest.raises(ValueError, match="bfloat16"):
            buf.dispatch(x.float(), borrow_recv=True, **kw)
        assert len(buf.dispatch(x, borrow_recv=False, **kw)) == 5
        buf.destroy()


@pytest.mark.parametrize("ranks", [2, 4])
def test_borrowed_receive_view(ranks):
    from ep_torch_testing import run_script  # loaded by conftest.py

    code, out = run_script(__file__, ["_ranks", str(ranks)], 300, what=f"{ranks} ranks: ")
    assert code == 0, out[-4000:]


def test_region_rows():
    """The slot of each received row in the ordinary dispatch's order: sources in rank order, slots in order."""
    from ep_torch.recv_view import region_rows

    psum = torch.tensor([2, 2, 5], dtype=torch.int32)
    assert region_rows(psum, 5, 4).tolist() == [0, 1, 8, 9, 10]
    assert region_rows(torch.tensor([3], dtype=torch.int32), 3, 7).tolist() == [0, 1, 2]
    assert region_rows(torch.tensor([0, 0], dtype=torch.int32), 0, 7).tolist() == []
    assert region_rows(psum, 5, 4).dtype == torch.int64


def test_in_place_slab_reads_the_ordinary_rows():
    """A lent region (rows of whole tokens: the hidden part, then the tail) read through the strided bf16 slab and
    `region_rows` gives the ordinary dispatch's rows bit for bit, as `_borrow_cuda` builds it (here on the CPU: the
    region filled as the dispatch and the lending epilogue leave it)."""
    from ep_torch.recv_view import DispatchRecvView, region_rows

    n, m, hidden, tail = 3, 4, 8, 48
    g = torch.Generator().manual_seed(3)
    counts = [2, 0, 3]
    psum = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    recv_x = torch.randn(sum(counts), hidden, generator=g).bfloat16()
    # junk where no row lies
    region = torch.randint(0, 255, (n * m, 2 * hidden + tail), generator=g, dtype=torch.uint8)
    row = 0
    for src, count in enumerate(counts):
        for slot in range(count):
            region[src * m + slot, : 2 * hidden] = recv_x[row].view(torch.uint8)
            row += 1
    slab = region.view(torch.bfloat16)[:, :hidden]
    assert slab.stride() == ((2 * hidden + tail) // 2, 1)
    indices = region_rows(psum, sum(counts), m)
    assert torch.equal(slab.index_select(0, indices).view(torch.int16), recv_x.view(torch.int16))

    class Owner:
        def _end_borrow(self):
            self.ended = True

    owner = Owner()
    own = psum[1] - psum[0]  # rank 1's own rows (none here)
    view = DispatchRecvView(owner, slab, indices, copied_rows=own)
    assert view.in_place and view.copy_reason is None and "pending" in repr(view)
    with pytest.raises(RuntimeError, match="wait"):
        view.copied_rows  # noqa: B018
    view._mark_ready()
    assert view.copied_rows == 0 and view.row_indices is indices
    view.release()
    assert owner.ended and "released" in repr(view)
    with pytest.raises(RuntimeError, match="released"):
        view.slab  # noqa: B018


def test_export():
    import ep_torch
    from ep_torch.recv_view import DispatchRecvView

    assert ep_torch.DispatchRecvView is DispatchRecvView and "DispatchRecvView" in ep_torch.__all__


if __name__ == "__main__":
    from ep_torch_testing import spawn_cpu

    spawn_cpu(globals()[sys.argv[1]], int(sys.argv[2]))
