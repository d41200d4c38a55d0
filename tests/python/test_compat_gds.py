"""tensortier.compat.gds: torch.cuda.gds's exceptions and results for misuse (on CPU storages,
which take the same code path up to the transfer)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from tensortier.compat import gds


def test_a_load_past_the_end_fills_what_the_file_holds(disk_dir: Path) -> None:
    """torch's load_storage drops cuFileRead's short count: no error, the rest unchanged."""
    path = disk_dir / "short.bin"
    path.write_bytes(bytes(range(100)))
    with gds.GdsFile(path, os.O_RDONLY) as f:
        s = torch.full((300,), 7, dtype=torch.uint8)
        assert f.load_storage(s.untyped_storage(), 40) is None
        assert s[:60].tolist() == list(range(40, 100)) and s[60:].eq(7).all()
        f.load_storage(s.untyped_storage(), 1000)  # wholly past the end: nothing read
        assert s[60:].eq(7).all()


def test_failed_transfers_are_runtime_errors_with_errno(disk_dir: Path) -> None:
    path = disk_dir / "ro.bin"
    path.write_bytes(b"\0" * 4096)
    with gds.GdsFile(path, os.O_RDONLY) as f:
        with pytest.raises(RuntimeError, match="cuFileWrite failed") as e:
            f.save_storage(torch.zeros(8).untyped_storage(), 0)
        assert isinstance(e.value, OSError) and e.value.errno == errno.EBADF
        with pytest.raises(RuntimeError, match="cuFileRead failed") as e:
            f.load_storage(torch.zeros(8).untyped_storage(), -4096)
        assert isinstance(e.value, OSError) and e.value.errno == errno.EINVAL


def test_handle_registration_follows_torch(disk_dir: Path) -> None:
    f = gds.GdsFile(disk_dir / "h.bin", os.O_CREAT | os.O_RDWR)
    s = torch.arange(16, dtype=torch.uint8).untyped_storage()
    with pytest.raises(AssertionError, match="already registered"):
        f.register_handle()  # __init__ registered it
    f.deregister_handle()
    assert f.handle is None
    with pytest.raises(AssertionError, match="not registered"):
        f.deregister_handle()
    with pytest.raises(AssertionError, match="Cannot save data to a file that is not registered"):
        f.save_storage(s, 0)
    with pytest.raises(AssertionError, match="Cannot load data from a file that is not regis"):
        f.load_storage(s, 0)
    f.register_handle()
    f.save_storage(s, 0)
    f.close()
    f.close()  # a second close does nothing, as torch's
    assert f.fd == -1 and f.handle is None
    with pytest.raises(AssertionError, match="not registered"):
        f.save_storage(s, 0)
    with pytest.raises(RuntimeError, match="cuFileHandleRegister"):
        f.register_handle()  # torch's registers descriptor -1


def test_argument_types(disk_dir: Path) -> None:
    with gds.GdsFile(disk_dir / "t.bin", os.O_CREAT | os.O_RDWR) as f:
        with pytest.raises(TypeError):
            f.save_storage(torch.zeros(3), 0)  # a tensor, not its storage
        with pytest.raises(TypeError):
            f.save_storage(torch.zeros(3).untyped_storage(), 1.5)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            gds.gds_register_buffer(b"bytes")
    with pytest.raises(FileNotFoundError):
        gds.GdsFile(disk_dir / "missing.bin", os.O_RDONLY)


def test_integers_of_numpy_and_torch_are_taken_as_torch_s_are(disk_dir: Path) -> None:
    """torch's GdsFile passes flags to os.open and offsets to a pybind11 int64: anything with
    __index__ works there (offsets summed with numpy, say)."""
    import numpy as np

    flags = np.int64(os.O_CREAT | os.O_RDWR)
    with gds.GdsFile(disk_dir / "n.bin", flags) as f:  # type: ignore[arg-type]
        s = torch.arange(16, dtype=torch.uint8).untyped_storage()
        f.save_storage(s, np.int64(4096))  # type: ignore[arg-type]
        back = torch.zeros(16, dtype=torch.uint8)
        f.load_storage(back.untyped_storage(), torch.tensor(4096).item())
        f.load_storage(back.untyped_storage(), np.uint32(4096))  # type: ignore[arg-type]
        assert back.tolist() == list(range(16))
        with pytest.raises(TypeError):
            f.load_storage(back.untyped_storage(), np.float64(0.0))  # type: ignore[arg-type]


def test_a_forked_child_opens_files_of_its_own(disk_dir: Path) -> None:
    """A GdsFile made in a child made by fork, after the parent used the module: the child's
    transfers run on a handle of its own (the parent's threads are not in the child)."""
    import subprocess
    import sys

    code = f"""
import os, torch
from tensortier.compat.gds import GdsFile
p = {str(disk_dir / "f.bin")!r}
s = torch.arange(256, dtype=torch.float32).untyped_storage()
GdsFile(p, os.O_CREAT | os.O_RDWR).save_storage(s, 0)
pid = os.fork()
if pid == 0:
    t = torch.empty(256).untyped_storage()
    GdsFile(p, os.O_RDONLY).load_storage(t, 0)
    os._exit(0 if bytes(t) == bytes(s) else 3)
_, status = os.waitpid(pid, 0)
t = torch.empty(256).untyped_storage()
GdsFile(p, os.O_RDONLY).load_storage(t, 0)  # and the parent's still works
assert bytes(t) == bytes(s)
raise SystemExit(os.waitstatus_to_exitcode(status))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, (r.returncode, r.stderr)
