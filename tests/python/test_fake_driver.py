"""Pinned host memory from Python against the stand-in CUDA driver (tests/cpp/fake_cuda), built
here with the system's C++ compiler: registration, where the driver says the memory lives, and
that the registration goes when the last tensor does. Each case runs in a subprocess, since the
driver is chosen once per process (``TENSORTIER_CUDA_LIBRARY``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from faults import require_faults

FAKE_SOURCE = Path(__file__).resolve().parents[2] / "tests/cpp/fake_cuda/fake_libcuda.cpp"


@pytest.fixture(scope="module")
def fake_driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stand-in libcuda, compiled once for this module."""
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        pytest.skip("no C++ compiler to build the stand-in CUDA driver")
    out = tmp_path_factory.mktemp("fake-cuda") / "libfakecuda.so"
    subprocess.run(
        [compiler, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-Wall", "-Werror",
         str(FAKE_SOURCE), "-o", str(out)],
        check=True, capture_output=True, text=True, timeout=300,
    )
    return out


def run_with_fake(fake_driver: Path, body: str, tmp_path: Path) -> None:
    """Runs `body` in a fresh interpreter on the stand-in driver; `fake` is the library (ctypes)
    and `check_clean()` asserts nothing is left registered and no misuse was recorded."""
    prologue = textwrap.dedent(
        """
        import ctypes, gc, os, sys
        import torch
        import tensortier
        from tensortier import _core
        fake = ctypes.CDLL(os.environ["TENSORTIER_CUDA_LIBRARY"])
        info = tensortier.cuda_info()
        assert info["available"], info
        start = fake.fakecuda_live()
        def check_clean():
            gc.collect()
            assert fake.fakecuda_live() == start, (fake.fakecuda_live(), start)
            assert fake.fakecuda_violations(None, 0) == 0
        """
    )
    env = dict(os.environ, TENSORTIER_CUDA_LIBRARY=str(fake_driver), TMP_DIR=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-c", prologue + textwrap.dedent(body)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_pinned_empty_is_registered_and_unregistered_with_its_last_tensor(
    fake_driver: Path, tmp_path: Path
) -> None:
    run_with_fake(
        fake_driver,
        """
        t = tensortier.pinned_empty((3, 1001), torch.float32)
        assert t.shape == (3, 1001) and t.dtype == torch.float32
        assert t.data_ptr() % 4096 == 0
        assert _core.locate(t.data_ptr())["type"] == "registered host"
        view = t[1:]          # a view keeps the storage, so the registration
        del t
        gc.collect()
        assert fake.fakecuda_live() > start
        assert _core.locate(view.data_ptr())["type"] == "registered host"
        del view
        check_clean()
        z = tensortier.pinned_empty(0)
        assert z.numel() == 0
        del z
        check_clean()
        """,
        tmp_path,
    )


def test_pin_copies_pageable_tensors_and_keeps_pinned_ones(
    fake_driver: Path, tmp_path: Path
) -> None:
    run_with_fake(
        fake_driver,
        """
        for dtype in (torch.float16, torch.bfloat16, torch.int64, torch.bool):
            src = torch.arange(12345).to(dtype).reshape(5, -1)
            pinned = tensortier.pin(src)
            assert _core.locate(pinned.data_ptr())["type"] == "registered host"
            assert _core.locate(src.data_ptr())["type"] == "host"
            assert pinned.dtype == dtype and pinned.shape == src.shape
            assert torch.equal(pinned, src)
            assert tensortier.pin(pinned) is pinned
            del pinned
        check_clean()
        """,
        tmp_path,
    )


def test_io_handle_moves_pinned_tensors(fake_driver: Path, tmp_path: Path) -> None:
    run_with_fake(
        fake_driver,
        """
        path = os.path.join(os.environ["TMP_DIR"], "pinned.bin")
        io = tensortier.IOHandle()
        src = tensortier.pin(torch.randn(100003))
        io.pwrite(src, path)
        back = tensortier.pinned_empty(100003, torch.float32)
        io.pread(back, path)
        assert torch.equal(src, back)
        io.close()
        del src, back
        check_clean()
        """,
        tmp_path,
    )


def test_io_handle_device_pieces_are_started_and_recorded_in_one_call(
    fake_driver: Path, tmp_path: Path
) -> None:
    """IOHandle's CUDA pieces (a CPU-only torch makes no CUDA tensors: the stand-in's device
    memory is given by address) start with the host ones and are recorded in the same C++ call,
    so Ctrl-C cannot leave one running unrecorded; a piece refused leaves those that started
    recorded, waited for by wait_all(), and raises."""
    run_with_fake(
        fake_driver,
        """
        import ctypes
        from tensortier.io import IOFuture
        ctx = ctypes.c_void_p()
        assert fake.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
        assert fake.cuCtxPushCurrent_v2(ctx) == 0
        def alloc(nbytes):
            p = ctypes.c_uint64()
            assert fake.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(nbytes)) == 0
            return p.value
        def copy(to_device, host, address):
            call = fake.cuMemcpyHtoDAsync_v2 if to_device else fake.cuMemcpyDtoHAsync_v2
            args = ((ctypes.c_uint64(address), ctypes.c_void_p(host.data_ptr()))
                    if to_device else (ctypes.c_void_p(host.data_ptr()), ctypes.c_uint64(address)))
            assert call(*args, ctypes.c_size_t(host.nbytes), None) == 0
            assert fake.cuStreamSynchronize(None) == 0
        path = os.path.join(os.environ["TMP_DIR"], "device.bin")
        n = (1 << 20) + 12  # unaligned
        src = torch.randint(0, 255, (n,), dtype=torch.uint8)
        head = torch.randint(0, 255, (4096,), dtype=torch.uint8)
        dev, dev2 = alloc(n), alloc(n)
        copy(True, src, dev)
        io = tensortier.IOHandle()
        engine, log = io._core(), io._pending
        w = io.open(path, "w")
        fut = log.submit(engine, "write", [(w, head.data_ptr(), head.nbytes, 0)], False, IOFuture,
                         [head], io._device, [(dev, n, 0, None, w, 4096)], [False, True])
        assert fut.wait() == 4096 + n
        with open(path, "rb") as f:
            assert f.read() == head.numpy().tobytes() + src.numpy().tobytes()
        r = io.open(path, "r")
        fut = log.submit(engine, "read", [], False, IOFuture, [], io._device,
                         [(dev2, n, 0, None, r, 4096)], [True])
        assert fut.wait() == n
        back = torch.empty(n, dtype=torch.uint8)
        copy(False, back, dev2)
        assert torch.equal(back, src)
        try:
            log.submit(engine, "read", [], False, IOFuture, [], io._device,
                       [(dev2, n, 0, None, r, 4096), (dev, n, 0, None, "not a File", 0)],
                       [True, True])
            raise AssertionError("a piece that is not a File was started")
        except RuntimeError:
            pass
        assert len(log) == 1  # the piece that started
        io.wait_all()
        assert len(log) == 0
        for pieces, flags in (([], [True]), ([(dev, n, 0, None, r, 0)], [False])):
            try:
                log.submit(engine, "read", [], False, IOFuture, [], io._device, pieces, flags)
                raise AssertionError("on_device that does not match the pieces")
            except ValueError as e:
                assert "on_device" in str(e), e
        io.close()
        del w, r, fut
        for address in (dev, dev2):
            assert fake.cuMemFree_v2(ctypes.c_uint64(address)) == 0
        fake.cuCtxPopCurrent_v2(None)
        fake.cuDevicePrimaryCtxRelease_v2(0)
        check_clean()
        """,
        tmp_path,
    )

# Shared tensors on the stand-in driver: two real processes (a FileStore between them). The
# stand-in's device memory is memfd-backed, so the partitions each rank creates and exports are
# mapped by the other; the ranks write and read device memory through the driver's own copies
# (ctypes), since a CPU-only torch cannot make CUDA tensors (views on "cuda" are checked to say
# so, and run for real in scripts/gpu-test.sh).
SHARED_RANK = """
import ctypes, gc, os, sys
import torch
import torch.distributed as dist
import tensortier
from tensortier import _core, shared
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
fake = ctypes.CDLL(os.environ["TENSORTIER_CUDA_LIBRARY"])
assert tensortier.cuda_info()["available"]
start = fake.fakecuda_live()
store = dist.FileStore(os.environ["STORE_PATH"], world)
group = shared.Group(rank=rank, world_size=world, store=store, timeout=30)

ctx = ctypes.c_void_p()
assert fake.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
assert fake.cuCtxPushCurrent_v2(ctx) == 0
def to_device(address, src):
    assert fake.cuMemcpyHtoDAsync_v2(ctypes.c_uint64(address), ctypes.c_void_p(src.data_ptr()),
                                     ctypes.c_size_t(src.numel() * src.element_size()), None) == 0
    assert fake.cuStreamSynchronize(None) == 0
def from_device(dst, address):
    assert fake.cuMemcpyDtoHAsync_v2(ctypes.c_void_p(dst.data_ptr()), ctypes.c_uint64(address),
                                     ctypes.c_size_t(dst.numel() * dst.element_size()), None) == 0
    assert fake.cuStreamSynchronize(None) == 0
"""


def run_ranks_with_fake(fake_driver: Path, body: str, tmp_path: Path, world: int = 2) -> None:
    env = dict(os.environ, TENSORTIER_CUDA_LIBRARY=str(fake_driver), WORLD_SIZE=str(world),
               STORE_PATH=str(tmp_path / "store"))
    env.pop("FAKE_CUDA_GRANULARITY", None)
    code = textwrap.dedent(SHARED_RANK) + textwrap.dedent(body)
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=dict(env, RANK=str(r)),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(world)
    ]
    errors = []
    try:
        for r, p in enumerate(procs):
            _, err = p.communicate(timeout=240)
            if p.returncode != 0:
                errors.append(f"rank {r} exited {p.returncode}:\n{err[-3000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert not errors, "\n".join(errors)


# One pair of ranks per layout runs every dtype: each run of two fresh interpreters costs seconds
# of torch imports, each dtype a few milliseconds.
@pytest.mark.parametrize("layout", ["continuous", "chunked"])
def test_device_shared_tensor_writes_are_seen_by_every_rank(
    fake_driver: Path, tmp_path: Path, layout: str
) -> None:
    run_ranks_with_fake(
        fake_driver,
        f"""
        layout = {layout!r}
        for dtype in (torch.float32, torch.bfloat16, torch.int8, torch.float64):
            rows, cols = 3001, 5                   # unequal partitions
            t = group.create_tensor((rows, cols), dtype, device="cuda", layout=layout)
            assert t.memory == "device" and t.layout == layout
            st = t.stats
            assert st["device"] == 0 and st["granularity"] == 2 << 20 and not st["cuda_registered"]
            parts = t._core.partitions
            assert sum(p[2] for p in parts) == rows
            full = (torch.arange(rows * cols) % 100).to(dtype).reshape(rows, cols)
            _, begin, n, nbytes, address = parts[rank]
            if n:
                to_device(address, full[begin:begin + n].contiguous())
            group.barrier()
            for _, begin, n, nbytes, address in parts:
                if n:
                    back = torch.empty((n, cols), dtype=dtype)
                    from_device(back, address)
                    assert torch.equal(back, full[begin:begin + n]), (rank, begin)
            # Without torch CUDA, CUDA views and row access say why; host buffers are refused.
            for call in (lambda: t.view("cuda"), lambda: t.gather([0]), lambda: t.local()):
                try:
                    call()
                    raise AssertionError("a CUDA view on a CPU-only torch")
                except RuntimeError as e:
                    assert "no CUDA" in str(e), e
            try:
                t.view("cpu")
                raise AssertionError("a CPU view of device memory")
            except ValueError as e:
                assert "device memory" in str(e), e
            group.barrier()  # every rank has read every partition
            t.close()
        group.barrier()
        group.close()
        gc.collect()
        fake.cuCtxPopCurrent_v2(None)
        fake.cuDevicePrimaryCtxRelease_v2(0)
        assert fake.fakecuda_live() == start, (fake.fakecuda_live(), start)
        assert fake.fakecuda_violations(None, 0) == 0
        """,
        tmp_path,
    )


def test_device_shared_tensor_rows_go_to_and_from_files(fake_driver: Path, tmp_path: Path) -> None:
    """load_files and store_files of device memory move each rank's rows between its files and
    its GPU through page-locked memory, in C++: no CUDA in torch is needed. The slab is made
    small (the test seam): several per rank, the last one short."""
    require_faults()
    run_ranks_with_fake(
        fake_driver,
        """
        from tensortier import _testing
        _testing.set_device_slab_bytes(4096)
        rows, cols = 3001, 5                   # unequal partitions
        full = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
        path = os.environ["STORE_PATH"] + ".rows"
        if rank == 0:
            full.numpy().tofile(path)
        group.barrier()
        t = group.create_tensor((rows, cols), torch.float32, device="cuda", layout="chunked")
        copies_in = fake.fakecuda_calls(b"cuMemcpyHtoDAsync_v2")
        t.load_files(path)
        _, begin, n, nbytes, address = t._core.partitions[rank]
        assert fake.fakecuda_calls(b"cuMemcpyHtoDAsync_v2") - copies_in >= nbytes // 4096
        back = torch.empty((n, cols), dtype=torch.float32)
        from_device(back, address)
        assert torch.equal(back, full[begin:begin + n]), rank
        copies_out = fake.fakecuda_calls(b"cuMemcpyDtoHAsync_v2")
        names = t.store_files(path + ".out")
        assert fake.fakecuda_calls(b"cuMemcpyDtoHAsync_v2") - copies_out >= nbytes // 4096
        stored = b"".join(open(name, "rb").read() for name in names)
        assert torch.equal(torch.frombuffer(bytearray(stored), dtype=torch.float32), full.view(-1))
        group.barrier()
        group.close()
        del t
        gc.collect()
        fake.cuCtxPopCurrent_v2(None)
        fake.cuDevicePrimaryCtxRelease_v2(0)
        assert fake.fakecuda_live() == start, (fake.fakecuda_live(), start)
        assert fake.fakecuda_violations(None, 0) == 0
        """,
        tmp_path,
    )


def test_host_shared_tensor_is_registered_with_cuda(fake_driver: Path, tmp_path: Path) -> None:
    run_ranks_with_fake(
        fake_driver,
        """
        before = fake.fakecuda_calls(b"cuMemHostRegister")
        t = group.create_tensor((4096, 3), torch.int32)
        assert t.stats["cuda_registered"], t.stats["cuda_registered_reason"]
        for _, begin, n, nbytes, address in t._core.partitions:
            if n:
                assert _core.locate(address)["type"] == "registered host"
        assert fake.fakecuda_calls(b"cuMemHostRegister") - before == 2
        t.local()[0][:] = rank + 1
        group.barrier()
        assert int(t.view()[0, 0]) == 1 and int(t.view()[-1, 0]) == 2
        if not torch.cuda.is_available():  # with CUDA, torch's own driver is not the fake
            try:
                t.view("cuda")
                raise AssertionError("a CUDA view on a CPU-only torch")
            except RuntimeError as e:
                assert "no CUDA" in str(e), e
        group.barrier()
        unregisters = fake.fakecuda_calls(b"cuMemHostUnregister")
        del t
        group.close()
        gc.collect()
        assert fake.fakecuda_calls(b"cuMemHostUnregister") - unregisters == 2
        fake.cuCtxPopCurrent_v2(None)
        fake.cuDevicePrimaryCtxRelease_v2(0)
        assert fake.fakecuda_live() == start, (fake.fakecuda_live(), start)
        """,
        tmp_path,
    )


def test_wholememory_device_memory_on_cpu_only_torch_says_why(
    fake_driver: Path, tmp_path: Path
) -> None:
    run_ranks_with_fake(
        fake_driver,
        """
        from tensortier.compat import wholememory as wm
        wm.init_lib()
        wm.mp_init(rank, world, store=store)
        try:
            wm.create_tensor([10, 4], [], torch.float32, False, [])
            raise AssertionError("is_host=False on a CPU-only torch")
        except RuntimeError as e:
            assert "no CUDA" in str(e), e
        t = wm.create_tensor([10, 4], [], torch.float32, True, [])
        assert wm.get_tensor_view(t, torch.device("cpu")).data_ptr() == t.data_ptr()
        wm.finalize_lib()
        fake.cuCtxPopCurrent_v2(None)
        fake.cuDevicePrimaryCtxRelease_v2(0)
        """,
        tmp_path,
    )


def test_file_reader_pins_its_arenas_and_lets_them_go(fake_driver: Path, tmp_path: Path) -> None:
    # What device="cuda" needs short of a GPU: batches in page-locked, CUDA-registered arenas
    # (the one copy to the device is torch's); the copy itself needs a torch built with CUDA.
    run_with_fake(
        fake_driver,
        """
        import numpy as np
        from tensortier.data import FileReader
        root = os.path.join(os.environ["TMP_DIR"], "set")
        os.makedirs(os.path.join(root, "c0"))
        want = []
        for i, size in enumerate([0, 1, 4095, 4097, 70001, 200003]):
            data = np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()
            with open(os.path.join(root, "c0", f"{i}.jpg"), "wb") as f:
                f.write(data)
            want.append(data)
        reader = FileReader(file_root=root, batch_size=4, shuffle=False, pin_memory=True)
        got = []
        for epoch in range(2):
            for batch in reader.batches():
                assert batch.pinned
                arena = np.frombuffer(batch, dtype=np.uint8)
                where = _core.locate(arena.ctypes.data)
                assert where["type"] == "registered host", where
                samples, labels = reader._tensors(batch)
                got.extend(bytes(s.numpy()) for s in samples)
                del arena, samples, labels, batch
        assert got == want * 2
        assert fake.fakecuda_live() > start
        reader.close()
        del reader
        check_clean()
        if not torch.cuda.is_available():
            try:
                FileReader(file_root=root, device="cuda")
            except ValueError as e:
                assert "CUDA" in str(e), e
            else:
                raise AssertionError("device='cuda' without CUDA in torch was accepted")
        """,
        tmp_path,
    )
