"""CPU tensor file access (issue 4): DeepNVMe's file-access scripts against fio, in one run.

Runs ``examples/file_access/{py,tensortier}_{load,store}_cpu_tensor.py`` (each prints
``label: X GB/sec``) and fio on the same file size, tools in rotated order, several repeats,
and reports medians and the ratios tensortier / baseline against the issue's targets:

  store        py_store (buffered write, no fsync, as DeepNVMe's script) and fio write
               (io_uring, O_DIRECT, 1 MiB blocks, queue depth 32)
  load-warm    py_load / tensortier_load of a file in the page cache, and fio buffered read
  load-cold    the same after evicting the file (``--cold``), and fio O_DIRECT read

Targets: tensortier load >= 2.5x py_, store >= 4x py_, and >= 0.9x fio.

    python bench/file_access_bench.py --mb-size 1024 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/_benchlib.py, from any directory
from _benchlib import GB, drop_file_cache, fio_first_job, log, warm_file  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = REPO_ROOT / "examples" / "file_access"
GBPS = re.compile(r":\s*([0-9.]+) GB/sec")
TARGETS = {("store", "py"): 4.0, ("load-warm", "py"): 2.5, ("load-cold", "py"): 2.5}
FIO_TARGET = 0.9


def run_script(name: str, *args: str) -> float:
    """Runs one example script; returns the GB/s it printed."""
    argv = [sys.executable, str(EXAMPLES / name), *args]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=EXAMPLES, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed ({done.returncode}): {done.stderr.strip()[-800:]}")
    match = GBPS.search(done.stdout)
    if match is None:
        raise RuntimeError(f"{name} printed no GB/sec: {done.stdout!r}")
    return float(match.group(1))


def run_fio(path: Path, rw: str, size: int, direct: bool) -> float:
    """One fio job over `path`; returns GB/s (1e9 bytes per second)."""
    argv = ["fio", "--name=file_access", f"--filename={path}", f"--rw={rw}", "--bs=1M",
            f"--size={size}", "--output-format=json", "--end_fsync=0"]
    if direct:
        argv += ["--ioengine=io_uring", "--iodepth=32", "--direct=1"]
    else:
        argv += ["--ioengine=psync", "--direct=0"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"fio failed: {done.stderr.strip()[-800:]}")
    job = fio_first_job(done.stdout)
    side = job["read" if "read" in rw else "write"]
    return side["io_bytes"] / (side["runtime"] / 1000.0) / GB if side["runtime"] else 0.0


def make_input(path: Path, size: int) -> None:
    """A file of random bytes to load (written once, untimed)."""
    chunk = os.urandom(1 << 20)
    with open(path, "wb") as f:
        for _ in range(size >> 20):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dir", type=Path, default=REPO_ROOT / "tensortier-bench")
    p.add_argument("--mb-size", type=int, default=1024, help="tensor size in MiB (default 1024)")
    p.add_argument("--repeats", type=int, default=3, help="rounds, tools rotated (default 3)")
    p.add_argument("--loop", type=int, default=3,
                   help="the scripts' --loop: timed repetitions inside one run (default 3, as DeepNVMe)")
    p.add_argument("--json", type=Path, default=REPO_ROOT / "bench" / "results" / "file_access.json")
    args = p.parse_args(argv)
    if shutil.which("fio") is None:
        log("fio not found: install it (apt-get install fio)")
        return 1
    args.dir.mkdir(parents=True, exist_ok=True)
    size = args.mb_size << 20
    input_file = args.dir / "file_access_input.bin"
    fio_file = args.dir / "file_access_fio.bin"
    make_input(input_file, size)
    folder = str(args.dir)
    common = ["--loop", str(args.loop)]
    load = ["--input_file", str(input_file), *common]
    store = ["--nvme_folder", folder, "--mb_size", str(args.mb_size), *common]

    def cold(tool: str) -> float:
        drop_file_cache(input_file)  # fsync, then POSIX_FADV_DONTNEED
        return run_fio(input_file, "read", size, True) if tool == "fio" else run_script(
            f"{tool}_load_cpu_tensor.py", *load, "--cold")

    def warm(tool: str) -> float:
        warm_file(input_file)  # buffered reads of 64 MiB
        return run_fio(input_file, "read", size, False) if tool == "fio" else run_script(
            f"{tool}_load_cpu_tensor.py", *load)

    def write(tool: str) -> float:
        return run_fio(fio_file, "write", size, True) if tool == "fio" else run_script(
            f"{tool}_store_cpu_tensor.py", *store)

    scenarios = {"store": write, "load-warm": warm, "load-cold": cold}
    tools = ["tensortier", "py", "fio"]
    samples: dict[str, dict[str, list[float]]] = {s: {t: [] for t in tools} for s in scenarios}
    for r in range(args.repeats):
        order = tools[r % len(tools):] + tools[: r % len(tools)]
        for name, fn in scenarios.items():
            for tool in order:
                gbps = fn(tool)
                samples[name][tool].append(gbps)
                log(f"round {r + 1} {name:9s} {tool:10s} {gbps:6.2f} GB/s")
                time.sleep(1.0)  # let the disk settle between tools
    for path in (input_file, fio_file):
        path.unlink(missing_ok=True)

    rows: list[dict[str, Any]] = []
    print(f"\n{args.mb_size} MiB, {args.repeats} repeats, medians (GB/s)\n")
    print("| scenario | tensortier | baseline | baseline GB/s | ratio | target | result |")
    print("|---|---:|---|---:|---:|---:|---|")
    for name in scenarios:
        ours = statistics.median(samples[name]["tensortier"])
        for base in ("py", "fio"):
            theirs = statistics.median(samples[name][base])
            ratio = ours / theirs if theirs else float("nan")
            target = TARGETS[(name, base)] if base == "py" else FIO_TARGET
            verdict = "pass" if ratio >= target else "miss"
            label = {"py": "py_ script", "fio": "fio"}[base]
            print(f"| {name} | {ours:.3f} | {label} | {theirs:.3f} | **{ratio:.2f}×** | "
                  f"≥ {target}× | {verdict} |")
            rows.append({"scenario": name, "baseline": base, "tensortier_gbps": ours,
                         "baseline_gbps": theirs, "ratio": ratio, "target": target})
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"mb_size": args.mb_size, "repeats": args.repeats,
                                     "samples": samples, "comparisons": rows}, indent=2))
    print(f"\nsamples: {json.dumps(samples)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
