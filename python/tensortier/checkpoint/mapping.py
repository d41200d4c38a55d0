"""Where loaded tensors live: host allocations placed for O_DIRECT, memory-mapped files with
readahead, and the placement of tensors on their target device."""

from __future__ import annotations

import ctypes
import errno
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from mmap import MAP_SHARED
from typing import Any

from ..io import File
from . import _format
from ._format import _require, _torch, ALIGNMENT, UnavailableDeviceError


def _as_bytes(t: Any) -> Any:
    """A flat uint8 view of a contiguous tensor's bytes."""
    torch = _torch()
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=flat.device)
    return flat.view(torch.uint8)


def _storage_bytes(storage: Any) -> Any:
    """A flat uint8 tensor over a whole UntypedStorage."""
    torch = _torch()
    t = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return t.set_(storage, 0, (storage.nbytes(),), (1,))


def _host_alloc(numel: int, dtype: Any, misalign: int = 0) -> Any:
    """An uninitialised flat CPU tensor with a storage of its own. Large ones start `misalign`
    bytes past a page boundary, so that address and file offset agree modulo the page size
    (read O_DIRECT with no bounce copy). torch's allocator, as any tensor's: glibc reuses freed
    heap memory already faulted in (a warm reload of 2 GiB ran 3.7 -> 15 GB/s, BENCHMARKS.md)."""
    torch = _torch()
    nbytes = numel * dtype.itemsize
    if nbytes < _format._ALIGNED_ALLOC_MIN:
        return torch.empty(numel, dtype=dtype)
    if misalign % dtype.itemsize:
        misalign = 0  # keep elements naturally aligned; the engine bounces this one
    base = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8)  # skip < ALIGNMENT
    skip = (misalign - base.data_ptr()) % ALIGNMENT
    # A storage of exactly these bytes (torch files share storages between views, by byte
    # offsets into them).
    return _fixed_size(base[skip : skip + nbytes]).view(dtype)


class _Readahead(_require("ReadaheadBudget")):  # type: ignore[misc]
    """What ``mmap=True`` loads may still read ahead: half the memory available at the start,
    shared by an index's shards (so that readahead does not evict earlier shards' pages); and
    whether files are mapped shared (`shared`; None: as torch's mmap loads map them)."""

    def __init__(self, shared: bool | None = None) -> None:
        super().__init__(_available_memory() // 2)
        self.shared = _maps_shared() if shared is None else shared


def _map_file(
    file: File, path: str, ranges: Sequence[tuple[str, int, int]], readahead: _Readahead,
    private: bool = False,
) -> Any:
    """The whole file `file` has open, mapped as a CPU UntypedStorage: copy-on-write, or shared
    (writes reach the file) where torch's ``set_default_mmap_options(mmap.MAP_SHARED)`` asks
    ``torch.load(mmap=True)`` for that (never where `private`). `ranges`
    ((name, offset, length) the caller will use) must lie inside the file as mapped (a page
    past its end is SIGBUS); their span is read ahead when `readahead` allows."""
    torch = _torch()
    fd = file.fileno()
    size = os.fstat(fd).st_size
    start, end = _require("span_in_file")(path, size, ranges)
    # Map the file the descriptor has open (`path` may name another one by now). torch maps it
    # MAP_PRIVATE and closes its descriptor; Python's mmap would keep a duplicate open per file.
    proc = f"/proc/self/fd/{fd}"
    try:
        whole = torch.UntypedStorage.from_file(
            proc if os.path.exists(proc) else path, shared=readahead.shared and not private, nbytes=size
        )
    except RuntimeError as e:  # "unable to mmap N bytes from file <name>: <strerror> (<errno>)"
        found = re.search(r"\((\d+)\)\s*$", str(e))
        raise OSError(
            int(found.group(1)) if found else errno.EIO,
            f"cannot map the checkpoint ({str(e).replace(proc, path)}): load it with mmap=False",
            path,
        ) from None
    if end > start and readahead.take(end - start):
        try:
            # Queues large reads of the whole span and returns: on the benchmark VM a cold load
            # that touches every page of 2 GiB ran 1.6 -> 2.6 GB/s with it.
            os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass  # only a hint: pages still come in as they are touched
    return whole


def _maps_shared() -> bool:
    """Whether torch's mmap loads map files MAP_SHARED on this thread (``torch.serialization``'s
    ``set_default_mmap_options``, a per-thread setting; MAP_PRIVATE unless changed)."""
    from torch.utils.serialization import config

    return getattr(config.load, "mmap_flags", None) == MAP_SHARED


# MemAvailable of /proc/meminfo (0 when it cannot tell): the name tests replace.
_available_memory = _require("available_memory")


def _fixed_storage(nbytes: int, offset: int) -> Any:
    """A CPU UntypedStorage of `nbytes` that cannot be resized (a tensor set_ past its end is
    refused, as by torch.load), for the bytes at `offset` of a file."""
    torch = _torch()
    if nbytes == 0:
        return torch.frombuffer(bytearray(1), dtype=torch.uint8).untyped_storage()[0:0]
    flat = _host_alloc(nbytes, torch.uint8, offset % ALIGNMENT)
    if flat.untyped_storage().resizable():
        flat = _fixed_size(flat)
    return flat.untyped_storage()


def _fixed_size(flat: Any) -> Any:
    """`flat`'s bytes (a uint8 CPU tensor) in a storage that cannot be resized."""
    torch = _torch()
    window = (ctypes.c_char * flat.numel()).from_address(flat.data_ptr())
    window.owner = flat  # type: ignore[attr-defined]
    return torch.frombuffer(window, dtype=torch.uint8)


def _mapped_tensor(
    whole: Any, offset: int, nbytes: int, dtype: Any, shape: Sequence[int]
) -> Any:
    """A tensor of `shape` over bytes [offset, offset + nbytes) of the mapped file `whole`, in a
    storage of exactly those bytes; a copy where `offset` is not a multiple of the element size."""
    torch = _torch()
    if nbytes == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    window = whole[offset : offset + nbytes]
    if offset % dtype.itemsize:
        flat = _host_alloc(nbytes // dtype.itemsize, dtype)
        _as_bytes(flat).copy_(_storage_bytes(window))
        return flat.view(tuple(shape))
    return torch.empty(0, dtype=dtype).set_(window, 0, tuple(shape))


@dataclass
class _Placement:
    """``load``'s `map_location` (a dict of locations, or a callable given each storage read on
    the CPU) as torch.load applies it to a storage saved at `location`."""

    mapping: Mapping[str, Any] | None = None
    restore: Callable[[Any, str], Any] | None = None

    def device_for(self, location: str) -> Any:
        if self.mapping is not None:
            target = self.mapping.get(location, location)
            return _target_device(str(target) if not isinstance(target, str) else target)
        return _torch().device("cpu")  # read there, then given to `restore`

    def restored(self, storage: Any, location: str) -> Any:
        torch = _torch()
        assert self.restore is not None
        result = self.restore(storage, location)
        if result is None:  # torch's default: where it was saved
            dev = _target_device(location)
            if dev.type == "cpu":
                return storage
            placed = torch.UntypedStorage(storage.nbytes(), device=dev)
            placed.copy_(storage)
            return placed
        if isinstance(result, torch.storage.TypedStorage):
            result = result._untyped_storage
        if not isinstance(result, torch.UntypedStorage) or result.nbytes() != storage.nbytes():
            raise ValueError(
                f"map_location returned {type(result).__name__} for a storage of "
                f"{storage.nbytes()} bytes: it must return a storage of the same size (or None)"
            )
        return result

    def restored_tensor(self, t: Any, location: str) -> Any:
        torch = _torch()
        storage = self.restored(t.untyped_storage(), location)
        if storage is t.untyped_storage() or storage.data_ptr() == t.untyped_storage().data_ptr():
            return t
        out = torch.empty(0, dtype=t.dtype, device=storage.device)
        return out.set_(storage, t.storage_offset(), t.shape, t.stride())


def _target_device(device: Any) -> Any:
    torch = _torch()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is not a device: {e}") from e
    if dev.type in ("cpu", "meta"):  # meta: shapes and dtypes only, as torch.load gives them
        return torch.device(dev.type)
    cuda = dev.type == "cuda" and torch.cuda.is_available()
    index = torch.cuda.current_device() if cuda and dev.index is None else dev.index
    try:
        _require("check_load_device")(str(dev), dev.type, cuda, index or 0,
                                      torch.cuda.device_count() if cuda else 0)
    except ValueError as e:  # torch.load raises RuntimeError for these
        raise UnavailableDeviceError(str(e)) from None
    return torch.device("cuda", index)
