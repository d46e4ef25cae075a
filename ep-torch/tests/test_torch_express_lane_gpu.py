"""GPU (marker gpu): each dispatch layout through the express lanes (kept plans, `ep_core.kernels.op_plan`) gives what the
ordinary road gives.

One rank over nccl, in a child process (this file run as a script), a deterministic buffer, ep_torch's host
extension loaded. For every layout (bf16 and FP8, no-sync and CPU-sync, the plain and the expanded layout, expert
alignment, zero padding), the same inputs are dispatched twice: the first call takes the ordinary road (it makes
the prepared entry and the lane), the second the lane. The two calls must agree bitwise on what is defined whatever
the row count: the combine of the received rows (FP8: dequantized), the handle's counts and prefix sums, and for a
CPU-sync dispatch its row counts and per-expert list. The CPU tests (`test_torch_express_lane.py`) compare the
launches' words; this runs them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

T, HIDDEN, E, K = 128, 7168, 256, 8

# (FP8, CPU sync, expand, expert alignment, zero padding); padded layouts are zero-padded (their padding rows are
# then defined), and every layout's rows are compared only through the combine
LAYOUTS = [
    (fp8, sync, expand, align, pad)
    for fp8 in (False, True)
    for sync in (False, True)
    for expand, align, pad in ((False, 1, False), (False, 4, False), (True, 1, False), (True, 4, True))
]


@pytest.mark.gpu
def test_lanes_give_what_the_ordinary_road_gives(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    from ep_torch_testing import run_script  # loaded by conftest.py

    code, out = run_script(__file__, [str(tmp_path)], 300.0)
    assert code == 0, out[-4000:]
    seen = json.loads((tmp_path / "out.json").read_text())
    if not seen["host_extension"].startswith("built"):
        pytest.skip(f"no host extension here: {seen['host_extension']}")
    assert seen["failures"] == [], seen["failures"][:10]
    assert seen["served"] == len(LAYOUTS), seen  # every second call took a lane


def _main(out_dir: str) -> int:
    import torch
    import torch.distributed as dist
    from ep_core.kernels import op_plan
    from ep_torch import ElasticBuffer, host_extension
    from ep_torch.launch import free_port, init_rank

    served = [0]
    # the no-sync and CPU-sync lanes (fields of one class; not the zero-copy one)

    def counted(self, *args, _call=op_plan.DispatchPlan.__call__):
        got = _call(self, *args)
        served[0] += got is not None and not self.zero_copy and not self.cached
        return got

    op_plan.DispatchPlan.__call__ = counted
    init_rank(0, 1, free_port(), "nccl")
    buf = ElasticBuffer(
        None,
        num_max_tokens_per_rank=T,
        hidden=HIDDEN,
        num_topk=K,
        deterministic=True,
        explicitly_destroy=True,
    )
    g = torch.Generator(device="cuda").manual_seed(3)
    failures: list[str] = []
    fields = (
        "psum_num_recv_tokens_per_scaleup_rank",
        "psum_num_recv_tokens_per_expert",
        "num_unaligned_recv_tokens_per_expert",
    )

    def bf16_rows(recv_x):
        if not isinstance(recv_x, tuple):
            return recv_x
        data, sf = recv_x
        return (data.float() * sf.repeat_interleave(128, dim=1)).to(torch.bfloat16)

    for fp8, sync, expand, align, pad in LAYOUTS:
        tag = f"fp8={fp8} sync={sync} expand={expand} align={align} pad={pad}"
        x = torch.randn(T, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)
        sent = (
            (x.to(torch.float8_e4m3fn), torch.rand(T, HIDDEN // 128, device="cuda", generator=g) + 0.5)
            if fp8
            else x
        )
        idx = torch.rand(T, E, device="cuda", generator=g).topk(K, dim=1).indices
        w = torch.rand(T, K, device="cuda", generator=g)
        kw = dict(
            topk_idx=idx,
            topk_weights=w,
            num_experts=E,
            num_sms=16,
            expert_alignment=align,
            do_cpu_sync=sync,
            do_expand=expand,
            do_zero_padding=pad,
            use_tma_aligned_col_major_sf=fp8 and expand,
        )
        got = []
        before = served[0]
        for _ in range(2):  # the ordinary road, then the lane
            recv_x, _idx, recv_w, handle, _ = buf.dispatch(sent, **kw)
            comb, _, _ = buf.combine(bf16_rows(recv_x), handle, num_sms=16)
            got.append(
                (
                    comb,
                    [getattr(handle, f).clone() for f in fields],
                    (
                        handle.num_recv_tokens,
                        handle.num_expanded_tokens,
                        list(handle.num_recv_tokens_per_expert_list),
                    ),
                    None if recv_w is None else tuple(recv_w.shape),
                )
            )
        torch.cuda.synchronize()
        if served[0] != before + 1:
            failures.append(f"{tag}: the second call did not take a lane")
        (c0, f0, n0, w0), (c1, f1, n1, w1) = got
        if not torch.equal(c0, c1):
            failures.append(f"{tag}: combine of the received rows differs")
        for name, a, b in zip(fields, f0, f1):
            if not torch.equal(a, b):
                failures.append(f"{tag}: handle.{name} differs")
        if n0 != n1 or w0 != w1:
            failures.append(f"{tag}: counts / layouts {n0[:2]} {w0} != {n1[:2]} {w1}")
        if not expand and not torch.equal(c1, x if not fp8 else bf16_rows(sent)):
            failures.append(f"{tag}: combine(dispatch(x)) != x")
    Path(out_dir, "out.json").write_text(
        json.dumps({"failures": failures, "served": served[0], "host_extension": host_extension.status()})
    )
    buf.destroy()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1]))
