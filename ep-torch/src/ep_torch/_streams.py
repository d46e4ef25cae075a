"""The process-wide high-priority communication stream (one per device), shared by every buffer of the process."""

from __future__ import annotations

import threading

import torch

_lock = threading.Lock()
_streams: dict[int, torch.cuda.Stream] = {}


def comm_stream(device: torch.device | int) -> torch.cuda.Stream:
    """The comm stream of ``device``, created on first use with the highest priority."""
    index = device.index if isinstance(device, torch.device) else int(device)
    if index is None:
        index = torch.cuda.current_device()
    stream = _streams.get(index)  # created once: later calls need no lock
    if stream is not None:
        return stream
    with _lock:
        stream = _streams.get(index)
        if stream is None:
            stream = torch.cuda.Stream(device=index, priority=-1)  # torch: lower is higher priority
            _streams[index] = stream
        return stream
