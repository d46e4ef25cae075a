#!/usr/bin/env bash
# The GPU checks that work on the CPU-only machine left owing (benchmarks/RESULTS.md names them per session), in
# one device call each, every step under its own time limit so one hang costs only its step:
#
#   scripts/gpu-pending.sh OUTDIR main    # this tree: the road's GPU tests, host time, the V2 GPU file (<= 10 min)
#   scripts/gpu-pending.sh OUTDIR verify  # this tree, after a session's merges: the deferred epilogue, hybrid's
#                                         # deterministic order, bench_v1 at EP8 with the LL receive cap, the LL and
#                                         # bucket GPU tests, ep-core's GPU tests (<= 9.5 min)
#
# Logs land in OUTDIR (summary.txt first: one line per step with its exit status and seconds), the rest in
# OUTDIR/logs.tgz (the device tool brings back at most 8 files).
set -uo pipefail
out=${1:?usage: scripts/gpu-pending.sh OUTDIR main|verify}
what=${2:?usage: scripts/gpu-pending.sh OUTDIR main|verify}
root=$(cd "$(dirname "$0")/.." && pwd)
tree=$root
[[ $what == main || $what == verify ]] || { echo "unknown set $what (main or verify)"; exit 2; }
[[ -d $tree/ep-core ]] || { echo "no tree at $tree"; exit 2; }
mkdir -p "$out/logs"
summary=$out/summary.txt
: >"$summary"

step() {  # step NAME LIMIT_S COMMAND...: run in $tree, log to logs/NAME.log, one summary line
  local name=$1 limit=$2 t0 rc
  shift 2
  t0=$(date +%s)
  (cd "$tree" && timeout "$limit" "$@") >"$out/logs/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc $(($(date +%s) - t0))s" | tee -a "$summary"
  tail -3 "$out/logs/$name.log" | sed 's/^/    /' >>"$summary"
  tar -czf "$out/logs.tgz" -C "$out" logs  # after every step: a call cut short still brings its logs back
}

export EP_GPU_PREFIX=/tmp/ep-pending-$what
step install 90 bash scripts/gpu-suite.sh "$out/logs" install
export PYTHONPATH=$EP_GPU_PREFIX EPKIT_JIT_CACHE_DIR=$EP_GPU_PREFIX-jit-cache PYTHONUNBUFFERED=1
pt=(python3 -m pytest -m gpu -v --tb=short -p no:cacheprovider -o faulthandler_timeout=100)  # a hang prints its stacks

if [[ $what == main ]]; then
  # issue 45: the one-plan road on the GPU (repeats, the kept plan), host time (more rounds: the no-sync row's
  # ratio moved between sessions), then the GPU suite's V2 file (its 11 tests need about 4 minutes)
  step repeat 120 "${pt[@]}" ep-torch/tests/test_torch_repeat_gpu.py ep-torch/tests/test_torch_express_lane_gpu.py
  step host_time 120 python3 benchmarks/bench_host_overhead.py --out "$out/logs" --rounds 5
  step core_gpu 120 "${pt[@]}" -x ep-core/tests/gpu  # trim10's consolidated GPU-only host code among them
  step torch_gpu 200 "${pt[@]}" ep-torch/tests/test_torch_gpu.py
elif [[ $what == verify ]]; then
  # the merged GPU changes, most needed first (a call cut short still brings back the steps it ran): issue 42's
  # deferred dispatch / combine and in-place borrow_recv, hybrid's deterministic order, the overlap defer_epilogue
  # buys; issue 44's LL tests, then bench_v1 at EP8 with the LL receive cap (the EP8 decode step is checked inside)
  step defer 75 "${pt[@]}" ep-torch/tests/test_torch_defer_borrow_gpu.py
  step hybrid 60 "${pt[@]}" ep-core/tests/gpu/test_gpu_hybrid.py -k "handle_order or two_nodes"
  step bench_defer 100 python3 benchmarks/bench_defer.py --quick --out "$out/logs/defer"
  step ll_tests 60 "${pt[@]}" ep-torch/tests/test_torch_legacy_ll_native.py ep-torch/tests/test_torch_hybrid_gpu.py
  step bucket 60 "${pt[@]}" ep-torch/tests/test_torch_bucket_gpu.py
  step bench_v1 150 python3 benchmarks/bench_v1.py --ranks 8 --quick --iters 20
fi
rm -rf "$out/logs"
cat "$summary"
