"""Shared by the file-access examples: DeepNVMe's options, timing, GB/s, validation."""

from __future__ import annotations

import argparse
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch


def load_args(description: str) -> argparse.Namespace:
    """``--input_file``, ``--loop``, ``--validate`` (DeepNVMe's load options)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--input_file", required=True, help="file to load")
    p.add_argument("--loop", type=int, default=3, help="timed repetitions")
    p.add_argument("--validate", action="store_true", help="compare with a plain Python read")
    p.add_argument("--cold", action="store_true",
                   help="evict the file from the page cache before each load (DeepNVMe's "
                        "scripts do not, so their Python loads after the first are warm)")
    p.add_argument("--gds", action="store_true",
                   help="GPU loaders: GPUDirect Storage where cuFile accepts the file (else the "
                        "pinned bounce ring)")
    return p.parse_args()


def store_args(description: str) -> argparse.Namespace:
    """``--nvme_folder``, ``--mb_size``, ``--loop``, ``--validate`` (DeepNVMe's store options)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--nvme_folder", required=True, help="folder to store into")
    p.add_argument("--mb_size", type=int, default=1024, help="tensor size in MiB")
    p.add_argument("--loop", type=int, default=3, help="timed repetitions")
    p.add_argument("--validate", action="store_true", help="read back and compare")
    p.add_argument("--fsync", action="store_true",
                   help="fsync inside the timing (DeepNVMe's scripts do not, so their Python "
                        "stores end in the page cache)")
    p.add_argument("--gds", action="store_true",
                   help="GPU storers: GPUDirect Storage where cuFile accepts the file (else the "
                        "pinned bounce ring)")
    return p.parse_args()


def before_load(args: argparse.Namespace) -> Callable[[], None] | None:
    """What runs untimed before each load: nothing, or with --cold a page-cache eviction."""
    return (lambda: drop_cache(args.input_file)) if args.cold else None


def drop_cache(path: str) -> None:
    """Evict `path` from the page cache, so a load is served by the disk (a cold load)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def timed(label: str, nbytes: int, loop: int, run: Callable[[], Any],
          before: Callable[[], None] | None = None) -> Any:
    """Runs `run` `loop` times (calling `before` untimed before each); prints
    ``label: X GB/sec, T secs`` like DeepNVMe's scripts, over the total."""
    total = 0.0
    result = None
    for _ in range(loop):
        if before is not None:
            before()
        start = time.perf_counter()
        result = run()
        total += time.perf_counter() - start
    print(f"{label}: {loop * nbytes / total / 1e9:5.2f} GB/sec, {total:5.2f} secs")
    return result


def random_tensor(mb_size: int, device: str = "cpu") -> torch.Tensor:
    return torch.randint(0, 256, (mb_size << 20,), dtype=torch.uint8, device=device)


def python_read(path: str) -> torch.Tensor:
    """DeepNVMe's baseline: ``torch.frombuffer(f.read())`` (one copy out of the page cache)."""
    with open(path, "rb") as f, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # frombuffer of read-only bytes
        return torch.frombuffer(f.read(), dtype=torch.uint8)


def check(label: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if not torch.equal(got.cpu(), want.cpu()):
        raise SystemExit(f"{label}: validation FAILED")
    print(f"{label}: validation passed")
