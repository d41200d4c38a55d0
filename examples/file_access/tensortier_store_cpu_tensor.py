"""Store a CPU tensor into a file with tensortier (O_DIRECT, parallel)."""

import os

import tensortier
from _common import random_tensor, store_args, timed

args = store_args(__doc__)
t = random_tensor(args.mb_size)
path = os.path.join(args.nvme_folder, "tensortier_store_cpu.pt")
io = tensortier.IOHandle()


def store() -> None:
    # Overwrites in place, as DeepNVMe's aio_handle does (no truncate: the file keeps its blocks).
    f = io.open(path, "a")
    io.pwrite(t, f)  # O_DIRECT: the data has left the page cache when this returns
    if args.fsync:
        f.datasync()
    f.close()


timed(f"tensortier store_cpu ({io.backend})", t.numel(), args.loop, store)
if args.validate:
    from _common import check, python_read

    check("tensortier store_cpu", python_read(path), t)
io.close()
os.unlink(path)
