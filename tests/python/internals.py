"""The checkpoint package's private names the tests reach, each imported from the module that
owns it (the package itself exports only its public API)."""

from __future__ import annotations

from tensortier.checkpoint._dtype import _convert, _convert_in_place  # noqa: F401
from tensortier.checkpoint._engine import _default_io  # noqa: F401
from tensortier.checkpoint._format import _sniff, ALIGNMENT, CHECKSUM_KEY  # noqa: F401
from tensortier.checkpoint._format import HEADER_CHECKSUM_KEY  # noqa: F401
from tensortier.checkpoint._progress import _Progress  # noqa: F401
from tensortier.checkpoint._tensor_bytes import _xxh64  # noqa: F401
from tensortier.checkpoint._reading import (  # noqa: F401
    _Piece,
    _pinned_buffer,
    _read_batched,
    _read_device_checked,
    _read_pieces,
)
from tensortier.checkpoint._writing import _DurableFile, _wait_for_replaced_files  # noqa: F401
from tensortier.checkpoint.loading_into import _staged_groups  # noqa: F401
from tensortier.checkpoint.mapping import (  # noqa: F401
    _available_memory,
    _host_alloc,
    _map_file,
    _Readahead,
    _target_device,
)
from tensortier.checkpoint.safetensors import _parse_checksums, _read_st_header  # noqa: F401
from tensortier.checkpoint.unpickler import (  # noqa: F401
    _swap_bytes,
    _torch_records,
    _unpickle_torch,
    _zip_records,
)
