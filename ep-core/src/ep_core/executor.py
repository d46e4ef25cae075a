"""The executor interface between `EPBuffer` (validation) and an implementation (GPU kernels, or the reference).

`EPBuffer` validates every input (SPEC §6, `ep_core.validation`), resolves defaults (SM and QP counts, sizes from
the handle, `do_cpu_sync`), and hands an immutable request to its executor, which runs the operation and allocates
every output through `request.allocator(shape, dtype) -> array` (dtype names as in `ep_core.device_array`).

Contract for implementers (the GPU kernels implement `Executor`, and a `Transport` that builds it):

- `Transport.create_executor(config, buffer)`: called once by `EPBuffer.__init__` after the buffer's storage
  exists (`buffer.bootstrap`, `buffer.storage` = `[workspace | GPU buffer | CPU buffer]`, `buffer.workspace` /
  `buffer.data` uint8 views). `Transport.allocate(bootstrap, num_bytes)` returns that storage (`ptr`, `num_bytes`,
  optional `close()`); `Transport.num_nvlink_ranks(bootstrap)` the NVLink (LSA) domain size.
- `Executor` attributes read by the validation: `array_device` ("cuda" or "cpu"), `device_id`, `num_device_sms`
  (the SMs this rank may use: the device's divided by the ranks sharing it, so that all their grids stay resident);
  optional `nvlink_gbs` / `rdma_gbs` (GB/s) for the SM planner when `num_sms=0`.
- `dispatch(req)` returns `DispatchResult` (a cached dispatch returns `req.handle` itself); `combine(req)`
  `CombineResult`. Bad expert ids are `EPDeviceError` / `EPValueError` (on the device into the workspace error word,
  raised at the next sync, or on the host); waits raise `EPTimeoutError(rank, tag, counter, value)`.
- Output shapes: SPEC §2 (R rows: exact with CPU sync, else the worst case); `recv_sf` with
  `use_tma_aligned_col_major_sf` is the storage array `[P, align(R, 4)]` (the logical `[R, P]` is `recv_sf.T[:R]`);
  `recv_topk_idx` int64 (None in expand mode); handle arrays come from the allocator too (`ep_core.handle`).
- Zero-copy (optional): `zero_copy_dispatch = True` honours `DispatchRequest.zero_copy` (the outputs are views of the
  executor's memory, deterministic row order, valid until its next dispatch or combine); `combine_buffer(handle,
  hidden)` returns the bf16 array a zero-copy combine reads in place. `EPBuffer` refuses `zero_copy` otherwise.
- Failures: after a timeout a GPU executor raises at every call, launching nothing, until `reset()` (optional, not
  in the protocol: a collective ordered through the bootstrap's barrier); outputs are valid once a later call
  returned without raising (`ep_core.kernels.rank_driver`, "Failures").
- Events/streams: `req.stream` is the caller's stream as an int handle (0 = default; ignored by host executors);
  `previous_event` is opaque to all but the executor; `DispatchResult.event` / `CombineResult.event` only when
  `async_with_compute_stream`.
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
