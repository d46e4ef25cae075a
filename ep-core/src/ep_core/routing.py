"""Synthetic routings and inputs for tests and benchmarks (numpy, seeded): `(topk_idx [T, K] int64, topk_weights
[T, K] float32)` with distinct experts per token (uniform, unbalanced, one expert, lanes masked to -1), and
`make_inputs`, a full multi-rank input set (bf16 or FP8 data, per-rank token counts, 0 included).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ep_core.bf16 import float32_to_bf16

__all__ = [
    "RankInputs",
    "make_inputs",
    "mask_lanes",
    "one_expert_routing",
    "random_bf16",
    "random_fp8",
    "random_scale_packs",
    "unbalanced_routing",
    "uniform_routing",
]


def _weights(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.uniform(0.01, 1.0, size=shape).astype(np.float32)


def _topk_from_logits(logits: np.ndarray, num_topk: int, rng: np.random.Generator) -> np.ndarray:
    """K distinct experts per row, sampled without replacement with probability ~ exp(logits) (Gumbel top-k),
    returned in a random lane order."""
    t, e = logits.shape
    if num_topk > e:
        raise ValueError(f"num_topk ({num_topk}) must be <= the number of selectable experts ({e})")
    keys = logits + rng.gumbel(size=(t, e))
    idx = (
        np.argpartition(-keys, num_topk - 1, axis=1)[:, :num_topk] if t else np.zeros((0, num_topk), np.int64)
    )
    return rng.permuted(idx, axis=1).astype(np.int64)


def uniform_routing(
    num_tokens: int,
    num_experts: int,
    num_topk: int,
    rng: np.random.Generator,
    *,
    allowed_experts: Sequence[int] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """K distinct uniformly chosen experts per token (from `allowed_experts` when given)."""
    allowed = (
        np.arange(num_experts) if allowed_experts is None else np.asarray(allowed_experts, dtype=np.int64)
    )
    local = _topk_from_logits(np.zeros((num_tokens, allowed.size)), num_topk, rng)
    return allowed[local], _weights(rng, (num_tokens, num_topk))


def unbalanced_routing(
    num_tokens: int,
    num_experts: int,
    num_ranks: int,
    num_topk: int,
    ratio: float,
    rng: np.random.Generator,
    *,
    hot_rank: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Each of `hot_rank`'s experts is `ratio` times as likely to be picked as any other expert."""
    epr = num_experts // num_ranks
    logits = np.zeros((num_tokens, num_experts))
    logits[:, hot_rank * epr : (hot_rank + 1) * epr] = np.log(ratio)
    return _topk_from_logits(logits, num_topk, rng), _weights(rng, (num_tokens, num_topk))


def one_expert_routing(
    num_tokens: int, num_topk: int, expert: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Every token selects `expert` in one random lane; every other lane is -1 (weight 0)."""
    idx = np.full((num_tokens, num_topk), -1, dtype=np.int64)
    lane = rng.integers(0, num_topk, size=num_tokens)
    idx[np.arange(num_tokens), lane] = expert
    weights = np.where(idx >= 0, _weights(rng, idx.shape), np.float32(0)).astype(np.float32)
    return idx, weights


def mask_lanes(
    topk_idx: np.ndarray, topk_weights: np.ndarray, ratio: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Copies with a random `ratio` of lanes set to -1 and their weights to 0."""
    masked = rng.random(topk_idx.shape) < ratio
    return (
        np.where(masked, -1, topk_idx).astype(np.int64),
        np.where(masked, np.float32(0), topk_weights).astype(np.float32),
    )


def random_bf16(shape: tuple[int, ...], rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """Random normal bf16 values (uint16 bits), never zero."""
    f = rng.standard_normal(shape).astype(np.float32) * np.float32(scale)
    f = np.where(f == 0, np.float32(1.0), f)
    return float32_to_bf16(f)


def random_fp8(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random float8_e4m3fn bit patterns (uint8), NaN encodings (0x7F, 0xFF) excluded."""
    b = rng.integers(0, 256, size=shape, dtype=np.uint8)
    return np.where((b & 0x7F) == 0x7F, b ^ 0x01, b).astype(np.uint8)


def random_scale_packs(
    num_tokens: int, num_packs: int, rng: np.random.Generator, dtype: type = np.float32
) -> np.ndarray:
    """Random 4-byte scale packs: positive float32 scales, or int32 packs of four UE8M0 bytes."""
    if np.dtype(dtype) == np.float32:
        return rng.uniform(1e-3, 1.0, size=(num_tokens, num_packs)).astype(np.float32)
    return rng.integers(0, 2**31 - 1, size=(num_tokens, num_packs), dtype=np.int64).astype(np.dtype(dtype))


@dataclass
class RankInputs:
    """Inputs of all ranks (lists indexed by rank). `sfs` is None for bf16 data."""

    xs: list[np.ndarray]
    sfs: list[np.ndarray] | None
    topk_idxs: list[np.ndarray]
    topk_weights: list[np.ndarray]

    @property
    def x_args(self) -> list:
        """`xs` as `ep_core.reference.dispatch` takes them: arrays, or FP8 tuples `(data, sf)`."""
        return list(self.xs) if self.sfs is None else list(zip(self.xs, self.sfs))


def make_inputs(
    num_ranks: int,
    num_tokens: int | Sequence[int],
    hidden: int,
    num_experts: int,
    num_topk: int,
    *,
    seed: int = 0,
    kind: str = "uniform",
    ratio: float = 4.0,
    masked_ratio: float = 0.0,
    empty_dst_ranks: Sequence[int] = (),
    fp8: bool = False,
    num_sf_packs: int | None = None,
    sf_dtype: type = np.float32,
) -> RankInputs:
    """Random inputs for `num_ranks` ranks.

    `num_tokens`: one count for every rank or a count per rank (0 allowed). `kind`: "uniform", "unbalanced"
    (rank 0 hot by `ratio`) or "one_expert" (every token to expert 0). `empty_dst_ranks`: ranks whose experts are
    never chosen (they receive nothing; uniform kind only). `masked_ratio`: fraction of lanes set to -1.
    """
    rng = np.random.default_rng(seed)
    counts = [num_tokens] * num_ranks if isinstance(num_tokens, int) else list(num_tokens)
    epr = num_experts // num_ranks
    allowed = [e for e in range(num_experts) if e // epr not in set(empty_dst_ranks)]
    xs, sfs, idxs, ws = [], [], [], []
    for t in counts:
        if kind == "uniform":
            idx, w = uniform_routing(t, num_experts, num_topk, rng, allowed_experts=allowed)
        elif kind == "unbalanced":
            idx, w = unbalanced_routing(t, num_experts, num_ranks, num_topk, ratio, rng)
        elif kind == "one_expert":
            idx, w = one_expert_routing(t, num_topk, 0, rng)
        else:
            raise ValueError(f"kind: expected 'uniform', 'unbalanced' or 'one_expert', got {kind!r}")
        if masked_ratio:
            idx, w = mask_lanes(idx, w, masked_ratio, rng)
        idxs.append(idx)
        ws.append(w)
        if fp8:
            xs.append(random_fp8((t, hidden), rng))
            sfs.append(random_scale_packs(t, num_sf_packs or (hidden + 127) // 128, rng, sf_dtype))
        else:
            xs.append(random_bf16((t, hidden), rng))
    return RankInputs(xs, sfs if fp8 else None, idxs, ws)
