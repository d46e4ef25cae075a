"""GPU: a stalled peer times out cleanly (EPTimeoutError within budget, GPU usable afterwards); no-sync and cached
dispatch + combine captured into one CUDA graph and replayed on fresh inputs."""

from __future__ import annotations

import time

import numpy as np
import pytest
from ep_core import reference, routing
from ep_core.errors import EPTimeoutError
from ep_core_gpu_testing import num_gpus

pytestmark = pytest.mark.gpu

if num_gpus() == 0:
    pytest.skip("no CUDA GPU", allow_module_level=True)

from ep_core.kernels import _cuda  # noqa: E402
from ep_core.kernels._cuda import DeviceArray, Event, Stream  # noqa: E402
from ep_core.loopback import LoopbackDomain  # noqa: E402

M, HIDDEN, K, E = 64, 512, 8, 64


def _check_combine(dom, outs, inp, xs):
    comb = dom.combine(xs, [o.handle for o in outs])
    ref = reference.combine(
        [x.numpy() if isinstance(x, DeviceArray) else x for x in xs], [o.to_reference().handle for o in outs]
    )
    for r in range(dom.num_ranks):
        assert np.array_equal(comb[r].combined_x.numpy(), ref[r].combined_x)


def test_stalled_peer_times_out_and_gpu_stays_usable() -> None:
    dom = LoopbackDomain(
        2, num_max_tokens_per_rank=M, hidden=HIDDEN, num_topk=K, gpu_timeout_secs=0.5, cpu_timeout_secs=30.0
    )
    inp = routing.make_inputs(2, M, HIDDEN, E, K, seed=3)
    s0 = dom.streams[0]
    t0 = time.monotonic()
    pending = dom.ranks[0].launch_dispatch(
        DeviceArray.from_numpy(inp.xs[0], s0),
        DeviceArray.from_numpy(inp.topk_idxs[0], s0),
        None,
        num_experts=E,
    )
    with pytest.raises(EPTimeoutError) as info:
        dom.ranks[0].finish_dispatch(pending)
    elapsed = time.monotonic() - t0
    assert elapsed < 10.0, f"the timeout took {elapsed:.1f} s for a 0.5 s budget"
    assert info.value.rank == 0
    assert "dispatch" in str(info.value.tag) or "grid" in str(info.value.tag)
    # the GPU and the domain are usable after a reset
    dom.reset()
    outs = dom.dispatch(inp.xs, inp.topk_idxs, inp.topk_weights, num_experts=E, deterministic=True)
    ref = reference.dispatch(
        inp.xs, inp.topk_idxs, inp.topk_weights, num_experts=E, num_max_tokens_per_rank=M
    )
    for r in range(2):
        assert np.array_equal(outs[r].recv_x.numpy(), ref[r].recv_x)
    _check_combine(dom, outs, inp, [o.recv_x for o in outs])
    dom.close()


@pytest.mark.parametrize("bad", ["out_of_range", "duplicate"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_invalid_expert_ids_are_reported(bad: str, deterministic: bool) -> None:
    from ep_core.errors import EPDeviceError

    dom = LoopbackDomain(2, num_max_tokens_per_rank=M, hidden=HIDDEN, num_topk=K, gpu_timeout_secs=10.0)
    inp = routing.make_inputs(2, M, HIDDEN, E, K, seed=5)
    idx = [i.copy() for i in inp.topk_idxs]
    if bad == "out_of_range":
        idx[1][3, 2] = E
    else:
        idx[1][3, 2] = idx[1][3, 5]
    with pytest.raises(EPDeviceError, match="topk_idx"):
        dom.dispatch(inp.xs, idx, inp.topk_weights, num_experts=E, deterministic=deterministic)
    dom.synchronize()
    outs = dom.dispatch(inp.xs, inp.topk_idxs, inp.topk_weights, num_experts=E, deterministic=True)
    ref = reference.dispatch(
        inp.xs, inp.topk_idxs, inp.topk_weights, num_experts=E, num_max_tokens_per_rank=M
    )
    for r in range(2):
        assert np.array_equal(outs[r].recv_x.numpy(), ref[r].recv_x)
    dom.close()


class _StaticAllocator:
    """Plain cuMemAlloc arrays (allowed during stream capture); kept alive for the graph's lifetime."""

    def __init__(self) -> None:
        self.arrays: list[DeviceArray] = []

    def __call__(self, shape, dtype, strides=None):
        a = DeviceArray(shape, dtype, None, strides)
        self.arrays.append(a)
        return a


def test_graph_capture_nosync_and_cached() -> None:
    drv = _cuda.driver()
    n = 4
    dom = LoopbackDomain(n, num_max_tokens_per_rank=M, hidden=HIDDEN, num_topk=K, gpu_timeout_secs=10.0)
    inp = routing.make_inputs(n, M, HIDDEN, E, K, seed=11, masked_ratio=0.2)
    # device inputs that the graph reads; refilled between replays
    xs = [DeviceArray.from_numpy(x, 0) for x in inp.xs]
    idxs = [DeviceArray.from_numpy(i, 0) for i in inp.topk_idxs]
    ws = [DeviceArray.from_numpy(w, 0) for w in inp.topk_weights]
    # warm up (loads the kernels) and make the handles of the cached dispatch
    first = dom.dispatch(xs, idxs, ws, num_experts=E, do_cpu_sync=True)
    dom.synchronize()
    alloc = _StaticAllocator()
    for rank in dom.ranks:
        rank._allocator = alloc
    main = Stream()
    fork, joins = Event(timing=False), [Event(timing=False) for _ in range(n)]
    mode = drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    _cuda.check(drv.cuStreamBeginCapture(main.handle, mode), "cuStreamBeginCapture")
    fork.record(main)
    for s in dom.streams:
        s.wait_event(fork)
    nosync = dom.dispatch(xs, idxs, ws, num_experts=E, do_cpu_sync=False)
    comb_nosync = dom.combine(
        [o.recv_x for o in nosync],
        [o.handle for o in nosync],
        topk_weights=[o.recv_topk_weights for o in nosync],
    )
    cached = dom.dispatch(xs, None, ws, handles=[o.handle for o in first])
    comb_cached = dom.combine([o.recv_x for o in cached], [o.handle for o in cached])
    for s, ev in zip(dom.streams, joins):
        ev.record(s)
        main.wait_event(ev)
    graph = _cuda.check(drv.cuStreamEndCapture(main.handle), "cuStreamEndCapture")
    exe = _cuda.check(drv.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
    for rank in dom.ranks:
        rank._allocator = None

    for replay in range(2):
        rng = np.random.default_rng(100 + replay)
        new_x = [routing.random_bf16(x.shape, rng) for x in inp.xs]
        for d, h in zip(xs, new_x):
            _cuda.copy_to_device(d.ptr, h, 0)
        _cuda.check(drv.cuCtxSynchronize(), "cuCtxSynchronize")
        _cuda.check(drv.cuGraphLaunch(exe, main.handle), "cuGraphLaunch")
        main.synchronize()
        dom.synchronize()
        ref = reference.dispatch(
            new_x,
            inp.topk_idxs,
            inp.topk_weights,
            num_experts=E,
            num_max_tokens_per_rank=M,
            do_cpu_sync=False,
        )
        for r in range(n):
            k = reference.canonical_order(nosync[r].to_reference())
            rr = ref[r]
            nv = rr.num_valid_rows
            assert np.array_equal(k.recv_x[:nv], rr.recv_x[:nv])
            kc = cached[r].to_reference()
            kf = first[r].to_reference()
            ref_sync = reference.dispatch(
                new_x, inp.topk_idxs, inp.topk_weights, num_experts=E, num_max_tokens_per_rank=M
            )
            assert np.array_equal(
                reference.canonical_order(kc).recv_x,
                reference.canonical_order(ref_sync[r]).recv_x[: kf.recv_x.shape[0]],
            )
        k_handles = [o.to_reference().handle for o in nosync]
        ref_comb = reference.combine(
            [o.recv_x.numpy() for o in nosync],
            k_handles,
            topk_weights=[o.recv_topk_weights.numpy() for o in nosync],
        )
        ref_comb_c = reference.combine(
            [o.recv_x.numpy() for o in cached], [o.to_reference().handle for o in cached]
        )
        for r in range(n):
            assert np.array_equal(comb_nosync[r].combined_x.numpy(), ref_comb[r].combined_x)
            assert np.array_equal(
                comb_nosync[r].combined_topk_weights.numpy().view(np.uint32),
                np.where(inp.topk_idxs[r] >= 0, inp.topk_weights[r], 0).astype(np.float32).view(np.uint32),
            )
            assert np.array_equal(comb_cached[r].combined_x.numpy(), ref_comb_c[r].combined_x)
    _cuda.check(drv.cuGraphExecDestroy(exe), "cuGraphExecDestroy")
    _cuda.check(drv.cuGraphDestroy(graph), "cuGraphDestroy")
    dom.close()
