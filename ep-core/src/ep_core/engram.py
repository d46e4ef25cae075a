"""Engram (DeepEP V2's `engram_*`): a table of cached entries sharded over the ranks, fetched by global index.

`engram_write(storage [n, hidden])`, a collective: every rank writes its `n` entries (the same `n` and `hidden` on
every rank) into its buffer's storage part; entry `g` lives on rank `g // n`, row `g % n`. `engram_fetch(indices
[T, k] int32)` is one-sided: it reads the `T * k` entries into the front of this rank's GPU buffer and returns a
hook, which waits and returns `(data [T * k, hidden], sf)`, row `t * k + j` being entry `indices[t, j]`. FP8
storage carries replicated per-entry scales `sf [N * n, num_sf_packs]`, gathered to `[T, k * num_sf_packs]`
(row-major, or TMA-aligned column-major: storage `[k * packs, align(T, 4)]`, viewed transposed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ep_core.errors import EPStateError, EPTypeError, EPValueError

__all__ = [
    "ENGRAM_ENTRY_ALIGN_BYTES",
    "EngramTable",
    "HostEngram",
    "check_fetch_indices",
    "fetch_reference",
    "get_engram_storage_size_hint",
    "make_engram_table",
    "sf_layout",
]

#: per-entry alignment in the storage (one 256-bit load)
ENGRAM_ENTRY_ALIGN_BYTES = 32
_BUFFER_ALIGN = 2 << 20
#: storage dtypes: bf16 or FP8 e4m3 (with scaling factors)
STORAGE_DTYPES = {"bfloat16": 2, "float8_e4m3fn": 1}


def _align(a: int, b: int) -> int:
    return -(-a // b) * b


def _nonneg_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise EPValueError(f"{name}: expected an int >= 0, got {value!r}")
    return int(value)


def get_engram_storage_size_hint(
    num_entries: int, hidden: int, num_max_tokens_per_rank: int, itemsize: int = 2
) -> tuple[int, int]:
    """`(num_gpu_bytes, num_cpu_bytes)`, both 2 MiB aligned: the fetch area for `num_max_tokens_per_rank` rows and
    the storage for `num_entries` entries, each entry `align(hidden * itemsize, 32)` bytes."""
    e = _nonneg_int("num_entries", num_entries)
    h = _nonneg_int("hidden", hidden)
    m = _nonneg_int("num_max_tokens_per_rank", num_max_tokens_per_rank)
    if itemsize not in (1, 2, 4):
        raise EPValueError(f"dtype: expected an item size of 1, 2 or 4 bytes, got {itemsize}")
    per_entry = _align(h * itemsize, ENGRAM_ENTRY_ALIGN_BYTES)
    return _align(per_entry * m, _BUFFER_ALIGN), _align(per_entry * e, _BUFFER_ALIGN)


@dataclass(frozen=True)
class EngramTable:
    """What `engram_write` fixed: the table's shape on every rank."""

    rank: int
    num_ranks: int
    num_entries_per_rank: int
    hidden: int
    dtype: str
    num_sf_packs: int  # 0 without scaling factors (bf16)

    @property
    def itemsize(self) -> int:
        return STORAGE_DTYPES[self.dtype]

    @property
    def num_total_entries(self) -> int:
        return self.num_entries_per_rank * self.num_ranks

    @property
    def entry_bytes(self) -> int:
        return self.hidden * self.itemsize

    def owner(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`(owner rank, local row)` of global entries `g`."""
        return g // self.num_entries_per_rank, g % self.num_entries_per_rank

    def key(self) -> tuple:
        """What must agree across ranks."""
        return (self.num_entries_per_rank, self.hidden, self.dtype, self.num_sf_packs)


def make_engram_table(
    rank: int,
    num_ranks: int,
    shape: tuple[int, ...],
    dtype: str,
    num_cpu_bytes: int,
    sf_shape: tuple[int, ...] | None,
    sf_itemsize: int = 4,
) -> EngramTable:
    """Validate `engram_write`'s storage (`shape`, `dtype`) and `sf` against the buffer's storage part."""
    if dtype not in STORAGE_DTYPES:
        raise EPTypeError(
            f"storage: expected torch.bfloat16 or torch.float8_e4m3fn entries, got {dtype} (rank {rank})"
        )
    if len(shape) != 2:
        raise EPValueError(
            f"storage: expected a 2-D [num_entries, hidden] tensor, got shape {shape} (rank {rank})"
        )
    n, h = (int(s) for s in shape)
    if n <= 0 or h <= 0:
        raise EPValueError(
            f"storage: expected num_entries > 0 and hidden > 0, got shape {shape} (rank {rank})"
        )
    nbytes = n * h * STORAGE_DTYPES[dtype]
    if nbytes > num_cpu_bytes:
        raise EPValueError(
            f"storage: {nbytes} bytes exceed the buffer's storage part (num_cpu_bytes = {num_cpu_bytes}) on rank "
            f"{rank}; size it with get_engram_storage_size_hint()"
        )
    fp8 = dtype != "bfloat16"
    if fp8 != (sf_shape is not None):
        raise EPValueError(
            f"sf: required iff the storage is FP8 (storage is {dtype}, sf is "
            f"{'given' if sf_shape is not None else 'None'}) on rank {rank}"
        )
    packs = 0
    if sf_shape is not None:
        if sf_itemsize != 4:
            raise EPTypeError(f"sf: expected 4-byte packs (float32 or int32), got {sf_itemsize}-byte items")
        if len(sf_shape) != 2 or int(sf_shape[0]) != n * num_ranks or int(sf_shape[1]) <= 0:
            raise EPValueError(
                f"sf: expected [num_total_entries = {n * num_ranks}, num_sf_packs > 0] (replicated on every "
                f"rank), got {tuple(sf_shape)} on rank {rank}"
            )
        packs = int(sf_shape[1])
    return EngramTable(rank, num_ranks, n, h, dtype, packs)


def require_table(table: EngramTable | None, rank: int) -> EngramTable:
    if table is None:
        raise EPStateError(f"engram_fetch: call engram_write() first (rank {rank})")
    return table


def check_fetch_indices(
    table: EngramTable,
    shape: tuple[int, ...],
    dtype: str,
    num_gpu_bytes: int,
    values: np.ndarray | None = None,
) -> tuple[int, int]:
    """Validate `engram_fetch`'s indices; returns `(T, k)`. `values` (host indices) are range-checked too."""
    if dtype != "int32":
        raise EPTypeError(f"indices: expected torch.int (int32), got {dtype} (rank {table.rank})")
    if len(shape) != 2:
        raise EPValueError(
            f"indices: expected [num_tokens, num_entries_per_token], got shape {tuple(shape)} (rank {table.rank})"
        )
    t, k = (int(s) for s in shape)
    need = t * k * table.entry_bytes
    if need > num_gpu_bytes:
        raise EPValueError(
            f"indices: {t} x {k} entries of {table.entry_bytes} bytes need {need} bytes, more than the fetch area "
            f"(num_bytes - num_cpu_bytes = {num_gpu_bytes}) on rank {table.rank}"
        )
    if values is not None and values.size:
        lo, hi = int(values.min()), int(values.max())
        if lo < 0 or hi >= table.num_total_entries:
            bad = lo if lo < 0 else hi
            raise EPValueError(
                f"indices: entry {bad} outside [0, {table.num_total_entries}) ({table.num_ranks} ranks x "
                f"{table.num_entries_per_rank} entries) on rank {table.rank}"
            )
    return t, k


def sf_layout(num_tokens: int, k: int, num_sf_packs: int, col_major: bool) -> tuple[tuple[int, int], bool]:
    """Storage shape of the fetched factors and whether the logical `[T, k * packs]` view is its transpose."""
    if col_major:
        return (k * num_sf_packs, _align(num_tokens, 4)), True
    return (num_tokens, k * num_sf_packs), False


def fetch_reference(
    storages: list[np.ndarray],
    indices: np.ndarray,
    sf_table: np.ndarray | None = None,
    col_major: bool = False,
) -> tuple[np.ndarray, np.ndarray | None]:
    """The oracle: `storages[r]` is rank r's `[n, hidden]` table (raw bits), `indices [T, k]` global entry ids.

    Returns `(data [T * k, hidden], sf)` where sf is the logical `[T, k * packs]` array (a transposed view of the
    column-major storage with `col_major`) or None without `sf_table`."""
    n = storages[0].shape[0]
    flat = indices.reshape(-1).astype(np.int64)
    full = np.concatenate(storages, axis=0)
    data = full[flat] if flat.size else np.zeros((0, storages[0].shape[1]), storages[0].dtype)
    assert all(s.shape[0] == n for s in storages)
    if sf_table is None:
        return data, None
    t, k = indices.shape
    p = sf_table.shape[1]
    rows = sf_table[flat].reshape(t, k * p)
    shape, transposed = sf_layout(t, k, p, col_major)
    if not transposed:
        return data, rows
    store = np.zeros(shape, dtype=sf_table.dtype)
    store[:, :t] = rows.T
    return data, store.T[:t]


class HostEngram:
    """Engram on host arrays over any bootstrap (framework-agnostic; numpy): `write` is a collective that
    all-gathers the tables (so `fetch` is local and one-sided, as with RDMA gets), `fetch` returns the hook.

    Arrays carry raw bits: bf16 entries as uint16, FP8 as uint8 (`dtype` names what they are)."""

    def __init__(self, bootstrap: Any, num_gpu_bytes: int, num_cpu_bytes: int) -> None:
        from ep_core.bootstrap import check_bootstrap

        self.bootstrap = check_bootstrap(bootstrap)
        self.rank, self.num_ranks = int(self.bootstrap.rank), int(self.bootstrap.size)
        self.num_gpu_bytes, self.num_cpu_bytes = int(num_gpu_bytes), int(num_cpu_bytes)
        self.table: EngramTable | None = None
        self._replica: np.ndarray | None = None
        self._sf: np.ndarray | None = None

    def write(self, storage: np.ndarray, dtype: str = "bfloat16", sf: np.ndarray | None = None) -> None:
        table = make_engram_table(
            self.rank,
            self.num_ranks,
            tuple(storage.shape),
            dtype,
            self.num_cpu_bytes,
            None if sf is None else tuple(sf.shape),
            4 if sf is None else sf.dtype.itemsize,
        )
        keys = self.bootstrap.allgather(repr(table.key()).encode())
        if any(k != keys[0] for k in keys):
            from ep_core.errors import EPMismatchError

            raise EPMismatchError(
                f"engram_write: ranks write tables of different shapes ({[k.decode() for k in keys]}); every rank "
                "must write [num_entries, hidden] of the same size and dtype"
            )
        raw = np.ascontiguousarray(storage)
        parts = self.bootstrap.allgather(raw.tobytes())
        self._replica = np.frombuffer(b"".join(parts), dtype=raw.dtype).reshape(-1, raw.shape[1])
        self._sf = None if sf is None else np.array(sf, copy=True)
        self.table = table

    def fetch(self, indices: np.ndarray, col_major: bool = False) -> Any:
        table = require_table(self.table, self.rank)
        idx = np.asarray(indices)
        check_fetch_indices(table, idx.shape, str(idx.dtype), self.num_gpu_bytes, idx)
        assert self._replica is not None
        n = table.num_entries_per_rank
        storages = [self._replica[r * n : (r + 1) * n] for r in range(self.num_ranks)]
        data, sf = fetch_reference(storages, idx, self._sf, col_major)
        return lambda: (data, sf)
