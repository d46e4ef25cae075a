"""DeepEP 2.5's ``DispatchRecvView``: what ``dispatch(..., borrow_recv=True)`` returns in place of ``recv_x``.

Logical row ``r`` of the received tokens is ``view.slab[view.row_indices[r]]``. While a view is out, its buffer
refuses ``dispatch``, ``combine`` and ``destroy`` (``EPStateError``, a ``RuntimeError``) until ``release()``; after
``release()`` the view's ``slab`` / ``row_indices`` raise. With ``async_with_compute_stream=True`` the view is
readable once the dispatch's event has been waited on (``event.current_stream_wait()``).

ep serves it on the CPU reference backend (``DispatchCombine._borrow``): the slab is the dispatch's received rows
and ``row_indices`` is ``arange(R)`` (int64), so ``slab.index_select(0, row_indices)`` is bitwise the ordinary
dispatch's ``recv_x``.
"""

from __future__ import annotations

from typing import Any

import torch
from ep_core.errors import EPStateError

__all__ = ["DispatchRecvView"]


class DispatchRecvView:
    """An exclusive view of a dispatch's received bf16 rows (module doc)."""

    def __init__(self, owner: Any, slab: torch.Tensor, row_indices: torch.Tensor) -> None:
        self._owner = owner
        self._slab: torch.Tensor | None = slab
        self._row_indices: torch.Tensor | None = row_indices
        self._ready = False
        self._released = False

    def _mark_ready(self) -> None:
        self._ready = True

    def wait(self) -> None:
        """Check that the view may be read: not released, and its dispatch's event waited on."""
        if self._released:
            raise EPStateError("DispatchRecvView: the view has been released")
        if not self._ready:
            raise EPStateError(
                "DispatchRecvView: wait on the dispatch's event (event.current_stream_wait()) before reading the "
                "receive view"
            )

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
        """Give the rows back to the buffer, which serves dispatch / combine / destroy again. ``consumer_streams``
        (DeepEP: the CUDA streams that read the view) are accepted and have nothing to wait for on the CPU
        reference backend, where every read has completed when it returns."""
        self.wait()
        owner = self._owner
        self._released = True
        self._owner = self._slab = self._row_indices = None
        owner._end_borrow()

    def __repr__(self) -> str:
        state = "released" if self._released else ("ready" if self._ready else "pending")
        return f"DispatchRecvView({state})"
