"""EPBuffer's zero-copy combine on the reference backend (N ranks in threads): `combine_buffer(handle)` is where a
rank writes its expert outputs, `combine(buffer, handle, zero_copy=True)` gives the ordinary combine's bits; the
refusals name the argument, and a refusal on one rank reaches its peers instead of leaving them waiting."""

from __future__ import annotations

import ep_core as ec
import numpy as np
import pytest
from ep_core import reference, routing
from ep_core.errors import EPPeerError

N, M, H, E, K = 3, 8, 64, 12, 4
TOKENS = [8, 5, 0]


def _buffer(boot):
    return ec.EPBuffer(
        boot, transport="reference", num_max_tokens_per_rank=M, hidden=H, num_topk=K, explicitly_destroy=True
    )


def _dispatch(buf, inp, r, **kw):
    return buf.dispatch(
        ec.host_array(inp.xs[r], "bfloat16"),
        ec.host_array(inp.topk_idxs[r]),
        ec.host_array(inp.topk_weights[r]),
        num_experts=E,
        **kw,
    )


@pytest.mark.parametrize("cpu_sync", [True, False])
def test_zero_copy_combine_equals_the_combine(cpu_sync: bool) -> None:
    inp = routing.make_inputs(N, TOKENS, H, E, K, seed=3, masked_ratio=0.25)
    rng = np.random.default_rng(4)
    bias = [routing.random_bf16((t, H), rng) for t in TOKENS]

    def rank_fn(r, boot):
        buf = _buffer(boot)
        try:
            out = _dispatch(buf, inp, r, do_cpu_sync=cpu_sync)
            rows = out.recv_x.shape[0]
            y = routing.random_bf16((rows, H), np.random.default_rng(10 + r))
            zc = buf.combine_buffer(out.handle)
            assert zc.shape == (rows, H) and zc.dtype == "bfloat16"
            ec.to_numpy(zc)[:] = y  # the expert GEMM writes here
            got = buf.combine(zc, out.handle, bias=ec.host_array(bias[r], "bfloat16"), zero_copy=True)
            want = buf.combine(
                ec.host_array(y, "bfloat16"), out.handle, bias=ec.host_array(bias[r], "bfloat16")
            )
            assert got.combined_topk_weights is None
            return np.array(ec.to_numpy(got.combined_x)), np.array(ec.to_numpy(want.combined_x))
        finally:
            buf.destroy()

    for r, (got, want) in enumerate(ec.ThreadGroup(N, timeout_secs=60).run(rank_fn)):
        assert np.array_equal(got, want), f"rank {r}"
    # and the ordinary combine is the reference's (test_core_executor); here once more for this routing
    ref = reference.dispatch(
        inp.xs, inp.topk_idxs, inp.topk_weights, num_experts=E, num_max_tokens_per_rank=M, do_cpu_sync=True
    )
    assert ref[0].handle.do_expand is False


def test_refusals_name_the_argument_and_reach_the_peers() -> None:
    inp = routing.make_inputs(N, TOKENS, H, E, K, seed=6)

    def rank_fn(r, boot):
        buf = _buffer(boot)
        try:
            out = _dispatch(buf, inp, r)
            expanded = _dispatch(buf, inp, r, do_expand=True)
            zc = buf.combine_buffer(out.handle)
            with pytest.raises(
                ValueError, match="handle: a zero-copy combine needs the handle of a non-expanded"
            ):
                buf.combine_buffer(expanded.handle)
            with pytest.raises(TypeError, match="zero_copy: expected a bool"):
                buf.combine(zc, out.handle, zero_copy=1)
            with pytest.raises(ValueError, match="topk_weights: a zero-copy combine sends nothing back"):
                buf.combine(zc, out.handle, out.recv_topk_weights, zero_copy=True)
            # rank 1 passes an array of its own: it raises, and its peers raise EPPeerError naming it
            x = zc if r != 1 else ec.host_array(np.zeros(zc.shape, np.uint16), "bfloat16")
            try:
                buf.combine(x, out.handle, zero_copy=True)
            except ValueError as e:
                assert r == 1 and "x: a zero-copy combine reads rank 1's combine buffer" in str(e)
                return "refused"
            except EPPeerError as e:
                assert "rank 1" in str(e)
                return "peer"
            return "ran"
        finally:
            buf.destroy()

    assert ec.ThreadGroup(N, timeout_secs=60).run(rank_fn, raise_first=False) == ["peer", "refused", "peer"]
