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
    requires_grad, 2 pinned; nbytes; the order of the tensors and ``items`` in the state dict:
    i >= 0 tensor i, i < 0 item ~i); in the global plan, the indices of those the rank writes
    (None: all). ``kept``: set by the dedup, (the plain tensors kept, the items kept, the
    fqn of each of the rank's items before the dedup)."""

    plain: Any = None
    kept: Any = None


def _default_hooks(planner: Any, base: type, hooks: tuple[str, ...]) -> bool:
    """Whether `planner` resolves values as `base` does (no subclass overrides `hooks`, DCP's
    extension points for what is written or read where)."""
    return all(getattr(type(planner), h) is getattr(base, h) for h in hooks)


def _plan_order(n_plain: int, rest: dict[str, Any], rest_at: list[int],
                items: list[Any]) -> list[int]:
    """The state dict's order of a rank's `n_plain` plain tensors (i >= 0) and the write items
    (~j, item j) planned for its other values `rest`, value k of which came after rest_at[k]
    plain tensors."""
    items_of: dict[str, list[int]] = {}
    for j, item in enumerate(items):
        items_of.setdefault(item.index.fqn, []).append(~j)
    order: list[int] = []
    done = 0
    for fqn, at in zip(rest, rest_at):
        order.extend(range(done, at))
        done = at
        order.extend(items_of.pop(fqn, ()))
    order.extend(range(done, n_plain))
    for left in items_of.values():  # items under other keys than their value's (none by default)
        order.extend(left)
    return order


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

    With another storage writer, or in a subclass that overrides ``resolve_data``,
    ``lookup_object`` or ``transform_object``, it plans as ``DefaultSavePlanner`` does. The
    ``Metadata`` it returns from ``create_global_plan`` makes its entries' objects when
    something looks into them (then the Writer pickles those); the one ``dcp.save`` returns reads
    the checkpoint's ``.metadata`` when first looked into (at its path then): once another save
    replaced the checkpoint, or the directory was moved or removed, looking into it raises
    ``FileNotFoundError`` (looked into once before, it keeps what it read).

    Args:
        flatten_state_dict: ``DefaultSavePlanner``'s.
        flatten_sharded_tensors: ``DefaultSavePlanner``'s.
        dedup_replicated_tensors: ``DefaultSavePlanner``'s (deprecated there, no effect).
        dedup_save_to_lowest_rank: ``DefaultSavePlanner``'s.
        enable_plan_caching: ``DefaultSavePlanner``'s. Its cache holds the default plans' objects:
            with it, this planner plans as ``DefaultSavePlanner`` does.
    """

    def __init__(self, flatten_state_dict: bool = True, flatten_sharded_tensors: bool = True,
                 dedup_replicated_tensors: bool | None = None,
                 dedup_save_to_lowest_rank: bool = False,
                 enable_plan_caching: bool = False) -> None:
        super().__init__(flatten_state_dict=flatten_state_dict,
                         flatten_sharded_tensors=flatten_sharded_tensors,
                         dedup_replicated_tensors=dedup_replicated_tensors,
                         dedup_save_to_lowest_rank=dedup_save_to_lowest_rank,
                         enable_plan_caching=enable_plan_caching)
        self._plain: tuple[Any, ...] | None = None  # create_local_plan's lists
        self._plain_tensors: list[Any] = []
        self._lists = False  # whether the storage writer is ours (it reads the lists)

    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: Any = None,
                       is_coordinator: bool = False) -> None:
        """``DefaultSavePlanner``'s; notes whether the storage writer is a tensortier one (and
        the values are resolved as by default)."""
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        self._lists = (
            getattr(storage_meta, "tensortier_format", None) is not None
            and not self._enable_plan_caching
            and _default_hooks(self, DefaultSavePlanner,
                               ("resolve_data", "lookup_object", "transform_object")))

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
        rest_at: list[int] = []  # the place of each value of `rest` among the state dict's
        _core.check_dcp_keys(self.state_dict)
        with gc_paused():
            for fqn, value in self.state_dict.items():
                if (type(value) not in plain_types or value.dtype not in storable
                        or value.layout != torch.strided or value.is_meta):
                    rest[fqn] = value  # planned (and refused, where it must be) as by default
                    rest_at.append(len(fqns))
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
            order = _plan_order(len(fqns), rest, rest_at, plan.items)
        self._plain = (fqns, dtypes, shapes, bytes(flags), nbytes, order)
        self._plain_tensors = tensors
        self.plan = _PlainSavePlan(plan.items, planner_data=(
            self.mappings if self.flatten_state_dict else None),
            plain=self._plain)
        return self.plan

    def _dedup_save_plans(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        """torch's dedup over each rank's plain tensors and other items together, in the
        state dict's order (DefaultSavePlanner's ``_create_global_plan`` calls it)."""
        if not all(isinstance(p, _PlainSavePlan) for p in all_plans):
            return super()._dedup_save_plans(all_plans)
        kept = _core.dcp_dedup_save_plans(
            [p.plain[0] for p in all_plans], [p.plain[2] for p in all_plans],
            [p.plain[4] for p in all_plans],
            [[_core.dcp_dedup_key(i.index) for i in p.items] for p in all_plans],
            [[i.tensor_storage_size() or 1 for i in p.items] for p in all_plans],
            [p.plain[5] for p in all_plans], self.dedup_save_to_lowest_rank)
        return [dataclasses.replace(p, kept=(plain, items, [i.index.fqn for i in p.items]),
                                    items=p.items if items is None
                                    else [p.items[i] for i in items])
                for p, (plain, items) in zip(all_plans, kept)]

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Any]:
        """The default global plan; each value several ranks hold given to one of them, as the
        default dedup does. The metadata is a :class:`_SavedMetadata`, which the Writer writes
        from lists."""
        if not all(isinstance(p, _PlainSavePlan) for p in all_plans):
            return super().create_global_plan(all_plans)
        plans, metadata = self._create_global_plan(all_plans)
        lists = _core.dcp_kept_plain([p.plain for p in plans], [p.kept for p in plans])
        clash = next((f for f in lists[0] if f in metadata.state_dict_metadata), None)
        if clash is not None:  # torch's global plan refuses one fqn twice, so
            raise AssertionError(f"item.index.fqn not in md: {clash} is a plain tensor on some "
                                 "ranks and another kind of value (a DTensor, a sharded "
                                 "tensor, a non-tensor) on others")
        plans = [dataclasses.replace(p, plain=p.kept[0], kept=None) for p in plans]
        self.global_plan = plans
        self.metadata = _SavedMetadata._of_lists(metadata, lists)
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


_MEMORY_FORMATS = {0: torch.contiguous_format, 1: torch.channels_last, 2: torch.preserve_format}


def _tensor_entry(fqn: str, dtype: str, size: Any, chunks: Any, requires_grad: bool = False,
                  pin_memory: bool = False, layout: str = "torch.strided",
                  memory_format: int = 0, path: str = "") -> Any:
    """The TensorStorageMetadata of tensor `fqn` as torch makes it, from plain values (torch's
    dtype and layout names, a _MEM_FORMAT_ENCODING value, chunks as (offsets, sizes)).
    ValueError naming `path` (the .metadata) for a dtype or layout this torch lacks."""
    torch_dtype = getattr(torch, dtype, None)
    torch_layout = getattr(torch, layout.removeprefix("torch."), None)
    if not isinstance(torch_dtype, torch.dtype) or not isinstance(torch_layout, torch.layout):
        raise ValueError(f"{path}: {fqn} is a tensor of dtype {dtype} and layout {layout}, "
                         "which this torch does not have")
    props = _md.TensorProperties(
        dtype=torch_dtype, layout=torch_layout, requires_grad=requires_grad,
        memory_format=_MEMORY_FORMATS[memory_format], pin_memory=pin_memory)
    return _md.TensorStorageMetadata(props, torch.Size(size), [
        _md.ChunkStorageMetadata(torch.Size(o), torch.Size(c)) for o, c in chunks])


class _LazyMetadata(_md.Metadata):
    """A ``Metadata`` whose entry fields (``state_dict_metadata``, ``planner_data``,
    ``storage_data``: tens of thousands of objects for a state dict of many tensors) are made
    when first looked into, by the subclass's ``_make``; ``storage_meta`` and ``version`` are
    plain attributes. Made from Metadata's fields (``dataclasses.replace`` does), it holds
    them."""

    def __init__(self, state_dict_metadata: Any = None, planner_data: Any = None,
                 storage_data: Any = None, storage_meta: Any = None,
                 version: str | None = None) -> None:
        # Not Metadata.__init__: the entry fields are properties here.
        self._made: _md.Metadata | None = _md.Metadata(
            state_dict_metadata if state_dict_metadata is not None else {}, planner_data,
            storage_data)
        self.storage_meta = storage_meta
        self.version = version

    def _full(self) -> _md.Metadata:
        if self._made is None:  # only the subclasses' constructors leave it unmade
            self._made = self._make()  # type: ignore[attr-defined]
        return self._made

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

    def _fields(self) -> tuple[Any, ...]:
        full = self._full()
        return (full.state_dict_metadata, full.planner_data, full.storage_data,
                self.storage_meta, self.version)

    def _as_metadata(self) -> _md.Metadata:
        """A plain ``Metadata`` of the same fields."""
        return _md.Metadata(*self._fields())

    # As torch's Metadata: pickled as one (what unpickles is a plain Metadata), equal to one of
    # equal fields, shown as one.
    def __reduce_ex__(self, protocol: Any) -> Any:
        return (_md.Metadata, self._fields())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _md.Metadata):
            return NotImplemented
        theirs = (other._fields() if isinstance(other, _LazyMetadata) else
                  (other.state_dict_metadata, other.planner_data, other.storage_data,
                   other.storage_meta, other.version))
        return self._fields() == theirs

    __hash__ = None  # type: ignore[assignment]  # as Metadata's

    def __repr__(self) -> str:
        return repr(self._as_metadata())


class _SavedMetadata(_LazyMetadata):
    """The ``Metadata`` of a save planned by :class:`SavePlanner`. Until committed, its entries
    are lists (``_regular``: the other values' Metadata; ``_plain``: the plain tensors' lists),
    which the Writer writes as they are unless something made the objects (looked into them,
    changed them: those are pickled then). Once committed (``_directory``), a copy that never
    made them reads them from the checkpoint's ``.metadata`` (``dcp.save`` returns it on every
    rank: it crosses between the ranks as the checkpoint's path and ids)."""

    _regular: _md.Metadata | None = None
    _plain: tuple[Any, ...] | None = None
    _directory: str | None = None

    @classmethod
    def _of_lists(cls, regular: _md.Metadata, plain: tuple[Any, ...]) -> _SavedMetadata:
        md = cls.__new__(cls)
        md._made, md._regular, md._plain = None, regular, plain
        md.storage_meta, md.version = regular.storage_meta, _VERSION
        return md

    @classmethod
    def _committed(cls, directory: str, storage_meta: Any, version: str | None
                   ) -> _SavedMetadata:
        md = cls.__new__(cls)
        md._made, md._directory = None, directory
        md.storage_meta, md.version = storage_meta, version
        return md

    def _lists(self) -> tuple[_md.Metadata, tuple[Any, ...]] | None:
        """(the other values' Metadata, the plain tensors' lists) while the Writer may write
        them as they are; None once the objects were made."""
        if self._made is not None or self._plain is None or self._regular is None:
            return None
        return self._regular, self._plain

    def __reduce_ex__(self, protocol: Any) -> Any:
        if self._directory is not None and self._made is None:
            return (_SavedMetadata._committed, (self._directory, self.storage_meta,
                                                self.version))
        return super().__reduce_ex__(protocol)

    def _make(self) -> _md.Metadata:
        lists = self._lists()
        if lists is not None:  # not committed: the objects from the lists, as torch makes them
            regular, (fqns, dtypes, shapes, flags, order) = lists
            entries = dict(regular.state_dict_metadata)
            for fqn, dtype, shape, flag in zip(fqns, dtypes, shapes, flags):
                entries[fqn] = _tensor_entry(fqn, dtype, shape, [((0,) * len(shape), shape)],
                                             requires_grad=bool(flag & 1),
                                             pin_memory=bool(flag & 2))
            entries = {k: entries.pop(k) for k in order if k in entries} | entries  # torch's order
            return _md.Metadata(entries, regular.planner_data, regular.storage_data)
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
        return md


class _ReadMetadata(_LazyMetadata):
    """The ``Metadata`` a Reader read from a ``.metadata`` that carries tensortier's index
    (written with :class:`SavePlanner`): :class:`LoadPlanner` plans from the index
    (``_table``, a ``DcpMetadataTable``); the Python objects are unpickled only when something
    looks into the entries (torch's planners do)."""

    _table: Any = None
    _data = b""
    _path = ""

    @classmethod
    def _of_index(cls, data: bytes, table: Any, path: str) -> _ReadMetadata:
        md = cls.__new__(cls)
        md._made, md._data, md._table, md._path = None, data, table, path
        checkpoint_id, save_id, load_id, modules, fmt = table.storage_meta
        meta = _md.StorageMeta(checkpoint_id=pathlib.Path(checkpoint_id), save_id=save_id,
                               load_id=load_id, modules=list(modules))
        if fmt is not None:
            meta.tensortier_format = fmt  # type: ignore[attr-defined]
        md.storage_meta, md.version = meta, table.version
        return md

    def _indexed(self) -> bool:
        """Whether a load may plan from the index: nothing made (or changed) the objects."""
        return self._table is not None and self._made is None

    def _make(self) -> _md.Metadata:
        md = _unpickle_metadata(self._data, self._path)
        md.storage_meta, md.version = self.storage_meta, self.version  # this load's ids
        return md


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


def _storage_entry(table: Any, fqn: str, path: str) -> Any:
    """state_dict_metadata[fqn] as torch's objects, from the ``DcpMetadataTable`` of the
    ``.metadata`` at `path`."""
    entry = table.entry(fqn)
    if entry is None:
        return _md.BytesStorageMetadata()
    dtype, layout, requires_grad, memory_format, pin_memory, size, chunks = entry
    return _tensor_entry(fqn, dtype, size, chunks, requires_grad, pin_memory, layout,
                         memory_format, path)


class LoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` for state dicts of many tensors, with :class:`Reader`:
    ``dcp.load(state_dict, storage_reader=Reader(path), planner=LoadPlanner())``.

    For a checkpoint saved with :class:`SavePlanner` (its ``.metadata`` carries tensortier's
    index), each plain tensor of the state dict that the checkpoint stores whole is read
    straight into it, planned on its rank from the index: no ``Metadata`` objects, no read
    items sent between the ranks. Everything else (DTensors, tensors stored in shards,
    non-tensor values) is planned as ``DefaultLoadPlanner`` plans it, with its errors (a key
    the checkpoint lacks, a size that differs). With other checkpoints, another storage
    reader, or in a subclass that overrides ``lookup_tensor`` or ``transform_tensor`` (where
    a tensor is read into), it plans as ``DefaultLoadPlanner`` does.

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
        if not (isinstance(md, _ReadMetadata) and md._indexed() and _default_hooks(
                self, DefaultLoadPlanner, ("lookup_tensor", "transform_tensor"))):
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
                    requests += _create_read_items(fqn, _storage_entry(table, fqn, md._path),
                                                   value)
        return _PlainLoadPlan(requests, plain=len(self._plain_reads))

    def resolve_tensor(self, read_item: Any) -> Any:
        """The target of a whole read; otherwise ``DefaultLoadPlanner``'s."""
        if type(read_item) is _PlainRead:
            return read_item.target
        return super().resolve_tensor(read_item)
