"""Helpers shared by the ep-core GPU test modules: GPU detection, bit views for bitwise comparisons, and the
runner of one worker process per rank.

conftest.py of this folder loads this file as the module `ep_core_gpu_testing` before pytest imports any test
module here (the root config's --import-mode=importlib puts no test folder on sys.path, so the test modules
could not import it by a sibling's name otherwise).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

__all__ = ["bits", "num_gpus", "run_workers"]


@functools.cache
def num_gpus() -> int:
    """CUDA devices the driver reports; 0 when there is no usable driver or device (never raises)."""
    try:
        from cuda.bindings import driver as drv

        (err,) = drv.cuInit(0)
        if err != drv.CUresult.CUDA_SUCCESS:
            return 0
        err, count = drv.cuDeviceGetCount()
        return int(count) if err == drv.CUresult.CUDA_SUCCESS else 0
    except Exception:
        return 0


def bits(a: Any) -> Any:
    """float32 arrays as their uint32 bit patterns (bitwise comparison, NaN-safe); other arrays unchanged."""
    a = np.asarray(a)
    return a.view(np.uint32) if a.dtype == np.float32 else a


def run_workers(script: str, size: int, tmp_path: Path, *args: str) -> list[dict]:
    """Run `script` with `python -c` in `size` processes at once, each with the arguments rank, size,
    `tmp_path / "boot"` (the file-bootstrap directory), *args; wait up to 240 s for each. Fails the test when a
    worker hangs (killing them all) or exits nonzero (with its stderr's tail); returns the JSON object each worker
    printed on its last stdout line, in rank order."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(r), str(size), str(tmp_path / "boot"), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ),
        )
        for r in range(size)
    ]
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a worker process hung")
        assert p.returncode == 0, f"worker failed:\n{err[-4000:]}"
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results
