"""File paths as tensortier takes them: a Linux file name is bytes, and every public function
that takes a path accepts it as ``str`` (a name that is not UTF-8 as ``os.fsdecode`` gives it,
with surrogate escapes), ``bytes`` or ``os.PathLike``. Inside the package a path is a ``str``
(``os.fsdecode``), so paths given back (file lists, ``OSError.filename``) round-trip through
``os.fsencode``; the C++ core receives the raw bytes (bindings/paths.hpp)."""

from __future__ import annotations

import os
from typing import Any, Union

PathArg = Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]


def fspath(path: Any, what: str = "path", *, bytes_ok: bool = True) -> str:
    """`path` as a ``str`` that ``os.fsencode`` turns into its exact bytes.

    Args:
        path: a ``str``, ``bytes`` or ``os.PathLike``.
        what: the argument's name, for the error message.
        bytes_ok: ``False`` where the API this one copies refuses ``bytes`` paths.

    Raises:
        TypeError: `path` is none of the accepted types, naming them.
    """
    if isinstance(path, (str, bytes, os.PathLike)):
        p = os.fspath(path)
        if isinstance(p, str):
            return p
        if bytes_ok:
            return os.fsdecode(p)
    accepted = "str, bytes or os.PathLike" if bytes_ok else "str or os.PathLike"
    raise TypeError(f"{what} must be {accepted}, not {type(path).__name__}")
