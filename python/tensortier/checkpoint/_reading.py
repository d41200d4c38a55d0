"""Reading: a plan of (destination, file offset) pieces executed with the engine, in groups,
directly into device memory where that is possible."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..io import IOFuture, IOHandle
from . import _format
from ._tensor_bytes import _as_bytes
from ._format import _require, _T, _torch, ALIGNMENT
from ._progress import _Progress


@dataclass
class _Piece:
    """Read `nbytes` at `offset` of `file` into `dest` (a tensor of exactly those bytes), then
    call `done(dest_host_bytes)` (checksums)."""

    name: str
    file: Any
    offset: int
    nbytes: int
    dest: Any
    check: Callable[[Any], None] | None = None


def _read_pieces(
    io: IOHandle, pieces: Sequence[_Piece], progress: _Progress, path: str,
    close_progress: bool = True,
) -> None:
    """Read every piece into its destination, in groups of ~64 MiB submitted together and
    checked as they complete. CPU destinations are read in place; CUDA ones through the
    engine's GPU path (pinned bounce ring or GPUDirect Storage, copies on the current stream),
    except those with a checksum to check, which come through a pinned host buffer."""
    batched = [p for p in pieces if p.dest.is_cpu or p.check is None]
    checked_device = [p for p in pieces if not p.dest.is_cpu and p.check is not None]
    try:
        if batched:
            _read_batched(io, batched, progress, path)
        if checked_device:
            _read_device_checked(io, checked_device, progress, path)
    finally:
        if close_progress:
            progress.close()


def _groups(pieces: Sequence[_T]) -> Iterator[list[_T]]:
    """`pieces` (anything with ``nbytes``) in runs of about _GROUP_BYTES (one piece when
    larger)."""
    group: list[_T] = []
    size = 0
    for p in pieces:
        group.append(p)
        size += p.nbytes
        if size >= _format._GROUP_BYTES:
            yield group
            group, size = [], 0
    if group:
        yield group


def _short_read(path: str, piece: _Piece, got: int) -> ValueError:
    return ValueError(
        f"{path}: file ended early: tensor {piece.name!r} needs {piece.nbytes} bytes at offset "
        f"{piece.offset}, got {got} (truncated file?)"
    )


def _read_batched(
    io: IOHandle, pieces: Sequence[_Piece], progress: _Progress, path: str
) -> None:
    submitted: list[tuple[list[_Piece], IOFuture]] = []
    try:
        for group in _groups(pieces):
            batch = [(_as_bytes(p.dest), p.file, p.offset) for p in group if p.nbytes]
            if batch:
                # Tensors from torch's allocator (new ones, or load_into's targets) are small
                # pages, which some disks read slowly: see IOHandle(stage_reads=...).
                submitted.append((group, io.pread_batch_async(batch, stage_reads=True)))
            else:
                submitted.append((group, None))  # type: ignore[arg-type]
        for group, fut in submitted:
            if fut is not None:
                result = fut.result()
                got = iter(result.segment_bytes)
                for p in group:
                    if p.nbytes:
                        n = next(got)
                        if n != p.nbytes:
                            raise _short_read(path, p, n)
            for p in group:
                if p.check is not None:
                    p.check(p.dest)
                progress.update(p.nbytes)
    finally:
        for _, fut in submitted:  # memory handed to the engine must outlive the reads
            if fut is not None:
                try:
                    fut.wait()
                except (OSError, RuntimeError):  # CUDA failures are RuntimeErrors (CudaError)
                    pass


def _read_small(
    io: IOHandle, file: Any, path: str, pieces: Sequence[tuple[str, int, int]],
    addresses: Sequence[int], progress: _Progress,
) -> None:
    """(name, offset, nbytes) `pieces` of `file` read by ``_core.read_scattered`` into host
    memory at `addresses` (the caller's tensors, kept alive meanwhile): small tensors (optimizer
    states, adapters, norms) in large requests copied out, not one request each."""
    got = _require("read_scattered")(io._core(), file,  # noqa: SLF001 - same package
                                     [o for _, o, _ in pieces], [n for _, _, n in pieces],
                                     addresses)
    for (name, offset, n), g in zip(pieces, got):
        if g != n:
            raise ValueError(
                f"{path}: file ended early: tensor {name!r} needs {n} bytes at offset {offset}, "
                f"got {g} (truncated file?)"
            )
    progress.update(sum(n for _, _, n in pieces))


def _pinned_buffer(size: int) -> Any:
    """`size` bytes of tensortier's pinned host memory (exactly that size, unmapped when the
    tensor goes), as a uint8 tensor."""
    from .device import pinned_empty

    return pinned_empty(size)


def _read_device_checked(
    io: IOHandle, pieces: Sequence[_Piece], progress: _Progress, path: str
) -> None:
    """Fill CUDA destinations whose bytes must be checksummed on the host (verify=True):
    each piece is read whole into one of two reused pinned buffers, checked, then copied to
    its device (on a stream of that device's own) while the next piece is read. The buffers are
    tensortier's pinned memory of the exact size, unmapped when this returns (torch's pinned
    allocator would round each up to a power of two and keep it cached for the process)."""
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
                if got != p.nbytes:
                    raise _short_read(path, p, got)
            assert p.check is not None
            p.check(view)
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
