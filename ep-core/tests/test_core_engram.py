"""ep_core.engram: size hint, write/fetch validation and the fetch oracle."""

from __future__ import annotations

import numpy as np
import pytest
from ep_core import engram
from ep_core.bootstrap import ThreadGroup
from ep_core.errors import EPStateError, EPTypeError, EPValueError

MiB = 1 << 20


def test_size_hint_matches_deepep_formula() -> None:
    assert engram.get_engram_storage_size_hint(1000, 7168, 4096) == (
        -(-7168 * 2 * 4096 // (2 * MiB)) * 2 * MiB,
        -(-7168 * 2 * 1000 // (2 * MiB)) * 2 * MiB,
    )
    assert engram.get_engram_storage_size_hint(1, 3, 1, itemsize=1) == (2 * MiB, 2 * MiB)
    assert engram.get_engram_storage_size_hint(0, 8, 0) == (0, 0)
    with pytest.raises(EPValueError, match="hidden"):
        engram.get_engram_storage_size_hint(1, -1, 1)


def test_table_validation() -> None:
    t = engram.make_engram_table(1, 4, (10, 16), "bfloat16", 2 * MiB, None)
    assert t.num_total_entries == 40 and t.entry_bytes == 32
    with pytest.raises(EPValueError, match=r"num_cpu_bytes = 0\) on rank 1"):
        engram.make_engram_table(1, 4, (10, 16), "bfloat16", 0, None)
    with pytest.raises(EPTypeError, match="storage"):
        engram.make_engram_table(0, 4, (10, 16), "float32", MiB, None)
    with pytest.raises(EPValueError, match="sf: required iff"):
        engram.make_engram_table(0, 4, (10, 16), "float8_e4m3fn", MiB, None)
    with pytest.raises(EPValueError, match="num_total_entries = 40"):
        engram.make_engram_table(0, 4, (10, 16), "float8_e4m3fn", MiB, (10, 1))
    f = engram.make_engram_table(0, 4, (10, 16), "float8_e4m3fn", MiB, (40, 2))
    assert f.num_sf_packs == 2
    with pytest.raises(EPStateError, match="engram_write"):
        engram.require_table(None, 3)


def test_fetch_index_checks() -> None:
    t = engram.make_engram_table(0, 2, (4, 8), "bfloat16", MiB, None)
    assert engram.check_fetch_indices(t, (3, 2), "int32", 1 << 20, np.zeros((3, 2), np.int32)) == (3, 2)
    with pytest.raises(EPTypeError, match="int32"):
        engram.check_fetch_indices(t, (3, 2), "int64", MiB)
    with pytest.raises(EPValueError, match=r"entry 8 outside \[0, 8\)"):
        engram.check_fetch_indices(t, (1, 1), "int32", MiB, np.array([[8]], np.int32))
    with pytest.raises(EPValueError, match="fetch area"):
        engram.check_fetch_indices(t, (100, 2), "int32", 16 * 100)


@pytest.mark.parametrize("col_major", [False, True])
def test_fetch_reference_rows_and_factors(col_major: bool) -> None:
    rng = np.random.default_rng(0)
    storages = [rng.integers(0, 255, (5, 6), dtype=np.uint8) for _ in range(3)]
    sf = rng.standard_normal((15, 2)).astype(np.float32)
    idx = rng.integers(0, 15, (7, 3)).astype(np.int32)
    data, got_sf = engram.fetch_reference(storages, idx, sf, col_major)
    for t in range(7):
        for j in range(3):
            g = idx[t, j]
            assert np.array_equal(data[t * 3 + j], storages[g // 5][g % 5])
            assert np.array_equal(got_sf[t, j * 2 : j * 2 + 2], sf[g])
    assert got_sf.shape == (7, 6)
    if col_major:
        assert got_sf.strides == (4, 4 * 8)  # column-major, the token dim aligned to 4


def test_host_engram_over_a_bootstrap() -> None:
    n = 3
    storages = [np.random.default_rng(r).integers(0, 1 << 15, (4, 8)).astype(np.uint16) for r in range(n)]
    idx = np.random.default_rng(7).integers(0, 4 * n, (5, 2)).astype(np.int32)

    def run(r: int, boot) -> tuple:
        e = engram.HostEngram(boot, MiB, MiB)
        e.write(storages[r])
        return e.fetch(idx)()

    out = ThreadGroup(n, timeout_secs=30).run(run, join_timeout_secs=60)
    want, _ = engram.fetch_reference(storages, idx)
    for data, sf in out:
        assert sf is None and np.array_equal(data, want)
