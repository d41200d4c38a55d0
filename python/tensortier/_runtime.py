"""What the checkpoint package and ``tensortier.dcp`` share: the process's engine and the one
Python-side mapping between torch dtypes and tensortier's dtype names (whose table lives in C++,
include/tensortier/checkpoint/dtypes.hpp)."""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import threading
from collections.abc import Iterator
from typing import Any

from . import _core
from .io import IOHandle

_default_lock = threading.Lock()
_default: tuple[int, IOHandle] | None = None


def default_io() -> IOHandle:
    """One engine per process, made on first use (again after a fork: threads do not survive)."""
    global _default
    with _default_lock:
        if _default is None or _default[0] != os.getpid():
            _default = (os.getpid(), IOHandle())
        return _default[1]


@functools.lru_cache(maxsize=None)
def torch_dtypes() -> dict[str, Any]:
    """tensortier dtype name -> torch.dtype, for every row of the C++ dtype table this torch
    has."""
    try:
        import torch
    except ImportError as e:  # pragma: no cover - torch is a dependency of these modules
        raise ImportError("tensortier checkpoints need PyTorch: pip install torch") from e
    rows = getattr(_core, "dtypes", None)
    if rows is None:
        raise ImportError("tensortier._core has no dtypes(): the C++ extension is older than "
                          "this Python package; reinstall tensortier")
    out: dict[str, Any] = {}
    for row in rows():
        dt = getattr(torch, row["torch"], None) if row["torch"] else None
        if isinstance(dt, torch.dtype):
            out[row["name"]] = dt
    return out


@functools.lru_cache(maxsize=None)
def dtype_names() -> dict[Any, str]:
    """torch.dtype -> tensortier dtype name: the inverse of ``torch_dtypes``."""
    return {dt: name for name, dt in torch_dtypes().items()}


@functools.lru_cache(maxsize=None)
def quantized_dtypes() -> frozenset[Any]:
    """The torch dtypes the C++ table marks quantized (qint8, quint4x2...): tensors whose
    storage holds more than their values (scales, zero points), which no dtype name stores."""
    dtypes = torch_dtypes()
    return frozenset(dtypes[row["name"]] for row in _core.dtypes()
                     if row["quantized"] and row["name"] in dtypes)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collection paused while the block runs (as it was after). For
    blocks that make an object or more per tensor of a state dict: with tens of thousands of
    tensors, the collections those allocations start walk every live object again and again
    (half the time of a DCP save's own work on 20,000 small tensors). Only on the main thread:
    the switch is process-wide, and from a background thread (an async save) it could undo a
    ``gc.disable()`` the training loop makes meanwhile."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
