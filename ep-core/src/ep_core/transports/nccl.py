"""The nccl transport, host side: direct mode (one LSA / NVLink domain) over an NCCL window (ep-nccl-gin).

The kernels are the ipc ones with `ep_core::NcclTransport` switched in at JIT time (`KernelConfig(transport=
"nccl")`): `sym_ptr(p, peer)` is `ncclGetLsaPointer(window, p - own_base, peer)`; the host gives them the
`ncclWindow_t` (`OpArgs::nccl_window`) and this rank's base of the window.

Setup (`NcclTransport.allocate`, every rank in the same order):
1. a communicator: owned (`ncclCommInitRank` from rank 0's id) or borrowed (`NcclTransport(comm_ptr=...)`, e.g.
   torch's; its rank and size must equal the bootstrap's);
2. the version gate (NCCL >= 2.28.7, library and headers); NCCL's LSA team must be all `n` ranks (direct mode) or
   `S_u` consecutive ranks with `S_u` dividing `n` (the hybrid nodes), else `EPConfigError`;
3. the storage `[workspace | data]` from `ncclMemAlloc`, zeroed, registered as a symmetric, strictly ordered window,
   and a device communicator (`ncclDevCommCreate`, LSA barriers, no GIN);
4. several nodes (`create_executor`): hybrid mode and direct mode across nodes need GIN. Every rank checks
   `gin_support(hybrid=...)`, the traffic-class gate and the window's ordering, the outcome is exchanged (no rank
   enters a collective another refused), then the device communicator is replaced by one with
   `gin_requirements(...)` for the `gin` scale-out put (include/ep_core/scaleout.cuh). Compiled and wired, never
   run (no RDMA NIC on the machines this was built on).

Teardown (`NcclStorage.close()`, after `EPBuffer.destroy()`'s barrier): device communicator, window (both
collective), `ncclMemFree`, then an owned communicator once its last storage is gone. Garbage collected instead,
the release is local: an owned communicator is aborted, a borrowed one's window and memory are left registered (a
`ResourceWarning` says so).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

from ep_core.errors import EPConfigError, EPDeviceError
from ep_core.kernels.rank_driver import RankDriver, RankResources

__all__ = [
    "GIN_QUEUE_DEPTH",
    "GIN_SIGNAL_COUNT",
    "MIN_NCCL_VERSION",
    "NcclRank",
    "NcclStorage",
    "NcclTransport",
    "gin_requirements",
    "load_nccl_gin",
    "make_transport",
]

MIN_NCCL_VERSION = (2, 28, 7)
"""The NCCL release (library and headers) the transport needs: ep-nccl-gin's "gin" feature gate."""

GIN_QUEUE_DEPTH = 1024
"""Entries per GIN queue (DeepEP's `kGinQPDepth`)."""

GIN_SIGNAL_COUNT = 0
"""GIN signal ids the kernels of several nodes use: none. Every signal of include/ep_core/hybrid.cuh and
direct_xnode.cuh (the count-block signal per source node, the rank-count signals of direct mode across nodes, the
barrier's arrival adds) is a `ncclGin_StrongVASignalAdd` on a workspace word of the window
(a VA signal), and the puts are plain `put`/`putValue`; no `ncclGinSignal_t` id is ever passed. A kernel that
starts using indexed signals must raise this (DeepEP asks for N + 4 because its barrier uses ids)."""

GIN_KERNEL_PEERS = "rail"
"""Which peers the hybrid gin kernels reach over GIN: the rail only. The data puts, count signals and the barrier
(`hybrid_barrier<S_u, true>`: node clique + rail clique) go to the ranks of the same local index on the other
nodes (addressed through `ncclTeamWorld`, which NCCL maps onto the rail connections), so hybrid mode asks for a
RAIL connection, as DeepEP. Direct mode across nodes puts to every rank: FULL ("world" here would make hybrid
mode FULL too)."""

_GATE_FEATURE = "gin"
_INSTALL_HINT = "pip install 'ep-core[nccl]' (ep-nccl-gin) with nvidia-nccl-cu12/cu13 >= 2.28.7"


# --- seams (tests replace these to check the plumbing without a GPU) -------------------------------------------
def _import_nccl_gin() -> Any:
    import ep_nccl_gin

    return ep_nccl_gin


def _current_device() -> int:
    from ep_core.transports.ipc import _current_device as current

    return current()


def _device_sms() -> int:
    from ep_core.kernels import _cuda

    return _cuda.num_device_sms()


def _zero(ptr: int, nbytes: int) -> None:
    from ep_core.kernels import _cuda

    _cuda.memset(ptr, nbytes, 0)
    _cuda.check(_cuda.driver().cuCtxSynchronize(), "cuCtxSynchronize")


def _upload(raw: bytes) -> Any:
    """A device copy of `raw` (the `ncclDevComm` the gin kernels read through `OpArgs::nccl_devcomm`); returns an
    object with `.ptr` and `.close()`."""
    import numpy as np

    from ep_core.kernels import _cuda

    buf = _cuda.DeviceBuffer(len(raw))
    _cuda.copy_to_device(buf.ptr, np.frombuffer(raw, dtype=np.uint8), 0)
    _cuda.check(_cuda.driver().cuCtxSynchronize(), "cuCtxSynchronize")
    return buf


def _storage_total_bytes(num_bytes: int) -> int:
    """`[workspace | data]` bytes for `EPBuffer`'s request of `num_bytes` (workspace included), as ipc sizes it."""
    import ep_layout

    ws = ep_layout.WorkspaceLayout.NUM_ALIGNED_BYTES
    data = int(num_bytes) - ws
    if data < 0:
        raise EPConfigError(f"num_bytes: expected at least the workspace ({ws} bytes), got {num_bytes}")
    return ws + ep_layout.align(data, ep_layout.NUM_SYMMETRIC_ALIGN_BYTES)


def load_nccl_gin() -> Any:
    """ep_nccl_gin, loaded and version-gated (library and headers >= MIN_NCCL_VERSION, device headers found);
    `EPConfigError` saying what to do otherwise. Local (no collective): callers that must agree across ranks, such as
    an automatic transport choice, exchange the outcome themselves."""
    try:
        nccl = _import_nccl_gin()
    except ImportError as exc:
        raise EPConfigError(
            f"transport 'nccl': the ep-nccl-gin package is not importable ({exc}); {_INSTALL_HINT}, or use "
            "transport='ipc'"
        ) from exc
    try:
        loaded = nccl.load()
    except nccl.NcclGinError as exc:
        raise EPConfigError(
            f"transport 'nccl': no usable NCCL library ({exc}); {_INSTALL_HINT}, or use transport='ipc'"
        ) from exc
    since = nccl.FEATURES[_GATE_FEATURE].since
    for what, version in (("library", loaded.runtime), ("headers of ep-nccl-gin", loaded.header)):
        if version < since:
            raise EPConfigError(
                f"transport 'nccl': needs NCCL >= {since} (device API with GIN), got NCCL {what} {version}; "
                f"{_INSTALL_HINT} (and rebuild ep-nccl-gin against it), or use transport='ipc'"
            )
    try:
        nccl.include_dirs()  # the JIT compiles against these headers: same version as the library
    except nccl.NcclGinError as exc:
        raise EPConfigError(f"transport 'nccl': NCCL device headers for the kernels: {exc}") from exc
    return nccl


def gin_requirements(
    topology: Any, *, num_allocated_qps: int, sl_idx: int, lsa_barrier_count: int
) -> dict[str, Any]:
    """`Communicator.create_dev_comm` keyword arguments for a buffer of `topology` (several nodes):
    contexts = the allocated QPs (DeepEP: one GIN context per QP; `num_allocated_qps` as `EPBuffer` resolved it,
    0 = the planner's default), exclusive contexts, `GIN_QUEUE_DEPTH`, traffic class = `sl_idx`, the signal ids the
    kernels use (`GIN_SIGNAL_COUNT`), and the connection: RAIL in hybrid mode (the kernels reach rail peers only:
    `GIN_KERNEL_PEERS`), FULL in direct mode across nodes (a put to every rank)."""
    from ep_core import planner

    if topology.num_rdma_ranks <= 1:
        raise EPConfigError(
            f"topology: GIN requirements are for several nodes, got one NVLink domain of {topology.num_ranks} ranks"
        )
    qps = int(num_allocated_qps) or planner.default_num_allocated_qps(topology)
    rail = topology.is_hybrid and GIN_KERNEL_PEERS == "rail"
    return {
        "lsa_barrier_count": int(lsa_barrier_count),
        "gin_contexts": qps,
        "gin_exclusive_contexts": True,
        "gin_queue_depth": GIN_QUEUE_DEPTH,
        "gin_signal_count": GIN_SIGNAL_COUNT,
        "gin_connection_type": "rail" if rail else "full",
        "gin_traffic_class": int(sl_idx),
    }


def _gin_blockers(
    nccl: Any, storage: NcclStorage, requirements: dict[str, Any], hybrid: bool = True
) -> list[str]:
    """What keeps this rank from a GIN device communicator with `requirements` (empty: nothing). Local.
    `hybrid`: hybrid mode (the RAIL connection options too), else direct mode across nodes."""
    missing = list(nccl.gin_support(hybrid=hybrid).missing)  # EPKIT_DISABLE_GIN, versions, RDMA NIC
    loaded = nccl.load()
    if requirements.get("gin_traffic_class") is not None:
        since = nccl.FEATURES["gin_traffic_class"].since
        if loaded.runtime < since or loaded.header < since:
            missing.append(
                f"sl_idx={requirements['gin_traffic_class']} is the GIN traffic class, which needs NCCL >= {since} "
                f"(library {loaded.runtime}, headers {loaded.header}); upgrade nvidia-nccl (and rebuild ep-nccl-gin)"
            )
    window = storage.window
    if window is not None and not getattr(window, "strict_ordering", False):
        missing.append(
            "the window was registered without NCCL_WIN_STRICT_ORDERING (NCCL 2.28 has no such flag), but the gin "
            "scale-out's strong VA signals need it: use an NCCL release with strict-ordering windows"
        )
    return missing


class NcclStorage:
    """One rank's symmetric storage `[workspace | data]`: NCCL memory registered as a window, plus the device
    communicator. `ptr`/`num_bytes`/`device` as every storage; `nccl_window` is what the kernels read."""

    array_device = "cuda"
    peer_table = 0  # the nccl kernels take peers from the window, not from a table

    def __init__(
        self, transport: NcclTransport, ptr: int, num_bytes: int, window: Any, dev_comm: Any, device: int
    ) -> None:
        self._transport = transport
        self.ptr = int(ptr)
        self.num_bytes = int(num_bytes)
        self.device = int(device)
        self._window = window
        self._dev_comm = dev_comm
        self.nccl_window = int(window.handle)
        self.lsa_size = int(dev_comm.lsa_size)
        self.lsa_rank = int(dev_comm.lsa_rank)
        # device copy of a GIN ncclDevComm (several nodes, `NcclTransport.create_executor`)
        self.nccl_devcomm = 0
        self._devcomm_copy: Any = None
        self._peer_bases: list[int] | None = None
        self.closed = False

    def lsa_team_short(self: Any, num_ranks: int) -> bool:
        """Whether NCCL's LSA team is smaller than the `num_ranks` of the group (its peers outside it are not load/store
        reachable); called unbound on any storage (False without an LSA team: ipc's), each caller with its refusal."""
        lsa = getattr(self, "lsa_size", None)
        return lsa is not None and lsa != int(num_ranks)

    def peer_bases(self, num_ranks: int) -> list[int]:
        """Every rank's storage base as mapped in this process (rank order), for kernels that take a table of peer
        bases (V1 low-latency mode's own kernels): the window's LSA pointers, read once (`nccl_peer_bases`). Only
        where the LSA team is the whole group (one NVLink domain: direct mode)."""
        if self.lsa_team_short(num_ranks):
            raise EPConfigError(
                f"peer_bases: NCCL's LSA team has {self.lsa_size} of the {int(num_ranks)} ranks (several nodes); "
                "the peers outside it are not load/store reachable"
            )
        if self._peer_bases is None:
            from ep_core.transports.nccl_peer_bases import lsa_peer_bases

            self._peer_bases = lsa_peer_bases(self._alive().nccl_window, int(num_ranks), self.device)
        return list(self._peer_bases)

    def _use_gin_dev_comm(self, dev_comm: Any, copy: Any) -> None:
        """Replace the LSA-only device communicator by the GIN one (collective destroy of the old one)."""
        old, self._dev_comm = self._dev_comm, dev_comm
        self._devcomm_copy = copy
        self.nccl_devcomm = int(copy.ptr)
        old.destroy()

    def _free_devcomm_copy(self) -> None:
        copy, self._devcomm_copy, self.nccl_devcomm = self._devcomm_copy, None, 0
        if copy is not None:
            with contextlib.suppress(Exception):
                copy.close()

    @property
    def window(self) -> Any:
        """The `ep_nccl_gin.Window` (None once closed)."""
        return self._window

    @property
    def dev_comm(self) -> Any:
        """The `ep_nccl_gin.DevComm` (None once closed)."""
        return self._dev_comm

    def dev_comm_bytes(self) -> bytes:
        """The raw `ncclDevComm` (a kernel argument by value)."""
        return self._alive()._dev_comm.as_bytes()

    def context_bytes(self) -> bytes:
        """An `ep_nccl_gin::Context` for this window (ep_nccl_gin/device.cuh)."""
        self._alive()
        return self._dev_comm.context_bytes(self._window)

    def _alive(self) -> NcclStorage:
        if self.closed:
            raise EPConfigError("NcclStorage: used after close(); create a new buffer")
        return self

    def close(self) -> None:
        """Collective release: device communicator, window, memory, then an owned communicator when no other
        storage uses it. Garbage collection calls `release_local()` instead (BufferBase)."""
        if self.closed:
            return
        self.closed = True
        nccl = self._transport._nccl
        dev_comm, window = self._dev_comm, self._window
        self._dev_comm = self._window = None
        self._free_devcomm_copy()
        try:
            dev_comm.destroy()
            window.deregister()
        finally:
            nccl.mem_free(self.ptr)
            self._transport._storage_closed(self, collective=True)

    def release_local(self) -> None:
        """Free what can be freed without a collective call (garbage collection, error paths)."""
        if self.closed:
            return
        self.closed = True
        nccl = self._transport._nccl
        window = self._window
        self._dev_comm = None
        self._free_devcomm_copy()
        if self._transport._storage_closed(self, collective=False):
            # the communicator was aborted: its windows are gone, the memory can go too
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ResourceWarning)
                self._window = window = None
            with contextlib.suppress(Exception):
                nccl.mem_free(self.ptr)
        else:
            warnings.warn(
                "ep_core nccl transport: a buffer was garbage collected while its NCCL window is registered on a "
                "communicator that stays alive (borrowed, or shared with another buffer); the window and its "
                f"{self.num_bytes} bytes are left registered. Call EPBuffer.destroy() (collective) instead.",
                ResourceWarning,
                stacklevel=2,
            )
            _LEAKED.append((window, self.ptr))
            self._window = None


_LEAKED: list[tuple[Any, int]] = []  # windows that could not be released without a collective call


class NcclTransport:
    """`EPBuffer(transport="nccl")`: the direct-mode kernels over an NCCL window (LSA pointers).

    Args:
        comm_ptr: an existing `ncclComm_t` (int) to borrow instead of creating one (never destroyed here; it must
            come from the libnccl that ep-nccl-gin loads, e.g. torch's ProcessGroupNCCL `_comm_ptr()`).
        lsa_barrier_count: LSA barriers of the device communicator (`ncclLsaBarrierSession` indices); default one
            per SM of the device, so every CTA of a kernel may own one.
    """

    name = "nccl"

    def __init__(self, comm_ptr: int | None = None, *, lsa_barrier_count: int | None = None) -> None:
        if comm_ptr is not None and (
            not isinstance(comm_ptr, int) or isinstance(comm_ptr, bool) or comm_ptr <= 0
        ):
            raise EPConfigError(f"comm_ptr: expected a non-null ncclComm_t as an int, got {comm_ptr!r}")
        if lsa_barrier_count is not None and (
            not isinstance(lsa_barrier_count, int)
            or isinstance(lsa_barrier_count, bool)
            or lsa_barrier_count < 0
        ):
            raise EPConfigError(f"lsa_barrier_count: expected an int >= 0, got {lsa_barrier_count!r}")
        self.comm_ptr = comm_ptr
        self.lsa_barrier_count = lsa_barrier_count
        self._nccl: Any = None
        self._comm: Any = None
        self._storages: list[NcclStorage] = []
        self.gin_requirements: dict[str, Any] | None = None  # what the last GIN device communicator asked for

    # -- communicator ---------------------------------------------------------------------------------------
    @property
    def communicator(self) -> Any:
        """The `ep_nccl_gin.Communicator` in use (None before the first buffer / after the last is destroyed)."""
        return self._comm

    def _load(self) -> Any:
        return load_nccl_gin()

    def _ensure_comm(self, bootstrap: Any) -> Any:
        if self._comm is not None:
            self._check_comm(self._comm, bootstrap)
            return self._comm
        n, rank = int(bootstrap.size), int(bootstrap.rank)
        # Every rank reports whether NCCL is usable before anyone waits in ncclCommInitRank.
        try:
            nccl = self._load()
            error = ""
            payload = nccl.get_unique_id() if (rank == 0 and self.comm_ptr is None) else b""
        except EPConfigError as exc:
            nccl, error, payload = None, str(exc), b""
        blobs = bootstrap.allgather((b"E" + error.encode()) if error else (b"K" + payload))
        failed = [(r, b[1:].decode(errors="replace")) for r, b in enumerate(blobs) if b[:1] != b"K"]
        if failed:
            own = dict(failed).get(rank)
            ranks = [r for r, _ in failed]
            raise EPConfigError(
                own
                if own is not None
                else f"transport 'nccl': rank(s) {ranks} cannot use NCCL: {failed[0][1]}"
            )
        self._nccl = nccl
        device = _current_device()
        if self.comm_ptr is not None:
            try:
                comm = nccl.Communicator.from_pointer(self.comm_ptr)
            except (nccl.NcclGinError, ValueError, TypeError) as exc:
                raise EPConfigError(f"comm_ptr: not a usable ncclComm_t ({exc})") from exc
        else:
            uid = blobs[0][1:]
            try:
                comm = nccl.Communicator(uid, n, rank, device=device)
            except nccl.NcclGinError as exc:
                raise EPDeviceError(
                    f"transport 'nccl': ncclCommInitRank of rank {rank} of {n} on device {device} failed: {exc}",
                    rank=rank,
                ) from exc
        try:
            self._check_comm(comm, bootstrap)
        except BaseException:
            if comm.owned:
                with contextlib.suppress(Exception):
                    comm.abort()  # local: safe even if another rank passed the check
            raise
        self._comm = comm
        return comm

    def _check_comm(self, comm: Any, bootstrap: Any) -> None:
        n, rank = int(bootstrap.size), int(bootstrap.rank)
        if (comm.nranks, comm.rank) != (n, rank):
            raise EPConfigError(
                f"comm_ptr: expected a communicator of the bootstrap's {n} ranks with this rank = {rank}, got rank "
                f"{comm.rank} of {comm.nranks}; pass the communicator of the same group (same rank order)"
            )
        device = _current_device()
        if comm.device != device:
            raise EPConfigError(
                f"transport 'nccl': the communicator lives on device {comm.device} but the current CUDA device is "
                f"{device}; make the communicator's device current before creating the buffer"
            )
        team = comm.lsa_team()
        su = int(team.nranks)
        if su < 1 or n % su or team.rank != rank % su or (su > 1 and team.stride != 1):
            raise EPConfigError(
                f"transport 'nccl': NCCL's LSA team (NVLink domain) of rank {rank} has {team.nranks} ranks (index "
                f"{team.rank}, stride {team.stride}); expected all {n} ranks (direct mode) or a divisor S_u of {n} "
                f"consecutive ranks (nodes of ranks r // S_u, index r % S_u, stride 1): order the ranks node by node"
            )

    def _storage_closed(self, storage: NcclStorage, *, collective: bool) -> bool:
        """Forget `storage`; destroy (collective) or abort (local) an owned communicator that nobody uses any
        more. Returns True when the communicator was aborted."""
        with contextlib.suppress(ValueError):
            self._storages.remove(storage)
        comm = self._comm
        if self._storages or comm is None or not comm.owned:
            return False
        self._comm = None
        if collective:
            comm.destroy()
            return False
        with contextlib.suppress(Exception):
            comm.abort()
        return True

    # -- Transport protocol -----------------------------------------------------------------------------------
    def num_nvlink_ranks(self, bootstrap: Any) -> int:
        """The LSA team size (creates the communicator: a collective, like `allocate`)."""
        return int(self._ensure_comm(bootstrap).lsa_team().nranks)

    def allocate(self, bootstrap: Any, num_bytes: int) -> NcclStorage:
        """Collective: `[workspace | data]` of `num_bytes` (workspace included; data rounded up to 2 MiB) from
        ncclMemAlloc, zeroed, registered as a window, with a device communicator."""
        comm = self._ensure_comm(bootstrap)
        nccl = self._nccl
        total = _storage_total_bytes(num_bytes)
        device = _current_device()
        barriers = self.lsa_barrier_count if self.lsa_barrier_count is not None else _device_sms()
        ptr = nccl.mem_alloc(total)
        window = dev_comm = None
        try:
            _zero(ptr, total)
            window = comm.register_window(ptr, total)
            dev_comm = comm.create_dev_comm(lsa_barrier_count=barriers)
            lsa = int(comm.lsa_team().nranks)
            if dev_comm.lsa_size != lsa:
                raise EPConfigError(
                    f"transport 'nccl': the device communicator's LSA team has {dev_comm.lsa_size} ranks, expected "
                    f"{lsa} (the communicator's LSA team)"
                )
        except BaseException:
            # collective calls that failed on one rank may hang the others: release only locally here
            if dev_comm is not None:
                with contextlib.suppress(Exception):
                    dev_comm.destroy()
            if window is not None:
                with contextlib.suppress(Exception):
                    window.deregister()
            with contextlib.suppress(Exception):
                nccl.mem_free(ptr)
            raise
        storage = NcclStorage(self, ptr, total, window, dev_comm, device)
        self._storages.append(storage)
        bootstrap.barrier()
        return storage

    def create_executor(self, config: Any, buffer: Any) -> Any:
        from ep_core.kernels.gpu_executor import GpuExecutor

        storage = buffer.storage
        if not isinstance(storage, NcclStorage):
            raise EPConfigError(
                f"transport 'nccl': expected the buffer's storage from NcclTransport.allocate, got "
                f"{type(storage).__name__}"
            )
        topology = getattr(config, "topology", None)
        if topology is not None:
            self._check_topology(topology, storage, int(config.rank))
            if topology.num_rdma_ranks > 1 and not storage.nccl_devcomm:
                self._setup_gin(storage, config, buffer.bootstrap)
        return GpuExecutor(config, storage, buffer.bootstrap)

    @staticmethod
    def _check_topology(topology: Any, storage: NcclStorage, rank: int) -> None:
        """The buffer's NVLink domains must be NCCL's LSA teams (the kernels address a node's peers through LSA
        pointers and everything else through GIN)."""
        nvl = int(topology.num_nvlink_ranks)
        if nvl != storage.lsa_size:
            raise EPConfigError(
                f"num_nvlink_ranks: over transport 'nccl' it must be NCCL's LSA team size {storage.lsa_size} (rank "
                f"{rank}), got {nvl}; leave it unset (emulated nodes within one NVLink domain run over "
                "transport='ipc')"
            )

    def _setup_gin(self, storage: NcclStorage, config: Any, bootstrap: Any) -> None:
        """Collective: check GIN on every rank, exchange the outcome, then replace the storage's device
        communicator by one with `gin_requirements` and upload it for the kernels."""
        nccl = self._nccl
        topology = config.topology
        barriers = self.lsa_barrier_count if self.lsa_barrier_count is not None else _device_sms()
        reqs = gin_requirements(
            topology,
            num_allocated_qps=int(config.num_allocated_qps),
            sl_idx=int(config.sl_idx),
            lsa_barrier_count=barriers,
        )
        mode = "hybrid mode" if topology.is_hybrid else "direct mode across nodes"
        what = f"{mode} ({topology.num_rdma_ranks} nodes x {storage.lsa_size} ranks) needs GIN between nodes"
        try:
            missing = "; ".join(_gin_blockers(nccl, storage, reqs, hybrid=topology.is_hybrid))
        except Exception as exc:  # a check that cannot run is a blocker too (every rank must hear of it)
            missing = f"the GIN check failed ({exc})"
        _agree(bootstrap, missing, what)  # no rank enters ncclDevCommCreate that another refused
        try:
            dev_comm = self._comm.create_dev_comm(**reqs)
        except (nccl.NcclGinError, ValueError, TypeError) as exc:
            # collective: the other ranks fail in (or hang on) the same call; NCCL's error names the cause
            raise EPConfigError(
                f"transport 'nccl': {what}: ncclDevCommCreate with {reqs} failed on rank {bootstrap.rank}: {exc}"
            ) from exc
        copy = None
        try:
            error = ""
            if dev_comm.lsa_size != storage.lsa_size:
                error = f"the GIN device communicator's LSA team has {dev_comm.lsa_size} ranks, not {storage.lsa_size}"
            elif not dev_comm.gin_available:
                error = "NCCL created the device communicator without GIN contexts (no GIN transport, e.g. no GPUDirect RDMA)"
            else:
                try:
                    copy = _upload(dev_comm.as_bytes())
                except (
                    Exception
                ) as exc:  # reported through the exchange: the peers must not wait for this rank
                    error = f"copying the ncclDevComm to the device failed ({exc})"
            _agree(bootstrap, error, what)
        except BaseException:
            with contextlib.suppress(Exception):
                dev_comm.destroy()
            if copy is not None:
                with contextlib.suppress(Exception):
                    copy.close()
            raise
        storage._use_gin_dev_comm(dev_comm, copy)
        self.gin_requirements = reqs
        bootstrap.barrier()


def _agree(bootstrap: Any, error: str, what: str) -> None:
    """Collective: raise the same `EPConfigError` on every rank when any rank reports an `error` (empty: none)."""
    blobs = bootstrap.allgather(error.encode())
    failed = {r: b.decode(errors="replace") for r, b in enumerate(blobs) if b}
    if failed:
        rank = int(bootstrap.rank)
        first = rank if rank in failed else min(failed)
        raise EPConfigError(
            f"transport 'nccl': {what}, which rank(s) {sorted(failed)} cannot have; rank {first}: {failed[first]}"
        )


def make_transport() -> NcclTransport:
    """The nccl `Transport` of `EPBuffer(transport="nccl")`: an owned communicator per buffer group."""
    return NcclTransport()


class NcclRank(RankDriver):
    """One rank per process over the nccl transport (the `ProcessRank` of ipc): RankDriver's two-phase dispatch
    and combine on an NCCL window. Tests and benchmarks drive the kernels through it without `EPBuffer`."""

    check_routing = True  # (`DispatchLaunch.check_routing`)

    def __init__(
        self,
        bootstrap: Any,
        *,
        num_max_tokens_per_rank: int,
        hidden: int,
        num_topk: int,
        num_bytes: int | None = None,
        gpu_timeout_secs: float = 100.0,
        cpu_timeout_secs: float = 300.0,
        num_warps: int | None = None,
        comm_ptr: int | None = None,
        lsa_barrier_count: int | None = None,
    ) -> None:
        import ep_layout

        from ep_core.kernels._cuda import Stream
        from ep_core.loopback import domain_data_bytes

        size = int(bootstrap.size)
        data = num_bytes or domain_data_bytes(size, num_max_tokens_per_rank, hidden, num_topk)
        self.bootstrap = bootstrap
        self.transport = NcclTransport(comm_ptr, lsa_barrier_count=lsa_barrier_count)
        self.storage = self.transport.allocate(bootstrap, ep_layout.WorkspaceLayout.NUM_ALIGNED_BYTES + data)
        if self.storage.lsa_team_short(size):
            self.storage.close()
            raise EPConfigError(
                f"NcclRank: direct mode within one NVLink domain only, but NCCL's LSA team has "
                f"{self.storage.lsa_size} of {size} ranks (rank {bootstrap.rank}); several nodes run through "
                "EPBuffer(transport='nccl') (hybrid mode, GIN)"
            )
        res = RankResources(
            int(bootstrap.rank),
            size,
            self.storage.ptr,
            data,
            0,
            Stream(),
            nccl_window=self.storage.nccl_window,
            num_ranks_on_device=1,  # NCCL refuses two ranks on one GPU: each rank has its own
        )
        super().__init__(
            res,
            num_max_tokens_per_rank=num_max_tokens_per_rank,
            gpu_timeout_secs=gpu_timeout_secs,
            cpu_timeout_secs=cpu_timeout_secs,
            num_warps=num_warps,
        )

    def close(self) -> None:
        """Collective: drain, barrier, release the window, memory and (owned) communicator."""
        self.stream.synchronize(60.0)
        self.bootstrap.barrier()
        self.storage.close()
