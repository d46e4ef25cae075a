"""``combine(..., out_dtype=torch.float32)``: the combined tokens in float32 (DeepEP 2.6 added an optional FP32
combine output; its source, and so its argument's name, was not available to ep: ``out_dtype`` is ep's name).

The float32 output is the home rank's final float32 sum itself (biases first, then the operands in ascending order
of their representative lane, SPEC §3), not rounded to bf16; every earlier reduction level still rounds to bf16 as
before. So the ordinary bf16 output is exactly this output rounded to nearest even. ``out_dtype=None`` (the default)
or ``torch.bfloat16`` is the ordinary combine; other dtypes are refused (``EPTypeError`` naming ``out_dtype``).

The CPU reference backend runs it here, beside the ordinary combine road (which another change is reshaping): the
arguments go through ep-core's one validator (``validate_combine``), the step is the reference executor's combine (``fp32_output``:
``out_dtype`` in its envelope's configuration (ranks that mix a float32 and a bf16 combine all raise
``EPMismatchError``), the sum through ``ep_core.reference.combine(fp32_output=True)``. Refused with ``defer_epilogue``
and ``zero_copy`` (ours). On CUDA: ``NotImplementedError`` naming ``out_dtype`` (the reduce epilogue kernel writes
bf16; the road needs an ``out_dtype`` field in ``CombineArgs`` and a float32 store in the epilogue).
"""

from __future__ import annotations

from typing import Any

import torch
from ep_core.device_array import to_numpy
from ep_core.errors import EPTypeError, EPValueError
from ep_core.requests import CombineArgs
from ep_core.validation import validate_combine

from .event import EventHandle, EventOverlap

__all__ = ["combine_out_dtype"]


def combine_out_dtype(
    buf: Any,
    out_dtype: Any,
    x: Any,
    handle: Any,
    topk_weights: Any,
    bias: Any,
    num_sms: Any,
    num_qps: Any,
    previous_event: Any,
    previous_event_before_epilogue: Any,
    async_with_compute_stream: Any,
    allocate_on_comm_stream: Any,
    defer_epilogue: Any,
    zero_copy: Any,
) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap]:
    """``buf.combine(...)`` with ``out_dtype`` given (module doc)."""
    with buf._core.announcing("combine"):
        if out_dtype is not torch.float32:
            raise EPTypeError(f"out_dtype: expected None, torch.bfloat16 or torch.float32, got {out_dtype!r}")
        if defer_epilogue is not False or zero_copy is not False:
            raise EPValueError(
                "out_dtype: torch.float32 is not combined with defer_epilogue or zero_copy in ep (ours); drop one"
            )
        if buf._cuda:
            raise NotImplementedError(
                "out_dtype=torch.float32: the float32 combine output runs on the CPU reference backend only in ep; "
                "the CUDA reduce epilogue writes bf16"
            )
        rt = buf._rt()
        ex = rt._executor
        req = validate_combine(
            rt.config,
            ex,
            CombineArgs(
                x,
                handle,
                topk_weights,
                bias,
                num_sms,
                num_qps,
                previous_event,
                previous_event_before_epilogue,
                bool(async_with_compute_stream),
                bool(allocate_on_comm_stream),
                ex.default_allocator,
                0,
                False,
            ),
        )
        out = ex.combine(req, fp32_output=True)
    # copies: a numpy view of a host DeviceArray does not keep the array's storage alive
    combined_x = torch.from_numpy(to_numpy(out.combined_x).copy())
    w = out.combined_topk_weights
    combined_w = None if w is None else torch.from_numpy(to_numpy(w).copy())
    event = EventOverlap(EventHandle(device="cpu")) if async_with_compute_stream else EventOverlap(None)
    return combined_x, combined_w, event
