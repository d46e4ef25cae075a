"""GPU: the zero-copy dispatch (`dispatch(..., zero_copy=True)`) in the loopback domain.

The dispatch kernel stores every output in its final place in the destination's receive region and the results are
views of it (no copy epilogue). Each case poisons the regions first, then compares every output and the handle
bitwise with the reference dispatch (whose row order is the deterministic one) and with the ordinary deterministic
dispatch of the same domain, for 1, 2, 3 and 8 ranks, bf16 and FP8, CPU sync or not, top-k 1, 8 and 32, -1 lanes,
a rank without tokens and one that receives nothing; then the handle combines (ordinary and zero-copy) to the
reference's bits, and a second zero-copy dispatch and an ordinary one after it are exact (nothing left behind).
"""

from __future__ import annotations

import numpy as np
import pytest
from ep_core import reference, routing
from ep_core_gpu_testing import bits, num_gpus

pytestmark = pytest.mark.gpu

if num_gpus() == 0:
    pytest.skip("no CUDA GPU", allow_module_level=True)

from ep_core.kernels import _cuda  # noqa: E402
from ep_core.kernels.plan import plan_regions  # noqa: E402
from ep_core.loopback import LoopbackDomain  # noqa: E402

M, HIDDEN, E = 96, 512, 96  # E: a multiple of every rank count here
PACKS = HIDDEN // 128


def _eq(name: str, got, want) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    if got.dtype.kind == "f":
        got, want = bits(got), bits(want)
    if not np.array_equal(got, want):
        diff = np.asarray(got != want).reshape(got.shape[0], -1)
        bad = np.nonzero(diff.any(axis=1))[0]
        raise AssertionError(f"{name}: {len(bad)} rows differ, first {list(bad[:8])}")


def _poison(dom: LoopbackDomain, k: int, elem: int, packs: int) -> None:
    """Every rank's zero-copy arrays to 0xA5 bytes: a row the kernel does not write shows."""
    for r, rank in enumerate(dom.ranks):
        cfg = rank._config(HIDDEN, elem, packs, k)
        z = rank.zero_copy_rows(cfg)
        base = rank.res.base + plan_regions(cfg, E, M, rank.res.data_bytes, op="dispatch").recv_offset
        _cuda.check(_cuda.driver().cuMemsetD8Async(base, 0xA5, z.num_bytes, dom.streams[r].handle), "memset")


def _compare(tag: str, got, want, rows: int) -> None:
    """Outputs and handle of one rank: `rows` valid rows (all of them after a CPU sync)."""
    gh, wh = got.handle, want.handle
    _eq(
        f"{tag} psum_rank", gh.psum_num_recv_tokens_per_scaleup_rank, wh.psum_num_recv_tokens_per_scaleup_rank
    )
    _eq(f"{tag} psum_expert", gh.psum_num_recv_tokens_per_expert, wh.psum_num_recv_tokens_per_expert)
    _eq(f"{tag} unaligned", gh.num_unaligned_recv_tokens_per_expert, wh.num_unaligned_recv_tokens_per_expert)
    _eq(f"{tag} dst_slot", gh.dst_buffer_slot_idx, wh.dst_buffer_slot_idx)
    _eq(f"{tag} meta", np.asarray(gh.recv_src_metadata)[:rows], np.asarray(wh.recv_src_metadata)[:rows])
    _eq(f"{tag} recv_x", got.recv_x[:rows], want.recv_x[:rows])
    _eq(f"{tag} recv_topk_idx", got.recv_topk_idx[:rows], want.recv_topk_idx[:rows])
    if want.recv_topk_weights is None:
        assert got.recv_topk_weights is None, f"{tag}: weights without topk_weights"
    else:
        _eq(f"{tag} weights", got.recv_topk_weights[:rows], want.recv_topk_weights[:rows])
    if want.recv_sf is None:
        assert got.recv_sf is None, f"{tag}: scales for bf16"
    else:
        _eq(f"{tag} recv_sf", bits(got.recv_sf[:rows]), bits(want.recv_sf[:rows]))


# (ranks, fp8, CPU sync, top-k): every rank count and dtype at top-k 8, top-k 1 and 32 in bf16 at 1 and 8 ranks
CASES = [(n, fp8, sync, 8) for n in (1, 2, 3, 8) for fp8 in (False, True) for sync in (True, False)]
CASES += [(n, False, sync, k) for n in (1, 8) for sync in (True, False) for k in (1, 32)]


@pytest.mark.parametrize(
    "n,fp8,sync,k",
    CASES,
    ids=[f"{n}-{'fp8' if f else 'bf16'}-{'sync' if s else 'nosync'}-{k}" for n, f, s, k in CASES],
)
def test_zero_copy_dispatch_equals_the_reference(n: int, fp8: bool, sync: bool, k: int) -> None:
    dom = LoopbackDomain(
        n, num_max_tokens_per_rank=M, hidden=HIDDEN, num_topk=k, num_sms=4, gpu_timeout_secs=10.0
    )
    try:
        rng = np.random.default_rng(97 * n + 7 * fp8 + 3 * sync + k)
        counts = [M, *(int(c) for c in rng.integers(0, M + 1, size=n - 1))]
        if n > 2:
            counts[-1] = 0  # a rank without tokens
        inp = routing.make_inputs(
            n,
            counts,
            HIDDEN,
            E,
            k,
            seed=int(rng.integers(1 << 30)),
            masked_ratio=0.25,
            empty_dst_ranks=(1,) if n == 3 else (),
            fp8=fp8,
            num_sf_packs=PACKS if fp8 else None,
        )
        weights = None if n == 2 else inp.topk_weights  # one case without weights
        ref = reference.dispatch(
            inp.x_args, inp.topk_idxs, weights, num_experts=E, num_max_tokens_per_rank=M, do_cpu_sync=sync
        )
        ordinary = dom.dispatch(
            inp.x_args, inp.topk_idxs, weights, num_experts=E, deterministic=True, do_cpu_sync=sync
        )
        plain = [o.to_reference() for o in ordinary]
        for step in range(2):  # a second call on the rewritten regions
            _poison(dom, k, 1 if fp8 else 2, PACKS if fp8 else 0)
            outs = dom.dispatch(
                inp.x_args, inp.topk_idxs, weights, num_experts=E, do_cpu_sync=sync, zero_copy=True
            )
            got = [o.to_reference() for o in outs]
            for r in range(n):
                rows = ref[r].num_valid_rows
                assert got[r].recv_x.shape[0] == (rows if sync else n * M)
                _compare(f"step {step} r{r} vs reference", got[r], ref[r], rows)
                _compare(f"step {step} r{r} vs deterministic", got[r], plain[r], rows)
                if sync:
                    assert got[r].handle.num_recv_tokens_per_expert_list == list(
                        ref[r].handle.num_recv_tokens_per_expert_list
                    )
        # the handle combines: ordinary, then through the combine buffers (which share recv_x's rows)
        handles = [o.handle for o in outs]
        ref_handles = [o.handle for o in ref]
        xs = [routing.random_bf16((o.recv_x.shape[0], HIDDEN), rng) for o in outs]
        want = reference.combine(xs, ref_handles)
        comb = dom.combine(xs, handles)
        for r in range(n):
            _eq(f"r{r} combine", comb[r].to_reference().combined_x, want[r].combined_x)
        if sync:
            bufs = dom.combine_buffers(handles, HIDDEN)
            for r, (buf, x) in enumerate(zip(bufs, xs)):
                assert buf.ptr == outs[r].recv_x.ptr or x.shape[0] == 0  # the same rows as recv_x (bf16)
                _cuda.copy_to_device(buf.ptr, x, dom.streams[r])
            zc = dom.combine(bufs, handles, zero_copy=True)
            for r in range(n):
                _eq(f"r{r} zero-copy combine", zc[r].to_reference().combined_x, want[r].combined_x)
        again = dom.dispatch(
            inp.x_args, inp.topk_idxs, weights, num_experts=E, deterministic=True, do_cpu_sync=True
        )
        ref_sync = reference.dispatch(
            inp.x_args, inp.topk_idxs, weights, num_experts=E, num_max_tokens_per_rank=M, do_cpu_sync=True
        )
        for r in range(n):
            _compare(f"ordinary after r{r}", again[r].to_reference(), ref_sync[r], ref_sync[r].num_valid_rows)
        dom.synchronize()
    finally:
        dom.close()


def test_zero_copy_dispatch_refusals() -> None:
    """Expand, a cached handle and column-major scales are refused before any rank launches; the domain stays exact."""
    n = 2
    dom = LoopbackDomain(
        n, num_max_tokens_per_rank=M, hidden=HIDDEN, num_topk=8, num_sms=4, gpu_timeout_secs=10.0
    )
    try:
        inp = routing.make_inputs(n, [M, 40], HIDDEN, E, 8, seed=3)
        with pytest.raises(ValueError, match="zero_copy: the non-expanded layout only"):
            dom.dispatch(
                inp.x_args, inp.topk_idxs, inp.topk_weights, num_experts=E, do_expand=True, zero_copy=True
            )
        outs = dom.dispatch(inp.x_args, inp.topk_idxs, inp.topk_weights, num_experts=E)
        with pytest.raises(ValueError, match="zero_copy: not with a cached dispatch"):
            dom.dispatch(inp.x_args, None, inp.topk_weights, handles=[o.handle for o in outs], zero_copy=True)
        got = dom.dispatch(inp.x_args, inp.topk_idxs, inp.topk_weights, num_experts=E, zero_copy=True)
        ref = reference.dispatch(
            inp.x_args, inp.topk_idxs, inp.topk_weights, num_experts=E, num_max_tokens_per_rank=M
        )
        for r in range(n):
            _compare(f"r{r}", got[r].to_reference(), ref[r], ref[r].num_valid_rows)
    finally:
        dom.close()
