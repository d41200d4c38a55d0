"""DeepNVMe's Python API (DeepSpeed ``AsyncIOBuilder`` / ``GDSBuilder``), backed by tensortier.

Code written for DeepNVMe runs with its import changed::

    from tensortier.compat.deepnvme import AsyncIOBuilder
    h = AsyncIOBuilder().load().aio_handle(1024**2, 128, True, True, 1)
    h.sync_pwrite(tensor, "/nvme/t.bin")
    h.sync_pread(tensor, "/nvme/t.bin")

``PinMemoryBuilder().load().pin_handle()`` is DeepSpeed's ``pin_memory`` op (its
``DS_PIN_MEMORY_BACKEND=native``): its locked tensors and those of every ``aio_handle`` and
``gds_handle`` are one registry, as DeepSpeed's one pinned-tensor manager per process, so each
handle's ``is_pinned`` knows the others' tensors; where a CUDA driver is loaded, ``is_pinned`` is
also True for host memory that anyone page-locked with CUDA.

Both handles take CPU and CUDA tensors. A CUDA tensor moves through tensortier's ring of pinned
bounce buffers (disk and PCIe overlap; copies ordered on the tensor's device's current stream);
``gds_handle`` uses GPUDirect Storage where cuFile accepts the file and falls back to the ring
elsewhere (DeepNVMe's fails). Without a CUDA driver a CUDA tensor raises ``CudaError`` naming
what is missing.

Misuse gets DeepNVMe's answer: a file that cannot be opened or stat'ed (missing, no
permission, a missing directory) makes the call return -1, with DeepNVMe's message as a
``RuntimeWarning`` (DeepNVMe prints it), and starts nothing; an argument of the wrong type raises
``TypeError``; a non-contiguous tensor is read and written through a contiguous copy, as
DeepNVMe's bounce buffer does; a read past the end of the file fills what the file holds (the
rest of the buffer stays as it was: DeepNVMe lets buffers exceed the file for alignment).

Differences, all on the side of safety: an I/O error of a transfer started raises ``OSError``
(errno and path) from ``wait()`` where DeepNVMe ignores it, and what DeepNVMe aborts the process
for (a negative ``file_offset``; ``read()`` of a file whose size is not the buffer's, or that
ends before the buffer does when read at an offset) raises ``ValueError``; any alignment of
size, offset and memory works (no multiple of ``intra_op_parallelism`` needed); an
asynchronous read fills the tensor itself while it runs (DeepNVMe reads unpinned tensors
through a bounce buffer copied out at ``wait()``): either way, use it only after ``wait()``.
"""

from __future__ import annotations

import errno
import os
import sys
import threading
import warnings
from typing import Any, NamedTuple

from .. import _core
from ..io import IOFuture, IOHandle

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
_MAX_INFLIGHT = 1 << 30
# DeepNVMe's get_alignment(): intra_op_parallelism x its O_DIRECT alignment.
_O_DIRECT_ALIGNMENT = 512
# DeepSpeed's bindings take the handle's settings as C ints: pybind11 refuses others (TypeError).
_C_INT_BITS = 32
# file_offset is an int64_t there.
_OFFSET_BITS = 64
# A uintptr_t, as free_cpu_locked_tensor_by_ptr takes it.
_ADDRESS_BITS = 64


# DeepSpeed's bindings take C ints, int64s and uintptr_ts, and C++ bools, as pybind11 converts
# them: ``_integer(value, what, name, minimum, bits, unsigned=False)`` and
# ``_c_bool(value, what, name)`` (TypeError or ValueError naming the argument).
_integer = _core.c_integer
_c_bool = _core.c_bool


def _require_tensor(value: Any, what: str, name: str = "buffer") -> None:
    """TypeError unless `value` is a torch tensor (what DeepNVMe's binding takes)."""
    import torch

    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{what}: {name} must be a torch tensor, not {type(value).__name__}")


def _check_tensor(buffer: Any, what: str, contiguous: bool = False) -> None:
    _require_tensor(buffer, what)
    if contiguous and not buffer.is_contiguous():
        raise ValueError(f"{what}: buffer of shape {tuple(buffer.shape)} is not contiguous")
    if buffer.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{what}: buffer is on {buffer.device}; only CPU and CUDA tensors move")


class aio_handle:  # noqa: N801 - DeepNVMe's name
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
    # Async writes of CUDA tensors copy them to host memory first (see _start).
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
        if "num_threads" in kwargs:  # the fifth argument's name before DeepSpeed 0.15
            intra_op_parallelism = kwargs.pop("num_threads")
        if kwargs:
            raise TypeError(f"aio_handle() got unexpected keyword arguments: {sorted(kwargs)}")
        self._block_size, self._queue_depth, self._parallelism = (
            _integer(value, "aio_handle", name, 1, bits=_C_INT_BITS) for value, name in (
                (block_size, "block_size"), (queue_depth, "queue_depth"),
                (intra_op_parallelism, "intra_op_parallelism")))
        self._single_submit = _c_bool(single_submit, "aio_handle", "single_submit")
        self._overlap_events = _c_bool(overlap_events, "aio_handle", "overlap_events")
        # Every size DeepNVMe takes works: the engine runs with the nearest it allows; the
        # getters answer what was given.
        chunk = _core.clamp_to_setting(-(-self._block_size // 4096) * 4096, "TENSORTIER_CHUNK_SIZE")
        depth = _core.clamp_to_setting(self._queue_depth, "TENSORTIER_QUEUE_DEPTH")
        workers = _core.clamp_to_setting(self._parallelism, "TENSORTIER_WORKERS")
        self._io = IOHandle(
            chunk_size=chunk,
            queue_depth=depth,
            workers=workers,
            max_inflight_bytes=max(chunk, min(chunk * depth * workers, _MAX_INFLIGHT)),
            gds=self._GDS,
        )
        self._pending: list[_Pending] = []
        # DeepNVMe's handle mutex: held while an operation starts, and by a blocking call to the
        # end of its wait (another thread's wait() cannot take its operation half done).
        self._mutex = threading.Lock()

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

    def get_alignment(self) -> int:
        """DeepNVMe's: ``intra_op_parallelism * 512`` (its parallel ops split a buffer evenly
        between threads). tensortier needs no alignment; callers that assert on it keep working."""
        return self._parallelism * _O_DIRECT_ALIGNMENT

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
        if (filename is None) == (fd is None):
            raise TypeError("async_pwrite: give a filename or an fd (one of them)")
        target = filename if fd is None else fd
        with self._mutex:
            return self._start("write", buffer, target, file_offset, validate=False,
                               snapshot=True, descriptor_ok=True)

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
        _check_tensor(buffer, "read")
        validate = _c_bool(validate, "read", "validate")
        _filename(filename, "read")
        file_offset = _integer(file_offset, "read", "file_offset", 0, bits=_OFFSET_BITS)
        try:
            size = os.path.getsize(filename)
        except OSError as e:
            return _failed(filename, "fstat for read", e.errno)
        nbytes = _nbytes(buffer)
        if file_offset == 0 and size != nbytes:
            raise ValueError(f"read: {filename} holds {size} bytes, buffer {nbytes}")
        if file_offset + nbytes > size:
            # A read that stopped at the end would leave the buffer's tail as it was, unseen.
            raise ValueError(
                f"read: {filename} holds {size} bytes, fewer than the buffer's {nbytes} "
                f"from offset {file_offset}"
            )
        return 0 if self.pread(buffer, filename, validate, False, file_offset) >= 0 else -1

    def write(self, buffer: Any, filename: str, validate: bool, file_offset: int = 0) -> int:
        """DeepNVMe's synchronous ``write``: all of `buffer` at `file_offset` (the file is created
        if missing, never truncated: bytes past the write stay). Returns 0."""
        _check_tensor(buffer, "write")
        validate = _c_bool(validate, "write", "validate")
        return 0 if self.pwrite(buffer, filename, validate, False, file_offset) >= 0 else -1

    def wait(self) -> int:
        """Waits for every operation started; returns how many completed. Raises the first
        error (``OSError``, or ``CudaError``/``CuFileError``) after all have finished."""
        with self._mutex:
            return self._wait_locked()

    def _wait_locked(self) -> int:
        """wait(), the mutex held. Ctrl-C interrupts it with every operation still pending: the
        next wait() waits for them, counts them and finishes them (copies, validation)."""
        for entry in self._pending:
            try:
                entry.future.wait()
            except (OSError, RuntimeError):  # raised below, in order
                pass
        pending, self._pending = self._pending, []
        first: BaseException | None = None
        for future, buffer, filename, offset, validate, copy_to in pending:
            try:
                future.wait()
                if copy_to is not None:  # a non-contiguous tensor read through a copy
                    copy_to.copy_(buffer)
                if validate:
                    _validate(buffer, filename, offset)
            except (OSError, RuntimeError) as e:  # RuntimeError: CudaError / CuFileError
                first = first or e
        if first is not None:
            raise first
        return len(pending)

    # ---- pinned ("locked") host tensors -----------------------------------------------------
    def new_cpu_locked_tensor(
        self, num_elem: int, example_tensor: Any = None, **kwargs: Any
    ) -> Any:
        """An uninitialised 1-D tensor of `num_elem` elements of `example_tensor`'s dtype in
        pinned memory (CUDA), else page-aligned memory (the fastest O_DIRECT target) with every
        page faulted in and locked where ``RLIMIT_MEMLOCK`` allows, as DeepNVMe's are. Its memory
        goes with ``free_cpu_locked_tensor`` or with its last reference. (DeepSpeed spells the
        second argument ``example_tenosr``; both names work.)"""
        example_tensor = _example_argument("new_cpu_locked_tensor", example_tensor, kwargs)
        return _new_locked(num_elem, example_tensor)

    def free_cpu_locked_tensor(self, tensor: Any) -> bool:
        """Releases a tensor from ``new_cpu_locked_tensor`` of any handle (``pin_handle``'s
        too: DeepSpeed has one manager per process), or a tensor starting at its address, and
        returns True: pinned memory is freed now (the tensor, and views of it, must not be used
        afterwards), page-aligned memory with the tensor's last reference. Any other tensor is
        left alone: False."""
        _require_tensor(tensor, "free_cpu_locked_tensor", "tensor")
        return _free_locked(int(tensor.data_ptr()), tensor)

    def is_pinned(self, buffer: Any) -> bool:
        """Whether all of `buffer` is page-locked host memory: pinned by torch, in (a view of) a
        tensor from ``new_cpu_locked_tensor`` of any handle (``pin_handle``'s too), or, where a
        CUDA driver is loaded, page-locked with CUDA by anyone."""
        _require_tensor(buffer, "is_pinned")
        return _is_pinned(buffer)

    def close(self) -> None:
        """Waits for everything in flight and stops the workers."""
        with self._mutex:
            self._io.close()

    # ---- internals ------------------------------------------------------------------------
    def _call(self, op: str, buffer: Any, filename: str, validate: bool, async_op: bool | None,
              file_offset: int, kwargs: dict[str, Any]) -> int:
        """``pread``/``pwrite``: starts `op`, then waits for it unless `async_op`."""
        what = "pread" if op == "read" else "pwrite"
        async_op = _c_bool(_aliased_argument(what, async_op, kwargs, "async_op", "async"), what,
                           "async")
        validate = _c_bool(validate, what, "validate")
        with self._mutex:
            if self._start(op, buffer, filename, file_offset, validate,
                           snapshot=async_op and op == "write") < 0:
                return -1
            return 0 if async_op else self._wait_locked()

    def _snapshot(self, buffer: Any) -> bool:
        """Whether an async write copies `buffer` first, as DeepNVMe copies any buffer that is
        not locked host memory (DeepSpeed may reuse it before wait()); our device path would
        queue a CUDA tensor's copies after work the caller queues meanwhile."""
        if buffer.device.type == "cuda":
            return self._SNAPSHOT_CUDA_WRITES
        return not self.is_pinned(buffer)

    def _start(self, op: str, buffer: Any, filename: str | int, offset: int, validate: bool,
               snapshot: bool = False, descriptor_ok: bool = False) -> int:
        """Starts `op`; `filename` may be an open descriptor only with `descriptor_ok`
        (``async_pwrite``'s second overload: every other call takes a name)."""
        what = "pread" if op == "read" else "pwrite"
        _check_tensor(buffer, what)
        if not descriptor_ok:
            _filename(filename, what)
        offset = _integer(offset, what, "file_offset", 0, bits=_OFFSET_BITS)
        copy_to = None
        if not buffer.is_contiguous():
            # DeepNVMe moves such a tensor through a contiguous bounce buffer, copied in at the
            # call (writes) or out at wait() (reads).
            if op == "read":
                copy_to, buffer = buffer, buffer.contiguous()
            else:
                buffer, snapshot = buffer.contiguous(), False
        if snapshot and buffer.numel() > 0 and self._snapshot(buffer):
            buffer = buffer.detach().to("cpu", copy=True)
        # An async_pwrite descriptor stays the caller's: the engine opens its file again.
        path, step, code = _core.deepnvme_file(op, filename, what)
        if step:
            return _failed(path, step, code)
        # A read past the end fills what exists.
        future = (self._io.pread_async if op == "read" else self._io.pwrite_async)(
            buffer, path, offset)
        self._pending.append(_Pending(future, buffer, path, offset, validate, copy_to))
        return 0


class _Pending(NamedTuple):
    """An operation started, for wait()."""

    future: IOFuture
    buffer: Any  # the memory it moves (a contiguous copy of a non-contiguous tensor)
    path: str
    offset: int
    validate: bool
    copy_to: Any  # the non-contiguous tensor a read fills at wait(), or None


def _filename(filename: Any, what: str) -> None:
    """DeepNVMe's calls take a C string: an int is not a descriptor (but async_pwrite's)."""
    if not isinstance(filename, (str, bytes, os.PathLike)):
        raise TypeError(f"{what}: filename must be a path, not {type(filename).__name__}")


def _failed(path: str, step: str, code: int | None) -> int:
    """DeepNVMe's answer to a file it cannot open or stat: -1, with its message (printed there,
    a RuntimeWarning here)."""
    code = code or 0
    level, frame = 2, sys._getframe(1)  # the warning names the caller's line, not this module's
    while frame is not None and frame.f_code.co_filename == __file__:
        level, frame = level + 1, frame.f_back
    warnings.warn(
        f"deepspeed_aio:  {step} failed on {path} error = {code} ({os.strerror(code)})",
        RuntimeWarning,
        stacklevel=level,
    )
    return -1


def _aliased_argument(
    what: str, value: Any, kwargs: dict[str, Any], name: str, alias: str
) -> Any:
    """An argument given as `value` (its name `name`) or as the keyword `alias` in `kwargs`
    (DeepSpeed's spelling); no other keyword may be left."""
    if alias in kwargs:
        if value is not None:
            raise TypeError(f"{what}() got both {name} and {alias}")
        value = kwargs.pop(alias)
    if kwargs:
        raise TypeError(f"{what}() got unexpected keyword arguments: {sorted(kwargs)}")
    if value is None:
        raise TypeError(f"{what}() missing its argument '{name}'")
    return value


def _example_argument(what: str, example: Any, kwargs: dict[str, Any]) -> Any:
    """`example_tensor`, also under DeepSpeed's spelling ``example_tenosr``."""
    return _aliased_argument(what, example, kwargs, "example_tensor", "example_tenosr")


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
        self._pinned = _core.CuFileRegistrations()  # by data_ptr, each with its tensor

    def get_alignment(self) -> int:
        """DeepNVMe's: 512 whatever ``intra_op_parallelism`` (its GDS handle gives its host I/O
        one thread and leaves the parallelism to cuFile)."""
        return _O_DIRECT_ALIGNMENT

    def pin_device_tensor(self, tensor: Any) -> bool:
        """Registers a CUDA tensor's memory with cuFile (skipped without cuFile, or where it would
        run in its compatibility mode: nothing DMAs into registered memory then), through the
        tensor's own device's primary context whichever device is current. Returns True."""
        _check_tensor(tensor, "pin_device_tensor", contiguous=True)
        if tensor.device.type != "cuda":
            raise ValueError(f"pin_device_tensor: tensor is on {tensor.device}, not a GPU")
        self._pinned.add(int(tensor.data_ptr()), _nbytes(tensor), tensor)
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

        example_tensor = _example_argument("new_pinned_device_tensor", example_tensor, kwargs)
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


# DeepSpeed's pinned-tensor manager, one per process: new_cpu_locked_tensor's tensors of every
# aio_handle, gds_handle and pin_handle, so that each handle's is_pinned knows the others' and
# free_cpu_locked_tensor frees only them. By data_ptr: bytes, the tensor's storage, weakly (it
# lives as long as any view of the tensor, which the tensor's Python object need not).
_locked = _core.LockedTensors()


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
    _locked.add(int(tensor.data_ptr()), _nbytes(tensor), tensor.untyped_storage())
    return tensor


def _free_locked(address: int, tensor: Any = None) -> bool:
    """Frees the live tensor from ``new_cpu_locked_tensor`` at `address` (its storage shrinks to
    nothing where torch allows, as pinned storages do; page-aligned memory goes with its last
    reference). A zero-byte one only through `tensor`, a view of it: such tensors may share an
    address. False, and nothing freed, when there is none."""
    storage = _locked.take(address, None if tensor is None else tensor.untyped_storage())
    if storage is None:
        return False
    if storage.resizable():
        storage.resize_(0)
    return True


def _is_pinned(buffer: Any) -> bool:
    """``is_pinned`` of every handle: a CPU tensor pinned by torch, in the registry, or (asked
    of the CUDA driver, where one is loaded) page-locked with CUDA by anyone."""
    if buffer.device.type != "cpu":
        return False
    # All of its bytes in one live tensor from new_cpu_locked_tensor (DeepSpeed's manager
    # likewise refuses a buffer that starts in a region and ends past it).
    if bool(buffer.is_pinned()) or _locked.covers(int(buffer.data_ptr()), _nbytes(buffer)):
        return True
    try:
        return bool(_core.pinned_host(int(buffer.data_ptr()), _nbytes(buffer)))
    except (RuntimeError, OSError):  # a driver that cannot answer: DeepNVMe's answer, not pinned
        return False


class pin_handle:  # noqa: N801 - DeepSpeed's name
    """DeepSpeed's ``pin_memory`` op handle (``PinMemoryBuilder().load().pin_handle()``): locked
    host tensors, in the one registry the ``aio_handle`` and ``gds_handle`` use."""

    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: Any) -> Any:
        """An uninitialised 1-D tensor of `num_elem` elements of `example_tensor`'s dtype in
        locked memory, as ``aio_handle.new_cpu_locked_tensor``'s."""
        _require_tensor(example_tensor, "new_cpu_locked_tensor", "example_tensor")
        return _new_locked(num_elem, example_tensor)

    def free_cpu_locked_tensor(self, locked_tensor: Any) -> bool:
        """As ``aio_handle.free_cpu_locked_tensor``: True when `locked_tensor` starts at a locked
        tensor of any handle, which is freed."""
        _require_tensor(locked_tensor, "free_cpu_locked_tensor", "locked_tensor")
        return _free_locked(int(locked_tensor.data_ptr()), locked_tensor)

    def free_cpu_locked_tensor_by_ptr(self, address: int) -> bool:
        """Frees the locked tensor (of any handle) whose memory starts at `address`, even where
        the tensor's ``.data`` has since been pointed elsewhere; True when there was one."""
        return _free_locked(
            _integer(address, "free_cpu_locked_tensor_by_ptr", "address", 0, _ADDRESS_BITS, True)
        )

    def is_pinned(self, buffer: Any) -> bool:
        """As ``aio_handle.is_pinned``: whether all of `buffer` is page-locked host memory."""
        _require_tensor(buffer, "is_pinned")
        return _is_pinned(buffer)


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
