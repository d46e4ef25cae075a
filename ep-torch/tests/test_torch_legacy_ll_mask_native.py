"""V1 low-latency rank masking (``Buffer(enable_shrink=True)``, issue 44) on CUDA with the native kernels
(``ll_native=True``, ``legacy.ll_shrink.NativeShrink``, the mask in ``include/ep_core/ll_native.cuh``): on a loopback
group, bitwise against ``ep_torch.legacy.reference`` with the masked ranks' experts dropped (the CPU backend's
semantics, test_torch_legacy_ll_mask.py): masking by the user (a rank sits out, query, clean, rejoin, the hook
split, FP8, LogFMT, a rank without tokens), a rank that stops calling (masked by the others after the GPU timeout,
a warning naming it, then rejoined by clean), the refusals. The GPU tests skip without a GPU; the host logic
(the herr merge, the unmask rule, where enable_shrink is refused) runs on the CPU."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from ep_core.errors import EPStateError
from ep_core.rank_mask import RankMaskedWarning
from ep_torch.legacy.reference import (
    bf16_to_f32,
    f32_to_bf16,
    fp8_cast_reference,
    ll_combine_reference,
    ll_expected_rows,
)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
T, H, K, E, M = 6, 512, 3, 12, 8  # H: LogFMT's multiple of 512; E: a multiple of 2, 3 and 4 ranks


def _inputs(rank: int, seed: int):
    """bf16 x below 1 in magnitude (LogFMT encodes its chunks), top-k ids with a -1 lane, a token selecting nothing
    and a token naming an expert twice, float32 weights; at seed 7 rank 0 has no tokens."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    x = (torch.rand(T, H, generator=g) - 0.5).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    idx[0, 1] = -1
    idx[T - 1] = -1
    idx[2, 2] = idx[2, 0]
    w = torch.rand(T, K, generator=g)
    t = 0 if (seed, rank) == (7, 0) else T
    return x[:t], idx[:t], w[:t]


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16)


def _coef(e: int) -> float:
    return 1.0 + e / 8.0


def _dropped(idx: np.ndarray, lost: set[int], n: int) -> np.ndarray:
    epr = E // n
    return np.where((idx >= 0) & np.isin(idx // epr, list(lost)), -1, idx)


def _want_rows(rank: int, n: int, seed: int, sent: set[int]):
    idxs = [
        _dropped(_inputs(r, seed)[1].numpy(), sent, n) if r not in sent else np.full((T, K), -1)
        for r in range(n)
    ]
    return ll_expected_rows(idxs, rank, E)


def _check_dispatch(rank, n, seed, sent, recv, cnt, handle, fp8: bool, what: str) -> None:
    for e, rows in enumerate(_want_rows(rank, n, seed, sent)):
        c = len(rows)
        assert int(cnt[e]) == c, f"{what} rank {rank}: recv_count[{e}]={int(cnt[e])}, want {c}"
        if c and not fp8:
            ref = np.stack([_bits(_inputs(s, seed)[0][t]) for s, t in rows])
            assert np.array_equal(_bits(recv[e, :c]), ref), f"{what} rank {rank}: rows of expert {e}"
        elif c:
            q, s = recv
            rq, rs = fp8_cast_reference(
                np.stack([_bits(_inputs(r, seed)[0][t]) for r, t in rows]), True, False
            )
            assert np.array_equal(q[e, :c].cpu().view(torch.uint8).numpy(), rq), f"{what}: fp8 expert {e}"
            got_s = s[e, :c].cpu().contiguous().numpy()
            assert np.array_equal(got_s.view(np.int32), rs.view(np.int32)), f"{what}: scales of expert {e}"
        if fp8:
            continue
        src_info, layout_range = handle[0].cpu(), handle[1].cpu()
        assert src_info[e, :c].tolist() == [t for _, t in rows], f"{what}: src_info of expert {e}"
        for s in range(n):
            v = int(layout_range[e, s])
            cc, off = sum(1 for r, _ in rows if r == s), sum(1 for r, _ in rows if r < s)
            assert (v >> 32, v & 0xFFFFFFFF) == (off, cc), f"{what} rank {rank}: layout_range[{e}, {s}]"


def _expert(recv: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    epr = E // n
    c = torch.tensor([_coef(rank * epr + e) for e in range(epr)], device=recv.device)
    return (recv.float() * c[:, None, None]).to(torch.bfloat16)


def _combine_ref(rank: int, n: int, seed: int, kept: set[int], logfmt: bool) -> np.ndarray:
    x, idx, w = _inputs(rank, seed)
    live = _dropped(idx.numpy(), kept, n)
    xf = bf16_to_f32(_bits(x))
    y = np.zeros((len(x), K, H), np.uint16)
    for t in range(len(x)):
        for k in range(K):
            if live[t, k] >= 0:
                y[t, k] = f32_to_bf16((xf[t] * np.float32(_coef(int(live[t, k])))).astype(np.float32))
    return ll_combine_reference(y, live, w.numpy(), use_logfmt=logfmt)


def _round(group, v1, n, seed, active, sent, kept, what, hook=False, fp8=False, logfmt=False):
    """One dispatch (+ combine unless ``fp8``) on the ``active`` ranks (the others sit out), checked bitwise.
    ``sent``: ranks masked before the dispatch; ``kept``: before the combine. Returns the handles."""
    dev = torch.device("cuda", torch.cuda.current_device())
    inp = [tuple(a.to(dev) for a in _inputs(r, seed)) for r in range(n)]

    def disp(r):
        if r not in active:
            return None
        return v1[r].low_latency_dispatch(
            inp[r][0], inp[r][1], M, E, use_fp8=fp8, round_scale=fp8, return_recv_hook=hook
        )

    outs = group.run(disp)
    if hook:
        group.run(lambda r: outs[r][4]() if r in active else None)
    torch.cuda.synchronize()
    for r in active:
        recv, cnt, handle, _, _ = outs[r]
        _check_dispatch(r, n, seed, sent, recv, cnt.cpu(), handle, fp8, what)
    if fp8:
        return [None if o is None else o[2] for o in outs]

    def comb(r):
        if r not in active:
            return None
        recv, _, handle, _, _ = outs[r]
        return v1[r].low_latency_combine(
            _expert(recv, r, n), inp[r][1], inp[r][2], handle, use_logfmt=logfmt, return_recv_hook=hook
        )

    cs = group.run(comb)
    if hook:
        group.run(lambda r: cs[r][2]() if r in active else None)
    torch.cuda.synchronize()
    for r in active:
        bad = np.argwhere(_bits(cs[r][0]) != _combine_ref(r, n, seed, kept, logfmt))
        assert not bad.size, f"{what} rank {r}: combine differs from the reference at {tuple(bad[0])}"
    return [None if o is None else o[2] for o in outs]


def _query(buf, n: int) -> list[int]:
    q = torch.full((n,), 7, dtype=torch.int32)
    buf.low_latency_query_mask_buffer(q)
    return q.tolist()


def _group(n: int, timeout: float = 20.0):
    from ep_torch.loopback import LoopbackGroup

    torch.cuda.set_device(0)
    group = LoopbackGroup(n, device="cuda", gpu_timeout_secs=timeout, timeout_secs=120.0)
    v1 = group.v1_buffers(
        0, int(1e8), low_latency_mode=True, explicitly_destroy=True, ll_native=True, enable_shrink=True
    )
    return group, v1


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n", [2, 4])
def test_user_mask_native_gpu(n, monkeypatch):
    monkeypatch.setenv("EPKIT_NVLINK_GBS", "450")
    group, v1 = _group(n)
    every, d = set(range(n)), n - 1
    rest = every - {d}
    _round(group, v1, n, 0, every, set(), set(), "unmasked")
    assert v1[0]._ll_region is not None, "the native kernels ran"
    assert all(_query(v1[r], n) == [0] * n for r in range(n))
    for r in range(n):
        v1[r].low_latency_update_mask_buffer(d, True)
    assert _query(v1[0], n) == [int(r == d) for r in range(n)]
    # rank d sits out: the others neither send to it nor wait for it
    _round(group, v1, n, 1, rest, {d}, {d}, "masked")
    handles = _round(group, v1, n, 2, rest, {d}, {d}, "masked, hook", hook=True)
    _round(group, v1, n, 9, rest, {d}, {d}, "masked, fp8", fp8=True)
    _round(group, v1, n, 8, rest, {d}, {d}, "masked, logfmt", logfmt=True)
    _round(group, v1, n, 7, rest, {d}, {d}, "masked, no tokens on rank 0")
    with pytest.raises(EPStateError, match="low_latency_clean_mask_buffer"):
        v1[0].low_latency_update_mask_buffer(d, False)  # calls ran while it was masked: its epochs lag
    group.run(lambda r: v1[r].low_latency_clean_mask_buffer())  # every rank, d included: the epochs restart
    assert all(_query(v1[r], n) == [0] * n for r in range(n))
    _, idx, w = _inputs(0, 2)
    with pytest.raises(EPStateError, match=r"before\s+low_latency_clean_mask_buffer"):
        y = torch.zeros(E // n, n * M, H, dtype=torch.bfloat16, device="cuda")
        v1[0].low_latency_combine(y, idx.cuda(), w.cuda(), handles[0])
    _round(group, v1, n, 3, every, set(), set(), "after clean")
    _round(group, v1, n, 4, every, set(), set(), "after clean, hook", hook=True)
    for r in range(n):  # masked and unmasked with no call between: allowed alone
        v1[r].low_latency_update_mask_buffer(d, True)
        v1[r].low_latency_update_mask_buffer(d, False)
    _round(group, v1, n, 5, every, set(), set(), "after unmask")
    group.run(lambda r: v1[r].destroy())
    group.close()


@pytest.mark.gpu
@gpu
def test_lost_rank_masked_native_gpu(monkeypatch):
    """The target on CUDA: one of 4 ranks stops calling; the others mask it within the GPU timeout (the kernels'
    waits), warn naming it once at their next call (the same round's combine), and keep decoding with its experts dropped; clean on every rank
    brings it back."""
    monkeypatch.setenv("EPKIT_NVLINK_GBS", "450")
    n, lost, timeout = 4, 3, 2.0
    group, v1 = _group(n, timeout)
    every = set(range(n))
    rest = every - {lost}
    _round(group, v1, n, 0, every, set(), set(), "all")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # the dispatch waits expire: masked, and said at the rank's next call (this round's combine: no host sync)
        _round(group, v1, n, 1, rest, {lost}, {lost}, "rank 3 stopped")
        _round(group, v1, n, 2, rest, {lost}, {lost}, "rank 3 masked")  # said once only
    said = [str(c.message) for c in caught if issubclass(c.category, RankMaskedWarning)]
    assert len(said) == len(rest) and all(f"rank {lost} did not arrive" in m for m in said), said
    assert all(_query(v1[r], n) == [0, 0, 0, 1] for r in rest)
    group.run(lambda r: v1[r].low_latency_clean_mask_buffer())
    assert all(_query(v1[r], n) == [0] * n for r in range(n))
    _round(group, v1, n, 3, every, set(), set(), "rejoined")
    group.run(lambda r: v1[r].destroy())
    group.close()


def _proc_step(buf, rank: int, n: int, seed: int, sent: set[int], kept: set[int], what: str) -> None:
    x, idx, w = (a.cuda() for a in _inputs(rank, seed))
    recv, cnt, handle, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    torch.cuda.synchronize()
    _check_dispatch(rank, n, seed, sent, recv, cnt.cpu(), handle, False, what)
    comb, _, _ = buf.low_latency_combine(_expert(recv, rank, n), idx, w, handle)
    bad = np.argwhere(_bits(comb) != _combine_ref(rank, n, seed, kept, False))
    assert not bad.size, f"{what} rank {rank}: combine differs from the reference at {tuple(bad[0])}"


def _mask_lost_procs(rank: int, n: int) -> None:
    """4 processes sharing the GPU over ipc: rank 3's process ends at step 2 after its dispatch (before its combine).
    The others' combine waits on it expire (bound shortened to 3 s for the test): they mask it, finish the step with
    its experts dropped, warn naming it at their next call, and keep decoding."""
    import os
    import sys
    import time
    from datetime import timedelta

    import torch.distributed as dist
    from ep_torch.legacy import Buffer

    torch.cuda.set_device(0)
    os.environ.setdefault("EPKIT_NVLINK_GBS", "450")
    store = dist.distributed_c10d._get_default_store()
    buf = Buffer(None, 0, int(1e8), low_latency_mode=True, explicitly_destroy=True, transport="ipc",
                 ll_native=True, enable_shrink=True)  # fmt: skip
    lost, bound = 3, 3.0
    for step in range(5):
        if rank == lost and step == 2:
            x, idx, _ = (a.cuda() for a in _inputs(rank, step))
            buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
            torch.cuda.synchronize()
            os._exit(0)  # mid-step: after its dispatch, before its combine
        t0 = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _proc_step(
                buf,
                rank,
                n,
                step,
                {lost} if step > 2 else set(),
                {lost} if step >= 2 else set(),
                f"step {step}",
            )
        took = time.monotonic() - t0
        if step == 0:
            assert buf._ll_region is not None, "the native kernels ran"
            buf._ll_region.timeout_ms = int(
                bound * 1000
            )  # the kernels' wait bound (num_gpu_timeout_secs), for the test
        said = [str(c.message) for c in caught if issubclass(c.category, RankMaskedWarning)]
        if step == 3:  # reported at the next call after the kernels masked it (no host sync)
            assert len(said) == 1 and f"rank {lost} did not arrive" in said[0], said
        else:
            assert not said, said
        if step == 2:
            assert took < bound + 10, f"step 2 took {took:.1f} s (bound {bound} s)"
        if step > 2:
            assert took < bound, f"step {step} waited {took:.1f} s for a masked rank"
            assert _query(buf, n) == [0, 0, 0, 1], _query(buf, n)
    store.set(f"mask_native/done/{rank}", "1")
    if rank == 0:  # the store's host leaves last
        store.wait([f"mask_native/done/{r}" for r in (1, 2)], timedelta(seconds=120))
    sys.stdout.flush()
    os._exit(0)  # no barrier with the lost rank


@pytest.mark.gpu
@gpu
def test_lost_process_masked_native_gpu():
    """The target on CUDA with processes: one of 4 ipc processes sharing the GPU exits mid-loop."""
    import subprocess
    import sys

    try:
        proc = subprocess.run(
            [sys.executable, __file__, "_mask_lost_procs", "4"], capture_output=True, text=True, timeout=300
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"still running after 300 s (a hang):\n{str(exc.output)[-3000:]}")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


# ---------------------------------------------------------------------------------------------------------------------
# host logic (CPU)


class _Region:
    def __init__(self, n: int) -> None:
        self.herr = torch.zeros(4 + n, dtype=torch.int32)
        self.timeout_ms = 1500


def test_native_shrink_merge_and_unmask_rule(monkeypatch):
    from ep_torch.legacy.ll_shrink import NativeShrink

    s = NativeShrink(1, 4)
    dev = torch.zeros(5, dtype=torch.int32)
    monkeypatch.setattr(s, "device", lambda: dev)
    reg = _Region(4)
    reg.herr[4 + 2] = 1  # a kernel masked rank 2 in generation 0 (records generation + 1)
    with pytest.warns(
        RankMaskedWarning,
        match=r"rank 2 did not arrive within 1.5 s in a low-latency kernel's wait \(reported at low_latency_dispatch",
    ):
        s.merge(reg, "low_latency_dispatch")
    assert s.mask.masked_ranks() == {2: "timeout"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s.merge(reg, "low_latency_combine")  # taken once
    with pytest.raises(EPStateError, match="low_latency_clean_mask_buffer"):
        s.update(2, False)  # masked by a timeout: its epochs lag
    s.update(0, True)
    assert dev.tolist() == [1, 0, 0, 0, 0]
    s.update(0, False)  # no call since it was masked: allowed
    s.update(0, True)
    s.calls += 1
    with pytest.raises(EPStateError, match="cannot be unmasked alone"):
        s.update(0, False)
    s.clean(None, None)  # no region yet: the host and device masks only
    assert s.gen == 1 and not s.mask.any() and dev.tolist() == [0, 0, 0, 0, 1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s.merge(reg, "low_latency_dispatch")  # the record of generation 0 is stale now
    assert not s.mask.any()
    reg.herr[4 + 3] = 2
    with pytest.warns(RankMaskedWarning, match="rank 3"):
        s.merge(reg, "low_latency_combine")
    status = torch.zeros(4, dtype=torch.int32)
    dev[3] = 1
    s.query(reg, status, "low_latency_query_mask_buffer")
    assert status.tolist() == [0, 0, 0, 1]


def test_enable_shrink_where_refused():
    """CUDA masking runs on the native kernels only: the adapter (ll_native off) and nccl are refused by name; a
    loopback group needs CUDA and ll_native=True."""
    from ep_torch.legacy import Buffer
    from ep_torch.loopback import LoopbackGroup

    probe = Buffer.__new__(Buffer)
    assert probe._make_shrink("ipc", check_only=True, ll_native=True) is None
    with pytest.raises(NotImplementedError, match=r"transport ipc \(CUDA\) without ll_native=True"):
        probe._make_shrink("ipc", check_only=True, ll_native=None)
    with pytest.raises(NotImplementedError, match="transport nccl"):
        probe._make_shrink("nccl", check_only=True, ll_native=True)
    group = LoopbackGroup(2, device="cpu")
    with pytest.raises(NotImplementedError, match="a loopback group"):
        group.v1_buffers(0, 0, low_latency_mode=True, enable_shrink=True, ll_native=True)


def test_native_launch_arguments_match_the_signatures(monkeypatch):
    """The launchers' argument lists (the mask, then the signature word; ep_lln_clean: the mask last; ep_lln_abort)
    against ``ep_core.ll_native.SIGNATURES`` on the CPU: the kernels themselves need a GPU, their parameter lists do
    not."""
    pytest.importorskip("ep_jit")
    from ep_core import ll_native
    from ep_torch.legacy import ll_kernels

    seen: list[tuple[str, list]] = []

    def fake_launch(name, grid, block, values, **kw):
        seen.append((name, ll_native._args(name, values)))

    monkeypatch.setattr(ll_native, "launch", fake_launch)

    def init(self):
        self.device, self.stream = 0, 0

    monkeypatch.setattr(ll_kernels._Launch, "__init__", init)
    n, epr, m, h, k = 2, 3, 4, 256, 2

    reg = SimpleNamespace(
        num_ranks=n, epr=epr, m=m, hidden=h, num_topk=k, num_experts=n * epr, rank=0, own_base=4096,
        timeout_ms=1000, recv_blocks=4, send_blocks=4, next_half=0, peers=torch.zeros(n, dtype=torch.int64),
        herr=torch.zeros(ll_native.herr_words(n), dtype=torch.int32), take_half=lambda dispatch=False: 0,
        half_ptr=lambda half: 8192, seen=0,
    )  # fmt: skip
    reg.words = reg.herr.numpy()
    mask = torch.zeros(n + 1, dtype=torch.int32)
    x = torch.zeros(3, h, dtype=torch.bfloat16)
    idx = torch.zeros(3, k, dtype=torch.int64)
    for fp8, by_token in ((False, "0"), (True, "0"), (True, "1")):  # EPKIT_LL_OWN_BY_TOKEN=1: local_direct 2
        monkeypatch.setenv("EPKIT_LL_OWN_BY_TOKEN", by_token)
        out = ll_kernels.native_dispatch(reg, x, idx, fp8, fp8, False, None, by_token == "1", mask)
        out[-1]()
    src_info, layout_range, lanes, lane_pos = out[2], out[3], out[4], out[5]
    y = torch.zeros(epr, n * m, h, dtype=torch.bfloat16)
    for logfmt in (False, True):
        _, receive = ll_kernels.native_combine(
            reg, y, src_info, lanes, layout_range, idx, torch.zeros(3, k), None, lane_pos, False, logfmt, mask
        )
        receive()
    ll_kernels.native_clean(reg, mask, 1)
    for op in ("low_latency_dispatch", "low_latency_combine"):
        ll_kernels.native_abort(reg, op, ValueError("refused"))
    names = [name for name, _ in seen]
    assert set(names) == set(ll_native.KERNEL_NAMES), names
    for name, args in seen:
        if name not in ("ep_lln_cast_fp8", "ep_lln_abort"):
            at = -1 if name == "ep_lln_clean" else -2  # the exchanges: the signature word last
            assert int(args[at].value if hasattr(args[at], "value") else args[at]) == mask.data_ptr(), name


if __name__ == "__main__":
    import sys

    from ep_torch.launch import spawn

    spawn(globals()[sys.argv[1]], int(sys.argv[2]), *sys.argv[3:])


# ---------------------------------------------------------------------------------------------------------------------
# the masked kernels themselves on host threads (ll_native_emulation.cpp: CUDA's names shimmed, N ranks' regions in
# host memory): dispatch, combine (bf16 and LogFMT, with and without the local shortcut), a rank sitting out under
# the user's mask or lost (the waits expire and mask it), then ep_lln_clean on every rank and a round of all ranks


@pytest.fixture(scope="module")
def emulation(tmp_path_factory):
    import os
    import shutil
    import subprocess

    from ep_core.kernels._source import get_include

    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not found")
    exe = tmp_path_factory.mktemp("emu") / "ll_native_emulation"
    src = os.path.join(os.path.dirname(__file__), "ll_native_emulation.cpp")
    proc = subprocess.run(
        [gxx, "-std=c++20", "-O1", "-pthread", "-I", get_include(), src, "-o", str(exe)],
        capture_output=True,
        text=True,
    )
    if proc.returncode and "barrier" in proc.stderr:
        pytest.skip("g++ without C++20 <barrier>")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return exe


def _write_round(path, n: int, q: int, seed: int) -> None:
    """Round q's inputs of every rank for the emulation (x{q}, idx{q}, w{q}), padded to T rows selecting nothing."""
    xs, idxs, ws = [], [], []
    for r in range(n):
        x, idx, w = _inputs(r, seed)
        pad = T - len(x)
        xs.append(torch.cat([x, torch.zeros(pad, H, dtype=torch.bfloat16)]))
        idxs.append(torch.cat([idx, torch.full((pad, K), -1)]))
        ws.append(torch.cat([w, torch.zeros(pad, K)]))
    _bits(torch.stack(xs)).tofile(path / f"x{q}")
    torch.stack(idxs).numpy().astype(np.int64).tofile(path / f"idx{q}")
    torch.stack(ws).numpy().astype(np.float32).tofile(path / f"w{q}")


def _env(by_token: int) -> dict:
    """The emulation's environment: EP_EMU_OWN_BY_TOKEN=1 runs each receive with local_direct as 2 (own rows by
    token, EPKIT_LL_OWN_BY_TOKEN)."""
    import os

    return {**os.environ, "EP_EMU_OWN_BY_TOKEN": str(by_token)}


@pytest.mark.parametrize("direct,by_token", [(0, 0), (1, 0), (1, 1)])
def test_kernels_of_ranks_running_at_once(emulation, tmp_path, direct, by_token):
    """The kernels' protocol with the ranks' streams interleaving as on a GPU they share (the EP8 loopback decode
    step's shape: each rank's dispatch, other work, combine, while the other ranks are anywhere in theirs): each
    rank a process of its own over one shared mapping, random pauses before every kernel, every call the other
    half, a second dispatch every third round (so both ops use both halves); every round bitwise."""
    import subprocess

    n, rounds = 4, 6
    seeds = {q: 20 + q if q != 4 else 7 for q in range(1, rounds + 1)}  # round 4: rank 0 without tokens
    for q, seed in seeds.items():
        _write_round(tmp_path, n, q, seed)
    args = [str(emulation), "concurrent", str(tmp_path), *map(str, (n, E, T, K, H, M, direct, rounds, 5))]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, env=_env(by_token))
    assert proc.returncode == 0, proc.stderr[-3000:]
    epr = E // n
    for r in range(n):
        assert np.fromfile(tmp_path / f"err_{r}", np.int32).tolist() == [0] * 5, f"rank {r}: a wait expired"
        for q, seed in seeds.items():
            what = f"direct={direct} by_token={by_token} round {q} rank {r}"
            cnt = np.fromfile(tmp_path / f"c{q}_count_{r}", np.int32)
            recv = np.fromfile(tmp_path / f"c{q}_recv_{r}", np.uint16).reshape(epr, n * M, H)
            for e, rows in enumerate(_want_rows(r, n, seed, set())):
                assert cnt[e] == len(rows), f"{what}: recv_count[{e}]={cnt[e]}, want {len(rows)}"
                if rows:
                    ref = np.stack([_bits(_inputs(s, seed)[0][t]) for s, t in rows])
                    assert np.array_equal(recv[e, : len(rows)], ref), f"{what}: rows of expert {e}"
            t = len(_inputs(r, seed)[0])
            comb = np.fromfile(tmp_path / f"c{q}_comb_{r}", np.uint16).reshape(T, H)[:t]
            bad = np.argwhere(comb != _combine_ref(r, n, seed, set(), False))
            assert not bad.size, f"{what}: combine differs from the reference at {tuple(bad[0])}"


@pytest.mark.parametrize(
    "case,direct,logfmt,by_token",
    [
        ("nomask", 0, 0, 0),
        ("nomask", 1, 0, 0),
        ("nomask", 1, 0, 1),
        ("user", 0, 0, 0),
        ("user", 1, 0, 0),
        ("user", 1, 0, 1),
        ("user", 0, 1, 0),
        ("lost", 1, 0, 0),
        ("lost", 1, 0, 1),
        ("lost", 0, 1, 0),
        ("late", 1, 0, 0),
        ("late", 1, 0, 1),
        ("late", 0, 1, 0),
        ("one", 1, 0, 0),  # one rank with the local shortcut: the host launches no send (ll_kernels)
        ("one", 1, 0, 1),
        ("one", 0, 0, 0),
    ],
)
def test_masked_kernels_on_host_threads(emulation, tmp_path, case, direct, logfmt, by_token):
    import subprocess

    n, lost = (1, -1) if case == "one" else (4, 3)
    if case == "one":
        case = "nomask"
    epr = E // n
    use_mask = int(case != "nomask")
    rounds = 1 if case == "nomask" else 2
    umask = np.zeros((n, n), np.int32)
    if case == "user":
        umask[:, lost] = 1  # every rank masks it (it sits out)
    seeds = {1: 3, 2: 7}  # round 2: rank 0 without tokens (padded to T rows selecting nothing)
    for q, seed in seeds.items():
        _write_round(tmp_path, n, q, seed)
    umask.tofile(tmp_path / "umask")
    args = [
        str(emulation),
        str(tmp_path),
        *map(str, (n, E, T, K, H, M, use_mask, lost if case != "nomask" else -1)),
    ]
    args += [str(direct), str(logfmt), "40", str(rounds), str(int(case == "late"))]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, env=_env(by_token))
    assert proc.returncode == 0, proc.stderr[-3000:]

    def load(name, dtype):
        return np.fromfile(tmp_path / name, dtype=dtype)

    for q in range(1, rounds + 1):
        seed = seeds[q]
        gone = {lost} if q == 1 and case != "nomask" else set()
        for r in range(n):
            sent, kept = gone, gone
            if r in gone:
                if case != "late":
                    continue
                # late: the others sent to it before they masked it; their combines skip it, so it masks them
                sent, kept = set(), set(range(n)) - {lost}
            what = f"{case} direct={direct} logfmt={logfmt} by_token={by_token} round {q} rank {r}"
            cnt = load(f"r{q}_count_{r}", np.int32)
            rng_ = load(f"r{q}_range_{r}", np.int64).reshape(epr, n)
            src = load(f"r{q}_src_{r}", np.int32).reshape(epr, n * M)
            recv = load(f"r{q}_recv_{r}", np.uint16).reshape(epr, n * M, H)
            for e, rows in enumerate(_want_rows(r, n, seed, sent)):
                c = len(rows)
                assert cnt[e] == c, f"{what}: recv_count[{e}]={cnt[e]}, want {c}"
                if c:
                    ref = np.stack([_bits(_inputs(s, seed)[0][t]) for s, t in rows])
                    assert np.array_equal(recv[e, :c], ref), f"{what}: rows of expert {e}"
                assert src[e, :c].tolist() == [t for _, t in rows], f"{what}: src_info of expert {e}"
                for s in range(n):
                    v = int(rng_[e, s])
                    cc, off = sum(1 for a, _ in rows if a == s), sum(1 for a, _ in rows if a < s)
                    assert (v >> 32, v & 0xFFFFFFFF) == (off, cc), f"{what}: layout_range[{e}, {s}]"
            t = len(_inputs(r, seed)[0])
            comb = load(f"r{q}_comb_{r}", np.uint16).reshape(T, H)[:t]
            bad = np.argwhere(comb != _combine_ref(r, n, seed, kept, bool(logfmt)))
            assert not bad.size, f"{what}: combine differs from the reference at {tuple(bad[0])}"
            mask = load(f"mask{q}_{r}", np.int32)
            herr = load(f"herr{q}_{r}", np.int32)
            assert load(f"err{q}_{r}", np.int32)[0] == 0, f"{what}: the error word was raised"
            if q == 1:
                assert mask[:n].tolist() == [int(p in kept) for p in range(n)] or not use_mask, (
                    f"{what}: {mask}"
                )
                timed_out = sorted(kept) if case in ("lost", "late") else []
                assert [p for p in range(n) if herr[4 + p]] == timed_out, f"{what}: herr {herr}"
                assert all(herr[4 + p] == 1 for p in timed_out), f"{what}: records generation 0 + 1"
            else:  # after ep_lln_clean: every rank unmasked, generation 1, and nothing timed out since
                assert mask.tolist() == [0] * n + [1], f"{what}: mask after clean {mask}"


# ---------------------------------------------------------------------------------------------------------------------
# the kernels' signature words and abort (issue 41) on host threads: round 1 has one rank's fault, rounds 2 and 3
# follow with no ep_lln_clean, so the epochs must have stayed in step


@pytest.mark.parametrize(
    "fault,direct,by_token",
    [(1, 0, 0), (1, 1, 0), (1, 1, 1), (2, 0, 0), (2, 1, 0), (2, 1, 1), (3, 0, 0), (3, 1, 0), (3, 1, 1), (4, 0, 0),
     (4, 1, 0)],
    ids=["dispatch_sig", "dispatch_sig_direct", "dispatch_sig_by_token", "dispatch_abort", "dispatch_abort_direct",
         "dispatch_abort_by_token", "combine_sig", "combine_sig_direct", "combine_sig_by_token", "combine_abort",
         "combine_abort_direct"],
)  # fmt: skip
def test_signature_words_and_abort_on_host_threads(emulation, tmp_path, fault, direct, by_token):
    """Fault 1 / 3: the culprit's dispatch / combine carries another signature word (its FP8 / LogFMT bit); 2 / 4:
    it runs ep_lln_abort instead of its dispatch / combine. Every peer records (token, culprit, tag, its word, theirs)
    in herr's signature record without a timeout, the culprit records a peer where its own kernels ran, and the two
    rounds after it are bitwise exact with no record and no clean between."""
    import subprocess

    n, culprit = 4, 1
    seeds = {1: 3, 2: 7, 3: 5}
    for q, seed in seeds.items():
        _write_round(tmp_path, n, q, seed)
    np.zeros((n, n), np.int32).tofile(tmp_path / "umask")
    args = [str(emulation), "envelope", str(tmp_path), *map(str, (n, E, T, K, H, M, direct, culprit, fault))]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, env=_env(by_token))
    assert proc.returncode == 0, proc.stderr[-3000:]
    epr, base = E // n, 4 + n
    tag = 1 if fault in (1, 2) else 2
    # (epoch 1 * 2 + half) * 2 + op: the dispatch on half 0, the combine on half 1
    token = 4 if tag == 1 else 7
    theirs = {1: 1 << 16, 2: 0x80000001, 3: 1 << 18, 4: 0x80000001}[fault]
    for r in range(n):
        what = f"fault {fault} direct={direct} by_token={by_token} rank {r}"
        rec = [np.fromfile(tmp_path / f"herr{q}_{r}", np.int32)[base:].tolist() for q in (1, 2, 3)]
        for q in (1, 2, 3):
            herr = np.fromfile(tmp_path / f"herr{q}_{r}", np.int32)
            assert herr[:4].tolist() == [0, 0, 0, 0], f"{what}: a wait expired in round {q}: {herr}"
            assert np.fromfile(tmp_path / f"err{q}_{r}", np.int32)[0] == 0, f"{what}: err raised in round {q}"
        assert rec[1] == rec[0] and rec[2] == rec[0], f"{what}: a record after round 1: {rec}"
        if r != culprit:
            got = rec[0]
            assert got[:3] == [token, culprit, tag], f"{what}: record {got}"
            bits = 0xFFFF0000 if tag == 1 else 0xFFFFFFFF  # a dispatch's count is below its signature bits
            assert got[3] & bits == theirs & bits, f"{what}: their word {got}"
            assert got[4] == 0, f"{what}: this rank's word {got}"
        elif fault in (1, 3):  # its kernels ran: it sees the peers' words differ from its own
            assert rec[0][0] == token and rec[0][1] != culprit and rec[0][2] == tag, (
                f"{what}: record {rec[0]}"
            )
        else:  # it refused the call: no kernel of it ran, no record
            assert rec[0] == [0] * 5, f"{what}: record {rec[0]}"
        for q in (2, 3):
            seed = seeds[q]
            cnt = np.fromfile(tmp_path / f"r{q}_count_{r}", np.int32)
            recv = np.fromfile(tmp_path / f"r{q}_recv_{r}", np.uint16).reshape(epr, n * M, H)
            for e, rows in enumerate(_want_rows(r, n, seed, set())):
                assert cnt[e] == len(rows), f"{what} round {q}: recv_count[{e}]={cnt[e]}, want {len(rows)}"
                if rows:
                    ref = np.stack([_bits(_inputs(s, seed)[0][t]) for s, t in rows])
                    assert np.array_equal(recv[e, : len(rows)], ref), f"{what} round {q}: rows of expert {e}"
            t = len(_inputs(r, seed)[0])
            comb = np.fromfile(tmp_path / f"r{q}_comb_{r}", np.uint16).reshape(T, H)[:t]
            bad = np.argwhere(comb != _combine_ref(r, n, seed, set(), False))
            assert not bad.size, f"{what} round {q}: combine differs from the reference at {tuple(bad[0])}"


# ---------------------------------------------------------------------------------------------------------------------
# the dispatch on host threads, both ways (EPKIT_LL_OWN_BY_TOKEN): this rank's own rows copied (FP8: from the staging
# buffer ep_lln_cast_fp8 fills) per expert, or per token from x (FP8: cast once a token) into each of its experts'
# slots; every output bitwise the same both ways and legacy.reference's (FP8: its cast)


def _fp8_inputs(n: int, t: int, h: int, e: int, k: int, seed: int, routing: str = "mixed"):
    """Per rank: bf16 x [t, h] whose 128-channel groups span zeros, bf16 subnormals, tiny, unit, large and near-max
    values (a group of one non-zero among zeros, a token all zeros), top-k ids with a -1 lane, a repeated expert and
    a token selecting nothing; ``routing`` "one": every token selects expert 1 only (twice: one row)."""
    g = torch.Generator().manual_seed(seed)
    mags = torch.tensor([0.0, 1e-40, 1e-30, 1.0, 37.0, 3e4, 1e38, 3e38])
    xs, idxs = [], []
    for _ in range(n):
        pick = torch.randint(len(mags), (t, h // 128), generator=g)
        x = (torch.rand(t, h, generator=g) * 2 - 1) * mags[pick].repeat_interleave(128, dim=1)
        idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else torch.zeros(0, k)
        if t >= 3 and routing == "mixed":
            x[0] = 0.0
            x[1, :128] = 0.0
            x[1, 5] = -2.5
            idx[0, k - 1] = -1
            idx[2, 1] = idx[2, 0]
            idx[t - 1] = -1
        if routing == "one":
            idx[:] = -1
            idx[:, 0] = idx[:, k - 1] = 1
        xs.append(x.to(torch.bfloat16))
        idxs.append(idx.long())
    return xs, idxs


def _dispatch(emulation, path, n, e, t, k, h, m, direct, round_scale, ue8m0, by_token, fp8, xs, idxs):
    """One dispatch of every rank on host threads (ll_native_emulation.cpp's dispatch mode): {name: bytes} per rank."""
    import subprocess

    path.mkdir()
    np.stack([_bits(x) for x in xs]).tofile(path / "x1")
    torch.stack(idxs).numpy().astype(np.int64).tofile(path / "idx1")
    args = [str(emulation), "dispatch", str(path), *map(str, (n, e, t, k, h, m, direct, round_scale, ue8m0))]
    proc = subprocess.run([*args, str(by_token), str(fp8)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = ("count", "q", "s", "src", "lanes", "range", "pos", "err")
    return [{w: (path / f"f_{w}_{r}").read_bytes() for w in names} for r in range(n)]


def _check_dispatch(out, what, n, e, t, k, h, m, round_scale, ue8m0, fp8, xs, idxs):
    """Every rank's outputs against legacy.reference: counts, rows (FP8: bytes and scales of its cast), src_info,
    lanes, layout_range, lane_pos (each (token, first lane of an expert)'s position among the rank's tokens of it)."""
    epr, slots, groups = e // n, n * m, h // 128
    ids = [i.numpy() for i in idxs]
    for r in range(n):
        got = out[r]
        assert np.frombuffer(got["err"], np.int32).tolist() == [0, 0, 0], f"{what} rank {r}: an error"
        cnt = np.frombuffer(got["count"], np.int32)
        q = np.frombuffer(got["q"], np.uint8 if fp8 else np.uint16).reshape(epr, slots, h)
        dt, cols = (np.int32, groups // 4) if ue8m0 else (np.float32, groups)
        s = np.frombuffer(got["s"], dt)[: epr * cols * slots].reshape(epr, cols, slots)
        src = np.frombuffer(got["src"], np.int32).reshape(epr, slots)
        lanes = np.frombuffer(got["lanes"], np.int32).reshape(epr, slots)
        rng_ = np.frombuffer(got["range"], np.int64).reshape(epr, n)
        for le, rows in enumerate(ll_expected_rows(ids, r, e)):
            c, g = len(rows), r * epr + le
            assert cnt[le] == c, f"{what} rank {r}: recv_count[{le}]={cnt[le]}, want {c}"
            assert src[le].tolist() == [tok for _, tok in rows] + [-1] * (slots - c), f"{what}: src_info {le}"
            first = [list(ids[sr][tok]).index(g) for sr, tok in rows]
            assert lanes[le].tolist() == first + [-1] * (slots - c), f"{what} rank {r}: lanes of {le}"
            for sr in range(n):
                v, want = int(rng_[le, sr]), (sum(a < sr for a, _ in rows), sum(a == sr for a, _ in rows))
                assert (v >> 32, v & 0xFFFFFFFF) == want, f"{what}: range {le}"
            if not c:
                continue
            rows_x = np.stack([_bits(xs[sr][tok]) for sr, tok in rows])
            if not fp8:
                assert np.array_equal(q[le, :c], rows_x), f"{what} rank {r}: rows of expert {le}"
                continue
            rq, rs = fp8_cast_reference(rows_x, bool(round_scale), bool(ue8m0))
            bad = np.argwhere(q[le, :c] != rq)
            assert not bad.size, f"{what} rank {r}: e4m3 bytes of expert {le} differ at {tuple(bad[0])}"
            assert np.array_equal(s[le, :, :c].T.view(np.int32), rs.view(np.int32)), f"{what}: scales of {le}"
        pos = np.frombuffer(got["pos"], np.int32)[: t * k].reshape(t, k)
        seen: dict[int, int] = {}
        for tok in range(t):
            row = [int(v) for v in ids[r][tok]]
            for lane, g in enumerate(row):
                if 0 <= g < e and row.index(g) == lane:
                    assert pos[tok, lane] == seen.get(g, 0), f"{what} rank {r}: lane_pos[{tok}, {lane}]"
                    seen[g] = seen.get(g, 0) + 1


@pytest.mark.parametrize("by_token", [0, 1])
@pytest.mark.parametrize(
    "n,h,direct,round_scale,ue8m0",
    [(1, 7168, 1, 1, 1), (2, 7168, 0, 0, 0), (2, 7168, 1, 1, 0), (4, 384, 1, 0, 0), (4, 384, 0, 1, 0),
     (3, 512, 1, 0, 1), (2, 128, 1, 1, 0), (1, 256, 0, 0, 0)],
)  # fmt: skip
def test_fp8_dispatch_on_host_threads(emulation, tmp_path, n, h, direct, round_scale, ue8m0, by_token):
    """The FP8 dispatch (``ep_lln_cast_fp8``, ``ep_lln_dispatch_send`` copying the staged rows, the receive copying
    the messages and this rank's own rows: staged (``by_token`` 0) or cast from x token by token (1, with the local
    shortcut)): every rank's q bytes and scales (float32, or ue8m0's packed exponents) bitwise ``fp8_cast_reference``
    of its rows, in V1's packed order, and the layout outputs legacy.reference's; hidden 7168 (56 groups), an odd
    group count (384), one group (128); with and without the local shortcut (at one rank with it no send runs)."""
    t, k, m, e = (4, 3, 4, 12) if h == 7168 else (6, 3, 8, 12)
    xs, idxs = _fp8_inputs(n, t, h, e, k, 97 + h + n)
    args = (n, e, t, k, h, m, direct, round_scale, ue8m0)
    out = _dispatch(emulation, tmp_path / "d", *args, by_token, 1, xs, idxs)
    what = f"n={n} h={h} direct={direct} round_scale={round_scale} ue8m0={ue8m0} by_token={by_token}"
    _check_dispatch(out, what, n, e, t, k, h, m, round_scale, ue8m0, 1, xs, idxs)


@pytest.mark.parametrize(
    "n,h,direct,fp8,round_scale,ue8m0,route,t",
    [(1, 7168, 1, 0, 0, 0, "mixed", 5), (1, 7168, 1, 1, 0, 0, "mixed", 5), (1, 384, 1, 1, 1, 0, "one", 7),
     (1, 128, 1, 0, 0, 0, "empty", 0), (2, 7168, 1, 1, 0, 1, "mixed", 4), (2, 384, 1, 0, 0, 0, "one", 6),
     (2, 512, 0, 1, 1, 1, "mixed", 6), (3, 384, 1, 1, 1, 0, "mixed", 7), (3, 128, 1, 1, 0, 0, "empty", 0),
     (4, 128, 1, 0, 0, 0, "mixed", 6), (4, 512, 1, 1, 0, 1, "one", 5), (4, 384, 1, 1, 1, 0, "mixed", 40)],
)  # fmt: skip
def test_own_rows_by_token_on_host_threads(
    emulation, tmp_path, n, h, direct, fp8, round_scale, ue8m0, route, t
):
    """EPKIT_LL_OWN_BY_TOKEN's receive (local_direct 2: this rank's rows written token by token) against the
    expert-major one: every output byte the same (rows, scales, counts, src_info, lanes, layout_range, lane_pos,
    error words), and legacy.reference's; bf16 and FP8 (round_scale, ue8m0), EP1..EP4, hidden 7168 / 384 / 128, -1
    ids, a repeated expert in a token, a token selecting nothing, no tokens, every token to one expert, more tokens
    than a warp (40: the ballot count over several warps)."""
    k, m, e = 3, max(t, 1), 12
    xs, idxs = _fp8_inputs(n, t, h, e, k, 11 + h + n + t, route)
    args = (n, e, t, k, h, m, direct, round_scale, ue8m0)
    off = _dispatch(emulation, tmp_path / "off", *args, 0, fp8, xs, idxs)
    on = _dispatch(emulation, tmp_path / "on", *args, 1, fp8, xs, idxs)
    what = f"n={n} h={h} fp8={fp8} round_scale={round_scale} ue8m0={ue8m0} {route} t={t}"
    for r in range(n):
        for name, b in off[r].items():
            assert on[r][name] == b, f"{what} rank {r}: {name} differs with the own rows by token"
    _check_dispatch(on, what, n, e, t, k, h, m, round_scale, ue8m0, fp8, xs, idxs)
