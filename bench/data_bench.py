"""The training-data reader (tensortier.data.FileReader) against the ways people read small
files today, in the same run, cold and warm.

A tree of FILES files (sizes log-uniform MIN..MAX KiB, CLASSES class folders, made once and kept
in --dir) is read in full epochs of shuffled batches by each tool:

  tensortier       FileReader, iterating (samples, labels) batches (views of the batch arena)
  tensortier_dali  the same reader feeding DALI: fn.external_source(source=reader.dali_source(),
                   no_copy=True)
  seed_dali        the seed's pipeline: a np.fromfile loop in an external_source iterator
  loop             the same np.fromfile loop alone
  dali_reader      DALI's fn.readers.file (random_shuffle, num_threads=2)
  pool16           a 16-thread Python pool, one open+read per file
  fio              fio random reads of 128 KiB at queue depth 64, O_DIRECT, over a scratch file
                   as large as the tree (the device's rate for this access pattern; cold only)

Each tool is built once per repeat, untimed, as a training job builds its pipeline once: the
reader or pipeline made and the tree listed (fn.readers.file lists it when its pipeline is
built; no tool reads a file before its first epoch). Then whole epochs are timed: warm, one
untimed epoch and then --epochs (3) epochs in a row on the same tool, the steady state of a
job's later epochs (DALI pipelines reset() between them); cold, the tool's first epoch.

The DALI pipelines return each sample's size and its label (--dali-output sizes), as a training
pipeline passes the samples on to an operator that reads them in place (a decoder); with
--dali-output bytes they return the samples, which DALI copies into its output buffers.

Cold: the page cache is dropped after the tool is built, before its timed epoch
(/proc/sys/vm/drop_caches 3 as root: file data, inodes and folders, as in a job's first epoch;
else posix_fadvise DONTNEED per file). Cold_data: drop_caches 1, file data only, the inodes and
folders stay cached (the later epochs of a data set larger than memory). One epoch per build:
fn.readers.file reads ahead across the end of an epoch, so a second cold epoch would start with
batches read before the drop. Warm: the tree is read once, untimed, before the first epoch.
Tools run in a rotated order (repeat r starts with tool r mod n); each figure is the median of
--repeats. Prints one Markdown table per mode and writes everything to --json-out.

    python bench/data_bench.py                          # 20,000 files, 3 repeats
    python bench/data_bench.py --files 2000 --repeats 3 # a quicker run
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import platform
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchlib import GB, fio_stats, log, median, ratio, settle, tool_version  # noqa: E402

ALL_TOOLS = ["tensortier", "tensortier_dali", "seed_dali", "loop", "dali_reader", "pool16", "fio"]


# --------------------------------------------------------------------------- the tree


def make_tree(root: Path, files: int, classes: int, min_kib: float, max_kib: float,
              seed: int) -> list[Path]:
    """The tree, made once: a manifest records what it holds, so a run with other settings
    makes it anew."""
    manifest = root / "manifest.json"
    want = {"files": files, "classes": classes, "min_kib": min_kib, "max_kib": max_kib,
            "seed": seed}
    if manifest.exists() and json.loads(manifest.read_text()) == want:
        return sorted((root / "train").rglob("*.jpg"))
    log(f"making {files} files in {classes} class folders under {root}")
    subprocess.run(["rm", "-rf", str(root / "train")], check=True)
    rng = np.random.default_rng(seed)
    sizes = np.exp(rng.uniform(math.log(min_kib * 1024), math.log(max_kib * 1024), files))
    block = rng.integers(0, 256, size=int(max_kib * 1024) + 4096, dtype=np.uint8).tobytes()
    paths = []
    for i, size in enumerate(sizes.astype(np.int64)):
        d = root / "train" / f"class_{i % classes:03d}"
        d.mkdir(parents=True, exist_ok=True)
        p = d / f"img_{i:06d}.jpg"
        start = int(rng.integers(0, 4096))
        p.write_bytes(i.to_bytes(8, "little") + block[start:start + int(size) - 8])
        paths.append(p)
    os.sync()
    manifest.write_text(json.dumps(want))
    return sorted(paths)


# /proc/sys/vm/drop_caches level per cold mode.
COLD_LEVELS = {"cold": 3, "cold_data": 1}


def drop_caches(paths: list[Path], level: int = 3) -> None:
    """Level 3 drops file data and cached inodes and folders; level 1 file data only."""
    try:
        Path("/proc/sys/vm/drop_caches").write_text(f"{level}\n")
        return
    except OSError:
        pass
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm(paths: list[Path]) -> None:
    for p in paths:
        with open(p, "rb") as f:
            while f.read(1 << 20):
                pass


# --------------------------------------------------------------------------- tools
# Each tool is built once (untimed: the reader or pipeline made, the tree listed), as a training
# job builds its pipeline once; what it returns reads one full epoch per call, returning
# (files, bytes). Every loop counts files and bytes the cheapest way its API offers and leaves
# the bytes untouched.
#
# The DALI pipelines return each sample's size (``data.shape()``) and the labels by default, as a
# training pipeline hands its samples to an operator (a decoder) that reads them in place. With
# --dali-output bytes they return the samples themselves: DALI then copies every byte into its
# output buffers (the executor's MakeContiguous step, even for a dense batch fed with
# ``no_copy=True``), a copy that no other tool here makes.

Epoch = Callable[[], tuple[int, int]]


def make_tensortier(root: Path, batch_size: int, seed: int, dali_output: str) -> Epoch:
    from tensortier.data import FileReader

    reader = FileReader(file_root=root, batch_size=batch_size, shuffle=True, seed=seed)

    def epoch() -> tuple[int, int]:
        files = nbytes = 0
        for samples, labels in reader:
            files += len(samples)
            nbytes += sum(s.numel() for s in samples)
        return files, nbytes

    return epoch


def _dali_outputs(data: Any, labels: Any, dali_output: str) -> tuple[Any, Any]:
    from nvidia.dali import types

    if dali_output == "bytes":
        return data, labels
    return data.shape(dtype=types.INT64), labels


def _dali_epoch(pipe: Any, dali_output: str) -> Epoch:
    """Runs ``pipe`` to the end of its source's epoch, then ``reset()``s it for the next."""
    pipe.build()

    def epoch() -> tuple[int, int]:
        files = nbytes = 0
        try:
            while True:
                data, labels = pipe.run()
                files += len(data)
                nbytes += _dali_bytes(data, dali_output)
        except StopIteration:
            pass
        pipe.reset()
        return files, nbytes

    return epoch


def _dali_bytes(data: Any, dali_output: str) -> int:
    if dali_output == "bytes":
        return sum(shape[0] for shape in data.shape())
    return int(np.asarray(data.as_tensor()).sum())


def make_tensortier_dali(root: Path, batch_size: int, seed: int, dali_output: str) -> Epoch:
    from nvidia.dali import fn, pipeline_def, types

    from tensortier.data import FileReader

    reader = FileReader(file_root=root, batch_size=batch_size, shuffle=True, seed=seed)

    # no_copy: DALI uses the batch arenas in place; dali_source keeps them alive for DALI's
    # prefetch queue (queue_depth = prefetch_queue_depth).
    @pipeline_def(batch_size=batch_size, num_threads=2, device_id=None, prefetch_queue_depth=2)
    def pipe():
        data, labels = fn.external_source(source=reader.dali_source(queue_depth=2),
                                          num_outputs=2, batch=True, no_copy=True,
                                          dtype=[types.UINT8, types.INT32])
        return _dali_outputs(data, labels, dali_output)

    return _dali_epoch(pipe(), dali_output)


class SeedIterator:
    """The seed notebook's external_source iterator: np.fromfile one file at a time, shuffled
    with random.shuffle (labels as numpy arrays: DALI refuses torch CPU tensors on CPU torch)."""

    def __init__(self, files: list[tuple[str, int]], batch_size: int) -> None:
        self.files = list(files)
        self.batch_size = batch_size

    def __iter__(self) -> "SeedIterator":
        self.i = 0
        random.shuffle(self.files)
        return self

    def __next__(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        if self.i >= len(self.files):
            raise StopIteration
        batch, labels = [], []
        for path, label in self.files[self.i:self.i + self.batch_size]:
            batch.append(np.fromfile(path, dtype=np.uint8))
            labels.append(np.array([label], dtype=np.int32))
        self.i += self.batch_size
        return batch, labels


def labelled(root: Path) -> list[tuple[str, int]]:
    classes = sorted(d.name for d in root.iterdir() if d.is_dir())
    return [(str(p), label) for label, c in enumerate(classes)
            for p in sorted((root / c).iterdir())]


def make_seed_dali(root: Path, batch_size: int, seed: int, dali_output: str) -> Epoch:
    from nvidia.dali import fn, pipeline_def, types

    source = SeedIterator(labelled(root), batch_size)

    # cycle="raise": DALI iterates the source anew after each reset() (the seed's pipeline read
    # one epoch; with DALI's default the second epoch would be empty).
    @pipeline_def(batch_size=batch_size, num_threads=2, device_id=None)
    def pipe():
        data, labels = fn.external_source(source=source, num_outputs=2, batch=True,
                                          cycle="raise", dtype=[types.UINT8, types.INT32])
        return _dali_outputs(data, labels, dali_output)

    return _dali_epoch(pipe(), dali_output)


def make_loop(root: Path, batch_size: int, seed: int, dali_output: str) -> Epoch:
    source = SeedIterator(labelled(root), batch_size)

    def epoch() -> tuple[int, int]:
        files = nbytes = 0
        for batch, labels in source:
            files += len(batch)
            nbytes += sum(a.size for a in batch)
        return files, nbytes

    return epoch


def make_dali_reader(root: Path, batch_size: int, seed: int, dali_output: str) -> Epoch:
    """fn.readers.file lists the tree when the pipeline is built (untimed, as for every tool)
    and streams across epochs: an epoch is its epoch_size rounded up to whole batches (the last
    one filled from the next epoch)."""
    from nvidia.dali import fn, pipeline_def

    @pipeline_def(batch_size=batch_size, num_threads=2, device_id=None, seed=seed + 1)
    def pipe():
        data, labels = fn.readers.file(file_root=str(root), random_shuffle=True, name="reader")
        return _dali_outputs(data, labels, dali_output)

    p = pipe()
    p.build()
    size = p.epoch_size("reader")

    def epoch() -> tuple[int, int]:
        files = nbytes = 0
        for _ in range(-(-size // batch_size)):
            data, labels = p.run()
            files += len(data)
            nbytes += _dali_bytes(data, dali_output)
        return min(files, size), nbytes

    return epoch


def make_pool16(root: Path, batch_size: int, seed: int, dali_output: str) -> Epoch:
    files = labelled(root)
    pool = concurrent.futures.ThreadPoolExecutor(16)

    def read(item: tuple[str, int]) -> bytes:
        with open(item[0], "rb", buffering=0) as f:
            return f.read()

    def epoch() -> tuple[int, int]:
        random.shuffle(files)
        count = nbytes = 0
        for i in range(0, len(files), batch_size):
            for data in pool.map(read, files[i:i + batch_size]):
                count += 1
                nbytes += len(data)
        return count, nbytes

    return epoch


FIO_READ_BLOCK = 128 << 10
FIO_FILL_BLOCK = 1 << 20


def fio_sizes(total: int) -> tuple[int, int]:
    """(scratch file size, bytes fio reads) for a tree of `total` bytes: the reads are as many
    bytes as the tree holds, rounded down to whole 128 KiB blocks, at least one block; the file
    is whole 1 MiB fill blocks holding them (fio refuses a file smaller than its block size,
    and O_DIRECT a size that is not a multiple of the disk's block)."""
    io_size = max(FIO_READ_BLOCK, total // FIO_READ_BLOCK * FIO_READ_BLOCK)
    size = max(total, io_size)
    return -(-size // FIO_FILL_BLOCK) * FIO_FILL_BLOCK, io_size


def run_fio(scratch: Path, total: int) -> tuple[dict[str, Any], str]:
    """Reads as many bytes as the tree holds (see fio_sizes) at random over the scratch file."""
    size, io_size = fio_sizes(total)
    argv = ["fio", "--name=randread", f"--filename={scratch}", "--rw=randread",
            f"--bs={FIO_READ_BLOCK >> 10}k", "--iodepth=64", "--direct=1", "--ioengine=io_uring",
            f"--size={size}", f"--io_size={io_size}", "--randrepeat=0", "--norandommap",
            "--output-format=json"]
    command = shlex.join(argv)
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    return fio_stats(proc, command, "read", io_size), command


# --------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="tensortier-data/data-bench")
    parser.add_argument("--files", type=int, default=20000)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--min-kib", type=float, default=20)
    parser.add_argument("--max-kib", type=float, default=400)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default="cold,cold_data,warm")
    parser.add_argument("--epochs", type=int, default=3,
                        help="warm epochs timed per repeat after one untimed epoch, on each tool "
                             "built once (cold: its first epoch only)")
    parser.add_argument("--dali-output", choices=["sizes", "bytes"], default="sizes",
                        help="what the DALI pipelines return: each sample's size, or the "
                             "samples (DALI copies them into its output buffers)")
    parser.add_argument("--tools", default=",".join(ALL_TOOLS))
    parser.add_argument("--json-out", default="bench/results/data_bench.json")
    args = parser.parse_args()
    tools = args.tools.split(",")
    unknown = set(tools) - set(ALL_TOOLS)
    if unknown:
        parser.error(f"unknown tools {sorted(unknown)}; use {ALL_TOOLS}")
    modes = args.modes.split(",")
    if set(modes) - {"warm", *COLD_LEVELS}:
        parser.error(f"unknown modes {sorted(set(modes) - {'warm', *COLD_LEVELS})}")
    # Imported before anything is timed: dropping the page cache would make a first import
    # read torch's and DALI's libraries from the disk inside a tool's time.
    import torch  # noqa: F401
    from nvidia.dali import fn, pipeline_def  # noqa: F401

    import tensortier.data  # noqa: F401

    base = Path(args.dir)
    base.mkdir(parents=True, exist_ok=True)
    paths = make_tree(base, args.files, args.classes, args.min_kib, args.max_kib, 0)
    root = base / "train"
    total = sum(p.stat().st_size for p in paths)
    scratch = base / "fio-scratch.dat"
    scratch_size = fio_sizes(total)[0]
    if "fio" in tools and (not scratch.exists() or scratch.stat().st_size != scratch_size):
        subprocess.run(["fio", "--name=fill", f"--filename={scratch}", "--rw=write",
                        f"--bs={FIO_FILL_BLOCK >> 20}M", f"--size={scratch_size}", "--direct=1",
                        "--output-format=json"],
                       capture_output=True, check=True)
    log(f"{len(paths)} files, {total / GB:.2f} GB; tools {tools}; modes {modes}")

    makers: dict[str, Callable[[Path, int, int, str], Epoch]] = {
        "tensortier": make_tensortier, "tensortier_dali": make_tensortier_dali,
        "seed_dali": make_seed_dali, "loop": make_loop, "dali_reader": make_dali_reader,
        "pool16": make_pool16,
    }
    samples: dict[str, dict[str, list[dict[str, float]]]] = {m: {t: [] for t in tools}
                                                             for m in modes}
    commands: dict[str, str] = {}
    for mode in modes:
        mode_tools = [t for t in tools if not (t == "fio" and mode == "warm")]
        epochs = args.epochs if mode == "warm" else 1
        for repeat in range(args.repeats):
            order = mode_tools[repeat % len(mode_tools):] + mode_tools[:repeat % len(mode_tools)]
            for tool in order:
                settle()
                if tool == "fio":
                    drop_caches(paths + [scratch], COLD_LEVELS[mode])
                    stats, commands["fio"] = run_fio(scratch, total)
                    nbytes = stats["io_bytes"]
                    seconds = stats["runtime"] / 1000
                    files = round(len(paths) * nbytes / total)
                else:
                    # Built once, untimed (no tool reads a file while it is built), then
                    # timed over whole epochs.
                    epoch = makers[tool](root, args.batch_size, repeat, args.dali_output)
                    files = nbytes = 0
                    seconds = 0.0
                    if mode not in COLD_LEVELS:
                        warm(paths)
                        epoch()  # untimed: a job's first epoch (allocations, threads started)
                    for _ in range(epochs):
                        if mode in COLD_LEVELS:
                            drop_caches(paths + [scratch], COLD_LEVELS[mode])
                        start = time.perf_counter()
                        epoch_files, epoch_bytes = epoch()
                        seconds += time.perf_counter() - start
                        if epoch_files != len(paths):
                            raise RuntimeError(f"{tool} read {epoch_files} files, not {len(paths)}")
                        # fn.readers.file fills an epoch's last batch from the next epoch.
                        if tool != "dali_reader" and epoch_bytes != total:
                            raise RuntimeError(f"{tool} read {epoch_bytes} bytes, not {total}")
                        files += epoch_files
                        nbytes += epoch_bytes
                    del epoch
                samples[mode][tool].append({"seconds": seconds, "files_per_s": files / seconds,
                                            "gbps": nbytes / seconds / GB})
                log(f"{mode} r{repeat} {tool:16s} {files / seconds:9.0f} files/s "
                    f"{nbytes / seconds / GB:6.2f} GB/s")

    report: dict[str, Any] = {"command": shlex.join([sys.executable] + sys.argv),
                              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                              "kernel": platform.release(), "files": len(paths),
                              "bytes": total, "fio": tool_version(["fio", "--version"]),
                              "fio_command": commands.get("fio"), "epochs": args.epochs,
                              "dali_output": args.dali_output, "samples": samples,
                              "medians": {}}
    for mode in modes:
        print(f"\n### {mode}: {len(paths)} files, {total / GB:.2f} GB, batch {args.batch_size}, "
              f"median of {args.repeats} ({args.epochs if mode == 'warm' else 1} epoch(s) each, "
              f"DALI pipelines returning {args.dali_output})\n")
        print("| tool | files/s | GB/s | tensortier / tool |")
        print("|---|---:|---:|---:|")
        ours = median([s["gbps"] for s in samples[mode].get("tensortier", [])])
        report["medians"][mode] = {}
        for tool in tools:
            runs = samples[mode][tool]
            if not runs:
                continue
            fps = median([s["files_per_s"] for s in runs])
            gbps = median([s["gbps"] for s in runs])
            r = ratio(ours, gbps)
            report["medians"][mode][tool] = {"files_per_s": fps, "gbps": gbps, "ratio": r}
            print(f"| {tool} | {fps:.0f} | {gbps:.2f} | {'' if r is None else f'{r:.2f}x'} |")
    Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
