"""Tensor bytes as flat uint8 tensors, and their checksums (computed in C++)."""

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

