"""Host staging of state dicts for tensortier.dcp's asynchronous saves (``Writer.stage``): each
copy goes to a reused arena of host memory, free again once its save has written its file or no
tensor staged in it is alive (docs/checkpoints.md says what a user sees)."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from . import _core
from ._runtime import dtype_names, gc_paused, quantized_dtypes

# Threads that copy a state dict into its arena.
_COPY_THREADS = max(1, min(8, len(os.sched_getaffinity(0))))


def stage(state_dict: Any) -> Any:
    """A copy of `state_dict` (nested dicts, lists and tuples) whose tensors are in a reused
    arena, DTensors rebuilt around their staged local tensors; other values deep-copied (kept as
    they are when they cannot be: the save then names them). Returns when every copy is done."""
    # () where no DTensor can exist (a torch without it, or a process that has not imported it:
    # importing it costs seconds).
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", ())
    sources: list[Any] = []
    with torch.no_grad(), gc_paused():
        shaped = _core.dcp_stage_collect(state_dict, sources, torch.Tensor, dtensor)
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
        return _core.dcp_stage_rebuild(shaped, staged, dtensor)
