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


def test_export():
    import ep_torch
    from ep_torch.recv_view import DispatchRecvView

    assert ep_torch.DispatchRecvView is DispatchRecvView and "DispatchRecvView" in ep_torch.__all__


if __name__ == "__main__":
    from ep_torch_testing import spawn_cpu

    spawn_cpu(globals()[sys.argv[1]], int(sys.argv[2]))
