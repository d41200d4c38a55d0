"""Saving torch.save files: the object is pickled as torch.save pickles it (a plain dict of CPU
tensors by C++, anything else by Python's pickler with torch's persistent ids), then one C++
writer (``TorchFileWriter``) writes the records, the storages' bytes and their CRC-32s through
the engine."""

from __future__ import annotations

import io as _io
import pickle
from typing import Any

from ..io import IOHandle
from . import _format
from ._format import _dtype_names, _require, _torch, _unsavable, PathLike
from ._writing import _DurableFile


def _pickled(obj: Any) -> tuple[bytes, list[Any]]:
    """The data.pkl torch.save writes for `obj` (``torch.serialization._save``'s rules), and the
    untyped storages its persistent ids name "0", "1"... in that order."""
    torch = _torch()
    serialization = torch.serialization
    storages: list[Any] = []
    keys: dict[int, str] = {}
    dtypes: dict[int, Any] = {}

    class Pickler(pickle.Pickler):
        def persistent_id(self, o: Any) -> Any:
            if isinstance(o, torch.storage.TypedStorage):
                storage, dtype = o._untyped_storage, o.dtype
                storage_type = getattr(torch, o._pickle_storage_type())
                numel = o._size()
            elif torch.is_storage(o):
                storage, dtype = o, torch.uint8
                storage_type = serialization.normalize_storage_type(type(o))
                numel = storage.nbytes()
            else:
                return None
            if str(storage.device) != "meta" and storage.data_ptr() != 0:
                if dtypes.setdefault(storage.data_ptr(), dtype) != dtype:
                    raise RuntimeError("Cannot save multiple tensors or storages that view the "
                                       "same data as different types")
            key = keys.get(storage._cdata)
            if key is None:
                key = keys[storage._cdata] = str(len(storages))
                storages.append(storage)
            fake = getattr(o, "_fake_device", None)
            location = str(fake) if fake is not None else serialization.location_tag(storage)
            return ("storage", storage_type, key, location, numel)

    buf = _io.BytesIO()
    Pickler(buf, protocol=serialization.DEFAULT_PROTOCOL).dump(obj)
    return buf.getvalue(), storages


def _plain_dict_writer(obj: Any, crc32: bool) -> tuple[Any, list[int]] | None:
    """A C++ writer of `obj` and its tensors' addresses when `obj` is a plain dict: str -> plain
    contiguous CPU ``torch.Tensor``s, each alone in a storage of exactly its bytes (C++ writes
    its pickle then). None for anything else."""
    if type(obj) is not dict or not obj:
        return None
    torch = _torch()
    tensor_type, strided = torch.Tensor, torch.strided
    dtype_names = _dtype_names()
    rows: list[tuple[Any, ...]] = []  # (name, dtype, shape, strides, nbytes, storage)
    addresses: list[int] = []
    for k, v in obj.items():
        if type(k) is not str or type(v) is not tensor_type or v.is_nested:
            return None  # a nested tensor has no sizes to ask (torch pickles it)
        if not k.isascii():
            try:
                k.encode("utf-8")
            except UnicodeEncodeError:
                return None  # a lone surrogate: torch's pickler writes it, C++ takes UTF-8
        dt = dtype_names.get(v.dtype)
        if (dt is None or v.is_quantized or not v.is_cpu or v.layout is not strided
                or v.requires_grad or v.is_conj() or v.is_neg() or v.__dict__):
            return None
        n = v.nbytes
        storage = v.untyped_storage()
        if v.storage_offset() != 0 or not v.is_contiguous() or storage.nbytes() != n:
            return None
        address = v.data_ptr()
        # C++ refuses one storage twice (torch.save shares it; an empty one's address tells
        # nothing: its object's is passed) and checks a size-1 dimension's stride.
        rows.append((k, dt, v.shape, v.stride(), n, address if n else storage._cdata))
        addresses.append(address)
    try:  # C++ refuses what only torch's pickler writes (names that are not UTF-8...)
        return _require("TorchFileWriter")(*zip(*rows), crc32), addresses
    except (ValueError, UnicodeEncodeError):
        return None


def _save_torch(obj: Any, path: PathLike, checksum: bool, io: IOHandle) -> None:
    torch = _torch()
    # Whether torch.save would write CRC-32s now (``set_crc32_options``, torch >= 2.6).
    writes_crcs = getattr(torch.serialization, "get_crc32_options", lambda: True)
    crc32 = checksum or bool(writes_crcs())
    plain = _plain_dict_writer(obj, crc32)
    storages: list[Any] = []
    if plain is not None:
        writer, addresses = plain
    else:
        try:
            data, storages = _pickled(obj)
        except (RuntimeError, pickle.PicklingError, AttributeError) as e:
            raise _unsavable(e, f"torch.save cannot save this object: {e}") from e
        writer = _require("TorchFileWriter")(data, [s.nbytes() for s in storages], crc32)
        addresses = [s.data_ptr() if s.device.type == "cpu" else None for s in storages]
    engine = io._core()  # noqa: SLF001 - same package
    with _DurableFile(path, io) as df:
        if all(s.device.type == "cpu" for s in storages):
            writer.write(engine, df, addresses)
            # Committed in a call of its own: Ctrl-C during the write (raised once it returns)
            # then leaves the old checkpoint, and the save reports the failure it is.
            df.commit()
            return

        def host(i: int) -> Any:  # a copy in host memory, about _STAGING_BYTES of them at once
            if storages[i].device.type == "meta":
                raise ValueError("meta tensors have no data to save")
            return storages[i].cpu()

        writer.write_staged(engine, df, addresses, host, _format._STAGING_BYTES)
        df.commit()
