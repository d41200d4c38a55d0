"""Hugging Face shard indexes (model.safetensors.index.json)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..io import IOHandle
from ._format import _require, _sniff
from .mapping import _Placement, _Readahead
from .safetensors import _load_safetensors
from .unpickler import _load_torch


def _read_index(path: str) -> dict[str, list[str]]:
    """shard file path -> names it must hold, from a ``*.index.json`` (read by the rules of the
    CLI's: include/tensortier/checkpoint_format.hpp). A shard the index spells two ways
    ("s.safetensors", "./s.safetensors") is one file that must hold the names of both."""
    shards: dict[str, list[str]] = {}
    for shard, names in _require("read_shard_index")(path):
        shards.setdefault(os.path.abspath(shard), []).extend(names)
    return shards


def _load_index(
    path: str, dev: Any, dtype: Any, verify: bool, progress: bool | None, io: IOHandle,
    mapped: _Readahead | None = None, placement: _Placement | None = None,
) -> dict[str, Any]:
    """`mapped`: map the shards (``load(mmap=True)``), sharing this readahead budget."""
    out: dict[str, Any] = {}
    for shard, names in _read_index(path).items():
        kind = _sniff(shard)
        if kind == "index":
            raise ValueError(f"{path}: shard {shard} is itself an index")
        if kind == "torch":
            part = _load_torch(shard, dev, dtype, verify, progress, io, mapped, placement)
            if not isinstance(part, Mapping):
                raise ValueError(f"{shard}: holds a {type(part).__name__}, not a state dict")
        else:
            part = _load_safetensors(
                shard, dev, dtype, verify, progress, io, mapped=mapped, placement=placement
            )
        missing = [n for n in names if n not in part]
        if missing:
            raise ValueError(f"{path}: the index puts {missing[:8]} in {shard}, which lacks them")
        out.update(part)
    return out
