"""tensortier.compat.tensornvme: TensorNVMe's own tests, and its errors for misuse (same types,
tensors left exactly as they were)."""

from __future__ import annotations

import errno
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tensortier import DiskOffloader as NativeOffloader
from tensortier.compat.tensornvme import DiskOffloader, UnsupportedBackendError

from conftest import require_backend

_BACKENDS = {"uring": "io_uring", "aio": "libaio", "pthread": "threads"}


def storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


@pytest.fixture
def of(disk_dir: Path) -> Iterator[DiskOffloader]:
    with DiskOffloader(str(disk_dir), backend="threads") as o:
        yield o


# ---- TensorNVMe's tests (tests/test_disk_offloader.py), only the import changed ----------------


@pytest.mark.parametrize("backend", ["uring", "aio"])
def test_sync_io(disk_dir: Path, backend: str) -> None:
    require_backend(_BACKENDS[backend])
    x = torch.rand(2, 2)
    x_copy = x.clone()
    of = DiskOffloader(str(disk_dir), backend=backend)
    try:
        of.sync_read(x)
        assert False
    except RuntimeError:
        pass
    of.sync_write(x)
    assert x.storage().size() == 0
    of.sync_read(x)
    assert torch.equal(x, x_copy)


@pytest.mark.parametrize("backend", ["uring", "aio"])
def test_async_io(disk_dir: Path, backend: str) -> None:
    require_backend(_BACKENDS[backend])
    x = torch.rand(2, 2)
    x_copy = x.clone()
    of = DiskOffloader(str(disk_dir), backend=backend)
    try:
        of.async_read(x)
        assert False
    except RuntimeError:
        pass
    of.async_write(x)
    of.sync_write_events()
    assert x.storage().size() == 0
    of.sync_read(x)
    of.sync_read_events()
    assert torch.equal(x, x_copy)


@pytest.mark.parametrize("backend", ["uring", "aio"])
def test_sync_vec_io(disk_dir: Path, backend: str) -> None:
    require_backend(_BACKENDS[backend])
    x = torch.rand(2, 2)
    y = torch.rand(2, 2, 2)
    x_copy = x.clone()
    y_copy = y.clone()
    of = DiskOffloader(str(disk_dir), backend=backend)
    try:
        of.sync_readv([x, y])
        assert False
    except RuntimeError:
        pass
    of.sync_writev([x, y])
    assert x.storage().size() == 0
    assert y.storage().size() == 0
    try:
        of.sync_readv(x)
        assert False
    except RuntimeError:
        pass
    try:
        of.sync_readv([y, x])
        assert False
    except RuntimeError:
        pass
    of.sync_readv([x, y])
    assert torch.equal(x, x_copy)
    assert torch.equal(y, y_copy)


@pytest.mark.parametrize("backend", ["uring", "aio"])
def test_async_vec_io(disk_dir: Path, backend: str) -> None:
    require_backend(_BACKENDS[backend])
    x = torch.rand(2, 2)
    y = torch.rand(2, 2, 2)
    x_copy = x.clone()
    y_copy = y.clone()
    of = DiskOffloader(str(disk_dir), backend=backend)
    try:
        of.async_readv([x, y])
        assert False
    except RuntimeError:
        pass
    of.async_writev([x, y])
    of.sync_write_events()
    assert x.storage().size() == 0
    assert y.storage().size() == 0
    try:
        of.async_readv(x)
        assert False
    except RuntimeError:
        pass
    try:
        of.async_readv([y, x])
        assert False
    except RuntimeError:
        pass
    of.async_readv([x, y])
    of.sync_read_events()
    assert torch.equal(x, x_copy)
    assert torch.equal(y, y_copy)


# ---- misuse: TensorNVMe's exception, nothing changed -------------------------------------------


def test_reading_a_tensor_not_offloaded_is_a_runtime_error_that_changes_nothing(
    of: DiskOffloader,
) -> None:
    x = torch.rand(3, 5)
    x0 = x.clone()
    for read in (of.sync_read, of.async_read):
        with pytest.raises(RuntimeError, match="tensor not found"):
            read(x)
        assert storage_bytes(x) == 60 and torch.equal(x, x0)
    for readv in (of.sync_readv, of.async_readv):
        with pytest.raises(RuntimeError, match="tensor not found"):
            readv([x])
        assert storage_bytes(x) == 60 and torch.equal(x, x0)
    # Read back already: not offloaded any more.
    of.sync_write(x)
    of.sync_read(x)
    with pytest.raises(RuntimeError, match="tensor not found"):
        of.sync_read(x)
    assert torch.equal(x, x0)


@pytest.mark.parametrize("order", ["reversed", "subset", "single", "superset"])
def test_readv_needs_the_tensors_and_order_of_its_writev(of: DiskOffloader, order: str) -> None:
    x, y, z = torch.rand(4), torch.rand(2, 3), torch.rand(7)
    copies = [t.clone() for t in (x, y, z)]
    of.sync_writev([x, y])
    of.sync_write(z)
    attempt = {
        "reversed": lambda: of.sync_readv([y, x]),
        "subset": lambda: of.async_readv([x]),
        "single": lambda: of.sync_read(x),
        "superset": lambda: of.sync_readv([x, y, z]),
    }[order]
    with pytest.raises(RuntimeError, match="tensor not found"):
        attempt()
    assert storage_bytes(x) == storage_bytes(y) == storage_bytes(z) == 0  # still offloaded
    assert of.is_offloaded(x) and of.is_offloaded(y) and of.is_offloaded(z)
    with pytest.raises(RuntimeError, match="tensor not found"):
        of.sync_readv([z])  # written alone: read alone
    of.sync_readv([x, y])
    of.sync_read(z)
    for t, c in zip((x, y, z), copies):
        assert torch.equal(t, c)


def test_tensors_written_one_by_one_are_not_a_vector(of: DiskOffloader) -> None:
    x, y = torch.rand(4), torch.rand(5)
    of.async_write(x)
    of.async_write(y)
    of.sync_write_events()
    with pytest.raises(RuntimeError, match="tensor not found"):
        of.sync_readv([x, y])
    assert storage_bytes(x) == storage_bytes(y) == 0
    of.sync_read(y)
    of.sync_read(x)


def test_a_tensor_of_a_vector_written_again_leaves_the_vector_readable(
        of: DiskOffloader) -> None:
    """TensorNVMe keys a vector by its tensors: writing one of them again (alone, or in another
    vector) leaves the first vector's key, whose read brings back every tensor of it (the one
    written again as its later write). Before, the vector's other tensors could never be read."""
    a, b, c = torch.rand(8), torch.rand(8), torch.rand(8)
    a1, b0 = torch.rand(8), b.clone()
    of.async_writev([a, b])
    of.sync_write_events()
    of.sync_readv([a, b])
    a.copy_(a1)
    of.async_writev([a, b])
    of.async_write(a)  # a again, while the vector's write may run
    of.sync_write_events()
    of.sync_readv([a, b])
    assert torch.equal(a, a1) and torch.equal(b, b0)
    with pytest.raises(RuntimeError, match="tensor not found"):
        of.sync_readv([a, b])  # read back: its key is taken
    c0 = c.clone()
    of.async_writev([a, b])
    of.async_writev([a, c])  # a again, in another vector
    of.sync_write_events()
    of.sync_readv([a, c])
    assert torch.equal(c, c0) and storage_bytes(b) == 0
    of.sync_readv([a, b])  # a is back already: b, which only this read brings back
    assert torch.equal(a, a1) and torch.equal(b, b0)


def test_a_later_write_regroups_a_tensor(of: DiskOffloader) -> None:
    x, y = torch.rand(4), torch.rand(5)
    of.sync_writev([x, y])
    of.sync_readv([x, y])
    of.sync_write(x)
    of.sync_write(y)
    with pytest.raises(RuntimeError, match="tensor not found"):
        of.sync_readv([x, y])  # the vector was read back; each is now its own
    of.sync_read(x)
    of.sync_read(y)


@pytest.mark.parametrize("call", ["sync_readv", "async_readv"])
def test_an_offloaded_tensor_where_a_list_is_expected(of: DiskOffloader, call: str) -> None:
    """TensorNVMe iterates what it is given: torch refuses the rows of an offloaded tensor with a
    RuntimeError (setStorage ... out of bounds). Nothing is resized here."""
    x, y = torch.rand(2, 2), torch.rand(3)
    x0 = x.clone()
    of.sync_writev([x, y])
    with pytest.raises(RuntimeError, match="out of bounds"):
        getattr(of, call)(x)
    assert storage_bytes(x) == 0 and of.is_offloaded(x)
    of.sync_readv([x, y])
    assert torch.equal(x, x0)


@pytest.mark.parametrize("call", ["sync_writev", "async_writev", "sync_readv", "async_readv"])
def test_a_tensor_with_memory_where_a_list_is_expected(of: DiskOffloader, call: str) -> None:
    x = torch.rand(2, 2)
    x0 = x.clone()
    with pytest.raises(TypeError, match="list"):
        getattr(of, call)(x)
    assert storage_bytes(x) == 16 and torch.equal(x, x0) and not of.is_offloaded(x)
    with pytest.raises(TypeError):
        getattr(of, call)(torch.tensor(1.0))  # a 0-d tensor cannot be iterated


def test_writing_a_tensor_without_memory_is_an_assertion(of: DiskOffloader) -> None:
    x = torch.rand(10)
    of.sync_write(x)
    with pytest.raises(AssertionError):
        of.sync_write(x)
    with pytest.raises(AssertionError):
        of.async_writev([torch.rand(3), x])
    with pytest.raises(AssertionError):
        of.async_write(torch.empty(0))
    of.synchronize()
    assert of.stored_bytes == 40  # the refused vector wrote nothing


def test_non_contiguous_and_resized_tensors_are_runtime_errors(of: DiskOffloader) -> None:
    t = torch.rand(4, 4).t()
    t0 = t.clone()
    for call in (of.sync_write, of.async_write):
        with pytest.raises(RuntimeError, match="contiguous"):
            call(t)
    with pytest.raises(RuntimeError, match="contiguous"):
        of.sync_writev([torch.rand(2), t])
    assert torch.equal(t, t0) and storage_bytes(t) == 64
    x = torch.rand(10)
    x0 = x.clone()
    of.sync_write(x)
    x.data = torch.empty(5)  # another size: TensorNVMe's "shape mismatch"
    with pytest.raises(RuntimeError, match="shape mismatch"):
        of.sync_read(x)
    assert x.shape == (5,) and storage_bytes(x) == 20
    x.data = torch.empty(10)
    of.sync_read(x)
    assert torch.equal(x, x0)


def test_the_native_offloader_stays_lenient(disk_dir: Path) -> None:
    with NativeOffloader(disk_dir, backend="threads") as off:
        x, y = torch.rand(4), torch.rand(5)
        off.sync_writev([x, y])
        off.sync_read(y)  # any grouping
        off.sync_readv([x])
        with pytest.raises(ValueError, match="not offloaded"):
            off.sync_read(x)


def test_every_unsigned_n_entries_works_as_with_tensornvme(disk_dir: Path) -> None:
    """TensorNVMe's binding takes any 32-bit unsigned n_entries (io_uring rings up to 32768,
    libaio contexts and thread pools larger): so does this offloader, whose rings take the
    nearest depth they allow; past 32 bits, or negative, is pybind11's TypeError."""
    for n_entries in (0, 4097, 32768, (1 << 32) - 1):
        with DiskOffloader(str(disk_dir), n_entries) as of:
            x = torch.arange(1001, dtype=torch.float32)
            of.sync_write(x)
            assert storage_bytes(x) == 0
            of.sync_read(x)
            assert torch.equal(x, torch.arange(1001, dtype=torch.float32))
    for n_entries in (1 << 32, -1, 1 << 64):
        with pytest.raises(TypeError, match="n_entries"):
            DiskOffloader(str(disk_dir), n_entries)


def test_constructor_errors_are_tensornvme_s(disk_dir: Path) -> None:
    """TensorNVMe asserts that dir_name is a directory, its binding takes n_entries as an
    unsigned int (TypeError for anything else), and a backend it does not know fails before
    the directory is made: its DiskOffloader asserts (AssertionError), its C++ raises a
    RuntimeError ("Unsupported backend: ..."); code catching either catches this."""
    a_file = disk_dir / "a_file"
    a_file.write_bytes(b"x")
    with pytest.raises(AssertionError):
        DiskOffloader(str(a_file))
    with pytest.raises(FileNotFoundError):  # os.mkdir: the directory, not its parents
        DiskOffloader(str(disk_dir / "missing" / "dir"))
    for n_entries in (-1, 8.0, "16", None, [8]):
        with pytest.raises(TypeError):
            DiskOffloader(str(disk_dir), n_entries)  # type: ignore[arg-type]
    for backend in ("bogus", "", "URING"):
        for caught in (RuntimeError, AssertionError, UnsupportedBackendError):
            with pytest.raises(caught, match="Unsupported backend"):
                DiskOffloader(str(disk_dir / "never made"), 8, backend)
    assert a_file.read_bytes() == b"x" and sorted(p.name for p in disk_dir.iterdir()) == ["a_file"]
    with DiskOffloader(str(disk_dir / "made"), n_entries=4, backend="pthread") as of:
        x = torch.arange(5.0)
        of.sync_write(x)
        of.sync_read(x)
        assert torch.equal(x, torch.arange(5.0))
    import numpy as np

    with DiskOffloader(str(disk_dir / "made"), np.uint32(4)) as of:  # as pybind11 takes it
        assert of.backend in ("io_uring", "libaio", "threads")


def test_out_of_space_raises_and_leaves_the_tensors_as_they_were(small_fs: Path) -> None:
    """TensorNVMe ignores write errors (the tensor's memory is freed, its data lost); here the
    wait raises OSError (ENOSPC), the tensors keep memory and data, and their reads are
    TensorNVMe's "not found"."""
    with DiskOffloader(str(small_fs), 8) as of:
        big = torch.rand(2 << 20)  # 8 MiB on a 4 MiB filesystem
        big0 = big.clone()
        with pytest.raises(OSError) as e:
            of.sync_write(big)
        assert e.value.errno == errno.ENOSPC
        assert storage_bytes(big) == big.nbytes and torch.equal(big, big0)
        with pytest.raises(RuntimeError, match="not found"):
            of.sync_read(big)
        of.async_write(big)
        with pytest.raises(OSError) as e:
            of.sync_write_events()
        assert e.value.errno == errno.ENOSPC and torch.equal(big, big0)
        small = torch.rand(100)
        small0 = small.clone()
        with pytest.raises(OSError):
            of.sync_writev([small, big])
        assert torch.equal(small, small0) and torch.equal(big, big0)
        with pytest.raises(RuntimeError, match="not found"):
            of.sync_readv([small, big])
        of.sync_writev([small])  # the space is free again
        of.sync_readv([small])
        assert torch.equal(small, small0)
    assert [p.name for p in small_fs.iterdir() if p.name != "lost+found"] == []


_REFUSE_IO_URING = r"""
import ctypes, struct, sys, tempfile

def ins(code, jt, jf, k):
    return struct.pack("HBBI", code, jt, jf, k)

# A seccomp filter refusing io_uring_setup (425 on every Linux architecture) with EPERM, as
# Docker's default profile does.
prog = b"".join([
    ins(0x20, 0, 0, 0),                 # load the syscall number
    ins(0x15, 0, 1, 425),               # io_uring_setup?
    ins(0x06, 0, 0, 0x00050000 | 1),    # then fail it with EPERM
    ins(0x06, 0, 0, 0x7FFF0000),        # else allow
])
buf = ctypes.create_string_buffer(prog)

class Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

libc = ctypes.CDLL(None, use_errno=True)
fprog = Fprog(len(prog) // 8, ctypes.addressof(buf))
if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) != 0:
    print("SKIP seccomp", ctypes.get_errno())
    sys.exit(0)

import errno
import torch
from tensortier.compat.tensornvme import DiskOffloader, get_backends

assert "uring" not in get_backends(), get_backends()
d = sys.argv[1]
for backend in ("uring", "io_uring"):
    try:
        DiskOffloader(d, 16, backend)
    except RuntimeError as e:
        assert isinstance(e, OSError) and e.errno == errno.EPERM, e
        assert "not install correctly" in str(e), e
    else:
        raise AssertionError("io_uring started under the filter")
with DiskOffloader(d, 16) as of:  # the default takes a backend that starts
    x = torch.arange(10.0)
    of.sync_write(x)
    of.sync_read(x)
    assert torch.equal(x, torch.arange(10.0)) and of.backend != "io_uring"
print("OK")
"""


def test_a_backend_the_kernel_refuses_is_tensornvme_s_runtime_error(disk_dir: Path) -> None:
    """TensorNVMe probes the backend named and raises RuntimeError when it does not start
    (io_uring in a Docker container, say); ours is also an OSError with the kernel's errno.
    Run in a child process whose seccomp filter refuses io_uring."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _REFUSE_IO_URING, str(disk_dir)],
                         capture_output=True, text=True, timeout=120)
    if run.stdout.startswith("SKIP"):
        pytest.skip(f"cannot install a seccomp filter here: {run.stdout.strip()}")
    assert run.returncode == 0 and run.stdout.strip() == "OK", run.stdout + run.stderr


def test_the_environment_names_the_backend_as_with_tensornvme(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TENSORNVME_BACKEND, when set and not empty, takes the place of the backend argument
    (the way to change a backend that code names, as ColossalAI's "uring")."""
    monkeypatch.setenv("TENSORNVME_BACKEND", "pthread")
    with DiskOffloader(str(disk_dir), 16, "uring") as of:
        assert of.backend == "threads"
        x = torch.arange(6.0)
        of.sync_write(x)
        of.sync_read(x)
        assert torch.equal(x, torch.arange(6.0))
    monkeypatch.setenv("TENSORNVME_BACKEND", "bogus")
    with pytest.raises(RuntimeError, match="bogus"):
        DiskOffloader(str(disk_dir), 16, "pthread")
    monkeypatch.setenv("TENSORNVME_BACKEND", "")
    with DiskOffloader(str(disk_dir), 16, "pthread") as of:
        assert of.backend == "threads"
    monkeypatch.setenv("TENSORNVME_BACKEND", "bogus")
    with NativeOffloader(disk_dir, backend="threads") as native:  # TensorNVMe's variable only
        assert native.backend == "threads"


def test_a_tensor_being_read_is_not_found_again(of: DiskOffloader) -> None:
    """TensorNVMe takes a tensor's key when its read starts: reading it again while the first
    read runs is its "not found" (prefetching windows that overlap meet this)."""
    x = torch.rand(1 << 16)
    a, b = torch.rand(10), torch.rand(3)
    x0, a0, b0 = x.clone(), a.clone(), b.clone()
    of.sync_write(x)
    of.sync_writev([a, b])
    of.async_read(x)
    of.async_readv([a, b])
    for again in (lambda: of.async_read(x), lambda: of.sync_read(x),
                  lambda: of.async_readv([a, b]), lambda: of.sync_readv([a, b])):
        with pytest.raises(RuntimeError, match="tensor not found"):
            again()
    of.sync_read_events()
    assert torch.equal(x, x0) and torch.equal(a, a0) and torch.equal(b, b0)


def test_tensors_that_cannot_be_offloaded_are_runtime_errors(of: DiskOffloader) -> None:
    """TensorNVMe fails on numpy's memory when torch refuses to resize it, and on a tensor not
    on the CPU, with RuntimeError; ours refuses before writing (a RuntimeError and a
    ValueError, as the native offloader's), the tensors as they were."""
    import numpy as np

    from tensortier.compat.tensornvme import WriteRefusedError

    foreign = torch.from_numpy(np.arange(8, dtype=np.float32))
    meta = torch.empty(4, device="meta")
    other = torch.rand(3)
    shared = torch.arange(8, dtype=torch.float32).share_memory_()  # resize_ would crash
    for call, arg in ((of.sync_write, foreign), (of.async_write, foreign),
                      (of.sync_writev, [other, foreign]), (of.sync_write, meta),
                      (of.sync_write, shared)):
        with pytest.raises(RuntimeError) as e:
            call(arg)  # type: ignore[operator]
        assert isinstance(e.value, ValueError) and isinstance(e.value, WriteRefusedError)
    assert foreign.tolist() == list(range(8)) and storage_bytes(other) == 12
    assert shared.tolist() == list(range(8))
    of.synchronize()
    assert of.stored_bytes == 0


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_tensors_of_one_storage_in_one_vector_call(of: DiskOffloader, mode: str) -> None:
    """TensorNVMe keys a vector by the tuple of its tensors and moves each one's whole storage:
    a tensor and a view of all of it (or the same tensor twice) go in one writev and come back
    by the readv of the same list; other groupings are its "not found"."""
    t = torch.rand(4, 4)
    flat = t.view(-1)
    other = torch.rand(3)
    t0, other0 = t.clone(), other.clone()
    group: list[torch.Tensor] = [t, flat, other, other]
    if mode == "sync":
        of.sync_writev(group)
    else:
        of.async_writev(group)
        of.sync_write_events()
    held = [storage_bytes(t), storage_bytes(other)]  # not shown freed by a failing assert
    assert held == [0, 0]
    assert of.stored_bytes == 64 + 12  # each storage once
    for wrong in ([t, other], [flat, t, other, other], [t]):
        with pytest.raises(RuntimeError, match="tensor not found"):
            of.sync_readv(wrong)
    with pytest.raises(RuntimeError, match="tensor not found"):
        of.sync_read(flat)
    if mode == "sync":
        of.sync_readv(group)
    else:
        of.async_readv(group)
        of.sync_read_events()
    assert torch.equal(t, t0) and torch.equal(flat, t0.view(-1)) and torch.equal(other, other0)
    assert of.stored_bytes == 0


def test_a_view_of_part_of_a_storage_stays_refused_in_a_vector(of: DiskOffloader) -> None:
    """TensorNVMe moves a view's whole storage from the view's address: past the storage's end
    for a view that does not start it, and its read is a "shape mismatch". Refused before
    anything moves here."""
    from tensortier.compat.tensornvme import WriteRefusedError

    base = torch.rand(2, 8)
    base0 = base.clone()
    for group in ([base, base[1]], [base[0], base[1]], [base, base[0]]):
        with pytest.raises(WriteRefusedError):
            of.sync_writev(group)
    assert torch.equal(base, base0) and of.stored_bytes == 0


@pytest.mark.parametrize("path", ["host", "device"])
def test_writing_a_tensor_again_while_its_write_runs(disk_dir: Path, path: str) -> None:
    """TensorNVMe takes a second async_write of a tensor whose write still runs (its key then
    names the later write): both writes run, both callbacks run at the wait, the memory is
    freed once both are done, and a read brings back the later write's data. "device": the
    path of CUDA tensors, its copies done by memcpy."""
    copier = {"host": "cuda", "device": "memcpy"}[path]
    with DiskOffloader(str(disk_dir), backend="threads", _device_copier=copier) as of:
        _write_again_while_written(of)
        z = torch.rand(10)
        z0 = z.clone()
        of.async_write(z)
        of.async_write(z)
    # Closed with both writes not waited for: cancelled, the tensor keeps its memory and data.
    assert torch.equal(z, z0)


def _write_again_while_written(of: DiskOffloader) -> None:
    x = torch.rand(1 << 16)
    x0 = x.clone()
    calls: list[int] = []
    of.async_write(x, lambda: calls.append(1))
    of.async_write(x, lambda: calls.append(2))
    held = [storage_bytes(x)]  # not shown freed by a failing assert
    assert held == [4 << 16] and not calls
    of.sync_write_events()
    held = [storage_bytes(x)]
    assert sorted(calls) == [1, 2] and held == [0]
    assert of.stored_bytes == 4 << 16  # the earlier copy's space is given back
    of.sync_read(x)
    assert torch.equal(x, x0) and of.stored_bytes == 0
    y = torch.rand(100)
    y0 = y.clone()
    of.async_writev([x, y])
    of.async_writev([x, y])
    of.synchronize()
    of.sync_readv([x, y])
    assert torch.equal(x, x0) and torch.equal(y, y0) and of.stored_bytes == 0


def test_a_sync_call_leaves_asynchronous_operations_to_their_wait(of: DiskOffloader) -> None:
    """TensorNVMe's sync_write/sync_read move their own tensors with a plain write()/read():
    an async_write or async_read of another tensor is done (memory freed, callback run) only by
    sync_write_events()/sync_read_events()/synchronize()."""
    a, b, c = torch.rand(1000), torch.rand(10), torch.rand(20)
    a0, b0, c0 = a.clone(), b.clone(), c.clone()
    calls: list[str] = []
    of.async_write(a, lambda: calls.append("write a"))
    of.sync_write(b)
    of.sync_writev([c])
    # Byte counts taken first: a failed assert shows its operands, and showing a freed tensor
    # reads memory it no longer has.
    held = [storage_bytes(t) for t in (a, b, c)]
    assert held == [4000, 0, 0] and not calls and not of.is_offloaded(a)
    of.sync_read(b)
    held = [storage_bytes(t) for t in (a, b)]
    assert held == [4000, 40] and not calls
    of.sync_write_events()
    held = [storage_bytes(a)]
    assert calls == ["write a"] and held == [0]
    of.async_read(a, lambda: calls.append("read a"))
    of.sync_readv([c])
    assert calls == ["write a"]
    of.sync_read_events()
    assert calls == ["write a", "read a"]
    assert torch.equal(a, a0) and torch.equal(b, b0) and torch.equal(c, c0)
    # A tensor written again by a sync call: both of its writes are done when it returns.
    of.async_write(a)
    of.sync_write(a)
    held = [storage_bytes(a)]
    assert held == [0] and of.stored_bytes == 4000
    of.sync_read(a)
    assert torch.equal(a, a0) and of.stored_bytes == 0


def test_a_closed_offloader_says_so_to_every_call(disk_dir: Path) -> None:
    """After close(), reads said "Read error, tensor not found" (the offloaded tensor looked up
    first) where writes, and the native offloader, say it is closed."""
    import warnings

    for cls in (NativeOffloader, DiskOffloader):
        off = cls(str(disk_dir / cls.__module__))
        x = torch.randn(100)
        off.sync_write(x)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the data offloaded is lost: warned, as documented
            off.close()
        for call, t in (("sync_read", x), ("async_read", x), ("sync_write", torch.randn(100))):
            with pytest.raises(ValueError, match="DiskOffloader is closed"):
                getattr(off, call)(t)
