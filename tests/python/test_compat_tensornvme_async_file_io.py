"""tensortier.compat.tensornvme.AsyncFileWriter: TensorNVMe's tensornvme.async_file_io writer, as
ColossalAI's asynchronous checkpoint saving drives it (CPU tensors; CUDA paths skip)."""

from __future__ import annotations

import errno
import gc
import json
import os
import resource
import struct
import threading
from pathlib import Path

import pytest
import torch

from tensortier.compat.tensornvme import AsyncFileWriter, BackendUnavailableError

from conftest import require_backend
from faults import with_faults

DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64, torch.bool, torch.complex64]
_BACKENDS = {"uring": "io_uring", "aio": "libaio", "pthread": "threads"}


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("backend", ["uring", "aio", "pthread", None])
def test_safetensors_file_as_colossalai_writes_it(disk_dir: Path, backend: str | None) -> None:
    """ColossalAI's safetensors saving: the header's length and the header with ``write``, each
    tensor with ``write_raw`` at the writer's offset (or ``write_tensor``), then
    ``synchronize()``; the file is exactly what safetensors reads back."""
    require_backend(_BACKENDS[backend or "aio"])
    from safetensors.torch import load_file

    tensors = {f"t{i}": torch.randn(3 + 17 * i, dtype=torch.float32) for i in range(6)}
    tensors["odd"] = torch.arange(1001, dtype=torch.int16)  # unaligned size
    tensors["empty"] = torch.empty(0)
    header: dict[str, object] = {}
    offset = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        dtype = {torch.float32: "F32", torch.int16: "I16"}[t.dtype]
        header[name] = {"dtype": dtype, "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header_bytes = json.dumps(header).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    path = disk_dir / "model.safetensors"
    f_writer = AsyncFileWriter(str(path), n_entries=64, backend=backend)
    assert f_writer.write(struct.pack("<Q", len(header_bytes))) == 8
    assert f_writer.write(header_bytes) == len(header_bytes)
    for i, t in enumerate(tensors.values()):
        if i % 2:
            f_writer.write_tensor(t)
        else:
            f_writer.write_raw(t, t.data_ptr(), t.numel() * t.element_size(), f_writer.offset)
    f_writer.flush()
    f_writer.synchronize()
    assert f_writer.buffers == []
    assert f_writer.offset == path.stat().st_size == 8 + len(header_bytes) + offset
    back = load_file(str(path))
    assert back.keys() == tensors.keys()
    for name, t in tensors.items():
        assert torch.equal(back[name], t), name
    del f_writer


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_write_tensor_every_dtype(disk_dir: Path, dtype: torch.dtype) -> None:
    path = disk_dir / "t.bin"
    w = AsyncFileWriter(str(path), backend="pthread")
    t = (torch.arange(777) % 7).to(dtype)
    strided = (torch.arange(40) % 5).to(dtype).reshape(5, 8)[:, ::2]  # its values, in order
    w.register_h2d(2)
    w.write_tensor(t)
    w.write_tensor(strided)
    w.sync_before_step()
    w.synchronize()
    assert path.read_bytes() == as_bytes(t) + as_bytes(strided)
    assert w.offset == path.stat().st_size


def test_writes_side_by_side_and_the_file_is_not_truncated(disk_dir: Path) -> None:
    """Many small writes next to each other in one block (no read-modify-write between them),
    a file's bytes past the writes kept (TensorNVMe opens without O_TRUNC), and a new file
    made with mode 0664 less the umask."""
    path = disk_dir / "kept.bin"
    path.write_bytes(b"#" * 10_000)
    w = AsyncFileWriter(str(path), n_entries=8, backend="pthread")
    pieces = [bytes([i % 251]) * (1 + i % 5) for i in range(1000)]
    for piece in pieces:
        w.write(bytearray(piece))
    w.synchronize()
    written = b"".join(pieces)
    assert path.read_bytes() == written + b"#" * (10_000 - len(written))
    del w
    umask = os.umask(0)
    os.umask(umask)
    fresh = disk_dir / "fresh.bin"
    w = AsyncFileWriter(str(fresh), backend="pthread")
    w.write(b"")
    w.synchronize()
    assert fresh.stat().st_size == 0 and fresh.stat().st_mode & 0o777 == 0o664 & ~umask


def test_callbacks_run_at_synchronize_and_free_the_sources(disk_dir: Path) -> None:
    w = AsyncFileWriter(str(disk_dir / "c.bin"), backend="pthread")
    done: list[int] = []
    w.write(b"abc")
    t = torch.ones(100)
    w.io.write_tensor(t, 3, lambda: done.append(1))
    w.io.write(t.data_ptr(), 8, 403, lambda: done.append(2))
    assert w.buffers == [b"abc"]
    w.io.synchronize()
    assert done == [1, 2] and w.buffers == [None]

    def fails() -> None:
        raise KeyError("callback")

    w.io.write(t.data_ptr(), 4, 0, fails)
    w.io.write(t.data_ptr(), 4, 4, lambda: done.append(3))
    with pytest.raises(KeyError):
        w.synchronize()
    w.synchronize()  # the callback after the failed one runs now
    assert done == [1, 2, 3]


def test_a_failed_write_raises_from_synchronize() -> None:
    """/dev/full refuses every write (ENOSPC): TensorNVMe ignores it; this raises OSError,
    naming the file (not the descriptor's /proc link)."""
    w = AsyncFileWriter("/dev/full", backend="pthread")
    w.write(b"x" * 5000)
    with pytest.raises(OSError) as raised:
        w.synchronize()
    assert raised.value.errno == errno.ENOSPC
    assert raised.value.filename == "/dev/full" and "/proc" not in str(raised.value)
    w.synchronize()  # nothing left


def test_a_forked_child_s_writer_refuses_by_name_and_drops_quietly(disk_dir: Path) -> None:
    """In a child made by fork (a DataLoader worker) the writer's writes are the parent's: a
    write there is a ValueError naming the AsyncFileWriter and its file (not an IOHandle the
    user never made), and dropping the child's copy prints no traceback; the parent's file is
    whole."""
    import subprocess
    import sys

    path = disk_dir / "w.bin"
    code = f"""
import os, sys, torch
from tensortier.compat.tensornvme import AsyncFileWriter
w = AsyncFileWriter({str(path)!r}, backend="pthread")
t = torch.arange(1 << 18, dtype=torch.float32)
w.write_tensor(t)
pid = os.fork()
if pid == 0:
    try:
        w.write(b"child")
        code = 3
    except ValueError as e:
        code = 0 if "AsyncFileWriter of" in str(e) and "a child made by fork()" in str(e) else 4
    del w
    sys.stderr.flush()
    os._exit(code)
_, status = os.waitpid(pid, 0)
w.synchronize()
del w
sys.exit(os.waitstatus_to_exitcode(status))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "Exception ignored" not in r.stderr, (r.returncode, r.stderr)
    assert path.read_bytes() == torch.arange(1 << 18, dtype=torch.float32).numpy().tobytes()


def test_the_writer_names_the_file_of_its_descriptor(disk_dir: Path) -> None:
    """TensorNVMe's C++ writer takes a descriptor; ours names its file (renamed since, too),
    or the descriptor's number when it is not open."""
    from tensortier.compat.tensornvme import _AsyncFileWriterCore

    path, moved = disk_dir / "n.bin", disk_dir / "renamed.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o664)
    try:
        os.rename(path, moved)
        core = _AsyncFileWriterCore(fd, 8, backend="pthread")
        try:
            assert core._file.path == str(moved)  # noqa: SLF001
            core.write(0, 0, 0)
            core.synchronize()
        finally:
            core.close()
    finally:
        os.close(fd)
    never_open = resource.getrlimit(resource.RLIMIT_NOFILE)[0]  # descriptors are below it
    with pytest.raises(OSError) as raised:
        _AsyncFileWriterCore(never_open, 8, backend="pthread")
    assert raised.value.errno == errno.EBADF and raised.value.filename == f"fd {never_open}"


def test_errors_are_tensornvme_s(disk_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(FileNotFoundError):
        AsyncFileWriter(str(disk_dir / "missing" / "f.bin"))
    for backend in ("bogus", "", "URING"):
        with pytest.raises(RuntimeError, match="backend"):
            AsyncFileWriter(str(disk_dir / "b.bin"), backend=backend)
    for n_entries in (-1, 1 << 32, 8.0, None):
        with pytest.raises(TypeError, match="n_entries"):
            AsyncFileWriter(str(disk_dir / "b.bin"), n_entries, backend="pthread")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="n_tasks"):
        AsyncFileWriter(str(disk_dir / "b.bin"), backend="pthread", n_tasks=-1)
    w = AsyncFileWriter(str(disk_dir / "b.bin"), 0, backend="pthread", n_tasks=3)
    for value in (-1, 1.5):
        with pytest.raises(TypeError, match="offset"):
            w.io.write(0, 0, value)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        w.write("text")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        w.write_tensor([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="null"):
        w.io.write(0, 8, 0)
    w.register_tasks(5)
    w.synchronize()
    assert w.offset == 0 and (disk_dir / "b.bin").stat().st_size == 0
    # TENSORNVME_BACKEND takes the place of the argument, as with TensorNVMe.
    monkeypatch.setenv("TENSORNVME_BACKEND", "bogus")
    with pytest.raises(RuntimeError, match="bogus"):
        AsyncFileWriter(str(disk_dir / "b.bin"), backend="pthread")
    monkeypatch.setenv("TENSORNVME_BACKEND", "pthread")
    w = AsyncFileWriter(str(disk_dir / "b.bin"), backend="uring")
    assert w.io._io.backend == "threads"  # noqa: SLF001
    assert issubclass(BackendUnavailableError, RuntimeError)


def test_dropping_the_writer_waits_and_closes_its_descriptor(disk_dir: Path) -> None:
    path = disk_dir / "d.bin"
    w = AsyncFileWriter(str(path), backend="pthread")
    fd = w.fd
    data = os.urandom(300_001)
    w.write(data)
    del w
    gc.collect()
    assert path.read_bytes() == data
    with pytest.raises(OSError) as raised:
        os.fstat(fd)
    assert raised.value.errno == errno.EBADF


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensor_through_pinned(disk_dir: Path) -> None:
    path = disk_dir / "g.bin"
    w = AsyncFileWriter(str(path), backend="pthread")
    t = torch.arange(1000, dtype=torch.float32, device="cuda")
    pinned = torch.empty(1000, dtype=torch.float32, pin_memory=True)
    w.register_h2d(2)
    w.write_tensor(t, pinned)
    w.write_tensor(t * 2)
    w.sync_before_step()
    t.zero_()
    w.synchronize()
    assert path.read_bytes() == as_bytes(torch.arange(1000.0)) + as_bytes(torch.arange(1000.0) * 2)


def test_an_interrupted_synchronize_leaves_the_writes_to_the_next(disk_dir: Path, alarm_interrupt) -> None:  # type: ignore[no-untyped-def]
    """Ctrl-C in synchronize() stops the wait, not the writes: the next synchronize() waits for
    them and runs their callbacks, in order."""
    from tensortier import IOHandle

    path = disk_dir / "slow.bin"
    w = AsyncFileWriter(str(path), backend="pthread")
    w.io._io.close()  # the engine with its first request delayed (the fault-injecting backend)
    w.io._io = with_faults({"kind": "delay", "delay_us": 1_500_000, "nth": 1}, IOHandle, "threads")
    done: list[int] = []
    t = torch.arange(1000, dtype=torch.int32)
    w.io.write_tensor(t, 0, lambda: done.append(1))
    w.io.write_tensor(t[:10], 4000, lambda: done.append(2))
    alarm_interrupt(0.3)
    with pytest.raises(KeyboardInterrupt):
        w.synchronize()
    assert done == []
    w.synchronize()
    assert done == [1, 2]
    assert path.read_bytes() == as_bytes(t) + as_bytes(t[:10])
    del w
    gc.collect()


def test_writes_from_one_thread_while_another_synchronizes(disk_dir: Path) -> None:
    """A thread's write while another thread's synchronize() waits: the wait goes on over a
    list that grows under it (and waits for the new writes too); every byte lands. (Through the
    C++ writer: TensorNVMe's Python writer keeps its sources in a list that synchronize() clears,
    which is not for two threads.)"""
    path = disk_dir / "shared.bin"
    w = AsyncFileWriter(str(path), backend="pthread")
    block = bytes(range(256)) * 16
    count = 2000
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            for i in range(count):
                w.io._start(block, i * len(block), None)  # noqa: SLF001 - the C++ writer
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        while thread.is_alive():
            w.synchronize()
    finally:
        thread.join(60)
    w.synchronize()
    assert not errors
    assert path.stat().st_size == count * len(block)
    assert path.read_bytes() == block * count
    del w
    gc.collect()


@pytest.mark.parametrize("backend", ["uring", "aio", "pthread"])
def test_a_writer_takes_few_threads(disk_dir: Path, backend: str) -> None:
    """ColossalAI keeps a writer per shard alive until the next step: each takes about what
    TensorNVMe's does (a ring, or a pool of 8 threads), not a pool per queue entry."""
    require_backend(_BACKENDS[backend])

    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    before = threads()
    writers = [AsyncFileWriter(str(disk_dir / f"s{i}.bin"), n_entries=32, backend=backend)
               for i in range(4)]
    for w in writers:
        w.write(b"x" * 4096)
    for w in writers:
        w.synchronize()
    assert threads() - before <= 4 * 16, threads() - before
    del writers
    gc.collect()


def test_a_writer_cannot_be_copied(disk_dir: Path) -> None:
    """A copy would share the descriptor, and dropping it would close it under the original:
    TypeError, as TensorNVMe's binding cannot be copied either; the writer goes on."""
    import copy

    path = disk_dir / "w.bin"
    w = AsyncFileWriter(str(path), backend="pthread")
    for copier in (copy.copy, copy.deepcopy):
        with pytest.raises(TypeError, match="AsyncFileWriter cannot be pickled or copied: it "
                                            "owns its file.s descriptor"):
            copier(w)
    w.write(b"still open")
    w.synchronize()
    assert path.read_bytes() == b"still open"
