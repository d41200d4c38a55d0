"""tensortier.dcp: torch.distributed.checkpoint's Writer and Reader on tensortier's engine, in
real Gloo processes (dcp_worker.py) and, for single-process cases, without a process group."""

from __future__ import annotations

import dataclasses
import errno
import io
import json
import os
import pickle
import random
import re
import shutil
import signal
import subprocess
import threading
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import dcp_worker
from ranks import ForkServer
from tensortier import _core
from tensortier import dcp as tdcp
from tensortier._runtime import default_io

TIMEOUT = 120  # seconds one job of ranks may take on a loaded 2-core machine


@pytest.fixture(scope="module")
def ranks() -> Iterator[ForkServer]:
    """A fork server that has imported dcp_worker (and torch): a job's ranks start in well under
    a second."""
    with ForkServer("dcp_worker") as server:
        yield server


def run_job(server: ForkServer, tmp: Path, world: int, steps: list[dict[str, Any]],
            ok: bool = True, **env: str) -> tuple[list[dict[str, Any] | None], list[int]]:
    """Runs dcp_worker's `steps` in one process group of `world` ranks: each rank's report
    (None for a rank that wrote none) and exit status. With `ok`, asserts every rank passed."""
    out = tmp / f"job-{len(list(tmp.glob('job-*')))}"
    steps = [{k: str(v) if isinstance(v, Path) else v for k, v in s.items()} for s in steps]
    done = server.run(out, world, [json.dumps({"out": str(out), "steps": steps})], TIMEOUT,
                      **env)
    reports = []
    for r in range(world):
        path = out / f"rank{r}.json"
        rep = json.loads(path.read_text()) if path.exists() else None
        if rep is not None:
            rep["output"] = (out / f"rank{r}.log").read_text(errors="replace")[-3000:]
        reports.append(rep)
        if ok:
            assert not done["timed_out"], f"the job ran past {TIMEOUT} s"
            assert rep is not None, f"rank {r} wrote no report ({done})"
            assert rep["ok"], f"rank {r}: {rep.get('error')}\n{rep['output']}"
    return reports, done["returncodes"]


@pytest.fixture(scope="module")
def saved_by_two(ranks: ForkServer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Version 1 of the mixed layout saved by 2 Gloo ranks with ours ("ours") and version 2
    with torch's writer ("stock"). Tests that change them work on copies."""
    tmp = tmp_path_factory.mktemp("saved_by_two")
    ckpts = {"ours": tmp / "ours2", "stock": tmp / "stock2"}
    run_job(ranks, tmp, 2, [{"do": "save", "with": "ours", "dir": ckpts["ours"], "v": 1},
                            {"do": "save", "with": "stock", "dir": ckpts["stock"], "v": 2}])
    return ckpts


def assert_reads_about_what_it_needs(reports: list[Any], step: int) -> None:
    """A resharded load read at most 1.1x the bytes of its targets, on every rank."""
    for r, rep in enumerate(reports):
        got = rep["steps"][step]
        assert 0 < got["bytes_read"] <= 1.1 * got["needed"], (r, step, got)


def load_whole(ckpt: Path, version: int, reader: Any = None,
               keys: list[str] | None = None) -> None:
    """Loads the checkpoint in this process, into whole tensors (no process group), with our
    Reader (or `reader`), and compares it with version `version` of the mixed layout (its
    `keys`)."""
    want = dcp_worker.full_state(version)
    if keys is not None:
        want = {k: want[k] for k in keys}
    got = {k: dcp_worker.zeroed(v) for k, v in want.items()}
    dcp.load(got, storage_reader=reader or tdcp.Reader(ckpt), no_dist=True)
    dcp_worker.compare(got, want)


def test_two_and_four_ranks_round_trips_and_resharding(
        tmp_path: Path, ranks: ForkServer, saved_by_two: dict[str, Path]) -> None:
    """DTensor Shard(0), Shard(1) and Replicate, plain tensors of every dtype, empty tensors
    and non-tensor values: saved by ours and by torch's writer, loaded by both, by 2 and 4 Gloo
    ranks, and resharded 2 -> 4, 4 -> 2 and Shard(0) -> Shard(1), where each rank reads at most
    1.1x the bytes of its targets."""
    ours2, stock2 = saved_by_two["ours"], saved_by_two["stock"]
    ours4, stock4, st2 = tmp_path / "ours4", tmp_path / "stock4", tmp_path / "safetensors2"
    big_s1 = {"only": ["big"], "big": "S1"}
    st = {"format": "safetensors", "only": SAFETENSORS_KEYS}
    two = [
        {"do": "load", "with": "ours", "dir": ours2, "v": 1},
        {"do": "load", "with": "stock", "dir": ours2, "v": 1},
        {"do": "load", "with": "ours", "dir": stock2, "v": 2},
        {"do": "load", "with": "ours", "dir": ours2, "v": 1, **big_s1},  # Shard(0) -> Shard(1)
        {"do": "save", "with": "stock", "dir": st2, "v": 5, **st},
        {"do": "load", "with": "ours", "dir": st2, "v": 5, **st},
    ]
    reports, _ = run_job(ranks, tmp_path, 2, two)
    assert_reads_about_what_it_needs(reports, 3)
    four = [
        {"do": "load", "with": "ours", "dir": ours2, "v": 1},  # 2 -> 4
        {"do": "load", "with": "ours", "dir": ours2, "v": 1, "only": ["big"]},
        {"do": "load", "with": "ours", "dir": ours2, "v": 1, **big_s1},
        {"do": "load", "with": "ours", "dir": stock2, "v": 2},
        {"do": "save", "with": "ours", "dir": ours4, "v": 3},
        {"do": "load", "with": "stock", "dir": ours4, "v": 3},
        {"do": "save", "with": "stock", "dir": stock4, "v": 4},
        {"do": "load", "with": "ours", "dir": stock4, "v": 4},
        {"do": "load", "with": "ours", "dir": st2, "v": 5, **st},
        {"do": "load", "with": "ours", "dir": st2, "v": 5, **big_s1},
    ]
    reports, _ = run_job(ranks, tmp_path, 4, four)
    assert_reads_about_what_it_needs(reports, 9)
    assert_reads_about_what_it_needs(reports, 1)
    assert_reads_about_what_it_needs(reports, 2)
    back = [
        {"do": "load", "with": "ours", "dir": ours4, "v": 3},  # 4 -> 2
        {"do": "load", "with": "ours", "dir": ours4, "v": 3, **big_s1},
        {"do": "load", "with": "ours", "dir": stock4, "v": 4},
        {"do": "load", "with": "ours", "dir": ours4, "v": 3, "verify": "full", **big_s1},
    ]
    reports, _ = run_job(ranks, tmp_path, 2, back)
    assert_reads_about_what_it_needs(reports, 1)
    for rep in reports:  # verify="full" reads each stored chunk whole
        assert rep["steps"][3]["bytes_read"] >= 2 * rep["steps"][3]["needed"], rep["steps"][3]
    for ckpt, v in ((ours2, 1), (stock2, 2), (ours4, 3), (stock4, 4)):  # one process: 2/4 -> 1
        load_whole(ckpt, v)
    load_whole(ours4, 3, dcp.FileSystemReader(ours4))


# What torch's writer stores with serialization_format=SAFETENSORS (safetensors has no complex
# dtypes and wants contiguous tensors).
SAFETENSORS_KEYS = ["s0", "s1", "s0_bf16", "repl", "big", "empty", "i32_scalar", "step", "extra"]


def test_twenty_thousand_small_tensors_per_rank(tmp_path: Path, ranks: ForkServer) -> None:
    ckpt = tmp_path / "small"
    run_job(ranks, tmp_path, 2, [{"do": "save", "with": "ours", "dir": ckpt, "v": 1,
                                  "layout": "small"},
                                 {"do": "load", "with": "ours", "dir": ckpt, "v": 1,
                                  "layout": "small"}])


def test_twenty_kills_leave_the_old_or_the_new_checkpoint_whole(tmp_path: Path,
                                                                ranks: ForkServer) -> None:
    """Saves over an existing checkpoint, each SIGKILLing rank 1 or the coordinator (rank 0) at
    a random moment of the save (the job's other rank dies with it, as under torchrun): after
    every kill the directory holds the last committed checkpoint or the new one, whole, by our
    reader and torch's; the next save removes what the dead ones left."""
    ckpt = tmp_path / "ckpt"
    reports, _ = run_job(ranks, tmp_path, 2, [{"do": "save", "with": "ours", "dir": ckpt,
                                               "v": 1, "only": KILL_KEYS}])
    seconds = max(rep["steps"][0]["seconds"] for rep in reports)
    rng = random.Random(int(os.environ.get("DCP_KILL_SEED", "37")))
    committed, kills = 1, 0
    for version in range(2, 22):
        after = rng.uniform(0, 1.2 * seconds)
        reports, codes = run_job(ranks, tmp_path, 2, [
            {"do": "save", "with": "ours", "dir": ckpt, "v": version, "only": KILL_KEYS,
             "kill": after, "victim": version % 2}], ok=False)
        kills += codes[version % 2] == -signal.SIGKILL
        found = _saved_step(ckpt)
        assert found in (committed, version), (found, committed, version, after)
        committed = found
        load_whole(ckpt, committed, keys=KILL_KEYS)
        if version % 5 == 0:
            load_whole(ckpt, committed, dcp.FileSystemReader(ckpt), keys=KILL_KEYS)
    assert kills == 20, kills
    run_job(ranks, tmp_path, 2, [{"do": "save", "with": "ours", "dir": ckpt, "v": 30,
                                  "only": KILL_KEYS}])
    names = sorted(p.name for p in ckpt.iterdir())
    assert len([n for n in names if n.endswith(".distcp")]) == 2, names
    assert set(names) - {n for n in names if n.endswith(".distcp")} == \
        {".metadata", ".tensortier-dcp.lock"}, names
    load_whole(ckpt, 30, keys=KILL_KEYS)


# A kill test's state dict: DTensors of each placement, 8 MiB in all, and non-tensor values.
KILL_KEYS = ["s0", "s1", "repl", "big", "f64_t", "step", "extra"]


def _saved_step(ckpt: Path) -> int:
    got = {"step": 0}
    dcp.load(got, storage_reader=tdcp.Reader(ckpt), no_dist=True)
    return int(got["step"])


def data_file_of(ckpt: Path, fqn: str, rank: int) -> tuple[Path, Any]:
    """The data file holding rank `rank`'s chunk of `fqn`, and its _StorageInfo."""
    md = tdcp.Reader(ckpt).read_metadata()
    info = next(v for k, v in md.storage_data.items()
                if k.fqn == fqn and v.relative_path.startswith(f"__{rank}_"))
    return ckpt / info.relative_path, info


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "stale", "chunk left out"])
@pytest.mark.parametrize("writer", ["ours", "stock"])
def test_damaged_two_rank_checkpoints_are_named(tmp_path: Path, saved_by_two: dict[str, Path],
                                                damage: str, writer: str) -> None:
    """A checkpoint of 2 ranks with a flipped byte or a cut in rank 1's file, rank 1's file
    deleted, a .metadata of another save, or a .metadata that leaves rank 1's chunk of a tensor
    out: the load raises naming the file (or the .metadata) and what is wrong."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved_by_two[writer], ckpt)
    version = 1 if writer == "ours" else 2
    path, info = data_file_of(ckpt, "big", 1)
    if damage == "flip":
        data = bytearray(path.read_bytes())
        data[info.offset + info.length // 2] ^= 0x10
        path.write_bytes(bytes(data))
        want = [str(path), "item 'big at [32, 0]'", "the file is damaged"]
    elif damage == "truncate":
        os.truncate(path, info.offset + info.length // 2)
        want = [str(path), "item 'big at [32, 0]'", "truncated"]
    elif damage == "delete":
        path.unlink()
        want = [str(ckpt / ".metadata"), f"data files that are missing: {path.name}", str(path)]
    elif damage == "stale":
        other = tmp_path / "other"
        dcp.save({"w": torch.ones(3)}, storage_writer=tdcp.Writer(other), no_dist=True)
        shutil.copy(other / ".metadata", ckpt / ".metadata")
        want = [str(ckpt / ".metadata"), "is stale: it names data files of another save",
                next(other.glob("*.distcp")).name]
    else:
        def leave_out(md: Any) -> None:
            md.state_dict_metadata["big"].chunks = md.state_dict_metadata["big"].chunks[:1]

        rewrite_metadata(ckpt, leave_out)
        want = [str(ckpt / ".metadata"), "the chunks of 'big' hold 1048576 of its 2097152"]
    with pytest.raises((CheckpointException, OSError, ValueError)) as e:
        load_whole(ckpt, version)
    assert all(w in str(e.value) for w in want), (want, str(e.value))


@pytest.mark.parametrize("small_fs", ["tmpfs"], indirect=True)
def test_full_disk_with_two_ranks_keeps_the_old_checkpoint(small_fs: Path, tmp_path: Path,
                                                           ranks: ForkServer) -> None:
    """Two ranks save 8 MiB over a small checkpoint on a 4 MiB tmpfs: the save fails on every
    rank, the error names the rank that ran out of space and its file; the old checkpoint
    loads whole and no temporary file is left."""
    ckpt = small_fs / "ckpt"
    small = ["s0", "s1", "step", "extra"]
    reports, _ = run_job(ranks, tmp_path, 2, [
        {"do": "save", "with": "ours", "dir": ckpt, "v": 1, "only": small},
        {"do": "save", "with": "ours", "dir": ckpt, "v": 2, "fail": True},
        {"do": "load", "with": "ours", "dir": ckpt, "v": 1, "only": small}])
    errors = [rep["steps"][1].get("error", "") for rep in reports]
    assert all(errors), errors
    assert any(re.search(rf"rank {r} saving its DCP data file.*{re.escape(str(ckpt))}/__{r}_",
                         e, re.S) and "No space left" in e for r in (0, 1) for e in errors), errors
    assert not [p for p in ckpt.iterdir() if ".tmp-" in p.name]


def single_process_checkpoint(tmp_path: Path, writer: str = "ours") -> tuple[Path, dict[str, Any]]:
    ckpt = tmp_path / "single"
    sd = {"w": torch.arange(5000, dtype=torch.float32), "b": torch.ones(3, dtype=torch.int16),
          "note": {"text": "hello"}}
    dcp.save(sd, storage_writer=tdcp.Writer(ckpt) if writer == "ours"
             else dcp.FileSystemWriter(ckpt))
    return ckpt, sd


def test_without_process_group(tmp_path: Path) -> None:
    ckpt, sd = single_process_checkpoint(tmp_path)
    got = {"w": torch.zeros(5000), "b": torch.zeros(3, dtype=torch.int16), "note": {"text": ""}}
    dcp.load(got, storage_reader=tdcp.Reader(ckpt))
    assert torch.equal(got["w"], sd["w"]) and torch.equal(got["b"], sd["b"])
    assert got["note"] == {"text": "hello"}
    # Each tensor's data lies on a 4 KiB boundary once it has 4 KiB or more.
    md = tdcp.Reader(ckpt).read_metadata()
    info = next(v for k, v in md.storage_data.items() if k.fqn == "w")
    assert isinstance(info.xxh64, int)
    reads = _core.DcpFileReads(default_io()._core(), str(ckpt / info.relative_path),
                                    ["w"], [info.offset], [info.length], [True], [None], ["w"],
                                    [[]], [None], [None], False)
    items = [layout for _, layout in reads.plan()]
    assert items[0][4] % 4096 == 0


def test_a_writer_used_again_writes_new_files(tmp_path: Path) -> None:
    """A second save through the same Writer (no new checkpoint_id) writes files of new names:
    the committed checkpoint's files stay untouched until the new metadata replaces it."""
    writer = tdcp.Writer(tmp_path / "ckpt")
    dcp.save({"w": torch.ones(10)}, storage_writer=writer)
    first = {p.name for p in (tmp_path / "ckpt").glob("*.distcp")}
    dcp.save({"w": torch.full((10,), 2.0)}, storage_writer=writer)
    second = {p.name for p in (tmp_path / "ckpt").glob("*.distcp")}
    assert len(first) == len(second) == 1 and not first & second
    got = {"w": torch.zeros(10)}
    dcp.load(got, storage_reader=tdcp.Reader(tmp_path / "ckpt"))
    assert torch.equal(got["w"], torch.full((10,), 2.0))


def test_file_system_writer_options_are_taken_and_overwrite_false_refuses(tmp_path: Path) -> None:
    """Code written for FileSystemWriter passes its options: taken; overwrite=False refuses a
    save over a checkpoint as stock does (and leaves it whole); checkpoint_id as stock's."""
    ckpt = tmp_path / "ckpt"
    options = dict(single_file_per_rank=True, sync_files=False, thread_count=8,
                   per_thread_copy_ahead=1 << 20, cache_staged_state_dict=True, overwrite=False)
    writer = tdcp.Writer(ckpt, **options)  # type: ignore[arg-type]
    # path and checkpoint_id are pathlib.Paths, as stock's: code joins them with "/".
    stock_writer, stock_reader = dcp.FileSystemWriter(ckpt), dcp.FileSystemReader(ckpt)
    reader = tdcp.Reader(str(ckpt))
    for ours, stock in ((writer, stock_writer), (reader, stock_reader)):
        assert type(ours.path) is type(stock.path) and ours.path == stock.path
        assert type(ours.checkpoint_id) is type(stock.checkpoint_id)
        assert ours.checkpoint_id == stock.checkpoint_id
    reader.path = tmp_path / "other"
    assert reader.checkpoint_id / "x" == tmp_path / "other" / "x"
    reader.reset(ckpt)
    dcp.save({"w": torch.ones(10)}, storage_writer=writer)
    for storage_writer in (tdcp.Writer(ckpt, overwrite=False),
                           dcp.FileSystemWriter(ckpt, overwrite=False)):
        with pytest.raises(CheckpointException, match="Checkpoint already exists"):
            dcp.save({"w": torch.zeros(10)}, storage_writer=storage_writer)
    got = {"w": torch.zeros(10)}
    dcp.load(got, storage_reader=tdcp.Reader(ckpt))
    assert torch.equal(got["w"], torch.ones(10))


def flip_in(ckpt: Path, fqn: str, at: str) -> tuple[str, int, int]:
    md = tdcp.Reader(ckpt).read_metadata()
    info = next(v for k, v in md.storage_data.items() if k.fqn == fqn)
    path = ckpt / info.relative_path
    data = bytearray(path.read_bytes())
    pos = {"end": info.offset + info.length - 100, "start": info.offset + 10,
           "middle": info.offset + info.length // 2}[at]
    data[pos] ^= 0x40
    path.write_bytes(bytes(data))
    return info.relative_path, info.offset, info.offset + info.length


@pytest.mark.parametrize("writer,at", [("ours", "end"), ("ours", "start"),
                                           ("stock", "middle")])
def test_flipped_byte_names_file_item_and_range(tmp_path: Path, writer: str, at: str) -> None:
    """A flipped byte in tensor data (or in a zip record) of ours, found by the item's xxh64,
    and in tensor data of torch's, found by its zip CRC-32."""
    ckpt, _ = single_process_checkpoint(tmp_path, writer)
    name, begin, end = flip_in(ckpt, "w", at)
    got = {"w": torch.zeros(5000), "b": torch.zeros(3, dtype=torch.int16), "note": {"text": ""}}
    with pytest.raises(CheckpointException) as e:  # DCP wraps each rank's error
        dcp.load(got, storage_reader=tdcp.Reader(ckpt))
    msg = str(e.value)
    assert "ValueError" in msg or "FormatError" in msg, msg  # FormatError: a ValueError
    assert name in msg and "'w'" in msg and f"[{begin}, {end})" in msg, msg
    # The error is kept (in e, as a retry loop or a log keeps it, with the frames of the load):
    # the rank file is closed all the same.
    opened = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            opened.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass  # the listing's own descriptor
    assert not [p for p in opened if p.startswith(str(ckpt))], opened


def test_a_damaged_value_of_a_stock_checkpoint_is_found_by_its_zip_crc(tmp_path: Path) -> None:
    """A non-tensor value (an lr scheduler's state, say) in a stock checkpoint is a torch.save
    zip: a changed byte of its pickle is found by the record's CRC-32, by the Reader (which
    loaded the changed value) and by tensortier verify (which said OK)."""
    ckpt, _ = single_process_checkpoint(tmp_path, "stock")
    md = tdcp.Reader(ckpt).read_metadata()
    info = next(v for k, v in md.storage_data.items() if k.fqn == "note.text")
    path = ckpt / info.relative_path
    data = bytearray(path.read_bytes())
    at = data.index(b"hello", info.offset, info.offset + info.length)
    data[at] = ord("j")
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointException) as e:
        dcp.load(zeros_like_single(), storage_reader=tdcp.Reader(ckpt))
    msg = str(e.value)
    assert f"item 'note.text' at bytes [{info.offset}, {info.offset + info.length})" in msg, msg
    assert "data.pkl' has the CRC-32" in msg, msg
    got = zeros_like_single()  # unchecked, it loads as stock's reader loads it
    dcp.load(got, storage_reader=tdcp.Reader(ckpt, verify=False))
    assert got["note"] == {"text": "jello"}
    if BIN.is_file():
        said = cli("verify", ckpt)
        assert said.returncode == 1 and "data.pkl' has the CRC-32" in said.stderr, said.stderr


def zeros_like_single() -> dict[str, Any]:
    return {"w": torch.zeros(5000), "b": torch.zeros(3, dtype=torch.int16), "note": {"text": ""}}


@pytest.mark.parametrize("cut", ["last item", "w"])
def test_truncated_file_names_file_and_item(tmp_path: Path, cut: str) -> None:
    """A data file cut 50 bytes short (inside its last item) or in the middle of 'w' (only 'w'
    loaded: the items after it are cut off too)."""
    ckpt, _ = single_process_checkpoint(tmp_path)
    md = tdcp.Reader(ckpt).read_metadata()
    info = next(v for k, v in md.storage_data.items() if k.fqn == "w")
    data_file = ckpt / info.relative_path
    os.truncate(data_file, data_file.stat().st_size - 50 if cut == "last item"
                else info.offset + info.length // 2)
    item = "'w'" if cut == "w" else "item '"
    with pytest.raises(CheckpointException,
                       match=f"(ValueError|FormatError): .*{data_file.name}.*{item}.*truncated"):
        dcp.load({"w": torch.zeros(5000)} if cut == "w" else zeros_like_single(),
                 storage_reader=tdcp.Reader(ckpt))


def test_missing_data_file_names_file_and_item(tmp_path: Path) -> None:
    """A data file deleted before the load: FileNotFoundError naming the .metadata and the file;
    deleted between the metadata and the data: naming the file and its first item."""
    ckpt, _ = single_process_checkpoint(tmp_path)
    data_file = next(p for p in ckpt.iterdir() if p.name.endswith(".distcp"))
    md = tdcp.Reader(ckpt).read_metadata()
    data_file.unlink()
    with pytest.raises(CheckpointException) as e:
        dcp.load(zeros_like_single(), storage_reader=tdcp.Reader(ckpt))
    msg = str(e.value)
    assert "[Errno 2]" in msg and f"data files that are missing: {data_file.name}" in msg, msg
    assert str(ckpt / ".metadata") in msg and str(data_file) in msg, msg
    if BIN.is_file():  # the CLI: info lists the checkpoint, then names what is missing
        said = cli("info", ckpt)
        assert said.returncode == 1 and data_file.name in said.stdout, said.stdout
        assert f"data files that are missing: {data_file.name}" in said.stderr, said.stderr
        said = cli("verify", ckpt)
        assert said.returncode == 1 and str(data_file) in said.stderr, said.stderr

    class Late(tdcp.Reader):  # the file goes after the metadata was read
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return md

    with pytest.raises(CheckpointException) as e:
        dcp.load(zeros_like_single(), storage_reader=Late(ckpt))
    msg = str(e.value)
    assert "FileNotFoundError" in msg and str(data_file) in msg, msg
    assert re.search(r"for item '(w|b|note)'", msg), msg


def test_a_save_that_replaces_the_checkpoint_during_a_load_is_named(tmp_path: Path) -> None:
    """The load read .metadata, then a save committed into the directory and removed the files
    the old .metadata named: the error says so, rather than that a file is missing."""
    ckpt, _ = single_process_checkpoint(tmp_path)

    class Raced(tdcp.Reader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            md = super().read_metadata(*args, **kwargs)
            dcp.save({"w": torch.ones(5000), "b": torch.ones(3, dtype=torch.int16),
                      "note": {"text": "new"}}, storage_writer=tdcp.Writer(ckpt))
            return md

    with pytest.raises(CheckpointException) as e:
        dcp.load(zeros_like_single(), storage_reader=Raced(ckpt))
    msg = str(e.value)
    assert "FileNotFoundError" in msg and f"a save replaced the checkpoint in {ckpt}" in msg, msg
    got = zeros_like_single()  # the new checkpoint is whole
    dcp.load(got, storage_reader=tdcp.Reader(ckpt))
    assert torch.equal(got["w"], torch.ones(5000)) and got["note"] == {"text": "new"}


def test_ranks_that_read_different_metadata_do_not_mix_two_checkpoints(
    ranks: ForkServer, tmp_path: Path
) -> None:
    """Rank 0 reads .metadata, a save commits into the directory, then rank 1 reads the new
    .metadata of the same tensors (a training loop's next save): the load fails on every rank,
    naming the race, before reading anything."""
    ckpt = tmp_path / "raced"
    plain = ["i32_scalar", "f64_t", "step", "extra"]  # values every rank holds whole
    run_job(ranks, tmp_path, 2, [{"do": "save", "with": "ours", "dir": ckpt, "v": 1,
                                  "only": plain}])
    reports, _ = run_job(ranks, tmp_path, 2, [{"do": "load", "with": "ours", "dir": ckpt,
                                              "v": 1, "only": plain, "race": True,
                                              "fail": True}])
    for rep in reports:
        err = rep["steps"][0].get("error", "")
        assert "ranks 1 read another .metadata than rank 0" in err, err
        assert "a save replaced the checkpoint in this directory" in err, err


def test_rank_local_metadata_of_several_ranks_loads(ranks: ForkServer, tmp_path: Path) -> None:
    """torch's FileSystemWriter saving without collectives writes one __N.metadata per rank
    and no .metadata: each rank loads through its own, as with torch's reader (the ranks'
    metadata differ by design, which is no save racing the load)."""
    ckpt = tmp_path / "rank-local"
    run_job(ranks, tmp_path, 2, [
        {"do": "save", "with": "stock", "dir": ckpt, "v": 1, "layout": "small", "count": 3,
         "collectives": False},
        {"do": "load", "with": "ours", "dir": ckpt, "v": 1, "layout": "small", "count": 3}])
    assert not (ckpt / ".metadata").exists()
    assert {p.name for p in ckpt.glob("__*.metadata")} == {"__0.metadata", "__1.metadata"}


def test_a_planners_storage_data_is_left_as_it_is(tmp_path: Path) -> None:
    """LoadPlan.storage_data a planner sets goes through the Reader unchanged (as through
    torch's reader); the Reader's own digest of .metadata goes only where it is unset."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    ckpt, _ = single_process_checkpoint(tmp_path)
    seen: list[Any] = []

    class Tagging(DefaultLoadPlanner):
        def create_local_plan(self) -> Any:
            return dataclasses.replace(super().create_local_plan(), storage_data={"hint": 7})

        def finish_plan(self, new_plan: Any) -> Any:
            seen.append(new_plan.storage_data)
            return super().finish_plan(new_plan)

    dcp.load(zeros_like_single(), storage_reader=tdcp.Reader(ckpt), planner=Tagging())
    assert seen == [{"hint": 7}]

    class Plain(DefaultLoadPlanner):
        def finish_plan(self, new_plan: Any) -> Any:
            seen.append(new_plan.storage_data)
            return super().finish_plan(new_plan)

    dcp.load(zeros_like_single(), storage_reader=tdcp.Reader(ckpt), planner=Plain())
    assert seen[1:] == [None]


def test_a_save_committing_while_the_metadata_is_read_is_read_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save commits between the Reader's read of .metadata and its check of the files named
    there: nothing is planned yet, so it reads the new .metadata, and loads the new checkpoint."""
    ckpt, _ = single_process_checkpoint(tmp_path)
    real = _core.check_dcp_metadata
    calls = [0]

    def commit_first(*args: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:  # the save lands just after the first read
            dcp.save({"w": torch.ones(5000), "b": torch.ones(3, dtype=torch.int16),
                      "note": {"text": "new"}}, storage_writer=tdcp.Writer(ckpt), no_dist=True)
        return real(*args)

    monkeypatch.setattr(_core, "check_dcp_metadata", commit_first)
    got = zeros_like_single()
    dcp.load(got, storage_reader=tdcp.Reader(ckpt), no_dist=True)
    assert calls[0] == 2 and got["note"] == {"text": "new"}
    assert torch.equal(got["w"], torch.ones(5000))


def test_the_cli_notes_data_files_the_metadata_does_not_name(tmp_path: Path) -> None:
    """A __*.distcp file the .metadata does not name (a save that died before committing, a
    file copied in) is never read by a load: info and verify say so, and still pass."""
    ckpt, _ = single_process_checkpoint(tmp_path)
    shutil.copy(next(ckpt.glob("*.distcp")), ckpt / "__1_stray.distcp")
    for command in ("info", "verify"):
        said = cli(command, ckpt)
        assert said.returncode == 0, said.stderr
        assert "1 data file its .metadata does not name (first: __1_stray.distcp)" in said.stderr


def test_newer_format_is_refused_naming_its_version(tmp_path: Path) -> None:
    """Writer stores its format version in the metadata's StorageMeta; a Reader refuses a newer
    one before reading any item, naming the file, the version found and the one it reads."""
    ckpt, _ = single_process_checkpoint(tmp_path)
    path = ckpt / ".metadata"
    md = pickle.loads(path.read_bytes())  # our own test file: trusted
    assert md.storage_meta.tensortier_format == tdcp._common._FORMAT == 1
    md.storage_meta.tensortier_format = 7
    path.write_bytes(pickle.dumps(md))
    want = f"{path}: written in tensortier's DCP format 7; this tensortier reads format 1"
    with pytest.raises(ValueError) as e:
        tdcp.Reader(ckpt).read_metadata()
    assert want in str(e.value), e.value
    with pytest.raises(CheckpointException) as e:  # DCP reports the reader's error in its own
        dcp.load(zeros_like_single(), storage_reader=tdcp.Reader(ckpt))
    assert want in str(e.value), e.value
    if BIN.is_file():  # the CLI reads the same rule
        info = cli("info", ckpt)
        assert info.returncode != 0 and "DCP format 7" in info.stderr, info.stderr
    md.storage_meta.tensortier_format = "1"
    path.write_bytes(pickle.dumps(md))
    with pytest.raises(ValueError, match="tensortier_format is a str, not a format version"):
        tdcp.Reader(ckpt).read_metadata()


@pytest.mark.parametrize("case", ["missing", "empty", "unfinished", "a file", "json", "torch.save",
                                  "metadata dir"])
def test_missing_or_foreign_directory_is_named(tmp_path: Path, case: str) -> None:
    """A path that holds no DCP checkpoint: the error names the path and what is wrong."""
    d = tmp_path / "ckpt"
    if case == "a file":
        d.write_bytes(b"x")
    elif case != "missing":
        d.mkdir()
    if case == "unfinished":
        (d / "__0_abc.distcp").write_bytes(b"x")
    if case == "json":
        (d / ".metadata").write_text('{"step": 3}')
    if case == "metadata dir":
        (d / ".metadata").mkdir()
    if case == "torch.save":
        buf = io.BytesIO()
        torch.save({"w": torch.ones(2)}, buf)
        (d / ".metadata").write_bytes(buf.getvalue())
    error, what, where = {
        "missing": (FileNotFoundError, "the directory cannot be reached", d),
        "empty": (FileNotFoundError, "no .metadata: not a DCP checkpoint directory",
                  d / ".metadata"),
        "unfinished": (FileNotFoundError, "a save that did not finish", d / ".metadata"),
        "a file": (NotADirectoryError, "a DCP checkpoint is a directory", d),
        "json": (ValueError, "not a DCP metadata file", d / ".metadata"),
        "torch.save": (ValueError, "not a DCP metadata file", d / ".metadata"),
        "metadata dir": (IsADirectoryError, ".metadata is a directory", d / ".metadata"),
    }[case]
    with pytest.raises(error) as e:
        tdcp.Reader(d).read_metadata()
    assert what in str(e.value) and str(where) in str(e.value), e.value
    with pytest.raises(CheckpointException) as e:
        dcp.load(zeros_like_single(), storage_reader=tdcp.Reader(d))
    assert what in str(e.value) and str(where) in str(e.value), e.value


@pytest.mark.parametrize("small_fs", ["tmpfs", "ext2"], indirect=True)
def test_full_disk_keeps_the_old_checkpoint(small_fs: Path) -> None:
    """A save over a checkpoint on a 4 MiB filesystem runs out of space (tmpfs: at the file's
    reservation; ext2, which cannot reserve: in the middle of its writes). The error is OSError
    ENOSPC naming the rank and the file; the old checkpoint stays loadable, no temporary file is
    left, and a save that fits goes through afterwards."""
    ckpt = small_fs / "ckpt"
    old = {"w": torch.arange(1000, dtype=torch.float32), "step": 1}
    dcp.save(old, storage_writer=tdcp.Writer(ckpt))
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    with pytest.raises(CheckpointException) as e:
        dcp.save({"w": torch.ones(3 << 20), "step": 2}, storage_writer=tdcp.Writer(ckpt))
    error = e.value.failures[0][0]
    assert isinstance(error, OSError) and error.errno == errno.ENOSPC, repr(error)
    assert "rank 0 saving its DCP data file" in str(error) and str(ckpt) in str(error), error
    assert ".tmp-" not in str(error.filename), error.filename
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
    for reader in (tdcp.Reader(ckpt), dcp.FileSystemReader(ckpt)):
        got = {"w": torch.zeros(1000), "step": 0}
        dcp.load(got, storage_reader=reader)
        assert torch.equal(got["w"], old["w"]) and got["step"] == 1
    dcp.save({"w": torch.ones(1000), "step": 3}, storage_writer=tdcp.Writer(ckpt))
    got = {"w": torch.zeros(1000), "step": 0}
    dcp.load(got, storage_reader=tdcp.Reader(ckpt))
    assert torch.equal(got["w"], torch.ones(1000)) and got["step"] == 3
    assert not [p for p in ckpt.iterdir() if ".tmp-" in p.name]


@pytest.mark.parametrize("small_fs", ["tmpfs"], indirect=True)
def test_full_disk_at_the_commit_keeps_the_old_checkpoint(small_fs: Path) -> None:
    """The rank's data file takes the filesystem's last free blocks, so the coordinator's
    .metadata does not fit: OSError ENOSPC naming the coordinator and .metadata; the old
    checkpoint stays loadable and the new save's data file is removed with its temporaries."""
    ckpt = small_fs / "ckpt"
    old = {"w": torch.arange(1000, dtype=torch.float32), "step": 1}
    dcp.save(old, storage_writer=tdcp.Writer(ckpt))
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    new = {"w": torch.ones(200_000), "step": 2}
    probe = small_fs / "probe"  # the same save elsewhere: how many blocks its data file takes
    dcp.save(new, storage_writer=tdcp.Writer(probe))
    data_bytes = sum(p.stat().st_blocks * 512 for p in probe.glob("*.distcp"))
    shutil.rmtree(probe)
    fs = os.statvfs(small_fs)
    with open(small_fs / "filler", "wb") as f:
        f.write(b"\0" * (fs.f_bavail * fs.f_frsize - data_bytes))
    with pytest.raises(CheckpointException) as e:
        dcp.save(new, storage_writer=tdcp.Writer(ckpt))
    error = e.value.failures[0][0]
    assert isinstance(error, OSError) and error.errno == errno.ENOSPC, repr(error)
    assert "rank 0 (the coordinator) committing the checkpoint" in str(error), error
    assert error.filename == str(ckpt / ".metadata"), error.filename
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
    got = {"w": torch.zeros(1000), "step": 0}
    dcp.load(got, storage_reader=tdcp.Reader(ckpt))
    assert torch.equal(got["w"], old["w"]) and got["step"] == 1


def test_unsafe_pickle_in_bytes_item_is_refused(tmp_path: Path) -> None:
    ckpt = tmp_path / "unsafe"
    dcp.save({"obj": {"cls": signal.Signals.SIGINT}}, storage_writer=tdcp.Writer(ckpt))
    with pytest.raises(CheckpointException, match="ValueError: .*weights_only"):
        dcp.load({"obj": {"cls": None}}, storage_reader=tdcp.Reader(ckpt))



@pytest.mark.parametrize("writer", ["ours", "stock"])
def test_bytesio_values_load_as_torch_s_reader_loads_them(tmp_path: Path, writer: str) -> None:
    """io.BytesIO values (torchtitan's TrainState saves its loss logs as such) load as with
    FileSystemReader: a BytesIO holding the bytes saved. Other classes stay refused."""
    logs = io.BytesIO()
    torch.save([1.0, 2.0], logs)
    ckpt = tmp_path / writer
    dcp.save({"step": torch.tensor(5), "log_steps": logs}, no_dist=True,
             storage_writer=tdcp.Writer(ckpt) if writer == "ours" else dcp.FileSystemWriter(ckpt))
    got = {"step": torch.tensor(0), "log_steps": io.BytesIO()}
    dcp.load(got, storage_reader=tdcp.Reader(ckpt), no_dist=True)
    assert int(got["step"]) == 5 and isinstance(got["log_steps"], io.BytesIO)
    got["log_steps"].seek(0)
    assert torch.load(got["log_steps"], weights_only=True) == [1.0, 2.0]
    assert io.BytesIO not in torch.serialization.get_safe_globals()  # allowed for the check only


@pytest.mark.parametrize("writer", ["ours", "stock"])
def test_empty_bytes_values_load_as_torch_s_reader_loads_them(tmp_path: Path, writer: str) -> None:
    """An empty bytes value pickles as a call of bytes(), and an empty BytesIO holds one:
    FileSystemReader loads both, so does Reader."""
    ckpt = tmp_path / writer
    dcp.save({"b": b"", "buf": io.BytesIO(), "full": b"xy"}, no_dist=True,
             storage_writer=tdcp.Writer(ckpt) if writer == "ours" else dcp.FileSystemWriter(ckpt))
    got: dict[str, Any] = {"b": None, "buf": None, "full": None}
    dcp.load(got, storage_reader=tdcp.Reader(ckpt), no_dist=True)
    assert got["b"] == b"" and got["full"] == b"xy" and got["buf"].getvalue() == b""
    assert bytes not in torch.serialization.get_safe_globals()  # allowed for the check only


def test_readers_on_several_threads_leave_torch_s_allowed_globals_as_they_were(
        tmp_path: Path) -> None:
    """torch's allowed globals are one set for the process: readers checking values on several
    threads at once neither refuse a value another one's check allowed for a moment, nor leave
    io.BytesIO allowed afterwards."""
    ckpt = tmp_path / "values"
    dcp.save({f"v{i}": io.BytesIO(b"%d" % i) for i in range(20)}, no_dist=True,
             storage_writer=tdcp.Writer(ckpt))
    failures: list[BaseException] = []

    def load() -> None:
        try:
            for _ in range(10):
                got: dict[str, Any] = {f"v{i}": None for i in range(20)}
                dcp.load(got, storage_reader=tdcp.Reader(ckpt), no_dist=True)
                assert [got[f"v{i}"].getvalue() for i in range(20)] == \
                    [b"%d" % i for i in range(20)]
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            failures.append(e)

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert failures == [] and not any(t.is_alive() for t in threads)
    assert io.BytesIO not in torch.serialization.get_safe_globals()


def test_a_planner_with_its_own_load_bytes_gets_its_raw_bytes(tmp_path: Path) -> None:
    """DCP's contract: a bytes item holds what the SavePlanner made of it, here JSON, which the
    LoadPlanner's own load_bytes reads; only bytes headed for torch.load are checked."""
    from torch.distributed.checkpoint.default_planner import (DefaultLoadPlanner,
                                                              DefaultSavePlanner)
    from torch.distributed.checkpoint.planner import WriteItemType

    class JsonSavePlanner(DefaultSavePlanner):
        def resolve_data(self, write_item):  # type: ignore[no-untyped-def]
            if write_item.type == WriteItemType.BYTE_IO:
                return io.BytesIO(json.dumps(self.lookup_object(write_item.index)).encode())
            return super().resolve_data(write_item)

    class JsonLoadPlanner(DefaultLoadPlanner):
        loaded: dict[str, Any] = {}

        def load_bytes(self, read_item, value):  # type: ignore[no-untyped-def]
            self.loaded[read_item.dest_index.fqn] = json.loads(value.read())

    ckpt = tmp_path / "json"
    dcp.save({"cfg": "lr=0.1", "w": torch.arange(4.0)}, storage_writer=tdcp.Writer(ckpt),
             planner=JsonSavePlanner(), no_dist=True)
    got = {"cfg": "", "w": torch.zeros(4)}
    dcp.load(got, storage_reader=tdcp.Reader(ckpt), planner=JsonLoadPlanner(), no_dist=True)
    assert JsonLoadPlanner.loaded == {"cfg": "lr=0.1"} and torch.equal(got["w"], torch.arange(4.0))
    # The default planner would unpickle them: there, they are checked (and are no pickle).
    with pytest.raises(CheckpointException, match="weights_only"):
        dcp.load({"cfg": "", "w": torch.zeros(4)}, storage_reader=tdcp.Reader(ckpt), no_dist=True)


def test_rank_local_metadata_of_a_save_without_collectives_loads(tmp_path: Path) -> None:
    """FileSystemWriter with use_collectives=False writes __N.metadata for each rank, no
    .metadata; dcp.load falls back to them, with Reader too. Writer refuses such saves."""
    ckpt = tmp_path / "local"
    dcp.save({"w": torch.arange(3.0)}, storage_writer=dcp.FileSystemWriter(ckpt),
             use_collectives=False)
    assert (ckpt / "__0.metadata").is_file() and not (ckpt / ".metadata").exists()
    got = {"w": torch.zeros(3)}
    dcp.load(got, storage_reader=tdcp.Reader(ckpt))
    assert torch.equal(got["w"], torch.arange(3.0))
    with pytest.raises(FileNotFoundError, match="rank-local metadata .*use_collectives=False"):
        tdcp.Reader(ckpt).read_metadata()
    with pytest.raises(FileNotFoundError, match="no rank-local metadata __1.metadata"):
        tdcp.Reader(ckpt).read_metadata(rank=1)
    with pytest.raises((ValueError, CheckpointException), match="use_collectives=True"):
        dcp.save({"w": torch.arange(3.0)}, storage_writer=tdcp.Writer(tmp_path / "ours"),
                 use_collectives=False)


def test_stock_metadata_pickled_by_python_3_13_reads(tmp_path: Path) -> None:
    """Python 3.13 pickles FileSystemWriter's checkpoint id (a pathlib.PosixPath) as
    pathlib._local.PosixPath; Reader and the CLI read such metadata on every Python."""
    import pathlib
    import types

    ckpt = tmp_path / "stock"
    dcp.save({"w": torch.arange(3.0)}, storage_writer=dcp.FileSystemWriter(ckpt), no_dist=True)
    local = types.ModuleType("pathlib._local")

    class PosixPath(pathlib.PurePosixPath):
        pass

    PosixPath.__module__, PosixPath.__qualname__ = local.__name__, "PosixPath"
    local.PosixPath = PosixPath  # type: ignore[attr-defined]
    sys.modules[local.__name__] = local
    try:
        def as_313(md: Any) -> None:
            md.storage_meta.checkpoint_id = PosixPath(str(ckpt))
        rewrite_metadata(ckpt, as_313)
    finally:
        del sys.modules[local.__name__]
    assert b"pathlib._local" in (ckpt / ".metadata").read_bytes()
    got = {"w": torch.zeros(3)}
    dcp.load(got, storage_reader=tdcp.Reader(ckpt), no_dist=True)
    assert torch.equal(got["w"], torch.arange(3.0))
    ok = cli("verify", ckpt)
    assert ok.returncode == 0, ok.stderr


def test_a_planner_s_bytes_like_data_and_a_directory_name_that_is_not_utf8(tmp_path: Path) -> None:
    """A custom planner may return any bytes-like object for a bytes item (DCP's writer takes
    bytes() of it); a checkpoint directory's name is bytes to the file system, not UTF-8."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class BytearrayPlanner(DefaultSavePlanner):
        def resolve_data(self, write_item):  # type: ignore[no-untyped-def]
            data = super().resolve_data(write_item)
            return bytearray(data.getvalue()) if isinstance(data, io.BytesIO) else data

    ckpt = tmp_path / "caf\udce9"
    sd = {"s": "hello", "t": torch.arange(3.0)}
    dcp.save(sd, storage_writer=tdcp.Writer(ckpt), planner=BytearrayPlanner(), no_dist=True)
    got = {"s": "", "t": torch.zeros(3)}
    dcp.load(got, storage_reader=tdcp.Reader(ckpt), no_dist=True)
    assert got["s"] == "hello" and torch.equal(got["t"], sd["t"])

BIN = Path(os.environ.get("TENSORTIER_CLI", Path(sys.executable).parent / "tensortier"))


def cli(*args: object) -> subprocess.CompletedProcess[str]:
    if not BIN.is_file():
        pytest.skip(f"no tensortier binary at {BIN}")
    return subprocess.run([str(BIN), *map(str, args)], capture_output=True, text=True,
                          errors="replace", timeout=60)


def test_cli_reads_the_rank_local_metadata_of_a_save_without_collectives(tmp_path: Path) -> None:
    """A save with use_collectives=False leaves no .metadata, only each rank's __N.metadata
    (which dcp.load reads rank by rank): info lists and verify checks their items together."""
    ckpt = tmp_path / "local"
    dcp.save({"w": torch.arange(100.0), "note": {"text": "hi"}},
             storage_writer=dcp.FileSystemWriter(ckpt), no_dist=True, use_collectives=False)
    assert not (ckpt / ".metadata").exists() and (ckpt / "__0.metadata").exists()
    info = cli("info", ckpt)
    assert info.returncode == 0, info.stderr
    assert "1 rank-local file" in info.stdout and "items:     2" in info.stdout, info.stdout
    ok = cli("verify", ckpt)
    assert ok.returncode == 0, ok.stderr
    assert "DCP checkpoint OK (2 items checked" in ok.stdout, ok.stdout


@pytest.mark.parametrize("writer", ["ours", "stock"])
def test_cli_info_and_verify_read_dcp_directories(tmp_path: Path, writer: str) -> None:
    ckpt = tmp_path / writer
    sd = {"w": torch.arange(5000, dtype=torch.float32), "note": {"text": "hello"}}
    make = tdcp.Writer(ckpt) if writer == "ours" else dcp.FileSystemWriter(ckpt)
    dcp.save(sd, storage_writer=make)
    info = cli("info", ckpt)
    assert info.returncode == 0, info.stderr
    assert "torch.distributed.checkpoint" in info.stdout and "w " in info.stdout
    ok = cli("verify", ckpt)
    assert ok.returncode == 0, ok.stderr
    # Stock's non-tensor value too, by its zip records' CRC-32s.
    assert "DCP checkpoint OK (2 items checked, 0 without a checksum)" in ok.stdout, ok.stdout
    name, begin, end = flip_in(ckpt, "w", "end")
    bad = cli("verify", ckpt)
    assert bad.returncode == 1
    assert name in bad.stderr and "'w'" in bad.stderr and "FAILED" in bad.stderr, bad.stderr


def test_cli_verify_holds_one_data_file_open_at_a_time(tmp_path: Path) -> None:
    """A checkpoint of more data files than the descriptor limit lets one hold open (a job of
    many ranks; here stock's file per item) is verified whole under that limit."""
    import resource

    if not BIN.is_file():
        pytest.skip(f"no tensortier binary at {BIN}")
    ckpt = tmp_path / "many"
    sd = {f"t{i}": torch.full((8,), float(i)) for i in range(96)}
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(ckpt, single_file_per_rank=False),
             no_dist=True)
    assert len(list(ckpt.glob("*.distcp"))) == 96

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))

    ok = subprocess.run([str(BIN), "verify", str(ckpt)], capture_output=True, text=True,
                        errors="replace", timeout=60, preexec_fn=limit)
    assert ok.returncode == 0, ok.stderr
    assert "DCP checkpoint OK (96 items checked" in ok.stdout, ok.stdout


def test_cli_given_a_file_of_a_dcp_directory_names_the_directory(tmp_path: Path) -> None:
    ckpt, _ = single_process_checkpoint(tmp_path)
    for file in (ckpt / ".metadata", next(ckpt.glob("*.distcp"))):
        for command in ("info", "verify"):
            said = cli(command, file)
            assert said.returncode == 1, said
            assert f"a file of the DCP checkpoint {ckpt}" in said.stderr, said.stderr
            assert f"tensortier {command} {ckpt}" in said.stderr, said.stderr


def test_async_save_with_a_one_rank_group(tmp_path: Path) -> None:
    """dcp.async_save with Writer (DCP's default staging): the values at the call are saved,
    whatever the training step changes afterwards."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        sd = {"w": torch.arange(10.0), "step": 3}
        fut = dcp.async_save(sd, storage_writer=tdcp.Writer(tmp_path / "ckpt"))
        sd["w"].add_(1)
        fut.result(timeout=60)
        got = {"w": torch.zeros(10), "step": 0}
        dcp.load(got, storage_reader=tdcp.Reader(tmp_path / "ckpt"))
        assert torch.equal(got["w"], torch.arange(10.0)) and got["step"] == 3
    finally:
        dist.destroy_process_group()


def test_async_staging_with_a_checkpoint_process(tmp_path: Path) -> None:
    """Writer(async_staging=True) with async_save's checkpoint process (AsyncCheckpointerType.
    PROCESS), which pickles the writer after staging: two saves in a row commit."""
    import pickle

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    writer = tdcp.Writer(tmp_path / "a", async_staging=True)
    writer.stage({"w": torch.ones(3)}).result(timeout=60)
    assert pickle.loads(pickle.dumps(writer)).path == writer.path
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        for step in (1, 2):
            sd = {"w": torch.full((10,), float(step)), "step": step}
            response = dcp.async_save(
                sd, storage_writer=tdcp.Writer(tmp_path / f"ckpt{step}", async_staging=True),
                async_checkpointer_type=AsyncCheckpointerType.PROCESS)
            response.staging_completion.result(timeout=60)
            sd["w"].add_(1)
            response.upload_completion.result(timeout=120)
            got = {"w": torch.zeros(10), "step": 0}
            dcp.load(got, storage_reader=tdcp.Reader(tmp_path / f"ckpt{step}"))
            assert torch.equal(got["w"], torch.full((10,), float(step))) and got["step"] == step
    finally:
        dist.destroy_process_group()


class _SaveBetween(tdcp.Writer):
    """A Writer that runs another whole save into its directory after writing its data file and
    before its commit: the order in which overlapping saves remove each other's files."""

    def __init__(self, path: Path, other: dict[str, Any]) -> None:
        super().__init__(path)
        self.other = other

    def write_data(self, plan: Any, planner: Any) -> Any:
        fut = super().write_data(plan, planner)
        dcp.save(self.other, storage_writer=tdcp.Writer(self.path), no_dist=True)
        return fut


def test_overlapping_saves_keep_the_committed_checkpoint(tmp_path: Path) -> None:
    """Save B writes its file, save A commits (removing B's file), B commits: B raises naming
    its file, A's checkpoint loads whole."""
    ckpt = tmp_path / "ckpt"
    a = {"w": torch.full((100,), 1.0)}
    with pytest.raises((CheckpointException, OSError), match="another save"):
        dcp.save({"w": torch.full((100,), 2.0)}, storage_writer=_SaveBetween(ckpt, a),
                 no_dist=True)
    got = {"w": torch.zeros(100)}
    dcp.load(got, storage_reader=tdcp.Reader(ckpt))
    assert torch.equal(got["w"], a["w"])
    assert len(list(ckpt.glob("*.distcp"))) == 1


def test_async_saves_in_flight_leave_a_loadable_checkpoint(tmp_path: Path) -> None:
    """Four dcp.async_save futures into one directory: each succeeds or raises, and the
    directory ends with a checkpoint equal to one of the saves."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        saves = [{"w": torch.full((1000,), float(i))} for i in range(4)]
        futs = [dcp.async_save(sd, storage_writer=tdcp.Writer(tmp_path / "ckpt"))
                for sd in saves]
        ok = 0
        for f in futs:
            try:
                f.result(timeout=60)
                ok += 1
            except (CheckpointException, OSError) as e:
                assert "another save" in str(e), e
        assert ok >= 1
        got = {"w": torch.full((1000,), -1.0)}
        dcp.load(got, storage_reader=tdcp.Reader(tmp_path / "ckpt"))
        assert any(torch.equal(got["w"], sd["w"]) for sd in saves)
    finally:
        dist.destroy_process_group()


def rewrite_metadata(ckpt: Path, change: Any) -> None:
    md = pickle.loads((ckpt / ".metadata").read_bytes())
    change(md)
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))


def test_chunk_sizes_that_do_not_match_the_data_file_are_refused(tmp_path: Path) -> None:
    """A .metadata giving an item more rows than its data file holds: ValueError naming the
    file, the item and both shapes (no read past the stored tensor)."""
    ckpt = tmp_path / "ckpt"
    dcp.save({"w": torch.arange(64 * 48.0).reshape(64, 48)}, storage_writer=tdcp.Writer(ckpt),
             no_dist=True)

    def grow(md: Any) -> None:
        md.state_dict_metadata["w"].size = torch.Size([66, 48])
        md.state_dict_metadata["w"].chunks[0].sizes = torch.Size([66, 48])

    rewrite_metadata(ckpt, grow)
    name = next(ckpt.glob("*.distcp")).name
    with pytest.raises(CheckpointException) as e:
        dcp.load({"w": torch.full((66, 48), -1.0)}, storage_reader=tdcp.Reader(ckpt),
                 no_dist=True)
    msg = str(e.value)
    assert name in msg and "'w'" in msg and "[66, 48]" in msg and "[64, 48]" in msg, msg
    if BIN.is_file():  # the CLI's verify applies the same rule
        bad = cli("verify", ckpt)
        assert bad.returncode == 1 and "'w'" in bad.stderr, bad.stderr
        assert "[66, 48]" in bad.stderr and "[64, 48]" in bad.stderr, bad.stderr


@pytest.mark.parametrize("relative", ["../other/__0_x.distcp", "sub/__0_x.distcp", ".hidden",
                                      "/abs/__0_x.distcp", ""])
def test_data_file_outside_the_directory_is_refused(tmp_path: Path, relative: str) -> None:
    """A .metadata naming a data file outside its directory: ValueError naming the .metadata
    and the path, from the rule `tensortier verify` applies."""
    ckpt = tmp_path / "ckpt"
    dcp.save({"w": torch.ones(10)}, storage_writer=tdcp.Writer(ckpt), no_dist=True)
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(next(ckpt.glob("*.distcp")), other / "__0_x.distcp")

    def move(md: Any) -> None:
        for info in md.storage_data.values():
            info.relative_path = relative

    rewrite_metadata(ckpt, move)
    with pytest.raises(ValueError, match="outside the checkpoint directory") as e:
        tdcp.Reader(ckpt).read_metadata()
    assert str(ckpt / ".metadata") in str(e.value) and f"'{relative}'" in str(e.value)
    with pytest.raises(CheckpointException):
        dcp.load({"w": torch.zeros(10)}, storage_reader=tdcp.Reader(ckpt), no_dist=True)


@pytest.mark.parametrize("case", ["unfinished", "metadata dir"])
def test_cli_names_a_dcp_directory_without_usable_metadata(tmp_path: Path, case: str) -> None:
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "__0_abc.distcp").write_bytes(b"x")
    if case == "metadata dir":
        (d / ".metadata").mkdir()
    what = {"unfinished": "a DCP checkpoint directory whose .metadata is missing",
            "metadata dir": ".metadata is a directory"}[case]
    for command in ("info", "verify"):
        r = cli(command, d)
        assert r.returncode != 0 and what in r.stderr and str(d / ".metadata") in r.stderr, \
            r.stderr


def test_conjugate_and_negative_views_of_torch_files_load_resolved(tmp_path: Path) -> None:
    """torch's writer stores a conjugate (or negative) view with its bit set: Reader loads the
    values torch's reader gives, the bit resolved."""
    ckpt = tmp_path / "ckpt"
    c = torch.randn(6, dtype=torch.complex64)
    sd = {"conj": c.conj(), "neg": torch._neg_view(torch.randn(5, dtype=torch.complex64)),
          "plain": c}
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(ckpt), no_dist=True)
    for reader in (dcp.FileSystemReader(ckpt), tdcp.Reader(ckpt)):
        got = {k: torch.zeros_like(v.resolve_conj().resolve_neg()) for k, v in sd.items()}
        dcp.load(got, storage_reader=reader, no_dist=True)
        for k, v in sd.items():
            assert torch.equal(got[k], v.resolve_conj().resolve_neg()), (type(reader), k)


def test_torch_safetensors_serialization_loads(tmp_path: Path) -> None:
    """torch's writer with serialization_format=SAFETENSORS puts each rank file's tensors in
    one safetensors section after its bytes items: Reader loads them (the 2- and 4-rank test
    loads blocks of them), tensortier verify passes them (they carry no checksum)."""
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    ckpt = tmp_path / "ckpt"
    w = torch.arange(64 * 1024, dtype=torch.float32).reshape(64, 1024)
    sd = {"w": w, "b": torch.ones(3, dtype=torch.int16), "note": {"text": "hi"}}
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(
        ckpt, serialization_format=SerializationFormat.SAFETENSORS), no_dist=True)
    got = {"w": torch.zeros(64, 1024), "b": torch.zeros(3, dtype=torch.int16),
           "note": {"text": ""}}
    dcp.load(got, storage_reader=tdcp.Reader(ckpt), no_dist=True)
    assert torch.equal(got["w"], w) and torch.equal(got["b"], sd["b"])
    assert got["note"] == {"text": "hi"}
    if BIN.is_file():
        ok = cli("verify", ckpt)
        assert ok.returncode == 0, ok.stderr


def test_items_stored_through_stream_transforms_are_named(tmp_path: Path) -> None:
    """FileSystemWriter(_extensions=[...]) compresses items: Reader says so and points to
    torch's reader with its extension registry; `tensortier verify` checks the rest and counts
    them as not read, which is no failure."""
    import zlib

    from torch.distributed.checkpoint._extension import StreamTransformExtension

    class Zlib(StreamTransformExtension):
        @staticmethod
        def from_descriptor(version: str) -> "Zlib":
            return Zlib()

        @staticmethod
        def registry_name() -> str:
            return "stream.zlib-test"

        def get_descriptor(self) -> str:
            return f"{self.registry_name()}/1"

        def transform_to(self, output: Any) -> Any:
            class Compressing(io.RawIOBase):
                def __init__(self) -> None:
                    self.z: Any = zlib.compressobj()

                def writable(self) -> bool:
                    return True

                def write(self, b: Any) -> int:
                    output.write(self.z.compress(bytes(b)))
                    return len(memoryview(b))

                def flush(self) -> None:
                    if self.z is not None:
                        output.write(self.z.flush())
                        self.z = None
                    output.flush()

            return Compressing()

        def transform_from(self, input: Any) -> Any:
            return io.BytesIO(zlib.decompress(input.read()))

    ckpt = tmp_path / "zlib"
    dcp.save({"w": torch.zeros(1000), "s": 5}, no_dist=True,
             storage_writer=dcp.FileSystemWriter(ckpt, _extensions=[Zlib()]))
    with pytest.raises(CheckpointException, match="stream transforms .*_extension_registry"):
        dcp.load({"w": torch.ones(1000), "s": 0}, storage_reader=tdcp.Reader(ckpt),
                 no_dist=True)
    said = cli("verify", ckpt)
    assert said.returncode == 0, said.stderr
    assert "stored through stream transforms (compressed) and not read" in said.stdout, said.stdout


@pytest.mark.parametrize("small_fs", ["tmpfs"], indirect=True)
def test_a_failed_save_gives_its_staged_memory_to_the_next_stage(small_fs: Path) -> None:
    """A job that goes on training through a full disk: each failed save's staged copy is
    reused by the next stage (held alive by the error's traceback, it would otherwise take new
    memory each time)."""
    from tensortier import _core

    writer = tdcp.Writer(small_fs / "ckpt")
    big = (3 << 20) + 4096  # 12 MiB: more than the filesystem holds, and than earlier arenas
    staged = writer.stage({"w": torch.full((big,), 1.0), "step": 1})
    with pytest.raises(CheckpointException):
        dcp.save(staged, storage_writer=writer, no_dist=True)
    count = _core.staging_arena_count()
    again = writer.stage({"w": torch.full((big,), 2.0), "step": 2})
    reused = again["w"].data_ptr() == staged["w"].data_ptr()
    assert reused and _core.staging_arena_count() == count
    del staged, again


def test_an_empty_path_is_the_current_directory_as_for_stock_dcp(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    dcp.save({"w": torch.ones(3)}, storage_writer=tdcp.Writer(""), no_dist=True)
    assert (tmp_path / ".metadata").is_file()
    for reader in (tdcp.Reader(""), dcp.FileSystemReader("")):
        got = {"w": torch.zeros(3)}
        dcp.load(got, storage_reader=reader, no_dist=True)
        assert torch.equal(got["w"], torch.ones(3))
