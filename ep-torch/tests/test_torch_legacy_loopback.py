"""V1 low-latency mode (and V2's ElasticBuffer) over ``ep_torch.loopback.LoopbackGroup``: N ranks in one process, bit
for bit against ``ep_torch.legacy.reference``. CPU: the reference executor, one thread per rank. GPU (marker ``gpu``):
ep-core's loopback domain, one stream per rank, eager and captured in one CUDA graph (all ranks) and replayed.
The checks are test_torch_legacy_ll.py's (loaded by path: the tests are imported with --import-mode=importlib)."""

from __future__ import annotations

import ast
import importlib.util
import inspect
from pathlib import Path

import numpy as np
import pytest
import torch
from ep_torch.buffer import ElasticBuffer
from ep_torch.legacy.reference import fp8_cast_reference, ll_expected_rows
from ep_torch.loopback import LoopbackBuffer, LoopbackElasticBuffer, LoopbackGroup


def _ll_helpers():
    spec = importlib.util.spec_from_file_location(
        "_ep_torch_legacy_ll_checks", Path(__file__).with_name("test_torch_legacy_ll.py")
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ll = _ll_helpers()
T, H, K, E, M = ll.T, ll.H, ll.K, ll.E, ll.M


def _fp8_checks(outs, n: int, round_scale: bool, use_ue8m0: bool) -> None:
    what = f"fp8 round_scale={round_scale} use_ue8m0={use_ue8m0}"
    xs = [ll._inputs(r)[0] for r in range(n)]
    for rank, ((q, s), cnt, _, _, _) in enumerate(outs):
        assert q.dtype == torch.float8_e4m3fn and s.transpose(-1, -2).is_contiguous(), what
        want = ll_expected_rows([ll._inputs(r)[1].numpy() for r in range(n)], rank, E)
        for e, rows in enumerate(want):
            assert int(cnt[e]) == len(rows), f"{what} rank {rank}: recv_count[{e}]"
            if not rows:
                continue
            c = len(rows)
            rq, rs = fp8_cast_reference(
                np.stack([ll._bits(xs[sr][t]) for sr, t in rows]), round_scale, use_ue8m0
            )
            assert np.array_equal(q[e, :c].cpu().view(torch.uint8).numpy(), rq), (
                f"{what} rank {rank} e{e}: bytes"
            )
            got_s = s[e, :c].cpu().contiguous().numpy()
            assert np.array_equal(got_s.view(np.int32), rs.view(np.int32)), f"{what} rank {rank} e{e}: scales"


def _loopback_ll_checks(n: int, device: str) -> None:
    """Every rank's dispatch (bf16, FP8 in three modes, hooks) and weighted combine (lane groups, non-deterministic
    dispatch underneath) over one loopback group; all ranks launch before anything is read back."""
    group = LoopbackGroup(n, device=device, gpu_timeout_secs=20.0, timeout_secs=60.0)
    dev = group.device
    epr = E // n
    v1 = group.v1_buffers(0, int(1e8), low_latency_mode=True, explicitly_destroy=True)
    assert all(isinstance(b, LoopbackBuffer) for b in v1) and [b.rank for b in v1] == list(range(n))
    inp = [tuple(a.to(dev) for a in ll._inputs(r)) for r in range(n)]

    def dispatch(r, **kw):
        x, idx, _ = inp[r]
        return v1[r].low_latency_dispatch(x, idx, M, E, **kw)

    def combine(outs, r, **kw):
        _, idx, w = inp[r]
        recv, _, handle, _, _ = outs[r]
        return v1[r].low_latency_combine(ll._expert(recv, r, epr), idx, w, handle, **kw)

    def check_combine(combs, what):
        for r, comb in enumerate(combs):
            x, idx, w = ll._inputs(r)
            got, ref = ll._bits(comb[0]), ll._combine_ref(x, idx, w)
            bad = np.argwhere(got != ref)
            assert not bad.size, f"{what} rank {r}: combine differs from the reference at {tuple(bad[0])}"

    for hook_mode in (False, True):
        outs = group.run(lambda r, hm=hook_mode: dispatch(r, use_fp8=False, return_recv_hook=hm))
        if hook_mode:
            group.run(lambda r, o=outs: o[r][4]())
        for r, (recv, cnt, handle, _, _) in enumerate(outs):
            ll._check_dispatch(recv, cnt, handle, r, n, 0, f"loopback bf16 (hook={hook_mode})")
        combs = group.run(lambda r, o=outs, hm=hook_mode: combine(o, r, return_recv_hook=hm))
        if hook_mode:
            group.run(lambda r, c=combs: c[r][2]())
        check_combine(combs, f"loopback combine (hook={hook_mode})")
    for lanes in (1, 2):
        for b in v1:
            b.ll_lanes_per_combine = lanes
        check_combine(group.run(lambda r: combine(outs, r)), f"loopback combine lanes={lanes}")
    for b in v1:
        b.ll_lanes_per_combine = 0
    for rs, ue in ((False, False), (True, False), (True, True)):
        outs8 = group.run(lambda r, rs=rs, ue=ue: dispatch(r, use_fp8=True, round_scale=rs, use_ue8m0=ue))
        _fp8_checks(outs8, n, rs, ue)
    # ep's non-deterministic dispatch underneath: new inner buffers, built for every rank together
    for b in v1:
        b.ll_deterministic = False
    outs = group.run(lambda r: dispatch(r, use_fp8=False))
    for r, (recv, cnt, handle, _, _) in enumerate(outs):
        ll._check_dispatch(recv, cnt, handle, r, n, 0, "loopback bf16 nondet")
    check_combine(group.run(lambda r: combine(outs, r)), "loopback combine nondet")
    if device == "cuda":  # (a CPU group runs normal mode: test_torch_v1_loopback_normal.py)
        with pytest.raises(NotImplementedError, match="normal mode"):
            v1[0].dispatch(inp[0][0])
    group.run(lambda r: v1[r].destroy())
    assert not group._built, "every inner buffer was released"
    group.close()


@pytest.mark.parametrize("ranks", [2, 4])
def test_loopback_v1_ll_bitwise_cpu(ranks):
    _loopback_ll_checks(ranks, "cpu")


def test_loopback_elastic_buffer_cpu():
    """V2's ElasticBuffer over the loopback group: dispatch + combine on every rank (reference executor)."""
    n = 2
    group = LoopbackGroup(n, device="cpu")
    bufs = group.elastic_buffers(num_max_tokens_per_rank=T, hidden=H, num_topk=K)
    assert all(isinstance(b, LoopbackElasticBuffer) for b in bufs)
    assert (
        [b.rank_idx for b in bufs] == [0, 1] and bufs[0].num_ranks == n and bufs[0].transport == "reference"
    )
    inp = [ll._inputs(r) for r in range(n)]
    outs = group.run(
        lambda r: bufs[r].dispatch(inp[r][0], topk_idx=inp[r][1], topk_weights=inp[r][2], num_experts=E)
    )
    for r, (rx, _, _, _, _) in enumerate(outs):
        want = sum(
            1 for s in range(n) for t in range(T) if any(0 <= int(e) // (E // n) == r for e in inp[s][1][t])
        )
        assert rx.shape[0] == want, f"rank {r}: {rx.shape[0]} rows, want {want}"
    combs = group.run(lambda r: bufs[r].combine(outs[r][0], outs[r][3]))
    for r, (comb, _, _) in enumerate(combs):
        x, idx, _ = inp[r]
        reached = torch.tensor([len({int(e) // (E // n) for e in idx[t] if e >= 0}) for t in range(T)])
        assert torch.equal(comb.float(), (x.float() * reached[:, None]).to(torch.bfloat16).float()), (
            f"rank {r}"
        )
    group.run(lambda r: bufs[r].destroy())


def test_loopback_binds_through_connect():
    """LoopbackElasticBuffer runs ElasticBuffer.__init__ itself, bound to its rank through the ``_connect`` hook: the
    constructor makes no group-facing call of its own outside it (a new one would bypass the loopback group)."""
    tree = ast.parse(inspect.getsource(ElasticBuffer.__init__).lstrip().replace("\n    ", "\n"))
    called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert not called & {"ProcessGroupBootstrap", "choose_transport", "make_core_transport"}, called
    assert "_connect" in LoopbackElasticBuffer.__dict__
    group = LoopbackGroup(2, device="cpu")
    bufs = group.elastic_buffers(num_max_tokens_per_rank=4, hidden=H, num_topk=K)
    assert [b.group for b in bufs] == [None, None]
    assert all("loopback group: 2 ranks" in b.transport_choice.reason for b in bufs)
    group.run(lambda r: bufs[r].destroy())


def test_loopback_refusals():
    """(Normal mode's refusal on a GPU group: test_torch_v1_loopback_normal.py, which a CPU group runs.)"""
    with pytest.raises(ValueError, match="num_ranks"):
        LoopbackGroup(0)
    group = LoopbackGroup(2, device="cpu")
    with pytest.raises(ValueError, match="transport"):
        group.v1_buffers(0, 0, low_latency_mode=True, transport="ipc")


def test_bench_v1_loopback_dry_run():
    """benchmarks/bench_v1.py: EP1 in a process and EP2 as a loopback group, on the CPU reference backend; every
    row and the bitwise checks pass, the EP2 rows are labelled loopback."""
    from ep_torch_testing import BENCH_V1_ROWS, bench_v1_dry_run

    lines = bench_v1_dry_run("--quick", "--ranks", "1", "2")
    words = [line.split() for line in lines]
    labelled = {(w[0], w[1]) for w in words if len(w) > 2 and w[0] in ("1", "2")}
    tail = "\n".join(lines[-40:])
    assert ("2", "loopback") in labelled and ("1", "cpu") in labelled, tail
    for op in BENCH_V1_ROWS:
        assert sum(op in line for line in lines) >= 2, f"{op!r} missing for EP1 or EP2:\n{tail}"


# ---------------------------------------------------------------------------------------------------------------------
# GPU (the lead runs these on the H200)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.gpu
@gpu
def test_loopback_v1_ll_bitwise_gpu(ranks, monkeypatch):
    """The CPU test's checks on ep-core's loopback domain: the ipc kernels and ep-torch's low-latency kernels."""
    monkeypatch.setenv("EPKIT_NVLINK_GBS", "450")  # the planner's figure for ranks on one GPU
    torch.cuda.set_device(0)
    _loopback_ll_checks(ranks, "cuda")


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.gpu
@gpu
def test_loopback_v1_ll_cuda_graph_gpu(ranks, monkeypatch):
    """All ranks' low-latency dispatch + weighted combine captured in one CUDA graph (each rank on its stream), then
    replayed on new inputs copied into the captured ones: bitwise equal to the reference every time."""
    from ep_torch.cuda_graph import avoid_record_stream

    monkeypatch.setenv("EPKIT_NVLINK_GBS", "450")
    torch.cuda.set_device(0)
    n, dev = ranks, torch.device("cuda", 0)
    epr = E // n
    group = LoopbackGroup(n, device="cuda", gpu_timeout_secs=20.0, timeout_secs=60.0)
    v1 = group.v1_buffers(0, int(1e8), low_latency_mode=True, explicitly_destroy=True)
    static = [tuple(a.to(dev) for a in ll._inputs(r, 0)) for r in range(n)]
    result: list = [None] * n

    def step(r):
        x, idx, w = static[r]
        recv, cnt, handle, _, _ = v1[r].low_latency_dispatch(x, idx, M, E, use_fp8=False)
        comb, _, _ = v1[r].low_latency_combine(ll._expert(recv, r, epr), idx, w, handle)
        result[r] = (recv, cnt, handle, comb)

    # the test's "expert" runs between dispatch and combine: its torch kernels loaded before any rank's call (a
    # first, lazy load there could wait for the kernels of the ranks before it)
    ll._expert(torch.zeros(epr, 1, H, dtype=torch.bfloat16, device=dev), 0, epr)
    torch.cuda.synchronize()
    group.run(step)  # builds the buffers and compiles the kernels (outside capture)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with avoid_record_stream(), torch.cuda.graph(graph):
        group.run(step)
    for seed in (1, 2, 3):
        for r in range(n):
            for dst, src in zip(static[r], ll._inputs(r, seed)):
                dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        for r in range(n):
            recv, cnt, handle, comb = result[r]
            ll._check_dispatch(recv, cnt, handle, r, n, seed, f"loopback graph replay {seed}")
            x, idx, w = ll._inputs(r, seed)
            bad = np.argwhere(ll._bits(comb) != ll._combine_ref(x, idx, w))
            assert not bad.size, f"graph replay {seed} rank {r}: combine differs at {tuple(bad[0])}"
    del graph
    group.run(lambda r: v1[r].destroy())
    group.close()


def test_loopback_transport_storage(monkeypatch):
    """The GPU group's transport without a GPU (IpcBuffer.create_loopback and the device identity faked): one
    allocation for all ranks, created by the first rank to allocate, each rank's storage at its own base with every
    rank on one device, freed when the last rank's storage closes."""
    from ep_core.kernels import _cuda
    from ep_core.transports import ipc
    from ep_torch.loopback import _LoopbackTransport

    made = []

    class FakeBuffer:
        def __init__(self, n, data):
            self.bases = [0x10000000 * (r + 1) for r in range(n)]
            self.peer_table = 0xABC000
            self.data, self.closed = data, 0
            made.append(self)

        def close(self):
            self.closed += 1

    monkeypatch.setattr(
        ipc.IpcBuffer, "create_loopback", classmethod(lambda cls, n, d, use_symmem: FakeBuffer(n, d))
    )
    monkeypatch.setattr(_cuda, "device_identity", lambda: "host/gpu0")

    class Boot:
        def __init__(self, r):
            self.rank, self.size = r, 3

    tr = _LoopbackTransport(3, 0)
    assert tr.num_nvlink_ranks(Boot(0)) == 3 and not tr.supports_host_memory
    total = ipc.IpcBuffer.total_bytes(4 << 20)
    stores = [tr.allocate(Boot(r), total) for r in (1, 0, 2)]
    assert len(made) == 1 and made[0].data == 4 << 20
    assert [s.ptr for s in stores] == [0x20000000, 0x10000000, 0x30000000]
    assert all(s.num_bytes == total and s.peer_table == 0xABC000 and s.device == 0 for s in stores)
    assert stores[0].rank_devices == ["host/gpu0"] * 3 and stores[0].peer_bases(3) == made[0].bases
    for s in stores[:2]:
        s.close()
    assert made[0].closed == 0
    stores[2].close()
    stores[2].close()  # a second close is a no-op
    assert made[0].closed == 1 and tr.buffer is None


def test_loopback_refuses_too_few_hardware_queues(monkeypatch):
    """A GPU group needs a hardware queue per rank stream (2N): a context created with fewer is refused with the
    variable to set, before any kernel could deadlock; enough (or the variable raised before CUDA starts) passes."""
    from ep_core.errors import EPConfigError
    from ep_core.kernels import _cuda
    from ep_torch import loopback

    asked = []

    def have(queues):
        def reserve(num_streams, device=0):
            asked.append(num_streams)
            return queues

        return reserve

    monkeypatch.setattr(_cuda, "reserve_connections", have(8))
    loopback._reserve_queues(4, None)  # 8 streams, 8 queues
    with pytest.raises(EPConfigError, match="CUDA_DEVICE_MAX_CONNECTIONS=32") as err:
        loopback._reserve_queues(8, "cuda:0")
    assert "LoopbackGroup(8)" in str(err.value) and "16 streams" in str(err.value)
    monkeypatch.setattr(_cuda, "reserve_connections", have(32))
    loopback._reserve_queues(8, "cuda:0")
    assert asked == [13, 25, 25]  # asks for V1's comm streams and the caller's too


def test_reserve_connections_never_lowers(monkeypatch):
    """Enough queues already: nothing asked of the driver, the variable unchanged."""
    from ep_core.kernels import _cuda

    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "24")
    assert _cuda.reserve_connections(9) == 24
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    assert _cuda.reserve_connections(8) == 8
