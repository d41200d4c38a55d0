"""File paths as tensortier takes them: ``str``, ``bytes`` or ``os.PathLike`` (see the guide's
I/O page); inside the package a ``str`` that ``os.fsencode`` turns into its exact bytes."""

from __future__ import annotations

import os
from typing import Union

from . import _core

PathArg = Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]
fspath = _core.fspath  # its rule: bindings/paths.cpp
