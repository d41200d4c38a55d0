"""IOHandle: asynchronous reads and writes of host memory at any file offset."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence, Union

from . import _core
from ._buffers import HostBuffer, host_buffer

File = _core.File
PathOrFile = Union[str, "os.PathLike[str]", File]


@dataclass(frozen=True)
class IOResult:
    """Outcome of one operation: bytes moved, per-piece bytes, and how they were moved.

    ``stats`` has ``backend``, ``direct_bytes``, ``buffered_bytes``, ``bounced_bytes``,
    ``cached_bytes`` (read buffered because resident in the page cache), ``requests``,
    ``resubmits`` (short transfers continued), ``eof`` (a read hit end of file) and
    ``direct_fallback`` (the filesystem refused O_DIRECT).
    """

    bytes: int
    segment_bytes: list[int] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)


class IOFuture:
    """A submitted operation. Keeps its buffers and files alive until it has completed."""

    def __init__(self, future: _core.Future, keepalive: list[Any]) -> None:
        self._future = future
        self._keepalive: list[Any] | None = keepalive
        self._result: IOResult | None = None

    def done(self) -> bool:
        """True once the operation has completed (successfully or not); never blocks."""
        return self._future.done()

    def result(self) -> IOResult:
        """Wait (GIL released) and return the full result; raises OSError on I/O failure."""
        if self._result is None:
            try:
                raw = self._future.wait()
            finally:
                if self._future.done():
                    self._keepalive = None
            self._result = IOResult(raw["bytes"], list(raw["segment_bytes"]), dict(raw["stats"]))
        return self._result

    def wait(self) -> int:
        """Wait for completion and return the number of bytes transferred.

        Raises:
            OSError: with ``errno``, ``filename`` and a message naming offset and length.
        """
        return self.result().bytes

    def __del__(self) -> None:
        # Memory handed to the kernel must outlive the I/O, even if the future is dropped.
        if getattr(self, "_keepalive", None) is not None:
            try:
                self._future.wait()
            except Exception:  # noqa: BLE001 - the error belongs to whoever waits; nobody will
                pass


class IOHandle:
    """An I/O engine: worker threads with io_uring, libaio or thread-pool rings.

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
        direct: open files given by path with O_DIRECT (falls back, reported, where refused).
        probe_dir: with ``backend="auto"``, pick the first backend whose verified round trip
            passes in this directory.

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
        direct: bool = True,
        probe_dir: str | os.PathLike[str] | None = None,
        _fault: dict[str, Any] | None = None,
    ) -> None:
        for name, value in (
            ("chunk_size", chunk_size),
            ("queue_depth", queue_depth),
            ("workers", workers),
            ("max_inflight_bytes", max_inflight_bytes),
        ):
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive integer, not {value!r}")
        self._direct = direct
        self._engine: _core.Engine | None = _core.Engine(
            backend=backend,
            chunk_size=chunk_size,
            queue_depth=queue_depth,
            workers=workers,
            max_inflight_bytes=max_inflight_bytes,
            page_cache_check=page_cache_check,
            probe_dir=os.fspath(probe_dir) if probe_dir is not None else "",
            fault=_fault,
        )
        self._pending: list[IOFuture] = []

    # -- properties ------------------------------------------------------------------------
    @property
    def backend(self) -> str:
        """The backend in use (``auto`` resolved)."""
        return self._core().backend

    @property
    def options(self) -> dict[str, Any]:
        """Effective settings after defaults and environment."""
        return dict(self._core().options)

    # -- files -----------------------------------------------------------------------------
    def open(self, path: str | os.PathLike[str], mode: str = "r", *, direct: bool | None = None) -> File:
        """Open `path` for this handle ('r', 'r+', 'w' create/truncate, 'a' create/keep).

        Raises:
            OSError: the file cannot be opened (FileNotFoundError, PermissionError...).
            ValueError: a bad mode.
        """
        return File.open(os.fspath(path), mode, self._direct if direct is None else direct)

    def _file(self, file: PathOrFile, write: bool) -> File:
        if isinstance(file, File):
            if file.closed:
                raise ValueError("file is closed")
            return file
        if isinstance(file, (str, os.PathLike)):
            return self.open(file, "a" if write else "r")
        raise TypeError(f"file must be a path or a tensortier.File, not {type(file).__name__}")

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
    def pread_batch_async(self, pieces: Iterable[tuple[Any, PathOrFile, int]]) -> IOFuture:
        """Start a scatter read of many ``(buf, file, offset)`` pieces, submitted together."""
        return self._submit("read", list(pieces))

    def pwrite_batch_async(self, pieces: Iterable[tuple[Any, PathOrFile, int]]) -> IOFuture:
        """Start a gather write of many ``(buf, file, offset)`` pieces, submitted together."""
        return self._submit("write", list(pieces))

    def wait_all(self) -> None:
        """Wait for every operation started on this handle; raises the first unseen error."""
        pending, self._pending = self._pending, []
        first: BaseException | None = None
        for fut in pending:
            try:
                fut.result()
            except OSError as e:
                first = first or e
        try:
            self._core().wait_all()
        except OSError as e:
            first = first or e
        if first is not None:
            raise first

    def close(self) -> None:
        """Wait for everything in flight, then stop the workers. Idempotent."""
        if self._engine is None:
            return
        try:
            self.wait_all()
        finally:
            self._engine = None

    def __enter__(self) -> "IOHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------------
    def _core(self) -> _core.Engine:
        if self._engine is None:
            raise ValueError("IOHandle is closed")
        return self._engine

    def _submit(self, op: str, pieces: Sequence[tuple[Any, PathOrFile, int]]) -> IOFuture:
        engine = self._core()
        write = op == "write"
        keepalive: list[Any] = []
        native: list[tuple[File, int, int, int]] = []
        for buf, file, offset in pieces:
            if not isinstance(offset, int) or isinstance(offset, bool):
                raise TypeError(f"offset must be an int, not {type(offset).__name__}")
            if offset < 0:
                raise ValueError(f"offset must be >= 0, not {offset}")
            hb: HostBuffer = host_buffer(buf, writable=not write)
            f = self._file(file, write)
            keepalive.append(hb.owner)
            keepalive.append(f)
            native.append((f, hb.address, hb.nbytes, offset))
        future = IOFuture(engine.submit(op, native), keepalive)
        self._pending = [p for p in self._pending if not p.done()]
        self._pending.append(future)
        return future
