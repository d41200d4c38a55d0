"""tensortier.compat.deepnvme: DeepNVMe's aio_handle API on host tensors."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from tensortier.compat.deepnvme import AsyncIOBuilder, GDSBuilder

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
    # write() replaces the file, read() needs the exact size.
    small = torch.arange(10, dtype=torch.int32)
    assert handle.write(small, path, True) == 1
    assert os.path.getsize(path) == 40
    got = torch.empty_like(small)
    assert handle.read(got, path, True) == 1 and torch.equal(got, small)
    with pytest.raises(ValueError, match="holds 40 bytes"):
        handle.read(torch.empty(11, dtype=torch.int32), path, False)


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


def test_errors_raise_instead_of_returning_minus_one(handle, disk_dir: Path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(FileNotFoundError):
        handle.sync_pread(torch.empty(10), str(disk_dir / "missing.bin"))
    path = str(disk_dir / "short.bin")
    handle.sync_pwrite(torch.empty(10), path)
    with pytest.raises(ValueError, match="fewer than"):
        handle.sync_pread(torch.empty(11), path)
    with pytest.raises(ValueError, match="not contiguous"):
        handle.sync_pwrite(torch.empty(10, 10).t(), path)
    with pytest.raises(TypeError):
        handle.sync_pwrite(bytearray(10), path)
    with pytest.raises(ValueError, match="file_offset"):
        handle.sync_pwrite(torch.empty(10), path, -1)


def test_locked_tensors(handle, resident_bytes) -> None:  # type: ignore[no-untyped-def]
    t = handle.new_cpu_locked_tensor(12345, torch.empty(0, dtype=torch.float16))
    assert t.shape == (12345,) and t.dtype == torch.float16
    if torch.cuda.is_available():
        assert t.is_pinned()
    else:  # page-aligned, every page in memory before first use (DeepNVMe mlocks them)
        assert t.data_ptr() % 4096 == 0
        assert resident_bytes(t) == -(-t.numel() * 2 // 4096) * 4096
    assert handle.free_cpu_locked_tensor(t) is True


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
    h.close()
