"""Checkpoints: save and load whole state dicts as safetensors or ``torch.save`` files.

::

    tensortier.save(model.state_dict(), "model.safetensors")         # or "ckpt.pt" / format="torch"
    sd = tensortier.load("model.safetensors")                        # also .pt and HF index.json
    tensortier.load_into(model, "model.safetensors")                 # into the existing tensors

Files are written in formats the ecosystem already reads:

- **safetensors**: a valid file for the ``safetensors`` package, whose header is padded with spaces
  so that the data starts on a 4 KiB boundary. Tensors whose size is a multiple of 4 KiB come
  first, so they start on 4 KiB boundaries as well (the format allows no gaps between tensors).
- **torch**: a ``torch.load(path, weights_only=True)`` file. torch's own pickler writes the
  metadata (``torch.serialization.skip_data`` with a storage alignment of 4096), then the engine
  writes the storage bytes at their record offsets.

Tensor bytes always move through the I/O engine (O_DIRECT where the filesystem allows it, large
transfers split over its workers, with the GIL released), never through Python file objects.

Writes are durable: the file is written under a temporary name in the same directory
(``.<name>.tmp-<pid>-<start time>-<tag>-<random>``), flushed with ``fdatasync``, renamed over the
final name and the directory is fsynced. On any error the temporary file is removed and an
existing file under the final name is left untouched; the temporary files of saves into the same
path that were killed (their process no longer runs) are removed by the next save. The replaced
file's mode, owner and group are kept; a file the caller may not write is not replaced (as
``torch.save`` refuses it). These rules live in C++ (include/tensortier/checkpoint_file.hpp),
shared with the ``tensortier`` CLI.

Checksums (``save(..., checksum=True)``, checked by ``load(..., verify=True)``):

- safetensors: the xxHash64 of each tensor's bytes, in the header's ``__metadata__`` under
  ``tensortier.xxh64`` as a JSON object string ``{name: "<16 hex digits>"}`` (what
  ``tensortier verify`` reads).
- torch: the zip format's own CRC-32 of each storage record. Like ``torch.save``, ``save``
  writes these always (so ``unzip -t`` and Python's ``zipfile`` accept the file), unless
  ``torch.serialization.set_crc32_options(False)`` turned them off, which ``checksum=True``
  overrides. ``verify=True`` also checks plain ``torch.save`` files.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import functools
import json
import os
import pickle
import re
import shutil
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, NamedTuple, TypeVar

from . import _core
from .io import File, IOFuture, IOHandle

# torch is imported inside the functions (see _torch()): `import tensortier` must not need it.
__all__ = ["IncompatibleKeys", "StateDictMismatchError", "load", "load_into", "save"]

PathLike = str | os.PathLike[str]
_T = TypeVar("_T")

ALIGNMENT = 4096
CHECKSUM_KEY = "tensortier.xxh64"
# The xxh64 of what the header says (names, dtypes, shapes, offsets, other metadata): see
# SafetensorsHeaderDigest in include/tensortier/safetensors.hpp.
HEADER_CHECKSUM_KEY = "tensortier.header_xxh64"
_INDEX_SUFFIX = ".index.json"

# Reads are submitted in groups of about this many bytes: progress, checksums and device copies
# of one group overlap the reads of the next ones (the engine bounds what is really in flight).
_GROUP_BYTES = 64 << 20
# Copies made to write non-contiguous or GPU tensors: at most this many bytes are alive at once.
_STAGING_BYTES = 256 << 20
# Loaded tensors at least this large are placed at their file offset modulo the page size (read
# O_DIRECT with no bounce copy the alignment rules would force); smaller ones are torch.empty.
_ALIGNED_ALLOC_MIN = 1 << 20
# The progress bar shows for loads of at least this many bytes when stderr is a terminal.
_PROGRESS_MIN_BYTES = 512 << 20

@functools.lru_cache(maxsize=None)
def _st_per_torch_element() -> dict[str, int]:
    """safetensors dtype -> values one torch element packs, where more than one: safetensors
    counts F4 values (4 bits each) where torch's float4_e2m1fn_x2 counts bytes of two, so the
    last dimension of a safetensors shape is this many times torch's."""
    return {st: int(per) for st, _, per in _require("safetensors_dtypes_for_torch")() if per != 1}


def _torch_shape(name: str, dt: str, shape: Sequence[int], path: str) -> tuple[int, ...]:
    """The torch shape of a safetensors tensor of dtype `dt` and `shape`."""
    per = _st_per_torch_element().get(dt, 1)
    if per == 1:
        return tuple(int(s) for s in shape)
    if not shape or shape[-1] % per:
        raise ValueError(
            f"{path}: tensor {name!r} of {dt} has shape {tuple(shape)}: its last dimension must "
            f"be a multiple of {per} to be held as torch's packed dtype"
        )
    return (*(int(s) for s in shape[:-1]), int(shape[-1]) // per)


def _st_shape(name: str, dt: str, shape: Sequence[int]) -> tuple[int, ...]:
    """The safetensors shape of a torch tensor of `shape` saved as `dt`."""
    per = _st_per_torch_element().get(dt, 1)
    if per == 1:
        return tuple(int(s) for s in shape)
    if not shape:
        raise ValueError(f"tensor {name!r}: a 0-dimensional {dt} tensor has no safetensors shape")
    return (*(int(s) for s in shape[:-1]), int(shape[-1]) * per)


class IncompatibleKeys(NamedTuple):
    """What :func:`load_into` could not match (like ``torch.nn.Module.load_state_dict``)."""

    missing_keys: list[str]
    unexpected_keys: list[str]


class StateDictMismatchError(RuntimeError, ValueError):
    """:func:`load_into` found names or shapes that do not match the target. A ``RuntimeError``
    worded as ``torch.nn.Module.load_state_dict``'s (``Error(s) in loading state_dict for
    ...``), so code written for it keeps working; also a ``ValueError``, as before."""


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def save(
    state_dict: Mapping[str, Any],
    path: PathLike | BinaryIO,
    format: str | None = None,
    metadata: Mapping[str, str] | None = None,
    checksum: bool = False,
    *,
    _io: IOHandle | None = None,
) -> None:
    """Save `state_dict` to `path`, durably (temporary file, fdatasync, rename, directory fsync).

    Args:
        state_dict: name -> tensor (CPU or GPU; non-contiguous tensors are saved contiguous).
            With ``format="torch"`` any object ``torch.save`` accepts and ``torch.load(...,
            weights_only=True)`` reads back (nested dicts/lists, ints, strings...). Objects
            holding quantized or nested tensors, which torch cannot pickle without their data,
            are written by ``torch.save`` itself (as durably, at its speed).
        path: the file to write; its directory must exist. An existing file is replaced only
            once the new one is complete and synced, keeping its mode, owner and group (the
            owner where the caller may set it: root); one the caller may not write is not
            replaced (``PermissionError``, as from ``torch.save``). Or a writable binary
            file object (``io.BytesIO``, an open file), as ``torch.save`` takes: the checkpoint
            is written to a temporary file first, then copied to it from its current position.
        format: ``"safetensors"`` or ``"torch"``; by default from the suffix (``.safetensors``
            -> safetensors, ``.pt``/``.pth``/``.bin``/``.ckpt`` -> torch; for a file object,
            torch, as ``torch.save`` writes).
        metadata: safetensors only: text metadata stored in the header (``__metadata__``);
            ``{"format": "pt"}`` is added unless given (transformers expects it).
        checksum: store a checksum of every tensor (safetensors: xxHash64 in the metadata,
            plus one of the header's names, dtypes, shapes, offsets and metadata; torch: the zip
            CRC-32 of each storage and of the pickle, written by default as ``torch.save``
            does: ``checksum=True`` writes them even when
            ``torch.serialization.set_crc32_options(False)`` is in effect), checked by
            ``load(..., verify=True)`` and ``tensortier verify``.

    Raises:
        TypeError: a value the format cannot store (safetensors: only tensors of its dtypes).
        ValueError: bad arguments, or tensors sharing memory in a safetensors file (save them
            with ``format="torch"``, or ``.clone()`` the duplicates).
        OSError: the file cannot be written (nothing is left under the final name then); the
            message names `path` as given first, then what failed.
    """
    if _is_file_object(path, "write"):
        fmt = _save_format("stream.pt" if format is None else "", format)
        with tempfile.TemporaryDirectory(prefix="tensortier-save-") as tmp:
            staged = os.path.join(tmp, "checkpoint")
            save(state_dict, staged, fmt, metadata, checksum, _io=_io)
            with open(staged, "rb") as f:
                shutil.copyfileobj(f, path, _STREAM_CHUNK)  # type: ignore[misc]
        return
    fmt = _save_format(path, format)
    if metadata is not None:
        if fmt != "safetensors":
            raise ValueError(
                "metadata is stored in safetensors files only: use format='safetensors'"
            )
        if not isinstance(metadata, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise TypeError("metadata must be a mapping of str to str")
    if not isinstance(checksum, bool):
        raise TypeError(f"checksum must be a bool, not {type(checksum).__name__}")
    io = _io if _io is not None else _default_io()
    try:
        if fmt == "safetensors":
            _save_safetensors(state_dict, path, dict(metadata or {}), checksum, io)
        else:
            _save_torch(state_dict, path, checksum, io)
    except OSError as e:
        raise _save_error(e, os.fspath(path)) from e


def _save_error(e: OSError, given: str) -> OSError:
    """`e` naming the path the caller gave first: a failure on the hidden temporary file is one
    of saving `given`."""
    final = os.path.realpath(given)
    if e.filename in (given, final) and ".tmp-" not in str(e.strerror):
        return e  # about the file itself already (read-only, a directory...)
    detail = str(e.strerror) if e.strerror else str(e)
    if e.filename is not None and str(e.filename) not in detail:
        detail = f"{detail}: {e.filename!r}"
    if e.errno is None:
        return OSError(f"cannot save {given!r}: {detail}")
    return OSError(e.errno, f"cannot save {given!r}: {detail}")  # the errno's subclass


def load(
    path: PathLike | BinaryIO,
    device: Any = None,
    dtype: Any = None,
    verify: bool = False,
    *,
    map_location: Any = None,
    weights_only: bool | None = None,
    mmap: bool = False,
    progress: bool | None = None,
    _io: IOHandle | None = None,
) -> Any:
    """Load a checkpoint: a safetensors file, a zip-format ``torch.save`` file, or a Hugging Face
    shard index (``model.safetensors.index.json``, ``pytorch_model.bin.index.json``).

    Each tensor is allocated once, at its final place, and its bytes are read into it by the
    engine (never the whole file staged in memory; on disks that cut requests into scattered
    small pages, virtio ones, direct reads pass through the engine's reused huge-page buffers,
    see ``TENSORTIER_STAGE_READS``). Pickled metadata of torch files is read with
    torch's ``weights_only`` unpickler: no other pickle code ever runs.

    Args:
        path: the file (format found from its contents) or the ``.index.json`` of shards. Or
            a readable binary file object (``io.BytesIO``, an open file), as ``torch.load``
            takes: read from its current position to its end into anonymous memory (a
            ``memfd``), then loaded from there (with `mmap`, tensors map that memory).
        device: ``"cpu"`` (the default) or ``"cuda:N"``. For CUDA each tensor is allocated on the device and
            filled by the engine's GPU path (GPUDirect Storage where cuFile accepts the file,
            else a ring of pinned bounce buffers; disk reads and copies overlap), never staging
            the whole file in host memory. With ``verify`` each tensor is checked in a pinned
            host buffer on its way.
        dtype: convert floating-point tensors to this torch dtype (integer, bool and complex
            tensors keep theirs). Storage sharing between converted tensors is lost. Memory
            (GPU memory for a CUDA device) holds the converted tensors plus ~64 MiB of
            originals for safetensors files (read and converted a group at a time), plus one
            original tensor for torch files (read whole, converted a tensor at a time).
        verify: check the stored checksums (see :func:`save`); a file without checksums is an
            error then.
        mmap: return CPU tensors that map the file (copy-on-write, as
            ``safetensors.torch.load_file`` and ``torch.load(mmap=True)`` do) instead of
            reading it into memory of their own. Pages come from the page cache, read from the
            disk as tensors touch them; readahead of all the tensors' bytes is queued when they
            fit in half the available memory (one budget for all shards of an index).
            Processes that map one file share its cached pages; writes to the tensors stay
            private. Only for ``device="cpu"``. The call reads no tensor bytes itself, except
            with `verify` (checks them now, as they are at load time), `dtype` (converted
            tensors are copies), big-endian torch files (swapped into private copies) and
            tensors whose offset is not a multiple of their element size (possible in other
            writers' files; copied). The file must not be truncated or rewritten in place
            while the tensors live: reading a page past its new end kills the process with
            SIGBUS. Replacing it by rename, as :func:`save` does, is safe.
        progress: show a progress bar on stderr; by default only for loads of 512 MiB or more
            when stderr is a terminal.
        map_location: ``torch.load``'s, instead of `device`: a string or ``torch.device``
            (every storage there), a dict of saved location -> location (``{"cuda:1":
            "cuda:0"}``; unmapped locations stay as saved), or a callable ``(storage,
            location) -> storage or None`` given each storage read on the CPU (None: as
            saved). Locations are those a ``.pt`` file records for its storages; safetensors
            files hold ``"cpu"`` ones. The one difference from ``torch.load``: without
            `map_location` (nor `device`) tensors load to the CPU, not where they were saved.
        weights_only: ``torch.load``'s: True and None (its default) load as always; False is
            refused, as tensortier never runs arbitrary pickled code (use ``torch.load`` for a
            trusted file that needs it).

    Returns:
        safetensors and index files: ``dict[str, Tensor]`` in the file's order. torch files:
        whatever was saved (shared storages stay shared).

    Raises:
        ValueError: not a checkpoint, a malformed or unsupported file (legacy torch format,
            compressed zip entries, pickled globals ``weights_only`` refuses...), a checksum
            mismatch (naming the tensor), or a bad argument (CUDA unavailable...).
        OSError: the file cannot be read, or is not a regular file (a FIFO is refused, never
            waited on).
    """
    torch = _torch()
    if weights_only is False:
        raise ValueError(
            "weights_only=False is not supported: tensortier loads pickles with torch's "
            "weights_only unpickler only and never runs arbitrary pickled code (a pickle can run "
            "any program); use torch.load(..., weights_only=False) for a file you trust"
        )
    if weights_only not in (True, None):
        raise TypeError(f"weights_only must be True or None, not {weights_only!r}")
    placement = None
    if map_location is not None:
        if device is not None:
            raise ValueError("give device or map_location, not both (they say the same thing)")
        if isinstance(map_location, (str, torch.device)):
            device = map_location
        elif isinstance(map_location, Mapping):
            placement = _Placement(mapping=dict(map_location))
        elif callable(map_location):
            placement = _Placement(restore=map_location)
        else:
            raise TypeError(
                "map_location must be a string, torch.device, dict or callable, not "
                f"{type(map_location).__name__}"
            )
        if placement is not None and mmap:
            raise ValueError(
                "mmap=True maps CPU tensors: use map_location='cpu' with it, not a "
                f"{type(map_location).__name__}"
            )
    dev = _target_device(device if device is not None else "cpu")
    target_dtype = _target_dtype(dtype)
    if not isinstance(mmap, bool):
        raise TypeError(f"mmap must be a bool, not {type(mmap).__name__}")
    if mmap and dev.type != "cpu":
        raise ValueError(
            f"mmap=True maps the file into host memory: it needs device='cpu', not {dev} "
            "(load to the GPU with mmap=False: its bytes go there without host copies)"
        )
    io = _io if _io is not None else _default_io()
    with contextlib.ExitStack() as stack:
        streamed = _is_file_object(path, "read")
        fspath = stack.enter_context(_memfd_copy(path)) if streamed else os.fspath(path)
        try:
            return _load_path(fspath, dev, target_dtype, verify, progress, io, mmap, placement,
                              streamed)
        except ValueError as e:
            if not streamed or fspath not in str(e):
                raise
            # errors name the file: the caller's object, not the memfd it was copied to
            name = getattr(path, "name", None)
            label = repr(name) if isinstance(name, str) else f"<{type(path).__name__}>"
            raise ValueError(str(e).replace(fspath, label)) from e


def _load_path(
    fspath: str, dev: Any, target_dtype: Any, verify: bool, progress: bool | None,
    io: IOHandle, mmap: bool, placement: _Placement | None, streamed: bool,
) -> Any:
    kind = _sniff(fspath)
    if kind == "index" and streamed:
        raise ValueError(
            "a shard index names its shards by path: load it by its path, not from a file object"
        )
    mapped = _Readahead() if mmap else None
    if kind == "index":
        return _load_index(fspath, dev, target_dtype, verify, progress, io, mapped, placement)
    if kind == "torch":
        return _load_torch(fspath, dev, target_dtype, verify, progress, io, mapped, placement)
    return _load_safetensors(
        fspath, dev, target_dtype, verify, progress, io, mapped=mapped, placement=placement
    )


def load_into(
    module_or_state_dict: Any,
    path: PathLike,
    strict: bool = True,
    verify: bool = False,
    *,
    progress: bool | None = None,
    _io: IOHandle | None = None,
) -> IncompatibleKeys:
    """Read a checkpoint straight into existing tensors. Allocates nothing for contiguous CPU
    targets of the file's dtype; contiguous CUDA targets are filled by the engine's GPU path
    (GPUDirect Storage or the pinned bounce ring). Non-contiguous targets, and targets of
    another dtype than the file's (converted as ``load_state_dict``'s ``copy_`` does), are read
    into temporaries ~64 MiB at a time (or one tensor, if larger), then copied.

    Args:
        module_or_state_dict: a ``torch.nn.Module`` (its ``state_dict()``: parameters and
            persistent buffers) or a mapping of name -> tensor.
        path: a safetensors file, a zip-format ``torch.save`` file holding a flat
            ``{name: tensor}`` dict, or a shard index.
        strict: like ``load_state_dict``: names missing from the file or not in the target are
            an error. A missing name whose tensor shares its memory with a loaded one (tied
            weights that safetensors files store once) is not missing.
        verify: check the stored checksums of what is read.

    Returns:
        ``IncompatibleKeys(missing_keys, unexpected_keys)`` (both empty when strict).

    Raises:
        StateDictMismatchError: a ``RuntimeError`` (and ``ValueError``) worded as
            ``load_state_dict``'s: missing/unexpected names (strict), shape mismatches (even
            when not strict, as there), all listed, naming the file on its last line.
        ValueError: meta-device targets, a malformed file, a checksum mismatch.
        OSError: the file cannot be read.
        TypeError: the target is neither a module nor a mapping of tensors.

    Names and shapes are all checked before any byte is read. An error during the read
    itself (I/O error, checksum mismatch, interrupt) leaves the targets partly overwritten, as
    ``load_state_dict`` would after a failed ``copy_``: load again, or load into copies, when
    the old values must survive a failure.
    """
    torch = _torch()
    if isinstance(module_or_state_dict, torch.nn.Module):
        targets = dict(module_or_state_dict.state_dict())
    elif isinstance(module_or_state_dict, Mapping):
        targets = dict(module_or_state_dict)
    else:
        raise TypeError(
            f"load_into needs a torch.nn.Module or a mapping of tensors, not "
            f"{type(module_or_state_dict).__name__}"
        )
    meta = []
    for name, t in targets.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"target {name!r} is {_a(type(t).__name__)}, not a tensor")
        if t.is_meta:
            meta.append(name)
    if meta:
        # Meta tensors have no memory to read into (and all share data_ptr 0, which would make
        # them look tied to each other): materialise them first, e.g. module.to_empty(device=).
        raise ValueError(
            f"load_into: {len(meta)} target(s) on the meta device, e.g. {meta[:4]}: give them "
            "memory first (module.to_empty(device='cpu'))"
        )
    io = _io if _io is not None else _default_io()
    fspath = os.fspath(path)
    files: dict[str, File] = {}  # opened once: what is parsed is what is read
    try:
        sources = _describe_sources(fspath, io, files, verify)  # name -> _Source
        return _load_into(targets, sources, strict, verify, progress, io, fspath, files,
                          type(module_or_state_dict).__name__)
    finally:
        for f in files.values():
            f.close()


# --------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------

# File objects are copied to and from temporary files this many bytes at a time.
_STREAM_CHUNK = 8 << 20


def _is_file_object(obj: Any, method: str) -> bool:
    """A file object given where a path may be (as torch.save/torch.load take them)."""
    return not isinstance(obj, (str, bytes, os.PathLike)) and callable(getattr(obj, method, None))


@contextlib.contextmanager
def _memfd_copy(stream: Any) -> Iterator[str]:
    """`stream` from its position to its end in anonymous memory, as a path the engine opens."""
    fd = os.memfd_create("tensortier-load", os.MFD_CLOEXEC)
    try:
        with open(fd, "wb", closefd=False) as out:
            shutil.copyfileobj(stream, out, _STREAM_CHUNK)
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)



def _torch() -> Any:
    try:
        import torch
    except ImportError as e:  # pragma: no cover - torch is a dependency of this module
        raise ImportError("tensortier checkpoints need PyTorch: pip install torch") from e
    return torch


_default_lock = threading.Lock()
_default: tuple[int, IOHandle] | None = None


def _default_io() -> IOHandle:
    """One engine per process, made on first use (again after a fork: threads do not survive)."""
    global _default
    with _default_lock:
        if _default is None or _default[0] != os.getpid():
            _default = (os.getpid(), IOHandle())
        return _default[1]


def _require(name: str) -> Callable[..., Any]:
    fn = getattr(_core, name, None)
    if fn is None:
        raise ImportError(
            f"tensortier._core has no {name}(): the C++ extension is older than this Python "
            "package; reinstall tensortier"
        )
    return fn


def _save_format(path: PathLike, format: str | None) -> str:
    if format is not None:
        if format not in ("safetensors", "torch"):
            raise ValueError(f"format must be 'safetensors' or 'torch', not {format!r}")
        return format
    named = _require("format_of_suffix")(os.fspath(path))
    if named is not None:
        return str(named)
    raise ValueError(
        f"cannot tell the format from the name {os.fspath(path)!r}: use a .safetensors or .pt "
        "suffix, or pass format='safetensors' or format='torch'"
    )


def _target_device(device: Any) -> Any:
    torch = _torch()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is not a device: {e}") from e
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(f"device {str(dev)!r} is not supported: use 'cpu' or 'cuda:N'")
    if not torch.cuda.is_available():
        raise ValueError(
            f"device {str(dev)!r} was asked for but CUDA is not available "
            "(torch.cuda.is_available() is False): load with device='cpu'"
        )
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise ValueError(f"device {str(dev)!r}: there are only {torch.cuda.device_count()} GPUs")
    return torch.device("cuda", index)


def _target_dtype(dtype: Any) -> Any:
    if dtype is None:
        return None
    torch = _torch()
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, not {type(dtype).__name__}")
    if not dtype.is_floating_point:
        # Only floating-point tensors are converted: any other dtype would be a silent no-op.
        raise ValueError(
            f"dtype={dtype}: load converts floating-point tensors to a floating-point dtype "
            "(torch.bfloat16, torch.float16...); convert to other dtypes after loading"
        )
    return dtype


def _convert(t: Any, dtype: Any) -> Any:
    """`t` in `dtype` when both are floating point; otherwise `t` unchanged. A Parameter stays
    a Parameter and a tensor that requires grad stays a leaf that does (as loading it in
    `dtype` would give; not a result of `.to` with autograd history)."""
    if dtype is None or t.dtype == dtype:
        return t
    if not t.is_floating_point() or not dtype.is_floating_point:
        return t
    torch = _torch()
    with torch.no_grad():
        out = t.to(dtype)
    if isinstance(t, torch.nn.Parameter):
        out = torch.nn.Parameter(out, requires_grad=t.requires_grad)
    else:
        out.requires_grad_(t.requires_grad)
    if getattr(t, "__dict__", None):  # Python attributes a file gave it, as torch.load keeps
        out.__dict__.update(t.__dict__)
    return out


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size()


def _st_dtype_maps() -> tuple[dict[Any, str], dict[str, Any]]:
    torch = _torch()
    to_st: dict[Any, str] = {}
    from_st: dict[str, Any] = {}
    for st, attr, _ in _require("safetensors_dtypes_for_torch")():
        dt = getattr(torch, attr, None)
        if dt is not None:
            to_st[dt] = st
            from_st[st] = dt
    return to_st, from_st


def _host_alloc(numel: int, dtype: Any, misalign: int = 0) -> Any:
    """An uninitialised flat CPU tensor with a storage of its own. Large ones start `misalign`
    bytes past a page boundary, so that address and file offset agree modulo the page size:
    the engine then reads them O_DIRECT with no bounce copy the alignment rules would force.

    The memory comes from torch's CPU allocator, as any tensor's. With glibc, tensors up to its
    mmap threshold (at most 32 MiB) reuse heap memory the process freed, already faulted in (a
    warm reload of 2 GiB in 300 tensors ran 3.7 -> 15 GB/s on the benchmark VM); larger ones
    are fresh mappings either way. Where transparent huge pages are "madvise" (the common
    default) the memory has small pages, the faster first touch on VMs that report free memory
    to their host (BENCHMARKS.md)."""
    torch = _torch()
    nbytes = numel * dtype.itemsize
    if nbytes < _ALIGNED_ALLOC_MIN:
        return torch.empty(numel, dtype=dtype)
    if misalign % dtype.itemsize:
        misalign = 0  # keep elements naturally aligned; the engine bounces this one
    base = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8)  # skip < ALIGNMENT
    skip = (misalign - base.data_ptr()) % ALIGNMENT
    # A storage of exactly these bytes (torch files share storages between views, by byte
    # offsets into them). torch.frombuffer keeps `window` alive, and `window` keeps `base`.
    window = (ctypes.c_char * nbytes).from_address(base.data_ptr() + skip)
    window.owner = base  # type: ignore[attr-defined]
    return torch.frombuffer(window, dtype=torch.uint8).view(dtype)


class _Readahead:
    """What loads with ``mmap=True`` may still ask the kernel to read ahead: half the memory
    available when the load began. The shards of one index share it, so that reading ahead for
    a model larger than memory does not evict earlier shards' pages before they are touched."""

    def __init__(self) -> None:
        self.left = _available_memory() // 2

    def take(self, nbytes: int) -> bool:
        if nbytes > self.left:
            return False
        self.left -= nbytes
        return True


def _map_file(
    file: File, path: str, ranges: Sequence[tuple[str, int, int]], readahead: _Readahead
) -> Any:
    """The whole file `file` has open, mapped copy-on-write, as a CPU UntypedStorage that keeps
    the mapping alive (it is unmapped when the last tensor on it is gone; no descriptor stays
    open). `ranges` are the (name, offset, length) the caller will use: each must lie inside the
    file as mapped, since touching a mapped page past the end of a file is SIGBUS, not an
    error. Starts readahead of the bytes they span when `readahead` allows."""
    torch = _torch()
    fd = file.fileno()
    size = os.fstat(fd).st_size
    for name, offset, length in ranges:
        if offset < 0 or length < 0:
            raise ValueError(f"{path}: {name!r} has offset {offset} and length {length}")
        if offset + length > size:
            raise ValueError(
                f"{path}: file ended early: {name!r} needs {length} bytes at offset {offset}, "
                f"the file has {size} (truncated file?)"
            )
    # Map the file the descriptor has open (`path` may name another one by now). torch maps it
    # MAP_PRIVATE and closes its descriptor; Python's mmap would keep a duplicate open per file.
    proc = f"/proc/self/fd/{fd}"
    try:
        whole = torch.UntypedStorage.from_file(
            proc if os.path.exists(proc) else path, shared=False, nbytes=size
        )
    except RuntimeError as e:  # "unable to mmap N bytes from file <name>: <strerror> (<errno>)"
        found = re.search(r"\((\d+)\)\s*$", str(e))
        raise OSError(
            int(found.group(1)) if found else errno.EIO,
            f"cannot map the checkpoint ({str(e).replace(proc, path)}): load it with mmap=False",
            path,
        ) from None
    used = [(offset, length) for _, offset, length in ranges if length]
    if used:
        start = min(o for o, _ in used)
        end = max(o + n for o, n in used)
        if readahead.take(end - start):
            try:
                # Queues large reads of the whole span and returns: on the benchmark VM a cold
                # load that touches every page of 2 GiB ran 1.6 -> 2.6 GB/s with it.
                os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass  # only a hint: pages still come in as they are touched
    return whole


def _available_memory() -> int:
    """MemAvailable from /proc/meminfo, in bytes (0 when unknown)."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _empty_fixed_storage() -> Any:
    """A storage of 0 bytes that cannot be resized (a tensor set_ past its end is refused, as
    torch.load refuses it, instead of growing it)."""
    torch = _torch()
    return torch.frombuffer(bytearray(1), dtype=torch.uint8).untyped_storage()[0:0]


def _fixed_size(flat: Any) -> Any:
    """`flat`'s bytes (a uint8 CPU tensor) in a storage that cannot be resized; keeps `flat`
    alive."""
    torch = _torch()
    window = (ctypes.c_char * flat.numel()).from_address(flat.data_ptr())
    window.owner = flat  # type: ignore[attr-defined]
    return torch.frombuffer(window, dtype=torch.uint8)


def _mapped_tensor(
    whole: Any, offset: int, nbytes: int, dtype: Any, shape: Sequence[int]
) -> Any:
    """A tensor of `shape` over bytes [offset, offset + nbytes) of the mapped file `whole`, in a
    storage of exactly those bytes (so that saving it, or checking it for shared memory as
    safetensors does, sees only its own bytes). A copy where `offset` is not a multiple of the
    element size: torch expects elements at their natural alignment."""
    torch = _torch()
    if nbytes == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    window = whole[offset : offset + nbytes]
    if offset % dtype.itemsize:
        flat = _host_alloc(nbytes // dtype.itemsize, dtype)
        _as_bytes(flat).copy_(_storage_bytes(window))
        return flat.view(tuple(shape))
    return torch.empty(0, dtype=dtype).set_(window, 0, tuple(shape))


def _as_bytes(t: Any) -> Any:
    """A flat uint8 view of a contiguous tensor's bytes."""
    torch = _torch()
    flat = t.reshape(-1)
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=flat.device)
    return flat.view(torch.uint8)


def _storage_bytes(storage: Any) -> Any:
    """A flat uint8 tensor over a whole UntypedStorage."""
    torch = _torch()
    t = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return t.set_(storage, 0, (storage.nbytes(),), (1,))


def _xxh64(t: Any) -> int:
    """xxHash64 of a contiguous CPU tensor's bytes (GIL released in C++ for large ones)."""
    n = _nbytes(t)
    if n == 0:
        return int(_require("xxh64")(b""))
    return int(_require("xxh64_address")(t.data_ptr(), n))


def _crc32(t: Any, value: int = 0) -> int:
    """zlib.crc32 of a contiguous CPU tensor's bytes (carry-less multiply folding in C++, GIL
    released: ~4x zlib's own)."""
    n = _nbytes(t)
    if n == 0:
        return value
    return int(_require("crc32_address")(t.data_ptr(), n, value))


class _DurableFile:
    """A save's new file (``_core.DurableFile``: temporary name next to `path`, fdatasync,
    rename, directory fsync, background release of the replaced file, every system call
    through `io`'s fault seam); ``commit()`` makes it the file at `path`, ``abort()`` (or an
    exception in the ``with`` body) removes it."""

    # False: the rename frees the replaced file, as before (bench/save_replace_cost.py's switch).
    _free_in_background = True

    def __init__(self, path: PathLike, io: IOHandle) -> None:
        self._core = _core.DurableFile(
            os.fspath(path), io._direct, io._file_system,  # noqa: SLF001 - same package
            self._free_in_background,
        )
        self.final: str = self._core.path
        self.tmp: str = self._core.temporary_path
        self.file: Any = None

    def open(self) -> Any:
        """The engine's handle on the temporary file (O_DIRECT where possible)."""
        if self.file is None:
            self.file = self._core.file
        return self.file

    def reserve(self, size: int) -> None:
        """Allocate `size` bytes up front: ENOSPC now rather than mid-write, contiguous extents."""
        self._core.reserve(size)

    def commit(self) -> None:
        self._close()
        self._core.commit()

    def abort(self) -> None:
        self._close()
        self._core.abort()

    def _close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None

    def __enter__(self) -> "_DurableFile":
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is not None or not self._core.committed:
            self.abort()


def _open_checkpoint(io: IOHandle, path: str) -> File:
    """`path` opened for the engine's reads through `io`'s fault seam (a FIFO or a device is
    refused, never waited on)."""
    return io._file_system.open(path, io._direct)  # noqa: SLF001 - same package


def _read_at(file: File, size: int, offset: int, io: IOHandle | None = None) -> bytes:
    """`size` bytes of `file` from `offset` (fewer at its end), read by the engine: faults can
    be injected there and its errors name the file."""
    if size == 0:
        return b""
    buf = bytearray(size)
    got = (io if io is not None else _default_io()).pread(buf, file, offset)
    return bytes(memoryview(buf)[:got])


def _wait_for_replaced_files() -> None:
    """Wait until the files earlier saves replaced are freed."""
    _core.wait_for_replaced_files()


class _Writer:
    """Writes (tensor, file offset) pieces with the engine in groups of ~64 MiB submitted
    together, keeping at most `_STAGING_BYTES` of staged copies (of non-contiguous or GPU
    tensors) alive. ``finish()`` waits for everything and raises the first error."""

    def __init__(self, io: IOHandle, file: Any) -> None:
        self._io = io
        self._file = file
        self._group: list[tuple[Any, Any, int]] = []
        self._group_bytes = 0
        self._group_staged = 0
        self._inflight: collections.deque[tuple[IOFuture, int]] = collections.deque()
        self._inflight_staged = 0

    def add(self, data: Any, offset: int, staged: bool) -> None:
        """Queue the bytes of `data` (a contiguous CPU tensor or a buffer) for `offset`;
        `staged`: `data` is a copy made for this write (its memory counts against the bound)."""
        n = _nbytes(data) if hasattr(data, "element_size") else len(data)
        if n == 0:
            return
        self._group.append((data, self._file, offset))
        self._group_bytes += n
        if staged:
            self._group_staged += n
        if self._group_bytes >= _GROUP_BYTES or self._group_staged >= _STAGING_BYTES // 2:
            self._flush()
        while self._inflight_staged > _STAGING_BYTES and self._inflight:
            self._wait_oldest()

    def _flush(self) -> None:
        if self._group:
            fut = self._io.pwrite_batch_async(self._group)
            self._inflight.append((fut, self._group_staged))
            self._inflight_staged += self._group_staged
            self._group, self._group_bytes, self._group_staged = [], 0, 0

    def _wait_oldest(self) -> None:
        fut, staged = self._inflight.popleft()
        self._inflight_staged -= staged
        fut.wait()

    def finish(self) -> None:
        self._flush()
        first: BaseException | None = None
        while self._inflight:
            try:
                self._wait_oldest()
            except OSError as e:
                first = first or e
        if first is not None:
            raise first

    def drain(self) -> None:
        """Wait for everything in flight, ignoring errors (the caller is already failing)."""
        self._group = []
        while self._inflight:
            try:
                self._wait_oldest()
            except OSError:
                pass


def _host_contiguous(t: Any) -> tuple[Any, bool]:
    """`t`'s values in a contiguous CPU tensor, and whether that needed a copy (a conjugate or
    negative view's storage holds other numbers than its values: resolved into a copy)."""
    if t.is_conj() or t.is_neg():
        return t.detach().to("cpu").resolve_conj().resolve_neg().contiguous(), True
    if t.device.type == "cpu" and t.is_contiguous():
        return t, False
    return t.detach().to("cpu").contiguous(), True


# --------------------------------------------------------------------------------------------
# Progress
# --------------------------------------------------------------------------------------------


class _Progress:
    """A one-line progress bar on stderr, redrawn at most ten times a second."""

    def __init__(self, label: str, total: int, enabled: bool | None) -> None:
        if enabled is None:
            enabled = total >= _PROGRESS_MIN_BYTES and _stderr_is_tty()
        self.enabled = bool(enabled) and total > 0
        self.label = label
        self.total = total
        self.done = 0
        self.start = time.perf_counter()
        self.last = 0.0
        self.drawn = -1  # `done` at the last draw

    def update(self, n: int) -> None:
        self.done += n
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self.last >= 0.1 or self.done >= self.total:
            self.last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        self.drawn = self.done
        frac = self.done / self.total if self.total else 1.0
        width = 30
        bar = "#" * int(frac * width)
        rate = self.done / max(now - self.start, 1e-9) / 1e9
        sys.stderr.write(
            f"\r{self.label} [{bar:<{width}}] {frac * 100:5.1f}% "
            f"{self.done / 2**30:.2f}/{self.total / 2**30:.2f} GiB {rate:.2f} GB/s"
        )
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            if self.drawn != self.done:  # the final state is drawn once
                self._draw(time.perf_counter())
            sys.stderr.write("\n")
            sys.stderr.flush()


def _stderr_is_tty() -> bool:
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


# --------------------------------------------------------------------------------------------
# Reading: a plan of (destination, file offset) pieces executed with the engine
# --------------------------------------------------------------------------------------------


@dataclass
class _Piece:
    """Read `nbytes` at `offset` of `file` into `dest` (a tensor of exactly those bytes), then
    call `done(dest_host_bytes)` (checksums)."""

    name: str
    file: Any
    offset: int
    nbytes: int
    dest: Any
    check: Callable[[Any], None] | None = None


def _read_pieces(
    io: IOHandle, pieces: Sequence[_Piece], progress: _Progress, path: str,
    close_progress: bool = True,
) -> None:
    """Read every piece into its destination, in groups of ~64 MiB submitted together and
    checked as they complete. CPU destinations are read in place; CUDA ones through the
    engine's GPU path (pinned bounce ring or GPUDirect Storage, copies on the current stream),
    except those with a checksum to check, which come through a pinned host buffer."""
    batched = [p for p in pieces if p.dest.device.type == "cpu" or p.check is None]
    checked_device = [p for p in pieces if p.dest.device.type != "cpu" and p.check is not None]
    try:
        if batched:
            _read_batched(io, batched, progress, path)
        if checked_device:
            _read_device_checked(io, checked_device, progress, path)
    finally:
        if close_progress:
            progress.close()


def _groups(pieces: Sequence[_T]) -> Iterator[list[_T]]:
    """`pieces` (anything with ``nbytes``) in runs of about _GROUP_BYTES (one piece when
    larger)."""
    group: list[_T] = []
    size = 0
    for p in pieces:
        group.append(p)
        size += p.nbytes
        if size >= _GROUP_BYTES:
            yield group
            group, size = [], 0
    if group:
        yield group


def _short_read(path: str, piece: _Piece, got: int) -> ValueError:
    return ValueError(
        f"{path}: file ended early: tensor {piece.name!r} needs {piece.nbytes} bytes at offset "
        f"{piece.offset}, got {got} (truncated file?)"
    )


def _read_batched(
    io: IOHandle, pieces: Sequence[_Piece], progress: _Progress, path: str
) -> None:
    submitted: list[tuple[list[_Piece], IOFuture]] = []
    try:
        for group in _groups(pieces):
            batch = [(_as_bytes(p.dest), p.file, p.offset) for p in group if p.nbytes]
            if batch:
                # Tensors from torch's allocator (new ones, or load_into's targets) are small
                # pages, which some disks read slowly: see IOHandle(stage_reads=...).
                submitted.append((group, io.pread_batch_async(batch, stage_reads=True)))
            else:
                submitted.append((group, None))  # type: ignore[arg-type]
        for group, fut in submitted:
            if fut is not None:
                result = fut.result()
                got = iter(result.segment_bytes)
                for p in group:
                    if p.nbytes:
                        n = next(got)
                        if n != p.nbytes:
                            raise _short_read(path, p, n)
            for p in group:
                if p.check is not None:
                    p.check(p.dest)
                progress.update(p.nbytes)
    finally:
        for _, fut in submitted:  # memory handed to the engine must outlive the reads
            if fut is not None:
                try:
                    fut.wait()
                except (OSError, RuntimeError):  # CUDA failures are RuntimeErrors (CudaError)
                    pass


def _pinned_buffer(size: int) -> Any:
    """`size` bytes of tensortier's pinned host memory (exactly that size, unmapped when the
    tensor goes), as a uint8 tensor."""
    from .device import pinned_empty

    return pinned_empty(size)


def _read_device_checked(
    io: IOHandle, pieces: Sequence[_Piece], progress: _Progress, path: str
) -> None:
    """Fill CUDA destinations whose bytes must be checksummed on the host (verify=True):
    each piece is read whole into one of two reused pinned buffers, checked, then copied to
    its device (on a stream of that device's own) while the next piece is read. The buffers are
    tensortier's pinned memory of the exact size, unmapped when this returns (torch's pinned
    allocator would round each up to a power of two and keep it cached for the process)."""
    torch = _torch()
    size = max(p.nbytes for p in pieces) + ALIGNMENT
    buffers = [_pinned_buffer(size) for _ in range(2)]
    events: list[Any] = [None, None]
    streams: dict[Any, Any] = {}  # device -> the stream copying to it
    which = 0
    try:
        for p in pieces:
            buf = buffers[which]
            if events[which] is not None:
                events[which].synchronize()  # the copy out of this buffer has finished
            skew = p.offset % ALIGNMENT  # address = file offset mod page: no bounce
            view = buf[skew : skew + p.nbytes]
            if p.nbytes:
                got = io.pread(view, p.file, p.offset)
                if got != p.nbytes:
                    raise _short_read(path, p, got)
            assert p.check is not None
            p.check(view)
            if p.nbytes:
                dev = p.dest.device
                stream = streams.get(dev)
                if stream is None:
                    stream = streams[dev] = torch.cuda.Stream(device=dev)
                    # The destinations come from the caching allocator in the current stream's
                    # order: their memory may still be in use by kernels queued there (a tensor
                    # just freed, the parameters a queued forward pass reads). Copy after that.
                    stream.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(stream):  # also makes `dev` current while it lasts
                    _as_bytes(p.dest).copy_(view, non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(stream)
                events[which] = ev
                which ^= 1
            progress.update(p.nbytes)
    finally:
        # Copies still running read the pinned buffers and write the destinations: neither may
        # be freed (on an error) or used (on success) before they finish.
        for stream in streams.values():
            stream.synchronize()


def _a(noun: str) -> str:
    """`noun` with its indefinite article, for messages ("an OrderedDict", "a dict")."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def _checksum_mismatch(path: str, name: str, kind: str, stored: int, actual: int) -> ValueError:
    """`name`: the tensor (xxh64, per tensor) or the zip record of a storage (crc32)."""
    what, width = ("record", 8) if kind == "crc32" else ("tensor", 16)
    return ValueError(
        f"{path}: checksum mismatch in {what} {name!r}: stored {kind} {stored:0{width}x}, data "
        f"has {actual:0{width}x}: the file is corrupt"
    )


# --------------------------------------------------------------------------------------------
# Format detection
# --------------------------------------------------------------------------------------------


def _sniff(path: str) -> str:
    """'safetensors', 'torch' or 'index', from the file's first bytes."""
    if os.path.isdir(path):
        raise IsADirectoryError(
            errno.EISDIR, "is a directory: pass a checkpoint file or a shard .index.json", path
        )
    # By content (a FIFO or a device is refused, never waited on): the rule the CLI follows.
    return str(_require("detect_checkpoint_kind")(path))


# --------------------------------------------------------------------------------------------
# safetensors
# --------------------------------------------------------------------------------------------


def _check_tensor_dict(state_dict: Any) -> Any:
    torch = _torch()
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"a safetensors file holds a mapping of name -> tensor, not a "
            f"{type(state_dict).__name__}: use format='torch' for other objects"
        )
    bad = [k for k, v in state_dict.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise TypeError(
            f"safetensors files hold tensors only; these values are not tensors: {bad[:8]}"
            f"{' ...' if len(bad) > 8 else ''}: use format='torch' to keep them"
        )
    bad = [k for k in state_dict if not isinstance(k, str)]
    if bad:
        raise TypeError(f"safetensors tensor names must be str, not {bad[:8]}")
    bad = [k for k, v in state_dict.items() if v.layout != torch.strided]
    if bad:
        raise TypeError(f"sparse or non-strided tensors cannot be saved as safetensors: {bad}")
    bad = [k for k, v in state_dict.items() if v.device.type == "meta"]
    if bad:
        raise ValueError(f"meta tensors have no data to save: {bad}")
    return state_dict


def _shared_groups(state_dict: Mapping[str, Any]) -> list[list[str]]:
    """Groups of names whose tensors overlap in memory (what safetensors refuses)."""
    by_storage: dict[tuple[str, int], list[str]] = collections.defaultdict(list)
    for k, v in state_dict.items():
        if _nbytes(v) == 0:
            continue
        by_storage[(str(v.device), v.untyped_storage().data_ptr())].append(k)
    groups: list[list[str]] = []
    for names in by_storage.values():
        if len(names) < 2:
            continue
        areas = []
        for k in names:
            v = state_dict[k]
            start = v.data_ptr()
            # the furthest byte any element reaches (views may be strided)
            span = sum((s - 1) * abs(st) for s, st in zip(v.shape, v.stride())) + 1
            areas.append((start, start + span * v.element_size(), k))
        areas.sort()
        current = [areas[0][2]]
        stop = areas[0][1]
        for start, end, k in areas[1:]:
            if start < stop:
                current.append(k)
            else:
                if len(current) > 1:
                    groups.append(current)
                current = [k]
            stop = max(stop, end)
        if len(current) > 1:
            groups.append(current)
    return groups


def _safetensors_layout(state_dict: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """Offsets (relative to the data start) for each tensor. safetensors allows no gaps, so
    tensors whose size is a multiple of 4 KiB go first (each then starts on a 4 KiB boundary);
    the rest follow, widest elements first so every tensor stays naturally aligned."""
    items = list(state_dict.items())
    whole = [(k, v) for k, v in items if _nbytes(v) % ALIGNMENT == 0]
    rest = [(k, v) for k, v in items if _nbytes(v) % ALIGNMENT != 0]
    rest.sort(key=lambda kv: -kv[1].element_size())  # stable: keeps insertion order per width
    offsets: dict[str, tuple[int, int]] = {}
    pos = 0
    for k, v in whole + rest:
        n = _nbytes(v)
        offsets[k] = (pos, pos + n)
        pos += n
    return offsets


def _save_safetensors(
    state_dict: Mapping[str, Any], path: PathLike, metadata: dict[str, str], checksum: bool,
    io: IOHandle,
) -> None:
    serialize = _require("serialize_safetensors_header")
    _check_tensor_dict(state_dict)
    to_st, _ = _st_dtype_maps()
    bad = [f"{k} ({v.dtype})" for k, v in state_dict.items() if v.dtype not in to_st]
    if bad:
        raise TypeError(
            f"safetensors has no dtype for: {', '.join(bad)}: convert them or use format='torch'"
        )
    shared = _shared_groups(state_dict)
    if shared:
        raise ValueError(
            f"these tensors share memory, which safetensors files cannot express: {shared}; "
            "save one name per group (or .clone() the others), or use format='torch', which "
            "keeps the sharing"
        )
    reserved = [k for k in (CHECKSUM_KEY, HEADER_CHECKSUM_KEY) if k in metadata]
    if reserved:
        # Without checksum=True they would be stale checksums a later verify fails on.
        raise ValueError(
            f"metadata keys {reserved} are tensortier's checksums: leave them out "
            "(save(..., checksum=True) writes fresh ones)"
        )
    offsets = _safetensors_layout(state_dict)
    entries = [
        (k, to_st[v.dtype], _st_shape(k, to_st[v.dtype], v.shape), *offsets[k])
        for k, v in state_dict.items()
    ]
    data_bytes = max((end for _, end in offsets.values()), default=0)
    md = dict(metadata)
    md.setdefault("format", "pt")  # as save_model / save_pretrained write: transformers wants it
    if checksum:  # placeholder of the final length: the real header replaces it at the end
        md[CHECKSUM_KEY] = _checksum_json({k: 0 for k in state_dict})
        digest = _require("safetensors_header_digest")(entries, md)  # skips the checksum keys
        md[HEADER_CHECKSUM_KEY] = f"{digest:016x}"
    header = bytes(serialize(entries, md, ALIGNMENT))
    data_start = len(header)
    sums: dict[str, int] = {}
    with _DurableFile(path, io) as df:
        df.reserve(data_start + data_bytes)
        writer = _Writer(io, df.open())
        try:
            for k, v in state_dict.items():
                data, staged = _host_contiguous(v.detach())
                if checksum:
                    sums[k] = _xxh64(data)
                writer.add(_as_bytes(data), data_start + offsets[k][0], staged)
            writer.finish()
        except BaseException:
            writer.drain()
            raise
        if checksum:
            md[CHECKSUM_KEY] = _checksum_json(sums)
            final = bytes(serialize(entries, md, ALIGNMENT))
            if len(final) != data_start:  # cannot happen: fixed-width hex digits
                raise RuntimeError("safetensors header changed length after checksumming")
            header = final
        io.pwrite(header, df.open(), 0)
        df.commit()


def _checksum_json(sums: Mapping[str, int]) -> str:
    return json.dumps({k: f"{v:016x}" for k, v in sums.items()}, separators=(",", ":"))


def _parse_checksums(path: str, metadata: Mapping[str, str]) -> dict[str, int]:
    text = metadata.get(CHECKSUM_KEY)
    if text is None:
        raise ValueError(
            f"{path}: verify=True but the file stores no checksums (save it with "
            "tensortier.save(..., checksum=True), or load with verify=False)"
        )
    # The rules `tensortier verify` applies (one parser, in C++): duplicate names are refused,
    # and each value is exactly 16 hex digits.
    try:
        raw = _require("parse_tensor_checksums")(text)
    except ValueError as e:
        raise ValueError(f"{path}: malformed {CHECKSUM_KEY} metadata: {e}") from e
    sums = {}
    for name, hex_digits in raw.items():
        value = _core.parse_stored_checksum(hex_digits)
        if value is None:
            raise ValueError(
                f"{path}: malformed {CHECKSUM_KEY} metadata: tensor {name!r}: checksum "
                f"{hex_digits!r} is not 16 hex digits"
            )
        sums[name] = value
    return sums


@dataclass
class _STEntry:
    name: str
    dtype: Any
    shape: tuple[int, ...]
    offset: int  # absolute file offset
    nbytes: int


def _read_st_header(path: str, verify: bool = False) -> tuple[list[_STEntry], dict[str, str]]:
    """Parse a safetensors header; with `verify`, also check its stored header checksum (files
    without one, from other writers or older versions, pass: their data checksums still
    count)."""
    read_header = _require("read_safetensors_header")
    try:
        data_start, entries, metadata = read_header(path)
    except ValueError as e:
        msg = str(e)
        raise ValueError(msg if path in msg else f"{path}: {msg}") from e
    stored = metadata.get(HEADER_CHECKSUM_KEY)
    if verify and stored is not None:
        actual = _require("safetensors_header_digest")(entries, metadata)
        stored_value = _core.parse_stored_checksum(stored)
        if stored_value is None:
            raise ValueError(
                f"{path}: malformed {HEADER_CHECKSUM_KEY} metadata: {stored!r} is not 16 hex "
                "digits"
            )
        if stored_value != actual:
            raise ValueError(
                f"{path}: header checksum mismatch (stored {stored}, the header gives "
                f"{actual:016x}): names, shapes, dtypes, offsets or metadata were changed"
            )
    _, from_st = _st_dtype_maps()
    out: list[_STEntry] = []
    for name, dt, shape, begin, end in entries:
        dtype = from_st.get(dt)
        if dtype is None:
            raise ValueError(
                f"{path}: tensor {name!r} has dtype {dt}, which this torch cannot hold"
            )
        torch_shape = _torch_shape(name, dt, shape, path)
        numel = 1
        for s in torch_shape:
            numel *= s
        if numel * dtype.itemsize != end - begin:
            raise ValueError(
                f"{path}: tensor {name!r}: shape {tuple(shape)} of {dt} needs "
                f"{numel * dtype.itemsize} bytes, the header gives {end - begin}"
            )
        out.append(_STEntry(name, dtype, torch_shape, data_start + begin, end - begin))
    return out, dict(metadata)


def _xxh64_check(path: str, name: str, expected: int | None) -> Callable[[Any], None]:
    def check(data: Any) -> None:
        if expected is None:
            raise ValueError(f"{path}: verify=True but tensor {name!r} has no stored checksum")
        actual = _xxh64(data)
        if actual != expected:
            raise _checksum_mismatch(path, name, "xxh64", expected, actual)

    return check


def _same_file(file: File, path: str, parse: Callable[[str], _T]) -> _T:
    """``parse(name)`` where `name` is exactly the file `file` has open (its /proc/self/fd link):
    the header or zip directory then describes the bytes the engine reads, even if `path` is
    replaced meanwhile (an atomic save by another process). Messages name `path`."""
    proc = f"/proc/self/fd/{file.fileno()}"
    if not os.path.exists(proc):
        return parse(path)
    try:
        return parse(proc)
    except (OSError, ValueError) as e:
        if proc not in str(e):
            raise
        message = str(e).replace(proc, path)
        if isinstance(e, OSError):
            raise OSError(e.errno, message) from e
        raise ValueError(message) from e


def _load_safetensors(
    path: str, dev: Any, dtype: Any, verify: bool, progress: bool | None, io: IOHandle,
    _prog: _Progress | None = None, mapped: _Readahead | None = None,
    placement: _Placement | None = None,
) -> dict[str, Any]:
    """`placement` (``map_location``): safetensors files hold CPU tensors (location "cpu")."""
    if placement is not None and placement.restore is None:
        dev = placement.device_for("cpu")
    out = _load_safetensors_at(path, dev, dtype, verify, progress, io, _prog, mapped)
    if placement is not None and placement.restore is not None:
        out = {k: placement.restored_tensor(t, "cpu") for k, t in out.items()}
    return out


def _load_safetensors_at(
    path: str, dev: Any, dtype: Any, verify: bool, progress: bool | None, io: IOHandle,
    _prog: _Progress | None = None, mapped: _Readahead | None = None,
) -> dict[str, Any]:
    file = _open_checkpoint(io, path)
    try:
        entries, metadata = _same_file(file, path, lambda name: _read_st_header(name, verify))
        sums = _parse_checksums(path, metadata) if verify else None
        if mapped is not None:
            ranges = [(e.name, e.offset, e.nbytes) for e in entries]
            whole = _map_file(file, path, ranges, mapped)
            mapped_out = {}
            for e in entries:
                t = _mapped_tensor(whole, e.offset, e.nbytes, e.dtype, e.shape)
                if verify:
                    _xxh64_check(path, e.name, sums.get(e.name))(t)
                mapped_out[e.name] = t
            return _convert_in_place(mapped_out, dtype) if dtype is not None else mapped_out
        total = sum(e.nbytes for e in entries)
        prog = _Progress(f"loading {os.path.basename(path)}", total, progress)
        out: dict[str, Any] = {}
        # Without conversion every tensor is read in one go; with it, ~64 MiB of tensors at a
        # time, each group converted before the next is allocated: memory (GPU memory, for a
        # load to CUDA) then holds the converted tensors plus one group, not the whole file in
        # its saved dtype as well.
        converts = dtype is not None and any(_converts(e.dtype, dtype) for e in entries)
        try:
            for group in _groups(entries) if converts else [entries]:
                out.update(_read_st_group(io, file, path, group, dev, dtype, sums, prog))
        finally:
            prog.close()
    finally:
        file.close()
    return out


def _read_st_group(
    io: IOHandle, file: File, path: str, group: Sequence[_STEntry], dev: Any, dtype: Any,
    sums: Mapping[str, Any] | None, prog: _Progress,
) -> dict[str, Any]:
    """`group`'s tensors read from `file` into new tensors on `dev` and converted to `dtype`
    (when not None); checksums checked when `sums` is not None. The originals of converted
    tensors go when this returns."""
    torch = _torch()
    pieces: list[_Piece] = []
    for e in group:
        numel = e.nbytes // e.dtype.itemsize
        if dev.type == "cpu":
            flat = _host_alloc(numel, e.dtype, e.offset % ALIGNMENT)
        else:
            flat = torch.empty(numel, dtype=e.dtype, device=dev)
        check = _xxh64_check(path, e.name, sums.get(e.name)) if sums is not None else None
        pieces.append(_Piece(e.name, file, e.offset, e.nbytes, flat, check))
    _read_pieces(io, pieces, prog, path, close_progress=False)
    return {e.name: _convert(p.dest.view(e.shape), dtype) for e, p in zip(group, pieces)}


def _converts(saved: Any, dtype: Any) -> bool:
    """Whether ``_convert`` changes a tensor saved in `saved` into `dtype`."""
    return saved != dtype and saved.is_floating_point and dtype.is_floating_point


# --------------------------------------------------------------------------------------------
# torch.save zip files
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _ZipRecord:
    offset: int  # of the record's data
    size: int
    crc32: int
    # Whether the archive records CRC-32s at all: torch.save with set_crc32_options(False)
    # writes 0 for every record, so 0 means "none" only when no non-empty record has another
    # value (one record in 2**32 really has the CRC-32 0, and is checked).
    archive_has_crcs: bool = True


def _zip_records(path: str) -> dict[str, _ZipRecord]:
    """The stored (uncompressed) records of a zip file, by name."""
    zip_entries = _require("zip_entries")
    try:
        entries = zip_entries(path)
    except ValueError as e:
        msg = str(e)
        raise ValueError(msg if path in msg else f"{path}: {msg}") from e
    has_crcs = any(int(crc) != 0 for _, _, size, crc in entries if int(size) > 0)
    return {
        name: _ZipRecord(int(off), int(size), int(crc), has_crcs)
        for name, off, size, crc in entries
    }


def _archive_prefix(path: str, records: Mapping[str, _ZipRecord]) -> str:
    pkl = [n for n in records if n == "data.pkl" or n.endswith("/data.pkl")]
    pkl = [n for n in pkl if n.count("/") <= 1]
    if not pkl:
        raise ValueError(f"{path}: a zip file without data.pkl: not a torch.save checkpoint")
    if len(pkl) > 1:
        raise ValueError(f"{path}: several data.pkl records ({pkl}): not a torch.save checkpoint")
    prefix = pkl[0][: -len("data.pkl")]
    if prefix + "constants.pkl" in records:
        raise ValueError(
            f"{path}: a TorchScript archive, not a torch.save checkpoint: use torch.jit.load"
        )
    return prefix


def _read_record(
    path: str, file: File, records: Mapping[str, _ZipRecord], name: str, verify: bool = False,
    io: IOHandle | None = None,
) -> bytes:
    rec = records[name]
    data = _read_at(file, rec.size, rec.offset, io)  # small metadata records only
    if len(data) != rec.size:
        raise ValueError(f"{path}: record {name} is truncated")
    if verify and rec.archive_has_crcs and zlib.crc32(data) != rec.crc32:
        raise ValueError(
            f"{path}: checksum mismatch in record {name!r}: stored crc32 {rec.crc32:08x}, data "
            f"has {zlib.crc32(data):08x}: the file is corrupt"
        )
    return data


class _StorageOverrun(ValueError):
    """A tensor in a torch file reaches past the end of its storage record."""


@dataclass
class _StorageRef:
    path: str
    key: str
    record: _ZipRecord
    nbytes: int
    dtype: Any
    storage: Any  # UntypedStorage (cpu, cuda or meta)
    filled: bool = False  # read while unpickling (see _DATA_DEPENDENT_REBUILDS)


# torch functions that read their tensor arguments' data while the pickle is loaded (a nested
# tensor's sizes, strides and offsets are tensors): storages are normally filled after the whole
# pickle is loaded, so in files naming one they are read as the unpickler meets them instead
# (the rebuild read uninitialised memory: wrong nested shapes, or "size calculation overflowed").
_DATA_DEPENDENT_REBUILDS = (b"_rebuild_nested_tensor",)


def _fill_now(
    ref: _StorageRef, path: str, verify: bool, big_endian: bool, io: IOHandle | None = None
) -> None:
    """Reads `ref`'s record into its storage now, checked with `verify` (a CUDA storage through
    host memory), in native byte order."""
    torch = _torch()
    dest = _storage_bytes(ref.storage)
    host = dest if dest.device.type == "cpu" else torch.empty(ref.nbytes, dtype=torch.uint8)
    reader = io if io is not None else _default_io()
    file = _open_checkpoint(reader, path)
    try:
        got = reader.pread(host, file, ref.record.offset) if ref.nbytes else 0
    finally:
        file.close()
    if got < ref.nbytes:
        raise ValueError(
            f"{ref.path}: file ended early: storage data/{ref.key} needs {ref.nbytes} "
            f"bytes at offset {ref.record.offset} (truncated file?)"
        )
    if verify:
        _verifiable(ref.path, [ref])  # a file saved without CRC-32s is not a corrupt one
        _crc_check(ref.path, ref.key, ref.record.crc32)(host)
    if host is not dest:
        dest.copy_(host)
    if big_endian:
        _byteswap_storages([ref])
    ref.filled = True


@dataclass
class _Placement:
    """``load``'s `map_location` as torch.load applies it to a storage saved at `location`
    ('cpu', 'cuda:1'...): a dict maps location strings (unmapped ones stay where they were
    saved), a callable gets each storage, read on the CPU, and returns it placed (None: where
    it was saved)."""

    mapping: Mapping[str, Any] | None = None
    restore: Callable[[Any, str], Any] | None = None

    def device_for(self, location: str) -> Any:
        if self.mapping is not None:
            target = self.mapping.get(location, location)
            return _target_device(str(target) if not isinstance(target, str) else target)
        return _torch().device("cpu")  # read there, then given to `restore`

    def restored(self, storage: Any, location: str) -> Any:
        torch = _torch()
        assert self.restore is not None
        result = self.restore(storage, location)
        if result is None:  # torch's default: where it was saved
            dev = _target_device(location)
            if dev.type == "cpu":
                return storage
            placed = torch.UntypedStorage(storage.nbytes(), device=dev)
            placed.copy_(storage)
            return placed
        if isinstance(result, torch.storage.TypedStorage):
            result = result._untyped_storage
        if not isinstance(result, torch.UntypedStorage) or result.nbytes() != storage.nbytes():
            raise ValueError(
                f"map_location returned {type(result).__name__} for a storage of "
                f"{storage.nbytes()} bytes: it must return a storage of the same size (or None)"
            )
        return result

    def restored_tensor(self, t: Any, location: str) -> Any:
        torch = _torch()
        storage = self.restored(t.untyped_storage(), location)
        if storage is t.untyped_storage() or storage.data_ptr() == t.untyped_storage().data_ptr():
            return t
        out = torch.empty(0, dtype=t.dtype, device=storage.device)
        return out.set_(storage, t.storage_offset(), t.shape, t.stride())


def _unpickle_torch(
    path: str, storage_device: Any, label: str | None = None, verify: bool = False,
    mapped: Any = None, records: dict[str, _ZipRecord] | None = None,
    placement: _Placement | None = None, io: IOHandle | None = None,
) -> tuple[Any, dict[str, _StorageRef], dict[str, _ZipRecord], str, bool]:
    """Unpickle data.pkl with torch's weights_only unpickler. Storages are allocated empty on
    `storage_device` (``meta``: not at all) and filled later, or, given `mapped` (the whole
    file as a CPU UntypedStorage), are slices of it (copies where a record's offset is not a
    multiple of its element size). `records`: the zip's records when the caller has them
    already (parsed from the same file). Returns the object, the storages by
    key, the records, the archive prefix and whether the file is big-endian. The storage
    references carry `label` (the user's path when `path` is a /proc/self/fd link). With
    `verify`, the CRC-32s recorded for data.pkl and byteorder are checked too: a flipped bit
    there changes offsets, strides or non-tensor values without touching any storage.
    `placement` (``map_location``): the device of each storage from its saved location, or
    the callable each storage is given to once read on the CPU. `io` reads the records (the
    default handle without)."""
    torch = _torch()
    from torch import _weights_only_unpickler as wou

    if records is None:
        records = _zip_records(path)
    prefix = _archive_prefix(path, records)
    file = _open_checkpoint(io if io is not None else _default_io(), path)
    try:
        pkl = _read_record(path, file, records, prefix + "data.pkl", verify, io)
        big_endian = False
        if prefix + "byteorder" in records:
            order = _read_record(path, file, records, prefix + "byteorder", verify, io)
            if order not in (b"little", b"big"):
                raise ValueError(f"{path}: unknown byte order {order[:16]!r}")
            big_endian = order == b"big"
    finally:
        file.close()
    data_dependent = any(name in pkl for name in _DATA_DEPENDENT_REBUILDS)
    eager = mapped is None and data_dependent
    # Mapped storages hold their bytes already; a big-endian one must be swapped before a
    # rebuild reads it, not after the pickle is loaded.
    swap_now = mapped is not None and data_dependent and big_endian

    def unpickle(device: Any) -> tuple[Any, dict[str, _StorageRef]]:
        storages: dict[str, _StorageRef] = {}

        def persistent_load(saved_id: Any) -> Any:
            if not isinstance(saved_id, tuple) or len(saved_id) != 5:
                raise ValueError(f"{path}: unexpected persistent id {saved_id!r:.100}")
            typename, storage_type, key, location, numel = saved_id
            if isinstance(location, bytes):
                location = location.decode("ascii")
            if isinstance(typename, bytes):
                typename = typename.decode("ascii")
            if isinstance(key, bytes):
                key = key.decode("ascii")
            if typename != "storage" or not isinstance(key, str) or not isinstance(numel, int):
                raise ValueError(f"{path}: unexpected persistent id {saved_id!r:.100}")
            if storage_type is torch.UntypedStorage:
                dtype = torch.uint8
            else:
                dtype = getattr(storage_type, "dtype", None)
                if not isinstance(dtype, torch.dtype):
                    raise ValueError(
                        f"{path}: storage {key} has an unknown type {storage_type!r}"
                    )
            if key in storages:
                ref = storages[key]
            else:
                name = f"{prefix}data/{key}"
                record = records.get(name)
                if record is None:
                    raise ValueError(f"{path}: storage record {name} is missing")
                if numel < 0:
                    raise ValueError(f"{path}: storage {key} has a negative size")
                nbytes = numel * dtype.itemsize
                if nbytes != record.size:
                    raise ValueError(
                        f"{path}: storage {key} should hold {nbytes} bytes, its record has "
                        f"{record.size}"
                    )
                # A tensor set_ past the end of a resizable storage grows it: a few bytes of
                # pickle would allocate any size. CPU storages are fixed-size: torch refuses
                # then (as torch.load does).
                sdev = device
                if placement is not None and device.type != "meta":
                    sdev = placement.device_for(str(location))
                if nbytes == 0 and (mapped is not None or sdev.type == "cpu"):
                    storage = _empty_fixed_storage()
                elif mapped is not None:
                    # Only the storage is kept: quantized dtypes are mapped as bytes (a quantized
                    # tensor cannot be set_ to a storage), others in their dtype, so that a record
                    # not at a multiple of their size is copied to one that is.
                    quantized = dtype in (torch.quint8, torch.qint8, torch.qint32,
                                          getattr(torch, "quint4x2", None),
                                          getattr(torch, "quint2x4", None))
                    storage = _mapped_tensor(
                        mapped, record.offset, nbytes,
                        torch.uint8 if quantized else dtype, (nbytes if quantized else numel,),
                    ).untyped_storage()
                    if storage.resizable():  # a copy (misaligned record)
                        storage = _fixed_size(_storage_bytes(storage)).untyped_storage()
                elif sdev.type == "cpu":
                    flat = _host_alloc(nbytes, torch.uint8, record.offset % ALIGNMENT)
                    if flat.untyped_storage().resizable():
                        flat = _fixed_size(flat)
                    storage = flat.untyped_storage()
                else:
                    storage = torch.UntypedStorage(nbytes, device=sdev)
                ref = _StorageRef(label or path, key, record, nbytes, dtype, storage)
                restore = placement.restore if placement is not None else None
                if restore is not None and device.type != "meta":
                    # torch.load gives the callable each storage with its bytes, on the CPU
                    if nbytes and mapped is None:
                        _fill_now(ref, path, verify, big_endian, io)
                    ref.storage = placement.restored(ref.storage, str(location))
                    ref.filled = True
                elif eager and nbytes and device.type != "meta":
                    _fill_now(ref, path, verify, big_endian, io)
                elif swap_now and nbytes:
                    if verify:  # the CRC-32 is of the stored bytes
                        _verifiable(label or path, [ref])
                        _crc_check(label or path, key, record.crc32)(_storage_bytes(storage))
                    _byteswap_storages([ref])
                    ref.filled = True
                storages[key] = ref
            return torch.storage.TypedStorage(
                wrap_storage=ref.storage, dtype=dtype, _internal=True
            )

        import io as pyio

        stream = pyio.BytesIO(pkl)
        unpickler = wou.Unpickler(stream, encoding="utf-8")
        unpickler.persistent_load = persistent_load  # type: ignore[method-assign]
        # torch queues every sparse tensor it rebuilds for a check at the end of a load; meta
        # ones (load_into's pass, the check before a GPU load) must not be queued: the check
        # cannot read them.
        sparse_queue = getattr(torch._utils, "_sparse_tensors_to_validate", None)
        queued = len(sparse_queue) if isinstance(sparse_queue, list) else 0
        try:
            obj = unpickler.load()
        except pickle.UnpicklingError as e:
            raise ValueError(
                f"{path}: data.pkl holds what torch.load(weights_only=True) refuses (tensortier "
                f"never runs other pickle code): {e}"
            ) from None
        except OSError:
            raise
        except ValueError as e:
            if path in str(e) or (label is not None and label in str(e)):
                raise
            # The unpickler's own (a bad UTF-8 string: UnicodeDecodeError...): where it stopped.
            raise ValueError(
                f"{path}: malformed data.pkl (at byte {stream.tell()} of {len(pkl)}): "
                f"{type(e).__name__}: {e}"
            ) from e
        except Exception as e:  # noqa: BLE001 - a malformed pickle can fail in many ways
            raise ValueError(
                f"{path}: malformed data.pkl (at byte {stream.tell()} of {len(pkl)}): "
                f"{type(e).__name__}: {e}"
            ) from e
        finally:
            if device.type == "meta" and isinstance(sparse_queue, list):
                del sparse_queue[queued:]
        for key, ref in storages.items():
            # Storages that can grow (meta, CUDA) grew to fit a tensor reaching past their
            # end: its bytes would come from other records, or from nowhere.
            if ref.storage.nbytes() != ref.nbytes:
                raise _StorageOverrun(
                    f"{label or path}: malformed data.pkl: a tensor reaches past the end of "
                    f"storage data/{key} ({ref.nbytes} bytes)"
                )
        return obj, storages

    if mapped is None and (storage_device.type not in ("cpu", "meta") or (
            placement is not None and placement.mapping is not None)):
        # A CUDA storage grows to whatever a tensor set_ past its end asks for before the size
        # check can refuse the file: a few bytes of pickle would allocate any amount of GPU
        # memory. Meta storages grow for free: the same pickle is checked on them first.
        try:
            unpickle(torch.device("meta"))
        except _StorageOverrun:
            raise
        except ValueError:
            pass  # what meta cannot rebuild (quantized tensors): the real pass decides
    obj, storages = unpickle(storage_device)
    return obj, storages, records, prefix, big_endian


def _crc_check(path: str, key: str, expected: int) -> Callable[[Any], None]:
    def check(data: Any) -> None:
        actual = _crc32(_as_bytes(data))
        if actual != expected:
            raise _checksum_mismatch(path, f"data/{key}", "crc32", expected, actual)

    return check


def _verify_other_records(
    path: str, file: File, records: Mapping[str, _ZipRecord], checked: set[str], io: IOHandle
) -> None:
    """verify=True: the CRC-32 of every zip record not in `checked` (read and checked with the
    tensors): ``.format_version``, ``version``, ``.data/serialization_id``, records no tensor
    uses... as ``tensortier verify`` checks every entry. An archive recording no CRC-32s
    cannot be verified (nor can it there)."""
    if any(r.size and not r.archive_has_crcs for r in records.values()):
        raise ValueError(
            f"{path}: verify=True but the file stores no CRC-32 for its records (it was saved "
            "with torch.serialization.set_crc32_options(False); save it with "
            "tensortier.save(..., checksum=True), or load with verify=False)"
        )
    for name, rec in records.items():
        if name in checked:
            continue
        crc = pos = 0
        while pos < rec.size:
            data = _read_at(file, min(rec.size - pos, _GROUP_BYTES), rec.offset + pos, io)
            if not data:
                raise ValueError(f"{path}: record {name} is truncated (file ended at offset "
                                 f"{rec.offset + pos})")
            crc = zlib.crc32(data, crc)
            pos += len(data)
        if crc != rec.crc32:
            raise ValueError(
                f"{path}: checksum mismatch in record {name!r}: stored crc32 {rec.crc32:08x}, "
                f"data has {crc:08x}: the file is corrupt"
            )


def _verifiable(path: str, storages: Sequence[_StorageRef]) -> None:
    if any(r.nbytes and not r.record.archive_has_crcs for r in storages):
        # torch.save writes a CRC-32 for every record unless told not to (then all are 0)
        raise ValueError(
            f"{path}: verify=True but the file stores no CRC-32 for its storages (it was saved "
            "with torch.serialization.set_crc32_options(False); save it with "
            "tensortier.save(..., checksum=True), or load with verify=False)"
        )


def _load_torch(
    path: str, dev: Any, dtype: Any, verify: bool, progress: bool | None, io: IOHandle,
    mapped: _Readahead | None = None, placement: _Placement | None = None,
) -> Any:
    torch = _torch()
    file = _open_checkpoint(io, path)
    try:
        whole = records = None
        if mapped is not None:
            records = _same_file(file, path, _zip_records)
            ranges = [(name, r.offset, r.size) for name, r in records.items()]
            whole = _map_file(file, path, ranges, mapped)
        obj, storages, records, prefix, big_endian = _same_file(
            file,
            path,
            lambda name: _unpickle_torch(
                name, dev, label=path, verify=verify, mapped=whole, records=records,
                placement=placement, io=io,
            ),
        )
        refs = sorted(storages.values(), key=lambda r: r.record.offset)
        if verify:
            _verifiable(path, refs)
            read = {f"{prefix}data/{r.key}" for r in refs}
            read |= {f"{prefix}data.pkl", f"{prefix}byteorder"}  # checked while unpickling
            _verify_other_records(path, file, records, read, io)
        pieces: list[_Piece] = []
        if whole is not None:
            if verify:
                for r in refs:
                    if not r.filled:  # swapped while unpickling: checked then
                        _crc_check(path, r.key, r.record.crc32)(_storage_bytes(r.storage))
        else:
            pieces = [
                _Piece(
                    f"data/{r.key}", file, r.record.offset, r.nbytes, _storage_bytes(r.storage),
                    _crc_check(path, r.key, r.record.crc32) if verify else None,
                )
                for r in refs
                if not r.filled
            ]
        if pieces:
            prog = _Progress(
                f"loading {os.path.basename(path)}", sum(r.nbytes for r in refs), progress
            )
            _read_pieces(io, pieces, prog, path)
    finally:
        file.close()
    if big_endian:
        _byteswap_storages([r for r in refs if not r.filled])
    validate = getattr(torch._utils, "_validate_loaded_sparse_tensors", None)
    if validate is not None:
        validate()
    if dtype is not None:
        del storages, refs, pieces  # the originals' last references are obj's
        obj = _convert_in_place(obj, dtype)
    return obj


def _byteswap_storages(refs: Sequence[_StorageRef]) -> None:
    """Big-endian data in native order, on the storages' own devices."""
    for r in refs:
        if r.storage.device.type == "cpu":
            r.storage.byteswap(r.dtype)
        else:  # torch's byteswap writes through the pointer on the host
            _swap_bytes(r.storage, r.dtype)


def _swap_bytes(storage: Any, dtype: Any) -> None:
    """``storage.byteswap(dtype)`` done with tensor operations on the storage's own device (each
    element's bytes reversed; a complex number's two halves each on their own, as torch does)."""
    width = dtype.itemsize // (2 if dtype.is_complex else 1)
    if width <= 1:
        return
    flat = _storage_bytes(storage)
    count = flat.numel() // width
    elements = flat[: count * width].view(count, width)
    elements.copy_(elements.flip(-1))


def _convert_in_place(obj: Any, dtype: Any) -> Any:
    """`obj` with every tensor inside dicts, lists and tuples converted by ``_convert``. Dicts
    and lists are changed in place, one tensor at a time, so that each original can go as soon
    as it is converted (with nothing else holding it): converting a whole checkpoint then needs
    room for one converted tensor more, not for a second copy of all of them. A tensor met twice
    is converted once and stays one object; so do containers met twice."""
    torch = _torch()
    converted: dict[int, Any] = {}  # id(original) -> converted, for tensors met again
    done: set[int] = set()  # containers already converted

    def visit(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            out = converted.get(id(o))
            if out is None:
                out = _convert(o, dtype)
                if out is not o:
                    converted[id(o)] = out
            return out
        if id(o) in done:
            return o
        if isinstance(o, dict):
            done.add(id(o))
            for k in list(o):
                o[k] = visit(o[k])
        elif isinstance(o, list):
            done.add(id(o))
            for i, v in enumerate(o):
                o[i] = visit(v)
        elif isinstance(o, tuple) and not hasattr(o, "_fields"):
            items = [visit(v) for v in o]
            if all(new is old for new, old in zip(items, o)):
                return o  # nothing converted: torch.Size and other tuple types kept as they are
            return type(o)(items) if type(o) is not tuple else tuple(items)
        return o

    return visit(obj)


class _NullSink:
    def write(self, data: bytes) -> int:
        return len(data)


def _storages_in_save_order(obj: Any) -> list[Any]:
    """The storages ``torch.save(obj)`` writes, in the order of their keys ("0", "1", ...).

    torch's ``_save`` numbers storages in the order its pickler meets them; pickling the same
    object again with the same protocol meets them in the same order."""
    torch = _torch()
    seen: dict[int, int] = {}
    storages: list[Any] = []

    class Recorder(pickle.Pickler):
        def persistent_id(self, o: Any) -> Any:
            if isinstance(o, torch.storage.TypedStorage) or torch.is_storage(o):
                storage = o._untyped_storage if isinstance(o, torch.storage.TypedStorage) else o
                if storage._cdata not in seen:
                    seen[storage._cdata] = len(storages)
                    storages.append(storage)
                return ("storage", seen[storage._cdata])
            return None

    with torch.serialization.skip_data():
        Recorder(_NullSink(), protocol=torch.serialization.DEFAULT_PROTOCOL).dump(obj)
    return storages


def _torch_writes_crcs(torch: Any) -> bool:
    """Whether torch.save would write CRC-32s now (``set_crc32_options``, torch >= 2.6)."""
    get = getattr(torch.serialization, "get_crc32_options", None)
    return bool(get()) if get is not None else True


def _save_torch_config(checksum: bool) -> dict[str, Any]:
    """torch.save settings for our saves: storages 4 KiB aligned; with `checksum`, CRC-32s for
    every record even where set_crc32_options(False) said not to. (torch's config patches are
    per thread: saves on other threads, ours or torch.save's, keep their own settings.)"""
    from torch.utils.serialization import config as ser_config

    patch: dict[str, Any] = {"save.storage_alignment": ALIGNMENT}
    if checksum and hasattr(ser_config.save, "compute_crc32"):  # torch >= 2.6
        patch["save.compute_crc32"] = True
    return patch


def _save_torch_whole(obj: Any, path: PathLike, checksum: bool, io: IOHandle) -> None:
    """What torch cannot pickle without its data (quantized and nested tensors refuse
    ``skip_data``): written by torch.save itself, data and all, with the same durability (a
    temporary file, fsync, rename). Slower: torch's single-threaded buffered writes."""
    torch = _torch()
    from torch.utils.serialization import config as ser_config

    with _DurableFile(path, io) as df:
        with open(df.tmp, "r+b") as f:
            try:
                with ser_config.patch(_save_torch_config(checksum)):
                    torch.save(obj, f)
            except (RuntimeError, pickle.PicklingError, AttributeError) as e:
                raise ValueError(f"torch.save cannot save this object: {e}") from e
        df.commit()


def _save_torch(obj: Any, path: PathLike, checksum: bool, io: IOHandle) -> None:
    torch = _torch()
    if not hasattr(torch.serialization, "skip_data"):
        raise ValueError(
            f"format='torch' needs torch.serialization.skip_data (PyTorch >= 2.5); this is "
            f"{torch.__version__}: use format='safetensors'"
        )
    from torch.utils.serialization import config as ser_config

    try:
        storages = _storages_in_save_order(obj)
    except (RuntimeError, pickle.PicklingError, AttributeError) as e:
        if "skip_data" in str(e):  # quantized and nested tensors: torch writes them itself
            _save_torch_whole(obj, path, checksum, io)
            return
        raise ValueError(f"torch.save cannot save this object: {e}") from e
    with _DurableFile(path, io) as df:
        with open(df.tmp, "r+b") as f:  # torch writes the metadata records and leaves holes
            try:
                with ser_config.patch(_save_torch_config(checksum)):
                    with torch.serialization.skip_data():
                        torch.save(obj, f)
            except (RuntimeError, pickle.PicklingError, AttributeError) as e:
                raise ValueError(f"torch.save cannot save this object: {e}") from e
        records = _zip_records(df.tmp)
        prefix = _archive_prefix(df.tmp, records)
        data_names = [n for n in records if n.startswith(prefix + "data/")]
        if len(data_names) != len(storages):
            raise RuntimeError(
                f"tensortier found {len(storages)} storages, torch.save wrote {len(data_names)}"
            )
        places: list[tuple[Any, _ZipRecord]] = []
        for key, storage in enumerate(storages):
            rec = records.get(f"{prefix}data/{key}")
            if rec is None or rec.size != storage.nbytes():
                raise RuntimeError(f"torch.save wrote storage {key} differently than expected")
            places.append((storage, rec))
        file_size = os.path.getsize(df.tmp)
        df.reserve(file_size)
        writer = _Writer(io, df.open())
        # torch.save writes every record's CRC-32 unless set_crc32_options(False) said not to;
        # zip tools reject a record whose CRC does not match (skip_data leaves zeros).
        with_crcs = checksum or _torch_writes_crcs(torch)
        crcs: dict[str, int] = {}
        try:
            for key, (storage, rec) in enumerate(places):
                data = _storage_bytes(storage)
                staged = data.device.type != "cpu"
                if staged:
                    data = data.to("cpu")
                writer.add(data, rec.offset, staged)
                if with_crcs:  # while the engine writes the groups before this one
                    crcs[f"{prefix}data/{key}"] = _crc32(data)
            writer.finish()
        except BaseException:
            writer.drain()
            raise
        if crcs:
            # Hundreds of 4-byte patches into pages torch wrote through the page cache (the
            # engine's writes, all complete, covered only the records' data): one batch through
            # the engine, flushed by commit's fdatasync like the rest.
            patches = [(bytearray(packed), df.open(), offset)
                       for offset, packed in _require("zip_crc_patches")(df.tmp, crcs)]
            if patches:
                io.pwrite_batch_async(patches).wait()
        df.commit()


# --------------------------------------------------------------------------------------------
# Hugging Face shard indexes
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# load_into
# --------------------------------------------------------------------------------------------


@dataclass
class _Source:
    """Where a saved tensor's bytes are: a contiguous run of `nbytes` at `offset` of `path`, or
    (non-contiguous torch views) a tensor to copy from once its storage is read."""

    path: str
    dtype: Any
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    check: Callable[[Any], None] | None  # set per load (verify)
    checksum: int | None  # xxh64 of the bytes (safetensors) or None
    crc_storage: _StorageRef | None = None  # torch: the storage record (crc checks)
    view: Any = None  # torch: a meta tensor describing the saved view


def _describe_sources(
    path: str, io: IOHandle, files: dict[str, File], verify: bool = False
) -> dict[str, _Source]:
    """The tensors of `path` (an index: of its shards). Every data file is opened into `files`
    and parsed through that descriptor."""
    kind = _sniff(path)
    if kind == "index":
        out: dict[str, _Source] = {}
        for shard, names in _read_index(path).items():
            if _sniff(shard) == "index":  # also stops an index naming itself (endless recursion)
                raise ValueError(f"{path}: shard {shard} is itself an index")
            part = _describe_sources(shard, io, files, verify)
            missing = [n for n in names if n not in part]
            if missing:
                raise ValueError(
                    f"{path}: the index puts {missing[:8]} in {shard}, which lacks them"
                )
            out.update(part)
        return out
    if path not in files:
        files[path] = _open_checkpoint(io, path)
    file = files[path]
    if kind == "safetensors":
        entries, metadata = _same_file(file, path, lambda name: _read_st_header(name, verify))
        sums: dict[str, int] | None = None
        if CHECKSUM_KEY in metadata:
            sums = _parse_checksums(path, metadata)
        return {
            e.name: _Source(path, e.dtype, e.shape, e.offset, e.nbytes, None,
                            None if sums is None else sums.get(e.name, -1))
            for e in entries
        }
    torch = _torch()
    obj, storages, records, prefix, big_endian = _same_file(
        file,
        path,
        lambda name: _unpickle_torch(
            name, torch.device("meta"), label=path, verify=verify, io=io
        ),
    )
    if verify:  # storage records are checked as their tensors are read
        read = {f"{prefix}data/{r.key}" for r in storages.values()}
        read |= {f"{prefix}data.pkl", f"{prefix}byteorder"}
        _verify_other_records(path, file, records, read, io)
    if big_endian:
        raise ValueError(f"{path}: big-endian torch files are read by load(), not load_into()")
    if not isinstance(obj, Mapping):
        raise ValueError(
            f"{path}: holds a {type(obj).__name__}, not a flat state dict: use tensortier.load"
        )
    by_storage = {id(r.storage): r for r in storages.values()}
    by_cdata = {r.storage._cdata: r for r in storages.values()}
    out = {}
    for name, t in obj.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(
                f"{path}: {name!r} is {_a(type(t).__name__)}, not a tensor: load_into reads flat "
                "state dicts; use tensortier.load"
            )
        ref = by_cdata.get(t.untyped_storage()._cdata) or by_storage.get(id(t.untyped_storage()))
        if ref is None:
            raise ValueError(f"{path}: cannot find the storage of {name!r}")
        start = t.storage_offset() * t.element_size()
        n = _nbytes(t)
        # A conjugate or negative view's storage holds other numbers than its values: read
        # through its storage, then copied with the bit applied, as non-contiguous views are.
        contiguous = t.is_contiguous() and not t.is_conj() and not t.is_neg()
        out[name] = _Source(path, t.dtype, tuple(t.shape), ref.record.offset + start, n, None,
                            None, ref, None if contiguous else t)
    return out


def _load_into(
    targets: dict[str, Any], sources: dict[str, _Source], strict: bool, verify: bool,
    progress: bool | None, io: IOHandle, path: str, files: Mapping[str, File],
    target_name: str = "dict",
) -> IncompatibleKeys:
    torch = _torch()
    unexpected = [k for k in sources if k not in targets]
    missing = [k for k in targets if k not in sources]
    # A name missing from the file whose tensor is the very same memory as a loaded one (tied
    # weights, stored once in safetensors files) gets its data anyway.
    loaded_mem = {
        (t.data_ptr(), _nbytes(t), t.dtype, tuple(t.shape))
        for k, t in targets.items() if k in sources
    }
    missing = [
        k for k in missing
        if (targets[k].data_ptr(), _nbytes(targets[k]), targets[k].dtype,
            tuple(targets[k].shape)) not in loaded_mem or _nbytes(targets[k]) == 0
    ]
    # The lines and their order are load_state_dict's: code parsing its message keeps working.
    errors = []
    if strict and missing:
        errors.append("Missing key(s) in state_dict: {}. ".format(
            ", ".join(f'"{k}"' for k in missing)))
    if strict and unexpected:
        errors.append("Unexpected key(s) in state_dict: {}. ".format(
            ", ".join(f'"{k}"' for k in unexpected)))
    for k, src in sources.items():
        t = targets.get(k)
        if t is not None and tuple(t.shape) != src.shape:
            errors.append(
                f"size mismatch for {k}: copying a param with shape {torch.Size(src.shape)} "
                f"from checkpoint, the shape in current model is {t.shape}."
            )
    if errors:
        hint = " (load_into(..., strict=False) skips missing and unexpected names)"
        raise StateDictMismatchError(
            f"Error(s) in loading state_dict for {target_name}:\n\t" + "\n\t".join(errors)
            + f"\n\tfrom {path}" + (hint if strict and (missing or unexpected) else "")
        )

    direct: list[_Piece] = []  # read straight into the target's memory
    staged: list[_Staged] = []  # read into a temporary, then copied (and converted) into it
    crc_refs: dict[tuple[str, str], _StorageRef] = {}
    # The same memory under several names (tied weights) is read once, from the name that
    # comes last in the target's order: the value load_state_dict leaves (it copies each name
    # in turn, so the last one wins).
    last_name: dict[tuple[int, int], str] = {}
    for k, t in targets.items():
        if k in sources and _nbytes(t) > 0:
            last_name[(t.data_ptr(), _nbytes(t))] = k
    for k, src in sources.items():
        t = targets.get(k)
        if t is None:
            continue
        mem = (t.data_ptr(), _nbytes(t))
        if mem[1] > 0 and last_name[mem] != k:
            continue
        f = files[src.path]
        if src.view is not None and src.crc_storage is not None:
            # a non-contiguous saved view: read its whole storage, then copy the view out
            ref = src.crc_storage
            if verify:
                _verifiable(src.path, [ref])
            staged.append(_Staged(ref.nbytes, functools.partial(
                _stage_saved_view, t, ref, src.view, f,
                _crc_check(src.path, ref.key, ref.record.crc32) if verify else None)))
            continue
        check = None
        if verify and src.crc_storage is not None:
            ref = src.crc_storage
            if src.offset == ref.record.offset and src.nbytes == ref.nbytes:
                _verifiable(src.path, [ref])
                check = _crc_check(src.path, ref.key, ref.record.crc32)
            else:  # the CRC covers more than this tensor: checked on its own afterwards
                crc_refs[(ref.path, ref.key)] = ref
        elif verify:
            if src.checksum is None:
                _parse_checksums(src.path, {})  # raises: this file stores no checksums
            check = _xxh64_check(src.path, k, None if src.checksum == -1 else src.checksum)
        if t.is_contiguous() and t.dtype == src.dtype:  # CPU: in place; CUDA: engine's ring/GDS
            direct.append(_Piece(k, f, src.offset, src.nbytes, t.detach(), check))
        else:
            staged.append(_Staged(src.nbytes, functools.partial(
                _stage_tensor, t, k, f, src, check)))
    total = sum(p.nbytes for p in direct) + sum(s.nbytes for s in staged)
    prog = _Progress(f"loading {os.path.basename(path)}", total, progress)
    try:
        with torch.no_grad():
            _read_pieces(io, direct, prog, path, close_progress=False)
            # Temporaries a group at a time: the extra memory is one group (or one tensor),
            # plus, for CUDA targets with verify, two pinned buffers of the largest piece.
            for group in _staged_groups(staged):
                made = [s.make() for s in group]
                _read_pieces(io, [piece for piece, _ in made], prog, path, close_progress=False)
                for _, finish in made:
                    finish()
                del made
    finally:
        prog.close()
    if crc_refs:
        _verify_torch_records(io, files, list(crc_refs.values()))
    return IncompatibleKeys(missing, unexpected)


@dataclass
class _Staged:
    """A load_into target read through a temporary: non-contiguous, another dtype than the
    file's (converted as load_state_dict's copy_ does), or a view of a saved storage. `make`
    allocates the temporary and returns the piece to read and the copy into the target."""

    nbytes: int
    make: Callable[[], tuple[_Piece, Callable[[], None]]]


def _staged_groups(staged: Sequence[_Staged]) -> Iterator[list[_Staged]]:
    group: list[_Staged] = []
    size = 0
    for s in staged:
        if group and size + s.nbytes > _GROUP_BYTES:
            yield group
            group, size = [], 0
        group.append(s)
        size += s.nbytes
    if group:
        yield group


def _stage_tensor(
    t: Any, name: str, f: File, src: _Source, check: Callable[[Any], None] | None
) -> tuple[_Piece, Callable[[], None]]:
    torch = _torch()
    tmp = torch.empty(src.shape, dtype=src.dtype, device=t.device)
    return _Piece(name, f, src.offset, src.nbytes, tmp, check), lambda: t.copy_(tmp)


def _stage_saved_view(
    t: Any, ref: _StorageRef, view: Any, f: File, check: Callable[[Any], None] | None
) -> tuple[_Piece, Callable[[], None]]:
    torch = _torch()
    holder = torch.empty(ref.nbytes, dtype=torch.uint8)

    def copy_view() -> None:
        src_t = torch.empty(0, dtype=view.dtype).set_(
            holder.untyped_storage(), view.storage_offset(), view.shape, view.stride())
        if view.is_conj():
            src_t = src_t.conj()
        if view.is_neg():
            src_t = src_t.neg()
        t.copy_(src_t)

    return _Piece(f"data/{ref.key}", f, ref.record.offset, ref.nbytes, holder, check), copy_view


def _verify_torch_records(io: IOHandle, files: Mapping[str, Any], refs: Sequence[_StorageRef]
                          ) -> None:
    """verify=True for load_into from torch files, for storage records the tensors read do not
    cover whole: the CRC-32 covers the whole record, so it is read again through a bounded
    buffer and checked."""
    torch = _torch()
    _verifiable(refs[0].path, refs)
    buf = torch.empty(min(max(r.nbytes for r in refs), _GROUP_BYTES) or 1, dtype=torch.uint8)
    for r in refs:
        f = files[r.path]
        crc = 0
        pos = 0
        while pos < r.nbytes:
            n = min(buf.numel(), r.nbytes - pos)
            got = io.pread(buf[:n], f, r.record.offset + pos)
            if got != n:
                raise ValueError(f"{r.path}: file ended early in record data/{r.key}")
            crc = _crc32(buf[:n], crc)
            pos += n
        if crc != r.record.crc32:
            raise _checksum_mismatch(r.path, f"data/{r.key}", "crc32", r.record.crc32, crc)
