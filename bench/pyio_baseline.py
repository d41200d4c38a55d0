#!/usr/bin/env python3
"""Plain Python file I/O: the "plain Python" baseline of bench/engine_bench.py.

This is what a Python program does without tensortier: unbuffered ``FileIO`` writes of one
block-sized buffer until the file has SIZE bytes, then ``os.fsync``; cold reads into one
preallocated ``bytearray`` after dropping the file's pages with ``posix_fadvise(DONTNEED)``.
It runs as its own process so that each tool the benchmark compares is a subprocess printing
one JSON object, shaped like ``tensortier bench --json``::

    python bench/pyio_baseline.py --mode both --file f.dat --size 268435456 --block-size 1048576

Modes: ``write`` (timing includes the fsync; the file's pages are dropped afterwards, untimed),
``read`` (cold: pages dropped first, untimed; with ``--warm`` the file is read once untimed
instead, then the timed read comes from the page cache) and ``both`` (write, then cold read).
The file is never deleted here: the caller owns it. Sizes are plain byte counts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/_benchlib.py, from any directory
from _benchlib import GB, drop_file_cache  # noqa: E402


def write_file(path: Path, size: int, block_size: int) -> float:
    """Write ``size`` bytes to ``path`` in ``block_size`` writes, fsync; return seconds taken."""
    block = memoryview(os.urandom(block_size))
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        remaining = size
        while remaining > 0:
            remaining -= f.write(block[: min(block_size, remaining)])
        os.fsync(f.fileno())
    return time.perf_counter() - start


def read_file(path: Path, size: int, block_size: int) -> float:
    """Read ``size`` bytes of ``path`` into one reused buffer; return seconds taken.

    Raises OSError if the file holds fewer than ``size`` bytes.
    """
    buffer = bytearray(block_size)
    total = 0
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while total < size:
            n = f.readinto(buffer)
            if not n:
                break
            total += n
    elapsed = time.perf_counter() - start
    if total < size:
        raise OSError(f"{path}: short read, {total} of {size} bytes")
    return elapsed


def run(mode: str, path: Path, size: int, block_size: int, warm: bool) -> dict[str, object]:
    """Run one mode and return the result object printed on stdout."""
    result: dict[str, object] = {
        "tool": "python",
        "size": size,
        "block_size": block_size,
        "direct": False,
        "warm": warm,
    }
    if mode in ("write", "both"):
        result["write_gbps"] = size / write_file(path, size, block_size) / GB
        drop_file_cache(path, sync=None)  # write_file fsynced it
    if mode in ("read", "both"):
        if warm:
            read_file(path, size, block_size)
        else:
            drop_file_cache(path, sync=None)
        result["read_gbps"] = size / read_file(path, size, block_size) / GB
    return result


def positive_int(text: str) -> int:
    """argparse type: a byte count greater than zero."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run, print one JSON object; exit 1 with the error on stderr on failure."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("write", "read", "both"), required=True)
    parser.add_argument("--file", type=Path, required=True)
    parser.add_argument("--size", type=positive_int, required=True, help="bytes")
    parser.add_argument("--block-size", type=positive_int, required=True, help="bytes")
    parser.add_argument("--warm", action="store_true", help="read: time a page-cache read")
    args = parser.parse_args(argv)
    try:
        result = run(args.mode, args.file, args.size, args.block_size, args.warm)
    except OSError as e:
        print(f"pyio_baseline: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
