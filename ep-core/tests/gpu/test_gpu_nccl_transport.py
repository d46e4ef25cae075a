"""GPU: the direct-mode kernels over the nccl transport (an NCCL window, LSA pointers through ep-nccl-gin).

- World size 1 on one GPU (NCCL refuses two ranks on one GPU): `NcclRank` dispatch + combine, bf16 and FP8,
  expand and non-expand, sync / no-sync / cached, deterministic or not, bitwise against `ep_core.reference`;
  `EPBuffer(LocalBootstrap(), transport="nccl")` end to end; a borrowed communicator (`comm_ptr`); clean destroy.
- With >= 2 GPUs: one process per GPU (N = number of GPUs), file bootstrap, `NcclRank` and `EPBuffer` against
  the reference (skipped on a one-GPU machine).
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
from ep_core import reference, routing
from ep_core_gpu_testing import bits, num_gpus, run_workers

pytestmark = pytest.mark.gpu

NUM_GPUS = num_gpus()
if NUM_GPUS == 0:
    pytest.skip("no CUDA GPU", allow_module_level=True)
ep_nccl_gin = pytest.importorskip("ep_nccl_gin")
try:
    ep_nccl_gin.load()
except ep_nccl_gin.NcclGinError as _exc:
    pytest.skip(f"no NCCL library: {_exc}", allow_module_level=True)

from ep_core import EPBuffer, LocalBootstrap  # noqa: E402
from ep_core.device_array import DeviceArray as CoreArray  # noqa: E402
from ep_core.kernels import _cuda  # noqa: E402
from ep_core.kernels._cuda import DeviceArray  # noqa: E402
from ep_core.transports.nccl import NcclRank, NcclStorage, NcclTransport  # noqa: E402

M = 96
HIDDEN = 512
K = 8
E = 64
PACKS = HIDDEN // 128

# (expand, fp8, deterministic, mode, alignment)
CASES = [
    (False, False, True, "sync", 1),
    (False, False, False, "nosync", 1),
    (False, True, True, "cached", 1),
    (False, True, False, "sync", 1),
    (True, False, True, "sync", 128),
    (True, False, False, "cached", 4),
    (True, True, True, "nosync", 128),
    (True, True, False, "sync", 1),
]


@pytest.fixture(scope="module")
def rank1() -> NcclRank:
    r = NcclRank(
        LocalBootstrap(),
        num_max_tokens_per_rank=M,
        hidden=HIDDEN,
        num_topk=K,
        gpu_timeout_secs=10.0,
        cpu_timeout_secs=30.0,
    )
    yield r
    r.close()


def _up(a, stream):
    if a is None:
        return None
    if isinstance(a, tuple):
        return tuple(_up(v, stream) for v in a)
    return DeviceArray.from_numpy(np.ascontiguousarray(a), stream)


def _eq(name: str, got, want) -> None:
    got, want = bits(got), bits(want)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    if not np.array_equal(got, want):
        diff = np.asarray(got != want).reshape(got.shape[0], -1).any(axis=1)
        raise AssertionError(f"{name}: {int(diff.sum())} rows differ, first {list(np.nonzero(diff)[0][:8])}")


def _compare_dispatch(k, r, *, det: bool, sync: bool) -> None:
    kh, rh = k.handle, r.handle
    _eq("psum_rank", kh.psum_num_recv_tokens_per_scaleup_rank, rh.psum_num_recv_tokens_per_scaleup_rank)
    _eq("unaligned", kh.num_unaligned_recv_tokens_per_expert, rh.num_unaligned_recv_tokens_per_expert)
    _eq("psum_expert", kh.psum_num_recv_tokens_per_expert, rh.psum_num_recv_tokens_per_expert)
    if sync:
        assert k.recv_x.shape == r.recv_x.shape
        assert kh.num_recv_tokens_per_expert_list == list(rh.num_recv_tokens_per_expert_list)
    if det:
        _eq("dst_slot", kh.dst_buffer_slot_idx, rh.dst_buffer_slot_idx)
    else:
        k, r = reference.canonical_order(k), reference.canonical_order(r)
        kh, rh = k.handle, r.handle
    nv = r.num_valid_rows
    _eq("meta", np.asarray(kh.recv_src_metadata)[:nv], np.asarray(rh.recv_src_metadata)[:nv])
    if not kh.do_expand:
        _eq("recv_x", k.recv_x[:nv], r.recv_x[:nv])
        _eq("recv_topk_idx", k.recv_topk_idx[:nv], r.recv_topk_idx[:nv])
        _eq("recv_topk_weights", k.recv_topk_weights[:nv], r.recv_topk_weights[:nv])
        if r.recv_sf is not None:
            _eq("recv_sf", k.recv_sf[:nv], r.recv_sf[:nv])
        return
    valid, k_valid = r.valid_expanded_rows, k.valid_expanded_rows
    n = min(len(valid), len(k_valid))
    assert np.array_equal(valid[:n], k_valid[:n]) and not valid[n:].any() and not k_valid[n:].any()
    v = valid[:n]
    _eq("recv_x", k.recv_x[:n][v], r.recv_x[:n][v])
    _eq("recv_topk_weights", k.recv_topk_weights[:n][v], r.recv_topk_weights[:n][v])
    if r.recv_sf is not None:
        _eq("recv_sf", k.recv_sf[:n][v], r.recv_sf[:n][v])


def test_nccl_rank_is_wired_to_the_window(rank1: NcclRank) -> None:
    st = rank1.storage
    assert isinstance(st, NcclStorage)
    assert st.nccl_window != 0 and rank1.res.nccl_window == st.nccl_window
    assert rank1.res.base == st.ptr == st.window.ptr and rank1.res.peer_table == 0
    assert (st.lsa_size, st.lsa_rank) == (1, 0)
    assert rank1._config(HIDDEN, 2, 0, K).transport == "nccl"
    assert len(st.context_bytes()) == (len(st.dev_comm_bytes()) + 7) // 8 * 8 + 24
    # this rank's LSA pointer aliases the registered memory
    assert st.window.lsa_ptr(0) != 0


@pytest.mark.parametrize("case", range(len(CASES)), ids=lambda c: "-".join(map(str, CASES[c])))
def test_ep1_dispatch_combine(rank1: NcclRank, case: int) -> None:
    expand, fp8, det, mode, align = CASES[case]
    rng = np.random.default_rng(500 + case)
    inp = routing.make_inputs(
        1,
        [M if case % 2 else 57],
        HIDDEN,
        E,
        K,
        seed=int(rng.integers(1 << 30)),
        masked_ratio=0.25 if case % 3 else 0.0,
        fp8=fp8,
        sf_dtype=np.int32 if case % 4 == 3 else np.float32,
    )
    col_major = fp8 and case % 2 == 0
    zero_pad = expand and case % 3 != 0
    sync = mode != "nosync"
    common = dict(
        num_experts=E,
        expert_alignment=align,
        do_expand=expand,
        use_tma_aligned_col_major_sf=col_major,
        do_zero_padding=zero_pad,
    )
    ref = reference.dispatch(
        inp.x_args, inp.topk_idxs, inp.topk_weights, num_max_tokens_per_rank=M, do_cpu_sync=sync, **common
    )[0]
    s = rank1.stream
    x = _up(inp.x_args[0], s)
    out = rank1.dispatch(
        x,
        _up(inp.topk_idxs[0], s),
        _up(inp.topk_weights[0], s),
        deterministic=det,
        do_cpu_sync=sync,
        num_sms=(0, 2, 5)[case % 3],
        **common,
    )
    first = out.to_reference()
    _compare_dispatch(first, ref, det=det, sync=sync)
    if mode == "cached":
        new_w = rng.uniform(0.01, 1.0, size=inp.topk_weights[0].shape).astype(np.float32)
        again = rank1.dispatch(
            x,
            None,
            _up(new_w, s),
            handle=out.handle,
            do_zero_padding=zero_pad,
            use_tma_aligned_col_major_sf=col_major,
        )
        assert again.handle is out.handle
        ref_c = reference.dispatch(
            inp.x_args,
            None,
            [new_w],
            handles=[ref.handle],
            do_zero_padding=zero_pad,
            use_tma_aligned_col_major_sf=col_major,
        )[0]
        _compare_dispatch(again.to_reference(), ref_c, det=det, sync=True)
        out = again

    amr = case % 2 == 0
    rows = out.recv_x.shape[0]
    xs = routing.random_bf16((rows, HIDDEN), rng)
    weights = None if (expand and not amr) else out.recv_topk_weights
    bias = None
    if case % 3 == 1:
        bias = routing.random_bf16((len(inp.topk_idxs[0]), HIDDEN), rng)
    elif case % 3 == 2:
        bias = (
            routing.random_bf16((len(inp.topk_idxs[0]), HIDDEN), rng),
            routing.random_bf16((len(inp.topk_idxs[0]), HIDDEN), rng),
        )
    comb = rank1.combine(
        _up(xs, s), out.handle, topk_weights=weights, bias=_up(bias, s), allow_multiple_reduction=amr
    )
    got = comb.to_reference()
    ref_comb = reference.combine(
        [xs],
        [out.to_reference().handle],
        topk_weights=None if weights is None else [weights.numpy()],
        bias=None if bias is None else [bias],
        allow_multiple_reduction=amr,
    )[0]
    _eq("combined_x", got.combined_x, ref_comb.combined_x)
    if weights is not None:
        _eq("combined_topk_weights", got.combined_topk_weights, ref_comb.combined_topk_weights)
    rank1.check_errors()


def _core(a: np.ndarray, dtype: str) -> CoreArray:
    mem = DeviceArray.from_numpy(np.ascontiguousarray(a), 0)
    return CoreArray(mem.ptr, a.shape, dtype, owner=mem)


def _host(a) -> np.ndarray:
    owner = getattr(a, "owner", None)
    return owner.numpy() if isinstance(owner, DeviceArray) else np.asarray(a)


def _epbuffer_round(buf: EPBuffer, fp8: bool, seed: int) -> None:
    inp = routing.make_inputs(1, [M - 5], HIDDEN, E, K, seed=seed, masked_ratio=0.2, fp8=fp8)
    ref = reference.dispatch(
        inp.x_args, inp.topk_idxs, inp.topk_weights, num_experts=E, num_max_tokens_per_rank=M
    )[0]
    x = (
        (_core(inp.xs[0], "float8_e4m3fn"), _core(inp.sfs[0], "float32"))
        if fp8
        else _core(inp.xs[0], "bfloat16")
    )
    res = buf.dispatch(
        x, _core(inp.topk_idxs[0], "int64"), _core(inp.topk_weights[0], "float32"), num_experts=E, num_sms=4
    )
    _cuda.check(_cuda.driver().cuCtxSynchronize(), "cuCtxSynchronize")
    nv = ref.num_valid_rows
    meta = _host(res.handle.recv_src_metadata)
    order = np.argsort(meta[:nv, 0], kind="stable")
    ref_order = np.argsort(np.asarray(ref.handle.recv_src_metadata)[:nv, 0], kind="stable")
    _eq("epbuffer recv_x", _host(res.recv_x)[:nv][order], ref.recv_x[:nv][ref_order])
    _eq("epbuffer recv_topk_idx", _host(res.recv_topk_idx)[:nv][order], ref.recv_topk_idx[:nv][ref_order])
    if fp8:
        _eq("epbuffer recv_sf", _host(res.recv_sf)[:nv][order], ref.recv_sf[:nv][ref_order])
        return
    comb = buf.combine(res.recv_x, res.handle, res.recv_topk_weights, num_sms=4)
    _cuda.check(_cuda.driver().cuCtxSynchronize(), "cuCtxSynchronize")
    # identity experts: each token comes back as bf16(sum over its valid lanes' weights * x)
    ref_c = reference.combine(
        [_host(res.recv_x)], [_kernel_handle(res.handle)], topk_weights=[_host(res.recv_topk_weights)]
    )[0]
    _eq("epbuffer combined_x", _host(comb.combined_x), ref_c.combined_x)
    want = np.where(inp.topk_idxs[0] >= 0, inp.topk_weights[0], np.float32(0)).astype(np.float32)
    _eq("epbuffer weights round trip", _host(comb.combined_topk_weights), want)


def _kernel_handle(h):
    """The EPBuffer handle with numpy arrays (what ep_core.reference.combine reads)."""
    import dataclasses

    fields = {}
    for name in (
        "topk_idx",
        "psum_num_recv_tokens_per_scaleup_rank",
        "psum_num_recv_tokens_per_expert",
        "num_unaligned_recv_tokens_per_expert",
        "recv_src_metadata",
        "dst_buffer_slot_idx",
    ):
        fields[name] = _host(getattr(h, name))
    return dataclasses.replace(
        h,
        **fields,
        token_metadata_at_forward=None,
        channel_linked_list=None,
        cached_recv_src_metadata_before_sort=None,
    )


def test_epbuffer_transport_nccl() -> None:
    buf = EPBuffer(
        LocalBootstrap(),
        transport="nccl",
        num_max_tokens_per_rank=M,
        hidden=HIDDEN,
        num_topk=K,
        num_experts=E,
        num_gpu_timeout_secs=10,
        num_cpu_timeout_secs=30,
    )
    storage = buf.storage
    assert isinstance(buf.transport, NcclTransport) and isinstance(storage, NcclStorage)
    assert buf.executor.rank.res.nccl_window == storage.nccl_window
    assert buf.get_physical_domain_size() == (1, 1)
    comm = buf.transport.communicator
    assert comm is not None and comm.owned
    _epbuffer_round(buf, False, 11)
    _epbuffer_round(buf, True, 12)
    buf.destroy()
    assert storage.closed and storage.window is None
    assert buf.transport.communicator is None  # owned communicator destroyed with its last buffer


def test_borrowed_communicator_survives_destroy() -> None:
    comm = ep_nccl_gin.Communicator(ep_nccl_gin.get_unique_id(), 1, 0, device=0)
    try:
        tr = NcclTransport(comm_ptr=comm.ptr, lsa_barrier_count=4)
        with EPBuffer(
            LocalBootstrap(),
            transport=tr,
            num_max_tokens_per_rank=M,
            hidden=HIDDEN,
            num_topk=K,
            num_experts=E,
        ) as buf:
            assert not tr.communicator.owned and tr.communicator.ptr == comm.ptr
            _epbuffer_round(buf, False, 13)
        assert comm.async_error() == 0 and comm.nranks == 1  # still usable
    finally:
        comm.destroy()


MULTI_WORKER = textwrap.dedent(
    """
    import json, pickle, sys
    import numpy as np
    from cuda.bindings import driver as drv
    rank, size, directory = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    drv.cuInit(0)
    _, dev = drv.cuDeviceGet(rank)
    _, ctx = drv.cuDevicePrimaryCtxRetain(dev)
    drv.cuCtxSetCurrent(ctx)
    import ep_symmem
    from ep_core import reference, routing
    from ep_core.kernels._cuda import DeviceArray
    from ep_core.transports.nccl import NcclRank

    M, H, K, E = 64, 512, 8, 16 * size
    boot = ep_symmem.FileBootstrap(directory, rank, size, timeout=120.0)
    pr = NcclRank(boot, num_max_tokens_per_rank=M, hidden=H, num_topk=K, gpu_timeout_secs=30.0)
    assert pr.storage.lsa_size == size
    checks = 0
    for it, (det, expand, fp8) in enumerate([(True, False, False), (False, False, True), (True, True, False)]):
        counts = [[M, M // 2, 0, 17, 33, 5, M, 1][r % 8] for r in range(size)]
        inp = routing.make_inputs(size, counts, H, E, K, seed=7 + it, masked_ratio=0.2, fp8=fp8)
        a = 4 if expand else 1
        ref = reference.dispatch(inp.x_args, inp.topk_idxs, inp.topk_weights, num_experts=E,
                                 num_max_tokens_per_rank=M, do_expand=expand, expert_alignment=a)
        s = pr.stream
        up = lambda v: DeviceArray.from_numpy(np.ascontiguousarray(v), s)
        x = (up(inp.xs[rank]), up(inp.sfs[rank])) if fp8 else up(inp.xs[rank])
        out = pr.dispatch(x, up(inp.topk_idxs[rank]), up(inp.topk_weights[rank]), num_experts=E,
                          deterministic=det, do_expand=expand, expert_alignment=a, num_sms=4)
        k = out.to_reference()
        r = ref[rank]
        if not det:
            k, r = reference.canonical_order(k), reference.canonical_order(r)
        nv = r.num_valid_rows
        if expand:
            v = r.valid_expanded_rows
            assert np.array_equal(k.recv_x[v], r.recv_x[v]), "recv_x"
        else:
            assert np.array_equal(k.recv_x[:nv], r.recv_x[:nv]), "recv_x"
            assert np.array_equal(k.recv_topk_idx[:nv], r.recv_topk_idx[:nv]), "recv_topk_idx"
            if fp8:
                assert np.array_equal(k.recv_sf[:nv].view(np.uint32), r.recv_sf[:nv].view(np.uint32)), "recv_sf"
        if not fp8:
            xs = routing.random_bf16((out.recv_x.shape[0], H), np.random.default_rng(100 * it + rank))
            comb = pr.combine(up(xs), out.handle, num_sms=4)
            everyone = [pickle.loads(b) for b in boot.allgather(pickle.dumps((xs, out.to_reference().handle)))]
            ref_c = reference.combine([e[0] for e in everyone], [e[1] for e in everyone])
            assert np.array_equal(comb.combined_x.numpy(), ref_c[rank].combined_x), "combined_x"
        checks += 1
    pr.check_errors()
    pr.close()
    print(json.dumps({"rank": rank, "checks": checks}))
    """
)


@pytest.mark.skipif(NUM_GPUS < 2, reason="needs >= 2 GPUs (NCCL refuses two ranks on one GPU)")
def test_one_process_per_gpu(tmp_path) -> None:
    pytest.importorskip("ep_symmem")
    size = NUM_GPUS
    results = run_workers(MULTI_WORKER, size, tmp_path)
    assert sorted(r["rank"] for r in results) == list(range(size))
    assert all(r["checks"] == 3 for r in results)


SPIN = r"""
extern "C" __global__ void ep_test_spin(long long cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) {
    }
}
"""


@pytest.mark.slow
def test_nccl_vs_ipc_ep1_timing(capsys) -> None:
    """EP1, T=4096, hidden 7168 bf16, top-8 of 256 experts: the same kernels over the nccl and the ipc transport.
    GPU time per op: a spin kernel holds the stream while 10 ops are enqueued (no Python launch gaps), CUDA events
    around the 10; median of 7 such rounds, no L2 flush. Prints the table; asserts only that nccl < 2x ipc."""
    import ep_jit
    from ep_core.kernels._cuda import Event, device_attribute
    from ep_core.loopback import LoopbackDomain

    spin = ep_jit.load(ep_jit.compile(SPIN, name="ep_test_spin")).function("ep_test_spin")
    cycles = int(device_attribute("CU_DEVICE_ATTRIBUTE_CLOCK_RATE") * 1000 * 0.02)  # ~20 ms
    t, h, k, e = 4096, 7168, 8, 256
    inp = routing.make_inputs(1, t, h, e, k, seed=3)
    nccl = NcclRank(LocalBootstrap(), num_max_tokens_per_rank=t, hidden=h, num_topk=k)
    dom = LoopbackDomain(1, num_max_tokens_per_rank=t, hidden=h, num_topk=k)
    ranks = {"nccl": nccl, "ipc": dom.ranks[0]}
    times: dict = {}
    reps = 10
    try:
        for sms in (16, 64):
            for name, rank in ranks.items():
                s = rank.stream
                x, idx, w = (_up(a, s) for a in (inp.xs[0], inp.topk_idxs[0], inp.topk_weights[0]))
                state = {}

                def disp(rank=rank, x=x, idx=idx, w=w, sms=sms, state=state):
                    state["out"] = rank.dispatch(x, idx, w, num_experts=e, do_cpu_sync=False, num_sms=sms)

                def cached(rank=rank, x=x, w=w, state=state):
                    state.setdefault("keep", []).append(rank.dispatch(x, None, w, handle=state["out"].handle))

                def comb(rank=rank, sms=sms, state=state):
                    out = state["out"]
                    state.setdefault("keep", []).append(rank.combine(out.recv_x, out.handle, num_sms=sms))

                for op, fn in (("dispatch", disp), ("dispatch_cached", cached), ("combine", comb)):
                    fn()
                    s.synchronize()
                    samples = []
                    for _ in range(7):
                        keep = []
                        a, b = Event(), Event()
                        spin.launch(1, 1, [ep_jit.int64(cycles)], stream=s.handle)
                        a.record(s)
                        for _ in range(reps):
                            fn()
                            keep.append(state.get("out"))
                        b.record(s)
                        b.synchronize()
                        state.pop("keep", None)
                        samples.append(a.elapsed_ms(b) / reps)
                    times[(op, sms, name)] = float(np.median(samples))
                rank.check_errors()
    finally:
        nccl.close()
        dom.close()
    with capsys.disabled():
        print("\nop | SMs | nccl ms | ipc ms | nccl/ipc")
        for (op, sms, name), ms in times.items():
            if name == "nccl":
                ipc = times[(op, sms, "ipc")]
                print(f"{op} | {sms} | {ms:.3f} | {ipc:.3f} | {ms / ipc:.2f}")
    for (op, sms, name), ms in times.items():
        if name == "nccl":
            assert ms < 2.0 * times[(op, sms, "ipc")] + 0.05, (op, sms, ms)
