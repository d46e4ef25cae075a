"""Multi-process EP runs through `ep_core.EPBuffer`, one rank per process, every rank checked bitwise against
`ep_core.reference` (dispatch outputs, handle counts and combine results of its own tokens):

- one process per GPU for N = 1, 2, 4, 8 (skipped with the reason when the machine has fewer GPUs), over the ipc
  transport (ep_symmem VMM buffers, and CUDA IPC handles) and the nccl transport (skipped with the transport's own
  message while `EPBuffer(transport="nccl")` is not available);
- 2 processes sharing GPU 0 over the ipc transport (runs on the one-GPU machine);
- the same harness on CPU tensors over the reference transport (no GPU; checks the harness itself).

Modes per run: bf16 non-expand with CPU sync (default, non-deterministic order: compared in canonical order) and
its combine of per-rank scaled expert outputs with the received weights; FP8 deterministic plus a cached re-dispatch
(bitwise equal to the first); bf16 expand with alignment 4 and zero padding, and its combine; bf16 without CPU sync
(worst-case shapes, valid rows compared). Routing: top-8 of 256 experts, 20% of lanes masked, ranks with 128, 96,
0, 17, ... tokens, hidden 7168.

Each rank is this file run as a script (`python tests/test_multigpu_ep.py --worker ...`); bootstrap:
`ep_symmem.FileBootstrap` in a fresh directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
M, HIDDEN, TOPK, EXPERTS, SMS = 128, 7168, 8, 256, 8
COUNTS = (M, 96, 0, 17, M, 1, 64, 33)
# name, fp8, expand, alignment, deterministic, cpu sync, zero padding
MODES = (
    ("bf16/rank/sync", False, False, 1, False, True, False),
    ("fp8/rank/sync/deterministic+cached", True, False, 1, True, True, False),
    ("bf16/expand/A4/zero-padding/deterministic", False, True, 4, True, True, True),
    ("bf16/rank/no-cpu-sync/deterministic", False, False, 1, True, False, False),
)


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def _needs(nprocs: int) -> None:
    have = _gpu_count()
    if have == 0:
        pytest.skip("needs an NVIDIA GPU")
    if have < nprocs:
        pytest.skip(f"needs {nprocs} GPUs (one per process), this machine has {have}")


def _run(nprocs: int, device: str, transport: str, memory: str, tmp_path: Path) -> list[dict]:
    """Start `nprocs` worker processes; device "cpu", "shared" (all on GPU 0) or "own" (GPU = rank)."""
    boot = tmp_path / "boot"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs = []
    for r in range(nprocs):
        dev = "cpu" if device == "cpu" else ("0" if device == "shared" else str(r))
        cmd = [sys.executable, __file__, "--worker", str(r), str(nprocs), dev, transport, memory, str(boot)]
        procs.append(
            subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        )
    results = []
    for r, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=420)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"rank {r} hung (420 s)")
        assert p.returncode == 0, f"rank {r} failed (exit {p.returncode}):\n{err[-6000:]}"
        lines = [ln for ln in out.strip().splitlines() if ln.startswith("{")]
        assert lines, f"rank {r} printed no result:\n{out[-2000:]}\n{err[-4000:]}"
        results.append(json.loads(lines[-1]))
    skips = {res["skip"] for res in results if res.get("skip")}
    if skips:
        pytest.skip("; ".join(sorted(skips)))
    assert sorted(res["rank"] for res in results) == list(range(nprocs))
    errors = [f"rank {res['rank']}: {e}" for res in results for e in res["errors"]]
    assert not errors, "bitwise mismatches against ep_core.reference:\n" + "\n".join(errors[:20])
    for res in results:
        assert res["checks"] == [m[0] for m in MODES], res
    return results


@pytest.mark.gpu
@pytest.mark.parametrize("nprocs", [1, 2, 4, 8])
@pytest.mark.parametrize(
    "transport,memory",
    [("ipc", "symmem"), ("ipc", "cuda_ipc"), ("nccl", "-")],
    ids=["ipc-symmem", "ipc-cuda_ipc", "nccl"],
)
def test_one_process_per_gpu(nprocs: int, transport: str, memory: str, tmp_path: Path) -> None:
    _needs(nprocs)
    _run(nprocs, "own", transport, memory, tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("memory", ["symmem", "cuda_ipc"])
def test_two_processes_share_gpu0_ipc(memory: str, tmp_path: Path) -> None:
    _needs(1)
    _run(2, "shared", "ipc", memory, tmp_path)


@pytest.mark.slow
def test_harness_on_cpu_reference_transport(tmp_path: Path) -> None:
    """The worker's inputs, modes and comparisons, run over the reference transport on CPU tensors."""
    pytest.importorskip("torch")
    pytest.importorskip("ep_symmem")
    _run(2, "cpu", "reference", "-", tmp_path)


@pytest.mark.slow
def test_bench_multiproc_dry_run_on_cpu(tmp_path: Path) -> None:
    """benchmarks/bench_ep_multiproc.py end to end on CPU (reference transport, host timer): launch, checks against
    ep_core.reference, aggregation and the JSON report."""
    pytest.importorskip("torch")
    pytest.importorskip("ep_torch")
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "bench_ep_multiproc.py"),
        "--dry-run-cpu",
        "--nprocs",
        "2",
    ]
    cmd += ["--tokens", "48", "--sms", "8", "--iters", "1", "--warmup", "0", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "bench_ep_multiproc_n2_cpu_reference.json").read_text())
    ops = {(r["dtype"], r["op"]) for r in result["rows"]}
    assert ops == {("bf16", "dispatch"), ("bf16", "combine"), ("fp8", "dispatch")}, ops
    assert all(r["check"] == "ok" and r["ranks"] == 2 for r in result["rows"]), result["rows"]
    assert "logical_dispatch" in result["formulas"] and "recv_tokens_r" in proc.stdout


# ---------------------------------------------------------------------------------------------------------------
# the worker (one rank)


def _worker(rank: int, size: int, device: str, transport: str, memory: str, directory: str) -> dict:
    import torch

    if device != "cpu":
        dev = torch.device("cuda", int(device))
        torch.cuda.set_device(dev)
        torch.zeros(1, device=dev)  # the device's primary context, current on this thread (ep_core uses it)
    else:
        dev = torch.device("cpu")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_ep_multiproc as bench
    import ep_symmem
    from ep_core import EPBuffer, reference, routing
    from ep_core.errors import EPConfigError

    boot = ep_symmem.FileBootstrap(directory, rank, size, timeout=300.0)
    if transport == "ipc":
        from ep_core.transports.ipc import make_transport

        tr = make_transport(memory)
    else:
        tr = transport  # "nccl" or "reference"
    buffers = {}
    try:
        for det in (False, True):
            buffers[det] = EPBuffer(
                boot,
                transport=tr,
                num_max_tokens_per_rank=M,
                hidden=HIDDEN,
                num_topk=TOPK,
                num_experts=EXPERTS,
                deterministic=det,
                num_gpu_timeout_secs=60,
                num_cpu_timeout_secs=120,
            )
    except EPConfigError as e:
        if transport == "nccl":
            return {"rank": rank, "skip": f"nccl transport not available: {e}"}
        raise
    pool = bench.TorchPool(dev)
    stream = 0 if device == "cpu" else int(torch.cuda.current_stream().cuda_stream)
    counts = [COUNTS[r % len(COUNTS)] for r in range(size)]
    checks, errors = [], []

    def sync() -> None:
        if device != "cpu":
            torch.cuda.synchronize()

    for i, (name, fp8, expand, align, det, cpu_sync, zero_pad) in enumerate(MODES):
        buf = buffers[det]
        inp = routing.make_inputs(size, counts, HIDDEN, EXPERTS, TOPK, seed=11 + i, masked_ratio=0.2, fp8=fp8)
        ref = reference.dispatch(
            inp.x_args,
            inp.topk_idxs,
            inp.topk_weights,
            num_experts=EXPERTS,
            num_max_tokens_per_rank=M,
            do_expand=expand,
            expert_alignment=align,
            do_zero_padding=zero_pad,
        )
        if fp8:
            x = (
                bench.from_numpy(inp.xs[rank], torch.float8_e4m3fn, dev),
                bench.from_numpy(inp.sfs[rank], torch.float32, dev),
            )
        else:
            x = bench.from_numpy(inp.xs[rank], torch.bfloat16, dev)
        idx = bench.from_numpy(inp.topk_idxs[rank], torch.int64, dev)
        w = bench.from_numpy(inp.topk_weights[rank], torch.float32, dev)
        res = buf.dispatch(
            x,
            idx,
            w,
            num_experts=EXPERTS,
            do_expand=expand,
            expert_alignment=align,
            do_cpu_sync=cpu_sync,
            do_zero_padding=zero_pad,
            num_sms=SMS,
            allocator=pool.use(name),
            stream=stream,
        )
        sync()
        errs = bench.compare_dispatch(
            bench.output_to_reference(res), ref[rank], canonical=not det, zero_padding=zero_pad
        )
        if fp8:  # cached re-dispatch: same rows in the same order
            again = buf.dispatch(
                x,
                None,
                w,
                handle=res.handle,
                num_sms=SMS,
                allocator=pool.use(name + "/cached"),
                stream=stream,
            )
            sync()
            for field in ("recv_x", "recv_sf", "recv_topk_idx", "recv_topk_weights"):
                a, b = bench.to_numpy(getattr(again, field)), bench.to_numpy(getattr(res, field))
                if a.shape != b.shape or a.tobytes() != b.tobytes():
                    errs.append(f"cached {field}: differs from the first dispatch")
        elif cpu_sync:  # combine of this rank's scaled expert outputs
            y = bench.scale_expert_output_torch(res.recv_x, rank)
            ys = [bench.scale_expert_output_numpy(o.recv_x, d) for d, o in enumerate(ref)]
            if expand:
                comb = buf.combine(
                    y, res.handle, num_sms=SMS, allocator=pool.use(name + "/combine"), stream=stream
                )
                want = reference.combine(ys, [o.handle for o in ref])[rank]
            else:
                comb = buf.combine(
                    y,
                    res.handle,
                    res.recv_topk_weights,
                    num_sms=SMS,
                    allocator=pool.use(name + "/combine"),
                    stream=stream,
                )
                want = reference.combine(
                    ys, [o.handle for o in ref], topk_weights=[o.recv_topk_weights for o in ref]
                )[rank]
            sync()
            errs += bench.compare_combine(comb.combined_x, comb.combined_topk_weights, want)
        errors += [f"{name}: {e}" for e in errs]
        checks.append(name)
    for buf in buffers.values():
        buf.destroy()
    return {"rank": rank, "checks": checks, "errors": errors}


if __name__ == "__main__" and len(sys.argv) == 8 and sys.argv[1] == "--worker":
    _, _, a_rank, a_size, a_dev, a_transport, a_memory, a_dir = sys.argv
    try:
        result = _worker(int(a_rank), int(a_size), a_dev, a_transport, a_memory, a_dir)
    except Exception:
        traceback.print_exc()
        sys.exit(1)
    print(json.dumps(result), flush=True)
