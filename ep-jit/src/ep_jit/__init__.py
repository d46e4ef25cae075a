"""ep-jit: compile CUDA source to cubins through a multi-process-safe cache, load them, launch kernels.

>>> art = ep_jit.compile(src, name="scale", arch="sm_90a", defines={"N": 128})
>>> kernel = ep_jit.load(art).function("scale")
>>> kernel.launch(grid, block, [x, ep_jit.float32(2.0), ep_jit.int32(n)], stream=torch_stream)

Importing needs no GPU and no driver; only loading and launching do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ._args import KernelArg, Struct, bool_, float32, float64, int32, int64, pointer, struct, uint32, uint64
from ._build import Artifact, KeyRecord, clear_memo, compile, compute_key
from ._cache import Cache, CacheCorruptionWarning
from ._errors import CompileError, JitError, LaunchError, NoDeviceError
from ._module import Kernel, Module, load, stream_handle

__version__ = "0.1.0"

__all__ = [
    "Artifact",
    "Cache",
    "CacheCorruptionWarning",
    "CompileError",
    "JitError",
    "Kernel",
    "KernelArg",
    "KeyRecord",
    "LaunchError",
    "Module",
    "NoDeviceError",
    "Struct",
    "__version__",
    "bool_",
    "cache",
    "clear_memo",
    "compile",
    "compile_and_load",
    "compute_key",
    "float32",
    "float64",
    "get_kernel",
    "int32",
    "int64",
    "load",
    "pointer",
    "stream_handle",
    "struct",
    "uint32",
    "uint64",
]


def cache() -> Cache:
    """The cache at the configured location (``EPKIT_JIT_CACHE_DIR``, default ``~/.cache/ep/jit``)."""
    from . import _env

    return Cache(_env.cache_dir())


def compile_and_load(source: str, **kwargs: Any) -> Module:
    """``load(compile(source, **kwargs))``."""
    return load(compile(source, **kwargs))


def get_kernel(
    source: str,
    *,
    name: str,
    kernel: str | None = None,
    include_dirs: Sequence[Any] = (),
    defines: Mapping[str, Any] | None = None,
    arch: str | None = None,
    flags: Sequence[str] = (),
    backend: str | None = None,
    **kwargs: Any,
) -> Kernel:
    """Compile (cached), load (memoized) and look up one kernel; ``kernel`` defaults to ``name``."""
    art = compile(
        source,
        name=name,
        include_dirs=include_dirs,
        defines=defines,
        arch=arch,
        flags=flags,
        backend=backend,
        **kwargs,
    )
    return load(art).function(kernel or name)
