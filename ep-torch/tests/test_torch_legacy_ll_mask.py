"""V1 low-latency mode with rank masking (``Buffer(enable_shrink=True)``, issue 44) on gloo ranks (CPU backend),
bitwise against ``ep_torch.legacy.reference`` with the masked ranks' experts dropped: masking by the user on 2 and 4
ranks (query, clean, a rank that sits out while masked and rejoins), a rank that stops mid-loop (its process exits
after a dispatch, or it stops calling) masked by the others within the timeout with a warning naming it, refusals;
and the refusal of enable_shrink on CUDA."""

from __future__ import annotations

import os
import sys
import time
import warnings
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
from ep_core.errors import EPPeerError, EPStateError, EPValueError
from ep_core.rank_mask import RankMaskedWarning
from ep_torch.legacy import Buffer
from ep_torch.legacy.reference import (
    bf16_to_f32,
    f32_to_bf16,
    fp8_cast_reference,
    ll_combine_reference,
    ll_expected_rows,
)

T, H, K, E, M = 5, 256, 3, 12, 8  # E: a multiple of 1, 2, 3 and 4 ranks
TIMEOUT = 1.0  # the buffer's num_cpu_timeout_secs: how long a lost rank is waited for


def _inputs(rank: int, seed: int):
    """bf16 x, top-k ids with a -1 lane and a token selecting nothing, float32 weights; at seed 7 rank 0 has no
    tokens."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    x = (torch.randn(T, H, generator=g) * 3).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    idx[0, 1] = -1
    idx[T - 1] = -1
    w = torch.rand(T, K, generator=g)
    t = 0 if (seed, rank) == (7, 0) else T
    return x[:t], idx[:t], w[:t]


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def _coef(e: int) -> float:
    return 1.0 + e / 8.0


def _dropped(idx: np.ndarray, lost: set[int], n: int) -> np.ndarray:
    """``idx`` with -1 on the lanes of the lost ranks' experts."""
    epr = E // n
    return np.where((idx >= 0) & np.isin(idx // epr, list(lost)), -1, idx)


def _step(
    buf: Buffer, rank: int, n: int, seed: int, sent: set[int], kept: set[int], what: str, hook: bool = False
) -> None:
    """One dispatch + combine, checked bitwise. ``sent``: ranks masked before the dispatch (their tokens do not
    come, their experts receive none); ``kept``: ranks masked before the combine (their experts contribute nothing).
    ``hook``: with ``return_recv_hook``, ``async_finish`` and the recv stats."""
    epr = E // n
    x, idx, w = _inputs(rank, seed)
    stats = torch.zeros(epr, dtype=torch.int32) if hook else None
    recv, cnt, handle, ev, recv_hook = buf.low_latency_dispatch(
        x, idx, M, E, cumulative_local_expert_recv_stats=stats, use_fp8=False, async_finish=hook,
        return_recv_hook=hook,
    )  # fmt: skip
    if hook:
        ev.current_stream_wait()
        recv_hook()
        assert torch.equal(stats, cnt), f"{what}: cumulative_local_expert_recv_stats"
    idxs = [
        _dropped(_inputs(r, seed)[1].numpy(), sent, n) if r not in sent else np.full((T, K), -1)
        for r in range(n)
    ]
    want = ll_expected_rows(idxs, rank, E)
    src_info, layout_range = handle[0], handle[1]
    for e in range(epr):
        rows = want[e]
        assert int(cnt[e]) == len(rows), (
            f"{what} rank {rank}: recv_count[{e}]={int(cnt[e])}, want {len(rows)}"
        )
        ref = [_bits(_inputs(s, seed)[0][t]) for s, t in rows]
        assert all(np.array_equal(_bits(recv[e, i]), r) for i, r in enumerate(ref)), (
            f"{what}: rows of expert {e}"
        )
        assert src_info[e, : len(rows)].tolist() == [t for _, t in rows], f"{what}: src_info of expert {e}"
        for s in range(n):
            v = int(layout_range[e, s])
            c, off = sum(1 for r, _ in rows if r == s), sum(1 for r, _ in rows if r < s)
            assert (v >> 32, v & 0xFFFFFFFF) == (off, c), f"{what}: layout_range[{e}, {s}]"
    y = torch.empty_like(recv)
    for e in range(epr):
        y[e] = (recv[e].float() * _coef(rank * epr + e)).to(torch.bfloat16)
    if hook:  # the zero-copy buffer and the hook
        buf.get_next_low_latency_combine_buffer(handle).copy_(y)
        comb, _, recv_hook = buf.low_latency_combine(
            None, idx, w, handle, zero_copy=True, return_recv_hook=True
        )
        recv_hook()
    else:
        comb, _, _ = buf.low_latency_combine(y, idx, w, handle)
    live = _dropped(idx.numpy(), kept, n)
    xf = bf16_to_f32(_bits(x))
    yr = np.zeros((len(x), K, H), np.uint16)
    for t in range(len(x)):
        for k in range(K):
            if live[t, k] >= 0:
                yr[t, k] = f32_to_bf16((xf[t] * np.float32(_coef(int(live[t, k])))).astype(np.float32))
    ref = ll_combine_reference(yr, live, w.numpy())
    bad = np.argwhere(_bits(comb) != ref)
    assert not bad.size, f"{what} rank {rank}: combine differs from the reference at {tuple(bad[0])}"


def _query(buf: Buffer, n: int) -> list[int]:
    q = torch.full((n,), 7, dtype=torch.int32)
    buf.low_latency_query_mask_buffer(q)
    return q.tolist()


def _check_fp8(buf: Buffer, rank: int, n: int, sent: set[int]) -> None:
    x, idx, _ = _inputs(rank, 9)
    (q, s), cnt, _, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=True, round_scale=True)
    assert s.transpose(-1, -2).is_contiguous(), "scales column-major in the last two dimensions"
    idxs = [
        _dropped(_inputs(r, 9)[1].numpy(), sent, n) if r not in sent else np.full((T, K), -1)
        for r in range(n)
    ]
    for e, rows in enumerate(ll_expected_rows(idxs, rank, E)):
        assert int(cnt[e]) == len(rows)
        if rows:
            rq, rs = fp8_cast_reference(np.stack([_bits(_inputs(r, 9)[0][t]) for r, t in rows]), True, False)
            assert np.array_equal(q[e, : len(rows)].view(torch.uint8).numpy(), rq), f"fp8 expert {e}"
            assert np.array_equal(s[e, : len(rows)].contiguous().numpy().view(np.int32), rs.view(np.int32))


def _check_logfmt(buf: Buffer, rank: int, n: int, masked: set[int]) -> None:
    """``use_logfmt=True`` under masking: the reference's LogFMT round trip of every live lane (hidden 512, values
    below 1 so the chunks are encoded)."""
    g = torch.Generator().manual_seed(77)
    xs = [(torch.rand(T, 512, generator=g) - 0.5).to(torch.bfloat16) for _ in range(n)]
    _, idx, w = _inputs(rank, 8)
    _, _, handle, _, _ = buf.low_latency_dispatch(xs[rank], idx, M, E, use_fp8=False)
    recv_rows = ll_expected_rows(
        [
            _dropped(_inputs(r, 8)[1].numpy(), masked, n) if r not in masked else np.full((T, K), -1)
            for r in range(n)
        ],
        rank,
        E,
    )
    epr = E // n
    y = torch.zeros(epr, M * n, 512, dtype=torch.bfloat16)
    for e, rows in enumerate(recv_rows):
        for i, (s, t) in enumerate(rows):
            y[e, i] = (xs[s][t].float() * 0.5).to(torch.bfloat16)
    comb, _, _ = buf.low_latency_combine(y, idx, w, handle, use_logfmt=True)
    live = _dropped(idx.numpy(), masked, n)
    yr = np.zeros((T, K, 512), np.uint16)
    for t in range(T):
        for k in range(K):
            if live[t, k] >= 0:
                yr[t, k] = _bits((xs[rank][t].float() * 0.5).to(torch.bfloat16))
    ref = ll_combine_reference(yr, live, w.numpy(), use_logfmt=True)
    assert np.array_equal(_bits(comb), ref), "use_logfmt under masking differs from the reference"


def _mask_user(rank: int, n: int) -> None:
    """Masked by the user on every rank: the last rank sits out two steps, the others drop its experts; query
    reports it; clean restores every rank (it rejoins in step). Then a refusal under masking stays announced."""
    buf = Buffer(None, low_latency_mode=True, enable_shrink=True, explicitly_destroy=True,
                 num_cpu_timeout_secs=30.0)  # fmt: skip
    d = n - 1
    _step(buf, rank, n, 0, set(), set(), "unmasked")
    assert _query(buf, n) == [0] * n
    buf.low_latency_update_mask_buffer(d, True)
    assert _query(buf, n) == [int(r == d) for r in range(n)]
    if rank != d:
        for seed in (1, 2):
            _step(buf, rank, n, seed, {d}, {d}, f"rank {d} masked (step {seed})", hook=seed == 2)
        _check_fp8(buf, rank, n, {d})
        _check_logfmt(buf, rank, n, {d})
    buf.low_latency_clean_mask_buffer()
    assert _query(buf, n) == [0] * n
    _step(buf, rank, n, 3, set(), set(), "after clean")
    buf.low_latency_update_mask_buffer(d, True)
    buf.low_latency_update_mask_buffer(d, False)  # unmask one rank
    _step(buf, rank, n, 4, set(), set(), "after unmask")
    if rank != d:  # masked again, and rank 0 without tokens
        buf.low_latency_update_mask_buffer(d, True)
        _step(buf, rank, n, 7, {d}, {d}, "no tokens on rank 0")
    buf.low_latency_clean_mask_buffer()
    _step(buf, rank, n, 7, set(), set(), "no tokens on rank 0, unmasked")
    # a rank that rejects its call tells its peers in the masked exchange; every rank stays in step
    x, idx, _ = _inputs(rank, 5)
    if rank == 0:
        with pytest.raises(EPValueError, match="num_max_dispatch_tokens_per_rank"):
            buf.low_latency_dispatch(torch.cat([x, x]), torch.cat([idx, idx]), T, E, use_fp8=False)
    elif n > 1:
        with pytest.raises(EPPeerError, match="rank 0 abandoned"):
            buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    _step(buf, rank, n, 6, set(), set(), "after a refusal")
    for bad in (n, -1):
        with pytest.raises(EPValueError, match="rank_to_mask"):
            buf.low_latency_update_mask_buffer(bad, True)
    with pytest.raises(EPValueError, match="mask_status"):
        buf.low_latency_query_mask_buffer(torch.zeros(n, dtype=torch.int64))
    dist.barrier()
    buf.destroy()


def _mask_lost(rank: int, n: int, mode: str) -> None:
    """Rank 3 leaves at step 2: ``exit`` (its process ends after its dispatch) or ``stop`` (alive, it stops calling).
    The others mask it within the timeout, warn naming it, and keep decoding with its experts dropped."""
    store = dist.distributed_c10d._get_default_store()
    buf = Buffer(None, low_latency_mode=True, enable_shrink=True, explicitly_destroy=True,
                 num_cpu_timeout_secs=TIMEOUT)  # fmt: skip
    lost = 3
    for step in range(5):
        if rank == lost and step == 2:
            if mode == "exit":
                x, idx, _ = _inputs(rank, step)
                buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
                os._exit(0)  # mid-step: after its dispatch, before its combine
            store.wait([f"mask_test/done/{r}" for r in range(3)], timedelta(seconds=120))
            store.set(f"mask_test/done/{rank}", "1")
            os._exit(0)
        sent = {lost} if step > 2 or (step == 2 and mode == "stop") else set()
        kept = {lost} if step >= 2 else set()
        t0 = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _step(buf, rank, n, step, sent, kept, f"{mode} step {step}")
        took = time.monotonic() - t0
        said = [str(c.message) for c in caught if issubclass(c.category, RankMaskedWarning)]
        if step == 2:
            op = "low_latency_combine" if mode == "exit" else "low_latency_dispatch"
            assert len(said) == 1 and f"rank {lost} did not arrive" in said[0] and op in said[0], said
            assert took < TIMEOUT + 5, f"step 2 took {took:.1f} s (timeout {TIMEOUT} s)"
        else:
            assert not said, said
        if step > 2:
            assert took < TIMEOUT, f"step {step} waited {took:.1f} s for a masked rank"
        assert _query(buf, n) == ([0, 0, 0, 1] if step >= 2 else [0] * n), f"step {step}: {_query(buf, n)}"
    store.set(f"mask_test/done/{rank}", "1")
    if rank == 0:  # the store's host leaves last
        rest = [1, 2] + ([lost] if mode == "stop" else [])
        store.wait([f"mask_test/done/{r}" for r in rest], timedelta(seconds=120))
    sys.stdout.flush()
    os._exit(0)  # no barrier with the lost rank


def _mask_late(rank: int, n: int) -> None:
    """Rank 3 is late for step 2 (longer than the timeout) but alive: the others mask it and go on; rank 3, writing
    late, finds its messages given up, masks every peer in turn (a warning naming them) and drops their messages of
    that step (its outputs: its own tokens and experts only). After clean on every rank, all four decode together
    again, bitwise: nothing of the late step is read later."""
    timeout, late = 2.0, 3
    buf = Buffer(None, low_latency_mode=True, enable_shrink=True, explicitly_destroy=True,
                 num_cpu_timeout_secs=timeout)  # fmt: skip
    others = set(range(n)) - {late}
    for step in range(4):
        if rank == late and step == 2:
            time.sleep(1.3 * timeout)
        lost = ({late} if rank != late else others) if step >= 2 else set()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _step(buf, rank, n, step, lost, lost, f"late step {step}")
        said = [str(c.message) for c in caught if issubclass(c.category, RankMaskedWarning)]
        if step == 2:
            want = ["did not arrive"] if rank != late else ["gave up"] * len(others)
            assert [w for w in want if any(w in m for m in said)] == want and len(said) == len(want), said
        assert _query(buf, n) == [int(r in lost) for r in range(n)], f"step {step}: {_query(buf, n)}"
    buf.low_latency_clean_mask_buffer()
    _step(buf, rank, n, 4, set(), set(), "after clean")
    dist.barrier()
    buf.destroy()


def _spawn(worker: str, ranks: int, *args: str, limit: float = 180.0) -> float:
    from ep_torch_testing import run_script  # loaded by conftest.py

    t0 = time.monotonic()
    code, out = run_script(__file__, [worker, str(ranks), *args], limit, what=f"{worker} x{ranks}: ")
    assert code == 0, out[-4000:]
    return time.monotonic() - t0


@pytest.mark.parametrize(
    "ranks", [2, 4, pytest.param(1, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow)]
)
def test_user_mask_cpu(ranks):
    _spawn("_mask_user", ranks)


@pytest.mark.parametrize("mode", ["exit", "stop"])
def test_lost_rank_is_masked_cpu(mode):
    """The target: one of 4 ranks leaves mid-loop; the other 3 mask it within the timeout and keep decoding."""
    _spawn("_mask_lost", 4, mode)


def test_late_rank_is_masked_then_rejoins_cpu():
    _spawn("_mask_late", 4)


def test_without_enable_shrink_the_mask_methods_refuse():
    buf = Buffer.__new__(Buffer)  # no state needed: they refuse before touching it
    for call in (
        lambda: buf.low_latency_update_mask_buffer(0, True),
        lambda: buf.low_latency_query_mask_buffer(torch.zeros(2, dtype=torch.int32)),
        buf.low_latency_clean_mask_buffer,
    ):
        with pytest.raises(EPStateError, match="enable_shrink=True"):
            call()


@pytest.mark.parametrize("transport,native", [("ipc", False), ("ipc", None), ("nccl", None), ("nccl", True)])
def test_enable_shrink_refused_on_cuda_transports(transport, native, monkeypatch):
    """No silent fallback: where the CUDA low-latency kernels take no mask (nccl; the adapter, ``ll_native=False``
    or ``EPKIT_LL_NATIVE=0``), the buffer is refused by name (before the group is touched); over ipc the default
    (``ll_native=None``) runs the native kernels, which do."""
    if native is None and transport == "ipc":
        monkeypatch.setenv("EPKIT_LL_NATIVE", "0")  # the default then means the adapter
    with pytest.raises(NotImplementedError, match=f"enable_shrink=True .*transport {transport} .CUDA"):
        Buffer(None, low_latency_mode=True, enable_shrink=True, transport=transport, ll_native=native)


if __name__ == "__main__":
    from ep_torch_testing import spawn_cpu

    spawn_cpu(globals()[sys.argv[1]], int(sys.argv[2]), *sys.argv[3:])
