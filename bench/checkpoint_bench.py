#!/usr/bin/env python3
"""Checkpoint benchmark: tensortier.save/load against torch.save/torch.load, safetensors and fio.

One state dict of SIZE bytes in ~TENSORS tensors (bf16 and fp32 weights of varied shapes, some
int64 tables and a few tiny tensors: biases, scalars, an empty one) is saved and loaded by every
tool in the same run, so that every figure has its baseline measured next to it (BENCHMARKS.md:
on our shared, noisy disk only such ratios mean something). Each figure is the median of
``--repeats`` samples; the tools' order rotates from repeat to repeat (repeat r starts with tool
r mod n) and all samples are printed.

Scenarios (``--scenarios``, default all):

  save   time until the file is durable (every tool's time includes an fsync, as
         tensortier.save's fdatasync + rename + directory fsync):
           tt-safetensors   tensortier.save(sd, "tt.safetensors")
           tt-torch         tensortier.save(sd, "tt.pt")
           torch.save       torch.save(sd, "torch.pt") + fsync
           safetensors      safetensors.torch.save_file(sd, "st.safetensors") + fsync
           fio              fio sequential write of SIZE bytes: io_uring, direct=1, bs=BS,
                            iodepth=QD, --end_fsync=1
  cold   load to CPU after POSIX_FADV_DONTNEED of the file (written and fsynced beforehand):
           tt-safetensors   tensortier.load("tt.safetensors")
           tt-foreign       tensortier.load("st.safetensors")   (written by safetensors: unaligned)
           tt-torch         tensortier.load("tt.pt")
           tt-unstaged      tensortier.load("tt.safetensors") with stage_reads="off": direct
                            reads straight into the new tensors (what tt-safetensors does
                            where TENSORTIER_STAGE_READS=auto does not stage: NVMe)
           tt-trim          tensortier.load("tt.safetensors") through an IOHandle with
                            bounce_idle_ms=0: the engine frees its bounce buffers whenever its
                            workers go idle (the behaviour before TENSORTIER_BOUNCE_IDLE_MS)
           tt-sharded       tensortier.load("tt-shards/model.safetensors.index.json"): the same
                            state dict in SHARDS safetensors files written by tensortier.save,
                            and a Hugging Face index naming them
           tt-sharded-trim  tt-sharded with bounce_idle_ms=0, as tt-trim
           tt-hugepages     tensortier.load("tt.safetensors") with each loaded tensor in a
                            fresh huge-page mapping (the alternative to torch's allocator)
           tt-mmap          tensortier.load("tt.safetensors", mmap=True) + touching every
                            4 KiB page (tensors that map the file, as safetensors' do)
           safetensors      safetensors.torch.load_file("tt.safetensors") + touching every
                            4 KiB page (costs nothing if it copied the data into memory, and
                            charges the page faults if its tensors map the file)
           torch.load       torch.load("tt.pt", mmap=False, weights_only=True)
           torch.load-mmap  torch.load("tt.pt", mmap=True, weights_only=True) + touching every
                            4 KiB page of every tensor
           fio              fio sequential read: io_uring, direct=1, bs=BS, iodepth=QD
           tensorizer       tensorizer.TensorDeserializer("tensorizer.tensors", device="cpu")
                            (eager, its default readers), every tensor taken out of it and every
                            4 KiB page touched; the file is written untimed beforehand by
                            TensorSerializer.write_state_dict of the same state dict, fsynced
           runai-streamer   runai_model_streamer.SafetensorsStreamer: stream_file("tt.safetensors",
                            device="cpu") and every tensor get_tensors() yields kept (owned=True,
                            its default: they stay valid) and every 4 KiB page touched
  warm   the same loads with the file already in the page cache (read once, untimed, just
         before); fio reads buffered (psync, --direct=0 --invalidate=0 --iomem=mmap).
  warm-fresh
         warm loads as a job's start runs them: each sample in a new Python process (imports
         and the untimed warming of the file first; tensortier's engine starts inside the
         timing, as on a first load), so no tool reuses memory that an earlier one freed:
           tt-safetensors, tt-torch, safetensors, torch.load   as in warm
           first-touch      torch.empty(SIZE bytes) and a write to each 4 KiB page on one
                            thread: what handing out SIZE bytes of fresh memory costs at all
                            (report only)
         On the first repeat each process also hashes what it loaded (untimed) and the
         parent compares that with the state dict.
  gpu-cold, gpu-warm   (default when torch sees a CUDA device) load to --gpu-device, each
         timed until the device is done (torch.cuda.synchronize), validated on the first
         repeat; the allocator's cache is filled by one untimed load first:
           tt-safetensors   tensortier.load("tt.safetensors", device=DEV)
           tt-torch         tensortier.load("tt.pt", device=DEV)
           safetensors      safetensors.torch.load_file("tt.safetensors", device=DEV)
           torch.load       torch.load("tt.pt", map_location=DEV, weights_only=True)
           fastsafetensors  fastsafe_open(["tt.safetensors"], device=DEV, nogds=False), every
                            tensor kept (they outlive the block since 0.5.0; report only)
           file-read        the file's bytes read by tensortier into one reused pinned buffer
           h2d              those bytes copied from that pinned buffer to the device
         The limit row, min(file-read, h2d), is the per-repeat minimum of those two.

tensorizer and runai-streamer are optional (pip install tensorizer runai-model-streamer): when
one does not import, it is skipped with a note in its table row. They are report only (issue 5):
their rows have the ratios but no target.

Targets (issue 5): save >= 3x torch.save, >= 2x safetensors, >= 0.9x fio; load to CPU >= 2x
safetensors and torch.load(mmap=False), >= 0.9x fio; load to GPU >= 2x safetensors and >= 0.9x
min(file-read, h2d). The ratio columns compare tt-safetensors
(save/load; the target and result columns are for it), tt-torch and tt-mmap with each tool. fio's write
time is the wall time of the fio process (its own runtime leaves out the end fsync), so it
includes fio's start-up: tens of milliseconds, negligible at 2 GiB, not at --size 64M.

Examples:
  .venv/bin/python bench/checkpoint_bench.py                                 # 2G, 300 tensors
  .venv/bin/python bench/checkpoint_bench.py --size 64M --repeats 1          # smoke test
  .venv/bin/python bench/checkpoint_bench.py --scenarios cold --tools tt-safetensors,fio

Progress goes to stderr, the Markdown report to stdout, everything (all samples, commands,
versions, load averages) to ``--json``. Test files are removed at the end. The exit status is 1
if tensortier raised or returned wrong data.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.metadata
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/_benchlib.py, from any directory
from _benchlib import GB, drop_file_cache, fio_stats, loadavg, log, median, name_list  # noqa: E402
from _benchlib import settle, tool_version, warm_file  # noqa: E402
from _benchlib import parse_size as _parse_size  # noqa: E402

BENCH_DIR = Path(__file__).resolve().parent
SCENARIOS = ("save", "cold", "warm", "warm-fresh", "gpu-cold", "gpu-warm")
FRESH_TOOLS = ("tt-safetensors", "tt-torch", "safetensors", "torch.load", "first-touch")
GPU_TOOLS = ("tt-safetensors", "tt-torch", "safetensors", "torch.load", "fastsafetensors",
             "file-read", "h2d")
LIMIT = "min(file-read, h2d)"
SAVE_TOOLS = ("tt-safetensors", "tt-torch", "torch.save", "safetensors", "fio")
LOAD_TOOLS = ("tt-safetensors", "tt-unstaged", "tt-foreign", "tt-torch", "tt-trim", "tt-sharded",
              "tt-sharded-trim", "tt-hugepages", "tt-mmap", "safetensors",
              "torch.load", "torch.load-mmap", "fio", "tensorizer", "runai-streamer")
OPTIONAL_MODULES = {  # optional load tools (report only) -> (module to import, pip package)
    "tensorizer": ("tensorizer", "tensorizer"),
    "runai-streamer": ("runai_model_streamer", "runai-model-streamer"),
    "fastsafetensors": ("fastsafetensors", "fastsafetensors"),
}
TARGETS = {  # (scenario, baseline) -> minimum ratio tt-safetensors / baseline
    ("save", "torch.save"): 3.0, ("save", "safetensors"): 2.0, ("save", "fio"): 0.9,
    ("cold", "safetensors"): 2.0, ("cold", "torch.load"): 2.0, ("cold", "fio"): 0.9,
    ("warm", "safetensors"): 2.0, ("warm", "torch.load"): 2.0, ("warm", "fio"): 0.9,
    ("warm-fresh", "safetensors"): 2.0, ("warm-fresh", "torch.load"): 2.0,
    ("gpu-cold", "safetensors"): 2.0, ("gpu-cold", LIMIT): 0.9,
    ("gpu-warm", "safetensors"): 2.0, ("gpu-warm", LIMIT): 0.9,
}


class BenchError(Exception):
    """tensortier raised or returned wrong data: reported, exit status 1."""


def parse_size(text: str) -> int:
    """A byte count with an optional K/M/G suffix (powers of 1024): '64M' -> 67108864."""
    return _parse_size(text, "64M, 2G", _at_least_1m)


def _at_least_1m(value: int) -> str | None:
    """``parse_size``'s check."""
    return "size must be at least 1M" if value < (1 << 20) else None


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- the state dict


def make_state_dict(total: int, count: int, seed: int) -> dict[str, Any]:
    """~`count` tensors, ~`total` bytes: 60% bf16 and 30% fp32 weights of varied shapes, 10%
    int64 tables, plus ten tiny ones. Random bytes (every bit pattern: NaNs compare by bytes)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    tiny = 10
    big = max(count - tiny, 3)
    sd: dict[str, Any] = {}
    plan = [("bf16", torch.bfloat16, 0.6), ("fp32", torch.float32, 0.3), ("i64", torch.int64, 0.1)]
    n_by_kind = [max(1, round(big * share)) for _, _, share in plan]
    widths = (1024, 2048, 4096, 3072, 1536, 768, 5120, 1000)
    for (kind, dtype, share), n in zip(plan, n_by_kind):
        budget = int(total * share)
        weights = [1.0 + (i % 7) * 0.5 for i in range(n)]  # varied sizes
        scale = budget / sum(weights)
        for i, w in enumerate(weights):
            width = widths[i % len(widths)]
            rows = max(1, int(w * scale) // (width * dtype.itemsize))
            raw = torch.randint(0, 256, (rows * width * dtype.itemsize,), dtype=torch.uint8,
                                generator=gen)
            sd[f"layers.{i}.{kind}.weight"] = raw.view(dtype).view(rows, width)
    for i in range(tiny - 2):
        sd[f"tiny.{i}.bias"] = torch.randn(3 + i * 5, generator=gen)
    sd["tiny.scalar"] = torch.tensor(42, dtype=torch.int64)
    sd["tiny.empty"] = torch.empty(0, 8)
    return sd


def nbytes(sd: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def check_same(got: dict[str, Any], ref: dict[str, Any], what: str) -> None:
    """Raise BenchError naming the first tensor whose bytes differ."""
    import torch

    if set(got) != set(ref):
        raise BenchError(f"{what}: names differ: {sorted(set(got) ^ set(ref))[:5]}")
    for k, r in ref.items():
        t = got[k]
        if t.dtype != r.dtype or t.shape != r.shape:
            raise BenchError(
                f"{what}: {k} is {t.dtype}{tuple(t.shape)}, not {r.dtype}{tuple(r.shape)}")
        if r.numel() and not torch.equal(t.contiguous().view(-1).view(torch.uint8),
                                         r.view(-1).view(torch.uint8)):
            raise BenchError(f"{what}: the bytes of {k} differ")


def touch_pages(sd: dict[str, Any]) -> int:
    """Read one byte of every 4 KiB page of every tensor (faults mmap'd pages in)."""
    import torch

    total = 0
    for t in sd.values():
        if t.numel():
            total += int(t.view(-1).view(torch.uint8)[::4096].sum())
    return total


# --------------------------------------------------------------------------- tools


@dataclass
class Settings:
    directory: Path
    size: int
    tensors: int
    repeats: int
    scenarios: list[str]
    tools: list[str] | None
    json_path: Path
    fio: str
    fio_bs: int
    fio_iodepth: int
    seed: int
    verify: bool
    command: str
    gpu_device: str = "cuda:0"
    child: str | None = None  # warm-fresh: this process runs one load of this tool
    child_digest: bool = False


@dataclass
class Samples:
    values: dict[str, list[float]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    verified: set[str] = field(default_factory=set)  # tools whose loaded data was compared

    def add(self, tool: str, value: float) -> None:
        self.values.setdefault(tool, []).append(value)

    def median(self, tool: str) -> float | None:
        return median(self.values.get(tool, []))


def run_fio(s: Settings, path: Path, rw: str, warm: bool = False) -> tuple[float, str]:
    """One sequential fio job over the state dict's bytes; returns (seconds, command)."""
    if warm:
        engine = ["--ioengine=psync", "--direct=0", "--invalidate=0", "--iomem=mmap"]
    else:
        engine = ["--ioengine=io_uring", "--direct=1", f"--iodepth={s.fio_iodepth}"]
    size = -(-s.size // s.fio_bs) * s.fio_bs  # fio moves whole blocks: round up
    argv = [s.fio, f"--name=ckpt-bench-{rw}", f"--filename={path}", f"--rw={rw}",
            f"--size={size}", f"--bs={s.fio_bs}", "--numjobs=1", "--output-format=json",
            *engine, *(["--end_fsync=1"] if rw == "write" else [])]
    command = shlex.join(argv)
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
    seconds = time.perf_counter() - start  # fio's own runtime leaves out the end fsync
    stats = fio_stats(proc, command, rw, size)
    # reads: fio's own runtime; writes: the wall time of the process, as fio's runtime leaves
    # out the end fsync (start-up costs ~10 ms). Scaled to the state dict's bytes.
    runtime = stats["runtime"] / 1000.0 if rw == "read" else seconds
    return runtime * s.size / size, command


def save_tool(s: Settings, tool: str, sd: dict[str, Any]) -> float:
    """Run one save; returns seconds until the file is durable."""
    import torch

    import tensortier

    d = s.directory
    start = time.perf_counter()
    if tool == "tt-safetensors":
        tensortier.save(sd, d / "tt.safetensors")
    elif tool == "tt-torch":
        tensortier.save(sd, d / "tt.pt")
    elif tool == "torch.save":
        torch.save(sd, d / "torch.pt")
        fsync_path(d / "torch.pt")
    elif tool == "safetensors":
        from safetensors.torch import save_file

        save_file(sd, d / "st.safetensors")
        fsync_path(d / "st.safetensors")
    elif tool == "fio":
        seconds, _ = run_fio(s, d / "fio.dat", "write")
        return seconds
    return time.perf_counter() - start


LOAD_FILES = {
    "tt-safetensors": "tt.safetensors", "tt-foreign": "st.safetensors", "tt-torch": "tt.pt",
    "tt-hugepages": "tt.safetensors", "tt-mmap": "tt.safetensors", "tt-unstaged": "tt.safetensors",
    "safetensors": "tt.safetensors", "torch.load": "tt.pt", "torch.load-mmap": "tt.pt",
    "fio": "fio.dat", "tensorizer": "tensorizer.tensors", "runai-streamer": "tt.safetensors",
    "fastsafetensors": "tt.safetensors", "file-read": "tt.safetensors", "h2d": "tt.safetensors",
    "tt-trim": "tt.safetensors", "tt-sharded": "tt-shards/model.safetensors.index.json",
    "tt-sharded-trim": "tt-shards/model.safetensors.index.json",
}
SHARDS = 8
BENCH_FILES = ("tt.safetensors", "tt.pt", "torch.pt", "st.safetensors", "fio.dat",
               "tensorizer.tensors")


def tensorizer_save(sd: dict[str, Any], path: Path) -> None:
    """Write ``sd`` with tensorizer's TensorSerializer and fsync it (untimed setup)."""
    from tensorizer import TensorSerializer

    serializer = TensorSerializer(str(path))
    serializer.write_state_dict(sd)
    serializer.close()
    fsync_path(path)


def tensorizer_load(path: Path) -> dict[str, Any]:
    """Load every tensor of a tensorizer file to CPU. Eager (lazy_load=False, the default): the
    constructor reads all tensors; they come out as Parameters, detached here (free, no copy)."""
    from tensorizer import TensorDeserializer

    with TensorDeserializer(str(path), device="cpu") as deserializer:
        return {name: t.detach() for name, t in deserializer.items()}


def runai_load(path: Path) -> dict[str, Any]:
    """Stream every tensor of a safetensors file to CPU with runai-model-streamer. Yielded
    tensors are owned by the caller (owned=True, the default), so keeping them keeps the data."""
    from runai_model_streamer import SafetensorsStreamer

    with SafetensorsStreamer() as streamer:
        streamer.stream_file(str(path), device="cpu", owned=True)
        return dict(streamer.get_tensors())


class _HugePageTensors:
    """Inside: tensortier.load puts each loaded tensor in a fresh page-aligned mapping with
    transparent huge pages (as earlier versions did) instead of torch's allocator: the
    alternative to the default, measured in the same run."""

    def __enter__(self) -> None:
        import torch

        from tensortier import _core, checkpoint

        def alloc(numel: int, dtype: Any, misalign: int = 0) -> Any:
            nbytes = numel * dtype.itemsize
            if nbytes < checkpoint._format._ALIGNED_ALLOC_MIN:
                return torch.empty(numel, dtype=dtype)
            misalign = 0 if misalign % dtype.itemsize else misalign
            buffer = _core.AlignedBuffer(nbytes + misalign, reused=True)
            return torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes,
                                    offset=misalign).view(dtype)

        self._saved = checkpoint.mapping._host_alloc
        checkpoint.mapping._host_alloc = alloc

    def __exit__(self, *exc: object) -> None:
        from tensortier import checkpoint

        checkpoint.mapping._host_alloc = self._saved


def load_tool(s: Settings, tool: str, warm: bool) -> tuple[float, dict[str, Any] | None]:
    """Run one load to CPU; returns (seconds, what was loaded or None for fio)."""
    import torch

    import tensortier

    path = s.directory / LOAD_FILES[tool]
    data_files = sorted(path.parent.glob("*.safetensors")) if path.suffix == ".json" else [path]
    for data in data_files:
        if warm:
            warm_file(data, 16 << 20, reuse=True)
        else:
            drop_file_cache(data, sync=os.fdatasync)
    if tool == "fio":
        return run_fio(s, path, "read", warm)[0], None
    handle = (_unstaged_io() if tool == "tt-unstaged"  # made before the timing
              else _trimming_io() if tool.endswith("-trim") else None)
    if tool == "safetensors":
        from safetensors.torch import load_file  # imported before the timing, as torch is
    if tool.startswith("tt-") and not s.child:
        from tensortier.checkpoint._engine import _default_io

        held = (handle or _default_io()).bounce_bytes
        log(f"    {tool}: engine holds {held / (1 << 20):.0f} MiB of bounce buffers at the start")
    start = time.perf_counter()
    if tool == "tt-hugepages":
        with _HugePageTensors():
            out = tensortier.load(path, progress=False)
    elif tool == "tt-mmap":
        out = tensortier.load(path, mmap=True, progress=False)
        touch_pages(out)
    elif handle is not None:
        out = tensortier.load(path, progress=False, _io=handle)
    elif tool.startswith("tt-"):
        out = tensortier.load(path, progress=False)
    elif tool == "safetensors":
        out = load_file(path)
        touch_pages(out)  # in case its tensors are lazily mapped: count the reads they need
    elif tool == "torch.load":
        out = torch.load(path, mmap=False, weights_only=True)
    elif tool == "torch.load-mmap":
        out = torch.load(path, mmap=True, weights_only=True)
        touch_pages(out)
    elif tool == "tensorizer":
        out = tensorizer_load(path)
        touch_pages(out)  # costs nothing if they hold their data, as they should
    else:
        out = runai_load(path)
        touch_pages(out)
    return time.perf_counter() - start, out


def state_digest(sd: dict[str, Any]) -> str:
    """A hash of a state dict's names, dtypes, shapes and bytes, in name order."""
    import hashlib

    import torch

    h = hashlib.blake2b(digest_size=16)
    for name in sorted(sd):
        t = sd[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def run_child(s: Settings, tool: str, digest: bool) -> tuple[float, str | None]:
    """One warm-fresh sample: `tool`'s load in a new Python process; (seconds, digest or None)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--dir", str(s.directory),
           "--size", str(s.size), "--child", tool] + (["--child-digest"] if digest else [])
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    if run.returncode != 0:
        raise RuntimeError(f"exit {run.returncode}: {run.stderr.strip()[-2000:]}")
    result = json.loads(run.stdout.strip().splitlines()[-1])
    return float(result["seconds"]), result.get("digest")


def child_main(s: Settings) -> int:
    """The process of one warm-fresh sample: prints {"seconds": ..., "digest": ...} as JSON."""
    import torch

    assert s.child is not None
    if s.child == "first-touch":
        start = time.perf_counter()
        memory = torch.empty(s.size, dtype=torch.uint8)
        memory[::4096].fill_(1)
        print(json.dumps({"seconds": time.perf_counter() - start}))
        return 0
    seconds, out = load_tool(s, s.child, warm=True)
    result: dict[str, Any] = {"seconds": seconds}
    if s.child_digest and out is not None:
        result["digest"] = state_digest(out)
    print(json.dumps(result))
    return 0


_UNSTAGED_IO: Any = None


def _unstaged_io() -> Any:
    """An IOHandle whose direct reads go straight into the new tensors (no staging)."""
    global _UNSTAGED_IO
    import tensortier

    if _UNSTAGED_IO is None:
        _UNSTAGED_IO = tensortier.IOHandle(stage_reads="off")
    return _UNSTAGED_IO


_TRIMMING_IO: Any = None


def _trimming_io() -> Any:
    """An IOHandle whose idle workers free their bounce buffers at once (bounce_idle_ms=0)."""
    global _TRIMMING_IO
    import tensortier

    if _TRIMMING_IO is None:
        _TRIMMING_IO = tensortier.IOHandle(bounce_idle_ms=0)
    return _TRIMMING_IO


def save_shards(sd: dict[str, Any], directory: Path, shards: int) -> None:
    """``sd`` as `shards` safetensors files of about equal bytes (tensortier.save) and a Hugging
    Face ``model.safetensors.index.json`` naming them (untimed setup)."""
    import tensortier

    directory.mkdir(parents=True, exist_ok=True)
    share = -(-nbytes(sd) // shards)
    groups: list[dict[str, Any]] = [{}]
    filled = 0
    for name, t in sd.items():
        if filled >= share * len(groups) and len(groups) < shards:
            groups.append({})
        groups[-1][name] = t
        filled += t.numel() * t.element_size()
    weight_map = {}
    for i, group in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensortier.save(group, directory / file)
        weight_map.update({name: file for name in group})
    index = {"metadata": {"total_size": nbytes(sd)}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


class GpuLoads:
    """The loads of the gpu-* scenarios, with the buffers the limits reuse."""

    def __init__(self, s: Settings) -> None:
        import torch

        import tensortier

        self.device = torch.device(s.gpu_device)
        if self.device.type == "cuda" and self.device.index is None:  # "cuda": the current one
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.size = (s.directory / "tt.safetensors").stat().st_size
        on_gpu = self.device.type == "cuda"
        # --gpu-device cpu (a dry run of this code on machines without a GPU): plain memory
        self.host = (tensortier.pinned_empty(self.size) if on_gpu
                     else tensortier.aligned_empty(self.size, reused=True, resident=True))
        self.target = torch.empty(self.size, dtype=torch.uint8, device=self.device)
        self.io = tensortier.IOHandle()

    def sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def run(self, s: Settings, tool: str, warm: bool) -> tuple[float, dict[str, Any] | None]:
        """One load (cache prepared first); returns (seconds, what was loaded or None)."""
        import torch

        import tensortier

        path = s.directory / LOAD_FILES[tool]
        if tool != "h2d":
            if warm:
                warm_file(path, 16 << 20, reuse=True)
            else:
                drop_file_cache(path, sync=os.fdatasync)
        dev = str(self.device)
        self.sync()
        start = time.perf_counter()
        out: dict[str, Any] | None = None
        if tool == "file-read":
            n = self.io.pread(self.host, path)
            if n != self.size:
                raise BenchError(f"file-read: {n} of {self.size} bytes")
        elif tool == "h2d":
            self.target.copy_(self.host, non_blocking=True)
        elif tool.startswith("tt-"):
            out = tensortier.load(path, device=dev, progress=False)
        elif tool == "safetensors":
            from safetensors.torch import load_file

            out = load_file(path, device=dev)
        elif tool == "torch.load":
            out = torch.load(path, map_location=dev, weights_only=True)
        else:
            from fastsafetensors import fastsafe_open

            with fastsafe_open(filenames=[str(path)], device=dev, nogds=False) as f:
                # 0.5.0: its tensors share ownership of the loader's buffer and outlive the block
                out = {k: f.get_tensor(k) for k in f.keys()}
        self.sync()
        seconds = time.perf_counter() - start
        if out is not None:
            return seconds, out
        # The limits move the file's bytes (header included): scale to the state dict's.
        return seconds * s.size / self.size, None

    def close(self) -> None:
        self.io.close()
        del self.host, self.target


def ensure_files(s: Settings, sd: dict[str, Any], tools: Sequence[str]) -> dict[str, str]:
    """The files the loads read, written untimed when the save scenario did not run (the
    tensorizer file always: no save tool writes it). Returns {optional tool: why its file could
    not be written}; such a tool is skipped, while any other failure here raises."""
    import torch

    import tensortier

    d = s.directory
    needed = {LOAD_FILES[t] for t in tools}
    if "tt.safetensors" in needed and not (d / "tt.safetensors").exists():
        tensortier.save(sd, d / "tt.safetensors")
    if "tt.pt" in needed and not (d / "tt.pt").exists():
        tensortier.save(sd, d / "tt.pt")
    shards = d / "tt-shards"
    if LOAD_FILES["tt-sharded"] in needed and not (shards / "model.safetensors.index.json").exists():
        save_shards(sd, shards, SHARDS)
    if "st.safetensors" in needed and not (d / "st.safetensors").exists():
        from safetensors.torch import save_file

        save_file(sd, d / "st.safetensors")
        fsync_path(d / "st.safetensors")
    if "fio.dat" in needed and not (d / "fio.dat").exists():
        run_fio(s, d / "fio.dat", "write")
    failed: dict[str, str] = {}
    if "tensorizer.tensors" in needed and not (d / "tensorizer.tensors").exists():
        try:
            tensorizer_save(sd, d / "tensorizer.tensors")
        except Exception as e:  # noqa: BLE001 - an optional tool failing is reported, not fatal
            failed["tensorizer"] = f"failed to write its file: {type(e).__name__}: {e}"
            log(f"  tensorizer: {failed['tensorizer']}")
    del torch
    return failed


def warm_up(s: Settings) -> None:
    """Untimed: one tiny save and load per library, so that imports, the engine's start and its
    first buffers are not charged to whichever tool runs first."""
    import torch

    import tensortier

    tiny = {"w": torch.randn(4096), "i": torch.arange(10)}
    d = s.directory
    for name in ("warm.safetensors", "warm.pt"):
        tensortier.save(tiny, d / name)
        tensortier.load(d / name, progress=False)
    torch.save(tiny, d / "warm-torch.pt")
    torch.load(d / "warm-torch.pt", weights_only=True)
    torch.load(d / "warm-torch.pt", weights_only=True, mmap=True)
    if available("safetensors") is None:
        from safetensors.torch import load_file, save_file

        save_file(tiny, d / "warm-st.safetensors")
        load_file(d / "warm-st.safetensors")
    optional = {"tensorizer": lambda: (tensorizer_save(tiny, d / "warm.tensors"),
                                       tensorizer_load(d / "warm.tensors")),
                "runai-streamer": lambda: runai_load(d / "warm.safetensors")}
    for tool, warm in optional.items():
        if available(tool) is None:
            try:
                warm()
            except Exception as e:  # noqa: BLE001 - its timed runs will fail and say why
                log(f"  warm-up of {tool} failed: {type(e).__name__}: {e}")
    for name in ("warm.safetensors", "warm.pt", "warm-torch.pt", "warm-st.safetensors",
                 "warm.tensors"):
        try:
            (d / name).unlink()
        except FileNotFoundError:
            pass


def available(tool: str) -> str | None:
    """Why `tool` cannot run here, or None."""
    if tool in ("safetensors", "tt-foreign"):
        try:
            import safetensors.torch  # noqa: F401
        except ImportError:
            return "safetensors is not installed"
    if tool in OPTIONAL_MODULES:
        module, package = OPTIONAL_MODULES[tool]
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - any import failure only skips the tool
            return f"{module} does not import ({type(e).__name__}: {e}); pip install {package}"
    return None


def package_version(package: str) -> str | None:
    """The installed version of a pip package, or None."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def run_scenario(s: Settings, scenario: str, sd: dict[str, Any]) -> tuple[Samples, list[str]]:
    gpu = scenario.startswith("gpu-")
    fresh = scenario == "warm-fresh"
    all_tools = (SAVE_TOOLS if scenario == "save" else GPU_TOOLS if gpu
                 else FRESH_TOOLS if fresh else LOAD_TOOLS)
    tools = [t for t in all_tools if s.tools is None or t in s.tools]
    samples = Samples()
    for t in list(tools):
        why = available(t)
        if why:
            samples.errors[t] = f"skipped: {why}"
            tools.remove(t)
    if scenario != "save":
        files_for = [t for t in tools if t != "first-touch"] + (["tt-safetensors"] if gpu else [])
        for t, why in ensure_files(s, sd, files_for).items():
            samples.errors[t] = why
            tools.remove(t)
    total = nbytes(sd)
    loads = GpuLoads(s) if gpu else None
    if loads is not None:
        import tensortier

        # Untimed: the device allocator's cache holds a state dict's blocks before anyone runs.
        tensortier.load(s.directory / "tt.safetensors", device=s.gpu_device, progress=False)
    expected: str | None = None  # warm-fresh: the state dict's digest
    for repeat in range(s.repeats):
        order = tools[repeat % len(tools):] + tools[:repeat % len(tools)]
        for tool in order:
            if tool in samples.errors:
                continue
            settle()
            gc.collect()
            try:
                if scenario == "save":
                    seconds, out = save_tool(s, tool, sd), None
                elif loads is not None:
                    seconds, out = loads.run(s, tool, scenario == "gpu-warm")
                elif fresh:
                    digest = s.verify and repeat == 0 and tool != "first-touch"
                    seconds, got = run_child(s, tool, digest)
                    if digest and expected is None:
                        expected = state_digest(sd)
                    if digest and got != expected:
                        raise BenchError(f"{scenario} {tool}: loaded data differs (digest)")
                    if digest:
                        samples.verified.add(tool)
                    out = None
                else:
                    seconds, out = load_tool(s, tool, scenario == "warm")
            except BenchError:
                raise
            except Exception as e:  # noqa: BLE001 - a failing tool is reported, not fatal
                if tool.startswith("tt-"):
                    raise BenchError(f"{scenario} {tool}: {type(e).__name__}: {e}") from e
                samples.errors[tool] = f"failed: {type(e).__name__}: {e}"
                log(f"  {scenario} {tool}: {samples.errors[tool]}")
                continue
            if out is not None and s.verify and repeat == 0:
                if gpu:
                    for k, t in out.items():
                        if t.device != loads.device:  # type: ignore[union-attr]
                            raise BenchError(f"{scenario} {tool}: {k} is on {t.device}")
                    out = {k: t.cpu() for k, t in out.items()}
                check_same(out, sd, f"{scenario} {tool}")
                samples.verified.add(tool)
            del out
            gbps = total / seconds / GB
            samples.add(tool, gbps)
            log(f"  {scenario} repeat {repeat + 1}/{s.repeats} {tool}: {seconds:.3f} s "
                f"{gbps:.2f} GB/s")
    if loads is not None:
        loads.close()
        read, h2d = samples.values.get("file-read", []), samples.values.get("h2d", [])
        if read and len(read) == len(h2d):
            samples.values[LIMIT] = [min(a, b) for a, b in zip(read, h2d)]
            tools.append(LIMIT)
    return samples, tools


def report(scenario: str, samples: Samples, tools: Sequence[str]) -> tuple[str, dict[str, Any]]:
    """A Markdown table (GB/s medians, samples, ratio of tt-safetensors to each tool, target)."""
    ours = samples.median("tt-safetensors")
    ours_pt = samples.median("tt-torch")
    ours_mm = samples.median("tt-mmap")
    title = {"save": "save (until durable)", "cold": "load to CPU, cold cache",
             "warm": "load to CPU, warm cache", "gpu-cold": "load to GPU, cold cache",
             "gpu-warm": "load to GPU, warm cache",
             "warm-fresh": "load to CPU, warm cache, one load per new process"}[scenario]
    lines = [f"### {title}", "",
             "| tool | GB/s (median) | samples | tt-safetensors / tool | target | result "
             "| tt-torch / tool | tt-mmap / tool |",
             "|---|---|---|---|---|---|---|---|"]
    rows = {}
    for tool in list(tools) + [t for t in samples.errors if t not in tools]:
        med = samples.median(tool)
        r = ours / med if ours and med else None
        r_pt = ours_pt / med if ours_pt and med else None
        r_mm = ours_mm / med if ours_mm and med else None
        target = TARGETS.get((scenario, tool))
        result = "n/a" if r is None or target is None else ("pass" if r >= target else "miss")
        if tool in samples.errors and med is None:
            result = samples.errors[tool]
        vals = ", ".join(f"{v:.2f}" for v in samples.values.get(tool, []))
        lines.append(f"| {tool} | {'-' if med is None else f'{med:.2f}'} | {vals} | "
                     f"{'-' if r is None else f'{r:.2f}'} | "
                     f"{'-' if target is None else f'>= {target}'} | {result} | "
                     f"{'-' if r_pt is None else f'{r_pt:.2f}'} | "
                     f"{'-' if r_mm is None else f'{r_mm:.2f}'} |")
        rows[tool] = {"median_gbps": med, "samples_gbps": samples.values.get(tool, []),
                      "ratio": r, "target": target, "result": result, "ratio_tt_torch": r_pt,
                      "ratio_tt_mmap": r_mm, "verified": tool in samples.verified}
    return "\n".join(lines) + "\n", rows


def parse_args(argv: Sequence[str] | None) -> Settings:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, default=Path("./tensortier-data/checkpoint-bench"),
                   help="directory for the test files, on the disk under test "
                   "(default: %(default)s)")
    p.add_argument("--size", type=parse_size, default=parse_size("2G"),
                   help="state dict bytes (default: 2G)")
    p.add_argument("--tensors", type=int, default=300,
                   help="about this many tensors (default: 300)")
    p.add_argument("--repeats", type=int, default=3, help="samples per figure (default: 3)")
    p.add_argument("--scenarios", type=name_list(SCENARIOS), default=None,
                   help="comma-separated subset of " + ",".join(SCENARIOS) + " (default: all; "
                   "the gpu ones only when torch sees a CUDA device)")
    p.add_argument("--tools", type=name_list(sorted(set(SAVE_TOOLS + LOAD_TOOLS + GPU_TOOLS
                                                          + FRESH_TOOLS))),
                   default=None,
                   help="comma-separated subset of the tools (default: all)")
    p.add_argument("--json", type=Path, default=BENCH_DIR / "results" / "checkpoint_bench.json",
                   help="where to write all results (default: bench/results/checkpoint_bench.json)")
    p.add_argument("--fio", default="fio", help="fio binary (default: fio)")
    p.add_argument("--fio-bs", type=parse_size, default=parse_size("4M"), help="fio block size")
    p.add_argument("--fio-iodepth", type=int, default=32, help="fio iodepth (default: 32)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    p.add_argument("--no-verify", action="store_true",
                   help="do not compare what the first repeat loads with the state dict")
    p.add_argument("--child", choices=FRESH_TOOLS, help=argparse.SUPPRESS)
    p.add_argument("--child-digest", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--gpu-device", default="cuda:0",
                   help="device of the gpu-* scenarios (default: cuda:0; 'cpu' runs their code "
                   "without a GPU, a check of this script, not a figure)")
    a = p.parse_args(argv)
    if a.scenarios is None and a.child is None:
        a.scenarios = [sc for sc in SCENARIOS if not sc.startswith("gpu-")]
        import torch

        if torch.cuda.is_available():
            a.scenarios += ["gpu-cold", "gpu-warm"]
    if a.repeats <= 0 or a.tensors < 13 or a.fio_iodepth <= 0:
        raise SystemExit("--repeats and --fio-iodepth must be positive, --tensors >= 13")
    return Settings(a.dir.resolve(), a.size, a.tensors, a.repeats, a.scenarios or [], a.tools,
                    a.json, a.fio, a.fio_bs, a.fio_iodepth, a.seed, not a.no_verify,
                    shlex.join([sys.executable, *sys.argv]), a.gpu_device, a.child,
                    a.child_digest)


def main(argv: Sequence[str] | None = None) -> int:
    s = parse_args(argv)
    if s.child is not None:
        return child_main(s)
    import torch

    import tensortier

    s.directory.mkdir(parents=True, exist_ok=True)
    log(f"building a {s.size / 2**30:.2f} GiB state dict of ~{s.tensors} tensors")
    sd = make_state_dict(s.size, s.tensors, s.seed)
    s.size = nbytes(sd)  # what fio moves too
    log(f"  {len(sd)} tensors, {s.size} bytes")
    results: dict[str, Any] = {
        "command": s.command, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "kernel": platform.release(), "python": platform.python_version(),
        "torch": torch.__version__, "tensortier": tensortier.__version__,
        "fio": tool_version([s.fio, "--version"]), "cpus": os.cpu_count(),
        "tensors": len(sd), "bytes": s.size,
        "dtypes": sorted({str(t.dtype) for t in sd.values()}), "scenarios": {},
    }
    try:
        import safetensors

        results["safetensors"] = safetensors.__version__
    except ImportError:
        results["safetensors"] = None
    for _, package in OPTIONAL_MODULES.values():
        results[package] = package_version(package)
    status = 0
    warm_up(s)
    out = [f"## checkpoint_bench: {len(sd)} tensors, {s.size / 2**30:.2f} GiB, "
           f"median of {s.repeats}\n", f"`{s.command}`\n"]
    try:
        for scenario in s.scenarios:
            log(f"scenario {scenario}")
            results[f"loadavg_before_{scenario}"] = loadavg()
            samples, tools = run_scenario(s, scenario, sd)
            table, rows = report(scenario, samples, tools)
            out.append(table)
            results["scenarios"][scenario] = rows
    except BenchError as e:
        log(f"ERROR: {e}")
        results["error"] = str(e)
        status = 1
    finally:
        for name in BENCH_FILES:
            try:
                (s.directory / name).unlink()
            except FileNotFoundError:
                pass
        shutil.rmtree(s.directory / "tt-shards", ignore_errors=True)
    print("\n".join(out))
    s.json_path.parent.mkdir(parents=True, exist_ok=True)
    s.json_path.write_text(json.dumps(results, indent=2) + "\n")
    log(f"results written to {s.json_path}")
    return status


if __name__ == "__main__":
    sys.exit(main())
