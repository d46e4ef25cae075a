"""The rank-private scratch: header offsets mirror args.cuh, and the barrier epoch follows the scratch when a
configuration moves it (the epoch is compared with arrival counts that every operation shares)."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import ep_layout
from ep_core.kernels import KernelConfig, _cuda, scratch_bytes
from ep_core.kernels.plan import SCRATCH_BARRIER_EPOCH_OFFSET, SCRATCH_INPUT_ERROR_OFFSET
from ep_core.kernels.rank_driver import RankDriver

ARGS_CUH = Path(__file__).resolve().parents[1] / "include" / "ep_core" / "args.cuh"


def test_scratch_header_offsets_mirror_args_cuh() -> None:
    text = ARGS_CUH.read_text()
    for field, offset in (
        ("barrier_epoch", SCRATCH_BARRIER_EPOCH_OFFSET),
        ("input_error", SCRATCH_INPUT_ERROR_OFFSET),
    ):
        m = re.search(rf"\b{field}\(\) const \{{ return reinterpret_cast<[^>]+>\(base \+ (\d+)\); \}}", text)
        assert m is not None, f"args.cuh: Scratch::{field}() not found"
        assert int(m.group(1)) == offset


def test_barrier_epoch_follows_a_moved_scratch(monkeypatch) -> None:
    copies: list[tuple[int, int, int]] = []
    monkeypatch.setattr(_cuda, "copy_device", lambda dst, src, n, stream: copies.append((dst, src, n)))
    monkeypatch.setattr(_cuda, "DeviceBuffer", lambda nbytes: SimpleNamespace(ptr=0x7000_0000 + nbytes))
    n, m = 8, 4096
    cfg = KernelConfig(n, 8, 7168)
    small, large = 64, 2048  # experts: the first scratch fits the workspace's reserved region, the second not
    assert scratch_bytes(n, small, m) <= ep_layout.NUM_RESERVED_BYTES < scratch_bytes(n, large, m)
    base = 0x1000_0000
    rank = SimpleNamespace(
        res=SimpleNamespace(base=base, data_bytes=1 << 34, scratch_buffers={}),
        num_max_tokens=m,
        stream=0,
        _scratches=set(),
    )
    _, s1 = RankDriver._regions(rank, cfg, small, "dispatch")
    _, s1_again = RankDriver._regions(rank, cfg, small, "dispatch")
    assert s1 == s1_again == base + ep_layout.WorkspaceLayout.RESERVED_OFFSET and copies == []
    _, s2 = RankDriver._regions(rank, cfg, large, "dispatch")
    _, s3 = RankDriver._regions(rank, cfg, small, "combine")
    off = SCRATCH_BARRIER_EPOCH_OFFSET
    assert s2 != s1 and s3 == s1
    assert copies == [(s2 + off, s1 + off, 8), (s1 + off, s2 + off, 8)]
    assert rank._scratches == {s1, s2}  # every scratch used is remembered (input-error records live there)
