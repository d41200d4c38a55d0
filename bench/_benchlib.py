"""Helpers shared by the benchmark scripts in bench/ (not a benchmark itself).

Sizes (``parse_size``, ``format_size``), comma-separated name lists for argparse, progress
logging to stderr, page-cache control (``drop_file_cache``, ``warm_file``), ``settle`` (wait for
the disk to go idle between tools), medians and ratios that tolerate missing figures, and the
parsing of fio's JSON output.

The scripts run as ``python bench/X.py`` from any directory, so they import this module from
their own directory::

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _benchlib import log, parse_size  # noqa: E402

Where two scripts used to differ in a detail that shows in their output (an error message, the
smallest size accepted, the I/O pattern of a cache warm-up), the helper takes a parameter and
each script passes its own value, so that no script's behaviour changed when it moved here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

GB = 1e9  # GB/s means 1e9 bytes per second, as in `tensortier bench --json`.
SIZE_UNITS = {"K": 1024, "M": 1024**2, "G": 1024**3}


# --------------------------------------------------------------------------- sizes


def positive_size(value: int) -> str | None:
    """The default ``parse_size`` check: refuses sizes <= 0."""
    return "size must be > 0" if value <= 0 else None


def parse_size(
    text: str,
    examples: str = "4K, 1M, 2G",
    check: Callable[[int], str | None] = positive_size,
) -> int:
    """Parse a byte count with an optional K/M/G suffix (powers of 1024): '4K' -> 4096.

    Case-insensitive; one trailing 'B' and then one 'I' are ignored ('4KiB', '4kb'). Whole
    numbers only. An argparse type: raises argparse.ArgumentTypeError 'not a size: TEXT (use
    e.g. EXAMPLES)', or 'WHY: TEXT' when ``check(value)`` returns why the value is refused.
    TEXT is the normalised text (upper case, suffix B/I removed), as the scripts always printed.
    """
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = SIZE_UNITS.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in SIZE_UNITS else text
    try:
        value = int(number) * unit
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. {examples})") from None
    why = check(value)
    if why is not None:
        raise argparse.ArgumentTypeError(f"{why}: {text!r}")
    return value


def format_size(size: int) -> str:
    """Format a byte count with the largest exact K/M/G suffix: 2147483648 -> '2G'."""
    for suffix, unit in sorted(SIZE_UNITS.items(), key=lambda item: -item[1]):
        if size % unit == 0:
            return f"{size // unit}{suffix}"
    return str(size)


# --------------------------------------------------------------------------- arguments, output


def name_list(allowed: Sequence[str], hint: str = "use") -> Callable[[str], list[str]]:
    """argparse type factory: comma-separated names, each one of ``allowed``.

    Anything else is refused with 'unknown NAMES; HINT a,b,c' (``hint`` is 'use' or 'choose
    from', as each script always said).
    """

    def parse(text: str) -> list[str]:
        names = [part.strip() for part in text.split(",") if part.strip()]
        unknown = [name for name in names if name not in allowed]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {unknown or text!r}; {hint} {','.join(allowed)}"
            )
        return names

    return parse


def ab_args(description: str | None) -> argparse.Namespace:
    """The options of the small A/B scripts (``--dir``, ``--repeats``), parsed; ``--dir`` is
    created."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--dir", default="tensortier-data/checkpoint-bench",
                        help="directory on the disk under test")
    parser.add_argument("--repeats", type=int, default=5, help="samples per figure")
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    return args


def log(message: str) -> None:
    """Progress and errors go to stderr; stdout carries only the report."""
    print(message, file=sys.stderr, flush=True)


def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages, rounded to 2 decimals."""
    return [round(x, 2) for x in os.getloadavg()]


def tool_version(argv: list[str]) -> str:
    """First line of a version command's output, or why it could not run."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unavailable ({e})"
    text = (proc.stdout or proc.stderr).strip()
    return text.splitlines()[0] if text else f"unavailable (exit status {proc.returncode})"


# --------------------------------------------------------------------------- page cache, disk


def cached_fraction(path: str | os.PathLike[str]) -> float | None:
    """The fraction of ``path``'s pages in the page cache (mincore over a mapping of it, which
    faults nothing in); None where it cannot be told (an empty file, mmap or mincore refused)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = os.path.getsize(path)
    if size == 0:
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            pages = -(-size // mmap.PAGESIZE)
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(addr, size, vec) != 0:
                return None
            return sum(v & 1 for v in vec) / pages
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


_warned_cache_drop: set[str] = set()


def drop_file_cache(
    path: str | os.PathLike[str], sync: Callable[[int], None] | None = os.fsync
) -> float | None:
    """Drop ``path``'s clean pages from the page cache (POSIX_FADV_DONTNEED); returns the
    fraction still cached after it (``cached_fraction``).

    ``sync`` (``os.fsync`` by default, or ``os.fdatasync``) runs on the file first so that dirty
    pages are written and can be dropped too; None skips it, for files whose writer already
    synced them (or wrote them with O_DIRECT). Where the kernel kept more than 5 % of the file
    (a sandbox that ignores the advice), a warning says once per file that its "cold" figures
    are partly warm.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        if sync is not None:
            sync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    left = cached_fraction(path)
    if left is not None and left > 0.05 and str(path) not in _warned_cache_drop:
        _warned_cache_drop.add(str(path))
        log(f"warning: {left:.0%} of {path} is still in the page cache after dropping it: "
            "'cold' figures for it are partly warm here")
    return left


def warm_file(path: str | os.PathLike[str], block: int = 64 << 20, reuse: bool = False) -> None:
    """Read ``path`` once through the page cache (untimed) so that the next read is warm.

    Reads ``block`` bytes at a time: with ``reuse``, unbuffered ``readinto`` one preallocated
    buffer, else buffered ``read`` calls that each return a new bytes object.
    """
    if reuse:
        with open(path, "rb", buffering=0) as raw:
            buf = bytearray(block)
            while raw.readinto(buf):
                pass
    else:
        with open(path, "rb") as f:
            while f.read(block):
                pass


def settle(max_wait: float = 15.0) -> float:
    """Let the disk finish the work the previous tool left behind (writeback, and the discards
    that unlink or truncate issue on a discard-mounted file system) so that it is not charged to
    the next tool: sync, then wait until no block device has requests in flight for 0.5 s (at
    most ``max_wait`` seconds). Untimed; returns the seconds it took."""
    start = time.monotonic()
    os.sync()
    quiet_since = time.monotonic()
    while time.monotonic() - start < max_wait:
        busy = 0
        for stat in Path("/sys/block").glob("*/inflight"):
            try:
                busy += sum(int(v) for v in stat.read_text().split())
            except OSError:
                pass
        now = time.monotonic()
        if busy:
            quiet_since = now
        elif now - quiet_since >= 0.5:
            break
        time.sleep(0.05)
    return time.monotonic() - start


# --------------------------------------------------------------------------- statistics


def median(values: Sequence[float]) -> float | None:
    """Median, or None when there are no values."""
    return statistics.median(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is 0."""
    return a / b if a is not None and b else None


# --------------------------------------------------------------------------- fio


def fio_first_job(stdout: str) -> dict[str, Any]:
    """The first job object of fio's ``--output-format=json`` output (text before the JSON,
    such as fio's warnings, is skipped)."""
    job: dict[str, Any] = json.loads(stdout[stdout.find("{") :])["jobs"][0]
    return job


def fio_stats(
    proc: subprocess.CompletedProcess[str], command: str, rw: str, size: int
) -> dict[str, Any]:
    """The write (``rw == "write"``) or read statistics of a finished one-job fio run.

    Raises RuntimeError if fio failed, its job reported an error, or it moved other than
    ``size`` bytes; ``command`` (the shell-quoted fio command line) goes into the message.
    """
    if proc.returncode != 0:
        raise RuntimeError(f"fio failed ({proc.returncode}): {command}\n{proc.stderr[-2000:]}")
    job = fio_first_job(proc.stdout)
    if job.get("error"):
        raise RuntimeError(f"fio job error {job['error']}: {command}")
    stats: dict[str, Any] = job["write" if rw == "write" else "read"]
    if stats["io_bytes"] != size:
        raise RuntimeError(f"fio moved {stats['io_bytes']} bytes, not {size}: {command}")
    return stats
