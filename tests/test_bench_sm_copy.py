"""CPU check of benchmarks/bench_sm_copy.py: its kernels (bulk ring, register copy, register fan-out) compile for
sm_90a, so a GPU call never spends its minutes on a compile error."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_sm_copy.py"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_kernels_compile(tmp_path, monkeypatch):
    ep_jit = pytest.importorskip("ep_jit")
    monkeypatch.setenv("EPKIT_JIT_CACHE_DIR", str(tmp_path))
    spec = importlib.util.spec_from_file_location("bench_sm_copy_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    art = ep_jit.compile(mod.SRC, name="bench_sm_copy", arch="sm_90a")
    cubin = Path(art.cubin_path).read_bytes()
    for kernel in (b"tma_ring", b"reg_copy", b"reg_fanout"):
        assert kernel in cubin
