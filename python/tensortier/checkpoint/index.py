"""Hugging Face shard indexes (model.safetensors.index.json)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..io import IOHandle
from ._format import _require
from .mapping import _Placement, _Readahead
from .safetensors import _load_safetensors
from .unpickler import _load_torch


def _each_shard(path: str, read: Callable[[str, str], Any]) -> dict[str, Any]:
    """What ``read(shard, kind)`` gives for each shard of index `path`, in one dict in the
    shards' order (the index read by the CLI's rules), each shard's tensors those the index
    puts there (the order shards are read in must not decide the bytes)."""
    out: dict[str, Any] = {}
    for shard, kind, names in _require("shard_index_walk")(path):  # an index in one is refused
        part = read(shard, kind)
        out.update((n, part[n]) for n in _require("shard_names")(path, shard, names, part))
    return out


def _load_kind(
    path: str, kind: str, dev: Any, dtype: Any, verify: bool, progress: bool | None,
    io: IOHandle, mapped: _Readahead | None = None, placement: _Placement | None = None,
) -> Any:
    """The load of `path`, a file of `kind` (``_sniff``'s); an index's shards each through
    their format's module."""
    if kind == "index":
        return _each_shard(path, lambda shard, k: _load_kind(
            shard, k, dev, dtype, verify, progress, io, mapped, placement))
    if kind == "safetensors":
        return _load_safetensors(path, dev, dtype, verify, progress, io, mapped, placement)
    return _load_torch(path, dev, dtype, verify, progress, io, mapped, placement)
