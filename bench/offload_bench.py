#!/usr/bin/env python3
"""DiskOffloader benchmark: bulk offload speed, memory given back, and compute/I-O overlap.

Everything runs in one process and one run, so that every figure has its baseline measured next
to it (BENCHMARKS.md: on our shared, noisy disk only such ratios mean something). Each figure is
the median of ``--repeats`` samples, and all samples are printed.

Scenarios (``--scenarios``, default all):

  copy     COUNT tensors of TENSOR_SIZE bytes (float32, random): ``sync_writev`` then
           ``sync_readv`` (cold), in GB/s, against
             - fio, one job: io_uring, direct=1, bs=BS, iodepth=QD, sequential write of one file
               of the same total size, then a sequential read of it (O_DIRECT, so cold);
             - ``torch.save`` of each tensor to its own file, ``fsync`` of the files, then
               ``torch.load`` of each after dropping its pages (``POSIX_FADV_DONTNEED``).
           Nobody fsyncs in the timed DiskOffloader or fio write (TensorNVMe does not either):
           the fair baseline for its O_DIRECT writes is fio with direct=1 and no fsync. torch.save
           is reported both without (data only reached the page cache) and with the fsync.
           The offloader's backing files are dropped from the page cache before ``sync_readv``
           too, although its O_DIRECT writes leave nothing there to drop.
           A second, diagnostic tensortier pass in the same slot repeats the write with one
           4 KiB tensor written after the batch, so that it holds the tail of the backing file:
           its ``sync_readv`` frees no tail, so the offloader does not shrink (ftruncate) the
           file inside the timed read; the ``sync_read`` of the 4 KiB tensor then times the
           shrink of the whole file on its own.
           The repeats alternate tensortier and fio: tensortier before fio on odd repeats, fio
           first on even ones; torch moves through the positions (slot ``repeat mod 3``).
           The data read back is compared with a copy (``torch.equal``) on the repeats chosen by
           ``--verify``. After each tool, untimed, ``settle()`` syncs and waits for the disk to
           go idle, so that deferred work (writeback, the discards of unlinked or truncated
           files, the offloader's background shrink) is not charged to the next tool.
  rss      Measured during the copy scenario's tensortier runs (it needs no extra I/O): VmRSS
           (/proc/self/status) before ``sync_writev``, after it, after ``sync_readv`` and after
           ``close()``; the drop after the write and the return after the read as a percentage
           of the tensor bytes (target: drop >= 95%).
  overlap  TensorNVMe's README loop over LOOP_COUNT tensors of LOOP_TENSOR_SIZE, all offloaded
           beforehand::

               for i, x in enumerate(tensors):
                   if i == 0: off.sync_read(x)
                   if i + 1 < len(tensors): off.async_read(tensors[i + 1])
                   compute(x)
                   off.async_write(x)
                   off.sync_read_events()
               off.sync_write_events()

           ``compute`` is K products of a fixed MATMUL x MATMUL float32 matrix (``torch.mm``,
           which releases the GIL), with ``torch.set_num_threads(1)`` so one of the machine's two
           cores stays free for the I/O workers. K is calibrated so that the compute-only loop
           lasts about as long as the I/O-only loop (``--compute-iters`` overrides). Timed: the
           full loop (wall), the same loop without I/O (compute), the same loop without compute
           (io), in rotated order. Reported: wall / (compute + io) (1.0 = no overlap) and
           wall / max(compute, io) (1.0 = perfect overlap).

Examples:
  .venv/bin/python bench/offload_bench.py                       # defaults, ~4-6 min here
  .venv/bin/python bench/offload_bench.py --count 8 --repeats 2 --loop-count 4   # smoke test
  .venv/bin/python bench/offload_bench.py --scenarios overlap --compute-iters 50

Progress goes to stderr, the Markdown report to stdout, everything (all samples, commands,
versions, load averages) to ``--json``. Test files are removed at the end. The exit status is 1
if the offloader raised or returned wrong data.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/_benchlib.py, from any directory
from _benchlib import GB, drop_file_cache, fio_stats, format_size, loadavg, log  # noqa: E402
from _benchlib import median, name_list, ratio, settle, tool_version  # noqa: E402
from _benchlib import parse_size as _parse_size  # noqa: E402

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
MIB = 1024**2
SCENARIOS = ("copy", "rss", "overlap")


# --------------------------------------------------------------------------- helpers


def parse_size(text: str) -> int:
    """Parse a byte count with an optional K/M/G suffix (powers of 1024): '32M' -> 33554432.
    Sizes must be positive multiples of 4 (float32 tensors)."""
    return _parse_size(text, "4M, 32M", _multiple_of_4)


def _multiple_of_4(value: int) -> str | None:
    """``parse_size``'s check."""
    if value <= 0 or value % 4 != 0:
        return "size must be a positive multiple of 4"
    return None


def proc_status() -> dict[str, int]:
    """VmRSS, RssAnon, RssFile of this process in bytes (from /proc/self/status)."""
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def rss() -> int:
    """Resident set size of this process in bytes."""
    return proc_status()["VmRSS"]


def fmt(value: float | None, digits: int = 3) -> str:
    """A number for the table, '-' when missing."""
    return "-" if value is None else f"{value:.{digits}f}"


def fmt_samples(values: Sequence[float], digits: int = 3) -> str:
    """'1.234, 2.345, ...' for the samples column."""
    return ", ".join(f"{v:.{digits}f}" for v in values)


class BenchError(Exception):
    """The offloader misbehaved (raised, or returned wrong data): reported, exit status 1."""


@dataclass
class Samples:
    """Named lists of samples plus free-form details of each run."""

    values: dict[str, list[float]] = field(default_factory=dict)
    details: list[dict[str, Any]] = field(default_factory=list)

    def add(self, key: str, value: float) -> None:
        """Record one sample of ``key``."""
        self.values.setdefault(key, []).append(value)

    def get(self, key: str) -> list[float]:
        """The samples of ``key`` (empty if none)."""
        return self.values.get(key, [])

    def median(self, key: str) -> float | None:
        """Median of the samples of ``key``."""
        return median(self.get(key))


# --------------------------------------------------------------------------- settings


@dataclass
class Settings:
    """Resolved command-line settings."""

    directory: Path
    repeats: int
    json_path: Path
    scenarios: list[str]
    count: int
    tensor_size: int
    loop_count: int
    loop_tensor_size: int
    n_entries: int
    backend: str
    fio: str
    fio_bs: int
    fio_iodepth: int
    matmul: int
    compute_iters: int | None
    verify: str
    skip_torch_save: bool
    seed: int
    aligned_alloc: bool
    command: str

    def verify_repeat(self, repeat: int) -> bool:
        """Whether data is compared with the reference copy on 0-based ``repeat``."""
        return self.verify == "all" or (self.verify == "first" and repeat == 0)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="See the module docstring (head of this file) for what each scenario times.",
    )
    p.add_argument(
        "--dir",
        type=Path,
        default=Path("./tensortier-data/offload-bench"),
        help="directory for the test files, on the disk under test (default: %(default)s)",
    )
    p.add_argument("--repeats", type=int, default=5, help="samples per figure (default: 5)")
    p.add_argument(
        "--json",
        type=Path,
        default=BENCH_DIR / "results" / "offload_bench.json",
        help="where to write all results (default: bench/results/offload_bench.json)",
    )
    p.add_argument(
        "--scenarios",
        type=name_list(SCENARIOS),
        default=list(SCENARIOS),
        help="comma-separated subset of copy,rss,overlap (default: all)",
    )
    p.add_argument("--count", type=int, default=64, help="tensors in copy/rss (default: 64)")
    p.add_argument(
        "--tensor-size",
        type=parse_size,
        default=parse_size("32M"),
        help="bytes per tensor in copy/rss (default: 32M)",
    )
    p.add_argument("--loop-count", type=int, default=16, help="tensors in overlap (default: 16)")
    p.add_argument(
        "--loop-tensor-size",
        type=parse_size,
        default=parse_size("64M"),
        help="bytes per tensor in overlap (default: 64M)",
    )
    p.add_argument(
        "--n-entries",
        type=int,
        default=16,
        help="DiskOffloader n_entries (default: 16, TensorNVMe's default)",
    )
    p.add_argument("--backend", default="auto", help="DiskOffloader backend (default: auto)")
    p.add_argument("--fio", default="fio", help="fio binary (default: fio)")
    p.add_argument(
        "--fio-bs",
        type=parse_size,
        default=parse_size("4M"),
        help="fio block size (default: 4M, the engine's chunk size)",
    )
    p.add_argument("--fio-iodepth", type=int, default=32, help="fio iodepth (default: 32)")
    p.add_argument(
        "--matmul",
        type=int,
        default=256,
        help="side of the square matrix of the compute step (default: 256)",
    )
    p.add_argument(
        "--compute-iters",
        type=int,
        default=None,
        help="matrix products per compute step (default: calibrated to match I/O)",
    )
    p.add_argument(
        "--verify",
        choices=("all", "first", "none"),
        default="all",
        help="repeats whose data is checked with torch.equal (default: all)",
    )
    p.add_argument(
        "--skip-torch-save",
        action="store_true",
        help="leave out the torch.save/torch.load baseline",
    )
    p.add_argument("--seed", type=int, default=0, help="torch random seed (default: 0)")
    p.add_argument(
        "--aligned-alloc",
        action="store_true",
        help="diagnostic: set THP_MEM_ALLOC_ENABLE=1 before importing torch, so large "
        "tensors get page-aligned memory (default torch memory is only 64-byte "
        "aligned, below the 512-byte O_DIRECT memory alignment of ext4 here)",
    )
    return p.parse_args(argv)


def resolve_settings(args: argparse.Namespace, argv: Sequence[str]) -> Settings:
    """Check the arguments and build Settings."""
    for name in ("repeats", "count", "loop_count", "n_entries", "fio_iodepth", "matmul"):
        if getattr(args, name) <= 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be positive")
    if args.compute_iters is not None and args.compute_iters < 0:
        raise SystemExit("--compute-iters must be >= 0")
    return Settings(
        directory=args.dir.resolve(),
        repeats=args.repeats,
        json_path=args.json,
        scenarios=args.scenarios,
        count=args.count,
        tensor_size=args.tensor_size,
        loop_count=args.loop_count,
        loop_tensor_size=args.loop_tensor_size,
        n_entries=args.n_entries,
        backend=args.backend,
        fio=args.fio,
        fio_bs=args.fio_bs,
        fio_iodepth=args.fio_iodepth,
        matmul=args.matmul,
        compute_iters=args.compute_iters,
        verify=args.verify,
        skip_torch_save=args.skip_torch_save,
        seed=args.seed,
        aligned_alloc=args.aligned_alloc,
        command=shlex.join([sys.executable, *sys.argv[:1], *argv]),
    )


# --------------------------------------------------------------------------- tensors


def make_tensors(count: int, nbytes: int) -> list[torch.Tensor]:
    """``count`` float32 tensors of ``nbytes`` each, filled with uniform random numbers."""
    import torch

    return [torch.rand(nbytes // 4, dtype=torch.float32) for _ in range(count)]


def check_equal(tensors: Sequence[torch.Tensor], refs: Sequence[torch.Tensor], what: str) -> None:
    """Raise BenchError naming the first tensor whose data differs from its reference."""
    import torch

    for i, (t, r) in enumerate(zip(tensors, refs, strict=True)):
        if t.untyped_storage().nbytes() != r.untyped_storage().nbytes():
            raise BenchError(
                f"{what}: tensor {i} has {t.untyped_storage().nbytes()} bytes of storage, "
                f"expected {r.untyped_storage().nbytes()}"
            )
        if not torch.equal(t, r):
            bad = int((t != r).sum())
            raise BenchError(f"{what}: tensor {i} differs from its copy in {bad} elements")


def alignment_info(tensors: Sequence[torch.Tensor]) -> dict[str, Any]:
    """Where the tensors' data sits relative to 512-byte and page boundaries."""
    offsets = sorted({t.data_ptr() % 4096 for t in tensors})
    return {
        "data_ptr_mod_4096": offsets[:8],
        "all_512_aligned": all(t.data_ptr() % 512 == 0 for t in tensors),
    }


def direct_io_alignment(directory: Path) -> dict[str, Any]:
    """The O_DIRECT memory and offset alignment of a file in ``directory`` (tensortier's File)."""
    from tensortier import _core

    probe = directory / "alignment-probe.bin"
    try:
        f = _core.File.open(str(probe), "w")
        info = {
            "direct": bool(f.direct),
            "memory_alignment": int(f.memory_alignment),
            "offset_alignment": int(f.offset_alignment),
        }
        f.close()
        return info
    except Exception as e:  # noqa: BLE001 - informational only
        return {"error": repr(e)}
    finally:
        probe.unlink(missing_ok=True)


# --------------------------------------------------------------------------- copy scenario


def run_fio(s: Settings, path: Path, rw: str, size: int) -> tuple[float, dict[str, Any]]:
    """One fio job (sequential ``rw`` of ``size`` bytes); returns GB/s and a summary."""
    # fmt: off
    argv = [
        s.fio, f"--name=offload-bench-{rw}", f"--filename={path}", f"--rw={rw}",
        f"--size={size}", f"--bs={s.fio_bs}", f"--iodepth={s.fio_iodepth}", "--numjobs=1",
        "--ioengine=io_uring", "--direct=1", "--output-format=json",
    ]
    # fmt: on
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    command = shlex.join(argv)
    stats = fio_stats(proc, command, rw, size)
    summary = {k: stats.get(k) for k in ("io_bytes", "bw_bytes", "iops", "runtime")}
    summary["command"] = command
    return stats["bw_bytes"] / GB, summary


def tensortier_copy(
    s: Settings,
    tensors: list[torch.Tensor],
    refs: list[torch.Tensor] | None,
    out: Samples,
    rss_out: Samples,
) -> None:
    """One timed sync_writev + cold sync_readv of ``tensors``, with VmRSS around each step."""
    from tensortier import DiskOffloader

    total = sum(t.numel() * t.element_size() for t in tensors)
    gc.collect()
    r_before = rss()
    off = DiskOffloader(s.directory / "tensortier", n_entries=s.n_entries, backend=s.backend)
    try:
        r_open = rss()
        t0 = time.perf_counter()
        off.sync_writev(tensors)
        t1 = time.perf_counter()
        r_written = rss()
        status_written = proc_status()
        stored, file_bytes, backend = off.stored_bytes, off.file_bytes, off.backend
        freed = sum(1 for t in tensors if t.untyped_storage().nbytes() == 0)
        if stored != total:
            raise BenchError(f"stored_bytes is {stored} after sync_writev, expected {total}")
        if freed != len(tensors):
            raise BenchError(f"sync_writev freed {freed} of {len(tensors)} tensors' memory")
        for path in off.paths:  # O_DIRECT writes leave nothing cached; make sure anyway
            drop_file_cache(path, sync=None)
        t2 = time.perf_counter()
        off.sync_readv(tensors)
        t3 = time.perf_counter()
        r_read = rss()
        stored_after, file_after = off.stored_bytes, off.file_bytes
    finally:
        off.close()
    del off
    gc.collect()
    r_closed = rss()
    if stored_after != 0:
        raise BenchError(f"stored_bytes is {stored_after} after sync_readv of everything, not 0")
    verified = refs is not None
    if refs is not None:
        check_equal(tensors, refs, "sync_readv")
    out.add("write_gbps", total / (t1 - t0) / GB)
    out.add("read_gbps", total / (t3 - t2) / GB)
    for key, value in (
        ("before", r_before),
        ("open", r_open),
        ("written", r_written),
        ("read", r_read),
        ("closed", r_closed),
    ):
        rss_out.add(f"rss_{key}_mib", value / MIB)
    rss_out.add("drop_pct", 100 * (r_before - r_written) / total)
    rss_out.add("drop_from_open_pct", 100 * (r_open - r_written) / total)
    rss_out.add("return_pct", 100 * (r_read - r_written) / total)
    rss_out.add("retained_after_close_mib", (r_closed - r_before) / MIB)
    rss_out.details.append({"status_after_write": status_written})
    keep = tensortier_read_keeping_tail(s, tensors)
    out.add("read_keep_tail_gbps", total / keep["read_s"] / GB)
    out.add("shrink_s", keep["shrink_s"])
    out.details.append(
        {
            "tool": "tensortier",
            "write_s": t1 - t0,
            "read_s": t3 - t2,
            "stored_bytes_after_write": stored,
            "file_bytes_after_write": file_bytes,
            "file_bytes_after_read": file_after,
            "backend": backend,
            "verified": verified,
            "keep_tail_pass": keep,
        }
    )


def tensortier_read_keeping_tail(s: Settings, tensors: list[torch.Tensor]) -> dict[str, Any]:
    """Second, diagnostic pass: the same sync_writev, then one 4 KiB tensor written after it so
    that it holds the tail of the backing file; the timed sync_readv of ``tensors`` then frees no
    tail and the file is not shrunk (no ftruncate). Reading the 4 KiB tensor afterwards frees the
    whole file: that ``sync_read`` times the shrink (ftruncate of the file to 0)."""
    import torch
    from tensortier import DiskOffloader

    sentinel = torch.ones(1024, dtype=torch.float32)
    off = DiskOffloader(s.directory / "tensortier", n_entries=s.n_entries, backend=s.backend)
    try:
        off.sync_writev(tensors)
        off.sync_write(sentinel)
        file_written = off.file_bytes
        for path in off.paths:
            drop_file_cache(path, sync=None)
        t0 = time.perf_counter()
        off.sync_readv(tensors)
        t1 = time.perf_counter()
        file_between = off.file_bytes
        off.sync_read(sentinel)
        t2 = time.perf_counter()
        file_after = off.file_bytes
    finally:
        off.close()
    if file_between != file_written:
        raise BenchError(
            f"keep-tail pass: the file went from {file_written} to {file_between} bytes during "
            "sync_readv although the 4 KiB tensor holds its tail"
        )
    if not torch.equal(sentinel, torch.ones(1024, dtype=torch.float32)):
        raise BenchError("keep-tail pass: the 4 KiB tensor came back with different data")
    return {
        "read_s": t1 - t0,
        "shrink_s": t2 - t1,
        "file_bytes_written": file_written,
        "file_bytes_between": file_between,
        "file_bytes_after": file_after,
    }


def fio_copy(s: Settings, total: int, out: Samples) -> None:
    """fio sequential write then O_DIRECT read of one ``total``-byte file."""
    path = s.directory / "fio.dat"
    path.unlink(missing_ok=True)
    try:
        write_gbps, write_summary = run_fio(s, path, "write", total)
        read_gbps, read_summary = run_fio(s, path, "read", total)
    finally:
        path.unlink(missing_ok=True)
    out.add("write_gbps", write_gbps)
    out.add("read_gbps", read_gbps)
    out.details.append({"tool": "fio", "write": write_summary, "read": read_summary})


def torch_copy(s: Settings, tensors: list[torch.Tensor], verify: bool, out: Samples) -> None:
    """torch.save of each tensor to its own file, fsync, drop pages, torch.load of each."""
    import torch

    total = sum(t.numel() * t.element_size() for t in tensors)
    directory = s.directory / "torch"
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / f"t{i:04d}.pt" for i in range(len(tensors))]
    try:
        t0 = time.perf_counter()
        for t, path in zip(tensors, paths):
            torch.save(t, path)
        t1 = time.perf_counter()
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        t2 = time.perf_counter()
        for path in paths:  # untimed: make the loads cold
            drop_file_cache(path, sync=None)
        t3 = time.perf_counter()
        loaded = [torch.load(path) for path in paths]
        t4 = time.perf_counter()
        file_bytes = sum(p.stat().st_size for p in paths)
        if verify:
            for i, (a, b) in enumerate(zip(loaded, tensors)):
                if not torch.equal(a, b):
                    raise RuntimeError(f"torch.load returned different data for tensor {i}")
        del loaded
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    out.add("save_gbps", total / (t1 - t0) / GB)
    out.add("save_fsync_gbps", total / (t2 - t0) / GB)
    out.add("load_gbps", total / (t4 - t3) / GB)
    out.details.append(
        {
            "tool": "torch",
            "save_s": t1 - t0,
            "fsync_s": t2 - t1,
            "load_s": t4 - t3,
            "file_bytes": file_bytes,
            "verified": verify,
        }
    )


def copy_order(repeat: int, with_torch: bool) -> list[str]:
    """Run order of 0-based ``repeat``: tensortier before fio on odd (1-based) repeats, fio first
    on even ones; torch takes slot ``repeat mod 3``."""
    pair = ["tensortier", "fio"] if repeat % 2 == 0 else ["fio", "tensortier"]
    if with_torch:
        pair.insert(repeat % 3, "torch")
    return pair


def copy_scenario(s: Settings) -> dict[str, Any]:
    """The copy (and rss) scenario: every repeat runs each tool once, in copy_order."""
    total = s.count * s.tensor_size
    log(f"[copy] generating {s.count} x {format_size(s.tensor_size)} random float32 tensors")
    tensors = make_tensors(s.count, s.tensor_size)
    refs = [t.clone() for t in tensors] if s.verify != "none" else None
    align = alignment_info(tensors)
    results = {name: Samples() for name in ("tensortier", "fio", "torch")}
    rss_samples = Samples()
    orders: list[list[str]] = []
    loads: list[list[float]] = []
    for repeat in range(s.repeats):
        order = copy_order(repeat, not s.skip_torch_save)
        orders.append(order)
        loads.append(loadavg())
        for tool in order:
            start = time.monotonic()
            keys: tuple[str, ...]
            if tool == "tensortier":
                tensortier_copy(
                    s,
                    tensors,
                    refs if s.verify_repeat(repeat) else None,
                    results["tensortier"],
                    rss_samples,
                )
                keys = ("write_gbps", "read_gbps", "read_keep_tail_gbps", "shrink_s")
            elif tool == "fio":
                fio_copy(s, total, results["fio"])
                keys = ("write_gbps", "read_gbps")
            else:
                torch_copy(s, tensors, s.verify_repeat(repeat), results["torch"])
                keys = ("save_gbps", "save_fsync_gbps", "load_gbps")
            values = " ".join(f"{k}={results[tool].get(k)[-1]:.3f}" for k in keys)
            waited = settle()
            log(
                f"[copy] repeat {repeat + 1}/{s.repeats} {tool:<11} {values} "
                f"({time.monotonic() - start:.1f} s, then {waited:.1f} s settling)"
            )
        log(
            f"[rss] repeat {repeat + 1}: drop {rss_samples.get('drop_pct')[-1]:.1f}% "
            f"return {rss_samples.get('return_pct')[-1]:.1f}% "
            f"(VmRSS MiB before {rss_samples.get('rss_before_mib')[-1]:.0f}, after write "
            f"{rss_samples.get('rss_written_mib')[-1]:.0f}, after read "
            f"{rss_samples.get('rss_read_mib')[-1]:.0f}, after close "
            f"{rss_samples.get('rss_closed_mib')[-1]:.0f})"
        )
    del tensors, refs
    gc.collect()
    return {
        "params": {
            "count": s.count,
            "tensor_size": s.tensor_size,
            "total_bytes": total,
            "fio_bs": s.fio_bs,
            "fio_iodepth": s.fio_iodepth,
            "n_entries": s.n_entries,
        },
        "alignment": align,
        "orders": orders,
        "loadavg_per_repeat": loads,
        "samples": {name: r.values for name, r in results.items()},
        "details": {name: r.details for name, r in results.items()},
        "rss": {"samples": rss_samples.values, "details": rss_samples.details},
    }


# --------------------------------------------------------------------------- overlap scenario


def make_compute(s: Settings) -> Callable[[int], None]:
    """compute(k): k products of a fixed matrix (torch.mm, GIL released inside)."""
    import torch

    gen = torch.Generator().manual_seed(s.seed + 1)
    a = torch.rand(s.matmul, s.matmul, generator=gen) / s.matmul
    out = torch.empty_like(a)

    def compute(k: int) -> None:
        for _ in range(k):
            torch.mm(a, a, out=out)

    return compute


@dataclass
class LoopTiming:
    """One run of the overlap loop: total seconds, seconds blocked in waits (``sync_read``,
    ``sync_read_events``, ``sync_write_events``) and seconds inside ``async_read``/``async_write``
    (allocation and submission)."""

    elapsed: float
    wait: float = 0.0
    submit: float = 0.0
    waits: list[float] = field(default_factory=list)  # per iteration, then the final wait


def overlap_loop(
    off: Any, tensors: Sequence[torch.Tensor], compute: Callable[[int], None], k: int, io: bool
) -> LoopTiming:
    """TensorNVMe's README loop; ``io=False`` drops the offloader calls, ``k=0`` the compute."""
    n = len(tensors)
    clock = time.perf_counter
    submit = 0.0
    waits: list[float] = []
    t0 = clock()
    if io:
        for i, x in enumerate(tensors):
            first = 0.0
            if i == 0:
                a = clock()
                off.sync_read(x)
                first = clock() - a
            a = clock()
            if i + 1 < n:
                off.async_read(tensors[i + 1])
            submit += clock() - a
            compute(k)
            a = clock()
            off.async_write(x)
            b = clock()
            off.sync_read_events()
            c = clock()
            submit += b - a
            waits.append(first + c - b)
        a = clock()
        off.sync_write_events()
        waits.append(clock() - a)
    else:
        for _x in tensors:
            compute(k)
    elapsed = clock() - t0
    return LoopTiming(elapsed, sum(waits), submit, waits)


def cpu_busy_seconds() -> float:
    """CPU seconds spent busy by the whole machine since boot (all cores; /proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    busy = sum(fields[:8]) - idle  # user nice system idle iowait irq softirq steal
    return busy / os.sysconf("SC_CLK_TCK")


class OverlapState:
    """Keeps the loop's tensors offloaded or resident as each variant needs (untimed)."""

    def __init__(self, off: Any, tensors: list[torch.Tensor]) -> None:
        self.off = off
        self.tensors = tensors

    def resident(self) -> bool:
        """Whether every tensor has its memory."""
        return all(t.untyped_storage().nbytes() > 0 for t in self.tensors)

    def make_offloaded(self) -> None:
        """Offload every tensor (if resident), drop the backing files' pages."""
        if self.resident():
            self.off.sync_writev(self.tensors)
        if self.resident() or self.off.stored_bytes != sum(
            t.numel() * t.element_size() for t in self.tensors
        ):
            raise BenchError("tensors are not all offloaded after sync_writev")
        for path in self.off.paths:
            drop_file_cache(path, sync=None)

    def make_resident(self) -> None:
        """Bring every tensor back (if offloaded)."""
        if not self.resident():
            self.off.sync_readv(self.tensors)
        if not self.resident():
            raise BenchError("tensors are not all resident after sync_readv")


def overlap_scenario(s: Settings) -> dict[str, Any]:
    """Time the README loop with I/O and compute, with compute only, with I/O only."""
    import torch
    from tensortier import DiskOffloader

    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    log(
        f"[overlap] {s.loop_count} x {format_size(s.loop_tensor_size)} tensors, "
        f"torch.set_num_threads(1) (was {threads_before})"
    )
    tensors = make_tensors(s.loop_count, s.loop_tensor_size)
    refs = [t.clone() for t in tensors] if s.verify != "none" else None
    compute = make_compute(s)
    off = DiskOffloader(s.directory / "overlap", n_entries=s.n_entries, backend=s.backend)
    state = OverlapState(off, tensors)
    try:
        # Calibration: one warm-up I/O-only loop, then one timed; compute per matrix product.
        state.make_offloaded()
        overlap_loop(off, tensors, compute, 0, io=True)
        state.make_offloaded()
        io_time = overlap_loop(off, tensors, compute, 0, io=True).elapsed
        if refs is not None:
            state.make_resident()
            check_equal(tensors, refs, "overlap calibration (I/O-only loop, then sync_readv)")
        probe = 20
        compute(probe)
        per_mm = min(_timed(lambda: compute(probe)) for _ in range(5)) / probe
        if s.compute_iters is not None:
            k = s.compute_iters
        else:
            k = max(1, round(io_time / s.loop_count / per_mm))
        log(
            f"[overlap] calibration: I/O-only loop {io_time:.3f} s, one {s.matmul}^2 matmul "
            f"{per_mm * 1e3:.3f} ms -> {k} matmuls per tensor "
            f"(~{k * per_mm * s.loop_count:.3f} s of compute per loop)"
        )

        samples = Samples()
        variants = ["wall", "compute", "io"]
        orders: list[list[str]] = []
        loads: list[list[float]] = []
        iteration_waits: dict[str, list[list[float]]] = {}
        for repeat in range(s.repeats):
            r = repeat % len(variants)
            order = [*variants[r:], *variants[:r]]
            orders.append(order)
            loads.append(loadavg())
            for variant in order:
                if variant == "compute":
                    state.make_resident()
                else:
                    state.make_offloaded()
                gc.collect()
                cpu0, busy0 = time.process_time(), cpu_busy_seconds()
                timing = overlap_loop(
                    off, tensors, compute, 0 if variant == "io" else k, io=variant != "compute"
                )
                cpu = time.process_time() - cpu0
                others = cpu_busy_seconds() - busy0 - cpu
                elapsed = timing.elapsed
                samples.add(f"{variant}_s", elapsed)
                samples.add(f"{variant}_cpu_s", cpu)
                samples.add(f"{variant}_others_cpu_s", max(0.0, others))
                if variant != "compute":
                    samples.add(f"{variant}_wait_s", timing.wait)
                    samples.add(f"{variant}_max_wait_s", max(timing.waits))
                    samples.add(f"{variant}_submit_s", timing.submit)
                    samples.add(f"{variant}_other_s", elapsed - timing.wait - timing.submit)
                    iteration_waits.setdefault(variant, []).append(timing.waits)
                if variant != "compute" and s.verify_repeat(repeat) and refs is not None:
                    state.make_resident()
                    check_equal(tensors, refs, f"overlap loop ({variant}), then sync_readv")
                log(
                    f"[overlap] repeat {repeat + 1}/{s.repeats} {variant:<8} {elapsed:.3f} s "
                    f"(waits {timing.wait:.3f} s, async calls {timing.submit:.3f} s, process "
                    f"CPU {cpu:.3f} s, other processes' CPU {max(0.0, others):.3f} s)"
                )
        for repeat in range(s.repeats):
            w, c, i = (samples.get(f"{v}_s")[repeat] for v in ("wall", "compute", "io"))
            samples.add("wall_over_sum", w / (c + i))
            samples.add("wall_over_max", w / max(c, i))
    finally:
        off.close()
        torch.set_num_threads(threads_before)
    total = s.loop_count * s.loop_tensor_size
    return {
        "params": {
            "count": s.loop_count,
            "tensor_size": s.loop_tensor_size,
            "total_bytes": total,
            "matmul": s.matmul,
            "matmuls_per_tensor": k,
            "n_entries": s.n_entries,
            "torch_threads": 1,
            "calibration_io_s": io_time,
            "calibration_matmul_s": per_mm,
        },
        "orders": orders,
        "loadavg_per_repeat": loads,
        "samples": samples.values,
        "iteration_waits_s": iteration_waits,
    }


def _timed(fn: Callable[[], None]) -> float:
    """Seconds ``fn()`` takes."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# --------------------------------------------------------------------------- report


def copy_report(c: dict[str, Any], repeats: int) -> list[str]:
    """Markdown for the copy scenario."""
    tt, fio, tor = (Samples(c["samples"][n]) for n in ("tensortier", "fio", "torch"))
    p = c["params"]
    lines = [
        (
            f"### Bulk offload: {p['count']} tensors x {format_size(p['tensor_size'])} "
            f"({format_size(p['total_bytes'])}), median of {repeats}"
        ),
        "",
        (
            "| operation | tensortier (GB/s) | baseline | baseline (GB/s) | ratio of medians "
            "| per-repeat ratios (median) | tensortier samples | baseline samples |"
        ),
        "|---|---:|---|---:|---:|---|---|---|",
    ]
    rows = [
        (
            "sync_writev",
            "write_gbps",
            (
                f"fio write, io_uring direct=1 bs={format_size(p['fio_bs'])} "
                f"qd={p['fio_iodepth']}, no fsync"
            ),
            fio,
            "write_gbps",
        ),
        ("sync_readv (cold)", "read_gbps", "fio read, same job shape (O_DIRECT)", fio, "read_gbps"),
        (
            "sync_readv (cold), file tail kept: no ftruncate",
            "read_keep_tail_gbps",
            "fio read, same job shape (O_DIRECT)",
            fio,
            "read_gbps",
        ),
        ("sync_writev", "write_gbps", "torch.save per tensor + fsync", tor, "save_fsync_gbps"),
        (
            "sync_writev",
            "write_gbps",
            "torch.save per tensor, no fsync (page cache only)",
            tor,
            "save_gbps",
        ),
        (
            "sync_readv (cold)",
            "read_gbps",
            "torch.load per tensor, pages dropped first",
            tor,
            "load_gbps",
        ),
        (
            "sync_readv (cold), file tail kept: no ftruncate",
            "read_keep_tail_gbps",
            "torch.load per tensor, pages dropped first",
            tor,
            "load_gbps",
        ),
    ]
    for op, key, label, base, base_key in rows:
        if not base.get(base_key):
            continue
        a, b = tt.median(key), base.median(base_key)
        paired = [x / y for x, y in zip(tt.get(key), base.get(base_key)) if y]
        lines.append(
            f"| {op} | {fmt(a)} | {label} | {fmt(b)} | **{fmt(ratio(a, b), 2)}x** "
            f"| {fmt_samples(paired, 2)} ({fmt(median(paired), 2)}x) "
            f"| {fmt_samples(tt.get(key))} | {fmt_samples(base.get(base_key))} |"
        )
    lines += [
        "",
        (
            f"Shrinking the backing file from {format_size(p['total_bytes'])} to 0 (the "
            f"`sync_read` of the 4 KiB tensor holding its tail, in the keep-tail pass): median "
            f"{fmt(tt.median('shrink_s'))} s, samples {fmt_samples(tt.get('shrink_s'))} s."
        ),
        f"Run orders: {'; '.join(', '.join(o) for o in c['orders'])}.",
        (
            f"Tensor data pointers mod 4096: {c['alignment']['data_ptr_mod_4096']} "
            f"(all 512-byte aligned: {c['alignment']['all_512_aligned']})."
        ),
    ]
    return lines


def rss_report(c: dict[str, Any], repeats: int) -> list[str]:
    """Markdown for the rss figures (from the copy scenario's tensortier runs)."""
    r = Samples(c["rss"]["samples"])
    total = c["params"]["total_bytes"]
    lines = [
        (
            f"### Memory: VmRSS around sync_writev / sync_readv of {format_size(total)}, "
            f"median of {repeats}"
        ),
        "",
        "| figure | median | samples |",
        "|---|---:|---|",
    ]
    for key, label, digits in (
        ("rss_before_mib", "VmRSS before (MiB; tensors + reference copies resident)", 0),
        ("rss_open_mib", "VmRSS after DiskOffloader() (MiB)", 0),
        ("rss_written_mib", "VmRSS after sync_writev (MiB)", 0),
        ("rss_read_mib", "VmRSS after sync_readv (MiB)", 0),
        ("rss_closed_mib", "VmRSS after close() (MiB)", 0),
        ("drop_pct", "**drop after sync_writev, % of tensor bytes** (target >= 95)", 1),
        ("drop_from_open_pct", "drop measured from after DiskOffloader(), %", 1),
        ("return_pct", "return after sync_readv, % of tensor bytes", 1),
        ("retained_after_close_mib", "VmRSS after close() minus before (MiB)", 1),
    ):
        lines.append(
            f"| {label} | {fmt(r.median(key), digits)} | {fmt_samples(r.get(key), digits)} |"
        )
    return lines


def overlap_report(o: dict[str, Any], repeats: int) -> list[str]:
    """Markdown for the overlap scenario."""
    sm = Samples(o["samples"])
    p = o["params"]
    w, c, i = (sm.median(f"{v}_s") for v in ("wall", "compute", "io"))
    lines = [
        (
            f"### Overlap: TensorNVMe README loop, {p['count']} tensors x "
            f"{format_size(p['tensor_size'])}, {p['matmuls_per_tensor']} x {p['matmul']}^2 matmul "
            f"per tensor, torch.set_num_threads(1), median of {repeats}"
        ),
        "",
        "| figure | median | samples |",
        "|---|---:|---|",
        f"| wall: loop with I/O and compute (s) | {fmt(w)} | {fmt_samples(sm.get('wall_s'))} |",
        f"| compute only (s) | {fmt(c)} | {fmt_samples(sm.get('compute_s'))} |",
        f"| I/O only (s) | {fmt(i)} | {fmt_samples(sm.get('io_s'))} |",
        f"| compute + I/O (s) | {fmt(c + i if c is not None and i is not None else None)} | |",
        (
            f"| max(compute, I/O) (s) | {fmt(max(c, i) if c is not None and i is not None else None)} "
            f"| |"
        ),
        (
            f"| **wall / (compute + I/O)** (1.0 = no overlap, 0.5 = best possible here) | "
            f"**{fmt(ratio(w, c + i) if c is not None and i is not None else None)}** | "
            f"per repeat: {fmt_samples(sm.get('wall_over_sum'))} |"
        ),
        (
            f"| **wall / max(compute, I/O)** (1.0 = perfect overlap) | "
            f"**{fmt(ratio(w, max(c, i)) if c is not None and i is not None else None)}** | "
            f"per repeat: {fmt_samples(sm.get('wall_over_max'))} |"
        ),
    ]
    for key, label in (
        ("wall_wait_s", "wall loop: blocked in sync_read / sync_*_events (s)"),
        ("wall_max_wait_s", "wall loop: longest single wait (s)"),
        ("wall_submit_s", "wall loop: inside async_read / async_write (s)"),
        ("wall_other_s", "wall loop: the rest, i.e. compute while I/O runs (s)"),
        ("io_wait_s", "I/O-only loop: blocked in sync_read / sync_*_events (s)"),
        ("wall_cpu_s", "this process's CPU time, wall loop (core-s)"),
        ("compute_cpu_s", "this process's CPU time, compute-only loop (core-s)"),
        ("io_cpu_s", "this process's CPU time, I/O-only loop (core-s)"),
        ("wall_others_cpu_s", "other processes' CPU time during the wall loop (core-s)"),
        ("compute_others_cpu_s", "other processes' CPU time during the compute loop (core-s)"),
        ("io_others_cpu_s", "other processes' CPU time during the I/O-only loop (core-s)"),
    ):
        lines.append(f"| {label} | {fmt(sm.median(key))} | {fmt_samples(sm.get(key))} |")
    lines += [
        "",
        (
            f"I/O per loop: {format_size(p['total_bytes'])} read + {format_size(p['total_bytes'])} "
            f"written. Calibration: I/O-only loop {p['calibration_io_s']:.3f} s, one matmul "
            f"{p['calibration_matmul_s'] * 1e3:.3f} ms. "
            f"Run orders: {'; '.join(', '.join(x) for x in o['orders'])}."
        ),
    ]
    return lines


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    """Run the selected scenarios; print the report; write the JSON file."""
    argv = list(sys.argv[1:] if argv is None else argv)
    s = resolve_settings(parse_args(argv), argv)
    if s.aligned_alloc:
        os.environ["THP_MEM_ALLOC_ENABLE"] = "1"  # read by torch's CPU allocator
    import tensortier
    import torch

    torch.manual_seed(s.seed)
    created_dir = not s.directory.exists()
    s.directory.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now().astimezone()
    load_start = loadavg()
    log(f"load average at start: {load_start} ({os.cpu_count()} CPUs)")
    results: dict[str, Any] = {
        "command": s.command,
        "cwd": os.getcwd(),
        "started": started.isoformat(timespec="seconds"),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(s).items()},
        "loadavg_start": load_start,
        "cpu_count": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads_default": torch.get_num_threads(),
        "tensortier": getattr(tensortier, "__version__", "?"),
        "fio_version": tool_version([s.fio, "--version"]),
        "direct_io": direct_io_alignment(s.directory),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("TENSORTIER_", "THP_"))},
    }
    error: str | None = None
    try:
        if "copy" in s.scenarios or "rss" in s.scenarios:
            results["copy"] = copy_scenario(s)
            results["loadavg_after_copy"] = loadavg()
        if "overlap" in s.scenarios:
            results["overlap"] = overlap_scenario(s)
    except (BenchError, OSError, ValueError, RuntimeError) as e:
        error = f"{type(e).__name__}: {e}"
        log(f"FAILED: {error}")
        results["error"] = error
    finally:
        for name in ("tensortier", "overlap", "torch"):
            shutil.rmtree(s.directory / name, ignore_errors=True)
        (s.directory / "fio.dat").unlink(missing_ok=True)
        if created_dir:
            shutil.rmtree(s.directory, ignore_errors=True)
    results["loadavg_end"] = loadavg()
    results["finished"] = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    results["elapsed_s"] = (datetime.datetime.now().astimezone() - started).total_seconds()

    s.json_path.parent.mkdir(parents=True, exist_ok=True)
    s.json_path.write_text(json.dumps(results, indent=2) + "\n")

    report = [
        f"Command: `{s.command}`",
        "",
        (
            f"Load average (1/5/15 min): start {load_start}, end {results['loadavg_end']}; "
            f"{os.cpu_count()} CPUs. torch {torch.__version__}, {results['fio_version']}, "
            f"kernel {platform.release()}. O_DIRECT alignment here: {results['direct_io']}."
        ),
        "",
    ]
    if "copy" in results:
        if "copy" in s.scenarios:
            report += copy_report(results["copy"], s.repeats) + [""]
        if "rss" in s.scenarios:
            report += rss_report(results["copy"], s.repeats) + [""]
        report.append(f"Load average per copy repeat: {results['copy']['loadavg_per_repeat']}")
        report.append("")
    if "overlap" in results:
        report += overlap_report(results["overlap"], s.repeats) + [""]
        report.append(
            f"Load average per overlap repeat: {results['overlap']['loadavg_per_repeat']}"
        )
        report.append("")
    if error:
        report.append(f"**FAILED**: {error}")
    print("\n".join(report))
    log(f"results: {s.json_path} ({results['elapsed_s']:.0f} s)")
    return 1 if error else 0


if __name__ == "__main__":
    sys.exit(main())
