"""Saves to be killed: ``python crash_worker.py``, driven by test_checkpoint_crash.py.

The worker imports torch and tensortier and builds both versions of the checkpoint once, prints
``ready``, then serves commands read from stdin, one a line:

- ``save PATH VERSION``: forks a child that saves version VERSION to PATH with
  ``tensortier.save(..., checksum=True)``, prints ``saved PID`` and exits; the worker prints
  ``started PID`` at once. The test kills the child with SIGKILL somewhere between its start and
  past the end of its save. A fork is ready at once (the import and the tensors are the
  parent's), so each kill costs only the save and the checks.
- ``reap PID``: waits for that child and prints ``reaped PID STATUS`` (its exit code, or minus
  the signal that killed it), so that its pid no longer names a process.

The worker is single-threaded when it forks (torch's intra-op pool is kept to this thread, and
no tensortier engine exists before a save), so the children start in a consistent state.
"""

from __future__ import annotations

import os
import sys
import traceback

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


def save_in_child(versions: dict[int, dict[str, torch.Tensor]], path: str, version: int) -> None:
    """The forked child: saves, says so, exits without running the parent's exit handlers."""
    import tensortier

    code = 0
    try:
        tensortier.save(versions[version], path, checksum=True)
        os.write(1, f"saved {os.getpid()}\n".encode())
    except BaseException:  # noqa: BLE001 - reported to the test through stderr and the status
        traceback.print_exc()
        sys.stderr.flush()
        code = 1
    os._exit(code)


def main() -> int:
    torch.set_num_threads(1)  # no thread pool for fork() to leave behind
    import tensortier  # noqa: F401 - imported before forking, not in each child

    versions = {v: state(v) for v in (0, 1)}
    print("ready", flush=True)
    for line in sys.stdin:
        words = line.split()
        if words[:1] == ["save"] and len(words) == 3:
            pid = os.fork()
            if pid == 0:
                save_in_child(versions, words[1], int(words[2]))
            print(f"started {pid}", flush=True)
        elif words[:1] == ["reap"] and len(words) == 2:
            pid = int(words[1])
            _, status = os.waitpid(pid, 0)
            print(f"reaped {pid} {os.waitstatus_to_exitcode(status)}", flush=True)
        else:
            print(f"bad command {line!r}", file=sys.stderr, flush=True)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
