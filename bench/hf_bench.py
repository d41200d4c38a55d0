#!/usr/bin/env python3
"""Hugging Face model loads and saves in new processes: transformers vs tensortier.hf.

The model is a generated Llama-shaped ``LlamaForCausalLM`` of about ``--size`` bytes (bf16,
random weights, vocabulary 32000; the hidden size grows with ``--size``, the layer count makes up
the rest), written by transformers' ``save_pretrained`` in 3 shards (once: a later run given the
same ``--dir`` and ``--size`` reuses it). Every sample runs in a new Python process that imports
its libraries untimed, then times the operation; a load's timing includes reading one byte of
every 4 KiB page of every parameter.

Loads, cold (the shards' pages dropped from the page cache before each sample, POSIX_FADV_DONTNEED
on those files only) and warm (the shards read once through the page cache just before):
  transformers     AutoModelForCausalLM.from_pretrained(dir)       (the ratio column's baseline)
  tensortier.hf    tensortier.hf.from_pretrained(AutoModelForCausalLM, dir)
  tensortier.load  tensortier.load(dir/model.safetensors.index.json)   (the files alone)
Saves (the child loads the model untimed first), timed until durable:
  transformers     model.save_pretrained(out) + fsync of every file  (the ratio column's baseline)
  tensortier.hf    tensortier.hf.save_pretrained(model, out)
  fio              fio: io_uring, direct=1, bs=1M, iodepth=32 sequential write of the model's
                   bytes, plus an fsync (its own process; no peak RSS)
"save" writes a new directory (fio a new file): what the sample before left is removed untimed.
"resave" saves over the directory holding the same model (saved untimed first where the tool
has none yet), as a job that saves its final model again does: each tool frees the old files'
blocks in its timing (transformers by renaming its temporary file over each, tensortier.hf by
removing the old directory after the swap); fio has no such figure.

Each round runs every tool once per operation in an order rotated from round to round; the
figures are medians over ``--rounds`` (default 5). Peak RSS growth is VmHWM minus the VmRSS the
child had before the timing. Targets: cold load >= 2x transformers and within 1.2x of
tensortier.load; warm >= 1.5x; save >= 3x transformers and >= 0.9x fio; peak RSS growth <= the
model's size + 64 MiB.

Examples:
  .venv/bin/python bench/hf_bench.py --size 1G
  .venv/bin/python bench/hf_bench.py --size 4G --rounds 3     # hidden size 2048, 3 shards
  .venv/bin/python bench/hf_bench.py --size 4G --ops warm,save
  .venv/bin/python bench/hf_bench.py --size 64M --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchlib import (  # noqa: E402
    drop_file_cache, fio_stats, format_size, log, median, parse_size, ratio, settle, warm_file)
from checkpoint_bench import fsync_path, touch_pages  # noqa: E402
from checkpoint_fresh_bench import memory_status  # noqa: E402

LOADS = ["transformers", "tensortier.hf", "tensortier.load"]
SAVES = ["transformers", "tensortier.hf", "fio"]
VOCAB = 32000


def llama_config(size: int) -> Any:
    """A Llama config of about `size` bytes in bf16."""
    import transformers

    hidden = 256 if size < 256 << 20 else 1024 if size < 2 << 30 else 2048
    per_layer = 4 * hidden * hidden + 3 * hidden * (hidden * 11 // 4)
    layers = max(1, round((size // 2 - 2 * VOCAB * hidden) / per_layer))
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers, num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64, dtype="bfloat16")


def write_model(size: int, directory: Path) -> int:
    """The model's shards, written by transformers; returns the weights' bytes."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(llama_config(size)).to(torch.bfloat16)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32))
    model.save_pretrained(directory, max_shard_size=size // 3 + 1)  # 3 shards
    return sum(p.numel() * p.element_size() for p in model.parameters())


def model_in(directory: Path, size: int) -> int:
    """The weights' bytes of the model under `directory`/model: the one a run before left there
    for the same --size (its marker file says so), else one written now."""
    marker = directory / "model-written.json"
    if marker.exists():
        written = json.loads(marker.read_text())
        if written.get("size") == size and (directory / "model").is_dir():
            log(f"reusing the {format_size(size)} model under {directory}")
            return int(written["nbytes"])
        marker.unlink()
    shutil.rmtree(directory / "model", ignore_errors=True)
    log(f"writing a {format_size(size)} Llama-shaped model with transformers")
    nbytes = write_model(size, directory / "model")
    marker.write_text(json.dumps({"size": size, "nbytes": nbytes}))
    return nbytes


def child(args: argparse.Namespace) -> dict[str, Any]:
    import transformers

    import tensortier
    from tensortier import hf

    src = Path(args.dir) / "model"
    auto = transformers.AutoModelForCausalLM
    transformers.LlamaForCausalLM  # noqa: B018 - imports the model's module untimed (lazy)
    if args.op in ("save", "resave"):
        model = hf.from_pretrained(auto, src)
        out = Path(args.dir) / f"save-{args.child}"
        if args.op == "resave" and not out.is_dir():  # the directory to save over
            save_model(args.child, model, out)
            settle()
    before = memory_status()["VmRSS"]
    start = time.perf_counter()
    if args.op in ("save", "resave"):
        save_model(args.child, model, out)
    else:
        if args.child == "tensortier.load":
            loaded = tensortier.load(src / "model.safetensors.index.json", progress=False)
        else:
            m = (hf.from_pretrained(auto, src) if args.child == "tensortier.hf"
                 else auto.from_pretrained(src))
            loaded = dict(m.named_parameters())
        touch_pages(loaded)
    return {"seconds": time.perf_counter() - start, "rss_before": before,
            "peak_rss": memory_status()["VmHWM"]}


def save_model(tool: str, model: Any, out: Path) -> None:
    """`model` saved into `out` by `tool`, durably."""
    from tensortier import hf

    if tool == "tensortier.hf":
        hf.save_pretrained(model, out)
        return
    model.save_pretrained(out)
    for f in out.iterdir():
        fsync_path(f)
    fsync_path(out)


def shards(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def sample(args: argparse.Namespace, op: str, tool: str, nbytes: int) -> dict[str, Any]:
    d = Path(args.dir)
    if op == "save":  # a new directory (file) each time: the last sample's, removed untimed
        shutil.rmtree(d / f"save-{tool}", ignore_errors=True)
        (d / "fio.bin").unlink(missing_ok=True)
        settle()
    if op == "save" and tool == "fio":
        path, size = d / "fio.bin", -(-nbytes // (1 << 20)) << 20
        argv = [args.fio, "--name=hf-bench", f"--filename={path}", "--rw=write", f"--size={size}",
                "--bs=1M", "--ioengine=io_uring", "--direct=1", "--iodepth=32",
                "--output-format=json"]
        stats = fio_stats(subprocess.run(argv, capture_output=True, text=True, check=False),
                          " ".join(argv), "write", size)
        start = time.perf_counter()
        fsync_path(path)
        return {"seconds": stats["runtime"] / 1000 + time.perf_counter() - start}
    for f in shards(d / "model"):
        warm_file(f) if op == "warm" else drop_file_cache(f)
    settle()
    cmd = [sys.executable, __file__, "--dir", str(d), "--child", tool,
           "--op", op if op in ("save", "resave") else "load"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=False)
    if run.returncode != 0:
        raise RuntimeError(f"{tool} {op}: exit {run.returncode}: {run.stderr.strip()[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default=parse_size("1G"))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default=None,
                   help="where the files go, kept after the run: a later run with the same --size "
                        "reuses the model there (default: a new temp dir, removed)")
    p.add_argument("--fio", default="fio")
    p.add_argument("--ops", default="cold,warm,save,resave",
                   help="which to measure, comma-separated (default: cold,warm,save,resave)")
    p.add_argument("--json", default=None, help="write every sample there")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--op", help=argparse.SUPPRESS)
    args = p.parse_args()
    unknown = set(args.ops.split(",")) - {"cold", "warm", "save", "resave"}
    if unknown:
        p.error(f"--ops: no such measure {', '.join(sorted(unknown))} (cold, warm, save, "
                "resave)")
    if args.child:
        print(json.dumps(child(args)))
        return 0
    made = args.dir is None
    args.dir = os.path.abspath(args.dir or tempfile.mkdtemp(prefix="hf-bench-", dir="."))
    try:
        nbytes = model_in(Path(args.dir), args.size)
        ops = {op: tools for op, tools in {"cold": LOADS, "warm": LOADS, "save": SAVES,
                                           "resave": SAVES[:2]}.items()
               if op in args.ops.split(",")}
        if shutil.which(args.fio) is None:
            log(f"{args.fio} not found: no fio figures")
            if "save" in ops:
                ops["save"] = SAVES[:2]
        samples: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for r in range(args.rounds):
            for op, tools in ops.items():
                for tool in tools[r % len(tools):] + tools[:r % len(tools)]:
                    log(f"round {r + 1}/{args.rounds}: {op} {tool}")
                    samples.setdefault((op, tool), []).append(sample(args, op, tool, nbytes))
        print(f"\n{format_size(nbytes)} of bf16 weights, {args.rounds} rounds (medians; a loaded "
              "machine's figures are not claims)\n")
        print("| operation | tool | seconds | GB/s | vs transformers | peak RSS growth |")
        print("|---|---|---|---|---|---|")
        for (op, tool), ss in samples.items():
            secs = median([s["seconds"] for s in ss])
            base = median([s["seconds"] for s in samples[(op, "transformers")]])
            growth = median([s["peak_rss"] - s["rss_before"] for s in ss if "peak_rss" in s])
            print(f"| {op} | {tool} | {secs:.3f} | {nbytes / secs / 1e9:.2f} | "
                  f"{ratio(base, secs):.2f}x | "
                  f"{format_size(int(growth)) if growth is not None else '-'} |")
        if args.json:
            Path(args.json).write_text(json.dumps(
                {f"{op} {tool}": ss for (op, tool), ss in samples.items()}, indent=1))
    finally:
        if made:
            shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
