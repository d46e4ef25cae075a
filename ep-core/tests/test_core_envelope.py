"""The operation envelope (ep_core.envelope, issue 14) on ThreadGroup ranks with the reference executor: every
disagreement raises on every rank, a one-rank error is announced to the peers, waits are bounded."""

from __future__ import annotations

import pickle
import time

import ep_core as ec
import numpy as np
import pytest
from ep_core import routing
from ep_core.envelope import Envelope, check_envelopes
from ep_core.errors import EPMismatchError, EPPeerError

H, K, E = 32, 2, 8


def run_ranks(fn, n=2, timeout_secs=10.0):
    """fn(rank, bootstrap) in n threads, each rank's result or the exception it raised; bounded (no hang)."""
    return ec.ThreadGroup(n, timeout_secs=timeout_secs).run(
        fn, raise_first=False, join_timeout_secs=timeout_secs * 3
    )


def _buf(boot, m=8):
    return ec.EPBuffer(boot, transport="reference", num_max_tokens_per_rank=m, hidden=H, num_topk=K)


def _args(inp, r):
    return ec.host_array(inp.xs[r], "bfloat16"), ec.host_array(inp.topk_idxs[r])


def test_check_envelopes_names_ranks_and_fields():
    a = Envelope(3, "dispatch", (("hidden", 32), ("num_experts", 8)))
    b = Envelope(3, "dispatch", (("hidden", 32), ("num_experts", 16)))
    check_envelopes([a, a], 0)
    with pytest.raises(EPMismatchError, match=r"num_experts differs \(rank 0: 8, rank 1: 16\)") as info:
        check_envelopes([a, b], 1)
    assert info.value.fields == {"num_experts": [8, 16]}
    with pytest.raises(EPMismatchError, match="operation differs"):
        check_envelopes([a, Envelope(3, "combine")], 0)
    with pytest.raises(EPMismatchError, match="step differs"):
        check_envelopes([a, Envelope(4, "dispatch", a.config)], 0)
    abort = Envelope(3, "dispatch", abort="dispatch: EPTypeError: bad")
    check_envelopes([abort, a], 0)  # the aborting rank raises its own error, not this one
    with pytest.raises(EPPeerError, match="rank 0 abandoned the operation") as peer:
        check_envelopes([abort, a], 1)
    assert peer.value.ranks == (0,)
    again = pickle.loads(pickle.dumps(peer.value))
    assert isinstance(again, EPPeerError) and again.ranks == (0,)


def test_one_rank_validation_error_is_announced_and_ranks_stay_in_step():
    inp = routing.make_inputs(2, 4, H, E, K, seed=1)
    want = ec.reference.dispatch(inp.xs, inp.topk_idxs, None, num_experts=E, num_max_tokens_per_rank=8)

    def rank_fn(r, boot):
        buf = _buf(boot)
        x, i = _args(inp, r)
        seen = []
        try:  # rank 0 passes a bad stream: its own error; rank 1 an EPPeerError naming rank 0
            buf.dispatch(x, i, None, num_experts=E, stream="abc" if r == 0 else 0)
        except Exception as exc:
            seen.append(exc)
        out = buf.dispatch(x, i, None, num_experts=E)
        return seen, np.array(ec.to_numpy(out.recv_x), copy=True)

    (s0, x0), (s1, x1) = run_ranks(rank_fn)
    assert isinstance(s0[0], ec.EPTypeError) and "stream" in str(s0[0])
    assert isinstance(s1[0], EPPeerError) and "rank 0" in str(s1[0]) and "stream" in str(s1[0])
    assert x0.tobytes() == want[0].recv_x.tobytes() and x1.tobytes() == want[1].recv_x.tobytes()


def test_mismatched_num_experts_and_handles_raise_on_every_rank():
    inp = routing.make_inputs(2, 4, H, E, K, seed=2)  # ids < 8: valid for either count

    def rank_fn(r, boot):
        buf = _buf(boot, m=16)
        x, i = _args(inp, r)
        with pytest.raises(EPMismatchError, match="num_experts differs"):
            buf.dispatch(x, i, None, num_experts=16 if r == 0 else 8)
        with pytest.raises(ec.EPStateError, match=r"refused.*until reset"):  # out of step: nothing pairs now
            buf.dispatch(x, i, None, num_experts=16)
        buf.reset()  # every rank: in step again
        a = buf.dispatch(x, i, None, num_experts=16)
        b = buf.dispatch(x, i, None, num_experts=16, num_max_tokens_per_rank=8)
        h, recv = (a.handle, a.recv_x) if r == 0 else (b.handle, b.recv_x)
        with pytest.raises(EPMismatchError, match="handle differs"):  # handles of different dispatches / M
            buf.combine(recv, h)
        buf.reset()
        with pytest.raises(ec.EPStateError, match="stale"):  # a handle from before the reset
            buf.combine(a.recv_x, a.handle)
        a = buf.dispatch(x, i, None, num_experts=16)
        return buf.combine(a.recv_x, a.handle).combined_x is not None

    assert run_ranks(rank_fn) == [True, True]


def test_bias_or_weights_on_one_rank_only_is_a_mismatch_not_a_key_error():
    inp = routing.make_inputs(2, 4, H, E, K, seed=6)

    def rank_fn(r, boot):
        buf = _buf(boot)
        x, i = _args(inp, r)
        w = ec.host_array(np.ascontiguousarray(inp.topk_weights[r], dtype=np.float32))
        with pytest.raises(EPMismatchError, match="topk_weights differs"):
            buf.dispatch(x, i, w if r == 0 else None, num_experts=E)
        buf.reset()
        out = buf.dispatch(x, i, None, num_experts=E)
        bias = ec.host_array(np.zeros((4, H), dtype=np.uint16), "bfloat16")
        with pytest.raises(EPMismatchError, match="bias differs"):
            buf.combine(out.recv_x, out.handle, bias=bias if r == 1 else None)
        buf.reset()
        out = buf.dispatch(x, i, None, num_experts=E)
        return buf.combine(out.recv_x, out.handle).combined_x is not None

    assert run_ranks(rank_fn) == [True, True]


def test_barrier_against_dispatch_is_a_mismatch():
    inp = routing.make_inputs(2, 4, H, E, K, seed=3)

    def rank_fn(r, boot):
        buf = _buf(boot)
        x, i = _args(inp, r)
        with pytest.raises(EPMismatchError, match="operation differs"):
            buf.barrier() if r == 0 else buf.dispatch(x, i, None, num_experts=E)
        buf.reset()
        buf.barrier()
        return True

    assert run_ranks(rank_fn) == [True, True]


def test_thread_group_timeout_names_its_own_knob():
    group = ec.ThreadGroup(2, timeout_secs=0.2)
    boot = group.bootstraps()[0]
    t0 = time.monotonic()
    with pytest.raises(ec.EPTimeoutError, match=r"ThreadGroup\(timeout_secs=") as info:
        boot.barrier()
    assert time.monotonic() - t0 < 5
    assert "does not apply to a ThreadGroup" in str(info.value)


def test_meta_tensor_and_bad_stream_name_the_argument():
    torch = pytest.importorskip("torch")
    buf = _buf(ec.LocalBootstrap())
    inp = routing.make_inputs(1, 4, H, E, K, seed=4)
    x, i = _args(inp, 0)
    with pytest.raises(
        ec.EPTypeError, match=r"x: expected a CPU or CUDA array, got one on the 'meta' device"
    ):
        buf.dispatch(torch.empty(4, H, dtype=torch.bfloat16, device="meta"), i, None, num_experts=E)
    with pytest.raises(ec.EPTypeError, match="stream: expected a stream handle"):
        buf.dispatch(x, i, None, num_experts=E, stream="abc")


def test_negative_ids_other_than_minus_one_are_rejected():
    buf = _buf(ec.LocalBootstrap())
    inp = routing.make_inputs(1, 4, H, E, K, seed=5)
    idx = inp.topk_idxs[0].copy()
    idx[2, 1] = -5
    with pytest.raises(ec.EPValueError, match=r"topk_idx\[2, 1\] = -5 on rank 0 \(token 2, lane 1\)"):
        buf.dispatch(ec.host_array(inp.xs[0], "bfloat16"), ec.host_array(idx), None, num_experts=E)
    idx[2, 1] = -1  # -1 is "no expert"
    buf.dispatch(ec.host_array(inp.xs[0], "bfloat16"), ec.host_array(idx), None, num_experts=E)


def test_buffers_built_with_different_sizes_raise_on_every_rank():
    def rank_fn(r, boot):
        with pytest.raises(EPMismatchError, match=r"construct.*hidden differs \(rank 0: 32, rank 1: 64\)"):
            ec.EPBuffer(
                boot, transport="reference", num_max_tokens_per_rank=8, hidden=32 * (r + 1), num_topk=K
            )
        return True

    assert run_ranks(rank_fn) == [True, True]
