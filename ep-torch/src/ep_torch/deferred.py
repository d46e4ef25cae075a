"""``dispatch(..., defer_epilogue=True)`` and ``combine(..., defer_epilogue=True)`` on CUDA: the communication now,
the epilogue at the event's wait (issue 42).

Dispatch. DeepEP 2.5 defers "the CPU receive-count wait and copy epilogue until ``event.current_stream_wait()``".
ep-core's GPU executor splits a dispatch there (``GpuExecutor.launch_dispatch_deferred``, ``ep_core.EPBuffer
.launch_dispatch_deferred``): the call validates and launches the dispatch kernel (and queues a CPU sync's count
copies) and returns the ``EventOverlap`` at once; its first ``current_stream_wait()`` waits for the counts (CPU sync),
allocates the outputs, launches the copy epilogue on the comm stream, makes the current stream wait for it and
returns ``(recv_x, recv_topk_idx, recv_topk_weights, handle)``. Between the two the host is free: a CPU-sync
dispatch no longer blocks in the call, and kernels queued on the compute stream before the wait run beside the
dispatch kernel.

Combine. DeepEP 2.5 defers "the reduce epilogue": its call launches the combine kernel (the rows pushed to their
source ranks), its wait allocates the outputs and launches the reduce on the waiting stream. ep's direct combine
splits the same way (``GpuExecutor.launch_combine_deferred``, ``ep_core.EPBuffer.launch_combine_deferred``: the
send-only and reduce-only launches of a split combine, ``ep_core.kernels.combine_launch``): the call launches the send
part; the wait orders the comm stream after the waiting stream (the reduce follows its work, as DeepEP's runs on
it), allocates ``(combined_x, combined_topk_weights)``, launches the reduce and makes the waiting stream wait for
it. The bits are the ordinary combine's. ``x`` is read until the epilogue (a dispatch's own rows come from ``x``,
a combine's reduce reads its own rows in place): keep it unchanged until the wait. Hybrid and cross-node combines have no separate reduce: they run whole at the call and
the wait hands the outputs over.

Streams: the outputs are allocated on the executor's comm stream (the stream the epilogue writes them on: no wait for
the compute stream's queued work, which would also hold the CPU sync back) and recorded on the waiting stream; the
inputs and the handle's arrays are recorded on the comm stream (it reads them after the call returned; the closure
keeps them until the epilogue is queued). Until the wait the buffer refuses ``dispatch``, ``combine`` and
``destroy`` (``EPStateError``): the pending call owns the rank's count words and receive region. Refused inside
CUDA-graph capture (``EPValueError``; the wait runs host work).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from ep_core.errors import EPStateError, EPValueError
from ep_core.handle import EPHandle
from ep_core.requests import CombineArgs, DispatchArgs

from .event import EventOverlap

__all__ = ["WAITING", "comm_stream_of", "deferred_combine", "deferred_dispatch", "hold"]


def comm_stream_of(buf: Any, device: torch.device) -> torch.cuda.Stream:
    """The stream every GPU operation of `buf`'s rank runs on (ep-core's executor's comm stream: the dispatch and
    combine kernels), as a torch stream."""
    stream = getattr(buf._core.executor, "stream", None)
    handle = getattr(stream, "handle", None)
    if handle is None:  # (a GPU executor always has one)
        raise EPStateError(f"{type(buf).__name__}: the buffer's executor has no CUDA stream")
    return torch.cuda.ExternalStream(int(handle), device=device)


# a deferred operation's refusal of the buffer's other calls until its wait (`hold`)
WAITING = (
    "a deferred {} of this buffer waits for its event's current_stream_wait() (defer_epilogue=True); "
    "wait on it first"
)


def hold(buf: Any, why: str) -> Any:
    """`buf`'s dispatch / combine / destroy refused (``EPStateError``: ``"name(): why"``) while a deferred operation
    waits for its event's wait (`WAITING`) or a receive view is out (``ep_torch.recv_view.lend``): instance
    attributes shadowing the methods (the calls of a buffer holding nothing pay nothing for it; "destroy" among them
    is also resize's marker of a call that owns the buffer: ``ep_torch.resize``); returns the function that gives
    them back. The CPU reference backend holds the buffer as CUDA does, so that code tried there meets the GPU's
    rule."""

    def busy(name: str) -> Any:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            with buf._core.announcing(name):  # the peers' call waits in its first step (issue 41)
                raise EPStateError(f"{name}(): {why}")

        return refuse

    names = ("dispatch", "combine", "destroy")
    for name in names:
        buf.__dict__[name] = busy(name)

    def release() -> None:
        for name in names:
            buf.__dict__.pop(name, None)

    return release


def deferred_dispatch(buf: Any, call: dict) -> EventOverlap:
    """A deferred dispatch of `buf` on CUDA (module doc); `call`: the dispatch's arguments by name, DeepEP's and ep's
    rules already checked, inside the call's announcing block (``DispatchCombine._deferred``: an error here is
    announced to the peers as the dispatch's)."""
    from .dispatch_combine import _cuda_tensors, _handle_tensors, _received

    x, topk_idx, handle, do_expand = call["x"], call["topk_idx"], call["handle"], call["do_expand"]
    _not_captured("dispatch", "the CPU sync, the epilogue's launch")
    if handle is not None and not do_expand and isinstance(handle, EPHandle):
        do_expand = handle.do_expand  # DeepEP: a cached dispatch takes its layout from the handle
    first = x[0] if isinstance(x, tuple) and len(x) == 2 else x
    device = first.device if isinstance(first, torch.Tensor) else buf.device
    tma = call["use_tma_aligned_col_major_sf"]
    finish = launch_split_dispatch(buf, call, device, handle, do_expand, tma)
    w, stats = call["topk_weights"], call["cumulative_local_expert_recv_stats"]

    def done(res: Any, waiting: torch.cuda.Stream, comm: torch.cuda.Stream) -> tuple:
        for t in _cuda_tensors((res.recv_x, res.recv_sf, res.recv_topk_idx, res.recv_topk_weights)):
            t.record_stream(waiting)
        for t in _handle_tensors(res.handle):
            t.record_stream(comm)
            t.record_stream(waiting)
        if handle is None:
            res.handle.topk_idx = topk_idx  # the caller's tensor itself (do_handle_copy=False)
        return _received(res.recv_x, res.recv_sf, tma), res.recv_topk_idx, res.recv_topk_weights, res.handle

    return _deferred(buf, "dispatch", device, _cuda_tensors((x, topk_idx, w, stats)), finish, done)


def launch_split_dispatch(
    buf: Any, call: dict, device: torch.device, handle: Any, do_expand: bool, tma: bool
) -> Any:
    """ep-core's split dispatch of `call` (its arguments by name, inside the call's announcing block) on `device`:
    the dispatch kernel launched, its ``finish(stream)`` returned (the CPU sync, the outputs, the epilogue). Shared
    by the deferred dispatch and ``borrow_recv`` (``recv_view.borrow``)."""
    from .dispatch_combine import _current_stream, _plain

    rt = buf._rt()
    allocator = buf._allocators.get(device) if "_allocators" in buf.__dict__ else None
    if allocator is None:
        allocator = buf._announced("dispatch", buf._allocator, device)
    previous_event = call["previous_event"]
    scoped = previous_event is not None or bool(call["allocate_on_comm_stream"])
    x, topk_idx, do_cpu_sync = call["x"], call["topk_idx"], call["do_cpu_sync"]
    w, stats = call["topk_weights"], call["cumulative_local_expert_recv_stats"]
    with buf._scope("dispatch", previous_event, True) if scoped else contextlib.nullcontext():
        return rt.launch_dispatch_deferred(
            DispatchArgs(
                _plain(x),
                _plain(topk_idx) if topk_idx is not None else None,
                _plain(w) if w is not None else None,
                _plain(stats) if stats is not None else None,
                call["num_experts"],
                call["num_max_tokens_per_rank"],
                call["expert_alignment"],
                call["num_sms"],
                call["num_qps"],
                previous_event,
                call["previous_event_before_epilogue"],
                True,
                bool(call["allocate_on_comm_stream"]),
                handle,
                False,
                None if do_cpu_sync is None else bool(do_cpu_sync),
                bool(do_expand),
                bool(call["do_zero_padding"]),
                bool(tma),
                allocator,
                _current_stream(buf._device_index),
                False,
            )
        )


def _deferred(buf: Any, op: str, device: torch.device, inputs: list, finish: Any, done: Any) -> EventOverlap:
    """The deferred call's event, after its launch: `inputs` (its CUDA tensors) recorded on the comm stream and kept
    until the epilogue is queued (the epilogue reads them too: a dispatch's own rows from `x`, a combine's reduce its
    own rows in place), the buffer held until the wait (`hold`); the first wait runs `finish(waiting stream)` on the
    comm stream (the outputs from its pool, module doc), gives the buffer back and returns `done(result, waiting
    stream, comm stream)`."""
    comm = comm_stream_of(buf, device)
    for t in inputs:  # the comm stream reads them after this call returned
        t.record_stream(comm)
    event = EventOverlap.recorded(torch.cuda.current_stream())
    release = hold(buf, WAITING.format(op))

    def epilogue() -> tuple:
        waiting = torch.cuda.current_stream(device)
        try:
            with torch.cuda.stream(comm):
                res = finish(waiting.cuda_stream)
        finally:
            release()
        del inputs[:]  # (held until the epilogue was queued: their frees wait for it, `record_stream`)
        return done(res, waiting, comm)

    event.register_hook_after_wait(epilogue)
    return event


def _not_captured(op: str, work: str) -> None:
    if torch.cuda.is_current_stream_capturing():
        raise EPValueError(
            f"defer_epilogue: not inside CUDA-graph capture (the wait runs host work: {work}); capture the {op} "
            "without defer_epilogue"
        )


def deferred_combine(buf: Any, a: CombineArgs) -> EventOverlap:
    """A deferred combine of `buf` on CUDA (module doc); `a`: the combine's record, DeepEP's and ep's rules already
    checked, inside the call's announcing block (``DispatchCombine._deferred``)."""
    from .dispatch_combine import _cuda_tensors, _current_stream, _handle_tensors

    _not_captured("combine", "the outputs' allocation, the reduce's launch")
    rt = buf._rt()
    device = a.x.device if isinstance(a.x, torch.Tensor) else buf.device
    allocator = a.allocator
    if allocator is None:  # this device's first call
        allocator = buf._announced("combine", buf._allocator, device)
    scoped = a.previous_event is not None or bool(a.allocate_on_comm_stream)
    with buf._scope("combine", a.previous_event, True) if scoped else contextlib.nullcontext():
        stream = _current_stream(buf._device_index)  # (in a comm-stream scope: that stream)
        finish = rt.launch_combine_deferred(a._replace(allocator=allocator, stream=stream))
    handle = a.handle

    def done(res: Any, waiting: torch.cuda.Stream, comm: torch.cuda.Stream) -> tuple:
        for t in _cuda_tensors((res.combined_x, res.combined_topk_weights)):
            t.record_stream(waiting)
        return res.combined_x, res.combined_topk_weights

    inputs = _cuda_tensors((a.x, a.topk_weights, a.bias, handle.topk_idx, *_handle_tensors(handle)))
    return _deferred(buf, "combine", device, inputs, finish, done)
