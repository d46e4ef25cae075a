"""Conformance ``modes``: SPEC §9 on the torch surface against ``ep_core.reference`` (every dispatch/combine
mode, events, zero-copy, ``cumulative_local_expert_recv_stats``; ``conformance`` module doc)."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import torch
from ep_core import reference
from ep_torch._convert import from_numpy
from ep_torch.buffer import ElasticBuffer
from ep_torch.event import EventOverlap

from ._common import (
    ROUTINGS,
    _as_output,
    _bits,
    _Checks,
    _combine_input,
    _compare_dispatch,
    _inputs,
    _rng_bf16,
    _same,
    _torch_x,
)


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
            deterministic=buf.deterministic,
            **common,
        )
        ref = refs[rank]
        ref_handles = [o.handle for o in refs]
        x = _torch_x(inputs, rank, device)
        idx = torch.from_numpy(inputs.topk_idxs[rank]).to(device)
        w = torch.from_numpy(inputs.topk_weights[rank]).to(device)
        # the arguments of this mode's dispatches (the ordinary one, then the zero-copy one below)
        call = {
            "topk_idx": idx,
            "topk_weights": w,
            "do_cpu_sync": sync,
            "allocate_on_comm_stream": alloc_comm,
            "async_with_compute_stream": async_,
            "do_handle_copy": bool(seed % 2),
            **common,
        }
        prev = buf.capture() if with_prev else None
        recv_x, recv_idx, recv_w, handle, event = buf.dispatch(
            x, use_tma_aligned_col_major_sf=col_major, previous_event=prev, **call
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
                x, previous_event=z_prev, zero_copy=True, **call
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
