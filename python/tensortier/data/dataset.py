"""``FileDataset``: the reader as a PyTorch ``IterableDataset``, split by worker and rank."""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.utils.data

from .. import _core
from .._paths import PathArg
from .extents import ExtentMap
from .reader import (FileReader, _check_device, _check_label_dtype, _check_reader_choices,
                     _reader_defaults)


# The fields of FileDataset's shared tensor.
_EPOCH, _RESUME_TAKEN, _WORKER_ITERATIONS, _SKIPPED = 0, 1, 2, 3


def _rank_and_world() -> tuple[int, int] | None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


# What FileDataset sets on each worker's reader itself, and the settings it takes by name.
_SET_PER_WORKER = {"files", "labels", "shard_id", "num_shards", "check_files", "file_root",
                   "file_list"}


def _check_reader_options(options: Mapping[str, Any]) -> None:
    """Refuses, when the dataset is made, options no FileReader takes and those the dataset
    sets itself on each worker's reader."""
    import inspect

    known = set(inspect.signature(FileReader.__init__).parameters) - {"self"}
    for name in options:
        if name in ("shard_id", "num_shards"):
            raise TypeError(f"FileDataset splits the files by rank and DataLoader worker itself: "
                            f"pass rank= and world_size= instead of {name}=")
        if name in _SET_PER_WORKER or name not in known:
            raise TypeError(f"FileDataset() got an unexpected keyword argument {name!r}")


def _split_setting(rank: Any, world_size: Any) -> tuple[int, int] | None:
    """(rank, world_size) given to FileDataset, checked; None where neither was given."""
    if rank is None and world_size is None:
        return None
    if rank is None or world_size is None:
        raise ValueError("give FileDataset both rank= and world_size=, or neither")
    r = _core.check_reader_setting(rank, "rank", 0, 63)
    w = _core.check_reader_setting(world_size, "world_size", 1, 63)
    if r >= w:
        raise ValueError(f"rank {r} is out of range for world_size {w}")
    return r, w


class FileDataset(torch.utils.data.IterableDataset):
    """Batches of files for ``torch.utils.data.DataLoader(dataset, batch_size=None, ...)``.

    Every (rank, DataLoader worker) pair reads its own shard (``num_shards = world_size *
    num_workers``; torch.distributed's rank when it is initialised in the process that makes
    the DataLoader, whichever way its workers are started), with the same seeded
    per-epoch shuffle everywhere, so no two read the same file in an epoch. Each item is one
    ``(samples, labels)`` batch as ``FileReader`` yields it; ``copy=True`` (the default) gives
    the batch memory of its own (one block of exactly its samples' bytes), which is what crosses
    from workers to the main process. Call
    ``set_epoch(epoch)`` before each epoch, as with ``DistributedSampler``: every iteration
    reads the epoch last set (0 until then), in the main process and in workers alike,
    ``persistent_workers=True`` included (the epoch lives in shared memory, which workers
    read when each iteration starts).

    ``rank`` and ``world_size`` (both or neither) replace torch.distributed's for the split, as
    ``DistributedSampler(num_replicas=, rank=)`` does: the data-parallel rank where tensor or
    pipeline parallel ranks share batches, or ``rank=0, world_size=1`` to read every file in a
    process of a job (evaluation on one rank).

    The other arguments are ``FileReader``'s; the file list is made (and checked) once, here,
    and so are the settings (a typo or a bad value raises now, not in the workers). Each worker
    forms its own batches, so with ``num_workers > 1`` each may end its epoch on a short batch
    (``drop_last`` drops each).
    """

    def __init__(
        self,
        file_root: PathArg | None = None,
        file_list: PathArg | None = None,
        files: Sequence[PathArg] | None = None,
        labels: Sequence[int] | None = None,
        batch_size: int = 256,
        shuffle: bool = True,
        seed: int = 0,
        pad_last_batch: bool = False,
        drop_last: bool = False,
        prefetch: int = 2,
        *,
        file_filters: str | Sequence[str] | None = None,
        case_sensitive_filter: bool = False,
        dir_filters: str | Sequence[str] | None = None,
        copy: bool = True,
        on_error: str = "raise",
        rank: int | None = None,
        world_size: int | None = None,
        **reader_options: Any,
    ) -> None:
        super().__init__()
        _check_reader_options(reader_options)
        _core.check_reader_settings(batch_size, prefetch, 1, reader_options.get("open_threads", 16),
                                    seed, 0, on_error)
        _check_label_dtype(reader_options.get("label_dtype", torch.int32))
        # The rest of what FileReader checks, now rather than in each worker; the flags as
        # bools (None: this dataset's default) for the workers' readers.
        flags = _check_reader_choices(
            dict(reader_options, shuffle=shuffle, pad_last_batch=pad_last_batch,
                 drop_last=drop_last, copy=copy, case_sensitive_filter=case_sensitive_filter),
            {**_reader_defaults(), "copy": True})
        shuffle, pad_last_batch, drop_last, copy, case_sensitive_filter = (
            flags.pop(k) for k in ("shuffle", "pad_last_batch", "drop_last", "copy",
                                   "case_sensitive_filter"))
        reader_options.update(flags)
        if "device" in reader_options:
            _check_device(reader_options["device"], available=False)
        if reader_options.get("extent_map") is not None:
            ExtentMap.of(reader_options["extent_map"])  # a path: the map is read and checked
        self._split = _split_setting(rank, world_size)
        self._paths, self._labels = _core.resolve_sample_inputs(
            file_root, file_list, files, labels, file_filters=file_filters,
            case_sensitive_filter=case_sensitive_filter, dir_filters=dir_filters)
        self._options = dict(batch_size=batch_size, shuffle=shuffle, seed=seed,
                             pad_last_batch=pad_last_batch, drop_last=drop_last,
                             prefetch=prefetch, copy=copy, on_error=on_error, **reader_options)
        # Shared memory: persistent workers, which hold their own copy of the dataset, see
        # the epoch set after they started (torch passes it to spawned workers by handle).
        # [_EPOCH]: the epoch set; [_RESUME_TAKEN]: 1 once an iteration resumed at the state
        # given to load_state_dict (workers get a copy of it each epoch: it resumes one);
        # [_WORKER_ITERATIONS]: iterations begun in DataLoader workers (state_dict() in this
        # process then has nothing to say).
        # [_SKIPPED]: files on_error="skip" left out, by every process (see `skipped`), each
        # adding to it atomically.
        self._shared = torch.zeros(_SKIPPED + 1, dtype=torch.int64).share_memory_()
        self._worker_iterations_seen = 0  # [_WORKER_ITERATIONS] when this process's began
        self._parent_rank: tuple[int, int] | None = None  # set in copies sent to workers
        self._reader: FileReader | None = None  # the iteration under way in this process
        self._resume: Mapping[str, Any] | None = None  # load_state_dict's, for the next one
        # Whether _resume was loaded in the training process before DataLoader workers copied it
        # (each worker made again every epoch gets it again: it resumes one iteration), rather
        # than in a worker (torchdata's StatefulDataLoader loads each worker's own).
        self._resume_before_workers = False

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration reads (its shuffle and shards), in this process and in
        the DataLoader's workers, persistent ones included."""
        # 63 bits: the epoch is shared with the workers in an int64 tensor.
        self._shared[_EPOCH] = _core.check_reader_setting(epoch, "epoch", 0, 63)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        # Pickled into a DataLoader worker started by spawn or forkserver, where the process
        # group is not initialised: the worker reads the rank of the process that started it.
        state["_parent_rank"] = _rank_and_world() or self._parent_rank
        state["_reader"] = None  # this process's iteration stays here
        return state

    def shard(self) -> tuple[int, int]:
        """(shard_id, num_shards) of the calling process and DataLoader worker: the rank is
        torch.distributed's, in a DataLoader worker its parent's (however it was started)."""
        rank, world = self._split or _rank_and_world() or self._parent_rank or (0, 1)
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return rank * workers + worker, world * workers

    def __iter__(self) -> Iterator[tuple[list[torch.Tensor], torch.Tensor]]:
        shard_id, num_shards = self.shard()
        in_worker = torch.utils.data.get_worker_info() is not None
        if in_worker:
            self._shared[_WORKER_ITERATIONS] += 1
        else:
            self._worker_iterations_seen = int(self._shared[_WORKER_ITERATIONS])
        if num_shards > len(self._paths):
            # More ranks x workers than files (a small validation set): one file per shard.
            # The shards past the last file yield nothing, as an IterableDataset may; with
            # pad_last_batch (every step a collective: DDP) they read the first files again, as
            # DistributedSampler pads, so that every rank gets as many batches.
            if shard_id >= len(self._paths) and not self._options["pad_last_batch"]:
                return
            shard_id %= len(self._paths)
            num_shards = len(self._paths)
        # The files were checked when the dataset was made; each worker does not stat them again.
        reader = FileReader(files=self._paths, labels=self._labels.tolist(), shard_id=shard_id,
                            num_shards=num_shards, check_files=False, **self._options)
        reader.set_epoch(int(self._shared[_EPOCH]))
        if self._resume is not None:
            resume, self._resume = self._resume, None
            # A state of another shard is refused (ValueError) whenever it comes; the state of
            # this shard resumes one iteration only: DataLoader workers made again each epoch
            # get a copy of it, and later epochs read from their start.
            same_shard = (resume.get("shard_id"), resume.get("num_shards")) == (shard_id,
                                                                                num_shards)
            once = self._resume_before_workers and in_worker
            if not once or not same_shard or int(self._shared[_RESUME_TAKEN]) == 0:
                reader.load_state_dict(resume)
                if once:
                    self._shared[_RESUME_TAKEN] = 1
        if len(reader) == 0 and self._options["drop_last"] and (
                files := len(reader.epoch_indices(int(self._shared[_EPOCH])))):
            warnings.warn(
                f"FileDataset: drop_last drops every file of shard {shard_id} of {num_shards} "
                f"({files} files, batch_size {self._options['batch_size']}): this "
                f"rank's DataLoader worker reads nothing this epoch (each worker forms its own "
                f"batches: use fewer workers, a smaller batch_size or drop_last=False)",
                RuntimeWarning, stacklevel=2)
        self._reader = reader
        skipped = self._shared[_SKIPPED:].data_ptr()
        try:
            for batch in reader.batches():
                if batch.skipped:  # counted as the batch is given out (not as it is read ahead)
                    _core.shared_counter_add(skipped, len(batch.skipped))
                yield reader._tensors(batch)
        finally:
            reader.close()

    @property
    def skipped(self) -> int:
        """Files ``on_error="skip"`` has left out of batches (unreadable, vanished, not regular
        files) since the dataset was made, in this process and its DataLoader workers alike
        (each worker's count is in shared memory); counted as each batch is given out."""
        return int(self._shared[_SKIPPED])

    def state_dict(self) -> dict[str, Any]:
        """Where this process's (or DataLoader worker's) iteration is: its reader's
        ``FileReader.state_dict()`` (the epoch, the batches already given out, its shard, the
        settings and files that fix the order); before any iteration, the state given to
        ``load_state_dict``, else ``{}`` (nothing given out: an iteration from the start).
        torchdata's ``StatefulDataLoader`` takes it in each worker."""
        in_worker = torch.utils.data.get_worker_info() is not None
        if not in_worker and int(self._shared[_WORKER_ITERATIONS]) > self._worker_iterations_seen:
            raise RuntimeError(
                "FileDataset.state_dict(): the iteration runs in DataLoader workers, whose "
                "states this process does not have: take each worker's (torchdata's "
                "StatefulDataLoader does), or iterate with num_workers=0")
        if self._reader is None:
            return dict(self._resume) if self._resume is not None else {}
        return self._reader.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Makes the next iteration in this process resume after the last batch given out
        before ``state`` was taken (checked then, by ``FileReader.load_state_dict``: the same
        files, settings and shard, else ``ValueError``)."""
        if not isinstance(state, Mapping):
            raise TypeError(f"FileDataset.load_state_dict needs the dict state_dict() returns, "
                            f"not {type(state).__name__}")
        self._resume = state or None  # {}: from the start
        self._resume_before_workers = torch.utils.data.get_worker_info() is None
        if self._resume_before_workers:
            self._shared[_RESUME_TAKEN] = 0
