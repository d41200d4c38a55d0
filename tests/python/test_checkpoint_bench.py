"""bench/checkpoint_bench.py runs end to end (small, tensortier's tools and the GPU scenarios'
code on the CPU): the benchmark a GPU machine will run must not rot on machines without one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("safetensors")

REPO = Path(__file__).resolve().parents[2]


def test_checkpoint_bench_small_run(disk_dir: Path) -> None:
    out = disk_dir / "bench.json"
    r = subprocess.run(
        [sys.executable, str(REPO / "bench" / "checkpoint_bench.py"), "--dir", str(disk_dir / "d"),
         "--size", "8M", "--tensors", "40", "--repeats", "2",
         "--scenarios", "cold,warm,gpu-cold", "--gpu-device", "cpu",
         "--tools", "tt-safetensors,tt-unstaged,tt-mmap,safetensors,file-read,h2d",
         "--json", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads(out.read_text())
    cold = results["scenarios"]["cold"]
    warm = results["scenarios"]["warm"]
    gpu = results["scenarios"]["gpu-cold"]
    loads = ("tt-safetensors", "tt-unstaged", "tt-mmap", "safetensors")
    for rows, tools in ((cold, loads), (warm, loads),
                        (gpu, ("tt-safetensors", "safetensors", "file-read", "h2d"))):
        for tool in tools:
            assert len(rows[tool]["samples_gbps"]) == 2 and rows[tool]["median_gbps"] > 0, tool
    limit = gpu["min(file-read, h2d)"]
    assert limit["samples_gbps"] == [min(a, b) for a, b in zip(
        gpu["file-read"]["samples_gbps"], gpu["h2d"]["samples_gbps"])]
    assert limit["target"] == 0.9 and gpu["safetensors"]["target"] == 2.0
    assert "### load to GPU, cold cache" in r.stdout
    assert not list((disk_dir / "d").glob("*.safetensors"))  # its files are removed
