"""safetensors files: the aligned layout a save writes, checksums in its metadata, and loads."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..io import File, IOHandle
from . import _dtype, _format, _reading, mapping
from ._dtype import _converts
from ._files import _renamed, _same_file
from ._format import _dtype_names, _require, _st_dtype_maps, _torch
from ._format import ALIGNMENT, PathLike
from ._reading import _open_checkpoint, _Piece, _Progress
from ._writing import _DurableFile
from .mapping import _mapped_tensor, _Placement, _Readahead


def _require_utf8_name(name: str) -> None:
    """Raises safetensors' UnicodeEncodeError (a ValueError) for a name that is not UTF-8 text
    (a lone surrogate, as ``os.fsdecode`` gives for a file name that is not UTF-8): a
    safetensors header is JSON."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UnicodeEncodeError(e.encoding, e.object, e.start, e.end,
                                 f"{e.reason}: a safetensors tensor name is UTF-8 text "
                                 f"(save this one with format='torch')") from None


def _save_safetensors(
    state_dict: Mapping[str, Any], path: PathLike, metadata: dict[str, str], checksum: bool,
    io: IOHandle,
) -> None:
    torch = _torch()
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"a safetensors file holds a mapping of name -> tensor, not a "
            f"{type(state_dict).__name__}: use format='torch' for other objects"
        )
    to_st, _ = _st_dtype_maps()
    tensor, strided = torch.Tensor, torch.strided
    rows: list[tuple[Any, ...]] = []
    for k, v in state_dict.items():
        if isinstance(k, str) and not k.isascii():
            _require_utf8_name(k)
        if not isinstance(v, tensor):
            rows.append((k, "value"))
        elif v.layout != strided:
            rows.append((k, "sparse"))
        elif v.is_meta:
            rows.append((k, "meta"))
        else:  # a strided view's memory reaches its furthest element: C++ takes its strides
            view = () if v.is_contiguous() else (v.shape, v.stride(), v.element_size())
            rows.append((k, "" if v.is_cpu else str(v.device), v.data_ptr(), v.nbytes,
                         "" if v.dtype in to_st else str(v.dtype), *view))
    _require("check_safetensors_save")(rows)
    tensors = list(state_dict.values())
    names = _dtype_names()
    writer = _require("SafetensorsFileWriter")(
        list(state_dict), [names[v.dtype] for v in tensors], [v.shape for v in tensors],
        [v.nbytes for v in tensors], metadata, checksum)
    # Contiguous CPU tensors are written from their memory; the others (GPU, non-contiguous,
    # conjugate or negative views) from host copies, about _STAGING_BYTES at a time.
    ready = [i for i, v in enumerate(tensors)
             if v.is_cpu and v.is_contiguous() and not v.is_conj() and not v.is_neg()]
    engine = io._core()  # noqa: SLF001 - same package
    with _DurableFile(path, io) as out:
        writer.write(engine, out, ready, [tensors[i].data_ptr() for i in ready])

        def host(i: int) -> Any:
            return tensors[i].detach().to("cpu").resolve_conj().resolve_neg().contiguous()

        writer.write_staged(engine, out, sorted(set(range(len(tensors))) - set(ready)), host,
                            _format._STAGING_BYTES)
        out.commit()


# (path, metadata, names) -> {name: the stored xxh64} of the file's tensors `names`, by
# `tensortier verify`'s rule.
_parse_checksums = _require("safetensors_checksums")


@dataclass
class _STEntry:
    name: str
    dtype: Any
    shape: tuple[int, ...]
    offset: int  # absolute file offset
    nbytes: int


def _read_st_header(path: str, verify: bool = False) -> tuple[list[_STEntry], dict[str, str]]:
    try:
        entries, metadata = _require("read_safetensors_header")(path, verify)
    except ValueError as e:
        msg = str(e)
        raise _renamed(e, msg if path in msg else f"{path}: {msg}") from e
    _, from_st = _st_dtype_maps()
    out: list[_STEntry] = []
    for name, dt, shape, offset, nbytes in entries:
        dtype = from_st.get(dt)
        if dtype is None:
            raise ValueError(
                f"{path}: tensor {name!r} has dtype {dt}, which this torch cannot hold"
            )
        out.append(_STEntry(name, dtype, tuple(shape), offset, nbytes))
    return out, dict(metadata)


def _load_safetensors(
    path: str, dev: Any, dtype: Any, verify: bool, progress: bool | None, io: IOHandle,
    mapped: _Readahead | None = None, placement: _Placement | None = None,
) -> dict[str, Any]:
    """`placement` (``map_location``): safetensors files hold CPU tensors (location "cpu")."""
    restore = placement.restore if placement is not None else None
    if placement is not None and restore is None:
        dev = placement.device_for("cpu")
    file = _open_checkpoint(io, path)
    try:
        entries, metadata = _same_file(file, path, lambda name: _read_st_header(name, verify))
        if dev.type == "meta":  # shapes and dtypes only: no byte is read
            torch = _torch()
            return {
                e.name: _dtype._convert(torch.empty(e.shape, dtype=e.dtype, device=dev), dtype)
                for e in entries
            }
        sums = _parse_checksums(path, metadata, [e.name for e in entries]) if verify else None
        if mapped is not None:
            ranges = [(e.name, e.offset, e.nbytes) for e in entries]
            whole = mapping._map_file(file, path, ranges, mapped)
            out = {e.name: _mapped_tensor(whole, e.offset, e.nbytes, e.dtype, e.shape)
                   for e in entries}
            if sums is not None:
                _reading._check_host(path, [(k, t, ("xxh64", sums.get(k)))
                                            for k, t in out.items()])
            if dtype is not None:
                out = _dtype._convert_in_place(out, dtype)
            if dev.type != "cpu":  # map_location sends "cpu" elsewhere: copied there
                out = {k: t.to(dev) for k, t in out.items()}
        else:
            prog = _Progress(f"loading {os.path.basename(path)}", sum(e.nbytes for e in entries),
                             progress)
            out = {}
            # With conversion, a group at a time, converted before the next is allocated.
            converts = dtype is not None and any(_converts(e.dtype, dtype) for e in entries)
            try:
                for group in _reading._byte_groups(entries) if converts else [entries]:
                    out.update(_read_st_group(io, file, path, group, dev, dtype, sums, prog))
            finally:
                prog.close()
    finally:
        file.close()
    if placement is not None and restore is not None:
        out = {k: placement.restored_tensor(t, "cpu") for k, t in out.items()}
    return out


def _read_st_group(
    io: IOHandle, file: File, path: str, group: Sequence[_STEntry], dev: Any, dtype: Any,
    sums: Mapping[str, Any] | None, prog: _Progress,
) -> dict[str, Any]:
    """`group`'s tensors read into new tensors on `dev`, converted to `dtype` (if not None) and
    checked against `sums` (if not None)."""
    torch = _torch()
    out: dict[str, Any] = {}
    if dev.type == "cpu":  # one call into the pipeline reads and checks them all
        small = _format._ALIGNED_ALLOC_MIN
        for e in group:
            out[e.name] = (torch.empty(e.shape, dtype=e.dtype) if e.nbytes < small else
                           mapping._host_alloc(e.nbytes // e.dtype.itemsize, e.dtype,
                                               e.offset % ALIGNMENT).view(e.shape))
        _reading._read_host(
            io, file, path, [e.name for e in group], [e.offset for e in group],
            [e.nbytes for e in group], [t.data_ptr() for t in out.values()], prog,
            "xxh64" if sums is not None else "none",
            [sums.get(e.name) for e in group] if sums is not None else None)
    else:
        pieces: list[_Piece] = []
        for e in group:
            t = out[e.name] = torch.empty(e.shape, dtype=e.dtype, device=dev)
            pieces.append(_Piece(e.name, file, e.offset, e.nbytes, t,
                                 ("xxh64", sums.get(e.name)) if sums is not None else None))
        _reading._read_pieces(io, pieces, prog, path)
    if dtype is not None:
        return {k: _dtype._convert(t, dtype) for k, t in out.items()}
    return out
