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
``num_cpu_timeout_secs``) and the GPU over ipc (processes sharing a GPU or one per GPU: :func:`_gpu_transfers`).
On the GPU the agreement is the same host exchange (it also carries each receiver's ``dsts`` offsets, which its
sender writes to); then, on the comm stream after the current one, no SM: the receiver tells its sender that its
``dsts`` may be overwritten (a stream write of the operation's number into the sender's signal word), the sender
waits for that, copies each src into the receiver's storage (``cuMemcpyDtoDAsync`` between the mapped peer
regions, the copy engine) and writes the arrival into the receiver's signal word (ordered after the copies), and the
receiver waits for the arrival; the current stream then waits for the comm stream. Every wait on a peer is bounded
by ``num_gpu_timeout_secs`` (``ep_core.signal_wait``, as the all-gather's): one that expires records the rank, the
peer and what it waited for, and the next operation of the buffer raises ``EPTimeoutError`` naming them (and keeps
raising it until ``reset()``). A send to itself is a device copy on the current stream.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist
from ep_core.errors import EPMismatchError, EPTypeError, EPValueError

from .elastic_copy_engine import _BUCKET_DONE, _SIGNAL_BYTES

__all__ = ["send_recv"]

_TAG = 0x5352  # gloo tag of the transfers (the PP FIFOs use 0x5050-0x5052)
# the GPU path's u64 signal words (CopyEngineBackend's 2 MiB signal allocation, after the BucketBuffer words), each
# indexed by the peer that writes it: "my dsts are free for your send" and "my srcs have landed in your dsts"
_SR_READY = _BUCKET_DONE + 1024
_SR_ARRIVED = _BUCKET_DONE + 2048


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

    with _Guarded(buf, "send_recv", announce=True):
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
        cuda = buf.storage.is_cuda
        if cuda:
            buf._backend.check()  # a GPU wait that expired earlier raises here, before this call's exchange
        buf._ops += 1
        mine = (
            buf._ops,
            dst,
            src,
            [(str(x.dtype), x.nbytes) for x in xs],
            [(str(d.dtype), d.nbytes) for d in ds],
            offs,
        )
        every = [pickle.loads(b) for b in buf._buf().bootstrap.allgather(pickle.dumps(mine))]
        _check_pairs(every, r)
        if cuda:
            _gpu_transfers(buf, xs, ds, offs, dst, src, every[dst][5] if dst is not None else [])
            return buf._handle(True, [None]) if not ds else buf._handle(packed_d, ds)
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
    for q, e in enumerate(every):
        d, s, sent = e[1], e[2], e[3]
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


assert 8 * (_SR_ARRIVED + 1024) <= _SIGNAL_BYTES  # the words fit the signal allocation


def _gpu_transfers(
    buf: Any,
    xs: list[torch.Tensor],
    ds: list[torch.Tensor],
    offs: list[int],
    dst: int | None,
    src: int | None,
    dst_offs: list[int],
) -> None:
    """The GPU half of one ``send_recv`` after the agreement (module doc): ``dst_offs`` are the receiver's ``dsts``
    offsets in its storage (from the exchange). The protocol's order on every rank's comm stream: free (to ``src``),
    wait free (from ``dst``), copies, arrival (to ``dst``), wait arrival (from ``src``); each wait depends only on
    writes queued before any wait on the peers' streams, so no ordering of the ranks can deadlock (rings included)."""
    be = buf._backend
    ops, r, op = be.ops, buf.rank_idx, buf._ops
    if src == r:  # to itself: a device copy on the current stream (the pairs matched: srcs[i] fits dsts[i])
        for x, d, off in zip(xs, ds, offs, strict=True):
            buf.storage[off : off + d.nbytes].copy_(x.detach().reshape(-1).view(torch.uint8))
    remote_send = dst is not None and dst != r
    remote_recv = src is not None and src != r
    if not (remote_send or remote_recv):
        return
    s = ops.comm_stream()  # ordered after the current stream: the srcs are written, the dsts no longer read
    if remote_recv:  # this rank's dsts may be overwritten by src from here on
        ops.write(be.sig[src] + 8 * (_SR_READY + r), op, s)
    if remote_send:
        what = f"BucketBuffer.send_recv: operation {op}, rank {dst}'s dsts free for this rank's send"
        ops.wait(be.sig[r] + 8 * (_SR_READY + dst), op, s, dst, what)
        for x, off in zip(xs, dst_offs, strict=True):
            ops.copy(be.data[dst] + off, x.data_ptr(), x.nbytes, s)
        ops.keep(xs)  # the srcs live until the copies ran
        ops.write(be.sig[dst] + 8 * (_SR_ARRIVED + r), op, s)  # ordered after the copies (stream order)
    if remote_recv:
        what = f"BucketBuffer.send_recv: operation {op}, the srcs of rank {src}"
        ops.wait(be.sig[r] + 8 * (_SR_ARRIVED + src), op, s, src, what)
    ops.wait_event(ops.record())  # the current stream: after the arrivals and this rank's sends
