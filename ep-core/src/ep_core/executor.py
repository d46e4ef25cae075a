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
- Zero-copy (optional): `zero_copy_dispatch = True` marks an executor that honours `DispatchRequest.zero_copy` (the
  outputs, not the handle, are views of its own memory, in the deterministic row order, valid until its next
  dispatch or combine); `combine_buffer(handle, hidden)` returns the bf16 array a `CombineRequest.zero_copy` combine
  reads in place (bf16 `recv_x` of a zero-copy dispatch is that memory). `EPBuffer` refuses `zero_copy` for an
  executor without them.
- Failures: after a wait timed out, a GPU executor raises at its next call (`EPTimeoutError`), and at every call
  after that, launching nothing, until `reset()`: an optional method (not part of the `Executor` protocol that
  `isinstance` checks), a collective that every rank calls together (ordered through the bootstrap's barrier).
  Outputs of an operation are valid once a later call returned without raising; an operation that failed leaves
  its outputs undefined (`ep_core.kernels.rank_driver`, "Failures").
- Events/streams: `req.stream` is the caller's (compute) stream as an int handle (0 = default stream; ignored by
  host executors); `previous_event` is an opaque object the executor understands; `DispatchResult.event` /
  `CombineResult.event` is returned when `async_with_compute_stream` (None otherwise).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from ep_core.reference_executor import ReferenceExecutor, ReferenceTransport
from ep_core.requests import (
    Allocator,
    BufferConfig,
    CombineRequest,
    CombineResult,
    DispatchRequest,
    DispatchResult,
)

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
