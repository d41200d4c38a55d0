"""The checkpoint package's private names the tests reach, each imported from the module that
owns it (the package itself exports only its public API), and helpers only tests use."""

from __future__ import annotations

from typing import Any

from tensortier import _core

from tensortier.checkpoint._dtype import _convert, _convert_in_place  # noqa: F401
from tensortier.checkpoint._engine import _default_io  # noqa: F401
from tensortier.checkpoint._format import _sniff, ALIGNMENT, CHECKSUM_KEY  # noqa: F401
from tensortier.checkpoint._format import HEADER_CHECKSUM_KEY  # noqa: F401
from tensortier.checkpoint._reading import (  # noqa: F401
    _byte_groups,
    _Piece,
    _pinned_buffer,
    _Progress,
    _read_batched,
    _read_device_checked,
    _read_pieces,
)
from tensortier.checkpoint._writing import _DurableFile  # noqa: F401
from tensortier._core import wait_for_replaced_files as _wait_for_replaced_files  # noqa: F401
from tensortier.checkpoint.mapping import (  # noqa: F401
    _available_memory,
    _host_alloc,
    _map_file,
    _Readahead,
    _target_device,
)
from tensortier.checkpoint.safetensors import _parse_checksums, _read_st_header  # noqa: F401
from tensortier.checkpoint.unpickler import (  # noqa: F401
    _records,
    _swap_bytes,
    _torch_records,
    _unpickle_torch,
    _ZipRecord,
)


def _xxh64(t: Any) -> int:
    """xxHash64 of a contiguous CPU tensor's bytes."""
    n = t.numel() * t.element_size()
    return int(_core.xxh64(b"") if n == 0 else _core.xxh64_address(t.data_ptr(), n))


def _zip_records(path: str) -> dict[str, _ZipRecord]:
    """The stored (uncompressed) records of a zip file, by name."""
    return _records(_core.zip_entries(path))
