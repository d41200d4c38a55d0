"""Saving torch.save files. A plain dict of CPU tensors is written by C++ (TorchFileWriter: the
pickle torch.save writes for it, the records, the storages gathered into large writes); anything
else is pickled by torch (skip_data), the engine writes the storages at their record offsets,
and their CRC-32s are patched in."""

from __future__ import annotations

import functools
import os
import pickle
from typing import Any

from ..io import IOHandle
from . import unpickler
from ._tensor_bytes import _crc32, _storage_bytes
from ._format import _require, _torch, _torch_dtypes, ALIGNMENT, PathLike
from ._writing import _DurableFile, _Writer
from .unpickler import _ZipRecord


class _NullSink:
    def write(self, data: bytes) -> int:
        return len(data)


def _storages_in_save_order(obj: Any) -> list[Any]:
    """The storages ``torch.save(obj)`` writes, in the order of their keys ("0", "1", ...).

    torch's ``_save`` numbers storages in the order its pickler meets them; pickling the same
    object again with the same protocol meets them in the same order."""
    torch = _torch()
    seen: dict[int, int] = {}
    storages: list[Any] = []

    class Recorder(pickle.Pickler):
        def persistent_id(self, o: Any) -> Any:
            if isinstance(o, torch.storage.TypedStorage) or torch.is_storage(o):
                storage = o._untyped_storage if isinstance(o, torch.storage.TypedStorage) else o
                if storage._cdata not in seen:
                    seen[storage._cdata] = len(storages)
                    storages.append(storage)
                return ("storage", seen[storage._cdata])
            return None

    with torch.serialization.skip_data():
        Recorder(_NullSink(), protocol=torch.serialization.DEFAULT_PROTOCOL).dump(obj)
    return storages


def _torch_writes_crcs(torch: Any) -> bool:
    """Whether torch.save would write CRC-32s now (``set_crc32_options``, torch >= 2.6)."""
    get = getattr(torch.serialization, "get_crc32_options", None)
    return bool(get()) if get is not None else True


def _save_torch_config(checksum: bool) -> dict[str, Any]:
    """torch.save settings for our saves: storages 4 KiB aligned; with `checksum`, CRC-32s for
    every record even where set_crc32_options(False) said not to. (torch's config patches are
    per thread: saves on other threads, ours or torch.save's, keep their own settings.)"""
    from torch.utils.serialization import config as ser_config

    patch: dict[str, Any] = {"save.storage_alignment": ALIGNMENT}
    if checksum and hasattr(ser_config.save, "compute_crc32"):  # torch >= 2.6
        patch["save.compute_crc32"] = True
    return patch


def _save_torch_whole(obj: Any, path: PathLike, checksum: bool, io: IOHandle) -> None:
    """What torch cannot pickle without its data (quantized and nested tensors refuse
    ``skip_data``): written by torch.save itself, data and all, with the same durability (a
    temporary file, fsync, rename). Slower: torch's single-threaded buffered writes."""
    torch = _torch()
    from torch.utils.serialization import config as ser_config

    with _DurableFile(path, io) as df:
        with open(df.tmp, "r+b") as f:
            try:
                with ser_config.patch(_save_torch_config(checksum)):
                    torch.save(obj, f)
            except (RuntimeError, pickle.PicklingError, AttributeError) as e:
                raise ValueError(f"torch.save cannot save this object: {e}") from e
        df.commit()


@functools.lru_cache(maxsize=None)
def _plain_dtype_names() -> dict[Any, str]:
    """torch.dtype -> the dtype table's name, for the dtypes torch pickles as plain tensors (not
    quantized ones; C++ refuses the others it cannot write)."""
    quantized = {row["name"] for row in _require("dtypes")() if row["quantized"]}
    return {dt: name for name, dt in _torch_dtypes().items() if name not in quantized}


def _plain_dict_writer(obj: Any, crc32: bool) -> tuple[Any, list[int]] | None:
    """A C++ writer of `obj` and its tensors' addresses when `obj` is what torch.save pickles as a
    plain dict: a ``dict`` of str -> CPU tensors of type ``torch.Tensor`` (no Parameters or
    subclasses, no requires_grad, no Python attributes, no conjugate or negative bit), each
    contiguous and alone in a storage of exactly its bytes. None for anything else (torch
    pickles it)."""
    if type(obj) is not dict or not obj:
        return None
    torch = _torch()
    tensor_type, strided = torch.Tensor, torch.strided
    dtype_names = _plain_dtype_names()
    names: list[str] = []
    dtypes: list[str] = []
    shapes: list[Any] = []
    strides: list[Any] = []
    sizes: list[int] = []
    addresses: list[int] = []
    empty: set[int] = set()  # the storages of empty tensors (their addresses tell nothing)
    for k, v in obj.items():
        if type(k) is not str or type(v) is not tensor_type or v.is_nested:
            return None  # a nested tensor has no sizes to ask (torch pickles it)
        dt = dtype_names.get(v.dtype)
        if (dt is None or not v.is_cpu or v.layout is not strided or v.requires_grad
                or v.is_conj() or v.is_neg() or v.__dict__):
            return None
        n = v.nbytes
        storage = v.untyped_storage()
        if v.storage_offset() != 0 or not v.is_contiguous() or storage.nbytes() != n:
            return None
        if n == 0:
            if storage._cdata in empty:
                return None
            empty.add(storage._cdata)
        names.append(k)
        dtypes.append(dt)
        shapes.append(v.shape)
        strides.append(v.stride())  # a size-1 dimension's may be anything: C++ checks them
        sizes.append(n)
        addresses.append(v.data_ptr())
    nonempty = [a for a, n in zip(addresses, sizes) if n]
    if len(set(nonempty)) != len(nonempty):  # one storage twice: torch.save shares it
        return None
    try:
        return _require("TorchFileWriter")(names, dtypes, shapes, strides, sizes, crc32), addresses
    except (ValueError, UnicodeEncodeError):  # what only torch's pickler writes
        return None


def _save_torch(obj: Any, path: PathLike, checksum: bool, io: IOHandle) -> None:
    torch = _torch()
    plain = _plain_dict_writer(obj, checksum or _torch_writes_crcs(torch))
    if plain is not None:
        writer, addresses = plain
        with _DurableFile(path, io) as df:
            writer.write(io._core(), df._core, addresses)  # noqa: SLF001 - same package
            df.commit()
        return
    if not hasattr(torch.serialization, "skip_data"):
        raise ValueError(
            f"format='torch' needs torch.serialization.skip_data (PyTorch >= 2.5); this is "
            f"{torch.__version__}: use format='safetensors'"
        )
    from torch.utils.serialization import config as ser_config

    try:
        storages = _storages_in_save_order(obj)
    except (RuntimeError, pickle.PicklingError, AttributeError) as e:
        if "skip_data" in str(e):  # quantized and nested tensors: torch writes them itself
            _save_torch_whole(obj, path, checksum, io)
            return
        raise ValueError(f"torch.save cannot save this object: {e}") from e
    with _DurableFile(path, io) as df:
        with open(df.tmp, "r+b") as f:  # torch writes the metadata records and leaves holes
            try:
                with ser_config.patch(_save_torch_config(checksum)):
                    with torch.serialization.skip_data():
                        torch.save(obj, f)
            except (RuntimeError, pickle.PicklingError, AttributeError) as e:
                raise ValueError(f"torch.save cannot save this object: {e}") from e
        records, prefix = unpickler._torch_records(df.tmp)
        data_names = [n for n in records if n.startswith(prefix + "data/")]
        if len(data_names) != len(storages):
            raise RuntimeError(
                f"tensortier found {len(storages)} storages, torch.save wrote {len(data_names)}"
            )
        places: list[tuple[Any, _ZipRecord]] = []
        for key, storage in enumerate(storages):
            rec = records.get(f"{prefix}data/{key}")
            if rec is None or rec.size != storage.nbytes():
                raise RuntimeError(f"torch.save wrote storage {key} differently than expected")
            places.append((storage, rec))
        file_size = os.path.getsize(df.tmp)
        df.reserve(file_size)
        writer = _Writer(io, df.open())
        # torch.save writes every record's CRC-32 unless set_crc32_options(False) said not to;
        # zip tools reject a record whose CRC does not match (skip_data leaves zeros).
        with_crcs = checksum or _torch_writes_crcs(torch)
        crcs: dict[str, int] = {}
        try:
            for key, (storage, rec) in enumerate(places):
                data = _storage_bytes(storage)
                staged = data.device.type != "cpu"
                if staged:
                    data = data.to("cpu")
                writer.add(data, rec.offset, staged)
                if with_crcs:  # while the engine writes the groups before this one
                    crcs[f"{prefix}data/{key}"] = _crc32(data)
            writer.finish()
        except BaseException:
            writer.drain()
            raise
        if crcs:
            # Hundreds of 4-byte patches into pages torch wrote through the page cache (the
            # engine's writes, all complete, covered only the records' data): one batch through
            # the engine, flushed by commit's fdatasync like the rest.
            patches = [(bytearray(packed), df.open(), offset)
                       for offset, packed in _require("zip_crc_patches")(df.tmp, crcs)]
            if patches:
                io.pwrite_batch_async(patches).wait()
        df.commit()
