"""A cache miss on a read-only cache directory or a full disk gives a JitError naming the cache path and the remedy
(EPKIT_JIT_CACHE_DIR), never a raw OSError or "no valid cubin" (issue 14, point 5).

Tests run as root, where chmod does not block writes: the OS calls are monkeypatched to fail instead."""

from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path

import ep_jit
import pytest
from ep_jit import _build, _cache
from ep_jit._compiler import NvccBackend

ARCH = "sm_90a"
KERNEL = 'extern "C" __global__ void k(int* x) { x[0] = 1; }\n'


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    try:
        NvccBackend.locate()
    except ep_jit.JitError as e:
        pytest.skip(f"nvcc not available: {e}")
    d = tmp_path / "cache"
    monkeypatch.setenv("EPKIT_JIT_CACHE_DIR", str(d))
    monkeypatch.delenv("EPKIT_JIT_ALWAYS_COMPILE", raising=False)
    ep_jit.clear_memo()
    yield d
    ep_jit.clear_memo()


def _source() -> str:
    return f"// {uuid.uuid4()}\n{KERNEL}"


def _fail_open_of(monkeypatch, suffix: str, code: int) -> None:
    real = os.open

    def fake(path, flags, *args, **kwargs):
        if str(path).endswith(suffix) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(code, os.strerror(code), str(path))
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake)


def test_read_only_cache_names_the_path_and_the_remedy(cache_dir, monkeypatch):
    (cache_dir / "locks").mkdir(parents=True)
    _fail_open_of(monkeypatch, ".lock", errno.EROFS)
    with pytest.raises(ep_jit.JitError) as info:
        ep_jit.compile(_source(), name="ro", arch=ARCH)
    text = str(info.value)
    assert not isinstance(info.value, OSError)
    assert str(cache_dir) in text and "not writable" in text and "EPKIT_JIT_CACHE_DIR" in text, text


def test_read_only_cache_dir_creation(cache_dir, monkeypatch):
    real = Path.mkdir

    def fake(self, *args, **kwargs):
        if str(self).startswith(str(cache_dir)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", fake)
    with pytest.raises(ep_jit.JitError, match=r"not writable.*EPKIT_JIT_CACHE_DIR"):
        ep_jit.compile(_source(), name="ro2", arch=ARCH)


def test_full_disk_while_writing_the_entry(cache_dir, monkeypatch):
    real = Path.write_bytes

    def fake(self, data):
        if self.name == "kernel.cubin":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", fake)
    with pytest.raises(ep_jit.JitError) as info:
        ep_jit.compile(_source(), name="full", arch=ARCH)
    text = str(info.value)
    assert "no space left" in text and str(cache_dir) in text and "kernel.cubin" in text, text
    assert "EPKIT_JIT_CACHE_DIR" in text


def test_full_disk_is_not_misreported_as_no_valid_cubin(cache_dir, monkeypatch):
    from ep_jit._compiler import CompileOutput

    def truncated(self, source, workdir, canonical, *, keep_temps):
        return CompileOutput(cubin=b"\x7fEL", log="", command="nvcc (test)", seconds=0.0)

    monkeypatch.setattr(NvccBackend, "compile", truncated)
    monkeypatch.setattr(_build, "disk_is_full", lambda path: True)
    with pytest.raises(ep_jit.JitError, match=r"no space left.*truncated.*EPKIT_JIT_CACHE_DIR") as info:
        ep_jit.compile(_source(), name="trunc", arch=ARCH)
    assert "no valid cubin" not in str(info.value)


def test_disk_error_messages():
    root = Path("/some/cache")
    ro = _cache.disk_error(
        root, OSError(errno.EROFS, "Read-only file system", "/some/cache/locks/x.lock"), "w"
    )
    assert "/some/cache/locks/x.lock" in str(ro) and "not writable" in str(ro)
    full = _cache.disk_error(root, OSError(errno.ENOSPC, "No space left on device"), "writing")
    assert "no space left" in str(full) and "python -m ep_jit clear" in str(full)
