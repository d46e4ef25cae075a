"""GPU: the failure rule (no output is ever silently garbage after a timeout), collective resets, and the launch
modes by ranks per GPU.

- loopback: a no-sync dispatch that times out publishes its failure to the host without a sync, its copy epilogue
  writes nothing, every later call raises (sticky) and launches nothing until reset(), a peer's next kernel publishes
  the peer abort, the failed dispatch's handle stays refused after the reset while the handles of clean calls work,
  an invalid expert id in a no-sync dispatch is raised at the next call; then everything works again;
- processes sharing the GPU: a timeout on one rank, the peer abort on the other, a collective reset, then correct
  results;
- one process alone on the GPU: cooperative launches of dispatch and combine, bitwise equal to the reference.
"""

from __future__ import annotations

import textwrap
import time

import numpy as np
import pytest
from ep_core import reference, routing
from ep_core.errors import EPDeviceError, EPStateError, EPTimeoutError
from ep_core_gpu_testing import num_gpus, run_workers

pytestmark = pytest.mark.gpu

if num_gpus() == 0:
    pytest.skip("no CUDA GPU", allow_module_level=True)

from ep_core.kernels import _cuda  # noqa: E402
from ep_core.kernels._cuda import DeviceArray  # noqa: E402
from ep_core.loopback import LoopbackDomain  # noqa: E402

M, HIDDEN, K, E = 64, 512, 8, 64
TIMEOUT_KIND, PEER_ABORT_KIND, INVALID_EXPERT_KIND, ENVELOPE_MISMATCH_KIND = 1, 2, 3, 6


class _PatternAllocator:
    """Plain allocations filled with 0xAB, so that bytes a kernel did not write are recognizable."""

    def __init__(self) -> None:
        self.arrays: list[DeviceArray] = []

    def __call__(self, shape, dtype, strides=None):
        a = DeviceArray(shape, dtype, None, strides)
        if a.nbytes:
            _cuda.check(_cuda.driver().cuMemsetD8(a.ptr, 0xAB, a.nbytes), "cuMemsetD8")
            _cuda.check(_cuda.driver().cuCtxSynchronize(), "cuCtxSynchronize")
        self.arrays.append(a)
        return a


def _wait_status(rank, index: int, deadline_s: float = 30.0) -> int:
    """Poll the host-mapped words (no CUDA call) until word `index` is set."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        v = rank.status()[index]
        if v:
            return v
        time.sleep(0.01)
    return 0


def _check_dispatch_and_combine(dom, inp) -> None:
    outs = dom.dispatch(inp.xs, inp.topk_idxs, inp.topk_weights, num_experts=E, deterministic=True)
    ref = reference.dispatch(
        inp.xs, inp.topk_idxs, inp.topk_weights, num_experts=E, num_max_tokens_per_rank=M
    )
    for r in range(dom.num_ranks):
        assert np.array_equal(outs[r].recv_x.numpy(), ref[r].recv_x)
    xs = [o.recv_x for o in outs]
    comb = dom.combine(xs, [o.handle for o in outs])
    ref_c = reference.combine([x.numpy() for x in xs], [o.to_reference().handle for o in outs])
    for r in range(dom.num_ranks):
        assert np.array_equal(comb[r].combined_x.numpy(), ref_c[r].combined_x)
    dom.synchronize()


def test_nosync_timeout_is_sticky_until_reset() -> None:
    dom = LoopbackDomain(
        2, num_max_tokens_per_rank=M, hidden=HIDDEN, num_topk=K, gpu_timeout_secs=0.5, cpu_timeout_secs=30.0
    )
    inp = routing.make_inputs(2, M, HIDDEN, E, K, seed=3)
    r0, r1 = dom.ranks
    assert r0.num_ranks_on_device == 2 and not r0.cooperative
    first = dom.dispatch(inp.xs, inp.topk_idxs, inp.topk_weights, num_experts=E)  # handles for a cached call
    dom.synchronize()

    # rank 0 dispatches alone, without a CPU sync: the dispatch times out on the device, the epilogue must not run
    alloc = _PatternAllocator()
    r0._allocator = alloc
    s0 = dom.streams[0]
    pending = r0.launch_dispatch(
        DeviceArray.from_numpy(inp.xs[0], s0),
        DeviceArray.from_numpy(inp.topk_idxs[0], s0),
        None,
        num_experts=E,
        do_cpu_sync=False,
    )
    res = r0.finish_dispatch(pending)  # launches the copy epilogue behind the failing dispatch
    r0._allocator = None
    assert _wait_status(r0, 0) == TIMEOUT_KIND  # published without any stream sync
    s0.synchronize()
    assert np.all(res.recv_x.numpy().view(np.uint8) == 0xAB), (
        "the epilogue wrote outputs after a failed dispatch"
    )

    # every later call raises and launches nothing, until reset
    for _ in range(2):
        with pytest.raises(EPTimeoutError, match="until the domain is reset"):
            dom.dispatch(inp.xs, inp.topk_idxs, inp.topk_weights, num_experts=E, do_cpu_sync=False)
        with pytest.raises(EPTimeoutError):
            dom.dispatch(inp.xs, None, inp.topk_weights, handles=[o.handle for o in first])
        with pytest.raises(EPTimeoutError):
            dom.combine([o.recv_x for o in first], [o.handle for o in first])
    with pytest.raises(EPTimeoutError):
        dom.synchronize()

    # rank 1 published nothing yet; its next kernel finds the abort flag rank 0 raised and publishes it
    assert r1.status() == (0, 0)
    s1 = dom.streams[1]
    p1 = r1.launch_dispatch(
        DeviceArray.from_numpy(inp.xs[1], s1),
        DeviceArray.from_numpy(inp.topk_idxs[1], s1),
        None,
        num_experts=E,
        do_cpu_sync=False,
    )
    r1.finish_dispatch(p1)
    s1.synchronize()
    assert r1.status()[0] == PEER_ABORT_KIND
    with pytest.raises(EPTimeoutError, match="peer rank failed"):
        r1.guard()

    dom.reset()
    assert r0.status() == (0, 0) and r1.status() == (0, 0)
    # the failed no-sync dispatch's handle stays refused after the reset; the handles of the clean first call work
    with pytest.raises(EPStateError, match="dispatch again"):
        r0.combine(res.recv_x, res.handle)
    cached = dom.dispatch(inp.xs, None, inp.topk_weights, handles=[o.handle for o in first])
    for r in range(2):
        assert np.array_equal(cached[r].recv_x.numpy(), first[r].recv_x.numpy())
    _check_dispatch_and_combine(dom, inp)
    dom.close()


def test_a_split_combine_alone_times_out_and_its_reduce_writes_nothing() -> None:
    """prefer_overlap_with_compute=False: a combine is a send-only launch on the op's SMs and a reduce-only launch on
    the rank's share. Rank 0 combining alone: the send launch times out at the entry barrier, the reduce launch
    behind it finds the abort flag and writes nothing; after reset() the domain is exact again."""
    dom = LoopbackDomain(
        2,
        num_max_tokens_per_rank=M,
        hidden=HIDDEN,
        num_topk=K,
        num_sms=4,
        gpu_timeout_secs=0.5,
        cpu_timeout_secs=30.0,
        prefer_overlap_with_compute=False,
    )
    r0, _ = dom.ranks
    assert r0.epilogue_sms == _cuda.num_device_sms() // 2
    inp = routing.make_inputs(2, M, HIDDEN, E, K, seed=5)
    first = dom.dispatch(inp.xs, inp.topk_idxs, inp.topk_weights, num_experts=E)
    dom.synchronize()
    alloc = _PatternAllocator()
    r0._allocator = alloc
    res = r0.combine(first[0].recv_x, first[0].handle)
    r0._allocator = None
    assert _wait_status(r0, 0) == TIMEOUT_KIND
    dom.streams[0].synchronize()
    assert np.all(res.combined_x.numpy().view(np.uint8) == 0xAB), (
        "the reduce wrote outputs after a failed send"
    )
    with pytest.raises(EPTimeoutError, match=r"combine\.entry_barrier"):
        r0.guard()
    dom.reset()
    _check_dispatch_and_combine(dom, inp)
    dom.close()


def test_nosync_invalid_expert_raised_at_next_call() -> None:
    dom = LoopbackDomain(2, num_max_tokens_per_rank=M, hidden=HIDDEN, num_topk=K, gpu_timeout_secs=10.0)
    inp = routing.make_inputs(2, M, HIDDEN, E, K, seed=5)
    idx = [i.copy() for i in inp.topk_idxs]
    idx[1][3, 2] = E
    dom.dispatch(inp.xs, idx, inp.topk_weights, num_experts=E, do_cpu_sync=False)  # no raise: no sync
    assert _wait_status(dom.ranks[1], 1) == INVALID_EXPERT_KIND
    with pytest.raises(EPDeviceError, match="topk_idx"):
        dom.dispatch(inp.xs, inp.topk_idxs, inp.topk_weights, num_experts=E)
    assert dom.ranks[1].status() == (0, 0)
    _check_dispatch_and_combine(dom, inp)  # raised once; no reset needed
    dom.close()


def _launch_alone(rank, stream, xs, idx, num_experts):
    """One rank's no-sync dispatch, launched without its peers' matching call."""
    return rank.finish_dispatch(
        rank.launch_dispatch(
            DeviceArray.from_numpy(xs, stream),
            DeviceArray.from_numpy(idx, stream),
            None,
            num_experts=num_experts,
            do_cpu_sync=False,
        )
    )


@pytest.mark.parametrize("case", ["num_experts", "dispatch_vs_combine"])
def test_peers_in_different_operations_stop_at_once(case: str) -> None:
    """The kernel-side envelope: ranks that meet in different operations (or one configuration differing) both
    record the mismatch at the entry barrier, well before the 30 s timeout, and work again after reset()."""
    dom = LoopbackDomain(2, num_max_tokens_per_rank=M, hidden=HIDDEN, num_topk=K, gpu_timeout_secs=30.0)
    inp = routing.make_inputs(2, M, HIDDEN, E, K, seed=7)
    r0, r1 = dom.ranks
    s0, s1 = dom.streams
    first = dom.dispatch(inp.xs, inp.topk_idxs, inp.topk_weights, num_experts=E)
    dom.synchronize()
    start = time.monotonic()
    _launch_alone(r0, s0, inp.xs[0], inp.topk_idxs[0], E)
    if case == "num_experts":
        half = routing.make_inputs(2, M, HIDDEN, E // 2, K, seed=8)
        _launch_alone(r1, s1, half.xs[1], half.topk_idxs[1], E // 2)
    else:
        r1.combine(first[1].recv_x, first[1].handle)
    for r in (r0, r1):
        assert _wait_status(r, 0, deadline_s=5.0) == ENVELOPE_MISMATCH_KIND
    assert time.monotonic() - start < 5.0
    for r, peer in ((r0, 1), (r1, 0)):
        with pytest.raises(EPDeviceError, match=f"rank {peer} entered") as info:
            r.guard()
        assert info.value.rank == r.rank
    dom.reset()
    _check_dispatch_and_combine(dom, inp)
    dom.close()


WORKER = textwrap.dedent(
    """
    import json, pickle, sys
    import numpy as np
    from ep_core import reference, routing
    from ep_core.errors import EPTimeoutError
    from ep_core.kernels._cuda import DeviceArray
    from ep_core.loopback import ProcessRank

    rank, size, directory = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    M, H, K, E = 64, 512, 8, 32
    import ep_symmem
    boot = ep_symmem.FileBootstrap(directory, rank, size, timeout=120.0)
    pr = ProcessRank(boot, num_max_tokens_per_rank=M, hidden=H, num_topk=K, gpu_timeout_secs=1.0,
                     cpu_timeout_secs=60.0, memory="cuda_ipc")
    assert pr.num_ranks_on_device == size and not pr.cooperative
    inp = routing.make_inputs(size, [M, 40, 0, 17][:size], H, E, K, seed=17, masked_ratio=0.2)
    up = lambda a: DeviceArray.from_numpy(a, pr.stream)
    seen = []
    if rank == 0:  # alone: times out
        try:
            pr.dispatch(up(inp.xs[0]), up(inp.topk_idxs[0]), None, num_experts=E, num_sms=4)
        except EPTimeoutError as exc:
            seen.append(exc.tag)
    boot.barrier()
    if rank != 0:  # rank 0's timeout raised our abort flag: our kernel leaves at entry and the sync raises
        try:
            pr.dispatch(up(inp.xs[rank]), up(inp.topk_idxs[rank]), None, num_experts=E, num_sms=4)
        except EPTimeoutError as exc:
            seen.append(exc.tag)
    try:  # sticky
        pr.dispatch(up(inp.xs[rank]), up(inp.topk_idxs[rank]), None, num_experts=E, num_sms=4)
    except EPTimeoutError as exc:
        seen.append("sticky")
    pr.reset()
    assert pr.status() == (0, 0)
    ref = reference.dispatch(inp.xs, inp.topk_idxs, inp.topk_weights, num_experts=E, num_max_tokens_per_rank=M)
    out = pr.dispatch(up(inp.xs[rank]), up(inp.topk_idxs[rank]), up(inp.topk_weights[rank]), num_experts=E,
                      deterministic=True, num_sms=4)
    k = out.to_reference()
    nv = ref[rank].num_valid_rows
    assert np.array_equal(k.recv_x[:nv], ref[rank].recv_x[:nv]), "recv_x after reset"
    comb = pr.combine(out.recv_x, out.handle, num_sms=4)
    everyone = [pickle.loads(b) for b in boot.allgather(pickle.dumps((out.recv_x.numpy(), k.handle)))]
    ref_c = reference.combine([e[0] for e in everyone], [e[1] for e in everyone])
    assert np.array_equal(comb.combined_x.numpy(), ref_c[rank].combined_x), "combined_x after reset"
    pr.check_errors()
    pr.close()
    print(json.dumps({"rank": rank, "seen": seen}))
    """
)


def test_processes_reset_collectively_after_a_timeout(tmp_path) -> None:
    pytest.importorskip("ep_symmem")
    results = run_workers(WORKER, 2, tmp_path)
    by_rank = {r["rank"]: r["seen"] for r in results}
    assert by_rank[0][0] != "peer_abort" and by_rank[0][-1] == "sticky"
    assert by_rank[1] == ["peer_abort", "sticky"]


def test_rank_alone_on_its_gpu_launches_cooperatively() -> None:
    from ep_core.bootstrap import LocalBootstrap
    from ep_core.loopback import ProcessRank

    pr = ProcessRank(
        LocalBootstrap(), num_max_tokens_per_rank=M, hidden=HIDDEN, num_topk=K, memory="cuda_ipc"
    )
    assert pr.num_ranks_on_device == 1 and pr.cooperative
    inp = routing.make_inputs(1, M, HIDDEN, E, K, seed=29, masked_ratio=0.2)
    ref = reference.dispatch(
        inp.xs, inp.topk_idxs, inp.topk_weights, num_experts=E, num_max_tokens_per_rank=M
    )
    for num_sms in (0, 24):  # 0: the planner's count for one rank alone (the whole device)
        s = pr.stream
        out = pr.dispatch(
            DeviceArray.from_numpy(inp.xs[0], s),
            DeviceArray.from_numpy(inp.topk_idxs[0], s),
            DeviceArray.from_numpy(inp.topk_weights[0], s),
            num_experts=E,
            deterministic=True,
            num_sms=num_sms,
        )
        if num_sms == 0:
            assert out.handle.num_sms == pr.device_sms
        assert np.array_equal(out.recv_x.numpy(), ref[0].recv_x)
        comb = pr.combine(out.recv_x, out.handle)
        ref_c = reference.combine([out.recv_x.numpy()], [out.to_reference().handle])
        assert np.array_equal(comb.combined_x.numpy(), ref_c[0].combined_x)
    pr.check_errors()
    pr.close()
