"""Host staging of state dicts for tensortier.dcp's asynchronous saves (``Writer.stage``): each
copy goes to a reused arena of host memory, free again once its save has written its file or no
tensor staged in it is alive (docs/checkpoints.md says what a user sees)."""

from __future__ import annotations

import copy
import functools
import os
import sys
from typing import Any

import torch

from . import _core
from ._runtime import dtype_names, gc_paused, quantized_dtypes

# Threads that copy a state dict into its arena.
_COPY_THREADS = max(1, min(8, len(os.sched_getaffinity(0))))


class _Slot:
    """Where a staged tensor goes in the rebuilt state dict."""

    __slots__ = ("index", "spec")

    def __init__(self, index: int, spec: Any) -> None:
        self.index = index
        self.spec = spec  # a DTensor's spec, None for a plain tensor


def _dtensor_type() -> Any:
    """torch's DTensor class; () where no DTensor can exist (a torch without it, or a process
    that has not imported it: importing it costs seconds)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", ()) if module is not None else ()


def stage(state_dict: Any) -> Any:
    """A copy of `state_dict` (nested dicts, lists and tuples) whose tensors are in a reused
    arena, DTensors rebuilt around their staged local tensors; other values deep-copied (kept as
    they are when they cannot be: the save then names them). Returns when every copy is done."""
    dtensor = _dtensor_type()
    sources: list[Any] = []
    with torch.no_grad(), gc_paused():
        shaped = _collect(state_dict, sources, dtensor)
        storable = _storable_dtypes()
        # Each stageable tensor's bytes (None: staged by torch, and refused by the save where it
        # must be); the arena is pinned for the first CUDA tensor's device.
        sizes = [t.numel() * t.dtype.itemsize if t.dtype in storable and t.layout == torch.strided
                 and (t.is_cpu or t.is_cuda) else None for t in sources]
        pinned_device = next((torch.cuda.current_device() if t.device.index is None
                              else t.device.index for t, n in zip(sources, sizes)
                              if n is not None and t.is_cuda), None)
        # The arena is in use while a tensor made from its capsule (each staged one) lives.
        address, capsule, offsets = _core.take_staging_arena(sizes, pinned_device)
        memory = torch.from_dlpack(capsule)
        bases: dict[Any, Any] = {}  # the arena as a flat tensor of each dtype
        staged: list[Any] = []
        # Plain CPU tensors: one C++ copy of them all (their views made here, no copy each).
        dst: list[int] = []
        src: list[int] = []
        nbytes: list[int] = []
        devices: set[Any] = set()
        for t, offset, n in zip(sources, offsets, sizes):
            if offset is None:
                staged.append(t.clone() if t.is_cpu else t.cpu())  # host memory in any case
                continue
            dtype = t.dtype
            base = bases.get(dtype)
            if base is None:
                base = bases[dtype] = memory.view(dtype)
            start = offset // dtype.itemsize
            if t.is_contiguous():
                out = base.as_strided(t.shape, t.stride(), start)
                if t.is_cpu and not t.is_conj() and not t.is_neg():
                    staged.append(out)
                    dst.append(address + offset)
                    src.append(t.data_ptr())
                    nbytes.append(n)
                    continue
            else:
                out = base.narrow(0, start, t.numel()).view(t.shape)
            staged.append(out)
            if t.is_cuda:
                out.copy_(t, non_blocking=True)
                devices.add(t.device)
            else:
                out.copy_(t)  # strided, conjugate or negative views: torch resolves them
        _core.copy_ranges(dst, src, nbytes, _COPY_THREADS)
        for device in devices:
            torch.cuda.current_stream(device).synchronize()
        del bases, memory
        return _rebuild(shaped, staged, dtensor)


@functools.lru_cache(maxsize=None)
def _storable_dtypes() -> frozenset[Any]:
    """The torch dtypes a DCP item can hold."""
    return frozenset(dt for dt in dtype_names() if dt not in quantized_dtypes())


# (Module functions, not closures: a recursive closure is a reference cycle, which would keep
# the tensors it saw, and the arena, alive until the cyclic collector runs.)
def _collect(obj: Any, sources: list[Any], dtensor: Any) -> Any:
    """`obj` with each tensor appended to `sources` (a DTensor's local tensor) and replaced by
    its _Slot; other values deep-copied."""
    kind = type(obj)  # exact types first: isinstance on torch.Tensor costs more
    if kind is torch.Tensor or (kind not in (dict, list, tuple) and isinstance(obj, torch.Tensor)):
        spec = None
        if kind is not torch.Tensor and dtensor and isinstance(obj, dtensor):
            spec, obj = obj._spec, obj._local_tensor  # noqa: SLF001 - DTensor's own parts
        sources.append(obj)
        return _Slot(len(sources) - 1, spec)
    if kind is dict or isinstance(obj, dict):
        return {k: _collect(v, sources, dtensor) for k, v in obj.items()}
    if kind is list or isinstance(obj, list):
        return [_collect(v, sources, dtensor) for v in obj]
    if kind is tuple:
        return tuple(_collect(v, sources, dtensor) for v in obj)
    try:
        return copy.deepcopy(obj)
    except Exception:  # an open file, a lock...: the save's pickling names it
        return obj


def _rebuild(obj: Any, staged: list[Any], dtensor: Any) -> Any:
    """`obj` (from _collect) with each _Slot replaced by its staged tensor (a DTensor around it
    where the original was one)."""
    if isinstance(obj, _Slot):
        t = staged[obj.index]
        return t if obj.spec is None else dtensor(t, obj.spec, requires_grad=False)
    if isinstance(obj, dict):
        return {k: _rebuild(v, staged, dtensor) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rebuild(v, staged, dtensor) for v in obj]
    if type(obj) is tuple:
        return tuple(_rebuild(v, staged, dtensor) for v in obj)
    return obj
