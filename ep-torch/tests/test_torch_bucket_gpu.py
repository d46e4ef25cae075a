"""Issue 42's BucketBuffer rows on the GPU (marker gpu): several groups (``BucketBuffer([world, sub])``) and
``reduce_scatter(comm_precision="bf16")`` over the ipc transport with several processes sharing GPU 0 (a gloo
bootstrap), each result compared bit for bit with a CPU reference ``BucketBuffer`` (``transport="reference"``) over
the same gloo group fed the same inputs (the bf16 reduce-scatter: ``ep_core.bucket_bf16``'s kernels against its
numpy steps, the packed shards included); the refusals of groups the GPU path cannot map (announced to the peers). Skipped without a GPU.

Run: ``/work/bin/eptest ep-torch/tests/test_torch_bucket_gpu.py -q -m gpu`` (written 2026-12-08 without a GPU).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


def _run(mode: str, n: int, tmp_path: Path, limit: float = 240.0, transport: str = "ipc") -> None:
    from ep_torch_testing import run_script  # loaded by conftest.py

    env = dict(os.environ, EP_TEST_BUCKET_TRANSPORT=transport)
    env.pop("EPKIT_TORCH_TRANSPORT", None)
    code, out = run_script(__file__, [mode, str(n), str(tmp_path)], limit, env=env, what=f"{mode}: ")
    assert code == 0, out[-3000:]
    per_rank = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(n)]
    failures = [
        f"rank {r}: {name}: {detail}" for r, res in enumerate(per_rank) for name, ok, detail in res if not ok
    ]
    assert any(per_rank), "no checks ran"
    assert not failures, "\n".join(failures[:10])


# ---------------------------------------------------------------------------------------------------------------
# the ranks' side


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaN-aware (a NaN's payload after an addition is the hardware's: NaN must meet NaN)."""
    a, b = a.detach().cpu().reshape(-1), b.detach().cpu().reshape(-1)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    nan = torch.isnan(a)
    if not torch.equal(nan, torch.isnan(b)):
        return False
    ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a[~nan].view(ints), b[~nan].view(ints))


def _val(seed: int, count: int, specials: bool = True) -> torch.Tensor:
    """float32 values on the CPU; with `specials` the edge cases (infinities of both signs across ranks give NaN
    sums, NaN, values that carry past the largest finite bf16, subnormals, zeros) at the front."""
    g = torch.Generator().manual_seed(seed * 131 + 7)
    x = torch.randn(count, generator=g) * 10
    if specials and count >= 16:
        sign = 1.0 if seed % 2 else -1.0
        x[:8] = torch.tensor(
            [sign * float("inf"), float("nan"), 3.3961514e38, -3.3961514e38, 1e-40, -1e-45, 0.0, -0.0]
        )
    return x


def _buffers(groups, plan, res: list):
    """The GPU buffer (ipc or nccl) and the CPU reference buffer over the same groups (over nccl, where the group
    is nccl's, the CPU buffer takes a gloo group of the same ranks)."""
    import torch.distributed as dist
    from ep_torch import BucketBuffer

    transport = os.environ["EP_TEST_BUCKET_TRANSPORT"]
    gpu = BucketBuffer(groups, plan, explicitly_destroy=True, transport=transport)
    if transport == "nccl":
        assert groups is None
        groups = dist.new_group(list(range(dist.get_world_size())), backend="gloo")
    cpu = BucketBuffer(groups, plan, explicitly_destroy=True, transport="reference", num_cpu_timeout_secs=60)
    res.append(("storage on the GPU / CPU", gpu.storage.is_cuda and not cpu.storage.is_cuda, ""))
    return gpu, cpu


def _bf16(rank: int, n: int, res: list) -> None:
    """``reduce_scatter(comm_precision="bf16")``: registered tensors, a list, a scale, a session; the whole tensors
    after (the other shards packed alike on both); partial tiles, a 4-byte aligned tensor; the refusals."""
    from ep_core import BufferAllocator

    plan = BufferAllocator()
    plan.tensor("a", (n * 1024,), "float32")
    plan.tensor("b", (n * 8 * 37,), "float32")
    plan.tensor("half", (n * 64,), "float16")
    plan.tensor("big", (n * (32768 + 4104),), "float32")  # a shard of one tile and a part
    plan.tensor("spare", (1 << 16,), "float32")
    gpu, cpu = _buffers(None, plan, res)
    for name, get in (
        ("partial tiles", lambda b: b.tensors["big"]),
        ("4-byte aligned", lambda b: b.tensors["spare"][1 : 1 + n * 64]),  # the kernels' element-wise loads
    ):
        outs = []
        for buf in (gpu, cpu):
            get(buf).copy_(_val(rank + 40, get(buf).numel()))
            outs.append(buf.reduce_scatter(get(buf), comm_precision="bf16", scale=0.5).wait())
        res.append((f"bf16/{name}", _same(outs[0], outs[1]) and _same(get(gpu), get(cpu)), ""))
    for step, (scale, names) in enumerate(((0.25, ["a"]), (1.0, ["a", "b"]), (3.0, ["b"]))):
        outs = []
        for buf in (gpu, cpu):
            ts = [buf.tensors[k] for k in names]
            for i, t in enumerate(ts):
                t.copy_(_val(100 * step + 10 * i + rank, t.numel(), specials=i == 0))
            outs.append(
                buf.reduce_scatter(ts if len(ts) > 1 else ts[0], comm_precision="bf16", scale=scale).wait()
            )
        res.append(
            (f"bf16/step {step}: the paths", (gpu.bf16_path, cpu.bf16_path) == ("kernel", "reference"), "")
        )
        g, c = (o if isinstance(o, list) else [o] for o in outs)
        res.append((f"bf16/step {step}", all(_same(a, b) for a, b in zip(g, c, strict=True)), str(names)))
        whole = all(_same(gpu.tensors[k], cpu.tensors[k]) for k in names)
        res.append((f"bf16/step {step}: the whole tensors", whole, ""))
    # the same inputs in fp32 precision: the GPU's rank-order sum equals the CPU's too
    outs = []
    for buf in (gpu, cpu):
        buf.tensors["a"].copy_(_val(rank + 900, n * 1024, specials=False))
        outs.append(buf.reduce_scatter(buf.tensors["a"], scale=0.5).wait())
    res.append(("fp32 reduce_scatter", _same(outs[0], outs[1]), ""))
    outs = []
    for buf, dev in ((gpu, "cuda"), (cpu, "cpu")):
        with buf.session():  # an unregistered tensor, staged in session storage
            outs.append(
                buf.reduce_scatter(_val(rank + 500, n * 64).to(dev), comm_precision="bf16", scale=2.0).wait()
            )
    res.append(("bf16/session (unregistered)", outs[0].is_cuda and _same(outs[0], outs[1]), ""))
    for name, fn, want in (
        ("float16 src", lambda b: b.reduce_scatter(b.tensors["half"], comm_precision="bf16"), "EPTypeError"),
        (
            "odd shards",
            lambda b: b.reduce_scatter(b.tensors["a"][: n * 4], comm_precision="bf16"),
            "multiple of 8",
        ),
    ):
        try:
            fn(gpu)
            err = "no error"
        except Exception as exc:
            err = f"{type(exc).__name__}: {exc}"
        res.append((f"bf16/refused: {name}", want in err, err))
    res.append(("bf16/works after the refusals", _after(gpu, cpu, rank), ""))
    torch.cuda.synchronize()
    gpu.destroy()
    cpu.destroy()


def _after(gpu, cpu, rank: int) -> bool:
    outs = []
    for buf in (gpu, cpu):
        buf.tensors["a"].copy_(_val(rank + 700, buf.tensors["a"].numel()))
        outs.append(buf.reduce_scatter(buf.tensors["a"], comm_precision="bf16").wait())
    return _same(outs[0], outs[1])


def _groups(rank: int, n: int, res: list) -> None:
    """``BucketBuffer([world, sub])``: for 3 ranks the subgroups [0] and [1, 2] (group rank != world rank, and a
    group of one), for 2 ranks a second group over both; every collective of either group against the CPU."""
    import torch.distributed as dist
    from ep_core import BufferAllocator

    subs = [dist.new_group([0, 1])] if n == 2 else [dist.new_group([0]), dist.new_group(list(range(1, n)))]
    sub = subs[0] if n == 2 or rank == 0 else subs[1]
    world = dist.group.WORLD
    ns, sr = dist.get_world_size(sub), dist.get_rank(sub)
    plan = BufferAllocator()
    plan.tensor("w", (n * 64,), "float32")
    plan.tensor("p", (2 * 256,), "float32")  # the same plan on every rank: a subgroup uses the front
    plan.tensor("g", (2 * 32,), "bfloat16")
    plan.tensor("sr", (40,), "float32")
    plan.tensor("spare", (1 << 16,), "float32")
    gpu, cpu = _buffers([world, sub], plan, res)
    c = gpu.contexts
    res.append(
        (
            "groups/contexts",
            len(c) == 2 and (c[1].rank_idx, c[1].num_ranks) == (sr, ns) and gpu.get_context_idx(sub) == 1,
            f"{[(x.rank_idx, x.num_ranks) for x in c]}",
        )
    )
    steps = [
        ("world all_reduce", "w", lambda b, t: b.all_reduce(t, scale=0.5, group=world)),
        ("sub all_reduce", "p", lambda b, t: b.all_reduce(t, group=sub)),
        ("sub reduce_scatter", "p", lambda b, t: b.reduce_scatter(t, scale=2.0, group=sub)),
        ("sub reduce_scatter bf16", "p", lambda b, t: b.reduce_scatter(t, comm_precision="bf16", group=sub)),
        (
            "world reduce_scatter bf16",
            "w",
            lambda b, t: b.reduce_scatter(t, comm_precision="bf16", group=world),
        ),
        ("sub all_gather", "g", lambda b, t: b.all_gather(t.view(ns, -1)[sr], group=sub)),
        ("world all_reduce again", "w", lambda b, t: b.all_reduce(t, group=world)),
    ]
    for i, (name, key, fn) in enumerate(steps):
        outs = []
        for buf in (gpu, cpu):
            t = buf.tensors[key][: {"w": n * 64, "p": ns * 256, "g": ns * 32}[key]]
            t.copy_(_val(rank + 10 * i, t.numel(), specials=False).to(t.dtype))
            outs.append(fn(buf, t).wait())
        res.append((f"groups/{name}", _same(outs[0], outs[1]), ""))
        res.append((f"groups/{name}: in the storage", outs[0].data_ptr() >= gpu.storage.data_ptr(), ""))
    outs = []
    for buf, dev in ((gpu, "cuda"), (cpu, "cpu")):
        buf.barrier(group=sub)
        nxt, prv = (sr + 1) % ns, (sr - 1) % ns
        src = _val(rank + 300, 40).to(dev)
        outs.append(buf.send_recv(src, buf.tensors["sr"], nxt, prv, group=sub).wait())
        with buf.session():
            outs.append(buf.all_reduce(_val(rank + 400, 77).to(dev), group=sub).wait())
    res.append(("groups/sub send_recv ring", _same(outs[0], outs[2]), ""))
    res.append(("groups/sub session all_reduce (unregistered)", _same(outs[1], outs[3]), ""))
    res.append(
        ("groups/storage after", all(_same(gpu.tensors[k], cpu.tensors[k]) for k in ("w", "p", "g")), "")
    )
    torch.cuda.synchronize()
    gpu.destroy()
    cpu.destroy()


def _refusals(rank: int, n: int, res: list) -> None:
    """3 ranks: ranks 0 and 1 give [pair, world]; world has rank 2, which the pair's storage exchange never mapped:
    both refuse before any collective over world. 2 ranks: rank 0 gives the same group twice, rank 1 one group:
    rank 0 refuses, rank 1 raises EPPeerError naming it (announced in the constructor's exchange)."""
    import torch.distributed as dist
    from ep_torch import BucketBuffer

    world = dist.group.WORLD
    transport = os.environ["EP_TEST_BUCKET_TRANSPORT"]
    pair = dist.new_group([0, 1])
    if n == 3:
        groups = [pair, world] if rank < 2 else None
        want = "EPConfigError" if rank < 2 else ""
        needle = "global ranks [2]"
    else:
        groups = [world, world] if rank == 0 else [world]
        want = "EPConfigError" if rank == 0 else "EPPeerError"
        needle = "same group twice"
    err = ""
    if groups is not None:
        try:
            BucketBuffer(groups, 1 << 20, explicitly_destroy=True, transport=transport)
            err = "no error"
        except Exception as exc:
            err = f"{type(exc).__name__}: {exc}"
    res.append(("refused", err.startswith(want) and needle in err if want else err == "", err))
    if want == "EPPeerError":
        res.append(("refused/names the rank", "rank 0" in err, err))


_CASES = {"bf16": _bf16, "groups": _groups, "refusals": _refusals}


def _worker(rank: int, n: int, mode: str, out_dir: str) -> None:
    torch.cuda.set_device(0)
    res: list = []
    try:
        _CASES[mode](rank, n, res)
    except Exception as exc:  # reported, not hidden
        res.append((f"{mode}/raised", False, f"{type(exc).__name__}: {exc}"))
    Path(out_dir, f"{rank}.json").write_text(json.dumps(res))


# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3])
def test_reduce_scatter_bf16_on_the_gpu_equals_the_cpu(n: int, tmp_path: Path) -> None:
    _run("bf16", n, tmp_path)


@pytest.mark.parametrize("n", [2, 3])
def test_several_groups_on_the_gpu_equal_the_cpu(n: int, tmp_path: Path) -> None:
    _run("groups", n, tmp_path)


@pytest.mark.parametrize("n", [2, 3])
def test_groups_the_gpu_cannot_map_are_refused_on_every_rank(n: int, tmp_path: Path) -> None:
    _run("refusals", n, tmp_path)


def test_reduce_scatter_bf16_one_rank_over_nccl(tmp_path: Path) -> None:
    """The same over the nccl transport (one rank: NCCL's LSA team is the whole group; the copy-engine backend
    through the window's LSA pointers)."""
    _run("bf16", 1, tmp_path, transport="nccl")


if __name__ == "__main__":
    from ep_torch import launch

    nccl = os.environ.get("EP_TEST_BUCKET_TRANSPORT") == "nccl"
    launch.spawn(_worker, int(sys.argv[2]), sys.argv[1], sys.argv[3], backend="nccl" if nccl else "gloo")
