"""Three ways to feed DALI's CPU JPEG decoder from a folder of small JPEG files, side by side:

  readers.file   DALI's own fn.readers.file
  seed           the xNVMe + DALI notebook's way: an external_source iterator that reads one
                 file at a time with np.fromfile (labels as numpy arrays: DALI fails on torch
                 CPU tensors with a CPU-only torch)
  tensortier     tensortier.data.FileReader's dali_source(): whole batches read at once, in C++,
                 ahead of the pipeline

Each pipeline decodes with fn.decoders.image(device="cpu") and prints files/s over full epochs.
Generates the folder first (--files small JPEGs in --classes class folders) unless it exists.

    python examples/data/decode_pipelines.py --dir /tmp/jpegs --files 2000
"""

from __future__ import annotations

import argparse
import io
import random
import time
from pathlib import Path

import numpy as np
from nvidia.dali import fn, pipeline_def, types
from PIL import Image

from tensortier.data import FileReader


def make_jpegs(root: Path, files: int, classes: int) -> None:
    if root.exists() and any(root.rglob("*.jpg")):
        return
    rng = np.random.default_rng(0)
    for i in range(files):
        d = root / f"class_{i % classes:03d}"
        d.mkdir(parents=True, exist_ok=True)
        h, w = (int(x) for x in rng.integers(64, 256, size=2))
        # Smooth gradients plus noise: compresses like a photo, not like pure noise.
        y, x = np.mgrid[0:h, 0:w]
        base = np.stack([(x * 255 // w), (y * 255 // h), ((x + y) * 127 // (w + h))], axis=-1)
        pixels = np.clip(base + rng.integers(-20, 20, size=(h, w, 3)), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="JPEG", quality=85)
        (d / f"{i:06d}.jpg").write_bytes(buf.getvalue())


class SeedSource:
    """The seed's iterator: np.fromfile per file, random.shuffle per epoch."""

    def __init__(self, root: Path, batch_size: int) -> None:
        classes = sorted(p.name for p in root.iterdir() if p.is_dir())
        self.files = [(str(f), label) for label, c in enumerate(classes)
                      for f in sorted((root / c).iterdir())]
        self.batch_size = batch_size

    def __iter__(self) -> "SeedSource":
        self.i = 0
        random.shuffle(self.files)
        return self

    def __next__(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        if self.i >= len(self.files):
            raise StopIteration
        chunk = self.files[self.i:self.i + self.batch_size]
        self.i += self.batch_size
        return ([np.fromfile(f, dtype=np.uint8) for f, _ in chunk],
                [np.array([label], dtype=np.int32) for _, label in chunk])


def run(name: str, pipe, epochs: int, epoch_batches: int | None) -> None:
    pipe.build()
    files = 0
    empty_epochs = 0
    start = time.perf_counter()
    for _ in range(epochs):
        if epoch_batches is None:  # external_source: StopIteration ends the epoch
            before = files
            try:
                while True:
                    images, _ = pipe.run()
                    files += len(images)
            except StopIteration:
                pipe.reset()
            empty_epochs += files == before
        else:
            for _ in range(epoch_batches):
                images, _ = pipe.run()
                files += len(images)
    seconds = time.perf_counter() - start
    note = (f"; {empty_epochs} of {epochs} epochs empty: the source does not rewind"
            if empty_epochs else "")
    print(f"{name:14s} {files / seconds:9.0f} files/s  ({files} files in {seconds:.2f} s{note})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="tensortier-data/jpegs")
    p.add_argument("--files", type=int, default=2000)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="DALI worker threads")
    p.add_argument("--epochs", type=int, default=2)
    args = p.parse_args()
    root = Path(args.dir)
    make_jpegs(root, args.files, args.classes)
    common = dict(batch_size=args.batch_size, num_threads=args.threads, device_id=None)

    @pipeline_def(**common)
    def readers_file():
        jpegs, labels = fn.readers.file(file_root=str(root), random_shuffle=True, name="r")
        return fn.decoders.image(jpegs, device="cpu", output_type=types.RGB), labels

    def external(source):
        @pipeline_def(**common)
        def pipe():
            jpegs, labels = fn.external_source(source=source, num_outputs=2, batch=True,
                                               dtype=[types.UINT8, types.INT32])
            return fn.decoders.image(jpegs, device="cpu", output_type=types.RGB), labels

        return pipe()

    dali = readers_file()
    dali.build()
    batches = -(-dali.epoch_size("r") // args.batch_size)
    run("readers.file", dali, args.epochs, batches)
    run("seed", external(SeedSource(root, args.batch_size)), args.epochs, None)
    reader = FileReader(file_root=root, batch_size=args.batch_size, shuffle=True)
    run("tensortier", external(reader.dali_source()), args.epochs, None)


if __name__ == "__main__":
    main()
