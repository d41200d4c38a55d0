#!/usr/bin/env python3
"""torch.distributed.checkpoint saves and loads: tensortier.dcp against torch's file backend.

Every sample is a new job: a new Python process that spawns ``--ranks`` Gloo ranks on the CPU
(torch.multiprocessing), each holding its ``Shard(0)`` part of DTensors on a one-dimensional CPU
mesh, ``--size`` bytes per rank in total (float32 matrices of 64 MiB or less, as a model's
layers). The ranks build their tensors untimed, meet at a barrier, then rank 0 times the
``dcp.save`` (or ``dcp.load``) between two barriers: the time the job waits for its checkpoint.

Saves (``--saves``), each over the previous round's checkpoint of the same tool, as a job
saving ``latest`` does; each is durable when timed (ours fsyncs; torch's FileSystemWriter is
timed with its default ``sync_files=True``):
  tt            tensortier.dcp.Writer
  stock         FileSystemWriter (thread_count=1, its default)
  stock4        FileSystemWriter(thread_count=4)
  fio           fio: io_uring, direct=1, bs=1M, iodepth=32 sequential write of the same bytes,
                plus an fsync (the disk's rate, for scale)
Loads (``--loads``), cold: the checkpoint's files are dropped from the page cache first
(POSIX_FADV_DONTNEED on those files only):
  tt            tensortier.dcp.Reader (verify=True, its default) of tt's checkpoint
  tt-noverify   tensortier.dcp.Reader(verify=False)
  stock         FileSystemReader of stock's checkpoint
  fio           fio sequential read with O_DIRECT of the same bytes

Each round runs every tool once in an order rotated from round to round; the figures are
medians over ``--rounds``. Prints one JSON object per sample and a table of GB/s (1e9 bytes per
second over the job's bytes) with each tool's ratio to stock's and fio's.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchlib import GB, drop_file_cache, fio_stats, format_size, log, median, parse_size  # noqa: E402

SAVES = ("tt", "stock", "stock4", "fio")
LOADS = ("tt", "tt-noverify", "stock", "fio")
MATRIX_BYTES = 64 << 20
COLUMNS = 4096


def shapes(size: int, ranks: int) -> list[tuple[int, int]]:
    """Global (rows, COLUMNS) float32 shapes: each rank holds size bytes in rows // ranks."""
    rows_per_rank = MATRIX_BYTES // (COLUMNS * 4)
    out, left = [], size
    while left > 0:
        rows = min(rows_per_rank, max(1, left // (COLUMNS * 4)))
        out.append((rows * ranks, COLUMNS))
        left -= rows * COLUMNS * 4
    return out


def rank_main(rank: int, ranks: int, op: str, tool: str, directory: str, size: int,
              rendezvous: str, result: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=ranks)
    try:
        mesh = init_device_mesh("cpu", (ranks,))
        sd: dict[str, Any] = {}
        gen = torch.Generator().manual_seed(rank)
        for i, (rows, cols) in enumerate(shapes(size, ranks)):
            local = (torch.randn(rows // ranks, cols, generator=gen) if op == "save" else
                     torch.empty(rows // ranks, cols))
            sd[f"layer{i}.weight"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
        if tool.startswith("tt"):
            from tensortier.dcp import Reader, Writer
            storage = (Writer(directory) if op == "save" else
                       Reader(directory, verify=(tool != "tt-noverify")))
        else:
            fs = dcp.FileSystemWriter if op == "save" else dcp.FileSystemReader
            storage = (fs(directory, thread_count=4) if tool == "stock4" else fs(directory))
        dist.barrier()
        start = time.perf_counter()
        if op == "save":
            dcp.save(sd, storage_writer=storage)
        else:
            dcp.load(sd, storage_reader=storage)
        dist.barrier()
        seconds = time.perf_counter() - start
        if rank == 0:
            Path(result).write_text(json.dumps({"seconds": seconds}))
    finally:
        dist.destroy_process_group()


def child(args: argparse.Namespace) -> int:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        rendezvous, result = os.path.join(tmp, "rendezvous"), os.path.join(tmp, "result")
        mp.spawn(rank_main, args=(args.ranks, args.op, args.tool, str(args.checkpoint),
                                  args.size, rendezvous, result), nprocs=args.ranks)
        print(Path(result).read_text())
    return 0


def fio_sample(fio_file: Path, rw: str, nbytes: int) -> float:
    size = -(-nbytes // (1 << 20)) * (1 << 20)
    argv = ["fio", f"--name=dcp-bench-{rw}", f"--filename={fio_file}", f"--rw={rw}",
            f"--size={size}", "--bs=1M", "--numjobs=1", "--output-format=json",
            "--ioengine=io_uring", "--direct=1", "--iodepth=32"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
    seconds = fio_stats(proc, shlex.join(argv), rw, size)["runtime"] / 1000.0
    if rw == "write":
        start = time.perf_counter()
        fd = os.open(fio_file, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        seconds += time.perf_counter() - start
    return seconds * nbytes / size


def sample(args: argparse.Namespace, op: str, tool: str, nbytes: int) -> float:
    fio_file = args.dir / "fio.dat"
    if tool == "fio":
        if op == "load":
            drop_file_cache(fio_file)
        return fio_sample(fio_file, "write" if op == "save" else "read", nbytes)
    checkpoint = args.dir / ("tt" if tool.startswith("tt") else "stock")
    if op == "load":
        for f in checkpoint.iterdir():
            drop_file_cache(f)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", op, tool,
           "--checkpoint", str(checkpoint), "--ranks", str(args.ranks), "--size", str(args.size)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{op} {tool} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return float(json.loads(out.stdout.strip().splitlines()[-1])["seconds"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", type=Path, default=Path("./tensortier-data/dcp-bench"))
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--size", type=parse_size, default=parse_size("1G"),
                   help="bytes per rank (default 1G)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--saves", default=",".join(SAVES))
    p.add_argument("--loads", default=",".join(LOADS))
    p.add_argument("--child", nargs=2, metavar=("OP", "TOOL"))
    p.add_argument("--checkpoint", type=Path)
    args = p.parse_args()
    if args.child:
        args.op, args.tool = args.child
        return child(args)
    args.dir.mkdir(parents=True, exist_ok=True)
    nbytes = sum(r * c * 4 for r, c in shapes(args.size, args.ranks))
    saves = [t for t in args.saves.split(",") if t]
    loads = [t for t in args.loads.split(",") if t]
    log(f"{args.ranks} ranks x {format_size(args.size)}, {nbytes / GB:.2f} GB per job, "
        f"{args.rounds} rounds")
    times: dict[tuple[str, str], list[float]] = {}
    # Each load reads the checkpoint its tool saved: saves come first in every round.
    for r in range(args.rounds):
        for op, tools in (("save", saves), ("load", loads)):
            if op == "load":
                missing = {"tt" if t.startswith("tt") else "stock" for t in tools if t != "fio"}
                for m in missing:
                    if not (args.dir / m / ".metadata").exists():
                        sample(args, "save", m, nbytes)
            order = tools[r % len(tools):] + tools[:r % len(tools)]
            for tool in order:
                s = sample(args, op, tool, nbytes)
                times.setdefault((op, tool), []).append(s)
                print(json.dumps({"round": r, "op": op, "tool": tool, "seconds": s,
                                  "gb_s": nbytes / s / GB}), flush=True)
    print(f"\n{args.ranks} ranks x {format_size(args.size)} ({nbytes / GB:.2f} GB), "
          f"medians of {args.rounds}")
    for op, tools in (("save", saves), ("load", loads)):
        base = median(times.get((op, "stock"), [])) if "stock" in tools else None
        fio = median(times.get((op, "fio"), [])) if "fio" in tools else None
        print(f"{op:5} {'tool':12} {'GB/s':>6} {'x stock':>8} {'x fio':>6}")
        for tool in tools:
            m = median(times[(op, tool)])
            assert m is not None
            vs_stock = f"{base / m:8.2f}" if base else f"{'':8}"
            vs_fio = f"{fio / m:6.2f}" if fio else f"{'':6}"
            print(f"{op:5} {tool:12} {nbytes / m / GB:6.2f} {vs_stock} {vs_fio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
