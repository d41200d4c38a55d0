"""tensortier.load_into: checkpoint tensors read straight into existing tensors."""

from __future__ import annotations

import contextlib
import errno
import functools
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from .. import _core
from ..io import File, IOHandle
from . import _engine, _reading, safetensors, unpickler
from ._files import _same_file
from ._format import _as_damaged, _require, _sniff, _torch, CHECKSUM_KEY, PathLike
from .._paths import fspath as _fspath
from ._reading import _byte_groups, _open_checkpoint, _Piece, _Progress
from .loading import _each_shard
from .unpickler import _StorageRef, _verify_other_records


def _a(noun: str) -> str:
    """`noun` with its indefinite article, for messages ("an OrderedDict", "a dict")."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


class IncompatibleKeys(NamedTuple):
    """What :func:`load_into` could not match (like ``torch.nn.Module.load_state_dict``)."""

    missing_keys: list[str]
    unexpected_keys: list[str]


class StateDictMismatchError(RuntimeError, ValueError):
    """:func:`load_into` found names or shapes that do not match the target. A ``RuntimeError``
    worded as ``torch.nn.Module.load_state_dict``'s (``Error(s) in loading state_dict for
    ...``), so code written for it keeps working; also a ``ValueError``, as before."""


def load_into(
    module_or_state_dict: Any,
    path: PathLike,
    strict: bool = True,
    verify: bool = False,
    *,
    progress: bool | None = None,
    _io: IOHandle | None = None,
) -> IncompatibleKeys:
    """Read a checkpoint straight into existing tensors. Allocates nothing for contiguous CPU
    targets of the file's dtype; contiguous CUDA targets are filled by the engine's GPU path
    (GPUDirect Storage or the pinned bounce ring). Non-contiguous targets, and targets of
    another dtype than the file's (converted as ``load_state_dict``'s ``copy_`` does), are read
    into temporaries ~64 MiB at a time (or one tensor, if larger), then copied.

    Args:
        module_or_state_dict: a ``torch.nn.Module`` (its ``state_dict()``: parameters and
            persistent buffers) or a mapping of name -> tensor. A submodule's extra state
            (``get_extra_state``, named ``..._extra_state``) is given to its
            ``set_extra_state`` as saved, as ``load_state_dict`` does: any object a torch file
            holds there, or a tensor of the saved shape.
        path: a safetensors file, a zip-format ``torch.save`` file holding a flat
            ``{name: tensor}`` dict, or a shard index.
        strict: like ``load_state_dict``: names missing from the file or not in the target are
            an error. A missing name whose tensor shares its memory with a loaded one (tied
            weights that safetensors files store once) is not missing. Modules'
            ``_load_from_state_dict`` and ``load_state_dict`` hooks are not run (the tensors
            are read in place): entries that ``load_state_dict`` would upgrade (older module
            versions, by the state dict's ``_metadata``) are missing or unexpected here, and
            the error names the modules saved at an older version.
        verify: check the stored checksums of what is read.

    Returns:
        ``IncompatibleKeys(missing_keys, unexpected_keys)`` (both empty when strict).

    Raises:
        StateDictMismatchError: a ``RuntimeError`` (and ``ValueError``) worded as
            ``load_state_dict``'s: missing/unexpected names (strict), shape mismatches (even
            when not strict, as there), all listed, naming the file on its last line.
        ValueError: meta-device targets, a malformed file, a checksum mismatch.
        OSError: the file cannot be read.
        TypeError: the target is neither a module nor a mapping of tensors.

    Names and shapes are all checked before any byte is read. An error during the read
    itself (I/O error, checksum mismatch, interrupt) leaves the targets partly overwritten, as
    ``load_state_dict`` would after a failed ``copy_``: load again, or load into copies, when
    the old values must survive a failure.
    """
    torch = _torch()
    extra_states: dict[str, Any] = {}  # name -> the module whose get_extra_state gave it
    if isinstance(module_or_state_dict, torch.nn.Module):
        targets = dict(module_or_state_dict.state_dict())
        extra_states = _extra_state_modules(module_or_state_dict, targets)
    elif isinstance(module_or_state_dict, Mapping):
        targets = dict(module_or_state_dict)
    else:
        raise TypeError(
            f"load_into needs a torch.nn.Module or a mapping of tensors, not "
            f"{type(module_or_state_dict).__name__}"
        )
    meta = []
    for name, t in targets.items():
        if name in extra_states:
            continue  # any object: given to set_extra_state, never read into
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"target {name!r} is {_a(type(t).__name__)}, not a tensor")
        if t.is_meta:
            meta.append(name)
    _require("check_load_into_targets")(meta)
    io = _io if _io is not None else _engine._default_io()
    fspath = _fspath(path)
    files = _Files(io)  # opened once: what is parsed is what is read
    try:
        saved_states: dict[str, Any] = {}  # extra states the file holds as other objects
        saved_versions: dict[str, Any] = {}  # module prefix -> version, from `_metadata`
        values: dict[str, _Source] = {}  # other values the file holds ("step": 4)
        sources = _describe_sources(  # name -> _Source
            fspath, io, files, verify, frozenset(extra_states), saved_states, saved_versions,
            values
        )
        for name, value in values.items():
            if name in targets:  # a tensor's name: no value load_state_dict could copy either
                _require("check_saved_tensor")(value.path, name, value.dtype, "", False)
            sources[name] = value  # unexpected, as load_state_dict reports it
        for name in extra_states:
            src = sources.get(name)
            if name in saved_states:
                del targets[name]
            elif src is not None:  # a tensor: read whole, whatever the module holds now
                targets[name] = torch.empty(src.shape, dtype=src.dtype)
            else:  # missing, as load_state_dict reports it
                targets[name] = torch.empty(0)
        explain = None
        if isinstance(module_or_state_dict, torch.nn.Module):
            explain = functools.partial(_upgrade_note, module_or_state_dict, saved_versions)
        result = _load_into(targets, sources, strict, verify, progress, io, fspath, files,
                            type(module_or_state_dict).__name__, explain)
    except _core.FormatError as e:
        # The damaged file's error as load gives it (torch's or safetensors' type), naming the
        # file it was read from (a shard of an index).
        damaged = next((p for p in files if p in str(e)), fspath)
        raise _as_damaged(e, damaged, None) from None
    finally:
        files.close()
    for name, module in extra_states.items():
        if name in saved_states:
            module.set_extra_state(saved_states[name])
        elif name in sources:
            module.set_extra_state(targets[name])
    return result


def _upgrade_note(module: Any, saved_versions: Mapping[str, Any], names: Sequence[str]) -> str:
    """Why `names` may load with ``load_state_dict``: submodules holding them whose ``_version``
    is newer than the file's ``_metadata`` records get them upgraded by their
    ``_load_from_state_dict``, which load_into does not run ("" when none)."""
    holders = {name.rpartition(".")[0] for name in names}
    return str(_require("upgrade_note")([
        (prefix, type(sub).__name__, saved_versions.get(prefix), getattr(type(sub), "_version", 1))
        for prefix, sub in module.named_modules() if prefix in holders]))


def _extra_state_modules(module: Any, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The state dict names holding a submodule's ``get_extra_state()``, and their modules."""
    nn = _torch().nn
    base = nn.Module.get_extra_state
    suffix = getattr(nn.modules.module, "_EXTRA_STATE_KEY_SUFFIX", "_extra_state")
    out = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        if getattr(type(sub), "get_extra_state", base) is base:
            continue
        name = f"{prefix}.{suffix}" if prefix else suffix
        if name in state_dict:
            out[name] = sub
    return out


@dataclass
class _Source:
    """A saved tensor's bytes: `nbytes` at `offset` of `path`, or (torch views) `view` of
    `crc_storage` once read."""

    path: str
    dtype: Any
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    checksum: int | None  # xxh64 of the bytes (safetensors) or None
    crc_storage: _StorageRef | None = None  # torch: the storage record (crc checks)
    view: Any = None  # torch: a meta tensor describing the saved view


class _Files:
    """The files a load_into reads, by path, each open from its parse to its reads so that what
    is parsed is what is read; except the shards of an index of more than can be held open
    together (see _opened_together): each is closed once parsed, and opened again for its
    reads, refused if it is no longer the file parsed."""

    def __init__(self, io: IOHandle) -> None:
        self._io = io
        self.held: dict[str, File] = {}
        self._parsed: dict[str, tuple[int, ...]] = {}  # closed once parsed: what it was

    def __iter__(self) -> Iterator[str]:
        yield from self.held
        yield from self._parsed

    def to_parse(self, path: str) -> File:
        """`path` open (opened now unless it is held already)."""
        if path not in self.held:
            self.held[path] = _open_checkpoint(self._io, path)
        return self.held[path]

    def parsed(self, path: str) -> None:
        """`path` is parsed and is not to be held open until its reads: closed."""
        file = self.held.pop(path)
        try:
            self._parsed[path] = _version(os.fstat(file.fileno()))
        finally:
            file.close()

    def all_held(self) -> bool:
        """Whether every file is open (its reads may go together)."""
        return not self._parsed

    @contextlib.contextmanager
    def to_read(self, path: str) -> Iterator[Mapping[str, File]]:
        """`path` open for its reads (by path, in a mapping): the one held, or opened again."""
        if path in self.held:
            yield self.held
            return
        advice = ("after its header was read (too many shards to hold open together); load it "
                  "again once the saves into its directory have ended")
        try:
            file = _open_checkpoint(self._io, path)
        except FileNotFoundError as e:
            raise OSError(errno.EAGAIN, f"{path}: removed by another save {advice}", path) from e
        try:
            if _version(os.fstat(file.fileno())) != self._parsed[path]:
                raise OSError(errno.EAGAIN, f"{path}: replaced by another save {advice}", path)
            yield {path: file}
        finally:
            file.close()

    def close(self) -> None:
        """Every file held closed."""
        for file in self.held.values():
            file.close()
        self.held.clear()


def _version(st: os.stat_result) -> tuple[int, ...]:
    """What tells one version of a file's bytes from the next (not its ctime, which a chmod or
    a new hard link, by a backup tool say, moves)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _describe_sources(
    path: str, io: IOHandle, files: _Files, verify: bool = False,
    extra_names: frozenset[str] = frozenset(), saved_states: dict[str, Any] | None = None,
    saved_versions: dict[str, Any] | None = None, values: dict[str, _Source] | None = None,
    hold: bool = True,
) -> dict[str, _Source]:
    """The tensors of `path` (an index: of its shards), each file parsed through its descriptor
    in `files` (and held open there unless `hold` is false); non-tensor values of `extra_names`
    go into `saved_states`, the module versions of a torch file's ``_metadata`` into
    `saved_versions`, other non-tensor values into `values` (as a _Source whose dtype is their
    type's name; ValueError without `values`)."""
    kind = _sniff(path)
    if kind == "index":
        # The shards are held open until read where _each_shard could open them all together.
        return _each_shard(path, lambda shard, _: _describe_sources(
            shard, io, files, verify, extra_names, saved_states, saved_versions, values,
            hold=_reading._preopened.get() is not None), io)
    file = files.to_parse(path)
    try:
        return _describe_file(kind, path, io, file, verify, extra_names, saved_states,
                              saved_versions, values)
    finally:
        if not hold:
            files.parsed(path)


def _describe_file(
    kind: str, path: str, io: IOHandle, file: File, verify: bool, extra_names: frozenset[str],
    saved_states: dict[str, Any] | None, saved_versions: dict[str, Any] | None,
    values: dict[str, _Source] | None,
) -> dict[str, _Source]:
    """_describe_sources of one file (not an index), `file` open."""
    if kind == "safetensors":
        entries, metadata = _same_file(
            file, path, lambda name: safetensors._read_st_header(name, verify)
        )
        sums: dict[str, int] | None = None
        if verify and CHECKSUM_KEY in metadata:
            sums = safetensors._parse_checksums(path, metadata, [e.name for e in entries])
        return {
            e.name: _Source(path, e.dtype, e.shape, e.offset, e.nbytes,
                            None if sums is None else sums.get(e.name, -1))
            for e in entries
        }
    torch = _torch()
    obj, storages, records, prefix, big_endian = _same_file(
        file,
        path,
        lambda name: unpickler._unpickle_torch(
            name, torch.device("meta"), label=path, verify=verify, io=io
        ),
    )
    if verify:  # storage records are checked as their tensors are read
        _verify_other_records(path, file, records, prefix, storages.values(), io)
    if big_endian:
        raise ValueError(f"{path}: big-endian torch files are read by load(), not load_into()")
    if not isinstance(obj, Mapping):
        raise ValueError(
            f"{path}: holds a {type(obj).__name__}, not a flat state dict: use tensortier.load"
        )
    recorded = getattr(obj, "_metadata", None)
    if saved_versions is not None and isinstance(recorded, Mapping):
        for prefix, local in recorded.items():
            if isinstance(local, Mapping):
                saved_versions[prefix] = local.get("version")
    by_storage = {id(r.storage): r for r in storages.values()}
    by_cdata = {r.storage._cdata: r for r in storages.values()}
    out = {}
    for name, t in obj.items():
        tensor = isinstance(t, torch.Tensor)
        if name in extra_names and not tensor and saved_states is not None:
            saved_states[name] = t
            continue
        if not tensor and values is not None:
            values[name] = _Source(path, _a(type(t).__name__), (), 0, 0, None)
            continue
        strided = tensor and t.layout == torch.strided
        ref = None if not strided else (by_cdata.get(t.untyped_storage()._cdata)
                                        or by_storage.get(id(t.untyped_storage())))
        _require("check_saved_tensor")(
            path, name, "" if tensor else _a(type(t).__name__),
            "" if strided or not tensor else str(t.layout).replace("torch.", ""), ref is not None)
        start = t.storage_offset() * t.element_size()
        n = t.nbytes
        # A conjugate or negative view's storage holds other numbers than its values: read
        # through its storage, then copied with the bit applied, as non-contiguous views are.
        contiguous = t.is_contiguous() and not t.is_conj() and not t.is_neg()
        out[name] = _Source(path, t.dtype, tuple(t.shape), ref.record.offset + start, n, None,
                            ref, None if contiguous else t)
    return out


def _load_into(
    targets: dict[str, Any], sources: dict[str, _Source], strict: bool, verify: bool,
    progress: bool | None, io: IOHandle, path: str, files: _Files,
    target_name: str = "dict", explain: Callable[[Sequence[str]], str] | None = None,
) -> IncompatibleKeys:
    torch = _torch()
    missing, unexpected, errors, reads = _require("plan_load_into")(
        [(k, t.shape, str(t.dtype), t.data_ptr(), t.nbytes) for k, t in targets.items()],
        [(k, src.shape, "", 0, 0) for k, src in sources.items()], bool(strict))  # truthy, as torch
    if errors:  # the lines and their order are load_state_dict's: code parsing it keeps working
        hint = " (load_into(..., strict=False) skips missing and unexpected names)"
        raise StateDictMismatchError(
            f"Error(s) in loading state_dict for {target_name}:\n\t" + "\n\t".join(errors)
            + f"\n\tfrom {path}" + (hint if strict and (missing or unexpected) else "")
            + (explain((missing + unexpected) if strict else []) if explain else "")
        )

    # The reads of every file together where all are open; else file by file, each opened
    # again for its reads.
    by_file: dict[str, list[str]] = {}
    for k in reads:
        by_file.setdefault("" if files.all_held() else sources[k].path, []).append(k)
    plans = {p: _ReadPlan(keys, targets, sources, verify) for p, keys in by_file.items()}
    total = sum(plan.nbytes for plan in plans.values())
    with _Progress(f"loading {os.path.basename(path)}", total, progress) as prog, \
            torch.no_grad():
        for file_path, plan in plans.items():
            with (contextlib.nullcontext(files.held) if not file_path
                  else files.to_read(file_path)) as opened:
                plan.read(io, opened, prog, path)
    return IncompatibleKeys(missing, unexpected)


class _ReadPlan:
    """The reads of targets `keys` from their sources: straight into the target's memory, or
    into a temporary, then copied (and converted) into it; and the storage records they do not
    cover whole, checked afterwards (verify). Pieces name their file by path until read."""

    def __init__(self, keys: Sequence[str], targets: Mapping[str, Any],
                 sources: Mapping[str, _Source], verify: bool) -> None:
        torch = _torch()
        self.direct: list[_Piece] = []
        self.staged: list[_Staged] = []
        self.crc_refs: dict[tuple[str, str], _StorageRef] = {}
        for k in keys:  # tied weights: only the name load_state_dict's value comes from
            t, src = targets[k], sources[k]
            if src.view is not None and src.crc_storage is not None:
                # a non-contiguous saved view: read its whole storage, then copy the view out
                ref = src.crc_storage
                self.staged.append(_Staged(
                    _Piece(ref.record.name, src.path, ref.record.offset, ref.nbytes, None,
                           ("crc32", ref.record.crc32) if verify else None),
                    t, src.view, "cpu"))
                continue
            check: tuple[str, int | None] | None = None
            if verify and src.crc_storage is not None:
                ref = src.crc_storage
                if src.offset == ref.record.offset and src.nbytes == ref.nbytes:
                    check = ("crc32", ref.record.crc32)
                else:  # the CRC covers more than this tensor: checked on its own afterwards
                    self.crc_refs[(ref.path, ref.key)] = ref
            elif verify:
                if src.checksum is None:
                    safetensors._parse_checksums(src.path, {}, [])  # raises: the file stores none
                check = ("xxh64", None if src.checksum == -1 else src.checksum)
            # A CRC-32 is a zip record's: a mismatch names the record.
            name = src.crc_storage.record.name if check and check[0] == "crc32" else k
            if t.is_contiguous() and t.dtype == src.dtype:  # CPU: in place; CUDA: ring/GDS
                self.direct.append(_Piece(name, src.path, src.offset, src.nbytes, t.detach(),
                                          check))
            else:
                # A [1] entry for a 0-dim target (load_state_dict's rule): its one value, as a
                # 0-dim.
                shape = () if t.dim() == 0 else src.shape
                self.staged.append(_Staged(
                    _Piece(name, src.path, src.offset, src.nbytes, None, check), t,
                    torch.empty(shape, dtype=src.dtype, device="meta"), t.device))

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.direct) + sum(s.nbytes for s in self.staged)

    def read(self, io: IOHandle, files: Mapping[str, File], prog: _Progress, path: str) -> None:
        """Every read, from `files` (by path)."""
        torch = _torch()
        for piece in [*self.direct, *(s.piece for s in self.staged)]:
            piece.file = files[piece.file]
        _reading._read_pieces(io, self.direct, prog, path)
        # Temporaries a group at a time: the extra memory is one group (or one tensor), plus,
        # for CUDA targets with verify, two pinned buffers of the largest piece.
        for group in _byte_groups(self.staged):
            for s in group:
                s.piece.dest = torch.empty(s.nbytes, dtype=torch.uint8, device=s.device)
            _reading._read_pieces(io, [s.piece for s in group], prog, path)
            for s in group:
                s.finish()
        # Storage records the tensors read do not cover whole (a CRC-32 covers the whole
        # record): streamed again by the pipeline through bounded buffers and checked.
        for r in self.crc_refs.values():
            _require("check_records")(io._core(), files[r.path], r.path, [  # noqa: SLF001
                (r.record.name, r.record.offset, r.nbytes, r.record.crc32)])


@dataclass
class _Staged:
    """A target read through a temporary on `device` (made a group at a time), copied into
    `target` as `view` (a meta tensor: the saved tensor's dtype, strides, conj/neg bits) says."""

    piece: _Piece
    target: Any
    view: Any
    device: Any

    @property
    def nbytes(self) -> int:
        return self.piece.nbytes

    def finish(self) -> None:
        holder, view = self.piece.dest, self.view
        self.piece.dest = None  # the temporary goes with its group
        src = _torch().empty(0, dtype=view.dtype, device=holder.device).set_(
            holder.untyped_storage(), view.storage_offset(), view.shape, view.stride())
        if view.is_conj():
            src = src.conj()
        if view.is_neg():
            src = src.neg()
        self.target.copy_(src)
