"""Load libnccl through cuda.pathfinder and bind the extension's function pointers to it (once per process)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from . import _env
from .errors import NcclNotFoundError
from .version import NcclVersion

__all__ = ["LoadedNccl", "extension", "is_loaded", "load"]


@dataclass(frozen=True)
class LoadedNccl:
    """The NCCL library the extension is bound to."""

    path: str  # absolute path of libnccl.so.2 ("" if pathfinder could not tell)
    runtime: NcclVersion  # ncclGetVersion of that library
    header: NcclVersion  # NCCL_VERSION_CODE of the headers the extension was compiled against
    was_already_loaded: bool  # True when another component (e.g. torch) had loaded it first


_lock = threading.Lock()
_loaded: LoadedNccl | None = None


def _check_enabled() -> None:
    if _env.disabled():
        raise NcclNotFoundError(
            "NCCL is disabled by EPKIT_NCCL_GIN_DISABLE=1; unset it to use ep_nccl_gin's NCCL bindings"
        )


def extension() -> ModuleType:
    """The compiled module ``ep_nccl_gin._impl`` (raises NcclNotFoundError when it was not built)."""
    _check_enabled()
    try:
        from . import _impl
    except ImportError as exc:
        raise NcclNotFoundError(
            f"the compiled extension ep_nccl_gin._impl cannot be imported ({exc}); install ep-nccl-gin from a "
            "wheel or build it (pip install --no-build-isolation packages/ep-nccl-gin)"
        ) from exc
    return _impl


def _load_nvidia_dynamic_lib(name: str) -> Any:
    """cuda.pathfinder's loader (a seam the tests replace to simulate a machine without NCCL)."""
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib
    except ImportError as exc:
        raise NcclNotFoundError(
            f"cuda-pathfinder is not importable ({exc}); pip install cuda-pathfinder"
        ) from exc
    return load_nvidia_dynamic_lib(name)


def _not_found_types() -> tuple[type[BaseException], ...]:
    try:
        from cuda.pathfinder import DynamicLibNotFoundError
    except ImportError:
        return (OSError,)
    return (DynamicLibNotFoundError, OSError)


def load() -> LoadedNccl:
    """Load libnccl (cuda.pathfinder prefers a copy already loaded, e.g. torch's) and bind to it. Idempotent."""
    global _loaded
    _check_enabled()
    with _lock:
        if _loaded is not None:
            return _loaded
        impl = extension()
        try:
            dl = _load_nvidia_dynamic_lib("nccl")
        except NcclNotFoundError:
            raise
        except _not_found_types() as exc:
            raise NcclNotFoundError(
                f"no NCCL library found by cuda.pathfinder ({exc}). Install one: "
                "pip install 'ep-nccl-gin[cu13]' (CUDA 13) or 'ep-nccl-gin[cu12]' (CUDA 12)."
            ) from exc
        path = getattr(dl, "abs_path", None) or ""
        handle = int(getattr(dl, "_handle_uint", 0) or 0)
        impl.bind_library(handle, path)
        _loaded = LoadedNccl(
            path=path,
            runtime=NcclVersion.from_code(int(impl.runtime_version())),
            header=NcclVersion.from_code(int(impl.header_version())),
            was_already_loaded=bool(getattr(dl, "was_already_loaded_from_elsewhere", False)),
        )
        return _loaded


def is_loaded() -> bool:
    """Whether :func:`load` has succeeded in this process."""
    return _loaded is not None
