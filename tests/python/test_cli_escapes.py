"""The `tensortier` tool never puts a file's bytes raw on the terminal: names from safetensors
headers, torch.save pickles and zip directories, and paths given or found, are shown with control
characters and invalid UTF-8 escaped (\\x1b, \\n, \\xff, \\u009b; a backslash as \\\\)."""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import zipfile
from pathlib import Path

import pytest

from test_cli import BIN

torch = pytest.importorskip("torch")
import tensortier  # noqa: E402

# An OSC 52 clipboard write, a forged line, a carriage return, DEL and a C1 CSI (U+009B).
EVIL = "w\x1b]52;c;aGVsbG8=\x07\nforged: data OK\r\x7f\x9b"
EVIL_SHOWN = "w\\x1b]52;c;aGVsbG8=\\x07\\nforged: data OK\\r\\x7f\\u009b"
# A file name that is not UTF-8 (Latin-1 bytes) and starts a colour sequence.
BAD_NAME = b"m\x1b[31m\xff\xfe"
BAD_SHOWN = "m\\x1b[31m\\xff\\xfe"


def run(*args: str | bytes | Path) -> subprocess.CompletedProcess[bytes]:
    argv = [os.fsencode(a) for a in (BIN, *args)]
    return subprocess.run(argv, capture_output=True, timeout=300)


def assert_terminal_safe(r: subprocess.CompletedProcess[bytes]) -> str:
    """Both streams are UTF-8 with no control character but the newlines ending lines; returns
    them as one text."""
    for stream in (r.stdout, r.stderr):
        text = stream.decode("utf-8")  # strict: a byte that is not UTF-8 fails here
        bad = [c for c in text if c != "\n" and (ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F)]
        assert not bad, (bad, text)
    out = (r.stdout + r.stderr).decode()
    assert "\nforged" not in out, out  # no line of the tool's forged by a name
    return out


def safetensors_layout(path: Path) -> tuple[int, dict]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return 8 + n, json.loads(raw[8:8 + n])


def test_info_and_verify_show_safetensors_names_escaped(disk_dir: Path) -> None:
    path = disk_dir / "evil.safetensors"
    tensortier.save({EVIL: torch.arange(4, dtype=torch.float32), "plain": torch.ones(2)}, path,
                    metadata={f"key{EVIL}": f"value{EVIL}"}, checksum=True)
    r = run("info", path)
    assert r.returncode == 0, r.stderr
    out = assert_terminal_safe(r)
    assert f"  {EVIL_SHOWN} " in out and f"key{EVIL_SHOWN} = value{EVIL_SHOWN}" in out, out
    assert "  plain " in out

    r = run("verify", path)
    assert r.returncode == 0, r.stderr
    assert_terminal_safe(r)
    data_start, header = safetensors_layout(path)
    with open(path, "r+b") as f:  # damage the evil tensor's data: verify names it
        f.seek(data_start + header[EVIL]["data_offsets"][0])
        f.write(b"\xff")
    r = run("verify", path)
    assert r.returncode == 1
    out = assert_terminal_safe(r)
    assert f"tensor '{EVIL_SHOWN}': xxh64 checksum mismatch" in out, out


def test_a_file_name_that_is_not_utf8_is_shown_escaped(disk_dir: Path) -> None:
    path = os.fsencode(disk_dir) + b"/" + BAD_NAME + b".safetensors"
    tensortier.save({"x": torch.ones(3)}, disk_dir / "x.safetensors", checksum=True)
    os.rename(disk_dir / "x.safetensors", path)
    for command in ("info", "verify"):
        r = run(command, path)
        assert r.returncode == 0, r.stderr
        assert BAD_SHOWN + ".safetensors" in assert_terminal_safe(r)
    out_path = os.fsencode(disk_dir) + b"/" + BAD_NAME + b"\n.pt"
    r = run("convert", path, out_path)
    assert r.returncode == 0, r.stderr
    assert f"{BAD_SHOWN}\\n.pt: 1 tensor" in assert_terminal_safe(r)
    # Errors embed paths too: a file that is not a checkpoint, one that does not exist.
    with open(out_path, "wb") as f:
        f.write(b"\x1b[2J not a checkpoint")
    for args in (("info", out_path), ("verify", out_path + b"-missing")):
        r = run(*args)
        assert r.returncode == 1
        assert f"{BAD_SHOWN}\\n.pt" in assert_terminal_safe(r)


def test_torch_names_and_zip_entry_names_are_shown_escaped(disk_dir: Path) -> None:
    buffer = io.BytesIO()
    # A lone surrogate: pickled strings may hold one (surrogatepass), which is not UTF-8.
    torch.save({EVIL: torch.arange(3, dtype=torch.int32), "a\ud800b": torch.ones(1)}, buffer)
    # The same records under a folder whose name holds controls.
    path = disk_dir / "evil.pt"
    folder = "ev\x1b]0;title\x07il"
    with zipfile.ZipFile(buffer) as src, zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            dst.writestr(folder + info.filename[info.filename.index("/"):], src.read(info))
    r = run("info", path)
    assert r.returncode == 0, r.stderr
    out = assert_terminal_safe(r)
    assert "folder 'ev\\x1b]0;title\\x07il'" in out, out
    assert f"  {EVIL_SHOWN} " in out and "  a\\xed\\xa0\\x80b " in out, out

    with zipfile.ZipFile(path) as z:  # damage the first storage: verify names its zip entry
        info = z.getinfo(folder + "/data/0")
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
        f.seek(info.header_offset + 30 + name_len + extra_len)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    r = run("verify", path)
    assert r.returncode == 1
    out = assert_terminal_safe(r)
    assert "entry 'ev\\x1b]0;title\\x07il/data/0': CRC-32 checksum mismatch" in out, out


def test_convert_errors_show_names_escaped(disk_dir: Path) -> None:
    path = disk_dir / "meta.pt"
    torch.save({EVIL: torch.empty(2, device="meta")}, path)
    r = run("convert", path, disk_dir / "out.safetensors")
    assert r.returncode == 1
    out = assert_terminal_safe(r)
    assert f"tensor '{EVIL_SHOWN}' is a meta tensor" in out, out


def test_shard_index_paths_are_shown_escaped(disk_dir: Path) -> None:
    shard = f"shard{EVIL}.safetensors"
    tensortier.save({"w": torch.ones(2)}, disk_dir / shard, checksum=True)
    index = disk_dir / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {"w": shard}}))
    for command in ("info", "verify"):
        r = run(command, index)
        assert r.returncode == 0, r.stderr
        assert f"shard{EVIL_SHOWN}.safetensors" in assert_terminal_safe(r)


def test_bench_files_shows_paths_escaped(disk_dir: Path) -> None:
    root = disk_dir / f"set{EVIL}"
    (root / "class0").mkdir(parents=True)
    (root / "class0" / "a.jpg").write_bytes(b"x" * 5000)
    r = run("bench-files", root)
    assert r.returncode == 0, r.stderr
    assert f"set{EVIL_SHOWN}: 1 file," in assert_terminal_safe(r)
    # --json: the root as a JSON string (control characters escaped the JSON way), exactly.
    r = run("bench-files", root, "--json")
    assert r.returncode == 0, r.stderr
    assert_terminal_safe(r)
    assert json.loads(r.stdout)["root"] == str(root)
    # A file the reader cannot open (a link to nothing) is named in the error.
    os.symlink(disk_dir / "nowhere", root / "class0" / "b\x1b[2J\n.jpg")
    r = run("bench-files", root)
    assert r.returncode == 1
    assert "b\\x1b[2J\\n.jpg" in assert_terminal_safe(r)


def test_bench_files_json_writes_a_root_that_is_not_utf8_escaped(disk_dir: Path) -> None:
    root = os.fsencode(disk_dir) + b"/" + BAD_NAME
    os.makedirs(root + b"/class0")
    with open(root + b"/class0/a.jpg", "wb") as f:
        f.write(b"x" * 100)
    r = run("bench-files", root, "--json")
    assert r.returncode == 0, r.stderr
    assert_terminal_safe(r)
    # \udcXX for each byte that is not UTF-8: json.loads + os.fsencode give the bytes back.
    assert os.fsencode(json.loads(r.stdout)["root"]) == root
    r = run("bench-files", root)  # the table shows it escaped
    assert r.returncode == 0, r.stderr
    assert BAD_SHOWN in assert_terminal_safe(r)


def test_arguments_and_directories_are_shown_escaped(disk_dir: Path) -> None:
    r = run(f"bogus{EVIL}")
    assert r.returncode == 2
    assert f"unknown command 'bogus{EVIL_SHOWN}'" in assert_terminal_safe(r)
    r = run("info", disk_dir / "x.safetensors", f"--{EVIL}")
    assert r.returncode == 2
    assert f"unknown option '--{EVIL_SHOWN}'" in assert_terminal_safe(r)
    r = run("check", disk_dir / f"missing{EVIL}")
    assert r.returncode == 2
    assert f"missing{EVIL_SHOWN}' is not a directory" in assert_terminal_safe(r)
    odd = disk_dir / f"dir{EVIL}"
    odd.mkdir()
    r = run("check", odd)
    assert r.returncode == 0, r.stderr
    assert f"dir{EVIL_SHOWN}" in assert_terminal_safe(r)
