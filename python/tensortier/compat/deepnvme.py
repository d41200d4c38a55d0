"""DeepNVMe's Python API (DeepSpeed ``AsyncIOBuilder`` / ``GDSBuilder``), backed by tensortier.

Code written for DeepNVMe runs with its import changed::

    from tensortier.compat.deepnvme import AsyncIOBuilder
    h = AsyncIOBuilder().load().aio_handle(1024**2, 128, True, True, 1)
    h.sync_pwrite(tensor, "/nvme/t.bin")
    h.sync_pread(tensor, "/nvme/t.bin")

Both handles take CPU and CUDA tensors. A CUDA tensor moves through tensortier's ring of pinned
bounce buffers (disk and PCIe overlap; copies ordered on the tensor's device's current stream);
``gds_handle`` uses GPUDirect Storage where cuFile accepts the file and falls back to the ring
elsewhere (DeepNVMe's fails). Without a CUDA driver a CUDA tensor raises ``CudaError`` naming
what is missing.

Differences, all on the side of safety: errors raise (``OSError`` with errno and path,
``ValueError`` for bad arguments) where DeepNVMe returns -1, prints or aborts; writes never
truncate the file; any alignment of size, offset and memory works.
"""

from __future__ import annotations

import errno
import os
from typing import Any

from .. import _core
from ..io import IOFuture, IOHandle

__all__ = ["AsyncIOBuilder", "GDSBuilder", "aio_handle", "gds_handle"]

# DeepNVMe's defaults (deepspeed/runtime/swap_tensor/constants.py).
_DEFAULT_BLOCK_SIZE = 1 << 20
_DEFAULT_QUEUE_DEPTH = 8
_MAX_INFLIGHT = 1 << 30


def _nbytes(buffer: Any) -> int:
    return int(buffer.numel() * buffer.element_size())


def _check_tensor(buffer: Any, what: str) -> None:
    import torch

    if not isinstance(buffer, torch.Tensor):
        raise TypeError(f"{what}: buffer must be a torch tensor, not {type(buffer).__name__}")
    if not buffer.is_contiguous():
        raise ValueError(f"{what}: buffer of shape {tuple(buffer.shape)} is not contiguous")
    if buffer.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{what}: buffer is on {buffer.device}; only CPU and CUDA tensors move")


class aio_handle:  # noqa: N801 - DeepNVMe's name
    """DeepNVMe's ``aio_handle``: parallel async file I/O of whole tensors.

    Args:
        block_size: bytes per request (DeepNVMe's ``block_size``); rounded up to 4 KiB.
        queue_depth: requests in flight per worker.
        single_submit: accepted for compatibility (requests are always batched).
        overlap_events: accepted for compatibility (completions are always overlapped).
        intra_op_parallelism: worker threads (DeepNVMe's ``num_threads`` in older releases).
    """

    _GDS = "off"
    # Async writes of CUDA tensors copy them to host memory first (see _start).
    _SNAPSHOT_CUDA_WRITES = True

    def __init__(
        self,
        block_size: int = _DEFAULT_BLOCK_SIZE,
        queue_depth: int = _DEFAULT_QUEUE_DEPTH,
        single_submit: bool = False,
        overlap_events: bool = False,
        intra_op_parallelism: int = 1,
    ) -> None:
        for name, value in (
            ("block_size", block_size),
            ("queue_depth", queue_depth),
            ("intra_op_parallelism", intra_op_parallelism),
        ):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, not {value!r}")
        self._block_size = block_size
        self._queue_depth = queue_depth
        self._single_submit = bool(single_submit)
        self._overlap_events = bool(overlap_events)
        self._parallelism = intra_op_parallelism
        chunk = -(-block_size // 4096) * 4096
        self._io = IOHandle(
            chunk_size=chunk,
            queue_depth=queue_depth,
            workers=intra_op_parallelism,
            max_inflight_bytes=max(chunk, min(chunk * queue_depth * intra_op_parallelism,
                                              _MAX_INFLIGHT)),
            gds=self._GDS,
        )
        self._pending: list[tuple[IOFuture, Any, str, int, bool]] = []

    # ---- settings -------------------------------------------------------------------------
    def get_block_size(self) -> int:
        return self._block_size

    def get_queue_depth(self) -> int:
        return self._queue_depth

    def get_single_submit(self) -> bool:
        return self._single_submit

    def get_overlap_events(self) -> bool:
        return self._overlap_events

    def get_intra_op_parallelism(self) -> int:
        return self._parallelism

    def get_thread_count(self) -> int:
        return self._parallelism

    # ---- I/O ------------------------------------------------------------------------------
    def sync_pread(self, buffer: Any, filename: str, file_offset: int = 0) -> int:
        """Reads ``buffer.nbytes`` bytes at `file_offset` of `filename`; returns the count of
        completed operations (1). The file must hold the whole range."""
        self.async_pread(buffer, filename, file_offset)
        return self.wait()

    def sync_pwrite(self, buffer: Any, filename: str, file_offset: int = 0) -> int:
        """Writes all of `buffer` at `file_offset` of `filename` (created if missing, never
        truncated); returns the count of completed operations (1)."""
        self.async_pwrite(buffer, filename, file_offset)
        return self.wait()

    def async_pread(self, buffer: Any, filename: str, file_offset: int = 0) -> int:
        """Starts a read; ``wait()`` completes it. Returns 0."""
        return self._start("read", buffer, filename, file_offset, validate=False)

    def async_pwrite(self, buffer: Any, filename: str, file_offset: int = 0) -> int:
        """Starts a write; ``wait()`` completes it. Returns 0. ``aio_handle`` copies a CUDA tensor
        to host memory before this returns (as DeepNVMe does): work queued afterwards may change
        it. ``gds_handle`` reads it while the write runs: leave it unchanged until ``wait()``."""
        return self._start("write", buffer, filename, file_offset, validate=False, snapshot=True)

    def pread(
        self, buffer: Any, filename: str, validate: bool, async_op: bool, file_offset: int = 0
    ) -> int:
        """DeepNVMe's ``pread(buffer, filename, validate, async)``."""
        self._start("read", buffer, filename, file_offset, validate)
        return 0 if async_op else self.wait()

    def pwrite(
        self, buffer: Any, filename: str, validate: bool, async_op: bool, file_offset: int = 0
    ) -> int:
        """DeepNVMe's ``pwrite(buffer, filename, validate, async)``. An async write of a CUDA
        tensor copies it to host memory before this returns, as ``async_pwrite``."""
        self._start("write", buffer, filename, file_offset, validate, snapshot=async_op)
        return 0 if async_op else self.wait()

    def read(self, buffer: Any, filename: str, validate: bool) -> int:
        """Reads the whole file into `buffer` (sizes must match)."""
        _check_tensor(buffer, "read")
        size = os.path.getsize(filename)
        if size != _nbytes(buffer):
            raise ValueError(f"read: {filename} holds {size} bytes, buffer {_nbytes(buffer)}")
        return self.pread(buffer, filename, validate, False)

    def write(self, buffer: Any, filename: str, validate: bool) -> int:
        """Writes `buffer` as the whole file `filename` (truncated first, as DeepNVMe does)."""
        _check_tensor(buffer, "write")
        with open(filename, "wb"):
            pass
        return self.pwrite(buffer, filename, validate, False)

    def wait(self) -> int:
        """Waits for every operation started; returns how many completed. Raises the first
        error (``OSError``, or ``CudaError``/``CuFileError``) after all have finished."""
        pending, self._pending = self._pending, []
        first: BaseException | None = None
        for future, buffer, filename, offset, validate in pending:
            try:
                future.wait()
                if validate:
                    _validate(buffer, filename, offset)
            except (OSError, RuntimeError) as e:  # RuntimeError: CudaError / CuFileError
                first = first or e
        if first is not None:
            raise first
        return len(pending)

    # ---- pinned ("locked") host tensors -----------------------------------------------------
    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: Any) -> Any:
        """An uninitialised 1-D tensor of `num_elem` elements of `example_tensor`'s dtype in
        pinned memory (CUDA), else page-aligned memory (the fastest O_DIRECT target) with every
        page faulted in and locked where ``RLIMIT_MEMLOCK`` allows, as DeepNVMe's are."""
        import torch

        from .. import aligned_empty

        if torch.cuda.is_available():
            return torch.empty(num_elem, dtype=example_tensor.dtype, pin_memory=True)
        return aligned_empty(num_elem, example_tensor.dtype, reused=True, resident=True)

    def free_cpu_locked_tensor(self, tensor: Any) -> bool:
        """Releases a tensor from ``new_cpu_locked_tensor`` (its memory goes with the last
        reference). Returns True."""
        storage = tensor.untyped_storage()
        if storage.resizable():
            storage.resize_(0)
        return True

    def close(self) -> None:
        """Waits for everything in flight and stops the workers."""
        self._io.close()

    # ---- internals ------------------------------------------------------------------------
    def _start(
        self,
        op: str,
        buffer: Any,
        filename: str,
        offset: int,
        validate: bool,
        snapshot: bool = False,
    ) -> int:
        what = f"{'pread' if op == 'read' else 'pwrite'}"
        _check_tensor(buffer, what)
        if snapshot and self._SNAPSHOT_CUDA_WRITES and buffer.device.type == "cuda":
            # DeepNVMe's io_op_desc_t copies a CUDA tensor to host memory when the write is
            # submitted, and DeepSpeed relies on it: it may reuse the tensor before wait(). Our
            # device path would queue its copies later on the tensor's stream, after such work.
            buffer = buffer.detach().to("cpu")
        if not isinstance(offset, int) or offset < 0:
            raise ValueError(f"{what}: file_offset must be a non-negative int, not {offset!r}")
        path = os.fspath(filename)
        nbytes = _nbytes(buffer)
        if op == "read":
            size = os.path.getsize(path)
            if offset + nbytes > size:
                raise ValueError(
                    f"pread: {path} holds {size} bytes, fewer than file_offset {offset} + "
                    f"buffer {nbytes}"
                )
            future = self._io.pread_async(buffer, path, offset)
        else:
            future = self._io.pwrite_async(buffer, path, offset)
        self._pending.append((future, buffer, path, offset, validate))
        return 0


def _validate(buffer: Any, filename: str, offset: int) -> None:
    """Compares `buffer` with the file through the page cache (DeepNVMe's ``validate``)."""
    import torch

    nbytes = _nbytes(buffer)
    with open(filename, "rb") as f:
        f.seek(offset)
        on_disk = f.read(nbytes)
    if buffer.detach().reshape(-1).view(torch.uint8).cpu().numpy().tobytes() != on_disk:
        raise OSError(errno.EIO, f"validation failed: {filename} at offset {offset}", filename)


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
        self._pinned: dict[int, Any] = {}  # data_ptr -> _core.CuFileBuffer

    def pin_device_tensor(self, tensor: Any) -> bool:
        """Registers a CUDA tensor's memory with cuFile (skipped without cuFile), through the
        tensor's own device's primary context whichever device is current. Returns True."""
        _check_tensor(tensor, "pin_device_tensor")
        if tensor.device.type != "cuda":
            raise ValueError(f"pin_device_tensor: tensor is on {tensor.device}, not a GPU")
        address = int(tensor.data_ptr())
        if address in self._pinned or not _core.cufile()["available"]:
            return True
        nbytes = _nbytes(tensor)
        if nbytes > 0:
            self._pinned[address] = (_core.CuFileBuffer(address, nbytes), tensor)
        return True

    def unpin_device_tensor(self, tensor: Any) -> bool:
        """Undoes ``pin_device_tensor`` now (GIL released while cuFile deregisters). Returns
        True."""
        entry = self._pinned.pop(int(tensor.data_ptr()), None)
        if entry is not None:
            entry[0].release()
        return True

    def new_pinned_device_tensor(self, num_elem: int, example_tensor: Any) -> Any:
        """An uninitialised 1-D tensor on `example_tensor`'s GPU, registered with cuFile."""
        import torch

        device = example_tensor.device if example_tensor.device.type == "cuda" else "cuda"
        tensor = torch.empty(num_elem, dtype=example_tensor.dtype, device=device)
        self.pin_device_tensor(tensor)
        return tensor

    def free_pinned_device_tensor(self, tensor: Any) -> bool:
        """Deregisters and frees a tensor from ``new_pinned_device_tensor``. Returns True."""
        self.unpin_device_tensor(tensor)
        tensor.untyped_storage().resize_(0)
        return True

    def close(self) -> None:
        for registration, _ in self._pinned.values():
            registration.release()
        self._pinned.clear()
        super().close()


class _Loaded:
    """What ``Builder().load()`` returns: the op module with the handle classes."""

    aio_handle = aio_handle
    gds_handle = gds_handle


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
