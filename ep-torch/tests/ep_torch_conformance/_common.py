"""The helpers every conformance check shares: the result record, bit-exact comparison against
``ep_core.reference``, the inputs every rank regenerates from one seed."""

from __future__ import annotations

import dataclasses
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from ep_core import reference
from ep_core.handle import ARRAY_FIELDS, EPHandle
from ep_core.routing import make_inputs
from ep_torch._convert import from_numpy, to_numpy

Result = tuple[str, bool, str]


class _Checks:
    def __init__(self) -> None:
        self.results: list[Result] = []

    def run(self, name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
            self.results.append((name, True, ""))
        except Exception as e:  # a failed comparison: record it and go on (the collectives already happened)
            detail = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"
            self.results.append((name, False, detail))


def _bits(t: torch.Tensor) -> np.ndarray:
    return to_numpy(t.detach())


def _same(name: str, got: Any, want: Any) -> None:
    if want is None or got is None:
        if (want is None) != (got is None):
            raise AssertionError(f"{name}: expected {'None' if want is None else 'a value'}, got {got!r}")
        return
    g = _bits(got) if isinstance(got, torch.Tensor) else np.asarray(got)
    w = np.asarray(want)
    if g.dtype.kind == "f" or w.dtype.kind == "f":  # compare floats as bits
        g = np.ascontiguousarray(g).view(np.uint8 if g.dtype.itemsize == 1 else f"u{g.dtype.itemsize}")
        w = np.ascontiguousarray(w).view(np.uint8 if w.dtype.itemsize == 1 else f"u{w.dtype.itemsize}")
    if g.shape != w.shape:
        raise AssertionError(f"{name}: shape {g.shape} != reference {w.shape}")
    if not np.array_equal(g.astype(np.int64), w.astype(np.int64)):
        bad = np.argwhere(g != w)
        raise AssertionError(
            f"{name}: {len(bad)} elements differ from the reference, first at {bad[0].tolist()}"
        )


def _same_handle(h: EPHandle, ref: Any) -> None:
    for field in (
        "num_recv_tokens",
        "num_expanded_tokens",
        "num_recv_tokens_per_expert_list",
        "psum_num_recv_tokens_per_scaleup_rank",
        "psum_num_recv_tokens_per_expert",
        "num_unaligned_recv_tokens_per_expert",
        "recv_src_metadata",
        "dst_buffer_slot_idx",
    ):
        got, want = getattr(h, field), getattr(ref, field)
        if isinstance(want, list):
            if list(got) != list(want):
                raise AssertionError(f"handle.{field}: {got} != reference {want}")
        else:
            _same(f"handle.{field}", got, want)


def _torch_x(inputs: Any, r: int, device: torch.device) -> Any:
    if inputs.sfs is None:
        return from_numpy(inputs.xs[r], torch.bfloat16, device)
    return (from_numpy(inputs.xs[r], torch.float8_e4m3fn, device), torch.from_numpy(inputs.sfs[r]).to(device))


def _rng_bf16(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    from ep_core.routing import random_bf16

    return random_bf16(shape, np.random.default_rng(seed))


def _as_output(recv_x: Any, recv_idx: Any, recv_w: Any, handle: EPHandle) -> reference.DispatchOutput:
    """Torch outputs as an ``ep_core.reference.DispatchOutput`` of numpy arrays (bits for bf16 / FP8)."""
    data, sf = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
    h = dataclasses.replace(handle, **{f: _bits(getattr(handle, f)) for f in ARRAY_FIELDS})
    return reference.DispatchOutput(
        _bits(data),
        None if sf is None else _bits(sf),
        None if recv_idx is None else _bits(recv_idx),
        None if recv_w is None else _bits(recv_w),
        h,
    )


def _compare_dispatch(
    prefix: str,
    got: reference.DispatchOutput,
    ref: reference.DispatchOutput,
    *,
    exact: bool,
    deterministic: bool,
    zero_padding: bool,
) -> None:
    """``exact`` (the reference backend): every array bit for bit, slack rows included. Otherwise (GPU kernels):
    row order inside regions/experts compared through ``canonical_order`` unless deterministic, only valid rows
    (slack and padding are unspecified), padding zero when ``zero_padding``."""
    if exact:
        _same(prefix + "recv_x", got.recv_x, ref.recv_x)
        _same(prefix + "recv_sf", got.recv_sf, ref.recv_sf)
        _same(prefix + "recv_topk_idx", got.recv_topk_idx, ref.recv_topk_idx)
        _same(prefix + "recv_topk_weights", got.recv_topk_weights, ref.recv_topk_weights)
        _same_handle(got.handle, ref.handle)
        return
    if not deterministic:
        got, ref = reference.canonical_order(got), reference.canonical_order(ref)
    h, rh = got.handle, ref.handle
    for field in ("num_recv_tokens", "num_expanded_tokens", "num_recv_tokens_per_expert_list"):
        if getattr(h, field) != getattr(rh, field):
            raise AssertionError(
                f"{prefix}handle.{field}: {getattr(h, field)} != reference {getattr(rh, field)}"
            )
    for field in (
        "psum_num_recv_tokens_per_scaleup_rank",
        "psum_num_recv_tokens_per_expert",
        "num_unaligned_recv_tokens_per_expert",
    ):
        _same(f"{prefix}handle.{field}", getattr(h, field), getattr(rh, field))
    n = ref.num_valid_rows
    _same(prefix + "handle.recv_src_metadata (valid rows)", h.recv_src_metadata[:n], rh.recv_src_metadata[:n])
    if deterministic:
        _same(prefix + "handle.dst_buffer_slot_idx", h.dst_buffer_slot_idx, rh.dst_buffer_slot_idx)
    if h.do_expand:
        rows = ref.valid_expanded_rows
        end = (
            int(sum(rh.num_recv_tokens_per_expert_list))
            if rh.num_recv_tokens_per_expert_list
            else int(
                reference.align(int(np.asarray(rh.psum_num_recv_tokens_per_expert)[-1]), rh.expert_alignment)
                if rh.num_local_experts
                else 0
            )
        )
        padding = ~rows & (np.arange(rows.size) < end)
    else:
        rows = np.arange(got.recv_x.shape[0]) < n
        padding = np.zeros_like(rows)
    for name in ("recv_x", "recv_sf", "recv_topk_idx", "recv_topk_weights"):
        a, b = getattr(got, name), getattr(ref, name)
        if a is None or b is None:
            _same(prefix + name, a, b)
            continue
        _same(f"{prefix}{name} (valid rows)", a[rows], b[rows])
        if zero_padding and padding.any():
            _same(f"{prefix}{name} (zero padding)", a[padding], np.zeros_like(a[padding]))


def _combine_input(handle: Any, table: np.ndarray, k: int) -> np.ndarray:
    """Combine input rows for ``handle`` (numpy fields): the row of source token ``s`` is ``table[s*K]``
    (non-expand), the expanded row of lane ``l`` is ``table[s*K + l]``; other rows are zero."""
    rows = handle.num_expanded_tokens if handle.do_expand else handle.num_recv_tokens
    meta = np.asarray(handle.recv_src_metadata).astype(np.int64)
    num_recv = int(np.asarray(handle.psum_num_recv_tokens_per_scaleup_rank)[-1])
    src = meta[:num_recv, 0]
    y = np.zeros((rows, table.shape[1]), dtype=table.dtype)
    if not handle.do_expand:
        y[:num_recv] = table[src * k]
    else:
        ii, kk = np.nonzero(meta[:num_recv, 2:] >= 0)
        y[meta[ii, 2 + kk]] = table[src[ii] * k + kk]
    return y


# --------------------------------------------------------------------------------------------------------------------
# routings and inputs (every scenario regenerates all ranks' inputs from one seed)


ROUTINGS: dict[str, dict[str, Any]] = {
    # -1 lanes, unequal counts, a rank with no tokens, a rank with exactly M tokens
    "masked": {
        "kind": "uniform",
        "masked_ratio": 0.25,
        "counts": lambda n, m: [m, 0, *[m - 3 - r for r in range(n - 2)]],
    },
    "unbalanced": {"kind": "unbalanced", "ratio": 4.0, "counts": lambda n, m: [m - r for r in range(n)]},
    # the last rank receives nothing
    "empty_dst": {
        "kind": "uniform",
        "empty_dst": True,
        "counts": lambda n, m: [m // 2 + r for r in range(n)],
    },
}


def _inputs(routing: str, n: int, m: int, hidden: int, experts: int, topk: int, fp8: bool, seed: int) -> Any:
    spec = ROUTINGS[routing]
    counts = [min(m, max(0, c)) for c in spec["counts"](n, m)][:n] if n > 1 else [m]
    kw: dict[str, Any] = {"kind": spec["kind"], "seed": seed, "fp8": fp8}
    if "masked_ratio" in spec:
        kw["masked_ratio"] = spec["masked_ratio"]
    if "ratio" in spec:
        kw["ratio"] = spec["ratio"]
    if spec.get("empty_dst") and n > 1:
        kw["empty_dst_ranks"] = (n - 1,)
    if fp8:
        kw["num_sf_packs"] = 3
        kw["sf_dtype"] = np.int32 if seed % 2 else np.float32
    return make_inputs(n, counts, hidden, experts, topk, **kw)
