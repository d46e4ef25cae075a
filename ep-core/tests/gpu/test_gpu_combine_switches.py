"""GPU: the combine reduction split into column parts (EP_CORE_COMBINE_REDUCE_PARTS, combine.cuh
`kCombineReduceParts`, issue 17) gives the reference's bits. One block per rank (W = 16 warps) and token counts
inside the split window W < T <= P x W, T % W != 0 (24 and 40 tokens: split at P = 4, 24 also at P = 2) and outside
it (16 = W, 48 a multiple of W: whole rows); biases 0/1/2, multiple reduction on/off, expanded layout, weights. A
hidden size no other GPU test uses, so this process loads the P instance for it alone."""

from __future__ import annotations

import numpy as np
import pytest
from ep_core import reference, routing
from ep_core_gpu_testing import bits, num_gpus

pytestmark = pytest.mark.gpu

if num_gpus() == 0:
    pytest.skip("no CUDA GPU", allow_module_level=True)

from ep_core.kernels import _source  # noqa: E402
from ep_core.kernels.plan import KernelConfig  # noqa: E402
from ep_core.loopback import LoopbackDomain  # noqa: E402

HIDDEN = 640  # 1280-byte combine rows: 2 parts of 40 vectors, 4 of 20
K = 8
E = 32
M = 48


@pytest.mark.parametrize("parts", [2, 4])
@pytest.mark.parametrize("n", [1, 2])
def test_split_reduce_is_bitwise(monkeypatch, n: int, parts: int) -> None:
    monkeypatch.setenv(_source.COMBINE_REDUCE_PARTS_ENV, str(parts))
    cfg = KernelConfig(n, K, HIDDEN)
    saved = _source._loaded.pop(cfg, None)
    try:
        assert f"_rp{parts}" in _source.compile_kernels(cfg).cubin_path.parent.name
        dom = LoopbackDomain(
            n,
            num_max_tokens_per_rank=M,
            hidden=HIDDEN,
            num_topk=K,
            gpu_timeout_secs=10.0,
            cpu_timeout_secs=30.0,
        )
        try:
            for case, tokens in enumerate((24, 40, 16, 48)):
                _one_case(dom, n, case, [tokens] + [M - tokens] * (n - 1))
        finally:
            dom.close()
    finally:
        _source._loaded.pop(cfg, None)  # the P instance stays out of the other tests' way
        if saved is not None:
            _source._loaded[cfg] = saved


def _one_case(dom, n: int, case: int, counts: list[int]) -> None:
    rng = np.random.default_rng(77 + 10 * n + case)
    inp = routing.make_inputs(n, counts, HIDDEN, E, K, seed=int(rng.integers(1 << 30)), masked_ratio=0.25)
    expand = case % 2 == 1
    amr = case % 3 != 2
    outs = dom.dispatch(
        inp.x_args,
        inp.topk_idxs,
        inp.topk_weights,
        num_experts=E,
        do_cpu_sync=True,
        num_sms=1,
        do_expand=expand,
    )
    handles = [o.handle for o in outs]
    k_handles = [o.to_reference().handle for o in outs]
    xs = [routing.random_bf16((o.recv_x.shape[0], HIDDEN), rng) for o in outs]
    weights = None if (expand and not amr) else [o.recv_topk_weights for o in outs]
    nb = case % 3
    biases = None
    if nb == 1:
        biases = [routing.random_bf16((len(i), HIDDEN), rng) for i in inp.topk_idxs]
    elif nb == 2:
        biases = [
            (routing.random_bf16((len(i), HIDDEN), rng), routing.random_bf16((len(i), HIDDEN), rng))
            for i in inp.topk_idxs
        ]
    comb = dom.combine(
        xs, handles, topk_weights=weights, bias=biases, allow_multiple_reduction=amr, num_sms=1
    )
    ref_w = None if weights is None else [w.numpy() for w in weights]
    ref = reference.combine(xs, k_handles, topk_weights=ref_w, bias=biases, allow_multiple_reduction=amr)
    for r in range(n):
        kc = comb[r].to_reference()
        what = f"r{r} tokens {counts[r]} expand={expand} amr={amr} biases={nb}"
        got, want = bits(kc.combined_x), bits(ref[r].combined_x)
        assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
        if not np.array_equal(got, want):
            bad = np.nonzero((got != want).reshape(got.shape[0], -1).any(axis=1))[0]
            raise AssertionError(f"{what}: combined_x rows {bad[:8].tolist()} of {got.shape[0]} differ")
        if weights is not None:
            assert np.array_equal(bits(kc.combined_topk_weights), bits(ref[r].combined_topk_weights)), what
    dom.synchronize()
