"""Shared tensors: one tensor that every process of a job sees, in shared host memory or in the
memory of the job's GPUs. The guide is docs/shared.md."""

from __future__ import annotations

import contextlib
import datetime
import functools
import threading
from collections.abc import Iterator
from typing import Any, Callable, Sequence, TypeVar

import torch

from . import _core
from ._paths import fspath, PathArg

__all__ = ["Group", "SharedTensor", "attach", "LAYOUTS", "DEFAULT_TIMEOUT"]

_T = TypeVar("_T")

#: The layouts :meth:`Group.create_tensor` accepts.
LAYOUTS = ("continuous", "chunked", "distributed")
#: Seconds a collective call waits for the other ranks before raising ``TimeoutError``.
DEFAULT_TIMEOUT: float = _core.shared_default_timeout_s


def _memory_of(device: Any, what: str) -> tuple[str, int]:
    """``("host" | "device", the CUDA device index)`` for a `device` argument."""
    dev = torch.device(device)
    if _core.shared_memory_of(dev.type, str(dev), what) == "device":
        index = dev.index
        if index is None:
            index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        return "device", index
    # Host memory registers through the GPU torch already uses here (no new context elsewhere).
    return "host", torch.cuda.current_device() if torch.cuda.is_initialized() else 0


def _require_torch_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"{what}: this torch has no CUDA (torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}); it cannot make CUDA tensors over shared memory"
        )


def _tensor_over(region: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if len(region) == 0:
        return torch.empty(shape, dtype=dtype)
    # Bytes first: torch.frombuffer does not take every dtype, a byte view can be any.
    return torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)


def _guard_pickling() -> None:
    """Keeps views of shared host memory part of their shared tensor when torch.multiprocessing
    sends them to another process (``mp.spawn`` arguments, ``mp.Queue``, DataLoader workers).
    Its pickling moves a storage it does not know as shared into new shared memory of its own
    and swaps it under the tensor in place: the view would silently stop being part of the
    shared tensor. A copy is sent instead (what the other process always got), and the view
    stays where it is."""
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing import reductions  # registers torch's reducers first

    torch_reduce = reductions.reduce_storage

    def reduce_storage(storage: Any) -> Any:
        if _in_shared_tensor(storage):
            storage = storage.clone()
        return torch_reduce(storage)

    ForkingPickler.register(torch.UntypedStorage, reduce_storage)


def _in_shared_tensor(storage: Any) -> bool:
    return (storage.device.type == "cpu" and storage.nbytes() > 0
            and _core.shared_tensor_name_at(storage.data_ptr()) is not None)


def _guard_share_memory() -> None:
    """Makes ``share_memory_()`` (``Module.share_memory()``, a torch.multiprocessing habit) a
    no-op on views of shared host memory, and ``is_shared()`` true, as for torch's own shared
    memory. torch would move a storage it does not know as shared into new shared memory and
    swap it under the tensor: the view would silently stop being part of the shared tensor."""
    torch_share = torch.UntypedStorage.share_memory_
    torch_is_shared = torch.UntypedStorage.is_shared

    @functools.wraps(torch_share)
    def share_memory_(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _in_shared_tensor(self):
            return self
        return torch_share(self, *args, **kwargs)

    @functools.wraps(torch_is_shared)
    def is_shared(self: Any) -> bool:
        return bool(torch_is_shared(self)) or _in_shared_tensor(self)

    torch.UntypedStorage.share_memory_ = share_memory_  # type: ignore[method-assign]
    torch.UntypedStorage.is_shared = is_shared  # type: ignore[method-assign]


_guard_pickling()
_guard_share_memory()

#: One round of the distributed layout at a time per process: rounds move rows through the
#: default process group, whose collectives pair up by the order each process issues them.
_ROUND_LOCK = threading.Lock()


class SharedTensor:
    """A tensor whose rows are shared by every process of a :class:`Group`.

    Made by :meth:`Group.create_tensor` or :meth:`Group.attach`. After :meth:`close` (or the
    group's), its methods raise ``RuntimeError``; tensors already taken from :meth:`view` or
    :meth:`local` keep their memory until they are dropped.
    """

    def __init__(self, core: Any, dtype: torch.dtype, group: Any = None) -> None:
        self._core = core  # _core.SharedTensor, or _core.SharedDistributedTensor
        self._dtype = dtype
        self._shape = tuple(core.shape)
        self._group = group  # the _core.SharedGroup of a tensor this rank holds rows of
        self._distributed = str(core.layout) == "distributed"
        # Host memory takes gather's lean path; device memory goes through CUDA views.
        self._host = not self._distributed and str(core.memory) == "host"

    def __reduce__(self) -> Any:
        raise TypeError(
            "a SharedTensor cannot be pickled (into a spawned process, an mp.Queue): create it "
            "with name=..., send the name, and shared.attach(name) it there (a forked process "
            "inherits it as it is)")

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def layout(self) -> str:
        return str(self._core.layout)

    @property
    def name(self) -> str:
        return str(self._core.name)

    @property
    def memory(self) -> str:
        """``"host"`` (shared host memory) or ``"device"`` (each partition on its rank's GPU)."""
        return str(self._core.memory)

    @property
    def partitions(self) -> list[tuple[int, int]]:
        """Each rank's rows, in rank order, as ``(begin, end)`` (some may be empty)."""
        return list(self._core.row_ranges)

    @property
    def stats(self) -> dict[str, Any]:
        """``local_bytes``, ``huge_pages`` (hugetlb pages back this rank's rows) and
        ``huge_pages_reason`` (why not); ``shmem_huge_pages`` (otherwise: transparent huge
        pages asked for, where the kernel's ``shmem_enabled`` gives them on advice) and
        ``shmem_huge_pages_reason`` (why not); ``cuda_registered`` (host memory registered with
        CUDA in this process: page-locked, fast copies to GPUs) and ``cuda_registered_reason``
        (why not); for device memory, ``device`` (this rank's GPU) and ``granularity`` (bytes
        each partition's allocation is rounded up to)."""
        return dict(self._core.stats)

    @property
    def closed(self) -> bool:
        return bool(self._core.closed)

    def _over(self, rank: int, index: int | None) -> torch.Tensor:
        """Partition `rank` (-1: the whole continuous tensor) on CUDA device `index`, or the
        CPU (None): registered host memory has the same address on the GPU."""
        shape = self._shape if rank < 0 else (self._core.partitions[rank][2], *self._shape[1:])
        _, nbytes, keeper = self._core.span(rank)
        if index is None:
            return _tensor_over(keeper, self._dtype, shape)
        if nbytes == 0:
            return torch.empty(shape, dtype=self._dtype, device=torch.device("cuda", index))
        # The keeper's __cuda_array_interface__ holds the mapping while the tensor lives.
        raw = torch.as_tensor(keeper, device=f"cuda:{index}")
        return raw.view(self._dtype).view(shape)

    def local(self) -> tuple[torch.Tensor, tuple[int, int]]:
        """This rank's partition as a tensor over the shared memory, and its row range
        ``(begin, end)`` in the whole tensor."""
        rank = self._core.local_rank()
        index = None  # where the rows are seen from: this rank's GPU for device memory
        if self.memory == "device":
            _require_torch_cuda("a view of device memory")
            index = int(self._core.stats["device"])
        return self._over(rank, index), self.partitions[rank]

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
        self._core.require("view")
        dev = torch.device(device)
        index = _core.shared_view_device(self._core, dev.type, dev.index, str(dev))
        if index is not None:
            _require_torch_cuda("view")
            index = index if index >= 0 else torch.cuda.current_device()
        if self.layout == "continuous":
            return self._over(-1, index)
        return [self._over(r, index) for r in range(len(self._core.partitions))]

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
        _core.shared_check_indices(str(idx.device), str(idx.dtype), idx.shape)
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
            self._host
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
        if self._distributed and self._group is not None:
            self._group.require_rank("gather")  # a forked child: its round would never pair
        with self._refused_round_on_error(kind_scatter=False):
            core.require("gather")  # closed: this rank still takes part in a distributed round
            idx = self._indices(indices)
        if self._distributed:
            return self._round(idx, None)
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
        host = self.memory == "host"  # device memory takes values from any device
        if self._distributed and self._group is not None:
            self._group.require_rank("scatter")  # a forked child: its round would never pair
        with self._refused_round_on_error(kind_scatter=True):
            self._core.require("scatter")  # closed: still takes part in a distributed round
            idx = self._indices(indices)
            if not isinstance(values, torch.Tensor):
                raise TypeError(f"values must be a torch.Tensor, not {type(values).__name__}")
            _core.shared_check_values(str(values.dtype), str(self._dtype), values.shape,
                                      (idx.numel(), *self._shape[1:]),
                                      str(values.device) if host else None)
            if host:
                # The values themselves, as index_copy_ writes them: a conj or neg view's memory
                # holds other numbers; rows of this tensor are read before any is written.
                values = values.resolve_conj().resolve_neg()
                if not self._distributed and self._holds(values):
                    values = values.clone()
                values = values.contiguous()  # may fail (memory): still before the round
        if not host:
            self._device_rows(idx, values)
            return
        if self._distributed:
            self._round(idx, values)
            return
        self._core.scatter(idx.data_ptr(), idx.numel(), values.data_ptr())

    def _holds(self, values: torch.Tensor) -> bool:
        """Whether `values` lie in this tensor's memory (are rows of it)."""
        storage = values.untyped_storage()
        start = storage.data_ptr()
        end = start + storage.nbytes()
        views = self.view()
        return any(start < v.data_ptr() + v.nbytes and v.data_ptr() < end
                   for v in (views if isinstance(views, list) else [views]))

    def _device_rows(self, idx: torch.Tensor, values: torch.Tensor | None) -> torch.Tensor:
        """Gathers (`values` None) or scatters rows `idx` of device memory on the GPU, through
        CUDA views (the result is a CUDA tensor)."""
        order = torch.empty_like(idx)
        counts = self._core.route(idx.data_ptr(), idx.numel(), order.data_ptr())  # IndexError
        view = self.view("cuda")
        device = (view[0] if isinstance(view, list) else view).device
        idx = idx.to(device)
        values = None if values is None else values.to(device)
        if isinstance(view, torch.Tensor):  # continuous: one array
            if values is None:
                return view.index_select(0, idx)
            return view.index_copy_(0, idx, values)
        order, at = order.to(device), 0
        out = torch.empty((idx.numel(), *self._shape[1:]), dtype=self._dtype, device=device)
        for part, (begin, _), n in zip(view, self.partitions, counts):
            where, at = order[at : at + n], at + n
            if n == 0:
                continue
            local = idx.index_select(0, where) - begin
            if values is None:
                out.index_copy_(0, where, part.index_select(0, local))
            else:
                part.index_copy_(0, local, values.index_select(0, where))
        return out

    @contextlib.contextmanager
    def _refused_round_on_error(self, kind_scatter: bool) -> Iterator[None]:
        """Within: what this rank's call does before its round (checks, copies). Where that
        fails on the ``distributed`` layout (a refusal, out of memory), this rank still takes
        part in the round, saying so: the other ranks raise ValueError naming it, rather than
        pairing their round with this rank's next call or waiting out their timeout."""
        try:
            yield
        except Exception:
            if self._distributed:
                # This rank's own error is the one to raise, whatever the round meets.
                with _ROUND_LOCK, contextlib.suppress(Exception):
                    ex = self._core.exchange
                    self._all_to_all(*ex.route(0, 0, kind_scatter, refused=True), 8)
                    ex.read_requests()  # raises on every rank, naming this one
            raise

    def _round(self, idx: torch.Tensor, values: torch.Tensor | None) -> torch.Tensor | None:
        """The distributed layout's gather (`values` None: returns rows `idx`) or scatter (of
        `values`, contiguous), as one round of all-to-alls; the bookkeeping is the C++
        exchange's (shared_exchange.hpp). Rounds pair up across ranks by their order."""
        with _ROUND_LOCK:
            # Held through the round: a close() meanwhile frees nothing (RuntimeError once closed).
            local, _, keeper = self._core.span(self._core.rank)
            ex, n = self._core.exchange, idx.numel()
            self._all_to_all(*ex.route(idx.data_ptr(), n, values is not None), 8)  # the requests
            if ex.read_requests():
                self._all_to_all(*ex.late_splits(), 8)  # those past the pairs' slots
            mine = 0 if values is None else values.data_ptr()
            self._all_to_all(*ex.serve(local, mine), self._core.row_bytes)  # the rows
            out = None if values is not None else torch.empty((n, *self._shape[1:]),
                                                              dtype=self._dtype)
            ex.finish(local, 0 if out is None else out.data_ptr())
            return out

    def _all_to_all(self, send_splits: list[int], recv_splits: list[int], width: int) -> None:
        import torch.distributed as dist

        ex = self._core.exchange
        send = _tensor_over(ex.send_buffer(), torch.uint8, (sum(send_splits), width))
        recv = _tensor_over(ex.recv_buffer(), torch.uint8, (sum(recv_splits), width))
        dist.all_to_all_single(recv, send, recv_splits, send_splits)

    # -- files ---------------------------------------------------------------------------------
    def _collective(self, what: str, step: Callable[[], _T]) -> _T:
        """This rank's `step` of collective call `what`, then every rank's outcome: an error on
        any rank (this tensor closed here, too) reaches all at once instead of leaving them
        waiting out the timeout."""
        if self._group is None:  # attached from outside the group: ValueError, nobody waits
            self._core.require(what, True)
        self._group.require_rank(what)  # a forked child: RuntimeError before anything is done
        try:
            self._core.require(what, True)  # RuntimeError once closed
            if self.memory == "device" and torch.cuda.is_initialized():
                # The C++ copies run on their own stream: first what torch queued on the rows.
                torch.cuda.current_stream(int(self._core.stats["device"])).synchronize()
            result = step()
        except Exception as e:
            # This rank's own error is the one to raise (a closed group has nobody to tell: the
            # others see it closed).
            with contextlib.suppress(Exception):
                self._group.settle(what, f"{type(e).__name__}: {e}")
            raise
        self._group.settle(what, None)
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
        return self._collective("load_files",
                                lambda: self._core.read_rows("load_files", paths, None, ""))

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
        return self._collective("load_checkpoint", lambda: self._core.read_rows(
            "load_checkpoint", [], fspath(path), key))

    def store_files(self, prefix: PathArg) -> list[str]:
        """Collective: each rank writes its rows to ``{prefix}_part_{rank}_of_{world}`` (replacing
        it) through the engine; returns every rank's file name in rank order (what
        :meth:`load_files` takes back) once all are written.

        Raises:
            OSError: this rank's file cannot be written.
            RuntimeError: another rank failed; the message names it and quotes its error (every
                rank raises as soon as one fails).
        """
        return self._collective("store_files",
                                lambda: self._core.write_rows(fspath(prefix, "prefix")))

    def close(self) -> None:
        """Stops sharing this rank's rows with processes that attach later and releases this
        object's hold on the memory. Idempotent."""
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
    ``TypeError`` for a rank or world size that is not an int, or a timeout that is not a
    number or ``timedelta``; ``TimeoutError`` when the other ranks do not arrive in time.
    """

    def __init__(
        self,
        rank: int | None = None,
        world_size: int | None = None,
        store: Any = None,
        timeout: float | datetime.timedelta = DEFAULT_TIMEOUT,
    ) -> None:
        self.timeout = _core.shared_timeout_s(timeout)
        self._core, self._torch_store, self.rank, self.world_size = _core.shared_open_group(
            rank, world_size, store, self.timeout)

    def __reduce__(self) -> Any:
        raise TypeError(
            "a shared Group cannot be pickled: each process makes its own (collectively), or "
            "attaches a tensor by name with shared.attach(name)")

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
                names which asked for what; every rank raises; a rank whose arguments were
                refused raises its own error, and the others a ValueError naming it).
            TimeoutError: a rank did not make the call within the group's timeout.
            OSError: the memory could not be had or shared.
            CudaError: device memory without a CUDA driver, or a CUDA call failed (on the rank
                where it failed; the others raise RuntimeError naming it).
        """
        self._core.require("create_tensor")
        try:
            element_size = _core.shared_create_dtype(dtype, layout)
            memory, index = _memory_of(device, "create_tensor")
            _core.shared_create_args(layout, memory, name, self.rank, self.world_size)
        except Exception as e:
            # Refused here, the call still takes part: the other ranks raise ValueError at once,
            # naming this rank, rather than waiting out the timeout.
            self._core.refuse("create_tensor", f"{type(e).__name__}: {e}")
            raise
        core = self._core.create(shape, str(dtype), element_size, layout, name or "", memory, index)
        return SharedTensor(core, dtype, self._core)

    def attach(self, name: str) -> SharedTensor:
        """The shared tensor created under `name` in this group's store (not collective; its
        owners must not have closed it), waiting up to the group's timeout for it to appear.
        One this group created has this rank's rows as :meth:`SharedTensor.local`; one another
        group created is attached as :func:`attach` does. Raises TimeoutError when none
        appears in time."""
        core = self._core.attach(name)
        group = self._core if core.rank >= 0 else None
        return SharedTensor(core, _core.shared_attached_dtype(core, name), group)

    def barrier(self) -> None:
        """Collective: returns once every rank has called it (``TimeoutError`` otherwise)."""
        self._core.barrier("barrier")

    def close(self) -> None:
        """Closes every tensor of this group and stops sharing (not collective). Idempotent.

        Groups are closed when dropped and at interpreter exit. The rank that serves the group's store (rank 0
        when no ``store`` is given outside torchrun) then keeps serving it until every other
        rank has closed its group or exited, at most the timeout: ranks still finishing a
        collective call do not lose the store under them."""
        self._core.close()

    def __enter__(self) -> "Group":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


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
    return SharedTensor(*_core.shared_attach_outside(name, store, timeout))
