"""GPU: direct mode across nodes (`allow_hybrid_mode=False` with several emulated nodes) in the loopback domain and
across processes, against `ep_core.reference` WITHOUT hybrid semantics (direct mode's regions and reduction order).

`LoopbackDomain(N, num_scaleup_ranks=S_u, allow_hybrid_mode=False)` runs include/ep_core/direct_xnode.cuh: every
rank puts straight to every rank of another node through the emulated scale-out put (load/store + release signal,
GIN's put-then-signal ordering), the ranks of its own node by load/store, as DeepEP's direct mode across nodes.

- the hybrid test's matrix per topology (2x2, 2x4, 4x2, and 2x8 at <= 8 SMs): {expand, non-expand} x {A = 1, 128}
  x {bf16, FP8} x {sync, no sync, cached} x {deterministic or not}, 0/1/2 biases and multiple reduction on/off,
  bitwise equal to the direct reference (N psum regions, one per source rank);
- prefer_overlap_with_compute=False (each rank's copy epilogue on device SMs // N blocks, wider than the op's 1 or
  2 SMs; the combine stays one launch): the hybrid test's 5 cases per topology, bitwise equal to the reference;
- the direct-mode order is observable: on an input where the hybrid reference differs, the kernels equal the direct
  one;
- a node that never sends (its ranks skip the count signals to other nodes) gives EPTimeoutError naming a waiting
  rank of another node and the silent peer, nothing hangs, and reset() recovers;
- 4 processes sharing the GPU as 2 nodes x 2: `ProcessRank(allow_hybrid_mode=False)` with `EPKIT_SCALEUP_RANKS=2`,
  and `EPBuffer(num_nvlink_ranks=2, allow_hybrid_mode=False)` over ipc.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from ep_core import reference, routing
from ep_core.errors import EPTimeoutError
from ep_core_gpu_testing import bits, num_gpus

pytestmark = pytest.mark.gpu

if num_gpus() == 0:
    pytest.skip("no CUDA GPU", allow_module_level=True)

from ep_core.kernels._cuda import num_device_sms  # noqa: E402
from ep_core.kernels._source import compile_kernels  # noqa: E402
from ep_core.kernels.plan import KernelConfig  # noqa: E402
from ep_core.loopback import LoopbackDomain  # noqa: E402

# the hybrid test's matrix and comparison helpers (no test folder is on sys.path: load the module by its path)
_spec = importlib.util.spec_from_file_location(
    "_ep_core_gpu_hybrid_cases", Path(__file__).with_name("test_gpu_hybrid.py")
)
_hyb = sys.modules.get(_spec.name)
if _hyb is None:
    _hyb = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_hyb)
    sys.modules[_spec.name] = _hyb
CASES, E, HIDDEN, K, M, PACKS = _hyb.CASES, _hyb.E, _hyb.HIDDEN, _hyb.K, _hyb.M, _hyb.PACKS
_eq, _token_counts, compare_dispatch = _hyb._eq, _hyb._token_counts, _hyb.compare_dispatch
share_cases = _hyb.share_cases

# (num_ranks, ranks per node): 2x2, 2x4, 4x2, 2x8
TOPOLOGIES = ((4, 2), (8, 4), (8, 2), (16, 8))

_domains: dict[tuple[int, int, bool], LoopbackDomain] = {}


def _precompile() -> None:
    from concurrent.futures import ThreadPoolExecutor

    cfgs = [
        KernelConfig(n, K, HIDDEN, e, p, num_nvlink_ranks=su)
        for n, su in TOPOLOGIES
        for (e, p) in ((2, 0), (1, PACKS))
    ]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(compile_kernels, cfgs))


def _new_domain(n: int, su: int, gpu_timeout_secs: float = 10.0, overlap: bool = True) -> LoopbackDomain:
    """`overlap=False`: prefer_overlap_with_compute=False, each rank's copy epilogue on its share of the GPU."""
    return LoopbackDomain(
        n,
        num_max_tokens_per_rank=M,
        hidden=HIDDEN,
        num_topk=K,
        gpu_timeout_secs=gpu_timeout_secs,
        cpu_timeout_secs=30.0,
        num_scaleup_ranks=su,
        allow_hybrid_mode=False,
        prefer_overlap_with_compute=overlap,
    )


def domain(n: int, su: int, overlap: bool = True) -> LoopbackDomain:
    if not _domains:
        _precompile()
    if (n, su, overlap) not in _domains:
        _domains[n, su, overlap] = _new_domain(n, su, overlap=overlap)
    return _domains[n, su, overlap]


def _check_kernels(dom: LoopbackDomain, su: int) -> None:
    """Every instance the ranks launched is direct mode across nodes (not the direct or the hybrid kernels)."""
    for rank in dom.ranks:
        assert rank.num_scaleup_ranks == dom.num_ranks and rank.num_nvlink_ranks == su
        cfgs = list(rank._configs.values())
        assert cfgs and all(c.is_direct_xnode and c.num_nvlink_ranks == su for c in cfgs), cfgs


def _topo_id(t: tuple[int, int]) -> str:
    return f"{t[0] // t[1]}x{t[1]}"


@pytest.mark.parametrize("case", range(len(CASES)), ids=lambda c: "-".join(map(str, CASES[c])))
@pytest.mark.parametrize("topo", TOPOLOGIES, ids=_topo_id)
def test_direct_xnode_dispatch_combine(topo: tuple[int, int], case: int) -> None:
    _check_case(*topo, case, (0, 1, 3)[case % 3])


@pytest.mark.parametrize(("topo", "case", "num_sms"), share_cases(TOPOLOGIES))
def test_direct_xnode_no_overlap_epilogue_on_share(topo: tuple[int, int], case: int, num_sms: int) -> None:
    """prefer_overlap_with_compute=False: the cross-node copy epilogue on device SMs // N blocks, more than the
    op's num_sms (the combine keeps one launch); the same bits as the direct reference."""
    n, su = topo
    if num_device_sms() // n <= num_sms:
        pytest.skip("device too small: the epilogue's share is not wider than the op's grid")
    assert all(r.epilogue_sms == num_device_sms() // n for r in domain(n, su, overlap=False).ranks)
    _check_case(n, su, case, num_sms, overlap=False)


def _check_case(n: int, su: int, case: int, num_sms: int, overlap: bool = True) -> None:
    if n * max(num_sms, 1) > num_device_sms():
        pytest.skip("device too small")
    dom = domain(n, su, overlap)
    try:
        _run_case(dom, n, su, case, num_sms)
    except BaseException:
        # a failed kernel leaves the domain refusing every call until reset: later cases must not inherit it
        try:
            dom.reset()
        except Exception:
            _domains.pop((n, su, overlap), None)
        raise


def _run_case(dom: LoopbackDomain, n: int, su: int, case: int, num_sms: int) -> None:
    expand, align, fp8, mode, det = CASES[case]
    rng = np.random.default_rng(9000 * n + 100 * su + case)
    kind = ("uniform", "unbalanced", "uniform", "uniform")[case % 4]
    empty = (n - 1,) if (kind == "uniform" and case % 4 == 2) else ()
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
    common = dict(
        num_experts=E,
        expert_alignment=align,
        do_expand=expand,
        use_tma_aligned_col_major_sf=col_major,
        do_zero_padding=zero_pad,
    )
    # the direct reference: one logical domain of N ranks, whatever the nodes
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
        assert np.asarray(k_first[r].handle.psum_num_recv_tokens_per_scaleup_rank).shape == (n,)
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
        _eq(f"r{r} combined_x (amr={amr}, biases={nb})", kc.combined_x, ref_comb[r].combined_x)
        if weights is not None:
            _eq(f"r{r} combined_w", bits(kc.combined_topk_weights), bits(ref_comb[r].combined_topk_weights))
            if mode != "cached":
                want = np.where(inp.topk_idxs[r] >= 0, inp.topk_weights[r], np.float32(0))
                _eq(f"r{r} weights round trip", bits(kc.combined_topk_weights), bits(want))
    dom.synchronize()
    _check_kernels(dom, su)


def test_direct_xnode_reduces_in_direct_order() -> None:
    """With multiple reduction the hybrid order (a bf16 rounding per node group) differs from direct mode's on this
    input: the kernels across nodes follow the direct reference, so the check can fail."""
    n, su = 4, 2
    dom = domain(n, su)
    rng = np.random.default_rng(5)
    inp = routing.make_inputs(n, [M] * n, HIDDEN, E, K, seed=11, kind="uniform")
    outs = dom.dispatch(inp.x_args, inp.topk_idxs, inp.topk_weights, num_experts=E, deterministic=True)
    xs = [routing.random_bf16((o.recv_x.shape[0], HIDDEN), rng) for o in outs]
    comb = dom.combine(xs, [o.handle for o in outs], allow_multiple_reduction=True)
    k_handles = [o.to_reference().handle for o in outs]
    direct = reference.combine(xs, k_handles, allow_multiple_reduction=True)
    # the same rows reduced in the hybrid order (level 2 per node; the reference reads only metadata and psums)
    hyb = reference.combine(xs, k_handles, allow_multiple_reduction=True, num_scaleup_ranks=su)
    differs = False
    for r in range(n):
        got = comb[r].to_reference().combined_x
        _eq(f"r{r} combined_x (direct reference)", got, direct[r].combined_x)
        differs |= not np.array_equal(got, hyb[r].combined_x)
    assert differs, "the hybrid and direct references agree on this input: the order check is vacuous"


def test_node_that_never_sends_times_out() -> None:
    """Node 0's ranks skip their count signals to the other nodes: those ranks wait for node 0's counts until their
    GPU timeout, the error names a waiting rank of another node and a silent peer of node 0, nothing hangs, and
    reset() recovers."""
    n, su = 4, 2
    dom = _new_domain(n, su, gpu_timeout_secs=0.5)
    try:
        inp = routing.make_inputs(n, [M] * n, HIDDEN, E, K, seed=3, kind="uniform")
        for r in range(su):
            dom.ranks[r].debug_skip_scaleout_signal = True
        with pytest.raises(EPTimeoutError):
            dom.dispatch(inp.x_args, inp.topk_idxs, inp.topk_weights, num_experts=E, do_cpu_sync=True)
        dom._drain()
        errors = []
        for rank in dom.ranks:
            with pytest.raises(EPTimeoutError) as ei:
                rank.check_errors(synchronize=True)
            errors.append(ei.value)
        own = [e for e in errors if e.tag == "dispatch.counts"]
        assert own, f"no rank recorded the count wait: {[(e.rank, e.tag) for e in errors]}"
        for e in own:
            assert su <= e.rank < n, f"rank {e.rank} of the silent node timed out on counts: {e}"
            peer = re.search(r"peer (-?\d+)", str(e))
            assert peer is not None and 0 <= int(peer.group(1)) < su, f"the silent peer is not named: {e}"
            assert isinstance(e.counter, int) and e.counter >= 0, e.counter
        for r in range(su):
            dom.ranks[r].debug_skip_scaleout_signal = False
        dom.reset()
        outs = dom.dispatch(inp.x_args, inp.topk_idxs, inp.topk_weights, num_experts=E, deterministic=True)
        ref = reference.dispatch(
            inp.x_args, inp.topk_idxs, inp.topk_weights, num_experts=E, num_max_tokens_per_rank=M
        )
        for r in range(n):
            compare_dispatch(outs[r].to_reference(), ref[r], det=True, zero_pad=False, sync=True, rank=r)
    finally:
        dom.close()


PROCESS_WORKER = """
import json, pickle, sys
import numpy as np
import ep_symmem
from ep_core import reference, routing
from ep_core.kernels._cuda import DeviceArray
from ep_core.loopback import ProcessRank

rank, size, directory = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
M, H, K, E, SU = 64, 512, 8, 32, 2
boot = ep_symmem.FileBootstrap(directory, rank, size, timeout=120.0)
pr = ProcessRank(boot, num_max_tokens_per_rank=M, hidden=H, num_topk=K, gpu_timeout_secs=30.0, memory="cuda_ipc",
                 allow_hybrid_mode=False)
# EPKIT_SCALEUP_RANKS=2: nodes of 2, one logical domain of every rank
assert (pr.num_scaleup_ranks, pr.num_nvlink_ranks) == (size, SU), (pr.num_scaleup_ranks, pr.num_nvlink_ranks)
checks = 0
for it, (det, expand, amr) in enumerate([(True, False, True), (False, False, False), (True, True, True)]):
    inp = routing.make_inputs(size, [M, M // 2, 0, 17][:size], H, E, K, seed=7 + it, masked_ratio=0.2)
    kw = dict(num_experts=E, do_expand=expand, expert_alignment=4 if expand else 1)
    ref = reference.dispatch(inp.xs, inp.topk_idxs, inp.topk_weights, num_max_tokens_per_rank=M, **kw)
    up = lambda a: DeviceArray.from_numpy(a, pr.stream)
    out = pr.dispatch(up(inp.xs[rank]), up(inp.topk_idxs[rank]), up(inp.topk_weights[rank]), deterministic=det,
                      num_sms=4, **kw)
    k = out.to_reference()
    if not det:
        k = reference.canonical_order(k)
    r = ref[rank]
    nv = r.num_valid_rows
    assert np.array_equal(k.handle.psum_num_recv_tokens_per_scaleup_rank,
                          r.handle.psum_num_recv_tokens_per_scaleup_rank), "psum (N regions)"
    if expand:
        v = r.valid_expanded_rows
        assert np.array_equal(k.recv_x[v], r.recv_x[v]), "recv_x"
    else:
        assert np.array_equal(k.recv_x[:nv], r.recv_x[:nv]), "recv_x"
        assert np.array_equal(k.recv_topk_idx[:nv], r.recv_topk_idx[:nv]), "recv_topk_idx"
    comb = pr.combine(out.recv_x, out.handle, num_sms=4, allow_multiple_reduction=amr)
    mine = pickle.dumps((out.recv_x.numpy(), out.to_reference().handle))
    everyone = [pickle.loads(b) for b in boot.allgather(mine)]
    ref_c = reference.combine([e[0] for e in everyone], [e[1] for e in everyone], allow_multiple_reduction=amr)
    assert np.array_equal(comb.combined_x.numpy(), ref_c[rank].combined_x), "combined_x"
    checks += 1
assert all(c.is_direct_xnode for c in pr._configs.values()), list(pr._configs.values())
pr.check_errors()
pr.close()
print(json.dumps({"rank": rank, "checks": checks}))
"""


def test_processes_share_gpu_as_two_nodes_direct(tmp_path, monkeypatch) -> None:
    """4 processes on the GPU, EPKIT_SCALEUP_RANKS=2 and allow_hybrid_mode=False: direct mode across 2 emulated
    nodes x 2 through ProcessRank (CUDA IPC), against the direct reference."""
    pytest.importorskip("ep_symmem")
    from ep_core_gpu_testing import run_workers

    monkeypatch.setenv("EPKIT_SCALEUP_RANKS", "2")
    results = run_workers(PROCESS_WORKER, 4, tmp_path)
    assert sorted(r["rank"] for r in results) == [0, 1, 2, 3]
    assert all(r["checks"] == 3 for r in results)


EPBUFFER_WORKER = """
import json, pickle, sys
import numpy as np
import ep_symmem
from ep_core import EPBuffer, reference, routing
from ep_core.device_array import DeviceArray as CoreArray
from ep_core.kernels import _cuda
from ep_core.transports.ipc import IpcTransport

rank, size, directory = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
M, H, K, E, SU = 64, 512, 8, 32, 2
boot = ep_symmem.FileBootstrap(directory, rank, size, timeout=120.0)
buf = EPBuffer(boot, transport=IpcTransport("cuda_ipc"), num_max_tokens_per_rank=M, hidden=H, num_topk=K,
               num_experts=E, num_nvlink_ranks=SU, allow_hybrid_mode=False, deterministic=True,
               num_gpu_timeout_secs=30, num_cpu_timeout_secs=60)
assert buf.topology.logical_domain_size == (1, size), buf.topology.logical_domain_size
assert buf.topology.physical_domain_size == (size // SU, SU), buf.topology.physical_domain_size


def up(a, dtype):
    mem = _cuda.DeviceArray.from_numpy(a, 0)
    return CoreArray(mem.ptr, a.shape, dtype, owner=mem)


def down(a):
    from ep_core.device_array import describe
    info = describe(a)
    if info.device != "cuda":
        return np.asarray(a)
    assert info.is_contiguous, info
    dt = {"bfloat16": np.uint16, "float8_e4m3fn": np.uint8}.get(info.dtype, info.dtype)
    host = np.empty(tuple(info.shape), dtype=dt)
    _cuda.copy_to_host(host, int(info.ptr), 0)
    _cuda.driver().cuCtxSynchronize()
    return host


inp = routing.make_inputs(size, [M, 40, 0, 17][:size], H, E, K, seed=21, masked_ratio=0.2)
ref = reference.dispatch(inp.xs, inp.topk_idxs, inp.topk_weights, num_experts=E, num_max_tokens_per_rank=M)
res = buf.dispatch(up(inp.xs[rank], "bfloat16"), up(inp.topk_idxs[rank], "int64"),
                   up(inp.topk_weights[rank], "float32"), num_experts=E, num_sms=4)
_cuda.driver().cuCtxSynchronize()
recv_x = down(res.recv_x)
h = res.handle
meta = down(h.recv_src_metadata)
psum = down(h.psum_num_recv_tokens_per_scaleup_rank)
r = ref[rank]
nv = r.num_valid_rows
assert psum.shape == (size,), psum.shape
assert np.array_equal(psum, r.handle.psum_num_recv_tokens_per_scaleup_rank), f"psum {psum}"
assert np.array_equal(meta[:nv], np.asarray(r.handle.recv_src_metadata)[:nv]), "recv_src_metadata"
assert np.array_equal(recv_x[:nv], r.recv_x[:nv]), "recv_x"
comb = buf.combine(res.recv_x, h, res.recv_topk_weights, num_sms=4)
_cuda.driver().cuCtxSynchronize()
w = down(comb.combined_topk_weights)
want = np.where(inp.topk_idxs[rank] >= 0, inp.topk_weights[rank], 0).astype(np.float32)
assert np.array_equal(w.view(np.uint32), want.view(np.uint32)), "weights round trip"
everyone = [pickle.loads(b) for b in boot.allgather(pickle.dumps(recv_x))]
ref_c = reference.combine(everyone, [x.handle for x in ref])
assert np.array_equal(down(comb.combined_x), ref_c[rank].combined_x), "combined_x"
cfgs = list(buf.executor.rank._configs.values())  # GpuExecutor -> RankDriver: the instances it launched
assert cfgs and all(c.is_direct_xnode and c.num_nvlink_ranks == SU for c in cfgs), cfgs
buf.destroy()
print(json.dumps({"rank": rank, "ok": True}))
"""


def test_epbuffer_processes_as_two_nodes_direct(tmp_path) -> None:
    """EPBuffer over ipc with num_nvlink_ranks=2 and allow_hybrid_mode=False (4 processes sharing the GPU): the
    executor runs direct mode across nodes; deterministic dispatch and combine equal the direct reference."""
    pytest.importorskip("ep_symmem")
    from ep_core_gpu_testing import run_workers

    for result in run_workers(EPBUFFER_WORKER, 4, tmp_path):
        assert result["ok"]
