"""Conformance ``errors``: the bad-input table of SPEC §6 (type, message fragment), and a bad input on one
rank only."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from ep_core.errors import EPError
from ep_torch import functional
from ep_torch.buffer import ElasticBuffer
from ep_torch.event import EventHandle

from ._common import _Checks

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
