"""A shared tensor's rows as torch tensors: tensors over its memory (host bytes, or device
memory at a CUDA address), and the ``distributed`` layout's rows, which move between ranks
through all-to-all collectives of ``torch.distributed``. Internal to tensortier.shared."""

from __future__ import annotations

import math
import threading
from typing import Any

import torch

from . import _core


class _CudaMemory:
    """Device memory seen by torch through ``__cuda_array_interface__`` (bytes); holds `keeper`
    (the mapping) for as long as a tensor made from it lives."""

    def __init__(self, address: int, nbytes: int, keeper: Any) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (address, False), "version": 3,
            "strides": None,
        }
        self._keeper = keeper


def _require_torch_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"{what}: this torch has no CUDA (torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}); it cannot make CUDA tensors over shared memory"
        )


def _cuda_tensor_over(address: int, nbytes: int, keeper: Any, dtype: torch.dtype,
                      shape: tuple[int, ...], index: int) -> torch.Tensor:
    """A CUDA tensor on device `index` over `nbytes` at device address `address`."""
    device = torch.device("cuda", index)
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype, device=device)
    raw = torch.as_tensor(_CudaMemory(address, nbytes, keeper), device=device)
    return raw.view(dtype).view(shape)


def _tensor_over(region: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over `region`'s memory (which it keeps alive)."""
    if len(region) == 0:
        return torch.empty(shape, dtype=dtype)
    # Bytes first: torch.frombuffer does not take every dtype, a byte view can be any.
    return torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)


#: One collective round at a time per process: every distributed tensor moves its rows through
#: the default process group, whose collectives pair up by the order each process issues them.
_ROUND_LOCK = threading.Lock()


class _Distributed:
    """A ``distributed`` tensor's state: this rank's rows in private memory; other ranks' rows
    come and go through all-to-all collectives of ``torch.distributed`` (Gloo on CPU).

    Every gather or scatter is one round: an all-to-all of the requests (the indices each rank
    asks of each other), one more when a pair's index slots were too few, then one of the rows.
    The bookkeeping is C++'s (``_core.SharedRowExchange``: which rows go where, in what buffers);
    here are only the collectives. Rounds pair up across ranks by their order in each process, so
    a rank's gather may meet another's scatter (a round serves both); rounds of one process run
    one at a time (``_ROUND_LOCK``)."""

    def __init__(self, name: str, rank: int, parts: list[tuple[int, int]], local: torch.Tensor):
        self.name = name
        self.rank = rank
        self.parts = parts
        self.local: torch.Tensor | None = local
        self.row_shape = tuple(local.shape[1:])
        self.row_bytes = local.element_size() * math.prod(self.row_shape)
        self.exchange = _core.SharedRowExchange([end for _, end in parts], rank, self.row_bytes)

    def round(self, idx: torch.Tensor, values: torch.Tensor | None) -> torch.Tensor | None:
        """This rank's gather (`values` None: returns rows `idx`) or scatter (writes `values`,
        contiguous, to rows `idx`), as one collective round."""
        with _ROUND_LOCK:
            # A close() from another thread leaves the exchange under way its memory.
            local = self.local
            if local is None:
                raise RuntimeError("the shared tensor was closed (finalized)")
            ex, n = self.exchange, idx.numel()
            self._all_to_all(*ex.route(idx.data_ptr(), n, values is not None), 8)  # the requests
            if ex.read_requests():
                self._all_to_all(*ex.late_splits(), 8)  # those past the pairs' slots
            mine = 0 if values is None else values.data_ptr()
            self._all_to_all(*ex.serve(local.data_ptr(), mine), self.row_bytes)  # the rows
            out = None
            if values is None:
                out = torch.empty((n, *self.row_shape), dtype=local.dtype)
            ex.finish(local.data_ptr(), 0 if out is None else out.data_ptr())
            return out

    def _all_to_all(self, send_splits: list[int], recv_splits: list[int], width: int) -> None:
        """One all-to-all of the exchange's buffers, in pieces of `width` bytes."""
        import torch.distributed as dist

        send = _tensor_over(self.exchange.send_buffer(), torch.uint8, (sum(send_splits), width))
        recv = _tensor_over(self.exchange.recv_buffer(), torch.uint8, (sum(recv_splits), width))
        dist.all_to_all_single(recv, send, recv_splits, send_splits)
