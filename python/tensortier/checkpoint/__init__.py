"""Checkpoints: save and load whole state dicts as safetensors or ``torch.save`` files.

::

    tensortier.save(model.state_dict(), "model.safetensors")         # or "ckpt.pt" / format="torch"
    sd = tensortier.load("model.safetensors")                        # also .pt and HF index.json
    tensortier.load_into(model, "model.safetensors")                 # into the existing tensors

Files are written in formats the ecosystem already reads:

- **safetensors**: a valid file for the ``safetensors`` package, whose header is padded with spaces
  so that the data starts on a 4 KiB boundary. Tensors whose size is a multiple of 4 KiB come
  first, so they start on 4 KiB boundaries as well (the format allows no gaps between tensors).
- **torch**: a ``torch.load(path, weights_only=True)`` file. torch's own pickler writes the
  metadata (``torch.serialization.skip_data`` with a storage alignment of 4096), then the engine
  writes the storage bytes at their record offsets.

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
format detection), ``_common`` (engine, devices, dtypes, checksums), ``mapping`` (allocation,
memory maps, placement), ``_writing`` and ``_reading`` (engine I/O), ``_progress``,
``safetensors``, ``unpickler`` (torch.save zips read without torch.load), ``torch_save``,
``index`` (shard indexes), and ``saving``, ``loading`` and ``loading_into`` (the public
functions).
Module-level settings (``_GROUP_BYTES``...) are read from their owning module at each use.
"""

from __future__ import annotations

from .loading import load
from .loading_into import IncompatibleKeys, StateDictMismatchError, load_into
from .saving import save
from .unpickler import WeightsOnlyUnpicklingError

# Names reached through the package (each lives in the module named). Settings such as
# _GROUP_BYTES are not repeated here: they are read from their module at each use.
from ._format import _sniff, ALIGNMENT, CHECKSUM_KEY, HEADER_CHECKSUM_KEY  # noqa: F401
from ._common import _convert, _convert_in_place, _default_io, _target_device, _xxh64  # noqa: F401
from ._progress import _Progress  # noqa: F401
from .mapping import _available_memory, _host_alloc, _map_file, _Readahead  # noqa: F401
from ._writing import _DurableFile, _wait_for_replaced_files, _Writer  # noqa: F401
from ._reading import (# noqa: F401
    _Piece,
    _pinned_buffer,
    _read_batched,
    _read_device_checked,
    _read_pieces,
)
from .unpickler import _swap_bytes, _torch_records, _unpickle_torch, _zip_records  # noqa: F401
from .safetensors import _parse_checksums, _read_st_header, _xxh64_check  # noqa: F401
from .loading_into import _staged_groups  # noqa: F401

__all__ = [
    "IncompatibleKeys",
    "StateDictMismatchError",
    "WeightsOnlyUnpicklingError",
    "load",
    "load_into",
    "save",
]
