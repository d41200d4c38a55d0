"""Park tensors in files to free their memory and bring them back: TensorNVMe's ``DiskOffloader``.
The guide is docs/offload.md (GPU tensors: docs/gpu.md)."""

from __future__ import annotations

import atexit
import collections
import errno
import itertools
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from . import _core
from ._notes import add_note
from ._offloaded import (
    _check_callback, _check_distinct, _check_tensor, _Entry, _facts, _host_pieces,
    _require_preserved_storages, _resize, _run_callbacks, _span,
)
from ._paths import fspath, PathArg

__all__ = ["DiskOffloader", "OffloadedDataLostWarning"]


class OffloadedDataLostWarning(UserWarning):
    """A DiskOffloader was closed, or collected, with tensors still offloaded: their data is
    gone. A UserWarning (shown by default), not a ResourceWarning (hidden by default): the
    data was the user's."""


class DiskOffloader:
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
        if isinstance(dir_name, (str, bytes, os.PathLike)):
            dir_name = [dir_name]
        elif not isinstance(dir_name, Iterable):
            raise TypeError(
                "dir_name must be a path (str, bytes or os.PathLike) or a list of paths, not "
                f"{type(dir_name).__name__}"
            )
        dirs = [os.path.abspath(fspath(d, "dir_name")) for d in dir_name]
        if not dirs:
            raise ValueError("DiskOffloader needs at least one directory")
        gds = _core.gds_mode(gds)
        if pin_memory:
            import torch

            if not torch.cuda.is_available():
                raise ValueError("pin_memory=True needs a CUDA device, and "
                                 "torch.cuda.is_available() is False")
        # The TENSORTIER_BOUNCE_* variables are checked now, not at the first CUDA tensor.
        _core.device_transfer_options()
        for d in dirs:
            if os.path.exists(d) and not os.path.isdir(d):
                # makedirs would say "File exists", which reads as if all were well.
                raise NotADirectoryError(errno.ENOTDIR, "dir_name is not a directory", d)
            os.makedirs(d, exist_ok=True)
        # Checks backend, n_entries and stripe_threshold (ValueError or TypeError naming them).
        self._core: _core.Offloader | None = _core.Offloader(
            dirs, backend, n_entries, stripe_threshold
        )
        self._pid, self._pin = os.getpid(), pin_memory
        # "memcpy" (tests): CPU tensors take the device path, copied by memcpy (no GPU needed).
        self._device_copier = _device_copier
        # The bounce rings (one per directory at least: the parts of a striped tensor move at
        # once) and the device operations in flight.
        rings = None if _core.setting_is_set("TENSORTIER_BOUNCE_RINGS") else max(2, len(dirs))
        self._device = _core.OffloadDevice(self._core, gds, rings, _device_copier)
        self._lock = threading.RLock()
        # Errors of operations of one kind that a call of the other kind waited for (a read of
        # a tensor being written), and of their callbacks: raised by the next wait of the kind.
        self._undelivered: dict[str, tuple[list[BaseException], list[BaseException]]] = {
            "write": ([], []), "read": ([], [])}
        self._forgotten: collections.deque[tuple[int, str, int]] = collections.deque()
        self._by_id: dict[int, _Entry] = {}  # by id() of the tensor given
        self._by_storage: dict[int, _Entry] = {}  # by id() of its storage
        self._by_key: dict[int, _Entry] = {}
        self._keys = itertools.count(1)
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
            self._drain_forgotten()
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
            self._drain_forgotten()
            self._open().trim()

    def is_offloaded(self, tensor: Any) -> bool:
        """Whether `tensor`'s data is parked here (written, not yet read back)."""
        import torch

        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
            return False
        with self._lock:
            entry = self._lookup(tensor)
            return entry is not None and entry.state != "writing"

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
            self._undelivered = {"write": ([], []), "read": ([], [])}
            self._let_go()
            return
        with self._lock:
            if self._core is None:
                return
            failed = 0
            for kind in ("write", "read"):
                errors = self._collect(kind, cancel_writes=True)[0]
                failed += len(errors) + len(self._undelivered[kind][0])
                self._undelivered[kind] = ([], [])
            lost = sum(1 for e in self._by_key.values() if e.state == "stored")
            self._let_go()
        failures = f"{failed} operation(s) not waited for had failed" if failed else ""
        if lost:
            warnings.warn(
                f"DiskOffloader closed with {lost} tensor(s) still offloaded; their data is gone"
                + (f" ({failures})" if failures else ""), OffloadedDataLostWarning, stacklevel=2)
        elif failures:
            warnings.warn(f"DiskOffloader closed: {failures}", OffloadedDataLostWarning,
                          stacklevel=2)

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
        """TensorNVMe's call `what`; ``sync_...`` waits for its own tensors only."""
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
        for entry in self._by_key.values():
            entry.detach()
        self._by_id.clear()
        self._by_storage.clear()
        self._by_key.clear()

    def _lookup(self, tensor: Any) -> _Entry | None:
        entry = self._by_id.get(id(tensor))
        if entry is not None and entry.tensor_ref() is tensor:
            return entry
        storage = tensor.untyped_storage()
        entry = self._by_storage.get(id(storage))
        if entry is None or entry.storage_ref() is not storage:
            return None
        # Another tensor of the storage stands for it only if it covers all of it, as the
        # tensor written did: a view of part of it would have the whole moved at its address.
        if tensor.storage_offset() != 0 or tensor.numel() * tensor.element_size() != entry.nbytes:
            return None
        return entry

    def _forget(self, key: int, part: str, gen: int) -> None:
        # A finalizer, run by any thread's collection, maybe amid code holding the lock: never
        # block or change the entries then; the next call that takes the lock drains the key.
        self._forgotten.append((key, part, gen))
        if self._lock._is_owned() or not self._lock.acquire(blocking=False):  # type: ignore
            return
        try:
            self._drain_forgotten()
        finally:
            self._lock.release()

    def _drain_forgotten(self) -> None:
        while self._forgotten:
            key, part, gen = self._forgotten.popleft()
            entry = self._by_key.get(key)
            if entry is None or (part == "storage" and gen != entry.storage_gen):
                continue  # gone, or the death of a storage the entry has left since
            entry.alive.discard(part)
            self._unmap(entry, part)
            if entry.alive:
                continue  # the other can still read it back
            self._remove(entry)
            if self._core is not None and os.getpid() == self._pid:  # a fork's copy: not ours
                self._core.discard(entry.key)

    def _unmap(self, entry: _Entry, part: str) -> None:
        by, ident = ((self._by_id, entry.tensor_id) if part == "tensor"
                     else (self._by_storage, entry.storage_id))
        if by.get(ident) is entry:
            del by[ident]

    def _remove(self, entry: _Entry) -> None:
        self._by_key.pop(entry.key, None)
        self._unmap(entry, "tensor")
        self._unmap(entry, "storage")
        entry.detach()

    def _write(self, tensors: list[Any], callback: Callable[[], None] | None,
               supersede: bool = False) -> list[int]:
        """Returns the keys whose writes free the memory. With `supersede` (TensorNVMe's rule) a
        tensor being written is written again: the later write is the one read back."""
        _check_callback(callback)
        with self._lock:
            core = self._open()
            self._drain_forgotten()
            _require_preserved_storages()
            for t in tensors:
                _check_tensor(t, "write")
            _check_distinct(tensors)
            if any((e := self._lookup(t)) is not None and e.state == "reading" for t in tensors):
                self._settle("read")
            superseded = []
            for t in tensors:
                entry = self._lookup(t)
                if entry is not None and supersede and entry.state == "writing":
                    superseded.append(entry)
                elif entry is not None:
                    raise ValueError(
                        "tensor is already offloaded"
                        if entry.state == "stored"
                        else "tensor is already being written"
                    )
                _core.check_offload_tensor("write", *_facts(t), t.data_ptr())
            entries = [_Entry(next(self._keys), t, t.numel() * t.element_size()) for t in tensors]
            if entries:
                entries[-1].callback = callback
            device = self._route(tensors)
            spans = [_span(t) if d else None for t, d in zip(tensors, device)]  # CudaError
            host = _host_pieces(entries, tensors, device)
            if host:
                core.write(host)
            self._submit("write", entries, spans)
            for old in superseded:
                old.superseded = True
                old.detach()  # the later entry watches the tensor and its storage
            for e, t in zip(entries, tensors):
                storage = t.untyped_storage()
                self._by_id[id(t)] = e
                self._by_storage[id(storage)] = e
                self._by_key[e.key] = e
                e.watch(self, "tensor", t)
                e.watch(self, "storage", storage)
            return [e.key for e in entries] + [e.key for e in superseded]

    def _read(self, tensors: list[Any], callback: Callable[[], None] | None) -> list[int]:
        _check_callback(callback)
        with self._lock:
            core = self._open()
            self._drain_forgotten()
            for t in tensors:
                _check_tensor(t, "read")
            _check_distinct(tensors)
            found = [self._lookup(t) for t in tensors]
            if any(e is None for e in found):
                raise ValueError(
                    "tensor is not offloaded by this DiskOffloader (never written, or already "
                    "read back)"
                )
            if any(e.state == "writing" for e in found):  # type: ignore[union-attr]
                self._settle("write")
                if any(self._lookup(t) is None for t in tensors):
                    raise ValueError("tensor's write failed, so there is nothing to read")
            entries: list[_Entry] = [self._lookup(t) for t in tensors]  # type: ignore[misc]
            if len({id(e) for e in entries}) != len(entries):
                raise ValueError(
                    "two of these tensors stand for one offloaded tensor (the tensor written and "
                    "another tensor of its storage): read it once"
                )
            if any(e.state == "reading" for e in entries):
                raise ValueError("tensor is already being read")
            for t, e in zip(tensors, entries):
                _core.check_offload_tensor("read", *_facts(t), e.nbytes)
            device = self._route(tensors)
            spans: list[Any] = []
            try:
                # The memory is allocated here, on the caller's thread and stream, while the
                # data is still on disk: out of memory leaves it offloaded.
                for e, t, d in zip(entries, tensors, device):
                    if not d and self._pin and e.tensor_ref() is t:
                        self._allocate_pinned(e, t)
                    else:
                        _resize(t.untyped_storage(), e.nbytes)
                    spans.append(_span(t) if d else None)  # CudaError without a driver
                host = _host_pieces(entries, tensors, device)
                if host:
                    core.read(host)
            except BaseException:
                for t in tensors:
                    _resize(t.untyped_storage())
                raise
            for e, t in zip(entries, tensors):
                e.state, e.tensor, e.storage, e.callback = "reading", t, t.untyped_storage(), None
            if entries:
                entries[-1].callback = callback
            self._submit("read", entries, spans)
            return [e.key for e in entries]

    def _submit(self, kind: str, entries: list[_Entry], spans: list[Any]) -> None:
        for e, span in zip(entries, spans):
            if span is not None:  # `span` keeps the tensor and its stream
                self._device.submit(kind, e.key, span.address, e.nbytes, span.device,
                                    span.stream, span)

    def _allocate_pinned(self, entry: _Entry, tensor: Any) -> None:
        """A new pinned storage for `tensor` (the tensor written: another tensor of the storage
        would take the data from it); `entry` watches it instead of the old one."""
        import torch

        memory = torch.empty(entry.nbytes, dtype=torch.uint8, pin_memory=True)
        # The old storage may die inside set_(): its finalizer goes first, so that its death
        # is not taken for the new storage's.
        old_storage = tensor.untyped_storage()
        old = entry.finalizers.pop("storage", None)
        if old is not None:
            old.detach()
        try:
            with torch.no_grad():
                tensor.set_(memory.untyped_storage(), 0, tensor.shape, tensor.stride())
        except RuntimeError:
            # torch refuses (an inference tensor outside inference mode): the storage stays
            # and watched, and the read fills it in place, unpinned.
            entry.watch(self, "storage", old_storage)
            _resize(old_storage, entry.nbytes)
            return
        new = tensor.untyped_storage()
        self._unmap(entry, "storage")
        entry.storage_gen += 1  # deaths of the old storage queued meanwhile are not the new one's
        entry.storage_id = id(new)
        entry.storage_ref = weakref.ref(new)
        entry.alive.add("storage")
        self._by_storage[entry.storage_id] = entry
        entry.watch(self, "storage", new)

    def _route(self, tensors: list[Any]) -> list[bool]:
        """Per tensor, whether it takes the device path; makes its transfer before anything
        starts (CudaError)."""
        device = [t.device.type == "cuda" or self._device_copier == "memcpy" for t in tensors]
        if any(device):
            self._device.prepare()
        return device

    def _wait(self, kind: str, keys: Sequence[int] | None = None) -> None:
        """Waits for the operations of `kind` (those moving `keys`), runs every callback, then
        raises the first I/O error (callbacks' errors as notes), else the first callback's. An
        interrupt from a callback is raised after the others ran, the I/O errors kept."""
        errors, callbacks = self._collect(kind, keys=keys)
        with self._lock:
            if keys is None:
                held_errors, held_callback_errors = self._undelivered[kind]
                self._undelivered[kind] = ([], [])
            else:
                held_errors, held_callback_errors = [], []
        errors = held_errors + errors
        callback_errors, interrupt = _run_callbacks(callbacks)
        callback_errors[:0] = held_callback_errors
        if interrupt is not None:
            with self._lock:
                self._undelivered[kind][0][:0] = errors
            raise interrupt
        if errors:
            first = errors[0]
            if len(errors) > 1:
                add_note(first, f"{len(errors) - 1} other offload {kind}(s) also failed")
            for e in callback_errors:
                add_note(first, f"and a callback raised {e!r}")
            raise first
        if callback_errors:
            raise callback_errors[0]

    def _settle(self, kind: str) -> None:
        """A wait for a call of the other kind; the errors are kept for the next wait of `kind`:
        other tensors' failures are not this call's."""
        errors, callbacks = self._collect(kind)
        held_errors, held_callback_errors = self._undelivered[kind]
        held_errors.extend(errors)  # kept before any callback runs: an interrupt loses none
        callback_errors, interrupt = _run_callbacks(callbacks)
        held_callback_errors.extend(e for e in callback_errors if e is not interrupt)
        if interrupt is not None:
            raise interrupt

    def _collect(
        self, kind: str, cancel_writes: bool = False, keys: Sequence[int] | None = None
    ) -> tuple[list[BaseException], list[Callable[[], None]]]:
        """Waits for the operations of `kind` and applies the outcomes; returns the errors and
        the callbacks due. With `cancel_writes` (close()) a write done leaves its tensor as is."""
        with self._lock:
            if self._core is None:
                return [], []
            self._open()  # a child made by fork(): raises (the operations are the parent's)
            self._drain_forgotten()
            # Everything is waited for before any outcome is taken: an interrupt (Ctrl-C) while
            # waiting leaves them all to the next wait.
            outcomes = self._device.wait(kind, None if keys is None else sorted(set(keys)))
            errors = []
            callbacks = []
            for key, error in outcomes:
                if error is not None:
                    errors.append(error)  # never dropped, whatever became of the entry
                entry = self._by_key.get(key)
                if entry is None:
                    continue
                tensor, entry.tensor = entry.tensor, None
                storage, entry.storage = entry.storage, None
                callback, entry.callback = entry.callback, None
                if entry.superseded:
                    # The later write holds the tensor (and frees its memory once done: it is
                    # waited for with this one); this copy is not the one to read back.
                    self._remove(entry)
                    if error is None:
                        self._core.discard(key)
                elif error is not None and kind == "read":  # still on disk: offloaded again
                    _resize(storage)
                    entry.state = "stored"
                    continue
                elif error is not None or cancel_writes:
                    # A failed write stored nothing; closing removes the files, so the memory
                    # keeps the only copy of the data. The tensor is as it was.
                    self._remove(entry)
                    continue
                elif kind == "write":
                    _resize(storage)  # the memory written, whatever the tensor holds now
                    entry.state = "stored"
                else:
                    self._remove(entry)
                if callback is not None and not cancel_writes:
                    callbacks.append(callback)
            # Tensors whose last reference this wait held died here, under the lock: their
            # finalizers left their keys for now.
            del outcomes
            tensor = storage = None
            self._drain_forgotten()
        return errors, callbacks


_live: "weakref.WeakSet[DiskOffloader]" = weakref.WeakSet()


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
