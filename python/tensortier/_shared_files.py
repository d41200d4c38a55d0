"""A shared tensor's rows to and from files, through the engine: the pieces of raw row files or
of a checkpoint's tensor that hold one rank's rows, read in parallel (O_DIRECT where the
filesystem allows), and one rank's rows written to its part file. Internal to tensortier.shared,
whose collective calls run these as each rank's part."""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from . import _core
from ._paths import fspath, PathArg


def _missing_key(path: str, key: str, keys: Sequence[str]) -> str:
    """The KeyError message for a checkpoint without `key`: the keys it has (the first ones)."""
    shown = ", ".join(repr(k) for k in keys[:20])
    if len(keys) > 20:
        shown += f", ... ({len(keys)} in all)"
    return f"{path} has no tensor {key!r}; its tensors are: {shown or 'none'}"


def bytes_of(local: torch.Tensor) -> torch.Tensor:
    """`local` (a rank's rows, contiguous) as its bytes."""
    return local.reshape(-1).view(torch.uint8) if local.numel() else torch.empty(0, dtype=torch.uint8)


def read_rows(
    sources: list[tuple[str, int, int]],
    what: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    local: Callable[[], tuple[torch.Tensor, tuple[int, int]]],
) -> dict[str, Any]:
    """Reads a rank's rows from `sources`, ``(path, offset, length)`` pieces whose concatenation
    is the whole tensor (of `shape` and `dtype`), through the engine (O_DIRECT, parallel), into
    the rows `local` returns with their range ``(begin, end)``. Returns the engine's stats for
    these reads.

    Raises:
        ValueError: the sources do not hold exactly the tensor's bytes.
        OSError: a file cannot be read, or holds fewer bytes than it did.
    """
    from .io import IOHandle

    row_bytes = torch.empty((), dtype=dtype).element_size() * math.prod(shape[1:])
    total = sum(length for _, _, length in sources)
    if total != shape[0] * row_bytes:
        raise ValueError(
            f"{what}: the sources hold {total} bytes; a tensor of shape {shape} and "
            f"dtype {dtype} needs {shape[0] * row_bytes}"
        )
    rows, (begin, end) = local()
    want_lo, want_hi = begin * row_bytes, end * row_bytes
    dest = bytes_of(rows)
    pieces = []
    at = 0
    for path, offset, length in sources:
        lo, hi = max(at, want_lo), min(at + length, want_hi)
        if lo < hi:
            pieces.append((dest[lo - want_lo : hi - want_lo], path, offset + lo - at))
        at += length
    stats: dict[str, Any] = {}
    if pieces:
        with IOHandle() as io:
            result = io.pread_batch_async(pieces).result()
        if result.bytes != want_hi - want_lo:
            raise OSError(f"{what}: read {result.bytes} of {want_hi - want_lo} bytes (a file shrank?)")
        stats = dict(result.stats)
    return stats


def checkpoint_source(
    path: PathArg, key: str, shape: tuple[int, ...], dtype: torch.dtype
) -> list[tuple[str, int, int]]:
    """Where tensor `key` of checkpoint `path` (safetensors, or ``torch.save`` found without
    running its pickle) lies, as the one ``(path, offset, length)`` source :func:`read_rows`
    takes, once it is known to be of `shape` and `dtype`.

    Raises:
        TypeError: a `key` that is not a str.
        KeyError: no tensor `key` in the file (the message lists the keys there are).
        ValueError: another shape or dtype, a shard index, or a file that is no checkpoint.
        OSError: the file cannot be read.
    """
    if not isinstance(key, str):
        raise TypeError(f"key must be a str, not {type(key).__name__}")
    from .checkpoint._format import _sniff
    from .checkpoint.safetensors import _read_st_header

    path = fspath(path)
    kind = _sniff(path)  # the C++ detection tensortier.load and the CLI use
    if kind == "index":
        raise ValueError(
            f"{path}: a shard index, not a checkpoint file: pass the shard holding {key!r}"
        )
    if kind == "torch":
        found, keys = _core.locate_torch_tensor(path, key)
        if found is None:
            raise KeyError(_missing_key(path, key, keys))
        dtype_name, stored_shape, offset, nbytes = found
        stored_dtype = getattr(torch, dtype_name, None)
    else:
        entries, _ = _read_st_header(path)
        entry = next((e for e in entries if e.name == key), None)
        if entry is None:
            raise KeyError(_missing_key(path, key, [e.name for e in entries]))
        stored_dtype, stored_shape = entry.dtype, entry.shape
        offset, nbytes = entry.offset, entry.nbytes
        dtype_name = str(stored_dtype).removeprefix("torch.")
    if tuple(stored_shape) != shape or stored_dtype != dtype:
        raise ValueError(
            f"{path}: {key!r} is {dtype_name} of shape {tuple(stored_shape)}; this shared "
            f"tensor is {str(dtype).removeprefix('torch.')} of shape {shape}"
        )
    return [(path, offset, nbytes)]


def write_rows(
    prefix: PathArg,
    rank: int,
    world: int,
    local: Callable[[], tuple[torch.Tensor, tuple[int, int]]],
) -> list[str]:
    """Writes rank `rank`'s rows, which `local` returns, to ``{prefix}_part_{rank}_of_{world}``
    (replacing it) through the engine, synced; returns every rank's file name in rank order.

    Raises:
        OSError: the file cannot be written.
    """
    from .io import IOHandle

    names = [f"{fspath(prefix, 'prefix')}_part_{r}_of_{world}" for r in range(world)]
    data = bytes_of(local()[0])
    with IOHandle() as io:
        f = io.open(names[rank], "w")
        try:
            if data.numel():
                io.pwrite(data, f, 0)
            f.datasync()
        finally:
            f.close()
    return names
