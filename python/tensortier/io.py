"""IOHandle: asynchronous reads and writes of host memory and CUDA tensors at any file offset."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence, Union

from . import _core
from ._buffers import HostBuffer, host_buffer
from ._notes import add_note
from ._paths import fspath, PathArg
from .device import device_buffer, is_cuda_tensor

File = _core.File
PathOrFile = Union[PathArg, File]


@dataclass(frozen=True)
class IOResult:
    """Outcome of one operation: bytes moved, per-piece bytes, and how they were moved.

    ``stats`` has ``backend``, ``direct_bytes``, ``buffered_bytes``, ``bounced_bytes``
    (through the engine's aligned buffers), ``staged_bytes`` (of those, by ``stage_reads``),
    ``cached_bytes`` (read buffered because resident in the page cache), ``requests``,
    ``resubmits`` (short transfers continued), ``eof`` (a read hit end of file) and
    ``direct_fallback`` (the filesystem refused O_DIRECT).
    """

    bytes: int
    segment_bytes: list[int] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)


class IOFuture(_core.IOFuture):
    """A submitted operation. Keeps its buffers and files alive until it has completed.

    Host pieces go to the engine as one submission; pieces in CUDA tensors each run through the
    transfer layer (pinned bounce ring or GDS) as a job of its C++ job queue. The C++ operation
    (``_core.Operation``) merges their outcomes and gives each error once (see
    ``IOHandle.wait_all``).
    """

    def done(self) -> bool:
        """True once the operation has completed (successfully or not); never blocks."""
        return bool(self._op.done())

    def result(self) -> IOResult:
        """Wait (GIL released; Ctrl-C interrupts the wait, not the operation) and return the
        full result.

        Raises:
            OSError: an I/O error (errno, filename, offset and length in the message).
            CudaError: a CUDA copy failed or the driver is missing.
        """
        return self._outcome(IOResult)

    def wait(self) -> int:
        """Wait for completion and return the number of bytes transferred.

        Raises:
            OSError: with ``errno``, ``filename`` and a message naming offset and length.
        """
        return self.result().bytes


class IOHandle:
    """An I/O engine: worker threads with io_uring, libaio or thread-pool rings.

    Buffers are host memory (tensors, numpy arrays, anything with the buffer protocol) or CUDA
    tensors. A CUDA tensor moves through a ring of pinned bounce buffers (disk reads and
    host-to-device copies overlap; the copies are ordered after the work queued on the tensor's
    device's current stream) or, with ``gds``, through GPUDirect Storage where cuFile accepts
    the file; the result's ``stats["path"]`` says which. Without a CUDA driver a CUDA tensor raises
    ``CudaError`` naming what is missing. A CUDA transfer follows the work queued on that stream
    before the call: its copies, queued later from the C++ threads of its job queue, go on a
    stream of their own that waits for that work, so work queued afterwards does not hold them
    up. Until its future completes, that work must not change a tensor being written nor use a
    tensor being read (as with KvikIO's futures).

    Every argument left as ``None`` takes its default, which ``TENSORTIER_*`` environment
    variables override (see :func:`tensortier.defaults`).

    Args:
        backend: ``"auto"`` (io_uring, then libaio, then threads), ``"io_uring"``, ``"libaio"``
            or ``"threads"``.
        chunk_size: large transfers are split into chunks of this many bytes (multiple of 4096).
        queue_depth: requests in flight per worker.
        workers: worker threads.
        max_inflight_bytes: bound on bytes in flight over all workers.
        page_cache_check: read page-cache-resident data buffered instead of O_DIRECT.
        stage_reads: for reads started with ``stage_reads=True`` (into small-page memory,
            such as tensors from torch's allocator): ``"auto"`` stages them through the
            engine's huge-page buffers where the file's disk cuts requests into scattered pages
            short (virtio disks), copied out by the engine's copy threads
            (``$TENSORTIER_COPY_THREADS``, at most ``$TENSORTIER_MAX_STAGED`` of buffers held;
            with no copy threads only into memory faulted in already: the copy would fault
            every page in on the workers), ``"on"`` (or ``True``) always, ``"off"`` (or
            ``False``) never.
        bounce_idle_ms: milliseconds a worker keeps an aligned bounce buffer that nothing uses
            (a burst of I/O into unaligned memory, or of staged reads, makes up to
            ``max_inflight_bytes`` of them) before it frees it; each worker keeps two. ``0``
            frees them as soon as the worker is idle. Keeping them spares the next burst
            faulting them in again (the next shard of a checkpoint, a loop of reads). Default
            ``$TENSORTIER_BOUNCE_IDLE_MS``, else 1000. ``bounce_bytes`` says how much is held.
        direct: open files given by path with O_DIRECT (falls back, reported, where refused).
        probe_dir: with ``backend="auto"``, pick the first backend whose verified round trip
            passes in this directory.
        gds: for CUDA tensors, ``"off"`` (the bounce ring), ``"auto"`` (GDS where cuFile
            accepts the file and is not in its compatibility mode: the nvidia-fs driver is
            loaded, or cuFile's configuration sets ``use_pci_p2pdma``; else the ring) or
            ``"on"`` (cuFile, in whichever mode it runs, or an error; ``"require"`` is another
            spelling of it). Default: ``$TENSORTIER_GDS``, else ``"off"``.
        bounce_slots, bounce_slot_size, bounce_rings: the pinned bounce ring of CUDA transfers:
            buffers per ring, bytes per buffer, rings (concurrent CUDA transfers). Defaults:
            ``$TENSORTIER_BOUNCE_SLOTS`` (8), ``$TENSORTIER_BOUNCE_SLOT_SIZE`` (8 MiB),
            ``$TENSORTIER_BOUNCE_RINGS`` (4). Checked (variables included) when the handle is
            made, against the settings table's ranges, not at its first CUDA transfer.

    Raises:
        ValueError: a bad setting. OSError: the requested backend cannot start here.
    """

    def __init__(
        self,
        backend: str | None = None,
        *,
        chunk_size: int | None = None,
        queue_depth: int | None = None,
        workers: int | None = None,
        max_inflight_bytes: int | None = None,
        page_cache_check: bool | None = None,
        stage_reads: str | bool | None = None,
        bounce_idle_ms: int | None = None,
        direct: bool = True,
        probe_dir: PathArg | None = None,
        gds: str | None = None,
        bounce_slots: int | None = None,
        bounce_slot_size: int | None = None,
        bounce_rings: int | None = None,
    ) -> None:
        self._direct = bool(_core.flag(direct, "direct"))
        # Checks the settings (ValueError or TypeError naming the argument).
        self._engine: _core.Engine | None = _core.Engine(
            backend=backend,
            chunk_size=chunk_size,
            queue_depth=queue_depth,
            workers=workers,
            max_inflight_bytes=max_inflight_bytes,
            page_cache_check=page_cache_check,
            stage_reads=stage_reads,
            bounce_idle_ms=bounce_idle_ms,
            probe_dir=fspath(probe_dir, "probe_dir") if probe_dir is not None else "",
        )
        # Saves' and loads' system calls outside the engine (open, fallocate, fsync, rename).
        self._file_system = _core.FileSystem()
        self._pid = os.getpid()
        # Operations not known to be over, and finished ones whose error nobody has seen.
        self._pending = _core.OperationLog()
        self._device = _core.DeviceRoute(gds, bounce_slots, bounce_slot_size, bounce_rings)

    # -- properties ------------------------------------------------------------------------
    @property
    def backend(self) -> str:
        """The backend in use (``auto`` resolved)."""
        return self._core().backend

    @property
    def options(self) -> dict[str, Any]:
        """Effective settings after defaults and environment (``gds`` included; the bounce
        ring's settings once a CUDA tensor has been moved)."""
        return {**self._core().options, **self._device.options}

    @property
    def bounce_bytes(self) -> int:
        """Bytes of the engine's aligned bounce buffers held now, in use or kept for the next
        burst (see ``bounce_idle_ms``)."""
        return self._core().bounce_bytes

    # -- files -----------------------------------------------------------------------------
    def open(self, path: PathArg, mode: str = "r", *, direct: bool | None = None) -> File:
        """Open `path` for this handle: 'r' read only; 'r+' read and write; 'w' (or 'w+')
        create or truncate; 'a' create if missing and keep the contents ('w' and 'a' files can
        be read too, unlike Python's; writes go where the offset says, never appended).

        Raises:
            OSError: the file cannot be opened (FileNotFoundError, PermissionError...).
            ValueError: a bad mode.
        """
        if not isinstance(mode, str):
            raise TypeError(f"mode must be a str such as 'r' or 'w', not {type(mode).__name__}")
        direct = _core.flag(direct, "direct")
        return File.open(fspath(path), mode, self._direct if direct is None else direct)

    # -- single operations -------------------------------------------------------------------
    def pread_async(self, buf: Any, file: PathOrFile, offset: int = 0) -> IOFuture:
        """Start reading ``len(buf)`` bytes at `offset` of `file` into `buf`.

        A read past end of file stops there: the future's byte count says how much arrived.
        """
        return self._submit("read", [(buf, file, offset)])

    def pwrite_async(self, buf: Any, file: PathOrFile, offset: int = 0) -> IOFuture:
        """Start writing all of `buf` at `offset` of `file` (created if it is a missing path)."""
        return self._submit("write", [(buf, file, offset)])

    def pread(self, buf: Any, file: PathOrFile, offset: int = 0) -> int:
        """Read into `buf` from `offset`; returns the bytes read (fewer only at end of file)."""
        return self.pread_async(buf, file, offset).wait()

    def pwrite(self, buf: Any, file: PathOrFile, offset: int = 0) -> int:
        """Write `buf` at `offset`; returns the bytes written (always all of them, or raises)."""
        return self.pwrite_async(buf, file, offset).wait()

    # -- batches -----------------------------------------------------------------------------
    def pread_batch_async(
        self, pieces: Iterable[tuple[Any, PathOrFile, int]], *, stage_reads: bool = False
    ) -> IOFuture:
        """Start a scatter read of many ``(buf, file, offset)`` pieces, submitted together.

        ``stage_reads=True`` says the host buffers are small-page memory (tensors from torch's
        allocator; not huge-page buffers such as ``aligned_empty(..., reused=True)``):
        where the handle's ``stage_reads`` setting allows, direct reads then go through the
        engine's huge-page buffers and are copied out by its copy threads, which is faster on
        disks that cut requests into scattered pages short (``stats["staged_bytes"]``)."""
        return self._submit("read", list(pieces), stage_reads)

    def pwrite_batch_async(self, pieces: Iterable[tuple[Any, PathOrFile, int]]) -> IOFuture:
        """Start a gather write of many ``(buf, file, offset)`` pieces, submitted together."""
        return self._submit("write", list(pieces))

    def wait_all(self) -> None:
        """Wait for every operation started on this handle; raises the first error not yet
        raised to anyone (by a future's ``result()``/``wait()`` or an earlier ``wait_all()``),
        including those of futures dropped without waiting; the others, if several failed, are
        counted in a note on it. Ctrl-C interrupts the wait; nothing is lost (a later wait_all
        waits again)."""
        self._pending.wait_all(self._core())

    def close(self) -> None:
        """Wait for everything in flight, then stop the workers. Idempotent. Raises the first
        error not yet raised to anyone (see ``wait_all``)."""
        if self._engine is None:
            return
        try:
            if os.getpid() == self._pid:
                self.wait_all()
            else:
                # A fork's child: the operations and threads are the parent's. Let go without
                # waiting, and without locks (a thread of the parent may have held one).
                self._pending = _core.OperationLog()
        finally:
            self._device.clear()  # its jobs are over (or, in a fork's child, the parent's)
            self._engine = None

    def __enter__(self) -> "IOHandle":
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            self.close()
            return
        # The block's exception is the one to see; a dropped operation's error is a note on it.
        try:
            self.close()
        except Exception as close_error:  # noqa: BLE001 - reported on the block's exception
            add_note(exc, f"and closing the IOHandle raised: {close_error!r}")

    # -- internals -----------------------------------------------------------------------------
    def _core(self) -> _core.Engine:
        if self._engine is None:
            raise ValueError("IOHandle is closed")
        if os.getpid() != self._pid:
            raise ValueError(_core.forked_message("IOHandle", self._pid))
        return self._engine

    def _submit(
        self, op: str, pieces: Sequence[tuple[Any, PathOrFile, int]], stage_reads: bool = False
    ) -> IOFuture:
        engine = self._core()
        write = op == "write"
        keepalive: list[Any] = []
        native: list[tuple[File, int, int, int]] = []
        device: list[tuple[Any, File, int]] = []
        on_device: list[bool] = []
        for index, piece in enumerate(pieces):
            buf, file, offset = _core.batch_piece(index, piece)  # TypeError/ValueError
            on_device.append(is_cuda_tensor(buf))
            if on_device[-1]:
                f = _core.io_file(file, write, self._direct)
                keepalive.extend((buf, buf.untyped_storage(), f))
                device.append((buf, f, offset))
                continue
            hb: HostBuffer = host_buffer(buf, writable=not write)
            # The engine holds the file while the piece is in flight: a file opened here for a
            # path closes when the piece ends, not when the future is waited (descriptors are
            # a budget: ulimit -n).
            f = _core.io_file(file, write, self._direct)
            keepalive.append(hb.owner)
            native.append((f, hb.address, hb.nbytes, offset))
        # Every device buffer first (a stream of its own each, ordered after the work queued
        # so far): a CUDA error raises before anything starts.
        device_pieces: list[tuple[int, int, int, int | None, File, int]] = []
        for buf, f, offset in device:
            db = device_buffer(buf, own_stream=True)
            keepalive.append(db.owner)
            device_pieces.append((db.address, db.nbytes, db.device, db.stream, f, offset))
        # Started and recorded by one C++ call: Ctrl-C cannot come between the two. A device
        # piece refused leaves what started recorded (its memory kept alive until it is over).
        result = self._pending.submit(engine, op, native, stage_reads, IOFuture, keepalive,
                                      self._device, device_pieces, on_device)
        if not write:
            _bump_versions([piece[0] for piece in pieces])
        return result


def _bump_versions(buffers: Sequence[Any]) -> None:
    """Counts a read into torch tensors as an in-place change for autograd (as ``copy_`` would:
    a tensor saved for backward and then read into makes backward raise, not compute a wrong
    gradient)."""
    increment = None
    for buf in buffers:
        if type(buf).__module__.startswith("torch") and hasattr(buf, "_version"):
            if increment is None:
                from torch.autograd.graph import increment_version as increment
            increment(buf)

