"""Turn user objects (torch tensors, buffer-protocol objects, DLPack arrays) into host addresses.

The returned HostBuffer keeps whatever must stay alive while the engine uses the memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import _core


@dataclass(frozen=True)
class HostBuffer:
    """A contiguous host memory range and the object that owns it."""

    address: int
    nbytes: int
    owner: Any


def check_tensor_memory(tensor: Any, where: str = "tensor") -> None:
    """Raises TypeError/ValueError unless `tensor` is a dense, contiguous torch tensor whose
    memory holds its values (not a conjugate or negative view)."""
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"{type(tensor).__name__} is not a tensor: pass a tensor (for a storage, "
            "torch.tensor([], dtype=torch.uint8).set_(storage))"
        )
    if tensor.layout != torch.strided:
        raise ValueError(
            f"{where} has layout {tensor.layout}: only dense tensors move (call .to_dense())"
        )
    if tensor.is_conj() or tensor.is_neg():
        # Its memory holds the conjugates (negatives) of its values: writing it would store
        # other numbers, reading into it would change them.
        raise ValueError(
            f"{where} is a {'conjugate' if tensor.is_conj() else 'negative'} view: its memory "
            "does not hold its values; call .resolve_conj().resolve_neg() first"
        )
    if not tensor.is_contiguous():
        raise ValueError(
            f"{where} of shape {tuple(tensor.shape)} is not contiguous: call .contiguous() first"
        )


def _from_tensor(tensor: Any) -> HostBuffer:
    if tensor.device.type == "cuda":
        # A torch CUDA tensor takes the CUDA path before it gets here; other CUDA arrays come
        # through DLPack.
        raise ValueError(
            f"an array on {tensor.device} given through DLPack: pass it as a torch tensor "
            "(torch.from_dlpack(array)) for the CUDA path, or copy it to the host"
        )
    if tensor.device.type != "cpu":
        raise ValueError(
            f"tensor is on {tensor.device}: tensortier moves CPU and CUDA tensors only; copy "
            "it to one of those first"
        )
    check_tensor_memory(tensor)
    # The storage is kept as well as the tensor: `tensor.set_(...)` or `param.data = ...`
    # while the operation runs would otherwise free the memory the engine is using.
    return HostBuffer(
        tensor.data_ptr(), tensor.numel() * tensor.element_size(),
        (tensor, tensor.untyped_storage()),
    )


def host_buffer(obj: Any, *, writable: bool) -> HostBuffer:
    """Resolve `obj` to a host memory range.

    Args:
        obj: a torch tensor, an object with the buffer protocol (bytes, bytearray, memoryview,
            numpy array, mmap) or one with ``__dlpack__`` (CuPy/JAX arrays on the CPU...).
        writable: the engine will write into the memory (a read target).

    Raises:
        TypeError: `obj` exposes no memory.
        ValueError: the memory is not contiguous, read-only for a read, or not on the host.
    """
    if type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr"):
        return _from_tensor(obj)
    memory = _core.host_range(obj, writable)  # ValueError: read-only, not contiguous
    if memory is None and hasattr(obj, "__dlpack__"):
        try:
            import torch

            return _from_tensor(torch.from_dlpack(obj))
        except ImportError:
            import numpy

            memory = _core.host_range(numpy.from_dlpack(obj), writable)
    if memory is not None:
        return HostBuffer(*memory)
    raise TypeError(
        f"{type(obj).__name__} is not a tensor, a buffer (bytes, bytearray, numpy array...) "
        "or a DLPack array"
    )
