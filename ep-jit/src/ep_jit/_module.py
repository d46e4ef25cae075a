"""Loaded cubins (:class:`Module`) and their kernels (:class:`Kernel`), launched with ``cuLaunchKernelEx``."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._args import ArgLayout, build_signature, describe
from ._build import Artifact
from ._cubin import is_cubin, kernel_names
from ._driver import check, driver, ensure_context
from ._errors import JitError, LaunchError

__all__ = ["Kernel", "Module", "load", "stream_handle"]

_DEFAULT_SMEM_LIMIT = 48 * 1024


def stream_handle(stream: Any) -> int:
    """The ``CUstream`` handle of an int, None, a ``CUstream``, an object with ``.cuda_stream`` (torch),
    ``.ptr`` (CuPy) or the ``__cuda_stream__`` protocol."""
    if stream is None:
        return 0
    if isinstance(stream, int):
        return stream
    handle = getattr(stream, "cuda_stream", None)
    if handle is not None:
        return int(handle)
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        return int(proto()[1])
    ptr = getattr(stream, "ptr", None)
    if isinstance(ptr, int):
        return ptr
    try:
        return int(stream)
    except (TypeError, ValueError):
        raise TypeError(
            f"stream: expected an int handle, a cuda.bindings CUstream, a torch.cuda.Stream or an object with "
            f"__cuda_stream__, got {type(stream).__name__}"
        ) from None


def _dim3(value: Any, what: str) -> tuple[int, int, int]:
    if isinstance(value, int):
        dims = (value, 1, 1)
    else:
        dims = tuple(int(v) for v in value)
        if not 1 <= len(dims) <= 3:
            raise ValueError(f"{what}: expected an int or 1 to 3 ints, got {value!r}")
        dims = dims + (1,) * (3 - len(dims))
    if any(d < 1 for d in dims):
        raise ValueError(f"{what}: every dimension must be >= 1, got {value!r}")
    return dims  # type: ignore[return-value]


class Kernel:
    """One ``__global__`` function of a loaded module, bound to the context current when it was looked up."""

    __slots__ = (
        "_configs",
        "_func",
        "_launch",
        "_layouts",
        "_lock",
        "_smem_optin",
        "module",
        "name",
        "param_sizes",
    )

    def __init__(self, func: Any, name: str, module: Module) -> None:
        drv = driver()
        self._func = func
        self.name = name
        self.module = module
        self._launch = drv.cuLaunchKernelEx
        self._configs: dict[tuple, Any] = {}
        self._layouts: dict[tuple, ArgLayout] = {}
        self._lock = threading.Lock()
        self._smem_optin: int | None = (
            None  # dynamic bytes usable without opting in (48 KiB minus the static part)
        )
        self.param_sizes = self._query_param_sizes()

    def __repr__(self) -> str:
        return f"<ep_jit.Kernel {self.name} of {self.module.path.name}>"

    def _query_param_sizes(self) -> tuple[int, ...] | None:
        drv = driver()
        fn = getattr(drv, "cuFuncGetParamInfo", None)
        if fn is None:
            return None
        sizes = []
        for i in range(4096):
            try:
                res = fn(self._func, i)
            except Exception:
                return None
            if res[0] == drv.CUresult.CUDA_ERROR_INVALID_VALUE:
                break
            if res[0]:
                return None  # not supported by this driver
            sizes.append(int(res[2]))
        return tuple(sizes)

    # --- attributes --------------------------------------------------------------------------------
    def attribute(self, name: str) -> int:
        """``cuFuncGetAttribute`` by short name, e.g. ``"num_regs"``, ``"max_threads_per_block"``."""
        drv = driver()
        enum = getattr(drv.CUfunction_attribute, f"CU_FUNC_ATTRIBUTE_{name.upper()}", None)
        if enum is None:
            raise ValueError(f"attribute: unknown function attribute {name!r}")
        return int(check(drv.cuFuncGetAttribute(enum, self._func), f"cuFuncGetAttribute({name})"))

    def max_active_blocks_per_sm(self, block: int | Sequence[int], shared_mem: int = 0) -> int:
        """Occupancy: resident blocks per SM for this block size and dynamic shared memory."""
        drv = driver()
        threads = 1
        for d in _dim3(block, "block"):
            threads *= d
        self._opt_in_smem(shared_mem)
        return int(
            check(
                drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(self._func, threads, shared_mem),
                "cuOccupancyMaxActiveBlocksPerMultiprocessor",
            )
        )

    def _opt_in_smem(self, shared_mem: int) -> None:
        # the 48 KiB default bounds static + dynamic shared memory together: a kernel with a static part must opt in
        # below 48 KiB of dynamic memory already (else its occupancy is 0 and its launch fails)
        if self._smem_optin is None:
            self._smem_optin = max(0, _DEFAULT_SMEM_LIMIT - self.attribute("shared_size_bytes"))
        if shared_mem > self._smem_optin:
            drv = driver()
            attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            err = drv.cuFuncSetAttribute(self._func, attr, shared_mem)[0]
            if err:
                static = self.attribute("shared_size_bytes")
                raise LaunchError(
                    f"{self.name}: cannot opt in to {shared_mem} bytes of dynamic shared memory "
                    f"(static {static} bytes; the device allows at most its "
                    f"MAX_SHARED_MEMORY_PER_BLOCK_OPTIN per block in total): {err!r}"
                )
            self._smem_optin = shared_mem

    # --- launch ------------------------------------------------------------------------------------
    def _config(
        self,
        grid: Any,
        block: Any,
        shared_mem: int,
        stream: int,
        cooperative: bool,
        cluster_dim: Any,
        pdl: bool,
    ) -> Any:
        drv = driver()
        g = _dim3(grid, "grid")
        b = _dim3(block, "block")
        if not isinstance(shared_mem, int) or shared_mem < 0:
            raise ValueError(f"shared_mem: expected a byte count >= 0, got {shared_mem!r}")
        with self._lock:
            self._opt_in_smem(shared_mem)
        cfg = drv.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = g
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = b
        cfg.sharedMemBytes = shared_mem
        cfg.hStream = stream
        ids = drv.CUlaunchAttributeID
        attrs = []
        if cooperative:
            a = drv.CUlaunchAttribute()
            a.id = ids.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
            a.value.cooperative = 1
            attrs.append(a)
        if cluster_dim is not None:
            c = _dim3(cluster_dim, "cluster_dim")
            for i, (gd, cd) in enumerate(zip(g, c)):
                if gd % cd:
                    raise ValueError(
                        f"cluster_dim: grid dimension {i} ({gd}) is not a multiple of the cluster's ({cd})"
                    )
            a = drv.CUlaunchAttribute()
            a.id = ids.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            a.value.clusterDim.x, a.value.clusterDim.y, a.value.clusterDim.z = c
            attrs.append(a)
        if pdl:
            a = drv.CUlaunchAttribute()
            a.id = ids.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            a.value.programmaticStreamSerializationAllowed = 1
            attrs.append(a)
        if attrs:
            cfg.attrs = attrs
        cfg.numAttrs = len(attrs)
        return cfg, attrs

    def _layout(self, sig: tuple) -> ArgLayout:
        sizes = self.param_sizes
        if sizes is not None:
            if len(sig) != len(sizes):
                raise TypeError(f"{self.name}: the kernel takes {len(sizes)} arguments, got {len(sig)}")
            layout = ArgLayout(sig)
            for i, (got, want) in enumerate(zip(layout.sizes, sizes)):
                if got != want:
                    raise TypeError(
                        f"{self.name}: argument {i} is a {want}-byte parameter in the kernel, got {describe(sig[i])}"
                    )
        else:
            layout = ArgLayout(sig)
        with self._lock:
            if len(self._layouts) > 64:
                self._layouts.clear()
            self._layouts[sig] = layout
        return layout

    def launch(
        self,
        grid: int | Sequence[int],
        block: int | Sequence[int],
        args: Sequence[Any],
        shared_mem: int = 0,
        stream: Any = 0,
        cooperative: bool = False,
        cluster_dim: int | Sequence[int] | None = None,
        pdl: bool = False,
    ) -> None:
        """Launch on ``stream`` (asynchronous). ``args`` are typed wrappers, arrays/tensors (pointers) or structs.

        ``cooperative`` makes a cooperative launch (grid-wide sync allowed; all blocks must be resident),
        ``cluster_dim`` launches thread-block clusters (sm_90+), ``pdl`` allows programmatic dependent
        launch (the kernel may start before the previous one in the stream ends; it must call
        ``cudaGridDependencySynchronize``). Shared memory above 48 KiB is opted in automatically.
        """
        if type(stream) is not int:
            stream = stream_handle(stream)
        ck = (grid, block, shared_mem, stream, cooperative, cluster_dim, pdl)
        try:
            cfg = self._configs[ck][0]
        except KeyError:
            cfg = self._new_config(ck)
        except TypeError:  # unhashable (lists): normalize
            ck = tuple(tuple(x) if isinstance(x, list) else x for x in ck)
            cfg = self._configs[ck][0] if ck in self._configs else self._new_config(ck)
        try:
            sig = tuple([a._ep_sig for a in args])
            vals = [a.value for a in args]
        except AttributeError:
            sig, vals = build_signature(args)
        layout = self._layouts.get(sig)
        if layout is None:
            layout = self._layout(sig)
        if layout.lock.acquire(False):
            try:
                buf, addr = layout.shared()
                layout.pack(buf, vals)
                err = self._launch(cfg, self._func, addr, 0)[0]
            finally:
                layout.lock.release()
        else:
            buf, addr = layout.new_buffer()
            layout.pack(buf, vals)
            err = self._launch(cfg, self._func, addr, 0)[0]
        if err:
            self._retry_or_raise(err, ck, cfg, layout, vals)

    __call__ = launch

    def _new_config(self, ck: tuple) -> Any:
        entry = self._config(*ck)
        with self._lock:
            if len(self._configs) > 256:
                self._configs.clear()
            self._configs[ck] = entry
        return entry[0]

    def _retry_or_raise(self, err: Any, ck: tuple, cfg: Any, layout: ArgLayout, vals: list[Any]) -> None:
        """A thread with no current context (contexts are per thread) gets the primary one, then one retry."""
        drv = driver()
        if err == drv.CUresult.CUDA_ERROR_INVALID_CONTEXT:
            ensure_context()
            buf, addr = layout.new_buffer()
            layout.pack(buf, vals)
            err = self._launch(cfg, self._func, addr, 0)[0]
            if not err:
                return
        self._raise_launch_error(err, ck)

    def _raise_launch_error(self, err: Any, ck: tuple) -> None:
        from ._driver import _error_text

        grid, block, shared_mem, stream, cooperative, cluster_dim, pdl = ck
        hint = ""
        drv = driver()
        if err == drv.CUresult.CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE:
            hint = "; a cooperative grid must fit on the device at once (see max_active_blocks_per_sm)"
        raise LaunchError(
            f"launching {self.name} failed: {_error_text(drv, err)} (grid={grid}, block={block}, "
            f"shared_mem={shared_mem}, stream=0x{stream:x}, cooperative={cooperative}, cluster_dim={cluster_dim}, "
            f"pdl={pdl}){hint}"
        )


def _mangled_prefixes(name: str) -> list[str]:
    parts = name.split("::")
    if len(parts) == 1:
        return [f"_Z{len(name)}{name}"]
    nested = "".join(f"{len(p)}{p}" for p in parts)
    return [f"_ZN{nested}E", f"_ZN{nested}I"]


class Module:
    """A cubin loaded with ``cuLibraryLoadData`` (context-independent); kernels come from :meth:`function`."""

    def __init__(self, path: str | os.PathLike[str], *, data: bytes | None = None) -> None:
        self.path = Path(path)
        if data is None:
            try:
                data = self.path.read_bytes()
            except FileNotFoundError:
                raise JitError(
                    f"{self.path} no longer exists (evicted or cleared from the cache by another process); "
                    "call ep_jit.clear_memo() and compile again"
                ) from None
        if not is_cubin(data):
            raise JitError(f"{self.path} is not a cubin (64-bit CUDA ELF)")
        drv = driver()
        ensure_context()
        self._library = check(
            drv.cuLibraryLoadData(data, [], [], 0, [], [], 0), f"cuLibraryLoadData({self.path})"
        )
        self.kernel_names: list[str] = kernel_names(data)
        self._kernels: dict[str, Kernel] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<ep_jit.Module {self.path} kernels={self.kernel_names}>"

    def resolve(self, name: str) -> str:
        """The symbol for ``name``: exact (mangled or ``extern "C"``), else the unique mangled match."""
        if name in self.kernel_names:
            return name
        prefixes = _mangled_prefixes(name) if name.replace("::", "").replace("_", "a").isalnum() else []
        matches = [k for k in self.kernel_names if any(k.startswith(p) for p in prefixes)]
        if len(matches) == 1:
            return matches[0]
        listing = ", ".join(self.kernel_names) or "(none)"
        if matches:
            raise JitError(
                f"kernel name {name!r} is ambiguous in {self.path}: it matches {', '.join(matches)}; "
                "pass the exact mangled name"
            )
        raise JitError(
            f"no kernel {name!r} in {self.path}; available: {listing}. Pass a mangled name as listed, the plain "
            'name of an extern "C" kernel, or a plain C++ name that matches exactly one template instantiation'
        )

    def function(self, name: str) -> Kernel:
        """The kernel ``name`` (cached); accepts mangled names, ``extern "C"`` names and unique C++ names."""
        kernel = self._kernels.get(name)
        if kernel is not None:
            return kernel
        with self._lock:
            kernel = self._kernels.get(name)
            if kernel is None:
                symbol = self.resolve(name)
                drv = driver()
                ensure_context()
                ck = check(
                    drv.cuLibraryGetKernel(self._library, symbol.encode()), f"cuLibraryGetKernel({symbol})"
                )
                func = check(drv.cuKernelGetFunction(ck), f"cuKernelGetFunction({symbol})")
                kernel = Kernel(func, symbol, self)
                self._kernels[name] = kernel
                self._kernels[symbol] = kernel
        return kernel

    def unload(self) -> None:
        """Unload the library; its kernels must not be launched afterwards."""
        if self._library is not None:
            check(driver().cuLibraryUnload(self._library), "cuLibraryUnload")
            self._library = None
            self._kernels.clear()
            with _modules_lock:
                for k, v in list(_modules.items()):
                    if v is self:
                        del _modules[k]


_modules: dict[tuple, Module] = {}
_modules_lock = threading.Lock()


def load(artifact: Artifact | str | os.PathLike[str]) -> Module:
    """Load an :class:`Artifact` (or a cubin path) into the driver; memoized per cubin in this process.

    Creates and makes current the primary context of device 0 when no context is current.
    """
    if isinstance(artifact, Artifact):
        path, tag = artifact.cubin_path, artifact.key
    else:
        path, tag = Path(artifact), None
    mk = (str(path), tag)
    module = _modules.get(mk)
    if module is None:
        with _modules_lock:
            module = _modules.get(mk)
            if module is None:
                module = Module(path)
                _modules[mk] = module
    return module
