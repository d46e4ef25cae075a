"""``BucketBuffer.send_recv``: point-to-point transfers into registered tensors (DeepEP 2.6 added a method of this
name to ``BucketBuffer``; its source was not available to ep, so the signature and semantics here are ep's).

``send_recv(srcs=None, dsts=None, dst_rank_idx=None, src_rank_idx=None, group=None, num_sms=None)``: every rank of
the group calls it (a collective step); this rank's ``srcs`` land in ``dsts`` of rank ``dst_rank_idx``, and ``dsts``
(tensors inside this buffer's storage, where a peer may write) receive the ``srcs`` of rank ``src_rank_idx``.
``None`` for a rank index: this rank sends (receives) nothing, and then gives no ``srcs`` (``dsts``). A tensor or a
sequence of tensors, paired by position: the i-th src of the sender and the i-th dst of its receiver must have the
same dtype and byte count. The pairs must match across ranks (rank ``d = dst_rank_idx(r)`` has ``src_rank_idx = r``,
and back); a rank may send to itself (a local copy). Rings (``r -> r+1``), swaps and single transfers are all one
call. ``num_sms``: None or 0 (copy-engine driven, as the all-gather); ``handle.num_sms`` is 0. The handle's
``wait()`` / ``current_stream_wait()`` returns ``dsts`` (one tensor for a tensor argument), None when this rank
receives nothing.

Collective safety (issue 41): inside the buffer's rank-state guard (``_Guarded``): a rank that refuses its arguments
announces it in the agreement exchange (its peers raise ``EPPeerError`` naming it; the ranks stay in step); ranks
whose calls do not pair (different operation counts, rank indices that do not match, dtype or byte counts that
differ between a sender and its receiver) all raise the same ``EPMismatchError`` and the buffer refuses every call
until ``reset()``.

Backends: the CPU reference backend (gloo ``isend``/``irecv`` after the agreement, every wait bounded by
``num_cpu_timeout_secs``). On the GPU (ipc) it raises ``NotImplementedError`` naming ``send_recv`` (ours: the copy
engine put into the peer's storage is not written yet).
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist
from ep_core.errors import EPMismatchError, EPTypeError, EPValueError

__all__ = ["send_recv"]

_TAG = 0x5352  # gloo tag of the transfers (the PP FIFOs use 0x5050-0x5052)


def _tensors(name: str, x: Any) -> tuple[bool, list[torch.Tensor]]:
    if x is None:
        return False, []
    if isinstance(x, torch.Tensor):
        return True, [x]
    if isinstance(x, (str, bytes)) or not hasattr(x, "__iter__"):
        raise EPTypeError(f"{name}: expected a tensor, a sequence of tensors or None, got {type(x).__name__}")
    items = list(x)
    if not items or any(not isinstance(t, torch.Tensor) for t in items):
        raise EPTypeError(f"{name}: expected a non-empty sequence of tensors (no None)")
    return False, items


def _peer(name: str, value: Any, n: int, rank: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < n:
        raise EPValueError(
            f"{name}: expected None or a rank of the group in [0, {n}), got {value!r} (rank {rank})"
        )
    return value


def send_recv(
    buf: Any,
    srcs: Any = None,
    dsts: Any = None,
    dst_rank_idx: int | None = None,
    src_rank_idx: int | None = None,
    num_sms: int | None = None,
) -> Any:
    """The body of ``BucketBuffer.send_recv`` on ``buf`` (the context buffer of the chosen group; module doc)."""
    from .bucket_buffer import _Guarded

    with _Guarded(buf, "send_recv"):
        n, r = buf.num_ranks, buf.rank_idx
        if num_sms not in (None, 0):
            raise EPValueError(
                f"num_sms: send_recv is copy-engine driven: expected None or 0, got {num_sms!r}"
            )
        dst = _peer("dst_rank_idx", dst_rank_idx, n, r)
        src = _peer("src_rank_idx", src_rank_idx, n, r)
        _, xs = _tensors("srcs", srcs)
        packed_d, ds = _tensors("dsts", dsts)
        if (dst is None) != (not xs):
            raise EPValueError(
                f"srcs: give srcs exactly when dst_rank_idx is set (dst_rank_idx={dst}, {len(xs)} srcs; rank {r})"
            )
        if (src is None) != (not ds):
            raise EPValueError(
                f"dsts: give dsts exactly when src_rank_idx is set (src_rank_idx={src}, {len(ds)} dsts; rank {r})"
            )
        xs = [buf._check(f"srcs[{i}]", x) for i, x in enumerate(xs)]
        ds = [buf._check(f"dsts[{i}]", d) for i, d in enumerate(ds)]
        offs = [
            buf._offset(f"dsts[{i}]", d) for i, d in enumerate(ds)
        ]  # a peer writes there: registered only
        if buf.storage.is_cuda:
            raise NotImplementedError(
                "send_recv: BucketBuffer.send_recv runs on the CPU reference backend only (ours); on the GPU (ipc) "
                "the copy-engine put into the peer's storage is not implemented"
            )
        buf._ops += 1
        mine = (
            buf._ops,
            dst,
            src,
            [(str(x.dtype), x.nbytes) for x in xs],
            [(str(d.dtype), d.nbytes) for d in ds],
        )
        every = [pickle.loads(b) for b in buf._buf().bootstrap.allgather(pickle.dumps(mine))]
        _check_pairs(every, r)
        works, held = [], []  # the sent bytes stay alive until their sends complete
        for i, x in enumerate(xs):
            if dst is not None and dst != r:
                held.append(x.detach().reshape(-1).view(torch.uint8))
                works.append(dist.isend(held[-1], buf._backend._global(dst), group=buf.group, tag=_TAG + i))
        for i, (d, off) in enumerate(zip(ds, offs, strict=True)):
            place = buf.storage[off : off + d.nbytes]
            if src == r:  # to itself: the pairs matched, so its srcs are the dsts' sources
                place.copy_(xs[i].detach().reshape(-1).view(torch.uint8))
            else:
                works.append(dist.irecv(place, buf._backend._global(src), group=buf.group, tag=_TAG + i))
        for w in works:
            buf._backend._wait(w, "send_recv", f"the transfers with ranks {dst} / {src}", buf._ops)
        return buf._handle(True, [None]) if not ds else buf._handle(packed_d, ds)


def _check_pairs(every: list[tuple], rank: int) -> None:
    """Every rank runs this on the same list: the same error everywhere when the calls do not pair."""
    problems = []
    if len({e[0] for e in every}) > 1:
        problems.append(
            f"operation counts differ ({[e[0] for e in every]}): another call is pending on a rank"
        )
    for q, (_, d, s, sent, _) in enumerate(every):
        if d is not None:
            if every[d][2] != q:
                problems.append(f"rank {q} sends to rank {d}, whose src_rank_idx is {every[d][2]}")
            elif sent != every[d][4]:
                problems.append(
                    f"rank {q}'s srcs {sent} do not fit rank {d}'s dsts {every[d][4]} (dtype, bytes)"
                )
        if s is not None and every[s][1] != q:
            problems.append(f"rank {q} receives from rank {s}, whose dst_rank_idx is {every[s][1]}")
    if problems:
        raise EPMismatchError(
            f"send_recv (rank {rank}): the ranks' calls do not pair: "
            + "; ".join(problems)
            + "; every rank raises "
            "this error and the buffer refuses every call until reset() is called on every rank",
            fields={"pairs": [(e[1], e[2]) for e in every]},
        )
