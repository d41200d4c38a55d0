#!/usr/bin/env bash
# Everything GPU, on a machine with a CUDA GPU, torch with CUDA, a C++ compiler, cmake and
# pybind11 (no internet, no apt needed; GoogleTest, pytest, numpy, liburing, libaio and ninja
# optional: what is missing is reported and its step SKIPs):
#   build     builds the C++ library, CLI and (when cmake finds GoogleTest) tests, and the Python
#             extension, in build/gpu; makes a venv on the system Python (--system-site-packages:
#             the preinstalled torch) holding the tensortier package and CLI (nothing else is
#             installed anywhere);
#   test-cpp  every C++ test (ctest), GPU suites included (they must run, not skip);
#   test-py   every pytest test, GPU tests included (SKIP when pytest or numpy is missing):
#             test_gpu_transfer.py, test_gpu_shared.py (shared tensors in device memory,
#             two processes on one GPU) and test_dcp_save.py (DCP saves of CUDA state dicts)
#             must run, not skip;
#   test      test-cpp then test-py;
#   bench     the GPU benchmark (file->GPU and GPU->file, page cache warm and cold, against the
#             py_ GPU scripts and torch.cuda.gds.GdsFile, with the file read rate and the pinned
#             host->device copy rate measured in the same run; every load is validated);
#   bench-checkpoint
#             checkpoint loads to the GPU (bench/checkpoint_bench.py gpu-cold,gpu-warm: a 2 GiB
#             state dict of 300 tensors; tensortier.load against safetensors, torch.load and
#             fastsafetensors where they import, and min(file read rate, pinned host->device
#             rate) from the same run);
#   all       (default) build + test + bench + bench-checkpoint. test-* and bench* build first
#             when nothing is built.
# Debian packages the machine lacks (GoogleTest for the C++ tests, liburing and libaio for those
# backends) are unpacked by build from DEBS (default build/gpu-debs) into build/gpu-deps, which
# cmake then searches first (never into /), e.g. fetched on a Debian 12 machine with
#   mkdir -p build/gpu-debs && (cd build/gpu-debs && apt-get download libgtest-dev \
#     libgmock-dev liburing-dev liburing2 libaio-dev libaio1)
# (Ubuntu 24.04 names libaio1 libaio1t64.)
# Benchmark peers missing on a machine without internet (fastsafetensors; the GPU image has
# safetensors) are unpacked into the venv from WHEELS (default build/gpu-wheels) by build, e.g.
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
#     --platform manylinux_2_34_x86_64 -d build/gpu-wheels fastsafetensors
# Results go to OUT (default: $OUT, else build/gpu-results), few files (a device machine may
# send back only 8): summary.txt (the machine, then one line per step), and per step its log
# (build.log, ctest.log, pytest.log, gpu_bench_SIZES.log, checkpoint_gpu_bench.log) plus
# ctest.xml, pytest.xml and the benchmarks' JSON.
#
# Usage: scripts/gpu-test.sh [all|build|test|test-cpp|test-py|bench|bench-checkpoint] [--out DIR]
#                            [--sizes 1G,8G] [--repeats N] [--quick] [--gpu-only] [--budget SECONDS]
#   --quick: pytest without the `slow` tests; bench at 1 GiB only (unless --sizes is given).
#   --gpu-only: pytest runs only the tests that exercise CUDA (tests/python/conftest.py says
#             which), for a lease too short for the whole suite.
#   --repeats: bench repeats per method (default 3, and 2 over 2 GiB).
#   --budget: the whole call ends within this many seconds (default 570, for a 600 s limit):
#             each step gets min(STEP_TIMEOUT, what is left); a step with under 30 s left does
#             not start (NOT RUN, a failure), so the summary always comes back.
# Environment: PYTHON (default python3), JOBS (default nproc), BENCH_DIR (default
# build/gpu-bench), STEP_TIMEOUT (seconds per step at most, default 540), DEBS and WHEELS (above).
# Exit status: 0 when every step ran and passed (SKIP counts as passed; NOT RUN, TIMEOUT fail).
#
# On a machine whose calls are limited to 10 minutes each and that is given back after 30 s
# idle (so each call may start bare and build again: ~2 min on 16 cores), run, carrying
# build/gpu-debs and build/gpu-wheels:
#   scripts/gpu-test.sh test --quick                 # build, C++ tests, Python tests
#   scripts/gpu-test.sh bench --sizes 1G
#   scripts/gpu-test.sh bench-checkpoint
#   scripts/gpu-test.sh bench --sizes 8G --repeats 2
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

phase=all
OUTDIR="${OUT:-$ROOT/build/gpu-results}"
SIZES=""
REPEATS=""
QUICK=0
GPU_ONLY=0
BUDGET=570
while [ $# -gt 0 ]; do
  case "$1" in
    all|build|test|test-cpp|test-py|bench|bench-checkpoint) phase=$1 ;;
    --out) OUTDIR=$2; shift ;;
    --sizes) SIZES=$2; shift ;;
    --repeats) REPEATS=$2; shift ;;
    --quick) QUICK=1 ;;
    --gpu-only) GPU_ONLY=1 ;;
    --budget) BUDGET=$2; shift ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "gpu-test: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[ -n "$SIZES" ] || { [ "$QUICK" = 1 ] && SIZES=1G || SIZES=1G,8G; }
mkdir -p "$OUTDIR"
OUTDIR="$(cd "$OUTDIR" && pwd)"
PY="${PYTHON:-python3}"
JOBS="${JOBS:-$(nproc)}"
STEP_TIMEOUT="${STEP_TIMEOUT:-540}"
BUILD="$ROOT/build/gpu"
VENV="$ROOT/build/gpu-venv"
BENCH_DIR="${BENCH_DIR:-$ROOT/build/gpu-bench}"
SUMMARY="$OUTDIR/summary.txt"
SKIP=77  # a step's exit status meaning "could not run here", reported as SKIP
echo "== gpu-test $phase $(date -Is)" >> "$SUMMARY"
status=0
# The steps run in a child bash under `timeout`: it needs these.
export ROOT OUTDIR PY JOBS BUILD VENV BENCH_DIR SIZES REPEATS QUICK GPU_ONLY SKIP
# cuFile writes its log into the working directory (the checkout) unless told where.
export CUFILE_LOGFILE_PATH="${CUFILE_LOGFILE_PATH:-$BUILD/cufile.log}"

note() { echo "gpu-test: $*" | tee -a "$SUMMARY"; }
step() {  # step NAME LOG FUNCTION: runs under timeout, logs, records PASS/SKIP/FAIL/TIMEOUT
  local name=$1 log=$2 fn=$3
  local start=$SECONDS rc limit
  limit=$((BUDGET - SECONDS - 15))  # 15 s for the kill (-k 10) and the summary
  [ "$limit" -gt "$STEP_TIMEOUT" ] && limit=$STEP_TIMEOUT
  if [ "$limit" -lt 30 ]; then
    note "NOT RUN $name: $((BUDGET - SECONDS)) s left of this call's --budget $BUDGET"
    status=1
    return
  fi
  echo "== $name (log: $log, limit $limit s)"
  timeout -k 10 "$limit" bash -c "$fn" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  if [ $rc = 0 ]; then
    note "PASS $name ($((SECONDS - start)) s)"
  elif [ $rc = "$SKIP" ]; then
    note "SKIP $name: $(grep '^SKIP: ' "$log" | tail -1 | cut -c7-)"
  elif [ $rc = 124 ] || [ $rc = 137 ]; then
    note "TIMEOUT $name (killed after $limit s): see $log"
    status=1
  else
    note "FAIL $name ($((SECONDS - start)) s, exit $rc): see $log"
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
  cmake --version 2>&1 | head -1
  for module in pytest numpy pybind11; do
    "$PY" -c "import $module; print('$module', $module.__version__)" 2>/dev/null ||
      echo "$module: not installed for $PY"
  done
  echo "kernel: $(uname -r); filesystem of the checkout: $(stat -f -c %T "$ROOT")"
  "$PY" - "$ROOT/build" <<'EOF' 2>&1 || true
import os, sys
os.makedirs(sys.argv[1], exist_ok=True)
path = os.path.join(sys.argv[1], "odirect-probe")
try:
    os.close(os.open(path, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600))
    print("O_DIRECT: accepted in", sys.argv[1])
except OSError as e:
    print(f"O_DIRECT: refused in {sys.argv[1]} ({e})")
finally:
    if os.path.exists(path):
        os.unlink(path)
EOF
  for f in /run/udev /proc/driver/nvidia-fs /etc/cufile.json; do
    [ -e "$f" ] && echo "$f: present" || echo "$f: absent"
  done
} > "$OUTDIR/machine.txt"
tee -a "$SUMMARY" < "$OUTDIR/machine.txt"
rm -f "$OUTDIR/machine.txt"  # kept in summary.txt: fewer files to send back
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  note "torch.cuda.is_available() is False here: GPU tests would only skip"
  status=1
fi
for module in pytest numpy; do
  "$PY" -c "import $module" 2>/dev/null ||
    note "$module is not installed for $PY (no internet here?): the Python tests will SKIP"
done

# ---- build -------------------------------------------------------------------------------
# Whether cmake finds GoogleTest (a throwaway project; arguments go to cmake): without it the C++
# tests SKIP.
have_gtest() {
  local probe rc
  probe=$(mktemp -d) || return 1
  printf 'cmake_minimum_required(VERSION 3.16)\nproject(probe CXX)\nfind_package(GTest REQUIRED)\n' \
    > "$probe/CMakeLists.txt"
  cmake -S "$probe" -B "$probe/build" "$@" > "$probe/log" 2>&1
  rc=$?
  rm -rf "$probe"
  return $rc
}

build() {
  cmake --version | head -1
  local gen=() pybind=() prefix=() tests=ON pybind_dir deb
  local debs="${DEBS:-$ROOT/build/gpu-debs}" deps="$ROOT/build/gpu-deps"
  command -v ninja >/dev/null && gen=(-G Ninja)
  if compgen -G "$debs/*.deb" > /dev/null; then
    if command -v dpkg-deb > /dev/null; then
      rm -rf "$deps" && mkdir -p "$deps" || return 1
      for deb in "$debs"/*.deb; do
        dpkg-deb -x "$deb" "$deps" || return 1
        echo "unpacked $(basename "$deb") into $deps"
      done
      prefix=(-DCMAKE_PREFIX_PATH="$deps/usr")
    else
      echo "dpkg-deb is missing: not unpacking $debs/*.deb (cmake searches the system only)"
    fi
  fi
  if pybind_dir=$("$PY" -m pybind11 --cmakedir 2>/dev/null) && [ -n "$pybind_dir" ]; then
    pybind=(-Dpybind11_DIR="$pybind_dir")
  else
    echo "python -m pybind11 --cmakedir failed: configuring without -Dpybind11_DIR (cmake searches)"
  fi
  if ! have_gtest ${prefix[@]+"${prefix[@]}"}; then
    echo "GoogleTest not found by cmake: building without the C++ tests (test-cpp will SKIP)"
    tests=OFF
  fi
  rm -f "$BUILD/no-cpp-tests"
  # -Werror off: a warning new to that machine's compiler must not waste the GPU time we get.
  cmake -S . -B "$BUILD" ${gen[@]+"${gen[@]}"} -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTENSORTIER_WERROR=OFF \
    -DTENSORTIER_BUILD_TESTS=$tests -DTENSORTIER_BUILD_PYTHON=ON -DTENSORTIER_BUILD_CLI=ON \
    -DTENSORTIER_PYTHON_TEST_SEAMS=ON \
    -DPython_EXECUTABLE="$(command -v "$PY")" ${pybind[@]+"${pybind[@]}"} \
    ${prefix[@]+"${prefix[@]}"} || return 1
  cmake --build "$BUILD" -j "$JOBS" || return 1
  [ "$tests" = ON ] || echo "NO_CPP_TESTS" > "$BUILD/no-cpp-tests"
  # A venv over the machine's Python (its torch), holding only our package and CLI. Where that
  # Python is itself a venv (the GPU image's /opt/torch/.venv), --system-site-packages reaches
  # only the interpreter it was made from, not that venv's packages: a .pth file adds them.
  if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv --system-site-packages --without-pip "$VENV" || return 1
  fi
  local site
  site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "$PY" -c 'import site, sys
if sys.prefix != sys.base_prefix:
    with open(sys.argv[1], "w") as f:
        f.writelines(f"import site; site.addsitedir({d!r})\n" for d in site.getsitepackages())
    print(f"{sys.argv[1]}: the venv sees the packages of {sys.prefix}")' \
    "$site/_gpu_test_parent_venv.pth" || return 1
  "$VENV/bin/python" -c 'import torch' || { echo "the venv $VENV does not see torch"; return 1; }
  rm -rf "$site/tensortier"
  cp -r python/tensortier "$site/tensortier"
  cp "$BUILD"/_core*.so "$BUILD"/_testing*.so "$site/tensortier/"  # _testing: the tests' faults
  cp "$BUILD/tensortier" "$VENV/bin/tensortier"
  local wheels="${WHEELS:-$ROOT/build/gpu-wheels}" wheel module
  if compgen -G "$wheels/*.whl" > /dev/null; then
    for wheel in "$wheels"/*.whl; do
      module=$(basename "$wheel")
      module=${module%%-*}
      [ "$module" = markdown_it_py ] && module=markdown_it
      "$VENV/bin/python" -c "import $module" 2>/dev/null && continue  # the machine's own wins
      "$VENV/bin/python" -m zipfile -e "$wheel" "$site" &&
        echo "unpacked $(basename "$wheel") into the venv"
    done
  fi
  use_wheel_cufile  # so that the line below says what the tests will load
  "$VENV/bin/python" -c 'import tensortier; print("tensortier", tensortier.__version__,
tensortier.cuda_info(), tensortier.cufile_info())'
}

built() { [ -x "$VENV/bin/python" ] && [ -x "$VENV/bin/tensortier" ]; }

# cuFile where the loader does not find libcufile.so.0 but a Python package holds it (the GPU
# image has it only in NVIDIA's nvidia-cufile wheel): the tests and benchmarks load that one
# (TENSORTIER_CUFILE_LIBRARY), so that cuFile's own code runs there too.
use_wheel_cufile() {
  [ -n "${TENSORTIER_CUFILE_LIBRARY:-}" ] && return 0
  ldconfig -p 2>/dev/null | grep -q 'libcufile\.so\.0 ' && return 0
  local lib
  lib=$("$VENV/bin/python" -c 'import glob, os, sys
for d in sys.path:
    for f in sorted(glob.glob(os.path.join(d, "nvidia", "**", "libcufile.so.0"), recursive=True)):
        print(f)
        raise SystemExit' 2>/dev/null)
  if [ -n "$lib" ]; then
    export TENSORTIER_CUFILE_LIBRARY=$lib
    echo "cuFile: $lib (TENSORTIER_CUFILE_LIBRARY; the loader does not find libcufile.so.0)"
  else
    echo "cuFile: no libcufile.so.0 here (the cuFile tests will skip)"
  fi
}

# ---- tests -------------------------------------------------------------------------------
cpp_tests() {
  if [ -f "$BUILD/no-cpp-tests" ]; then
    echo "SKIP: C++ tests were not built (cmake did not find GoogleTest)"
    return "$SKIP"
  fi
  use_wheel_cufile
  local out="$BUILD/ctest-output.txt" rc suite  # the step's log holds it too: not in OUTDIR
  (cd "$BUILD" && ctest --output-on-failure --no-tests=error -j "$JOBS" \
    --output-junit "$OUTDIR/ctest.xml") > "$out" 2>&1
  rc=$?
  cat "$out"
  # The GPU suites must have run, not skipped (cuFile's may skip: GDS is optional). Read from
  # the one ctest run above, not a second run of the suites.
  echo "-- GPU suites:"
  grep -E "(TransferGpu|CudaGpu|CuFileGpu)[A-Za-z]*\." "$out" | grep -E "Passed|Failed|Skipped" || true
  if grep -E "(TransferGpu|CudaGpu)[A-Za-z]*\..*Skipped" "$out" > /dev/null; then
    echo "the CUDA GPU suites skipped: the tests cannot use the CUDA driver (see above)"
    rc=1
  fi
  for suite in CudaGpu TransferGpu; do  # and they were found at all
    if ! grep -E "${suite}[A-Za-z]*\..*Passed" "$out" > /dev/null; then
      echo "no $suite test passed: the GPU suites did not run"
      rc=1
    fi
  done
  return $rc
}

py_tests() {
  local marks=() module
  for module in pytest numpy; do
    "$VENV/bin/python" -c "import $module" 2>/dev/null && continue
    if "$PY" -c "import $module" 2>/dev/null; then  # a broken venv must not pass as a skip
      echo "$PY has $module but the venv $VENV does not see it"
      return 1
    fi
    echo "SKIP: $module is not installed for $PY (tests/python needs pytest and numpy)"
    return "$SKIP"
  done
  [ "$QUICK" = 1 ] && marks=(-m "not slow")
  [ "$GPU_ONLY" = 1 ] && export TENSORTIER_GPU_TESTS_ONLY=1
  # A hung test shows in the log: each test's name (-v), every thread's stack after 240 s, and
  # (where pytest-timeout is installed) that test failed after 300 s instead of the whole step.
  "$VENV/bin/python" -c "import pytest_timeout" 2>/dev/null && marks+=(--timeout=300)
  use_wheel_cufile
  local rc
  "$VENV/bin/python" -m pytest -v -rs -p no:cacheprovider -o faulthandler_timeout=240 \
    "${marks[@]}" --junitxml="$OUTDIR/pytest.xml" tests/python
  rc=$?
  # The GPU tests must have run: a skip for want of CUDA means the venv's torch saw no GPU.
  "$VENV/bin/python" - "$OUTDIR/pytest.xml" <<'EOF' || rc=1
import sys
import xml.etree.ElementTree as ET

cases = list(ET.parse(sys.argv[1]).getroot().iter("testcase"))
files = ("test_gpu_transfer", "test_gpu_shared", "test_dcp_save")
gpu = {f: [c for c in cases if c.get("classname", "").endswith(f)] for f in files}
skipped = [c for c in cases for s in c.findall("skipped")
           if "needs a CUDA" in (s.get("message") or "")]
print("-- GPU tests: " + ", ".join(f"{len(gpu[f])} in {f}.py" for f in files) +
      f", {len(skipped)} skipped for want of CUDA")
for c in skipped[:10]:
    print(f"   skipped: {c.get('classname')}::{c.get('name')}")
sys.exit(1 if skipped or not all(gpu.values()) else 0)
EOF
  return $rc
}

# ---- benchmarks --------------------------------------------------------------------------
bench() {
  local repeats=() rc
  use_wheel_cufile
  [ -n "$REPEATS" ] && repeats=(--repeats "$REPEATS")
  rm -rf "$BENCH_DIR"  # what a run killed at its time limit left (up to 3 files of a size)
  "$VENV/bin/python" bench/gpu_bench.py --dir "$BENCH_DIR" --sizes "$SIZES" "${repeats[@]}" \
    --json "$OUTDIR/gpu_bench_${SIZES//,/-}.json"
  rc=$?
  rm -rf "$BENCH_DIR"
  return $rc
}

bench_checkpoint() {
  local rc
  use_wheel_cufile
  rm -rf "$BENCH_DIR/checkpoint"
  "$VENV/bin/python" bench/checkpoint_bench.py --dir "$BENCH_DIR/checkpoint" \
    --scenarios gpu-cold,gpu-warm --repeats "${REPEATS:-3}" \
    --json "$OUTDIR/checkpoint_gpu_bench.json"
  rc=$?
  rm -rf "$BENCH_DIR/checkpoint"
  return $rc
}

export -f have_gtest build built use_wheel_cufile cpp_tests py_tests bench bench_checkpoint

# ---- run ---------------------------------------------------------------------------------
BUILD_STEP="build (C++ library, tests, CLI, Python extension; venv)"
if [ "$phase" = all ] || [ "$phase" = build ] || ! built; then
  step "$BUILD_STEP" "$OUTDIR/build.log" build
fi
if built; then
  case "$phase" in all | test | test-cpp)
    step "C++ tests (ctest, GPU suites included)" "$OUTDIR/ctest.log" cpp_tests ;;
  esac
  case "$phase" in all | test | test-py)
    step "Python tests (pytest, GPU tests included)" "$OUTDIR/pytest.log" py_tests ;;
  esac
  case "$phase" in all | bench)
    step "GPU benchmark ($SIZES, warm and cold)" "$OUTDIR/gpu_bench_${SIZES//,/-}.log" bench ;;
  esac
  case "$phase" in all | bench-checkpoint)
    step "checkpoint loads to the GPU (2 GiB, warm and cold)" "$OUTDIR/checkpoint_gpu_bench.log" \
      bench_checkpoint ;;
  esac
elif [ "$phase" != build ]; then
  note "FAIL nothing is built: the $phase step cannot run"
  status=1
fi

echo "== summary ($SUMMARY)"
cat "$SUMMARY"
exit $status
