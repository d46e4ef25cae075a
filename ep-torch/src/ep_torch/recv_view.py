"""DeepEP 2.5's ``DispatchRecvView``: what ``dispatch(..., borrow_recv=True)`` returns in place of ``recv_x``.

Logical row ``r`` of the received tokens is ``view.slab[view.row_indices[r]]``. While a view is out, its buffer
refuses ``dispatch``, ``combine``, ``destroy``, ``resize`` and ``lb_*`` (``EPStateError``, a ``RuntimeError``) until
``release()``; after ``release()`` the view's ``slab`` / ``row_indices`` raise, and a reference to the slab kept from
before is invalid (DeepEP's rule: the rows belong to the buffer). With ``async_with_compute_stream=True`` the view is
readable once the dispatch's event has been waited on (``event.current_stream_wait()``). Borrowing is a rank's own
choice, as DeepEP's: its peers may dispatch without it.

In place (``view.in_place``, CUDA): as DeepEP's view, the slab is the buffer's receive region itself, ``[N * M,
hidden]`` bf16 rows of the region's tokens (a strided view: each row is a token's hidden part, its tail after it),
and ``row_indices`` (int64) names the slot of each received row in the ordinary dispatch's row order, so
``slab.index_select(0, row_indices)`` is bitwise the ordinary dispatch's ``recv_x``. No copy epilogue for the rows:
the epilogue reads only the peers' tails and writes the other outputs (ids, weights, the handle's metadata), and puts
this rank's own rows (which the dispatch kernel stores as their tail only) whole into their slots from ``x``
(``view.copied_rows`` counts them: the rows of one rank's worth, all of them for a rank alone). Where: a dispatch
DeepEP lets borrow (bf16 ``x``, not expanded, CPU sync, no cached handle) in direct mode within one NVLink domain
(``ep_core``'s ``DispatchLaunch.lends_region``), on a GPU executor that splits a dispatch.

Copied (``view.in_place`` False, ``view.copy_reason`` saying why): the slab is the ordinary dispatch's ``recv_x`` and
``row_indices`` is ``arange(R)``, the same rows at the cost of the copy. Never silent: the CPU reference backend (its
outputs are host copies anyway) and hybrid or cross-node buffers (their receive region does not hold the rows whole:
hybrid forwards them through the scale-up ranks, cross-node stages them) copy.

On CUDA, as DeepEP's view: the view is ready on the stream that waited for the dispatch (an event recorded there after
the row indices are made; ``slab`` / ``row_indices`` make the reading stream wait for it), and
``release(*consumer_streams)`` (default: the current stream) makes each consumer stream wait for that event and
records the row indices on it; in place it also orders the buffer's comm stream (where the next dispatch or combine
writes the region) after each consumer stream, so a reader still running on one of them keeps its rows; a copy's
slab is recorded on each consumer stream instead (its memory is not reused before their reads).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from ep_core.errors import EPStateError, EPValueError

from .deferred import hold

__all__ = ["DispatchRecvView", "borrow", "lend", "region_rows"]

# why a borrowing dispatch copied its rows (`DispatchRecvView.copy_reason`)
CPU_COPIES = "the CPU reference backend returns host copies of the rows"
MODE_COPIES = (
    "hybrid and cross-node buffers do not hold the received rows whole in their receive region (ep lends it in "
    "direct mode within one NVLink domain)"
)
NO_SPLIT = "this buffer's executor does not split a dispatch (no launch_dispatch_deferred)"


class DispatchRecvView:
    """An exclusive view of a dispatch's received bf16 rows (module doc). ``in_place``: the slab is the buffer's
    receive region (no copy); else ``copy_reason`` says why the rows were copied. ``copied_rows``: the rows the
    dispatch copied for the view (in place: this rank's own rows, put into the region; copied: every row)."""

    def __init__(
        self,
        owner: Any,
        slab: torch.Tensor,
        row_indices: torch.Tensor | None = None,
        *,
        copy_reason: str | None = None,
        comm_stream: Any = None,
        copied_rows: Any = None,
    ) -> None:
        self._owner = owner
        self._slab: torch.Tensor | None = slab
        self._row_indices: torch.Tensor | None = row_indices
        # None: the dispatch not waited on yet; True: ready (CPU); a torch.cuda.Event recorded where it became ready
        self._ready: Any = None
        self._released = False
        self.in_place = copy_reason is None
        self.copy_reason = copy_reason
        self._comm = comm_stream  # in place: the stream the buffer's next operation writes the region on
        self._copied = slab.shape[0] if copied_rows is None else copied_rows

    @property
    def copied_rows(self) -> int:
        """The rows the dispatch copied for this view (in place: read from the device, a sync, while the view is
        readable: ``wait()``'s rules)."""
        if isinstance(self._copied, torch.Tensor):
            self.wait()
        return int(self._copied)

    def _mark_ready(self) -> None:
        """Called on a stream that has waited for the dispatch: the row indices are made there unless given (so a
        reader that waits for the ready event finds them written) and, on CUDA, the ready event recorded after
        them."""
        slab = self._slab
        assert slab is not None
        if self._row_indices is None:
            self._row_indices = torch.arange(slab.shape[0], dtype=torch.int64, device=slab.device)
        if slab.is_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(slab.device))
            self._ready = event
        else:
            self._ready = True

    def wait(self) -> None:
        """Check that the view may be read (not released, its dispatch's event waited on); on CUDA make the current
        stream wait until the view is ready."""
        if self._released:
            raise EPStateError("DispatchRecvView: the view has been released")
        if self._ready is None:
            raise EPStateError(
                "DispatchRecvView: wait on the dispatch's event (event.current_stream_wait()) before reading the "
                "receive view"
            )
        if self._ready is not True:
            assert self._slab is not None
            torch.cuda.current_stream(self._slab.device).wait_event(self._ready)

    @property
    def slab(self) -> torch.Tensor:
        self.wait()
        assert self._slab is not None
        return self._slab

    @property
    def row_indices(self) -> torch.Tensor:
        self.wait()
        assert self._row_indices is not None
        return self._row_indices

    def release(self, *consumer_streams: Any) -> None:
        """Give the rows back to the buffer, which serves dispatch / combine / destroy again. ``consumer_streams``:
        the CUDA streams that read the view (default: the current stream); the view's rows are not overwritten or
        reused before each has done the reads queued on it so far (module doc). On the CPU reference backend every
        read has completed when it returns: nothing to wait for."""
        self.wait()
        slab, owner = self._slab, self._owner
        assert slab is not None and self._row_indices is not None
        if slab.is_cuda:
            streams = consumer_streams or (torch.cuda.current_stream(slab.device),)
            for s in streams:
                if not isinstance(s, torch.cuda.Stream) or s.device != slab.device:
                    raise EPValueError(
                        f"DispatchRecvView.release: consumer_streams must be CUDA streams of the view's device "
                        f"{slab.device}, got {s!r}"
                    )
            for s in streams:
                s.wait_event(self._ready)
                self._row_indices.record_stream(s)
                if (
                    self._comm is not None
                ):  # in place: the buffer's next writes of the region wait for the reads
                    self._comm.wait_stream(s)
                else:
                    slab.record_stream(s)
        self._released = True
        self._owner = self._slab = self._row_indices = self._ready = self._comm = None
        owner._end_borrow()

    def __repr__(self) -> str:
        state = "released" if self._released else ("pending" if self._ready is None else "ready")
        return f"DispatchRecvView({state}, {'in place' if self.in_place else 'copied'})"


def lend(
    owner: Any, outputs: tuple, async_with_compute_stream: bool, view: DispatchRecvView | None = None
) -> tuple:
    """``(view, recv_topk_idx, recv_topk_weights, handle, event)`` of a borrowing dispatch from its ``outputs``
    (``(recv_x, ids, weights, handle, event)``; `view`: the view made already, else one of ``recv_x``'s copied rows,
    `copy_reason` the CPU backend's), and `owner`'s dispatch / combine / destroy refused until the view's release
    (instance attributes shadowing the methods: the calls of a buffer with no view out pay nothing for it). An async
    call's view is ready at its event's wait (a hook after any earlier one)."""
    recv_x, recv_idx, recv_w, handle, event = outputs
    if view is None:
        view = DispatchRecvView(owner, recv_x, copy_reason=CPU_COPIES if not recv_x.is_cuda else NO_SPLIT)
    if async_with_compute_stream:
        earlier = event.hook_after_wait
        event.hook_after_wait = None

        def ready() -> Any:
            view._mark_ready()
            return None if earlier is None else earlier()

        event.register_hook_after_wait(ready)
    else:
        view._mark_ready()

    # (`_end_borrow` gives the calls back at the view's release)
    hold(
        owner,
        "a DispatchRecvView of this buffer is out (dispatch(..., borrow_recv=True)); release() it first",
    )
    return view, recv_idx, recv_w, handle, event


def region_rows(psum: torch.Tensor, num_recv: int, num_max_tokens: int) -> torch.Tensor:
    """The receive-region slot (``s * M + slot``) of each of the ``num_recv`` received rows, in the ordinary
    dispatch's row order: rows of source rank 0 first, each source's in slot order (dispatch_epilogue.cuh), from the
    inclusive prefix ``psum`` of the rows per source rank (direct mode: ``psum_num_recv_tokens_per_scaleup_rank``);
    int64, on ``psum``'s device (a few small kernels on the current stream)."""
    i = torch.arange(num_recv, dtype=torch.int64, device=psum.device)
    incl = psum.to(torch.int64)
    src = torch.searchsorted(incl, i, right=True)  # the first source whose prefix passes the row
    excl = incl - torch.diff(incl, prepend=incl.new_zeros(1))
    return src * num_max_tokens + (i - excl[src])


def borrow(buf: Any, call: dict, again: Any) -> tuple:
    """A borrowing dispatch (``DispatchCombine._borrow``, DeepEP's refusals done): `call`, its arguments by name;
    `again()` runs it as an ordinary dispatch. On CUDA the dispatch is split (ep-core's ``launch_dispatch_deferred``)
    and its finish asked to lend the receive region (``RankDriver.borrow_recv_next``): the view in place where the
    buffer's mode allows it, else the copied rows with the reason (module doc). On the CPU: ``lend(again())``."""
    async_ = bool(call["async_with_compute_stream"])
    if not buf._cuda:
        return lend(buf, again(), async_)
    if getattr(buf._core.executor, "launch_dispatch_deferred", None) is None:
        return lend(buf, again(), async_)
    with buf._core.announcing("dispatch"):
        return _borrow_cuda(buf, call, async_)


def _borrow_cuda(buf: Any, call: dict, async_: bool) -> tuple:
    """`borrow` on CUDA, inside the call's announcing block."""
    from .deferred import comm_stream_of, launch_split_dispatch
    from .dispatch_combine import _cuda_tensors, _handle_tensors
    from .event import EventOverlap
    from .handle_version import keep

    x, topk_idx, w = call["x"], call["topk_idx"], call["topk_weights"]
    stats = call["cumulative_local_expert_recv_stats"]
    buf._check_capture(call["do_cpu_sync"])  # (a CPU sync: refused inside CUDA-graph capture)
    device = x.device
    finish = launch_split_dispatch(buf, call, device, None, False, False)  # (not cached, expanded or FP8)
    comm = comm_stream_of(buf, device)
    for t in _cuda_tensors((x, topk_idx, w, stats)):  # (read by the epilogue on the comm stream)
        t.record_stream(comm)
    waiting = torch.cuda.current_stream(device)
    driver = buf._core.executor.rank
    driver.borrow_recv_next = True
    try:
        with torch.cuda.stream(comm):  # the outputs from the comm stream's pool, as a deferred dispatch's
            # async: nothing waits for the comm stream but the event below; else the current stream, as the
            # ordinary call's
            res = finish(comm.cuda_stream if async_ else waiting.cuda_stream)
    finally:
        driver.borrow_recv_next = False
    handle = res.handle
    for t in _cuda_tensors((res.recv_topk_idx, res.recv_topk_weights)):
        t.record_stream(waiting)
    for t in _handle_tensors(handle):
        t.record_stream(comm)
        t.record_stream(waiting)
    if call["do_handle_copy"]:
        handle.topk_idx = topk_idx.detach().clone()
    else:
        handle.topk_idx = topk_idx  # the caller's tensor itself
        keep(handle, topk_idx)
    region = res.recv_x
    # lent: the region as ep-core's array (`DispatchLaunch.region_rows`); else the copied rows (the mode declined)
    if not isinstance(region, torch.Tensor):
        rows = buf._own_tensor(region, torch.uint8)
        slab = rows.view(torch.bfloat16)[:, : x.shape[1]]
        m = driver.num_max_tokens
        psum = handle.psum_num_recv_tokens_per_scaleup_rank
        rank = driver.rank
        # the indices where the rows are readable: the comm stream (async, before the event) or the current one
        with torch.cuda.stream(comm) if async_ else contextlib.nullcontext():
            indices = region_rows(psum, int(handle.num_recv_tokens), m)
            own = psum[rank] - (psum[rank - 1] if rank > 0 else 0)
        view = DispatchRecvView(buf, slab, indices, comm_stream=comm, copied_rows=own)
    else:
        recv_x = res.recv_x
        recv_x.record_stream(waiting)
        view = DispatchRecvView(buf, recv_x, copy_reason=MODE_COPIES)
    event = EventOverlap.recorded(comm) if async_ else EventOverlap(None)
    return lend(buf, (None, res.recv_topk_idx, res.recv_topk_weights, handle, event), async_, view)
