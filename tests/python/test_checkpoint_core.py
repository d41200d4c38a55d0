"""The torch-free checkpoint rules tensortier.load/save take from the C++ core, checked against
the CLI (which reads files by the same functions) and against the originals they replace:
format detection, the safetensors dtype table, and the CRC-32 patches of a torch.save zip."""

from __future__ import annotations

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

import tensortier
from tensortier import _core
from internals import _sniff

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")

BIN = Path(os.environ.get("TENSORTIER_CLI", Path(sys.executable).parent / "tensortier"))


def run_cli(*args: object) -> subprocess.CompletedProcess[str]:
    if not BIN.is_file():
        pytest.skip(f"no tensortier binary at {BIN}")
    return subprocess.run([str(BIN), *map(str, args)], capture_output=True, text=True, timeout=300)


def _safetensors_bytes(header_len_bytes: bytes | None = None) -> bytes:
    header = b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}'
    if header_len_bytes is not None:  # pad the header to the length those bytes say
        n = struct.unpack("<Q", header_len_bytes)[0]
        header = header + b" " * (n - len(header))
    return struct.pack("<Q", len(header)) + header + b"\x07"


INDEX = b'  \n{"weight_map": {"a": "shard.safetensors"}}'


@pytest.mark.parametrize(
    "name, content, kind",
    [
        ("m.bin", _safetensors_bytes(), "safetensors"),
        ("m.pt", INDEX, "index"),  # JSON from the first byte, whatever the name
        ("m.index.json", INDEX, "index"),
        ("m.bin", b"abc", "safetensors"),  # too short: the safetensors parser says why
    ],
)
def test_sniff_agrees_with_cli(disk_dir: Path, name: str, content: bytes, kind: str) -> None:
    path = disk_dir / name
    path.write_bytes(content)
    (disk_dir / "shard.safetensors").write_bytes(_safetensors_bytes())
    assert _sniff(str(path)) == kind
    r = run_cli("info", path)
    if kind == "index":
        assert r.returncode == 0 and r.stdout.startswith("index:"), r.stdout + r.stderr
    elif kind == "safetensors" and len(content) > 8:
        assert r.returncode == 0 and "safetensors" in r.stdout, r.stdout + r.stderr
    else:
        says = "not a safetensors file: 3 bytes, shorter than the 8-byte header length"
        assert r.returncode != 0 and says in r.stderr, r.stderr
        with pytest.raises(ValueError, match=re.escape(says)):
            tensortier.load(path)


def test_sniff_header_length_that_looks_like_json(disk_dir: Path) -> None:
    # An 8-byte header length starting with "{" (123) is still safetensors: byte 8 decides.
    path = disk_dir / "m.bin"
    path.write_bytes(_safetensors_bytes(b"{\0\0\0\0\0\0\0"))
    assert _sniff(str(path)) == "safetensors"
    assert tensortier.load(path)["a"].tolist() == [7]
    r = run_cli("info", path)
    assert r.returncode == 0 and not r.stdout.startswith("index:"), r.stdout + r.stderr


@pytest.mark.parametrize(
    "content, says",
    [(b"", "empty file (0 bytes)"), (b"\x80\x02}q\x00.", "legacy torch.save format")],
)
def test_sniff_refusals_agree_with_cli(disk_dir: Path, content: bytes, says: str) -> None:
    path = disk_dir / "m.pt"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=re.escape(f"{path}: {says}")):
        tensortier.load(path)
    r = run_cli("verify", path)
    assert r.returncode != 0 and f"{path}: {says}" in r.stderr, r.stderr


def test_dtype_table_matches_safetensors_package() -> None:
    table = {name: (attr, per) for name, attr, per in _core.safetensors_dtypes_for_torch()}
    for name, dtype in st._TYPES.items():  # the safetensors package's own name -> dtype table
        assert getattr(torch, table[name][0]) == dtype, name
        assert table[name][1] == 1
    assert table["F4"] == ("float4_e2m1fn_x2", 2)
    assert "F6_E2M3" not in table


# torch dtypes the C++ table leaves out: sub-byte integers no tensor can be made of.
_LEFT_OUT = {f"{sign}int{bits}" for sign in ("", "u") for bits in range(1, 8)}


def _every_torch_dtype() -> dict[torch.dtype, set[str]]:
    """Every dtype this torch has, with the attribute names it goes by."""
    out: dict[torch.dtype, set[str]] = {}
    for name in dir(torch):
        value = getattr(torch, name)
        if isinstance(value, torch.dtype):
            out.setdefault(value, set()).add(name)
    return out


def test_dtype_table_holds_every_torch_dtype() -> None:
    rows = {row["torch"]: row for row in _core.dtypes() if row["torch"]}
    storage_classes = torch.storage._dtype_to_storage_type_map()
    seen = set()
    for dtype, names in _every_torch_dtype().items():
        canonical = str(dtype).removeprefix("torch.")
        if canonical in _LEFT_OUT:
            assert canonical not in rows
            continue
        assert canonical in rows, f"torch.{canonical} is not in include/tensortier/checkpoint/dtypes.hpp"
        row = rows[canonical]
        seen.add(canonical)
        assert names == {row["torch"], row["torch_alias"]} - {""}, canonical
        assert dtype.itemsize * 8 == row["bits"], canonical
        assert row["storage"] == storage_classes.get(dtype, ""), canonical
        assert row["quantized"] == row["storage"].startswith("Q"), canonical
        if row["packing"] != 1 and not row["quantized"]:
            packed = next(r for r in _core.dtypes() if r["name"] == row["safetensors"])
            assert packed["bits"] * row["packing"] == row["bits"], canonical
    assert seen == set(rows)  # no row names a dtype torch lacks


def test_every_dtype_round_trips_through_both_formats(disk_dir: Path) -> None:
    """Every table dtype torch holds as a plain tensor: saved by tensortier as safetensors (read
    back by the safetensors package with the table's name in the header) and by torch.save,
    each loaded back by tensortier with its dtype and bytes."""
    rows = [r for r in _core.dtypes() if r["torch"] and not r["quantized"]]
    assert rows
    for row in rows:
        dtype = getattr(torch, row["torch"])
        t = torch.arange(96, dtype=torch.uint8).view(dtype).reshape(2, -1)
        torch.save({"t": t}, disk_dir / "t.pt")
        out = tensortier.load(disk_dir / "t.pt")["t"]
        assert out.dtype == dtype and torch.equal(out.view(torch.uint8), t.view(torch.uint8))
        if not row["safetensors"]:
            with pytest.raises(TypeError, match="safetensors has no dtype"):
                tensortier.save({"t": t}, disk_dir / "t.safetensors")
            continue
        tensortier.save({"t": t}, disk_dir / "t.safetensors")
        with open(disk_dir / "t.safetensors", "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        assert header["t"]["dtype"] == row["safetensors"], row["name"]
        out = tensortier.load(disk_dir / "t.safetensors")["t"]
        assert out.dtype == dtype and torch.equal(out.view(torch.uint8), t.view(torch.uint8))
        if row["packing"] == 1:
            theirs = st.load_file(disk_dir / "t.safetensors")["t"]
            assert theirs.dtype == dtype and torch.equal(theirs.view(torch.uint8), t.view(torch.uint8))


def test_f4_shapes_agree_with_cli_convert(disk_dir: Path) -> None:
    if not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip("this torch has no float4_e2m1fn_x2")
    t = torch.arange(6, dtype=torch.uint8).view(torch.float4_e2m1fn_x2).reshape(2, 3)
    path = disk_dir / "f4.safetensors"
    tensortier.save({"w": t}, path)
    r = run_cli("convert", path, disk_dir / "f4.pt")
    assert r.returncode == 0, r.stderr
    for loaded in (tensortier.load(path)["w"], tensortier.load(disk_dir / "f4.pt")["w"]):
        assert loaded.shape == (2, 3) and loaded.dtype == torch.float4_e2m1fn_x2
        assert loaded.view(torch.uint8).tolist() == t.view(torch.uint8).tolist()


def test_torch_save_with_checksums_passes_cli_verify(disk_dir: Path) -> None:
    path = disk_dir / "m.pt"
    tensortier.save({"a": torch.arange(1000), "b": torch.ones(7)}, path, checksum=True)
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None
    r = run_cli("verify", path)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


def _zip_of(records: dict[str, bytes]) -> bytes:
    import io

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, value in records.items():
            z.writestr(name, value)
    return buf.getvalue()


@pytest.mark.parametrize("records,says", [
    ({"data.pkl": "pkl", "version": b"3\n"}, "without a <folder>/data.pkl"),
    ({"x/data.pkl": "pkl", "y/data.pkl": "pkl", "x/version": b"3\n"}, "more than one data.pkl"),
    ({"m/data.pkl": "pkl", "m/constants.pkl": "pkl", "m/version": b"3\n"}, "TorchScript archive"),
    ({"m/data.pkl": "pkl", "m/version": b"11\n"}, "format version 11"),
])
def test_torch_archive_rules_agree_with_cli(
    disk_dir: Path, records: dict[str, Any], says: str
) -> None:
    # One rule (C++: TorchArchivePrefix, CheckTorchFileVersion) for the folder of the records
    # and the format version: a data.pkl outside a folder is refused, as torch refuses it.
    torch.save({"a": torch.ones(2)}, disk_dir / "ok.pt")
    with zipfile.ZipFile(disk_dir / "ok.pt") as z:
        pkl = z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))
    path = disk_dir / "bad.pt"
    path.write_bytes(_zip_of({n: pkl if v == "pkl" else v for n, v in records.items()}))
    for how in ("load", "mmap", "load_into"):
        with pytest.raises(ValueError, match=re.escape(says)):
            if how == "load_into":
                tensortier.load_into({}, path, strict=False)
            else:
                tensortier.load(path, mmap=how == "mmap")
    r = run_cli("info", path)
    assert r.returncode == 1 and says in r.stderr, r.stderr


def test_a_torchscript_archive_is_named_as_one_not_as_damage(disk_dir: Path) -> None:
    """torch.jit.save's archive (its code records compressed): load names it and points to
    torch.jit.load, as the CLI does, rather than calling a compressed record damage."""
    path = disk_dir / "jit.pt"
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), str(path))
    for how in ("load", "mmap"):
        with pytest.raises(ValueError, match="a TorchScript archive.*use torch.jit.load"):
            tensortier.load(path, mmap=how == "mmap")
    r = run_cli("info", path)
    assert r.returncode == 1 and "TorchScript archive" in r.stderr, r.stderr


@pytest.mark.parametrize("how", ["load", "mmap", "load_into", "meta"])
def test_a_torch_load_reads_the_zip_directory_once(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    # The directory of a 20,000-record zip takes ~19 ms to read: the format version is checked
    # from the same read that gives the records.
    path = disk_dir / "m.pt"
    torch.save({f"t{i}": torch.full((3,), float(i)) for i in range(50)}, path)
    reads: list[str] = []
    for name in ("zip_entries", "torch_zip_entries", "read_torch_checkpoint"):
        real = getattr(_core, name)

        def spy(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            reads.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(_core, name, spy)
    if how == "load_into":
        out = {f"t{i}": torch.zeros(3) for i in range(50)}
        tensortier.load_into(out, path)
    else:
        kwargs = {"map_location": "meta"} if how == "meta" else {"mmap": how == "mmap"}
        out = tensortier.load(path, **kwargs)
    if how != "meta":
        assert torch.equal(out["t7"], torch.full((3,), 7.0))
    assert reads == ["torch_zip_entries"]
