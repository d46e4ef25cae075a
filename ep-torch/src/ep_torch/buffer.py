"""``ElasticBuffer`` (DeepEP V2's surface, planner policy V2) and ``EPBuffer`` (the newer surface, policy V2.5).

A user switches from DeepEP by changing one import. Both classes are thin layers on ``ep_core.EPBuffer`` (kept as
``self.runtime``, like DeepEP's C++ runtime): ep-core validates every call (SPEC §6), plans SMs and QPs, and runs
the operation on its executor; this layer adds what is torch-specific:

- the bootstrap over the ProcessGroup (:class:`~ep_torch.bootstrap.ProcessGroupBootstrap`);
- outputs allocated as torch tensors (on the comm stream with ``allocate_on_comm_stream=True``);
- DeepEP's return tuples, the column-major scale view, ``EventOverlap`` objects and the stream rules of behaviour
  doc §1.8.

Backends (``transport``): ``"reference"`` for CPU tensors on a gloo group (ep-core's reference executor: the
operations are all-gathers plus ``ep_core.reference``, bit-identical to the oracle the kernels are tested
against); ``"ipc"`` / ``"nccl"`` for CUDA tensors (ep-core's GPU transports and kernels). The automatic choice, and
when the nccl transport borrows the group's communicator, are :mod:`ep_torch.transport_choice`'s rules.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from collections.abc import Iterator
from typing import Any

import ep_core
import numpy as np
import torch
import torch.distributed as dist
from ep_core import device_array, planner
from ep_core.errors import EPStateError, EPTypeError, EPValueError
from ep_core.handle import EPHandle
from ep_core.planner import PlannerPolicy
from ep_core.requests import CombineArgs, DispatchArgs
from ep_core.topology import Topology

from . import _env, host_extension
from .bootstrap import ProcessGroupBootstrap
from .elastic_ops import ElasticOps
from .event import EventHandle, EventOverlap
from .transport_choice import (
    choose_transport,
    data_device,
    make_core_transport,
    ranks_per_host,
    scaleup_ranks,
)
from .zero_copy_tensors import ZeroCopyTensors

__all__ = ["EPBuffer", "ElasticBuffer", "topk_idx_t"]

#: dtype of expert ids (``deep_ep.topk_idx_t``).
topk_idx_t = torch.int64

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint16": torch.uint16,
    "uint32": torch.uint32,
    "uint64": torch.uint64,
    "bool": torch.bool,
}


def _plain(a: Any) -> Any:
    """``a`` without autograd history (DLPack refuses tensors that require grad; autograd is ep_torch.functional's
    business), keeping tuples and non-tensors as they are so that ep-core validates them. A tensor that needs no
    grad is passed as it is (a detached alias would be the same memory, shape and strides, at the cost of a new
    tensor object per call)."""
    if isinstance(a, torch.Tensor):
        return a.detach() if a.requires_grad else a
    if isinstance(a, tuple):
        return tuple(_plain(v) for v in a)
    return a


def _current_stream(index: int | None = None) -> int:
    """The raw handle of the current CUDA stream of device ``index`` (None: the current device), the stream the
    operation is ordered after, read without building a ``torch.cuda.Stream`` object when torch offers it
    (``torch.cuda.current_stream(index).cuda_stream`` otherwise)."""
    if index is None:
        index = torch.cuda.current_device()
    if _raw_stream is not None:
        return _raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


_NO_SCOPE = contextlib.nullcontext()  # reusable: the scope of a call that needs no comm-stream context

# torch's own accessor of the raw current stream (what torch.compile's generated code calls); None if absent
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _handle_tensors(handle: Any) -> tuple:
    """The tensors a dispatch's kernels wrote into its new handle (the routing copy, the int32 arrays; a repeated
    dispatch's still in their one block): an async call records them on the streams like its outputs, so that a
    handle dropped before the comm stream is done cannot give their memory back early."""
    return tuple([v for v in handle.held() if isinstance(v, torch.Tensor)])


def _flat(items: Any) -> Iterator[Any]:
    for a in items:
        if isinstance(a, tuple):
            yield from _flat(a)
        else:
            yield a


class _ExpressLane:
    """One of ep-core's express lanes (`ep_core.kernels.express`) and the scalars of the call it was made from,
    which `dispatch` / `combine` compare with a later call's (`_same`: by identity, or as equal ints; never
    equal-but-other objects, 16.0 for 16, True for 1, which are other keys for ep-core's validation). `run` is the
    lane itself."""

    __slots__ = ("run", "scalars")

    def __init__(self, run: Any, scalars: tuple) -> None:
        self.run = run
        self.scalars = scalars

    @classmethod
    def make(
        cls, core: Any, op: str, arrays: tuple, scalars: tuple, handle: Any = None
    ) -> _ExpressLane | None:
        """`core.last_plan(op, match, handle)` (ep_core's `EPBuffer`) for the call just run with these
        arrays, or None: no host extension (the allocator offers no `batch`), arrays a signature cannot hold, or
        a call ep-core's lane does not serve. An FP8 ``x`` (a ``(data, scales)`` tuple) is matched as its two
        tensors: `match` returns both pointers, then the others'."""
        native = host_extension.module()
        x = arrays[0]
        if native is None:
            return None
        try:
            if type(x) is torch.Tensor:
                match = native.signature(*arrays).match
            elif type(x) is tuple and len(x) == 2 and type(x[0]) is type(x[1]) is torch.Tensor:
                pair = native.signature(x[0], x[1], *arrays[1:]).match

                def match(x: Any, *rest: Any) -> Any:
                    return pair(x[0], x[1], *rest) if type(x) is tuple and len(x) == 2 else None

            else:
                return None
        except (TypeError, ValueError):  # a subclass, autograd, a layout describe reads itself
            return None
        lane = core.last_plan(op, match, handle)
        return None if lane is None else cls(lane, scalars)


def _received(recv_x: Any, recv_sf: Any, col_major: Any) -> Any:
    """A dispatch's ``recv_x`` as DeepEP returns it: ``(data, scales)`` iff it received FP8 scales; column-major
    scales as the logical ``[R, P]`` view of their storage ``[P, align(R, 4)]``."""
    if recv_sf is None:
        return recv_x
    if col_major:
        recv_sf = recv_sf.t()[: recv_x.shape[0]]
    return recv_x, recv_sf


def _view_tensor(arr: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """An array of the buffer's own memory (ep-core's ``DeviceArray``: a zero-copy output, the combine buffer) as a
    tensor of ``dtype`` over the same memory: torch reads bf16 / FP8 bits as uint16 / uint8, then reinterprets them
    (the same item size). On the CPU reference backend through numpy's array interface, whose array keeps the
    ``DeviceArray`` (and so the executor's host memory) alive."""
    if arr is None:
        return None
    if arr.device == "cpu":
        t = torch.from_numpy(np.asarray(arr))
    else:  # the rank's own memory, on its own device
        t = torch.as_tensor(arr, device=device)
    return t if t.dtype == dtype else t.view(dtype)


def _same(a: tuple, b: tuple) -> bool:
    """Whether a call's scalars are the recorded call's (`_ExpressLane`): each the same object, or an int equal to
    a recorded int (a count computed anew on each call, such as ``x.shape[0]`` above the small-int cache). Never
    an equal value of another type (``16.0`` for ``16``, ``True`` for ``1``): validation keys those apart."""
    return all(map(operator.is_, a, b)) or all(map(_same_scalar, a, b))


def _same_scalar(a: Any, b: Any) -> bool:
    return a is b or (type(a) is int and type(b) is int and a == b)


class ElasticBuffer(ElasticOps):
    """An expert-parallel communication buffer over ``group`` (DeepEP V2's ``ElasticBuffer``).

    Keyword arguments, defaults, methods and return tuples are DeepEP's (behaviour doc §1.2-1.6). Ours, keyword
    only: ``transport`` (``"reference"``, ``"ipc"``, ``"nccl"``; None = automatic: ``reference`` for CPU groups;
    for nccl groups ``nccl`` when every rank has its own GPU and NCCL >= 2.28.7, else ``ipc``;
    ``EPKIT_TORCH_TRANSPORT`` overrides the default). ``transport_choice`` says what was picked and why.
    """

    # the express lanes (set per buffer in __init__; None here for buffers made without it)
    _express: _ExpressLane | None = None
    _express_cached: _ExpressLane | None = None
    _express_combine: _ExpressLane | None = None
    _express_combine_zero_copy: _ExpressLane | None = None
    _express_zero_copy: _ExpressLane | None = None
    _express_sync: _ExpressLane | None = None

    policy: PlannerPolicy = PlannerPolicy.V2

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        num_bytes: int | None = None,
        num_cpu_bytes: int = 0,
        num_max_tokens_per_rank: int = 0,
        hidden: int = 0,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        deterministic: bool = False,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
        prefer_overlap_with_compute: bool = True,
        sl_idx: int = 3,
        num_allocated_qps: int = 0,
        num_cpu_timeout_secs: int = 300,
        num_gpu_timeout_secs: int = 100,
        explicitly_destroy: bool = False,
        *,
        transport: str | None = None,
    ) -> None:
        core_transport = self._connect(group, transport, bool(explicitly_destroy))
        self.rank_idx = self.bootstrap.rank
        self.num_ranks = self.bootstrap.size
        self.transport, self.device = self.transport_choice.name, self.transport_choice.device
        # read on every call: whether operations are CUDA ones, the device whose current stream they follow, and
        # the output allocators by device (`_allocator`)
        self._cuda = self.device.type == "cuda"
        self._device_index: int | None = self.device.index
        self._allocators: dict = {}
        # the express lanes of the last plain no-sync dispatch, cached dispatch and combine (`dispatch`, `combine`)
        self._express: _ExpressLane | None = None
        self._express_cached: _ExpressLane | None = None
        self._express_combine: _ExpressLane | None = None
        self._express_sync: _ExpressLane | None = None  # the same for a plain CPU-sync dispatch
        self.allow_hybrid_mode = bool(allow_hybrid_mode)
        self.allow_multiple_reduction = bool(allow_multiple_reduction)
        self.prefer_overlap_with_compute = bool(prefer_overlap_with_compute)
        self.deterministic = bool(deterministic)
        self.explicitly_destroy = bool(explicitly_destroy)
        self.runtime: ep_core.EPBuffer | None = ep_core.EPBuffer(
            self.bootstrap,
            transport=core_transport,
            num_bytes=num_bytes,
            num_cpu_bytes=int(num_cpu_bytes),
            num_max_tokens_per_rank=int(num_max_tokens_per_rank),
            hidden=int(hidden),
            num_topk=int(num_topk),
            use_fp8_dispatch=bool(use_fp8_dispatch),
            deterministic=self.deterministic,
            allow_hybrid_mode=self.allow_hybrid_mode,
            allow_multiple_reduction=self.allow_multiple_reduction,
            prefer_overlap_with_compute=self.prefer_overlap_with_compute,
            sl_idx=int(sl_idx),
            num_allocated_qps=int(num_allocated_qps),
            num_cpu_timeout_secs=num_cpu_timeout_secs,
            num_gpu_timeout_secs=num_gpu_timeout_secs,
            explicitly_destroy=self.explicitly_destroy,
            policy=self.policy,
            # EPKIT_SCALEUP_RANKS: emulated nodes of S_u ranks (hybrid mode); None = the transport's NVLink domain
            num_nvlink_ranks=self.transport_choice.scaleup_ranks,
        )
        rt = self.runtime
        self._core = rt  # kept after destroy(): a call on a destroyed buffer is still announced to the peers
        self.num_bytes = rt.num_bytes
        self.num_cpu_bytes = rt.config.num_cpu_bytes
        self.num_max_tokens_per_rank = rt.num_max_tokens_per_rank
        self.num_allocated_qps = rt.num_allocated_qps
        self.sl_idx = rt.config.sl_idx
        self.num_scaleout_ranks, self.num_scaleup_ranks = rt.get_logical_domain_size()
        self.scaleout_rank_idx = self.rank_idx // self.num_scaleup_ranks
        self.scaleup_rank_idx = self.rank_idx % self.num_scaleup_ranks
        self.num_rdma_ranks, self.num_nvlink_ranks = rt.get_physical_domain_size()
        self._functional_id: int | None = None
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _connect(
        self, group: dist.ProcessGroup | None, transport: str | None, explicitly_destroy: bool
    ) -> Any:
        """Bind this buffer to its ranks: sets ``group``, ``bootstrap`` (the host collectives) and
        ``transport_choice``, and returns ep-core's transport for them. ``ep_torch.loopback`` overrides it to bind one
        rank of a loopback group (a thread bootstrap and the group's transport) to the same constructor."""
        self.group = dist.group.WORLD if group is None else group
        self.bootstrap = ProcessGroupBootstrap(self.group)
        self.transport_choice = choose_transport(
            transport, self.bootstrap, self.group, explicitly_destroy=explicitly_destroy
        )
        return make_core_transport(self.transport_choice)

    # ----------------------------------------------------------------------------------------------------------------
    # lifecycle

    def _rt(self) -> ep_core.EPBuffer:
        if self.runtime is None or self.runtime.destroyed:
            raise EPStateError(f"{type(self).__name__}: used after destroy(); create a new buffer")
        return self.runtime

    def destroy(self) -> None:
        """Release the buffer (a collective). Only for buffers built with ``explicitly_destroy=True``."""
        if not self.explicitly_destroy:
            raise EPStateError(
                "destroy(): this buffer was created with explicitly_destroy=False and is released automatically; "
                "pass explicitly_destroy=True to the constructor to manage its lifetime yourself"
            )
        rt = self._rt()
        self._express = self._express_cached = self._express_combine = self._express_sync = None
        self._express_combine_zero_copy = self._express_zero_copy = None
        self.__dict__.pop("_zero_copy_tensors", None)  # tensors over the memory released below
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        rt.destroy()  # a barrier first: no peer copies into this rank's signal words any more
        self.runtime = None
        self._release_elastic()

    def _release_elastic(self) -> None:
        """Free the PP/Engram/AGRS state now (ep_torch.elastic_ops): its signal words, host NUMA storage and
        host-mapped timeout record are allocations of their own, outside the runtime's storage."""
        st = self.__dict__.pop("_elastic_state", None)
        close = getattr(getattr(st, "backend", None), "close", None)
        if close is not None:
            close()

    def __enter__(self) -> ElasticBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.explicitly_destroy and self.runtime is not None and not self.runtime.destroyed:
            self.destroy()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(rank={self.rank_idx}/{self.num_ranks}, transport={self.transport}"
            + (f" ({self.transport_choice.communicator} communicator)" if self.transport == "nccl" else "")
            + f", num_bytes={self.num_bytes}, domains={self.num_scaleout_ranks}x{self.num_scaleup_ranks})"
        )

    # ----------------------------------------------------------------------------------------------------------------
    # sizes, planner, domains

    @staticmethod
    def get_buffer_size_hint(
        group: dist.ProcessGroup | None,
        num_max_tokens_per_rank: int,
        hidden: int,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
    ) -> int:
        """Bytes a buffer needs for these sizes (2 MiB aligned; SPEC §4). A collective over ``group``."""
        boot = ProcessGroupBootstrap(dist.group.WORLD if group is None else group)
        name, _ = data_device(None, boot.device)
        # EPKIT_SCALEUP_RANKS, else one domain on the reference backend; a CUDA group's domain is NCCL's LSA team,
        # which would need a communicator just for a size: ranks per host stand in for it (several hosts: hybrid)
        nvl = scaleup_ranks(name or "auto", boot.size, boot.rank)
        if nvl is None:
            nvl = boot.size if name == "reference" else ranks_per_host(boot)
        topology = Topology(boot.size, nvl, bool(allow_hybrid_mode))
        return planner.get_buffer_size_hint(
            topology,
            num_max_tokens_per_rank,
            hidden,
            num_topk,
            bool(use_fp8_dispatch),
            bool(allow_multiple_reduction),
        )

    def get_theoretical_num_sms(
        self,
        num_experts: int,
        num_topk: int,
        num_scaleout_topk: int = 0,
        rdma_gbs: float = 0,
        nvlink_gbs: float = 0,
        sm_read_gbs: float = 200,
        sm_write_gbs: float = 50,
    ) -> int:
        """SMs the bandwidth model asks for (SPEC §5; policy V2 for ElasticBuffer, V2.5 for EPBuffer)."""
        return self._rt().get_theoretical_num_sms(
            num_experts, num_topk, num_scaleout_topk, rdma_gbs, nvlink_gbs, sm_read_gbs, sm_write_gbs
        )

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """QPs for ``num_sms``: ``min(sms, 9)`` direct, ``16*sms + 1`` hybrid, capped by the allocated QPs."""
        return self._rt().get_theoretical_num_qps(num_sms)

    def get_physical_domain_size(self) -> tuple[int, int]:
        """``(num_rdma_ranks, num_nvlink_ranks)``."""
        return self._rt().get_physical_domain_size()

    def get_logical_domain_size(self) -> tuple[int, int]:
        """``(num_scaleout_ranks, num_scaleup_ranks)``: ``(1, N)`` in direct mode."""
        return self._rt().get_logical_domain_size()

    # ----------------------------------------------------------------------------------------------------------------
    # streams, events, barrier

    @staticmethod
    def capture() -> EventHandle:
        """An event recorded on the current stream (a completed event without CUDA)."""
        return EventHandle()

    def get_comm_stream(self) -> torch.cuda.Stream | None:
        """The process-wide high-priority communication stream (None on the CPU reference backend)."""
        if self.device.type != "cuda":
            return None
        from ._streams import comm_stream

        return comm_stream(self.device)

    def reset(self) -> None:
        """Recover after a failed operation (ours; DeepEP has none): a collective, every rank calls it.

        After a timeout or a peer's abort every call raises the recorded error instead of returning garbage;
        ``reset()`` waits for this rank's streams, clears the buffer's state with the peers, and the buffer works as
        new (handles of no-sync dispatches in flight during the failure stay refused)."""
        rt = self._rt()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        rt.reset()

    def barrier(
        self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True
    ) -> None:
        """A barrier over every rank of the buffer (on the comm stream, ordered after the compute stream)."""
        rt = self._rt()
        cuda = self.device.type == "cuda"
        if cuda and with_cpu_sync:
            torch.cuda.synchronize()
        with self._on_comm_stream(use_comm_stream and cuda, None, wait_back=True):
            rt.barrier()
        if cuda and with_cpu_sync:
            torch.cuda.synchronize()

    @contextlib.contextmanager
    def _on_comm_stream(
        self, enabled: bool, previous_event: EventHandle | None, *, wait_back: bool
    ) -> Iterator[None]:
        """Make the comm stream current for the body (allocations and the operation are ordered on it): it first
        waits for ``previous_event``, or else for the compute stream; afterwards the compute stream waits for it
        unless ``wait_back`` is False (the async case: the caller waits on the returned event)."""
        if not enabled:
            yield
            return
        compute = torch.cuda.current_stream()
        comm = self.get_comm_stream()
        assert comm is not None
        if previous_event is not None:
            previous_event.stream_wait(comm)
        else:
            comm.wait_stream(compute)
        with torch.cuda.stream(comm):
            yield
        if wait_back:
            compute.wait_stream(comm)

    # ----------------------------------------------------------------------------------------------------------------
    # dispatch / combine

    def _allocator(self, device: torch.device) -> Any:
        """Outputs as torch tensors on ``device``, from the caching allocator of the current stream (one allocator
        per device, reused by every call). It offers ``int32_block``: a new handle's int32 arrays as disjoint views
        of one ``torch.empty`` (``ep_core.kernels.array_block``; they all belong to the one handle returned), and
        ``handle_block``: the same block, each view made when the handle's field is first read; with the host
        extension also ``batch``: a callable making several outputs in one C call (ep-core's express lane)."""
        allocators = self.__dict__.setdefault("_allocators", {})
        allocate = allocators.get(device)
        if allocate is None:
            # on the CPU only when asked for (EPKIT_TORCH_HOST_EXTENSION=1): the CPU reference backend has no use
            # for it, and a CPU-only install should not compile anything
            wanted = device.type == "cuda" or _env.host_extension() == "1"
            native = host_extension.module() if wanted else None
            if native is not None:
                # at::empty in one C call (torch's Python argument parser skipped); the extension also reads the
                # tensors' facts for ep_core's describe from now on
                device_array.set_torch_reader(native.facts)
                empty, index = (
                    native.empty,
                    (torch.cuda.current_device() if device.index is None else device.index)
                    if device.type == "cuda"
                    else -1,
                )

                def allocate(shape: tuple[int, ...], dtype: str) -> torch.Tensor:
                    return empty(shape, _TORCH_DTYPES[dtype], index)

                def batch(specs: tuple) -> Any:
                    # ep-core's express lane: one call that makes every (shape, dtype name) of `specs`
                    made = tuple([(tuple(shape), _TORCH_DTYPES[name]) for shape, name in specs])
                    return functools.partial(native.empty_many, made, index)

                allocate.batch = batch  # type: ignore[attr-defined]

            else:

                def allocate(shape: tuple[int, ...], dtype: str) -> torch.Tensor:
                    # `size=` by keyword: torch's argument parser then skips the varargs-size overload it otherwise
                    # tries first on a tuple (about half a microsecond of every allocation)
                    return torch.empty(size=shape, dtype=_TORCH_DTYPES[dtype], device=device)

            from ep_core.kernels import array_block

            # through the module attribute: benchmarks' step timers (ep-core/benchmarks/host_steps.py) see it
            allocate.int32_block = lambda shapes: array_block.int32_block(allocate, shapes)  # type: ignore[attr-defined]
            # the same block with no view made: a repeated dispatch's new handle views a field when it is read
            allocate.handle_block = lambda shapes: array_block.carve(allocate, shapes)  # type: ignore[attr-defined]
            # exact shapes and dtypes on `device`: ep-core records the handles made from it as validated
            allocate.ep_core_trusted = True  # type: ignore[attr-defined]
            allocators[device] = allocate
        return allocate

    def _announced(self, op: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(...)`` inside this buffer's announcement block (``ep_core.EPBuffer.announcing``): an error it raises
        before this rank took part in the operation's exchange (a bad ``previous_event``, a call after
        ``destroy()``, the capture check, ep-core's validation) is announced to the peers once (they raise
        ``EPPeerError`` naming this rank instead of pairing this rank's next call with theirs; on the GPU backends
        the rejected call gives up its device sequence number instead). For methods that have no block of their
        own (``ElasticOps``); ``dispatch`` and ``combine`` open the block themselves."""
        with self._core.announcing(op):
            return fn(*args, **kwargs)

    def _check_capture(self, op: str, do_cpu_sync: bool | None, handle: Any) -> None:
        if op != "dispatch" or handle is not None or do_cpu_sync is False:
            return  # nothing this check refuses (and no capture query: it costs a microsecond per call)
        if self.device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            return
        if do_cpu_sync is None or bool(do_cpu_sync):
            raise EPValueError(
                "do_cpu_sync: a dispatch inside CUDA-graph capture must not sync with the CPU; pass "
                "do_cpu_sync=False (worst-case shapes) or a cached handle"
            )

    def _event(self, async_with_compute_stream: bool, keep: tuple[Any, ...]) -> EventOverlap:
        """The returned ``EventOverlap``: None unless async; on CUDA an event recorded on the stream the operation
        ended on, with every operand ``record_stream``-ed on both streams (or kept in the event with
        ``EPKIT_AVOID_RECORD_STREAM=1``)."""
        if not async_with_compute_stream:
            return EventOverlap(None)
        if self.device.type != "cuda":
            return EventOverlap(EventHandle(device="cpu"))
        event = EventHandle(torch.cuda.current_stream())
        tensors = [t for t in _flat(keep) if isinstance(t, torch.Tensor) and t.is_cuda]
        if _env.avoid_record_stream():
            return EventOverlap(event, extra_tensors=tensors)
        comm = self.get_comm_stream()
        for t in tensors:
            t.record_stream(torch.cuda.current_stream())
            if comm is not None:
                t.record_stream(comm)
        return EventOverlap(event)

    def _dispatch_event(
        self, async_with_compute_stream: Any, x: Any, idx: Any, w: Any, res: Any
    ) -> EventOverlap:
        if not async_with_compute_stream:
            return EventOverlap(None)
        keep = (x, idx, w, res.recv_x, res.recv_sf, res.recv_topk_idx, res.recv_topk_weights)
        return self._event(True, (*keep, *_handle_tensors(res.handle)))

    def _combine_event(
        self, async_with_compute_stream: Any, x: Any, w: Any, bias: Any, res: Any
    ) -> EventOverlap:
        if not async_with_compute_stream:
            return EventOverlap(None)
        return self._event(True, (x, w, bias, res.combined_x, res.combined_topk_weights))

    def _streams(
        self, allocate_on_comm_stream: Any, previous_event: Any, async_with_compute_stream: Any
    ) -> tuple[Any, bool]:
        """What one operation runs in: the comm-stream context (a null context unless it allocates on the comm
        stream or waits on ``previous_event``), and whether it is a CUDA operation (ordered after the stream that is
        current inside that context)."""
        if previous_event is not None and not isinstance(previous_event, EventHandle):
            raise EPTypeError(
                f"previous_event: expected an EventHandle (buffer.capture()), got {type(previous_event).__name__}"
            )
        if self.device.type != "cuda":
            return contextlib.nullcontext(), False
        if allocate_on_comm_stream or previous_event is not None:
            return self._on_comm_stream(True, previous_event, wait_back=not async_with_compute_stream), True
        return contextlib.nullcontext(), True

    def dispatch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        num_experts: int | None = None,
        num_max_tokens_per_rank: int | None = None,
        expert_alignment: int | None = None,
        num_sms: int = 0,
        num_qps: int = 0,
        previous_event: EventHandle | None = None,
        previous_event_before_epilogue: EventHandle | None = None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
        handle: EPHandle | None = None,
        do_handle_copy: bool = True,
        do_cpu_sync: bool | None = None,
        do_expand: bool = False,
        do_zero_padding: bool = False,
        use_tma_aligned_col_major_sf: bool = False,
        *,
        zero_copy: bool = False,
    ) -> tuple[Any, torch.Tensor | None, torch.Tensor | None, EPHandle, EventOverlap]:
        """Send every token to the ranks of its top-k experts (SPEC §2).

        Returns ``(recv_x, recv_topk_idx, recv_topk_weights, handle, event)``; ``recv_x`` is a ``(data, sf)`` tuple
        iff ``x`` was one; ``recv_topk_idx`` is None with ``do_expand=True``; ``event`` holds an event only with
        ``async_with_compute_stream=True``. With ``handle=`` this is a cached dispatch: same rows, same order, and the
        returned handle is the one given.

        ``zero_copy=True`` (an ep extension): the dispatch stores every output in its final place in the buffer's own
        memory (the receive region on the GPU) and ``recv_x``, its scales, ``recv_topk_idx`` and
        ``recv_topk_weights`` are views of it, rows in the deterministic order, with no copy epilogue. They are valid
        until the next dispatch or combine on this buffer; bf16 ``recv_x`` is the memory of
        :meth:`get_combine_buffer` for the returned handle, so the expert computation may write its outputs over the
        rows it has read, then ``combine(..., zero_copy=True)``. Non-expanded layout, no ``handle`` (not cached),
        row-major scales (no ``use_tma_aligned_col_major_sf``), direct mode in one NVLink domain; every rank of the
        call passes it alike. The handle is an ordinary one (combine, cached dispatch).
        """
        # the express lanes (`ep_core.EPBuffer.last_plan`): a repeat of the last dispatch of its kind (no handle:
        # no-sync, CPU-sync with the same `do_cpu_sync` object, or zero-copy; or a cached dispatch of the same
        # handle) without events, stats or comm-stream scope, every scalar the same object as that call's (so the
        # same prepared entry), the arrays compared by the lane's `match`
        plain = (
            handle is None
            and previous_event is None
            and previous_event_before_epilogue is None
            and cumulative_local_expert_recv_stats is None
            and async_with_compute_stream is False
            and allocate_on_comm_stream is False
            and do_handle_copy is True
        )
        lane_scalars = (
            num_experts,
            num_max_tokens_per_rank,
            expert_alignment,
            num_sms,
            num_qps,
            do_cpu_sync,
            use_tma_aligned_col_major_sf,
            do_expand,
            do_zero_padding,
        )
        if zero_copy is False:
            lane = self._express if do_cpu_sync is False else self._express_sync
        else:  # a zero-copy dispatch's outputs are views of the buffer's memory, as tensors of x's dtypes
            lane = self._express_zero_copy if zero_copy is True and do_cpu_sync is False else None
            data, sf = x if isinstance(x, tuple) and len(x) == 2 else (x, None)
        if handle is not None and zero_copy is False:
            lane = self._express_cached
            scalars = (
                topk_idx,
                cumulative_local_expert_recv_stats,
                num_experts,
                num_max_tokens_per_rank,
                expert_alignment,
                num_sms,
                num_qps,
                previous_event,
                previous_event_before_epilogue,
                async_with_compute_stream,
                allocate_on_comm_stream,
                do_handle_copy,
                do_cpu_sync,
                do_expand,
                do_zero_padding,
                use_tma_aligned_col_major_sf,
            )
            if lane is not None and _same(scalars, lane.scalars):
                got = lane.run(
                    x, handle, topk_weights, _current_stream(self._device_index) if self._cuda else 0
                )
                if got is not None:
                    return (
                        got.recv_x,
                        got.recv_topk_idx,
                        got.recv_topk_weights,
                        got.handle,
                        EventOverlap(None),
                    )
        elif plain and lane is not None and _same(lane_scalars, lane.scalars):
            if do_cpu_sync is not False:
                try:  # a CPU sync inside CUDA-graph capture: the caller's error
                    self._check_capture("dispatch", do_cpu_sync, None)
                except Exception:
                    # refused before any launch: announced (the step given up) as on the ordinary road
                    with self._core.announcing("dispatch"):
                        raise
            got = lane.run(
                x, topk_idx, topk_weights, _current_stream(self._device_index) if self._cuda else 0
            )
            if got is not None:
                if zero_copy is not False:
                    recv_x, recv_idx, recv_w = self._zero_copy_outputs(data, sf, *got[:4])
                    return recv_x, recv_idx, recv_w, got[4], EventOverlap(None)
                recv_x = _received(got[0], got[1], use_tma_aligned_col_major_sf)
                return recv_x, got[2], got[3], got[4], EventOverlap(None)
        with self._core.announcing("dispatch"):
            rt = self._rt()
            if handle is None and do_cpu_sync is not False:
                self._check_capture("dispatch", do_cpu_sync, handle)
            if handle is not None and not do_expand and isinstance(handle, EPHandle) and zero_copy is False:
                do_expand = handle.do_expand  # DeepEP: a cached dispatch takes its layout from the handle
            first = x[0] if isinstance(x, tuple) and len(x) == 2 else x
            device = first.device if isinstance(first, torch.Tensor) else self.device
            # the common case (no previous event, outputs on the compute stream): no comm-stream scope to build
            if previous_event is None and not allocate_on_comm_stream:
                scope, cuda = _NO_SCOPE, self._cuda
            else:
                scope, cuda = self._streams(
                    allocate_on_comm_stream, previous_event, async_with_compute_stream
                )
            with scope:
                res = rt.run_dispatch(
                    DispatchArgs(
                        x if type(x) is torch.Tensor and not x.requires_grad else _plain(x),
                        _plain(topk_idx) if topk_idx is not None else None,
                        _plain(topk_weights) if topk_weights is not None else None,
                        None
                        if cumulative_local_expert_recv_stats is None
                        else _plain(cumulative_local_expert_recv_stats),
                        num_experts,
                        num_max_tokens_per_rank,
                        expert_alignment,
                        num_sms,
                        num_qps,
                        previous_event,
                        previous_event_before_epilogue,
                        bool(async_with_compute_stream),
                        bool(allocate_on_comm_stream),
                        handle,
                        bool(do_handle_copy),
                        None if do_cpu_sync is None else bool(do_cpu_sync),
                        bool(do_expand),
                        bool(do_zero_padding),
                        bool(use_tma_aligned_col_major_sf),
                        self._allocators.get(device) or self._allocator(device),
                        _current_stream(self._device_index) if cuda else 0,
                        zero_copy,
                    )
                )
                # a zero-copy dispatch's outputs are the buffer's memory, not the caching allocator's: only the
                # handle's tensors need recording on the streams
                event = self._dispatch_event(async_with_compute_stream, x, topk_idx, topk_weights, res)
            # the express lane of this call, for the next one (the allocator offers `batch` where the host
            # extension is loaded)
            lanes = scope is _NO_SCOPE and getattr(self._allocators.get(device), "batch", None) is not None
            if lanes and plain:
                made = _ExpressLane.make(rt, "dispatch", (x, topk_idx, topk_weights), lane_scalars)
                if zero_copy is not False:
                    if zero_copy is True and do_cpu_sync is False:
                        self._express_zero_copy = made
                elif do_cpu_sync is False:
                    self._express = made
                else:
                    self._express_sync = made
            elif (
                lanes
                and zero_copy is False
                and handle is not None
                and topk_idx is None
                and cumulative_local_expert_recv_stats is None
                and previous_event is None
                and previous_event_before_epilogue is None
                and not async_with_compute_stream
            ):
                self._express_cached = _ExpressLane.make(rt, "dispatch", (x, topk_weights), scalars, handle)
        if handle is None:
            if not do_handle_copy:
                res.handle.topk_idx = (
                    topk_idx  # the caller's tensor itself (ep-core saw a detached alias of it)
                )
            elif res.handle.topk_idx is topk_idx:
                # ep-core copies every non-empty routing into the handle (the dispatch kernel fills the copy); an
                # empty one stays an alias, never the caller's tensor object
                res.handle.topk_idx = topk_idx.detach()
        if zero_copy is not False:
            recv_x, recv_idx, recv_w = self._zero_copy_outputs(
                data, sf, res.recv_x, res.recv_sf, res.recv_topk_idx, res.recv_topk_weights
            )
            return recv_x, recv_idx, recv_w, res.handle, event
        recv_x = _received(res.recv_x, res.recv_sf, use_tma_aligned_col_major_sf)
        return recv_x, res.recv_topk_idx, res.recv_topk_weights, res.handle, event

    def _zero_copy_outputs(
        self, data: Any, sf: Any, recv_x: Any, recv_sf: Any, recv_idx: Any, recv_w: Any
    ) -> tuple[Any, torch.Tensor | None, torch.Tensor | None]:
        """A zero-copy dispatch's views as tensors of the caller's dtypes (``data`` / ``sf``: ``x``'s parts):
        ``(recv_x, recv_topk_idx, recv_topk_weights)``, ``recv_x`` a ``(data, scales)`` tuple iff ``x`` was one."""
        own = self._own_tensor
        rx = own(recv_x, data.dtype)
        if sf is not None:
            rx = (rx, own(recv_sf, sf.dtype))
        return rx, own(recv_idx, torch.int64), own(recv_w, torch.float32)

    def _own_tensor(self, arr: Any, dtype: torch.dtype) -> torch.Tensor | None:
        """An array of the buffer's own memory (a zero-copy output, the combine buffer) as a tensor of ``dtype``:
        on the GPU one tensor per place, sliced per call (`ZeroCopyTensors`); the reference backend's host memory
        through numpy."""
        if arr is None or arr.device == "cpu":
            return _view_tensor(arr, dtype, self.device)
        tensors = self.__dict__.get("_zero_copy_tensors")
        if tensors is None:
            tensors = self._zero_copy_tensors = ZeroCopyTensors(self.device)
        return tensors.tensor(arr, dtype)

    def combine(
        self,
        x: torch.Tensor,
        handle: EPHandle,
        topk_weights: torch.Tensor | None = None,
        bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        num_sms: int = 0,
        num_qps: int = 0,
        previous_event: EventHandle | None = None,
        previous_event_before_epilogue: EventHandle | None = None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
        *,
        zero_copy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap]:
        """Send expert outputs back and sum them per token, unweighted (SPEC §3).

        Returns ``(combined_x [T, hidden] bf16, combined_topk_weights [T, K] float32 | None, event)``.
        ``zero_copy=True`` (an ep extension): ``x`` is :meth:`get_combine_buffer`'s tensor with the expert outputs
        written into it, read in place (one pass over the rows instead of two; non-expanded handles, no
        ``topk_weights``, direct mode). Every rank of the call passes it alike.
        """
        plain = (
            bias is None
            and previous_event is None
            and previous_event_before_epilogue is None
            and async_with_compute_stream is False
            and allocate_on_comm_stream is False
        )
        # the express lane of the last combine of its kind (ordinary, or zero-copy: ep-core's express combine over
        # its zero-copy repeat, which declines an x that is not the combine buffer: then the road below names the
        # error)
        if zero_copy is False:
            lane = self._express_combine
        else:
            lane = self._express_combine_zero_copy if zero_copy is True else None
        if plain and lane is not None and _same((num_sms, num_qps), lane.scalars):
            got = lane.run(x, handle, topk_weights, _current_stream(self._device_index) if self._cuda else 0)
            if got is not None:
                return got.combined_x, got.combined_topk_weights, EventOverlap(None)
        with self._core.announcing("combine"):
            rt = self._rt()
            device = x.device if isinstance(x, torch.Tensor) else self.device
            # the common case (no previous event, outputs on the compute stream): no comm-stream scope to build
            if previous_event is None and not allocate_on_comm_stream:
                scope, cuda = _NO_SCOPE, self._cuda
            else:
                scope, cuda = self._streams(
                    allocate_on_comm_stream, previous_event, async_with_compute_stream
                )
            with scope:  # the event is recorded inside: on the stream the operation ended on
                res = rt.run_combine(
                    CombineArgs(
                        x if type(x) is torch.Tensor and not x.requires_grad else _plain(x),
                        handle,
                        _plain(topk_weights) if topk_weights is not None else None,
                        _plain(bias) if bias is not None else None,
                        num_sms,
                        num_qps,
                        previous_event,
                        previous_event_before_epilogue,
                        bool(async_with_compute_stream),
                        bool(allocate_on_comm_stream),
                        self._allocators.get(device) or self._allocator(device),
                        _current_stream(self._device_index) if cuda else 0,
                        zero_copy,
                    )
                )
                event = self._combine_event(async_with_compute_stream, x, topk_weights, bias, res)
            if (
                plain
                and type(zero_copy) is bool
                and scope is _NO_SCOPE
                and getattr(self._allocators.get(device), "batch", None) is not None
            ):
                made = _ExpressLane.make(rt, "combine", (x, topk_weights), (num_sms, num_qps), handle)
                if zero_copy:
                    self._express_combine_zero_copy = made
                else:
                    self._express_combine = made
        return res.combined_x, res.combined_topk_weights, event

    def get_combine_buffer(self, handle: EPHandle) -> torch.Tensor:
        """Where this rank's expert outputs go for ``combine(..., zero_copy=True)`` (an ep extension, in the spirit of
        DeepEP V1's ``get_next_low_latency_combine_buffer``): a bf16 ``[received rows, hidden]`` view of the buffer's
        own memory (the start of its receive region on the GPU), one row per row of the dispatch's ``recv_x``.
        Write the expert outputs into it and pass it as ``combine``'s ``x``. Valid from the end of the dispatch
        until the next dispatch or combine on this buffer; non-expanded handles, direct mode."""
        return self._own_tensor(self._rt().combine_buffer(handle), torch.bfloat16)

    @property
    def launch_path(self) -> str | None:
        """How this buffer's kernels and stream-order events reach the driver: ep_launch's C++ calls, or the
        cuda-python fallback and why (announced once with a RuntimeWarning); None on the CPU reference backend."""
        return getattr(self._core.executor, "launch_path", None)

    @property
    def nccl_comm_handle(self) -> Any:
        """DeepEP's name for the buffer's NCCL communicator: the ``ep_nccl_gin`` communicator the nccl transport
        runs on (owned, or borrowed from the group), None with the ipc or reference transport and after
        ``destroy()`` (DeepEP sets it to None there too)."""
        if self.runtime is None or self.runtime.destroyed or self.transport != "nccl":
            return None
        return getattr(self.runtime.transport, "communicator", None)


class EPBuffer(ElasticBuffer):
    """The newer EP surface (EP buffer on a shared buffer base): ``ElasticBuffer``'s keywords, methods and return
    tuples, with planner policy V2.5 (margin 1.3, multiples of 4 SMs)."""

    policy: PlannerPolicy = PlannerPolicy.V2_5
