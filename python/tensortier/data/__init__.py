"""Training-data reading: batches of many small files (ImageNet-style), shuffled and sharded as
NVIDIA DALI's ``fn.readers.file`` does, for PyTorch and DALI, and extent maps for reading a data
set's files straight from the block device.

::

    from tensortier.data import FileReader
    reader = FileReader(file_root="/data/train", batch_size=256, shard_id=rank, num_shards=world)
    for samples, labels in reader:      # one epoch; the next loop reads the next one
        ...                             # samples: list of uint8 tensors, labels: int32 tensor
"""

from __future__ import annotations

from .dali import DaliSource
from .dataset import FileDataset
from .extents import (
    ExtentMap,
    ExtentReader,
    build_extent_map,
    load_extent_map,
    read_files,
    verify_extent_map,
)
from .reader import FileReader

__all__ = [
    "DaliSource",
    "ExtentMap",
    "ExtentReader",
    "FileDataset",
    "FileReader",
    "build_extent_map",
    "load_extent_map",
    "read_files",
    "verify_extent_map",
]
