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
    where the refusal is announced; with ``"change"`` the peers' kernels wait on the device (nothing to announce to:
    they time out)."""
    if self._ll_region is None:
        return self._ll_inner, False
    if self.ll_native_agree == "call":
        return None, True
    return _SILENT, False


class _NoStep:
    """An inner buffer stand-in whose refusals are announced nowhere (``_ll_target``)."""

    _destroyed = False

    @property
    def runtime(self) -> _NoStep:
        return self

    def _step(self) -> None:
        return None

    def announce_error(self, op: str, error: BaseException, step: Any) -> None:
        return None


_SILENT = _NoStep()
