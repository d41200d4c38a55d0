"""Park tensors in files to free their memory and bring them back: TensorNVMe's ``DiskOffloader``.
The guide is docs/offload.md (GPU tensors: docs/gpu.md)."""

from __future__ import annotations

import atexit
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from . import _core
from ._owners import NotCopyable
from ._paths import fspath, PathArg
from .device import device_buffer, DeviceBuffer

__all__ = ["DiskOffloader", "OffloadedDataLostWarning"]


class OffloadedDataLostWarning(UserWarning):
    """A DiskOffloader was closed, or collected, with tensors still offloaded: their data is
    gone. A UserWarning (shown by default), not a ResourceWarning (hidden by default): the
    data was the user's."""


class DiskOffloader(NotCopyable):
    """Offloads CPU and CUDA tensors to files in one or several directories.

    Args:
        dir_name: directory for the backing files (created if missing), or a list of directories
            (one per drive): tensors of at least `stripe_threshold` bytes are striped over all.
        n_entries: requests in flight per worker ring (TensorNVMe's queue size).
        backend: ``"auto"``, ``"io_uring"``, ``"libaio"`` or ``"threads"`` (TensorNVMe's
            ``"uring"``, ``"aio"`` and ``"pthread"`` also work).
        pin_memory: restore tensors into pinned (page-locked) memory, so a following copy to the
            GPU is fast. Needs CUDA.
        stripe_threshold: smallest tensor, in bytes, striped over several directories.
        gds: how CUDA tensors reach the files: ``"off"`` (the pinned bounce ring), ``"auto"``
            (GPUDirect Storage where cuFile takes a backing file and is not in its
            compatibility mode, else the ring) or ``"on"`` (cuFile, or the operation fails);
            default ``$TENSORTIER_GDS``, else ``"off"``. ``device_bytes`` says which ran.

    CUDA tensors move through rings of pinned bounce buffers made on the first one (one ring per
    directory and at least two: transfers at once; each ``TENSORTIER_BOUNCE_SLOTS`` x
    ``TENSORTIER_BOUNCE_SLOT_SIZE`` bytes, 64 MiB by default; ``TENSORTIER_BOUNCE_RINGS`` sets
    how many), kept until ``close()``. An
    asynchronous write reads the tensor while it runs, after the work queued on its current
    stream before the call: do not change the tensor until the write is waited for.

    Backing files are named ``tensortier-offload-<pid>-...bin`` and are removed by ``close()``,
    at context-manager exit and at interpreter exit; files of dead processes are removed by the
    next offloader on the directory.
    """

    _owned = "its files and the tensors offloaded to them"

    def __init__(
        self,
        dir_name: PathArg | Sequence[PathArg],
        n_entries: int = 16,
        backend: str = "auto",
        *,
        pin_memory: bool = False,
        stripe_threshold: int = 16 << 20,
        gds: str | None = None,
        _device_copier: str = "cuda",
    ) -> None:
        dirs = _core.offload_directories(dir_name)  # absolute (TypeError, ValueError)
        gds = _core.gds_mode(gds)
        if pin_memory:
            import torch

            if not torch.cuda.is_available():
                raise ValueError("pin_memory=True needs a CUDA device, and "
                                 "torch.cuda.is_available() is False")
        # The TENSORTIER_BOUNCE_* variables are checked now, not at the first CUDA tensor.
        _core.device_transfer_options()
        # backend, n_entries and stripe_threshold (ValueError or TypeError naming them), before
        # anything is made on disk.
        _core.check_offloader_arguments(backend, n_entries, stripe_threshold)
        _core.make_directories(dirs)  # as os.makedirs; NotADirectoryError for a file
        self._core: _core.Offloader | None = _core.Offloader(
            dirs, backend, n_entries, stripe_threshold
        )
        self._pid, self._pin = os.getpid(), pin_memory
        self._device = _core.OffloadDevice(self._core, gds, self._core.bounce_rings, _device_copier)
        self._lock = threading.RLock()
        self._entries = _core.OffloadEntries(self._core, weakref.WeakMethod(self._forget))
        _live.add(self)

    # ---- TensorNVMe's API -----------------------------------------------------------------

    def sync_write(self, tensor: Any) -> None:
        """Writes `tensor` to disk, then frees its memory (its shape and dtype stay). As with
        TensorNVMe, asynchronous writes of other tensors are left to their wait."""
        self._call("sync_write", tensor)

    def sync_read(self, tensor: Any) -> None:
        """Restores the memory and data of an offloaded `tensor` (asynchronous reads of other
        tensors are left to their wait)."""
        self._call("sync_read", tensor)

    def sync_writev(self, tensors: Sequence[Any]) -> None:
        """Writes several tensors in one submission, then frees their memory."""
        self._call("sync_writev", tensors)

    def sync_readv(self, tensors: Sequence[Any]) -> None:
        """Restores several offloaded tensors in one submission (any order works; TensorNVMe
        needs the order they were written in)."""
        self._call("sync_readv", tensors)

    def async_write(self, tensor: Any, callback: Callable[[], None] | None = None) -> None:
        """Starts writing `tensor`; its memory is freed when ``sync_write_events()`` or
        ``synchronize()`` sees the write done, after which `callback` runs. An I/O error, out
        of space included, is raised by that wait on every filesystem, never by this call."""
        self._call("async_write", tensor, callback)

    def async_read(self, tensor: Any, callback: Callable[[], None] | None = None) -> None:
        """Allocates `tensor`'s memory and starts reading its data into it; the data is there
        once ``sync_read_events()`` or ``synchronize()`` returns, after which `callback` runs."""
        self._call("async_read", tensor, callback)

    def async_writev(
        self, tensors: Sequence[Any], callback: Callable[[], None] | None = None
    ) -> None:
        """``async_write`` of several tensors in one submission."""
        self._call("async_writev", tensors, callback)

    def async_readv(
        self, tensors: Sequence[Any], callback: Callable[[], None] | None = None
    ) -> None:
        """``async_read`` of several tensors in one submission."""
        self._call("async_readv", tensors, callback)

    def sync_write_events(self) -> None:
        """Waits for every write in flight; frees the memory of the tensors written. Raises the
        first error (``OSError``); the tensors whose write failed keep their memory and data."""
        self._wait("write")

    def sync_read_events(self) -> None:
        """Waits for every read in flight. Raises the first error (``OSError``); the tensors whose
        read failed stay offloaded (memory freed again, data still on disk)."""
        self._wait("read")

    def synchronize(self) -> None:
        """Waits for all writes, then all reads; raises the first error after both."""
        error: BaseException | None = None
        for kind in ("write", "read"):
            try:
                self._wait(kind)
            except Exception as e:  # noqa: BLE001 - OSError, CudaError...: raised below
                error = error or e
        if error is not None:
            raise error

    # ---- tensortier additions -------------------------------------------------------------

    @property
    def backend(self) -> str:
        """The I/O backend in use."""
        return self._open().backend

    @property
    def paths(self) -> list[str]:
        """The backing files."""
        return list(self._open().paths)

    @property
    def stored_bytes(self) -> int:
        """Bytes of tensor data parked on disk."""
        with self._lock:
            self._entries.drain()
            return int(self._open().stored_bytes)

    @property
    def file_bytes(self) -> int:
        """Bytes the backing files span now (space is reused after reads; the free tail is given
        back when idle, or by ``trim()``)."""
        return int(self._open().file_bytes)

    @property
    def device_bytes(self) -> dict[str, int]:
        """Bytes of device tensors moved so far, by how they moved: ``"gds"`` (cuFile, for every
        part of a tensor) or ``"bounce"`` (the pinned ring, for at least one part), counted when
        their operations are waited for."""
        with self._lock:
            return dict(self._device.device_bytes)

    def trim(self) -> None:
        """Gives the freed space at the ends of the backing files back to the filesystem now.
        The offloader does it by itself in the background once idle for a second; truncating is
        slow on some filesystems, and space freed by reads is often needed by the next writes."""
        with self._lock:
            self._entries.drain()
            self._open().trim()

    def is_offloaded(self, tensor: Any) -> bool:
        """Whether `tensor`'s data is parked here (written, not yet read back)."""
        with self._lock:
            return self._entries.is_offloaded(tensor)

    def close(self) -> None:
        """Waits for operations in flight (their callbacks do not run, their errors are not
        raised), then removes the backing files. A write not yet waited for is cancelled once
        done: its tensor keeps its memory and data, as ``is_offloaded()`` said; a read not yet
        waited for gives its tensor its data. The data of tensors still offloaded (written and
        waited for, not read back) is lost, and an ``OffloadedDataLostWarning`` says how many.
        In a child made by fork() it only lets go: the files, the data and the operations are
        the parent's."""
        if os.getpid() != self._pid:
            # A fork's child: no lock (a parent's thread may have held it), no wait, no file
            # removed (the C++ offloader leaves them in another process).
            self._device.forget()
            self._let_go()
            return
        with self._lock:
            if self._core is None:
                return
            message = self._entries.closing(self._device)
            self._let_go()
        if message is not None:
            warnings.warn(message, OffloadedDataLostWarning, stacklevel=2)

    def __enter__(self) -> "DiskOffloader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown may have torn down modules
            pass

    # ---- internals ------------------------------------------------------------------------

    def _call(self, what: str, given: Any, callback: Callable[[], None] | None = None) -> None:
        kind = "write" if "write" in what else "read"
        tensors = list(given) if what.endswith("v") else [given]
        keys = (self._write if kind == "write" else self._read)(tensors, callback)
        if what.startswith("sync"):
            self._wait(kind, keys)

    def _open(self) -> _core.Offloader:
        if self._core is None:
            raise ValueError("DiskOffloader is closed")
        if os.getpid() != self._pid:
            raise ValueError(
                f"this DiskOffloader was made in process {self._pid}; in process {os.getpid()}, "
                "a child made by fork(), its files and threads are the parent's: make a new "
                "DiskOffloader in the child"
            )
        return self._core

    def _let_go(self) -> None:
        core, self._core = self._core, None
        if core is None:
            return
        self._device.close()
        core.close()
        self._entries.clear()

    def _forget(self) -> None:
        # Called after a death is queued, by any thread's collection, maybe amid code holding
        # the lock: never block then; the next call that takes the lock drains it.
        if self._lock._is_owned() or not self._lock.acquire(blocking=False):  # type: ignore
            return
        try:
            self._entries.drain()
        finally:
            self._lock.release()

    def _write(self, tensors: list[Any], callback: Callable[[], None] | None,
               supersede: bool = False) -> list[int]:
        """Returns the keys whose writes free the memory. With `supersede` (TensorNVMe's rule) a
        tensor being written is written again: the later write is the one read back."""
        _core.check_callback(callback)
        with self._lock:
            self._open()
            self._entries.drain()
            superseded = self._entries.check_write(tensors, supersede)  # TypeError, ValueError
            if superseded is None:  # a tensor being read: its read first
                self._settle("read")
                superseded = self._entries.check_write(tensors, supersede)
            _refuse_others(self, tensors)
            keys = self._entries.new_keys(len(tensors))
            device = self._device.route(tensors)
            spans = [_span(t) if d else None for t, d in zip(tensors, device)]  # CudaError
            host = _host_pieces(keys, tensors, device)
            # Started and recorded by one C++ call: Ctrl-C cannot leave a write running that
            # nothing records, on memory nothing keeps alive.
            self._entries.start_writes(host, self._device, spans, keys, tensors, callback,
                                       superseded)
            return keys + superseded

    def _read(self, tensors: list[Any], callback: Callable[[], None] | None) -> list[int]:
        _core.check_callback(callback)
        with self._lock:
            self._open()  # refused once closed
            self._entries.drain()
            keys = self._entries.read_keys(tensors, False)
            if keys is None:  # a tensor being written: its write first
                self._settle("write")
                keys = self._entries.read_keys(tensors, True)
            device = self._device.route(tensors)
            spans: list[Any] = []
            try:
                # The memory is allocated here, on the caller's thread and stream, while the
                # data is still on disk: out of memory leaves it offloaded.
                for k, t, d in zip(keys, tensors, device):
                    if not d and self._pin and self._entries.holds(k, t):
                        self._allocate_pinned(k, t)
                    else:
                        _resize(t.untyped_storage(), t.nbytes)
                    spans.append(_span(t) if d else None)  # CudaError without a driver
                host = _host_pieces(keys, tensors, device)
            except BaseException:  # nothing started: the data stays offloaded
                for t in tensors:
                    _resize(t.untyped_storage())
                raise
            try:
                # Started and recorded by one C++ call: Ctrl-C after the reads started cannot
                # have their memory freed under them, nor leave them unrecorded, nor record
                # reads that never started.
                self._entries.start_reads(host, self._device, spans, keys, tensors, callback)
            except Exception:
                # Refused. A tensor whose read had started and ended whole is read back (its
                # copy on disk is gone); the others stay offloaded, their memory freed.
                for t in tensors:
                    if self._entries.find(t) is not None:
                        _resize(t.untyped_storage())
                raise
            return keys

    def _allocate_pinned(self, key: int, tensor: Any) -> None:
        """A new pinned storage for `tensor` (the tensor written: another tensor of the storage
        would take the data from it), watched instead of the old one."""
        import torch

        memory = torch.empty(tensor.nbytes, dtype=torch.uint8, pin_memory=True)
        # The old storage may die inside set_(): its death is not the entry's.
        self._entries.unwatch_storage(key)
        try:
            with torch.no_grad():
                tensor.set_(memory.untyped_storage(), 0, tensor.shape, tensor.stride())
        except RuntimeError:
            # torch refuses (an inference tensor outside inference mode): the read fills the
            # storage in place, unpinned.
            _resize(tensor.untyped_storage(), tensor.nbytes)
        finally:
            self._entries.watch_storage(key, tensor.untyped_storage())

    def _wait(self, kind: str, keys: Sequence[int] | None = None) -> None:
        error = self._entries.deliver(kind, *self._collect(kind, keys=keys), keys is None)
        if error is not None:
            raise error

    def _settle(self, kind: str) -> None:
        """A wait for a call of the other kind; the errors are kept for the next wait of `kind`:
        other tensors' failures are not this call's."""
        interrupt = self._entries.hold(kind, *self._collect(kind))
        if interrupt is not None:
            raise interrupt

    def _collect(
        self, kind: str, keys: Sequence[int] | None = None
    ) -> tuple[list[BaseException], list[Callable[[], None]]]:
        with self._lock:
            if self._core is None:
                return [], []
            self._open()  # a child made by fork(): raises (the operations are the parent's)
            return self._entries.collect(self._device, kind, keys)


def _resize(storage: Any, nbytes: int = 0) -> None:
    """Resized only if its size differs: a zero-size tensor's storage may not be resizable."""
    if storage.nbytes() != nbytes:
        storage.resize_(nbytes)


def _host_pieces(keys: list[int], tensors: list[Any], device: list[bool]) -> list[Any]:
    return [(k, t.data_ptr(), t.nbytes) for k, t, d in zip(keys, tensors, device) if not d]


def _span(tensor: Any) -> DeviceBuffer:
    """For CPU tensors (the memcpy test copier): host memory and no stream."""
    if tensor.device.type != "cuda":
        return DeviceBuffer(int(tensor.data_ptr()), tensor.nbytes, 0, None, tensor)
    return device_buffer(tensor, own_stream=True)


_live: "weakref.WeakSet[DiskOffloader]" = weakref.WeakSet()


def _refuse_others(mine: DiskOffloader, tensors: list[Any]) -> None:
    """ValueError for a tensor another live offloader holds (its write may still run, before it
    frees the memory): two offloaders taking one tensor would each read back their own copy."""
    for other in list(_live):
        entries = getattr(other, "_entries", None)
        if other is mine or entries is None:
            continue
        for t in tensors:
            if entries.find(t) is not None:
                raise ValueError(
                    f"tensor of shape {tuple(t.shape)} is offloaded by another DiskOffloader "
                    "(its write may still run): read it back through that one first")


def _fresh_locks_after_fork() -> None:
    # A thread of the parent may have held an offloader's lock at the fork: the child's copy
    # would be held for good, and close() (atexit included) or any call would hang instead of
    # letting go or raising.
    for offloader in list(_live):
        offloader._lock = threading.RLock()  # noqa: SLF001


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_locks_after_fork)


@atexit.register
def _close_all() -> None:
    for offloader in list(_live):
        offloader.close()


def remove_stale_files(directories: PathArg | Iterable[PathArg]) -> int:
    """Removes backing files left in `directories` (one directory, or several) by processes
    that no longer run; returns how many. Offloaders do this for their own directories when
    they start."""
    if isinstance(directories, (str, bytes, os.PathLike)):
        directories = [directories]  # one directory, not the characters of its name
    return sum(int(_core.remove_stale_offload_files(fspath(d, "directories"))) for d in directories)
