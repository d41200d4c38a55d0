"""bench/checkpoint_bench.py runs end to end (small, tensortier's tools and the GPU scenarios'
code on the CPU): the benchmark a GPU machine will run must not rot on machines without one."""

from __future__ import annotations

import json
import os
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
    assert all(cold[tool]["verified"] for tool in loads)
    limit = gpu["min(file-read, h2d)"]
    assert limit["samples_gbps"] == [min(a, b) for a, b in zip(
        gpu["file-read"]["samples_gbps"], gpu["h2d"]["samples_gbps"])]
    assert limit["target"] == 0.9 and gpu["safetensors"]["target"] == 2.0
    assert "### load to GPU, cold cache" in r.stdout
    assert not list((disk_dir / "d").glob("*.safetensors"))  # its files are removed


def test_checkpoint_bench_warm_fresh_runs_each_load_in_a_new_process(disk_dir: Path) -> None:
    out = disk_dir / "bench.json"
    r = subprocess.run(
        [sys.executable, str(REPO / "bench" / "checkpoint_bench.py"), "--dir", str(disk_dir / "d"),
         "--size", "8M", "--tensors", "40", "--repeats", "1", "--scenarios", "warm-fresh",
         "--tools", "tt-safetensors,torch.load,first-touch", "--json", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["scenarios"]["warm-fresh"]
    for tool in ("tt-safetensors", "torch.load", "first-touch"):
        assert len(rows[tool]["samples_gbps"]) == 1 and rows[tool]["median_gbps"] > 0, tool
    assert rows["torch.load"]["target"] == 2.0 and rows["first-touch"]["target"] is None
    # Each child's load was hashed and compared (first-touch loads nothing to compare).
    assert rows["tt-safetensors"]["verified"] and rows["torch.load"]["verified"]
    assert not rows["first-touch"]["verified"]
    assert "one load per new process" in r.stdout


def test_state_digest_sees_one_changed_byte() -> None:
    """warm-fresh verifies a child's load by this digest: it must see any difference."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("checkpoint_bench",
                                                  REPO / "bench" / "checkpoint_bench.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(bench)
    finally:
        del sys.modules[spec.name]
    sd = {"a": torch.arange(1000, dtype=torch.int32), "b": torch.ones(3, 5, dtype=torch.bfloat16),
          "empty": torch.zeros(0)}
    base = bench.state_digest(sd)
    assert base == bench.state_digest({k: v.clone() for k, v in sd.items()})
    changed = dict(sd, a=sd["a"].clone())
    changed["a"][999] += 1
    assert bench.state_digest(changed) != base
    assert bench.state_digest(dict(sd, b=sd["b"].reshape(5, 3))) != base
    assert bench.state_digest(dict(sd, a=sd["a"].view(torch.float32))) != base


def test_drop_file_cache_says_when_the_kernel_kept_the_pages(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The benchmarks' "cold" loads rest on POSIX_FADV_DONTNEED; a sandbox that ignores it
    (simulated: the advice does nothing) would make them warm unnoticed: drop_file_cache
    measures what stayed cached (mincore) and warns once per file."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import _benchlib
    finally:
        sys.path.remove(str(REPO / "bench"))
    path = disk_dir / "f.bin"
    path.write_bytes(bytes(8 << 20))
    _benchlib.warm_file(path)
    assert _benchlib.cached_fraction(path) > 0.9
    left = _benchlib.drop_file_cache(path)
    assert left is not None and left < 0.05  # this disk honours the advice
    assert "still in the page cache" not in capsys.readouterr().err
    _benchlib.warm_file(path)
    monkeypatch.setattr(_benchlib.os, "posix_fadvise", lambda *args: None)
    assert _benchlib.drop_file_cache(path) > 0.9
    assert _benchlib.drop_file_cache(path) > 0.9
    err = capsys.readouterr().err
    assert err.count("still in the page cache after dropping it") == 1, err
    empty = disk_dir / "empty.bin"
    empty.touch()
    assert _benchlib.cached_fraction(empty) is None


def test_checkpoint_fresh_bench_runs_every_sample_in_a_new_process(disk_dir: Path) -> None:
    """bench/checkpoint_fresh_bench.py at a tiny size, one round, the loaders and savers that
    are always here (fio where it is installed), cold and warm: a well-formed result, every load
    verified by its hash, a peak RSS for every sample, and the LLM-shaped state dict's 268
    tensors."""
    import shutil

    out = disk_dir / "fresh.json"
    fio = ",fio" if shutil.which("fio") else ""
    loads = ["tt-safetensors", "tt-torch", "safetensors", "torch.load"]
    saves = ["tt-safetensors", "tt-torch", "torch.save", "safetensors"]
    r = subprocess.run(
        [sys.executable, str(REPO / "bench" / "checkpoint_fresh_bench.py"),
         "--dir", str(disk_dir / "d"), "--size", "4M", "--rounds", "1",
         "--loads", ",".join(loads) + fio, "--saves", ",".join(saves) + fio,
         "--warm", ",".join(loads) + fio, "--json", str(out)],
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["tensors"] == 268 and results["rounds"] == 1
    assert 3 << 20 < results["bytes"] < 5 << 20
    for op, tools, baseline in (("load", loads, "safetensors"), ("warm", loads, "safetensors"),
                                ("save", saves, "torch.save")):
        rows = results["ops"][op]
        assert set(tools) <= set(rows), rows.keys()
        for tool in tools + (["fio"] if fio else []):
            row = rows[tool]
            assert len(row["samples_gbps"]) == 1 and row["median_gbps"] > 0, (op, tool)
            assert row[f"ratio_vs_{baseline}"] > 0, (op, tool)
            if tool != "fio":  # a Python child: its peak RSS and RSS before the timing
                assert row["peak_rss_bytes"][0] >= row["rss_before_bytes"][0] > 0, (op, tool)
                assert row["verified"], (op, tool)  # hashed against the state dict
        assert rows[baseline][f"ratio_vs_{baseline}"] == 1.0
    for tool in loads:  # dropped from the page cache before the load, and checked
        assert results["ops"]["load"][tool]["cached_fraction_before"][0] < 0.05, tool
    for tool in loads:  # read into the page cache before the warm load, and checked
        cached = results["ops"]["warm"][tool]["cached_fraction_before"][0]
        assert cached is None or cached > 0.95, tool
    assert {c["result"] for c in results["targets"]} <= {"pass", "miss", "n/a"}
    assert any(c["target"].startswith("save tt-torch >= 5x") for c in results["targets"])
    # the warm target compares with the fastest copying loader: torch.load here, never the
    # mapping safetensors.load_file
    warm_targets = [c for c in results["targets"] if c["target"].startswith("warm load")]
    assert [c["target"] for c in warm_targets] == [
        f"warm load {t} >= 1.3x fastest copying loader (torch.load)"
        for t in ("tt-safetensors", "tt-torch")]
    assert all(c["ratio"] > 0 for c in warm_targets)
    assert "### cold load to CPU, one load per new process" in r.stdout
    assert "### save until durable, one save per new process" in r.stdout
    assert "### warm load to CPU (file in the page cache), one load per new process" in r.stdout
    assert not [p for p in (disk_dir / "d").iterdir()]  # its files are removed


def test_checkpoint_fresh_bench_skips_a_loader_that_does_not_import(disk_dir: Path) -> None:
    """An optional loader that is not installed (here: shadowed by a module that refuses to
    import) is skipped with a printed line naming the pip package; the run still succeeds."""
    shadow = disk_dir / "shadow"
    shadow.mkdir()
    (shadow / "tensorizer.py").write_text("raise ImportError('not installed here')\n")
    out = disk_dir / "fresh.json"
    r = subprocess.run(
        [sys.executable, str(REPO / "bench" / "checkpoint_fresh_bench.py"),
         "--dir", str(disk_dir / "d"), "--size", "2M", "--rounds", "1",
         "--loads", "tt-safetensors,tensorizer", "--saves", "none", "--warm", "none",
         "--json", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "PYTHONPATH": str(shadow)},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "load tensorizer: skipped: tensorizer does not import" in r.stderr
    assert "pip install tensorizer" in r.stderr
    results = json.loads(out.read_text())
    rows = results["ops"]["load"]
    assert rows["tensorizer"]["error"].startswith("skipped")
    assert not rows["tensorizer"]["samples_gbps"]
    assert rows["tt-safetensors"]["verified"] and "save" not in results["ops"]
    assert "warm" not in results["ops"]
