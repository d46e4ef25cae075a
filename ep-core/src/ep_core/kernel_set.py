"""A set of ``extern "C"`` kernels compiled as one ep_jit module and launched by name with checked arguments.

V1 low-latency mode has two such sets (`ll_pack`: the adapter's packing kernels, `ll_native`: its own kernels over
symmetric memory). Each is one configuration (sizes and options are kernel arguments), described by a signature
string per kernel: ``p`` a device address (an int, None for null), ``i`` an int32. `KernelSet.args` checks the count
and ranges against it before anything reaches the driver; a CPU test compares the strings with the headers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ep_core.errors import EPValueError

__all__ = ["KernelSet"]


class KernelSet:
    """Kernels ``signatures`` (name -> parameter codes, in order) of the translation unit ``source``, compiled with
    ``defines`` (and ``include_dirs()``, default ep-core's include directory) under the ep_jit cache name ``name``;
    loaded once per device."""

    def __init__(
        self,
        name: str,
        source: str,
        signatures: Mapping[str, str],
        defines: Mapping[str, int],
        include_dirs: Callable[[], Sequence[str]] | None = None,
    ) -> None:
        self.name, self.source = name, source
        self._include_dirs = include_dirs  # None: ep-core's include directory
        self.signatures, self.defines = dict(signatures), dict(defines)
        self.kernel_names = tuple(self.signatures)
        self._functions: dict[int, dict[str, Any]] = {}  # device ordinal -> kernel name -> loaded function
        self._lock = threading.Lock()

    def compile(self, arch: str | None = None, *, headers: tuple[str, str] | None = None) -> Any:
        """Compile (or fetch from ep_jit's cache); returns the ep_jit Artifact. `headers`: as
        `kernels._source.compile_kernels`'s (another tree's ep-core and ep-layout include directories)."""
        import ep_jit

        from ep_core.kernels._source import get_include

        return ep_jit.compile(
            self.source,
            name=self.name,
            include_dirs=list(headers)
            if headers is not None
            else (list(self._include_dirs()) if self._include_dirs else [get_include()]),
            defines=self.defines,
            arch=arch,
            flags=("-std=c++17",),
        )

    def function(self, device: int, name: str) -> Any:
        fns = self._functions.get(device)
        if fns is None:
            import ep_jit

            with self._lock:
                fns = self._functions.get(device)
                if fns is None:
                    module = ep_jit.load(self.compile())
                    fns = {n: module.function(n) for n in self.kernel_names}
                    self._functions[device] = fns
        return fns[name]

    def load(self, device: int) -> None:
        """Load every kernel on ``device`` now (compiling on first use). Launches load them anyway; call this first
        where a load must not happen later: several ranks of one process whose kernels wait for each other (a load,
        or CUDA's lazy loading of a function, may wait for the kernels already running, which wait for a rank not
        yet launched)."""
        for name in self.kernel_names:
            self.function(int(device), name)

    def args(self, name: str, values: Sequence[Any]) -> list[Any]:
        """The ep_jit arguments of ``values`` by the kernel's signature (addresses: ints or None)."""
        import ep_jit

        sig = self.signatures.get(name)
        if sig is None:
            raise EPValueError(f"kernel: expected one of {self.kernel_names}, got {name!r}")
        if len(values) != len(sig):
            raise EPValueError(f"{name}: expected {len(sig)} arguments ({sig}), got {len(values)}")
        out: list[Any] = []
        for pos, (code, v) in enumerate(zip(sig, values)):
            if code == "p":
                out.append(ep_jit.pointer(0 if v is None else int(v)))
            else:
                if isinstance(v, bool):
                    v = int(v)
                if not isinstance(v, int) or not -(1 << 31) <= v < (1 << 31):
                    raise EPValueError(f"{name}: argument {pos} must be an int32, got {v!r}")
                out.append(ep_jit.int32(v))
        return out

    def launch(
        self,
        name: str,
        grid: int | tuple[int, ...],
        block: int,
        values: Sequence[Any],
        *,
        device: int,
        stream: int,
        shared_mem: int = 0,
    ) -> None:
        """Queue kernel ``name`` on ``stream`` (a raw CUDA stream handle) of ``device`` (the ordinal whose context
        is current); ``values`` in the order of its signature (device addresses as ints, None for null)."""
        args = self.args(name, values)
        self.function(int(device), name).launch(
            grid, block, args, shared_mem=int(shared_mem), stream=int(stream)
        )
