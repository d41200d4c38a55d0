"""Tensor bytes as flat uint8 tensors, their checksums (computed in C++), and the error a
mismatch raises."""

from __future__ import annotations

from typing import Any

from ._format import _require, _torch


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size()


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


def _checksum_mismatch(path: str, name: str, kind: str, stored: int, actual: int) -> ValueError:
    """`name`: the tensor (xxh64, per tensor) or the zip record of a storage (crc32)."""
    what, width = ("record", 8) if kind == "crc32" else ("tensor", 16)
    return ValueError(
        f"{path}: checksum mismatch in {what} {name!r}: stored {kind} {stored:0{width}x}, data "
        f"has {actual:0{width}x}: the file is corrupt"
    )
