"""ep_core.ll_native (host side of include/ep_core/ll_native.cuh, V1 low-latency mode's own kernels): the
parameter table equals the header's extern "C" signatures, the host layout mirror equals the header's, the kernels
compile with nvcc (sm_90a and sm_80), bad arguments are refused before the driver, and rank masking's decisions
(the header's helpers, composed as the kernels compose them) run on the host against a numpy model. (Their results
are tested on the GPU by ep-torch's test_torch_legacy_ll_native.py and test_torch_legacy_ll_mask.py, bitwise against
legacy.reference.)"""

from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import pytest
from ep_core import ll_native
from ep_core.errors import EPValueError


def _nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    path = os.path.join(home, "bin", "nvcc")
    return path if os.path.exists(path) else shutil.which("nvcc")


needs_nvcc = pytest.mark.skipif(_nvcc() is None, reason="nvcc not found")


def test_signatures_match_the_header(header_signatures):
    assert header_signatures("ll_native.cuh")[1] == ll_native.SIGNATURES


def test_bad_arguments_are_refused():
    pytest.importorskip("ep_jit")
    with pytest.raises(EPValueError, match="expected one of"):
        ll_native._args("ep_lln_nope", [])
    with pytest.raises(EPValueError, match="expected 22 arguments"):
        ll_native._args("ep_lln_dispatch_send", [0])
    sig = ll_native.SIGNATURES["ep_lln_combine_recv"]
    vals = [1 << 40 if c == "i" else 0 for c in sig]
    with pytest.raises(EPValueError, match="must be an int32"):
        ll_native._args("ep_lln_combine_recv", vals)


_LAYOUT_MAIN = r"""
#include <ep_core/ll_native.cuh>
#include <cstdio>
int main(int argc, char** argv) {
  int v[6];
  for (int i = 0; i < 6; ++i) v[i] = atoi(argv[i + 1]);
  ep_lln::Layout L(v[0], v[1], v[2], v[3], v[4], v[5]);
  printf("%lld %lld %lld %lld %lld %lld %lld %lld %lld\n", (long long)L.ctrl, (long long)L.dflag, (long long)L.cflag,
         (long long)L.ddata, (long long)L.cdata, (long long)L.half_bytes, (long long)L.msg, (long long)L.cmeta,
         (long long)ep_lln::header_bytes(v[1]));
  return 0;
}
"""


@needs_nvcc
def test_host_layout_equals_the_header(tmp_path):
    from ep_core.kernels._source import get_include

    src = tmp_path / "layout.cu"
    src.write_text(_LAYOUT_MAIN)
    exe = tmp_path / "layout"
    subprocess.run([_nvcc(), "-std=c++17", "-I", get_include(), str(src), "-o", str(exe)], check=True)
    for cfg in (
        (256, 1, 256, 128, 8, 7168),
        (32, 8, 256, 128, 8, 7168),
        (288, 1, 288, 8, 9, 384),
        (3, 4, 12, 5, 3, 128),
    ):
        got = [
            int(v)
            for v in subprocess.run(
                [str(exe), *map(str, cfg)], capture_output=True, text=True, check=True
            ).stdout.split()
        ]
        lay = ll_native.region_layout(*cfg)
        assert tuple(got) == (*lay[:7], lay.cmeta, lay.header), cfg
        assert lay.total_bytes == lay.header + 2 * lay.half_bytes and lay.half_offset(0) == lay.header


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_native_kernels_compile(arch, tmp_path, monkeypatch):
    ep_jit = pytest.importorskip("ep_jit")
    monkeypatch.setenv("EPKIT_JIT_CACHE_DIR", str(tmp_path / "jit"))
    ep_jit.clear_memo()
    art = ll_native.compile_ll_native(arch=arch)
    assert art.cubin_path.read_bytes()[:4] == b"\x7fELF"
    assert set(ll_native.KERNEL_NAMES) <= set(art.kernel_names)


# ---------------------------------------------------------------------------------------------------------------------
# rank masking's decisions on the host: the header's helpers (masked, expire, source_count, block_layout,
# lane_source), composed as the kernels compose them, for every rank of a small group; one rank may be "lost" (it
# sends nothing: the waits on it expire)

_MASK_MAIN = r"""
#include <ep_core/ll_native.cuh>
#include <cstdio>
#include <vector>
// argv: N E T K lost use_mask gen, then stdin: topk [N][T][K], user mask [N][N]
int main(int argc, char** argv) {
  const int n = atoi(argv[1]), ne = atoi(argv[2]), nt = atoi(argv[3]), nk = atoi(argv[4]);
  const int lost = atoi(argv[5]), use_mask = atoi(argv[6]), gen = atoi(argv[7]), epr = ne / n;
  std::vector<int> topk(n * nt * nk), umask(n * n);
  for (auto& v : topk) if (scanf("%d", &v) != 1) return 2;
  for (auto& v : umask) if (scanf("%d", &v) != 1) return 2;
  // per rank: mask [N + 1] (the generation last), err, herr [4 + N]
  std::vector<std::vector<int>> mask(n, std::vector<int>(n + 1)), herr(n, std::vector<int>(4 + n));
  std::vector<int> err(n);
  for (int d = 0; d < n; ++d) {
    for (int r = 0; r < n; ++r) mask[d][r] = umask[d * n + r];
    mask[d][n] = gen;
  }
  auto mp = [&](int d) { return use_mask ? mask[d].data() : (int*)nullptr; };
  // dispatch send: flag[d][e][s] = (epoch << 32) | count, or absent (-1)
  const int64_t epoch = 1;
  std::vector<int64_t> dflag(n * epr * n, -1);
  for (int s = 0; s < n; ++s) {
    if (s == lost) continue;
    for (int g = 0; g < ne; ++g) {
      const int dst = g / epr;
      if (ep_lln::masked(mp(s), dst)) continue;  // the send's skip
      int count = 0;
      for (int t = 0; t < nt; ++t) {
        bool any = false;
        for (int k = 0; k < nk; ++k) any = any || topk[(s * nt + t) * nk + k] == g;
        count += any;
      }
      dflag[(dst * epr + g % epr) * n + s] = (epoch << 32) | count;
    }
  }
  // dispatch receive: counts and layout_range of every expert
  for (int d = 0; d < n; ++d) {
    for (int e = 0; e < epr; ++e) {
      std::vector<int> s_off(n + 1);
      std::vector<int64_t> range(n);
      for (int r = 0; r < n; ++r) {
        const int64_t v = dflag[(d * epr + e) * n + r];
        int res;
        if (ep_lln::masked(mp(d), r)) res = ep_lln::kMasked;  // wait_flag's first check
        else if (v >= 0 && (v >> 32) >= epoch) res = ep_lln::kArrived;
        else res = ep_lln::expire(mp(d), n, &err[d], herr[d].data(), d, r, 1);
        s_off[r] = ep_lln::source_count(res, v);
      }
      const int total = ep_lln::block_layout(s_off.data(), n, range.data());
      printf("D %d %d %d", d, e, total);
      for (int r = 0; r < n; ++r) printf(" %lld", (long long)range[r]);
      printf("\n");
    }
  }
  // combine: expert owners send their flags unless the token's rank is masked there; the home rank's lanes
  std::vector<int> cflag(n * ne, 0);
  for (int o = 0; o < n; ++o) {
    if (o == lost) continue;
    for (int h = 0; h < n; ++h)
      if (!ep_lln::masked(mp(o), h))
        for (int e = 0; e < epr; ++e) cflag[h * ne + o * epr + e] = 1;
  }
  for (int h = 0; h < n; ++h) {
    for (int t = 0; t < nt; ++t) {
      std::vector<int> src(nk), dead(nk);
      for (int k = 0; k < nk; ++k) {
        const int g = topk[(h * nt + t) * nk + k];
        src[k] = -1;
        dead[k] = 0;
        if (g < 0 || g >= ne) continue;
        src[k] = k;
        for (int j = 0; j < k; ++j)
          if (topk[(h * nt + t) * nk + j] == g) { src[k] = j; break; }
        if (src[k] != k) continue;
        int res;
        if (ep_lln::masked(mp(h), g / epr)) res = ep_lln::kMasked;
        else if (cflag[h * ne + g]) res = ep_lln::kArrived;
        else res = ep_lln::expire(mp(h), n, &err[h], herr[h].data(), h, g / epr, 2);
        dead[k] = res == ep_lln::kMasked;
      }
      printf("C %d %d", h, t);
      for (int k = 0; k < nk; ++k) printf(" %d", use_mask ? ep_lln::lane_source(src[k], dead.data()) : src[k]);
      printf("\n");
    }
  }
  for (int d = 0; d < n; ++d) {
    printf("M %d %d", d, err[d]);
    for (int r = 0; r <= n; ++r) printf(" %d", mask[d][r]);
    for (int i = 0; i < 4 + n; ++i) printf(" %d", herr[d][i]);
    printf("\n");
  }
  return 0;
}
"""


def _final_mask(umask: np.ndarray, lost: int, d: int) -> set[int]:
    """The ranks rank ``d`` ends up masking: its user mask, the ranks that mask it (they send it nothing: its wait
    on them expires) and the lost rank."""
    n = umask.shape[0]
    out = {r for r in range(n) if umask[d, r] or umask[r, d]}
    return out | ({lost} if 0 <= lost != d else set())


@needs_nvcc
def test_mask_decisions_on_host(tmp_path):
    from ep_core.kernels._source import get_include

    src = tmp_path / "mask.cu"
    src.write_text(_MASK_MAIN)
    exe = tmp_path / "mask"
    subprocess.run([_nvcc(), "-std=c++17", "-I", get_include(), str(src), "-o", str(exe)], check=True)
    rng = np.random.default_rng(44)
    n, ne, nt, nk = 4, 12, 6, 3
    epr = ne // n
    idx = np.stack([np.stack([rng.permutation(ne)[:nk] for _ in range(nt)]) for _ in range(n)])
    idx[0, 0, 1] = -1
    idx[1, nt - 1] = -1
    idx[2, 1, 2] = idx[2, 1, 0]  # a token naming an expert twice: one message, both lanes
    cases = [
        ("none", np.zeros((n, n), int), -1, 1),
        ("user masks rank 3 everywhere", np.array([[int(r == 3) for r in range(n)]] * n), -1, 1),
        ("rank 1 masks itself and rank 2", np.array([[0] * n, [0, 1, 1, 0], [0] * n, [0] * n]), -1, 1),
        ("rank 2 is lost", np.zeros((n, n), int), 2, 3),
        ("rank 2 lost, rank 3 masked by the user", np.array([[int(r == 3) for r in range(n)]] * n), 2, 1),
    ]
    for what, umask, lost, gen in cases:
        stdin = " ".join(map(str, [*idx.reshape(-1), *umask.reshape(-1)]))
        out = subprocess.run(
            [str(exe), str(n), str(ne), str(nt), str(nk), str(lost), "1", str(gen)],
            input=stdin, capture_output=True, text=True, check=True,
        ).stdout.split("\n")  # fmt: skip
        rows = [line.split() for line in out if line]
        masks = {int(r[1]): [int(v) for v in r[2:]] for r in rows if r[0] == "M"}
        for d in range(n):
            if d == lost:  # what it computes does not matter (it left)
                continue
            want_masked = _final_mask(umask, lost, d)
            m = masks[d]
            assert m[0] == 0, f"{what}: rank {d} raised the error word instead of masking"
            assert {r for r in range(n) if m[1 + r]} == want_masked, f"{what}: rank {d}'s mask {m[1 : 1 + n]}"
            herr = m[2 + n :]
            assert herr[:4] == [0, 0, 0, 0], f"{what}: rank {d}: no timeout record without an error"
            rec = [r for r in range(n) if herr[4 + r]]
            timed_out = sorted(want_masked - {r for r in range(n) if umask[d, r]})
            assert rec == timed_out and all(herr[4 + r] == gen + 1 for r in rec), (
                f"{what}: rank {d} herr {herr}"
            )
        for r in rows:
            if r[0] in "DC" and int(r[1]) == lost:
                continue
            if (
                r[0] == "D"
            ):  # recv_count and layout_range: the reference routing of the sources d does not mask
                d, e, total = int(r[1]), int(r[2]), int(r[3])
                g = d * epr + e
                off = 0
                for s in range(n):
                    c = int((idx[s] == g).any(axis=1).sum()) if s not in _final_mask(umask, lost, d) else 0
                    v = int(r[4 + s])
                    assert (v >> 32, v & 0xFFFFFFFF) == (off, c), f"{what}: rank {d} layout_range[{e}, {s}]"
                    off += c
                assert total == off, f"{what}: rank {d} recv_count[{e}]"
            elif r[0] == "C":  # the combine's lanes: those of an expert on a rank h masks contribute nothing
                h, t = int(r[1]), int(r[2])
                got = [int(v) for v in r[3:]]
                want = []
                for k in range(nk):
                    gk = int(idx[h, t, k])
                    o = gk // epr
                    dropped = gk < 0 or o in _final_mask(umask, lost, h)
                    want.append(-1 if dropped else int(np.flatnonzero(idx[h, t] == gk)[0]))
                assert got == want, f"{what}: rank {h} token {t} lanes {got}, want {want}"
    # without a mask (enable_shrink off) a lost rank raises the error word: the first expiry's record
    out = subprocess.run(
        [str(exe), str(n), str(ne), str(nt), str(nk), "2", "0", "0"],
        input=" ".join(map(str, [*idx.reshape(-1), *np.zeros(n * n, int)])), capture_output=True, text=True,
        check=True,
    ).stdout  # fmt: skip
    for line in out.split("\n"):
        if line.startswith("M"):
            v = [int(x) for x in line.split()[1:]]
            d, err, herr = v[0], v[1], v[2 + n + 1 :]
            assert err == 1 and herr[:4] == [1, d, 2, 1] and not any(herr[4:]), f"rank {d}: {v}"
