"""ep_core.reference against a naive per-token model of SPEC §2-3, plus its properties on edge-case routings."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from ep_core import reference as ref
from ep_core import routing
from ep_core.bf16 import bf16_to_float32, float32_to_bf16
from hypothesis import given, settings
from hypothesis import strategies as st


def _align(a: int, b: int) -> int:
    return (a + b - 1) // b * b


# ------------------------------------------------------------------------------------------------------------
# bf16


def test_bf16_known_values():
    cases = {
        0x3F800000: 0x3F80,  # 1.0
        0x3F808000: 0x3F80,  # tie, even stays
        0x3F818000: 0x3F82,  # tie, odd rounds up
        0x3F808001: 0x3F81,  # above tie
        0x80000000: 0x8000,  # -0.0
        0x7F800000: 0x7F80,  # +inf
        0xFF800000: 0xFF80,  # -inf
        0x7F7FFFFF: 0x7F80,  # max float rounds to inf
        0x00000001: 0x0000,  # smallest subnormal rounds to 0
        0x7F800001: 0x7FC0,  # signalling NaN -> quiet NaN
        0xFFC00000: 0xFFC0,  # negative quiet NaN keeps its sign
    }
    bits = np.array(list(cases), dtype=np.uint32)
    assert float32_to_bf16(bits.view(np.float32)).tolist() == list(cases.values())


@given(st.integers(0, 2**32 - 1))
def test_bf16_round_to_nearest_even(u):
    f = np.array([u], dtype=np.uint32).view(np.float32)
    if np.isnan(f[0]):
        return
    r = int(float32_to_bf16(f)[0])
    lo = u >> 16
    cand = [lo, lo + 1] if (u & 0xFFFF) else [lo]
    assert r in cand
    # exactness: nearest in float64 arithmetic, ties to even
    x = float(f[0])
    if len(cand) == 2 and np.isfinite(bf16_to_float32(np.array(cand, dtype=np.uint16))).all():
        dl, dh = (abs(float(bf16_to_float32(np.uint16(c))) - x) for c in cand)
        want = cand[0] if dl < dh else cand[1] if dh < dl else (cand[0] if cand[0] % 2 == 0 else cand[1])
        assert r == want
    assert int(float32_to_bf16(bf16_to_float32(np.array([r], dtype=np.uint16)))[0]) == r


# ------------------------------------------------------------------------------------------------------------
# a naive model: per token, per lane loops written straight from SPEC §2-3


def naive_dispatch(idxs, m, e, su, alignment, expand, deterministic=False):
    """Per destination: ordered list of (src, tok, master, local ids), per-expert row lists. Sources walked region
    by region, or (deterministic) in rank order: rows by the source token's global index."""
    n = len(idxs)
    epr = e // n
    out = []
    for d in range(n):
        recv = []
        walk = [[*range(n)]] if deterministic else [range(region, n, su) for region in range(su)]
        for sources in walk:
            for s in sources:
                for t, row in enumerate(idxs[s]):
                    lanes = [k for k, x in enumerate(row) if x >= 0 and x // epr == d]
                    if lanes:
                        local = [int(x - d * epr) if (x >= 0 and x // epr == d) else -1 for x in row]
                        recv.append((s, t, max(lanes), local))
        experts = [[] for _ in range(epr)]
        for i, (_, _, _, local) in sorted(enumerate(recv), key=lambda it: (it[1][0], it[1][1])):
            for k, lid in enumerate(local):
                if lid >= 0:
                    experts[lid].append((i, k))
        out.append((recv, experts))
    return out


def naive_combine(idxs, partial, m, e, su, biases, amr, expand):
    """partial(d, s, t, k) -> bf16 bits row of the value rank d holds for lane k (expand) or token (non-expand)."""
    n = len(idxs)
    epr = e // n
    so = n // su
    results = []
    for s in range(n):
        rows = []
        for t, row in enumerate(idxs[s]):
            ranks = sorted({int(x // epr) for x in row if x >= 0})
            ops = []  # (rep lane, float32 row, domain)
            for d in ranks:
                lanes = [k for k, x in enumerate(row) if x >= 0 and x // epr == d]
                if expand and not amr:
                    ops += [(k, bf16_to_float32(partial(d, s, t, k)), d // su) for k in lanes]
                    continue
                if expand:
                    acc = None
                    for k in lanes:
                        v = bf16_to_float32(partial(d, s, t, k))
                        acc = v if acc is None else (acc + v).astype(np.float32)
                    val = bf16_to_float32(float32_to_bf16(acc))
                else:
                    val = bf16_to_float32(partial(d, s, t, None))
                ops.append((max(lanes), val, d // su))
            if so > 1 and amr:
                merged = []
                for dom in sorted({o[2] for o in ops}):
                    group = sorted(o for o in ops if o[2] == dom)
                    acc = None
                    for _, v, _ in group:
                        acc = v if acc is None else (acc + v).astype(np.float32)
                    merged.append((group[-1][0], bf16_to_float32(float32_to_bf16(acc)), dom))
                ops = merged
            acc = None
            b = biases[s]
            if b is not None:
                parts = b if isinstance(b, tuple) else (b,)
                acc = bf16_to_float32(parts[0][t])
                for p in parts[1:]:
                    acc = (acc + bf16_to_float32(p[t])).astype(np.float32)
            for _, v, _ in sorted(ops, key=lambda o: o[0]):
                acc = v if acc is None else (acc + v).astype(np.float32)
            rows.append(
                float32_to_bf16(acc) if acc is not None else np.zeros(partial.hidden, dtype=np.uint16)
            )
        results.append(np.array(rows, dtype=np.uint16).reshape(len(rows), partial.hidden))
    return results


class Partial:
    """Deterministic per-(rank, source token, lane) expert outputs, like DeepEP's sinusoid recipe."""

    def __init__(self, hidden, seed):
        self.hidden = hidden
        self.seed = seed

    def __call__(self, d, s, t, k):
        kk = -1 if k is None else k
        rng = np.random.default_rng([self.seed, d, s, t, kk + 1])
        return routing.random_bf16((self.hidden,), rng)


def _expert_outputs(outs, part, expand):
    """Rank d's combine input built from `part` through d's handle."""
    xs = []
    for d, o in enumerate(outs):
        h = o.handle
        x = np.zeros_like(o.recv_x)
        n = o.num_valid_rows
        meta = h.recv_src_metadata[:n]
        for i in range(n):
            s, t = divmod(int(meta[i, 0]), h.num_max_tokens_per_rank)
            if expand:
                for k, row in enumerate(meta[i, 2:]):
                    if row >= 0:
                        x[row] = part(d, s, t, k)
            else:
                x[i] = part(d, s, t, None)
        xs.append(x)
    return xs


CASES = {
    # name: (num ranks, tokens per rank, experts, topk, kind, masked ratio, empty destination ranks, S_u)
    "uniform": (4, [6, 5, 8, 7], 16, 4, "uniform", 0.0, (), None),
    "masked": (4, [8, 3, 8, 6], 16, 4, "uniform", 0.4, (), None),
    "empty_src": (4, [0, 7, 0, 8], 8, 2, "uniform", 0.0, (), None),
    "empty_dst": (4, [8, 8, 8, 8], 16, 3, "uniform", 0.0, (1, 2), None),
    "one_rank": (1, [8], 4, 3, "uniform", 0.2, (), None),
    "unbalanced": (4, [8, 8, 8, 8], 32, 6, "unbalanced", 0.0, (), None),
    "one_expert": (4, [8, 8, 5, 8], 8, 4, "one_expert", 0.0, (), None),
    "hybrid2x2": (4, [7, 8, 6, 8], 16, 4, "uniform", 0.2, (), 2),
    "hybrid4x2": (8, [5, 8, 0, 8, 6, 8, 3, 8], 32, 5, "uniform", 0.1, (), 2),
}
M = 8
HIDDEN = 32


def _inputs(case, seed=0, fp8=False):
    n, tokens, e, k, kind, masked, empty, su = CASES[case]
    inp = routing.make_inputs(
        n,
        tokens,
        HIDDEN,
        e,
        k,
        seed=seed,
        kind=kind,
        masked_ratio=masked,
        empty_dst_ranks=empty,
        fp8=fp8,
        num_sf_packs=3,
    )
    return inp, e, (n if su is None else su)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("expand", [False, True])
@pytest.mark.parametrize("alignment", [1, 4])
@pytest.mark.parametrize("deterministic", [False, True])
def test_dispatch_matches_naive(case, expand, alignment, deterministic):
    inp, e, su = _inputs(case, seed=3)
    n = len(inp.xs)
    outs = ref.dispatch(
        inp.x_args,
        inp.topk_idxs,
        inp.topk_weights,
        num_experts=e,
        num_max_tokens_per_rank=M,
        expert_alignment=alignment,
        do_expand=expand,
        num_scaleup_ranks=su,
        deterministic=deterministic,
    )
    naive = naive_dispatch(inp.topk_idxs, M, e, su, alignment, expand, deterministic)
    for o, (recv, experts) in zip(outs, naive):
        h = o.handle
        assert h.num_recv_tokens == len(recv)
        meta = h.recv_src_metadata
        assert meta.dtype == np.int32 and meta.shape == (len(recv), inp.topk_idxs[0].shape[1] + 2)
        assert [tuple(r) for r in meta[:, :2]] == [(s * M + t, s * h.num_topk + mk) for s, t, mk, _ in recv]
        region = [sum(1 for r in recv if r[0] % su == g) for g in range(su)]
        assert h.psum_num_recv_tokens_per_scaleup_rank.tolist() == np.cumsum(region).tolist()
        counts = [len(x) for x in experts]
        aligned = [_align(c, alignment) for c in counts]
        assert h.num_unaligned_recv_tokens_per_expert.tolist() == counts
        assert h.num_recv_tokens_per_expert_list == aligned
        assert h.num_expanded_tokens == sum(aligned)
        if not expand:
            assert (meta[:, 2:] == -1).all()
            assert h.psum_num_recv_tokens_per_expert.tolist() == np.cumsum(aligned).tolist()
            assert o.recv_x.shape == (len(recv), HIDDEN)
            for i, (s, t, _, local) in enumerate(recv):
                assert (o.recv_x[i] == inp.xs[s][t]).all()
                assert o.recv_topk_idx[i].tolist() == local
                assert (
                    o.recv_topk_weights[i].view(np.uint32).tolist()
                    == inp.topk_weights[s][t].view(np.uint32).tolist()
                )
        else:
            assert o.recv_topk_idx is None
            starts = np.concatenate([[0], np.cumsum(aligned)[:-1]])
            assert h.psum_num_recv_tokens_per_expert.tolist() == (starts + counts).tolist()
            assert o.recv_x.shape == (sum(aligned), HIDDEN)
            valid = np.zeros(sum(aligned), bool)
            for lid, rows in enumerate(experts):
                for j, (i, k) in enumerate(rows):
                    row = starts[lid] + j
                    valid[row] = True
                    s, t = recv[i][0], recv[i][1]
                    assert meta[i, 2 + k] == row
                    assert (o.recv_x[row] == inp.xs[s][t]).all()
                    assert o.recv_topk_weights[row] == inp.topk_weights[s][t, k]
            assert (meta[:, 2:] >= 0).sum() == valid.sum()
            assert (o.recv_x[~valid] == 0).all() and (o.recv_topk_weights[~valid] == 0).all()
            assert (o.valid_expanded_rows == valid).all()
        # sender side: the master lane of each (token, destination) holds src*M + slot
        for s in range(n):
            slots = outs[s].handle.dst_buffer_slot_idx
            sent = [(t, mk) for (src, t, mk, _) in recv if src == s]
            for j, (t, mk) in enumerate(sent):
                assert slots[t, mk] == s * M + j


@pytest.mark.parametrize("case", list(CASES))
def test_every_valid_token_rank_pair_received_once(case):
    inp, e, su = _inputs(case, seed=5)
    n = len(inp.xs)
    outs = ref.dispatch(
        inp.x_args,
        inp.topk_idxs,
        inp.topk_weights,
        num_experts=e,
        num_max_tokens_per_rank=M,
        num_scaleup_ranks=su,
    )
    got = sorted((int(src), d) for d, o in enumerate(outs) for src in o.handle.recv_src_metadata[:, 0])
    epr = e // n
    want = sorted(
        (s * M + t, int(d))
        for s in range(n)
        for t, row in enumerate(inp.topk_idxs[s])
        for d in {x // epr for x in row if x >= 0}
    )
    assert got == want
    # every slot of the sender side is a distinct destination slot
    for s in range(n):
        slots = outs[s].handle.dst_buffer_slot_idx
        assert (
            (slots >= 0).sum(axis=1) == [len({x // epr for x in r if x >= 0}) for r in inp.topk_idxs[s]]
        ).all()


@pytest.mark.parametrize("case", ["uniform", "masked", "hybrid4x2", "empty_src"])
@pytest.mark.parametrize("expand", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_cached_dispatch_and_no_cpu_sync(case, expand, fp8, deterministic):
    inp, e, su = _inputs(case, seed=7, fp8=fp8)
    n = len(inp.xs)
    k = inp.topk_idxs[0].shape[1]
    kw = dict(
        num_experts=e,
        num_max_tokens_per_rank=M,
        expert_alignment=4,
        do_expand=expand,
        num_scaleup_ranks=su,
        deterministic=deterministic,
    )
    outs = ref.dispatch(inp.x_args, inp.topk_idxs, inp.topk_weights, **kw)
    cached = ref.dispatch(
        inp.x_args, None, inp.topk_weights, handles=[o.handle for o in outs], do_zero_padding=expand
    )
    for a, b in zip(outs, cached):
        assert b.handle is a.handle
        for name in ("recv_x", "recv_sf", "recv_topk_idx", "recv_topk_weights"):
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None) == (y is None)
            if x is not None:
                assert x.dtype == y.dtype and x.tobytes() == y.tobytes()
    nosync = ref.dispatch(inp.x_args, inp.topk_idxs, inp.topk_weights, do_cpu_sync=False, **kw)
    for a, b in zip(outs, nosync):
        h = b.handle
        assert h.num_recv_tokens == n * M and h.num_recv_tokens_per_expert_list == []
        epr = e // n
        assert h.num_expanded_tokens == _align(n * M * min(k, epr) + 3 * epr, 4)
        rows = h.num_expanded_tokens if expand else n * M
        assert b.recv_x.shape[0] == rows and h.recv_src_metadata.shape == (n * M, k + 2)
        nv = a.num_valid_rows
        assert b.num_valid_rows == nv
        assert (h.recv_src_metadata[:nv] == a.handle.recv_src_metadata).all()
        valid = a.recv_x.shape[0]
        assert (b.recv_x[:valid] == a.recv_x).all()
        for name in (
            "psum_num_recv_tokens_per_scaleup_rank",
            "psum_num_recv_tokens_per_expert",
            "num_unaligned_recv_tokens_per_expert",
        ):
            assert (getattr(h, name) == getattr(a.handle, name)).all()
        if fp8:
            assert (b.recv_sf[:valid].view(np.uint32) == a.recv_sf.view(np.uint32)).all()


def test_fp8_scales_bitwise_and_col_major():
    inp, e, _ = _inputs("masked", seed=9, fp8=True)
    inp.sfs = [s.view(np.int32) for s in inp.sfs]  # opaque packs, also NaN-like patterns
    inp.sfs[0][0, 0] = np.int32(-4194304)  # 0xFFC00000 as float32 would be a NaN
    strided = [np.asfortranarray(s) for s in inp.sfs]  # any input strides
    outs = ref.dispatch(
        list(zip(inp.xs, strided)),
        inp.topk_idxs,
        None,
        num_experts=e,
        num_max_tokens_per_rank=M,
        use_tma_aligned_col_major_sf=True,
        do_expand=True,
        expert_alignment=4,
    )
    for o in outs:
        r = o.recv_sf.shape[0]
        assert o.recv_sf.dtype == np.int32
        assert o.recv_sf.strides == (4, 4 * _align(r, 4))
        assert o.recv_x.dtype == np.uint8 and o.recv_topk_weights is None
        meta = o.handle.recv_src_metadata
        for i in range(o.num_valid_rows):
            s, t = divmod(int(meta[i, 0]), M)
            for row in meta[i, 2:][meta[i, 2:] >= 0]:
                assert (o.recv_sf[row] == inp.sfs[s][t]).all() and (o.recv_x[row] == inp.xs[s][t]).all()


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("expand", [False, True])
@pytest.mark.parametrize("amr", [True, False])
@pytest.mark.parametrize("num_bias", [0, 1, 2])
def test_combine_matches_naive(case, expand, amr, num_bias):
    inp, e, su = _inputs(case, seed=11)
    n = len(inp.xs)
    outs = ref.dispatch(
        inp.x_args,
        inp.topk_idxs,
        inp.topk_weights,
        num_experts=e,
        num_max_tokens_per_rank=M,
        expert_alignment=4,
        do_expand=expand,
        num_scaleup_ranks=su,
        do_zero_padding=expand,
        deterministic=num_bias == 1,  # the combine reads any row order through the handles
    )
    part = Partial(HIDDEN, seed=13)
    xs = _expert_outputs(outs, part, expand)
    rng = np.random.default_rng(17)
    biases = []
    for s in range(n):
        b = tuple(routing.random_bf16((len(inp.xs[s]), HIDDEN), rng) for _ in range(num_bias))
        biases.append(None if num_bias == 0 else b[0] if num_bias == 1 else b)
    weights = None if (expand and not amr) else [o.recv_topk_weights for o in outs]
    got = ref.combine(
        xs, [o.handle for o in outs], topk_weights=weights, bias=biases, allow_multiple_reduction=amr
    )
    want = naive_combine(inp.topk_idxs, part, M, e, su, biases, amr, expand)
    for s in range(n):
        assert got[s].combined_x.shape == (len(inp.xs[s]), HIDDEN)
        assert got[s].combined_x.tobytes() == want[s].tobytes()
        if weights is not None:
            assert got[s].combined_topk_weights.tobytes() == inp.topk_weights[s].tobytes()


def test_combine_accepts_any_row_order_and_canonical_order():
    inp, e, _ = _inputs("masked", seed=19)
    outs = ref.dispatch(
        inp.x_args,
        inp.topk_idxs,
        inp.topk_weights,
        num_experts=e,
        num_max_tokens_per_rank=M,
        expert_alignment=4,
        do_expand=True,
    )
    part = Partial(HIDDEN, seed=23)
    want = ref.combine(_expert_outputs(outs, part, True), [o.handle for o in outs])
    rng = np.random.default_rng(29)
    shuffled = []
    for o in outs:
        h = o.handle
        nv = o.num_valid_rows
        # shuffle received tokens inside each region, and expanded rows inside each expert
        perm_tok = np.arange(h.num_recv_tokens)
        bounds = np.concatenate([[0], h.psum_num_recv_tokens_per_scaleup_rank])
        for lo, hi in itertools.pairwise(bounds):
            perm_tok[lo:hi] = rng.permutation(np.arange(lo, hi))
        rows = o.recv_x.shape[0]
        perm_rows = np.arange(rows)
        start = 0
        for c in h.num_unaligned_recv_tokens_per_expert:
            perm_rows[start : start + c] = rng.permutation(np.arange(start, start + c))
            start = _align(start + int(c), h.expert_alignment)
        inv = np.empty(rows, np.int64)
        inv[perm_rows] = np.arange(rows)
        meta = h.recv_src_metadata[perm_tok].copy()
        meta[:nv, 2:] = np.where(meta[:nv, 2:] >= 0, inv[np.maximum(meta[:nv, 2:], 0)], -1)
        hh = dataclasses.replace(h, recv_src_metadata=meta)
        shuffled.append(
            ref.DispatchOutput(o.recv_x[perm_rows], None, None, o.recv_topk_weights[perm_rows], hh)
        )
    got = ref.combine(_expert_outputs(shuffled, part, True), [o.handle for o in shuffled])
    for a, b in zip(want, got):
        assert a.combined_x.tobytes() == b.combined_x.tobytes()
    for o, s in zip(outs, shuffled):
        c = ref.canonical_order(s)
        assert c.recv_x.tobytes() == o.recv_x.tobytes()
        assert c.recv_topk_weights.tobytes() == o.recv_topk_weights.tobytes()
        assert (c.handle.recv_src_metadata == o.handle.recv_src_metadata).all()


def test_identity_experts_round_trip():
    """Non-expand identity experts: every destination returns the token itself; the sum is the token added
    (number of destination ranks) times in fp32, rounded once."""
    inp, e, _ = _inputs("masked", seed=31)
    n = len(inp.xs)
    epr = e // n
    outs = ref.dispatch(inp.x_args, inp.topk_idxs, inp.topk_weights, num_experts=e, num_max_tokens_per_rank=M)
    got = ref.combine(
        [o.recv_x for o in outs], [o.handle for o in outs], topk_weights=[o.recv_topk_weights for o in outs]
    )
    for s in range(n):
        x = bf16_to_float32(inp.xs[s])
        acc = np.zeros_like(x)
        for t, row in enumerate(inp.topk_idxs[s]):
            c = len({v // epr for v in row if v >= 0})
            a = x[t] if c else np.zeros_like(x[t])
            for _ in range(c - 1):
                a = (a + x[t]).astype(np.float32)
            acc[t] = a
        assert got[s].combined_x.tobytes() == float32_to_bf16(acc).tobytes()
        assert got[s].combined_topk_weights.tobytes() == inp.topk_weights[s].tobytes()


@pytest.mark.parametrize("num_tokens", [M, 1])
def test_full_and_single_token(num_tokens):
    inp = routing.make_inputs(2, num_tokens, HIDDEN, 4, 4, seed=37)
    outs = ref.dispatch(inp.x_args, inp.topk_idxs, inp.topk_weights, num_experts=4, num_max_tokens_per_rank=M)
    # with K == E every token goes to every rank
    assert [o.handle.num_recv_tokens for o in outs] == [2 * num_tokens] * 2


def test_no_valid_lane_combines_to_bias_or_zero():
    idx = [np.full((3, 2), -1, np.int64), np.array([[0, -1], [-1, -1], [1, 3]])]
    w = [np.zeros((3, 2), np.float32), np.ones((3, 2), np.float32)]
    xs = [routing.random_bf16((3, 16), np.random.default_rng(1)) for _ in range(2)]
    outs = ref.dispatch(xs, idx, w, num_experts=4, num_max_tokens_per_rank=4)
    b = routing.random_bf16((3, 16), np.random.default_rng(2))
    got = ref.combine([o.recv_x for o in outs], [o.handle for o in outs], bias=[b, None])
    assert got[0].combined_x.tobytes() == b.tobytes()
    assert (got[1].combined_x[1] == 0).all()
    assert got[1].combined_x[0].tobytes() == xs[1][0].tobytes()


def test_hybrid_regions_group_by_scaleup_index():
    inp, e, su = _inputs("hybrid4x2", seed=41)
    outs = ref.dispatch(
        inp.x_args, inp.topk_idxs, None, num_experts=e, num_max_tokens_per_rank=M, num_scaleup_ranks=su
    )
    for o in outs:
        h = o.handle
        src_rank = h.recv_src_metadata[:, 0] // M
        bounds = np.concatenate([[0], h.psum_num_recv_tokens_per_scaleup_rank])
        for r, (lo, hi) in enumerate(itertools.pairwise(bounds)):
            assert (src_rank[lo:hi] % su == r).all()
            assert (np.diff(h.recv_src_metadata[lo:hi, 0]) > 0).all()


@settings(max_examples=30, deadline=None)
@given(
    n=st.sampled_from([1, 2, 3, 4]),
    epr=st.integers(1, 4),
    k=st.integers(1, 6),
    a=st.sampled_from([1, 2, 3]),
    masked=st.sampled_from([0.0, 0.5]),
    seed=st.integers(0, 2**16),
    expand=st.booleans(),
)
def test_reference_properties(n, epr, k, a, masked, seed, expand):
    e = n * epr
    k = min(k, e)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, M + 1, size=n).tolist()
    inp = routing.make_inputs(n, tokens, 16, e, k, seed=seed, masked_ratio=masked)
    outs = ref.dispatch(
        inp.x_args,
        inp.topk_idxs,
        inp.topk_weights,
        num_experts=e,
        num_max_tokens_per_rank=M,
        expert_alignment=a,
        do_expand=expand,
    )
    for d, o in enumerate(outs):
        h = o.handle
        counts = h.num_unaligned_recv_tokens_per_expert.astype(int)
        lids = [
            v - d * epr for s in range(n) for row in inp.topk_idxs[s] for v in row if v >= 0 and v // epr == d
        ]
        assert counts.tolist() == np.bincount(lids, minlength=epr).tolist()
        psum = h.psum_num_recv_tokens_per_expert.astype(int)
        prev = np.concatenate([[0], psum[:-1]])
        if expand:
            assert (psum - np.array([_align(p, a) for p in prev]) == counts).all()
            assert o.valid_expanded_rows.sum() == counts.sum()
        else:
            assert (psum - prev == [_align(c, a) for c in counts]).all()
        assert h.psum_num_recv_tokens_per_scaleup_rank[-1] == h.num_recv_tokens
        # expanded copies of a token are identical and sit inside their expert's block
        if expand:
            starts = np.concatenate([[0], np.cumsum([_align(c, a) for c in counts])[:-1]])
            for i in range(h.num_recv_tokens):
                rows = h.recv_src_metadata[i, 2:]
                for kk, row in enumerate(rows):
                    if row >= 0:
                        s, t = divmod(int(h.recv_src_metadata[i, 0]), M)
                        lid = inp.topk_idxs[s][t, kk] - d * epr
                        assert starts[lid] <= row < starts[lid] + counts[lid]
                        assert (o.recv_x[row] == o.recv_x[rows[rows >= 0][0]]).all()


@pytest.mark.parametrize(
    ("kwargs", "exc", "fragment"),
    [
        (dict(num_experts=7), ValueError, "num_experts"),
        (dict(num_max_tokens_per_rank=2), ValueError, "num_max_tokens_per_rank"),
        (dict(idx_dtype=np.float32), TypeError, "integer dtype"),
        (dict(bad_expert=8), ValueError, "out of range"),
        (dict(duplicate=True), ValueError, "twice"),
        (dict(do_zero_padding=True), ValueError, "do_zero_padding"),
        (dict(weights_dtype=np.float64), TypeError, "topk_weights"),
        (dict(expert_alignment=0), ValueError, "expert_alignment"),
    ],
)
def test_reference_rejects_bad_inputs(kwargs, exc, fragment):
    inp = routing.make_inputs(2, 4, 16, 8, 2, seed=1)
    kwargs = dict(kwargs)
    idx = [i.copy() for i in inp.topk_idxs]
    w = list(inp.topk_weights)
    if "idx_dtype" in kwargs:
        dt = kwargs.pop("idx_dtype")
        idx = [i.astype(dt) for i in idx]
    if "bad_expert" in kwargs:
        idx[1][0, 0] = kwargs.pop("bad_expert")
    if kwargs.pop("duplicate", False):
        idx[0][1, 1] = idx[0][1, 0]
    if "weights_dtype" in kwargs:
        dt = kwargs.pop("weights_dtype")
        w = [x.astype(dt) for x in w]
    args = dict(num_experts=8, num_max_tokens_per_rank=4) | kwargs
    with pytest.raises(exc, match=fragment):
        ref.dispatch(inp.xs, idx, w, **args)


def test_combine_rejects_list_bias_and_weights_without_reduction():
    inp = routing.make_inputs(2, 4, 16, 8, 2, seed=1)
    outs = ref.dispatch(
        inp.xs, inp.topk_idxs, inp.topk_weights, num_experts=8, num_max_tokens_per_rank=4, do_expand=True
    )
    xs = [o.recv_x for o in outs]
    hs = [o.handle for o in outs]
    with pytest.raises(TypeError, match="bias"):
        ref.combine(xs, hs, bias=[[inp.xs[0], inp.xs[0]], None])
    with pytest.raises(TypeError, match="exactly two"):
        ref.combine(xs, hs, bias=[(inp.xs[0],), None])
    with pytest.raises(ValueError, match="topk_weights"):
        ref.combine(xs, hs, topk_weights=[o.recv_topk_weights for o in outs], allow_multiple_reduction=False)
    with pytest.raises(ValueError, match="cached"):
        ref.dispatch(inp.xs, None, None, handles=hs, num_experts=16)


@pytest.mark.slow
def test_reference_speed_at_production_shape():
    import time

    inp = routing.make_inputs(8, 4096, 128, 256, 8, seed=2)
    t0 = time.perf_counter()
    outs = ref.dispatch(
        inp.xs,
        inp.topk_idxs,
        inp.topk_weights,
        num_experts=256,
        num_max_tokens_per_rank=4096,
        do_expand=True,
        expert_alignment=128,
    )
    ref.combine([o.recv_x for o in outs], [o.handle for o in outs])
    assert time.perf_counter() - t0 < 30
