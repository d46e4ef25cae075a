"""Conformance ``autograd``, ``compile`` and ``module``: ``ep_torch.functional``, ``torch.compile`` and
``ep_torch.nn.MoEDispatcher`` against a dense computation whose arithmetic is exact in bf16."""

from __future__ import annotations

from typing import Any

import torch
from ep_torch import functional
from ep_torch.buffer import ElasticBuffer

from ._common import _Checks

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
    from ep_torch.nn import MoEDispatcher

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
