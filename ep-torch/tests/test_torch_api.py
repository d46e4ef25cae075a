"""In-process unit tests of ep_torch: DeepEP-compatible signatures, events, bit-exact conversions, environment
knobs, handle tokens."""

from __future__ import annotations

import inspect

import ep_torch
import numpy as np
import pytest
import torch
from ep_torch import ElasticBuffer, EPBuffer, EPHandle, EventHandle, EventOverlap, _env, topk_idx_t
from ep_torch._convert import from_numpy, to_numpy

# DeepEP V2 (behaviour doc §1.2, §1.5.1, §1.6): names and defaults, in order.
CTOR = [
    ("group", inspect.Parameter.empty),
    ("num_bytes", None),
    ("num_cpu_bytes", 0),
    ("num_max_tokens_per_rank", 0),
    ("hidden", 0),
    ("num_topk", 0),
    ("use_fp8_dispatch", False),
    ("deterministic", False),
    ("allow_hybrid_mode", True),
    ("allow_multiple_reduction", True),
    ("prefer_overlap_with_compute", True),
    ("sl_idx", 3),
    ("num_allocated_qps", 0),
    ("num_cpu_timeout_secs", 300),
    ("num_gpu_timeout_secs", 100),
    ("explicitly_destroy", False),
]
DISPATCH = [
    ("x", inspect.Parameter.empty),
    ("topk_idx", None),
    ("topk_weights", None),
    ("cumulative_local_expert_recv_stats", None),
    ("num_experts", None),
    ("num_max_tokens_per_rank", None),
    ("expert_alignment", None),
    ("num_sms", 0),
    ("num_qps", 0),
    ("previous_event", None),
    ("previous_event_before_epilogue", None),
    ("async_with_compute_stream", False),
    ("allocate_on_comm_stream", False),
    ("handle", None),
    ("do_handle_copy", True),
    ("do_cpu_sync", None),
    ("do_expand", False),
    ("do_zero_padding", False),
    ("use_tma_aligned_col_major_sf", False),
]
COMBINE = [
    ("x", inspect.Parameter.empty),
    ("handle", inspect.Parameter.empty),
    ("topk_weights", None),
    ("bias", None),
    ("num_sms", 0),
    ("num_qps", 0),
    ("previous_event", None),
    ("previous_event_before_epilogue", None),
    ("async_with_compute_stream", False),
    ("allocate_on_comm_stream", False),
]


def _params(fn, skip_self=True):
    ps = list(inspect.signature(fn).parameters.values())
    if skip_self:
        ps = ps[1:]
    return [(p.name, p.default) for p in ps if p.kind is not inspect.Parameter.KEYWORD_ONLY]


@pytest.mark.parametrize("cls", [ElasticBuffer])  # EPBuffer: DeepEP 2.5's order (test_torch_epbuffer_25.py)
def test_signatures_match_deepep(cls):
    assert _params(cls.__init__) == CTOR
    assert _params(cls.dispatch) == DISPATCH
    assert _params(cls.combine) == COMBINE
    size_hint = inspect.signature(cls.get_buffer_size_hint).parameters
    assert list(size_hint) == [
        "group",
        "num_max_tokens_per_rank",
        "hidden",
        "num_topk",
        "use_fp8_dispatch",
        "allow_hybrid_mode",
        "allow_multiple_reduction",
    ]
    sms = inspect.signature(cls.get_theoretical_num_sms).parameters
    assert [(n, p.default) for n, p in sms.items()][1:] == [
        ("num_experts", inspect.Parameter.empty),
        ("num_topk", inspect.Parameter.empty),
        ("num_scaleout_topk", 0),
        ("rdma_gbs", 0),
        ("nvlink_gbs", 0),
        ("sm_read_gbs", 200),
        ("sm_write_gbs", 50),
    ]
    barrier = inspect.signature(cls.barrier).parameters
    assert [(n, p.default) for n, p in barrier.items()][1:] == [
        ("use_comm_stream", True),
        ("with_cpu_sync", False),
        ("sequential", True),
    ]
    for name in (
        "destroy",
        "capture",
        "get_comm_stream",
        "get_physical_domain_size",
        "get_logical_domain_size",
        "get_theoretical_num_qps",
    ):
        assert callable(getattr(cls, name))


def test_exports():
    assert set(ep_torch.__all__) >= {
        "ElasticBuffer",
        "EPBuffer",
        "EPHandle",
        "EventOverlap",
        "EventHandle",
        "topk_idx_t",
    }
    assert topk_idx_t is torch.int64
    assert ep_torch.__version__ == "0.1.0"
    assert issubclass(EPBuffer, ElasticBuffer)
    import ep_core

    assert EPHandle is ep_core.EPHandle  # one handle type: ep-core's, holding torch tensors
    # DeepEP's positional order of the handle's fields
    names = [f for f in EPHandle.__dataclass_fields__][:16]
    assert names == [
        "do_expand",
        "num_experts",
        "expert_alignment",
        "num_max_tokens_per_rank",
        "num_sms",
        "topk_idx",
        "num_recv_tokens",
        "num_expanded_tokens",
        "num_recv_tokens_per_expert_list",
        "psum_num_recv_tokens_per_scaleup_rank",
        "psum_num_recv_tokens_per_expert",
        "num_unaligned_recv_tokens_per_expert",
        "recv_src_metadata",
        "dst_buffer_slot_idx",
        "token_metadata_at_forward",
        "channel_linked_list",
    ]


def test_event_overlap_semantics():
    calls = []
    ev = EventOverlap(EventHandle(device="cpu"))
    ev.register_hook_after_wait(lambda: calls.append("hook"))
    with pytest.raises(RuntimeError, match="already registered"):
        ev.register_hook_after_wait(lambda: None)
    with ev:
        calls.append("body")
    assert calls == ["body", "hook"]
    ev.current_stream_wait(release_handle=True)  # hook ran once; waiting again is fine
    assert calls == ["body", "hook"] and ev.event is None
    with pytest.raises(RuntimeError, match="async_with_compute_stream"):
        EventOverlap(None).current_stream_wait()
    with EventOverlap(None):  # no event: the context manager does nothing
        pass
    kept = EventOverlap(EventHandle(device="cpu"), extra_tensors=[torch.zeros(1)])
    with kept(release_handle=True):
        pass
    assert kept.event is None and kept.extra_tensors is None
    assert EventHandle(device="cpu").query() and EventHandle(device="cpu").is_cpu


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float16, torch.float32, torch.int64]
)
def test_conversions_are_bit_exact(dtype):
    g = torch.Generator().manual_seed(0)
    if dtype.is_floating_point:
        t = (torch.randn(7, 32, generator=g) * 100).to(dtype)
    else:
        t = torch.randint(-(2**40), 2**40, (7, 32), generator=g, dtype=dtype)
    a = to_numpy(t)
    if dtype is torch.bfloat16:
        assert a.dtype == np.uint16
        assert np.array_equal(a, t.view(torch.int16).numpy().view(np.uint16))
    if dtype is torch.float8_e4m3fn:
        assert a.dtype == np.uint8
    back = from_numpy(a, dtype)
    assert back.dtype == dtype
    assert torch.equal(back.view(torch.uint8), t.contiguous().view(torch.uint8))
    # strided input: the values, not the strides, travel
    assert torch.equal(
        from_numpy(to_numpy(t.t()), dtype).view(torch.uint8), t.t().contiguous().view(torch.uint8)
    )


def test_bf16_bits_match_ep_core():
    from ep_core.bf16 import float32_to_bf16

    f = np.random.default_rng(1).standard_normal(1000).astype(np.float32) * 1e3
    assert np.array_equal(to_numpy(torch.from_numpy(f).bfloat16()), float32_to_bf16(f))


def test_env_knobs(monkeypatch):
    monkeypatch.setenv("EPKIT_AVOID_RECORD_STREAM", "1")
    assert _env.avoid_record_stream()
    monkeypatch.setenv("EPKIT_AVOID_RECORD_STREAM", "maybe")
    with pytest.raises(ValueError, match="EPKIT_AVOID_RECORD_STREAM"):
        _env.avoid_record_stream()
    monkeypatch.setenv("EPKIT_TORCH_TRANSPORT", "carrier")
    with pytest.raises(ValueError, match="EPKIT_TORCH_TRANSPORT"):
        _env.transport()
    monkeypatch.setenv("EPKIT_TORCH_REFERENCE_NUM_SMS", "78")
    assert _env.reference_num_sms() == 78
    assert all(name.startswith("EPKIT_") for name in _env.knobs)


def test_handle_token_errors():
    from ep_torch import functional

    with pytest.raises(TypeError, match="handle token"):
        functional.get_handle(torch.zeros(3))
    with pytest.raises(RuntimeError, match="unknown or was released"):
        functional.get_handle(torch.full((1, 2, 2), 10**9, dtype=torch.int64))


def test_buffer_needs_a_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        ElasticBuffer(None, num_max_tokens_per_rank=8, hidden=64)
