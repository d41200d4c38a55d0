"""Checkpoints: save and load whole state dicts as safetensors or ``torch.save`` files (the
guide: docs/checkpoints.md).

One module per concept: ``_format`` (constants, settings, format detection), ``_engine`` (the
process's engine), ``_files`` (file objects, the file a descriptor names), ``_dtype``
(conversion to a dtype), ``mapping`` (allocation, tensor bytes, memory maps, devices and
placement), ``_writing`` and ``_reading`` (engine I/O, the progress bar), ``safetensors``,
``unpickler`` (torch.save zips read without torch.load), ``torch_save``, and ``saving``,
``loading`` (with shard indexes: a load's way down to the format's module) and ``loading_into``
(the public functions). Module-level settings (``_GROUP_BYTES``...) are read from their owning
module at each use; tests reach private names through their modules.
"""

from __future__ import annotations

from .loading import load
from .loading_into import IncompatibleKeys, StateDictMismatchError, load_into
from .saving import save
from .unpickler import WeightsOnlyUnpicklingError

# Constants of the file formats (their values live in C++, include/tensortier/checkpoint/safetensors.hpp).
from ._format import ALIGNMENT, CHECKSUM_KEY, HEADER_CHECKSUM_KEY  # noqa: F401
from ._format import DamagedCheckpointError, EmptyCheckpointError, UnavailableDeviceError

__all__ = [
    "DamagedCheckpointError",
    "EmptyCheckpointError",
    "IncompatibleKeys",
    "StateDictMismatchError",
    "UnavailableDeviceError",
    "WeightsOnlyUnpicklingError",
    "load",
    "load_into",
    "save",
]
