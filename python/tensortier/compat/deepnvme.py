"""DeepNVMe's Python API (DeepSpeed's ``AsyncIOBuilder``, ``GDSBuilder`` and ``PinMemoryBuilder``),
backed by tensortier: code written for DeepNVMe runs with its import changed. The guide's
compatibility page says how misuse is answered and where it differs from DeepNVMe."""

from __future__ import annotations

from typing import Any

from .. import _core
from ..io import IOHandle

__all__ = [
    "AsyncIOBuilder",
    "GDSBuilder",
    "PinMemoryBuilder",
    "aio_handle",
    "aio_read",
    "aio_write",
    "deepspeed_memcpy",
    "gds_handle",
    "pin_handle",
]

# The handles' defaults in DeepSpeed's bindings (csrc/aio/py_lib/py_ds_aio.cpp).
_DEFAULT_BLOCK_SIZE = 1 << 20
_DEFAULT_QUEUE_DEPTH = 128
# DeepNVMe's get_alignment(): intra_op_parallelism x its O_DIRECT alignment.
_O_DIRECT_ALIGNMENT = 512
_require_tensor = _core.deepnvme_tensor


class aio_handle(_core.DeepNvmeHandle):  # noqa: N801 - DeepNVMe's name
    """DeepNVMe's ``aio_handle``: parallel async file I/O of whole tensors.

    Args:
        block_size: bytes per request (DeepNVMe's ``block_size``); rounded up to 4 KiB, at most
            the engine's largest chunk (1 GiB).
        queue_depth: requests in flight per worker (at most the engine's 4096 run at once).
        single_submit: accepted for compatibility (requests are always batched).
        overlap_events: accepted for compatibility (completions are always overlapped).
        intra_op_parallelism: worker threads, at most the engine's 256 (``num_threads=`` as in
            older releases also works).

    Every C int DeepNVMe's constructor takes is taken (the getters answer it), and what its
    binding refuses is a ``TypeError`` here too (not an integer, or not a 32-bit one); a value
    below 1, with which DeepNVMe's handle fails at its first transfer, is a ``ValueError``.

    Threads may share a handle: as DeepNVMe's, a blocking call (``sync_pread``, ``pread`` with
    ``async=False``...) holds the handle from its start to the end of its wait, which also
    completes the operations started before it (its count includes them).
    """

    _GDS = "off"
    # Async writes of CUDA tensors copy them to host memory first.
    _SNAPSHOT_CUDA_WRITES = True

    def __init__(
        self,
        block_size: int = _DEFAULT_BLOCK_SIZE,
        queue_depth: int = _DEFAULT_QUEUE_DEPTH,
        single_submit: bool = False,
        overlap_events: bool = False,
        intra_op_parallelism: int = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__(block_size, queue_depth, single_submit, overlap_events,
                         intra_op_parallelism, **kwargs)
        self._io = IOHandle(**self._engine_settings(), gds=self._GDS)

    # ---- settings (the getters DeepNVMe's handle has are DeepNvmeHandle's) -----------------
    def get_alignment(self) -> int:
        """DeepNVMe's: ``intra_op_parallelism * 512`` (its parallel ops split a buffer evenly
        between threads). tensortier needs no alignment; callers that assert on it keep working."""
        return self.get_intra_op_parallelism() * _O_DIRECT_ALIGNMENT

    # ---- I/O ------------------------------------------------------------------------------
    def sync_pread(self, buffer: Any, filename: str, file_offset: int = 0) -> int:
        """Reads ``buffer.nbytes`` bytes at `file_offset` of `filename` (what the file holds of
        them); returns the count of completed operations (1), or -1 when the file cannot be
        opened."""
        return self.pread(buffer, filename, False, False, file_offset)

    def sync_pwrite(self, buffer: Any, filename: str, file_offset: int = 0) -> int:
        """Writes all of `buffer` at `file_offset` of `filename` (created if missing, never
        truncated); returns the count of completed operations (1), or -1 when the file cannot
        be opened."""
        return self.pwrite(buffer, filename, False, False, file_offset)

    def async_pread(self, buffer: Any, filename: str, file_offset: int = 0) -> int:
        """Starts a read; ``wait()`` completes it. Returns 0, or -1 when the file cannot be
        opened (nothing started)."""
        return self.pread(buffer, filename, False, True, file_offset)

    def async_pwrite(
        self,
        buffer: Any,
        filename: str | int | None = None,
        file_offset: int = 0,
        *,
        fd: int | None = None,
    ) -> int:
        """Starts a write to `filename`, or to an open file descriptor (left open) given in its
        place or as ``fd=`` (DeepSpeed's second overload); ``wait()`` completes it. Returns 0.
        As DeepNVMe's, the bytes of a tensor not in locked memory (an
        unpinned CPU tensor not from ``new_cpu_locked_tensor``; with ``aio_handle`` a CUDA
        tensor too) are copied before this returns: the caller may change it at once. Locked
        tensors (and, with ``gds_handle``, CUDA tensors) are read while the write runs: leave
        them unchanged until ``wait()``."""
        return self._async_pwrite(buffer, filename, file_offset, fd)

    def pread(
        self,
        buffer: Any,
        filename: str,
        validate: bool,
        async_op: bool | None = None,
        file_offset: int = 0,
        **kwargs: Any,
    ) -> int:
        """DeepNVMe's ``pread(buffer, filename, validate, async, file_offset=0)`` (``async`` is a
        keyword Python reserves: pass it by position, as ``async_op=``, or ``**{"async": x}``)."""
        return self._call("read", buffer, filename, validate, async_op, file_offset, kwargs)

    def pwrite(
        self,
        buffer: Any,
        filename: str,
        validate: bool,
        async_op: bool | None = None,
        file_offset: int = 0,
        **kwargs: Any,
    ) -> int:
        """DeepNVMe's ``pwrite(buffer, filename, validate, async, file_offset=0)``. An async write
        copies the tensor first where ``async_pwrite`` does."""
        return self._call("write", buffer, filename, validate, async_op, file_offset, kwargs)

    def read(self, buffer: Any, filename: str, validate: bool, file_offset: int = 0) -> int:
        """DeepNVMe's synchronous ``read``: at offset 0 the file's size must be the buffer's;
        at `file_offset` > 0 the buffer's bytes from there must be in the file. Returns 0."""
        return self._whole("read", buffer, filename, validate, file_offset)

    def write(self, buffer: Any, filename: str, validate: bool, file_offset: int = 0) -> int:
        """DeepNVMe's synchronous ``write``: all of `buffer` at `file_offset` (the file is created
        if missing, never truncated: bytes past the write stay). Returns 0."""
        return self._whole("write", buffer, filename, validate, file_offset)

    def wait(self) -> int:
        """Waits for every operation started; returns how many completed. Raises the first
        error (``OSError``, or ``CudaError``/``CuFileError``) after all have finished."""
        count = self._wait()
        # And what a call Ctrl-C interrupted after the engine took its operation left
        # unrecorded here: the IOHandle keeps every operation until it is waited for.
        self._io.wait_all()
        return count

    # ---- pinned ("locked") host tensors -----------------------------------------------------
    def new_cpu_locked_tensor(
        self, num_elem: int, example_tensor: Any = None, **kwargs: Any
    ) -> Any:
        """An uninitialised 1-D tensor of `num_elem` elements of `example_tensor`'s dtype in
        pinned memory (CUDA), else page-aligned memory (the fastest O_DIRECT target) with every
        page faulted in and locked where ``RLIMIT_MEMLOCK`` allows, as DeepNVMe's are. Its memory
        goes with ``free_cpu_locked_tensor`` or with its last reference. (DeepSpeed spells the
        second argument ``example_tenosr``; both names work.)"""
        example_tensor = _core.deepnvme_argument("new_cpu_locked_tensor", example_tensor, kwargs,
                                                 "example_tensor", "example_tenosr")
        return _new_locked(num_elem, example_tensor)

    def free_cpu_locked_tensor(self, tensor: Any) -> bool:
        """Releases a tensor from ``new_cpu_locked_tensor`` of any handle (``pin_handle``'s
        too: DeepSpeed has one manager per process), or a tensor starting at its address, and
        returns True: pinned memory is freed now (the tensor, and views of it, must not be used
        afterwards), page-aligned memory with the tensor's last reference. Any other tensor is
        left alone: False. Reads and writes that handles started on its memory are waited for
        first (DeepSpeed's frees the memory under them)."""
        _require_tensor(tensor, "free_cpu_locked_tensor", "tensor")
        return _locked.free(int(tensor.data_ptr()), tensor)

    def is_pinned(self, buffer: Any) -> bool:
        """Whether all of `buffer` is page-locked host memory: pinned by torch, in (a view of) a
        tensor from ``new_cpu_locked_tensor`` of any handle (``pin_handle``'s too), or, where a
        CUDA driver is loaded, page-locked with CUDA by anyone."""
        _require_tensor(buffer, "is_pinned")
        return _locked.pinned(buffer)

    def close(self) -> None:
        """Waits for everything in flight and stops the workers."""
        self._close()


class gds_handle(aio_handle):  # noqa: N801 - DeepNVMe's name
    """DeepNVMe's ``gds_handle``: as ``aio_handle``, with GPUDirect Storage for CUDA tensors where
    cuFile accepts the file (the bounce ring elsewhere). ``pin_device_tensor`` registers device
    memory with cuFile when cuFile is available and does nothing otherwise."""

    _GDS = "auto"
    # DeepNVMe's GDS ops read device memory while they run, with no host copy: the tensor must
    # stay unchanged until wait(), as there.
    _SNAPSHOT_CUDA_WRITES = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pinned = _core.CuFileRegistrations()  # by data_ptr, each with its tensor

    def get_alignment(self) -> int:
        """DeepNVMe's: 512 whatever ``intra_op_parallelism`` (its GDS handle gives its host I/O
        one thread and leaves the parallelism to cuFile)."""
        return _O_DIRECT_ALIGNMENT

    def pin_device_tensor(self, tensor: Any) -> bool:
        """Registers a CUDA tensor's memory with cuFile (skipped without cuFile, or where it would
        run in its compatibility mode: nothing DMAs into registered memory then), through the
        tensor's own device's primary context whichever device is current. Returns True."""
        _require_tensor(tensor, "pin_device_tensor", device=True, contiguous=True, gpu=True)
        self._pinned.add(int(tensor.data_ptr()), int(tensor.nbytes), tensor)
        return True

    def unpin_device_tensor(self, tensor: Any) -> bool:
        """Undoes ``pin_device_tensor`` now (GIL released while cuFile deregisters). Returns
        True."""
        self._pinned.remove(int(tensor.data_ptr()))
        return True

    def new_pinned_device_tensor(
        self, num_elem: int, example_tensor: Any = None, **kwargs: Any
    ) -> Any:
        """An uninitialised 1-D tensor on `example_tensor`'s GPU, registered with cuFile."""
        import torch

        example_tensor = _core.deepnvme_argument("new_pinned_device_tensor", example_tensor, kwargs,
                                                 "example_tensor", "example_tenosr")
        device = example_tensor.device if example_tensor.device.type == "cuda" else "cuda"
        tensor = torch.empty(num_elem, dtype=example_tensor.dtype, device=device)
        self.pin_device_tensor(tensor)
        return tensor

    def free_pinned_device_tensor(self, tensor: Any) -> bool:
        """Deregisters a tensor from ``new_pinned_device_tensor`` (as DeepNVMe's, the tensor
        stays usable; its memory goes with its last reference). Returns True."""
        return self.unpin_device_tensor(tensor)

    def close(self) -> None:
        self._pinned.clear()
        super().close()


def _one_shot(method: str, buffer: Any, filename: str, block_size: int, queue_depth: int,
              single_submit: bool, overlap_events: bool, validate: bool) -> int:
    h = aio_handle(block_size, queue_depth, single_submit, overlap_events, 1)
    try:
        return int(getattr(h, method)(buffer, filename, validate))
    finally:
        h.close()


def aio_read(buffer: Any, filename: str, block_size: int, queue_depth: int,
             single_submit: bool, overlap_events: bool, validate: bool) -> int:
    """DeepNVMe's one-shot ``aio_read``: the whole file (its size must be the buffer's) into
    `buffer`. Returns 0."""
    return _one_shot("read", buffer, filename, block_size, queue_depth, single_submit,
                     overlap_events, validate)


def aio_write(buffer: Any, filename: str, block_size: int, queue_depth: int,
              single_submit: bool, overlap_events: bool, validate: bool) -> int:
    """DeepNVMe's one-shot ``aio_write``: all of `buffer` at the start of `filename`. Returns 0."""
    return _one_shot("write", buffer, filename, block_size, queue_depth, single_submit,
                     overlap_events, validate)


def deepspeed_memcpy(dest: Any, src: Any) -> int:
    """DeepNVMe's ``deepspeed_memcpy``: `src`'s elements into `dest` (same size). Returns 0."""
    if dest.numel() != src.numel():
        raise ValueError(f"deepspeed_memcpy: dest has {dest.numel()} elements, src {src.numel()}")
    dest.copy_(src.reshape(dest.shape))
    return 0


class _Loaded:
    """What ``Builder().load()`` returns: the op module's functions and handle classes."""

    aio_handle = aio_handle
    gds_handle = gds_handle
    aio_read = staticmethod(aio_read)
    aio_write = staticmethod(aio_write)
    deepspeed_memcpy = staticmethod(deepspeed_memcpy)


# DeepSpeed's pinned-tensor manager, one per process: the locked tensors of every handle (the
# storage weakly: it lives as long as any view of the tensor, which its Python object need not).
_locked = _core.LockedTensors()


def _new_locked(num_elem: int, example_tensor: Any) -> Any:
    import torch

    from .. import aligned_empty

    _require_tensor(example_tensor, "new_cpu_locked_tensor", "example_tensor")
    if torch.cuda.is_available():
        tensor = torch.empty(num_elem, dtype=example_tensor.dtype, pin_memory=True)
    else:
        tensor = aligned_empty(num_elem, example_tensor.dtype, reused=True, resident=True)
    _locked.add(int(tensor.data_ptr()), int(tensor.nbytes), tensor.untyped_storage())
    return tensor


class pin_handle:  # noqa: N801 - DeepSpeed's name
    """DeepSpeed's ``pin_memory`` op handle (``PinMemoryBuilder().load().pin_handle()``): locked
    host tensors, in the one registry the ``aio_handle`` and ``gds_handle`` use."""

    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: Any) -> Any:
        """An uninitialised 1-D tensor of `num_elem` elements of `example_tensor`'s dtype in
        locked memory, as ``aio_handle.new_cpu_locked_tensor``'s."""
        return _new_locked(num_elem, example_tensor)

    def free_cpu_locked_tensor(self, locked_tensor: Any) -> bool:
        """As ``aio_handle.free_cpu_locked_tensor``: True when `locked_tensor` starts at a locked
        tensor of any handle, which is freed."""
        _require_tensor(locked_tensor, "free_cpu_locked_tensor", "locked_tensor")
        return _locked.free(int(locked_tensor.data_ptr()), locked_tensor)

    def free_cpu_locked_tensor_by_ptr(self, address: int) -> bool:
        """Frees the locked tensor (of any handle) whose memory starts at `address`, even where
        the tensor's ``.data`` has since been pointed elsewhere; True when there was one."""
        # DeepSpeed's binding takes a uintptr_t, as pybind11 converts one.
        return _locked.free(
            _core.c_integer(address, "free_cpu_locked_tensor_by_ptr", "address", 0, 64, True)
        )

    def is_pinned(self, buffer: Any) -> bool:
        """As ``aio_handle.is_pinned``: whether all of `buffer` is page-locked host memory."""
        _require_tensor(buffer, "is_pinned")
        return _locked.pinned(buffer)


class _PinMemoryLoaded:
    """What ``PinMemoryBuilder().load()`` returns: the op module's handle class."""

    pin_handle = pin_handle


class PinMemoryBuilder:
    """``PinMemoryBuilder().load().pin_handle()``, as in DeepSpeed."""

    BUILD_VAR = "DS_BUILD_PIN_MEMORY"
    NAME = "pin_memory"

    def absolute_name(self) -> str:
        return f"deepspeed.ops.pin_memory.{self.NAME}_op"

    def is_compatible(self, verbose: bool = False) -> bool:
        return True

    def load(self, verbose: bool = False) -> type[_PinMemoryLoaded]:
        return _PinMemoryLoaded


class AsyncIOBuilder:
    """``AsyncIOBuilder().load().aio_handle(...)``, as in DeepSpeed."""

    NAME = "async_io"

    def is_compatible(self, verbose: bool = False) -> bool:
        return True

    def load(self, verbose: bool = True) -> type[_Loaded]:
        return _Loaded


class GDSBuilder(AsyncIOBuilder):
    """``GDSBuilder().load().gds_handle(...)``, as in DeepSpeed."""

    NAME = "gds"
