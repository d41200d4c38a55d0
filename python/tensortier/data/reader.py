"""``FileReader``: batches of whole files, read ahead in C++, as torch tensors."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .. import _core
from .._paths import PathArg
from .extents import ExtentMap


def _check_label_dtype(label_dtype: Any) -> torch.dtype:
    """`label_dtype`, the labels tensor's dtype: torch.int32 or torch.int64."""
    if not isinstance(label_dtype, torch.dtype):
        raise TypeError(f"label_dtype must be a torch.dtype, not {type(label_dtype).__name__}")
    if label_dtype not in (torch.int32, torch.int64):
        raise ValueError(f"label_dtype must be torch.int32 or torch.int64, not {label_dtype}")
    return label_dtype


# FileReader's settings that are True or False.
_FLAGS = frozenset({"shuffle", "stick_to_shard", "pad_last_batch", "drop_last", "pin_memory",
                    "extent_checksums", "case_sensitive_filter", "copy", "direct",
                    "check_files"})


def _check_reader_choices(options: Mapping[str, Any],
                          defaults: Mapping[str, bool] | None = None) -> dict[str, bool]:
    """The flags among `options` (FileReader's keyword arguments) as bools, None standing for
    the default (`defaults`, else FileReader's, as DALI takes None for an argument not given),
    and its backend checked: TypeError naming a flag that is neither True nor False (a config
    file's "False" would be true), ValueError for a backend the engine lacks."""
    checked = _core.check_reader_choices({k: v for k, v in options.items() if k in _FLAGS},
                                         options.get("backend"))
    if defaults is None:
        defaults = _reader_defaults()
    return {k: defaults[k] if v is None else v for k, v in checked.items()}


@functools.cache
def _reader_defaults() -> dict[str, bool]:
    """FileReader's defaults of its flags."""
    import inspect

    parameters = inspect.signature(FileReader.__init__).parameters
    return {name: p.default for name, p in parameters.items() if name in _FLAGS}


def _check_device(device: Any, available: bool = True) -> Any:
    """`device` as the torch.device a FileReader fills batches on: ValueError unless a CPU or
    a CUDA one (with `available`: and a GPU is there; asking initialises CUDA, which a process
    about to fork DataLoader workers must not)."""
    checked = torch.device(device)
    if checked.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', not {device!r}")
    if available and checked.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' needs a torch build with CUDA and a GPU")
    return checked


class FileReader:
    """Reads a file set in batches, many files at once, ``prefetch`` batches ahead of the loop.

    Inputs as DALI's ``fn.readers.file`` takes them: ``file_root`` with one subfolder per class
    (labels in sorted folder order; the folders whose names match ``dir_filters``, default all,
    and in them the files matching ``file_filters``, default DALI's image and audio globs),
    ``file_list`` (DALI's text format, ``path label`` per line, relative paths relative to
    ``file_root`` or the list's folder), or ``files`` with optional ``labels`` (default: each
    file's position).

    Shards, padding and the move to the next shard each epoch are DALI's: shard ``k`` of ``n``
    starts at ``len(files) * k // n``; ``pad_last_batch`` repeats a shard's last sample up to
    ``ceil(len(files) / n)`` samples and then to a whole batch, so every shard gives the same
    number of batches; without ``stick_to_shard`` the reader reads shard ``(shard_id + epoch) %
    n`` in each epoch. ``shuffle`` permutes the whole list each epoch by a function of
    ``(seed, epoch)`` only (``_core.epoch_permutation``), the same on every rank, so shards
    never overlap; there is no shuffle buffer. With ``stick_to_shard`` a shuffled shard keeps
    the files it has in epoch 0 and reads them in a new order each epoch, as DALI's does.

    Iterating gives one epoch of ``(samples, labels)``: ``samples`` a list of uint8 tensors, one
    per file, ``labels`` an int32 tensor. The next ``for`` loop reads the next epoch; a loop
    left early resumes where it stopped. The sample tensors are views into the batch's arena,
    which is reused for a later batch once nothing refers to it: treat them as valid until the
    next batch, or pass ``copy=True`` to get tensors in memory of the batch's own: one block of
    exactly its samples' bytes, which the samples share (a sample kept keeps the block).
    ``device="cuda"`` puts each batch on the GPU with one copy (from pinned memory when
    ``pin_memory=True``); ``pin_memory`` alone pins the arenas.

    A file that vanished, cannot be read, is not a regular file or changes size while read
    raises ``OSError`` naming it, or with ``on_error="skip"`` is left out of its batch (the batch
    is smaller) and counted in ``stats["skipped"]``. Running out of descriptors or memory
    (EMFILE, ENFILE, ENOMEM) raises even then: files open at once follow ``RLIMIT_NOFILE``,
    not the batch size. Empty files give empty samples; a file that reports 0 bytes but has
    data (``/proc``) raises ``OSError(EINVAL)``.

    ``extent_map`` (an ``ExtentMap`` or the path of one, ``build_extent_map``) reads the files
    the map holds straight from their block device by their extents (O_DIRECT, the batch's reads
    in flight together) instead of opening them. Each file's identity (device, inode, size, mtime,
    ctime) is checked against the map first; one that changed since is read through the
    filesystem. ``stats["raw_files"]`` and ``stats["fallback_files"]`` count the two; files the
    map does not hold are read as usual, and a map that holds none of them is refused
    (``ValueError``). Each raw read is checked against the file's checksum in the map, so a file
    whose blocks moved (online defragmentation) is read through the filesystem too;
    ``extent_checksums=False`` skips that check, for files that never move. Paths are looked
    up as spelled, then by their real folders under the map root's real path: a ``file_root``
    reached through a symbolic link finds a map built through the real path, and the other way
    round. Raw reads need read access to the disk (root): without
    it the reader is refused with ``PermissionError`` naming the disk.

    ``state_dict()`` / ``load_state_dict()`` resume mid-epoch exactly: the next batch after a
    restore is the one after the last batch given out before the state was taken.

    Keyword-only tuning: ``open_threads`` (files opened at once), ``direct=False`` (read through
    the page cache only), ``backend`` (the engine's: ``"io_uring"``, ``"libaio"``,
    ``"threads"``; default ``TENSORTIER_BACKEND`` or auto), ``check_files=False`` (skip the
    check, when the reader is made, that every listed file exists: a caller that checked),
    ``label_dtype`` (the labels tensor's: ``torch.int32``, DALI's, by default;
    ``torch.int64`` for torch's losses, which take class indices as int64, as torchvision's
    ``ImageFolder`` gives them; the DALI source's labels stay int32).
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
        shard_id: int = 0,
        num_shards: int = 1,
        stick_to_shard: bool = False,
        pad_last_batch: bool = False,
        drop_last: bool = False,
        prefetch: int = 2,
        device: str | torch.device = "cpu",
        pin_memory: bool = False,
        extent_map: ExtentMap | PathArg | None = None,
        *,
        extent_checksums: bool = True,
        file_filters: str | Sequence[str] | None = None,
        case_sensitive_filter: bool = False,
        dir_filters: str | Sequence[str] | None = None,
        copy: bool = False,
        on_error: str = "raise",
        open_threads: int = 16,
        direct: bool = True,
        backend: str | None = None,
        check_files: bool = True,
        label_dtype: torch.dtype = torch.int32,
    ) -> None:
        _core.check_reader_settings(batch_size, prefetch, num_shards, open_threads, seed,
                                    shard_id, on_error)
        self._label_dtype = _check_label_dtype(label_dtype)
        flag = _check_reader_choices(dict(
            shuffle=shuffle, stick_to_shard=stick_to_shard, pad_last_batch=pad_last_batch,
            drop_last=drop_last, pin_memory=pin_memory, extent_checksums=extent_checksums,
            case_sensitive_filter=case_sensitive_filter, copy=copy, direct=direct,
            check_files=check_files, backend=backend))
        self._device = _check_device(device)
        self._paths, self._labels = _core.resolve_sample_inputs(
            file_root, file_list, files, labels, flag["check_files"], file_filters,
            flag["case_sensitive_filter"], dir_filters)
        self._state = _core.ReaderState(
            self._paths, self._labels, batch_size=batch_size, shuffle=flag["shuffle"],
            seed=seed, shard_id=shard_id, num_shards=num_shards,
            stick_to_shard=flag["stick_to_shard"], pad_last_batch=flag["pad_last_batch"],
            drop_last=flag["drop_last"])
        self._copy = flag["copy"]
        self._core = _core.BatchReader(
            self._paths,
            prefetch=prefetch,
            open_threads=open_threads,
            skip_errors=on_error == "skip",
            direct=flag["direct"],
            pin_memory=flag["pin_memory"] or self._device.type == "cuda",
            device=self._device.index or 0,
            backend=backend,
            extent_map=None if extent_map is None else ExtentMap.of(extent_map),
            extent_checksums=flag["extent_checksums"],
        )

    @property
    def files(self) -> list[str]:
        """The paths read, in list order (before shuffling)."""
        return list(self._paths)

    @property
    def labels(self) -> np.ndarray:
        """The labels, one per path (int32)."""
        return self._labels.copy()

    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to."""
        return int(self._state.epoch)

    def __len__(self) -> int:
        """Batches in the current epoch (shards differ by one sample when not padded)."""
        return len(self._state)

    def epoch_indices(self, epoch: int) -> list[int]:
        """File indices this reader returns in ``epoch``, in order, padding included."""
        return self._state.epoch_indices(epoch)

    def set_epoch(self, epoch: int) -> None:
        """Starts ``epoch`` from its first batch: the next batch, of a new iteration or of one
        under way, is its first. The epoch an iteration has under way keeps its place: a script
        that sets each epoch as it starts, while DALI already reads ahead into it, gets each
        batch once. So does the epoch ``load_state_dict`` just resumed, until a batch is given
        out: ``for epoch in range(start, n): reader.set_epoch(epoch)`` after a resume goes on
        where the state was taken."""
        self._state.set_epoch(epoch)

    @property
    def stats(self) -> dict[str, Any]:
        """Counts so far: batches, files, bytes, skipped, direct_bytes, cached_bytes, raw_files
        and fallback_files (with an extent map: files read from the disk, and files that had
        changed since the map was built and were read through the filesystem)."""
        return dict(self._core.stats())

    def state_dict(self) -> dict[str, Any]:
        """Where the reader is: the epoch, the batches of it already given out, the settings
        that fix the order and a digest of the paths and labels (``files_digest``), all
        checked again by ``load_state_dict``: a state resumes only a reader of the same files
        (the same real paths: a root spelled another way, ``"/a/b/"`` or ``"/a/./b"``, relative
        from another working directory or through a symbolic link, is the same root), with the
        same labels."""
        return self._state.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resumes at ``state``: the next batch, of a new iteration or of one under way (a
        loop, a ``dali_source()``), is the one after the last one given out before
        ``state_dict()`` was taken.

        A state without ``files_digest`` (taken before states carried one) is checked by the
        settings and the file count only.

        Raises:
            TypeError: ``state`` is not a dict (what ``state_dict()`` returns).
            ValueError: the state was taken from a reader with other files or settings.
        """
        self._state.load_state_dict(state)

    def batches(self) -> Iterator[Any]:
        """The current epoch's remaining batches as ``_core.Batch`` objects (arena, offsets,
        sizes, file indices), without tensors: what the adapters build on."""
        return self._state.iterate(self._core)

    def batch_labels(self, batch: Any) -> np.ndarray:
        """The int32 labels of a ``_core.Batch``'s samples."""
        return self._labels[np.asarray(batch.indices, dtype=np.int64)]

    def __iter__(self) -> Iterator[tuple[list[torch.Tensor], torch.Tensor]]:
        for batch in self.batches():
            yield self._tensors(batch)

    def _tensors(self, batch: Any) -> tuple[list[torch.Tensor], torch.Tensor]:
        arena = torch.from_numpy(np.frombuffer(batch, dtype=np.uint8))
        labels = torch.from_numpy(self.batch_labels(batch)).to(self._label_dtype)
        if self._device.type == "cuda":
            arena = arena.to(self._device, non_blocking=bool(batch.pinned))
            labels = labels.to(self._device, non_blocking=False)
        samples = [arena[o:o + s] for o, s in zip(batch.offsets, batch.sizes)]
        if self._copy and self._device.type != "cuda" and samples:
            # One block of exactly the samples' bytes, not of the arena (each sample starts on
            # its own 4 KiB there): a batch of 10-byte files is 2.5 KiB, not 1 MiB, kept or
            # sent from a DataLoader worker.
            samples = list(torch.cat(samples).split(list(batch.sizes)))
        return samples, labels

    def dali_source(self, queue_depth: int = 2) -> "DaliSource":
        """This reader as a source for ``fn.external_source(source=..., num_outputs=2,
        batch=True, dtype=[types.UINT8, types.INT32])``; see ``DaliSource``."""
        from .dali import DaliSource

        return DaliSource(self, queue_depth=queue_depth)

    def __reduce__(self) -> Any:
        raise TypeError(
            "a FileReader cannot be pickled (into a DataLoader worker, for one): make it in the "
            "process that reads from it, e.g. in an IterableDataset's __iter__, or use "
            "tensortier.data.FileDataset, which makes one reader per worker")

    def close(self) -> None:
        """Stops reading ahead (also done when the reader is dropped); an iteration under way
        ends."""
        self._state.close(self._core)
