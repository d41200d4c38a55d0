"""WholeMemory's PyTorch example, with only its import changed: every process of the job sees
the same tensors. Run with torchrun (host memory; no GPU or NCCL needed):

    torchrun --standalone --nproc_per_node=4 examples/shared/wholememory_seed.py
    torchrun --standalone --nproc_per_node=4 examples/shared/wholememory_seed.py --full   # 10,000,000 x 512 float32 (20 GB)
"""

import argparse
import os

import torch

# from wholememory.torch import wholememory_pytorch as wm
from tensortier.compat import wholememory as wm

parser = argparse.ArgumentParser()
parser.add_argument("--full", action="store_true", help="the seed's 10,000,000 x 512 table")
parser.add_argument("--rows", type=int, default=100_000)
args = parser.parse_args()
rows = 10_000_000 if args.full else args.rows

rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
wm.init_lib()
wm.mp_init(rank, size)
a = wm.create_tensor([2, 3], [], torch.float32, True, [])
b = wm.create_tensor([rows, 512], [], torch.float32, True, [])
bb = wm.get_tensor_view(b, torch.device("cpu"))
# Each rank writes its share of rows; every rank then reads all of them.
bb[rank::size, 0] = rank
print(f"rank {rank}: a={tuple(a.shape)} b={tuple(b.shape)}")
del a, b
# finalize_lib waits for every rank; tensors still referenced (bb) keep their memory.
wm.finalize_lib()
owners = [int(x) for x in bb[: 2 * size, 0].tolist()]
print(f"rank {rank}: rows 0..{2 * size - 1} were written by ranks {owners}")
