"""Conformance checks of the torch API against ``ep_core.reference``, runnable on any backend.

Every rank regenerates all ranks' inputs from one seed (``ep_core.routing.make_inputs``), runs the reference over
them locally, calls the torch API with its own slice and compares bit for bit. Scenarios:

- ``modes``: SPEC §9 on the torch surface: {non-expand, expand} x {A = 1, 128} x {bf16, FP8} x {0, 1, 2 biases} x
  {CPU sync, no sync, cached} x {deterministic or not, multiple reduction or not}, over routings with -1 lanes,
  unequal and zero token counts, ``num_tokens == M``, unbalanced load and ranks that receive nothing; plus events
  (``async_with_compute_stream``, ``previous_event``) and ``cumulative_local_expert_recv_stats``; in one NVLink
  domain every non-expanded mode also runs the zero-copy dispatch (against the reference's deterministic order),
  the zero-copy combine, and the round trip dispatch -> expert in place -> combine through the buffer's memory;
- ``errors``: the bad-input table of SPEC §6 (type, message fragment), and a bad input on one rank only;
- ``autograd``: ``ep_torch.functional`` forward and gradients against a dense float64 computation on data whose
  arithmetic is exact in bf16, so equality is exact (non-expand and expand layouts);
- ``compile``: the same step inside ``torch.compile`` (``aot_eager``) equals eager mode;
- ``module``: ``ep_torch.nn.MoEDispatcher`` against the dense computation.

``run_all(...)`` returns ``[(name, ok, detail)]``; a check's failure never skips the collectives of the others, so
ranks stay in step. Command line: ``python -m ep_torch.testing.conformance --ranks 4 [--backend cuda]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from ep_core import reference
from ep_core.errors import EPError
from ep_core.handle import ARRAY_FIELDS, EPHandle
from ep_core.routing import make_inputs

from .. import functional
from .._convert import from_numpy, to_numpy
from ..buffer import ElasticBuffer, EPBuffer
from ..event import EventHandle, EventOverlap

__all__ = ["SCENARIOS", "main", "run_all"]

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
# modes


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


def check_modes(checks: _Checks, buffers: dict[str, ElasticBuffer], cfg: dict[str, Any]) -> None:
    rank, n, device = cfg["rank"], cfg["world"], cfg["device"]
    m, hidden, experts, topk = cfg["tokens"], cfg["hidden"], cfg["experts"], cfg["topk"]
    seed = cfg["seed"]
    event_modes = itertools.cycle(
        [
            (False, False, False),
            (True, False, False),
            (True, True, True),
            (False, True, True),
            (False, False, True),
        ]
    )
    for routing, fp8, expand, align, sync, bufname in itertools.product(
        ROUTINGS, (False, True), (False, True), (1, 128), (True, False), list(buffers)
    ):
        seed += 1
        buf = buffers[bufname]
        name = f"modes/{routing}/{'fp8' if fp8 else 'bf16'}/{'expand' if expand else 'rank'}/A{align}/{'sync' if sync else 'nosync'}/{bufname}"
        async_, with_prev, alloc_comm = next(event_modes)
        exact = buf.transport == "reference"
        inputs = _inputs(routing, n, m, hidden, experts, topk, fp8, seed)
        col_major = expand and fp8
        common = {
            "num_experts": experts,
            "num_max_tokens_per_rank": m,
            "expert_alignment": align,
            "do_expand": expand,
        }
        refs = reference.dispatch(
            inputs.x_args,
            inputs.topk_idxs,
            inputs.topk_weights,
            do_cpu_sync=sync,
            use_tma_aligned_col_major_sf=col_major,
            num_scaleup_ranks=buf.num_scaleup_ranks,
            **common,
        )
        ref = refs[rank]
        ref_handles = [o.handle for o in refs]
        x = _torch_x(inputs, rank, device)
        idx = torch.from_numpy(inputs.topk_idxs[rank]).to(device)
        w = torch.from_numpy(inputs.topk_weights[rank]).to(device)
        prev = buf.capture() if with_prev else None
        recv_x, recv_idx, recv_w, handle, event = buf.dispatch(
            x,
            topk_idx=idx,
            topk_weights=w,
            do_cpu_sync=sync,
            use_tma_aligned_col_major_sf=col_major,
            previous_event=prev,
            allocate_on_comm_stream=alloc_comm,
            async_with_compute_stream=async_,
            do_handle_copy=bool(seed % 2),
            **common,
        )

        def check_dispatch(
            recv_x=recv_x,
            recv_idx=recv_idx,
            recv_w=recv_w,
            handle=handle,
            event=event,
            ref=ref,
            async_=async_,
            idx=idx,
            col_major=col_major,
            seed=seed,
            fp8=fp8,
            exact=exact,
            buf=buf,
        ) -> None:
            assert isinstance(event, EventOverlap)
            if async_:
                assert event.event is not None, "async dispatch must return an event"
                event.current_stream_wait()
            else:
                assert event.event is None, "a synchronous dispatch returns EventOverlap(None)"
            assert isinstance(recv_x, tuple) == fp8, "recv_x is a tuple iff x was one"
            if fp8:
                sf = recv_x[1]
                if col_major and sf.shape[0]:
                    rows = sf.shape[0]
                    assert sf.stride() == (1, reference.align(rows, 4)), f"col-major sf strides {sf.stride()}"
            if recv_idx is not None:
                assert recv_idx.dtype == torch.int64
            _compare_dispatch(
                "",
                _as_output(recv_x, recv_idx, recv_w, handle),
                ref,
                exact=exact,
                deterministic=buf.deterministic,
                zero_padding=False,
            )
            assert handle.topk_idx.equal(idx)
            assert (handle.topk_idx is not idx) == bool(seed % 2), "do_handle_copy"

        checks.run(name + "/dispatch", check_dispatch)

        # cached dispatch: same rows, same order; new weights allowed
        w2 = (w * 0.5).contiguous()
        refs_c = reference.dispatch(
            inputs.x_args,
            None,
            [wt * np.float32(0.5) for wt in inputs.topk_weights],
            handles=ref_handles,
            use_tma_aligned_col_major_sf=col_major,
            do_zero_padding=expand,
        )
        c_x, c_idx, c_w, c_handle, _ = buf.dispatch(
            x, handle=handle, topk_weights=w2, do_zero_padding=expand, use_tma_aligned_col_major_sf=col_major
        )

        def check_cached(
            c_x=c_x,
            c_idx=c_idx,
            c_w=c_w,
            c_handle=c_handle,
            handle=handle,
            ref_c=refs_c[rank],
            recv_x=recv_x,
            recv_idx=recv_idx,
            fp8=fp8,
            exact=exact,
            buf=buf,
            expand=expand,
        ) -> None:
            assert c_handle is handle, "a cached dispatch returns the handle it was given"
            got = _as_output(c_x, c_idx, c_w, handle)
            _compare_dispatch(
                "cached ", got, ref_c, exact=exact, deterministic=buf.deterministic, zero_padding=expand
            )
            # bitwise equal to the original dispatch at every valid row, in the same order
            orig = _as_output(recv_x, recv_idx, None, handle)
            n = reference.DispatchOutput(got.recv_x, None, None, None, got.handle).num_valid_rows
            valid = (
                reference.valid_expanded_rows(got.handle, got.recv_x.shape[0])
                if expand
                else np.arange(got.recv_x.shape[0]) < n
            )
            _same("cached recv_x == original", got.recv_x[valid], orig.recv_x[valid])
            if fp8:
                _same("cached recv_sf == original", got.recv_sf[valid], orig.recv_sf[valid])
            if c_idx is not None:
                _same("cached recv_topk_idx == original", got.recv_topk_idx[valid], orig.recv_topk_idx[valid])

        checks.run(name + "/cached", check_cached)

        # zero-copy (an ep extension): the same dispatch with its outputs left in the buffer's memory, in the
        # deterministic order (the reference's) whatever the buffer's; non-expanded modes are the row-major ones
        if not expand and buf.get_physical_domain_size()[0] == 1:
            z_prev = buf.capture() if with_prev else None
            z_x, z_idx, z_w, z_handle, z_event = buf.dispatch(
                x,
                topk_idx=idx,
                topk_weights=w,
                do_cpu_sync=sync,
                previous_event=z_prev,
                allocate_on_comm_stream=alloc_comm,
                async_with_compute_stream=async_,
                do_handle_copy=bool(seed % 2),
                zero_copy=True,
                **common,
            )
            if async_:
                z_event.current_stream_wait()

            def check_zero_copy_dispatch(
                z_x=z_x,
                z_idx=z_idx,
                z_w=z_w,
                z_handle=z_handle,
                z_event=z_event,
                ref=ref,
                async_=async_,
                fp8=fp8,
                x=x,
                exact=exact,
            ) -> None:
                assert isinstance(z_event, EventOverlap) and (z_event.event is not None) == async_
                assert isinstance(z_x, tuple) == fp8, "recv_x is a tuple iff x was one"
                data = z_x[0] if fp8 else z_x
                assert (
                    data.dtype == (torch.float8_e4m3fn if fp8 else torch.bfloat16) and data.device == device
                )
                if fp8:
                    assert z_x[1].dtype == x[1].dtype
                assert z_idx.dtype == torch.int64 and z_w.dtype == torch.float32
                _compare_dispatch(
                    "zero-copy ",
                    _as_output(z_x, z_idx, z_w, z_handle),
                    ref,
                    exact=exact,
                    deterministic=True,
                    zero_padding=False,
                )

            checks.run(name + "/dispatch/zero_copy", check_zero_copy_dispatch)
            if not fp8:
                # the expert (times two: exact in bf16) writes its outputs over the rows it read, which are the
                # combine buffer's; the zero-copy combine reads them there
                aliased = buf.get_combine_buffer(z_handle).data_ptr() == z_x.data_ptr()
                z_x.mul_(2)
                rx, _, _ = buf.combine(z_x, z_handle, zero_copy=True)
                # the reference's rows, through the same expert
                doubled = [_bits(from_numpy(o.recv_x, torch.bfloat16) * 2) for o in refs]
                ref_rt = reference.combine(
                    doubled,
                    ref_handles,
                    allow_multiple_reduction=buf.allow_multiple_reduction,
                    num_scaleup_ranks=buf.num_scaleup_ranks,
                )[rank]

                def check_round_trip(rx=rx, ref_rt=ref_rt, aliased=aliased) -> None:
                    assert aliased, (
                        "bf16 recv_x of a zero-copy dispatch is get_combine_buffer(handle)'s memory"
                    )
                    _same("zero-copy dispatch -> expert in place -> zero-copy combine", rx, ref_rt.combined_x)

                checks.run(name + "/zero_copy_round_trip", check_round_trip)

        if fp8:
            continue  # combine takes bf16 expert outputs
        # combine with 0, 1, 2 biases; weights round trip
        # expert outputs keyed by (source token, lane), not by row: the same values whatever row order a kernel chose
        table = _rng_bf16(seed * 131, (n * m * topk, hidden))
        ys = [_combine_input(o.handle, table, topk) for o in refs]
        amr = buf.allow_multiple_reduction
        with_w = not expand or amr
        for num_bias in (0, 1, 2):
            biases = [
                tuple(
                    _rng_bf16(seed * 977 + 10 * r + b, (len(inputs.topk_idxs[r]), hidden))
                    for b in range(num_bias)
                )
                for r in range(n)
            ]
            ref_bias = None if num_bias == 0 else [b[0] if num_bias == 1 else b for b in biases]
            ref_out = reference.combine(
                ys,
                ref_handles,
                topk_weights=[o.recv_topk_weights for o in refs] if with_w else None,
                bias=ref_bias,
                allow_multiple_reduction=amr,
                num_scaleup_ranks=buf.num_scaleup_ranks,
            )[rank]
            tb = tuple(from_numpy(b, torch.bfloat16, device) for b in biases[rank])
            bias_arg = None if num_bias == 0 else (tb[0] if num_bias == 1 else tb)
            y = from_numpy(
                _combine_input(_as_output(recv_x, None, None, handle).handle, table, topk),
                torch.bfloat16,
                device,
            )
            cx, cw, ev = buf.combine(
                y,
                handle,
                topk_weights=recv_w if with_w else None,
                bias=bias_arg,
                async_with_compute_stream=async_,
            )

            def check_combine(
                cx=cx, cw=cw, ev=ev, ref_out=ref_out, w=w, with_w=with_w, async_=async_, handle=handle
            ) -> None:
                if async_:
                    ev.current_stream_wait()
                _same("combined_x", cx, ref_out.combined_x)
                assert cx.dtype == torch.bfloat16
                if with_w:
                    _same("combined_topk_weights", cw, ref_out.combined_topk_weights)
                    masked = torch.where(handle.topk_idx >= 0, w, torch.zeros_like(w))
                    _same("combined_topk_weights == topk_weights (round trip)", cw, _bits(masked))
                else:
                    assert cw is None

            checks.run(f"{name}/combine/bias{num_bias}", check_combine)

        if not expand and buf.get_physical_domain_size()[0] == 1:
            # zero-copy (an ep extension): the same expert outputs written into the rank's combine buffer, read there
            zc = buf.get_combine_buffer(handle)
            zc.copy_(
                from_numpy(
                    _combine_input(_as_output(recv_x, None, None, handle).handle, table, topk),
                    torch.bfloat16,
                    device,
                )
            )
            zx, zw, _ = buf.combine(zc, handle, zero_copy=True)
            ref_zc = reference.combine(
                ys, ref_handles, allow_multiple_reduction=amr, num_scaleup_ranks=buf.num_scaleup_ranks
            )[rank]

            def check_zero_copy(zx=zx, zw=zw, ref_zc=ref_zc) -> None:
                _same("zero-copy combined_x", zx, ref_zc.combined_x)
                assert zw is None

            checks.run(f"{name}/combine/zero_copy", check_zero_copy)


def check_stats(checks: _Checks, buf: ElasticBuffer, cfg: dict[str, Any]) -> None:
    rank, n, device = cfg["rank"], cfg["world"], cfg["device"]
    inputs = _inputs("unbalanced", n, cfg["tokens"], cfg["hidden"], cfg["experts"], cfg["topk"], False, 7)
    refs = reference.dispatch(
        inputs.x_args,
        inputs.topk_idxs,
        inputs.topk_weights,
        num_experts=cfg["experts"],
        num_max_tokens_per_rank=cfg["tokens"],
        expert_alignment=4,
        num_scaleup_ranks=buf.num_scaleup_ranks,
    )
    epr = cfg["experts"] // n
    stats = torch.full((epr,), 5, dtype=torch.int32, device=device)
    x = _torch_x(inputs, rank, device)
    idx = torch.from_numpy(inputs.topk_idxs[rank]).to(device)
    for _ in range(2):
        buf.dispatch(
            x,
            topk_idx=idx,
            num_experts=cfg["experts"],
            expert_alignment=4,
            cumulative_local_expert_recv_stats=stats,
        )

    def check() -> None:
        want = 5 + 2 * refs[rank].handle.num_unaligned_recv_tokens_per_expert.astype(np.int64)
        _same("cumulative_local_expert_recv_stats", stats.cpu().numpy().astype(np.int64), want)

    checks.run("modes/cumulative_local_expert_recv_stats", check)


# --------------------------------------------------------------------------------------------------------------------
# bad inputs


def _bad_dispatch_cases(
    cfg: dict[str, Any], device: torch.device
) -> list[tuple[str, dict[str, Any], type, str]]:
    m, h, e, k = cfg["tokens"], cfg["hidden"], cfg["experts"], cfg["topk"]
    t = max(1, m // 2)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(t, h, generator=g).bfloat16().to(device)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(device)
    w = torch.rand(t, k, generator=g).to(device)
    fp8 = (x.float().to(torch.float8_e4m3fn), torch.ones(t, 2, device=device))
    dup = idx.clone()
    dup[0, 1] = dup[0, 0]
    big = idx.clone()
    big[0, 0] = e
    base = {"x": x, "topk_idx": idx, "topk_weights": w, "num_experts": e}
    odd_h = torch.randn(t, 24, generator=g).bfloat16().to(device)

    def with_(**kw: Any) -> dict[str, Any]:
        return {**base, **kw}

    return [
        ("x float32", with_(x=x.float()), TypeError, "x: expected dtype bfloat16"),
        ("x list", with_(x=[x]), TypeError, "x: expected a bf16 array"),
        ("x 3-D", with_(x=x.unsqueeze(0)), ValueError, "x: expected a 2-D"),
        ("x not contiguous", with_(x=x.t().contiguous().t()), ValueError, "contiguous"),
        ("x hidden bytes not a multiple of 32", with_(x=odd_h), ValueError, "multiple of 32"),
        ("fp8 data not fp8", with_(x=(x, fp8[1])), TypeError, "float8_e4m3fn"),
        ("fp8 sf float16", with_(x=(fp8[0], fp8[1].half())), TypeError, "x[1] (sf)"),
        ("fp8 sf rows", with_(x=(fp8[0], fp8[1][:-1])), ValueError, "x[1] (sf)"),
        ("fp8 tuple of 3", with_(x=(fp8[0], fp8[1], fp8[1])), TypeError, "x: an FP8 input is a tuple"),
        ("topk_idx float", with_(topk_idx=idx.float()), TypeError, "topk_idx"),
        ("topk_idx missing", with_(topk_idx=None), ValueError, "topk_idx: required"),
        ("topk_idx rows", with_(topk_idx=idx[:-1]), ValueError, "topk_idx: expected"),
        (
            "topk_idx K > 32",
            with_(topk_idx=torch.zeros(t, 33, dtype=torch.int64, device=device), topk_weights=None),
            ValueError,
            "num_topk",
        ),
        (
            "topk_weights float64",
            with_(topk_weights=w.double()),
            TypeError,
            "topk_weights: expected dtype float32",
        ),
        ("topk_weights second dim", with_(topk_weights=w[:, :-1].contiguous()), ValueError, "topk_weights"),
        ("num_tokens > M", with_(num_max_tokens_per_rank=t - 1), ValueError, "num_max_tokens_per_rank"),
        ("num_experts not a multiple of N", with_(num_experts=e + 1), ValueError, "num_experts"),
        ("num_experts missing", with_(num_experts=None), ValueError, "num_experts"),
        # found on the host by the reference; on the GPU in the kernel's error word (any EPError is fine there)
        (
            "expert id >= E",
            with_(topk_idx=big),
            *((EPError, "") if device.type == "cuda" else (ValueError, "out of range")),
        ),
        (
            "duplicate expert",
            with_(topk_idx=dup),
            *((EPError, "") if device.type == "cuda" else (ValueError, "twice")),
        ),
        ("do_zero_padding without expand", with_(do_zero_padding=True), ValueError, "do_zero_padding"),
        (
            "previous_event without allocate_on_comm_stream",
            with_(previous_event=EventHandle()),
            ValueError,
            "allocate_on_comm_stream",
        ),
        (
            "previous_event not an event",
            with_(previous_event=1, allocate_on_comm_stream=True),
            TypeError,
            "previous_event",
        ),
        ("num_qps > allocated", with_(num_qps=10_000), ValueError, "num_qps"),
        ("num_sms negative", with_(num_sms=-1), ValueError, "num_sms"),
        ("buffer too small", with_(num_max_tokens_per_rank=1 << 20), ValueError, "bytes"),
        ("expert_alignment 0", with_(expert_alignment=0), ValueError, "expert_alignment"),
        # zero-copy (an ep extension): refused before anything runs, naming the argument
        ("zero_copy not a bool", with_(zero_copy=1), TypeError, "zero_copy: expected a bool"),
        (
            "zero_copy expanded",
            with_(do_expand=True, zero_copy=True),
            ValueError,
            "zero_copy: the non-expanded layout only",
        ),
        (
            "zero_copy column-major scales",
            with_(x=fp8, use_tma_aligned_col_major_sf=True, zero_copy=True),
            ValueError,
            "zero_copy: row-major scales only",
        ),
    ]


def check_errors(checks: _Checks, buf: ElasticBuffer, other: ElasticBuffer, cfg: dict[str, Any]) -> None:
    rank, device = cfg["rank"], cfg["device"]
    e = cfg["experts"]

    def expect(name: str, fn: Callable[[], Any], exc: type, fragment: str) -> None:
        try:
            fn()
        except exc as err:
            if fragment not in str(err):
                checks.results.append((f"errors/{name}", False, f"message {str(err)!r} lacks {fragment!r}"))
            else:
                checks.results.append((f"errors/{name}", True, ""))
            return
        except Exception as err:
            checks.results.append(
                (f"errors/{name}", False, f"raised {type(err).__name__}: {err}, expected {exc.__name__}")
            )
            return
        checks.results.append((f"errors/{name}", False, f"no error, expected {exc.__name__} ({fragment})"))

    for name, kwargs, exc, fragment in _bad_dispatch_cases(cfg, device):
        if name == "num_experts not a multiple of N" and buf.num_ranks == 1:
            continue  # every expert count is a multiple of one rank: nothing to reject
        expect(f"dispatch/{name}", lambda kw=kwargs: buf.dispatch(**kw), exc, fragment)

    # a valid dispatch for the cached / combine cases
    x = torch.randn(4, cfg["hidden"], generator=torch.Generator().manual_seed(rank)).bfloat16().to(device)
    idx = torch.tensor([[0, 1], [2, -1], [e - 1, 0], [-1, -1]], dtype=torch.int64, device=device)
    w = torch.rand(4, 2, generator=torch.Generator().manual_seed(9)).to(device)
    recv_x, _, recv_w, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=e)
    expect(
        "cached/topk_idx with handle",
        lambda: buf.dispatch(x, topk_idx=idx, handle=handle),
        ValueError,
        "topk_idx",
    )
    expect(
        "cached/do_cpu_sync with handle",
        lambda: buf.dispatch(x, handle=handle, do_cpu_sync=True),
        ValueError,
        "do_cpu_sync",
    )
    expect(
        "cached/num_experts differs",
        lambda: buf.dispatch(x, handle=handle, num_experts=2 * e),
        ValueError,
        "num_experts",
    )
    expect(
        "cached/stats",
        lambda: buf.dispatch(
            x,
            handle=handle,
            cumulative_local_expert_recv_stats=torch.zeros(e // cfg["world"], dtype=torch.int32),
        ),
        ValueError,
        "cumulative_local_expert_recv_stats",
    )
    expect("cached/x rows", lambda: buf.dispatch(x[:-1], handle=handle), ValueError, "tokens")
    expect("cached/handle type", lambda: buf.dispatch(x, handle=object()), TypeError, "handle")
    expect(
        "cached/zero_copy",
        lambda: buf.dispatch(x, handle=handle, zero_copy=True),
        ValueError,
        "zero_copy: not with a cached dispatch",
    )
    rows = recv_x.shape[0]
    t = x.shape[0]
    y = recv_x
    b = torch.zeros(t, cfg["hidden"], dtype=torch.bfloat16, device=device)
    expect("combine/bias list", lambda: buf.combine(y, handle, bias=[b, b]), TypeError, "bias")
    expect("combine/bias 3-tuple", lambda: buf.combine(y, handle, bias=(b, b, b)), TypeError, "bias")
    expect(
        "combine/bias shape",
        lambda: buf.combine(y, handle, bias=b[:, :16].contiguous()),
        ValueError,
        "bias: expected shape",
    )
    expect("combine/bias dtype", lambda: buf.combine(y, handle, bias=(b, b.float())), TypeError, "bias[1]")
    expect(
        "combine/x float32", lambda: buf.combine(y.float(), handle), TypeError, "x: expected dtype bfloat16"
    )
    expect(
        "combine/x rows",
        lambda: buf.combine(
            torch.zeros(rows + 1, cfg["hidden"], dtype=torch.bfloat16, device=device), handle
        ),
        ValueError,
        "rows",
    )
    expect(
        "combine/topk_weights shape",
        lambda: buf.combine(y, handle, topk_weights=recv_w[:, :1].contiguous()),
        ValueError,
        "topk_weights",
    )
    expect(
        "combine/topk_weights dtype",
        lambda: buf.combine(y, handle, topk_weights=recv_w.double()),
        TypeError,
        "topk_weights",
    )
    expect("combine/not a handle", lambda: buf.combine(y, None), ValueError, "handle: required")
    # expand + no multiple reduction + weights
    if not other.allow_multiple_reduction:
        ex, _, ew, eh, _ = other.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=e, do_expand=True)
        expect(
            "combine/expand weights without multiple reduction",
            lambda: other.combine(ex, eh, topk_weights=ew),
            ValueError,
            "allow_multiple_reduction",
        )
    if not other.allow_multiple_reduction:
        wg = w.clone().requires_grad_(True)
        expect(
            "functional/expand weights' gradient without multiple reduction",
            lambda: functional.dispatch(other, x, idx, wg, num_experts=e, do_expand=True),
            ValueError,
            "allow_multiple_reduction",
        )
    # a bad input on one rank only: that rank raises its error, the others a PeerError (nobody hangs); reference
    # backend only (GPU peers would wait for the rank in the kernel until the GPU timeout)
    if buf.transport == "reference":
        bad_x = x.float() if rank == 0 else x
        expect(
            "one rank bad",
            lambda: buf.dispatch(bad_x, topk_idx=idx, num_experts=e),
            TypeError if rank == 0 else RuntimeError,
            "x: expected dtype bfloat16" if rank == 0 else "rank 0 abandoned",
        )

    # DeepEP's test passes its mode flags as ints (do_handle_copy=1, async_with_compute_stream=0, ...): accepted
    def deepep_style() -> None:
        rx, _, _, hh, ev = buf.dispatch(
            x, idx, w, None, e, None, 1, 0, 0, None, None, 0, 0, None, 1, 1, 0, 0, 0
        )
        out, _, _ = buf.combine(rx, hh, None, None, 0, 0, None, None, 0, 0)
        assert out.shape == x.shape and ev.event is None

    checks.run("errors/positional DeepEP-style call with int flags", deepep_style)

    # constructor and lifecycle
    group = buf.group
    expect(
        "ctor/num_bytes not 2 MiB aligned", lambda: type(buf)(group, num_bytes=3 << 20), ValueError, "2 MiB"
    )
    expect("ctor/no size", lambda: type(buf)(group), ValueError, "num_bytes")
    expect(
        "ctor/transport",
        lambda: type(buf)(group, num_bytes=2 << 20, transport="carrier-pigeon"),
        ValueError,
        "transport",
    )
    expect(
        "ctor/num_cpu_bytes without num_bytes",
        lambda: type(buf)(group, num_cpu_bytes=2 << 20, hidden=64, num_max_tokens_per_rank=8),
        ValueError,
        "num_bytes",
    )
    auto = type(buf)(group, num_max_tokens_per_rank=8, hidden=cfg["hidden"])
    expect("destroy without explicitly_destroy", auto.destroy, RuntimeError, "explicitly_destroy")
    owned = type(buf)(group, num_max_tokens_per_rank=8, hidden=cfg["hidden"], explicitly_destroy=True)
    owned.destroy()
    expect(
        "use after destroy",
        lambda: owned.dispatch(x, topk_idx=idx, num_experts=e),
        RuntimeError,
        "used after destroy",
    )
    expect("destroy twice", owned.destroy, RuntimeError, "used after destroy")


# --------------------------------------------------------------------------------------------------------------------
# autograd, compile, module: exact arithmetic (small integers, dyadic weights and scales)


def _exact_problem(cfg: dict[str, Any], rank: int, seed: int) -> dict[str, Any]:
    """Inputs whose whole forward and backward is exact in bf16/fp32: ints in [-2, 2], weights in {0.5, 1},
    expert e multiplies by c_e in {0.5, 1, 1.5, 2}, loss gradient in [-2, 2]."""
    n, e, k, h = cfg["world"], cfg["experts"], cfg["topk"], cfg["hidden"]
    out = {}
    for r in range(n):
        g = torch.Generator().manual_seed(seed * 1000 + r)
        t = max(1, cfg["tokens"] - 2 * r)
        idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
        idx[torch.rand(t, k, generator=g) < 0.2] = -1
        out[r] = {
            "x": torch.randint(-2, 3, (t, h), generator=g).to(torch.bfloat16),
            "idx": idx,
            "w": torch.randint(1, 3, (t, k), generator=g).float() / 2,
            "g": torch.randint(-2, 3, (t, h), generator=g).float(),
        }
    return {"all": out, "scale": torch.tensor([0.5, 1.0, 1.5, 2.0])[torch.arange(e) % 4]}


def _dense(prob: dict[str, Any]) -> dict[str, Any]:
    xs = [v["x"].double().requires_grad_(True) for v in prob["all"].values()]
    ws = [v["w"].double().requires_grad_(True) for v in prob["all"].values()]
    scale = prob["scale"].double()
    loss = 0.0
    outs = []
    for x, w, v in zip(xs, ws, prob["all"].values()):
        idx = v["idx"]
        c = torch.where(idx >= 0, scale[idx.clamp(min=0)], torch.zeros((), dtype=torch.float64))
        out = (w * c).sum(1, keepdim=True) * x
        outs.append(out)
        loss = loss + (out * v["g"].double()).sum()
    loss.backward()
    return {"out": outs, "gx": [x.grad for x in xs], "gw": [w.grad for w in ws]}


def _ep_step(
    buf: ElasticBuffer,
    v: dict[str, Any],
    scale: torch.Tensor,
    rank: int,
    epr: int,
    e: int,
    expand: bool,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = v["x"].to(device).clone().requires_grad_(True)
    w = v["w"].to(device).clone().requires_grad_(True)
    local_scale = scale[rank * epr : (rank + 1) * epr].to(device)
    recv_x, recv_idx, recv_w, handle = functional.dispatch(
        buf, x, v["idx"].to(device), w, num_experts=e, expert_alignment=4 if expand else 1, do_expand=expand
    )
    if expand:
        h = functional.get_handle(handle)
        counts = h.num_unaligned_recv_tokens_per_expert.long()
        starts = torch.cat(
            [
                torch.zeros(1, dtype=torch.long, device=device),
                torch.tensor(h.num_recv_tokens_per_expert_list, device=device).cumsum(0)[:-1],
            ]
        )
        row_scale = torch.zeros(recv_x.shape[0], dtype=torch.float32, device=device)
        for le in range(epr):
            row_scale[starts[le] : starts[le] + counts[le]] = local_scale[le]
        y = (recv_x.float() * (recv_w * row_scale).unsqueeze(1)).bfloat16()
    else:
        c = torch.where(recv_idx >= 0, local_scale[recv_idx.clamp(min=0)], torch.zeros((), device=device))
        y = (recv_x.float() * (recv_w * c).sum(1, keepdim=True)).bfloat16()
    out = functional.combine(buf, y, handle)
    (out.float() * v["g"].to(device)).sum().backward()
    return out, x.grad, w.grad


def check_autograd(checks: _Checks, buffers: dict[str, ElasticBuffer], cfg: dict[str, Any]) -> None:
    rank, device = cfg["rank"], cfg["device"]
    e, n = cfg["experts"], cfg["world"]
    prob = _exact_problem(cfg, rank, 11)
    dense = _dense(prob)
    for bufname, buf in buffers.items():
        for expand in (False, True):
            if expand and not buf.allow_multiple_reduction:
                continue  # expand combine with weights needs multiple reduction
            out, gx, gw = _ep_step(buf, prob["all"][rank], prob["scale"], rank, e // n, e, expand, device)

            def check(out=out, gx=gx, gw=gw) -> None:
                for name, got, want in (
                    ("out", out, dense["out"][rank]),
                    ("grad x", gx, dense["gx"][rank]),
                    ("grad topk_weights", gw, dense["gw"][rank]),
                ):
                    got64 = got.detach().double().cpu()
                    if not torch.equal(got64, want):
                        raise AssertionError(
                            f"{name}: max |diff| {float((got64 - want).abs().max())} (exact expected)"
                        )

            checks.run(f"autograd/{bufname}/{'expand' if expand else 'rank'}", check)


def check_compile(checks: _Checks, buf: ElasticBuffer, cfg: dict[str, Any]) -> None:
    rank, device = cfg["rank"], cfg["device"]
    e, n = cfg["experts"], cfg["world"]
    prob = _exact_problem(cfg, rank, 12)
    v = prob["all"][rank]
    local_scale = prob["scale"][rank * (e // n) : (rank + 1) * (e // n)].to(device)

    def step(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        recv_x, recv_idx, recv_w, handle = functional.dispatch(buf, x, idx, w, num_experts=e)
        c = torch.where(recv_idx >= 0, local_scale[recv_idx.clamp(min=0)], torch.zeros((), device=device))
        y = (recv_x.float() * (recv_w * c).sum(1, keepdim=True)).bfloat16()
        return functional.combine(buf, y, handle)

    def step_expand(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        recv_x, _, recv_w, handle = functional.dispatch(
            buf, x, idx, w, num_experts=e, expert_alignment=4, do_expand=True
        )
        y = (recv_x.float() * recv_w.unsqueeze(1)).bfloat16()
        return functional.combine(buf, y, handle)

    for label, fn_eager in (("rank layout", step), ("expand layout", step_expand)):
        results = {}
        for mode, fn in (
            ("eager", fn_eager),
            ("compiled", torch.compile(fn_eager, backend="aot_eager", fullgraph=True)),
        ):
            x = v["x"].to(device).clone().requires_grad_(True)
            w = v["w"].to(device).clone().requires_grad_(True)
            try:
                out = fn(x, v["idx"].to(device), w)
                (out.float() * v["g"].to(device)).sum().backward()
                results[mode] = (out.detach(), x.grad, w.grad)
            except Exception as err:  # keep the ranks in step: report after
                results[mode] = err

        def check(results=results) -> None:
            for mode in ("eager", "compiled"):
                if isinstance(results[mode], Exception):
                    raise results[mode]
            for name, a, b in zip(("out", "grad x", "grad w"), results["compiled"], results["eager"]):
                if not torch.equal(a, b):
                    raise AssertionError(f"compiled {name} differs from eager")

        checks.run(f"compile/aot_eager fullgraph/{label}", check)


def check_module(checks: _Checks, buf: ElasticBuffer, cfg: dict[str, Any]) -> None:
    from ..nn import MoEDispatcher

    rank, device = cfg["rank"], cfg["device"]
    e, n = cfg["experts"], cfg["world"]
    epr = e // n
    prob = _exact_problem(cfg, rank, 13)
    dense = _dense(prob)
    v = prob["all"][rank]
    scale = prob["scale"]
    experts = [(lambda a, c=float(scale[rank * epr + i]): a * c) for i in range(epr)]
    for layout in ("rank", "expert"):
        x = v["x"].to(device).clone().requires_grad_(True)
        w = v["w"].to(device).clone().requires_grad_(True)
        out = MoEDispatcher(buf, e, layout=layout, expert_alignment=4)(x, v["idx"].to(device), w, experts)
        (out.float() * v["g"].to(device)).sum().backward()

        def check(out=out, x=x, w=w) -> None:
            for name, got, want in (
                ("out", out, dense["out"][rank]),
                ("grad x", x.grad, dense["gx"][rank]),
                ("grad w", w.grad, dense["gw"][rank]),
            ):
                if not torch.equal(got.detach().double().cpu(), want):
                    raise AssertionError(f"MoEDispatcher {name} differs from the dense computation")

        checks.run(f"module/MoEDispatcher/{layout} layout", check)


# --------------------------------------------------------------------------------------------------------------------
# planner and domains: the buffers answer with ep-core's planner under their policy


def check_planner(checks: _Checks, buffers: dict[str, ElasticBuffer], cfg: dict[str, Any]) -> None:
    from ep_core import planner
    from ep_core.topology import Topology

    n = cfg["world"]
    hint = ElasticBuffer.get_buffer_size_hint(
        dist.group.WORLD, cfg["tokens"], cfg["hidden"], num_topk=cfg["topk"]
    )
    hint_v25 = EPBuffer.get_buffer_size_hint(
        dist.group.WORLD, cfg["tokens"], cfg["hidden"], num_topk=cfg["topk"]
    )

    def check() -> None:
        el, ep = buffers["Elastic"], buffers["EP-deterministic-single-reduction"]
        assert type(el).policy is planner.PlannerPolicy.V2 and type(ep).policy is planner.PlannerPolicy.V2_5
        topo = el.runtime.topology
        assert topo.num_ranks == n
        assert el.get_physical_domain_size() == topo.physical_domain_size
        assert el.get_logical_domain_size() == topo.logical_domain_size
        assert (el.num_scaleout_ranks, el.num_scaleup_ranks) == topo.logical_domain_size
        assert el.scaleup_rank_idx == cfg["rank"] % el.num_scaleup_ranks
        want = planner.get_buffer_size_hint(
            Topology(n, topo.num_nvlink_ranks, True), cfg["tokens"], cfg["hidden"], cfg["topk"]
        )
        assert hint == hint_v25 == want and hint % (2 << 20) == 0, (hint, hint_v25, want)
        assert el.num_bytes == want, "the constructor sizes the buffer with the hint"
        for buf in (el, ep):
            ex = buf.runtime.executor
            for e, k in ((8 * n, 4), (256 if n <= 8 else 32 * n, 8)):
                got = buf.get_theoretical_num_sms(e, k)
                ref = planner.get_theoretical_num_sms(
                    topo,
                    e,
                    k,
                    num_device_sms=ex.num_device_sms,
                    nvlink_gbs=getattr(ex, "nvlink_gbs", None),
                    rdma_gbs=getattr(ex, "rdma_gbs", None),
                    prefer_overlap_with_compute=buf.prefer_overlap_with_compute,
                    policy=type(buf).policy,
                )
                assert got == ref, (type(buf).__name__, e, k, got, ref)
            assert buf.get_theoretical_num_qps(4) == planner.get_theoretical_num_qps(
                topo, 4, buf.num_allocated_qps
            )

    checks.run("planner/buffers use ep-core's planner with their policy", check)

    def placement() -> None:
        # the copy epilogue's SMs follow prefer_overlap_with_compute (GPU executors only: the reference has none)
        for buf in buffers.values():
            rank = getattr(buf.runtime.executor, "rank", None)
            if rank is None:
                continue
            ex = buf.runtime.executor
            want = 0 if buf.prefer_overlap_with_compute else ex.num_device_sms
            assert rank.epilogue_sms == want, (type(buf).__name__, rank.epilogue_sms, want)

    checks.run("planner/the copy epilogue's SMs follow prefer_overlap_with_compute", placement)


# --------------------------------------------------------------------------------------------------------------------
# CUDA only: streams, events, CUDA-graph capture


def check_cuda(checks: _Checks, buffers: dict[str, ElasticBuffer], cfg: dict[str, Any]) -> None:
    from ..cuda_graph import CapturedStep

    rank, n, device = cfg["rank"], cfg["world"], cfg["device"]
    m, hidden, e, k = cfg["tokens"], cfg["hidden"], cfg["experts"], cfg["topk"]
    buf = buffers["EP-deterministic-single-reduction"]
    inputs = _inputs("masked", n, m, hidden, e, k, False, 99)
    x = _torch_x(inputs, rank, device)
    idx = torch.from_numpy(inputs.topk_idxs[rank]).to(device)
    w = torch.from_numpy(inputs.topk_weights[rank]).to(device)

    def streams() -> None:
        comm = buf.get_comm_stream()
        assert comm is not None and comm is buffers["Elastic"].get_comm_stream(), (
            "one comm stream per process"
        )
        assert comm.priority <= torch.cuda.Stream().priority, "the comm stream has high priority"

    checks.run("cuda/comm stream", streams)

    # async dispatch + combine: events, then the results equal the synchronous ones
    sync = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=e)
    sync_out = buf.combine(sync[0], sync[3])[0]
    prev = buf.capture()
    a_x, _, _, a_h, a_ev = buf.dispatch(
        x,
        topk_idx=idx,
        topk_weights=w,
        num_experts=e,
        async_with_compute_stream=True,
        allocate_on_comm_stream=True,
        previous_event=prev,
    )
    a_ev.current_stream_wait()
    a_out, _, c_ev = buf.combine(a_x, a_h, async_with_compute_stream=True)
    c_ev.current_stream_wait()
    torch.cuda.synchronize()

    def events() -> None:
        assert a_ev.event is not None and not a_ev.event.is_cpu, "async dispatch returns a CUDA event"
        _same("async recv_x", a_x, _bits(sync[0]))
        _same("async combined_x", a_out, _bits(sync_out))

    checks.run("cuda/async events", events)

    # CUDA graph: a no-sync dispatch + combine captured once, replayed on new inputs, equals eager mode
    def step(xx: torch.Tensor, ii: torch.Tensor, ww: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rx, _, _, hh, _ = buf.dispatch(xx, topk_idx=ii, topk_weights=ww, num_experts=e, do_cpu_sync=False)
        out, _, _ = buf.combine(rx, hh)
        return hh.psum_num_recv_tokens_per_scaleup_rank, out

    fresh = _inputs("unbalanced", n, m, hidden, e, k, False, 100)
    x2 = _torch_x(fresh, rank, device)
    if x2.shape[0] != x.shape[0]:
        x2 = x2[: x.shape[0]] if x2.shape[0] > x.shape[0] else torch.cat([x2, x[x2.shape[0] :]])
    i2 = torch.from_numpy(fresh.topk_idxs[rank]).to(device)[: x.shape[0]]
    if i2.shape[0] < x.shape[0]:
        i2 = torch.cat([i2, idx[i2.shape[0] :]])
    w2 = torch.ones(i2.shape, dtype=torch.float32, device=device)
    error: Exception | None = None
    try:
        graph = CapturedStep(step, x, idx, w)
        _, g_out = graph(x2.contiguous(), i2.contiguous(), w2)
        g_out = g_out.clone()
    except Exception as exc:  # keep the ranks in step, report below
        error = exc
    _, e_out = step(x2.contiguous(), i2.contiguous(), w2)
    torch.cuda.synchronize()

    def graphs() -> None:
        if error is not None:
            raise error
        _same("graph-replayed combine", g_out, _bits(e_out))

    checks.run("cuda/graph capture and replay", graphs)

    def capture_refuses_cpu_sync() -> None:
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g):
                buf.dispatch(x, topk_idx=idx, num_experts=e)
        except ValueError as exc:
            assert "do_cpu_sync" in str(exc)
            return
        raise AssertionError("a CPU-synchronizing dispatch was accepted inside CUDA-graph capture")

    checks.run("cuda/capture refuses cpu sync", capture_refuses_cpu_sync)


# --------------------------------------------------------------------------------------------------------------------
# driver


def check_transport(checks: _Checks, buf: ElasticBuffer, cfg: dict[str, Any], size: dict[str, Any]) -> None:
    """The automatic choice agrees with the group (``cfg["expect_transport"]`` / ``["expect_comm"]`` when the
    caller knows the machine), and a buffer destroyed collectively, which may borrow the group's NCCL
    communicator, passes every dispatch/combine mode."""
    choice = buf.transport_choice
    checks.results.append((f"transport/chosen {choice.name}", True, choice.reason))

    def expected() -> None:
        want = cfg.get("expect_transport") or (
            "reference" if cfg["device"].type == "cpu" else size["transport"] or choice.name
        )
        assert choice.name == want, f"transport {choice.name!r} ({choice.reason}), expected {want!r}"
        assert choice.device.type == cfg["device"].type
        if choice.name == "nccl":
            assert choice.communicator == "own", (
                "explicitly_destroy=False must not borrow the group communicator"
            )

    checks.run("transport/automatic choice", expected)
    owned = type(buf)(buf.group, explicitly_destroy=True, **size)
    try:

        def communicator() -> None:
            want = cfg.get("expect_comm")
            got = owned.transport_choice.communicator
            assert want is None or got == want, (
                f"communicator {got!r} ({owned.transport_choice.reason}), expected {want!r}"
            )

        checks.run("transport/communicator of a collectively destroyed buffer", communicator)
        checks.run("transport/reset (collective) leaves a working buffer", owned.reset)
        check_modes(checks, {"destroyed-collectively": owned}, {**cfg, "seed": cfg["seed"] + 7919})
    finally:
        owned.destroy()


SCENARIOS = ("modes", "errors", "autograd", "compile", "module", "planner", "cuda", "transport")


def run_all(rank: int, world: int, cfg: dict[str, Any]) -> list[Result]:
    """Run the scenarios named in ``cfg["scenarios"]`` on this rank; returns the results."""
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if str(cfg.get("backend", "cpu")).startswith("cuda")
        else torch.device("cpu")
    )
    cfg = {
        "tokens": 12,
        "hidden": 64,
        "experts": 8 * world,
        "topk": 4,
        "seed": 1,
        **cfg,
        "rank": rank,
        "world": world,
        "device": device,
    }
    transport = cfg.get("transport") or ("ipc" if cfg.get("backend") == "cuda-shared" else None)
    group = dist.group.WORLD
    size = {
        "num_max_tokens_per_rank": cfg["tokens"],
        "hidden": cfg["hidden"],
        "num_topk": cfg["topk"],
        "transport": transport,
    }
    if "prefer_overlap_with_compute" in cfg:  # False: each rank's copy epilogue on its share of the GPU
        size["prefer_overlap_with_compute"] = bool(cfg["prefer_overlap_with_compute"])
    buffers = {
        "Elastic": ElasticBuffer(group, **size),
        "EP-deterministic-single-reduction": EPBuffer(
            group, deterministic=True, allow_multiple_reduction=False, **size
        ),
    }
    checks = _Checks()
    wanted = cfg.get("scenarios") or SCENARIOS
    if "modes" in wanted:
        check_modes(checks, buffers, cfg)
        check_stats(checks, buffers["Elastic"], cfg)
    if "errors" in wanted:
        check_errors(checks, buffers["Elastic"], buffers["EP-deterministic-single-reduction"], cfg)
    if "autograd" in wanted:
        check_autograd(checks, buffers, cfg)
    if "compile" in wanted:
        check_compile(checks, buffers["Elastic"], cfg)
    if "module" in wanted:
        check_module(checks, buffers["Elastic"], cfg)
    if "planner" in wanted:
        check_planner(checks, buffers, cfg)
    if "cuda" in wanted and device.type == "cuda":
        check_cuda(checks, buffers, cfg)
    if "transport" in wanted:
        check_transport(checks, buffers["Elastic"], cfg, size)
    dist.barrier()
    return checks.results


def _worker(rank: int, world: int, cfg: dict[str, Any], out_dir: str) -> None:
    if str(cfg.get("backend", "cpu")).startswith("cuda"):
        # ranks sharing one GPU have no NVLink to detect: give the planner a bandwidth (HBM-class) unless set
        os.environ.setdefault("EPKIT_NVLINK_GBS", "450")
    results = run_all(rank, world, cfg)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


def run_spawned(ranks: int, cfg: dict[str, Any]) -> list[list[Result]]:
    """Spawn ``ranks`` processes (gloo, or nccl with ``cfg["backend"] == "cuda"``) and return every rank's results."""
    from ..launch import spawn

    with tempfile.TemporaryDirectory(prefix="ep-torch-conformance-") as out_dir:
        spawn(_worker, ranks, cfg, out_dir, backend="nccl" if cfg.get("backend") == "cuda" else "gloo")
        # "cuda-shared": a gloo group whose ranks all use this machine's current GPU (NCCL refuses two ranks on
        # one GPU), driving the GPU kernels over the ipc transport
        out = []
        for r in range(ranks):
            with open(os.path.join(out_dir, f"rank{r}.json")) as f:
                out.append([tuple(x) for x in json.load(f)])
        return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m ep_torch.testing.conformance", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument(
        "--backend",
        choices=("cpu", "cuda", "cuda-shared"),
        default="cpu",
        help="cpu: gloo + reference backend; cuda: nccl, one GPU per rank; cuda-shared: gloo, every rank on GPU 0 (ipc)",
    )
    p.add_argument("--transport", choices=("reference", "ipc", "nccl"), default=None)
    p.add_argument("--scenarios", nargs="*", choices=SCENARIOS, default=list(SCENARIOS))
    args = p.parse_args(argv)
    cfg = {"backend": args.backend, "transport": args.transport, "scenarios": args.scenarios}
    per_rank = run_spawned(args.ranks, cfg)
    failed = 0
    by_rank = [{n: (o, d) for n, o, d in res} for res in per_rank]
    for name, _, _ in per_rank[0]:
        bad = [r for r, res in enumerate(by_rank) if not res.get(name, (False, ""))[0]]
        if bad:
            failed += 1
            print(
                f"FAIL {name} (ranks {bad})\n{by_rank[bad[0]].get(name, (False, 'missing on this rank'))[1]}"
            )
    total = len(per_rank[0])
    print(f"{total - failed}/{total} checks passed on {args.ranks} ranks ({args.backend})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
