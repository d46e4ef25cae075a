"""V1 low-latency mode on its own kernels (``ll_native``, ``legacy.ll_kernels.native_*``, ep_core.ll_native) over
ep's loopback domain: EP1 (288 experts on one rank, DeepEP V1's test default, past the adapter's 256) and EP8, bf16
and FP8 (round_scale, ue8m0) dispatch, the weighted combine, the hook split (send now, receive at ``hook()``), two
calls in flight on the two buffer halves, and a CUDA graph replayed on new inputs: every result bitwise against
``ep_torch.legacy.reference``. The CPU backend keeps the adapter (test_torch_legacy_ll.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ep_torch.legacy.reference import (
    bf16_to_f32,
    f32_to_bf16,
    fp8_cast_reference,
    ll_combine_reference,
    ll_expected_rows,
)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
T, H, K, M = 24, 1024, 8, 32


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16)


def _inputs(rank: int, e: int, seed: int = 0):
    g = torch.Generator().manual_seed(7919 * seed + rank)
    mag = torch.tensor([2.0**-12, 1.0, 37.0, 2.0**9] * (H // 512))[torch.arange(H) // 128]
    x = (torch.randn(T, H, generator=g) * mag).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(e, generator=g)[:K] for _ in range(T)])
    idx[0, 1] = -1
    idx[T - 1] = -1
    idx[2, 3] = idx[2, 0]  # one token naming an expert twice: one message, both lanes weighted
    w = torch.rand(T, K, generator=g)
    return x, idx, w


def _coef(e: int) -> float:
    return 1.0 + (e % 16) / 8.0


def _expert(recv: torch.Tensor, rank: int, epr: int) -> torch.Tensor:
    """Multiply expert e's rows by ``_coef(e)`` (device ops only: capturable)."""
    g = torch.arange(epr, device=recv.device) + rank * epr
    c = 1.0 + (g % 16).float() / 8.0
    return (recv.float() * c[:, None, None]).to(torch.bfloat16)


def _combine_ref(x, idx, w) -> np.ndarray:
    xf = bf16_to_f32(_bits(x))
    y = np.zeros((T, K, H), dtype=np.uint16)
    for t in range(T):
        for k in range(K):
            if idx[t, k] >= 0:
                y[t, k] = f32_to_bf16((xf[t] * np.float32(_coef(int(idx[t, k])))).astype(np.float32))
    return ll_combine_reference(y, idx.numpy(), w.numpy())


def _check(outs, n, e, seed, fp8=None, what=""):
    ins = [_inputs(r, e, seed) for r in range(n)]
    for rank, (recv, cnt, handle, _, _) in enumerate(outs):
        want = ll_expected_rows([i[1].numpy() for i in ins], rank, e)
        src_info, layout_range = handle[0], handle[1]
        for le, rows in enumerate(want):
            c = len(rows)
            assert int(cnt[le]) == c, f"{what} rank {rank}: recv_count[{le}]"
            if not c:
                continue
            if fp8 is None:
                ref = np.stack([_bits(ins[s][0][t]) for s, t in rows])
                assert np.array_equal(_bits(recv[le, :c]), ref), f"{what} rank {rank} e{le}: rows"
            else:
                q, s = recv
                rq, rs = fp8_cast_reference(np.stack([_bits(ins[sr][0][t]) for sr, t in rows]), *fp8)
                assert np.array_equal(q[le, :c].cpu().view(torch.uint8).numpy(), rq), f"{what} e{le}: fp8"
                got_s = s[le, :c].cpu().contiguous().numpy()
                assert np.array_equal(got_s.view(np.int32), rs.view(np.int32)), f"{what} e{le}: scales"
            assert src_info[le, :c].tolist() == [t for _, t in rows], f"{what}: src_info e{le}"
            for sr in range(n):
                cc = sum(1 for r, _ in rows if r == sr)
                off = sum(1 for r, _ in rows if r < sr)
                v = int(layout_range[le, sr])
                assert (v >> 32, v & 0xFFFFFFFF) == (off, cc), f"{what}: layout_range[{le}, {sr}]"


def _run(n: int, e: int) -> None:
    from ep_torch.cuda_graph import avoid_record_stream
    from ep_torch.loopback import LoopbackGroup

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    epr = e // n
    group = LoopbackGroup(n, device="cuda", gpu_timeout_secs=20.0, timeout_secs=60.0)
    v1 = group.v1_buffers(0, int(1e8), low_latency_mode=True, explicitly_destroy=True, ll_native=True)
    inp = [tuple(a.to(dev) for a in _inputs(r, e)) for r in range(n)]
    stats = [torch.zeros(epr, dtype=torch.int32, device=dev) for _ in range(n)]
    _expert(torch.zeros(epr, 1, H, dtype=torch.bfloat16, device=dev), 0, epr)  # torch kernels loaded up front
    torch.cuda.synchronize()

    def disp(r, **kw):
        return v1[r].low_latency_dispatch(inp[r][0], inp[r][1], M, e, **kw)

    outs = group.run(lambda r: disp(r, use_fp8=False, cumulative_local_expert_recv_stats=stats[r]))
    assert v1[0]._ll_region is not None, "the native kernels ran"
    _check(outs, n, e, 0, what=f"EP{n} bf16")
    for r in range(n):
        assert torch.equal(stats[r].cpu(), outs[r][1].cpu()), "cumulative_local_expert_recv_stats"
    for rs, ue in ((False, False), (True, False), (True, True)):
        o8 = group.run(lambda r, rs=rs, ue=ue: disp(r, use_fp8=True, round_scale=rs, use_ue8m0=ue))
        _check(o8, n, e, 0, fp8=(rs, ue), what=f"EP{n} fp8 {rs} {ue}")

    def comb(r, o, **kw):
        recv, _, handle, _, _ = o[r]
        return v1[r].low_latency_combine(_expert(recv, r, epr), inp[r][1], inp[r][2], handle, **kw)

    def check_comb(cs, seed, what):
        for r, c in enumerate(cs):
            x, idx, w = _inputs(r, e, seed)
            bad = np.argwhere(_bits(c[0]) != _combine_ref(x, idx, w))
            assert not bad.size, f"{what} rank {r}: combine differs at {tuple(bad[0])}"

    check_comb(group.run(lambda r: comb(r, outs)), 0, f"EP{n} combine")
    # the hook split: sends only, then every rank's receive at hook()
    ho = group.run(lambda r: disp(r, use_fp8=False, return_recv_hook=True))
    group.run(lambda r: ho[r][4]())
    _check(ho, n, e, 0, what=f"EP{n} hook")
    hc = group.run(lambda r: comb(r, ho, return_recv_hook=True))
    group.run(lambda r: hc[r][2]())
    check_comb(hc, 0, f"EP{n} combine hook")

    # zero copy: the next combine buffer filled by the caller
    def zc(r):
        recv, _, handle, _, _ = outs[r]
        buf = v1[r].get_next_low_latency_combine_buffer(handle)
        buf.copy_(_expert(recv, r, epr))
        return v1[r].low_latency_combine(buf, inp[r][1], inp[r][2], handle, zero_copy=True)

    check_comb(group.run(zc), 0, f"EP{n} zero_copy")
    # a CUDA graph of dispatch + combine on every rank, replayed on new inputs
    result: list = [None] * n

    def step(r):
        recv, cnt, handle, _, _ = disp(r, use_fp8=False)
        c, _, _ = v1[r].low_latency_combine(_expert(recv, r, epr), inp[r][1], inp[r][2], handle)
        result[r] = (recv, cnt, handle, None, None, c)

    group.run(step)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with avoid_record_stream(), torch.cuda.graph(graph):
        group.run(step)
    for seed in (1, 2):
        for r in range(n):
            for dst, src in zip(inp[r], _inputs(r, e, seed)):
                dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        _check([res[:5] for res in result], n, e, seed, what=f"EP{n} graph {seed}")
        check_comb([(res[5],) for res in result], seed, f"EP{n} graph combine {seed}")
    del graph
    group.run(lambda r: v1[r].destroy())
    group.close()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    "n,e,local", [(1, 288, "1"), (8, 64, "1"), (2, 32, "1"), (8, 64, "0"), (1, 288, "0")]
)
def test_ll_native_loopback_gpu(n, e, local, monkeypatch):
    """``local`` = EPKIT_LL_LOCAL_DIRECT: without a hook a rank's own experts read their rows in place (1), or
    every row travels through the buffer like a peer's (0); the hook split always does the latter."""
    monkeypatch.setenv("EPKIT_NVLINK_GBS", "450")
    monkeypatch.setenv("EPKIT_LL_LOCAL_DIRECT", local)
    _run(n, e)


def _nccl_one(rank: int, n: int) -> None:
    """One rank over the nccl transport (NCCL's LSA window; the peer table read back by ``NcclStorage.peer_bases``):
    ``ll_native=True`` takes the native kernels there (the default keeps the adapter on nccl until this passes),
    bitwise like on the loopback domain."""
    import torch.distributed as dist
    from ep_torch.legacy import Buffer

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    e = 288
    buf = Buffer(
        dist.group.WORLD, 0, int(1e8), low_latency_mode=True, explicitly_destroy=True, ll_native=True
    )
    x, idx, w = (a.to(dev) for a in _inputs(rank, e))
    outs = [buf.low_latency_dispatch(x, idx, M, e, use_fp8=False)]  # V1's default is FP8
    print(
        f"rank {rank}: transport {buf._ll_inner.transport}, native {buf._ll_region is not None}", flush=True
    )
    assert buf._ll_region is not None, "the native kernels ran"
    _check(outs, n, e, 0, what="nccl EP1 bf16")
    _check(
        [buf.low_latency_dispatch(x, idx, M, e, use_fp8=True)], n, e, 0, fp8=(False, False), what="nccl fp8"
    )
    recv, _, handle, _, _ = outs[0]
    c, _, _ = buf.low_latency_combine(_expert(recv, rank, e), idx, w, handle)
    bad = np.argwhere(_bits(c) != _combine_ref(*_inputs(rank, e)))
    assert not bad.size, f"nccl EP1 combine differs at {tuple(bad[0])}"
    torch.cuda.synchronize()
    buf.destroy()


@pytest.mark.gpu
@gpu
def test_ll_native_nccl_one_rank_gpu():
    import os

    from ep_torch_testing import run_script  # loaded by conftest.py

    code, out = run_script(os.path.abspath(__file__), ["_nccl_one", "1"], 180, what="nccl one rank")
    assert code == 0, out[-3000:]
    assert "transport nccl, native True" in out, out[-2000:]


def _nccl_one_refusals(rank: int, n: int) -> None:
    """One rank over nccl, every row through the buffer (``EPKIT_LL_LOCAL_DIRECT=0``: each receive waits for its own
    send's flags of its epoch): a refused dispatch and a refused combine launch ``ep_lln_abort`` in their place
    (issue 41), which advances the half's epoch as the call would have, so the valid calls after them are bitwise
    and record nothing."""
    import torch.distributed as dist
    from ep_core.errors import EPValueError
    from ep_torch.legacy import Buffer

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    e = 288
    buf = Buffer(
        dist.group.WORLD, 0, int(1e8), low_latency_mode=True, explicitly_destroy=True, ll_native=True
    )
    x, idx, w = (a.to(dev) for a in _inputs(rank, e))
    buf.low_latency_dispatch(x, idx, M, e, use_fp8=False)  # builds the region
    for i in range(3):
        try:
            buf.low_latency_dispatch(x.float(), idx, M, e, use_fp8=False)
            raise AssertionError("a float32 x was not refused")
        except EPValueError:
            pass
        outs = [buf.low_latency_dispatch(x, idx, M, e, use_fp8=False)]
        _check(outs, n, e, 0, what=f"nccl EP1 after an aborted dispatch ({i})")
        recv, _, handle, _, _ = outs[0]
        try:
            buf.low_latency_combine(_expert(recv, rank, e), idx, w.to(torch.bfloat16), handle)
            raise AssertionError("bfloat16 weights were not refused")
        except EPValueError:
            pass
        c, _, _ = buf.low_latency_combine(_expert(recv, rank, e), idx, w, handle)
        bad = np.argwhere(_bits(c) != _combine_ref(*_inputs(rank, e)))
        assert not bad.size, f"nccl EP1 combine after an aborted combine ({i}) differs at {tuple(bad[0])}"
    torch.cuda.synchronize()
    reg = buf._ll_region
    assert reg.calls == 1 + 3 * 4 and not reg.words.any(), f"records: {reg.words.tolist()}"
    print(f"rank {rank}: refusals aborted, native {reg is not None}", flush=True)
    buf.destroy()


@pytest.mark.gpu
@gpu
def test_ll_native_nccl_one_rank_refusals_gpu():
    import os

    from ep_torch_testing import run_script  # loaded by conftest.py

    env = {**os.environ, "EPKIT_LL_LOCAL_DIRECT": "0"}
    code, out = run_script(
        os.path.abspath(__file__), ["_nccl_one_refusals", "1"], 180, what="nccl one rank refusals", env=env
    )
    assert code == 0, out[-3000:]
    assert "refusals aborted, native True" in out, out[-2000:]


if __name__ == "__main__":
    import sys

    from ep_torch.launch import spawn

    spawn(globals()[sys.argv[1]], int(sys.argv[2]), backend="nccl")
