"""tensortier.compat.deepnvme: DeepNVMe's aio_handle API on host tensors."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tensortier.compat.deepnvme import AsyncIOBuilder, GDSBuilder, PinMemoryBuilder, aio_read
from test_fake_driver import fake_driver, run_with_fake  # noqa: F401 - a fixture
from faults import with_faults
from conftest import exits_cleanly, INTERRUPTED_CALLS

DTYPES = [torch.uint8, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32,
          torch.float64, torch.bool, torch.complex64]


@pytest.fixture
def handle():  # type: ignore[no-untyped-def]
    h = AsyncIOBuilder().load().aio_handle(1024**2, 128, True, True, 1)
    yield h
    h.close()


def test_builder_and_settings() -> None:
    assert AsyncIOBuilder().is_compatible()
    h = AsyncIOBuilder().load().aio_handle(block_size=256 * 1024, queue_depth=16,
                                           single_submit=False, overlap_events=True,
                                           intra_op_parallelism=2)
    assert h.get_block_size() == 256 * 1024
    assert h.get_queue_depth() == 16
    assert h.get_single_submit() is False
    assert h.get_overlap_events() is True
    assert h.get_intra_op_parallelism() == 2 == h.get_thread_count()
    h.close()
    with pytest.raises(ValueError, match="queue_depth"):
        AsyncIOBuilder().load().aio_handle(1 << 20, 0, True, True, 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sync_round_trip_every_dtype(handle, disk_dir: Path, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    raw = torch.randint(0, 256, (1_000_003 * 2,), dtype=torch.uint8)
    size = torch.empty((), dtype=dtype).element_size()
    t = raw[: (raw.numel() // size) * size].view(dtype).clone()
    if dtype == torch.bool:
        t = raw[:1000].bool()
    path = str(disk_dir / "t.bin")
    assert handle.sync_pwrite(t, path) == 1
    assert os.path.getsize(path) == t.numel() * size
    u = torch.empty_like(t)
    assert handle.sync_pread(u, path) == 1
    assert torch.equal(u.view(torch.uint8), t.view(torch.uint8))


def test_offsets_async_and_wait_count(handle, disk_dir: Path) -> None:  # type: ignore[no-untyped-def]
    path = str(disk_dir / "t.bin")
    parts = [torch.full((1000 + i,), float(i)) for i in range(5)]
    offset = 0
    offsets = []
    for p in parts:
        offsets.append(offset)
        assert handle.async_pwrite(p, path, offset) == 0
        offset += p.numel() * 4 + 7  # unaligned offsets
    assert handle.wait() == 5
    outs = [torch.empty_like(p) for p in parts]
    for o, off in zip(outs, offsets):
        handle.async_pread(o, path, off)
    assert handle.wait() == 5
    for o, p in zip(outs, parts):
        assert torch.equal(o, p)


@pytest.mark.parametrize("builder", [AsyncIOBuilder, GDSBuilder])
def test_overlapping_operations_on_one_handle_keep_their_order(disk_dir: Path, builder: Any) -> None:
    """DeepNVMe's workers take operations first in, first out: on one handle, with several
    workers, a later write to the same bytes wins and a read sees the writes started before it
    (the engine would run them side by side; an overlapping one waits for the earlier)."""
    h = builder().load().aio_handle(intra_op_parallelism=4) if builder is AsyncIOBuilder \
        else builder().load().gds_handle(intra_op_parallelism=4)
    path = str(disk_dir / "order.bin")
    n = 1 << 18  # 1 MiB of float32: split over the workers
    a = h.new_cpu_locked_tensor(n, torch.empty(0)).fill_(1.0)
    b = h.new_cpu_locked_tensor(n, torch.empty(0)).fill_(2.0)
    back = torch.zeros(n)
    for _ in range(20):
        assert h.async_pwrite(a, path) == 0 and h.async_pwrite(b, path) == 0
        assert h.wait() == 2
        h.sync_pread(back, path)
        assert torch.all(back == 2.0)
        assert h.async_pwrite(a, path) == 0 and h.async_pread(back, path) == 0
        assert h.wait() == 2 and torch.all(back == 1.0)
        assert h.async_pwrite(b, path) == 0
        assert h.sync_pwrite(a, path) == 2  # counts the async one too, as DeepNVMe's does
        h.sync_pread(back, path)
        assert torch.all(back == 1.0)
    # Disjoint ranges still run side by side: no order to keep.
    assert h.async_pwrite(a, path, 0) == 0 and h.async_pwrite(b, path, 4 * n) == 0
    assert h.wait() == 2
    h.free_cpu_locked_tensor(a)
    h.free_cpu_locked_tensor(b)


def test_read_and_write_leave_the_async_operations_to_wait(handle, disk_dir: Path) -> None:  # type: ignore[no-untyped-def]
    """read()/write() run on their own, as DeepNVMe's do on the handle's own context: the
    async operations started before are still counted by the next wait()."""
    path = str(disk_dir / "own.bin")
    data = torch.arange(4096, dtype=torch.float32)
    handle.sync_pwrite(data, path)
    outs = [torch.zeros(4096), torch.zeros(4096)]
    for o in outs:
        assert handle.async_pread(o, path) == 0
    assert handle.read(torch.zeros(4096), path, False) == 0
    assert handle.write(data, str(disk_dir / "other.bin"), False) == 0
    assert handle.wait() == 2
    assert all(torch.equal(o, data) for o in outs)


def test_validate_of_a_read_past_the_end_compares_what_the_file_holds(handle, disk_dir: Path) -> None:  # type: ignore[no-untyped-def]
    """A buffer longer than the file is a legal read (DeepNVMe reads whole blocks); validation
    compares the bytes the file holds, not the rest of the buffer."""
    path = str(disk_dir / "short.bin")
    handle.sync_pwrite(torch.arange(1000, dtype=torch.int32), path)
    buf = torch.zeros(4096, dtype=torch.int32)
    assert handle.sync_pread(buf, path) == 1
    assert handle.pread(buf, path, True, False) == 1
    assert handle.pread(buf, path, True, True) == 0 and handle.wait() == 1
    assert torch.equal(buf[:1000], torch.arange(1000, dtype=torch.int32))


def test_write_does_not_truncate_and_read_write_whole_file(handle, disk_dir: Path) -> None:  # type: ignore[no-untyped-def]
    path = str(disk_dir / "t.bin")
    big = torch.arange(10_000, dtype=torch.int32)
    handle.sync_pwrite(big, path)
    handle.sync_pwrite(torch.tensor([-1], dtype=torch.int32), path, 4)
    back = torch.empty_like(big)
    handle.sync_pread(back, path)
    expect = big.clone()
    expect[1] = -1
    assert torch.equal(back, expect)
    # write() (DeepNVMe's O_WRONLY | O_CREAT, no O_TRUNC) keeps the bytes past it; both it and
    # read() return 0, as DeepNVMe's; read() at offset 0 needs the file's exact size.
    small = torch.arange(10, dtype=torch.int32)
    assert handle.write(small, path, True) == 0
    assert os.path.getsize(path) == 40_000
    back = torch.empty_like(big)
    assert handle.read(back, path, True) == 0
    expect[:10] = small
    assert torch.equal(back, expect)
    with pytest.raises(ValueError, match="holds 40000 bytes"):
        handle.read(torch.empty(11, dtype=torch.int32), path, False)
    # file_offset, by position and by name.
    assert handle.write(small, path, False, 400) == 0
    got = torch.empty_like(small)
    assert handle.read(got, path, True, file_offset=400) == 0 and torch.equal(got, small)
    assert handle.write(small + 1, path, False, file_offset=800) == 0
    assert handle.read(got, path, False, 800) == 0 and torch.equal(got, small + 1)
    fresh = str(disk_dir / "fresh.bin")
    assert handle.write(small, fresh, False) == 0 and os.path.getsize(fresh) == 40


def test_validate_detects_a_mismatch(handle, disk_dir: Path) -> None:  # type: ignore[no-untyped-def]
    path = str(disk_dir / "t.bin")
    t = torch.arange(1000, dtype=torch.int64)
    assert handle.pwrite(t, path, True, False) == 1
    u = torch.empty_like(t)
    assert handle.pread(u, path, True, False) == 1 and torch.equal(u, t)
    # An async validated read: the file changes after the data arrived, before wait() checks.
    handle.pread(u, path, True, True)
    handle._pending[0][0].wait()
    with open(path, "r+b") as f:
        f.write(b"\xff" * 8)
    with pytest.raises(OSError) as e:
        handle.wait()
    assert e.value.errno == errno.EIO and "validation failed" in str(e.value)


def test_files_that_cannot_be_opened_return_minus_one(handle, disk_dir: Path) -> None:  # type: ignore[no-untyped-def]
    """DeepNVMe's calls return -1 (and print why) for a file they cannot stat or open; nothing
    starts, so the next wait() counts nothing of them."""
    missing = str(disk_dir / "missing.bin")
    nowhere = str(disk_dir / "no-such-dir" / "x.bin")
    t = torch.arange(10, dtype=torch.float32)
    calls = [
        lambda: handle.sync_pread(torch.empty(10), missing),
        lambda: handle.async_pread(torch.empty(10), missing),
        lambda: handle.pread(torch.empty(10), missing, False, True),
        lambda: handle.read(torch.empty(10), missing, False),
        lambda: aio_read(torch.empty(10), missing, 1 << 20, 8, False, False, False),
        lambda: handle.sync_pwrite(t, nowhere),
        lambda: handle.async_pwrite(t, nowhere),
        lambda: handle.pwrite(t, nowhere, False, False),
        lambda: handle.write(t, nowhere, False),
    ]
    for call in calls:
        with pytest.warns(RuntimeWarning, match="deepspeed_aio: .* failed on .* error = 2"):
            assert call() == -1
    assert handle.wait() == 0 and not os.path.exists(missing)
    # A directory: DeepNVMe's open fails, for reads (O_DIRECT: EINVAL) as for writes (EISDIR).
    folder = str(disk_dir)
    for call, code in [(lambda: handle.sync_pread(torch.empty(10), folder), 22),
                       (lambda: handle.async_pread(torch.empty(10), folder), 22),
                       (lambda: handle.sync_pwrite(t, folder), 21)]:
        with pytest.warns(RuntimeWarning, match=f"deepspeed_aio: .* failed on .* error = {code}"):
            assert call() == -1
    assert handle.wait() == 0


def test_misuse_gets_deepnvme_s_answer(handle, disk_dir: Path) -> None:  # type: ignore[no-untyped-def]
    path = str(disk_dir / "short.bin")
    handle.sync_pwrite(torch.arange(10, dtype=torch.float32), path)
    # A buffer larger than the file (DeepNVMe allows it, for alignment): what the file holds.
    big = torch.full((16,), -1.0)
    assert handle.sync_pread(big, path) == 1
    assert torch.equal(big[:10], torch.arange(10, dtype=torch.float32))
    assert big[10:].eq(-1).all()
    assert handle.sync_pread(big, path, 4096) == 1 and big[10:].eq(-1).all()  # wholly past it
    with pytest.raises(TypeError):
        handle.sync_pwrite(bytearray(10), path)
    with pytest.raises(TypeError):
        handle.sync_pwrite(torch.empty(10), path, 1.5)
    with pytest.raises(TypeError, match="filename"):
        handle.sync_pread(torch.empty(10), 3)  # descriptors are for async_pwrite only
    with pytest.raises(TypeError, match="filename"):
        handle.sync_pread(torch.empty(10), 5, -1)  # the file is checked first, as DeepNVMe does
    with pytest.warns(RuntimeWarning, match="deepspeed_aio"):
        assert handle.sync_pread(torch.empty(10), path + ".missing", -1) == -1
    with pytest.raises(ValueError, match="file_offset"):
        handle.sync_pwrite(torch.empty(10), path, -1)  # DeepNVMe aborts the process


@pytest.mark.parametrize("call", ["sync", "async", "pread"])
def test_non_contiguous_tensors_move_through_a_copy(handle, disk_dir: Path, call: str) -> None:  # type: ignore[no-untyped-def]
    """As DeepNVMe's bounce buffer: the tensor's elements in order, whatever its strides."""
    path = str(disk_dir / "t.bin")
    src = torch.arange(64, dtype=torch.int32).reshape(8, 8).t()
    back = torch.zeros(8, 8, dtype=torch.int32).t()
    if call == "sync":
        assert handle.sync_pwrite(src, path) == 1
        assert handle.sync_pread(back, path) == 1
    elif call == "async":
        assert handle.async_pwrite(src, path) == 0
        assert handle.wait() == 1
        assert handle.async_pread(back, path) == 0
        assert handle.wait() == 1
    else:
        assert handle.pwrite(src, path, True, False) == 1
        assert handle.pread(back, path, True, False) == 1
    assert torch.equal(back, src) and not back.is_contiguous()
    with open(path, "rb") as f:
        assert f.read() == src.contiguous().numpy().tobytes()


def test_locked_tensors(handle, resident_bytes) -> None:  # type: ignore[no-untyped-def]
    t = handle.new_cpu_locked_tensor(12345, torch.empty(0, dtype=torch.float16))
    assert t.shape == (12345,) and t.dtype == torch.float16
    if torch.cuda.is_available():
        assert t.is_pinned()
    else:  # page-aligned, every page in memory before first use (DeepNVMe mlocks them)
        assert t.data_ptr() % 4096 == 0
        assert resident_bytes(t) == -(-t.numel() * 2 // 4096) * 4096
    # Views of a locked tensor are locked too (DeepNVMe checks the range); others are not.
    assert handle.is_pinned(t) and handle.is_pinned(t[100:])
    other = torch.ones(10)
    assert not handle.is_pinned(other)
    # Only the handle's own tensors are freed: any other is left alone (DeepNVMe returns False).
    assert handle.free_cpu_locked_tensor(other) is False
    assert other.sum().item() == 10
    assert handle.free_cpu_locked_tensor(t[1:]) is False
    assert handle.free_cpu_locked_tensor(t) is True
    assert handle.free_cpu_locked_tensor(t) is False  # once
    # DeepSpeed's keyword spelling.
    u = handle.new_cpu_locked_tensor(8, example_tenosr=torch.empty(0, dtype=torch.int64))
    assert u.dtype == torch.int64 and handle.free_cpu_locked_tensor(u)
    with pytest.raises(TypeError, match="example_tensor"):
        handle.new_cpu_locked_tensor(8)
    with pytest.raises(TypeError, match="example_tensor"):  # as DeepSpeed's binding refuses it
        handle.new_cpu_locked_tensor(8, 5)


def test_async_write_copies_unlocked_tensors_first(handle, disk_dir: Path) -> None:  # type: ignore[no-untyped-def]
    """DeepNVMe copies a buffer that is not locked memory when an async write is submitted, and
    DeepSpeed reuses such buffers before wait(): the file gets the bytes of the call."""
    path = str(disk_dir / "snap.bin")
    n = 8 << 20  # 32 MiB of int32: the write is still running when the tensor changes
    plain = torch.arange(n, dtype=torch.int32)
    assert handle.async_pwrite(plain, path) == 0
    assert handle._pending[0][1] is not plain  # a copy, whatever the disk's speed
    plain.fill_(7)
    assert handle.pwrite(plain[:1000], path, False, True, 4 * n) == 0  # pwrite(async=True)
    plain[:1000].fill_(8)
    assert handle.wait() == 2
    back = torch.empty(n + 1000, dtype=torch.int32)
    handle.sync_pread(back, path)
    assert torch.equal(back[:n], torch.arange(n, dtype=torch.int32))
    assert torch.equal(back[n:], torch.full((1000,), 7, dtype=torch.int32))
    # A locked tensor is written in place (no copy): it must stay unchanged until wait().
    locked = handle.new_cpu_locked_tensor(1000, torch.empty(0, dtype=torch.int32))
    locked.copy_(torch.arange(1000, dtype=torch.int32))
    assert handle.async_pwrite(locked, path) == 0
    assert handle._pending[0][1] is locked  # the handle's own memory, not a copy
    assert handle.wait() == 1
    handle.free_cpu_locked_tensor(locked)


def test_async_pwrite_to_an_open_descriptor(handle, disk_dir: Path) -> None:  # type: ignore[no-untyped-def]
    """DeepSpeed's FastFileWriter passes its own descriptor: written at the offset, left open."""
    path = disk_dir / "fd.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        t = torch.arange(3000, dtype=torch.int16)
        assert handle.async_pwrite(t, fd, 4096) == 0
        assert handle.async_pwrite(t[:10], fd) == 0
        assert handle.wait() == 2
        os.fstat(fd)  # still open
        os.write(fd, b"")  # and usable
    finally:
        os.close(fd)
    data = path.read_bytes()
    assert len(data) == 4096 + 6000
    assert data[:20] == t[:10].numpy().tobytes() and data[4096:] == t.numpy().tobytes()
    with pytest.raises(OSError) as e:
        handle.async_pwrite(t, fd)  # closed now
    assert e.value.errno == errno.EBADF and f"descriptor {fd}" in str(e.value)
    ro = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError) as e:
            handle.async_pwrite(t, ro)  # as a write(2) to it would
        assert e.value.errno == errno.EBADF and "read-only" in str(e.value)
    finally:
        os.close(ro)


def test_async_pwrite_fd_keyword_and_integer_types(handle, disk_dir: Path) -> None:  # type: ignore[no-untyped-def]
    """DeepSpeed's second overload, ``async_pwrite(buffer=, fd=, file_offset=)`` (its
    test_offset_write), and numpy/torch integers wherever its pybind11 bindings take ints."""
    np = pytest.importorskip("numpy")
    path = disk_dir / "fd.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    t = torch.arange(1000, dtype=torch.int32)
    try:
        assert handle.async_pwrite(buffer=t, fd=fd, file_offset=np.int64(512)) == 0
        assert handle.async_pwrite(t[:4], np.int32(fd)) == 0  # a descriptor by position
        assert handle.wait() == 2
    finally:
        os.close(fd)
    data = path.read_bytes()
    assert data[:16] == t[:4].numpy().tobytes() and data[512:] == t.numpy().tobytes()
    u = torch.empty(1000, dtype=torch.int32)
    assert handle.sync_pread(u, str(path), torch.tensor(512)) == 1 and torch.equal(u, t)
    with pytest.raises(TypeError, match="one of them"):
        handle.async_pwrite(t, str(path), fd=fd)
    with pytest.raises(TypeError, match="one of them"):
        handle.async_pwrite(t)
    with pytest.raises(TypeError, match="file_offset"):
        handle.sync_pread(u, str(path), 512.0)
    h = AsyncIOBuilder().load().aio_handle(np.int64(1 << 16), np.int64(8), False, False,
                                           np.int64(2))
    assert (h.get_block_size(), h.get_queue_depth(), h.get_intra_op_parallelism()) == (
        1 << 16, 8, 2)
    h.close()
    with pytest.raises(TypeError, match="block_size"):
        AsyncIOBuilder().load().aio_handle(1.5, 8, False, False, 1)


def test_new_files_are_their_owners_only_as_deepnvme_makes_them(handle, disk_dir: Path) -> None:  # type: ignore[no-untyped-def]
    """DeepNVMe opens files to write with mode 0600: swapped model state is not world-readable.
    An existing file keeps its mode."""
    path = disk_dir / "new.bin"
    handle.sync_pwrite(torch.ones(100), str(path))
    assert path.stat().st_mode & 0o777 == 0o600
    old = disk_dir / "old.bin"
    old.write_bytes(b"x" * 400)
    old.chmod(0o644)
    handle.sync_pwrite(torch.ones(100), str(old))
    assert old.stat().st_mode & 0o777 == 0o644


_WRITE_ONLY_CHILD = """
import os, sys, torch
from tensortier.compat.deepnvme import AsyncIOBuilder
path = sys.argv[1]
if os.geteuid() == 0:  # after the imports: the packages may lie where nobody cannot read
    os.setgid(65534)
    os.setuid(65534)
    if not os.access(os.path.dirname(path), os.X_OK):
        sys.exit(77)
h = AsyncIOBuilder().load().aio_handle(1 << 20, 8, False, False, 1)
h.sync_pwrite(torch.arange(2048, dtype=torch.int16), path, 4096)
import warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    # DeepNVMe's answer: stat works, the open for read does not: -1.
    if h.sync_pread(torch.empty(10), path) != -1:
        sys.exit("a read of a file we may not read did not return -1")
if not any("open for read failed" in str(w.message) for w in caught):
    sys.exit(f"no warning naming the failed open: {[str(w.message) for w in caught]}")
h.close()
"""


def test_a_file_we_may_write_but_not_read_is_written(disk_dir: Path) -> None:
    """DeepNVMe opens O_WRONLY: a file of mode 0222 takes writes. (Root reads anything: the
    child drops to nobody.)"""
    import subprocess
    import sys

    disk_dir.chmod(0o755)
    path = disk_dir / "wo.bin"
    path.write_bytes(b"\0" * 8192)
    path.chmod(0o222)
    proc = subprocess.run([sys.executable, "-c", _WRITE_ONLY_CHILD, str(path)],
                          capture_output=True, text=True)
    if proc.returncode == 77:
        pytest.skip(f"nobody cannot reach {disk_dir} (a parent directory is private)")
    assert proc.returncode == 0, proc.stderr[-2000:]
    path.chmod(0o644)
    data = path.read_bytes()
    assert data[:4096] == b"\0" * 4096
    assert data[4096:] == torch.arange(2048, dtype=torch.int16).numpy().tobytes()


def test_deepspeed_spellings(disk_dir: Path) -> None:
    """What DeepSpeed's own code passes: queue depth 128 by default, get_alignment(), ``async``
    by keyword, the older ``num_threads``, the module's one-shot functions."""
    mod = AsyncIOBuilder().load()
    h = mod.aio_handle()
    assert h.get_queue_depth() == 128 and h.get_block_size() == 1 << 20
    assert h.get_alignment() == 512
    h.close()
    h = mod.aio_handle(1 << 20, 32, False, False, num_threads=4)
    assert h.get_intra_op_parallelism() == 4 and h.get_alignment() == 2048
    path = str(disk_dir / "k.bin")
    t = torch.arange(100, dtype=torch.float32)
    assert h.pwrite(t, path, False, **{"async": False}) == 1
    u = torch.empty_like(t)
    assert h.pread(u, path, False, **{"async": True}) == 0 and h.wait() == 1
    assert torch.equal(u, t)
    with pytest.raises(TypeError, match="async"):
        h.pread(u, path, False)
    with pytest.raises(TypeError, match="unexpected"):
        h.pread(u, path, False, True, bogus=1)
    h.close()
    assert mod.aio_write(t * 2, path, 1 << 20, 8, False, False, True) == 0
    assert mod.aio_read(u, path, 1 << 20, 8, False, False, True) == 0
    assert torch.equal(u, t * 2)
    v = torch.empty(10, 10)
    assert mod.deepspeed_memcpy(v, t) == 0 and torch.equal(v.reshape(-1), t)


@pytest.mark.parametrize(
    "settings",
    [((1 << 31) - 1, 8, 1), ((1 << 30) + 1, 1, 1), (1 << 16, 8192, 1), (1 << 16, 1, 257)],
    ids=["block_size_2G", "block_size_1G_plus_1", "queue_depth_8192", "parallelism_257"],
)
def test_settings_past_the_engine_s_limits_work_as_deepnvme_s(
    disk_dir: Path, settings: tuple[int, int, int]
) -> None:
    """DeepNVMe takes any C int for block_size, queue_depth and intra_op_parallelism: so does
    the handle (the engine runs with its nearest limits), and answers what was given."""
    block_size, queue_depth, parallelism = settings
    for make in (AsyncIOBuilder().load().aio_handle, GDSBuilder().load().gds_handle):
        h = make(block_size, queue_depth, False, False, parallelism)
        try:
            assert (h.get_block_size(), h.get_queue_depth(), h.get_intra_op_parallelism()) == (
                block_size, queue_depth, parallelism)
            path = str(disk_dir / "limits.bin")
            t = torch.arange(100_003, dtype=torch.int16)  # unaligned size
            assert h.sync_pwrite(t, path) == 1
            u = torch.empty_like(t)
            assert h.async_pread(u, path) == 0 and h.wait() == 1
            assert torch.equal(u, t)
        finally:
            h.close()


def test_settings_deepnvme_s_binding_refuses() -> None:
    """Past a C int, DeepSpeed's pybind11 binding refuses the constructor: TypeError."""
    for make in (AsyncIOBuilder().load().aio_handle, GDSBuilder().load().gds_handle):
        for position, name in ((0, "block_size"), (1, "queue_depth"),
                               (4, "intra_op_parallelism")):
            for value in (1 << 31, -(1 << 31) - 1, 1 << 64):
                args: list[object] = [1 << 20, 8, False, False, 1]
                args[position] = value
                with pytest.raises(TypeError, match=name):
                    make(*args)


def test_gds_handle_alignment_is_deepnvme_s() -> None:
    """DeepNVMe's gds_handle gives its host I/O one thread: get_alignment() is 512 whatever its
    intra_op_parallelism (aio_handle's is parallelism x 512)."""
    for parallelism in (1, 4, 16):
        g = GDSBuilder().load().gds_handle(1 << 20, 8, False, False, parallelism)
        a = AsyncIOBuilder().load().aio_handle(1 << 20, 8, False, False, parallelism)
        try:
            assert g.get_alignment() == 512
            assert g.get_intra_op_parallelism() == parallelism
            assert a.get_alignment() == 512 * parallelism
        finally:
            g.close()
            a.close()


def test_gds_handle_moves_host_tensors_and_rejects_pinning_them(disk_dir: Path) -> None:
    h = GDSBuilder().load().gds_handle(1 << 20, 32, True, True, 1)
    t = torch.randn(1000)
    path = str(disk_dir / "g.bin")
    h.sync_pwrite(t, path)
    u = torch.empty_like(t)
    h.sync_pread(u, path)
    assert torch.equal(t, u)
    with pytest.raises(ValueError, match="not a GPU"):
        h.pin_device_tensor(t)
    assert h.unpin_device_tensor(t) is True  # never pinned: nothing to undo
    assert h.get_alignment() == 512
    h.close()


@pytest.mark.parametrize("call", ["sync_pwrite", "pwrite", "write"])
def test_only_async_pwrite_takes_a_descriptor(handle, disk_dir: Path, call: str) -> None:  # type: ignore[no-untyped-def]
    """DeepNVMe's sync_pwrite/pwrite/write take a file name (a C string): an int there is its
    binding's TypeError, never a write into whatever file that descriptor number holds."""
    path = disk_dir / "victim.bin"
    path.write_bytes(b"k" * 64)
    fd = os.open(path, os.O_WRONLY)
    try:
        args = {"sync_pwrite": (), "pwrite": (False, False), "write": (False,)}[call]
        with pytest.raises(TypeError, match="filename"):
            getattr(handle, call)(torch.zeros(16, dtype=torch.uint8), fd, *args)
        with pytest.raises(TypeError, match="filename"):
            getattr(handle, call)(torch.zeros(16, dtype=torch.uint8), None, *args)
    finally:
        os.close(fd)
    assert handle.wait() == 0
    assert path.read_bytes() == b"k" * 64


def test_what_is_no_tensor_is_a_type_error_for_the_locked_tensor_calls(handle) -> None:  # type: ignore[no-untyped-def]
    """DeepNVMe's binding takes a torch.Tensor in is_pinned and free_cpu_locked_tensor: anything
    else is its TypeError (not an AttributeError from deep inside)."""
    np = pytest.importorskip("numpy")
    for value in (None, 3, np.zeros(3), [torch.zeros(3)]):
        with pytest.raises(TypeError, match="tensor"):
            handle.is_pinned(value)
        with pytest.raises(TypeError, match="tensor"):
            handle.free_cpu_locked_tensor(value)


def test_integers_past_the_binding_s_c_types_are_type_errors(handle, disk_dir: Path) -> None:  # type: ignore[no-untyped-def]
    """file_offset is an int64_t and the descriptor a C int in DeepNVMe's binding: pybind11
    refuses a Python int outside them with a TypeError (a negative offset that fits stays our
    ValueError: DeepNVMe takes it and aborts)."""
    path = str(disk_dir / "t.bin")
    t = torch.zeros(8, dtype=torch.uint8)
    for offset in (1 << 63, 1 << 64, -(1 << 63) - 1):
        for call in (handle.sync_pread, handle.sync_pwrite, handle.async_pread,
                     handle.async_pwrite):
            with pytest.raises(TypeError, match="file_offset"):
                call(t, path, offset)
    with pytest.raises(TypeError, match="fd"):
        handle.async_pwrite(t, 1 << 32)
    with pytest.raises(TypeError, match="fd"):
        handle.async_pwrite(t, fd=-(1 << 31) - 1)
    assert handle.wait() == 0


@pytest.mark.parametrize("value", ["no", [], [1], {}, object()],
                         ids=["no", "[]", "[1]", "{}", "object()"])
def test_flags_take_what_pybind11_s_bool_takes(disk_dir: Path, value: object) -> None:
    """DeepNVMe's bool arguments (single_submit, overlap_events, validate, async) take what
    pybind11 converts to a C++ bool: True/False, None, and objects with a number's truth
    (ints, floats, numpy bools); a str, a list or a dict is its TypeError."""
    builder = AsyncIOBuilder().load()
    with pytest.raises(TypeError, match="single_submit"):
        builder.aio_handle(1 << 20, 8, value, False, 1)
    with pytest.raises(TypeError, match="overlap_events"):
        builder.aio_handle(1 << 20, 8, False, value, 1)
    h = builder.aio_handle(1 << 20, 8, None, 1.0, 1)
    try:
        assert h.get_single_submit() is False and h.get_overlap_events() is True
        path = str(disk_dir / "t.bin")
        t = torch.arange(8, dtype=torch.uint8)
        with pytest.raises(TypeError, match="validate"):
            h.pwrite(t, path, value, False)
        with pytest.raises(TypeError, match="async"):
            h.pwrite(t, path, False, value)
        with pytest.raises(TypeError, match="validate"):
            h.pread(t, path, value, False)
        with pytest.raises(TypeError, match="validate"):
            h.write(t, path, value)
        assert h.wait() == 0
        assert h.pwrite(t, path, None, 0) == 1  # numbers and None convert
        assert h.pread(t, path, 1.0, 0) == 1
    finally:
        h.close()


def test_read_at_an_offset_needs_the_buffer_s_bytes_in_the_file(handle, disk_dir: Path) -> None:  # type: ignore[no-untyped-def]
    """read() is the whole-buffer call: at an offset, a file that ends before the buffer does is
    a ValueError, not a return of 0 with the buffer's tail left as it was."""
    path = str(disk_dir / "t.bin")
    assert handle.sync_pwrite(torch.arange(100, dtype=torch.uint8), path) == 1
    buffer = torch.zeros(10, dtype=torch.uint8)
    assert handle.read(buffer, path, False, 90) == 0  # the file's last 10 bytes
    assert buffer.tolist() == list(range(90, 100))
    for offset in (95, 100, 4096):
        buffer.fill_(7)
        with pytest.raises(ValueError, match="from offset"):
            handle.read(buffer, path, False, offset)
        assert buffer.eq(7).all()
    with pytest.raises(TypeError, match="file_offset"):
        handle.read(buffer, path, False, "90")
    assert handle.wait() == 0


@pytest.mark.parametrize("call", ["wait", "sync_pread"])
def test_an_interrupted_wait_leaves_the_operations_to_the_next(disk_dir: Path, alarm_interrupt, call: str) -> None:  # type: ignore[no-untyped-def]
    """Ctrl-C during wait() (or a blocking call) stops the wait, not the reads: the next wait()
    still waits for them, counts them and finishes them (a non-contiguous tensor gets its data
    copied in), as DeepSpeed's ``assert wait() == n`` expects."""
    from tensortier import IOHandle

    data = torch.arange(1 << 16, dtype=torch.int32)
    path = str(disk_dir / "slow.bin")
    data.numpy().tofile(path)
    h = AsyncIOBuilder().load().aio_handle()
    h._io.close()  # the engine with its first request delayed (the fault-injecting backend)
    h._io = with_faults({"kind": "delay", "delay_us": 1_500_000, "nth": 1}, IOHandle, "threads")
    try:
        flat = torch.zeros_like(data)
        strided = torch.zeros(256, 256, dtype=torch.int32).t()  # not contiguous: read via a copy
        assert h.async_pread(flat, path) == 0
        alarm_interrupt(0.3)
        with pytest.raises(KeyboardInterrupt):
            if call == "wait":
                assert h.async_pread(strided, path) == 0
                h.wait()
            else:
                h.sync_pread(strided, path)
        assert h.wait() == 2
        assert torch.equal(flat, data)
        assert torch.equal(strided, data.reshape(256, 256))
        assert h.wait() == 0
    finally:
        h.close()



def test_an_interrupt_reaches_a_wait_behind_another_thread_s_call(disk_dir: Path, alarm_interrupt) -> None:  # type: ignore[no-untyped-def]
    """Ctrl-C reaches the main thread while it waits for the handle that another thread's
    blocking read holds (DeepNVMe's handle lock is a Python lock there); the read goes on."""
    import threading
    import time

    from tensortier import IOHandle

    data = torch.arange(1 << 12, dtype=torch.int32)
    path = str(disk_dir / "slow.bin")
    data.numpy().tofile(path)
    h = AsyncIOBuilder().load().aio_handle()
    h._io.close()  # the engine with its first request delayed (the fault-injecting backend)
    h._io = with_faults({"kind": "delay", "delay_us": 4_000_000, "nth": 1}, IOHandle, "threads")
    target = torch.zeros_like(data)
    reader = threading.Thread(target=h.sync_pread, args=(target, path))
    try:
        reader.start()
        time.sleep(0.5)  # the reader holds the handle, its read delayed
        alarm_interrupt(0.3)
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            h.wait()
        # Raised while the read is still delayed, not after it let go of the handle.
        assert time.monotonic() - start < 2.5
    finally:
        reader.join(60)
        assert h.wait() == 0
        h.close()
    assert torch.equal(target, data)

def test_is_pinned_needs_all_of_the_buffer_locked(handle) -> None:  # type: ignore[no-untyped-def]
    """As DeepSpeed's manager: a buffer that starts in a locked tensor and ends past it has an
    unlocked tail, so it is not pinned (its writes are copied first)."""
    ctypes = pytest.importorskip("ctypes")
    np = pytest.importorskip("numpy")
    t = handle.new_cpu_locked_tensor(8192, torch.empty(0, dtype=torch.uint8))
    try:
        assert handle.is_pinned(t[4096:]) and handle.is_pinned(t[:4096])
        # A tensor made over the address, running 4 KiB past the end (is_pinned reads nothing).
        past = torch.from_numpy(np.ctypeslib.as_array(
            (ctypes.c_uint8 * 8192).from_address(t.data_ptr() + 4096)))
        assert not handle.is_pinned(past)
        assert not PinMemoryBuilder().load().pin_handle().is_pinned(past)
    finally:
        handle.free_cpu_locked_tensor(t)


def test_pin_handle_frees_by_address_as_deepspeed_native_pinning_does(handle) -> None:  # type: ignore[no-untyped-def]
    """DeepSpeed's DS_PIN_MEMORY_BACKEND=native (deepspeed/utils/pin_memory.py): a tensor from
    the pin_memory op, used through a reshaped view of it, freed by its address while only the
    view holds it; the aio handle sees the same registry throughout."""
    assert PinMemoryBuilder().is_compatible() and PinMemoryBuilder.NAME == "pin_memory"
    pins = PinMemoryBuilder().load().pin_handle()
    tensor = torch.arange(32, dtype=torch.float32).reshape(4, 8)
    base = pins.new_cpu_locked_tensor(tensor.numel(), tensor)
    begin = base.data_ptr()
    locked = base[: tensor.numel()]
    locked.copy_(tensor.reshape(-1))
    locked = locked.view(tensor.shape)
    del base  # the view keeps it
    assert handle.is_pinned(locked) and handle.is_pinned(locked[1]) and pins.is_pinned(locked)
    assert torch.equal(locked, tensor)
    assert pins.free_cpu_locked_tensor_by_ptr(begin) is True
    assert not handle.is_pinned(locked) and not pins.is_pinned(locked)
    assert pins.free_cpu_locked_tensor_by_ptr(begin) is False  # once
    assert handle.free_cpu_locked_tensor(locked) is False
    # Freed through the aio handle, too, whichever handle made it.
    other = handle.new_cpu_locked_tensor(16, torch.empty(0))
    assert pins.free_cpu_locked_tensor(other) is True and not handle.is_pinned(other)
    # What pybind11 refuses for a uintptr_t or a tensor.
    for value in (-1, 1 << 64, "0", 1.0):
        with pytest.raises(TypeError, match="address"):
            pins.free_cpu_locked_tensor_by_ptr(value)
    for call in (pins.is_pinned, pins.free_cpu_locked_tensor):
        with pytest.raises(TypeError, match="tensor"):
            call([1])  # type: ignore[operator]
    with pytest.raises(TypeError, match="example_tensor"):
        pins.new_cpu_locked_tensor(4, None)


def test_is_pinned_asks_the_cuda_driver_about_memory_pinned_by_anyone(
    fake_driver: Path, tmp_path: Path  # noqa: F811 - the fixture
) -> None:
    """With a CUDA driver, host memory another library page-locked (cuMemHostRegister straight
    through the driver: nothing of tensortier's records it) is pinned for every handle, as far as
    the registration goes."""
    run_with_fake(
        fake_driver,
        """
        from tensortier.compat.deepnvme import AsyncIOBuilder, GDSBuilder, PinMemoryBuilder
        aio = AsyncIOBuilder().load().aio_handle(1 << 20, 8, False, False, 1)
        gds = GDSBuilder().load().gds_handle(1 << 20, 8, False, False, 1)
        pins = PinMemoryBuilder().load().pin_handle()
        memory = tensortier.aligned_empty(8192)
        address = memory.data_ptr()
        head = memory[:4096]
        assert not aio.is_pinned(head) and not pins.is_pinned(head)
        device, context = ctypes.c_int(), ctypes.c_void_p()
        assert fake.cuDeviceGet(ctypes.byref(device), 0) == 0
        assert fake.cuDevicePrimaryCtxRetain(ctypes.byref(context), device) == 0
        assert fake.cuCtxPushCurrent_v2(context) == 0
        assert fake.cuMemHostRegister_v2(ctypes.c_void_p(address), ctypes.c_size_t(4096), 1) == 0
        try:
            for h in (aio, gds, pins):
                assert h.is_pinned(head) and h.is_pinned(head[100:200]), h
                assert not h.is_pinned(memory), h  # its second page is pageable
                assert not h.is_pinned(memory[4096:]), h
            assert tensortier.pin(head) is head
            assert tensortier.pin(memory) is not memory
        finally:
            assert fake.cuMemHostUnregister(ctypes.c_void_p(address)) == 0
            popped = ctypes.c_void_p()
            assert fake.cuCtxPopCurrent_v2(ctypes.byref(popped)) == 0
            assert fake.cuDevicePrimaryCtxRelease_v2(device) == 0
        assert not aio.is_pinned(head) and not pins.is_pinned(head)
        aio.close()
        gds.close()
        check_clean()
        """,
        tmp_path,
    )


def test_integer_arguments_take_bools_as_pybind11_does(handle, disk_dir: Path) -> None:  # type: ignore[no-untyped-def]
    """DeepSpeed's binding takes its ints (file_offset, the descriptor, the constructor's
    settings) as pybind11 converts them: a bool is an int there (True is 1)."""
    path = str(disk_dir / "b.bin")
    t = torch.arange(16, dtype=torch.uint8)
    assert handle.sync_pwrite(t, path, False) == 1
    assert handle.sync_pwrite(t[:1], path, True) == 1  # at offset 1
    u = torch.zeros(2, dtype=torch.uint8)
    assert handle.sync_pread(u, path, True) == 1 and u.tolist() == [0, 2]
    assert handle.read(torch.zeros(15, dtype=torch.uint8), path, False, True) == 0
    h = AsyncIOBuilder().load().aio_handle(True, True, False, False, True)
    try:
        assert (h.get_block_size(), h.get_queue_depth(), h.get_intra_op_parallelism()) == (1, 1, 1)
    finally:
        h.close()
    with pytest.raises(ValueError, match="queue_depth"):  # 0, below 1, as for the int 0
        AsyncIOBuilder().load().aio_handle(1 << 20, False, False, False, 1)
    assert PinMemoryBuilder().load().pin_handle().free_cpu_locked_tensor_by_ptr(True) is False


def test_free_cpu_locked_tensor_waits_for_the_io_on_it(disk_dir: Path) -> None:
    """DeepSpeed frees a locked tensor at once, under a read still writing into it; here the
    free (by any handle: one manager per process) waits for the reads and writes started on its
    memory, then frees it."""
    from tensortier import IOHandle

    data = torch.arange(1 << 14, dtype=torch.int32)
    path = str(disk_dir / "slow.bin")
    data.numpy().tofile(path)
    h = AsyncIOBuilder().load().aio_handle()
    pin = PinMemoryBuilder().load().pin_handle()
    try:
        for by_ptr in (False, True):
            h._io.close()  # an engine with its first request delayed (the fault-injecting backend)
            h._io = with_faults({"kind": "delay", "delay_us": 500_000, "nth": 1}, IOHandle,
                                "threads")
            t = h.new_cpu_locked_tensor(data.numel(), data)
            t.fill_(-1)
            keep = t.view(torch.uint8)  # the page-aligned memory outlives the free (CPU path)
            assert h.async_pread(t, path) == 0
            future = h._pending[0][0]
            if by_ptr:
                assert pin.free_cpu_locked_tensor_by_ptr(t.data_ptr())
            else:
                assert pin.free_cpu_locked_tensor(t)
            assert future.done()
            if keep.untyped_storage().nbytes() > 0:  # pinned by CUDA: resized to nothing
                assert torch.equal(keep.view(torch.int32), data)
            assert h.wait() == 1
    finally:
        h.close()


def test_a_handle_in_a_cycle_through_a_pending_buffer_is_collected(disk_dir: Path) -> None:
    """A tensor moved by a pending write that refers back to its handle (an attribute) makes a
    cycle the collector frees: the handle's log of operations takes part in collection."""
    import gc
    import weakref

    refs = []
    for i in range(3):
        h = AsyncIOBuilder().load().aio_handle(1024**2, 128, True, True, 1)
        buffer = h.new_cpu_locked_tensor(4096, torch.empty(0, dtype=torch.uint8))
        buffer.copy_(torch.arange(4096, dtype=torch.uint8))
        buffer.owner = h  # type: ignore[attr-defined]
        assert h.async_pwrite(buffer, str(disk_dir / f"f{i}")) == 0
        refs.append(weakref.ref(h))
        del h, buffer
    gc.collect()
    assert [r() for r in refs] == [None] * 3
    assert all((disk_dir / f"f{i}").read_bytes() == bytes(range(256)) * 16 for i in range(3))


def test_operations_on_one_locked_buffer_keep_the_order_they_started_in(
        disk_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepNVMe's workers take a handle's operations first in, first out: a write of a buffer
    then a read into it leaves the file with the old contents, a read then a write the new.
    The engine runs operations side by side: one on memory an earlier one still moves waits."""
    monkeypatch.setenv("TENSORTIER_BACKEND", "threads")  # where a race shows most
    h = AsyncIOBuilder().load().aio_handle(16384, 32, False, False, 8)
    n = 1 << 20
    buf = h.new_cpu_locked_tensor(n, torch.empty(0))
    h.sync_pwrite(torch.full((n,), 2.0), str(disk_dir / "in.bin"))
    out = torch.empty(n)
    for i in range(5):
        buf.fill_(1.0)
        assert h.async_pwrite(buf, str(disk_dir / f"old{i}.bin")) == 0
        assert h.async_pread(buf, str(disk_dir / "in.bin")) == 0
        assert h.wait() == 2
        h.sync_pread(out, str(disk_dir / f"old{i}.bin"))
        assert bool((out == 1.0).all()), f"round {i}: the write saw the read's data"
        buf.fill_(1.0)
        assert h.async_pread(buf, str(disk_dir / "in.bin")) == 0
        assert h.async_pwrite(buf, str(disk_dir / f"new{i}.bin")) == 0
        assert h.wait() == 2
        h.sync_pread(out, str(disk_dir / f"new{i}.bin"))
        assert bool((out == 2.0).all()), f"round {i}: the write did not see the read's data"
    h.free_cpu_locked_tensor(buf)


def test_a_forked_child_s_copy_of_a_handle_refuses_to_wait_for_the_parent_s_reads(
        disk_dir: Path) -> None:
    """A child made by fork (a DataLoader worker) holding a handle whose read is in flight in
    the parent: its wait() and blocking calls raise ValueError, as an IOHandle's do (they waited
    forever for operations no thread of the child runs); the parent's read completes."""
    import subprocess
    import sys

    code = f"""
import os, signal, torch
from tensortier.compat.deepnvme import AsyncIOBuilder
path = {str(disk_dir / "big.bin")!r}
t = torch.arange(16 << 20, dtype=torch.float32)
t.numpy().tofile(path)
h = AsyncIOBuilder().load().aio_handle()
u = torch.empty_like(t)
assert h.async_pread(u, path) == 0
pid = os.fork()
if pid == 0:
    signal.alarm(30)
    code = 0
    for call in (h.wait, lambda: h.sync_pread(torch.empty(4), path),
                 lambda: h.read(torch.empty(4), path, False, 0)):
        try:
            call()
            code = 3
        except ValueError as e:
            code = code or (0 if "a child made by fork()" in str(e) else 4)
    h.close()  # the child's copy, at once
    os._exit(code)
_, status = os.waitpid(pid, 0)
assert h.wait() == 1 and torch.equal(u, t)
raise SystemExit(os.waitstatus_to_exitcode(status))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, (r.returncode, r.stderr)


def test_a_forked_child_frees_a_locked_tensor_the_parent_still_writes(disk_dir: Path) -> None:
    """free_cpu_locked_tensor in a child made by fork while the parent's write of the buffer is
    in flight: the child frees its copy at once (it waited for the parent's operation, which no
    thread of the child can finish: forever), and the parent's write completes."""
    import subprocess
    import sys

    code = f"""
import os, signal, torch
from tensortier.compat.deepnvme import AsyncIOBuilder
h = AsyncIOBuilder().load().aio_handle()
buf = h.new_cpu_locked_tensor(64 << 20, torch.empty(0, dtype=torch.uint8))
buf.fill_(7)
h.async_pwrite(buf, {str(disk_dir / "locked.bin")!r})
pid = os.fork()
if pid == 0:
    signal.alarm(30)
    os._exit(0 if h.free_cpu_locked_tensor(buf) else 3)
_, status = os.waitpid(pid, 0)
assert h.wait() == 1
assert h.free_cpu_locked_tensor(buf)
raise SystemExit(os.waitstatus_to_exitcode(status))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, (r.returncode, r.stderr)
    assert (disk_dir / "locked.bin").read_bytes() == b"\x07" * (64 << 20)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_ctrl_c_in_a_read_leaves_it_to_the_next_wait(tmp_path: Path, mode: str) -> None:
    """compat.md: Ctrl-C interrupts a wait, not the operations; the next wait() waits for them.
    A read interrupted after it started was forgotten (the buffer then freed under it: heap
    corruption), and an interrupted sync_pread's wait lost it: wait() returned with it running."""
    import textwrap

    script = INTERRUPTED_CALLS + textwrap.dedent("""
        import sys, torch
        from tensortier.compat.deepnvme import AsyncIOBuilder
        mode = sys.argv[2]
        handle = AsyncIOBuilder().load().aio_handle(1 << 20, 32, False, True, 4)
        path = sys.argv[1] + "/data.bin"
        data = torch.randn(1 << 22)
        handle.sync_pwrite(data, path)
        hits = 0
        for it in range(150):
            into = torch.zeros_like(data)
            call = ((lambda: handle.sync_pread(into, path)) if mode == "sync" else
                    (lambda: (handle.async_pread(into, path), handle.wait())))
            was = interrupted(call, 1e-4, it)
            hits += was
            handle.wait()
            assert len(handle._io._pending) == 0, it  # nothing left running
            assert was or torch.equal(into, data), it
            del into
        print("interrupted", hits)
        """)
    assert exits_cleanly(script, str(tmp_path), mode, timeout=300).startswith("interrupted")
