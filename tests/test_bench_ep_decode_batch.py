"""CPU checks of bench_ep.py's decode GPU time (issue 17): rows timed as back-to-back graph replays carry the old
one-replay time (host submission included) beside it, in the JSON row, the progress line and a labelled last
table column; rows without it print as before."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_ep.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_ep_decode_batch_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


bench = _load()


def test_decode_row_keeps_one_replay_time():
    r = bench.make_row(
        1, False, "uniform", "dispatch", 16, 0.03, 10**6, 0.4, 4000.0, 8.0, decode=True, single_ms=0.04
    )
    assert r["time_us"] == pytest.approx(30.0)
    assert r["time_us_1replay"] == pytest.approx(40.0)
    assert "(1 replay incl. submit   40.0 us)" in bench.progress_line(r)
    lines = bench.table_lines([r], decode=True)
    assert lines[0].endswith("| x torch | 1-replay us (incl. submit) |")
    assert lines[1].count("---") == 12
    assert lines[2].endswith("| 30.0 | 0.2 | 33 | 0.8 | 400.0 | 13.33 | 40.0 |")


def test_mixed_rows_and_plain_rows():
    timed = bench.make_row(8, False, "uniform", "combine", 8, 0.1, 10**6, 0.5, 4000.0, 8.0, True, 0.11)
    eager = bench.make_row(8, False, "uniform", "combine_eager", 8, 0.2, 10**6, 0.5, 4000.0, 8.0, True)
    assert "time_us_1replay" not in eager
    lines = bench.table_lines([timed, eager], decode=True)
    assert lines[2].endswith(" 110.0 |") and lines[3].endswith(" - |")
    plain = bench.table_lines([eager], decode=True)
    assert "1-replay" not in plain[0]  # the table of rows without it is unchanged


def test_batch_default():
    assert bench.DECODE_BATCH >= 10
    assert "back to back" in bench.__doc__


def test_back_to_back_batch_is_queued_behind_the_hold():
    """The hold comes first, then the start event, every launch, the check, the stop event; ms is per launch."""
    calls = []
    ms, host_us, hidden = bench.time_back_to_back(
        lambda us: calls.append(("hold", us)),
        lambda: calls.append("start"),
        lambda: calls.append("launch"),
        lambda: calls.append("stop"),
        lambda: calls.append("query") or False,  # the start event has not run yet: submission hidden
        lambda: calls.append("elapsed") or 2.0,
        4,
        300.0,
    )
    assert calls == [("hold", 300.0), "start"] + ["launch"] * 4 + ["query", "stop", "elapsed"]
    assert ms == pytest.approx(0.5) and host_us >= 0 and hidden is True
    _, _, late = bench.time_back_to_back(
        lambda us: None, lambda: None, lambda: None, lambda: None, lambda: True, lambda: 1.0, 2, 1.0
    )
    assert late is False  # the start event ran before the last launch was queued: flagged


def test_partly_hidden_batches_are_flagged():
    r = bench.make_row(1, False, "uniform", "combine", 16, 0.012, 10**6, 0.07, 4000.0, 8.0, True, 0.024)
    assert "submission hidden" not in bench.progress_line(r)
    r.update({"batch_submit_hidden": 0.5, "batch_host_us_per_launch": 14.0})
    assert "[submission hidden in 50% of batches]" in bench.progress_line(r)


def _plan(*argv):
    return bench.plan_from_args(bench.build_parser().parse_args(list(argv)))


def test_ranks_and_sms_select_the_sweep():
    p = _plan("--decode", "--quick", "--ranks", "1", "--sms", "8,16,32,132")
    assert [(c.ranks, c.fp8, c.sms) for c in p.configs] == [(1, False, (8, 16, 32, 132))]
    assert p.json_name == "bench_ep_decode_ep1_sms8-16-32-132.json"
    full = _plan("--decode", "--ranks", "8", "--sms", "8")
    assert [(c.ranks, c.fp8, c.sms) for c in full.configs] == [(8, False, (8,)), (8, True, (8,))]
    assert _plan("--decode").json_name == "bench_ep_decode.json"  # unchanged without them
    with pytest.raises(SystemExit):
        _plan("--decode", "--ranks", "4")
    with pytest.raises(SystemExit):
        _plan("--decode", "--sms", "0")


def test_graph_floor_column():
    """A row with the graph floor (a graph of the op's shape with one-block kernels) prints it on the progress line
    and in the last column; rows without it print '-' there, a table without any has no such column."""
    r = bench.make_row(8, False, "uniform", "dispatch", 8, 0.093, 10**6, 3.0, 4000.0, 8.0, True, 0.1)
    r.update({"graph_kernels": 16, "graph_floor_us": 12.34})
    assert "graph floor  12.3 us" in bench.progress_line(r)
    eager = bench.make_row(8, False, "uniform", "dispatch_eager", 8, 0.8, 10**6, 3.0, 4000.0, 8.0, True)
    lines = bench.table_lines([r, eager], decode=True)
    assert lines[0].endswith("| 1-replay us (incl. submit) | graph floor us |")
    assert lines[1].count("---") == 13
    assert lines[2].endswith("| 100.0 | 12.3 |") and lines[3].endswith("| - | - |")
    assert "graph floor" not in bench.table_lines([eager], decode=True)[0]


class _FakeDriver:
    """cuGraphGetNodes / cuGraphNodeGetType as cuda.bindings returns them: (CUresult, ...)."""

    class CUgraphNodeType:
        CU_GRAPH_NODE_TYPE_KERNEL = "kernel"

    class CUresult:
        CUDA_SUCCESS = 0

    def __init__(self, kinds):
        self.kinds = kinds

    def cuGraphGetNodes(self, graph, count):
        nodes = list(range(len(self.kinds)))[:count]
        return 0, nodes, len(self.kinds)

    def cuGraphNodeGetType(self, node):
        return 0, self.kinds[node]


def test_graph_kernel_count_counts_kernel_nodes_only():
    fake = _FakeDriver(["kernel", "event", "kernel", "memset", "kernel"])
    assert bench.graph_kernel_count(fake, object()) == 3
    fake.cuGraphNodeGetType = lambda node: (1, None)
    with pytest.raises(RuntimeError, match="cuGraphNodeGetType failed"):
        bench.graph_kernel_count(fake, object())
