"""``combine(..., out_dtype=torch.float32)``: the combined tokens in float32 (DeepEP 2.6's optional FP32 combine
output; ``out_dtype`` is ep's name).

The float32 output is the home rank's final float32 sum itself (biases first, then the operands in ascending order
of their representative lane, SPEC §3); earlier reduction levels still round to bf16, so the ordinary output is this
one rounded to nearest even. ``None`` / ``torch.bfloat16`` is the ordinary combine; other dtypes, and
``defer_epilogue`` / ``zero_copy``, are refused. The arguments go through ep-core's ``validate_combine`` first.

CPU reference backend: the reference executor's combine with ``fp32_output`` (in its envelope, so ranks that mix a
float32 and a bf16 combine all raise ``EPMismatchError``).

CUDA (direct mode): :func:`combine_fp32_by_lanes`, ordinary combines plus torch ops. A token's operands have
distinct representative lanes, so the rows are laid out one column block per lane (``[rows, K * hidden]``, -0.0
elsewhere, the identity of IEEE addition) and combined: block ``k`` of a result is its lane-``k`` operand exactly,
and a float32 sum over the blocks in lane order, after the biases, is the reference's. The wide rows go as combines
of width ``hidden - 16`` (``32`` for hidden 16), each built just before its combine and added in as it comes: never
more bytes per row than the buffer holds, never the ordinary combine's width (a peer running an ordinary combine
meets another envelope and every rank raises). Cost: about ``K + 1`` combines instead of one; for accuracy, not
speed. It runs on the current stream after ``previous_event``; an async call's event is recorded there. Hybrid mode
is refused on CUDA (``NotImplementedError``: its second level rounds per domain). In a loopback group run one
float32 combine of the same shapes first (``ep_torch.loopback``'s rule on torch work after a communication kernel).
"""

from __future__ import annotations

from typing import Any

import torch
from ep_core.device_array import to_numpy
from ep_core.errors import EPTypeError, EPValueError
from ep_core.requests import CombineArgs
from ep_core.validation import validate_combine

from .event import EventHandle, EventOverlap

__all__ = ["combine_fp32_by_lanes", "combine_out_dtype", "lane_pass_width"]


def combine_out_dtype(buf: Any, a: CombineArgs) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap]:
    """``buf.combine(...)`` with ``out_dtype`` given (module doc), of the call's record."""
    with buf._core.announcing("combine"):
        if a.out_dtype is not torch.float32:
            raise EPTypeError(
                f"out_dtype: expected None, torch.bfloat16 or torch.float32, got {a.out_dtype!r}"
            )
        if a.defer_epilogue is not False or a.zero_copy is not False:
            raise EPValueError(
                "out_dtype: torch.float32 is not combined with defer_epilogue or zero_copy in ep (ours); drop one"
            )
        rt = buf._rt()
        ex = rt._executor
        if buf._cuda and buf.num_scaleout_ranks > 1:
            raise NotImplementedError(
                "out_dtype=torch.float32: on CUDA tensors ep computes the float32 output in direct mode only; this "
                f"buffer runs hybrid mode ({buf.num_scaleout_ranks} scale-up domains), whose per-domain bf16 "
                "reduction the float32 road does not follow (the CPU reference backend has it)"
            )
        # every argument checked before any launch, on every backend (the executor's own outputs)
        req = validate_combine(rt.config, ex, a._replace(allocator=ex.default_allocator, stream=0))
        if not buf._cuda:
            out = ex.combine(req, fp32_output=True)
    if buf._cuda:  # outside the block: each combine below is announced by its own
        if a.previous_event is not None:
            a.previous_event.current_stream_wait()
        combined_x, combined_w = combine_fp32_by_lanes(
            buf, a.x, a.handle, a.topk_weights, a.bias, a.num_sms, a.num_qps
        )
        event = EventOverlap(EventHandle()) if a.async_with_compute_stream else EventOverlap(None)
        return combined_x, combined_w, event
    # copies: a numpy view of a host DeviceArray does not keep the array's storage alive
    combined_x = torch.from_numpy(to_numpy(out.combined_x).copy())
    w = out.combined_topk_weights
    combined_w = None if w is None else torch.from_numpy(to_numpy(w).copy())
    event = EventOverlap(EventHandle(device="cpu")) if a.async_with_compute_stream else EventOverlap(None)
    return combined_x, combined_w, event


def lane_pass_width(hidden: int) -> int:
    """The width of the combines of :func:`combine_fp32_by_lanes` for rows of ``hidden``: a multiple of 16 (the
    combine's rule), not ``hidden`` itself (a different envelope than the ordinary combine's), and no wider than
    ``hidden`` where it can be (the buffer holds it)."""
    return hidden - 16 if hidden > 16 else 32


def _lane_of_row(buf: Any, x: torch.Tensor, handle: Any, k: int) -> torch.Tensor:
    """For each row of ``x``: the representative lane of the operand it feeds (-1: a row no token reads). Rows of
    the handle past the received count (no-CPU-sync worst-case sizes) are left out on the device: no sync."""
    dev = x.device
    meta = torch.as_tensor(handle.recv_src_metadata, device=dev)
    psum = torch.as_tensor(handle.psum_num_recv_tokens_per_scaleup_rank, device=dev)
    rows = meta.shape[0]
    valid = torch.arange(rows, device=dev) < psum[-1]
    master = meta[:, 1].to(torch.int64) % k  # column 1: src_rank * K + master lane (SPEC §2)
    if not handle.do_expand:  # one row per received token: the token's master lane on this rank
        return torch.where(valid, master, -1)
    n = x.shape[0]
    exp = meta[:, 2 : 2 + k].to(torch.int64)  # the expanded row of each lane, or -1
    ok = valid[:, None] & (exp >= 0) & (exp < n)
    if buf.allow_multiple_reduction:  # the rank sums a token's rows first: they all feed its master lane
        lanes = master[:, None].expand(rows, k)
    else:  # every lane travels alone: its own representative
        lanes = torch.arange(k, device=dev).expand(rows, k)
    out = torch.full((n + 1,), -1, dtype=torch.int64, device=dev)
    out.scatter_(0, torch.where(ok, exp, n).reshape(-1), lanes.reshape(-1))  # row n: the discarded ones
    return out[:n]


def combine_fp32_by_lanes(
    buf: Any,
    x: torch.Tensor,
    handle: Any,
    topk_weights: torch.Tensor | None = None,
    bias: Any = None,
    num_sms: int = 0,
    num_qps: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(combined_x float32 [T, hidden], combined_topk_weights)`` through ordinary combines of ``buf`` (module
    doc); arguments as ``combine``'s, already validated. Direct mode; any backend (the CPU tests compare it with
    the reference executor's float32 combine). A collective: every rank calls it with the same shapes.

    The wide rows ``[rows, K * hidden]`` are never built: pass ``j`` takes their columns ``[j * width, (j + 1) *
    width)`` (column ``g`` is lane ``g // hidden``, element ``g % hidden``), and its result is added into the float32
    sum lane segment by lane segment as it comes. Passes run in column order, so every element receives its lanes
    in ascending order. The sum starts from the biases' sum, or from -0.0 (``-0.0 + v == v`` for every ``v``: the
    reference's "start from the first operand")."""
    k = handle.num_topk
    xd = x.detach()
    hidden = xd.shape[1]
    dev = xd.device
    width = lane_pass_width(hidden)
    total = k * hidden
    neg0 = torch.full((), -0.0, dtype=torch.bfloat16, device=dev)
    lane = _lane_of_row(buf, xd, handle, k)[:, None]  # [rows, 1]
    idx = torch.as_tensor(handle.topk_idx, device=dev)
    if bias is None:
        biases: tuple = ()
    else:
        biases = tuple(b for b in bias if b is not None) if isinstance(bias, tuple) else (bias,)
    acc = None
    for b in biases:
        f = b.detach().float()
        acc = f if acc is None else acc + f
    has = None
    if acc is None:
        acc = torch.full((idx.shape[0], hidden), -0.0, dtype=torch.float32, device=dev)
    else:  # a token with no lane gets +0.0 from the kernel (no term at all): it keeps its biases' sum as is
        has = (idx >= 0).any(1)[:, None]
    combined_w = None
    for j in range(-(-total // width)):
        cols = torch.arange(j * width, (j + 1) * width, device=dev)  # past `total`: padding, lane >= K
        part = torch.where(lane == (cols // hidden)[None, :], xd.index_select(1, cols % hidden), neg0)
        out, w, _ = buf.combine(part, handle, topk_weights if j == 0 else None, None, num_sms, num_qps)
        if j == 0:
            combined_w = w
        lo, hi = j * width, min((j + 1) * width, total)
        for lane_k in range(lo // hidden, (hi - 1) // hidden + 1):  # this pass's lane segments, in lane order
            start, end = max(lo, lane_k * hidden), min(hi, (lane_k + 1) * hidden)
            seg = out[:, start - lo : end - lo].float()
            if has is not None:
                seg = torch.where(has, seg, torch.full((), -0.0, device=dev))
            h0 = start - lane_k * hidden
            acc[:, h0 : h0 + end - start] += seg
    return acc, combined_w
