"""tensortier.save."""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any, BinaryIO

from ..io import IOHandle
from . import _engine
from ._files import _is_file_object, _STREAM_CHUNK
from ._format import _require, _save_format, PathLike
from .._paths import fspath
from .safetensors import _save_safetensors
from .torch_save import _save_torch


def save(
    state_dict: Mapping[str, Any],
    path: PathLike | BinaryIO,
    format: str | None = None,
    metadata: Mapping[str, str] | None = None,
    checksum: bool = False,
    *,
    pickle_module: Any = None,
    pickle_protocol: int = 2,
    _use_new_zipfile_serialization: bool = True,
    _disable_byteorder_record: bool = False,
    _io: IOHandle | None = None,
) -> None:
    """Save `state_dict` to `path`, durably (temporary file, fdatasync, rename, directory fsync).

    Args:
        state_dict: name -> tensor (CPU or GPU; non-contiguous tensors are saved contiguous).
            With ``format="torch"`` any object ``torch.save`` accepts, pickled as
            ``torch.save`` pickles it; :func:`load` reads back what ``torch.load(...,
            weights_only=True)`` reads (nested dicts/lists, ints, strings...), and refuses
            the rest as torch.load does by default (a whole ``nn.Module``, instances of your
            own classes: save their ``state_dict()``).
        path: the file to write; its directory must exist. An existing file is replaced only
            once the new one is complete and synced, keeping its mode, owner and group (the
            owner where the caller may set it: root); one the caller may not write is not
            replaced (``PermissionError``, as from ``torch.save``). Or a writable binary
            file object (``io.BytesIO``, an open file), as ``torch.save`` takes: the checkpoint
            is written to a temporary file first, then copied to it from its current position.
        format: ``"safetensors"`` or ``"torch"``; by default from the suffix, in either case
            (``.safetensors``/``.st`` -> safetensors, ``.pt``/``.pth``/``.bin``/``.ckpt``/``.tar``
            -> torch; an unknown suffix after one of those, that one's: ``x.safetensors.tmp``;
            any other name, and a file object, torch, as ``torch.save`` writes).
        metadata: safetensors only: text metadata stored in the header (``__metadata__``);
            ``{"format": "pt"}`` is added unless given (transformers expects it).
        pickle_module: ``torch.save``'s, taken where code passes it on: the standard
            ``pickle`` module (or None).
        pickle_protocol: ``torch.save``'s: any protocol from 2 (the file is written with
            protocol 2, torch.save's default; what loads back is the same).
        _use_new_zipfile_serialization: ``torch.save``'s: True (the zip format) only.
        _disable_byteorder_record: ``torch.save``'s, taken and ignored.
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
    _check_torch_save_options(pickle_module, pickle_protocol, _use_new_zipfile_serialization)
    if _is_file_object(path, "write"):
        fmt = _save_format(None, format)
        # Staged in TMPDIR under a name that says which process made it: the staging of a
        # killed save is removed by the next save to a file object. Only this user reads it.
        tmp = _require("create_staging_directory")(
            os.path.join(tempfile.gettempdir(), "tensortier-save"), 0o700)
        try:
            staged = os.path.join(tmp, "checkpoint")
            save(state_dict, staged, fmt, metadata, checksum, _io=_io)
            with open(staged, "rb") as f:
                shutil.copyfileobj(f, path, _STREAM_CHUNK)  # type: ignore[misc]
        finally:
            _require("remove_directory_tree")(tmp)
        return
    path = fspath(path)
    fmt = _save_format(path, format)
    _require("check_save_options")(fmt, metadata, checksum)
    io = _io if _io is not None else _engine._default_io()
    try:
        with _engine._gc_paused():
            if fmt == "safetensors":
                _save_safetensors(state_dict, path, dict(metadata or {}), checksum, io)
            else:
                _save_torch(state_dict, path, checksum, io)
    except OSError as e:  # naming `path` as given (a failure on the hidden temporary file too)
        raise _require("save_error")(e, path) from e


def _check_torch_save_options(pickle_module: Any, pickle_protocol: Any, zip_format: Any) -> None:
    """``torch.save``'s options as :func:`save` takes them; ValueError for what it cannot
    write."""
    if pickle_module is not None and pickle_module is not pickle:
        raise ValueError(
            "tensortier.save pickles as torch.save does with the standard pickle module, not "
            f"{getattr(pickle_module, '__name__', pickle_module)!r}: leave pickle_module unset")
    if (not isinstance(pickle_protocol, int) or isinstance(pickle_protocol, bool)
            or not 2 <= pickle_protocol <= pickle.HIGHEST_PROTOCOL):
        raise ValueError(f"pickle_protocol must be an int from 2 to {pickle.HIGHEST_PROTOCOL} "
                         f"(torch.save's default is 2), not {pickle_protocol!r}")
    if not zip_format:
        raise ValueError("tensortier.save writes torch's zip format only: "
                         "_use_new_zipfile_serialization=False asks for the legacy one")
