"""GPU: direct-mode dispatch + combine kernels in the loopback domain (N ranks on one GPU) against ep_core.reference.

Every mode of SPEC §9 on fresh random inputs: {expand, non-expand} x {A = 1, 128} x {bf16, FP8} x {sync, no sync,
cached} x {deterministic or not}, with 0/1/2 biases and multiple reduction on/off spread over the cases, and
routings with -1 lanes, unbalanced load, ranks that receive nothing, ranks with no tokens and num_tokens == M.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from ep_core import reference, routing
from ep_core_gpu_testing import bits, num_gpus

pytestmark = pytest.mark.gpu

if num_gpus() == 0:
    pytest.skip("no CUDA GPU", allow_module_level=True)

from ep_core.kernels._cuda import num_device_sms  # noqa: E402
from ep_core.kernels._source import compile_kernels  # noqa: E402
from ep_core.kernels.plan import KernelConfig  # noqa: E402
from ep_core.loopback import LoopbackDomain  # noqa: E402

M = 96
HIDDEN = 512
K = 8
E = 64
PACKS = HIDDEN // 128
RANKS = (1, 2, 4, 8)

# (expand, alignment, fp8, mode, deterministic)
CASES = list(
    itertools.product((False, True), (1, 128), (False, True), ("sync", "nosync", "cached"), (True, False))
)

_domains: dict[tuple[int, bool], LoopbackDomain] = {}


def _precompile() -> None:
    from concurrent.futures import ThreadPoolExecutor

    cfgs = [KernelConfig(n, K, HIDDEN, e, p) for n in RANKS for (e, p) in ((2, 0), (1, PACKS))]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(compile_kernels, cfgs))


def domain(n: int, overlap: bool = True) -> LoopbackDomain:
    """`overlap=False`: prefer_overlap_with_compute=False, each rank's copy epilogue on its share of the GPU."""
    if not _domains:
        _precompile()
    if (n, overlap) not in _domains:
        _domains[n, overlap] = LoopbackDomain(
            n,
            num_max_tokens_per_rank=M,
            hidden=HIDDEN,
            num_topk=K,
            gpu_timeout_secs=10.0,
            cpu_timeout_secs=30.0,
            prefer_overlap_with_compute=overlap,
        )
    return _domains[n, overlap]


def _eq(name: str, got, want) -> None:
    got = np.asarray(got)
    want = np.asarray(want)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    if got.dtype.kind == "f":
        got = got.view(np.uint32 if got.dtype.itemsize == 4 else np.uint16)
        want = np.asarray(want, dtype=np.asarray(want).dtype).view(got.dtype)
    if np.array_equal(got, want):
        return
    diff = np.asarray(got != want)
    bad = np.nonzero(diff.reshape(diff.shape[0], -1).any(axis=1))[0] if diff.ndim else [0]
    raise AssertionError(f"{name}: {len(bad)} rows differ, first {list(bad[:8])}")


def compare_dispatch(k_out, r_out, *, det: bool, zero_pad: bool, sync: bool, rank: int) -> None:
    kh, rh = k_out.handle, r_out.handle
    _eq(
        f"r{rank} psum_rank",
        kh.psum_num_recv_tokens_per_scaleup_rank,
        rh.psum_num_recv_tokens_per_scaleup_rank,
    )
    _eq(
        f"r{rank} unaligned", kh.num_unaligned_recv_tokens_per_expert, rh.num_unaligned_recv_tokens_per_expert
    )
    _eq(f"r{rank} psum_expert", kh.psum_num_recv_tokens_per_expert, rh.psum_num_recv_tokens_per_expert)
    if sync:
        assert k_out.recv_x.shape == r_out.recv_x.shape, (k_out.recv_x.shape, r_out.recv_x.shape)
        assert kh.num_recv_tokens_per_expert_list == list(rh.num_recv_tokens_per_expert_list)
    if det:
        _eq(f"r{rank} dst_slot", kh.dst_buffer_slot_idx, rh.dst_buffer_slot_idx)
    else:
        k_out = reference.canonical_order(k_out)
        r_out = reference.canonical_order(r_out)
        kh, rh = k_out.handle, r_out.handle
    n_recv = r_out.num_valid_rows
    _eq(f"r{rank} meta", np.asarray(kh.recv_src_metadata)[:n_recv], np.asarray(rh.recv_src_metadata)[:n_recv])
    if not kh.do_expand:
        rows = slice(0, n_recv)
        _eq(f"r{rank} recv_x", k_out.recv_x[rows], r_out.recv_x[rows])
        _eq(f"r{rank} recv_topk_idx", k_out.recv_topk_idx[rows], r_out.recv_topk_idx[rows])
        if r_out.recv_topk_weights is not None:
            _eq(f"r{rank} weights", bits(k_out.recv_topk_weights[rows]), bits(r_out.recv_topk_weights[rows]))
        if r_out.recv_sf is not None:
            _eq(f"r{rank} recv_sf", bits(k_out.recv_sf[rows]), bits(r_out.recv_sf[rows]))
        return
    valid = r_out.valid_expanded_rows
    k_valid = k_out.valid_expanded_rows
    n = min(len(valid), len(k_valid))
    assert np.array_equal(valid[:n], k_valid[:n]) and not valid[n:].any() and not k_valid[n:].any()
    _eq(f"r{rank} recv_x", k_out.recv_x[:n][valid[:n]], r_out.recv_x[:n][valid[:n]])
    if r_out.recv_topk_weights is not None:
        _eq(
            f"r{rank} weights",
            bits(k_out.recv_topk_weights[:n][valid[:n]]),
            bits(r_out.recv_topk_weights[:n][valid[:n]]),
        )
    if r_out.recv_sf is not None:
        _eq(f"r{rank} recv_sf", bits(k_out.recv_sf[:n][valid[:n]]), bits(r_out.recv_sf[:n][valid[:n]]))
    if zero_pad:
        a = kh.expert_alignment
        end = 0
        for c in np.asarray(rh.num_unaligned_recv_tokens_per_expert):
            end = reference.align(end, a) + int(c)
        end = reference.align(end, a) if len(np.asarray(rh.num_unaligned_recv_tokens_per_expert)) else 0
        pad = ~k_valid[:end]
        assert not np.asarray(k_out.recv_x[:end][pad]).any(), "padding rows of recv_x are not zero"
        if k_out.recv_topk_weights is not None:
            assert not np.asarray(k_out.recv_topk_weights[:end][pad]).any(), "padding weights are not zero"
        if k_out.recv_sf is not None:
            assert not np.asarray(k_out.recv_sf[:end][pad]).any(), "padding scales are not zero"


def _token_counts(n: int, case: int, rng: np.random.Generator) -> list[int]:
    counts = [int(c) for c in rng.integers(0, M + 1, size=n)]
    counts[0] = M
    if n > 1 and case % 3 == 1:
        counts[-1] = 0
    return counts


@pytest.mark.parametrize("case", range(len(CASES)), ids=lambda c: "-".join(map(str, CASES[c])))
@pytest.mark.parametrize("n", RANKS)
def test_dispatch_combine(n: int, case: int) -> None:
    check_dispatch_combine(n, case, domain(n))


@pytest.mark.parametrize("case", range(0, len(CASES), 2), ids=lambda c: "-".join(map(str, CASES[c])))
@pytest.mark.parametrize("n", (1, 2, 8))
def test_dispatch_combine_epilogue_on_the_ranks_share(n: int, case: int) -> None:
    """prefer_overlap_with_compute=False: the copy epilogue on device SMs // n blocks, more than the op's 1 or 3 SMs
    of most cases; the same bits as the reference."""
    dom = domain(n, overlap=False)
    assert all(r.epilogue_sms == num_device_sms() // n for r in dom.ranks)
    check_dispatch_combine(n, case, dom)


def check_dispatch_combine(n: int, case: int, dom: LoopbackDomain) -> None:
    if n * 1 > num_device_sms():
        pytest.skip("device too small")
    expand, align, fp8, mode, det = CASES[case]
    rng = np.random.default_rng(1000 * n + case)
    kind = ("uniform", "unbalanced", "uniform", "uniform")[case % 4]
    empty = (n - 1,) if (n > 1 and kind == "uniform" and case % 4 == 2) else ()
    inp = routing.make_inputs(
        n,
        _token_counts(n, case, rng),
        HIDDEN,
        E,
        K,
        seed=int(rng.integers(1 << 30)),
        kind=kind,
        masked_ratio=0.25 if case % 2 else 0.0,
        empty_dst_ranks=empty,
        fp8=fp8,
        sf_dtype=np.int32 if case % 4 == 3 else np.float32,
    )
    col_major = fp8 and case % 2 == 0
    zero_pad = expand and case % 3 != 0

    num_sms = (0, 1, 3)[case % 3] if n <= 8 else 0
    common = dict(
        num_experts=E,
        expert_alignment=align,
        do_expand=expand,
        use_tma_aligned_col_major_sf=col_major,
        do_zero_padding=zero_pad,
    )
    ref = reference.dispatch(
        inp.x_args,
        inp.topk_idxs,
        inp.topk_weights,
        num_max_tokens_per_rank=M,
        do_cpu_sync=mode != "nosync",
        **common,
    )
    outs = dom.dispatch(
        inp.x_args,
        inp.topk_idxs,
        inp.topk_weights,
        deterministic=det,
        do_cpu_sync=mode != "nosync",
        num_sms=num_sms,
        **common,
    )
    k_first = [o.to_reference() for o in outs]
    for r in range(n):
        compare_dispatch(k_first[r], ref[r], det=det, zero_pad=zero_pad, sync=mode != "nosync", rank=r)
    if mode == "cached":
        new_w = [rng.uniform(0.01, 1.0, size=w.shape).astype(np.float32) for w in inp.topk_weights]
        handles = [o.handle for o in outs]
        outs = dom.dispatch(
            inp.x_args,
            None,
            new_w,
            handles=handles,
            **{"do_zero_padding": zero_pad, "use_tma_aligned_col_major_sf": col_major},
        )
        assert all(o.handle is h for o, h in zip(outs, handles))
        ref_c = reference.dispatch(
            inp.x_args,
            None,
            new_w,
            handles=[r.handle for r in ref],
            do_zero_padding=zero_pad,
            use_tma_aligned_col_major_sf=col_major,
        )
        for r in range(n):
            kc = outs[r].to_reference()
            kf = k_first[r]
            if not expand:
                _eq(f"r{r} cached recv_x", kc.recv_x, kf.recv_x)
                _eq(f"r{r} cached idx", kc.recv_topk_idx, kf.recv_topk_idx)
                if kf.recv_sf is not None:
                    _eq(f"r{r} cached sf", bits(kc.recv_sf), bits(kf.recv_sf))
            else:
                v = kf.valid_expanded_rows
                _eq(f"r{r} cached recv_x", kc.recv_x[v], kf.recv_x[v])
            compare_dispatch(kc, ref_c[r], det=det, zero_pad=zero_pad, sync=True, rank=r)

    # combine: random expert outputs (bf16), weights round trip, biases
    amr = case % 2 == 0
    nb = case % 3
    handles = [o.handle for o in outs]
    k_handles = [o.to_reference().handle for o in outs]
    xs = [routing.random_bf16((o.recv_x.shape[0], HIDDEN), rng) for o in outs]
    weights = None
    if not (expand and not amr):
        weights = [o.recv_topk_weights for o in outs]
    biases = None
    if nb == 1:
        biases = [routing.random_bf16((len(i), HIDDEN), rng) for i in inp.topk_idxs]
    elif nb == 2:
        biases = [
            (routing.random_bf16((len(i), HIDDEN), rng), routing.random_bf16((len(i), HIDDEN), rng))
            for i in inp.topk_idxs
        ]
    comb = dom.combine(xs, handles, topk_weights=weights, bias=biases, allow_multiple_reduction=amr)
    ref_w = None if weights is None else [w.numpy() for w in weights]
    ref_comb = reference.combine(xs, k_handles, topk_weights=ref_w, bias=biases, allow_multiple_reduction=amr)
    for r in range(n):
        kc = comb[r].to_reference()
        _eq(f"r{r} combined_x", kc.combined_x, ref_comb[r].combined_x)
        if weights is not None:
            _eq(f"r{r} combined_w", bits(kc.combined_topk_weights), bits(ref_comb[r].combined_topk_weights))
            if mode != "cached":
                want = np.where(inp.topk_idxs[r] >= 0, inp.topk_weights[r], np.float32(0))
                _eq(f"r{r} weights round trip", bits(kc.combined_topk_weights), bits(want))
    dom.synchronize()


@pytest.mark.parametrize("det", (True, False), ids=("det", "atomic"))
@pytest.mark.parametrize("k", (1, 3, 12, 32))
def test_topk_other_than_8(k: int, det: bool) -> None:
    """Top-k 1, 3, 12 and 32 (the deterministic count phase packs 32 // 1, 8, 2 and 1 tokens per warp), with -1
    lanes and a rank that sends nothing, at 4 ranks on 2 SMs each: dispatch and combine equal the reference."""
    n, e = 4, 128
    dom = LoopbackDomain(
        n, num_max_tokens_per_rank=M, hidden=HIDDEN, num_topk=k, num_sms=2, gpu_timeout_secs=10.0
    )
    rng = np.random.default_rng(77 + k)
    counts = [M, 0, 37, 64]
    inp = routing.make_inputs(
        n, counts, HIDDEN, e, k, seed=int(rng.integers(1 << 30)), masked_ratio=0.25 if k > 1 else 0.0
    )
    ref = reference.dispatch(
        inp.x_args,
        inp.topk_idxs,
        inp.topk_weights,
        num_experts=e,
        num_max_tokens_per_rank=M,
        do_cpu_sync=True,
    )
    outs = dom.dispatch(inp.x_args, inp.topk_idxs, inp.topk_weights, num_experts=e, deterministic=det)
    for r in range(n):
        compare_dispatch(outs[r].to_reference(), ref[r], det=det, zero_pad=False, sync=True, rank=r)
    xs = [routing.random_bf16((o.recv_x.shape[0], HIDDEN), rng) for o in outs]
    comb = dom.combine(xs, [o.handle for o in outs], topk_weights=[o.recv_topk_weights for o in outs])
    ref_c = reference.combine(
        xs, [o.to_reference().handle for o in outs], topk_weights=[o.recv_topk_weights.numpy() for o in outs]
    )
    for r in range(n):
        _eq(f"r{r} combined_x", comb[r].to_reference().combined_x, ref_c[r].combined_x)
    dom.close()
