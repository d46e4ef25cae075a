#!/usr/bin/env python3
"""Host cost of ep_torch's road on the CPU (no GPU): `ElasticBuffer.dispatch` / `combine` with torch CPU tensors over
ep_core's GPU executor with the CUDA driver mocked (`ep-core/benchmarks/bench_host_cpu.py`'s mocks), a gloo group of
one; with and without ep_torch's host extension (the express lanes); plus ep_torch's host-extension describe and
allocation rows. ep_core's own rows (no ep_torch): `ep-core/benchmarks/bench_host_cpu.py`.

    python benchmarks/bench_host_torch.py [--iters 2000] [--json OUT.json] [--fail-above-us US] [--breakdown]

Prints microseconds per call (best of 5 rounds); `--breakdown` times each step of every call
(`ep-core/benchmarks/host_steps.py`, with ep_torch's steps of `TORCH_STEPS`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ep-core" / "benchmarks"))
import bench_host_cpu as b

T, HIDDEN, NUM_EXPERTS, TOPK = b.T, b.HIDDEN, b.NUM_EXPERTS, b.TOPK

# ep_torch's steps of one call, timed around their functions before ep_core's (`host_steps.STEPS`)
TORCH_STEPS: tuple[tuple[str, str, str], ...] = (
    ("ep_torch ElasticBuffer.dispatch", "ep_torch.buffer", "ElasticBuffer.dispatch"),
    ("ep_torch ElasticBuffer.combine", "ep_torch.buffer", "ElasticBuffer.combine"),
    ("current stream", "ep_torch.dispatch_combine", "_current_stream"),
    ("torch clone (handle's topk_idx copy)", "torch", "Tensor.clone"),
)


def torch_rows(iters: int) -> list[tuple[str, float]]:
    """ep_torch's host-extension describe and allocation rows (no rows without torch or the extension)."""
    try:
        import torch
    except ImportError:
        return []
    out: list[tuple[str, float]] = []

    def add(name: str, fn: Any) -> None:
        fn()
        out.append((name, b._time(fn, iters)))

    _time_host_extension(
        add, torch.ones(T, HIDDEN, dtype=torch.bfloat16), torch.ones(T, TOPK, dtype=torch.int64)
    )
    return out


def _time_host_extension(add: Any, x_t: Any, i_t: Any) -> None:
    """The same describes through ep_torch's host extension (`ep_torch.host_extension`, built here against this
    torch if need be), and one allocation through it against `torch.empty`: what ep_torch's CUDA path uses."""
    import warnings

    import ep_core
    import torch
    from ep_core import device_array

    try:
        from ep_torch import host_extension
    except ImportError:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        native = host_extension.module()
    if native is None:
        print(f"(no host extension rows: {host_extension.status()})")
        return
    saved = device_array._torch_reader
    device_array.set_torch_reader(native.facts)
    try:
        add("describe: torch CPU bf16 [T, H], host extension reader", lambda: ep_core.describe(x_t))
        add("describe: torch CPU int64 [T, K], host extension reader", lambda: ep_core.describe(i_t))
    finally:
        device_array.set_torch_reader(saved)
    add("torch.empty(size=(T, K), dtype=int64), CPU", lambda: torch.empty(size=(T, TOPK), dtype=torch.int64))
    add("host extension empty((T, K), int64, CPU)", lambda: native.empty((T, TOPK), torch.int64, -1))


def host_tensor_at(torch: Any, arr: Any, dtype: Any) -> Any:
    """A torch CPU tensor of `dtype` over the address and shape of ep-core's `arr` (numpy's array interface):
    the mocked executor's memory, which nothing reads."""
    size = torch.empty((), dtype=dtype).element_size()

    class Interface:
        def __init__(self) -> None:
            self.__array_interface__ = {
                "data": (arr.ptr, False),
                "shape": tuple(arr.shape),
                "typestr": f"<u{size}",
                "version": 3,
            }

    return torch.from_numpy(np.asarray(Interface())).view(dtype)


def _host_zero_copy_tensors(torch: Any, base: type) -> type:
    """ep_torch's `ZeroCopyTensors` making its tensors at the mocked executor's addresses on the host
    (`host_tensor_at`) instead of through the CUDA array interface: the zero-copy calls' host road without a GPU."""

    class HostZeroCopyTensors(base):
        __slots__ = ()

        def _whole(self, arr: Any, dtype: Any) -> Any:
            return host_tensor_at(torch, arr, dtype)

    return HostZeroCopyTensors


def run_torch(iters: int, steps: list | None = None, express: bool = False) -> list[tuple[str, float]]:
    """ep_torch.ElasticBuffer.dispatch / combine (torch CPU tensors, a gloo group of one) over the mocked GPU
    executor: ep_torch's own host work plus everything above; CUDA stream and event handling are not in it.
    `steps`: a list to which each op's per-step breakdown (`host_steps.format_rows`) is appended. `express`: with
    ep_torch's host extension loaded for the CPU tensors (`EPKIT_TORCH_HOST_EXTENSION=1`, built with the host
    compiler), so that the repeats take the express lanes (`ep_core.kernels.op_plan`); no rows if it cannot be
    built."""
    try:
        import torch
        import torch.distributed as dist
        from ep_torch import buffer as tbuf
        from ep_torch import host_extension
        from ep_torch.launch import free_port, init_rank
    except ImportError:
        return []
    if express:
        saved_env = os.environ.get("EPKIT_TORCH_HOST_EXTENSION")
        saved_state = list(host_extension._state)
        os.environ["EPKIT_TORCH_HOST_EXTENSION"] = "1"
        host_extension._state.clear()
        try:
            host_extension.module()
            return _renamed(run_torch(iters, steps), "express lane")
        except Exception as exc:
            print(f"bench_host_torch: no express-lane rows (the host extension cannot be had here: {exc})")
            return []
        finally:
            host_extension._state[:] = saved_state
            if saved_env is None:
                os.environ.pop("EPKIT_TORCH_HOST_EXTENSION", None)
            else:
                os.environ["EPKIT_TORCH_HOST_EXTENSION"] = saved_env
    out: list[tuple[str, float]] = []
    own_group = not dist.is_initialized()
    if own_group:
        init_rank(0, 1, free_port(), "gloo")
    saved = tbuf.make_core_transport, tbuf.ZeroCopyTensors
    tbuf.make_core_transport = lambda choice: b._CpuMockedTransport()
    tbuf.ZeroCopyTensors = _host_zero_copy_tensors(torch, tbuf.ZeroCopyTensors)
    try:
        with b._MockedGpu():
            buf = tbuf.ElasticBuffer(None, num_max_tokens_per_rank=T, hidden=HIDDEN, num_topk=TOPK)
            x = torch.ones(T, HIDDEN, dtype=torch.bfloat16)
            idx = torch.arange(T * TOPK, dtype=torch.int64).reshape(T, TOPK) % NUM_EXPERTS
            w = torch.ones(T, TOPK)
            kw = dict(num_experts=NUM_EXPERTS, num_sms=16)
            handle = buf.dispatch(x, topk_idx=idx, topk_weights=w, do_cpu_sync=False, **kw)[3]
            recv = torch.ones(handle.num_recv_tokens, HIDDEN, dtype=torch.bfloat16)
            x8 = (torch.ones(T, HIDDEN, dtype=torch.float8_e4m3fn), torch.ones(T, HIDDEN // 128))
            zero_copy_x = buf.get_combine_buffer(handle)  # where the expert writes its outputs
            ops = {
                "ElasticBuffer.dispatch (torch CPU, mocked GPU, no CPU sync)": lambda: buf.dispatch(
                    x, topk_idx=idx, topk_weights=w, do_cpu_sync=False, **kw
                ),
                "ElasticBuffer.dispatch (torch CPU, mocked GPU, FP8, no CPU sync)": lambda: buf.dispatch(
                    x8, topk_idx=idx, topk_weights=w, do_cpu_sync=False, **kw
                ),
                # the count round trip mocked: the host's side of it (copy, wait, read) and the second allocation
                "ElasticBuffer.dispatch (torch CPU, mocked GPU, CPU sync)": lambda: buf.dispatch(
                    x, topk_idx=idx, topk_weights=w, **kw
                ),
                "ElasticBuffer.dispatch (torch CPU, mocked GPU, cached)": lambda: buf.dispatch(
                    x, handle=handle, num_sms=16
                ),
                "ElasticBuffer.combine (torch CPU, mocked GPU)": lambda: buf.combine(
                    recv, handle, num_sms=16
                ),
                # the zero-copy road: outputs left in the buffer's memory (tensors over the mocked executor's
                # addresses, never read), recv_x combined where it is
                "ElasticBuffer.dispatch (torch CPU, mocked GPU, zero-copy, no CPU sync)": lambda: (
                    buf.dispatch(x, topk_idx=idx, topk_weights=w, do_cpu_sync=False, zero_copy=True, **kw)
                ),
                "ElasticBuffer.combine (torch CPU, mocked GPU, zero-copy)": lambda: buf.combine(
                    zero_copy_x, handle, num_sms=16, zero_copy=True
                ),
                # a training step's pattern: every combine meets the handle its dispatch has just made
                "ElasticBuffer.dispatch + combine of its new handle (torch CPU, mocked GPU, no CPU sync)": lambda: (
                    buf.combine(
                        recv,
                        buf.dispatch(x, topk_idx=idx, topk_weights=w, do_cpu_sync=False, **kw)[3],
                        num_sms=16,
                    )
                ),
            }
            for name, fn in ops.items():
                fn()
                out.append((name, b._time(fn, iters)))
                if steps is not None:
                    from host_steps import STEPS, breakdown, format_rows

                    steps.append(format_rows(name, out[-1][1], breakdown(fn, iters, TORCH_STEPS + STEPS)))
    finally:
        tbuf.make_core_transport, tbuf.ZeroCopyTensors = saved
        if own_group:
            dist.destroy_process_group()
    return out


def _renamed(rows: list[tuple[str, float]], tag: str) -> list[tuple[str, float]]:
    return [(name.replace("mocked GPU", f"mocked GPU, {tag}"), us) for name, us in rows]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--json", default=None)
    ap.add_argument("--breakdown", action="store_true", help="also time the steps of each ElasticBuffer call")
    ap.add_argument(
        "--fail-above-us",
        type=float,
        default=None,
        help="exit 1 if a whole ElasticBuffer call takes longer (a generous regression bound for CI)",
    )
    args = ap.parse_args(argv)
    steps: list | None = [] if args.breakdown else None
    rows = torch_rows(args.iters) + run_torch(args.iters, steps) + run_torch(args.iters, None, True)
    for name, us in rows:
        print(f"{name:62s} {us:9.2f} us/call")
    for block in steps or ():
        print(block)
    if args.json:
        Path(args.json).write_text(json.dumps([{"op": n, "us_per_call": u} for n, u in rows], indent=1))
    if args.fail_above_us is not None:
        slow = [(n, u) for n, u in rows if "Buffer." in n and u > args.fail_above_us]
        for name, us in slow:
            print(
                f"bench_host_torch: {name} took {us:.1f} us per call, above the bound of {args.fail_above_us} us"
            )
        return 1 if slow else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
