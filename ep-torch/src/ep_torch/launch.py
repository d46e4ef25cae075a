"""Start N ranks on one machine for CPU (gloo) or GPU (nccl) runs: ``spawn(fn, nprocs, *args)`` gives each rank a
free local ``MASTER_PORT``, initializes ``torch.distributed`` and calls ``fn(rank, world_size, *args)``.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "init_rank", "spawn", "start_on_free_port"]


def free_port() -> int:
    """A TCP port that is free on localhost right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_rank(rank: int, world_size: int, port: int, backend: str = "gloo", timeout_s: float = 120.0) -> None:
    """Initialize the default process group of this rank (and pick its GPU for nccl)."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        **({"device_id": torch.device("cuda", torch.cuda.current_device())} if backend == "nccl" else {}),
    )


def _entry(
    rank: int, world_size: int, port: int, backend: str, threads: int, fn: Callable[..., Any], args: tuple
) -> None:
    if threads > 0:
        torch.set_num_threads(threads)
    init_rank(rank, world_size, port, backend)
    done = False
    try:
        fn(rank, world_size, *args)
        # Leave together: a gloo rank whose peers tear their connections down first can abort in its own
        # teardown ("terminate called without an active exception"). Skipped after an error, where peers may
        # never arrive.
        dist.barrier()
        done = True
    finally:
        dist.destroy_process_group()
    if done:
        # The barrier narrows that race but does not close it (seen in CI: the peer's SIGABRT at interpreter exit,
        # from gloo's threads being torn down): a rank whose work is done leaves without running C++ teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def spawn(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    backend: str = "gloo",
    threads_per_rank: int = 1,
    port: int | None = None,
    start_method: str = "spawn",
) -> None:
    """Run ``fn(rank, nprocs, *args)`` in ``nprocs`` processes with an initialized process group.

    ``fn`` must be picklable (a module-level function) with ``start_method="spawn"`` (the default: fresh
    interpreters, what CUDA needs). ``"fork"``: the ranks are forked from this process and inherit what it imported
    (no torch import per rank: CPU-only ranks, called while this process runs one thread and has no CUDA context).
    Raises if any rank fails. Without ``port``, a free port is picked (``start_on_free_port``). A rank whose ``fn``
    returned leaves with ``os._exit(0)`` after the process group is destroyed (gloo's teardown can abort a rank at
    interpreter exit): ``atexit`` handlers do not run there.
    """
    if start_method not in ("spawn", "fork"):
        raise ValueError(f"start_method: expected 'spawn' or 'fork', got {start_method!r}")
    start_on_free_port(
        lambda p: mp.start_processes(
            _entry,
            args=(nprocs, p, backend, threads_per_rank, fn, args),
            nprocs=nprocs,
            join=True,
            start_method=start_method,
        ),
        port,
    )


_PORT_ATTEMPTS = 3


def start_on_free_port(start: Callable[[int], None], port: int | None = None) -> None:
    """``start(port)``: start the ranks (joining them) with rank 0's store on ``port``, or on a free port. A free
    port may be taken by another process before rank 0 listens on it (``EADDRINUSE``); the ranks are then started
    again on a new port, up to ``_PORT_ATTEMPTS`` times: nothing else has run, since every rank waits for the store.
    An explicit ``port`` is not retried."""
    for attempt in range(1, _PORT_ATTEMPTS + 1):
        try:
            start(port or free_port())
            return
        except mp.ProcessRaisedException as exc:
            if port is not None or attempt == _PORT_ATTEMPTS or not _lost_the_port(str(exc)):
                raise


def _lost_the_port(message: str) -> bool:
    """The rendezvous failed because the picked port was taken meanwhile (before any rank ran ``fn``)."""
    return "EADDRINUSE" in message and "init_process_group" in message
