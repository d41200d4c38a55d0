#!/usr/bin/env bash
# Everything GPU in one command, on a machine with a CUDA GPU, torch with CUDA, a C++ compiler,
# cmake and pybind11 (no internet, no apt needed; liburing/libaio/ninja optional):
#   1. builds the C++ library, CLI and tests, and the Python extension, in build/gpu*;
#   2. makes a venv on the system Python (--system-site-packages: the preinstalled torch) holding
#      the tensortier package and CLI (nothing is installed anywhere else);
#   3. runs every C++ test (ctest) and every pytest test, GPU tests included;
#   4. runs the GPU benchmark (file->GPU and GPU->file, 1 GiB and 8 GiB, page cache warm and cold,
#      against the py_ GPU scripts and torch.cuda.gds.GdsFile, with the file read rate and the
#      pinned host->device copy rate measured in the same run).
# Results (logs, JUnit XML, bench JSON, summary.txt) go to OUT (default: $OUT, else
# build/gpu-results).
#
# Usage: scripts/gpu-test.sh [all|build|test|bench] [--out DIR] [--sizes 1G,8G] [--quick]
#   all (default) = build + test + bench; test and bench build first when needed.
#   --quick: pytest without the `slow` tests, bench at 1 GiB only.
# Environment: PYTHON (default python3), JOBS (default nproc), BENCH_DIR (default build/gpu-bench).
# Exit status: 0 when every step that ran passed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

phase=all
OUTDIR="${OUT:-$ROOT/build/gpu-results}"
SIZES=1G,8G
QUICK=0
while [ $# -gt 0 ]; do
  case "$1" in
    all|build|test|bench) phase=$1 ;;
    --out) OUTDIR=$2; shift ;;
    --sizes) SIZES=$2; shift ;;
    --quick) QUICK=1; SIZES=1G ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "gpu-test: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$OUTDIR"
OUTDIR="$(cd "$OUTDIR" && pwd)"
PY="${PYTHON:-python3}"
JOBS="${JOBS:-$(nproc)}"
BUILD="$ROOT/build/gpu"
VENV="$ROOT/build/gpu-venv"
SUMMARY="$OUTDIR/summary.txt"
: > "$SUMMARY"
status=0

note() { echo "gpu-test: $*" | tee -a "$SUMMARY"; }
step() {  # step NAME LOG COMMAND...: runs, logs, records PASS/FAIL
  local name=$1 log=$2
  shift 2
  local start=$SECONDS
  echo "== $name (log: $log)"
  if "$@" > >(tee "$log") 2>&1; then
    note "PASS $name ($((SECONDS - start)) s)"
  else
    note "FAIL $name ($((SECONDS - start)) s): see $log"
    status=1
  fi
}

# ---- what this machine has ---------------------------------------------------------------
{
  echo "date: $(date -Is)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || true
  "$PY" - <<'EOF' 2>&1 || true
import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available())
EOF
  command -v nvcc >/dev/null && nvcc --version | tail -1
  cmake --version | head -1
} > "$OUTDIR/machine.txt"
cat "$OUTDIR/machine.txt"
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  note "torch.cuda.is_available() is False here: GPU tests would only skip"
  status=1
fi

# ---- build -------------------------------------------------------------------------------
build() {
  local gen=() pybind_dir
  command -v ninja >/dev/null && gen=(-G Ninja)
  pybind_dir=$("$PY" -m pybind11 --cmakedir 2>/dev/null) || {
    echo "pybind11 not found for $PY (python -m pybind11 --cmakedir failed)"; return 1; }
  local tests=ON
  # -Werror off: a warning new to that machine's compiler must not waste the GPU time we get.
  if ! cmake -S . -B "$BUILD" "${gen[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTENSORTIER_WERROR=OFF \
      -DTENSORTIER_BUILD_TESTS=ON -DTENSORTIER_BUILD_PYTHON=ON -DTENSORTIER_BUILD_CLI=ON \
      -DPython_EXECUTABLE="$(command -v "$PY")" -Dpybind11_DIR="$pybind_dir"; then
    echo "configure with tests failed (GoogleTest missing?): building without the C++ tests"
    tests=OFF
    rm -rf "$BUILD"
    cmake -S . -B "$BUILD" "${gen[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTENSORTIER_WERROR=OFF \
      -DTENSORTIER_BUILD_TESTS=OFF -DTENSORTIER_BUILD_PYTHON=ON -DTENSORTIER_BUILD_CLI=ON \
      -DPython_EXECUTABLE="$(command -v "$PY")" -Dpybind11_DIR="$pybind_dir" || return 1
  fi
  cmake --build "$BUILD" -j "$JOBS" || return 1
  [ "$tests" = ON ] || echo "NO_CPP_TESTS" > "$BUILD/no-cpp-tests"
  # A venv over the system Python (its torch), holding only our package and CLI.
  if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv --system-site-packages --without-pip "$VENV" || return 1
  fi
  local site
  site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  rm -rf "$site/tensortier"
  cp -r python/tensortier "$site/tensortier"
  cp "$BUILD"/_core*.so "$site/tensortier/"
  cp "$BUILD/tensortier" "$VENV/bin/tensortier"
  "$VENV/bin/python" -c 'import tensortier; print("tensortier", tensortier.__version__,
tensortier.cuda_info(), tensortier.cufile_info())'
}

built() { [ -x "$VENV/bin/python" ] && [ -x "$VENV/bin/tensortier" ]; }

if [ "$phase" = all ] || [ "$phase" = build ] || ! built; then
  step "build (C++ library, tests, CLI, Python extension; venv)" "$OUTDIR/build.log" build
fi

# ---- tests -------------------------------------------------------------------------------
cpp_tests() {
  if [ -f "$BUILD/no-cpp-tests" ]; then
    echo "C++ tests were not built (GoogleTest not found by cmake)"; return 1
  fi
  (cd "$BUILD" && ctest --output-on-failure --no-tests=error -j "$JOBS" \
     --output-junit "$OUTDIR/ctest.xml")
  local rc=$?
  # The GPU suites must have run, not skipped.
  "$BUILD/tests/cpp/tensortier_tests" --gtest_filter='TransferGpu*:CudaGpu*:CuFileGpu*' \
    --gtest_brief=0 | grep -E "SKIPPED|PASSED|FAILED|Skipped" || true
  return $rc
}

py_tests() {
  local marks=()
  [ "$QUICK" = 1 ] && marks=(-m "not slow")
  "$VENV/bin/python" -c 'import pytest' || { echo "pytest is not installed for $PY"; return 1; }
  "$VENV/bin/python" -m pytest -q -rs -p no:cacheprovider "${marks[@]}" \
    --junitxml="$OUTDIR/pytest.xml" tests/python
}

if [ "$phase" = all ] || [ "$phase" = test ]; then
  built && step "C++ tests (ctest, GPU suites included)" "$OUTDIR/ctest.log" cpp_tests
  built && step "Python tests (pytest, GPU tests included)" "$OUTDIR/pytest.log" py_tests
fi

# ---- benchmarks --------------------------------------------------------------------------
if [ "$phase" = all ] || [ "$phase" = bench ]; then
  bench() {
    "$VENV/bin/python" bench/gpu_bench.py --dir "${BENCH_DIR:-$ROOT/build/gpu-bench}" \
      --sizes "$SIZES" --json "$OUTDIR/gpu_bench.json"
    local rc=$?
    rm -rf "${BENCH_DIR:-$ROOT/build/gpu-bench}"
    return $rc
  }
  built && step "GPU benchmark ($SIZES, warm and cold)" "$OUTDIR/gpu_bench.log" bench
fi

echo "== summary ($SUMMARY)"
cat "$SUMMARY"
exit $status
