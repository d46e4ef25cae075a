"""``ElasticBuffer`` (DeepEP V2's surface, planner policy V2) and ``EPBuffer`` (the newer surface, policy V2.5).

Both are thin layers on ``ep_core.EPBuffer`` (kept as ``self.runtime``, like DeepEP's C++ runtime), which validates
every call, plans and runs it on its executor; this layer adds the bootstrap over the ProcessGroup, torch tensors as
outputs, DeepEP's return tuples and the stream rules of behaviour doc §1.8. The backend (``transport``:
``"reference"`` on a gloo group, ``"ipc"`` / ``"nccl"`` for CUDA tensors) is :mod:`ep_torch.transport_choice`'s.
"""

from __future__ import annotations

import contextlib
from typing import Any

import ep_core
import numpy as np
import torch
import torch.distributed as dist
from ep_core import planner
from ep_core.envelope import Channel
from ep_core.errors import EPStateError
from ep_core.handle import EPHandle
from ep_core.planner import PlannerPolicy
from ep_core.topology import Topology

from .bootstrap import ProcessGroupBootstrap
from .dispatch_combine import (  # noqa: F401 (_current_stream, _handle_tensors, _plain: read here by tests)
    DispatchCombine,
    _current_stream,
    _handle_tensors,
    _plain,
)
from .elastic_ops import ElasticOps
from .epbuffer_surface import EPBufferSurface
from .event import EventHandle
from .load_balance import LoadBalance
from .resize import resize as _resize
from .transport_choice import (
    choose_transport,
    data_device,
    make_core_transport,
    ranks_per_host,
    scaleup_ranks,
)
from .zero_copy_tensors import ZeroCopyTensors

__all__ = ["EPBuffer", "ElasticBuffer", "topk_idx_t"]

#: dtype of expert ids (``deep_ep.topk_idx_t``).
topk_idx_t = torch.int64


def _view_tensor(arr: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """An array of the buffer's own memory (ep-core's ``DeviceArray``: a zero-copy output, the combine buffer) as a
    tensor of ``dtype`` over the same memory: torch reads bf16 / FP8 bits as uint16 / uint8, then reinterprets them
    (the same item size). On the CPU reference backend through numpy's array interface, whose array keeps the
    ``DeviceArray`` (and so the executor's host memory) alive."""
    if arr is None:
        return None
    if arr.device == "cpu":
        t = torch.from_numpy(np.asarray(arr))
    else:  # the rank's own memory, on its own device
        t = torch.as_tensor(arr, device=device)
    return t if t.dtype == dtype else t.view(dtype)


class ElasticBuffer(DispatchCombine, ElasticOps):
    """An expert-parallel communication buffer over ``group`` (DeepEP V2's ``ElasticBuffer``).

    Keyword arguments, defaults, methods and return tuples are DeepEP's (behaviour doc §1.2-1.6). Ours, keyword
    only: ``transport`` (``"reference"``, ``"ipc"``, ``"nccl"``; None = automatic: ``reference`` for CPU groups;
    for nccl groups ``nccl`` when every rank has its own GPU and NCCL >= 2.28.7, else ``ipc``;
    ``EPKIT_TORCH_TRANSPORT`` overrides the default). ``transport_choice`` says what was picked and why.
    """

    policy: PlannerPolicy = PlannerPolicy.V2

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
        core_transport = self._connect(group, transport, bool(explicitly_destroy))
        self.rank_idx = self.bootstrap.rank
        self.num_ranks = self.bootstrap.size
        self.transport, self.device = self.transport_choice.name, self.transport_choice.device
        # read on every call: whether operations are CUDA ones, the device whose current stream they follow, and
        # the output allocators by device (`_allocator`)
        self._cuda = self.device.type == "cuda"
        self._device_index: int | None = self.device.index
        self._allocators: dict = {}
        self.allow_hybrid_mode = bool(allow_hybrid_mode)
        self.allow_multiple_reduction = bool(allow_multiple_reduction)
        self.prefer_overlap_with_compute = bool(prefer_overlap_with_compute)
        self.deterministic = bool(deterministic)
        self.explicitly_destroy = bool(explicitly_destroy)
        rt = self._new_runtime(
            core_transport,
            num_bytes=num_bytes,
            num_cpu_bytes=_int(num_cpu_bytes),
            num_max_tokens_per_rank=_int(num_max_tokens_per_rank),
            hidden=_int(hidden),
            num_topk=_int(num_topk),
            use_fp8_dispatch=bool(use_fp8_dispatch),
            sl_idx=_int(sl_idx),
            num_allocated_qps=_int(num_allocated_qps),
            num_cpu_timeout_secs=num_cpu_timeout_secs,
            num_gpu_timeout_secs=num_gpu_timeout_secs,
        )
        self.num_allocated_qps = rt.num_allocated_qps
        self.sl_idx = rt.config.sl_idx
        self.num_scaleout_ranks, self.num_scaleup_ranks = rt.get_logical_domain_size()
        self.scaleout_rank_idx = self.rank_idx // self.num_scaleup_ranks
        self.scaleup_rank_idx = self.rank_idx % self.num_scaleup_ranks
        self.num_rdma_ranks, self.num_nvlink_ranks = rt.get_physical_domain_size()
        self._functional_id: int | None = None
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _new_runtime(self, core_transport: Any, **sizes: Any) -> ep_core.EPBuffer:
        """ep-core's buffer for ``sizes`` (the constructor's, or ``resize``'s new ones) and this buffer's settings,
        made ``runtime``, with the sizes it resolved read back (``num_bytes``, ``num_cpu_bytes``,
        ``num_max_tokens_per_rank``)."""
        rt = ep_core.EPBuffer(
            self.bootstrap,
            transport=core_transport,
            deterministic=self.deterministic,
            allow_hybrid_mode=self.allow_hybrid_mode,
            allow_multiple_reduction=self.allow_multiple_reduction,
            prefer_overlap_with_compute=self.prefer_overlap_with_compute,
            explicitly_destroy=self.explicitly_destroy,
            policy=self.policy,
            # EPKIT_SCALEUP_RANKS: emulated nodes of S_u ranks (hybrid mode); None = the transport's NVLink domain
            num_nvlink_ranks=self.transport_choice.scaleup_ranks,
            **sizes,
        )
        self.runtime: ep_core.EPBuffer | None = rt
        self._core = rt  # kept after destroy(): a call on a destroyed buffer is still announced to the peers
        self.num_bytes = rt.num_bytes
        self.num_cpu_bytes = rt.config.num_cpu_bytes
        self.num_max_tokens_per_rank = rt.num_max_tokens_per_rank
        return rt

    def _connect(
        self, group: dist.ProcessGroup | None, transport: str | None, explicitly_destroy: bool
    ) -> Any:
        """Bind this buffer to its ranks: sets ``group``, ``bootstrap`` (the host collectives) and
        ``transport_choice``, and returns ep-core's transport for them. ``ep_torch.loopback`` overrides it to bind one
        rank of a loopback group (a thread bootstrap and the group's transport) to the same constructor."""
        self.group = dist.group.WORLD if group is None else group
        self.bootstrap = ProcessGroupBootstrap(self.group)
        self.transport_choice = choose_transport(
            transport, self.bootstrap, self.group, explicitly_destroy=explicitly_destroy
        )
        return make_core_transport(self.transport_choice)

    # ----------------------------------------------------------------------------------------------------------------
    # lifecycle

    def _rt(self) -> ep_core.EPBuffer:
        if self.runtime is None or self.runtime.destroyed:
            raise EPStateError(f"{type(self).__name__}: used after destroy(); create a new buffer")
        return self.runtime

    def destroy(self) -> None:
        """Release the buffer (a collective). Only for buffers built with ``explicitly_destroy=True``."""
        if not self.explicitly_destroy:
            raise EPStateError(
                "destroy(): this buffer was created with explicitly_destroy=False and is released automatically; "
                "pass explicitly_destroy=True to the constructor to manage its lifetime yourself"
            )
        rt = self._rt()
        self.__dict__.pop("_zero_copy_tensors", None)  # tensors over the memory released below
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        rt.destroy()  # a barrier first: no peer copies into this rank's signal words any more
        self.runtime = None
        self._release_elastic()

    def _release_elastic(self) -> None:
        """Free the PP/Engram/AGRS state now (ep_torch.elastic_ops): its signal words, host NUMA storage and
        host-mapped timeout record are allocations of their own, outside the runtime's storage."""
        st = self.__dict__.pop("_elastic_state", None)
        close = getattr(getattr(st, "backend", None), "close", None)
        if close is not None:
            close()

    def __enter__(self) -> ElasticBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.explicitly_destroy and self.runtime is not None and not self.runtime.destroyed:
            self.destroy()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(rank={self.rank_idx}/{self.num_ranks}, transport={self.transport}"
            + (f" ({self.transport_choice.communicator} communicator)" if self.transport == "nccl" else "")
            + f", num_bytes={self.num_bytes}, domains={self.num_scaleout_ranks}x{self.num_scaleup_ranks})"
        )

    # ----------------------------------------------------------------------------------------------------------------
    # sizes, planner, domains

    @staticmethod
    def get_buffer_size_hint(
        group: dist.ProcessGroup | None,
        num_max_tokens_per_rank: int,
        hidden: int,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
    ) -> int:
        """Bytes a buffer needs for these sizes (2 MiB aligned; SPEC §4). A collective over ``group``."""
        boot = ProcessGroupBootstrap(dist.group.WORLD if group is None else group)
        name, _ = data_device(None, boot.device)
        # EPKIT_SCALEUP_RANKS, else one domain on the reference backend; a CUDA group's domain is NCCL's LSA team,
        # which would need a communicator just for a size: ranks per host stand in for it (several hosts: hybrid)
        nvl = scaleup_ranks(name or "auto", boot.size, boot.rank)
        if nvl is None:
            nvl = boot.size if name == "reference" else ranks_per_host(boot)
        topology = Topology(boot.size, nvl, bool(allow_hybrid_mode))
        return planner.get_buffer_size_hint(
            topology,
            num_max_tokens_per_rank,
            hidden,
            num_topk,
            bool(use_fp8_dispatch),
            bool(allow_multiple_reduction),
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
        return self._rt().get_theoretical_num_sms(
            num_experts, num_topk, num_scaleout_topk, rdma_gbs, nvlink_gbs, sm_read_gbs, sm_write_gbs
        )

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """QPs for ``num_sms``: ``min(sms, 9)`` direct, ``16*sms + 1`` hybrid, capped by the allocated QPs."""
        return self._rt().get_theoretical_num_qps(num_sms)

    def get_physical_domain_size(self) -> tuple[int, int]:
        """``(num_rdma_ranks, num_nvlink_ranks)``."""
        return self._rt().get_physical_domain_size()

    def get_logical_domain_size(self) -> tuple[int, int]:
        """``(num_scaleout_ranks, num_scaleup_ranks)``: ``(1, N)`` in direct mode."""
        return self._rt().get_logical_domain_size()

    # ----------------------------------------------------------------------------------------------------------------
    # streams, events, barrier

    @staticmethod
    def capture() -> EventHandle:
        """An event recorded on the current stream (a completed event without CUDA)."""
        return EventHandle()

    def reset(self) -> None:
        """Recover after a failed operation (ours; DeepEP has none): a collective, every rank calls it.

        After a timeout or a peer's abort every call raises the recorded error instead of returning garbage;
        ``reset()`` waits for this rank's streams, clears the buffer's state with the peers, and the buffer works as
        new (handles of no-sync dispatches in flight during the failure stay refused)."""
        rt = self._rt()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        rt.reset()
        if getattr(rt.executor, "channel", None) is None:
            # the GPU executors keep no host channel, but the host steps of resize / lb_* / PP agreements do
            # (over the bootstrap's rank state): resynchronise those too, or a failed agreement stays refused
            Channel(self.bootstrap).reset()

    def barrier(
        self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True
    ) -> None:
        """A barrier over every rank of the buffer (on the comm stream, ordered after the compute stream)."""
        rt = self._rt()
        cuda = self.device.type == "cuda"
        if cuda and with_cpu_sync:
            torch.cuda.synchronize()
        with self._scope(None, None, False) if use_comm_stream else contextlib.nullcontext():
            rt.barrier()
        if cuda and with_cpu_sync:
            torch.cuda.synchronize()

    def _own_tensor(self, arr: Any, dtype: torch.dtype) -> torch.Tensor | None:
        """An array of the buffer's own memory (a zero-copy output, the combine buffer) as a tensor of ``dtype``:
        on the GPU one tensor per place, sliced per call (`ZeroCopyTensors`); the reference backend's host memory
        through numpy."""
        if arr is None or arr.device == "cpu":
            return _view_tensor(arr, dtype, self.device)
        tensors = self.__dict__.get("_zero_copy_tensors")
        if tensors is None:
            tensors = self._zero_copy_tensors = ZeroCopyTensors(self.device)
        return tensors.tensor(arr, dtype)

    def get_combine_buffer(self, handle: EPHandle) -> torch.Tensor:
        """Where this rank's expert outputs go for ``combine(..., zero_copy=True)`` (an ep extension, in the spirit of
        DeepEP V1's ``get_next_low_latency_combine_buffer``): a bf16 ``[received rows, hidden]`` view of the buffer's
        own memory (the start of its receive region on the GPU), one row per row of the dispatch's ``recv_x``.
        Write the expert outputs into it and pass it as ``combine``'s ``x``. Valid from the end of the dispatch
        until the next dispatch or combine on this buffer; non-expanded handles, direct mode."""
        return self._own_tensor(self._rt().combine_buffer(handle), torch.bfloat16)

    @property
    def launch_path(self) -> str | None:
        """How this buffer's kernels and stream-order events reach the driver: ep_launch's C++ calls, or the
        cuda-python fallback and why (announced once with a RuntimeWarning); None on the CPU reference backend."""
        return getattr(self._core.executor, "launch_path", None)

    @property
    def nccl_comm_handle(self) -> Any:
        """DeepEP's name for the buffer's NCCL communicator: the ``ep_nccl_gin`` communicator the nccl transport
        runs on (owned, or borrowed from the group), None with the ipc or reference transport and after
        ``destroy()`` (DeepEP sets it to None there too)."""
        if self.runtime is None or self.runtime.destroyed or self.transport != "nccl":
            return None
        return getattr(self.runtime.transport, "communicator", None)


def _int(value: Any) -> Any:
    """``int(value)`` where it casts (a numpy or torch integer), else ``value`` itself: ep-core's constructor then
    refuses it inside its announced block, so the peers raise naming this rank instead of waiting in the
    construction's exchange (issue 41)."""
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError, RuntimeError):
        return value


class EPBuffer(EPBufferSurface, LoadBalance, ElasticBuffer):
    """The newer EP surface (EP buffer on a shared buffer base): ``ElasticBuffer``'s methods in DeepEP 2.5's
    parameter order and defaults (``ep_torch.epbuffer_surface``), planner policy V2.5 (margin 1.3, multiples of 4
    SMs), DeepEP 2.5's load balancing (``lb_allocation_plan_or_num_bytes=``, ``lb_*``: ``ep_torch.load_balance``)
    and 2.6's ``resize`` (``ep_torch.resize``)."""

    policy: PlannerPolicy = PlannerPolicy.V2_5
    resize = _resize
