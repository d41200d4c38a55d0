"""What the CRC-32s of a ``.pt`` save cost: tensortier.save of one 2 GiB state dict (300 fp32
tensors) with and without CRCs (torch.serialization.set_crc32_options), alternating order,
median GB/s until durable. Used for BENCHMARKS.md's checkpoint section (CRC-32s)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
import statistics
import time

import torch

import tensortier

sys.path.insert(0, str(Path(__file__).parent))
from _benchlib import ab_args  # noqa: E402


def main() -> None:
    args = ab_args(__doc__)
    g = torch.Generator().manual_seed(0)
    sd = {f"t{i}": torch.randn((2 << 30) // 300 // 4, generator=g) for i in range(300)}
    total = sum(t.numel() * t.element_size() for t in sd.values())
    path = os.path.join(args.dir, "crc_cost.pt")
    before = torch.serialization.get_crc32_options()
    samples: dict[str, list[float]] = {"with CRCs": [], "without": []}
    try:
        for r in range(args.repeats):
            for mode in list(samples) if r % 2 == 0 else list(samples)[::-1]:
                torch.serialization.set_crc32_options(mode == "with CRCs")
                start = time.perf_counter()
                tensortier.save(sd, path)
                samples[mode].append(total / (time.perf_counter() - start) / 1e9)
                os.unlink(path)
    finally:
        torch.serialization.set_crc32_options(before)
    for mode, v in samples.items():
        print(f"{mode}: median {statistics.median(v):.2f} GB/s ({', '.join(f'{x:.2f}' for x in v)})")


if __name__ == "__main__":
    main()
