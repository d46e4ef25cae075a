"""``compile()``: source -> cached cubin, keyed by everything that decides the cubin's bytes."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import _env
from ._cache import SCHEMA_VERSION, Cache, disk_error, disk_is_full
from ._compiler import Backend, get_backend, normalize_arch
from ._cubin import is_cubin, kernel_names
from ._errors import CompileError, JitError
from ._includes import include_closure

__all__ = ["Artifact", "KeyRecord", "clear_memo", "compile", "compute_key"]

log = logging.getLogger("ep_jit")


@dataclass(frozen=True)
class Artifact:
    """A compiled cubin in the cache: its key, its path, whether it came from the cache, and meta.json."""

    key: str
    cubin_path: Path
    from_cache: bool
    name: str
    meta: dict[str, Any] = field(repr=False, compare=False, hash=False)

    @property
    def entry_dir(self) -> Path:
        return self.cubin_path.parent

    @property
    def kernel_names(self) -> list[str]:
        """The ``__global__`` entry points of the cubin (mangled, or plain for ``extern "C"``)."""
        return list(self.meta.get("kernels", []))


@dataclass(frozen=True)
class KeyRecord:
    """Everything hashed into a key, in clear text (stored in meta.json as ``key_record``)."""

    record: dict[str, Any]
    key: str
    canonical_flags: list[str]
    backend: Backend


def _version() -> str:
    from . import __version__

    return __version__


def _canonical_defines(defines: Mapping[str, Any] | None) -> list[str]:
    out = []
    for k, v in sorted((defines or {}).items()):
        if not isinstance(k, str) or not k or not (k[0].isalpha() or k[0] == "_"):
            raise ValueError(f"defines: expected macro names (identifiers), got {k!r}")
        if v is None:
            out.append(f"-D{k}")
        elif isinstance(v, bool):
            out.append(f"-D{k}={int(v)}")
        else:
            out.append(f"-D{k}={v}")
    return out


def _resolve_arch(arch: str | None) -> str:
    if arch is not None:
        return normalize_arch(arch)
    from ._driver import current_arch

    return current_arch()


def compute_key(
    source: str,
    *,
    name: str,
    include_dirs: Sequence[str | os.PathLike[str]] = (),
    defines: Mapping[str, Any] | None = None,
    arch: str | None = None,
    flags: Sequence[str] = (),
    backend: str | None = None,
    lineinfo: bool | None = None,
    key_extra: Mapping[str, Any] | None = None,
    package_versions: Mapping[str, Any] | None = None,
) -> KeyRecord:
    """The cache key of a compile request, without compiling (hashes sources and headers)."""
    if not isinstance(source, str) or not source.strip():
        raise ValueError("source: expected the CUDA source text (a non-empty str)")
    if not isinstance(name, str) or not name:
        raise ValueError("name: expected a non-empty str naming the kernel (used in logs and the cache)")
    if isinstance(flags, str):
        raise TypeError("flags: expected a sequence of strings such as ('-DX=1',), got one str")
    arch_n = _resolve_arch(arch)
    be = get_backend(backend)
    dirs = [os.fspath(d) for d in include_dirs]
    for d in dirs:
        if not os.path.isdir(d):
            raise ValueError(f"include_dirs: {d!r} is not a directory")
    include_flags = [f"-I{os.path.realpath(d)}" for d in dirs]
    user_flags = [*map(str, flags), *_env.extra_flags()]
    if (lineinfo if lineinfo is not None else _env.lineinfo()) and "-lineinfo" not in user_flags:
        user_flags.append("-lineinfo")
    canonical = be.canonical_flags(
        arch=arch_n, include_flags=include_flags, define_flags=_canonical_defines(defines), flags=user_flags
    )
    # The caller's include paths vary between installs; their content is what matters, so the key holds
    # those flags without paths and the header closure's digests instead.
    user_includes = set(include_flags)
    keyed_flags = [f if f not in user_includes else "-I<dir>" for f in canonical]
    record = {
        "schema": SCHEMA_VERSION,
        "ep_jit": _version(),
        "name": name,
        "source_sha256": hashlib.sha256(source.encode()).hexdigest(),
        "includes": include_closure(source, dirs),
        "compiler": be.identity(),
        "backend": be.name,
        "flags": keyed_flags,
        "arch": arch_n,
        "extra": {str(k): str(v) for k, v in sorted((key_extra or {}).items())},
        "packages": {str(k): str(v) for k, v in sorted((package_versions or {}).items())},
    }
    blob = json.dumps(record, sort_keys=True, separators=(",", ":")).encode()
    return KeyRecord(record, hashlib.sha256(blob).hexdigest(), canonical, be)


# In-process memo: the call's arguments (and the env knobs) -> Artifact. A hot call is one dict lookup.
_memo: dict[tuple, Artifact] = {}
_memo_lock = threading.Lock()


def clear_memo() -> None:
    """Forget in-process results, so the next ``compile()`` re-hashes sources (after editing headers)."""
    with _memo_lock:
        _memo.clear()


def compile(
    source: str,
    *,
    name: str,
    include_dirs: Sequence[str | os.PathLike[str]] = (),
    defines: Mapping[str, Any] | None = None,
    arch: str | None = None,
    flags: Sequence[str] = (),
    backend: str | None = None,
    lineinfo: bool | None = None,
    key_extra: Mapping[str, Any] | None = None,
    package_versions: Mapping[str, Any] | None = None,
) -> Artifact:
    """Compile ``source`` to a cubin through the on-disk cache and return the cached :class:`Artifact`.

    ``name`` labels the kernel in logs and cache listings. ``include_dirs`` are searched for
    ``#include``s, and every header found there is hashed into the key. ``defines`` become ``-D``
    flags. ``arch`` is e.g. ``"sm_90a"`` (default: the current GPU's, which needs a driver).
    ``flags`` are passed to the compiler as given. ``backend`` is ``"nvcc"`` or ``"nvrtc"``
    (default ``EPKIT_JIT_BACKEND`` or nvcc). ``package_versions`` (e.g. ``{"ep_layout": "0.1.0",
    "nccl": "2.28.9"}``) and ``key_extra`` (anything else that changes the code) are added to the key.
    ``lineinfo`` adds ``-lineinfo`` (default ``EPKIT_JIT_LINEINFO``). Raises :class:`CompileError`
    with the compiler's output on failure.

    Results are memoized in the process by the call's arguments (and the EPKIT_JIT_* variables), so a
    repeated call does no hashing and no file I/O; :func:`clear_memo` forgets them.
    """
    memo_key = (
        source,
        name,
        tuple(map(os.fspath, include_dirs)),
        tuple(sorted((k, str(v)) for k, v in defines.items())) if defines else (),
        arch,
        tuple(flags),
        backend,
        lineinfo,
        tuple(sorted((str(k), str(v)) for k, v in key_extra.items())) if key_extra else (),
        tuple(sorted((str(k), str(v)) for k, v in package_versions.items())) if package_versions else (),
        _env.snapshot(),
    )
    if arch is None:
        from ._driver import current_arch

        memo_key = (*memo_key, current_arch())
    hit = _memo.get(memo_key)
    if hit is not None:
        return hit
    artifact = _compile_uncached(
        source,
        name=name,
        include_dirs=include_dirs,
        defines=defines,
        arch=arch,
        flags=flags,
        backend=backend,
        lineinfo=lineinfo,
        key_extra=key_extra,
        package_versions=package_versions,
    )
    with _memo_lock:
        if len(_memo) > 1024:
            _memo.clear()
        _memo[memo_key] = Artifact(artifact.key, artifact.cubin_path, True, artifact.name, artifact.meta)
    return artifact


_debug_handler: logging.Handler | None = None


def _enable_debug_logging() -> None:
    """EPKIT_JIT_DEBUG=1: make ep_jit's log visible on stderr even if the application configured nothing."""
    global _debug_handler
    if _debug_handler is None:
        _debug_handler = logging.StreamHandler()
        _debug_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        log.addHandler(_debug_handler)
        if log.getEffectiveLevel() > logging.DEBUG:
            log.setLevel(logging.DEBUG)


def _compile_uncached(source: str, *, name: str, **kwargs: Any) -> Artifact:
    debug = _env.debug()
    if debug:
        _enable_debug_logging()
    t_key = time.perf_counter()
    kr = compute_key(source, name=name, **kwargs)
    cache = Cache(_env.cache_dir())
    entry = cache.entry_dir(name, kr.key)
    if debug:
        log.info(
            "ep_jit: key %s for %s computed in %.1f ms", kr.key, name, (time.perf_counter() - t_key) * 1e3
        )
    always = _env.always_compile()
    if not always:
        meta, problem = cache.verify(entry)
        if meta is not None:
            cache.touch(entry)
            if debug:
                log.info("ep_jit: cache hit %s", entry)
            return Artifact(kr.key, entry / "kernel.cubin", True, name, meta)
    waiting_since = time.time() - 1.0  # margin for coarse file-system timestamps
    with cache.key_lock(kr.key, _env.lock_timeout(), name):
        meta, problem = cache.verify(entry)
        if meta is not None and not always:
            cache.touch(entry)
            if debug:
                log.info("ep_jit: cache hit %s (built by another process)", entry)
            return Artifact(kr.key, entry / "kernel.cubin", True, name, meta)
        failed = cache.recent_failure(name, kr.key, waiting_since)
        if failed is not None:
            # Another process failed on this very key while we waited: same inputs, same error; do not
            # make every rank of a job recompile a broken kernel in turn.
            path, text = failed
            raise CompileError(
                f"compiling {name} failed in another process or thread just now (same key {kr.key[:12]}):\n{text.strip()}\n"
                f"(full compiler output saved in {path})",
                output=text,
                command=kr.backend.name,
                log_path=str(path),
            )
        if problem is not None:
            cache.quarantine(entry, problem)
        if debug:
            log.info("ep_jit: cache miss %s; compiling", entry)
        meta = _build(cache, entry, source, name, kr)
    max_bytes = _env.cache_max_bytes()
    if max_bytes > 0:
        cache.evict(max_bytes, keep=entry)
    return Artifact(kr.key, entry / "kernel.cubin", False, name, meta)


def _build(cache: Cache, entry: Path, source: str, name: str, kr: KeyRecord) -> dict[str, Any]:
    build_dir = cache.new_build_dir(kr.key)
    keep = _env.keep_temps()
    try:
        (build_dir / "kernel.cu").write_text(source)
        t0 = time.perf_counter()
        try:
            out = kr.backend.compile(source, build_dir, kr.canonical_flags, keep_temps=keep)
        except CompileError as e:
            if disk_is_full(build_dir):  # the compiler could not write its output: say so, not "failed"
                raise JitError(
                    f"compiling {name}: no space left for the ep-jit cache {cache.root} (the compiler's output in "
                    f"{build_dir} could not be written); free space (`python -m ep_jit clear`) or set "
                    "EPKIT_JIT_CACHE_DIR to a directory with room"
                ) from e
            header = f"# ep_jit compile failure: {name} (key {kr.key})\n# command: {e.command}\n"
            try:
                e.log_path = str(cache.write_failure(name, kr.key, header + e.output))
                e.args = (f"{e.args[0]}\n(full compiler output saved in {e.log_path})",)
            except OSError:  # the compiler's error stays the one to report
                pass
            raise
        seconds = time.perf_counter() - t0
        if not is_cubin(out.cubin):
            if disk_is_full(build_dir):
                raise JitError(
                    f"compiling {name}: no space left for the ep-jit cache {cache.root} (the cubin in {build_dir} is "
                    f"truncated, {len(out.cubin)} bytes); free space (`python -m ep_jit clear`) or set "
                    "EPKIT_JIT_CACHE_DIR to a directory with room"
                )
            raise JitError(
                f"{kr.backend.name} produced no valid cubin for {name} (got {len(out.cubin)} bytes)"
            )
        (build_dir / "kernel.cubin").write_bytes(out.cubin)
        (build_dir / "compile.log").write_text(f"# {out.command}\n{out.log}")
        if out.ptx:
            (build_dir / "kernel.ptx").write_text(out.ptx)
        if out.sass:
            (build_dir / "kernel.sass").write_text(out.sass)
        meta = {
            "schema": kr.record["schema"],
            "name": name,
            "key": kr.key,
            "key_record": kr.record,
            "command": out.command,
            "compile_seconds": round(seconds, 4),
            "created": time.time(),
            "host": platform.node(),
            "cubin_sha256": hashlib.sha256(out.cubin).hexdigest(),
            "cubin_size": len(out.cubin),
            "kernels": kernel_names(out.cubin),
            "resources": out.resources,
        }
        (build_dir / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
        cache.publish(build_dir, entry)
    except OSError as e:  # writing the entry: a read-only or full cache, named with its path and remedy
        raise disk_error(cache.root, e, f"writing the cache entry of {name}") from e
    finally:
        if build_dir.exists():
            shutil.rmtree(build_dir, ignore_errors=True)
    log.info(
        "ep_jit: compiled %s in %.2f s (%s, %s, key %s)",
        name,
        seconds,
        kr.backend.name,
        kr.record["arch"],
        kr.key[:12],
    )
    if _env.ptxas_verbose():
        for kernel, res in sorted(out.resources.items()):
            log.info("ep_jit: %s: %s", kernel, ", ".join(f"{k}={v}" for k, v in sorted(res.items())))
    return meta
