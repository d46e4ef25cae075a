"""ep-demo: train a small MoE layer over N ranks through dispatch/combine and check it against a dense computation.

Every rank holds a replicated router, E/N SiLU-MLP experts and one fixed batch with a regression target. A step
routes the tokens (top-k, softmax over the chosen k), dispatches them, runs the local experts, combines the weighted
outputs back, and takes an SGD step after backward through combine and dispatch (router gradient all-reduced): the
loss must go down. Rank 0 recomputes the layer densely in float64 and compares the output and every gradient.
Defaults run on CPU processes with gloo in well under a minute; ``--backend cuda`` runs one rank per GPU on nccl.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DemoConfig", "dense_reference", "main", "run"]


@dataclass
class DemoConfig:
    ranks: int = 4
    tokens: int = 96
    hidden: int = 256
    ffn: int = 128
    experts: int = 16
    topk: int = 4
    steps: int = 8
    lr: float = 0.5
    backend: str = "cpu"
    buffer: str = "ElasticBuffer"
    seed: int = 0
    tolerance: float = 2e-2
    progress: bool = True
    threads: int = 1
    result_path: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------------------------------
# the layer


def init_params(cfg: DemoConfig) -> dict[str, torch.Tensor]:
    """Deterministic parameters (identical on every rank): router [H, E], w1 [E, H, F], w2 [E, F, H]."""
    g = torch.Generator().manual_seed(cfg.seed)
    h, f, e = cfg.hidden, cfg.ffn, cfg.experts
    return {
        "router": torch.randn(h, e, generator=g) / math.sqrt(h),
        "w1": torch.randn(e, h, f, generator=g) / math.sqrt(h),
        "w2": torch.randn(e, f, h, generator=g) / math.sqrt(f),
    }


def num_tokens_of(cfg: DemoConfig, rank: int) -> int:
    """Tokens of ``rank``: unequal across ranks (the last ranks have fewer), never above ``cfg.tokens``."""
    return max(1, cfg.tokens - (rank * cfg.tokens) // (4 * max(1, cfg.ranks)))


def step_inputs(cfg: DemoConfig, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's tokens (bf16) and regression target (float32: a fixed random teacher map of x) at ``step``."""
    g = torch.Generator().manual_seed(1_000_003 * (cfg.seed + 1) + 7919 * step + rank)
    t = num_tokens_of(cfg, rank)
    x = torch.randn(t, cfg.hidden, generator=g).bfloat16()
    teacher = torch.randn(cfg.hidden, cfg.hidden, generator=torch.Generator().manual_seed(cfg.seed + 17))
    target = torch.tanh(x.float() @ teacher / math.sqrt(cfg.hidden))
    return x, target


def loss_scale(cfg: DemoConfig) -> float:
    """The loss is ``scale * sum((out - target)^2)`` over all tokens of all ranks (a mean-squared error)."""
    return 1.0 / (cfg.ranks * cfg.tokens * 2)


def route(x: torch.Tensor, router: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts of each token and their softmax weights (differentiable in x and router)."""
    scores = x.to(router.dtype) @ router
    top, idx = scores.topk(k, dim=1)
    return idx, torch.softmax(top, dim=1)


def expert_forward(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(x @ w1) @ w2


def dense_reference(
    xs: list[torch.Tensor],
    idxs: list[torch.Tensor],
    targets: list[torch.Tensor],
    params: dict[str, torch.Tensor],
    scale: float,
) -> dict[str, Any]:
    """The same layer on one process in float64 with the given routing: outputs and gradients."""
    p = {k: v.detach().double().requires_grad_(True) for k, v in params.items()}
    x = torch.cat([a.double() for a in xs]).requires_grad_(True)
    idx = torch.cat(idxs)
    scores = x @ p["router"]
    w = torch.softmax(scores.gather(1, idx), dim=1)
    out = torch.zeros_like(x)
    for e in range(p["w1"].shape[0]):
        rows, lanes = (idx == e).nonzero(as_tuple=True)
        if rows.numel():
            h = expert_forward(x[rows], p["w1"][e], p["w2"][e])
            out = out.index_add(0, rows, h * w[rows, lanes].unsqueeze(1))
    loss = scale * ((out - torch.cat(targets).double()) ** 2).sum()
    loss.backward()
    return {
        "out": out.detach(),
        "loss": float(loss.detach()),
        "x": x.grad,
        **{k: v.grad for k, v in p.items()},
    }


# --------------------------------------------------------------------------------------------------------------------
# one rank


def _worker(rank: int, world: int, cfg: DemoConfig) -> None:
    from . import functional
    from .buffer import ElasticBuffer, EPBuffer
    from .nn import apply_local_experts

    on_gpu = cfg.backend in ("cuda", "cuda-shared")
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    if cfg.backend == "cuda-shared":
        # ranks sharing one GPU have no NVLink to detect: give the planner a bandwidth unless set
        os.environ.setdefault("EPKIT_NVLINK_GBS", "450")
    cls = EPBuffer if cfg.buffer == "EPBuffer" else ElasticBuffer
    buffer = cls(
        dist.group.WORLD,
        num_max_tokens_per_rank=cfg.tokens,
        hidden=cfg.hidden,
        num_topk=cfg.topk,
        explicitly_destroy=True,
        transport="ipc" if cfg.backend == "cuda-shared" else None,
    )
    epr = cfg.experts // world
    full = init_params(cfg)
    router = full["router"].to(device).requires_grad_(True)
    w1 = full["w1"][rank * epr : (rank + 1) * epr].clone().to(device).requires_grad_(True)
    w2 = full["w2"][rank * epr : (rank + 1) * epr].clone().to(device).requires_grad_(True)
    experts = [(lambda a, e=e: expert_forward(a, w1[e], w2[e])) for e in range(epr)]
    num_sms = buffer.get_theoretical_num_sms(cfg.experts, cfg.topk)
    if rank == 0:
        _say(f"{world} ranks up, buffer ready; loading torch's custom-op machinery")

    importlib.import_module("torch._dynamo")  # the custom ops import it on first use: keep that out of step 0
    if rank == 0 and on_gpu:
        _say(
            "the first step JIT-compiles the GPU kernels (nvcc) unless the ep-jit cache has them; "
            "`python -m ep_core compile` prebuilds it"
        )
    elif rank == 0:
        _say(f"training {cfg.steps} steps")

    progress = _Progress(cfg) if rank == 0 else None
    rows: list[dict[str, Any]] = []
    worst = 0.0
    batch, batch_target = step_inputs(cfg, 0, rank)  # this rank's batch, fitted step after step
    for step in range(cfg.steps):
        x, target = batch.clone().to(device).requires_grad_(True), batch_target.to(device)
        params_before = {
            "router": router.detach().cpu().clone(),
            "w1": w1.detach().cpu().clone(),
            "w2": w2.detach().cpu().clone(),
        }
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        topk_idx, topk_w = route(x, router, cfg.topk)
        recv_x, recv_idx, recv_w, handle = functional.dispatch(
            buffer, x, topk_idx, topk_w, num_experts=cfg.experts
        )
        y = apply_local_experts(recv_x, recv_idx, recv_w, experts)
        out = functional.combine(buffer, y, handle)
        loss = loss_scale(cfg) * ((out.float() - target) ** 2).sum()
        loss.backward()
        for p in (router, w1, w2):  # a rank whose experts received nothing has no expert gradient
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        dist.all_reduce(router.grad)
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0

        h = functional.get_handle(handle)
        sent = int((h.dst_buffer_slot_idx >= 0).sum())
        received = int(h.num_recv_tokens)
        k = cfg.topk
        # payload moved by this rank in the four exchanges (dispatch, combine, and their backward passes)
        row_bytes = cfg.hidden * 2
        moved = 2 * sent * (row_bytes + k * 12) + 2 * received * (row_bytes + k * 4)
        stats = {
            "rank": rank,
            "loss": float(loss.detach()),
            "sent": sent,
            "received": received,
            "time": elapsed,
            "bytes": moved,
        }
        check = {
            "x": x.detach().cpu(),
            "idx": topk_idx.cpu(),
            "target": target.cpu(),
            "out": out.detach().cpu(),
            "gx": x.grad.cpu(),
            "gw1": w1.grad.cpu(),
            "gw2": w2.grad.cpu(),
            "grouter": router.grad.cpu(),
            "params": params_before,
        }
        gathered: list[Any] = [None] * world if rank == 0 else []
        dist.gather_object((stats, check), gathered if rank == 0 else None, dst=0)
        with torch.no_grad():
            for p in (router, w1, w2):
                p -= cfg.lr * p.grad
                p.grad = None
        if rank == 0:
            row = _check_step(cfg, step, gathered)
            worst = max(worst, row["error"])
            rows.append(row)
            progress.advance(row)
    if rank == 0:
        progress.close()
        losses = [r["loss"] for r in rows]
        trained = len(losses) < 2 or losses[-1] < losses[0]
        summary = {
            "ok": all(r["ok"] for r in rows) and trained,
            "trained": trained,
            "max_error": worst,
            "steps": rows,
            "config": asdict(cfg),
            "buffer": repr(buffer),
            "num_sms": num_sms if on_gpu else None,  # the planner's figure means nothing on the CPU backend
        }
        _print_summary(cfg, summary)
        if cfg.result_path:
            with open(cfg.result_path, "w") as f:
                json.dump(summary, f)
    buffer.destroy()


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = float(want.abs().max()) or 1.0
    return float((got.double() - want.double()).abs().max()) / scale


def _check_step(cfg: DemoConfig, step: int, gathered: list[Any]) -> dict[str, Any]:
    stats = [s for s, _ in gathered]
    checks = [c for _, c in gathered]
    world = len(checks)
    params = {
        "router": checks[0]["params"]["router"],
        "w1": torch.cat([c["params"]["w1"] for c in checks]),
        "w2": torch.cat([c["params"]["w2"] for c in checks]),
    }
    ref = dense_reference(
        [c["x"] for c in checks],
        [c["idx"] for c in checks],
        [c["target"] for c in checks],
        params,
        loss_scale(cfg),
    )
    errors = {
        "out": _rel_err(torch.cat([c["out"] for c in checks]), ref["out"]),
        "grad_x": _rel_err(torch.cat([c["gx"] for c in checks]), ref["x"]),
        "grad_router": _rel_err(checks[0]["grouter"], ref["router"]),
        "grad_w1": _rel_err(torch.cat([c["gw1"] for c in checks]), ref["w1"]),
        "grad_w2": _rel_err(torch.cat([c["gw2"] for c in checks]), ref["w2"]),
    }
    abs_err = float((torch.cat([c["out"] for c in checks]).double() - ref["out"]).abs().max())
    error = max(errors.values())
    t = max(s["time"] for s in stats)
    return {
        "step": step,
        "loss": sum(s["loss"] for s in stats),
        "dense_loss": ref["loss"],
        "sent": [s["sent"] for s in stats],
        "received": [s["received"] for s in stats],
        "time_ms": 1e3 * t,
        "gbps": sum(s["bytes"] for s in stats) / t / 1e9 if t > 0 else 0.0,
        "max_abs_error_out": abs_err,
        "errors": errors,
        "error": error,
        "ok": error <= cfg.tolerance and all(math.isfinite(v) for v in errors.values()),
        "ranks": world,
    }


# --------------------------------------------------------------------------------------------------------------------
# output


def _say(text: str) -> None:
    """A status line of the parent or rank 0, flushed so that a log shows it when it happens."""
    print(f"ep-demo: {text}", flush=True)


class _Progress:
    """A rich progress bar when rich is installed (``pip install ep-torch[demo]``), plain lines otherwise."""

    def __init__(self, cfg: DemoConfig) -> None:
        self.cfg = cfg
        self._bar = None
        if cfg.progress:
            try:
                from rich.progress import (
                    BarColumn,
                    MofNCompleteColumn,
                    Progress,
                    TextColumn,
                    TimeElapsedColumn,
                )

                self._bar = Progress(
                    TextColumn("[bold]ep-demo"),
                    BarColumn(),
                    MofNCompleteColumn(),
                    TextColumn("{task.description}"),
                    TimeElapsedColumn(),
                )
                self._bar.start()
                self._task = self._bar.add_task("steps", total=cfg.steps)
            except ImportError:
                self._bar = None

    def advance(self, row: dict[str, Any]) -> None:
        text = f"step {row['step']}: max rel err {row['error']:.2e} {'ok' if row['ok'] else 'FAIL'}"
        if self._bar is not None:
            self._bar.update(self._task, advance=1, description=text)
        elif self.cfg.progress:
            print(f"[{row['step'] + 1}/{self.cfg.steps}] {text}", flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def _print_summary(cfg: DemoConfig, summary: dict[str, Any]) -> None:
    # Plain lines, each under 100 columns with the default sizes, printed before the table rather than as its title:
    # rich wraps a title to the table's width, which breaks it mid-phrase in a log (not a terminal).
    sms = f", planner SMs {summary['num_sms']}" if summary["num_sms"] is not None else ""
    head = [
        f"ep-demo: {cfg.ranks} ranks, {cfg.backend} backend, {summary['buffer']}",
        f"  tokens/rank <= {cfg.tokens}, hidden {cfg.hidden}, ffn {cfg.ffn}, top-{cfg.topk} of {cfg.experts} "
        f"experts, {cfg.steps} steps of SGD (lr {cfg.lr:g}) on one batch per rank{sms}",
    ]
    cols = ["step", "loss", "sent/rank", "recv/rank", "ms", "GB/s", "abs err", "rel err", ""]
    body = [
        [
            str(r["step"]),
            f"{r['loss']:.4f}",
            " ".join(map(str, r["sent"])),
            " ".join(map(str, r["received"])),
            f"{r['time_ms']:.1f}",
            f"{r['gbps']:.3f}",
            f"{r['max_abs_error_out']:.2e}",
            f"{r['error']:.2e}",
            "ok" if r["ok"] else "FAIL",
        ]
        for r in summary["steps"]
    ]
    losses = [r["loss"] for r in summary["steps"]]
    trend = (
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f} ({'down' if summary['trained'] else 'NOT down'}); "
        if len(losses) > 1
        else ""
    )
    verdict = (
        f"{'PASS' if summary['ok'] else 'FAIL'}: {trend}max relative error {summary['max_error']:.3e} "
        f"(output and gradients of x, router, experts vs dense float64; tolerance {cfg.tolerance:g})"
    )
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table()
        for c in cols:
            table.add_column(c, justify="right")
        for r in body:
            table.add_row(*r)
        # a log is not a terminal: a fixed width there, so the table never depends on the environment's COLUMNS
        console = Console(width=max(100, Console().width) if sys.stdout.isatty() else 100)
        for line in head:
            console.print(line, markup=False, highlight=False, soft_wrap=True)
        console.print(table)
        console.print(f"[bold {'green' if summary['ok'] else 'red'}]{verdict}", soft_wrap=True)
    except ImportError:
        print("\n".join(head))
        widths = [max(len(c), *(len(r[i]) for r in body)) for i, c in enumerate(cols)]
        print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
        for r in body:
            print("  ".join(v.rjust(w) for v, w in zip(r, widths)))
        print(verdict)
    sys.stdout.flush()


# --------------------------------------------------------------------------------------------------------------------
# entry points


def run(cfg: DemoConfig) -> dict[str, Any]:
    """Spawn the ranks, run the demo, return rank 0's summary (``summary["ok"]`` is the verdict)."""
    from .launch import spawn

    if cfg.experts % cfg.ranks:
        raise ValueError(f"--experts ({cfg.experts}) must be a multiple of --ranks ({cfg.ranks})")
    if cfg.topk > cfg.experts:
        raise ValueError(f"--topk ({cfg.topk}) must be <= --experts ({cfg.experts})")
    if (cfg.hidden * 2) % 32:
        raise ValueError(f"--hidden ({cfg.hidden}) must be a multiple of 16 (bf16 rows in 32-byte units)")
    if cfg.backend == "cuda-shared" and not torch.cuda.is_available():
        raise ValueError("--backend cuda-shared needs a GPU")
    if cfg.backend == "cuda" and torch.cuda.device_count() < cfg.ranks:
        raise ValueError(
            f"--backend cuda needs one GPU per rank: {cfg.ranks} ranks, {torch.cuda.device_count()} GPUs"
        )
    own_tmp = not cfg.result_path
    if own_tmp:
        fd, cfg.result_path = tempfile.mkstemp(prefix="ep-demo-", suffix=".json")
        os.close(fd)
    _say(
        f"starting {cfg.ranks} ranks ({cfg.backend} backend, torch.distributed over "
        f"{'nccl' if cfg.backend == 'cuda' else 'gloo'})"
    )
    try:
        spawn(
            _worker,
            cfg.ranks,
            cfg,
            backend="nccl" if cfg.backend == "cuda" else "gloo",
            threads_per_rank=cfg.threads,
        )
        with open(cfg.result_path) as f:
            return json.load(f)
    finally:
        if own_tmp:
            os.unlink(cfg.result_path)


def build_parser() -> argparse.ArgumentParser:
    d = DemoConfig()
    p = argparse.ArgumentParser(
        prog="ep-demo",
        description=(
            "Train a small MoE layer (router, top-k, SiLU-MLP experts) on one batch per rank over N ranks through "
            "ep_torch dispatch/combine, forward and backward, and check every step against a dense single-process "
            "float64 computation of the same layer. Prints a per-step table (loss, tokens sent/received per rank, "
            "time, bandwidth) and exits non-zero if any error exceeds the tolerance or the loss does not go down."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("ranks and backend")
    g.add_argument("--ranks", "-n", type=int, default=d.ranks, help="number of ranks (processes) to spawn")
    g.add_argument(
        "--backend",
        choices=("auto", "cpu", "cuda", "cuda-shared"),
        default="auto",
        help="cpu: gloo processes and the CPU reference backend; cuda: one GPU per rank over nccl with "
        "the GPU kernels; cuda-shared: every rank on GPU 0 (gloo bootstrap, ipc transport, GPU kernels); "
        "auto: cuda when there is a GPU per rank, else cpu",
    )
    g.add_argument(
        "--buffer",
        choices=("ElasticBuffer", "EPBuffer"),
        default=d.buffer,
        help="buffer class (planner policy V2 or V2.5)",
    )
    g.add_argument("--threads", type=int, default=d.threads, help="torch threads per rank")
    s = p.add_argument_group("sizes")
    s.add_argument(
        "--tokens",
        "-t",
        type=int,
        default=d.tokens,
        help="max tokens per rank (rank r has tokens - r*tokens/(4*ranks))",
    )
    s.add_argument("--hidden", type=int, default=d.hidden, help="hidden size (multiple of 16)")
    s.add_argument("--ffn", type=int, default=d.ffn, help="expert intermediate size")
    s.add_argument(
        "--experts", "-e", type=int, default=d.experts, help="number of experts (multiple of --ranks)"
    )
    s.add_argument("--topk", "-k", type=int, default=d.topk, help="experts per token")
    r = p.add_argument_group("run")
    r.add_argument("--steps", type=int, default=d.steps, help="training steps")
    r.add_argument("--lr", type=float, default=d.lr, help="SGD learning rate")
    r.add_argument("--seed", type=int, default=d.seed, help="seed of parameters and data")
    r.add_argument(
        "--tolerance",
        type=float,
        default=d.tolerance,
        help="largest accepted error, relative to the largest reference value, per checked tensor",
    )
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.add_argument("--json", metavar="PATH", default="", help="also write the summary as JSON to PATH")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    backend = args.backend
    if backend == "auto":
        backend = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= args.ranks else "cpu"
    # the options named after a field of DemoConfig go there as they are; these three are resolved or renamed
    same = {k: v for k, v in vars(args).items() if k in DemoConfig.__dataclass_fields__}
    cfg = DemoConfig(
        **{**same, "backend": backend, "progress": not args.no_progress, "result_path": args.json}
    )
    try:
        summary = run(cfg)
    except ValueError as e:
        print(f"ep-demo: {e}", file=sys.stderr)
        return 2
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
