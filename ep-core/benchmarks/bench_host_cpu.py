#!/usr/bin/env python3
"""Host cost of ep_core's per-call work on the CPU (no GPU): array description, request validation, kernel planning.

The GPU executor spends its host time per dispatch / combine in four places that run identically without a GPU:
`describe()` of every argument, `make_dispatch_request` / `make_combine_request` (SPEC §6 validation, the cached
handle's arrays included), `KernelConfig` + `plan_regions` (the buffer regions of the configuration) and
`as_view` (the kernel-side views). This times each of them on the decode shape of benchmarks/bench_host_overhead.py
(one rank, T=128, hidden 7168, top-8 of 256 experts), with torch CPU tensors (when torch is installed), objects
exposing `__cuda_array_interface__` and ep_core `DeviceArray`s; and whole `EPBuffer.dispatch` / `combine` calls
through the GPU executor with the CUDA driver mocked (kernel launches and driver calls are no-ops, so what is left
is the host work of ep_core itself; the C++ launch path of ep_launch is mocked too, so its Python side is timed).

    python ep-core/benchmarks/bench_host_cpu.py [--iters 2000] [--json OUT.json] [--fail-above-us US] [--breakdown]

Prints microseconds per call (best of 5 rounds). To compare with another revision, run this same script with
PYTHONPATH pointing at that revision's package sources (it uses only public ep_core entry points, plus the driver
entry points of `ep_core.kernels` that it patches for the mocked-GPU rows).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

T, HIDDEN, NUM_EXPERTS, TOPK, SF_PACKS = 128, 7168, 256, 8, 56


class FakeCudaArray:
    """An object exposing only `__cuda_array_interface__` (as CuPy / Numba arrays do) and a device."""

    class _Dev:
        id = 0

    device = _Dev()

    def __init__(self, shape: tuple, typestr: str, ptr: int = 0x7F0000000000) -> None:
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (ptr, False),
            "strides": None,
            "version": 3,
        }


class HostTarget:
    """The attributes of an executor that the validation reads (host arrays)."""

    array_device = "cpu"
    device_id = 0
    num_device_sms = 132
    nvlink_gbs = 450.0
    rdma_gbs = 50.0

    @staticmethod
    def default_allocator(shape, dtype):
        import ep_core

        return ep_core.host_allocator(shape, dtype)


def _time(fn, iters: int, rounds: int = 5) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - t0) / iters * 1e6)
    return best


def _config():
    import ep_core

    class Null:
        array_device = "cpu"
        device_id = 0
        num_device_sms = 132

        def dispatch(self, req):
            return req

        def combine(self, req):
            return req

        def barrier(self):
            return None

        def destroy(self):
            return None

    buf = ep_core.EPBuffer(
        ep_core.LocalBootstrap(),
        transport="reference",
        num_max_tokens_per_rank=T,
        hidden=HIDDEN,
        num_topk=TOPK,
        executor=Null(),
    )
    return buf.config


def _handle(make, rows: int):
    import ep_core

    return ep_core.EPHandle(
        False,
        NUM_EXPERTS,
        1,
        T,
        16,
        make((T, TOPK), "int64"),
        rows,
        rows,
        [],
        make((1,), "int32"),
        make((NUM_EXPERTS,), "int32"),
        make((NUM_EXPERTS,), "int32"),
        make((rows, TOPK + 2), "int32"),
        make((T, TOPK), "int32"),
        num_ranks=1,
        rank=0,
    )


def _time_requests(add, label: str, make, config, target) -> None:
    from ep_core.validation import make_combine_request, make_dispatch_request

    rows = T * TOPK
    x = make((T, HIDDEN), "bfloat16")
    idx = make((T, TOPK), "int64")
    w = make((T, TOPK), "float32")
    fp8 = (make((T, HIDDEN), "float8_e4m3fn"), make((T, SF_PACKS), "float32"))
    handle = _handle(make, rows)
    recv = make((rows, HIDDEN), "bfloat16")
    kw = dict(num_experts=NUM_EXPERTS, num_sms=16, sm_cache={})
    add(
        f"make_dispatch_request ({label}, bf16)",
        lambda: make_dispatch_request(config, target, x, idx, w, do_cpu_sync=False, **kw),
    )
    add(
        f"make_dispatch_request ({label}, fp8)",
        lambda: make_dispatch_request(config, target, fp8, idx, w, do_cpu_sync=False, **kw),
    )
    add(
        f"make_dispatch_request ({label}, cached)",
        lambda: make_dispatch_request(config, target, x, handle=handle, num_sms=16),
    )
    add(f"make_combine_request ({label})", lambda: make_combine_request(config, target, recv, handle))
    try:  # the prepared-operation cache (absent in older revisions)
        from ep_core.prepared import PreparedOps
    except ImportError:
        return
    prep = PreparedOps(config)
    add(
        f"PreparedOps.dispatch_request ({label}, bf16, repeated)",
        lambda: prep.dispatch_request(target, x, idx, w, do_cpu_sync=False, **kw),
    )
    add(
        f"PreparedOps.dispatch_request ({label}, fp8, repeated)",
        lambda: prep.dispatch_request(target, fp8, idx, w, do_cpu_sync=False, **kw),
    )
    add(
        f"PreparedOps.dispatch_request ({label}, cached, repeated)",
        lambda: prep.dispatch_request(target, x, handle=handle, num_sms=16),
    )
    add(
        f"PreparedOps.combine_request ({label}, repeated)", lambda: prep.combine_request(target, recv, handle)
    )


def run(iters: int) -> list[tuple[str, float]]:
    import ep_core
    from ep_core.kernels._cuda import as_view
    from ep_core.kernels.plan import KernelConfig, plan_regions

    out: list[tuple[str, float]] = []

    def add(name: str, fn) -> None:
        fn()
        out.append((name, _time(fn, iters)))

    cai = FakeCudaArray((T, TOPK), "<i8")
    dev = ep_core.DeviceArray(0x7F0000000000, (T, HIDDEN), "bfloat16", device="cuda")
    add("describe: __cuda_array_interface__ object", lambda: ep_core.describe(cai))
    add("describe: ep_core DeviceArray", lambda: ep_core.describe(dev))

    config = _config()
    target = HostTarget()

    def host(shape, dtype):
        storage = {"bfloat16": np.uint16, "float8_e4m3fn": np.uint8}.get(dtype, dtype)
        return ep_core.host_array(np.ones(shape, storage), dtype)

    try:
        import torch
    except ImportError:
        torch = None
    makers = [("host DeviceArray", host)]
    if torch is not None:
        tdt = {"bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn}

        def tens(shape, dtype):
            return torch.ones(shape, dtype=tdt.get(dtype) or getattr(torch, dtype))

        makers.append(("torch CPU", tens))
        x_t = tens((T, HIDDEN), "bfloat16")
        i_t = tens((T, TOPK), "int64")
        add("describe: torch CPU bf16 [T, H]", lambda: ep_core.describe(x_t))
        add("describe: torch CPU int64 [T, K]", lambda: ep_core.describe(i_t))
        add("as_view: torch CPU bf16 [T, H]", lambda: as_view(x_t, "x"))

    for label, make in makers:
        _time_requests(add, label, make, config, target)

    add("KernelConfig(1, 8, 7168)", lambda: KernelConfig(1, TOPK, HIDDEN))
    cfg = KernelConfig(1, TOPK, HIDDEN)
    data = 1 << 30
    add("plan_regions (dispatch)", lambda: plan_regions(cfg, NUM_EXPERTS, T, data, op="dispatch"))
    add(
        "plan_regions (combine)",
        lambda: plan_regions(cfg, NUM_EXPERTS, T, data, op="combine", allow_multiple_reduction=True),
    )
    add("KernelConfig.dynamic_smem_bytes", lambda: cfg.dynamic_smem_bytes)
    return out


# ------------------------------------------------------------------------------------------------------------
# the GPU executor with the CUDA driver mocked: every host step of EPBuffer -> GpuExecutor -> RankDriver runs (validation,
# planning, views, argument packing), kernel launches and driver calls are no-ops


class _Fake:
    """Stands in for driver objects: any method returns a success tuple / None."""

    handle = 0
    _event = 0
    device_ptr = 0
    array = np.ones(1 << 10, np.int32).view(np.uint8)  # a CPU-sync dispatch reads counts of 1 from here

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __getattr__(self, name):
        return lambda *a, **k: (0,)

    def __int__(self) -> int:
        return 0

    def read(self):
        return (0, 0)

    def synchronize(self, timeout=None) -> bool:
        return True


class _FakeKernel:
    _func = 0  # looks like an ep_jit kernel: its prepared launches take the (mocked) native path

    def launch(self, *args, **kwargs) -> None:
        return None

    def _opt_in_smem(self, shared_mem: int) -> None:
        return None

    def max_active_blocks_per_sm(self, block, shared_mem) -> int:
        return 1


class _FakeNative:
    """Stands in for ep_launch: the C++ launch and event pair, as no-ops that report success."""

    class Launch:
        def __init__(self, *args) -> None:
            pass

        def __call__(self, stream, values, wait_event=0, wait_on=0, signal_event=0, signal_to=0) -> int:
            return 0

    @staticmethod
    def record_wait(event, on, waiter) -> int:
        return 0

    @staticmethod
    def copy_to_host(dst, src, nbytes, stream) -> int:
        return 0

    @staticmethod
    def stream_query(stream) -> int:
        return 0


class _FakeKernels:
    dispatch = epilogue = combine = dispatch_zero_copy = combine_zero_copy = _FakeKernel()


class _MockedGpu:
    """Patches ep_core.kernels' driver entry points for the duration of a `with` block."""

    def __enter__(self):
        from ep_core.kernels import _cuda
        from ep_core.kernels import gpu_executor as gex
        from ep_core.kernels import rank_driver as kex

        self._saved = []

        def patch(mod, name, value):
            self._saved.append((mod, name, getattr(mod, name)))
            setattr(mod, name, value)

        patch(_cuda, "driver", lambda: _Fake())
        patch(_cuda, "check", lambda result, what: None)
        patch(_cuda, "num_device_sms", lambda: 132)
        patch(_cuda, "current_device", lambda: 0)
        patch(_cuda, "device_attribute", lambda name: 1_000_000)
        patch(_cuda, "copy_to_host", lambda *a: None)
        patch(_cuda, "copy_device", lambda *a: None)
        patch(_cuda, "memset", lambda *a: None)
        patch(_cuda, "MappedWords", _Fake)
        patch(_cuda, "native_launch", lambda: _FakeNative)
        patch(_cuda, "native_launch_status", lambda: "mocked ep_launch")
        patch(kex, "PinnedBuffer", _Fake)
        patch(kex, "load_kernels", lambda config: _FakeKernels)
        patch(gex, "Stream", _Fake)
        patch(gex, "Event", _Fake)
        return self

    def __exit__(self, *exc) -> None:
        for mod, name, value in reversed(self._saved):
            setattr(mod, name, value)


class _Storage:
    ptr = 1 << 44
    peer_table = 1 << 45
    device = 0
    nccl_window = 0
    rank_devices = ("host/gpu0",)

    def __init__(self, num_bytes: int) -> None:
        self.num_bytes = num_bytes

    def close(self) -> None:
        return None


class _MockedTransport:
    def num_nvlink_ranks(self, bootstrap) -> int:
        return 1

    def allocate(self, bootstrap, num_bytes: int):
        return _Storage(num_bytes)

    def create_executor(self, config, buffer):
        from ep_core.kernels.gpu_executor import GpuExecutor

        return GpuExecutor(config, buffer.storage, buffer.bootstrap)


def run_executor(iters: int, steps: list | None = None) -> list[tuple[str, float]]:
    """EPBuffer.dispatch / combine end to end on the mocked GPU executor, ep_core DeviceArrays in and out. `steps`:
    a list to which each op's per-step breakdown (`host_steps.format_rows`) is appended."""
    import ep_core

    out: list[tuple[str, float]] = []
    counter = [1 << 40]

    def alloc(shape, dtype):
        counter[0] += 1 << 24
        return ep_core.DeviceArray(counter[0], shape, dtype, device="cuda")

    def arr(shape, dtype):
        return alloc(shape, dtype)

    with _MockedGpu():
        buf = ep_core.EPBuffer(
            ep_core.LocalBootstrap(),
            transport=_MockedTransport(),
            num_max_tokens_per_rank=T,
            hidden=HIDDEN,
            num_topk=TOPK,
        )
        x, idx, w = arr((T, HIDDEN), "bfloat16"), arr((T, TOPK), "int64"), arr((T, TOPK), "float32")
        kw = dict(num_experts=NUM_EXPERTS, num_sms=16, allocator=alloc)
        first = buf.dispatch(x, idx, w, do_cpu_sync=False, **kw)
        handle = first.handle
        recv = arr((handle.num_recv_tokens, HIDDEN), "bfloat16")
        zc_buf = buf.combine_buffer(handle)
        ops = {
            "EPBuffer.dispatch (mocked GPU, no CPU sync)": lambda: buf.dispatch(
                x, idx, w, do_cpu_sync=False, **kw
            ),
            "EPBuffer.dispatch (mocked GPU, CPU sync)": lambda: buf.dispatch(x, idx, w, **kw),
            "EPBuffer.dispatch (mocked GPU, cached)": lambda: buf.dispatch(
                x, handle=handle, num_sms=16, allocator=alloc
            ),
            "EPBuffer.combine (mocked GPU)": lambda: buf.combine(recv, handle, num_sms=16, allocator=alloc),
            # the zero-copy roads (issue 17): their own request-cache entries and repeats
            "EPBuffer.dispatch (mocked GPU, zero-copy, no CPU sync)": lambda: buf.dispatch(
                x, idx, w, do_cpu_sync=False, zero_copy=True, **kw
            ),
            "EPBuffer.combine (mocked GPU, zero-copy)": lambda: buf.combine(
                zc_buf, handle, num_sms=16, allocator=alloc, zero_copy=True
            ),
        }
        for name, fn in ops.items():
            fn()
            out.append((name, _time(fn, iters)))
            if steps is not None:
                from host_steps import breakdown, format_rows

                steps.append(format_rows(name, out[-1][1], breakdown(fn, iters)))
    return out


class _CpuMockedTransport(_MockedTransport):
    """The mocked GPU executor, taking host arrays (torch CPU tensors): ep_torch's path without CUDA streams."""

    def create_executor(self, config, buffer):
        ex = super().create_executor(config, buffer)
        ex.array_device = "cpu"
        return ex


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--breakdown",
        action="store_true",
        help="also time the steps of each EPBuffer call (host_steps.py)",
    )
    ap.add_argument(
        "--fail-above-us",
        type=float,
        default=None,
        help="exit 1 if a whole EPBuffer call takes longer (a generous regression bound for CI)",
    )
    args = ap.parse_args(argv)
    steps: list | None = [] if args.breakdown else None
    rows = run(args.iters) + run_executor(args.iters, steps)
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
                f"bench_host_cpu: {name} took {us:.1f} us per call, above the bound of {args.fail_above_us} us"
            )
        return 1 if slow else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
