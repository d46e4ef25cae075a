"""Where the host time of one ep_core call goes: the steps of the road (validate -> plan -> launch)
timed around their functions, so that a per-call total can be read as a sum.

`breakdown(fn, iters)` patches the functions of `STEPS` with timing wrappers for the duration of the run, calls
`fn` `iters` times and returns one row per step that ran: calls per op call, inclusive and own microseconds per op
call (own = inclusive minus the steps nested in it). A wrapper costs a fraction of a microsecond, which the parent
steps' own time includes; the uninstrumented total is measured separately by the benchmarks that print this.
Used by `bench_host_cpu.py --breakdown` (driver mocked), and with ep_torch's steps before these (`TORCH_STEPS` of
`benchmarks/bench_host_torch.py`) by that benchmark and `benchmarks/bench_host_overhead.py` (the GPU).
"""

from __future__ import annotations

import importlib
import time
from typing import Any

# (label, module, attribute path); a step's own time is its time minus that of the steps called inside it (timed
# on a stack: nesting is what happened, not declared)
STEPS: tuple[tuple[str, str, str], ...] = (
    ("ep_core EPBuffer.dispatch", "ep_core.buffer", "EPBuffer.run_dispatch"),
    ("ep_core EPBuffer.combine", "ep_core.buffer", "EPBuffer.run_combine"),
    ("validate: PreparedOps.dispatch", "ep_core.prepared", "PreparedOps.dispatch"),
    ("validate: PreparedOps.combine", "ep_core.prepared", "PreparedOps.combine"),
    ("validate: describe (pointer, layout)", "ep_core.prepared", "describe"),
    ("validate: describe_all (pointers, layouts)", "ep_core.prepared", "describe_all"),
    ("validate: check_handle", "ep_core.prepared", "checked_fingerprint"),
    ("launch: GpuExecutor.dispatch", "ep_core.kernels.gpu_executor", "GpuExecutor.dispatch"),
    ("launch: GpuExecutor.combine", "ep_core.kernels.gpu_executor", "GpuExecutor.combine"),
    ("handle's topk_idx copy (its allocation)", "ep_core.kernels.gpu_executor", "GpuExecutor._routing_copy"),
    ("plan: DispatchPlan.run", "ep_core.kernels.op_plan", "DispatchPlan.run"),
    ("plan: CombinePlan.run", "ep_core.kernels.op_plan", "CombinePlan.run"),
    ("full path: RankDriver.dispatch", "ep_core.kernels.rank_driver", "RankDriver.dispatch"),
    ("full path: RankDriver.combine", "ep_core.kernels.rank_driver", "RankDriver.combine"),
    ("handle state: RankDriver._check_handle", "ep_core.kernels.rank_driver", "RankDriver._check_handle"),
    ("CPU sync: RankDriver._sync_counts", "ep_core.kernels.rank_driver", "RankDriver._sync_counts"),
    ("handle arrays: one block", "ep_core.kernels.array_block", "int32_block"),
    ("handle arrays: one block, no view", "ep_core.kernels.array_block", "carve"),
    ("outputs: torch.empty", "torch", "empty"),
    ("launches (+ event pairs)", "ep_core.kernels.rank_driver", "RankDriver._launch_prepared"),
    ("a plan's launches (+ event pairs)", "ep_core.kernels.op_plan", "run_launch"),
    ("kept plan: DispatchPlan.__call__", "ep_core.kernels.op_plan", "DispatchPlan.__call__"),
    ("kept plan: CombinePlan.__call__", "ep_core.kernels.op_plan", "CombinePlan.__call__"),
    ("new EPHandle", "ep_core.kernels.op_plan", "EPHandle"),
    ("new EPHandle over its block", "ep_core.kernels.op_plan", "DispatchPlan._block_handle"),
)


def _resolve(module: str, path: str) -> tuple[Any, str] | None:
    try:
        obj = importlib.import_module(module)
    except ImportError:
        return None
    *owners, attr = path.split(".")
    for name in owners:
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return (obj, attr) if hasattr(obj, attr) else None


def breakdown(fn: Any, iters: int, steps: tuple = STEPS) -> list[dict]:
    """Rows `{"step", "calls", "incl_us", "own_us"}` per call of `fn` (module doc)."""
    acc: dict[str, list] = {}  # label -> [calls, inclusive seconds, seconds inside nested steps]
    stack: list[list] = []
    saved = []
    clock = time.perf_counter
    for label, module, path in steps:
        where = _resolve(module, path)
        if where is None:
            continue
        owner, attr = where
        own = attr in vars(owner)  # else inherited (torch.Tensor.clone): restored by deleting the wrapper
        orig = vars(owner)[attr] if own else getattr(owner, attr)
        if isinstance(orig, (staticmethod, classmethod)):
            continue
        cell = acc[label] = [0, 0.0, 0.0]

        def wrap(f: Any, cell: list = cell) -> Any:
            def timed(*args: Any, **kwargs: Any) -> Any:
                stack.append(cell)
                t0 = clock()
                try:
                    return f(*args, **kwargs)
                finally:
                    dt = clock() - t0
                    stack.pop()
                    cell[0] += 1
                    cell[1] += dt
                    if stack:
                        stack[-1][2] += dt

            return timed

        saved.append((owner, attr, orig if own else None))
        setattr(owner, attr, wrap(orig))
    try:
        for _ in range(3):  # warm up through the wrappers
            fn()
        for cell in acc.values():
            cell[:] = [0, 0.0, 0.0]
        for _ in range(iters):
            fn()
    finally:
        for owner, attr, orig in reversed(saved):
            if orig is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, orig)
    return [
        {
            "step": label,
            "calls": c[0] / iters,
            "incl_us": c[1] / iters * 1e6,
            "own_us": (c[1] - c[2]) / iters * 1e6,
        }
        for label, c in acc.items()
        if c[0]
    ]


def format_rows(title: str, total_us: float, rows: list[dict]) -> str:
    lines = [f"-- {title}: {total_us:.1f} us/call uninstrumented; steps (calls per op, inclusive / own us):"]
    for r in rows:
        lines.append(f"   {r['step']:44s} {r['calls']:5.1f} x  {r['incl_us']:8.2f} / {r['own_us']:8.2f}")
    return "\n".join(lines)
