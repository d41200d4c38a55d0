"""`tensortier convert` both ways, checked with the ecosystem's own readers: torch.load
(weights_only=True, with and without mmap), safetensors.torch.load_file, Python's zipfile, and
`tensortier verify` on the result."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

BIN = Path(os.environ.get("TENSORTIER_CLI", Path(sys.executable).parent / "tensortier"))
if not BIN.is_file():
    pytest.skip(f"no tensortier binary at {BIN}", allow_module_level=True)

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")


def run(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN), *map(str, args)], capture_output=True, text=True, timeout=300
    )


def convert(src: Path, dst: Path) -> None:
    r = run("convert", src, dst)
    assert r.returncode == 0, r.stderr
    r = run("verify", dst)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK" in r.stdout
    r = run("info", dst)
    assert r.returncode == 0, r.stderr


def raw(t: "torch.Tensor") -> "torch.Tensor":
    return t.reshape(-1).view(torch.uint8)


def assert_same(got: dict, want: dict) -> None:
    assert type(got) is dict or isinstance(got, dict)
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        g = got[name]
        assert isinstance(g, torch.Tensor), name
        assert g.dtype == w.dtype, name
        assert g.shape == w.shape, name
        assert g.is_contiguous(), name
        assert torch.equal(raw(g), raw(w)), name  # bytes: NaN patterns included


def random_tensors() -> dict:
    """One tensor per dtype safetensors.torch can save, with arbitrary bit patterns, plus a 0-d,
    zero-element and high-rank ones."""
    g = torch.Generator().manual_seed(0)
    names = ["float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8",
             "uint8", "bool", "complex64", "uint16", "uint32", "uint64", "float8_e4m3fn",
             "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"]
    out = {}
    for i, name in enumerate(names):
        dtype = getattr(torch, name, None)
        if dtype is None:
            continue
        shape = (3, i + 1)
        size = torch.empty((), dtype=dtype).element_size()
        if dtype == torch.bool:
            t = torch.randint(0, 2, shape, generator=g).to(torch.bool)
        else:
            t = torch.randint(0, 256, (3 * (i + 1) * size,), dtype=torch.uint8, generator=g)
            t = t.view(dtype).reshape(shape)
        out[f"t.{name}"] = t
    out["scalar"] = torch.tensor(2.5, dtype=torch.float64)
    out["empty"] = torch.zeros(0, 7, dtype=torch.bfloat16)
    out["rank5"] = torch.randn(2, 1, 3, 1, 2, generator=g)
    out["big"] = torch.randn(300, 1000, generator=g)  # several chunks of the writer
    return out


def data_offsets(path: Path) -> dict[str, int]:
    """Each zip record's data offset, from its local header."""
    out = {}
    with open(path, "rb") as f, zipfile.ZipFile(f) as z:
        for info in z.infolist():
            f.seek(info.header_offset)
            local = f.read(30)
            assert local[:4] == b"PK\x03\x04"
            n, x = struct.unpack("<HH", local[26:30])
            out[info.filename] = info.header_offset + 30 + n + x
    return out


@pytest.mark.parametrize("out_name,folder", [("model.pt", "model"), ("w.v2.bin", "w.v2"),
                                             ("noext", "noext"), (".pt", "archive")])
def test_safetensors_to_torch(disk_dir: Path, out_name: str, folder: str) -> None:
    src = disk_dir / "in.safetensors"
    want = random_tensors()
    st.save_file(want, str(src), metadata={"note": "kept out of the torch file"})
    dst = disk_dir / out_name
    convert(src, dst)
    assert sorted(p.name for p in disk_dir.iterdir()) == sorted(["in.safetensors", out_name])

    loaded = st.load_file(str(src))
    assert_same(torch.load(dst, weights_only=True), loaded)
    assert_same(torch.load(dst, weights_only=True, mmap=True), loaded)
    assert list(torch.load(dst, weights_only=True)) == list(loaded)  # same order
    # torch computes offsets itself only for files with .format_version (we write none): the
    # records' real offsets are used even when asked to calculate them.
    from torch.utils.serialization import config

    with config.patch({"load.calculate_storage_offsets": True}):
        assert_same(torch.load(dst, weights_only=True, mmap=True), loaded)

    r = subprocess.run([sys.executable, "-m", "zipfile", "-t", str(dst)],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "Done testing" in r.stdout, r.stdout + r.stderr
    with zipfile.ZipFile(dst) as z:
        assert z.testzip() is None  # every CRC-32 recorded and right
        names = z.namelist()
        assert all(info.compress_type == zipfile.ZIP_STORED for info in z.infolist())
        assert z.read(f"{folder}/byteorder") == b"little"
        assert z.read(f"{folder}/version") == b"3\n"
        assert len(z.read(f"{folder}/.data/serialization_id")) == 40
    storages = [n for n in names if n.startswith(f"{folder}/data/")]
    assert names[0] == f"{folder}/data.pkl"
    assert storages == [f"{folder}/data/{i}" for i in range(len(want))]
    offsets = data_offsets(dst)
    assert all(offsets[n] % 4096 == 0 for n in storages)


def test_torch_to_safetensors_and_back(disk_dir: Path) -> None:
    want = random_tensors()
    pt = disk_dir / "ckpt.pt"
    torch.save(want, pt)
    sf = disk_dir / "ckpt.safetensors"
    convert(pt, sf)
    assert_same(st.load_file(str(sf)), want)
    r = subprocess.run([sys.executable, "-c",
                        "import sys, safetensors; safetensors.safe_open(sys.argv[1], 'pt')",
                        str(sf)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr

    back = disk_dir / "back.pt"
    convert(sf, back)
    assert_same(torch.load(back, weights_only=True), want)
    # Same pickle as torch.save writes for the dict torch.load gives back.
    again = disk_dir / "back2.pt"
    torch.save(torch.load(back, weights_only=True), again)
    with zipfile.ZipFile(back) as a, zipfile.ZipFile(again) as b:
        assert a.read("back/data.pkl") == b.read("back2/data.pkl")


def tensor_ranges(path: Path) -> dict[str, list[int]]:
    """Each tensor's [begin, end) in a safetensors file's data section, from its header."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    return {k: v["data_offsets"] for k, v in header.items() if k != "__metadata__"}


def test_convert_lays_out_tensors_as_tensortier_save_does(disk_dir: Path) -> None:
    """One layout rule for every safetensors writer: tensors whose size is a multiple of 4 KiB
    first (each then starts on a 4 KiB boundary), the rest after them, widest elements first."""
    import tensortier

    sd = {
        "f16": torch.ones(3, dtype=torch.float16),
        "page": torch.ones(1024),
        "i8": torch.ones(5, dtype=torch.int8),
        "f64": torch.ones(3, dtype=torch.float64),
        "two_pages": torch.ones(2048),
    }
    pt = disk_dir / "m.pt"
    torch.save(sd, pt)
    converted = disk_dir / "converted.safetensors"
    convert(pt, converted)
    saved = disk_dir / "saved.safetensors"
    tensortier.save(sd, saved, checksum=True)
    assert tensor_ranges(converted) == tensor_ranges(saved) == {
        "page": [0, 4096],
        "two_pages": [4096, 12288],
        "f64": [12288, 12312],
        "f16": [12312, 12318],
        "i8": [12318, 12323],
    }
    assert_same(st.load_file(str(converted)), sd)


def test_empty_safetensors_file(disk_dir: Path) -> None:
    src = disk_dir / "none.safetensors"
    st.save_file({}, str(src))
    dst = disk_dir / "none.pt"
    convert(src, dst)
    assert torch.load(dst, weights_only=True) == {}


def write_safetensors(path: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


@pytest.mark.parametrize("dtype", ["F4", "F6_E2M3", "F6_E3M2"])
def test_refuses_dtypes_torch_cannot_hold(disk_dir: Path, dtype: str) -> None:
    """F6 torch has no dtype for; F4 it holds two values a byte (float4_e2m1fn_x2), so an odd
    last dimension cannot be held."""
    src = disk_dir / "packed.safetensors"
    shape = [2, 3] if dtype == "F4" else [4]
    write_safetensors(src, {
        "ok": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
        "packed.weight": {"dtype": dtype, "shape": shape, "data_offsets": [4, 4 + 3]},
    }, bytes(4 + 3))
    dst = disk_dir / "out.pt"
    dst.write_bytes(b"an existing checkpoint")
    r = run("convert", src, dst)
    assert r.returncode != 0
    assert "packed.weight" in r.stderr and dtype in r.stderr, r.stderr
    assert dst.read_bytes() == b"an existing checkpoint"  # untouched, no temporary left behind
    assert sorted(p.name for p in disk_dir.iterdir()) == ["out.pt", "packed.safetensors"]


def test_float8_e8m0_through_both_directions(disk_dir: Path) -> None:
    # safetensors.torch has no F8_E8M0 yet; torch has float8_e8m0fnu: torch -> safetensors -> torch.
    dtype = getattr(torch, "float8_e8m0fnu", None)
    if dtype is None:
        pytest.skip("this torch has no float8_e8m0fnu")
    want = {"scales": torch.arange(16, dtype=torch.uint8).view(dtype).reshape(4, 4)}
    pt = disk_dir / "scales.pt"
    torch.save(want, pt)
    sf = disk_dir / "scales.safetensors"
    convert(pt, sf)
    back = disk_dir / "back.pt"
    convert(sf, back)
    assert_same(torch.load(back, weights_only=True), want)


def test_float4_through_both_directions(disk_dir: Path) -> None:
    """torch's float4_e2m1fn_x2 (a byte of two values) is safetensors' F4 with the last
    dimension doubled, as tensortier.save writes it."""
    dtype = getattr(torch, "float4_e2m1fn_x2", None)
    if dtype is None:
        pytest.skip("this torch has no float4_e2m1fn_x2")
    packed = torch.arange(24, dtype=torch.uint8).view(dtype).reshape(2, 3, 4)
    want = {"packed": packed, "other": torch.arange(5, dtype=torch.float32)}
    pt = disk_dir / "f4.pt"
    torch.save(want, pt)
    sf = disk_dir / "f4.safetensors"
    convert(pt, sf)
    text = sf.read_bytes()
    header = json.loads(text[8 : 8 + struct.unpack("<Q", text[:8])[0]])
    assert header["packed"]["dtype"] == "F4" and header["packed"]["shape"] == [2, 3, 8]
    assert_same(st.load_file(str(sf)), want)  # safetensors gives float4_e2m1fn_x2 back
    back = disk_dir / "back.pt"
    convert(sf, back)
    assert_same(torch.load(back, weights_only=True), want)


def test_an_empty_storage_viewed_as_two_dtypes(disk_dir: Path) -> None:
    """torch.save describes such a storage twice, with each dtype (its check that a storage
    keeps one dtype skips empty ones): the tool refused the file."""
    t = torch.empty(0)
    want = {"a": t, "b": t.view(torch.int32), "c": torch.arange(3)}
    pt = disk_dir / "empty.pt"
    torch.save(want, pt)
    r = run("info", pt)
    assert r.returncode == 0, r.stderr
    sf = disk_dir / "empty.safetensors"
    convert(pt, sf)
    assert_same(st.load_file(str(sf)), want)


def test_meta_tensors(disk_dir: Path) -> None:
    """info and verify read meta tensors (dtype and shape, no data); convert refuses them."""
    want = {"m": torch.empty(2, 3, device="meta"),
            "p": torch.nn.Parameter(torch.empty(4, device="meta", dtype=torch.bfloat16)),
            "w": torch.ones(2)}
    pt = disk_dir / "meta.pt"
    torch.save(want, pt)
    r = run("info", pt)
    assert r.returncode == 0, r.stderr
    assert "tensors:   3" in r.stdout and "bytes:     8" in r.stdout, r.stdout
    assert "[2, 3]               meta (no data)" in r.stdout
    r = run("verify", pt)
    assert r.returncode == 0 and "data OK" in r.stdout, r.stdout + r.stderr
    r = run("convert", pt, disk_dir / "meta.safetensors")
    assert r.returncode != 0 and "'m' is a meta tensor (no data)" in r.stderr


@pytest.mark.filterwarnings("ignore::UserWarning")  # quantized tensors' deprecation
def test_quantized_tensors(disk_dir: Path) -> None:
    """info and verify read quantized tensors (their integers: QI8, QU8, QI32); convert says
    safetensors cannot store them; quint4x2/quint2x4 (packed) are refused by name."""
    want = {
        "q": torch.quantize_per_tensor(torch.randn(4), 0.1, 3, torch.qint8),
        "qc": torch.quantize_per_channel(torch.randn(2, 3), torch.tensor([0.1, 0.2]),
                                         torch.tensor([1, 2]), 0, torch.quint8),
        "q32": torch.quantize_per_tensor(torch.randn(5), 0.1, 3, torch.qint32)[1:],
        "scheme": torch.per_tensor_affine,
    }
    pt = disk_dir / "q.pt"
    torch.save(want, pt)
    r = run("info", pt)
    assert r.returncode == 0, r.stderr
    assert "dtypes:    QI32 x1, QI8 x1, QU8 x1" in r.stdout, r.stdout
    assert "1 non-tensor value" in r.stdout
    r = run("verify", pt)
    assert r.returncode == 0 and "data OK" in r.stdout, r.stdout + r.stderr
    r = run("convert", pt, disk_dir / "q.safetensors")
    assert r.returncode != 0
    assert "has dtype QI8 (torch.qint8), which safetensors cannot store" in r.stderr
    packed = disk_dir / "q4.pt"
    torch.save({"q4": torch.quantize_per_tensor(torch.randn(6), 0.1, 3, torch.quint4x2)}, packed)
    r = run("info", packed)
    # Listed as it is read (other objects are values; a storage is data): refused, named.
    assert r.returncode != 0 and "'torch.QUInt4x2Storage' is not a storage type" in r.stderr
    # The packed dtypes as plain values (a config naming them) are read, as torch.load reads them.
    config = disk_dir / "config.pt"
    torch.save({"dtype": torch.quint4x2, "other": torch.quint2x4, "w": torch.ones(3)}, config)
    r = run("info", config)
    assert r.returncode == 0, r.stderr
    assert "2 non-tensor value" in r.stdout, r.stdout
    r = run("verify", config)
    assert r.returncode == 0 and "data OK" in r.stdout, r.stdout + r.stderr


def test_torch_only_dtypes(disk_dir: Path) -> None:
    """complex32 and the bits types: info and verify read them; convert says safetensors has no
    dtype for them and leaves nothing behind."""
    want = {"c32": torch.zeros(24, dtype=torch.uint8).view(torch.complex32).reshape(3, 2)[:, 0]}
    for name in ("bits8", "bits16", "bits1x8", "bits2x4", "bits4x2"):
        dtype = getattr(torch, name, None)
        if dtype is not None:
            want[name] = torch.arange(8, dtype=torch.uint8).view(dtype)
    pt = disk_dir / "torch_only.pt"
    torch.save(want, pt)
    r = run("info", pt)
    assert r.returncode == 0, r.stderr
    assert f"tensors:   {len(want)}" in r.stdout
    assert "C32    [3]" in r.stdout and "BITS16 [4]" in r.stdout, r.stdout
    r = run("verify", pt)
    assert r.returncode == 0 and "data OK" in r.stdout, r.stdout + r.stderr
    r = run("convert", pt, disk_dir / "out.safetensors")
    assert r.returncode != 0
    assert "'c32' has dtype C32 (torch.complex32), which safetensors cannot store" in r.stderr
    assert sorted(p.name for p in disk_dir.iterdir()) == ["torch_only.pt"]


def test_big_endian_torch_file(disk_dir: Path) -> None:
    """A torch.save file written on a big-endian machine: info says so, verify checks it, and
    convert writes the values torch.load gives (typed storages swapped, each complex half on its
    own; untyped ones, as torch.load does, not)."""
    g = torch.Generator().manual_seed(3)
    big = torch.randn(3_000_000, generator=g)  # several 16 MiB chunks
    sd = {"f32": big, "view": big[1000:3000], "i64": torch.arange(-50, 50),
          "bf16": torch.randn(33, generator=g).to(torch.bfloat16),
          "c64": torch.randn(7, generator=g, dtype=torch.complex64)[2:],
          "u16": torch.arange(9, dtype=torch.int32).to(torch.uint16),  # an untyped storage
          "u8": torch.arange(5, dtype=torch.uint8)}
    little = disk_dir / "little.pt"
    torch.save(sd, little)
    src = disk_dir / "big.pt"
    with zipfile.ZipFile(little) as zin, zipfile.ZipFile(src, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            zout.writestr(info.filename, b"big" if info.filename.endswith("byteorder") else data)
    want = torch.load(src, weights_only=True)  # torch's own reading: swapped by storage type
    assert not torch.equal(raw(want["i64"]), raw(sd["i64"]))
    assert torch.equal(raw(want["u16"]), raw(sd["u16"]))
    r = run("info", src)
    assert r.returncode == 0 and ", big-endian)" in r.stdout, r.stdout + r.stderr
    dst = disk_dir / "out.safetensors"
    convert(src, dst)
    assert_same(st.load_file(str(dst)), {k: v.contiguous() for k, v in want.items()})


def test_big_endian_view_across_elements_is_refused(disk_dir: Path) -> None:
    """A float16 view (_rebuild_tensor_v3) starting inside a big-endian float32 storage's
    element: torch.load swaps the storage by its float32 units, which a stream of the view's
    bytes cannot; convert refuses it (it wrote other bytes than torch.load gives)."""
    import collections
    import io
    import pickle

    class Storage:
        def __init__(self) -> None:
            self.pid = ("storage", torch.FloatStorage, "0", "cpu", 4)

    class Rebuild:
        def __reduce__(self) -> tuple:
            args = (Storage(), 1, (3,), (1,), False, collections.OrderedDict(), torch.float16)
            return (torch._utils._rebuild_tensor_v3, args)

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj: object) -> object:
            return obj.pid if isinstance(obj, Storage) else None

    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump({"x": Rebuild()})
    src = disk_dir / "view.pt"
    with zipfile.ZipFile(src, "w") as z:
        z.writestr("archive/data.pkl", buf.getvalue())
        z.writestr("archive/byteorder", b"big")
        z.writestr("archive/data/0", bytes(range(16)))
        z.writestr("archive/version", b"3\n")
    torch.load(src, weights_only=True)  # torch reads it
    assert run("info", src).returncode == 0
    r = run("convert", src, disk_dir / "out.safetensors")
    assert r.returncode != 0
    assert "'x' of F16 views a big-endian F32 storage off its elements' boundaries" in r.stderr
    assert not (disk_dir / "out.safetensors").exists()


FIXTURES = Path(__file__).resolve().parents[1] / "data" / "checkpoint"


def flatten(obj: object, prefix: str = "") -> dict:
    """The tensors of a nested torch.load result by dotted key path, as `tensortier` names them."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    if isinstance(obj, dict):
        items = obj.items()
    else:
        items = enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    out = {}
    for k, v in items:
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


@pytest.mark.parametrize("name", ["state_dict.pt", "train_state.pt"])
def test_state_dict_files(disk_dir: Path, name: str) -> None:
    """torch.save(model.state_dict()) pickles OrderedDict._metadata with a BUILD opcode."""
    src = FIXTURES / name
    want = flatten(torch.load(src, weights_only=True))
    r = run("info", src)
    assert r.returncode == 0, r.stderr
    assert f"tensors:   {len(want)}" in r.stdout
    r = run("verify", src)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "data OK" in r.stdout
    dst = disk_dir / "out.safetensors"
    convert(src, dst)
    assert_same(st.load_file(str(dst)), want)


def test_convert_drops_other_objects_of_a_training_checkpoint(disk_dir: Path) -> None:
    """A training checkpoint with an argparse.Namespace (fairseq's "args"), a dataclass and
    numpy state beside its weights: those are dropped as every non-tensor value is, never
    called, and the tensors converted (as info and verify read the file)."""
    src = disk_dir / "train.pt"
    script = ("import argparse, dataclasses, sys, numpy, torch\n"
              "@dataclasses.dataclass\n"
              "class Config:\n"
              "    lr: float = 0.1\n"
              "torch.save({'model': {'w': torch.arange(6.0).reshape(2, 3)},\n"
              "            'args': argparse.Namespace(lr=0.1, arch='x'), 'cfg': Config(),\n"
              "            'rng': numpy.random.get_state(), 'step': 7}, sys.argv[1])\n")
    subprocess.run([sys.executable, "-c", script, str(src)], check=True, timeout=120)
    dst = disk_dir / "train.safetensors"
    r = run("convert", src, dst)
    assert r.returncode == 0, r.stderr
    assert "non-tensor value" in r.stdout + r.stderr
    assert_same(st.load_file(str(dst)), {"model.w": torch.arange(6.0).reshape(2, 3)})


def test_convert_replaces_a_symlinks_target(disk_dir: Path) -> None:
    """As tensortier.save (and open(path, 'w')): the link stays, its target gets the new file; no
    temporary file is left behind, whether convert succeeds or fails."""
    (disk_dir / "real").mkdir()
    target = disk_dir / "real" / "target.safetensors"
    target.write_bytes(b"old")
    link = disk_dir / "link.safetensors"
    link.symlink_to(Path("real") / "target.safetensors")
    convert(FIXTURES / "state_dict.pt", link)
    assert link.is_symlink()
    want = flatten(torch.load(FIXTURES / "state_dict.pt", weights_only=True))
    assert_same(st.load_file(str(target)), want)
    dangling = disk_dir / "dangling.safetensors"
    dangling.symlink_to(Path("real") / "new.safetensors")
    convert(FIXTURES / "state_dict.pt", dangling)
    assert dangling.is_symlink() and (disk_dir / "real" / "new.safetensors").is_file()
    r = run("convert", FIXTURES / "small.safetensors", disk_dir / "real" / "t.pt" / "x")
    assert r.returncode != 0
    leftovers = [p.name for p in disk_dir.rglob("*tmp*")]
    assert leftovers == []


def test_convert_refuses_to_replace_what_is_not_a_regular_file(disk_dir: Path) -> None:
    """As tensortier.save: the rename would replace a FIFO or device node (as root: /dev/null)."""
    fifo = disk_dir / "fifo.safetensors"
    os.mkfifo(fifo)
    r = run("convert", FIXTURES / "state_dict.pt", fifo)
    assert r.returncode != 0 and "not a regular file" in r.stderr
    assert fifo.is_fifo()
    assert [p.name for p in disk_dir.rglob("*tmp*")] == []


def test_convert_past_the_file_size_limit_fails_and_cleans_up(disk_dir: Path) -> None:
    """Under `ulimit -f` the write fails with EFBIG: the tool reports it and removes its
    temporary file instead of being killed by SIGXFSZ (which a shell reports as status 153)."""
    import resource

    src = disk_dir / "big.pt"
    torch.save({"w": torch.randn(1 << 18)}, src)  # 1 MiB

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, 256 << 10))

    dst = disk_dir / "big.safetensors"
    r = subprocess.run([str(BIN), "convert", str(src), str(dst)], capture_output=True, text=True,
                       timeout=300, preexec_fn=limit)  # the child's SIGXFSZ is the default one
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "File too large" in r.stderr and dst.name in r.stderr, r.stderr
    assert sorted(p.name for p in disk_dir.iterdir()) == ["big.pt"]


@pytest.mark.skipif(os.geteuid() != 0, reason="only root may replace a read-only file")
def test_convert_keeps_a_read_only_targets_mode(disk_dir: Path) -> None:
    dst = disk_dir / "ro.safetensors"
    convert(FIXTURES / "state_dict.pt", dst)
    os.chmod(dst, 0o444)
    convert(FIXTURES / "small.safetensors", disk_dir / "small.pt")
    convert(disk_dir / "small.pt", dst)
    assert (os.stat(dst).st_mode & 0o777) == 0o444
    assert sorted(st.load_file(str(dst))) == sorted(st.load_file(str(FIXTURES / "small.safetensors")))


def test_convert_refuses_conjugate_and_negative_views(disk_dir: Path) -> None:
    """torch.save stores a conjugate (or negative) view's storage as it is, with a flag torch.load
    applies; safetensors has no such flag, so copying the bytes would change the values."""
    x = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    for name, view in (("conj", x.conj()), ("neg", x.conj().imag)):
        src = disk_dir / f"{name}.pt"
        torch.save({"c": view, "plain": torch.ones(2)}, src)
        r = run("convert", src, disk_dir / f"{name}.safetensors")
        assert r.returncode != 0
        assert ("conjugate" if name == "conj" else "negative") in r.stderr, r.stderr
        assert not (disk_dir / f"{name}.safetensors").exists()


def test_info_and_verify_read_python_complex_values(disk_dir: Path) -> None:
    """torch.load(weights_only=True) takes Python complex numbers among the values; so do we."""
    src = disk_dir / "cplx.pt"
    torch.save({"c": 1 + 2j, "w": torch.ones(2), "l": [complex(0, 1)]}, src)
    r = run("info", src)
    assert r.returncode == 0, r.stderr
    assert "2 non-tensor values" in r.stdout
    r = run("verify", src)
    assert r.returncode == 0, r.stdout + r.stderr


def test_info_verify_and_convert_read_tensor_attributes_counters_and_layouts(
    disk_dir: Path,
) -> None:
    """What torch.load(weights_only=True) and tensortier.load read, and tensortier.save writes:
    tensors and Parameters with Python attributes (pickled through _rebuild_from_type_v2),
    collections.Counter, torch.strided (the C++ reader refused all three)."""
    import collections

    import tensortier

    t = torch.arange(6, dtype=torch.float32)
    t.note = "x"  # type: ignore[attr-defined]
    p = torch.nn.Parameter(torch.ones(3))
    p.tag = 3  # type: ignore[attr-defined]
    sd = {"w": t, "p": p, "c": collections.Counter(a=1), "layout": torch.strided}
    for name, save in (("torch", torch.save), ("ours", tensortier.save)):
        src = disk_dir / f"{name}.pt"
        save(sd, src)
        r = run("info", src)
        assert r.returncode == 0, r.stderr
        assert "tensors:   2" in r.stdout and "F32    [6]" in r.stdout, r.stdout
        r = run("verify", src)
        assert r.returncode == 0, r.stdout + r.stderr
        out = disk_dir / f"{name}.safetensors"
        r = run("convert", src, out)
        assert r.returncode == 0, r.stderr
        back = tensortier.load(out)
        assert torch.equal(back["w"], t) and torch.equal(back["p"], p.detach())


def test_convert_refuses_to_replace_its_input(disk_dir: Path) -> None:
    src = disk_dir / "m.pt"
    torch.save({"w": torch.ones(3)}, src)
    before = src.read_bytes()
    for out in (src, disk_dir / "link.pt"):
        if out != src:
            out.symlink_to(src.name)
        r = run("convert", src, out)
        assert r.returncode == 1 and "is the input file" in r.stderr, r.stderr
    assert src.read_bytes() == before


@pytest.mark.parametrize("src_name, out_name", [
    ("m.pt", "out.bin"), ("m.pt", "out.pth"), ("m.safetensors", "out.safetensors"),
    ("m.safetensors", "out.st"),
    # Suffixes in any case, as tensortier.save reads them.
    ("m.pt", "out.PT"), ("m.pt", "out.Bin"), ("m.safetensors", "out.SafeTensors"),
    ("m.safetensors", "out.ST"),
    # A temporary name's suffix after the format's, as tensortier.save reads it.
    ("m.pt", "out.pt.tmp"), ("m.safetensors", "out.safetensors.partial"),
])
def test_convert_refuses_an_output_suffix_of_the_other_format(
    disk_dir: Path, src_name: str, out_name: str
) -> None:
    """convert writes the other format than its input's: an output named for the input's
    format would hold a file its readers reject (torch.load of a .bin holding safetensors)."""
    src = disk_dir / src_name
    if src_name.endswith(".pt"):
        torch.save({"w": torch.ones(3)}, src)
    else:
        st.save_file({"w": torch.ones(3)}, str(src))
    r = run("convert", src, disk_dir / out_name)
    assert r.returncode == 1 and "by its suffix" in r.stderr, r.stderr
    assert not (disk_dir / out_name).exists()
    other = "out.safetensors" if src_name.endswith(".pt") else "out.pt"
    convert(src, disk_dir / other)  # the right suffix, or none, still converts
    convert(src, disk_dir / other.upper())
    convert(src, disk_dir / (other + ".tmp"))
    convert(src, disk_dir / "out")


def test_info_refuses_a_shard_that_lacks_a_tensor_its_index_puts_there(disk_dir: Path) -> None:
    """As tensortier.load: the index names a tensor its shard does not hold."""
    import tensortier

    tensortier.save({"a": torch.ones(2)}, disk_dir / "s1.safetensors")
    index = disk_dir / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"}}))
    with pytest.raises(ValueError, match="lacks"):
        tensortier.load(index)
    r = run("info", index)
    assert r.returncode == 1, r.stderr
    assert "puts tensor 'b' in this file, which lacks it" in r.stderr, r.stderr


def test_info_refuses_a_zip_entry_whose_sizes_disagree(disk_dir: Path) -> None:
    """As tensortier.load: a stored record the tensors do not use (the pickle format version)
    whose central directory entry gives two sizes is a damaged archive."""
    import tensortier

    path = disk_dir / "m.pt"
    torch.save({"w": torch.ones(3)}, path)
    raw = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        name = next(i for i in z.infolist() if i.filename.endswith("/.format_version")).filename
    entry, at = -1, 0
    while entry < 0:  # the central directory entry naming it
        at = raw.index(b"PK\x01\x02", at) + 4
        if raw[at + 42 : at + 42 + len(name)] == name.encode():
            entry = at - 4
    (size,) = struct.unpack_from("<I", raw, entry + 20)
    struct.pack_into("<I", raw, entry + 20, size + 1)  # compressed size, not the data's
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="damaged"):
        tensortier.load(path)
    r = run("info", path)
    assert r.returncode == 1 and "damaged" in r.stderr, r.stderr


def test_verify_fails_when_there_is_nothing_to_verify(disk_dir: Path) -> None:
    """As load(verify=True): a file without checksums is not verified, which is not a pass."""
    import tensortier

    plain = disk_dir / "plain.safetensors"
    tensortier.save({"w": torch.ones(3)}, plain)
    r = run("verify", plain)
    assert r.returncode == 1 and "no checksums" in r.stderr, r.stdout + r.stderr
    assert "structure OK" in r.stdout
    nocrc = disk_dir / "nocrc.pt"
    torch.serialization.set_crc32_options(False)
    try:
        torch.save({"w": torch.ones(3)}, nocrc)
    finally:
        torch.serialization.set_crc32_options(True)
    r = run("verify", nocrc)
    assert r.returncode == 1 and "no CRC-32" in r.stderr and "(1 problem)" in r.stderr, r.stderr


def test_info_and_verify_take_a_shard_index(disk_dir: Path) -> None:
    import tensortier

    shards = disk_dir / "model"
    shards.mkdir()
    tensortier.save({"a": torch.ones(3)}, shards / "m1.safetensors", checksum=True)
    tensortier.save({"b": torch.ones(5), "c": torch.ones(1)}, shards / "m2.safetensors",
                    checksum=True)
    index = shards / "model.safetensors.index.json"
    weight_map = {"a": "m1.safetensors", "b": "m2.safetensors", "c": "m2.safetensors"}
    index.write_text(json.dumps({"metadata": {"total_size": 36}, "weight_map": weight_map}))
    r = run("info", index)
    assert r.returncode == 0, r.stderr
    assert "(2 shards, 3 tensors)" in r.stdout and r.stdout.count("file:") == 2, r.stdout
    r = run("verify", index)
    assert r.returncode == 0 and "all 2 shards OK" in r.stdout, r.stdout + r.stderr
    # A tensor the index places in a shard that lacks it; a damaged shard; a missing one.
    index.write_text(json.dumps({"weight_map": {**weight_map, "d": "m1.safetensors"}}))
    r = run("verify", index)
    assert r.returncode == 1 and "tensor 'd'" in r.stderr, r.stderr
    data = bytearray((shards / "m2.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (shards / "m2.safetensors").write_bytes(bytes(data))
    index.write_text(json.dumps({"weight_map": {**weight_map, "e": "gone.safetensors"}}))
    r = run("verify", index)
    assert r.returncode == 1 and "(2 of 3 shards)" in r.stderr, r.stderr
    assert "m1.safetensors: data OK" in r.stdout and "gone.safetensors" in r.stderr
    index.write_text(json.dumps({"weight_map": {"a": "../m1.safetensors"}}))
    r = run("info", index)
    assert r.returncode == 1 and "outside the index's directory" in r.stderr, r.stderr
    r = run("convert", index, disk_dir / "x.pt")
    assert r.returncode == 1 and "shard index" in r.stderr, r.stderr
    # A malformed shard does not stop the others being checked; duplicates and an empty map
    # are refused.
    index.write_text(json.dumps({"weight_map": weight_map}))
    (shards / "m1.safetensors").write_bytes(b"\x10\x00\x00")
    r = run("verify", index)
    assert r.returncode == 1 and "(2 of 2 shards)" in r.stderr, r.stdout + r.stderr
    assert "m2.safetensors: structure OK" in r.stdout
    for text, says in (('{"weight_map": {"a": "m1.safetensors", "a": "m2.safetensors"}}',
                        "listed twice"),
                       ('{"weight_map": {"a": "m1.safetensors"}, "weight_map": {}}',
                        "two 'weight_map'"),
                       ('{"weight_map": {}}', "naming no tensors")):
        index.write_text(text)
        r = run("verify", index)
        assert r.returncode == 1 and says in r.stderr, r.stderr


def test_info_and_verify_note_tensors_a_shard_holds_and_its_index_leaves_out(
    disk_dir: Path,
) -> None:
    """tensortier.load leaves such tensors out while from_pretrained loads them: a note, not a
    failure; a file the index names under two spellings is one file."""
    import tensortier

    tensortier.save({"a": torch.ones(3), "b": torch.ones(2), "c": torch.ones(1)},
                    disk_dir / "m1.safetensors", checksum=True)
    index = disk_dir / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "m1.safetensors",
                                                "b": "./m1.safetensors"}}))
    for command in ("info", "verify"):
        r = run(command, index)
        assert r.returncode == 0, r.stdout + r.stderr
        assert r.stderr.count("note:") == 1 and "holds 1 tensor that the index" in r.stderr
        assert "(c): tensortier.load leaves them out" in r.stderr, r.stderr
    index.write_text(json.dumps({"weight_map": {"a": "m1.safetensors", "b": "m1.safetensors",
                                                "c": "m1.safetensors"}}))
    r = run("verify", index)
    assert r.returncode == 0 and "note:" not in r.stderr, r.stderr


def test_info_and_verify_note_shard_files_beside_the_index_it_does_not_name(
    disk_dir: Path,
) -> None:
    """A shard an earlier save with more shards left (model-00003-of-00003 beside an index of
    two) is read by neither tensortier.load nor from_pretrained: a note naming it, not a
    failure. Another variant's shards, a folder named like a shard and a shard the index names
    under another spelling are not noted."""
    import tensortier

    for name, value in (("model-00001-of-00002", 1.0), ("model-00002-of-00002", 2.0),
                        ("model-00003-of-00003", 3.0), ("model.fp16-00001-of-00001", 4.0)):
        tensortier.save({f"w{value:g}": torch.full((3,), value)}, disk_dir / f"{name}.safetensors",
                        checksum=True)
    (disk_dir / "model-00009-of-00009.safetensors.d").mkdir()
    (disk_dir / "model-x-of-00002.safetensors").write_bytes(b"")
    (disk_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "w1": "model-00001-of-00002.safetensors", "w2": "./model-00002-of-00002.safetensors"}}))
    (disk_dir / "model.safetensors.index.fp16.json").write_text(json.dumps({"weight_map": {
        "w4": "model.fp16-00001-of-00001.safetensors"}}))
    for command in ("info", "verify"):
        r = run(command, disk_dir)
        assert r.returncode == 0, r.stdout + r.stderr
        assert r.stderr.count("note:") == 1, r.stderr
        assert (f"{disk_dir}/model-00003-of-00003.safetensors is a shard file beside the index "
                f"{disk_dir}/model.safetensors.index.json, which names none of its tensors: "
                "neither tensortier.load nor transformers' from_pretrained reads it") in r.stderr
        r = run(command, disk_dir / "model.safetensors.index.fp16.json")
        assert r.returncode == 0 and "note:" not in r.stderr, r.stdout + r.stderr
    (disk_dir / "model-00003-of-00003.safetensors").unlink()
    r = run("verify", disk_dir)
    assert r.returncode == 0 and "note:" not in r.stderr, r.stderr


def test_info_and_verify_read_a_model_directory_as_from_pretrained_does(disk_dir: Path) -> None:
    """safetensors first, then pytorch_model.bin and its index; a directory of variants only
    names its files, since a variant is read by name."""
    bins = disk_dir / "bins"
    bins.mkdir()
    torch.save({"w": torch.ones(3)}, bins / "pytorch_model-00001-of-00001.bin")
    (bins / "pytorch_model.bin.index.json").write_text(
        json.dumps({"weight_map": {"w": "pytorch_model-00001-of-00001.bin"}}))
    r = run("verify", bins)
    assert r.returncode == 0 and "pytorch_model.bin.index.json: all 1 shards OK" in r.stdout, (
        r.stdout + r.stderr)
    torch.save({"w": torch.ones(3)}, bins / "pytorch_model.bin")
    r = run("info", bins)
    assert r.returncode == 0 and "pytorch_model.bin\n" in r.stdout, r.stdout + r.stderr
    variants = disk_dir / "variants"
    variants.mkdir()
    st.save_file({"w": torch.ones(3, dtype=torch.float16)},
                 str(variants / "model.fp16.safetensors"))
    for command in ("info", "verify"):
        r = run(command, variants)
        assert r.returncode == 1, r.stdout
        assert "pass one of the weights files it holds: model.fp16.safetensors" in r.stderr, (
            r.stderr)
    r = run("info", disk_dir / "variants" / "model.fp16.safetensors")
    assert r.returncode == 0, r.stderr
    config_only = disk_dir / "config-only"  # a download that did not finish
    config_only.mkdir()
    (config_only / "config.json").write_text("{}")
    for command in ("info", "verify"):
        r = run(command, config_only)
        assert r.returncode == 1, r.stdout
        assert "it holds no model.safetensors" in r.stderr and "errno 21" in r.stderr, r.stderr


@pytest.mark.parametrize("header_length", [123, 0x7B20])
def test_a_safetensors_file_whose_length_bytes_look_like_json_is_not_an_index(
    disk_dir: Path, header_length: int
) -> None:
    """The 8-byte header length comes first: 123 is '{', 0x7B20 is ' {'."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    header += b" " * (header_length - len(header))
    path = disk_dir / "odd.safetensors"
    path.write_bytes(struct.pack("<Q", header_length) + header + struct.pack("<ff", 1.0, 2.0))
    assert st.load_file(str(path))["w"].tolist() == [1.0, 2.0]
    r = run("info", path)
    assert r.returncode == 0 and "tensors:   1" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("command", ["convert", "verify"])
def test_data_pkl_is_read_once(disk_dir: Path, command: str) -> None:
    # Its CRC-32 is checked from the read that parses it. Counted as the threads backend's
    # preads (io_uring reads make no system call to trace) at data.pkl's offset and size.
    import shutil

    import tensortier
    import internals

    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("strace is not installed")
    path = disk_dir / "m.pt"
    tensortier.save({"a": torch.ones(1000), "b": torch.arange(5)}, path, checksum=True)
    records, prefix = internals._torch_records(str(path))
    pkl = records[prefix + "data.pkl"]
    log = disk_dir / "strace.log"
    args = [path, disk_dir / "m.safetensors"] if command == "convert" else [path]
    r = subprocess.run(
        [strace, "-f", "-e", "trace=pread64", "-o", str(log), str(BIN), command,
         *map(str, args)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "TENSORTIER_BACKEND": "threads"},
    )
    if r.returncode != 0 and "ptrace" in r.stderr:
        pytest.skip(f"strace cannot trace here: {r.stderr.strip()[-200:]}")
    assert r.returncode == 0, r.stderr
    assert log.read_text().count(f", {pkl.size}, {pkl.offset}) ") == 1
    # A damaged data.pkl is still found, from that one read: the name "a" becomes "c".
    raw = bytearray(path.read_bytes())
    at = raw.index(b"X\x01\x00\x00\x00a", pkl.offset, pkl.offset + pkl.size) + 5
    raw[at] = ord("c")
    path.write_bytes(bytes(raw))
    r = run(command, *args)
    assert r.returncode == 1 and "data.pkl': CRC-32 checksum mismatch" in r.stderr, r.stderr


def test_convert_refuses_two_tensors_that_get_one_name(disk_dir: Path) -> None:
    """Tensor names are key paths joined by '.', and keys other than str and int read '<key>':
    two tensors may get one name, which a safetensors file cannot hold twice. The error says
    so (not that a safetensors header is damaged), and nothing is written."""
    cases = {
        "dotted": ({"s": {"3": torch.ones(1)}, "s.3": torch.zeros(1)}, "'s.3'"),
        "tuples": ({(1,): torch.ones(1), (2,): torch.zeros(1)}, "'<key>'"),
    }
    for name, (obj, label) in cases.items():
        src = disk_dir / f"{name}.pt"
        torch.save(obj, src)
        dst = disk_dir / f"{name}.safetensors"
        r = run("convert", src, dst)
        assert r.returncode == 1, r.stderr
        assert f"two tensors get the name {label}" in r.stderr, r.stderr
        assert "header" not in r.stderr, r.stderr
        assert not dst.exists()
        assert [p.name for p in disk_dir.glob(".*tmp*")] == []
