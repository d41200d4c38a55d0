"""Shared tensors: memory held by N processes sharing one table against N private copies, and
row-gather rates against ``index_select`` on a private tensor, measured in the same run.

    OMP_NUM_THREADS=1 python bench/shared_bench.py --size 1G --procs 4 --repeats 3 --json shared.json

(OMP_NUM_THREADS=1 for the one-process gathers too; the worker processes always get it.)

- memory: N processes (plain subprocesses meeting through a TCPStore) each see the whole table
  (every page touched) and report their PSS (/proc/self/smaps_rollup); the sum is what the job
  holds. Baseline: N processes, each with a private copy, touched the same way.
- gather: random rows (batches of 1024 and 65536 rows of 128 float32) from a table of --size,
  in one process (``SharedTensor.gather`` vs ``index_select`` on a private tensor), and the
  aggregate of 2 processes doing the same at once. Alternating order, median of --repeats.
- distributed: the ``distributed`` layout's gather over Gloo (2 and 4 processes) against
  ``all_to_all_single`` moving the same bytes (and the indices), the floor it stands on.
- load: ``load_files`` of a raw table file of --load-size by 2 and 4 processes, cold (the file's
  pages dropped before each run), against fio's sequential O_DIRECT read of the same file, cold,
  alternating. The time is from a barrier after the table is created to the end of the
  collective call (the slowest rank's).

Huge pages: by default the machine's settings serve (the report records vm.nr_hugepages,
shmem_enabled and the shared table's ``stats``). As root, ``--reserve-huge-pages N`` (hugetlb
pages for the shared tables) and ``--shmem-enabled advise`` (transparent huge pages on advice)
change them for the run and restore them after.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchlib import drop_file_cache, fio_stats, loadavg, log, parse_size  # noqa: E402

COLUMNS = 128


def pss_bytes() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    raise OSError("no Pss line in /proc/self/smaps_rollup")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker(args: argparse.Namespace) -> None:
    """One process of a multi-process measurement; prints one JSON line."""
    import tensortier.shared as shared

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rows = args.size // (COLUMNS * 4)
    store = torch.distributed.TCPStore(
        "127.0.0.1", args.port, world, is_master=False, timeout=datetime.timedelta(seconds=300)
    )
    group = shared.Group(rank=rank, world_size=world, store=store, timeout=300)
    out: dict[str, Any] = {"rank": rank}
    if args.kind in ("distributed", "all_to_all"):
        return distributed_worker(args, group, store, rank, world, rows, out)
    if args.kind == "load":
        table = group.create_tensor((rows, COLUMNS), torch.float32)
        group.barrier()
        start = time.perf_counter()
        out["stats"] = table.load_files([args.path])
        out["seconds"] = time.perf_counter() - start
        local, (begin, end) = table.local()
        if end > begin:  # the rows came from the file: its first and last rows of this rank
            with open(args.path, "rb") as f:
                for row in (begin, end - 1):
                    f.seek(row * COLUMNS * 4)
                    want = torch.frombuffer(bytearray(f.read(COLUMNS * 4)), dtype=torch.float32)
                    assert torch.equal(local[row - begin], want), f"row {row} differs"
        group.barrier()
        print(json.dumps(out), flush=True)
        group.close()
        return
    if args.kind == "shared":
        table = group.create_tensor((rows, COLUMNS), torch.float32)
        local, _ = table.local()
        local.fill_(1.0)
        group.barrier()
        view = table.view()
        assert isinstance(view, torch.Tensor)
        out["checksum"] = float(view[:, 0].sum())  # every page of the table mapped and read
        gather = table.gather
    else:
        private = torch.empty((rows, COLUMNS), dtype=torch.float32)
        private.fill_(1.0)
        out["checksum"] = float(private[:, 0].sum())

        def gather(idx: torch.Tensor) -> torch.Tensor:
            return private.index_select(0, idx)

    group.barrier()
    out["pss"] = pss_bytes()
    group.barrier()
    if args.batch:
        gen = torch.Generator().manual_seed(rank)
        batches = [torch.randint(0, rows, (args.batch,), generator=gen) for _ in range(8)]
        group.barrier()
        start, done = time.perf_counter(), 0
        while time.perf_counter() - start < args.seconds:
            gather(batches[done % 8])
            done += 1
        out["rows_per_s"] = done * args.batch / (time.perf_counter() - start)
    group.barrier()
    print(json.dumps(out), flush=True)
    group.close()


def distributed_worker(args: argparse.Namespace, group: Any, store: Any, rank: int, world: int,
                       rows: int, out: dict[str, Any]) -> None:
    """The distributed layout's gather over Gloo, or its floor: one all_to_all_single moving
    the same bytes (each rank's batch spread evenly over the ranks)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.PrefixStore("gloo", store), rank=rank,
                            world_size=world)
    gen = torch.Generator().manual_seed(rank)
    if args.kind == "distributed":
        table = group.create_tensor((rows, COLUMNS), torch.float32, layout="distributed")
        table.local()[0].fill_(1.0)
        batches = [torch.randint(0, rows, (args.batch,), generator=gen) for _ in range(8)]

        def step(i: int) -> None:
            table.gather(batches[i % 8])
    else:
        send = torch.ones((args.batch, COLUMNS), dtype=torch.float32)
        recv = torch.empty_like(send)
        ids = torch.zeros(args.batch, dtype=torch.int64)
        ids_back = torch.empty_like(ids)

        def step(i: int) -> None:
            dist.all_to_all_single(ids_back, ids)  # the indices travel too
            dist.all_to_all_single(recv, send)

    dist.barrier()
    # A fixed number of steps: every rank must make the same collective calls.
    steps = max(4, int(args.seconds * 20))
    start = time.perf_counter()
    for i in range(steps):
        step(i)
    out["rows_per_s"] = steps * args.batch / (time.perf_counter() - start)
    dist.barrier()
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()
    group.close()


def run_procs(kind: str, procs: int, size: int, batch: int, seconds: float,
              path: str = "") -> list[dict[str, Any]]:
    port = free_port()
    # This process serves the store (as torchrun's agent would): no worker outlives it.
    store = torch.distributed.TCPStore("127.0.0.1", port, procs + 1, is_master=True,
                                       timeout=datetime.timedelta(seconds=300), wait_for_workers=False)
    children = []
    for r in range(procs):
        # One OpenMP thread per process, as torchrun sets: several processes' spinning OpenMP
        # pools on the same cores slow torch's own ops (the baselines) many times over.
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(procs), OMP_NUM_THREADS="1")
        cmd = [sys.executable, __file__, "--worker", "--kind", kind, "--size", str(size), "--port",
               str(port), "--batch", str(batch), "--seconds", str(seconds), "--path", path]
        children.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    results = []
    for c in children:
        out, _ = c.communicate(timeout=600)
        if c.returncode != 0:
            raise RuntimeError(f"{kind} worker failed ({c.returncode})")
        results.append(json.loads(out.strip().splitlines()[-1]))
    del store
    return results


#: What the run's memory had: the kernel's settings and the shared table's stats.
PAGES: dict[str, Any] = {}
NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")
SHMEM_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")


@contextlib.contextmanager
def kernel_setting(path: Path, value: str | None) -> Iterator[None]:
    """Writes `value` to the kernel setting `path` (root) for the duration, then restores it."""
    if value is None:
        yield
        return
    before = path.read_text().strip()
    if "[" in before:  # "always [never]": the bracketed word is the current one
        before = before[before.index("[") + 1 : before.index("]")]
    path.write_text(value)
    try:
        yield
    finally:
        path.write_text(before)


def gather_one_process(size: int, batch: int, seconds: float, repeats: int) -> dict[str, float]:
    import tensortier.shared as shared

    rows = size // (COLUMNS * 4)
    group = shared.Group(rank=0, world_size=1, store=torch.distributed.HashStore())
    table = group.create_tensor((rows, COLUMNS), torch.float32)
    table.local()[0].fill_(1.0)
    private = torch.ones((rows, COLUMNS), dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, rows, (batch,), generator=gen) for _ in range(8)]
    PAGES["shared table stats"] = dict(table.stats)
    rates: dict[str, list[float]] = {"shared.gather": [], "index_select": []}
    calls = {"shared.gather": table.gather, "index_select": lambda i: private.index_select(0, i)}
    for rep in range(repeats):
        order = list(calls) if rep % 2 == 0 else list(reversed(calls))
        for name in order:
            start, done = time.perf_counter(), 0
            while time.perf_counter() - start < seconds:
                calls[name](batches[done % 8])
                done += 1
            rates[name].append(done * batch / (time.perf_counter() - start))
    group.close()
    return {k: statistics.median(v) for k, v in rates.items()}


def make_table_file(path: Path, size: int) -> None:
    """A raw table file of `size` bytes (distinct rows), written once and synced."""
    if path.exists() and path.stat().st_size == size:
        return
    log(f"writing {path} ({size >> 20} MiB)")
    block = torch.arange(16 << 20 >> 2, dtype=torch.float32)
    with open(path, "wb") as f:
        done = 0
        while done < size:
            n = min(size - done, block.numel() * 4)
            f.write(block.add_(1.0).numpy().tobytes()[:n])
            done += n
        f.flush()
        os.fsync(f.fileno())


def fio_read_seconds(path: Path, size: int, bs: int, iodepth: int) -> tuple[float, str]:
    """fio's sequential O_DIRECT read of the whole file (one job, io_uring); its runtime."""
    argv = ["fio", "--name=shared-load", f"--filename={path}", "--rw=read", f"--size={size}",
            f"--bs={bs}", "--numjobs=1", "--ioengine=io_uring", "--direct=1",
            f"--iodepth={iodepth}", "--output-format=json"]
    command = shlex.join(argv)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
    return fio_stats(proc, command, "read", size)["runtime"] / 1000.0, command


def load_against_fio(args: argparse.Namespace, procs_list: list[int]) -> dict[str, Any]:
    """load_files by N processes against fio, both cold, alternating; medians of GB/s."""
    args.dir.mkdir(parents=True, exist_ok=True)
    path = args.dir / "shared_table.bin"
    size = args.load_size // (COLUMNS * 4) * (COLUMNS * 4)
    make_table_file(path, size)
    report: dict[str, Any] = {"size": size, "path": str(path)}
    for procs in procs_list:
        rates: dict[str, list[float]] = {"load_files": [], "fio": []}
        for rep in range(args.repeats):
            for kind in (["load_files", "fio"] if rep % 2 == 0 else ["fio", "load_files"]):
                drop_file_cache(path, sync=None)
                if kind == "fio":
                    seconds, command = fio_read_seconds(path, size, args.fio_bs, args.fio_iodepth)
                    report["fio_command"] = command
                else:
                    res = run_procs("load", procs, size, 0, 0, str(path))
                    seconds = max(r["seconds"] for r in res)
                    report[f"load_stats_{procs}"] = res[0]["stats"]
                rates[kind].append(size / seconds / 1e9)
        report[str(procs)] = {k: statistics.median(v) for k, v in rates.items()}
        report[str(procs)]["all"] = rates
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=parse_size, default=parse_size("1G"), help="table bytes (default 1G)")
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seconds", type=float, default=2.0, help="per gather measurement")
    p.add_argument("--batches", default="1024,65536")
    p.add_argument("--distributed-procs", default="2,4",
                   help="process counts for the distributed layout against all_to_all_single")
    p.add_argument("--parts", default="memory,gather,distributed,load", help="which measurements")
    p.add_argument("--load-size", type=parse_size, default=parse_size("1G"),
                   help="table file bytes for the load measurement (default 1G)")
    p.add_argument("--load-procs", default="2,4", help="process counts for the load measurement")
    p.add_argument("--dir", type=Path, default=Path("build/shared-bench"),
                   help="directory for the table file (on the disk to measure)")
    p.add_argument("--fio-bs", type=parse_size, default=parse_size("4M"), help="fio block size")
    p.add_argument("--fio-iodepth", type=int, default=32, help="fio iodepth (default 32)")
    p.add_argument("--reserve-huge-pages", type=int, default=None, metavar="N",
                   help="set vm.nr_hugepages to N during the run (root), restoring it after: "
                        "shared tables then get hugetlb pages")
    p.add_argument("--shmem-enabled", default=None, metavar="POLICY",
                   help="set transparent_hugepage/shmem_enabled (e.g. advise) during the run "
                        "(root), restoring it after")
    p.add_argument("--json", type=Path)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--kind", default="shared", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--path", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    with kernel_setting(NR_HUGEPAGES, None if args.reserve_huge_pages is None
                        else str(args.reserve_huge_pages)), \
            kernel_setting(SHMEM_ENABLED, args.shmem_enabled):
        PAGES["nr_hugepages"] = NR_HUGEPAGES.read_text().strip()
        PAGES["shmem_enabled"] = SHMEM_ENABLED.read_text().strip()
        measure(args)


def measure(args: argparse.Namespace) -> None:

    report: dict[str, Any] = {"size": args.size, "procs": args.procs, "columns": COLUMNS,
                              "loadavg_start": loadavg(), "memory": {}, "gather": {},
                              "gather_2_procs": {}}
    parts = set(args.parts.split(","))
    mem: dict[str, list[float]] = {"shared": [], "private": []}
    for rep in range(args.repeats if "memory" in parts else 0):
        for kind in (["shared", "private"] if rep % 2 == 0 else ["private", "shared"]):
            total = sum(r["pss"] for r in run_procs(kind, args.procs, args.size, 0, 0))
            mem[kind].append(total)
    report["memory"] = {k: statistics.median(v) for k, v in mem.items() if v}
    batches = [int(b) for b in args.batches.split(",")]
    for batch in batches if "gather" in parts else []:
        report["gather"][batch] = gather_one_process(args.size, batch, args.seconds, args.repeats)
        two: dict[str, list[float]] = {"shared": [], "private": []}
        for rep in range(args.repeats):
            for kind in (["shared", "private"] if rep % 2 == 0 else ["private", "shared"]):
                res = run_procs(kind, 2, args.size, batch, args.seconds)
                two[kind].append(sum(r["rows_per_s"] for r in res))
        report["gather_2_procs"][batch] = {k: statistics.median(v) for k, v in two.items()}
    report["distributed"] = {}
    dist_procs = [int(n) for n in args.distributed_procs.split(",") if n and "distributed" in parts]
    for procs in dist_procs:
        for batch in batches:
            rates: dict[str, list[float]] = {"distributed": [], "all_to_all": []}
            for rep in range(args.repeats):
                for kind in (["distributed", "all_to_all"] if rep % 2 == 0 else ["all_to_all", "distributed"]):
                    res = run_procs(kind, procs, args.size, batch, args.seconds)
                    rates[kind].append(sum(r["rows_per_s"] for r in res))
            report["distributed"][f"{procs}x{batch}"] = {k: statistics.median(v) for k, v in rates.items()}

    load_procs = [int(n) for n in args.load_procs.split(",") if n and "load" in parts]
    report["load"] = load_against_fio(args, load_procs) if load_procs else {}
    report["loadavg_end"] = loadavg()
    report["pages"] = PAGES

    gib = 1024**3
    print(f"load average {report['loadavg_start']} at the start, {report['loadavg_end']} at the end")
    print(f"pages: {PAGES}")
    print(f"table {args.size / gib:.2f} GiB, {args.procs} processes, median of {args.repeats}")
    print(f"{'measure':<44}{'shared':>14}{'baseline':>14}{'ratio':>8}")
    m = report["memory"]
    if m:
        print(f"{'sum of PSS, GiB (baseline: private copies)':<44}{m['shared'] / gib:>14.2f}"
              f"{m['private'] / gib:>14.2f}{m['shared'] / m['private']:>8.2f}")
    for batch in report["gather"]:
        g = report["gather"][batch]
        print(f"{f'gather {batch} rows, 1 proc, Mrows/s (index_select)':<44}"
              f"{g['shared.gather'] / 1e6:>14.2f}{g['index_select'] / 1e6:>14.2f}"
              f"{g['shared.gather'] / g['index_select']:>8.2f}")
        t = report["gather_2_procs"][batch]
        print(f"{f'gather {batch} rows, 2 procs, Mrows/s (private)':<44}"
              f"{t['shared'] / 1e6:>14.2f}{t['private'] / 1e6:>14.2f}{t['shared'] / t['private']:>8.2f}")
    for key, d in report["distributed"].items():
        procs, batch = key.split("x")
        print(f"{f'distributed, {procs} procs, {batch} rows, Mrows/s (a2a)':<44}"
              f"{d['distributed'] / 1e6:>14.2f}{d['all_to_all'] / 1e6:>14.2f}"
              f"{d['distributed'] / d['all_to_all']:>8.2f}")
    for procs in load_procs:
        d = report["load"][str(procs)]
        label = f"load_files cold, {procs} procs, GB/s (fio)"
        print(f"{label:<44}{d['load_files']:>14.2f}{d['fio']:>14.2f}{d['load_files'] / d['fio']:>8.2f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
