#!/usr/bin/env bash
# The main job on a fresh machine: set up, check this machine, then a short benchmark.
# Usage: scripts/run.sh [DIR]   (default: ./tensortier-data)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
DIR="${1:-./tensortier-data}"
mkdir -p "$DIR"
.venv/bin/tensortier check "$DIR"
.venv/bin/tensortier bench --dir "$DIR" --size 512M
