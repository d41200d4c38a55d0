"""Host memory of tensortier.load: the peak grows by the checkpoint's bytes plus the engine's
bounded buffers, never by a second copy of the file (issue 5: "host peak <= checkpoint bytes +
the bounce ring when loading to CPU"; load_into allocates nothing for tensor data)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import tensortier

MIB = 1 << 20
CHECKPOINT_BYTES = 256 * MIB
# The engine's bounce buffers (torch's own tensors start 64 bytes past a page, so O_DIRECT reads
# into them bounce; bounded by the 128 MiB in flight) plus allocator and interpreter noise. A
# load that staged the file would need CHECKPOINT_BYTES more.
SLACK = 128 * MIB + 32 * MIB

# Runs in a fresh process so that the high-water mark of its RSS starts clean.
PEAK_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch, tensortier
    path, mode = sys.argv[1], sys.argv[2]
    def peak():
        # VmHWM, not ru_maxrss: after fork+exec ru_maxrss starts at the parent's RSS.
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmHWM in /proc/self/status")
    # Warm up the engine and the code paths on a tiny file of the same format (not on `path`:
    # that would raise the high-water mark to the very peak this measures).
    tiny = os.path.join(os.path.dirname(path), "tiny" + os.path.splitext(path)[1])
    tensortier.save({"x": torch.ones(1000)}, tiny)
    tensortier.load(tiny)
    if mode == "load":
        before = peak()
        sd = tensortier.load(path)
        after = peak()
        total = sum(t.numel() * t.element_size() for t in sd.values())
    else:
        target = {name: torch.empty(shape, dtype=torch.float32)
                  for name, shape in [(f"t{i}", (8 * 1024 * 1024 // 4,)) for i in range(32)]}
        for t in target.values():
            t.zero_()  # resident before the baseline
        tensortier.load_into({"x": torch.empty(1000)}, tiny)
        before = peak()
        tensortier.load_into(target, path)
        after = peak()
        total = 0
    print(before, after, total)
    """
)


def _state_dict() -> dict[str, torch.Tensor]:
    # 32 tensors x 8 MiB, plus an unaligned small one (bounced through the engine's buffers).
    sd = {f"t{i}": torch.full((8 * MIB // 4,), float(i)) for i in range(32)}
    sd["small"] = torch.arange(1001, dtype=torch.int16)
    return sd


def _peak(path: Path, mode: str) -> tuple[int, int, int]:
    done = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, str(path), mode],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    before, after, total = (int(x) for x in done.stdout.split())
    return before, after, total


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_load_to_cpu_peaks_at_the_checkpoint_bytes_plus_the_engine_buffers(
    tmp_path: Path, suffix: str
) -> None:
    path = tmp_path / f"m{suffix}"
    tensortier.save(_state_dict(), path)
    before, after, total = _peak(path, "load")
    assert total >= CHECKPOINT_BYTES
    growth = after - before
    assert growth >= total // 2, "the measurement saw no load at all"
    assert growth <= total + SLACK, (
        f"peak RSS grew by {growth / MIB:.0f} MiB loading {total / MIB:.0f} MiB of tensors"
    )


def test_load_into_allocates_nothing_for_tensor_data(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    sd = _state_dict()
    del sd["small"]
    tensortier.save(sd, path)
    before, after, _ = _peak(path, "load_into")
    assert after - before <= SLACK, f"peak RSS grew by {(after - before) / MIB:.0f} MiB"
