"""Extent maps and raw block-device reads on a real ext4 filesystem: an image file made here,
attached to a loop device and mounted (as root; skipped where loop devices cannot be had)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from tensortier.data import (
    ExtentReader,
    build_extent_map,
    load_extent_map,
    read_files,
    verify_extent_map,
)

from faults import with_faults

BIN = Path(sys.executable).parent / "tensortier"
REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 120  # seconds for any one command: mkfs, mount and umount take well under one


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=TIMEOUT)


class LoopFilesystem:
    """An ext4 image attached to a loop device and mounted; `detach()` undoes each step done."""

    def __init__(self, base: Path, size_mib: int, mkfs_options: tuple[str, ...],
                 partition: bool = False) -> None:
        self.image = base / "fs.img"
        self.mount = base / "mnt"
        self.device = ""  # the loop device: the whole disk
        self.partitioned = False
        self.mounted = False
        with open(self.image, "wb") as f:
            f.truncate(size_mib << 20)
        if partition:  # one GPT partition from 1 MiB on
            r = subprocess.run(["sfdisk", "-q", str(self.image)], input="label: gpt\nstart=2048\n",
                               capture_output=True, text=True, timeout=TIMEOUT)
            if r.returncode != 0:
                raise RuntimeError(f"sfdisk failed: {r.stderr}")
        r = _run("losetup", "--find", "--show", str(self.image))
        if r.returncode != 0:
            raise PermissionError(f"losetup: {r.stderr.strip()}")
        self.device = r.stdout.strip()
        self.filesystem_device = self.device
        if partition:
            # partx asks the kernel for the partition itself (BLKPG): kernels without partition
            # table parsers, or without udev, still get /dev/loopNp1.
            r = _run("partx", "-a", self.device)
            if r.returncode != 0:
                raise PermissionError(f"partx: {r.stderr.strip()}")
            self.partitioned = True
            self.filesystem_device = self.device + "p1"
        r = _run("mkfs.ext4", "-F", "-q", "-b", "4096", *mkfs_options, self.filesystem_device)
        if r.returncode != 0:
            raise RuntimeError(f"mkfs.ext4 failed: {r.stderr}")
        self.mount.mkdir()
        r = _run("mount", "-t", "ext4", self.filesystem_device, str(self.mount))
        if r.returncode != 0:
            raise PermissionError(f"mount: {r.stderr.strip()}")
        self.mounted = True

    def detach(self) -> None:
        if self.mounted:
            r = _run("umount", str(self.mount))
            if r.returncode != 0:  # a process still holds it: detach lazily rather than leak
                _run("umount", "-l", str(self.mount))
            self.mounted = False
        if self.partitioned:
            _run("partx", "-d", self.device)
            self.partitioned = False
        if self.device:
            _run("losetup", "-d", self.device)
            self.device = ""


def _loop_filesystem(mkfs_options: tuple[str, ...] = (),
                     partition: bool = False) -> Iterator[LoopFilesystem]:
    if os.geteuid() != 0:
        pytest.skip("loop devices and raw reads need root")
    for tool in ("mkfs.ext4", "losetup", "mount", "umount") + (("sfdisk", "partx") if partition
                                                                else ()):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    (REPO / "build").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=REPO / "build", prefix="pytest-extents-") as d:
        fs = None
        try:
            try:
                fs = LoopFilesystem(Path(d), 256, mkfs_options, partition)
            except PermissionError as e:
                if os.environ.get("CI"):
                    raise
                pytest.skip(f"no loop device here: {e}")
            yield fs
        finally:
            if fs is not None:
                fs.detach()


@pytest.fixture
def loop_fs() -> Iterator[LoopFilesystem]:
    """A fresh ext4 filesystem on a loop device (4 KiB blocks)."""
    yield from _loop_filesystem(("-O", "^inline_data"))


@pytest.fixture
def partition_fs() -> Iterator[LoopFilesystem]:
    """ext4 on the first partition (from 1 MiB) of a GPT-partitioned loop device."""
    yield from _loop_filesystem(("-O", "^inline_data"), partition=True)


@pytest.fixture
def inline_fs() -> Iterator[LoopFilesystem]:
    """The same with inline data on: files of up to ~150 bytes live in their inode."""
    yield from _loop_filesystem(("-O", "inline_data"))


def _bytes(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def _fragmented_files(root: Path, count: int = 6, rounds: int = 12) -> dict[str, bytes]:
    """Files written in interleaved appends, each made durable before the next file's: their
    blocks alternate on the disk, so each file has many extents. Sizes end off block bounds."""
    contents = {f"frag/f{i}.bin": bytearray() for i in range(count)}
    (root / "frag").mkdir()
    handles = {name: open(root / name, "wb") for name in contents}
    try:
        for r in range(rounds):
            for i, (name, f) in enumerate(handles.items()):
                chunk = _bytes(4096 * (1 + (r + i) % 3) + (r * 37 + i * 11) % 4096, r * 100 + i)
                f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
                contents[name] += chunk
    finally:
        for f in handles.values():
            f.close()
    return {name: bytes(data) for name, data in contents.items()}


def _write(root: Path, name: str, data: bytes) -> None:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _plain_files(root: Path, min_size: int = 0) -> dict[str, bytes]:
    """Files of awkward sizes, and an empty one; `min_size` leaves out the smaller ones (inline
    data would hold them)."""
    files = {}
    for i, size in enumerate((1, 511, 4095, 4096, 4097, 65536 + 3, 1 << 20)):
        if size < min_size:
            continue
        name = f"plain/c{i % 3}/file{i}.bin"
        files[name] = _bytes(size, 1000 + i)
        _write(root, name, files[name])
    files["plain/empty.bin"] = b""
    _write(root, "plain/empty.bin", b"")
    return files


def _awkward_files(root: Path) -> dict[str, str]:
    """Files the map must refuse, with the words their reasons contain."""
    (root / "odd").mkdir()
    with open(root / "odd/sparse.bin", "wb") as f:  # data, a hole, data
        f.write(_bytes(8192, 1))
        f.seek(1 << 20)
        f.write(_bytes(4096, 2))
    with open(root / "odd/unwritten.bin", "wb") as f:
        os.posix_fallocate(f.fileno(), 0, 1 << 20)
    (root / "odd/tiny.txt").write_bytes(b"inline data lives in the inode\n")
    os.mkfifo(root / "odd/fifo")
    return {"odd/sparse.bin": "sparse", "odd/unwritten.bin": "unwritten",
            "odd/tiny.txt": "inline", "odd/fifo": "not a regular file"}


def _extent_count(extent_map, name: str) -> int:
    return len(extent_map.file(extent_map.find(name))["extents"])


def test_every_byte_read_raw_equals_the_files(loop_fs: LoopFilesystem, tmp_path: Path) -> None:
    root = loop_fs.mount
    files = {**_fragmented_files(root), **_plain_files(root)}
    out = tmp_path / "map.json"
    extent_map = build_extent_map(root, out)
    assert sorted(extent_map.paths) == sorted(files)
    assert extent_map.refused == []
    # The fragmentation took: files of several extents (else this test would prove little).
    assert max(_extent_count(extent_map, n) for n in files if n.startswith("frag/")) >= 4
    device = extent_map.devices[0]
    assert device["disk"] == loop_fs.device and device["partition_offset"] == 0
    assert device["filesystem"] == "ext4" and device["block_size"] == 4096
    st = os.stat(root / "plain/c0/file0.bin")
    entry = extent_map.file(extent_map.find("plain/c0/file0.bin"))
    assert (entry["inode"], entry["size"], entry["mtime_ns"]) == (st.st_ino, 1, st.st_mtime_ns)
    assert entry["ctime_ns"] == st.st_ctime_ns
    assert extent_map.file(extent_map.find("plain/empty.bin"))["extents"] == []

    reader = ExtentReader(out)
    names = sorted(files)
    arrays = reader.read(names)
    for name, array in zip(names, arrays):
        assert array.dtype == np.uint8 and array.tobytes() == files[name], name
    assert reader.last_stats["raw_files"] == len(names)
    assert reader.last_stats["fallback_files"] == 0
    assert reader.last_stats["buffered_bytes"] == 0  # never the disk's page cache
    # Into given buffers, larger than the files, by index and by absolute path.
    bufs = [np.full(len(files[n]) + 100, 7, dtype=np.uint8) for n in names]
    keys = [extent_map.find(n) if i % 2 else str(root / n) for i, n in enumerate(names)]
    views = reader.read(keys, bufs)
    for name, view, buf in zip(names, views, bufs):
        assert view.tobytes() == files[name]
        assert (buf[len(files[name]):] == 7).all(), "wrote past the file"
    # torch tensors too.
    torch = pytest.importorskip("torch")
    tensors = [torch.empty(len(files[n]), dtype=torch.uint8) for n in names[:3]]
    for name, t in zip(names[:3], read_files(extent_map, names[:3], tensors)):
        assert bytes(t.numpy()) == files[name]


def test_refusals_name_the_file(inline_fs: LoopFilesystem, tmp_path: Path) -> None:
    root = inline_fs.mount
    good = _plain_files(root, min_size=4095)
    awkward = _awkward_files(root)
    with pytest.raises(OSError) as info:
        build_extent_map(root, tmp_path / "map.json")
    assert info.value.errno == errno.EOPNOTSUPP
    for name, says in awkward.items():
        assert name in str(info.value) and says in str(info.value), str(info.value)
    assert not (tmp_path / "map.json").exists()
    extent_map = build_extent_map(root, tmp_path / "map.json", allow_refused=True)
    refused = dict(extent_map.refused)
    assert sorted(refused) == sorted(awkward)
    for name, says in awkward.items():
        assert says in refused[name]
    assert sorted(extent_map.paths) == sorted(good)
    for name, array in zip(sorted(good), ExtentReader(extent_map).read(sorted(good))):
        assert array.tobytes() == good[name]
    with pytest.raises(ValueError, match="not in the extent map"):
        ExtentReader(extent_map).read(["odd/tiny.txt"])


def test_verify_and_fall_back_when_a_file_changed(loop_fs: LoopFilesystem,
                                                  tmp_path: Path) -> None:
    root = loop_fs.mount
    files = _plain_files(root)
    extent_map = build_extent_map(root, tmp_path / "map.json")
    assert verify_extent_map(tmp_path / "map.json") == []
    reader = ExtentReader(extent_map)
    # Rewritten in place (same size), replaced by a rename, grown, and renamed away.
    rewritten = _bytes(4097, 77)
    with open(root / "plain/c1/file4.bin", "r+b") as f:
        f.write(rewritten)
    replacement = _bytes(4096, 78)
    (root / "plain/new.tmp").write_bytes(replacement)
    os.rename(root / "plain/new.tmp", root / "plain/c0/file3.bin")
    grown = files["plain/c2/file5.bin"] + b"more"
    (root / "plain/c2/file5.bin").write_bytes(grown)
    os.rename(root / "plain/c0/file6.bin", root / "plain/c0/moved.bin")

    changed = dict(verify_extent_map(extent_map))
    assert sorted(changed) == ["plain/c0/file3.bin", "plain/c0/file6.bin", "plain/c1/file4.bin",
                               "plain/c2/file5.bin"]
    assert "missing" in changed["plain/c0/file6.bin"]
    assert "size" in changed["plain/c2/file5.bin"]
    r = subprocess.run([str(BIN), "extents", "verify", str(tmp_path / "map.json")],
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 1 and "plain/c1/file4.bin" in r.stdout, r.stdout + r.stderr

    names = ["plain/c1/file4.bin", "plain/c0/file3.bin", "plain/c0/file0.bin"]
    arrays = reader.read(names)
    assert arrays[0].tobytes() == rewritten and arrays[1].tobytes() == replacement
    assert arrays[2].tobytes() == files["plain/c0/file0.bin"]
    assert reader.last_stats["raw_files"] == 1 and reader.last_stats["fallback_files"] == 2
    whys = dict(reader.last_stats["fallbacks"])
    assert "mtime" in whys[str(root / "plain/c1/file4.bin")]
    assert "replaced" in whys[str(root / "plain/c0/file3.bin")]
    # A file that grew past its buffer, or vanished, is an error naming it.
    with pytest.raises(OSError) as info:
        reader.read(["plain/c2/file5.bin"])
    assert info.value.errno == errno.EFBIG and "file5.bin" in str(info.value)
    assert reader.read(["plain/c2/file5.bin"], [np.empty(len(grown), np.uint8)])[0].tobytes() \
        == grown
    with pytest.raises(FileNotFoundError, match="file6.bin"):
        reader.read(["plain/c0/file6.bin"])
    with pytest.raises(ValueError, match="buffer"):
        reader.read(["plain/c0/file0.bin"], [np.empty(0, np.uint8)])


def test_cli_build_and_verify(inline_fs: LoopFilesystem, tmp_path: Path) -> None:
    root = inline_fs.mount
    _plain_files(root, min_size=4095)
    out = tmp_path / "map.json"
    r = subprocess.run([str(BIN), "extents", "build", str(root), "-o", str(out)],
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr
    assert "mapped 6 files" in r.stdout and inline_fs.device in r.stdout
    doc = json.loads(out.read_text())
    assert doc["format"] == "tensortier extent map" and doc["version"] == 1
    assert load_extent_map(out) == build_extent_map(root)
    r = subprocess.run([str(BIN), "extents", "verify", str(out)], capture_output=True, text=True,
                       timeout=TIMEOUT)
    assert r.returncode == 0 and "all 6 files match" in r.stdout, r.stdout + r.stderr

    _awkward_files(root)
    r = subprocess.run([str(BIN), "extents", "build", str(root), "-o", str(tmp_path / "b.json")],
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 1 and not (tmp_path / "b.json").exists()
    assert "refused odd/unwritten.bin: " in r.stderr and "odd/tiny.txt" in r.stderr, r.stderr
    r = subprocess.run([str(BIN), "extents", "build", str(root), "--output",
                        str(tmp_path / "b.json"), "--allow-refused"],
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0 and "4 files refused" in r.stdout, r.stdout + r.stderr
    assert len(json.loads((tmp_path / "b.json").read_text())["refused"]) == 4


def test_cli_a_map_written_inside_its_root_is_not_mapped(loop_fs: LoopFilesystem) -> None:
    """`extents build ROOT -o ROOT/extents.json`: the map is not one of the mapped files (a
    second build mapped the first map, then replaced it, and verify failed at once)."""
    root = loop_fs.mount
    _plain_files(root, min_size=4095)
    out = root / "extents.json"
    link = root.parent / "root-link"  # the root named through a link, the map by its own path
    link.symlink_to(root)
    for named in (root, root, link):
        r = subprocess.run([str(BIN), "extents", "build", str(named), "-o", str(out)],
                           capture_output=True, text=True, timeout=TIMEOUT)
        assert r.returncode == 0 and "mapped 6 files" in r.stdout, r.stdout + r.stderr
    assert all(f["path"] != "extents.json" for f in json.loads(out.read_text())["files"])
    r = subprocess.run([str(BIN), "extents", "verify", str(out)], capture_output=True, text=True,
                       timeout=TIMEOUT)
    assert r.returncode == 0 and "all 6 files match" in r.stdout, r.stdout + r.stderr


def test_raw_reads_without_access_to_the_disk_name_it(loop_fs: LoopFilesystem) -> None:
    root = loop_fs.mount
    _plain_files(root)
    shared = Path(tempfile.mkdtemp(prefix="tensortier-extents-"))  # readable by nobody
    try:
        os.chmod(shared, 0o755)
        out = shared / "map.json"
        build_extent_map(root, out)
        os.chmod(out, 0o644)
        _check_nobody_is_refused(out, loop_fs.device)
    finally:
        shutil.rmtree(shared)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the tool as another user")
def test_a_folder_that_cannot_be_listed_is_named() -> None:
    """The walk's error names the folder it could not open, not ROOT: the user must know which
    of thousands of class folders to fix."""
    shared = Path(tempfile.mkdtemp(prefix="tensortier-extents-"))  # listable by nobody
    try:
        os.chmod(shared, 0o755)
        for name in ("a", "b", "c"):
            (shared / name).mkdir()
            (shared / name / "x.bin").write_bytes(b"x" * 5000)
        locked = shared / "b"
        os.chmod(locked, 0o700)
        out = shared / "map.json"
        r = subprocess.run([str(BIN), "extents", "build", str(shared), "-o", str(out)],
                           capture_output=True, text=True, timeout=TIMEOUT,
                           user=65534, group=65534, extra_groups=[])
        assert r.returncode == 1 and not out.exists(), r.stdout + r.stderr
        assert f"list failed on '{locked}': Permission denied" in r.stderr, r.stderr
    finally:
        shutil.rmtree(shared)


def test_a_map_that_cannot_be_put_in_place_names_the_output(tmp_path: Path) -> None:
    """-o naming a folder: the error names it (not the temporary file beside it), and no
    temporary file stays."""
    root = tmp_path / "set"
    (root / "a").mkdir(parents=True)
    (root / "a" / "x.bin").write_bytes(b"x" * 5000)
    out = tmp_path / "maps"
    out.mkdir()
    r = subprocess.run([str(BIN), "extents", "build", str(root), "-o", str(out)],
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"failed on '{out}': Is a directory" in r.stderr, r.stderr
    with pytest.raises(IsADirectoryError) as e:
        build_extent_map(root, out)
    assert e.value.filename == str(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["maps", "set"]
    assert list(out.iterdir()) == []


def test_cli_shows_file_names_escaped(loop_fs: LoopFilesystem, tmp_path: Path) -> None:
    """Paths found under ROOT reach the terminal with control characters and bytes that are not
    UTF-8 escaped (test_cli_escapes.py covers the other commands)."""
    root = loop_fs.mount
    evil = "w\x1b]52;c;aGk=\x07\nforged\r\x9b.bin"
    shown = "w\\x1b]52;c;aGk=\\x07\\nforged\\r\\u009b.bin"
    _write(root, f"set/{evil}", _bytes(5000, 7))
    with open(os.fsencode(root) + b"/set/latin\xff\x1b[2J.bin", "wb") as f:
        f.write(_bytes(4096, 8))
    out = tmp_path / "map.json"

    def run(*args: str) -> str:
        r = subprocess.run([str(BIN), "extents", *args], capture_output=True, timeout=TIMEOUT)
        text = (r.stdout + r.stderr).decode("utf-8")  # strict: no byte that is not UTF-8
        assert not [c for c in text if c != "\n" and (ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F)]
        assert "\nforged" not in text
        return text

    text = run("build", str(root), "-o", str(out))
    assert "mapped 2 files" in text, text
    with open(root / "set" / evil, "ab") as f:
        f.write(b"grown")
    with open(os.fsencode(root) + b"/set/latin\xff\x1b[2J.bin", "ab") as f:
        f.write(b"grown")
    text = run("verify", str(out))
    assert f"changed set/{shown}: " in text, text
    assert "changed set/latin\\xff\\x1b[2J.bin: " in text, text


def _check_nobody_is_refused(out: Path, device: str) -> None:
    # The package is imported as root (the interpreter's own files may be out of nobody's
    # reach), then the process becomes nobody, who may not read the disk.
    code = (
        "import os\n"
        "import tensortier.data as d\n"
        "os.setgid(65534); os.setuid(65534)\n"
        "try:\n"
        f"    d.ExtentReader({str(out)!r})\n"
        "    print('opened')\n"
        "except OSError as e:\n"
        "    print('OSError', e.errno, e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=TIMEOUT)
    assert r.stdout.startswith(f"OSError {errno.EACCES} "), r.stdout + r.stderr
    assert device in r.stdout and "root" in r.stdout


def test_bad_maps_are_value_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "tensortier extent map", "version": 9}')
    with pytest.raises(ValueError, match="version 9"):
        load_extent_map(bad)
    with pytest.raises(FileNotFoundError):
        load_extent_map(tmp_path / "missing.json")
    with pytest.raises(TypeError):
        verify_extent_map(42)  # type: ignore[arg-type]


def test_files_on_two_filesystems_are_grouped_by_device(loop_fs: LoopFilesystem,
                                                        inline_fs: LoopFilesystem) -> None:
    """A root with another filesystem mounted inside it: one map, one device entry each."""
    root = loop_fs.mount
    files = _plain_files(root, min_size=4095)
    others = {f"other/{name}": data for name, data in _plain_files(inline_fs.mount,
                                                                  min_size=4095).items()}
    (root / "other").mkdir()
    r = _run("mount", "--bind", str(inline_fs.mount), str(root / "other"))
    if r.returncode != 0:
        pytest.skip(f"bind mount refused: {r.stderr.strip()}")
    try:
        extent_map = build_extent_map(root)
        assert sorted(d["disk"] for d in extent_map.devices) == sorted(
            [loop_fs.device, inline_fs.device])
        devices = {extent_map.file(i)["device"] for i in range(len(extent_map))}
        assert devices == {0, 1}
        everything = {**files, **others}
        assert sorted(extent_map.paths) == sorted(everything)
        reader = ExtentReader(extent_map)
        names = sorted(everything)
        for name, array in zip(names, reader.read(names)):
            assert array.tobytes() == everything[name], name
        assert reader.last_stats["raw_files"] == len(names)
        del reader
    finally:
        _run("umount", str(root / "other"))


def test_injected_device_faults(loop_fs: LoopFilesystem) -> None:
    """A failed device read names the file it was for; short device reads are continued
    (still direct) and every byte arrives."""
    root = loop_fs.mount
    files = _plain_files(root)
    extent_map = build_extent_map(root)
    names = sorted(files)
    fault = {"kind": "error", "errno": errno.EIO, "nth": 3, "reads": True, "writes": False}
    reader = with_faults(fault, ExtentReader, extent_map, backend="threads")
    with pytest.raises(OSError) as info:
        reader.read(names)
    assert info.value.errno == errno.EIO
    assert "raw read of '" in str(info.value) and loop_fs.device in str(info.value)
    assert any(str(root / n) in str(info.value) for n in names), str(info.value)
    # The fault was one request: the next batch reads everything.
    for name, array in zip(names, reader.read(names)):
        assert array.tobytes() == files[name], name
    fault = {"kind": "short", "short_bytes": 4096, "nth": 1, "count": 1000, "reads": True,
             "writes": False}
    reader = with_faults(fault, ExtentReader, extent_map, backend="threads")
    for name, array in zip(names, reader.read(names)):
        assert array.tobytes() == files[name], name
    assert reader.last_stats["buffered_bytes"] == 0


def test_partition_reads_through_the_whole_disk(partition_fs: LoopFilesystem) -> None:
    """A filesystem on a partition: the map names the whole disk and the partition's offset
    (sysfs), and raw reads of the disk at those offsets give every byte."""
    root = partition_fs.mount
    files = {**_fragmented_files(root, count=3, rounds=6), **_plain_files(root)}
    extent_map = build_extent_map(root)
    (device,) = extent_map.devices
    assert device["disk"] == partition_fs.device
    assert device["partition_offset"] == 2048 * 512
    assert os.stat(partition_fs.filesystem_device).st_rdev == os.makedev(device["major"],
                                                                         device["minor"])
    names = sorted(files)
    reader = ExtentReader(extent_map)
    for name, array in zip(names, reader.read(names)):
        assert array.tobytes() == files[name], name
    assert reader.last_stats["raw_files"] == len(names)


def test_one_reader_from_several_threads(loop_fs: LoopFilesystem) -> None:
    """ReadBatch may be called from any thread: batches from four threads at once, each
    checked byte for byte."""
    from concurrent.futures import ThreadPoolExecutor

    root = loop_fs.mount
    files = {**_fragmented_files(root, count=4, rounds=6), **_plain_files(root)}
    reader = ExtentReader(build_extent_map(root))
    names = sorted(files)

    def read_all(seed: int) -> int:
        order = names[seed % len(names):] + names[:seed % len(names)]
        for _ in range(5):
            for name, array in zip(order, reader.read(order)):
                assert array.tobytes() == files[name], name
        return seed

    with ThreadPoolExecutor(4) as pool:
        assert sorted(pool.map(read_all, range(4))) == [0, 1, 2, 3]


def test_cli_help_and_bad_commands() -> None:
    r = subprocess.run([str(BIN), "extents", "--help"], capture_output=True, text=True,
                       timeout=TIMEOUT)
    assert r.returncode == 0 and "usage: tensortier extents build ROOT -o MAP" in r.stdout
    r = subprocess.run([str(BIN), "extents", "shrink"], capture_output=True, text=True,
                       timeout=TIMEOUT)
    assert r.returncode == 2 and "unknown extents command 'shrink'" in r.stderr
    r = subprocess.run([str(BIN), "extents", "build", "/tmp"], capture_output=True, text=True,
                       timeout=TIMEOUT)
    assert r.returncode == 2 and "usage:" in r.stderr
    r = subprocess.run([str(BIN), "help"], capture_output=True, text=True, timeout=TIMEOUT)
    assert "extents build ROOT -o MAP" in r.stdout


def test_verify_sees_blocks_moved_by_defragmentation(loop_fs: LoopFilesystem) -> None:
    """e4defrag moves a file's blocks and leaves its times alone: identity cannot see it (the
    reason verify re-reads the extents), verify does."""
    if shutil.which("e4defrag") is None:
        pytest.skip("e4defrag is not installed")
    root = loop_fs.mount
    files = _fragmented_files(root, count=3, rounds=10)
    extent_map = build_extent_map(root)
    name = "frag/f0.bin"
    before = os.stat(root / name)
    r = _run("e4defrag", str(root / name))
    if r.returncode != 0:
        pytest.skip(f"e4defrag failed here: {r.stdout}{r.stderr}")
    after = os.stat(root / name)
    moved = build_extent_map(root)
    if moved.file(moved.find(name))["extents"] == extent_map.file(extent_map.find(name))["extents"]:
        pytest.skip("e4defrag left the file where it was")
    changed = dict(verify_extent_map(extent_map))
    assert list(changed) == [name]
    if (after.st_mtime_ns, after.st_ctime_ns) == (before.st_mtime_ns, before.st_ctime_ns):
        assert changed[name] == "extents differ (the file's blocks moved)"
    assert verify_extent_map(moved) == []
    assert ExtentReader(moved).read([name])[0].tobytes() == files[name]
