"""torch.save zip files read without torch.load: the zip records, the restricted unpickler
that places storages, their verification and byte order."""

from __future__ import annotations

import contextlib
import os
import pickle
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .. import _core
from ..io import File, IOHandle
from . import _dtype, _engine, _reading, mapping
from ._files import _same_file
from ._format import _dtype_names, _quantized_dtypes, _require, _torch, _torch_dtypes
from ._reading import _open_checkpoint, _Piece, _Progress
from .mapping import _fixed_size, _mapped_tensor, _Placement, _Readahead, _storage_bytes


@dataclass(frozen=True)
class _ZipRecord:
    name: str  # the whole entry name ("archive/data/0"), as errors name it
    offset: int  # of the record's data
    size: int
    crc32: int
    # Whether the archive records CRC-32s at all (the pipeline's rule, RecordsCrcs in C++):
    # torch.save with set_crc32_options(False) writes 0 for every record.
    archive_has_crcs: bool = True


def _records(entries: Sequence[tuple[str, int, int, int, bool]]) -> dict[str, _ZipRecord]:
    return {name: _ZipRecord(name, int(off), int(size), int(crc), bool(recorded))
            for name, off, size, crc, recorded in entries}


def _big_endian_record(file: File, records: dict[str, _ZipRecord], prefix: str) -> bool:
    """Whether the torch file `file` has open says (its byteorder record) it is big-endian;
    True where that record cannot be read (the caller then keeps its mapping private)."""
    record = records.get(f"{prefix}byteorder")
    if record is None:
        return False
    try:
        return os.pread(file.fileno(), record.size, record.offset) != b"little"
    except OSError:
        return True


def _torch_records(path: str) -> tuple[dict[str, _ZipRecord], str]:
    """The records and archive prefix ("<folder>/") of a torch.save zip, by the CLI's rules."""
    prefix, entries = _require("torch_zip_entries")(path)
    return _records(entries), prefix + "/"


class WeightsOnlyUnpicklingError(pickle.UnpicklingError, ValueError):
    """A torch file's pickle holds what ``torch.load(weights_only=True)`` refuses (a global not
    allowed, an unsupported opcode): a ``pickle.UnpicklingError``, the type ``torch.load``
    raises, so code written for it catches it; also a ``ValueError``, as before."""


class _StorageOverrun(ValueError):
    pass


class _PlacementError(Exception):
    """What `map_location` raised (its cause), carried out of the unpickler unchanged."""


@dataclass
class _StorageRef:
    path: str
    key: str
    record: _ZipRecord
    nbytes: int
    dtype: Any
    storage: Any  # UntypedStorage (cpu, cuda or meta)
    filled: bool = False  # read while unpickling (a rebuild reading data, map_location...)


def _fill_now(ref: _StorageRef, path: str, verify: bool, big_endian: bool, io: IOHandle) -> None:
    """`ref`'s storage filled now (CUDA through host memory), in native order."""
    torch = _torch()
    dest = _storage_bytes(ref.storage)
    host = dest if dest.device.type == "cpu" else torch.empty(ref.nbytes, dtype=torch.uint8)
    with contextlib.closing(_open_checkpoint(io, path)) as file:
        _reading._read_host(io, file, path, [ref.record.name], [ref.record.offset],
                            [ref.nbytes], [host.data_ptr()], _Progress("", 0, False),
                            "crc32" if verify else "none", [ref.record.crc32] if verify else None)
    if host is not dest:
        dest.copy_(host)
    if big_endian:
        _swap_bytes(ref.storage, ref.dtype)
    ref.filled = True


def _unpickle_torch(
    path: str, storage_device: Any, label: str | None = None, verify: bool = False,
    mapped: Any = None, archive: tuple[dict[str, _ZipRecord], str] | None = None,
    placement: _Placement | None = None, io: IOHandle | None = None,
) -> tuple[Any, dict[str, _StorageRef], dict[str, _ZipRecord], str, bool]:
    """data.pkl through torch's weights_only unpickler, storages allocated empty on
    `storage_device` (filled later) or slices of `mapped`. With `verify`, data.pkl's and
    byteorder's CRC-32s are checked too: a flipped bit there changes offsets or values."""
    torch = _torch()
    from torch import _weights_only_unpickler as wou

    records, prefix = archive if archive is not None else _torch_records(path)
    reader = io if io is not None else _engine._default_io()
    # With verify, an archive saved without CRC-32s is refused too (not a corrupt one).
    with contextlib.closing(_open_checkpoint(reader, path)) as file:
        pkl, big_endian, data_dependent = _require("read_torch_pickle")(
            reader._core(), file, path, prefix,  # noqa: SLF001 - same package
            [(n, r.offset, r.size, r.crc32, r.archive_has_crcs) for n, r in records.items()],
            verify)
    eager = mapped is None and data_dependent
    # Mapped storages hold their bytes already; a big-endian one must be swapped before a
    # rebuild reads it, not after the pickle is loaded.
    swap_now = mapped is not None and data_dependent and big_endian

    check_storage = _require("check_torch_storage")
    persistent_id = _require("torch_persistent_id")

    def unpickle(device: Any) -> tuple[Any, dict[str, _StorageRef]]:
        storages: dict[str, _StorageRef] = {}

        def persistent_load(saved_id: Any) -> Any:
            storage_type, key, location, numel = persistent_id(path, saved_id)  # C++: its form
            if storage_type is torch.UntypedStorage:
                dtype = torch.uint8
            else:
                dtype = getattr(storage_type, "dtype", None)
                if not isinstance(dtype, torch.dtype):
                    raise _core.FormatError(
                        f"{path}: storage {key} has an unknown type {storage_type!r}"
                    )
            ref = storages.get(key)
            name = f"{prefix}data/{key}"
            record = records.get(name)
            nbytes = check_storage(  # C++: the record's size, a second description's
                path, name, key, str(dtype), dtype.itemsize, numel,
                None if record is None else record.size,
                None if ref is None else (str(ref.dtype), ref.nbytes))
            if ref is None:
                assert record is not None
                # A tensor set_ past the end of a resizable storage grows it: a few bytes of
                # pickle would allocate any size. CPU storages are fixed-size: torch refuses
                # then (as torch.load does).
                sdev = device
                if placement is not None and device.type != "meta":
                    try:
                        sdev = placement.device_for(str(location))
                    except Exception as e:  # noqa: BLE001 - passed on as raised
                        raise _PlacementError from e
                finished = False  # checked (and swapped) here, not after the unpickling
                if nbytes == 0 and (mapped is not None or sdev.type == "cpu"):
                    storage = mapping._fixed_storage(0, 0)
                elif mapped is not None:
                    # Only the storage is kept: quantized dtypes are mapped as bytes (a quantized
                    # tensor cannot be set_ to a storage), others in their dtype, so that a record
                    # not at a multiple of their size is copied to one that is.
                    quantized = dtype in _quantized_dtypes()
                    storage = _mapped_tensor(
                        mapped, record.offset, nbytes,
                        torch.uint8 if quantized else dtype, (nbytes if quantized else numel,),
                    ).untyped_storage()
                    if storage.resizable():  # a copy (misaligned record)
                        storage = _fixed_size(_storage_bytes(storage)).untyped_storage()
                    if nbytes and (sdev.type != "cpu" or (
                            placement is not None and placement.restore is not None)):
                        # Leaving the mapping (for another device, or map_location's callable):
                        # checked and put in this machine's byte order first, as read storages
                        # are (a big-endian file is mapped privately).
                        if verify:
                            _reading._check_host(label or path, [(record.name, _storage_bytes(
                                storage), ("crc32", record.crc32))])
                        if big_endian:
                            _swap_bytes(storage, dtype)
                        finished = True
                        if sdev.type != "cpu":  # map_location sends it elsewhere: copied there
                            placed = torch.UntypedStorage(nbytes, device=sdev)
                            placed.copy_(storage)
                            storage = placed
                elif sdev.type == "cpu":
                    storage = mapping._fixed_storage(nbytes, record.offset)
                else:
                    storage = torch.UntypedStorage(nbytes, device=sdev)
                ref = _StorageRef(label or path, key, record, nbytes, dtype, storage)
                ref.filled = finished
                restore = placement.restore if placement is not None else None
                if restore is not None and device.type != "meta":
                    # torch.load gives the callable each storage with its bytes, on the CPU
                    if nbytes and mapped is None:
                        _fill_now(ref, path, verify, big_endian, reader)
                    try:
                        ref.storage = placement.restored(ref.storage, str(location))
                    except Exception as e:  # noqa: BLE001 - passed on as raised
                        raise _PlacementError from e
                    ref.filled = True
                elif eager and nbytes and device.type != "meta":
                    _fill_now(ref, path, verify, big_endian, reader)
                elif swap_now and nbytes and not ref.filled:
                    if verify:  # the CRC-32 is of the stored bytes
                        _reading._check_host(ref.path, [(ref.record.name, _storage_bytes(
                            storage), ("crc32", ref.record.crc32))])
                    _swap_bytes(ref.storage, ref.dtype)
                    ref.filled = True
                storages[key] = ref
            return torch.storage.TypedStorage(
                wrap_storage=ref.storage, dtype=dtype, _internal=True
            )

        import io as pyio

        stream = pyio.BytesIO(pkl)
        unpickler = wou.Unpickler(stream, encoding="utf-8")
        unpickler.persistent_load = persistent_load  # type: ignore[method-assign]
        # torch queues every sparse tensor it rebuilds for a check at the end of a load; meta
        # ones (load_into's pass, the check before a GPU load) must not be queued: the check
        # cannot read them.
        sparse_queue = getattr(torch._utils, "_sparse_tensors_to_validate", None)
        queued = len(sparse_queue) if isinstance(sparse_queue, list) else 0
        try:
            obj = unpickler.load()
        except _PlacementError as e:
            raise e.__cause__ from None  # type: ignore[misc]
        except pickle.UnpicklingError as e:
            raise WeightsOnlyUnpicklingError(
                f"{path}: data.pkl holds what torch.load(weights_only=True) refuses (tensortier "
                f"never runs other pickle code): {e}"
            ) from None
        except OSError:
            raise
        except Exception as e:  # noqa: BLE001 - a malformed pickle can fail in many ways
            if isinstance(e, ValueError) and (
                    path in str(e) or (label is not None and label in str(e))):
                raise
            # The unpickler's own (a bad UTF-8 string: UnicodeDecodeError...): where it stopped,
            # the file's damage; or a valid file that a description without the data
            # (load_into's) cannot hold.
            meta = isinstance(e, NotImplementedError) and device.type == "meta"
            message = _require("unpickling_failure")(path, type(e).__name__, str(e), meta, pkl,
                                                     stream.tell())
            raise (ValueError if meta else _core.FormatError)(message) from e
        finally:
            if device.type == "meta" and isinstance(sparse_queue, list):
                del sparse_queue[queued:]
        for key, ref in storages.items():
            # Storages that can grow (meta, CUDA) grew to fit a tensor reaching past their
            # end: its bytes would come from other records, or from nowhere.
            if ref.storage.nbytes() != ref.nbytes:
                raise _StorageOverrun(
                    f"{label or path}: malformed data.pkl: a tensor reaches past the end of "
                    f"storage data/{key} ({ref.nbytes} bytes)"
                )
        return obj, storages

    if mapped is None and (storage_device.type not in ("cpu", "meta") or (
            placement is not None and placement.mapping is not None)):
        # A CUDA storage grows to whatever a tensor set_ past its end asks for before the size
        # check can refuse the file: a few bytes of pickle would allocate any amount of GPU
        # memory. Meta storages grow for free: the same pickle is checked on them first.
        try:
            unpickle(torch.device("meta"))
        except _StorageOverrun:
            raise
        except ValueError:
            pass  # what meta cannot rebuild (quantized tensors): the real pass decides
    obj, storages = unpickle(storage_device)
    return obj, storages, records, prefix, big_endian


def _verify_other_records(
    path: str, file: File, records: Mapping[str, _ZipRecord], prefix: str,
    storages: Iterable[_StorageRef], io: IOHandle,
) -> None:
    """verify=True: the CRC-32 of every record not checked elsewhere, as ``tensortier verify``."""
    checked = {f"{prefix}data/{r.key}" for r in storages}
    checked |= {f"{prefix}data.pkl", f"{prefix}byteorder"}
    _require("check_records")(io._core(), file, path, [  # noqa: SLF001 - same package
        (name, r.offset, r.size, r.crc32) for name, r in records.items() if name not in checked])


def _load_plain_dict(
    path: str, file: File, plain: tuple[list[str], list[str], list[Any], list[int], list[int]],
    progress: bool | None, io: IOHandle,
) -> dict[str, Any]:
    """The dict ``torch.load`` gives for a plain dict of tensors C++ read, made without
    unpickling: each tensor in a fixed-size storage of its own bytes, as torch.load's."""
    torch = _torch()
    names, dtypes, shapes, offsets, sizes = plain
    to_torch = _torch_dtypes()
    # Small tensors share chunks of memory (C++'s plan: one allocation and one read per chunk).
    chunk_bytes, chunk_of, positions = _require("plan_shared_chunks")(sizes)
    chunks = [torch.empty(b, dtype=torch.uint8) for b in chunk_bytes]
    chunk_storages = [c.untyped_storage() for c in chunks]
    bases = [c.data_ptr() for c in chunks]
    out: dict[str, Any] = {}
    addresses: list[int] = []
    for name, dt, shape, offset, n, chunk, pos in zip(
            names, dtypes, shapes, offsets, sizes, chunk_of, positions):
        if chunk >= 0:
            storage = chunk_storages[chunk][pos : pos + n]
            addresses.append(bases[chunk] + pos)
        else:
            storage = mapping._fixed_storage(n, offset)
            addresses.append(storage.data_ptr() if n else 0)
        out[name] = torch.empty(0, dtype=to_torch[dt]).set_(storage, 0, shape)
    with _Progress(f"loading {os.path.basename(path)}", sum(sizes), progress) as prog:
        _reading._read_host(io, file, path, names, offsets, sizes, addresses, prog)
    return out


def _load_torch(
    path: str, dev: Any, dtype: Any, verify: bool, progress: bool | None, io: IOHandle,
    mapped: _Readahead | None = None, placement: _Placement | None = None,
) -> Any:
    torch = _torch()
    file = _open_checkpoint(io, path)
    try:
        whole = archive = None
        if mapped is None and placement is None and not verify and dev.type == "cpu":
            # One read of the zip directory: a plain dict is made without unpickling (C++ read
            # its pickle); for anything else the records serve the unpickler.
            prefix, entries, plain = _same_file(
                file, path, lambda name: _require("torch_zip_entries")(name, True))
            if plain is not None:
                obj = _load_plain_dict(path, file, plain, progress, io)
                return _dtype._convert_in_place(obj, dtype) if dtype is not None else obj
            archive = _records(entries), prefix + "/"
        if mapped is not None:
            archive = _same_file(file, path, _torch_records)
            ranges = [(name, r.offset, r.size) for name, r in archive[0].items()]
            # A big-endian file's storages are swapped where they are mapped: never in a
            # mapping shared with the file (that would swap the file's bytes).
            whole = mapping._map_file(file, path, ranges, mapped,
                                      private=_big_endian_record(file, *archive))
        obj, storages, records, prefix, big_endian = _same_file(
            file,
            path,
            lambda name: _unpickle_torch(
                name, dev, label=path, verify=verify, mapped=whole, archive=archive,
                placement=placement, io=io,
            ),
        )
        refs = sorted(storages.values(), key=lambda r: r.record.offset)
        if verify:
            _verify_other_records(path, file, records, prefix, refs, io)
        pieces: list[_Piece] = []
        if whole is not None:
            if verify:  # storages swapped while unpickling were checked then
                _reading._check_host(path, [
                    (r.record.name, _storage_bytes(r.storage), ("crc32", r.record.crc32))
                    for r in refs if not r.filled])
        else:
            pieces = [
                _Piece(
                    r.record.name, file, r.record.offset, r.nbytes, _storage_bytes(r.storage),
                    ("crc32", r.record.crc32) if verify else None,
                )
                for r in refs
                if not r.filled and r.storage.device.type != "meta"  # meta: nothing to read
            ]
        if pieces:
            total = sum(r.nbytes for r in refs)
            with _Progress(f"loading {os.path.basename(path)}", total, progress) as prog:
                _reading._read_pieces(io, pieces, prog, path)
    finally:
        file.close()
    if big_endian:
        for r in refs:
            if not r.filled and r.storage.device.type != "meta":
                _swap_bytes(r.storage, r.dtype)
    validate = getattr(torch._utils, "_validate_loaded_sparse_tensors", None)
    if validate is not None:
        validate()
    if dtype is not None:
        del storages, refs, pieces  # the originals' last references are obj's
        obj = _dtype._convert_in_place(obj, dtype)
    return obj


def _swap_bytes(storage: Any, dtype: Any) -> None:
    """``storage.byteswap(dtype)`` by the CLI's rule (C++), device storages through the host."""
    width = int(_require("big_endian_swap_width")(_dtype_names()[dtype]))
    if width <= 1:
        return
    flat = _storage_bytes(storage)
    host = flat if flat.device.type == "cpu" else flat.cpu()
    _require("reverse_units_address")(host.data_ptr(), host.numel() - host.numel() % width, width)
    if host is not flat:
        flat.copy_(host)
