"""TensorNVMe's Python API: ``from tensortier.compat.tensornvme import DiskOffloader``.

Code written for ``tensornvme`` runs with only its import changed.
"""

from __future__ import annotations

import tempfile

from .. import _core
from ..offload import DiskOffloader

__all__ = ["DiskOffloader", "get_backends"]

_TENSORNVME_NAMES = {"io_uring": "uring", "libaio": "aio", "threads": "pthread"}


def get_backends() -> set[str]:
    """The backends that work on this machine, by TensorNVMe's names (``uring``, ``aio``,
    ``pthread``); each is verified with a round trip in the temporary directory."""
    return {
        _TENSORNVME_NAMES[p["backend"]]
        for p in _core.probe_backends(tempfile.gettempdir())
        if p["available"] and (p["direct_ok"] or p["buffered_ok"])
    }
