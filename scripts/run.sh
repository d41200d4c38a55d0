#!/usr/bin/env bash
# The main job on a fresh machine: set up, check this machine, then a short benchmark.
# Usage: scripts/run.sh [DIR]   (default: tensortier-data at the repository's root)
set -euo pipefail
# DIR as the caller wrote it, from the caller's directory (before the cd below).
DIR="$(realpath -m -- "${1:-$(dirname "$0")/../tensortier-data}")"
cd "$(dirname "$0")/.."
scripts/setup.sh
mkdir -p "$DIR"
.venv/bin/tensortier check "$DIR"
.venv/bin/tensortier bench --dir "$DIR" --size 512M
