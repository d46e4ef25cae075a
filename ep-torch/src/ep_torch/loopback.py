"""N ranks of ep_torch's buffers in one process: ep-core's loopback domain (DESIGN §4) under the torch surfaces
(ep-torch's README: "Several ranks in one process").

    group = LoopbackGroup(8)
    v1 = group.v1_buffers(low_latency_mode=True)
    outs = group.run(lambda r: v1[r].low_latency_dispatch(xs[r], idxs[r], 128, 256, use_fp8=False))

On a GPU every rank is a real ``ep_core.EPBuffer`` (one ``IpcBuffer.create_loopback`` per group of buffers, its
own GPU executor and torch stream, the device's SMs shared); on the CPU the ranks run ep-core's reference executor.
``run(fn)`` calls ``fn(rank)`` for every rank: on the GPU one after another in this thread, each on its rank's
stream (forked from the current stream and joined back, so one graph captures all ranks); on the CPU in one thread
per rank.

On the GPU, nothing a rank does on the host may wait for its GPU work while later ranks have not launched theirs
(low-latency mode and ``do_cpu_sync=False`` dispatches qualify, a CPU-synced dispatch does not), nor load GPU code
(a lazy kernel load can wait for the running kernels): ep-core's kernels are loaded before their first launch, V1's
(``ep_core.ll_pack``) when the group builds V1's inner buffers, torch kernels run after a rank's communication
kernel must have run once before; frees that wait for the whole device are held until every rank has launched
(``ep_core.kernels._cuda.frees_deferred``). Two ranks' streams sharing one of ``CUDA_DEVICE_MAX_CONNECTIONS``'
hardware queues deadlock: a group raises it to 32 before CUDA starts, and refuses (``EPConfigError``) a context
with fewer queues than its ranks' 2N streams.

Host collectives (building and destroying buffers) run in one thread per rank over ``ep_core.ThreadGroup``
bootstraps, hidden from the caller: the first rank that needs a new inner buffer builds every rank's; a destroyed
buffer is released once every rank of its group destroyed it (inside a GPU ``run()``, after every rank's call was
made). V1 normal mode syncs the host in every call: on the CPU each rank's V1 buffer has a host channel of its own
(a ``ThreadGroup`` bootstrap) and normal mode runs as over gloo; on the GPU it is refused (``_GPU_NORMAL`` says what
to run instead).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from ep_core.bootstrap import ThreadGroup
from ep_core.envelope import Channel
from ep_core.errors import EPConfigError, EPStateError, EPValueError
from ep_core.rank_state import RankState

from .buffer import ElasticBuffer
from .legacy import Buffer
from .transport_choice import TransportChoice

__all__ = ["LoopbackBuffer", "LoopbackElasticBuffer", "LoopbackGroup"]


class _LoopbackStorage:
    """Rank ``rank``'s ``[workspace | data]`` in the group's loopback allocation (an ``IpcStorage`` look-alike)."""

    array_device = "cuda"
    num_host_bytes = 0

    def __init__(self, owner: _LoopbackTransport, rank: int) -> None:
        buf = owner.buffer
        self._owner = owner
        self.ptr = int(buf.bases[rank])
        self.num_bytes = owner.total_bytes
        self.peer_table = buf.peer_table
        self.device = owner.device
        self.rank_devices = owner.rank_devices  # every rank on this GPU: executors split its SMs between them

    def peer_bases(self, num_ranks: int) -> list[int]:
        return [int(b) for b in self._owner.buffer.bases[: int(num_ranks)]]

    def close(self) -> None:
        if self._owner is not None:
            self._owner.release()
            self._owner = None


class _LoopbackTransport:
    """ep-core ``Transport`` of one group of N buffers: the first rank to allocate creates all N buffers (the
    construction's envelope made every rank ask for the same size); freed when the last rank's storage closes."""

    supports_host_memory = False

    def __init__(self, num_ranks: int, device: int) -> None:
        self.num_ranks = num_ranks
        self.device = device
        self.buffer: Any = None
        self.total_bytes = 0
        self.rank_devices: list[str] = []
        self._refs = 0
        self._lock = threading.Lock()

    def num_nvlink_ranks(self, bootstrap: Any) -> int:
        return int(bootstrap.size)

    def allocate(self, bootstrap: Any, num_bytes: int) -> _LoopbackStorage:
        from ep_core.kernels import _cuda
        from ep_core.transports.ipc import IpcBuffer

        data = int(num_bytes) - IpcBuffer.total_bytes(0)  # the workspace comes first (IpcBuffer's layout)
        with self._lock:
            if self.buffer is None:
                # plain allocations (no VMM needed inside one process), zeroed, and the peer table of all N
                self.buffer = IpcBuffer.create_loopback(self.num_ranks, data, use_symmem=False)
                self.total_bytes = IpcBuffer.total_bytes(data)
                self.rank_devices = [_cuda.device_identity()] * self.num_ranks
                self._refs = self.num_ranks
        return _LoopbackStorage(self, int(bootstrap.rank))

    def create_executor(self, config: Any, buffer: Any) -> Any:
        from ep_core.kernels.gpu_executor import GpuExecutor

        return GpuExecutor(config, buffer.storage, buffer.bootstrap)

    def release(self) -> None:
        with self._lock:
            self._refs -= 1
            if self._refs == 0 and self.buffer is not None:
                self.buffer.close()
                self.buffer = None


class _Members:
    """The N buffers built together (one collective); released together once every rank destroyed its own."""

    def __init__(self) -> None:
        self.buffers: list[Any] = []
        self.error: BaseException | None = None
        self.ready = threading.Event()
        self.released: set[int] = set()


class LoopbackElasticBuffer(ElasticBuffer):
    """One rank of a loopback group's ``ElasticBuffer``: ``ElasticBuffer.__init__`` itself, bound (``_connect``) to a
    thread bootstrap and the group's transport instead of a ProcessGroup and the transport choice; every method is
    ``ElasticBuffer``'s. ``destroy()`` releases it; the group frees the N buffers when all are released."""

    def __init__(
        self, loopback: LoopbackGroup, members: _Members, bootstrap: Any, core_transport: Any, **kwargs: Any
    ) -> None:
        self._loopback, self._members = loopback, members
        self._parts = (bootstrap, core_transport)
        super().__init__(None, **kwargs)

    def _connect(self, group: Any, transport: str | None, explicitly_destroy: bool) -> Any:
        """This rank of the group: its thread bootstrap and the group's transport (no ProcessGroup:
        torch.distributed's WORLD, if any, is not this group)."""
        bootstrap, core_transport = self._parts
        cuda = self._loopback.device.type == "cuda"
        n = int(bootstrap.size)
        self.group, self.bootstrap = None, bootstrap
        self.transport_choice = TransportChoice(
            "ipc" if cuda else "reference",
            self._loopback.device,
            f"loopback group: {n} ranks in one process"
            + (" on one GPU (ep-core's loopback domain)" if cuda else " (reference executor)"),
        )
        return core_transport

    def get_comm_stream(self) -> torch.cuda.Stream | None:
        """This rank's own comm stream (the process-wide one would put the ranks, which wait for each other, on one
        stream)."""
        return self._loopback.comm_streams[self.rank_idx]

    def destroy(self) -> None:
        """Release this rank's buffer; the group frees the N buffers once every rank released its own."""
        if self.runtime is None or self.runtime.destroyed:
            raise EPStateError(f"{type(self).__name__}: used after destroy(); create a new buffer")
        self.runtime = None  # before the release: the last rank's release destroys every rank's buffer
        self._loopback._release(self._members, self.rank_idx)

    def _collective_destroy(self) -> None:
        self.runtime = self._core
        ElasticBuffer.destroy(self)


_GPU_NORMAL = (
    "LoopbackBuffer.{op}: V1 normal mode on a GPU loopback group: each call exchanges host data with the peers and "
    "waits on the host for the received counts (V1's CPU sync), while run() launches the ranks one after another in "
    "one thread, so the first rank would wait for ranks not launched yet. Run normal mode on a CPU loopback group "
    "(LoopbackGroup(n, device='cpu'): the same numerics, the reference executor), or on the GPU as processes that "
    "share it (ep_torch.launch.spawn(fn, n), each rank building Buffer(group, ..., transport='ipc') over gloo); "
    "low-latency mode runs here"
)


class LoopbackBuffer(Buffer):
    """One rank of a loopback group's V1 ``Buffer``: V1's code with the inner buffers built by the group. On the CPU
    (rank threads) it has a host channel of its own and runs both modes; on the GPU low-latency mode only
    (normal-mode ``dispatch``/``combine`` refused: ``_GPU_NORMAL``)."""

    def __init__(
        self, loopback: LoopbackGroup, rank: int, *args: Any, host_bootstrap: Any = None, **kwargs: Any
    ) -> None:
        if host_bootstrap is None and (kwargs.get("num_max_tokens_per_rank") or kwargs.get("hidden")):
            raise EPValueError(
                "LoopbackBuffer: num_max_tokens_per_rank/hidden size normal mode, which a GPU loopback group does "
                "not run (a CPU group does)"
            )
        if kwargs.get("transport") is not None:
            raise EPValueError("LoopbackBuffer: transport is the loopback group's (leave it None)")
        self._loopback, self._rank = loopback, int(rank)
        self._host_bootstrap = host_bootstrap
        super().__init__(None, *args, **kwargs)

    def _bind_group(self, group: Any, transport: str | None) -> None:
        self.group = None
        self.rank, self.group_size = self._rank, self._loopback.num_ranks
        self._nvl_ranks = self.group_size  # one domain
        boot = self._host_bootstrap
        # CPU: this rank's own host steps, as a process group's buffer has them (Buffer._bind_group)
        if boot is not None:
            boot.device = torch.device("cpu")
            boot.rank_state = RankState(self.rank, "Buffer")
            self._channel = Channel(boot)

    def _new_inner(self, **kwargs: Any) -> ElasticBuffer:
        return self._loopback._inner(self.rank, kwargs)

    def _make_shrink(self, transport: str | None, check_only: bool = False, ll_native: Any = None) -> Any:
        """Rank masking on a loopback group: the native kernels' device mask on CUDA; a CPU group's host channel
        (normal mode's) does not carry the CPU backend's masked exchange: refused as before it had one."""
        if not check_only and self._channel is not None:
            from .legacy.ll_shrink import shrink_unsupported

            raise shrink_unsupported(
                "Buffer", "a loopback group" + ("" if ll_native else " without ll_native=True")
            )
        return super()._make_shrink(transport, check_only, ll_native)

    def get_comm_stream(self) -> torch.cuda.Stream | None:
        return self._loopback.comm_streams[self.rank]

    def dispatch(self, *args: Any, **kwargs: Any) -> Any:
        if self._channel is None:
            raise NotImplementedError(_GPU_NORMAL.format(op="dispatch"))
        return super().dispatch(*args, **kwargs)

    def combine(self, *args: Any, **kwargs: Any) -> Any:
        if self._channel is None:
            raise NotImplementedError(_GPU_NORMAL.format(op="combine"))
        return super().combine(*args, **kwargs)


def _reserve_queues(num_ranks: int, device: Any) -> None:
    """Enough hardware work queues for the ranks' streams (``ep_core.kernels._cuda.reserve_connections``): a
    compute and a comm stream per rank, plus V1's comm stream per rank and the caller's stream where they fit. Past
    the queues, ranks' streams share one and the kernels that wait for each other deadlock: refused, before any
    kernel could hang, when the context already exists with too few (DeepEP-style ``CUDA_DEVICE_MAX_CONNECTIONS=1``
    or CUDA's default 8 for 8 ranks)."""
    from ep_core.kernels import _cuda

    index = torch.device(device).index if device is not None else None
    have = _cuda.reserve_connections(3 * num_ranks + 1, int(index or 0))
    if 2 * num_ranks > have:
        raise EPConfigError(
            f"LoopbackGroup({num_ranks}): its {2 * num_ranks} streams (a compute and a comm stream per rank) exceed "
            f"the {have} hardware work queues this process's CUDA context was created with "
            "(CUDA_DEVICE_MAX_CONNECTIONS); streams that share a queue are falsely ordered, and the ranks' kernels, "
            "which wait for each other, would deadlock. Create the group before CUDA starts (it raises the variable "
            f"then) or set CUDA_DEVICE_MAX_CONNECTIONS={_cuda.MAX_CONNECTIONS} in the environment"
        )


class LoopbackGroup:
    """``num_ranks`` ranks of ep_torch buffers in this process (see the module docstring). ``device``: ``"cuda"``
    (the current GPU) or ``"cpu"``; None = CUDA when available. ``timeout_secs`` bounds the rank threads' host
    exchanges, ``gpu_timeout_secs`` is the buffers' default ``num_gpu_timeout_secs``."""

    def __init__(
        self,
        num_ranks: int,
        *,
        device: str | torch.device | None = None,
        timeout_secs: float = 120.0,
        gpu_timeout_secs: float = 100.0,
    ) -> None:
        if not isinstance(num_ranks, int) or num_ranks < 1:
            raise EPValueError(f"num_ranks: expected an int >= 1, got {num_ranks!r}")
        kind = (
            torch.device(device).type
            if device is not None
            else ("cuda" if torch.cuda.is_available() else "cpu")
        )
        if kind not in ("cuda", "cpu"):
            raise EPValueError(f"device: expected 'cuda' or 'cpu', got {device!r}")
        if kind == "cuda":
            _reserve_queues(num_ranks, device)
        self.num_ranks = num_ranks
        self.timeout_secs = float(timeout_secs)  # host waits: the rank threads' bootstraps
        # the kernels' wait for peers (every buffer's num_gpu_timeout_secs unless given): a rank that raised before
        # launching leaves the others' kernels waiting this long
        self.gpu_timeout_secs = gpu_timeout_secs
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")
        )
        cuda = kind == "cuda"
        self.streams: list[Any] = [torch.cuda.Stream(self.device) for _ in range(num_ranks)] if cuda else []
        self.comm_streams: list[Any] = (
            [torch.cuda.Stream(self.device, priority=-1) for _ in range(num_ranks)]
            if cuda
            else [None] * num_ranks
        )
        self._ctx = None
        if cuda:
            from ep_core.kernels import _cuda

            drv = _cuda.driver()
            _cuda.native_launch()  # decided once per process: here, not in the first rank thread
            # this process's context, made current in the rank threads
            self._ctx = _cuda.check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
        self._lock = threading.Lock()
        self._asked: list[dict] = [{} for _ in range(num_ranks)]  # rank -> key -> inner buffers asked so far
        self._built: dict = {}  # (key, n-th) -> _Members
        # inside a GPU run(): buffers released by their last rank wait here until every rank has launched (their
        # destruction synchronizes the GPU, which would wait for the kernels of the ranks launched so far, which
        # wait for the ranks not launched yet: V1 rebuilds its inner buffer inside a rank's call)
        self._running = False
        self._deferred: list[_Members] = []

    # --------------------------------------------------------------------------------------------------------------
    # running the ranks

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        """``[fn(0), ..., fn(N-1)]``: on the GPU in this thread, each on its rank's stream (forked from and joined to
        the current stream: capturable); on the CPU in one thread per rank."""
        if self.device.type != "cuda":
            return self._threads(fn)
        from ep_core.kernels._cuda import frees_deferred

        cur = torch.cuda.current_stream()
        out = []
        self._running = True
        try:
            # no free that waits for the device (cuMemFree, a collected buffer) between ranks
            with frees_deferred():
                for r, s in enumerate(self.streams):
                    s.wait_stream(cur)
                    with torch.cuda.stream(s):
                        out.append(fn(r))
        finally:
            self._running = False
            for s in self.streams:
                cur.wait_stream(s)
            self._destroy_deferred()
        return out

    def _threads(self, fn: Callable[[int], Any]) -> list[Any]:
        """``fn(rank)`` in one thread per rank (on the GPU with this process's context and the rank's stream);
        the first error is raised, naming its rank."""
        out: list[Any] = [None] * self.num_ranks
        errors: list[tuple[int, BaseException]] = []

        def body(r: int) -> None:
            try:
                if self.device.type == "cuda":
                    from ep_core.kernels import _cuda

                    _cuda.check(_cuda.driver().cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
                    torch.cuda.set_device(self.device)
                    with torch.cuda.stream(self.streams[r]):
                        out[r] = fn(r)
                else:
                    out[r] = fn(r)
            except BaseException as exc:  # re-raised in the caller's thread
                errors.append((r, exc))

        threads = [
            threading.Thread(target=body, args=(r,), name=f"loopback-rank{r}") for r in range(self.num_ranks)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            r, exc = min(errors, key=lambda e: e[0])
            if hasattr(exc, "add_note"):  # Python >= 3.11
                exc.add_note(f"(raised by loopback rank {r} of {self.num_ranks})")
            raise exc
        return out

    # --------------------------------------------------------------------------------------------------------------
    # buffers

    def elastic_buffers(self, **kwargs: Any) -> list[LoopbackElasticBuffer]:
        """N ranks of ``ElasticBuffer`` (its keywords; ``explicitly_destroy`` is always True), built together."""
        members = _Members()
        self._build(members, kwargs)
        return list(members.buffers)

    def v1_buffers(self, *args: Any, **kwargs: Any) -> list[LoopbackBuffer]:
        """N ranks of V1's ``Buffer`` (its arguments after ``group``); their inner buffers are built on first use
        (or here, sized up front by ``num_max_tokens_per_rank`` and ``hidden``: CPU only). On the CPU each rank gets
        a host channel of its own (one ``ThreadGroup``): normal mode's steps."""
        n = self.num_ranks
        boots: list[Any] = [None] * n
        if self.device.type == "cpu":
            boots = list(ThreadGroup(n, timeout_secs=self.timeout_secs).bootstraps())
        return [LoopbackBuffer(self, r, *args, host_bootstrap=boots[r], **kwargs) for r in range(n)]

    def _build(self, members: _Members, kwargs: dict) -> None:
        kwargs = {k: v for k, v in kwargs.items() if k != "explicitly_destroy"}
        kwargs.setdefault("num_gpu_timeout_secs", self.gpu_timeout_secs)
        boots = ThreadGroup(self.num_ranks, timeout_secs=self.timeout_secs).bootstraps()
        if self.device.type == "cuda":
            transport: Any = _LoopbackTransport(self.num_ranks, int(self.device.index or 0))
        else:
            transport = "reference"
        try:
            members.buffers = self._threads(
                lambda r: LoopbackElasticBuffer(
                    self, members, boots[r], transport, explicitly_destroy=True, **kwargs
                )
            )
        except BaseException as exc:
            members.error = exc
            raise
        finally:
            members.ready.set()

    def _inner(self, rank: int, kwargs: dict) -> LoopbackElasticBuffer:
        """Rank ``rank``'s next inner buffer of these keywords: built for every rank by the first rank to ask."""
        key = tuple(sorted(kwargs.items()))
        with self._lock:
            nth = self._asked[rank].get(key, 0)
            self._asked[rank][key] = nth + 1
            members = self._built.get((key, nth))
            build = members is None
            if build:
                members = self._built[(key, nth)] = _Members()
        assert members is not None
        if build:
            if self.device.type == "cuda":
                # V1's kernels loaded before any rank launches: a load inside a rank's call (after its kernel that
                # waits for the next ranks) could wait for that kernel
                from .legacy import ll_kernels as legacy_ll_kernels

                legacy_ll_kernels.preload()
            self._build(members, kwargs)
        elif not members.ready.wait(self.timeout_secs):
            raise EPStateError(f"loopback rank {rank}: the group's inner buffer was not built in time")
        if members.error is not None:
            raise EPStateError(
                f"loopback rank {rank}: building the group's inner buffers failed: {members.error}"
            )
        return members.buffers[rank]

    def _release(self, members: _Members, rank: int) -> None:
        with self._lock:
            members.released.add(rank)
            last = len(members.released) == self.num_ranks
            if last:
                for k in [k for k, m in self._built.items() if m is members]:
                    del self._built[k]
        if last:
            if self._running:
                self._deferred.append(members)
            else:
                self._threads(lambda r: members.buffers[r]._collective_destroy())

    def _destroy_deferred(self) -> None:
        while self._deferred:
            members = self._deferred.pop(0)
            self._threads(lambda r, m=members: m.buffers[r]._collective_destroy())

    def close(self) -> None:
        """Synchronize the GPU (the buffers are freed by their ``destroy()``)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()
