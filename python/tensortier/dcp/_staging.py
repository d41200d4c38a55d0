"""``dcp.async_save``'s staging copies (``Writer.stage``) and the host copies a save writes
from: the state dict's tensors in staging arenas this process reuses from save to save."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from typing import Any

import torch

from .. import _core
from .._runtime import dtype_names, gc_paused, quantized_dtypes

def _stage(state_dict: Any) -> Any:
    """``Writer.stage``'s copy of `state_dict` (nested dicts, lists and tuples), DTensors rebuilt
    around their staged local tensors; other values deep-copied (kept as they are when they
    cannot be: the save then names them)."""
    return _stage_begin(state_dict)()


def _stage_begin(state_dict: Any) -> Callable[[], Any]:
    """:func:`_stage` in two steps. This one takes the state dict's structure, its non-tensor
    values (deep-copied) and its tensors, and marks where the CUDA ones' queued work ends; it
    returns the second, which copies the tensors (the bulk copy in C++, GIL released) and
    returns the copy. The second may run on another thread: the tensors must not change
    until it is done."""
    # () where no DTensor can exist (a torch without it, or a process that has not imported it:
    # importing it costs seconds).
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", ())
    sources: list[Any] = []
    with torch.no_grad(), gc_paused():
        shaped = _core.dcp_stage_collect(state_dict, sources, torch.Tensor, dtensor)
        # The work queued on each CUDA device's current stream here: copies wait for it.
        queued = {}
        for t in sources:
            if t.is_cuda and t.device not in queued:
                queued[t.device] = torch.cuda.Event()
                queued[t.device].record(torch.cuda.current_stream(t.device))

    def finish() -> Any:
        with torch.no_grad(), gc_paused(), contextlib.ExitStack() as streams:
            # The copies go on streams of their own (the default stream would queue them after
            # the training work launched meanwhile), once the work queued above is done.
            for device, event in queued.items():
                stream = _staging_stream(device)
                stream.wait_event(event)
                streams.enter_context(torch.cuda.stream(stream))
            return _stage_copy(shaped, sources, dtensor, list(queued))

    return finish


_staging_streams: dict[Any, Any] = {}  # a CUDA device's stream for staging copies


def _staging_stream(device: Any) -> Any:
    stream = _staging_streams.get(device)
    if stream is None:
        stream = _staging_streams.setdefault(device, torch.cuda.Stream(device))
    return stream


def _stage_copy(shaped: Any, sources: list[Any], dtensor: Any, devices: list[Any]) -> Any:
    """The copy of :func:`_stage_begin`'s tensors (`sources`, with CUDA tensors on `devices`)
    in a staging arena, put back into `shaped`."""
    storable = dtype_names().keys() - quantized_dtypes()  # what a DCP item can hold
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
    copies: list[tuple[int, int, int]] = []  # (offset in the arena, address, bytes)
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
                copies.append((offset, t.data_ptr(), n))
                continue
        else:
            out = base.narrow(0, start, t.numel()).view(t.shape)
        staged.append(out)
        if t.is_cuda:
            out.copy_(t, non_blocking=True)
        else:
            out.copy_(t)  # strided, conjugate or negative views: torch resolves them
    _core.copy_into_staging_arena(address, copies)
    for device in devices:
        torch.cuda.current_stream(device).synchronize()
    del bases, memory
    return _core.dcp_stage_rebuild(shaped, staged, dtensor)


def _in_place(t: Any) -> bool:
    """Whether the file can take `t`'s bytes where they are (contiguous host memory)."""
    return t.is_cpu and t.is_contiguous() and not t.is_conj() and not t.is_neg()


def _host_copies(tensors: list[Any]) -> list[Any]:
    """Contiguous host copies of `tensors`, as the file stores them: :func:`_stage`'s, in a
    staging arena (pinned where they are on a GPU) that the next group reuses once these are
    dropped."""
    return list(_stage(tensors))
