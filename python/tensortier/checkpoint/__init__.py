"""Checkpoints: save and load whole state dicts as safetensors or ``torch.save`` files.

::

    tensortier.save(model.state_dict(), "model.safetensors")         # or "ckpt.pt" / format="torch"
    sd = tensortier.load("model.safetensors")                        # also .pt and HF index.json
    tensortier.load_into(model, "model.safetensors")                 # into the existing tensors

Files are written in formats the ecosystem already reads:

- **safetensors**: a valid file for the ``safetensors`` package, whose header is padded with spaces
  so that the data starts on a 4 KiB boundary. Tensors whose size is a multiple of 4 KiB come
  first, so they start on 4 KiB boundaries as well (the format allows no gaps between tensors).
- **torch**: a ``torch.load(path, weights_only=True)`` file. The object is pickled as
  ``torch.save`` pickles it (Python's pickler with torch's persistent ids; a plain dict of CPU
  tensors by C++, byte for byte the same), and one C++ writer writes the zip records, each
  storage 4 KiB aligned, with their CRC-32s.

Tensor bytes always move through the I/O engine (O_DIRECT where the filesystem allows it, large
transfers split over its workers, with the GIL released), never through Python file objects.

Writes are durable: the file is written under a temporary name in the same directory
(``.<name>.tmp-<pid>-<start time>-<tag>-<random>``), flushed with ``fdatasync``, renamed over the
final name and the directory is fsynced. On any error the temporary file is removed and an
existing file under the final name is left untouched; the temporary files of saves into the same
path that were killed (their process no longer runs) are removed by the next save. The replaced
file's mode, owner and group are kept; a file the caller may not write is not replaced (as
``torch.save`` refuses it). These rules live in C++ (include/tensortier/checkpoint/checkpoint_file.hpp),
shared with the ``tensortier`` CLI.

Checksums (``save(..., checksum=True)``, checked by ``load(..., verify=True)``):

- safetensors: the xxHash64 of each tensor's bytes, in the header's ``__metadata__`` under
  ``tensortier.xxh64`` as a JSON object string ``{name: "<16 hex digits>"}`` (what
  ``tensortier verify`` reads).
- torch: the zip format's own CRC-32 of each storage record. Like ``torch.save``, ``save``
  writes these always (so ``unzip -t`` and Python's ``zipfile`` accept the file), unless
  ``torch.serialization.set_crc32_options(False)`` turned them off, which ``checksum=True``
  overrides. ``verify=True`` also checks plain ``torch.save`` files.

The package holds one module per concept: ``_format`` (constants, settings, dtype shapes,
format detection), ``_engine`` (the process's engine), ``_files`` (file objects, the file a
descriptor names), ``_dtype`` (conversion to a dtype), ``_tensor_bytes`` (tensor bytes and their
checksums), ``mapping`` (allocation, memory maps, devices and placement), ``_writing`` and
``_reading`` (engine I/O), ``_progress``,
``safetensors``, ``unpickler`` (torch.save zips read without torch.load), ``torch_save``,
``index`` (shard indexes; a load's way down to the format's module), and ``saving``,
``loading`` and ``loading_into`` (the public functions).
Module-level settings (``_GROUP_BYTES``...) are read from their owning module at each use.
The package exports its public API only; tests reach private names through their modules.
"""

from __future__ import annotations

from .loading import load
from .loading_into import IncompatibleKeys, StateDictMismatchError, load_into
from .saving import save
from .unpickler import WeightsOnlyUnpicklingError

# Constants of the file formats (their values live in C++, include/tensortier/checkpoint/safetensors.hpp).
from ._format import ALIGNMENT, CHECKSUM_KEY, HEADER_CHECKSUM_KEY  # noqa: F401

__all__ = [
    "IncompatibleKeys",
    "StateDictMismatchError",
    "WeightsOnlyUnpicklingError",
    "load",
    "load_into",
    "save",
]
