"""`EPBuffer`'s GPU executor: the `ep_core.executor.Executor` protocol over `RankDriver` (one rank per process; the
transports that allocate its storage, `ep_core.transports`, are not imported here). A storage with a non-zero
`nccl_window` selects the kernels' `NcclTransport`.

Every operation runs on the rank's high-priority comm stream after the caller's stream (`req.stream`), and the
caller's stream then waits for it, so callers need no extra synchronization. `num_device_sms` is the device's SMs
divided by the ranks that drive it (learnt from the device identities exchanged at allocation, or through the
bootstrap), so every rank's grid stays resident. Failures: `ep_core.kernels.rank_runtime`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from ep_core.errors import EPStateError
from ep_core.kernels import _cuda
from ep_core.kernels._cuda import DeviceView, Event, Stream
from ep_core.kernels.array_block import c_strides, carve, int32_block, use_block, use_offered
from ep_core.kernels.op_plan import dispatch_result, note_handle_topk_idx
from ep_core.kernels.plan import epilogue_share, rank_sm_share
from ep_core.kernels.prepared_launch import record_wait
from ep_core.kernels.rank_driver import RankDriver, RankResources, count_ranks_on_device
from ep_core.validation import is_trusted_allocator

__all__ = ["GpuExecutor"]

_NP = {
    "bfloat16": np.uint16,
    "float16": np.float16,
    "float8_e4m3fn": np.uint8,
    "float8_e5m2": np.uint8,
    "uint8": np.uint8,
    "int8": np.int8,
    "uint16": np.uint16,
    "int32": np.int32,
    "uint32": np.uint32,
    "float32": np.float32,
    "int64": np.int64,
}


_NP_DTYPES = {name: np.dtype(t) for name, t in _NP.items()}
_U8, _U16 = np.dtype(np.uint8), np.dtype(np.uint16)
# `np.dtype.name` is a slow property: the names of the dtypes the kernels allocate, looked up by dtype
_NP_NAMES = {
    np.dtype(t): np.dtype(t).name for t in (np.int8, np.int32, np.uint32, np.float16, np.float32, np.int64)
}


def _view(info: Any) -> DeviceView | None:
    """An ep_core `ArrayInfo` (byte strides, dtype name) as a kernel-side `DeviceView` (element strides)."""
    if info is None:
        return None
    dtype = _NP_DTYPES.get(info.dtype, _U8)
    size = dtype.itemsize
    strides = tuple([int(s) // size for s in info.strides])
    return DeviceView(int(info.ptr), tuple(info.shape), dtype, strides, owner=info.obj)


class GpuExecutor:
    """`Executor` of one rank: validated requests in, kernels launched on the comm stream."""

    array_device = "cuda"
    # honours `DispatchRequest.zero_copy` (`RankDriver.launch_dispatch(zero_copy=True)`; EPBuffer asks for this mark)
    zero_copy_dispatch = True
    # no host channel: the kernels meet their peers on the device (`EPBuffer._step` reads this)
    channel = None

    def __init__(self, config: Any, storage: Any, bootstrap: Any) -> None:  # an IpcStorage or NcclStorage
        self.config = config
        self.bootstrap = bootstrap
        self.device_id = int(getattr(storage, "device", 0))
        devices = getattr(storage, "rank_devices", None)
        if devices is None:  # storage that did not exchange device identities (nccl): a collective here
            devices = [b.decode() for b in bootstrap.allgather(_cuda.device_identity().encode())]
        self.num_ranks_on_device = count_ranks_on_device(list(devices), int(config.rank))
        self.device_sms = _cuda.num_device_sms()
        # the SMs this rank may use: the device's, split between the ranks that share it
        self.num_device_sms = rank_sm_share(self.device_sms, self.num_ranks_on_device)
        self.nvlink_gbs: float | None = None
        self.rdma_gbs: float | None = None
        # the whole data region, its host part included: receive regions may spill into it (ep_core.elastic_memory)
        data = int(storage.num_bytes) - int(config.num_workspace_bytes)
        self.stream = Stream(high_priority=True)
        res = RankResources(
            config.rank,
            config.num_ranks,
            int(storage.ptr),
            data,
            storage.peer_table,
            self.stream,
            nccl_window=int(getattr(storage, "nccl_window", 0) or 0),
            nccl_devcomm=int(getattr(storage, "nccl_devcomm", 0) or 0),
            num_ranks_on_device=self.num_ranks_on_device,
        )
        # hybrid topologies (several NVLink domains, allow_hybrid_mode) run the hybrid kernels; over ipc every rank is
        # load/store reachable, so their scale-out put is the emulated one (emulated nodes on one host); over nccl it
        # is the gin one, with the storage's GIN device communicator (`nccl_devcomm`)
        # several nodes without hybrid mode run direct mode across nodes (the same scale-out put to every rank of
        # another node: direct_xnode.cuh); num_nvlink_ranks = the ranks of one node
        topology = getattr(config, "topology", None)
        su = topology.num_scaleup_ranks if topology is not None and topology.is_hybrid else None
        nvl = topology.num_nvlink_ranks if topology is not None else None
        self.rank = RankDriver(
            res,
            num_max_tokens_per_rank=config.num_max_tokens_per_rank,
            gpu_timeout_secs=config.num_gpu_timeout_secs,
            cpu_timeout_secs=config.num_cpu_timeout_secs,
            num_scaleup_ranks=su,
            num_nvlink_ranks=nvl,
            epilogue_sms=epilogue_share(
                config.prefer_overlap_with_compute, self.device_sms, self.num_ranks_on_device
            ),
        )
        # where `launch_step` lives, read by `EPBuffer`'s announcing block on every call without a property call
        self.launch_counter = (self.rank, "_num_collective_launches")
        self._destroyed = False
        # the reused events of `stream_pairs`, made at first use (`stream_events`)
        self.enter_event: Event | None = None
        self.leave_event: Event | None = None
        self._allocators: dict = {}
        # C++ event pairs and launches (ep_launch) loaded now, or cuda-python (announced once, `launch_path`)
        _cuda.native_launch()
        self.launch_path = _cuda.native_launch_status()

    @property
    def launch_step(self) -> int:
        """The device-side step counter (`RankDriver.launch_step`): see `ep_core.EPBuffer.announce_error`."""
        return self.rank._num_collective_launches  # `RankDriver.launch_step`'s field (read on every call)

    def abandon_step(self) -> None:
        self.rank.abandon_step()

    def default_allocator(self, shape: tuple, dtype: str) -> Any:
        """Outputs on this GPU (stream-ordered on the comm stream), as ep_core DeviceArrays with real dtype names."""
        from ep_core.device_array import DeviceArray as CoreArray

        mem = _cuda.DeviceArray(tuple(shape), _NP.get(dtype, np.uint8), self.stream)
        return CoreArray(mem.ptr, tuple(shape), dtype, device="cuda", device_id=self.device_id, owner=mem)

    # exact shapes and dtypes on this GPU (`validation.trust_handle`)
    default_allocator.ep_core_trusted = True

    def _allocator(self, req: Any, x_dtype: str):
        """`RankDriver`'s allocator (numpy dtypes) over the request's (dtype names). One per (allocator, x dtype),
        reused by every call of that pair: the rank allocates up to eight arrays per dispatch (a new handle's int32
        arrays in one block)."""
        key = (req.allocator, x_dtype)
        try:
            alloc = self._allocators.get(key)
        except TypeError:  # an unhashable allocator: a wrapper per call
            alloc, key = None, None
        if alloc is not None:
            return alloc
        allocate = req.allocator
        # 2-byte storage is bf16 (the only 2-byte output), 1-byte storage has x's dtype (FP8 data)
        names = {**_NP_NAMES, _U16: "bfloat16", _U8: x_dtype}

        def alloc(shape: tuple, dtype: Any, strides: tuple | None = None) -> Any:
            name = names.get(dtype)
            if name is None:
                dt = np.dtype(dtype)
                name = names.get(dt) or dt.name
            if strides is not None and tuple(strides) != c_strides(shape):
                # column-major scales: the storage array [P, ld] (EPBuffer's contract), kernels get its pointer
                _rows, packs = shape
                return allocate((packs, strides[1]), name)
            return allocate(tuple(shape), name)

        # a new handle's int32 arrays in one allocation (ep_core.kernels.array_block): viewed at once by the full
        # path (`int32_block`), left in the block by a repeat (`handle_block`: the handle views a field when read)
        alloc.trusted = is_trusted_allocator(allocate)  # the request's allocator (`validation.trust_handle`)
        # a trusted allocator's `batch`: a plan's allocations in one call (`DispatchPlan.batched`)
        alloc.batch = getattr(allocate, "batch", None) if alloc.trusted else None
        # this executor's own `default_allocator` (DeviceArrays on the comm stream)?
        own = getattr(allocate, "__self__", None) is self and getattr(allocate, "__func__", None) is (
            GpuExecutor.default_allocator
        )
        offered = getattr(allocate, "int32_block", None)  # the allocator's own (ep_torch's: torch views)
        if offered is not None and use_offered():
            alloc.int32_block = offered
            lazy = getattr(allocate, "handle_block", None)
            if lazy is not None:
                alloc.handle_block = lazy
        elif use_block(own):
            alloc.int32_block = lambda shapes: int32_block(allocate, shapes)
            alloc.handle_block = lambda shapes: carve(allocate, shapes)
        if key is not None:
            # callers that make a new allocator per call: keep only recent ones
            if len(self._allocators) >= 16:
                self._allocators.clear()
            self._allocators[key] = alloc
        return alloc

    def stream_pairs(self, stream: int, fresh: bool) -> tuple:
        """One call's stream-order pairs `(wait, signal, leave event)`: the comm stream waits for the caller's
        `stream` (inputs ready), the caller's for the comm stream (outputs ready); each `(event, stream)`, None on the
        comm stream. A plan's run issues them with its first and last launch, the full path around its launches. A
        reused event serves every call (a wait binds to the event's record at the time); `fresh`: a new leave event
        (the caller's)."""
        if self._destroyed:
            raise EPStateError("the executor was destroyed")
        same = stream == self.stream.handle
        if same and not fresh:
            return None, None, None
        enter, leave = self.enter_event, self.leave_event
        if enter is None:
            enter, leave = self.stream_events()
        if fresh:
            leave = Event(timing=False)
        return None if same else (enter, stream), (leave, stream), leave

    def stream_events(self) -> tuple:
        """The two reused events of `stream_pairs`, made at first use (a kept plan takes them at `keep`)."""
        if self.enter_event is None:
            self.enter_event, self.leave_event = Event(timing=False), Event(timing=False)
        return self.enter_event, self.leave_event

    def dispatch(self, req: Any) -> Any:
        """The full path of a request (`RankDriver.dispatch`: every check; `_full`), whose plan serves the later
        requests of its token (`DispatchPlan.serve`); a zero-copy one's outputs are views of its receive region."""
        idx = req.topk_idx
        # the handle's own copy of the routing (`do_handle_copy`: the caller may overwrite its tensor), from the
        # request's allocator: the dispatch kernel fills it as it reads the routing, so it costs no copy on the
        # stream (`OpArgs::topk_idx_copy`); none for an empty routing
        want_copy = req.do_handle_copy and idx is not None and 0 not in idx.shape
        copy = req.allocator(idx.shape, idx.dtype) if want_copy else None

        def launch(record: bool) -> Any:
            return _rank_dispatch(self.rank.dispatch, req, record, copy)

        res, alloc, ev = self._full(req, req.x.dtype, launch)
        if res.handle is not req.handle and idx is not None:
            res.handle.topk_idx = idx.obj if copy is None else copy
            if want_copy and alloc.trusted:
                note_handle_topk_idx(self.rank, res.handle, copy, idx.dtype == "int32")
        return dispatch_result(res, req, ev)

    def _full(self, req: Any, dtype: str, launch: Any) -> tuple:
        """`(launch(record), allocator wrapper, leave event)`: a full path with the request's allocator as the
        rank's, the stream-order pairs around its launches, its plan kept under the request's token."""
        rank, token = self.rank, req.prepared
        alloc = self._allocator(req, dtype)
        wait, signal, ev = self.stream_pairs(req.stream, req.async_with_compute_stream)
        rank._allocator = alloc
        try:
            if wait is not None:
                record_wait(wait[0], wait[1], self.stream.handle)
            res = launch(token is not None)
            if token is not None:
                rank.plans.keep(token, rank.last_repeat)
            if signal is not None:
                record_wait(signal[0], self.stream.handle, signal[1])
        finally:
            rank._allocator = None
        return res, alloc, ev

    def launch_dispatch_deferred(self, req: Any) -> Any:
        """DeepEP 2.5's `defer_epilogue`: `req`'s dispatch kernel alone, on the full path (no kept plan; no routing
        copy: DeepEP's rule there is `do_handle_copy=False`), after the request's stream. Returns `finish(stream)`,
        which does the rest (`RankDriver.finish_dispatch`) on the comm stream, orders `stream` after it and returns
        the `DispatchResult`. Until `finish` this rank must start no other operation: the caller refuses them."""
        rank = self.rank
        alloc = self._allocator(req, req.x.dtype)
        wait, _, _ = self.stream_pairs(req.stream, False)
        with self._serving(alloc, wait):
            pending = _rank_dispatch(rank.launch_dispatch, req, False, None)

        def finish(stream: int) -> Any:
            _, signal, ev = self.stream_pairs(stream, True)
            with self._serving(alloc, None):
                res = rank.finish_dispatch(pending)
            record_wait(signal[0], self.stream.handle, signal[1])
            if res.handle is not req.handle and req.topk_idx is not None:
                res.handle.topk_idx = req.topk_idx.obj
            res.event = ev
            return res

        return finish

    @contextlib.contextmanager
    def _serving(self, alloc: Any, wait: Any) -> Iterator[None]:
        """A deferred operation's step: `alloc` (`_allocator`) as the rank's allocator, the comm stream first
        ordered after `wait` (`stream_pairs`; None: no wait)."""
        self.rank._allocator = alloc
        try:
            if wait is not None:
                record_wait(wait[0], wait[1], self.stream.handle)
            yield
        finally:
            self.rank._allocator = None

    def combine_buffer(self, handle: Any, hidden: int) -> Any:
        """This rank's zero-copy combine buffer (`RankDriver.combine_buffer`)."""
        return self.rank.combine_buffer(handle, hidden)

    def combine(self, req: Any) -> Any:
        """The full path of a combine request (`RankDriver.combine`; `dispatch`'s, with `CombinePlan.serve`)."""
        res, _alloc, ev = self._full(req, "bfloat16", lambda record: _rank_combine(self.rank, req, record))
        res.event = ev if req.async_with_compute_stream else None  # this call's own result object
        return res

    def launch_combine_deferred(self, req: Any) -> Any:
        """`launch_dispatch_deferred` of a combine: `req`'s send part alone (`RankDriver.combine(defer=True)`).
        `finish(stream)` first orders the comm stream after `stream` (DeepEP launches the reduce on the waiting
        stream), allocates the outputs, launches the reduce, orders `stream` after it and returns the
        `CombineResult`. Until then the receive region holds the rows the reduce reads: the caller refuses other
        operations."""
        alloc = self._allocator(req, "bfloat16")
        wait, _, _ = self.stream_pairs(req.stream, False)
        with self._serving(alloc, wait):
            reduce = _rank_combine(self.rank, req, False, defer=True)

        def finish(stream: int) -> Any:
            wait, signal, ev = self.stream_pairs(stream, True)
            with self._serving(alloc, wait):
                res = reduce()
            record_wait(signal[0], self.stream.handle, signal[1])
            res.event = ev
            return res

        return finish

    def barrier(self) -> None:
        self.stream.synchronize()
        self.rank.check_errors(synchronize=True)  # drained already: confirms earlier no-sync handles
        self.bootstrap.barrier()

    def reset(self) -> None:
        """Clear this rank's error state, workspace and scratch after a failure (a collective: every rank of the
        group calls it; ordered through the bootstrap's barrier)."""
        if self._destroyed:
            raise EPStateError("the executor was destroyed")
        # every stream of the context, not only ours: CUDA-graph replays run on the caller's streams
        _cuda.synchronize_context()
        self.rank.reset_state(self.bootstrap.barrier)

    def destroy(self) -> None:
        if not self._destroyed:
            self.stream.synchronize()
            self._destroyed = True


def _rank_combine(rank: RankDriver, req: Any, record: bool, defer: bool = False) -> Any:
    """`RankDriver.combine` on views of `req`'s arrays, every check on (`defer`: its send part, `finish` returned)."""
    bias = tuple(_view(b) for b in req.bias)
    return rank.combine(
        _view(req.x),
        req.handle,
        topk_weights=_view(req.topk_weights),
        bias=None if not bias else (bias[0] if len(bias) == 1 else bias),
        allow_multiple_reduction=req.allow_multiple_reduction,
        num_sms=req.num_sms,
        record=record,
        zero_copy=req.zero_copy,
        defer=defer,
    )


def _rank_dispatch(call: Any, req: Any, record: bool, copy: Any) -> Any:
    """`call` (`RankDriver.dispatch`, or `launch_dispatch` for a deferred epilogue) on views of `req`'s arrays, every
    check on; `copy`: the new handle's copy of the routing, filled by the kernel."""
    return call(
        _view(req.x),
        _view(req.topk_idx),
        _view(req.topk_weights),
        sf=_view(req.sf),
        num_experts=req.num_experts,
        expert_alignment=req.expert_alignment,
        do_expand=req.do_expand,
        do_cpu_sync=req.do_cpu_sync,
        deterministic=req.deterministic,
        do_zero_padding=req.do_zero_padding,
        use_tma_aligned_col_major_sf=req.use_tma_aligned_col_major_sf,
        handle=req.handle,
        num_sms=req.num_sms,
        cumulative_local_expert_recv_stats=_view(req.cumulative_local_expert_recv_stats),
        record=record,
        topk_idx_copy=copy,
        zero_copy=req.zero_copy,
    )
