#!/usr/bin/env python3
"""The per-tensor cost of checkpoints: a state dict of many small tensors (optimizer states,
adapters, norms) saved and loaded in one process by tensortier and by the libraries it replaces.

    python bench/small_tensors_bench.py                       # 20,000 tensors of 1 KiB, 5 rounds
    python bench/small_tensors_bench.py --tensors 100000 --elements 1 --rounds 3

The state dict is ``{f"t{i}": torch.randn(ELEMENTS)}`` (float32). Each round runs every tool
once, in an order that rotates from round to round; a save is timed until it returns (fsyncs:
below), a load until the tensors are there (the file is in the page cache: this measures the work
per tensor, not the disk). Each figure is the median of the rounds; every sample is printed.

  tt-pt         tensortier.save(sd, "tt.pt") / tensortier.load("tt.pt")
  torch         torch.save(sd, "torch.pt") / torch.load("torch.pt", weights_only=True)
  tt-st         tensortier.save(sd, "tt.safetensors") / tensortier.load("tt.safetensors")
  safetensors   safetensors.torch.save_file / safetensors.torch.load_file

tensortier's saves include their fsync (temporary file, fdatasync, rename); torch's and
safetensors' do not, unless --fsync-baselines adds one inside their timing.

Targets: tt-pt >= 2x torch and tt-st >= 2x safetensors, for save and for load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchlib import loadavg, log  # noqa: E402


def fsynced(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


Tool = tuple[Callable[[Any], None], Callable[[], Any]]


def tools(d: Path, fsync_baselines: bool) -> dict[str, Tool]:
    import safetensors.torch as st
    import torch

    import tensortier

    def torch_save(sd: Any) -> None:
        torch.save(sd, d / "torch.pt")
        if fsync_baselines:
            fsynced(d / "torch.pt")

    def st_save(sd: Any) -> None:
        st.save_file(sd, str(d / "st.safetensors"))
        if fsync_baselines:
            fsynced(d / "st.safetensors")

    return {
        "tt-pt": (lambda sd: tensortier.save(sd, d / "tt.pt"),
                  lambda: tensortier.load(d / "tt.pt")),
        "torch": (torch_save, lambda: torch.load(d / "torch.pt", weights_only=True)),
        "tt-st": (lambda sd: tensortier.save(sd, d / "tt.safetensors"),
                  lambda: tensortier.load(d / "tt.safetensors")),
        "safetensors": (st_save, lambda: st.load_file(str(d / "st.safetensors"))),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, default=20_000)
    parser.add_argument("--elements", type=int, default=256, help="float32 elements per tensor")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--fsync-baselines", action="store_true",
                        help="time an fsync after torch.save and save_file too")
    parser.add_argument("--dir", default=None, help="directory on the disk under test "
                        "(default: a temporary one under ./tensortier-data)")
    parser.add_argument("--json-out", default="bench/results/small_tensors_bench.json")
    args = parser.parse_args()
    import torch

    sd = {f"t{i}": torch.randn(args.elements) for i in range(args.tensors)}
    root = Path(args.dir) if args.dir else Path("tensortier-data")
    root.mkdir(parents=True, exist_ok=True)
    samples: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="small-tensors-", dir=root) as tmp:
        named = tools(Path(tmp), args.fsync_baselines)
        names = list(named)
        for name in names:  # untimed: imports, engines, first allocations
            named[name][0](sd)
            named[name][1]()
        samples = {n: {"save": [], "load": []} for n in names}
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for op in ("save", "load"):
                for name in order:
                    fn = named[name][0 if op == "save" else 1]
                    start = time.perf_counter()
                    out = fn(sd) if op == "save" else fn()
                    elapsed = time.perf_counter() - start
                    del out
                    samples[name][op].append(elapsed)
                    log(f"round {r}: {name} {op} {elapsed:.3f} s")
    med = {n: {op: statistics.median(samples[n][op]) for op in ("save", "load")}
           for n in names}
    print(f"\n### {args.tensors} tensors of {args.elements * 4} bytes, same process, "
          f"median of {args.rounds} rounds (s)\n")
    print("| | " + " | ".join(names) + " | torch / tt-pt | safetensors / tt-st |")
    print("|---|" + "---:|" * (len(names) + 2))
    for op in ("save", "load"):
        cells = [f"{med[n][op]:.3f}" for n in names]
        print(f"| {op} | " + " | ".join(cells)
              + f" | {med['torch'][op] / med['tt-pt'][op]:.2f}x"
              + f" | {med['safetensors'][op] / med['tt-st'][op]:.2f}x |")
    report = {"command": " ".join([sys.executable, *sys.argv]),
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "loadavg": loadavg(),
              "samples": samples, "medians": med}
    Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_out).write_text(json.dumps(report, indent=1))
    log(f"wrote {args.json_out}")


if __name__ == "__main__":
    main()
