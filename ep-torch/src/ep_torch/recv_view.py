"""DeepEP 2.5's ``DispatchRecvView``: what ``dispatch(..., borrow_recv=True)`` returns in place of ``recv_x``.

Logical row ``r`` of the received tokens is ``view.slab[view.row_indices[r]]``. While a view is out, its buffer
refuses ``dispatch``, ``combine``, ``destroy`` and ``resize`` (``EPStateError``, a ``RuntimeError``) until
``release()``; after ``release()`` the view's ``slab`` / ``row_indices`` raise. With
``async_with_compute_stream=True`` the view is readable once the dispatch's event has been waited on
(``event.current_stream_wait()``). Borrowing is a rank's own choice, as DeepEP's: its peers may dispatch without it.

ep serves it on the CPU reference backend and on CUDA alike (``DispatchCombine._borrow``): the slab is the ordinary
dispatch's ``recv_x`` (the copy epilogue's output) and ``row_indices`` is ``arange(R)`` (int64), so
``slab.index_select(0, row_indices)`` is bitwise the ordinary dispatch's ``recv_x``. DeepEP lends its receive
buffer itself (no copy epilogue for the rows); ep does not save that copy yet (docs/deepep-2.5.md says what it needs).

On CUDA, as DeepEP's view: the view is ready on the stream that waited for the dispatch (an event recorded there after
the row indices are made; ``slab`` / ``row_indices`` make the reading stream wait for it), and
``release(*consumer_streams)`` (default: the current stream) makes each consumer stream wait for that event and
records the slab and indices on it, so their memory is not reused while a reader on one of them still runs.
"""

from __future__ import annotations

from typing import Any

import torch
from ep_core.errors import EPStateError, EPValueError

from .deferred import hold

__all__ = ["DispatchRecvView", "lend"]


class DispatchRecvView:
    """An exclusive view of a dispatch's received bf16 rows (module doc)."""

    def __init__(self, owner: Any, slab: torch.Tensor, row_indices: torch.Tensor | None = None) -> None:
        self._owner = owner
        self._slab: torch.Tensor | None = slab
        self._row_indices: torch.Tensor | None = row_indices
        # None: the dispatch not waited on yet; True: ready (CPU); a torch.cuda.Event recorded where it became ready
        self._ready: Any = None
        self._released = False

    def _mark_ready(self) -> None:
        """Called on a stream that has waited for the dispatch: the row indices are made there (so a reader that
        waits for the ready event finds them written) and, on CUDA, the ready event recorded after them."""
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
        the CUDA streams that read the view (default: the current stream); the view's memory is not reused before
        each has done its reads. On the CPU reference backend every read has completed when it returns: nothing to
        wait for."""
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
                slab.record_stream(s)
                self._row_indices.record_stream(s)
        self._released = True
        self._owner = self._slab = self._row_indices = self._ready = None
        owner._end_borrow()

    def __repr__(self) -> str:
        state = "released" if self._released else ("pending" if self._ready is None else "ready")
        return f"DispatchRecvView({state})"


def lend(owner: Any, outputs: tuple, async_with_compute_stream: bool) -> tuple:
    """``(view, recv_topk_idx, recv_topk_weights, handle, event)`` of a borrowing dispatch from its ordinary
    ``outputs`` (``DispatchCombine._borrow``), and `owner`'s dispatch / combine / destroy refused until the view's
    release (instance attributes shadowing the methods: the calls of a buffer with no view out pay nothing for it).
    An async call's view is ready at its event's wait (a hook after any earlier one)."""
    recv_x, recv_idx, recv_w, handle, event = outputs
    view = DispatchRecvView(owner, recv_x)
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
