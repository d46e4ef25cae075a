"""One rank of a multi-rank ep_symmem GPU check; the GPU tests run it as threads (imported) or as processes
(`python symmem_worker.py MODE --dir D --rank R --size N ...`, last stdout line `RESULT <json>`).

Modes:
  pattern  every rank writes a (writer, owner)-specific pattern into every peer's buffer (half of each slot by a
           kernel through the peer mapping, half by cuMemcpy), and into every peer's host part (kernel); each
           owner verifies its GPU part (copy back) and its host part (CPU reads through host_view()).
  leak     `cycles` create/exchange/close cycles; reports cuMemGetInfo free bytes and the fd count before/after,
           measured while every rank is idle.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from array import array

import ep_symmem as sm


def _seeds(session: int, writer: int, owner: int) -> tuple[int, int]:
    rng = random.Random(session * 1_000_003 + writer * 1009 + owner)
    return rng.getrandbits(32), rng.getrandbits(32) | 1


def _sequence(first: int, step: int, num_words: int) -> bytes:
    return array("I", [(first + i * step) & 0xFFFFFFFF for i in range(num_words)]).tobytes()


def _random_bytes(session: int, writer: int, owner: int, num_bytes: int) -> bytes:
    return random.Random(f"{session}/{writer}/{owner}").randbytes(num_bytes)


def agree_on_session(bootstrap: sm.Bootstrap) -> int:
    """A random number shared by all ranks, so that no stale pattern of an earlier run can pass the check."""
    mine = random.SystemRandom().getrandbits(63).to_bytes(8, "little")
    return int.from_bytes(bootstrap.allgather(mine)[0], "little")


def run_pattern(bootstrap: sm.Bootstrap, num_gpu_bytes: int, num_host_bytes: int, handle_type: str) -> dict:
    rank, size = bootstrap.rank, bootstrap.size
    session = agree_on_session(bootstrap)
    errors: list[str] = []
    with sm.SymmetricAllocation.create(num_gpu_bytes, num_host_bytes, handle_type=handle_type) as buf:
        dev = buf.device
        sm.memset_device(buf.ptr, 0, buf.num_gpu_bytes, dev)
        if buf.host_ptr is not None:
            sm.fill_u32(buf.host_ptr, buf.num_host_bytes // 4, 0, 0, dev)  # zeros, stored by the device
        t0 = time.perf_counter()
        ptrs = sm.exchange(buf, bootstrap)
        exchange_s = time.perf_counter() - t0
        assert ptrs == buf.peer_ptrs and ptrs[rank] == buf.ptr and buf.rank == rank and buf.num_ranks == size
        table = sm.copy_from_device(buf.peer_ptr_table, 8 * size, dev)
        if list(array("Q", table)) != ptrs:
            errors.append(f"peer_ptr_table {list(array('Q', table))} != peer_ptrs {ptrs}")
        slot = buf.num_gpu_bytes // size // 8 * 8
        half = slot // 2
        host_slot = buf.num_host_bytes // size // 4 * 4
        for owner in range(size):
            base = buf.peer_ptr(owner)
            first, step = _seeds(session, rank, owner)
            sm.fill_u32(base + rank * slot, half // 4, first, step, dev)
            sm.copy_to_device(
                base + rank * slot + half, _random_bytes(session, rank, owner, slot - half), dev
            )
            if host_slot:
                sm.fill_u32(
                    base + buf.num_gpu_bytes + rank * host_slot,
                    host_slot // 4,
                    first ^ 0xA5A5A5A5,
                    step + 2,
                    dev,
                )
        bootstrap.barrier()  # every writer is done (each call above is synchronous)
        mine = sm.copy_from_device(buf.ptr, buf.num_gpu_bytes, dev)
        host = bytes(buf.host_view()) if host_slot else b""
        for writer in range(size):
            first, step = _seeds(session, writer, rank)
            got = mine[writer * slot : writer * slot + half]
            if got != _sequence(first, step, half // 4):
                errors.append(f"rank {rank}: kernel-written slot of writer {writer} differs")
            got = mine[writer * slot + half : (writer + 1) * slot]
            if got != _random_bytes(session, writer, rank, slot - half):
                errors.append(f"rank {rank}: cuMemcpy-written slot of writer {writer} differs")
            if host_slot:
                got = host[writer * host_slot : (writer + 1) * host_slot]
                if got != _sequence(first ^ 0xA5A5A5A5, step + 2, host_slot // 4):
                    errors.append(f"rank {rank}: host-part slot of writer {writer} differs (CPU read)")
        bootstrap.barrier()  # nobody unmaps while others still verify
    return {"rank": rank, "errors": errors, "exchange_s": exchange_s, "ptrs": ptrs}


def run_leak(
    bootstrap: sm.Bootstrap, num_gpu_bytes: int, num_host_bytes: int, cycles: int, handle_type: str
) -> dict:
    def cycle() -> None:
        with sm.SymmetricAllocation.create(num_gpu_bytes, num_host_bytes, handle_type=handle_type) as buf:
            sm.exchange(buf, bootstrap)
            _ = buf.peer_ptr_table

    def measure() -> tuple[int, int]:
        # One rank at a time: ranks that are threads of one process share its fds (and a concurrent listdir of
        # /proc/self/fd is itself an open fd), and every rank sees the one device's free memory.
        value = (0, 0)
        for turn in range(bootstrap.size):
            bootstrap.barrier()
            if turn == bootstrap.rank:
                value = (sm.device_memory_info().free, sm.open_fd_count())
        bootstrap.barrier()
        return value

    cycle()  # warm-up: context, module and small-allocation pools
    free0, fds0 = measure()
    start = time.perf_counter()
    for _ in range(cycles):
        cycle()
    elapsed = time.perf_counter() - start
    free1, fds1 = measure()
    return {
        "rank": bootstrap.rank,
        "free_before": free0,
        "free_after": free1,
        "fds_before": fds0,
        "fds_after": fds1,
        "cycles": cycles,
        "seconds": elapsed,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("mode", choices=["pattern", "leak"])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--gpu-bytes", type=int, default=8 << 20)
    parser.add_argument("--host-bytes", type=int, default=4 << 20)
    parser.add_argument("--cycles", type=int, default=200)
    parser.add_argument("--handle-type", default="auto")
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    bootstrap = sm.FileBootstrap(args.dir, args.rank, args.size, timeout=args.timeout)
    if args.mode == "pattern":
        result = run_pattern(bootstrap, args.gpu_bytes, args.host_bytes, args.handle_type)
    else:
        result = run_leak(bootstrap, args.gpu_bytes, args.host_bytes, args.cycles, args.handle_type)
    bootstrap.cleanup()
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
