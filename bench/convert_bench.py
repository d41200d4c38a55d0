"""`tensortier convert` of one build against another (a baseline binary, e.g. the previous
release), in the same run: rotated order, median seconds per conversion.

Scenarios:
  many   safetensors files of N tiny tensors (--tiny-bytes each: 4, or 1) -> .pt, for each N in
         --counts
         (the .pt writer's cost per tensor; each storage is 4 KiB aligned, so the output is
         ~N * 4 KiB).
  large  one safetensors file of --size bytes (--large-tensors fp32 tensors, saved with
         checksum=True) -> .pt, and the .pt torch.save writes of the same tensors -> safetensors;
         the file is in the page cache (read once untimed first), the output written and
         fsynced. This is what checking the input's checksums while copying costs.

    python bench/convert_bench.py --cli .venv/bin/tensortier --baseline-cli OLD/tensortier

Prints one Markdown table per scenario; writes every sample to --json-out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchlib import format_size, loadavg, log, parse_size, tool_version  # noqa: E402


def many_tensors_file(path: Path, n: int, width: int = 4) -> None:
    dtype, fmt = {1: ("U8", "<B"), 4: ("I32", "<i")}[width]
    header = {f"layer.{i}.w": {"dtype": dtype, "shape": [1],
                               "data_offsets": [width * i, width * i + width]}
              for i in range(n)}
    text = json.dumps(header).encode()
    data = b"".join(struct.pack(fmt, i % (1 << (8 * width - 1))) for i in range(n))
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def large_files(d: Path, size: int, count: int) -> tuple[Path, Path]:
    import torch  # noqa: PLC0415 - only this scenario needs torch

    import tensortier  # noqa: PLC0415

    g = torch.Generator().manual_seed(0)
    sd = {f"t{i}": torch.randn(size // count // 4, generator=g) for i in range(count)}
    st_path, pt_path = d / "large.safetensors", d / "large.pt"
    tensortier.save(sd, st_path, checksum=True)
    torch.save(sd, pt_path)
    return st_path, pt_path


def warm(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(16 << 20):
            pass


def time_convert(cli: str, src: Path, dst: Path) -> tuple[float, float]:
    """Wall seconds and the child's CPU seconds (user + system): on a loaded shared machine the
    CPU time says more about the work done than the wall time."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    r = subprocess.run([cli, "convert", str(src), str(dst)], capture_output=True, text=True,
                       timeout=3600, check=False)
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        raise RuntimeError(f"{cli} convert {src} failed: {r.stderr.strip()}")
    dst.unlink()
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return elapsed, cpu


Samples = dict[str, dict[str, list[float]]]  # tool -> {"wall": [...], "cpu": [...]}


def measure(tools: dict[str, str], src: Path, dst: Path, repeats: int) -> Samples:
    samples: Samples = {name: {"wall": [], "cpu": []} for name in tools}
    names = list(tools)
    for r in range(repeats):
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            warm(src)
            wall, cpu = time_convert(tools[name], src, dst)
            samples[name]["wall"].append(wall)
            samples[name]["cpu"].append(cpu)
            log(f"  {src.name} {name}: {wall:.3f} s wall, {cpu:.3f} s CPU")
    return samples


def table(title: str, rows: list[tuple[str, Samples]], names: list[str]) -> None:
    print(f"\n### {title}\n")
    print("| case | " + " | ".join(f"{n} median s (wall / CPU)" for n in names)
          + " | baseline / cli (wall / CPU) |")
    print("|---|" + "---|" * (len(names) + 1))
    for case, samples in rows:
        med = {n: {m: statistics.median(samples[n][m]) for m in ("wall", "cpu")} for n in names}
        ratio = {m: med["baseline"][m] / med["cli"][m] for m in ("wall", "cpu")}
        print(f"| {case} | "
              + " | ".join(f"{med[n]['wall']:.3f} / {med[n]['cpu']:.3f}" for n in names)
              + f" | {ratio['wall']:.2f}x / {ratio['cpu']:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cli", default=".venv/bin/tensortier", help="the build under test")
    parser.add_argument("--baseline-cli", required=True, help="the build to compare with")
    parser.add_argument("--dir", default="tensortier-data/convert-bench",
                        help="directory on the disk under test")
    parser.add_argument("--scenarios", default="many,large")
    parser.add_argument("--counts", default="10000,30000,100000")
    parser.add_argument("--tiny-bytes", type=int, choices=(1, 4), default=4,
                        help="bytes per tensor in the many scenario")
    parser.add_argument("--size", type=parse_size, default=parse_size("1G"))
    parser.add_argument("--large-tensors", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json-out", default="bench/results/convert_bench.json")
    args = parser.parse_args()
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    tools = {"cli": args.cli, "baseline": args.baseline_cli}
    names = list(tools)
    report: dict = {"command": " ".join([sys.executable, *sys.argv]), "date": time.strftime(
        "%Y-%m-%d %H:%M:%S %Z"), "kernel": platform.release(), "loadavg_start": loadavg(),
        "tools": {n: {"path": p, "version": tool_version([p, "--version"])}
                  for n, p in tools.items()}, "scenarios": {}}
    scenarios = args.scenarios.split(",")
    try:
        if "many" in scenarios:
            rows = []
            for n in (int(x) for x in args.counts.split(",")):
                src = d / f"many-{n}.safetensors"
                many_tensors_file(src, n, args.tiny_bytes)
                rows.append((f"{n} tensors -> .pt", measure(tools, src, d / "out.pt",
                                                            args.repeats)))
                src.unlink()
            table("many tiny tensors, safetensors -> .pt", rows, names)
            report["scenarios"]["many"] = dict(rows)
        if "large" in scenarios:
            st_path, pt_path = large_files(d, args.size, args.large_tensors)
            rows = [
                (f"{format_size(args.size)} safetensors (xxh64) -> .pt",
                 measure(tools, st_path, d / "out.pt", args.repeats)),
                (f"{format_size(args.size)} .pt (CRC-32) -> safetensors",
                 measure(tools, pt_path, d / "out.safetensors", args.repeats)),
            ]
            st_path.unlink()
            pt_path.unlink()
            table(f"{args.large_tensors} fp32 tensors, warm input, output fsynced", rows, names)
            report["scenarios"]["large"] = dict(rows)
    finally:
        report["loadavg_end"] = loadavg()
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(report, indent=1))
        log(f"wrote {args.json_out}")
    os.sync()


if __name__ == "__main__":
    main()
