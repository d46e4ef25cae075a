"""Elastic memory through ``ep_torch.ElasticBuffer`` (issue 20): a dispatch whose receive region does not fit the
GPU part (``num_bytes - num_cpu_bytes``) spills into the host part instead of being refused, with the same results
as ``ep_core.reference``; ``explain_memory()`` shows the bytes in host memory and their cost.

CPU: 2 gloo processes on the reference backend. GPU (marker gpu): 2 processes sharing GPU 0 over the ipc transport,
where the host part is host NUMA memory behind the GPU part in one VA range (ep_symmem): the kernels write source
rank 1's rows there (the CPU reads them back through the allocation's host view), results bitwise vs the
reference. Each case runs in a process group started by this file as a script under a wall-clock limit.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

MiB = 1 << 20
N, M, H, E, K = 2, 512, 2048, 8, 2


def _run(mode: str, tmp_path: Path, limit: float = 300.0) -> list[dict]:
    from ep_torch_testing import run_script  # loaded by conftest.py

    env = dict(os.environ)
    for name in ("EPKIT_TORCH_TRANSPORT", "EPKIT_SCALEUP_RANKS", "EPKIT_TORCH_REFERENCE_NVLINK_RANKS"):
        env.pop(name, None)
    env.setdefault("EPKIT_NVLINK_GBS", "450")  # ranks sharing one GPU: nothing to detect for the SM planner
    code, out = run_script(__file__, [mode, str(tmp_path)], limit, env=env, what=f"{mode}: ")
    seen = [
        json.loads(p.read_text()) if p.exists() else {} for p in (tmp_path / f"{r}.json" for r in range(N))
    ]
    errors = [f"rank {r}: {s['error']}" for r, s in enumerate(seen) if s.get("error")]
    assert not errors, "\n".join(errors) + "\n" + out[-2000:]
    assert code == 0, out[-3000:]
    return seen


def _sizes() -> tuple[int, int]:
    """`(num_bytes, num_cpu_bytes)`: the size hint, of which all but 2 MiB is the host part."""
    import ep_layout
    from ep_core import planner
    from ep_core.topology import Topology

    num_bytes = ep_layout.align(planner.get_buffer_size_hint(Topology(N, N, True), M, H, K), 2 * MiB)
    return num_bytes, num_bytes - 2 * MiB


# ---------------------------------------------------------------------------------------------------------------
# the ranks' side


def _np(t) -> np.ndarray:
    from ep_torch._convert import to_numpy

    return to_numpy(t.cpu())


def _case(rank: int, mode: str, seen: dict) -> None:
    import dataclasses

    import torch
    import torch.distributed as dist
    from ep_core import reference, routing
    from ep_torch import ElasticBuffer
    from ep_torch._convert import from_numpy

    gpu = mode == "gpu"
    dev = torch.device("cuda", 0) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(0)
    num_bytes, cpu = _sizes()
    buf = ElasticBuffer(
        None,
        num_bytes=num_bytes,
        num_cpu_bytes=cpu,
        num_max_tokens_per_rank=M,
        hidden=H,
        num_topk=K,
        deterministic=True,
        explicitly_destroy=True,
        num_gpu_timeout_secs=30,
        num_cpu_timeout_secs=60,
        transport="ipc" if gpu else "reference",
    )
    storage = buf._rt().storage
    seen["host_bytes"] = int(getattr(storage, "num_host_bytes", 0))
    inp = routing.make_inputs(N, [M, M - 9], H, E, K, seed=11)
    x = from_numpy(inp.xs[rank], torch.bfloat16, dev)
    i = torch.from_numpy(np.ascontiguousarray(inp.topk_idxs[rank]).astype(np.int64)).to(dev)
    w = torch.from_numpy(np.ascontiguousarray(inp.topk_weights[rank]).astype(np.float32)).to(dev)
    kw = {"num_sms": 4} if gpu else {}
    recv_x, _, recv_w, handle, _ = buf.dispatch(x, topk_idx=i, topk_weights=w, num_experts=E, **kw)
    want = reference.dispatch(
        inp.xs, inp.topk_idxs, inp.topk_weights, num_experts=E, num_max_tokens_per_rank=M, deterministic=True
    )
    nv = want[rank].num_valid_rows
    seen["recv_x"] = bool(np.array_equal(_np(recv_x)[:nv], want[rank].recv_x[:nv]))
    seen["num_recv"] = int(nv)
    if gpu:
        torch.cuda.synchronize()
        alloc = storage._buffer._owners[0]
        if seen["host_bytes"] and alloc.host_cpu_accessible:
            host = np.frombuffer(alloc.host_view(), dtype=np.uint8)
            seen["host_part_written"] = bool(host.any())  # source rank 1's rows landed in host memory
        else:
            seen["host_part_written"] = f"not CPU-readable (host bytes {seen['host_bytes']})"
    comb_x, _, _ = buf.combine(recv_x, handle, topk_weights=recv_w, **kw)
    # the reference combines what the kernels received, read through their metadata (as the hybrid GPU test)
    mine = (
        _np(recv_x),
        _np(recv_w),
        _np(handle.recv_src_metadata),
        _np(handle.psum_num_recv_tokens_per_scaleup_rank),
    )
    everyone: list = [None] * N
    dist.all_gather_object(everyone, mine)
    handles = [
        dataclasses.replace(
            want[d].handle, recv_src_metadata=e[2], psum_num_recv_tokens_per_scaleup_rank=e[3]
        )
        for d, e in enumerate(everyone)
    ]
    want_c = reference.combine([e[0] for e in everyone], handles, topk_weights=[e[1] for e in everyone])
    seen["combined_x"] = bool(np.array_equal(_np(comb_x), want_c[rank].combined_x))
    # the cost, last: a detection failure must not hide the results above
    try:
        plan = buf.explain_memory(num_experts=E, hbm_gbs=None if gpu else 4000, host_gbs=None if gpu else 50)
        seen["plan"] = plan.as_dict()
    except Exception as exc:
        seen["plan_error"] = f"{type(exc).__name__}: {exc}"
        seen["plan"] = buf.explain_memory(num_experts=E, hbm_gbs=4000, host_gbs=50).as_dict()
    buf.destroy()


def _worker(rank: int, world: int, mode: str, out: str) -> None:
    import traceback

    seen: dict = {}
    try:
        _case(rank, mode, seen)
    except Exception as exc:
        seen["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"
    finally:
        Path(out, f"{rank}.json").write_text(json.dumps(seen))
    if "error" in seen:
        os._exit(0)  # the group may be out of step: leave without the launcher's closing barrier


# ---------------------------------------------------------------------------------------------------------------
# the tests


def _check(seen: list[dict], host_memory: bool) -> None:
    for r, s in enumerate(seen):
        p = s["plan"]
        assert p["num_gpu_bytes"] == 2 * MiB and p["dispatch_host_bytes"] > 0 and not p["fits_gpu"], (r, p)
        assert p["host_memory"] is host_memory, (r, p)
        assert s["recv_x"] and s["combined_x"] and s["num_recv"] > 0, (r, s)


def test_dispatch_spills_into_the_host_part_on_the_reference_backend(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    seen = _run("cpu", tmp_path)
    _check(seen, host_memory=False)  # host storage: no host link to pay for
    assert seen[0]["plan"]["dispatch_host_us"] == 0


@pytest.mark.gpu
def test_dispatch_spills_into_host_numa_memory_on_the_gpu(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    pytest.importorskip("ep_symmem")
    seen = _run("gpu", tmp_path)
    _, cpu = _sizes()
    _check(seen, host_memory=True)  # results first: bitwise vs the reference
    for r, s in enumerate(seen):
        assert s["host_bytes"] == cpu, (r, s["host_bytes"])  # the host part really is host memory
        assert s["host_part_written"] is True, (r, s["host_part_written"])
        assert "plan_error" not in s, s["plan_error"]
        p = s["plan"]
        assert p["host_gbs"] > 0 and p["hbm_gbs"] > p["host_gbs"] and p["dispatch_host_us"] > 0, p


if __name__ == "__main__":
    from ep_torch import launch
    from ep_torch_testing import spawn_cpu

    # the GPU modes' ranks start afresh (a forked process cannot use CUDA)
    (launch.spawn if sys.argv[1].startswith("gpu") else spawn_cpu)(_worker, N, sys.argv[1], sys.argv[2])
