"""GPU benchmark: file -> GPU and GPU -> file, tensortier (bounce ring, GDS) against the plain
Python baseline of examples/file_access/py_*_gpu_tensor.py and torch.cuda.gds.GdsFile (where it
runs), with the limits measured in the same run: the file read rate (tensortier into host memory)
and the pinned host -> device copy rate. Page cache warm and cold, methods alternated, median of
the repeats; every load of every method is validated against the source (untimed; the target
is cleared before each load). Prints a table and writes JSON.

    python bench/gpu_bench.py --dir /nvme/bench --sizes 1G,8G --json out/gpu_bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import tensortier

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/_benchlib.py, from any directory
from _benchlib import GB, SIZE_UNITS, drop_file_cache, log, warm_file  # noqa: E402


def parse_size(text: str) -> int:
    """'1G' -> 1073741824. Kept apart from _benchlib.parse_size: this one accepts fractions
    ('1.5G'), strips every trailing 'B' and then every 'I', and validates nothing (ValueError
    or a traceback on bad input, no argparse error)."""
    text = text.strip().upper().rstrip("B").rstrip("I")
    if text and text[-1] in SIZE_UNITS:
        return int(float(text[:-1]) * SIZE_UNITS[text[-1]])
    return int(text)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / GB


def timed(run: Callable[[], Any]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    run()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def copy_rates(nbytes: int = 1 << 30, repeats: int = 4) -> dict[str, float]:
    """Pinned host <-> device copy rates (tensortier's pinned memory)."""
    host = tensortier.pinned_empty(nbytes)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    h2d = [gbps(nbytes, timed(lambda: dev.copy_(host, non_blocking=True))) for _ in range(repeats)]
    d2h = [gbps(nbytes, timed(lambda: host.copy_(dev, non_blocking=True))) for _ in range(repeats)]
    del host, dev
    return {"h2d_pinned_gbps": statistics.median(h2d), "d2h_pinned_gbps": statistics.median(d2h)}


def python_read(path: str) -> torch.Tensor:
    with open(path, "rb") as f, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(f.read(), dtype=torch.uint8)


def torch_gds_file(path: str, flags: int) -> Any:
    from torch.cuda.gds import GdsFile

    return GdsFile(path, flags)


def taken_path(result: Any) -> str:
    """The path an IOHandle transfer took ("bounce", "gds"), marked where cuFile ran in its
    compatibility mode (no nvidia-fs: POSIX I/O through cuFile's own buffers, not GPUDirect)."""
    stats = result.stats
    if stats["path"] == "gds" and stats.get("gds_reason"):
        return "gds (compat)"
    return stats["path"]


def bench_size(size: int, folder: str, repeats: int, caches: list[str]) -> list[dict[str, Any]]:
    path = os.path.join(folder, f"gpu_bench_{size}.bin")
    rows: list[dict[str, Any]] = []
    src = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    bounce = tensortier.IOHandle(gds="off")
    bounce.pwrite(src, path)  # the file every load reads
    out_path = os.path.join(folder, f"gpu_bench_store_{size}.bin")
    # cuFile itself ("on"), where it takes these files: "auto" takes the ring where cuFile would
    # run in its compatibility mode (no nvidia-fs), which would only time the bounce ring twice.
    # One untimed load and store first: a refusal is a note, not the end of the run.
    gds: Any = None
    cufile_note = tensortier.cufile_info()["why_unavailable"]
    if not cufile_note:
        try:
            gds = tensortier.IOHandle(gds="on")
            gds.pread_async(dst, path).result()
            gds.pwrite_async(src[:4096], out_path).result()
        except Exception as e:  # noqa: BLE001 - reported in the JSON
            cufile_note = f"gds='on' refused: {type(e).__name__}: {e}"
            if gds is not None:
                gds.close()
            gds = None
    host = tensortier.aligned_empty(size, reused=True, resident=True)  # reused: huge pages
    torch_gds_error = ""
    try:
        torch_gds_file(path, os.O_RDONLY)
    except Exception as e:  # noqa: BLE001 - reported in the JSON
        torch_gds_error = f"{type(e).__name__}: {e}"

    def load_bounce() -> str:
        return taken_path(bounce.pread_async(dst, path).result())

    def load_gds() -> str:
        return taken_path(gds.pread_async(dst, path).result())

    def load_py() -> str:
        dst.copy_(python_read(path).cuda())
        return "python"

    torch_source: list[Any] = []  # torch's GdsFile of `path`, opened and registered once (its
    # best case, as tensortier's IOHandle keeps its registration of a file)

    def load_torch_gds() -> str:
        if not torch_source:
            torch_source.append(torch_gds_file(path, os.O_RDONLY))
        torch_source[0].load_storage(dst.untyped_storage(), 0)
        return "torch.cuda.gds"

    def read_host() -> str:
        bounce.pread(host, path)
        return "host"

    read_rate = "file_read_rate (tensortier -> host)"

    def clear(name: str) -> None:
        """Untimed, before each load: a load that moved nothing must fail validation."""
        (host if name == read_rate else dst).zero_()

    def validate(name: str, cache: str, rep: int) -> None:
        """Untimed, after each load: every method's data is checked, not only the last one's."""
        if name == read_rate:
            dst.copy_(host)
        if not torch.equal(src, dst):
            raise SystemExit(
                f"load validation failed: {name}, size {size}, {cache} cache, repeat {rep}"
            )

    loads: dict[str, Callable[[], str]] = {
        read_rate: read_host,
        "tensortier bounce": load_bounce,
        "py_load_gpu_tensor": load_py,
    }
    if gds is not None:
        loads["tensortier gds=on (cuFile)"] = load_gds
    if not torch_gds_error:
        loads["torch.cuda.gds.GdsFile"] = load_torch_gds

    def store_bounce() -> str:
        return taken_path(bounce.pwrite_async(src, out_path).result())

    def store_gds() -> str:
        return taken_path(gds.pwrite_async(src, out_path).result())

    def store_py() -> str:
        with open(out_path, "wb") as f:
            f.write(src.cpu().numpy())
        return "python (page cache)"

    def store_torch_gds() -> str:
        # a new file each time (the last one was unlinked), as tensortier's stores write one
        torch_gds_file(out_path, os.O_CREAT | os.O_RDWR).save_storage(src.untyped_storage(), 0)
        return "torch.cuda.gds"

    stores: dict[str, Callable[[], str]] = {
        "tensortier bounce": store_bounce,
        "py_store_gpu_tensor": store_py,
    }
    if gds is not None:
        stores["tensortier gds=on (cuFile)"] = store_gds
    if not torch_gds_error:
        stores["torch.cuda.gds.GdsFile"] = store_torch_gds

    for cache in caches:
        times: dict[str, list[float]] = {name: [] for name in loads}
        paths: dict[str, str] = {}
        names = list(loads)
        for rep in range(repeats):
            order = names if rep % 2 == 0 else names[::-1]  # alternate the order
            for name in order:
                clear(name)
                (drop_file_cache if cache == "cold" else warm_file)(path)
                taken = [""]
                times[name].append(timed(lambda: taken.__setitem__(0, loads[name]())))
                paths[name] = taken[0]
                validate(name, cache, rep)
        for name in names:
            rows.append(row("load", size, cache, name, paths[name], times[name]))
    times_s: dict[str, list[float]] = {name: [] for name in stores}
    paths_s: dict[str, str] = {}
    for rep in range(repeats):
        order = list(stores) if rep % 2 == 0 else list(stores)[::-1]
        for name in order:
            taken = [""]
            times_s[name].append(timed(lambda: taken.__setitem__(0, stores[name]())))
            paths_s[name] = taken[0]
            if os.path.exists(out_path):
                os.unlink(out_path)
    for name in stores:
        rows.append(row("store", size, "n/a", name, paths_s[name], times_s[name]))
    rows += offload_rows(src, folder, repeats)
    bounce.close()
    if gds is not None:
        gds.close()
    torch_source.clear()  # closes torch's file (deregistered as it goes)
    os.unlink(path)
    del src, dst, host
    torch.cuda.empty_cache()
    if torch_gds_error:
        rows.append({"op": "note", "size": size, "torch_cuda_gds": torch_gds_error})
    if cufile_note:
        rows.append({"op": "note", "size": size, "cufile": cufile_note})
    return rows


def offload_rows(src: torch.Tensor, folder: str, repeats: int) -> list[dict[str, Any]]:
    """DiskOffloader with a CUDA tensor of src's size: ``sync_write`` (its GPU memory freed once
    the data is on disk) then ``sync_read`` (allocated again, restored; cold: the writes were
    O_DIRECT), alternately; each restore validated (untimed). Compare with the store and load
    rows of IOHandle's bounce ring above, the same path underneath."""
    size = src.numel()
    work = src.clone()
    writes: list[float] = []
    reads: list[float] = []
    with tensortier.DiskOffloader(os.path.join(folder, "gpu_bench_offload")) as off:
        for rep in range(repeats):
            writes.append(timed(lambda: off.sync_write(work)))
            if work.untyped_storage().nbytes() != 0:
                raise SystemExit("offload: the GPU memory of a written tensor was not freed")
            reads.append(timed(lambda: off.sync_read(work)))
            if not torch.equal(work, src):
                raise SystemExit(f"offload validation failed: size {size}, repeat {rep}")
        path = ",".join(sorted(off.device_bytes)) or "none"
    del work
    return [
        row("offload write", size, "n/a", "DiskOffloader.sync_write", path, writes),
        row("offload read", size, "cold", "DiskOffloader.sync_read", path, reads),
    ]


def row(op: str, size: int, cache: str, method: str, path: str, seconds: list[float]) -> dict:
    rates = [gbps(size, s) for s in seconds]
    return {"op": op, "size": size, "cache": cache, "method": method, "path": path,
            "gbps_median": statistics.median(rates), "gbps": rates}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True, help="folder on the disk to measure")
    p.add_argument("--sizes", default="1G,8G", help="comma-separated sizes (1G,8G)")
    p.add_argument("--repeats", type=int, default=None,
                   help="repeats per method (default 3, and 2 for sizes over 2 GiB)")
    p.add_argument("--caches", default="warm,cold")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        log("gpu_bench: no CUDA device; nothing to measure")
        return 2
    os.makedirs(args.dir, exist_ok=True)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda_driver": tensortier.cuda_info(),
        "cufile": tensortier.cufile_info(),
        "command": " ".join(sys.argv),
    }
    report.update(copy_rates())
    rows: list[dict[str, Any]] = []
    report["results"] = rows

    def dump() -> None:
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)

    for size in (parse_size(s) for s in args.sizes.split(",")):
        if args.repeats is not None:
            repeats = max(1, args.repeats)
        else:
            repeats = 3 if size <= (2 << 30) else 2
        rows += bench_size(size, args.dir, repeats, args.caches.split(","))
        dump()  # a later size killed by a time limit keeps this one's results
    # The target: file -> GPU >= 0.9 x min(file read rate, pinned H2D rate), same run.
    checks = []
    for r in rows:
        if r["op"] == "load" and r["method"] == "tensortier bounce":
            read = next(x for x in rows if x["op"] == "load" and x["size"] == r["size"]
                        and x["cache"] == r["cache"] and x["method"].startswith("file_read_rate"))
            limit = min(read["gbps_median"], report["h2d_pinned_gbps"])
            checks.append({"size": r["size"], "cache": r["cache"], "load_gbps": r["gbps_median"],
                           "limit_gbps": limit, "ratio": r["gbps_median"] / limit})
    report["load_vs_limit"] = checks
    print(f"device: {report['device']}  pinned H2D {report['h2d_pinned_gbps']:.2f} GB/s, "
          f"D2H {report['d2h_pinned_gbps']:.2f} GB/s; cuFile: "
          f"{'available' if report['cufile']['available'] else report['cufile']['why_unavailable']}")
    print(f"{'op':13} {'size':>6} {'cache':5} {'method':38} {'path':18} {'GB/s':>7}")
    for r in rows:
        if r["op"] == "note":
            for key, what in (("torch_cuda_gds", "torch.cuda.gds"), ("cufile", "cuFile")):
                if key in r:
                    print(f"note: {what} at {r['size'] >> 20} MiB: {r[key]}")
            continue
        print(f"{r['op']:13} {r['size'] >> 20:5}M {r['cache']:5} {r['method']:38} {r['path']:18} "
              f"{r['gbps_median']:7.2f}")
    for c in checks:
        print(f"load {c['size'] >> 20}M {c['cache']}: {c['load_gbps']:.2f} GB/s = "
              f"{c['ratio']:.2f} x min(file read, H2D) = {c['limit_gbps']:.2f} GB/s (target >= 0.9)")
    if args.json:
        dump()
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
