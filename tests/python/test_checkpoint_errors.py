"""tensortier checkpoints: bad files, checksums and durability (injected faults)."""

from __future__ import annotations

import errno
import json
import os
import re
import struct
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

import internals
import tensortier
from tensortier import IOHandle, _core, checkpoint
from tensortier.checkpoint import _format, _reading, safetensors, unpickler

from faults import faults_injected, with_faults


def write_safetensors(path: Path, header: dict, data: bytes, *, length: int | None = None) -> None:
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text) if length is None else length) + text + data)


def good_header() -> dict:
    return {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "I64", "shape": [1], "data_offsets": [8, 16]}}


def leftovers(d: Path) -> list[str]:
    return sorted(n for n in os.listdir(d) if ".tmp-" in n)


# ---- bad safetensors files -------------------------------------------------------------------


def test_good_hand_written_file_loads(disk_dir: Path) -> None:
    path = disk_dir / "ok.safetensors"
    write_safetensors(path, good_header(), struct.pack("<ffq", 1.0, 2.0, 42))
    out = tensortier.load(path)
    assert out["a"].tolist() == [1.0, 2.0] and out["b"].tolist() == [42]


@pytest.mark.parametrize(
    "case",
    ["truncated", "length_beyond_file", "malformed_json", "overlap", "out_of_range",
     "unknown_dtype", "shape_size_mismatch", "empty", "tiny", "garbage"],
)
@pytest.mark.parametrize("mapped", [False, True], ids=["read", "mmap"])
def test_bad_safetensors(disk_dir: Path, case: str, mapped: bool) -> None:
    path = disk_dir / "bad.safetensors"
    data = struct.pack("<ffq", 1.0, 2.0, 42)
    h = good_header()
    if case == "truncated":
        write_safetensors(path, h, data[:10])
    elif case == "length_beyond_file":
        write_safetensors(path, h, data, length=1 << 40)
    elif case == "malformed_json":
        text = b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]'
        path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    elif case == "overlap":
        h["b"]["data_offsets"] = [4, 12]
        write_safetensors(path, h, data[:12])
    elif case == "out_of_range":
        h["b"]["data_offsets"] = [8, 1 << 50]
        h["b"]["shape"] = [(1 << 50) // 8 - 1]
        write_safetensors(path, h, data)
    elif case == "unknown_dtype":
        h["a"]["dtype"] = "F7"
        write_safetensors(path, h, data)
    elif case == "shape_size_mismatch":
        h["a"]["shape"] = [3]
        write_safetensors(path, h, data)
    elif case == "empty":
        path.write_bytes(b"")
    elif case == "tiny":
        path.write_bytes(b"\x05\x00")
    elif case == "garbage":
        path.write_bytes(os.urandom(4096).replace(b"{", b"x").replace(b"PK", b"pk"))
    with pytest.raises(ValueError) as info:
        tensortier.load(path, mmap=mapped)
    assert "bad.safetensors" in str(info.value) or case in ("empty", "tiny")
    with pytest.raises((ValueError, OSError)):
        tensortier.load_into({"a": torch.zeros(2), "b": torch.zeros(1, dtype=torch.int64)}, path)


def test_missing_file_is_oserror(disk_dir: Path) -> None:
    with pytest.raises(FileNotFoundError):
        tensortier.load(disk_dir / "nope.safetensors")
    with pytest.raises(IsADirectoryError):
        tensortier.load(disk_dir)


@pytest.mark.parametrize("name", ["ckpt", "m.safetensors", "m.pt", "m.safetensors.index.json"])
def test_a_directory_is_refused_alike_by_load_and_the_cli(disk_dir: Path, name: str) -> None:
    """One rule (C++): EISDIR naming the path, with what to pass instead, whatever the name."""
    path = disk_dir / name
    path.mkdir()
    said = "a directory: pass a checkpoint file or a shard .index.json"
    for call in (lambda: tensortier.load(path), lambda: tensortier.load(path, mmap=True),
                 lambda: tensortier.load_into({}, path, strict=False)):
        with pytest.raises(IsADirectoryError) as info:
            call()
        assert info.value.errno == errno.EISDIR and info.value.filename == str(path)
        assert said in str(info.value)
    from test_cli_convert import run

    for command in (("info", path), ("verify", path), ("convert", path, disk_dir / "out.pt")):
        r = run(*command)
        assert r.returncode != 0
        assert f"'{path}'" in r.stderr and said in r.stderr and "errno 21" in r.stderr, r.stderr


# ---- bad torch files ---------------------------------------------------------------------------


def test_legacy_torch_file(disk_dir: Path) -> None:
    path = disk_dir / "legacy.pt"
    torch.save({"a": torch.ones(2)}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(ValueError, match="legacy.*torch.load") as caught:
        tensortier.load(path)
    # A valid file of a format not read here, not a damaged one.
    assert not isinstance(caught.value, (tensortier.DamagedCheckpointError, tensortier.EmptyCheckpointError))
    assert isinstance(caught.value, _core.UnsupportedFormatError)


def rezip(src: Path, dst: Path, *, compress: str | None = None, drop: str | None = None,
          replace: dict[str, bytes] | None = None) -> None:
    """Copy a zip, deflating or dropping or replacing some records."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            if drop and info.filename.endswith(drop):
                continue
            data = zin.read(info.filename)
            if replace:
                for suffix, new in replace.items():
                    if info.filename.endswith(suffix):
                        data = new
            ctype = zipfile.ZIP_DEFLATED if compress and info.filename.endswith(compress) \
                else zipfile.ZIP_STORED
            zout.writestr(info.filename, data, compress_type=ctype)


def _refused(bad: Path, how: str, says: str, into: dict[str, Any],
             cli_says: str | None = None, **load_kwargs: Any) -> None:
    """Opens `bad` as `how` says (``load``, ``mmap``, ``load_into`` into `into`, or the CLI's
    ``info``) and expects it refused: a ValueError matching `says`, or the CLI's exit status 1
    with `cli_says` (default `says`, a regular expression) on stderr."""
    if how == "cli":
        from test_cli_convert import BIN, run

        if not BIN.is_file():
            pytest.skip("the tensortier CLI is not built")
        r = run("info", bad)
        assert r.returncode == 1 and re.search(cli_says or says, r.stderr), r.stderr
        return
    with pytest.raises(ValueError, match=says):
        if how == "load_into":
            tensortier.load_into(into, bad)
        else:
            tensortier.load(bad, mmap=how == "mmap", **load_kwargs)


@pytest.mark.parametrize("record", ["/version", "/.data/version"])
@pytest.mark.parametrize("how", ["load", "mmap", "load_into", "cli"])
def test_format_version_torch_does_not_read_is_refused(
    disk_dir: Path, record: str, how: str
) -> None:
    # A later format version may lay data out differently: torch.load refuses it, so do we
    # rather than load tensors that may be wrong. ".data/version" is read first, as by torch.
    src = disk_dir / "ok.pt"
    torch.save({"a": torch.arange(10.0)}, src)
    bad = disk_dir / "v99.pt"
    rezip(src, bad, replace={"/version": b"99\n"} if record == "/version" else None)
    if record == "/.data/version":
        with zipfile.ZipFile(bad, "a") as z:
            z.writestr(z.namelist()[0].split("/")[0] + record, b"11")
    with pytest.raises(RuntimeError, match="maximum supported version"):
        torch.load(bad, weights_only=True)
    says = "torch.save format version (99|11) .*is not one torch reads"
    _refused(bad, how, says, into={"a": torch.empty(10)})
    rezip(src, bad, replace={"/version": b"10"})  # the last version torch reads
    assert torch.equal(tensortier.load(bad)["a"], torch.arange(10.0))


@pytest.mark.parametrize("how", ["load", "mmap", "load_into", "cli"])
def test_an_archive_without_a_format_version_is_refused(disk_dir: Path, how: str) -> None:
    # torch's reader requires a "version" (or ".data/version") record and refuses the file
    # without one: a file that loads here must load in torch too.
    src = disk_dir / "ok.pt"
    torch.save({"a": torch.arange(10.0)}, src)
    bad = disk_dir / "noversion.pt"
    rezip(src, bad, drop="/version")
    with zipfile.ZipFile(bad) as z:
        assert not any(n.endswith("version") and not n.endswith("format_version")
                       for n in z.namelist())
    with pytest.raises(RuntimeError, match='hasRecord\\("version"\\)'):
        torch.load(bad, weights_only=True)
    says = (r"noversion.pt: zip file without a format version record "
            r"\('ok/version' or 'ok/.data/version'\)")
    _refused(bad, how, says, into={"a": torch.empty(10)})


@pytest.mark.parametrize("how", ["load", "mmap", "load_into", "cli"])
def test_a_storage_described_twice_differently_is_refused(disk_dir: Path, how: str) -> None:
    # data.pkl puts an int16 tensor on the float32 storage "0" (torch.save refuses to write
    # that): torch.load would give it float32 values, reading its bytes as int16 is no better.
    src = disk_dir / "ok.pt"
    torch.save({"a": torch.arange(8.0), "c": torch.arange(7, dtype=torch.int16)}, src)
    with zipfile.ZipFile(src) as z:
        pkl = z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))
    short_key = rb"(ShortStorage\n(?:q.|r....)X\x01\x00\x00\x00)1"  # its storage key, "1"
    twice = re.sub(short_key, rb"\g<1>0", pkl, flags=re.S)
    assert twice != pkl
    bad = disk_dir / "twice.pt"
    rezip(src, bad, replace={"/data.pkl": twice})  # with the right CRC-32s: verify passes them
    _refused(bad, how, "storage '0' is described twice, differently",
             into={"a": torch.empty(8), "c": torch.empty(7, dtype=torch.int16)},
             cli_says="described twice, differently", verify=True)


@pytest.mark.parametrize("mapped", [False, True], ids=["read", "mmap"])
def test_compressed_zip_entry(disk_dir: Path, mapped: bool) -> None:
    src = disk_dir / "ok.pt"
    torch.save({"a": torch.zeros(1000)}, src)
    bad = disk_dir / "deflated.pt"
    rezip(src, bad, compress="data/0")
    with pytest.raises(ValueError, match="compress"):
        tensortier.load(bad, mmap=mapped)
    rezip(src, bad, compress="data.pkl")
    with pytest.raises(ValueError, match="compress"):
        tensortier.load(bad, mmap=mapped)


@pytest.mark.parametrize("mapped", [False, True], ids=["read", "mmap"])
def test_a_byte_order_neither_little_nor_big_is_refused_alike_by_load_and_the_cli(
    disk_dir: Path, mapped: bool
) -> None:
    """One rule (C++) for the "byteorder" record, in one message: load and verify name it."""
    path = disk_dir / "m.pt"
    torch.save({"a": torch.ones(3), "b": torch.zeros(2)}, path)
    data = path.read_bytes()
    assert data.count(b"little") == 1
    path.write_bytes(data.replace(b"little", b"middle"))
    said = "byte order 'middle' is neither 'little' nor 'big'"
    with pytest.raises(ValueError, match=said):
        tensortier.load(path, mmap=mapped)
    from test_cli_convert import run

    r = run("info", path)
    assert r.returncode != 0 and said in r.stderr, r.stderr


@pytest.mark.parametrize("mapped", [False, True], ids=["read", "mmap"])
def test_missing_records(disk_dir: Path, mapped: bool) -> None:
    src = disk_dir / "ok.pt"
    torch.save({"a": torch.zeros(10)}, src)
    bad = disk_dir / "bad.pt"
    # Damage torch.load raises RuntimeError for: DamagedCheckpointError (a RuntimeError too).
    rezip(src, bad, drop="data/0")
    with pytest.raises(tensortier.DamagedCheckpointError, match="data/0"):
        tensortier.load(bad, mmap=mapped)
    rezip(src, bad, drop="data.pkl")
    with pytest.raises(ValueError, match="data.pkl"):
        tensortier.load(bad, mmap=mapped)
    rezip(src, bad, replace={"data/0": b"\0" * 12})  # record shorter than the storage
    with pytest.raises(tensortier.DamagedCheckpointError, match="40 bytes"):
        tensortier.load(bad, mmap=mapped)
    rezip(src, bad, replace={"data.pkl": b"\x80\x02}q\x00(X"})  # truncated pickle
    with pytest.raises(tensortier.DamagedCheckpointError, match="data.pkl"):
        tensortier.load(bad, mmap=mapped)
    with pytest.raises(tensortier.DamagedCheckpointError, match="data.pkl"):
        tensortier.load_into({"a": torch.empty(10)}, bad)


@pytest.mark.parametrize("name", ["c.pt", "c.safetensors"])
def test_load_into_raises_for_damage_what_load_raises(disk_dir: Path, name: str) -> None:
    """A checksum that fails: load_into's error is load's (DamagedCheckpointError, or
    safetensors' SafetensorError), not the bare FormatError."""
    path = disk_dir / name
    b = torch.randn(10)
    tensortier.save({"b": b}, path, checksum=True)
    raw = bytearray(path.read_bytes())
    raw[raw.find(b.numpy().tobytes()) + 3] ^= 0x10
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError) as loaded:
        tensortier.load(path, verify=True)
    with pytest.raises(ValueError) as into:
        tensortier.load_into({"b": torch.zeros(10)}, path, verify=True)
    assert type(into.value) is type(loaded.value) and type(loaded.value) is not _core.FormatError
    assert str(path) in str(into.value)


class Boom:
    """Would create a directory when unpickled by a plain unpickler."""

    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self) -> tuple:
        return (os.mkdir, (self.target,))


def test_disallowed_pickle_global_never_runs(disk_dir: Path) -> None:
    target = disk_dir / "pwned"
    path = disk_dir / "evil.pt"
    torch.save({"a": torch.ones(2), "x": Boom(str(target))}, path)
    with pytest.raises(ValueError, match="weights_only.*mkdir|mkdir.*weights_only"):
        tensortier.load(path)
    with pytest.raises(ValueError):
        tensortier.load_into({"a": torch.zeros(2)}, path)
    assert not target.exists()


def test_zip_that_is_not_torch(disk_dir: Path) -> None:
    path = disk_dir / "x.pt"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("hello.txt", "hi")
    with pytest.raises(ValueError, match="data.pkl"):
        tensortier.load(path)
    truncated = disk_dir / "trunc.pt"
    torch.save({"a": torch.zeros(100)}, disk_dir / "full.pt")
    data = (disk_dir / "full.pt").read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError):
        tensortier.load(truncated)


# ---- checksums -----------------------------------------------------------------------------------


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def test_verify_detects_flipped_byte_safetensors(disk_dir: Path) -> None:
    sd = {"first": torch.randn(1024), "victim": torch.randn(2048), "last": torch.arange(3)}
    path = disk_dir / "c.safetensors"
    tensortier.save(sd, path, checksum=True)
    entries, _ = internals._read_st_header(str(path))
    victim = next(e for e in entries if e.name == "victim")
    flip_byte(path, victim.offset + 4097)
    tensortier.load(path)  # without verify the damage goes unseen
    with pytest.raises(ValueError, match="tensor 'victim': xxh64 checksum mismatch"):
        tensortier.load(path, verify=True)
    with pytest.raises(ValueError, match="'victim'"):
        tensortier.load_into({k: torch.zeros_like(v) for k, v in sd.items()}, path, verify=True)
    tensortier.load_into({"first": torch.zeros(1024)}, path, strict=False, verify=True)


def test_verify_detects_flipped_byte_torch(disk_dir: Path) -> None:
    sd = {"a": torch.randn(3000), "b": torch.randn(100)}
    path = disk_dir / "c.pt"
    tensortier.save(sd, path, checksum=True)
    with zipfile.ZipFile(path) as z:
        info = z.getinfo("archive/data/1")
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        n, x = struct.unpack("<HH", f.read(4))
    flip_byte(path, info.header_offset + 30 + n + x + 7)
    assert torch.equal(torch.load(path, weights_only=True)["a"], sd["a"])
    with pytest.raises(ValueError, match="entry 'archive/data/1': CRC-32 checksum mismatch"):
        tensortier.load(path, verify=True)
    with pytest.raises(ValueError, match="data/1"):
        tensortier.load_into({k: torch.zeros_like(v) for k, v in sd.items()}, path, verify=True)


def test_verify_detects_a_flipped_byte_in_the_torch_metadata(disk_dir: Path) -> None:
    # A bit flip in data.pkl changes a value, an offset or a stride without touching any
    # storage: only the record's own CRC-32 sees it.
    sd = {"a": torch.randn(100), "note": "checkpoint of step 1000"}
    path = disk_dir / "m.pt"
    tensortier.save(sd, path, checksum=True)
    data = path.read_bytes()
    where = data.index(b"step 1000")
    with open(path, "r+b") as f:
        f.seek(where)
        f.write(b"stop")
    assert tensortier.load(path)["note"] == "checkpoint of stop 1000"  # silently different
    with pytest.raises(ValueError, match="entry '.*data.pkl': CRC-32 checksum mismatch"):
        tensortier.load(path, verify=True)
    with pytest.raises(ValueError, match="data.pkl"):
        tensortier.load_into({"a": torch.zeros(100)}, path, strict=False, verify=True)


def _edit_header(path: Path, old: str, new: str) -> None:
    """Replace `old` by `new` (same length) in a safetensors file's JSON header, in place."""
    assert len(old) == len(new)
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = raw[8 : 8 + n].decode()
    assert header.count(old) == 1, header
    raw[8 : 8 + n] = header.replace(old, new).encode()
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    "old, new, what",
    [
        ('"shape":[4,8]', '"shape":[8,4]', "a transposed shape"),
        ('"F32"', '"I32"', "another dtype of the same size"),
        ('"step":"1000"', '"step":"9000"', "a metadata value"),
        ('"wq"', '"wk"', "a renamed tensor"),
    ],
)
def test_verify_detects_an_edited_safetensors_header(
    disk_dir: Path, old: str, new: str, what: str
) -> None:
    """Per-tensor data checksums cannot see header edits that keep the bytes where they were;
    the header checksum does (load, load_into and the CLI)."""
    path = disk_dir / "h.safetensors"
    sd = {"wq": torch.randn(4, 8), "b": torch.arange(7)}
    tensortier.save(sd, path, checksum=True, metadata={"step": "1000"})
    tensortier.load(path, verify=True)
    _edit_header(path, old, new)
    tensortier.load(path)  # without verify the edit goes unseen
    with pytest.raises(ValueError, match="header checksum mismatch"):
        tensortier.load(path, verify=True)
    targets = {k: torch.zeros_like(v) for k, v in tensortier.load(path).items()}
    with pytest.raises(ValueError, match="header checksum mismatch"):
        tensortier.load_into(targets, path, verify=True)
    from test_cli_convert import run  # the tensortier binary

    r = run("verify", path)
    assert r.returncode == 1 and "header checksum mismatch" in r.stderr, r.stdout + r.stderr


def test_a_damaged_name_of_the_header_checksum_does_not_switch_its_check_off(
        disk_dir: Path) -> None:
    """One flipped bit in the key's name, with the header changed: verify=True and the CLI's
    verify refuse the unknown tensortier.* key (before, the header went unchecked)."""
    path = disk_dir / "s.safetensors"
    tensortier.save({"a": torch.arange(50, dtype=torch.float32).reshape(10, 5)}, path,
                    checksum=True)
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = raw[8:8 + n].replace(b"tensortier.header_xxh64", b"tensortier.headeR_xxh64")
    edited = json.loads(header)
    edited["a"]["shape"] = [5, 10]
    path.write_bytes(raw[:8] + json.dumps(edited).encode().ljust(n) + raw[8 + n:])
    assert tensortier.load(path)["a"].shape == (5, 10)  # without verify the edit goes unseen
    with pytest.raises(ValueError, match="'tensortier.headeR_xxh64' is none tensortier writes"):
        tensortier.load(path, verify=True)
    from test_cli_convert import run

    r = run("verify", path)
    assert r.returncode == 1 and "none tensortier writes" in r.stderr, r.stdout + r.stderr


def test_verify_of_files_without_a_header_checksum(disk_dir: Path) -> None:
    """Files of other writers (or earlier tensortier versions) with only data checksums still
    verify their data."""
    path = disk_dir / "old.safetensors"
    t = torch.randn(100)
    from safetensors.torch import save_file  # noqa: PLC0415 - optional peer

    save_file({"t": t}, str(path), metadata={
        checkpoint.CHECKSUM_KEY: json.dumps({"t": f"{internals._xxh64(t):016x}"})})
    assert torch.equal(tensortier.load(path, verify=True)["t"], t)
    from test_cli_convert import run

    r = run("verify", path)
    assert r.returncode == 0 and "no header checksum" in r.stdout, r.stdout + r.stderr


def test_a_record_whose_crc32_is_zero_is_checked(disk_dir: Path) -> None:
    """0 in a zip record's CRC field means "none recorded" only where every record has 0
    (torch.save with set_crc32_options(False)); these 4 bytes' CRC-32 really is 0."""
    import zlib

    zero_crc = torch.tensor([0x6DD90A9D], dtype=torch.int32)
    assert zlib.crc32(zero_crc.numpy().tobytes()) == 0
    path = disk_dir / "crc0.pt"
    tensortier.save({"x": zero_crc, "y": torch.ones(3)}, path, checksum=True)
    assert tensortier.load(path, verify=True)["x"].item() == 0x6DD90A9D
    cli = Path(sys.executable).parent / "tensortier"  # checked too where the binary is

    def verify_cli() -> subprocess.CompletedProcess[str] | None:
        if not cli.is_file():
            return None
        return subprocess.run([str(cli), "verify", str(path)], capture_output=True, text=True,
                              timeout=300)

    r = verify_cli()
    assert r is None or r.returncode == 0, r
    rec = internals._zip_records(str(path))
    x_rec = next(r for name, r in rec.items() if name.endswith("data/0"))
    assert x_rec.crc32 == 0 and x_rec.archive_has_crcs
    with open(path, "r+b") as f:  # flip a bit of x: its CRC no longer matches 0
        f.seek(x_rec.offset)
        byte = f.read(1)
        f.seek(x_rec.offset)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(ValueError, match="entry '.*data/0': CRC-32 checksum mismatch"):
        tensortier.load(path, verify=True)
    r = verify_cli()
    assert r is None or (r.returncode == 1 and "stored 00000000" in r.stderr), r


def test_concurrent_saves_replacing_files(disk_dir: Path) -> None:
    """Saves on several threads, each replacing its own file over and over (the replaced
    files are freed on threads the next saves wait for)."""
    import threading

    errors: list[BaseException] = []

    def worker(i: int) -> None:
        path = disk_dir / f"m{i}.safetensors"
        try:
            for step in range(40):
                tensortier.save({"w": torch.full((100,), float(step))}, path)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    for i in range(3):
        assert tensortier.load(disk_dir / f"m{i}.safetensors")["w"][0].item() == 39.0
    internals._wait_for_replaced_files()  # noqa: SLF001
    assert leftovers(disk_dir) == []


def test_verify_without_checksums(disk_dir: Path) -> None:
    path = disk_dir / "n.safetensors"
    tensortier.save({"a": torch.ones(3)}, path)
    with pytest.raises(ValueError, match="no checksums.*checksum=True"):
        tensortier.load(path, verify=True)
    with pytest.raises(ValueError, match="no checksums"):
        tensortier.load_into({"a": torch.zeros(3)}, path, verify=True)
    save_file = pytest.importorskip("safetensors.torch").save_file  # optional peer

    save_file({"a": torch.ones(3)}, str(path), metadata={checkpoint.CHECKSUM_KEY: "[1,2"})
    with pytest.raises(ValueError, match="malformed"):
        tensortier.load(path, verify=True)
    # Our own checksum keys are refused as user metadata, with or without checksum=True
    # (without, they would be stale checksums that verify then fails on).
    for checksum in (True, False):
        with pytest.raises(ValueError, match="tensortier's checksums"):
            tensortier.save({"a": torch.ones(3)}, path, checksum=checksum,
                            metadata={checkpoint.CHECKSUM_KEY: "{}"})
        with pytest.raises(ValueError, match="tensortier's checksums"):
            tensortier.save({"a": torch.ones(3)}, path, checksum=checksum,
                            metadata={checkpoint.HEADER_CHECKSUM_KEY: "0"})


def _stored_checksum_cases(good: str) -> dict[str, tuple[str, bool]]:
    """name -> (the tensortier.xxh64 value, whether it is accepted) for tensor "a"."""
    return {
        "as written": (f'{{"a":"{good}"}}', True),
        "upper case": (f'{{"a":"{good.upper()}"}}', True),
        "a name twice": (f'{{"a":"{"0" * 16}","a":"{good}"}}', False),
        "0x prefix": (f'{{"a":"0x{good}"}}', False),
        "underscore": (f'{{"a":"{good[:8]}_{good[8:]}"}}', False),
        "space": (f'{{"a":" {good}"}}', False),
        "15 digits": (f'{{"a":"{good[1:]}"}}', False),
        "not an object": ('["a"]', False),
        # A checksum for a tensor the file does not hold: the metadata is not this file's.
        "an unknown name": (f'{{"a":"{good}","b":"{good}"}}', False),
        "no checksum for a": ('{}', False),
    }


@pytest.mark.parametrize("case", sorted(_stored_checksum_cases("0" * 16)))
def test_checksum_metadata_is_read_by_the_rules_of_tensortier_verify(
    disk_dir: Path, case: str
) -> None:
    """One parser for load(verify=True) and `tensortier verify`: 16 hex digits exactly, a
    name given twice refused (json.loads kept the last, int(v, 16) took "0x", "_", spaces)."""
    save_file = pytest.importorskip("safetensors.torch").save_file  # optional peer
    a = torch.arange(10, dtype=torch.float32)
    good = f"{internals._xxh64(a):016x}"  # noqa: SLF001
    text, accepted = _stored_checksum_cases(good)[case]
    path = disk_dir / "c.safetensors"
    save_file({"a": a}, str(path), metadata={checkpoint.CHECKSUM_KEY: text})
    from test_cli_convert import BIN, run

    if accepted:
        assert torch.equal(tensortier.load(path, verify=True)["a"], a)
    else:
        with pytest.raises(ValueError, match="malformed"):
            tensortier.load(path, verify=True)
    if BIN.is_file():
        r = run("verify", path)
        assert (r.returncode == 0) == accepted, r.stdout + r.stderr


@pytest.mark.parametrize("stored", ["0x" + "0" * 14, "0" * 15 + "_", " " + "0" * 15, "0" * 17])
def test_header_checksum_must_be_16_hex_digits(disk_dir: Path, stored: str) -> None:
    save_file = pytest.importorskip("safetensors.torch").save_file  # optional peer
    path = disk_dir / "h.safetensors"
    save_file({"a": torch.ones(2)}, str(path), metadata={checkpoint.HEADER_CHECKSUM_KEY: stored})
    with pytest.raises(ValueError, match="not 16 hex digits"):
        tensortier.load(path, verify=True)


@pytest.mark.parametrize("name,fmt", [("M.PT", "torch"), ("m.SafeTensors", "safetensors"),
                                      ("m.Bin", "torch"), ("m.ST", "safetensors")])
def test_a_suffix_names_its_format_in_either_case_for_save_and_convert(
    disk_dir: Path, name: str, fmt: str
) -> None:
    path = disk_dir / name
    tensortier.save({"w": torch.ones(3)}, path)
    assert (path.read_bytes()[:4] == b"PK\x03\x04") == (fmt == "torch")
    from test_cli_convert import BIN, run

    if not BIN.is_file():
        return
    # convert writes the other format: an output named for this one is refused, by any case.
    other = disk_dir / ("src.safetensors" if fmt == "torch" else "src.pt")
    tensortier.save({"w": torch.ones(3)}, disk_dir / ("o" + name))
    r = run("convert", disk_dir / ("o" + name), disk_dir / ("x" + name))
    assert r.returncode != 0 and "by its suffix" in r.stderr, r.stderr
    tensortier.save({"w": torch.ones(3)}, other)
    r = run("convert", other, disk_dir / ("y" + name))
    assert r.returncode == 0, r.stderr
    assert torch.equal(tensortier.load(disk_dir / ("y" + name))["w"], torch.ones(3))


@pytest.mark.parametrize("weight_map,says", [
    ({"a": "..\\x.safetensors"}, "outside the index's directory"),
    ({"a": "sub/../../x.safetensors"}, "outside the index's directory"),
    ({}, "naming no tensors"),
])
def test_shard_indexes_are_read_by_the_rules_of_the_cli(
    disk_dir: Path, weight_map: dict[str, str], says: str
) -> None:
    index = disk_dir / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match=says):
        tensortier.load(index)
    from test_cli_convert import BIN, run

    if BIN.is_file():
        r = run("verify", index)
        assert r.returncode == 1 and says in r.stderr, r.stderr


@pytest.mark.parametrize("first", ["m-1", "m-2"])
@pytest.mark.parametrize("how", ["load", "mmap", "load_into"])
def test_a_tensor_in_two_shards_comes_from_the_one_the_index_names(
    tmp_path: Path, first: str, how: str
) -> None:
    # m-2 also holds an "a" (a stale copy): whichever shard is read last, "a" is m-1's.
    one, two = tmp_path / "m-1.safetensors", tmp_path / "m-2.safetensors"
    tensortier.save({"a": torch.full((3,), 1.0), "b": torch.arange(4)}, one)
    tensortier.save({"c": torch.ones(2), "a": torch.full((3,), 2.0)}, two)
    weight_map = {"a": "m-1.safetensors", "b": "m-1.safetensors", "c": "m-2.safetensors"}
    if first == "m-2":
        weight_map = {"c": weight_map.pop("c"), **weight_map}
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": weight_map}))
    if how == "load_into":
        out = {"a": torch.zeros(3), "b": torch.zeros(4, dtype=torch.int64), "c": torch.zeros(2)}
        tensortier.load_into(out, index)
    else:
        out = tensortier.load(index, mmap=how == "mmap")
        assert sorted(out) == ["a", "b", "c"]
    assert torch.equal(out["a"], torch.full((3,), 1.0))
    assert torch.equal(out["c"], torch.ones(2))


@pytest.mark.parametrize("how", ["load", "mmap", "load_into", "meta"])
@pytest.mark.parametrize("held_by", [1, 2])
def test_a_tensor_the_index_does_not_list_is_left_out(
    tmp_path: Path, how: str, held_by: int
) -> None:
    # The weight_map is the checkpoint's list of tensors (transformers' load_sharded_checkpoint
    # takes its keys as the checkpoint's): "x", in one shard or two, is not part of it.
    tensortier.save({"a": torch.ones(3), "x": torch.zeros(1)}, tmp_path / "m-1.safetensors")
    second = {"b": torch.ones(3), "x": torch.ones(1)} if held_by == 2 else {"b": torch.ones(3)}
    torch.save(second, tmp_path / "m-2.bin")
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "m-1.safetensors", "b": "m-2.bin"}}))
    if how == "load_into":
        out = {"a": torch.zeros(3), "b": torch.zeros(3), "x": torch.full((1,), 5.0)}
        keys = tensortier.load_into(out, index, strict=False)
        assert keys.missing_keys == ["x"] and keys.unexpected_keys == []
        assert torch.equal(out["x"], torch.full((1,), 5.0))
        with pytest.raises(ValueError, match="x"):
            tensortier.load_into(out, index)
    else:
        if how == "meta":
            out = tensortier.load(index, map_location="meta")
        else:
            out = tensortier.load(index, mmap=how == "mmap")
        assert list(out) == ["a", "b"]
    if how != "meta":
        assert torch.equal(out["a"], torch.ones(3)) and torch.equal(out["b"], torch.ones(3))


# ---- durability --------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_saves_to_names_of_the_longest_length_a_file_may_have(
    disk_dir: Path, suffix: str
) -> None:
    # 255 bytes (the most a name may have, as torch.save writes it): the temporary file of the
    # save needs a shorter name than ".NAME.tmp-...".
    path = disk_dir / ("m" * (255 - len(suffix)) + suffix)
    sd = {"w": torch.arange(1000, dtype=torch.float32)}
    tensortier.save(sd, path)
    tensortier.save(sd, path)  # over the first
    assert torch.equal(tensortier.load(path)["w"], sd["w"])
    assert leftovers(disk_dir) == []
    from test_cli_convert import BIN, run

    if BIN.is_file():
        other = ".pt" if suffix == ".safetensors" else ".safetensors"
        out = disk_dir / ("c" * (255 - len(other)) + other)
        r = run("convert", path, out)
        assert r.returncode == 0, r.stderr
        assert torch.equal(tensortier.load(out)["w"], sd["w"])
        assert leftovers(disk_dir) == []


@pytest.mark.parametrize("name", ["m.safetensors", "m.pt"])
def test_a_full_or_read_only_filesystem_keeps_the_old_checkpoint(
    small_fs: Path, name: str
) -> None:
    # A real 4 MiB filesystem: ENOSPC from fallocate (tmpfs, ext4) or from the writes (ext2),
    # then a read-only remount (EROFS). The old checkpoint stays whole, nothing is left behind.
    path = small_fs / name
    old = {"w": torch.arange(1000, dtype=torch.float32)}
    tensortier.save(old, path)
    before = path.read_bytes()
    with pytest.raises(OSError) as info:
        tensortier.save({"w": torch.ones(3 << 20)}, path)  # 12 MiB
    assert info.value.errno == errno.ENOSPC and f"cannot save '{path}'" in str(info.value)
    assert path.read_bytes() == before and leftovers(small_fs) == []
    from test_cli_convert import BIN, run

    if BIN.is_file():
        src = small_fs.parent / ("big.pt" if name.endswith(".safetensors") else "big.safetensors")
        tensortier.save({"w": torch.ones(3 << 20)}, src)
        r = run("convert", src, path)
        assert r.returncode == 1 and "errno 28" in r.stderr, r.stderr
        assert path.read_bytes() == before and leftovers(small_fs) == []
    remount = subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], capture_output=True,
                             text=True, timeout=60)
    assert remount.returncode == 0, remount.stderr
    with pytest.raises(OSError) as info:
        tensortier.save({"w": torch.ones(3)}, path)
    assert info.value.errno == errno.EROFS and "read-only" in str(info.value)
    assert "this user" not in str(info.value)  # not a permission the user could change
    assert torch.equal(tensortier.load(path, verify=name.endswith(".pt"))["w"], old["w"])


@pytest.mark.parametrize("name", ["m.safetensors", "m.pt"])
@pytest.mark.parametrize("nth", [1, 3])
def test_failed_write_keeps_old_checkpoint(disk_dir: Path, name: str, nth: int) -> None:
    path = disk_dir / name
    old = {"w": torch.randn(256, 1024)}
    tensortier.save(old, path)
    before = path.read_bytes()
    new = {"w": torch.randn(256, 1024), "v": torch.randn(100000)}
    fault = {"kind": "error", "errno": errno.ENOSPC, "nth": nth, "reads": False}
    # (close() re-raises the fault)
    io = with_faults(fault, IOHandle, "threads", chunk_size=64 << 10)
    with pytest.raises(OSError) as info:
        tensortier.save(new, path, _io=io)
    assert info.value.errno == errno.ENOSPC
    assert path.read_bytes() == before
    assert leftovers(disk_dir) == []
    assert torch.equal(tensortier.load(path)["w"], old["w"])


@pytest.mark.parametrize("name", ["m.safetensors", "m.pt"])
def test_failure_before_rename_and_in_fsync(disk_dir: Path, name: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    path = disk_dir / name
    tensortier.save({"w": torch.ones(10)}, path)
    before = path.read_bytes()

    io = with_faults({"kind": "error", "errno": errno.EIO, "steps": ["datasync"]}, IOHandle,
                     "threads")
    with pytest.raises(OSError, match="fdatasync failed"):
        tensortier.save({"w": torch.zeros(10)}, path, _io=io)
    assert path.read_bytes() == before and leftovers(disk_dir) == []

    # Every file is written by one C++ writer (a .pt's TorchFileWriter, a .safetensors'
    # SafetensorsFileWriter): the interrupt comes once the bytes are in the file, before the
    # commit (each commits in a call of its own).
    from tensortier import _core

    class InterruptedTorchWriter(_core.TorchFileWriter):  # type: ignore[misc]
        def write(self, engine: object, out: object, addresses: object,
                  commit: bool = False) -> None:
            super().write(engine, out, addresses, commit)
            raise KeyboardInterrupt

    class InterruptedSafetensorsWriter(_core.SafetensorsFileWriter):  # type: ignore[misc]
        def write(self, *args: object) -> None:
            super().write(*args)
            raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(_core, "TorchFileWriter", InterruptedTorchWriter)
        m.setattr(_core, "SafetensorsFileWriter", InterruptedSafetensorsWriter)
        with pytest.raises(KeyboardInterrupt):
            tensortier.save({"w": torch.zeros(10), "v": torch.zeros(5), "u": torch.ones(2)}, path)
    assert path.read_bytes() == before and leftovers(disk_dir) == []


def test_save_into_missing_directory(disk_dir: Path) -> None:
    with pytest.raises(FileNotFoundError, match="directory does not exist: create it first"):
        tensortier.save({"w": torch.ones(1)}, disk_dir / "no" / "m.safetensors")
    (disk_dir / "f").write_bytes(b"")  # a file where a directory should be: ENOTDIR
    with pytest.raises(NotADirectoryError, match="m.pt"):
        tensortier.save({"w": torch.ones(1)}, disk_dir / "f" / "m.pt")
    assert sorted(os.listdir(disk_dir)) == ["f"]
    with pytest.raises(IsADirectoryError):
        os.mkdir(disk_dir / "d.safetensors")
        tensortier.save({"w": torch.ones(1)}, disk_dir / "d.safetensors")


def test_save_replaces_and_keeps_mode(disk_dir: Path) -> None:
    path = disk_dir / "m.safetensors"
    tensortier.save({"w": torch.ones(1)}, path)
    os.chmod(path, 0o600)
    tensortier.save({"w": torch.zeros(1)}, path)
    assert (os.stat(path).st_mode & 0o777) == 0o600
    assert tensortier.load(path)["w"].item() == 0.0
    assert leftovers(disk_dir) == []


def _descriptors_of(target: str) -> list[str]:
    """This process's descriptors open on `target` (as /proc shows their paths)."""
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile (listdir's own descriptor)
        if link == target:
            fds.append(fd)
    return fds


# Local block filesystems, where a save frees the replaced file on a thread of its own.
_FREES_BLOCKS_IN_RENAME = {0xEF53, 0x58465342, 0x9123683E}


def _releasing_slowly(disk_dir: Path, seconds: float) -> IOHandle:
    """An IOHandle whose saves close the replaced file `seconds` late (the fault seam's delay
    of the "release" step); skips where the filesystem frees replaced files in the rename."""
    if tensortier._core.filesystem_magic(str(disk_dir)) not in _FREES_BLOCKS_IN_RENAME:
        pytest.skip("the test directory's filesystem frees replaced files in the rename")
    fault = {"kind": "delay", "delay_us": int(seconds * 1e6), "steps": ["release"]}
    return with_faults(fault, IOHandle, "threads")


def test_replaced_file_is_freed_after_save_returns_and_before_the_next_save(
    disk_dir: Path,
) -> None:
    path = disk_dir / "m.safetensors"
    slow = _releasing_slowly(disk_dir, 3.0)
    tensortier.save({"w": torch.ones(1000)}, path)
    tensortier.save({"w": torch.zeros(1000)}, path, _io=slow)  # returns while the old is held
    assert len(_descriptors_of(f"{path} (deleted)")) == 1
    assert tensortier.load(path)["w"].sum().item() == 0.0
    import threading

    second = threading.Thread(target=tensortier.save, args=({"w": torch.ones(10)}, path))
    second.start()
    second.join(0.3)
    assert second.is_alive()  # waits for the first replaced file to be freed
    second.join()
    internals._wait_for_replaced_files()  # noqa: SLF001 - the test's own wait
    assert _descriptors_of(f"{path} (deleted)") == []
    assert tensortier.load(path)["w"].tolist() == [1.0] * 10
    assert leftovers(disk_dir) == []


def test_a_child_forked_while_a_replaced_file_is_held_does_not_keep_it(disk_dir: Path) -> None:
    """The descriptor holding a replaced file is closed in a child made by fork() (it would
    keep the old file's blocks for the child's whole life: DataLoader workers forked next to a
    thread that saves)."""
    path = disk_dir / "m.safetensors"
    slow = _releasing_slowly(disk_dir, 5.0)
    tensortier.save({"w": torch.ones(1000)}, path)
    tensortier.save({"w": torch.zeros(1000)}, path, _io=slow)
    try:
        assert len(_descriptors_of(f"{path} (deleted)")) == 1
        pid = os.fork()
        if pid == 0:  # the child: no descriptor of the old file, and saves still work
            code = 1
            try:
                if _descriptors_of(f"{path} (deleted)") == []:
                    tensortier.save({"w": torch.ones(3)}, disk_dir / "child.safetensors")
                    code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        internals._wait_for_replaced_files()  # noqa: SLF001
    assert _descriptors_of(f"{path} (deleted)") == []


def test_failed_rename_releases_the_replaced_file(disk_dir: Path) -> None:
    path = disk_dir / "m.safetensors"
    tensortier.save({"w": torch.ones(4)}, path)
    io = with_faults({"kind": "error", "errno": errno.EIO, "steps": ["rename"]}, IOHandle,
                     "threads")
    with pytest.raises(OSError, match="rename failed"):
        tensortier.save({"w": torch.zeros(4)}, path, _io=io)
    internals._wait_for_replaced_files()  # noqa: SLF001
    assert _descriptors_of(str(path)) == []
    assert tensortier.load(path)["w"].tolist() == [1.0] * 4
    assert leftovers(disk_dir) == []


# Each system call of a save, failed in turn through the fault seam, and what the error says.
_SAVE_STEPS = {
    "open": "creating its temporary file",
    "allocate": "fallocate failed",
    "datasync": "fdatasync failed",
    "rename": "rename failed",
}


@pytest.mark.parametrize("name", ["m.safetensors", "m.pt"])
@pytest.mark.parametrize("step", sorted(_SAVE_STEPS))
def test_each_failed_step_of_a_save_keeps_the_old_checkpoint(
    disk_dir: Path, name: str, step: str
) -> None:
    path = disk_dir / name
    old = {"w": torch.randn(64, 33)}
    tensortier.save(old, path)
    before = path.read_bytes()
    io = with_faults({"kind": "error", "errno": errno.ENOSPC, "steps": [step]}, IOHandle, "threads")
    with pytest.raises(OSError) as info:
        tensortier.save({"w": torch.randn(100, 7), "v": torch.ones(3)}, path, _io=io)
    assert info.value.errno == errno.ENOSPC
    assert _SAVE_STEPS[step] in str(info.value) and str(path) in str(info.value), info.value
    assert faults_injected(io._file_system) == 1  # noqa: SLF001
    assert path.read_bytes() == before
    internals._wait_for_replaced_files()  # noqa: SLF001
    assert leftovers(disk_dir) == []
    assert torch.equal(tensortier.load(path)["w"], old["w"])


@pytest.mark.parametrize("name", ["m.safetensors", "m.pt"])
def test_a_failed_save_into_a_new_path_leaves_nothing(disk_dir: Path, name: str) -> None:
    path = disk_dir / name
    for step in sorted(_SAVE_STEPS):
        io = with_faults({"kind": "error", "errno": errno.EIO, "steps": [step]}, IOHandle,
                         "threads")
        with pytest.raises(OSError, match=_SAVE_STEPS[step]):
            tensortier.save({"w": torch.ones(5)}, path, _io=io)
        assert os.listdir(disk_dir) == [], step


@pytest.mark.parametrize("name", ["m.safetensors", "m.pt"])
def test_a_failed_directory_fsync_is_reported_after_the_rename(disk_dir: Path, name: str) -> None:
    """The rename happened: the path holds the new checkpoint whole; only whether the rename
    survives a power loss is unknown, which the error says."""
    path = disk_dir / name
    tensortier.save({"w": torch.ones(5)}, path)
    io = with_faults({"kind": "error", "errno": errno.EIO, "steps": ["sync_directory"]},
                     IOHandle, "threads")
    with pytest.raises(OSError, match="fsync the directory of") as info:
        tensortier.save({"w": torch.zeros(7)}, path, _io=io)
    assert info.value.errno == errno.EIO and str(path) in str(info.value)
    assert torch.equal(tensortier.load(path)["w"], torch.zeros(7))
    internals._wait_for_replaced_files()  # noqa: SLF001
    assert leftovers(disk_dir) == []


@pytest.mark.parametrize("name", ["m.safetensors", "m.pt"])
@pytest.mark.parametrize("mmap", [False, True])
def test_a_failed_open_of_a_load_names_the_path(disk_dir: Path, name: str, mmap: bool) -> None:
    path = disk_dir / name
    tensortier.save({"w": torch.ones(5)}, path)
    fault = {"kind": "error", "errno": errno.EACCES, "steps": ["open"]}
    with pytest.raises(PermissionError, match="open failed") as info:
        tensortier.load(path, mmap=mmap, _io=with_faults(fault, IOHandle, "threads"))
    assert str(path) in str(info.value)
    with pytest.raises(PermissionError, match="open failed"):
        tensortier.load_into({"w": torch.empty(5)}, path,
                             _io=with_faults(fault, IOHandle, "threads"))


@pytest.mark.parametrize("name", ["m.safetensors", "m.pt"])
def test_a_failed_read_of_a_load_names_the_path(disk_dir: Path, name: str) -> None:
    path = disk_dir / name
    tensortier.save({"w": torch.randn(100000)}, path)
    io = with_faults({"kind": "error", "errno": errno.EIO, "writes": False}, IOHandle, "threads")
    with pytest.raises(OSError) as info:
        tensortier.load(path, _io=io)
    assert info.value.errno == errno.EIO and name in str(info.value), info.value


@pytest.mark.parametrize("name", ["m.safetensors", "m.pt"])
def test_short_reads_of_a_load_are_completed_not_taken_as_data(disk_dir: Path, name: str) -> None:
    path = disk_dir / name
    saved = {"w": torch.randn(100000)}
    tensortier.save(saved, path)
    fault = {"kind": "short", "short_bytes": 1000, "count": 50, "writes": False}
    io = with_faults(fault, IOHandle, "threads", chunk_size=64 << 10)
    assert torch.equal(tensortier.load(path, _io=io)["w"], saved["w"])


@pytest.mark.parametrize("verify", [False, True])
def test_the_records_of_a_torch_file_are_read_through_the_engine(
    disk_dir: Path, verify: bool
) -> None:
    """data.pkl and the other zip records are read by the engine, not os.pread: a fault there
    fails a load whose tensors map the file (no other read), and the error names the file."""
    path = disk_dir / "m.pt"
    tensortier.save({"w": torch.ones(5)}, path)
    io = with_faults({"kind": "error", "errno": errno.EIO, "writes": False}, IOHandle, "threads")
    with pytest.raises(OSError) as info:
        tensortier.load(path, mmap=True, verify=verify, _io=io)
    assert info.value.errno == errno.EIO and str(path) in str(info.value), info.value
    assert torch.equal(tensortier.load(path, mmap=True, verify=verify)["w"], torch.ones(5))


def test_save_through_symlink_replaces_its_target(disk_dir: Path) -> None:
    real = disk_dir / "real.safetensors"
    tensortier.save({"w": torch.ones(1)}, real)
    link = disk_dir / "link.safetensors"
    link.symlink_to(real.name)
    tensortier.save({"w": torch.zeros(1)}, link)
    assert link.is_symlink() and tensortier.load(real)["w"].item() == 0.0
    assert leftovers(disk_dir) == []


def test_read_error_is_oserror(disk_dir: Path) -> None:
    path = disk_dir / "m.safetensors"
    tensortier.save({"w": torch.randn(100000)}, path)
    fault = {"kind": "error", "errno": errno.EIO, "nth": 1, "writes": False}
    io = with_faults(fault, IOHandle, "threads")
    with pytest.raises(OSError) as info:
        tensortier.load(path, _io=io)
    assert info.value.errno == errno.EIO


def test_torch_pickle_failures_are_valueerrors(disk_dir: Path) -> None:
    path = disk_dir / "m.pt"
    with pytest.raises(ValueError, match="torch.save cannot save"):
        tensortier.save({"f": lambda: 1}, path)
    assert leftovers(disk_dir) == [] and not path.exists()
    a = torch.zeros(8)
    with pytest.raises(ValueError, match="different types"):  # torch refuses mixed-dtype views
        tensortier.save({"a": a, "b": a.view(torch.int32)}, path)
    assert leftovers(disk_dir) == [] and not path.exists()


def test_a_storage_without_data_is_a_valueerror_leaving_nothing(disk_dir: Path) -> None:
    # A storage outside host memory is staged after the first records are written (a meta one
    # has nothing to stage): the writes in flight finish before the file is removed.
    path = disk_dir / "m.pt"
    sd = {"w": torch.ones(1 << 20), "s": torch.UntypedStorage(8, device="meta")}
    with pytest.raises(ValueError, match="no data"):
        tensortier.save(sd, path)
    assert leftovers(disk_dir) == [] and not path.exists()


@pytest.mark.parametrize("kind,says", [
    ("quantized", "holds quantized tensors"),
    ("empty quantized", "holds quantized tensors"),
    ("nested", "holds nested tensors"),
    ("sparse", "'x' is a sparse_coo tensor: load_into reads dense tensors"),
    ("sparse_csr", "'x' is a sparse_csr tensor: load_into reads dense tensors"),
    ("meta", "'x' has no data in the file"),
])
def test_load_into_a_file_with_tensors_it_cannot_read_is_a_clear_error(
    tmp_path: Path, kind: str, says: str
) -> None:
    # A valid torch.save file (tensortier.load reads it), not a malformed one.
    x = {
        "quantized": lambda: torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.quint8),
        "empty quantized": lambda: torch.quantize_per_tensor(torch.ones(0), 0.1, 0, torch.quint8),
        "nested": lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
        "sparse": lambda: torch.eye(3).to_sparse(),
        "sparse_csr": lambda: torch.eye(3).to_sparse_csr(),
        "meta": lambda: torch.empty(2, device="meta"),
    }[kind]()
    path = tmp_path / "x.pt"
    torch.save({"x": x, "w": torch.ones(3)}, path)
    assert set(tensortier.load(path)) == {"x", "w"}
    with pytest.raises(ValueError) as info:
        tensortier.load_into({"w": torch.zeros(3)}, path, strict=False)
    assert says in str(info.value) and str(path) in str(info.value)
    assert "malformed" not in str(info.value) and "use tensortier.load" in str(info.value)


def test_load_into_meta_targets_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    tensortier.save({"a": torch.ones(4), "b": torch.ones(4)}, path)
    with pytest.raises(ValueError, match="meta device"):
        tensortier.load_into({"a": torch.empty(4, device="meta"), "b": torch.empty(4)}, path)


def test_an_index_naming_an_index_is_refused_alike_by_load_and_the_cli(tmp_path: Path) -> None:
    """One reader of indexes (C++) for the package and the CLI."""
    from test_cli_convert import run

    index = tmp_path / "model.safetensors.index.json"
    other = tmp_path / "other.index.json"
    other.write_text(json.dumps({"weight_map": {"a": "m.safetensors"}}))
    for named in (index.name, other.name):
        index.write_text(json.dumps({"weight_map": {"a": named}}))
        said = f"shard '{named}' is itself an index"
        with pytest.raises(ValueError, match=said):
            tensortier.load_into({"a": torch.empty(4)}, index)
        with pytest.raises(ValueError, match=said):
            tensortier.load(index)
        for command in ("info", "verify"):
            r = run(command, index)
            assert r.returncode == 1 and said in r.stderr, r.stderr


def test_an_index_spelling_one_shard_two_ways_reads_it_once_in_load_and_the_cli(
    tmp_path: Path,
) -> None:
    from test_cli_convert import run

    tensortier.save({"a": torch.ones(2), "b": torch.zeros(3)}, tmp_path / "s.safetensors",
                    checksum=True)
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "s.safetensors", "b": "./s.safetensors"}}))
    loaded = tensortier.load(index)
    assert torch.equal(loaded["a"], torch.ones(2)) and torch.equal(loaded["b"], torch.zeros(3))
    r = run("info", index)
    assert r.returncode == 0 and "1 shard, 2 tensors" in r.stdout, r.stdout + r.stderr
    r = run("verify", index)
    assert r.returncode == 0 and "all 1 shards OK" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
@pytest.mark.parametrize("into", [False, True])
def test_a_file_replaced_while_loading_is_read_from_one_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, suffix: str, into: bool
) -> None:
    # An atomic save by another process renames a new checkpoint over the path right after the
    # header (or zip directory) was parsed: the bytes must still come from the parsed file.
    path = tmp_path / f"m{suffix}"
    other = tmp_path / f"other{suffix}"
    old = {"w": torch.arange(5000, dtype=torch.float32)}
    new = {"a": torch.ones(3), "w": -torch.arange(5000, dtype=torch.float32)}  # another layout
    tensortier.save(old, path)
    tensortier.save(new, other)
    name = "_read_st_header" if suffix == ".safetensors" else "_unpickle_torch"
    real = getattr(internals, name)

    def parse_then_replace(*args: object, **kwargs: object) -> object:
        out = real(*args, **kwargs)
        if other.exists():
            os.replace(other, path)
        return out

    monkeypatch.setattr(safetensors if name == "_read_st_header" else unpickler, name,
                        parse_then_replace)
    if into:
        target = {"w": torch.empty(5000)}
        tensortier.load_into(target, path)
        assert torch.equal(target["w"], old["w"])
    else:
        assert torch.equal(tensortier.load(path)["w"], old["w"])


def test_save_removes_temporary_files_of_killed_saves(tmp_path: Path) -> None:
    import subprocess
    import sys
    import time

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid is gone (reuse within this test is vanishingly unlikely)
    hour_ago = time.time() - 2 * 3600
    path = tmp_path / "m.safetensors"

    def temp(pid: int, token: str, old: bool) -> Path:
        p = tmp_path / f".m.safetensors.tmp-{pid}-{token}"
        p.write_bytes(b"x" * 4096)
        if old:
            os.utime(p, (hour_ago, hour_ago))
        return p

    killed = temp(dead.pid, "0123abcd", old=True)
    recent = temp(dead.pid, "4567abcd", old=False)  # maybe a save on another machine
    alive = temp(os.getpid(), "89abcdef", old=True)  # this process: not killed
    other = tmp_path / f".other.safetensors.tmp-{dead.pid}-0123abcd"  # another checkpoint's
    other.write_bytes(b"x")
    os.utime(other, (hour_ago, hour_ago))
    tensortier.save({"a": torch.ones(3)}, path)
    assert not killed.exists()
    assert recent.exists() and alive.exists() and other.exists()
    assert torch.equal(tensortier.load(path)["a"], torch.ones(3))


def test_a_failed_device_read_still_waits_for_the_other_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CUDA read fails with a RuntimeError (CudaError): the error reaches the caller, and every
    other read still in flight is waited for before its memory can be freed."""
    monkeypatch.setattr(_format, "_GROUP_BYTES", 1)  # one future per tensor
    waited: list[int] = []

    class Future:
        def __init__(self, index: int) -> None:
            self.index = index

        def result(self) -> object:
            if self.index == 0:
                raise RuntimeError("injected: cuMemcpyHtoDAsync failed")
            raise AssertionError("only the first result is asked for")

        def wait(self) -> None:
            waited.append(self.index)
            if self.index == 0:
                raise RuntimeError("injected: cuMemcpyHtoDAsync failed")

    class FakeIO:
        def __init__(self) -> None:
            self.count = 0

        def pread_batch_async(self, batch: object, *, stage_reads: bool = False) -> Future:
            self.count += 1
            return Future(self.count - 1)

    pieces = [internals._Piece(f"t{i}", None, 0, 16, torch.zeros(16, dtype=torch.uint8))
              for i in range(3)]
    progress = internals._Progress("x", 48, False)
    with pytest.raises(RuntimeError, match="injected"):
        internals._read_batched(FakeIO(), pieces, progress, "m.safetensors")  # type: ignore[arg-type]
    assert waited == [0, 1, 2]


def test_device_pieces_go_to_the_engine_unless_they_carry_a_checksum(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Routing of _read_pieces, with meta tensors standing in for CUDA ones: CPU pieces, checked
    or not, go to the pipeline in C++ (read and checked there), unchecked device pieces to the
    engine's GPU path, checked device pieces through the pinned host buffers, where their bytes
    can be hashed."""
    seen: dict[str, list[str]] = {}
    monkeypatch.setattr(_reading, "_read_host_pieces",
                        lambda io, ps, prog, path: seen.setdefault("host", [p.name for p in ps]))
    monkeypatch.setattr(_reading, "_read_batched",
                        lambda io, ps, prog, path: seen.setdefault("engine", [p.name for p in ps]))
    monkeypatch.setattr(_reading, "_read_device_checked",
                        lambda io, ps, prog, path: seen.setdefault("pinned", [p.name for p in ps]))

    def piece(name: str, device: str, checked: bool) -> internals._Piece:
        return internals._Piece(name, None, 0, 4, torch.empty(4, device=device),
                                 ("xxh64", 0) if checked else None)

    pieces = [piece("cpu", "cpu", False), piece("cpu-checked", "cpu", True),
              piece("dev", "meta", False), piece("dev-checked", "meta", True)]
    progress = internals._Progress("x", 16, False)
    internals._read_pieces(None, pieces, progress, "m")  # type: ignore[arg-type]
    assert seen == {"host": ["cpu", "cpu-checked"], "engine": ["dev"], "pinned": ["dev-checked"]}


def _oversized_view_file(disk_dir: Path) -> Path:
    """A torch file whose tensor "a" (1000 floats) claims a 4-element storage record: torch.load
    refuses it ("Trying to resize storage that is not resizable")."""
    ok = disk_dir / "ok.pt"
    torch.save({"a": torch.zeros(1000), "z": torch.full((1000,), 7.0)}, ok)
    with zipfile.ZipFile(ok) as z:
        pkl = next(n for n in z.namelist() if n.endswith("data.pkl"))
        data = z.read(pkl)
    assert data.count(b"M\xe8\x03") >= 1  # BININT2 1000: the storage's element count
    bad = disk_dir / "oversized.pt"
    rezip(ok, bad, replace={"data.pkl": data.replace(b"M\xe8\x03", b"M\x04\x00", 1),
                            "data/0": b"\0" * 16})
    with pytest.raises(RuntimeError):
        torch.load(bad, weights_only=True)
    return bad


@pytest.mark.parametrize("mapped", [False, True], ids=["read", "mmap"])
def test_tensor_past_the_end_of_its_storage(disk_dir: Path, mapped: bool) -> None:
    """A tensor larger than its storage record must not take bytes of other records (mmap, meta
    storages of load_into) nor grow its storage to any size a few bytes of pickle ask for."""
    bad = _oversized_view_file(disk_dir)
    with pytest.raises(ValueError, match="past the end of storage|not resizable"):
        tensortier.load(bad, mmap=mapped)


def _huge_view_file(disk_dir: Path, misaligned: bool) -> Path:
    """A torch file whose tensor "a" asks for 2**31 - 1 floats (8 GiB) of a 16-byte storage
    record; `misaligned`: the record's offset is not a multiple of 4 (mmap loads copy it)."""
    ok = disk_dir / "ok.pt"
    torch.save({"a": torch.zeros(1000)}, ok)
    with zipfile.ZipFile(ok) as z:
        pkl = next(n for n in z.namelist() if n.endswith("data.pkl"))
        data = z.read(pkl)
    # The storage's element count (first BININT2 1000) -> 4, the tensor's size (second) ->
    # BININT 2**31 - 1.
    data = data.replace(b"M\xe8\x03", b"M\x04\x00", 1).replace(b"M\xe8\x03", b"J\xff\xff\xff\x7f", 1)
    for pad in range(4):  # bytes after the pickle's STOP shift the record; pickle ignores them
        bad = disk_dir / f"huge{pad}.pt"
        rezip(ok, bad, replace={"data.pkl": data + b"\0" * pad, "data/0": b"\0" * 16})
        offset = next(r.offset for n, r in internals._zip_records(str(bad)).items()
                      if n.endswith("data/0"))
        if (offset % 4 != 0) == misaligned:
            return bad
    raise AssertionError("no padding gave the wanted alignment")


@pytest.mark.parametrize("mapped, misaligned", [(False, False), (True, False), (True, True)],
                         ids=["read", "mmap", "mmap-misaligned-copy"])
def test_a_few_bytes_of_pickle_allocate_nothing_huge(disk_dir: Path, mapped: bool,
                                                     misaligned: bool) -> None:
    """A tensor asking 8 GiB of a 16-byte storage is refused when torch sets it on the storage,
    as torch.load refuses it, before any storage grows: every CPU storage is fixed-size (a
    mapped window, or a copy of a misaligned one, was not: it grew first)."""
    bad = _huge_view_file(disk_dir, misaligned)
    with pytest.raises(RuntimeError, match="not resizable"):
        torch.load(bad, weights_only=True)
    with pytest.raises(ValueError, match="not resizable"):
        tensortier.load(bad, mmap=mapped)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_few_bytes_of_pickle_allocate_no_gpu_memory(disk_dir: Path) -> None:
    """CUDA storages can grow: the pickle is checked on meta storages first, so the file is
    refused for what it is, not by an allocation of 8 GiB (or an out-of-memory error)."""
    bad = _huge_view_file(disk_dir, misaligned=False)
    torch.cuda.reset_peak_memory_stats()  # (an earlier test's peak would hide this one's)
    before = torch.cuda.max_memory_allocated()
    with pytest.raises(ValueError, match="past the end of storage"):
        tensortier.load(bad, device="cuda")
    assert torch.cuda.max_memory_allocated() - before < 1 << 20


@pytest.mark.parametrize("mapped", [False, True], ids=["read", "mmap"])
def test_an_empty_storage_does_not_grow_either(disk_dir: Path, mapped: bool) -> None:
    """A 0-byte storage record whose tensor asks for 2**31 - 1 floats: refused when torch sets
    the tensor on it (as torch.load), not after growing it to 8 GiB."""
    ok = disk_dir / "empty.pt"
    torch.save({"a": torch.zeros(0, 3)}, ok)
    with zipfile.ZipFile(ok) as z:
        pkl = next(n for n in z.namelist() if n.endswith("data.pkl"))
        data = z.read(pkl)
    assert data.count(b"K\x00K\x03\x86") == 1  # the size tuple (0, 3)
    bad = disk_dir / "empty-huge.pt"
    rezip(ok, bad, replace={"data.pkl": data.replace(b"K\x00K\x03\x86",
                                                     b"J\xff\xff\xff\x7fK\x01\x86")})
    with pytest.raises(RuntimeError, match="not resizable"):
        torch.load(bad, weights_only=True)
    with pytest.raises(ValueError, match="not resizable"):
        tensortier.load(bad, mmap=mapped)


def test_sparse_tensors_load_with_invariant_checks_after_meta_passes(disk_dir: Path) -> None:
    """Meta passes over a pickle (load_into's, the check before a GPU load) must not leave
    meta sparse tensors in torch's queue of tensors to check: under
    check_sparse_tensor_invariants the next load would fail reading them."""
    path = disk_dir / "sparse.pt"
    torch.save({"s": torch.eye(3).to_sparse(), "d": torch.ones(2)}, path)
    internals._unpickle_torch(str(path), torch.device("meta"))
    with torch.sparse.check_sparse_tensor_invariants():
        out = tensortier.load(path)
    assert torch.equal(out["s"].to_dense(), torch.eye(3))


def test_load_into_refuses_a_tensor_past_the_end_of_its_storage(disk_dir: Path) -> None:
    bad = _oversized_view_file(disk_dir)
    target = {"a": torch.zeros(1000), "z": torch.zeros(1000)}
    for verify in (False, True):
        with pytest.raises(ValueError, match="past the end of storage data/0"):
            tensortier.load_into(target, bad, verify=verify)
    assert target["a"].abs().sum().item() == 0  # checked before any byte is read


def test_save_refuses_to_replace_what_is_not_a_regular_file(disk_dir: Path) -> None:
    """save() renames a new file over the old one: over a FIFO or a device (as root: /dev/null)
    that would replace it. torch.save writes through; we refuse, and the node stays."""
    fifo = disk_dir / "fifo"
    os.mkfifo(fifo)
    for fmt in ("torch", "safetensors"):
        with pytest.raises(OSError) as e:
            tensortier.save({"a": torch.ones(2)}, fifo, format=fmt)
        assert e.value.errno == errno.EINVAL and "not a regular file" in str(e.value)
        assert fifo.is_fifo()
    assert leftovers(disk_dir) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="only root may replace a read-only file")
def test_save_over_a_read_only_checkpoint_keeps_its_mode(disk_dir: Path) -> None:
    """Root replaces a 0444 checkpoint (as torch.save, whose open() root passes) and the new one
    is 0444 too; the temporary file is made writable by its owner, whatever the old mode (it
    took the old mode at creation and could not be opened for writing). Other users are
    refused: test_checkpoint_files.py."""
    for name in ("m.safetensors", "m.pt"):
        path = disk_dir / name
        tensortier.save({"w": torch.ones(3)}, path)
        os.chmod(path, 0o444)
        tensortier.save({"w": torch.zeros(3)}, path)
        assert (os.stat(path).st_mode & 0o777) == 0o444
        assert tensortier.load(path)["w"].sum().item() == 0
    assert leftovers(disk_dir) == []


def test_safetensors_with_other_fields_of_a_tensor_load(disk_dir: Path) -> None:
    """Fields other writers add to a tensor's entry: the safetensors package ignores them."""
    header = good_header()
    header["a"]["extra"] = {"nested": [1, 2.5, None]}
    path = disk_dir / "extra.safetensors"
    write_safetensors(path, header, struct.pack("<2fq", 1.5, -2.0, 7))
    st = pytest.importorskip("safetensors.torch")
    want = st.load_file(str(path))
    got = tensortier.load(path)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k])


# ---- the meta device ---------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["map_location", "device", "torch.device", "dict"])
def test_a_load_to_the_meta_device_gives_shapes_and_dtypes_as_torch_does(
    disk_dir: Path, where: str
) -> None:
    state = {"a": torch.arange(10.0), "b": torch.ones(3, 4, dtype=torch.int16),
             "c": torch.zeros(0, dtype=torch.bfloat16)}
    state["v"] = state["a"][2:6]  # a view: shares a's storage
    pt = disk_dir / "m.pt"
    torch.save(state, pt)
    st = disk_dir / "m.safetensors"
    tensortier.save({k: v for k, v in state.items() if k != "v"}, st)
    how: dict[str, Any] = {
        "map_location": {"map_location": "meta"},
        "device": {"device": "meta"},
        "torch.device": {"map_location": torch.device("meta")},
        "dict": {"map_location": {"cpu": "meta"}},
    }[where]
    expected = torch.load(pt, map_location="meta", weights_only=True)
    for path in (pt, st):
        got = tensortier.load(path, **how)
        for name, t in got.items():
            assert t.device.type == "meta", (path, name)
            assert t.shape == expected[name].shape and t.dtype == expected[name].dtype
            assert t.stride() == expected[name].stride(), (path, name)
            assert t.storage_offset() == expected[name].storage_offset(), (path, name)
    with pytest.raises(ValueError, match="verify=True .* meta device reads none"):
        tensortier.load(pt, map_location="meta", verify=True)
    # mmap reads no bytes there either: meta tensors, as torch.load(mmap=True) gives
    assert tensortier.load(pt, map_location="meta", mmap=True)["a"].is_meta


@pytest.mark.parametrize("to", ["meta", torch.device("meta"), "meta:0"])
def test_verify_refuses_a_map_location_dict_that_sends_storages_to_meta(
    disk_dir: Path, to: Any
) -> None:
    pt, st = disk_dir / "m.pt", disk_dir / "m.safetensors"
    tensortier.save({"a": torch.arange(10.0)}, pt, checksum=True)
    tensortier.save({"a": torch.arange(10.0)}, st, checksum=True)
    for path in (pt, st):
        # A location the file does not use is refused too: the request contradicts itself.
        for mapping in ({"cpu": to}, {"cuda:1": to, "cpu": "cpu"}):
            with pytest.raises(ValueError, match=r"verify=True .* to the meta device"):
                tensortier.load(path, map_location=mapping, verify=True)
        # Mapped elsewhere, the bytes are read and checked.
        got = tensortier.load(path, map_location={"cpu": "cpu", "cuda:1": "cpu"}, verify=True)
        assert torch.equal(got["a"], torch.arange(10.0))
        assert tensortier.load(path, map_location={"cpu": to})["a"].is_meta


@pytest.mark.parametrize("how", ["path", "file object"])
def test_damaged_files_raise_what_torch_and_safetensors_raise(disk_dir: Path, how: str) -> None:
    """Code that catches what torch.load (RuntimeError for a damaged zip, EOFError for an empty
    file) or safetensors (SafetensorError) raises for a damaged file catches tensortier.load's
    error too; each is also a ValueError, as documented."""
    import io

    from safetensors import SafetensorError
    from safetensors.torch import save_file

    pt, st, empty = disk_dir / "trunc.pt", disk_dir / "trunc.safetensors", disk_dir / "empty.pt"
    torch.save({"w": torch.ones(1000)}, pt)
    save_file({"w": torch.ones(1000)}, str(st))
    for f in (pt, st):
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    empty.write_bytes(b"")
    for path, theirs in ((pt, RuntimeError), (st, SafetensorError), (empty, EOFError)):
        with pytest.raises(theirs) as caught:
            tensortier.load(path if how == "path" else io.BytesIO(path.read_bytes()))
        assert isinstance(caught.value, ValueError), type(caught.value)
        if how == "path":
            assert str(path) in str(caught.value), caught.value
    assert issubclass(tensortier.DamagedCheckpointError, RuntimeError)
    assert issubclass(tensortier.EmptyCheckpointError, EOFError)
    # A file named .safetensors is read as safetensors reads it, whatever its bytes turn out to
    # be (empty, a pickle, a zip): its errors are safetensors' type then.
    if how == "path":
        for name, data in (("e.safetensors", b""), ("p.safetensors", b"\x80\x02}q\x00."),
                           ("z.SAFETENSORS", pt.read_bytes())):
            (disk_dir / name).write_bytes(data)
            with pytest.raises(SafetensorError) as caught:
                tensortier.load(disk_dir / name)
            assert isinstance(caught.value, ValueError) and name in str(caught.value)


def test_an_index_naming_a_json_shard_is_refused_not_recursed_into(tmp_path: Path) -> None:
    """A shard whose contents are an index, under a name without .index.json (itself, say)."""
    index = tmp_path / "w.json"
    index.write_text(json.dumps({"weight_map": {"a": "w.json"}}))
    with pytest.raises(ValueError, match="is itself an index"):
        tensortier.load(index)
    (tmp_path / "inner.json").write_text(json.dumps({"weight_map": {"a": "m.safetensors"}}))
    index.write_text(json.dumps({"weight_map": {"a": "inner.json"}}))
    with pytest.raises(ValueError, match="is itself an index"):
        tensortier.load(index)


def _local_object() -> Any:
    class Local:
        pass

    return Local()


@pytest.mark.parametrize("what", ["lambda", "local class", "dtype views of one storage"])
def test_an_object_torch_save_cannot_save_raises_torch_s_type_and_a_value_error(
        tmp_path: Path, what: str) -> None:
    """Code written for torch.save catches AttributeError (a lambda, a local class) or
    RuntimeError (two dtype views of one storage): so does ours, as well as ValueError."""
    import pickle

    x = torch.randn(4)
    obj = {"lambda": {"fn": lambda: 0}, "local class": {"o": _local_object()},
           "dtype views of one storage": {"a": x, "b": x.view(torch.int32)}}[what]
    with pytest.raises(Exception) as theirs:
        torch.save(obj, tmp_path / "theirs.pt")
    with pytest.raises(ValueError, match="torch.save cannot save this object") as ours:
        tensortier.save(obj, tmp_path / "ours.pt")
    assert isinstance(ours.value, type(theirs.value)), (type(ours.value), type(theirs.value))
    again = pickle.loads(pickle.dumps(ours.value))  # as a DataLoader worker's error travels
    assert type(again) is type(ours.value) and str(again) == str(ours.value)
    elsewhere = subprocess.run(  # into a process that never made the class
        [sys.executable, "-c", "import pickle, sys; e = pickle.loads(sys.stdin.buffer.read()); "
         "print(type(e).__name__, isinstance(e, ValueError))"],
        input=pickle.dumps(ours.value), capture_output=True, timeout=120)
    assert elsewhere.stdout.decode().split() == [type(ours.value).__name__, "True"], elsewhere
    assert not (tmp_path / "ours.pt").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with CUDA loads there")
def test_loading_to_cuda_without_cuda_raises_torch_s_runtime_error_and_a_value_error(
        tmp_path: Path) -> None:
    torch.save({"a": torch.ones(2)}, tmp_path / "m.pt")
    for where in ("cuda", {"cpu": "cuda"}, torch.device("cuda", 0)):
        with pytest.raises(RuntimeError):
            torch.load(tmp_path / "m.pt", map_location=where)
        with pytest.raises(tensortier.UnavailableDeviceError, match="CUDA is not available") as e:
            tensortier.load(tmp_path / "m.pt", map_location=where)
        assert isinstance(e.value, RuntimeError) and isinstance(e.value, ValueError)
    # A file without tensors (a scheduler's state) restores no storage: torch.load loads it.
    state = {"last_epoch": 3, "base_lrs": [0.1], "_step_count": 4}
    torch.save(state, tmp_path / "sched.pt")
    for where in ("cuda", "cuda:0", {"cpu": "cuda"}, torch.device("cuda", 0)):
        assert torch.load(tmp_path / "sched.pt", map_location=where) == state
        assert tensortier.load(tmp_path / "sched.pt", map_location=where) == state
    assert tensortier.load(tmp_path / "sched.pt", device="cuda") == state
    tensortier.save({"w": torch.ones(2)}, tmp_path / "m.safetensors")
    with pytest.raises(tensortier.UnavailableDeviceError):
        tensortier.load(tmp_path / "m.safetensors", device="cuda")


def test_a_third_positional_argument_that_is_no_format_says_which_keyword_it_needs(
        tmp_path: Path) -> None:
    """safetensors' save_file(tensors, filename, metadata) and torch.save(obj, f, pickle_module)
    put other things third: save says which keyword takes them."""
    import pickle

    tensors = {"w": torch.ones(2)}
    with pytest.raises(ValueError, match=r"not \{'step': '7'\} .*pass metadata as metadata="):
        tensortier.save(tensors, tmp_path / "m.safetensors", {"step": "7"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pass a pickle module as pickle_module="):
        tensortier.save(tensors, tmp_path / "m.pt", pickle)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^format must be 'safetensors' or 'torch', not 'npz'$"):
        tensortier.save(tensors, tmp_path / "m.pt", "npz")


def test_names_that_are_not_utf8_text(tmp_path: Path) -> None:
    """A lone surrogate (what os.fsdecode gives for a file name that is not UTF-8): torch.save
    writes it as a key, and so do we; a safetensors header cannot hold it (UnicodeEncodeError,
    a ValueError, as safetensors raises)."""
    key = "\udcff"
    for obj in ({key: torch.ones(2)}, {"m": {key: torch.ones(2)}}):
        tensortier.save(obj, tmp_path / "s.pt")
        again = torch.load(tmp_path / "s.pt")
        assert list(again) == list(obj)
        ours = tensortier.load(tmp_path / "s.pt")
        assert list(ours) == list(obj)
    with pytest.raises(UnicodeEncodeError, match="safetensors tensor name is UTF-8"):
        tensortier.save({key: torch.ones(2)}, tmp_path / "s.safetensors")
    assert not (tmp_path / "s.safetensors").exists()
