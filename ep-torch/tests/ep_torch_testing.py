"""Helpers shared by the ep-torch test modules: the runner of a test file as a script in its own process group,
and the CPU ranks' start in that script (`spawn_cpu`).

conftest.py of this folder loads this file as the module `ep_torch_testing` before pytest imports any test module
here (the root config's --import-mode=importlib puts no test folder on sys.path, so the test modules could not
import it by a sibling's name otherwise). The test modules import it inside their runner, never at module level:
they also run as the ranks' scripts, where no conftest loaded it (there the script's folder is sys.path[0], so
their `__main__` block imports it by name).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

__all__ = ["BENCH_V1_ROWS", "bench_v1_dry_run", "run_script", "spawn_cpu"]

BENCH_V1_ROWS = (
    "v2 dispatch bf16",
    "v2 combine",
    "v1 ll_dispatch bf16",
    "v1 ll_dispatch fp8",
    "v1 ll_combine",
)
"""Rows every domain of benchmarks/bench_v1.py reports (its table's op column starts with one of these)."""


def bench_v1_dry_run(*args: str) -> list[str]:
    """benchmarks/bench_v1.py on the CPU reference backend (`--dry-run-cpu`, tiny sizes) with `args`: checks that it
    exits 0 with no failed bitwise check and returns its output's lines."""
    from pathlib import Path

    bench = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_v1.py"
    proc = subprocess.run(
        [sys.executable, str(bench), "--dry-run-cpu", *args], capture_output=True, text=True, timeout=300
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "CHECK FAILED" not in out, out[-3000:]
    return out.splitlines()


def run_script(
    script: str, args: list[str], limit: float, *, what: str = "", env: dict | None = None
) -> tuple[int, str]:
    """Run `python script *args` in a new process group; returns its exit status and output (stdout and stderr).

    Past `limit` seconds the whole group is killed (the ranks too) and the test fails as a hang, with the output's
    tail; `what` prefixes that message. `env` None: this process's environment."""
    proc = subprocess.Popen(
        [sys.executable, script, *args],
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        out, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{what}still running after {limit} s (a hang):\n{out.decode(errors='replace')[-3000:]}")
    return proc.returncode, out.decode(errors="replace")


def spawn_cpu(fn, nprocs: int, *args) -> None:
    """``ep_torch.launch.spawn(fn, nprocs, *args)`` (gloo, one thread a rank, same rank entry and port retry) with
    the ranks forked from this process instead of started afresh: each rank inherits the torch, ep_torch and test
    module this script has imported (a fresh interpreter spends about 2 CPU-s importing them; a test's ranks often
    do less work than that). `fn` needs not be picklable.

    Only for ranks that never touch CUDA (a forked child cannot use a CUDA context, and importing ep_core may
    initialize the driver in this process), called from a test script's ``__main__`` (one thread: nothing else
    runs here when it forks). GPU ranks keep ``launch.spawn``."""
    import torch.multiprocessing as mp
    from ep_torch import launch

    launch.start_on_free_port(
        lambda port: mp.start_processes(
            launch._entry,  # the rank side of launch.spawn: init, fn, barrier, teardown
            args=(nprocs, port, "gloo", 1, fn, args),
            nprocs=nprocs,
            join=True,
            start_method="fork",
        )
    )
