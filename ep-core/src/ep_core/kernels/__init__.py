"""The GPU side of ep_core: kernel planning (`plan`), JIT instantiation (`_source`), the rank driver (`rank_driver`)
and its executor (`gpu_executor`).

Importing this package needs no GPU; the driver is loaded on first use.
"""

from __future__ import annotations

from ep_core.kernels.plan import (
    DEFAULT_NUM_WARPS,
    KernelConfig,
    LaunchGeometry,
    RegionPlan,
    check_coresident,
    launch_geometry,
    plan_regions,
    scratch_bytes,
)

__all__ = [
    "DEFAULT_NUM_WARPS",
    "KernelConfig",
    "LaunchGeometry",
    "RegionPlan",
    "check_coresident",
    "launch_geometry",
    "plan_regions",
    "scratch_bytes",
]
