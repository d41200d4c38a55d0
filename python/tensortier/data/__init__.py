"""Training-data reading: batches of many small files (ImageNet-style), shuffled and sharded as
NVIDIA DALI's ``fn.readers.file`` does, for PyTorch and DALI, and extent maps for reading a data
set's files straight from the block device (the guide's "The training-data reader" page)."""

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
