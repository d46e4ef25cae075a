"""DeepEP 2.5's ``EPBuffer`` call surface on ep's ``ElasticBuffer`` (issue 42).

DeepEP 2.5 (``deep_ep/buffers/ep.py``) reordered V2's parameters; code written for it passes them positionally as
well as by name, so ``EPBuffer`` takes them in 2.5's order with 2.5's defaults (the signatures below). ep's own
parameters that 2.5 lacks are keyword-only: V2's ``num_cpu_bytes`` (2.5 moved the Engram host part to
``EngramBuffer``) and ``transport``; ``previous_event_before_epilogue``, ``zero_copy`` and (combine) ``out_dtype``.
``sl_idx=None`` is ep's traffic class 3; ``do_handle_copy=False`` by default (2.5 refuses True; ep still copies when
asked); an odd ``num_sms`` is rounded up to even, as 2.5 does (``handle.num_sms`` too).

Each method forwards to ``ElasticBuffer``'s: the constructor by name (``_by_name``), ``dispatch`` / ``combine``
positionally (their per-call path). DeepEP's receive-view rules added here: ``borrow_recv=True`` is refused
(``ValueError``, before any launch) outside one NVLink domain, and ``lb_prefetch_weights`` / ``lb_reduce_grads``
refuse while a view is out, as ``dispatch`` / ``combine`` / ``destroy`` do.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from ep_core.errors import EPStateError, EPValueError
from ep_core.handle import EPHandle

from .buffer_base import BufferAllocator, BufferContext
from .event import EventHandle, EventOverlap

__all__ = ["EPBufferSurface"]

_LB_OPS = ("lb_prefetch_weights", "lb_reduce_grads")


def _by_name(params: dict) -> dict:
    """A surface method's parameters (its ``locals()`` before any other local is bound), by name, for
    ``ElasticBuffer``'s method of the same name: 2.5's order needs no second list in V2's order (off the per-call
    path: building the dict costs microseconds)."""
    return {k: v for k, v in params.items() if k not in ("self", "__class__")}


def _even_sms(num_sms: Any) -> Any:
    """DeepEP 2.5 rounds a given SM count up to even (the handle keeps the rounded count); anything else (0, a
    refused value) goes on as given."""
    return num_sms + 1 if type(num_sms) is int and num_sms > 0 and num_sms & 1 else num_sms


class EPBufferSurface:
    """DeepEP 2.5's parameter order and defaults for ``EPBuffer`` (module doc); a mixin before ``ElasticBuffer``."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        num_bytes: int | None = None,
        num_max_tokens_per_rank: int = 0,
        hidden: int = 0,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        lb_allocation_plan_or_num_bytes: BufferAllocator | int = 0,
        deterministic: bool = False,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
        prefer_overlap_with_compute: bool = True,
        sl_idx: int | None = None,
        num_allocated_qps: int = 0,
        num_cpu_timeout_secs: int = 300,
        num_gpu_timeout_secs: int = 100,
        explicitly_destroy: bool = False,
        *,
        num_cpu_bytes: int = 0,
        transport: str | None = None,
    ) -> None:
        sl_idx = 3 if sl_idx is None else sl_idx
        # LoadBalance takes lb_allocation_plan_or_num_bytes, ElasticBuffer the rest
        super().__init__(**_by_name(locals()))
        self._context: BufferContext | None = BufferContext(self)

    def dispatch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        num_experts: int | None = None,
        num_max_tokens_per_rank: int | None = None,
        expert_alignment: int | None = None,
        num_sms: int = 0,
        num_qps: int = 0,
        previous_event: EventHandle | None = None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
        handle: EPHandle | None = None,
        do_handle_copy: bool = False,
        do_cpu_sync: bool | None = None,
        do_expand: bool = False,
        do_zero_padding: bool = False,
        use_tma_aligned_col_major_sf: bool = False,
        defer_epilogue: bool = False,
        borrow_recv: bool = False,
        *,
        previous_event_before_epilogue: EventHandle | None = None,
        zero_copy: bool = False,
    ) -> tuple[Any, torch.Tensor | None, torch.Tensor | None, EPHandle, EventOverlap] | EventOverlap:
        """``ElasticBuffer.dispatch`` in DeepEP 2.5's parameter order (module doc); ``borrow_recv=True`` returns a
        :class:`~ep_torch.DispatchRecvView` in place of ``recv_x``."""
        num_sms = _even_sms(num_sms)
        if borrow_recv and (self.num_scaleout_ranks != 1 or self.num_rdma_ranks != 1):
            with self._core.announcing("dispatch"):  # type: ignore[attr-defined]  # before the first step (issue 41)
                raise EPValueError(
                    f"borrow_recv=True (rank {self.rank_idx}): a receive view needs one NVLink domain (direct "  # type: ignore[attr-defined]
                    f"mode); this buffer has {self.num_scaleout_ranks} scale-out and {self.num_rdma_ranks} RDMA ranks"
                )
        # positionally (V2's order): by name (`_by_name`) costs a few microseconds per call on this hot path
        out = super().dispatch(  # type: ignore[misc]
            x,
            topk_idx,
            topk_weights,
            cumulative_local_expert_recv_stats,
            num_experts,
            num_max_tokens_per_rank,
            expert_alignment,
            num_sms,
            num_qps,
            previous_event,
            previous_event_before_epilogue,
            async_with_compute_stream,
            allocate_on_comm_stream,
            handle,
            do_handle_copy,
            do_cpu_sync,
            do_expand,
            do_zero_padding,
            use_tma_aligned_col_major_sf,
            defer_epilogue=defer_epilogue,
            borrow_recv=borrow_recv,
            zero_copy=zero_copy,
        )
        if borrow_recv:
            # the view's rows must not move while it is out: DeepEP refuses the lb_* calls too (ElasticBuffer's
            # dispatch, combine and destroy refuse for themselves), announced in their host step (issue 41)
            for name in _LB_OPS:
                self.__dict__[name] = _busy(self, name)
        return out

    def _end_borrow(self) -> None:
        super()._end_borrow()  # type: ignore[misc]
        for name in _LB_OPS:
            self.__dict__.pop(name, None)

    def combine(
        self,
        x: torch.Tensor,
        handle: EPHandle,
        topk_weights: torch.Tensor | None = None,
        bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        num_sms: int = 0,
        num_qps: int = 0,
        previous_event: EventHandle | None = None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
        defer_epilogue: bool = False,
        *,
        previous_event_before_epilogue: EventHandle | None = None,
        out_dtype: torch.dtype | None = None,
        zero_copy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap] | EventOverlap:
        """``ElasticBuffer.combine`` in DeepEP 2.5's parameter order (module doc)."""
        num_sms = _even_sms(num_sms)
        return super().combine(  # type: ignore[misc]
            x,
            handle,
            topk_weights,
            bias,
            num_sms,
            num_qps,
            previous_event,
            previous_event_before_epilogue,
            async_with_compute_stream,
            allocate_on_comm_stream,
            defer_epilogue=defer_epilogue,
            out_dtype=out_dtype,
            zero_copy=zero_copy,
        )

    def get_theoretical_num_sms(
        self,
        num_experts: int,
        num_topk: int,
        num_scaleout_topk: int = 0,
        rdma_gbs: float = 0,
        nvlink_gbs: float = 0,
        sm_read_gbs: float = 0,
        sm_write_gbs: float = 0,
    ) -> int:
        """SMs the bandwidth model asks for; 0 bandwidths mean the defaults (detected links; DeepEP 2.5's per-SM rates,
        180 / 45 GB/s: `ep_core.planner.PlannerPolicy.V2_5`)."""
        return super().get_theoretical_num_sms(  # type: ignore[misc]
            num_experts, num_topk, num_scaleout_topk, rdma_gbs, nvlink_gbs, sm_read_gbs, sm_write_gbs
        )

    def barrier(  # type: ignore[override]
        self,
        wait_comm_stream: bool = True,
        with_cpu_sync: bool = False,
        sequential: bool = True,
        context_idx: int | None = None,
    ) -> None:
        """A barrier over every rank of the buffer (``deep_ep.comm.barrier``'s parameters; one context: 0)."""
        refused = BufferContext.refusal(context_idx, f"barrier (rank {self.rank_idx}): an EPBuffer")  # type: ignore[attr-defined]
        if refused is not None:
            with self._core.announcing("barrier"):  # type: ignore[attr-defined]  # the peers wait in theirs
                raise refused
        super().barrier(wait_comm_stream, with_cpu_sync, sequential)  # type: ignore[misc]

    @property
    def context(self) -> BufferContext | None:
        """The group's rank, size and domain sizes (DeepEP's ``buffer.context``); None after ``destroy()``."""
        return None if self.runtime is None else self._context  # type: ignore[attr-defined]

    @property
    def main_context(self) -> BufferContext | None:
        """The first (only) communication context, None after ``destroy()`` (DeepEP's ``BufferBase``)."""
        return self.context

    def print_memory_usage(self) -> None:
        """This rank's buffer bytes: the EP buffer, its host part and the LB region (DeepEP's ``BufferBase``)."""
        self._rt()  # type: ignore[attr-defined]
        print(
            f"EPBuffer rank {self.rank_idx}: buffer {self.num_bytes} bytes, host {self.num_cpu_bytes} bytes, "  # type: ignore[attr-defined]
            f"LB region {self.num_lb_bytes} bytes"  # type: ignore[attr-defined]
        )


def _busy(buffer: Any, name: str) -> Any:
    """``name`` (an LB collective) refused while a receive view is out, announced in the LB collectives' host step
    where the peers' call waits."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        channel = buffer._lb_channel()
        with channel.state.guard(name, channel.announce):
            raise EPStateError(
                f"{name}() (rank {buffer.rank_idx}): a DispatchRecvView of this buffer is out (dispatch(..., "
                "borrow_recv=True)); release() it first"
            )

    return refuse
