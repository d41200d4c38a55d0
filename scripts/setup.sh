#!/usr/bin/env bash
# Installs everything tensortier needs on a fresh Debian machine, then builds and installs the
# package into .venv at the repository root. Idempotent: re-running only rebuilds what changed.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(build-essential cmake ninja-build pkg-config liburing-dev libaio-dev libgtest-dev fio
  e2fsprogs mount util-linux fdisk   # these four: mkfs.ext4, mount, losetup/partx and sfdisk
                                     # for the extent-map tests
  strace                             # the CLI tests count the reads of a file
  ccache                             # scripts/test.sh: one build's objects reused by another
  python3 python3-venv python3-dev)  # Debian's Python 3.11: venv's ensurepip, Python.h
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${missing[@]}"
fi

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PYTHON" -m venv .venv
fi
# torch==2.13.0 is the pinned CPU build; an unpinned torch would pull GBs of CUDA wheels.
.venv/bin/python -m pip install -q --upgrade pip
# nvidia-cufile and nvidia-cuda-runtime (1.5 and 2.2 MB; nothing lands on the loader's path):
# NVIDIA's libcufile.so.0, which a test loads without a CUDA driver, and cufile.h and cuda.h,
# which tests/python/test_cuda_abi.py holds tensortier's own declarations against.
# nvidia-dali-cuda130 (~270 MB, runs CPU-only pipelines without a driver) and Pillow are
# test-only: the training-data reader's tests compare with DALI's fn.readers.file, run real DALI
# pipelines over it and compare decoded JPEGs with PIL's.
.venv/bin/python -m pip install -q "torch==2.13.0" numpy pytest "pytest-xdist==3.8.0" safetensors \
  "scikit-build-core>=0.10" "pybind11>=2.12" ninja "nvidia-cufile==1.20.0.107" \
  "nvidia-cuda-runtime==13.0.96" "nvidia-dali-cuda130==2.4.0" Pillow
# transformers and accelerate are test-only: tensortier.hf's tests compare with transformers'
# own from_pretrained/save_pretrained on tiny random-weight models (the versions hf.py supports).
.venv/bin/python -m pip install -q "transformers==5.23.0" "accelerate==1.15.0"
# The documentation site's tools, pinned with the libraries whose warnings --strict turns into
# errors (griffelib reads the docstrings): scripts/test.sh builds the site with mkdocs --strict.
.venv/bin/python -m pip install -q "mkdocs==1.6.1" "mkdocs-material==9.8.1" "mkdocstrings==1.0.8" \
  "mkdocstrings-python==2.0.11" "griffelib==2.4.1" "mkdocs-autorefs==1.4.5" \
  "pymdown-extensions==13.1.2" "Markdown==3.11.3"
echo "setup: building and installing tensortier into .venv"
# With tensortier._testing, the test-only module through which the tests inject faults (a plain
# `pip install .` leaves it out).
.venv/bin/python -m pip install -q --no-build-isolation \
  -C cmake.define.TENSORTIER_PYTHON_TEST_SEAMS=ON .
.venv/bin/python -c "import tensortier; print('setup: tensortier', tensortier.__version__, 'ready')"
