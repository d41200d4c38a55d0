"""bench/data_bench.py runs end to end on a small tree: every file reader and DALI pipeline built
once and run over several epochs, each epoch checked to read every file and, but for
fn.readers.file's last batch filled from the next epoch, every byte."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("nvidia.dali")

REPO = Path(__file__).resolve().parents[2]
TOOLS = ["tensortier", "tensortier_dali", "seed_dali", "loop", "dali_reader", "pool16"]


@pytest.mark.parametrize("dali_output", ["sizes", "bytes"])
def test_data_bench_small_warm_run(disk_dir: Path, dali_output: str) -> None:
    out = disk_dir / "bench.json"
    r = subprocess.run(
        [sys.executable, str(REPO / "bench" / "data_bench.py"), "--dir", str(disk_dir / "d"),
         "--files", "70", "--classes", "3", "--min-kib", "1", "--max-kib", "9",
         "--batch-size", "16", "--repeats", "2", "--epochs", "3", "--modes", "warm",
         "--dali-output", dali_output, "--tools", ",".join(TOOLS), "--json-out", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["epochs"] == 3 and report["dali_output"] == dali_output
    for tool in TOOLS:
        runs = report["samples"]["warm"][tool]
        assert len(runs) == 2, tool
        # Three epochs of 70 files per repeat.
        assert all(abs(run["files_per_s"] * run["seconds"] - 3 * 70) < 1e-6 for run in runs), tool
        if tool != "dali_reader":
            assert all(abs(run["gbps"] * run["seconds"] * 1e9 - 3 * report["bytes"]) < 1
                       for run in runs), tool


def test_data_bench_fio_on_a_tree_smaller_than_its_blocks(disk_dir: Path) -> None:
    # 3 files of a few KiB: less than one 128 KiB read, and than one 1 MiB fill block.
    import shutil

    if shutil.which("fio") is None:
        pytest.skip("fio is not installed")
    out = disk_dir / "bench.json"
    r = subprocess.run(
        [sys.executable, str(REPO / "bench" / "data_bench.py"), "--dir", str(disk_dir / "d"),
         "--files", "3", "--classes", "1", "--min-kib", "1", "--max-kib", "9",
         "--repeats", "1", "--modes", "cold_data", "--tools", "fio", "--json-out", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["bytes"] < 128 << 10
    assert "--io_size=131072" in report["fio_command"] and "--size=1048576" in report["fio_command"]
    assert len(report["samples"]["cold_data"]["fio"]) == 1
    assert (disk_dir / "d" / "fio-scratch.dat").stat().st_size == 1 << 20
