"""The host fast paths of dispatch / combine are exact: each one against the slow path it replaces.

- `describe()` of a plain torch tensor (its own accessors) == the `__cuda_array_interface__` / DLPack result, for
  every dtype, shape and stride pattern, errors included (a GPU test covers the CUDA branch);
- `is_c_contiguous` == the reference rule on random shapes and strides;
- a validated handle is re-validated whenever a field, the buffer or the device changes;
- `plan_regions`, `launch_geometry`, `KernelConfig`'s derived sizes and the validation's capacity sizes are
  memoized pure functions: equal to a fresh computation, distinct per configuration, errors raised every time;
- `as_view`'s cached torch dtype lookup == the name/size mapping.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import ep_core as ec
import ep_layout
import numpy as np
import pytest
from ep_core import device_array, validation
from ep_core.device_array import _c_strides, describe, is_c_contiguous
from ep_core.errors import EPConfigError, EPTypeError, EPValueError
from ep_core.executor import CombineRequest, DispatchRequest
from ep_core.kernels import plan
from ep_core.kernels._cuda import DeviceView, as_view
from ep_core.kernels.plan import KernelConfig, launch_geometry, plan_regions

N, RANK, T, H, K, E, M = 2, 0, 4, 64, 2, 8, 8


# ------------------------------------------------------------------------------------------------------------
# describe: torch fast path == slow path


def _slow(t, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(device_array, "_from_torch", lambda obj: None)
        return _outcome(t)


def _outcome(t):
    try:
        info = describe(t, "arg")
    except Exception as exc:  # the same type and message either way
        return ("raised", type(exc), str(exc))
    assert info.obj is t
    return (info, info.ptr, info.shape, info.dtype, info.strides, info.device, info.device_id)


def _torch_cases(torch, device="cpu"):
    dtypes = [
        torch.bool,
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.uint16,
        torch.float16,
        torch.bfloat16,
        torch.int32,
        torch.uint32,
        torch.float32,
        torch.int64,
        torch.uint64,
        torch.float64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.complex64,
    ]
    for name in ("float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "bits16"):
        if hasattr(torch, name):
            dtypes.append(getattr(torch, name))

    def make(shape, dt):
        try:
            if dt == getattr(torch, "bits16", None):
                return torch.empty(shape, dtype=dt, device=device)
            return torch.zeros(shape, dtype=torch.float32, device=device).to(dt)
        except (RuntimeError, TypeError, NotImplementedError):  # a conversion this build lacks on this device
            return None

    shapes = [(), (0,), (1,), (7,), (0, 5), (5, 0), (1, 1), (3, 1), (1, 4), (4, 6), (2, 3, 4)]
    for dt in dtypes:
        base = make((6, 8), dt)
        if base is None:
            continue
        for shape in shapes:
            yield make(shape, dt)
        yield base[:, 2:5]  # non-contiguous, storage offset
        yield base[1:2]  # one row of a larger tensor
        yield base[:, 3:4]  # one column
        yield base.t()
        yield base[::2]
        yield base[:, :1].expand(6, 5)  # stride 0
        yield base[2:2]  # empty with an offset
    yield torch.empty_strided((0, 5), (0, 0), device=device)
    yield torch.empty_strided((1, 1), (7, 9), device=device)
    yield torch.empty_strided((3, 1), (1, 11), dtype=torch.bfloat16, device=device)
    yield torch.zeros(4, 3, 2, device=device).permute(2, 0, 1)
    yield torch.zeros(4, requires_grad=True, device=device)  # DLPack refuses: the same error
    yield torch.nn.Parameter(torch.zeros(2, 3, device=device))  # a subclass: the slow path
    yield torch.nn.Parameter(torch.zeros(2, 3, device=device), requires_grad=False)
    yield torch._neg_view(torch.zeros(3, device=device))  # negative bit: the slow path decides
    yield torch.zeros(2, 2, dtype=torch.complex64, device=device).conj()
    yield torch.zeros(3, 3, device=device).to_sparse()
    yield torch.zeros(2, 3, device="meta")
    yield torch.zeros(1, 3, 2, 2, device=device).to(memory_format=torch.channels_last)
    yield torch.zeros(2, 3, 2, 2, device=device).to(memory_format=torch.channels_last)
    with torch.inference_mode():
        yield torch.zeros(2, 8, dtype=torch.bfloat16, device=device)


def test_describe_torch_fast_path_equals_slow_path(monkeypatch):
    torch = pytest.importorskip("torch")
    n = 0
    for _ in range(2):  # the second round from the fast path's per-dtype layout cache
        for t in _torch_cases(torch):
            fast = _outcome(t)
            slow = _slow(t, monkeypatch)
            assert fast == slow, (t.dtype, tuple(t.shape), t.stride(), fast, slow)
            n += 1
    assert n > 400


def test_describe_torch_layout_cache_follows_each_tensors_strides():
    """Tensors of one dtype and shape, contiguous or not, alternating: each gets its own strides (the layout cache
    is keyed by sizes and strides, never by the shape alone), also after the tensor itself is re-strided in place."""
    torch = pytest.importorskip("torch")
    a = torch.zeros(4, 6)
    b = torch.zeros(6, 4).t()
    for _ in range(3):
        assert describe(a).strides == (24, 4) and describe(b).strides == (4, 16)
    a.as_strided_((4, 6), (1, 4))
    assert describe(a).strides == (4, 16) and not describe(a).is_contiguous
    a.resize_(2, 3)
    assert describe(a).shape == (2, 3) and describe(a).strides == (12, 4)


def test_describe_torch_fast_path_is_taken(monkeypatch):
    torch = pytest.importorskip("torch")
    seen = []
    real = device_array._from_torch
    monkeypatch.setattr(device_array, "_from_torch", lambda t: seen.append(t) or real(t))
    t = torch.zeros(4, 64, dtype=torch.bfloat16)
    assert describe(t).dtype == "bfloat16" and seen == [t]
    seen.clear()
    assert describe(np.zeros(3, np.float32)).dtype == "float32" and seen == []  # other types never probe it


def test_describe_torch_fast_path_validation_messages(monkeypatch):
    """check_array's errors for torch tensors are the same with and without the fast path."""
    torch = pytest.importorskip("torch")

    class Target:
        array_device = "cpu"
        device_id = 0

    cases = [
        (torch.zeros(4, 8, dtype=torch.float32), {"dtypes": ("bfloat16",), "ndim": 2}),
        (torch.zeros(4, 8, 1, dtype=torch.bfloat16), {"dtypes": ("bfloat16",), "ndim": 2}),
        (torch.zeros(8, 4, dtype=torch.bfloat16).t(), {"dtypes": ("bfloat16",), "ndim": 2}),
        (torch.zeros(3, 8, dtype=torch.int64), {"dtypes": ("int64",), "shape": (4, None)}),
        (torch.zeros(0, 8, dtype=torch.bfloat16), {"dtypes": ("bfloat16",), "ndim": 2}),
        (torch.zeros(4, 8, dtype=torch.float32)[:, :1], {"dtypes": ("float32",), "shape": (4, 1)}),
    ]

    def run(t, kw, target):
        try:
            return validation.check_array("arg", t, target, **kw)
        except (EPTypeError, EPValueError) as exc:
            return (type(exc), str(exc))

    class CudaTarget:
        array_device = "cuda"
        device_id = 0

    for t, kw in cases:
        for target in (Target(), CudaTarget()):
            fast = run(t, kw, target)
            with monkeypatch.context() as m:
                m.setattr(device_array, "_from_torch", lambda obj: None)
                slow = run(t, kw, target)
            assert fast == slow


@pytest.mark.gpu
def test_describe_torch_cuda_fast_path_equals_slow_path(monkeypatch):
    """The CUDA branch: __cuda_array_interface__ dtypes (no strides when contiguous, null pointer when empty) and
    DLPack dtypes (bf16, FP8)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    n = 0
    for t in _torch_cases(torch, "cuda"):
        fast = _outcome(t)
        slow = _slow(t, monkeypatch)
        assert fast == slow, (t.dtype, tuple(t.shape), t.stride(), fast, slow)
        n += bool(getattr(t, "is_cuda", False))
    assert n > 200


# ------------------------------------------------------------------------------------------------------------
# contiguity


def _reference_is_c_contiguous(shape, strides, itemsize):
    if 0 in shape:
        return True
    want = _c_strides(shape, itemsize)
    return all(s == w or d == 1 for s, w, d in zip(strides, want, shape))


def test_is_c_contiguous_matches_the_rule():
    rng = random.Random(7)
    for _ in range(20000):
        ndim = rng.randint(0, 4)
        shape = tuple(rng.choice([0, 1, 1, 2, 3, 5]) for _ in range(ndim))
        itemsize = rng.choice([1, 2, 4, 8])
        strides = list(_c_strides(shape, itemsize))
        for i in range(ndim):
            if rng.random() < 0.3:
                strides[i] = rng.choice([0, -itemsize, itemsize, 2 * itemsize, 7, strides[i] * 2])
        if rng.random() < 0.05:
            strides = strides[: max(ndim - 1, 0)]  # mismatched lengths keep the old zip semantics
        strides = tuple(strides)
        assert is_c_contiguous(shape, strides, itemsize) == _reference_is_c_contiguous(
            shape, strides, itemsize
        )


# ------------------------------------------------------------------------------------------------------------
# handle validation cache


class PairBootstrap:
    rank = RANK
    size = N

    def allgather(self, data: bytes) -> list[bytes]:
        return [data] * N

    def barrier(self) -> None:
        return None


class NullExecutor:
    array_device = "cpu"
    device_id = 0
    num_device_sms = 132
    nvlink_gbs = 450.0
    rdma_gbs = 50.0

    def dispatch(self, req):
        return req

    def combine(self, req):
        return req

    def barrier(self) -> None:
        return None

    def destroy(self) -> None:
        return None

    @staticmethod
    def default_allocator(shape, dtype):
        return ec.host_allocator(shape, dtype)


def _buffer(**kw):
    args = dict(
        transport="reference", num_max_tokens_per_rank=M, hidden=H, num_topk=K, executor=NullExecutor()
    )
    args.update(kw)
    return ec.EPBuffer(PairBootstrap(), **args)


def _handle(rows=T * 2, tokens=T):
    epr = E // N
    return ec.EPHandle(
        False,
        E,
        1,
        M,
        8,
        ec.host_array(np.zeros((tokens, K), np.int64)),
        rows,
        rows,
        [rows] * epr,
        ec.host_array(np.zeros(N, np.int32)),
        ec.host_array(np.zeros(epr, np.int32)),
        ec.host_array(np.zeros(epr, np.int32)),
        ec.host_array(np.zeros((rows, K + 2), np.int32)),
        ec.host_array(np.zeros((tokens, K), np.int32)),
        num_ranks=N,
        rank=RANK,
    )


def _bf16(shape):
    return ec.host_array(np.ones(shape, np.uint16), "bfloat16")


@pytest.fixture
def counted(monkeypatch):
    calls = []
    real = validation.check_array
    monkeypatch.setattr(
        validation, "check_array", lambda name, *a, **kw: calls.append(name) or real(name, *a, **kw)
    )
    return calls


def _expect(exc, fragment, fn):
    with pytest.raises(exc) as info:
        fn()
    assert fragment in str(info.value)
    return str(info.value)


def test_validated_handle_is_not_described_again(counted):
    buf = _buffer()
    h = _handle()
    buf.combine(_bf16((T * 2, H)), h)
    first = [c for c in counted if c.startswith("handle.")]
    assert len(first) == 6
    counted.clear()
    buf.combine(_bf16((T * 2, H)), h)
    buf.dispatch(_bf16((T, H)), handle=h)
    assert [c for c in counted if c.startswith("handle.")] == []
    assert "x" in counted  # the call's own arrays are always checked


@pytest.mark.parametrize(
    "field",
    [
        "topk_idx",
        "psum_num_recv_tokens_per_scaleup_rank",
        "psum_num_recv_tokens_per_expert",
        "num_unaligned_recv_tokens_per_expert",
        "recv_src_metadata",
        "dst_buffer_slot_idx",
    ],
)
def test_replaced_handle_field_is_validated_again(field, counted):
    buf = _buffer()
    h = _handle()
    buf.combine(_bf16((T * 2, H)), h)
    good = getattr(h, field)
    # a bad replacement: the same error as on a fresh handle
    bad = ec.host_array(np.zeros((3, 3, 3), np.float32))
    setattr(h, field, bad)
    msg = _expect((EPTypeError, EPValueError), f"handle.{field}", lambda: buf.combine(_bf16((T * 2, H)), h))
    fresh = _handle()
    setattr(fresh, field, bad)
    assert msg == _expect(
        (EPTypeError, EPValueError), f"handle.{field}", lambda: buf.combine(_bf16((T * 2, H)), fresh)
    )
    # still refused on every call (a failed validation is never remembered)
    _expect((EPTypeError, EPValueError), f"handle.{field}", lambda: buf.combine(_bf16((T * 2, H)), h))
    # a good replacement (another object): validated once more, then accepted
    setattr(h, field, ec.host_array(np.array(good.owner, copy=True), good.dtype))
    counted.clear()
    buf.combine(_bf16((T * 2, H)), h)
    assert f"handle.{field}" in counted


def test_handle_scalar_fields_buffer_and_device_are_in_the_fingerprint(counted):
    buf = _buffer()
    h = _handle()
    x = _bf16((T * 2, H))
    buf.combine(x, h)
    h.num_recv_tokens = T * 2 + 1  # metadata no longer has num_recv_tokens rows
    _expect(
        EPValueError,
        "handle.recv_src_metadata: expected shape",
        lambda: buf.combine(_bf16((T * 2 + 1, H)), h),
    )
    h.num_recv_tokens = T * 2
    buf.combine(x, h)
    h.num_experts = 16  # epr changes: the per-expert arrays no longer match
    _expect(EPValueError, "handle.psum_num_recv_tokens_per_expert", lambda: buf.combine(x, h))
    h.num_experts = E
    h.rank = 1
    _expect(EPValueError, "handle: made by rank 1", lambda: buf.combine(x, h))
    h.rank = RANK
    buf.combine(x, h)
    # another buffer (another config object): validated again against it
    other = _buffer(num_max_tokens_per_rank=M)
    counted.clear()
    other.combine(x, h)
    assert [c for c in counted if c.startswith("handle.")]
    # another device: refused
    buf._executor.array_device = "cuda"
    try:
        _expect(EPValueError, "expected an array on cuda:0", lambda: buf.combine(x, h))
    finally:
        buf._executor.array_device = "cpu"


def test_resized_handle_array_is_validated_again():
    torch = pytest.importorskip("torch")
    buf = _buffer()
    h = _handle()
    h.recv_src_metadata = torch.zeros(T * 2, K + 2, dtype=torch.int32)
    buf.combine(_bf16((T * 2, H)), h)
    h.recv_src_metadata.resize_(T * 2, K + 3)  # same object, new shape
    _expect(
        EPValueError, "handle.recv_src_metadata: expected shape", lambda: buf.combine(_bf16((T * 2, H)), h)
    )


def test_handle_cache_does_not_keep_handles_alive():
    import gc
    import weakref

    buf = _buffer()
    h = _handle()
    buf.combine(_bf16((T * 2, H)), h)
    ref = weakref.ref(h)
    del h
    gc.collect()
    assert ref() is None


# ------------------------------------------------------------------------------------------------------------
# memoized planning


def _fresh_plan(config, num_experts, m, data, op, amr):
    return plan._plan_regions(config, num_experts, m, data, op, amr)


def test_plan_regions_memo_equals_fresh_computation():
    configs = [
        KernelConfig(n, k, h, e, p, transport=t)
        for n, k, h, e, p, t in itertools.product(
            (1, 2, 8), (1, 8), (2048, 7168), (2, 1), (0, 56), ("ipc", "nccl")
        )
        if not (e == 2 and p)
    ]
    plans = set()
    for cfg in configs:
        for experts, m, op, amr in itertools.product(
            (256, 64), (128, 4096), ("dispatch", "combine", None), (None, True, False)
        ):
            want = _fresh_plan(cfg, experts, m, None, op, amr)
            got = plan_regions(cfg, experts, m, op=op, allow_multiple_reduction=amr)
            assert got == want and plan_regions(cfg, experts, m, op=op, allow_multiple_reduction=amr) is got
            big = 1 << 34
            assert plan_regions(cfg, experts, m, big, op=op, allow_multiple_reduction=amr) == _fresh_plan(
                cfg, experts, m, big, op, amr
            )
            plans.add((cfg, experts, m, op, amr, got))
    # different configurations give their own plans (the key covers every input)
    by_key = {}
    for cfg, experts, m, op, amr, got in plans:
        by_key.setdefault(
            (cfg.num_ranks, cfg.hidden, cfg.elem_size, cfg.num_sf_packs, cfg.num_topk, experts, m, op, amr),
            set(),
        ).add(got)
    assert all(len(v) == 1 for v in by_key.values())
    a = plan_regions(KernelConfig(8, 8, 7168), 256, 128, op="dispatch")
    b = plan_regions(KernelConfig(8, 8, 7168, 1, 56), 256, 128, op="dispatch")
    c = plan_regions(KernelConfig(8, 8, 7168), 256, 256, op="dispatch")
    assert a.dispatch_bytes != b.dispatch_bytes and a.dispatch_bytes != c.dispatch_bytes


def test_plan_regions_errors_are_raised_every_time():
    cfg = KernelConfig(8, 8, 7168)
    need = plan_regions(cfg, 256, 128, op="dispatch").dispatch_bytes
    for _ in range(3):
        with pytest.raises(EPConfigError, match="needs"):
            plan_regions(cfg, 256, 128, need - 1, op="dispatch")
        with pytest.raises(EPConfigError, match="multiple of num_ranks"):
            plan_regions(cfg, 250, 128)
    assert (
        plan_regions(cfg, 256, 128, need, op="dispatch").total_bytes
        == ep_layout.WorkspaceLayout.NUM_ALIGNED_BYTES + need
    )


def test_plan_regions_non_int_arguments_take_the_uncached_path():
    cfg = KernelConfig(2, 8, 7168)
    want = plan_regions(cfg, 256, 128, op="combine", allow_multiple_reduction=True)
    got = plan_regions(
        cfg, np.int64(256), np.int32(128), op="combine", allow_multiple_reduction=np.bool_(True)
    )
    assert got == want


def test_launch_geometry_memo():
    cfg = KernelConfig(8, 8, 7168)
    g = launch_geometry(cfg, 16, 132)
    assert g == plan._launch_geometry(cfg, 16, 132) and launch_geometry(cfg, 16, 132) is g
    assert launch_geometry(cfg, 24, 132).grid == 24
    assert launch_geometry(KernelConfig(8, 8, 7168, num_warps=4), 16, 132).block == 128
    for bad in (0, 133):
        for _ in range(2):
            with pytest.raises(EPValueError, match="num_sms"):
                launch_geometry(cfg, bad, 132)


def test_kernel_config_derived_sizes_are_computed_once_and_exact():
    for cfg in (
        KernelConfig(8, 8, 7168),
        KernelConfig(4, 2, 2048, 1, 64),
        KernelConfig(1, 32, 4096, num_warps=3),
    ):
        token = ep_layout.make_dispatch_token_layout(
            cfg.hidden, cfg.elem_size, cfg.num_sf_packs, cfg.num_topk
        )
        assert cfg.dispatch_token == token and cfg.dispatch_token is cfg.dispatch_token
        assert cfg.combine_token == ep_layout.make_combine_token_layout(cfg.hidden, cfg.num_topk)
        assert cfg.smem_slot_bytes == ep_layout.align(token.get_num_bytes(), 128)
        assert cfg.dynamic_smem_bytes == cfg.num_warps * cfg.smem_slot_bytes
        other = dataclasses.replace(cfg, hidden=cfg.hidden * 2, num_warps=0)
        assert other.smem_slot_bytes > cfg.smem_slot_bytes  # a new config computes its own
        assert hash(cfg) == hash(
            KernelConfig(
                cfg.num_ranks, cfg.num_topk, cfg.hidden, cfg.elem_size, cfg.num_sf_packs, cfg.num_warps
            )
        )
        assert cfg == KernelConfig(
            cfg.num_ranks, cfg.num_topk, cfg.hidden, cfg.elem_size, cfg.num_sf_packs, cfg.num_warps
        )


def test_capacity_memo_equals_ep_layout():
    from ep_core.topology import Topology

    for n, h, e, p, k, m in itertools.product((1, 8), (2048, 7168), (2, 1), (0, 56), (1, 8), (128, 4096)):
        if e == 2 and p:
            continue
        topo = Topology(n)
        token = ep_layout.make_dispatch_token_layout(h, e, p, k)
        assert validation._dispatch_bytes(h, e, p, k, topo, m) == ep_layout.dispatch_buffer_bytes(
            token, topo.to_layout(), m
        )
        for amr in (True, False):
            ct = ep_layout.make_combine_token_layout(h, k)
            assert validation._combine_bytes(h, k, topo, m, amr) == ep_layout.combine_buffer_bytes(
                ct, topo.to_layout(), m, amr
            )


def test_capacity_error_every_time():
    buf = _buffer(num_bytes=2 << 20, num_max_tokens_per_rank=4096, hidden=7168)
    x = ec.host_array(np.ones((4, 7168), np.uint16), "bfloat16")
    idx = ec.host_array(np.zeros((4, 8), np.int64))
    for _ in range(2):
        with pytest.raises(EPValueError, match="buffer: the dispatch needs"):
            buf.dispatch(x, idx, num_experts=E)


# ------------------------------------------------------------------------------------------------------------
# as_view of torch-like tensors


def _old_as_view_dtype(t):
    name = str(t.dtype)
    size = int(t.element_size())
    mapping = {
        "torch.bfloat16": np.uint16,
        "torch.float16": np.float16,
        "torch.float32": np.float32,
        "torch.int32": np.int32,
        "torch.int64": np.int64,
        "torch.float8_e4m3fn": np.uint8,
        "torch.uint8": np.uint8,
        "torch.int8": np.int8,
    }
    return np.dtype(mapping.get(name, {1: np.uint8, 2: np.uint16, 4: np.float32, 8: np.int64}[size]))


def test_as_view_torch_matches_mapping():
    torch = pytest.importorskip("torch")
    for dt in (
        torch.bfloat16,
        torch.float16,
        torch.float32,
        torch.int32,
        torch.int64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.uint8,
        torch.int8,
        torch.bool,
        torch.int16,
        torch.float64,
    ):
        for t in (
            torch.zeros(3, 5, dtype=torch.float32).to(dt),
            torch.zeros(5, 3, dtype=torch.float32).to(dt).t(),
        ):
            for _ in range(2):
                v = as_view(t, "x")
                assert isinstance(v, DeviceView)
                assert v.dtype == _old_as_view_dtype(t)
                assert (v.ptr, v.shape, v.strides, v.owner) == (t.data_ptr(), tuple(t.shape), t.stride(), t)
    with pytest.raises(KeyError):
        as_view(torch.zeros(2, dtype=torch.complex128), "x")  # 16-byte elements: as before


def test_view_ptr_equals_as_view_ptr():
    torch = pytest.importorskip("torch")
    from ep_core.kernels import _cuda
    from ep_core.kernels._cuda import view_ptr

    describe(torch.zeros(1))  # arms the torch fast path (as validation does before any launch)

    class CAI:
        def __init__(self) -> None:
            self.__cuda_array_interface__ = {
                "shape": (2, 3),
                "typestr": "<i4",
                "data": (0x1000, False),
                "version": 3,
            }

    objs = [
        torch.zeros(3, 5, dtype=torch.bfloat16),
        torch.zeros(5, 3, dtype=torch.int64).t(),
        torch.zeros(0, 4, dtype=torch.int32),
        torch.zeros(4, dtype=torch.float8_e4m3fn)[1:],
        torch.nn.Parameter(torch.zeros(2), requires_grad=False),
        DeviceView(0x2000, (2, 2), np.dtype(np.int32)),
        _cuda.DeviceArray((0,), np.int32),
        ec.DeviceArray(0x3000, (4, 2), "bfloat16", device="cuda"),
        ec.DeviceArray(0x3000, (4, 2), "bfloat16", strides=(2, 8), device="cuda"),
        CAI(),
    ]
    for obj in objs:
        assert view_ptr(obj, "a") == as_view(obj, "a").ptr
    for bad in (
        torch.zeros(2, dtype=torch.complex128),
        "not an array",
        None,
        ec.DeviceArray(0x3000, (4, 2), "bfloat16", device="cpu"),
    ):
        with pytest.raises(Exception) as want:
            as_view(bad, "a")
        with pytest.raises(type(want.value)) as got:
            view_ptr(bad, "a")
        assert str(got.value) == str(want.value)


def _request_cases(torch):
    bf = torch.bfloat16
    f8 = torch.float8_e4m3fn

    def x(t=T, h=H):
        return torch.ones(t, h, dtype=bf)

    def idx(t=T, dtype=torch.int64):
        return torch.zeros(t, K, dtype=dtype)

    def w(t=T, k=K):
        return torch.ones(t, k)

    sf = torch.ones(T, 2)
    d = {"num_experts": E, "do_cpu_sync": False}
    return [
        ("bf16", (x(), idx(), w()), d),
        ("bf16 int32 ids", (x(), idx(dtype=torch.int32), None), d),
        ("zero tokens", (x(0), idx(0), w(0)), d),
        ("one token", (x(1), idx(1), w(1)), d),
        ("fp8", ((x().to(f8), sf), idx(), w()), d),
        ("fp8 uint8 bits", ((x().to(f8).view(torch.uint8), sf), idx(), None), d),
        ("fp8 column-major sf", ((x().to(f8), torch.ones(2, T).t()), idx(), None), d),
        ("fp8 one-pack sf", ((x().to(f8), torch.ones(T, 1)), idx(), None), d),
        ("fp8 bad sf dtype", ((x().to(f8), sf.to(bf)), idx(), None), d),
        ("fp8 sf rows", ((x().to(f8), torch.ones(T + 1, 2)), idx(), None), d),
        ("fp8 data dtype", ((x(), sf), idx(), None), d),
        ("x non-contiguous", (torch.ones(H, T, dtype=bf).t(), idx(), None), d),
        ("x rows of a larger tensor", (torch.ones(2 * T, H, dtype=bf)[T:], idx(), None), d),
        ("x every other row", (torch.ones(2 * T, H, dtype=bf)[::2], idx(), None), d),
        ("x 3-D", (torch.ones(T, H, 1, dtype=bf), idx(), None), d),
        ("x float32", (torch.ones(T, H), idx(), None), d),
        ("ids float", (x(), torch.zeros(T, K), None), d),
        ("ids rows", (x(), idx(T - 1), None), d),
        ("ids non-contiguous", (x(), torch.zeros(K, T, dtype=torch.int64).t(), None), d),
        ("weights shape", (x(), idx(), w(k=K + 1)), d),
        ("weights dtype", (x(), idx(), w().to(bf)), d),
        ("weights grad", (x(), idx(), torch.ones(T, K, requires_grad=True)), d),
        ("meta device", (torch.ones(T, H, dtype=bf, device="meta"), idx(), None), d),
    ]


GOOD_REQUESTS = {
    "bf16",
    "bf16 int32 ids",
    "zero tokens",
    "one token",
    "fp8",
    "fp8 uint8 bits",
    "fp8 column-major sf",
    "fp8 one-pack sf",
    "x rows of a larger tensor",
}


def test_requests_with_torch_tensors_equal_with_and_without_fast_path(monkeypatch):
    """Whole dispatch / combine requests (torch CPU tensors) are equal, or fail with the same error, either way."""
    torch = pytest.importorskip("torch")
    buf = _buffer()
    config, target = buf.config, buf._executor

    def dispatch(args, kw):
        try:
            return validation.make_dispatch_request(config, target, *args, **kw)
        except Exception as exc:
            return (type(exc), str(exc))

    for name, args, kw in _request_cases(torch):
        fast = dispatch(args, kw)
        with monkeypatch.context() as m:
            m.setattr(device_array, "_from_torch", lambda obj: None)
            slow = dispatch(args, kw)
        assert fast == slow, name
        ok = isinstance(fast, DispatchRequest)
        assert ok == (name in GOOD_REQUESTS), (name, fast)
    rows = T * 2
    h = _handle(rows)
    for name, xr, bias in (
        ("combine", torch.ones(rows, H, dtype=torch.bfloat16), None),
        ("combine bias", torch.ones(rows, H, dtype=torch.bfloat16), torch.ones(T, H, dtype=torch.bfloat16)),
        (
            "combine two biases",
            torch.ones(rows, H, dtype=torch.bfloat16),
            (torch.ones(T, H, dtype=torch.bfloat16), torch.ones(T, H, dtype=torch.bfloat16)),
        ),
        (
            "combine bad bias",
            torch.ones(rows, H, dtype=torch.bfloat16),
            torch.ones(T, H + 16, dtype=torch.bfloat16),
        ),
        ("combine rows", torch.ones(rows + 1, H, dtype=torch.bfloat16), None),
        ("combine dtype", torch.ones(rows, H), None),
    ):
        results = []
        for slow in (False, True):
            with monkeypatch.context() as m:
                if slow:
                    m.setattr(device_array, "_from_torch", lambda obj: None)
                try:
                    results.append(validation.make_combine_request(config, target, xr, h, bias=bias))
                except Exception as exc:
                    results.append((type(exc), str(exc)))
        assert results[0] == results[1], name
        assert isinstance(results[0], CombineRequest) == (
            name in ("combine", "combine bias", "combine two biases")
        )


# ------------------------------------------------- GPU path: a call rejected before launching gives up its step
class SteppedExecutor(NullExecutor):
    """A GPU-style executor (no host channel): `launch_step` counts launches, `abandon_step` gives one up."""

    def __init__(self) -> None:
        self.launch_step = 0

    def dispatch(self, req):
        self.launch_step += 1
        return req

    def combine(self, req):
        self.launch_step += 1
        return req

    def abandon_step(self) -> None:
        self.launch_step += 1


def test_gpu_path_rejected_call_gives_up_its_step():
    ex = SteppedExecutor()
    buf = _buffer(executor=ex)
    x = ec.host_array(np.zeros((T, H), np.uint16), dtype="bfloat16")
    idx = ec.host_array(np.zeros((T, K), np.int64))
    buf.dispatch(x, idx, num_experts=E)
    assert ex.launch_step == 1
    many = ec.host_array(
        np.zeros((M + 1, H), np.uint16), dtype="bfloat16"
    )  # over M: rejected before launching
    with pytest.raises(ValueError):
        buf.dispatch(many, ec.host_array(np.zeros((M + 1, K), np.int64)), num_experts=E)
    assert ex.launch_step == 2  # the rank's next launch carries the next sequence number: its peers see it
    with pytest.raises(ValueError):
        buf.combine(x, None)
    assert ex.launch_step == 3


def test_nested_announcing_blocks_announce_once():
    """ep_torch opens `announcing` around EPBuffer's own block: the error is announced (a step given up) once, by
    the outermost block, whether it was raised inside the inner block or outside it."""
    ex = SteppedExecutor()
    buf = _buffer(executor=ex)
    many = ec.host_array(np.zeros((M + 1, H), np.uint16), dtype="bfloat16")
    bad_idx = ec.host_array(np.zeros((M + 1, K), np.int64))
    with pytest.raises(ValueError), buf.announcing("dispatch"):
        buf.dispatch(many, bad_idx, num_experts=E)  # inner: passes the error on
    assert ex.launch_step == 1
    with pytest.raises(TypeError), buf.announcing("dispatch"):
        raise TypeError("previous_event: rejected by the framework layer")
    assert ex.launch_step == 2
    x = ec.host_array(np.zeros((T, H), np.uint16), dtype="bfloat16")
    with buf.announcing("dispatch"):
        buf.dispatch(x, ec.host_array(np.zeros((T, K), np.int64)), num_experts=E)
    assert ex.launch_step == 3 and buf._announcing_depth == 0
