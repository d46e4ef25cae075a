"""Differentiable dispatch and combine, registered as ``torch.library`` custom ops (opaque operators inside
``torch.compile``: ``torch.ops.ep_torch.dispatch`` / ``combine`` / ``cached_dispatch``).

``dispatch(buffer, x, topk_idx, topk_weights, num_experts=...)`` returns ``(recv_x, recv_topk_idx,
recv_topk_weights, handle)`` and ``combine(buffer, y, handle)`` returns ``combined_y``. Gradients (DeepEP's recipe,
the handle reused so nothing is recomputed):

- dispatch backward = combine of ``grad_recv_x`` with ``topk_weights = grad_recv_topk_weights`` masked to the lanes
  that live on the receiving rank (a lane's weight is owned by the rank of its expert; uses of a non-local lane's
  weight are not differentiated); the combined top-k weights are the gradient of ``topk_weights``;
- combine backward = cached dispatch of ``grad_combined``; the gradient of combine's ``topk_weights`` is the cached
  dispatch's weights at the owner lanes.

The ``handle`` here is a small int64 host tensor ``[1 + do_expand, num_tokens + 1, num_topk]`` (a *handle token*):
its ``[0, 0, 0]`` element names the :class:`~ep_torch.EPHandle` kept in a registry while the token lives, and its
shape carries the sizes ``torch.compile`` needs; :func:`get_handle` returns the ``EPHandle``.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import TYPE_CHECKING, Any

import torch
from ep_core.errors import EPValueError

if TYPE_CHECKING:
    from ep_core.handle import EPHandle

    from .buffer import ElasticBuffer

__all__ = ["combine", "dispatch", "get_handle", "register_buffer"]

_lock = threading.Lock()
_ids = itertools.count(1)
_buffers: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_handles: dict[int, Any] = {}


def register_buffer(buffer: ElasticBuffer) -> int:
    """The id under which the custom ops find ``buffer`` (registered once, held weakly)."""
    bid = getattr(buffer, "_functional_id", None)
    if bid is None:
        with _lock:
            bid = next(_ids)
            _buffers[bid] = buffer
        buffer._functional_id = bid
    return bid


def _buffer(bid: int) -> ElasticBuffer:
    try:
        return _buffers[bid]
    except KeyError:
        raise RuntimeError(
            f"ep_torch.functional: buffer #{bid} no longer exists (was it destroyed?)"
        ) from None


def _new_token(handle: EPHandle, num_tokens: int, num_topk: int, do_expand: bool) -> torch.Tensor:
    with _lock:
        hid = next(_ids)
        _handles[hid] = handle
    # on the host whatever the data's device: reading the id never synchronizes a GPU (CUDA graphs allowed)
    token = torch.zeros(1 + int(do_expand), num_tokens + 1, num_topk, dtype=torch.int64)
    token[0, 0, 0] = hid
    weakref.finalize(token, _handles.pop, hid, None)
    return token


def get_handle(token: torch.Tensor) -> EPHandle:
    """The :class:`~ep_torch.EPHandle` that a handle token (returned by :func:`dispatch`) stands for."""
    if not isinstance(token, torch.Tensor) or token.dtype != torch.int64 or token.dim() != 3:
        raise TypeError(
            f"handle: expected the int64 [1 + do_expand, num_tokens + 1, num_topk] handle token returned by "
            f"ep_torch.functional.dispatch, got {type(token).__name__}"
            + (f" {token.dtype} {tuple(token.shape)}" if isinstance(token, torch.Tensor) else "")
        )
    hid = int(token[0, 0, 0].item())
    try:
        return _handles[hid]
    except KeyError:
        raise RuntimeError(
            f"handle: handle #{hid} is unknown or was released; pass the token returned by this process's dispatch"
        ) from None


# --------------------------------------------------------------------------------------------------------------------
# The operators.


@torch.library.custom_op("ep_torch::dispatch", mutates_args=())
def _dispatch_op(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    buffer_id: int,
    num_experts: int,
    expert_alignment: int,
    do_expand: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    buffer = _buffer(buffer_id)
    recv_x, recv_topk_idx, recv_topk_weights, handle, _ = buffer.dispatch(
        x,
        topk_idx=topk_idx,
        topk_weights=topk_weights,
        num_experts=num_experts,
        expert_alignment=expert_alignment,
        do_expand=do_expand,
        do_cpu_sync=True,
    )
    if recv_topk_idx is None:  # expand layout: no per-row ids
        recv_topk_idx = torch.empty(0, topk_idx.shape[1], dtype=torch.int64, device=x.device)
    token = _new_token(handle, x.shape[0], topk_idx.shape[1], do_expand)
    return recv_x, recv_topk_idx, recv_topk_weights, token


@_dispatch_op.register_fake
def _(x, topk_idx, topk_weights, buffer_id, num_experts, expert_alignment, do_expand):
    ctx = torch.library.get_ctx()
    rows = ctx.new_dynamic_size()
    k = topk_idx.shape[1]
    recv_x = x.new_empty(rows, x.shape[1])
    if do_expand:
        return (
            recv_x,
            topk_idx.new_empty(0, k),
            topk_weights.new_empty(rows),
            torch.empty(2, x.shape[0] + 1, k, dtype=torch.int64, device="cpu"),
        )
    return (
        recv_x,
        topk_idx.new_empty(rows, k),
        topk_weights.new_empty(rows, k),
        torch.empty(1, x.shape[0] + 1, k, dtype=torch.int64, device="cpu"),
    )


@torch.library.custom_op("ep_torch::combine", mutates_args=())
def _combine_op(
    x: torch.Tensor, token: torch.Tensor, topk_weights: torch.Tensor | None, buffer_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    buffer = _buffer(buffer_id)
    combined_x, combined_w, _ = buffer.combine(x, get_handle(token), topk_weights=topk_weights)
    if combined_w is None:
        combined_w = torch.empty(0, token.shape[2], dtype=torch.float32, device=x.device)
    return combined_x, combined_w


@_combine_op.register_fake
def _(x, token, topk_weights, buffer_id):
    t, k = token.shape[1] - 1, token.shape[2]
    w_rows = t if topk_weights is not None else 0
    return x.new_empty(t, x.shape[1]), x.new_empty(w_rows, k, dtype=torch.float32)


@torch.library.custom_op("ep_torch::cached_dispatch", mutates_args=())
def _cached_dispatch_op(
    x: torch.Tensor, token: torch.Tensor, topk_weights: torch.Tensor | None, buffer_id: int, num_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    buffer = _buffer(buffer_id)
    handle = get_handle(token)
    recv_x, recv_topk_idx, recv_w, _, _ = buffer.dispatch(x, handle=handle, topk_weights=topk_weights)
    if recv_w is None:
        recv_w = torch.empty(0, token.shape[2], dtype=torch.float32, device=x.device)
    elif recv_topk_idx is not None:  # non-expand: only the owner lanes carry the weight's gradient
        recv_w = recv_w.masked_fill(recv_topk_idx < 0, 0.0)
    return recv_x, recv_w


@_cached_dispatch_op.register_fake
def _(x, token, topk_weights, buffer_id, num_rows):
    rows = num_rows if num_rows >= 0 else torch.library.get_ctx().new_dynamic_size()
    k = token.shape[2]
    if topk_weights is None:
        return x.new_empty(rows, x.shape[1]), x.new_empty(0, k, dtype=torch.float32)
    w_shape = (rows,) if token.shape[0] == 2 else (rows, k)  # expand layout: one weight per row
    return x.new_empty(rows, x.shape[1]), x.new_empty(*w_shape, dtype=torch.float32)


# --------------------------------------------------------------------------------------------------------------------
# Autograd.


def _dispatch_setup(ctx, inputs, output) -> None:
    _, _, _, buffer_id, _, _, do_expand = inputs
    _, recv_topk_idx, _, token = output
    ctx.buffer_id = buffer_id
    ctx.do_expand = do_expand
    ctx.save_for_backward(token, recv_topk_idx)


def _dispatch_backward(ctx, grad_recv_x, grad_recv_topk_idx, grad_recv_w, grad_token):
    token, recv_topk_idx = ctx.saved_tensors
    if not ctx.do_expand:
        grad_recv_w = grad_recv_w.masked_fill(recv_topk_idx < 0, 0.0)
    grad_x, grad_w = torch.ops.ep_torch.combine(
        grad_recv_x.contiguous(), token, grad_recv_w.contiguous().float(), ctx.buffer_id
    )
    return grad_x, None, grad_w, None, None, None, None


torch.library.register_autograd("ep_torch::dispatch", _dispatch_backward, setup_context=_dispatch_setup)


def _combine_setup(ctx, inputs, output) -> None:
    x, token, topk_weights, buffer_id = inputs
    ctx.num_rows = x.shape[0]
    ctx.buffer_id = buffer_id
    ctx.has_weights = topk_weights is not None
    ctx.save_for_backward(token)


def _combine_backward(ctx, grad_combined_x, grad_combined_w):
    (token,) = ctx.saved_tensors
    grad_w_in = grad_combined_w.contiguous().float() if ctx.has_weights else None
    grad_x, grad_w = torch.ops.ep_torch.cached_dispatch(
        grad_combined_x.contiguous(), token, grad_w_in, ctx.buffer_id, ctx.num_rows
    )
    return grad_x, None, (grad_w if ctx.has_weights else None), None


torch.library.register_autograd("ep_torch::combine", _combine_backward, setup_context=_combine_setup)


def _cached_dispatch_setup(ctx, inputs, output) -> None:
    _, token, topk_weights, buffer_id, _ = inputs
    ctx.buffer_id = buffer_id
    ctx.has_weights = topk_weights is not None
    ctx.save_for_backward(token)


def _cached_dispatch_backward(ctx, grad_recv_x, grad_recv_w):
    (token,) = ctx.saved_tensors
    grad_w_in = grad_recv_w.contiguous().float() if ctx.has_weights else None
    grad_x, grad_w = torch.ops.ep_torch.combine(grad_recv_x.contiguous(), token, grad_w_in, ctx.buffer_id)
    return grad_x, None, (grad_w if ctx.has_weights else None), None, None


torch.library.register_autograd(
    "ep_torch::cached_dispatch", _cached_dispatch_backward, setup_context=_cached_dispatch_setup
)


# --------------------------------------------------------------------------------------------------------------------
# Public functions.


def dispatch(
    buffer: ElasticBuffer,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    num_experts: int,
    expert_alignment: int = 1,
    do_expand: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Differentiable ``buffer.dispatch`` (with CPU sync: exact output sizes).

    Returns ``(recv_x, recv_topk_idx, recv_topk_weights, handle)``; ``recv_topk_idx`` is None in the expand layout.
    Gradients flow to ``x`` and ``topk_weights``.
    """
    if do_expand and not buffer.allow_multiple_reduction and topk_weights.requires_grad:
        raise EPValueError(
            "topk_weights: its gradient in the expand layout is a combine with weights, which needs "
            "allow_multiple_reduction=True; build the buffer with it, or detach topk_weights"
        )
    recv_x, recv_topk_idx, recv_w, token = torch.ops.ep_torch.dispatch(
        x,
        topk_idx,
        topk_weights,
        register_buffer(buffer),
        int(num_experts),
        int(expert_alignment),
        bool(do_expand),
    )
    return recv_x, (None if do_expand else recv_topk_idx), recv_w, token


def combine(
    buffer: ElasticBuffer, x: torch.Tensor, handle: torch.Tensor, topk_weights: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Differentiable ``buffer.combine`` of expert outputs ``x`` (already weighted) through ``handle``.

    Returns ``combined_x``, or ``(combined_x, combined_topk_weights)`` when ``topk_weights`` is given.
    """
    combined_x, combined_w = torch.ops.ep_torch.combine(x, handle, topk_weights, register_buffer(buffer))
    return combined_x if topk_weights is None else (combined_x, combined_w)


def cached_dispatch(
    buffer: ElasticBuffer, x: torch.Tensor, handle: torch.Tensor, topk_weights: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Differentiable cached dispatch of ``x`` through ``handle`` (same rows, same order as the original)."""
    recv_x, recv_w = torch.ops.ep_torch.cached_dispatch(x, handle, topk_weights, register_buffer(buffer), -1)
    return recv_x if topk_weights is None else (recv_x, recv_w)
