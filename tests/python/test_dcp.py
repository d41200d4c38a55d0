"""tensortier.dcp: torch.distributed.checkpoint's Writer and Reader on tensortier's engine, in
real Gloo processes (dcp_worker.py) and, for single-process cases, without a process group."""

from __future__ import annotations

import errno
import io
import json
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tensortier import dcp as tdcp

WORKER = Path(__file__).with_name("dcp_worker.py")
TIMEOUT = 90  # seconds a 2-rank run may take on a loaded 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(tmp: Path, scenario: str, ckpt: Path, version: int = 1, world: int = 2,
              **extra: str) -> list[dict[str, Any]]:
    """Runs `world` ranks of dcp_worker.py and returns each rank's report (None for a rank that
    wrote none). Every process is killed when the run ends, passed or failed."""
    out = tmp / f"out-{scenario}-{version}-{len(list(tmp.iterdir()))}"
    out.mkdir()
    port = free_port()
    procs = []
    try:
        for r in range(world):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **extra)
            procs.append(subprocess.Popen(
                [sys.executable, str(WORKER), scenario, str(ckpt), str(out), str(version)],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        outputs = [p.communicate(timeout=TIMEOUT)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    reports = []
    for r in range(world):
        path = out / f"rank{r}.json"
        rep = json.loads(path.read_text()) if path.exists() else None
        if rep is not None:
            rep["output"] = outputs[r][-3000:]
            rep["returncode"] = procs[r].returncode
        reports.append(rep)
    return reports


def assert_ok(reports: list[dict[str, Any] | None]) -> None:
    for r, rep in enumerate(reports):
        assert rep is not None, f"rank {r} wrote no report"
        assert rep["ok"], f"rank {r}: {rep.get('error')}\n{rep['output']}"


@pytest.mark.parametrize("save,load", [("ours", "ours"), ("ours", "stock"), ("stock", "ours")])
def test_two_gloo_ranks_save_and_load(tmp_path: Path, save: str, load: str) -> None:
    ckpt = tmp_path / "ckpt"
    assert_ok(run_ranks(tmp_path, f"save-{save}", ckpt))
    assert (ckpt / ".metadata").exists()
    assert_ok(run_ranks(tmp_path, f"load-{load}", ckpt))


@pytest.mark.parametrize("saved,loaded", [(1, 2), (2, 1)])
def test_load_into_another_world_size(tmp_path: Path, saved: int, loaded: int) -> None:
    """Shard(0) tensors saved by `saved` ranks load into `loaded` ranks (the same values: the
    per-rank size DCP_BIG is scaled): 1 -> 2 reads only the rows each rank needs, 2 -> 1 reads
    each stored chunk straight into its part of the target."""
    ckpt = tmp_path / "ckpt"
    assert_ok(run_ranks(tmp_path, "save-ours", ckpt, world=saved, DCP_BIG=str(600000 // saved)))
    assert_ok(run_ranks(tmp_path, "load-ours", ckpt, world=loaded,
                        DCP_BIG=str(600000 // loaded)))


@pytest.mark.parametrize("rank,step", [("1", "write_data"), ("0", "finish")])
def test_killed_rank_leaves_the_old_checkpoint_whole(tmp_path: Path, rank: str, step: str) -> None:
    """A rank is SIGKILLed during a save over an existing checkpoint (rank 1 50 ms into writing
    its file, or the coordinator as it starts the commit, every data file written); the other
    rank fails on the group's timeout. The old checkpoint (or the new one, where the save was
    committed before the kill came) loads whole, with our reader and torch's, and the next save
    removes what the dead one left."""
    ckpt = tmp_path / "ckpt"
    assert_ok(run_ranks(tmp_path, "save-ours", ckpt, version=1))
    before = sorted(p.name for p in ckpt.iterdir())
    reports = run_ranks(tmp_path, "save-ours", ckpt, version=2, DCP_BIG="4000000",
                        DCP_KILL_RANK=rank, DCP_KILL_IN=step,
                        DCP_KILL_AFTER="0.05" if step == "write_data" else "0",
                        DCP_PG_TIMEOUT="10")
    # Killed before it could report; a rank killed during its file write may have finished its
    # part first on a loaded machine (the timer fires late): the checks below allow for it.
    assert reports[int(rank)] is None or step == "write_data"
    md = tdcp.Reader(ckpt).read_metadata()
    committed = 2 if md.state_dict_metadata["shard_big"].size[0] == 8_000_000 else 1
    assert committed == 1 or step == "write_data"
    size = {"DCP_BIG": "4000000"} if committed == 2 else {}
    assert_ok(run_ranks(tmp_path, "load-ours", ckpt, version=committed, **size))
    assert_ok(run_ranks(tmp_path, "load-stock", ckpt, version=committed, **size))
    assert_ok(run_ranks(tmp_path, "save-ours", ckpt, version=3))
    after = sorted(p.name for p in ckpt.iterdir())
    assert not set(before) & set(after) - {".metadata", ".tensortier-dcp.lock"} or committed == 2
    assert len([n for n in after if n.endswith(".distcp")]) == 2
    assert not [n for n in after if ".tmp-" in n]
    assert_ok(run_ranks(tmp_path, "load-ours", ckpt, version=3))


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
    items = tdcp._core.read_dcp_tensor_items(str(ckpt / info.relative_path), ["w"],
                                             [info.offset], [info.length])
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
    assert "ValueError" in msg, msg
    assert name in msg and "'w'" in msg and f"[{begin}, {end})" in msg, msg


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
                       match=f"ValueError: .*{data_file.name}.*{item}.*truncated"):
        dcp.load({"w": torch.zeros(5000)} if cut == "w" else zeros_like_single(),
                 storage_reader=tdcp.Reader(ckpt))


def test_missing_data_file_names_file_and_item(tmp_path: Path) -> None:
    ckpt, _ = single_process_checkpoint(tmp_path)
    data_file = next(p for p in ckpt.iterdir() if p.name.endswith(".distcp"))
    data_file.unlink()
    with pytest.raises(CheckpointException) as e:
        dcp.load(zeros_like_single(), storage_reader=tdcp.Reader(ckpt))
    msg = str(e.value)
    assert "FileNotFoundError" in msg and str(data_file) in msg, msg
    assert re.search(r"for item '(w|b|note)'", msg), msg


def test_newer_format_is_refused_naming_its_version(tmp_path: Path) -> None:
    """Writer stores its format version in the metadata's StorageMeta; a Reader refuses a newer
    one before reading any item, naming the file, the version found and the one it reads."""
    ckpt, _ = single_process_checkpoint(tmp_path)
    path = ckpt / ".metadata"
    md = pickle.loads(path.read_bytes())  # our own test file: trusted
    assert md.storage_meta.tensortier_format == tdcp._FORMAT == 1
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


BIN = Path(os.environ.get("TENSORTIER_CLI", Path(sys.executable).parent / "tensortier"))


def cli(*args: object) -> subprocess.CompletedProcess[str]:
    if not BIN.is_file():
        pytest.skip(f"no tensortier binary at {BIN}")
    return subprocess.run([str(BIN), *map(str, args)], capture_output=True, text=True,
                          errors="replace", timeout=60)


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
    assert "DCP checkpoint OK (1 item checked" in ok.stdout or writer == "ours", ok.stdout
    name, begin, end = flip_in(ckpt, "w", "end")
    bad = cli("verify", ckpt)
    assert bad.returncode == 1
    assert name in bad.stderr and "'w'" in bad.stderr and "FAILED" in bad.stderr, bad.stderr


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
