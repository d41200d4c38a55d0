"""Writing checkpoint files: the durable file (C++), the engine writer that stages
non-contiguous and GPU tensors, and plain reads of checkpoint files."""

from __future__ import annotations

import collections
import os
from typing import Any

from .. import _core
from ..io import File, IOFuture, IOHandle
from . import _engine, _format
from ._tensor_bytes import _nbytes
from ._format import PathLike


class _DurableFile:
    """A save's new file (``_core.DurableFile``: temporary name next to `path`, fdatasync,
    rename, directory fsync, background release of the replaced file, every system call
    through `io`'s fault seam); ``commit()`` makes it the file at `path`, ``abort()`` (or an
    exception in the ``with`` body) removes it."""

    # False: the rename frees the replaced file, as before (bench/save_replace_cost.py's switch).
    _free_in_background = True

    def __init__(self, path: PathLike, io: IOHandle) -> None:
        self._core = _core.DurableFile(
            os.fspath(path), io._direct, io._file_system,  # noqa: SLF001 - same package
            self._free_in_background,
        )
        self.final: str = self._core.path
        self.tmp: str = self._core.temporary_path
        self.file: Any = None

    def open(self) -> Any:
        """The engine's handle on the temporary file (O_DIRECT where possible)."""
        if self.file is None:
            self.file = self._core.file
        return self.file

    def reserve(self, size: int) -> None:
        """Allocate `size` bytes up front: ENOSPC now rather than mid-write, contiguous extents."""
        self._core.reserve(size)

    def commit(self) -> None:
        self._close()
        self._core.commit()

    def abort(self) -> None:
        self._close()
        self._core.abort()

    def _close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None

    def __enter__(self) -> "_DurableFile":
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is not None or not self._core.committed:
            self.abort()


def _open_checkpoint(io: IOHandle, path: str) -> File:
    """`path` opened for the engine's reads through `io`'s fault seam (a FIFO or a device is
    refused, never waited on)."""
    return io._file_system.open(path, io._direct)  # noqa: SLF001 - same package


def _read_at(file: File, size: int, offset: int, io: IOHandle | None = None) -> bytes:
    """`size` bytes of `file` from `offset` (fewer at its end), read by the engine: faults can
    be injected there and its errors name the file."""
    if size == 0:
        return b""
    buf = bytearray(size)
    got = (io if io is not None else _engine._default_io()).pread(buf, file, offset)
    return bytes(memoryview(buf)[:got])


def _wait_for_replaced_files() -> None:
    """Wait until the files earlier saves replaced are freed."""
    _core.wait_for_replaced_files()


class _Writer:
    """Writes (tensor, file offset) pieces with the engine in groups of ~64 MiB submitted
    together, keeping at most `_STAGING_BYTES` of staged copies (of non-contiguous or GPU
    tensors) alive. ``finish()`` waits for everything and raises the first error."""

    def __init__(self, io: IOHandle, file: Any) -> None:
        self._io = io
        self._file = file
        self._group: list[tuple[Any, Any, int]] = []
        self._group_bytes = 0
        self._group_staged = 0
        self._inflight: collections.deque[tuple[IOFuture, int]] = collections.deque()
        self._inflight_staged = 0

    def add(self, data: Any, offset: int, staged: bool) -> None:
        """Queue the bytes of `data` (a contiguous CPU tensor or a buffer) for `offset`;
        `staged`: `data` is a copy made for this write (its memory counts against the bound)."""
        n = _nbytes(data) if hasattr(data, "element_size") else len(data)
        if n == 0:
            return
        self._group.append((data, self._file, offset))
        self._group_bytes += n
        if staged:
            self._group_staged += n
        if (self._group_bytes >= _format._GROUP_BYTES
                or self._group_staged >= _format._STAGING_BYTES // 2):
            self._flush()
        while self._inflight_staged > _format._STAGING_BYTES and self._inflight:
            self._wait_oldest()

    def _flush(self) -> None:
        if self._group:
            fut = self._io.pwrite_batch_async(self._group)
            self._inflight.append((fut, self._group_staged))
            self._inflight_staged += self._group_staged
            self._group, self._group_bytes, self._group_staged = [], 0, 0

    def _wait_oldest(self) -> None:
        fut, staged = self._inflight.popleft()
        self._inflight_staged -= staged
        fut.wait()

    def finish(self) -> None:
        self._flush()
        first: BaseException | None = None
        while self._inflight:
            try:
                self._wait_oldest()
            except OSError as e:
                first = first or e
        if first is not None:
            raise first

    def drain(self) -> None:
        """Wait for everything in flight, ignoring errors (the caller is already failing)."""
        self._group = []
        while self._inflight:
            try:
                self._wait_oldest()
            except OSError:
                pass


def _host_contiguous(t: Any) -> tuple[Any, bool]:
    """`t`'s values in a contiguous CPU tensor, and whether that needed a copy (a conjugate or
    negative view's storage holds other numbers than its values: resolved into a copy)."""
    if t.is_conj() or t.is_neg():
        return t.detach().to("cpu").resolve_conj().resolve_neg().contiguous(), True
    if t.device.type == "cpu" and t.is_contiguous():
        return t, False
    return t.detach().to("cpu").contiguous(), True
