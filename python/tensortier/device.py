"""Pinned host memory and CUDA tensors: what tensortier needs to move GPU data. The guide is
docs/gpu.md."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

from . import _core

__all__ = [
    "CuFileError",
    "CudaError",
    "cuda_info",
    "cufile_info",
    "pin",
    "pinned_empty",
]

#: A CUDA driver call failed, or the driver is missing (the message says which, e.g.
#: ``... CUDA driver unavailable: libcuda.so.1 not found: ...``). A ``RuntimeError``.
CudaError = _core.CudaError
#: A cuFile (GPUDirect Storage) call failed or cuFile is unavailable. A ``RuntimeError``.
CuFileError = _core.CuFileError


def cuda_info() -> dict[str, Any]:
    """The CUDA driver as tensortier sees it: ``available``, ``why_unavailable``, ``library``,
    ``version`` (e.g. 12040) and ``device_count``."""
    return dict(_core.cuda_driver())


def cufile_info() -> dict[str, Any]:
    """cuFile (GPUDirect Storage): ``available``, ``why_unavailable``, ``library`` and
    ``compat_mode_reason`` (set when cuFile opens but would only run in its compatibility mode:
    no nvidia-fs driver and no ``use_pci_p2pdma``, or a configuration forcing that mode;
    ``gds="auto"`` then uses the bounce ring)."""
    return dict(_core.cufile())


def _shape(shape: Any, dtype: Any) -> tuple[Any, tuple[int, ...], int, int]:
    """(dtype, dims, numel, nbytes) of a new tensor (`dtype` default uint8)."""
    import torch

    dtype = torch.uint8 if dtype is None else dtype
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, not {type(dtype).__name__}")
    try:
        dims: tuple[int, ...] = (operator.index(shape),)
    except TypeError:
        try:
            dims = tuple(operator.index(d) for d in shape)
        except TypeError:
            raise TypeError(f"shape must be an int or a sequence of ints, not {shape!r}") from None
    if any(d < 0 for d in dims):
        raise ValueError(f"shape {dims} has a negative dimension")
    numel = math.prod(dims)
    return dtype, dims, numel, numel * dtype.itemsize


def pinned_empty(
    shape: int | tuple[int, ...], dtype: Any = None, *, device: int | None = None
) -> Any:
    """An uninitialised CPU tensor in pinned (page-locked, CUDA-registered) memory.

    Args:
        shape: tensor shape.
        dtype: a torch dtype (default ``torch.uint8``).
        device: the GPU whose context registers the memory (usable from every GPU); default:
            torch's current device.

    Raises:
        CudaError: no CUDA driver here (the message names what is missing), or registration
            failed (e.g. over the locked-memory limit).
        ValueError, TypeError: a bad shape or dtype.
    """
    import torch

    dtype, dims, _, nbytes = _shape(shape, dtype)
    _core.require_cuda_driver("tensortier.pinned_empty")
    if device is None:
        # torch's current device, not always 0: a context costs hundreds of MiB of that GPU's
        # memory, and every rank of a multi-GPU job would make one on GPU 0.
        device = int(torch.cuda.current_device()) if torch.cuda.is_available() else 0
    memory = _core.PinnedMemory(max(nbytes, 1), device)
    # torch.frombuffer keeps `memory` (and so the registration) alive as long as the storage.
    # (frombuffer refuses count=0, hence the slice: zero-byte shapes are valid tensors.)
    return torch.frombuffer(memory, dtype=torch.uint8)[:nbytes].view(dtype).view(dims)


def pin(tensor: Any, *, device: int | None = None) -> Any:
    """A copy of CPU `tensor` in pinned memory (as ``tensor.pin_memory()``), or `tensor` itself
    when its memory is pinned already. Contiguous copies keep the shape and dtype. `device` as
    for :func:`pinned_empty`.

    Raises:
        TypeError: not a torch tensor. ValueError: a CUDA tensor (already device memory).
        CudaError: no CUDA driver (the message names what is missing).
    """
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"pin needs a torch tensor, not {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"pin needs a CPU tensor; this one is on {tensor.device}")
    _core.require_cuda_driver("tensortier.pin")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes > 0 and _core.pinned_host(tensor.data_ptr(), nbytes):
        return tensor
    out = pinned_empty(tuple(tensor.shape), tensor.dtype, device=device)
    out.copy_(tensor)
    return out


@dataclass(frozen=True)
class DeviceBuffer:
    """A contiguous range of CUDA device memory, for the transfer layer."""

    address: int
    nbytes: int
    device: int
    stream: int | None  # the stream the copies are ordered on (see device_buffer); None: host
    owner: Any  # what must stay alive while the transfer runs (the tensor, its stream)


def is_cuda_tensor(obj: Any) -> bool:
    """Whether `obj` is a torch tensor on a CUDA device."""
    device = getattr(obj, "device", None)
    return (
        type(obj).__module__.startswith("torch")
        and hasattr(obj, "data_ptr")
        and getattr(device, "type", None) == "cuda"
    )


def device_buffer(tensor: Any, *, own_stream: bool = False) -> DeviceBuffer:
    """The device range of a contiguous CUDA tensor and the stream its copies go on: its device's
    current stream, or with `own_stream` a stream of torch's pool made to wait, now, for the work
    queued so far on the current one. Copies that a worker thread queues later then follow
    exactly the work queued before this call, not work the caller queues meanwhile (which would
    otherwise run between the transfer's chunks and hold it up).

    Raises:
        ValueError: not contiguous.
        CudaError: tensortier cannot reach the CUDA driver (it is loaded separately from torch's
            runtime; the message says why).
    """
    import torch

    from ._buffers import check_tensor_memory

    check_tensor_memory(tensor, "CUDA tensor")
    _core.require_cuda_driver(f"moving a tensor on {tensor.device}")
    index = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
    current = torch.cuda.current_stream(index)
    nbytes = tensor.numel() * tensor.element_size()
    storage = tensor.untyped_storage()  # kept too: set_() meanwhile must not free the memory
    stream = current
    if own_stream:
        stream = torch.cuda.Stream(index)
        if stream.cuda_stream == current.cuda_stream:  # torch's pool hands streams out in turn:
            stream = torch.cuda.Stream(index)  # the caller's may come round; the next is not it
        stream.wait_stream(current)
    return DeviceBuffer(
        tensor.data_ptr(), nbytes, index, int(stream.cuda_stream), (tensor, storage, stream)
    )
