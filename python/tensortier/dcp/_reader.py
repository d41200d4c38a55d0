"""``Reader``: DCP's ``StorageReader`` reading each rank file's byte ranges through tensortier's
engine, checked as they arrive."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import io
import os
import threading
import uuid
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem as _fs
from torch.distributed.checkpoint import metadata as _md
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .. import _core
from .._runtime import default_io, gc_paused, torch_dtypes
from ._common import _CheckpointDirectory, _directory, _done, _extent, _unpickle_metadata
from ._planners import LoadPlanner, _PlainLoadPlan, _ReadMetadata

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


# What DCP saves itself besides what torch.load(weights_only=True) allows: io.BytesIO values
# (torchtitan's TrainState holds some) and bytes (an empty one pickles as a call of bytes()).
_DCP_VALUE_GLOBALS = (io.BytesIO, bytes)
# torch's allowed globals are one set for the process, changed by entering and leaving
# safe_globals: our readers on several threads add and remove theirs one at a time. Other code
# changing the set meanwhile is not held off (torch has no lock for it): its own torch.load may
# see these two allowed for that moment.
_safe_globals_lock = threading.Lock()


def _check_weights_only(raw: bytes, path: str, name: str) -> None:
    """ValueError naming the file and the value unless torch.load(weights_only=True) reads
    `raw`, with ``io.BytesIO`` and ``bytes`` allowed besides what
    ``torch.serialization.safe_globals`` allows at the call."""
    try:
        with _safe_globals_lock:
            # Only those not allowed already: leaving the context takes away what it added.
            missing = [g for g in _DCP_VALUE_GLOBALS
                       if g not in torch.serialization.get_safe_globals()]
            with (torch.serialization.safe_globals(missing) if missing
                  else contextlib.nullcontext()):
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
                    md = _ReadMetadata._of_index(data, table, path)
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
        if isinstance(metadata, _ReadMetadata) and metadata._table is not None:  # checked
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
            into = (target is not None and target.layout == torch.strided
                    and target.dtype == dtype and target.is_cpu and target.is_contiguous()
                    and list(target.shape) == shape and target.nbytes == nbytes
                    and (stride is None or list(target.stride()) == stride))
            bufs.append((target if into else torch.empty(nbytes, dtype=torch.uint8),
                         target))
        # Targets sharing memory (tied weights, a planner's reused scratch tensor) are
        # read apart, then copied in at their commits, in order: the last one wins, as
        # in stock DCP, where each is read and committed in turn.
        targets = [k for k, (_, target) in enumerate(bufs)
                   if target is not None and target.layout == torch.strided]  # sparse: copy_'s
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
