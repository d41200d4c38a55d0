"""``torch.cuda.gds``'s API, backed by tensortier: code written for it runs with its import changed::

    from tensortier.compat.gds import GdsFile, gds_register_buffer, gds_deregister_buffer
    f = GdsFile("/nvme/t.bin", os.O_CREAT | os.O_RDWR)
    f.save_storage(t.untyped_storage(), offset=0)
    f.load_storage(u.untyped_storage(), offset=0)

Where torch's version needs GPUDirect Storage and fails without it, this one uses GDS where cuFile
accepts the file and tensortier's pinned bounce ring elsewhere; and it also takes CPU storages
(through the I/O engine). ``GdsFile.last_path`` says how the last transfer moved ("gds",
"bounce" or "host"). Errors raise ``OSError`` (errno, path, offset, length), ``ValueError`` or
``CudaError`` (a CUDA storage without a CUDA driver, naming what is missing).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from .. import _core
from ..io import IOHandle

__all__ = ["GdsFile", "gds_deregister_buffer", "gds_register_buffer"]

_lock = threading.Lock()
_handle: IOHandle | None = None
# data_ptr -> cuFile registration of a storage, from gds_register_buffer.
_registered: dict[int, Any] = {}


def _io() -> IOHandle:
    """The IOHandle every GdsFile shares (made on first use)."""
    global _handle
    with _lock:
        if _handle is None:
            _handle = IOHandle(gds="auto")
        return _handle


def _check_storage(storage: Any, what: str) -> None:
    import torch

    if not isinstance(storage, (torch.UntypedStorage, torch.TypedStorage)):
        raise TypeError(
            f"{what} needs a torch storage (tensor.untyped_storage()), not {type(storage).__name__}"
        )


def _as_tensor(storage: Any) -> Any:
    """A 1-D uint8 tensor over all of `storage` (no copy)."""
    import torch

    if isinstance(storage, torch.TypedStorage):
        storage = storage.untyped()
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


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
    cufile = _core.cufile()
    if s.device.type != "cuda" or s.nbytes() == 0 or not cufile["available"]:
        return
    if cufile["compat_mode_reason"]:  # no nvidia-fs: nothing DMAs into registered memory
        return
    address = int(s.data_ptr())
    with _lock:
        if address not in _registered:
            _registered[address] = _core.CuFileBuffer(address, int(s.nbytes()))


def gds_deregister_buffer(s: Any) -> None:
    """Undoes ``gds_register_buffer`` (a storage never registered is ignored). Deregisters now,
    with the GIL released, rather than whenever the registration object is collected."""
    _check_storage(s, "gds_deregister_buffer")
    with _lock:
        registration = _registered.pop(int(s.data_ptr()), None)
    if registration is not None:
        registration.release()


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
        if not isinstance(flags, int) or isinstance(flags, bool):
            raise TypeError(f"flags must be os.open flags (an int), not {type(flags).__name__}")
        self.filename = os.fspath(filename)
        self.flags = flags
        fd = os.open(self.filename, flags | os.O_CLOEXEC, 0o644)  # create/truncate as asked
        os.close(fd)
        writable = (flags & os.O_ACCMODE) != os.O_RDONLY
        io = _io()
        self._file: Any = io.open(self.filename, "r+" if writable else "r")
        # The cuFile registration (or the reason there is none), decided once per file.
        self._device_file: Any = None
        self.last_path = ""

    @property
    def fd(self) -> int:
        """The file's descriptor (torch's ``GdsFile.fd``; opened read-write when `flags` allow
        writing, and with O_DIRECT where the filesystem takes it). Closed by ``close()``."""
        if self._file is None:
            raise ValueError("GdsFile is closed")
        return int(self._file.fileno())

    @property
    def handle(self) -> Any:
        """The file's cuFile registration (torch's ``GdsFile.handle``), made on first use: an
        opaque object whose ``gds`` says whether GDS serves the file and ``gds_reason`` why not."""
        return self._cufile_handle()

    # torch's GdsFile registers the handle in __init__ and has these two to manage it.
    def register_handle(self) -> None:
        """Registers the file with cuFile now (otherwise done on the first CUDA transfer)."""
        self._cufile_handle()

    def deregister_handle(self) -> None:
        """Drops the cuFile registration (the next CUDA transfer registers again)."""
        self._device_file = None

    @property
    def gds(self) -> bool:
        """Whether CUDA transfers of this file go through GDS (registers on first use)."""
        return bool(self._cufile_handle().gds)

    @property
    def gds_reason(self) -> str:
        """Why GDS is not used ('' when it is)."""
        return str(self._cufile_handle().gds_reason)

    def load_storage(self, storage: Any, offset: int = 0) -> None:
        """Fills all of `storage` from the file at `offset`.

        Raises:
            OSError: I/O error, or the file ends before ``offset + storage.nbytes()`` (EIO).
        """
        self._transfer("read", storage, offset)

    def save_storage(self, storage: Any, offset: int = 0) -> None:
        """Writes all of `storage` to the file at `offset`."""
        self._transfer("write", storage, offset)

    def close(self) -> None:
        """Releases the registration and the file (also done when the object is collected)."""
        self._device_file = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "GdsFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ------------------------------------------------------------------------

    def _cufile_handle(self) -> Any:
        if self._file is None:
            raise ValueError("GdsFile is closed")
        if self._device_file is None:
            self._device_file = _core.DeviceFile(self._file, "auto")
        return self._device_file

    def _transfer(self, op: str, storage: Any, offset: int) -> None:
        _check_storage(storage, "load_storage" if op == "read" else "save_storage")
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise ValueError(f"offset must be a non-negative int, not {offset!r}")
        if self._file is None:
            raise ValueError("GdsFile is closed")
        tensor = _as_tensor(storage)
        nbytes = int(tensor.numel())
        io = _io()
        if tensor.device.type == "cuda":
            from ..device import device_buffer

            db = device_buffer(tensor)  # CudaError without a driver
            transfer = io._device_transfer()  # noqa: SLF001 - same package
            target = self._cufile_handle()
            if op == "read":
                result = transfer.read(target, offset, nbytes, db.address, db.device, db.stream)
            else:
                result = transfer.write(db.address, nbytes, target, offset, db.device, db.stream)
            moved = int(result["bytes"])
            self.last_path = str(result["stats"]["path"])
        else:
            if op == "read":
                moved = io.pread(tensor, self._file, offset)
            else:
                moved = io.pwrite(tensor, self._file, offset)
            self.last_path = "host"
        if moved != nbytes:
            import errno

            raise OSError(
                errno.EIO,
                f"load_storage: {self.filename} ends before offset {offset} + {nbytes} bytes "
                f"(read {moved})",
                self.filename,
            )
