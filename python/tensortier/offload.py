"""Park tensors in files to free their memory and bring them back: TensorNVMe's ``DiskOffloader``.

Code written for TensorNVMe runs with only its import changed::

    from tensortier import DiskOffloader
    off = DiskOffloader("./offload")
    off.sync_write(x)   # x's data is on disk, its memory freed (shape and dtype kept)
    off.sync_read(x)    # x's memory and data are back

Memory is freed only once the data is on disk: a failed write leaves the tensor as it was and
raises on the call that waits for it, and a failed read leaves the data on disk to read again.

CUDA tensors work too: offloading frees their GPU memory (back to torch's caching allocator;
``torch.cuda.empty_cache()`` gives it to the driver), reading allocates it again and restores the
data. Their bytes are staged through pinned host memory of the tensor's size while an operation
is in flight (copied from the GPU when the write starts, to the GPU when the read is waited for).
"""

from __future__ import annotations

import atexit
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from . import _core

__all__ = ["DiskOffloader"]

# TensorNVMe's backend names are accepted too.
_BACKENDS = {
    "auto": "auto",
    "io_uring": "io_uring",
    "uring": "io_uring",
    "libaio": "libaio",
    "aio": "libaio",
    "threads": "threads",
    "pthread": "threads",
}

PathLike = str | os.PathLike[str]


class _Entry:
    """One offloaded tensor: its key, a weak reference, and while an operation runs, the tensor."""

    __slots__ = (
        "key",
        "ref",
        "tensor_id",
        "nbytes",
        "state",
        "tensor",
        "callback",
        "finalizer",
        "staging",
    )

    def __init__(self, key: int, tensor: Any, nbytes: int) -> None:
        self.key = key
        self.tensor_id = id(tensor)
        self.ref = weakref.ref(tensor)
        self.nbytes = nbytes
        # then "stored", "reading"; "staged" when a read's copy to the GPU failed after the
        # file's copy was freed: the bytes are in `staging` until the next read
        self.state = "writing"
        self.tensor: Any = tensor  # strong while an operation is in flight
        self.callback: Callable[[], None] | None = None
        self.finalizer: weakref.finalize | None = None
        # CUDA tensors: the pinned host copy the disk I/O uses while an operation is in flight.
        self.staging: Any = None


def _discard_key(offloader_ref: "weakref.ref[DiskOffloader]", key: int) -> None:
    """A stored tensor died: its data will never be read back, so free its file space."""
    offloader = offloader_ref()
    if offloader is not None:
        offloader._forget(key)


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

    Backing files are named ``tensortier-offload-<pid>-...bin`` and are removed by ``close()``,
    at context-manager exit and at interpreter exit; files of dead processes are removed by the
    next offloader on the directory.
    """

    def __init__(
        self,
        dir_name: PathLike | Sequence[PathLike],
        n_entries: int = 16,
        backend: str = "auto",
        *,
        pin_memory: bool = False,
        stripe_threshold: int = 16 << 20,
        _fault: dict[str, Any] | None = None,
    ) -> None:
        dirs = (
            [os.path.abspath(dir_name)]
            if isinstance(dir_name, (str, os.PathLike))
            else [os.path.abspath(d) for d in dir_name]
        )
        if not dirs:
            raise ValueError("DiskOffloader needs at least one directory")
        if backend not in _BACKENDS:
            raise ValueError(
                f"backend {backend!r} is not one of {', '.join(sorted(_BACKENDS))}"
            )
        if not isinstance(n_entries, int) or n_entries <= 0:
            raise ValueError(f"n_entries must be a positive integer, not {n_entries!r}")
        if pin_memory:
            import torch

            if not torch.cuda.is_available():
                raise ValueError(
                    "pin_memory=True needs a CUDA device, and torch.cuda.is_available() is False"
                )
        for d in dirs:
            os.makedirs(d, exist_ok=True)
        self._core: _core.Offloader | None = _core.Offloader(
            dirs,
            backend=_BACKENDS[backend],
            queue_depth=n_entries,
            stripe_threshold=stripe_threshold,
            fault=_fault,
        )
        self._pin = pin_memory
        self._lock = threading.RLock()
        self._by_id: dict[int, _Entry] = {}
        self._by_key: dict[int, _Entry] = {}
        self._next_key = 1
        _live.add(self)

    # ---- TensorNVMe's API -----------------------------------------------------------------

    def sync_write(self, tensor: Any) -> None:
        """Writes `tensor` to disk, then frees its memory (its shape and dtype stay)."""
        self._write([tensor], None)
        self.sync_write_events()

    def sync_read(self, tensor: Any) -> None:
        """Restores the memory and data of an offloaded `tensor`."""
        self._read([tensor], None)
        self.sync_read_events()

    def sync_writev(self, tensors: Sequence[Any]) -> None:
        """Writes several tensors in one submission, then frees their memory."""
        self._write(list(tensors), None)
        self.sync_write_events()

    def sync_readv(self, tensors: Sequence[Any]) -> None:
        """Restores several offloaded tensors in one submission (any order works; TensorNVMe
        needs the order they were written in)."""
        self._read(list(tensors), None)
        self.sync_read_events()

    def async_write(self, tensor: Any, callback: Callable[[], None] | None = None) -> None:
        """Starts writing `tensor`; its memory is freed when ``sync_write_events()`` or
        ``synchronize()`` sees the write done, after which `callback` runs."""
        self._write([tensor], callback)

    def async_read(self, tensor: Any, callback: Callable[[], None] | None = None) -> None:
        """Allocates `tensor`'s memory and starts reading its data into it; the data is there
        once ``sync_read_events()`` or ``synchronize()`` returns, after which `callback` runs."""
        self._read([tensor], callback)

    def async_writev(
        self, tensors: Sequence[Any], callback: Callable[[], None] | None = None
    ) -> None:
        """``async_write`` of several tensors in one submission."""
        self._write(list(tensors), callback)

    def async_readv(
        self, tensors: Sequence[Any], callback: Callable[[], None] | None = None
    ) -> None:
        """``async_read`` of several tensors in one submission."""
        self._read(list(tensors), callback)

    def sync_write_events(self) -> None:
        """Waits for every write in flight; frees the memory of the tensors written. Raises the
        first error (``OSError``); the tensors whose write failed keep their memory and data."""
        self._wait("write")

    def sync_read_events(self) -> None:
        """Waits for every read in flight. Raises the first error (``OSError``); the tensors whose
        read failed stay offloaded (memory freed again, data still on disk)."""
        self._wait("read")

    def synchronize(self) -> None:
        """Waits for all writes, then all reads."""
        error: BaseException | None = None
        for kind in ("write", "read"):
            try:
                self._wait(kind)
            except OSError as e:
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
        return int(self._open().stored_bytes)

    @property
    def file_bytes(self) -> int:
        """Bytes the backing files span now (space is reused after reads; the free tail is given
        back when idle, or by ``trim()``)."""
        return int(self._open().file_bytes)

    def trim(self) -> None:
        """Gives the freed space at the ends of the backing files back to the filesystem now.
        The offloader does it by itself in the background once idle for a second; truncating is
        slow on some filesystems, and space freed by reads is often needed by the next writes."""
        with self._lock:
            self._open().trim()

    def is_offloaded(self, tensor: Any) -> bool:
        """Whether `tensor`'s data is parked here (written, not yet read back)."""
        with self._lock:
            entry = self._lookup(tensor)
            return entry is not None and entry.state != "writing"

    def close(self) -> None:
        """Waits for operations in flight, then removes the backing files. The data of tensors
        still offloaded is lost (a ``ResourceWarning`` says how many)."""
        with self._lock:
            core, self._core = self._core, None
            if core is None:
                return
            core.close()
            lost = sum(1 for e in self._by_key.values() if e.state in ("stored", "staged"))
            for entry in self._by_key.values():
                if entry.finalizer is not None:
                    entry.finalizer.detach()
            self._by_id.clear()
            self._by_key.clear()
        if lost:
            warnings.warn(
                f"DiskOffloader closed with {lost} tensor(s) still offloaded; their data is gone",
                ResourceWarning,
                stacklevel=2,
            )

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

    def _open(self) -> _core.Offloader:
        if self._core is None:
            raise ValueError("DiskOffloader is closed")
        return self._core

    def _lookup(self, tensor: Any) -> _Entry | None:
        entry = self._by_id.get(id(tensor))
        return entry if entry is not None and entry.ref() is tensor else None

    def _forget(self, key: int) -> None:
        with self._lock:
            entry = self._by_key.get(key)
            if entry is None:
                return
            self._remove(entry)
            if self._core is not None and entry.state != "staged":  # staged: not in the file
                self._core.discard(key)

    def _remove(self, entry: _Entry) -> None:
        self._by_key.pop(entry.key, None)
        if self._by_id.get(entry.tensor_id) is entry:
            del self._by_id[entry.tensor_id]
        if entry.finalizer is not None:
            entry.finalizer.detach()

    def _write(self, tensors: list[Any], callback: Callable[[], None] | None) -> None:
        with self._lock:
            core = self._open()
            for t in tensors:
                _check_tensor(t, "write")
            if len({id(t) for t in tensors}) != len(tensors):
                raise ValueError("the same tensor is given twice")
            if any((e := self._lookup(t)) is not None and e.state == "reading" for t in tensors):
                self._wait("read")
            for t in tensors:
                entry = self._lookup(t)
                if entry is not None:
                    raise ValueError(
                        "tensor is already offloaded"
                        if entry.state in ("stored", "staged")
                        else "tensor is already being written"
                    )
                storage = t.untyped_storage()
                nbytes = t.numel() * t.element_size()
                if nbytes > 0 and storage.nbytes() == 0:
                    raise ValueError(
                        "tensor has no memory (it is offloaded by another DiskOffloader, or its "
                        "storage was freed)"
                    )
                if t.storage_offset() != 0 or storage.nbytes() != nbytes:
                    raise ValueError(
                        f"tensor of shape {tuple(t.shape)} is a view into a storage of "
                        f"{storage.nbytes()} bytes; offloading frees the whole storage, so only "
                        "a tensor that owns its storage can be offloaded (use .clone())"
                    )
                if nbytes > 0 and not storage.resizable():
                    raise ValueError(
                        "tensor's storage cannot be resized (it wraps foreign memory, e.g. from "
                        "numpy or torch.frombuffer); offloading frees memory by resizing it: "
                        "use .clone()"
                    )
            entries = []
            for t in tensors:
                entry = _Entry(self._next_key, t, t.numel() * t.element_size())
                self._next_key += 1
                entry.callback = callback if t is tensors[-1] else None
                entries.append(entry)
            for e, t in zip(entries, tensors):
                if t.device.type == "cuda" and e.nbytes > 0:
                    e.staging = _stage_from_device(t, e.nbytes)
            core.write([(e.key, _host_address(e, t), e.nbytes) for e, t in zip(entries, tensors)])
            me = weakref.ref(self)
            for e, t in zip(entries, tensors):
                self._by_id[id(t)] = e
                self._by_key[e.key] = e
                e.finalizer = weakref.finalize(t, _discard_key, me, e.key)

    def _read(self, tensors: list[Any], callback: Callable[[], None] | None) -> None:
        import torch

        ready: Callable[[], None] | None = None
        with self._lock:
            core = self._open()
            for t in tensors:
                _check_tensor(t, "read")
            if len({id(t) for t in tensors}) != len(tensors):
                raise ValueError("the same tensor is given twice")
            found = [self._lookup(t) for t in tensors]
            if any(e is None for e in found):
                raise ValueError(
                    "tensor is not offloaded by this DiskOffloader (never written, or already "
                    "read back)"
                )
            if any(e.state == "writing" for e in found):  # type: ignore[union-attr]
                self._wait("write")
                if any(self._lookup(t) is None for t in tensors):
                    raise ValueError("tensor's write failed, so there is nothing to read")
            entries: list[_Entry] = [self._lookup(t) for t in tensors]  # type: ignore[misc]
            if any(e.state == "reading" for e in entries):
                raise ValueError("tensor is already being read")
            # Tensors whose bytes a failed copy left in host memory are restored from there now.
            staged = [(e, t) for e, t in zip(entries, tensors) if e.state == "staged"]
            for e, t in staged:
                _restore_staged(e, t)  # raises (the bytes stay staged) on a CUDA error
                self._remove(e)
            if staged:
                restored = {id(e) for e, _ in staged}
                pending = [(e, t) for e, t in zip(entries, tensors) if id(e) not in restored]
                entries, tensors = [e for e, _ in pending], [t for _, t in pending]
            if not entries:
                ready = callback  # all of them were in host memory: done already
            else:
                self._start_read(core, entries, tensors, callback, torch)
        if ready is not None:
            ready()

    def _start_read(
        self,
        core: _core.Offloader,
        entries: list[_Entry],
        tensors: list[Any],
        callback: Callable[[], None] | None,
        torch: Any,
    ) -> None:
        try:
            for e, t in zip(entries, tensors):
                if t.device.type == "cuda":
                    # GPU memory is allocated now, while the data is still on disk: reading it
                    # back frees its file space, so running out of GPU memory after that (in
                    # _wait) would lose it.
                    e.staging = _pinned_bytes(e.nbytes) if e.nbytes > 0 else None
                    t.untyped_storage().resize_(e.nbytes)
                else:
                    _allocate(t, e.nbytes, self._pin, torch)
            core.read([(e.key, _host_address(e, t), e.nbytes) for e, t in zip(entries, tensors)])
        except BaseException:
            for e, t in zip(entries, tensors):
                e.staging = None
                t.untyped_storage().resize_(0)
            raise
        for e, t in zip(entries, tensors):
            e.state = "reading"
            e.tensor = t
            e.callback = callback if t is tensors[-1] else None

    def _wait(self, kind: str) -> None:
        with self._lock:
            if self._core is None:
                return
            outcomes = self._core.wait(kind)
            errors = []
            callbacks = []
            for key, error in outcomes:
                entry = self._by_key.get(key)
                if entry is None:
                    continue
                tensor, entry.tensor = entry.tensor, None
                staging, entry.staging = entry.staging, None
                if error is None and kind == "read" and tensor.device.type == "cuda":
                    try:
                        _copy_to_device(tensor, staging, entry.nbytes)
                    except Exception as e:  # noqa: BLE001 - a CUDA error
                        # The file's copy is gone (read back): the bytes live on in `staging`,
                        # from which the next read of this tensor restores it.
                        tensor.untyped_storage().resize_(0)
                        entry.staging = staging
                        entry.state = "staged"
                        errors.append(e)
                        continue
                if error is not None:
                    errors.append(error)
                    if kind == "write":  # nothing was stored; the tensor is as it was
                        self._remove(entry)
                    else:  # the data is still on disk: offloaded again
                        tensor.untyped_storage().resize_(0)
                        entry.state = "stored"
                    continue
                if kind == "write":
                    tensor.untyped_storage().resize_(0)
                    entry.state = "stored"
                else:
                    self._remove(entry)
                if entry.callback is not None:
                    callbacks.append(entry.callback)
                    entry.callback = None
        for cb in callbacks:
            cb()
        if errors:
            first = errors[0]
            if len(errors) > 1:
                first.add_note(f"{len(errors) - 1} other offload {kind}(s) also failed")
            raise first


def _check_tensor(tensor: Any, what: str) -> None:
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"DiskOffloader can {what} torch tensors only, not {type(tensor).__name__}")
    if tensor.device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"tensor is on {tensor.device}; DiskOffloader offloads CPU and CUDA tensors only"
        )
    if not tensor.is_contiguous():
        raise ValueError(
            f"tensor of shape {tuple(tensor.shape)} is not contiguous: only contiguous tensors "
            "can be offloaded (call .contiguous() first)"
        )


def _pinned_bytes(nbytes: int) -> Any:
    """A pinned host staging buffer (tensortier's registered memory)."""
    from .device import pinned_empty

    return pinned_empty(nbytes)


def _storage_bytes(tensor: Any) -> Any:
    """The whole storage of `tensor` as a 1-D uint8 tensor on its device."""
    import torch

    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


def _stage_from_device(tensor: Any, nbytes: int) -> Any:
    """A pinned host copy of a CUDA tensor's bytes, complete when this returns (the copy is
    ordered after the work queued on the current stream)."""
    staging = _pinned_bytes(nbytes)
    staging.copy_(_storage_bytes(tensor))
    return staging


def _restore_staged(entry: _Entry, tensor: Any) -> None:
    """Restores a CUDA tensor whose bytes are held in `entry.staging` (a read whose copy to the
    device failed); on failure they stay there."""
    tensor.untyped_storage().resize_(entry.nbytes)
    try:
        _copy_to_device(tensor, entry.staging, entry.nbytes)
    except BaseException:
        tensor.untyped_storage().resize_(0)
        raise
    entry.staging = None


def _copy_to_device(tensor: Any, staging: Any, nbytes: int) -> None:
    """Copies the staged bytes into a CUDA tensor whose memory is allocated again."""
    if nbytes > 0:
        _storage_bytes(tensor).copy_(staging)


def _host_address(entry: _Entry, tensor: Any) -> int:
    return int(entry.staging.data_ptr()) if entry.staging is not None else int(tensor.data_ptr())


def _allocate(tensor: Any, nbytes: int, pin: bool, torch: Any) -> None:
    """Gives an offloaded tensor `nbytes` of memory again, in place (views of the same storage
    see it too); pinned memory means a new storage."""
    if not pin:
        tensor.untyped_storage().resize_(nbytes)
        return
    memory = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).untyped_storage()
    with torch.no_grad():
        tensor.set_(memory, 0, tensor.shape, tensor.stride())


_live: "weakref.WeakSet[DiskOffloader]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for offloader in list(_live):
        offloader.close()


def remove_stale_files(directories: Iterable[PathLike]) -> int:
    """Removes backing files left in `directories` by processes that no longer run; returns how
    many. Offloaders do this for their own directories when they start."""
    return sum(int(_core.remove_stale_offload_files(os.fspath(d))) for d in directories)
