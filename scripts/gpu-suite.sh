#!/usr/bin/env bash
# The GPU suite, for a machine with an NVIDIA GPU but no network and no nox (e.g. the lent H200).
#
#   scripts/gpu-suite.sh OUTDIR [STAGE...]      STAGE: install tests bench (default: all three)
#
# Installs the local packages with `pip install --no-build-isolation --no-deps` into a temporary prefix (the
# machine already has torch, cuda-bindings, cuda-pathfinder, pybind11, scikit-build-core, nvidia-nccl-cu13), runs
# every test marked `gpu`, then the benchmarks. Logs, JUnit XML and benchmark JSON/PNG land in OUTDIR.
# Extra pytest arguments: GPU_PYTEST_ARGS="-k loopback -x"; a subset of test folders: GPU_TEST_PATHS="ep-jit/tests".
# Benchmarks: GPU_BENCHES="benchmarks/bench_ep.py benchmarks/bench_ep.py,--decode" picks a subset (arguments
# after the script, joined by commas).
set -uo pipefail
out=${1:?usage: scripts/gpu-suite.sh OUTDIR [install|tests|bench ...]}
shift
stages=${*:-install tests bench}
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
mkdir -p "$out"
prefix=${EP_GPU_PREFIX:-/tmp/ep-gpu-prefix}
export PYTHONPATH="$prefix${PYTHONPATH:+:$PYTHONPATH}" PATH="$prefix/bin:$PATH" PYTHONUNBUFFERED=1
export EPKIT_JIT_CACHE_DIR=${EPKIT_JIT_CACHE_DIR:-$prefix-jit-cache}
packages=(ep-layout ep-jit packages/ep-symmem packages/ep-nccl-gin packages/ep-launch ep-core ep-torch)
status=0

if [[ " $stages " == *" install "* ]]; then
  echo "== installing ${packages[*]} into $prefix"
  rm -rf "$prefix" && mkdir -p "$prefix"
  python3 -m pip install -q --no-build-isolation --no-deps --no-compile --target "$prefix" \
    "${packages[@]/#/./}" >"$out/install.log" 2>&1 || { echo "install failed, see $out/install.log"; tail -40 "$out/install.log"; exit 1; }
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
fi

if [[ " $stages " == *" tests "* ]]; then
  echo "== pytest -m gpu"
  tests=()
  for p in "${packages[@]}"; do tests+=("$p/tests"); done
  tests+=(tests)
  # shellcheck disable=SC2206
  [[ -n ${GPU_TEST_PATHS:-} ]] && tests=($GPU_TEST_PATHS)
  # shellcheck disable=SC2086
  python3 -m pytest "${tests[@]}" -m gpu -p no:cacheprovider --junitxml="$out/gpu-junit.xml" \
    ${GPU_PYTEST_ARGS:-} 2>&1 | tee "$out/gpu-tests.log"
  status=$((status | PIPESTATUS[0]))
fi

if [[ " $stages " == *" bench "* ]]; then
  # An entry is a script, optionally with arguments joined by commas: "benchmarks/bench_ep.py,--decode".
  default_benches="benchmarks/bench_ep.py benchmarks/bench_ep.py,--decode benchmarks/bench_ep.py,--ranks,8,--no-overlap"
  default_benches+=" benchmarks/bench_host_overhead.py,--profile"
  default_benches+=" benchmarks/bench_host_calls.py benchmarks/bench_sm_copy.py"
  default_benches+=" ep-jit/benchmarks/bench_jit.py packages/ep-symmem/benchmarks/bench_symmem.py"
  for entry in ${GPU_BENCHES:-$default_benches}; do
    IFS=, read -r script bench_args <<<"$entry"
    [[ -f $script ]] || { echo "no such benchmark: $script"; status=1; continue; }
    # shellcheck disable=SC2206
    extra=(${bench_args//,/ })
    name=$(basename "$script" .py)${bench_args:+_${bench_args//[^a-z0-9]/}}
    echo "== $script ${extra[*]}"
    timeout 600 python3 "$script" --out "$out" "${extra[@]}" 2>&1 | tee "$out/$name.log"
    status=$((status | PIPESTATUS[0]))
  done
fi
exit $status
