#!/usr/bin/env bash
# Loads INPUT_FILE (default: a 1 GiB file made in ./tensortier-data) with every loader:
# plain Python and tensortier, CPU and (with a GPU) GPU, tensortier's through the bounce ring and
# with --gds. Usage: run_load_tensor.sh [FILE] [LOOP]
# EXTRA=--cold evicts the file from the page cache before each load.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
py="${PYTHON:-$here/../../.venv/bin/python}"
file="${1:-}"
loop="${2:-3}"
if [ -z "$file" ]; then
  mkdir -p tensortier-data
  file=tensortier-data/test_1GB.bin
  [ -f "$file" ] || head -c 1G /dev/urandom > "$file"
fi
gpu=$("$py" -c 'import torch; print(int(torch.cuda.is_available()))')
for script in py_load_cpu_tensor tensortier_load_cpu_tensor; do
  "$py" "$here/$script.py" --input_file "$file" --loop "$loop" --validate ${EXTRA:-}
done
if [ "$gpu" = 1 ]; then
  for script in py_load_gpu_tensor tensortier_load_gpu_tensor; do
    "$py" "$here/$script.py" --input_file "$file" --loop "$loop" --validate ${EXTRA:-}
  done
  "$py" "$here/tensortier_load_gpu_tensor.py" --input_file "$file" --loop "$loop" --validate --gds ${EXTRA:-}
else
  echo "no CUDA device: GPU loaders skipped"
fi
