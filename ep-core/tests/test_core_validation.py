"""SPEC §6 validation: a table of bad inputs (dispatch, combine, constructor), each with the expected exception type
and message fragment; plus the request the executor receives for good inputs."""

from __future__ import annotations

import ep_core as ec
import numpy as np
import pytest
from ep_core import routing
from ep_core.errors import EPConfigError, EPStateError, EPTypeError, EPValueError

N, RANK, T, H, K, E, M = 2, 0, 4, 64, 2, 8, 8


class PairBootstrap:
    """Rank 0 of a 2-rank group whose peer always agrees (validation never reaches the peer)."""

    rank = RANK
    size = N

    def allgather(self, data: bytes) -> list[bytes]:
        return [data] * N

    def barrier(self) -> None:
        return None


class RecordingExecutor:
    array_device = "cpu"
    device_id = 0
    num_device_sms = 132
    nvlink_gbs = 450.0
    rdma_gbs = 50.0

    def __init__(self) -> None:
        self.requests: list = []
        self.destroyed = False

    def dispatch(self, req):
        self.requests.append(req)
        return "dispatched"

    def combine(self, req):
        self.requests.append(req)
        return "combined"

    def barrier(self) -> None:
        return None

    def destroy(self) -> None:
        self.destroyed = True

    @staticmethod
    def default_allocator(shape, dtype):
        return ec.host_allocator(shape, dtype)


def make_buffer(**kw):
    args = dict(
        transport="reference", num_max_tokens_per_rank=M, hidden=H, num_topk=K, executor=RecordingExecutor()
    )
    args.update(kw)
    return ec.EPBuffer(PairBootstrap(), **args)


def _inputs(seed=0):
    inp = routing.make_inputs(1, T, H, E, K, seed=seed)
    x = ec.host_array(inp.xs[0], "bfloat16")
    idx = ec.host_array(inp.topk_idxs[0])
    w = ec.host_array(inp.topk_weights[0])
    return x, idx, w


def _handle(do_expand=False, rank=RANK, num_ranks=N, num_experts=E, tokens=T, rows=None):
    """A structurally valid handle for this rank (as the executor would return it)."""
    rows = tokens * 2 if rows is None else rows
    epr = num_experts // num_ranks
    return ec.EPHandle(
        do_expand,
        num_experts,
        1,
        M,
        8,
        ec.host_array(np.zeros((tokens, K), np.int64)),
        rows,
        rows * 2,
        [rows] * epr,
        ec.host_array(np.zeros(N, np.int32)),
        ec.host_array(np.zeros(epr, np.int32)),
        ec.host_array(np.zeros(epr, np.int32)),
        ec.host_array(np.zeros((rows, K + 2), np.int32)),
        ec.host_array(np.zeros((tokens, K), np.int32)),
        num_ranks=num_ranks,
        rank=rank,
    )


def bf16(shape):
    return ec.host_array(np.ones(shape, np.uint16), "bfloat16")


def f32(shape):
    return ec.host_array(np.ones(shape, np.float32))


def fp8(shape):
    return ec.host_array(np.ones(shape, np.uint8), "float8_e4m3fn")


# each case: (id, mutate(args dict) -> None, exception, fragment)
def _x(v):
    return lambda a: a.__setitem__("x", v)


def _kw(**kw):
    return lambda a: a["kw"].update(kw)


def _set(name, v):
    return lambda a: a.__setitem__(name, v)


DISPATCH_CASES = [
    ("x_list", _x([bf16((T, H))]), EPTypeError, "x: expected a bf16 array or a tuple"),
    ("x_tuple3", _x((fp8((T, H)), f32((T, 2)), f32((T, 2)))), EPTypeError, "two arrays"),
    ("x_dtype", _x(f32((T, H))), EPTypeError, "x: expected dtype bfloat16"),
    ("x_not_array", _x("tokens"), EPTypeError, "x: expected an array"),
    ("x_3d", _x(bf16((T, H, 1))), EPValueError, "x: expected a 2-D array"),
    (
        "x_noncontiguous",
        _x(ec.host_array(np.ones((H, T), np.uint16).T, "bfloat16")),
        EPValueError,
        "contiguous",
    ),
    ("x_device", _x(ec.DeviceArray(0x1000, (T, H), "bfloat16", device="cuda")), EPValueError, "on cpu:0"),
    ("x_hidden_align", _x(bf16((T, 40))), EPValueError, "multiple of 32 bytes"),
    ("fp8_data_dtype", _x((bf16((T, H)), f32((T, 2)))), EPTypeError, "x[0] (FP8 data): expected dtype"),
    ("fp8_sf_dtype", _x((fp8((T, H)), bf16((T, 2)))), EPTypeError, "x[1] (sf): expected dtype"),
    ("fp8_sf_rows", _x((fp8((T, H)), f32((T + 1, 2)))), EPValueError, "x[1] (sf): expected 4 rows"),
    ("fp8_sf_1d", _x((fp8((T, H)), f32((T,)))), EPValueError, "x[1] (sf): expected a 2-D"),
    ("tokens_over_m", _kw(num_max_tokens_per_rank=T - 1), EPValueError, "num_max_tokens_per_rank (3)"),
    ("idx_missing", _set("idx", None), EPValueError, "topk_idx: required"),
    ("idx_dtype", _set("idx", f32((T, K))), EPTypeError, "topk_idx: expected dtype int64 or int32"),
    (
        "idx_rows",
        _set("idx", ec.host_array(np.zeros((T + 1, K), np.int64))),
        EPValueError,
        "topk_idx: expected 4",
    ),
    ("idx_k33", _set("idx", ec.host_array(np.zeros((T, 33), np.int64))), EPValueError, "num_topk"),
    ("idx_1d", _set("idx", ec.host_array(np.zeros(T, np.int64))), EPValueError, "topk_idx: expected a 2-D"),
    (
        "idx_noncontiguous",
        _set("idx", ec.host_array(np.zeros((K, T), np.int64).T)),
        EPValueError,
        "contiguous",
    ),
    (
        "weights_dtype",
        _set("w", ec.host_array(np.ones((T, K)))),
        EPTypeError,
        "topk_weights: expected dtype float32",
    ),
    ("weights_k", _set("w", f32((T, K + 1))), EPValueError, "topk_weights: expected shape (4, 2)"),
    ("weights_rows", _set("w", f32((T - 1, K))), EPValueError, "topk_weights: expected shape"),
    ("experts_missing", _kw(num_experts=None), EPValueError, "num_experts: required"),
    ("experts_multiple", _kw(num_experts=7), EPValueError, "num_experts: expected a multiple"),
    ("experts_max", _kw(num_experts=4096), EPValueError, "num_experts: expected at most 2048"),
    ("experts_per_rank", _kw(num_experts=2 * 258), EPValueError, "experts per rank"),
    ("experts_type", _kw(num_experts=8.0), EPTypeError, "num_experts: expected an int"),
    ("alignment", _kw(expert_alignment=0), EPValueError, "expert_alignment"),
    ("zero_padding", _kw(do_zero_padding=True), EPValueError, "do_zero_padding"),
    ("expand_flag", _kw(do_expand=1), EPTypeError, "do_expand: expected a bool"),
    ("cpu_sync_flag", _kw(do_cpu_sync="yes"), EPTypeError, "do_cpu_sync"),
    (
        "stats_shape",
        _kw(cumulative_local_expert_recv_stats=ec.host_array(np.zeros(3, np.int32))),
        EPValueError,
        "cumulative_local_expert_recv_stats: expected shape (4,)",
    ),
    (
        "stats_dtype",
        _kw(cumulative_local_expert_recv_stats=ec.host_array(np.zeros(4, np.int64))),
        EPTypeError,
        "cumulative_local_expert_recv_stats: expected dtype int32",
    ),
    ("num_sms_negative", _kw(num_sms=-1), EPValueError, "num_sms: expected an int >= 0"),
    ("num_sms_too_many", _kw(num_sms=133), EPValueError, "num_sms: expected at most the device's 132"),
    ("num_qps", _kw(num_qps=1000), EPValueError, "allocated QPs are not enough"),
    (
        "previous_event",
        _kw(previous_event=object()),
        EPValueError,
        "previous_event: requires allocate_on_comm",
    ),
    ("allocator", _kw(allocator=42), EPTypeError, "allocator: expected a callable"),
    ("handle_type", _kw(handle=object()), EPTypeError, "handle: expected the EPHandle"),
    ("zero_copy_flag", _kw(zero_copy=1), EPTypeError, "zero_copy: expected a bool"),
    (
        "zero_copy_expand",
        _kw(zero_copy=True, do_expand=True),
        EPValueError,
        "zero_copy: the non-expanded layout only (do_expand=False), got do_expand=True (rank 0)",
    ),
    (
        "zero_copy_col_major_sf",
        lambda a: (
            _x((fp8((T, H)), f32((T, 2))))(a),
            _kw(zero_copy=True, use_tma_aligned_col_major_sf=True)(a),
        ),
        EPValueError,
        "zero_copy: row-major scales only",
    ),
    # an executor without the mark (`zero_copy_dispatch`): refused, never an ordinary dispatch in its place
    ("zero_copy_executor", _kw(zero_copy=True), EPConfigError, "RecordingExecutor has no zero-copy dispatch"),
]

HANDLE_CASES = [
    ("handle_with_idx", dict(), "keep_idx", EPValueError, "topk_idx: must be None"),
    ("handle_cpu_sync", dict(do_cpu_sync=True), None, EPValueError, "do_cpu_sync: a cached dispatch"),
    ("handle_expand", dict(do_expand=True), None, EPValueError, "do_expand: True differs"),
    (
        "handle_stats",
        dict(cumulative_local_expert_recv_stats=ec.host_array(np.zeros(4, np.int32))),
        None,
        EPValueError,
        "not allowed with a cached handle",
    ),
    ("handle_experts", dict(num_experts=16), None, EPValueError, "num_experts: 16 differs"),
    ("handle_m", dict(num_max_tokens_per_rank=7), None, EPValueError, "num_max_tokens_per_rank: 7 differs"),
    ("handle_alignment", dict(expert_alignment=4), None, EPValueError, "expert_alignment: 4 differs"),
    ("handle_rank", dict(), "other_rank", EPValueError, "handle: made by rank 1"),
    ("handle_tokens", dict(), "other_tokens", EPValueError, "cached handle was made for 3"),
    ("handle_psum_shape", dict(), "bad_psum", EPValueError, "handle.psum_num_recv_tokens_per_scaleup_rank"),
    ("handle_zero_copy", dict(zero_copy=True), None, EPValueError, "zero_copy: not with a cached dispatch"),
]


@pytest.mark.parametrize(
    ("case", "mutate", "exc", "fragment"), DISPATCH_CASES, ids=[c[0] for c in DISPATCH_CASES]
)
def test_dispatch_rejects(case, mutate, exc, fragment):
    buf = make_buffer()
    x, idx, w = _inputs()
    args = {"x": x, "idx": idx, "w": w, "kw": {"num_experts": E}}
    mutate(args)
    with pytest.raises(exc) as err:
        buf.dispatch(args["x"], args["idx"], args["w"], **args["kw"])
    assert fragment in str(err.value)
    assert buf.executor.requests == []


@pytest.mark.parametrize(
    ("case", "kw", "special", "exc", "fragment"), HANDLE_CASES, ids=[c[0] for c in HANDLE_CASES]
)
def test_cached_dispatch_rejects(case, kw, special, exc, fragment):
    buf = make_buffer()
    x, idx, w = _inputs()
    handle = _handle()
    if special == "other_rank":
        handle = _handle(rank=1)
    elif special == "other_tokens":
        handle = _handle(tokens=3)
    elif special == "bad_psum":
        handle.psum_num_recv_tokens_per_scaleup_rank = ec.host_array(np.zeros(3, np.int32))
    with pytest.raises(exc) as err:
        buf.dispatch(x, idx if special == "keep_idx" else None, w, handle=handle, **kw)
    assert fragment in str(err.value)


def test_dispatch_capacity():
    buf = make_buffer(num_bytes=2 << 20, num_max_tokens_per_rank=4096, hidden=7168)
    x = bf16((T, 7168))
    _, idx, w = _inputs()
    with pytest.raises(EPValueError, match="buffer: the dispatch needs"):
        buf.dispatch(x, idx, w, num_experts=E)


def test_good_dispatch_request_and_defaults():
    buf = make_buffer(allow_hybrid_mode=False)
    x, idx, w = _inputs()
    assert buf.dispatch(x, idx, w, num_experts=E) == "dispatched"
    req = buf.executor.requests[-1]
    assert isinstance(req, ec.DispatchRequest)
    assert (req.num_tokens, req.hidden, req.num_topk, req.elem_size, req.num_sf_packs) == (T, H, K, 2, 0)
    assert req.do_cpu_sync and not req.is_cached and req.expert_alignment == 1
    assert req.num_max_tokens_per_rank == M and req.num_experts == E
    want_sms = ec.get_theoretical_num_sms(
        ec.Topology(N, N, False), E, K, num_device_sms=132, nvlink_gbs=450.0
    )
    assert req.num_sms == want_sms and req.num_qps == min(want_sms, 9)
    assert req.x.obj is x and req.topk_idx.obj is idx and req.topk_weights.obj is w
    assert callable(req.allocator)
    # FP8 with strided scales, explicit SMs and QPs, cached handle accepted
    sf = ec.host_array(np.ones((2, T), np.float32).T)
    buf.dispatch(
        (fp8((T, H)), sf),
        idx,
        None,
        num_experts=E,
        num_sms=10,
        num_qps=3,
        do_expand=True,
        do_zero_padding=True,
        use_tma_aligned_col_major_sf=True,
        expert_alignment=4,
    )
    req = buf.executor.requests[-1]
    assert (req.elem_size, req.num_sf_packs, req.num_sms, req.num_qps) == (1, 2, 10, 3)
    handle = _handle()
    buf.dispatch(x, None, w, handle=handle)
    req = buf.executor.requests[-1]
    assert req.is_cached and not req.do_cpu_sync and req.num_sms == handle.num_sms


def test_zero_copy_dispatch_request():
    """D18: a zero-copy dispatch reaches an executor that offers it (`zero_copy_dispatch`) as a request of its own
    (the request cache keys it apart: its prepared token is not the ordinary call's); several NVLink domains are
    refused."""
    buf = make_buffer()
    buf.executor.zero_copy_dispatch = True
    x, idx, w = _inputs()
    tokens = []
    for _ in range(2):
        buf.dispatch(x, idx, w, num_experts=E, zero_copy=True)
        req = buf.executor.requests[-1]
        assert req.zero_copy and not req.is_cached
        tokens.append(req.prepared)
    buf.dispatch(x, idx, w, num_experts=E)
    plain = buf.executor.requests[-1]
    assert not plain.zero_copy and plain.prepared is not tokens[0]
    assert tokens[0] is tokens[1]  # the second zero-copy call hit the first one's entry
    for hybrid in (True, False):
        other = make_buffer(num_nvlink_ranks=1, allow_hybrid_mode=hybrid)
        other.executor.zero_copy_dispatch = True
        with pytest.raises(EPValueError, match="zero_copy: direct mode within one NVLink domain only"):
            other.dispatch(x, idx, w, num_experts=E, zero_copy=True)
        assert other.executor.requests == []


def test_hybrid_flag_qps():
    buf = make_buffer(num_allocated_qps=129)
    x, idx, w = _inputs()
    buf.dispatch(x, idx, w, num_experts=E, num_sms=4)
    assert buf.executor.requests[-1].num_qps == 65
    assert buf.get_theoretical_num_qps(20) == 129


COMBINE_CASES = [
    ("x_tuple", lambda a: a.__setitem__("x", (bf16((8, H)),)), EPTypeError, "x: expected one bf16 array"),
    ("x_dtype", lambda a: a.__setitem__("x", f32((8, H))), EPTypeError, "x: expected dtype bfloat16"),
    (
        "x_rows",
        lambda a: a.__setitem__("x", bf16((7, H))),
        EPValueError,
        "x: expected 8 rows (handle.num_recv",
    ),
    ("x_hidden", lambda a: a.__setitem__("x", bf16((8, 8))), EPValueError, "multiple of 16"),
    (
        "x_noncontiguous",
        lambda a: a.__setitem__("x", ec.host_array(np.ones((H, 8), np.uint16).T, "bfloat16")),
        EPValueError,
        "contiguous",
    ),
    ("handle_none", lambda a: a.__setitem__("handle", None), EPValueError, "handle: required"),
    ("handle_type", lambda a: a.__setitem__("handle", "h"), EPTypeError, "handle: expected the EPHandle"),
    (
        "weights_shape",
        lambda a: a.__setitem__("w", f32((8, K + 1))),
        EPValueError,
        "topk_weights: expected shape",
    ),
    (
        "weights_dtype",
        lambda a: a.__setitem__("w", bf16((8, K))),
        EPTypeError,
        "topk_weights: expected dtype",
    ),
    (
        "bias_list",
        lambda a: a.__setitem__("bias", [bf16((T, H))]),
        EPTypeError,
        "bias: expected None, an array",
    ),
    ("bias_tuple3", lambda a: a.__setitem__("bias", (bf16((T, H)),) * 3), EPTypeError, "exactly two"),
    ("bias_tuple1", lambda a: a.__setitem__("bias", (bf16((T, H)),)), EPTypeError, "exactly two"),
    (
        "bias_shape",
        lambda a: a.__setitem__("bias", bf16((T + 1, H))),
        EPValueError,
        "bias: expected shape (4, 64)",
    ),
    (
        "bias1_shape",
        lambda a: a.__setitem__("bias", (bf16((T, H)), bf16((T, H + 16)))),
        EPValueError,
        "bias[1]",
    ),
    (
        "bias_dtype",
        lambda a: a.__setitem__("bias", f32((T, H))),
        EPTypeError,
        "bias: expected dtype bfloat16",
    ),
    ("bias_type", lambda a: a.__setitem__("bias", "b"), EPTypeError, "bias: expected an array"),
    ("num_sms", lambda a: a["kw"].update(num_sms=500), EPValueError, "num_sms"),
    ("num_qps", lambda a: a["kw"].update(num_qps=500), EPValueError, "allocated QPs are not enough"),
    ("previous_event", lambda a: a["kw"].update(previous_event=1), EPValueError, "previous_event"),
]


@pytest.mark.parametrize(
    ("case", "mutate", "exc", "fragment"), COMBINE_CASES, ids=[c[0] for c in COMBINE_CASES]
)
def test_combine_rejects(case, mutate, exc, fragment):
    buf = make_buffer()
    args = {"x": bf16((8, H)), "handle": _handle(), "w": f32((8, K)), "bias": None, "kw": {}}
    mutate(args)
    with pytest.raises(exc) as err:
        buf.combine(args["x"], args["handle"], args["w"], args["bias"], **args["kw"])
    assert fragment in str(err.value)


def test_combine_expand_rules_and_capacity():
    buf = make_buffer(allow_multiple_reduction=False)
    h = _handle(do_expand=True)
    with pytest.raises(EPValueError, match="x: expected 16 rows"):
        buf.combine(bf16((8, H)), h)
    with pytest.raises(EPValueError, match="topk_weights: not allowed in expand mode"):
        buf.combine(bf16((16, H)), h, f32((16,)))
    assert buf.combine(bf16((16, H)), h) == "combined"
    ok = make_buffer()
    with pytest.raises(EPValueError, match="topk_weights: expected a 1-D array"):
        ok.combine(bf16((16, H)), h, f32((16, K)))
    assert ok.combine(bf16((16, H)), h, f32((16,)), (bf16((T, H)), bf16((T, H)))) == "combined"
    req = ok.executor.requests[-1]
    assert isinstance(req, ec.CombineRequest) and len(req.bias) == 2 and req.num_sms == h.num_sms
    small = make_buffer(num_bytes=2 << 20)
    big = bf16((8, 4096))
    with pytest.raises(EPValueError, match="buffer: the combine needs"):
        small.combine(big, _handle_m(4096))


def _handle_m(m):
    h = _handle()
    h.num_max_tokens_per_rank = m
    return h


CONSTRUCTOR_CASES = [
    ("bootstrap", dict(bootstrap=object()), EPValueError, "bootstrap: expected an object"),
    ("transport_name", dict(transport="carrier_pigeon"), EPConfigError, "transport: unknown transport"),
    ("transport_type", dict(transport=3), EPTypeError, "transport: expected a name"),
    ("unsized", dict(num_max_tokens_per_rank=0), EPValueError, "num_bytes: not given"),
    ("num_bytes_align", dict(num_bytes=3 << 20), EPValueError, "multiples of 2 MiB"),
    ("num_bytes_zero", dict(num_bytes=0), EPValueError, "num_bytes: expected a positive int"),
    (
        "cpu_without_bytes",
        dict(num_cpu_bytes=2 << 20),
        EPValueError,
        "num_bytes: required when num_cpu_bytes",
    ),
    ("cpu_over", dict(num_bytes=2 << 20, num_cpu_bytes=4 << 20), EPValueError, "num_cpu_bytes: expected <="),
    ("topk", dict(num_topk=33), EPValueError, "num_topk: expected an int [0, 32]"),
    ("hidden", dict(hidden=-1), EPValueError, "hidden"),
    ("flag", dict(deterministic="yes"), EPTypeError, "deterministic: expected a bool"),
    ("gpu_timeout", dict(num_gpu_timeout_secs=0), EPValueError, "num_gpu_timeout_secs"),
    ("cpu_timeout", dict(num_cpu_timeout_secs=-1), EPValueError, "num_cpu_timeout_secs"),
    ("experts", dict(num_experts=7), EPConfigError, "num_experts: expected a multiple"),
    ("nvlink", dict(num_nvlink_ranks=3), EPConfigError, "num_nvlink_ranks"),
    ("policy", dict(policy="V3"), EPTypeError, "policy"),
    ("sl_idx", dict(sl_idx=-1), EPValueError, "sl_idx"),
    ("qps", dict(num_allocated_qps=-2), EPValueError, "num_allocated_qps"),
    ("hidden_align", dict(hidden=40), EPConfigError, "hidden"),
]


@pytest.mark.parametrize(
    ("case", "kw", "exc", "fragment"), CONSTRUCTOR_CASES, ids=[c[0] for c in CONSTRUCTOR_CASES]
)
def test_constructor_rejects(case, kw, exc, fragment):
    kw = dict(kw)
    boot = kw.pop("bootstrap", PairBootstrap())
    args = dict(transport="reference", num_max_tokens_per_rank=M, hidden=H, num_topk=K) | kw
    with pytest.raises(exc) as err:
        ec.EPBuffer(boot, **args)
    assert fragment in str(err.value)


def test_constructor_sizes_and_lifecycle():
    buf = make_buffer(allow_hybrid_mode=False)
    assert buf.num_bytes == ec.get_buffer_size_hint(ec.Topology(N), M, H, K)
    assert buf.num_bytes % (2 << 20) == 0
    assert buf.config.num_allocated_qps == 17
    assert buf.get_logical_domain_size() == (1, 2) and buf.get_physical_domain_size() == (1, 2)
    assert buf.workspace.nbytes == buf.config.num_workspace_bytes and buf.workspace.nbytes % (2 << 20) == 0
    assert buf.data.nbytes == buf.num_bytes
    assert buf.get_theoretical_num_sms(256, 8) == ec.get_theoretical_num_sms(
        ec.Topology(2, 2, False), 256, 8, num_device_sms=132, nvlink_gbs=450.0
    )
    ex = buf.executor
    buf.destroy()
    assert ex.destroyed and buf.destroyed and buf.storage.closed
    with pytest.raises(EPStateError, match="used after destroy"):
        buf.dispatch(*_inputs(), num_experts=E)
    with pytest.raises(EPStateError):
        buf.destroy()
    with make_buffer() as b2:
        ex2 = b2.executor
    assert ex2.destroyed


def test_the_kernel_layers_entry_points_check_the_routing_with_the_validators_words() -> None:
    """Rule D7 lives in the validator alone (issue 45): `LoopbackDomain`, `ProcessRank` and `NcclRank` call
    `validate_rank_routing` before `RankDriver.launch_dispatch`, which repeats none of it, with `validate_dispatch`'s
    wording."""
    import inspect

    from ep_core.device_array import host_array
    from ep_core.kernels.dispatch_launch import DispatchLaunch
    from ep_core.validation import validate_rank_routing

    x = host_array(np.zeros((6, 64), np.uint16), "bfloat16")
    idx = host_array(np.zeros((6, 2), np.int64))
    validate_rank_routing(x, idx, None)
    validate_rank_routing((host_array(np.zeros((6, 64), np.uint8), "float8_e4m3fn"), None), idx, None)
    validate_rank_routing(x, None, object())
    with pytest.raises(EPValueError, match=r"topk_idx: required unless a cached handle is given"):
        validate_rank_routing(x, None, None)
    with pytest.raises(
        EPValueError, match=r"topk_idx: must be None for a cached dispatch \(the handle holds"
    ):
        validate_rank_routing(x, idx, object())
    with pytest.raises(EPValueError, match=r"topk_idx: expected 5 rows \(one per token of x\)"):
        validate_rank_routing(host_array(np.zeros((5, 64), np.uint16), "bfloat16"), idx, None)
    with pytest.raises(EPTypeError, match=r"topk_idx: expected dtype int64 or int32, got int16"):
        validate_rank_routing(x, host_array(np.zeros((6, 2), np.int16)), None)
    with pytest.raises(EPValueError, match=r"topk_idx: expected a contiguous"):
        validate_rank_routing(x, host_array(np.zeros((6, 4), np.int64)[:, ::2]), None)
    with pytest.raises(EPValueError, match=r"topk_idx: expected a 2-D array"):
        validate_rank_routing(x, host_array(np.zeros(6, np.int64)), None)
    validate_rank_routing(np.zeros(3), idx, None)  # an x that is no 2-D array: the kernel layer's check of x
    src = inspect.getsource(DispatchLaunch.launch_dispatch)
    assert "topk_idx: required" not in src and "must be None for a cached" not in src
