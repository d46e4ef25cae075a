"""The guard of every V1 ``Buffer`` operation: the method runs inside ``Buffer._guard`` (``ep_core.rank_state``), so a
refusal is announced to the peers and an out-of-step buffer refuses at once. A target names the inner buffer whose
pending step a refusal is announced in (none: the V1 buffer's own host exchange comes first)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from ep_core.errors import EPStateError

if TYPE_CHECKING:
    from .buffer import Buffer

__all__ = ["_dispatch_target", "_guarded", "_ll_target", "_normal_target"]


def _guarded(op: str, target: Any = None) -> Any:
    """Run the method inside ``Buffer._guard(op, *target(self, args, kwargs))`` (default: its first step is this
    buffer's host exchange), refusing it at once on a destroyed buffer (announced like any refusal). The native
    low-latency road (``_ll_target``): a call that raises before taking its half of the region (a refusal of any
    kind, the refusal of an out-of-step buffer included) posts the abort word in its place (``_native_abort``)."""

    def deco(fn: Any) -> Any:
        @functools.wraps(fn)
        def call(self: Buffer, *args: Any, **kwargs: Any) -> Any:
            inner, host = target(self, args, kwargs) if target is not None else (None, True)
            mark = _native_mark(self) if target is _ll_target else None
            try:
                with self._guard(op, inner, host):
                    if self._destroyed:
                        raise EPStateError(
                            f"{op} (rank {self.rank}): Buffer used after destroy(); create a new buffer"
                        )
                    return fn(self, *args, **kwargs)
            except Exception as exc:
                if mark is not None:
                    _native_abort(self, op, exc, mark)
                raise

        return call

    return deco


def _live_region(self: Buffer) -> Any:
    """The native low-latency region whose kernels the peers run (None: none, or its inner buffer was destroyed,
    dropped by ``reset()`` or rebuilt)."""
    reg = getattr(self, "_ll_region", None)
    inner = getattr(self, "_ll_inner", None)
    if reg is None or inner is None or reg.inner is not inner or self._destroyed:
        return None
    if getattr(inner, "runtime", True) is None:
        return None
    return reg


def _native_mark(self: Buffer) -> Any:
    """Where a native call starts: ``(region, its call count)``, or None where no abort could be posted (no live
    region, or rank masking: a rank that does not arrive is masked instead). A few attribute reads: the hot path."""
    reg = _live_region(self)
    if reg is None or getattr(self, "_shrink", None) is not None:
        return None
    return reg, reg.calls


def _native_abort(self: Buffer, op: str, exc: BaseException, mark: tuple) -> None:
    """Post the abort word of this refused call (``ll_kernels.native_abort``; issue 41) unless the call took its half
    of the region (its kernels ran, or the region it started in is gone). Every native call thus either runs its
    kernels or posts its abort: the peers' receives of it end at once naming this rank, and the epochs stay in step
    (a host wait that expired included: a lone size change's host step ends its peers' call that way). Not after a
    kernel's wait expired (the region is unusable until rebuilt: its kernels return at once), nor under CUDA-graph
    capture. Best effort: a failure to post never hides ``exc``."""
    reg = _live_region(self)
    if reg is None or reg.words[0] != 0:
        return
    if reg.calls != (mark[1] if reg is mark[0] else 0):
        return
    import torch

    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return  # no refusal is captured into a graph (a replay runs every kernel of the capture)
    from . import ll_kernels

    try:
        ll_kernels.native_abort(reg, op, exc)
    except Exception as inner:  # the caller raises the original error
        exc.__context__ = inner


def _dispatch_target(self: Buffer, args: tuple, kwargs: dict) -> tuple[Any, bool]:
    cached = (args[1] if len(args) > 1 else kwargs.get("handle")) is not None
    return (self._inner, False) if cached else (None, True)


def _normal_target(self: Buffer, args: tuple, kwargs: dict) -> tuple[Any, bool]:
    return self._inner, False


def _ll_target(self: Buffer, args: tuple, kwargs: dict) -> tuple[Any, bool]:
    """The adapter's refusals are announced in its inner buffer's step. The native kernels (issue 41) have no step
    of that buffer: with ``ll_native_agree="call"`` the peers wait in this buffer's host step (``_agree_native``),
    where the refusal is announced; with ``"change"`` the peers wait on the device, so nothing is announced on the
    host (``_SILENT``): the refusal posts its abort word into the region instead (``_guarded``), which ends the
    peers' receives of that call and makes them raise naming this rank."""
    if _live_region(self) is None:
        return self._ll_inner, False
    if self.ll_native_agree == "call":
        return None, True
    return _SILENT, False


class _NoStep:
    """An inner buffer stand-in whose refusals are announced nowhere on the host (``_ll_target``: the native road's
    abort word announces them on the device)."""

    _destroyed = False

    @property
    def runtime(self) -> _NoStep:
        return self

    def _step(self) -> None:
        return None

    def announce_error(self, op: str, error: BaseException, step: Any) -> None:
        return None


_SILENT = _NoStep()
