"""``EngramBuffer``: V2.5's buffer for Engram alone (DeepEP's ``deep_ep.EngramBuffer`` surface), several layers.

Layer ``l`` is a table of ``N * num_entries_per_layer[l]`` entries sharded over the ranks: rank ``r`` writes entries
``[r * n_l, (r + 1) * n_l)`` (``write``, a collective); any rank fetches any entries by global index (``fetch``: one
hook per layer, one-sided). The storage (``num_rdma_storage_bytes`` per rank) is in host NUMA memory with
``use_cpu_rdma_storage=True``, else at the back of the GPU buffer; layer ``l``'s fetched rows land in the GPU part at
``l * align(T * k * entry_bytes, 256)``. Storage, lifecycle and the bytes' path are an ``ElasticBuffer``'s
(transports ``reference`` and ``ipc``). Ours: no RDMA path (QPs checked, unused), FP8 scales replicated in a GPU
tensor beside the buffer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from ep_core import engram
from ep_core.buffer_base import align
from ep_core.envelope import Channel
from ep_core.errors import EPStateError, EPTypeError, EPValueError

from .bootstrap import ProcessGroupBootstrap
from .buffer import ElasticBuffer
from .buffer_base import BufferContext, ElasticBacked

__all__ = ["EngramBuffer"]

_ALIGN = 2 << 20
_LAYER_ALIGN = 256
_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)


# operations whose first collective step is the host agreement (`ElasticOps._collective`) on every backend
_HOST_FIRST = ("set_config", "write")


def _entries(name: str, value: Any) -> list[int]:
    if isinstance(value, (int, torch.Tensor)) or not isinstance(value, Sequence) or not value:
        raise EPValueError(
            f"{name}: expected a non-empty list of entries per rank for each layer, got {value!r}"
        )
    out = []
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise EPValueError(f"{name}: expected positive ints, got {v!r} in {list(value)!r}")
        out.append(int(v))
    return out


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise EPValueError(f"{name}: expected a positive int, got {value!r}")
    return int(value)


def _announce_construct(group: Any, num_cpu_timeout_secs: Any, exc: BaseException) -> None:
    """Take part in the peers' construction exchange with an abort note naming ``exc`` (best effort: the caller
    raises ``exc``), so that they raise ``EPPeerError`` naming this rank instead of waiting out the timeout."""
    with contextlib.suppress(Exception):
        boot = ProcessGroupBootstrap(group)
        if isinstance(num_cpu_timeout_secs, (int, float)) and num_cpu_timeout_secs > 0:
            boot.set_timeout(num_cpu_timeout_secs)
        Channel(boot).announce("construct", exc)


class _Refused:
    """A guard whose block raises at once (inside the guard: announced like any refusal)."""

    __slots__ = ("guard", "what")

    def __init__(self, guard: Any, what: str) -> None:
        self.guard, self.what = guard, what

    def __enter__(self) -> None:
        self.guard.__enter__()
        exc = EPStateError(
            f"{self.what}: after the timeout this buffer was reset from, the process group's own collectives are "
            "out of step (a wait given up leaves its collective pending); Engram on the CPU backend needs a new "
            "process group and buffer"
        )
        self.guard.__exit__(EPStateError, exc, None)
        raise exc

    def __exit__(self, *exc: object) -> bool:
        return False


def _layout(
    num_entries_per_layer: list[int], hidden: int, itemsize: int, num_max_tokens: int, k: int
) -> tuple[list[int], int, int, int]:
    """`(storage offset of each layer, storage bytes, fetch stride per layer, fetch bytes)`."""
    offsets, end = [], 0
    for n in num_entries_per_layer:
        offsets.append(end)
        end = align(end + n * hidden * itemsize, _LAYER_ALIGN)
    stride = align(num_max_tokens * k * hidden * itemsize, _LAYER_ALIGN)
    return offsets, end, stride, stride * len(num_entries_per_layer)


class EngramBuffer(ElasticBacked):
    """Engram storage shards and a GPU fetch area over ``group`` (a collective to build)."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        num_gpu_bytes: int,
        num_rdma_storage_bytes: int | None = None,
        use_cpu_rdma_storage: bool = False,
        num_allocated_qps: int = 0,
        qp_depth: int = 0,
        restrict_rd_atomic: bool = False,
        allow_hybrid_mode: bool = True,
        sl_idx: int | None = None,
        num_gpu_timeout_secs: int = 100,
        explicitly_destroy: bool = False,
        *,
        num_rdma_storage_size: int | None = None,
        transport: str | None = None,
        num_cpu_timeout_secs: int = 300,
    ) -> None:
        try:
            gpu, storage = self._check_sizes(
                num_gpu_bytes, num_rdma_storage_bytes, num_rdma_storage_size, use_cpu_rdma_storage,
                num_allocated_qps, qp_depth,
            )  # fmt: skip
        except Exception as exc:  # the peers wait in the construction's exchange: tell them (issue 41)
            _announce_construct(group, num_cpu_timeout_secs, exc)
            raise
        self.num_gpu_bytes, self.num_rdma_storage_bytes = gpu, storage
        self.use_cpu_rdma_storage = use_cpu_rdma_storage
        self.allow_hybrid_mode = bool(allow_hybrid_mode)
        self.restrict_rd_atomic = bool(restrict_rd_atomic)
        self.qp_depth = int(qp_depth)
        self.explicitly_destroy = bool(explicitly_destroy)
        self._buffer: ElasticBuffer | None = ElasticBuffer(
            group,
            num_bytes=gpu + storage,
            num_cpu_bytes=storage if use_cpu_rdma_storage else 0,
            allow_hybrid_mode=allow_hybrid_mode,
            sl_idx=3 if sl_idx is None else sl_idx,
            num_allocated_qps=int(num_allocated_qps),
            num_gpu_timeout_secs=num_gpu_timeout_secs,
            num_cpu_timeout_secs=num_cpu_timeout_secs,
            explicitly_destroy=explicitly_destroy,
            transport=transport,
        )
        self._init_rest(gpu, use_cpu_rdma_storage)

    @staticmethod
    def _check_sizes(
        num_gpu_bytes: Any,
        num_rdma_storage_bytes: Any,
        num_rdma_storage_size: Any,
        use_cpu_rdma_storage: Any,
        num_allocated_qps: Any,
        qp_depth: Any,
    ) -> tuple[int, int]:
        if num_rdma_storage_size is not None:  # DeepEP's legacy keyword
            if num_rdma_storage_bytes is not None:
                raise TypeError("Specify only one of num_rdma_storage_bytes and num_rdma_storage_size")
            num_rdma_storage_bytes = num_rdma_storage_size
        gpu = _positive("num_gpu_bytes", num_gpu_bytes)
        storage = _positive("num_rdma_storage_bytes", num_rdma_storage_bytes)
        if gpu % _ALIGN or storage % _ALIGN:
            raise EPValueError(
                f"num_gpu_bytes/num_rdma_storage_bytes: expected multiples of 2 MiB, got {gpu} and {storage}; use "
                "EngramBuffer.get_storage_size_hint()"
            )
        if not isinstance(use_cpu_rdma_storage, bool):
            raise EPTypeError(f"use_cpu_rdma_storage: expected a bool, got {use_cpu_rdma_storage!r}")
        # DeepEP asserts both (pass them from get_theoretical_config)
        _positive("num_allocated_qps", num_allocated_qps)
        _positive("qp_depth", qp_depth)
        return gpu, storage

    def _init_rest(self, gpu: int, use_cpu_rdma_storage: bool) -> None:
        b = self._buffer
        assert b is not None
        self.group, self.rank_idx, self.num_ranks = b.group, b.rank_idx, b.num_ranks
        self.num_allocated_qps = b.num_allocated_qps
        self.num_scaleout_ranks, self.num_scaleup_ranks = b.get_logical_domain_size()
        self.scaleout_rank_idx = self.rank_idx // self.num_scaleup_ranks
        self.scaleup_rank_idx = self.rank_idx % self.num_scaleup_ranks
        self.num_rdma_ranks, self.num_nvlink_ranks = b.get_physical_domain_size()
        st = b._elastic(collective=True)  # the backend (a collective: the GPU one exchanges its signal words)
        if not use_cpu_rdma_storage and hasattr(st.backend, "place_storage"):
            st.backend.place_storage(gpu)  # the storage in GPU memory, behind the fetch area
        self._config: dict | None = None
        self._tables: list[engram.EngramTable] = []

    # ---------------------------------------------------------------------------------------------------------
    # sizes

    @staticmethod
    def get_storage_size_hint(
        group: dist.ProcessGroup | None,
        num_entries_per_layer: list[int],
        hidden: int,
        num_max_tokens: int,
        num_entries_per_token: int,
        dtype: torch.dtype = torch.bfloat16,
        num_sf_packs: int = 0,
    ) -> tuple[int, int]:
        """``(num_gpu_bytes, num_rdma_storage_bytes)``, both 2 MiB aligned: the fetch area (every layer's
        ``num_max_tokens * num_entries_per_token`` rows) and this rank's storage shard (every layer's entries, each
        layer 256-byte aligned). The FP8 factors are kept beside the buffer (``num_sf_packs`` is checked only)."""
        layers = _entries("num_entries_per_layer", num_entries_per_layer)
        if dtype not in _DTYPES:
            raise EPTypeError(f"dtype: expected torch.bfloat16 or torch.float8_e4m3fn, got {dtype}")
        if isinstance(num_sf_packs, bool) or not isinstance(num_sf_packs, int) or num_sf_packs < 0:
            raise EPValueError(f"num_sf_packs: expected an int >= 0, got {num_sf_packs!r}")
        _, storage, _, fetch = _layout(
            layers,
            _positive("hidden", hidden),
            dtype.itemsize,
            _positive("num_max_tokens", num_max_tokens),
            _positive("num_entries_per_token", num_entries_per_token),
        )
        return align(fetch, _ALIGN), align(storage, _ALIGN)

    @staticmethod
    def get_theoretical_config(
        group: dist.ProcessGroup | None,
        num_layers: int,
        num_max_tokens: int,
        num_entries_per_token: int,
        num_max_read_requests_per_qp: int = 16,
    ) -> tuple[int, int, bool]:
        """``(num_qps, qp_depth, restrict_rd_atomic)``. Ours: there is no RDMA path (the fetch reads the node's
        storage with a gather kernel), so this is the direct default of 17 QPs, a depth of
        ``num_max_read_requests_per_qp`` and no read-atomic restriction."""
        for name, v in (
            ("num_layers", num_layers),
            ("num_max_tokens", num_max_tokens),
            ("num_entries_per_token", num_entries_per_token),
            ("num_max_read_requests_per_qp", num_max_read_requests_per_qp),
        ):
            _positive(name, v)
        from ep_core.planner import DIRECT_NUM_ALLOCATED_QPS

        return DIRECT_NUM_ALLOCATED_QPS, int(num_max_read_requests_per_qp), False

    # ---------------------------------------------------------------------------------------------------------
    # configuration, write, fetch

    def _guard(self, op: str, collective: bool = True, raw: bool = False) -> Any:
        """The block of one operation (issue 41): inside the buffer's ``ep_core.rank_state`` guard, refused at once
        while the ranks are out of step (after a disagreement, a timeout or a lost peer) until ``reset()``; on the
        CPU reference backend, and for the operations whose first step is the host agreement on every backend
        (``set_config``, ``write``: ``_HOST_FIRST``, the GPU too), a refusal of this rank's ``collective`` call is
        announced in the peers' pending exchange (they raise ``EPPeerError`` naming this rank); on the GPU the
        peers of a ``barrier`` wait on the device, where no note reaches them. ``raw``: the operation also uses the
        process group's own collectives, which a timeout leaves out of step for good on the CPU backend."""
        b = self._buffer
        state = None if b is None else getattr(b.bootstrap, "rank_state", None)
        if state is None:
            return contextlib.nullcontext()
        reference = b.transport == "reference"
        announce = collective and (reference or op in _HOST_FIRST)
        guard = state.guard(f"EngramBuffer.{op}", b._announce_refusal if announce else None)
        if raw and reference and getattr(b.bootstrap, "_via_store", None) is not None:
            return _Refused(guard, f"EngramBuffer.{op} (rank {self.rank_idx})")
        return guard

    def reset(self) -> None:
        """(ours; DeepEP has none) Recover after a failure: a collective, every rank calls it. After a
        disagreement, a timeout or a lost peer every operation is refused (``EPStateError``); ``reset()``
        resynchronises the ranks (``ElasticBuffer.reset``), the configuration and the written tables stay."""
        self._buf().reset()

    def set_config(
        self,
        num_entries_per_layer: list[int],
        hidden: int,
        num_max_tokens: int,
        num_entries_per_token: int,
        dtype: torch.dtype = torch.bfloat16,
        num_sf_packs: int = 0,
    ) -> None:
        """Fix the layers' shapes (a collective: every rank must pass the same values). The storage and the fetch
        area must fit (``get_storage_size_hint``)."""
        with self._guard("set_config"):
            b = self._buf()
            r = self.rank_idx

            def validate() -> dict:
                layers = _entries("num_entries_per_layer", num_entries_per_layer)
                if dtype not in _DTYPES:
                    raise EPTypeError(
                        f"dtype: expected torch.bfloat16 or torch.float8_e4m3fn, got {dtype} (rank {r})"
                    )
                fp8 = dtype == torch.float8_e4m3fn
                if isinstance(num_sf_packs, bool) or not isinstance(num_sf_packs, int) or num_sf_packs < 0:
                    raise EPValueError(f"num_sf_packs: expected an int >= 0, got {num_sf_packs!r} (rank {r})")
                if fp8 != (num_sf_packs > 0):
                    raise EPValueError(
                        f"num_sf_packs: expected > 0 iff dtype is torch.float8_e4m3fn, got {num_sf_packs} with {dtype} "
                        f"(rank {r})"
                    )
                h, m = _positive("hidden", hidden), _positive("num_max_tokens", num_max_tokens)
                k = _positive("num_entries_per_token", num_entries_per_token)
                offsets, storage, stride, fetch = _layout(layers, h, dtype.itemsize, m, k)
                if storage > self.num_rdma_storage_bytes:
                    raise EPValueError(
                        f"num_entries_per_layer: {storage} bytes of storage exceed num_rdma_storage_bytes = "
                        f"{self.num_rdma_storage_bytes} (rank {r}); size it with get_storage_size_hint()"
                    )
                if fetch > self.num_gpu_bytes:
                    raise EPValueError(
                        f"num_max_tokens: {len(layers)} layers x {m} x {k} rows need {fetch} bytes of fetch area, "
                        f"num_gpu_bytes = {self.num_gpu_bytes} (rank {r}); size it with get_storage_size_hint()"
                    )
                return {
                    "layers": layers,
                    "hidden": h,
                    "tokens": m,
                    "k": k,
                    "dtype": str(dtype).removeprefix("torch."),
                    "packs": int(num_sf_packs),
                    "offsets": offsets,
                    "stride": stride,
                }

            cfg = b._collective("EngramBuffer.set_config", validate, lambda c: dict(c))
            self._config = cfg
            self._tables = []

    def _require(self, op: str) -> dict:
        if self._config is None:
            raise EPStateError(f"EngramBuffer.{op}: call set_config() first (rank {self.rank_idx})")
        return self._config

    def write(self, storages: list[torch.Tensor], sfs: list[torch.Tensor] | None = None) -> None:
        """Write this rank's shard of every layer (a collective, with a barrier before and after): ``storages[l]``
        ``[num_entries_per_layer[l], hidden]`` of the configured dtype; ``sfs[l]`` ``[N * n_l, num_sf_packs]``
        4-byte packs (replicated on every rank), required iff FP8."""
        with self._guard("write", raw=True):
            b = self._buf()
            cfg = self._require("write")
            r, n = self.rank_idx, self.num_ranks
            st = b._elastic()

            def validate() -> list[engram.EngramTable]:
                if not isinstance(storages, (list, tuple)) or len(storages) != len(cfg["layers"]):
                    raise EPValueError(
                        f"storages: expected a list of {len(cfg['layers'])} tensors (one per layer), got "
                        f"{type(storages).__name__} of {len(storages) if isinstance(storages, (list, tuple)) else '?'}"
                        f" (rank {r})"
                    )
                if (sfs is None) != (cfg["packs"] == 0) or (
                    sfs is not None and (not isinstance(sfs, (list, tuple)) or len(sfs) != len(storages))
                ):
                    raise EPValueError(
                        f"sfs: expected one scaling-factor tensor per layer iff the storage is FP8 (rank {r})"
                    )
                tables = []
                for i, (nl, t) in enumerate(zip(cfg["layers"], storages, strict=True)):
                    t = b._check_tensor(f"storages[{i}]", t)
                    if str(t.dtype).removeprefix("torch.") != cfg["dtype"] or tuple(t.shape) != (
                        nl,
                        cfg["hidden"],
                    ):
                        raise EPValueError(
                            f"storages[{i}]: expected [{nl}, {cfg['hidden']}] {cfg['dtype']}, got {tuple(t.shape)} "
                            f"{t.dtype} (rank {r})"
                        )
                    sf_shape = None
                    if sfs is not None:
                        sf = b._check_tensor(f"sfs[{i}]", sfs[i])
                        if sf.dtype not in (torch.float32, torch.int32) or tuple(sf.shape) != (
                            n * nl,
                            cfg["packs"],
                        ):
                            raise EPValueError(
                                f"sfs[{i}]: expected [{n * nl}, {cfg['packs']}] float32 or int32 packs, got "
                                f"{tuple(sf.shape)} {sf.dtype} (rank {r})"
                            )
                        sf_shape = tuple(sf.shape)
                    tables.append(
                        engram.make_engram_table(r, n, tuple(t.shape), cfg["dtype"], t.nbytes, sf_shape)
                    )
                return tables

            tables = b._collective(
                "EngramBuffer.write", validate, lambda ts: {"tables": [t.key() for t in ts]}
            )
            st.backend.barrier()
            for i, table in enumerate(tables):
                sf = None if sfs is None else sfs[i]
                st.backend.engram_write(
                    table, storages[i], sf, layer=i, offset=cfg["offsets"][i], barriers=False
                )
            st.backend.barrier()
            self._tables = tables

    def fetch(
        self, indices: torch.Tensor, num_qps: int = 0, use_tma_aligned_col_major_sf: bool = True
    ) -> list[Callable[[], Any]]:
        """Start fetching ``indices [num_layers, num_tokens, num_entries_per_token]`` (int32 global entry ids of
        each layer) and return one hook per layer: ``hooks[l]()`` returns layer ``l``'s ``data [num_tokens,
        num_entries_per_token * hidden]`` (bf16), or ``(data, sf [num_tokens, k * num_sf_packs])`` (FP8). The data
        are views of the fetch area: valid until the next fetch. One-sided: the owners take no part."""
        with self._guard("fetch", collective=False):
            b = self._buf()
            cfg = self._require("fetch")
            r = self.rank_idx
            if not self._tables:
                raise EPStateError(f"EngramBuffer.fetch: call write() first (rank {r})")
            if (
                isinstance(num_qps, bool)
                or not isinstance(num_qps, int)
                or not 0 <= num_qps <= self.num_allocated_qps
            ):
                raise EPValueError(
                    f"num_qps: expected an int in [0, {self.num_allocated_qps}] (0 = all allocated), got {num_qps!r} "
                    f"(rank {r}): allocated QPs are not enough"
                )
            indices = b._check_tensor("indices", indices)
            if indices.dim() != 3 or indices.shape[0] != len(cfg["layers"]) or indices.shape[2] != cfg["k"]:
                raise EPValueError(
                    f"indices: expected [num_layers = {len(cfg['layers'])}, num_tokens, num_entries_per_token = "
                    f"{cfg['k']}], got shape {tuple(indices.shape)} (rank {r})"
                )
            if indices.shape[1] > cfg["tokens"]:
                raise EPValueError(
                    f"indices: {indices.shape[1]} tokens exceed num_max_tokens = {cfg['tokens']} (rank {r})"
                )
            host = indices.numpy() if indices.device.type == "cpu" else None
            st = b._elastic()
            hooks = []
            fp8 = cfg["packs"] > 0
            t = int(indices.shape[1])
            for i, table in enumerate(self._tables):
                engram.check_fetch_indices(
                    table,
                    tuple(indices[i].shape),
                    str(indices.dtype).removeprefix("torch."),
                    cfg["stride"],
                    None if host is None else host[i],
                )
                inner = st.backend.engram_fetch(
                    table, indices[i], bool(use_tma_aligned_col_major_sf), layer=i, front=i * cfg["stride"]
                )

                def hook(inner=inner) -> Any:
                    data, sf = inner()
                    data = data.view(t, -1)
                    return (data, sf) if fp8 else data

                hooks.append(hook)
            return hooks

    # ---------------------------------------------------------------------------------------------------------
    # lifecycle, domains

    def print_memory_usage(self) -> None:
        """This rank's fetch area and storage bytes (DeepEP's BufferBase method)."""
        self._buf()
        where = "host NUMA" if self.use_cpu_rdma_storage else "GPU"
        print(
            f"EngramBuffer rank {self.rank_idx}: fetch area {self.num_gpu_bytes} bytes (GPU), storage "
            f"{self.num_rdma_storage_bytes} bytes ({where})"
        )

    def barrier(
        self,
        wait_comm_stream: bool = True,
        with_cpu_sync: bool = False,
        sequential: bool = True,
        context_idx: int | None = None,
    ) -> None:
        """A barrier over the group (``deep_ep.comm.barrier``'s parameters; one context: 0)."""
        with self._guard("barrier"):
            refused = BufferContext.refusal(context_idx, "barrier: an EngramBuffer")
            if refused is not None:
                raise refused
            self._buf().barrier(wait_comm_stream, with_cpu_sync, sequential)

    @property
    def context(self) -> BufferContext | None:
        """The group's rank, size and domain sizes (DeepEP's ``buffer.context``); None after ``destroy()``."""
        return None if self._buffer is None else BufferContext(self._buffer)

    @property
    def nccl_comm_handle(self) -> Any:
        """The NCCL communicator underneath (None on the reference and ipc transports and after ``destroy()``)."""
        return None if self._buffer is None else self._buffer.nccl_comm_handle

    def get_comm_stream(self) -> Any:
        return self._buf().get_comm_stream()

    def get_physical_domain_size(self) -> tuple[int, int]:
        return self._buf().get_physical_domain_size()

    def get_logical_domain_size(self) -> tuple[int, int]:
        return self._buf().get_logical_domain_size()

    def destroy(self) -> None:
        """Release the storage (a collective; needs ``explicitly_destroy=True``, like DeepEP)."""
        self._buf().destroy()  # out of step, the ElasticBuffer releases this rank's part without the peers
        self._buffer = None
        self._tables, self._config = [], None
