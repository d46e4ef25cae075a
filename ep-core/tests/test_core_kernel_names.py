"""CPU: the kernels carry the names DeepEP's profiling looks up by substring (its tests time `dispatch_impl`,
`dispatch_copy_epilogue_impl`, `combine_impl` out of a profiler trace), each matching exactly one ep kernel, and
the executor launches those names. test_core_kernels_compile checks that the compiled cubin exports them."""

from __future__ import annotations

import re
from pathlib import Path

from ep_core.kernels._source import (
    DISPATCH_ZERO_COPY_KERNEL,
    KERNEL_NAMES,
    ZERO_COPY_KERNEL,
    get_include,
)

# the zero-copy combine and dispatch: direct-mode instances only
ALL = (*KERNEL_NAMES, ZERO_COPY_KERNEL, DISPATCH_ZERO_COPY_KERNEL)

# the rank's modules that launch them (`RankDriver`: its state, its dispatch side, its combine side)
KERNELS_DIR = Path(__file__).resolve().parents[1] / "src" / "ep_core" / "kernels"
SRC = [KERNELS_DIR / name for name in ("rank_driver.py", "dispatch_launch.py", "combine_launch.py")]

# DeepEP's substring -> the ep kernel it must find. DeepEP's combine reduce epilogue (`combine_reduce_epilogue_impl`)
# has no ep counterpart: ep's combine reduces in its one kernel.
DEEPEP = {
    "dispatch_impl": "ep_dispatch_impl",
    "dispatch_copy_epilogue_impl": "ep_dispatch_copy_epilogue_impl",
    "combine_impl": "ep_combine_impl",
}


def test_each_deepep_substring_finds_exactly_its_kernel():
    for sub, kernel in DEEPEP.items():
        assert [n for n in ALL if sub in n] == [kernel], sub
    assert all(n.startswith("ep_") for n in ALL)
    assert not any("combine_reduce_epilogue_impl" in n for n in ALL)


def test_header_defines_and_executor_launches_those_names():
    header = (Path(get_include()) / "ep_core" / "kernels.cuh").read_text()
    defined = re.findall(r"__global__ void __launch_bounds__\([^)]*\)\s+(\w+)\(", header)
    assert sorted(defined) == sorted(ALL)
    launched = set(re.findall(r'"(ep_\w+_impl)"', "".join(p.read_text() for p in SRC)))
    assert launched == set(ALL)
