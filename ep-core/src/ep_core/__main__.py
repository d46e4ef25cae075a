"""`python -m ep_core compile ...`: prebuild the JIT cache of one configuration (ep_core.prebuild)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from ep_core.errors import EPConfigError, EPValueError

EXIT_OK, EXIT_BUILD_FAILED, EXIT_CONFIG = 0, 1, 2


def _packs(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ep_core", description="ep_core tools.")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser(
        "compile",
        help="prebuild the JIT cache for one configuration (no GPU needed)",
        description="Compile every kernel instance the runtime can launch for this configuration into the ep-jit "
        "cache (EPKIT_JIT_CACHE_DIR). do_expand, deterministic, cached/CPU-sync dispatch, alignment, biases, "
        "num_experts and num_sms are kernel arguments: one instance serves them all.",
    )
    c.add_argument("--num-ranks", type=int, required=True)
    c.add_argument("--num-scaleup-ranks", type=int, default=None, help="ranks per node (default: num-ranks)")
    c.add_argument(
        "--no-hybrid",
        action="store_true",
        help="allow_hybrid_mode=False: several nodes run direct mode across nodes (puts to every remote rank)",
    )
    c.add_argument("--hidden", type=int, required=True)
    c.add_argument("--num-topk", type=int, required=True)
    c.add_argument("--num-experts", type=int, required=True)
    c.add_argument("--fp8", action="store_true", help="also the FP8 dispatch instances")
    c.add_argument(
        "--num-sf-packs",
        type=_packs,
        default=None,
        help="FP8 scale packs per token, comma-separated (default: ceil(H/128) FP32 and ceil(H/512) UE8M0)",
    )
    c.add_argument("--transport", choices=("ipc", "nccl"), default="ipc")
    c.add_argument(
        "--arch", default="sm_90a", help="GPU arch the runtime will detect (default sm_90a: H100/H200)"
    )
    c.add_argument(
        "--num-warps", type=int, default=None, help="warps per block, part of the key (default: auto)"
    )
    c.add_argument(
        "--num-sms",
        type=int,
        default=0,
        help="SMs per launch; reported only, not part of the JIT key (default: planner)",
    )
    c.add_argument(
        "--device-sms", type=int, default=132, help="SMs of the target GPU for the planner (default 132)"
    )
    c.add_argument(
        "--nvlink-gbs", type=float, default=None, help="NVLink GB/s per GPU for the planner (default: detect)"
    )
    return p


def _mode(instances: list) -> str:
    c = instances[0].config
    if c.is_direct_xnode:
        return f"direct mode across nodes: {c.num_nodes} nodes x {c.num_nvlink_ranks}, scale-out put {c.scaleout}"
    if not c.is_hybrid:
        return "direct mode"
    return f"hybrid mode: {c.num_nodes} nodes x {c.num_scaleup_ranks}, scale-out put {c.scaleout}"


def _compile(args: argparse.Namespace) -> int:
    import ep_jit

    from ep_core import prebuild
    from ep_core.kernels._source import jit_switches

    try:
        instances = prebuild.plan_instances(
            num_ranks=args.num_ranks,
            num_scaleup_ranks=args.num_scaleup_ranks,
            hidden=args.hidden,
            num_topk=args.num_topk,
            num_experts=args.num_experts,
            fp8=args.fp8,
            num_sf_packs=args.num_sf_packs,
            transport=args.transport,
            num_warps=args.num_warps,
            allow_hybrid_mode=not args.no_hybrid,
        )
        if args.num_sms:
            if not 1 <= args.num_sms <= args.device_sms:
                raise EPValueError(f"num_sms: expected 1..{args.device_sms} (device SMs), got {args.num_sms}")
            sms, source = args.num_sms, "given"
        else:
            sms, source = prebuild.planned_num_sms(
                args.num_ranks, args.num_experts, args.num_topk, args.device_sms, args.nvlink_gbs
            )
        switches = jit_switches(instances[0].config)[0]  # from the environment, part of every instance's key
    except (EPConfigError, EPValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    print(f"ep_core prebuild: cache {ep_jit.cache().root}, arch {args.arch}, transport {args.transport}")
    print(
        f"  num_ranks={args.num_ranks} ({_mode(instances)}), hidden={args.hidden}, num_topk={args.num_topk}, "
        f"num_experts={args.num_experts}, fp8={args.fp8}"
    )
    print(f"  num_sms={sms} ({source}; a launch parameter, not part of the JIT key)")
    print(
        "  switches "
        + " ".join(f"{k}={v}" for k, v in switches.items())
        + " (from the environment; the runtime builds the same only under the same values)"
    )
    print(f"  {len(instances)} instance(s), each with kernels {', '.join(prebuild.KERNEL_NAMES)}")

    def report(b: prebuild.BuiltInstance) -> None:
        c = b.planned.config
        state = "cached" if b.from_cache else "built"
        print(
            f"  {state:6} {b.seconds:7.2f}s  key {b.key[:12]}  elem={c.elem_size} sf_packs={c.num_sf_packs} "
            f"warps={c.num_warps}  used by: {', '.join(b.planned.uses)}\n           {b.path}"
        )

    t0 = time.perf_counter()
    try:
        built = prebuild.prebuild(instances, arch=args.arch, on_built=report)
    except (ep_jit.JitError, EPConfigError, ValueError, OSError, ImportError) as e:
        print(f"error: build failed: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_BUILD_FAILED
    n_new = sum(not b.from_cache for b in built)
    print(
        f"ok: {len(built)} instance(s) ready ({n_new} built, {len(built) - n_new} cached) in {time.perf_counter() - t0:.1f}s"
    )
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return {"compile": _compile}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
