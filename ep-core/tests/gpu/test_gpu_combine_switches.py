"""GPU: the kernels' JIT switches of issue 17 give the reference's bits, both on (the default build) and off, each
build chosen by its environment variable set explicitly (the other two switches at their defaults).

- EP_CORE_COMBINE_REDUCE_PARTS (combine.cuh `kCombineReduceParts`; default 4 here): the reduction split into column
  parts, P = 1 (whole rows), 2 and 4. One block per rank (W = 16 warps) and token counts inside the split window
  W < T <= P x W, T % W != 0 (24 and 40 tokens: split at P = 4, 24 also at P = 2) and outside it (16 = W, 48 a
  multiple of W: whole rows).
- EP_CORE_COMBINE_LOCAL_REF (`kCombineLocalRef`; 1 and 0): rows whose source token is on the sending rank left by
  address (every row at EP1), at 1, 2 and 4 ranks, expanded or not, multiple reduction on/off (rank layout and lane
  slots).
- EP_CORE_WARP_MAJOR (token.cuh `work_warp_index`; 1 and 0): tokens and rows handed out warp-major in dispatch, copy
  epilogue and combine; dispatch (deterministic: slots too; otherwise in canonical order), cached dispatch and
  combine against the reference, at 1, 2 and 4 ranks, 1 and 3 SMs (partial last rounds).

Biases 0/1/2, weights round trip. A hidden size no other GPU test uses, and the instance is dropped from the process
cache afterwards, so no other test loads a build of this module's environment."""

from __future__ import annotations

import contextlib

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


SWITCHES = (_source.COMBINE_REDUCE_PARTS_ENV, _source.COMBINE_LOCAL_REF_ENV, _source.WARP_MAJOR_ENV)
OFF_SUFFIXES = ("_rp", "_lr0", "_wm0")


@contextlib.contextmanager
def switched_domain(monkeypatch, n: int, env: dict[str, str], suffix: str):
    """A loopback domain whose kernels are the instance built with `env` (the other switches unset: defaults),
    checked by its name suffix ("": the default build, no switch suffix)."""
    for k in SWITCHES:
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    cfg = KernelConfig(n, K, HIDDEN)
    saved = _source._loaded.pop(cfg, None)
    try:
        name = _source.compile_kernels(cfg).name
        if suffix:
            assert name.endswith(suffix), name
        else:
            assert not any(s in name for s in OFF_SUFFIXES), name
        dom = LoopbackDomain(
            n,
            num_max_tokens_per_rank=M,
            hidden=HIDDEN,
            num_topk=K,
            gpu_timeout_secs=10.0,
            cpu_timeout_secs=30.0,
        )
        try:
            yield dom
        finally:
            dom.close()
    finally:
        _source._loaded.pop(cfg, None)
        if saved is not None:
            _source._loaded[cfg] = saved


@pytest.mark.parametrize(("parts", "suffix"), [(1, "_rp1"), (2, "_rp2"), (4, "")])
@pytest.mark.parametrize("n", [1, 2])
def test_split_reduce_is_bitwise(monkeypatch, n: int, parts: int, suffix: str) -> None:
    env = {_source.COMBINE_REDUCE_PARTS_ENV: str(parts)}
    with switched_domain(monkeypatch, n, env, suffix) as dom:
        for case, tokens in enumerate((24, 40, 16, 48)):
            _one_case(
                dom, n, case, [tokens] + [M - tokens] * (n - 1), expand=case % 2 == 1, amr=case % 3 != 2
            )


@pytest.mark.parametrize(("value", "suffix"), [("1", ""), ("0", "_lr0")], ids=["on", "off"])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_local_ref_is_bitwise(monkeypatch, n: int, value: str, suffix: str) -> None:
    with switched_domain(monkeypatch, n, {_source.COMBINE_LOCAL_REF_ENV: value}, suffix) as dom:
        rng = np.random.default_rng(5 + n)
        case = 0
        for expand in (False, True):
            for amr in (True, False):
                for _ in range(2):
                    counts = [int(c) for c in rng.integers(0, M + 1, size=n)]
                    counts[0] = M
                    if n > 1 and case % 3 == 1:
                        counts[-1] = 0
                    _one_case(dom, n, 100 + case, counts, expand=expand, amr=amr, num_sms=(1, 3)[case % 2])
                    case += 1


@pytest.mark.parametrize(("value", "suffix"), [("1", ""), ("0", "_wm0")], ids=["on", "off"])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_warp_major_is_bitwise(monkeypatch, n: int, value: str, suffix: str) -> None:
    with switched_domain(monkeypatch, n, {_source.WARP_MAJOR_ENV: value}, suffix) as dom:
        rng = np.random.default_rng(9 + n)
        for case in range(6):
            counts = [int(c) for c in rng.integers(1, M + 1, size=n)]
            counts[0] = M - 1 if case % 2 else M
            det, sms, expand = case % 2 == 0, (1, 3)[case % 2], case >= 4
            inp = routing.make_inputs(
                n, counts, HIDDEN, E, K, seed=int(rng.integers(1 << 30)), masked_ratio=0.25
            )
            kw = dict(num_experts=E, do_cpu_sync=True, do_expand=expand)
            ref = reference.dispatch(
                inp.x_args, inp.topk_idxs, inp.topk_weights, num_max_tokens_per_rank=M, **kw
            )
            outs = dom.dispatch(
                inp.x_args, inp.topk_idxs, inp.topk_weights, deterministic=det, num_sms=sms, **kw
            )
            first = [o.to_reference() for o in outs]
            for r in range(n):
                k_out, r_out = first[r], ref[r]
                what = f"r{r} det={det} sms={sms} expand={expand}"
                if det:
                    assert np.array_equal(
                        k_out.handle.dst_buffer_slot_idx, r_out.handle.dst_buffer_slot_idx
                    ), what
                else:
                    k_out, r_out = reference.canonical_order(k_out), reference.canonical_order(r_out)
                n_recv = r_out.num_valid_rows
                meta_k = np.asarray(k_out.handle.recv_src_metadata)[:n_recv]
                assert np.array_equal(meta_k, np.asarray(r_out.handle.recv_src_metadata)[:n_recv]), what
                if not expand:
                    assert np.array_equal(k_out.recv_x[:n_recv], r_out.recv_x[:n_recv]), f"{what}: recv_x"
            if not expand:  # cached: the same rows again
                again = dom.dispatch(inp.x_args, None, inp.topk_weights, handles=[o.handle for o in outs])
                for r in range(n):
                    assert np.array_equal(again[r].to_reference().recv_x, first[r].recv_x), f"r{r} cached"
            _combine_check(
                dom, n, 200 + case, counts, outs, rng, expand=expand, amr=case % 3 != 2, num_sms=sms
            )


def _one_case(
    dom, n: int, case: int, counts: list[int], *, expand: bool, amr: bool, num_sms: int = 1
) -> None:
    rng = np.random.default_rng(77 + 10 * n + case)
    inp = routing.make_inputs(n, counts, HIDDEN, E, K, seed=int(rng.integers(1 << 30)), masked_ratio=0.25)
    outs = dom.dispatch(
        inp.x_args,
        inp.topk_idxs,
        inp.topk_weights,
        num_experts=E,
        do_cpu_sync=True,
        num_sms=num_sms,
        do_expand=expand,
    )
    _combine_check(dom, n, case, counts, outs, rng, expand=expand, amr=amr, num_sms=num_sms)


def _combine_check(dom, n, case, counts, outs, rng, *, expand: bool, amr: bool, num_sms: int) -> None:
    handles = [o.handle for o in outs]
    k_handles = [o.to_reference().handle for o in outs]
    xs = [routing.random_bf16((o.recv_x.shape[0], HIDDEN), rng) for o in outs]
    weights = None if (expand and not amr) else [o.recv_topk_weights for o in outs]
    nb = case % 3
    biases = None
    if nb == 1:
        biases = [routing.random_bf16((c, HIDDEN), rng) for c in counts]
    elif nb == 2:
        biases = [
            (routing.random_bf16((c, HIDDEN), rng), routing.random_bf16((c, HIDDEN), rng)) for c in counts
        ]
    comb = dom.combine(
        xs, handles, topk_weights=weights, bias=biases, allow_multiple_reduction=amr, num_sms=num_sms
    )
    ref_w = None if weights is None else [w.numpy() for w in weights]
    ref = reference.combine(xs, k_handles, topk_weights=ref_w, bias=biases, allow_multiple_reduction=amr)
    for r in range(n):
        kc = comb[r].to_reference()
        what = f"r{r} tokens {counts[r]} expand={expand} amr={amr} biases={nb} sms={num_sms}"
        got, want = bits(kc.combined_x), bits(ref[r].combined_x)
        assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
        if not np.array_equal(got, want):
            bad = np.nonzero((got != want).reshape(got.shape[0], -1).any(axis=1))[0]
            raise AssertionError(f"{what}: combined_x rows {bad[:8].tolist()} of {got.shape[0]} differ")
        if weights is not None:
            assert np.array_equal(bits(kc.combined_topk_weights), bits(ref[r].combined_topk_weights)), what
    dom.synchronize()
