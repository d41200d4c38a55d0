"""One rank of a torch.distributed.checkpoint test job (Gloo on CPU), forked by ranks.ForkServer:
``main([JOB])``, JOB a JSON object {"out": DIR, "steps": [STEP...]} run in one process group.

A STEP is {"do": "save" | "load", "with": "ours" | "stock", "dir": CKPT, "v": VERSION,
"layout": "mixed" | "small" | "disagree", ...}: a save of version VERSION of the layout's state dict, or a load
into a zeroed one compared with it. Options: "big": "S0" | "S1" (the placement of the layout's
large tensor "big", Shard(0) by default: a load into another placement reshards it), "only":
[KEYS] (a load of those keys alone), "format": "safetensors" (stock saves), "kill": SECONDS
(with "victim": RANK: that rank SIGKILLs itself that long after the save starts, or as
the save returns if that comes first), "planner": "ours" (planned by tensortier.dcp's
planners), "fail": True (the
step must raise; its error is reported). Each rank writes DIR/rank<r>.json: {"ok", "error",
"steps": [{"seconds", "bytes_read", "needed", "error"}]}.

The values of every layout are a function of the version alone (``full_state``), whatever the
world size: a checkpoint of one world loads into another.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import threading
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import tensortier.dcp as tdcp
from tensortier._runtime import torch_dtypes

BIG = (64, 32768)  # "big": 8 MiB of float32; half a row is 64 KiB
SMALL = 20_000  # tensors of "small", 1 KiB per rank each


def dtype_tensors(g: torch.Generator) -> dict[str, torch.Tensor]:
    """A 3 x 5 tensor of every dtype tensortier saves and DCP plans for (random bytes; bool 0/1),
    keyed "dt_<name>"."""
    out = {}
    quantized = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}
    for name, dt in sorted(torch_dtypes().items()):
        if dt in quantized:  # no plain tensors of these (torch.quantize_per_tensor makes them)
            continue
        try:
            itemsize = torch._utils._element_size(dt)  # DCP's planner sizes items with it
        except (TypeError, RuntimeError):  # bits dtypes: DCP cannot save them
            continue
        raw = torch.randint(0, 256, (15 * itemsize,), generator=g, dtype=torch.uint8)
        if dt == torch.bool:
            out[f"dt_{name}"] = (raw[:15] % 2).bool().reshape(3, 5)
            continue
        try:
            out[f"dt_{name}"] = raw.view(dt).reshape(3, 5)
        except (RuntimeError, TypeError):  # a dtype torch cannot view bytes as (quantized...)
            continue
    return out


def full_state(version: int, layout: str = "mixed") -> dict[str, Any]:
    """Version `version` of a layout's state dict as whole tensors (what every world saves)."""
    g = torch.Generator().manual_seed(1000 + version)
    if layout == "small":
        return {"step": version}
    sd: dict[str, Any] = {
        "s0": torch.randn(16, 8, generator=g),
        "s1": torch.randn(6, 20, generator=g),
        "s0_bf16": torch.randn(12, 3, generator=g).to(torch.bfloat16),
        "repl": torch.arange(10, dtype=torch.int64) + version,
        "big": torch.randn(*BIG, generator=g),
        "empty": torch.empty(0, 3),
        "empty_s0": torch.empty(0, 4),
        "i32_scalar": torch.tensor(7 + version, dtype=torch.int32),
        "f64_t": torch.randn(2, 3, generator=g, dtype=torch.float64).t(),
    }
    sd.update(dtype_tensors(g))
    sd["step"] = version
    sd["extra"] = {"lr": 0.1 * version, "name": f"v{version}", "ids": [1, 2, version]}
    return sd


PLACEMENT = {"s0": Shard(0), "s0_bf16": Shard(0), "s1": Shard(1), "repl": Replicate(),
             "empty_s0": Shard(0)}


def zeroed(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, dict):
        return {k: zeroed(v) for k, v in value.items()}
    if isinstance(value, list):
        return []
    return type(value)()


def small_state(version: int, zeros: bool, count: int = SMALL) -> dict[str, Any]:
    """`count` tensors of 256 float32 on each rank, under keys of its own ("r<rank>.t<i>": DCP
    saves each rank's, where it would save one copy of a plain tensor all ranks hold)."""
    rank = dist.get_rank()
    base = torch.arange(count * 256, dtype=torch.float32).reshape(count, 256)
    local = torch.zeros_like(base) if zeros else base + (version * 10 + rank)
    sd: dict[str, Any] = {f"r{rank}.t{i}": local[i] for i in range(count)}
    sd["step"] = -1 if zeros else version
    return sd


def state(step: dict[str, Any], zeros: bool, mesh: Any) -> dict[str, Any]:
    """The step's state dict on this rank: DTensors placed as PLACEMENT says (and "big" as the
    step's "big"), the rest plain."""
    if step.get("layout") == "small":
        return small_state(int(step["v"]), zeros, int(step.get("count", SMALL)))
    if step.get("layout") == "disagree":  # ranks hold one key of other sizes and dtypes
        rank = dist.get_rank()
        return {"a": torch.ones(1 + 3 * rank), "b": torch.ones(1), "c": rank,
                "d": torch.ones(2, dtype=torch.float32 if rank == 0 else torch.float64),
                "e": torch.ones(3)}
    full = full_state(int(step["v"]))
    if "only" in step:
        full = {k: full[k] for k in step["only"]}
    placement = dict(PLACEMENT, big=Shard(1) if step.get("big") == "S1" else Shard(0))
    sd: dict[str, Any] = {}
    for k, v in full.items():
        v = zeroed(v) if zeros else v
        sd[k] = distribute_tensor(v, mesh, [placement[k]]) if k in placement else v
    return sd


def to_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def compare(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Equal keys, types, dtypes, shapes and bytes (NaNs of random bytes compare equal)."""
    if set(got) != set(want):
        raise AssertionError(f"keys differ: {sorted(set(got) ^ set(want))}")
    for k, w in want.items():
        g = got[k]
        if isinstance(w, DTensor):
            w, g = w.to_local(), g.to_local()
        if isinstance(w, torch.Tensor):
            if g.dtype != w.dtype or g.shape != w.shape or not torch.equal(to_bytes(g),
                                                                           to_bytes(w)):
                raise AssertionError(f"{k}: got {g!r}, want {w!r}")
        elif g != w:
            raise AssertionError(f"{k}: got {g!r}, want {w!r}")


def local_bytes(sd: dict[str, Any]) -> int:
    """The bytes of this rank's tensors (what a load of `sd` needs to read)."""
    total = 0
    for v in sd.values():
        if isinstance(v, DTensor):
            v = v.to_local()
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
    return total


class RacedReader(tdcp.Reader):
    """Rank 0 reads .metadata and then commits a save of `replacement` into the directory (one
    process) before rank 1 reads .metadata: the ranks read two different checkpoints."""

    def __init__(self, path: str, replacement: dict[str, Any]) -> None:
        super().__init__(path)
        self.replacement = replacement

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        marker = os.path.join(os.path.dirname(self.path), "raced-save-committed")
        if dist.get_rank() == 0:
            md = super().read_metadata(*args, **kwargs)
            dcp.save(self.replacement, storage_writer=tdcp.Writer(self.path), no_dist=True)
            open(marker, "w").close()
            return md
        deadline = time.monotonic() + 60
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.01)
        return super().read_metadata(*args, **kwargs)


def run_step(step: dict[str, Any], mesh: Any) -> dict[str, Any]:
    rank = dist.get_rank()
    report: dict[str, Any] = {}
    start = time.monotonic()
    if step["do"] == "save":
        if "kill" in step and int(step.get("victim", 1)) == rank:
            threading.Timer(float(step["kill"]), os.kill, (os.getpid(), signal.SIGKILL)).start()
        if step["with"] == "ours":
            writer: Any = tdcp.Writer(step["dir"])
        else:
            kwargs = {}
            if step.get("format"):
                from torch.distributed.checkpoint.filesystem import SerializationFormat

                kwargs["serialization_format"] = SerializationFormat[step["format"].upper()]
            writer = dcp.FileSystemWriter(step["dir"], **kwargs)
        # "collectives": false, a save without them: rank-local __N.metadata (torch's writer).
        # "planner": "ours", planned by tensortier.dcp.SavePlanner.
        kwargs = {} if step.get("collectives", True) else {"use_collectives": False}
        if step.get("planner") == "ours":
            kwargs["planner"] = tdcp.SavePlanner()
        dcp.save(state(step, False, mesh), storage_writer=writer, **kwargs)
        if "kill" in step and int(step.get("victim", 1)) == rank:  # the timer came late
            os.kill(os.getpid(), signal.SIGKILL)
    else:
        reader: Any = dcp.FileSystemReader(step["dir"]) if step["with"] != "ours" \
            else RacedReader(step["dir"], state({**step, "v": int(step["v"]) + 1}, False, mesh)) \
            if step.get("race") \
            else tdcp.Reader(step["dir"], verify=step.get("verify", True))
        sd = state(step, True, mesh)
        dcp.load(sd, storage_reader=reader,
                 **({"planner": tdcp.LoadPlanner()} if step.get("planner") == "ours" else {}))
        compare(sd, state(step, False, mesh))
        report["needed"] = local_bytes(sd)
        report["bytes_read"] = getattr(reader, "bytes_read", None)
    report["seconds"] = time.monotonic() - start
    return report


def main(args: list[str]) -> None:
    job = json.loads(args[0])
    rank = int(os.environ["RANK"])
    result: dict[str, Any] = {"ok": False, "steps": []}
    try:
        timeout = float(os.environ.get("DCP_PG_TIMEOUT", "60"))
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for step in job["steps"]:
            try:
                result["steps"].append(run_step(step, mesh))
            except BaseException as e:  # DCP's CheckpointException is a BaseException
                if not step.get("fail"):
                    raise
                result["steps"].append({"error": f"{type(e).__name__}: {e}"})
            dist.barrier()
        result["ok"] = True
    except BaseException as e:  # reported to the test, which shows it
        result["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
    path = os.path.join(job["out"], f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:  # whole or absent, whenever the rank is killed
        json.dump(result, f)
    os.rename(path + ".tmp", path)
    if dist.is_initialized():
        dist.destroy_process_group()
