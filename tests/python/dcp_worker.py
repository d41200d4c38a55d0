"""One rank of a torch.distributed.checkpoint test (Gloo on CPU; RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set by the test): python dcp_worker.py SCENARIO CKPT_DIR OUT_DIR [VERSION].

save-ours / save-stock: saves version VERSION of the state dict with tensortier's Writer / torch's
FileSystemWriter. load-ours / load-stock: loads into a zeroed state dict and compares it with
version VERSION. Each rank writes OUT_DIR/rank<r>.json: {"ok": bool, "error": str}. With
DCP_KILL_RANK set, that rank kills itself (SIGKILL) DCP_KILL_AFTER seconds into its file write
(DCP_KILL_IN=finish: as it starts the commit);
DCP_PG_TIMEOUT: the process group's timeout (seconds).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import threading
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import tensortier.dcp as tdcp


def state(version: int, zeros: bool, world: int) -> dict[str, Any]:
    """Version `version` of the state dict (every rank makes the same one), or its shape in
    zeros to load into."""
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(1000 + version)
    big = int(os.environ.get("DCP_BIG", "300000"))
    full = {
        "shard0": torch.randn(16, 8, generator=g),
        "shard_big": torch.randn(world * big, generator=g),
        "repl": torch.arange(10, dtype=torch.int64) + version,
        "plain_f16": torch.arange(7, dtype=torch.float16) + version,
        "bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "bool": torch.tensor([True, False, version % 2 == 0]),
        "u8": (torch.arange(300) % 251).to(torch.uint8),
        "c64": torch.randn(4, generator=g, dtype=torch.complex64),
        "f64": torch.randn(2, 3, generator=g, dtype=torch.float64).t(),
        "empty": torch.empty(0, 3),
        "i32_scalar": torch.tensor(7 + version, dtype=torch.int32),
    }
    if zeros:
        full = {k: torch.zeros_like(v) for k, v in full.items()}
    sd: dict[str, Any] = {}
    for k, v in full.items():
        if k.startswith("shard"):
            sd[k] = distribute_tensor(v, mesh, [Shard(0)])
        elif k == "repl":
            sd[k] = distribute_tensor(v, mesh, [Replicate()])
        else:
            sd[k] = v
    sd["step"] = -1 if zeros else version
    sd["extra"] = {"lr": 0.0 if zeros else 0.1 * version, "name": "" if zeros else f"v{version}",
                   "ids": [] if zeros else [1, 2, version]}
    return sd


def compare(got: dict[str, Any], want: dict[str, Any]) -> None:
    for k, w in want.items():
        g = got[k]
        if isinstance(w, DTensor):
            w, g = w.full_tensor(), g.full_tensor()
        if isinstance(w, torch.Tensor):
            if g.dtype != w.dtype or g.shape != w.shape or not torch.equal(g, w):
                raise AssertionError(f"{k}: got {g!r}, want {w!r}")
        elif g != w:
            raise AssertionError(f"{k}: got {g!r}, want {w!r}")


def arm_kill(rank: int) -> None:
    """Makes this rank kill itself (SIGKILL): DCP_KILL_AFTER seconds after its file write
    starts, or, with DCP_KILL_IN=finish, as the coordinator starts its commit."""
    if os.environ.get("DCP_KILL_RANK") != str(rank):
        return
    after = float(os.environ.get("DCP_KILL_AFTER", "0"))
    step = os.environ.get("DCP_KILL_IN", "write_data")
    original = getattr(tdcp.Writer, step)

    def killed(self: Any, *args: Any, **kwargs: Any) -> Any:
        if after == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Timer(after, os.kill, (os.getpid(), signal.SIGKILL)).start()
        return original(self, *args, **kwargs)

    setattr(tdcp.Writer, step, killed)


def main() -> None:
    scenario, ckpt, out = sys.argv[1], sys.argv[2], sys.argv[3]
    version = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    rank = int(os.environ["RANK"])
    result: dict[str, Any] = {"ok": False}
    try:
        timeout = float(os.environ.get("DCP_PG_TIMEOUT", "30"))
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
        world = dist.get_world_size()
        if scenario.startswith("save"):
            arm_kill(rank)
            writer = tdcp.Writer(ckpt) if scenario == "save-ours" else dcp.FileSystemWriter(ckpt)
            dcp.save(state(version, False, world), storage_writer=writer)
        else:
            reader = tdcp.Reader(ckpt) if scenario == "load-ours" else dcp.FileSystemReader(ckpt)
            sd = state(version, True, world)
            dcp.load(sd, storage_reader=reader)
            compare(sd, state(version, False, world))
        dist.barrier()
        result["ok"] = True
    except BaseException as e:  # reported to the test, which shows it
        result["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
