"""Extent maps: read a data set's files straight from their block device (the guide's "Extent
maps" page)."""

from __future__ import annotations

from typing import Any, Sequence

from .. import _core
from .._paths import fspath, PathArg
from .._buffers import host_buffer

ExtentMap = _core.ExtentMap
PathLike = PathArg

__all__ = [
    "ExtentMap",
    "ExtentReader",
    "build_extent_map",
    "load_extent_map",
    "read_files",
    "verify_extent_map",
]


def build_extent_map(
    root: PathLike,
    output: PathLike | None = None,
    *,
    files: Sequence[PathLike] | None = None,
    allow_refused: bool = False,
) -> ExtentMap:
    """Maps every regular file under `root` (or the `files` under it) to its extents on disk.

    Args:
        root: the data set's folder. Files are recorded relative to it.
        output: where to write the map as JSON (written durably), or None.
        files: map only these files (absolute, or relative to `root`) instead of walking it.
        allow_refused: files the filesystem cannot promise (unwritten, inline, encoded,
            encrypted, shared or sparse) are listed in ``map.refused`` instead of failing.

    Returns:
        The map: ``len(map)`` files, ``map.paths``, ``map.file(i)``, ``map.refused``.

    Raises:
        OSError: `root` cannot be walked or a file cannot be mapped (EOPNOTSUPP, naming the
            refused files, unless `allow_refused`).
        ValueError: a file of `files` is not under `root`, or is listed twice.
    """
    return _core.ExtentMap.build(root, files, allow_refused, output)


def load_extent_map(path: PathLike) -> ExtentMap:
    """Reads a map written by ``build_extent_map`` or ``tensortier extents build``.

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not a valid extent map (the message says where and why).
    """
    return _core.ExtentMap.load(fspath(path))


def verify_extent_map(extent_map: ExtentMap | PathLike) -> list[tuple[str, str]]:
    """Re-checks a map against the files (identity, then extents by FIEMAP).

    Returns:
        ``(path, what changed)`` for each file that no longer matches; empty when all do.
    """
    return list(ExtentMap.of(extent_map).verify())


class ExtentReader:
    """Reads files by an extent map from their block device (O_DIRECT, many in flight).

    Each file's identity is checked (stat by path) before and after its raw read, and its bytes
    against the map's checksum (XXH64) after it; a file that changed since the map was built, or
    whose blocks moved (online defragmentation, deduplication), is read through the filesystem
    instead. ``last_stats`` says how the last batch went.

    Args:
        extent_map: an ExtentMap, or the path of one (refused unless owned by this user or root
            and writable by nobody else: ``PermissionError``).
        backend, queue_depth, workers: engine settings (default: the environment's).
        verify_checksums: False skips the checksum check (and reads raw the files of an older
            map without checksums): only for files that never move, e.g. a read-only filesystem.

    Raises:
        ValueError: an extent of the map lies outside its filesystem's device.
        OSError: a disk cannot be opened for reading (EACCES: raw reads need read access to
            the block device, usually root), is no longer the disk the map names, or refuses
            O_DIRECT. The message names the device.
    """

    def __init__(
        self,
        extent_map: ExtentMap | PathLike,
        *,
        backend: str | None = None,
        queue_depth: int | None = None,
        workers: int | None = None,
        verify_checksums: bool = True,
    ) -> None:
        self.map = ExtentMap.of(extent_map)
        self._reader = _core.ExtentReader(self.map, backend, queue_depth, workers,
                                          bool(verify_checksums))
        self.last_stats: dict[str, Any] = {}

    def read(self, files: Sequence[int | PathLike], out: Sequence[Any] | None = None) -> list[Any]:
        """Reads a batch of files, all in flight together.

        Args:
            files: map indices or paths (absolute, or relative to the map's root).
            out: one writable buffer per file (numpy array, torch CPU tensor, bytearray), at
                least the file's size in the map; None makes numpy uint8 arrays.

        Returns:
            Per file, the buffer holding its bytes: the new array, or a view of the first
            `size` bytes of the given buffer (a numpy array or tensor sliced, else a
            memoryview).

        Raises:
            OSError: a read failed or a file vanished (naming it), or a changed file grew past
                its buffer (EFBIG).
            ValueError: a path not in the map, a buffer smaller than its file.
            IndexError: an index not in the map.
        """
        indices = [self.map.index_of(f) for f in files]
        if out is None:
            import numpy

            out = [numpy.empty(self.map.file(i)["size"], dtype=numpy.uint8) for i in indices]
        elif len(out) != len(indices):
            raise ValueError(f"{len(out)} buffers for {len(indices)} files")
        buffers = [host_buffer(b, writable=True) for b in out]
        sizes, self.last_stats = self._reader.read(
            [(i, b.address, b.nbytes) for i, b in zip(indices, buffers)]
        )
        return [_first_bytes(b, n) for b, n in zip(out, sizes)]

    @property
    def backend(self) -> str:
        """The engine backend the reader uses."""
        return str(self._reader.backend)


def _first_bytes(buffer: Any, n: int) -> Any:
    if hasattr(buffer, "reshape") and str(getattr(buffer, "dtype", "")).endswith("uint8"):
        flat = buffer.reshape(-1)
        return buffer if flat.shape[0] == n and buffer.ndim == 1 else flat[:n]
    return memoryview(buffer).cast("B")[:n]


def read_files(
    extent_map: ExtentMap | PathLike,
    files: Sequence[int | PathLike],
    out: Sequence[Any] | None = None,
) -> list[Any]:
    """Reads `files` by `extent_map` from the block device in one batch (see ExtentReader.read).

    Opens the disks for this call only: keep an ExtentReader to read many batches.
    """
    return ExtentReader(extent_map).read(files, out)
