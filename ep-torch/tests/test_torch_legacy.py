"""DeepEP V1 ``Buffer`` on 2 gloo ranks (CPU reference backend) against a torch oracle of V1 semantics built from
every rank's inputs: normal dispatch rows/counts/handle, cached dispatch, combine; low-latency packed layout,
combine, hook; FP8 cast against numpy; bad inputs. One spawn runs every scenario."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
from ep_torch.launch import spawn
from ep_torch.legacy import Buffer, Config, per_token_cast_to_fp8
from ep_torch.legacy.reference import ll_combine_reference

T, H, K, E = 6, 128, 2, 8


def _inputs(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    idx[0, 1] = -1  # a masked lane
    w = torch.rand(T, K, generator=g)
    return x, idx, w


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16)


def _oracle_rows(rank: int, n: int):
    """V1 dispatch rows of ``rank``: (src_rank, src_token) in order, for tokens with an expert on ``rank``."""
    epr = E // n
    rows = []
    for r in range(n):
        x, idx, w = _inputs(r)
        for t in range(T):
            local = [(int(e) - rank * epr if int(e) // epr == rank and e >= 0 else -1) for e in idx[t]]
            if any(v >= 0 for v in local):
                rows.append((r, t, x[t], local, [float(w[t, k]) if local[k] >= 0 else 0.0 for k in range(K)]))
    return rows


def _ranks(rank: int, n: int, device: str = "cpu") -> None:
    x, idx, w = _inputs(rank)
    epr = E // n
    buf = Buffer(None, int(1e8), 0, explicitly_destroy=True, transport="ipc" if device == "cuda" else None)
    if device == "cuda":  # the same checks on CUDA tensors (ep's kernels), compared on the host
        _ranks_cuda(buf, x, idx, w, rank, n)
        return
    ntr, ntrr, nte, itr, _ev = buf.get_dispatch_layout(idx, E)
    assert ntrr is None and itr.dtype == torch.bool and ntr.dtype == torch.int32
    assert int(nte.sum()) == int((idx >= 0).sum())
    rx, ridx, rw, counts, handle, _ev = buf.dispatch(
        x,
        num_tokens_per_rank=ntr,
        is_token_in_rank=itr,
        num_tokens_per_expert=nte,
        topk_idx=idx,
        topk_weights=w,
    )
    want = _oracle_rows(rank, n)
    assert rx.shape[0] == len(want)
    for i, (_r, t, xr, local, wr) in enumerate(want):
        assert torch.equal(rx[i], xr)
        assert ridx[i].tolist() == local
        assert torch.equal(rw[i], torch.tensor(wr))
        assert int(handle[3][i]) == t
    assert counts == [sum(1 for *_, lo, _w in want if e in lo) for e in range(epr)]
    rpm = handle[0]
    assert rpm.shape == (n, n) and int(rpm[-1, rank]) == len(want)
    assert torch.equal(handle[4], itr)
    # cached dispatch: same rows
    rx2, a, _b, _c, d, _ = buf.dispatch(x * 2, handle=handle)
    assert a is None and d is None and torch.equal(rx2, rx * 2)  # every rank sent 2x: the same rows, doubled
    # combine: unweighted sum over the ranks each token went to; weights round trip
    y, yw, _ = buf.combine(rx, handle, topk_weights=rw)
    reached = (itr.sum(1)).to(torch.float32)
    assert torch.equal(y, (x.float() * reached[:, None]).to(torch.bfloat16))
    assert torch.equal(yw, torch.where(idx >= 0, w, torch.zeros_like(w)))
    # bias is added once per token; expert_alignment aligns the per-expert list only
    bias = torch.full((T, H), 0.5, dtype=torch.bfloat16)
    yb, _, _ = buf.combine(rx, handle, bias=bias)
    assert torch.equal(yb, (x.float() * reached[:, None] + 0.5).to(torch.bfloat16))
    *_, counts_a, _, _ = buf.dispatch(
        x,
        num_tokens_per_rank=ntr,
        is_token_in_rank=itr,
        num_tokens_per_expert=nte,
        topk_idx=idx,
        expert_alignment=4,
    )
    assert counts_a == [(c + 3) // 4 * 4 for c in counts]
    # num_worst_tokens pads rows; combine accepts the padded rows
    rx3, ridx3, _, counts3, h3, _ = buf.dispatch(
        x,
        num_tokens_per_rank=ntr,
        is_token_in_rank=itr,
        num_tokens_per_expert=nte,
        topk_idx=idx,
        num_worst_tokens=n * T,
    )
    assert rx3.shape[0] == n * T and counts3 == [] and bool((ridx3[len(want) :] == -1).all())
    y3, _, _ = buf.combine(rx3, h3)
    assert torch.equal(y3, y)

    # low-latency: packed layout, source order per local expert
    m = 8
    stats = torch.zeros(epr, dtype=torch.int32)
    recv, cnt, llh, _ev, hook = buf.low_latency_dispatch(
        x, idx, m, E, cumulative_local_expert_recv_stats=stats, use_fp8=False, return_recv_hook=True
    )
    assert torch.equal(stats, cnt)
    hook()
    assert recv.shape == (epr, n * m, H) and cnt.dtype == torch.int32
    for e in range(epr):
        rows = [xr for r, t, xr, lo, _w in want if e in lo]
        assert int(cnt[e]) == len(rows)
        if rows:
            assert torch.equal(recv[e, : len(rows)], torch.stack(rows))
    # combine: an "expert" multiplying by (global expert id + 1); expected sum_k w_k * (e_k + 1) * x
    out_ll = recv.clone()
    for e in range(epr):
        out_ll[e] = (recv[e].float() * (rank * epr + e + 1)).to(torch.bfloat16)
    comb, _, hook2 = buf.low_latency_combine(out_ll, idx, w, llh)
    assert hook2 is None
    # bitwise: fp32 multiply then add in ascending lane order, one bf16 rounding (legacy.reference)
    y = np.zeros((T, K, H), dtype=np.uint16)
    for t in range(T):
        for k in range(K):
            if idx[t, k] >= 0:
                y[t, k] = _bits((x[t].float() * (int(idx[t, k]) + 1)).to(torch.bfloat16))
    assert np.array_equal(_bits(comb), ll_combine_reference(y, idx.numpy(), w.numpy()))
    # fp8 path returns (data, scales)
    (q, s), cnt2, _, _, _ = buf.low_latency_dispatch(x, idx, m, E, use_fp8=True, round_scale=True)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (epr, n * m, H // 128) and torch.equal(cnt2, cnt)
    assert s.transpose(-1, -2).is_contiguous()  # column-major scales
    q_ref, s_ref = per_token_cast_to_fp8(recv, round_scale=True)
    for e in range(epr):  # rows past recv_count are unspecified
        c = int(cnt[e])
        assert torch.equal(q[e, :c].view(torch.uint8), q_ref[e, :c].view(torch.uint8))
        assert torch.equal(s[e, :c], s_ref[e, :c])
    # bad inputs
    with pytest.raises(
        ValueError, match="use_logfmt=True needs hidden % 512 == 0"
    ):  # H = 128: no whole chunk
        buf.low_latency_combine(out_ll, idx, w, llh, use_logfmt=True)
    with pytest.raises(ValueError, match="num_max_dispatch_tokens_per_rank"):
        buf.low_latency_dispatch(x, idx, T - 1, E)
    with pytest.raises(ValueError, match="num_experts"):
        buf.get_dispatch_layout(idx, E + 1)
    with pytest.raises(ValueError, match="is_token_in_rank"):
        buf.dispatch(x, num_tokens_per_expert=nte, topk_idx=idx)
    with pytest.raises(AssertionError, match="cached dispatch"):
        buf.dispatch(x, handle=handle, topk_idx=idx)
    with pytest.raises(AssertionError, match="use_ue8m0"):
        buf.low_latency_dispatch(x, idx, m, E, use_ue8m0=True)
    with pytest.raises(ValueError, match="hidden"):
        buf.low_latency_combine(out_ll[:, :, :64], idx, w, llh)
    dist.barrier()
    buf.destroy()


def _spawn(worker: str, ranks: int, limit: float = 300.0) -> None:
    """Run `worker` on `ranks` processes from this file started as a script: spawned ranks unpickle the worker
    from `__main__` (under pytest's importlib mode the test module has no importable name)."""
    from ep_torch_testing import run_script  # loaded by conftest.py

    code, out = run_script(__file__, [worker, str(ranks)], limit, what=f"{worker} x{ranks}: ")
    assert code == 0, out[-4000:]


@pytest.mark.parametrize("ranks", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 ranks: ~15 s on two cores
def test_v1_surface(ranks):
    _spawn("_ranks", ranks)


def _np_cast(x: np.ndarray, round_scale: bool):
    g = x.reshape(x.shape[0], -1, 128).astype(np.float32)
    amax = np.maximum(np.abs(g).max(-1), 1e-4)
    s = amax / np.float32(448.0)
    if round_scale:
        s = np.exp2(np.ceil(np.log2(s))).astype(np.float32)
    return g / s[..., None], s


@pytest.mark.parametrize("round_scale", [False, True])
def test_fp8_cast_matches_numpy(round_scale):
    x = torch.randn(5, 512).to(torch.bfloat16)
    q, s = per_token_cast_to_fp8(x, round_scale=round_scale)
    nq, ns = _np_cast(x.float().numpy(), round_scale)
    np.testing.assert_array_equal(s.numpy(), ns)
    want = torch.from_numpy(nq.reshape(5, 512)).to(torch.float8_e4m3fn)
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))
    if round_scale:
        _, packed = per_token_cast_to_fp8(x, round_scale=True, use_ue8m0=True)
        exps = ((ns.view(np.int32) >> 23) & 0xFF).reshape(5, 1, 4)
        np.testing.assert_array_equal(
            packed.numpy(), (exps[..., 0] | exps[..., 1] << 8 | exps[..., 2] << 16 | exps[..., 3] << 24)
        )


def test_configs_and_static_helpers():
    c = Buffer.get_dispatch_config(8)
    assert isinstance(c, Config) and c.num_sms == Buffer.num_sms
    assert isinstance(Buffer.get_combine_config(8), Config)
    assert Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256) % 128 == 0
    with pytest.raises(AssertionError, match="even"):
        Buffer.set_num_sms(3)
    with pytest.raises(AssertionError, match="unsupported number of EP ranks"):
        Buffer.get_dispatch_config(3)


def test_capture_on_cpu():
    ev = Buffer.capture()
    ev.current_stream_wait()


def test_signature_matches_v1():
    import inspect

    names = list(inspect.signature(Buffer.__init__).parameters)[1:11]
    assert names == [
        "group", "num_nvl_bytes", "num_rdma_bytes", "low_latency_mode", "num_qps_per_rank",
        "allow_nvlink_for_low_latency_mode", "allow_mnnvl", "explicitly_destroy", "enable_shrink", "comm",
    ]  # fmt: skip
    d = list(inspect.signature(Buffer.dispatch).parameters)[1:]
    assert d == [
        "x", "handle", "num_tokens_per_rank", "num_tokens_per_rdma_rank", "is_token_in_rank",
        "num_tokens_per_expert", "topk_idx", "topk_weights", "expert_alignment", "num_worst_tokens", "config",
        "previous_event", "async_finish", "allocate_on_comm_stream",
    ]  # fmt: skip
    c = list(inspect.signature(Buffer.combine).parameters)[1:]
    assert c == ["x", "handle", "topk_weights", "bias", "config", "previous_event", "async_finish",
                 "allocate_on_comm_stream"]  # fmt: skip


def _ranks_cuda(buf, x, idx, w, rank: int, n: int) -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    xc, ic, wc = x.to(dev), idx.to(dev), w.to(dev)
    ntr, _, nte, itr, _ = buf.get_dispatch_layout(ic, E)
    rx, ridx, _rw, _counts, handle, _ = buf.dispatch(
        xc,
        num_tokens_per_rank=ntr,
        is_token_in_rank=itr,
        num_tokens_per_expert=nte,
        topk_idx=ic,
        topk_weights=wc,
    )
    want = _oracle_rows(rank, n)
    assert rx.shape[0] == len(want)
    for i, (_r, _t, xr, local, _w) in enumerate(want):
        assert torch.equal(rx[i].cpu(), xr) and ridx[i].tolist() == local
    y, _, _ = buf.combine(rx, handle)
    assert torch.equal(y.cpu(), (x.float() * itr.sum(1).cpu().float()[:, None]).to(torch.bfloat16))
    recv, cnt, llh, _, hook = buf.low_latency_dispatch(xc, ic, 8, E, use_fp8=False, return_recv_hook=True)
    hook()
    for e in range(E // n):
        rows = [xr for _r, _t, xr, lo, _w in want if e in lo]
        assert int(cnt[e]) == len(rows)
        if rows:
            assert torch.equal(recv[e, : len(rows)].cpu(), torch.stack(rows))
    comb, _, _ = buf.low_latency_combine(recv, ic, wc, llh)
    y = np.zeros((T, K, H), dtype=np.uint16)
    y[:] = _bits(x)[:, None, :]
    assert np.array_equal(_bits(comb), ll_combine_reference(y, idx.numpy(), w.numpy()))
    dist.barrier()
    buf.destroy()


def _ranks_shared_gpu(rank: int, n: int) -> None:
    torch.cuda.set_device(0)  # several processes on one GPU over a gloo bootstrap: ep's ipc transport
    os.environ.setdefault("EPKIT_NVLINK_GBS", "450")  # no NVLink to detect between processes on one GPU
    _ranks(rank, n, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_v1_surface_shared_gpu():
    _spawn("_ranks_shared_gpu", 2)


if __name__ == "__main__":
    from ep_torch_testing import spawn_cpu

    worker = sys.argv[1]  # the GPU ranks start afresh (a forked process cannot use CUDA)
    (spawn if "gpu" in worker else spawn_cpu)(globals()[worker], int(sys.argv[2]))
