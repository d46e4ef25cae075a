"""Include directories for JIT-compiling kernels against NCCL's device API and ``ep_nccl_gin/device.cuh``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from . import _env
from ._loader import load
from .errors import NcclHeadersNotFoundError, NcclNotFoundError
from .version import NcclVersion, check_header_runtime, parse_header_version, require

__all__ = ["include_dirs", "nccl_header_version", "nccl_include_dir", "own_include_dir"]

_PROBE = "nccl_device.h"


def own_include_dir() -> str:
    """The directory holding ``ep_nccl_gin/device.cuh`` (``#include <ep_nccl_gin/device.cuh>``)."""
    return str(Path(__file__).resolve().parent / "include")


def _valid(d: Path) -> bool:
    return (d / "nccl.h").is_file() and (d / _PROBE).is_file()


def _from_loaded_library() -> Path | None:
    """``<wheel>/nvidia/nccl/include`` beside the ``lib/libnccl.so.2`` that is loaded, if that is a wheel."""
    try:
        loaded = load()
    except NcclNotFoundError:
        return None
    if not loaded.path:
        return None
    candidate = Path(loaded.path).resolve().parent.parent / "include"
    return candidate if _valid(candidate) else None


def _from_pathfinder() -> Path | None:
    try:
        from cuda.pathfinder import find_nvidia_header_directory
    except ImportError:
        return None
    try:
        found = find_nvidia_header_directory("nccl")
    except Exception:  # older cuda-pathfinder: "nccl" is not in its header catalog
        return None
    if found is None:
        return None
    d = Path(found)
    return d if _valid(d) else None


def _from_wheel_namespace() -> Path | None:
    # nvidia.nccl is a namespace package (no __init__.py): its __path__ is the wheel's nvidia/nccl directory.
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        d = Path(loc) / "include"
        if _valid(d):
            return d
    return None


def nccl_include_dir() -> str:
    """The NCCL include directory for kernels: ``EPKIT_NCCL_INCLUDE_DIR``, else the headers of the loaded
    library's wheel, else what cuda.pathfinder (or the installed nvidia-nccl wheel) offers."""
    override = _env.nccl_include_dir()
    if override is not None:
        d = Path(override)
        if not _valid(d):
            raise NcclHeadersNotFoundError(
                f"EPKIT_NCCL_INCLUDE_DIR={override!r} does not hold nccl.h and {_PROBE}; point it at an NCCL "
                "include directory (>= 2.28.3) or unset it"
            )
        return str(d)
    for finder in (_from_loaded_library, _from_pathfinder, _from_wheel_namespace):
        d = finder()
        if d is not None:
            return str(d)
    raise NcclHeadersNotFoundError(
        f"no NCCL device headers ({_PROBE}) found: install nvidia-nccl-cu13 (or -cu12) >= 2.28.7, e.g. "
        "pip install 'ep-nccl-gin[cu13]', or set EPKIT_NCCL_INCLUDE_DIR"
    )


def nccl_header_version(include_dir: str | None = None) -> NcclVersion:
    """Version of the NCCL headers in ``include_dir`` (default: :func:`nccl_include_dir`)."""
    return parse_header_version(include_dir if include_dir is not None else nccl_include_dir())


def include_dirs(*, check: bool = True) -> list[str]:
    """``[nccl_include_dir(), own_include_dir()]`` for the JIT.

    With ``check`` (default) and a loaded NCCL, the headers must satisfy NCCL's header/library rule against the
    loaded library (before 2.31: the same version), else :class:`NcclVersionError`.
    """
    nccl_dir = nccl_include_dir()
    if check:
        try:
            runtime = load().runtime
        except NcclNotFoundError:
            runtime = None
        if runtime is not None:
            require("device_api", runtime)
            check_header_runtime(
                parse_header_version(nccl_dir), runtime, what=f"the NCCL headers in {nccl_dir}"
            )
    return [nccl_dir, own_include_dir()]
