"""ep_torch's per-call shortcuts keep the semantics: tensors that need no grad reach ep-core as they are (no
detached alias per call), tensors that need grad are detached, and a handle never holds the caller's topk_idx
object with do_handle_copy=True."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ep_torch.buffer import _plain


def test_plain_passes_plain_tensors_and_detaches_grad_ones():
    a = torch.zeros(3, 4)
    assert _plain(a) is a
    g = torch.zeros(3, 4, requires_grad=True)
    d = _plain(g)
    assert d is not g and not d.requires_grad and d.data_ptr() == g.data_ptr()
    t = _plain((a, g))
    assert isinstance(t, tuple) and t[0] is a and not t[1].requires_grad
    assert _plain(None) is None and _plain([a]) == [a] and _plain(5) == 5


@pytest.fixture
def one_rank_group():
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    from ep_torch.launch import free_port, init_rank

    init_rank(0, 1, free_port(), "gloo")
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tokens", [0, 1, 6])
def test_handle_topk_idx_is_never_the_callers_object(one_rank_group, tokens):
    from ep_torch import ElasticBuffer

    hidden, experts, k = 64, 8, 2
    buf = ElasticBuffer(
        one_rank_group, num_max_tokens_per_rank=8, hidden=hidden, num_topk=k, transport="reference"
    )
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    idx = torch.rand(tokens, experts, generator=g).topk(k, dim=1).indices
    w = torch.rand(tokens, k, generator=g)
    recv_x, recv_idx, recv_w, handle, _ = buf.dispatch(x, idx, w, num_experts=experts)
    assert handle.topk_idx is not idx and torch.equal(handle.topk_idx, idx)
    assert recv_x.shape[0] == recv_idx.shape[0] == recv_w.shape[0] == tokens  # one rank: one row per token
    _, _, _, handle2, _ = buf.dispatch(x, idx, w, num_experts=experts, do_handle_copy=False)
    assert handle2.topk_idx is idx  # DeepEP: without a copy the handle keeps the caller's tensor
    combined, _, _ = buf.combine(recv_x, handle)
    assert combined.shape == (tokens, hidden)
    # a cached dispatch with the same tensors, twice (the validated handle is reused)
    for _ in range(2):
        again, _, _, h3, _ = buf.dispatch(x, handle=handle)
        assert h3 is handle and torch.equal(again, recv_x)
