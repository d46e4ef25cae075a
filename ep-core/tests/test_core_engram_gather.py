"""The Engram gather kernel's host side (no GPU): kernel and grid choice, and the source compiles (nvcc)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from ep_core import engram_gather
from ep_core.errors import EPValueError


@pytest.mark.parametrize(
    ("entry_bytes", "addresses", "vec"),
    [
        (14336, [1 << 21, 3 << 21], 16),  # hidden 7168 bf16, 2 MiB aligned storage
        (14336, [1 << 21, (3 << 21) + 8], 8),  # one base only 8-byte aligned
        (12, [1 << 21], 4),
        (7, [1 << 21], 1),
    ],
)
def test_widest_vector_dividing_the_entry_and_every_address(entry_bytes, addresses, vec):
    plan = engram_gather.plan_launch(1024, entry_bytes, addresses, 132)
    assert plan.vec == vec and plan.kernel == f"ep_engram_gather_{vec}"
    assert plan.block == engram_gather.BLOCK_THREADS


def test_grid_is_the_sms_or_one_warp_per_row():
    warps = engram_gather.BLOCK_THREADS // 32
    assert engram_gather.plan_launch(4096, 16, [0], 66).grid == 66
    assert engram_gather.plan_launch(3 * warps + 1, 16, [0], 66).grid == 4
    assert engram_gather.plan_launch(0, 16, [0], 66).grid == 1
    with pytest.raises(EPValueError, match="num_sms"):
        engram_gather.plan_launch(1, 16, [0], 0)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_the_kernels_compile_for_sm_90():
    art = engram_gather.compile_engram_gather("sm_90")
    assert art.cubin_path.read_bytes()[:4] == b"\x7fELF"


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_the_gather_indexing_on_the_host(tmp_path: Path):
    """The kernel's threads are independent (no barrier, no shared memory), so running every (block, thread) one
    after another on the host with CUDA's names shimmed (engram_gather_emu.cpp) checks its indexing: rows over the
    grid, lanes and unrolled loads over a row, the tail, each id's owner and row, zero rows for ids outside."""
    from ep_core.kernels._source import get_include

    src = Path(__file__).with_name("engram_gather_emu.cpp")
    exe = tmp_path / "emu"
    subprocess.run(
        ["g++", "-std=c++17", "-O1", f"-I{get_include()}", str(src), "-o", str(exe)], check=True, timeout=120
    )
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout
