"""Store a CPU tensor into a file with plain Python file I/O (the baseline)."""

import os

from _common import random_tensor, store_args, timed

args = store_args(__doc__)
t = random_tensor(args.mb_size)
path = os.path.join(args.nvme_folder, "py_store_cpu.pt")


def store() -> None:
    with open(path, "wb") as f:
        f.write(t.numpy())
        if args.fsync:
            f.flush()
            os.fsync(f.fileno())


timed("py store_cpu", t.numel(), args.loop, store)
if args.validate:
    from _common import check, python_read

    check("py store_cpu", python_read(path), t)
os.unlink(path)
