"""TensorNVMe's Python API: ``from tensortier.compat.tensornvme import DiskOffloader``, and
``AsyncFileWriter`` (TensorNVMe's ``tensornvme.async_file_io``). Code written for ``tensornvme``
runs with only its import changed, the errors it catches included: the guide's Compatibility
modules page says what each call raises. ``tensortier.DiskOffloader`` is the lenient offloader.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

from .. import _core
from .. import offload as _offload
from .._owners import NotCopyable
from ..io import IOHandle

__all__ = [
    "AsyncFileWriter",
    "BackendUnavailableError",
    "DiskOffloader",
    "UnsupportedBackendError",
    "WriteRefusedError",
    "get_backends",
]

#: A backend TensorNVMe does not know: its ``DiskOffloader`` asserts (``AssertionError``), its
#: C++ raises ``RuntimeError`` ("Unsupported backend: ..."); this is both.
UnsupportedBackendError = _core.UnsupportedBackendError


class BackendUnavailableError(OSError, RuntimeError):
    """A backend named to the constructor does not start here (the kernel refuses io_uring
    under a container's seccomp profile, say): TensorNVMe's ``RuntimeError`` ("Backend ... is
    not install correctly"), and an ``OSError`` with the kernel's errno."""


class WriteRefusedError(ValueError, RuntimeError):
    """A tensor that cannot be offloaded (its storage cannot be resized, as numpy's; it is not
    in CPU or CUDA memory; it is part of a larger storage): where
    TensorNVMe fails it does so with ``RuntimeError`` (from torch, or its "Tensor must be
    contiguous and on cpu"); tensortier's offloader with ``ValueError``. This is both, and
    nothing was written."""


def get_backends() -> set[str]:
    """The backends that work on this machine, by TensorNVMe's names (``uring``, ``aio``,
    ``pthread``); each is verified with a round trip in the temporary directory."""
    return set(_core.tensornvme_backends(tempfile.gettempdir()))


class DiskOffloader(_offload.DiskOffloader):
    """TensorNVMe's ``DiskOffloader(dir_name, n_entries=16, backend=...)``: see the guide.
    Takes the arguments of ``tensortier.DiskOffloader``."""

    def __init__(
        self,
        dir_name: Any,
        n_entries: int = 16,
        backend: str = "auto",
        **kwargs: Any,
    ) -> None:
        # TensorNVMe's checks; a path `dir_name` is made as TensorNVMe makes it.
        entries, backend = _core.tensornvme_offloader_arguments(dir_name, n_entries, backend)
        with _starting(backend):
            super().__init__(dir_name, entries, backend, **kwargs)
        # The tensors of each write call, as TensorNVMe keys them (a later write of one of them
        # makes its old group unreadable, as TensorNVMe's key would no longer be its).
        self._groups = _core.TensorGroups()

    # ---- internals ------------------------------------------------------------------------

    def _call(self, what: str, given: Any, callback: Callable[[], None] | None = None) -> None:
        """TensorNVMe's call `what`, its arguments checked as its binding checks them before
        anything moves: a tensor is read back by the kind of call that wrote it."""
        _core.check_callback(callback)  # as pybind, before all else
        vector, write = what.endswith("v"), "write" in what
        tensors = _core.tensornvme_tensors(what, given)
        with self._lock:
            self._open()  # closed: said so, before a read would say its tensor is not found
            if write:
                # Remembered first: Ctrl-C once the write started must not leave it unreadable.
                known = self._groups.matches(tensors, vector)
                self._groups.remember(tensors, vector)
                try:
                    keys = self._write(_core.tensornvme_moved(tensors), callback, supersede=True)
                except ValueError as e:
                    if not known:  # refused: nothing was written under this group
                        self._groups.forget(tensors, vector)
                    raise WriteRefusedError(f"{what}: {e}") from e
            elif not (self._groups.matches(tensors, vector)
                      and (readable := self._still_offloaded(tensors))):
                raise RuntimeError(
                    "Read error, tensor not found"
                    + (" (read a vector with the tensors, in the order, of its write)"
                       if vector else "")
                )
            else:
                try:
                    keys = self._read(_core.tensornvme_moved(readable), callback)
                except ValueError as e:  # its memory was replaced: TensorNVMe's size check
                    raise RuntimeError(f"Read error, tensor shape mismatch: {e}") from e
                self._groups.forget(tensors, vector)  # TensorNVMe's read takes its key
        if what.startswith("sync"):  # only its own tensors: async ones are left to their waits
            self._wait("write" if write else "read", keys)


    def _still_offloaded(self, tensors: list[Any]) -> list[Any]:
        """Those of a group's `tensors` to read back: all of them, when all are offloaded and
        not being read; where some were read back by another group of a later write (a tensor
        in two vectors), the others, which only this group's read brings back; else none."""
        if self._entries.readable(tensors):
            return tensors
        left = [t for t in tensors if self._entries.readable([t])]
        back = all(self._entries.readable([t]) or t.untyped_storage().nbytes() > 0
                   for t in tensors)
        return left if back else []


@contextlib.contextmanager
def _starting(backend: str) -> Iterator[None]:
    """Starting an engine on `backend` (the engine's name): an OSError is TensorNVMe's error
    when the backend does not start here, else itself (the directory's failure, say)."""
    try:
        yield
    except OSError as e:
        if _core.backend_starts(backend, tempfile.gettempdir()):
            raise
        raise BackendUnavailableError(
            e.errno, f"Backend {_core.tensornvme_backend_name(backend)!r} is not install "
            f"correctly: {e.strerror or e}" + (f": {e.filename!r}" if e.filename else "")
        ) from e


# ---- tensornvme.async_file_io -------------------------------------------------------------


class _AsyncFileWriterCore(_core.TensorNvmeWriter):
    """TensorNVMe's C++ ``AsyncFileWriter`` (``tensornvme._C``) on tensortier's engine: writes
    at given offsets of an open file descriptor; ``synchronize()`` waits for them and then runs
    their callbacks, in order."""

    def __init__(self, fd: int, n_entries: int, backend: str = "aio", n_tasks: int = 0) -> None:
        depth, backend, workers = _core.tensornvme_writer_arguments(fd, n_entries, backend,
                                                                   n_tasks)
        with _starting(backend):
            io = IOHandle(backend, queue_depth=depth, workers=workers)
        super().__init__(io, fd)

    def write_tensor(self, tensor: Any, offset: int, callback: Callable[[], None] | None = None,
                     pinned: Any = None) -> None:
        """Starts writing `tensor`'s values at `offset`. A CUDA tensor is copied to the host
        first (into `pinned` when given), before this returns."""
        import torch

        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"write_tensor() takes a torch.Tensor, not {type(tensor).__name__}")
        if tensor.is_cuda:
            tensor = tensor.to("cpu") if pinned is None else pinned.copy_(tensor)
        self._start(tensor.contiguous(), offset, callback)


class AsyncFileWriter(NotCopyable):
    """TensorNVMe's ``tensornvme.async_file_io.AsyncFileWriter``, as ColossalAI's asynchronous
    checkpoint saving uses it: ``write`` appends bytes, ``write_raw`` writes memory at an
    offset, ``write_tensor`` appends a tensor (a CUDA one through `pinned`); all of them start
    the write and return, ``synchronize()`` waits for every write.

    The file is opened as TensorNVMe opens it (created with mode 0664 if missing, never
    truncated), `backend` takes TensorNVMe's names (``aio`` by default;
    ``TENSORNVME_BACKEND`` takes its place when set). Differences, on the side of safety: a
    write that fails raises ``OSError`` from ``synchronize()`` (TensorNVMe ignores it); a
    CUDA tensor is copied to the host before ``write_tensor`` returns (``sync_before_step()``
    has nothing left to wait for, whatever ``register_h2d`` was told: TensorNVMe's ``pthread``
    backend blocks for good when fewer tensors than told were written, or more); ``write``
    takes any bytes-like object (TensorNVMe: ``bytes``); a non-contiguous tensor is written as
    its values in order; it runs without CUDA (TensorNVMe's makes a CUDA stream and fails).
    Errors name the file: its path when the writer was made (where it is now if renamed).
    """

    _owned = "its file's descriptor"

    def __init__(
        self, path: str, n_entries: int = 16, backend: str | None = None, n_tasks: int = 0
    ) -> None:
        import torch

        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT, mode=0o664)
        try:
            self.io = _AsyncFileWriterCore(
                self.fd, n_entries, "aio" if backend is None else backend, n_tasks)
        except BaseException:
            os.close(self.fd)
            del self.fd
            raise
        self.offset = 0
        # Each write's source, kept alive until its write is done.
        self.buffers: list[Any] = []
        # TensorNVMe copies CUDA tensors on a stream of its own; without CUDA there is none.
        self.comm_stream = torch.cuda.Stream() if torch.cuda.is_available() else None

    def write(self, data: bytes) -> int:
        """Starts writing `data` at the writer's offset, which moves past it; returns its
        length in bytes."""
        if isinstance(data, str):
            raise TypeError("write() takes bytes, not str")
        nbytes = memoryview(data).nbytes
        self.io._start(data, self.offset, self._keep(data))  # noqa: SLF001 - its own engine
        self.offset += nbytes
        return nbytes

    def write_raw(self, py_ref: object, buffer: int, n_bytes: int, offset: int) -> None:
        """Starts writing `n_bytes` from address `buffer` at `offset`, keeping `py_ref` (the
        memory's owner) alive until done; the writer's offset moves by `n_bytes`."""
        self.io.write(buffer, n_bytes, offset, self._keep(py_ref))
        self.offset += n_bytes

    def write_tensor(self, tensor: Any, pinned: Any = None) -> None:
        """Starts writing `tensor` at the writer's offset, which moves past it. A CUDA tensor
        is copied to host memory first (into `pinned`, a pinned tensor of its size, when
        given)."""
        import torch

        with torch.cuda.stream(self.comm_stream):
            self.io.write_tensor(tensor, self.offset, self._keep(tensor), pinned)
            self.offset += tensor.numel() * tensor.element_size()

    def _keep(self, source: Any) -> Callable[[], None]:
        """Keeps a write's `source` alive until its callback drops it (TensorNVMe's)."""
        self.buffers.append(source)
        return partial(AsyncFileWriter.gc_callback, self.buffers, len(self.buffers) - 1)

    def register_h2d(self, num_tensors: int) -> None:
        """How many ``write_tensor`` calls ``sync_before_step()`` waits for (TensorNVMe)."""
        _core.unsigned_argument(num_tensors, "num_tensors")  # each copy ends in its write_tensor

    def sync_before_step(self) -> None:
        """Returns once the tensors given to ``write_tensor`` may change."""

    @staticmethod
    def gc_callback(listt: list[Any], idx: int) -> None:
        """Drops the writer's reference to a write's source once it is written."""
        listt[idx] = None

    def flush(self) -> None:
        """Does nothing, as TensorNVMe's (``synchronize()`` waits for the writes)."""

    def synchronize(self) -> None:
        """Waits for every write started; raises the first write's ``OSError``."""
        self.io.synchronize()
        self.buffers.clear()

    def register_tasks(self, num_tasks: int) -> None:
        """Accepted (TensorNVMe counts tasks for its debug log only)."""
        _core.unsigned_argument(num_tasks, "num_tasks")

    def __del__(self) -> None:
        if not hasattr(self, "fd"):
            return
        try:
            if hasattr(self, "io"):
                try:
                    if not self.io._forked:  # a forked child's writes are the parent's
                        self.synchronize()
                finally:
                    self.io.close()
        finally:
            os.close(self.fd)
            del self.fd
