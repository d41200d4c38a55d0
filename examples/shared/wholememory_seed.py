"""WholeMemory's PyTorch example, with only its import changed: every process of the job sees
the same tensors. Run with torchrun (host memory; no GPU or NCCL needed):

    torchrun --standalone --nproc_per_node=4 examples/shared/wholememory_seed.py
    torchrun --standalone --nproc_per_node=4 examples/shared/wholememory_seed.py --full   # 10,000,000 x 512 float32 (20 GB)

With --device the tensors are in device memory (``is_host=False``), each rank's rows on its GPU
(LOCAL_RANK, modulo the GPUs there are), and viewed from that GPU; without a CUDA driver this
raises an error saying that none was found.
"""

import argparse
import os

import torch

# from wholememory.torch import wholememory_pytorch as wm
from tensortier.compat import wholememory as wm

parser = argparse.ArgumentParser()
parser.add_argument("--full", action="store_true", help="the seed's 10,000,000 x 512 table")
parser.add_argument("--rows", type=int, default=100_000)
parser.add_argument("--device", action="store_true", help="device memory (is_host=False)")
args = parser.parse_args()
rows = 10_000_000 if args.full else args.rows

rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
is_host = not args.device
view_device = torch.device("cpu")
if args.device and torch.cuda.is_available():
    gpu = int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()
    torch.cuda.set_device(gpu)
    view_device = torch.device("cuda", gpu)
wm.init_lib()
wm.mp_init(rank, size)
a = wm.create_tensor([2, 3], [], torch.float32, is_host, [])
b = wm.create_tensor([rows, 512], [], torch.float32, is_host, [])
bb = wm.get_tensor_view(b, view_device)
# Each rank writes its share of rows; every rank then reads all of them.
bb[rank::size, 0] = rank
if bb.is_cuda:
    torch.cuda.synchronize()
print(f"rank {rank}: a={tuple(a.shape)} b={tuple(b.shape)}")
del a, b
# finalize_lib waits for every rank; tensors still referenced (bb) keep their memory.
wm.finalize_lib()
owners = [int(x) for x in bb[: 2 * size, 0].tolist()]
print(f"rank {rank}: rows 0..{2 * size - 1} were written by ranks {owners}")
