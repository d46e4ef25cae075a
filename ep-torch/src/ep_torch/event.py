"""Events between the compute stream and the communication stream (DeepEP's ``EventHandle`` / ``EventOverlap``).

On CUDA an :class:`EventHandle` wraps a ``torch.cuda.Event`` recorded on a stream. On the CPU reference backend
every operation has finished when the call returns, so the handle is a *completed* event: waiting on it is a no-op,
but the objects keep the same methods so that code written for the GPU runs unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["EventHandle", "EventOverlap"]


class EventHandle:
    """An event recorded on a stream (the current stream by default).

    ``EventHandle()`` on a machine without CUDA, or with ``device="cpu"``, is an already-completed event.
    """

    def __init__(
        self, stream: torch.cuda.Stream | None = None, *, device: str | torch.device | None = None
    ) -> None:
        self.event: torch.cuda.Event | None = None
        use_cuda = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
        if use_cuda:
            self.event = torch.cuda.Event()
            self.event.record(stream if stream is not None else torch.cuda.current_stream())

    @property
    def is_cpu(self) -> bool:
        """True for the completed event of the CPU reference backend."""
        return self.event is None

    def current_stream_wait(self) -> None:
        """Make the current stream wait until the event has completed (no-op for a CPU event)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def stream_wait(self, stream: torch.cuda.Stream) -> None:
        """Make ``stream`` wait until the event has completed."""
        if self.event is not None:
            stream.wait_event(self.event)

    def synchronize(self) -> None:
        """Block the host until the event has completed."""
        if self.event is not None:
            self.event.synchronize()

    def query(self) -> bool:
        """True once the event has completed."""
        return True if self.event is None else self.event.query()

    def __repr__(self) -> str:
        return f"EventHandle({'cpu' if self.event is None else 'cuda'})"


class EventOverlap:
    """The event returned by ``dispatch``/``combine``: ``None`` unless ``async_with_compute_stream=True``.

    ``current_stream_wait()`` makes the compute stream wait for the communication; ``with event: ...`` runs the
    block and then waits; a hook registered with ``register_hook_after_wait`` runs once right after the wait
    (deterministic post-processing and deferred epilogues use it). ``extra_tensors`` keeps tensors alive until the
    wait when ``record_stream`` is avoided (``EPKIT_AVOID_RECORD_STREAM=1``).
    """

    def __init__(self, event: EventHandle | None = None, extra_tensors: Sequence[Any] | None = None) -> None:
        self.event = event
        self.extra_tensors: tuple[Any, ...] | None = (
            tuple(extra_tensors) if extra_tensors is not None else None
        )
        # DeepEP's public attribute: the hook that the next wait runs (None when none is pending).
        self.hook_after_wait: Callable[[], Any] | None = None
        self._release_on_exit = False

    @classmethod
    def recorded(cls, stream: Any, extra_tensors: Sequence[Any] | None = None) -> EventOverlap:
        """``EventOverlap(EventHandle(stream))`` in one call (None: the CPU backend's completed event)."""
        return cls(EventHandle(stream) if stream is not None else EventHandle(device="cpu"), extra_tensors)

    def current_stream_wait(self, release_handle: bool = False) -> Any:
        """Wait on the event (which must exist), run and clear the hook, and drop the event if asked. Returns what
        the hook returned (a deferred epilogue's outputs: ``defer_epilogue=True``), None when no hook was pending."""
        if self.event is None:
            raise RuntimeError(
                "EventOverlap.current_stream_wait(): this operation returned no event (it was not called with "
                "async_with_compute_stream=True); there is nothing to wait for"
            )
        self.event.current_stream_wait()
        result = None
        if self.hook_after_wait is not None:
            hook, self.hook_after_wait = self.hook_after_wait, None
            result = hook()
        if release_handle:
            self.event = None
            self.extra_tensors = None
        return result

    def wait(self) -> Any:
        """``current_stream_wait()`` (DeepEP 2.5's name): waits and returns the hook's result."""
        return self.current_stream_wait()

    def register_hook_after_wait(self, hook_after_wait: Callable[[], Any]) -> None:
        """Run ``hook_after_wait`` once, right after the next wait. Only one hook may be pending."""
        if self.hook_after_wait is not None:
            raise RuntimeError("EventOverlap.register_hook_after_wait(): a hook is already registered")
        self.hook_after_wait = hook_after_wait

    def __call__(self, release_handle: bool = False) -> EventOverlap:
        self._release_on_exit = release_handle
        return self

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if self.event is not None:
            self.current_stream_wait(release_handle=self._release_on_exit)
        self._release_on_exit = False

    def __repr__(self) -> str:
        return f"EventOverlap(event={self.event!r})"
