"""tensortier.dcp.Reader's reads of parts of stored tensors (a load into another sharding), in
one process: the requests DCP's planner makes for a target block, read by the Reader."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from tensortier import _core
from tensortier import dcp as tdcp

BIN = Path(os.environ.get("TENSORTIER_CLI", Path(sys.executable).parent / "tensortier"))
ROWS, COLS = 64, 2048  # float32: rows of 8 KiB, 512 KiB of data


class _BlockPlanner:
    """The planner's side of a read: each request's target is its block of `out`."""

    def __init__(self, out: torch.Tensor) -> None:
        self.out = out

    def resolve_tensor(self, req: Any) -> torch.Tensor:
        t = self.out
        for dim, (start, length) in enumerate(zip(req.dest_offsets, req.lengths)):
            t = t.narrow(dim, start, length)
        return t

    def commit_tensor(self, req: Any, tensor: torch.Tensor) -> None:
        pass


def read_block(ckpt: Path, offsets: list[int], sizes: list[int],
               verify: bool | str = True) -> tuple[torch.Tensor, int]:
    """The block of "w" at `offsets` of `sizes`, as a rank of another sharding reads it, and the
    bytes the Reader read."""
    reader = tdcp.Reader(ckpt, verify=verify)
    md = reader.read_metadata()
    reader.set_up_storage_reader(md, True)
    chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
    items = create_read_items_for_chunk_list("w", md.state_dict_metadata["w"], [chunk])
    out = torch.full(sizes, -1.0)
    reader.read_data(LoadPlan(items), _BlockPlanner(out)).wait()
    return out, reader.bytes_read


def test_parts_are_checked_by_the_blocks_they_touch(tmp_path: Path) -> None:
    """A flipped byte inside the part a resharded target reads raises ValueError naming the file,
    the item and the block's byte range (default verify; `tensortier verify` by the same rule);
    one outside the blocks the part touches does not stop the load, which reads those blocks
    alone. Torch's reader loads the checkpoint with its block sums."""
    w = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    ckpt = tmp_path / "ckpt"
    dcp.save({"w": w}, storage_writer=tdcp.Writer(ckpt), no_dist=True)
    md = pickle.loads((ckpt / ".metadata").read_bytes())
    info = next(iter(md.storage_data.values()))
    block = _core.dcp_block_bytes
    assert len(info.xxh64_blocks) == 8 * (w.nbytes // block)
    got = {"w": torch.zeros(ROWS, COLS)}
    dcp.load(got, storage_reader=dcp.FileSystemReader(ckpt), no_dist=True)
    assert torch.equal(got["w"], w)

    # Rows 0-15, columns 0-1023: 64 KiB of the 4 blocks that hold rows 0-15, of 16.
    part, bytes_read = read_block(ckpt, [0, 0], [16, 1024])
    assert torch.equal(part, w[:16, :1024])
    _, whole = read_block(ckpt, [0, 0], [16, 1024], verify="full")  # reads the item whole
    assert 16 * COLS * 4 <= bytes_read < whole / 2, (bytes_read, whole)

    path = ckpt / info.relative_path
    raw = bytearray(path.read_bytes())
    data = bytes(raw).find(w.numpy().tobytes())
    assert data > 0
    outside = tmp_path / "outside"
    shutil.copytree(ckpt, outside)
    flip = data + (40 * COLS + 5) * 4  # row 40: a block the part does not touch
    (outside / info.relative_path).write_bytes(
        bytes(raw[:flip]) + bytes([raw[flip] ^ 0x40]) + bytes(raw[flip + 1:]))
    part, _ = read_block(outside, [0, 0], [16, 1024])
    assert torch.equal(part, w[:16, :1024])

    flip = data + (1 * COLS + 10) * 4  # row 1, column 10: inside the part, in block 0
    raw[flip] ^= 0x40
    path.write_bytes(bytes(raw))
    start = info.offset
    with pytest.raises(ValueError) as e:
        read_block(ckpt, [0, 0], [16, 1024])
    msg = str(e.value)
    assert info.relative_path in msg and "'w'" in msg, msg
    assert f"[{start}, {start + info.length})" in msg and f"[{data}, {data + block})" in msg, msg
    part, _ = read_block(ckpt, [0, 0], [16, 1024], verify=False)  # unchecked: loads wrong
    assert not torch.equal(part, w[:16, :1024])
    part, _ = read_block(ckpt, [32, 0], [16, 1024])  # rows 32-47: blocks 8-11, undamaged
    assert torch.equal(part, w[32:48, :1024])
    if BIN.is_file():  # the CLI names the damaged block by the same rule
        for where, at in ((ckpt, 0), (outside, 10)):
            bad = subprocess.run([str(BIN), "verify", str(where)], capture_output=True,
                                 text=True, errors="replace", timeout=60)
            assert bad.returncode == 1, bad.stdout
            begin = data + at * block
            assert "'w'" in bad.stderr and f"[{begin}, {begin + block})" in bad.stderr, bad.stderr


def test_reader_verify_is_true_false_or_full() -> None:
    from tensortier.dcp import Reader

    for verify in (True, False, "full"):
        assert Reader("ckpt", verify=verify).verify == verify
    for verify in ("fast", "FULL", "off", 1, None):
        with pytest.raises(ValueError, match=f"verify must be True, False or 'full', not {verify!r}"):
            Reader("ckpt", verify=verify)  # type: ignore[arg-type]


@pytest.mark.parametrize("verify", [True, False])
def test_targets_sharing_memory_take_the_last_item_as_stock_dcp_does(
        tmp_path: Path, verify: bool) -> None:
    """Two names tied to one tensor, and a planner whose resolve_tensor returns one scratch
    tensor it copies out at each commit: every item is read apart and committed in turn (the
    last wins), never two reads racing into one memory (a false checksum mismatch, or values
    that change from run to run)."""
    saved = {"emb": torch.full((256,), 1.0), "head": torch.full((256,), 2.0),
             **{f"w{i}": torch.full((64,), float(i)) for i in range(4)}}
    for writer in (tdcp.Writer(tmp_path / "ours"), dcp.FileSystemWriter(tmp_path / "stock")):
        dcp.save(saved, storage_writer=writer, no_dist=True)
    for ckpt in (tmp_path / "ours", tmp_path / "stock"):
        tied = torch.zeros(256)
        dcp.load({"emb": tied, "head": tied}, storage_reader=tdcp.Reader(ckpt, verify=verify),
                 no_dist=True)
        expected = torch.zeros(256)
        dcp.load({"emb": expected, "head": expected},
                 storage_reader=dcp.FileSystemReader(ckpt), no_dist=True)
        assert torch.equal(tied, expected)

        class Scratch(dcp.DefaultLoadPlanner):
            """Reads every tensor into one scratch tensor, cast into its target at commit."""

            scratch = torch.zeros(64)

            def resolve_tensor(self, read_item: Any) -> torch.Tensor:
                return self.scratch

            def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
                self.lookup_tensor(read_item.dest_index).copy_(tensor)

        out = {f"w{i}": torch.zeros(64, dtype=torch.bfloat16) for i in range(4)}
        dcp.load(out, storage_reader=tdcp.Reader(ckpt, verify=verify), planner=Scratch(),
                 no_dist=True)
        for i in range(4):
            assert torch.equal(out[f"w{i}"], torch.full((64,), float(i), dtype=torch.bfloat16))


def test_metadata_of_torch_2_0_to_2_2_is_read_as_stock_reads_it(tmp_path: Path) -> None:
    """torch 2.0 to 2.2 pickled each tensor's TensorProperties (and its memory format's enum)
    from torch.distributed._shard.sharded_tensor.metadata, which torch still has: stock's reader
    loads such a checkpoint, and so do the Reader and the CLI."""
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties as Old
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    ckpt = tmp_path / "old"
    dcp.save({"w": torch.arange(6.0), "step": 3}, storage_writer=dcp.FileSystemWriter(ckpt),
             no_dist=True)
    md = pickle.loads((ckpt / ".metadata").read_bytes())
    for value in md.state_dict_metadata.values():
        if isinstance(value, TensorStorageMetadata):
            p = value.properties
            value.properties = Old(dtype=p.dtype, layout=p.layout, requires_grad=p.requires_grad,
                                   memory_format=p.memory_format, pin_memory=p.pin_memory)
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    assert b"torch.distributed._shard.sharded_tensor.metadata" in (ckpt / ".metadata").read_bytes()
    for reader in (tdcp.Reader(ckpt), dcp.FileSystemReader(ckpt)):
        got = {"w": torch.zeros(6), "step": 0}
        dcp.load(got, storage_reader=reader, no_dist=True)
        assert torch.equal(got["w"], torch.arange(6.0)) and got["step"] == 3
    if BIN.is_file():
        for command in ("info", "verify"):
            said = subprocess.run([str(BIN), command, str(ckpt)], capture_output=True, text=True,
                                  timeout=120)
            assert said.returncode == 0, said.stdout + said.stderr
