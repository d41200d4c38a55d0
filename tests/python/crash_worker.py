"""A save to be killed: ``python crash_worker.py``, driven by test_checkpoint_crash.py.

The worker imports torch and tensortier and builds both versions of the checkpoint first (the
test starts the next worker while it checks the last one, so this cost is off the clock), prints
``ready``, then reads one line ``PATH VERSION`` from stdin, saves version VERSION to PATH with
``tensortier.save(..., checksum=True)``, prints ``saved`` and exits. The test kills it with
SIGKILL somewhere between reading the line and past the end of the save.
"""

from __future__ import annotations

import sys

import torch

# About 210 MiB per version, in tensors of several dtypes and sizes that are no multiple of a
# page (nor of 8 bytes: the uint8 one), so the save writes unaligned ends and several tensors.
LAYOUT: tuple[tuple[str, torch.dtype, int], ...] = (
    ("embed.weight", torch.float32, 20_000_003),
    ("block.0.weight", torch.bfloat16, 30_000_001),
    ("block.0.bias", torch.float16, 4_097),
    ("block.1.weight", torch.float32, 12_345_679),
    ("block.1.index", torch.int64, 3_000_017),
    ("head.mask", torch.uint8, 5_000_011),
)


def state(version: int) -> dict[str, torch.Tensor]:
    """Version `version` of the checkpoint: every tensor of version 0 differs from version 1 in
    every element, so any mix of the two shows in a comparison (the stored checksums catch
    misplaced bytes). Version 1 also has one tensor more."""
    out: dict[str, torch.Tensor] = {}
    for i, (name, dtype, numel) in enumerate(LAYOUT):
        # A period of a few hundred elements repeated (a copy, cheap), prime to a page's count
        # of any element size, so that misplaced pages differ too.
        if dtype == torch.uint8:
            period = (torch.arange(251) * 7 + 1 + 2 * version) % 251
        elif dtype == torch.int64:
            period = torch.arange(257) * 3 + 1_000_003 * (version + 1) + i
        else:
            # Values exact in each float type: at most 8 significant bits, odd for version 1.
            period = torch.arange(127) * 2 + version + 1
        out[name] = period.to(dtype).repeat(-(-numel // len(period)))[:numel].clone()
    if version == 1:
        out["extra.scale"] = torch.full((257,), 0.5, dtype=torch.float64)
    return out


def main() -> int:
    import tensortier

    versions = {v: state(v) for v in (0, 1)}
    print("ready", flush=True)
    line = sys.stdin.readline().split()
    if len(line) != 2:
        return 0  # told to stop (stdin closed)
    path, version = line[0], int(line[1])
    tensortier.save(versions[version], path, checksum=True)
    print("saved", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
