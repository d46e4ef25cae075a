"""The guard of every V1 ``Buffer`` operation: the method runs inside ``Buffer._guard`` (``ep_core.rank_state``), so a
refusal is announced to the peers and an out-of-step buffer refuses at once. A target names the inner buffer whose
pending step a refusal is announced in (none: the V1 buffer's own host exchange comes first)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from ep_core.errors import EPStateError

if TYPE_CHECKING:
    from .buffer import Buffer

__all__ = ["_dispatch_target", "_guarded", "_ll_target", "_normal_target"]


def _guarded(op: str, target: Any = None) -> Any:
    """Run the method inside ``Buffer._guard(op, *target(self, args, kwargs))`` (default: its first step is this
    buffer's host exchange), refusing it at once on a destroyed buffer (announced like any refusal)."""

    def deco(fn: Any) -> Any:
        @functools.wraps(fn)
        def call(self: Buffer, *args: Any, **kwargs: Any) -> Any:
            inner, host = target(self, args, kwargs) if target is not None else (None, True)
            with self._guard(op, inner, host):
                if self._destroyed:
                    raise EPStateError(
                        f"{op} (rank {self.rank}): Buffer used after destroy(); create a new buffer"
                    )
                return fn(self, *args, **kwargs)

        return call

    return deco


def _dispatch_target(self: Buffer, args: tuple, kwargs: dict) -> tuple[Any, bool]:
    cached = (args[1] if len(args) > 1 else kwargs.get("handle")) is not None
    return (self._inner, False) if cached else (None, True)


def _normal_target(self: Buffer, args: tuple, kwargs: dict) -> tuple[Any, bool]:
    return self._inner, False


def _ll_target(self: Buffer, args: tuple, kwargs: dict) -> tuple[Any, bool]:
    """The adapter's refusals are announced in its inner buffer's step. The native kernels (issue 41) have no step
    of that buffer: with ``ll_native_agree="call"`` the peers wait in this buffer's host step (``_agree_native``),
    where the refusal is announced; with ``"change"`` the peers' kernels wait on the device: the refusal is announced
    there (``_NativeAbort``)."""
    if self._ll_region is None:
        return self._ll_inner, False
    if self.ll_native_agree == "call":
        return None, True
    abort = self.__dict__.get("_ll_abort")
    if abort is None or abort.buf is not self:
        abort = self._ll_abort = _NativeAbort(self)
    return abort, False


class _NoStep:
    """An inner buffer stand-in for ``Buffer._guard`` (no pending step; ``_NativeAbort`` announces on the device)."""

    _destroyed = False

    @property
    def runtime(self) -> _NoStep:
        return self

    def _step(self) -> None:
        return None

    def announce_error(self, op: str, error: BaseException, step: Any) -> None:
        return None


class _NativeAbort(_NoStep):
    """The default native mode's announcement of a refusal (issue 41): the peers' receive kernels wait for this
    rank's flags, so it runs ``ep_lln_abort`` in the refused call's place (their waits end at once and their next
    call raises ``EPPeerError`` naming this rank), then refuses every operation until ``reset()`` itself (its
    epochs no longer match theirs). Not under CUDA-graph capture (the abort would be captured and replayed): the
    capture fails anyway, and the peers' waits are bounded by their timeout."""

    __slots__ = ("buf",)

    def __init__(self, buf: Buffer) -> None:
        self.buf = buf

    def announce_error(self, op: str, error: BaseException, step: Any) -> None:
        from . import ll_kernels

        buf = self.buf
        reg, inner = buf._ll_region, buf._ll_inner
        # only into live peers' regions: not after destroy() or a reset() that dropped the inner buffer (its
        # mappings may be gone), nor with rank masking (the peers mask a rank that does not arrive)
        if reg is None or getattr(inner, "runtime", None) is None or buf._shrink is not None:
            return
        if getattr(reg, "inner", inner) is not inner:
            return
        cuda = not buf._ll_native_on_cpu
        if cuda and torch.cuda.is_current_stream_capturing():
            return
        ll_kernels.native_abort(reg, 0 if op == "low_latency_dispatch" else 1)
        state = buf._state
        if state is not None and state.failure is None:
            state.failure, state.failed_op = error, op
