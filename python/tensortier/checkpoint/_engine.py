"""What every save and load runs with: the process's engine, and Python's cyclic collector
held off meanwhile (tens of thousands of small tensors would set off full collections of the
whole process in its middle: twice the time of a 20,000-tensor load)."""

from .._runtime import default_io as _default_io  # noqa: F401  (the checkpoint modules' name)
from .._runtime import gc_paused as _gc_paused  # noqa: F401
