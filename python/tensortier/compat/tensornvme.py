"""TensorNVMe's Python API: ``from tensortier.compat.tensornvme import DiskOffloader``.

Code written for ``tensornvme`` runs with only its import changed, the errors it catches
included. This ``DiskOffloader`` is TensorNVMe's, strict where TensorNVMe is:

- A tensor is read back by the call kind that wrote it: ``sync_write``/``async_write`` by
  ``sync_read``/``async_read``, ``sync_writev``/``async_writev`` by the vector reads of the same
  tensors in the same order (TensorNVMe keys a vector by the tuple of its tensors). Anything else
  is "not found": ``RuntimeError``, as is reading a tensor not offloaded, and reading into a
  tensor whose size changed ("shape mismatch").
- A tensor given where a list is expected raises what TensorNVMe raises (``RuntimeError`` from
  torch when iterating an offloaded tensor, else ``TypeError``); writing a tensor without memory
  (offloaded already, or with no elements) raises ``AssertionError``; a non-contiguous tensor
  ``RuntimeError``; a tensor that cannot be offloaded otherwise (numpy's memory, say: TensorNVMe
  fails to resize it) ``WriteRefusedError``, a ``RuntimeError`` and a ``ValueError``.
- ``TENSORNVME_BACKEND``, when set and not empty, takes the place of the `backend` argument,
  as with TensorNVMe.
- The constructor fails as TensorNVMe's: ``AssertionError`` when `dir_name` exists and is not
  a directory, ``TypeError`` for an `n_entries` that is not a 32-bit unsigned integer (any
  that is works: the engine's rings take the nearest depth they allow, 1 to 4096),
  ``RuntimeError`` ("Unsupported backend") for a backend name it does not know (TensorNVMe's
  ``uring``, ``aio``, ``pthread`` and tensortier's own work), ``BackendUnavailableError`` (a
  ``RuntimeError``, and an ``OSError`` with errno) for one the kernel refuses here.
- Every refused call leaves its tensors exactly as they were (TensorNVMe resizes the storage of
  a tensor it then fails to read).

``tensortier.DiskOffloader`` is the lenient one (any read order or grouping, reads through a
parameter's ``.data``, ``ValueError`` for misuse).
"""

from __future__ import annotations

import operator
import os
import tempfile
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from .. import _core
from .. import offload as _offload
from .._paths import fspath

__all__ = ["BackendUnavailableError", "DiskOffloader", "WriteRefusedError", "get_backends"]

_TENSORNVME_NAMES = {"io_uring": "uring", "libaio": "aio", "threads": "pthread"}
_C_UINT_MAX = (1 << 32) - 1

# How TensorNVMe keys what a call wrote: one tensor by its id, a vector by its tuple.
_Key = tuple[str, tuple[int, ...]]


class BackendUnavailableError(OSError, RuntimeError):
    """A backend named to the constructor does not start here (the kernel refuses io_uring
    under a container's seccomp profile, say): TensorNVMe's ``RuntimeError`` ("Backend ... is
    not install correctly"), and an ``OSError`` with the kernel's errno."""


class WriteRefusedError(ValueError, RuntimeError):
    """A tensor that cannot be offloaded (its storage cannot be resized, as numpy's; it is not
    in CPU or CUDA memory; it is part of a larger storage; its write runs already): where
    TensorNVMe fails it does so with ``RuntimeError`` (from torch, or its "Tensor must be
    contiguous and on cpu"); tensortier's offloader with ``ValueError``. This is both, and
    nothing was written."""


def get_backends() -> set[str]:
    """The backends that work on this machine, by TensorNVMe's names (``uring``, ``aio``,
    ``pthread``); each is verified with a round trip in the temporary directory."""
    return {
        _TENSORNVME_NAMES[p["backend"]]
        for p in _core.probe_backends(tempfile.gettempdir())
        if p["available"] and (p["direct_ok"] or p["buffered_ok"])
    }


class DiskOffloader(_offload.DiskOffloader):
    """TensorNVMe's ``DiskOffloader(dir_name, n_entries=16, backend=...)``: see the module.
    Takes the arguments of ``tensortier.DiskOffloader``."""

    def __init__(
        self,
        dir_name: Any,
        n_entries: int = 16,
        backend: str = "auto",
        **kwargs: Any,
    ) -> None:
        if isinstance(dir_name, (str, bytes, os.PathLike)):
            # TensorNVMe joins dir_name with a str file name: bytes are a TypeError there.
            path = fspath(dir_name, "dir_name", bytes_ok=False)
            # TensorNVMe: `assert os.path.isdir(dir_name)` once it exists.
            if os.path.exists(path) and not os.path.isdir(path):
                raise AssertionError(f"dir_name {path!r} exists and is not a directory")
        # Its binding takes an unsigned int: anything else is pybind11's TypeError.
        try:
            entries = operator.index(n_entries)
        except TypeError:
            entries = -1
        if not 0 <= entries <= _C_UINT_MAX:
            raise TypeError(
                f"n_entries must be an unsigned integer (32 bits), not {n_entries!r}"
            )
        # Every such count is taken; the engine's rings run with the nearest depth they allow.
        low, high = _core.setting_range("TENSORTIER_QUEUE_DEPTH")
        entries = min(max(entries, low), high)
        # TensorNVMe's environment variable, when set, takes the place of the argument.
        backend = os.environ.get("TENSORNVME_BACKEND") or backend
        # Its C++ refuses a backend it does not know with a RuntimeError.
        known = _offload._BACKENDS  # noqa: SLF001 - same package
        if not isinstance(backend, str) or backend not in known:
            raise RuntimeError(
                f"Unsupported backend: {backend!r} (one of {', '.join(sorted(known))})"
            )
        try:
            super().__init__(dir_name, entries, backend, **kwargs)
        except OSError as e:
            if known[backend] == "auto" or _starts(known[backend]):
                raise  # not the backend's failure: the directory's, say
            raise BackendUnavailableError(
                e.errno, f"Backend {backend!r} is not install correctly: {e.strerror or e}"
            ) from e
        self._groups: dict[_Key, tuple[weakref.ref[Any], ...]] = {}
        self._member: dict[int, _Key] = {}  # id(tensor) -> the key it was last written under
        self._groups_kept = 64  # prune dead groups when there are twice as many

    # ---- TensorNVMe's API -----------------------------------------------------------------

    def sync_write(self, tensor: Any) -> None:
        """Writes `tensor` to disk, then frees its memory (its shape and dtype stay)."""
        self._compat_write("sync_write", tensor, False, None, sync=True)

    def sync_read(self, tensor: Any) -> None:
        """Restores a tensor written by ``sync_write``/``async_write``."""
        self._compat_read("sync_read", tensor, False, None, sync=True)

    def sync_writev(self, tensors: Sequence[Any]) -> None:
        """Writes several tensors in one submission, then frees their memory."""
        self._compat_write("sync_writev", tensors, True, None, sync=True)

    def sync_readv(self, tensors: Sequence[Any]) -> None:
        """Restores tensors written by one ``sync_writev``/``async_writev``, given in the same
        order."""
        self._compat_read("sync_readv", tensors, True, None, sync=True)

    def async_write(self, tensor: Any, callback: Callable[[], None] | None = None) -> None:
        """Starts writing `tensor`; its memory is freed when ``sync_write_events()`` or
        ``synchronize()`` sees the write done, after which `callback` runs."""
        self._compat_write("async_write", tensor, False, callback, sync=False)

    def async_read(self, tensor: Any, callback: Callable[[], None] | None = None) -> None:
        """Starts restoring a tensor written by ``sync_write``/``async_write``."""
        self._compat_read("async_read", tensor, False, callback, sync=False)

    def async_writev(
        self, tensors: Sequence[Any], callback: Callable[[], None] | None = None
    ) -> None:
        """``async_write`` of several tensors in one submission."""
        self._compat_write("async_writev", tensors, True, callback, sync=False)

    def async_readv(
        self, tensors: Sequence[Any], callback: Callable[[], None] | None = None
    ) -> None:
        """Starts restoring tensors written by one vector write, given in the same order."""
        self._compat_read("async_readv", tensors, True, callback, sync=False)

    # ---- internals ------------------------------------------------------------------------

    def _compat_write(
        self,
        what: str,
        given: Any,
        vector: bool,
        callback: Callable[[], None] | None,
        sync: bool,
    ) -> None:
        tensors = _tensors(what, given, vector)
        for t in tensors:
            _require_contiguous(t)
            # TensorNVMe: `assert tensor.storage().size() > 0`.
            if t.untyped_storage().nbytes() == 0:
                raise AssertionError(
                    f"{what}: tensor has no memory to write (it is offloaded already, or has no "
                    "elements)"
                )
        with self._lock:
            try:
                self._write(tensors, callback)
            except ValueError as e:
                raise WriteRefusedError(f"{what}: {e}") from e
            self._remember(tensors, vector)
        if sync:
            self.sync_write_events()

    def _compat_read(
        self,
        what: str,
        given: Any,
        vector: bool,
        callback: Callable[[], None] | None,
        sync: bool,
    ) -> None:
        tensors = _tensors(what, given, vector)
        for t in tensors:
            _require_contiguous(t)
        with self._lock:
            key = _key(tensors, vector)
            group = self._groups.get(key)
            if (
                group is None
                or len(group) != len(tensors)
                or any(ref() is not t or self._member.get(id(t)) != key
                       for ref, t in zip(group, tensors))
                # TensorNVMe takes a tensor's key when its read starts: a second read of it
                # finds nothing, even while the first runs.
                or any((e := self._lookup(t)) is None or e.state == "reading" for t in tensors)
            ):
                raise RuntimeError(
                    "Read error, tensor not found"
                    + (" (read a vector with the tensors, in the order, of its write)"
                       if vector else "")
                )
            try:
                self._read(tensors, callback)
            except ValueError as e:  # its memory was replaced: TensorNVMe's size check
                raise RuntimeError(f"Read error, tensor shape mismatch: {e}") from e
        if sync:
            self.sync_read_events()

    def _remember(self, tensors: list[Any], vector: bool) -> None:
        """Records the key the tensors were written under (a later write of one of them makes
        its old group unreadable, as TensorNVMe's key would no longer be its). REQUIRES:
        self._lock."""
        key = _key(tensors, vector)
        for t in tensors:
            old = self._member.get(id(t))
            if old is not None:
                self._groups.pop(old, None)
            self._member[id(t)] = key
        self._groups[key] = tuple(weakref.ref(t) for t in tensors)
        if len(self._groups) > 2 * self._groups_kept:
            dead = [k for k, refs in self._groups.items() if any(r() is None for r in refs)]
            for k in dead:
                del self._groups[k]
            live = {k for refs in self._groups.values() for k in [id(r()) for r in refs]}
            self._member = {i: k for i, k in self._member.items() if i in live}
            self._groups_kept = max(64, len(self._groups))


def _starts(backend: str) -> bool:
    """Whether tensortier's `backend` starts on this machine."""
    return any(
        p["backend"] == backend and p["available"]
        for p in _core.probe_backends(tempfile.gettempdir())
    )


def _key(tensors: list[Any], vector: bool) -> _Key:
    return ("vector" if vector else "tensor", tuple(id(t) for t in tensors))


def _tensors(what: str, given: Any, vector: bool) -> list[Any]:
    """The tensors of a call, checked as TensorNVMe's calls check them before anything moves."""
    import torch

    if not vector:
        if not isinstance(given, torch.Tensor):
            raise TypeError(f"{what}() takes a torch.Tensor, not {type(given).__name__}")
        return [given]
    if isinstance(given, torch.Tensor):
        # TensorNVMe iterates what it is given: torch refuses to make the rows of an offloaded
        # tensor (RuntimeError); the rows of one with memory reach its binding, which wants a
        # list (TypeError). Iterating changes nothing.
        list(given)
        raise TypeError(
            f"{what}(): incompatible function arguments: a list of tensors is expected, not a "
            "tensor (wrap it: [tensor])"
        )
    tensors = list(given)
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}() takes a list of torch.Tensor, not of {type(t).__name__}")
    return tensors


def _require_contiguous(tensor: Any) -> None:
    if not tensor.is_contiguous():
        raise RuntimeError("Tensor must be contiguous")
