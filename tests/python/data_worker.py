"""A torchrun rank for tests/python/test_data_reader.py: reads a file tree through FileDataset
in a DataLoader (its workers started by the context given) and writes what it read.

    python -m torch.distributed.run --standalone --nproc_per_node=N data_worker.py ROOT OUT \
        WORKERS CONTEXT EPOCHS
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tensortier.data import FileDataset


def main() -> None:
    root, out, workers, context, epochs = sys.argv[1:6]
    dist.init_process_group("gloo")
    try:
        dataset = FileDataset(file_root=root, batch_size=3, seed=11)
        loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=int(workers),
                                             multiprocessing_context=context, timeout=120,
                                             persistent_workers=True)
        read = []
        for epoch in range(int(epochs)):
            dataset.set_epoch(epoch)
            read.append([bytes(s.numpy()).hex() for samples, _ in loader for s in samples])
        path = Path(out) / f"rank{dist.get_rank()}.json"
        path.write_text(json.dumps(read))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":  # spawned DataLoader workers import this file again
    main()
