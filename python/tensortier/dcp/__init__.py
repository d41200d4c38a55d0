"""A ``torch.distributed.checkpoint`` (DCP) storage backend on tensortier's engine: ``Writer`` and
``Reader`` for the stock DCP calls, in DCP's layout (the guide: "Distributed checkpoints" in
docs/checkpoints.md)."""

from __future__ import annotations

from ._planners import LoadPlanner, SavePlanner
from ._reader import Reader
from ._writer import Writer

__all__ = ["LoadPlanner", "Reader", "SavePlanner", "Writer"]
