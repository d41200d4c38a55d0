"""Helpers every checkpoint module uses: the default engine, file objects, target devices and
dtypes, conversion, tensor bytes and their checksums, error wording."""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ..io import File, IOHandle
from ._format import _require, _T, _torch, _torch_dtypes, PathLike


# File objects are copied to and from temporary files this many bytes at a time.
_STREAM_CHUNK = 8 << 20


def _is_file_object(obj: Any, method: str) -> bool:
    """A file object given where a path may be (as torch.save/torch.load take them)."""
    return not isinstance(obj, (str, bytes, os.PathLike)) and callable(getattr(obj, method, None))


@contextlib.contextmanager
def _memfd_copy(stream: Any) -> Iterator[str]:
    """`stream` from its position to its end in anonymous memory, as a path the engine opens."""
    fd = os.memfd_create("tensortier-load", os.MFD_CLOEXEC)
    try:
        with open(fd, "wb", closefd=False) as out:
            shutil.copyfileobj(stream, out, _STREAM_CHUNK)
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector held off for a save or load: one of many small tensors
    makes tens of thousands of objects (tensors, shapes, entries), which would set off full
    collections over every object of the process (torch's own included) in its middle: twice
    the time of a 20,000-tensor load here. It runs again (if it was on) when the block ends."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


_default_lock = threading.Lock()


_default: tuple[int, IOHandle] | None = None


def _default_io() -> IOHandle:
    """One engine per process, made on first use (again after a fork: threads do not survive)."""
    global _default
    with _default_lock:
        if _default is None or _default[0] != os.getpid():
            _default = (os.getpid(), IOHandle())
        return _default[1]


def _save_format(path: PathLike, format: str | None) -> str:
    if format is not None:
        if format not in ("safetensors", "torch"):
            raise ValueError(f"format must be 'safetensors' or 'torch', not {format!r}")
        return format
    named = _require("format_of_suffix")(os.fspath(path))
    if named is not None:
        return str(named)
    raise ValueError(
        f"cannot tell the format from the name {os.fspath(path)!r}: use a .safetensors or .pt "
        "suffix, or pass format='safetensors' or format='torch'"
    )


def _target_device(device: Any) -> Any:
    torch = _torch()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is not a device: {e}") from e
    if dev.type in ("cpu", "meta"):  # meta: shapes and dtypes only, as torch.load gives them
        return torch.device(dev.type)
    if dev.type != "cuda":
        raise ValueError(f"device {str(dev)!r} is not supported: use 'cpu', 'cuda:N' or 'meta'")
    if not torch.cuda.is_available():
        raise ValueError(
            f"device {str(dev)!r} was asked for but CUDA is not available "
            "(torch.cuda.is_available() is False): load with device='cpu'"
        )
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise ValueError(f"device {str(dev)!r}: there are only {torch.cuda.device_count()} GPUs")
    return torch.device("cuda", index)


def _target_dtype(dtype: Any) -> Any:
    if dtype is None:
        return None
    torch = _torch()
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, not {type(dtype).__name__}")
    if not dtype.is_floating_point:
        # Only floating-point tensors are converted: any other dtype would be a silent no-op.
        raise ValueError(
            f"dtype={dtype}: load converts floating-point tensors to a floating-point dtype "
            "(torch.bfloat16, torch.float16...); convert to other dtypes after loading"
        )
    return dtype


def _convert(t: Any, dtype: Any) -> Any:
    """`t` in `dtype` when both are floating point; otherwise `t` unchanged. A Parameter stays
    a Parameter and a tensor that requires grad stays a leaf that does (as loading it in
    `dtype` would give; not a result of `.to` with autograd history)."""
    if dtype is None or t.dtype == dtype:
        return t
    if not t.is_floating_point() or not dtype.is_floating_point:
        return t
    torch = _torch()
    with torch.no_grad():
        out = t.to(dtype)
    if isinstance(t, torch.nn.Parameter):
        out = torch.nn.Parameter(out, requires_grad=t.requires_grad)
    else:
        out.requires_grad_(t.requires_grad)
    if getattr(t, "__dict__", None):  # Python attributes a file gave it, as torch.load keeps
        out.__dict__.update(t.__dict__)
    return out


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size()


def _st_dtype_maps() -> tuple[dict[Any, str], dict[str, Any]]:
    """torch.dtype -> safetensors dtype and back, for the C++ table's dtypes safetensors stores."""
    dtypes = _torch_dtypes()
    to_st: dict[Any, str] = {}
    from_st: dict[str, Any] = {}
    for row in _require("dtypes")():
        dt = dtypes.get(row["name"])
        if dt is not None and row["safetensors"]:
            to_st[dt] = row["safetensors"]
            from_st[row["safetensors"]] = dt
    return to_st, from_st


def _as_bytes(t: Any) -> Any:
    """A flat uint8 view of a contiguous tensor's bytes."""
    torch = _torch()
    flat = t.reshape(-1)
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=flat.device)
    return flat.view(torch.uint8)


def _storage_bytes(storage: Any) -> Any:
    """A flat uint8 tensor over a whole UntypedStorage."""
    torch = _torch()
    t = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return t.set_(storage, 0, (storage.nbytes(),), (1,))


def _xxh64(t: Any) -> int:
    """xxHash64 of a contiguous CPU tensor's bytes (GIL released in C++ for large ones)."""
    n = _nbytes(t)
    if n == 0:
        return int(_require("xxh64")(b""))
    return int(_require("xxh64_address")(t.data_ptr(), n))


def _crc32(t: Any, value: int = 0) -> int:
    """zlib.crc32 of a contiguous CPU tensor's bytes (carry-less multiply folding in C++, GIL
    released: ~4x zlib's own)."""
    n = _nbytes(t)
    if n == 0:
        return value
    return int(_require("crc32_address")(t.data_ptr(), n, value))


def _a(noun: str) -> str:
    """`noun` with its indefinite article, for messages ("an OrderedDict", "a dict")."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def _checksum_mismatch(path: str, name: str, kind: str, stored: int, actual: int) -> ValueError:
    """`name`: the tensor (xxh64, per tensor) or the zip record of a storage (crc32)."""
    what, width = ("record", 8) if kind == "crc32" else ("tensor", 16)
    return ValueError(
        f"{path}: checksum mismatch in {what} {name!r}: stored {kind} {stored:0{width}x}, data "
        f"has {actual:0{width}x}: the file is corrupt"
    )


def _same_file(file: File, path: str, parse: Callable[[str], _T]) -> _T:
    """``parse(name)`` where `name` is exactly the file `file` has open (its /proc/self/fd link):
    the header or zip directory then describes the bytes the engine reads, even if `path` is
    replaced meanwhile (an atomic save by another process). Messages name `path`."""
    proc = f"/proc/self/fd/{file.fileno()}"
    if not os.path.exists(proc):
        return parse(path)
    try:
        return parse(proc)
    except (OSError, ValueError) as e:
        if proc not in str(e):
            raise
        message = str(e).replace(proc, path)
        if isinstance(e, OSError):
            raise OSError(e.errno, message) from e
        raise _renamed(e, message) from e


def _renamed(e: ValueError, message: str) -> ValueError:
    """`e`'s type with `message` (the file named as the caller gave it): code catches the types
    (``WeightsOnlyUnpicklingError`` as ``pickle.UnpicklingError``, as from ``torch.load``).
    Types that need more than a message (``UnicodeDecodeError``) become a plain ValueError."""
    try:
        return type(e)(message)
    except TypeError:
        return ValueError(message)


def _converts(saved: Any, dtype: Any) -> bool:
    """Whether ``_convert`` changes a tensor saved in `saved` into `dtype`."""
    return saved != dtype and saved.is_floating_point and dtype.is_floating_point


def _convert_in_place(obj: Any, dtype: Any) -> Any:
    """`obj` with every tensor inside dicts, lists and tuples converted by ``_convert``. Dicts
    and lists are changed in place, one tensor at a time, so that each original can go as soon
    as it is converted (with nothing else holding it): converting a whole checkpoint then needs
    room for one converted tensor more, not for a second copy of all of them. A tensor met twice
    is converted once and stays one object; so do containers met twice."""
    torch = _torch()
    converted: dict[int, Any] = {}  # id(original) -> converted, for tensors met again
    done: set[int] = set()  # containers already converted

    def visit(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            out = converted.get(id(o))
            if out is None:
                out = _convert(o, dtype)
                if out is not o:
                    converted[id(o)] = out
            return out
        if id(o) in done:
            return o
        if isinstance(o, dict):
            done.add(id(o))
            for k in list(o):
                o[k] = visit(o[k])
        elif isinstance(o, list):
            done.add(id(o))
            for i, v in enumerate(o):
                o[i] = visit(v)
        elif isinstance(o, tuple) and not hasattr(o, "_fields"):
            items = [visit(v) for v in o]
            if all(new is old for new, old in zip(items, o)):
                return o  # nothing converted: torch.Size and other tuple types kept as they are
            return type(o)(items) if type(o) is not tuple else tuple(items)
        return o

    return visit(obj)
