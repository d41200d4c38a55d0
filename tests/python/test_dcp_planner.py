"""tensortier.dcp.SavePlanner and LoadPlanner: the checkpoint DefaultSavePlanner gives (the same
.metadata objects, read by torch's reader and ours), planned and committed without Python objects
per tensor, with an index before the pickle that LoadPlanner plans whole reads from; in real Gloo
jobs (dcp_worker.py) and in one process."""

from __future__ import annotations

import dataclasses
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import dcp_worker
from ranks import ForkServer
from tensortier import dcp as tdcp
from test_checkpoint_errors import flip_byte
from test_dcp import cli, load_whole, run_job


@pytest.fixture(scope="module")
def ranks() -> Iterator[ForkServer]:
    with ForkServer("dcp_worker") as server:
        yield server


def metadata_of(ckpt: Path) -> Any:
    """The checkpoint's .metadata as torch's reader unpickles it."""
    with open(ckpt / ".metadata", "rb") as f:
        return pickle.load(f)


def assert_same_checkpoint(ours: Any, default: Any) -> None:
    """Two saves' metadata describe the same state dict: equal entries, planner data and item
    keys; each item with its xxh64 (tensors: their block sums too)."""
    assert ours.state_dict_metadata == default.state_dict_metadata
    assert list(ours.state_dict_metadata) == list(default.state_dict_metadata)  # in its order
    assert ours.planner_data == default.planner_data
    assert set(ours.storage_data) == set(default.storage_data)
    indices = {k: k for k in default.storage_data}
    for index, info in ours.storage_data.items():
        assert vars(index) == vars(indices[index]), index  # no attribute more or less
        assert isinstance(info.xxh64, int), index
        assert (getattr(info, "xxh64_blocks", b"") != b"") == (
            index.offset is not None and default.state_dict_metadata[index.fqn].size.numel() > 0
            and hasattr(default.storage_data[index], "xxh64_blocks")), index
    assert ours.version == default.version
    assert ours.storage_meta.tensortier_format == default.storage_meta.tensortier_format


def test_two_ranks_save_what_the_default_planner_saves(tmp_path: Path, ranks: ForkServer) -> None:
    """The mixed layout (DTensors, plain tensors every rank holds, of every dtype, a view that
    is not contiguous, empty ones, non-tensor values) saved by 2 ranks with SavePlanner: the
    same metadata as DefaultSavePlanner's save, each replicated tensor written once, loaded by
    torch's reader and ours, in 2 ranks and in one process."""
    planned, default = tmp_path / "planned", tmp_path / "default"
    ours = {"with": "ours", "planner": "ours"}
    run_job(ranks, tmp_path, 2, [
        {"do": "save", "dir": planned, "v": 1, **ours},
        {"do": "save", "with": "ours", "dir": default, "v": 1},
        {"do": "load", "with": "stock", "dir": planned, "v": 1},
        {"do": "load", "with": "ours", "dir": planned, "v": 1},
        {"do": "load", "dir": planned, "v": 1, **ours},
        {"do": "load", "dir": planned, "v": 1, "big": "S1", "only": ["big", "repl"], **ours},
        {"do": "load", "dir": default, "v": 1, **ours},  # no index: planned as by default
    ])
    # 2 -> 4 ranks: the DTensors resharded, the plain tensors read whole on every rank.
    reports, _ = run_job(ranks, tmp_path, 4, [{"do": "load", "dir": planned, "v": 1, **ours}])
    for rep in reports:
        assert 0 < rep["steps"][0]["bytes_read"] <= 1.1 * rep["steps"][0]["needed"] + 65536
    md = metadata_of(planned)
    assert_same_checkpoint(md, metadata_of(default))
    # Each value every rank holds (plain tensors, non-tensor values) written by the rank
    # torch's dedup picks.
    assert writer_ranks(planned) == writer_ranks(default)
    files = {info.relative_path for info in md.storage_data.values()}
    assert {f[:4] for f in files} == {"__0_", "__1_"}  # both ranks wrote items
    assert {p.name for p in planned.glob("*.distcp")} == files
    load_whole(planned, 1)
    load_whole(planned, 1, dcp.FileSystemReader(planned))


def writer_ranks(ckpt: Path) -> dict[Any, str]:
    """Which rank's file holds each item of the checkpoint."""
    return {k: v.relative_path.split("_")[2] for k, v in metadata_of(ckpt).storage_data.items()}


def test_ranks_that_disagree_on_a_value_save_whose_the_default_saves(
        tmp_path: Path, ranks: ForkServer) -> None:
    """Keys the ranks hold with other sizes or dtypes, and a non-tensor of another value: each
    written by the rank torch's dedup picks (it counts the last rank's size)."""
    planned, default = tmp_path / "planned", tmp_path / "default"
    run_job(ranks, tmp_path, 2, [
        {"do": "save", "with": "ours", "dir": planned, "v": 1, "layout": "disagree",
         "planner": "ours"},
        {"do": "save", "with": "ours", "dir": default, "v": 1, "layout": "disagree"},
    ])
    assert writer_ranks(planned) == writer_ranks(default)
    md, default_md = metadata_of(planned), metadata_of(default)
    assert md.state_dict_metadata == default_md.state_dict_metadata


def test_twenty_thousand_small_tensors_per_rank_with_the_planner(tmp_path: Path,
                                                                 ranks: ForkServer) -> None:
    """20,000 tensors of 1 KiB per rank saved with SavePlanner, loaded back; fewer, loaded by
    torch's reader too."""
    many, few = tmp_path / "many", tmp_path / "few"
    small = {"layout": "small", "planner": "ours"}
    run_job(ranks, tmp_path, 2, [
        {"do": "save", "with": "ours", "dir": many, "v": 1, **small},
        {"do": "load", "with": "ours", "dir": many, "v": 1, **small},
        {"do": "load", "with": "ours", "dir": many, "v": 1, "layout": "small"},
        {"do": "save", "with": "ours", "dir": few, "v": 2, "count": 300, **small},
        {"do": "load", "with": "stock", "dir": few, "v": 2, "count": 300, **small},
    ])
    assert len(metadata_of(many).state_dict_metadata) == 2 * 20_000 + 1


def state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(3000, generator=g),
        "p": torch.nn.Parameter(torch.randn(4, 4, generator=g)),  # requires_grad
        "t": torch.randn(4, 6, generator=g, dtype=torch.float64).t(),  # not contiguous
        "empty": torch.empty(0, 2),
        "scalar": torch.tensor(3, dtype=torch.int8),
        "bf16": torch.randn(5, generator=g).to(torch.bfloat16),
        "nested": {"m": torch.full((7,), 2.0), "lr": 0.1, "ids": [1, torch.ones(2), "x"]},
        "step": 9,
    }


def load_into_zeros(ckpt: Path, reader: Any = None) -> dict[str, Any]:
    want = state()
    got: dict[str, Any] = {
        k: torch.zeros_like(v.detach()) if isinstance(v, torch.Tensor) else v
        for k, v in want.items() if k != "nested"}
    got["step"] = 0
    got["nested"] = {"m": torch.zeros(7), "lr": 0.0, "ids": [0, torch.zeros(2), ""]}
    dcp.load(got, storage_reader=reader or tdcp.Reader(ckpt), no_dist=True)
    for k in ("w", "p", "t", "empty", "scalar", "bf16"):
        assert torch.equal(got[k], want[k].detach()), k
    assert torch.equal(got["nested"]["m"], want["nested"]["m"]) and got["step"] == 9
    assert got["nested"]["ids"][0] == 1 and torch.equal(got["nested"]["ids"][1], torch.ones(2))
    return got


def test_one_process_saves_what_the_default_planner_saves(tmp_path: Path) -> None:
    planned, default = tmp_path / "planned", tmp_path / "default"
    returned = dcp.save(state(), storage_writer=tdcp.Writer(planned), planner=tdcp.SavePlanner(),
                        no_dist=True)
    dcp.save(state(), storage_writer=tdcp.Writer(default), no_dist=True)
    md = metadata_of(planned)
    assert_same_checkpoint(md, metadata_of(default))
    assert md.state_dict_metadata["p"].properties.requires_grad
    # What dcp.save returns reads the same, here and where it crossed to another rank.
    assert isinstance(returned, dcp.metadata.Metadata)
    for got in (returned, pickle.loads(pickle.dumps(returned))):
        assert got.state_dict_metadata == md.state_dict_metadata
        assert got.planner_data == md.planner_data and set(got.storage_data) == set(
            md.storage_data)
        assert got.storage_meta.save_id == md.storage_meta.save_id
    load_into_zeros(planned)
    load_into_zeros(planned, dcp.FileSystemReader(planned))
    verified = cli("verify", planned)
    assert verified.returncode == 0 and "DCP checkpoint OK" in verified.stdout, verified


def test_a_directory_whose_name_is_not_utf8_saves_and_loads(tmp_path: Path) -> None:
    """The checkpoint's id (its path) is pickled as pickle writes any str: a name's bytes that
    are not UTF-8 (lone surrogates in Python) come back as they were, with torch's reader too."""
    import os

    ckpt = tmp_path / os.fsdecode(b"step-\xff")
    dcp.save(state(), storage_writer=tdcp.Writer(ckpt), planner=tdcp.SavePlanner(), no_dist=True)
    assert (ckpt / ".metadata").is_file() and len(list(ckpt.glob("*.distcp"))) == 1
    md = metadata_of(ckpt)
    assert os.fspath(md.storage_meta.checkpoint_id) == str(ckpt)
    assert md.state_dict_metadata == metadata_of_default(tmp_path).state_dict_metadata
    load_into_zeros(ckpt)
    load_into_zeros(ckpt, dcp.FileSystemReader(ckpt))
    got = state()  # through the index tensortier's reader keeps
    dcp.load(got, storage_reader=tdcp.Reader(ckpt), planner=tdcp.LoadPlanner(), no_dist=True)
    assert os.fspath(tdcp.Reader(ckpt).read_metadata().storage_meta.checkpoint_id) == str(ckpt)


def metadata_of_default(tmp_path: Path) -> Any:
    default = tmp_path / "default-planner"
    dcp.save(state(), storage_writer=tdcp.Writer(default), no_dist=True)
    return metadata_of(default)


def test_the_returned_metadata_of_a_replaced_checkpoint_says_so(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    first = dcp.save({"w": torch.ones(3)}, storage_writer=tdcp.Writer(ckpt),
                     planner=tdcp.SavePlanner(), no_dist=True)
    dcp.save({"w": torch.zeros(3)}, storage_writer=tdcp.Writer(ckpt), planner=tdcp.SavePlanner(),
             no_dist=True)
    with pytest.raises(FileNotFoundError, match="another save replaced it"):
        first.state_dict_metadata


def test_its_arguments_are_default_save_planner_s(tmp_path: Path) -> None:
    """Code that passes DefaultSavePlanner's arguments, by position or name, passes them here;
    with plan caching it plans as the default (from its cache the second time)."""
    import inspect

    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    ours, default = (inspect.signature(c).parameters for c in (tdcp.SavePlanner,
                                                               DefaultSavePlanner))
    assert [(p.name, p.default) for p in ours.values()] == [
        (p.name, p.default) for p in default.values()]
    for step in range(2):
        ckpt = tmp_path / f"cached-{step}"
        planner = tdcp.SavePlanner(True, True, None, False, True)
        dcp.save(state(), storage_writer=tdcp.Writer(ckpt), planner=planner, no_dist=True)
        assert not planner._lists  # noqa: SLF001 - the default's plans, which its cache holds
        load_into_zeros(ckpt)
        load_into_zeros(ckpt, dcp.FileSystemReader(ckpt))


def test_with_another_storage_writer_it_plans_as_the_default(tmp_path: Path) -> None:
    ckpt = tmp_path / "stock"
    returned = dcp.save(state(), storage_writer=dcp.FileSystemWriter(ckpt),
                        planner=tdcp.SavePlanner(), no_dist=True)
    assert type(returned) is dcp.metadata.Metadata
    load_into_zeros(ckpt, dcp.FileSystemReader(ckpt))


def test_values_that_cannot_be_saved_are_refused_as_by_default(tmp_path: Path) -> None:
    """A quantized tensor goes the default way, and is refused naming its key; a plain tensor
    on one rank that is a non-tensor, or a tensor of other dimensions, on another cannot be
    written as both (AssertionError, as torch's global plan)."""
    q = torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)
    with pytest.raises(CheckpointException, match="q: tensors of torch.qint8 cannot be saved"):
        dcp.save({"q": q, "w": torch.ones(2)}, storage_writer=tdcp.Writer(tmp_path / "q"),
                 planner=tdcp.SavePlanner(), no_dist=True)
    planner = tdcp.SavePlanner()
    meta = tdcp.Writer(tmp_path / "x").storage_meta()
    plans = []
    for value in (torch.ones(2), 5):
        planner.set_up_planner({"x": value}, meta, True)
        plans.append(planner.create_local_plan())
    with pytest.raises(AssertionError, match="x is a plain tensor on some ranks and another"):
        planner.create_global_plan(plans)
    # One key of another number of dimensions on two ranks: both kept by the dedup (their
    # indices differ), refused as torch's global plan refuses them.
    plans = []
    for value in (torch.ones(2, 2), torch.ones(4)):
        planner.set_up_planner({"x": value}, meta, True)
        plans.append(planner.create_local_plan())
    with pytest.raises(AssertionError, match="x is a tensor of another number of dimensions"):
        planner.create_global_plan(plans)


def test_metadata_written_from_lists_reads_in_a_python_without_tensortier(tmp_path: Path) -> None:
    """The .metadata names only torch's classes: a process that never imported tensortier
    unpickles it."""
    ckpt = tmp_path / "ckpt"
    dcp.save(state(), storage_writer=tdcp.Writer(ckpt), planner=tdcp.SavePlanner(), no_dist=True)
    code = ("import pickle, sys; md = pickle.load(open(sys.argv[1], 'rb')); "
            "assert 'tensortier' not in sys.modules; print(len(md.state_dict_metadata))")
    out = subprocess.run([sys.executable, "-c", code, str(ckpt / ".metadata")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == str(len(metadata_of(ckpt)
                                                                 .state_dict_metadata)), out


def planned_checkpoint(tmp_path: Path) -> Path:
    ckpt = tmp_path / "planned"
    dcp.save(state(), storage_writer=tdcp.Writer(ckpt), planner=tdcp.SavePlanner(), no_dist=True)
    return ckpt


def load_planned(ckpt: Path, got: dict[str, Any], **planner: Any) -> tdcp.Reader:
    reader = tdcp.Reader(ckpt)
    dcp.load(got, storage_reader=reader, planner=tdcp.LoadPlanner(**planner), no_dist=True)
    return reader


def test_load_planner_reads_whole_tensors_from_the_index(tmp_path: Path) -> None:
    """The Reader plans from the index (the Metadata's objects never made), reads the plain
    tensors straight into the state dict's, and the rest (non-tensor values) as torch plans
    them; the entries, looked into, are those pickle.load gives."""
    ckpt = planned_checkpoint(tmp_path)
    want = state()
    got: dict[str, Any] = {k: torch.zeros_like(v.detach()) if isinstance(v, torch.Tensor) else v
                           for k, v in want.items() if k != "nested"}
    got["step"] = 0
    got["nested"] = {"m": torch.zeros(7), "lr": 0.0, "ids": [0, torch.zeros(2), ""]}
    targets = {k: got[k] for k in ("w", "p", "t", "scalar", "bf16")}
    reader = tdcp.Reader(ckpt)
    md = reader.read_metadata()
    assert isinstance(md, tdcp._planners._ReadMetadata) and md._made is None
    planner = tdcp.LoadPlanner()
    dcp.load(got, storage_reader=reader, planner=planner, no_dist=True)
    assert len(planner._plain_reads) == 8  # w, p, t, empty, scalar, bf16, nested.m, ids.1
    for k, target in targets.items():
        assert got[k] is target and torch.equal(target, want[k].detach()), k
    assert got["step"] == 9 and got["nested"]["lr"] == 0.1 and got["nested"]["ids"][2] == "x"
    assert torch.equal(got["nested"]["ids"][1], torch.ones(2))
    assert md.state_dict_metadata == metadata_of(ckpt).state_dict_metadata
    assert md.storage_meta.load_id and md.storage_meta.save_id == metadata_of(
        ckpt).storage_meta.save_id


def test_load_planner_converts_and_refuses_as_the_default_planner(tmp_path: Path) -> None:
    ckpt = planned_checkpoint(tmp_path)
    # Another dtype and a GPU-less device: read, then copied in as torch's planner does.
    got = {"w": torch.zeros(3000, dtype=torch.float64)}
    load_planned(ckpt, got, allow_partial_load=True)
    assert torch.equal(got["w"], state()["w"].double())
    with pytest.raises(CheckpointException, match="Missing key in checkpoint state_dict: nope."):
        load_planned(ckpt, {"nope": torch.zeros(2)})
    load_planned(ckpt, {"nope": torch.zeros(2)}, allow_partial_load=True)
    with pytest.raises(CheckpointException,
                       match=r"Size mismatch between saved torch.Size\(\[3000\]\) and current: "
                             r"torch.Size\(\[30\]\) for w"):
        load_planned(ckpt, {"w": torch.zeros(30)})


def test_load_planner_with_checkpoints_without_an_index(tmp_path: Path) -> None:
    """A checkpoint of the default planner, and torch's reader: planned as by default."""
    ckpt = tmp_path / "default"
    dcp.save(state(), storage_writer=tdcp.Writer(ckpt), no_dist=True)
    assert type(tdcp.Reader(ckpt).read_metadata()) is dcp.metadata.Metadata
    for reader in (tdcp.Reader(ckpt), dcp.FileSystemReader(ckpt)):
        got = {"w": torch.zeros(3000)}
        dcp.load(got, storage_reader=reader, planner=tdcp.LoadPlanner(allow_partial_load=True),
                 no_dist=True)
        assert torch.equal(got["w"], state()["w"])


def test_damage_to_a_whole_read_tensor_or_the_index_is_named(tmp_path: Path) -> None:
    ckpt = planned_checkpoint(tmp_path)
    md = metadata_of(ckpt)
    info = next(v for k, v in md.storage_data.items() if k.fqn == "w")
    flip_byte(ckpt / info.relative_path, info.offset + info.length - 5)
    with pytest.raises(CheckpointException, match=rf"{info.relative_path}.*'w'|w.*{info.relative_path}"):
        load_planned(ckpt, {"w": torch.zeros(3000)}, allow_partial_load=True)
    # The index (its start) and the pickle after it (its end) each carry an xxh64.
    data = (ckpt / ".metadata").read_bytes()
    for at, says in ((40, "damaged tensortier index"),
                     (len(data) - 3, "not the one it describes")):
        copy = tmp_path / f"copy{at}"
        shutil.copytree(ckpt, copy)
        flip_byte(copy / ".metadata", at)
        with pytest.raises(ValueError, match=says):
            tdcp.Reader(copy).read_metadata()
        verified = cli("verify", copy)  # the CLI reads the pickle, and checks the index too
        assert verified.returncode == 1 and says in verified.stderr, verified


def test_async_save_with_the_planners(tmp_path: Path) -> None:
    """dcp.async_save with Writer and SavePlanner (on the staged copy), then a LoadPlanner
    load: the values at the call."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        sd = {"w": torch.arange(10.0), "m": {f"t{i}": torch.full((3,), float(i))
                                             for i in range(50)}, "step": 3}
        fut = dcp.async_save(sd, storage_writer=tdcp.Writer(tmp_path / "ckpt"),
                             planner=tdcp.SavePlanner())
        sd["w"].add_(1)
        md = fut.result(timeout=60)
        assert len(md.state_dict_metadata) == 52
        got = {"w": torch.zeros(10), "m": {f"t{i}": torch.zeros(3) for i in range(50)},
               "step": 0}
        dcp.load(got, storage_reader=tdcp.Reader(tmp_path / "ckpt"), planner=tdcp.LoadPlanner())
        assert torch.equal(got["w"], torch.arange(10.0)) and got["step"] == 3
        assert all(torch.equal(got["m"][f"t{i}"], torch.full((3,), float(i))) for i in range(50))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_state_dicts_with_the_planners(tmp_path: Path) -> None:
    """Plain CUDA tensors saved through SavePlanner (staged through pinned memory) and loaded
    by LoadPlanner into CUDA targets, another dtype among them."""
    ckpt = tmp_path / "cuda"
    sd = {k: v.detach().cuda() for k, v in state().items() if isinstance(v, torch.Tensor)}
    dcp.save(sd, storage_writer=tdcp.Writer(ckpt), planner=tdcp.SavePlanner(), no_dist=True)
    got = {k: torch.zeros_like(v) for k, v in sd.items()}
    got["w"] = torch.zeros(3000, dtype=torch.float64, device="cuda")
    planner = tdcp.LoadPlanner()
    dcp.load(got, storage_reader=tdcp.Reader(ckpt), planner=planner, no_dist=True)
    assert len(planner._plain_reads) == len(sd)
    for k, v in sd.items():
        assert got[k].is_cuda and torch.equal(got[k].cpu(), v.cpu().to(got[k].dtype)), k


def test_dcp_extension_points_of_subclasses_are_honoured(tmp_path: Path) -> None:
    """A SavePlanner subclass's resolve_data (what is written), a LoadPlanner subclass's
    lookup_tensor (where it is read into), and torch's documented pattern of extra planner data
    in the metadata (dataclasses.replace of what create_global_plan returns) work as with the
    default planners."""
    class Doubling(tdcp.SavePlanner):
        def resolve_data(self, write_item: Any) -> Any:
            obj = super().resolve_data(write_item)
            return obj * 2 if isinstance(obj, torch.Tensor) else obj

    ckpt = tmp_path / "doubled"
    dcp.save({"w": torch.ones(3)}, storage_writer=tdcp.Writer(ckpt), planner=Doubling(),
             no_dist=True)
    got = {"w": torch.zeros(3)}
    dcp.load(got, storage_reader=dcp.FileSystemReader(ckpt), no_dist=True)
    assert torch.equal(got["w"], torch.full((3,), 2.0))

    elsewhere = {"w": torch.zeros(3)}

    class Redirect(tdcp.LoadPlanner):
        def lookup_tensor(self, index: Any) -> Any:
            return elsewhere[index.fqn]

    mine = {"w": torch.zeros(3)}
    dcp.load(mine, storage_reader=tdcp.Reader(ckpt), planner=Redirect(), no_dist=True)
    assert torch.equal(elsewhere["w"], torch.full((3,), 2.0)) and not mine["w"].any()

    class ExtraData(tdcp.SavePlanner):
        def create_local_plan(self) -> Any:
            return dataclasses.replace(super().create_local_plan(), planner_data="per-rank")

        def create_global_plan(self, all_plans: Any) -> Any:
            plans, metadata = super().create_global_plan(all_plans)
            return plans, dataclasses.replace(
                metadata, planner_data=[p.planner_data for p in plans])

    extra = tmp_path / "extra"
    returned = dcp.save({"w": torch.randn(2, 2), "step": 3}, storage_writer=tdcp.Writer(extra),
                        planner=ExtraData(flatten_state_dict=False), no_dist=True)
    assert metadata_of(extra).planner_data == ["per-rank"] == returned.planner_data
    assert set(metadata_of(extra).storage_data) == set(returned.storage_data)
    got = {"w": torch.zeros(2, 2), "step": 0}
    dcp.load(got, storage_reader=tdcp.Reader(extra), planner=tdcp.LoadPlanner(), no_dist=True)
    assert got["step"] == 3


def test_keys_that_are_not_utf8_are_named(tmp_path: Path) -> None:
    key = "layer\udcff.weight"  # as os.fsdecode gives for a byte name
    for planner in (tdcp.SavePlanner(), dcp.DefaultSavePlanner()):
        with pytest.raises(CheckpointException, match=r"layer\\udcff.weight.*not a str of valid UTF-8"):
            dcp.save({key: torch.ones(2)}, storage_writer=tdcp.Writer(tmp_path / "k"),
                     planner=planner, no_dist=True)


def test_an_index_that_lies_is_named(tmp_path: Path) -> None:
    """An index whose sums agree with it but whose contents are not what the writer writes (a
    dtype that is no name, a memory format past 2): ValueError naming the .metadata."""
    import struct

    from tensortier import _core

    ckpt = planned_checkpoint(tmp_path)
    data = (ckpt / ".metadata").read_bytes()
    n = struct.unpack("<I", data[3:7])[0]
    index, body = data[7:7 + n], data[7 + n + 1:]
    for old, new in ((b"\x07\x00\x00\x00float32", b"\x07\x00\x00\x00fl-at32"),
                     (b"\x0d\x00\x00\x00torch.strided\x00", b"\x0d\x00\x00\x00torch.strided\x07")):
        assert old in index
        payload = index[24:].replace(old, new, 1)
        forged = index[:16] + struct.pack("<Q", _core.xxh64(payload)) + payload
        (ckpt / ".metadata").write_bytes(data[:3] + struct.pack("<I", len(forged)) + forged
                                         + b"0" + body)
        with pytest.raises(ValueError, match=r"\.metadata: a damaged tensortier index"):
            tdcp.Reader(ckpt).read_metadata()


def test_metadata_objects_behave_as_torch_s(tmp_path: Path) -> None:
    """What Reader.read_metadata and dcp.save return with the planners: pickled, compared,
    replaced and shown as torch's Metadata; the keys in torch's order."""
    ckpt = tmp_path / "ckpt"
    sd = {"model.w": torch.ones(2), "epoch": 3, "model.b": torch.zeros(2), "lr": 0.1}
    returned = dcp.save(sd, storage_writer=tdcp.Writer(ckpt), planner=tdcp.SavePlanner(),
                        no_dist=True)
    read = tdcp.Reader(ckpt).read_metadata()
    stock = dcp.FileSystemReader(ckpt).read_metadata()
    assert list(stock.state_dict_metadata) == list(sd)  # the state dict's order
    for md in (read, returned):
        plain = dcp.metadata.Metadata(md.state_dict_metadata, md.planner_data, md.storage_data,
                                      md.storage_meta, md.version)
        assert md == plain and plain == md
        again = pickle.loads(pickle.dumps(md))
        assert type(again) is dcp.metadata.Metadata and again == plain
        assert dataclasses.replace(md, planner_data=None).planner_data is None
        assert repr(md).startswith("Metadata(")
    assert read.state_dict_metadata == stock.state_dict_metadata


def test_a_sparse_target_gets_torch_s_error(tmp_path: Path) -> None:
    ckpt = planned_checkpoint(tmp_path)
    for planner in (tdcp.LoadPlanner(allow_partial_load=True),
                    dcp.DefaultLoadPlanner(allow_partial_load=True)):
        with pytest.raises(CheckpointException, match="between dense and sparse"):
            dcp.load({"w": torch.zeros(3000).to_sparse()}, storage_reader=tdcp.Reader(ckpt),
                     planner=planner, no_dist=True)
