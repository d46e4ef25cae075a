"""``combine(..., out_dtype=torch.float32)`` (DeepEP 2.6's optional FP32 combine output; ``out_dtype`` is ep's name,
issue 42) on 2 and 4 gloo ranks and 4 ranks as 2 emulated nodes (CPU backend): the float32 output rounded to bf16 is
bitwise the ordinary combine's output (non-expanded, expanded with and without multiple reduction, biases, weights);
in direct non-expanded mode it equals an independent float32 sum in SPEC §3's order; the refusals are announced to
every rank, a rank mixing the two outputs makes every rank raise."""

from __future__ import annotations

import os
import sys

import ep_torch
import pytest
import torch
import torch.distributed as dist
from ep_core.errors import EPMismatchError, EPPeerError, EPStateError

E, K, H, T = 8, 3, 32, 12


def _inputs(rank: int, seed: int):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    x = (torch.randn(T, H, generator=g) * 3).bfloat16()
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int64)
    idx[::4, 1] = -1
    idx[5] = -1  # a token that goes nowhere
    w = torch.rand(T, K, generator=g)
    b0 = torch.randn(T, H, generator=g).bfloat16()
    b1 = torch.randn(T, H, generator=g).bfloat16()
    return x, idx, w, b0, b1


def _expected_direct(x, idx, b0, b1, factor, n: int) -> torch.Tensor:
    """Direct non-expanded mode: bias0, bias1, then one row per destination rank, in ascending order of the rank's
    representative (highest) lane, each row the token scaled by that rank's factor in bf16; float32 adds."""
    epr = E // n
    out = torch.zeros(T, H)
    for t in range(T):
        acc = b0[t].float() + b1[t].float()
        master = {}
        for lane, e in enumerate(idx[t].tolist()):
            if e >= 0:
                master[e // epr] = lane
        for d, _ in sorted(master.items(), key=lambda kv: kv[1]):
            acc = acc + (x[t].float() * factor(d)).bfloat16().float()
        out[t] = acc
    return out


def _ranks(rank: int, n: int) -> None:
    group = dist.group.WORLD
    buf = ep_torch.EPBuffer(group, num_max_tokens_per_rank=T, hidden=H, num_topk=K)
    amr = ep_torch.EPBuffer(
        group, num_max_tokens_per_rank=T, hidden=H, num_topk=K, allow_multiple_reduction=False
    )
    hybrid = buf.num_scaleout_ranks > 1

    def factor(d: int) -> float:
        return 1.0 + 0.125 * d

    for seed, b, expand in ((0, buf, False), (1, buf, True), (2, amr, True), (3, amr, False)):
        x, idx, w, b0, b1 = _inputs(rank, seed)
        kw = {"do_expand": True, "expert_alignment": 4} if expand else {}
        recv_x, _, recv_w, handle, _ = b.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E, **kw)
        y = (recv_x.float() * factor(rank)).bfloat16()
        cw = recv_w if not (expand and b is amr) else None
        for bias in (None, b0, (b0, b1)):
            o16, w16, _ = b.combine(y, handle, topk_weights=cw, bias=bias)
            o32, w32, ev = b.combine(y, handle, topk_weights=cw, bias=bias, out_dtype=torch.float32)
            assert o32.dtype == torch.float32 and o32.shape == o16.shape == (T, H)
            assert torch.equal(o32.bfloat16().view(torch.int16), o16.view(torch.int16)), (seed, bias is None)
            assert (w16 is None and w32 is None) or torch.equal(w16, w32)
            assert ev.event is None
        if not expand and not hybrid:
            want = _expected_direct(x, idx, b0, b1, factor, n)
            got, _, _ = b.combine(y, handle, bias=(b0, b1), out_dtype=torch.float32)
            assert torch.equal(got, want)
            assert not torch.equal(got.bfloat16().float(), got)  # float32 kept bits bf16 would drop
    y, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, num_experts=E)
    o16, _, _ = buf.combine(y, handle, out_dtype=torch.bfloat16)  # the ordinary combine
    assert o16.dtype == torch.bfloat16
    _, _, ev = buf.combine(y, handle, out_dtype=torch.float32, async_with_compute_stream=True)
    ev.current_stream_wait()

    # refusals on one rank: announced, the others raise EPPeerError naming it; the buffer stays usable
    if rank == n - 1:
        with pytest.raises(TypeError, match="out_dtype"):
            buf.combine(y, handle, out_dtype=torch.float16)
    else:
        with pytest.raises(EPPeerError, match=f"rank {n - 1}"):
            buf.combine(y, handle, out_dtype=torch.float32)
    if rank == 0:
        with pytest.raises(ValueError, match="out_dtype"):
            buf.combine(
                y, handle, out_dtype=torch.float32, async_with_compute_stream=True, defer_epilogue=True
            )
        with pytest.raises(ValueError, match="rows"):
            buf.combine(y[:-1], handle, out_dtype=torch.float32)
    else:
        for _ in range(2):
            with pytest.raises(EPPeerError, match="rank 0"):
                buf.combine(y, handle, out_dtype=torch.float32)
    base, _, _ = buf.combine(y, handle)
    # a rank mixing the outputs: every rank raises, refused until reset()
    with pytest.raises(EPMismatchError, match="out_dtype"):
        buf.combine(y, handle, out_dtype=torch.float32 if rank == 0 else None)
    with pytest.raises(EPStateError, match="reset"):
        buf.combine(y, handle, out_dtype=torch.float32)
    buf.reset()
    y2, _, _, h2, _ = buf.dispatch(x, topk_idx=idx, num_experts=E)
    again, _, _ = buf.combine(y2, h2, out_dtype=torch.float32)
    assert torch.equal(again.bfloat16().view(torch.int16), base.view(torch.int16))
    dist.barrier()


@pytest.mark.parametrize(("ranks", "scaleup"), [(2, None), (4, None), (4, "2")], ids=["2", "4", "4-2-nodes"])
def test_combine_fp32(ranks, scaleup):
    env = {k: v for k, v in os.environ.items() if k != "EPKIT_SCALEUP_RANKS"}
    if scaleup is not None:
        env["EPKIT_SCALEUP_RANKS"] = scaleup
    from ep_torch_testing import run_script  # loaded by conftest.py

    code, out = run_script(__file__, ["_ranks", str(ranks)], 300, env=env, what=f"{ranks} ranks: ")
    assert code == 0, out[-4000:]


if __name__ == "__main__":
    from ep_torch_testing import spawn_cpu

    spawn_cpu(globals()[sys.argv[1]], int(sys.argv[2]))
