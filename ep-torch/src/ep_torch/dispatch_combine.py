"""``ElasticBuffer.dispatch`` / ``combine``: the road of one call from DeepEP's signature to ep-core
(:class:`DispatchCombine`, a part of :class:`~ep_torch.buffer.ElasticBuffer`).

A call either takes the express lane of its kind (ep-core's plan of its last call, or of an earlier one of other
shapes, ``ep_core.EPBuffer.keep_lane``: the arrays matched by the host extension's native signature, every scalar
the recorded call's), or builds ep-core's argument
record (``DispatchArgs`` / ``CombineArgs``) once and hands it to ``run_dispatch`` / ``run_combine``, which announce
an error of the call (a call on the comm stream runs inside a block of the buffer's own); the outputs come back as
torch tensors in DeepEP's return tuples.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch
from ep_core import device_array
from ep_core.errors import EPTypeError, EPValueError
from ep_core.handle import EPHandle
from ep_core.requests import CombineArgs, DispatchArgs

from . import _env, host_extension
from ._streams import comm_stream
from .event import EventHandle, EventOverlap
from .handle_version import KEPT as _kept_versions
from .handle_version import check_announced as _check_version
from .handle_version import keep as _keep_version

# ep-core's dtype names are torch's
_TORCH_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in "bfloat16 float16 float32 float64 float8_e4m3fn float8_e5m2 int8 uint8 int16 int32 "  # noqa: SIM905
    "int64 uint16 uint32 uint64 bool".split()
}


def _plain(a: Any) -> Any:
    """``a`` without autograd history (DLPack refuses tensors that require grad; autograd is ep_torch.functional's
    business), keeping tuples and non-tensors as they are so that ep-core validates them. A tensor that needs no
    grad is passed as it is (a detached alias would be the same memory, shape and strides, at the cost of a new
    tensor object per call)."""
    if isinstance(a, torch.Tensor):
        return a.detach() if a.requires_grad else a
    if isinstance(a, tuple):
        return tuple(_plain(v) for v in a)
    return a


def _current_stream(index: int | None = None) -> int:
    """The raw handle of the current CUDA stream of device ``index`` (None: the current device), the stream the
    operation is ordered after, read without building a ``torch.cuda.Stream`` object when torch offers it
    (``torch.cuda.current_stream(index).cuda_stream`` otherwise)."""
    if index is None:
        index = torch.cuda.current_device()
    if _raw_stream is not None:
        return _raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


_NO_LANES: Mapping[str, Any] = MappingProxyType({})
_NO_SCOPE = contextlib.nullcontext()  # reusable: the scope of a call that needs no comm-stream context

# torch's own accessor of the raw current stream (what torch.compile's generated code calls); None if absent
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _handle_tensors(handle: Any) -> tuple:
    """The tensors a dispatch's kernels wrote into its new handle (the routing copy, the int32 arrays; a repeated
    dispatch's still in their one block): an async call records them on the streams like its outputs, so that a
    handle dropped before the comm stream is done cannot give their memory back early."""
    return tuple([v for v in handle.held() if isinstance(v, torch.Tensor)])


def _cuda_tensors(items: Any) -> list[torch.Tensor]:
    """The CUDA tensors among ``items``, tuples (an FP8 ``x``, a bias pair) opened."""
    out = []
    for a in items:
        if isinstance(a, tuple):
            out.extend(_cuda_tensors(a))
        elif isinstance(a, torch.Tensor) and a.is_cuda:
            out.append(a)
    return out


def _match(arrays: tuple, allocator: Any) -> Any:
    """The host extension's native comparison of a later call's arrays with these (`ep_core.EPBuffer.keep_lane`'s
    `match`, from the `signature` kept on the allocator), or None: arrays a signature cannot hold. An FP8 ``x``
    (``(data, scales)``) is matched as its two tensors: `match` returns both pointers, then the others'."""
    signature = allocator.signature
    x = arrays[0]
    try:
        if type(x) is torch.Tensor:
            return signature(*arrays).match
        if type(x) is tuple and len(x) == 2 and type(x[0]) is type(x[1]) is torch.Tensor:
            # the plan passes an FP8 x's two tensors apart (`ep_core.kernels.op_plan.DispatchPlan.__call__`)
            return signature(x[0], x[1], *arrays[1:]).match
    except (TypeError, ValueError):  # a subclass, autograd, a layout describe reads itself
        pass
    return None


def _received(recv_x: Any, recv_sf: Any, col_major: Any) -> Any:
    """A dispatch's ``recv_x`` as DeepEP returns it: ``(data, scales)`` iff it received FP8 scales; column-major
    scales as the logical ``[R, P]`` view of their storage ``[P, align(R, 4)]``."""
    if recv_sf is None:
        return recv_x
    if col_major:
        recv_sf = recv_sf.t()[: recv_x.shape[0]]
    return recv_x, recv_sf


def _same(a: tuple, b: tuple) -> bool:
    """Whether a call's scalars are the recorded call's (a lane's `scalars`, `ep_core.EPBuffer.keep_lane`): each the same object, or an int equal to
    a recorded int (a count computed anew on each call, such as ``x.shape[0]`` above the small-int cache). Never
    an equal value of another type (``16.0`` for ``16``, ``True`` for ``1``): validation keys those apart."""
    return all(map(operator.is_, a, b)) or all(map(_same_scalar, a, b))


def _same_scalar(a: Any, b: Any) -> bool:
    return a is b or (type(a) is int and type(b) is int and a == b)


class _CommScope:
    """The comm stream made current for one operation, after ``previous_event`` (a CPU one: nothing) or the compute
    stream, which waits back on a normal exit unless async (a class here: a repeat enters no other ep module)."""

    __slots__ = ("comm", "compute", "context", "wait_back")

    def __init__(self, comm: Any, previous_event: EventHandle | None, wait_back: bool) -> None:
        self.compute, self.comm, self.wait_back = torch.cuda.current_stream(), comm, wait_back
        if previous_event is None:
            comm.wait_stream(self.compute)
        elif previous_event.event is not None:  # (`EventHandle.stream_wait`, read as a field)
            comm.wait_event(previous_event.event)
        self.context = torch.cuda.stream(comm)

    def __enter__(self) -> None:
        self.context.__enter__()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.context.__exit__(exc_type, exc, tb)
        if exc_type is None and self.wait_back:
            self.compute.wait_stream(self.comm)


class DispatchCombine:
    """The dispatch / combine methods of :class:`~ep_torch.buffer.ElasticBuffer` (module doc)."""

    @property
    def _lanes(self) -> Mapping[str, Any]:
        """ep-core's kept plans of this buffer by kind (`ep_core.EPBuffer.keep_lane`): "dispatch" (no-sync),
        "dispatch_sync", "dispatch_zero_copy", "dispatch_cached", "combine", "combine_zero_copy"; the current
        runtime's (a resize makes a new one), none for a buffer made without __init__."""
        return getattr(self.__dict__.get("_core"), "_lanes", _NO_LANES)

    # ----------------------------------------------------------------------------------------------------------------
    # dispatch / combine

    def _allocator(self, device: torch.device) -> Any:
        """Outputs as torch tensors on ``device``, from the caching allocator of the current stream (one allocator
        per device, reused by every call). It offers ``int32_block``: a new handle's int32 arrays as disjoint views
        of one ``torch.empty`` (``ep_core.kernels.array_block``; they all belong to the one handle returned), and
        ``handle_block``: the same block, each view made when the handle's field is first read; with the host
        extension also ``batch``: a callable making several outputs in one C call (ep-core's express lane)."""
        allocators = self.__dict__.setdefault("_allocators", {})
        allocate = allocators.get(device)
        if allocate is None:
            # on the CPU only when asked for (EPKIT_TORCH_HOST_EXTENSION=1): the CPU reference backend has no use
            # for it, and a CPU-only install should not compile anything
            wanted = device.type == "cuda" or _env.host_extension() == "1"
            native = host_extension.module() if wanted else None
            if native is not None:
                # at::empty in one C call (torch's Python argument parser skipped); the extension also reads the
                # tensors' facts for ep_core's describe from now on
                device_array.set_torch_reader(native.facts)
                empty, index = (
                    native.empty,
                    (torch.cuda.current_device() if device.index is None else device.index)
                    if device.type == "cuda"
                    else -1,
                )

                def allocate(shape: tuple[int, ...], dtype: str) -> torch.Tensor:
                    return empty(shape, _TORCH_DTYPES[dtype], index)

                def batch(specs: tuple) -> Any:
                    # ep-core's express lane: one call that makes every (shape, dtype name) of `specs`
                    made = tuple([(tuple(shape), _TORCH_DTYPES[name]) for shape, name in specs])
                    return functools.partial(native.empty_many, made, index)

                allocate.batch = batch  # type: ignore[attr-defined]
                allocate.signature = native.signature  # type: ignore[attr-defined]  # (`_match`'s)

            else:

                def allocate(shape: tuple[int, ...], dtype: str) -> torch.Tensor:
                    # `size=` by keyword: torch's argument parser then skips the varargs-size overload it otherwise
                    # tries first on a tuple (about half a microsecond of every allocation)
                    return torch.empty(size=shape, dtype=_TORCH_DTYPES[dtype], device=device)

            from ep_core.kernels import array_block

            # through the module attribute: benchmarks' step timers (ep-core/benchmarks/host_steps.py) see it
            allocate.int32_block = lambda shapes: array_block.int32_block(allocate, shapes)  # type: ignore[attr-defined]
            # the same block with no view made: a repeated dispatch's new handle views a field when it is read
            allocate.handle_block = lambda shapes: array_block.carve(allocate, shapes)  # type: ignore[attr-defined]
            # exact shapes and dtypes on `device`: ep-core records the handles made from it as validated
            allocate.ep_core_trusted = True  # type: ignore[attr-defined]
            allocators[device] = allocate
        return allocate

    def _announced(self, op: str, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` in an announcing block of its own: what may raise before ep-core's block (`_rt`'s error, a
        device's first allocator)."""
        with self._core.announcing(op):
            return fn(*args)

    def _check_capture(self, do_cpu_sync: Any) -> None:
        """A CPU sync refused inside CUDA-graph capture (never asked of `do_cpu_sync=False`: no capture query)."""
        capturing = self._cuda and torch.cuda.is_current_stream_capturing()
        if capturing and (do_cpu_sync is None or bool(do_cpu_sync)):
            raise EPValueError(
                "do_cpu_sync: a dispatch inside CUDA-graph capture must not sync with the CPU; pass "
                "do_cpu_sync=False (worst-case shapes) or a cached handle"
            )

    def _refuse_capture(self, do_cpu_sync: Any) -> None:
        """`_check_capture` of a dispatch without a handle (a CPU sync inside CUDA-graph capture: the caller's
        error), refused before any launch: announced (the step given up) as ep-core's block announces."""
        try:
            self._check_capture(do_cpu_sync)
        except Exception:
            with self._core.announcing("dispatch"):
                raise

    def _event(self, keep: tuple[Any, ...], scoped: Any = False) -> EventOverlap:
        """An async call's ``EventOverlap`` (one call into :mod:`ep_torch.event`): on CUDA an event recorded on the
        stream the operation ended on (`scoped`: the comm stream, after its scope), with every operand
        ``record_stream``-ed on both streams (or kept in the event with ``EPKIT_AVOID_RECORD_STREAM=1``)."""
        if not self._cuda:
            return EventOverlap.recorded(None)
        stream = self.get_comm_stream() if scoped else torch.cuda.current_stream()
        tensors = _cuda_tensors(keep)
        if _env.avoid_record_stream():
            return EventOverlap.recorded(stream, tensors)
        comm = self.get_comm_stream()
        for t in tensors:  # (on CUDA the comm stream exists)
            t.record_stream(stream)
            t.record_stream(comm)
        return EventOverlap.recorded(stream)

    def get_comm_stream(self) -> torch.cuda.Stream | None:
        """The process-wide high-priority communication stream (None on the CPU reference backend), kept here."""
        comm = self.__dict__.get("_comm_stream")
        if comm is None and self.device.type == "cuda":
            comm = self.__dict__["_comm_stream"] = comm_stream(self.device)
        return comm

    def _scope(self, op: str | None, previous_event: Any, async_with_compute_stream: Any) -> Any:
        """A call's `_CommScope` (none on the CPU backend) after ``previous_event``'s type check; a failure to build it
        (no launch yet) is announced as `op`'s (None: the caller's block announces, or nothing does)."""
        if previous_event is not None and not isinstance(previous_event, EventHandle):
            raise EPTypeError(
                f"previous_event: expected an EventHandle (buffer.capture()), got {type(previous_event).__name__}"
            )
        if not self._cuda:
            return _NO_SCOPE
        try:
            return _CommScope(self.get_comm_stream(), previous_event, not async_with_compute_stream)
        except Exception:
            with self._core.announcing(op) if op else _NO_SCOPE:
                raise

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
        *,
        defer_epilogue: bool = False,
        borrow_recv: bool = False,
        zero_copy: bool = False,
    ) -> tuple[Any, torch.Tensor | None, torch.Tensor | None, EPHandle, EventOverlap] | EventOverlap:
        """Send every token to the ranks of its top-k experts (SPEC §2).

        Returns ``(recv_x, recv_topk_idx, recv_topk_weights, handle, event)``; ``recv_x`` is a ``(data, sf)`` tuple
        iff ``x`` was one; ``recv_topk_idx`` is None with ``do_expand=True``; ``event`` holds an event only with
        ``async_with_compute_stream=True``. With ``handle=`` this is a cached dispatch: same rows, same order, and the
        returned handle is the one given.

        Ours and DeepEP 2.5's, keyword-only (ep-torch's README, "Zero-copy dispatch" and the API table):
        ``zero_copy=True``: the outputs are views of the buffer's own memory (valid until its next dispatch or
        combine; bf16 ``recv_x`` is :meth:`get_combine_buffer`'s memory); ``defer_epilogue=True``: only the
        ``EventOverlap`` is returned, whose first ``current_stream_wait()`` returns the other four (:meth:`_deferred`);
        ``borrow_recv=True``: ``recv_x`` is a :class:`~ep_torch.DispatchRecvView` (:meth:`_borrow`).
        """
        if defer_epilogue is not False or borrow_recv is not False:  # the one test the calls without them pay
            # this call without the deferral / the borrow, its arguments by name (the parameters are the only
            # locals yet)
            call = {
                k: v
                for k, v in locals().items()
                if k not in ("self", "defer_epilogue", "borrow_recv", "zero_copy")
            }

            def again(**kw: Any) -> Any:
                return self.dispatch(**call, **kw)

            if borrow_recv:
                return self._borrow(
                    x,
                    handle,
                    do_cpu_sync,
                    do_expand,
                    bool(defer_epilogue),
                    zero_copy,
                    async_with_compute_stream,
                    again,
                    call,
                )
            return self._deferred(
                "dispatch",
                defer_epilogue,
                async_with_compute_stream,
                do_handle_copy,
                zero_copy,
                lambda: again(zero_copy=zero_copy),
                call,
            )
        # DeepEP 2.5: a handle's kept topk_idx unchanged since its dispatch (ep_torch.handle_version)
        if handle is not None and _kept_versions:
            kept = _kept_versions.get(id(handle))  # inline: the kept-plan road enters no module for it
            if kept is not None and kept[1]._version != kept[2]:
                _check_version(self, handle, "dispatch")  # raises (unless another handle had this id)
        # the express lanes (`ep_core.EPBuffer.keep_lane`): a repeat of a dispatch of its kind (no-sync, CPU-sync
        # with the same `do_cpu_sync` object, zero-copy, or cached: a handle of the same layout, no routing or stats)
        # without an epilogue event, every scalar the same object as that call's, the arrays (stats too) compared by
        # `match`; in its comm-stream scope (a `previous_event` of the one type, with `allocate_on_comm_stream`: D15)
        scoped = previous_event is not None or allocate_on_comm_stream
        plain = (
            previous_event_before_epilogue is None
            and (
                previous_event is None
                or (allocate_on_comm_stream and isinstance(previous_event, EventHandle))
            )
            and (
                handle is None
                or (topk_idx is cumulative_local_expert_recv_stats is None and zero_copy is False)
            )
        )
        lane_scalars: tuple = (
            num_experts,
            num_max_tokens_per_rank,
            expert_alignment,
            num_sms,
            num_qps,
            do_cpu_sync,
            use_tma_aligned_col_major_sf,
            do_expand,
            do_zero_padding,
            async_with_compute_stream,
            do_handle_copy,
            cumulative_local_expert_recv_stats is None,  # (a plan kept with stats matches them too)
        )
        if zero_copy is False:
            kind = "dispatch" if do_cpu_sync is False else "dispatch_sync"
        else:  # a zero-copy dispatch's outputs are views of the buffer's memory, as tensors of x's dtypes
            kind = "dispatch_zero_copy" if zero_copy is True and do_cpu_sync is False else None
            data, sf = x if isinstance(x, tuple) and len(x) == 2 else (x, None)
        if handle is not None and zero_copy is False:
            kind = "dispatch_cached"
        lane = self._lanes.get(kind)
        if plain and lane is not None and _same(lane_scalars, lane.scalars):
            if handle is None and do_cpu_sync is not False:
                self._refuse_capture(do_cpu_sync)
            b, w, s = topk_idx if handle is None else handle, topk_weights, cumulative_local_expert_recv_stats
            if not scoped:
                got = lane(x, b, w, _current_stream(self._device_index) if self._cuda else 0, s)
            else:  # (in its scope the current stream is the comm stream)
                with self._scope("dispatch", previous_event, async_with_compute_stream):
                    got = lane(x, b, w, _current_stream(self._device_index) if self._cuda else 0, s)
            if got is not None:
                if handle is None and not do_handle_copy:
                    _keep_version(got.handle, topk_idx)
                if async_with_compute_stream:  # the ordinary road's event: every operand on the streams
                    outs = (got.recv_x, got.recv_sf, got.recv_topk_idx, got.recv_topk_weights)
                    event = self._event((x, topk_idx, w, *outs, *_handle_tensors(got.handle)), scoped)
                else:
                    event = EventOverlap(None)
                if zero_copy is not False:
                    outs = (got.recv_x, got.recv_sf, got.recv_topk_idx, got.recv_topk_weights)
                    recv_x, recv_idx, recv_w = self._zero_copy_outputs(data, sf, *outs)
                    return recv_x, recv_idx, recv_w, got.handle, event
                recv_x = _received(got.recv_x, got.recv_sf, use_tma_aligned_col_major_sf)
                return recv_x, got.recv_topk_idx, got.recv_topk_weights, got.handle, event
        # the ordinary road: ep-core's `run_dispatch` announces an error of the call (`announcing`); what may raise
        # here first is announced by a block of its own, and a call on the comm stream runs in one block whole
        with self._core.announcing("dispatch") if scoped else _NO_SCOPE:
            rt = self.runtime
            if rt is None or rt._destroyed:  # (`_rt`'s test, inline: the field, no property call)
                rt = self._announced("dispatch", self._rt)  # raises
            if handle is None and do_cpu_sync is not False:
                self._refuse_capture(do_cpu_sync)
            if handle is not None and not do_expand and isinstance(handle, EPHandle) and zero_copy is False:
                do_expand = handle.do_expand  # DeepEP: a cached dispatch takes its layout from the handle
            first = x[0] if isinstance(x, tuple) and len(x) == 2 else x
            device = first.device if isinstance(first, torch.Tensor) else self.device
            allocator = self._allocators.get(device) or self._announced("dispatch", self._allocator, device)
            lane = None  # this call's plan kept as the lane of its kind, for the next one (`batch`: host extension)
            if plain and kind is not None and getattr(allocator, "batch", None) is not None:
                arrays = (x, topk_idx, topk_weights) if handle is None else (x, topk_weights)
                if cumulative_local_expert_recv_stats is not None:
                    arrays += (cumulative_local_expert_recv_stats,)
                lane = (kind, _match(arrays, allocator), lane_scalars, handle)
            with self._scope(None, previous_event, async_with_compute_stream) if scoped else _NO_SCOPE:
                res = rt.run_dispatch(
                    DispatchArgs(
                        x if type(x) is torch.Tensor and not x.requires_grad else _plain(x),
                        _plain(topk_idx) if topk_idx is not None else None,
                        _plain(topk_weights) if topk_weights is not None else None,
                        None
                        if cumulative_local_expert_recv_stats is None
                        else _plain(cumulative_local_expert_recv_stats),
                        num_experts,
                        num_max_tokens_per_rank,
                        expert_alignment,
                        num_sms,
                        num_qps,
                        previous_event,
                        previous_event_before_epilogue,
                        bool(async_with_compute_stream),
                        bool(allocate_on_comm_stream),
                        handle,
                        bool(do_handle_copy),
                        None if do_cpu_sync is None else bool(do_cpu_sync),
                        bool(do_expand),
                        bool(do_zero_padding),
                        bool(use_tma_aligned_col_major_sf),
                        allocator,
                        _current_stream(self._device_index) if self._cuda else 0,
                        zero_copy,
                    ),
                    lane,
                )
                # a zero-copy dispatch's outputs are the buffer's memory, not the caching allocator's: only the
                # handle's tensors need recording on the streams
                outs = (res.recv_x, res.recv_sf, res.recv_topk_idx, res.recv_topk_weights)
                event = (
                    self._event((x, topk_idx, topk_weights, *outs, *_handle_tensors(res.handle)))
                    if async_with_compute_stream
                    else EventOverlap(None)
                )
        if handle is None:
            if not do_handle_copy:
                # the caller's tensor itself (ep-core saw a detached alias of it)
                res.handle.topk_idx = topk_idx
                _keep_version(res.handle, topk_idx)
            elif res.handle.topk_idx is topk_idx:
                # ep-core copies every non-empty routing into the handle (the dispatch kernel fills the copy); an
                # empty one stays an alias, never the caller's tensor object
                res.handle.topk_idx = topk_idx.detach()
        if zero_copy is not False:
            recv_x, recv_idx, recv_w = self._zero_copy_outputs(data, sf, *outs)
            return recv_x, recv_idx, recv_w, res.handle, event
        recv_x = _received(res.recv_x, res.recv_sf, use_tma_aligned_col_major_sf)
        return recv_x, res.recv_topk_idx, res.recv_topk_weights, res.handle, event

    def _deferred(
        self,
        op: str,
        defer_epilogue: Any,
        async_with_compute_stream: Any,
        do_handle_copy: Any,
        zero_copy: Any,
        call: Any,
        args: Any,
    ) -> Any:
        """A ``dispatch`` / ``combine`` with ``defer_epilogue`` set (DeepEP 2.5): ``call()`` runs the operation
        without it (`args`: a dispatch's arguments by name, a combine's ``CombineArgs``); a false value other than
        ``False`` (``0``) is the ordinary call. DeepEP's rules (``async_with_compute_stream=True``;
        ``do_handle_copy=False`` for a dispatch) and ep's (no ``zero_copy``) are checked before any launch; the
        returned ``EventOverlap``'s first ``current_stream_wait()`` returns the outputs. On CUDA the operation is
        split (:mod:`ep_torch.deferred`: the wait runs the epilogue or the reduce); on the CPU reference backend it
        is the ordinary async one, whose outputs the event's hook hands over."""
        if not defer_epilogue:
            return call()
        with self._core.announcing(op):  # a refusal here precedes the call's first step (issue 41)
            if not async_with_compute_stream:
                raise EPValueError(
                    f"defer_epilogue: a deferred {op} returns only its event, whose current_stream_wait() runs the "
                    "epilogue; pass async_with_compute_stream=True with it (DeepEP's rule)"
                )
            if do_handle_copy:
                raise EPValueError(
                    "defer_epilogue: a deferred dispatch keeps the caller's topk_idx in its handle; pass "
                    "do_handle_copy=False with it (DeepEP's rule)"
                )
            if zero_copy is not False:
                raise EPValueError(
                    f"defer_epilogue: a zero-copy {op} has no epilogue to defer; pass one of zero_copy and "
                    "defer_epilogue"
                )
            from . import deferred

            if self._cuda:
                return (deferred.deferred_dispatch if op == "dispatch" else deferred.deferred_combine)(
                    self, args
                )
            outputs = call()
            event: EventOverlap = outputs[-1]
            earlier = event.hook_after_wait
            event.hook_after_wait = None
            release = deferred.hold(self, deferred.WAITING.format(op))  # held until the wait, as on CUDA

            def epilogue() -> tuple:
                release()
                if earlier is not None:
                    earlier()
                return outputs[:-1]

            event.register_hook_after_wait(epilogue)
            return event

    def _borrow(
        self,
        x: Any,
        handle: Any,
        do_cpu_sync: Any,
        do_expand: Any,
        defer_epilogue: bool,
        zero_copy: Any,
        async_with_compute_stream: Any,
        call: Any,
        args: dict,
    ) -> tuple:
        """A dispatch with ``borrow_recv=True`` (DeepEP 2.5): ``call()`` runs it without the keyword; returns
        ``(view, recv_topk_idx, recv_topk_weights, handle, event)``, ``view`` a
        :class:`~ep_torch.recv_view.DispatchRecvView` of the received rows (:func:`~ep_torch.recv_view.borrow`;
        `args`: the call's arguments by name).
        DeepEP's refusals come first (``EPValueError``, before any launch): a bf16 tensor ``x`` only (no FP8
        tuple), no ``do_expand``, no ``defer_epilogue``, no ``do_cpu_sync=False``, no cached ``handle``; ep's: no
        ``zero_copy``. A rank's own choice, as DeepEP's: its peers may dispatch without it."""
        from .recv_view import borrow

        refusals = (
            (type(x) is not torch.Tensor or x.dtype != torch.bfloat16, "x must be one bfloat16 tensor"),
            (bool(do_expand), "do_expand=True is not supported"),
            (defer_epilogue, "defer_epilogue=True is not supported"),
            (do_cpu_sync is not None and not do_cpu_sync, "do_cpu_sync=False is not supported"),
            (handle is not None, "a cached dispatch (handle=) is not supported"),
            (zero_copy is not False, "zero_copy is not supported"),
        )
        with self._core.announcing("dispatch"):  # before the call's first step: announced (issue 41)
            for refused, why in refusals:
                if refused:
                    raise EPValueError(f"borrow_recv=True: {why} (a receive view holds compact bf16 rows)")
        return borrow(self, args, call)

    def _end_borrow(self) -> None:
        """The view was released: the buffer's own methods again."""
        for name in ("dispatch", "combine", "destroy"):
            self.__dict__.pop(name, None)

    def _zero_copy_outputs(
        self, data: Any, sf: Any, recv_x: Any, recv_sf: Any, recv_idx: Any, recv_w: Any
    ) -> tuple[Any, torch.Tensor | None, torch.Tensor | None]:
        """A zero-copy dispatch's views as tensors of the caller's dtypes (``data`` / ``sf``: ``x``'s parts):
        ``(recv_x, recv_topk_idx, recv_topk_weights)``, ``recv_x`` a ``(data, scales)`` tuple iff ``x`` was one.
        On the GPU, once the buffer's tensors exist (`ZeroCopyTensors`, made by the first call's ``_own_tensor``),
        one call of theirs makes all of them."""
        tensors = self.__dict__.get("_zero_copy_tensors")
        if tensors is not None:
            return tensors.outputs(
                recv_x, data.dtype, recv_sf, None if sf is None else sf.dtype, recv_idx, recv_w
            )
        own = self._own_tensor
        rx = own(recv_x, data.dtype)
        if sf is not None:
            rx = (rx, own(recv_sf, sf.dtype))
        return rx, own(recv_idx, torch.int64), own(recv_w, torch.float32)

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
        *,
        defer_epilogue: bool = False,
        out_dtype: torch.dtype | None = None,
        zero_copy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap] | EventOverlap:
        """Send expert outputs back and sum them per token, unweighted (SPEC §3).

        Returns ``(combined_x [T, hidden] bf16, combined_topk_weights [T, K] float32 | None, event)``. Keyword-only:
        ``zero_copy=True`` (ours): ``x`` is :meth:`get_combine_buffer`'s tensor, read in place;
        ``defer_epilogue=True`` (DeepEP 2.5): only the ``EventOverlap``, whose first ``current_stream_wait()``
        returns the outputs (:meth:`_deferred`); ``out_dtype=torch.float32`` (DeepEP 2.6): ``combined_x`` in
        float32, unrounded (:mod:`ep_torch.combine_out_dtype`).
        """
        # DeepEP 2.5: the kept topk_idx unchanged (ep_torch.handle_version; inline as dispatch's)
        if _kept_versions:
            kept = _kept_versions.get(id(handle))
            if kept is not None and kept[1]._version != kept[2]:
                _check_version(self, handle, "combine")
        # the express lane of a combine of its kind (ordinary, or zero-copy: its plan declines an x that is not the
        # combine buffer: then the road below names the error), in the call's comm-stream scope as `dispatch`'s;
        # `kind`: the lane this call keeps after its ordinary road (None: none)
        kind = None
        scoped = previous_event is not None or allocate_on_comm_stream
        if (
            (out_dtype is None or out_dtype is torch.bfloat16)
            and (defer_epilogue is False or not defer_epilogue)
            and bias is None
            and previous_event_before_epilogue is None
            and (
                previous_event is None
                or (allocate_on_comm_stream and isinstance(previous_event, EventHandle))
            )
        ):
            if zero_copy is False:
                kind = "combine"
            elif zero_copy is True:
                kind = "combine_zero_copy"
            lane = self._lanes.get(kind)
            if lane is not None and _same((num_sms, num_qps, async_with_compute_stream), lane.scalars):
                w = topk_weights
                if not scoped:
                    got = lane(x, handle, w, _current_stream(self._device_index) if self._cuda else 0)
                else:  # (in its scope the current stream is the comm stream)
                    with self._scope("combine", previous_event, async_with_compute_stream):
                        got = lane(x, handle, w, _current_stream(self._device_index) if self._cuda else 0)
                if got is not None:
                    if async_with_compute_stream:  # the ordinary road's event
                        event = self._event((x, w, None, got.combined_x, got.combined_topk_weights), scoped)
                    else:
                        event = EventOverlap(None)
                    return got.combined_x, got.combined_topk_weights, event
        # the one record of this call (ep-core's `CombineArgs`): the FP32 and deferred roads and the ordinary one
        # read it; the allocator of a device's first call and a comm-stream scope's stream are filled in below
        px = x if type(x) is torch.Tensor and not x.requires_grad else _plain(x)
        pw = _plain(topk_weights) if topk_weights is not None else None
        return self._run_combine(
            CombineArgs(
                px,
                handle,
                pw,
                _plain(bias) if bias is not None else None,
                num_sms,
                num_qps,
                previous_event,
                previous_event_before_epilogue,
                bool(async_with_compute_stream),
                bool(allocate_on_comm_stream),
                getattr(self, "_allocators", _NO_LANES).get(
                    x.device if isinstance(x, torch.Tensor) else self.device
                ),
                _current_stream(self._device_index) if self._cuda else 0,
                zero_copy,
                None if out_dtype is torch.bfloat16 else out_dtype,  # bf16: the ordinary combine
                defer_epilogue,
            ),
            None if kind is None else (kind, px is x and pw is topk_weights),
        )

    def _run_combine(self, a: CombineArgs, keep: tuple | None, in_block: bool = False) -> Any:
        """`combine` of its record: the FP32 output (:mod:`ep_torch.combine_out_dtype`), the deferred epilogue
        (:meth:`_deferred`) or the ordinary road, which then keeps its plan as the lane ``keep[0]`` (``keep[1]``:
        the record's arrays are the caller's; autograd ones, detached here, are never matched: no lane)."""
        # 2.6's FP32 output: a road of its own
        if a.out_dtype is not None and a.out_dtype is not torch.bfloat16:
            from .combine_out_dtype import combine_out_dtype

            return combine_out_dtype(self, a)
        if a.defer_epilogue is not False:  # the one test the calls without it pay
            return self._deferred(
                "combine",
                a.defer_epilogue,
                a.async_with_compute_stream,
                False,
                a.zero_copy,
                lambda: self._run_combine(a._replace(defer_epilogue=False), keep),
                a,
            )
        # the ordinary road, announced as a dispatch's (`dispatch`): a call on the comm stream in one block whole
        scoped = a.previous_event is not None or a.allocate_on_comm_stream
        if scoped and not in_block:
            with self._core.announcing("combine"):
                return self._run_combine(a, keep, True)
        rt = self.runtime
        if rt is None or rt._destroyed:  # (`_rt`'s test, inline)
            rt = self._announced("combine", self._rt)  # raises
        if a.allocator is None:  # this device's first call
            device = a.x.device if isinstance(a.x, torch.Tensor) else self.device
            a = a._replace(allocator=self._announced("combine", self._allocator, device))
        lane = None
        if keep is not None and getattr(a.allocator, "batch", None) is not None:
            match = _match((a.x, a.topk_weights), a.allocator) if keep[1] else None
            lane = (keep[0], match, (a.num_sms, a.num_qps, a.async_with_compute_stream), a.handle)
        if not scoped:
            res = rt.run_combine(a, lane)
        else:  # (in its scope the current stream is the comm stream)
            with self._scope(None, a.previous_event, a.async_with_compute_stream):
                stream = _current_stream(self._device_index) if self._cuda else 0
                res = rt.run_combine(a._replace(stream=stream), lane)
        if a.async_with_compute_stream:  # on the stream the operation ended on
            outs = (a.x, a.topk_weights, a.bias, res.combined_x, res.combined_topk_weights)
            event = self._event(outs, scoped)
        else:
            event = EventOverlap(None)
        return res.combined_x, res.combined_topk_weights, event
