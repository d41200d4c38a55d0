"""tensortier.data.FileReader with an extent map: files read from the block device by their
extents, on a loop-mounted ext4 image (test_extents.py's fixtures; root only)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from test_extents import (  # noqa: F401  (loop_fs is a fixture)
    TIMEOUT,
    LoopFilesystem,
    _bytes,
    loop_fs,
)

from tensortier.data import (ExtentReader, FileReader, build_extent_map, load_extent_map,
                             verify_extent_map)


def _training_set(root: Path) -> dict[str, bytes]:
    """Four classes of files of awkward sizes (an empty one among them); the files of class
    ``c3`` are written in interleaved, fsynced appends, so their blocks alternate on the disk."""
    files: dict[str, bytes] = {}
    sizes = (1, 511, 4095, 4096, 4097, 65536 + 3, 300001, 0, 12345, 8192)
    for c in range(3):
        (root / f"c{c}").mkdir(parents=True)
        for i, size in enumerate(sizes):
            name = f"c{c}/f{i}.jpg"
            files[name] = _bytes(size, 100 * c + i)
            (root / name).write_bytes(files[name])
    (root / "c3").mkdir()
    fragments = {f"c3/g{i}.jpg": bytearray() for i in range(5)}
    handles = {name: open(root / name, "wb") for name in fragments}
    try:
        for r in range(8):
            for i, (name, f) in enumerate(handles.items()):
                size = 4096 * (1 + (r + i) % 3) + (r * 37 + i * 11) % 4096
                chunk = _bytes(size, 1000 + 10 * r + i)
                f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
                fragments[name] += chunk
    finally:
        for f in handles.values():
            f.close()
    files.update({name: bytes(data) for name, data in fragments.items()})
    return files


def _epochs(reader: FileReader, epochs: int) -> list[tuple[list[bytes], list[int]]]:
    out = []
    for _ in range(epochs):
        for samples, labels in reader:
            out.append(([s.numpy().tobytes() for s in samples], labels.tolist()))
    return out


def test_batches_equal_the_reader_without_a_map(loop_fs: LoopFilesystem,
                                                tmp_path: Path) -> None:
    root = loop_fs.mount / "train"
    files = _training_set(root)
    extent_map = build_extent_map(root, tmp_path / "map.json")
    assert max(len(extent_map.file(extent_map.find(n))["extents"]) for n in files) > 1
    # A file added after the map: not in it, read as usual.
    (root / "c1/late.jpg").write_bytes(_bytes(5000, 9))
    for shard_id in range(3):
        settings = dict(file_root=root, batch_size=4, shuffle=True, seed=7, shard_id=shard_id,
                        num_shards=3, pad_last_batch=shard_id == 1)
        plain = FileReader(**settings)
        raw = FileReader(**settings,
                         extent_map=tmp_path / "map.json" if shard_id else extent_map)
        expected = _epochs(plain, 2)
        got = _epochs(raw, 2)
        assert got == expected
        assert len(got) > 2
        stats = raw.stats
        assert stats["fallback_files"] == 0
        assert stats["raw_files"] > 0
        assert stats["files"] == plain.stats["files"]
        # Every distinct file read per batch is either raw or read as usual (late.jpg only).
        late = raw.files.index(str(root / "c1/late.jpg"))
        late_reads = sum(idx.count(late) > 0 for idx in _batch_indices(raw, 2))
        assert stats["raw_files"] + late_reads == _distinct_reads(raw, 2)
        assert plain.stats["raw_files"] == 0 and plain.stats["fallback_files"] == 0
    # Every byte read raw is the file's.
    every = FileReader(files=[root / n for n in files], batch_size=len(files), shuffle=False,
                       extent_map=extent_map)
    (samples, _), = list(every)
    assert [s.numpy().tobytes() for s in samples] == list(files.values())
    assert every.stats["raw_files"] == len(files)


def _batch_indices(reader: FileReader, epochs: int) -> list[list[int]]:
    batch_size = reader._state.config["batch_size"]  # the plan the reader itself follows
    out = []
    for epoch in range(epochs):
        samples = reader.epoch_indices(epoch)
        out += [samples[i:i + batch_size] for i in range(0, len(samples), batch_size)]
    return out


def _distinct_reads(reader: FileReader, epochs: int) -> int:
    return sum(len(set(batch)) for batch in _batch_indices(reader, epochs))


def test_a_file_changed_after_the_map_falls_back(loop_fs: LoopFilesystem,
                                                 tmp_path: Path) -> None:
    root = loop_fs.mount / "train"
    files = _training_set(root)
    extent_map = build_extent_map(root)
    # Rewritten in place (same size: only mtime tells), replaced by a rename, and grown.
    rewritten = _bytes(4097, 77)
    with open(root / "c0/f4.jpg", "r+b") as f:
        f.write(rewritten)
    # mtime a second on: the clock's tick may be coarser than the time since the map was built.
    st = os.stat(root / "c0/f4.jpg")
    os.utime(root / "c0/f4.jpg", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    replacement = _bytes(4096, 78)
    (root / "new.tmp").write_bytes(replacement)
    os.rename(root / "new.tmp", root / "c3/g1.jpg")
    grown = files["c2/f6.jpg"] + b"more"
    (root / "c2/f6.jpg").write_bytes(grown)
    now = {**files, "c0/f4.jpg": rewritten, "c3/g1.jpg": replacement, "c2/f6.jpg": grown}

    names = sorted(files)
    reader = FileReader(files=[root / n for n in names], batch_size=8, shuffle=False,
                        extent_map=extent_map)
    got = [s.numpy().tobytes() for samples, _ in reader for s in samples]
    assert got == [now[n] for n in names]
    assert reader.stats["fallback_files"] == 3
    assert reader.stats["raw_files"] == len(names) - 3
    # The same through on_error="skip": nothing is skipped, the changed files still fall back.
    reader = FileReader(files=[root / n for n in names], batch_size=len(names), shuffle=False,
                        extent_map=extent_map, on_error="skip")
    got = [s.numpy().tobytes() for samples, _ in reader for s in samples]
    assert got == [now[n] for n in names]
    assert reader.stats["skipped"] == 0 and reader.stats["fallback_files"] == 3


def test_a_vanished_mapped_file_is_an_error_naming_it(loop_fs: LoopFilesystem) -> None:
    root = loop_fs.mount / "train"
    files = _training_set(root)
    extent_map = build_extent_map(root)
    names = sorted(files)
    reader = FileReader(files=[root / n for n in names], batch_size=len(names), shuffle=False,
                        extent_map=extent_map)
    os.unlink(root / "c1/f3.jpg")
    with pytest.raises(FileNotFoundError, match="f3.jpg"):
        list(reader)
    names.remove("c1/f3.jpg")
    reader = FileReader(files=[root / n for n in names], batch_size=len(names), shuffle=False,
                        extent_map=extent_map, on_error="skip")
    os.unlink(root / "c2/f5.jpg")
    (samples, _), = list(reader)
    assert [s.numpy().tobytes() for s in samples] == [files[n] for n in names if n != "c2/f5.jpg"]
    assert reader.stats["skipped"] == 1 and reader.stats["raw_files"] == len(names) - 1


def test_bad_extent_map_arguments(tmp_path: Path) -> None:
    (tmp_path / "c0").mkdir()
    (tmp_path / "c0/a.jpg").write_bytes(b"abc")
    with pytest.raises(TypeError, match="ExtentMap"):
        FileReader(file_root=tmp_path, extent_map=3)  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError):
        FileReader(file_root=tmp_path, extent_map=tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError):
        FileReader(file_root=tmp_path, extent_map=tmp_path / "bad.json")


def test_without_access_to_the_disk_the_reader_is_refused(loop_fs: LoopFilesystem) -> None:
    root = loop_fs.mount / "train"
    _training_set(root)
    shared = Path(tempfile.mkdtemp(prefix="tensortier-data-extents-"))
    try:
        os.chmod(shared, 0o755)
        os.chmod(loop_fs.mount.parent, 0o755)  # the fixture's folder: nobody may list the files
        out = shared / "map.json"
        build_extent_map(root, out)
        os.chmod(out, 0o644)
        assert len(load_extent_map(out)) > 0
        # Imported as root, then the process becomes nobody, who may read the files (mode 0644
        # under 0755 folders) but not the disk.
        code = (
            "import os\n"
            "from tensortier.data import FileReader\n"
            "os.setgid(65534); os.setuid(65534)\n"
            f"FileReader(file_root={str(root)!r}, batch_size=4)\n"
            "try:\n"
            f"    FileReader(file_root={str(root)!r}, batch_size=4, extent_map={str(out)!r})\n"
            "    print('opened')\n"
            "except OSError as e:\n"
            "    print('OSError', e.errno, type(e).__name__, e)\n"
        )
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=TIMEOUT)
        assert r.stdout.startswith(f"OSError {errno.EACCES} PermissionError "), \
            r.stdout + r.stderr
        assert loop_fs.device in r.stdout and "root" in r.stdout
    finally:
        shutil.rmtree(shared)


def test_a_root_reached_through_a_symbolic_link_uses_the_map(loop_fs: LoopFilesystem,
                                                             tmp_path: Path) -> None:
    root = loop_fs.mount / "train"
    files = _training_set(root)
    link = tmp_path / "train-link"
    link.symlink_to(root, target_is_directory=True)
    # The map records its root as given and each file's path under it: a map built through the
    # link is found from the real path and the other way round.
    through_link = build_extent_map(link, tmp_path / "link.json")
    direct = build_extent_map(root, tmp_path / "map.json")
    for reader_root, extent_map in ((link, direct), (root, through_link), (link, through_link)):
        reader = FileReader(file_root=reader_root, batch_size=len(files), shuffle=False,
                            extent_map=extent_map)
        (samples, _), = list(reader)
        assert [s.numpy().tobytes() for s in samples] == [files[n] for n in sorted(files)]
        assert reader.stats["raw_files"] == len(files), reader_root
        assert reader.stats["fallback_files"] == 0
    # A map of other files would never be used: refused, naming the map's root.
    other = loop_fs.mount / "other"
    (other / "c0").mkdir(parents=True)
    (other / "c0/a.jpg").write_bytes(b"abc")
    with pytest.raises(ValueError, match="holds none of the"):
        FileReader(file_root=link, extent_map=build_extent_map(other, tmp_path / "other.json"))


def test_names_that_are_not_utf8_are_mapped_and_read_raw(loop_fs: LoopFilesystem,
                                                         tmp_path: Path) -> None:
    """A file name is bytes: the map holds one that is not UTF-8 as \\udcXX escapes (what
    json.dumps(os.fsdecode(name)) writes), and the reader finds and reads it by its map."""
    root = os.fsencode(loop_fs.mount / "train")
    names = [b"c\xff/a\xe9.jpg", b"c\xff/ok.jpg", b"d/\xed\xb3\xbf.jpg"]
    files = {}
    for i, name in enumerate(names):
        os.makedirs(os.path.dirname(os.path.join(root, name)), exist_ok=True)
        files[name] = _bytes(4096 * (i + 1) + 7, 50 + i)
        with open(os.path.join(root, name), "wb") as f:
            f.write(files[name])
    out = tmp_path / "map.json"
    extent_map = build_extent_map(root, os.fsencode(out))
    assert extent_map.refused == []
    assert sorted(os.fsencode(p) for p in extent_map.paths) == sorted(names)
    doc = json.loads(out.read_text(encoding="utf-8"))  # the file is UTF-8 text
    assert "\\udcff" in out.read_text(encoding="utf-8")
    assert sorted(os.fsencode(f["path"]) for f in doc["files"]) == sorted(names)
    assert os.fsencode(doc["root"]) == root
    assert load_extent_map(out) == extent_map
    assert verify_extent_map(out) == []
    reader = FileReader(file_root=root, batch_size=8, shuffle=False, extent_map=out)
    (samples, labels), = list(reader)
    got = {os.fsencode(p): s.numpy().tobytes() for p, s in zip(reader.files, samples)}
    assert got == {os.path.join(root, n): files[n] for n in names}
    assert labels.tolist() == [0, 0, 1]  # classes c\xff and d, in DALI's (byte) order
    assert reader.stats["raw_files"] == 3 and reader.stats["fallback_files"] == 0
    # verify names a changed file as the str that encodes back to its bytes.
    with open(os.path.join(root, names[0]), "ab") as f:
        f.write(b"more")
    (changed, _), = verify_extent_map(extent_map)
    assert os.fsencode(changed) == names[0]


def test_a_map_placing_the_filesystem_elsewhere_on_the_disk_is_refused(loop_fs: LoopFilesystem,
                                                                      tmp_path: Path) -> None:
    root = loop_fs.mount / "data"
    files = _training_set(root)
    good = tmp_path / "good.json"
    build_extent_map(str(root), str(good))
    assert _epochs(FileReader(file_root=root, extent_map=good, shuffle=False, batch_size=64),
                   1)[0][0] == [files[k] for k in sorted(files)]
    # Every file's identity still matches: only the device's place on its disk is wrong, which
    # would read other bytes for every file.
    edited = json.loads(good.read_text())
    edited["devices"][0]["partition_offset"] = 1 << 20
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(edited))
    with pytest.raises(OSError, match="rebuild the extent map") as info:
        FileReader(file_root=root, extent_map=bad)
    assert info.value.errno == errno.ENODEV


def _fill_free_space(directory: Path, byte: int) -> None:
    """Writes files of `byte` until the filesystem is full, then syncs: every free block (those
    a defragmentation left behind included) now holds `byte`."""
    chunk = bytes([byte]) * (1 << 20)
    for n in range(1 << 20):
        try:
            with open(directory / f"fill{n}", "wb") as f:
                for _ in range(16):
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            break
    os.sync()


def test_blocks_moved_by_online_defragmentation_are_not_read_raw(loop_fs: LoopFilesystem,
                                                                 tmp_path: Path) -> None:
    if shutil.which("e4defrag") is None:
        pytest.skip("e4defrag is not installed")
    from test_extents import _fragmented_files
    root = loop_fs.mount / "train"
    root.mkdir()
    files = _fragmented_files(root)
    names = sorted(files)
    extent_map = build_extent_map(root, tmp_path / "map.json")
    assert min(len(extent_map.file(i)["extents"]) for i in range(len(extent_map))) > 1
    before = {n: os.stat(root / n) for n in names}
    r = subprocess.run(["e4defrag", str(root / "frag")], capture_output=True, text=True,
                       timeout=TIMEOUT)
    assert r.returncode == 0, r.stdout + r.stderr
    for n in names:  # the identity the map checks is unchanged...
        now = os.stat(root / n)
        assert (now.st_ino, now.st_size, now.st_mtime_ns, now.st_ctime_ns) == (
            before[n].st_ino, before[n].st_size, before[n].st_mtime_ns, before[n].st_ctime_ns)
    moved = [path for path, _ in verify_extent_map(extent_map)]  # ...but blocks moved
    if not moved:
        pytest.skip("e4defrag moved no file on this kernel and filesystem")
    os.sync()  # ext4 reuses blocks freed by a transaction only once it is committed
    _fill_free_space(loop_fs.mount, 0x5A)  # the old blocks now hold other bytes
    reader = FileReader(files=[root / n for n in names], batch_size=len(names), shuffle=False,
                        extent_map=tmp_path / "map.json")
    (samples, _), = list(reader)
    assert [s.numpy().tobytes() for s in samples] == [files[n] for n in names]
    raw = ExtentReader(extent_map)
    assert [a.tobytes() for a in raw.read(names)] == [files[n] for n in names]
    assert {os.path.relpath(p, root) for p, _ in raw.last_stats["fallbacks"]} <= set(moved)
    assert all("checksum" in why for _, why in raw.last_stats["fallbacks"])
    # Opted out (files promised never to move): the moved blocks are read as they are.
    unchecked = ExtentReader(extent_map, verify_checksums=False)
    if [a.tobytes() for a in unchecked.read(names)] == [files[n] for n in names]:
        pytest.skip("the filesystem gave none of the moved files' old blocks to the fill")
    # A moved file whose old blocks were not reused yet still reads right raw.
    assert 1 <= reader.stats["fallback_files"] <= len(moved)


def test_a_map_pointing_a_file_at_other_blocks_gives_the_files_bytes(loop_fs: LoopFilesystem,
                                                                     tmp_path: Path) -> None:
    root = loop_fs.mount / "train"
    (root / "c").mkdir(parents=True)
    a, b = _bytes(20000, 1), _bytes(20000, 2)
    (root / "c/a.jpg").write_bytes(a)
    (root / "c/b.jpg").write_bytes(b)
    good = tmp_path / "good.json"
    build_extent_map(root, good)
    edited = json.loads(good.read_text())
    # a's extents now name b's blocks: what a move of a's blocks looks like (identity unchanged).
    edited["files"][0]["extents"] = edited["files"][1]["extents"]
    bad = tmp_path / "moved.json"
    bad.write_text(json.dumps(edited))
    reader = FileReader(file_root=root, batch_size=2, shuffle=False, file_filters="*.jpg",
                        extent_map=bad)
    (samples, _), = list(reader)
    assert [s.numpy().tobytes() for s in samples] == [a, b]
    assert reader.stats["fallback_files"] == 1 and reader.stats["raw_files"] == 1
    # A map made before maps carried checksums is read through the filesystem, saying why.
    for f in edited["files"]:
        del f["xxh64"]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(edited))
    raw = ExtentReader(old)
    assert [x.tobytes() for x in raw.read(["c/a.jpg", "c/b.jpg"])] == [a, b]
    assert raw.last_stats["raw_files"] == 0
    assert all("no checksum" in why for _, why in raw.last_stats["fallbacks"])


def test_an_extent_outside_the_filesystems_device_is_refused(loop_fs: LoopFilesystem,
                                                             tmp_path: Path) -> None:
    root = loop_fs.mount / "train"
    (root / "c").mkdir(parents=True)
    (root / "c/a.jpg").write_bytes(_bytes(8192, 3))
    good = tmp_path / "good.json"
    build_extent_map(root, good)
    edited = json.loads(good.read_text())
    size = 256 << 20  # the fixture's image: the device ends there
    edited["files"][0]["extents"] = [[0, size, 8192]]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(edited))
    for make in (lambda: FileReader(file_root=root, file_filters="*.jpg", extent_map=bad),
                 lambda: ExtentReader(bad)):
        with pytest.raises(ValueError, match="outside its filesystem's device"):
            make()


def test_a_map_others_can_write_or_own_is_refused(loop_fs: LoopFilesystem,
                                                  tmp_path: Path) -> None:
    root = loop_fs.mount / "train"
    (root / "c").mkdir(parents=True)
    (root / "c/a.jpg").write_bytes(_bytes(100, 4))
    path = tmp_path / "map.json"
    build_extent_map(root, path)
    os.chmod(path, 0o666)
    with pytest.raises(PermissionError, match="chmod go-w") as info:
        FileReader(file_root=root, file_filters="*.jpg", extent_map=path)
    assert info.value.filename == str(path)
    os.chmod(path, 0o644)
    os.chown(path, 4321, 4321)  # the fixture runs as root only
    with pytest.raises(PermissionError, match="uid 4321"):
        load_extent_map(path)


def test_files_read_through_the_filesystem_stay_within_rlimit_nofile(loop_fs: LoopFilesystem,
                                                                    tmp_path: Path) -> None:
    root = loop_fs.mount / "train"
    (root / "c").mkdir(parents=True)
    files = {f"c/{i:03d}.jpg": _bytes(1000 + 37 * i, i) for i in range(200)}
    for name, data in files.items():
        (root / name).write_bytes(data)
    good = tmp_path / "good.json"
    build_extent_map(root, good)
    # Every checksum wrong: each raw read is read again through the filesystem after the batch's
    # raw reads, all 200 of them in one batch, in a child that may open 128 descriptors.
    edited = json.loads(good.read_text())
    for f in edited["files"]:
        f["xxh64"] = "0000000000000000"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(edited))
    script = (
        "import resource, sys\n"
        "from tensortier.data import ExtentReader, FileReader\n"
        "_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (128, hard))\n"
        "names = sys.argv[3:]\n"
        "reader = FileReader(files=[sys.argv[1] + '/' + n for n in names], batch_size=len(names),\n"
        "                    shuffle=False, extent_map=sys.argv[2])\n"
        "(samples, _), = list(reader)\n"
        "raw = ExtentReader(sys.argv[2]).read(names)\n"
        "for s, a, n in zip(samples, raw, names):\n"
        "    data = open(sys.argv[1] + '/' + n, 'rb').read()\n"
        "    assert s.numpy().tobytes() == data and a.tobytes() == data, n\n"
        "print(reader.stats['fallback_files'], reader.stats['raw_files'])\n")
    r = subprocess.run([sys.executable, "-c", script, str(root), str(bad), *sorted(files)],
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split() == ["200", "0"]


def test_star_import_gives_the_public_names() -> None:
    names: dict[str, object] = {}
    exec("from tensortier.data.extents import *", names)  # noqa: S102 - the import under test
    assert sorted(k for k in names if k != "__builtins__") == [
        "ExtentMap", "ExtentReader", "build_extent_map", "load_extent_map", "read_files",
        "verify_extent_map"]
