"""The durable file a save writes (C++), through the engine."""

from __future__ import annotations

import os

from .. import _core
from ..io import IOHandle
from ._format import PathLike


class _DurableFile(_core.DurableFile):
    """A save's new file, which the C++ writers fill: ``commit()`` makes it the file at `path`,
    an exception in the ``with`` body (or no commit) removes it."""

    # False: the rename frees the replaced file, as before (bench/save_replace_cost.py's switch).
    _free_in_background = True

    def __init__(self, path: PathLike, io: IOHandle) -> None:
        super().__init__(os.fspath(path), io._direct, io._file_system,  # noqa: SLF001
                         self._free_in_background)
