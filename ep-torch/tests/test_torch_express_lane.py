"""The express lane (a kept plan, `ep_core.kernels.op_plan`, issue 18): a repeat of the last plain no-sync dispatch goes from
`ElasticBuffer.dispatch` to the launches in one call, and launches exactly what the ordinary road launches.

Through the GPU executor with the driver mocked (bench_host_cpu's), on CPU tensors, with ep_torch's host
extension loaded for them (`EPKIT_TORCH_HOST_EXTENSION=1`; it builds with the host compiler): each launch's
argument words, with every pointer named by the array it points into, are compared between a buffer that takes
the lane and one that does not (`EPKIT_EXPRESS_LANE=0`); the lane's handles carry the fingerprint validation
would give them; any argument that differs from the recorded call's takes the ordinary road; an error before the
launch gives up the step as the ordinary road's announcement does.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "ep-core" / "benchmarks"))
# ep_torch's part of the CPU benchmark (its tensors at the mocked executor's addresses)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

HIDDEN, EXPERTS, K = 64, 8, 2
_FIELDS = (
    "topk_idx",
    "dst_buffer_slot_idx",
    "psum_num_recv_tokens_per_scaleup_rank",
    "psum_num_recv_tokens_per_expert",
    "num_unaligned_recv_tokens_per_expert",
    "recv_src_metadata",
)


@pytest.fixture
def mocked(monkeypatch):
    """`make(lane)`: an ElasticBuffer on the mocked GPU executor with the host extension loaded, the lane on or
    off; `launches`: every launch as (kernel name, words); `served`: the dispatches the lane served."""
    if not shutil_which_cxx():
        pytest.skip("no C++ compiler for the host extension")
    import bench_host_cpu as b
    import torch.distributed as dist
    from ep_core.kernels import op_plan
    from ep_core.kernels import prepared_launch as pl
    from ep_torch import buffer as tbuf
    from ep_torch import host_extension
    from ep_torch.launch import free_port, init_rank

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    monkeypatch.setenv("EPKIT_TORCH_HOST_EXTENSION", "1")
    monkeypatch.setattr(host_extension, "_state", [])
    monkeypatch.setattr(tbuf, "make_core_transport", lambda choice: b._CpuMockedTransport())
    launches: list = []
    served = [0]
    native = pl._native_launch

    def recorded_native(launch):  # a prepared launch's words reach the (mocked) native launch, on every road
        call = native(launch)

        def recorded(stream, values, *pairs):
            launches.append((launch.name, launch.patch(values)))
            return call(stream, values, *pairs)

        return recorded

    def recorded_launch(self, words, stream):
        launches.append((self.name, list(words)))

    monkeypatch.setattr(pl, "_native_launch", recorded_native)
    monkeypatch.setattr(pl.PreparedLaunch, "launch", recorded_launch)
    served_by: dict = {"dispatch": 0, "cached": 0, "combine": 0}

    call = op_plan.DispatchPlan.__call__

    def counted(
        self, *args
    ):  # the no-sync lanes (CPU-sync, zero-copy and cached are fields of the same class)
        got = call(self, *args)
        if got is not None and self.cached:
            served_by["cached"] += 1
        elif got is not None and not self.cpu_sync and not self.zero_copy:
            served_by["dispatch"] += 1
            served[0] += 1
        return got

    monkeypatch.setattr(op_plan.DispatchPlan, "__call__", counted)
    combine_call = op_plan.CombinePlan.__call__

    def counted_combine(self, *args):  # a combine's lane
        got = combine_call(self, *args)
        served_by["combine"] += got is not None
        return got

    monkeypatch.setattr(op_plan.CombinePlan, "__call__", counted_combine)

    init_rank(0, 1, free_port(), "gloo")

    def make(lane: bool):
        monkeypatch.setenv("EPKIT_EXPRESS_LANE", "1" if lane else "0")
        return tbuf.ElasticBuffer(None, num_max_tokens_per_rank=8, hidden=HIDDEN, num_topk=K)

    with b._MockedGpu():
        yield make, launches, served, served_by
    dist.destroy_process_group()


def shutil_which_cxx() -> bool:
    import os
    import shutil

    return bool(os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++"))


def _named(words: list, names: dict) -> list:
    return [names.get(w, w) for w in words]


def _named_launches(launches: list, names: dict) -> list:
    """Each recorded launch as (kernel, words with every known pointer named)."""
    return [(name, _named(words, names)) for name, words in launches]


def _handle_fields(handle) -> dict:
    """A handle's fields but its arrays (compared by the launches' named pointers)."""
    return {k: v for k, v in vars(handle).items() if not k.startswith("_") and not torch.is_tensor(v)}


def _pointer_names(x, idx, w, out) -> dict:
    """Every pointer of a call's arrays -> the names of what it points at (handle parts by field)."""
    from ep_core.kernels.op_plan import _handle_ptrs

    recv_x, recv_idx, recv_w, handle, _ = out
    named: dict = {}
    arrays = {"x": x, "idx": idx, "w": w, "recv_x": recv_x, "recv_idx": recv_idx, "recv_w": recv_w}
    for name, a in arrays.items():
        if a is not None and a.numel():
            named.setdefault(a.data_ptr(), []).append(name)
    for name, ptr in zip(_FIELDS, _handle_ptrs(handle, _FIELDS)):
        named.setdefault(ptr, []).append(name)
    return {p: "+".join(sorted(n)) for p, n in named.items()}


@pytest.mark.parametrize(
    ("tokens", "weights", "idx_dtype"),
    [(8, True, torch.int64), (1, True, torch.int64), (8, False, torch.int64), (5, True, torch.int32)],
)
def test_lane_launches_what_the_ordinary_road_launches(mocked, tokens, weights, idx_dtype):
    make, launches, served, _by = mocked
    g = torch.Generator().manual_seed(tokens)
    calls = []
    for _ in range(4):
        x = torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16)
        idx = torch.rand(tokens, EXPERTS, generator=g).topk(K, dim=1).indices.to(idx_dtype)
        w = torch.rand(tokens, K, generator=g) if weights else None
        calls.append((x, idx, w))
    seen = {}
    for lane in (False, True):
        buf = make(lane)
        served[0] = 0
        per_call = []
        for x, idx, w in calls:
            launches.clear()
            out = buf.dispatch(
                x, topk_idx=idx, topk_weights=w, num_experts=EXPERTS, num_sms=4, do_cpu_sync=False
            )
            names = _pointer_names(x, idx, w, out)
            recv_x, recv_idx, recv_w, handle, event = out
            assert event.event is None
            assert recv_x.shape == (handle.num_recv_tokens, HIDDEN) and recv_x.dtype == torch.bfloat16
            assert recv_idx.shape == (handle.num_recv_tokens, K) and recv_idx.dtype == torch.int64
            assert (recv_w is None) == (w is None)
            assert handle.topk_idx is not idx and handle.topk_idx.dtype == idx.dtype
            assert handle.topk_idx.shape == idx.shape
            per_call.append((_named_launches(launches, names), _handle_fields(handle)))
        seen[lane] = per_call
        assert served[0] == (3 if lane else 0)  # the first call makes the entry; the lane serves the others
        assert (buf._lanes.get("dispatch") is not None) == lane
    assert seen[True] == seen[False]


def test_lane_handles_carry_the_fingerprint_validation_gives(mocked, monkeypatch):
    from ep_core import validation

    make, _launches, served, _by = mocked
    buf = make(True)
    x = torch.ones(8, HIDDEN, dtype=torch.bfloat16)
    idx = torch.arange(16, dtype=torch.int64).reshape(8, 2) % EXPERTS
    kw = dict(topk_idx=idx, num_experts=EXPERTS, num_sms=4, do_cpu_sync=False)
    buf.dispatch(x, **kw)
    checks: list = []
    real = validation._check_handle_arrays
    monkeypatch.setattr(validation, "_check_handle_arrays", lambda *a: checks.append(a[2]) or real(*a))
    rt = buf.runtime
    for _ in range(3):
        h = buf.dispatch(x, **kw)[3]
        fp = validation.handle_fingerprint(rt.config, rt.executor, h)
        assert validation._fingerprint_matches(validation._validated_handles[h], fp)
        recv = torch.ones(h.num_recv_tokens, HIDDEN, dtype=torch.bfloat16)
        buf.combine(recv, h, num_sms=4)
        buf.dispatch(x, handle=h, num_sms=4)
    assert served[0] == 3 and checks == []  # trusted: no handle was checked array by array


def test_any_other_argument_takes_the_ordinary_road(mocked):
    from ep_core.errors import EPValueError

    make, _launches, served, _by = mocked
    buf = make(True)
    x = torch.ones(8, HIDDEN, dtype=torch.bfloat16)
    idx = torch.arange(16, dtype=torch.int64).reshape(8, 2) % EXPERTS
    kw = dict(topk_idx=idx, num_experts=EXPERTS, num_sms=4, do_cpu_sync=False)
    h = buf.dispatch(x, **kw)[3]
    buf.dispatch(x, **kw)
    assert served[0] == 1
    lane = buf._lanes.get("dispatch")
    others = [
        dict(kw, num_sms=8),  # another scalar: another entry (and a new lane)
        dict(kw, do_cpu_sync=None),
        dict(kw, do_cpu_sync=True),
        dict(kw, do_handle_copy=False),
        dict(kw, do_expand=True),
        dict(kw, async_with_compute_stream=True),
        dict(kw, num_qps=0, expert_alignment=1),
    ]
    for extra in others:
        buf._lanes["dispatch"] = lane
        buf.dispatch(x, **extra)
        assert served[0] == 1, extra
    buf._lanes["dispatch"] = lane
    buf.dispatch(x[:4].clone(), **dict(kw, topk_idx=idx[:4].clone()))  # other shapes
    buf._lanes["dispatch"] = lane
    buf.dispatch(x.clone().requires_grad_(), **kw)  # autograd: ep_torch detaches it on the ordinary road
    buf._lanes["dispatch"] = lane
    with pytest.raises(EPValueError, match="contiguous"):  # other strides: validation's error, as without it
        buf.dispatch(x.t().contiguous().t(), **kw)
    buf._lanes["dispatch"] = lane
    buf.dispatch(x, handle=h, num_sms=4)
    assert served[0] == 1
    buf._lanes["dispatch"] = lane
    buf.dispatch(x, **kw)
    assert served[0] == 2


def test_a_bad_scalar_of_another_type_is_never_served(mocked):
    """`num_sms=4.0` equals the recorded 4 but is another key: it must meet validation's error, as without the
    lane."""
    from ep_core.errors import EPError

    make, _launches, served, _by = mocked
    buf = make(True)
    x = torch.ones(8, HIDDEN, dtype=torch.bfloat16)
    idx = torch.arange(16, dtype=torch.int64).reshape(8, 2) % EXPERTS
    kw = dict(topk_idx=idx, num_experts=EXPERTS, num_sms=4, do_cpu_sync=False)
    buf.dispatch(x, **kw)
    with pytest.raises(EPError, match="num_sms"):
        buf.dispatch(x, **dict(kw, num_sms=4.0))
    assert served[0] == 0


@pytest.mark.parametrize(
    ("failure", "cpu_sync"), [("kernel", False), ("kernel", True), ("timeout", True), ("capture", None)]
)
def test_a_refused_call_fails_as_the_ordinary_road_does(mocked, sync_served, monkeypatch, failure, cpu_sync):
    """A kernel's published failure or ep_torch's capture check refusing a CPU sync (before the launch: the step
    is given up), or a CPU-sync dispatch's count wait running out of its CPU timeout (after the launch: the step is
    the call's): the same error and the same step on the lanes as on the ordinary road."""
    make, _launches, served, _by = mocked
    outcomes = {}
    for lane in (False, True):
        buf = make(lane)
        x = torch.ones(8, HIDDEN, dtype=torch.bfloat16)
        idx = torch.arange(16, dtype=torch.int64).reshape(8, 2) % EXPERTS
        kw = dict(topk_idx=idx, num_experts=EXPERTS, num_sms=4, do_cpu_sync=cpu_sync)
        buf.dispatch(x, **kw)
        buf.dispatch(x, **kw)
        rank = buf.runtime.executor.rank
        before = rank.launch_step
        if failure == "kernel":  # a kernel of this rank published a failure
            monkeypatch.setattr(rank._status, "read", lambda: (3, 0))
        elif failure == "capture":  # ep_torch's CUDA-graph capture check refuses the CPU sync
            from ep_core.errors import EPValueError

            def refuse(*_args):
                raise EPValueError("do_cpu_sync: refused inside capture (test)")

            monkeypatch.setattr(buf, "_check_capture", refuse)
        else:
            monkeypatch.setattr(rank.stream, "synchronize", lambda timeout=None: False)
        with pytest.raises(Exception) as err:
            buf.dispatch(x, **kw)
        outcomes[lane] = (type(err.value), str(err.value), rank.launch_step - before)
    assert served[0] + sync_served[0] == 1  # the lane's second call; the refused one raised
    assert outcomes[True] == outcomes[False]
    assert outcomes[True][2] == 1  # given up (kernel) or launched (timeout): one step either way
    if failure == "timeout":
        from ep_core.errors import EPTimeoutError

        assert outcomes[True][0] is EPTimeoutError


def test_lane_off_by_knob(mocked):
    make, _launches, served, _by = mocked
    buf = make(False)
    x = torch.ones(8, HIDDEN, dtype=torch.bfloat16)
    idx = torch.arange(16, dtype=torch.int64).reshape(8, 2) % EXPERTS
    for _ in range(3):
        buf.dispatch(x, topk_idx=idx, num_experts=EXPERTS, num_sms=4, do_cpu_sync=False)
    assert buf._lanes.get("dispatch") is None and served[0] == 0


@pytest.mark.parametrize("weights", [True, False])
def test_combine_and_cached_lanes_launch_what_the_ordinary_road_launches(mocked, weights):
    """A training step's pattern: dispatch, combine of its new handle, cached dispatch of that handle; the lanes
    serve the repeats of all three and launch the same words as the ordinary road."""
    make, launches, _served, served_by = mocked
    g = torch.Generator().manual_seed(7)
    calls = []
    for _ in range(4):
        x = torch.randn(8, HIDDEN, generator=g).to(torch.bfloat16)
        idx = torch.rand(8, EXPERTS, generator=g).topk(K, dim=1).indices
        w = torch.rand(8, K, generator=g) if weights else None
        calls.append((x, idx, w))
    seen = {}
    for lane in (False, True):
        buf = make(lane)
        for kind in served_by:
            served_by[kind] = 0
        per_call = []
        for x, idx, w in calls:
            launches.clear()
            out = buf.dispatch(
                x, topk_idx=idx, topk_weights=w, num_experts=EXPERTS, num_sms=4, do_cpu_sync=False
            )
            names = _pointer_names(x, idx, w, out)
            recv = torch.randn(out[3].num_recv_tokens, HIDDEN, generator=g).to(torch.bfloat16)
            rw = out[2]
            names[recv.data_ptr()] = "recv"
            comb, comb_w, ev = buf.combine(recv, out[3], topk_weights=rw, num_sms=4)
            assert ev.event is None and comb.shape == (8, HIDDEN) and (comb_w is None) == (rw is None)
            names[comb.data_ptr()] = "combined"
            if comb_w is not None:
                names[comb_w.data_ptr()] = "combined_w"
            again = buf.dispatch(x, handle=out[3], num_sms=4)
            assert again[3] is out[3] and again[0].shape == out[0].shape
            names[again[0].data_ptr()] = "cached recv_x"
            for a, tag in ((again[1], "cached recv_idx"), (again[2], "cached recv_w")):
                if a is not None:
                    names[a.data_ptr()] = tag
            per_call.append(_named_launches(launches, names))
        seen[lane] = per_call
        want = (
            {"dispatch": 3, "cached": 3, "combine": 3} if lane else {"dispatch": 0, "cached": 0, "combine": 0}
        )
        assert served_by == want
    assert seen[True] == seen[False]


def test_handle_lanes_check_the_handle(mocked, monkeypatch):
    """A handle of other shapes takes the ordinary road; a handle whose array was replaced by a wrong one meets
    validation's error on the lane, named as without it."""
    from ep_core.errors import EPValueError

    make, _launches, _served, served_by = mocked
    buf = make(True)
    x = torch.ones(8, HIDDEN, dtype=torch.bfloat16)
    idx = torch.arange(16, dtype=torch.int64).reshape(8, 2) % EXPERTS
    kw = dict(topk_idx=idx, num_experts=EXPERTS, num_sms=4, do_cpu_sync=False)
    h = buf.dispatch(x, **kw)[3]
    recv = torch.ones(h.num_recv_tokens, HIDDEN, dtype=torch.bfloat16)
    buf.combine(recv, h, num_sms=4)
    buf.dispatch(x, handle=h, num_sms=4)
    h2 = buf.dispatch(x, **kw)[3]
    buf.combine(recv, h2, num_sms=4)
    buf.dispatch(x, handle=h2, num_sms=4)
    assert served_by == {"dispatch": 1, "cached": 1, "combine": 1}
    h2.psum_num_recv_tokens_per_expert = torch.zeros(3, dtype=torch.int32)
    for call in (lambda: buf.combine(recv, h2, num_sms=4), lambda: buf.dispatch(x, handle=h2, num_sms=4)):
        with pytest.raises(EPValueError, match="psum_num_recv_tokens_per_expert"):
            call()
    small = buf.dispatch(x[:4].clone(), **dict(kw, topk_idx=idx[:4].clone()))[3]  # another handle key
    buf.combine(torch.ones(small.num_recv_tokens, HIDDEN, dtype=torch.bfloat16), small, num_sms=4)
    assert served_by == {"dispatch": 1, "cached": 1, "combine": 1}


@pytest.fixture
def sync_served(monkeypatch):
    """The CPU-sync dispatches the sync lane served (a kept CPU-sync `DispatchPlan`)."""
    from ep_core.kernels import op_plan

    served = [0]
    call = op_plan.DispatchPlan.__call__

    def counted(self, *args):
        got = call(self, *args)
        served[0] += got is not None and self.cpu_sync
        return got

    monkeypatch.setattr(op_plan.DispatchPlan, "__call__", counted)
    return served


@pytest.mark.parametrize(
    ("cpu_sync", "weights", "idx_dtype"),
    [(True, True, torch.int64), (None, True, torch.int64), (True, False, torch.int32)],
)
def test_sync_lane_launches_what_the_ordinary_road_launches(
    mocked, sync_served, cpu_sync, weights, idx_dtype
):
    """A repeated CPU-sync dispatch (`do_cpu_sync=True`, or the default None) takes the sync lane: the same
    launches, the same counts in the handle, the handle confirmed (drained) and trusted."""
    from ep_core import validation

    make, launches, _served, _by = mocked
    g = torch.Generator().manual_seed(11)
    calls = []
    for _ in range(4):
        x = torch.randn(8, HIDDEN, generator=g).to(torch.bfloat16)
        idx = torch.rand(8, EXPERTS, generator=g).topk(K, dim=1).indices.to(idx_dtype)
        w = torch.rand(8, K, generator=g) if weights else None
        calls.append((x, idx, w))
    seen = {}
    for lane in (False, True):
        buf = make(lane)
        sync_served[0] = 0
        per_call = []
        for x, idx, w in calls:
            launches.clear()
            kw = dict(topk_weights=w, num_experts=EXPERTS, num_sms=4)
            if cpu_sync is not None:
                kw["do_cpu_sync"] = cpu_sync
            out = buf.dispatch(x, topk_idx=idx, **kw)
            names = _pointer_names(x, idx, w, out)
            recv_x, recv_idx, recv_w, handle, event = out
            rank = buf.runtime.executor.rank
            assert event.event is None and handle not in rank._unconfirmed
            assert recv_x.shape == (handle.num_recv_tokens, HIDDEN) and recv_x.dtype == torch.bfloat16
            assert recv_idx.shape == (handle.num_recv_tokens, K) and recv_idx.dtype == torch.int64
            assert (recv_w is None) == (w is None)
            assert handle.recv_src_metadata.shape == (handle.num_recv_tokens, K + 2)
            assert handle.topk_idx is not idx and handle.topk_idx.dtype == idx.dtype
            rt = buf.runtime
            fp = validation.handle_fingerprint(rt.config, rt.executor, handle)
            assert validation._fingerprint_matches(validation._validated_handles[handle], fp)
            per_call.append((_named_launches(launches, names), _handle_fields(handle)))
            # its combine and cached dispatch take their lanes as after a no-sync dispatch
            recv = torch.ones(handle.num_recv_tokens, HIDDEN, dtype=torch.bfloat16)
            assert buf.combine(recv, handle, num_sms=4)[0].shape == (8, HIDDEN)
        seen[lane] = per_call
        assert sync_served[0] == (3 if lane else 0)
        assert (buf._lanes.get("dispatch_sync") is not None) == lane and buf._lanes.get("dispatch") is None
    assert seen[True] == seen[False]
    assert seen[True][0][1]["num_recv_tokens_per_expert_list"]  # the counts the CPU sync read


def test_sync_lane_keys_on_the_do_cpu_sync_object(mocked, sync_served):
    """`do_cpu_sync=True` after a call with the default None (or the reverse) is another entry, as is a no-sync
    call: each takes the ordinary road once and makes its own lane."""
    make, _launches, served, _by = mocked
    buf = make(True)
    x = torch.ones(8, HIDDEN, dtype=torch.bfloat16)
    idx = torch.arange(16, dtype=torch.int64).reshape(8, 2) % EXPERTS
    kw = dict(topk_idx=idx, num_experts=EXPERTS, num_sms=4)
    buf.dispatch(x, **kw)
    buf.dispatch(x, **kw)
    assert sync_served[0] == 1
    buf.dispatch(x, **kw, do_cpu_sync=True)  # another object: the ordinary road, then its lane
    assert sync_served[0] == 1
    buf.dispatch(x, **kw, do_cpu_sync=True)
    assert sync_served[0] == 2
    buf.dispatch(x, **kw, do_cpu_sync=False)
    buf.dispatch(x, **kw, do_cpu_sync=False)
    assert sync_served[0] == 2 and served[0] == 1  # the no-sync lane, not the sync one
    buf.dispatch(x[:4].clone(), **dict(kw, topk_idx=idx[:4].clone(), do_cpu_sync=True))  # other shapes
    assert sync_served[0] == 2


@pytest.mark.parametrize(
    ("cpu_sync", "expand", "zero_padding", "alignment", "fp8", "col_major"),
    [
        # FP8 in the plain layout, row-major and TMA-aligned column-major received scales
        (False, False, False, 1, True, False),
        (True, False, False, 1, True, False),
        (False, False, False, 1, True, True),
        (True, False, False, 1, True, True),
        # the expanded layout, expert alignment, zero padding (FP8: column-major, as DeepGEMM reads it)
        (False, True, False, 1, False, False),
        (True, True, False, 4, False, False),
        (False, True, True, 4, False, False),
        (True, True, True, 2, False, False),
        (False, False, False, 4, False, False),
        (True, False, False, 4, False, False),
        (True, True, False, 4, True, True),
        (False, True, True, 2, True, True),
    ],
)
def test_dispatch_layouts_launch_what_the_ordinary_road_launches(
    mocked, sync_served, cpu_sync, expand, zero_padding, alignment, fp8, col_major
):
    """FP8 (`x = (data, scales)`), the expanded layout (`do_expand`), zero padding and expert alignment through
    the dispatch lanes, no-sync and CPU-sync: the ordinary road's words and layouts."""
    make, launches, served, _by = mocked
    g = torch.Generator().manual_seed(17)
    packs = 3
    calls = []
    for _ in range(4):
        data = torch.randn(8, HIDDEN, generator=g)
        x = (
            (data.to(torch.float8_e4m3fn), torch.rand(8, packs, generator=g))
            if fp8
            else data.to(torch.bfloat16)
        )
        idx = torch.rand(8, EXPERTS, generator=g).topk(K, dim=1).indices
        calls.append((x, idx, torch.rand(8, K, generator=g)))
    seen = {}
    for lane in (False, True):
        buf = make(lane)
        served[0] = sync_served[0] = 0
        per_call = []
        for x, idx, w in calls:
            launches.clear()
            out = buf.dispatch(
                x,
                topk_idx=idx,
                topk_weights=w,
                num_experts=EXPERTS,
                expert_alignment=alignment,
                num_sms=4,
                do_cpu_sync=cpu_sync,
                do_expand=expand,
                do_zero_padding=zero_padding,
                use_tma_aligned_col_major_sf=col_major,
            )
            recv_x, recv_idx, recv_w, handle, _ = out
            data = recv_x[0] if fp8 else recv_x
            rows = handle.num_expanded_tokens if expand else handle.num_recv_tokens
            assert data.shape == (rows, HIDDEN) and (recv_idx is None) == expand
            assert recv_w.shape == ((rows,) if expand else (rows, K))
            names = _pointer_names(x[0] if fp8 else x, idx, w, (data, recv_idx, recv_w, handle, None))
            if fp8:
                recv_sf = recv_x[1]
                assert data.dtype == torch.float8_e4m3fn
                assert recv_sf.dtype == torch.float32 and recv_sf.shape == (rows, packs)
                if col_major:
                    assert recv_sf.stride() == (1, (max(rows, 1) + 3) // 4 * 4)
                else:
                    assert recv_sf.stride() == (packs, 1)
                names.setdefault(x[1].data_ptr(), "x_sf")
                if recv_sf.numel():
                    names.setdefault(recv_sf.data_ptr(), "recv_sf")
            layout = (tuple(data.shape), None if recv_w is None else tuple(recv_w.shape))
            per_call.append((_named_launches(launches, names), layout))
        seen[lane] = per_call
        assert (sync_served if cpu_sync else served)[0] == (3 if lane else 0)
    assert seen[True] == seen[False]


def test_an_equal_int_computed_anew_is_served(mocked, sync_served):
    """A count computed anew on each call (an int above CPython's small-int cache: another object each time) is the
    same key: the lanes serve it, and an equal value of another type still takes the ordinary road."""
    make, _launches, served, _by = mocked
    buf = make(True)
    x = torch.ones(8, HIDDEN, dtype=torch.bfloat16)
    idx = torch.arange(16, dtype=torch.int64).reshape(8, 2) % EXPERTS

    def align():  # 1000, a new object on each call
        return int("1000")

    assert align() is not align()
    for sync in (False, True):
        for _ in range(3):
            buf.dispatch(
                x, topk_idx=idx, num_experts=EXPERTS, expert_alignment=align(), num_sms=4, do_cpu_sync=sync
            )
    assert served[0] == 2 and sync_served[0] == 2
    with pytest.raises(Exception, match="expert_alignment"):
        buf.dispatch(
            x, topk_idx=idx, num_experts=EXPERTS, expert_alignment=1000.0, num_sms=4, do_cpu_sync=True
        )
    assert sync_served[0] == 2


def _at(arr) -> torch.Tensor:
    """A CPU bf16 tensor at the address of `arr` (the mocked executor's memory, which nothing reads)."""
    import bench_host_torch

    return bench_host_torch.host_tensor_at(torch, arr, torch.bfloat16)


def test_zero_copy_combine_lane_launches_what_its_road_launches(mocked):
    """`combine(..., zero_copy=True)` of the buffer's combine buffer: the repeats take the zero-copy combine's own
    lane (ep-core's express combine over the zero-copy repeat) and launch the same words as its road; an `x` that
    is not the combine buffer is declined by the lane and refused by the road, naming x and the combine buffer."""
    from ep_core.errors import EPValueError

    make, launches, _served, served_by = mocked
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, HIDDEN, generator=g).to(torch.bfloat16)
    idx = torch.rand(8, EXPERTS, generator=g).topk(K, dim=1).indices
    seen = {}
    for lane in (False, True):
        buf = make(lane)
        served_by["combine"] = 0
        handle = buf.dispatch(x, topk_idx=idx, num_experts=EXPERTS, num_sms=4, do_cpu_sync=False)[3]
        per_call = []
        for _ in range(4):
            launches.clear()
            zx = _at(buf.runtime.combine_buffer(handle))
            names = _pointer_names(x, idx, None, (None, None, None, handle, None))
            names[zx.data_ptr()] = "combine buffer"
            comb, comb_w, ev = buf.combine(zx, handle, num_sms=4, zero_copy=True)
            assert ev.event is None and comb.shape == (8, HIDDEN) and comb_w is None
            names[comb.data_ptr()] = "combined"
            per_call.append(_named_launches(launches, names))
        seen[lane] = per_call
        assert served_by["combine"] == (3 if lane else 0)
        assert (buf._lanes.get("combine_zero_copy") is not None) == lane
        other = torch.zeros(zx.shape, dtype=torch.bfloat16)
        with pytest.raises(EPValueError, match="x: a zero-copy combine reads rank 0's combine buffer"):
            buf.combine(other, handle, num_sms=4, zero_copy=True)
        assert served_by["combine"] == (3 if lane else 0)
    assert seen[True] == seen[False]


@pytest.mark.parametrize("weights", [True, False])
def test_zero_copy_dispatch_lane_launches_what_its_road_launches(mocked, monkeypatch, weights):
    """`dispatch(..., zero_copy=True, do_cpu_sync=False)`: the repeats take the zero-copy dispatch's own lane
    (a kept zero-copy `DispatchPlan`: one launch, the outputs the region's views) and launch the same words as its road
    (the handle's metadata among them), returning the same views and an equal handle."""
    from ep_core.kernels import op_plan
    from ep_torch import buffer as tbuf

    make, launches, _served, _by = mocked
    import bench_host_torch

    # ZeroCopyTensors making its tensors on the host at the views' addresses (the mocked memory; it needs CUDA)
    monkeypatch.setattr(
        tbuf, "ZeroCopyTensors", bench_host_torch._host_zero_copy_tensors(torch, tbuf.ZeroCopyTensors)
    )
    served = [0]
    call = op_plan.DispatchPlan.__call__

    def counted(self, *args):
        got = call(self, *args)
        served[0] += got is not None and self.zero_copy
        return got

    monkeypatch.setattr(op_plan.DispatchPlan, "__call__", counted)
    g = torch.Generator().manual_seed(11)
    calls = []
    for _ in range(4):
        x = torch.randn(8, HIDDEN, generator=g).to(torch.bfloat16)
        idx = torch.rand(8, EXPERTS, generator=g).topk(K, dim=1).indices
        w = torch.rand(8, K, generator=g) if weights else None
        calls.append((x, idx, w))
    seen = {}
    for lane in (False, True):
        buf = make(lane)
        served[0] = 0
        per_call = []
        for x, idx, w in calls:
            launches.clear()
            out = buf.dispatch(
                x,
                topk_idx=idx,
                topk_weights=w,
                num_experts=EXPERTS,
                num_sms=4,
                do_cpu_sync=False,
                zero_copy=True,
            )
            recv_x, recv_idx, recv_w, handle, event = out
            assert event.event is None and recv_x.dtype == torch.bfloat16 and recv_idx.dtype == torch.int64
            assert recv_x.shape == (handle.num_recv_tokens, HIDDEN) and (recv_w is None) == (w is None)
            # the handle's own routing copy (which the kernel fills)
            assert handle.topk_idx is not idx and handle.topk_idx.shape == idx.shape
            names = _pointer_names(x, idx, w, out)
            per_call.append((_named_launches(launches, names), _handle_fields(handle)))
        seen[lane] = per_call
        assert served[0] == (3 if lane else 0)  # the first call makes the entry; the lane serves the others
        assert (buf._lanes.get("dispatch_zero_copy") is not None) == lane
    assert [launch[0][0] for launch, _ in seen[True]] == ["ep_dispatch_zero_copy_impl"] * 4
    assert "recv_src_metadata" in seen[True][-1][0][0][1]  # the kernel writes the handle's metadata
    assert seen[True] == seen[False]


def _road(fn) -> list[str]:
    """The ep_core / ep_torch modules `fn()` enters, in order (an entry: a call from another module; the fixture's
    counting wrappers and launch recorder are not the road), with "LAUNCH" at each native launch (the mocked
    `ep_launch.Launch`)."""
    seq: list[str] = []

    def prof(frame, event, _arg):
        if event != "call":
            return
        mod = frame.f_globals.get("__name__", "")
        if mod == "bench_host_cpu" and frame.f_code.co_qualname == "_FakeNative.Launch.__call__":
            seq.append("LAUNCH")
        elif mod.startswith(("ep_core", "ep_torch")):
            back = frame.f_back
            if back is not None and back.f_code.co_name in ("recorded", "recorded_launch"):
                return  # the fixture's launch recorder (it reads the patched words), not the road
            if back is not None and back.f_code.co_name in ("counted", "counted_combine"):
                back = back.f_back  # the fixture's counting wrappers of a plan's call: their caller's call
            if back is None or back.f_globals.get("__name__", "") != mod:
                seq.append(mod)

    import gc

    gc.collect()  # an earlier test's buffer collected inside the call (its `__del__`) is not the road
    gc.disable()
    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
        gc.enable()
    return seq


def _repeat_ops(buf):
    """The calls whose repeats the road tests follow: no-sync, CPU-sync and cached dispatch, and combine."""
    x = torch.ones(8, HIDDEN, dtype=torch.bfloat16)
    idx = torch.arange(16, dtype=torch.int64).reshape(8, 2) % EXPERTS
    kw = dict(topk_idx=idx, num_experts=EXPERTS, num_sms=4)
    h = buf.dispatch(x, do_cpu_sync=False, **kw)[3]
    recv = torch.ones(h.num_recv_tokens, HIDDEN, dtype=torch.bfloat16)
    ops = {
        "no-sync dispatch": lambda: buf.dispatch(x, do_cpu_sync=False, **kw),
        "CPU-sync dispatch": lambda: buf.dispatch(x, do_cpu_sync=True, **kw),
        "cached dispatch": lambda: buf.dispatch(x, handle=h, num_sms=4),
        "combine": lambda: buf.combine(recv, h, num_sms=4),
    }
    return ops


def test_a_kept_plans_call_crosses_at_most_four_modules_to_its_launch(mocked):
    """Issue 45's target for a repeated call through a kept plan (no-sync, CPU-sync and cached dispatch, combine):
    at most four modules from `ElasticBuffer.dispatch` / `combine` to the first launch, and no module entered twice
    in the whole call (`ep_torch.dispatch_combine` -> `ep_core.kernels.op_plan` -> at most two more)."""
    make, _launches, _served, served_by = mocked
    buf = make(True)
    ops = _repeat_ops(buf)
    for name, op in ops.items():
        for _ in range(3):  # the full path, the ordinary repeat that keeps the plan, a kept-plan call
            op()
        before = sum(served_by.values())
        road = _road(op)
        assert sum(served_by.values()) + ("CPU-sync" in name) > before, name  # the kept plan served it
        entered = [m for m in road if m != "LAUNCH"]
        assert "LAUNCH" in road, (name, road)
        to_launch = road[: road.index("LAUNCH")]
        assert to_launch[:2] == ["ep_torch.dispatch_combine", "ep_core.kernels.op_plan"], (name, road)
        assert len(set(to_launch)) <= 4, (name, road)
        assert len(entered) == len(set(entered)), (name, road)


def test_a_caller_alternating_between_shapes_is_served_by_the_plan_of_each(mocked):
    """Issue 45: a repeated call whose kind last kept another shape's plan (two token counts and an FP8 `x` taking
    turns, and the combine of each one's handle) is served by its own plan, kept beside the last one
    (`EPBuffer.keep_lane`'s siblings), on the kept-plan road (at most four modules to the launch, none entered twice
    in the whole call), and launches what the ordinary road launches, with handles of the same fields."""
    make, launches, _served, served_by = mocked
    packs = 3
    seen = {}
    for lane in (False, True):
        buf = make(lane)
        g = torch.Generator().manual_seed(11)  # the same calls on both roads
        per_call = []
        for step in range(3):
            for tokens, fp8 in ((8, False), (5, False), (8, True)):
                data = torch.randn(tokens, HIDDEN, generator=g)
                x = (
                    (data.to(torch.float8_e4m3fn), torch.rand(tokens, packs, generator=g))
                    if fp8
                    else data.to(torch.bfloat16)
                )
                idx = torch.rand(tokens, EXPERTS, generator=g).topk(K, dim=1).indices
                w = torch.rand(tokens, K, generator=g)
                got: list = []  # (the lambdas run at once, in this iteration)
                kw = dict(topk_idx=idx, topk_weights=w, num_experts=EXPERTS, num_sms=4, do_cpu_sync=False)
                for op in ("dispatch", "combine"):
                    launches.clear()
                    before = sum(served_by.values())
                    if op == "dispatch":
                        road = _road(lambda kw=kw: got.append(buf.dispatch(x, **kw)))  # noqa: B023
                        out = got[-1]
                        recv_x = out[0][0] if fp8 else out[0]
                        names = _pointer_names(x[0] if fp8 else x, idx, w, (recv_x, *out[1:]))
                        if fp8:
                            names.update({x[1].data_ptr(): "x_sf", out[0][1].data_ptr(): "recv_sf"})
                        per_call.append((_named_launches(launches, names), _handle_fields(out[3])))
                    else:
                        recv = torch.randn(out[3].num_recv_tokens, HIDDEN, generator=g).to(torch.bfloat16)
                        road = _road(lambda recv=recv: got.append(buf.combine(recv, out[3], num_sms=4)))  # noqa: B023
                        names[recv.data_ptr()] = "x"
                        names[got[-1][0].data_ptr()] = "combined"
                        per_call.append((_named_launches(launches, names), None))
                    if not lane or (step == 0 and (op == "dispatch" or not fp8)):
                        # (the FP8 dispatch's handle has the layout of the first one's: its combine's plan)
                        assert sum(served_by.values()) == before, (lane, step, tokens, fp8, op)
                        continue
                    assert sum(served_by.values()) > before, (step, tokens, fp8, op)  # a kept plan served it
                    if step == 1:
                        continue  # (a plan's first call reads its handles' fingerprint by value)
                    to_launch = road[: road.index("LAUNCH")]
                    entered = [m for m in road if m != "LAUNCH"]
                    assert to_launch[:2] == ["ep_torch.dispatch_combine", "ep_core.kernels.op_plan"], road
                    assert len(set(to_launch)) <= 4 and len(entered) == len(set(entered)), road
        seen[lane] = per_call
    assert seen[True] == seen[False]


def test_an_async_repeat_is_served_and_returns_the_ordinary_roads_event(mocked):
    """`async_with_compute_stream=True` is one of a kept plan's scalars, not a road of its own: the repeats of an
    async dispatch, of the cached dispatch of its handle and of its combine are served by their plans, launch what
    the ordinary road launches and return its event (on CPU tensors a completed `EventHandle`)."""
    make, launches, _served, served_by = mocked
    seen = {}
    for lane in (False, True):
        buf = make(lane)
        g = torch.Generator().manual_seed(5)  # the same calls on both roads
        per_call = []
        for step in range(3):
            x = torch.randn(8, HIDDEN, generator=g).to(torch.bfloat16)
            idx = torch.rand(8, EXPERTS, generator=g).topk(K, dim=1).indices
            w = torch.rand(8, K, generator=g)
            launches.clear()
            before = dict(served_by)
            out = buf.dispatch(
                x,
                topk_idx=idx,
                topk_weights=w,
                num_experts=EXPERTS,
                num_sms=4,
                do_cpu_sync=False,
                async_with_compute_stream=True,
            )
            names = _pointer_names(x, idx, w, out)
            cached = buf.dispatch(x, topk_weights=w, handle=out[3], num_sms=4, async_with_compute_stream=True)
            names.update(zip([a.data_ptr() for a in cached[:3]], ("cached_x", "cached_idx", "cached_w")))
            recv = torch.randn(out[3].num_recv_tokens, HIDDEN, generator=g).to(torch.bfloat16)
            combined = buf.combine(recv, out[3], num_sms=4, async_with_compute_stream=True)
            names.update({recv.data_ptr(): "combine_x", combined[0].data_ptr(): "combined"})
            events = [type(r[-1].event).__name__ for r in (out, cached, combined)]
            per_call.append((_named_launches(launches, names), _handle_fields(out[3]), events))
            assert events == ["EventHandle"] * 3
            for kind in served_by:  # the first call of each makes its plan; its repeats take it
                assert served_by[kind] == before[kind] + (lane and step > 0), (lane, step, kind)
        seen[lane] = per_call
    assert seen[True] == seen[False]


def test_an_ordinary_repeat_goes_from_its_prepared_entry_straight_to_the_plans_run(mocked):
    """Issue 45, the ordinary road (no kept plan: the lane off): a repeated call's prepared hit goes from the
    executor straight to the plan's `run()` (no stream-pair or pointer helper calls into `op_plan` first); on the way
    to the first launch `ep_core.prepared`, the executor and `op_plan` are each entered once, validation not at all
    for a call without a handle, and the whole road to the launch crosses at most eight modules (ep_torch's
    allocator and `array_block`'s carve, called back from the run, are two of them; `device_array.describe` reads
    the arrays, `buffer_base.destroyed` the buffer's state). Issue 45's target of four is not met here yet: five
    (`device_array` stands between the call and its plan, which this road keys by the described arrays)."""
    make, _launches, _served, served_by = mocked
    buf = make(False)
    ops = _repeat_ops(buf)
    for name, op in ops.items():
        for _ in range(2):  # the full path, the repeat that records the plan
            op()
        road = _road(op)
        assert sum(served_by.values()) == 0, name  # no kept plan served it
        assert "LAUNCH" in road, (name, road)
        to_launch = road[: road.index("LAUNCH")]
        for mod in ("ep_core.prepared", "ep_core.kernels.op_plan"):
            assert to_launch.count(mod) == 1, (name, mod, road)
        assert to_launch.count("ep_core.kernels.gpu_executor") <= 2, (
            name,
            road,
        )  # `launch_step`, the run's call
        if "cached" not in name and name != "combine":
            assert "ep_core.validation" not in to_launch, (name, road)
        assert "ep_core.kernels.rank_driver" not in to_launch, (name, road)
        assert len(set(to_launch)) <= 8, (name, road)
        # session 4: seven modules at most, none entered twice, and no call back into ep_torch (the allocator's
        # `batch` makes the plan's outputs, routing copy and block in one C call); ep_core.buffer once (it
        # announces the call), the executor once (the launch counter is a field)
        assert len(set(to_launch)) <= 7 and len(to_launch) == len(set(to_launch)), (name, road)
        assert to_launch[0] == "ep_torch.dispatch_combine", (name, road)
        # issue 45: `EPBuffer`'s road is `ep_core.prepared.Operations` (its base class), so `ep_core.buffer` is not
        # entered: dispatch_combine -> prepared -> device_array (the arrays' descriptions) -> op_plan, and
        # array_block (a new handle's block) or validation (a handle's check), five modules
        assert to_launch[1] == "ep_core.prepared" and "ep_core.buffer" not in road, (name, road)
        assert len(set(to_launch)) <= 5, (name, road)


def test_an_ordinary_repeat_launches_what_its_full_path_launched(mocked):
    """The ordinary road's repeat (the plan's run, its allocations from the allocator's `batch`) launches the
    kernels of its first call (the full path) with every output and handle pointer in the same word and makes a
    handle of the same fields: a no-sync dispatch, a cached dispatch of its handle, its combine. (The mocked
    kernels write no counts: a CPU-sync dispatch's handle reads whatever its block held.)"""
    make, launches, _served, served_by = mocked
    buf = make(False)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, HIDDEN, generator=g).to(torch.bfloat16)
    idx = torch.rand(8, EXPERTS, generator=g).topk(K, dim=1).indices
    w = torch.rand(8, K, generator=g)
    h = None

    def named(out, names: dict) -> tuple:
        words = [(k, [v for v in _named(ws, names) if isinstance(v, str)]) for k, ws in launches]
        return words, None if out is None else _handle_fields(out[3])

    for op in ("dispatch", "cached", "combine"):
        seen = []
        for _ in range(3):  # the full path, the repeat that records the plan, a repeat
            launches.clear()
            if op == "dispatch":
                out = buf.dispatch(
                    x, topk_idx=idx, topk_weights=w, num_experts=EXPERTS, num_sms=4, do_cpu_sync=False
                )
                seen.append(named(out, _pointer_names(x, idx, w, out)))
                h = out[3]
            elif op == "cached":
                out = buf.dispatch(x, topk_weights=w, handle=h, num_sms=4)
                seen.append(named(out, _pointer_names(x, None, w, out)))
            else:
                recv = torch.ones(h.num_recv_tokens, HIDDEN, dtype=torch.bfloat16)
                combined = buf.combine(recv, h, num_sms=4)[0]
                seen.append(named(None, {recv.data_ptr(): "x", combined.data_ptr(): "combined"}))
        assert seen[0] == seen[1] == seen[2], (op, seen)
        assert "recv_x" in seen[0][0][-1][1] if op != "combine" else seen[0][0][0][1] == ["x", "combined"], (
            seen
        )
    assert sum(served_by.values()) == 0


@pytest.mark.parametrize(
    ("dispatch_kw", "scope"),
    [
        ({}, dict(previous_event=True, allocate_on_comm_stream=True)),
        (dict(cumulative_local_expert_recv_stats=True), {}),
        ({}, dict(allocate_on_comm_stream=True)),
        ({}, dict(previous_event=True, allocate_on_comm_stream=True, async_with_compute_stream=True)),
        ({}, dict(async_with_compute_stream=True)),
        (dict(do_handle_copy=False), {}),
        (
            dict(do_handle_copy=False),
            dict(previous_event=True, allocate_on_comm_stream=True, async_with_compute_stream=True),
        ),
    ],
    ids=[
        "previous_event",
        "stats",
        "comm_stream",
        "overlap",
        "async",
        "no_handle_copy",
        "no_handle_copy_overlap",
    ],
)
def test_an_overlapped_repeat_is_served_by_its_plan(mocked, dispatch_kw, scope):
    """Issue 45 (road7): a comm-stream scope (`previous_event`, `allocate_on_comm_stream`: DeepEP's overlap pattern,
    which Megatron's V1 calls pass every layer) and `do_handle_copy=False` (DeepEP 2.5's `EPBuffer` default) are
    not roads of their own: the repeats of a no-sync, a CPU-sync and a cached dispatch and of a combine with them are
    served by their kept plans, cross three modules to the launch and enter none twice in the whole call (an async
    call's event module once), launch what the ordinary road launches and make handles of the same fields (without a
    copy, the caller's routing itself)."""
    make, launches, _served, _by = mocked
    seen = {}
    for lane in (False, True):
        buf = make(lane)
        g = torch.Generator().manual_seed(17)  # the same calls on both roads
        per_call = []
        for step in range(4):
            x = torch.randn(8, HIDDEN, generator=g).to(torch.bfloat16)
            idx = torch.rand(8, EXPERTS, generator=g).topk(K, dim=1).indices
            w = torch.rand(8, K, generator=g)
            recv = torch.randn(8 * K, HIDDEN, generator=g).to(torch.bfloat16)
            kw = dict(scope)
            if kw.get("previous_event"):
                kw["previous_event"] = buf.capture()
            routed = dict(topk_idx=idx, topk_weights=w, num_experts=EXPERTS, num_sms=4, **dispatch_kw, **kw)
            stats = routed.pop("cumulative_local_expert_recv_stats", None)  # (not a cached dispatch's)
            if stats:  # a new tensor of the same layout on each call
                routed["cumulative_local_expert_recv_stats"] = stats = torch.zeros(EXPERTS, dtype=torch.int32)
            handle_kw = {k: v for k, v in dispatch_kw.items() if k != "cumulative_local_expert_recv_stats"}
            got: dict = {}

            def call(op, kw=kw, routed=routed, x=x, w=w, recv=recv, got=got):
                if op in ("dispatch", "sync"):
                    return buf.dispatch(x, do_cpu_sync=op == "sync", **routed)  # noqa: B023
                h = got["dispatch"][3]
                if op == "cached":
                    return buf.dispatch(x, topk_weights=w, handle=h, num_sms=4, **handle_kw, **kw)  # noqa: B023
                return buf.combine(recv[: h.num_recv_tokens], h, num_sms=4, **kw)  # noqa: B023

            for op in ("dispatch", "sync", "cached", "combine"):
                launches.clear()
                road = _road(lambda op=op, got=got, call=call: got.__setitem__(op, call(op)))
                out = got[op]
                assert (type(out[-1].event).__name__ == "EventHandle") == bool(
                    scope.get("async_with_compute_stream")
                )
                if op in ("dispatch", "sync"):
                    names = _pointer_names(x, idx, w, out)
                    if stats is not None:
                        names[stats.data_ptr()] = "stats"
                    assert (out[3].topk_idx is idx) == ("do_handle_copy" in dispatch_kw), op
                    per_call.append((op, _named_launches(launches, names), _handle_fields(out[3])))
                else:
                    names = _pointer_names(x, idx, w, got["dispatch"])
                    names[recv.data_ptr()] = "recv"
                    names.update(
                        {a.data_ptr(): f"out{i}" for i, a in enumerate(out[:3]) if torch.is_tensor(a)}
                    )
                    per_call.append((op, _named_launches(launches, names)))
                to_launch = road[: road.index("LAUNCH")] if "LAUNCH" in road else road  # (full path: none)
                kept = to_launch[:2] == ["ep_torch.dispatch_combine", "ep_core.kernels.op_plan"]
                assert kept == (lane and step > 0), (lane, step, op, road)  # the first call keeps its plan
                if kept and step > 1:  # (a plan's first call reads its handles' fingerprint by value)
                    entered = [m for m in road if m != "LAUNCH"]
                    assert len(set(to_launch)) <= 3 and len(entered) == len(set(entered)), (op, str(road))
        seen[lane] = per_call
    assert seen[True] == seen[False]


def test_v1_normal_mode_repeats_reach_the_kept_plan(mocked, monkeypatch):
    """V1's normal mode (`ep_torch.legacy.Buffer.dispatch` / `combine` with `previous_event`, `async_finish` and
    `allocate_on_comm_stream`, Megatron's per-layer call) waits for the event on the caller's stream and calls its
    inner `ElasticBuffer` without a scope: from the second call on, the inner call takes its kept plan (three modules
    from `ElasticBuffer.dispatch` / `combine` to the launch)."""
    import bench_host_cpu as b
    from ep_torch.legacy import buffer as lbuf

    monkeypatch.setattr(lbuf, "make_core_transport", lambda choice: b._CpuMockedTransport())
    buf = lbuf.Buffer(None, num_nvl_bytes=1 << 24)
    x = torch.ones(8, HIDDEN, dtype=torch.bfloat16)
    idx = torch.arange(16, dtype=torch.int64).reshape(8, 2) % EXPERTS
    w = torch.rand(8, K)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, EXPERTS)
    overlap = dict(async_finish=True, allocate_on_comm_stream=True)
    for step in range(3):
        got: list = []
        kw = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
        ev = buf.capture()
        road = _road(
            lambda ev=ev, kw=kw, got=got: got.append(
                buf.dispatch(x, **kw, topk_idx=idx, topk_weights=w, previous_event=ev, **overlap)
            )
        )
        recv = torch.ones_like(got[0][0])
        ev = buf.capture()
        combine_road = _road(
            lambda ev=ev, r=recv, h=got[0][4]: buf.combine(r, h, previous_event=ev, **overlap)
        )
        # (the combine of a CPU-sync handle: the mocked kernels write no counts, so its handle's layout is whatever
        # its block held and may be another plan's; its road is checked where its plan serves it)
        for r, op in ((road, "dispatch"), (combine_road, "combine")):
            to_launch = r[: r.index("LAUNCH")] if "LAUNCH" in r else r
            inner = to_launch[len(to_launch) - to_launch[::-1].index("ep_torch.dispatch_combine") - 1 :]
            kept = inner[:2] == ["ep_torch.dispatch_combine", "ep_core.kernels.op_plan"] and "LAUNCH" in r
            assert kept == (step > 0) or op == "combine", str(r)
            assert not kept or len(set(inner)) <= 3 or "ep_core.prepared" in inner, inner


def test_an_overlapped_call_the_ordinary_road_refuses_is_refused_alike(mocked):
    """With a kept plan of an overlapped dispatch and combine, a `previous_event` of another type and one without
    `allocate_on_comm_stream` (rule D15) meet the ordinary road's errors, as without the kept plan."""
    from ep_core.errors import EPError

    make, _launches, _served, _by = mocked
    seen = {}
    for lane in (False, True):
        buf = make(lane)
        x = torch.ones(8, HIDDEN, dtype=torch.bfloat16)
        idx = torch.arange(16, dtype=torch.int64).reshape(8, 2) % EXPERTS
        kw = dict(topk_idx=idx, num_experts=EXPERTS, num_sms=4, do_cpu_sync=False)
        ov = dict(previous_event=buf.capture(), allocate_on_comm_stream=True)
        for _ in range(3):
            h = buf.dispatch(x, **kw, **ov)[3]
            recv = torch.ones(h.num_recv_tokens, HIDDEN, dtype=torch.bfloat16)
            buf.combine(recv, h, num_sms=4, **ov)
        errors = []
        for bad in (dict(ov, previous_event=object()), dict(ov, allocate_on_comm_stream=False)):
            for op in ("dispatch", "combine"):
                with pytest.raises(EPError) as err:
                    if op == "dispatch":
                        buf.dispatch(x, **kw, **bad)
                    else:
                        buf.combine(recv, h, num_sms=4, **bad)
                errors.append((type(err.value), str(err.value)))
        seen[lane] = errors
        assert (buf._lanes.get("dispatch") is not None) == lane
    assert seen[True] == seen[False]
