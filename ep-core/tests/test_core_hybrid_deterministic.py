"""CPU: hybrid mode's `deterministic=True` row order (issue 42): every received row sorted by the source token's
global index `src_rank * M + src_token`, DeepEP's `EPHandle.deterministic_sort` order, in the reference and through
EPBuffer on the reference backend with emulated nodes; the combine follows the handle; the default order (rows
grouped by scale-up region) is unchanged.

Fresh random routings per case, with masked (-1) lanes, ranks without tokens, all-masked tokens, zero tokens
everywhere, one node (S_u = N, direct mode) and one rank per node (S_u = 1)."""

from __future__ import annotations

import dataclasses

import ep_core as ec
import numpy as np
import pytest
from ep_core import reference as ref
from ep_core import routing

M, H = 8, 32

# (num ranks, S_u, tokens per rank, experts, top-k, masked ratio)
TOPOLOGIES = {
    "2x2": (4, 2, [7, 8, 6, 8], 16, 4, 0.2),
    "4x2": (8, 2, [5, 8, 0, 8, 6, 8, 3, 8], 32, 5, 0.1),
    "2x4": (8, 4, [8, 1, 8, 7, 0, 8, 4, 8], 16, 3, 0.3),
    "4x1": (4, 1, [8, 3, 8, 6], 8, 2, 0.25),
    "one_node": (4, 4, [6, 8, 2, 8], 16, 4, 0.2),
    "zero_tokens": (4, 2, [0, 0, 0, 0], 16, 4, 0.0),
    "all_masked": (4, 2, [5, 8, 3, 8], 16, 4, 1.0),
}


def _inputs(name: str, seed: int):
    n, su, tokens, e, k, masked = TOPOLOGIES[name]
    inp = routing.make_inputs(n, tokens, H, e, k, seed=seed, masked_ratio=masked)
    return inp, n, su, e


def _dispatch(inp, e, su, *, expand=False, det=False, sync=True):
    return ref.dispatch(
        inp.x_args,
        inp.topk_idxs,
        inp.topk_weights,
        num_experts=e,
        num_max_tokens_per_rank=M,
        expert_alignment=2,
        do_expand=expand,
        do_cpu_sync=sync,
        num_scaleup_ranks=su,
        deterministic=det,
    )


def _same(name: str, a, b) -> None:
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, f"{name}: {a.shape} {a.dtype} != {b.shape} {b.dtype}"
    assert a.tobytes() == b.tobytes(), f"{name}: differs"


def _deepep_sorted(o: ref.DispatchOutput, sync: bool) -> ref.DispatchOutput:
    """A copy of a default-order output sorted as DeepEP's deterministic mode sorts it (`EPHandle.deterministic_sort`,
    ep-core's port of DeepEP's method)."""
    h = dataclasses.replace(o.handle, recv_src_metadata=np.array(o.handle.recv_src_metadata, copy=True))
    c = [
        None if a is None else np.array(a, copy=True)
        for a in (o.recv_x, o.recv_topk_idx, o.recv_topk_weights)
    ]
    h.deterministic_sort(sync, False, c[0], None, c[1], c[2])
    return ref.DispatchOutput(c[0], None, c[1], c[2], h)


@pytest.mark.parametrize("name", list(TOPOLOGIES))
@pytest.mark.parametrize("expand", [False, True])
@pytest.mark.parametrize("sync", [True, False])
def test_reference_rows_by_global_index(name, expand, sync):
    seed = int(np.random.default_rng().integers(1 << 30))  # fresh routing per run; printed on failure
    inp, n, su, e = _inputs(name, seed)
    det = _dispatch(inp, e, su, expand=expand, det=True, sync=sync)
    dflt = _dispatch(inp, e, su, expand=expand, sync=sync)
    direct = _dispatch(inp, e, n, expand=expand, det=True, sync=sync)
    for r in range(n):
        d, g = det[r], dflt[r]
        nv = d.num_valid_rows
        meta = np.asarray(d.handle.recv_src_metadata)
        assert (np.diff(meta[:nv, 0].astype(np.int64)) > 0).all(), f"seed {seed}: rank {r} rows not sorted"
        # the layout's counts are the default's: only the row order moves
        for f in ("psum_num_recv_tokens_per_scaleup_rank", "psum_num_recv_tokens_per_expert",
                  "num_unaligned_recv_tokens_per_expert", "dst_buffer_slot_idx"):  # fmt: skip
            _same(f"seed {seed} r{r} {f}", getattr(d.handle, f), getattr(g.handle, f))
        assert d.handle.num_recv_tokens_per_expert_list == g.handle.num_recv_tokens_per_expert_list
        # direct mode's deterministic rows are the same rows (hybrid keeps its S_u region prefix sums)
        _same(f"seed {seed} r{r} recv_x == direct", d.recv_x, direct[r].recv_x)
        _same(f"seed {seed} r{r} meta == direct", meta, direct[r].handle.recv_src_metadata)
        if not expand:
            # DeepEP's rule: the default order sorted by EPHandle.deterministic_sort
            s = _deepep_sorted(g, sync)
            for f in ("recv_x", "recv_topk_idx", "recv_topk_weights"):
                _same(f"seed {seed} r{r} {f} == deterministic_sort", getattr(d, f), getattr(s, f))
            _same(f"seed {seed} r{r} meta == deterministic_sort", meta, s.handle.recv_src_metadata)
        else:
            # expanded rows: by expert, then source id, in both orders (only the metadata rows move)
            _same(f"seed {seed} r{r} expanded recv_x", d.recv_x, g.recv_x)
            _same(f"seed {seed} r{r} expanded weights", d.recv_topk_weights, g.recv_topk_weights)
            order = np.argsort(np.asarray(g.handle.recv_src_metadata)[:nv, 0], kind="stable")
            _same(
                f"seed {seed} r{r} meta rows", meta[:nv], np.asarray(g.handle.recv_src_metadata)[:nv][order]
            )


def test_deterministic_order_differs_from_the_default_in_hybrid_mode():
    """On this routing the two hybrid orders differ (so the tests above can fail), and agree in direct mode."""
    inp, n, su, e = _inputs("2x2", seed=3)
    det, dflt = _dispatch(inp, e, su, det=True), _dispatch(inp, e, su)
    assert any(not np.array_equal(a.recv_x, b.recv_x) for a, b in zip(det, dflt))
    det1, dflt1 = _dispatch(inp, e, n, det=True), _dispatch(inp, e, n)
    assert all(np.array_equal(a.recv_x, b.recv_x) for a, b in zip(det1, dflt1))


@pytest.mark.parametrize("name", ["2x2", "4x2", "4x1", "zero_tokens", "all_masked"])
@pytest.mark.parametrize("expand", [False, True])
@pytest.mark.parametrize("amr", [True, False])
def test_combine_and_cached_dispatch_follow_the_handle(name, expand, amr):
    """The same expert outputs (per source token and lane) combine to the same bits from either order, and a cached
    dispatch of deterministic handles repeats their rows."""
    seed = int(np.random.default_rng().integers(1 << 30))
    inp, n, su, e = _inputs(name, seed)
    outs = {det: _dispatch(inp, e, su, expand=expand, det=det) for det in (False, True)}
    rng = np.random.default_rng(seed)
    values = {}  # (rank d, source id, lane or -1) -> bf16 row

    def row(d, src, lane):
        key = (d, int(src), lane)
        if key not in values:
            values[key] = routing.random_bf16((H,), rng)
        return values[key]

    got = {}
    for det, o in outs.items():
        xs = []
        for d, out in enumerate(o):
            x = np.zeros((out.recv_x.shape[0], H), np.uint16)
            meta = np.asarray(out.handle.recv_src_metadata)[: out.num_valid_rows]
            for i, m in enumerate(meta):
                if not expand:
                    x[i] = row(d, m[0], -1)
                for k, erow in enumerate(m[2:]):
                    if expand and erow >= 0:
                        x[erow] = row(d, m[0], k)
            xs.append(x)
        weights = None if (expand and not amr) else [w.recv_topk_weights for w in o]
        got[det] = ref.combine(
            xs,
            [w.handle for w in o],
            topk_weights=weights,
            allow_multiple_reduction=amr,
            num_scaleup_ranks=su,
        )
    for s in range(n):
        _same(f"seed {seed} combined_x[{s}]", got[True][s].combined_x, got[False][s].combined_x)
        if got[True][s].combined_topk_weights is not None:
            _same(
                f"seed {seed} weights[{s}]",
                got[True][s].combined_topk_weights,
                got[False][s].combined_topk_weights,
            )
    cached = ref.dispatch(inp.x_args, None, inp.topk_weights, handles=[o.handle for o in outs[True]])
    for a, b in zip(outs[True], cached):
        _same(f"seed {seed} cached recv_x", b.recv_x, a.recv_x)


def test_reference_rejects_a_non_bool_deterministic():
    inp, _, su, e = _inputs("2x2", seed=1)
    with pytest.raises(TypeError, match="deterministic: expected a bool"):
        _dispatch(inp, e, su, det="yes")


def _run(n, fn):
    return ec.ThreadGroup(n, timeout_secs=60).run(fn)


@pytest.mark.parametrize("name", ["2x2", "4x1", "one_node", "zero_tokens"])
@pytest.mark.parametrize("expand", [False, True])
@pytest.mark.parametrize("det", [True, False])
def test_epbuffer_on_emulated_nodes(name, expand, det):
    """EPBuffer over the reference backend with emulated nodes (`num_nvlink_ranks=S_u`): dispatch, cached dispatch
    and combine equal the reference of the same `deterministic`, bit for bit."""
    seed = int(np.random.default_rng().integers(1 << 30))
    inp, n, su, e = _inputs(name, seed)
    k = inp.topk_idxs[0].shape[1]

    def rank_fn(r, boot):
        buf = ec.EPBuffer(
            boot,
            transport=ec.ReferenceTransport(num_nvlink_ranks=su),
            num_max_tokens_per_rank=M,
            hidden=H,
            num_topk=k,
            deterministic=det,
            num_allocated_qps=65,
        )
        x = ec.host_array(inp.xs[r], "bfloat16")
        out = buf.dispatch(
            x,
            ec.host_array(inp.topk_idxs[r]),
            ec.host_array(inp.topk_weights[r]),
            num_experts=e,
            do_expand=expand,
            expert_alignment=2,
        )
        cached = buf.dispatch(x, handle=out.handle, do_expand=expand)
        shape = tuple(ec.describe(out.recv_x).shape)
        y = routing.random_bf16(shape, np.random.default_rng(seed + r))
        comb = buf.combine(ec.host_array(y, "bfloat16"), out.handle)
        res = (
            np.array(ec.to_numpy(out.recv_x)),
            np.array(ec.to_numpy(out.handle.recv_src_metadata)),
            np.array(ec.to_numpy(cached.recv_x)),
            y,
            np.array(ec.to_numpy(comb.combined_x)),
        )
        buf.destroy()
        return res

    results = _run(n, rank_fn)
    want = _dispatch(inp, e, su, expand=expand, det=det)
    want_c = ref.combine([res[3] for res in results], [w.handle for w in want], num_scaleup_ranks=su)
    for r, (recv_x, meta, cached_x, _, comb) in enumerate(results):
        _same(f"seed {seed} r{r} recv_x", recv_x, want[r].recv_x)
        _same(f"seed {seed} r{r} meta", meta, want[r].handle.recv_src_metadata)
        _same(f"seed {seed} r{r} cached recv_x", cached_x, want[r].recv_x)
        _same(f"seed {seed} r{r} combined_x", comb, want_c[r].combined_x)
        if det:
            nv = want[r].num_valid_rows
            assert (np.diff(meta[:nv, 0].astype(np.int64)) > 0).all()
