"""V1 low-latency mode's limits (issue 44) on the CPU backend: what DeepEP V1 low-latency accepts and V2's inner
buffer refuses (more than 256 experts per rank: DeepEP V1's test default of 288 experts on one rank; more than 32
top-k lanes, up to low-latency mode's maximum) runs on the buffer's own host exchange, bitwise against
``ep_torch.legacy.reference``; just past each limit every rank raises ``EPValueError`` naming the argument, the limit
and the rank, before anything runs. Edge cases: zero tokens on a rank, -1 lanes, a token selecting nothing."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from ep_core.errors import EPPeerError, EPValueError
from ep_torch.legacy import Buffer
from ep_torch.legacy.checks import LL_MAX_EXPERTS_PER_RANK, LL_MAX_TOPK
from ep_torch.legacy.reference import (
    bf16_to_f32,
    f32_to_bf16,
    fp8_cast_reference,
    ll_combine_reference,
    ll_expected_rows,
)

H, M = 128, 4


def _inputs(rank: int, e: int, k: int, seed: int):
    """bf16 x, distinct top-k ids with a -1 lane and a token selecting nothing, float32 weights; rank 1 of seed 1
    has no tokens."""
    t = 0 if (seed, rank) == (1, 1) else 3
    g = torch.Generator().manual_seed(100 * seed + rank)
    x = (torch.randn(3, H, generator=g) * 4).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(3)])
    idx[0, k - 1] = -1
    idx[2] = -1
    w = torch.rand(3, k, generator=g)
    return x[:t], idx[:t], w[:t]


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def _coef(e: int) -> float:
    return 1.0 + (e % 64) / 64.0  # the test's "expert": a per-expert constant (exact in fp32)


def _round_trip(
    buf: Buffer, rank: int, n: int, e: int, k: int, seed: int, use_fp8: bool, dev: str = "cpu"
) -> None:
    what = f"{e} experts on {n} ranks, top-{k}, seed {seed}, fp8={use_fp8}"
    epr = e // n
    x, idx, w = (a.to(dev) for a in _inputs(rank, e, k, seed))
    stats = torch.zeros(epr, dtype=torch.int32, device=dev)
    recv, cnt, handle, _, hook = buf.low_latency_dispatch(
        x, idx, M, e, cumulative_local_expert_recv_stats=stats, use_fp8=use_fp8, return_recv_hook=True
    )
    hook()
    assert torch.equal(stats, cnt), what
    handle_dev = handle
    recv, cnt, handle = _cpu(recv), cnt.cpu(), _cpu(handle)
    xs = [_inputs(r, e, k, seed)[0] for r in range(n)]
    want = ll_expected_rows([_inputs(r, e, k, seed)[1].numpy() for r in range(n)], rank, e)
    src_info, layout_range, m, hidden, num_experts = handle
    assert (m, hidden, num_experts) == (M, H, e) and cnt.shape == (epr,), what
    q, s = recv if use_fp8 else (recv, None)
    assert q.shape == (epr, n * M, H), what
    for j, rows in enumerate(want):
        c = len(rows)
        assert int(cnt[j]) == c, f"{what}: recv_count[{j}] = {int(cnt[j])}, want {c}"
        for src in range(n):
            v = int(layout_range[j, src])
            got = (v >> 32, v & 0xFFFFFFFF)
            assert got == (sum(r < src for r, _ in rows), sum(r == src for r, _ in rows)), (
                f"{what}: layout_range"
            )
        if not c:
            continue
        assert src_info[j, :c].tolist() == [t for _, t in rows], f"{what}: src_info[{j}]"
        ref = np.stack([_bits(xs[r][t]) for r, t in rows])
        if use_fp8:
            rq, rs = fp8_cast_reference(ref, False, False)
            assert np.array_equal(q[j, :c].view(torch.uint8).numpy(), rq), f"{what}: fp8 rows of expert {j}"
            assert np.array_equal(s[j, :c].contiguous().numpy().view(np.int32), rs.view(np.int32)), what
        else:
            assert np.array_equal(_bits(q[j, :c]), ref), f"{what}: rows of expert {j}"
    # the combine of bf16 expert outputs: y = x * coef(expert), exact
    y = torch.zeros(epr, n * M, H, dtype=torch.bfloat16)
    x, idx, w = x.cpu(), idx.cpu(), w.cpu()
    for j, rows in enumerate(want):
        for i, (r, t) in enumerate(rows):
            y[j, i] = (xs[r][t].float() * _coef(rank * epr + j)).to(torch.bfloat16)
    comb, _, hook = buf.low_latency_combine(
        y.to(dev), idx.to(dev), w.to(dev), handle_dev, return_recv_hook=True
    )
    hook()
    comb = comb.cpu()
    lanes = np.zeros((x.shape[0], k, H), np.uint16)
    xf = bf16_to_f32(_bits(x))
    for t in range(x.shape[0]):
        for j in range(k):
            if idx[t, j] >= 0:
                lanes[t, j] = f32_to_bf16((xf[t] * np.float32(_coef(int(idx[t, j])))).astype(np.float32))
    ref = ll_combine_reference(lanes, idx.numpy(), w.numpy())
    assert comb.shape == (x.shape[0], H) and np.array_equal(_bits(comb), ref), f"{what}: combine"


def _cpu(obj):
    """Tensors (and tuples of them, one level) on the host."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, tuple):
        return tuple(_cpu(o) for o in obj)
    return obj


def _limits(rank: int, n: int) -> None:
    buf = Buffer(None, 0, int(1e8), low_latency_mode=True, explicitly_destroy=True)
    try:
        # DeepEP V1's test default on one rank, then past V2's top-k limit, then low-latency mode's top-k maximum
        for e, k, seed, fp8 in ((288 * n, 8, 0, False), (288 * n, 8, 1, True), (64 * n, 40, 0, False)):
            _round_trip(buf, rank, n, e, k, seed, fp8)
        _round_trip(buf, rank, n, 160 * n, LL_MAX_TOPK, 1, False)
        _round_trip(
            buf, rank, n, 8 * n, 2, 0, False
        )  # back on the adapter (within V2's sizes): the same bits
        # just past each limit: every rank refuses alike, before any step (the next call still runs)
        x, idx, _ = _inputs(rank, 256, 4, 0)
        big = torch.zeros(3, LL_MAX_TOPK + 1, dtype=torch.int64)
        with pytest.raises(
            EPValueError, match=rf"\(rank {rank}\): num_topk={LL_MAX_TOPK + 1} .* > {LL_MAX_TOPK}"
        ):
            buf.low_latency_dispatch(x, big, M, 256 * n, use_fp8=False)
        e = (LL_MAX_EXPERTS_PER_RANK + 1) * n
        with pytest.raises(
            EPValueError,
            match=rf"\(rank {rank}\): num_experts={e} over {n} ranks is {e // n} experts per rank > "
            rf"{LL_MAX_EXPERTS_PER_RANK}",
        ):
            buf.low_latency_dispatch(x, idx, M, e, use_fp8=False)
        _round_trip(buf, rank, n, LL_MAX_EXPERTS_PER_RANK * n, 3, 0, False)  # the limit itself
        if n > 1:  # one rank refuses while its peer is in the host exchange: the peer raises, nothing hangs
            x, idx, _ = _inputs(rank, 288 * n, 4, 0)
            if rank == 1:
                with pytest.raises(EPValueError, match="num_topk"):
                    buf.low_latency_dispatch(x, big, M, 288 * n, use_fp8=False)
            else:
                with pytest.raises(EPPeerError, match="rank 1"):
                    buf.low_latency_dispatch(x, idx, M, 288 * n, use_fp8=False)
            _round_trip(buf, rank, n, 288 * n, 8, 0, False)  # the buffer stays usable
    finally:
        buf.destroy()


def _spawn(ranks: int) -> None:
    from ep_torch_testing import run_script  # loaded by conftest.py

    code, out = run_script(__file__, ["_limits", str(ranks)], 240, what=f"limits x{ranks}: ")
    assert code == 0, out[-4000:]


@pytest.mark.parametrize("ranks", [1, 2])
def test_low_latency_limits_cpu(ranks):
    _spawn(ranks)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_low_latency_limits_native_gpu():
    """The native kernels (EP1 loopback): the limits themselves bitwise (1024 experts on one rank; top-128), and
    just past each the same refusal as on the CPU backend."""
    from ep_torch.loopback import LoopbackGroup

    torch.cuda.set_device(0)
    group = LoopbackGroup(1, device="cuda", gpu_timeout_secs=20.0, timeout_secs=60.0)
    (buf,) = group.v1_buffers(0, int(1e8), low_latency_mode=True, explicitly_destroy=True, ll_native=True)
    try:
        for e, k, seed, fp8 in (
            (288, 8, 0, False),
            (288, 8, 0, True),
            (1024, 3, 1, False),
            (160, LL_MAX_TOPK, 0, False),
        ):
            group.run(lambda r, e=e, k=k, seed=seed, fp8=fp8: _round_trip(buf, 0, 1, e, k, seed, fp8, "cuda"))
        assert buf._ll_region is not None, "the native kernels ran"
        x, idx, _ = (a.cuda() for a in _inputs(0, 256, 4, 0))
        big = torch.zeros(3, LL_MAX_TOPK + 1, dtype=torch.int64, device="cuda")
        with pytest.raises(EPValueError, match=rf"\(rank 0\): num_topk={LL_MAX_TOPK + 1} .* > {LL_MAX_TOPK}"):
            buf.low_latency_dispatch(x, big, M, 256, use_fp8=False)
        with pytest.raises(EPValueError, match=rf"is {LL_MAX_EXPERTS_PER_RANK + 1} experts per rank > "):
            buf.low_latency_dispatch(x, idx, M, LL_MAX_EXPERTS_PER_RANK + 1, use_fp8=False)
    finally:
        group.run(lambda r: buf.destroy())
        group.close()


def test_limits_match_the_native_kernels():
    from ep_core import ll_native

    assert ll_native.MAX_TOPK == LL_MAX_TOPK


if __name__ == "__main__":
    from ep_torch_testing import spawn_cpu

    spawn_cpu(globals()[sys.argv[1]], int(sys.argv[2]))
