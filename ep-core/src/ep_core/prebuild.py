"""Prebuild the JIT cache for one EP configuration (`python -m ep_core compile ...`), with or without a GPU.

What the runtime compiles is decided by `KernelConfig` alone (`kernels/plan.py`): ranks, top-k, hidden, element
size, FP8 scale packs, warps per block and transport; one instance holds all three kernels. Everything else a call
varies is a kernel argument or launch parameter, so the enumeration below is exactly the instances the executor
can ask for. Prebuild for the runtime's arch (`sm_90a` on an H200) and under the JIT switches it will see
(`EPKIT_COMBINE_LOCAL_REF`, `EPKIT_WARP_MAJOR`, `EPKIT_COMBINE_REDUCE_PARTS`), or the entries are never hit.
Hybrid configurations build the hybrid kernels (or, with `allow_hybrid_mode=False`, direct mode across nodes) with
the transport's scale-out put (`emulated` over ipc, `gin` over nccl).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ep_core.errors import EPConfigError, EPValueError
from ep_core.kernels._source import KERNEL_NAMES, compile_kernels
from ep_core.kernels.plan import KernelConfig, default_num_sms, plan_regions
from ep_core.topology import resolve_scaleup_ranks

__all__ = [
    "BuiltInstance",
    "PlannedInstance",
    "cache_root",
    "fp8_sf_pack_counts",
    "plan_instances",
    "prebuild",
]


def cache_root() -> Path:
    """The root of the JIT cache the kernels are compiled into (`EPKIT_JIT_CACHE_DIR`, default
    `~/.cache/ep/jit`): ep_torch keeps its host extension's builds under it too (`host/`), one cache to clear."""
    import ep_jit

    return Path(ep_jit.cache().root)


DEFAULT_ARCH = "sm_90a"
DEFAULT_DEVICE_SMS = 132  # H200 / H100 SXM


def fp8_sf_pack_counts(hidden: int) -> tuple[int, ...]:
    """The `num_sf_packs` of the two scale formats of the behaviour doc: one FP32 scale per 128-element block
    (`ceil(hidden / 128)` packs) and four UE8M0 bytes per int32 pack (`ceil(hidden / 512)` packs).
    `sf.shape[1]` is a template constant, so any other count is a different instance (pass it explicitly)."""
    fp32 = -(-hidden // 128)
    ue8m0 = -(-fp32 // 4)
    return tuple(dict.fromkeys((fp32, ue8m0)))


@dataclass(frozen=True)
class PlannedInstance:
    """One JIT instance the runtime can launch for the configuration, and which operations use it."""

    config: KernelConfig
    uses: tuple[str, ...]


@dataclass(frozen=True)
class BuiltInstance:
    planned: PlannedInstance
    key: str
    path: str
    from_cache: bool
    seconds: float
    kernels: tuple[str, ...]


def plan_instances(
    *,
    num_ranks: int,
    hidden: int,
    num_topk: int,
    num_experts: int,
    num_scaleup_ranks: int | None = None,
    fp8: bool = False,
    num_sf_packs: tuple[int, ...] | None = None,
    transport: str = "ipc",
    num_warps: int | None = None,
    allow_hybrid_mode: bool = True,
) -> list[PlannedInstance]:
    """The instances of the runtime for this configuration (module doc); raises EPConfigError for a
    configuration the runtime would refuse (the same checks: `KernelConfig`, `plan_regions`).
    `num_scaleup_ranks`: ranks per node; several nodes run hybrid mode, or direct mode across nodes with
    `allow_hybrid_mode=False`."""
    su = resolve_scaleup_ranks(num_ranks, num_scaleup_ranks)
    kw: dict[str, Any] = {"transport": transport, "num_scaleup_ranks": su}
    if not allow_hybrid_mode:  # one logical domain of every rank; the nodes only decide who is reached how
        kw = {"transport": transport, "num_scaleup_ranks": num_ranks, "num_nvlink_ranks": su}
    if num_warps is not None:
        kw["num_warps"] = int(num_warps)
    bf16 = KernelConfig(num_ranks, num_topk, hidden, 2, 0, **kw)
    plan_regions(bf16, num_experts, 1)  # num_experts rules (multiple of num_ranks, limits)
    # The executor's combine always uses the bf16 instance (`_config(hidden, 2, 0, k)`), whatever dispatched.
    out = [PlannedInstance(bf16, ("dispatch bf16", "copy epilogue bf16", "combine"))]
    if fp8:
        packs = fp8_sf_pack_counts(hidden) if not num_sf_packs else tuple(dict.fromkeys(num_sf_packs))
        for p in packs:
            if p < 1:
                raise EPValueError(f"num_sf_packs: expected >= 1 for FP8, got {p}")
            cfg = KernelConfig(num_ranks, num_topk, hidden, 1, int(p), **kw)
            out.append(
                PlannedInstance(cfg, (f"dispatch fp8 (sf packs {p})", f"copy epilogue fp8 (sf packs {p})"))
            )
    elif num_sf_packs:
        raise EPValueError("num_sf_packs: only meaningful with fp8=True")
    return out


def planned_num_sms(
    num_ranks: int, num_experts: int, num_topk: int, device_sms: int, nvlink_gbs: float | None = None
) -> tuple[int, str]:
    """The SM count a rank alone on its GPU would launch with (the executor's `_num_sms` path), and where it came
    from. Reported only: num_sms is a launch parameter, not part of the JIT key."""
    from ep_core import planner
    from ep_core.topology import Topology

    try:
        sms = planner.get_theoretical_num_sms(
            Topology(num_ranks), num_experts, num_topk, num_device_sms=device_sms, nvlink_gbs=nvlink_gbs
        )
        source = "planner"
    except EPConfigError as e:
        sms, source = 0, f"default (planner could not run: {e})"
    return default_num_sms(device_sms, 1, int(sms)), source


def prebuild(
    instances: list[PlannedInstance], *, arch: str = DEFAULT_ARCH, on_built: Any = None
) -> list[BuiltInstance]:
    """Compile (or find in the cache) every instance; `on_built(BuiltInstance)` is called after each one.
    Raises what the compiler raises (ep_jit.CompileError, EPConfigError for missing headers)."""
    built = []
    for inst in instances:
        t0 = time.perf_counter()
        art = compile_kernels(inst.config, arch=arch)
        missing = [n for n in KERNEL_NAMES if n not in art.kernel_names]
        if missing:
            raise EPConfigError(
                f"prebuild: the cubin {art.cubin_path} of {inst.config} lacks the kernels {missing} "
                f"(it has {art.kernel_names}); clear the cache entry and rebuild"
            )
        b = BuiltInstance(
            inst, art.key, str(art.cubin_path), art.from_cache, time.perf_counter() - t0, KERNEL_NAMES
        )
        built.append(b)
        if on_built is not None:
            on_built(b)
    return built
