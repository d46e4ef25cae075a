"""V1 low-latency mode of ``ep_torch.Buffer`` bit for bit against ``ep_torch.legacy.reference`` (numpy): the packed
masked layout, ``src_info``/``layout_range``, FP8 with ``round_scale``/``use_ue8m0``, the weighted combine; on gloo
ranks (CPU reference backend) and, marker ``gpu``, on CUDA (EP1 loopback and two processes sharing one GPU), with
CUDA-graph capture + replay and the hook's deferred wait."""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from ep_torch.launch import spawn
from ep_torch.legacy import Buffer, per_token_cast_to_fp8
from ep_torch.legacy.reference import (
    bf16_to_f32,
    f32_to_bf16,
    fp8_cast_reference,
    ll_combine_reference,
    ll_expected_rows,
)

T, H, K, E, M = 5, 512, 3, 8, 8


def _inputs(rank: int, seed: int = 0):
    """bf16 x (channel groups of very different magnitude, to exercise the scales), top-k ids with masked lanes and
    one token selecting nothing, float32 weights."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    mag = torch.tensor([2.0**-12, 1.0, 37.0, 2.0**9])[torch.arange(H) // 128]
    x = (torch.randn(T, H, generator=g) * mag).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    idx[0, 1] = -1
    idx[T - 1] = -1
    w = torch.rand(T, K, generator=g)
    return x, idx, w


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16)


def _coef(e: int) -> float:
    return 1.0 + e / 8.0  # the test's "expert": multiply by a per-expert constant (exact in fp32)


def _expert(recv: torch.Tensor, rank: int, epr: int) -> torch.Tensor:
    out = torch.empty_like(recv)
    for e in range(epr):
        out[e] = (recv[e].float() * _coef(rank * epr + e)).to(torch.bfloat16)
    return out


def _combine_ref(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> np.ndarray:
    xf = bf16_to_f32(_bits(x))
    y = np.zeros((T, K, H), dtype=np.uint16)
    for t in range(T):
        for k in range(K):
            if idx[t, k] >= 0:
                y[t, k] = f32_to_bf16((xf[t] * np.float32(_coef(int(idx[t, k])))).astype(np.float32))
    return ll_combine_reference(y, idx.numpy(), w.numpy())


def _check_dispatch(recv, cnt, handle, rank: int, n: int, seed: int, what: str) -> None:
    epr = E // n
    xs = [_inputs(r, seed)[0] for r in range(n)]
    want = ll_expected_rows([_inputs(r, seed)[1].numpy() for r in range(n)], rank, E)
    src_info, layout_range, m, hidden, num_experts = handle
    assert (m, hidden, num_experts) == (M, H, E), f"{what}: handle scalars {(m, hidden, num_experts)}"
    assert recv.shape == (epr, n * M, H) and cnt.dtype == torch.int32, (
        f"{what}: shapes {recv.shape} {cnt.dtype}"
    )
    for e in range(epr):
        rows = want[e]
        assert int(cnt[e]) == len(rows), (
            f"{what} rank {rank}: recv_count[{e}]={int(cnt[e])}, want {len(rows)}"
        )
        if not rows:
            continue
        got = _bits(recv[e, : len(rows)])
        ref = np.stack([_bits(xs[s][t]) for s, t in rows])
        bad = np.argwhere(got != ref)
        assert not bad.size, (
            f"{what} rank {rank} expert {e}: packed row {bad[0][0]} differs (first of {len(bad)})"
        )
        assert src_info[e, : len(rows)].tolist() == [t for _, t in rows], f"{what}: src_info of expert {e}"
        for s in range(n):
            c = sum(1 for r, _ in rows if r == s)
            off = sum(1 for r, _ in rows if r < s)
            v = int(layout_range[e, s])
            assert (v >> 32, v & 0xFFFFFFFF) == (off, c), (
                f"{what}: layout_range[{e}, {s}] = ({v >> 32}, {v & 0xFFFFFFFF})"
            )


def _check_fp8(buf: Buffer, x, idx, rank: int, n: int, round_scale: bool, use_ue8m0: bool) -> None:
    what = f"fp8 round_scale={round_scale} use_ue8m0={use_ue8m0}"
    (q, s), cnt, _, _, _ = buf.low_latency_dispatch(
        x, idx, M, E, use_fp8=True, round_scale=round_scale, use_ue8m0=use_ue8m0
    )
    assert q.dtype == torch.float8_e4m3fn, what
    assert s.dtype == (torch.int32 if use_ue8m0 else torch.float32), f"{what}: scale dtype {s.dtype}"
    assert s.shape == (E // n, n * M, H // (512 if use_ue8m0 else 128)), f"{what}: scale shape {s.shape}"
    assert s.transpose(-1, -2).is_contiguous(), f"{what}: scales must be column-major in the last two dims"
    xs = [_inputs(r)[0] for r in range(n)]
    want = ll_expected_rows([_inputs(r)[1].numpy() for r in range(n)], rank, E)
    for e, rows in enumerate(want):
        assert int(cnt[e]) == len(rows), f"{what} rank {rank}: recv_count[{e}]"
        if not rows:
            continue
        c = len(rows)
        rq, rs = fp8_cast_reference(np.stack([_bits(xs[sr][t]) for sr, t in rows]), round_scale, use_ue8m0)
        got_q = q[e, :c].cpu().view(torch.uint8).numpy()
        bad = np.argwhere(got_q != rq)
        assert not bad.size, (
            f"{what} rank {rank} expert {e}: fp8 byte {tuple(bad[0])} {got_q[tuple(bad[0])]:#x} != {rq[tuple(bad[0])]:#x}"
        )
        got_s = s[e, :c].cpu().contiguous().numpy()
        assert np.array_equal(got_s.view(np.int32), rs.view(np.int32)), (
            f"{what} rank {rank} expert {e}: scales differ"
        )


def _ll_checks(rank: int, n: int, device: str = "cpu") -> None:
    """The whole low-latency surface on one device, every result bitwise against the numpy reference."""
    dev = torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    epr = E // n
    buf = Buffer(None, 0, int(1e8), low_latency_mode=True, num_qps_per_rank=epr, explicitly_destroy=True,
                 transport="ipc" if device == "cuda" else None)  # fmt: skip
    x, idx, w = (a.to(dev) for a in _inputs(rank))
    stats = torch.zeros(epr, dtype=torch.int32, device=dev)
    for hook_mode in (False, True):
        recv, cnt, handle, ev, hook = buf.low_latency_dispatch(
            x, idx, M, E, cumulative_local_expert_recv_stats=stats, use_fp8=False, return_recv_hook=hook_mode
        )
        assert (hook is not None) == hook_mode and ev.event is None
        if hook_mode:
            hook()
        _check_dispatch(recv, cnt, handle, rank, n, 0, f"bf16 dispatch (hook={hook_mode})")
        y = _expert(recv, rank, epr)
        comb, _, hook2 = buf.low_latency_combine(y, idx, w, handle, return_recv_hook=hook_mode)
        if hook_mode:
            hook2()
        got, ref = _bits(comb), _combine_ref(x.cpu(), idx.cpu(), w.cpu())
        bad = np.argwhere(got != ref)
        assert not bad.size, (
            f"combine (hook={hook_mode}) rank {rank}: {len(bad)} values differ from ll_combine_reference, first at "
            f"{tuple(bad[0])}: {got[tuple(bad[0])]:#06x} != {ref[tuple(bad[0])]:#06x}"
        )
    assert torch.equal(stats.cpu(), 2 * cnt.cpu()), (
        "cumulative_local_expert_recv_stats accumulates recv_count"
    )
    # async_finish: an event to wait on; out= is written and returned
    recv, cnt, handle, ev, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False, async_finish=True)
    ev.current_stream_wait()
    out = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    comb, ev2, _ = buf.low_latency_combine(
        _expert(recv, rank, epr), idx, w, handle, async_finish=True, out=out
    )
    ev2.current_stream_wait()
    assert comb is out and np.array_equal(_bits(out), _combine_ref(x.cpu(), idx.cpu(), w.cpu())), (
        "async + out="
    )
    # zero copy: the next combine buffer, filled by the caller
    zbuf = buf.get_next_low_latency_combine_buffer(handle)
    zbuf.copy_(_expert(recv, rank, epr))
    comb, _, _ = buf.low_latency_combine(zbuf, idx, w, handle, zero_copy=True)
    assert np.array_equal(_bits(comb), _combine_ref(x.cpu(), idx.cpu(), w.cpu())), "zero_copy combine"
    for group in (1, 2):  # lanes in groups: one ep combine per group, the same bits
        buf.ll_lanes_per_combine = group
        comb, _, _ = buf.low_latency_combine(_expert(recv, rank, epr), idx, w, handle)
        assert np.array_equal(_bits(comb), _combine_ref(x.cpu(), idx.cpu(), w.cpu())), (
            f"lanes per combine {group}"
        )
    buf.ll_lanes_per_combine = 0
    # the other dispatch underneath (zero-copy is the default on CUDA in one NVLink domain, off on the CPU backend):
    # the same packed rows and the same combine
    buf.ll_zero_copy = device != "cuda"
    recv, cnt, handle, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    _check_dispatch(recv, cnt, handle, rank, n, 0, f"bf16 dispatch (ll_zero_copy={buf.ll_zero_copy})")
    comb, _, _ = buf.low_latency_combine(_expert(recv, rank, epr), idx, w, handle)
    assert np.array_equal(_bits(comb), _combine_ref(x.cpu(), idx.cpu(), w.cpu())), "combine after it"
    _check_fp8(buf, x, idx, rank, n, True, False)
    buf.ll_zero_copy = None
    for rs, ue in ((False, False), (True, False), (True, True)):
        _check_fp8(buf, x, idx, rank, n, rs, ue)
    # options ep does not implement, and bad inputs: before any communication, so no rank waits
    with pytest.raises(NotImplementedError, match="dispatch_wait_recv_cost_stats"):
        buf.low_latency_dispatch(
            x, idx, M, E, dispatch_wait_recv_cost_stats=torch.zeros(n, n, dtype=torch.int64)
        )
    with pytest.raises(NotImplementedError, match="combine_wait_recv_cost_stats"):
        buf.low_latency_combine(
            y, idx, w, handle, combine_wait_recv_cost_stats=torch.zeros(n, n, dtype=torch.int64)
        )
    with pytest.raises(RuntimeError, match="enable_shrink"):  # EPStateError: a buffer built without it
        buf.low_latency_update_mask_buffer(0, True)
    with pytest.raises(ValueError, match="use_ue8m0"):
        buf.low_latency_dispatch(x, idx, M, E, use_ue8m0=True)
    with pytest.raises(ValueError, match="topk_weights"):
        buf.low_latency_combine(y, idx, w.double(), handle)
    with pytest.raises(ValueError, match="hidden"):
        buf.low_latency_combine(y[:, :, :128], idx, w, handle)
    with pytest.raises(TypeError, match="low_latency_dispatch"):
        buf.low_latency_combine(y, idx, w, (1, 2, 3, 4, 5))
    dist.barrier()
    buf.destroy()


def _spawn(worker: str, ranks: int, limit: float = 300.0) -> None:
    """Run ``worker`` on ``ranks`` processes from this file started as a script (see test_torch_legacy.py)."""
    from ep_torch_testing import run_script  # loaded by conftest.py

    code, out = run_script(__file__, [worker, str(ranks)], limit, what=f"{worker} x{ranks}: ")
    assert code == 0, out[-4000:]


@pytest.mark.parametrize("ranks", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_ll_bitwise_cpu(ranks):
    _spawn("_ll_checks", ranks)


@pytest.mark.parametrize("round_scale,use_ue8m0", [(False, False), (True, False), (True, True)])
def test_fp8_cast_equals_reference(round_scale, use_ue8m0):
    x, _, _ = _inputs(3)
    q, s = per_token_cast_to_fp8(x, round_scale=round_scale, use_ue8m0=use_ue8m0)
    rq, rs = fp8_cast_reference(_bits(x), round_scale, use_ue8m0)
    assert np.array_equal(q.view(torch.uint8).numpy(), rq)
    assert np.array_equal(s.contiguous().numpy().view(np.int32), rs.view(np.int32))


def test_fp8_reference_encoder_matches_torch():
    """The numpy e4m3 encoder agrees with torch's cast on every bf16 value in range (and ties)."""
    v = bf16_to_f32(np.arange(1 << 16, dtype=np.uint16))
    v = v[np.isfinite(v) & (np.abs(v) <= 448)]
    got = torch.from_numpy(v.copy()).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    from ep_torch.legacy.reference import fp8_e4m3_bits

    assert np.array_equal(fp8_e4m3_bits(v), got)


def test_v1_methods_and_keywords_match_deepep():
    """Every public V1 method exists with V1's parameter names; the ones ep does not implement raise
    NotImplementedError naming themselves (no process group needed: they raise before touching it)."""
    import inspect

    ll_d = list(inspect.signature(Buffer.low_latency_dispatch).parameters)[1:]
    assert ll_d == [
        "x", "topk_idx", "num_max_dispatch_tokens_per_rank", "num_experts", "cumulative_local_expert_recv_stats",
        "dispatch_wait_recv_cost_stats", "use_fp8", "round_scale", "use_ue8m0", "async_finish", "return_recv_hook",
    ]  # fmt: skip
    ll_c = list(inspect.signature(Buffer.low_latency_combine).parameters)[1:]
    assert ll_c == [
        "x", "topk_idx", "topk_weights", "handle", "use_logfmt", "zero_copy", "async_finish", "return_recv_hook",
        "out", "combine_wait_recv_cost_stats",
    ]  # fmt: skip
    assert list(inspect.signature(Buffer.get_dispatch_layout).parameters)[1:] == [
        "topk_idx", "num_experts", "previous_event", "async_finish", "allocate_on_comm_stream",
    ]  # fmt: skip
    assert list(inspect.signature(Buffer.get_local_buffer_tensor).parameters)[1:] == [
        "dtype", "size", "offset", "use_rdma_buffer",
    ]  # fmt: skip
    for name in ("clean_low_latency_buffer", "get_next_low_latency_combine_buffer", "is_sm90_compiled",
                 "get_low_latency_rdma_size_hint", "destroy", "get_comm_stream", "is_available"):  # fmt: skip
        assert callable(getattr(Buffer, name)), name
    # the unimplemented methods raise without state (internode_*: test_torch_epbuffer_25.py)
    buf = Buffer.__new__(Buffer)
    for call, name in ((lambda: buf.get_local_buffer_tensor(torch.bfloat16), "get_local_buffer_tensor"),):
        with pytest.raises(NotImplementedError, match=name):
            call()
    with pytest.raises(NotImplementedError, match="enable_shrink"):  # on CUDA (the CPU backend masks ranks)
        Buffer(None, enable_shrink=True, transport="nccl")
    with pytest.raises(NotImplementedError, match="comm="):
        Buffer(None, comm=object())


def test_weighted_lane_sum_equals_reference():
    from ep_torch.legacy.low_latency import weighted_lane_sum

    g = torch.Generator().manual_seed(7)
    y = (torch.randn(64, 8, 256, generator=g) * 100).to(torch.bfloat16)
    idx = torch.randint(-1, 16, (64, 8), generator=g)
    w = torch.rand(64, 8, generator=g)
    got = weighted_lane_sum(y, idx, w)
    assert np.array_equal(_bits(got), ll_combine_reference(_bits(y), idx.numpy(), w.numpy()))


def test_bench_v1_harness_dry_run():
    """benchmarks/bench_v1.py's harness on the CPU reference backend (tiny sizes, host timer): every row, and the
    V1 combine's bitwise check, pass."""
    from ep_torch_testing import BENCH_V1_ROWS, bench_v1_dry_run

    lines = bench_v1_dry_run("--ranks", "2")
    for op in BENCH_V1_ROWS:
        assert any(op in line for line in lines), f"bench_v1 lost its {op!r} row:\n" + "\n".join(lines[-40:])


# ---------------------------------------------------------------------------------------------------------------------
# GPU (the lead runs these on the H200)


def _gpu_setup() -> None:
    torch.cuda.set_device(0)  # several processes on one GPU over a gloo bootstrap: ep's ipc transport
    os.environ.setdefault("EPKIT_NVLINK_GBS", "450")  # no NVLink to detect between processes on one GPU


def _ll_checks_gpu(rank: int, n: int) -> None:
    _gpu_setup()
    _ll_checks(rank, n, "cuda")


def _ll_graph_gpu(rank: int, n: int) -> None:
    """Low-latency dispatch + combine (with the hooks) captured in one CUDA graph, replayed on new inputs: every
    replay bitwise equal to the reference for its inputs."""
    from ep_torch.cuda_graph import CapturedStep

    _gpu_setup()
    dev = torch.device("cuda", 0)
    epr = E // n
    buf = Buffer(None, 0, int(1e8), low_latency_mode=True, explicitly_destroy=True, transport="ipc")

    def step(x, idx, w):
        recv, cnt, handle, _, hook = buf.low_latency_dispatch(
            x, idx, M, E, use_fp8=False, return_recv_hook=True
        )
        hook()
        comb, _, hook2 = buf.low_latency_combine(
            _expert(recv, rank, epr), idx, w, handle, return_recv_hook=True
        )
        hook2()
        return recv, cnt, handle, comb

    graph = CapturedStep(step, *(a.to(dev) for a in _inputs(rank, 0)))
    for seed in (1, 2, 3):
        x, idx, w = _inputs(rank, seed)
        recv, cnt, handle, comb = graph(x.to(dev), idx.to(dev), w.to(dev))
        torch.cuda.synchronize()
        _check_dispatch(recv, cnt, handle, rank, n, seed, f"graph replay {seed}")
        got, ref = _bits(comb), _combine_ref(x, idx, w)
        bad = np.argwhere(got != ref)
        assert not bad.size, (
            f"graph replay {seed} rank {rank}: combine differs from the reference at {tuple(bad[0])}"
        )
        dist.barrier()
    dist.barrier()
    buf.destroy()


def _ll_hook_gpu(rank: int, n: int) -> None:
    """The hook defers the wait: rank 1 starts late (a 1 s GPU sleep), so rank 0's data cannot have arrived when its
    call returns; rank 0's host and compute stream are not blocked (the comm stream still is), and after hook() the
    data is complete and bitwise equal to the reference."""
    _gpu_setup()
    dev = torch.device("cuda", 0)
    epr = E // n
    buf = Buffer(None, 0, int(1e8), low_latency_mode=True, explicitly_destroy=True, transport="ipc")
    x, idx, w = (a.to(dev) for a in _inputs(rank))
    buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)  # builds the buffer and compiles the kernels
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 1:
        torch.cuda._sleep(int(2e9))  # ~1 s of GPU cycles before this rank sends anything
    t0 = time.perf_counter()
    recv, cnt, handle, _, hook = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False, return_recv_hook=True)
    host_s = time.perf_counter() - t0
    if rank == 0:
        marker = torch.cuda.Event()
        marker.record(torch.cuda.current_stream())
        marker.synchronize()  # the caller's stream is free
        assert host_s < 0.5, f"low_latency_dispatch with return_recv_hook blocked the host for {host_s:.3f} s"
        assert not buf.get_comm_stream().query(), (
            "rank 0's comm stream finished while rank 1 was still asleep: the dispatch did not wait for rank 1's "
            "data (or the sleep was too short)"
        )
    hook()
    torch.cuda.current_stream().synchronize()
    _check_dispatch(recv, cnt, handle, rank, n, 0, "after hook()")
    comb, _, hook2 = buf.low_latency_combine(_expert(recv, rank, epr), idx, w, handle, return_recv_hook=True)
    hook2()
    torch.cuda.current_stream().synchronize()
    assert np.array_equal(_bits(comb), _combine_ref(x.cpu(), idx.cpu(), w.cpu())), "combine after hook()"
    dist.barrier()
    buf.destroy()


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_ll_bitwise_gpu(ranks):
    """EP1 loopback and two processes sharing the GPU: layout, FP8 (round_scale, use_ue8m0), combine, bitwise."""
    _spawn("_ll_checks_gpu", ranks)


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_ll_cuda_graph_gpu(ranks):
    _spawn("_ll_graph_gpu", ranks)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_ll_hook_defers_wait_gpu():
    _spawn("_ll_hook_gpu", 2)


if __name__ == "__main__":
    from ep_torch_testing import spawn_cpu

    worker = sys.argv[1]  # the GPU ranks start afresh (a forked process cannot use CUDA)
    (spawn if "gpu" in worker else spawn_cpu)(globals()[worker], int(sys.argv[2]))
