#!/usr/bin/env bash
# The multi-GPU suite (issue 10), for a machine with 1-8 NVIDIA GPUs of one host, no network and no nox.
#
#   scripts/multigpu-suite.sh OUTDIR [STAGE...]     STAGE: install compile tests bench (default: all four)
#
# install  scripts/gpu-suite.sh's install stage (local packages into a temporary prefix, no network needed)
# compile  the JIT kernel sets the runs below use, compiled in parallel once (ep_jit's cache; failures are only noted)
# tests    pytest -m gpu tests/test_multigpu_ep.py: one process per GPU for N = 1, 2, 4, 8 (as many as there are
#          GPUs), transports ipc (ep_symmem and CUDA IPC buffers) and nccl, and 2 processes sharing GPU 0 (ipc)
# bench    benchmarks/bench_ep_multiproc.py for N = all GPUs and, for the record, N = 2 and 4 when there are more
#          GPUs, for every transport; with one GPU: N = 1, plus N = 2 sharing GPU 0 (ipc, --quick: a check of the
#          cross-process path, its times mean nothing)
#
# Knobs: MULTIGPU_BENCH_ARGS (extra benchmark arguments, e.g. "--quick"), MULTIGPU_TRANSPORTS (default "ipc nccl"),
# MULTIGPU_PYTEST_ARGS (e.g. "-x -k ipc"), MULTIGPU_TEST_PATHS (default tests/test_multigpu_ep.py),
# MULTIGPU_BENCH_TIMEOUT (seconds per benchmark run, default 900), EP_GPU_PREFIX and EPKIT_JIT_CACHE_DIR as in
# scripts/gpu-suite.sh. Logs, JUnit XML, benchmark JSON/PNG land in OUTDIR; OUTDIR/multigpu-summary.txt lists every
# step with its exit status. Exit status: nonzero if any step failed.
set -uo pipefail
out=${1:?usage: scripts/multigpu-suite.sh OUTDIR [install|compile|tests|bench ...]}
shift
stages=${*:-install compile tests bench}
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
mkdir -p "$out"
out=$(cd "$out" && pwd)
prefix=${EP_GPU_PREFIX:-/tmp/ep-gpu-prefix}
export PYTHONPATH="$prefix${PYTHONPATH:+:$PYTHONPATH}" PATH="$prefix/bin:$PATH" PYTHONUNBUFFERED=1
export EPKIT_JIT_CACHE_DIR=${EPKIT_JIT_CACHE_DIR:-$prefix-jit-cache}
transports=${MULTIGPU_TRANSPORTS:-ipc nccl}
summary="$out/multigpu-summary.txt"
: >"$summary"
status=0

step() { # step NAME COMMAND...: run, log to OUTDIR/NAME.log, record the exit status
  local name=$1
  shift
  echo "== $name: $*"
  "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "$rc  $name: $*" >>"$summary"
  status=$((status | (rc != 0)))
  return 0
}

if [[ " $stages " == *" install "* ]]; then
  EP_GPU_PREFIX=$prefix scripts/gpu-suite.sh "$out" install || { echo "install failed"; exit 1; }
fi

ngpu=$(python3 -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null || echo 0)
echo "== $ngpu GPU(s)" | tee -a "$summary"
nvidia-smi topo -m >"$out/nvidia-smi-topo.txt" 2>&1 || true
nvidia-smi nvlink -s >"$out/nvidia-smi-nvlink.txt" 2>&1 || true

# rank counts of the benchmark runs (with one GPU: N = 1 here, and the shared-GPU run below)
bench_ns=("$ngpu")
for n in 2 4; do ((n < ngpu)) && bench_ns+=("$n"); done

if [[ " $stages " == *" compile "* ]] && ((ngpu > 0)); then
  ns="1 2"
  for n in 4 8; do ((n <= ngpu)) && ns+=" $n"; done
  step compile python3 - "$ns" "$transports" <<'EOF'
import sys, time
from concurrent.futures import ThreadPoolExecutor
from ep_core.kernels._source import compile_kernels
from ep_core.kernels.plan import KernelConfig

ns = [int(n) for n in sys.argv[1].split()]
transports = sys.argv[2].split()
cfgs = [KernelConfig(n, 8, 7168, e, p, transport=t) for t in transports for n in ns for e, p in ((2, 0), (1, 56))]
t0 = time.time()

def build(cfg):
    try:
        compile_kernels(cfg)
        return None
    except Exception as exc:  # e.g. nccl headers missing: the run that needs them reports it
        return f"{cfg}: {type(exc).__name__}: {str(exc)[:300]}"

with ThreadPoolExecutor(8) as pool:
    errors = [e for e in pool.map(build, cfgs) if e]
print(f"compiled {len(cfgs) - len(errors)}/{len(cfgs)} kernel sets in {time.time() - t0:.1f} s")
for e in errors:
    print("not compiled:", e)
EOF
fi

if [[ " $stages " == *" tests "* ]]; then
  # shellcheck disable=SC2086
  step multigpu-tests python3 -m pytest ${MULTIGPU_TEST_PATHS:-tests/test_multigpu_ep.py} -m gpu -p no:cacheprovider \
    -v --junitxml="$out/multigpu-junit.xml" ${MULTIGPU_PYTEST_ARGS:-}
fi

if [[ " $stages " == *" bench "* ]] && ((ngpu > 0)); then
  tmo=${MULTIGPU_BENCH_TIMEOUT:-900}
  for t in $transports; do
    for n in "${bench_ns[@]}"; do
      # shellcheck disable=SC2086
      step "bench_n${n}_${t}" timeout "$tmo" python3 benchmarks/bench_ep_multiproc.py --nprocs "$n" --transport "$t" \
        --out "$out" ${MULTIGPU_BENCH_ARGS:-}
    done
  done
  if ((ngpu == 1)); then
    step bench_n2_ipc_shared timeout "$tmo" python3 benchmarks/bench_ep_multiproc.py --nprocs 2 --share-gpu \
      --transport ipc --quick --out "$out"
  fi
fi

echo "== summary (exit status, step):"
cat "$summary"
exit $status
