"""``EPBuffer.resize``: give the buffer a new size in place (DeepEP 2.6's method name; its source was not available
to ep, so the signature and semantics are ep's: ep-torch's README, API table).

``resize(num_bytes=None, num_max_tokens_per_rank=0, hidden=0, num_topk=0, use_fp8_dispatch=False)`` takes the
constructor's sizing arguments and rebuilds the storage for them; every other setting stays (the LB region and its
tensors included). A collective, with the same arguments on every rank:

- the arguments are checked and agreed first (``ep_core.envelope``: ``EPPeerError`` / ``EPMismatchError``, nothing
  released, the buffer works as before);
- then the old storage is released (a barrier; on CUDA after a device sync) and the new one built by the
  constructor's collective steps (a new ipc mapping exchange, or a new NCCL window); should that fail, the buffer
  is left destroyed (``EPStateError`` on use) and the error raised.

Handles from before are refused as stale (``EPStateError``, through the rank-state generation:
``ep_core.rank_state.check_owner``); PP, Engram and AGRS configurations are dropped; tensors that viewed the old
storage and CUDA graphs captured before are invalid; an outstanding ``DispatchRecvView`` refuses the resize.
"""

from __future__ import annotations

from typing import Any

import torch
from ep_core.buffer import SYMMETRIC_ALIGN_BYTES
from ep_core.envelope import Channel
from ep_core.errors import EPStateError, EPTypeError, EPValueError

from .transport_choice import make_core_transport

__all__ = ["resize"]


def _size(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise EPTypeError(f"resize: {name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise EPValueError(f"resize: {name} must be >= 0, got {value}")
    return value


def resize(
    self: Any,
    num_bytes: int | None = None,
    num_max_tokens_per_rank: int = 0,
    hidden: int = 0,
    num_topk: int = 0,
    use_fp8_dispatch: bool = False,
) -> None:
    """Rebuild this buffer's storage for new sizes, keeping every other setting (a collective; ``ep_torch.resize``)."""
    op = "resize"
    channel = Channel(self.bootstrap, getattr(self.bootstrap, "rank_state", None))
    with channel.state.guard(op, channel.announce):
        old = self._rt()
        if "destroy" in self.__dict__:  # dispatch_combine's marker of a DispatchRecvView that is out
            raise EPStateError("resize: a DispatchRecvView of this buffer is out; release() it first")
        if num_bytes is not None:
            _size("num_bytes", num_bytes)
            if num_bytes == 0 or num_bytes % SYMMETRIC_ALIGN_BYTES:
                raise EPValueError(
                    f"resize: num_bytes must be a positive multiple of {SYMMETRIC_ALIGN_BYTES} (2 MiB), got "
                    f"{num_bytes}; or None for the size hint of the MoE settings"
                )
            if num_bytes < old.config.num_cpu_bytes:
                raise EPValueError(
                    f"resize: num_bytes ({num_bytes}) must be >= num_cpu_bytes ({old.config.num_cpu_bytes})"
                )
        sizes = {
            "num_bytes": num_bytes,
            "num_max_tokens_per_rank": _size("num_max_tokens_per_rank", num_max_tokens_per_rank),
            "hidden": _size("hidden", hidden),
            "num_topk": _size("num_topk", num_topk),
        }
        if not isinstance(use_fp8_dispatch, bool):
            raise EPTypeError(
                f"resize: use_fp8_dispatch must be a bool, got {type(use_fp8_dispatch).__name__}"
            )
        channel.exchange(op, {**sizes, "use_fp8_dispatch": use_fp8_dispatch})
    _rebuild(self, old, sizes, use_fp8_dispatch)


def _rebuild(self: Any, old: Any, sizes: dict[str, Any], use_fp8_dispatch: bool) -> None:
    cfg = old.config
    old_state = _runtime_state(old)
    # what the old storage held (ElasticBuffer.destroy's list): zero-copy views, PP/Engram/AGRS; the express lanes
    # are the old runtime's (`old.destroy()` clears them)
    self.__dict__.pop("_zero_copy_tensors", None)
    if self._cuda:  # no kernel of this rank may still use the old storage when it is released
        torch.cuda.synchronize()
    old.destroy()  # a collective barrier first
    self.runtime = None
    self._release_elastic()
    rt = self._new_runtime(
        make_core_transport(self.transport_choice),
        **sizes,
        num_cpu_bytes=cfg.num_cpu_bytes,
        use_fp8_dispatch=use_fp8_dispatch,
        sl_idx=cfg.sl_idx,
        num_allocated_qps=cfg.num_allocated_qps,
        num_cpu_timeout_secs=cfg.num_cpu_timeout_secs,
        num_gpu_timeout_secs=cfg.num_gpu_timeout_secs,
    )
    state = getattr(self.bootstrap, "rank_state", None)
    if state is not None:  # handles made before carry the old generation: refused as stale
        state.new_generation()
    new_state = _runtime_state(rt)
    if old_state is not None and new_state is not None and new_state is not state:
        # the GPU rank runtime keeps a state of its own, new with the new executor: give it the old identity, one
        # generation on, so that `check_owner` calls a handle from before stale rather than another buffer's
        new_state.ident = old_state.ident
        new_state.generation = old_state.generation
        new_state.new_generation()
    if self._cuda:
        torch.cuda.synchronize()


def _runtime_state(rt: Any) -> Any:
    """The ``RankState`` whose owner tuple the executor's handles carry: the GPU rank runtime's own
    (``GpuExecutor.rank.state``), else None (the reference executor's is the bootstrap's, handled above)."""
    return getattr(getattr(rt.executor, "rank", None), "state", None)
