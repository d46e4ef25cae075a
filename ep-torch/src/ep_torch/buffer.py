"""``ElasticBuffer`` (DeepEP V2's surface, planner policy V2) and ``EPBuffer`` (the newer surface, policy V2.5).

A user switches from DeepEP by changing one import. Both classes are thin layers on ep-core:

- the *reference* backend (CPU tensors / a gloo group, or ``transport="reference"``): ``ep_core.reference`` over
  ``torch.distributed`` collectives, bit-identical to the oracle the kernels are tested against;
- the *GPU* backend (CUDA tensors on an nccl group): an ``ep_core.EPBuffer`` with the kernel executor
  (see :mod:`ep_torch._gpu_backend`).

Validation happens before anything is exchanged or launched and raises ``TypeError``/``ValueError`` naming the
argument (SPEC §6). Errors that DeepEP raises as ``AssertionError`` or ``RuntimeError`` are ``ValueError`` here.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from ep_core.errors import EPStateError, EPTypeError, EPValueError

from . import _env
from ._convert import from_numpy, is_fp8, to_numpy
from ._planning import PlannerPolicyName, Planning, planning_for_group
from ._reference_backend import ReferenceBackend
from .bootstrap import ProcessGroupBootstrap, group_device
from .event import EventHandle, EventOverlap
from .handle import EPHandle

__all__ = ["EPBuffer", "ElasticBuffer", "topk_idx_t"]

#: dtype of expert ids (``deep_ep.topk_idx_t``).
topk_idx_t = torch.int64

_MiB2 = 2 << 20
_MAX_TOPK = 32


def _is_tensor(a: Any) -> bool:
    return isinstance(a, torch.Tensor)


class ElasticBuffer:
    """An expert-parallel communication buffer over ``group`` (DeepEP V2's ``ElasticBuffer``).

    Keyword arguments, defaults and return tuples are DeepEP's (behaviour doc §1.2-1.6). ``transport`` (ours,
    keyword only) forces a backend: ``"reference"`` (collectives + numpy reference, any device), ``"ipc"`` or
    ``"nccl"`` (GPU kernels); ``None`` picks ``reference`` for CPU groups and the GPU kernels for nccl groups
    (``EPKIT_TORCH_TRANSPORT`` overrides).
    """

    _policy: PlannerPolicyName = "V2"

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        num_bytes: int | None = None,
        num_cpu_bytes: int = 0,
        num_max_tokens_per_rank: int = 0,
        hidden: int = 0,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        deterministic: bool = False,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
        prefer_overlap_with_compute: bool = True,
        sl_idx: int = 3,
        num_allocated_qps: int = 0,
        num_cpu_timeout_secs: int = 300,
        num_gpu_timeout_secs: int = 100,
        explicitly_destroy: bool = False,
        *,
        transport: str | None = None,
    ) -> None:
        if group is None:
            group = dist.group.WORLD
        self.group = group
        self.bootstrap = ProcessGroupBootstrap(group)
        self.rank_idx = self.bootstrap.rank
        self.num_ranks = self.bootstrap.size
        self.allow_hybrid_mode = bool(allow_hybrid_mode)
        self.allow_multiple_reduction = bool(allow_multiple_reduction)
        self.prefer_overlap_with_compute = bool(prefer_overlap_with_compute)
        self.deterministic = bool(deterministic)
        self.sl_idx = int(sl_idx)
        self.num_cpu_timeout_secs = num_cpu_timeout_secs
        self.num_gpu_timeout_secs = num_gpu_timeout_secs
        self.explicitly_destroy = bool(explicitly_destroy)
        self.use_fp8_dispatch = bool(use_fp8_dispatch)
        self.device = group_device(group)
        self.transport = self._pick_transport(transport)
        self.planning: Planning = planning_for_group(
            self.bootstrap,
            allow_hybrid_mode=self.allow_hybrid_mode,
            policy=self._policy,
            reference=self.transport == "reference",
        )

        if num_cpu_bytes < 0 or num_cpu_bytes % _MiB2:
            raise EPValueError(
                f"num_cpu_bytes: must be a non-negative multiple of 2 MiB, got {num_cpu_bytes}"
            )
        if num_cpu_bytes and num_bytes is None:
            raise EPValueError(
                "num_bytes: required when num_cpu_bytes > 0 (give the total size of the buffer)"
            )
        if num_bytes is None:
            if num_max_tokens_per_rank <= 0 or hidden <= 0:
                raise EPValueError(
                    "num_bytes: give num_bytes, or num_max_tokens_per_rank (> 0) and hidden (> 0) to size the buffer; "
                    f"got num_max_tokens_per_rank={num_max_tokens_per_rank}, hidden={hidden}"
                )
            num_bytes = self.planning.buffer_size_hint(
                num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch, self.allow_multiple_reduction
            )
        if num_bytes <= 0 or num_bytes % _MiB2:
            raise EPValueError(
                f"num_bytes: must be a positive multiple of 2 MiB ({_MiB2} bytes), got {num_bytes}"
            )
        if num_cpu_bytes > num_bytes:
            raise EPValueError(f"num_cpu_bytes: {num_cpu_bytes} exceeds num_bytes ({num_bytes})")
        self.num_bytes = int(num_bytes)
        self.num_cpu_bytes = int(num_cpu_bytes)
        self.num_max_tokens_per_rank = int(num_max_tokens_per_rank)
        self.num_allocated_qps = int(num_allocated_qps) or self.planning.default_num_allocated_qps()

        topo = self.planning.topology
        self.num_scaleout_ranks, self.num_scaleup_ranks = topo.logical
        self.scaleout_rank_idx = self.rank_idx // self.num_scaleup_ranks
        self.scaleup_rank_idx = self.rank_idx % self.num_scaleup_ranks
        self.num_rdma_ranks, self.num_nvlink_ranks = topo.physical

        self.runtime: Any
        if self.transport == "reference":
            self.runtime = ReferenceBackend(self.bootstrap, self.num_scaleup_ranks)
        else:
            from ._gpu_backend import GPUBackend

            self.runtime = GPUBackend(self)
        self._destroyed = False
        self._functional_id: int | None = None
        self.bootstrap.barrier()

    # ----------------------------------------------------------------------------------------------------------------
    # lifecycle

    def _pick_transport(self, transport: str | None) -> str:
        choice = (transport or _env.transport() or "").lower()
        if choice not in ("", "reference", "ipc", "nccl"):
            raise EPValueError(f"transport: expected 'reference', 'ipc', 'nccl' or None, got {transport!r}")
        if not choice:
            choice = "reference" if self.device.type == "cpu" else "auto"
        if choice == "reference":
            return "reference"
        if self.device.type == "cpu":
            raise EPValueError(
                f"transport: {choice!r} needs an nccl process group with CUDA tensors; this group ({dist.get_backend(self.group)}) "
                "works on CPU tensors: use transport='reference' (the default for CPU groups)"
            )
        return choice

    def destroy(self) -> None:
        """Release the buffer (a collective). Only for buffers built with ``explicitly_destroy=True``."""
        if not self.explicitly_destroy:
            raise EPStateError(
                "destroy(): this buffer was created with explicitly_destroy=False and is released automatically; "
                "pass explicitly_destroy=True to the constructor to manage its lifetime yourself"
            )
        self._check_alive()
        self.barrier(use_comm_stream=True, with_cpu_sync=True)
        if hasattr(self.runtime, "destroy"):
            self.runtime.destroy()
        self.runtime = None
        self._destroyed = True

    def _check_alive(self) -> None:
        if getattr(self, "_destroyed", False):
            raise EPStateError("this buffer was destroyed; create a new one")

    def __enter__(self) -> ElasticBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.explicitly_destroy and not self._destroyed:
            self.destroy()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(rank={self.rank_idx}/{self.num_ranks}, transport={self.transport}, "
            f"num_bytes={self.num_bytes}, domains={self.num_scaleout_ranks}x{self.num_scaleup_ranks})"
        )

    # ----------------------------------------------------------------------------------------------------------------
    # sizes, planner, domains

    @classmethod
    def get_buffer_size_hint(
        cls,
        group: dist.ProcessGroup | None,
        num_max_tokens_per_rank: int,
        hidden: int,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
    ) -> int:
        """Bytes a buffer needs for these sizes (2 MiB aligned; SPEC §4). A collective over ``group``."""
        if group is None:
            group = dist.group.WORLD
        planning = planning_for_group(
            ProcessGroupBootstrap(group),
            allow_hybrid_mode=allow_hybrid_mode,
            policy=cls._policy,
            reference=group_device(group).type == "cpu",
        )
        return planning.buffer_size_hint(
            num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch, allow_multiple_reduction
        )

    def get_theoretical_num_sms(
        self,
        num_experts: int,
        num_topk: int,
        num_scaleout_topk: int = 0,
        rdma_gbs: float = 0,
        nvlink_gbs: float = 0,
        sm_read_gbs: float = 200,
        sm_write_gbs: float = 50,
    ) -> int:
        """SMs the bandwidth model asks for (SPEC §5; policy V2 for ElasticBuffer, V2.5 for EPBuffer)."""
        return self.planning.num_sms(
            num_experts,
            num_topk,
            num_scaleout_topk=num_scaleout_topk,
            rdma_gbs=rdma_gbs,
            nvlink_gbs=nvlink_gbs,
            sm_read_gbs=sm_read_gbs,
            sm_write_gbs=sm_write_gbs,
            prefer_overlap_with_compute=self.prefer_overlap_with_compute,
        )

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """QPs for ``num_sms``: ``min(sms, 9)`` direct, ``16*sms + 1`` hybrid, capped by the allocated QPs."""
        return self.planning.num_qps(num_sms, self.num_allocated_qps)

    def get_physical_domain_size(self) -> tuple[int, int]:
        """``(num_rdma_ranks, num_nvlink_ranks)``."""
        return self.planning.topology.physical

    def get_logical_domain_size(self) -> tuple[int, int]:
        """``(num_scaleout_ranks, num_scaleup_ranks)``: ``(1, N)`` in direct mode."""
        return self.planning.topology.logical

    # ----------------------------------------------------------------------------------------------------------------
    # streams, events, barrier

    @staticmethod
    def capture() -> EventHandle:
        """An event recorded on the current stream (a completed event without CUDA)."""
        return EventHandle()

    def get_comm_stream(self) -> torch.cuda.Stream | None:
        """The process-wide high-priority communication stream (None on the CPU reference backend)."""
        if self.device.type != "cuda":
            return None
        from ._streams import comm_stream

        return comm_stream(self.device)

    def barrier(
        self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True
    ) -> None:
        """A barrier over every rank of the buffer."""
        self._check_alive()
        if self.transport == "reference":
            if with_cpu_sync and torch.cuda.is_available() and self.device.type == "cuda":
                torch.cuda.synchronize()
            self.runtime.barrier()
            return
        self.runtime.barrier(
            use_comm_stream=use_comm_stream, with_cpu_sync=with_cpu_sync, sequential=sequential
        )

    # ----------------------------------------------------------------------------------------------------------------
    # dispatch / combine

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
        previous_event_before_epilogue: EventHandle | None = None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
        handle: EPHandle | None = None,
        do_handle_copy: bool = True,
        do_cpu_sync: bool | None = None,
        do_expand: bool = False,
        do_zero_padding: bool = False,
        use_tma_aligned_col_major_sf: bool = False,
    ) -> tuple[Any, torch.Tensor | None, torch.Tensor | None, EPHandle, EventOverlap]:
        """Send every token to the ranks of its top-k experts (SPEC §2).

        Returns ``(recv_x, recv_topk_idx, recv_topk_weights, handle, event)``; ``recv_x`` is a ``(data, sf)`` tuple
        iff ``x`` was one, ``recv_topk_idx`` is None with ``do_expand=True``, ``event`` holds an event only with
        ``async_with_compute_stream=True``. With ``handle=`` this is a cached dispatch: same rows, same order.
        """
        self._check_alive()
        if self.transport != "reference":
            return self.runtime.dispatch(**{k: v for k, v in locals().items() if k != "self"})
        try:
            args = self._check_dispatch(
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
                allocate_on_comm_stream,
                handle,
                do_cpu_sync,
                do_expand,
                do_zero_padding,
            )
        except (TypeError, ValueError) as e:
            self.runtime.fail(
                "dispatch", e
            )  # joins the exchange so that the other ranks fail too, then raises
            raise
        data, sf = args["data_sf"]
        np_x = to_numpy(data)
        np_sf = None if sf is None else to_numpy(sf)
        np_w = None if topk_weights is None else to_numpy(topk_weights)
        col_major = bool(use_tma_aligned_col_major_sf)
        if handle is not None:
            out = self.runtime.cached_dispatch(
                np_x,
                np_sf,
                np_w,
                handle.backend_state,
                use_tma_aligned_col_major_sf=col_major,
                do_zero_padding=do_zero_padding,
            )
            new_handle = handle
        else:
            out, handles = self.runtime.dispatch(
                np_x,
                np_sf,
                to_numpy(topk_idx),
                np_w,
                num_experts=args["num_experts"],
                num_max_tokens_per_rank=args["num_max_tokens_per_rank"],
                expert_alignment=args["expert_alignment"],
                do_expand=do_expand,
                deterministic=self.deterministic,
                do_cpu_sync=args["do_cpu_sync"],
                use_tma_aligned_col_major_sf=col_major,
                do_zero_padding=do_zero_padding,
                num_sms=args["num_sms"],
            )
            user_idx = topk_idx.clone() if do_handle_copy else topk_idx
            new_handle = EPHandle.from_core(
                out.handle, data.device, topk_idx=user_idx, backend_state=handles, buffer_id=id(self)
            )
            if cumulative_local_expert_recv_stats is not None:
                counts = torch.from_numpy(out.handle.num_unaligned_recv_tokens_per_expert.astype(np.int32))
                cumulative_local_expert_recv_stats.add_(counts.to(cumulative_local_expert_recv_stats.device))
        device = data.device
        recv_data = from_numpy(out.recv_x, data.dtype, device)
        recv_x: Any = recv_data
        if sf is not None:
            recv_x = (recv_data, _sf_from_numpy(out.recv_sf, sf.dtype, device, col_major))
        recv_idx = (
            None if out.recv_topk_idx is None else torch.from_numpy(out.recv_topk_idx).to(device, topk_idx_t)
        )
        recv_w = None if out.recv_topk_weights is None else torch.from_numpy(out.recv_topk_weights).to(device)
        event = self._finish(async_with_compute_stream, device)
        return recv_x, recv_idx, recv_w, new_handle, event

    def combine(
        self,
        x: torch.Tensor,
        handle: EPHandle,
        topk_weights: torch.Tensor | None = None,
        bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        num_sms: int = 0,
        num_qps: int = 0,
        previous_event: EventHandle | None = None,
        previous_event_before_epilogue: EventHandle | None = None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap]:
        """Send expert outputs back and sum them per token, unweighted (SPEC §3).

        Returns ``(combined_x [T, hidden] bf16, combined_topk_weights [T, K] float32 | None, event)``.
        """
        self._check_alive()
        if self.transport != "reference":
            return self.runtime.combine(**{k: v for k, v in locals().items() if k != "self"})
        try:
            biases = self._check_combine(
                x, handle, topk_weights, bias, num_sms, num_qps, previous_event, allocate_on_comm_stream
            )
        except (TypeError, ValueError) as e:
            self.runtime.fail("combine", e)
            raise
        out = self.runtime.combine(
            to_numpy(x),
            None if topk_weights is None else to_numpy(topk_weights),
            tuple(None if b is None else to_numpy(b) for b in biases),
            handle.backend_state,
            allow_multiple_reduction=self.allow_multiple_reduction,
        )
        device = x.device
        combined_x = from_numpy(out.combined_x, torch.bfloat16, device)
        combined_w = None
        if out.combined_topk_weights is not None:
            combined_w = torch.from_numpy(out.combined_topk_weights).to(device)
        return combined_x, combined_w, self._finish(async_with_compute_stream, device)

    # ----------------------------------------------------------------------------------------------------------------
    # validation (torch-side: dtypes, devices, layouts, call rules; ep-core checks the rest)

    def _finish(self, async_with_compute_stream: bool, device: torch.device) -> EventOverlap:
        if not async_with_compute_stream:
            return EventOverlap(None)
        return EventOverlap(EventHandle(device=device))

    def _check_events(self, previous_event: Any, allocate_on_comm_stream: bool) -> None:
        if previous_event is not None:
            if not isinstance(previous_event, EventHandle):
                raise EPTypeError(
                    f"previous_event: expected an EventHandle (buffer.capture()), got {type(previous_event).__name__}"
                )
            if not allocate_on_comm_stream:
                raise EPValueError(
                    "previous_event: requires allocate_on_comm_stream=True (the outputs are allocated on the comm "
                    "stream after it waits on the event)"
                )

    def _check_sms(self, num_sms: int, num_qps: int) -> None:
        if num_sms < 0:
            raise EPValueError(f"num_sms: must be >= 0 (0 = from the planner), got {num_sms}")
        if num_qps < 0:
            raise EPValueError(f"num_qps: must be >= 0 (0 = from the planner), got {num_qps}")
        if num_qps > self.num_allocated_qps:
            raise EPValueError(
                f"num_qps: {num_qps} exceeds the allocated QPs ({self.num_allocated_qps}); "
                "pass num_allocated_qps to the constructor"
            )

    def _check_device(self, name: str, t: torch.Tensor, device: torch.device) -> None:
        if t.device != device:
            raise EPValueError(f"{name}: expected a tensor on {device} (the device of x), got {t.device}")

    def _check_dispatch(
        self,
        x,
        topk_idx,
        topk_weights,
        stats,
        num_experts,
        num_max_tokens_per_rank,
        expert_alignment,
        num_sms,
        num_qps,
        previous_event,
        allocate_on_comm_stream,
        handle,
        do_cpu_sync,
        do_expand,
        do_zero_padding,
    ) -> dict[str, Any]:
        if isinstance(x, tuple):
            if len(x) != 2 or not all(_is_tensor(a) for a in x):
                raise EPTypeError(
                    "x: expected a bf16 tensor or a (float8_e4m3fn data, scale factors) tuple of two tensors"
                )
            data, sf = x
            if not is_fp8(data.dtype):
                raise EPTypeError(f"x: the data of an FP8 tuple must be float8_e4m3fn, got {data.dtype}")
            if sf.dtype not in (torch.float32, torch.int32):
                raise EPTypeError(f"x: scale factors must be float32 or int32 (4-byte packs), got {sf.dtype}")
            if sf.dim() != 2 or sf.shape[0] != data.shape[0]:
                raise EPValueError(
                    f"x: scale factors must be [num_tokens={data.shape[0]}, num_sf_packs], got {tuple(sf.shape)}"
                )
            self._check_device("x (scale factors)", sf, data.device)
        elif _is_tensor(x):
            data, sf = x, None
            if data.dtype != torch.bfloat16:
                raise EPTypeError(
                    f"x: expected a bfloat16 tensor (or an FP8 (data, sf) tuple), got {data.dtype}; cast with x.bfloat16()"
                )
        else:
            raise EPTypeError(f"x: expected a tensor or a (data, sf) tuple, got {type(x).__name__}")
        if data.dim() != 2:
            raise EPValueError(
                f"x: expected a 2-D [num_tokens, hidden] tensor, got shape {tuple(data.shape)}"
            )
        if not data.is_contiguous():
            raise EPValueError("x: must be contiguous; call .contiguous() first")
        hidden_bytes = data.shape[1] * data.element_size()
        if hidden_bytes % 32:
            raise EPValueError(
                f"x: hidden bytes ({data.shape[1]} x {data.element_size()} B = {hidden_bytes}) must be a multiple of 32"
            )
        self._check_events(previous_event, allocate_on_comm_stream)
        self._check_sms(num_sms, num_qps)
        if topk_weights is not None:
            if not _is_tensor(topk_weights):
                raise EPTypeError(f"topk_weights: expected a tensor, got {type(topk_weights).__name__}")
            if topk_weights.dtype != torch.float32:
                raise EPTypeError(f"topk_weights: expected float32, got {topk_weights.dtype}")
            self._check_device("topk_weights", topk_weights, data.device)
            if not topk_weights.is_contiguous():
                raise EPValueError("topk_weights: must be contiguous")
        if do_zero_padding and not (do_expand or (handle is not None and handle.do_expand)):
            raise EPValueError("do_zero_padding: only valid together with do_expand=True")
        if handle is not None:
            if not isinstance(handle, EPHandle):
                raise EPTypeError(
                    f"handle: expected an EPHandle from a previous dispatch, got {type(handle).__name__}"
                )
            if topk_idx is not None:
                raise EPValueError(
                    "topk_idx: must be None for a cached dispatch (the handle holds the routing)"
                )
            if do_cpu_sync:
                raise EPValueError("do_cpu_sync: a cached dispatch cannot do a CPU sync (leave it None)")
            if stats is not None:
                raise EPValueError("cumulative_local_expert_recv_stats: not allowed in a cached dispatch")
            if handle.backend_state is None or handle.buffer_id != id(self):
                raise EPValueError(
                    "handle: was not produced by this buffer; pass the handle of this buffer's dispatch"
                )
            for name, given, cached in (
                ("num_experts", num_experts, handle.num_experts),
                ("num_max_tokens_per_rank", num_max_tokens_per_rank, handle.num_max_tokens_per_rank),
                ("expert_alignment", expert_alignment, handle.expert_alignment),
            ):
                if given is not None and given != cached:
                    raise EPValueError(f"{name}: {given} differs from the handle's {cached}")
            if do_expand and not handle.do_expand:
                raise EPValueError(
                    "do_expand: the handle was made by a non-expand dispatch; it fixes the layout"
                )
            if data.shape[0] != handle.num_tokens:
                raise EPValueError(
                    f"x: {data.shape[0]} tokens, but the handle's dispatch had {handle.num_tokens}"
                )
            if topk_weights is not None and topk_weights.shape != handle.topk_idx.shape:
                raise EPValueError(
                    f"topk_weights: expected shape {tuple(handle.topk_idx.shape)}, got {tuple(topk_weights.shape)}"
                )
            return {"data_sf": (data, sf)}
        if not _is_tensor(topk_idx):
            raise EPTypeError(
                f"topk_idx: expected a [num_tokens, num_topk] int64 tensor, got {type(topk_idx).__name__}"
            )
        if topk_idx.dtype not in (torch.int64, torch.int32):
            raise EPTypeError(f"topk_idx: expected topk_idx_t (int64) or int32, got {topk_idx.dtype}")
        if topk_idx.dim() != 2 or topk_idx.shape[0] != data.shape[0]:
            raise EPValueError(
                f"topk_idx: expected shape [num_tokens={data.shape[0]}, num_topk], got {tuple(topk_idx.shape)}"
            )
        if not 1 <= topk_idx.shape[1] <= _MAX_TOPK:
            raise EPValueError(f"topk_idx: num_topk must be in [1, {_MAX_TOPK}], got {topk_idx.shape[1]}")
        self._check_device("topk_idx", topk_idx, data.device)
        if not topk_idx.is_contiguous():
            raise EPValueError("topk_idx: must be contiguous")
        if topk_weights is not None and topk_weights.shape != topk_idx.shape:
            raise EPValueError(
                f"topk_weights: expected shape {tuple(topk_idx.shape)} (like topk_idx), got {tuple(topk_weights.shape)}"
            )
        if num_experts is None:
            raise EPValueError("num_experts: required for a non-cached dispatch")
        if num_experts <= 0 or num_experts % self.num_ranks:
            raise EPValueError(
                f"num_experts: must be a positive multiple of the number of ranks ({self.num_ranks}), got {num_experts}"
            )
        m = self.num_max_tokens_per_rank if num_max_tokens_per_rank is None else num_max_tokens_per_rank
        if m <= 0:
            raise EPValueError(
                f"num_max_tokens_per_rank: must be > 0; pass it to dispatch or to the constructor (got {m})"
            )
        if data.shape[0] > m:
            raise EPValueError(f"x: num_tokens ({data.shape[0]}) exceeds num_max_tokens_per_rank ({m})")
        alignment = 1 if expert_alignment is None else expert_alignment
        if alignment < 1:
            raise EPValueError(f"expert_alignment: must be >= 1, got {alignment}")
        if stats is not None:
            epr = num_experts // self.num_ranks
            if not _is_tensor(stats) or stats.dtype != torch.int32 or tuple(stats.shape) != (epr,):
                raise EPValueError(
                    f"cumulative_local_expert_recv_stats: expected an int32 tensor of shape [{epr}]"
                )
        needed = self.planning.dispatch_bytes(
            m, hidden_bytes, 0 if sf is None else sf.shape[1], topk_idx.shape[1]
        )
        if needed > self.num_bytes:
            raise EPValueError(
                f"num_max_tokens_per_rank: a dispatch of these sizes needs {needed} bytes, the buffer has "
                f"{self.num_bytes}; create the buffer with get_buffer_size_hint(...) for these sizes"
            )
        if num_sms == 0:
            num_sms = self.get_theoretical_num_sms(num_experts, topk_idx.shape[1])
        return {
            "data_sf": (data, sf),
            "num_experts": int(num_experts),
            "num_max_tokens_per_rank": int(m),
            "expert_alignment": int(alignment),
            "do_cpu_sync": do_cpu_sync is None or bool(do_cpu_sync),
            "num_sms": int(num_sms),
        }

    def _check_combine(
        self, x, handle, topk_weights, bias, num_sms, num_qps, previous_event, allocate_on_comm_stream
    ):
        if not isinstance(handle, EPHandle):
            raise EPTypeError(f"handle: expected the EPHandle of a dispatch, got {type(handle).__name__}")
        if handle.backend_state is None or handle.buffer_id != id(self):
            raise EPValueError(
                "handle: was not produced by this buffer; pass the handle of this buffer's dispatch"
            )
        if not _is_tensor(x):
            raise EPTypeError(f"x: expected a bf16 tensor, got {type(x).__name__}")
        if x.dtype != torch.bfloat16:
            raise EPTypeError(
                f"x: combine takes bfloat16 expert outputs, got {x.dtype}; cast with .bfloat16()"
            )
        if x.dim() != 2:
            raise EPValueError(f"x: expected a 2-D [rows, hidden] tensor, got shape {tuple(x.shape)}")
        if not x.is_contiguous():
            raise EPValueError("x: must be contiguous; call .contiguous() first")
        if (x.shape[1] * 2) % 32:
            raise EPValueError(f"x: hidden bytes ({x.shape[1]} x 2) must be a multiple of 32")
        rows = handle.num_expanded_tokens if handle.do_expand else handle.num_recv_tokens
        if x.shape[0] != rows:
            raise EPValueError(
                f"x: expected {rows} rows (the handle's {'expanded ' if handle.do_expand else ''}receive rows), got {x.shape[0]}"
            )
        self._check_events(previous_event, allocate_on_comm_stream)
        self._check_sms(num_sms, num_qps)
        if topk_weights is not None:
            if not _is_tensor(topk_weights) or topk_weights.dtype != torch.float32:
                raise EPTypeError(
                    f"topk_weights: expected a float32 tensor, got {getattr(topk_weights, 'dtype', type(topk_weights).__name__)}"
                )
            self._check_device("topk_weights", topk_weights, x.device)
            want = (rows,) if handle.do_expand else (rows, handle.num_topk)
            if tuple(topk_weights.shape) != want:
                raise EPValueError(
                    f"topk_weights: expected shape {list(want)}, got {list(topk_weights.shape)}"
                )
            if not topk_weights.is_contiguous():
                raise EPValueError("topk_weights: must be contiguous")
            if handle.do_expand and not self.allow_multiple_reduction:
                raise EPValueError(
                    "topk_weights: not allowed for an expand-layout combine with allow_multiple_reduction=False"
                )
        if bias is None:
            biases: tuple[Any, Any] = (None, None)
        elif _is_tensor(bias):
            biases = (bias, None)
        elif isinstance(bias, tuple) and len(bias) == 2 and all(_is_tensor(b) for b in bias):
            biases = bias
        else:
            raise EPTypeError(
                f"bias: expected None, a tensor or a tuple of two tensors, got {type(bias).__name__}"
                + (f" of length {len(bias)}" if isinstance(bias, (tuple, list)) else "")
            )
        t = handle.num_tokens
        for i, b in enumerate(biases):
            if b is None:
                continue
            if b.dtype != torch.bfloat16:
                raise EPTypeError(f"bias[{i}]: expected bfloat16 (like x), got {b.dtype}")
            if tuple(b.shape) != (t, x.shape[1]):
                raise EPValueError(f"bias[{i}]: expected shape [{t}, {x.shape[1]}], got {list(b.shape)}")
            if not b.is_contiguous():
                raise EPValueError(f"bias[{i}]: must be contiguous")
            self._check_device(f"bias[{i}]", b, x.device)
        return biases


def _sf_from_numpy(a: np.ndarray, dtype: torch.dtype, device: torch.device, col_major: bool) -> torch.Tensor:
    """Scale packs as a tensor: row-major, or column-major with the token dimension padded to 4 (DeepEP's
    ``empty_strided([R, P], (1, align(R, 4)))``)."""
    values = torch.from_numpy(np.ascontiguousarray(a).view(np.int32 if dtype == torch.int32 else np.float32))
    if not col_major:
        return values.to(device)
    rows, packs = values.shape
    out = torch.empty_strided((rows, packs), (1, (rows + 3) // 4 * 4), dtype=dtype, device=device)
    out.copy_(values)
    return out


class EPBuffer(ElasticBuffer):
    """The newer EP surface (EP buffer on a shared buffer base): ``ElasticBuffer``'s keywords, methods and return
    tuples, with planner policy V2.5 (margin 1.3, multiples of 4 SMs)."""

    _policy: PlannerPolicyName = "V2_5"
