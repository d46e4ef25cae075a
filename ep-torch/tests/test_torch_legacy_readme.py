"""The README's DeepEP V1 call sites run as written on 2 gloo ranks (CPU reference backend): every ``python`` block
of the "DeepEP V1 `Buffer`" section that switches by the one import, with small sizes and stand-in experts; the
results are checked against the V1 semantics (normal combine: unweighted sum; low-latency: identity experts give
the weighted sum of the token itself)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist

README = Path(__file__).resolve().parents[1] / "README.md"
MARK = "# was: from deep_ep import Buffer"


def v1_blocks() -> list[str]:
    section = README.read_text().split("## DeepEP V1 `Buffer`", 1)[1].split("\n## ", 1)[0]
    blocks = [b for b in re.findall(r"```python\n(.*?)```", section, flags=re.S) if MARK in b]
    assert len(blocks) == 2, "the README's V1 section lost its Megatron-style and vLLM-style call sites"
    return blocks


def test_v1_blocks_switch_by_one_import():
    assert "- from deep_ep import Buffer\n+ from ep_torch import Buffer" in README.read_text()
    for block in v1_blocks():
        assert f"from ep_torch import Buffer  {MARK}" in block and "deep_ep" not in block.replace(MARK, "")


def _prelude(rank: int):
    g = torch.Generator().manual_seed(rank)
    num_experts, hidden, world = 8, 256, dist.get_world_size()
    x = torch.randn(6, hidden, generator=g).to(torch.bfloat16)
    topk_idx = torch.stack([torch.randperm(num_experts, generator=g)[:2] for _ in range(6)])
    topk_weights = torch.rand(6, 2, generator=g)

    def experts(recv_x, recv_topk_idx, recv_topk_weights, tokens_per_expert):
        return recv_x  # identity experts

    def masked_grouped_gemm(recv_x, scales, recv_count):
        # dequantize: identity experts on the FP8 rows
        s = scales.repeat_interleave(128, dim=-1)
        return (recv_x.float() * s).to(torch.bfloat16)

    return {
        "group": dist.group.WORLD,
        "num_experts": num_experts,
        "hidden": hidden,
        "world": world,
        "x": x,
        "topk_idx": topk_idx,
        "topk_weights": topk_weights,
        "experts": experts,
        "masked_grouped_gemm": masked_grouped_gemm,
    }


def _run_blocks(rank: int, n: int) -> None:
    normal, low_latency = v1_blocks()
    ns = _prelude(rank)
    exec(compile(normal, "README V1 normal", "exec"), ns)
    reached = ns["in_rank"].sum(1).float()[:, None]
    assert torch.equal(ns["combined_x"], (ns["x"].float() * reached).to(torch.bfloat16)), (
        "normal-mode call site"
    )
    ns = _prelude(rank)
    exec(compile(low_latency, "README V1 low-latency", "exec"), ns)
    assert ns["combined_x"].shape == ns["x"].shape and ns["combined_x"].dtype == torch.bfloat16
    # identity experts on FP8 rows: close to sum_k w_k * x (the FP8 round trip is not exact)
    want = ns["x"].float() * torch.where(ns["topk_idx"] >= 0, ns["topk_weights"], 0).sum(1, keepdim=True)
    torch.testing.assert_close(ns["combined_x"].float(), want, rtol=0.1, atol=0.1)
    dist.barrier()


def test_v1_readme_call_sites_run():
    from ep_torch_testing import run_script  # loaded by conftest.py

    code, out = run_script(__file__, ["_run_blocks", "2"], 300, what="README V1 call sites: ")
    assert code == 0, out[-4000:]


if __name__ == "__main__":
    from ep_torch_testing import spawn_cpu

    spawn_cpu(globals()[sys.argv[1]], int(sys.argv[2]))
