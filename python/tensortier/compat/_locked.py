"""DeepSpeed's pinned-tensor manager, one per process: the locked host tensors of every
``aio_handle``, ``gds_handle`` and ``pin_handle`` of tensortier.compat.deepnvme, so that each
handle's ``is_pinned`` knows the others' tensors and ``free_cpu_locked_tensor`` frees only them."""

from __future__ import annotations

import threading
import weakref
from typing import Any

from .. import _core

# new_cpu_locked_tensor's tensors, of every aio_handle, gds_handle and pin_handle (DeepSpeed's
# pinned-tensor manager is one per process, shared by its async_io, gds and pin_memory ops):
# data_ptr -> (bytes, the tensor's storage, weakly: it lives as long as any view of the tensor,
# which the tensor's Python object need not). Writes from them are not copied first;
# free_cpu_locked_tensor frees only them.
_locked: dict[int, tuple[int, weakref.ref[Any]]] = {}
_locked_mutex = threading.Lock()


def _nbytes(buffer: Any) -> int:
    return int(buffer.numel() * buffer.element_size())


def _new_locked(num_elem: int, example_tensor: Any) -> Any:
    """``new_cpu_locked_tensor`` of every handle: a tensor in locked memory, in the registry."""
    import torch

    from .. import aligned_empty

    if torch.cuda.is_available():
        tensor = torch.empty(num_elem, dtype=example_tensor.dtype, pin_memory=True)
    else:
        tensor = aligned_empty(num_elem, example_tensor.dtype, reused=True, resident=True)
    with _locked_mutex:
        _locked[int(tensor.data_ptr())] = (_nbytes(tensor), weakref.ref(tensor.untyped_storage()))
    return tensor


def _free_locked(address: int, tensor: Any = None) -> bool:
    """Frees the live tensor from ``new_cpu_locked_tensor`` at `address` (its storage shrinks to
    nothing where torch allows, as pinned storages do; page-aligned memory goes with its last
    reference). A zero-byte one only through `tensor`, a view of it: such tensors may share an
    address. False, and nothing freed, when there is none."""
    with _locked_mutex:
        entry = _locked.get(address)
        storage = None if entry is None else entry[1]()
        if storage is None or (
            entry[0] == 0  # type: ignore[index]
            and (tensor is None or tensor.untyped_storage() is not storage)
        ):
            return False
        del _locked[address]
    if storage.resizable():
        storage.resize_(0)
    return True


def _managed(buffer: Any) -> bool:
    """Whether all of `buffer`'s bytes lie in one live tensor from ``new_cpu_locked_tensor``
    (DeepSpeed's manager likewise refuses a buffer that starts in a region and ends past it)."""
    start = int(buffer.data_ptr())
    end = start + _nbytes(buffer)
    with _locked_mutex:
        for base, (nbytes, ref) in list(_locked.items()):
            if ref() is None:
                del _locked[base]
            elif base <= start and end <= base + nbytes:
                return True
    return False


def _is_pinned(buffer: Any) -> bool:
    """``is_pinned`` of every handle: a CPU tensor pinned by torch, in the registry, or (asked
    of the CUDA driver, where one is loaded) page-locked with CUDA by anyone."""
    if buffer.device.type != "cpu":
        return False
    if bool(buffer.is_pinned()) or _managed(buffer):
        return True
    try:
        return bool(_core.pinned_host(int(buffer.data_ptr()), _nbytes(buffer)))
    except (RuntimeError, OSError):  # a driver that cannot answer: DeepNVMe's answer, not pinned
        return False
