"""Load a file into a GPU tensor with plain Python file I/O and ``.cuda()`` (the baseline)."""

import torch

from _common import before_load, load_args, python_read, timed

args = load_args(__doc__)
if not torch.cuda.is_available():
    raise SystemExit("py load_gpu: needs a CUDA device")
size = __import__("os").path.getsize(args.input_file)


def load() -> torch.Tensor:
    t = python_read(args.input_file).cuda()
    torch.cuda.synchronize()
    return t


t = timed("py load_gpu", size, args.loop, load, before=before_load(args))
if args.validate:
    from _common import check

    check("py load_gpu", t, python_read(args.input_file))
