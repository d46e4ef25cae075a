"""CPU: `ep_core.kernels.zero_copy_rows` (where a zero-copy dispatch leaves its outputs) against the header the
kernel uses (include/ep_core/zero_copy_rows.cuh), compiled by nvcc as a host program, for bf16 and FP8 rows, top-k
1 to 32 and rank counts up to 72."""

from __future__ import annotations

import os
import shutil
import subprocess

import ep_layout
import pytest
from ep_core.kernels._source import get_include
from ep_core.kernels.zero_copy_rows import ZeroCopyRows

CASES = [
    ZeroCopyRows(8 * 4096, 7168 * 2, 0, 8),
    ZeroCopyRows(8 * 4096, 7168, 56, 8),
    ZeroCopyRows(3 * 96, 512, 4, 32),
    ZeroCopyRows(1, 64, 1, 1),
    ZeroCopyRows(72 * 128, 4096 * 2, 0, 6),
]


def _nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    path = shutil.which("nvcc") or os.path.join(home, "bin", "nvcc")
    return path if os.path.exists(path) else None


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found")
def test_the_python_offsets_are_the_headers(tmp_path) -> None:
    rows = "\n".join(
        f"    print(ep_core::ZeroCopyRows{{{z.rows}, {z.hidden_bytes}, {z.num_sf_packs}, {z.num_topk}}});"
        for z in CASES
    )
    src = tmp_path / "rows.cu"
    src.write_text(
        "#include <cstdio>\n#include <ep_core/zero_copy_rows.cuh>\n"
        "static void print(const ep_core::ZeroCopyRows& z) {\n"
        '    std::printf("%lld %lld %lld %lld %lld\\n", (long long)z.sf_offset(), (long long)z.topk_idx_offset(),\n'
        "                (long long)z.weights_offset(), (long long)z.meta_offset(), (long long)z.num_bytes());\n"
        "}\nint main() {\n" + rows + "\n    return 0;\n}\n"
    )
    exe = tmp_path / "rows"
    subprocess.run(
        [_nvcc(), "-std=c++17", "-I", get_include(), "-I", ep_layout.get_include(), str(src), "-o", str(exe)],
        check=True,
        capture_output=True,
    )
    got = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split("\n")
    for z, line in zip(CASES, got):
        want = (z.sf_offset, z.topk_idx_offset, z.weights_offset, z.meta_offset, z.num_bytes)
        assert tuple(int(v) for v in line.split()) == want, z
        assert all(off % 128 == 0 for off in want[:4])  # every array aligned (int64 ids, 16-byte bulk stores)
