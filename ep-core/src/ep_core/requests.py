"""What crosses the executor boundary (`ep_core.executor`): the buffer's validated configuration, the validated
requests that `ep_core.validation` builds, and the results an executor returns. One definition of each, shared by
the reference executor, the GPU executor and the kernels' `RankDriver`; no behaviour beyond plain data."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ep_core.device_array import ArrayInfo, host_copy
from ep_core.handle import ARRAY_FIELDS, EPHandle
from ep_core.planner import PlannerPolicy
from ep_core.topology import Topology

__all__ = [
    "Allocator",
    "BufferConfig",
    "CombineArgs",
    "CombineRequest",
    "CombineResult",
    "DispatchArgs",
    "DispatchRequest",
    "DispatchResult",
    "PreparedToken",
]

# EPHandle's leading scalars, in its positional order (`DispatchResult.to_reference`)
_HANDLE_SCALARS = ("do_expand", "num_experts", "expert_alignment", "num_max_tokens_per_rank", "num_sms")

Allocator = Callable[[tuple[int, ...], str], Any]
"""`allocator(shape, dtype) -> array`: a new (contiguous, row-major) array on the executor's device."""


class DispatchArgs(NamedTuple):
    """The arguments of one dispatch as the caller gave them (`EPBuffer.dispatch`'s parameters, in its order, and
    `zero_copy`): built once at the top of the call and passed down whole, to the prepared-operation cache
    (`ep_core.prepared`, which keys on them) and the validator (`validation.validate_dispatch`, which reads them
    by name). A tuple: immutable, and as cheap to build as the positional lists it replaces."""

    x: Any
    topk_idx: Any = None
    topk_weights: Any = None
    cumulative_local_expert_recv_stats: Any = None
    num_experts: Any = None
    num_max_tokens_per_rank: Any = None
    expert_alignment: Any = None
    num_sms: Any = 0
    num_qps: Any = 0
    previous_event: Any = None
    previous_event_before_epilogue: Any = None
    async_with_compute_stream: Any = False
    allocate_on_comm_stream: Any = False
    handle: Any = None
    do_handle_copy: Any = True
    do_cpu_sync: Any = None
    do_expand: Any = False
    do_zero_padding: Any = False
    use_tma_aligned_col_major_sf: Any = False
    allocator: Any = None
    stream: Any = 0
    zero_copy: Any = False


class CombineArgs(NamedTuple):
    """The arguments of one combine as the caller gave them (`EPBuffer.combine`'s parameters, in its order, and
    `zero_copy`), then the framework layer's `out_dtype` and `defer_epilogue` (ep_torch's `ElasticBuffer.combine`
    runs those roads itself; `EPBuffer.run_combine` refuses a record that sets them); see `DispatchArgs`."""

    x: Any
    handle: Any
    topk_weights: Any = None
    bias: Any = None
    num_sms: Any = 0
    num_qps: Any = 0
    previous_event: Any = None
    previous_event_before_epilogue: Any = None
    async_with_compute_stream: Any = False
    allocate_on_comm_stream: Any = False
    allocator: Any = None
    stream: Any = 0
    zero_copy: Any = False
    out_dtype: Any = None
    defer_epilogue: Any = False


class PreparedToken:
    """The identity of one prepared-operation entry (`ep_core.prepared`): every request served from that entry
    carries the same token (`request.prepared`; None for a request built by the validation alone), so an executor
    may key on it what it derived from the entry's shapes for the first of them (the GPU executor: the entry's plan
    in its rank's one plan cache, `ep_core.kernels.prepared_launch.PlanCache`)."""

    __slots__ = ()


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
    # the outputs are views of the executor's own memory, in deterministic order (`EPBuffer.dispatch(zero_copy=)`)
    zero_copy: bool = False
    prepared: PreparedToken | None = field(default=None, compare=False, repr=False)

    @property
    def is_cached(self) -> bool:
        return self.handle is not None


@dataclass(eq=False)
class DispatchResult:
    """Outputs of one rank's dispatch (`ep_core.executor` says their shapes); `event` only when async."""

    recv_x: Any
    recv_sf: Any | None
    recv_topk_idx: Any | None
    recv_topk_weights: Any | None
    handle: EPHandle
    event: Any = None

    def to_reference(self) -> Any:
        """The same result as numpy arrays, as an `ep_core.reference.DispatchOutput` (synchronizes)."""
        from ep_core.reference import DispatchOutput

        h = self.handle
        handle = EPHandle(
            *(getattr(h, f) for f in _HANDLE_SCALARS),
            host_copy(h.topk_idx),
            h.num_recv_tokens,
            h.num_expanded_tokens,
            list(h.num_recv_tokens_per_expert_list),
            *(host_copy(getattr(h, f)) for f in ARRAY_FIELDS[1:]),
            num_ranks=h.num_ranks,
            rank=h.rank,
        )
        return DispatchOutput(
            host_copy(self.recv_x),
            host_copy(self.recv_sf),
            host_copy(self.recv_topk_idx),
            host_copy(self.recv_topk_weights),
            handle,
        )


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
    zero_copy: bool = False  # `x` is the executor's combine buffer, read in place (`EPBuffer.combine_buffer`)
    prepared: PreparedToken | None = field(default=None, compare=False, repr=False)


@dataclass(eq=False)
class CombineResult:
    """`combined_x` `[T, H]` bf16; `combined_topk_weights` `[T, K]` float32 or None; `event` only when async."""

    combined_x: Any
    combined_topk_weights: Any | None
    event: Any = None

    def to_reference(self) -> Any:
        """The same result as numpy arrays, as an `ep_core.reference.CombineOutput` (synchronizes)."""
        from ep_core.reference import CombineOutput

        return CombineOutput(host_copy(self.combined_x), host_copy(self.combined_topk_weights))
