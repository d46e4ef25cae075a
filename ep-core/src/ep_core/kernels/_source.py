"""Generated JIT source of the direct-mode kernels and their compilation through ep_jit."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ep_layout

from ep_core import _env
from ep_core.errors import EPConfigError
from ep_core.kernels.plan import KernelConfig

__all__ = [
    "DISPATCH_ZERO_COPY_KERNEL",
    "KERNEL_NAMES",
    "ZERO_COPY_KERNEL",
    "KernelSet",
    "compile_kernels",
    "get_include",
    "kernel_source",
    "load_kernels",
]

KERNEL_NAMES = ("ep_dispatch_impl", "ep_dispatch_copy_epilogue_impl", "ep_combine_impl")
ZERO_COPY_KERNEL = "ep_combine_zero_copy_impl"
"""The combine from the ranks' combine buffers (combine.cuh, zero-copy): in direct-mode instances only."""
DISPATCH_ZERO_COPY_KERNEL = "ep_dispatch_zero_copy_impl"
"""The dispatch into its outputs in place (dispatch.cuh, zero-copy): in direct-mode instances only."""


def get_include() -> str:
    """Directory holding `ep_core/kernels.cuh`: `<package>/include` in a wheel, `ep-core/include` in a checkout."""
    pkg = Path(__file__).resolve().parent.parent
    for candidate in (pkg / "include", pkg.parent.parent / "include"):
        if (candidate / "ep_core" / "kernels.cuh").is_file():
            return str(candidate)
    raise EPConfigError(
        f"ep_core kernel headers not found under {pkg / 'include'} or {pkg.parent.parent / 'include'}; "
        "reinstall ep-core"
    )


def kernel_source(config: KernelConfig) -> str:
    """The translation unit of one instance: the defines are passed separately (`KernelConfig.defines`)."""
    mode = (
        "hybrid"
        if config.is_hybrid
        else "direct-mode across nodes"
        if config.is_direct_xnode
        else "direct-mode"
    )
    lines = [f"// ep_core {mode} kernels: {config}"]
    if config.transport == "nccl":
        lines.append("#define EP_CORE_WITH_NCCL 1")
    lines.append("#include <ep_core/kernels.cuh>")
    return "\n".join(lines) + "\n"


def _include_dirs(config: KernelConfig, headers: tuple[str, str] | None = None) -> list[str]:
    dirs = list(headers) if headers is not None else [get_include(), ep_layout.get_include()]
    if config.transport == "nccl":
        import ep_nccl_gin  # optional extra

        dirs.extend(ep_nccl_gin.include_dirs(check=False))
    return dirs


PHASE_TIMING_ENV = "EPKIT_PHASE_TIMING"
"""Set to 1 to build the kernels with the phase-timing instrument (include/ep_core/phase_timing.cuh, read by
benchmarks/profile_ops.py --phases); read when a process first compiles an instance. Off by default."""


def phase_timing_enabled() -> bool:
    return _env.read(PHASE_TIMING_ENV)[1] not in ("", "0")


COMBINE_REDUCE_PARTS_ENV = "EPKIT_COMBINE_REDUCE_PARTS"
"""Column parts per token in the direct combine's reduction when the grid has fewer warps than tokens (combine.cuh
`kCombineReduceParts`; issue 17, decode tail: EP8 at 8 SMs is 120 warps for 128 tokens; EP8 decode combine 121.2 ->
109.7 us at 4). Unset or empty: the default build, `DEFAULT_COMBINE_REDUCE_PARTS` where it splits the config's
combine row into whole 16-byte vectors, else 1 (`default_combine_reduce_parts`). Any other P in 1..32 that splits the
row so (1: whole rows, one token per warp) builds a separate JIT instance (`_rp<P>`) when it differs from the
default. Same bits either way. Read when a process first compiles an instance."""

DEFAULT_COMBINE_REDUCE_PARTS = 4

COMBINE_LOCAL_REF_ENV = "EPKIT_COMBINE_LOCAL_REF"
"""1 (unset or empty: the default build): the direct combine leaves a row whose source token is on the sending rank
(every row at EP1) in its slot by address, and the reduce reads the caller's row itself (combine.cuh
`kCombineLocalRef`; issue 17: EP1 decode combine 16.9 -> 11.2 us). 0: every row copied into its slot, a separate JIT
instance (`_lr0`). Same bits either way."""


def _on_off(env: str) -> bool:
    # the deprecated EP_CORE_ name too (named in the error when it is the one set)
    used, text = _env.read(env)
    if text not in ("", "0", "1"):
        raise EPConfigError(f"{used}: expected 0 or 1, got {text!r}")
    return text != "0"


def combine_local_ref() -> bool:
    """The validated `EPKIT_COMBINE_LOCAL_REF` (True when unset)."""
    return _on_off(COMBINE_LOCAL_REF_ENV)


WARP_MAJOR_ENV = "EPKIT_WARP_MAJOR"
"""1 (unset or empty: the default build): the direct dispatch, copy epilogue (also hybrid's and direct mode across
nodes', which run direct mode's) and combine hand out their tokens / rows in warp-major order (token.cuh
`work_warp_index`; issue 17: a partial last round spreads over SMs instead of block 0's; EP1 decode dispatch 15.0 ->
12.5 us). 0: block-major, a separate JIT instance (`_wm0`). Same bytes either way (each unit's work does not depend
on the warp; the non-deterministic slot order was never fixed)."""


def warp_major() -> bool:
    """The validated `EPKIT_WARP_MAJOR` (True when unset)."""
    return _on_off(WARP_MAJOR_ENV)


def _splits_row(config: KernelConfig, parts: int) -> bool:
    return (config.hidden * 2) % (16 * parts) == 0  # bf16 combine row into whole 16-byte vectors


def default_combine_reduce_parts(config: KernelConfig) -> int:
    """`DEFAULT_COMBINE_REDUCE_PARTS` where it splits `config`'s combine row into whole 16-byte vectors, else 1."""
    return DEFAULT_COMBINE_REDUCE_PARTS if _splits_row(config, DEFAULT_COMBINE_REDUCE_PARTS) else 1


def combine_reduce_parts(config: KernelConfig) -> int:
    """The validated `EPKIT_COMBINE_REDUCE_PARTS` for `config` (`default_combine_reduce_parts` when unset)."""
    used, text = _env.read(COMBINE_REDUCE_PARTS_ENV)
    if text == "":
        return default_combine_reduce_parts(config)
    try:
        parts = int(text)
    except ValueError:
        parts = 0
    if parts < 1 or parts > 32 or not _splits_row(config, parts):
        raise EPConfigError(
            f"{used}: expected an integer in 1..32 that splits the combine row of "
            f"{config.hidden * 2} bytes into whole 16-byte vectors, got {text!r}"
        )
    return parts


def jit_switches(config: KernelConfig) -> tuple[dict[str, int], str]:
    """The defines of the issue-17 switches for `config` (always all three, explicit: the headers' fallbacks are
    off) and the instance-name suffix, which names only a switch that differs from its default (ep_jit keeps 48
    characters of a name: the default names stay as short as before the switches)."""
    parts, local_ref, wm = combine_reduce_parts(config), combine_local_ref(), warp_major()
    defines = {
        "EP_CORE_COMBINE_REDUCE_PARTS": parts,
        "EP_CORE_COMBINE_LOCAL_REF": int(local_ref),
        "EP_CORE_WARP_MAJOR": int(wm),
    }
    suffix = f"_rp{parts}" if parts != default_combine_reduce_parts(config) else ""
    suffix += "" if local_ref else "_lr0"
    suffix += "" if wm else "_wm0"
    return defines, suffix


def compile_kernels(
    config: KernelConfig, arch: str | None = None, *, headers: tuple[str, str] | None = None
) -> Any:
    """Compile (or fetch from the cache) the instance of `config`; returns the ep_jit Artifact. `headers`: the
    include directories of ep-core's and ep-layout's headers to build from instead of the installed ones (another
    tree's: scripts/sass_diff.py compares the machine code of two revisions)."""
    import ep_jit

    name = (
        f"ep_core_direct_n{config.num_ranks}_k{config.num_topk}_h{config.hidden}_e{config.elem_size}"
        f"_p{config.num_sf_packs}_w{config.num_warps}_{config.transport}"
    )
    if config.is_hybrid:
        name = (
            name.replace("ep_core_direct_", "ep_core_hybrid_")
            + f"_su{config.num_scaleup_ranks}_{config.scaleout[:3]}"
        )
    elif config.is_direct_xnode:  # direct mode across nodes (direct_xnode.cuh)
        name += f"_xn{config.num_nvlink_ranks}_{config.scaleout[:3]}"  # ep_jit keeps 48 characters
    defines = config.defines()
    switches, suffix = jit_switches(config)
    defines.update(switches)
    name += suffix
    if phase_timing_enabled():
        defines["EP_CORE_PHASE_TIMING"] = 1
        name += "_phases"
    return ep_jit.compile(
        kernel_source(config),
        name=name,
        include_dirs=_include_dirs(config, headers),
        defines=defines,
        arch=arch,
        flags=("-std=c++17",),
        key_extra={"ep_layout": ep_layout.__version__},
    )


@dataclass
class KernelSet:
    config: KernelConfig
    dispatch: Any
    epilogue: Any
    combine: Any
    combine_zero_copy: Any = None  # direct-mode instances only (ZERO_COPY_KERNEL)
    dispatch_zero_copy: Any = None  # direct-mode instances only (DISPATCH_ZERO_COPY_KERNEL)


_loaded: dict[KernelConfig, KernelSet] = {}
_load_lock = threading.Lock()


def load_kernels(config: KernelConfig) -> KernelSet:
    """Compile (cached on disk) and load the three kernels of `config` (cached per process)."""
    ks = _loaded.get(config)
    if ks is not None:
        return ks
    import ep_jit

    artifact = compile_kernels(config)
    with _load_lock:
        ks = _loaded.get(config)
        if ks is None:
            module = ep_jit.load(artifact)
            ks = KernelSet(config, *(module.function(n) for n in KERNEL_NAMES))
            if not (config.is_hybrid or config.is_direct_xnode):
                ks.combine_zero_copy = module.function(ZERO_COPY_KERNEL)
                ks.dispatch_zero_copy = module.function(DISPATCH_ZERO_COPY_KERNEL)
            _loaded[config] = ks
    return ks
