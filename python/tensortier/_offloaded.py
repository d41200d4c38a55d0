"""What DiskOffloader keeps of an offloaded tensor (its entry), and what it asks of torch tensors:
the checks before a write or a read, memory freed and given back, where a device tensor's bytes
are. Internal to tensortier.offload."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .device import device_buffer, DeviceBuffer

if TYPE_CHECKING:
    from .offload import DiskOffloader


class _Entry:
    """One offloaded tensor, found through the tensor given or its storage (``param.data``
    written, ``param`` read); its data is dropped only when both have died."""

    __slots__ = ("key", "tensor_id", "tensor_ref", "storage_id", "storage_ref", "storage_gen",
                 "alive", "nbytes", "state", "tensor", "storage", "callback", "finalizers",
                 "superseded")

    def __init__(self, key: int, tensor: Any, nbytes: int) -> None:
        storage = tensor.untyped_storage()
        self.key = key
        self.tensor_id = id(tensor)
        self.tensor_ref = weakref.ref(tensor)
        self.storage_id = id(storage)
        self.storage_ref = weakref.ref(storage)
        self.storage_gen = 0  # +1 when a pinned read gives the tensor a new storage
        self.alive = {"tensor", "storage"}  # what still can read the data back
        self.nbytes = nbytes
        self.state = "writing"  # then "stored", "reading"
        # Strong while an operation is in flight: the tensor, and the storage whose memory the
        # operation uses (`x.data = ...` meanwhile must not free it under the engine).
        self.tensor: Any = tensor
        self.storage: Any = storage
        self.callback: Callable[[], None] | None = None
        self.finalizers: dict[str, weakref.finalize] = {}
        # A write whose tensor was written again before it was waited for: the later write's
        # entry holds the tensor; this one only waits for its write, then gives its space back.
        self.superseded = False

    def watch(self, offloader: "DiskOffloader", part: str, obj: Any) -> None:
        old = self.finalizers.pop(part, None)
        if old is not None:
            old.detach()
        gen = self.storage_gen if part == "storage" else 0
        finalizer = weakref.finalize(obj, _part_died, weakref.ref(offloader), self.key, part, gen)
        # Not at interpreter exit: depending on import order weakref's exit hook ran before the
        # offloaders' close, discarding keys in flight and losing data without the warning.
        finalizer.atexit = False
        self.finalizers[part] = finalizer

    def detach(self) -> None:
        for finalizer in self.finalizers.values():
            finalizer.detach()
        self.finalizers.clear()


def _part_died(
    offloader_ref: "weakref.ref[DiskOffloader]", key: int, part: str, gen: int
) -> None:
    offloader = offloader_ref()
    if offloader is not None:
        offloader._forget(key, part, gen)


def _check_callback(callback: Any) -> None:
    """Refused when given, not at the wait (with the memory freed, the error out of place)."""
    if callback is not None and not callable(callback):
        raise TypeError(f"callback must be callable or None, not {type(callback).__name__}")


def _check_tensor(tensor: Any, what: str) -> None:
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"DiskOffloader can {what} torch tensors only, not {type(tensor).__name__}")
    if tensor.device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"tensor is on {tensor.device}; DiskOffloader offloads CPU and CUDA tensors only"
        )
    if tensor.is_nested:
        raise ValueError("nested tensors cannot be offloaded: offload their components")
    if not tensor.is_contiguous():
        raise ValueError(
            f"tensor of shape {tuple(tensor.shape)} is not contiguous: only contiguous tensors "
            "can be offloaded (call .contiguous() first)"
        )


@functools.cache
def _require_preserved_storages() -> None:
    """Entries follow storages by identity: torch must keep one Python object per storage."""
    import torch

    probe = torch.empty(1)
    if probe.untyped_storage() is not probe.untyped_storage():
        raise RuntimeError(
            f"torch {torch.__version__} makes a new Python object per untyped_storage() call; "
            "DiskOffloader needs one per storage (newer PyTorch releases keep it): upgrade torch"
        )


def _resize(storage: Any, nbytes: int = 0) -> None:
    """Resized only if its size differs: a zero-size tensor's storage may not be resizable."""
    if storage.nbytes() != nbytes:
        storage.resize_(nbytes)


def _run_callbacks(
    callbacks: Sequence[Callable[[], None]],
) -> tuple[list[BaseException], BaseException | None]:
    """Runs every callback; returns what they raised and the first interrupt (Ctrl-C)."""
    raised: list[BaseException] = []
    for cb in callbacks:
        try:
            cb()
        except BaseException as e:  # noqa: BLE001 - the caller raises them after all ran
            raised.append(e)
    return raised, next((e for e in raised if not isinstance(e, Exception)), None)


def _facts(tensor: Any) -> tuple[tuple[int, ...], int, int, int, bool]:
    storage = tensor.untyped_storage()
    return (tuple(tensor.shape), tensor.numel() * tensor.element_size(), storage.nbytes(),
            tensor.storage_offset(), storage.resizable())


def _check_distinct(tensors: Sequence[Any]) -> None:
    if len({id(t.untyped_storage()) for t in tensors}) != len(tensors):
        raise ValueError(
            "the same tensor (or two tensors of one storage, such as a parameter and its .data) "
            "is given twice"
        )


def _host_pieces(entries: list[_Entry], tensors: list[Any], device: list[bool]) -> list[Any]:
    return [(e.key, t.data_ptr(), e.nbytes) for e, t, d in zip(entries, tensors, device) if not d]


def _span(tensor: Any) -> DeviceBuffer:
    """For CPU tensors (the memcpy test copier): host memory and no stream."""
    if tensor.device.type != "cuda":
        return DeviceBuffer(int(tensor.data_ptr()), tensor.nbytes, 0, None, tensor)
    return device_buffer(tensor, own_stream=True)
