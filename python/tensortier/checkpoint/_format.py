"""Checkpoint facts: alignment, metadata keys, batching settings, dtype packing, format detection
(their rules live in C++: include/tensortier/checkpoint/checkpoint_format.hpp, torch_pickle.hpp), and the
lazy torch and _core lookups every module uses."""

from __future__ import annotations

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
# O_DIRECT with no bounce copy the alignment rules would force); smaller ones are torch.empty.
_ALIGNED_ALLOC_MIN = 1 << 20


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
