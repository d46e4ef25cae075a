"""CPU checks of benchmarks/profile_ops.py: `--register-combine` (inside its context the executor launches the direct
combine without dynamic shared memory, the register path, and the staged default comes back afterwards), and the
`--phases` pass accounting (the bytes each pass moves, counted from the routing: own rows carry only their tail in
the dispatch's send, the combine leaves them by reference; the rates over the pass's phase stamps)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "profile_ops.py"


def _load():
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("profile_ops_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_register_combine_context():
    from ep_core.kernels import rank_driver
    from ep_core.kernels.plan import KernelConfig

    prof = _load()
    cfg = KernelConfig(1, 8, 7168)
    staged = rank_driver._combine_smem(cfg)
    assert staged == cfg.combine_dynamic_smem_bytes > 0
    with prof.register_combine_launches(True):
        assert rank_driver._combine_smem(cfg) == 0
    assert rank_driver._combine_smem(cfg) == staged
    with prof.register_combine_launches(False):
        assert rank_driver._combine_smem(cfg) == staged


def test_own_pairs_counts_destinations_once():
    torch = pytest.importorskip("torch")
    prof = _load()
    epr = prof.bench_ep.NUM_EXPERTS // 2
    # rank 0: token 0 -> ranks 0 and 1 (twice to rank 1), token 1 -> rank 1 only, token 2 -> nowhere (-1)
    idx0 = torch.tensor([[0, epr, epr + 1], [epr, -1, -1], [-1, -1, -1]])
    # rank 1: token 0 -> rank 1 (its own) only
    idx1 = torch.tensor([[epr + 2, -1, epr + 3], [-1, -1, -1], [-1, -1, -1]])
    assert prof.own_pairs([idx0, idx1], 2) == (4, 2)
    # bench_ep's sent / received pairs per rank come from the same matrix (a -1 lane is no pair to rank 0)
    assert prof.bench_ep.pairs_per_rank([idx0, idx1], 2) == ([3, 1], [1, 3])


def test_pass_bytes_follow_the_kernels():
    torch = pytest.importorskip("torch")
    ep_layout = pytest.importorskip("ep_layout")
    prof = _load()
    n, t = 2, 3
    epr = prof.bench_ep.NUM_EXPERTS // n
    idxs = [torch.full((t, prof.bench_ep.TOPK), -1, dtype=torch.int64) for _ in range(n)]
    idxs[0][0, 0] = 0  # own row
    idxs[0][1, 0] = epr  # to rank 1
    moved = prof.pass_bytes(idxs, n, t, fp8=False)
    H, K = prof.bench_ep.HIDDEN, prof.bench_ep.TOPK
    d_tok = ep_layout.make_dispatch_token_layout(H, 2, 0, K).get_num_bytes()
    read, written = moved["dispatch"][("dispatch", "send")]
    assert read == n * t * 2 * H  # every token's hidden part is loaded
    assert written == d_tok + (d_tok - 2 * H)  # one whole row, one tail
    assert moved["dispatch"][("epilogue", "copy")][0] == 2 * d_tok
    _read, zwritten = moved["dispatch_zero_copy"][("dispatch", "send")]
    assert zwritten > 2 * 2 * H  # both rows whole
    assert moved["combine"][("combine", "send")][0] == 2 * H  # the own row stays by reference
    assert moved["combine"][("combine", "reduce")][1] == n * t * 2 * H


def test_pass_rates_use_the_pass_slots():
    prof = _load()
    phases = {
        "combine": {
            "slots": {
                4: {"mean_us": 10.0, "max_rank_us": 12.0},
                11: {"mean_us": 8.0, "max_rank_us": 16.0},
                12: {"mean_us": 30.0, "max_rank_us": 40.0},
            }
        },
    }
    rates = prof.pass_rates(phases, {("combine", "send"): (1000, 3000), ("combine", "reduce"): (2000, 2000)})
    assert rates["combine send"]["us"] == 8.0
    assert rates["combine send"]["gbs"] == pytest.approx(4000 / 8e3)
    assert rates["combine send"]["gbs_slowest_rank"] == pytest.approx(4000 / 16e3)
    assert rates["combine reduce"]["us"] == 20.0
    assert rates["combine reduce"]["write_gbs"] == pytest.approx(2000 / 20e3)
    # a kernel the op did not run has no rate
    assert prof.pass_rates({}, {("epilogue", "copy"): (1, 1)}) == {}


def test_phase_reader_merges_every_instance_of_the_domain(monkeypatch):
    """An op may run kernels of two instances (an FP8 dispatch's, the bf16 combine's): the reader zeroes and reads
    the stamps of every loaded instance of the rank count, each library once, and merges them."""
    import collections
    import ctypes
    import types

    np = pytest.importorskip("numpy")
    from ep_core.kernels import _cuda, _source

    prof = _load()
    size = 8 * prof.PHASE_MAX_RANKS * len(prof.PHASE_KERNELS) * prof.PHASE_SLOTS
    stamps = {lib: np.full(size // 8, 9, dtype=np.uint64) for lib in ("fp8", "bf16", "ep4")}

    class Driver:
        def cuLibraryGetGlobal(self, lib, name):
            assert name == b"ep_core_phase_ts"
            return stamps[lib].ctypes.data, size

        def cuMemsetD8(self, ptr, value, n):
            ctypes.memset(ptr, value, n)

        def cuMemcpyDtoH(self, dst, src, n):
            ctypes.memmove(dst, src, n)

    def kernels(lib):
        return types.SimpleNamespace(
            dispatch=types.SimpleNamespace(module=types.SimpleNamespace(_library=lib))
        )

    Config = collections.namedtuple("Config", "num_ranks is_hybrid tag")
    loaded = {
        Config(8, False, 1): kernels("fp8"),
        Config(8, False, 2): kernels("bf16"),
        Config(8, False, 3): kernels("bf16"),  # another config of the same library: read once
        Config(4, False, 4): kernels("ep4"),  # another domain: not read
    }
    monkeypatch.setattr(_cuda, "driver", lambda: Driver())
    monkeypatch.setattr(_cuda, "check", lambda result, what: result)
    monkeypatch.setattr(_source, "_loaded", loaded)
    reader = prof.PhaseReader(8)
    assert len(reader.ptrs) == 2
    reader.zero()
    assert not stamps["fp8"].any() and not stamps["bf16"].any() and stamps["ep4"].all()
    stamps["fp8"].reshape(prof.PHASE_MAX_RANKS, len(prof.PHASE_KERNELS), prof.PHASE_SLOTS)[3, 0, 5] = 11
    stamps["bf16"].reshape(prof.PHASE_MAX_RANKS, len(prof.PHASE_KERNELS), prof.PHASE_SLOTS)[3, 2, 4] = 22
    got = reader.read()
    assert got[3, 0, 5] == 11 and got[3, 2, 4] == 22 and int(got.sum()) == 33


def test_phase_op_names_the_slowest_rank(monkeypatch, capsys):
    import types

    np = pytest.importorskip("numpy")
    prof = _load()
    shape = (prof.PHASE_MAX_RANKS, len(prof.PHASE_KERNELS), prof.PHASE_SLOTS)

    class Reader:
        def __init__(self, num_ranks):
            self.replay = 0

        def zero(self):
            pass

        def read(self):
            self.replay += 1
            ts = np.zeros(shape, dtype=np.uint64)
            ts[:2, 0, 0] = 1000  # both ranks' dispatch kernels start at 1 us
            ts[0, 0, 11] = 1000 + 5000  # rank 0's sends end 5 us later
            ts[1, 0, 11] = 1000 + (9000 if self.replay != 2 else 4000)  # rank 1's 9 us later, but in replay 2
            return ts

    monkeypatch.setattr(prof, "PhaseReader", Reader)
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(synchronize=lambda: None))
    out = prof.phase_op(fake_torch, lambda: None, 3, 2)
    send = out["dispatch"]["slots"][11]
    assert send["rank_us"] == {0: 5.0, 1: pytest.approx((9 + 4 + 9) / 3)}
    assert (send["slowest_rank"], send["slowest_rank_replays"]) == (1, 2)
    prof.print_phases(2, 8, "dispatch", out)
    assert "slowest rank 1 in 2 replays" in capsys.readouterr().out
