"""The executor interface between `EPBuffer` (validation) and an implementation (GPU kernels, or the reference).

`EPBuffer` validates every input (SPEC §6, `ep_core.validation`), resolves defaults (SM and QP counts, sizes from
the handle, `do_cpu_sync`), and hands an immutable request to its executor. The executor runs the operation and
allocates every output through `request.allocator(shape, dtype) -> array` (dtype names as in
`ep_core.device_array`).

Contract for implementers (the GPU kernels implement `Executor`, and a `Transport` that builds it):

- `Transport.create_executor(config, buffer)`: called once by `EPBuffer.__init__` after the buffer's storage
  exists. `buffer` is the `EPBuffer` (a `BufferBase`): `buffer.bootstrap`, `buffer.storage` (the symmetric
  allocation `[workspace | GPU buffer | CPU buffer]`), `buffer.workspace` / `buffer.data` (uint8 `DeviceArray`
  views). `Transport.allocate(bootstrap, num_bytes)` returns that storage (`ptr`, `num_bytes`, optional
  `close()`); `Transport.num_nvlink_ranks(bootstrap)` returns the NVLink (LSA) domain size.
- `Executor` attributes read by the validation: `array_device` ("cuda" or "cpu": where input/output arrays
  live), `device_id` (int), `num_device_sms` (int: the SMs this rank may use, i.e. the device's SMs divided by the
  ranks of the group that share the device, so that the planner's count and the `num_sms` bound keep the grids of
  all those ranks resident together); optional `nvlink_gbs` / `rdma_gbs` (float, GB/s) used by the SM planner when
  `num_sms=0` (else environment / detection).
- `dispatch(req)` returns `DispatchResult`; with `req.handle` (cached dispatch) the returned handle must be that
  same object. `combine(req)` returns `CombineResult`. Expert ids `>= num_experts` and duplicate experts in a
  token are reported as `EPDeviceError`/`EPValueError` (checked on the device into the workspace error word and
  raised at the next sync, or on the host). Waits raise `EPTimeoutError(rank, tag, counter, value)`.
- Output shapes (R = rows): non-expand R = exact count with CPU sync else `N*M`; expand R =
  `num_expanded_tokens` (exact aligned sum with CPU sync, else the worst case). `recv_x` `[R, H]` (dtype of x),
  `recv_sf`: `[R, P]` row-major, or with `use_tma_aligned_col_major_sf` the **storage** array `[P, align(R, 4)]`
  (row-major), i.e. the logical `[R, P]` column-major tensor is `recv_sf.T[:R]`; `recv_topk_idx` `[R, K]`
  int64 (None in expand mode); `recv_topk_weights` `[R, K]` / `[R]` float32 (None without weights).
  Handle arrays (`EPHandle`) are allocated through the allocator too; see `ep_core.handle`.
- Failures: after a wait timed out, a GPU executor raises at its next call (`EPTimeoutError`), and at every call
  after that, launching nothing, until `reset()`: an optional method (not part of the `Executor` protocol that
  `isinstance` checks), a collective that every rank calls together (ordered through the bootstrap's barrier).
  Outputs of an operation are valid once a later call returned without raising; an operation that failed leaves
  its outputs undefined (`ep_core.kernels.executor`, "Failures").
- Events/streams: `req.stream` is the caller's (compute) stream as an int handle (0 = default stream; ignored by
  host executors); `previous_event` is an opaque object the executor understands; `DispatchResult.event` /
  `CombineResult.event` is returned when `async_with_compute_stream` (None otherwise).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ep_core import reference
from ep_core.device_array import ArrayInfo, DeviceArray, describe, host_allocator, to_numpy
from ep_core.envelope import Channel
from ep_core.errors import EPTypeError, EPValueError
from ep_core.handle import EPHandle
from ep_core.planner import PlannerPolicy
from ep_core.topology import Topology

__all__ = [
    "Allocator",
    "BufferConfig",
    "CombineRequest",
    "CombineResult",
    "DispatchRequest",
    "DispatchResult",
    "Executor",
    "ReferenceExecutor",
    "ReferenceTransport",
    "Transport",
]

Allocator = Callable[[tuple[int, ...], str], Any]
"""`allocator(shape, dtype) -> array`: a new (contiguous, row-major) array on the executor's device."""


@dataclass(frozen=True)
class BufferConfig:
    """The validated construction parameters of an `EPBuffer` (what a transport needs to build an executor)."""

    rank: int
    num_ranks: int
    topology: Topology
    num_bytes: int  # GPU buffer + CPU buffer bytes (2 MiB aligned), without the workspace
    num_cpu_bytes: int
    num_workspace_bytes: int  # 2 MiB aligned workspace in front of the buffer
    num_max_tokens_per_rank: int  # 0 = not given at construction
    hidden: int  # 0 = not given
    num_topk: int  # 0 = not given
    num_experts: int  # 0 = not given
    use_fp8_dispatch: bool
    deterministic: bool
    allow_hybrid_mode: bool
    allow_multiple_reduction: bool
    prefer_overlap_with_compute: bool
    sl_idx: int
    num_allocated_qps: int  # resolved (never 0)
    num_cpu_timeout_secs: float
    num_gpu_timeout_secs: float
    explicitly_destroy: bool
    policy: PlannerPolicy


@dataclass(frozen=True)
class DispatchRequest:
    """A validated dispatch. Array fields are `ArrayInfo` (pointer, shape, byte strides, dtype; `.obj` is the
    caller's object). `x` is `[T, H]` bf16 or FP8 data (float8_e4m3fn or uint8 bits); `sf` `[T, P]` 4-byte
    scale packs with any strides (None for bf16); `topk_idx` `[T, K]` int64/int32, or None for a cached dispatch
    (`handle.topk_idx` holds the routing); `topk_weights` `[T, K]` float32 or None."""

    x: ArrayInfo
    sf: ArrayInfo | None
    topk_idx: ArrayInfo | None
    topk_weights: ArrayInfo | None
    handle: EPHandle | None  # cached dispatch when given
    cumulative_local_expert_recv_stats: ArrayInfo | None  # [epr] int32, += unaligned counts
    num_tokens: int
    hidden: int
    num_topk: int
    num_sf_packs: int  # 0 for bf16
    elem_size: int  # 2 (bf16) or 1 (FP8)
    num_experts: int
    num_max_tokens_per_rank: int
    expert_alignment: int
    num_sms: int  # resolved, > 0
    num_qps: int  # resolved, > 0
    do_cpu_sync: bool
    do_expand: bool
    do_zero_padding: bool
    do_handle_copy: bool
    use_tma_aligned_col_major_sf: bool
    deterministic: bool
    allocator: Allocator
    stream: int = 0
    previous_event: Any = None
    previous_event_before_epilogue: Any = None
    async_with_compute_stream: bool = False
    allocate_on_comm_stream: bool = False

    @property
    def is_cached(self) -> bool:
        return self.handle is not None


@dataclass
class DispatchResult:
    """Outputs of one rank's dispatch (see the module doc for shapes)."""

    recv_x: Any
    recv_sf: Any | None
    recv_topk_idx: Any | None
    recv_topk_weights: Any | None
    handle: EPHandle
    event: Any = None


@dataclass(frozen=True)
class CombineRequest:
    """A validated combine: `x` `[R, H]` bf16 (R = the handle's rows), `topk_weights` `[R, K]` (non-expand) /
    `[R]` (expand) float32 or None, `bias` a tuple of 0, 1 or 2 `[T, H]` bf16 arrays (T = `handle.num_tokens`)."""

    x: ArrayInfo
    handle: EPHandle
    topk_weights: ArrayInfo | None
    bias: tuple[ArrayInfo, ...]
    num_tokens: int
    hidden: int
    num_topk: int
    num_sms: int
    num_qps: int
    allow_multiple_reduction: bool
    allocator: Allocator
    stream: int = 0
    previous_event: Any = None
    previous_event_before_epilogue: Any = None
    async_with_compute_stream: bool = False
    allocate_on_comm_stream: bool = False


@dataclass
class CombineResult:
    """`combined_x` `[T, H]` bf16; `combined_topk_weights` `[T, K]` float32 or None."""

    combined_x: Any
    combined_topk_weights: Any | None
    event: Any = None


@runtime_checkable
class Executor(Protocol):
    """Runs validated requests for one rank (see the module doc for the attributes it must expose)."""

    array_device: str
    device_id: int
    num_device_sms: int

    def dispatch(self, req: DispatchRequest) -> DispatchResult: ...

    def combine(self, req: CombineRequest) -> CombineResult: ...

    def barrier(self) -> None: ...

    def destroy(self) -> None: ...


@runtime_checkable
class Transport(Protocol):
    """Builds the storage and the executor of an `EPBuffer`."""

    def num_nvlink_ranks(self, bootstrap: Any) -> int: ...

    def allocate(self, bootstrap: Any, num_bytes: int) -> Any: ...

    def create_executor(self, config: BufferConfig, buffer: Any) -> Executor: ...


# ------------------------------------------------------------------------------------------------------------
# reference executor: ep_core.reference over host arrays, inputs exchanged through the bootstrap


class ReferenceTransport:
    """Host storage and a `ReferenceExecutor` (CPU tests; a CPU backend for any bootstrap)."""

    def __init__(
        self,
        num_device_sms: int = 132,
        nvlink_gbs: float = 450.0,
        rdma_gbs: float = 50.0,
        num_nvlink_ranks: int | None = None,
    ) -> None:
        self._num_device_sms = num_device_sms
        self._nvlink_gbs = nvlink_gbs
        self._rdma_gbs = rdma_gbs
        self._num_nvlink_ranks = num_nvlink_ranks

    def num_nvlink_ranks(self, bootstrap: Any) -> int:
        return self._num_nvlink_ranks or bootstrap.size

    def allocate(self, bootstrap: Any, num_bytes: int) -> Any:
        from ep_core.buffer_base import HostStorage

        return HostStorage(num_bytes)

    def create_executor(self, config: BufferConfig, buffer: Any) -> ReferenceExecutor:
        ex = ReferenceExecutor(config, buffer.bootstrap, num_device_sms=self._num_device_sms)
        ex.nvlink_gbs = self._nvlink_gbs
        ex.rdma_gbs = self._rdma_gbs
        return ex


def _np(a: Any) -> np.ndarray | None:
    return None if a is None else np.array(to_numpy(a), copy=True)


def _handle_key(h: EPHandle) -> tuple:
    """What identifies a handle across ranks: the step of the dispatch that made it, and its layout."""
    return (
        getattr(h, "_ep_step", None),
        h.num_experts,
        h.num_max_tokens_per_rank,
        h.do_expand,
        h.expert_alignment,
    )


def _handle_np(h: EPHandle) -> EPHandle:
    """A copy of a handle whose array fields are numpy arrays (for the exchange between ranks)."""
    import dataclasses

    fields = {}
    for name in (
        "topk_idx",
        "psum_num_recv_tokens_per_scaleup_rank",
        "psum_num_recv_tokens_per_expert",
        "num_unaligned_recv_tokens_per_expert",
        "recv_src_metadata",
        "dst_buffer_slot_idx",
    ):
        v = getattr(h, name)
        fields[name] = v if isinstance(v, np.ndarray) else _np(v)
    return dataclasses.replace(
        h,
        **fields,
        token_metadata_at_forward=None,
        channel_linked_list=None,
        cached_recv_src_metadata_before_sort=None,
    )


class ReferenceExecutor:
    """Runs `ep_core.reference` for host arrays. Every rank gathers all ranks' inputs through the bootstrap,
    computes the whole reference and keeps its own part, so it works across threads or processes."""

    array_device = "cpu"
    device_id = 0

    def __init__(self, config: BufferConfig, bootstrap: Any, *, num_device_sms: int = 132) -> None:
        self.config = config
        self.bootstrap = bootstrap
        self.num_device_sms = num_device_sms
        self.nvlink_gbs: float | None = None
        self.rdma_gbs: float | None = None
        self.num_dispatches = 0
        self.num_combines = 0
        set_timeout = getattr(bootstrap, "set_timeout", None)
        if set_timeout is not None:  # bound every host wait by the buffer's num_cpu_timeout_secs
            set_timeout(config.num_cpu_timeout_secs)
        self.channel = Channel(bootstrap)

    def _dispatch_envelope(self, req: DispatchRequest) -> dict[str, Any]:
        """The configuration of a dispatch that every rank must agree on."""
        h = req.handle
        return {
            "num_experts": req.num_experts,
            "num_max_tokens_per_rank": req.num_max_tokens_per_rank,
            "hidden": req.hidden,
            "num_topk": req.num_topk,
            "x.dtype": req.x.dtype,
            "sf": None if req.sf is None else (req.sf.dtype, req.num_sf_packs),
            "topk_weights": req.topk_weights is not None,
            "do_expand": req.do_expand,
            "expert_alignment": req.expert_alignment,
            "do_cpu_sync": req.do_cpu_sync,
            "handle": None if h is None else _handle_key(h),
        }

    def _check_routing(self, req: DispatchRequest, idx: np.ndarray | None) -> None:
        """This rank's expert ids, checked before the exchange so that the error is this rank's own (announced to
        the peers, which raise `EPPeerError` naming this rank, the token and the lane)."""
        if idx is None or idx.size == 0:
            return
        rank, e = self.config.rank, req.num_experts
        bad = np.argwhere((idx < -1) | (idx >= e))
        if bad.size:
            t, k = (int(v) for v in bad[0])
            raise EPValueError(
                f"topk_idx[{t}, {k}] = {int(idx[t, k])} on rank {rank} (token {t}, lane {k}) is out of range: expected an expert id "
                f"in [0, {e}) or -1 (no expert); other negative ids are rejected"
            )
        s = np.sort(idx, axis=1)
        dup = np.argwhere((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0))
        if dup.size:
            t = int(dup[0][0])
            v = int(s[t, dup[0][1]])
            lanes = [int(k) for k in np.flatnonzero(idx[t] == v)]
            raise EPValueError(
                f"topk_idx[{t}] on rank {rank} (token {t}, lanes {lanes}): expert {v} appears twice (or more); each "
                "expert may be chosen once per token"
            )

    @staticmethod
    def _out(allocator: Any, a: np.ndarray | None, dtype: str) -> Any:
        if a is None:
            return None
        arr = allocator(tuple(a.shape), dtype)
        info = describe(arr, "allocator result")
        if info.device != "cpu" or info.shape != tuple(a.shape) or info.dtype != dtype:
            raise EPTypeError(
                f"allocator: expected a host array {tuple(a.shape)} {dtype} for the reference executor, got "
                f"{info.device} {info.shape} {info.dtype}"
            )
        view = to_numpy(arr)
        view[...] = a.view(view.dtype) if a.dtype.itemsize == view.dtype.itemsize else a
        return arr

    def dispatch(self, req: DispatchRequest) -> DispatchResult:
        self.num_dispatches += 1
        cfg = self.config
        mine = {
            "x": _np(req.x.obj),
            "sf": _np(req.sf.obj) if req.sf is not None else None,
            "topk_idx": _np(req.topk_idx.obj) if req.topk_idx is not None else None,
            "topk_weights": _np(req.topk_weights.obj) if req.topk_weights is not None else None,
            "handle": _handle_np(req.handle) if req.handle is not None else None,
        }
        if req.handle is None:
            self._check_routing(req, mine["topk_idx"])
        everyone = self.channel.exchange("dispatch", self._dispatch_envelope(req), mine)
        xs = [(e["x"], e["sf"]) if e["sf"] is not None else e["x"] for e in everyone]
        weights = [e["topk_weights"] for e in everyone]
        weights_arg = None if weights[0] is None else weights
        try:
            if req.handle is None:
                outs = reference.dispatch(
                    xs,
                    [e["topk_idx"] for e in everyone],
                    weights_arg,
                    num_experts=req.num_experts,
                    num_max_tokens_per_rank=req.num_max_tokens_per_rank,
                    expert_alignment=req.expert_alignment,
                    do_expand=req.do_expand,
                    do_cpu_sync=req.do_cpu_sync,
                    use_tma_aligned_col_major_sf=False,
                    num_scaleup_ranks=cfg.topology.num_scaleup_ranks,
                    num_sms=req.num_sms,
                )
            else:
                outs = reference.dispatch(xs, None, weights_arg, handles=[e["handle"] for e in everyone])
        except ValueError as exc:  # raised alike on every rank (every rank computes the whole reference)
            raise EPValueError(f"dispatch (reference, every rank): {exc}") from exc
        out = outs[cfg.rank]
        alloc = req.allocator
        recv_x = self._out(alloc, out.recv_x, req.x.dtype)
        recv_sf = None
        if out.recv_sf is not None:
            sf = np.ascontiguousarray(out.recv_sf)
            if req.use_tma_aligned_col_major_sf:
                rows = sf.shape[0]
                storage = np.zeros((sf.shape[1], reference.align(rows, 4)), dtype=sf.dtype)
                storage[:, :rows] = sf.T
                sf = storage
            recv_sf = self._out(alloc, sf, req.sf.dtype)
        recv_idx = self._out(alloc, out.recv_topk_idx, "int64")
        recv_w = self._out(alloc, out.recv_topk_weights, "float32")
        if req.handle is not None:
            handle = req.handle
        else:
            h = out.handle
            topk_idx = (
                self._out(
                    alloc,
                    h.topk_idx.astype(np.int64 if req.topk_idx.dtype == "int64" else np.int32),
                    req.topk_idx.dtype,
                )
                if req.do_handle_copy
                else req.topk_idx.obj
            )
            handle = EPHandle(
                h.do_expand,
                h.num_experts,
                h.expert_alignment,
                h.num_max_tokens_per_rank,
                req.num_sms,
                topk_idx,
                h.num_recv_tokens,
                h.num_expanded_tokens,
                list(h.num_recv_tokens_per_expert_list),
                self._out(alloc, h.psum_num_recv_tokens_per_scaleup_rank, "int32"),
                self._out(alloc, h.psum_num_recv_tokens_per_expert, "int32"),
                self._out(alloc, h.num_unaligned_recv_tokens_per_expert, "int32"),
                self._out(alloc, h.recv_src_metadata, "int32"),
                self._out(alloc, h.dst_buffer_slot_idx, "int32"),
                num_ranks=cfg.num_ranks,
                rank=cfg.rank,
            )
            handle._ep_step = self.channel.seq - 1  # which collective step made it: handle identity for peers
            if req.cumulative_local_expert_recv_stats is not None:
                stats = to_numpy(req.cumulative_local_expert_recv_stats.obj)
                stats += h.num_unaligned_recv_tokens_per_expert.astype(stats.dtype)
        return DispatchResult(recv_x, recv_sf, recv_idx, recv_w, handle)

    def combine(self, req: CombineRequest) -> CombineResult:
        self.num_combines += 1
        mine = {
            "x": _np(req.x.obj),
            "handle": _handle_np(req.handle),
            "topk_weights": _np(req.topk_weights.obj) if req.topk_weights is not None else None,
            "bias": tuple(_np(b.obj) for b in req.bias),
        }
        config = {
            "hidden": req.hidden,
            "num_topk": req.num_topk,
            "handle": _handle_key(req.handle),
            "topk_weights": req.topk_weights is not None,
            "bias": len(req.bias),
            "allow_multiple_reduction": req.allow_multiple_reduction,
        }
        everyone = self.channel.exchange("combine", config, mine)
        weights = [e["topk_weights"] for e in everyone]
        biases = [
            None if not e["bias"] else e["bias"][0] if len(e["bias"]) == 1 else e["bias"] for e in everyone
        ]
        outs = reference.combine(
            [e["x"] for e in everyone],
            [e["handle"] for e in everyone],
            topk_weights=None if weights[0] is None else weights,
            bias=biases,
            allow_multiple_reduction=req.allow_multiple_reduction,
            num_scaleup_ranks=self.config.topology.num_scaleup_ranks,
        )
        out = outs[self.config.rank]
        return CombineResult(
            self._out(req.allocator, out.combined_x, "bfloat16"),
            self._out(req.allocator, out.combined_topk_weights, "float32"),
        )

    def barrier(self) -> None:
        self.channel.exchange("barrier", {})

    def reset(self) -> None:
        """Nothing to clear on the host; a collective like the GPU executor's."""
        self.channel.exchange("reset", {})

    def destroy(self) -> None:
        return None

    @staticmethod
    def default_allocator(shape: tuple[int, ...], dtype: str) -> DeviceArray:
        return host_allocator(shape, dtype)
