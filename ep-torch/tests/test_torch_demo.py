"""ep-demo: a small run passes against the dense computation, a zero tolerance fails with a non-zero exit status,
and --help documents sizes, ranks and backend."""

from __future__ import annotations

import json

import pytest
from ep_torch import demo

SMALL = [
    "--ranks",
    "2",
    "--tokens",
    "16",
    "--hidden",
    "64",
    "--ffn",
    "32",
    "--experts",
    "4",
    "--topk",
    "2",
    "--no-progress",
]


def test_demo_small_run_passes(tmp_path, capfd):
    out = tmp_path / "summary.json"
    assert demo.main([*SMALL, "--steps", "2", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["ok"] and len(summary["steps"]) == 2
    step = summary["steps"][0]
    assert len(step["sent"]) == 2 and len(step["received"]) == 2
    assert sum(step["sent"]) == sum(step["received"]) > 0  # every sent (token, rank) pair arrives once
    assert 0 < summary["max_error"] <= 2e-2
    out_lines = capfd.readouterr().out.splitlines()  # printed by the parent and rank 0, a child process
    # status lines before the ranks' work, and (stdout is not a terminal here) the header and verdict unbroken
    assert "ep-demo: starting 2 ranks (cpu backend, torch.distributed over gloo)" in out_lines
    assert "ep-demo: 2 ranks up, buffer ready; loading torch's custom-op machinery" in out_lines
    assert any(
        line.startswith("ep-demo: 2 ranks, cpu backend, ") and line.endswith(")") for line in out_lines
    )
    # the planner's SM figure means nothing on the CPU backend: not printed there
    assert any(line.startswith("  tokens/rank <= 16,") and "planner SMs" not in line for line in out_lines)
    # it trains: the loss goes down, and the verdict says so
    assert summary["trained"] and summary["steps"][-1]["loss"] < summary["steps"][0]["loss"]
    assert any(
        line.startswith("PASS: loss ") and "(down)" in line and "tolerance" in line for line in out_lines
    )


def test_demo_fails_loudly():
    # bf16 communication cannot meet a 1e-9 tolerance: the verdict is FAIL and the exit status non-zero
    assert demo.main([*SMALL, "--steps", "1", "--tolerance", "1e-9"]) == 1


def test_demo_help_documents_options(capsys):
    with pytest.raises(SystemExit) as exc:
        demo.main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for option in (
        "--ranks",
        "--backend",
        "--tokens",
        "--hidden",
        "--experts",
        "--topk",
        "--steps",
        "cpu",
        "cuda",
    ):
        assert option in text


def test_demo_rejects_bad_sizes(capsys):
    assert demo.main(["--ranks", "3", "--experts", "4"]) == 2
    assert "multiple of --ranks" in capsys.readouterr().err


def test_dense_reference_matches_a_loop():
    import torch

    cfg = demo.DemoConfig(ranks=2, tokens=4, hidden=16, ffn=8, experts=4, topk=2)
    params = demo.init_params(cfg)
    xs, targets, idxs = [], [], []
    for r in range(2):
        x, t = demo.step_inputs(cfg, 0, r)
        idx, _ = demo.route(x, params["router"], cfg.topk)
        xs.append(x), targets.append(t), idxs.append(idx)
    ref = demo.dense_reference(xs, idxs, targets, params, demo.loss_scale(cfg))
    x = torch.cat(xs).double()
    idx = torch.cat(idxs)
    w = torch.softmax((x @ params["router"].double()).gather(1, idx), 1)
    for t in range(x.shape[0]):
        want = sum(
            w[t, k]
            * demo.expert_forward(x[t], params["w1"][idx[t, k]].double(), params["w2"][idx[t, k]].double())
            for k in range(cfg.topk)
        )
        torch.testing.assert_close(ref["out"][t], want)
