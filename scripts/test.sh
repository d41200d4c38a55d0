#!/usr/bin/env bash
# The whole test suite on a fresh machine: set up, C++ tests (plain, ASan+UBSan, TSan for the
# engine, the offloader, the transfer ring, shared tensors and the batch reader), Python tests,
# then differential fuzzing of checkpoints against torch and safetensors, and of the library
# against the CLI on crafted files (DIFF_FUZZ_CASES cases per mode, DIFF_FUZZ_SEED). Any failure
# fails the script; "no tests ran" counts as a failure.
# Without a GPU the C++ GPU suites run against a stand-in driver (tests/cpp/fake_cuda) and the
# Python GPU tests skip; scripts/gpu-test.sh runs them all on a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
# The package (built by scripts/setup.sh) and the plain C++ tests are Release builds of the same
# library and tool sources with the same flags: through one compiler cache under build/, the tests'
# build takes those objects from the package's build instead of compiling them again. The cache
# keys on paths relative to the build directory (build/<name> for both) and on the compiler's
# name, so both builds name one.
export CCACHE_DIR="$PWD/build/ccache" CCACHE_BASEDIR="$PWD" CCACHE_DEPEND=1
export CXX="${CXX:-g++}"
CMAKE_CXX_COMPILER_LAUNCHER=ccache scripts/setup.sh
JOBS="${JOBS:-$(nproc)}"
phase() { echo "== $* (at ${SECONDS} s)"; }
trap 'echo "== done in ${SECONDS} s"' EXIT

build_and_test() {  # build_and_test DIR FILTER [cmake args...]
  local dir=$1 filter=$2
  shift 2
  cmake -S . -B "$dir" -G Ninja -DTENSORTIER_BUILD_TESTS=ON -DTENSORTIER_BUILD_PYTHON=OFF "$@" >/dev/null
  ninja -C "$dir" -j "$JOBS" tests/cpp/all  # the test binaries the configuration has
  local filter_args=()
  [ -n "$filter" ] && filter_args=(-R "$filter")
  (cd "$dir" && ctest --output-on-failure --no-tests=error -j "$JOBS" "${filter_args[@]}")
}

phase "C++ tests"
build_and_test build/test "" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER_LAUNCHER=ccache
# The sanitized builds are Debug builds with line tables only (-g1): their reports name the
# function, file and line of each frame, and they build about a fifth faster than with -g. They
# are unity builds (CMake's, 8 source files to a compiler run), which build in about 0.6x the
# time: so no two files of a target may give file-local helpers the same name. Their test cases
# run as 8 GoogleTest shards, not each as a process of its own: a sanitizer's runtime takes a
# fifth of a second to start, hundreds of times over (the plain build above still runs every
# case alone, so a case that passes only after another is caught there).
SANITIZED=(-DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG=-g1 -DCMAKE_UNITY_BUILD=ON
  -DTENSORTIER_TEST_SHARDS=8)
phase "C++ tests under AddressSanitizer + UndefinedBehaviorSanitizer"
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
  build_and_test build/asan "" "${SANITIZED[@]}" -DTENSORTIER_SANITIZE=address,undefined
phase "Parser fuzz targets under AddressSanitizer + UndefinedBehaviorSanitizer (${FUZZ_SECONDS:-20} s each)"
cmake -S . -B build/asan -DTENSORTIER_BUILD_FUZZ=ON >/dev/null
ninja -C build/asan -j "$JOBS" fuzz_safetensors_header fuzz_zip_directory fuzz_torch_pickle \
  fuzz_extent_map fuzz_dcp_metadata
fuzz() {  # fuzz TARGET, its output into build/asan/fuzz-TARGET.log
  # A scratch corpus: libFuzzer (Clang builds) writes new inputs into its first directory.
  local corpus="build/asan/fuzz-corpus/$1"
  rm -rf "$corpus" && mkdir -p "$corpus"
  cp tests/data/checkpoint/*.safetensors tests/data/checkpoint/*.pt tests/data/checkpoint/*.zip \
    tests/fuzz/corpus/torch_pickle/* tests/fuzz/corpus/extent_map/* \
    tests/fuzz/corpus/dcp_metadata/* "$corpus"/
  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
    "build/asan/tests/fuzz/fuzz_$1" -max_total_time="${FUZZ_SECONDS:-20}" "$corpus" \
    >"build/asan/fuzz-$1.log" 2>&1
}
# Each target is single-threaded: JOBS of them at a time, each with a core of its own.
targets=(safetensors_header zip_directory torch_pickle extent_map dcp_metadata)
fuzz_failed=()
for ((i = 0; i < ${#targets[@]}; i += JOBS)); do
  batch=("${targets[@]:i:JOBS}")
  pids=()
  for target in "${batch[@]}"; do
    fuzz "$target" &
    pids+=($!)
  done
  for j in "${!batch[@]}"; do
    wait "${pids[j]}" || fuzz_failed+=("${batch[j]}")
    cat "build/asan/fuzz-${batch[j]}.log"
  done
done
if [ ${#fuzz_failed[@]} -gt 0 ]; then
  echo "fuzz targets failed: ${fuzz_failed[*]}" >&2
  exit 1
fi
phase "C++ engine, offloader, transfer, shared-tensor and batch reader tests under ThreadSanitizer"
TSAN_OPTIONS=halt_on_error=1 \
  build_and_test build/tsan "" "${SANITIZED[@]}" -DTENSORTIER_SANITIZE=thread \
  -DTENSORTIER_TEST_FILTER="*Engine*:*Fault*:*Offload*:*Transfer*:*Shared*:*UnixSocketStore*:*BatchReader*:*DeviceJob*" \
  -DTENSORTIER_TEST_FILES="/test_(batch_reader|cuda|device_jobs|device_offload|engine|faults|offloader|shared_[a-z_]+|transfer)\\.cpp$"

phase "C++ install: find_package(tensortier) from a separate project"
rm -rf build/install build/consumer
ninja -C build/test -j "$JOBS" all  # the shared library and the tool, which the tests do not need
cmake --install build/test --prefix build/install >/dev/null
# Only the public API is installed (no internal header of src/), and each installed header builds
# on its own.
for internal in src/*/*.hpp; do
  if [ -e "build/install/include/tensortier/$(basename "$(dirname "$internal")")/$(basename "$internal")" ]; then
    echo "internal header $internal was installed" >&2
    exit 1
  fi
done
# The test seams (fault injection) are part of neither the installed library and tool nor the
# Python extension tensortier._core, whichever way the package was built (setup.sh adds the
# test-only tensortier._testing, which holds them). Stripped files keep no symbol table, so their
# strings (the classes' type names) are searched too; the search must find the seams in _testing.
library=$(find build/install -name 'libtensortier.so*' -type f | head -n 1)
[ -n "$library" ] || { echo "no libtensortier.so was installed" >&2; exit 1; }
seams() { { nm -C "$1" 2>/dev/null || true; strings -a "$1"; } | grep -cE \
  "FaultInjector|FaultInjectingBackend|FaultHooks|InjectUringSubmitFault" || true; }
module() { .venv/bin/python -c "import tensortier.$1 as m; print(m.__file__)"; }
for file in "$library" build/install/bin/tensortier "$(module _core)"; do
  if [ "$(seams "$file")" -ne 0 ]; then
    echo "$file holds the test-only fault injection" >&2
    exit 1
  fi
done
if [ "$(seams "$(module _testing)")" -eq 0 ]; then
  echo "no fault injection found in tensortier._testing: the check above is blind" >&2
  exit 1
fi
header_builds() {  # header_builds HEADER: the installed header compiles on its own
  echo "#include \"${1#build/install/include/}\"" |
    c++ -std=c++20 -fsyntax-only -Ibuild/install/include -x c++ - ||
    { echo "installed $1 does not build on its own" >&2; return 1; }
}
export -f header_builds
printf '%s\0' build/install/include/tensortier/*/*.hpp |
  xargs -0 -n 1 -P "$JOBS" bash -c 'header_builds "$1"' header_builds
cmake -S examples/cpp_consumer -B build/consumer -G Ninja -DCMAKE_PREFIX_PATH="$PWD/build/install" >/dev/null
ninja -C build/consumer >/dev/null
build/consumer/round_trip build/consumer/round_trip.dat

phase "Python tests ($JOBS at a time)"
# Most of the suite's time is its child processes (torchrun ranks, fresh interpreters, the CLI)
# starting and waiting: JOBS pytest workers (pytest-xdist) keep both cores busy. Each test takes
# its own files, ports, mounts and loop devices, so tests run side by side; worksteal evens out
# the test files of very different lengths.
set +e
.venv/bin/python -m pytest -q --durations=25 -n "$JOBS" --dist worksteal tests/python
rc=$?
set -e
if [ $rc -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
[ $rc -eq 0 ] || exit $rc

# The documentation site: generated pages (API reference, CLI reference, settings) included; a
# broken link or reference fails the build (--strict). Into build/site, outside the tree.
echo "== Documentation site (mkdocs build --strict)"
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir build/site

# Seeded, so every run checks the same cases (~2 min of work, the agree mode among it, where
# tensortier.load, verify, info and convert must agree on crafted files); a finding not in the
# fuzzer's KNOWN_GAPS fails the step and is printed with the command that reruns its case. The
# modes are single-threaded: two groups of about equal length, one on each core.
cases="${DIFF_FUZZ_CASES:-1000}"
seed="${DIFF_FUZZ_SEED:-1}"
phase "Differential fuzzing of checkpoints, and agreement of the library and the CLI ($cases cases per mode, seed $seed)"
groups=(torch,cli,agree st,craft)
pids=()
for group in "${groups[@]}"; do
  .venv/bin/python tests/differential/checkpoint_fuzz.py "$group" "$seed" "$cases" \
    >"build/difffuzz-$group.log" 2>&1 &
  pids+=($!)
done
fuzz_failed=()
for j in "${!groups[@]}"; do
  wait "${pids[j]}" || fuzz_failed+=("${groups[j]}")
  cat "build/difffuzz-${groups[j]}.log"
done
if [ ${#fuzz_failed[@]} -gt 0 ]; then
  echo "differential fuzzing failed: ${fuzz_failed[*]}" >&2
  exit 1
fi
