"""WholeMemory's PyTorch API (``from wholememory.torch import wholememory_pytorch as wm``) on
tensortier's shared tensors: code written for it runs after changing only its import to
``from tensortier.compat import wholememory as wm`` (see the guide's Compatibility modules page).
"""

from __future__ import annotations

import operator
from typing import Any, Sequence, cast

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .. import _core
from .. import shared as _shared

__all__ = ["init_lib", "mp_init", "create_tensor", "get_tensor_view", "finalize_lib"]

_initialized = False
_group: _shared.Group | None = None
# The shared tensor behind each tensor create_tensor or get_tensor_view returned, keyed by the
# tensor object itself (not its data pointer: every empty tensor's is 0) and held weakly: a tensor
# nobody references goes, and its shared tensor with it (memory and descriptors), as torch's do.
_tensors: WeakIdKeyDictionary = WeakIdKeyDictionary()


def init_lib() -> None:
    """Initialises the library (call before mp_init). Calling it twice is harmless."""
    global _initialized
    _initialized = True


def mp_init(rank: int, size: int, store: Any = None) -> None:
    """Joins this process, rank `rank` of `size`, to the job's shared memory.

    Args:
        rank, size: this process's rank and the number of processes.
        store: a ``torch.distributed.Store``; by default the default process group's store if
            one is initialised, else a ``TCPStore`` at torchrun's ``MASTER_ADDR:MASTER_PORT``.

    Raises:
        RuntimeError: init_lib() was not called, or mp_init was already.
        ValueError: a rank outside ``[0, size)``, or no way to reach the other processes.
        TimeoutError: the other processes did not arrive in time.
    """
    global _group
    _core.wholememory_group("mp_init", _initialized, _group)
    rank, size = operator.index(rank), operator.index(size)
    _group = _shared.Group(rank=rank, world_size=size, store=store)


def create_tensor(
    shape: Sequence[int], stride: Sequence[int], dtype: torch.dtype, is_host: bool,
    ranks: Sequence[int],
) -> torch.Tensor:
    """Collective: a tensor over memory shared by every process (a write by one is seen by all).

    Args:
        shape: the tensor's shape; its rows are split between the ranks.
        stride: ``[]`` for contiguous (the only strides accepted are the contiguous ones).
        dtype: a torch dtype.
        is_host: True for host memory; False for device memory (needs a CUDA driver).
        ranks: ``[]`` (or every rank) for all processes.

    Raises:
        ValueError: bad arguments, or ranks that asked for different tensors (all raise).
        CudaError: ``is_host=False`` and no CUDA driver was found.
        TimeoutError: a rank did not make the call in time.
    """
    group = _core.wholememory_group("create_tensor", _initialized, _group)
    try:
        dims = _core.wholememory_dims(shape, stride, ranks, group.world_size)  # ValueError
        if not is_host:
            _core.wholememory_device("create_tensor(is_host=False)", "cuda")
            # Before the collective call, which would be wasted: the result is a CUDA tensor.
            _shared._require_torch_cuda("wholememory: create_tensor(is_host=False)")
    except Exception as e:
        # Refused here, the call still takes part: the other ranks raise at once, naming this one.
        group._core.refuse("create_tensor", f"{type(e).__name__}: {e}")
        raise
    device = "cpu" if is_host else "cuda"
    shared = group.create_tensor(dims, dtype, device=device, layout="continuous")
    tensor = cast(torch.Tensor, shared.view(device))  # one tensor: the layout is continuous
    _tensors[tensor] = shared
    return tensor


def get_tensor_view(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A view of a tensor from create_tensor for `device` (the same memory).

    Raises:
        ValueError: `tensor` did not come from create_tensor, or is a part of one (a slice).
        CudaError: a CUDA device and no CUDA driver was found.
        RuntimeError: after finalize_lib().
    """
    _core.wholememory_group("get_tensor_view", _initialized, _group)
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"wholememory: get_tensor_view needs a torch.Tensor, not {type(tensor)}")
    shared = _tensors.get(tensor)
    if shared is None and tensor.untyped_storage().nbytes() > 0:
        # An alias (t.view(-1), t.detach()) shares the storage of the tensor create_tensor made.
        # Empty tensors all share address 0, so only the object itself names one of them.
        address = tensor.untyped_storage().data_ptr()
        shared = next((s for t, s in list(_tensors.items())
                       if t.untyped_storage().nbytes() > 0
                       and t.untyped_storage().data_ptr() == address), None)
    if shared is None:
        raise ValueError("wholememory: get_tensor_view needs a tensor returned by create_tensor")
    if tensor.storage_offset() != 0 or tensor.nbytes != tensor.untyped_storage().nbytes():
        # Looked up by its memory, a part would be taken for the whole: refused, not widened.
        raise ValueError(
            "wholememory: get_tensor_view needs a tensor returned by create_tensor or an alias of "
            f"all of it, not a part ({tuple(tensor.shape)} at element {tensor.storage_offset()}): "
            "take the view of the whole tensor, then the same part of it")
    device = torch.device(device)
    _core.wholememory_device("get_tensor_view", device.type, str(device))
    view = cast(torch.Tensor, shared.view(device))
    _tensors[view] = shared  # a view of a view is the same memory
    return view


def finalize_lib() -> None:
    """Collective: waits for every rank, then releases the shared memory this process holds
    (tensors still referenced keep theirs until dropped). Safe to call twice."""
    global _group, _initialized
    group, _group = _group, None
    _initialized = False
    if group is None:
        return
    try:
        group.barrier()
    finally:
        _tensors.clear()
        group.close()
