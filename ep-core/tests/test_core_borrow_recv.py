"""CPU: the lending finish of a dispatch (ep_torch's ``borrow_recv=True`` on CUDA, issue 42), driver mocked
(`test_core_deferred.py`'s fixture).

``RankDriver.borrow_recv_next`` set before ``finish_dispatch`` (ep_torch sets it around the finish of the split
dispatch): the copy epilogue is launched with a null ``recv_x`` (it copies no row; dispatch_epilogue.cuh) and the
result's ``recv_x`` is the rank's receive region as ``[N * M, token bytes]`` uint8; the other outputs are the
ordinary ones; no plan is kept for a replay; the flag is cleared. A call that cannot lend (expanded, no CPU sync,
cached) copies as usual, the flag cleared all the same."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from ep_core.kernels._args import OP_ARGS_FIELDS
from ep_core.kernels.plan import plan_regions

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_core_deferred import E, H, K, T, _args
from test_core_deferred import mocked as mocked  # (the fixture, found by name)

_RECV_X = OP_ARGS_FIELDS.index("recv_x")


def _epilogue_recv_x(launched) -> int:
    """The `recv_x` word of the last copy-epilogue launch."""
    words = [
        w for launch, *w in launched.raw if getattr(launch, "name", "") == "ep_dispatch_copy_epilogue_impl"
    ]
    return int(words[-1][0][_RECV_X])


def _finish(buf, args, lend: bool):
    rank = buf._executor.rank
    finish = buf.launch_dispatch_deferred(args)
    rank.borrow_recv_next = lend
    try:
        return finish(0)
    finally:
        assert rank.borrow_recv_next is False, "the finish clears the flag"


def test_a_lending_finish_returns_the_region_and_copies_no_row(mocked) -> None:
    buf, alloc, launched = mocked
    x, w, idx = alloc((T, H), "bfloat16"), alloc((T, K), "float32"), alloc((T, K), "int64")
    rank = buf._executor.rank
    ref = _finish(buf, _args(x, idx, w, alloc, do_cpu_sync=True), False)
    assert _epilogue_recv_x(launched) != 0 and ref.recv_x.shape[1] == H
    asked = []
    lends = rank.lends_region
    rank.lends_region = lambda p: asked.append(p) or lends(p)
    launched.clear()
    launched.raw.clear()
    res = _finish(buf, _args(x, idx, w, alloc, do_cpu_sync=True), True)
    assert launched == ["ep_dispatch_impl", "ep_dispatch_copy_epilogue_impl"]
    assert _epilogue_recv_x(launched) == 0, "the epilogue writes no recv_x"
    cfg = asked[0].config
    plan = plan_regions(cfg, E, T, rank.res.data_bytes, op="dispatch")
    assert res.recv_x.ptr == rank.res.base + plan.recv_offset
    assert res.recv_x.dtype == np.dtype(np.uint8)
    assert res.recv_x.shape == (rank.num_ranks * T, cfg.dispatch_token.get_num_bytes())
    assert res.recv_x.shape[1] >= 2 * H, "a whole token a row: the hidden part, then the tail"
    assert res.recv_topk_idx.shape == ref.recv_topk_idx.shape and res.recv_topk_weights is not None
    assert res.handle.topk_idx is idx and rank.last_repeat is None


def test_what_cannot_lend_copies(mocked) -> None:
    buf, alloc, launched = mocked
    x, w, idx = alloc((T, H), "bfloat16"), alloc((T, K), "float32"), alloc((T, K), "int64")
    for extra in ({"do_cpu_sync": False}, {"do_cpu_sync": True, "do_expand": True, "expert_alignment": 4}):
        launched.raw.clear()
        res = _finish(buf, _args(x, idx, w, alloc, **extra), True)
        assert _epilogue_recv_x(launched) != 0 and res.recv_x.shape[1] == H, extra
    first = _finish(buf, _args(x, idx, w, alloc, do_cpu_sync=True), False)
    launched.raw.clear()
    res = _finish(buf, _args(x, None, w, alloc, handle=first.handle, num_experts=None), True)
    assert res.handle is first.handle and res.recv_x.shape[1] == H, "a cached dispatch copies"
