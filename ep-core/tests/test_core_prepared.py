"""The prepared-operation cache (ep_core.prepared) is exact: a hit builds the request the full validation builds,
and a call that changes any one input the checks read gets the very error an uncached call gets."""

from __future__ import annotations

import dataclasses

import ep_core as ec
import numpy as np
import pytest
from ep_core.prepared import PreparedOps
from ep_core.validation import make_combine_request, make_dispatch_request

T, H, K, E = 4, 64, 2, 8


class _Target:
    array_device = "cpu"
    device_id = 0
    num_device_sms = 132
    nvlink_gbs = 450.0
    rdma_gbs = 50.0

    @staticmethod
    def default_allocator(shape, dtype):
        return ec.host_allocator(shape, dtype)


class _Null:
    array_device = "cpu"
    device_id = 0
    num_device_sms = 132

    def dispatch(self, req):
        return req

    def combine(self, req):
        return req

    def barrier(self):
        return None

    def destroy(self):
        return None


def _config():
    buf = ec.EPBuffer(
        ec.LocalBootstrap(),
        transport="reference",
        num_max_tokens_per_rank=T,
        hidden=H,
        num_topk=K,
        executor=_Null(),
    )
    return buf.config


def _arr(shape, dtype, fill=1):
    storage = {"bfloat16": np.uint16, "float8_e4m3fn": np.uint8}.get(dtype, dtype)
    return ec.host_array(np.full(shape, fill, storage), dtype)


def _handle(rows=T * K, idx_dtype="int64"):
    return ec.EPHandle(
        False,
        E,
        1,
        T,
        16,
        _arr((T, K), idx_dtype),
        rows,
        rows,
        [],
        _arr((1,), "int32"),
        _arr((E,), "int32"),
        _arr((E,), "int32"),
        _arr((rows, K + 2), "int32"),
        _arr((T, K), "int32"),
        num_ranks=1,
        rank=0,
    )


def _fields(req):
    """Every compared field, arrays as (pointer, layout) and the caller's object by identity (the entry's token,
    `prepared`, is checked by its own test)."""
    out = {}
    for f in dataclasses.fields(req):
        if not f.compare:
            continue
        v = getattr(req, f.name)
        if isinstance(v, ec.ArrayInfo):
            v = (v.ptr, v.shape, v.dtype, v.strides, v.device, v.device_id, id(v.obj))
        elif isinstance(v, tuple) and v and isinstance(v[0], ec.ArrayInfo):
            v = tuple((b.ptr, b.shape, b.dtype, id(b.obj)) for b in v)
        out[f.name] = v
    return out


def _outcome(fn):
    try:
        return ("ok", _fields(fn()))
    except Exception as exc:
        return ("raised", type(exc), str(exc))


def _dispatch_args():
    return {
        "x": _arr((T, H), "bfloat16"),
        "topk_idx": _arr((T, K), "int64"),
        "topk_weights": _arr((T, K), "float32"),
        "num_experts": E,
        "num_sms": 16,
        "do_cpu_sync": False,
    }


def _both_dispatch(config, target, prepared, kw):
    kw = dict(kw)
    x, idx, w = kw.pop("x"), kw.pop("topk_idx", None), kw.pop("topk_weights", None)
    cached = _outcome(lambda: prepared.dispatch_request(target, x, idx, w, **kw))
    full = _outcome(lambda: make_dispatch_request(config, target, x, idx, w, **kw))
    return cached, full


def test_a_repeated_dispatch_is_served_from_the_cache_with_this_calls_pointers():
    config, target = _config(), _Target()
    prepared = PreparedOps(config)
    for _ in range(3):
        kw = _dispatch_args()  # new arrays, new pointers, same shapes
        cached, full = _both_dispatch(config, target, prepared, kw)
        assert cached == full and cached[0] == "ok"
    assert (prepared.hits, prepared.misses) == (2, 1)


# one change to the warm call's arguments each; the cached path must answer as the uncached one does
_DISPATCH_CHANGES = {
    "x dtype": {"x": _arr((T, H), "float32")},
    "x rows": {"x": _arr((T + 1, H), "bfloat16")},
    "x hidden": {"x": _arr((T, H + 16), "bfloat16")},
    "x strides": {"x": ec.DeviceArray(1 << 30, (T, H), "bfloat16", (4 * H, 2), device="cpu")},
    "x on cuda": {"x": ec.DeviceArray(1 << 30, (T, H), "bfloat16", device="cuda")},
    "x as a list": {"x": [1, 2]},
    "x fp8 tuple": {"x": (_arr((T, H), "float8_e4m3fn"), _arr((T, 2), "float32"))},
    "x fp8 bad sf rows": {"x": (_arr((T, H), "float8_e4m3fn"), _arr((T + 1, 2), "float32"))},
    "x tuple of three": {"x": (_arr((T, H), "bfloat16"),) * 3},
    "topk_idx dtype": {"topk_idx": _arr((T, K), "float32")},
    "topk_idx int32": {"topk_idx": _arr((T, K), "int32")},
    "topk_idx shape": {"topk_idx": _arr((T, K + 1), "int64")},
    "topk_idx missing": {"topk_idx": None},
    "topk_weights shape": {"topk_weights": _arr((T, K + 1), "float32")},
    "topk_weights dtype": {"topk_weights": _arr((T, K), "float64")},
    "topk_weights none": {"topk_weights": None},
    "num_experts float": {"num_experts": float(E)},
    "num_experts bool": {"num_experts": True},
    "num_experts other": {"num_experts": 2 * E},
    "num_sms float": {"num_sms": 16.0},
    "num_sms too many": {"num_sms": 1000},
    "num_sms planner": {"num_sms": 0},
    "num_qps": {"num_qps": 1 << 20},
    "do_cpu_sync int": {"do_cpu_sync": 0},
    "do_cpu_sync true": {"do_cpu_sync": True},
    "do_expand int": {"do_expand": 1},
    "do_zero_padding": {"do_zero_padding": True},
    "expert_alignment": {"expert_alignment": 0},
    "num_max_tokens_per_rank": {"num_max_tokens_per_rank": T - 1},
    "previous_event": {"previous_event": object()},
    "allocator": {"allocator": 3},
    "stream": {"stream": "abc"},
    "stats": {"cumulative_local_expert_recv_stats": _arr((E,), "int32")},
    "stats shape": {"cumulative_local_expert_recv_stats": _arr((E + 1,), "int32")},
}


@pytest.mark.parametrize("change", sorted(_DISPATCH_CHANGES))
def test_a_changed_dispatch_input_is_validated_like_an_uncached_call(change):
    config, target = _config(), _Target()
    prepared = PreparedOps(config)
    warm = _dispatch_args()
    _both_dispatch(config, target, prepared, warm)
    cached, full = _both_dispatch(config, target, prepared, warm | _DISPATCH_CHANGES[change])
    assert cached == full
    # and the warm call still answers as before (an error is never cached)
    assert _both_dispatch(config, target, prepared, _dispatch_args())[0][0] == "ok"


def test_a_changed_executor_attribute_is_validated_again():
    config, target = _config(), _Target()
    prepared = PreparedOps(config)
    kw = _dispatch_args()
    _both_dispatch(config, target, prepared, kw)
    target.num_device_sms = 8  # fewer SMs than num_sms=16
    cached, full = _both_dispatch(config, target, prepared, _dispatch_args())
    assert cached == full and cached[0] == "raised"


def _cached_args(handle):
    return {"x": _arr((T, H), "bfloat16"), "handle": handle, "num_sms": 16}


_CACHED_CHANGES = {
    "x rows": {"x": _arr((T - 1, H), "bfloat16")},
    "topk_idx given": {"topk_idx": _arr((T, K), "int64")},
    "do_cpu_sync": {"do_cpu_sync": True},
    "do_expand": {"do_expand": True},
    "num_experts differs": {"num_experts": 2 * E},
    "handle not a handle": {"handle": object()},
    "stats": {"cumulative_local_expert_recv_stats": _arr((E,), "int32")},
}


@pytest.mark.parametrize("change", sorted(_CACHED_CHANGES))
def test_a_changed_cached_dispatch_input_is_validated_like_an_uncached_call(change):
    config, target = _config(), _Target()
    prepared = PreparedOps(config)
    h = _handle()
    _both_dispatch(config, target, prepared, _cached_args(h))
    cached, full = _both_dispatch(config, target, prepared, _cached_args(h) | _CACHED_CHANGES[change])
    assert cached == full


@pytest.mark.parametrize(
    "field, value",
    [
        ("recv_src_metadata", _arr((T * K, K + 3), "int32")),
        ("psum_num_recv_tokens_per_scaleup_rank", _arr((2,), "int32")),
        ("dst_buffer_slot_idx", _arr((T, K), "int64")),
        ("num_recv_tokens", T * K - 1),
        ("rank", 3),
    ],
)
def test_a_changed_handle_is_validated_again(field, value):
    config, target = _config(), _Target()
    prepared = PreparedOps(config)
    h = _handle()
    assert _both_dispatch(config, target, prepared, _cached_args(h))[0][0] == "ok"
    setattr(h, field, value)
    cached, full = _both_dispatch(config, target, prepared, _cached_args(h))
    assert cached == full and cached[0] == "raised"
    cached, full = _both_combine(config, target, prepared, _combine_args(h))
    assert cached == full and cached[0] == "raised"


def _combine_args(handle):
    return {"x": _arr((handle.num_recv_tokens, H), "bfloat16"), "handle": handle, "num_sms": 16}


def _both_combine(config, target, prepared, kw):
    kw = dict(kw)
    x, h = kw.pop("x"), kw.pop("handle")
    cached = _outcome(lambda: prepared.combine_request(target, x, h, **kw))
    full = _outcome(lambda: make_combine_request(config, target, x, h, **kw))
    return cached, full


def test_a_repeated_combine_is_served_from_the_cache():
    config, target = _config(), _Target()
    prepared = PreparedOps(config)
    h = _handle()
    for _ in range(3):
        cached, full = _both_combine(config, target, prepared, _combine_args(h))
        assert cached == full and cached[0] == "ok"
    assert (prepared.hits, prepared.misses) == (2, 1)


_COMBINE_CHANGES = {
    "x dtype": {"x": _arr((T * K, H), "float32")},
    "x rows": {"x": _arr((T * K + 1, H), "bfloat16")},
    "x tuple": {"x": (_arr((T * K, H), "bfloat16"),)},
    "weights": {"topk_weights": _arr((T * K, K), "float32")},
    "weights shape": {"topk_weights": _arr((T * K,), "float32")},
    "bias": {"bias": _arr((T, H), "bfloat16")},
    "bias shape": {"bias": _arr((T + 1, H), "bfloat16")},
    "bias pair": {"bias": (_arr((T, H), "bfloat16"), _arr((T, H), "bfloat16"))},
    "bias pair of one": {"bias": (_arr((T, H), "bfloat16"),)},
    "bias list": {"bias": [_arr((T, H), "bfloat16")]},
    "num_sms float": {"num_sms": 16.0},
    "num_qps": {"num_qps": -1},
    "async int": {"async_with_compute_stream": 1},
    "previous_event": {"previous_event": object()},
    "allocator": {"allocator": "no"},
    "stream": {"stream": -1},
    "handle none": {"handle": None},
}


@pytest.mark.parametrize("change", sorted(_COMBINE_CHANGES))
def test_a_changed_combine_input_is_validated_like_an_uncached_call(change):
    config, target = _config(), _Target()
    prepared = PreparedOps(config)
    h = _handle()
    _both_combine(config, target, prepared, _combine_args(h))
    cached, full = _both_combine(config, target, prepared, _combine_args(h) | _COMBINE_CHANGES[change])
    assert cached == full


def test_epbuffer_uses_the_cache_and_stays_exact():
    boot = ec.LocalBootstrap()
    buf = ec.EPBuffer(boot, transport="reference", num_max_tokens_per_rank=T, hidden=H, num_topk=K)
    x = ec.host_array(np.arange(T * H, dtype=np.uint16).reshape(T, H), "bfloat16")
    idx = ec.host_array(np.array([[0, 1], [2, 3], [4, 5], [6, 7]], np.int64))
    first = buf.dispatch(x, idx, num_experts=E)
    second = buf.dispatch(x, idx, num_experts=E)
    assert buf._prepared.hits >= 1
    assert ec.to_numpy(first.recv_x).tobytes() == ec.to_numpy(second.recv_x).tobytes()
    with pytest.raises(ec.EPTypeError, match="num_experts: expected an int"):
        buf.dispatch(x, idx, num_experts=float(E))


def test_requests_of_one_entry_share_its_token():
    """`request.prepared` names the entry that served it (an executor keeps its per-shape plan there): the same
    token for every request of one key, a new one for another key, none for the validation alone."""
    config, target = _config(), _Target()
    prepared = PreparedOps(config)
    kw = _dispatch_args()
    x, idx, w = kw.pop("x"), kw.pop("topk_idx"), kw.pop("topk_weights")
    first = prepared.dispatch_request(target, x, idx, w, **kw)
    again = prepared.dispatch_request(target, _arr((T, H), "bfloat16"), _arr((T, K), "int64"), w, **kw)
    assert isinstance(first.prepared, ec.requests.PreparedToken) and again.prepared is first.prepared
    other = prepared.dispatch_request(target, x, idx, None, **kw)
    assert other.prepared is not None and other.prepared is not first.prepared
    assert make_dispatch_request(config, target, x, idx, w, **kw).prepared is None
    handle = _handle()
    recv = _arr((T * K, H), "bfloat16")
    c1 = prepared.combine_request(target, recv, handle)
    c2 = prepared.combine_request(target, _arr((T * K, H), "bfloat16"), handle)
    assert c1.prepared is c2.prepared is not None
    assert make_combine_request(config, target, recv, handle).prepared is None


# the previous call's key is compared first (PreparedOps._last_dispatch / _last_combine): a change right after a
# repeat (a hit, which sets it) must still be validated like an uncached call, and so must the repeat after it
@pytest.mark.parametrize("change", sorted(_DISPATCH_CHANGES))
def test_a_change_after_a_repeated_dispatch_is_validated_like_an_uncached_call(change):
    config, target = _config(), _Target()
    prepared = PreparedOps(config)
    for _ in range(2):
        assert _both_dispatch(config, target, prepared, _dispatch_args())[0][0] == "ok"
    assert prepared.hits == 1
    for _ in range(2):  # changed, warm, changed again (now possibly an entry of its own), warm
        cached, full = _both_dispatch(config, target, prepared, _dispatch_args() | _DISPATCH_CHANGES[change])
        assert cached == full
        cached, full = _both_dispatch(config, target, prepared, _dispatch_args())
        assert cached == full and cached[0] == "ok"


@pytest.mark.parametrize("change", sorted(_CACHED_CHANGES))
def test_a_change_after_a_repeated_cached_dispatch_is_validated_like_an_uncached_call(change):
    config, target = _config(), _Target()
    prepared = PreparedOps(config)
    h = _handle()
    for _ in range(2):
        assert _both_dispatch(config, target, prepared, _cached_args(h))[0][0] == "ok"
    for _ in range(2):
        cached, full = _both_dispatch(config, target, prepared, _cached_args(h) | _CACHED_CHANGES[change])
        assert cached == full
        cached, full = _both_dispatch(config, target, prepared, _cached_args(h))
        assert cached == full and cached[0] == "ok"


@pytest.mark.parametrize("change", sorted(_COMBINE_CHANGES))
def test_a_change_after_a_repeated_combine_is_validated_like_an_uncached_call(change):
    config, target = _config(), _Target()
    prepared = PreparedOps(config)
    h = _handle()
    for _ in range(2):
        assert _both_combine(config, target, prepared, _combine_args(h))[0][0] == "ok"
    assert prepared.hits == 1
    for _ in range(2):
        cached, full = _both_combine(config, target, prepared, _combine_args(h) | _COMBINE_CHANGES[change])
        assert cached == full
        cached, full = _both_combine(config, target, prepared, _combine_args(h))
        assert cached == full and cached[0] == "ok"


@pytest.mark.parametrize(
    "field, value, raises",
    [
        ("recv_src_metadata", _arr((T * K, K + 3), "int32"), True),
        ("recv_src_metadata", _arr((T * K, K + 2), "float32"), True),
        ("topk_idx", _arr((T, K + 1), "int64"), True),
        ("num_recv_tokens", T * K - 1, True),
        ("rank", 3, True),
        ("do_expand", True, None),
        ("num_sms", 0, None),
        ("num_expanded_tokens", T * K + 4, None),
        ("expert_alignment", 4, None),
        ("num_max_tokens_per_rank", T + 1, None),
    ],
)
def test_a_handle_changed_after_a_repeat_is_validated_again(field, value, raises):
    """The handle's part of the key and its fingerprint (`validation.handle_fingerprint`, read once per call) after
    a hit: a re-shaped or replaced array, a scalar field; then the original handle is served again."""
    config, target = _config(), _Target()
    prepared = PreparedOps(config)
    h = _handle()
    for _ in range(2):
        assert _both_combine(config, target, prepared, _combine_args(h))[0][0] == "ok"
        assert _both_dispatch(config, target, prepared, _cached_args(h))[0][0] == "ok"
    old = getattr(h, field)
    setattr(h, field, value)
    for _ in range(2):
        for cached, full in (
            _both_combine(config, target, prepared, _combine_args(h)),
            _both_dispatch(config, target, prepared, _cached_args(h)),
        ):
            assert cached == full
            if raises:
                assert cached[0] == "raised", field
    setattr(h, field, old)
    assert _both_combine(config, target, prepared, _combine_args(h))[0][0] == "ok"
    assert _both_dispatch(config, target, prepared, _cached_args(h))[0][0] == "ok"
