"""All-gather sessions (DeepEP V2's AGRS: `agrs_*`, `all_gather`): sizes, configuration, the session state machine
and a numpy reference.

A session fills a stretch of the data region front to back: an `all_gather` of `b` bytes takes the next
`align(N * b, 32)`, rank r's part at `offset + r * b`, copied there on every peer, so the `[N, *shape]` result is a
view of the buffer. `agrs_get_inplace_tensor` hands out rank r's part of the next all-gather ahead of time (the
producer writes there, the local copy is skipped). Results stay valid until the session ends; ending waits for
every peer. Limits (`agrs_set_config`): `N > 1`, one NVLink domain, `num_max_session_bytes` of the data region, at
most 32 all-gathers per session (one signal slot each).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ep_core.errors import EPStateError, EPValueError

__all__ = [
    "AGRS_ALIGN_BYTES",
    "MAX_ALL_GATHERS_PER_SESSION",
    "NOT_IN_SESSION",
    "AGRSConfig",
    "AGRSSession",
    "HostAGRS",
    "all_gather_reference",
    "get_agrs_buffer_size_hint",
    "get_agrs_num_max_session_bytes",
    "make_agrs_config",
    "normalize_shapes",
    "reduce_scatter_reference",
]

AGRS_ALIGN_BYTES = 32
#: signal slots per session in the workspace (DeepEP's kNumMaxInflightAGRS)
MAX_ALL_GATHERS_PER_SESSION = 32
_BUFFER_ALIGN = 2 << 20


def _align(a: int, b: int) -> int:
    return -(-a // b) * b


def normalize_shapes(shapes: Any) -> tuple[list[tuple[int, ...]], bool]:
    """`(list of shapes, batched)`: a single shape (a tuple of ints, a `torch.Size`) or a sequence of shapes."""
    if isinstance(shapes, Sequence) and len(shapes) > 0 and isinstance(shapes[0], Sequence):
        out = [tuple(int(d) for d in s) for s in shapes]
        batched = True
    elif isinstance(shapes, Sequence):
        out = [tuple(int(d) for d in shapes)]
        batched = False
    else:
        raise EPValueError(f"shapes: expected a shape or a sequence of shapes, got {shapes!r}")
    for s in out:
        if any(d < 0 for d in s):
            raise EPValueError(f"shapes: expected non-negative dimensions, got {s}")
    return out, batched


def get_agrs_num_max_session_bytes(num_ranks: int, shapes: Any, itemsize: int) -> int:
    """Bytes one session needs for all-gathers of `shapes`: `sum(align(N * prod(shape) * itemsize, 32))`."""
    lst, _ = normalize_shapes(shapes)
    return sum(_align(num_ranks * math.prod(s) * itemsize, AGRS_ALIGN_BYTES) for s in lst)


def get_agrs_buffer_size_hint(num_max_session_bytes: int) -> int:
    """`align(num_max_session_bytes, 2 MiB)`."""
    if isinstance(num_max_session_bytes, bool) or not isinstance(num_max_session_bytes, int):
        raise EPValueError(f"num_max_session_bytes: expected an int, got {num_max_session_bytes!r}")
    if num_max_session_bytes <= 0:
        raise EPValueError(f"num_max_session_bytes: expected > 0, got {num_max_session_bytes}")
    return _align(num_max_session_bytes, _BUFFER_ALIGN)


@dataclass(frozen=True)
class AGRSConfig:
    rank: int
    num_ranks: int
    num_max_session_bytes: int  # aligned to 32
    num_max_all_gathers_per_session: int


def make_agrs_config(
    rank: int,
    num_ranks: int,
    num_nvlink_ranks: int,
    num_buffer_bytes: int,
    num_max_session_bytes: Any,
    num_max_all_gathers_per_session: Any,
) -> AGRSConfig:
    """Validate `agrs_set_config`'s arguments (`num_buffer_bytes`: the data region)."""
    for name, v in (
        ("num_max_session_bytes", num_max_session_bytes),
        ("num_max_all_gathers_per_session", num_max_all_gathers_per_session),
    ):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
            raise EPValueError(f"{name}: expected a positive int, got {v!r} (rank {rank})")
    if num_ranks < 2:
        raise EPValueError(
            f"agrs_set_config: all-gather sessions need at least 2 ranks, the group has {num_ranks}"
        )
    if num_nvlink_ranks != num_ranks:
        raise EPValueError(
            f"agrs_set_config: every rank must be in one NVLink domain ({num_nvlink_ranks} of {num_ranks} ranks "
            f"are, rank {rank})"
        )
    b, n = int(num_max_session_bytes), int(num_max_all_gathers_per_session)
    if b > num_buffer_bytes:
        raise EPValueError(
            f"num_max_session_bytes: {b} exceeds the buffer ({num_buffer_bytes} bytes) on rank {rank}; size it with "
            "get_agrs_buffer_size_hint()"
        )
    if n > MAX_ALL_GATHERS_PER_SESSION:
        raise EPValueError(
            f"num_max_all_gathers_per_session: expected <= {MAX_ALL_GATHERS_PER_SESSION}, got {n} (rank {rank})"
        )
    return AGRSConfig(rank, num_ranks, _align(b, AGRS_ALIGN_BYTES), n)


# the words of the refusal of an all-gather outside a session (a peer's announcement of it: `AGRSSession.abandon`)
NOT_IN_SESSION = "is not inside an AGRS session"


class AGRSSession:
    """The session state of one rank: which session, how far its region is filled, how many all-gathers ran.

    Pure bookkeeping (offsets into the data region); the backends move the bytes."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.config: AGRSConfig | None = None
        self.in_session = False
        self.session_idx = 0  # sessions begun so far; the signal value of the current one
        self.offset = 0  # bytes of the region used by this session's all-gathers
        self.slot = 0  # all-gathers run in this session

    def configure(self, config: AGRSConfig) -> None:
        if self.in_session:
            raise EPStateError(f"agrs_set_config: rank {self.rank} is inside a session; destroy it first")
        self.config = config

    def _require(self, op: str) -> AGRSConfig:
        if self.config is None:
            raise EPStateError(f"{op}: call agrs_set_config() first (rank {self.rank})")
        if not self.in_session:
            raise EPStateError(
                f"{op}: rank {self.rank} {NOT_IN_SESSION}; use create_agrs_session() or "
                "`with buffer.agrs_new_session():`"
            )
        return self.config

    def create(self) -> None:
        if self.in_session:
            raise EPStateError(
                f"create_agrs_session: rank {self.rank} is already inside session {self.session_idx}; sessions do "
                "not nest (call destroy_agrs_session() first)"
            )
        self.in_session = True
        self.offset = 0
        self.slot = 0
        self.session_idx += 1

    def destroy(self) -> int:
        """End the session; returns its index (the value peers signal and wait for)."""
        if not self.in_session:
            raise EPStateError(f"destroy_agrs_session: rank {self.rank} is not inside an AGRS session")
        self.in_session = False
        return self.session_idx

    def abandon(self) -> None:
        """End the current session as if it never began, without the peers: a peer refused its call from outside
        any session (its announcement says `NOT_IN_SESSION`), so no peer takes part in this session's end and the
        session counts on no rank (the ranks' session indices stay equal)."""
        if self.in_session:
            self.in_session = False
            self.session_idx -= 1
            self.offset = 0
            self.slot = 0

    def _check_fits(self, op: str, cfg: AGRSConfig, end: int) -> None:
        if self.slot >= cfg.num_max_all_gathers_per_session:
            raise EPValueError(
                f"{op}: session {self.session_idx} already ran {self.slot} all-gathers "
                f"(num_max_all_gathers_per_session) on rank {self.rank}; end the session and begin a new one"
            )
        if end > cfg.num_max_session_bytes:
            raise EPValueError(
                f"{op}: the session needs {end} bytes, more than num_max_session_bytes "
                f"({cfg.num_max_session_bytes}) on rank {self.rank}; end the session (or raise the limit with "
                "agrs_set_config and get_agrs_num_max_session_bytes)"
            )

    def inplace_offsets(self, nbytes_list: Sequence[int]) -> list[int]:
        """Offsets of this rank's parts of the next all-gather(s), without using them up."""
        cfg = self._require("agrs_get_inplace_tensor")
        if len(nbytes_list) < 1:
            raise EPValueError(f"shapes: expected at least one shape (rank {self.rank})")
        out = []
        off = self.offset
        for b in nbytes_list:
            self._check_fits("agrs_get_inplace_tensor", cfg, off + b * cfg.num_ranks)
            out.append(off + b * self.rank)
            off += _align(b * cfg.num_ranks, AGRS_ALIGN_BYTES)
        return out

    def plan_all_gather(
        self, nbytes_list: Sequence[int], inplace: Sequence[int | None]
    ) -> tuple[list[int], int]:
        """Take the region of one (batched) all-gather: returns `(offsets of each gathered [N, ...] result, slot)`.

        `inplace[i]` is the offset of tensor i when it already lies in the session region (else None); it must
        be this rank's part of exactly this all-gather."""
        cfg = self._require("all_gather")
        if len(nbytes_list) < 1:
            raise EPValueError(f"t: expected at least one tensor (rank {self.rank})")
        offsets = []
        off = self.offset
        for i, (b, at) in enumerate(zip(nbytes_list, inplace, strict=True)):
            if at is not None and at != off + b * self.rank:
                raise EPValueError(
                    f"t[{i}]: lies in the AGRS session region at byte {at}, but this all-gather's part for rank "
                    f"{self.rank} is at {off + b * self.rank}; pass the tensors of agrs_get_inplace_tensor() in "
                    "the same order and shapes, or a tensor outside the buffer"
                )
            offsets.append(off)
            off += _align(b * cfg.num_ranks, AGRS_ALIGN_BYTES)
        self._check_fits("all_gather", cfg, off)
        self.offset = off
        slot = self.slot
        self.slot += 1
        return offsets, slot


def all_gather_reference(parts: list[np.ndarray]) -> np.ndarray:
    """The oracle: rank r's tensor at index r of a new leading dimension."""
    return np.stack(parts, axis=0)


def reduce_scatter_reference(inputs: list[np.ndarray], rank: int) -> np.ndarray:
    """The oracle of ep_torch's (ours) reduce-scatter: chunk `rank` of every rank's input (split along dim 0 into
    N chunks), summed in float32 in rank order."""
    n = len(inputs)
    chunks = [np.split(np.asarray(x, dtype=np.float32), n, axis=0)[rank] for x in inputs]
    acc = chunks[0].copy()
    for c in chunks[1:]:
        acc += c
    return acc


class HostAGRS:
    """All-gather sessions on a host region over any bootstrap (framework-agnostic; numpy): the session layout and
    rules of `AGRSSession`, the bytes moved by `bootstrap.allgather`. Results are views of `region`."""

    def __init__(self, bootstrap: Any, num_buffer_bytes: int, num_nvlink_ranks: int | None = None) -> None:
        from ep_core.bootstrap import check_bootstrap

        self.bootstrap = check_bootstrap(bootstrap)
        self.rank, self.num_ranks = int(self.bootstrap.rank), int(self.bootstrap.size)
        self.num_nvlink_ranks = self.num_ranks if num_nvlink_ranks is None else int(num_nvlink_ranks)
        self.region = np.zeros(int(num_buffer_bytes), dtype=np.uint8)
        self.session = AGRSSession(self.rank)

    def set_config(self, num_max_session_bytes: int, num_max_all_gathers_per_session: int) -> None:
        cfg = make_agrs_config(
            self.rank,
            self.num_ranks,
            self.num_nvlink_ranks,
            self.region.nbytes,
            num_max_session_bytes,
            num_max_all_gathers_per_session,
        )
        self.session.configure(cfg)
        self.bootstrap.barrier()

    def create_session(self) -> None:
        self.session.create()

    def destroy_session(self) -> None:
        self.session.destroy()
        self.bootstrap.barrier()

    def get_inplace(self, shapes: Any, dtype: Any) -> Any:
        lst, batched = normalize_shapes(shapes)
        dt = np.dtype(dtype)
        sizes = [math.prod(s) * dt.itemsize for s in lst]
        offs = self.session.inplace_offsets(sizes)
        out = tuple(
            self.region[o : o + b].view(dt).reshape(s) for o, b, s in zip(offs, sizes, lst, strict=True)
        )
        return out if batched else out[0]

    def _exchange(self, op: str, raws: list[bytes], shapes: list) -> list[list[bytes]]:
        desc = repr((op, self.session.session_idx, self.session.slot, shapes)).encode()
        every = self.bootstrap.allgather(desc + b"\0" + b"".join(raws))
        heads = [e.split(b"\0", 1)[0] for e in every]
        if any(h != heads[0] for h in heads):
            from ep_core.errors import EPMismatchError

            raise EPMismatchError(f"{op}: ranks disagree ({[h.decode() for h in heads]}); make the same call")
        out = []
        sizes = [len(r) for r in raws]
        for e in every:
            body = e.split(b"\0", 1)[1]
            pos, parts = 0, []
            for b in sizes:
                parts.append(body[pos : pos + b])
                pos += b
            out.append(parts)
        return out

    def all_gather(self, arrays: Any) -> Any:
        single = isinstance(arrays, np.ndarray)
        xs = [np.ascontiguousarray(a) for a in ([arrays] if single else arrays)]
        base = self.region.ctypes.data
        cap = self.session.config.num_max_session_bytes if self.session.config else 0
        inplace = [a.ctypes.data - base if 0 <= a.ctypes.data - base < cap else None for a in xs]
        raws = [a.tobytes() for a in xs]
        offsets, _slot = self.session.plan_all_gather([a.nbytes for a in xs], inplace)
        every = self._exchange("all_gather", raws, [(a.shape, str(a.dtype)) for a in xs])
        n = self.num_ranks
        outs = []
        for i, (a, off) in enumerate(zip(xs, offsets, strict=True)):
            for r in range(n):
                self.region[off + r * a.nbytes : off + (r + 1) * a.nbytes] = np.frombuffer(
                    every[r][i], np.uint8
                )
            outs.append(self.region[off : off + n * a.nbytes].view(a.dtype).reshape(n, *a.shape))
        return outs[0] if single else outs

    def reduce_scatter(self, x: np.ndarray) -> np.ndarray:
        n = self.num_ranks
        a = np.ascontiguousarray(x)
        if a.ndim < 1 or a.shape[0] % n:
            raise EPValueError(
                f"t: expected a first dimension divisible by the {n} ranks, got shape {a.shape}"
            )
        cb = a.nbytes // n
        (off,), _slot = self.session.plan_all_gather([cb], [None])
        every = self._exchange("reduce_scatter", [a.tobytes()], [(a.shape, str(a.dtype))])
        for r in range(n):
            self.region[off + r * cb : off + (r + 1) * cb] = np.frombuffer(
                every[r][0][self.rank * cb : (self.rank + 1) * cb], np.uint8
            )
        chunk = (a.shape[0] // n, *a.shape[1:])
        parts = self.region[off : off + n * cb].view(a.dtype).reshape(n, *chunk)
        acc = parts[0].astype(np.float32)
        for p in parts[1:]:
            acc += p
        return acc
