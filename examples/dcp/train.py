#!/usr/bin/env python3
"""A small FSDP training loop that checkpoints with dcp.async_save through tensortier.dcp.Writer,
can be killed at any moment, and resumes from its last committed checkpoint.

Run it with torchrun (``torchrun --standalone --nproc_per_node=2 train.py CKPT``) or on its own
(``python train.py CKPT --nproc 2``: it spawns the ranks). Parameters and optimizer state are
DTensors sharded on dimension 0 (``fully_shard``, Gloo on the CPU). Every ``--every`` steps the
state is saved asynchronously to CKPT/step-NNNNNN: ``Writer(async_staging=True)`` copies the
state on another thread during the next step's forward and backward passes (the optimizer step
waits for the copy), training goes on while the checkpoint is written, and a save waits for the
one before it. A checkpoint directory counts once its
``.metadata`` exists (Writer writes it last, durably); the two newest are kept. At start the
newest committed checkpoint is loaded and training continues from the step after it; a batch
is a function of its step, so a resumed run computes what an uninterrupted one would.

Each rank prints ``committed step S digest D`` when checkpoint S is committed (D: a hash of the
rank's shards of the state it saved) and ``resumed step S digest D`` for the state it loaded.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from tensortier.dcp import Reader, Writer

KEEP = 2  # committed checkpoints kept


def say(line: str) -> None:
    """One line in one write: the ranks share the terminal, and print's separate write of the
    newline would let another rank's line run into this one."""
    print(line + "\n", end="", flush=True)


def committed(ckpt: Path) -> list[Path]:
    """The committed checkpoints under `ckpt`, oldest first."""
    if not ckpt.is_dir():
        return []
    return sorted(p for p in ckpt.glob("step-*") if (p / ".metadata").is_file())


def digest(state: dict[str, Any]) -> str:
    """A hash of this rank's part of every tensor (its shards of DTensors) and of the other
    values, in key order."""
    h = hashlib.sha256()

    def add(key: str, v: Any) -> None:
        if isinstance(v, dict):
            for k in sorted(v, key=str):
                add(f"{key}.{k}", v[k])
            return
        if isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                add(f"{key}.{i}", x)
            return
        h.update(key.encode())
        if isinstance(v, DTensor):
            v = v.to_local()
        if isinstance(v, torch.Tensor):
            h.update(v.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(v).encode())

    add("", state)
    return h.hexdigest()[:16]


def model_and_optimizer(mesh: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 8))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(16, 32, generator=g)
    return x, x[:, :8].sin()


def train(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    # Checkpoint collectives run on a thread of their own: they get a process group of their
    # own, so that they never interleave with the training step's.
    ckpt_group = dist.new_group(backend="gloo")
    model, optim = model_and_optimizer(mesh)
    start = 1
    done = committed(args.ckpt)
    if done:
        last = done[-1]
        model_sd, optim_sd = get_state_dict(model, optim)
        state = {"model": model_sd, "optim": optim_sd, "step": 0}
        dcp.load(state, storage_reader=Reader(last), process_group=ckpt_group)
        set_state_dict(model, optim, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        start = int(state["step"]) + 1
        model_sd, optim_sd = get_state_dict(model, optim)
        say(f"rank {rank} resumed step {state['step']} digest "
            f"{digest({'model': model_sd, 'optim': optim_sd, 'step': state['step']})}")
    pending: Any = None  # the last save's upload
    staging: Any = None  # the last save's copy of the state: done before the state changes
    pending_step, pending_digest, reported = 0, "", True

    def report_commit() -> None:
        """Says so once the last save is committed (checked at each step: a kill before the
        next save still leaves the line to compare a resumed digest with)."""
        nonlocal reported
        if pending is not None and not reported and pending.done():
            pending.result()  # its error, if it failed
            reported = True
            say(f"rank {rank} committed step {pending_step} digest {pending_digest}")

    def wait_pending() -> None:
        nonlocal pending
        if pending is None:
            return
        pending.result()
        report_commit()
        pending = None
        dist.barrier(group=ckpt_group)  # every rank's commit seen before old ones go
        if rank == 0:
            for old in committed(args.ckpt)[:-KEEP]:
                shutil.rmtree(old, ignore_errors=True)

    for step in range(start, args.steps + 1):
        x, y = batch(step, rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if staging is not None:
            staging.result()
            staging = None
        optim.step()
        optim.zero_grad()
        if step % args.every == 0:
            wait_pending()  # one save in flight at a time
            model_sd, optim_sd = get_state_dict(model, optim)
            state = {"model": model_sd, "optim": optim_sd, "step": step}
            pending_step, pending_digest, reported = step, digest(state), False
            writer = Writer(args.ckpt / f"step-{step:06d}", async_staging=True)
            response = dcp.async_save(state, storage_writer=writer, process_group=ckpt_group)
            staging, pending = response.staging_completion, response.upload_completion
        report_commit()
        if rank == 0 and step % 10 == 0:
            say(f"step {step} loss {loss.item():.5f}")
        if args.step_seconds:
            time.sleep(args.step_seconds)
    wait_pending()


def rank_main(rank: int, args: argparse.Namespace, rendezvous: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=args.nproc)
    try:
        train(args)
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("ckpt", type=Path, help="the checkpoints' directory")
    p.add_argument("--steps", type=int, default=100, help="train up to this step")
    p.add_argument("--every", type=int, default=10, help="checkpoint every this many steps")
    p.add_argument("--nproc", type=int, default=2,
                   help="ranks to spawn when not started by torchrun")
    p.add_argument("--step-seconds", type=float, default=0.0,
                   help="sleep this long after each step (a slower model, for demonstrations)")
    args = p.parse_args()
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group("gloo")
        try:
            train(args)
        finally:
            dist.destroy_process_group()
        return
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        # fork: the ranks start with torch imported already.
        mp.start_processes(rank_main, args=(args, os.path.join(tmp, "rendezvous")),
                           nprocs=args.nproc, start_method="fork")


if __name__ == "__main__":
    main()
