"""Every environment knob of ep-jit, in one place (name, type, default, meaning).

Knobs are read from ``os.environ`` each time they are asked for, so tests and long-lived processes
see changes; nothing else in the package reads the environment.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["KNOBS", "Knob", "scope"]


@dataclass(frozen=True)
class Knob:
    """One environment variable: its name, kind (``str``/``bool``/``int``), default and meaning."""

    name: str
    kind: str
    default: str | None
    doc: str

    def raw(self) -> str | None:
        value = os.environ.get(self.name)
        if value is None or value == "":
            return self.default
        return value

    def get_str(self) -> str | None:
        return self.raw()

    def get_bool(self) -> bool:
        value = self.raw()
        if value is None:
            return False
        lowered = value.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(f"{self.name}: expected one of 1/0/true/false/yes/no/on/off, got {value!r}")

    def get_int(self) -> int:
        value = self.raw()
        if value is None:
            raise ValueError(f"{self.name} has no value and no default")
        try:
            return int(value, 0)
        except ValueError:
            raise ValueError(f"{self.name}: expected an integer, got {value!r}") from None


KNOBS: dict[str, Knob] = {
    k.name: k
    for k in (
        Knob(
            "EPKIT_JIT_CACHE_DIR",
            "str",
            None,
            "cache root (default $XDG_CACHE_HOME/ep/jit or ~/.cache/ep/jit)",
        ),
        Knob("EPKIT_JIT_DEBUG", "bool", "0", "log compiler commands, keys, cache hits and misses"),
        Knob("EPKIT_JIT_NVCC", "str", None, "path of nvcc (default $CUDA_HOME/bin/nvcc, else nvcc on PATH)"),
        Knob("EPKIT_JIT_BACKEND", "str", "nvcc", "default compiler backend: nvcc or nvrtc"),
        Knob("EPKIT_JIT_KEEP_TEMPS", "bool", "0", "also keep kernel.ptx and kernel.sass in each cache entry"),
        Knob(
            "EPKIT_JIT_PTXAS_VERBOSE",
            "bool",
            "0",
            "log ptxas register/spill usage of each compiled kernel at INFO",
        ),
        Knob("EPKIT_JIT_LINEINFO", "bool", "0", "compile with -lineinfo (part of the key)"),
        Knob(
            "EPKIT_JIT_EXTRA_FLAGS",
            "str",
            "",
            "extra compiler flags appended to every compile (part of the key)",
        ),
        Knob(
            "EPKIT_JIT_CACHE_MAX_BYTES",
            "int",
            str(4 << 30),
            "soft size cap of the cache, LRU eviction; 0 = none",
        ),
        Knob("EPKIT_JIT_LOCK_TIMEOUT", "int", "1800", "seconds to wait for another process's build of a key"),
        Knob("EPKIT_JIT_ALWAYS_COMPILE", "bool", "0", "ignore cache hits (still publish the new entry)"),
    )
}


def cache_dir() -> Path:
    explicit = KNOBS["EPKIT_JIT_CACHE_DIR"].get_str()
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "ep" / "jit"


def debug() -> bool:
    return KNOBS["EPKIT_JIT_DEBUG"].get_bool()


def nvcc_override() -> str | None:
    return KNOBS["EPKIT_JIT_NVCC"].get_str()


def cuda_home() -> str | None:
    """The toolkit root from CUDA_HOME or CUDA_PATH (used to find nvcc)."""
    return os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or None


def backend() -> str:
    return (KNOBS["EPKIT_JIT_BACKEND"].get_str() or "nvcc").strip().lower()


def keep_temps() -> bool:
    return KNOBS["EPKIT_JIT_KEEP_TEMPS"].get_bool()


def ptxas_verbose() -> bool:
    return KNOBS["EPKIT_JIT_PTXAS_VERBOSE"].get_bool()


def lineinfo() -> bool:
    return KNOBS["EPKIT_JIT_LINEINFO"].get_bool()


def extra_flags() -> tuple[str, ...]:
    return tuple((KNOBS["EPKIT_JIT_EXTRA_FLAGS"].get_str() or "").split())


def cache_max_bytes() -> int:
    return KNOBS["EPKIT_JIT_CACHE_MAX_BYTES"].get_int()


def lock_timeout() -> int:
    return KNOBS["EPKIT_JIT_LOCK_TIMEOUT"].get_int()


def always_compile() -> bool:
    return KNOBS["EPKIT_JIT_ALWAYS_COMPILE"].get_bool()


_SNAPSHOT_NAMES = (*KNOBS, "XDG_CACHE_HOME", "CUDA_HOME", "CUDA_PATH")
# os.environ keeps its contents in a dict of encoded keys on POSIX; reading it directly is ~20x faster than
# os.environ.get, which matters on the in-process memo path. Any other layout falls back to os.environ.get.
_RAW_ENV = getattr(os.environ, "_data", None)
_RAW_KEYS = (
    tuple(os.environ.encodekey(n) for n in _SNAPSHOT_NAMES) if hasattr(os.environ, "encodekey") else ()
)
if not isinstance(_RAW_ENV, dict) or not _RAW_KEYS:
    _RAW_ENV = None


def snapshot() -> tuple:
    """The raw values of every knob (and the toolkit/cache variables they depend on), for the memo key."""
    if _RAW_ENV is not None:
        return tuple(map(_RAW_ENV.get, _RAW_KEYS))
    return tuple(map(os.environ.get, _SNAPSHOT_NAMES))


@contextlib.contextmanager
def scope(**values: str | None) -> Iterator[None]:
    """Temporarily set (or, with None, unset) environment knobs; restores them on exit. For tests."""
    saved = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
