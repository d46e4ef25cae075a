"""CPU checks of benchmarks/bench_defer.py (issue 42): its command line, its rows and table, and one tiny run of the
whole loop on the CPU reference backend (the correctness checks it makes before timing included)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_defer.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_defer_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


bench = _load()


def plan(*argv: str):
    return bench.plan_from_args(bench.build_parser().parse_args(list(argv)))


def test_defaults_and_quick():
    p = plan()
    assert (p.tokens, p.iters, p.gemm, p.setups, p.cpu_syncs) == (
        4096, 100, (4096, 4096, 4096), ("one", "loopback"), (True, False),
    )  # fmt: skip
    q = plan("--quick", "--out", "/tmp/x")
    assert (q.tokens, q.iters, q.cpu_syncs, q.out) == (1024, 20, (True,), "/tmp/x")
    assert q.runs == [("one", True), ("loopback", True)]


def test_gemm_and_choices():
    assert plan("--gemm", "8192,1024,2048").gemm == (8192, 1024, 2048)
    assert plan("--gemm", "512").gemm == (512, 512, 512)
    assert plan("--setup", "one", "--cpu-sync", "0").runs == [("one", False)]
    for bad in (["--gemm", "1,2"], ["--gemm", "0"], ["--experts", "7"], ["--hidden", "100"]):
        with pytest.raises(SystemExit):
            plan(*bad)


def test_rows_and_table():
    host = {"dispatch": [10e-6, 30e-6, 20e-6], "combine": [5e-6]}
    rows = [
        bench.mode_row("one", True, "compute", [100e-6] * 3, 300e-6, {}),
        bench.mode_row("one", True, "comm", [40e-6] * 3, 120e-6, host),
        bench.mode_row("one", True, "plain", [140e-6, 150e-6, 130e-6], 420e-6, host),
        bench.mode_row("one", True, "deferred", [110e-6] * 3, 330e-6, {"dispatch": [2e-6]}),
    ]
    assert rows[2]["iter_us"] == pytest.approx(140) and rows[2]["mean_us"] == pytest.approx(140)
    assert rows[1]["host_dispatch_us"] == pytest.approx(20) and rows[0]["host_combine_us"] is None
    o = bench.overlap_row(rows)
    assert (o["serial_us"], o["ideal_us"]) == pytest.approx((140, 100))
    assert o["saved_us"] == pytest.approx(30) and o["overlap"] == pytest.approx(30 / 40)
    assert o["host_dispatch_deferred_us"] == pytest.approx(2)
    text = bench.table([*rows, o])
    assert "overlap" in text and "0.75" in text and len(text.splitlines()) == 7
    with pytest.raises(ValueError, match="comm"):
        bench.overlap_row([r for r in rows if r["mode"] != "comm"])


def test_dry_run_lists_the_rows(capsys):
    assert bench.main(["--dry-run", "--quick", "--setup", "loopback"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert json.loads(lines[0])["tokens"] == 1024
    assert lines[1:] == [f"loopback/cpu/{m}" for m in (*bench.MODES, "overlap")]


def test_tiny_run_on_the_cpu_reference(tmp_path):
    env = dict(os.environ)
    env.pop("EPKIT_TORCH_TRANSPORT", None)
    argv = "--device cpu --tokens 24 --hidden 64 --topk 4 --experts 8 --iters 2 --warmup 1 --gemm 32"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *argv.split(), "--cpu-sync", "both", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=240, env=env, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "bench_defer.json").read_text())["rows"]
    assert [(r["setup"], r["cpu_sync"], r["mode"]) for r in rows] == [
        (s, c, m) for s in ("one", "loopback") for c in (True, False) for m in (*bench.MODES, "overlap")
    ]
    assert all(r["iters"] == 2 for r in rows if r["mode"] != "overlap")
