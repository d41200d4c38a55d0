"""The durable file a save writes (C++), through the engine."""

from __future__ import annotations

import os

from .. import _core
from ..io import IOHandle
from ._format import PathLike


class _DurableFile:
    """A save's new file (``_core.DurableFile``), which the C++ writers fill: ``commit()``
    makes it the file at `path`, an exception in the ``with`` body (or no commit) removes it."""

    # False: the rename frees the replaced file, as before (bench/save_replace_cost.py's switch).
    _free_in_background = True

    def __init__(self, path: PathLike, io: IOHandle) -> None:
        self._core = _core.DurableFile(
            os.fspath(path), io._direct, io._file_system,  # noqa: SLF001 - same package
            self._free_in_background,
        )

    def commit(self) -> None:
        self._core.commit()

    def __enter__(self) -> "_DurableFile":
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is not None or not self._core.committed:
            self._core.abort()
