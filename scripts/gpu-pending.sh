#!/usr/bin/env bash
# The GPU checks that work on the CPU-only machine left owing (benchmarks/RESULTS.md names them per session), in
# one device call each, every step under its own time limit so one hang costs only its step:
#
#   scripts/gpu-pending.sh OUTDIR main    # this tree: the road's GPU tests, host time, the V2 GPU file (<= 10 min)
#   scripts/gpu-pending.sh OUTDIR verify  # the merged GPU code not yet run: defer / borrow_recv, hybrid order, the LL
#                                         # kernels' signature words, LB over symmetric memory, bucket, conformance
#   scripts/gpu-pending.sh OUTDIR bench   # bench_defer's overlap row, bench_lb, bench_v1 at EP8 and EP1 (<= 7 min)
#
# Logs land in OUTDIR (summary.txt first: one line per step with its exit status and seconds), the rest in
# OUTDIR/logs.tgz (the device tool brings back at most 8 files).
set -uo pipefail
out=${1:?usage: scripts/gpu-pending.sh OUTDIR main|verify|bench}
what=${2:?usage: scripts/gpu-pending.sh OUTDIR main|verify|bench}
root=$(cd "$(dirname "$0")/.." && pwd)
tree=$root
[[ $what == main || $what == verify || $what == bench ]] || { echo "unknown set $what (main, verify or bench)"; exit 2; }
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
  # correctness of the merged GPU code no GPU has run yet, most needed first (a call cut short still brings back the
  # steps it ran): issue 42's deferred dispatch / combine and in-place borrow_recv, hybrid's deterministic order;
  # issue 41's signature words and abort on the native LL kernels (the envelope chains on 2 processes, nccl one
  # rank, the masked kernels); issue 42's LB over symmetric memory and the bucket buffers; issue 45's moved harness
  step defer 75 "${pt[@]}" ep-torch/tests/test_torch_defer_borrow_gpu.py
  step hybrid 60 "${pt[@]}" ep-core/tests/gpu/test_gpu_hybrid.py -k "handle_order or two_nodes"
  step ll_tests 150 "${pt[@]}" ep-torch/tests/test_torch_legacy_ll_native_envelope.py \
    ep-torch/tests/test_torch_legacy_ll_native.py ep-torch/tests/test_torch_legacy_ll_mask_native.py
  step ll_by_token 60 env EPKIT_LL_OWN_BY_TOKEN=1 "${pt[@]}" ep-torch/tests/test_torch_legacy_ll_native.py  # issue 44's A/B
  step lb 75 "${pt[@]}" ep-torch/tests/test_torch_lb_symmetric_gpu.py
  step bucket 60 "${pt[@]}" ep-torch/tests/test_torch_bucket_gpu.py
  step conformance 90 "${pt[@]}" ep-torch/tests/test_torch_gpu.py -k "conformance_on_gpu and cuda-1-auto" \
    ep-torch/tests/test_torch_hybrid_gpu.py
elif [[ $what == bench ]]; then
  # issue 42: the overlap defer_epilogue buys, LB bytes against a copy of the same bytes (one rank; 2 processes
  # sharing the GPU: not NVLink rates); issue 44: bench_v1 at EP8 with the LL receive cap (the decode step inside)
  # and EP1, own rows per expert and by token (EPKIT_LL_OWN_BY_TOKEN: keep the faster, delete the other)
  step bench_defer 100 python3 benchmarks/bench_defer.py --quick --out "$out/logs/defer"
  step lb_one 60 python3 benchmarks/bench_lb.py --out "$out/logs/lb1" --runs 5 --num-sms 132
  step lb_shared 90 python3 benchmarks/bench_lb.py --out "$out/logs/lbs" --nprocs 2 --share-gpu --scale 4 --runs 5
  step bench_v1 150 python3 benchmarks/bench_v1.py --ranks 8 1 --quick --iters 20
fi
rm -rf "$out/logs"
cat "$summary"
