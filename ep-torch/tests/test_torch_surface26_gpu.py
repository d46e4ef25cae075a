"""DeepEP 2.6's additions on CUDA tensors (issue 42), against the CPU reference:

- ``combine(out_dtype=torch.float32)``: bitwise ``ep_core.reference.combine(fp32_output=True)`` of every rank's
  inputs (non-expanded, expanded with and without multiple reduction; no bias and two biases; weights; -1 lanes, a
  token with no lane, a rank with zero tokens), and its bf16 rounding bitwise the ordinary combine;
- ``EPBuffer.resize``: the new sizes, a round trip bitwise a fresh buffer's, the LB region kept, a handle from before
  refused as stale (``EPStateError``), a refusal on one rank announced to every rank (``EPPeerError``);
- ``BucketBuffer.send_recv``: rings both ways, a swap, a send to itself, one transfer with idle ranks, the calls
  that do not pair (``EPMismatchError`` everywhere, refused until ``reset()``), a refusal announced, and a wait
  for a peer that never sends (``EPTimeoutError`` naming it, then ``reset()``).

GPU (marked ``gpu``): 2 processes sharing the GPU over ipc (one script: the three bodies), the float32 combine in a
loopback group of 2 ranks (no-CPU-sync dispatches: worst-case rows), and one rank over nccl (the float32 combine,
resize, ``lb_get_redundancy_mapping``). The same bodies run on the CPU reference backend (not marked): there they
also compare ``combine_fp32_by_lanes``, the GPU's float32 road, with the reference executor's float32 combine."""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

E, K, H, M = 8, 3, 64, 16


# ------------------------------------------------------------------------------------------------------------------
# helpers


def _inputs(rank: int, seed: int, t: int, dev: torch.device, hidden: int = H):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    x = (torch.randn(t, hidden, generator=g) * 3).bfloat16()
    rows = [torch.randperm(E, generator=g)[:K] for _ in range(t)]
    idx = torch.stack(rows).to(torch.int64) if rows else torch.zeros(0, K, dtype=torch.int64)
    idx[::4, 1] = -1
    if t > 5:
        idx[5] = -1  # a token that goes nowhere
    w = torch.rand(t, K, generator=g)
    b0 = torch.randn(t, hidden, generator=g).bfloat16()
    b1 = torch.randn(t, hidden, generator=g).bfloat16()
    return tuple(v.to(dev) for v in (x, idx, w, b0, b1))


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _np_handle(handle):
    from ep_core.handle import ARRAY_FIELDS
    from ep_torch._convert import to_numpy

    arrays = {f: to_numpy(getattr(handle, f)) for f in ARRAY_FIELDS if getattr(handle, f) is not None}
    return dataclasses.replace(
        handle, **arrays, cached_recv_src_metadata_before_sort=None, channel_linked_list=None
    )


def _reference(parts: list, rank: int, amr: bool) -> torch.Tensor:
    """``reference.combine(fp32_output=True)`` over every rank's ``(y, handle, weights, bias)`` (numpy)."""
    from ep_core import reference

    outs = reference.combine(
        [p[0] for p in parts],
        [p[1] for p in parts],
        topk_weights=None if parts[0][2] is None else [p[2] for p in parts],
        bias=None if parts[0][3] is None else [p[3] for p in parts],
        allow_multiple_reduction=amr,
        fp32_output=True,
    )
    return torch.from_numpy(outs[rank].combined_x)


def _part(y, handle, cw, bias):
    from ep_torch._convert import to_numpy

    return (
        to_numpy(y),
        _np_handle(handle),
        None if cw is None else to_numpy(cw),
        None if bias is None else tuple(to_numpy(b) for b in bias),
    )


def _gathered(part, n: int) -> list:
    every: list = [None] * n
    dist.all_gather_object(every, part)
    return every


def _poison(y: torch.Tensor, handle) -> None:
    """NaN in the rows of ``y`` that no received token reads, and garbage in the handle's metadata rows past the
    received count (worst-case sizes of a no-CPU-sync dispatch): the float32 road must ignore both, as the kernels
    and the reference do."""
    from ep_core import reference

    h = _np_handle(handle)
    num = int(h.psum_num_recv_tokens_per_scaleup_rank[-1])
    if handle.do_expand:
        unread = torch.from_numpy(~reference.valid_expanded_rows(h, y.shape[0])).to(y.device)
    else:
        unread = torch.arange(y.shape[0], device=y.device) >= num
    assert bool(unread.any()), "worst-case sizes leave rows no token reads"
    y[unread] = float("nan")
    meta = handle.recv_src_metadata
    if meta.shape[0] > num:
        g = torch.Generator().manual_seed(num)
        junk = torch.randint(-(1 << 30), 1 << 30, tuple(meta[num:].shape), generator=g, dtype=torch.int32)
        meta[num:] = junk.to(meta.device)


def _check_fp32(o32, w32, o16, w16, want, dev) -> None:
    assert o32.dtype == torch.float32 and o32.device == dev and o32.shape == o16.shape
    assert torch.equal(_bits(o32.bfloat16()), _bits(o16)), "the float32 output rounds to the bf16 combine"
    assert (w16 is None and w32 is None) or torch.equal(w16, w32)
    assert torch.equal(_bits(o32), _bits(want)), "the float32 output is bitwise the reference's"


# ------------------------------------------------------------------------------------------------------------------
# the bodies (one rank; CPU reference backend or CUDA)


def _combine_checks(rank: int, n: int, dev: torch.device, tr: str) -> None:
    import ep_torch
    from ep_torch.combine_out_dtype import combine_fp32_by_lanes

    cuda = dev.type == "cuda"
    kw = {
        "num_max_tokens_per_rank": M,
        "hidden": H,
        "num_topk": K,
        "explicitly_destroy": True,
        "transport": tr,
    }
    buf = ep_torch.EPBuffer(None, **kw)
    no_amr = ep_torch.EPBuffer(None, allow_multiple_reduction=False, **kw)
    rounds = ((0, buf, False, True), (1, buf, True, True), (2, no_amr, True, True), (3, no_amr, False, True))
    # no CPU sync: worst-case rows, the received count on the device only
    rounds += ((4, buf, False, False), (5, buf, True, False), (6, no_amr, True, False))
    for seed, b, expand, sync in rounds:
        t = 0 if (seed == 1 and rank == n - 1) else M - 2 * rank  # a rank with zero tokens
        x, idx, w, b0, b1 = _inputs(rank, seed, t, dev)
        ekw = {"do_expand": True, "expert_alignment": 4} if expand else {}
        if not sync:
            ekw["do_cpu_sync"] = False
        recv_x, _, recv_w, handle, _ = b.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E, **ekw)
        y = (recv_x.float() * (1.0 + 0.125 * rank)).bfloat16()
        if not sync:  # what no token reads may hold anything: NaN rows, garbage metadata past the count
            _poison(y, handle)
        cw = recv_w if not (expand and b is no_amr) else None
        for bias in (None, (b0, b1)):
            o16, w16, _ = b.combine(y, handle, topk_weights=cw, bias=bias)
            o32, w32, ev = b.combine(y, handle, topk_weights=cw, bias=bias, out_dtype=torch.float32)
            assert ev.event is None
            want = _reference(_gathered(_part(y, handle, cw, bias), n), rank, b.allow_multiple_reduction)
            _check_fp32(o32, w32, o16, w16, want, dev)
            if bias is not None and t and not expand and sync:
                assert not torch.equal(o32.bfloat16().float(), o32)  # float32 keeps bits bf16 drops
            if not cuda:  # the GPU's road, here against the reference executor's float32 combine
                lanes, lw = combine_fp32_by_lanes(b, y, handle, cw, bias)
                assert torch.equal(_bits(lanes), _bits(o32)), (seed, bias is None)
                assert (lw is None and w32 is None) or torch.equal(lw, w32)
    # the event of an async call; the refusal of another dtype on one rank, announced
    x, idx, w, b0, b1 = _inputs(rank, 9, M, dev)
    recv_x, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, num_experts=E)
    _, _, ev = buf.combine(recv_x, handle, out_dtype=torch.float32, async_with_compute_stream=True)
    ev.current_stream_wait()
    from ep_core.errors import EPPeerError

    # on CUDA every rank refuses alike: the GPU executors announce nothing on the host (each rank gives up its step)
    if cuda or rank == n - 1:
        with pytest.raises(TypeError, match="out_dtype"):
            buf.combine(recv_x, handle, out_dtype=torch.float16)
    else:
        with pytest.raises(EPPeerError, match=f"rank {n - 1}"):
            buf.combine(recv_x, handle, out_dtype=torch.float32)
    o16, _, _ = buf.combine(recv_x, handle)  # in step: the next calls pair
    o32, _, _ = buf.combine(recv_x, handle, out_dtype=torch.float32)
    assert torch.equal(_bits(o32.bfloat16()), _bits(o16))
    # hidden 16: the lane combines are wider (32) than the rows; the hint-sized buffer holds them
    if not cuda:
        with ep_torch.EPBuffer(None, **{**kw, "hidden": 16}) as small:
            x, idx, w, b0, b1 = _inputs(rank, 11, M, dev, hidden=16)
            recv_x, _, recv_w, handle, _ = small.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
            o32, w32, _ = small.combine(recv_x, handle, topk_weights=recv_w, bias=b0, out_dtype=torch.float32)
            lanes, lw = combine_fp32_by_lanes(small, recv_x, handle, recv_w, b0)
            assert torch.equal(_bits(lanes), _bits(o32)) and torch.equal(lw, w32)
    buf.destroy()
    no_amr.destroy()


def _round_trip(buf, rank: int, tokens: int, seed: int, dev: torch.device):
    x, idx, w, _, _ = _inputs(rank, seed, tokens, dev)
    recv_x, recv_idx, recv_w, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    out, out_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
    return [recv_x, recv_idx, recv_w, out, out_w], handle


def _same_all(a: list, b: list) -> bool:
    return all(torch.equal(_bits(p), _bits(q)) for p, q in zip(a, b, strict=True))


def _resize_checks(rank: int, n: int, dev: torch.device, tr: str) -> None:
    import ep_torch
    from ep_core.errors import EPMismatchError, EPPeerError, EPStateError

    mib2 = ep_torch.get_num_allocation_alignment()
    kw = {"num_topk": K, "deterministic": True, "explicitly_destroy": True, "transport": tr}
    buf = ep_torch.EPBuffer(
        None, num_max_tokens_per_rank=8, hidden=H, lb_allocation_plan_or_num_bytes=mib2, **kw
    )
    lb = buf.lb_storage
    lb[:16] = torch.arange(16, dtype=torch.uint8, device=dev) + rank
    _, old_handle = _round_trip(buf, rank, 8, 0, dev)
    buf.resize(num_max_tokens_per_rank=32, hidden=H, num_topk=K)
    assert buf.num_max_tokens_per_rank == 32
    assert buf.num_bytes == ep_torch.EPBuffer.get_buffer_size_hint(None, 32, H, K)
    assert buf.lb_storage is lb and torch.equal(lb[:16].cpu(), torch.arange(16, dtype=torch.uint8) + rank)
    got, _ = _round_trip(buf, rank, 32, 1, dev)
    with ep_torch.EPBuffer(None, num_max_tokens_per_rank=32, hidden=H, **kw) as fresh:
        want, _ = _round_trip(fresh, rank, 32, 1, dev)
    assert _same_all(got, want)
    with pytest.raises(EPStateError, match="stale"):  # every rank refuses it before any launch
        buf.combine(torch.zeros(old_handle.num_recv_tokens, H, device=dev).bfloat16(), old_handle)
    again, _ = _round_trip(buf, rank, 32, 1, dev)  # the refusal left the ranks in step
    assert _same_all(got, again)
    buf.resize(num_bytes=2 * mib2, num_max_tokens_per_rank=4)  # smaller, by bytes
    assert buf.num_bytes == 2 * mib2 and buf.num_max_tokens_per_rank == 4
    small, _ = _round_trip(buf, rank, 4, 2, dev)
    # a refusal on one rank: every rank raises, the buffer keeps its size and works
    if rank == n - 1:
        with pytest.raises(ValueError, match="num_bytes"):
            buf.resize(num_bytes=1000)
    else:
        with pytest.raises(EPPeerError, match=f"rank {n - 1}"):
            buf.resize(num_bytes=4 * mib2)
    assert buf.num_bytes == 2 * mib2
    assert _same_all(small, _round_trip(buf, rank, 4, 2, dev)[0])
    # ranks that disagree: every rank raises, nothing released, the next resize refused until reset()
    with pytest.raises(EPMismatchError, match="num_max_tokens_per_rank"):
        buf.resize(num_max_tokens_per_rank=16 + (rank == 0), hidden=H)
    with pytest.raises(EPStateError, match="reset"):
        buf.resize(num_max_tokens_per_rank=16, hidden=H)
    buf.reset()  # clears the failed agreement on every rank (the host steps' state too)
    buf.resize(num_max_tokens_per_rank=16, hidden=H)
    assert buf.num_max_tokens_per_rank == 16
    assert _same_all(small, _round_trip(buf, rank, 4, 2, dev)[0])
    buf.destroy()


def _send_recv_checks(rank: int, n: int, dev: torch.device, tr: str) -> None:
    from ep_core import BufferAllocator
    from ep_core.errors import EPMismatchError, EPPeerError, EPStateError, EPTimeoutError
    from ep_torch import BucketBuffer

    plan = BufferAllocator()
    plan.tensor("d1", (5, 3), "float32")
    plan.tensor("d2", (8,), "bfloat16")
    plan.tensor("s2", (8,), "bfloat16")
    buf = BucketBuffer(
        None, plan, explicitly_destroy=True, transport=tr, num_gpu_timeout_secs=2, num_cpu_timeout_secs=60
    )
    d1, d2, s2 = buf.tensors["d1"], buf.tensors["d2"], buf.tensors["s2"]

    def srcs(r: int, salt: int):
        g = torch.Generator().manual_seed(100 * salt + r)
        return (torch.randn(5, 3, generator=g) * 10).to(dev), torch.randn(8, generator=g).bfloat16().to(dev)

    def clear():
        d1.fill_(-7.0)
        d2.fill_(-7.0)

    for salt, step in ((1, 1), (2, -1)):  # rings both ways: one src outside the storage, one inside it
        clear()
        a, b = srcs(rank, salt)
        s2.copy_(b)
        h = buf.send_recv([a, s2], [d1, d2], (rank + step) % n, (rank - step) % n)
        got = h.wait()
        wa, wb = srcs((rank - step) % n, salt)
        assert got[0] is d1 and got[1] is d2 and h.num_sms == 0
        assert torch.equal(d1, wa) and torch.equal(_bits(d2), _bits(wb)), (salt, step)
        s2.fill_(0)  # the next ring overwrites it only after every rank's copy of it landed (stream order)
    clear()
    a, _ = srcs(rank, 3)
    got = buf.send_recv(a, d1, rank ^ 1, rank ^ 1).current_stream_wait(release_handle=True)  # a swap
    assert got is d1 and torch.equal(d1, srcs(rank ^ 1, 3)[0])
    clear()
    a, _ = srcs(rank, 4)
    assert torch.equal(buf.send_recv(a, d1, rank, rank).wait(), a)  # to itself
    clear()
    a, _ = srcs(rank, 5)
    if rank == 0:  # one transfer, the other ranks idle
        assert buf.send_recv(a, None, n - 1, None).wait() is None
    elif rank == n - 1:
        assert torch.equal(buf.send_recv(None, d1, None, 0).wait(), srcs(0, 5)[0])
    else:
        assert buf.send_recv().wait() is None
    # a refusal on one rank: announced (the agreement is a host exchange on every backend)
    a, _ = srcs(rank, 7)
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    if rank == n - 1:
        with pytest.raises(ValueError, match="storage"):
            buf.send_recv(a, torch.zeros(5, 3, device=dev), nxt, prv)
    else:
        with pytest.raises(EPPeerError, match=f"rank {n - 1}"):
            buf.send_recv(a, d1, nxt, prv)
    clear()
    assert torch.equal(buf.send_recv(a, d1, nxt, prv).wait(), srcs(prv, 7)[0])
    # calls that do not pair: every rank raises, refused until reset()
    with pytest.raises(EPMismatchError, match="do not pair"):
        buf.send_recv(a, d1, nxt, rank)
    with pytest.raises(EPStateError, match="reset"):
        buf.send_recv(a, d1, nxt, prv)
    buf.reset()
    clear()
    assert torch.equal(buf.send_recv(a, d1, nxt, prv).wait(), srcs(prv, 7)[0])
    if dev.type == "cuda":
        # a peer that never sends: the bounded wait expires and the next call raises naming it (sticky: the
        # elastic waits' timeout asks for a new buffer)
        if rank == 1:
            from ep_torch.bucket_send_recv import _gpu_transfers

            buf._ops += 1  # what the agreement would count; rank 0 never writes its arrival
            _gpu_transfers(buf, [], [d1], [buf._offset("d1", d1)], None, 0, [])
            torch.cuda.synchronize()  # the wait gives up after num_gpu_timeout_secs
            time.sleep(0.2)
            with pytest.raises(EPTimeoutError, match="rank 0"):
                buf.send_recv()
        dist.barrier()
        torch.cuda.synchronize()
    buf.destroy()


def _ranks(rank: int, n: int, device: str = "cpu") -> None:
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(0)  # every process on the one GPU: ipc (NCCL refuses two ranks on one GPU)
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    tr = "ipc" if cuda else "reference"
    _combine_checks(rank, n, dev, tr)
    _resize_checks(rank, n, dev, tr)
    _send_recv_checks(rank, n, dev, tr)
    dist.barrier()


def _ranks_cuda(rank: int, n: int) -> None:
    _ranks(rank, n, "cuda")


# ------------------------------------------------------------------------------------------------------------------
# the loopback domain and one rank over nccl (GPU only)


def _loopback() -> None:
    from ep_torch.loopback import LoopbackGroup

    dev = torch.device("cuda", torch.cuda.current_device())
    modes = ((0, False, True), (1, True, True), (2, True, False))  # (seed, expand, allow_multiple_reduction)

    def round_(group, bufs, seed, expand, n):
        data = [_inputs(r, seed, M - r, dev) for r in range(n)]
        ekw = {"do_expand": True, "expert_alignment": 4} if expand else {}
        outs = group.run(
            lambda r: bufs[r].dispatch(
                data[r][0],
                topk_idx=data[r][1],
                topk_weights=data[r][2],
                num_experts=E,
                do_cpu_sync=False,
                **ekw,
            )
        )
        ys = [(o[0].float() * (1.0 + 0.125 * r)).bfloat16() for r, o in enumerate(outs)]
        cws = [None if (expand and not bufs[0].allow_multiple_reduction) else o[2] for o in outs]
        biases = [(d[3], d[4]) for d in data]
        f32 = group.run(
            lambda r: bufs[r].combine(
                ys[r], outs[r][3], topk_weights=cws[r], bias=biases[r], out_dtype=torch.float32
            )
        )
        b16 = group.run(lambda r: bufs[r].combine(ys[r], outs[r][3], topk_weights=cws[r], bias=biases[r]))
        torch.cuda.synchronize()
        return [_part(ys[r], outs[r][3], cws[r], biases[r]) for r in range(n)], f32, b16

    # the float32 road's torch kernels, loaded once in the process by one rank that waits for nobody
    # (ep_torch.loopback: no kernel may be loaded while a rank's communication kernel waits for later ranks)
    one = LoopbackGroup(1, device="cuda")
    for seed, expand, amr in modes:
        bufs = one.elastic_buffers(
            num_max_tokens_per_rank=M, hidden=H, num_topk=K, allow_multiple_reduction=amr
        )
        round_(one, bufs, seed, expand, 1)
        bufs[0].destroy()
    group = LoopbackGroup(2, device="cuda", gpu_timeout_secs=20)
    for seed, expand, amr in modes:
        bufs = group.elastic_buffers(
            num_max_tokens_per_rank=M, hidden=H, num_topk=K, allow_multiple_reduction=amr
        )
        parts, f32, b16 = round_(group, bufs, seed, expand, 2)
        for r in range(2):
            want = _reference(parts, r, amr)
            _check_fp32(f32[r][0], f32[r][1], b16[r][0], b16[r][1], want, dev)
        for b in bufs:
            b.destroy()
    group.close()
    print("loopback ok")


def _nccl_one(rank: int, n: int) -> None:
    import ep_torch

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    mib2 = ep_torch.get_num_allocation_alignment()
    buf = ep_torch.EPBuffer(
        dist.group.WORLD,
        num_max_tokens_per_rank=M,
        hidden=H,
        num_topk=K,
        lb_allocation_plan_or_num_bytes=mib2,
        explicitly_destroy=True,
    )
    print(
        f"rank {rank}: transport {buf.transport} ({buf.transport_choice.reason})"
    )  # nccl, or ipc without NCCL 2.28.7
    m = buf.lb_get_redundancy_mapping(torch.tensor([5, 0, 3], dtype=torch.int32, device="cuda"), 2)
    assert m.is_cuda and m.dtype == torch.int32 and tuple(m.shape) == (buf.num_nvlink_ranks, 2)
    x, idx, w, b0, b1 = _inputs(rank, 5, M, dev)
    recv_x, _, recv_w, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    o16, w16, _ = buf.combine(recv_x, handle, topk_weights=recv_w, bias=(b0, b1))
    o32, w32, _ = buf.combine(recv_x, handle, topk_weights=recv_w, bias=(b0, b1), out_dtype=torch.float32)
    _check_fp32(o32, w32, o16, w16, _reference([_part(recv_x, handle, recv_w, (b0, b1))], 0, True), dev)
    buf.resize(num_max_tokens_per_rank=2 * M, hidden=H, num_topk=K)
    assert buf.num_max_tokens_per_rank == 2 * M
    got, _ = _round_trip(buf, rank, 2 * M, 6, dev)
    x, idx = _inputs(rank, 6, 2 * M, dev)[:2]
    want = torch.where((idx >= 0).any(1)[:, None], x, torch.zeros_like(x))  # one rank: x back where it went
    assert torch.equal(_bits(got[3]), _bits(want))
    torch.cuda.synchronize()
    buf.destroy()


# ------------------------------------------------------------------------------------------------------------------
# tests


def _script(args: list[str], limit: float) -> None:
    from ep_torch_testing import run_script  # loaded by conftest.py

    env = {k: v for k, v in os.environ.items() if k not in ("EPKIT_SCALEUP_RANKS", "EPKIT_TORCH_TRANSPORT")}
    code, out = run_script(__file__, args, limit, env=env, what=" ".join(args) + ": ")
    assert code == 0, out[-4000:]


def test_bodies_on_cpu_reference():
    """The GPU tests' bodies on 2 gloo ranks of the CPU reference backend (and the GPU's float32 road there)."""
    _script(["_ranks", "2"], 240)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_gpu_ipc_two_processes():
    _script(["_ranks_cuda", "2"], 240)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_gpu_loopback_combine_fp32():
    _script(["_loopback", "0"], 180)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_gpu_nccl_one_rank():
    _script(["_nccl_one", "1"], 180)


if __name__ == "__main__":
    name, count = sys.argv[1], int(sys.argv[2])
    if name == "_ranks":
        from ep_torch_testing import spawn_cpu

        spawn_cpu(_ranks, count)
    elif name == "_loopback":
        _loopback()
    else:
        from ep_torch.launch import spawn

        spawn(globals()[name], count, backend="nccl" if name == "_nccl_one" else "gloo")
