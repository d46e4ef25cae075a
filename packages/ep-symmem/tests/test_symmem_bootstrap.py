"""LocalBootstrap (threads) and FileBootstrap (processes): allgather order and content, reuse over many rounds,
timeouts naming the missing ranks, file cleanup."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import ep_symmem as sm
import pytest


def _run_threads(bootstraps, fn):
    results: list[object] = [None] * len(bootstraps)
    errors: list[BaseException] = []

    def body(b) -> None:
        try:
            results[b.rank] = fn(b)
        except BaseException as error:  # surfaced below
            errors.append(error)

    threads = [threading.Thread(target=body, args=(b,)) for b in bootstraps]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return results


def _payload(round_index: int, rank: int) -> bytes:
    return random.Random(round_index * 1000 + rank).randbytes(1 + (round_index * 7 + rank * 13) % 300)


def _rounds(b, n: int = 25) -> list[list[bytes]]:
    out = []
    for k in range(n):
        out.append(b.allgather(_payload(k, b.rank)))
        if k % 5 == 0:
            b.barrier()
    return out


@pytest.mark.parametrize("size", [1, 2, 4, 7])
def test_local_bootstrap_allgather(size: int) -> None:
    group = sm.LocalBootstrap.create_group(size, timeout=30)
    assert [b.rank for b in group] == list(range(size))
    assert all(b.size == size for b in group)
    assert all(isinstance(b, sm.Bootstrap) for b in group)
    results = _run_threads(group, _rounds)
    for per_rank in results:
        assert per_rank == [[_payload(k, r) for r in range(size)] for k in range(25)]


def test_local_bootstrap_timeout_names_the_collective() -> None:
    group = sm.LocalBootstrap.create_group(2, timeout=0.2)
    with pytest.raises(sm.BootstrapTimeoutError, match="allgather"):
        group[0].allgather(b"alone")


def test_local_bootstrap_rejects_non_bytes() -> None:
    group = sm.LocalBootstrap.create_group(1)
    with pytest.raises(sm.SymmemValueError, match="bytes"):
        group[0].allgather("text")  # type: ignore[arg-type]
    assert group[0].allgather(b"x") == [b"x"]


@pytest.mark.parametrize(("rank", "size"), [(0, 0), (2, 2), (-1, 3), (True, 2)])
def test_file_bootstrap_validates_rank_and_size(tmp_path: Path, rank, size) -> None:
    with pytest.raises(sm.SymmemValueError):
        sm.FileBootstrap(tmp_path, rank, size)


def test_file_bootstrap_threads(tmp_path: Path) -> None:
    size = 4
    group = [sm.FileBootstrap(tmp_path / "g", r, size, timeout=30) for r in range(size)]
    results = _run_threads(group, _rounds)
    for per_rank in results:
        assert per_rank == [[_payload(k, r) for r in range(size)] for k in range(25)]
    for b in group:
        b.cleanup()
    # Only the last round's file of each rank is left.
    assert sorted(p.name for p in (tmp_path / "g").iterdir()) == [
        f"round{29:09d}.rank{r:06d}" for r in range(size)
    ]


def test_file_bootstrap_keeps_at_most_two_rounds_of_files(tmp_path: Path) -> None:
    group = [sm.FileBootstrap(tmp_path, r, 3, timeout=30) for r in range(3)]
    _run_threads(group, lambda b: [b.allgather(b"%d" % k) for k in range(10)])
    names = sorted(p.name for p in tmp_path.iterdir())
    assert all(n.startswith(("round000000008", "round000000009")) for n in names), names


def test_file_bootstrap_timeout_names_missing_ranks(tmp_path: Path) -> None:
    b = sm.FileBootstrap(tmp_path, 1, 3, timeout=0.3)
    start = time.monotonic()
    with pytest.raises(sm.BootstrapTimeoutError, match=r"rank\(s\) \[0, 2\] did not post"):
        b.allgather(b"hello")
    assert time.monotonic() - start < 5


def test_file_bootstrap_refuses_a_used_directory(tmp_path: Path) -> None:
    first = sm.FileBootstrap(tmp_path, 0, 1)
    first.allgather(b"x")
    with pytest.raises(sm.BootstrapError, match="fresh"):
        sm.FileBootstrap(tmp_path, 0, 1)


_WORKER = textwrap.dedent(
    """
    import json, random, sys, ep_symmem as sm
    directory, rank, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    b = sm.FileBootstrap(directory, rank, size, timeout=60)
    out = []
    for k in range(20):
        mine = random.Random(k * 1000 + rank).randbytes(1 + (k * 7 + rank * 13) % 300)
        out.append([x.hex() for x in b.allgather(mine)])
        b.barrier()
    b.cleanup()
    print(json.dumps(out))
    """
)


def test_file_bootstrap_processes(tmp_path: Path) -> None:
    size = 4
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(tmp_path), str(r), str(size)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ),
        )
        for r in range(size)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err
    expected = [[_payload(k, r).hex() for r in range(size)] for k in range(20)]
    for out, _ in outs:
        assert json.loads(out) == expected


def test_local_bootstrap_abort_releases_waiting_ranks() -> None:
    group = sm.LocalBootstrap.create_group(3, timeout=60)
    errors: list[BaseException] = []

    def wait(b: sm.LocalBootstrap) -> None:
        try:
            b.allgather(b"x")
        except sm.BootstrapError as error:
            errors.append(error)

    threads = [threading.Thread(target=wait, args=(b,)) for b in group[:2]]
    start = time.monotonic()
    for t in threads:
        t.start()
    time.sleep(0.1)
    group[2].abort()
    for t in threads:
        t.join(10)
    assert len(errors) == 2 and time.monotonic() - start < 5
