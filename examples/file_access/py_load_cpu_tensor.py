"""Load a file into a CPU tensor with plain Python file I/O (the baseline)."""

from _common import before_load, load_args, python_read, timed

args = load_args(__doc__)
size = __import__("os").path.getsize(args.input_file)
t = timed("py load_cpu", size, args.loop, lambda: python_read(args.input_file),
          before=before_load(args))
if args.validate:
    from _common import check

    check("py load_cpu", t, python_read(args.input_file))
