"""CPU check of the benchmarks' own kernels (bench_sm_copy.py: bulk ring, register copy, register fan-out;
bench_placement.py: the placed fan-out): they compile for sm_90a, so a GPU call never spends its minutes on a compile
error."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize(
    ("script", "kernels"),
    [
        ("bench_sm_copy.py", (b"tma_ring", b"reg_copy", b"reg_fanout")),
        ("bench_placement.py", (b"placed_fanout",)),
    ],
)
def test_kernels_compile(tmp_path, monkeypatch, script, kernels):
    ep_jit = pytest.importorskip("ep_jit")
    monkeypatch.setenv("EPKIT_JIT_CACHE_DIR", str(tmp_path))
    spec = importlib.util.spec_from_file_location(f"{Path(script).stem}_under_test", BENCHMARKS / script)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    art = ep_jit.compile(mod.SRC, name=Path(script).stem, arch="sm_90a")
    cubin = Path(art.cubin_path).read_bytes()
    for kernel in kernels:
        assert kernel in cubin
