"""NCCL communicators, registered windows and device communicators (the host side of LSA and GIN).

Collective calls (``Communicator(...)``, ``register_window``, ``create_dev_comm``, ``Window.deregister``,
``DevComm.destroy``) must be made by every rank of the communicator in the same order. Destructors never make
collective calls: release windows and device communicators explicitly (or with ``with``); an owned communicator
that is garbage-collected without ``destroy()`` is aborted (``ncclCommAbort``, local).
"""

from __future__ import annotations

import contextlib
import struct
import warnings
import weakref
from dataclasses import dataclass
from types import TracebackType
from typing import Literal, TypeVar

from . import _env
from ._loader import LoadedNccl, extension, load
from .errors import GinUnavailableError, NcclGinError, NcclVersionError
from .version import FEATURES, check_header_runtime, require

__all__ = [
    "Communicator",
    "DevComm",
    "Team",
    "Window",
    "get_unique_id",
    "mem_alloc",
    "mem_free",
    "nccl_version",
]

GinConnectionType = Literal["full", "rail"]
_GIN_CONNECTION = {"full": 1, "rail": 2}  # ncclGinConnectionType_t values (NONE = 0)


def nccl_version() -> tuple[int, int, int]:
    """``(major, minor, patch)`` of the loaded NCCL library (``ncclGetVersion``)."""
    return load().runtime.as_tuple()


def get_unique_id() -> bytes:
    """A fresh ``ncclUniqueId`` (128 bytes) for rank 0 to share with every rank of a new communicator."""
    load()
    return bytes(extension().get_unique_id())


def mem_alloc(nbytes: int) -> int:
    """``ncclMemAlloc``: VMM-backed device memory that windows can register. Returns the device pointer."""
    _check_count("nbytes", nbytes, minimum=1)
    nccl = load()
    require("mem_alloc", nccl.runtime)
    return int(extension().mem_alloc(nbytes))


def mem_free(ptr: int) -> None:
    """``ncclMemFree`` of a pointer from :func:`mem_alloc`."""
    _check_count("ptr", ptr, minimum=1)
    nccl = load()
    require("mem_alloc", nccl.runtime)
    extension().mem_free(ptr)


def _check_count(name: str, value: object, *, minimum: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return value


@dataclass(frozen=True)
class Team:
    """An NCCL team: ``nranks`` ranks, this rank's index ``rank``, world-rank ``stride`` between members."""

    nranks: int
    rank: int
    stride: int

    def world_rank(self, index: int, my_world_rank: int) -> int:
        """World rank of team member ``index`` (this rank has world rank ``my_world_rank``)."""
        return my_world_rank + (index - self.rank) * self.stride

    def index_of(self, world_rank: int, my_world_rank: int) -> int | None:
        """Team index of ``world_rank``, or None when it is not a member."""
        delta = world_rank - my_world_rank
        if delta % self.stride != 0:
            return None
        index = self.rank + delta // self.stride
        return index if 0 <= index < self.nranks else None


_Self = TypeVar("_Self", bound="_ReleasedOnExit")


class _ReleasedOnExit:
    """``with`` support: leaving the block calls ``_release`` (the class's ``destroy`` or ``deregister``)."""

    def _release(self) -> None:
        raise NotImplementedError

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._release()


def _abort_quietly(ptr: int) -> None:
    # A finalizer: nothing useful can be done with an error here.
    with contextlib.suppress(Exception):
        extension().comm_abort(ptr)


class Communicator(_ReleasedOnExit):
    """An NCCL communicator: owned (created here, destroyed by :meth:`destroy`) or borrowed (:meth:`from_pointer`)."""

    def __init__(self, unique_id: bytes, nranks: int, rank: int, *, device: int | None = None) -> None:
        """``ncclCommInitRank`` (collective over ``nranks`` ranks). ``device``: make that GPU's primary context
        current first (otherwise NCCL uses the calling thread's current device)."""
        if not isinstance(unique_id, (bytes, bytearray)):
            raise TypeError(f"unique_id: expected bytes from get_unique_id(), got {type(unique_id).__name__}")
        _check_count("nranks", nranks, minimum=1)
        _check_count("rank", rank)
        if rank >= nranks:
            raise ValueError(f"rank: expected 0 <= rank < nranks = {nranks}, got {rank}")
        self._nccl = load()
        impl = extension()
        if len(unique_id) != impl.UNIQUE_ID_BYTES:
            raise ValueError(
                f"unique_id: expected {impl.UNIQUE_ID_BYTES} bytes (from get_unique_id()), got {len(unique_id)}"
            )
        if device is not None:
            _check_count("device", device)
            impl.set_device(device)
        self._ptr: int | None = int(impl.comm_init_rank(bytes(unique_id), nranks, rank))
        self._owned = True
        self._finalizer = weakref.finalize(self, _abort_quietly, self._ptr)
        self._finalizer.atexit = False

    @classmethod
    def from_pointer(cls, ptr: int) -> Communicator:
        """Wrap an existing ``ncclComm_t`` (borrowed: never destroyed here), e.g. torch's
        ``ProcessGroupNCCL._comm_ptr()``. It must come from the same libnccl that ep_nccl_gin loaded."""
        _check_count("ptr", ptr, minimum=1)
        self = cls.__new__(cls)
        self._nccl = load()
        self._ptr = ptr
        self._owned = False
        self._finalizer = None
        extension().comm_count(ptr)  # validates the pointer as far as NCCL can
        return self

    # -- identity -------------------------------------------------------------------------------------------

    @property
    def ptr(self) -> int:
        """The ``ncclComm_t`` as an integer."""
        if self._ptr is None:
            raise NcclGinError("this Communicator was destroyed")
        return self._ptr

    @property
    def owned(self) -> bool:
        return self._owned

    @property
    def nccl(self) -> LoadedNccl:
        return self._nccl

    @property
    def rank(self) -> int:
        return int(extension().comm_rank(self.ptr))

    @property
    def nranks(self) -> int:
        return int(extension().comm_count(self.ptr))

    @property
    def device(self) -> int:
        return int(extension().comm_device(self.ptr))

    def async_error(self) -> int:
        """``ncclCommGetAsyncError`` (0 = ncclSuccess)."""
        return int(extension().comm_async_error(self.ptr))

    def lsa_team(self) -> Team:
        """This rank's LSA (load/store accessible, NVLink/P2P) team."""
        require("device_api", self._nccl.runtime, self._nccl.header)
        return Team(*extension().team_lsa(self.ptr))

    def world_team(self) -> Team:
        require("device_api", self._nccl.runtime, self._nccl.header)
        return Team(*extension().team_world(self.ptr))

    def properties(self) -> dict[str, object]:
        """``ncclCommQueryProperties`` (NCCL >= 2.29.2): device API support, GIN type, ..."""
        require("comm_properties", self._nccl.runtime, self._nccl.header)
        return dict(extension().comm_properties(self.ptr))

    # -- lifetime ------------------------------------------------------------------------------------------

    def destroy(self) -> None:
        """``ncclCommDestroy`` for an owned communicator; for a borrowed one just drop the reference."""
        if self._ptr is None:
            return
        ptr, self._ptr = self._ptr, None
        if self._finalizer is not None:
            self._finalizer.detach()
        if self._owned:
            extension().comm_destroy(ptr)

    def abort(self) -> None:
        """``ncclCommAbort`` (owned communicators only)."""
        if not self._owned:
            raise NcclGinError(
                "abort: this Communicator is borrowed (from_pointer); abort it through its owner"
            )
        if self._ptr is None:
            return
        ptr, self._ptr = self._ptr, None
        if self._finalizer is not None:
            self._finalizer.detach()
        extension().comm_abort(ptr)

    def _release(self) -> None:
        self.destroy()

    def __repr__(self) -> str:
        state = "destroyed" if self._ptr is None else f"0x{self._ptr:x}"
        return f"Communicator({state}, {'owned' if self._owned else 'borrowed'})"

    # -- windows and device communicators -------------------------------------------------------------------

    def register_window(self, ptr: int, nbytes: int, strict_ordering: bool = True) -> Window:
        """``ncclCommWindowRegister`` (collective) of ``nbytes`` at ``ptr`` (from :func:`mem_alloc` or a VMM
        allocation), symmetric (``NCCL_WIN_COLL_SYMMETRIC``).

        ``strict_ordering`` adds ``NCCL_WIN_STRICT_ORDERING`` (GIN puts to the window complete in order, which
        GIN VA signals rely on). NCCL releases before that flag (2.28) have no VA signals and no such flag:
        there the window is registered without it and ``Window.strict_ordering`` reads False.
        """
        _check_count("ptr", ptr, minimum=1)
        _check_count("nbytes", nbytes, minimum=1)
        require("window", self._nccl.runtime, self._nccl.header)
        impl = extension()
        flags_table = impl.window_flags()
        if ptr % flags_table["required_alignment"] != 0:
            raise ValueError(
                f"ptr: expected an address aligned to NCCL_WIN_REQUIRED_ALIGNMENT = "
                f"{flags_table['required_alignment']} bytes, got 0x{ptr:x}"
            )
        flags = flags_table["coll_symmetric"]
        applied_strict = False
        # Only a flag that headers no newer than the library define is passed (an older library may reject it).
        if (
            strict_ordering
            and flags_table["strict_ordering"] is not None
            and self._nccl.runtime >= self._nccl.header
        ):
            flags |= flags_table["strict_ordering"]
            applied_strict = True
        handle = int(impl.window_register(self.ptr, ptr, nbytes, flags))
        return Window(self, handle, ptr, nbytes, applied_strict)

    def create_dev_comm(
        self,
        *,
        lsa_barrier_count: int = 0,
        barrier_count: int = 0,
        rail_gin_barrier_count: int = 0,
        gin_contexts: int | None = None,
        gin_exclusive_contexts: bool | None = None,
        gin_queue_depth: int | None = None,
        gin_signal_count: int = 0,
        gin_counter_count: int = 0,
        gin_connection_type: GinConnectionType | None = None,
        gin_traffic_class: int | None = None,
    ) -> DevComm:
        """``ncclDevCommCreate`` (collective) with these requirements; ``None`` keeps NCCL's default.

        Args:
            lsa_barrier_count: LSA barriers (``ncclLsaBarrierSession`` indices), typically one per CTA.
            barrier_count: hybrid (LSA + GIN) barriers.
            rail_gin_barrier_count: GIN barriers over the rail team.
            gin_contexts: GIN contexts (a hint; DeepEP: one per QP).
            gin_exclusive_contexts: one NIC queue per context (NCCL >= 2.29.7).
            gin_queue_depth: entries per GIN queue (NCCL >= 2.29.7).
            gin_signal_count: GIN signals, ids 0..n-1.
            gin_counter_count: GIN counters, ids 0..n-1.
            gin_connection_type: "full" (every peer) or "rail" (same-rail peers, NCCL >= 2.29.7). On NCCL 2.28,
                "full" sets ``ginForceEnable``.
            gin_traffic_class: network traffic class / IB service level (NCCL >= 2.30.3).
        """
        nccl = self._nccl
        require("device_api", nccl.runtime, nccl.header)
        use_runtime_version = check_header_runtime(
            nccl.header, nccl.runtime, what="ep_nccl_gin's extension (ncclDevCommRequirements/ncclDevComm)"
        )
        for name, value in (
            ("lsa_barrier_count", lsa_barrier_count),
            ("barrier_count", barrier_count),
            ("rail_gin_barrier_count", rail_gin_barrier_count),
            ("gin_signal_count", gin_signal_count),
            ("gin_counter_count", gin_counter_count),
        ):
            _check_count(name, value)
        impl = extension()
        req = impl.DevCommRequest()
        req.lsa_barrier_count = lsa_barrier_count
        req.barrier_count = barrier_count
        req.rail_gin_barrier_count = rail_gin_barrier_count
        req.gin_signal_count = gin_signal_count
        req.gin_counter_count = gin_counter_count
        wants_gin = bool(
            rail_gin_barrier_count
            or gin_signal_count
            or gin_counter_count
            or gin_contexts
            or gin_connection_type is not None
            or gin_exclusive_contexts is not None
            or gin_queue_depth is not None
            or gin_traffic_class is not None
        )
        if wants_gin:
            if _env.gin_disabled():
                raise GinUnavailableError(
                    "GIN is disabled by EPKIT_DISABLE_GIN=1: this device communicator asks for GIN (signals, "
                    "counters, contexts or a connection type); unset it or request LSA only",
                    missing=("EPKIT_DISABLE_GIN=1",),
                )
            require("gin", nccl.runtime, nccl.header)
        if gin_contexts is not None:
            req.gin_context_count = _check_count("gin_contexts", gin_contexts)
        if gin_exclusive_contexts is not None:
            if not isinstance(gin_exclusive_contexts, bool):
                raise TypeError(
                    f"gin_exclusive_contexts: expected a bool, got {type(gin_exclusive_contexts).__name__}"
                )
            require("gin_connection_options", nccl.runtime, nccl.header)
            req.gin_exclusive_contexts = gin_exclusive_contexts
        if gin_queue_depth is not None:
            require("gin_connection_options", nccl.runtime, nccl.header)
            req.gin_queue_depth = _check_count("gin_queue_depth", gin_queue_depth, minimum=1)
        if gin_connection_type is not None:
            if gin_connection_type not in _GIN_CONNECTION:
                raise ValueError(
                    f"gin_connection_type: expected 'full' or 'rail', got {gin_connection_type!r}"
                )
            since = FEATURES["gin_connection_options"].since
            if nccl.header >= since and nccl.runtime >= since:
                req.gin_connection_type = _GIN_CONNECTION[gin_connection_type]
            elif gin_connection_type == "full":
                req.gin_force_enable = True  # NCCL 2.28: the predecessor of NCCL_GIN_CONNECTION_FULL
            else:
                require("gin_connection_options", nccl.runtime, nccl.header)
        if gin_traffic_class is not None:
            require("gin_traffic_class", nccl.runtime, nccl.header)
            req.gin_traffic_class = _check_count("gin_traffic_class", gin_traffic_class)
        req.use_runtime_version = use_runtime_version
        raw = bytes(impl.dev_comm_create(self.ptr, req))
        return DevComm(self, raw, runtime_versioned=use_runtime_version, gin_requested=wants_gin)


class Window(_ReleasedOnExit):
    """A registered symmetric window (``ncclWindow_t``). Release it with :meth:`deregister` (collective)."""

    def __init__(self, comm: Communicator, handle: int, ptr: int, nbytes: int, strict_ordering: bool) -> None:
        self._comm = comm
        self._handle: int | None = handle
        self._ptr = ptr
        self._nbytes = nbytes
        self._strict_ordering = strict_ordering

    @property
    def comm(self) -> Communicator:
        return self._comm

    @property
    def handle(self) -> int:
        """The ``ncclWindow_t`` (a device pointer) as an integer; kernels take it by value."""
        if self._handle is None:
            raise NcclGinError("this Window was deregistered")
        return self._handle

    def handle_bytes(self) -> bytes:
        """The ``ncclWindow_t`` as the 8 bytes of a kernel argument."""
        return struct.pack("<Q", self.handle)

    @property
    def ptr(self) -> int:
        """This rank's local address of window offset 0 (what was registered)."""
        return self._ptr

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def strict_ordering(self) -> bool:
        """Whether ``NCCL_WIN_STRICT_ORDERING`` was applied."""
        return self._strict_ordering

    @property
    def registered(self) -> bool:
        return self._handle is not None

    def _offset(self, offset: int) -> int:
        _check_count("offset", offset)
        if offset >= self._nbytes:
            raise ValueError(f"offset: expected 0 <= offset < nbytes = {self._nbytes}, got {offset}")
        return offset

    def lsa_ptr(self, peer: int, offset: int = 0) -> int:
        """Device address, valid on this GPU, of LSA team member ``peer``'s window at ``offset`` (for world
        size 1 or a single NVLink domain the LSA index equals the world rank)."""
        nccl = self._comm.nccl
        require("device_api", nccl.runtime, nccl.header)
        _check_count("peer", peer)
        offset = self._offset(offset)
        if nccl.runtime < FEATURES["host_peer_pointer"].since:
            # The extension reads the window descriptor with its compiled layout: headers must match the library.
            check_header_runtime(
                nccl.header, nccl.runtime, what="ep_nccl_gin's extension (ncclWindow_vidmem)"
            )
        team = self._comm.lsa_team()
        if peer >= team.nranks:
            raise ValueError(f"peer: expected an LSA rank in [0, {team.nranks}), got {peer}")
        return int(extension().window_lsa_pointer(self._comm.ptr, self.handle, peer, offset))

    def peer_ptr(self, peer: int, offset: int = 0) -> int | None:
        """Device address of world rank ``peer``'s window at ``offset``, or None when ``peer`` is not in this
        rank's LSA team (reach it with GIN instead)."""
        _check_count("peer", peer)
        comm = self._comm
        nranks = comm.nranks
        if peer >= nranks:
            raise ValueError(f"peer: expected a world rank in [0, {nranks}), got {peer}")
        index = comm.lsa_team().index_of(peer, comm.rank)
        if index is None:
            return None
        return self.lsa_ptr(index, offset)

    def deregister(self) -> None:
        """``ncclCommWindowDeregister`` (collective). Idempotent."""
        if self._handle is None:
            return
        handle, self._handle = self._handle, None
        extension().window_deregister(self._comm.ptr, handle)

    def _release(self) -> None:
        self.deregister()

    def __del__(self) -> None:
        if getattr(self, "_handle", None) is not None:
            warnings.warn(
                "ep_nccl_gin.Window garbage-collected while registered: deregister() it explicitly (collective)",
                ResourceWarning,
                stacklevel=1,
            )

    def __repr__(self) -> str:
        state = "deregistered" if self._handle is None else f"0x{self._handle:x}"
        return f"Window({state}, ptr=0x{self._ptr:x}, nbytes={self._nbytes})"


class DevComm(_ReleasedOnExit):
    """A device communicator (``ncclDevComm``) that kernels take by value. Release with :meth:`destroy`."""

    def __init__(
        self, comm: Communicator, raw: bytes, *, runtime_versioned: bool, gin_requested: bool
    ) -> None:
        self._comm = comm
        self._raw: bytes | None = raw
        self._runtime_versioned = runtime_versioned
        impl = extension()
        team = comm.lsa_team()
        self._lsa_size = team.nranks
        self._lsa_rank = team.rank
        if not runtime_versioned:
            info = impl.dev_comm_info(raw)
            self._gin_contexts: int | None = int(info["gin_context_count"])
            if info["lsa_size"] != team.nranks or info["lsa_rank"] != team.rank:
                raise NcclVersionError(
                    f"ncclDevComm reports LSA team ({info['lsa_rank']} of {info['lsa_size']}) but ncclTeamLsa "
                    f"reports ({team.rank} of {team.nranks}): the struct layout does not match the library"
                )
        else:
            self._gin_contexts = None
        self._gin_requested = gin_requested

    @property
    def comm(self) -> Communicator:
        return self._comm

    def as_bytes(self) -> bytes:
        """The raw ``ncclDevComm`` bytes (pass by value to a kernel compiled against the loaded NCCL headers)."""
        if self._raw is None:
            raise NcclGinError("this DevComm was destroyed")
        return self._raw

    @property
    def nbytes(self) -> int:
        return len(self.as_bytes())

    @property
    def runtime_versioned(self) -> bool:
        """True when created with ``useRuntimeVersion`` (headers older than the library, both >= 2.31)."""
        return self._runtime_versioned

    @property
    def lsa_size(self) -> int:
        return self._lsa_size

    @property
    def lsa_rank(self) -> int:
        return self._lsa_rank

    @property
    def gin_contexts(self) -> int | None:
        """GIN contexts NCCL actually created (None when the struct is runtime-versioned and opaque here)."""
        return self._gin_contexts

    @property
    def gin_available(self) -> bool:
        """Whether kernels may issue GIN operations with this device communicator."""
        if self._gin_contexts is not None:
            return self._gin_contexts > 0
        if not self._gin_requested:
            return False
        props = self._comm.properties()
        return bool(props.get("gin_type", 0) or props.get("railed_gin_type", 0))

    def context_bytes(self, window: Window) -> bytes:
        """Bytes of an ``ep_nccl_gin::Context`` (device.cuh) for ``window``: the kernel argument of the device
        concept. Layout: ``[ncclDevComm | pad to 8 | ncclWindow_t | char* base | uint64 nbytes]``."""
        if window.comm is not self._comm and window.comm.ptr != self._comm.ptr:
            raise ValueError("window: expected a Window of the same communicator as this DevComm")
        raw = self.as_bytes()
        pad = (-len(raw)) % 8
        return raw + b"\0" * pad + struct.pack("<QQQ", window.handle, window.ptr, window.nbytes)

    def destroy(self) -> None:
        """``ncclDevCommDestroy``. Idempotent."""
        if self._raw is None:
            return
        raw, self._raw = self._raw, None
        extension().dev_comm_destroy(self._comm.ptr, raw)

    def _release(self) -> None:
        self.destroy()

    def __repr__(self) -> str:
        return (
            f"DevComm(lsa_rank={self._lsa_rank}, lsa_size={self._lsa_size}, nbytes={len(self._raw or b'')})"
        )
