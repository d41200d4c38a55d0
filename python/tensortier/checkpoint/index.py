"""Hugging Face shard indexes (model.safetensors.index.json)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from ..io import IOHandle
from ._format import _require, _sniff
from .mapping import _Placement, _Readahead
from .safetensors import _load_safetensors
from .unpickler import _load_torch


def _read_index(path: str) -> dict[str, list[str]]:
    """shard file path -> names it must hold, from a ``*.index.json`` (read by the rules of the
    CLI's: include/tensortier/checkpoint/checkpoint_format.hpp). A shard the index spells two ways
    ("s.safetensors", "./s.safetensors") is one file that must hold the names of both."""
    shards: dict[str, list[str]] = {}
    for shard, names in _require("read_shard_index")(path):
        shards.setdefault(os.path.abspath(shard), []).extend(names)
    return shards


def _take_shard(
    out: dict[str, Any], part: Mapping[str, Any], shard: str, shards: dict[str, list[str]],
    index: str,
) -> None:
    """Adds to `out` the tensors of `shard` (`part`, as read) that the index puts there, in the
    shard's order. The index's weight_map is the checkpoint's list of tensors, as for
    transformers' ``load_sharded_checkpoint`` (its keys are the checkpoint's keys): a tensor a
    shard holds and the index puts in another shard, or in none, is not taken from it (the
    order shards are read in must not decide the bytes, and a name the index omits is not part
    of the checkpoint)."""
    names = shards[shard]
    missing = [n for n in names if n not in part]
    if missing:
        raise ValueError(f"{index}: the index puts {missing[:8]} in {shard}, which lacks them")
    mine = set(names)
    for name, value in part.items():
        if name in mine:
            out[name] = value


def _each_shard(path: str, read: Callable[[str, str], Mapping[str, Any]]) -> dict[str, Any]:
    """What ``read(shard, kind)`` gives for each shard of index `path` ("safetensors" or
    "torch"), taken into one dict by the index's rules (``_take_shard``)."""
    out: dict[str, Any] = {}
    shards = _read_index(path)
    for shard in shards:
        kind = _sniff(shard)
        if kind == "index":  # also stops an index naming itself (endless recursion)
            raise ValueError(f"{path}: shard {shard} is itself an index")
        _take_shard(out, read(shard, kind), shard, shards, path)
    return out


def _load_index(
    path: str, dev: Any, dtype: Any, verify: bool, progress: bool | None, io: IOHandle,
    mapped: _Readahead | None = None, placement: _Placement | None = None,
) -> dict[str, Any]:
    """`mapped`: map the shards (``load(mmap=True)``), sharing this readahead budget."""

    def read(shard: str, kind: str) -> Mapping[str, Any]:
        if kind == "torch":
            part = _load_torch(shard, dev, dtype, verify, progress, io, mapped, placement)
            if not isinstance(part, Mapping):
                raise ValueError(f"{shard}: holds a {type(part).__name__}, not a state dict")
            return part
        return _load_safetensors(
            shard, dev, dtype, verify, progress, io, mapped=mapped, placement=placement
        )

    return _each_shard(path, read)
