"""What every save and load runs with: the process's engine, and Python's cyclic collector
held off meanwhile."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

from .._runtime import default_io as _default_io  # noqa: F401  (the checkpoint modules' name)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Python's cyclic collector held off for a save or load: tens of thousands of small
    tensors would set off full collections of the whole process in its middle (twice the time
    of a 20,000-tensor load)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
