"""``BucketBuffer``: V2.5's buffer for collectives on registered tensors (DeepEP's ``deep_ep.BucketBuffer`` surface,
one group, one NVLink domain).

The buffer is ``num_bytes`` of symmetric storage (``storage``, a 1-D uint8 tensor; an ``ep_core.BufferAllocator``
plan is materialized into it as named tensors, checked across ranks). Collectives work on tensors inside it, at the
same offsets on every rank:

- ``all_gather(srcs, dsts=None)``: without ``dsts`` each src is the ``rank``-th shard of the gathered tensor that
  surrounds it (gathered in place); with ``dsts`` (in the buffer, ``N * src.nbytes``) a src can be any tensor;
- ``reduce_scatter(srcs, comm_precision="fp32", scale=1.0)``: shard ``rank`` of each src (split into N) becomes
  ``scale * sum over ranks`` of that shard, in place;
- ``all_reduce(srcs, scale=1.0)``: each src becomes ``scale * sum over ranks``, in place.

Each returns an ``EventOverlap``-like handle whose ``wait()`` makes the current stream wait and returns the result
tensor(s) (1-D views with the srcs' dtype; one tensor for a tensor argument). Sums accumulate in float32 in rank order.

Transports as ``ElasticBuffer``'s. On the GPU (ipc) the all-gather is copy-engine copies into every peer's
storage (no SM); the reductions read the peers' shards over NVLink with torch kernels, between two stream
barriers (every src written before anyone reads; every read done before anyone overwrites). Ours, not DeepEP's:
one group only, ``comm_precision="fp32"`` only, no hybrid (RDMA) path.

``with buffer.session() as s:`` (DeepEP's ``BucketSession``): ``s.allocate(shapes, dtype)`` hands out storage front
to back, and inside the session the three collectives also accept tensors outside the storage: each is staged in
session storage (the src copied into its shard on the current stream; a registered dst's storage is used when the
src is not registered), the collective runs on the staged tensor, and ``wait()`` copies the result into external
``dsts`` (without ``dsts`` it returns the staged result). Every rank must make the same calls in a session (the
staging offsets are then the same everywhere). Sessions do not nest.

``get_theoretical_num_sms(op)``: DeepEP's NVLink model (all-gather 0; reduce-scatter / all-reduce from the NVLink
bandwidth per rank and the SM read/write rates). Ours: the reductions are torch kernels, which take no SM count
(``num_sms`` is accepted and ignored), so the number is what DeepEP's kernels would use, not what ours do.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from ep_core.errors import EPConfigError, EPStateError, EPTypeError, EPValueError

from .buffer import ElasticBuffer
from .event import EventHandle, EventOverlap

__all__ = ["BucketBuffer", "BucketSession"]

_ALIGN = 2 << 20
_SESSION_ALIGN = 256
_REDUCIBLE = (torch.float32, torch.bfloat16, torch.float16)


def _align(a: int, b: int) -> int:
    return -(-a // b) * b


class _Handle(EventOverlap):
    """An ``EventOverlap`` whose ``wait()`` returns the operation's result."""

    def __init__(self, event: EventHandle, result: Any) -> None:
        super().__init__(event)
        self._result = result

    def wait(self) -> Any:
        self.current_stream_wait()
        return self._result


class BucketSession:
    """``with buffer.session() as s:`` a bump allocator over the storage (``s.allocate(shapes, dtype)``); the caller
    makes sure nothing allocated earlier is still in use."""

    _METHODS = ("all_gather", "reduce_scatter", "all_reduce")

    def __init__(self, buffer: BucketBuffer) -> None:
        self.buffer = buffer
        self.num_allocated_bytes = 0

    def __enter__(self) -> BucketSession:
        if any(name in self.buffer.__dict__ for name in self._METHODS):
            raise EPStateError(f"BucketBuffer.session: sessions do not nest (rank {self.buffer.rank_idx})")
        self.num_allocated_bytes = 0
        for name in self._METHODS:  # the collectives accept unregistered tensors until the session ends
            self.buffer.__dict__[name] = lambda *a, _name=name, **kw: self._collective(_name, *a, **kw)
        return self

    def __exit__(self, *exc: object) -> None:
        for name in self._METHODS:
            self.buffer.__dict__.pop(name, None)
        return None

    def _stage(self, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        return self.allocate((nbytes // dtype.itemsize,), dtype)

    def _collective(self, name: str, *args: Any, **kwargs: Any) -> _Handle:
        """`name` on staged copies of unregistered tensors (module doc)."""
        buf = self.buffer
        n, r = buf.num_ranks, buf.rank_idx
        bound = inspect.signature(getattr(type(buf), name)).bind(buf, *args, **kwargs).arguments
        bound.pop("self")
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

        def wait() -> Any:
            res = inner.wait()
            outs = [res] if packed else list(res)
            final = []
            for out, d in zip(outs, results_at, strict=True):
                if d is not None and d.data_ptr() != out.data_ptr():
                    d.view(-1).copy_(out.view(-1))
                final.append(out if d is None else d)
            return final[0] if packed else final

        handle = _Handle(inner.event, None)
        handle.wait = wait  # type: ignore[method-assign]
        return handle

    def allocate(
        self, shapes: Any, dtype: torch.dtype = torch.float32, group: dist.ProcessGroup | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
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
            self.num_allocated_bytes = _align(start + nbytes, _SESSION_ALIGN)
            out.append(self.buffer.storage[start : start + nbytes].view(dtype).view(tuple(shape)))
        return tuple(out) if batched else out[0]


class BucketBuffer:
    """Symmetric storage for collectives over ``group`` (a collective to build)."""

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
        if isinstance(group, Sequence) and not isinstance(group, dist.ProcessGroup):
            if len(group) != 1:
                raise EPConfigError(f"group: ep's BucketBuffer takes one group (ours), got {len(group)}")
            group = group[0]
        plan = None if isinstance(allocation_plan_or_num_bytes, int) else allocation_plan_or_num_bytes
        num_bytes = int(allocation_plan_or_num_bytes) if plan is None else int(plan.num_bytes)
        if num_bytes <= 0:
            raise EPValueError(f"allocation_plan_or_num_bytes: expected a positive size, got {num_bytes}")
        self._buffer: ElasticBuffer | None = ElasticBuffer(
            group,
            num_bytes=_align(num_bytes, _ALIGN),
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

    # ------------------------------------------------------------------------------------------------------------
    def _buf(self) -> ElasticBuffer:
        if self._buffer is None:
            raise EPStateError("BucketBuffer: used after destroy(); create a new buffer")
        return self._buffer

    @property
    def runtime(self) -> Any:
        return None if self._buffer is None else self._buffer.runtime

    def session(self) -> BucketSession:
        return BucketSession(self)

    def barrier(
        self, wait_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True, group=None
    ):
        self._buf().barrier(with_cpu_sync=with_cpu_sync)

    def destroy(self) -> None:
        self._buf().destroy()
        self._buffer = None
        self._backend = None  # closed by the buffer's destroy()

    def _inside(self, t: torch.Tensor) -> bool:
        off = t.data_ptr() - self.storage.data_ptr()
        return off >= 0 and off + t.nbytes <= self.num_bytes and t.device == self.storage.device

    def get_theoretical_num_sms(self, op: str, group: Any = None) -> int:
        """DeepEP's SM model on one NVLink domain (module doc: ours ignores it, the reductions are torch kernels)."""
        from ep_core import planner

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
        return _align(max(6 if op == "reduce_scatter" else 4, math.ceil(sms)), 2)

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

    def _handle(self, packed: bool, results: list[torch.Tensor]) -> _Handle:
        event = EventHandle() if self.storage.is_cuda else EventHandle(device="cpu")
        return _Handle(event, results[0] if packed else results)

    # ------------------------------------------------------------------------------------------------------------
    def all_gather(
        self, srcs: Any, dsts: Any = None, group: Any = None, num_sms: int | None = None
    ) -> _Handle:
        """Gather every rank's src into the gathered tensor (see the module doc); copy engine on the GPU."""
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
                    raise EPValueError(f"srcs[{i}]: its gathered tensor would leave the storage (rank {r})")
                plan.append((x, off))
        else:
            _, ds = self._pack(dsts)
            if len(ds) != len(xs):
                raise EPValueError(f"dsts: expected {len(xs)} tensors, got {len(ds)}")
            for i, (x, d) in enumerate(zip(xs, ds, strict=True)):
                d = self._check(f"dsts[{i}]", d)
                if d.dtype != x.dtype or d.nbytes != n * x.nbytes:
                    raise EPValueError(f"dsts[{i}]: expected {n} x {x.nbytes} bytes of {x.dtype} (rank {r})")
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
        """Shard ``rank`` of each src becomes ``scale *`` the sum over ranks of that shard (in place)."""
        if comm_precision != "fp32":
            raise EPValueError(f"comm_precision: ep supports 'fp32' only (ours), got {comm_precision!r}")
        packed, xs = self._pack(srcs)
        xs = [self._check(f"srcs[{i}]", x, reduce=True) for i, x in enumerate(xs)]
        n = self.num_ranks
        for i, x in enumerate(xs):
            if x.numel() % n:
                raise EPValueError(f"srcs[{i}]: {x.numel()} elements do not split into {n} shards")
        plan = [(x, self._offset(f"srcs[{i}]", x)) for i, x in enumerate(xs)]
        self._ops += 1
        outs = self._backend.bucket_reduce(plan, self._ops, float(scale), scatter=True)
        return self._handle(packed, outs)

    def all_reduce(
        self, srcs: Any, scale: float = 1.0, group: Any = None, num_sms: int | None = None
    ) -> _Handle:
        """Each src becomes ``scale *`` the sum over ranks (in place)."""
        packed, xs = self._pack(srcs)
        xs = [self._check(f"srcs[{i}]", x, reduce=True) for i, x in enumerate(xs)]
        plan = [(x, self._offset(f"srcs[{i}]", x)) for i, x in enumerate(xs)]
        self._ops += 1
        outs = self._backend.bucket_reduce(plan, self._ops, float(scale), scatter=False)
        return self._handle(packed, outs)
