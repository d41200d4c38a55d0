"""Store a GPU tensor into a file with tensortier: through a ring of pinned bounce buffers
(device-to-host copies and disk writes overlap), or with --gds through GPUDirect Storage where
cuFile accepts the file (the ring elsewhere; the path taken is printed)."""

import os

import torch

import tensortier
from _common import random_tensor, store_args, timed

args = store_args(__doc__)
if not torch.cuda.is_available():
    raise SystemExit("tensortier store_gpu: needs a CUDA device")
t = random_tensor(args.mb_size, "cuda")
path = os.path.join(args.nvme_folder, "tensortier_store_gpu.pt")
io = tensortier.IOHandle(gds="auto" if args.gds else "off")
paths: set[str] = set()


def store() -> None:
    # Overwrites in place, as DeepNVMe's handles do (no truncate: the file keeps its blocks).
    f = io.open(path, "a")
    result = io.pwrite_async(t, f).result()  # O_DIRECT (or GDS): the data has left the GPU
    paths.add(result.stats["path"])
    if args.fsync:
        f.datasync()
    f.close()


timed(f"tensortier store_gpu ({'gds' if args.gds else 'bounce'})", t.numel(), args.loop, store)
print(f"tensortier store_gpu: path taken: {', '.join(sorted(paths))}")
if args.validate:
    from _common import check, python_read

    check("tensortier store_gpu", python_read(path), t)
io.close()
os.unlink(path)
