"""The transfer layer on CI (no GPU): the bounce ring through ``_core.DeviceTransfer`` with the
memcpy copier (the "device" is host memory), errors without a CUDA driver, ``compat.gds`` on CPU
storages. The same paths with real CUDA tensors are in test_gpu_transfer.py."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import tensortier
from tensortier import _core
from tensortier.compat import gds

from faults import with_faults

NO_DRIVER = not _core.cuda_driver()["available"]
needs_no_driver = pytest.mark.skipif(not NO_DRIVER, reason="a CUDA driver is installed here")


def _rand(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


def _fake_device(n: int, misalign: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A host array used as "device" memory, `misalign` bytes past a page boundary, with 64 guard
    bytes on each side: (whole, view)."""
    whole = np.frombuffer(_core.AlignedBuffer(n + misalign + 8192), dtype=np.uint8)
    whole[:] = 0xA5
    return whole, whole[4096 + misalign : 4096 + misalign + n]


def _addr(a: np.ndarray) -> int:
    return int(a.ctypes.data)


@pytest.fixture
def engine() -> _core.Engine:
    return _core.Engine(backend="threads", chunk_size=64 << 10, page_cache_check=False)


@pytest.fixture
def transfer(engine: _core.Engine) -> _core.DeviceTransfer:
    return _core.DeviceTransfer(engine, slots=3, slot_bytes=64 << 10, max_rings=2, copier="memcpy")


@pytest.mark.parametrize(
    "size,offset,misalign",
    [(0, 0, 0), (1, 0, 0), (1, 4095, 3), (4095, 1, 1), (300001, 4097, 5), (1 << 20, 0, 0),
     (3 << 20, 12345, 4095)],
)
def test_ring_round_trip_sizes_offsets_alignments(
    transfer: _core.DeviceTransfer, disk_dir: Path, size: int, offset: int, misalign: int
) -> None:
    path = disk_dir / "t.bin"
    f = _core.File.open(str(path), "w")
    _, src = _fake_device(size, misalign)
    src[:] = _rand(size, size)
    w = transfer.write(_addr(src), size, f, offset)
    assert w["bytes"] == size and w["stats"]["path"] == "bounce"
    assert w["stats"]["copier"] == "memcpy"
    on_disk = path.read_bytes()
    assert on_disk[offset : offset + size] == src.tobytes()
    whole, dst = _fake_device(size, (misalign + 1) % 4096)
    r = transfer.read(f, offset, size, _addr(dst))
    assert r["bytes"] == size and not r["eof"]
    assert np.array_equal(dst, src)
    guard = 4096 + (misalign + 1) % 4096
    assert (whole[:guard] == 0xA5).all() and (whole[guard + size :] == 0xA5).all()


def test_ring_read_stops_at_end_of_file(transfer: _core.DeviceTransfer, disk_dir: Path) -> None:
    path = disk_dir / "short.bin"
    data = _rand(100000, 1)
    path.write_bytes(data.tobytes())
    f = _core.File.open(str(path), "r")
    _, dst = _fake_device(200000)
    r = transfer.read(f, 50000, 200000, _addr(dst))
    assert r["bytes"] == 50000 and r["eof"]
    assert np.array_equal(dst[:50000], data[50000:])
    assert (dst[50000:] == 0xA5).all(), "device bytes past end of file are untouched"


def test_ring_several_files_and_offsets_from_threads(
    transfer: _core.DeviceTransfer, disk_dir: Path
) -> None:
    errors: list[BaseException] = []
    shared = _core.File.open(str(disk_dir / "shared.bin"), "a")

    def work(t: int) -> None:
        try:
            own = _core.File.open(str(disk_dir / f"own-{t}.bin"), "w")
            n = 200000 + 4097 * t
            for rnd in range(3):
                _, src = _fake_device(n, t)
                src[:] = _rand(n, 10 * t + rnd)
                for f, off in ((own, 0), (shared, t * 400000 + t)):
                    assert transfer.write(_addr(src), n, f, off)["bytes"] == n
                    _, dst = _fake_device(n, t + 1)
                    assert transfer.read(f, off, n, _addr(dst))["bytes"] == n
                    assert np.array_equal(dst, src)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(5)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert transfer.rings <= 2
    opts = transfer.options
    assert opts["pinned_bytes"] <= opts["pinned_budget"]


def test_ring_engine_fault_raises_oserror_with_path(disk_dir: Path) -> None:
    path = disk_dir / "f.bin"
    path.write_bytes(_rand(1 << 20, 2).tobytes())
    engine = with_faults(
        {"kind": "error", "nth": 3, "writes": False}, _core.Engine, backend="threads",
        chunk_size=64 << 10,
    )
    transfer = _core.DeviceTransfer(engine, slots=2, slot_bytes=64 << 10, copier="memcpy")
    f = _core.File.open(str(path), "r")
    _, dst = _fake_device(1 << 20)
    with pytest.raises(OSError) as info:
        transfer.read(f, 0, 1 << 20, _addr(dst))
    assert info.value.errno == errno.EIO
    assert info.value.filename == str(path)
    # The ring is usable again.
    assert transfer.read(f, 0, 4096, _addr(dst))["bytes"] == 4096


def test_jobs_run_on_the_transfers_queue_and_raise_their_errors_when_waited_for(
    disk_dir: Path,
) -> None:
    """read_async/write_async return C++ jobs: several in flight at once over the transfer's
    threads, results as read/write give them, an I/O error raised by result() (as often as
    asked), and outcome() giving it back instead of raising."""
    path = disk_dir / "jobs.bin"
    engine = with_faults(
        {"kind": "error", "nth": 10, "writes": False}, _core.Engine, backend="threads",
        chunk_size=64 << 10,
    )
    transfer = _core.DeviceTransfer(engine, slots=2, slot_bytes=64 << 10, max_rings=2,
                                    copier="memcpy")
    assert transfer.threads == 2
    f = _core.File.open(str(path), "w")
    lazy = _core.LazyDeviceFile(f, "off")
    size = 200001
    sources = [_fake_device(size, i)[1] for i in range(4)]
    jobs = []
    for i, src in enumerate(sources):
        src[:] = _rand(size, 10 + i)
        target = (f, lazy, _core.DeviceFile(f, "off"))[i % 3]
        jobs.append(transfer.write_async(_addr(src), size, target, i * size))
    for job in jobs:
        r = job.result()
        assert job.done() and r["bytes"] == size and r["stats"]["path"] == "bounce"
    reads = []
    targets = [_fake_device(size, i + 1)[1] for i in range(4)]
    for i, dst in enumerate(targets):
        reads.append(transfer.read_async(lazy, i * size, size, _addr(dst)))
    outcomes = [job.outcome() for job in reads]
    failed = [error for result, error in outcomes if error is not None]
    assert len(failed) == 1 and isinstance(failed[0], OSError)  # the 10th engine read
    assert failed[0].errno == errno.EIO and failed[0].filename == str(path)
    for i, (result, error) in enumerate(outcomes):
        if error is None:
            assert result["bytes"] == size and np.array_equal(targets[i], sources[i])
        else:
            for _ in range(2):
                with pytest.raises(OSError):
                    reads[i].result()


def test_ring_write_fault_leaves_bytes_outside_the_range(disk_dir: Path) -> None:
    path = disk_dir / "f.bin"
    before = _rand(1 << 20, 3)
    path.write_bytes(before.tobytes())
    engine = with_faults(
        {"kind": "error", "errno": errno.ENOSPC, "nth": 2, "reads": False},
        _core.Engine,
        backend="threads",
        chunk_size=64 << 10,
    )
    transfer = _core.DeviceTransfer(engine, slots=2, slot_bytes=64 << 10, copier="memcpy")
    f = _core.File.open(str(path), "r+")
    _, src = _fake_device(300000)
    with pytest.raises(OSError) as info:
        transfer.write(_addr(src), 300000, f, 100000)
    assert info.value.errno == errno.ENOSPC
    after = np.frombuffer(path.read_bytes(), dtype=np.uint8)
    assert np.array_equal(after[:100000], before[:100000])
    assert np.array_equal(after[400000:], before[400000:])


def test_transfer_options_are_validated(engine: _core.Engine) -> None:
    with pytest.raises(ValueError, match=r"bounce_slot_size \(TENSORTIER_BOUNCE_SLOT_SIZE\)"):
        _core.DeviceTransfer(engine, slot_bytes=1000, copier="memcpy")
    with pytest.raises(ValueError, match="slots"):
        _core.DeviceTransfer(engine, slots=0, copier="memcpy")
    with pytest.raises(ValueError, match="copier"):
        _core.DeviceTransfer(engine, copier="dma")
    with pytest.raises(ValueError, match="gds"):
        tensortier.IOHandle(gds="maybe")


# ---- without a CUDA driver ------------------------------------------------------------------


@needs_no_driver
def test_cuda_transfer_without_driver_names_libcuda(engine: _core.Engine) -> None:
    with pytest.raises(tensortier.CudaError, match="libcuda.so.1"):
        _core.DeviceTransfer(engine)
    info = tensortier.cuda_info()
    assert info["available"] is False and "libcuda.so.1" in info["why_unavailable"]


@needs_no_driver
def test_pinned_memory_without_driver_names_libcuda() -> None:
    with pytest.raises(tensortier.CudaError, match="libcuda.so.1"):
        tensortier.pinned_empty((4, 4), torch.float32)
    with pytest.raises(tensortier.CudaError, match="libcuda.so.1"):
        tensortier.pin(torch.zeros(10))
    with pytest.raises(tensortier.CudaError, match="libcuda.so.1"):
        _core.PinnedMemory(4096)
    assert issubclass(tensortier.CudaError, RuntimeError)


def test_pinned_memory_is_registered_through_torchs_current_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not GPU 0 always: each rank of a multi-GPU job would make a context there."""
    from tensortier import device as device_module

    devices: list[int] = []

    def fake_pinned_memory(nbytes: int, device: int) -> bytearray:
        devices.append(device)
        return bytearray(nbytes)

    monkeypatch.setattr(device_module._core, "require_cuda_driver", lambda what: None)
    monkeypatch.setattr(device_module._core, "PinnedMemory", fake_pinned_memory)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert tensortier.pinned_empty(16).shape == (16,)
    tensortier.pinned_empty(16, device=1)
    tensortier.pin(torch.zeros(4), device=2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    tensortier.pinned_empty(16)
    assert devices == [3, 1, 2, 0]


def test_pinned_memory_argument_errors() -> None:
    with pytest.raises(ValueError, match="negative"):
        tensortier.pinned_empty((2, -1))
    with pytest.raises(TypeError, match="dtype"):
        tensortier.pinned_empty(3, "float32")
    with pytest.raises(TypeError, match="torch tensor"):
        tensortier.pin(np.zeros(3))


@needs_no_driver
def test_locate_without_driver_says_host() -> None:
    a = np.zeros(10)
    assert _core.locate(_addr(a)) == {"type": "host", "device": -1}


def test_gds_setting_errors_name_where_the_value_came_from(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="gds must be 'off', 'auto' or 'on', not 'sometimes'"):
        tensortier.IOHandle(gds="sometimes")
    with pytest.raises(TypeError, match="gds must be a str .*, not int"):
        tensortier.IOHandle(gds=3)  # type: ignore[arg-type]
    monkeypatch.setenv("TENSORTIER_GDS", "maybe")
    with pytest.raises(ValueError,
                       match=r"TENSORTIER_GDS=maybe is invalid: .*\(allowed: off, auto, on"):
        tensortier.IOHandle()


def test_device_file_gds_modes(disk_dir: Path) -> None:
    f = _core.File.open(str(disk_dir / "g.bin"), "w")
    assert _core.DeviceFile(f, "off").gds_reason == "GDS off"
    with pytest.raises(ValueError, match="gds must be"):
        _core.DeviceFile(f, "sometimes")
    if _core.cufile()["available"]:
        pytest.skip("cuFile is installed here")
    why = _core.cufile()["why_unavailable"]  # no libcufile.so.0, or no driver for it
    auto = _core.DeviceFile(f, "auto")
    assert not auto.gds and auto.gds_reason == f"cuFile unavailable: {why}"
    with pytest.raises(tensortier.CuFileError, match="cuFile unavailable"):
        _core.DeviceFile(f, "on")


@needs_no_driver
def test_real_libcufile_without_a_driver_is_reported_not_opened(
    tmp_path: Path, nvidia_libcufile: Path
) -> None:
    """NVIDIA's libcufile (1.20.0) spun for minutes in cuFileDriverOpen without libcuda.so.1, as
    on a machine with a CUDA build of torch and no GPU: tensortier no longer calls it there."""
    lib = nvidia_libcufile
    env = dict(os.environ, TENSORTIER_CUFILE_LIBRARY=str(lib))
    code = "import tensortier; print(repr(tensortier.cufile_info()))"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, timeout=120,
                         capture_output=True, text=True, check=True).stdout
    info = eval(out)  # noqa: S307 - our own repr of a dict of str and bool
    assert info["library"] == str(lib)
    assert not info["available"]
    assert "no usable CUDA driver" in info["why_unavailable"], info


def test_iohandle_registers_each_file_with_cufile_once(disk_dir: Path) -> None:
    """CUDA transfers of one File share one DeviceFile (one cuFile handle registration); a closed
    File's entry goes at the next lookup, and closing the handle drops them all."""
    with tensortier.IOHandle(gds="auto") as io:
        f = io.open(disk_dir / "c.bin", "w")
        first = io._device.device_file(f)  # noqa: SLF001 - the cache is internal
        assert io._device.device_file(f) is first  # noqa: SLF001
        other = io.open(disk_dir / "c.bin", "r")
        assert io._device.device_file(other) is not first  # noqa: SLF001
        f.close()
        assert io._device.device_file(other) is not None  # noqa: SLF001 - sweeps closed files
        assert f not in io._device  # noqa: SLF001
        assert other in io._device  # noqa: SLF001
    assert len(io._device) == 0  # noqa: SLF001


# ---- compat.gds on CPU storages -------------------------------------------------------------


def test_gds_file_cpu_storages_at_offsets(disk_dir: Path) -> None:
    path = disk_dir / "gds.bin"
    a = torch.randn(1000)
    b = torch.arange(4097, dtype=torch.uint8)
    f = gds.GdsFile(path, os.O_CREAT | os.O_RDWR)
    gds.gds_register_buffer(a.untyped_storage())  # a no-op for host memory
    f.save_storage(a.untyped_storage(), 0)
    f.save_storage(b.untyped_storage(), 4001)
    assert f.last_path == "host"
    gds.gds_deregister_buffer(a.untyped_storage())
    r = gds.GdsFile(str(path), os.O_RDONLY)
    a2 = torch.empty_like(a)
    b2 = torch.empty_like(b)
    r.load_storage(a2.untyped_storage(), 0)
    r.load_storage(b2.untyped_storage(), 4001)
    assert torch.equal(a, a2) and torch.equal(b, b2)
    with pytest.raises(OSError):
        r.save_storage(a.untyped_storage(), 0)  # opened read-only
    # torch's attributes: the descriptor, and the registration (off here: not GDS).
    assert os.fstat(f.fd).st_ino == os.stat(path).st_ino
    assert f.handle.gds is False and f.handle.gds_reason
    r.close()
    f.close()
    assert f.fd == -1 and f.handle is None  # torch's, once closed


def test_gds_file_argument_errors(disk_dir: Path) -> None:
    with pytest.raises(FileNotFoundError):
        gds.GdsFile(disk_dir / "missing.bin", os.O_RDONLY)
    f = gds.GdsFile(disk_dir / "x.bin", os.O_CREAT | os.O_RDWR)
    with pytest.raises(TypeError, match="storage"):
        f.save_storage(torch.zeros(3), 0)
    with pytest.raises(RuntimeError, match="offset"):
        f.save_storage(torch.zeros(3).untyped_storage(), -1)
    with pytest.raises(TypeError, match="flags"):
        gds.GdsFile(disk_dir / "x.bin", "rw")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="storage"):
        gds.gds_register_buffer(torch.zeros(3))
    f.close()
    with pytest.raises(AssertionError, match="not registered"):
        f.load_storage(torch.zeros(3).untyped_storage(), 0)
