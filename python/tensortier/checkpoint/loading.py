"""tensortier.load, and the walk of shard indexes (model.safetensors.index.json)."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Mapping
from typing import Any, BinaryIO

from ..io import IOHandle
from . import _engine, mapping
from ._dtype import _target_dtype
from ._files import _is_file_object, _memfd_copy, _renamed
from ._reading import _opened_together
from .. import _core
from ._format import _as_damaged, _require, _sniff, _torch, PathLike, UnavailableDeviceError
from .._paths import fspath as _fspath
from .mapping import _Placement, _Readahead
from .safetensors import _load_safetensors
from .unpickler import _load_torch


def load(
    path: PathLike | BinaryIO,
    device: Any = None,
    dtype: Any = None,
    verify: bool = False,
    *,
    map_location: Any = None,
    weights_only: bool | None = None,
    mmap: bool | None = None,
    progress: bool | None = None,
    pickle_module: Any = None,
    encoding: str | None = None,
    _io: IOHandle | None = None,
    _shared_mapping: bool | None = None,
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
        device: ``"cpu"`` (the default), ``"cuda:N"`` or ``"meta"`` (shapes and dtypes only, as
            ``torch.load(map_location="meta")`` gives them: no tensor byte is read). For CUDA each tensor is allocated on the device and
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
            private (unless torch's ``set_default_mmap_options(mmap.MAP_SHARED)`` is in force,
            as for ``torch.load``: then they reach the file). Only for ``device="cpu"``. The call reads no tensor bytes itself, except
            with `verify` (checks them now, as they are at load time), `dtype` (converted
            tensors are copies), big-endian torch files (swapped into private copies) and
            tensors whose offset is not a multiple of their element size (possible in other
            writers' files; copied). The file must not be truncated or rewritten in place
            while the tensors live: reading a page past its new end kills the process with
            SIGBUS. Replacing it by rename, as :func:`save` does, is safe. None (the default,
            as for ``torch.load``): torch's setting
            ``torch.utils.serialization.config.load.mmap`` (False unless changed) for loads to
            the CPU without a dict or callable `map_location`, False for others.
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
        pickle_module: ``torch.load``'s, taken where code passes it on: it makes
            ``torch.load`` default to ``weights_only=False``, refused as above (with
            ``weights_only=True`` given, torch's ``RuntimeError``).
        encoding: ``torch.load``'s: it matters only for Python 2 pickles, which only legacy
            files (refused) hold.

    Returns:
        safetensors and index files: ``dict[str, Tensor]`` in the file's order. torch files:
        whatever was saved (shared storages stay shared).

    Raises:
        WeightsOnlyUnpicklingError: a torch file's pickle holds globals or opcodes that
            ``torch.load(weights_only=True)`` refuses (those ``torch.serialization.
            add_safe_globals`` allows load): a ``pickle.UnpicklingError``, as ``torch.load``
            raises, and a ``ValueError``.
        ValueError: not a checkpoint, a malformed or unsupported file (legacy torch format,
            compressed zip entries...), a checksum mismatch (naming the tensor), or a bad
            argument (CUDA unavailable...).
        OSError: the file cannot be read, or is not a regular file (a FIFO is refused, never
            waited on).
    """
    torch = _torch()
    if pickle_module is not None:
        if weights_only:
            raise RuntimeError("Can not safely load weights when explicit pickle_module is "
                               "specified")  # torch.load's own words
        weights_only = False  # torch.load's default with a pickle_module
    if encoding is not None and not isinstance(encoding, str):
        raise TypeError(f"encoding must be a str, not {type(encoding).__name__}")
    _require("check_weights_only")(weights_only)
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
    try:
        dev = mapping._target_device(device if device is not None else "cpu")
    except UnavailableDeviceError:
        if placement is not None or mmap:
            raise
        # torch.load fails only where it restores a storage there: a file without tensors (a
        # scheduler's state) loads. Each storage's device is asked for as it is met.
        placement = _Placement(mapping=_EveryLocation(device))
        dev = mapping._target_device("cpu")
    target_dtype = _target_dtype(dtype)
    if mmap is None:  # torch.load's default: its setting, where a mapping can serve the load
        mmap = placement is None and dev.type == "cpu" and _torch_default_mmap()
    to_meta: list[str] = []
    if verify and placement is not None and placement.mapping is not None:
        to_meta = sorted(str(k) for k, v in placement.mapping.items() if _is_meta(v))
    _require("check_load_options")(str(dev), bool(verify), mmap, repr(to_meta) if to_meta else "")
    io = _io if _io is not None else _engine._default_io()
    with contextlib.ExitStack() as stack:
        streamed = _is_file_object(path, "read")
        fspath = stack.enter_context(_memfd_copy(path)) if streamed else _fspath(path)
        try:
            try:
                kind = _sniff(fspath)
            except _core.FormatError as e:
                raise _as_damaged(e, fspath, None) from None
            if kind == "index" and streamed:
                raise ValueError("a shard index names its shards by path: load it by its path, "
                                 "not from a file object")
            # One way down: the shards here -> safetensors or unpickler -> _reading (C++ reads).
            with _engine._gc_paused():
                return _load_kind(fspath, kind, dev, target_dtype, verify, progress, io,
                                  _Readahead(_shared_mapping) if mmap and dev.type != "meta"
                                  else None,
                                  placement)
        except ValueError as e:
            if not streamed or fspath not in str(e):
                raise
            # errors name the file: the caller's object, not the memfd it was copied to
            name = getattr(path, "name", None)
            label = repr(name) if isinstance(name, str) else f"<{type(path).__name__}>"
            raise _renamed(e, str(e).replace(fspath, label)) from e


def _torch_default_mmap() -> bool:
    """``torch.utils.serialization.config.load.mmap`` (torch >= 2.5; False before)."""
    try:
        from torch.utils.serialization import config
    except ImportError:
        return False
    return bool(getattr(config.load, "mmap", False))


class _EveryLocation(dict):  # type: ignore[type-arg]
    """A ``map_location`` dict that sends every saved location to `device`."""

    def __init__(self, device: Any) -> None:
        super().__init__()
        self.device = device

    def get(self, key: Any, default: Any = None) -> Any:
        return self.device


def _is_meta(location: Any) -> bool:
    try:
        return _torch().device(location).type == "meta"
    except (TypeError, RuntimeError, ValueError):
        return False


# Times an index is read again when another save replaced it while its shards were opened.
_READS_OF_A_REPLACED_INDEX = 3


def _identity(path: str) -> tuple[int, ...] | None:
    """What tells one version of the file at `path` from the next (None: none there now)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _each_shard(path: str, read: Callable[[str, str], Any], io: IOHandle) -> dict[str, Any]:
    """What ``read(shard, kind)`` gives for each shard of index `path`, in one dict in the
    shards' order (the index read by the CLI's rules), each shard's tensors those the index
    puts there (the order shards are read in must not decide the bytes). The shards are opened
    together (more than _opened_together holds: one by one), and the index is read again if
    another save replaced it meanwhile (opened one by one: at any time until the last shard was
    read): a directory saved again during the load is read as one version, never a mix of two."""
    for _ in range(_READS_OF_A_REPLACED_INDEX):
        before = _identity(path)
        try:
            walk = list(_require("shard_index_walk")(path))  # an index in one is refused
            opening = _opened_together(io, [shard for shard, _, _ in walk])
            held = opening.__enter__()
        except FileNotFoundError:
            if _identity(path) != before:
                continue  # a save with other shard names replaced the directory meanwhile
            raise
        with contextlib.ExitStack() as stack:
            stack.push(opening)
            if held and _identity(path) != before:
                continue  # the shards opened may be another version's than the index read
            out: dict[str, Any] = {}
            try:
                for shard, kind, names in walk:
                    part = read(shard, kind)
                    out.update((n, part[n])
                               for n in _require("shard_names")(path, shard, names, part))
            except Exception:
                if held or _identity(path) == before:
                    raise
                # Too many shards to hold open, and another save's are there now: gone, split
                # otherwise (a shard that lacks what the index read puts there) or half written.
                continue
            if not held and _identity(path) != before:
                continue  # too many shards to hold open: read one by one, maybe of two versions
            return out
    raise OSError(errno.EAGAIN, f"{path}: replaced by another save each of the "
                  f"{_READS_OF_A_REPLACED_INDEX} times its shards were opened; load it again "
                  "once the saves into its directory have ended")


def _load_kind(
    path: str, kind: str, dev: Any, dtype: Any, verify: bool, progress: bool | None,
    io: IOHandle, mapped: _Readahead | None = None, placement: _Placement | None = None,
) -> Any:
    """The load of `path`, a file of ``_sniff``'s `kind` (an index: of each of its shards)."""
    if kind == "index":
        return _each_shard(path, lambda shard, k: _load_kind(
            shard, k, dev, dtype, verify, progress, io, mapped, placement), io)
    try:
        if kind == "safetensors":
            return _load_safetensors(path, dev, dtype, verify, progress, io, mapped, placement)
        return _load_torch(path, dev, dtype, verify, progress, io, mapped, placement)
    except _core.FormatError as e:
        raise _as_damaged(e, path, kind) from None
