"""Store a GPU tensor into a file with ``.cpu()`` and plain Python file I/O (the baseline)."""

import os

import torch

from _common import random_tensor, store_args, timed

args = store_args(__doc__)
if not torch.cuda.is_available():
    raise SystemExit("py store_gpu: needs a CUDA device")
t = random_tensor(args.mb_size, "cuda")
path = os.path.join(args.nvme_folder, "py_store_gpu.pt")


def store() -> None:
    with open(path, "wb") as f:
        f.write(t.cpu().numpy())
        if args.fsync:
            f.flush()
            os.fsync(f.fileno())


timed("py store_gpu", t.numel(), args.loop, store)
if args.validate:
    from _common import check, python_read

    check("py store_gpu", python_read(path), t)
os.unlink(path)
