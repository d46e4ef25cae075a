"""EPBuffer + ReferenceExecutor end to end: N ranks in threads, every mode, compared with ep_core.reference."""

from __future__ import annotations

import ep_core as ec
import numpy as np
import pytest
from ep_core import reference as ref
from ep_core import routing
from ep_core.errors import EPPeerError

N, M, H, E, K = 4, 8, 64, 16, 4
TOKENS = [8, 5, 0, 7]


def run_ranks(fn, n=N):
    """fn(rank, bootstrap) in n threads; the results (the first error re-raised)."""
    return ec.ThreadGroup(n, timeout_secs=60).run(fn)


def _np(a):
    return None if a is None else np.array(ec.to_numpy(a))


@pytest.mark.parametrize("expand", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("cpu_sync", [True, False])
@pytest.mark.parametrize("num_bias", [0, 2])
def test_round_trip_matches_reference(expand, fp8, cpu_sync, num_bias):
    inp = routing.make_inputs(N, TOKENS, H, E, K, seed=5, masked_ratio=0.2, fp8=fp8, num_sf_packs=2)
    rng = np.random.default_rng(9)
    biases = [tuple(routing.random_bf16((t, H), rng) for _ in range(num_bias)) for t in TOKENS]
    a = 4

    def rank_fn(r, boot):
        buf = ec.EPBuffer(
            boot,
            transport="reference",
            num_max_tokens_per_rank=M,
            hidden=H,
            num_topk=K,
            deterministic=True,
            explicitly_destroy=True,
        )
        x = (
            (ec.host_array(inp.xs[r], "float8_e4m3fn"), ec.host_array(inp.sfs[r]))
            if fp8
            else ec.host_array(inp.xs[r], "bfloat16")
        )
        stats = ec.host_array(np.zeros(E // N, np.int32))
        out = buf.dispatch(
            x,
            ec.host_array(inp.topk_idxs[r]),
            ec.host_array(inp.topk_weights[r]),
            num_experts=E,
            expert_alignment=a,
            do_expand=expand,
            do_zero_padding=expand,
            do_cpu_sync=cpu_sync,
            use_tma_aligned_col_major_sf=fp8,
            cumulative_local_expert_recv_stats=stats,
        )
        cached = buf.dispatch(
            x,
            None,
            ec.host_array(inp.topk_weights[r]),
            handle=out.handle,
            do_expand=expand,
            do_zero_padding=expand,
            use_tma_aligned_col_major_sf=fp8,
        )
        # expert outputs: the received rows themselves (identity experts), bf16
        y = (
            out.recv_x
            if not fp8
            else ec.host_array(
                routing.random_bf16(
                    (np.asarray(ec.to_numpy(out.recv_x)).shape[0], H), np.random.default_rng(r)
                ),
                "bfloat16",
            )
        )
        b = tuple(ec.host_array(v, "bfloat16") for v in biases[r])
        bias = b or None
        comb = buf.combine(y, out.handle, out.recv_topk_weights, bias)
        buf.destroy()
        return out, cached, y, comb, _np(stats)

    results = run_ranks(rank_fn)
    want = ref.dispatch(
        inp.x_args,
        inp.topk_idxs,
        inp.topk_weights,
        num_experts=E,
        num_max_tokens_per_rank=M,
        expert_alignment=a,
        do_expand=expand,
        do_cpu_sync=cpu_sync,
        do_zero_padding=expand,
    )
    ys = [_np(res[2]) for res in results]
    bias_arg = [b or None for b in biases]
    want_c = ref.combine(
        ys, [w.handle for w in want], topk_weights=[w.recv_topk_weights for w in want], bias=bias_arg
    )
    for r, (out, cached, _, comb, stats) in enumerate(results):
        w = want[r]
        assert _np(out.recv_x).tobytes() == w.recv_x.tobytes()
        assert _np(cached.recv_x).tobytes() == w.recv_x.tobytes()
        assert cached.handle is out.handle
        if fp8:
            sf = _np(out.recv_sf)
            rows = w.recv_sf.shape[0]
            assert sf.shape == (2, ref.align(rows, 4))
            assert sf.T[:rows].tobytes() == np.ascontiguousarray(w.recv_sf).tobytes()
        if expand:
            assert out.recv_topk_idx is None
        else:
            assert (_np(out.recv_topk_idx) == w.recv_topk_idx).all()
        assert _np(out.recv_topk_weights).tobytes() == w.recv_topk_weights.tobytes()
        h = out.handle
        for name in (
            "psum_num_recv_tokens_per_scaleup_rank",
            "psum_num_recv_tokens_per_expert",
            "num_unaligned_recv_tokens_per_expert",
            "recv_src_metadata",
            "dst_buffer_slot_idx",
        ):
            assert (_np(getattr(h, name)) == getattr(w.handle, name)).all(), name
        assert h.num_recv_tokens_per_expert_list == w.handle.num_recv_tokens_per_expert_list
        assert (h.num_recv_tokens, h.num_expanded_tokens) == (
            w.handle.num_recv_tokens,
            w.handle.num_expanded_tokens,
        )
        assert (stats == w.handle.num_unaligned_recv_tokens_per_expert).all()
        assert _np(comb.combined_x).tobytes() == want_c[r].combined_x.tobytes()
        assert _np(comb.combined_topk_weights).tobytes() == inp.topk_weights[r].tobytes()


def test_bad_expert_ids_raise_on_every_rank():
    inp = routing.make_inputs(2, 4, H, 8, 2, seed=1)
    inp.topk_idxs[1][0, 0] = 8

    def rank_fn(r, boot):
        buf = ec.EPBuffer(boot, transport="reference", num_max_tokens_per_rank=M, hidden=H, num_topk=2)
        # rank 1 raises its own error; rank 0 an EPPeerError naming rank 1, the token and the lane (issue 14)
        err, pat = (ec.EPValueError, "out of range") if r == 1 else (EPPeerError, r"rank 1.*token 0, lane 0")
        with pytest.raises(err, match=pat):
            buf.dispatch(
                ec.host_array(inp.xs[r], "bfloat16"), ec.host_array(inp.topk_idxs[r]), None, num_experts=8
            )
        return True

    assert run_ranks(rank_fn, 2) == [True, True]


def test_single_rank_local_bootstrap():
    inp = routing.make_inputs(1, 3, H, 4, 2, seed=2)
    buf = ec.EPBuffer(
        ec.LocalBootstrap(), transport=ec.ReferenceTransport(), num_max_tokens_per_rank=4, hidden=H
    )
    out = buf.dispatch(
        ec.host_array(inp.xs[0], "bfloat16"),
        ec.host_array(inp.topk_idxs[0].astype(np.int32)),
        ec.host_array(inp.topk_weights[0]),
        num_experts=4,
        do_handle_copy=False,
    )
    assert out.handle.topk_idx is not None and ec.describe(out.handle.topk_idx).dtype == "int32"
    comb = buf.combine(out.recv_x, out.handle)
    assert _np(comb.combined_x).tobytes() == inp.xs[0].tobytes()  # one rank: the token comes back unchanged
    assert comb.combined_topk_weights is None
    buf.destroy()


@pytest.mark.parametrize("amr", [True, False])
def test_hybrid_topology_through_the_buffer(amr):
    n, nvl = 4, 2
    inp = routing.make_inputs(n, [8, 6, 8, 3], H, E, K, seed=13, masked_ratio=0.1)

    def rank_fn(r, boot):
        buf = ec.EPBuffer(
            boot,
            transport=ec.ReferenceTransport(num_nvlink_ranks=nvl),
            num_max_tokens_per_rank=M,
            hidden=H,
            num_topk=K,
            allow_multiple_reduction=amr,
            num_allocated_qps=65,
        )
        assert buf.get_logical_domain_size() == (2, 2)
        out = buf.dispatch(
            ec.host_array(inp.xs[r], "bfloat16"),
            ec.host_array(inp.topk_idxs[r]),
            None,
            num_experts=E,
            do_expand=True,
            expert_alignment=2,
        )
        y = ec.host_array(
            routing.random_bf16(tuple(ec.describe(out.recv_x).shape), np.random.default_rng(r)), "bfloat16"
        )
        comb = buf.combine(y, out.handle)
        buf.destroy()
        return out, _np(y), comb

    results = run_ranks(rank_fn, n)
    want = ref.dispatch(
        inp.xs,
        inp.topk_idxs,
        None,
        num_experts=E,
        num_max_tokens_per_rank=M,
        do_expand=True,
        expert_alignment=2,
        num_scaleup_ranks=nvl,
    )
    want_c = ref.combine(
        [res[1] for res in results],
        [w.handle for w in want],
        allow_multiple_reduction=amr,
        num_scaleup_ranks=nvl,
    )
    for r, (out, _, comb) in enumerate(results):
        assert _np(out.handle.psum_num_recv_tokens_per_scaleup_rank).shape == (nvl,)
        assert _np(out.recv_x).tobytes() == want[r].recv_x.tobytes()
        assert _np(comb.combined_x).tobytes() == want_c[r].combined_x.tobytes()


def test_reset_is_a_collective_and_the_buffer_works_after_it():
    inp = routing.make_inputs(2, 4, H, 8, 2, seed=3)
    calls = []

    def rank_fn(r, boot):
        buf = ec.EPBuffer(boot, transport="reference", num_max_tokens_per_rank=M, hidden=H, num_topk=2)
        allgather = buf.executor.bootstrap.allgather  # reset is an enveloped exchange (ep_core.envelope)

        def counted(data):
            calls.append(r)
            return allgather(data)

        buf.executor.bootstrap.allgather = counted
        buf.reset()
        out = buf.dispatch(
            ec.host_array(inp.xs[r], "bfloat16"), ec.host_array(inp.topk_idxs[r]), None, num_experts=8
        )
        comb = buf.combine(out.recv_x, out.handle)
        buf.destroy()
        with pytest.raises(ec.EPStateError):
            buf.reset()
        return _np(comb.combined_x).shape

    assert run_ranks(rank_fn, 2) == [(4, H), (4, H)]
    assert sorted(calls[:2]) == [0, 1]  # every rank met the others in reset


def test_reset_needs_an_executor_that_can_reset():
    class NoReset:
        array_device, device_id, num_device_sms = "cpu", 0, 132

        def dispatch(self, req): ...
        def combine(self, req): ...
        def barrier(self): ...
        def destroy(self): ...

    buf = ec.EPBuffer(
        ec.LocalBootstrap(), transport="reference", num_max_tokens_per_rank=4, hidden=H, executor=NoReset()
    )
    with pytest.raises(ec.EPStateError, match="cannot be reset"):
        buf.reset()
