"""``Writer``: DCP's ``StorageWriter`` (and ``AsyncStager``) writing each rank's items through
tensortier's engine, committed crash-safe."""

from __future__ import annotations

import dataclasses
import os
import pickle
import threading
import uuid
from concurrent import futures
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem as _fs
from torch.distributed.checkpoint import metadata as _md
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from .. import _core
from .._runtime import default_io, dtype_names, gc_paused, quantized_dtypes
from ..checkpoint import _format
from ._common import _FORMAT, _RANK_WRITES, _VERSION, _CheckpointDirectory, _directory, _done
from ._planners import SavePlanner, _PlainSavePlan, _SavedMetadata
from ._staging import _host_copies, _in_place, _stage_begin

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
        item: DCP's plan step, so that no rank writes a file) and keys that are not valid UTF-8
        (ValueError naming the key), makes the checkpoint directory; with ``overwrite=False``,
        refuses one that holds a checkpoint."""
        _core.check_dcp_keys([item.index.fqn for item in plan.items])
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
            lists = metadata._lists()
            if lists is not None:  # its entries as lists still: written from them in C++
                regular, (fqns, dtypes, shapes, flags, order) = lists
                data, files = _core.dcp_metadata_pickle(
                    regular.state_dict_metadata, _md.TensorStorageMetadata, fqns, dtypes, shapes,
                    flags, regular.planner_data, results, _RANK_WRITES, metadata.storage_meta,
                    _VERSION, order)
                _core.commit_dcp_checkpoint(default_io()._core(), self._dir, data, files,
                                            f"rank {self.rank} (the coordinator)")
                # Committed: looked into, it reads what was written.
                metadata._directory, metadata._regular, metadata._plain = self._dir, None, None
                return
            metadata._directory = self._dir  # the objects made: pickled as they are, below
        with gc_paused():
            metadata.storage_data = _core.dcp_storage_data(results, _RANK_WRITES,
                                                           _md.MetadataIndex, _fs._StorageInfo)
            metadata.version = _VERSION
            metadata.storage_meta = self.storage_meta()
            data = pickle.dumps(metadata._as_metadata() if isinstance(metadata, _SavedMetadata)
                                else metadata)
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
