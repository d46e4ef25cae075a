"""The GPU backend of PP, Engram and AGRS on the ipc transport, and on nccl where NCCL's LSA team is the whole group
(the peers' windows through their LSA pointers): copy-engine transfers between the ranks' symmetric buffers, ordered
by stream memory operations, so PP and all-gather use no SM (ep-torch's README, "Elastic ops").

- PP: a send copies the tensor peer to peer into the receiver's slot, then writes the FIFO's arrival count into the
  receiver's signal word (``cuStreamWriteValue64``, which fences the copy); a receive waits for it, copies the slot
  out and writes the release count back; a full FIFO first waits for its oldest release. All on the current stream.
- AGRS: an all-gather copies each tensor to every peer on the comm stream, then signals and waits; ending a session
  signals and waits the same way, so the next session never overwrites live results.
- Engram: the storage lives in host NUMA memory (the buffer's own host part, else a side allocation,
  ``ep_core.side_allocation``; the GPU data region when a rank cannot map host memory); ``engram_write`` copies into
  it with the copy engine, a fetch is one gather kernel (``ep_core.engram_gather``) into the data region's front.

The signal words live in a separate 2 MiB symmetric allocation (``ep_core.side_allocation``), exchanged at the first
collective of these primitives. Every stream wait on a peer's signal is bounded by ``num_gpu_timeout_secs``: a
one-thread kernel polls the word with a deadline (``ep_core.signal_wait``); a timed-out wait records itself in
host-mapped memory and the next call on the buffer raises ``EPTimeoutError`` naming the rank, the peer and what it
waited for. ``EPKIT_ELASTIC_WAIT=stream`` queues ``cuStreamWaitValue64`` instead, bounded by a host watchdog
(``elastic_stream_wait``): no SM held while waiting. Default ``kernel``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils.dlpack
from ep_core import engram, pp
from ep_core.device_array import bytes_capsule
from ep_core.errors import EPConfigError
from ep_core.transports.nccl import NcclStorage

__all__ = ["CopyEngineBackend"]

_SIGNAL_BYTES = 2 << 20
_PP_ARRIVED, _PP_RELEASED = 0, 2  # u64 words [side]
_AGRS_ARRIVED = 8  # u64 words [slot * 1024 + src]
_AGRS_ENDED = _AGRS_ARRIVED + 32 * 1024  # u64 words [src]
_BUCKET_GATHERED, _BUCKET_READY, _BUCKET_DONE = (_AGRS_ENDED + 1024 * (i + 1) for i in range(3))  # [src]


def byte_view(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` at ``ptr`` labelled ``device``, whatever GPU the memory sits on: a peer GPU's
    memory mapped into this process stays addressable by this device's kernels (``__cuda_array_interface__`` would
    label it with the owner's GPU, and torch would then copy it). Built as a DLPack capsule, no copy."""
    kind = 2 if device.type == "cuda" else 1  # kDLCUDA, kDLCPU
    index = device.index if device.index is not None else (torch.cuda.current_device() if kind == 2 else 0)
    return torch.utils.dlpack.from_dlpack(bytes_capsule(ptr, nbytes, kind, index))


def _peer_bases(storage: Any, num_ranks: int, rank: int) -> list[int]:
    """Every rank's allocation base as mapped in this process: the ipc storage's peer mappings, or nccl's LSA
    pointers where NCCL's LSA team is the whole group (one node). The same refusal on every rank, before any
    collective step."""
    if NcclStorage.lsa_team_short(storage, num_ranks):
        raise EPConfigError(
            f"transport: PP, Engram and AGRS over nccl need every rank in NCCL's LSA team (one NVLink "
            f"domain); {storage.lsa_size} of the {num_ranks} ranks are (rank {rank}); across nodes they "
            "would need network puts, which ep does not implement for them: run them on a group of one node"
        )
    if not hasattr(storage, "peer_bases"):
        raise EPConfigError(
            "transport: PP, Engram and AGRS on the GPU need the peers' memory mapped (ipc, or nccl's LSA team); this "
            f"buffer's storage ({type(storage).__name__}) has none"
        )
    return storage.peer_bases(num_ranks)


class DriverOps:
    """The device operations the backend queues: CUDA driver calls on torch's streams."""

    def __init__(self, device: torch.device, rank: int, timeout_secs: float) -> None:
        from ep_core.kernels import _cuda
        from ep_core.signal_wait import SignalWaiter

        self.device = device
        self._cuda = _cuda
        self.drv = _cuda.driver()
        self._comm = None
        from . import _env

        try:
            mode = _env.elastic_wait()
        except ValueError as exc:
            raise EPConfigError(f"{exc} (rank {rank})") from None
        self.wait_mode = mode
        self._write_flags = (
            self.drv.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT
        )  # fences earlier copies
        if mode == "stream":
            from .elastic_stream_wait import StreamWaiter

            self.waiter: Any = StreamWaiter(rank, timeout_secs)
        else:
            self.waiter = SignalWaiter(rank, timeout_secs)

    def current_stream(self) -> int:
        return torch.cuda.current_stream().cuda_stream

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        if nbytes:
            self._cuda.check(self.drv.cuMemcpyDtoDAsync(dst, src, nbytes, stream), "cuMemcpyDtoDAsync")

    def write(self, addr: int, value: int, stream: int) -> None:
        self._cuda.check(
            self.drv.cuStreamWriteValue64(stream, addr, value, self._write_flags), "cuStreamWriteValue64"
        )

    def wait(self, addr: int, value: int, stream: int, peer: int, what: str) -> None:
        """The stream waits until the word at `addr` is >= `value` (written by `peer`), bounded (module doc)."""
        self.waiter.wait(addr, value, stream, peer, what)

    def check(self) -> None:
        """Raise the recorded GPU wait timeout, if any (reads host-mapped words: no synchronization)."""
        self.waiter.check()

    def close(self) -> None:
        self.waiter.close()

    def view(self, ptr: int, nbytes: int) -> torch.Tensor:
        return byte_view(ptr, nbytes, self.device)

    def bucket_bf16(self, kind: str, entries: list, bases: list[int], rank: int, scale: float, num_sms: Any,
                    stream: int) -> None:  # fmt: skip
        """Queue `ep_core.bucket_bf16`'s `kind` kernel over `entries` ((offset, elements a shard) per src)."""
        from ep_core import bucket_bf16

        dev = self.device.index if self.device.index is not None else torch.cuda.current_device()
        key = (tuple(bases), tuple(entries))
        cache = self.__dict__.setdefault("_bf16_tables", {})  # [bases | entries]; freed in stream order
        if key not in cache:
            if len(cache) >= 64:
                cache.clear()
            flat = [*bases, *(v for e in entries for v in e)]
            cache[key] = torch.tensor(flat, dtype=torch.int64, device=dev)
        sms = num_sms or torch.cuda.get_device_properties(dev).multi_processor_count
        ptr, n = cache[key].data_ptr(), len(bases)
        bucket_bf16.launch(kind, ptr + 8 * n, len(entries), ptr, bases[rank], rank, n, scale, num_sms=sms,
                           device=dev, stream=stream)  # fmt: skip

    def comm_stream(self) -> int:
        """The comm stream, ordered after the work queued so far on the current stream."""
        from ._streams import comm_stream

        self._comm = comm_stream(self.device)
        self._comm.wait_stream(torch.cuda.current_stream())
        return self._comm.cuda_stream

    def keep(self, tensors: list[torch.Tensor]) -> None:
        for x in tensors:
            x.record_stream(self._comm)

    def record(self) -> Any:
        event = torch.cuda.Event()
        event.record(self._comm)
        return event

    def wait_event(self, event: Any) -> None:
        torch.cuda.current_stream().wait_event(event)

    def synchronize(self) -> None:
        torch.cuda.synchronize()


class CopyEngineBackend:
    """The protocol over addresses: `data[r]` is rank r's data region and `sig[r]` its signal words, both as mapped
    in this process; `ops` queues the copies, writes and waits (`DriverOps`, or a host model in the tests)."""

    def __init__(
        self,
        rank: int,
        num_ranks: int,
        data: list[int],
        sig: list[int],
        region: torch.Tensor,
        num_gpu_buffer_bytes: int,
        ops: Any,
        barrier: Any,
    ) -> None:
        self.rank, self.n = rank, num_ranks
        self.data, self.sig = data, sig
        self._region = region
        self._num_gpu_buffer_bytes = num_gpu_buffer_bytes
        self.ops = ops
        self._barrier = barrier
        self.pp_sent = [0, 0]
        self.pp_received = [0, 0]
        self._events: dict[tuple[int, int], Any] = {}
        self._sf: dict[int, torch.Tensor | None] = {}  # per Engram layer (ElasticBuffer: layer 0)
        self._tables: dict[int, list[torch.Tensor]] = {}
        self._bases: dict[
            int, tuple[list[int], torch.Tensor]
        ] = {}  # per layer: owners' storage, host + device
        self._gather: Any = None
        self.gather_sms = 0  # SMs of the Engram gather (0: the device's share, set by from_buffer)
        self.last_gather: Any = None  # the last fetch's launch (kernel, grid): the benchmark reports it
        # where each rank's Engram storage starts: by default the back of its data region (the num_cpu_bytes
        # part); `from_buffer` moves it to host NUMA memory when it can
        self.storage = [d + num_gpu_buffer_bytes for d in data]
        self.engram_storage = "gpu"

    @classmethod
    def from_buffer(cls, buf: Any) -> CopyEngineBackend:
        """A collective: maps the peers' data regions and creates and exchanges the signal words."""
        from ep_core.side_allocation import create_exchanged

        rt = buf._rt()
        n = buf.num_ranks
        data = [b + rt.num_workspace_bytes for b in _peer_bases(rt.storage, n, buf.rank_idx)]
        ops = DriverOps(buf.device, buf.rank_idx, rt.config.num_gpu_timeout_secs)
        torch.cuda.synchronize()
        alloc, why = create_exchanged(
            buf.bootstrap, _SIGNAL_BYTES, device=torch.cuda.current_device(), zero=True
        )
        if alloc is None:
            ops.close()
            raise EPConfigError(
                f"PP/AGRS/Engram signal words: {_SIGNAL_BYTES} bytes of symmetric memory could not be allocated "
                f"({why}); every rank raises this (rank {buf.rank_idx})"
            )
        sig = [int(alloc.peer_ptr(r)) for r in range(n)]

        boot = buf.bootstrap  # not the buffer: the buffer owns this backend

        def barrier() -> None:
            torch.cuda.synchronize()
            ops.check()  # a wait that timed out before the barrier raises here, not a peer's barrier timeout
            boot.barrier()

        out = cls(
            buf.rank_idx,
            n,
            data,
            sig,
            ops.view(data[buf.rank_idx], rt.data.nbytes),
            buf._num_gpu_buffer_bytes,
            ops,
            barrier,
        )
        out._sig_alloc = alloc  # mapped by the peers: lives as long as the backend
        ex = getattr(rt, "executor", None)
        out.gather_sms = int(getattr(ex, "num_device_sms", 0) or 0) or int(
            torch.cuda.get_device_properties(buf.device).multi_processor_count
        )
        if buf.num_cpu_bytes > 0:
            if int(getattr(rt.storage, "num_host_bytes", 0) or 0) >= buf.num_cpu_bytes:
                # the buffer's own host part (the default storage address): one VA range, no second allocation
                out.engram_storage = "host"
                out._buffer_alloc = rt.storage._buffer._owners[0]
            else:
                out._host_storage(buf)
        return out

    def place_storage(self, offset: int) -> None:
        """Engram storage at `offset` bytes into every rank's data region (EngramBuffer with GPU storage)."""
        self.storage = [d + int(offset) for d in self.data]
        self.engram_storage = "gpu"

    def host_view(self) -> memoryview:
        """A CPU view of this rank's Engram storage in host memory (tests): the host part it lives in."""
        alloc = self.__dict__.get("_host_alloc") or self.__dict__.get("_buffer_alloc")
        if alloc is None:
            raise EPConfigError(f"host_view: the Engram storage is in {self.engram_storage} memory")
        return alloc.host_view()

    def _host_storage(self, buf: Any) -> None:
        """Engram storage in host NUMA memory (the elastic part): a symmetric allocation `[2 MiB GPU | num_cpu_bytes
        host]` exchanged like the data buffer, its host part mapped by every rank of the node. A collective; when
        any rank cannot build it, every rank keeps the storage at the back of its GPU data region (with a
        warning naming the rank and the reason)."""
        import warnings

        from ep_core.side_allocation import create_exchanged

        alloc, why = create_exchanged(
            buf.bootstrap, 2 << 20, num_host_bytes=buf.num_cpu_bytes, device=torch.cuda.current_device()
        )
        if alloc is None:
            warnings.warn(
                f"Engram storage stays in GPU memory: host memory could not be mapped ({why})", stacklevel=3
            )
            return
        self._host_alloc = alloc
        self.storage = [int(alloc.peer_ptr(r)) + int(alloc.num_gpu_bytes) for r in range(self.n)]
        self.engram_storage = "host"

    def region(self) -> torch.Tensor:
        return self._region

    def barrier(self) -> None:
        self.ops.check()
        self._barrier()

    def check(self) -> None:
        """Raise a GPU wait timeout recorded since the last call (every host call of these primitives checks)."""
        self.ops.check()

    def close(self) -> None:
        """Release the signal words, the host storage and the waiter (the caller synchronized the device)."""
        self._tables, self._sf, self._events, self._bases = {}, {}, {}, {}
        self.__dict__.pop("_buffer_alloc", None)
        self.__dict__.pop("_keep_bucket", None)
        self.__dict__.pop("_peer_regions", None)
        for name in ("_sig_alloc", "_host_alloc"):
            alloc = self.__dict__.pop(name, None)
            if alloc is not None:
                alloc.close()
        close = getattr(self.ops, "close", None)
        if close is not None:
            close()

    # ----------------------------------------------------------------------------------------------------------
    # PP

    def pp_configure(self, cfg: pp.PPConfig, old: pp.PPConfig | None) -> None:
        self.barrier()

    def pp_send(self, cfg: pp.PPConfig, t: torch.Tensor, dst: int) -> None:
        ops, s = self.ops, self.ops.current_stream()
        side = pp.send_side(self.rank, dst, self.n)
        rside = pp.recv_side(dst, self.rank, self.n)
        k = self.pp_sent[side]
        inflight = cfg.num_max_inflight_tensors
        ops.check()
        if k >= inflight:  # the slot of tensor k - inflight must be released first
            what = f"pp_send: the release of tensor {k - inflight} by rank {dst} ({inflight} in flight)"
            ops.wait(self.sig[self.rank] + 8 * (_PP_RELEASED + side), k - inflight + 1, s, dst, what)
        ops.copy(self.data[dst] + cfg.recv_slot_offset(rside, k % inflight), t.data_ptr(), t.nbytes, s)
        ops.write(self.sig[dst] + 8 * (_PP_ARRIVED + rside), k + 1, s)
        self.pp_sent[side] = k + 1

    def pp_recv(self, cfg: pp.PPConfig, t: torch.Tensor, src: int) -> None:
        ops, s = self.ops, self.ops.current_stream()
        side = pp.recv_side(self.rank, src, self.n)
        k = self.pp_received[side]
        ops.check()
        what = f"pp_recv: tensor {k} from rank {src}"
        ops.wait(self.sig[self.rank] + 8 * (_PP_ARRIVED + side), k + 1, s, src, what)
        slot = cfg.recv_slot_offset(side, k % cfg.num_max_inflight_tensors)
        ops.copy(t.data_ptr(), self.data[self.rank] + slot, t.nbytes, s)
        ops.write(self.sig[src] + 8 * (_PP_RELEASED + pp.send_side(src, self.rank, self.n)), k + 1, s)
        self.pp_received[side] = k + 1

    # ----------------------------------------------------------------------------------------------------------
    # Engram

    def engram_write(
        self,
        table: engram.EngramTable,
        storage: torch.Tensor,
        sf: torch.Tensor | None,
        layer: int = 0,
        offset: int = 0,
        barriers: bool = True,
    ) -> None:
        """This rank's entries into its storage at `offset` (copy engine); `layer` keys the table (EngramBuffer
        writes several; ElasticBuffer one). `barriers=False`: the caller brackets several writes itself."""
        if barriers:
            self.barrier()  # checks
        s = self.ops.current_stream()
        self.ops.copy(self.storage[self.rank] + offset, storage.data_ptr(), storage.nbytes, s)
        self._sf[layer] = None if sf is None else sf.detach().clone()
        rows = table.num_entries_per_rank * table.entry_bytes
        bases = [st + offset for st in self.storage]
        self._tables[layer] = [self.ops.view(b, rows).view(table.num_entries_per_rank, -1) for b in bases]
        dev = torch.tensor(bases, dtype=torch.int64).to(self._region.device, non_blocking=False)
        self._bases[layer] = (bases, dev)
        if barriers:
            self.barrier()

    def _gather_rows(
        self, table: engram.EngramTable, layer: int, idx: torch.Tensor, out: torch.Tensor
    ) -> None:
        bases, dev = self._bases[layer]
        if out.device.type != "cuda":  # the host model of the tests: torch gathers
            flat = idx.to(torch.int64)
            owner = (flat // table.num_entries_per_rank).clamp(0, self.n - 1)
            local = flat % table.num_entries_per_rank
            for r, peer in enumerate(self._tables[layer]):
                torch.where((owner == r)[:, None], peer.index_select(0, local), out, out=out)
            out[(flat < 0) | (flat >= table.num_total_entries)] = 0  # as the kernel: a zero row
            return
        if self._gather is None:
            from ep_core.engram_gather import EngramGather

            self._gather = EngramGather()
        self.last_gather = self._gather.launch(
            dev.data_ptr(),
            bases,
            idx.data_ptr(),
            out.data_ptr(),
            idx.numel(),
            table.num_entries_per_rank,
            table.entry_bytes,
            self.ops.current_stream(),
            self.gather_sms,
        )

    def engram_fetch(
        self,
        table: engram.EngramTable,
        indices: torch.Tensor,
        col_major: bool,
        layer: int = 0,
        front: int = 0,
    ) -> Any:
        """Gather the entries `indices [T, k]` of table `layer` into the data region at `front` (one kernel on the
        current stream); returns the hook giving `(data [T * k, hidden], sf)`."""
        self.ops.check()
        t, k = indices.shape
        idx = indices.reshape(-1)
        if idx.dtype != torch.int32:
            idx = idx.to(torch.int32)
        idx = idx.contiguous()
        e = table.entry_bytes
        out = self._region[front : front + t * k * e].view(t * k, e)
        self._gather_rows(table, layer, idx, out)
        dtype = torch.bfloat16 if table.dtype == "bfloat16" else torch.float8_e4m3fn
        data = out.view(dtype).view(t * k, table.hidden)
        sf = None
        table_sf = self._sf.get(layer)
        if table_sf is not None:
            p = table.num_sf_packs
            flat = idx.to(torch.int64).to(table_sf.device)
            rows = table_sf.index_select(0, flat).reshape(t, k * p)
            shape, transposed = engram.sf_layout(t, k, p, col_major)
            if transposed:
                store = torch.zeros(shape, dtype=table_sf.dtype, device=table_sf.device)
                store[:, :t] = rows.t()
                sf = store.t()[:t]
            else:
                sf = rows

        def hook() -> tuple[torch.Tensor, torch.Tensor | None]:
            return data, sf  # queued on the stream of the fetch: later work on it sees the data

        return hook

    # ----------------------------------------------------------------------------------------------------------
    # AGRS

    def _signal_all(self, word: int, value: int, stream: int, what: str) -> None:
        """Write `value` into word `word + rank` of every peer, then wait for word `word + p` >= value from each."""
        for i in range(1, self.n):
            p = (self.rank + i) % self.n
            self.ops.write(self.sig[p] + 8 * (word + self.rank), value, stream)
        for i in range(1, self.n):
            p = (self.rank + i) % self.n
            self.ops.wait(self.sig[self.rank] + 8 * (word + p), value, stream, p, what)

    def agrs_end_session(self, session_idx: int) -> None:
        self.ops.check()
        what = f"destroy_agrs_session: the end of session {session_idx}"
        self._signal_all(_AGRS_ENDED, session_idx, self.ops.comm_stream(), what)

    def all_gather(
        self,
        tensors: list[torch.Tensor],
        offsets: list[int],
        inplace: list[int | None],
        slot: int,
        session_idx: int,
    ) -> list[torch.Tensor]:
        self.ops.check()
        s = self.ops.comm_stream()
        for i in range(self.n):
            dst = (self.rank + i) % self.n
            for x, off in zip(tensors, offsets, strict=True):
                target = self.data[dst] + off + x.nbytes * self.rank
                if target != x.data_ptr():
                    self.ops.copy(target, x.data_ptr(), x.nbytes, s)
        self.ops.keep(tensors)
        self._signal_all(
            _AGRS_ARRIVED + slot * 1024, session_idx, s, f"all_gather: slot {slot} of session {session_idx}"
        )
        self._events = {key: ev for key, ev in self._events.items() if key[0] >= session_idx}
        self._events[(session_idx, slot)] = self.ops.record()
        return [
            self._region[off : off + self.n * x.nbytes].view(x.dtype).view(self.n, *x.shape)
            for x, off in zip(tensors, offsets, strict=True)
        ]

    def reduce_scatter(self, t: torch.Tensor, off: int, cb: int, slot: int, session_idx: int) -> torch.Tensor:
        """Chunk `p` of `t` goes to part `rank` of peer p's session slot (copy engine); returns this rank's `[N,
        chunk]` parts, complete once `agrs_wait` ordered the current stream after the arrivals."""
        self.ops.check()
        s = self.ops.comm_stream()
        for i in range(self.n):
            p = (self.rank + i) % self.n
            self.ops.copy(self.data[p] + off + cb * self.rank, t.data_ptr() + cb * p, cb, s)
        self.ops.keep([t])
        what = f"reduce_scatter: slot {slot} of session {session_idx}"
        self._signal_all(_AGRS_ARRIVED + slot * 1024, session_idx, s, what)
        self._events = {key: ev for key, ev in self._events.items() if key[0] >= session_idx}
        self._events[(session_idx, slot)] = self.ops.record()
        chunk = (t.shape[0] // self.n, *t.shape[1:])
        return self._region[off : off + self.n * cb].view(t.dtype).view(self.n, *chunk)

    def agrs_wait(self, slot: int, session_idx: int) -> None:
        self.ops.check()
        self.ops.wait_event(self._events[(session_idx, slot)])

    # ----------------------------------------------------------------------------------------------------------
    # BucketBuffer

    def bucket_all_gather(self, plan: list[tuple[torch.Tensor, int]], op: int) -> None:
        """Each `(src, off)`: src into part `rank` of the gathered tensor at `off` on every rank (copy engine on
        the comm stream, then a signal to and a wait for every peer); the current stream then waits for it."""
        self.ops.check()
        s = self.ops.comm_stream()
        for i in range(self.n):
            dst = (self.rank + i) % self.n
            for x, off in plan:
                target = self.data[dst] + off + x.nbytes * self.rank
                if target != x.data_ptr():
                    self.ops.copy(target, x.data_ptr(), x.nbytes, s)
        self.ops.keep([x for x, _ in plan])
        self._signal_all(_BUCKET_GATHERED, op, s, f"BucketBuffer.all_gather: operation {op}")
        self.ops.wait_event(self.ops.record())

    def bucket_reduce(
        self, plan: list[tuple[torch.Tensor, int]], op: int, scale: float, scatter: bool
    ) -> list[torch.Tensor]:
        """Sum every rank's src (or, with `scatter`, every rank's shard `rank` of it) read over NVLink, in rank
        order in float32, times `scale`; written back in place once every rank has read (two stream barriers)."""
        self.ops.check()
        s = self.ops.current_stream()
        if not getattr(self, "_peer_regions", None):  # every rank's data region, viewed once
            self._peer_regions = [self.ops.view(d, self._region.numel()) for d in self.data]
        # every src is written
        self._signal_all(_BUCKET_READY, op, s, f"BucketBuffer reduction {op}: the sources written")
        results = []
        for x, off in plan:
            nbytes = x.nbytes // self.n if scatter else x.nbytes
            at = off + (self.rank * nbytes if scatter else 0)
            acc = None
            for q in range(self.n):
                part = self._peer_regions[q][at : at + nbytes].view(x.dtype).float()
                acc = part.clone() if acc is None else acc.add_(part)
            assert acc is not None
            results.append((acc.mul_(scale).to(x.dtype), at, nbytes))
        # every rank has read: the sources may be overwritten
        self._signal_all(_BUCKET_DONE, op, s, f"BucketBuffer reduction {op}: the sources read")
        outs = []
        for value, at, nbytes in results:
            self.ops.copy(self.data[self.rank] + at, value.data_ptr(), nbytes, s)
            outs.append(self._region[at : at + nbytes].view(value.dtype))
        self._keep_bucket = [v for v, _, _ in results]  # until the next operation (the copies read them)
        return outs

    def bucket_reduce_scatter_bf16(
        self, plan: list[tuple[torch.Tensor, int]], op: int, scale: float, num_sms: int | None
    ) -> list[torch.Tensor]:
        """``reduce_scatter(comm_precision="bf16")`` (``ep_core.bucket_bf16``): this rank packs the bf16 it sends
        into the other shards of each src (`pack`), every src packed on every rank (a stream barrier), the owner
        reads the peers' packed bf16 of shard ``rank`` over NVLink and adds it to its own float32 shard in place
        (`reduce`), every read done (a second barrier) before the srcs may be overwritten. `ops.bucket_bf16`
        queues the two kernels on ``num_sms`` blocks (None: the device's SMs)."""
        self.ops.check()
        s = self.ops.current_stream()
        entries = [(off, x.numel() // self.n) for x, off in plan]
        self.ops.bucket_bf16("pack", entries, self.data, self.rank, scale, num_sms, s)
        self._signal_all(_BUCKET_READY, op, s, f"BucketBuffer reduction {op}: the sources written")
        self.ops.bucket_bf16("reduce", entries, self.data, self.rank, scale, num_sms, s)
        self._signal_all(_BUCKET_DONE, op, s, f"BucketBuffer reduction {op}: the sources read")
        return [
            x.detach().reshape(-1)[self.rank * m : (self.rank + 1) * m]
            for (x, _), (_, m) in zip(plan, entries)
        ]
