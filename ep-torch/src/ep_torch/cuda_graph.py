"""Capture dispatch + combine (no CPU sync, or a cached handle) in a CUDA graph and replay it.

Recipe (README "CUDA graphs"): warm up with the exact shapes outside capture (compiles and loads the kernels), avoid
``record_stream`` during capture (``EPKIT_AVOID_RECORD_STREAM=1``, set here for the duration of warm-up and capture),
capture on a side stream, then replay after copying new inputs into the captured (static) tensors. Only operations
that never wait for the host can be captured: ``dispatch(..., do_cpu_sync=False)`` (worst-case shapes; the true
count is ``handle.psum_num_recv_tokens_per_scaleup_rank[-1]`` on the GPU), a cached ``dispatch(handle=...)``, and
``combine``. ep_torch raises ``EPValueError`` for a CPU-synchronizing dispatch inside capture.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

__all__ = ["CapturedStep", "avoid_record_stream"]


@contextlib.contextmanager
def avoid_record_stream() -> Iterator[None]:
    """Set ``EPKIT_AVOID_RECORD_STREAM=1`` for the body (``record_stream`` is not allowed while capturing)."""
    old = os.environ.get("EPKIT_AVOID_RECORD_STREAM")
    os.environ["EPKIT_AVOID_RECORD_STREAM"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("EPKIT_AVOID_RECORD_STREAM", None)
        else:
            os.environ["EPKIT_AVOID_RECORD_STREAM"] = old


def _clone(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return a.clone()
    if isinstance(a, tuple):
        return tuple(_clone(v) for v in a)
    return a


def _copy_into(dst: Any, src: Any) -> None:
    if isinstance(dst, torch.Tensor):
        if not isinstance(src, torch.Tensor) or src.shape != dst.shape or src.dtype != dst.dtype:
            raise ValueError(
                f"CapturedStep: inputs must keep the captured shape and dtype {tuple(dst.shape)} {dst.dtype}, got "
                f"{tuple(getattr(src, 'shape', ()))} {getattr(src, 'dtype', type(src).__name__)}"
            )
        dst.copy_(src)
    elif isinstance(dst, tuple):
        for d, s in zip(dst, src):
            _copy_into(d, s)


class CapturedStep:
    """``fn(*inputs)`` captured once in a CUDA graph; calling the object copies new inputs into the static ones,
    replays the graph and returns the (static) outputs of the capture.

    ``fn`` must only issue graph-safe work: no CPU sync (use ``do_cpu_sync=False`` or a cached handle), no host
    reads of device values. Outputs are overwritten by the next replay: clone what you keep.
    """

    def __init__(
        self, fn: Callable[..., Any], *example_inputs: Any, warmup: int = 2, pool: Any = None
    ) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CapturedStep: CUDA graphs need a GPU")
        self.fn = fn
        self.static_inputs: Sequence[Any] = tuple(_clone(a) for a in example_inputs)
        self.graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with avoid_record_stream():
            with torch.cuda.stream(side):
                for _ in range(max(1, warmup)):
                    fn(*self.static_inputs)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            with torch.cuda.graph(self.graph, pool=pool):
                self.static_outputs = fn(*self.static_inputs)
        torch.cuda.synchronize()

    def __call__(self, *inputs: Any) -> Any:
        if len(inputs) != len(self.static_inputs):
            raise ValueError(f"CapturedStep: expected {len(self.static_inputs)} inputs, got {len(inputs)}")
        for dst, src in zip(self.static_inputs, inputs):
            _copy_into(dst, src)
        self.graph.replay()
        return self.static_outputs

    def replay(self) -> Any:
        """Replay with the inputs as they are (after writing into ``static_inputs`` yourself)."""
        self.graph.replay()
        return self.static_outputs
