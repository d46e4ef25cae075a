"""Compiler backends: nvcc (a subprocess, default) and NVRTC (in process, through cuda.bindings.nvrtc).

A backend turns one source text into a cubin in a work directory. It knows its own identity
(path + full version), which goes into the cache key, and how to spell the canonical flags.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from . import _env
from ._errors import CompileError, JitError

__all__ = ["Backend", "CompileOutput", "NvccBackend", "NvrtcBackend", "get_backend", "normalize_arch"]

DEFAULT_NVCC_FLAGS = ("-std=c++17", "-O3", "--expt-relaxed-constexpr")
DEFAULT_NVRTC_FLAGS = ("-std=c++17",)

_ARCH_RE = re.compile(r"^(?:sm_)?(\d{2,3})([af]?)$")


def normalize_arch(arch: str) -> str:
    """``"sm_90a"``, ``"90a"``, ``"sm_80"`` -> ``"sm_90a"``/``"sm_80"``; anything else is a ValueError."""
    m = _ARCH_RE.match(arch.strip().lower())
    if not m:
        raise ValueError(f"arch: expected a real GPU architecture such as 'sm_90a' or 'sm_80', got {arch!r}")
    return f"sm_{m.group(1)}{m.group(2)}"


@dataclass
class CompileOutput:
    """What one compile produced: the cubin, the compiler's log and the exact command."""

    cubin: bytes
    log: str
    command: str
    seconds: float
    ptx: str | None = None
    sass: str | None = None
    resources: dict[str, dict[str, int]] = field(default_factory=dict)


_PTXAS_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PTXAS_FUNC = re.compile(r"Function properties for (\S+)")
_PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse_ptxas_resources(log: str) -> dict[str, dict[str, int]]:
    """Per-entry ``registers``, ``smem_bytes``, ``stack_bytes``, ``spill_stores``, ``spill_loads`` from ``-v`` output."""
    out: dict[str, dict[str, int]] = {}
    current: str | None = None
    props_for: str | None = None
    for line in log.splitlines():
        m = _PTXAS_ENTRY.search(line)
        if m:
            current = m.group(1)
            out.setdefault(current, {})
            continue
        m = _PTXAS_FUNC.search(line)
        if m:
            props_for = m.group(1)
            continue
        m = _PTXAS_FRAME.search(line)
        if m and props_for is not None and props_for in out:
            out[props_for].update(
                stack_bytes=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3))
            )
            continue
        m = _PTXAS_USED.search(line)
        if m and current is not None:
            out[current]["registers"] = int(m.group(1))
            if m.group(2):
                out[current]["smem_bytes"] = int(m.group(2))
    return out


def _overridden(defaults: Sequence[str], flags: Sequence[str]) -> list[str]:
    """Default flags the user did not replace (same option family: -std=, -O)."""
    kept = []
    for d in defaults:
        family = d.split("=")[0] if "=" in d else d[:2]
        if family == "-O":
            clash = any(f.startswith("-O") and not f.startswith("-Ofast") for f in flags)
        else:
            clash = any(f == d or f.startswith(family + "=") for f in flags)
        if not clash:
            kept.append(d)
    return kept


class Backend:
    """A compiler. ``identity()`` is stable for a given installation and part of every key."""

    name = "base"

    def identity(self) -> str:
        raise NotImplementedError

    def canonical_flags(
        self, *, arch: str, include_flags: Sequence[str], define_flags: Sequence[str], flags: Sequence[str]
    ) -> list[str]:
        raise NotImplementedError

    def compile(self, source: str, workdir: Path, canonical: list[str], *, keep_temps: bool) -> CompileOutput:
        raise NotImplementedError


class NvccBackend(Backend):
    """``nvcc --cubin``: run with no shell, in a fresh work directory (so no cwd file shadows a header)."""

    name = "nvcc"
    _identity_cache: ClassVar[dict[tuple[str, int, int], str]] = {}

    def __init__(self, path: str) -> None:
        self.path = path

    @classmethod
    def locate(cls) -> NvccBackend:
        candidates: list[tuple[str, str]] = []
        override = _env.nvcc_override()
        if override:
            candidates.append(("EPKIT_JIT_NVCC", override))
        else:
            home = _env.cuda_home()
            if home:
                candidates.append(("CUDA_HOME", str(Path(home) / "bin" / "nvcc")))
            found = shutil.which("nvcc")
            if found:
                candidates.append(("PATH", found))
        for _origin, path in candidates:
            if os.path.isfile(path) and os.access(path, os.X_OK):
                return cls(os.path.realpath(path) if _origin != "EPKIT_JIT_NVCC" else os.path.abspath(path))
        tried = (
            ", ".join(f"{o}: {p}" for o, p in candidates)
            or "nothing (EPKIT_JIT_NVCC, CUDA_HOME unset; no nvcc on PATH)"
        )
        raise JitError(
            f"nvcc not found (tried {tried}); set EPKIT_JIT_NVCC to the nvcc binary, install the CUDA toolkit, "
            "or use backend='nvrtc'"
        )

    def identity(self) -> str:
        st = os.stat(self.path)
        cache_key = (self.path, st.st_mtime_ns, st.st_size)
        ident = self._identity_cache.get(cache_key)
        if ident is None:
            try:
                proc = subprocess.run([self.path, "--version"], capture_output=True, text=True, timeout=120)
            except OSError as e:
                raise JitError(f"cannot run {self.path} --version: {e}") from e
            if proc.returncode != 0:
                raise JitError(
                    f"{self.path} --version failed (exit {proc.returncode}): {proc.stderr.strip()}"
                )
            ident = f"nvcc {self.path}\n{proc.stdout.strip()}"
            self._identity_cache[cache_key] = ident
        return ident

    def canonical_flags(
        self, *, arch: str, include_flags: Sequence[str], define_flags: Sequence[str], flags: Sequence[str]
    ) -> list[str]:
        return [
            f"-arch={arch}",
            *_overridden(DEFAULT_NVCC_FLAGS, flags),
            *define_flags,
            *include_flags,
            *flags,
        ]

    def compile(self, source: str, workdir: Path, canonical: list[str], *, keep_temps: bool) -> CompileOutput:
        src = workdir / "kernel.cu"
        cubin = workdir / "kernel.cubin"
        cmd = [self.path, "--cubin", *canonical, "-Xptxas", "-v", "-o", str(cubin), str(src)]
        keep_dir = workdir / "keep"
        if keep_temps:
            keep_dir.mkdir()
            cmd[1:1] = ["--keep", "--keep-dir", str(keep_dir)]
        command = shlex.join(cmd)
        if _env.debug():
            import logging

            logging.getLogger("ep_jit").info("ep_jit: running %s", command)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        except OSError as e:
            raise CompileError(f"cannot run nvcc ({self.path}): {e}", command=command) from e
        seconds = time.perf_counter() - t0
        log = (proc.stdout or "") + (proc.stderr or "")
        if proc.returncode != 0 or not cubin.is_file():
            raise CompileError(
                f"nvcc failed (exit {proc.returncode}) compiling {src.name}:\n{log.strip()}\ncommand: {command}",
                output=log,
                command=command,
            )
        ptx = sass = None
        if keep_temps:
            ptx_files = sorted(keep_dir.glob("*.ptx"))
            ptx = ptx_files[0].read_text() if ptx_files else None
            sass = _disassemble(self.path, cubin)
            shutil.rmtree(keep_dir, ignore_errors=True)
        return CompileOutput(
            cubin=cubin.read_bytes(),
            log=log,
            command=command,
            seconds=seconds,
            ptx=ptx,
            sass=sass,
            resources=parse_ptxas_resources(log),
        )


def _disassemble(nvcc_path: str, cubin: Path) -> str | None:
    tool = Path(nvcc_path).with_name("cuobjdump")
    path = str(tool) if tool.is_file() else shutil.which("cuobjdump")
    if not path:
        return None
    proc = subprocess.run([path, "-sass", str(cubin)], capture_output=True, text=True)
    return proc.stdout if proc.returncode == 0 else None


class NvrtcBackend(Backend):
    """NVRTC through ``cuda.bindings.nvrtc``; the library is found by cuda.pathfinder."""

    name = "nvrtc"
    _identity: str | None = None

    @classmethod
    def locate(cls) -> NvrtcBackend:
        cls._load()
        return cls()

    @staticmethod
    def _load():
        try:
            from cuda.bindings import nvrtc
            from cuda.pathfinder import load_nvidia_dynamic_lib

            lib = load_nvidia_dynamic_lib("nvrtc")
        except Exception as e:
            raise JitError(
                f"NVRTC is not available ({type(e).__name__}: {e}); install the nvidia-cuda-nvrtc wheel or a CUDA "
                "toolkit that cuda.pathfinder can find (CUDA_HOME), or use backend='nvcc'"
            ) from e
        return nvrtc, lib

    def identity(self) -> str:
        if NvrtcBackend._identity is None:
            nvrtc, lib = self._load()
            err, major, minor = nvrtc.nvrtcVersion()
            _check_nvrtc(nvrtc, err, "nvrtcVersion")
            NvrtcBackend._identity = f"nvrtc {major}.{minor} {lib.abs_path}"
        return NvrtcBackend._identity

    def canonical_flags(
        self, *, arch: str, include_flags: Sequence[str], define_flags: Sequence[str], flags: Sequence[str]
    ) -> list[str]:
        translated = [f for f in flags if not f.startswith("-O")]  # NVRTC optimizes by default
        return [
            f"--gpu-architecture={arch}",
            *_overridden(DEFAULT_NVRTC_FLAGS, translated),
            *define_flags,
            *include_flags,
            *(f"-I{d}" for d in self.toolkit_include_dirs()),
            *translated,
        ]

    @staticmethod
    def toolkit_include_dirs() -> list[str]:
        """The CUDA runtime and CCCL header directories (cooperative_groups.h, cuda/std/...) found by
        cuda.pathfinder; NVRTC has no default search path. Their paths, not contents, enter the key."""
        try:
            from cuda.pathfinder import find_nvidia_header_directory
        except ImportError:
            return []
        dirs = []
        for lib in ("cccl", "cudart"):
            try:
                found = find_nvidia_header_directory(lib)
            except Exception:
                found = None
            if found and found not in dirs:
                dirs.append(str(found))
        return dirs

    def compile(self, source: str, workdir: Path, canonical: list[str], *, keep_temps: bool) -> CompileOutput:
        nvrtc, _lib = self._load()
        options = [*canonical, "--ptxas-options=-v"]
        command = "nvrtc " + shlex.join(options)
        t0 = time.perf_counter()
        err, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"kernel.cu", 0, [], [])
        _check_nvrtc(nvrtc, err, "nvrtcCreateProgram")
        try:
            opts = [o.encode() for o in options]
            (result,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
            err, log_size = nvrtc.nvrtcGetProgramLogSize(prog)
            _check_nvrtc(nvrtc, err, "nvrtcGetProgramLogSize")
            log_buf = b" " * log_size
            (err,) = nvrtc.nvrtcGetProgramLog(prog, log_buf)
            log = log_buf.rstrip(b"\0 ").decode(errors="replace")
            if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
                raise CompileError(
                    f"NVRTC failed ({result.name}) compiling kernel.cu:\n{log.strip()}\noptions: {command}",
                    output=log,
                    command=command,
                )
            err, size = nvrtc.nvrtcGetCUBINSize(prog)
            _check_nvrtc(nvrtc, err, "nvrtcGetCUBINSize")
            cubin = b" " * size
            (err,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
            _check_nvrtc(nvrtc, err, "nvrtcGetCUBIN")
            ptx = None
            if keep_temps:
                err, psize = nvrtc.nvrtcGetPTXSize(prog)
                if err == nvrtc.nvrtcResult.NVRTC_SUCCESS and psize:
                    pbuf = b" " * psize
                    nvrtc.nvrtcGetPTX(prog, pbuf)
                    ptx = pbuf.rstrip(b"\0").decode(errors="replace")
        finally:
            nvrtc.nvrtcDestroyProgram(prog)
        seconds = time.perf_counter() - t0
        return CompileOutput(
            cubin=bytes(cubin),
            log=log,
            command=command,
            seconds=seconds,
            ptx=ptx,
            resources=parse_ptxas_resources(log),
        )


def _check_nvrtc(nvrtc, err, what: str) -> None:
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise JitError(f"{what} failed: {getattr(err, 'name', err)}")


def get_backend(name: str | None) -> Backend:
    """The backend called ``name`` (``nvcc``/``nvrtc``), or the EPKIT_JIT_BACKEND default."""
    chosen = (name or _env.backend()).strip().lower()
    if chosen == "nvcc":
        return NvccBackend.locate()
    if chosen == "nvrtc":
        return NvrtcBackend.locate()
    raise ValueError(f"backend: expected 'nvcc' or 'nvrtc', got {chosen!r}")
