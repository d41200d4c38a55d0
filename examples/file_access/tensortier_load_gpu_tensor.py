"""Load a file into a GPU tensor with tensortier: through a ring of pinned bounce buffers (disk
reads and host-to-device copies overlap), or with --gds through GPUDirect Storage where cuFile
accepts the file (the ring elsewhere; the path taken is printed)."""

import os

import torch

import tensortier
from _common import before_load, load_args, timed

args = load_args(__doc__)
if not torch.cuda.is_available():
    raise SystemExit("tensortier load_gpu: needs a CUDA device")
size = os.path.getsize(args.input_file)
io = tensortier.IOHandle(gds="auto" if args.gds else "off")
t = torch.empty(size, dtype=torch.uint8, device="cuda")  # allocated once, as DeepNVMe's
f = io.open(args.input_file, "r")
paths: set[str] = set()


def load() -> None:
    result = io.pread_async(t, f).result()  # the data is on the GPU when this returns
    paths.add(result.stats["path"])


timed(f"tensortier load_gpu ({'gds' if args.gds else 'bounce'})", size, args.loop, load,
      before=before_load(args))
print(f"tensortier load_gpu: path taken: {', '.join(sorted(paths))}")
if args.validate:
    from _common import check, python_read

    check("tensortier load_gpu", t, python_read(args.input_file))
f.close()
io.close()
