"""A ``torch.distributed.checkpoint`` (DCP) storage backend on tensortier's engine: ``Writer`` and
``Reader`` for the stock DCP calls, in DCP's layout (the guide: "Distributed checkpoints" in
docs/checkpoints.md)."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import importlib
import io
import os
import pathlib
import pickle
import sys
import threading
import uuid
from collections.abc import Callable
from concurrent import futures
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint import filesystem as _fs
from torch.distributed.checkpoint import metadata as _md
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import _create_read_items
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from . import _core
from .checkpoint import _format
from ._runtime import default_io, dtype_names, gc_paused, quantized_dtypes, torch_dtypes

__all__ = ["LoadPlanner", "Reader", "SavePlanner", "Writer"]

# The key of the one WriteResult each rank's write_data returns.
_RANK_WRITES = "tensortier: the rank's items"
_VERSION = "1.0.0"  # DCP's CURRENT_DCP_VERSION for this layout
# StorageMeta.tensortier_format: tensortier's own format, a Reader refuses a newer one.
_FORMAT: int = _core.dcp_format


def _extent(tensor: Any) -> int:
    """The bytes from `tensor`'s first element to past its last, views included."""
    if tensor.numel() == 0:
        return 0
    last = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))
    return (last + 1) * tensor.element_size()


def _directory(path: str | os.PathLike[str]) -> str:
    """The checkpoint directory `path` names: "" is the current one, as for pathlib.Path (and
    stock DCP's FileSystemWriter/Reader)."""
    return os.fspath(path) or "."


def _done(value: Any) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(value)
    return fut


def _stage(state_dict: Any) -> Any:
    """``Writer.stage``'s copy of `state_dict` (nested dicts, lists and tuples), DTensors rebuilt
    around their staged local tensors; other values deep-copied (kept as they are when they
    cannot be: the save then names them)."""
    return _stage_begin(state_dict)()


def _stage_begin(state_dict: Any) -> Callable[[], Any]:
    """:func:`_stage` in two steps. This one takes the state dict's structure, its non-tensor
    values (deep-copied) and its tensors, and marks where the CUDA ones' queued work ends; it
    returns the second, which copies the tensors (the bulk copy in C++, GIL released) and
    returns the copy. The second may run on another thread: the tensors must not change
    until it is done."""
    # () where no DTensor can exist (a torch without it, or a process that has not imported it:
    # importing it costs seconds).
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", ())
    sources: list[Any] = []
    with torch.no_grad(), gc_paused():
        shaped = _core.dcp_stage_collect(state_dict, sources, torch.Tensor, dtensor)
        # The work queued on each CUDA device's current stream here: copies wait for it.
        queued = {}
        for t in sources:
            if t.is_cuda and t.device not in queued:
                queued[t.device] = torch.cuda.Event()
                queued[t.device].record(torch.cuda.current_stream(t.device))

    def finish() -> Any:
        with torch.no_grad(), gc_paused(), contextlib.ExitStack() as streams:
            # The copies go on streams of their own (the default stream would queue them after
            # the training work launched meanwhile), once the work queued above is done.
            for device, event in queued.items():
                stream = _staging_stream(device)
                stream.wait_event(event)
                streams.enter_context(torch.cuda.stream(stream))
            return _stage_copy(shaped, sources, dtensor, list(queued))

    return finish


_staging_streams: dict[Any, Any] = {}  # a CUDA device's stream for staging copies


def _staging_stream(device: Any) -> Any:
    stream = _staging_streams.get(device)
    if stream is None:
        stream = _staging_streams.setdefault(device, torch.cuda.Stream(device))
    return stream


def _stage_copy(shaped: Any, sources: list[Any], dtensor: Any, devices: list[Any]) -> Any:
    """The copy of :func:`_stage_begin`'s tensors (`sources`, with CUDA tensors on `devices`)
    in a staging arena, put back into `shaped`."""
    storable = dtype_names().keys() - quantized_dtypes()  # what a DCP item can hold
    # Each stageable tensor's bytes (None: staged by torch, and refused by the save where it
    # must be); the arena is pinned for the first CUDA tensor's device.
    sizes = [t.numel() * t.dtype.itemsize if t.dtype in storable and t.layout == torch.strided
             and (t.is_cpu or t.is_cuda) else None for t in sources]
    pinned_device = next((torch.cuda.current_device() if t.device.index is None
                          else t.device.index for t, n in zip(sources, sizes)
                          if n is not None and t.is_cuda), None)
    # The arena is in use while a tensor made from its capsule (each staged one) lives.
    address, capsule, offsets = _core.take_staging_arena(sizes, pinned_device)
    memory = torch.from_dlpack(capsule)
    bases: dict[Any, Any] = {}  # the arena as a flat tensor of each dtype
    staged: list[Any] = []
    # Plain CPU tensors: one C++ copy of them all (their views made here, no copy each).
    copies: list[tuple[int, int, int]] = []  # (offset in the arena, address, bytes)
    for t, offset, n in zip(sources, offsets, sizes):
        if offset is None:
            staged.append(t.clone() if t.is_cpu else t.cpu())  # host memory in any case
            continue
        dtype = t.dtype
        base = bases.get(dtype)
        if base is None:
            base = bases[dtype] = memory.view(dtype)
        start = offset // dtype.itemsize
        if t.is_contiguous():
            out = base.as_strided(t.shape, t.stride(), start)
            if t.is_cpu and not t.is_conj() and not t.is_neg():
                staged.append(out)
                copies.append((offset, t.data_ptr(), n))
                continue
        else:
            out = base.narrow(0, start, t.numel()).view(t.shape)
        staged.append(out)
        if t.is_cuda:
            out.copy_(t, non_blocking=True)
        else:
            out.copy_(t)  # strided, conjugate or negative views: torch resolves them
    _core.copy_into_staging_arena(address, copies)
    for device in devices:
        torch.cuda.current_stream(device).synchronize()
    del bases, memory
    return _core.dcp_stage_rebuild(shaped, staged, dtensor)


def _refuse_tensor(item: Any, kind: Any) -> None:
    """TypeError: write item `item` is a tensor of `kind` (a dtype, a layout), which no file of
    ours stores."""
    raise TypeError(f"{_core.dcp_item_name(item.index)}: tensors of {kind} cannot be saved by "
                    "tensortier.dcp (dense tensors of torch's plain dtypes only)")


def _write_sources(items: list[Any], planner: SavePlanner) -> tuple[list[str], list[Any]]:
    """(tensortier's dtype names, "" for a bytes item; the tensors, bytes items as uint8 host
    tensors) of the write items: those not in host memory or not contiguous are copied by
    :func:`_host_copies` as the write reaches them. TypeError naming the item for what cannot be
    saved."""
    names = dtype_names()
    quantized = quantized_dtypes()
    dtypes: list[str] = []
    tensors: list[Any] = []
    for item, t in zip(items, _core.dcp_write_values(items, planner, DefaultSavePlanner,
                                                     WriteItemType.BYTE_IO, torch.Tensor)):
        if isinstance(t, bytes):
            dtypes.append("")
            tensors.append(torch.frombuffer(bytearray(t), dtype=torch.uint8) if t
                           else torch.empty(0, dtype=torch.uint8))
            continue
        if t is None:
            t = planner.resolve_data(item).detach()  # a DTensor's shard, a tensor subclass...
        dt = names.get(t.dtype) if t.layout == torch.strided and not t.is_meta else None
        if dt is None or t.dtype in quantized:
            _refuse_tensor(item, t.layout if t.layout != torch.strided
                           else "meta" if t.is_meta else t.dtype)
        dtypes.append(dt)
        tensors.append(t)
    return dtypes, tensors


def _in_place(t: Any) -> bool:
    """Whether the file can take `t`'s bytes where they are (contiguous host memory)."""
    return t.is_cpu and t.is_contiguous() and not t.is_conj() and not t.is_neg()


def _host_copies(tensors: list[Any]) -> list[Any]:
    """Contiguous host copies of `tensors`, as the file stores them: :func:`_stage`'s, in a
    staging arena (pinned where they are on a GPU) that the next group reuses once these are
    dropped."""
    return list(_stage(tensors))


class _CheckpointDirectory:
    """``path`` and ``checkpoint_id`` as torch's ``FileSystemWriter`` and ``FileSystemReader``
    have them: ``pathlib.Path``s of the checkpoint directory."""

    _dir: str  # what the C++ calls take

    @property
    def path(self) -> pathlib.Path:
        """The checkpoint directory."""
        return pathlib.Path(self._dir)

    @path.setter
    def path(self, value: str | os.PathLike[str]) -> None:
        self._dir = _directory(value)

    @property
    def checkpoint_id(self) -> pathlib.Path:
        """The checkpoint directory (DCP's ``checkpoint_id``)."""
        return self.path


class Writer(_CheckpointDirectory, StorageWriter, AsyncStager):
    """A DCP ``StorageWriter`` writing each rank's items through tensortier's engine, and the
    ``AsyncStager`` of ``dcp.async_save(state_dict, storage_writer=Writer(path))``.

    Args:
        path: the checkpoint directory (made if missing). A save over an existing checkpoint
            leaves it whole until the new one is committed, then removes its files.
        direct: write with O_DIRECT where the filesystem allows it.
        async_staging: ``dcp.async_save`` returns before the state dict is copied, as with
            torch's ``DefaultStager(StagingOptions(use_async_staging=True))``: it returns an
            ``AsyncSaveResponse``, and nothing may change the state dict's tensors (an
            optimizer step; a forward pass in training mode that updates BatchNorm's running
            statistics) before its ``staging_completion`` is done; a forward and backward
            pass that leave them alone may run meanwhile. ``False`` (the default):
            ``async_save`` returns once the copy is done, and returns the upload's future.
        overwrite: ``FileSystemWriter``'s: False refuses a save into a directory that holds a
            checkpoint (``RuntimeError``, as stock raises it).
        single_file_per_rank: ``FileSystemWriter``'s, taken so that code passing it keeps
            working; each rank writes one file.
        sync_files: taken likewise; every file is made durable (the commit needs it).
        thread_count: taken likewise; the engine sizes its own parallelism.
        per_thread_copy_ahead: taken likewise.
        cache_staged_state_dict: taken likewise; staging memory is reused from save to save.
    """

    # stage() returns once its copy is done, or a future of it: nothing to synchronize.
    _synchronize_after_execute = False

    def __init__(self, path: str | os.PathLike[str], single_file_per_rank: bool = True,
                 sync_files: bool = True, thread_count: int = 1,
                 per_thread_copy_ahead: int = 10_000_000, cache_staged_state_dict: bool = False,
                 overwrite: bool = True, *, direct: bool = True,
                 async_staging: bool = False) -> None:
        super().__init__()
        del single_file_per_rank, sync_files, thread_count, per_thread_copy_ahead
        del cache_staged_state_dict
        self.overwrite = overwrite
        self._dir = _directory(path)
        self.direct = direct
        self.async_staging = async_staging
        self.save_id = uuid.uuid4().hex
        self.rank = 0  # this process's rank in the save, for errors
        self._staging: futures.Future[Any] | None = None  # the last stage(), async_staging

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Starts a new save (into `checkpoint_id` when given)."""
        if checkpoint_id:
            self._dir = _directory(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Starts a save: a new save id (the name of this rank's file; a Writer used again
        without a new checkpoint_id must not write over the files of the checkpoint it saved
        before). Refuses saves without rank coordination (each rank would need its own
        metadata)."""
        self.save_id = uuid.uuid4().hex
        self.rank = int(kwargs.get("rank") or 0)
        if kwargs.get("use_collectives", True) is False:
            raise ValueError("tensortier.dcp.Writer needs use_collectives=True (the default): "
                             "its commit writes one .metadata for all ranks, not one per rank")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Refuses tensors of a dtype or layout that cannot be saved (TypeError naming the
        item: DCP's plan step, so that no rank writes a file), makes the checkpoint directory;
        with ``overwrite=False``, refuses one that holds a checkpoint."""
        names = dtype_names()
        quantized = quantized_dtypes()
        for item in plan.items:
            if item.tensor_data is None:
                continue  # a bytes item
            props = item.tensor_data.properties
            if props.dtype not in names or props.dtype in quantized or (
                    props.layout != torch.strided):
                _refuse_tensor(item, props.layout if props.layout != torch.strided
                               else props.dtype)
        os.makedirs(self._dir, exist_ok=True)
        if not self.overwrite and os.path.exists(os.path.join(self._dir, ".metadata")):
            raise RuntimeError(f"Checkpoint already exists and self.overwrite={self.overwrite}.")
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Gives rank i's file the name prefix ``__i_``."""
        return [dataclasses.replace(p, storage_data=_fs._StoragePrefix(f"__{i}_"))
                for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Writes this rank's items to a new file (one C++ call, GIL released). Tensors in GPU
        memory (and views that are not contiguous) are copied to host memory (pinned, reused
        from save to save) as the write reaches them, about ``CHECKPOINT_STAGING_BYTES`` at a
        time, after the rest is written. The result
        is one WriteResult for all of the rank's items (which ``finish`` expands), not one per
        item."""
        # A name no earlier save used: the old checkpoint's files stay as they are.
        name = f"{plan.storage_data.prefix}{self.save_id[:16]}{_fs.DEFAULT_SUFFIX}"
        with gc_paused():  # the per-item Python only: the write itself leaves the GC on
            dtypes, tensors = _write_sources(plan.items, planner)
            plain_fqns: list[str] = []
            if isinstance(plan, _PlainSavePlan) and isinstance(planner, SavePlanner):
                plain_fqns, plain_dtypes, plain_tensors = planner._plain_writes(plan.plain)
                dtypes += plain_dtypes
                tensors += plain_tensors
            shapes, sizes = [t.shape for t in tensors], [t.nbytes for t in tensors]
            addresses = [t.data_ptr() if _in_place(t) else None for t in tensors]
        size, rank_writes = _core.write_dcp_file(
            default_io()._core(), self._dir, name, dtypes, shapes, sizes, addresses, plan.items,
            self.direct, f"rank {self.rank}",
            lambda group: _host_copies([tensors[i] for i in group]), _format._STAGING_BYTES,
            plain_fqns)
        # DCP gathers a few lists and bytes, not objects per item; ``finish`` expands them.
        return _done([WriteResult(index=_md.MetadataIndex(_RANK_WRITES), size_in_bytes=size,
                                  storage_data=rank_writes)])

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any] | futures.Future[Any]:
        """``dcp.async_save``'s staging step (DCP's ``AsyncStager``): a copy of `state_dict`
        whose tensors are in host memory this process reuses from save to save (pinned where
        the tensors are on CUDA), copied on several threads with the GIL released. Returns once
        the copy is done: training may change the state dict while the save writes the copy.
        With ``async_staging``, returns a ``concurrent.futures.Future`` of the copy at once
        (the non-tensor values are deep-copied now; the tensors are copied on another thread,
        and must not change until the future is done).
        A save that starts while another still writes gets memory of its own; once the save
        has written this rank's file, the next stage reuses the memory (a copy is for one save,
        whoever still holds a view of it)."""
        finish = _stage_begin(state_dict)
        if not self.async_staging:
            return finish()
        done: futures.Future[Any] = futures.Future()

        def copy() -> None:
            try:
                staged = finish()
            except BaseException as e:  # reported by the future: the save raises it
                done.set_exception(e)
            else:
                done.set_result(staged)

        done.set_running_or_notify_cancel()
        threading.Thread(target=copy, name="tensortier-dcp-stage").start()
        self._staging = done
        return done

    def __getstate__(self) -> dict[str, Any]:
        # Without the last stage's future: async_save(async_checkpointer_type=PROCESS) pickles
        # the writer to its checkpoint process.
        return {**self.__dict__, "_staging": None}

    def synchronize_staging(self) -> None:
        """Waits until the last ``stage`` has copied the state dict (at once without
        ``async_staging``; with it, ``async_save``'s ``staging_completion`` says the same)."""
        if self._staging is not None:
            self._staging.result()

    def close(self) -> None:
        """Nothing to release: the host memory stays for the process's next save."""

    def finish(self, metadata: _md.Metadata, results: list[list[WriteResult]]) -> None:
        """Commits the checkpoint (coordinator only): ``.metadata`` written durably, then the
        files it does not name (the replaced checkpoint's, dead saves') removed."""
        if isinstance(metadata, _SavedMetadata):  # tensortier.dcp.SavePlanner's
            metadata.storage_meta = self.storage_meta()
            metadata._directory = self._dir
            fqns, dtypes, shapes, flags = metadata._plain
            data, files = _core.dcp_metadata_pickle(
                metadata._regular.state_dict_metadata, _md.TensorStorageMetadata, fqns, dtypes,
                shapes, flags, metadata._regular.planner_data, results, _RANK_WRITES,
                metadata.storage_meta, _VERSION)
            _core.commit_dcp_checkpoint(default_io()._core(), self._dir, data, files,
                                        f"rank {self.rank} (the coordinator)")
            return
        with gc_paused():
            metadata.storage_data = _core.dcp_storage_data(results, _RANK_WRITES,
                                                           _md.MetadataIndex, _fs._StorageInfo)
            metadata.version = _VERSION
            metadata.storage_meta = self.storage_meta()
            data = pickle.dumps(metadata)
        _core.commit_dcp_checkpoint(default_io()._core(), self._dir, data, metadata.storage_data,
                                    f"rank {self.rank} (the coordinator)")

    def storage_meta(self) -> _md.StorageMeta:
        """The checkpoint's id (its path), this save's id and tensortier's format version."""
        meta = _md.StorageMeta(checkpoint_id=self.path, save_id=self.save_id)
        meta.tensortier_format = _FORMAT  # type: ignore[attr-defined]  # torch ignores it
        return meta

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether `checkpoint_id` is a local path (DCP's rule for its file system writer)."""
        return bool(_fs.FileSystem.validate_checkpoint_id(checkpoint_id))


@dataclasses.dataclass(frozen=True)
class _PlainSavePlan(SavePlan):
    """A rank's SavePlan from :class:`SavePlanner`: its plain tensors as lists, not WriteItems.
    ``plain`` is, in a local plan, (fqns, torch's dtype names, shapes, flag bytes: 1
    requires_grad, 2 pinned; nbytes); in the global plan, the indices of those the rank writes
    (None: all)."""

    plain: Any = None


class SavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` for state dicts of many tensors, with :class:`Writer`:
    ``dcp.save(state_dict, storage_writer=Writer(path), planner=SavePlanner())``.

    DCP's default planner makes, sends between ranks and pickles several Python objects per
    tensor (its write items, the metadata's entries), which takes most of a save of thousands
    of small tensors. This one plans the plain tensors of the state dict (not DTensors or
    other sharded values, which it plans as the default does) as lists, and the Writer writes
    the ``.metadata`` from those lists in C++. The checkpoint is the same: the same
    ``.metadata``, as ``DefaultSavePlanner`` and torch's ``FileSystemReader`` read it,
    replicated tensors written once (by the rank that the default dedup picks).

    With another storage writer it plans as ``DefaultSavePlanner`` does. The ``Metadata``
    ``dcp.save`` returns with it reads the checkpoint's ``.metadata`` when first looked into:
    once another save replaced the checkpoint, looking into it raises ``FileNotFoundError``.

    Args:
        flatten_state_dict: ``DefaultSavePlanner``'s.
        flatten_sharded_tensors: ``DefaultSavePlanner``'s.
        dedup_save_to_lowest_rank: ``DefaultSavePlanner``'s.
    """

    def __init__(self, flatten_state_dict: bool = True, flatten_sharded_tensors: bool = True,
                 dedup_save_to_lowest_rank: bool = False) -> None:
        super().__init__(flatten_state_dict=flatten_state_dict,
                         flatten_sharded_tensors=flatten_sharded_tensors,
                         dedup_save_to_lowest_rank=dedup_save_to_lowest_rank)
        self._plain: tuple[Any, ...] | None = None  # create_local_plan's lists
        self._plain_tensors: list[Any] = []
        self._lists = False  # whether the storage writer is ours (it reads the lists)

    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: Any = None,
                       is_coordinator: bool = False) -> None:
        """``DefaultSavePlanner``'s; notes whether the storage writer is a tensortier one."""
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        self._lists = getattr(storage_meta, "tensortier_format", None) is not None

    def create_local_plan(self) -> SavePlan:
        """The default plan of the state dict's other values, with its plain tensors as lists."""
        if not self._lists:
            return super().create_local_plan()
        storable = dtype_names().keys() - quantized_dtypes()
        plain_types = (torch.Tensor, torch.nn.Parameter)
        fqns: list[str] = []
        dtypes: list[str] = []
        shapes: list[tuple[int, ...]] = []
        flags = bytearray()
        nbytes: list[int] = []
        tensors: list[Any] = []
        rest: dict[str, Any] = {}
        names: dict[Any, str] = {}
        with gc_paused():
            for fqn, value in self.state_dict.items():
                if (type(value) not in plain_types or value.dtype not in storable
                        or value.layout != torch.strided or value.is_meta):
                    rest[fqn] = value  # planned (and refused, where it must be) as by default
                    continue
                dtype = value.dtype
                name = names.get(dtype)
                if name is None:
                    name = names[dtype] = str(dtype).removeprefix("torch.")
                fqns.append(fqn)
                dtypes.append(name)
                shapes.append(tuple(value.shape))
                flags.append(int(value.requires_grad) | (2 if value.is_pinned() else 0))
                nbytes.append(value.nbytes)
                tensors.append(value)
            plan = create_default_local_save_plan(rest, self.is_coordinator)
        self._plain = (fqns, dtypes, shapes, bytes(flags), nbytes)
        self._plain_tensors = tensors
        self.plan = _PlainSavePlan(plan.items, planner_data=(
            self.mappings if self.flatten_state_dict else None),
            plain=self._plain)
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Any]:
        """The default global plan of the other values; each plain tensor held by several
        ranks given to one of them, as the default dedup does. The metadata is a
        :class:`_SavedMetadata`, which the Writer writes from lists."""
        if not all(isinstance(p, _PlainSavePlan) for p in all_plans):
            return super().create_global_plan(all_plans)
        plans, metadata = self._create_global_plan(all_plans)
        planned = [sum(item.tensor_storage_size() or 1 for item in p.items) for p in plans]
        kept = _core.dcp_dedup_plain([p.plain[0] for p in plans], [p.plain[4] for p in plans],
                                     planned, self.dedup_save_to_lowest_rank)
        fqns: list[str] = []
        dtypes: list[str] = []
        shapes: list[Any] = []
        flags = bytearray()
        for p, keep in zip(plans, kept):
            p_fqns, p_dtypes, p_shapes, p_flags, _ = p.plain
            if keep is None:
                fqns += p_fqns
                dtypes += p_dtypes
                shapes += p_shapes
                flags += p_flags
            else:
                fqns += [p_fqns[i] for i in keep]
                dtypes += [p_dtypes[i] for i in keep]
                shapes += [p_shapes[i] for i in keep]
                flags += bytes(p_flags[i] for i in keep)
        clash = next((f for f in fqns if f in metadata.state_dict_metadata), None)
        if clash is not None:
            raise ValueError(f"{clash}: a plain tensor on some ranks and another kind of value "
                             "(a DTensor, a sharded tensor, a non-tensor) on others")
        # The mappings went into the metadata: the plans sent back to the ranks carry none.
        plans = [dataclasses.replace(p, planner_data=None, plain=keep)
                 for p, keep in zip(plans, kept)]
        self.global_plan = plans
        self.metadata = _SavedMetadata(metadata, (fqns, dtypes, shapes, bytes(flags)))
        return plans, self.metadata

    def _plain_writes(self, keep: list[int] | None) -> tuple[list[str], list[str], list[Any]]:
        """(fqns, tensortier's dtype names, tensors) of the plain tensors this rank writes."""
        if self._plain is None:
            raise RuntimeError("tensortier.dcp.SavePlanner: write_data before create_local_plan")
        fqns, tensors = self._plain[0], self._plain_tensors
        if keep is not None:
            fqns, tensors = [fqns[i] for i in keep], [tensors[i] for i in keep]
        names = dtype_names()
        return list(fqns), [names[t.dtype] for t in tensors], list(tensors)


class _LazyMetadata(_md.Metadata):
    """A ``Metadata`` whose entry fields (``state_dict_metadata``, ``planner_data``,
    ``storage_data``: tens of thousands of objects for a state dict of many tensors) are made
    when first looked into, by ``_full``; ``storage_meta`` and ``version`` are plain
    attributes."""

    def _full(self) -> _md.Metadata:
        raise NotImplementedError

    @property  # type: ignore[override]
    def state_dict_metadata(self) -> dict[str, Any]:  # noqa: D102 - Metadata's field
        return self._full().state_dict_metadata

    @state_dict_metadata.setter
    def state_dict_metadata(self, value: dict[str, Any]) -> None:
        self._full().state_dict_metadata = value

    @property  # type: ignore[override]
    def planner_data(self) -> Any:  # noqa: D102 - Metadata's field
        return self._full().planner_data

    @planner_data.setter
    def planner_data(self, value: Any) -> None:
        self._full().planner_data = value

    @property  # type: ignore[override]
    def storage_data(self) -> Any:  # noqa: D102 - Metadata's field
        return self._full().storage_data

    @storage_data.setter
    def storage_data(self, value: Any) -> None:
        self._full().storage_data = value


class _SavedMetadata(_LazyMetadata):
    """The ``Metadata`` of a save planned by :class:`SavePlanner`: its entries as lists until
    the Writer has written them, then read from the checkpoint's ``.metadata`` when first
    looked into (``dcp.save`` returns it on every rank; it crosses between ranks as the
    checkpoint's path and ids, not as thousands of objects)."""

    def __init__(self, regular: _md.Metadata | None, plain: tuple[Any, ...] | None,
                 directory: str | None = None, storage_meta: Any = None) -> None:
        # Not Metadata.__init__: its entry fields are properties here.
        self._regular = regular
        self._plain = plain
        self._directory = directory
        self._read: _md.Metadata | None = None
        self.storage_meta = storage_meta
        self.version = _VERSION

    def __reduce__(self) -> Any:
        return (_SavedMetadata, (None, None, self._directory, self.storage_meta))

    def _full(self) -> _md.Metadata:
        if self._read is None:
            if self._directory is None:
                raise RuntimeError("tensortier.dcp: the metadata of a save that has not "
                                   "committed yet")
            path = _core.dcp_metadata_path(self._directory)
            md = _MetadataUnpickler(io.BytesIO(_core.read_dcp_metadata_bytes(
                self._directory))).load()
            saved = getattr(self.storage_meta, "save_id", None)
            if getattr(md.storage_meta, "save_id", None) != saved:
                raise FileNotFoundError(
                    errno.ENOENT, f"the checkpoint of save {saved} is no longer in "
                    f"{self._directory}: another save replaced it", path)
            self._read = md
        return self._read


class _ReadMetadata(_LazyMetadata):
    """The ``Metadata`` a Reader read from a ``.metadata`` that carries tensortier's index
    (written with :class:`SavePlanner`): :class:`LoadPlanner` plans from the index
    (``_table``, a ``DcpMetadataTable``); the Python objects are unpickled only when something
    looks into the entries (torch's planners do)."""

    def __init__(self, data: bytes, table: Any, path: str) -> None:
        # Not Metadata.__init__: its entry fields are properties here.
        self._data = data
        self._table = table
        self._path = path
        self._unpickled: _md.Metadata | None = None
        checkpoint_id, save_id, load_id, modules, fmt = table.storage_meta
        meta = _md.StorageMeta(checkpoint_id=pathlib.Path(checkpoint_id), save_id=save_id,
                               load_id=load_id, modules=list(modules))
        if fmt is not None:
            meta.tensortier_format = fmt  # type: ignore[attr-defined]
        self.storage_meta = meta
        self.version = table.version

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self._full().__reduce_ex__(protocol)  # as the plain Metadata

    def _full(self) -> _md.Metadata:
        if self._unpickled is None:
            md = _unpickle_metadata(self._data, self._path)
            md.storage_meta, md.version = self.storage_meta, self.version  # this load's ids
            self._unpickled = md
        return self._unpickled


class _MetadataUnpickler(pickle.Unpickler):
    """The weights_only rule for DCP metadata (torch's own weights_only unpickler reads only
    protocol 2, and DCP pickles its metadata with protocol 4)."""

    def find_class(self, module: str, name: str) -> Any:
        if _core.dcp_metadata_global_allowed(module, name):  # the CLI's reader's rule
            if module == "pathlib._local":  # where Python 3.13 and later keep pathlib's classes
                module = "pathlib"
            value = getattr(importlib.import_module(module), name, None)
            if module != "torch" or value is torch.Size or isinstance(
                    value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not allowed in DCP metadata")


def _unpickle_metadata(data: bytes, path: str) -> Any:
    """The object the ``.metadata`` bytes `data` (of `path`) pickle, by the weights_only rule;
    ValueError naming `path` for anything else."""
    try:
        return _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as e:
        raise ValueError(f"{path}: not a DCP metadata file this reader accepts ({e})") from e


class _MetadataDigest(bytes):
    """A digest of the ``.metadata`` a rank read, carried in its load plan for the coordinator
    to compare with the other ranks' (told apart from what a planner may put there)."""


# How many times a load reads .metadata when saves keep replacing it under the read.
_METADATA_READS = 3


def _unpickled_unchecked(planner: LoadPlanner, raw: bytes) -> bool:
    """Whether `planner` would unpickle the bytes item `raw` with torch.load(weights_only=False),
    which runs any code a pickle names: DefaultLoadPlanner's ``load_bytes`` does, for every
    bytes item; a planner's own ``load_bytes`` decides what its bytes are (DCP's contract), and
    only those that are torch.save files are taken as headed there."""
    if type(planner).load_bytes is DefaultLoadPlanner.load_bytes:
        return True
    return raw.startswith(b"PK\x03\x04")


def _check_weights_only(raw: bytes, path: str, name: str) -> None:
    """ValueError naming the file and the value unless torch.load(weights_only=True) reads
    `raw`, with ``io.BytesIO`` allowed (a value DCP itself saves: torchtitan's TrainState
    holds some) besides what ``torch.serialization.safe_globals`` allows at the call."""
    allowed = torch.serialization.get_safe_globals()
    try:
        # (Not when the caller allowed it already: leaving the context would take it away.)
        with (contextlib.nullcontext() if io.BytesIO in allowed
              else torch.serialization.safe_globals([io.BytesIO])):
            torch.load(io.BytesIO(raw), weights_only=True)
    except Exception as e:
        raise ValueError(
            f"{path}: the value {name} holds what torch.load(weights_only=True) refuses ({e}). "
            "If you trust the checkpoint, allow the classes it names with "
            "torch.serialization.safe_globals([...]) around dcp.load") from e


class Reader(_CheckpointDirectory, StorageReader):
    """A DCP ``StorageReader`` reading through tensortier's engine.

    Each rank reads only the bytes its targets need: an item a target takes whole is read whole
    (straight into the target where both are contiguous CPU tensors of one dtype); a load into
    another sharding (2 ranks into 4, ``Shard(0)`` into ``Shard(1)``...) reads only the runs of
    each stored tensor that a target's block selects, sorted and merged with the other reads of
    the file (runs a page or less apart share a request); with ``verify``, the 32 KiB blocks of
    the stored data that those runs touch are read whole, and checked. The small items read
    whole are read in few large requests, once for their zip records and data alike.

    Args:
        path: the checkpoint directory (written by ``Writer`` or torch's ``FileSystemWriter``,
            with either ``serialization_format``; torch's own ``FileSystemReader`` reads only
            ``TORCH_SAVE``).
        verify: ``True`` (the default) checks each item read whole against its xxh64 in the
            metadata (``Writer``'s checkpoints) or its zip CRC-32 (torch's), and each item read
            in part by the xxh64s of the 32 KiB blocks of its data that the part touches (read
            whole for it; ``Writer``'s checkpoints record them); a mismatch raises ValueError
            naming the file, the item and the byte range. Parts of items without block sums
            (torch's checkpoints, older ones of ``Writer``) are not checked, nor are torch's
            ``SAFETENSORS`` items (they carry no checksum); ``"full"`` reads every item whole,
            so that all are checked. ``False`` checks nothing.

    Attributes:
        bytes_read: the bytes this process's Reader read from data files in its last
            ``read_data`` (zip records and tensor data; not the ``.metadata``).
    """

    def __init__(self, path: str | os.PathLike[str], *, verify: bool | str = True) -> None:
        super().__init__()
        _core.check_dcp_verify(verify)
        self._dir = _directory(path)
        self.verify = verify
        self.storage_data: dict[Any, Any] = {}
        self.chunk_sizes: dict[tuple[str, tuple[int, ...]], list[int]] = {}
        self.bytes_read = 0
        self._metadata_read: tuple[int | None, bytes] | None = None  # (rank, its bytes)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Starts a new load (from `checkpoint_id` when given)."""
        self.storage_data = {}
        self.chunk_sizes = {}
        self._metadata_read = None
        if checkpoint_id:
            self._dir = _directory(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> _md.Metadata:
        """The checkpoint's ``.metadata``; with ``rank=N`` (``dcp.load``'s fallback when there
        is none), the rank-local ``__N.metadata`` torch's ``FileSystemWriter`` writes in a save
        with ``use_collectives=False``. FileNotFoundError naming the path when the directory,
        its ``.metadata`` or a data file it names is missing (saying when the ``.metadata`` is of
        another save than the data files), ValueError when it is not DCP metadata or comes from a
        newer tensortier. (``dcp.load`` reports these inside an AssertionError or a
        CheckpointException.)"""
        rank = kwargs.get("rank")
        path = _core.dcp_metadata_path(self._dir, rank)
        for attempt in range(_METADATA_READS):
            data = _core.read_dcp_metadata_bytes(self._dir, rank)
            # tensortier's index, where the file has one: its Python objects wait until looked
            # into (LoadPlanner never does).
            table = _core.dcp_metadata_table(data, path) if rank is None else None
            md: Any = None
            try:
                if table is not None:
                    table.check(self._dir, path)
                    md = _ReadMetadata(data, table, path)
                else:
                    md = _unpickle_metadata(data, path)
                    _core.check_dcp_metadata(self._dir, md, _md.Metadata, path)
                break
            except FileNotFoundError:
                # A save committed between the read and the check (and removed the files the
                # metadata read named): nothing is planned yet, so read the new one.
                if attempt + 1 == _METADATA_READS or self._read_again(rank) == data:
                    raise
        self._metadata_read = (rank, data)
        if md.storage_meta is None:
            md.storage_meta = _md.StorageMeta()
        md.storage_meta.load_id = uuid.uuid4().hex
        return md

    def set_up_storage_reader(self, metadata: _md.Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        """Keeps the metadata's item locations and its chunks' sizes (checked against the
        tensors stored in the data files). ValueError for a tensor whose chunks do not hold all
        of its elements (a load would leave the rest as it was), and for items stored through
        stream transforms (compressed by FileSystemWriter's ``_extensions``)."""
        if isinstance(metadata, _ReadMetadata):  # the index: read_metadata checked it
            self.storage_data, self.chunk_sizes = metadata._table, {}
            return
        self.chunk_sizes = _core.dcp_chunk_sizes(
            metadata.state_dict_metadata, _md.TensorStorageMetadata,
            _core.dcp_metadata_path(self._dir))
        transformed = next((info.transform_descriptors for info in metadata.storage_data.values()
                            if getattr(info, "transform_descriptors", None)), None)
        if transformed:
            raise ValueError(
                f"{_core.dcp_metadata_path(self._dir)}: items stored through stream transforms "
                f"({', '.join(map(str, transformed))}: FileSystemWriter's _extensions, such as "
                "compression), which tensortier.dcp.Reader does not read; load the checkpoint "
                "with torch's FileSystemReader(path, _extension_registry=...)")
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """The plan, carrying a digest of the ``.metadata`` this rank read (in its
        ``storage_data``, which DCP leaves to the storage layer, where the planner left it
        unset) for :meth:`prepare_global_plan` to compare. Rank-local metadata (``__N.metadata``)
        differs from rank to rank by design: no digest."""
        if (plan.storage_data is None and self._metadata_read is not None
                and self._metadata_read[0] is None):
            plan = dataclasses.replace(plan, storage_data=_MetadataDigest(
                hashlib.blake2b(self._metadata_read[1], digest_size=16).digest()))
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """The plans, unchanged. ValueError where ranks read different metadata: a save
        committed into the directory between their reads, and the load would mix two
        checkpoints."""
        digests = [p.storage_data for p in plans]
        if all(isinstance(d, _MetadataDigest) for d in digests) and len(set(digests)) > 1:
            others = [r for r, d in enumerate(digests) if d != digests[0]]
            raise ValueError(
                f"{_core.dcp_metadata_path(self._dir)}: ranks {', '.join(map(str, others))} read "
                "another .metadata than rank 0: a save replaced the checkpoint in this "
                "directory while the ranks read it, and this load would mix the two; load again "
                "(and let saves into a directory finish before loading it)")
        return [dataclasses.replace(p, storage_data=None)
                if isinstance(p.storage_data, _MetadataDigest) else p for p in plans]

    def _read_again(self, rank: int | None) -> bytes | None:
        """The metadata file's bytes now (None where it cannot be read)."""
        try:
            return _core.read_dcp_metadata_bytes(self._dir, rank)
        except OSError:
            return None

    def _replaced(self) -> bool:
        """Whether the metadata this Reader read is no longer the directory's (a save committed
        since, and removed the data files the old one named)."""
        if self._metadata_read is None:
            return False
        rank, data = self._metadata_read
        return self._read_again(rank) != data

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether `checkpoint_id` is a local path (DCP's rule for its file system reader)."""
        return bool(_fs.FileSystem.validate_checkpoint_id(checkpoint_id))

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Reads the plan's items, file by file (one C++ read per file, GIL released), and
        counts the bytes read from the files in ``bytes_read``."""
        self.bytes_read = 0
        engine = default_io()._core()
        dtypes = torch_dtypes()
        items = plan.items
        if isinstance(plan, _PlainLoadPlan) and isinstance(planner, LoadPlanner):
            items = [*items, *planner._plain_reads]
        with gc_paused():  # objects per item: collections would walk them again and again
            for relative_path, reqs in _core.dcp_requests_by_file(items, self.storage_data):
                path = os.path.join(self._dir, relative_path)
                try:
                    load = _core.DcpFileLoad(engine, path, reqs, self.storage_data,
                                             self.chunk_sizes, LoadItemType.BYTE_IO, self.verify,
                                             dtypes)
                except FileNotFoundError as e:
                    if not self._replaced():
                        raise
                    raise FileNotFoundError(
                        errno.ENOENT, f"a save replaced the checkpoint in {self._dir} during this "
                        "load (its .metadata changed after this load read it, and the data files "
                        "the old one named are gone); load again", path) from e
                try:
                    self._read_file(load, path, planner, engine)
                finally:  # now: an error a caller keeps would hold the file's descriptors
                    load.close()
        return _done(None)

    def _read_file(self, load: Any, path: str, planner: LoadPlanner, engine: Any) -> None:
        """Reads the items of one rank file (`load`, a ``DcpFileLoad``) and commits them."""
        bufs: list[tuple[Any, Any]] = []  # (what is read into, the request's target)
        for req, dtype, shape, stride, nbytes in load.buffers:
            # Straight into the request's target where both lie alike in CPU memory.
            target = None if req is None else planner.resolve_tensor(req).detach()
            into = (target is not None and target.dtype == dtype and target.is_cpu
                    and target.is_contiguous() and list(target.shape) == shape
                    and target.nbytes == nbytes
                    and (stride is None or list(target.stride()) == stride))
            bufs.append((target if into else torch.empty(nbytes, dtype=torch.uint8),
                         target))
        # Targets sharing memory (tied weights, a planner's reused scratch tensor) are
        # read apart, then copied in at their commits, in order: the last one wins, as
        # in stock DCP, where each is read and committed in turn.
        targets = [k for k, (_, target) in enumerate(bufs) if target is not None]
        for i in _core.overlapping_areas(
                [(bufs[k][1].data_ptr(), _extent(bufs[k][1])) for k in targets]):
            buf, target = bufs[targets[i]]
            if buf is target:
                bufs[targets[i]] = (torch.empty(target.nbytes, dtype=torch.uint8), target)
        self.bytes_read += load.read(engine, [b.data_ptr() for b, _ in bufs])
        for i, req, name, view in load.commits:
            buf, target = bufs[i]
            if buf is target:
                planner.commit_tensor(req, target)
            elif view is None:
                raw = buf.numpy().tobytes()
                if _unpickled_unchecked(planner, raw):
                    _check_weights_only(raw, path, name)
                planner.load_bytes(req, io.BytesIO(raw))
            else:
                tensor = buf.view(view[0]).as_strided(*view[1:4])
                if view[4]:  # torch's conjugate bit
                    tensor = tensor.conj()
                if view[5]:  # torch's negative bit
                    tensor = tensor.neg()
                if target is None:
                    target = planner.resolve_tensor(req).detach()
                if target.size() != tensor.size():
                    raise ValueError(f"{path}: {name} gives a tensor of "
                                     f"{tuple(tensor.size())}, the load asks for "
                                     f"{tuple(target.size())}")
                target.copy_(tensor)
                planner.commit_tensor(req, target)


class _PlainIndex(NamedTuple):
    """The storage index of a tensor :class:`LoadPlanner` reads whole: a ``MetadataIndex``'s
    fields."""

    fqn: str
    offset: tuple[int, ...]
    index: int


class _PlainRead(NamedTuple):
    """A read of a whole stored tensor into a plain tensor of the state dict, with a
    ``ReadItem``'s fields (and the target): planned by :class:`LoadPlanner` without sending it
    between the ranks."""

    type: Any
    storage_index: _PlainIndex
    storage_offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    dest_index: _PlainIndex
    dest_offsets: tuple[int, ...]
    target: Any


@dataclasses.dataclass
class _PlainLoadPlan(LoadPlan):
    """A rank's LoadPlan from :class:`LoadPlanner`: ``items`` as torch plans them, and how many
    whole reads of plain tensors the rank's planner holds besides (``_plain_reads``)."""

    plain: int = 0


_MEMORY_FORMATS = {0: torch.contiguous_format, 1: torch.channels_last, 2: torch.preserve_format}


def _storage_entry(table: Any, fqn: str) -> Any:
    """state_dict_metadata[fqn] as torch's objects, from a ``DcpMetadataTable``."""
    entry = table.entry(fqn)
    if entry is None:
        return _md.BytesStorageMetadata()
    dtype, layout, requires_grad, memory_format, pin_memory, size, chunks = entry
    props = _md.TensorProperties(
        dtype=getattr(torch, dtype), layout=torch.serialization._get_layout(layout),
        requires_grad=requires_grad, memory_format=_MEMORY_FORMATS[memory_format],
        pin_memory=pin_memory)
    return _md.TensorStorageMetadata(props, torch.Size(size), [
        _md.ChunkStorageMetadata(torch.Size(o), torch.Size(c)) for o, c in chunks])


class LoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` for state dicts of many tensors, with :class:`Reader`:
    ``dcp.load(state_dict, storage_reader=Reader(path), planner=LoadPlanner())``.

    For a checkpoint saved with :class:`SavePlanner` (its ``.metadata`` carries tensortier's
    index), each plain tensor of the state dict that the checkpoint stores whole is read
    straight into it, planned on its rank from the index: no ``Metadata`` objects, no read
    items sent between the ranks. Everything else (DTensors, tensors stored in shards,
    non-tensor values) is planned as ``DefaultLoadPlanner`` plans it, with its errors (a key
    the checkpoint lacks, a size that differs). With other checkpoints, or another storage
    reader, it plans as ``DefaultLoadPlanner`` does.

    Args:
        flatten_state_dict: ``DefaultLoadPlanner``'s.
        flatten_sharded_tensors: ``DefaultLoadPlanner``'s.
        allow_partial_load: ``DefaultLoadPlanner``'s.
    """

    def __init__(self, flatten_state_dict: bool = True, flatten_sharded_tensors: bool = True,
                 allow_partial_load: bool = False) -> None:
        super().__init__(flatten_state_dict=flatten_state_dict,
                         flatten_sharded_tensors=flatten_sharded_tensors,
                         allow_partial_load=allow_partial_load)
        self._plain_reads: list[_PlainRead] = []

    def create_local_plan(self) -> LoadPlan:
        """The default plan of what the index cannot read whole, and the whole reads."""
        self._plain_reads = []
        md = self.metadata
        if not isinstance(md, _ReadMetadata) or md._unpickled is not None:
            return super().create_local_plan()
        # (DefaultLoadPlanner's fallback to keys flattened as torch 2.3 did is for checkpoints
        # of those versions, which carry no index.)
        table = md._table
        plain_types = (torch.Tensor, torch.nn.Parameter)
        fqns = list(self.state_dict)
        values = list(self.state_dict.values())
        shapes = [tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in values]
        plain = [type(v) in plain_types and v.layout == torch.strided for v in values]
        takes = table.classify(fqns, shapes, plain, not self.allow_partial_load)
        dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", ())
        requests: list[Any] = []
        zeros: dict[int, tuple[int, ...]] = {}
        with gc_paused():
            for fqn, value, shape, take in zip(fqns, values, shapes, takes):
                if take == 0:
                    at = zeros.get(len(shape))
                    if at is None:
                        at = zeros[len(shape)] = (0,) * len(shape)
                    index = _PlainIndex(fqn, at, 0)
                    self._plain_reads.append(_PlainRead(LoadItemType.TENSOR, index, at, shape,
                                                        index, at, value))
                elif take == 1:
                    if (isinstance(value, dtensor)
                            and value.device_mesh.get_coordinate() is None):
                        continue  # a DTensor of a mesh this rank is not in, as by default
                    requests += _create_read_items(fqn, _storage_entry(table, fqn), value)
        return _PlainLoadPlan(requests, plain=len(self._plain_reads))

    def resolve_tensor(self, read_item: Any) -> Any:
        """The target of a whole read; otherwise ``DefaultLoadPlanner``'s."""
        if type(read_item) is _PlainRead:
            return read_item.target
        return super().resolve_tensor(read_item)
