"""V1 normal mode over a CPU loopback group (issue 42, ``ep_torch.loopback``): N rank threads in one process run
test_torch_v1_normal_semantics.py's checks (loaded by path, its ``Buffer`` and ``dist.barrier`` bound to the group's
ranks), sized up front too, with collective safety on the ranks' own host channels; a GPU loopback group refuses
normal mode naming what to run instead."""

from __future__ import annotations

import importlib.util
import threading
import types
from pathlib import Path

import pytest
import torch
from ep_core.errors import EPMismatchError, EPPeerError, EPValueError
from ep_torch.loopback import LoopbackBuffer, LoopbackGroup


def _semantics():
    spec = importlib.util.spec_from_file_location(
        "_ep_torch_v1_normal_semantics", Path(__file__).with_name("test_torch_v1_normal_semantics.py")
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


sem = _semantics()
T, H, K, E = sem.T, sem.H, sem.K, sem.E


def _bind(mod, group: LoopbackGroup, **kwargs):
    """``mod``'s ``Buffer(None, ...)`` gives the calling rank thread its buffer of one loopback group, and its
    ``dist.barrier()`` meets the other rank threads."""
    v1 = group.v1_buffers(int(1e8), 0, explicitly_destroy=True, **kwargs)
    local = threading.local()
    barrier = threading.Barrier(group.num_ranks)
    mod.Buffer = lambda *args, **kw: v1[local.rank]
    mod.dist = types.SimpleNamespace(barrier=lambda *args, **kw: barrier.wait(60))

    def run(fn):
        def body(r):
            local.rank = r
            return fn(r)

        return group.run(body)

    return v1, run


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_v1_normal_semantics_over_loopback(ranks):
    """Every check of the process-group test (layout-only dispatch, cached dispatch, num_worst_tokens, V1's summed
    combined weights), bit for bit, on 1, 2 and 4 rank threads. A loopback group is one NVLink domain (it does not
    emulate nodes: V1's internode layout is the process-group test's); 3 ranks: V1's config table has no entry,
    DeepEP's neither."""
    mod = _semantics()
    group = LoopbackGroup(ranks, device="cpu", timeout_secs=60.0)
    v1, run = _bind(mod, group)
    assert all(isinstance(b, LoopbackBuffer) for b in v1)
    run(lambda r: mod._ranks(r, ranks))
    assert all(b._destroyed for b in v1)


def test_loopback_normal_sized_up_front_and_local_buffer():
    """``num_max_tokens_per_rank``/``hidden`` build the normal-mode buffers in the constructor (CPU groups), so
    ``get_local_buffer_tensor`` views each rank's own region; a larger dispatch is refused by name on every rank."""
    n = 2
    group = LoopbackGroup(n, device="cpu", timeout_secs=60.0)
    v1 = group.v1_buffers(int(1e8), 0, explicitly_destroy=True, num_max_tokens_per_rank=T, hidden=H)
    views = [b.get_local_buffer_tensor(torch.uint8) for b in v1]
    assert views[0].data_ptr() != views[1].data_ptr()
    assert all(v.data_ptr() == int(b._inner.runtime.data.ptr) for b, v in zip(v1, views))
    inp = [sem._inputs(r) for r in range(n)]

    def call(r, rows=T):
        x, idx, w = (t[:rows] if rows <= T else torch.cat([t] * 2) for t in inp[r])
        ntr, _, nte, itr, _ = v1[r].get_dispatch_layout(idx, E)
        rx, _, rw, _, handle, _ = v1[r].dispatch(
            x, num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte, topk_idx=idx,
            topk_weights=w,
        )  # fmt: skip
        y, yw, _ = v1[r].combine(rx, handle, topk_weights=rw)
        return x, idx, w, itr, y, yw

    for x, idx, w, itr, y, yw in group.run(call):
        assert torch.equal(y, (x.float() * itr.sum(1).float()[:, None]).to(torch.bfloat16))
        assert torch.equal(yw, torch.where(idx >= 0, w, torch.zeros_like(w)))
    with pytest.raises(EPValueError, match="built for num_max_tokens_per_rank"):
        group.run(lambda r: call(r, 2 * T))
    group.run(lambda r: v1[r].destroy())


def test_loopback_normal_collective_safety():
    """A rank that refuses its call is named by its peers (``EPPeerError``), ranks that disagree all raise
    (``EPMismatchError``), and ``reset()`` (a collective of the rank threads) brings the buffers back."""
    n = 2
    group = LoopbackGroup(n, device="cpu", timeout_secs=30.0)
    v1 = group.v1_buffers(int(1e8), 0, explicitly_destroy=True)
    inp = [sem._inputs(r) for r in range(n)]
    errors: list = [None] * n

    def call(r, bad_rank=-1, hidden=H):
        x, idx, _ = inp[r]
        ntr, _, nte, itr, _ = v1[r].get_dispatch_layout(idx, E)
        if r == bad_rank:
            itr = itr[:, :1]  # a wrong shape: refused on this rank before its host step
        if hidden != H and r == 1:
            x = torch.cat([x, x], 1)
        try:
            return v1[r].dispatch(x, num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte)
        except Exception as exc:
            errors[r] = exc
            return None

    group.run(lambda r: call(r, bad_rank=1))
    assert isinstance(errors[1], EPValueError) and "is_token_in_rank" in str(errors[1])
    assert isinstance(errors[0], EPPeerError) and "rank 1" in str(errors[0])
    errors[:] = [None] * n
    group.run(lambda r: v1[r].reset())
    group.run(lambda r: call(r, hidden=2 * H))  # the ranks disagree on hidden: every rank raises
    assert all(isinstance(e, EPMismatchError) for e in errors), errors
    errors[:] = [None] * n
    group.run(lambda r: v1[r].reset())
    outs = group.run(call)
    assert errors == [None] * n and all(o is not None for o in outs)
    group.run(lambda r: v1[r].destroy())


def test_gpu_loopback_refuses_normal_mode_naming_what_to_run():
    """A rank without a host channel (a GPU group's) refuses normal mode, naming the CPU group and processes."""
    group = LoopbackGroup(1, device="cpu")
    buf = LoopbackBuffer(group, 0, 0, 0, low_latency_mode=True)  # host_bootstrap=None: as on a GPU group
    for call in (lambda: buf.dispatch(torch.zeros(1, H)), lambda: buf.combine(torch.zeros(1, H), None)):
        with pytest.raises(NotImplementedError, match=r"device='cpu'.*launch\.spawn.*transport='ipc'"):
            call()
    with pytest.raises(ValueError, match="GPU loopback group"):
        LoopbackBuffer(group, 0, 0, 0, num_max_tokens_per_rank=8, hidden=H)
