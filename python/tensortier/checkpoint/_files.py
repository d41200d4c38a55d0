"""Where a checkpoint's bytes are when it is not a path: file objects (copied through anonymous
memory), and the one file an open descriptor names (so a header describes the bytes read)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

from ..io import File
from ._format import _T


# File objects are copied to and from temporary files this many bytes at a time.
_STREAM_CHUNK = 8 << 20


def _is_file_object(obj: Any, method: str) -> bool:
    """A file object given where a path may be (as torch.save/torch.load take them)."""
    return not isinstance(obj, (str, bytes, os.PathLike)) and callable(getattr(obj, method, None))


@contextlib.contextmanager
def _memfd_copy(stream: Any) -> Iterator[str]:
    """`stream` from its position to its end in anonymous memory, as a path the engine opens."""
    fd = os.memfd_create("tensortier-load", os.MFD_CLOEXEC)
    try:
        while True:
            chunk = stream.read(_STREAM_CHUNK)  # the caller's errors, as they are
            if not chunk:
                break
            view = memoryview(chunk)
            while view:
                try:
                    view = view[os.write(fd, view):]
                except OSError as e:
                    # The memory file's: say so (not a file of the caller's).
                    raise OSError(e.errno, f"{e.strerror}: copying the file object into "
                                  "memory to read it failed (a memory file is limited by "
                                  "memory and, as any file, by ulimit -f); load from a path "
                                  "instead") from e
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def _same_file(file: File, path: str, parse: Callable[[str], _T]) -> _T:
    """``parse(name)`` where `name` is the file `file` has open (its /proc/self/fd link), so
    that what is parsed is what is read even if `path` is replaced meanwhile; messages name
    `path`."""
    proc = f"/proc/self/fd/{file.fileno()}"
    if not os.path.exists(proc):
        return parse(path)
    try:
        return parse(proc)
    except (OSError, ValueError) as e:
        if proc not in str(e):
            raise
        if isinstance(e, OSError) and e.errno is not None:
            named = path if e.filename == proc else e.filename
            raise OSError(e.errno, (e.strerror or str(e)).replace(proc, path), named) from e
        if isinstance(e, OSError):
            raise OSError(str(e).replace(proc, path)) from e
        raise _renamed(e, str(e).replace(proc, path)) from e


def _renamed(e: ValueError, message: str) -> ValueError:
    """`e`'s type (code catches it) with `message`; a plain ValueError for types that need
    more than a message (``UnicodeDecodeError``)."""
    try:
        return type(e)(message)
    except TypeError:
        return ValueError(message)
