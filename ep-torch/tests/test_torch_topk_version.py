"""DeepEP 2.5's ``topk_idx`` version check (issue 42, ``ep_torch.handle_version``): with ``do_handle_copy=False``
(2.5's ``EPBuffer`` default) the handle keeps the caller's ``topk_idx``; changing it in place before a cached dispatch
or a combine that reads the handle raises ``EPValueError`` naming ``topk_idx`` (announced: a peer that did not change
its own raises ``EPPeerError`` naming the rank). CPU: 2 ranks over gloo."""

from __future__ import annotations

import gc
import sys

import pytest
import torch
import torch.distributed as dist
from ep_core.errors import EPPeerError, EPValueError
from ep_torch import handle_version

H, K, E, T = 64, 2, 4, 6


class _Handle:  # weak-referenceable, as ep-core's EPHandle
    pass


def test_keep_check_and_drop():
    idx = torch.zeros(3, 2, dtype=torch.int64)
    h = _Handle()
    handle_version.keep(h, idx)
    handle_version.check(h, "combine")
    idx.view(-1)[0] += 0  # through a view: the version counter is shared
    with pytest.raises(EPValueError, match="combine: topk_idx was modified in place"):
        handle_version.check(h, "combine")
    handle_version.check(_Handle(), "combine")  # never recorded: nothing to check
    key = id(h)
    del h
    gc.collect()
    assert key not in handle_version.KEPT  # dropped with its handle
    with torch.inference_mode():
        inf = torch.zeros(3, 2, dtype=torch.int64)
    h2 = _Handle()
    handle_version.keep(h2, inf)  # no version counter: not checked (DeepEP's rule)
    assert id(h2) not in handle_version.KEPT


def _inputs(rank: int):
    g = torch.Generator().manual_seed(900 + rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    return x, idx, torch.rand(T, K, generator=g)


def _ranks(rank: int, n: int) -> None:
    import ep_torch

    buf = ep_torch.EPBuffer(dist.group.WORLD, None, 16, H, K)
    x, idx0, w = _inputs(rank)

    def dispatch(idx, **kw):
        return buf.dispatch(x, idx, w, num_experts=E, **kw)

    idx = idx0.clone()
    for _ in range(2):  # the second call takes the kept-plan road (express lane)
        recv_x, _, recv_w, handle, _ = dispatch(idx)
        assert handle.topk_idx is idx
        buf.combine(recv_x, handle, recv_w)
        buf.dispatch(x, handle=handle)
    idx.add_(0)  # an in-place change (the same values: the version still moves, as DeepEP's check sees it)
    with pytest.raises(EPValueError, match="combine: topk_idx was modified in place"):
        buf.combine(recv_x, handle, recv_w)
    with pytest.raises(EPValueError, match="dispatch: topk_idx"):
        buf.dispatch(x, handle=handle)
    with pytest.raises(EPValueError, match="combine: topk_idx"):  # the deferred road too
        buf.combine(recv_x, handle, recv_w, async_with_compute_stream=True, defer_epilogue=True)
    dist.barrier()

    # a new dispatch records the new version; ep's own copy (do_handle_copy=True) is never checked
    recv_x, _, recv_w, handle, _ = dispatch(idx)
    buf.combine(recv_x, handle, recv_w)
    idx2 = idx0.clone()
    recv_x, _, recv_w, handle, _ = dispatch(idx2, do_handle_copy=True)
    idx2.add_(0)
    buf.combine(recv_x, handle, recv_w)

    # one rank changes its routing: it raises the error, its peer raises naming it
    idx3 = idx0.clone()
    recv_x, _, recv_w, handle, _ = dispatch(idx3)
    if rank == 0:
        idx3[0, 0] = idx3[0, 0]
        with pytest.raises(EPValueError, match="topk_idx"):
            buf.combine(recv_x, handle, recv_w)
    else:
        with pytest.raises(EPPeerError, match="rank 0"):
            buf.combine(recv_x, handle, recv_w)
    dist.barrier()


def test_topk_idx_version_on_gloo_ranks():
    from ep_torch_testing import run_script  # loaded by conftest.py

    code, out = run_script(__file__, ["_ranks", "2"], 300, what="2 ranks: ")
    assert code == 0, out[-4000:]


if __name__ == "__main__":
    from ep_torch_testing import spawn_cpu

    spawn_cpu(globals()[sys.argv[1]], int(sys.argv[2]))
