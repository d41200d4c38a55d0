#!/usr/bin/env python3
"""torch.distributed.checkpoint saves and loads: tensortier.dcp against torch's file backend.

Every sample is a new job: a new Python process that spawns the ranks (Gloo on the CPU,
torch.multiprocessing). A configuration is RANKSxSIZE (each rank holds its ``Shard(0)`` part of
float32 DTensors on a one-dimensional CPU mesh, SIZE bytes per rank, matrices of 64 MiB or less
as a model's layers) or RANKSxCOUNTxSIZE (COUNT plain float32 tensors of SIZE bytes per rank:
optimizer states, adapters; under one key, ``{"model": {...}}``, as state dicts are passed to
DCP: DCP's own per-key work on a flat dict of 20,000 keys costs every backend alike). The ranks
build their tensors untimed, meet at a barrier, then rank 0 times the call between two barriers:
the time the job waits for its checkpoint.

Saves (``--saves``), each over the previous round's checkpoint of the same tool, as a job
saving ``latest`` does; each is durable when timed (ours fsyncs; torch's FileSystemWriter is
timed with its default ``sync_files=True``):
  tt            tensortier.dcp.Writer
  stock         FileSystemWriter (thread_count=1, its default)
  stock4        FileSystemWriter(thread_count=4)
  stock8        FileSystemWriter(thread_count=8)
  fio           fio: io_uring, direct=1, bs=1M, iodepth=32 sequential write of the same bytes,
                plus an fsync (the disk's rate, for scale)
  floor         a StorageWriter that writes nothing (resolves each item's data and returns an
                empty WriteResult): dcp.save's own work (planning, collectives), the least any
                backend takes
  tt-cached     a job's second save (the first one untimed) through
                DefaultSavePlanner(enable_plan_caching=True), torch's plan caching: the plans
                of the first save are reused, their collectives skipped
  stock-cached  the same with FileSystemWriter
  tt-planned    tensortier.dcp.Writer with planner=tensortier.dcp.SavePlanner()
Asynchronous saves (``--asyncs``): the time ``dcp.async_save`` blocks the caller (training), and
the time until the checkpoint is committed on every rank ("total", the blocked time included;
"write x fio" leaves it out: the background write alone):
  tt            dcp.async_save(storage_writer=Writer(...)) (Writer stages the state dict): the
                job's first save, whose staging memory is new (its pages faulted in by the copy)
  tt-again      the same, the job's second async_save (untimed first one finished): staging
                into the memory the first one faulted in, as every save of a training job after
                its first does
  tt-zoc        dcp.async_save(storage_writer=Writer(..., async_staging=True)): returns before
                the copy, which runs on another thread; "staged" is the time until the
                response's staging_completion (the training step that changes the state waits
                for it). The job's first save, as for tt
  tt-zoc-again  the same, the job's second save
  stock         dcp.async_save(storage_writer=FileSystemWriter(...)) (torch's default stager)
  stock-zoc     the same with async_stager=DefaultStager(StagingOptions(use_async_staging=True))
                (torch's stager copying on another thread; "staged" as for tt-zoc)
  copy          one parallel memory copy of the state dict into tensors allocated (and touched)
                before the clock starts: torch._foreach_copy_, torch's intra-op threads
Loads (``--loads``), cold: the checkpoint's files are dropped from the page cache first
(POSIX_FADV_DONTNEED on those files only):
  tt            tensortier.dcp.Reader (verify=True, its default) of tt's checkpoint
  tt-noverify   tensortier.dcp.Reader(verify=False)
  stock         FileSystemReader of stock's checkpoint
  fio           fio sequential read with O_DIRECT of the same bytes
  floor         a Reader of tt's checkpoint that reads nothing (resolves and commits each
                target tensor untouched): dcp.load's own work, the least any backend takes
  tt-planned    tensortier.dcp.Reader with planner=tensortier.dcp.LoadPlanner() of
                tt-planned's checkpoint
Where Reader has ``bytes_read`` (the bytes its last load read), the table reports it per rank 0.
Each sample also records, per rank, the CPU seconds (user + system) its process spent in its
own part of the timed call (``cpu``: all its threads; ``main_cpu``: the calling thread alone);
the table reports the median of their sums over the ranks ("cpu s", "main s"): where the ranks
outnumber the cores, CPU time is what they contend for.

Each round runs every tool once in an order rotated from round to round; the figures are
medians over ``--rounds``. Prints one JSON object per sample and, per configuration, a table of
GB/s (1e9 bytes per second over the job's bytes) with each tool's ratio to stock's and fio's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchlib import GB, drop_file_cache, fio_stats, format_size, log, median, parse_size  # noqa: E402

SAVES = ("tt", "stock", "stock4", "stock8", "fio", "floor", "tt-cached", "stock-cached",
         "tt-planned")
ASYNCS = ("tt", "tt-again", "tt-zoc", "tt-zoc-again", "stock", "stock-zoc", "copy")
LOADS = ("tt", "tt-noverify", "stock", "fio", "floor", "tt-planned")
MATRIX_BYTES = 64 << 20
COLUMNS = 4096
CONFIGS = "2x1G,4x512M,2x20000x1K"  # the figures BENCHMARKS.md reports


@dataclass(frozen=True)
class Config:
    ranks: int
    size: int  # bytes per rank
    count: int = 0  # > 0: `count` plain tensors of `size` bytes each per rank

    @property
    def name(self) -> str:
        if self.count:
            return f"{self.ranks}x{self.count}x{format_size(self.size)}"
        return f"{self.ranks}x{format_size(self.size)}"

    @property
    def job_bytes(self) -> int:
        if self.count:
            return self.ranks * self.count * (self.size // 4) * 4
        return sum(r * c * 4 for r, c in shapes(self.size, self.ranks))

    def argv(self) -> list[str]:
        return ["--ranks", str(self.ranks), "--size", str(self.size), "--count", str(self.count)]


def parse_config(text: str) -> Config:
    parts = text.lower().split("x")
    if len(parts) == 2:
        return Config(int(parts[0]), parse_size(parts[1]))
    if len(parts) == 3:
        return Config(int(parts[0]), parse_size(parts[2]), int(parts[1]))
    raise argparse.ArgumentTypeError(f"{text!r}: want RANKSxSIZE or RANKSxCOUNTxSIZE")


def shapes(size: int, ranks: int) -> list[tuple[int, int]]:
    """Global (rows, COLUMNS) float32 shapes: each rank holds size bytes in rows // ranks."""
    rows_per_rank = MATRIX_BYTES // (COLUMNS * 4)
    out, left = [], size
    while left > 0:
        rows = min(rows_per_rank, max(1, left // (COLUMNS * 4)))
        out.append((rows * ranks, COLUMNS))
        left -= rows * COLUMNS * 4
    return out


def state_dict(cfg: Config, rank: int, empty: bool) -> dict[str, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    gen = torch.Generator().manual_seed(rank)
    sd: dict[str, Any] = {}
    if cfg.count:  # each rank's own tensors (keys differ by rank), under one key as a model's
        n = cfg.size // 4
        sd["model"] = {f"rank{rank}.t{i}": torch.empty(n) if empty else
                       torch.randn(n, generator=gen) for i in range(cfg.count)}
        return sd
    mesh = init_device_mesh("cpu", (cfg.ranks,))
    for i, (rows, cols) in enumerate(shapes(cfg.size, cfg.ranks)):
        local = (torch.empty(rows // cfg.ranks, cols) if empty else
                 torch.randn(rows // cfg.ranks, cols, generator=gen))
        sd[f"layer{i}.weight"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    return sd


def floor_storage(op: str, directory: str) -> Any:
    """A backend that moves no bytes: what DCP itself costs per item, for any backend."""
    from torch.distributed.checkpoint.planner import LoadItemType
    from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
    from torch.futures import Future

    from tensortier.dcp import Reader

    def done(value: Any) -> Future:
        fut: Future = Future()
        fut.set_result(value)
        return fut

    class FloorWriter(StorageWriter):
        def reset(self, checkpoint_id: Any = None) -> None:
            pass

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
            return True

        def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kw: Any) -> None:
            pass

        def prepare_local_plan(self, plan: Any) -> Any:
            return plan

        def prepare_global_plan(self, plans: Any) -> Any:
            return plans

        def write_data(self, plan: Any, planner: Any) -> Future:
            results = []
            for item in plan.items:
                planner.resolve_data(item)
                results.append(WriteResult(index=item.index, size_in_bytes=0, storage_data=None))
            return done(results)

        def finish(self, metadata: Any, results: Any) -> None:
            pass

    class FloorReader(Reader):
        def read_data(self, plan: Any, planner: Any) -> Future:
            for req in plan.items:
                if req.type == LoadItemType.BYTE_IO:
                    raise RuntimeError("the floor reader reads tensors only")
                planner.commit_tensor(req, planner.resolve_tensor(req))
            return done(None)

    return FloorWriter() if op != "load" else FloorReader(directory)


def storage(op: str, tool: str, directory: str) -> Any:
    import torch.distributed.checkpoint as dcp

    if tool == "floor":
        return floor_storage(op, directory)
    if tool.startswith("tt"):
        from tensortier.dcp import Reader, Writer
        return Writer(directory, async_staging="zoc" in tool) if op != "load" else Reader(
            directory, verify=(tool != "tt-noverify"))
    if op == "load":
        return dcp.FileSystemReader(directory)
    threads = {"stock4": 4, "stock8": 8}.get(tool, 1)
    return dcp.FileSystemWriter(directory, thread_count=threads)


def cpu_seconds(who: int) -> float:
    """User + system CPU seconds of `who` (resource.RUSAGE_SELF or RUSAGE_THREAD) so far."""
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def rank_main(rank: int, cfg: Config, op: str, tool: str, directory: str, rendezvous: str,
              result: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=cfg.ranks)
    try:
        sd = state_dict(cfg, rank, empty=(op == "load"))
        out: dict[str, Any] = {}
        cpu = main_cpu = 0.0  # at the start of the timed call
        if op == "async" and tool == "copy":
            values = list(sd["model"].values()) if cfg.count else list(sd.values())
            srcs = [v.to_local() if hasattr(v, "to_local") else v for v in values]
            dsts = [torch.ones_like(s) for s in srcs]  # allocated and touched
            dist.barrier()
            start = time.perf_counter()
            torch._foreach_copy_(dsts, srcs)
            out["blocked"] = time.perf_counter() - start
            dist.barrier()
            out["seconds"] = time.perf_counter() - start
        else:
            writer = storage(op, tool, directory)
            dist.barrier()
            start = time.perf_counter()
            cpu, main_cpu = cpu_seconds(resource.RUSAGE_SELF), cpu_seconds(resource.RUSAGE_THREAD)
            if op == "save" and tool.endswith("-cached"):
                from torch.distributed.checkpoint import DefaultSavePlanner

                def cached() -> Any:  # the cache is the planner class's, across its instances
                    return DefaultSavePlanner(enable_plan_caching=True)

                dcp.save(sd, storage_writer=writer, planner=cached())  # untimed: the first
                writer = storage(op, tool, directory)
                dist.barrier()
                start = time.perf_counter()
                cpu = cpu_seconds(resource.RUSAGE_SELF)
                main_cpu = cpu_seconds(resource.RUSAGE_THREAD)
                dcp.save(sd, storage_writer=writer, planner=cached())
            elif op == "save":
                dcp.save(sd, storage_writer=writer, **planner(op, tool))
            elif op == "async":
                stager: dict[str, Any] = {}
                if tool == "stock-zoc":
                    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
                    stager["async_stager"] = DefaultStager(StagingOptions(
                        use_pinned_memory=False, use_shared_memory=False,
                        use_async_staging=True, use_non_blocking_copy=False))
                if tool.endswith("-again"):  # untimed: the job's first save
                    first = dcp.async_save(sd, storage_writer=writer)
                    (first.upload_completion if hasattr(first, "upload_completion")
                     else first).result()
                    writer = storage(op, tool, directory)
                    dist.barrier()
                    start = time.perf_counter()
                    cpu = cpu_seconds(resource.RUSAGE_SELF)
                    main_cpu = cpu_seconds(resource.RUSAGE_THREAD)
                fut = dcp.async_save(sd, storage_writer=writer, **stager)
                out["blocked"] = time.perf_counter() - start
                if hasattr(fut, "staging_completion"):
                    fut.staging_completion.result()
                    out["staged"] = time.perf_counter() - start
                (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result()
                if stager:
                    stager["async_stager"].close()
            else:
                dcp.load(sd, storage_reader=writer, **planner(op, tool))
                if getattr(writer, "bytes_read", None) is not None:
                    out["bytes_read"] = int(writer.bytes_read)
            # The rank's own work (the barrier after it waits for the others).
            out["cpu"] = cpu_seconds(resource.RUSAGE_SELF) - cpu
            out["main_cpu"] = cpu_seconds(resource.RUSAGE_THREAD) - main_cpu
            dist.barrier()
            out["seconds"] = time.perf_counter() - start
        Path(f"{result}.{rank}").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


def child(args: argparse.Namespace) -> int:
    import torch.multiprocessing as mp

    cfg = Config(args.ranks, args.size, args.count)
    with tempfile.TemporaryDirectory() as tmp:
        rendezvous, result = os.path.join(tmp, "rendezvous"), os.path.join(tmp, "result")
        mp.spawn(rank_main, args=(cfg, args.op, args.tool, str(args.checkpoint), rendezvous,
                                  result), nprocs=cfg.ranks)
        ranks = [json.loads(Path(f"{result}.{r}").read_text()) for r in range(cfg.ranks)]
        out = ranks[0]  # rank 0's clock and counts; every rank's CPU
        for key in ("cpu", "main_cpu"):
            if key in out:
                out[key] = [round(r[key], 4) for r in ranks]
        print(json.dumps(out))
    return 0


def fio_sample(fio_file: Path, rw: str, nbytes: int) -> float:
    size = -(-nbytes // (1 << 20)) * (1 << 20)
    argv = ["fio", f"--name=dcp-bench-{rw}", f"--filename={fio_file}", f"--rw={rw}",
            f"--size={size}", "--bs=1M", "--numjobs=1", "--output-format=json",
            "--ioengine=io_uring", "--direct=1", "--iodepth=32"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
    seconds = fio_stats(proc, shlex.join(argv), rw, size)["runtime"] / 1000.0
    if rw == "write":
        start = time.perf_counter()
        fd = os.open(fio_file, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        seconds += time.perf_counter() - start
    return seconds * nbytes / size


def checkpoint_kind(tool: str) -> str:
    """Whose checkpoint a tool saves or loads (the floor loads tt's)."""
    if tool == "tt-planned":
        return tool
    return "tt" if tool.startswith("tt") or tool == "floor" else "stock"


def planner(op: str, tool: str) -> dict[str, Any]:
    """The planner argument of a tool's dcp.save or dcp.load."""
    if tool != "tt-planned":
        return {}
    from tensortier.dcp import LoadPlanner, SavePlanner
    return {"planner": SavePlanner() if op == "save" else LoadPlanner()}


def checkpoint_dir(args: argparse.Namespace, cfg: Config, op: str, tool: str) -> Path:
    kind = checkpoint_kind(tool) if (op, tool) != ("save", "floor") else "floor"
    return args.dir / cfg.name / (f"async-{kind}" if op == "async" else kind)


def sample(args: argparse.Namespace, cfg: Config, op: str, tool: str) -> dict[str, Any]:
    fio_file = args.dir / "fio.dat"
    if tool == "fio":
        if op == "load":
            drop_file_cache(fio_file)
        rw = "write" if op == "save" else "read"
        return {"seconds": fio_sample(fio_file, rw, cfg.job_bytes)}
    checkpoint = checkpoint_dir(args, cfg, op, tool)
    checkpoint.parent.mkdir(parents=True, exist_ok=True)
    if op == "load":
        for f in checkpoint.iterdir():
            drop_file_cache(f)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", op, tool,
           "--checkpoint", str(checkpoint), *cfg.argv()]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{cfg.name} {op} {tool} failed ({out.returncode}):\n"
                           f"{out.stderr[-3000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def run_config(args: argparse.Namespace, cfg: Config, plan: list[tuple[str, list[str]]]
               ) -> dict[tuple[str, str], list[dict[str, Any]]]:
    samples: dict[tuple[str, str], list[dict[str, Any]]] = {}
    # Each load reads the checkpoint its tool saved: saves come first in every round.
    for r in range(args.rounds):
        for op, tools in plan:
            if op == "load":
                for tool in tools:
                    if tool != "fio" and not (checkpoint_dir(args, cfg, "save", tool)
                                              / ".metadata").exists():
                        sample(args, cfg, "save", checkpoint_kind(tool))
            order = tools[r % len(tools):] + tools[:r % len(tools)]
            for tool in order:
                s = sample(args, cfg, op, tool)
                samples.setdefault((op, tool), []).append(s)
                print(json.dumps({"config": cfg.name, "round": r, "op": op, "tool": tool, **s,
                                  "gb_s": cfg.job_bytes / s["seconds"] / GB}), flush=True)
    return samples


def report(cfg: Config, rounds: int, plan: list[tuple[str, list[str]]],
           samples: dict[tuple[str, str], list[dict[str, Any]]]) -> None:
    nbytes = cfg.job_bytes
    print(f"\n{cfg.name}: {cfg.ranks} ranks, {nbytes / GB:.3f} GB per job, medians of {rounds}")

    def med(op: str, tool: str, key: str = "seconds") -> float | None:
        values = [s[key] for s in samples.get((op, tool), []) if key in s]
        return median(values) if values else None

    for op, tools in plan:
        if op == "async":
            print(f"{op:5} {'tool':12} {'blocked s':>9} {'x copy':>7} {'x stock':>8} "
                  f"{'total GB/s':>10} {'x fio':>6} {'write x fio':>11} {'staged s':>8}")
            copy, stock = med(op, "copy", "blocked"), med(op, "stock", "blocked")
            fio, nan = med("save", "fio"), float("nan")
            for tool in tools:
                blocked, total = med(op, tool, "blocked"), med(op, tool)
                assert blocked is not None and total is not None
                print(f"{op:5} {tool:12} {blocked:9.3f} "
                      f"{blocked / copy if copy else float('nan'):7.2f} "
                      f"{blocked / stock if stock else float('nan'):8.2f} "
                      f"{'' if tool == 'copy' else f'{nbytes / total / GB:10.2f}':>10} "
                      f"{fio / total if fio and tool != 'copy' else float('nan'):6.2f} "
                      f"{fio / (total - blocked) if fio and tool != 'copy' else nan:11.2f} "
                      f"{med(op, tool, 'staged') or nan:8.3f}")
            continue
        base = med(op, "stock") if "stock" in tools else None
        fio = med(op, "fio") if "fio" in tools else None
        print(f"{op:5} {'tool':12} {'seconds':>8} {'GB/s':>6} {'x stock':>8} {'x fio':>6} "
              f"{'bytes read':>12} {'cpu s':>6} {'main s':>6}")
        for tool in tools:
            m = med(op, tool)
            assert m is not None
            read = med(op, tool, "bytes_read")
            vs_stock = f"{base / m:8.2f}" if base else f"{'':8}"
            vs_fio = f"{fio / m:6.2f}" if fio else f"{'':6}"
            read_text = f"{read:12.0f}" if read is not None else f"{'':12}"
            cpu = [f"{median(v):6.2f}" if (v := [sum(s[key]) for s in samples[(op, tool)]
                                                 if key in s]) else f"{'':6}"
                   for key in ("cpu", "main_cpu")]
            print(f"{op:5} {tool:12} {m:8.3f} {nbytes / m / GB:6.2f} {vs_stock} {vs_fio} "
                  f"{read_text} {cpu[0]} {cpu[1]}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", type=Path, default=Path("./tensortier-data/dcp-bench"))
    p.add_argument("--configs", type=lambda s: [parse_config(c) for c in s.split(",") if c],
                   help=f"configurations, e.g. {CONFIGS} (the issue's figures); default: one "
                        "from --ranks, --size and --count")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--size", type=parse_size, default=parse_size("1G"),
                   help="bytes per rank (with --count: per tensor) (default 1G)")
    p.add_argument("--count", type=int, default=0,
                   help="per rank: this many plain tensors of --size bytes (default: DTensors)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--saves", default=",".join(SAVES))
    p.add_argument("--asyncs", default=",".join(ASYNCS))
    p.add_argument("--loads", default=",".join(LOADS))
    p.add_argument("--child", nargs=2, metavar=("OP", "TOOL"))
    p.add_argument("--checkpoint", type=Path)
    args = p.parse_args()
    if args.child:
        args.op, args.tool = args.child
        return child(args)
    args.dir.mkdir(parents=True, exist_ok=True)
    configs = args.configs or [Config(args.ranks, args.size, args.count)]
    plan = [(op, [t for t in tools.split(",") if t])
            for op, tools in (("save", args.saves), ("async", args.asyncs), ("load", args.loads))]
    plan = [(op, tools) for op, tools in plan if tools]
    results = []
    for cfg in configs:
        log(f"{cfg.name}: {cfg.job_bytes / GB:.3f} GB per job, {args.rounds} rounds")
        results.append((cfg, run_config(args, cfg, plan)))
    for cfg, samples in results:
        report(cfg, args.rounds, plan, samples)
    return 0


if __name__ == "__main__":
    sys.exit(main())
