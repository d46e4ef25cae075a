"""Issue 41's survey: one-rank errors on every surface, each case on 2 gloo ranks (CPU reference backend).

``python collective_safety_survey.py CASE OUTDIR`` runs one case (each rank writes ``OUTDIR/<rank>.json``);
``python collective_safety_survey.py --all OUTFILE [CASE ...]`` runs the cases one by one, each under a wall-clock
limit, and writes a table of verdicts: **clear** (every rank raised an ep error, the peers' naming the culprit rank,
and the two checked valid rounds after it are exact, after a ``reset()`` where the case calls for one), **unclear**
(an error naming no rank, a raw error, a rank that returned while its peer raised, rounds that raise),
**silent** (a valid result differs from the reference, or a peer returned rows of another call), **hang** (past the
limit). It runs against whatever ep tree is on PYTHONPATH (the 'before' numbers come from the starting commit's
tree), so it uses only what both have: ``reset`` and ``num_cpu_timeout_secs`` are used where they exist.

The CPU tests (test_torch_collective_safety_surfaces.py) run some of these cases and check the verdicts.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

T, H, E, K, M = 6, 32, 8, 2, 8
TIMEOUT = 3.0  # every buffer's host timeout in the survey (num_cpu_timeout_secs / EPKIT_CPU_TIMEOUT_SECS)
CULPRIT = 0
# EP_SURVEY_DEVICE=cuda: the same cases on the GPU (processes sharing GPU 0 over the ipc transport, a gloo group)
DEV = os.environ.get("EP_SURVEY_DEVICE", "cpu")
GPU_KW = {"transport": "ipc"} if DEV == "cuda" else {}


# ---------------------------------------------------------------------------------------------------------------
# inputs and references (exact: small integers in bf16, so every sum is exact)


def _inputs(seed: int, rank: int, tokens: int = T):
    import torch

    g = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.randint(-4, 5, (tokens, H), generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)]).to(torch.int64)
    w = torch.ones(tokens, K, dtype=torch.float32)
    return x.to(DEV), idx.to(DEV), w.to(DEV)


def _all_inputs(seed: int, world: int):
    return [_inputs(seed, r) for r in range(world)]


def _v1_rows(seed: int, world: int, rank: int):
    """V1 normal dispatch's rows on `rank`: source rank, then token, one per token with an expert on `rank`."""
    import torch

    epr = E // world
    rows = []
    for _s, (x, idx, _) in enumerate(_all_inputs(seed, world)):
        for t in range(x.shape[0]):
            if any(int(e) // epr == rank for e in idx[t]):
                rows.append(x[t])
    return torch.stack(rows) if rows else torch.zeros(0, H, dtype=torch.bfloat16)


def _eq(a, b) -> bool:
    import torch

    return (
        isinstance(a, torch.Tensor)
        and a.shape == b.shape
        and bool(torch.equal(a.float().cpu(), b.float().cpu()))
    )


def _outcome(fn):
    """("ok", value) or ("TypeName: message", None)."""
    try:
        return "ok", fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"[:600], None


# ---------------------------------------------------------------------------------------------------------------
# the surfaces' valid rounds (each returns True when exact)


def _v1(low_latency: bool = False, **kw):
    import inspect

    from ep_torch import Buffer

    if "num_cpu_timeout_secs" in inspect.signature(Buffer.__init__).parameters:
        kw["num_cpu_timeout_secs"] = TIMEOUT
    return Buffer(None, low_latency_mode=low_latency, explicitly_destroy=True, **GPU_KW, **kw)


def _v1_layout(buf, idx):
    return buf.get_dispatch_layout(idx, E)


def _v1_round(buf, seed: int, rank: int, world: int) -> bool:
    x, idx, w = _inputs(seed, rank)
    ntr, _, nte, itr, _ = _v1_layout(buf, idx)
    recv_x, _, _, _, handle, _ = buf.dispatch(
        x,
        num_tokens_per_rank=ntr,
        is_token_in_rank=itr,
        num_tokens_per_expert=nte,
        topk_idx=idx,
        topk_weights=w,
    )
    ok = _eq(recv_x, _v1_rows(seed, world, rank))
    combined, _, _ = buf.combine(recv_x, handle)
    epr = E // world
    dest = (idx // epr).unsqueeze(-1) == __import__("torch").arange(world, device=idx.device)
    want = x.float() * dest.any(1).sum(1, keepdim=True)
    return ok and _eq(combined, want.to(combined.dtype))


def _ll_counts(seed: int, rank: int, world: int) -> list[int]:
    epr = E // world
    want = [0] * epr
    for _xs, ids, _ in _all_inputs(seed, world):
        for e in ids.flatten().tolist():
            if e // epr == rank:
                want[e - rank * epr] += 1
    return want


def _ll_round(buf, seed: int, rank: int, world: int) -> bool:
    import torch

    x, idx, w = _inputs(seed, rank)
    recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    epr = E // world
    want_count = torch.zeros(epr, dtype=torch.int64)
    for _s, (_xs, ids, _) in enumerate(_all_inputs(seed, world)):
        for e in ids.flatten().tolist():
            if e // epr == rank:
                want_count[e - rank * epr] += 1
    ok = bool(torch.equal(count.to(torch.int64).cpu(), want_count))
    for e in range(epr):  # expert e's rows, source rank then token
        rows = [
            xs[t]
            for s, (xs, ids, _) in enumerate(_all_inputs(seed, world))
            for t in range(xs.shape[0])
            if rank * epr + e in ids[t].tolist()
        ]
        got = recv[e, : int(count[e])]
        ok = ok and _eq(got, torch.stack(rows) if rows else got[:0])
    combined, _, _ = buf.low_latency_combine(recv, idx, w, handle)
    return ok and _eq(combined, (x.float() * K).to(torch.bfloat16))


# V1 low-latency mode's native road (issue 41, session 3): the CPU stand-in of its kernels (ll_native_standin.py;
# EP_SURVEY_DEVICE=cuda: the real kernels over ipc). Surfaces "lln" (the default host envelope, agreed once per
# signature change) and "llnc" (ll_native_agree="call": a host step every call); "llnd": the default mode's cases
# followed by one more valid call where the faulty one returned, then reset() (on the GPU the kernels' record of a
# fault is raised at the rank's next call: the CPU stand-in's receive runs inside the call, so it raises there).
_STANDIN_DIR: str | None = None


def _v1_native(**kw):
    return _v1(low_latency=True, ll_native=True, **kw)


def _standin() -> None:
    if DEV == "cuda" or _STANDIN_DIR is None:
        return
    import importlib.util

    path = Path(__file__).with_name("ll_native_standin.py")
    spec = importlib.util.spec_from_file_location("ll_native_standin", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.install(_STANDIN_DIR, TIMEOUT)


def _ll_wide(seed: int, rank: int, hidden: int):
    """``_inputs`` with ``hidden`` channels (the same top-k ids)."""
    import torch

    g = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.randint(-4, 5, (T, hidden), generator=g).to(torch.bfloat16).to(DEV)
    return (x, *_inputs(seed, rank)[1:])


def _ll_rows_ok(recv, count, seed: int, rank: int, world: int, hidden: int) -> bool:
    import torch

    epr = E // world
    every = [_ll_wide(seed, r, hidden) for r in range(world)]
    if count.to(torch.int64).cpu().tolist() != _ll_counts(seed, rank, world):
        return False
    for e in range(epr):
        rows = [
            xs[t] for xs, ids, _ in every for t in range(xs.shape[0]) if rank * epr + e in ids[t].tolist()
        ]
        got = recv[e, : int(count[e])]
        if not _eq(got, torch.stack(rows) if rows else got[:0]):
            return False
    return True


def _ll_wide_round(buf, seed, rank, world, hidden, dispatch_kw=None, combine_kw=None, m=M) -> bool:
    """One dispatch + combine at ``hidden`` (plain unless the keywords say otherwise), checked where the call is
    plain (an FP8 dispatch's rows and its combine are not checked)."""
    import torch

    x, idx, w = _ll_wide(seed, rank, hidden)
    dkw = {"use_fp8": False, **(dispatch_kw or {})}
    recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, m, E, **dkw)
    fp8 = dkw["use_fp8"]
    ok = fp8 or _ll_rows_ok(recv, count, seed, rank, world, hidden)
    if fp8:
        recv = recv[0].to(torch.bfloat16)
    got = buf.low_latency_combine(recv, idx, w, handle, **(combine_kw or {}))[0]
    return bool(ok and (fp8 or _eq(got, (x.float() * K).to(torch.bfloat16))))


def _lln_logfmt_alone(buf, rank, world):
    """A plain round at hidden 512 first (every rank agrees it), then only the culprit combines with LogFMT: its
    signature alone changes."""
    ok = _ll_wide_round(buf, 67, rank, world, LOGFMT_H)
    return _ll_wide_round(buf, 68, rank, world, LOGFMT_H, None, {"use_logfmt": rank == CULPRIT}) and ok


def _lln_fp8_alone(buf, rank, world):
    """A plain round at hidden 128, then only the culprit dispatches FP8 (valid alone): the peer reads its rows."""
    ok = _ll_wide_round(buf, 69, rank, world, 128)
    return _ll_wide_round(buf, 70, rank, world, 128, {"use_fp8": rank == CULPRIT}) and ok


def _lln_m_alone(buf, rank, world):
    """Only the culprit passes another num_max_dispatch_tokens_per_rank (valid alone: another region layout)."""
    return _ll_wide_round(buf, 71, rank, world, H, m=2 * M if rank == CULPRIT else M)


def _lln_other_dispatch(buf, rank, world):
    """Two dispatches, then the culprit combines the first one's handle, the peer the second one's."""
    import torch

    x, idx, w = _inputs(72, rank)
    r1, _, h1, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    r2, _, h2, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    recv, handle = (r1, h1) if rank == CULPRIT else (r2, h2)
    got = buf.low_latency_combine(recv, idx, w, handle)[0]
    return _eq(got, (x.float() * K).to(torch.bfloat16))


def _v2(**kw):
    from ep_torch import ElasticBuffer

    args = dict(num_max_tokens_per_rank=M, hidden=H, num_topk=K, num_cpu_timeout_secs=TIMEOUT, **GPU_KW)
    args.update(kw)
    return ElasticBuffer(None, explicitly_destroy=True, **args)


def _v2_round(buf, seed: int, rank: int, world: int) -> bool:
    from ep_core import reference
    from ep_torch._convert import to_numpy

    inputs = _all_inputs(seed, world)
    x, idx, w = inputs[rank]
    recv_x, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    want = reference.dispatch(
        [to_numpy(a.cpu()) for a, _, _ in inputs],
        [b.cpu().numpy() for _, b, _ in inputs],
        [c.cpu().numpy() for _, _, c in inputs],
        num_experts=E,
        num_max_tokens_per_rank=M,
    )[rank]
    got = to_numpy(recv_x.cpu())
    ok = got.shape == want.recv_x.shape and got.tobytes() == want.recv_x.tobytes()
    combined = buf.combine(recv_x, handle)[0]
    return ok and combined.shape == x.shape


def _pp(**kw):
    from ep_torch import ElasticBuffer

    buf = ElasticBuffer(
        None,
        num_bytes=ElasticBuffer.get_pp_buffer_size_hint(4096, 2),
        num_cpu_timeout_secs=TIMEOUT,
        explicitly_destroy=True,
        **GPU_KW,
    )
    buf.pp_set_config(4096, 2)
    return buf


def _pp_round(buf, seed: int, rank: int, world: int) -> bool:
    import torch

    t = torch.arange(16, dtype=torch.float32, device=DEV) + seed * 100
    if rank == 0:
        buf.pp_send(t, 1)
        buf.barrier()  # the sender's buffer outlives the send (a freed backend drops its sends in flight)
        return True
    got = torch.zeros(16, device=DEV)
    buf.pp_recv(got, 0)
    buf.barrier()
    return _eq(got, t)


def _agrs():
    import torch
    from ep_torch import ElasticBuffer

    need = ElasticBuffer.get_agrs_num_max_session_bytes(None, [(16,)] * 4, torch.float32)
    buf = ElasticBuffer(
        None,
        num_bytes=ElasticBuffer.get_agrs_buffer_size_hint(None, need),
        num_cpu_timeout_secs=TIMEOUT,
        explicitly_destroy=True,
        **GPU_KW,
    )
    buf.agrs_set_config(need, 4)
    return buf


def _agrs_round(buf, seed: int, rank: int, world: int) -> bool:
    import torch

    with buf.agrs_new_session():
        x = torch.arange(16, dtype=torch.float32, device=DEV) + rank * 1000 + seed
        got, handle = buf.all_gather(x)
        handle()
        want = torch.stack([torch.arange(16, dtype=torch.float32) + r * 1000 + seed for r in range(world)])
        return _eq(got, want)


def _bucket(**kw):
    from ep_torch import BucketBuffer

    return BucketBuffer(
        None,
        2 << 20,
        explicitly_destroy=True,
        num_cpu_timeout_secs=TIMEOUT,
        **{**(GPU_KW or {"transport": "reference"}), **kw},
    )


def _bucket_val(seed: int, rank: int, n: int = 64):
    import torch

    g = torch.Generator().manual_seed(seed * 10 + rank)
    return torch.randint(-8, 8, (n,), generator=g).float()


def _bucket_round(buf, seed: int, rank: int, world: int) -> bool:
    t = buf.storage[: 64 * 4].view(__import__("torch").float32)
    t.copy_(_bucket_val(seed, rank).to(t.device))
    got = buf.all_reduce(t).wait()
    want = sum(_bucket_val(seed, r) for r in range(world))
    return _eq(got, want)


ENGRAM_LAYERS, ENGRAM_H, ENGRAM_T, ENGRAM_K = [4], 16, 4, 2


def _engram(**kw):
    from ep_torch import EngramBuffer

    args = dict(
        num_gpu_bytes=2 << 20,
        num_rdma_storage_bytes=2 << 20,
        use_cpu_rdma_storage=True,
        num_allocated_qps=1,
        qp_depth=1,
        explicitly_destroy=True,
        num_cpu_timeout_secs=TIMEOUT,
        **(GPU_KW or {"transport": "reference"}),
    )
    args.update(kw)
    buf = EngramBuffer(None, **args)
    buf.set_config(ENGRAM_LAYERS, ENGRAM_H, ENGRAM_T, ENGRAM_K)
    return buf


def _engram_shard(seed: int, r: int):
    import torch

    g = torch.Generator().manual_seed(seed * 10 + r)
    return torch.randint(-8, 8, (ENGRAM_LAYERS[0], ENGRAM_H), generator=g).to(torch.bfloat16)


def _engram_round(buf, seed: int, rank: int, world: int) -> bool:
    import torch

    buf.write([_engram_shard(seed, rank).to(DEV)])
    g = torch.Generator().manual_seed(seed + 1000 + rank)
    idx = torch.randint(0, world * ENGRAM_LAYERS[0], (1, ENGRAM_T, ENGRAM_K), generator=g).to(torch.int32)
    got = buf.fetch(idx.to(DEV))[0]()
    table = torch.cat([_engram_shard(seed, r) for r in range(world)])
    want = table[idx[0].reshape(-1).long()].reshape(ENGRAM_T, ENGRAM_K * ENGRAM_H)
    ok = _eq(got, want)
    buf.barrier()  # every rank fetched before the next write
    return ok


ROUNDS = {
    "v1": _v1_round,
    "v1n": _v1_round,
    "ll": _ll_round,
    "v2": _v2_round,
    "pp": _pp_round,
    "agrs": _agrs_round,
    "bucket": _bucket_round,
    "engram": _engram_round,
}


# ---------------------------------------------------------------------------------------------------------------
# the cases: (surface, fault(buf, rank, world) -> value checked by the peers, whether a reset follows)


def _v1_bad_dispatch(change):
    """A V1 normal dispatch where rank 0's arguments are changed by `change(kwargs)`; returns the peer's recv_x
    check."""

    def fault(buf, rank, world):
        x, idx, w = _inputs(50, rank)
        ntr, _, nte, itr, _ = _v1_layout(buf, idx)
        kw = dict(
            num_tokens_per_rank=ntr,
            is_token_in_rank=itr,
            num_tokens_per_expert=nte,
            topk_idx=idx,
            topk_weights=w,
        )
        if rank == CULPRIT:
            x = change(kw, x)
        recv_x = buf.dispatch(x, **kw)[0]
        return _eq(recv_x, _v1_rows(50, world, rank))

    return fault


def _oob(kw, x):
    kw["topk_idx"] = kw["topk_idx"].clone()
    kw["topk_idx"][0, 0] = E + 3
    return x


def _wshape(kw, x):
    kw["topk_weights"] = kw["topk_weights"][:, :1].contiguous()
    return x


def _missing(kw, x):
    kw["num_tokens_per_rank"] = None
    return x


def _align0(kw, x):
    kw["expert_alignment"] = 0
    return x


def _worst(kw, x):
    kw["num_worst_tokens"] = 1
    return x


def _too_many(kw, x):
    import torch

    x2, idx2, w2 = _inputs(51, 0, tokens=M + 1)
    kw["topk_idx"], kw["topk_weights"] = idx2, w2
    kw["num_tokens_per_rank"], _, kw["num_tokens_per_expert"], kw["is_token_in_rank"], _ = _v1_layout(
        _too_many.buf, idx2
    )
    return torch.as_tensor(x2)


def _v1_layout_skip(buf, rank, world):
    x, idx, w = _inputs(50, rank)
    if rank == CULPRIT:
        buf.get_dispatch_layout(idx.to(torch_float()), E)  # raises: this rank never dispatches this step
        return None
    ntr, _, nte, itr, _ = _v1_layout(buf, idx)
    recv_x = buf.dispatch(
        x,
        num_tokens_per_rank=ntr,
        is_token_in_rank=itr,
        num_tokens_per_expert=nte,
        topk_idx=idx,
        topk_weights=w,
    )[0]
    return _eq(recv_x, _v1_rows(50, world, rank))


def torch_float():
    import torch

    return torch.float32


def _v1_skip_combine(buf, rank, world):
    x, idx, _w = _inputs(50, rank)
    ntr, _, nte, itr, _ = _v1_layout(buf, idx)
    kw = dict(num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte, topk_idx=idx)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, **kw)
    if rank == CULPRIT:  # skips its combine: its next dispatch meets the peer's combine
        recv_x = buf.dispatch(x, **kw)[0]
        return _eq(recv_x, _v1_rows(50, world, rank))
    return buf.combine(recv_x, handle)[0] is not None


def _v1_foreign_handle(buf, rank, world):
    other = _v1()
    x, idx, _w = _inputs(50, rank)
    ntr, _, nte, itr, _ = _v1_layout(buf, idx)
    kw = dict(num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte, topk_idx=idx)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, **kw)
    x2, idx2, _ = _inputs(52, rank)
    o = other.get_dispatch_layout(idx2, E)
    recv2, _, _, _, handle2, _ = other.dispatch(
        x2, num_tokens_per_rank=o[0], is_token_in_rank=o[3], num_tokens_per_expert=o[2], topk_idx=idx2
    )
    if rank == CULPRIT:
        handle = handle2  # a handle of another buffer (of another layout)
        recv_x = recv2
    return buf.combine(recv_x, handle)[0] is not None


def _v1_combine_rows(buf, rank, world):
    x, idx, _w = _inputs(50, rank)
    ntr, _, nte, itr, _ = _v1_layout(buf, idx)
    recv_x, _, _, _, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte, topk_idx=idx
    )
    if rank == CULPRIT:
        recv_x = recv_x[:-1]
    return buf.combine(recv_x, handle)[0] is not None


def _v1_dispatched(buf, rank, seed=50):
    x, idx, w = _inputs(seed, rank)
    ntr, _, nte, itr, _ = _v1_layout(buf, idx)
    kw = dict(num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte, topk_idx=idx)
    recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, topk_weights=w, **kw)
    return x, kw, recv_x, recv_w, handle


def _v1_combine_weights_one_rank(buf, rank, world):
    """Only the culprit asks combine for the top-k weights; the peer combines without them (a valid call, its
    result exact) and goes on to its next dispatch, which meets the culprit's weight step."""
    x, kw, recv_x, recv_w, handle = _v1_dispatched(buf, rank)
    if rank == CULPRIT:
        return buf.combine(recv_x, handle, topk_weights=recv_w)[0] is not None
    buf.combine(recv_x, handle)
    return _eq(buf.dispatch(x, **kw)[0], _v1_rows(50, world, rank))


def _v1_combine_weights_k(buf, rank, world):
    """The culprit's combine weights have another top-k width than the peer's."""
    _x, _kw, recv_x, recv_w, handle = _v1_dispatched(buf, rank)
    if rank == CULPRIT:
        recv_w = recv_w[:, :1]
    return buf.combine(recv_x, handle, topk_weights=recv_w)[0] is not None


def _v1_combine_weights_other_dispatch(buf, rank, world):
    """The culprit combines with the handle of an earlier dispatch of other routing (same buffer, same
    generation): the rows of the weight reduction would pair with the wrong counts."""
    a = _v1_dispatched(buf, rank, 50)
    b = _v1_dispatched(buf, rank, 51)
    _x, _kw, recv_x, recv_w, handle = a if rank == CULPRIT else b
    return buf.combine(recv_x, handle, topk_weights=recv_w)[0] is not None


def _v1_after_destroy(buf, rank, world):
    dead = _v1()
    _v1_round(dead, 53, rank, world)
    dead.destroy()
    x, idx, w = _inputs(50, rank)
    use = dead if rank == CULPRIT else buf
    ntr, _, nte, itr, _ = _v1_layout(buf, idx)
    recv_x = use.dispatch(
        x,
        num_tokens_per_rank=ntr,
        is_token_in_rank=itr,
        num_tokens_per_expert=nte,
        topk_idx=idx,
        topk_weights=w,
    )[0]
    return _eq(recv_x, _v1_rows(50, world, rank))


def _ll_bad(change):
    def fault(buf, rank, world):
        x, idx, _w = _inputs(60, rank)
        kw = dict(use_fp8=False)
        m = M
        if rank == CULPRIT:
            x, idx, m = change(kw, x, idx, m)
        _recv, count, _handle, _, _ = buf.low_latency_dispatch(x, idx, m, E, **kw)
        return count.tolist() == _ll_counts(60, rank, world)

    return fault


def _ll_dtype(kw, x, idx, m):
    return x.float(), idx, m


def _ll_too_many(kw, x, idx, m):
    x2, idx2, _ = _inputs(61, 0, tokens=M + 1)
    return x2, idx2, m


def _ll_oob(kw, x, idx, m):
    idx = idx.clone()
    idx[0, 0] = E + 2
    return x, idx, m


def _ll_stats(kw, x, idx, m):
    import torch

    kw["cumulative_local_expert_recv_stats"] = torch.zeros(3, dtype=torch.int32, device=DEV)
    return x, idx, m


def _ll_combine_bad(change):
    def fault(buf, rank, world):
        x, idx, w = _inputs(62, rank)
        recv, _count, handle, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
        if change is _llc_foreign:  # every rank dispatches on the other buffer (a collective)
            x2, idx2, _ = _inputs(63, rank)
            r2, _, h2, _, _ = _ll_foreign_buffer.low_latency_dispatch(x2, idx2, M, E, use_fp8=False)
            _llc_foreign.got = (r2, idx2, h2)
        if rank == CULPRIT:
            recv, idx, w, handle = change(buf, rank, recv, idx, w, handle)
        return buf.low_latency_combine(recv, idx, w, handle)[0] is not None

    return fault


def _llc_xshape(buf, rank, recv, idx, w, handle):
    return recv[:, :-1].contiguous(), idx, w, handle


def _llc_wdtype(buf, rank, recv, idx, w, handle):
    return recv, idx, w.to(__import__("torch").bfloat16), handle


def _llc_foreign(buf, rank, recv, idx, w, handle):
    r2, idx2, h2 = _llc_foreign.got
    return r2, idx2, w, h2


_ll_foreign_buffer = None


def _ll_after_destroy(buf, rank, world):
    dead = _v1(low_latency=True)
    _ll_round(dead, 64, rank, world)
    dead.destroy()
    use = dead if rank == CULPRIT else buf
    x, idx, _w = _inputs(60, rank)
    return use.low_latency_dispatch(x, idx, M, E, use_fp8=False)[1].tolist() == _ll_counts(60, rank, world)


def _v2_skip_combine(buf, rank, world):
    x, idx, w = _inputs(70, rank)
    recv_x, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    if rank == CULPRIT:
        return buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)[0].shape[0]
    return buf.combine(recv_x, handle)[0].shape[0]


def _v2_foreign_handle(buf, rank, world):
    other = _v2(num_max_tokens_per_rank=M + 4)
    x, idx, w = _inputs(71, rank)
    recv_x, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    r2, _, _, h2, _ = other.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    if rank == CULPRIT:
        recv_x, handle = r2, h2
    return buf.combine(recv_x, handle)[0].shape[0]


def _v2_construct(buf, rank, world):
    b = _v2(num_topk=64 if rank == CULPRIT else K)
    b.destroy()
    return True


def _v2_construct_cast(buf, rank, world):
    """A constructor argument that ep_torch's casts cannot read (a string) on one rank."""
    b = _v2(hidden="wide" if rank == CULPRIT else H)
    b.destroy()
    return True


def _v2_construct_retry(buf, rank, world):
    """Rank 0's constructor fails and it retries; rank 1 retries when its constructor raised: rank 1 must see an
    error first instead of pairing its one constructor with rank 0's retry. Returns each attempt's outcome."""
    attempts = []
    for attempt in range(2):
        out, b = _outcome(lambda a=attempt: _v2(num_topk=64 if rank == CULPRIT and a == 0 else K))
        attempts.append(out[:200])
        if b is not None:
            b.destroy()
            break
    return attempts


def _agrs_outside(buf, rank, world):
    import torch

    x = torch.arange(16, dtype=torch.float32, device=DEV) + rank
    if rank == CULPRIT:
        got, handle = buf.all_gather(x)  # no session: refused on this rank
        return None
    with buf.agrs_new_session():
        got, handle = buf.all_gather(x)
        handle()
        return _eq(got[CULPRIT], torch.arange(16, dtype=torch.float32) + CULPRIT)


def _rs_indivisible(buf, rank, world):
    import torch

    with buf.agrs_new_session():
        t = torch.ones(2 * world + (1 if rank == CULPRIT else 0), 4, device=DEV)
        out = buf.reduce_scatter(t)
        return out.shape[0]


def _pp_noncontig(buf, rank, world):
    import torch

    t = torch.arange(32, dtype=torch.float32, device=DEV).view(16, 2)
    if rank == 0:
        buf.pp_send(t.t(), 1)  # non-contiguous: refused
        return None
    got = torch.zeros(32, device=DEV)
    buf.pp_recv(got, 0)
    return _eq(got, torch.arange(32, dtype=torch.float32))


# ---------------------------------------------------------------------------------------------------------------
# round 3 (2026-12-07): V1 LogFMT and rank masking, EPBuffer.resize, the LB collectives, V2 float32 combine output

LOGFMT_H = 512  # LogFMT needs whole chunks of 512 channels


def _ll_logfmt_one_rank(buf, rank, world):
    """Only the culprit combines with use_logfmt=True (hidden 512, valid on its own): the ranks disagree on the
    wire format of the combine's rows."""
    import torch

    g = torch.Generator().manual_seed(65 * 100 + rank)
    x = torch.randint(-4, 5, (T, LOGFMT_H), generator=g).to(torch.bfloat16).to(DEV)
    _x, idx, w = _inputs(65, rank)
    recv, _count, handle, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    got = buf.low_latency_combine(recv, idx, w, handle, use_logfmt=rank == CULPRIT)[0]
    return rank == CULPRIT or _eq(got, (x.float() * K).to(torch.bfloat16))


def _ll_logfmt_bad_hidden(buf, rank, world):
    """The culprit asks for LogFMT at hidden 32 (refused: hidden % 512); the peer combines without it."""
    x, idx, w = _inputs(66, rank)
    recv, _count, handle, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    return buf.low_latency_combine(recv, idx, w, handle, use_logfmt=rank == CULPRIT)[0] is not None


def _ep(**kw):
    from ep_torch import EPBuffer

    args = dict(num_max_tokens_per_rank=M, hidden=H, num_topk=K, num_cpu_timeout_secs=TIMEOUT, **GPU_KW)
    args.update(kw)
    return EPBuffer(None, explicitly_destroy=True, **args)


def _resize_bad(buf, rank, world):
    """The culprit's num_bytes is not a multiple of 2 MiB (refused on that rank); the peer's resize is valid."""
    if rank == CULPRIT:
        return buf.resize(num_bytes=3) is None
    return buf.resize(num_max_tokens_per_rank=M, hidden=H, num_topk=K) is None


def _resize_disagree(buf, rank, world):
    """Both resizes are valid; the culprit asks for more tokens than the peer."""
    m = M + 4 if rank == CULPRIT else M
    return buf.resize(num_max_tokens_per_rank=m, hidden=H, num_topk=K) is None


LB_L, LB_R, LB_H = 2, 3, 8  # local experts, redundant slots, hidden (test_torch_load_balance_safety.py's)


def _lb():
    import torch
    from ep_torch import BufferAllocator

    os.environ.setdefault("EPKIT_NVLINK_GBS", "450")
    plan = BufferAllocator()
    slots = plan.allocate((LB_R, LB_H), torch.float32)
    grads_slots = plan.allocate((LB_R, LB_H), torch.float32)
    buf = _ep(lb_allocation_plan_or_num_bytes=plan)
    buf.survey_lb = (slots, grads_slots)
    return buf


def _lb_mapping(world: int, seed: int = 3):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(-1, world * LB_L, (world, LB_R), generator=g, dtype=torch.int32)


def _lb_weights(seed: int, rank: int):
    import torch

    g = torch.Generator().manual_seed(seed * 10 + rank)
    return torch.randint(-8, 8, (LB_L, LB_H), generator=g).float(), torch.randint(
        -8, 8, (LB_R, LB_H), generator=g
    ).float()


def _lb_round(buf, seed: int, rank: int, world: int) -> bool:
    import numpy as np
    import torch
    from ep_core.load_balance import prefetch_reference, reduce_grads_reference

    slots, grads_slots = buf.survey_lb
    counts = torch.arange(LB_L, dtype=torch.int64) + seed + rank
    mapping = buf.lb_get_redundancy_mapping(counts, LB_R)
    w, red = _lb_weights(seed, rank)
    slots.zero_()
    buf.lb_prefetch_weights(slots, w, mapping)
    zeros = [np.zeros((LB_R, LB_H), np.float32)] * world
    want = prefetch_reference(zeros, [_lb_weights(seed, r)[0].numpy() for r in range(world)], mapping.numpy())
    ok = bool(np.array_equal(slots.numpy(), want[rank]))
    grads_slots.copy_(red)
    grads = torch.zeros(LB_L, LB_H)
    buf.lb_reduce_grads(grads_slots, grads, mapping)
    want = reduce_grads_reference(
        [_lb_weights(seed, r)[1].numpy() for r in range(world)],
        [np.zeros((LB_L, LB_H), np.float32)] * world,
        mapping.numpy(),
    )
    return ok and bool(np.array_equal(grads.numpy(), want[rank]))


ROUNDS.update(ep=_v2_round, epn=_v2_round, lb=_lb_round, lln=_ll_round, llnc=_ll_round, llnd=_ll_round)


def _lb_mapping_bad(buf, rank, world):
    """The culprit's counts are float (refused on that rank)."""
    import torch

    counts = torch.arange(LB_L, dtype=torch.float32 if rank == CULPRIT else torch.int64)
    return buf.lb_get_redundancy_mapping(counts, LB_R) is not None


def _lb_mapping_disagree(buf, rank, world):
    import torch

    counts = torch.arange(LB_L, dtype=torch.int64)
    return buf.lb_get_redundancy_mapping(counts, LB_R + 1 if rank == CULPRIT else LB_R) is not None


def _lb_prefetch_bad(buf, rank, world):
    """The culprit's destination is outside the LB region (refused on that rank)."""
    import torch

    slots, _ = buf.survey_lb
    dst = torch.zeros(LB_R, LB_H) if rank == CULPRIT else slots
    return buf.lb_prefetch_weights(dst, _lb_weights(67, rank)[0], _lb_mapping(world)) is not None


def _lb_prefetch_disagree(buf, rank, world):
    slots, _ = buf.survey_lb
    mapping = _lb_mapping(world, 4 if rank == CULPRIT else 3)
    return buf.lb_prefetch_weights(slots, _lb_weights(67, rank)[0], mapping) is not None


def _lb_reduce_bad(buf, rank, world):
    """The culprit's expert_grads are float64 (refused on that rank)."""
    import torch

    _, grads_slots = buf.survey_lb
    grads = torch.zeros(LB_L, LB_H, dtype=torch.float64 if rank == CULPRIT else torch.float32)
    return buf.lb_reduce_grads(grads_slots, grads, _lb_mapping(world)) is not None


def _lb_reduce_disagree(buf, rank, world):
    import torch

    _, grads_slots = buf.survey_lb
    mapping = _lb_mapping(world, 4 if rank == CULPRIT else 3)
    return buf.lb_reduce_grads(grads_slots, torch.zeros(LB_L, LB_H), mapping) is not None


def _v2_out_dtype_one_rank(buf, rank, world):
    """Only the culprit asks combine for a float32 output (valid on its own): the ranks' combines differ."""
    import torch

    x, idx, w = _inputs(68, rank)
    recv_x, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    kw = {"out_dtype": torch.float32} if rank == CULPRIT else {}
    return buf.combine(recv_x, handle, **kw)[0].shape[0]


def _v2_out_dtype_bad(buf, rank, world):
    """The culprit's out_dtype is float16 (refused on that rank); the peer's combine is ordinary."""
    import torch

    x, idx, w = _inputs(69, rank)
    recv_x, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    kw = {"out_dtype": torch.float16} if rank == CULPRIT else {}
    return buf.combine(recv_x, handle, **kw)[0].shape[0]


def _bucket_outside(buf, rank, world):
    """The culprit's src is not in the storage: refused on that rank."""
    import torch

    t = buf.storage[: 64 * 4].view(torch.float32)
    if rank == CULPRIT:
        t = torch.zeros(64, device=t.device)
    return buf.all_reduce(t).wait() is not None


def _bucket_indivisible(buf, rank, world):
    import torch

    t = buf.storage[: (2 * world + (1 if rank == CULPRIT else 0)) * 4].view(torch.float32)
    return buf.reduce_scatter(t).wait() is not None


def _bucket_other_op(buf, rank, world):
    """The culprit calls all_gather while the peer calls all_reduce: a disagreement (reset after)."""
    import torch

    t = buf.storage[: 8 * world * 4].view(torch.float32)
    if rank == CULPRIT:
        return buf.all_gather(t[rank * 8 : (rank + 1) * 8]).wait() is not None
    return buf.all_reduce(t).wait() is not None


def _bucket_send_recv_outside(buf, rank, world):
    """A ring send_recv (issue 42) whose culprit receives into a tensor outside the storage: refused there."""
    import torch

    t = buf.storage[: 64 * 4].view(torch.float32)
    dst = (
        torch.zeros(64, device=t.device)
        if rank == CULPRIT
        else buf.storage[256 : 256 + 64 * 4].view(torch.float32)
    )
    got = buf.send_recv(t, dst, (rank + 1) % world, (rank - 1) % world).wait()
    return got is not None


def _bucket_send_recv_unpaired(buf, rank, world):
    """The culprit names itself as its source while its peer sends to it: the calls do not pair (reset after)."""
    import torch

    t = buf.storage[: 64 * 4].view(torch.float32)
    dst = buf.storage[256 : 256 + 64 * 4].view(torch.float32)
    src = rank if rank == CULPRIT else (rank - 1) % world
    return buf.send_recv(t, dst, (rank + 1) % world, src).wait() is not None


def _bucket_send_recv_round(buf, rank, world):
    import torch

    t = buf.storage[: 64 * 4].view(torch.float32)
    t.copy_(_bucket_val(87, rank).to(t.device))
    dst = buf.storage[256 : 256 + 64 * 4].view(torch.float32)
    return _eq(
        buf.send_recv(t, dst, (rank + 1) % world, (rank - 1) % world).wait(),
        _bucket_val(87, (rank - 1) % world),
    )


def _engram_write_shape(buf, rank, world):
    shard = _engram_shard(60, rank).to(DEV)
    if rank == CULPRIT:
        shard = shard[:-1]
    buf.write([shard])
    return True


def _engram_config_mismatch(buf, rank, world):
    buf.set_config(ENGRAM_LAYERS, ENGRAM_H * (2 if rank == CULPRIT else 1), ENGRAM_T, ENGRAM_K)
    return True


def _engram_construct(buf, rank, world):
    b = _engram(num_gpu_bytes=3 if rank == CULPRIT else 2 << 20)
    b.destroy()
    return True


def _never(build, call):
    """Rank 1 never calls (it sleeps past the timeout): rank 0 must raise EPTimeoutError naming rank 1."""

    def fault(buf, rank, world):
        if rank == 1:
            time.sleep(TIMEOUT * 2 + 2)
            return None
        t0 = time.monotonic()
        try:
            call(buf, rank, world)
        finally:
            fault.waited = time.monotonic() - t0
        return True

    return fault


def _killed(call):
    def fault(buf, rank, world):
        if rank == 1:
            time.sleep(0.5)
            os._exit(0)
        time.sleep(1.0)
        return call(buf, rank, world)

    return fault


# ---------------------------------------------------------------------------------------------------------------
# session 5 (issue 41): DeepEP 2.5's EPBuffer order and defaults, ep_torch.comm, V1 internode_*, the receive view

# positional dispatch arguments of EPBuffer (DeepEP 2.5's order): x, topk_idx, topk_weights, stats, num_experts,
# num_max_tokens_per_rank, expert_alignment, num_sms, num_qps, previous_event, async_with_compute_stream,
# allocate_on_comm_stream, handle, do_handle_copy, do_cpu_sync, do_expand, do_zero_padding,
# use_tma_aligned_col_major_sf, defer_epilogue, borrow_recv
_EP25_DISPATCH = (
    "num_sms", "num_qps", "previous_event", "async_with_compute_stream", "allocate_on_comm_stream", "handle",
    "do_handle_copy", "do_cpu_sync", "do_expand", "do_zero_padding", "use_tma_aligned_col_major_sf",
    "defer_epilogue", "borrow_recv",
)  # fmt: skip
_EP25_COMBINE = (
    "topk_weights", "bias", "num_sms", "num_qps", "previous_event", "async_with_compute_stream",
    "allocate_on_comm_stream", "defer_epilogue",
)  # fmt: skip


def _ep25_dispatch(buf, x, idx, w, **kw):
    """EPBuffer.dispatch with every argument positional, in DeepEP 2.5's order (``kw`` names the changed ones)."""
    vals = dict(num_sms=0, num_qps=0, previous_event=None, async_with_compute_stream=False,
                allocate_on_comm_stream=False, handle=None, do_handle_copy=False, do_cpu_sync=None, do_expand=False,
                do_zero_padding=False, use_tma_aligned_col_major_sf=False, defer_epilogue=False, borrow_recv=False)  # fmt: skip
    vals.update(kw)
    return buf.dispatch(x, idx, w, None, E, None, None, *(vals[k] for k in _EP25_DISPATCH))


def _ep25_combine(buf, x, handle, **kw):
    vals = dict(topk_weights=None, bias=None, num_sms=0, num_qps=0, previous_event=None,
                async_with_compute_stream=False, allocate_on_comm_stream=False, defer_epilogue=False)  # fmt: skip
    vals.update(kw)
    return buf.combine(x, handle, *(vals[k] for k in _EP25_COMBINE))


def _ep25_want(seed: int, rank: int, world: int):
    from ep_core import reference
    from ep_torch._convert import to_numpy

    inputs = _all_inputs(seed, world)
    return reference.dispatch(
        [to_numpy(a.cpu()) for a, _, _ in inputs],
        [b.cpu().numpy() for _, b, _ in inputs],
        [c.cpu().numpy() for _, _, c in inputs],
        num_experts=E,
        num_max_tokens_per_rank=M,
    )[rank].recv_x


def _ep25_rows_ok(recv_x, seed, rank, world) -> bool:
    from ep_torch._convert import to_numpy

    got, want = to_numpy(recv_x.cpu()), _ep25_want(seed, rank, world)
    return got.shape == want.shape and got.tobytes() == want.tobytes()


def _ep25_dispatch_one_rank(seed: int, **culprit_kw):
    """The culprit dispatches (every argument positional) with ``culprit_kw``, the peer plainly; then both combine.
    Returns whether this rank's rows are exact (a deferred dispatch's come from its event, a view's from its slab,
    released before the combine)."""

    def fault(buf, rank, world):
        x, idx, w = _inputs(seed, rank)
        kw = culprit_kw if rank == CULPRIT else {}
        out = _ep25_dispatch(buf, x, idx, w, **kw)
        if kw.get("defer_epilogue") and not isinstance(out, tuple):
            recv_x, _, _, handle = out.current_stream_wait()
        else:
            recv_x, _, _, handle, _ = out
        if kw.get("borrow_recv"):
            view = recv_x
            recv_x = view.slab.index_select(0, view.row_indices).clone()
            view.release()
        ok = _ep25_rows_ok(recv_x, seed, rank, world)
        return ok and _ep25_combine(buf, recv_x, handle)[0].shape == x.shape

    return fault


def _ep25_combine_one_rank(seed: int, **culprit_kw):
    def fault(buf, rank, world):
        x, idx, w = _inputs(seed, rank)
        recv_x, _, _, handle, _ = _ep25_dispatch(buf, x, idx, w)
        out = _ep25_combine(buf, recv_x, handle, **(culprit_kw if rank == CULPRIT else {}))
        if not isinstance(out, tuple):
            out = out.current_stream_wait()
        return out[0].shape == x.shape

    return fault


def _v2_kw_one_rank(seed: int, combine: bool = False, view_out: bool = False, **culprit_kw):
    """ElasticBuffer (V2) with DeepEP 2.5's keywords on the culprit only: its dispatch's (``combine``: its
    combine's) ``culprit_kw``, refused there; ``view_out``: the culprit holds a receive view while both dispatch."""

    def fault(buf, rank, world):
        x, idx, w = _inputs(seed, rank)
        kw = culprit_kw if rank == CULPRIT else {}
        view = None
        if view_out:
            out = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E, borrow_recv=rank == CULPRIT)
            view = out[0] if rank == CULPRIT else None
            kw = {}
        try:
            recv_x, _, _, handle, _ = buf.dispatch(
                x, topk_idx=idx, topk_weights=w, num_experts=E, **({} if combine else kw)
            )
        finally:
            if view is not None:
                view.release()
        ok = _ep25_rows_ok(recv_x, seed, rank, world)
        return ok and buf.combine(recv_x, handle, **(kw if combine else {}))[0].shape == x.shape

    return fault


def _ep25_barrier_bad(buf, rank, world):
    """The culprit names a communication context the buffer does not have (refused there); the peer's barrier."""
    buf.barrier(True, False, True, 1 if rank == CULPRIT else None)
    return True


def _ep25_barrier_skipped(buf, rank, world):
    """The culprit skips the barrier and dispatches: its dispatch meets the peer's barrier (reset after)."""
    if rank == CULPRIT:
        return _v2_round(buf, 90, rank, world)
    buf.barrier(True, False, True, 0)
    return True


def _ep25_construct_bad(buf, rank, world):
    """EPBuffer's constructor with every argument positional; the culprit's num_topk is 64 (refused there)."""
    from ep_torch import EPBuffer

    k = 64 if rank == CULPRIT else K
    b = EPBuffer(
        None, None, M, H, k, False, 0, False, True, True, True, None, 0, TIMEOUT, 100, True, **GPU_KW
    )
    b.destroy()
    return True


def _ep25_construct_lb_one_rank(buf, rank, world):
    """Only the culprit asks (positionally, 7th) for a 2 MiB LB region: the ranks' buffers differ."""
    from ep_torch import EPBuffer

    lb = 2 << 20 if rank == CULPRIT else 0
    b = EPBuffer(
        None, None, M, H, K, False, lb, False, True, True, True, None, 0, TIMEOUT, 100, True, **GPU_KW
    )
    ok = _v2_round(b, 91, rank, world)
    b.destroy()
    return ok


def _ep25_lb_view_out(buf, rank, world):
    """The culprit holds a receive view (borrow_recv) while both call lb_prefetch_weights: refused there."""
    slots, _ = buf.survey_lb
    x, idx, w = _inputs(92, rank)
    out = _ep25_dispatch(buf, x, idx, w, borrow_recv=rank == CULPRIT)
    view = out[0] if rank == CULPRIT else None
    try:
        return buf.lb_prefetch_weights(slots, _lb_weights(67, rank)[0], _lb_mapping(world)) is not None
    finally:
        if view is not None:
            view.release()


def _ep25_dispatch_view_out(buf, rank, world):
    """The culprit dispatches again while its receive view is out (refused there); the peer's second dispatch."""
    x, idx, w = _inputs(93, rank)
    out = _ep25_dispatch(buf, x, idx, w, borrow_recv=rank == CULPRIT)
    try:
        recv_x = _ep25_dispatch(buf, x, idx, w)[0]
        return _ep25_rows_ok(recv_x, 93, rank, world)
    finally:
        if rank == CULPRIT:
            out[0].release()


def _comm_barrier(context_idx_of):
    def fault(buf, rank, world):
        from ep_torch import comm

        comm.barrier(buf, True, False, True, context_idx_of(rank))
        return True

    return fault


def _comm_barrier_skipped(round_fn):
    def fault(buf, rank, world):
        from ep_torch import comm

        if rank == CULPRIT:
            return round_fn(buf, 94, rank, world)
        comm.barrier(buf)
        return True

    return fault


def _comm_nccl_handle_on_gloo(buf, rank, world):
    """Every rank asks for an NCCL communicator over the gloo group: refused alike on every rank."""
    from ep_torch import comm

    return comm.get_nccl_comm_handle(None) is not None


def _comm_domain_sizes(buf, rank, world):
    """The group's and the buffer's domain sizes agree (local answers; no collective pending after)."""
    from ep_torch import comm

    return comm.get_physical_domain_size(None) == comm.get_physical_domain_size(
        buf
    ) and comm.get_logical_domain_size(None) == comm.get_logical_domain_size(buf)


def _v1_internode(culprit_dispatch: bool, every: bool = False, change=None):
    """V1 dispatch then combine; the culprit (every rank with ``every``) calls ``internode_dispatch`` when
    ``culprit_dispatch`` else ``internode_combine``; ``change`` alters the culprit's dispatch arguments."""

    def fault(buf, rank, world):
        x, idx, w = _inputs(95, rank)
        ntr, _, nte, itr, _ = _v1_layout(buf, idx)
        kw = dict(num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte, topk_idx=idx)
        kw["topk_weights"] = w
        mine = every or rank == CULPRIT
        if change is not None and rank == CULPRIT:
            x = change(kw, x)
        call = buf.internode_dispatch if mine and culprit_dispatch else buf.dispatch
        recv_x, _, _, _, handle, _ = call(x, **kw)
        ok = _eq(recv_x, _v1_rows(95, world, rank))
        call = buf.internode_combine if mine and not culprit_dispatch else buf.combine
        return ok and call(recv_x, handle)[0] is not None

    return fault


def _v1n_skipped_internode_combine(buf, rank, world):
    x, idx, _w = _inputs(96, rank)
    ntr, _, nte, itr, _ = _v1_layout(buf, idx)
    kw = dict(num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte, topk_idx=idx)
    recv_x, _, _, _, handle, _ = buf.internode_dispatch(x, **kw)
    if rank == CULPRIT:
        return _eq(buf.internode_dispatch(x, **kw)[0], _v1_rows(96, world, rank))
    return buf.internode_combine(recv_x, handle)[0] is not None


def _ll_native_one_rank(buf, rank, world):
    """Only the culprit builds its low-latency Buffer with ll_native=True where the native kernels cannot run (the
    CPU backend: refused at its first low-latency call); the peer's Buffer takes the adapter."""
    b = _v1(low_latency=True, ll_native=True if rank == CULPRIT else None)
    try:
        return _ll_round(b, 97, rank, world)
    finally:
        b.destroy()


CASES = {
    # name: (surface, builder kwargs, fault, reset after)
    "v1.expert_id_out_of_range": ("v1", {}, _v1_bad_dispatch(_oob), False),
    "v1.weights_shape": ("v1", {}, _v1_bad_dispatch(_wshape), False),
    "v1.missing_layout_tensor": ("v1", {}, _v1_bad_dispatch(_missing), False),
    "v1.expert_alignment_0": ("v1", {}, _v1_bad_dispatch(_align0), False),
    "v1.too_many_tokens": (
        "v1",
        {"num_max_tokens_per_rank": M, "hidden": H},
        _v1_bad_dispatch(_too_many),
        False,
    ),
    "v1.layout_error_then_skip": ("v1", {}, _v1_layout_skip, False),
    "v1.num_worst_tokens_too_small": ("v1", {}, _v1_bad_dispatch(_worst), False),
    "v1.dispatch_after_destroy": ("v1", {}, _v1_after_destroy, False),
    "v1.combine_foreign_handle": ("v1", {}, _v1_foreign_handle, False),
    "v1.combine_wrong_rows": ("v1", {}, _v1_combine_rows, False),
    "v1.combine_weights_one_rank": ("v1", {}, _v1_combine_weights_one_rank, True),
    "v1.combine_weights_topk_width": ("v1", {}, _v1_combine_weights_k, True),
    "v1.combine_weights_other_dispatch": ("v1", {}, _v1_combine_weights_other_dispatch, True),
    "v1.skipped_combine": ("v1", {}, _v1_skip_combine, True),
    "v1.skipped_combine_no_reset": ("v1", {}, _v1_skip_combine, False),
    "v1.peer_never_calls": ("v1", {}, _never(None, lambda b, r, w: _v1_round(b, 80, r, w)), None),
    "v1.peer_killed": ("v1", {}, _killed(lambda b, r, w: _v1_round(b, 81, r, w)), None),
    "ll.x_dtype": ("ll", {}, _ll_bad(_ll_dtype), False),
    "ll.too_many_tokens": ("ll", {}, _ll_bad(_ll_too_many), False),
    "ll.expert_id_out_of_range": ("ll", {}, _ll_bad(_ll_oob), False),
    "ll.stats_shape": ("ll", {}, _ll_bad(_ll_stats), False),
    "ll.dispatch_after_destroy": ("ll", {}, _ll_after_destroy, False),
    "ll.combine_x_shape": ("ll", {}, _ll_combine_bad(_llc_xshape), False),
    "ll.combine_weights_dtype": ("ll", {}, _ll_combine_bad(_llc_wdtype), False),
    "ll.combine_foreign_handle": ("ll", {}, _ll_combine_bad(_llc_foreign), False),
    "ll.peer_never_calls": ("ll", {}, _never(None, lambda b, r, w: _ll_round(b, 82, r, w)), None),
    "v2.skipped_combine": ("v2", {}, _v2_skip_combine, True),
    "v2.skipped_combine_no_reset": ("v2", {}, _v2_skip_combine, False),
    "v2.combine_foreign_handle": ("v2", {}, _v2_foreign_handle, True),
    "v2.construct_bad_num_topk": ("v2", {}, _v2_construct, False),
    "v2.construct_retry": ("v2", {}, _v2_construct_retry, False),
    "v2.construct_uncastable_arg": ("v2", {}, _v2_construct_cast, False),
    "v2.peer_killed": ("v2", {}, _killed(lambda b, r, w: _v2_round(b, 83, r, w)), None),
    "agrs.all_gather_outside_session": ("agrs", {}, _agrs_outside, False),
    "agrs.reduce_scatter_indivisible": ("agrs", {}, _rs_indivisible, False),
    "agrs.peer_never_calls": ("agrs", {}, _never(None, lambda b, r, w: _agrs_round(b, 84, r, w)), None),
    "pp.send_non_contiguous": ("pp", {}, _pp_noncontig, False),
    "bucket.all_reduce_outside_storage": ("bucket", {}, _bucket_outside, False),
    "bucket.reduce_scatter_indivisible": ("bucket", {}, _bucket_indivisible, False),
    "bucket.different_operations": ("bucket", {}, _bucket_other_op, True),
    "bucket.different_operations_no_reset": ("bucket", {}, _bucket_other_op, False),
    "bucket.peer_never_calls": ("bucket", {}, _never(None, lambda b, r, w: _bucket_round(b, 86, r, w)), None),
    "bucket.send_recv_outside_storage": ("bucket", {}, _bucket_send_recv_outside, False),
    "bucket.send_recv_unpaired": ("bucket", {}, _bucket_send_recv_unpaired, True),
    "bucket.send_recv_peer_never_calls": ("bucket", {}, _never(None, _bucket_send_recv_round), None),
    "engram.write_wrong_shape": ("engram", {}, _engram_write_shape, False),
    "engram.set_config_mismatch": ("engram", {}, _engram_config_mismatch, True),
    "engram.set_config_mismatch_no_reset": ("engram", {}, _engram_config_mismatch, False),
    "engram.construct_bad_size": ("engram", {}, _engram_construct, False),
    "ll.combine_logfmt_one_rank": ("ll", {}, _ll_logfmt_one_rank, True),
    "ll.combine_logfmt_bad_hidden": ("ll", {}, _ll_logfmt_bad_hidden, False),
    "ll_shrink.expert_id_out_of_range": ("ll", {"enable_shrink": True}, _ll_bad(_ll_oob), False),
    "ll_shrink.x_dtype": ("ll", {"enable_shrink": True}, _ll_bad(_ll_dtype), False),
    "ll_shrink.combine_x_shape": ("ll", {"enable_shrink": True}, _ll_combine_bad(_llc_xshape), False),
    "ll_shrink.combine_logfmt_bad_hidden": ("ll", {"enable_shrink": True}, _ll_logfmt_bad_hidden, False),
    "ll_shrink.combine_logfmt_one_rank": ("ll", {"enable_shrink": True}, _ll_logfmt_one_rank, True),
    "ep.resize_bad_num_bytes": ("ep", {}, _resize_bad, False),
    "ep.resize_disagreeing_sizes": ("ep", {}, _resize_disagree, True),
    "lb.redundancy_mapping_bad_counts": ("lb", {}, _lb_mapping_bad, False),
    "lb.redundancy_mapping_disagreeing_num_redundant": ("lb", {}, _lb_mapping_disagree, True),
    "lb.prefetch_outside_region": ("lb", {}, _lb_prefetch_bad, False),
    "lb.prefetch_different_mappings": ("lb", {}, _lb_prefetch_disagree, True),
    "lb.reduce_grads_float64": ("lb", {}, _lb_reduce_bad, False),
    "lb.reduce_grads_different_mappings": ("lb", {}, _lb_reduce_disagree, True),
    "v2.combine_out_dtype_one_rank": ("v2", {}, _v2_out_dtype_one_rank, True),
    "v2.combine_out_dtype_bad": ("v2", {}, _v2_out_dtype_bad, False),
    "pp.peer_killed": ("pp", {}, _killed(lambda b, r, w: _pp_round(b, 85, r, w)), None),
    # session 5: DeepEP 2.5's EPBuffer, positional (ep: EPBuffer; lb: EPBuffer with an LB region; v1n: EPKIT_SCALEUP_RANKS=1)
    "v2.dispatch_defer_without_async": ("v2", {}, _v2_kw_one_rank(111, defer_epilogue=True), False),
    "v2.dispatch_borrow_with_expand": (
        "v2",
        {},
        _v2_kw_one_rank(112, borrow_recv=True, do_expand=True),
        False,
    ),
    "v2.dispatch_while_view_out": ("v2", {}, _v2_kw_one_rank(113, view_out=True), False),
    "v2.combine_defer_without_async": ("v2", {}, _v2_kw_one_rank(114, True, defer_epilogue=True), False),
    "ep.dispatch_defer_without_async": ("ep", {}, _ep25_dispatch_one_rank(100, defer_epilogue=True), False),
    "ep.dispatch_borrow_with_expand": (
        "ep",
        {},
        _ep25_dispatch_one_rank(101, borrow_recv=True, do_expand=True),
        False,
    ),
    "ep.dispatch_negative_num_sms": ("ep", {}, _ep25_dispatch_one_rank(102, num_sms=-1), False),
    "ep.dispatch_defer_epilogue_one_rank_local": (
        "ep",
        {},
        _ep25_dispatch_one_rank(103, defer_epilogue=True, async_with_compute_stream=True),
        False,
    ),
    "ep.dispatch_borrow_recv_one_rank_local": (
        "ep",
        {},
        _ep25_dispatch_one_rank(104, borrow_recv=True),
        False,
    ),
    "ep.dispatch_do_handle_copy_one_rank_local": (
        "ep",
        {},
        _ep25_dispatch_one_rank(105, do_handle_copy=True),
        False,
    ),
    "ep.dispatch_odd_num_sms_one_rank_local": ("ep", {}, _ep25_dispatch_one_rank(106, num_sms=3), False),
    "ep.dispatch_other_num_sms_one_rank_local": ("ep", {}, _ep25_dispatch_one_rank(107, num_sms=6), False),
    "ep.dispatch_while_view_out": ("ep", {}, _ep25_dispatch_view_out, False),
    "epn.dispatch_borrow_recv_across_nodes": (
        "epn",
        {},
        _ep25_dispatch_one_rank(110, borrow_recv=True),
        False,
    ),
    "ep.combine_defer_without_async": ("ep", {}, _ep25_combine_one_rank(108, defer_epilogue=True), False),
    "ep.combine_defer_epilogue_one_rank_local": (
        "ep",
        {},
        _ep25_combine_one_rank(109, defer_epilogue=True, async_with_compute_stream=True),
        False,
    ),
    "ep.barrier_bad_context_idx": ("ep", {}, _ep25_barrier_bad, False),
    "ep.barrier_skipped": ("ep", {}, _ep25_barrier_skipped, True),
    "ep.construct_positional_bad_num_topk": ("ep", {}, _ep25_construct_bad, False),
    "ep.construct_positional_lb_one_rank": ("ep", {}, _ep25_construct_lb_one_rank, False),
    "lb.prefetch_while_view_out": ("lb", {}, _ep25_lb_view_out, False),
    "comm.barrier_bad_context_idx": ("ep", {}, _comm_barrier(lambda r: 2 if r == CULPRIT else None), False),
    "comm.barrier_skipped": ("ep", {}, _comm_barrier_skipped(_v2_round), True),
    "comm.barrier_v2_bad_context_idx": ("v2", {}, _comm_barrier(lambda r: 1 if r == CULPRIT else 0), False),
    "comm.barrier_engram_bad_context_idx": (
        "engram",
        {},
        _comm_barrier(lambda r: 1 if r == CULPRIT else 0),
        False,
    ),
    "comm.barrier_bucket_bad_context_idx": (
        "bucket",
        {},
        _comm_barrier(lambda r: 5 if r == CULPRIT else 0),
        False,
    ),
    "comm.barrier_bucket_skipped": ("bucket", {}, _comm_barrier_skipped(_bucket_round), True),
    "comm.nccl_handle_on_gloo_every_rank": ("ep", {}, _comm_nccl_handle_on_gloo, False),
    "comm.domain_sizes_local": ("ep", {}, _comm_domain_sizes, False),
    "v1.internode_dispatch_one_domain": ("v1", {}, _v1_internode(True), False),
    "v1.internode_combine_one_domain": ("v1", {}, _v1_internode(False), False),
    "v1.internode_dispatch_one_domain_every_rank": ("v1", {}, _v1_internode(True, every=True), False),
    "v1n.internode_dispatch_one_rank_local": ("v1n", {}, _v1_internode(True), False),
    "v1n.internode_combine_one_rank_local": ("v1n", {}, _v1_internode(False), False),
    "v1n.internode_expert_id_out_of_range": ("v1n", {}, _v1_internode(True, every=True, change=_oob), False),
    "v1n.internode_skipped_combine": ("v1n", {}, _v1n_skipped_internode_combine, True),
    "ll.native_true_one_rank_local": ("ll", {}, _ll_native_one_rank, False),
}


# the native road's cases, under each envelope mode (surface lln: "change", llnc: "call")
_NATIVE_CASES = {
    "x_dtype": (_ll_bad(_ll_dtype), False),
    "too_many_tokens": (_ll_bad(_ll_too_many), False),
    "expert_id_out_of_range": (_ll_bad(_ll_oob), False),
    "stats_shape": (_ll_bad(_ll_stats), False),
    "combine_x_shape": (_ll_combine_bad(_llc_xshape), False),
    "combine_weights_dtype": (_ll_combine_bad(_llc_wdtype), False),
    "combine_foreign_handle": (_ll_combine_bad(_llc_foreign), False),
    "combine_logfmt_bad_hidden": (_ll_logfmt_bad_hidden, False),
    "combine_logfmt_one_rank": (_ll_logfmt_one_rank, True),
    "combine_logfmt_one_rank_alone": (_lln_logfmt_alone, True),
    "dispatch_fp8_one_rank_alone": (_lln_fp8_alone, True),
    "dispatch_m_one_rank_alone": (_lln_m_alone, True),
    "combine_other_dispatch_one_rank": (_lln_other_dispatch, True),
    "peer_never_calls": (_never(None, lambda b, r, w: _ll_round(b, 82, r, w)), None),
}
for _surface in ("lln", "llnc"):
    for _name, (_fault, _reset) in _NATIVE_CASES.items():
        CASES[f"{_surface}.{_name}"] = (_surface, {}, _fault, _reset)


def _then_next_call(fault):
    """``llnd``: the fault, then, where it returned, a synchronize and one more valid call (where the GPU raises what
    the kernels recorded of the fault); every such case then calls reset()."""

    def run(buf, rank, world):
        value = fault(buf, rank, world)
        if DEV == "cuda":
            import torch

            torch.cuda.synchronize()
        _ll_round(buf, 83, rank, world)
        return value

    return run


for _name, (_fault, _reset) in _NATIVE_CASES.items():
    if _reset is not None:
        CASES[f"llnd.{_name}"] = ("llnd", {}, _then_next_call(_fault), True)
NATIVE = [c for c in CASES if c.startswith(("lln.", "llnc.", "llnd."))]


# cases whose every rank's call is valid on its own but the ranks disagree: all must raise (EPMismatchError)
_DISAGREE_SURFACES = ("ll", "ll_shrink", "v2", "lln", "llnc", "llnd")
DISAGREE = {c for c in CASES if "one_rank" in c and c.split(".")[0] in _DISAGREE_SURFACES} | {
    c for c in CASES if "disagreeing" in c or "different_mappings" in c
}


# cases whose differing call is local (each rank's result alone is exact): clear when every rank returned exact
# results (or every rank raised, naming the culprit)
LOCAL_OK = {c for c in CASES if c.endswith("_local")}
# cases where every rank makes the same refused call: clear when every rank raised an ep error of its own
SAME_ERROR = {c for c in CASES if c.endswith("_every_rank")}


def _build(surface: str, kw: dict):
    global _ll_foreign_buffer
    if surface in (
        "v1n",
        "epn",
    ):  # nodes of one rank: the internode road on the CPU backend (the chain restores it)
        os.environ["EPKIT_SCALEUP_RANKS"] = "1"
        if surface == "epn":
            return _ep(**kw)
    if surface in ("v1", "v1n"):
        buf = _v1(**kw)
        _too_many.buf = buf
        return buf
    if surface == "ll":
        buf = _v1(low_latency=True, **kw)
        _ll_foreign_buffer = _v1(low_latency=True)
        return buf
    if surface in ("lln", "llnc", "llnd"):
        _standin()
        buf, _ll_foreign_buffer = _v1_native(**kw), _v1_native()
        if surface == "llnc":
            buf.ll_native_agree = _ll_foreign_buffer.ll_native_agree = "call"
        return buf
    if surface == "v2":
        return _v2(**kw)
    if surface == "pp":
        return _pp(**kw)
    if surface == "bucket":
        return _bucket(**kw)
    if surface == "engram":
        return _engram(**kw)
    if surface == "ep":
        return _ep(**kw)
    if surface == "lb":
        return _lb()
    if surface != "agrs":
        raise ValueError(f"unknown surface {surface!r}")
    return _agrs()


def _device() -> None:
    if DEV == "cuda":
        import torch

        torch.cuda.set_device(0)


def _worker(rank: int, world: int, case: str, out: str) -> None:
    global _STANDIN_DIR
    os.environ["EPKIT_CPU_TIMEOUT_SECS"] = str(TIMEOUT)
    _STANDIN_DIR = str(Path(out, "lln"))
    _device()
    surface, kw, fault, reset = CASES[case]
    seen: dict = {"rank": rank}
    exit_hard = reset is None

    def save() -> None:  # after every stage: a hang later still shows what came before
        Path(out, f"{rank}.json").write_text(json.dumps(seen, default=str))

    try:
        buf = _build(surface, kw)
        round_fn = ROUNDS[surface]
        seen["warmup"] = _outcome(lambda: round_fn(buf, 1, rank, world))[1]
        save()
        t0 = time.monotonic()
        outcome, value = _outcome(lambda: fault(buf, rank, world))
        seen["fault"], seen["fault_value"] = outcome, value
        seen["fault_secs"] = time.monotonic() - t0
        save()
        if not exit_hard:
            if reset and hasattr(buf, "reset"):
                seen["reset"] = _outcome(buf.reset)[0]
            seen["rounds"] = []
            for s in (2, 3):
                seen["rounds"].append(_outcome(lambda s=s: round_fn(buf, s, rank, world)))
                save()
    except BaseException as exc:
        seen["crash"] = f"{type(exc).__name__}: {exc}"[:600]
    seen["done"] = True
    save()
    # leave without the launcher's closing barrier (after a failure the group may be out of step), but only once
    # every rank is done: a rank that exits early would turn its peer's hang into a connection error
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not all(
        _done(Path(out, f"{r}.json")) for r in range(world) if not (exit_hard and r != 0)
    ):
        time.sleep(0.05)
    os._exit(0)


def _done(f: Path) -> bool:
    try:
        return bool(json.loads(f.read_text()).get("done"))
    except (OSError, ValueError):
        return False


# ---------------------------------------------------------------------------------------------------------------
# many cases in one process group (the CPU tests): after each case the ranks must be in step


CHAIN = [
    "v1.expert_id_out_of_range",
    "v1.layout_error_then_skip",
    "v1.num_worst_tokens_too_small",
    "v1.too_many_tokens",
    "v1.dispatch_after_destroy",
    "v1.combine_foreign_handle",
    "v1.skipped_combine",
    "v1.combine_weights_topk_width",
    "v1.combine_weights_one_rank",
    "ll.x_dtype",
    "ll.stats_shape",
    "ll.combine_foreign_handle",
    "ll.combine_weights_dtype",
    "v2.skipped_combine",
    "v2.construct_bad_num_topk",
    "v2.construct_retry",
    "v2.construct_uncastable_arg",
    "agrs.reduce_scatter_indivisible",
    "pp.send_non_contiguous",
    "agrs.all_gather_outside_session",
    "bucket.all_reduce_outside_storage",
    "bucket.different_operations",
    "bucket.send_recv_outside_storage",
    "bucket.send_recv_unpaired",
    "engram.write_wrong_shape",
    "engram.set_config_mismatch",
    "engram.construct_bad_size",
]

# round 3's surfaces (V1 LogFMT and rank masking, resize, the LB collectives, the float32 combine output)
CHAIN_ROUND3 = [
    "ll.combine_logfmt_one_rank",
    "ll.combine_logfmt_bad_hidden",
    "ll_shrink.x_dtype",
    "ll_shrink.combine_logfmt_one_rank",
    "ep.resize_bad_num_bytes",
    "ep.resize_disagreeing_sizes",
    "lb.redundancy_mapping_disagreeing_num_redundant",
    "lb.prefetch_outside_region",
    "lb.reduce_grads_different_mappings",
    "v2.combine_out_dtype_one_rank",
    "v2.combine_out_dtype_bad",
]

# session 5's surfaces (DeepEP 2.5's EPBuffer refusals, comm.barrier, V1 internode_* on one domain): the cases that
# were not clear before their fix (the emulated-nodes case last: it sets EPKIT_SCALEUP_RANKS for itself)
CHAIN_SESSION5 = [
    "v2.dispatch_while_view_out",
    "v2.combine_defer_without_async",
    "ep.dispatch_defer_without_async",
    "ep.dispatch_borrow_with_expand",
    "ep.dispatch_negative_num_sms",
    "ep.dispatch_while_view_out",
    "ep.combine_defer_without_async",
    "ep.barrier_bad_context_idx",
    "lb.prefetch_while_view_out",
    "comm.barrier_engram_bad_context_idx",
    "comm.barrier_bucket_bad_context_idx",
    "comm.barrier_bucket_skipped",
    "v1.internode_dispatch_one_domain",
    "v1.internode_combine_one_domain",
    "epn.dispatch_borrow_recv_across_nodes",
]


def _chain_worker(rank: int, world: int, out: str, names: list[str]) -> None:
    """Every case of `names` in turn on this one group, each with its own buffers; each case's record as in
    `_worker`, in ``OUTDIR/<rank>.json`` as {case: record}."""
    global _STANDIN_DIR
    os.environ["EPKIT_CPU_TIMEOUT_SECS"] = str(TIMEOUT)
    _STANDIN_DIR = str(Path(out, "lln"))
    _device()
    records: dict = {}
    scaleup = os.environ.get("EPKIT_SCALEUP_RANKS")
    for case in names:
        surface, kw, fault, reset = CASES[case]
        seen: dict = {"rank": rank}
        if scaleup is None:  # a case of emulated nodes set it for itself (_build)
            os.environ.pop("EPKIT_SCALEUP_RANKS", None)
        try:
            buf = _build(surface, kw)
            round_fn = ROUNDS[surface]
            # as `_worker`: the native region exists when the fault comes
            if surface in ("lln", "llnc", "llnd"):
                seen["warmup"] = _outcome(lambda f=round_fn, b=buf: f(b, 1, rank, world))[1]
            t0 = time.monotonic()
            seen["fault"], seen["fault_value"] = _outcome(lambda f=fault, b=buf: f(b, rank, world))
            seen["fault_secs"] = time.monotonic() - t0
            if reset:
                seen["reset"] = _outcome(buf.reset)[0]
            seen["rounds"] = [_outcome(lambda s=s, f=round_fn, b=buf: f(b, s, rank, world)) for s in (2, 3)]
        except BaseException as exc:
            seen["crash"] = f"{type(exc).__name__}: {exc}"[:600]
        records[case] = seen
        Path(out, f"{rank}.json").write_text(json.dumps(records, default=str))
        if "crash" in seen:
            os._exit(0)


def _random_worker(rank: int, world: int, out: str, seed: int, steps: int) -> None:
    """Valid calls of V1 normal, V1 low-latency, V2 and AGRS interleaved with one-rank errors (the same random
    plan on every rank): every valid result is checked bitwise; every error step must raise on every rank."""
    global CULPRIT
    import random

    os.environ["EPKIT_CPU_TIMEOUT_SECS"] = str(TIMEOUT)
    _device()
    bufs = {
        "v1": _build("v1", {}),
        "ll": _build("ll", {}),
        "v2": _build("v2", {}),
        "agrs": _build("agrs", {}),
    }
    faults = {
        "v1": ["v1.expert_id_out_of_range", "v1.weights_shape", "v1.missing_layout_tensor", "v1.expert_alignment_0",
               "v1.num_worst_tokens_too_small", "v1.layout_error_then_skip", "v1.combine_wrong_rows",
               "v1.skipped_combine"],
        "ll": ["ll.x_dtype", "ll.too_many_tokens", "ll.expert_id_out_of_range", "ll.stats_shape",
               "ll.combine_x_shape", "ll.combine_weights_dtype"],
        "v2": ["v2.skipped_combine"],
        "agrs": ["agrs.reduce_scatter_indivisible"],
    }  # fmt: skip
    plan = random.Random(seed)
    log = []
    for step in range(steps):
        surface = plan.choice(sorted(bufs))
        bad = plan.random() < 0.5
        CULPRIT = plan.randrange(world)
        buf = bufs[surface]
        if not bad:
            out_, val = _outcome(lambda b=buf, s=surface, k=step: ROUNDS[s](b, 1000 + k, rank, world))
            log.append({"step": step, "case": f"{surface}.valid", "out": out_, "exact": val is True})
            continue
        case = plan.choice(faults[surface])
        _, _, fault, reset = CASES[case]
        out_, val = _outcome(lambda f=fault, b=buf: f(b, rank, world))
        rec = {"step": step, "case": case, "culprit": CULPRIT, "out": out_, "value": val}
        if reset:
            rec["reset"] = _outcome(buf.reset)[0]
        log.append(rec)
        Path(out, f"{rank}.json").write_text(json.dumps(log, default=str))
    Path(out, f"{rank}.json").write_text(json.dumps(log, default=str))


def verdict(case: str, ranks: list[dict]) -> tuple[str, str]:
    """(clear | unclear | silent, why) from the ranks' records."""
    _surface, _, _, reset = CASES[case]
    culprit = 1 if reset is None else CULPRIT
    live = [r for r in ranks if r]
    if reset is None:  # a peer that never calls / dies: the waiting rank 0 must raise naming rank 1
        r0 = ranks[0]
        f = r0.get("fault", r0.get("crash", "missing"))
        if not f.startswith(("EPTimeoutError", "EPPeerError")):
            return ("silent" if f == "ok" else "unclear"), f[:200]
        if "rank 1" not in f or "rank 0," in f:
            return "unclear", f[:200]
        if "never" in case and (not f.startswith("EPTimeoutError") or r0.get("fault_secs", 99) > TIMEOUT + 2):
            return (
                "unclear",
                f"not a timeout within {TIMEOUT:g} s: {r0.get('fault_secs', 0):.1f} s, {f[:150]}",
            )
        return "clear", f[:120]
    for r in live:
        if "crash" in r:
            return "unclear", r["crash"][:200]
        if "fault" not in r:
            return "unclear", f"rank {r.get('rank')}: no record of the case (the process ended in it)"
    for r in live:  # a returned value of the fault step must be right (no rows of another call)
        if r["fault"] == "ok" and r["fault_value"] is False:
            return "silent", f"rank {r['rank']} returned wrong rows without an error"
    for r in live:
        for out, val in r.get("rounds", []):
            if out == "ok" and val is not True:
                return "silent", f"rank {r['rank']}: a valid round after the error differs from the reference"
    errs = [r["fault"] for r in live]
    if case in LOCAL_OK and all(e == "ok" and r["fault_value"] is True for e, r in zip(errs, live)):
        return "clear", "every rank's result exact (the difference is local)"
    if case in SAME_ERROR:
        if all(e.startswith("EP") for e in errs) and all(
            o == "ok" for r in live for o, _ in r.get("rounds", [])
        ):
            return "clear", errs[-1][:120]
        return "unclear", f"not every rank raised an ep error, or unusable after: {[x[:120] for x in errs]}"
    if case in DISAGREE and all(e == "ok" for e in errs):  # each call valid alone: the ranks' results differ
        return "silent", "every rank returned though the ranks' calls disagree"
    if case == "v2.construct_retry":  # every rank built in the end; the peer saw the culprit's refusal first
        peer = [r for r in live if r["rank"] != CULPRIT]
        first = (peer[0].get("fault_value") or ["?"])[0] if peer else "?"
        if not all(r["fault"] == "ok" for r in live):
            return "unclear", f"not built: {errs}"
        if not (first.startswith("EPPeerError") and f"rank {CULPRIT}" in first):
            return "unclear", f"the peer's constructor did not see the culprit's error: {first[:150]}"
        return "clear", first[:120]
    for r in live:
        e = r["fault"]
        if e == "ok":
            return "unclear", f"rank {r['rank']} returned while another raised: {[x[:120] for x in errs]}"
        if not e.startswith("EP"):
            return "unclear", f"rank {r['rank']}: raw error {e[:200]}"
        if r["rank"] != culprit and f"rank {culprit}" not in e:
            return "unclear", f"rank {r['rank']}: names no culprit: {e[:200]}"
    for r in live:
        for out, _ in r.get("rounds", []):
            if out != "ok" and not (case.endswith("_no_reset") and "until reset()" in out):
                return "unclear", f"rank {r['rank']}: unusable after: {out[:200]}"
    return "clear", errs[-1][:120]


def _records(tmp: str) -> list[dict]:
    out = []
    for r in range(2):
        f = Path(tmp, f"{r}.json")
        try:
            out.append(json.loads(f.read_text()) if f.exists() else {})
        except ValueError:
            out.append({})
    return out


def _run_one(case: str, limit: float) -> tuple[str, str, float]:
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, __file__, case, tmp],
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        try:
            out, _ = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.communicate()
            ranks = _records(tmp)
            for r in ranks:  # wrong rows returned before the hang count as silent
                vals = [r.get("fault_value")] if r.get("fault") == "ok" else []
                vals += [v for o, v in r.get("rounds", []) if o == "ok"]
                if any(v is False for v in vals):
                    return "silent", f"rank {r['rank']}: wrong rows without an error, then a hang", limit
            return "hang", f"still running after {limit:g} s", time.monotonic() - t0
        took = time.monotonic() - t0
        ranks = _records(tmp)
        if not ranks[0]:
            return "unclear", "no record: " + out.decode(errors="replace")[-300:], took
        v, why = verdict(case, ranks)
        return v, why, took


def main_all(outfile: str, names: list[str]) -> None:
    limit = 45.0
    rows = []
    for case in names or list(CASES):
        v, why, took = _run_one(case, limit)
        rows.append({"case": case, "verdict": v, "why": why, "secs": round(took, 1)})
        print(f"{case:40s} {v:8s} {took:5.1f}s  {why[:150]}", flush=True)
    Path(outfile).write_text(json.dumps(rows, indent=1))
    table: dict = {}
    for r in rows:
        t = table.setdefault(r["case"].split(".")[0], {"clear": 0, "unclear": 0, "silent": 0, "hang": 0})
        t[r["verdict"]] += 1
    for s, t in table.items():
        print(s, t)


if __name__ == "__main__":
    from ep_torch import launch
    from ep_torch_testing import spawn_cpu

    # forked CPU ranks (see spawn_cpu); on the GPU they start afresh (a forked process cannot use CUDA)
    spawn = launch.spawn if DEV == "cuda" else spawn_cpu
    if sys.argv[1] == "--all":
        main_all(sys.argv[2], sys.argv[3:])
    elif sys.argv[1] == "chain":
        spawn(_chain_worker, 2, sys.argv[2], sys.argv[3:] or CHAIN)
    elif sys.argv[1] == "random":
        spawn(_random_worker, 2, sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        spawn(_worker, 2, sys.argv[1], sys.argv[2])
