"""``BucketBuffer``: V2.5's buffer for collectives on registered tensors (DeepEP's ``deep_ep.BucketBuffer`` surface,
one NVLink domain per group).

The buffer is ``num_bytes`` of symmetric storage (``storage``, a 1-D uint8 tensor; an ``ep_core.BufferAllocator``
plan is materialized into it as named tensors, checked across ranks). Collectives work on tensors inside it, at the
same offsets on every rank:

- ``all_gather(srcs, dsts=None)``: without ``dsts`` each src is the ``rank``-th shard of the gathered tensor that
  surrounds it (gathered in place); with ``dsts`` (in the buffer, ``N * src.nbytes``) a src can be any tensor;
- ``reduce_scatter(srcs, comm_precision="fp32", scale=1.0)``: shard ``rank`` of each src (split into N) becomes
  ``scale * sum over ranks`` of that shard, in place; ``comm_precision="bf16"`` (float32 srcs) sends the other
  ranks' shards as stochastically rounded bfloat16, packed in place, and sums in float32 as DeepEP's RDMA bf16
  kernel does (``BucketBuffer._reduce_scatter_bf16``, ``ep_core.bucket_bf16``; the GPU's results equal the CPU's
  bit for bit);
- ``all_reduce(srcs, scale=1.0)``: each src becomes ``scale * sum over ranks``, in place;
- ``send_recv(srcs, dsts, dst_rank_idx, src_rank_idx)``: point-to-point into registered ``dsts`` (DeepEP 2.6's name,
  ep's semantics; CPU reference backend and ipc): ``ep_torch.bucket_send_recv``.

Each returns an ``EventOverlap``-like handle whose ``wait()`` (or ``current_stream_wait(release_handle=...)``)
makes the current stream wait and returns the result tensor(s) (1-D views with the srcs' dtype; one tensor for a
tensor argument); ``handle.num_sms`` is the SM count (0 for the all-gather; the caller's ``num_sms`` or
``get_theoretical_num_sms(op)`` for the reductions). Sums accumulate in float32 in rank order (fp32 precision).

Several groups (DeepEP's ``BucketBuffer([g0, g1], ...)``): one storage, one context per group (``buffer.groups``,
``buffer.contexts``: rank, size, domain sizes); each collective, ``barrier`` and ``get_theoretical_num_sms`` take
``group=`` (required when there are several), a session keeps to one group.

Transports as ``ElasticBuffer``'s. On the GPU (ipc, and nccl within one LSA team) the all-gather and ``send_recv``
are copy-engine copies into the peers' storage (no SM); the reductions read the peers' shards over NVLink with torch
kernels (the bf16 reduce-scatter with ``ep_core.bucket_bf16``'s), between two stream barriers (every src written before anyone reads; every read done before anyone
overwrites). Ours, not DeepEP's: no hybrid (RDMA) path; on the GPU the ranks of a further group must be ranks of the
first (``_add_contexts``).

``with buffer.session() as s:`` (DeepEP's ``BucketSession``): ``s.allocate(shapes, dtype)`` hands out storage front
to back, and inside the session the three collectives also accept tensors outside the storage: each is staged in
session storage (the src copied into its shard on the current stream; a registered dst's storage is used when the
src is not registered), the collective runs on the staged tensor, and ``wait()`` copies the result into external
``dsts`` (without ``dsts`` it returns the staged result). Every rank must make the same calls in a session (the
staging offsets are then the same everywhere). Sessions do not nest.

``get_theoretical_num_sms(op)``: DeepEP's NVLink model (all-gather 0; reduce-scatter / all-reduce from the NVLink
bandwidth per rank and the SM read/write rates). Ours: the fp32 reductions are torch kernels, which take no SM count
(``num_sms`` is accepted and ignored), so the number is what DeepEP's kernels would use, not what ours do; the bf16
reduce-scatter's kernels run on the caller's ``num_sms`` blocks (default: every SM).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from ep_core import bucket_bf16
from ep_core.buffer_base import align
from ep_core.envelope import Channel
from ep_core.errors import EPConfigError, EPStateError, EPTypeError, EPValueError
from ep_core.rank_state import breaks_step

from .buffer import ElasticBuffer
from .buffer_base import BufferContext, ElasticBacked
from .event import EventHandle, EventOverlap

__all__ = [
    "BucketBuffer",
    "BucketContext",
    "BucketSession",
]

_ALIGN = 2 << 20
_SESSION_ALIGN = 256
_REDUCIBLE = (torch.float32, torch.bfloat16, torch.float16)


class _Guarded:
    """The block of one collective of a BucketBuffer (issue 41): inside its ``ElasticBuffer``'s
    ``ep_core.rank_state`` guard (refused at once while the ranks are out of step, until ``reset()``; a
    disagreement, timeout or lost peer recorded). On the CPU reference backend, where every collective begins with
    the agreement exchange, a refusal of this rank's call is announced there (the peers raise ``EPPeerError`` naming
    this rank); an error that leaves the ranks in step takes back this rank's operation count (``_ops``, part of the
    agreement), so the next calls pair."""

    __slots__ = ("broken", "buf", "guard", "ops")

    def __init__(self, buf: BucketBuffer, op: str, announce: bool = False) -> None:
        """``announce``: the operation begins with a host agreement exchange on every backend (``send_recv``), so a
        refusal is announced there on the GPU too."""
        self.buf, self.ops, self.guard, self.broken = buf, buf._ops, None, False
        eb = buf._buffer
        state = None if eb is None else getattr(eb.bootstrap, "rank_state", None)
        if state is not None:
            reference = eb.transport == "reference"
            self.guard = state.guard(
                f"BucketBuffer.{op}", _Abort(eb.bootstrap) if reference or announce else None
            )
            self.broken = reference and getattr(eb.bootstrap, "_via_store", None) is not None

    def __enter__(self) -> None:
        if self.guard is None:
            return
        self.guard.__enter__()
        if self.broken:  # raised inside the guard: announced like any refusal
            exc = EPStateError(
                f"{self.guard.op} (rank {self.buf.rank_idx}): after the timeout this buffer was reset from, the "
                "process group's own collectives are out of step (a wait given up leaves its collective pending); "
                "BucketBuffer on the CPU backend needs a new process group and buffer"
            )
            self.guard.__exit__(EPStateError, exc, None)
            raise exc

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if isinstance(exc, Exception) and not breaks_step(exc):
            self.buf._ops = self.ops  # the ranks stay in step: this call counts on no rank
        if self.guard is not None:
            return self.guard.__exit__(exc_type, exc, tb)
        return False


class _Abort:
    """Announce a refusal in the peers' pending agreement exchange (``ProcessGroupBootstrap.abort``)."""

    __slots__ = ("bootstrap",)

    def __init__(self, bootstrap: Any) -> None:
        self.bootstrap = bootstrap

    def __call__(self, op: str, exc: BaseException) -> None:
        self.bootstrap.abort(f"{op}: {type(exc).__name__}: {exc}")


class _Handle(EventOverlap):
    """An ``EventOverlap`` whose ``wait()`` and ``current_stream_wait(release_handle=...)`` return the operation's
    result (DeepEP's handles return their hook's value), with DeepEP's ``num_sms`` (the SM count the operation was
    launched with: 0 for the all-gather). ``finish`` (a session's copy into external ``dsts``) runs on the first
    wait; later waits return the same result."""

    def __init__(self, event: EventHandle, result: Any, num_sms: int = 0, finish: Any = None) -> None:
        super().__init__(event)
        self._result = result
        self._finish = finish
        self.num_sms = int(num_sms)

    def current_stream_wait(self, release_handle: bool = False) -> Any:
        if self.event is None:
            raise EPStateError(
                "BucketBuffer handle: current_stream_wait() after release_handle=True; the result was returned by "
                "that wait"
            )
        self.event.current_stream_wait()
        if self.hook_after_wait is not None:  # a hook the caller registered
            hook, self.hook_after_wait = self.hook_after_wait, None
            hook()
        if self._finish is not None:
            finish, self._finish = self._finish, None
            self._result = finish()
        result = self._result
        if release_handle:
            self.event = None
            self.extra_tensors = None
        return result


class BucketSession:
    """``with buffer.session() as s:`` a bump allocator over the storage (``s.allocate(shapes, dtype)``); the caller
    makes sure nothing allocated earlier is still in use."""

    _METHODS = ("all_gather", "reduce_scatter", "all_reduce")

    def __init__(self, buffer: BucketBuffer) -> None:
        self.buffer = buffer
        # DeepEP's attributes; its sessions align to get_num_rdma_alignment() (64), ep's to 256 bytes
        self.alignment = _SESSION_ALIGN
        self.collective_methods = self._METHODS
        self.num_allocated_bytes = 0
        self.context_idx: int | None = None  # the group every call of this session uses (DeepEP's rule)

    def __enter__(self) -> BucketSession:
        if any(name in self.buffer.__dict__ for name in self._METHODS):
            raise EPStateError(f"BucketBuffer.session: sessions do not nest (rank {self.buffer.rank_idx})")
        self.num_allocated_bytes = 0
        self.context_idx = None
        for name in self._METHODS:  # the collectives accept unregistered tensors until the session ends
            self.buffer.__dict__[name] = lambda *a, _name=name, **kw: self._collective(_name, *a, **kw)
        return self

    def __exit__(self, *exc: object) -> None:
        for name in self._METHODS:
            self.buffer.__dict__.pop(name, None)
        return None

    def _stage(self, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        group = None if self.context_idx is None else self.buffer.groups[self.context_idx]
        return self.allocate((nbytes // dtype.itemsize,), dtype, group)

    def _check_group(self, group: Any) -> BucketBuffer:
        """The context of `group`; every call of a session must use the same group (DeepEP's rule)."""
        idx = self.buffer.get_context_idx(group)
        if self.context_idx not in (None, idx):
            raise EPValueError(
                f"BucketBuffer.session: every collective of a session must use the same group (context "
                f"{self.context_idx}, got {idx}; rank {self.buffer.rank_idx})"
            )
        self.context_idx = idx
        return self.buffer._context_buffers[idx]

    def _collective(self, name: str, *args: Any, **kwargs: Any) -> _Handle:
        """`name` on staged copies of unregistered tensors (module doc)."""
        buf = self.buffer
        bound = inspect.signature(getattr(type(buf), name)).bind(buf, *args, **kwargs).arguments
        bound.pop("self")
        ctx = self._check_group(bound.get("group"))
        with _Guarded(ctx, name):  # a refused staging is announced like a refused collective (issue 41)
            return self._staged(ctx, name, bound)

    def _staged(self, ctx: BucketBuffer, name: str, bound: dict) -> _Handle:
        buf = self.buffer
        n, r = ctx.num_ranks, ctx.rank_idx
        srcs, dsts = bound.pop("srcs"), bound.pop("dsts", None)
        shards = {"all_gather": (n, 1), "reduce_scatter": (1, n), "all_reduce": (1, 1)}[name]
        packed, xs = buf._pack(srcs)
        ds = None if dsts is None else buf._pack(dsts)[1]
        if ds is not None and len(ds) != len(xs):
            raise EPValueError(f"dsts: expected {len(xs)} tensors, got {len(ds)} (rank {r})")
        staged, results_at, copies = [], [], []
        for i, x in enumerate(xs):
            x = buf._buf()._check_tensor(f"srcs[{i}]", x)
            d = None if ds is None else buf._buf()._check_tensor(f"dsts[{i}]", ds[i])
            if d is not None and (d.dtype != x.dtype or d.nbytes * shards[1] != x.nbytes * shards[0]):
                raise EPValueError(
                    f"dsts[{i}]: expected {x.nbytes * shards[0] // shards[1]} bytes of {x.dtype}, got {d.nbytes} "
                    f"of {d.dtype} (rank {r})"
                )
            total = x.nbytes * shards[0]
            start = None
            if buf._inside(x):
                start = buf._offset(f"srcs[{i}]", x) - (r % shards[0]) * x.nbytes
            elif d is not None and buf._inside(d):
                start = buf._offset(f"dsts[{i}]", d) - (r % shards[1]) * d.nbytes
            if start is None:
                region = self._stage(total, torch.uint8)
            elif start < 0 or start + total > buf.num_bytes:
                raise EPValueError(
                    f"srcs[{i}]: the {name} around this registered tensor would leave the storage (rank {r})"
                )
            else:
                region = buf.storage[start : start + total]
            region = region.view(x.dtype)
            src_part = region.view(shards[0], -1)[r % shards[0]]
            if src_part.data_ptr() != x.data_ptr():
                copies.append((src_part, x.reshape(-1)))
            staged.append(src_part)
            results_at.append(d)
        for dst, src in copies:
            dst.copy_(src)
        inner = getattr(type(buf), name)(buf, staged[0] if packed else staged, **bound)

        def finish() -> Any:
            res = inner.wait()
            outs = [res] if packed else list(res)
            final = []
            for out, d in zip(outs, results_at, strict=True):
                if d is not None and d.data_ptr() != out.data_ptr():
                    d.view(-1).copy_(out.view(-1))
                final.append(out if d is None else d)
            return final[0] if packed else final

        return _Handle(inner.event, None, num_sms=inner.num_sms, finish=finish)

    def allocate(
        self, shapes: Any, dtype: torch.dtype = torch.float32, group: dist.ProcessGroup | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        self._check_group(group)
        batched = isinstance(shapes[0], (tuple, list, torch.Size))
        lst = list(shapes) if batched else [shapes]
        out = []
        for shape in lst:
            nbytes = math.prod(shape) * dtype.itemsize
            start = self.num_allocated_bytes
            if start + nbytes > self.buffer.num_bytes:
                raise EPValueError(
                    f"allocate: the session needs {start + nbytes} bytes, the BucketBuffer has {self.buffer.num_bytes} "
                    f"(rank {self.buffer.rank_idx})"
                )
            self.num_allocated_bytes = align(start + nbytes, _SESSION_ALIGN)
            out.append(self.buffer.storage[start : start + nbytes].view(dtype).view(tuple(shape)))
        return tuple(out) if batched else out[0]


def _global_ranks(group: Any, size: int) -> list[int]:
    """The global rank of each rank of ``group``, in group rank order."""
    if group is None or group is dist.group.WORLD:
        return list(range(size))
    return [dist.get_global_rank(group, i) for i in range(size)]


class BucketContext(BufferContext):
    """One group of a ``BucketBuffer`` (DeepEP's ``buffer.contexts[i]``): its rank, size and domain sizes."""


class BucketBuffer(ElasticBacked):
    """Symmetric storage for collectives over ``group`` (a collective to build)."""

    bf16_path: str | None = None  # what the last bf16 reduce-scatter ran: "kernel" or "reference"

    def __init__(
        self,
        group: dist.ProcessGroup | Sequence[dist.ProcessGroup] | None,
        allocation_plan_or_num_bytes: Any,
        sl_idx: int | None = None,
        num_gpu_timeout_secs: int = 100,
        explicitly_destroy: bool = False,
        *,
        transport: str | None = None,
        num_cpu_timeout_secs: int = 300,
    ) -> None:
        extra_groups: list[Any] = []
        if isinstance(group, Sequence) and not isinstance(group, dist.ProcessGroup):
            if len(group) == 0:
                raise EPConfigError("group: expected a process group or a non-empty sequence of them")
            group, extra_groups = group[0], list(group[1:])
        plan = None if isinstance(allocation_plan_or_num_bytes, int) else allocation_plan_or_num_bytes
        num_bytes = int(allocation_plan_or_num_bytes) if plan is None else int(plan.num_bytes)
        if num_bytes <= 0:
            raise EPValueError(f"allocation_plan_or_num_bytes: expected a positive size, got {num_bytes}")
        self._buffer: ElasticBuffer | None = ElasticBuffer(
            group,
            num_bytes=align(num_bytes, _ALIGN),
            sl_idx=3 if sl_idx is None else sl_idx,
            num_gpu_timeout_secs=num_gpu_timeout_secs,
            num_cpu_timeout_secs=num_cpu_timeout_secs,
            explicitly_destroy=explicitly_destroy,
            transport=transport,
        )
        eb = self._buffer
        self.group, self.rank_idx, self.num_ranks = eb.group, eb.rank_idx, eb.num_ranks
        self.groups = [self.group]
        self.num_bytes = num_bytes
        self.explicitly_destroy = bool(explicitly_destroy)
        if eb.get_physical_domain_size()[1] != self.num_ranks:
            raise EPConfigError(
                f"group: BucketBuffer needs every rank in one NVLink domain (rank {self.rank_idx})"
            )
        self._backend = eb._elastic(collective=True).backend
        self.storage = self._backend.region()[:num_bytes]
        self._ops = 0  # operations run: the value of the GPU path's stream barriers
        self.tensors: dict[str, torch.Tensor] = {}
        if plan is not None:
            plan.check(eb.bootstrap)
            for spec in plan.specs:
                dt = getattr(torch, spec.dtype)
                self.tensors[spec.name] = (
                    self.storage[spec.offset : spec.offset + spec.num_bytes].view(dt).view(spec.shape)
                )
        self._context_buffers: list[BucketBuffer] = [self]
        self.contexts: list[BucketContext] | None = [BucketContext(eb)]
        if extra_groups or self.storage.is_cuda:  # on the GPU every rank takes part (_add_contexts)
            self._add_contexts(extra_groups, num_gpu_timeout_secs, num_cpu_timeout_secs, transport)

    # ------------------------------------------------------------------------------------------------------------
    def _add_contexts(
        self, groups: list[Any], num_gpu_timeout_secs: int, num_cpu_timeout_secs: int, transport: str | None
    ) -> None:
        """One context per further group over the same storage (DeepEP's ``BucketBuffer([g0, g1])``): each has its
        own collective state (an ``ElasticBuffer`` over that group, a minimal region of its own: its own operation
        count, rank state and, on the GPU, signal words) whose collectives run on this buffer's storage.

        On the GPU the peers' storage is mapped through the first group's exchange, so every rank of a further
        group must be a rank of the first (ours); its context addresses a peer's storage by that peer's rank in
        the first group. There every rank of the first group takes part in one more exchange, further groups or
        none: a rank whose groups are refused announces it there, and its peers raise ``EPPeerError`` naming it
        (no rank is left with a buffer whose peers have none)."""
        if not self.storage.is_cuda:
            self._build_contexts(groups, num_gpu_timeout_secs, num_cpu_timeout_secs, transport)
            return
        boot = self._buf().bootstrap
        try:
            self._build_contexts(groups, num_gpu_timeout_secs, num_cpu_timeout_secs, transport)
        except Exception as exc:  # (no destroy of the contexts built: a collective their peers may not reach)
            boot.abort(f"BucketBuffer groups: {type(exc).__name__}: {exc}")
            raise
        boot.allgather(b"groups built")  # a peer's refusal raises EPPeerError here

    def _build_contexts(
        self, groups: list[Any], num_gpu_timeout_secs: int, num_cpu_timeout_secs: int, transport: str | None
    ) -> None:
        cuda = self.storage.is_cuda
        first = _global_ranks(self.group, self.num_ranks) if cuda else []
        for k, g in enumerate(groups, start=1):
            if any(g is c.group for c in self._context_buffers):
                raise EPConfigError(f"group[{k}]: the same group twice (rank {self.rank_idx})")
            if cuda:  # the same verdict on every rank of g: refused before any collective over it
                outside = [r for r in _global_ranks(g, dist.get_world_size(g)) if r not in first]
                if outside:
                    raise EPConfigError(
                        f"group[{k}]: on the GPU every rank of a further group must be a rank of group[0] (ours: "
                        f"the storage is mapped through group[0]'s exchange); global ranks {outside} are not "
                        f"(rank {self.rank_idx})"
                    )
            eb = ElasticBuffer(
                g,
                num_bytes=_ALIGN,
                sl_idx=3,
                num_gpu_timeout_secs=num_gpu_timeout_secs,
                num_cpu_timeout_secs=num_cpu_timeout_secs,
                explicitly_destroy=self.explicitly_destroy,
                transport=transport,
            )
            if eb.get_physical_domain_size()[1] != eb.num_ranks:
                raise EPConfigError(
                    f"group[{k}]: BucketBuffer needs every rank in one NVLink domain (rank {self.rank_idx})"
                )
            # DeepEP checks that every rank of a group gives it the same context index
            every = eb.bootstrap.allgather(str(k).encode())
            if any(b != every[0] for b in every):
                raise EPConfigError(
                    f"group[{k}]: the ranks of this group pass it at different positions "
                    f"({[int(b) for b in every]}); every rank must list its groups in the same order"
                )
            backend = eb._elastic(collective=True).backend
            backend._region = self._backend._region  # its collectives work on this buffer's storage
            if cuda:  # and address the peers' storage (the main backend's data regions, by group[0] rank)
                backend.data = [
                    self._backend.data[first.index(r)] for r in _global_ranks(eb.group, eb.num_ranks)
                ]
                backend.__dict__.pop("_peer_regions", None)
            ctx = object.__new__(BucketBuffer)
            ctx.__dict__.update(
                _buffer=eb,
                _backend=backend,
                group=eb.group,
                rank_idx=eb.rank_idx,
                num_ranks=eb.num_ranks,
                groups=[eb.group],
                num_bytes=self.num_bytes,
                explicitly_destroy=self.explicitly_destroy,
                storage=self.storage,
                _ops=0,
                tensors=self.tensors,
                _context_buffers=None,
                contexts=None,
            )
            self._context_buffers.append(ctx)
            self.groups.append(eb.group)
            assert self.contexts is not None
            self.contexts.append(BucketContext(eb))

    def get_context_idx(self, group: Any) -> int:
        """The index in ``groups`` (and ``contexts``) of ``group``; ``None`` means the only group."""
        if group is None:
            if len(self.groups) > 1:
                raise EPValueError(
                    f"group: required when the BucketBuffer has several groups ({len(self.groups)}; rank "
                    f"{self.rank_idx})"
                )
            return 0
        for i, g in enumerate(self.groups):
            if g is group or g == group:
                return i
        raise EPValueError(f"group: not one of this BucketBuffer's groups (rank {self.rank_idx})")

    def _route(self, group: Any) -> BucketBuffer:
        """The buffer whose collectives run over ``group`` (this one for the first group)."""
        if self._context_buffers is None:  # a context's own view: its one group
            return self
        return self._context_buffers[self.get_context_idx(group)]

    def session(self) -> BucketSession:
        return BucketSession(self)

    def barrier(
        self, wait_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True, group=None
    ):
        ctx = self._route(group)
        with _Guarded(ctx, "barrier"):
            eb = ctx._buf()
            if eb.transport == "reference":
                # the agreement every other collective begins with here: a rank that skipped this barrier meets
                # it with its next collective's, and both raise EPMismatchError (issue 41)
                ctx._ops += 1
                eb._agree("barrier", {"op": ctx._ops, "barrier": True})
            eb.barrier(with_cpu_sync=with_cpu_sync)

    def _refuse(self, op: str, error: Exception) -> None:
        """Raise ``error`` of this rank's ``op`` inside the block of a collective (announced to the peers)."""
        with _Guarded(self, op):
            raise error

    def reset(self, group: Any = None) -> None:
        """(ours; DeepEP has none) Recover after a failure over ``group``: a collective of every rank of it. After
        a disagreement, a timeout or a lost peer every collective is refused (``EPStateError``); ``reset()``
        resynchronises the ranks (``ElasticBuffer.reset``) and their operation counts, then the buffer works as
        new. Data in the storage is left as it is."""
        ctx = self._route(group)
        eb = ctx._buf()
        eb.reset()
        if eb.transport != "reference":
            # the GPU executors have no host channel, so their reset leaves the host steps' state alone: a failed
            # agreement of send_recv (recorded in the bootstrap's rank state) is cleared here, collectively
            Channel(eb.bootstrap, getattr(eb.bootstrap, "rank_state", None)).reset()
        every = eb.bootstrap.allgather(str(ctx._ops).encode())
        ctx._ops = max(int(b) for b in every)

    def destroy(self) -> None:
        for ctx in (self._context_buffers or [])[1:]:
            ctx._buf().destroy()
            ctx._buffer = None
            ctx._backend = None
        self._buf().destroy()
        self._buffer = None
        self._backend = None  # closed by the buffer's destroy()
        self.contexts = None

    @property
    def main_context(self) -> BucketContext | None:
        """The first group's context (DeepEP's ``BufferBase.main_context``); None after ``destroy()``."""
        return None if not self.contexts else self.contexts[0]

    @property
    def nccl_comm_handles(self) -> list[Any] | None:
        """Each group's NCCL communicator (None entries on the reference and ipc transports); None after
        ``destroy()``."""
        if self.contexts is None:
            return None
        return [ctx._buffer.nccl_comm_handle for ctx in self.contexts]

    def _inside(self, t: torch.Tensor) -> bool:
        off = t.data_ptr() - self.storage.data_ptr()
        return off >= 0 and off + t.nbytes <= self.num_bytes and t.device == self.storage.device

    def get_theoretical_num_sms(self, op: str, group: Any = None) -> int:
        """DeepEP's SM model on one NVLink domain (module doc: ours ignores it, the reductions are torch kernels)."""
        from ep_core import planner

        ctx = self._route(group)
        if ctx is not self:
            return ctx.get_theoretical_num_sms(op)
        if op == "all_gather":
            return 0
        if op not in ("reduce_scatter", "all_reduce"):
            raise EPValueError(
                f"op: expected 'all_gather', 'reduce_scatter' or 'all_reduce', got {op!r} (rank {self.rank_idx})"
            )
        if self.num_ranks == 1:
            return 0
        nvl, _ = planner.detect_scaleup_gbs(self.num_ranks)
        dst = nvl / self.num_ranks
        sms = max(dst / 200, dst / 50)  # the planner's SM read / write GB/s
        return align(max(6 if op == "reduce_scatter" else 4, math.ceil(sms)), 2)

    def print_memory_usage(self) -> None:
        """This rank's storage bytes."""
        print(f"BucketBuffer rank {self.rank_idx}: storage {self.num_bytes} bytes")

    def _offset(self, name: str, t: torch.Tensor) -> int:
        off = t.data_ptr() - self.storage.data_ptr()
        if off < 0 or off + t.nbytes > self.num_bytes:
            raise EPValueError(
                f"{name}: expected a tensor inside this BucketBuffer's storage (rank {self.rank_idx}); allocate it "
                "with the allocation plan or a session"
            )
        return off

    def _check(self, name: str, t: Any, reduce: bool = False) -> torch.Tensor:
        eb = self._buf()
        t = eb._check_tensor(name, t)
        if reduce and t.dtype not in _REDUCIBLE:
            raise EPTypeError(
                f"{name}: expected float32, bfloat16 or float16, got {t.dtype} (rank {self.rank_idx})"
            )
        return t

    @staticmethod
    def _pack(t: Any) -> tuple[bool, list[torch.Tensor]]:
        return (True, [t]) if isinstance(t, torch.Tensor) else (False, list(t))

    def _handle(self, packed: bool, results: list[torch.Tensor], num_sms: int = 0) -> _Handle:
        event = EventHandle() if self.storage.is_cuda else EventHandle(device="cpu")
        return _Handle(event, results[0] if packed else results, num_sms=num_sms)

    # ------------------------------------------------------------------------------------------------------------
    def all_gather(
        self, srcs: Any, dsts: Any = None, group: Any = None, num_sms: int | None = None
    ) -> _Handle:
        """Gather every rank's src into the gathered tensor (see the module doc); copy engine on the GPU."""
        ctx = self._route(group)
        if ctx is not self:
            return ctx.all_gather(srcs, dsts, None, num_sms)
        with _Guarded(self, "all_gather"):
            if num_sms not in (None, 0):
                raise EPValueError(
                    f"num_sms: the all-gather is copy-engine driven: expected None or 0, got {num_sms}"
                )
            packed, xs = self._pack(srcs)
            xs = [self._check(f"srcs[{i}]", x) for i, x in enumerate(xs)]
            n, r = self.num_ranks, self.rank_idx
            plan = []
            if dsts is None:
                for i, x in enumerate(xs):
                    off = self._offset(f"srcs[{i}]", x) - r * x.nbytes
                    if off < 0 or off + n * x.nbytes > self.num_bytes:
                        raise EPValueError(
                            f"srcs[{i}]: its gathered tensor would leave the storage (rank {r})"
                        )
                    plan.append((x, off))
            else:
                _, ds = self._pack(dsts)
                if len(ds) != len(xs):
                    raise EPValueError(f"dsts: expected {len(xs)} tensors, got {len(ds)}")
                for i, (x, d) in enumerate(zip(xs, ds, strict=True)):
                    d = self._check(f"dsts[{i}]", d)
                    if d.dtype != x.dtype or d.nbytes != n * x.nbytes:
                        raise EPValueError(
                            f"dsts[{i}]: expected {n} x {x.nbytes} bytes of {x.dtype} (rank {r})"
                        )
                    plan.append((x, self._offset(f"dsts[{i}]", d)))
            self._ops += 1
            self._backend.bucket_all_gather(plan, self._ops)
            return self._handle(packed, [self.storage[o : o + n * x.nbytes].view(x.dtype) for x, o in plan])

    def reduce_scatter(
        self,
        srcs: Any,
        comm_precision: str = "fp32",
        scale: float = 1.0,
        group: Any = None,
        num_sms: int | None = None,
    ) -> _Handle:
        """Shard ``rank`` of each src becomes ``scale *`` the sum over ranks of that shard (in place);
        ``comm_precision="bf16"``: see ``_reduce_scatter_bf16``."""
        ctx = self._route(group)
        if ctx is not self:
            return ctx.reduce_scatter(srcs, comm_precision, scale, None, num_sms)
        with _Guarded(self, "reduce_scatter"):
            if comm_precision not in ("fp32", "bf16"):
                raise EPValueError(f"comm_precision: expected 'fp32' or 'bf16', got {comm_precision!r}")
            if comm_precision == "bf16":
                return self._reduce_scatter_bf16(srcs, scale, num_sms)
            packed, xs = self._pack(srcs)
            xs = [self._check(f"srcs[{i}]", x, reduce=True) for i, x in enumerate(xs)]
            n = self.num_ranks
            for i, x in enumerate(xs):
                if x.numel() % n:
                    raise EPValueError(f"srcs[{i}]: {x.numel()} elements do not split into {n} shards")
            plan = [(x, self._offset(f"srcs[{i}]", x)) for i, x in enumerate(xs)]
            self._ops += 1
            outs = self._backend.bucket_reduce(plan, self._ops, float(scale), scatter=True)
            return self._handle(packed, outs, self._num_sms("reduce_scatter", num_sms))

    def all_reduce(
        self, srcs: Any, scale: float = 1.0, group: Any = None, num_sms: int | None = None
    ) -> _Handle:
        """Each src becomes ``scale *`` the sum over ranks (in place)."""
        ctx = self._route(group)
        if ctx is not self:
            return ctx.all_reduce(srcs, scale, None, num_sms)
        with _Guarded(self, "all_reduce"):
            packed, xs = self._pack(srcs)
            xs = [self._check(f"srcs[{i}]", x, reduce=True) for i, x in enumerate(xs)]
            plan = [(x, self._offset(f"srcs[{i}]", x)) for i, x in enumerate(xs)]
            self._ops += 1
            outs = self._backend.bucket_reduce(plan, self._ops, float(scale), scatter=False)
            return self._handle(packed, outs, self._num_sms("all_reduce", num_sms))

    def send_recv(
        self,
        srcs: Any = None,
        dsts: Any = None,
        dst_rank_idx: int | None = None,
        src_rank_idx: int | None = None,
        group: Any = None,
        num_sms: int | None = None,
    ) -> _Handle:
        """This rank's ``srcs`` into ``dsts`` of rank ``dst_rank_idx``; ``dsts`` (registered) receive the ``srcs`` of
        rank ``src_rank_idx`` (a collective step; DeepEP 2.6's name, ep's semantics: ``ep_torch.bucket_send_recv``)."""
        from .bucket_send_recv import send_recv

        return send_recv(self._route(group), srcs, dsts, dst_rank_idx, src_rank_idx, num_sms)

    # ------------------------------------------------------------------------------------------------------------
    def _num_sms(self, op: str, num_sms: int | None) -> int:
        """DeepEP's ``handle.num_sms``: the caller's count, else ``get_theoretical_num_sms(op)``; 0 where the
        scale-up bandwidth is unknown (the CPU reference backend without ``EPKIT_NVLINK_GBS``: no SM runs it)."""
        if num_sms is not None:
            return int(num_sms)
        # the model asks nvidia-smi: once per buffer and op
        cache = self.__dict__.setdefault("_num_sms_cache", {})
        if op not in cache:
            try:
                cache[op] = self.get_theoretical_num_sms(op, self.group)
            except EPConfigError:
                cache[op] = 0
        return cache[op]

    def _reduce_scatter_bf16(self, srcs: Any, scale: float, num_sms: int | None) -> _Handle:
        """``reduce_scatter(comm_precision="bf16")``, DeepEP's bf16 reduce-scatter (``ep_core.bucket_bf16``): each
        rank rounds the shards of its float32 src that other ranks own to bf16 (stochastic rounding, the random
        bits a hash of the values and their place: the same on every run) and packs them in place, the owner adds
        them in float32 to its own unrounded shard, peers ``rank-1, rank-2, ...`` (cyclic), then multiplies by
        ``scale`` (when not 1). Float32 srcs whose shards are multiples of 8 elements (DeepEP's 32-byte rule). The
        other shards of each src hold the packed bf16 afterwards (DeepEP's chunk layout; treat them as undefined).
        Ours: DeepEP runs this on RDMA-only groups; ep on its NVLink-domain groups, where the peers read the
        packed bf16 (NVLink carries bf16). ``buffer.bf16_path`` says what ran: "kernel" (the GPU: two kernels,
        ``CopyEngineBackend.bucket_reduce_scatter_bf16``) or "reference" (the CPU: numpy, bit for bit the same)."""
        packed, xs = self._pack(srcs)
        xs = [self._check(f"srcs[{i}]", x, reduce=True) for i, x in enumerate(xs)]
        n, r = self.num_ranks, self.rank_idx
        for i, x in enumerate(xs):
            if x.dtype != torch.float32:
                raise EPTypeError(
                    f"srcs[{i}]: comm_precision='bf16' takes float32 tensors (DeepEP's rule), got {x.dtype} (rank {r})"
                )
            if x.numel() % (8 * n):
                raise EPValueError(
                    f"srcs[{i}]: {x.numel()} elements do not split into {n} shards of a multiple of 8 (32 bytes)"
                )
        plan = [(x, self._offset(f"srcs[{i}]", x)) for i, x in enumerate(xs)]
        self._ops += 1
        sms = self._num_sms("reduce_scatter", num_sms)
        if self.storage.is_cuda:
            self.bf16_path = "kernel"
            outs = self._backend.bucket_reduce_scatter_bf16(plan, self._ops, float(scale), num_sms)
            return self._handle(packed, outs, sms)
        self.bf16_path = "reference"
        self._buf()._agree(
            "reduce_scatter",
            {
                "op": self._ops,
                "comm_precision": "bf16",
                "t": [(tuple(x.shape), str(x.dtype), o) for x, o in plan],
            },
        )
        outs = []
        for x, _ in plan:
            flat = x.detach().reshape(-1)
            m = flat.numel() // n
            bucket_bf16.pack(flat.numpy(), r, n)  # what this rank sends, in place
            every = [torch.empty_like(flat) for _ in range(n)]
            work = dist.all_gather(every, flat, group=self.group, async_op=True)
            self._backend._wait(work, "reduce_scatter", "every rank's bf16 shards", self._ops)
            peers = [every[(r - p) % n][r * m : (r + 1) * m].numpy() for p in range(1, n)]
            view = flat[r * m : (r + 1) * m]
            sent = [bucket_bf16.packed(b, m, n) for b in peers]
            view.copy_(torch.from_numpy(bucket_bf16.reduce(view.numpy(), sent, scale)))
            outs.append(view)
        return self._handle(packed, outs, sms)
