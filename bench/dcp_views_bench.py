"""A plain ``dcp.save`` of a state dict that is mostly views that are not contiguous (48
transposed float32 matrices of 8 MiB, and 16 contiguous ones: 512 MiB), one process without a
process group, each sample in a new process: seconds and peak RSS growth of the save, for two
installed tensortier packages alternated (their install folders, as ``pip install --target``
makes them).

    python bench/dcp_views_bench.py --new /tmp/tt-new --old /tmp/tt-old --dir /scratch --rounds 6
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings


def rss(key: str) -> int:
    """A /proc/self/status memory figure (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def child(package: str, directory: str) -> dict[str, float]:
    import torch
    import torch.distributed.checkpoint as dcp

    import tensortier.dcp as tdcp

    warnings.filterwarnings("ignore")  # DCP's "no process group" warning
    if not tdcp.__file__.startswith(package):
        raise RuntimeError(f"imported {tdcp.__file__}, not the package under {package}")
    g = torch.Generator().manual_seed(0)
    sd = {f"v{i}": torch.randn(1024, 2048, generator=g).t() for i in range(48)}
    sd.update({f"c{i}": torch.randn(1024, 2048, generator=g) for i in range(16)})
    before = rss("VmRSS")
    start = time.perf_counter()
    dcp.save(sd, storage_writer=tdcp.Writer(os.path.join(directory, "ckpt")), no_dist=True)
    return {"seconds": time.perf_counter() - start, "peak_growth": rss("VmHWM") - before}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--new", required=True, help="install folder of the package to measure")
    p.add_argument("--old", required=True, help="install folder of its baseline")
    p.add_argument("--dir", required=True, help="where the checkpoint goes")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.dir)))
        return 0
    samples: dict[str, list[dict[str, float]]] = {"new": [], "old": []}
    for r in range(args.rounds):
        for tag in ("new", "old") if r % 2 == 0 else ("old", "new"):
            package = getattr(args, tag)
            run = subprocess.run(
                [sys.executable, __file__, "--child", package, "--new", args.new, "--old",
                 args.old, "--dir", args.dir], env={**os.environ, "PYTHONPATH": package},
                capture_output=True, text=True, timeout=600, check=False)
            if run.returncode != 0:
                raise RuntimeError(f"{tag}: exit {run.returncode}: {run.stderr[-2000:]}")
            samples[tag].append(json.loads(run.stdout.splitlines()[-1]))
    for tag, ss in samples.items():
        secs = [s["seconds"] for s in ss]
        peak = statistics.median(s["peak_growth"] for s in ss) / 2**20
        print(f"{tag}: median {statistics.median(secs):.3f} s "
              f"({', '.join(f'{s:.3f}' for s in secs)}), peak RSS growth {peak:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
