"""What replacing an existing checkpoint costs tensortier.save: one 2 GiB state dict (300
tensors, checkpoint_bench's) saved over an existing file of the same size, with the replaced
file's blocks freed on a background thread after the save returns (now) and inside the rename
as before (``_DurableFile._free_in_background`` False), alternating order, median GB/s
until durable. Used for BENCHMARKS.md's checkpoint section (replacing a file)."""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import checkpoint_bench  # noqa: E402
from _benchlib import ab_args  # noqa: E402

import tensortier  # noqa: E402
from tensortier import checkpoint  # noqa: E402


def main() -> None:
    args = ab_args(__doc__)
    sd = checkpoint_bench.make_state_dict(2 << 30, 300, 0)
    total = sum(t.numel() * t.element_size() for t in sd.values())
    path = os.path.join(args.dir, "replace_cost.safetensors")
    tensortier.save(sd, path)
    samples: dict[str, list[float]] = {"freed after the save": [], "freed in the rename": []}
    try:
        for r in range(args.repeats):
            for mode in list(samples) if r % 2 == 0 else list(samples)[::-1]:
                checkpoint._writing._DurableFile._free_in_background = (  # noqa: SLF001 - the A/B switch
                    mode == "freed after the save")
                tensortier._core.wait_for_replaced_files()  # start from quiet
                os.sync()
                time.sleep(2)
                start = time.perf_counter()
                tensortier.save(sd, path)
                samples[mode].append(total / (time.perf_counter() - start) / 1e9)
    finally:
        checkpoint._writing._DurableFile._free_in_background = True  # noqa: SLF001
        os.unlink(path)
    for mode, v in samples.items():
        print(f"{mode}: median {statistics.median(v):.2f} GB/s ("
              + ", ".join(f"{x:.2f}" for x in v) + ")")


if __name__ == "__main__":
    main()
