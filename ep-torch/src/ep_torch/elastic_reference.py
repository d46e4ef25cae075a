"""The CPU backend of PP, Engram and AGRS (transport ``reference``, CPU tensors on a gloo group): the GPU path's
results, with torch.distributed doing what the copy engine and the signals do there.

- PP: per ring direction one FIFO of ``isend`` messages (a header, then the bytes), each answered by a release once
  copied out; a sender with ``num_max_inflight_tensors`` unreleased waits for the oldest. One rank: a local queue.
- Engram: ``engram_write`` all-gathers the tables, so a fetch reads a local replica (one-sided, as RDMA gets).
- AGRS: gloo all-gathers into the session region of the data region (results are views of it); ending is a barrier.

Every wait is bounded by ``num_cpu_timeout_secs`` (``EPTimeoutError`` naming the rank and what it waited for).
"""

from __future__ import annotations

import datetime
import weakref
from collections import deque
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from ep_core import engram
from ep_core.errors import EPPeerError, EPTimeoutError, EPValueError

__all__ = ["ReferenceBackend"]

# gloo point-to-point tags of the PP FIFOs (collectives do not use tags)
_TAG_HEADER, _TAG_DATA, _TAG_RELEASE = 0x5050, 0x5051, 0x5052


class _Fifo:
    def __init__(self) -> None:
        self.sent = 0
        self.released = 0
        self.received = 0
        self.pending: deque = deque()  # (works, tensors) of sends not yet released
        self.local: deque = deque()  # a rank's FIFO to itself


class ReferenceBackend:
    def __init__(self, buf: Any) -> None:
        self.buf = weakref.proxy(buf)  # the buffer owns this backend: no cycle keeping its memory alive
        self.rank = buf.rank_idx
        self.group = buf.group
        self.timeout = float(buf._rt().config.num_cpu_timeout_secs)
        data = buf._rt().data
        self._region = torch.from_numpy(np.asarray(data))  # the buffer's data region, uint8
        self._fifos: dict[tuple[int, int], _Fifo] = {}
        self._release_works: list = []
        self._replica: dict[int, torch.Tensor] = {}  # per Engram layer (ElasticBuffer: layer 0)
        self._sf: dict[int, torch.Tensor | None] = {}

    # ----------------------------------------------------------------------------------------------------------
    def _global(self, r: int) -> int:
        return dist.get_global_rank(self.group, r) if self.group is not dist.group.WORLD else r

    def _wait(self, work: Any, what: str, counter: Any, value: Any) -> None:
        try:
            ok = work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except RuntimeError as exc:
            if "imeout" not in str(exc) and "imed out" not in str(exc):  # a peer left: name it (issue 41)
                dead = getattr(self.buf.bootstrap, "_dead", None)
                ranks = dead() if dead is not None else []
                names = ", ".join(map(str, ranks)) or "a peer"
                raise EPPeerError(
                    f"rank {self.rank}: {what} failed waiting for {counter} because rank {names} left the group "
                    f"(died or closed its connection: {str(exc).splitlines()[0][:200]}); rebuild the group",
                    ranks=tuple(ranks),
                ) from exc
            ok = False
        if ok is False:
            raise EPTimeoutError(
                self.rank,
                what,
                counter,
                value,
                f"rank {self.rank} timed out after {self.timeout} s in {what} waiting for {counter}: the peer did "
                "not take part (check that it makes the matching call), or raise num_cpu_timeout_secs. gloo "
                "closes the connection whose wait timed out: rebuild the process group",
            )

    def _lost(self, exc: BaseException, peer: int, what: str) -> EPPeerError:
        return EPPeerError(
            f"rank {self.rank}: {what} failed because rank {peer} left the group (died or closed its connection: "
            f"{str(exc).splitlines()[0][:200]}); rebuild the group",
            ranks=(peer,),
        )

    def region(self) -> torch.Tensor:
        return self._region

    def barrier(self) -> None:
        self.buf.bootstrap.barrier()

    # ----------------------------------------------------------------------------------------------------------
    # PP

    def pp_configure(self, cfg: Any, old: Any) -> None:
        self.barrier()

    def _fifo(self, src: int, dst: int) -> _Fifo:
        return self._fifos.setdefault((src, dst), _Fifo())

    def _reap_releases(self) -> None:
        self._release_works = [w for w in self._release_works if not w[0].is_completed()]

    def pp_send(self, cfg: Any, t: torch.Tensor, dst: int) -> None:
        fifo = self._fifo(self.rank, dst)
        payload = t.detach().reshape(-1).view(torch.uint8).clone()  # the slot: t may be reused at once
        if dst == self.rank:
            if fifo.sent - fifo.received >= cfg.num_max_inflight_tensors:
                raise EPTimeoutError(
                    self.rank, "pp_send", "slot release from itself", fifo.received,
                    f"pp_send: rank {self.rank} sends to itself with {cfg.num_max_inflight_tensors} tensors in "
                    "flight (num_max_inflight_tensors) and nothing received: it would wait forever",
                )  # fmt: skip
            fifo.local.append(payload)
            fifo.sent += 1
            return
        while fifo.sent - fifo.released >= cfg.num_max_inflight_tensors:
            ack = torch.zeros(1, dtype=torch.int64)
            work = dist.irecv(ack, self._global(dst), group=self.group, tag=_TAG_RELEASE)
            self._wait(work, "pp_send", f"the release of tensor {fifo.released} by rank {dst}", fifo.released)
            if int(ack) != fifo.released:
                raise EPValueError(
                    f"pp_send: rank {dst} released tensor {int(ack)}, rank {self.rank} expected {fifo.released}"
                )
            works, _ = fifo.pending.popleft()
            for w in works:
                self._wait(w, "pp_send", f"tensor {fifo.released} to rank {dst}", fifo.released)
            fifo.released += 1
        header = torch.tensor([payload.numel(), fifo.sent], dtype=torch.int64)
        g = self._global(dst)
        try:
            works = [
                dist.isend(header, g, group=self.group, tag=_TAG_HEADER),
                dist.isend(payload, g, group=self.group, tag=_TAG_DATA),
            ]
        except RuntimeError as exc:  # the connection to that rank is gone
            raise self._lost(exc, dst, f"pp_send to rank {dst}") from exc
        fifo.pending.append((works, (header, payload)))
        fifo.sent += 1

    def pp_recv(self, cfg: Any, t: torch.Tensor, src: int) -> None:
        fifo = self._fifo(src, self.rank)
        out = t.detach().reshape(-1).view(torch.uint8)
        if src == self.rank:
            if not fifo.local:
                raise EPTimeoutError(
                    self.rank, "pp_recv", "a tensor from itself", fifo.sent,
                    f"pp_recv: rank {self.rank} receives from itself but sent nothing: it would wait forever",
                )  # fmt: skip
            got = fifo.local.popleft()
            fifo.received += 1
            self._check_size(out, got.numel(), src, fifo.received - 1)
            out.copy_(got)
            return
        g = self._global(src)
        header = torch.zeros(2, dtype=torch.int64)
        what = f"tensor {fifo.received} from rank {src}"
        try:
            work = dist.irecv(header, g, group=self.group, tag=_TAG_HEADER)
        except RuntimeError as exc:  # the connection to that rank is gone
            raise self._lost(exc, src, f"pp_recv from rank {src}") from exc
        self._wait(work, "pp_recv", what, fifo.received)
        nbytes, seq = int(header[0]), int(header[1])
        if nbytes < 0:  # the sender refused its pp_send (`pp_abort`): its message follows
            note = torch.zeros(-nbytes, dtype=torch.uint8)
            self._wait(dist.irecv(note, g, group=self.group, tag=_TAG_DATA), "pp_recv", what, fifo.received)
            raise EPPeerError(
                f"pp_recv on rank {self.rank}: rank {src} refused the pp_send this pp_recv waits for (it raised "
                f"{bytes(note.numpy()).decode(errors='replace')}); the FIFO stays in step",
                ranks=(src,),
                announced=True,
            )
        into = out if nbytes == out.numel() else torch.empty(nbytes, dtype=torch.uint8)
        self._wait(dist.irecv(into, g, group=self.group, tag=_TAG_DATA), "pp_recv", what, fifo.received)
        ack = torch.tensor([seq], dtype=torch.int64)
        self._reap_releases()
        self._release_works.append((dist.isend(ack, g, group=self.group, tag=_TAG_RELEASE), ack))
        fifo.received += 1
        self._check_size(out, nbytes, src, seq)

    def pp_abort(self, dst: int, message: str) -> None:
        """Tell ``dst``'s pending ``pp_recv`` from this rank that this rank refused its ``pp_send`` (a header with a
        negative size, then the message); nothing is sent to this rank itself."""
        if dst == self.rank:
            return
        note = torch.frombuffer(bytearray(message.encode()[:2000] or b"?"), dtype=torch.uint8).clone()
        g = self._global(dst)
        header = torch.tensor([-note.numel(), -1], dtype=torch.int64)
        self._reap_releases()
        for t in (header, note):  # not waited for: kept until the receiver took them
            tag = _TAG_HEADER if t is header else _TAG_DATA
            self._release_works.append((dist.isend(t, g, group=self.group, tag=tag), t))

    def _check_size(self, out: torch.Tensor, nbytes: int, src: int, seq: int) -> None:
        if nbytes != out.numel():
            raise EPValueError(
                f"t: rank {self.rank} receives {out.numel()} bytes but rank {src} sent {nbytes} (tensor {seq} of "
                "that FIFO); pp_send and pp_recv must use tensors of the same size"
            )

    # ----------------------------------------------------------------------------------------------------------
    # Engram

    def engram_write(
        self,
        table: Any,
        storage: torch.Tensor,
        sf: torch.Tensor | None,
        layer: int = 0,
        offset: int = 0,
        barriers: bool = True,
    ) -> None:
        """All-gather the tables of `layer` (a replica per rank: fetches stay local and one-sided). `offset` (where
        the GPU keeps the layer in the storage) has no meaning here."""
        if barriers:
            self.barrier()
        mine = storage.detach().reshape(-1).view(torch.uint8).contiguous()
        parts = [torch.empty_like(mine) for _ in range(table.num_ranks)]
        work = dist.all_gather(parts, mine, group=self.group, async_op=True)
        self._wait(work, "engram_write", "the tables of every rank", 0)
        self._replica[layer] = (
            torch.cat(parts).view(storage.dtype).view(table.num_total_entries, table.hidden)
        )
        self._sf[layer] = None if sf is None else sf.detach().clone()
        if barriers:
            self.barrier()

    def engram_fetch(
        self, table: Any, indices: torch.Tensor, col_major: bool, layer: int = 0, front: int = 0
    ) -> Any:
        replica = self._replica[layer]
        t, k = indices.shape
        flat = indices.reshape(-1).to(torch.int64)
        nbytes = t * k * table.entry_bytes
        dtype = replica.dtype
        data = self._region[front : front + nbytes].view(dtype).view(t * k, table.hidden)
        data.copy_(replica.index_select(0, flat))
        sf = None
        table_sf = self._sf.get(layer)
        if table_sf is not None:
            p = table.num_sf_packs
            rows = table_sf.index_select(0, flat).reshape(t, k * p)
            shape, transposed = engram.sf_layout(t, k, p, col_major)
            if transposed:
                store = torch.zeros(shape, dtype=table_sf.dtype)
                store[:, :t] = rows.t()
                sf = store.t()[:t]
            else:
                sf = rows

        def hook() -> tuple[torch.Tensor, torch.Tensor | None]:
            return data, sf

        return hook

    # ----------------------------------------------------------------------------------------------------------
    # AGRS

    def agrs_end_session(self, session_idx: int) -> None:
        self.barrier()

    def all_gather(
        self,
        tensors: list[torch.Tensor],
        offsets: list[int],
        inplace: list[int | None],
        slot: int,
        session_idx: int,
    ) -> list[torch.Tensor]:
        n = self.buf.num_ranks
        self.buf._agree(
            "all_gather",
            {
                "session": session_idx,
                "slot": slot,
                "tensors": [(tuple(x.shape), str(x.dtype)) for x in tensors],
            },
        )
        outs = []
        for x, off in zip(tensors, offsets, strict=True):
            b = x.nbytes
            src = x.detach().reshape(-1).view(torch.uint8)
            src = (
                src.clone()
            )  # gloo reads the input while writing the outputs, which may include it (in place)
            parts = [self._region[off + r * b : off + (r + 1) * b] for r in range(n)]
            work = dist.all_gather(parts, src, group=self.group, async_op=True)
            self._wait(work, "all_gather", f"every rank's tensor of slot {slot}", session_idx)
            outs.append(self._region[off : off + n * b].view(x.dtype).view(n, *x.shape))
        return outs

    def reduce_scatter(self, t: torch.Tensor, off: int, cb: int, slot: int, session_idx: int) -> torch.Tensor:
        """Every rank's chunk `rank` lands at part `rank` of this rank's session slot, as on the GPU; returns the
        `[N, chunk]` parts (gloo has no all-to-all on every build: an all-gather of the whole inputs does it)."""
        n = self.buf.num_ranks
        self.buf._agree(
            "reduce_scatter", {"session": session_idx, "slot": slot, "t": (tuple(t.shape), str(t.dtype))}
        )
        src = t.detach().reshape(-1).view(torch.uint8).clone()
        full = [torch.empty_like(src) for _ in range(n)]
        work = dist.all_gather(full, src, group=self.group, async_op=True)
        self._wait(work, "reduce_scatter", f"every rank's input of slot {slot}", session_idx)
        for r in range(n):
            self._region[off + r * cb : off + (r + 1) * cb] = full[r][self.rank * cb : (self.rank + 1) * cb]
        chunk = (t.shape[0] // n, *t.shape[1:])
        return self._region[off : off + n * cb].view(t.dtype).view(n, *chunk)

    def agrs_wait(self, slot: int, session_idx: int) -> None:
        return None  # the gloo all-gather already completed

    # ----------------------------------------------------------------------------------------------------------
    # BucketBuffer

    def bucket_all_gather(self, plan: list[tuple[torch.Tensor, int]], op: int) -> None:
        n = self.buf.num_ranks
        self.buf._agree("all_gather", {"op": op, "t": [(tuple(x.shape), str(x.dtype), o) for x, o in plan]})
        for x, off in plan:
            b = x.nbytes
            src = x.detach().reshape(-1).view(torch.uint8).clone()
            parts = [self._region[off + q * b : off + (q + 1) * b] for q in range(n)]
            self._wait(
                dist.all_gather(parts, src, group=self.group, async_op=True), "all_gather", "every rank", op
            )

    def bucket_reduce(
        self, plan: list[tuple[torch.Tensor, int]], op: int, scale: float, scatter: bool
    ) -> list[torch.Tensor]:
        n = self.buf.num_ranks
        what = "reduce_scatter" if scatter else "all_reduce"
        self.buf._agree(what, {"op": op, "t": [(tuple(x.shape), str(x.dtype), o) for x, o in plan]})
        outs = []
        for x, off in plan:
            flat = x.detach().reshape(-1)
            every = [torch.empty_like(flat) for _ in range(n)]
            self._wait(
                dist.all_gather(every, flat.clone(), group=self.group, async_op=True), what, "every rank", op
            )
            m = flat.numel() // n if scatter else flat.numel()
            lo = self.rank * m if scatter else 0
            acc = every[0][lo : lo + m].float().clone()
            for q in range(1, n):
                acc += every[q][lo : lo + m].float()
            value = acc.mul_(scale).to(x.dtype)
            at = off + lo * x.element_size()
            view = self._region[at : at + m * x.element_size()].view(x.dtype)
            view.copy_(value)
            outs.append(view)
        return outs
