"""File names that are not UTF-8: every entry point that takes a path takes it as a str with
surrogate escapes (os.fsdecode), as bytes and as an os.PathLike, and paths given back (file
lists, OSError.filename) are str that os.fsencode turns back into the exact bytes."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

import tensortier
from tensortier.compat import gds, tensornvme
from tensortier.compat.deepnvme import AsyncIOBuilder
from tensortier.data import FileReader

NAME = b"w\xff\xe9-\xed\xb3\xbf"  # Latin-1 bytes and the UTF-8 form of a surrogate: not UTF-8


def _forms(path: bytes) -> list[Any]:
    """`path` as a str with surrogate escapes, as bytes and as a pathlib.Path."""
    return [os.fsdecode(path), path, Path(os.fsdecode(path))]


FORMS = ["str", "bytes", "PathLike"]


@pytest.fixture
def base(disk_dir: Path) -> bytes:
    """A scratch folder whose own name is not UTF-8 either."""
    d = os.path.join(os.fsencode(disk_dir), b"dir\xfe")
    os.mkdir(d)
    return d


@pytest.mark.parametrize("form", range(3), ids=FORMS)
@pytest.mark.parametrize("suffix", [b".safetensors", b".pt"])
def test_save_and_load_round_trip(base: bytes, form: int, suffix: bytes) -> None:
    sd = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3, 5, dtype=torch.int8)}
    target = os.path.join(base, NAME + suffix)
    path = _forms(target)[form]
    tensortier.save(sd, path, checksum=True)
    assert os.path.exists(target)
    assert sorted(os.listdir(base)) == [NAME + suffix]  # no temporary file left, right name
    for loaded in (tensortier.load(path, verify=True), tensortier.load(path, mmap=True)):
        assert loaded.keys() == sd.keys()
        assert all(torch.equal(loaded[k], sd[k]) for k in sd)
    dst = {k: torch.zeros_like(v) for k, v in sd.items()}
    tensortier.load_into(dst, path)
    assert all(torch.equal(dst[k], sd[k]) for k in sd)
    # Readable by the ecosystem's own loaders too.
    if suffix == b".pt":
        torch_loaded = torch.load(os.fsdecode(target), weights_only=True)
        assert torch.equal(torch_loaded["a"], sd["a"])
    # Saving over it again (the replaced file's name is not UTF-8 either).
    tensortier.save(sd, path, format="safetensors" if suffix == b".safetensors" else "torch")
    assert sorted(os.listdir(base)) == [NAME + suffix]


def test_errors_name_the_file_as_a_str_that_round_trips(base: bytes) -> None:
    missing = os.path.join(base, NAME + b".safetensors")
    for path in _forms(missing):
        with pytest.raises(FileNotFoundError) as e:
            tensortier.load(path)
        assert isinstance(e.value.filename, str)
        assert os.fsencode(e.value.filename) == missing
        # Shown as Python shows its own OSError's: "[Errno 2] ...: 'name'", once.
        assert str(e.value).endswith(f": {os.fsdecode(missing)!r}"), str(e.value)
        assert str(e.value).count(os.fsdecode(missing)[-8:]) == 1, str(e.value)
    with pytest.raises(FileNotFoundError) as e:
        tensortier.IOHandle().open(missing)
    assert os.fsencode(e.value.filename) == missing
    bad = os.path.join(base, NAME + b".pt")
    with open(bad, "wb") as f:
        f.write(b"not a zip file at all")
    with pytest.raises(ValueError) as v:
        tensortier.load(bad)
    assert os.fsdecode(bad) in str(v.value)


def test_what_is_not_a_path_is_a_type_error_naming_the_accepted_types(base: bytes) -> None:
    with pytest.raises(TypeError, match="str, bytes or os.PathLike"):
        tensortier.save({"a": torch.ones(1)}, 3.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="str, bytes or os.PathLike"):
        tensortier.IOHandle().open(7)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="file_root must be str, bytes or os.PathLike"):
        FileReader(file_root=1.0)  # type: ignore[arg-type]
    # A surrogate os.fsencode cannot encode, and a NUL, are refused as open() refuses them.
    with pytest.raises(UnicodeEncodeError):
        tensortier.IOHandle().open(os.fsdecode(base) + "/\ud800")
    with pytest.raises(ValueError, match="null"):
        tensortier.IOHandle().open(os.fsdecode(base) + "/a\0b")


@pytest.mark.parametrize("form", range(3), ids=FORMS)
def test_iohandle(base: bytes, form: int) -> None:
    path = _forms(os.path.join(base, NAME))[form]
    data = np.arange(10000, dtype=np.uint8)
    with tensortier.IOHandle() as io:
        assert io.pwrite(data, path, 3) == data.size
        f = io.open(path)
        try:
            assert isinstance(f.path, str) and os.fsencode(f.path) == os.path.join(base, NAME)
            out = np.zeros(data.size, np.uint8)
            assert io.pread(out, f, 3) == data.size
        finally:
            f.close()
    assert np.array_equal(out, data)


@pytest.mark.parametrize("form", range(3), ids=FORMS)
def test_disk_offloader(base: bytes, form: int) -> None:
    d = _forms(os.path.join(base, NAME))[form]
    t = torch.arange(5000, dtype=torch.int64)
    with tensortier.DiskOffloader(d) as off:
        off.sync_write(t)
        assert t.untyped_storage().size() == 0
        off.sync_read(t)
    assert torch.equal(t, torch.arange(5000, dtype=torch.int64))
    assert os.path.isdir(os.path.join(base, NAME))
    assert tensortier.offload.remove_stale_files(d) == 0


def test_compat_modules(base: bytes) -> None:
    target = os.path.join(base, NAME)
    # TensorNVMe joins its folder with a str name: bytes are its TypeError; str works.
    with pytest.raises(TypeError, match="dir_name must be str or os.PathLike, not bytes"):
        tensornvme.DiskOffloader(target)
    off = tensornvme.DiskOffloader(os.fsdecode(target))
    t = torch.arange(100, dtype=torch.float32)
    off.sync_write(t)
    off.sync_read(t)
    assert torch.equal(t, torch.arange(100, dtype=torch.float32))
    # DeepNVMe's aio_handle takes str and bytes file names (pybind11's char*).
    h = AsyncIOBuilder().load().aio_handle(1 << 20, 16, True, True, 1)
    src = torch.arange(4096, dtype=torch.uint8)
    for path in (os.fsdecode(target + b".a"), target + b".b"):
        assert h.sync_pwrite(src, path) == 1
        got = torch.zeros_like(src)
        assert h.sync_pread(got, path) == 1
        assert torch.equal(got, src)
    # torch.cuda.gds.GdsFile opens with os.open: str, bytes and PathLike, kept as given.
    for path in _forms(target + b".g"):
        with gds.GdsFile(path, os.O_CREAT | os.O_RDWR) as f:
            assert f.filename == path if not isinstance(path, Path) else f.filename == str(path)
            s = torch.arange(64, dtype=torch.uint8)
            f.save_storage(s.untyped_storage(), 0)
            back = torch.zeros(64, dtype=torch.uint8)
            f.load_storage(back.untyped_storage(), 0)
            assert torch.equal(back, s)


def _tree(root: bytes) -> dict[bytes, tuple[bytes, int]]:
    """Two classes, one of them named by bytes that are not UTF-8: full path -> (bytes, label)."""
    out = {}
    for label, cls in enumerate((b"a\xff", b"b")):
        os.makedirs(os.path.join(root, cls))
        for i, name in enumerate((b"x\xe9.jpg", b"y.jpg", NAME + b".jpg")):
            path = os.path.join(root, cls, name)
            data = bytes([label * 16 + i]) * (100 * (i + 1) + label)
            with open(path, "wb") as f:
                f.write(data)
            out[path] = (data, label)
    return out


def _read_all(reader: FileReader) -> dict[bytes, tuple[bytes, int]]:
    got = {}
    for samples, labels in reader:
        for i, (s, label) in enumerate(zip(samples, labels.tolist())):
            got[len(got)] = (s.numpy().tobytes(), label)
    paths = [os.fsencode(p) for p in reader.files]
    assert all(isinstance(p, str) for p in reader.files)
    return {paths[i]: got[i] for i in range(len(paths))}


@pytest.mark.parametrize("form", range(3), ids=FORMS)
def test_file_reader(base: bytes, form: int) -> None:
    tree = _tree(base)
    reader = FileReader(file_root=_forms(base)[form], batch_size=4, shuffle=False)
    assert _read_all(reader) == tree
    listed = sorted(tree)
    reader = FileReader(files=[_forms(p)[form] for p in listed], labels=[7] * len(listed),
                        batch_size=16, shuffle=False)
    assert _read_all(reader) == {p: (tree[p][0], 7) for p in listed}
    # A DALI file list ('path label' per line) holding names relative to file_root.
    file_list = os.path.join(base, b"list\xfd.txt")
    with open(file_list, "wb") as f:
        for p in listed:
            f.write(os.path.relpath(p, base) + b" %d\n" % tree[p][1])
    reader = FileReader(file_root=_forms(base)[form], file_list=_forms(file_list)[form],
                        batch_size=3, shuffle=False)
    assert _read_all(reader) == tree


def test_file_reader_errors_name_the_file(base: bytes) -> None:
    missing = os.path.join(base, NAME + b".jpg")
    with pytest.raises(FileNotFoundError) as e:
        FileReader(files=[missing], batch_size=1)
    assert os.fsencode(e.value.filename) == missing


@pytest.mark.parametrize("call", [tensortier.probe_backends,
                                  lambda d: tensortier.IOHandle(probe_dir=d).close()])
def test_directories_for_probes(base: bytes, call: Callable[[Any], Any]) -> None:
    d = os.path.join(base, NAME)
    os.mkdir(d)
    for form in _forms(d):
        call(form)
    with pytest.raises(FileNotFoundError) as e:
        tensortier.IOHandle(probe_dir=d + b"-missing")
    assert e.value.errno == errno.ENOENT


@pytest.mark.parametrize("form", range(3), ids=FORMS)
def test_shared_tensor_files(base: bytes, form: int) -> None:
    import torch.distributed

    from tensortier import shared

    values = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    checkpoint = os.path.join(base, NAME + b".pt")
    tensortier.save({"w": values}, checkpoint)
    store = torch.distributed.HashStore()
    with shared.Group(rank=0, world_size=1, store=store, timeout=5) as group:
        t = group.create_tensor((6, 4), torch.float32, layout="chunked", name="w")
        t.load_checkpoint(_forms(checkpoint)[form], "w")
        assert torch.equal(t.gather(list(range(6))), values)
        names = t.store_files(_forms(os.path.join(base, NAME))[form])
        assert [os.fsencode(n) for n in names] == [os.path.join(base, NAME) + b"_part_0_of_1"]
        assert all(isinstance(n, str) for n in names)
        u = group.create_tensor((6, 4), torch.float32, layout="chunked", name="u")
        u.load_files([_forms(os.fsencode(n))[form] for n in names])
        assert torch.equal(u.gather(list(range(6))), values)


def test_shard_index_in_a_folder_that_is_not_utf8(base: bytes) -> None:
    import json

    parts = {"a.safetensors": {"a": torch.ones(3)}, "b.safetensors": {"b": torch.zeros(2, 2)}}
    for name, sd in parts.items():
        tensortier.save(sd, os.path.join(base, name.encode()))
    index = os.path.join(base, NAME + b".safetensors.index.json")
    with open(index, "w") as f:
        json.dump({"weight_map": {"a": "a.safetensors", "b": "b.safetensors"}}, f)
    for path in _forms(index):
        loaded = tensortier.load(path)
        assert torch.equal(loaded["a"], torch.ones(3)) and torch.equal(loaded["b"], torch.zeros(2, 2))


def test_shard_index_naming_shards_that_are_not_utf8(base: bytes) -> None:
    import json

    # Written as extent maps write names: json.dumps(os.fsdecode(name)) gives \udcXX escapes.
    parts = {NAME + b"-1.safetensors": {"a": torch.ones(3)},
             b"sub\xfe/" + NAME + b"-2.pt": {"b": torch.zeros(2, 2)}}
    os.mkdir(os.path.join(base, b"sub\xfe"))
    for name, sd in parts.items():
        tensortier.save(sd, os.path.join(base, name))
    weight_map = dict(zip("ab", (os.fsdecode(n) for n in parts)))
    index = os.path.join(base, b"model.safetensors.index.json")
    with open(index, "w") as f:
        json.dump({"weight_map": weight_map}, f)
    assert "\\udcff" in open(index).read()
    for path in _forms(index):
        loaded = tensortier.load(path)
        assert torch.equal(loaded["a"], torch.ones(3))
        assert torch.equal(loaded["b"], torch.zeros(2, 2))
        out = {"a": torch.empty(3), "b": torch.empty(2, 2)}
        tensortier.load_into(out, path)
        assert torch.equal(out["b"], torch.zeros(2, 2))
    # The CLI reads the index by the same rule.
    from test_cli_convert import BIN, run

    if BIN.is_file():
        r = run("info", os.fsdecode(index))
        assert r.returncode == 0 and "(2 shards, 2 tensors)" in r.stdout, r.stderr
