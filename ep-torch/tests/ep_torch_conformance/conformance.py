"""Conformance checks of the torch API against ``ep_core.reference``, runnable on any backend.

Every rank regenerates all ranks' inputs from one seed (``ep_core.routing.make_inputs``), runs the reference over
them locally, calls the torch API with its own slice and compares bit for bit. Checks, each in the module named for
it: ``modes`` (SPEC §9's modes on the torch surface, events, stats, zero-copy in one NVLink domain), ``errors``
(``bad_inputs``: SPEC §6's table, a bad input on one rank only), ``autograd`` / ``compile`` / ``module``
(``autograd``: exact against a dense computation), ``planner``, ``cuda`` (CUDA only), and ``transport`` (here: the
choice with a collectively destroyed buffer); ``_common`` holds the shared helpers.

``run_all(...)`` returns ``[(name, ok, detail)]``; a check's failure never skips the collectives of the others, so
ranks stay in step. Command line, from ``ep-torch/tests`` of a checkout (not in the wheel):
``python -m ep_torch_conformance.conformance --ranks 4 [--backend cuda]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from ep_torch.buffer import ElasticBuffer, EPBuffer

from ._common import Result, _Checks
from .autograd import check_autograd, check_compile, check_module
from .bad_inputs import check_errors
from .cuda import check_cuda
from .modes import check_modes, check_stats
from .planner import check_planner

__all__ = ["SCENARIOS", "main", "run_all"]


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
    from ep_torch.launch import spawn

    # the fresh interpreters import this package by name (`_worker`): its folder on the path they inherit
    folder = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if folder not in sys.path:
        sys.path.insert(0, folder)
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
        prog="python -m ep_torch_conformance.conformance", description=__doc__.split("\n\n")[0]
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
