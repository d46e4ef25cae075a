"""GPU: the zero-copy combine (`combine_buffers` + `combine(..., zero_copy=True)`) in the loopback domain.

Each rank writes its expert outputs into its combine buffer (the start of its receive region) instead of an array of
its own; every rank's kernel then reads its operands from the peers' buffers in place. The result must be bitwise
the reference combine's (the same operands in the same order), for several rank counts, deterministic and atomic
slots, CPU-sync, no-sync and cached dispatches, -1 lanes, a rank without tokens and biases; then again on a second
call (the buffers rewritten), an ordinary combine and a dispatch after it (nothing left behind in the workspace).
"""

from __future__ import annotations

import numpy as np
import pytest
from ep_core import reference, routing
from ep_core_gpu_testing import num_gpus

pytestmark = pytest.mark.gpu

if num_gpus() == 0:
    pytest.skip("no CUDA GPU", allow_module_level=True)

from ep_core.kernels import _cuda  # noqa: E402
from ep_core.loopback import LoopbackDomain  # noqa: E402

M, HIDDEN, K, E = 96, 512, 8, 96  # E: a multiple of every rank count here


def _eq(name: str, got, want) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    if not np.array_equal(got, want):
        bad = np.nonzero((got != want).reshape(got.shape[0], -1).any(axis=1))[0]
        raise AssertionError(f"{name}: {len(bad)} rows differ, first {list(bad[:8])}")


def _fill(dom: LoopbackDomain, bufs, xs) -> None:
    for r, (buf, x) in enumerate(zip(bufs, xs)):
        assert buf.shape == x.shape, (buf.shape, x.shape)
        _cuda.copy_to_device(buf.ptr, x, dom.streams[r])


@pytest.mark.parametrize("mode", ("sync", "nosync", "cached"))
@pytest.mark.parametrize("det", (True, False), ids=("det", "atomic"))
@pytest.mark.parametrize("n", (1, 2, 3, 8))
def test_zero_copy_combine_equals_the_reference(n: int, det: bool, mode: str) -> None:
    dom = LoopbackDomain(
        n, num_max_tokens_per_rank=M, hidden=HIDDEN, num_topk=K, num_sms=4, gpu_timeout_secs=10.0
    )
    try:
        rng = np.random.default_rng(31 * n + 2 * det + len(mode))
        counts = [M, *(int(c) for c in rng.integers(0, M + 1, size=n - 1))]
        if n > 2:
            counts[-1] = 0  # a rank without tokens
        inp = routing.make_inputs(n, counts, HIDDEN, E, K, seed=int(rng.integers(1 << 30)), masked_ratio=0.25)
        outs = dom.dispatch(
            inp.x_args,
            inp.topk_idxs,
            inp.topk_weights,
            num_experts=E,
            deterministic=det,
            do_cpu_sync=mode != "nosync",
        )
        handles = [o.handle for o in outs]
        if mode == "cached":
            outs = dom.dispatch(inp.x_args, None, inp.topk_weights, handles=handles)
        ref_handles = [o.to_reference().handle for o in outs]
        biases = [routing.random_bf16((len(i), HIDDEN), rng) for i in inp.topk_idxs] if n % 2 else None
        for step in range(2):  # a second call on rewritten buffers: the read barrier released the first
            xs = [routing.random_bf16((o.recv_x.shape[0], HIDDEN), rng) for o in outs]
            bufs = dom.combine_buffers(handles, HIDDEN)
            _fill(dom, bufs, xs)
            got = dom.combine(bufs, handles, bias=biases, zero_copy=True)
            want = reference.combine(xs, ref_handles, bias=biases)
            for r in range(n):
                _eq(f"step {step} r{r} combined_x", got[r].to_reference().combined_x, want[r].combined_x)
                assert got[r].combined_topk_weights is None
        plain = dom.combine(xs, handles, bias=biases)  # the ordinary road after it, same operands
        for r in range(n):
            _eq(f"ordinary r{r} combined_x", plain[r].to_reference().combined_x, want[r].combined_x)
        again = dom.dispatch(
            inp.x_args, inp.topk_idxs, inp.topk_weights, num_experts=E, deterministic=det, do_cpu_sync=True
        )
        ref = reference.dispatch(
            inp.x_args,
            inp.topk_idxs,
            inp.topk_weights,
            num_experts=E,
            num_max_tokens_per_rank=M,
            do_cpu_sync=True,
        )
        for r in range(n):
            got_d = reference.canonical_order(again[r].to_reference())
            want_d = reference.canonical_order(ref[r])
            _eq(f"dispatch after r{r} recv_x", got_d.recv_x, want_d.recv_x)
        dom.synchronize()
    finally:
        dom.close()


def test_zero_copy_from_another_array_is_refused_on_every_rank() -> None:
    """An array that is not the rank's combine buffer raises before any rank launches; the domain stays usable."""
    n = 2
    dom = LoopbackDomain(
        n, num_max_tokens_per_rank=M, hidden=HIDDEN, num_topk=K, num_sms=4, gpu_timeout_secs=10.0
    )
    try:
        rng = np.random.default_rng(5)
        inp = routing.make_inputs(n, [M, 40], HIDDEN, E, K, seed=11)
        outs = dom.dispatch(inp.x_args, inp.topk_idxs, inp.topk_weights, num_experts=E)
        handles = [o.handle for o in outs]
        xs = [routing.random_bf16((o.recv_x.shape[0], HIDDEN), rng) for o in outs]
        with pytest.raises(ValueError, match="x: a zero-copy combine reads rank 0's combine buffer"):
            dom.combine(xs, handles, zero_copy=True)
        bufs = dom.combine_buffers(handles, HIDDEN)
        _fill(dom, bufs, xs)
        got = dom.combine(bufs, handles, zero_copy=True)
        want = reference.combine(xs, [o.to_reference().handle for o in outs])
        for r in range(n):
            _eq(f"r{r} combined_x", got[r].to_reference().combined_x, want[r].combined_x)
    finally:
        dom.close()
