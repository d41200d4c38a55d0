"""tensortier.load / save / load_into follow torch.load / torch.save / load_state_dict's
conventions: their errors, map_location and weights_only, file-like objects."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest
import torch

import tensortier


def _load_state_dict_error(module: torch.nn.Module, sd: dict[str, torch.Tensor]) -> str:
    with pytest.raises(RuntimeError) as info:
        module.load_state_dict(sd)
    return str(info.value)


@pytest.mark.parametrize("name", ["m.safetensors", "m.pt"])
def test_load_into_strict_raises_load_state_dicts_runtime_error(
    disk_dir: Path, name: str
) -> None:
    """The same RuntimeError, with load_state_dict's lines in its order, plus the file."""
    saved = {"weight": torch.randn(3, 2), "extra": torch.randn(5)}
    path = disk_dir / name
    tensortier.save(saved, path)
    model = torch.nn.Linear(2, 2)
    expected = _load_state_dict_error(torch.nn.Linear(2, 2), saved)
    with pytest.raises(RuntimeError) as info:
        tensortier.load_into(model, path)
    got = str(info.value)
    assert got.startswith(expected + "\n\t"), got
    assert str(path) in got.splitlines()[-1]
    assert isinstance(info.value, tensortier.StateDictMismatchError)
    assert isinstance(info.value, ValueError)  # what callers caught before


def test_load_into_missing_unexpected_and_mapping_target(disk_dir: Path) -> None:
    path = disk_dir / "s.safetensors"
    tensortier.save({"weight": torch.randn(2, 2), "x": torch.randn(1)}, path)
    expected = _load_state_dict_error(torch.nn.Linear(2, 2), {"weight": torch.randn(2, 2),
                                                               "x": torch.randn(1)})
    with pytest.raises(RuntimeError) as info:
        tensortier.load_into(torch.nn.Linear(2, 2), path)
    assert str(info.value).startswith(expected + "\n\t")
    assert "strict=False" in str(info.value)
    with pytest.raises(RuntimeError, match=r"^Error\(s\) in loading state_dict for dict:"):
        tensortier.load_into({"weight": torch.zeros(2, 2)}, path)


def test_load_into_size_mismatch_raises_even_when_not_strict(disk_dir: Path) -> None:
    """load_state_dict(strict=False) still refuses shape mismatches: so does load_into."""
    path = disk_dir / "s.pt"
    saved = {"weight": torch.randn(3, 2)}
    tensortier.save(saved, path)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError) as theirs:
        torch.nn.Linear(2, 2).load_state_dict(saved, strict=False)
    with pytest.raises(RuntimeError) as ours:
        tensortier.load_into(model, path, strict=False)
    assert str(ours.value).startswith(str(theirs.value) + "\n\t")
    assert "strict=False" not in str(ours.value)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_a_one_element_entry_fills_a_0_dim_target_as_load_state_dict_does(
        disk_dir: Path, dtype: torch.dtype) -> None:
    """load_state_dict's rule for what older versions saved 1-dim: a [1] entry is loaded into a
    0-dim parameter or buffer (its one value), straight or converted to the target's dtype."""

    class Counted(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("n", torch.tensor(0))

    path = disk_dir / "n.pt"
    tensortier.save({"n": torch.tensor([5], dtype=dtype)}, path)
    theirs, ours = Counted(), Counted()
    theirs.load_state_dict(torch.load(path))
    tensortier.load_into(ours, path)
    assert ours.n.shape == () and torch.equal(ours.n, theirs.n) and int(ours.n) == 5
    with pytest.raises(RuntimeError, match="size mismatch for n"):  # [2] is no such entry
        tensortier.save({"n": torch.tensor([5, 6], dtype=dtype)}, path)
        tensortier.load_into(Counted(), path)


def _save_as_if_on(location: str, obj: object, path: Path,
                   monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.save `obj` with every storage's location recorded as `location` ('cuda:0'...):
    the file a GPU machine writes, made here without one."""
    with monkeypatch.context() as m:
        m.setattr(torch.serialization, "location_tag", lambda storage: location)
        torch.save(obj, path)


def _equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.device == b.device and a.dtype == b.dtype
                and torch.equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            _equal(a[k], b[k]) for k in a)
    return bool(a == b)


def _cuda_saved(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, dict[str, object]]:
    base = torch.arange(12, dtype=torch.float32)
    obj = {"w": torch.randn(3, 5), "shared": base, "view": base[2:8].view(2, 3),
           "i": torch.arange(7, dtype=torch.int16), "step": 3}
    path = tmp / "gpu.pt"
    _save_as_if_on("cuda:0", obj, path, monkeypatch)
    return path, obj


def test_map_location_cpu_forms_load_a_cuda_saved_file_as_torch_does(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, obj = _cuda_saved(disk_dir, monkeypatch)
    seen: list[str] = []

    def to_cpu(storage: torch.UntypedStorage, location: str) -> torch.UntypedStorage:
        seen.append(location)
        assert storage.device.type == "cpu"
        return storage

    for ml in ["cpu", torch.device("cpu"), {"cuda:0": "cpu"}, to_cpu,
               lambda storage, location: storage.cpu()]:
        theirs = torch.load(path, map_location=ml, weights_only=True)
        ours = tensortier.load(path, map_location=ml)
        assert _equal(theirs, obj) and _equal(ours, theirs), ml
        # shared storages stay shared, as from torch.load
        assert ours["view"].untyped_storage().data_ptr() == \
            ours["shared"].untyped_storage().data_ptr()
    assert len(seen) == 6 and set(seen) == {"cuda:0"}  # 3 storages, torch.load's calls too


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusals of a machine without CUDA")
def test_map_location_to_cuda_is_refused_without_cuda(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = _cuda_saved(disk_dir, monkeypatch)
    for ml in [{"cuda:1": "cpu"}, {}, lambda storage, location: None, "cuda:0",
               {"cpu": "cuda:0"}]:
        with pytest.raises(RuntimeError):
            torch.load(path, map_location=ml, weights_only=True)
        with pytest.raises(ValueError, match="CUDA is not available"):
            tensortier.load(path, map_location=ml)
    # without map_location: the CPU (the documented difference from torch.load)
    assert tensortier.load(path)["i"].device.type == "cpu"


def test_map_location_on_safetensors_and_cpu_saved_files(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sd = {"a": torch.randn(4, 3), "b": torch.arange(5)}
    st = disk_dir / "m.safetensors"
    pt = disk_dir / "m.pt"
    tensortier.save(sd, st)
    torch.save(sd, pt)
    locations: list[str] = []

    def keep(storage: torch.UntypedStorage, location: str) -> None:
        locations.append(location)
        return None

    for path in (st, pt):
        for ml in ["cpu", {"cuda:0": "cuda:1"}, keep]:
            out = tensortier.load(path, map_location=ml)
            assert _equal(out, sd), (path, ml)
            if path == pt:
                assert _equal(torch.load(path, map_location=ml, weights_only=True), out)
    assert locations == ["cpu"] * 6  # 2 tensors: ours on both files, torch.load's on .pt


def test_weights_only_false_is_refused_true_and_none_load(disk_dir: Path) -> None:
    path = disk_dir / "m.pt"
    sd = {"a": torch.randn(3)}
    tensortier.save(sd, path)
    for wo in (True, None):
        assert _equal(tensortier.load(path, weights_only=wo), sd)
    with pytest.raises(ValueError, match="never runs arbitrary pickled code"):
        tensortier.load(path, weights_only=False)
    with pytest.raises(TypeError, match="weights_only"):
        tensortier.load(path, weights_only="yes")  # type: ignore[arg-type]


class _PlacementRefused(Exception):
    pass


@pytest.mark.parametrize("name", ["m.pt", "m.safetensors"])
def test_errors_of_map_location_reach_the_caller_as_raised(disk_dir: Path, name: str) -> None:
    # torch.load lets what the map_location callable raises through: code catching its own
    # error type around it must catch it here too, and the file is not called malformed.
    path = disk_dir / name
    tensortier.save({"a": torch.randn(3)}, path)

    def refuse(storage: torch.UntypedStorage, location: str) -> None:
        raise _PlacementRefused(f"no room for {location}")

    loaders = [tensortier.load] + ([torch.load] if name.endswith(".pt") else [])
    for load in loaders:
        with pytest.raises(_PlacementRefused, match="no room for cpu"):
            load(path, map_location=refuse)
    with pytest.raises(ValueError) as info:
        tensortier.load(path, map_location={"cpu": "nowhere"})
    assert "'nowhere'" in str(info.value) and "malformed" not in str(info.value)


def test_map_location_bad_arguments(disk_dir: Path) -> None:
    path = disk_dir / "m.pt"
    tensortier.save({"a": torch.randn(3)}, path)
    with pytest.raises(ValueError, match="not both"):
        tensortier.load(path, device="cpu", map_location="cpu")
    with pytest.raises(TypeError, match="map_location must be"):
        tensortier.load(path, map_location=3)
    # With mmap, as torch.load(mmap=True) takes it (test_checkpoint_mmap has the cases).
    assert tensortier.load(path, map_location={"cpu": "cpu"}, mmap=True)["a"].numel() == 3
    with pytest.raises(ValueError, match="same size"):
        tensortier.load(path, map_location=lambda s, loc: torch.UntypedStorage(1))
    assert tensortier.load(path, map_location="cpu", mmap=True)["a"].numel() == 3


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_save_and_load_file_objects(disk_dir: Path, fmt: str) -> None:
    """io.BytesIO and open binary files, both ways, as torch.save/torch.load take them."""
    import io

    sd = {"a": torch.randn(5, 3), "b": torch.arange(7, dtype=torch.int64),
          "empty": torch.zeros(0)}
    buf = io.BytesIO()
    tensortier.save(sd, buf, format=fmt)
    buf.seek(0)
    assert _equal(tensortier.load(buf), sd)
    if fmt == "torch":
        buf.seek(0)
        assert _equal(torch.load(buf, weights_only=True), sd)
    else:
        from safetensors.torch import load as st_load
        assert _equal(st_load(buf.getvalue()), sd)
    path = disk_dir / "f.bin"
    with open(path, "wb") as f:
        tensortier.save(sd, f, format=fmt)
    with open(path, "rb") as f:
        assert _equal(tensortier.load(f, mmap=True), sd)
    with open(path, "rb") as f:
        assert _equal(tensortier.load(f, verify=fmt == "torch"), sd)


def test_file_objects_default_to_torch_format_and_read_from_their_position(
    disk_dir: Path,
) -> None:
    import io

    sd = {"w": torch.randn(4)}
    ours, theirs = io.BytesIO(b"head"), io.BytesIO()
    ours.seek(4)
    tensortier.save(sd, ours)  # torch's format, as torch.save writes to a file object
    torch.save(sd, theirs)
    ours.seek(4)
    assert _equal(torch.load(ours, weights_only=True), sd)
    ours.seek(4)
    assert _equal(tensortier.load(ours, map_location="cpu"), sd)
    with pytest.raises(ValueError, match=r"^<BytesIO>: not a checkpoint: neither a torch.save zip"):
        tensortier.load(io.BytesIO(b"not a checkpoint at all"))
    with pytest.raises(TypeError):  # a text file object, as torch.save refuses it
        tensortier.save(sd, io.StringIO())


def test_index_from_a_file_object_is_refused(disk_dir: Path) -> None:
    import io

    index = io.BytesIO(b'{"weight_map": {"a": "x.safetensors"}}')
    with pytest.raises(ValueError, match="by its path"):
        tensortier.load(index)


class _NotAllowed:
    """A class of the test's own: torch.load(weights_only=True) refuses it unless allowed."""

    def __init__(self) -> None:
        self.value = 1


def test_what_weights_only_refuses_raises_torchs_unpickling_error(disk_dir: Path) -> None:
    # Code written for torch.load catches pickle.UnpicklingError; the error is also the
    # ValueError tensortier raised before. Allowed globals load, as they do for torch.load.
    import io
    import pickle

    import numpy as np

    for name, obj in [("own_class.pt", {"x": _NotAllowed()}), ("numpy.pt", {"step": np.int64(3)})]:
        path = disk_dir / name
        torch.save(obj, path)
        with pytest.raises(pickle.UnpicklingError):
            torch.load(path, weights_only=True)
        with pytest.raises(pickle.UnpicklingError, match="weights_only") as info:
            tensortier.load(path)
        assert isinstance(info.value, ValueError)
        assert isinstance(info.value, tensortier.WeightsOnlyUnpicklingError)
        assert str(path) in str(info.value)
        with pytest.raises(pickle.UnpicklingError, match="BytesIO"):
            tensortier.load(io.BytesIO(path.read_bytes()))
        with pytest.raises(pickle.UnpicklingError, match=name):
            tensortier.load_into({"x": torch.zeros(1)}, path)
    with torch.serialization.safe_globals([_NotAllowed]):
        assert tensortier.load(disk_dir / "own_class.pt")["x"].value == 1


class _WithExtraState(torch.nn.Module):
    """A module with extra state (get_extra_state), as TransformerEngine's layers have: any
    object, or a tensor whose size changes with what it holds."""

    def __init__(self, state: object) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        self.state = state

    def get_extra_state(self) -> object:
        return self.state

    def set_extra_state(self, state: object) -> None:
        self.state = state


@pytest.mark.parametrize("saved", [{"scale": 2.5, "steps": 7}, torch.arange(5, dtype=torch.uint8)])
def test_load_into_gives_extra_state_to_set_extra_state(disk_dir: Path, saved: object) -> None:
    outer = torch.nn.Sequential(_WithExtraState(saved), torch.nn.ReLU())
    path = disk_dir / "extra.pt"
    tensortier.save(outer.state_dict(), path)
    assert "0._extra_state" in torch.load(path, weights_only=True)
    for empty in ({}, torch.zeros(2, dtype=torch.uint8)):  # another shape than the saved one
        theirs = torch.nn.Sequential(_WithExtraState(empty), torch.nn.ReLU())
        theirs.load_state_dict(torch.load(path, weights_only=True))
        ours = torch.nn.Sequential(_WithExtraState(empty), torch.nn.ReLU())
        assert tensortier.load_into(ours, path) == ([], [])
        for got in (ours[0].state, theirs[0].state):
            if isinstance(saved, torch.Tensor):
                assert isinstance(got, torch.Tensor) and torch.equal(got, saved)
            else:
                assert got == saved
        assert torch.equal(ours[0].lin.weight, outer[0].lin.weight)
    # A file without it (safetensors holds tensors only): missing, as for load_state_dict.
    st_path = disk_dir / "no_extra.safetensors"
    lin_only = {f"lin.{k}": v for k, v in outer[0].lin.state_dict().items()}
    tensortier.save(lin_only, st_path)
    with pytest.raises(RuntimeError, match='Missing key.*"_extra_state"'):
        _WithExtraState({}).load_state_dict(lin_only)
    with pytest.raises(RuntimeError, match='Missing key.*"_extra_state"'):
        tensortier.load_into(_WithExtraState({}), st_path)
    target = _WithExtraState({"kept": 1})
    assert tensortier.load_into(target, st_path, strict=False) == (["_extra_state"], [])
    assert target.state == {"kept": 1}


def test_load_into_names_modules_whose_older_entries_load_state_dict_upgrades(
    disk_dir: Path,
) -> None:
    """BatchNorm files of version 1 (its _metadata records it) lack num_batches_tracked:
    load_state_dict's _load_from_state_dict adds it, which load_into does not run. Its error
    says so and what to call instead; a mismatch elsewhere gets no such note."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    old = model.state_dict()
    del old["1.num_batches_tracked"]
    old._metadata["1"]["version"] = 1  # type: ignore[attr-defined]
    path = disk_dir / "bn_v1.pt"
    torch.save(old, path)
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    fresh.load_state_dict(torch.load(path, weights_only=True))  # upgraded
    fresh.load_state_dict(tensortier.load(path))  # _metadata kept: upgraded too
    with pytest.raises(RuntimeError) as info:
        tensortier.load_into(fresh, path)
    message = str(info.value)
    assert '"1.num_batches_tracked"' in message
    assert "'1' (BatchNorm1d, saved with version 1, now 2)" in message
    assert "module.load_state_dict(tensortier.load(path))" in message
    # safetensors files record no versions
    st_path = disk_dir / "bn.safetensors"
    tensortier.save(dict(old), st_path)
    with pytest.raises(RuntimeError, match="'1' \\(BatchNorm1d, saved with no version, now 2\\)"):
        tensortier.load_into(fresh, st_path)
    # a mismatch that is not a BatchNorm's: no note
    current = model.state_dict()
    current["extra"] = torch.zeros(1)
    torch.save(current, path)
    with pytest.raises(RuntimeError) as info:
        tensortier.load_into(fresh, path)
    assert '"extra"' in str(info.value) and "older version" not in str(info.value)


def test_load_into_takes_other_values_as_unexpected_keys_as_load_state_dict_does(
        disk_dir: Path) -> None:
    """A training checkpoint's "step": 4 beside the weights: unexpected with strict=False (the
    weights are read), load_state_dict's RuntimeError with strict=True."""
    weights = torch.nn.Linear(3, 2).state_dict()
    saved = {**weights, "step": 4, "name": "run-1"}
    path = disk_dir / "ck.pt"
    tensortier.save(saved, path)
    expected = torch.nn.Linear(3, 2).load_state_dict(saved, strict=False)
    model = torch.nn.Linear(3, 2)
    got = tensortier.load_into(model, path, strict=False)
    assert sorted(got.unexpected_keys) == sorted(expected.unexpected_keys) == ["name", "step"]
    assert got.missing_keys == []
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
    message = _load_state_dict_error(torch.nn.Linear(3, 2), saved)
    with pytest.raises(tensortier.StateDictMismatchError) as info:
        tensortier.load_into(torch.nn.Linear(3, 2), path)
    assert str(info.value).startswith(message + "\n\t"), str(info.value)
    tensortier.save({"weight": 1, "bias": weights["bias"]}, path)  # a value where a tensor goes
    with pytest.raises(ValueError, match="'weight' is an int, not a tensor"):
        tensortier.load_into(torch.nn.Linear(3, 2), path, strict=False)


@pytest.mark.parametrize("name", ["m.pt", "m.safetensors"])
def test_mmap_with_the_meta_device_loads_meta_tensors_as_torch_load_does(
        disk_dir: Path, name: str) -> None:
    path = disk_dir / name
    tensortier.save({"w": torch.ones(3, 2)}, path)
    got = tensortier.load(path, map_location="meta", mmap=True)["w"]
    assert got.is_meta and got.shape == (3, 2) and got.dtype == torch.float32
    if name.endswith(".pt"):
        theirs = torch.load(path, map_location="meta", mmap=True)["w"]
        assert theirs.is_meta and theirs.shape == got.shape


def test_a_file_object_s_own_read_error_is_raised_as_it_is() -> None:
    """Only the memory file's errors are said to be the copy's: an EIO reading the caller's
    stream was relabelled as one of the copy, its file name dropped."""
    import io

    class FailingStream(io.RawIOBase):
        def readable(self) -> bool:
            return True

        def readinto(self, b: Any) -> int:
            raise OSError(errno.EIO, "Input/output error", "/mnt/nfs/model.pt")

    for stream in (FailingStream(), io.BufferedReader(FailingStream())):
        with pytest.raises(OSError) as e:
            tensortier.load(stream)
        assert e.value.errno == errno.EIO and e.value.filename == "/mnt/nfs/model.pt"
        assert "into memory" not in str(e.value)


def test_a_file_object_too_large_to_copy_into_memory_says_so() -> None:
    """A file object is read through a copy in a memory file, which ulimit -f limits as any
    file: the EFBIG names that copy, not a file of the caller's."""
    import subprocess
    import sys

    code = (
        "import errno, io, resource, torch, tensortier\n"
        "buf = io.BytesIO()\n"
        "torch.save({'w': torch.randn(1 << 18)}, buf)\n"
        "buf.seek(0)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, 256 << 10))\n"
        "try:\n"
        "    tensortier.load(buf)\n"
        "except OSError as e:\n"
        "    print(e.errno == errno.EFBIG, 'into memory' in str(e) and 'ulimit -f' in str(e))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["True", "True"], r.stdout
