"""CPU: the addressing a zero-copy combine relies on (include/ep_core/combine.cuh, `kZeroCopy`), checked on the
reference's handles, which the kernels' handles equal (the GPU tests compare them).

The kernel of source rank s reduces its token t from one operand per destination rank r: the lane whose
`dst_buffer_slot_idx` is set (the highest lane of that rank), at row `base_r[s] + slot` of rank r's combine buffer,
where `slot = dst_buffer_slot_idx[t, lane] - s * M` and `base_r[s]` is the prefix of rank r's handle over the sources
before s. That row must be the one rank r received for (s, t), and the operands and their order the reference
combine's: then the zero-copy combine is the ordinary one, bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
from ep_core import reference, routing

M, HIDDEN, K, E = 48, 64, 8, 96  # E: a multiple of every rank count here


def _zero_copy_rows(outs, s: int, t: int) -> list[tuple[int, int, int]]:
    """(lane, destination rank, row in its buffer) of each operand of source s's token t, in lane order."""
    h = outs[s].handle
    idx = np.asarray(h.topk_idx)[t]
    slots = np.asarray(h.dst_buffer_slot_idx)[t]
    epr = E // len(outs)
    rows = []
    for lane in range(K):
        if slots[lane] < 0:
            continue
        r = int(idx[lane]) // epr
        psum = np.asarray(outs[r].handle.psum_num_recv_tokens_per_scaleup_rank)
        base = 0 if s == 0 else int(psum[s - 1])
        rows.append((lane, r, base + int(slots[lane]) - s * M))
    return rows


def _dispatched(n: int, counts: list[int], seed: int, **kw):
    inp = routing.make_inputs(n, counts, HIDDEN, E, K, seed=seed, **kw)
    outs = reference.dispatch(
        inp.x_args,
        inp.topk_idxs,
        inp.topk_weights,
        num_experts=E,
        num_max_tokens_per_rank=M,
        do_cpu_sync=True,
    )
    return inp, outs


@pytest.mark.parametrize("n", (1, 2, 3, 8))
def test_each_operand_row_is_the_row_its_rank_received(n: int) -> None:
    rng = np.random.default_rng(n)
    counts = [M, *(int(c) for c in rng.integers(0, M + 1, size=n - 1))]
    if n > 2:
        counts[-1] = 0
    inp, outs = _dispatched(n, counts, 7 * n, masked_ratio=0.3, kind="unbalanced")
    epr = E // n
    for s in range(n):
        idx = inp.topk_idxs[s]
        for t in range(len(idx)):
            ops = _zero_copy_rows(outs, s, t)
            # one operand per destination rank, at its highest lane (the reduce's master)
            want = {}
            for lane in range(K):
                if idx[t, lane] >= 0:
                    want[int(idx[t, lane]) // epr] = lane
            assert [(lane, r) for lane, r, _ in ops] == sorted((lane, r) for r, lane in want.items())
            for _, r, row in ops:
                meta = np.asarray(outs[r].handle.recv_src_metadata)
                assert 0 <= row < outs[r].num_valid_rows
                assert int(meta[row, 0]) == s * M + t, (s, t, r, row)


def test_the_pulled_operands_sum_to_the_reference_combine() -> None:
    """A numpy model of the zero-copy reduce (operands pulled from the destinations' rows, biases first, fp32 in
    lane order, one rounding) equals `reference.combine` bit for bit."""
    n = 4
    rng = np.random.default_rng(3)
    inp, outs = _dispatched(n, [M, 30, 0, 17], 5, masked_ratio=0.25)
    xs = [routing.random_bf16((o.recv_x.shape[0], HIDDEN), rng) for o in outs]
    bias = [routing.random_bf16((len(i), HIDDEN), rng) for i in inp.topk_idxs]
    want = reference.combine(xs, [o.handle for o in outs], bias=bias)
    f32 = lambda b: (b.astype(np.uint32) << 16).view(np.float32)  # noqa: E731
    for s in range(n):
        got = np.empty((len(inp.topk_idxs[s]), HIDDEN), np.uint16)
        for t in range(len(got)):
            acc = f32(bias[s][t]).copy()
            for _, r, row in _zero_copy_rows(outs, s, t):
                acc += f32(xs[r][row])
            got[t] = routing.float32_to_bf16(acc)
        assert np.array_equal(got, want[s].combined_x), f"rank {s}"
