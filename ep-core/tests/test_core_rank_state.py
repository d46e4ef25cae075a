"""ep_core.rank_state (issue 41): after a disagreement or a timeout every rank refuses every operation at once until
`reset()`, the one collective that resynchronises; announced errors keep the ranks in step (ThreadGroup ranks,
reference executor)."""

from __future__ import annotations

import time

import ep_core as ec
import numpy as np
import pytest
from ep_core import routing
from ep_core.envelope import Channel
from ep_core.errors import EPMismatchError, EPPeerError, EPStateError, EPTimeoutError
from ep_core.rank_state import RankState, breaks_step

H, K, E = 32, 2, 8


def _buf(boot, m=8):
    return ec.EPBuffer(boot, transport="reference", num_max_tokens_per_rank=m, hidden=H, num_topk=K)


def _args(inp, r):
    return ec.host_array(inp.xs[r], "bfloat16"), ec.host_array(inp.topk_idxs[r])


def _want(inp, r):
    return ec.reference.dispatch(inp.xs, inp.topk_idxs, None, num_experts=E, num_max_tokens_per_rank=8)[r]


def test_breaks_step_tells_announced_errors_apart():
    assert breaks_step(EPMismatchError("x"))
    assert breaks_step(EPTimeoutError(0, "t", 0, 0))
    assert breaks_step(EPPeerError("died", ranks=(1,)))
    assert not breaks_step(EPPeerError("said so", ranks=(1,), announced=True))
    assert not breaks_step(ec.EPValueError("bad"))
    state = RankState(0)
    state.record("dispatch", ec.EPValueError("bad"))
    assert state.failure is None
    state.record("dispatch", EPMismatchError("disagree"))
    with pytest.raises(EPStateError, match=r"refused: .*since dispatch failed .*until reset\(\)"):
        state.refuse("combine")


def test_after_a_skipped_combine_nothing_pairs_until_reset():
    inp = routing.make_inputs(2, 4, H, E, K, seed=5)

    def rank_fn(r, boot):
        buf = _buf(boot)
        x, i = _args(inp, r)
        out = buf.dispatch(x, i, None, num_experts=E)
        seen = []
        try:  # rank 0 skips its combine: its next dispatch meets rank 1's combine
            buf.dispatch(x, i, None, num_experts=E) if r == 0 else buf.combine(out.recv_x, out.handle)
        except Exception as exc:
            seen.append(type(exc).__name__)
        for _ in range(2):  # no silent result: refused at once on every rank
            t0 = time.monotonic()
            try:
                buf.dispatch(x, i, None, num_experts=E)
            except EPStateError as exc:
                seen.append(("refused", "reset()" in str(exc), time.monotonic() - t0 < 0.5))
        buf.reset()
        again = buf.dispatch(x, i, None, num_experts=E)
        return seen, np.array(ec.to_numpy(again.recv_x), copy=True)

    res = ec.ThreadGroup(2, timeout_secs=5).run(rank_fn, join_timeout_secs=30)
    for r, (seen, got) in enumerate(res):
        assert seen[0] == "EPMismatchError", seen
        assert seen[1:] == [("refused", True, True)] * 2, seen
        assert got.tobytes() == _want(inp, r).recv_x.tobytes()


def test_after_a_timeout_calls_fail_fast_and_reset_resynchronises():
    inp = routing.make_inputs(2, 4, H, E, K, seed=6)

    def rank_fn(r, boot):
        buf = _buf(boot)
        x, i = _args(inp, r)
        out = {}
        if r == 1:  # late for the first dispatch: rank 0 times out (and the barrier breaks for both)
            time.sleep(1.3)
        t0 = time.monotonic()
        with pytest.raises(EPTimeoutError):
            buf.dispatch(x, i, None, num_experts=E)
        out["waited"] = time.monotonic() - t0
        t0 = time.monotonic()
        with pytest.raises(EPStateError, match="refused"):
            buf.dispatch(x, i, None, num_experts=E)
        out["refused_in"] = time.monotonic() - t0
        buf.reset()
        got = buf.dispatch(x, i, None, num_experts=E)
        out["exact"] = ec.to_numpy(got.recv_x).tobytes() == _want(inp, r).recv_x.tobytes()
        return out

    res = ec.ThreadGroup(2, timeout_secs=1.0).run(rank_fn, join_timeout_secs=30)
    assert res[0]["waited"] < 3 and res[1]["waited"] < 0.5  # the late rank learns it at once
    for out in res:
        assert out["refused_in"] < 0.2 and out["exact"], out


def test_reset_against_another_operation_times_out_and_a_second_reset_recovers():
    inp = routing.make_inputs(2, 4, H, E, K, seed=7)

    def rank_fn(r, boot):
        buf = _buf(boot)
        x, i = _args(inp, r)
        if r == 1:
            time.sleep(0.2)  # rank 0's reset gives up before rank 1's barrier does (then rank 1 resets)
        with pytest.raises(EPTimeoutError):  # reset() meets its peers outside the exchange: no pairing
            buf.reset() if r == 0 else buf.barrier()
        buf.reset()
        got = buf.dispatch(x, i, None, num_experts=E)
        return ec.to_numpy(got.recv_x).tobytes() == _want(inp, r).recv_x.tobytes()

    assert ec.ThreadGroup(2, timeout_secs=0.5).run(rank_fn, join_timeout_secs=30) == [True, True]


def test_an_abort_on_one_buffer_keeps_another_buffer_in_step():
    """An abort note pairs with whatever step the peer is in (another buffer on the same group included): that
    step counts on no rank, so neither buffer's counters drift."""
    inp = routing.make_inputs(2, 4, H, E, K, seed=8)

    def rank_fn(r, boot):
        a, b = _buf(boot), _buf(boot)
        x, i = _args(inp, r)
        a.destroy()
        try:
            if r == 0:
                a.dispatch(x, i, None, num_experts=E)  # refused (destroyed): announced in rank 1's step on b
            else:
                b.dispatch(x, i, None, num_experts=E)
        except Exception as exc:
            first = type(exc).__name__
        got = b.dispatch(x, i, None, num_experts=E)
        return first, ec.to_numpy(got.recv_x).tobytes() == _want(inp, r).recv_x.tobytes()

    assert ec.ThreadGroup(2, timeout_secs=5).run(rank_fn, join_timeout_secs=30) == [
        ("EPStateError", True),
        ("EPPeerError", True),
    ]


def test_construction_refusal_is_announced_and_a_retry_pairs_with_the_retry():
    def rank_fn(r, boot):
        seen = []
        try:
            ec.EPBuffer(
                boot, transport="reference", num_max_tokens_per_rank=8, hidden=H, num_topk=64 if r == 0 else K
            )
        except Exception as exc:
            seen.append(f"{type(exc).__name__}: {exc}")
        _buf(boot).destroy()  # both build again: they pair
        return seen

    s0, s1 = ec.ThreadGroup(2, timeout_secs=5).run(rank_fn, join_timeout_secs=30)
    assert s0[0].startswith("EPValueError: num_topk"), s0
    assert s1[0].startswith("EPPeerError") and "rank 0" in s1[0] and "num_topk" in s1[0], s1


def test_channel_shares_the_bootstraps_state():
    boot = ec.LocalBootstrap()
    state = RankState(0)
    boot.rank_state = state  # type: ignore[attr-defined]
    a, b = Channel(boot), Channel(boot)
    a.exchange("x", {})
    b.exchange("y", {})
    assert state.seq == 2 and a.seq == b.seq == 2


def test_a_handle_of_another_buffer_is_refused_by_name_and_the_ranks_stay_in_step():
    inp = routing.make_inputs(2, 4, H, E, K, seed=9)

    def rank_fn(r, boot):
        a, b = _buf(boot), _buf(boot)
        x, i = _args(inp, r)
        out_b = b.dispatch(x, i, None, num_experts=E)
        out_a = a.dispatch(x, i, None, num_experts=E)
        with pytest.raises(ec.EPValueError, match="another buffer"):  # every rank: no IndexError, no pairing
            a.combine(out_b.recv_x, out_b.handle)
        return a.combine(out_a.recv_x, out_a.handle).combined_x is not None

    assert ec.ThreadGroup(2, timeout_secs=5).run(rank_fn, join_timeout_secs=30) == [True, True]


def test_agrs_session_abandon_counts_on_no_rank():
    """A peer refused its all_gather from outside any session: this rank's session is dropped as if it never began
    (issue 41), so the ranks' session indices stay equal; the refusal's words name the case."""
    import pytest
    from ep_core import agrs
    from ep_core.errors import EPStateError

    s = agrs.AGRSSession(0)
    s.configure(agrs.make_agrs_config(0, 2, 2, 1 << 20, 4096, 4))
    with pytest.raises(EPStateError, match=agrs.NOT_IN_SESSION):
        s.plan_all_gather([16], [None])
    s.create()
    s.plan_all_gather([16], [None])
    s.abandon()
    assert (s.in_session, s.session_idx, s.slot, s.offset) == (False, 0, 0, 0)
    s.abandon()  # outside a session: nothing
    assert s.session_idx == 0
