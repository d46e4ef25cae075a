"""DeepEP 2.5's ``EPBuffer`` parameter order and defaults (``ep_torch.epbuffer_surface``, issue 42) and the
``BufferBase`` members of the 2.5 buffers, on the CPU reference backend: 2 and 4 gloo ranks, and 4 ranks as 2
emulated nodes. Calls written positionally in 2.5's order give what ``ep_core.reference`` gives; the constructor's
sizes land where 2.5 puts them; ``do_handle_copy`` defaults to False (the handle keeps the caller's ``topk_idx``);
``defer_epilogue`` / ``borrow_recv`` are positional; ``lb_*`` refuse while a receive view is out; ``borrow_recv``
is refused across NVLink domains; ``context`` / ``main_context`` / ``print_memory_usage`` /
``nccl_comm_handle(s)``; ``comm.barrier``'s ``context_idx`` over a ``BucketBuffer``'s groups."""

from __future__ import annotations

import inspect
import os
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist

E = inspect.Parameter.empty

CTOR_25 = [
    ("group", E), ("num_bytes", None), ("num_max_tokens_per_rank", 0), ("hidden", 0), ("num_topk", 0),
    ("use_fp8_dispatch", False), ("lb_allocation_plan_or_num_bytes", 0), ("deterministic", False),
    ("allow_hybrid_mode", True), ("allow_multiple_reduction", True), ("prefer_overlap_with_compute", True),
    ("sl_idx", None), ("num_allocated_qps", 0), ("num_cpu_timeout_secs", 300), ("num_gpu_timeout_secs", 100),
    ("explicitly_destroy", False),
]  # fmt: skip
DISPATCH_25 = [
    ("x", E), ("topk_idx", None), ("topk_weights", None), ("cumulative_local_expert_recv_stats", None),
    ("num_experts", None), ("num_max_tokens_per_rank", None), ("expert_alignment", None), ("num_sms", 0),
    ("num_qps", 0), ("previous_event", None), ("async_with_compute_stream", False),
    ("allocate_on_comm_stream", False), ("handle", None), ("do_handle_copy", False), ("do_cpu_sync", None),
    ("do_expand", False), ("do_zero_padding", False), ("use_tma_aligned_col_major_sf", False),
    ("defer_epilogue", False), ("borrow_recv", False),
]  # fmt: skip
COMBINE_25 = [
    ("x", E), ("handle", E), ("topk_weights", None), ("bias", None), ("num_sms", 0), ("num_qps", 0),
    ("previous_event", None), ("async_with_compute_stream", False), ("allocate_on_comm_stream", False),
    ("defer_epilogue", False),
]  # fmt: skip


def _params(fn):
    ps = list(inspect.signature(fn).parameters.values())[1:]
    return [(p.name, p.default) for p in ps if p.kind is not inspect.Parameter.KEYWORD_ONLY]


def test_epbuffer_signatures_are_deepep_2_5s():
    from ep_torch import EPBuffer

    assert _params(EPBuffer.__init__) == CTOR_25
    assert _params(EPBuffer.dispatch) == DISPATCH_25
    assert _params(EPBuffer.combine) == COMBINE_25
    sms = inspect.signature(EPBuffer.get_theoretical_num_sms).parameters
    assert [(n, p.default) for n, p in sms.items()][1:] == [
        ("num_experts", E), ("num_topk", E), ("num_scaleout_topk", 0), ("rdma_gbs", 0), ("nvlink_gbs", 0),
        ("sm_read_gbs", 0), ("sm_write_gbs", 0),
    ]  # fmt: skip
    barrier = inspect.signature(EPBuffer.barrier).parameters
    assert [(n, p.default) for n, p in barrier.items()][1:] == [
        ("wait_comm_stream", True), ("with_cpu_sync", False), ("sequential", True), ("context_idx", None),
    ]  # fmt: skip
    # ep's own parameters stay reachable by name
    kw_only = {
        n for n, p in inspect.signature(EPBuffer.__init__).parameters.items() if p.kind is p.KEYWORD_ONLY
    }
    assert kw_only == {"num_cpu_bytes", "transport"}
    kw_only = {
        n for n, p in inspect.signature(EPBuffer.dispatch).parameters.items() if p.kind is p.KEYWORD_ONLY
    }
    assert kw_only == {"previous_event_before_epilogue", "zero_copy"}


def test_top_level_names_are_deepep_2_5s():
    import ep_torch

    for name in ("destroy_all_managed_nccl_comm", "get_physical_domain_size", "get_logical_domain_size"):
        assert name in ep_torch.__all__ and getattr(ep_torch, name) is getattr(ep_torch.comm, name), name


def test_deterministic_sort_permutes_the_receive_views_row_indices():
    """DeepEP 2.5's `EPHandle.deterministic_sort(..., channel_linked_list, recv_row_indices)`: the view's row
    indices follow `recv_x` (ep_core.handle)."""
    from ep_torch import EPHandle

    assert list(inspect.signature(EPHandle.deterministic_sort).parameters)[1:] == [
        "do_cpu_sync", "is_cached_dispatch", "recv_x", "recv_sf", "recv_topk_idx", "recv_topk_weights",
        "channel_linked_list", "recv_row_indices",
    ]  # fmt: skip
    perm = torch.tensor([3, 0, 2, 1])
    meta = torch.zeros(4, 4, dtype=torch.int32)
    meta[:, 0] = perm.to(torch.int32)  # source ids out of order: the sort puts rows in source order
    h = EPHandle(
        False, 4, 1, 4, 2, torch.zeros(4, 2, dtype=torch.int64), 4, 4, [4],
        torch.tensor([4], dtype=torch.int32), torch.tensor([4], dtype=torch.int32), None, meta, None,
    )  # fmt: skip
    recv_x = perm.to(torch.float32).unsqueeze(1).repeat(1, 8)
    rows = perm.clone().to(torch.int64)
    h.deterministic_sort(True, False, recv_x, None, None, None, None, rows)
    assert torch.equal(rows, torch.arange(4)) and torch.equal(
        recv_x[:, 0], torch.arange(4, dtype=torch.float32)
    )


def test_buffer_base_gives_a_subclass_deepeps_members(capsys):
    from ep_torch import BufferBase

    class Runtime:
        main_context = "ctx"
        destroyed = False

        def print_memory_usage(self):
            print("usage")

        def destroy(self):
            Runtime.destroyed = True

    class Mine(BufferBase):
        def __init__(self, explicitly_destroy):
            super().__init__(explicitly_destroy)
            self.runtime = Runtime()

        def destroy(self):
            super().destroy()

    with pytest.raises(RuntimeError, match="explicitly_destroy"):
        Mine(False).destroy()
    b = Mine(True)
    assert b.main_context == "ctx" and isinstance(b, BufferBase)
    b.print_memory_usage()
    assert capsys.readouterr().out == "usage\n"
    b.destroy()
    assert Runtime.destroyed and b.runtime is None and b.main_context is None
    with pytest.raises(RuntimeError, match="no runtime"):
        b.print_memory_usage()
    with pytest.raises(TypeError):
        BufferBase()  # abstract: destroy()


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def _inputs(n: int, tokens: int, hidden: int, experts: int, topk: int):
    """Every rank's inputs (the same on every rank: each computes the reference for all)."""
    g = torch.Generator().manual_seed(29)
    xs, idxs, ws = [], [], []
    for r in range(n):
        t = tokens + r
        xs.append((torch.randn(t, hidden, generator=g) * 3).to(torch.bfloat16))
        rows = [torch.randperm(experts, generator=g)[:topk] for _ in range(t)]
        idx = torch.stack(rows).to(torch.int64) if rows else torch.zeros(0, topk, dtype=torch.int64)
        idx[::4, -1] = -1
        idxs.append(idx)
        ws.append(torch.rand(t, topk, generator=g))
    return xs, idxs, ws


def _ranks(rank: int, n: int) -> None:
    import ep_torch
    from ep_core import reference
    from ep_torch import comm

    group = dist.group.WORLD
    su = int(os.environ.get("EPKIT_SCALEUP_RANKS") or n)
    hidden, topk, experts, m = 64, 2, 2 * n, 16
    # the constructor's positional sizes are 2.5's: (group, num_bytes, num_max_tokens_per_rank, hidden, num_topk)
    buf = ep_torch.EPBuffer(group, None, m, hidden, topk)
    assert (buf.num_max_tokens_per_rank, buf.num_cpu_bytes, buf.sl_idx) == (m, 0, 3)
    assert buf.num_bytes == ep_torch.EPBuffer.get_buffer_size_hint(group, m, hidden, topk)
    assert buf.context is buf.main_context and buf.context.rank_idx == rank and buf.context.num_ranks == n
    assert buf.context.get_physical_domain_size() == buf.get_physical_domain_size() == (n // su, su)
    assert comm.get_logical_domain_size(buf) == buf.get_logical_domain_size()
    assert buf.get_theoretical_num_sms(experts, topk) == buf.get_theoretical_num_sms(
        experts, topk, 0, 0, 0, 180, 45
    )  # DeepEP 2.5's per-SM rates
    # 2.5's per-SM rates (180 read, 45 write): 400 GB/s -> ceil(max(400/180, 400/45)) = 9 -> 10 (V2's 200/50: 8)
    assert buf.lb_get_theoretical_num_sms() == 10
    buf.barrier(False, True)
    comm.barrier(buf, context_idx=0)
    with pytest.raises(ValueError, match="context"):
        comm.barrier(buf, context_idx=1)
    buf.print_memory_usage()

    for tokens in (0, 7):
        xs, idxs, ws = _inputs(n, tokens, hidden, experts, topk)
        refs = reference.dispatch(
            [_bits(x) for x in xs], [i.numpy() for i in idxs], [w.numpy() for w in ws],
            num_experts=experts, num_max_tokens_per_rank=m, expert_alignment=1, do_expand=False,
            num_scaleup_ranks=buf.num_scaleup_ranks,
        )  # fmt: skip
        x, idx, w = xs[rank], idxs[rank], ws[rank]
        # 2.5's positional order: ..., num_sms, num_qps, previous_event, async_with_compute_stream, ...
        recv_x, recv_idx, recv_w, handle, _ = buf.dispatch(x, idx, w, None, experts, m, 1, 0, 0, None, False)
        ref = refs[rank]
        assert np.array_equal(_bits(recv_x), ref.recv_x)
        assert np.array_equal(recv_idx.numpy(), ref.recv_topk_idx)
        assert np.array_equal(recv_w.numpy(), ref.recv_topk_weights)
        assert handle.topk_idx is idx  # do_handle_copy=False by default, as 2.5
        # an odd SM count is rounded up to even, as 2.5 (the handle keeps it); the rows are the same
        odd = buf.dispatch(x, idx, w, None, experts, m, 1, 3)
        assert odd[3].num_sms == 4 and torch.equal(odd[0].view(torch.int16), recv_x.view(torch.int16))
        y = recv_x.float().mul(1.5).to(torch.bfloat16)
        ys = [
            torch.from_numpy(o.recv_x.view(np.int16)).view(torch.bfloat16).float().mul(1.5).to(torch.bfloat16)
            for o in refs
        ]
        ref_c = reference.combine([_bits(t) for t in ys], [o.handle for o in refs], topk_weights=[
            o.recv_topk_weights for o in refs
        ], num_scaleup_ranks=buf.num_scaleup_ranks)[rank]  # fmt: skip
        assert torch.equal(y, ys[rank])
        # combine's positional order: x, handle, topk_weights, bias, num_sms, num_qps, previous_event, async, alloc
        cx, cw, _ = buf.combine(y, handle, recv_w, None, 0, 0, None, False, False)
        assert np.array_equal(_bits(cx), ref_c.combined_x)
        assert np.array_equal(cw.numpy(), ref_c.combined_topk_weights)
        # defer_epilogue in its 2.5 position (19th of dispatch, 10th of combine), with async_with_compute_stream
        ev = buf.dispatch(x, idx, w, None, experts, m, 1, 0, 0, None, True, False, None, False, None, False,
                          False, False, True)  # fmt: skip
        assert isinstance(ev, ep_torch.EventOverlap)
        d_x, _, d_w, d_handle = ev.current_stream_wait()
        assert torch.equal(d_x.view(torch.int16), recv_x.view(torch.int16)) and d_handle.topk_idx is idx
        ev = buf.combine(y, d_handle, d_w, None, 0, 0, None, True, False, True)
        c2x, c2w = ev.current_stream_wait()
        assert torch.equal(c2x.view(torch.int16), cx.view(torch.int16)) and torch.equal(c2w, cw)

    # borrow_recv in its 2.5 position (20th): one NVLink domain only; lb_* refused while the view is out
    xs, idxs, ws = _inputs(n, 5, hidden, experts, topk)
    args = (xs[rank], idxs[rank], ws[rank], None, experts, m, 1, 0, 0, None, False, False, None, False, None,
            False, False, False, False, True)  # fmt: skip
    if su < n:
        with pytest.raises(ValueError, match="one NVLink domain"):
            buf.dispatch(*args)
    else:
        view, _, _, handle, _ = buf.dispatch(*args)
        assert isinstance(view, ep_torch.DispatchRecvView)
        with pytest.raises(RuntimeError, match="DispatchRecvView"):
            buf.lb_prefetch_weights(torch.zeros(1), torch.zeros(1), torch.zeros(1, dtype=torch.int32))
        with pytest.raises(RuntimeError, match="DispatchRecvView"):
            buf.lb_reduce_grads(torch.zeros(1), torch.zeros(1), torch.zeros(1, dtype=torch.int32))
        view.release()
        assert "lb_prefetch_weights" not in buf.__dict__ and "dispatch" not in buf.__dict__
    # an explicit do_handle_copy=True still copies (ep accepts it; DeepEP 2.5 refuses it)
    _, _, _, h, _ = buf.dispatch(xs[rank], idxs[rank], ws[rank], num_experts=experts, do_handle_copy=True)
    assert h.topk_idx is not idxs[rank] and torch.equal(h.topk_idx, idxs[rank])
    buf.barrier()

    # ElasticBuffer keeps V2's order: (group, num_bytes, num_cpu_bytes, num_max_tokens_per_rank, hidden, ...)
    v2 = ep_torch.ElasticBuffer(group, None, 0, m, hidden, topk, explicitly_destroy=True)
    assert v2.num_max_tokens_per_rank == m
    v2.destroy()

    # V1's internode_dispatch / internode_combine (DeepEP's parameters): dispatch / combine across nodes
    v1 = ep_torch.Buffer(group, int(1e8), 0, explicitly_destroy=True)
    x, idx, w = xs[rank], idxs[rank], ws[rank]
    ntr, ntrr, nte, itr, _ = v1.get_dispatch_layout(idx, experts)
    cfg = ep_torch.Buffer.get_dispatch_config(n)
    if su < n:
        got = v1.internode_dispatch(x, None, ntr, ntrr, itr, nte, idx, w, 1, cfg, None, False, False)
        want = v1.dispatch(x, None, ntr, ntrr, itr, nte, idx, w, 1, 0, cfg)
        assert torch.equal(got[0].view(torch.int16), want[0].view(torch.int16)) and torch.equal(
            got[1], want[1]
        )
        assert torch.equal(got[2], want[2]) and got[3] == want[3] and len(got[4]) == 10
        cx, cw, _ = v1.internode_combine(got[0], got[4], got[2], None, None, None, False, False)
        wx, ww, _ = v1.combine(want[0], want[4], want[2])
        assert torch.equal(cx.view(torch.int16), wx.view(torch.int16)) and torch.equal(cw, ww)
    else:
        with pytest.raises(ValueError, match="one NVLink domain"):
            v1.internode_dispatch(x, None, ntr, ntrr, itr, nte, idx, w, 1, cfg)
        with pytest.raises(ValueError, match="one NVLink domain"):
            v1.internode_combine(x, None)
    v1.destroy()

    # the BufferBase members of the other 2.5 buffers
    pp = ep_torch.PPBuffer(group, 1024, 2, explicitly_destroy=True)
    assert pp.main_context.num_ranks == n and pp.nccl_comm_handle is None
    pp.destroy()
    assert pp.main_context is None
    eg = ep_torch.EngramBuffer(group, 2 << 20, 2 << 20, False, 1, 1, explicitly_destroy=True)
    assert (
        eg.context.get_logical_domain_size() == eg.get_logical_domain_size() and eg.nccl_comm_handle is None
    )
    eg.barrier(wait_comm_stream=False, with_cpu_sync=True)
    comm.barrier(eg, context_idx=0)
    eg.destroy()
    assert eg.context is None and eg.main_context is None
    pairs = [dist.new_group([a, a + 1]) for a in range(0, n, 2)][rank // 2]  # every rank makes every group
    if su == n:  # a BucketBuffer lives in one NVLink domain
        bk = ep_torch.BucketBuffer([group, pairs], 2 << 20, explicitly_destroy=True)
        assert bk.main_context is bk.contexts[0] and bk.nccl_comm_handles == [None, None]
        session = bk.session()
        assert session.collective_methods == ("all_gather", "reduce_scatter", "all_reduce")
        assert session.alignment == 256 and session.buffer is bk  # DeepEP's sessions: 64
        comm.barrier(bk, context_idx=1)
        comm.barrier(bk, True, False, True, 0)
        with pytest.raises(ValueError, match="context_idx"):
            comm.barrier(bk, context_idx=2)
        bk.destroy()
        assert bk.main_context is None and bk.nccl_comm_handles is None
    dist.barrier()


@pytest.mark.parametrize(("ranks", "scaleup"), [(2, None), (4, None), (4, "2")], ids=["2", "4", "4-2-nodes"])
def test_epbuffer_25_calls_on_gloo_ranks(ranks, scaleup):
    env = {k: v for k, v in os.environ.items() if k != "EPKIT_SCALEUP_RANKS"}
    env["EPKIT_NVLINK_GBS"] = "400"
    if scaleup is not None:
        env["EPKIT_SCALEUP_RANKS"] = scaleup
    from ep_torch_testing import run_script  # loaded by conftest.py

    code, out = run_script(__file__, ["_ranks", str(ranks)], 300, env=env, what=f"{ranks} ranks: ")
    assert code == 0, out[-4000:]


if __name__ == "__main__":
    from ep_torch_testing import spawn_cpu

    spawn_cpu(globals()[sys.argv[1]], int(sys.argv[2]))
