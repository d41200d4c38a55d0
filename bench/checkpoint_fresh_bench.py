#!/usr/bin/env python3
"""Checkpoint loads and saves in new processes: every sample a new Python process.

A job loads its checkpoint once per process (a server starting, a job resuming), so here every
sample, load and save alike, runs in a new Python process: no loader reuses memory, buffers or
threads that an earlier one left behind. The state dict is shaped like a 1B-parameter LLM (a
Llama-style model with 22 layers of hidden size 2048: 268 tensors, bf16 matrices up to
32000x2048, fp32 norms and rotary tables, one int64 table), ~2.2 GB; ``--size`` scales every
matrix's rows so that quick runs keep the same 268 tensors.

Before each load the parent drops the file's pages from the page cache (POSIX_FADV_DONTNEED on
that file only, never a global drop_caches) and checks with mincore what stayed; the fraction is
recorded. Each child imports its libraries untimed, then times the load plus a read of one byte
of every 4 KiB page of every loaded tensor (lazy or mapped loaders pay their reads), and reports
its peak RSS (VmHWM) and the RSS it had before the timing (VmRSS). On the first round each child
also hashes what it loaded (untimed) and the parent compares that with the state dict's hash.

Warm loads (``--warm``): the same loaders, each sample again in a new process, with the file
read once through the page cache just before (untimed; mincore's cached fraction is recorded):
a job starting on a checkpoint another process just wrote or read. fio reads with psync through
the page cache here. safetensors.load_file maps the file; the others copy it.

Loads (cold, ``--loads``):
  tt-safetensors   tensortier.load("tt.safetensors")
  tt-torch         tensortier.load("tt.pt")
  safetensors      safetensors.torch.load_file("tt.safetensors")  (the ratio column's baseline)
  torch.load       torch.load("tt.pt", mmap=False, weights_only=True)
  tensorizer       tensorizer.TensorDeserializer("tensorizer.tensors", device="cpu"), every
                   tensor taken out (file written untimed by TensorSerializer)
  runai-streamer   runai_model_streamer.SafetensorsStreamer: stream_file("tt.safetensors",
                   device="cpu"), every tensor kept
  fastsafetensors  fastsafe_open(["tt.safetensors"], device="cpu", nogds=True), every tensor
                   kept (CPU, no GDS)
  fio              fio: io_uring, direct=1, bs=1M, iodepth=32 sequential read (its own process,
                   no peak RSS recorded: the kernel's counts the forking parent's pages)

Saves (``--saves``), each timed until durable; the child builds the state dict untimed first:
  tt-safetensors   tensortier.save(sd, "save-tt.safetensors")
  tt-torch         tensortier.save(sd, "save-tt.pt")
  torch.save       torch.save(sd, "save-torch.pt") + fsync   (the ratio column's baseline)
  safetensors      safetensors.torch.save_file(sd, "save-st.safetensors") + fsync
  fio              fio: io_uring, direct=1, bs=1M, iodepth=32 sequential write; its own runtime
                   plus an fsync of the file right after (fio's start-up, which fills its
                   buffers with random bytes, is left out: 0.3-0.9 s here)
Every save writes over the previous round's file, as a job saving ``latest`` each epoch does.
After the first round the files tensortier saved are read back (mapped, untimed) and hashed.

Each round runs every tool once, in an order rotated from round to round (round r starts with
tool r mod n); the figures are medians over ``--rounds`` (default 5). The disk is left to settle
(sync, no requests in flight) before every sample.

The loaders other than tensortier, safetensors and torch are optional, installed for this
benchmark only (never dependencies of tensortier); one that does not import is skipped with a
printed line. The versions the figures in BENCHMARKS.md used:

  .venv/bin/python -m pip install tensorizer==2.12.1 runai-model-streamer==0.17.0 \\
      fastsafetensors==0.5.0

Targets checked (new-process loads and saves): tensortier's cold loads >= 1.2x the fastest other
loader (fio is the disk's rate, reported, not a loader) and >= 1.5x safetensors.load_file; peak
RSS growth of a cold load <= the file's size + 64 MiB; saves >= 5x torch.save and >= 1.0x fio;
warm loads >= 1.3x the fastest copying loader (all but safetensors.load_file, which maps).

Examples:
  .venv/bin/python bench/checkpoint_fresh_bench.py                    # 2.2 GB, 5 rounds
  .venv/bin/python bench/checkpoint_fresh_bench.py --size 64M --rounds 1 --saves none
  .venv/bin/python bench/checkpoint_fresh_bench.py --size 256M --rounds 3 --loads none --saves none

Progress goes to stderr, the Markdown report to stdout, everything (all samples, peak RSS, cache
fractions, commands, versions, load averages) to ``--json``. Test files are removed at the end.
The exit status is 1 if tensortier raised or any loader returned wrong data.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, from any directory
from _benchlib import GB, cached_fraction, drop_file_cache, fio_stats, loadavg  # noqa: E402
from _benchlib import log, median, name_list, ratio, settle, tool_version  # noqa: E402
from _benchlib import warm_file  # noqa: E402
from checkpoint_bench import OPTIONAL_MODULES, fsync_path, parse_size, runai_load  # noqa: E402
from checkpoint_bench import state_digest, tensorizer_load, tensorizer_save  # noqa: E402
from checkpoint_bench import touch_pages  # noqa: E402

BENCH_DIR = Path(__file__).resolve().parent
LOADS = ("tt-safetensors", "tt-torch", "safetensors", "torch.load", "tensorizer",
         "runai-streamer", "fastsafetensors", "fio")
SAVES = ("tt-safetensors", "tt-torch", "torch.save", "safetensors", "fio")
OURS = ("tt-safetensors", "tt-torch")
MAPPING = ("safetensors",)  # loaders whose tensors map the file rather than copy it
LOAD_BASELINE, SAVE_BASELINE = "safetensors", "torch.save"
LOAD_FILES = {"tt-safetensors": "tt.safetensors", "tt-torch": "tt.pt",
              "safetensors": "tt.safetensors", "torch.load": "tt.pt",
              "tensorizer": "tensorizer.tensors", "runai-streamer": "tt.safetensors",
              "fastsafetensors": "tt.safetensors", "fio": "fio-read.dat"}
SAVE_FILES = {"tt-safetensors": "save-tt.safetensors", "tt-torch": "save-tt.pt",
              "torch.save": "save-torch.pt", "safetensors": "save-st.safetensors",
              "fio": "fio-write.dat"}
FIO_BS, FIO_IODEPTH = 1 << 20, 32
RSS_SLACK = 64 << 20  # target: peak RSS growth of a load <= file size + this
WARM_MINIMUM = 1.3  # target: warm load >= this x the fastest copying loader
LOAD_OPS = ("load", "warm")  # cold and warm loads: same loaders, same files
# Shape of the full-size state dict (a Llama-style 1.1B model, bf16 weights).
LAYERS, HIDDEN, INTERMEDIATE, KV, VOCAB, HEAD_DIM = 22, 2048, 5632, 256, 32000, 64


class BenchError(Exception):
    """tensortier raised, or a loader returned wrong data: reported, exit status 1."""


# --------------------------------------------------------------------------- the state dict


def llm_shapes() -> list[tuple[str, tuple[int, ...], str]]:
    """(name, full-size shape, dtype) of the 268 tensors, in a model's order."""
    shapes: list[tuple[str, tuple[int, ...], str]] = [
        ("model.embed_tokens.weight", (VOCAB, HIDDEN), "bfloat16")]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", (HIDDEN, HIDDEN), "bfloat16"),
            (p + "self_attn.k_proj.weight", (KV, HIDDEN), "bfloat16"),
            (p + "self_attn.v_proj.weight", (KV, HIDDEN), "bfloat16"),
            (p + "self_attn.o_proj.weight", (HIDDEN, HIDDEN), "bfloat16"),
            (p + "mlp.gate_proj.weight", (INTERMEDIATE, HIDDEN), "bfloat16"),
            (p + "mlp.up_proj.weight", (INTERMEDIATE, HIDDEN), "bfloat16"),
            (p + "mlp.down_proj.weight", (HIDDEN, INTERMEDIATE), "bfloat16"),
            (p + "input_layernorm.weight", (HIDDEN,), "float32"),
            (p + "post_attention_layernorm.weight", (HIDDEN,), "float32"),
            (p + "self_attn.q_norm.weight", (HEAD_DIM,), "float32"),
            (p + "self_attn.k_norm.weight", (HEAD_DIM,), "float32"),
            (p + "self_attn.rotary_emb.inv_freq", (HEAD_DIM // 2,), "float32"),
        ]
    shapes += [("model.norm.weight", (HIDDEN,), "float32"),
               ("lm_head.weight", (VOCAB, HIDDEN), "bfloat16"),
               ("model.position_ids", (1, 4096), "int64")]
    return shapes


def llm_state_dict(size: int, seed: int) -> dict[str, Any]:
    """The LLM-shaped state dict scaled to about ``size`` bytes: each matrix keeps its columns
    and gets rows * size / full size rows (at least 1); vectors keep their length. Random bytes
    (every bit pattern, NaNs included: loads are compared by bytes); the same for the same
    ``seed`` and ``size`` in every process."""
    import numpy as np
    import torch

    shapes = llm_shapes()
    itemsize = {"bfloat16": 2, "float32": 4, "int64": 8}
    full = sum(itemsize[d] * _numel(s) for _, s, d in shapes)
    scale = size / full
    rng = np.random.default_rng(seed)
    sd: dict[str, Any] = {}
    for name, shape, dtype in shapes:
        if len(shape) == 2 and shape[0] > 1:
            shape = (max(1, round(shape[0] * scale)), shape[1])
        raw = rng.integers(0, 256, _numel(shape) * itemsize[dtype], dtype=np.uint8)
        sd[name] = torch.from_numpy(raw).view(getattr(torch, dtype)).view(shape)
    return sd


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


def nbytes(sd: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


# --------------------------------------------------------------------------- child processes


def memory_status() -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of this process, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def child_load(tool: str, path: Path) -> tuple[float, int, dict[str, Any]]:
    """One timed load of ``path`` by ``tool`` (imports done before the timing), every 4 KiB page
    of the result touched inside it; (seconds, VmRSS just before the timing, what it loaded)."""
    import torch

    import tensortier

    if tool == "safetensors":
        from safetensors.torch import load_file
    elif tool == "fastsafetensors":
        from fastsafetensors import fastsafe_open
    elif tool == "tensorizer":
        import tensorizer  # noqa: F401
    elif tool == "runai-streamer":
        import runai_model_streamer  # noqa: F401
    before = memory_status()["VmRSS"]
    start = time.perf_counter()
    if tool in OURS:
        out = tensortier.load(path, progress=False)
    elif tool == "safetensors":
        out = load_file(path)
    elif tool == "torch.load":
        out = torch.load(path, mmap=False, weights_only=True)
    elif tool == "tensorizer":
        out = tensorizer_load(path)
    elif tool == "runai-streamer":
        out = runai_load(path)
    else:
        with fastsafe_open(filenames=[str(path)], device="cpu", nogds=True) as f:
            out = {k: f.get_tensor(k) for k in f.keys()}
    touch_pages(out)
    return time.perf_counter() - start, before, out


def child_save(tool: str, path: Path, sd: dict[str, Any]) -> tuple[float, int]:
    """One timed save of ``sd`` to ``path`` by ``tool``, until the file is durable; (seconds,
    VmRSS just before the timing)."""
    import torch

    import tensortier

    if tool == "safetensors":
        from safetensors.torch import save_file
    before = memory_status()["VmRSS"]
    start = time.perf_counter()
    if tool in OURS:
        tensortier.save(sd, path)
    elif tool == "torch.save":
        torch.save(sd, path)
        fsync_path(path)
    else:
        save_file(sd, path)
        fsync_path(path)
    return time.perf_counter() - start, before


def child_main(args: argparse.Namespace) -> int:
    """The process of one sample: prints {"seconds", "rss_before", "peak_rss"[, "digest"]}."""
    directory = Path(args.dir)
    sd = llm_state_dict(args.size, args.seed) if args.op == "save" else None
    result: dict[str, Any] = {}
    if sd is not None:
        result["seconds"], result["rss_before"] = child_save(
            args.child, directory / SAVE_FILES[args.child], sd)
    else:  # cold or warm: the parent dropped or read the file's pages
        result["seconds"], result["rss_before"], out = child_load(
            args.child, directory / LOAD_FILES[args.child])
    result["peak_rss"] = memory_status()["VmHWM"]
    if sd is None and args.child_digest:
        result["digest"] = state_digest(out)
    print(json.dumps(result))
    return 0


# --------------------------------------------------------------------------- the parent


@dataclass
class Settings:
    directory: Path
    size: int  # bytes of the state dict
    requested_size: int  # --size: what llm_state_dict scales to (the same in every process)
    rounds: int
    loads: list[str]
    saves: list[str]
    warm: list[str]
    json_path: Path
    fio: str
    seed: int
    verify: bool
    command: str


@dataclass
class Sample:
    seconds: float
    peak_rss: int | None  # bytes (VmHWM); None for fio
    rss_before: int | None  # bytes (VmRSS just before the timing); None for fio
    cached_before: float | None = None  # fraction of the file cached (after dropping/reading it)


def run_fio(s: Settings, path: Path, rw: str, warm: bool = False) -> Sample:
    """One fio job (its own process). Its peak RSS is not recorded: the kernel's figure for an
    exec'd child starts from the forking parent's RSS, which says nothing about fio. ``warm``:
    psync reads through the page cache (O_DIRECT would skip the cached pages)."""
    size = -(-s.size // FIO_BS) * FIO_BS  # fio moves whole blocks: round up
    engine = (["--ioengine=psync", "--direct=0", "--invalidate=0"] if warm else
              ["--ioengine=io_uring", "--direct=1", f"--iodepth={FIO_IODEPTH}"])
    argv = [s.fio, f"--name=fresh-bench-{rw}", f"--filename={path}", f"--rw={rw}",
            f"--size={size}", f"--bs={FIO_BS}", "--numjobs=1", "--output-format=json",
            *engine]
    command = shlex.join(argv)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
    stats = fio_stats(proc, command, rw, size)
    # fio's own runtime: its start-up (random buffer fill, 0.3-0.9 s on a loaded machine) is
    # not I/O. A write is durable only after its fsync (fio's end_fsync is outside its runtime):
    # timed here, right after fio, it flushes what fio wrote. Scaled to the state dict's bytes.
    runtime = stats["runtime"] / 1000.0
    if rw == "write":
        start = time.perf_counter()
        fsync_path(path)
        runtime += time.perf_counter() - start
    return Sample(runtime * s.size / size, None, None)


def run_child(s: Settings, op: str, tool: str, digest: bool) -> tuple[Sample, str | None]:
    """One sample of ``tool`` (``op`` "load" or "save") in a new Python process."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--dir", str(s.directory),
           "--size", str(s.requested_size), "--seed", str(s.seed), "--child", tool, "--op", op]
    cmd += ["--child-digest"] if digest else []
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    if run.returncode != 0:
        raise RuntimeError(f"exit {run.returncode}: {run.stderr.strip()[-2000:]}")
    r = json.loads(run.stdout.strip().splitlines()[-1])
    return Sample(float(r["seconds"]), int(r["peak_rss"]), int(r["rss_before"])), r.get("digest")


def available(tool: str, fio: str) -> str | None:
    """Why ``tool`` cannot run here (printed, and the tool skipped), or None."""
    import importlib
    import shutil

    if tool == "fio":
        return None if shutil.which(fio) else f"{fio} is not installed"
    module, package = {"safetensors": ("safetensors.torch", "safetensors"),
                       **OPTIONAL_MODULES}.get(tool, (None, None))
    if module is None:
        return None
    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - any import failure only skips the tool
        return f"{module} does not import ({type(e).__name__}: {e}); pip install {package}"
    return None


def write_load_files(s: Settings, sd: dict[str, Any], tools: Sequence[str]) -> dict[str, str]:
    """The files the loads read (untimed, fsynced). Returns {tool: why its file could not be
    written} for optional tools; anything else failing raises."""
    import tensortier

    d = s.directory
    failed: dict[str, str] = {}
    for tool in tools:
        path = d / LOAD_FILES[tool]
        if path.exists():
            continue
        if tool in ("tt-safetensors", "tt-torch", "safetensors", "torch.load", "runai-streamer",
                    "fastsafetensors"):
            tensortier.save(sd, path)
        elif tool == "fio":
            run_fio(s, path, "write")
        else:
            try:
                tensorizer_save(sd, path)
            except Exception as e:  # noqa: BLE001 - an optional tool failing is reported
                failed[tool] = f"failed to write its file: {type(e).__name__}: {e}"
                log(f"  {tool}: {failed[tool]}")
    return failed


def verify_saved(s: Settings, tool: str, expected: str) -> None:
    """Hash what ``tool`` saved (mapped, untimed) against the state dict's hash."""
    import torch
    from safetensors.torch import load_file

    path = s.directory / SAVE_FILES[tool]
    got = (load_file(path) if path.suffix == ".safetensors"
           else torch.load(path, mmap=True, weights_only=True))
    if state_digest(got) != expected:
        raise BenchError(f"save {tool}: the file it wrote holds other data (digest)")


def run_op(s: Settings, op: str, tools: list[str], expected: str
           ) -> tuple[dict[str, list[Sample]], dict[str, str], set[str]]:
    """All rounds of one op; returns (samples per tool, errors per tool, verified tools)."""
    samples: dict[str, list[Sample]] = {}
    errors: dict[str, str] = {}
    verified: set[str] = set()
    tools = list(tools)
    for t in list(tools):
        why = available(t, s.fio)
        if why:
            errors[t] = f"skipped: {why}"
            log(f"  {op} {t}: {errors[t]}")
            tools.remove(t)
    if op in LOAD_OPS:
        import gc

        sd = llm_state_dict(s.requested_size, s.seed)
        for t, why in write_load_files(s, sd, tools).items():
            errors[t] = why
            tools.remove(t)
        del sd
        gc.collect()
    for round_ in range(s.rounds):
        order = tools[round_ % len(tools):] + tools[:round_ % len(tools)] if tools else []
        for tool in order:
            if tool in errors:
                continue
            cached = None
            if op == "load":
                cached = drop_file_cache(s.directory / LOAD_FILES[tool], sync=os.fdatasync)
            settle()
            if op == "warm":  # after settle(): its sync must not write back anything now
                warm_file(s.directory / LOAD_FILES[tool], 16 << 20, reuse=True)
                cached = cached_fraction(s.directory / LOAD_FILES[tool])
            digest = s.verify and round_ == 0 and op in LOAD_OPS and tool != "fio"
            try:
                if tool == "fio":
                    sample, got = run_fio(s, s.directory / (LOAD_FILES if op in LOAD_OPS
                                                            else SAVE_FILES)[tool],
                                          "read" if op in LOAD_OPS else "write",
                                          warm=op == "warm"), None
                else:
                    sample, got = run_child(s, op, tool, digest)
            except Exception as e:  # noqa: BLE001 - another loader failing is reported
                if tool in OURS:
                    raise BenchError(f"{op} {tool}: {type(e).__name__}: {e}") from e
                errors[tool] = f"failed: {type(e).__name__}: {e}"
                log(f"  {op} {tool}: {errors[tool]}")
                continue
            if digest:
                if got != expected:
                    raise BenchError(f"{op} {tool}: loaded data differs from the state dict")
                verified.add(tool)
            if op == "save" and s.verify and round_ == 0 and tool in OURS + ("torch.save",
                                                                               "safetensors"):
                verify_saved(s, tool, expected)
                verified.add(tool)
            sample.cached_before = cached
            samples.setdefault(tool, []).append(sample)
            log(f"  {op} round {round_ + 1}/{s.rounds} {tool}: {sample.seconds:.3f} s "
                f"{s.size / sample.seconds / GB:.2f} GB/s"
                + ("" if sample.peak_rss is None else
                   f", peak RSS {sample.peak_rss / 2**20:.0f} MiB")
                + ("" if cached is None else f", {cached:.1%} cached before"))
    return samples, errors, verified


def report(s: Settings, op: str, samples: dict[str, list[Sample]], errors: dict[str, str],
           verified: set[str]) -> tuple[str, dict[str, Any]]:
    """A Markdown table and the JSON rows of one op."""
    baseline = LOAD_BASELINE if op in LOAD_OPS else SAVE_BASELINE
    gbps = {t: [s.size / x.seconds / GB for x in xs] for t, xs in samples.items()}
    base = median(gbps.get(baseline, []))
    title = {"load": "cold load to CPU, one load per new process",
             "warm": "warm load to CPU (file in the page cache), one load per new process",
             "save": "save until durable, one save per new process"}[op]
    lines = [f"### {title}", "",
             f"| tool | GB/s (median) | samples | vs {baseline} | peak RSS MiB (median) "
             "| RSS growth MiB (median) | verified |",
             "|---|---:|---|---:|---:|---:|---|"]
    rows: dict[str, Any] = {}
    for tool in list(samples) + [t for t in errors if t not in samples]:
        xs = samples.get(tool, [])
        med = median(gbps.get(tool, []))
        peak = median([x.peak_rss for x in xs if x.peak_rss is not None])
        growth = median([x.peak_rss - x.rss_before for x in xs
                         if x.peak_rss is not None and x.rss_before is not None])
        r = ratio(med, base)
        if med is None:
            lines.append(f"| {tool} | - | {errors.get(tool, '')} | - | - | - | - |")
        else:
            lines.append(
                f"| {tool} | {med:.2f} | {', '.join(f'{v:.2f}' for v in gbps[tool])} | "
                f"{'-' if r is None else f'{r:.2f}x'} | "
                f"{'-' if peak is None else f'{peak / 2**20:.0f}'} | "
                f"{'-' if growth is None else f'{growth / 2**20:.0f}'} | "
                f"{'yes' if tool in verified else 'no'} |")
        rows[tool] = {
            "median_gbps": med, "samples_gbps": gbps.get(tool, []), f"ratio_vs_{baseline}": r,
            "samples_seconds": [x.seconds for x in xs],
            "peak_rss_bytes": [x.peak_rss for x in xs],
            "rss_before_bytes": [x.rss_before for x in xs],
            "median_peak_rss_bytes": peak, "median_rss_growth_bytes": growth,
            "cached_fraction_before": [x.cached_before for x in xs],
            "verified": tool in verified, "error": errors.get(tool),
        }
    return "\n".join(lines) + "\n", rows


def targets(s: Settings, results: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """The new-process targets, each with its figures and pass/miss (n/a where a figure is
    missing)."""
    checks: list[dict[str, Any]] = []
    loads = results["ops"].get("load", {})
    warm = results["ops"].get("warm", {})
    saves = results["ops"].get("save", {})

    def med(rows: dict[str, Any], tool: str) -> float | None:
        return rows.get(tool, {}).get("median_gbps")

    others = {t: med(loads, t) for t in loads if t not in OURS and t != "fio"}
    others = {t: v for t, v in others.items() if v is not None}
    fastest = max(others, key=lambda t: others[t]) if others else None
    copying = {t: med(warm, t) for t in warm if t not in OURS + MAPPING and t != "fio"}
    copying = {t: v for t, v in copying.items() if v is not None}
    fastest_copying = max(copying, key=lambda t: copying[t]) if copying else None
    for tool in OURS:
        ours = med(loads, tool)
        if fastest is not None:
            checks.append({"target": f"load {tool} >= 1.2x fastest other loader ({fastest})",
                           "ratio": ratio(ours, others[fastest]), "minimum": 1.2})
        checks.append({"target": f"load {tool} >= 1.5x safetensors",
                       "ratio": ratio(ours, med(loads, "safetensors")), "minimum": 1.5})
        growth = loads.get(tool, {}).get("median_rss_growth_bytes")
        file_size = results["file_sizes"].get(LOAD_FILES[tool])
        limit = file_size + RSS_SLACK if file_size is not None else None
        checks.append({"target": f"load {tool} peak RSS growth <= file size + 64 MiB",
                       "ratio": ratio(limit, growth), "minimum": 1.0,
                       "figures": f"{growth / 2**20:.0f} of {limit / 2**20:.0f} MiB"
                       if growth is not None and limit is not None else None})
        ours_save = med(saves, tool)
        checks.append({"target": f"save {tool} >= 5x torch.save",
                       "ratio": ratio(ours_save, med(saves, "torch.save")), "minimum": 5.0})
        checks.append({"target": f"save {tool} >= 1.0x fio",
                       "ratio": ratio(ours_save, med(saves, "fio")), "minimum": 1.0})
        if fastest_copying is not None:
            checks.append({
                "target": f"warm load {tool} >= {WARM_MINIMUM}x fastest copying loader "
                          f"({fastest_copying})",
                "ratio": ratio(med(warm, tool), copying[fastest_copying]),
                "minimum": WARM_MINIMUM})
    lines = ["### targets", "", "| target | ratio | result |", "|---|---:|---|"]
    for c in checks:
        r = c["ratio"]
        c["result"] = "n/a" if r is None else ("pass" if r >= c["minimum"] else "miss")
        shown = "-" if r is None else f"{r:.2f}" + (f" ({c['figures']})" if c.get("figures")
                                                    else "")
        lines.append(f"| {c['target']} | {shown} | {c['result']} |")
    return "\n".join(lines) + "\n", checks


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, default=Path("./tensortier-data/checkpoint-fresh-bench"),
                   help="directory for the test files, on the disk under test "
                   "(default: %(default)s)")
    p.add_argument("--size", type=parse_size, default=None,
                   help="state dict bytes, e.g. 64M (default: the full ~2.2 GB model)")
    p.add_argument("--rounds", type=int, default=5, help="rounds (default: 5)")
    none_or = ("none",)
    p.add_argument("--loads", type=name_list(LOADS + none_or), default=list(LOADS),
                   help="comma-separated loaders, or none (default: all: " + ",".join(LOADS)
                   + ")")
    p.add_argument("--saves", type=name_list(SAVES + none_or), default=list(SAVES),
                   help="comma-separated savers, or none (default: all: " + ",".join(SAVES) + ")")
    p.add_argument("--warm", type=name_list(LOADS + none_or), default=list(LOADS),
                   help="comma-separated loaders for warm loads (file in the page cache), or "
                   "none (default: all: " + ",".join(LOADS) + ")")
    p.add_argument("--json", type=Path,
                   default=BENCH_DIR / "results" / "checkpoint_fresh_bench.json",
                   help="where to write all results (default: %(default)s)")
    p.add_argument("--fio", default="fio", help="fio binary (default: fio)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    p.add_argument("--no-verify", action="store_true",
                   help="do not hash what the first round loads and saves")
    p.add_argument("--child", choices=sorted(set(LOADS + SAVES)), help=argparse.SUPPRESS)
    p.add_argument("--op", choices=("load", "warm", "save"), help=argparse.SUPPRESS)
    p.add_argument("--child-digest", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.rounds <= 0:
        raise SystemExit("--rounds must be positive")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    if a.child is not None:
        return child_main(a)
    import torch

    import tensortier

    full = sum({"bfloat16": 2, "float32": 4, "int64": 8}[d] * _numel(sh)
               for _, sh, d in llm_shapes())
    s = Settings(a.dir.resolve(), a.size or full, a.size or full, a.rounds,
                 [t for t in a.loads if t != "none"], [t for t in a.saves if t != "none"],
                 [t for t in a.warm if t != "none"],
                 a.json, a.fio, a.seed, not a.no_verify, shlex.join([sys.executable, *sys.argv]))
    s.directory.mkdir(parents=True, exist_ok=True)
    sd = llm_state_dict(s.requested_size, s.seed)
    s.size = nbytes(sd)
    expected = state_digest(sd)
    log(f"state dict: {len(sd)} tensors, {s.size} bytes ({s.size / GB:.2f} GB)")
    del sd
    results: dict[str, Any] = {
        "command": s.command, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "kernel": platform.release(), "python": platform.python_version(),
        "torch": torch.__version__, "tensortier": tensortier.__version__,
        "fio": tool_version([s.fio, "--version"]), "cpus": os.cpu_count(),
        "tensors": len(llm_shapes()), "bytes": s.size, "rounds": s.rounds, "seed": s.seed,
        "versions": {p: _version(p) for p in ("safetensors", *(
            pkg for _, pkg in OPTIONAL_MODULES.values()))},
        "file_sizes": {}, "ops": {}, "loadavg": {},
    }
    out = [f"## checkpoint_fresh_bench: {len(llm_shapes())} tensors, {s.size / GB:.2f} GB, "
           f"every sample in a new process, median of {s.rounds} rounds\n", f"`{s.command}`\n"]
    status = 0
    try:
        for op, tools in (("load", s.loads), ("warm", s.warm), ("save", s.saves)):
            if not tools:
                continue
            log(f"{op}s: {', '.join(tools)}")
            results["loadavg"][f"before_{op}s"] = loadavg()
            samples, errors, verified = run_op(s, op, tools, expected)
            results["loadavg"][f"after_{op}s"] = loadavg()
            if op in LOAD_OPS:
                results["file_sizes"] |= {
                    LOAD_FILES[t]: (s.directory / LOAD_FILES[t]).stat().st_size
                    for t in samples}
            table, rows = report(s, op, samples, errors, verified)
            out.append(table)
            results["ops"][op] = rows
        table, checks = targets(s, results)
        out.append(table)
        results["targets"] = checks
    except BenchError as e:
        log(f"ERROR: {e}")
        results["error"] = str(e)
        status = 1
    finally:
        for name in set(LOAD_FILES.values()) | set(SAVE_FILES.values()):
            try:
                (s.directory / name).unlink()
            except FileNotFoundError:
                pass
    out.append(f"load average (1, 5, 15 min): {results['loadavg']}\n")
    print("\n".join(out))
    s.json_path.parent.mkdir(parents=True, exist_ok=True)
    s.json_path.write_text(json.dumps(results, indent=2) + "\n")
    log(f"results written to {s.json_path}")
    return status


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
