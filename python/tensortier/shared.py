"""Shared tensors: one tensor that every process of a job sees, in shared host memory.

Each rank owns a partition of the rows (it allocates, first-touches and usually writes them);
every process maps every partition, so a write by one is seen by all and the job holds one copy
instead of one per process. Processes find each other through a ``torch.distributed`` store;
the memory passes between them as file descriptors, never through a file: nothing is left in
``/dev/shm`` or ``/tmp`` when a job ends, however it ends. No GPU and no NCCL are needed.

::

    import torch, tensortier.shared as shared
    group = shared.Group()                      # torchrun's environment, or the default group
    table = group.create_tensor((1_000_000, 128), torch.float32)
    rows, (begin, end) = table.local()          # this rank's rows: fill them
    rows.copy_(features[begin:end])
    group.barrier()
    batch = table.gather(torch.randint(0, 1_000_000, (1024,)))
"""

from __future__ import annotations

import atexit
import datetime
import math
import operator
import os
import weakref
from typing import Any, Callable, Sequence, TypeVar

import torch

from . import _core
from ._paths import fspath, PathArg
from ._shared_rows import _cuda_tensor_over, _Distributed, _require_torch_cuda, _tensor_over
from ._shared_store import _describe_store, _env_store, _rendezvous, _TorchStore
from .device import CudaError

__all__ = ["Group", "SharedTensor", "attach", "LAYOUTS", "DEFAULT_TIMEOUT"]

_T = TypeVar("_T")

# Device rows are read through a pinned host slab of at most this many bytes at a time.
_DEVICE_SLAB_BYTES = 256 << 20

#: The layouts :meth:`Group.create_tensor` accepts.
LAYOUTS = ("continuous", "chunked", "distributed")
#: Seconds a collective call waits for the other ranks before raising ``TimeoutError``.
DEFAULT_TIMEOUT: float = _core.shared_default_timeout_s


def _check_dtype(dtype: Any) -> torch.dtype:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, not {type(dtype).__name__}")
    return dtype


def _check_shape(shape: Any) -> tuple[int, ...]:
    try:
        dims = (operator.index(shape),)
    except TypeError:
        try:
            dims = tuple(operator.index(d) for d in shape)
        except TypeError:
            raise TypeError(f"shape must be an int or a sequence of ints, not {shape!r}") from None
    if not dims:
        raise ValueError("a shared tensor needs at least one dimension (its rows)")
    if any(d < 0 for d in dims):
        raise ValueError(f"shape {dims} has a negative dimension")
    return dims


def _check_cpu(device: Any, what: str) -> None:
    dev = torch.device(device)
    if dev.type == "cpu":
        return
    if dev.type == "cuda":
        _require_cuda_driver(dev, what)
        raise ValueError(f"{what} on {dev}: only host memory (device='cpu') is supported")
    raise ValueError(f"{what}: device must be 'cpu' or 'cuda', not {dev}")


def _require_cuda_driver(dev: torch.device, what: str) -> None:
    info = _core.cuda_driver()
    if not info["available"]:
        raise CudaError(
            f"{what} on {dev}: no CUDA driver was found ({info['why_unavailable']}); "
            "use host memory (device='cpu')"
        )


def _memory_of(device: Any, what: str) -> tuple[str, int]:
    """``("host" | "device", CUDA device index)`` for a create_tensor/attach `device`: the index
    is where device memory lives, and the context host memory is registered through."""
    dev = torch.device(device)
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{what}: device must be 'cpu' or 'cuda', not {dev}")
    if dev.type == "cuda":
        _require_cuda_driver(dev, what)
        index = dev.index
        if index is None:
            index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        return "device", index
    # Host memory registers through the GPU torch already uses here (no new context elsewhere).
    return "host", torch.cuda.current_device() if torch.cuda.is_initialized() else 0


class SharedTensor:
    """A tensor whose rows are shared by every process of a :class:`Group`.

    Made by :meth:`Group.create_tensor` or :meth:`Group.attach`. After :meth:`close` (or the
    group's), its methods raise ``RuntimeError``; tensors already taken from :meth:`view` or
    :meth:`local` keep their memory until they are dropped.
    """

    def __init__(self, core: Any, dtype: torch.dtype) -> None:
        self._core = core
        self._dtype = dtype
        self._shape = tuple(core.shape)
        self._distributed: _Distributed | None = None
        self._group_settle: Any = None  # the group's Group._settle (set by Group)
        # Host memory takes gather's lean path; device memory goes through CUDA views.
        self._host = core is not None and str(core.memory) == "host"

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def layout(self) -> str:
        return "distributed" if self._distributed else str(self._core.layout)

    @property
    def name(self) -> str:
        return self._distributed.name if self._distributed else str(self._core.name)

    @property
    def memory(self) -> str:
        """``"host"`` (shared host memory) or ``"device"`` (each partition on its rank's GPU)."""
        return "host" if self._distributed else str(self._core.memory)

    @property
    def partitions(self) -> list[tuple[int, int]]:
        """Each rank's rows, in rank order, as ``(begin, end)`` (some may be empty)."""
        if self._distributed:
            return list(self._distributed.parts)
        return [(begin, begin + rows) for _, begin, rows, _, _ in self._core.partitions]

    @property
    def stats(self) -> dict[str, Any]:
        """``local_bytes``, ``huge_pages`` (hugetlb pages back this rank's rows) and
        ``huge_pages_reason`` (why not); ``shmem_huge_pages`` (otherwise: transparent huge
        pages asked for, where the kernel's ``shmem_enabled`` gives them on advice) and
        ``shmem_huge_pages_reason`` (why not); ``cuda_registered`` (host memory registered with
        CUDA in this process: page-locked, fast copies to GPUs) and ``cuda_registered_reason``
        (why not); for device memory, ``device`` (this rank's GPU) and ``granularity`` (bytes
        each partition's allocation is rounded up to)."""
        if self._distributed:
            local = self._distributed.local
            nbytes = 0 if local is None else local.numel() * local.element_size()
            why = "distributed layout: private memory of each rank"
            return {"local_bytes": nbytes, "huge_pages": False, "huge_pages_reason": why,
                    "shmem_huge_pages": False, "shmem_huge_pages_reason": why,
                    "cuda_registered": False, "cuda_registered_reason": why}
        return dict(self._core.stats)

    @property
    def closed(self) -> bool:
        if self._distributed:
            return self._distributed.local is None
        return bool(self._core.closed)

    def _require_open(self, what: str) -> None:
        if self.closed:
            raise RuntimeError(f"{what}: the shared tensor was closed (finalized)")

    def _require_member(self, what: str) -> None:
        """Collective calls need a rank of the owning group."""
        self._require_open(what)
        if not self._distributed and self._core.rank < 0:
            raise ValueError(
                f"{what} is collective over the group that created {self.name!r}: this process "
                "attached it from outside that group"
            )

    def _partition_tensor(self, rank: int) -> torch.Tensor:
        _, _, rows, _, _ = self._core.partitions[rank]
        shape = (rows, *self._shape[1:])
        if self.memory == "device":
            _require_torch_cuda("a view of device memory")
            address, nbytes, keeper = self._core.device_region(rank)
            index = int(self._core.stats["device"])
            return _cuda_tensor_over(address, nbytes, keeper, self._dtype, shape, index)
        return _tensor_over(self._core.region(rank), self._dtype, shape)

    def local(self) -> tuple[torch.Tensor, tuple[int, int]]:
        """This rank's partition as a tensor over the shared memory, and its row range
        ``(begin, end)`` in the whole tensor."""
        self._require_open("local")
        if self._distributed:
            assert self._distributed.local is not None
            return self._distributed.local, self._distributed.parts[self._distributed.rank]
        rank = self._core.rank
        if rank < 0:
            raise ValueError(
                f"shared tensor {self.name!r} was attached from outside its group: it owns no "
                "rows here (use view(), gather() or scatter())"
            )
        return self._partition_tensor(rank), self.partitions[rank]

    def view(self, device: Any = "cpu") -> torch.Tensor | list[torch.Tensor]:
        """The whole tensor over the shared memory: one tensor for the ``continuous`` layout,
        one per rank (in rank order) for ``chunked``.

        Device memory is viewed from ``"cuda"`` (a CUDA tensor over the mapping of every rank's
        partition). Host memory is viewed from the CPU, and from ``"cuda"`` too when it is
        registered with CUDA (``stats["cuda_registered"]``): the GPU then reads it in place.

        Raises:
            CudaError: a CUDA device without a CUDA driver.
            RuntimeError: a CUDA view where torch has no CUDA.
            ValueError: a device the memory cannot be seen from.
        """
        self._require_open("view")
        dev = torch.device(device)
        if self._distributed:
            _check_cpu(device, "view")
            raise ValueError(
                "a distributed tensor has no view of all its rows in one process: use gather(), "
                "or local() for this rank's rows"
            )
        if self.memory == "device":
            if dev.type != "cuda":
                raise ValueError(
                    f"view on {dev}: this shared tensor is in device memory; view it on 'cuda'"
                )
            _require_torch_cuda("view")
            index = dev.index if dev.index is not None else int(self._core.stats["device"])
            if self.layout == "continuous":
                address, nbytes, keeper = self._core.device_region(-1)
                return _cuda_tensor_over(address, nbytes, keeper, self._dtype, self._shape, index)
            return [self._partition_tensor(r) for r in range(len(self._core.partitions))]
        if dev.type == "cuda":
            _require_cuda_driver(dev, "view")
            if not self._core.stats["cuda_registered"]:
                raise ValueError(
                    f"view on {dev}: this host memory is not registered with CUDA "
                    f"({self._core.stats['cuda_registered_reason']})"
                )
            _require_torch_cuda("view")
            index = dev.index if dev.index is not None else torch.cuda.current_device()
            host = self.view("cpu")
            parts = host if isinstance(host, list) else [host]
            # Registered host memory has the same address on the GPU (unified addressing).
            views = [
                _cuda_tensor_over(t.data_ptr(), t.numel() * t.element_size(), t, self._dtype,
                                  tuple(t.shape), index)
                for t in parts
            ]
            return views if isinstance(host, list) else views[0]
        _check_cpu(device, "view")
        if self.layout == "continuous":
            return _tensor_over(self._core.region(-1), self._dtype, self._shape)
        return [self._partition_tensor(r) for r in range(len(self._core.partitions))]

    def _indices(self, indices: Any) -> torch.Tensor:
        if isinstance(indices, torch.Tensor):
            idx = indices
        else:
            try:
                idx = torch.as_tensor(indices)
            except (RuntimeError, TypeError, ValueError) as e:
                raise TypeError(
                    f"indices must be a tensor or a sequence of integers, not {indices!r:.60}"
                ) from e
            if idx.numel() == 0:
                idx = idx.to(torch.int64)  # an empty list has no type: torch calls it float
        if idx.device.type != "cpu":
            raise ValueError(f"indices must be on the CPU, not {idx.device}")
        if idx.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
            raise TypeError(f"indices must be integers, not {idx.dtype}")
        if idx.dim() != 1:
            raise ValueError(f"indices must be one-dimensional, not of shape {tuple(idx.shape)}")
        return idx.to(torch.int64).contiguous()

    def gather(self, indices: Any) -> torch.Tensor:
        """Rows ``indices`` (any order, repeats allowed) as a new tensor, like
        ``view().index_select(0, indices)``; large batches are copied on several threads.

        With the ``distributed`` layout this is collective: every rank calls it (with its own
        indices) and rows move through ``torch.distributed`` (all-to-all). Threads may call
        ``gather`` and ``scatter`` on one such tensor at once (a process runs its calls one at a
        time; each rank makes as many calls in all as the others).

        Raises:
            IndexError: an index out of range (nothing is copied; with the ``distributed``
                layout every rank raises, naming the ranks that passed one).
        """
        core = self._core
        if (
            core is not None
            and self._host
            and type(indices) is torch.Tensor
            and indices.dtype is torch.int64
            and indices.dim() == 1
            and indices.is_contiguous()
            and indices.is_cpu
        ):
            # The common call, kept lean (small batches are a few tens of microseconds): C++
            # checks the indices, and raises RuntimeError once the tensor is closed.
            n = indices.shape[0]
            out = torch.empty((n, *self._shape[1:]), dtype=self._dtype)
            core.gather(indices.data_ptr(), n, out.data_ptr())
            return out
        self._require_open("gather")
        idx = self._indices(indices)
        if self._distributed:
            return self._distributed.round(idx, None)
        if self.memory == "device":
            return self._device_rows(idx, None)
        out = torch.empty((idx.numel(), *self._shape[1:]), dtype=self._dtype)
        core.gather(idx.data_ptr(), idx.numel(), out.data_ptr())
        return out

    def scatter(self, indices: Any, values: torch.Tensor) -> None:
        """Writes ``values[i]`` to row ``indices[i]``, like ``view().index_copy_(0, indices,
        values)``.

        Raises:
            IndexError: an index out of range (nothing is written).
            TypeError: values of another dtype.
            ValueError: values whose shape is not ``(len(indices), *shape[1:])``.
        """
        self._require_open("scatter")
        idx = self._indices(indices)
        if not isinstance(values, torch.Tensor):
            raise TypeError(f"values must be a torch.Tensor, not {type(values).__name__}")
        if values.dtype != self._dtype:
            raise TypeError(f"values are {values.dtype}; this shared tensor holds {self._dtype}")
        want = (idx.numel(), *self._shape[1:])
        if tuple(values.shape) != want:
            raise ValueError(f"values have shape {tuple(values.shape)}; expected {want}")
        if self.memory == "device":
            self._device_rows(idx, values)
            return
        if values.device.type != "cpu":
            raise ValueError(f"values must be on the CPU, not {values.device}")
        values = values.contiguous()
        if self._distributed:
            self._distributed.round(idx, values)
            return
        self._core.scatter(idx.data_ptr(), idx.numel(), values.data_ptr())

    def _device_rows(self, idx: torch.Tensor, values: torch.Tensor | None) -> torch.Tensor:
        """Gathers (`values` None) or scatters rows `idx` of device memory on the GPU, through
        CUDA views (the result is a CUDA tensor)."""
        rows = self._shape[0]
        if idx.numel() and bool((idx < 0).any() or (idx >= rows).any()):
            bad = idx[(idx < 0) | (idx >= rows)][0].item()
            raise IndexError(f"index {bad} is out of range for a shared tensor of {rows} rows")
        view = self.view("cuda")
        parts = view if isinstance(view, list) else [view]
        bounds = self.partitions if isinstance(view, list) else [(0, rows)]
        device = parts[0].device
        idx = idx.to(device)
        out = torch.empty((idx.numel(), *self._shape[1:]), dtype=self._dtype, device=device)
        if values is not None:
            values = values.to(device)
        for part, (begin, end) in zip(parts, bounds):
            where = ((idx >= begin) & (idx < end)).nonzero().squeeze(1)
            if where.numel() == 0:
                continue
            local = idx.index_select(0, where) - begin
            if values is None:
                out.index_copy_(0, where, part.index_select(0, local))
            else:
                part.index_copy_(0, local, values.index_select(0, where))
        return out

    # -- files ---------------------------------------------------------------------------------
    def _read_rows(self, what: str, files: list[tuple[str, int]], checkpoint: str | None = None,
                   key: str = "") -> dict[str, Any]:
        """Reads this rank's rows in C++ (``_core.shared_read_rows``: through the engine,
        O_DIRECT, parallel) from raw row `files`, ``(path, size)`` each, or from tensor `key` of
        `checkpoint`. Returns the engine's stats for this rank's reads (summed over the slabs)."""
        args = (what, files, checkpoint, key, str(self._dtype).removeprefix("torch."),
                self._dtype.itemsize, list(self._shape))
        stats: dict[str, Any] = {}
        for slab in self._through_host(True, lambda b, e, _, at: _core.shared_read_rows(
                *args, b, e, at)):
            for name, value in slab.items():
                summed = isinstance(value, int) and not isinstance(value, bool) and name in stats
                stats[name] = stats[name] + value if summed else value
        return stats

    def _through_host(self, read: bool, io: Callable[[int, int, int, int], _T]) -> list[_T]:
        """Calls ``io(begin, end, offset, address)`` on this rank's rows ``[begin, end)``, which
        lie at byte `offset` of the rank's part, in host memory at `address`: once for host
        rows; for device rows once per piece of a pinned host slab of at most
        ``_DEVICE_SLAB_BYTES``, so that a rank's part never needs a host copy of its own size,
        after (`read` False) or before (`read`) copying the piece from or to the GPU. Returns
        each call's result."""
        rows, (begin, end) = self.local()
        if rows.is_cpu or end == begin:
            return [io(begin, end, 0, rows.data_ptr() if rows.is_cpu else 0)]
        row_bytes = max(1, math.prod(rows.shape[1:]) * rows.element_size())
        slab_rows = max(1, min(end - begin, _DEVICE_SLAB_BYTES // row_bytes))
        host = torch.empty((slab_rows, *rows.shape[1:]), dtype=rows.dtype, pin_memory=True)
        results = []
        for b in range(begin, end, slab_rows):
            e = min(b + slab_rows, end)
            part, piece = host[: e - b], rows[b - begin : e - begin]
            if not read:
                part.copy_(piece)
            results.append(io(b, e, (b - begin) * row_bytes, part.data_ptr()))
            if read:
                piece.copy_(part)  # synchronous: the slab is reused next
        return results

    def _rank(self) -> int:
        return self._distributed.rank if self._distributed else int(self._core.rank)

    def _collective(self, what: str, step: Callable[[], _T]) -> _T:
        """Runs this rank's part of collective call `what`, then waits for every rank's: an
        error on any rank reaches all of them at once (the failing rank raises its own, the
        others ``RuntimeError`` naming it with its text), instead of leaving them waiting out
        the timeout for a rank that is alive."""
        try:
            result = step()
        except Exception as e:
            self._group_settle(what, e)
            raise
        self._group_settle(what, None)
        return result

    def load_files(self, paths: PathArg | Sequence[PathArg]) -> dict[str, Any]:
        """Collective: fills the tensor from raw row files whose concatenation, in order, is
        the whole tensor (as :meth:`store_files` writes them, or one file). Each rank reads only
        its own rows, through the engine (O_DIRECT where the filesystem allows, in parallel);
        returns when every rank has read its rows, with this rank's I/O stats.

        Raises:
            ValueError: the files do not hold exactly the tensor's bytes.
            OSError: a file cannot be read.
            RuntimeError: another rank failed; the message names it and quotes its error (every
                rank raises as soon as one fails).
        """
        self._require_member("load_files")

        def step() -> dict[str, Any]:
            files = [paths] if isinstance(paths, (str, bytes, os.PathLike)) else paths
            names = [fspath(p, "paths[i]") for p in files]
            return self._read_rows("load_files", [(p, os.stat(p).st_size) for p in names])

        return self._collective("load_files", step)

    def load_checkpoint(self, path: PathArg, key: str) -> dict[str, Any]:
        """Collective: fills the tensor from tensor `key` of a checkpoint, each rank reading only
        its rows (as :meth:`load_files`): a safetensors file, or a ``torch.save`` file whose
        tensors are found by their key path (``"feat"``, ``"model.emb.weight"``, as
        ``torch.load(path)`` nests them) without running its pickle. The stored tensor must
        have this tensor's shape and dtype and be contiguous.

        Raises:
            KeyError: no tensor `key` in the file (the message lists the keys there are).
            ValueError: another shape or dtype; a tensor stored with strides that do not give
                contiguous rows, or in a compressed zip entry; a legacy (pre-1.6) ``torch.save``
                file; a shard index or a file that is not a checkpoint.
            OSError: the file cannot be read.
            RuntimeError: another rank failed; the message names it and quotes its error (every
                rank raises as soon as one fails).
        """
        self._require_member("load_checkpoint")
        return self._collective("load_checkpoint", lambda: self._load_checkpoint_rows(path, key))

    def _load_checkpoint_rows(self, path: PathArg, key: str) -> dict[str, Any]:
        """This rank's part of :meth:`load_checkpoint`."""
        if not isinstance(key, str):
            raise TypeError(f"key must be a str, not {type(key).__name__}")
        return self._read_rows("load_checkpoint", [], fspath(path), key)

    def store_files(self, prefix: PathArg) -> list[str]:
        """Collective: each rank writes its rows to ``{prefix}_part_{rank}_of_{world}`` (replacing
        it) through the engine; returns every rank's file name in rank order (what
        :meth:`load_files` takes back) once all are written.

        Raises:
            OSError: this rank's file cannot be written.
            RuntimeError: another rank failed; the message names it and quotes its error (every
                rank raises as soon as one fails).
        """
        self._require_member("store_files")

        def step() -> list[str]:
            path, last = fspath(prefix, "prefix"), self.local()[1][1]
            row_bytes = math.prod(self._shape[1:]) * self._dtype.itemsize

            def write(begin: int, end: int, offset: int, address: int) -> list[str]:
                return _core.shared_write_rows(path, self._rank(), len(self.partitions), address,
                                               (end - begin) * row_bytes, offset, end == last)

            return self._through_host(False, write)[-1]

        return self._collective("store_files", step)

    def close(self) -> None:
        """Stops sharing this rank's rows with processes that attach later and releases this
        object's hold on the memory. Idempotent."""
        if self._distributed:
            self._distributed.local = None
            return
        self._core.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else self.layout
        return f"SharedTensor(shape={self._shape}, dtype={self._dtype}, {state}, name={self.name!r})"


class Group:
    """The processes of a job that share tensors.

    Args:
        rank, world_size: this process's rank and the number of processes; by default the
            default ``torch.distributed`` group's, else ``RANK``/``WORLD_SIZE`` (torchrun).
        store: any ``torch.distributed.Store`` (``TCPStore``, ``FileStore``...); by default the
            default group's store, else a ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT``.
        timeout: seconds a collective call waits for the other ranks.

    Creating a group is collective: every rank must do it, in the same order as its other
    groups on the same store (as torch's ``new_group``). Each group's keys in the store are its
    own (the nth group of its size that each rank makes on that store, counted by the store), so
    groups made one after another on one store, by one job or several, never read each other's
    keys. Processes of different groups that make them on one store at the same time (two jobs
    started together) must give each its own ``torch.distributed.PrefixStore``.

    Raises ``ValueError`` when the rank, world size or store cannot be found, or when a peer has
    already made more groups of this size on the store (groups made in another order);
    ``TimeoutError`` when the other ranks do not arrive in time.
    """

    def __init__(
        self,
        rank: int | None = None,
        world_size: int | None = None,
        store: Any = None,
        timeout: float | datetime.timedelta = DEFAULT_TIMEOUT,
    ) -> None:
        if isinstance(timeout, datetime.timedelta):
            timeout = timeout.total_seconds()
        if not timeout > 0:
            raise ValueError(f"timeout must be positive seconds, not {timeout!r}")
        self.timeout = float(timeout)
        torch_store, self.rank, self.world_size, where, self._hosts_store = _rendezvous(
            rank, world_size, store, timeout
        )
        self._torch_store = torch_store
        # Referenced here as long as C++ may call it.
        self._adapter = _TorchStore(torch_store, where)
        self._core = _core.SharedGroup(self._adapter, self.rank, self.world_size, self.timeout)
        self._closed = False
        # The other ranks count themselves out on close: a rank serving the store keeps it until
        # they are done with it (at most the timeout: a dead rank never counts).
        if self._hosts_store:  # holds the store (its server) until exit, even if dropped
            atexit.register(_core.shared_wait_for_leavers, self._adapter, self._core.leave_key,
                            self.world_size, self.timeout)
        if self.world_size > 1:  # runs before the above (atexit is last in, first out)
            atexit.register(_close_at_exit, weakref.ref(self))
        self._distributed_tensors: list[SharedTensor] = []

    def _require_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"{what}: the shared group was closed (finalized)")

    def create_tensor(
        self,
        shape: int | Sequence[int],
        dtype: torch.dtype,
        device: Any = "cpu",
        layout: str = "continuous",
        name: str | None = None,
    ) -> SharedTensor:
        """Collective: a new shared tensor, zero-filled, its rows partitioned by rank.

        Args:
            shape: the tensor's shape; rows (the first dimension) are split between ranks.
            dtype: any torch dtype.
            device: ``"cpu"`` (shared host memory, registered with CUDA when a driver is
                present) or ``"cuda"``/``"cuda:N"`` (each rank's partition in its GPU's memory,
                mapped by every process; needs a CUDA driver; ``continuous`` or ``chunked``).
            layout: ``"continuous"`` (every process sees one array) or ``"chunked"`` (one
                array per rank's partition).
            name: lets :meth:`attach` find the tensor; unique in the group.

        Raises:
            ValueError: bad arguments, or ranks that asked for different tensors (the message
                names which asked for what; every rank raises).
            TimeoutError: a rank did not make the call within the group's timeout.
            OSError: the memory could not be had or shared.
            CudaError: device memory without a CUDA driver, or a CUDA call failed (on the rank
                where it failed; the others raise RuntimeError naming it).
        """
        self._require_open("create_tensor")
        dims = _check_shape(shape)
        _check_dtype(dtype)
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, not {layout!r}")
        memory, index = _memory_of(device, "create_tensor")
        if memory == "device" and layout == "distributed":
            raise ValueError("the distributed layout keeps rows in host memory: use device='cpu'")
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError(f"name must be a non-empty string, not {name!r}")
        element_size = torch.empty((), dtype=dtype).element_size()
        if layout == "distributed":
            return self._create_distributed(dims, dtype, element_size, name or "")
        core = self._core.create(list(dims), str(dtype), element_size, layout, name or "", memory,
                                 index)
        t = SharedTensor(core, dtype)
        t._group_settle = self._settle
        return t

    def _create_distributed(
        self, dims: tuple[int, ...], dtype: torch.dtype, element_size: int, name: str
    ) -> SharedTensor:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "the distributed layout moves rows through torch.distributed: initialise its "
                "default process group first (torch.distributed.init_process_group('gloo'))"
            )
        if (dist.get_rank(), dist.get_world_size()) != (self.rank, self.world_size):
            raise ValueError(
                f"this group is rank {self.rank} of {self.world_size}; torch.distributed's "
                f"default group is rank {dist.get_rank()} of {dist.get_world_size()}"
            )
        self._core.agree(list(dims), str(dtype), element_size, "distributed", name)
        row_bytes = math.prod(dims[1:]) * element_size
        parts = [tuple(p) for p in _core.partition_rows(dims[0], row_bytes, self.world_size)]
        begin, end = parts[self.rank]
        t = SharedTensor.__new__(SharedTensor)
        t._core, t._dtype, t._shape, t._group_settle = None, dtype, dims, self._settle
        t._host = False
        t._distributed = _Distributed(
            name, self.rank, parts, torch.zeros((end - begin, *dims[1:]), dtype=dtype)
        )
        self._distributed_tensors.append(t)
        return t

    def attach(self, name: str) -> SharedTensor:
        """The shared tensor created under `name` in this group's store (not collective; its
        owners must not have closed it), waiting up to the group's timeout for it to appear.
        One this group created has this rank's rows as :meth:`SharedTensor.local`; one another
        group created is attached as :func:`attach` does. Raises TimeoutError when none
        appears in time."""
        self._require_open("attach")
        t = _attached(self._core.attach(name), name)
        if t._core.rank >= 0:
            t._group_settle = self._settle
        return t

    def barrier(self) -> None:
        """Collective: returns once every rank has called it (``TimeoutError`` otherwise)."""
        self._require_open("barrier")
        self._core.barrier("barrier")

    def _settle(self, what: str, error: BaseException | None) -> None:
        """Collective: every rank says whether its part of `what` worked (`error` None). Returns
        on a rank that failed (it raises its own error); elsewhere returns when every rank's
        worked, else raises ``RuntimeError`` naming each failing rank with its error."""
        self._require_open(what)
        self._core.settle(what, None if error is None else f"{type(error).__name__}: {error}")

    def close(self) -> None:
        """Closes every tensor of this group and stops sharing (not collective). Idempotent.

        Groups are closed at interpreter exit. The rank that serves the group's store (rank 0
        when no ``store`` is given outside torchrun) then keeps serving it until every other
        rank has closed its group or exited, at most the timeout: ranks still finishing a
        collective call do not lose the store under them."""
        if self._closed:
            return
        self._closed = True
        for t in self._distributed_tensors:
            t.close()
        self._distributed_tensors.clear()
        self._core.close()
        if not self._hosts_store:
            self._core.count_out()  # a store that is gone has nobody waiting

    def __enter__(self) -> "Group":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _close_at_exit(ref: "weakref.ref[Group]") -> None:
    group = ref()
    if group is not None:
        group.close()


def _attached(core: Any, name: str) -> SharedTensor:
    """The tensor over `core`, attached by `name`: its dtype, read from the store's record (which
    anyone who reaches the store can write), must be torch's and of the record's element size
    (the C++ side copies rows of that size into buffers torch sizes)."""
    dtype = getattr(torch, str(core.dtype).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"shared tensor {name!r} has dtype {core.dtype}, unknown to torch")
    if int(core.element_size) != dtype.itemsize:
        raise ValueError(
            f"shared tensor {name!r}: its record's element_size {core.element_size} is not the "
            f"size of {dtype} ({dtype.itemsize})"
        )
    return SharedTensor(core, dtype)


def attach(
    name: str,
    store: Any = None,
    timeout: float | datetime.timedelta = DEFAULT_TIMEOUT,
) -> SharedTensor:
    """Maps the shared tensor that a :class:`Group` created with ``name=`` from a process
    outside that group: one started later (an evaluation process, a new job step, a notebook),
    or a member of a group of another size. Not collective.

    Args:
        name: the ``name`` given to :meth:`Group.create_tensor`.
        store: the store the creating group met through: a client of the same ``TCPStore``
            (host and port), the same ``FileStore`` path... By default a ``TCPStore`` client
            of ``MASTER_ADDR:MASTER_PORT``, as a group started by torchrun uses.
        timeout: seconds to wait for the tensor to be created.

    The owners must still run and hold the tensor while it is attached (each serves its rows
    to processes of the same user only); afterwards the memory stays valid here until the
    tensor is dropped, even after they exit. The result has :meth:`~SharedTensor.view`,
    ``gather``, ``scatter`` (writes are seen by the owners and vice versa); it owns no rows,
    so :meth:`~SharedTensor.local` and the collective file calls raise ``ValueError``.

    Raises:
        TimeoutError: no tensor of that name appeared in time.
        ConnectionError: an owner exited (or the store is gone).
        FileNotFoundError: an owner closed the tensor.
        PermissionError: an owner runs as another user.
    """
    import torch.distributed as dist

    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, not {name!r}")
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if not timeout > 0:
        raise ValueError(f"timeout must be positive seconds, not {timeout!r}")
    if store is None:
        store, where = _env_store(False, None, float(timeout))
    elif not isinstance(store, dist.Store):
        raise TypeError(f"store must be a torch.distributed.Store, not {type(store).__name__}")
    else:
        where = _describe_store(store)
    core = _core.shared_attach(_TorchStore(store, where), name, float(timeout))
    return _attached(core, name)
