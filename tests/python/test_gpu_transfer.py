"""CUDA tensors to and from files: IOHandle, DiskOffloader, compat.deepnvme, compat.gds, pinned
memory. Random data of sizes 1 B, unaligned, 64 MiB and 1 GiB+, every dtype, several files and
offsets, non-default streams, concurrent transfers. Skipped without a CUDA device; run them all
with scripts/gpu-test.sh on a GPU machine."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import tensortier
from tensortier import _core

from faults import with_faults

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda)"),
]

GIB = 1 << 30


@pytest.fixture(autouse=True)
def _driver() -> None:
    info = _core.cuda_driver()
    if not info["available"]:
        pytest.fail(f"torch sees CUDA but tensortier's driver does not: {info['why_unavailable']}")


@pytest.fixture
def io() -> Any:
    with tensortier.IOHandle() as handle:
        yield handle


def _rand_bytes(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=g)


def _file_bytes(path: Path, offset: int, n: int) -> np.ndarray:
    with open(path, "rb") as f:
        f.seek(offset)
        return np.frombuffer(f.read(n), dtype=np.uint8)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("size", [1, 4097, 3333333, 64 << 20])
@pytest.mark.parametrize("offset", [0, 4097])
def test_round_trip_sizes_and_offsets(io: Any, disk_dir: Path, size: int, offset: int) -> None:
    path = disk_dir / "t.bin"
    src = _rand_bytes(size, size + offset)
    assert io.pwrite(src, path, offset) == size
    assert np.array_equal(_file_bytes(path, offset, size), src.cpu().numpy())
    dst = torch.zeros(size, dtype=torch.uint8, device="cuda")
    result = io.pread_async(dst, path, offset).result()
    assert result.bytes == size
    assert result.stats["path"] == "bounce"
    assert torch.equal(src, dst)


@pytest.mark.slow
def test_round_trip_over_one_gib(io: Any, disk_dir: Path) -> None:
    size = GIB + 4097
    path = disk_dir / "big.bin"
    src = _rand_bytes(size, 1)
    assert io.pwrite(src, path, 4096) == size
    dst = torch.empty_like(src)
    assert io.pread(dst, path, 4096) == size
    assert torch.equal(src, dst)
    del src, dst
    torch.cuda.empty_cache()


def _random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    raw = _rand_bytes(nbytes, seed)
    if dtype == torch.bool:
        return (raw[: int(np.prod(shape))] & 1).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
    torch.complex128, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
] + [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64")
     if hasattr(torch, n)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype(io: Any, disk_dir: Path, dtype: torch.dtype) -> None:
    src = _random_tensor(dtype, (3, 5, 7), 7)
    path = disk_dir / "d.bin"
    io.pwrite(src, path, 123)
    dst = torch.empty_like(src)
    io.pread(dst, path, 123)
    assert torch.equal(_as_bytes(src), _as_bytes(dst))


def test_several_files_and_offsets_in_one_batch(io: Any, disk_dir: Path) -> None:
    files = [disk_dir / f"f{i}.bin" for i in range(3)]
    # Disjoint ranges (4 MiB apart): the device pieces run concurrently.
    shapes = [(1000, 0), (1 << 20, 1000), (5, 3), (4096, 8192), (777777, 1), (12, 0)]
    pieces = [(_rand_bytes(n, n), files[k % 3], k * (4 << 20) + odd)
              for k, (n, odd) in enumerate(shapes)]
    host = torch.arange(100, dtype=torch.int32)  # a host piece in the same batch
    io.pwrite_batch_async([*pieces, (host, files[0], 10 << 20)]).wait()
    outs = [torch.empty_like(t) for t, _, _ in pieces]
    host_out = torch.empty_like(host)
    result = io.pread_batch_async(
        [*((o, f, off) for o, (_, f, off) in zip(outs, pieces)), (host_out, files[0], 10 << 20)]
    ).result()
    assert result.segment_bytes == [t.numel() for t, _, _ in pieces] + [400]
    for (t, _, _), o in zip(pieces, outs):
        assert torch.equal(t, o)
    assert torch.equal(host, host_out)


def test_non_default_stream_orders_the_copies(io: Any, disk_dir: Path) -> None:
    path = disk_dir / "s.bin"
    stream = torch.cuda.Stream()
    n = 16 << 20
    with torch.cuda.stream(stream):
        x = torch.zeros(n, dtype=torch.uint8, device="cuda")
        torch.cuda._sleep(200_000_000)  # the fill runs late: the write must wait for it
        x.fill_(7)
        io.pwrite(x, path)  # no synchronisation by the caller
    assert (_file_bytes(path, 0, n) == 7).all()
    with torch.cuda.stream(stream):
        y = torch.empty(n, dtype=torch.uint8, device="cuda")
        io.pread(y, path)
        z = y.to(torch.int32).sum()  # queued on the same stream after the read's copies
    stream.synchronize()
    assert int(z) == 7 * n


def test_explicit_stream_handle_through_core(disk_dir: Path) -> None:
    engine = _core.Engine()
    transfer = _core.DeviceTransfer(engine)
    f = _core.File.open(str(disk_dir / "c.bin"), "w")
    stream = torch.cuda.Stream()
    src = _rand_bytes(5 << 20, 3)
    torch.cuda.synchronize()
    r = transfer.write(src.data_ptr(), src.numel(), f, 4096, src.device.index, stream.cuda_stream)
    assert r["bytes"] == src.numel() and r["stats"]["copier"] == "cuda"
    dst = torch.empty_like(src)
    r = transfer.read(f, 4096, src.numel(), dst.data_ptr(), dst.device.index, stream.cuda_stream)
    stream.synchronize()
    assert torch.equal(src, dst)
    assert transfer.options["pinned_registered"]


def test_concurrent_transfers_from_threads(disk_dir: Path) -> None:
    errors: list[BaseException] = []
    with tensortier.IOHandle(bounce_rings=2) as io:

        def work(t: int) -> None:
            try:
                torch.cuda.set_device(0)
                for rnd in range(3):
                    src = _rand_bytes((4 << 20) + 4097 * t, 100 * t + rnd)
                    path = disk_dir / f"c{t}.bin"
                    io.pwrite(src, path, t * 4096 + 1)
                    dst = torch.empty_like(src)
                    io.pread(dst, path, t * 4096 + 1)
                    torch.cuda.current_stream().synchronize()
                    assert torch.equal(src, dst), f"thread {t} round {rnd}"
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                errors.append(e)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        # Many asynchronous operations outstanding at once from one thread.
        srcs = [_rand_bytes(3 << 20, 50 + i) for i in range(8)]
        futs = [io.pwrite_async(s, disk_dir / f"a{i}.bin") for i, s in enumerate(srcs)]
        for f in futs:
            f.wait()
        dsts = [torch.empty_like(s) for s in srcs]
        futs = [io.pread_async(d, disk_dir / f"a{i}.bin") for i, d in enumerate(dsts)]
        io.wait_all()
        assert all(torch.equal(s, d) for s, d in zip(srcs, dsts))
    assert not errors, errors


def test_read_past_end_of_file_and_errors(io: Any, disk_dir: Path) -> None:
    path = disk_dir / "short.bin"
    path.write_bytes(bytes(range(256)) * 4)
    dst = torch.full((2000,), 9, dtype=torch.uint8, device="cuda")
    assert io.pread(dst, path, 24) == 1000
    assert torch.equal(dst[:1000].cpu(), torch.tensor(list(range(256)) * 4, dtype=torch.uint8)[24:])
    assert (dst[1000:] == 9).all()
    with pytest.raises(FileNotFoundError):
        io.pread(dst, disk_dir / "missing.bin")
    with pytest.raises(ValueError, match="contiguous"):
        io.pwrite(torch.zeros(10, 10, device="cuda").t(), path)


def test_gds_auto_round_trip(disk_dir: Path) -> None:
    with tensortier.IOHandle(gds="auto") as io:
        src = _rand_bytes((32 << 20) + 5, 9)
        w = io.pwrite_async(src, disk_dir / "g.bin", 8192).result()
        assert w.stats["path"] in ("gds", "bounce"), w.stats
        dst = torch.empty_like(src)
        r = io.pread_async(dst, disk_dir / "g.bin", 8192).result()
        assert torch.equal(src, dst)
        info = tensortier.cufile_info()
        print("GDS path:", r.stats["path"], r.stats["device_pieces"][0]["gds_reason"], info)


def test_pinned_empty_and_pin() -> None:
    t = tensortier.pinned_empty((1024, 3), torch.float32)
    assert t.is_pinned() and t.shape == (1024, 3) and t.data_ptr() % 4096 == 0
    t.copy_(torch.randn(1024, 3))
    g = t.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(g.cpu(), t)
    assert tensortier.pin(t) is t
    plain = torch.randn(77)
    p = tensortier.pin(plain)
    assert p.is_pinned() and torch.equal(p, plain) and p.data_ptr() != plain.data_ptr()
    assert tensortier.pinned_empty(0).numel() == 0
    assert _core.locate(g.data_ptr())["type"] == "device"
    assert _core.locate(t.data_ptr())["type"] == "registered host"


def test_disk_offloader_frees_and_restores_gpu_memory(disk_dir: Path) -> None:
    with tensortier.DiskOffloader(disk_dir / "off") as off:
        x = _rand_bytes(64 << 20, 5).view(torch.float32).reshape(1024, -1)
        y = torch.randn(3, 5, device="cuda", dtype=torch.float16)
        ref_x, ref_y = x.clone(), y.clone()
        before = torch.cuda.memory_allocated()
        off.sync_write(x)
        assert x.untyped_storage().nbytes() == 0 and x.shape == ref_x.shape
        assert torch.cuda.memory_allocated() <= before - (64 << 20)
        off.async_writev([y])
        off.sync_write_events()
        assert y.untyped_storage().nbytes() == 0
        off.sync_read(x)
        off.async_read(y)
        off.synchronize()
        # bytes, not values: random bits hold NaNs, which torch.equal never finds equal
        assert torch.equal(_as_bytes(x), _as_bytes(ref_x))
        assert torch.equal(_as_bytes(y), _as_bytes(ref_y))
        assert x.device.type == "cuda" and not off.is_offloaded(x)


def test_disk_offloader_on_a_side_stream_and_from_threads(disk_dir: Path) -> None:
    """The offloader's transfers follow the work queued on the tensor's current stream (a late
    fill is what gets written; a kernel queued after the read sees the bytes once the wait is
    over), through reused pinned slots, from several threads at once."""
    with tensortier.DiskOffloader(disk_dir / "off") as off:
        stream = torch.cuda.Stream()
        n = 48 << 20
        with torch.cuda.stream(stream):
            x = torch.zeros(n, dtype=torch.uint8, device="cuda")
            torch.cuda._sleep(200_000_000)  # the fill runs late: the write must wait for it
            x.fill_(7)
            off.async_write(x)  # no synchronisation by the caller
            torch.cuda._sleep(5_000_000_000)  # queued after the call: must not hold the write
            off.sync_write_events()
            assert not stream.query()  # the write finished while the later sleep still runs
            assert x.untyped_storage().nbytes() == 0
            off.sync_read(x)
            total = x.to(torch.int32).sum()
        stream.synchronize()
        assert int(total) == 7 * n
        transfer = off._device.transfer
        assert transfer is not None and transfer.options["pinned_registered"]
        pinned = transfer.options["pinned_bytes"]

        errors: list[BaseException] = []

        def worker(seed: int) -> None:
            try:
                for round_ in range(3):
                    t = _rand_bytes((8 << 20) + seed * 4097 + round_, seed * 10 + round_)
                    ref = t.clone()
                    off.sync_write(t)
                    off.sync_read(t)
                    assert torch.equal(t, ref)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors, errors
        assert transfer.options["pinned_bytes"] <= transfer.options["pinned_budget"]
        assert pinned <= transfer.options["pinned_bytes"]


def test_disk_offloader_gds_auto_striped_over_two_directories(disk_dir: Path) -> None:
    """GDS where cuFile takes the backing files (else the ring), the parts of a striped tensor
    at once; ``device_bytes`` says which way the bytes went."""
    dirs = [disk_dir / "a", disk_dir / "b"]
    with tensortier.DiskOffloader(dirs, stripe_threshold=1 << 20, gds="auto") as off:
        x = _rand_bytes((40 << 20) + 3, 31)
        ref = x.clone()
        off.sync_write(x)
        assert x.untyped_storage().nbytes() == 0
        assert all(os.path.getsize(p) > 0 for p in off.paths)
        off.sync_read(x)
        assert torch.equal(x, ref)
        moved = off.device_bytes
        assert set(moved) <= {"gds", "bounce"} and sum(moved.values()) == 2 * x.numel(), moved
        info = tensortier.cufile_info()
        if not info["available"] or info["compat_mode_reason"]:
            assert set(moved) == {"bounce"}, (moved, info)


def test_disk_offloader_keeps_data_when_the_gpu_restore_fails(disk_dir: Path) -> None:
    """Reading a tensor back frees its file space: out of GPU memory, or a failed read, must not
    lose its bytes (the tensor stays offloaded; a later read restores it)."""
    with tensortier.DiskOffloader(disk_dir / "off") as off:
        x = _rand_bytes(64 << 20, 21)
        ref = x.clone()
        off.sync_write(x)
        # Out of memory when the read starts: nothing is read, the file keeps the data.
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(x.device).total_memory
        fraction = (torch.cuda.memory_reserved(x.device) + (16 << 20)) / total
        torch.cuda.set_per_process_memory_fraction(fraction, x.device)
        try:
            with pytest.raises(torch.OutOfMemoryError):
                off.sync_read(x)
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, x.device)
        assert off.is_offloaded(x) and x.untyped_storage().nbytes() == 0
        off.sync_read(x)
        assert not off.is_offloaded(x) and torch.equal(x, ref)
    # A disk read failing under the ring (an injected EIO): the wait raises it, the tensor stays
    # offloaded with its file space, and the next read restores it.
    fault = {"kind": "error", "errno": errno.EIO, "nth": 2, "count": 1, "writes": False}
    with with_faults(fault, tensortier.DiskOffloader, disk_dir / "fault", backend="threads") as off:
        x = _rand_bytes((24 << 20) + 5, 22)
        ref = x.clone()
        off.sync_write(x)
        with pytest.raises(OSError) as e:
            off.sync_read(x)
        assert e.value.errno == errno.EIO
        assert off.is_offloaded(x) and x.untyped_storage().nbytes() == 0
        assert off.stored_bytes == ref.numel()
        off.sync_read(x)
        assert not off.is_offloaded(x) and torch.equal(x, ref)


def test_deepnvme_handles_on_cuda_tensors(disk_dir: Path) -> None:
    from tensortier.compat.deepnvme import AsyncIOBuilder, GDSBuilder

    for builder, name in ((AsyncIOBuilder(), "aio_handle"), (GDSBuilder(), "gds_handle")):
        h = getattr(builder.load(), name)(1 << 20, 32, True, True, 1)
        src = _rand_bytes((8 << 20) + 3, 11).view(torch.uint8)
        path = str(disk_dir / f"{name}.bin")
        assert h.sync_pwrite(src, path) == 1
        dst = torch.empty_like(src)
        if name == "gds_handle":
            assert h.pin_device_tensor(dst) is True
        h.async_pread(dst, path)
        assert h.wait() == 1
        assert torch.equal(src, dst)
        if name == "gds_handle":
            assert h.unpin_device_tensor(dst) is True
            t = h.new_pinned_device_tensor(1000, src)
            assert t.device.type == "cuda" and h.free_pinned_device_tensor(t)
            t.fill_(3)  # only unpinned, as DeepNVMe's: the tensor stays usable
            assert int(t.sum()) == 3000
        h.pwrite(src, path, True, False)  # validate=True compares with the file
        h.close()


def test_deepnvme_aio_async_write_of_cuda_tensor_takes_its_values_at_submit(
    disk_dir: Path,
) -> None:
    """DeepNVMe's aio_handle copies a CUDA tensor to host memory when an async write is
    submitted: work queued on the tensor's stream right after the call (before wait) must not
    change what is written."""
    from tensortier.compat.deepnvme import AsyncIOBuilder

    h = AsyncIOBuilder().load().aio_handle(1 << 20, 32, True, True, 1)
    src = _rand_bytes((32 << 20) + 5, 13).view(torch.uint8)
    expected = src.cpu()
    for i, start in enumerate((h.async_pwrite, lambda t, p: h.pwrite(t, p, False, True))):
        path = str(disk_dir / f"aio-{i}.bin")
        assert start(src, path) == 0
        src.add_(1)  # queued on the current stream before the write's copies could run
        assert h.wait() == 1
        with open(path, "rb") as f:
            assert f.read() == expected.numpy().tobytes()
        expected = src.cpu()
    h.close()


def test_compat_gds_file_on_cuda_storages(disk_dir: Path) -> None:
    from tensortier.compat import gds

    src = torch.randn(1 << 20, device="cuda")
    dst = torch.empty_like(src)
    gds.gds_register_buffer(src.untyped_storage())
    gds.gds_register_buffer(dst.untyped_storage())
    f = gds.GdsFile(disk_dir / "gds.bin", os.O_CREAT | os.O_RDWR)
    f.save_storage(src.untyped_storage(), 4096)
    f.load_storage(dst.untyped_storage(), 4096)
    assert f.last_path in ("gds", "bounce")
    assert torch.equal(src, dst)
    gds.gds_deregister_buffer(src.untyped_storage())
    gds.gds_deregister_buffer(dst.untyped_storage())
    f.close()


def test_files_interchangeable_with_torch_cuda_gds(disk_dir: Path) -> None:
    try:
        from torch.cuda.gds import GdsFile as TorchGdsFile

        src = torch.randn(1 << 18, device="cuda")
        torch.cuda.synchronize()  # torch's save_storage does not wait for the stream
        theirs = TorchGdsFile(str(disk_dir / "torch.bin"), os.O_CREAT | os.O_RDWR)
        theirs.save_storage(src.untyped_storage(), 0)
    except Exception as e:  # noqa: BLE001 - torch's needs GDS; ours is tested without it above
        pytest.skip(f"torch.cuda.gds does not run here: {e}")
    from tensortier.compat import gds

    dst = torch.empty_like(src)
    gds.GdsFile(disk_dir / "torch.bin", os.O_RDONLY).load_storage(dst.untyped_storage(), 0)
    assert torch.equal(src, dst)
