"""DeepEP V1 ``Buffer`` across emulated nodes: 4 gloo ranks, ``EPKIT_SCALEUP_RANKS=2`` (2 nodes of 2 ranks, hybrid
mode on the CPU reference backend). V1's internode surface: ``num_tokens_per_rdma_rank`` against a numpy count, the
10-tuple handle against a numpy oracle of V1's two-level route, rows in V1 order and combine equal to
``ep_core.reference`` with ``num_scaleup_ranks=2``, cached dispatch with the internode handle; low-latency mode's
packed rows, layout_range and combine across the nodes."""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from ep_core import reference
from ep_torch.legacy import Buffer, V1InternodeHandle
from ep_torch.legacy.reference import ll_combine_reference

H, K, E, SU = 128, 2, 8, 2


def _tokens(rank: int) -> int:
    return 5 + rank % 2  # unequal token counts: the handle's all-gather pads to M


def _inputs(rank: int):
    g = torch.Generator().manual_seed(300 + rank)
    t = _tokens(rank)
    x = torch.randn(t, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
    idx[0, 1] = -1  # a masked lane
    w = torch.rand(t, K, generator=g)
    return x, idx, w


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16)


def _bf16(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)


def _in_rank(idx: torch.Tensor, n: int) -> np.ndarray:
    """[T, N] bool: token goes to rank (numpy, from topk_idx)."""
    epr = E // n
    out = np.zeros((idx.shape[0], n), dtype=bool)
    for t, row in enumerate(idx.tolist()):
        for e in row:
            if e >= 0:
                out[t, e // epr] = True
    return out


def _position(mask: np.ndarray) -> np.ndarray:
    return np.where(mask, np.cumsum(mask, 0) - 1, -1).astype(np.int32)


def _ranks(rank: int, n: int) -> None:
    assert os.environ.get("EPKIT_SCALEUP_RANKS") == str(SU)
    nodes, node, local = n // SU, rank // SU, rank % SU
    x, idx, w = _inputs(rank)
    t_own = _tokens(rank)
    inputs = [_inputs(r) for r in range(n)]
    itr_all = [_in_rank(i, n) for _, i, _ in inputs]
    buf = Buffer(None, int(1e8), 0, explicitly_destroy=True)

    # layout before the inner buffer exists: the node size is the predicted one
    ntr, ntrr, nte, itr, _ = buf.get_dispatch_layout(idx, E)
    per_node = itr_all[rank].reshape(t_own, nodes, SU).any(2)
    assert ntrr is not None and ntrr.dtype == torch.int32
    np.testing.assert_array_equal(ntrr.numpy(), per_node.sum(0))
    np.testing.assert_array_equal(itr.numpy(), itr_all[rank])

    rx, ridx, rw, counts, handle, _ = buf.dispatch(
        x,
        num_tokens_per_rank=ntr,
        num_tokens_per_rdma_rank=ntrr,
        is_token_in_rank=itr,
        num_tokens_per_expert=nte,
        topk_idx=idx,
        topk_weights=w,
    )
    assert buf._domain() == (nodes, SU)
    assert isinstance(handle, V1InternodeHandle) and len(handle) == 10

    # rows: the reference's hybrid rows, put in V1's order (source rank, then source token)
    m = max(_tokens(r) for r in range(n))
    ref = reference.dispatch(
        [_bits(xi) for xi, _, _ in inputs],
        [i.numpy() for _, i, _ in inputs],
        [wi.numpy() for _, _, wi in inputs],
        num_experts=E,
        num_max_tokens_per_rank=m,
        deterministic=True,
        num_scaleup_ranks=SU,
    )
    mine = ref[rank]
    rows = mine.num_valid_rows
    src_id = np.asarray(mine.handle.recv_src_metadata)[:rows, 0].astype(np.int64)
    order = np.argsort(src_id, kind="stable")
    assert rx.shape[0] == rows
    np.testing.assert_array_equal(_bits(rx), mine.recv_x[:rows][order])
    np.testing.assert_array_equal(ridx.numpy(), mine.recv_topk_idx[:rows][order])
    ref_w = mine.recv_topk_weights[:rows][order]
    np.testing.assert_array_equal(rw.numpy(), np.where(ridx.numpy() >= 0, ref_w, 0.0))
    src, tok = src_id[order] // m, src_id[order] % m
    assert counts == [int(((ridx.numpy() == e).any(1)).sum()) for e in range(E // n)]

    # the handle against V1's two-level route computed from every rank's routing
    (h_itr, rdma_cpm, gbl_cpm, recv_rdma_cpm, recv_rdma_psum, recv_gbl_cpm, recv_gbl_psum, meta, send_rdma_head,
     send_nvl_head) = handle  # fmt: skip
    assert torch.equal(h_itr, itr)
    np.testing.assert_array_equal(rdma_cpm.numpy(), per_node.sum(0).reshape(nodes, 1))
    np.testing.assert_array_equal(gbl_cpm.numpy(), itr_all[rank].sum(0).reshape(n, 1))
    to_me = np.array([itr_all[s][:, rank].sum() for s in range(n)])
    np.testing.assert_array_equal(recv_gbl_cpm.numpy(), to_me.reshape(n, 1))
    np.testing.assert_array_equal(recv_gbl_psum.numpy(), np.cumsum(to_me))
    assert int(recv_gbl_psum[-1]) == rows
    np.testing.assert_array_equal(src, np.repeat(np.arange(n), to_me))  # V1 order: source rank blocks

    def node_bits(s: int) -> np.ndarray:  # [T_s] bits of the local ranks of my node each token of s goes to
        blk = itr_all[s][:, node * SU : (node + 1) * SU]
        return (blk * (1 << np.arange(SU))).sum(1).astype(np.int32)

    fwd_src = [r * SU + local for r in range(nodes)]
    fwd = [node_bits(s)[node_bits(s) != 0] for s in fwd_src]
    np.testing.assert_array_equal(recv_rdma_cpm.numpy(), np.array([[len(f)] for f in fwd]))
    np.testing.assert_array_equal(recv_rdma_psum.numpy(), np.cumsum([len(f) for f in fwd]))
    assert meta.dtype == torch.uint8 and meta.shape == (rows, 8)
    meta_i = meta.view(torch.int32).numpy()
    np.testing.assert_array_equal(meta_i[:, 0], src // SU)
    np.testing.assert_array_equal(meta_i[:, 1], [node_bits(int(s))[int(t)] for s, t in zip(src, tok)])
    assert bool(((meta_i[:, 1] >> local) & 1).all())  # every row was bound for this rank
    np.testing.assert_array_equal(send_rdma_head.numpy(), _position(per_node))
    peers = (np.concatenate(fwd)[:, None] >> np.arange(SU)) & 1
    assert send_nvl_head.shape == (int(recv_rdma_psum[-1]), SU)
    np.testing.assert_array_equal(send_nvl_head.numpy(), _position(peers.astype(bool)))

    # combine: expert output = row * (rank + 1), against the reference combine of the same outputs
    def scaled(d: int, bits: np.ndarray) -> np.ndarray:
        return _bits((_bf16(bits).float() * (d + 1)).to(torch.bfloat16))

    outs = [scaled(d, o.recv_x[: o.num_valid_rows]) for d, o in enumerate(ref)]
    want = reference.combine(outs, [o.handle for o in ref], num_scaleup_ranks=SU)[rank]
    y, yw, _ = buf.combine(_bf16(scaled(rank, _bits(rx))), handle, topk_weights=rw)
    np.testing.assert_array_equal(_bits(y), want.combined_x)
    assert torch.equal(yw, torch.where(idx >= 0, w, torch.zeros_like(w)))

    # cached dispatch with the internode handle: the same rows in V1 order, then combine with it again
    rx2, a, b, c, d, _ = buf.dispatch(x * 2, handle=handle)
    assert a is None and b is None and c is None and d is None and torch.equal(rx2, rx * 2)
    y2, _, _ = buf.combine(_bf16(scaled(rank, _bits(rx))), handle)
    np.testing.assert_array_equal(_bits(y2), want.combined_x)

    # num_worst_tokens pads the V1-ordered rows; combine takes the padded rows
    worst = n * m
    rx3, ridx3, _, counts3, h3, _ = buf.dispatch(
        x, num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte, topk_idx=idx,
        num_worst_tokens=worst,
    )  # fmt: skip
    assert isinstance(h3, V1InternodeHandle) and counts3 == [] and rx3.shape[0] == worst
    assert torch.equal(rx3[:rows], rx) and bool((ridx3[rows:] == -1).all())
    pad = torch.zeros(worst - rows, H, dtype=torch.bfloat16)
    y3, _, _ = buf.combine(torch.cat([_bf16(scaled(rank, _bits(rx))), pad]), h3)
    np.testing.assert_array_equal(_bits(y3), want.combined_x)

    # (data, scales) input: both permuted to V1's order, the same way
    scales = torch.arange(t_own * (H // 128), dtype=torch.float32).view(t_own, H // 128) + 100 * rank
    (rq, rs), *_ = buf.dispatch(
        (x.view(torch.int16).to(torch.float8_e4m3fn), scales), handle=handle
    )  # fmt: skip
    want_s = np.concatenate([
        (np.arange(_tokens(s) * (H // 128), dtype=np.float32).reshape(-1, H // 128) + 100 * s)[tok[src == s]]
        for s in range(n)
    ])  # fmt: skip
    np.testing.assert_array_equal(rs.numpy(), want_s)
    assert rq.shape == (rows, H) and rq.dtype == torch.float8_e4m3fn

    # low-latency mode across nodes: packed rows in (source rank, source token) order, V1's layout_range, combine
    mm, epr = 8, E // n
    recv, cnt, llh, _, _ = buf.low_latency_dispatch(x, idx, mm, E, use_fp8=False)
    for e in range(epr):
        got = [
            (s, tt)
            for s in range(n)
            for tt in range(_tokens(s))
            if (inputs[s][1][tt] == rank * epr + e).any()
        ]
        assert int(cnt[e]) == len(got)
        if got:
            assert torch.equal(recv[e, : len(got)], torch.stack([inputs[s][0][tt] for s, tt in got]))
            assert llh[0][e, : len(got)].tolist() == [tt for _, tt in got]
        per_src = np.array([sum(1 for s, _ in got if s == r) for r in range(n)], dtype=np.int64)
        want_lr = ((np.cumsum(per_src) - per_src) << 32) | per_src
        np.testing.assert_array_equal(llh[1][e].numpy(), want_lr)
    out_ll = recv.clone()
    for e in range(epr):
        out_ll[e] = (recv[e].float() * (rank * epr + e + 1)).to(torch.bfloat16)
    comb, _, _ = buf.low_latency_combine(out_ll, idx, w, llh)
    y_ll = np.zeros((t_own, K, H), dtype=np.uint16)
    for tt in range(t_own):
        for k in range(K):
            if idx[tt, k] >= 0:
                y_ll[tt, k] = _bits((x[tt].float() * (int(idx[tt, k]) + 1)).to(torch.bfloat16))
    np.testing.assert_array_equal(_bits(comb), ll_combine_reference(y_ll, idx.numpy(), w.numpy()))
    dist.barrier()
    buf.destroy()


def _spawn(worker: str, ranks: int, limit: float = 300.0) -> None:
    env = {**os.environ, "EPKIT_SCALEUP_RANKS": str(SU)}
    from ep_torch_testing import run_script  # loaded by conftest.py

    code, out = run_script(__file__, [worker, str(ranks)], limit, what=f"{worker} x{ranks}: ", env=env)
    assert code == 0, out[-4000:]


def test_v1_internode_handle_4_ranks_2_nodes():
    _spawn("_ranks", 4)


if __name__ == "__main__":
    from ep_torch_testing import spawn_cpu

    spawn_cpu(globals()[sys.argv[1]], int(sys.argv[2]))
