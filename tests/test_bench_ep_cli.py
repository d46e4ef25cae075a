"""CPU checks of benchmarks/bench_ep.py's command line: the run it plans (tokens, domains, SM sweeps, output file
names) and the rows and lines it prints, without touching CUDA."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_ep.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_ep_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


bench = _load()


def plan(*argv: str):
    return bench.plan_from_args(bench.build_parser().parse_args(list(argv)))


def as_tuples(p):
    return [(c.ranks, c.fp8, c.routing, c.sms) for c in p.configs]


def test_default_run_is_unchanged():
    p = plan()
    assert (p.decode, p.quick, p.tokens, p.iters, p.torch_iters) == (False, False, 4096, 10, 3)
    assert (p.json_name, p.png_name, p.out) == ("bench_ep.json", "bench_ep.png", "bench-out")
    expected = []
    for fp8 in (False, True):
        for kind in ("uniform", "unbalanced"):
            expected.append((8, fp8, kind, (4, 8, 16)))
            expected.append((1, fp8, kind, (4, 8, 16, 32, 64)))
    assert as_tuples(p) == expected


def test_default_quick_is_unchanged():
    p = plan("--quick", "--out", "/tmp/x", "--iters", "4")
    assert as_tuples(p) == [(8, False, "uniform", (16,)), (1, False, "uniform", (16,))]
    assert (p.tokens, p.iters, p.json_name, p.out) == (4096, 4, "bench_ep.json", "/tmp/x")


def test_decode_preset():
    p = plan("--decode")
    assert (p.decode, p.tokens, p.iters, p.torch_iters) == (True, 128, 30, 10)
    assert (p.json_name, p.png_name) == ("bench_ep_decode.json", "bench_ep_decode.png")
    assert as_tuples(p) == [
        (8, False, "uniform", (4, 8, 16)),
        (1, False, "uniform", (8, 16, 32)),
        (8, True, "uniform", (4, 8, 16)),
        (1, True, "uniform", (8, 16, 32)),
    ]
    q = plan("--decode", "--quick")
    assert as_tuples(q) == [(8, False, "uniform", (8,)), (1, False, "uniform", (16,))]
    assert q.json_name == "bench_ep_decode.json"


@pytest.mark.parametrize(
    ("argv", "tokens", "stem"),
    [
        (("--tokens", "4096"), 4096, "bench_ep"),
        (("--tokens", "1024"), 1024, "bench_ep_t1024"),
        (("--decode", "--tokens", "128"), 128, "bench_ep_decode"),
        (("--decode", "--tokens", "64"), 64, "bench_ep_decode_t64"),
        (("--tokens", "32", "--decode"), 32, "bench_ep_decode_t32"),
    ],
)
def test_tokens_override_and_names(argv, tokens, stem):
    p = plan(*argv)
    assert p.tokens == tokens
    assert (p.json_name, p.png_name) == (f"{stem}.json", f"{stem}.png")
    # names never collide across modes
    assert p.decode == ("--decode" in argv)
    assert (p.stem == "bench_ep") == (not p.decode and tokens == 4096)


@pytest.mark.parametrize("bad", ["0", "-3", "abc", "1.5"])
def test_bad_counts_rejected(bad, capsys):
    for flag in ("--tokens", "--iters"):
        with pytest.raises(SystemExit) as e:
            plan(flag, bad)
        assert e.value.code == 2
        assert "expected a positive integer" in capsys.readouterr().err


def test_help_documents_decode(capsys):
    with pytest.raises(SystemExit) as e:
        bench.build_parser().parse_args(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for word in ("--decode", "--tokens", "bench_ep_decode.json", "T=128", "--quick"):
        assert word in text
    assert "--decode" in bench.__doc__ and "bench_ep_decode.json" in bench.__doc__


def _old_progress_line(n, dtype, kind, op, sms, ms, gbs, frac, base):
    """The line the script printed before the decode mode existed (kept byte for byte)."""
    return (
        f"EP{n:<2} {dtype:4} {kind:10} {op:22} sms/rank {sms:3}  {ms:8.3f} ms  {gbs:7.0f} GB/s  "
        f"{100 * frac:5.1f}% ceil  torch {base:8.3f} ms  x{(base / ms) if base == base else 0:5.2f}"
    )


def test_throughput_rows_and_lines_unchanged():
    r = bench.make_row(8, True, "uniform", "dispatch", 16, 0.5, 3_000_000_000, 2.0, 4000.0, 5.25)
    assert set(r) == {
        "ranks",
        "dtype",
        "routing",
        "op",
        "sms_per_rank",
        "sms_total",
        "time_ms",
        "bytes",
        "gbs",
        "frac_ceiling",
        "torch_ms",
        "speedup_vs_torch",
        "pairs_per_token",
    }
    assert r["gbs"] == pytest.approx(6000.0) and r["frac_ceiling"] == pytest.approx(1.5)
    assert r["speedup_vs_torch"] == pytest.approx(4.0) and r["sms_total"] == 128
    assert bench.progress_line(r) == _old_progress_line(
        8, "fp8", "uniform", "dispatch", 16, 0.5, r["gbs"], r["frac_ceiling"], 2.0
    )
    nan = bench.make_row(1, False, "unbalanced", "combine", 4, 0.25, 10**9, float("nan"), 4000.0, 1.0)
    assert nan["speedup_vs_torch"] is None
    assert bench.progress_line(nan) == _old_progress_line(
        1, "bf16", "unbalanced", "combine", 4, 0.25, nan["gbs"], nan["frac_ceiling"], float("nan")
    )
    lines = bench.table_lines([r, nan])
    assert lines[0] == "| EP | dtype | routing | op | SMs/rank | ms | GB/s | % ceiling | torch ms | x torch |"
    assert lines[2] == "| 8 | fp8 | uniform | dispatch | 16 | 0.500 | 6000 | 150.0 | 2.00 | 4.00 |"
    assert lines[3] == "| 1 | bf16 | unbalanced | combine | 4 | 0.250 | 4000 | 100.0 | - | - |"


def test_decode_rows_in_microseconds_with_floor():
    # 40 MB at a 4000 GB/s ceiling: floor 10 us; measured 0.05 ms = 50 us; torch 0.4 ms = 400 us
    r = bench.make_row(
        8, False, "uniform", "dispatch_cached", 4, 0.05, 40_000_000, 0.4, 4000.0, 5.0, decode=True
    )
    assert r["time_ms"] == 0.05 and r["torch_ms"] == 0.4
    assert r["time_us"] == pytest.approx(50.0)
    assert r["floor_us"] == pytest.approx(10.0)
    assert r["torch_us"] == pytest.approx(400.0)
    assert r["frac_ceiling"] == pytest.approx(r["floor_us"] / r["time_us"])
    line = bench.progress_line(r)
    assert "    50.0 us" in line and "floor   10.0 us" in line and "torch    400.0 us" in line
    assert "x 8.00" in line and " ms" not in line
    lines = bench.table_lines([r], decode=True)
    assert lines[0].split(" | ")[5:8] == ["us", "floor us", "GB/s"]
    assert (
        lines[2] == "| 8 | bf16 | uniform | dispatch_cached | 4 | 50.0 | 10.0 | 800 | 20.0 | 400.0 | 8.00 |"
    )
    fp8_comb = bench.make_row(
        1, True, "uniform", "combine", 8, 0.02, 10**6, float("nan"), 4000.0, 1.0, decode=True
    )
    assert math.isnan(fp8_comb["torch_us"])
    assert bench.table_lines([fp8_comb], decode=True)[2].endswith("| - | - |")


def test_import_is_lazy_and_skips_without_gpu(tmp_path):
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('b', {str(SCRIPT)!r})\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['b'] = m; spec.loader.exec_module(m)\n"
        "m.plan_from_args(m.build_parser().parse_args(['--decode']))\n"
        "assert 'torch' not in sys.modules and 'ep_core' not in sys.modules, 'eager import'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    if _has_cuda():
        pytest.skip("a GPU is present: main() would run the benchmark")
    assert bench.main(["--decode", "--out", str(tmp_path / "o")]) == 0
    assert not (tmp_path / "o").exists()


def _has_cuda() -> bool:
    try:
        import torch
    except Exception:
        return False
    return torch.cuda.is_available()


def test_hybrid_preset():
    p = plan("--hybrid")
    assert (p.hybrid, p.decode, p.tokens, p.torch_iters) == (True, False, 4096, 0)
    assert (p.json_name, p.png_name) == ("bench_ep_hybrid.json", "bench_ep_hybrid.png")
    assert [(c.ranks, c.fp8, c.scaleup) for c in p.configs] == [
        (8, False, 4),
        (8, False, 2),
        (8, False, None),
        (8, True, 4),
        (8, True, 2),
        (8, True, None),
    ]
    assert [(c.fp8, c.scaleup) for c in plan("--hybrid", "--quick").configs] == [
        (False, 4),
        (False, 2),
        (False, None),
    ]
    with pytest.raises(SystemExit, match="separate runs"):
        plan("--hybrid", "--decode")


def test_cross_node_pairs_counts_each_node_once():
    torch = pytest.importorskip("torch")
    # 4 ranks as 2 nodes x 2; 256 experts -> 64 per rank. Source rank 0 (node 0):
    # token 0 -> ranks 2 and 3 (node 1): one node pair, two rank pairs; token 1 -> rank 1 only (its own node);
    # token 2 -> rank 2 and a -1 lane; token 3 -> nothing.
    idx0 = torch.tensor([[128, 192], [64, 65], [130, -1], [-1, -1]])
    none = torch.full((4, 2), -1)
    by_node, by_rank = bench.cross_node_pairs([idx0, none, none, none], 4, 2)
    assert (by_node, by_rank) == (2, 3)


def test_hybrid_table_names_topology_and_crossing_bytes():
    r = bench.make_row(8, False, "uniform", "dispatch", 16, 0.5, 2_000_000_000, float("nan"), 4000.0, 5.0)
    r.update(
        scaleup_ranks=4,
        cross_node_pairs=1000,
        cross_node_bytes=15_000_000,
        cross_node_rank_pairs=2500,
        qps=129,
    )
    d = bench.make_row(8, False, "uniform", "dispatch", 16, 0.4, 2_000_000_000, float("nan"), 4000.0, 5.0)
    d["scaleup_ranks"] = None
    lines = bench.table_lines([r, d])
    assert lines[0].startswith("| topology | dtype | op |")
    assert lines[2] == "| 2x4 | bf16 | dispatch | 16 | 0.500 | 4000 | 100.0 | 15.0 | 1000 | 2500 | 129 |"
    assert lines[3].startswith("| direct | bf16 | dispatch | 16 | 0.400 |") and lines[3].endswith(
        "| - | - | - | - |"
    )


def test_no_overlap_names_its_files_and_keeps_the_domains():
    """`--no-overlap` (prefer_overlap_with_compute=False) benchmarks the same domains and SM counts under other
    file names; the default run keeps the overlap placement."""
    assert plan().overlap is True
    p = plan("--ranks", "8", "--no-overlap")
    assert p.overlap is False and p.json_name == "bench_ep_ep8_no-overlap.json"
    assert as_tuples(p) == as_tuples(plan("--ranks", "8"))
    d = plan("--decode", "--ranks", "8", "--sms", "8", "--no-overlap")
    assert (d.overlap, d.json_name) == (False, "bench_ep_decode_ep8_sms8_no-overlap.json")
