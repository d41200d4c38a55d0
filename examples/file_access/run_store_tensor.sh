#!/usr/bin/env bash
# Stores a MB_SIZE MiB tensor (default 1024) into FOLDER (default ./tensortier-data) with every
# storer: plain Python and tensortier, CPU and (with a GPU) GPU, tensortier's through the bounce
# ring and with --gds.
# Usage: run_store_tensor.sh [FOLDER] [MB_SIZE] [LOOP]; EXTRA=--fsync includes fsync in the timing.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
py="${PYTHON:-$here/../../.venv/bin/python}"
folder="${1:-tensortier-data}"
mb="${2:-1024}"
loop="${3:-3}"
mkdir -p "$folder"
gpu=$("$py" -c 'import torch; print(int(torch.cuda.is_available()))')
for script in py_store_cpu_tensor tensortier_store_cpu_tensor; do
  "$py" "$here/$script.py" --nvme_folder "$folder" --mb_size "$mb" --loop "$loop" --validate ${EXTRA:-}
done
if [ "$gpu" = 1 ]; then
  for script in py_store_gpu_tensor tensortier_store_gpu_tensor; do
    "$py" "$here/$script.py" --nvme_folder "$folder" --mb_size "$mb" --loop "$loop" --validate ${EXTRA:-}
  done
  "$py" "$here/tensortier_store_gpu_tensor.py" --nvme_folder "$folder" --mb_size "$mb" --loop "$loop" --validate --gds ${EXTRA:-}
else
  echo "no CUDA device: GPU storers skipped"
fi
