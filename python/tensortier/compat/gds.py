"""``torch.cuda.gds``'s API, backed by tensortier: code written for it runs with its import changed.
The guide's compatibility page says where it goes further than torch's (CPU storages, a fallback
where GDS cannot serve the file) and how misuse is answered."""

from __future__ import annotations

import operator
import os
import threading
from typing import Any

from .. import _core
from ..device import device_buffer
from ..io import IOHandle

__all__ = ["GdsFile", "GdsIOError", "gds_deregister_buffer", "gds_register_buffer"]


class GdsIOError(OSError, RuntimeError):
    """A failed transfer: torch's GdsFile raises ``RuntimeError`` ("cuFileRead failed: ...");
    this is one, and an ``OSError`` with errno, path, offset and length as well."""

_lock = threading.Lock()
_handle: tuple[int, IOHandle] | None = None  # (the pid it was made in, the handle)
# The cuFile registrations of gds_register_buffer, by data_ptr.
_registered = _core.CuFileRegistrations()


def _io() -> IOHandle:
    """The IOHandle every GdsFile of this process shares (made on first use, and again in a
    child made by fork: a handle's threads do not follow a fork)."""
    global _handle
    with _lock:
        if _handle is None or _handle[0] != os.getpid():
            _handle = (os.getpid(), IOHandle(gds="auto"))
        return _handle[1]


def _check_storage(storage: Any, what: str) -> None:
    import torch

    if not isinstance(storage, (torch.UntypedStorage, torch.TypedStorage)):
        raise TypeError(f"{what} needs a torch storage (tensor.untyped_storage()), not "
                        f"{type(storage).__name__}")


def _index(value: Any, what: str) -> int:
    """`value` as an int where torch takes it as one (os.open, a pybind11 int64): anything
    with ``__index__`` (numpy and torch integers too), else TypeError."""
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what}, not {type(value).__name__}") from None


def gds_register_buffer(s: Any) -> None:
    """Registers a CUDA storage with cuFile so GDS can DMA to it without bouncing. Does nothing
    for CPU storages, where cuFile is unavailable or where it would run in its compatibility
    mode (transfers work either way). The registration is made (and later dropped) through the
    storage's own device's primary context, whichever device is current; it releases the GIL
    while cuFile works.

    Raises:
        TypeError: not a storage. CuFileError: cuFile is available but refuses the memory.
    """
    _check_storage(s, "gds_register_buffer")
    if s.device.type != "cuda":
        return
    _registered.add(int(s.data_ptr()), int(s.nbytes()))


def gds_deregister_buffer(s: Any) -> None:
    """Undoes ``gds_register_buffer`` (a storage never registered is ignored). Deregisters now,
    with the GIL released, rather than whenever the registration object is collected."""
    _check_storage(s, "gds_deregister_buffer")
    _registered.remove(int(s.data_ptr()))


class GdsFile:
    """A file for storage-sized transfers, as ``torch.cuda.gds.GdsFile``.

    Args:
        filename: the file.
        flags: ``os.open`` flags (``os.O_RDONLY``, ``os.O_CREAT | os.O_RDWR``, ...); ``O_CREAT``
            and ``O_TRUNC`` are honoured when the file is opened.

    Raises:
        OSError: the file cannot be opened with `flags`.
    """

    def __init__(self, filename: str | os.PathLike[str], flags: int) -> None:
        flags = _index(flags, "flags must be os.open flags (an int)")
        self.filename = os.fspath(filename)
        self.flags = flags
        # torch's GdsFile registers its handle here; ours (a DeviceFile: the cuFile registration
        # or the reason there is none) is made on first use, but the state is torch's.
        self._state = _core.GdsFileState(_io(), self.filename, flags, GdsIOError)
        self.last_path = ""

    @property
    def fd(self) -> int:
        """The file's descriptor (torch's ``GdsFile.fd``; opened read-write when `flags` allow
        writing, and with O_DIRECT where the filesystem takes it); -1 once closed, as torch's."""
        return self._state.fd

    @property
    def handle(self) -> Any:
        """The file's cuFile registration (torch's ``GdsFile.handle``), made on first use: an
        opaque object whose ``gds`` says whether GDS serves the file and ``gds_reason`` why not;
        None while not registered (after ``deregister_handle()`` or ``close()``), as torch's."""
        return self._state.handle

    # torch's GdsFile registers the handle in __init__ and has these two to manage it.
    def register_handle(self) -> None:
        """Registers the file with cuFile (torch's; ``__init__`` did it already).

        Raises:
            AssertionError: already registered (torch's message).
        """
        self._state.register_handle()

    def deregister_handle(self) -> None:
        """Drops the cuFile registration; transfers raise until ``register_handle()``.

        Raises:
            AssertionError: not registered (torch's message).
        """
        self._state.deregister_handle()

    @property
    def gds(self) -> bool:
        """Whether CUDA transfers of this file go through GDS (registers on first use)."""
        return bool(self._state.device_file().gds)

    @property
    def gds_reason(self) -> str:
        """Why GDS is not used ('' when it is)."""
        return str(self._state.device_file().gds_reason)

    def load_storage(self, storage: Any, offset: int = 0) -> None:
        """Fills `storage` from the file at `offset` (``storage.nbytes()`` bytes, or what the
        file holds from there: the rest of the storage stays as it was, as with torch's).

        Raises:
            GdsIOError: the read failed (a ``RuntimeError`` and an ``OSError``).
            AssertionError: the handle is not registered (closed, or deregistered).
        """
        self._transfer("read", storage, offset)

    def save_storage(self, storage: Any, offset: int = 0) -> None:
        """Writes all of `storage` to the file at `offset`.

        Raises:
            GdsIOError: the write failed (a ``RuntimeError`` and an ``OSError``).
            AssertionError: the handle is not registered (closed, or deregistered).
        """
        self._transfer("write", storage, offset)

    def close(self) -> None:
        """Deregisters the handle and closes the file (also done when the object is collected);
        a second call does nothing."""
        self._state.close()

    def __enter__(self) -> "GdsFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _transfer(self, op: str, storage: Any, offset: int) -> None:
        import torch

        what, verb = ("load_storage", "load data from") if op == "read" else (
            "save_storage", "save data to")
        self._state.require(verb)
        _check_storage(storage, what)
        offset = _index(offset, f"{what}: offset must be an int")
        # A 1-D uint8 tensor over all of the storage (no copy).
        untyped = storage.untyped() if isinstance(storage, torch.TypedStorage) else storage
        tensor = torch.empty(0, dtype=torch.uint8, device=untyped.device).set_(untyped)
        span = device_buffer if tensor.device.type == "cuda" else None
        self.last_path = self._state.transfer(op, _io(), tensor, offset, span)
