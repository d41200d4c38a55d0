"""Checkpoints of many small tensors (optimizer states, adapters, norms): a plain dict is
written by C++ as torch.save would pickle it and loaded without unpickling; small tensors move
in large requests. The results are those of torch.save / torch.load / safetensors."""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch as st
import torch

import tensortier
from tensortier import _core


def _small_dict(n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8, torch.float16]
    out: dict[str, torch.Tensor] = {}
    for i in range(n):
        dt = dtypes[i % len(dtypes)]
        t = torch.randn(1 + i % 7, 3, generator=g) * 100
        out[f"layer.{i}.w"] = t > 0 if dt == torch.bool else t.to(dt)
    return out


def _pickle_of(path: Path) -> bytes:
    with zipfile.ZipFile(path) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))


@pytest.mark.parametrize("n", [1, 2, 999, 1000, 1001, 2001])
def test_a_plain_dict_is_pickled_as_torch_save_pickles_it(disk_dir: Path, n: int) -> None:
    # Python's C pickler writes a dict's items in batches of 1000 and follows a full batch with
    # another, empty after the last item: 1000 and 1001 items differ from the other counts.
    sd = _small_dict(n)
    tensortier.save(sd, disk_dir / "ours.pt")
    torch.save(sd, disk_dir / "torch.pt")
    assert _pickle_of(disk_dir / "ours.pt") == _pickle_of(disk_dir / "torch.pt")
    back = torch.load(disk_dir / "ours.pt", weights_only=True)
    assert list(back) == list(sd)
    assert all(torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in sd.items())
    with zipfile.ZipFile(disk_dir / "ours.pt") as z:
        assert z.testzip() is None


def _no_torch_pickling(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch import _weights_only_unpickler as wou

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a plain dict went through torch's (un)pickler")

    monkeypatch.setattr(wou, "Unpickler", refuse)
    monkeypatch.setattr(torch, "save", refuse)


@pytest.mark.parametrize("writer", ["tensortier", "torch"])
def test_a_plain_dict_is_saved_and_loaded_without_torchs_pickler(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch, writer: str
) -> None:
    sd = _small_dict(1500)
    sd["big"] = torch.randn(300_000)  # a storage of its own, past the chunked sizes
    sd["mid"] = torch.randn(40_000)
    sd["empty"] = torch.empty(0, 4)
    path = disk_dir / "m.pt"
    if writer == "torch":
        torch.save(sd, path)
    with monkeypatch.context() as m:
        _no_torch_pickling(m)
        if writer == "tensortier":
            tensortier.save(sd, path)
        out = tensortier.load(path)
        converted = tensortier.load(path, dtype=torch.float16)
    assert list(out) == list(sd)
    want = torch.load(path, weights_only=True)
    for k, v in sd.items():
        t = out[k]
        assert t.dtype == v.dtype and t.shape == v.shape and torch.equal(t, v), k
        assert type(t) is torch.Tensor and not t.requires_grad
        # as torch.load's: a fixed-size storage of exactly the tensor's bytes
        storage = t.untyped_storage()
        assert storage.nbytes() == v.nbytes == want[k].untyped_storage().nbytes(), k
        assert not storage.resizable(), k
        if v.is_floating_point():
            assert converted[k].dtype == torch.float16
    ptrs = [t.data_ptr() for t in out.values() if t.numel()]
    assert len(set(ptrs)) == len(ptrs)
    out["layer.0.w"].add_(1)  # writable, and alone in its bytes
    assert torch.equal(out["layer.0.w"], sd["layer.0.w"] + 1)
    assert torch.equal(out["layer.1.w"], sd["layer.1.w"])


@pytest.mark.parametrize("case", ["OrderedDict", "Parameter", "requires_grad", "view",
                                  "shared", "nested", "attribute", "strides"])
def test_what_a_plain_dict_is_not_goes_through_torch(disk_dir: Path, case: str) -> None:
    base = torch.arange(12.0)
    sd: Any = {"a": torch.ones(3), "b": torch.zeros(2, dtype=torch.int64)}
    if case == "OrderedDict":
        import collections

        sd = collections.OrderedDict(sd)
    elif case == "Parameter":
        sd["p"] = torch.nn.Parameter(torch.ones(2))
    elif case == "requires_grad":
        sd["g"] = torch.ones(2, requires_grad=True)
    elif case == "view":
        sd["v"] = base[2:5]
    elif case == "shared":
        sd["s1"], sd["s2"] = base, base
    elif case == "nested":
        sd = {"model": sd}
    elif case == "strides":  # contiguous, but a size-1 dimension's stride is not torch's own
        sd["t"] = torch.randn(1, 3).t()
        sd["u"] = torch.randn(4, 1, 2)[:, :, :1]
    else:
        t = torch.ones(2)
        t.note = "kept"  # type: ignore[attr-defined]
        sd["t"] = t
    path = disk_dir / "m.pt"
    tensortier.save(sd, path)
    assert _pickle_of(path).count(b"storage") >= 1
    ours, theirs = tensortier.load(path), torch.load(path, weights_only=False)
    sd_flat = sd["model"] if case == "nested" else sd
    assert type(ours) is type(theirs)
    flat_ours = ours["model"] if case == "nested" else ours
    flat_theirs = theirs["model"] if case == "nested" else theirs
    assert list(flat_ours) == list(flat_theirs)
    for k in flat_theirs:
        assert type(flat_ours[k]) is type(flat_theirs[k]), k
        assert torch.equal(flat_ours[k].detach(), flat_theirs[k].detach()), k
        assert flat_ours[k].requires_grad == flat_theirs[k].requires_grad, k
        assert flat_ours[k].stride() == flat_theirs[k].stride() == sd_flat[k].stride(), k
    if case == "shared":
        assert ours["s1"].untyped_storage().data_ptr() == ours["s2"].untyped_storage().data_ptr()
    if case == "attribute":
        assert ours["t"].note == "kept"


def test_small_safetensors_tensors_move_in_few_requests(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sd = {f"t{i}": torch.randn(1 + i % 300) for i in range(3000)}
    sd["big"] = torch.randn(400_000)
    calls: dict[str, int] = {}
    results: dict[str, Any] = {}
    real = _core.read_pieces

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls["read_pieces"] = calls.get("read_pieces", 0) + 1
        results["read_pieces"] = real(*args, **kwargs)
        return results["read_pieces"]

    class Writer(_core.SafetensorsFileWriter):  # type: ignore[misc]
        def write(self, *args: Any) -> None:  # all tensors, gathered by C++ into few writes
            calls["write"] = calls.get("write", 0) + 1
            super().write(*args)

    monkeypatch.setattr(_core, "read_pieces", spy)
    monkeypatch.setattr(_core, "SafetensorsFileWriter", Writer)
    path = disk_dir / "m.safetensors"
    tensortier.save(sd, path, checksum=True)
    out = tensortier.load(path, verify=True)
    assert calls == {"write": 1, "read_pieces": 1}
    # One engine group, for "big": the 3,000 small tensors were gathered into large requests.
    assert len(results["read_pieces"]) == 1, results["read_pieces"]
    theirs = st.load_file(str(path))
    assert list(out) == list(sd)
    assert all(torch.equal(out[k], v) and torch.equal(theirs[k], v) for k, v in sd.items())
    assert all(out[k].untyped_storage().nbytes() == v.nbytes for k, v in sd.items())
    assert tensortier.load(path)["t7"].data_ptr() != out["t7"].data_ptr()


@pytest.mark.parametrize("name", ["m.pt", "m.safetensors"])
def test_many_tensors_set_off_no_garbage_collection(disk_dir: Path, name: str) -> None:
    """Python's cyclic collector is held off while a save or load makes its objects (full
    collections over every object of the process doubled a 20,000-tensor load): at most the
    one young collection it put off runs when each call ends. It is left as it was found."""
    import gc

    sd = {f"t{i}": torch.randn(4) for i in range(5000)}
    path = disk_dir / name
    runs: list[str] = []

    def note(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            runs.append(str(info["generation"]))

    gc.collect()
    gc.callbacks.append(note)
    try:
        tensortier.save(sd, path)
        out = tensortier.load(path)
    finally:
        gc.callbacks.remove(note)
    assert runs in ([], ["0"], ["0", "0"]) and gc.isenabled(), runs
    assert all(torch.equal(out[k], v) for k, v in sd.items())
    gc.disable()
    try:
        tensortier.load(path)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_dict_holding_a_nested_tensor_goes_through_torch(disk_dir: Path) -> None:
    # A nested tensor is a torch.Tensor with a strided layout but no sizes to ask: the plain-dict
    # check must leave it to torch's pickler rather than fail on it.
    nested = torch.nested.nested_tensor([torch.arange(3.0), torch.arange(5.0)])
    sd = {"a": torch.ones(3), "n": nested}
    path = disk_dir / "nested.pt"
    tensortier.save(sd, path)
    theirs = torch.load(path, weights_only=True)
    ours = tensortier.load(path)
    assert torch.equal(ours["a"], sd["a"]) and torch.equal(theirs["a"], sd["a"])
    for got in (ours["n"], theirs["n"]):
        assert got.is_nested
        assert all(torch.equal(x, y) for x, y in zip(got.unbind(), nested.unbind()))
