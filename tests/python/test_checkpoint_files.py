"""Checkpoint files as the filesystem holds them: temporary files of killed saves, FIFOs given
to readers, another user's checkpoint, read-only checkpoints, and errors that name the file.
The library and the `tensortier` CLI follow the same rules (one C++ implementation)."""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import tensortier

BIN = Path(os.environ.get("TENSORTIER_CLI", Path(sys.executable).parent / "tensortier"))
NOBODY = 65534  # uid and gid of nobody/nogroup
IS_ROOT = os.geteuid() == 0


def cli(*args: object, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    if not BIN.is_file():
        pytest.skip(f"no tensortier binary at {BIN}")
    return subprocess.run(
        [str(BIN), *map(str, args)], capture_output=True, text=True, errors="replace",
        timeout=timeout,
    )


def python(code: str, *, timeout: float = 120, as_nobody: bool = False
           ) -> subprocess.CompletedProcess[str]:
    """Runs `code` in a new interpreter (as uid/gid 65534 with `as_nobody`), bounded in time."""
    prelude = ""
    if as_nobody:
        # Modules are imported first: the interpreter's own files may lie where only root may
        # read them (a home directory).
        prelude = (
            "import errno, os, subprocess, sys, torch, tensortier, tensortier.checkpoint\n"
            f"os.setgroups([])\nos.setgid({NOBODY})\nos.setuid({NOBODY})\n"
        )
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        capture_output=True, text=True, timeout=timeout,
    )


def temporaries(d: Path) -> list[str]:
    return sorted(n for n in os.listdir(d) if ".tmp-" in n)


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory every user may write (for saves by another uid), removed afterwards."""
    d = Path(tempfile.mkdtemp(prefix="tensortier-shared-"))
    try:
        os.chmod(d, 0o777)
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ---- temporary files of killed saves ----------------------------------------------------------


def kill_mid_save(path: Path, nbytes: int) -> int:
    """Saves `nbytes` to `path` in a new process that SIGKILLs itself once the data is written
    and before the rename; returns its pid."""
    r = python(f"""
        import os, signal, torch, tensortier
        from tensortier import _core
        from tensortier.checkpoint import _writing
        def killed(self):
            os.kill(os.getpid(), signal.SIGKILL)
        _writing._DurableFile.commit = killed
        class Killed(_core.TorchFileWriter):  # a .pt's writer commits unless told not to
            def write(self, engine, out, addresses, commit=False):
                super().write(engine, out, addresses, False)
                killed(self)
        _core.TorchFileWriter = Killed
        print(os.getpid(), flush=True)
        tensortier.save({{"w": torch.ones({nbytes // 4})}}, {str(path)!r})
    """)
    assert r.returncode == -signal.SIGKILL, r.stderr
    return int(r.stdout.split()[0])


@pytest.mark.parametrize("name", ["ck.safetensors", "ck.pt"])
@pytest.mark.parametrize("by", ["library", "cli"])
def test_the_next_save_removes_a_killed_saves_temporary_file(
    disk_dir: Path, name: str, by: str
) -> None:
    path = disk_dir / name
    tensortier.save({"w": torch.zeros(4)}, path)
    pid = kill_mid_save(path, 8 << 20)
    left = temporaries(disk_dir)
    assert len(left) == 1 and left[0].startswith(f".{name}.tmp-{pid}-"), left
    assert os.path.getsize(disk_dir / left[0]) >= 8 << 20
    assert torch.equal(tensortier.load(path)["w"], torch.zeros(4))  # the old one, whole
    if by == "library":
        tensortier.save({"w": torch.ones(2)}, path)
        assert torch.equal(tensortier.load(path)["w"], torch.ones(2))
    else:
        src = disk_dir / ("src.pt" if name.endswith(".safetensors") else "src.safetensors")
        tensortier.save({"w": torch.ones(2)}, src)
        r = cli("convert", src, path)
        assert r.returncode == 0, r.stderr
    assert temporaries(disk_dir) == []


def test_a_running_saves_temporary_file_is_kept(disk_dir: Path) -> None:
    """A process that is alive keeps its file (pid and start time match); once it is gone the
    next save removes it. A live pid with another start time is a reused pid: removed."""
    path = disk_dir / "ck.safetensors"
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys
            from tensortier import _core
            tmp = _core.temporary_path_prefix({str(path)!r}) + "0123abcd"
            open(tmp, "wb").write(b"partial")
            print(tmp, flush=True)
            sys.stdin.read()
        """)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        live = Path(child.stdout.readline().strip())
        assert live.exists() and f".tmp-{child.pid}-" in live.name
        # The same pid and tag, another start time: the pid's earlier owner, killed.
        pid, start, tag, _ = live.name.rsplit(".tmp-", 1)[1].split("-")
        reused = disk_dir / f".ck.safetensors.tmp-{pid}-{int(start) + 1}-{tag}-4567abcd"
        reused.write_bytes(b"partial")
        other_machine = disk_dir / f".ck.safetensors.tmp-{pid}-{int(start) + 1}-0-89abcdef"
        other_machine.write_bytes(b"partial")
        tensortier.save({"w": torch.ones(2)}, path)
        assert live.exists() and not reused.exists() and other_machine.exists()
        tensortier.save({"w": torch.ones(2)}, disk_dir / "src.pt")
        r = cli("convert", disk_dir / "src.pt", path)
        assert r.returncode == 0 and live.exists(), r.stderr
    finally:
        if child.stdin is not None:
            child.stdin.close()
        child.wait(timeout=60)
    tensortier.save({"w": torch.ones(2)}, path)
    assert not live.exists()
    assert temporaries(disk_dir) == [other_machine.name]


# ---- FIFOs -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["f.safetensors", "f.pt", "f.index.json", "f"])
def test_load_refuses_a_fifo_without_waiting(tmp_path: Path, name: str) -> None:
    fifo = tmp_path / name
    os.mkfifo(fifo)
    # In a child process, so that a load that waits for a writer fails the test, not hangs it.
    r = python(f"""
        import errno, tensortier
        fifo = {str(fifo)!r}
        for call in (lambda: tensortier.load(fifo), lambda: tensortier.load_into({{}}, fifo)):
            try:
                call()
            except OSError as e:
                assert e.errno == errno.EINVAL, e
                assert fifo in str(e) and "FIFO" in str(e), e
            else:
                raise AssertionError("loaded a FIFO")
    """, timeout=60)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("name", ["f.safetensors", "f.pt", "f.index.json"])
@pytest.mark.parametrize("command", ["info", "verify", "convert"])
def test_cli_refuses_a_fifo_without_waiting(tmp_path: Path, name: str, command: str) -> None:
    fifo = tmp_path / name
    os.mkfifo(fifo)
    args = [fifo, tmp_path / "out.safetensors"] if command == "convert" else [fifo]
    r = cli(command, *args, timeout=60)
    assert r.returncode != 0
    assert str(fifo) in r.stderr, r.stderr
    if not (command == "convert" and name.endswith(".index.json")):  # refused by its name
        assert "FIFO" in r.stderr, r.stderr
    assert not (tmp_path / "out.safetensors").exists()


# ---- another user's checkpoint, read-only checkpoints ------------------------------------------


@pytest.mark.skipif(not IS_ROOT, reason="giving files to another user needs root")
@pytest.mark.parametrize("name", ["ck.safetensors", "ck.pt"])
def test_root_saving_over_another_users_checkpoint_keeps_its_owner(
    disk_dir: Path, name: str
) -> None:
    path = disk_dir / name
    tensortier.save({"w": torch.zeros(3)}, path)
    os.chown(path, NOBODY, NOBODY)
    os.chmod(path, 0o640)
    tensortier.save({"w": torch.ones(3)}, path)
    st = os.stat(path)
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (NOBODY, NOBODY, 0o640)
    # The CLI's writer alike.
    other = disk_dir / ("src.pt" if name.endswith(".safetensors") else "src.safetensors")
    tensortier.save({"w": torch.full((3,), 2.0)}, other)
    r = cli("convert", other, path)
    assert r.returncode == 0, r.stderr
    st = os.stat(path)
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (NOBODY, NOBODY, 0o640)
    assert torch.equal(tensortier.load(path)["w"], torch.full((3,), 2.0))


@pytest.mark.skipif(not IS_ROOT, reason="running as another user needs root")
def test_a_user_saving_over_a_group_writable_file_owns_the_new_one(shared_dir: Path) -> None:
    """Not root: the owner cannot be kept (EPERM); the save goes on, the new file belongs to
    the saving user, with the old group (the user belongs to it) and mode."""
    path = shared_dir / "ck.safetensors"
    tensortier.save({"w": torch.zeros(3)}, path)
    os.chown(path, 0, NOBODY)
    os.chmod(path, 0o664)
    r = python(f"""
        import torch, tensortier
        tensortier.save({{"w": torch.ones(3)}}, {str(path)!r})
    """, as_nobody=True)
    assert r.returncode == 0, r.stderr
    st = os.stat(path)
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (NOBODY, NOBODY, 0o664)
    assert temporaries(shared_dir) == []


def test_save_over_a_read_only_checkpoint_does_what_torch_save_does(disk_dir: Path) -> None:
    """torch.save opens the file for writing: refused without write permission, allowed for
    root (which open() lets write any file). save() decides the same way, here as whoever runs
    the tests (the refusal itself, as another user, is the next test)."""
    for name in ("m.safetensors", "m.pt"):
        path = disk_dir / name
        tensortier.save({"w": torch.ones(3)}, path)
        os.chmod(path, 0o444)
        before = path.read_bytes()
        try:
            torch.save({"w": torch.ones(1)}, str(disk_dir / "probe.pt"))
            os.chmod(disk_dir / "probe.pt", 0o444)
            torch.save({"w": torch.ones(1)}, str(disk_dir / "probe.pt"))
            torch_refuses = False
        except (PermissionError, RuntimeError):  # RuntimeError from its C++ writer, for a path
            torch_refuses = True
        if torch_refuses:
            with pytest.raises(PermissionError) as e:
                tensortier.save({"w": torch.zeros(3)}, path)
            assert str(path) in str(e.value)
            assert path.read_bytes() == before
        else:
            tensortier.save({"w": torch.zeros(3)}, path)
            assert tensortier.load(path)["w"].sum().item() == 0
        assert (os.stat(path).st_mode & 0o777) == 0o444
        assert temporaries(disk_dir) == []


@pytest.mark.skipif(not IS_ROOT, reason="the non-root case runs as the test user itself above")
def test_another_user_may_not_replace_a_read_only_checkpoint(shared_dir: Path) -> None:
    for name in ("m.safetensors", "m.pt"):
        path = shared_dir / name
        tensortier.save({"w": torch.ones(3)}, path)
        os.chown(path, NOBODY, NOBODY)  # the user's own file, made read-only
        os.chmod(path, 0o444)
        before = path.read_bytes()
        r = python(f"""
            import errno, torch, tensortier
            try:  # torch.save given a path refuses with its C++ writer's RuntimeError
                torch.save({{"w": torch.zeros(3)}}, {str(path)!r})
            except RuntimeError as e:
                assert "Permission denied" in str(e), e
            else:
                raise AssertionError("torch.save replaced a read-only file")
            try:
                tensortier.save({{"w": torch.zeros(3)}}, {str(path)!r})
            except PermissionError as e:
                assert e.errno == errno.EACCES and {str(path)!r} in str(e), e
            else:
                raise AssertionError("tensortier.save replaced a read-only file")
        """, as_nobody=True)
        assert r.returncode == 0, r.stderr
        assert path.read_bytes() == before and temporaries(shared_dir) == []
    # The CLI refuses alike (as that user, through a shell that drops root).
    src = shared_dir / "src.pt"
    tensortier.save({"w": torch.zeros(3)}, src)
    os.chmod(src, 0o644)
    if not BIN.is_file():
        pytest.skip(f"no tensortier binary at {BIN}")
    r = python(f"""
        import subprocess, sys
        r = subprocess.run([{str(BIN)!r}, "convert", {str(src)!r},
                            {str(shared_dir / "m.safetensors")!r}],
                           capture_output=True, text=True, timeout=60)
        sys.stderr.write(r.stderr)
        sys.exit(r.returncode)
    """, as_nobody=True)
    assert r.returncode != 0 and "Permission denied" in r.stderr, r.stderr
    assert str(shared_dir / "m.safetensors") in r.stderr
    assert temporaries(shared_dir) == []


# ---- errors name the file ---------------------------------------------------------------------


def flip_record_byte(path: Path, record: str) -> None:
    """XORs the first byte of zip record `record` (an archive member's stored data)."""
    with zipfile.ZipFile(path) as z:
        names = [n for n in z.namelist() if n.endswith("/" + record)]
        assert len(names) == 1, (record, z.namelist())
        info = z.getinfo(names[0])
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len = int.from_bytes(f.read(2), "little")
        extra_len = int.from_bytes(f.read(2), "little")
        data = info.header_offset + 30 + name_len + extra_len
        f.seek(data)
        b = f.read(1)
        f.seek(data)
        f.write(bytes([b[0] ^ 0x01]))


@pytest.mark.parametrize("writer", ["tensortier", "torch"])
@pytest.mark.parametrize(
    "record", [".format_version", "version", ".data/serialization_id", "byteorder", "data.pkl"]
)
def test_load_verify_checks_every_zip_record_as_the_cli_does(
    disk_dir: Path, writer: str, record: str
) -> None:
    path = disk_dir / "m.pt"
    sd = {"w": torch.arange(6, dtype=torch.float32), "b": torch.ones(2, dtype=torch.int64)}
    if writer == "torch":
        torch.save(sd, path)
    else:
        tensortier.save(sd, path)
    with zipfile.ZipFile(path) as z:
        if not any(n.endswith("/" + record) for n in z.namelist()):
            pytest.skip(f"this torch writes no {record}")
    tensortier.load(path, verify=True)
    tensortier.load_into({k: torch.empty_like(v) for k, v in sd.items()}, path, verify=True)
    assert cli("verify", path).returncode == 0
    flip_record_byte(path, record)
    with pytest.raises(ValueError) as e:
        tensortier.load(path, verify=True)
    assert str(path) in str(e.value)
    with pytest.raises(ValueError):
        tensortier.load_into({k: torch.empty_like(v) for k, v in sd.items()}, path, verify=True)
    r = cli("verify", path)
    assert r.returncode != 0 and str(path) in r.stderr


def test_a_corrupt_pickle_string_is_an_error_naming_the_file(disk_dir: Path) -> None:
    path = disk_dir / "m.pt"
    tensortier.save({"weight_of_a_layer": torch.ones(2)}, path)
    data = bytearray(path.read_bytes())
    at = data.index(b"weight_of_a_layer")
    data[at] = 0x92  # not UTF-8
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError) as e:
        tensortier.load(path)
    message = str(e.value)
    assert message.startswith(f"{path}: malformed data.pkl (at byte "), message
    assert "UnicodeDecodeError" in message
    for command in ("info", "verify"):  # the CLI's own pickle reader refuses it alike
        r = cli(command, path)
        assert r.returncode == 1, r.stdout
        assert f"{path}: archive/data.pkl: at byte " in r.stderr, r.stderr
        assert "string is not valid UTF-8" in r.stderr
    r = cli("convert", path, disk_dir / "out.safetensors")
    assert r.returncode == 1 and str(path) in r.stderr, r.stderr
    assert not (disk_dir / "out.safetensors").exists()


def test_a_pickled_surrogate_is_read_as_torch_load_reads_it(disk_dir: Path) -> None:
    """Python pickles a lone surrogate ("\\ud800") and unpickles it ("surrogatepass")."""
    path = disk_dir / "m.pt"
    torch.save({"\ud800": torch.ones(2)}, path)
    assert list(torch.load(path, weights_only=True)) == ["\ud800"]
    assert list(tensortier.load(path)) == ["\ud800"]
    assert cli("info", path).returncode == 0
    r = cli("convert", path, disk_dir / "out.safetensors")  # no JSON string holds it
    assert r.returncode == 1 and f"{path}: " in r.stderr, r.stderr


@pytest.fixture
def full_dir() -> Iterator[Path]:
    """A 1 MiB tmpfs: writes past it fail with ENOSPC."""
    if not IS_ROOT:
        pytest.skip("mounting a small filesystem needs root")
    libc = ctypes.CDLL(None, use_errno=True)
    with tempfile.TemporaryDirectory(prefix="tensortier-full-") as d:
        if libc.mount(b"none", d.encode(), b"tmpfs", 0, b"size=1m") != 0:
            pytest.skip(f"cannot mount tmpfs: {os.strerror(ctypes.get_errno())}")
        try:
            yield Path(d)
        finally:
            libc.umount2(d.encode(), 2)  # MNT_DETACH


@pytest.mark.parametrize("name", ["ck.safetensors", "ck.pt"])
def test_a_failed_save_names_the_callers_path(full_dir: Path, name: str) -> None:
    given = os.path.join(os.path.relpath(full_dir), name)  # as the caller wrote it
    with pytest.raises(OSError) as e:
        tensortier.save({"w": torch.ones(1 << 20)}, given)
    assert e.value.errno == errno.ENOSPC
    assert str(e.value).startswith(f"[Errno {errno.ENOSPC}] cannot save {given!r}: "), e.value
    assert temporaries(full_dir) == []


def test_a_failed_convert_names_its_output(full_dir: Path, disk_dir: Path) -> None:
    src = disk_dir / "big.pt"
    tensortier.save({"w": torch.ones(1 << 20)}, src)
    out = full_dir / "big.safetensors"
    r = cli("convert", src, out)
    assert r.returncode != 0
    assert f"write '{out}': " in r.stderr and "No space left" in r.stderr, r.stderr
    assert temporaries(full_dir) == [] and not out.exists()


def test_a_killed_save_to_a_file_object_leaves_nothing_after_the_next(tmp_path: Path) -> None:
    """A save to a file object is staged in TMPDIR; a SIGKILL while it is copied out leaves
    the staging directory, which the next save to a file object removes."""
    killed = textwrap.dedent("""
        import io, os, shutil, signal, torch, tensortier
        def die(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
        shutil.copyfileobj = die
        tensortier.save({"w": torch.ones(1000)}, io.BytesIO())
    """)
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", killed], env=env, timeout=120)
    assert r.returncode == -signal.SIGKILL
    left = [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert len(left) == 1 and left[0].stat().st_mode & 0o777 == 0o700  # only its user reads it
    follows = textwrap.dedent("""
        import io, torch, tensortier
        buffer = io.BytesIO()
        tensortier.save({"w": torch.ones(1000)}, buffer)
        buffer.seek(0)
        assert torch.equal(torch.load(buffer)["w"], torch.ones(1000))
    """)
    r = subprocess.run([sys.executable, "-c", follows], env=env, timeout=120,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_save_over_a_checkpoint_keeps_its_extended_attributes(tmp_path: Path) -> None:
    """user.* attributes (and ACLs, by the same copy) of the replaced file stay, as an in-place
    torch.save keeps them."""
    path = tmp_path / "m.pt"
    tensortier.save({"w": torch.ones(3)}, path)
    try:
        os.setxattr(path, "user.tensortier.test", b"kept")
    except OSError as e:
        if e.errno in (errno.ENOTSUP, errno.EPERM):
            pytest.skip(f"no user extended attributes on this file system: {e}")
        raise
    tensortier.save({"w": torch.zeros(3)}, path)
    assert os.getxattr(path, "user.tensortier.test") == b"kept"
    assert torch.equal(tensortier.load(path)["w"], torch.zeros(3))


def test_a_file_that_is_a_mount_point_is_saved_over_in_place(tmp_path: Path) -> None:
    """A checkpoint bind-mounted into a container as one file (docker -v host.pt:/ckpt.pt, a
    Kubernetes subPath) cannot be renamed over: its bytes are written into it, as torch.save
    writes them, and nothing is left beside it."""
    from conftest import mounted

    host = tmp_path / "host.pt"
    tensortier.save({"w": torch.ones(3)}, host)
    (tmp_path / "box").mkdir()
    target = tmp_path / "box" / "ckpt.pt"
    target.write_bytes(b"")
    with mounted(["mount", "--bind", str(host), str(target)], target, "a bind mount of a file"):
        tensortier.save({"w": torch.full((1000,), 2.0)}, target)
        assert torch.equal(tensortier.load(target)["w"], torch.full((1000,), 2.0))
        assert torch.equal(tensortier.load(host)["w"], torch.full((1000,), 2.0))  # the same file
        assert sorted(p.name for p in (tmp_path / "box").iterdir()) == ["ckpt.pt"]
