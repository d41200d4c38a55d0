"""Reading a load's pieces: (destination, file offset, stored checksum) read and checked by the
pipeline in C++ (``_core.read_pieces``: grouped, checked as the bytes arrive, GIL released), CUDA
destinations through the engine's GPU path."""

from __future__ import annotations

import contextlib
import contextvars
import errno
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from .. import _core
from ..io import _bump_versions, File, IOFuture, IOHandle
from . import _format
from .mapping import _as_bytes
from ._format import _require, _torch, ALIGNMENT

_I = TypeVar("_I")

# A load's progress bar on stderr (C++, ProgressBar): _Progress(label, total, enabled or None).
_Progress = _core.Progress


@dataclass
class _Piece:
    """Read `nbytes` at `offset` of `file` into `dest` (a tensor of exactly those bytes), checked
    against `checksum`: ("xxh64", stored or None where the file stores none) for a safetensors
    tensor, ("crc32", stored) for a whole torch storage record, None for no check."""

    name: str
    file: Any
    offset: int
    nbytes: int
    dest: Any
    checksum: tuple[str, int | None] | None = None


# Files opened ahead of their reads (the shards of an index), by path: _open_checkpoint hands
# each to its caller, who closes it.
_preopened: contextvars.ContextVar[dict[str, File] | None] = contextvars.ContextVar(
    "tensortier_preopened", default=None)

# Shards opened together at most: an index of more is opened as it is read.
_MAX_PREOPENED = 256


def _open_checkpoint(io: IOHandle, path: str) -> File:
    """`path` opened for the engine's reads (a FIFO or a device is refused, never waited on)."""
    preopened = _preopened.get()
    if preopened is not None and path in preopened:
        return preopened.pop(path)
    return io._file_system.open(path, io._direct)  # noqa: SLF001 - same package


@contextlib.contextmanager
def _opened_together(io: IOHandle, paths: Sequence[str]) -> Iterator[bool]:
    """Within: `paths` (an index's shards) opened now, all of them, for _open_checkpoint to
    hand out (True; False where there are too many to hold open, more than _MAX_PREOPENED or
    than descriptors are left, each opened as it is read).
    A directory another process replaces after they were opened (a save of the model, swapped
    in by one rename) is then read as the version they were opened from."""
    if len(paths) > _MAX_PREOPENED:
        yield False
        return
    files: dict[str, File] = {}
    try:
        for path in dict.fromkeys(paths):
            files[path] = io._file_system.open(path, io._direct)  # noqa: SLF001
    except OSError as e:
        for file in files.values():
            file.close()
        if e.errno not in (errno.EMFILE, errno.ENFILE):
            raise
        files = {}  # more shards than descriptors left: each opened as it is read
    if not files:
        yield False
        return
    token = _preopened.set(files)
    try:
        yield True
    finally:
        _preopened.reset(token)
        for file in files.values():  # those no read took
            file.close()


def _read_host(
    io: IOHandle, file: File, path: str, names: Sequence[str], offsets: Sequence[int],
    lengths: Sequence[int], addresses: Sequence[int], progress: _Progress,
    check: str = "none", expected: Sequence[int | None] | None = None,
) -> None:
    """Host memory at `addresses` filled from `file` and checked (``check``: "xxh64", "crc32"
    or "none"; `expected`: the stored values) by one call into the pipeline."""
    report = progress.update if progress.enabled else None
    _require("read_pieces")(
        io._core(), file, path, names, offsets, lengths, addresses,  # noqa: SLF001
        expected, check, _format._GROUP_BYTES, _format._ALIGNED_ALLOC_MIN, True, report)
    if report is None:
        progress.update(sum(lengths))


def _check_host(path: str, pieces: Sequence[tuple[str, Any, tuple[str, int | None]]]) -> None:
    """(name, CPU tensor, checksum of one kind for all) `pieces` in memory, checked by C++."""
    if pieces:
        _require("check_pieces")(
            path, [n for n, _, _ in pieces], [t.data_ptr() for _, t, _ in pieces],
            [t.numel() * t.element_size() for _, t, _ in pieces], [c[1] for _, _, c in pieces],
            pieces[0][2][0])


def _read_pieces(io: IOHandle, pieces: Sequence[_Piece], progress: _Progress, path: str) -> None:
    """Read every piece into its destination: CPU ones by C++, CUDA ones by the engine's GPU
    path, except those with a checksum to check (through a pinned host buffer)."""
    host = [p for p in pieces if p.dest.is_cpu]
    device = [p for p in pieces if not p.dest.is_cpu and p.checksum is None]
    checked_device = [p for p in pieces if not p.dest.is_cpu and p.checksum is not None]
    if host:
        _read_host_pieces(io, host, progress, path)
    if device:
        _read_batched(io, device, progress, path)
    if checked_device:
        _read_device_checked(io, checked_device, progress, path)


def _read_host_pieces(
    io: IOHandle, pieces: Sequence[_Piece], progress: _Progress, path: str
) -> None:
    """CPU `pieces`, one pipeline call per file and kind of checksum; each read counts as an
    in-place change of its tensor for autograd."""
    calls: dict[tuple[int, str], list[_Piece]] = {}
    for p in pieces:
        calls.setdefault((id(p.file), p.checksum[0] if p.checksum else "none"), []).append(p)
    for (_, check), ps in calls.items():
        _read_host(io, ps[0].file, path, [p.name for p in ps], [p.offset for p in ps],
                   [p.nbytes for p in ps], [p.dest.data_ptr() for p in ps], progress, check,
                   [p.checksum[1] for p in ps] if check != "none" else None)  # type: ignore[index]
    _bump_versions([p.dest for p in pieces])


def _byte_groups(items: Sequence[_I]) -> list[Sequence[_I]]:
    """`items` (with `nbytes`) in runs of at most ``_GROUP_BYTES`` (one item, if larger)."""
    ends = _require("byte_group_ends")([i.nbytes for i in items], _format._GROUP_BYTES)
    return [items[begin:end] for begin, end in zip([0, *ends], ends)]


def _read_batched(
    io: IOHandle, pieces: Sequence[_Piece], progress: _Progress, path: str
) -> None:
    """Unchecked CUDA destinations through the engine's GPU path, a group at a time; every read
    is waited for before an error is raised (it writes the tensors)."""
    submitted: list[tuple[list[_Piece], IOFuture | None]] = []
    try:
        for group in _byte_groups(pieces):
            batch = [(_as_bytes(q.dest), q.file, q.offset) for q in group if q.nbytes]
            submitted.append((group, io.pread_batch_async(batch) if batch else None))
        for group, fut in submitted:
            if fut is not None:
                got = iter(fut.result().segment_bytes)
                for p in group:
                    if p.nbytes:  # C++: a short file is the pipeline's error
                        _require("check_read_length")(path, p.name, p.offset, p.nbytes, next(got))
            progress.update(sum(p.nbytes for p in group))
    finally:
        for _, fut in submitted:  # memory handed to the engine must outlive the reads
            if fut is not None:
                try:
                    fut.wait()
                except (OSError, RuntimeError):  # CUDA failures are RuntimeErrors (CudaError)
                    pass


def _pinned_buffer(size: int) -> Any:
    """`size` bytes of tensortier's pinned host memory, as a uint8 tensor."""
    from ..device import pinned_empty

    return pinned_empty(size)


def _read_device_checked(
    io: IOHandle, pieces: Sequence[_Piece], progress: _Progress, path: str
) -> None:
    """CUDA destinations checked on the host (verify=True): each piece read into one of two
    pinned buffers, checked, then copied to its device on a stream of its own while the next
    is read. tensortier's pinned memory, as torch's allocator would round each buffer up to a
    power of two and keep it cached."""
    torch = _torch()
    size = max(p.nbytes for p in pieces) + ALIGNMENT
    buffers = [_pinned_buffer(size) for _ in range(2)]
    events: list[Any] = [None, None]
    streams: dict[Any, Any] = {}  # device -> the stream copying to it
    which = 0
    try:
        for p in pieces:
            buf = buffers[which]
            if events[which] is not None:
                events[which].synchronize()  # the copy out of this buffer has finished
            skew = p.offset % ALIGNMENT  # address = file offset mod page: no bounce
            view = buf[skew : skew + p.nbytes]
            if p.nbytes:
                got = io.pread(view, p.file, p.offset)
                _require("check_read_length")(path, p.name, p.offset, p.nbytes, got)
            assert p.checksum is not None
            _check_host(path, [(p.name, view, p.checksum)])
            if p.nbytes:
                dev = p.dest.device
                stream = streams.get(dev)
                if stream is None:
                    stream = streams[dev] = torch.cuda.Stream(device=dev)
                    # The destinations come from the caching allocator in the current stream's
                    # order: their memory may still be in use by kernels queued there (a tensor
                    # just freed, the parameters a queued forward pass reads). Copy after that.
                    stream.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(stream):  # also makes `dev` current while it lasts
                    _as_bytes(p.dest).copy_(view, non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(stream)
                events[which] = ev
                which ^= 1
            progress.update(p.nbytes)
    finally:
        # Copies still running read the pinned buffers and write the destinations: neither may
        # be freed (on an error) or used (on success) before they finish.
        for stream in streams.values():
            stream.synchronize()
