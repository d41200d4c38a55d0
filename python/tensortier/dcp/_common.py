"""What the DCP Writer, Reader and planners share: the layout's constants, the checkpoint
directory's naming, and the weights_only unpickler of ``.metadata``."""

from __future__ import annotations

import importlib
import io
import os
import pathlib
import pickle
from typing import Any

import torch
from torch.futures import Future

from .. import _core

# The key of the one WriteResult each rank's write_data returns.
_RANK_WRITES = "tensortier: the rank's items"
_VERSION = "1.0.0"  # DCP's CURRENT_DCP_VERSION for this layout
# StorageMeta.tensortier_format: tensortier's own format, a Reader refuses a newer one.
_FORMAT: int = _core.dcp_format


def _extent(tensor: Any) -> int:
    """The bytes from `tensor`'s first element to past its last, views included."""
    if tensor.numel() == 0:
        return 0
    last = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))
    return (last + 1) * tensor.element_size()


def _directory(path: str | os.PathLike[str]) -> str:
    """The checkpoint directory `path` names: "" is the current one, as for pathlib.Path (and
    stock DCP's FileSystemWriter/Reader)."""
    return os.fspath(path) or "."


def _done(value: Any) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(value)
    return fut


class _CheckpointDirectory:
    """``path`` and ``checkpoint_id`` as torch's ``FileSystemWriter`` and ``FileSystemReader``
    have them: ``pathlib.Path``s of the checkpoint directory."""

    _dir: str  # what the C++ calls take

    @property
    def path(self) -> pathlib.Path:
        """The checkpoint directory."""
        return pathlib.Path(self._dir)

    @path.setter
    def path(self, value: str | os.PathLike[str]) -> None:
        self._dir = _directory(value)

    @property
    def checkpoint_id(self) -> pathlib.Path:
        """The checkpoint directory (DCP's ``checkpoint_id``)."""
        return self.path


class _MetadataUnpickler(pickle.Unpickler):
    """The weights_only rule for DCP metadata (torch's own weights_only unpickler reads only
    protocol 2, and DCP pickles its metadata with protocol 4)."""

    def find_class(self, module: str, name: str) -> Any:
        if _core.dcp_metadata_global_allowed(module, name):  # the CLI's reader's rule
            if module == "pathlib._local":  # where Python 3.13 and later keep pathlib's classes
                module = "pathlib"
            value = getattr(importlib.import_module(module), name, None)
            if module != "torch" or value is torch.Size or isinstance(
                    value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not allowed in DCP metadata")


def _unpickle_metadata(data: bytes, path: str) -> Any:
    """The object the ``.metadata`` bytes `data` (of `path`) pickle, by the weights_only rule;
    ValueError naming `path` for anything else."""
    try:
        return _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as e:
        raise ValueError(f"{path}: not a DCP metadata file this reader accepts ({e})") from e
