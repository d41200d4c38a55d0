"""Raw extent-map reads against file reads of the same files, on a loop-mounted ext4 image.

Makes an ext4 image (as root), attaches it to a loop device (with direct I/O to its backing file
where the kernel allows, so that "cold" means the disk), writes many small files in class
folders (sizes log-uniform between --min-size and --max-size), maps them
(``tensortier.data.build_extent_map``) and reads every file once per run, in a shuffled order
and in batches, by each method:

  raw          ExtentReader.read: O_DIRECT reads of the loop device by the map, a batch in flight,
               each file's bytes checked against its XXH64 in the map (the default)
  raw-unchecked the same without the checksum check (verify_checksums=False): its cost
  engine-files the same engine reading the files through the filesystem (File.open + one submit
               of the batch): what the map saves is the filesystem's open, lookup and mapping
  python-loop  open + readinto one file at a time (the seed's np.fromfile loop)

cold (the filesystem unmounted and mounted again, and the image's and the device's page cache
dropped, before each run: no cached inodes, directories or data, as after a reboot) and warm
(the files read once before: raw reads do not use the page cache, so they stay cold). Methods
alternate in rotated order over --repeats runs; the table shows medians, and the ratios of raw
to the others from the same run. Only ratios mean anything on a shared disk.

    sudo .venv/bin/python bench/extents_bench.py --files 4000 --repeats 5 --json extents.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchlib import GB, log, median, parse_size, ratio, settle  # noqa: E402

import tensortier  # noqa: E402
from tensortier import _core  # noqa: E402
from tensortier.data import ExtentReader, build_extent_map  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
METHODS = ("raw", "raw-unchecked", "engine-files", "python-loop")


def run(*args: str) -> str:
    r = subprocess.run(list(args), capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed: {r.stderr.strip()}")
    return r.stdout.strip()


def drop(paths: list[str]) -> None:
    """Drops the pages of `paths` (the image, the loop device) from the page cache."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def remount(device: str, mnt: Path, image: Path) -> None:
    """Cold: unmounting drops the filesystem's inodes, directories and data from memory; the
    image and the device are dropped too (only this filesystem's memory, not the machine's)."""
    run("umount", str(mnt))
    drop([str(image), device])
    run("mount", "-t", "ext4", device, str(mnt))


def read_raw(reader: ExtentReader, batches: list[list[str]]) -> int:
    total = 0
    for batch in batches:
        total += sum(a.nbytes for a in reader.read(batch))
    return total


def read_engine_files(engine: Any, root: Path, batches: list[list[str]],
                      sizes: dict[str, int]) -> int:
    total = 0
    for batch in batches:
        files = [_core.File.open(str(root / name), "r", True) for name in batch]
        arrays = [np.empty(sizes[name], dtype=np.uint8) for name in batch]
        pieces = [(f, a.ctypes.data, a.nbytes, 0) for f, a in zip(files, arrays)]
        result = engine.submit("read", pieces).wait()
        total += result["bytes"]
        for f in files:
            f.close()
    return total


def read_python_loop(root: Path, batches: list[list[str]], sizes: dict[str, int]) -> int:
    total = 0
    for batch in batches:
        for name in batch:
            a = np.empty(sizes[name], dtype=np.uint8)
            with open(root / name, "rb", buffering=0) as f:
                total += f.readinto(memoryview(a))
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--files", type=int, default=3000)
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--min-size", type=parse_size, default=parse_size("20K"))
    p.add_argument("--max-size", type=parse_size, default=parse_size("400K"))
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=str(REPO / "build"), help="where the image goes")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma-separated, of {', '.join(METHODS)} (raw always runs)")
    args = p.parse_args()
    chosen = [m for m in args.methods.split(",") if m]
    unknown = set(chosen) - set(METHODS)
    if unknown:
        raise SystemExit(f"unknown methods: {', '.join(sorted(unknown))}")
    methods_run = tuple(m for m in METHODS if m == "raw" or m in chosen)
    if os.geteuid() != 0:
        raise SystemExit("needs root: loop devices and raw device reads")

    rng = random.Random(0)
    sizes_list = [int(np.exp(rng.uniform(np.log(args.min_size), np.log(args.max_size))))
                  for _ in range(args.files)]
    total_bytes = sum(sizes_list)
    image_mib = int(total_bytes * 1.3 / 2**20) + 128
    base = Path(tempfile.mkdtemp(dir=args.dir, prefix="extents-bench-"))
    image, mnt = base / "fs.img", base / "mnt"
    device = ""
    mounted = False
    results: dict[str, Any] = {}
    try:
        with open(image, "wb") as f:
            f.truncate(image_mib << 20)
        run("mkfs.ext4", "-F", "-q", "-b", "4096", str(image))
        direct_io = True
        try:
            device = run("losetup", "--find", "--show", "--direct-io=on", str(image))
        except SystemExit:
            direct_io = False
            device = run("losetup", "--find", "--show", str(image))
        mnt.mkdir()
        run("mount", "-t", "ext4", device, str(mnt))
        mounted = True
        names = []
        order = list(range(args.files))
        rng.shuffle(order)  # files of a class are not written one after the other
        for i in order:
            name = f"c{i % args.classes:03d}/f{i:06d}.bin"
            (mnt / name).parent.mkdir(exist_ok=True)
            (mnt / name).write_bytes(rng.randbytes(sizes_list[i]))
            names.append(name)
        os.sync()
        t = time.perf_counter()
        extent_map = build_extent_map(mnt)
        build_s = time.perf_counter() - t
        sizes = {n: extent_map.file(i)["size"] for i, n in enumerate(extent_map.paths)}
        extents = sum(len(extent_map.file(i)["extents"]) for i in range(len(extent_map)))
        log(f"{len(sizes)} files, {total_bytes / GB:.2f} GB, {extents} extents, map built in "
            f"{build_s:.2f} s; {device} (loop direct I/O {'on' if direct_io else 'off'})")
        reader = ExtentReader(extent_map)
        unchecked = ExtentReader(extent_map, verify_checksums=False)
        engine = _core.Engine(page_cache_check=True)
        shuffled = sorted(sizes)
        rng.shuffle(shuffled)
        batches = [shuffled[i:i + args.batch] for i in range(0, len(shuffled), args.batch)]
        methods: dict[str, Callable[[], int]] = {
            "raw": lambda: read_raw(reader, batches),
            "raw-unchecked": lambda: read_raw(unchecked, batches),
            "engine-files": lambda: read_engine_files(engine, mnt, batches, sizes),
            "python-loop": lambda: read_python_loop(mnt, batches, sizes),
        }
        times: dict[str, dict[str, list[float]]] = {s: {m: [] for m in methods_run}
                                                     for s in ("cold", "warm")}
        for rep in range(args.repeats):
            k = rep % len(methods_run)
            rotated = methods_run[k:] + methods_run[:k]
            for state in ("cold", "warm"):
                for m in rotated:
                    if state == "cold":
                        remount(device, mnt, image)
                        settle(5)
                    else:
                        read_python_loop(mnt, batches, sizes)  # untimed warm-up
                    t = time.perf_counter()
                    got = methods[m]()
                    dt = time.perf_counter() - t
                    if got != total_bytes:
                        raise SystemExit(f"{m} read {got} bytes, not {total_bytes}")
                    times[state][m].append(dt)
                    log(f"repeat {rep + 1} {state:4s} {m:14s} {len(sizes) / dt:9.0f} files/s "
                        f"{total_bytes / dt / GB:6.2f} GB/s")
        print(f"\n{len(sizes)} files, {total_bytes / GB:.2f} GB, batch {args.batch}, "
              f"median of {args.repeats} (loop direct I/O {'on' if direct_io else 'off'})")
        print(f"{'state':5s} {'method':14s} {'files/s':>9s} {'GB/s':>6s} {'raw/this':>9s}")
        for state in ("cold", "warm"):
            med = {m: median(times[state][m]) for m in methods_run}
            for m in methods_run:
                r = ratio(med[m], med["raw"])
                print(f"{state:5s} {m:14s} {len(sizes) / med[m]:9.0f} "
                      f"{total_bytes / med[m] / GB:6.2f} {r:9.2f}")
                results.setdefault(state, {})[m] = {
                    "seconds": times[state][m], "median_s": med[m],
                    "files_per_s": len(sizes) / med[m], "gb_per_s": total_bytes / med[m] / GB,
                    "raw_speedup": r,
                }
        results.update(files=len(sizes), bytes=total_bytes, extents=extents, batch=args.batch,
                       repeats=args.repeats, map_build_s=build_s, loop_direct_io=direct_io,
                       backend=reader.backend, version=tensortier.__version__)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
    finally:
        if mounted:
            subprocess.run(["umount", str(mnt)], timeout=120)
        if device:
            subprocess.run(["losetup", "-d", device], timeout=120)
        image.unlink(missing_ok=True)
        if mnt.exists():
            mnt.rmdir()
        base.rmdir()


if __name__ == "__main__":
    main()
