"""V1 ``Buffer`` normal mode where DeepEP's semantics are easy to miss (issue 42), on 2 and 4 gloo ranks (CPU
reference backend) against a torch oracle built from every rank's inputs:

- ``dispatch`` with the layout tensors only (no ``topk_idx``): rows by ``is_token_in_rank``, ``None`` top-k outputs,
  the per-expert list from ``num_tokens_per_expert``; combine of those rows;
- ``num_worst_tokens > 0``: ``num_recv_tokens_per_expert_list == []``;
- ``combine``'s ``combined_topk_weights``: the fp32 sum from 0.0, ascending over the receiving ranks, of the weights
  each sends back, after the caller changed them (lanes whose expert is elsewhere included)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from ep_torch.launch import spawn
from ep_torch.legacy import Buffer
from ep_torch.legacy.buffer import V1InternodeHandle

T, H, K, E = 7, 64, 3, 8


def _inputs(rank: int):
    g = torch.Generator().manual_seed(300 + rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    idx[1, :] = -1  # a token that goes nowhere
    idx[2, 0] = -1  # a masked lane
    w = torch.rand(T, K, generator=g)
    return x, idx, w


def _in_rank(idx: torch.Tensor, n: int) -> torch.Tensor:
    epr = E // n
    return torch.stack([((idx >= 0) & (idx // epr == r)).any(1) for r in range(n)], dim=1)


def _changed_weight(d: int, s: int, t: int, k: int) -> float:
    """What rank ``d`` sends back for (source rank ``s``, token ``t``), lane ``k``: every lane, owned or not."""
    return (d + 1) * 0.375 + s * 0.0625 + t * 0.015625 + k * 0.25 + 1e-3


class _OnDevice:
    """The buffer with its tensor arguments moved to ``device`` and its tensor results back to the host (handles
    stay as they are), so the CPU oracle below checks a CUDA run too."""

    def __init__(self, buf: Buffer, device: str) -> None:
        self.buf, self.device = buf, device

    def __getattr__(self, name: str):
        fn = getattr(self.buf, name)

        def call(*args, **kwargs):
            args = [a.to(self.device) if isinstance(a, torch.Tensor) else a for a in args]
            kwargs = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            out = fn(*args, **kwargs)
            if isinstance(out, torch.Tensor):
                return out.cpu()
            if type(out) is tuple:
                return tuple(o.cpu() if isinstance(o, torch.Tensor) else o for o in out)
            return out

        return call


def _ranks(rank: int, n: int, device: str = "cpu") -> None:
    x, idx, w = _inputs(rank)
    epr = E // n
    transport = "ipc" if device == "cuda" else None
    buf = _OnDevice(Buffer(None, int(1e8), 0, explicitly_destroy=True, transport=transport), device)
    ntr, _, nte, itr, _ = buf.get_dispatch_layout(idx, E)

    # layout tensors only: V1's token all-to-all by is_token_in_rank
    rx, ridx, rw, counts, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte, expert_alignment=2
    )
    want = [(s, t) for s in range(n) for t in range(T) if bool(_in_rank(_inputs(s)[1], n)[t, rank])]
    assert ridx is None and rw is None
    assert rx.shape == (len(want), H)
    for i, (s, t) in enumerate(want):
        assert torch.equal(rx[i], _inputs(s)[0][t])
        if not isinstance(handle, V1InternodeHandle):
            assert int(handle[3][i].cpu()) == t
    total = sum(torch.bincount(_inputs(s)[1][_inputs(s)[1] >= 0], minlength=E) for s in range(n))
    assert counts == [(int(c) + 1) // 2 * 2 for c in total[rank * epr : (rank + 1) * epr]]
    y, yw, _ = buf.combine(rx, handle)
    assert yw is None
    assert torch.equal(y, (x.float() * itr.sum(1).float()[:, None]).to(torch.bfloat16))
    # cached dispatch with that handle
    rx2, *_ = buf.dispatch(x, handle=handle)
    assert torch.equal(rx2, rx)
    # with num_worst_tokens: padded rows and an empty per-expert list (DeepEP's [])
    rx3, ridx3, _, counts3, h3, _ = buf.dispatch(
        x, num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte, num_worst_tokens=n * T
    )
    assert counts3 == [] and ridx3 is None and rx3.shape == (n * T, H)
    y3, _, _ = buf.combine(rx3, h3)
    assert torch.equal(y3, y)
    *_, counts4, _, _ = buf.dispatch(
        x,
        num_tokens_per_rank=ntr,
        is_token_in_rank=itr,
        num_tokens_per_expert=nte,
        topk_idx=idx,
        topk_weights=w,
        num_worst_tokens=n * T,
    )
    assert counts4 == []
    with pytest.raises(ValueError, match="topk_weights without topk_idx"):
        buf.dispatch(
            x, num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte, topk_weights=w
        )

    # combined_topk_weights: V1 sums what every receiving rank sends back
    rx, ridx, rw, _, handle, _ = buf.dispatch(
        x,
        num_tokens_per_rank=ntr,
        is_token_in_rank=itr,
        num_tokens_per_expert=nte,
        topk_idx=idx,
        topk_weights=w,
    )
    _, yw, _ = buf.combine(rx, handle, topk_weights=rw)  # unchanged weights: the owner's (the others carry 0)
    assert torch.equal(yw, torch.where(idx >= 0, w, torch.zeros_like(w)))
    changed = torch.tensor(
        [[_changed_weight(rank, s, t, k) for k in range(K)] for s, t in _rows(rank, n)], dtype=torch.float32
    ).reshape(-1, K)
    _, yw, _ = buf.combine(rx, handle, topk_weights=changed)
    expect = torch.zeros(T, K, dtype=torch.float32)
    for t in range(T):
        for k in range(K):
            acc = torch.tensor(0.0, dtype=torch.float32)
            for d in range(n):
                if bool(itr[t, d]):
                    acc = acc + torch.tensor(_changed_weight(d, rank, t, k), dtype=torch.float32)
            expect[t, k] = acc
    assert torch.equal(yw, expect)
    # the same through the padded rows of num_worst_tokens (padding rows carry nothing back)
    rx5, _, _, _, h5, _ = buf.dispatch(
        x,
        num_tokens_per_rank=ntr,
        is_token_in_rank=itr,
        num_tokens_per_expert=nte,
        topk_idx=idx,
        topk_weights=w,
        num_worst_tokens=n * T,
    )
    padded = torch.full((n * T, K), 99.0)
    padded[: changed.shape[0]] = changed
    _, yw5, _ = buf.combine(rx5, h5, topk_weights=padded)
    assert torch.equal(yw5, expect)
    dist.barrier()
    buf.destroy()


def _ranks_shared_gpu(rank: int, n: int) -> None:
    torch.cuda.set_device(0)  # several processes on one GPU over a gloo bootstrap: ep's ipc transport
    os.environ.setdefault("EPKIT_NVLINK_GBS", "450")  # no NVLink to detect between processes on one GPU
    _ranks(rank, n, "cuda")


def _rows(rank: int, n: int) -> list[tuple[int, int]]:
    return [(s, t) for s in range(n) for t in range(T) if bool(_in_rank(_inputs(s)[1], n)[t, rank])]


@pytest.mark.parametrize(
    ("ranks", "scaleup"),
    [(2, None), (4, None), (4, "2")],
    ids=["2-ranks", "4-ranks", "4-ranks-2-nodes"],  # 2 nodes: V1's internode handle and row order
)
def test_v1_normal_semantics(ranks, scaleup):
    env = dict(os.environ)
    if scaleup is not None:
        env["EPKIT_SCALEUP_RANKS"] = scaleup
    from ep_torch_testing import run_script  # loaded by conftest.py

    code, out = run_script(__file__, ["_ranks", str(ranks)], 300, env=env, what=f"{ranks} ranks: ")
    assert code == 0, out[-4000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_v1_normal_semantics_shared_gpu():
    proc = subprocess.run(
        [sys.executable, __file__, "_ranks_shared_gpu", "2"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


def test_rank_lanes_compact_past_max_topk():
    from ep_torch.legacy.buffer import _rank_lanes

    itr = torch.zeros(3, 40, dtype=torch.bool)
    itr[0, [1, 5, 39]] = True
    itr[2, :] = True
    with pytest.raises(ValueError, match="at most 32 ranks"):
        _rank_lanes(itr, 2, 0)
    itr[2, 32:] = False
    lanes = _rank_lanes(itr, 2, 0)
    assert lanes.shape == (3, 32)
    assert lanes[0, :4].tolist() == [2, 10, 78, -1] and bool((lanes[1] == -1).all())
    assert lanes[2].tolist() == [2 * r for r in range(32)]


if __name__ == "__main__":
    from ep_torch_testing import spawn_cpu

    worker = sys.argv[1]  # the GPU ranks start afresh (a forked process cannot use CUDA)
    (spawn if "gpu" in worker else spawn_cpu)(globals()[worker], int(sys.argv[2]))
