"""Checkpoint facts: alignment, metadata keys, batching settings, dtype packing, format detection
(their rules live in C++: include/tensortier/checkpoint/checkpoint_format.hpp, torch_pickle.hpp), and the
lazy torch and _core lookups every module uses."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, TypeVar

from .. import _core
from .._runtime import dtype_names as _dtype_names, torch_dtypes as _torch_dtypes  # noqa: F401
from .._runtime import quantized_dtypes as _quantized_dtypes  # noqa: F401
from .._paths import PathArg


PathLike = PathArg

_T = TypeVar("_T")


# The data alignment of the files tensortier writes (include/tensortier/checkpoint/checkpoint_pipeline.hpp).
ALIGNMENT = int(_core.CHECKPOINT_ALIGNMENT)

# Metadata keys of the safetensors checksums: per-tensor xxh64s, and the xxh64 of what the header
# says (SafetensorsHeaderDigest in include/tensortier/checkpoint/safetensors.hpp).
CHECKSUM_KEY = str(_core.TENSOR_CHECKSUMS_KEY)
HEADER_CHECKSUM_KEY = str(_core.HEADER_CHECKSUM_KEY)

# Reads are submitted in groups of about this many bytes: progress, checksums and device copies
# of one group overlap the reads of the next ones (the engine bounds what is really in flight).
# The pipeline's one setting (kCheckpointGroupBytes), the CLI's reads too.
_GROUP_BYTES = int(_core.CHECKPOINT_GROUP_BYTES)

# Copies made to write non-contiguous or GPU tensors: at most this many bytes are alive at once.
_STAGING_BYTES = int(_core.CHECKPOINT_STAGING_BYTES)

# Loaded tensors at least this large are placed at their file offset modulo the page size (read
# O_DIRECT with no bounce copy the alignment rules would force); smaller ones are torch.empty
# and read gathered.
_ALIGNED_ALLOC_MIN = int(_core.CHECKPOINT_GATHER_BELOW)


def _torch() -> Any:
    try:
        import torch
    except ImportError as e:  # pragma: no cover - torch is a dependency of this module
        raise ImportError("tensortier checkpoints need PyTorch: pip install torch") from e
    return torch


def _require(name: str) -> Callable[..., Any]:
    fn = getattr(_core, name, None)
    if fn is None:
        raise ImportError(
            f"tensortier._core has no {name}(): the C++ extension is older than this Python "
            "package; reinstall tensortier"
        )
    return fn


# 'safetensors', 'torch' or 'index', from the file's content (a directory, a FIFO or a device is
# refused, never waited on): the rule the CLI follows.
_sniff = _require("detect_checkpoint_kind")


# The format a save writes: `format` when given, else the one the path's suffix names.
_save_format = _require("save_format")


def _st_dtype_maps() -> tuple[dict[Any, str], dict[str, Any]]:
    """torch.dtype -> safetensors dtype and back, for the C++ table's dtypes safetensors stores."""
    dtypes = _torch_dtypes()
    to_st: dict[Any, str] = {}
    from_st: dict[str, Any] = {}
    for row in _require("dtypes")():
        dt = dtypes.get(row["name"])
        if dt is not None and row["safetensors"]:
            to_st[dt] = row["safetensors"]
            from_st[row["safetensors"]] = dt
    return to_st, from_st


class DamagedCheckpointError(_core.FormatError, RuntimeError):  # type: ignore[misc]
    """A torch file ``tensortier.load`` cannot read (truncated, damaged, malformed): a
    ``ValueError``, and the ``RuntimeError`` ``torch.load`` raises for one ("PytorchStreamReader
    failed ..."), so that code catching either catches it."""


class EmptyCheckpointError(_core.FormatError, EOFError):  # type: ignore[misc]
    """An empty file given to ``tensortier.load``: a ``ValueError``, and the ``EOFError``
    ``torch.load`` raises for one."""


class UnavailableDeviceError(ValueError, RuntimeError):
    """A device a load cannot put tensors on (no CUDA, no such GPU, an unsupported type): a
    ``ValueError``, and the ``RuntimeError`` torch.load raises for one."""


@functools.cache
def _unsavable_error(base: type[Exception]) -> type[ValueError]:
    """The error tensortier.save raises for an object pickle cannot save: a ``ValueError``,
    and of `base`, the type torch.save raises for it (``AttributeError`` for a lambda or a
    local class, ``PicklingError``, ``RuntimeError``...), so that code catching either does."""
    if issubclass(base, ValueError):
        return base  # type: ignore[return-value]
    name = f"Unsavable{base.__name__}"
    cls = type(name, (base, ValueError), {
        "__module__": __name__, "__doc__": _unsavable_error.__doc__,
        # Made on first use: another process (a DataLoader or pool worker's parent) rebuilds it
        # from its base rather than looking it up by name.
        "__reduce__": lambda self: (_rebuild_unsavable, (base, str(self))),
    })
    globals()[name] = cls
    return cls


def _rebuild_unsavable(base: type[Exception], message: str) -> ValueError:
    return _unsavable_error(base)(message)


def _unsavable(error: Exception, message: str) -> ValueError:
    """`message` as :func:`_unsavable_error` of `error`'s type (a ValueError where that type
    takes more than a message)."""
    try:
        return _unsavable_error(type(error))(message)
    except TypeError:
        return ValueError(message)


@functools.cache
def _damaged_safetensors_error() -> type[ValueError]:
    """A safetensors file that cannot be read: a ``ValueError``, and the ``SafetensorError``
    ``safetensors`` (and transformers' reading) raises for one, where safetensors is installed."""
    try:
        from safetensors import SafetensorError
    except ImportError:
        return _core.FormatError  # type: ignore[no-any-return]
    cls = type("DamagedSafetensorsError", (_core.FormatError, SafetensorError),
               {"__module__": __name__, "__doc__": _damaged_safetensors_error.__doc__})
    globals()["DamagedSafetensorsError"] = cls  # pickled by name, as exceptions are
    return cls


def _as_damaged(error: ValueError, path: str, kind: str | None) -> ValueError:
    """`error` (a ``FormatError`` reading `path`, a file of `kind`: ``"safetensors"``,
    ``"torch"``, None where it could not be told) as the type torch or safetensors raises for
    such a file, with its message and traceback."""
    # A file named .safetensors is one its caller reads as safetensors would (even where its
    # bytes turned out to be something else): safetensors' error type then, empty or not.
    named = os.path.basename(path).lower().endswith(".safetensors")
    if not isinstance(error, _core.FormatError) or (type(error) is not _core.FormatError
                                                    and not named):
        return error  # a subtype already (UnsupportedFormatError), or not the file's fault
    try:
        empty = os.path.getsize(path) == 0
    except OSError:
        empty = False
    cls: type[ValueError] = (_damaged_safetensors_error() if kind == "safetensors" or named
                             else EmptyCheckpointError if empty
                             else DamagedCheckpointError)
    return cls(*error.args).with_traceback(error.__traceback__)


def __getattr__(name: str) -> Any:
    # The class is made on first use (it imports safetensors): a process unpickling one (a
    # worker's error) finds it by name here.
    if name == "DamagedSafetensorsError":
        return _damaged_safetensors_error()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
