"""ep_core.ll_native (host side of include/ep_core/ll_native.cuh, V1 low-latency mode's own kernels): the
parameter table equals the header's extern "C" signatures, the host layout mirror equals the header's, the kernels
compile with nvcc (sm_90a and sm_80), bad arguments are refused before the driver. (Their results are tested on the
GPU by ep-torch's test_torch_legacy_ll_native.py, bitwise against legacy.reference.)"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from ep_core import ll_native
from ep_core.errors import EPValueError


def _header() -> str:
    from ep_core.kernels._source import get_include

    return (Path(get_include()) / "ep_core" / "ll_native.cuh").read_text()


def _nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    path = os.path.join(home, "bin", "nvcc")
    return path if os.path.exists(path) else shutil.which("nvcc")


needs_nvcc = pytest.mark.skipif(_nvcc() is None, reason="nvcc not found")


def test_signatures_match_the_header():
    found = {}
    for m in re.finditer(
        r'extern "C" __global__ void(?: __launch_bounds__\(\d+\))?\s+(\w+)\(([^)]*)\)', _header()
    ):
        found[m.group(1)] = "".join("p" if "*" in p else "i" for p in m.group(2).split(","))
    assert found == ll_native.SIGNATURES


def test_bad_arguments_are_refused():
    pytest.importorskip("ep_jit")
    with pytest.raises(EPValueError, match="expected one of"):
        ll_native._args("ep_lln_nope", [])
    with pytest.raises(EPValueError, match="expected 19 arguments"):
        ll_native._args("ep_lln_dispatch_send", [0])
    sig = ll_native.SIGNATURES["ep_lln_combine_recv"]
    vals = [1 << 40 if c == "i" else 0 for c in sig]
    with pytest.raises(EPValueError, match="must be an int32"):
        ll_native._args("ep_lln_combine_recv", vals)


_LAYOUT_MAIN = r"""
#include <ep_core/ll_native.cuh>
#include <cstdio>
int main(int argc, char** argv) {
  int v[6];
  for (int i = 0; i < 6; ++i) v[i] = atoi(argv[i + 1]);
  ep_lln::Layout L(v[0], v[1], v[2], v[3], v[4], v[5]);
  printf("%lld %lld %lld %lld %lld %lld %lld %lld\n", (long long)L.ctrl, (long long)L.dflag, (long long)L.cflag,
         (long long)L.ddata, (long long)L.cdata, (long long)L.half_bytes, (long long)L.msg, (long long)L.cmeta);
  return 0;
}
"""


@needs_nvcc
def test_host_layout_equals_the_header(tmp_path):
    from ep_core.kernels._source import get_include

    src = tmp_path / "layout.cu"
    src.write_text(_LAYOUT_MAIN)
    exe = tmp_path / "layout"
    subprocess.run([_nvcc(), "-std=c++17", "-I", get_include(), str(src), "-o", str(exe)], check=True)
    for cfg in (
        (256, 1, 256, 128, 8, 7168),
        (32, 8, 256, 128, 8, 7168),
        (288, 1, 288, 8, 9, 384),
        (3, 4, 12, 5, 3, 128),
    ):
        got = [
            int(v)
            for v in subprocess.run(
                [str(exe), *map(str, cfg)], capture_output=True, text=True, check=True
            ).stdout.split()
        ]
        lay = ll_native.region_layout(*cfg)
        assert tuple(got) == (*lay[:7], lay.cmeta), cfg


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_native_kernels_compile(arch, tmp_path, monkeypatch):
    ep_jit = pytest.importorskip("ep_jit")
    monkeypatch.setenv("EPKIT_JIT_CACHE_DIR", str(tmp_path / "jit"))
    ep_jit.clear_memo()
    art = ll_native.compile_ll_native(arch=arch)
    assert art.cubin_path.read_bytes()[:4] == b"\x7fELF"
    assert set(ll_native.KERNEL_NAMES) <= set(art.kernel_names)
