"""ep_torch's host extension: `torch.empty` and a tensor's facts through torch's C++ API (issue 18).

Through torch's Python argument parser an allocation costs 2-6 us on the H200's host and a describe 1-3 us; the
extension (`csrc/host_extension.cpp`) makes each a single C call. It is built at first use with the host's C++
compiler against the imported torch (so it matches its ABI), once per torch version and source, cached under the
ep-jit cache (`host/`); `python -m ep_torch.host_extension` builds it ahead of time. `EPKIT_TORCH_HOST_EXTENSION`:
``auto`` (builds or loads it, else warns once and keeps the Python calls, which give the same tensors), ``0``,
``1`` (raises when it cannot be had). `status()` says which path runs and why.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
import warnings
from pathlib import Path
from types import ModuleType

import torch

from . import _env

__all__ = ["HostExtensionError", "build", "module", "status"]

_NAME = "ep_torch_host"
_SOURCE = Path(__file__).with_name("csrc") / "host_extension.cpp"
_LOCK_TIMEOUT_S = 600.0
_state: list[tuple[ModuleType | None, str]] = []
_lock = threading.Lock()


class HostExtensionError(RuntimeError):
    """The host extension could not be built or loaded (the message names the step and the build log)."""


def _torch_dir() -> Path:
    return Path(torch.__file__).resolve().parent


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise HostExtensionError(
            "no C++ compiler: set CXX or install g++ (the build needs torch's headers and one)"
        )
    return cxx


def _command(cxx: str, out: Path) -> list[str]:
    tdir = _torch_dir()
    includes = [tdir / "include", tdir / "include" / "torch" / "csrc" / "api" / "include"]
    abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))
    return [
        cxx,
        "-O2",
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{p}" for p in includes),
        f"-I{sysconfig.get_paths()['include']}",
        str(_SOURCE),
        "-o",
        str(out),
        f"-L{tdir / 'lib'}",
        f"-Wl,-rpath,{tdir / 'lib'}",
        "-ltorch_python",
        "-ltorch",
        "-ltorch_cpu",
        "-lc10",
    ]


def _key(cxx: str) -> str:
    """Everything the built module depends on: the source, the torch build, the Python ABI, the compiler."""
    h = hashlib.sha256(_SOURCE.read_bytes())
    for part in (
        torch.__version__,
        str(getattr(torch.version, "git_version", "")),
        str(_torch_dir()),
        sys.implementation.cache_tag,
        sysconfig.get_config_var("EXT_SUFFIX") or "",
        cxx,
    ):
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:20]


def _cache_root() -> Path:
    from ep_core import prebuild

    return prebuild.cache_root() / "host"


def _locked(path: Path) -> int:
    """An exclusive lock on `path`, waited for at most `_LOCK_TIMEOUT_S` (another process building the same key)."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    deadline = time.monotonic() + _LOCK_TIMEOUT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise HostExtensionError(
                    f"waited {_LOCK_TIMEOUT_S:.0f} s for {path} (another process building the host extension); "
                    "remove the file if no such process runs"
                ) from None
            time.sleep(0.2)


def build(*, quiet: bool = False) -> Path:
    """The built module's path, compiling it first if this torch and source have none cached. Raises
    `HostExtensionError` with the compiler's output (also kept in the entry's `build.log`)."""
    if not _SOURCE.is_file():
        raise HostExtensionError(f"source missing: {_SOURCE} (a broken ep-torch install)")
    cxx = _compiler()
    entry = _cache_root() / f"{_NAME}-{_key(cxx)}"
    target = entry / f"{_NAME}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
    if target.is_file():
        return target
    try:
        entry.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise HostExtensionError(
            f"cannot create {entry} ({exc.strerror or exc}); set EPKIT_JIT_CACHE_DIR to a writable directory"
        ) from exc
    fd = _locked(entry / "lock")
    try:
        if target.is_file():  # built by the process that held the lock
            return target
        failed = entry / "failed"
        if failed.is_file():  # every rank of a job would otherwise wait for the same failing build in turn
            raise HostExtensionError(
                f"{failed.read_text().strip()} (an earlier build; remove {entry} to retry)"
            )
        if not quiet:
            print(
                f"ep_torch: building the host extension against torch {torch.__version__} (once per torch version; "
                f"cached in {entry})",
                file=sys.stderr,
                flush=True,
            )
        tmp = entry / f"{_NAME}.{os.getpid()}.tmp.so"
        command = _command(cxx, tmp)
        started = time.monotonic()
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=_LOCK_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise HostExtensionError(f"running the compiler {cxx} failed: {exc}") from exc
        log = entry / "build.log"
        log.write_text(f"$ {' '.join(command)}\n{done.stdout}{done.stderr}")
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-12:])
            message = f"the compiler exited with {done.returncode} (full log: {log}):\n{tail}"
            failed.write_text(message)
            raise HostExtensionError(message)
        os.replace(tmp, target)
        if not quiet:
            print(
                f"ep_torch: host extension built in {time.monotonic() - started:.1f} s",
                file=sys.stderr,
                flush=True,
            )
        return target
    finally:
        os.close(fd)


def _import(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(_NAME, str(path))
    spec = importlib.util.spec_from_file_location(_NAME, path, loader=loader)
    if spec is None:
        raise HostExtensionError(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def _self_check(mod: ModuleType) -> None:
    """The module's answers on a CPU tensor equal torch's own (a mismatched build would be caught here)."""
    t = mod.empty((3, 5), torch.float32, -1)
    if type(t) is not torch.Tensor or t.shape != (3, 5) or t.dtype != torch.float32 or t.device.type != "cpu":
        raise HostExtensionError(f"empty((3, 5), float32, cpu) returned {t!r}")
    v = t[:, 1:]
    want = (v.dtype, tuple(v.shape), v.stride(), v.data_ptr(), -1)
    if mod.facts(v) != want or mod.facts(t.requires_grad_()) is not None:
        raise HostExtensionError(f"facts() disagrees with torch: {mod.facts(v)!r} != {want!r}")


def _load() -> tuple[ModuleType | None, str]:
    mode = _env.host_extension()
    if mode == "0":
        return None, "off (EPKIT_TORCH_HOST_EXTENSION=0): torch.empty and describe through torch's Python API"
    try:
        path = build()
        mod = _import(path)
        _self_check(mod)
    except Exception as exc:
        if mode == "1":
            if isinstance(exc, HostExtensionError):
                raise
            raise HostExtensionError(f"loading the host extension failed: {exc}") from exc
        warnings.warn(
            f"ep_torch: the host extension is unavailable, so each allocation and describe goes through torch's "
            f"Python API (same results, a few microseconds more host time each): {exc}. Set "
            "EPKIT_TORCH_HOST_EXTENSION=0 to choose that silently, or =1 to make this an error",
            RuntimeWarning,
            stacklevel=3,
        )
        return None, f"Python fallback: {exc}"
    return mod, f"built against torch {torch.__version__}: {path}"


def module() -> ModuleType | None:
    """The loaded extension, or None where `EPKIT_TORCH_HOST_EXTENSION` or a failure (warned once) leaves the
    Python calls. Decided once per process; the first call may build it."""
    if _state:
        return _state[0][0]
    with _lock:
        if not _state:
            _state.append(_load())
    return _state[0][0]


def status() -> str:
    """Which path this process takes, and why (`module`)."""
    module()
    return _state[0][1]


if __name__ == "__main__":
    print(build())
    print(status())
