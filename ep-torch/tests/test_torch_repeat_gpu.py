"""GPU (marker gpu): repeated eager calls of one shape take ep_core's repeated-call road (a plan's run,
ep_core.kernels.op_plan) and ep_launch's C++ launches, and stay exact.

One rank over nccl, in a child process (this file run as a script): dispatches without and with CPU sync,
cached dispatches and combines, each several times with new inputs of the same shapes, synchronous, async
(`async_with_compute_stream`) and on the comm stream (`allocate_on_comm_stream`), and FP8 dispatches (compared as
their dequantized rows). With one rank each token is
received once (the non-expand layout: one row per token and destination rank), so `combine(dispatch(x))` is
exactly `x`, a CPU-sync handle holds T rows and the routing's per-expert counts, and a cached dispatch of the
handle does the same with new data. The same script runs once with `EPKIT_NATIVE_LAUNCH=0` (the announced
cuda-python path). Where ep_torch's host extension is loaded, the plain repeats of the no-sync and the CPU-sync
dispatch take their express lanes (kept plans, `ep_core.kernels.op_plan`), and the test counts them."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

T, HIDDEN, E, K = 128, 7168, 256, 8  # the shapes of benchmarks/bench_host_overhead.py (its JIT cache entries)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("native", "overlap"),
    [("1", "1"), ("0", "1"), ("1", "0")],
    ids=["native", "cuda-python", "native-no-overlap"],
)
def test_repeated_calls_stay_exact(tmp_path: Path, native: str, overlap: str) -> None:
    """overlap "0": a buffer with prefer_overlap_with_compute=False at 4 SMs per op (the copy epilogue and the
    combine's reduce on the whole GPU; 128 tokens are more than one round of the op's warps, so a combine is two
    launches, through the repeat and the express lane alike)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    from ep_torch_testing import run_script  # loaded by conftest.py

    env = dict(os.environ, EPKIT_NATIVE_LAUNCH=native, EP_TEST_PREFER_OVERLAP=overlap)
    code, out = run_script(__file__, [str(tmp_path)], 300.0, what=f"native={native}: ", env=env)
    assert code == 0, out[-4000:]
    seen = json.loads((tmp_path / "out.json").read_text())
    assert seen["failures"] == [], seen["failures"][:10]
    assert seen["checks"] >= 40
    assert seen["launch_path"].startswith("ep_launch" if native == "1" else "off")
    assert seen["repeats"] > 0  # the repeated-call road ran
    assert (seen["split_combines"] > 0) == (overlap == "0"), seen
    # the no-sync zero-copy dispatch repeats (a CPU-sync one takes the full path), and the zero-copy combines
    zero_copy_served = seen["zero_copy_repeats"][0] + seen["express_zero_copy"]
    assert zero_copy_served >= 3 and seen["zero_copy_repeats"][1] >= 3, seen
    if seen["host_extension"].startswith("built"):
        # plain, int32-routing and FP8 modes: three repeats of the no-sync dispatch each took the express lane,
        # and three of the CPU-sync one the sync lane
        assert seen["express"] >= 9, seen
        assert seen["express_sync"] >= 9, seen
        assert seen["express_zero_copy"] >= 3, seen  # the zero-copy dispatch's own lane


def _main(out_dir: str) -> int:
    import torch
    import torch.distributed as dist
    from ep_core.kernels import op_plan
    from ep_torch import ElasticBuffer, host_extension
    from ep_torch.launch import free_port, init_rank

    # no-sync, CPU-sync and zero-copy dispatches the express lanes (kept plans, ep_core.kernels.op_plan) served
    served = [0, 0, 0]

    lane_call = op_plan.DispatchPlan.__call__

    def counted(self, *args):  # CPU sync and zero copy are fields of the plan (a cached one is not counted)
        got = lane_call(self, *args)
        if not self.cached:
            served[2 if self.zero_copy else 1 if self.cpu_sync else 0] += got is not None
        return got

    op_plan.DispatchPlan.__call__ = counted
    zero_copy_repeats = [0, 0]  # zero-copy dispatches and combines the repeated-call road served

    def counting_zero_copy(cls, at):
        repeat_run = cls.run

        def counted(self, *args, **kwargs):
            got = repeat_run(self, *args, **kwargs)
            zero_copy_repeats[at] += got is not None and self.zero_copy
            return got

        cls.run = counted

    counting_zero_copy(op_plan.DispatchPlan, 0)  # also under the zero-copy dispatch's express lane
    counting_zero_copy(op_plan.CombinePlan, 1)  # also under the zero-copy combine's express lane
    init_rank(0, 1, free_port(), "nccl")
    overlap = os.environ.get("EP_TEST_PREFER_OVERLAP", "1") == "1"
    buf = ElasticBuffer(
        None,
        num_max_tokens_per_rank=T,
        hidden=HIDDEN,
        num_topk=K,
        explicitly_destroy=True,
        prefer_overlap_with_compute=overlap,
    )
    g = torch.Generator(device="cuda").manual_seed(5)
    failures: list[str] = []
    checks = [0]

    def check(ok: bool, what: str) -> None:
        checks[0] += 1
        if not ok:
            failures.append(what)

    def inputs():
        x = torch.randn(T, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)
        idx = torch.rand(T, E, device="cuda", generator=g).topk(K, dim=1).indices
        w = torch.rand(T, K, device="cuda", generator=g)
        return x, idx, w

    def counts(idx):
        return torch.bincount(idx.flatten(), minlength=E).tolist()

    sms = (
        16 if overlap else 4
    )  # no overlap: fewer warps than tokens, the combine splits (RankDriver.combine_split)
    kw = {"num_experts": E, "num_sms": sms}

    def dequantized(data, sf):  # FP8 rows times their per-128-channel scales, as bf16 (exact per element)
        return (data.float() * sf.repeat_interleave(128, dim=1)).to(torch.bfloat16)

    for mode in ("plain", "async", "comm", "int32 routing", "fp8", "zero-copy"):
        extra = {
            # dispatch and combine in the buffer's memory: recv_x is the combine buffer, combined in place
            "zero-copy": {"zero_copy": True},
            "plain": {},
            "async": {"async_with_compute_stream": True},
            "comm": {"allocate_on_comm_stream": True},
            "int32 routing": {},
            "fp8": {},
        }[mode]

        def done(ev):
            if ev is not None and ev.event is not None:
                ev.current_stream_wait()

        for sync in (True, False):
            for i in range(4):  # the first call of each shape takes the full path, the others repeat it
                x, idx, w = inputs()
                if mode == "int32 routing":
                    idx = idx.int()
                sent = x
                if mode == "fp8":
                    sent = (x.to(torch.float8_e4m3fn), torch.rand(T, HIDDEN // 128, device="cuda") + 0.5)
                recv_x, recv_idx, recv_w, handle, ev = buf.dispatch(
                    sent, topk_idx=idx, topk_weights=w, do_cpu_sync=sync, **kw, **extra
                )
                done(ev)
                if mode == "fp8":  # compared (and combined) as the dequantized rows
                    data, sf = recv_x
                    check(
                        data.dtype == torch.float8_e4m3fn and sf.shape == (data.shape[0], HIDDEN // 128),
                        f"fp8 sync={sync} #{i}: received layouts",
                    )
                    recv_x, x = dequantized(data, sf), dequantized(*sent)
                # the caller overwrites its routing after the call: the handle keeps its own copy (the dispatch
                # kernel fills it), which the combine and the cached dispatches below read
                ref = idx.clone()
                idx.fill_(-1)
                tag = f"{mode} sync={sync} #{i}"
                if sync:
                    check(handle.num_recv_tokens == T, f"{tag}: rows {handle.num_recv_tokens}")
                    check(
                        list(handle.num_recv_tokens_per_expert_list) == counts(ref.long()),
                        f"{tag}: expert counts",
                    )
                # one rank: the received rows are the tokens in some order, with their routing and weights
                check(recv_x.shape[0] == T and recv_idx.shape == (T, K), f"{tag}: shapes {recv_x.shape}")
                check(
                    torch.equal(recv_idx.flatten().sort().values, ref.long().flatten().sort().values),
                    f"{tag}: ids",
                )
                check(
                    torch.equal(recv_w.flatten().sort().values, w.flatten().sort().values), f"{tag}: weights"
                )
                comb, _, ev = buf.combine(recv_x, handle, num_sms=sms, **extra)
                done(ev)
                check(torch.equal(comb, x), f"{tag}: combine(dispatch(x)) != x")
                check(
                    torch.equal(handle.topk_idx, ref) and handle.topk_idx.dtype == ref.dtype,
                    f"{tag}: handle.topk_idx",
                )
                for j in range(
                    0 if mode in ("fp8", "zero-copy") else 3
                ):  # cached dispatches of this handle, then combines
                    x2 = torch.randn(T, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)
                    r2, _, _, h2, ev = buf.dispatch(x2, handle=handle, num_sms=sms, **extra)
                    done(ev)
                    check(h2 is handle, f"{tag} cached #{j}: handle")
                    c2, _, ev = buf.combine(r2, handle, num_sms=sms, **extra)
                    done(ev)
                    check(torch.equal(c2, x2), f"{tag} cached #{j}: combine(dispatch(x)) != x")
    torch.cuda.synchronize()
    ex = buf.runtime.executor
    plans = ex.rank.plans  # the rank's one plan cache: a prepared entry's plan is kept under its token
    repeats = sum(1 for e in buf.runtime._prepared._dispatch.values() if plans.get(e["prepared"]) is not None)
    repeats += sum(1 for e in buf.runtime._prepared._combine.values() if plans.get(e["prepared"]) is not None)
    # combine shapes prepared as two launches (send, then the reduce on the wider grid)
    split = sum(
        1 for p in ex.rank.plans.launches() if p.epilogue is not None and p.main.name == "ep_combine_impl"
    )
    Path(out_dir, "out.json").write_text(
        json.dumps(
            {
                "failures": failures,
                "checks": checks[0],
                "launch_path": ex.launch_path,
                "repeats": repeats,
                "express": served[0],
                "express_sync": served[1],
                "express_zero_copy": served[2],
                "split_combines": split,
                "zero_copy_repeats": zero_copy_repeats,
                "host_extension": host_extension.status(),
            }
        )
    )
    buf.destroy()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1]))
