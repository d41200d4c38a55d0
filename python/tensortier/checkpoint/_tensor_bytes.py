"""Tensor bytes as flat uint8 tensors."""

from __future__ import annotations

from typing import Any

from ._format import _torch


def _as_bytes(t: Any) -> Any:
    """A flat uint8 view of a contiguous tensor's bytes."""
    torch = _torch()
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=flat.device)
    return flat.view(torch.uint8)


def _storage_bytes(storage: Any) -> Any:
    """A flat uint8 tensor over a whole UntypedStorage."""
    torch = _torch()
    t = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return t.set_(storage, 0, (storage.nbytes(),), (1,))
