"""tensortier: move tensors between GPU memory, host memory and NVMe files at hardware speed.

The native API::

    import tensortier, torch
    with tensortier.IOHandle() as io:
        t = torch.randn(1 << 20)
        io.pwrite(t, "/nvme/t.bin")
        u = torch.empty_like(t)
        io.pread(u, "/nvme/t.bin")
"""

from __future__ import annotations

from typing import Any

from . import _core
from ._paths import fspath, PathArg
from .checkpoint import (
    DamagedCheckpointError,
    EmptyCheckpointError,
    IncompatibleKeys,
    StateDictMismatchError,
    UnavailableDeviceError,
    WeightsOnlyUnpicklingError,
    load,
    load_into,
    save,
)
from .io import File, IOFuture, IOHandle, IOResult
from .offload import DiskOffloader
from .device import _shape, CuFileError, CudaError, cuda_info, cufile_info, pin, pinned_empty

__version__ = "0.1.0"
__all__ = [
    "CuFileError",
    "CudaError",
    "cuda_info",
    "cufile_info",
    "pin",
    "pinned_empty",
    "DamagedCheckpointError",
    "DiskOffloader",
    "EmptyCheckpointError",
    "File",
    "IOFuture",
    "IOHandle",
    "IOResult",
    "IncompatibleKeys",
    "StateDictMismatchError",
    "UnavailableDeviceError",
    "WeightsOnlyUnpicklingError",
    "aligned_empty",
    "defaults",
    "load",
    "load_into",
    "probe_backends",
    "save",
]


def defaults() -> list[dict[str, Any]]:
    """Every ``TENSORTIER_*`` setting, from the C++ settings table: ``name`` (the option it sets),
    ``env``, ``value`` (in effect), ``default``, ``allowed``, ``description`` and
    ``from_environment`` (the variable is set).

    Raises:
        ValueError: a variable holds a bad value (the message names it and what it allows).
    """
    return list(_core.defaults())


def probe_backends(directory: PathArg = ".") -> list[dict[str, Any]]:
    """For each backend: compiled in, starts, verified O_DIRECT and buffered round trips in
    `directory`, and why not. The Python form of ``tensortier check``."""
    return list(_core.probe_backends(fspath(directory, "directory")))


def aligned_empty(
    shape: int | tuple[int, ...],
    dtype: Any = None,
    *,
    reused: bool = False,
    resident: bool = False,
) -> Any:
    """An uninitialised CPU tensor whose memory is page-aligned (the fastest I/O target).

    Args:
        shape: tensor shape.
        dtype: a torch dtype (default ``torch.uint8``).
        reused: the buffer serves many transfers (a staging buffer): it always gets
            transparent huge pages when 4 MiB or larger (fewer, larger disk requests). Memory
            filled once gets them unless this VM reports free memory to its host, which makes
            their first touch slow (see ``tensortier check``).
        resident: fault every page in now, and lock them (``mlock``) where
            ``RLIMIT_MEMLOCK`` allows, as DeepNVMe's locked tensors and CUDA pinned memory
            are: the first transfer into the buffer then does not pay the page faults. The
            call takes that time instead (up to ~1 s per GiB).

    Raises:
        ValueError: a negative dimension.
        MemoryError: the memory (with ``resident``, all of its pages) cannot be had.
    """
    import torch

    dtype, dims, numel, nbytes = _shape(shape, dtype)
    if nbytes == 0:
        return torch.empty(dims, dtype=dtype)
    buffer = _core.AlignedBuffer(nbytes, reused=reused, resident=resident)  # or MemoryError
    # torch.frombuffer keeps `buffer` alive for as long as the tensor's storage lives.
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(dims)
