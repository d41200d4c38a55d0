"""What every save and load runs with: the process's engine, and Python's cyclic collector
held off meanwhile."""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Iterator

from ..io import IOHandle


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector held off for a save or load: one of many small tensors
    makes tens of thousands of objects (tensors, shapes, entries), which would set off full
    collections over every object of the process (torch's own included) in its middle: twice
    the time of a 20,000-tensor load here. It runs again (if it was on) when the block ends."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


_default_lock = threading.Lock()


_default: tuple[int, IOHandle] | None = None


def _default_io() -> IOHandle:
    """One engine per process, made on first use (again after a fork: threads do not survive)."""
    global _default
    with _default_lock:
        if _default is None or _default[0] != os.getpid():
            _default = (os.getpid(), IOHandle())
        return _default[1]
