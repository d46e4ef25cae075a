"""The on-disk cache: one directory per key, published atomically, verified by checksum, LRU-capped.

Layout under the root (``EPKIT_JIT_CACHE_DIR``, default ``~/.cache/ep/jit``)::

    entries/<name>.<key>/   kernel.cu, kernel.cubin, meta.json, compile.log [, kernel.ptx, kernel.sass]
    locks/<key>.lock        one OS file lock per key (flock; the kernel releases it when the holder dies)
    tmp/                    build directories, renamed into entries/ when complete
    failed/<name>.<key>.log the compiler output of the last failed build of a key

An entry directory appears whole (rename of a complete, fsynced directory), so readers trust any
entry whose cubin matches the sha256 in its meta.json; anything else is corrupt and rebuilt.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import filelock

from ._errors import JitError

__all__ = ["Cache", "CacheCorruptionWarning", "EntryInfo", "disk_error", "disk_is_full", "file_lock"]

log = logging.getLogger("ep_jit")

SCHEMA_VERSION = 1
_STALE_TMP_SECONDS = 3600
_NAME_SAFE = re.compile(r"[^A-Za-z0-9_\-]+")


class CacheCorruptionWarning(UserWarning):
    """A cache entry failed verification (checksum mismatch, missing file) and is being rebuilt."""


@dataclass(frozen=True)
class EntryInfo:
    """One entry of the cache, as listed by ``python -m ep_jit list``."""

    path: Path
    name: str
    key: str
    size_bytes: int
    last_used: float
    meta: dict[str, Any]


_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)
_FULL = (errno.ENOSPC, errno.EDQUOT)


def disk_error(root: Path, e: OSError, what: str) -> JitError:
    """A `JitError` for an OS error of the cache's file system: it names the path, the cause and the remedy
    (`EPKIT_JIT_CACHE_DIR`) instead of a bare `OSError` (issue 14: read-only cache, full disk)."""
    where = f"{what} {e.filename}" if e.filename else what
    if e.errno in _READ_ONLY:
        return JitError(
            f"the ep-jit cache directory {root} is not writable ({where}: {e.strerror or e}); set "
            "EPKIT_JIT_CACHE_DIR to a writable directory on a local file system"
        )
    if e.errno in _FULL:
        return JitError(
            f"no space left for the ep-jit cache {root} ({where}: {e.strerror or e}); free space on that file "
            "system (`python -m ep_jit clear` empties the cache) or set EPKIT_JIT_CACHE_DIR to a directory with room"
        )
    return JitError(
        f"the ep-jit cache {root} failed ({where}: {e.strerror or e}); set EPKIT_JIT_CACHE_DIR to a working "
        "local directory"
    )


def disk_is_full(path: Path) -> bool:
    """True when the file system of `path` has no free block left for this user (a compiler writing its output
    there then leaves a truncated file)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < (1 << 20)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _dir_size(path: Path) -> int:
    total = 0
    with contextlib.suppress(OSError):
        for child in path.iterdir():
            with contextlib.suppress(OSError):
                total += child.stat().st_size
    return total


def _sha256_file(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# One in-process lock per key path: filelock's locks are per file descriptor, threads of one process
# must also be serialized.
_thread_locks: dict[str, threading.Lock] = {}
_thread_locks_guard = threading.Lock()


def _thread_lock(path: str) -> threading.Lock:
    with _thread_locks_guard:
        lock = _thread_locks.get(path)
        if lock is None:
            lock = _thread_locks[path] = threading.Lock()
        return lock


def file_lock(path: Path, timeout: float) -> filelock.BaseFileLock:
    """An OS file lock (flock on Linux) not tied to the creating thread."""
    try:
        return filelock.FileLock(str(path), timeout=timeout, thread_local=False)
    except TypeError:  # filelock < 3.12
        return filelock.FileLock(str(path), timeout=timeout)


class Cache:
    """The cache rooted at ``root``. Cheap to construct; creates its directories lazily."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.entries = self.root / "entries"
        self.locks = self.root / "locks"
        self.tmp = self.root / "tmp"
        self.failed = self.root / "failed"

    # --- paths -------------------------------------------------------------------------------------
    @staticmethod
    def entry_name(name: str, key: str) -> str:
        safe = _NAME_SAFE.sub("_", name).strip("_")[:48] or "kernel"
        return f"{safe}.{key}"

    def entry_dir(self, name: str, key: str) -> Path:
        return self.entries / self.entry_name(name, key)

    def lock_path(self, key: str) -> Path:
        return self.locks / f"{key}.lock"

    def ensure_dirs(self) -> None:
        try:
            for d in (self.entries, self.locks, self.tmp, self.failed):
                d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            if e.errno in _READ_ONLY + _FULL:
                raise disk_error(self.root, e, "creating the cache directories") from e
            raise JitError(
                f"cannot create the ep-jit cache under {self.root} ({e.strerror or e}); set EPKIT_JIT_CACHE_DIR to a "
                "writable directory on a local file system"
            ) from e

    # --- verification ------------------------------------------------------------------------------
    def verify(self, entry: Path) -> tuple[dict[str, Any] | None, str | None]:
        """``(meta, None)`` for a sound entry, ``(None, None)`` when absent, ``(None, reason)`` when corrupt."""
        meta_path = entry / "meta.json"
        try:
            meta_text = meta_path.read_text()
        except FileNotFoundError:
            return (None, "meta.json is missing") if entry.exists() else (None, None)
        except OSError as e:
            return None, f"meta.json unreadable: {e}"
        try:
            meta = json.loads(meta_text)
            expected = meta["cubin_sha256"]
            expected_size = meta["cubin_size"]
        except (ValueError, KeyError, TypeError) as e:
            return None, f"meta.json is malformed ({type(e).__name__}: {e})"
        cubin = entry / "kernel.cubin"
        try:
            size = cubin.stat().st_size
        except OSError:
            return None, "kernel.cubin is missing"
        if size != expected_size:
            return None, f"kernel.cubin has {size} bytes, meta.json says {expected_size}"
        if _sha256_file(cubin) != expected:
            return None, "kernel.cubin does not match its sha256 in meta.json"
        return meta, None

    def touch(self, entry: Path) -> None:
        """Mark an entry as used now (LRU order); explicit because relatime/noatime mounts would not."""
        with contextlib.suppress(OSError):
            os.utime(entry)

    # --- locking -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def key_lock(self, key: str, timeout: float, what: str = "") -> Iterator[None]:
        """Exclusive build right for ``key`` among threads and processes (flock on locks/<key>.lock)."""
        self.ensure_dirs()
        path = self.lock_path(key)
        tlock = _thread_lock(str(path))
        if not tlock.acquire(timeout=timeout if timeout >= 0 else -1):
            raise JitError(f"timed out after {timeout} s waiting for another thread building {path.name}")
        try:
            flock = file_lock(path, timeout)
            try:
                try:
                    flock.acquire(timeout=0)
                except filelock.Timeout:
                    log.info(
                        "ep_jit: waiting for another process building %s (lock %s)", what or key[:12], path
                    )
                    flock.acquire()
            except OSError as e:  # a read-only cache (the lock file cannot be created) or a full disk
                if not e.filename:
                    e.filename = str(path)
                raise disk_error(self.root, e, "creating the build lock") from e
            except filelock.Timeout:
                raise JitError(
                    f"timed out after {timeout} s waiting for the build lock {path} held by another process; "
                    "if no ep-jit build is running, raise EPKIT_JIT_LOCK_TIMEOUT or check the file system "
                    "supports flock (NFS may not)"
                ) from None
            try:
                yield
            finally:
                flock.release()
        finally:
            tlock.release()

    # --- publishing --------------------------------------------------------------------------------
    def new_build_dir(self, key: str) -> Path:
        self.ensure_dirs()
        d = self.tmp / f"build.{key[:16]}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        try:
            d.mkdir()
        except OSError as e:
            raise disk_error(self.root, e, "creating a build directory") from e
        return d

    def publish(self, build_dir: Path, entry: Path) -> None:
        """fsync every file of ``build_dir`` and the directory, then rename it to ``entry`` (call under the lock)."""
        for child in build_dir.iterdir():
            _fsync_file(child)
        _fsync_dir(build_dir)
        if entry.exists():
            self.discard(entry)
        os.rename(build_dir, entry)
        _fsync_dir(self.entries)

    def discard(self, path: Path) -> None:
        """Remove a directory atomically from readers' view (rename aside, then delete)."""
        aside = self.tmp / f"discard.{path.name[:60]}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return
        except OSError:
            aside = path
        shutil.rmtree(aside, ignore_errors=True)

    def quarantine(self, entry: Path, reason: str) -> None:
        msg = f"ep_jit: cache entry {entry} is corrupt ({reason}); rebuilding it"
        warnings.warn(msg, CacheCorruptionWarning, stacklevel=4)
        log.warning(msg)
        self.discard(entry)

    def write_failure(self, name: str, key: str, text: str) -> Path:
        self.ensure_dirs()
        path = self.failed / f"{self.entry_name(name, key)}.log"
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
        return path

    def recent_failure(self, name: str, key: str, since: float) -> tuple[Path, str] | None:
        """The failure log of ``key`` if one was written after ``since`` (another builder failed meanwhile)."""
        path = self.failed / f"{self.entry_name(name, key)}.log"
        try:
            if path.stat().st_mtime >= since:
                return path, path.read_text()
        except OSError:
            return None
        return None

    # --- listing, eviction, clearing ---------------------------------------------------------------
    def list_entries(self) -> list[EntryInfo]:
        out = []
        try:
            children = list(self.entries.iterdir())
        except FileNotFoundError:
            return []
        for child in children:
            if not child.is_dir():
                continue
            name, _, key = child.name.rpartition(".")
            try:
                meta = json.loads((child / "meta.json").read_text())
            except (OSError, ValueError):
                meta = {}
            try:
                last_used = child.stat().st_mtime
            except OSError:
                continue
            out.append(EntryInfo(child, name, key, _dir_size(child), last_used, meta))
        out.sort(key=lambda e: e.last_used)
        return out

    def total_bytes(self) -> int:
        return sum(e.size_bytes for e in self.list_entries())

    def evict(self, max_bytes: int, keep: Path | None = None) -> list[Path]:
        """Remove least recently used entries until the cache holds at most ``max_bytes``.

        Entries whose lock is held (being rebuilt) are skipped; ``keep`` (the entry just built) stays.
        """
        if max_bytes <= 0:
            return []
        entries = self.list_entries()
        total = sum(e.size_bytes for e in entries)
        removed: list[Path] = []
        for e in entries:
            if total <= max_bytes:
                break
            if keep is not None and e.path == keep:
                continue
            flock = file_lock(self.lock_path(e.key), 0)
            try:
                flock.acquire()
            except filelock.Timeout:
                continue
            try:
                self.discard(e.path)
            finally:
                flock.release()
            total -= e.size_bytes
            removed.append(e.path)
            log.debug("ep_jit: evicted %s (%d bytes)", e.path.name, e.size_bytes)
        self.sweep_tmp()
        return removed

    def sweep_tmp(self, older_than: float = _STALE_TMP_SECONDS) -> int:
        """Delete build/discard directories left over by dead processes (older than ``older_than`` s)."""
        count = 0
        now = time.time()
        try:
            children = list(self.tmp.iterdir())
        except FileNotFoundError:
            return 0
        for child in children:
            with contextlib.suppress(OSError):
                if now - child.stat().st_mtime >= older_than:
                    if child.is_dir():
                        shutil.rmtree(child, ignore_errors=True)
                    else:
                        child.unlink()
                    count += 1
        return count

    def clear(self) -> tuple[int, int]:
        """Remove every entry not being built right now, failure logs and stale temps; ``(entries, bytes)``.

        Lock files are kept: deleting a lock file another process waits on would break mutual exclusion.
        """
        n = size = 0
        for e in self.list_entries():
            flock = file_lock(self.lock_path(e.key), 0)
            try:
                flock.acquire()
            except filelock.Timeout:
                continue
            try:
                self.discard(e.path)
            finally:
                flock.release()
            n += 1
            size += e.size_bytes
        shutil.rmtree(self.failed, ignore_errors=True)
        self.sweep_tmp(older_than=0 if not self._builds_in_progress() else _STALE_TMP_SECONDS)
        return n, size

    def _builds_in_progress(self) -> bool:
        try:
            return any(c.name.startswith("build.") for c in self.tmp.iterdir())
        except FileNotFoundError:
            return False
