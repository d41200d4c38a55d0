"""Load a file into a CPU tensor with tensortier (O_DIRECT, parallel, page-aligned target)."""

import os

import tensortier
from _common import before_load, load_args, timed

args = load_args(__doc__)
size = os.path.getsize(args.input_file)
io = tensortier.IOHandle()
# allocated once and reused, like DeepNVMe's locked buffer: huge pages, all in memory
# before the first load (DeepNVMe pins its buffer before timing, which faults it in)
t = tensortier.aligned_empty(size, reused=True, resident=True)
timed(f"tensortier load_cpu ({io.backend})", size, args.loop,
      lambda: io.pread(t, args.input_file), before=before_load(args))
if args.validate:
    from _common import check, python_read

    check("tensortier load_cpu", t, python_read(args.input_file))
io.close()
