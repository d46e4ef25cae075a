"""Where the host time of one ep_torch / ep_core call goes: the steps of the road (validate -> plan -> launch)
timed around their functions, so that a per-call total can be read as a sum.

`breakdown(fn, iters)` patches the functions of `STEPS` with timing wrappers for the duration of the run, calls
`fn` `iters` times and returns one row per step that ran: calls per op call, inclusive and own microseconds per op
call (own = inclusive minus the steps nested in it). A wrapper costs a fraction of a microsecond, which the parent
steps' own time includes; the uninstrumented total is measured separately by the benchmarks that print this.
Used by `bench_host_cpu.py --breakdown` (driver mocked) and `benchmarks/bench_host_overhead.py` (the H200).
"""

from __future__ import annotations

import importlib
import time
from typing import Any

# (label, module, attribute path, parent label): a step's parent is the step its calls are nested in
STEPS: tuple[tuple[str, str, str, str | None], ...] = (
    ("ep_torch ElasticBuffer.dispatch", "ep_torch.buffer", "ElasticBuffer.dispatch", None),
    ("ep_torch ElasticBuffer.combine", "ep_torch.buffer", "ElasticBuffer.combine", None),
    ("current stream", "ep_torch.buffer", "_current_stream", "ep_torch"),
    ("torch clone (handle's topk_idx copy)", "torch", "Tensor.clone", "ep_torch"),
    ("ep_core EPBuffer.dispatch", "ep_core.buffer", "EPBuffer.dispatch", "ep_torch"),
    ("ep_core EPBuffer.combine", "ep_core.buffer", "EPBuffer.combine", "ep_torch"),
    (
        "validate: PreparedOps.dispatch_request",
        "ep_core.prepared",
        "PreparedOps.dispatch_request",
        "EPBuffer",
    ),
    ("validate: PreparedOps.combine_request", "ep_core.prepared", "PreparedOps.combine_request", "EPBuffer"),
    ("validate: check_handle", "ep_core.prepared", "check_handle", "validate"),
    ("launch: GpuExecutor.dispatch", "ep_core.kernels.gpu_executor", "GpuExecutor.dispatch", "EPBuffer"),
    ("launch: GpuExecutor.combine", "ep_core.kernels.gpu_executor", "GpuExecutor.combine", "EPBuffer"),
    ("repeat: RepeatDispatch.run", "ep_core.kernels.repeat", "RepeatDispatch.run", "GpuExecutor"),
    ("repeat: RepeatCombine.run", "ep_core.kernels.repeat", "RepeatCombine.run", "GpuExecutor"),
    ("full path: DirectRank.dispatch", "ep_core.kernels.executor", "DirectRank.dispatch", "GpuExecutor"),
    ("full path: DirectRank.combine", "ep_core.kernels.executor", "DirectRank.combine", "GpuExecutor"),
    ("handle state: DirectRank._check_handle", "ep_core.kernels.executor", "DirectRank._check_handle", "run"),
    ("CPU sync: DirectRank._sync_counts", "ep_core.kernels.executor", "DirectRank._sync_counts", "run"),
    ("handle arrays: one block", "ep_core.kernels.array_block", "int32_block", "run"),
    ("outputs: torch.empty", "torch", "empty", "run"),
    ("launches (+ event pairs)", "ep_core.kernels.executor", "DirectRank._launch_prepared", "run"),
    ("new EPHandle", "ep_core.kernels.repeat", "EPHandle", "run"),
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
    """Rows `{"step", "parent", "calls", "incl_us", "own_us"}` per call of `fn` (module doc)."""
    acc: dict[str, list] = {}
    saved = []
    for label, module, path, parent in steps:
        where = _resolve(module, path)
        if where is None:
            continue
        owner, attr = where
        own = attr in vars(owner)  # else inherited (torch.Tensor.clone): restored by deleting the wrapper
        orig = vars(owner)[attr] if own else getattr(owner, attr)
        if isinstance(orig, (staticmethod, classmethod)):
            continue
        cell = acc[label] = [0, 0.0, parent]

        def wrap(f: Any, cell: list = cell) -> Any:
            clock = time.perf_counter

            def timed(*args: Any, **kwargs: Any) -> Any:
                t0 = clock()
                try:
                    return f(*args, **kwargs)
                finally:
                    cell[1] += clock() - t0
                    cell[0] += 1

            return timed

        saved.append((owner, attr, orig if own else None))
        setattr(owner, attr, wrap(orig))
    try:
        for _ in range(3):  # warm up through the wrappers
            fn()
        for cell in acc.values():
            cell[0], cell[1] = 0, 0.0
        for _ in range(iters):
            fn()
    finally:
        for owner, attr, orig in reversed(saved):
            if orig is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, orig)
    ran = {label: c for label, c in acc.items() if c[0]}
    rows = []
    for label, (calls, total, parent) in ran.items():
        # children: ran steps whose parent tag is a prefix-word of this label
        child = sum(c[1] for other, c in ran.items() if other != label and c[2] is not None and c[2] in label)
        rows.append(
            {
                "step": label,
                "parent": parent,
                "calls": calls / iters,
                "incl_us": total / iters * 1e6,
                "own_us": (total - child) / iters * 1e6,
            }
        )
    return rows


def format_rows(title: str, total_us: float, rows: list[dict]) -> str:
    lines = [f"-- {title}: {total_us:.1f} us/call uninstrumented; steps (calls per op, inclusive / own us):"]
    for r in rows:
        lines.append(f"   {r['step']:44s} {r['calls']:5.1f} x  {r['incl_us']:8.2f} / {r['own_us']:8.2f}")
    return "\n".join(lines)
