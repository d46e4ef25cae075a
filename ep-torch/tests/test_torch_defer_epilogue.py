"""DeepEP 2.5's ``defer_epilogue=True`` and the handle's ``topk_idx`` (issue 42).

``dispatch(..., defer_epilogue=True)`` / ``combine(..., defer_epilogue=True)`` return only the ``EventOverlap``; its
first ``current_stream_wait()`` (or ``wait()``) returns the outputs, bitwise those of the ordinary call (CPU
reference backend, 2 and 4 gloo ranks: plain, expanded, cached, FP32 weights, combine with weights). With
``do_handle_copy=False`` the handle keeps the caller's ``topk_idx`` tensor itself. DeepEP's rules are refused
before any launch (no ``async_with_compute_stream``, ``do_handle_copy=True``), and so is ``zero_copy``; on CUDA
ep refuses ``defer_epilogue`` (its GPU executor runs the send and the epilogue as one step)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from ep_torch.launch import spawn


def _bits(t):
    if t is None:
        return None
    if isinstance(t, tuple):
        return tuple(_bits(v) for v in t)
    return t.contiguous().view(torch.uint8) if t.dtype.is_floating_point else t


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is b
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same(u, v) for u, v in zip(a, b, strict=True))
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _inputs(rank: int, n: int, tokens: int = 12, hidden: int = 64, topk: int = 3):
    g = torch.Generator().manual_seed(17 + rank)
    experts = 4 * n
    x = (torch.randn(tokens, hidden, generator=g) * 3).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)]).to(torch.int64)
    idx[torch.rand(tokens, topk, generator=g) < 0.2] = -1
    w = torch.rand(tokens, topk, generator=g, dtype=torch.float32)
    return x, idx, w, experts


def _ranks(rank: int, n: int) -> None:
    import ep_torch
    from ep_core.errors import EPValueError

    buf = ep_torch.EPBuffer(dist.group.WORLD, num_max_tokens_per_rank=16, hidden=64, explicitly_destroy=True)
    x, idx, w, experts = _inputs(rank, n)

    for kw in ({}, {"do_expand": True, "expert_alignment": 4}, {"expert_alignment": 2, "do_cpu_sync": False}):
        ref = buf.dispatch(x, idx, w, num_experts=experts, do_handle_copy=False, **kw)
        assert ref[3].topk_idx is idx, "do_handle_copy=False keeps the caller's tensor"
        ev = buf.dispatch(
            x, idx, w, num_experts=experts, async_with_compute_stream=True, do_handle_copy=False,
            defer_epilogue=True, **kw,
        )  # fmt: skip
        assert isinstance(ev, ep_torch.EventOverlap), type(ev)
        got = ev.current_stream_wait()
        assert isinstance(got, tuple) and len(got) == 4
        assert ev.current_stream_wait() is None, "the epilogue runs once"
        for a, b in zip(ref[:3], got[:3], strict=True):
            assert _same(a, b), kw
        handle = got[3]
        assert handle.topk_idx is idx
        for name in ("psum_num_recv_tokens_per_expert", "recv_src_metadata", "dst_buffer_slot_idx"):
            assert _same(getattr(ref[3], name), getattr(handle, name)), name
        assert handle.num_recv_tokens_per_expert_list == ref[3].num_recv_tokens_per_expert_list

        # a cached dispatch, deferred (wait() is current_stream_wait())
        cached = buf.dispatch(x, handle=handle, topk_weights=w)
        ev = buf.dispatch(
            x, handle=handle, topk_weights=w, async_with_compute_stream=True, do_handle_copy=False,
            defer_epilogue=True,
        )  # fmt: skip
        got_cached = ev.wait()
        assert got_cached[3] is handle
        for a, b in zip(cached[:3], got_cached[:3], strict=True):
            assert _same(a, b), ("cached", kw)

        # combine, with and without weights
        y = (got[0].float() * 0.5 + 1).to(torch.bfloat16)
        rw = got[2]
        if kw.get("do_expand"):
            rw = None
        for weights in (None, rw):
            ref_c = buf.combine(y, handle, topk_weights=weights)
            ev = buf.combine(
                y, handle, topk_weights=weights, async_with_compute_stream=True, defer_epilogue=True
            )
            assert isinstance(ev, ep_torch.EventOverlap)
            with ev:  # the `with` form waits too (its result is dropped, as DeepEP's)
                pass
            assert ev.hook_after_wait is None
            ev = buf.combine(
                y, handle, topk_weights=weights, async_with_compute_stream=True, defer_epilogue=True
            )
            got_c = ev.current_stream_wait()
            assert len(got_c) == 2
            assert _same(ref_c[0], got_c[0]) and _same(ref_c[1], got_c[1]), ("combine", kw, weights is None)

    # defer_epilogue=0 is the ordinary call
    assert len(buf.dispatch(x, idx, w, num_experts=experts, defer_epilogue=0)) == 5
    # EPBuffer's default is DeepEP 2.5's do_handle_copy=False (the caller's tensor); True (ElasticBuffer's
    # default) copies
    assert buf.dispatch(x, idx, w, num_experts=experts)[3].topk_idx is idx
    assert buf.dispatch(x, idx, w, num_experts=experts, do_handle_copy=True)[3].topk_idx is not idx
    # DeepEP's rules and ep's, refused before any launch (every rank refuses alike: no collective started)
    with pytest.raises(EPValueError, match="async_with_compute_stream"):
        buf.dispatch(x, idx, w, num_experts=experts, do_handle_copy=False, defer_epilogue=True)
    with pytest.raises(EPValueError, match="do_handle_copy=False"):
        buf.dispatch(
            x,
            idx,
            w,
            num_experts=experts,
            async_with_compute_stream=True,
            do_handle_copy=True,
            defer_epilogue=True,
        )
    with pytest.raises(EPValueError, match="zero_copy"):
        buf.dispatch(
            x, idx, w, num_experts=experts, async_with_compute_stream=True, do_handle_copy=False,
            defer_epilogue=True, zero_copy=True,
        )  # fmt: skip
    _, _, _, handle, _ = buf.dispatch(x, idx, w, num_experts=experts)
    with pytest.raises(EPValueError, match="async_with_compute_stream"):
        buf.combine(x, handle, defer_epilogue=True)
    # the buffer still works after the refusals
    assert len(buf.dispatch(x, idx, w, num_experts=experts)) == 5
    buf.destroy()


@pytest.mark.parametrize("ranks", [2, 4])
def test_deferred_epilogue_is_bitwise_the_ordinary_call(ranks):
    from ep_torch_testing import run_script  # loaded by conftest.py

    code, out = run_script(__file__, ["_ranks", str(ranks)], 300, what=f"{ranks} ranks: ")
    assert code == 0, out[-4000:]


def test_event_overlap_wait_returns_the_hook_result():
    from ep_torch import EventHandle, EventOverlap

    ev = EventOverlap(EventHandle(device="cpu"))
    assert ev.current_stream_wait() is None
    ev.register_hook_after_wait(lambda: (1, 2))
    assert ev.wait() == (1, 2)
    assert ev.wait() is None


def _gpu_rank(rank: int, n: int) -> None:
    import ep_torch

    torch.cuda.set_device(rank)
    buf = ep_torch.EPBuffer(dist.group.WORLD, num_max_tokens_per_rank=16, hidden=64, explicitly_destroy=True)
    x, idx, w, experts = _inputs(rank, n)
    x, idx, w = x.cuda(), idx.cuda(), w.cuda()
    _, _, _, handle, _ = buf.dispatch(x, idx, w, num_experts=experts, do_handle_copy=False)
    assert handle.topk_idx is idx
    with pytest.raises(NotImplementedError, match="defer_epilogue"):
        buf.dispatch(
            x, idx, w, num_experts=experts, async_with_compute_stream=True, do_handle_copy=False,
            defer_epilogue=True,
        )  # fmt: skip
    with pytest.raises(NotImplementedError, match="defer_epilogue"):
        buf.combine(x, handle, async_with_compute_stream=True, defer_epilogue=True)
    torch.cuda.synchronize()
    buf.destroy()


@pytest.mark.gpu
def test_gpu_handle_keeps_topk_idx_and_defer_is_refused():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    proc = subprocess.run(
        [sys.executable, __file__, "_gpu_rank", "1"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


if __name__ == "__main__":
    from ep_torch_testing import spawn_cpu

    name, n = sys.argv[1], int(sys.argv[2])
    if name == "_gpu_rank":
        spawn(globals()[name], n, backend="nccl")
    else:
        spawn_cpu(globals()[name], n)
