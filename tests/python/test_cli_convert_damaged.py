"""`tensortier convert` checks its input's own checksums while it copies (safetensors xxh64
metadata, zip CRC-32s) and refuses a damaged file, writing nothing; convert of many tensors is
linear; the CLI's parsers name what they found (an empty file, a FRAME longer than its pickle,
a stored zip entry with two sizes)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import zipfile
from pathlib import Path

import pytest
from test_cli_convert import BIN, assert_same, run  # the tensortier binary (skips without it)

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")
tensortier = pytest.importorskip("tensortier")


def tensors() -> dict:
    """Several dtypes, unaligned sizes, a zero-element and a multi-chunk tensor."""
    g = torch.Generator().manual_seed(1)
    return {
        "w": torch.randn(37, 3, generator=g),
        "b": torch.arange(5, dtype=torch.int64),
        "h": torch.randn(13, generator=g).to(torch.bfloat16),
        "u": torch.randint(0, 255, (3,), dtype=torch.uint8, generator=g),
        "empty": torch.zeros(0, 4),
        "big": torch.randn(5 * (1 << 20), generator=g),  # 20 MiB: two chunks of the copy
    }


def flip(path: Path, offset: int, mask: int = 0x40) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def safetensors_offsets(path: Path) -> dict[str, tuple[int, int]]:
    """Each tensor's absolute [begin, end) in a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return {k: (8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1])
            for k, v in header.items()}


def zip_data_offsets(path: Path) -> dict[str, tuple[int, int]]:
    """Each zip entry's absolute [begin, end) of data, from its local header."""
    out = {}
    with open(path, "rb") as f, zipfile.ZipFile(f) as z:
        for info in z.infolist():
            f.seek(info.header_offset)
            local = f.read(30)
            n, x = struct.unpack("<HH", local[26:30])
            begin = info.header_offset + 30 + n + x
            out[info.filename] = (begin, begin + info.file_size)
    return out


def central_records(path: Path) -> dict[str, int]:
    """Each zip entry's central directory record offset (zip64 archives not needed here)."""
    data = path.read_bytes()
    end = data.rindex(b"PK\x05\x06")
    count, _size, cd = struct.unpack("<HII", data[end + 10 : end + 20])
    out = {}
    pos = cd
    for _ in range(count):
        assert data[pos : pos + 4] == b"PK\x01\x02"
        n, x, c = struct.unpack("<HHH", data[pos + 28 : pos + 34])
        out[data[pos + 46 : pos + 46 + n].decode()] = pos
        pos += 46 + n + x + c
    return out


def assert_refused(r: subprocess.CompletedProcess[str], src: Path, *needles: str) -> None:
    assert r.returncode != 0, r.stdout + r.stderr
    assert str(src) in r.stderr and "damaged" in r.stderr, r.stderr
    for needle in needles:
        assert needle in r.stderr, r.stderr


def assert_nothing_written(d: Path, keep: set[str]) -> None:
    assert sorted(p.name for p in d.iterdir()) == sorted(keep)  # no output, no temporary file


# ---- safetensors -> .pt ------------------------------------------------------------------------


@pytest.fixture
def checked_safetensors(disk_dir: Path) -> Path:
    src = disk_dir / "in.safetensors"
    tensortier.save(tensors(), src, checksum=True, metadata={"step": "1000"})
    return src


@pytest.mark.parametrize("name", ["w", "b", "h", "u", "big"])
@pytest.mark.parametrize("where", ["first", "last", "middle"])
def test_a_flipped_data_byte_of_any_safetensors_tensor_is_refused(
    checked_safetensors: Path, name: str, where: str
) -> None:
    src = checked_safetensors
    begin, end = safetensors_offsets(src)[name]
    flip(src, {"first": begin, "last": end - 1, "middle": (begin + end) // 2}[where])
    assert run("verify", src).returncode == 1
    dst = src.parent / "out.pt"
    assert_refused(run("convert", src, dst), src, f"tensor '{name}': xxh64 checksum mismatch")
    assert_nothing_written(src.parent, {src.name})


def test_a_refused_convert_leaves_an_existing_output_as_it_was(checked_safetensors: Path) -> None:
    src = checked_safetensors
    dst = src.parent / "out.pt"
    r = run("convert", src, dst)
    assert r.returncode == 0, r.stderr
    before = dst.read_bytes()
    begin, _ = safetensors_offsets(src)["big"]
    flip(src, begin + (17 << 20))  # in the second chunk: the first one was already written
    assert_refused(run("convert", src, dst), src, "tensor 'big'")
    assert dst.read_bytes() == before
    assert_nothing_written(src.parent, {src.name, dst.name})


def edit_header(path: Path, old: bytes, new: bytes) -> None:
    assert len(old) == len(new)
    raw = path.read_bytes()
    assert raw.count(old) == 1
    path.write_bytes(raw.replace(old, new))


@pytest.mark.parametrize(
    "old, new, needle",
    [
        (b'"shape":[37,3]', b'"shape":[3,37]', "header checksum mismatch"),
        (b'"step":"1000"', b'"step":"9000"', "header checksum mismatch"),
        (b'"dtype":"I64"', b'"dtype":"F64"', "header checksum mismatch"),
    ],
)
def test_an_edited_safetensors_header_is_refused(
    checked_safetensors: Path, old: bytes, new: bytes, needle: str
) -> None:
    src = checked_safetensors
    edit_header(src, old, new)
    assert run("verify", src).returncode == 1
    assert_refused(run("convert", src, src.parent / "out.pt"), src, needle)
    assert_nothing_written(src.parent, {src.name})


def test_an_edited_checksum_value_is_refused(checked_safetensors: Path) -> None:
    """The checksum fields themselves: a tensor's stored xxh64 changed (the header checksum
    leaves the checksums out: the tensor's own comparison sees it), then the header checksum."""
    src = checked_safetensors
    with open(src, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        metadata = json.loads(f.read(n))["__metadata__"]
    stored = json.loads(metadata["tensortier.xxh64"])["b"]
    edited = ("1" if stored[0] != "1" else "2") + stored[1:]
    pristine = src.read_bytes()
    edit_header(src, stored.encode(), edited.encode())
    assert_refused(run("convert", src, src.parent / "out.pt"), src,
                   f"tensor 'b': xxh64 checksum mismatch (stored {edited}")
    src.write_bytes(pristine)
    header_sum = metadata["tensortier.header_xxh64"]
    edit_header(src, header_sum.encode(), (("1" if header_sum[0] != "1" else "2")
                                           + header_sum[1:]).encode())
    assert_refused(run("convert", src, src.parent / "out.pt"), src, "header checksum mismatch")
    assert_nothing_written(src.parent, {src.name})


@pytest.mark.parametrize("data_flipped", [False, True])
def test_a_damaged_tensor_checksums_key_does_not_hide_the_header_checksum(
    checked_safetensors: Path, data_flipped: bool
) -> None:
    """One byte of the metadata key holding the tensors' checksums changed: the file no
    longer seems to have tensor checksums, but its header checksum (which covers that key)
    says the header was changed. convert refuses it, verify names the mismatch, as
    load(verify=True) does; with a data byte flipped too nothing passes it on."""
    src = checked_safetensors
    edit_header(src, b'"tensortier.xxh64"', b'"tensortier.xxh65"')
    if data_flipped:
        begin, _ = safetensors_offsets(src)["w"]
        flip(src, begin)
    with pytest.raises(ValueError, match="header checksum mismatch"):
        tensortier.load(src, verify=True)
    r = run("verify", src)
    assert r.returncode == 1 and "header checksum mismatch" in r.stderr, r.stdout + r.stderr
    assert_refused(run("convert", src, src.parent / "out.pt"), src, "header checksum mismatch")
    assert_nothing_written(src.parent, {src.name})


def test_damaged_checksums_of_a_safetensors_file_are_refused(disk_dir: Path) -> None:
    """Without a header checksum, the per-tensor checksums themselves: changed, malformed,
    missing, or naming a tensor the file lacks."""
    t = {"a": torch.arange(10, dtype=torch.float32), "b": torch.ones(3)}
    import internals
    h = {k: f"{internals._xxh64(v):016x}" for k, v in t.items()}

    cases = {
        "changed": ({**h, "a": "0" * 16}, "tensor 'a': xxh64 checksum mismatch"),
        "malformed": ({**h, "b": "xyz"}, "tensor 'b': checksum 'xyz' is not 16 hex digits"),
        "missing": ({"a": h["a"]}, "tensor 'b' has no checksum"),
        "unknown": ({**h, "c": h["a"]}, "checksum for unknown tensor 'c'"),
    }
    for case, (sums, needle) in cases.items():
        src = disk_dir / f"{case}.safetensors"
        st.save_file(t, str(src), metadata={"tensortier.xxh64": json.dumps(sums)})
        assert run("verify", src).returncode == 1, case
        assert_refused(run("convert", src, disk_dir / "out.pt"), src, needle)
        assert not (disk_dir / "out.pt").exists()
    assert not [p for p in os.listdir(disk_dir) if ".tmp-" in p]


def test_clean_files_still_convert_and_unchecked_ones_say_so(
    checked_safetensors: Path,
) -> None:
    src = checked_safetensors
    dst = src.parent / "out.pt"
    r = run("convert", src, dst)
    assert r.returncode == 0, r.stderr
    assert "no checksums" not in r.stderr
    assert_same(torch.load(dst, weights_only=True), {k: v for k, v in tensors().items()})
    assert run("verify", dst).returncode == 0

    plain = src.parent / "plain.safetensors"
    st.save_file(tensors(), str(plain))
    r = run("convert", plain, src.parent / "plain.pt")
    assert r.returncode == 0, r.stderr
    assert f"note: {plain} has no checksums" in r.stderr, r.stderr


# ---- .pt -> safetensors ------------------------------------------------------------------------


def views() -> dict:
    """Tensors sharing one 20 MiB storage (two chunks of the copy: views before, across and
    after the chunk boundary, overlapping) and lone ones."""
    base = torch.arange(5 << 20, dtype=torch.float32)
    edge = 4 << 20  # the element at 16 MiB
    small = {k: v for k, v in tensors().items() if k != "big"}
    return {"all": base, "head": base[:100], "across": base[edge - 10 : edge + 10],
            "tail": base[edge + 5 :], "one": base[7:8], **small}


@pytest.fixture(params=["torch.save", "tensortier.save"])
def checked_pt(request: pytest.FixtureRequest, disk_dir: Path) -> Path:
    src = disk_dir / "in.pt"
    sd = {"part": torch.arange(1000, dtype=torch.int32)[:10], **views(), "note": "step 1000"}
    if request.param == "torch.save":
        torch.save(sd, src)
    else:
        tensortier.save(sd, src, checksum=True)
    return src


def test_a_flipped_byte_of_any_torch_entry_is_refused(checked_pt: Path) -> None:
    """Every record, in its first, middle and last byte: tensors' data, bytes of a storage no
    tensor views (part's tail), the pickle and the small records."""
    src = checked_pt
    pristine = src.read_bytes()
    entries = zip_data_offsets(src)
    assert any(name.endswith("/data.pkl") for name in entries)
    checked = 0
    for name, (begin, end) in entries.items():
        if end == begin:
            continue
        for at in sorted({begin, (begin + end) // 2, end - 1}):
            src.write_bytes(pristine)
            flip(src, at, 0x01)
            r = run("convert", src, src.parent / "out.safetensors")
            if name.endswith(("/data.pkl", "/byteorder")) and "CRC-32" not in r.stderr:
                # A flip the parsers refuse before any copy: refused all the same.
                assert r.returncode != 0 and str(src) in r.stderr, r.stderr
            else:
                assert_refused(r, src, f"entry '{name}': CRC-32 checksum mismatch")
            assert_nothing_written(src.parent, {src.name})
            checked += 1
    assert checked >= 3 * 6


def test_a_flipped_crc_field_of_any_torch_entry_is_refused(checked_pt: Path) -> None:
    src = checked_pt
    pristine = src.read_bytes()
    records = central_records(src)
    for name, pos in records.items():
        src.write_bytes(pristine)
        flip(src, pos + 16, 0x10)  # the central directory's CRC-32 field
        assert run("verify", src).returncode == 1, name
        r = run("convert", src, src.parent / "out.safetensors")
        assert_refused(r, src, f"entry '{name}': CRC-32 checksum mismatch")
        assert_nothing_written(src.parent, {src.name})


def test_a_flipped_pickle_value_is_refused(disk_dir: Path) -> None:
    """A flip the pickle reader cannot see (a string's letters): only data.pkl's CRC-32 does."""
    src = disk_dir / "m.pt"
    torch.save({"a": torch.randn(100), "note": "checkpoint of step 1000"}, src)
    edit_header(src, b"step 1000", b"stop 1000")
    assert run("info", src).returncode == 0
    assert_refused(run("convert", src, disk_dir / "m.safetensors"), src,
                   "entry 'm/data.pkl': CRC-32 checksum mismatch")
    assert_nothing_written(disk_dir, {src.name})


def test_clean_torch_files_still_convert(checked_pt: Path) -> None:
    src = checked_pt
    dst = src.parent / "out.safetensors"
    r = run("convert", src, dst)
    assert r.returncode == 0, r.stderr
    assert "not checked" not in r.stderr
    want = {"part": torch.arange(10, dtype=torch.int32), **views()}
    assert_same(st.load_file(str(dst)), want)
    assert run("verify", dst).returncode == 0


def test_torch_files_without_crcs_convert_and_say_so(disk_dir: Path) -> None:
    src = disk_dir / "nocrc.pt"
    from torch.serialization import set_crc32_options

    set_crc32_options(False)
    try:
        torch.save(views(), src)
    finally:
        set_crc32_options(True)
    dst = disk_dir / "nocrc.safetensors"
    r = run("convert", src, dst)
    assert r.returncode == 0, r.stderr
    assert f"note: {src} records no CRC-32s" in r.stderr, r.stderr
    assert_same(st.load_file(str(dst)), views())


# ---- many tensors ------------------------------------------------------------------------------


def test_convert_of_many_tensors_is_linear(disk_dir: Path) -> None:
    """100,000 tiny tensors to .pt. The writer's zip planner once looked for a duplicate name by
    scanning every entry before it (100k tensors: 25 s and more, 300k: 190 s); now a few
    seconds. The bound is generous for a loaded machine, not a speed claim."""
    n = 100_000
    header = {f"layer.{i}.w": {"dtype": "I32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]}
              for i in range(n)}
    text = json.dumps(header).encode()
    src = disk_dir / "many.safetensors"
    values = torch.arange(n, dtype=torch.int32)
    src.write_bytes(struct.pack("<Q", len(text)) + text + values.numpy().tobytes())
    dst = disk_dir / "many.pt"
    r = subprocess.run([str(BIN), "convert", str(src), str(dst)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    got = torch.load(dst, weights_only=True)
    assert list(got) == list(header)
    assert all(t.shape == (1,) and t.dtype == torch.int32 for t in got.values())
    assert torch.equal(torch.cat(list(got.values())), values)


# ---- what the parsers say ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["empty.pt", "empty.safetensors", "empty"])
def test_an_empty_file_is_called_empty(disk_dir: Path, name: str) -> None:
    path = disk_dir / name
    path.write_bytes(b"")
    for args in (("info", path), ("verify", path), ("convert", path, disk_dir / "o")):
        r = run(*args)
        assert r.returncode == 1, r.stdout + r.stderr
        assert f"{path}: empty file (0 bytes)" in r.stderr, r.stderr
        assert "tried safetensors and torch.save zip" in r.stderr, r.stderr
    assert_nothing_written(disk_dir, {name})


def framed_pt(path: Path, frame: int) -> None:
    """A torch.save-shaped zip whose data.pkl is {} (protocol 4) in a FRAME of `frame` bytes."""
    body = b"}\x94."
    pickle = b"\x80\x04\x95" + struct.pack("<Q", frame) + body
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pickle)
        z.writestr("archive/byteorder", b"little")
        z.writestr("archive/version", b"3\n")


def test_a_frame_longer_than_its_pickle_is_refused(disk_dir: Path) -> None:
    good = disk_dir / "good.pt"
    framed_pt(good, 3)
    # (torch's weights_only reader has no FRAME opcode: the plain unpickler reads these)
    assert torch.load(good, weights_only=False) == {}
    assert run("info", good).returncode == 0
    bad = disk_dir / "bad.pt"
    framed_pt(bad, 1 << 62)
    with pytest.raises(Exception):  # noqa: B017 - whatever torch raises: it refuses
        torch.load(bad, weights_only=False)
    for args in (("info", bad), ("verify", bad), ("convert", bad, disk_dir / "o.safetensors")):
        r = run(*args)
        assert r.returncode == 1, r.stdout + r.stderr
        assert "FRAME of 4611686018427387904 bytes is longer than the 3 bytes left" in r.stderr
    assert_nothing_written(disk_dir, {good.name, bad.name})


def test_a_stored_entry_with_two_sizes_is_called_damaged(disk_dir: Path) -> None:
    src = disk_dir / "two.pt"
    torch.save({"a": torch.ones(2)}, src)
    pos = central_records(src)["two/version"]
    with open(src, "r+b") as f:
        f.seek(pos + 20)  # compressed size: 0 (stored records give their size twice)
        f.write(struct.pack("<I", 0))
    r = run("verify", src)
    assert r.returncode == 1
    assert "zip entry 'two/version' is stored (method 0, uncompressed) but the directory" in (
        r.stderr), r.stderr
    assert "compressed (method 0)" not in r.stderr
