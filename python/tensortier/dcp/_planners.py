"""Planners for state dicts of many tensors: ``SavePlanner`` (the rank's plain tensors as
lists, the ``.metadata`` written from them in C++, with an index before its pickle) and
``LoadPlanner`` (whole reads planned from that index), and the ``Metadata`` objects whose entries
are made only when looked into."""

from __future__ import annotations

import dataclasses
import errno
import io
import pathlib
import sys
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint import metadata as _md
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, SavePlan
from torch.distributed.checkpoint.planner_helpers import _create_read_items

from .. import _core
from .._runtime import dtype_names, gc_paused, quantized_dtypes
from ._common import _VERSION, _MetadataUnpickler, _unpickle_metadata

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
