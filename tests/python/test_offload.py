"""DiskOffloader: TensorNVMe's API and examples, data safety under faults, cleanup."""

from __future__ import annotations

import errno
import gc
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tensortier
from tensortier import DiskOffloader
from tensortier.compat import tensornvme
from tensortier.offload import OffloadedDataLostWarning, remove_stale_files

from conftest import exits_cleanly, INTERRUPTED_CALLS, INTERRUPTED_POINTS, require_backend
from faults import with_faults

BACKENDS = ["io_uring", "libaio", "threads"]

ALL_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random bits of any dtype (so every byte pattern, NaNs included, must survive)."""
    g = torch.Generator().manual_seed(seed)
    nbytes = torch.empty(shape, dtype=dtype).numel() * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw & 1
    return raw.view(dtype).reshape(shape).clone()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def offloaded(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() == 0


# How the offloader moves CPU tensors here: "cuda" is the default (the engine, straight from the
# tensor's memory); "memcpy" sends them down the path of CUDA tensors (the bounce ring, worker
# threads, Begin/Finish in the C++ offloader) with memcpy for the device copies, so that path
# runs without a GPU.
COPIERS = [pytest.param("cuda", id="host"), pytest.param("memcpy", id="device-path")]


@pytest.fixture(params=COPIERS)
def copier(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def off(disk_dir: Path, copier: str):  # type: ignore[no-untyped-def]
    with DiskOffloader(disk_dir / "offload", _device_copier=copier) as o:
        yield o


# ---- TensorNVMe's README examples, unchanged apart from the import -------------------------


def test_readme_sync_example(disk_dir: Path) -> None:
    DiskOffloader_ = tensornvme.DiskOffloader
    x = torch.rand(2, 2)
    y = torch.rand(4, 4, 4)
    x0, y0 = x.clone(), y.clone()
    offloader = DiskOffloader_(str(disk_dir / "offload"))
    offloader.sync_write(x)
    # x is saved to a file on disk (in ./offload folder) and the memory of x is freed
    assert offloaded(x) and x.shape == (2, 2)
    offloader.sync_read(x)
    # x is restored
    assert torch.equal(x, x0)
    offloader.sync_writev([x, y])
    # x and y are offloaded
    assert offloaded(x) and offloaded(y)
    offloader.sync_readv([x, y])
    # x and y are restored.
    assert torch.equal(x, x0) and torch.equal(y, y0)
    offloader.close()


def test_readme_async_example(disk_dir: Path) -> None:
    offloader = tensornvme.DiskOffloader(str(disk_dir / "offload"))
    x = torch.rand(2, 2)
    y = torch.rand(4, 4, 4)
    x0, y0 = x.clone(), y.clone()
    offloader.async_writev([x, y])
    # Write requests are submitted, but are not executed
    offloader.sync_write_events()
    # Wait for write requests to finish
    assert offloaded(x) and offloaded(y)
    offloader.async_readv([x, y])
    # Read requests are submitted, but are not executed
    offloader.sync_read_events()
    # Wait for read requests to finish
    assert torch.equal(x, x0) and torch.equal(y, y0)
    offloader.close()


def test_readme_overlap_example(disk_dir: Path) -> None:
    offloader = tensornvme.DiskOffloader(str(disk_dir / "offload"))
    tensors = []
    for _ in range(10):
        tensor = torch.rand(2, 2)
        tensors.append(tensor)
    expected = [t.clone() * 2.0 for t in tensors]
    for tensor in tensors:
        offloader.sync_write(tensor)

    offloader.sync_read(tensors[0])

    # prefetch=1, writing tensor[i] and reading tensor[i+1]
    for i, tensor in enumerate(tensors):
        offloader.sync_read_events()
        if i + 1 < len(tensors):
            offloader.async_read(tensors[i + 1])
        tensor.mul_(2.0)
        offloader.sync_write_events()
        offloader.async_write(tensor)
    offloader.synchronize()

    assert all(offloaded(t) for t in tensors)
    for t, e in zip(tensors, expected):
        offloader.sync_read(t)  # as written: one at a time (TensorNVMe keys each by the call)
        assert torch.equal(t, e)
    offloader.close()


def test_tensornvme_backend_names_and_get_backends(disk_dir: Path) -> None:
    assert tensornvme.get_backends() <= {"uring", "aio", "pthread"}
    assert "pthread" in tensornvme.get_backends()
    for name in tensornvme.get_backends():
        with tensornvme.DiskOffloader(str(disk_dir / name), 8, name) as o:
            x = torch.arange(1000.0)
            o.sync_write(x)
            o.sync_read(x)
            assert torch.equal(x, torch.arange(1000.0))


# ---- data --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype(off: DiskOffloader, dtype: torch.dtype) -> None:
    x = random_tensor((3, 1001), dtype, seed=hash(str(dtype)) % 1000)
    x0 = x.clone()
    off.sync_write(x)
    assert offloaded(x) and x.dtype == dtype and x.shape == (3, 1001)
    off.sync_read(x)
    assert same_bytes(x, x0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("numel", [0, 1, 4095, 4096, 4097, (1 << 20) + 3])
def test_sizes_on_every_backend(disk_dir: Path, backend: str, numel: int) -> None:
    require_backend(backend)
    with DiskOffloader(disk_dir, backend=backend) as o:
        x = random_tensor((numel,), torch.uint8, seed=numel)
        x0 = x.clone()
        o.sync_write(x)
        assert offloaded(x) and x.numel() == numel
        assert o.stored_bytes == numel
        o.sync_read(x)
        assert same_bytes(x, x0)
        o.trim()
        assert o.stored_bytes == 0 and o.file_bytes == 0


def test_zero_element_tensors(off: DiskOffloader) -> None:
    for shape in [(0,), (3, 0, 2)]:
        x = torch.empty(shape)
        off.sync_write(x)
        assert off.is_offloaded(x)
        off.sync_read(x)
        assert x.shape == shape and not off.is_offloaded(x)


def test_one_byte_tensor(off: DiskOffloader) -> None:
    x = torch.tensor(7, dtype=torch.uint8)  # a 0-d tensor of one byte
    off.sync_write(x)
    off.sync_read(x)
    assert x.item() == 7


def test_several_gib_tensor(disk_dir: Path) -> None:
    """A tensor past 4 GiB: offsets and lengths above 32 bits everywhere."""
    n = (4 << 30) + 4097
    x = torch.zeros(n, dtype=torch.uint8)
    marks = [0, 4095, 1 << 31, (1 << 32) - 1, 1 << 32, n - 1]
    for i, pos in enumerate(marks):
        x[pos] = i + 1
    with DiskOffloader(disk_dir) as o:
        o.sync_write(x)
        assert offloaded(x) and o.stored_bytes == n
        o.sync_read(x)
        assert x.numel() == n
        for i, pos in enumerate(marks):
            assert x[pos].item() == i + 1
        assert int(torch.count_nonzero(x)) == len(marks)
    del x


def test_views_of_the_same_storage_see_restored_memory(off: DiskOffloader) -> None:
    x = torch.arange(100.0)
    alias = x.view(10, 10)
    off.sync_write(x)
    off.sync_read(x)
    assert torch.equal(alias.flatten(), torch.arange(100.0))


def test_parameter_with_grad(off: DiskOffloader) -> None:
    p = torch.nn.Parameter(torch.randn(64, 64))
    p0 = p.detach().clone()
    off.sync_write(p)
    off.sync_read(p)
    assert torch.equal(p.detach(), p0) and p.requires_grad


def test_readv_in_any_order(off: DiskOffloader) -> None:
    ts = [torch.full((1000 + i,), float(i)) for i in range(5)]
    off.sync_writev(ts)
    off.sync_readv(list(reversed(ts)))
    for i, t in enumerate(ts):
        assert torch.equal(t, torch.full((1000 + i,), float(i)))


def test_space_is_reused_and_given_back(off: DiskOffloader) -> None:
    ts = [torch.randn(256, 1024) for _ in range(4)]
    off.sync_writev(ts)
    high = off.file_bytes
    for _ in range(5):
        off.sync_read(ts[1])
        off.sync_write(ts[1])
        assert off.file_bytes == high
    off.sync_readv(ts)
    off.trim()
    assert off.file_bytes == 0 and off.stored_bytes == 0
    assert all(os.path.getsize(p) == 0 for p in off.paths)


def test_freed_tail_goes_back_to_the_filesystem_when_idle(off: DiskOffloader) -> None:
    x = torch.randn(1 << 20)
    off.sync_write(x)
    off.sync_read(x)
    path = off.paths[0]
    deadline = time.monotonic() + 20
    while (os.path.getsize(path) or off.file_bytes) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.path.getsize(path) == 0 and off.file_bytes == 0


def test_bounce_buffers_go_back_once_the_offloader_is_idle(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Offloading is done to get memory back: the engine keeps no burst of bounce buffers
    after a transfer (bounce_idle_ms 0), unless TENSORTIER_BOUNCE_IDLE_MS says otherwise."""
    monkeypatch.delenv("TENSORTIER_BOUNCE_IDLE_MS", raising=False)
    with DiskOffloader(disk_dir / "offload") as o:
        core = o._core
        assert core is not None
        options = core.engine_options
        assert options["bounce_idle_ms"] == 0
        # 16 chunks from an odd address: every chunk goes through a bounce buffer.
        src = random_tensor((16 * options["chunk_size"] + 1,), torch.uint8)
        core.write([(1, src.data_ptr() + 1, src.numel() - 1)])
        assert core.wait("write") == [(1, None)]
        kept = 2 * options["workers"] * options["chunk_size"]
        assert core.bounce_allocations * options["chunk_size"] > kept  # more than an idle engine keeps
        deadline = time.monotonic() + 20
        while core.bounce_bytes > kept and time.monotonic() < deadline:
            time.sleep(0.002)
        assert core.bounce_bytes <= kept
        dst = torch.empty_like(src)
        core.read([(1, dst.data_ptr() + 1, dst.numel() - 1)])
        assert core.wait("read") == [(1, None)]
        assert torch.equal(dst[1:], src[1:])
    monkeypatch.setenv("TENSORTIER_BOUNCE_IDLE_MS", "250")
    with DiskOffloader(disk_dir / "offload") as o:
        assert o._core is not None and o._core.engine_options["bounce_idle_ms"] == 250


def test_striping_over_several_directories(
    disk_dir: Path, copier: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TENSORTIER_BOUNCE_RINGS", raising=False)
    dirs = [disk_dir / f"nvme{i}" for i in range(3)]
    with DiskOffloader(dirs, stripe_threshold=1 << 20, _device_copier=copier) as o:
        big = random_tensor(((3 << 20) + 5,), torch.uint8, seed=3)
        big0 = big.clone()
        o.sync_write(big)
        assert len(o.paths) == 3
        assert all(os.path.getsize(p) > 0 for p in o.paths)
        assert all(Path(p).parent in dirs for p in o.paths)
        o.sync_read(big)
        assert same_bytes(big, big0)
        if copier == "memcpy":  # a ring per directory: the three parts move at once
            assert o._device.transfer is not None and o._device.transfer.options["max_rings"] == 3


def test_space_of_a_tensor_released_by_the_wait_is_freed_by_it(off: DiskOffloader) -> None:
    """A tensor whose last reference was the offloader's (dropped by the caller while its write
    ran) dies inside the wait, under the lock: the wait itself frees its space."""
    x = torch.randn(1 << 16)
    off.async_write(x)
    del x
    off.sync_write_events()
    assert off._core is not None and off._core.stored_bytes == 0  # not through a draining call



def test_the_core_names_the_kinds_of_operation(disk_dir: Path) -> None:
    """The extension's words for the kinds an offloader waits on; anything else is named."""
    with DiskOffloader(disk_dir) as o:
        assert o._core is not None
        assert o._core.wait("write") == [] and o._core.wait("read") == []
        with pytest.raises(ValueError, match=r"^kind must be 'write' or 'read', not 'Write'$"):
            o._core.wait("Write")

def test_device_path_moves_bytes_through_the_ring(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The path of CUDA tensors: no engine operation of the offloader's own, the ring's pinned
    slots made once and reused, outcomes collected by the waits (a read of a tensor whose write
    is in flight waits for it)."""
    monkeypatch.delenv("TENSORTIER_BOUNCE_RINGS", raising=False)
    with DiskOffloader(disk_dir, _device_copier="memcpy") as o:
        xs = [random_tensor((n,), torch.uint8, seed=n) for n in (1, 4097, (1 << 20) + 3)]
        refs = [x.clone() for x in xs]
        done: list[str] = []
        o.async_writev(xs, callback=lambda: done.append("w"))
        assert o._core is not None and o._core.wait("write") == []  # none went to the engine
        o.sync_read(xs[0])  # waits for the writes first
        assert done == ["w"] and same_bytes(xs[0], refs[0])
        assert all(offloaded(x) for x in xs[1:]) and o.stored_bytes == 4097 + (1 << 20) + 3
        transfer = o._device.transfer
        assert transfer is not None and transfer.rings >= 1
        pinned = transfer.options["pinned_bytes"]
        assert pinned > 0
        o.async_readv(xs[1:], callback=lambda: done.append("r"))
        o.sync_read_events()
        assert done == ["w", "r"] and o.stored_bytes == 0
        assert all(same_bytes(x, r) for x, r in zip(xs, refs))
        for _ in range(3):  # the same transfer; rings are made up to its budget, then reused
            o.sync_writev(xs)
            o.sync_readv(xs)
        options = transfer.options
        assert o._device.transfer is transfer and options["max_rings"] == 2
        # Two transfers at once make a second ring (64 MiB each by default), never more.
        assert 1 <= transfer.rings <= 2 and pinned <= options["pinned_bytes"]
        assert options["pinned_bytes"] == transfer.rings * options["slots"] * options["slot_bytes"]
        moved = 2 * 4 * sum(x.numel() for x in xs)  # each tensor written and read 4 times
        assert o.device_bytes == {"bounce": moved}


def test_a_tensor_dying_while_another_thread_holds_the_lock_is_freed_later(
    off: DiskOffloader,
) -> None:
    """The finalizer of a tensor that died offloaded may run on a device worker (garbage
    collection) while the waiting thread holds the lock: it must not block there."""
    x = torch.randn(1 << 16)
    off.sync_write(x)
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with off._lock:
            held.set()
            release.wait(10)

    t = threading.Thread(target=holder)
    t.start()
    held.wait(10)
    start = time.monotonic()
    del x
    gc.collect()  # the finalizer runs here, on this thread, while `holder` has the lock
    assert time.monotonic() - start < 5
    release.set()
    t.join()
    assert off.stored_bytes == 0  # freed by the next call that takes the lock
    # On the thread holding the lock (a collection inside the offloader's own code, which may be
    # iterating its entries): left alone there too.
    y = torch.randn(1 << 16)
    off.sync_write(y)
    with off._lock:
        entries = len(off._entries)
        del y
        gc.collect()
        assert len(off._entries) == entries and off._entries.forgotten == 2  # tensor, storage
    assert off.stored_bytes == 0 and not off._entries


def test_close_applies_outcomes_not_waited_for(
    disk_dir: Path, copier: str, recwarn: pytest.WarningsRecorder
) -> None:
    """A read that failed and was never waited for leaves no tensor with unspecified bytes
    behind: close() applies it (memory freed again) and says so."""
    fault = {"kind": "error", "errno": errno.EIO, "nth": 1, "count": 1, "writes": False}
    o = with_faults(fault, DiskOffloader, disk_dir, backend="threads", _device_copier=copier)
    x, y = torch.randn(100_000), torch.randn(1000)
    o.sync_writev([x, y])
    o.async_read(x)  # fails: x's memory, allocated for it, holds no data
    o.close()
    assert offloaded(x) and offloaded(y)  # both stayed offloaded; the data went with the files
    messages = [str(w.message) for w in recwarn
                if issubclass(w.category, OffloadedDataLostWarning)]
    assert any("2 tensor(s) still offloaded" in m and "1 operation(s)" in m for m in messages)


def test_gds_mode_is_checked_and_on_without_cufile_fails_keeping_the_tensor(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match="gds must be"):
        DiskOffloader(disk_dir, gds="sometimes")
    monkeypatch.setenv("TENSORTIER_GDS", "maybe")
    with pytest.raises(ValueError, match="TENSORTIER_GDS"):
        DiskOffloader(disk_dir)
    monkeypatch.setenv("TENSORTIER_GDS", "on")
    if tensortier.cufile_info()["available"]:
        pytest.skip("cuFile is usable here: 'on' would not fail")
    # "on" needs cuFile for every backing file; without it the write fails and nothing is lost.
    with DiskOffloader(disk_dir, _device_copier="memcpy") as o:
        x = random_tensor((100_000,), torch.uint8, seed=9)
        x0 = x.clone()
        with pytest.raises(tensortier.CuFileError, match="cuFile"):
            o.sync_write(x)
        assert not offloaded(x) and same_bytes(x, x0)
        assert not o.is_offloaded(x) and o.stored_bytes == 0 and o.device_bytes == {}


def test_tensor_that_dies_while_offloaded_frees_its_space(off: DiskOffloader) -> None:
    x = torch.randn(1 << 16)
    off.sync_write(x)
    assert off.stored_bytes == x.numel() * 4
    del x
    gc.collect()
    off.trim()
    assert off.stored_bytes == 0 and off.file_bytes == 0


def test_async_operations_keep_tensors_alive(off: DiskOffloader) -> None:
    off.async_write(torch.randn(1 << 18))  # nobody else holds this tensor
    gc.collect()
    off.sync_write_events()
    x = torch.randn(1 << 18)
    x0 = x.clone()
    off.sync_write(x)
    off.async_read(x)
    ref = [x]
    del x
    gc.collect()
    off.sync_read_events()
    assert torch.equal(ref[0], x0)


def test_callbacks_run_after_the_wait(off: DiskOffloader) -> None:
    calls = []
    x = torch.randn(100)
    off.async_write(x, callback=lambda: calls.append(("w", offloaded(x))))
    assert calls == []
    off.sync_write_events()
    assert calls == [("w", True)]
    off.async_read(x, callback=lambda: calls.append(("r", offloaded(x))))
    off.synchronize()
    assert calls[-1] == ("r", False)


def test_random_interleavings_match_a_model(disk_dir: Path, copier: str) -> None:
    """Random async/sync operations on a pool of tensors, checked against what each should hold.

    Model states: mem (resident), w (write in flight), off (offloaded), r (read in flight).
    """
    rng = random.Random(1234)
    with DiskOffloader(disk_dir, n_entries=4, _device_copier=copier) as o:
        pool = [torch.randn(rng.randint(0, 70000)) for i in range(8)]
        want = [t.clone() for t in pool]
        state = ["mem"] * len(pool)

        def wait(kind: str) -> None:
            for i, s in enumerate(state):
                if kind == "write" and s == "w":
                    state[i] = "off"
                if kind == "read" and s == "r":
                    state[i] = "mem"

        for step in range(600):
            i = rng.randrange(len(pool))
            t = pool[i]
            op = rng.choice(["aw", "ar", "sw", "sr", "we", "re", "sync", "touch", "awv", "arv"])
            if op in ("aw", "sw"):
                if state[i] in ("w", "off"):
                    with pytest.raises(ValueError):
                        (o.async_write if op == "aw" else o.sync_write)(t)
                    continue
                if state[i] == "r":
                    wait("read")
                (o.async_write if op == "aw" else o.sync_write)(t)
                # A sync call waits for its own tensor only, as TensorNVMe's.
                state[i] = "w" if op == "aw" else "off"
            elif op in ("ar", "sr"):
                if state[i] in ("mem", "r"):
                    with pytest.raises(ValueError):
                        (o.async_read if op == "ar" else o.sync_read)(t)
                    continue
                if state[i] == "w":
                    wait("write")
                (o.async_read if op == "ar" else o.sync_read)(t)
                state[i] = "r" if op == "ar" else "mem"
            elif op in ("awv", "arv"):
                ok = "mem" if op == "awv" else "off"
                picks = [j for j in rng.sample(range(len(pool)), 3) if state[j] == ok]
                (o.async_writev if op == "awv" else o.async_readv)([pool[j] for j in picks])
                for j in picks:
                    state[j] = "w" if op == "awv" else "r"
            elif op == "we":
                o.sync_write_events()
                wait("write")
            elif op == "re":
                o.sync_read_events()
                wait("read")
            elif op == "sync":
                o.synchronize()
                wait("write")
                wait("read")
            elif op == "touch" and state[i] == "mem":
                t.add_(1.0)
                want[i].add_(1.0)
            for j, s in enumerate(state):
                if s == "mem":
                    assert torch.equal(pool[j], want[j]), (step, j)
                elif s == "off":
                    assert offloaded(pool[j]) or pool[j].numel() == 0, (step, j)
        o.synchronize()
        wait("write")
        wait("read")
        for j, s in enumerate(state):
            if s == "off":
                o.sync_read(pool[j])
            assert torch.equal(pool[j], want[j])


# ---- faults: nothing is ever lost ------------------------------------------------------------


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC])
@pytest.mark.parametrize("backend", BACKENDS)
def test_failed_write_keeps_memory_and_data(
    disk_dir: Path, backend: str, code: int, copier: str
) -> None:
    require_backend(backend)
    fault = {"kind": "error", "errno": code, "nth": 1, "count": 1, "reads": False}
    with with_faults(fault, DiskOffloader, disk_dir, backend=backend, _device_copier=copier) as o:
        x = torch.randn(300_000)
        x0 = x.clone()
        with pytest.raises(OSError) as e:
            o.sync_write(x)
        assert e.value.errno == code
        assert not offloaded(x) and torch.equal(x, x0)
        assert not o.is_offloaded(x) and o.stored_bytes == 0
        o.sync_write(x)  # the fault was one-shot: the offloader is still usable
        o.sync_read(x)
        assert torch.equal(x, x0)


def test_failed_async_write_raises_on_the_wait(disk_dir: Path, copier: str) -> None:
    fault = {"kind": "error", "errno": errno.EIO, "nth": 2, "count": 1, "reads": False}
    with with_faults(fault, DiskOffloader, disk_dir, backend="threads", _device_copier=copier) as o:
        xs = [torch.full((10_000,), float(i)) for i in range(3)]
        for x in xs:
            o.async_write(x)
        with pytest.raises(OSError) as e:
            o.sync_write_events()
        assert e.value.errno == errno.EIO
        kept = [x for x in xs if not offloaded(x)]
        assert len(kept) == 1 and not o.is_offloaded(kept[0])
        for i, x in enumerate(xs):
            if not offloaded(x):
                assert torch.equal(x, torch.full((10_000,), float(i)))
            else:
                o.sync_read(x)
                assert torch.equal(x, torch.full((10_000,), float(i)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_failed_read_keeps_the_data_on_disk(disk_dir: Path, backend: str, copier: str) -> None:
    require_backend(backend)
    fault = {"kind": "error", "errno": errno.EIO, "nth": 1, "count": 1, "writes": False}
    with with_faults(fault, DiskOffloader, disk_dir, backend=backend, _device_copier=copier) as o:
        x = torch.randn(300_000)
        x0 = x.clone()
        o.sync_write(x)
        with pytest.raises(OSError) as e:
            o.sync_read(x)
        assert e.value.errno == errno.EIO
        assert offloaded(x) and o.is_offloaded(x)
        o.sync_read(x)
        assert torch.equal(x, x0)


def test_short_io_is_completed(disk_dir: Path, copier: str) -> None:
    fault = {"kind": "short", "nth": 1, "count": 1000, "short_bytes": 1000}
    with with_faults(fault, DiskOffloader, disk_dir, backend="threads", _device_copier=copier) as o:
        x = random_tensor((1 << 20,), torch.uint8, seed=5)
        x0 = x.clone()
        o.sync_write(x)
        o.sync_read(x)
        assert same_bytes(x, x0)


def test_backing_file_cut_short_is_an_error_not_garbage(off: DiskOffloader) -> None:
    x = torch.randn(100_000)
    off.sync_write(x)
    os.truncate(off.paths[0], 1000)
    with pytest.raises(OSError) as e:
        off.sync_read(x)
    assert e.value.errno == errno.EIO and off.is_offloaded(x)


# ---- bad input -----------------------------------------------------------------------------


def test_bad_input(off: DiskOffloader, disk_dir: Path) -> None:
    with pytest.raises(ValueError, match="not contiguous"):
        off.sync_write(torch.randn(10, 10).t())
    with pytest.raises(ValueError, match="view"):
        off.sync_write(torch.randn(100)[10:20])
    with pytest.raises(TypeError, match="torch tensors"):
        off.sync_write(bytearray(10))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not offloaded"):
        off.sync_read(torch.randn(10))
    x = torch.randn(10)
    off.sync_write(x)
    with pytest.raises(ValueError, match="already offloaded"):
        off.sync_write(x)
    with pytest.raises(ValueError, match="twice"):
        off.sync_writev([torch.randn(3)] * 2)
    with pytest.raises(ValueError, match="resized"):
        import numpy as np

        off.sync_write(torch.from_numpy(np.zeros(1000, dtype=np.float32)))
    # A copy would share the engine, and dropping it would close it under the original.
    import copy

    for copier in (copy.copy, copy.deepcopy):
        with pytest.raises(TypeError,
                           match="DiskOffloader cannot be pickled or copied: it owns its files"):
            copier(off)
    # Shared memory says it resizes, and torch's resize_ of it crashes the process (the read
    # back did): refused before anything is written.
    shared = torch.arange(1000, dtype=torch.float32).share_memory_()
    with pytest.raises(ValueError, match="shared memory .*use .clone"):
        off.sync_write(shared)
    assert shared.untyped_storage().nbytes() == 4000 and shared[999] == 999
    with pytest.raises(ValueError, match="backend"):
        DiskOffloader(disk_dir / "never", backend="spdk")
    low, high = tensortier._core.setting_range("TENSORTIER_QUEUE_DEPTH")
    for entries in (0, -1, high + 1, 1 << 40, 1 << 64):
        with pytest.raises(ValueError, match=f"n_entries must be from {low} to {high} .*, not "):
            DiskOffloader(disk_dir / "never", n_entries=entries)
    for entries in (True, 1.0, "16", None):
        with pytest.raises(TypeError, match=f"n_entries must be an integer from {low} to {high}"):
            DiskOffloader(disk_dir / "never", n_entries=entries)  # type: ignore[arg-type]
    for gds in (3, True, b"on"):
        with pytest.raises(TypeError, match="gds must be a str"):
            DiskOffloader(disk_dir, gds=gds)  # type: ignore[arg-type]
    with DiskOffloader(disk_dir / "edges", n_entries=high) as edge:
        t = torch.randn(5)
        edge.sync_write(t)
        edge.sync_read(t)
    # Not pybind's "incompatible constructor arguments" listing: the argument, and what it takes.
    for threshold in (0, -1, 1.5, True, "16M", 1 << 64):
        with pytest.raises(ValueError, match="stripe_threshold must be a positive integer"):
            DiskOffloader(disk_dir / "never", stripe_threshold=threshold)
    assert not (disk_dir / "never").exists()  # refused before anything was made
    off.close()
    with pytest.raises(ValueError, match="closed"):
        off.sync_write(torch.randn(3))


def test_a_dir_name_that_is_no_directory_says_so(tmp_path: Path) -> None:
    """Not makedirs's "File exists" (which reads as if all were well) nor "'NoneType' object is
    not iterable"."""
    a_file = tmp_path / "not-a-dir"
    a_file.write_bytes(b"x")
    for given in (a_file, [tmp_path / "ok", a_file]):
        with pytest.raises(NotADirectoryError, match="dir_name is not a directory") as e:
            DiskOffloader(given)
        assert e.value.filename == str(a_file)
    for wrong in (None, 5, 1.5):
        with pytest.raises(TypeError, match="dir_name must be a path .* or a list of paths"):
            DiskOffloader(wrong)  # type: ignore[arg-type]
    with pytest.raises(AssertionError):  # TensorNVMe's own error stays
        tensornvme.DiskOffloader(str(a_file))


@pytest.mark.parametrize("cls", [DiskOffloader, tensornvme.DiskOffloader])
def test_a_callback_that_cannot_be_called_is_refused_by_the_call(cls: type, disk_dir: Path) -> None:
    """Refused at once, as TensorNVMe's binding refuses it, and nothing starts: not by the wait,
    after the write has freed the tensor's memory."""
    with cls(disk_dir / "offload") as o:
        x = torch.randn(100)
        x0 = x.clone()
        for call in (o.async_write, o.async_writev):
            with pytest.raises(TypeError, match="callback must be callable or None, not int"):
                call(x if call is o.async_write else [x], callback=5)
            assert not o.is_offloaded(x) and torch.equal(x, x0)
        o.sync_write_events()
        o.async_writev([x])
        o.sync_write_events()
        for call in (o.async_read, o.async_readv):
            with pytest.raises(TypeError, match="callback must be callable or None, not str"):
                call(x if call is o.async_read else [x], callback="done")
            assert o.is_offloaded(x)
        o.sync_readv([x])
        assert torch.equal(x, x0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_pin_memory_without_cuda_is_a_clear_error(disk_dir: Path) -> None:
    with pytest.raises(ValueError, match="CUDA"):
        DiskOffloader(disk_dir, pin_memory=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device to pin memory")
def test_pin_memory_restores_pinned(disk_dir: Path) -> None:
    with DiskOffloader(disk_dir, pin_memory=True) as o:
        x = torch.randn(1000)
        x0 = x.clone()
        o.sync_write(x)
        o.sync_read(x)
        assert x.is_pinned() and torch.equal(x, x0)


# ---- many offloaders, cleanup --------------------------------------------------------------


def test_many_offloaders_in_one_process(disk_dir: Path) -> None:
    offs = [DiskOffloader(disk_dir / ("shared" if i % 2 else f"own{i}")) for i in range(8)]
    tensors = [[torch.full((5000 + i,), float(i * 10 + j)) for j in range(3)] for i in range(8)]
    for o, ts in zip(offs, tensors):
        o.async_writev(ts)
    for o in reversed(offs):
        o.sync_write_events()
    for o, ts in zip(offs, tensors):
        o.sync_readv(ts)
    for i, ts in enumerate(tensors):
        for j, t in enumerate(ts):
            assert torch.equal(t, torch.full((5000 + i,), float(i * 10 + j)))
    paths = [p for o in offs for p in o.paths]
    assert len(set(paths)) == 8
    for o in offs:
        o.close()
    assert not any(os.path.exists(p) for p in paths)


def test_close_and_context_manager_remove_files(disk_dir: Path) -> None:
    o = DiskOffloader(disk_dir)
    x = torch.randn(1000)
    o.sync_write(x)
    paths = o.paths
    assert all(os.path.exists(p) for p in paths)
    with pytest.warns(OffloadedDataLostWarning, match="1 tensor"):
        o.close()
    assert not any(os.path.exists(p) for p in paths)
    o.close()  # idempotent
    with DiskOffloader(disk_dir) as o2:
        paths = o2.paths
    assert not any(os.path.exists(p) for p in paths)


def _child(code: str, cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=cwd,
        stdout=subprocess.PIPE,
        text=True,
    )


def test_files_removed_at_interpreter_exit(disk_dir: Path) -> None:
    child = _child(
        """
        import torch, tensortier
        off = tensortier.DiskOffloader("off")
        x = torch.randn(100000)
        off.sync_write(x)
        print(off.paths[0], flush=True)
        """,
        disk_dir,
    )
    out, _ = child.communicate(timeout=120)
    assert child.returncode == 0
    assert not os.path.exists(out.strip())
    assert os.listdir(disk_dir / "off") == []


def test_files_of_a_killed_process_are_named_and_cleaned(disk_dir: Path) -> None:
    child = _child(
        """
        import time, torch, tensortier
        off = tensortier.DiskOffloader("off")
        x = torch.randn(100000)
        off.sync_write(x)
        print(off.paths[0], flush=True)
        time.sleep(600)
        """,
        disk_dir,
    )
    assert child.stdout is not None
    path = child.stdout.readline().strip()
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=60)
    assert os.path.exists(path)
    name = os.path.basename(path)
    assert name.startswith(f"tensortier-offload-{child.pid}-") and name.endswith(".bin")
    # A live offloader's files in the same directory are left alone.
    with DiskOffloader(disk_dir / "off") as mine:
        assert not os.path.exists(path)
        assert all(os.path.exists(p) for p in mine.paths)
        assert remove_stale_files([disk_dir / "off"]) == 0
        assert remove_stale_files(disk_dir / "off") == 0  # one directory as a path
        assert remove_stale_files(str(disk_dir / "off")) == 0  # or a str: not its characters


def test_remove_stale_files_takes_one_directory_as_a_str(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A str is one directory, not a sequence of one-letter directory names."""
    (disk_dir / "off").mkdir()
    with DiskOffloader(disk_dir / "probe") as probe:  # names this boot's and namespace's tag
        tag = os.path.basename(probe.paths[0]).split("-")[4]
    stale = f"tensortier-offload-999999999-1-{tag}-0-0.bin"  # a pid that cannot be running
    (disk_dir / "off" / stale).write_bytes(b"x")
    (disk_dir / stale).write_bytes(b"x")
    monkeypatch.chdir(disk_dir)
    assert remove_stale_files("off") == 1
    assert not (disk_dir / "off" / stale).exists() and (disk_dir / stale).exists()


def test_public_exports() -> None:
    assert tensortier.DiskOffloader is DiskOffloader
    assert issubclass(tensornvme.DiskOffloader, DiskOffloader)  # TensorNVMe's strict one


FORK_WITH_LOCK_HELD = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    import torch, tensortier
    off = tensortier.DiskOffloader(sys.argv[1])
    held, release = threading.Event(), threading.Event()

    def hold() -> None:  # a thread of the parent inside the offloader at the fork
        with off._lock:
            held.set()
            release.wait()

    threading.Thread(target=hold).start()
    held.wait()
    pid = os.fork()
    if pid == 0:
        signal.alarm(20)  # a hang ends as SIGALRM
        try:
            off.sync_write(torch.ones(10))
            os._exit(1)
        except ValueError as e:
            os._exit(0 if "fork" in str(e) else 2)
    release.set()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status), f"the child hung or crashed: {status}"
    assert os.WEXITSTATUS(status) == 0, os.WEXITSTATUS(status)
    off.close()
    print("ok")
    """
)


def test_a_forked_child_raises_even_if_a_parent_thread_held_the_lock(disk_dir: Path) -> None:
    """A parent thread inside the offloader at the fork leaves its lock held in the child's copy
    for good: the child gets a fresh one, so using the offloader raises instead of hanging."""
    done = subprocess.run(
        [sys.executable, "-c", FORK_WITH_LOCK_HELD, str(disk_dir)],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "ok"


def test_dropping_an_offloader_with_stored_tensors_warns_by_default(disk_dir: Path) -> None:
    """Under Python's default warning filters (ResourceWarning would be hidden): the data of
    the tensors still offloaded is gone, which must not go unnoticed."""
    code = f"""
import gc, torch, tensortier
x = torch.arange(8.)
def park(t):
    off = tensortier.DiskOffloader({str(disk_dir)!r})
    off.sync_write(t)
park(x)
gc.collect()
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "OffloadedDataLostWarning" in r.stderr and "1 tensor(s) still offloaded" in r.stderr


def test_entries_follow_the_storage_not_the_tensor_object(disk_dir: Path) -> None:
    """sync_write(param.data) (a temporary sharing param's storage) then sync_read(param): the
    data stays as long as any tensor uses the storage (it was discarded when the temporary
    died, leaving param with no memory and no data)."""
    with DiskOffloader(disk_dir) as off:
        p = torch.nn.Parameter(torch.arange(8.0))
        off.sync_write(p.data)
        gc.collect()
        assert off.is_offloaded(p) and off.stored_bytes == 32
        off.sync_read(p)
        assert torch.equal(p.data, torch.arange(8.0))
        x = torch.arange(8.0)
        alias = x.view(2, 4)
        off.sync_write(alias)
        del alias
        gc.collect()
        assert off.is_offloaded(x)
        off.sync_read(x.view(4, 2))  # any tensor covering the storage reads it back
        assert torch.equal(x, torch.arange(8.0))
        with pytest.raises(ValueError, match="two tensors of one storage"):
            off.sync_writev([p, p.data])
        z = torch.arange(8.0)
        off.sync_write(z)
        z.data = torch.zeros(8)  # its storage replaced while offloaded: the old one dies
        gc.collect()
        assert off.is_offloaded(z) and off.stored_bytes == 32  # the tensor still reads it back
        off.sync_read(z)
        assert torch.equal(z, torch.arange(8.0))
        y = torch.ones(4)
        off.sync_write(y)
        del y  # the storage's last tensor: its data can never be read, its space is freed
        gc.collect()
        off.synchronize()
        assert off.stored_bytes == 0


def test_pinned_reads_move_the_entry_to_the_new_storage(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pin_memory reads give the tensor a new (pinned) storage; its old one dies then, which
    must not discard the data being read, and a failed read must leave the data readable
    through the tensor. (Pinned memory stands in as plain memory: no CUDA here.)"""
    real_empty = torch.empty

    def empty(*args: object, pin_memory: bool = False, **kwargs: object) -> torch.Tensor:
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    with DiskOffloader(disk_dir, backend="threads") as off:
        off._pin = True  # noqa: SLF001 - what pin_memory=True sets where CUDA exists
        x = torch.randn(50_000)
        want_x = x.clone()
        off.sync_write(x)
        off.sync_read(x)  # its old storage dies at once
        gc.collect()
        assert torch.equal(x, want_x) and not off.is_offloaded(x) and off.stored_bytes == 0
    fault = {"kind": "error", "errno": errno.EIO, "nth": 1, "count": 1, "writes": False}
    with with_faults(fault, DiskOffloader, disk_dir, backend="threads") as off:
        off._pin = True  # noqa: SLF001
        y = torch.randn(50_000)
        want_y = y.clone()
        off.sync_write(y)
        with pytest.raises(OSError):
            off.sync_read(y)  # fails (injected EIO)
        gc.collect()
        assert off.is_offloaded(y) and off.stored_bytes == y.numel() * 4
        off.sync_read(y)  # the data is still there, through the tensor
        assert torch.equal(y, want_y) and off.stored_bytes == 0


def _pinned_stand_in(monkeypatch: pytest.MonkeyPatch, off: DiskOffloader,
                     before_alloc: Callable[[], None] | None = None) -> None:
    """pin_memory=True where there is no CUDA: plain memory stands in for pinned memory."""
    real_empty = torch.empty

    def empty(*args: object, pin_memory: bool = False, **kwargs: object) -> torch.Tensor:
        if pin_memory and before_alloc is not None:
            before_alloc()
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    off._pin = True  # noqa: SLF001 - what pin_memory=True sets where CUDA exists


def test_a_view_of_part_of_an_offloaded_storage_is_not_it(off: DiskOffloader) -> None:
    """Only a tensor covering the whole storage stands for the tensor written: reading through
    a view at an offset moved the whole data to the view's address (heap overrun)."""
    x = torch.arange(1 << 16, dtype=torch.float32)
    want = x.clone()
    v, tail = x[16:], x[: (1 << 16) - 16]
    off.sync_write(x)
    assert not off.is_offloaded(v) and not off.is_offloaded(tail)
    for part in (v, tail):
        with pytest.raises(ValueError, match="not offloaded"):
            off.sync_read(part)
    off.sync_read(x.view(256, 256))  # the whole storage: fine
    assert torch.equal(x, want)
    assert not off.is_offloaded(None) and not off.is_offloaded(torch.eye(3).to_sparse())


def test_a_tensor_and_another_of_its_storage_are_read_once(off: DiskOffloader) -> None:
    x = torch.arange(4096.0)
    v = x.view(-1)
    off.sync_write(x)
    x.data = torch.zeros(4096)  # x found through itself, v through the old storage
    with pytest.raises(ValueError, match="read it once"):
        off.sync_readv([x, v])
    assert off.is_offloaded(x) and off.is_offloaded(v)
    off.sync_read(x)
    assert torch.equal(x, torch.arange(4096.0))


def test_a_storage_replaced_during_an_async_read_is_kept_until_it_ends(
    off: DiskOffloader,
) -> None:
    """The operation holds the memory it reads into: `p.data = ...` meanwhile freed it under
    the engine (and its death discarded the key in flight)."""
    p = torch.nn.Parameter(torch.randn(1 << 20))
    off.sync_write(p.data)
    off.async_read(p)
    p.data = torch.zeros(1)
    gc.collect()
    off.sync_read_events()
    assert off.stored_bytes == 0 and p.numel() == 1


def test_pinned_reads_through_another_tensor_of_the_storage_restore_in_place(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new pinned storage goes only to the tensor written; reading through another tensor of
    the storage (p written as p.data, or p.data read) fills the storage in place, for all."""
    with DiskOffloader(disk_dir, backend="threads") as off:
        _pinned_stand_in(monkeypatch, off)
        p = torch.nn.Parameter(torch.arange(8.0))
        off.sync_write(p.data)
        off.sync_read(p.data)
        assert torch.equal(p.data, torch.arange(8.0)) and off.stored_bytes == 0
        q = torch.nn.Parameter(torch.arange(8.0))
        off.sync_write(q)
        off.sync_read(q.data)
        assert torch.equal(q.data, torch.arange(8.0)) and not off.is_offloaded(q)


def test_a_storage_death_queued_before_a_pinned_read_is_not_the_new_storages(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The entry's old storage dies (a collection) while a pinned read holds the lock, just
    before the read gives the tensor a new storage; that death must not count for the new one
    (it unmapped it, and the data went when the tensor died while the new storage lived)."""
    fault = {"kind": "error", "errno": errno.EIO, "nth": 1, "count": 1, "writes": False}
    with with_faults(fault, DiskOffloader, disk_dir, backend="threads") as off:
        _pinned_stand_in(monkeypatch, off, before_alloc=gc.collect)
        x = torch.arange(1024.0)

        class Holder:
            pass

        h = Holder()
        h.view, h.me = x.view(-1), h  # the old storage kept only by a reference cycle
        off.sync_write(x)
        x.data = torch.zeros(1024)
        del h
        gc.disable()
        try:
            with pytest.raises(OSError):
                off.sync_read(x)  # the old storage is collected inside; the read then fails
        finally:
            gc.enable()
        w = torch.empty(0).set_(x.untyped_storage(), 0, x.shape, x.stride())
        del x
        gc.collect()
        assert off.is_offloaded(w) and off.stored_bytes == 4096
        off.sync_read(w)
        assert torch.equal(w, torch.arange(1024.0))


@pytest.mark.parametrize("replace", ["part of a larger storage", "at an offset", "resize_",
                                     "numpy memory"])
def test_a_tensor_whose_memory_was_replaced_is_read_back_only_into_its_own(
    off: DiskOffloader, replace: str
) -> None:
    """x.data = flat[a:b] (ZeRO-style flat buffers), set_ at an offset, or resize_ while
    offloaded: the read would write past x into other tensors' memory or shrink a storage under
    them (heap corruption). Refused; the data stays offloaded and reads once x has its own."""
    import numpy

    x = torch.arange(1024.0)
    off.sync_write(x)
    flat = torch.full((2048,), 7.0)
    if replace == "part of a larger storage":
        x.data = flat[:1024]
    elif replace == "at an offset":
        x.data = flat[1024:]
    elif replace == "resize_":
        x.data = torch.empty(0)
        x.resize_(4096)
        x.data = x.data[:1024]
    else:
        x.data = torch.from_numpy(numpy.zeros(1024, numpy.float32))
    with pytest.raises(ValueError, match="memory was replaced while it was offloaded"):
        off.sync_read(x)
    assert torch.equal(flat, torch.full((2048,), 7.0))  # nobody else's memory touched
    assert off.is_offloaded(x)
    x.data = torch.empty(1024)
    off.sync_read(x)
    assert torch.equal(x, torch.arange(1024.0))


def test_a_read_of_b_does_not_raise_a_failed_write_of_a(disk_dir: Path) -> None:
    """sync_read(b) waits for b's write in flight; a's failed write is a's error, raised by the
    next write wait, not by the read of b (which is done)."""
    fault = {"kind": "error", "errno": errno.EIO, "nth": 1, "count": 1, "writes": True}
    with with_faults(fault, DiskOffloader, disk_dir, backend="threads") as off:
        a, b = torch.randn(1000), torch.randn(1000)
        wants = {id(a): a.clone(), id(b): b.clone()}
        off.async_write(a)
        off.async_write(b)  # one of the two fails: the first piece the workers run
        try:
            off.sync_read(b)
            done, failed = b, a
        except ValueError as e:  # b's was the failed write: then a is the one to read
            assert "write failed" in str(e)
            off.sync_read(a)
            done, failed = a, b
        assert torch.equal(done, wants[id(done)])
        with pytest.raises(OSError) as err:
            off.sync_write_events()
        assert err.value.errno == errno.EIO
        assert not off.is_offloaded(failed)  # the failed one kept its memory and data
        assert torch.equal(failed, wants[id(failed)])
        off.sync_write_events()  # raised once


def test_a_raising_callback_loses_neither_errors_nor_other_callbacks(disk_dir: Path) -> None:
    fault = {"kind": "error", "errno": errno.EIO, "nth": 1, "count": 1, "writes": True}
    with with_faults(fault, DiskOffloader, disk_dir, backend="threads") as off:
        a, b, c = torch.randn(1000), torch.randn(1000), torch.randn(1000)
        ran: list[str] = []

        def bad() -> None:
            raise RuntimeError("callback b raised")

        off.async_write(a, lambda: ran.append("a"))
        off.async_write(b, bad)
        off.async_write(c, lambda: ran.append("c"))  # one of the three fails with EIO
        with pytest.raises(OSError) as e:
            off.sync_write_events()
        stored = {n for n, t in (("a", a), ("b", b), ("c", c)) if off.is_offloaded(t)}
        assert len(stored) == 2
        assert sorted(ran) == sorted(stored - {"b"})  # every other callback ran
        notes = getattr(e.value, "__notes__", [])
        assert ("b" in stored) == any("callback b raised" in n for n in notes), notes
        off.async_write(torch.randn(10), bad)  # the fault is spent: this write succeeds
        with pytest.raises(RuntimeError, match="callback b raised"):
            off.sync_write_events()  # no I/O error: the callback's is raised


def test_waits_in_a_forked_child_raise_instead_of_hanging(disk_dir: Path) -> None:
    code = f"""
import os, torch, tensortier
off = tensortier.DiskOffloader({str(disk_dir)!r}, backend="threads")
x = torch.randn(16 << 20)
off.async_write(x)
pid = os.fork()
if pid == 0:
    try:
        off.sync_write_events()
        os._exit(1)
    except ValueError as e:
        os._exit(0 if "fork" in str(e) else 2)
_, status = os.waitpid(pid, 0)
off.synchronize(); off.sync_read(x); off.close()
raise SystemExit(os.waitstatus_to_exitcode(status))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_offloaded_data_at_exit_warns_whatever_the_import_order(disk_dir: Path) -> None:
    """Entry finalizers do not run at interpreter exit (importing tensortier before torch ran
    weakref's exit hook first: keys in flight discarded with a traceback, data dropped without
    the warning)."""
    for mode in ("stored", "in flight"):
        code = f"""
from tensortier import DiskOffloader
import torch
off = DiskOffloader({str(disk_dir)!r}, backend="threads")
x = torch.randn(1 << 20)
off.{"sync_write" if mode == "stored" else "async_write"}(x)
"""
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
        if mode == "stored":
            assert "OffloadedDataLostWarning" in r.stderr, r.stderr


def test_a_pinned_read_torch_refuses_to_re_point_fills_the_storage_in_place(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An inference tensor read outside inference mode: torch refuses set_(); the read fills
    its storage in place (unpinned), and the entry stays watched (its space was never freed)."""
    with DiskOffloader(disk_dir, backend="threads") as off:
        _pinned_stand_in(monkeypatch, off)
        with torch.inference_mode():
            kv = torch.randn(1 << 16)
        want = kv.clone()
        off.sync_write(kv)
        off.sync_read(kv)
        assert torch.equal(kv, want) and off.stored_bytes == 0
        off.sync_write(kv)
        del kv
        gc.collect()
        off.synchronize()
        assert off.stored_bytes == 0 and not off._entries  # noqa: SLF001


def test_nested_tensors_are_refused(off: DiskOffloader) -> None:
    nt = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
    with pytest.raises(ValueError, match="nested"):
        off.sync_write(nt)


def test_a_tensor_another_offloader_holds_is_refused_even_while_its_write_runs(
        disk_dir: Path) -> None:
    """Two offloaders taking one tensor would each read back their own copy (the second's read
    silently restoring stale data): a second offloader refuses a tensor the first holds, also
    before the first's write is over and has freed the memory."""
    a, b = DiskOffloader(disk_dir / "a"), DiskOffloader(disk_dir / "b")
    x = torch.randn(1 << 20)
    x0 = x.clone()
    a.async_write(x)
    with pytest.raises(ValueError, match="offloaded by another DiskOffloader"):
        b.sync_write(x)
    a.sync_write_events()
    assert not b.is_offloaded(x)
    a.sync_read(x)
    assert torch.equal(x, x0)
    b.sync_write(x)  # back in memory: the other may take it now
    b.sync_read(x)
    assert torch.equal(x, x0)
    a.close()
    b.close()


def test_sparse_tensors_are_refused_with_advice_that_works(off: DiskOffloader) -> None:
    """Not "call .contiguous() first", which a sparse tensor refuses."""
    s = torch.eye(3).to_sparse()
    with pytest.raises(ValueError, match=r"layout torch.sparse_coo cannot be offloaded: offload "
                                         r"\.to_dense\(\)"):
        off.sync_write(s)
    off.sync_write(d := s.to_dense())
    off.sync_read(d)
    assert torch.equal(d, torch.eye(3))


def _one_of_two_writes_failed(off: DiskOffloader, x: torch.Tensor, z: torch.Tensor) -> None:
    """Reads back whichever of x and z was written (the other's write failed): the read settles
    the writes and keeps the failure for the next write wait."""
    try:
        off.sync_read(x)
    except ValueError:
        off.sync_read(z)


def test_close_counts_failures_a_read_held_and_clears_them(disk_dir: Path) -> None:
    fault = {"kind": "error", "errno": errno.EIO, "nth": 1, "count": 1, "writes": True,
             "reads": False}
    off = with_faults(fault, DiskOffloader, disk_dir, backend="threads")
    z, x = torch.randn(1000), torch.randn(1000)
    off.async_write(z)
    off.async_write(x)
    _one_of_two_writes_failed(off, x, z)
    with pytest.warns(OffloadedDataLostWarning, match="1 operation"):
        off.close()
    off.sync_write_events()  # closed: nothing left to raise


def test_a_held_callback_error_does_not_take_the_place_of_an_io_error(disk_dir: Path) -> None:
    fault = {"kind": "error", "errno": errno.EIO, "nth": 2, "count": 1, "writes": True,
             "reads": False}
    with with_faults(fault, DiskOffloader, disk_dir, backend="threads") as off:
        def bad() -> None:
            raise RuntimeError("callback of a raised")

        a, c = torch.randn(1000), torch.randn(1000)
        off.async_write(a, bad)
        off.sync_read(a)  # a's callback raises inside the read's wait for writes: held
        off.async_write(c)  # fails (the second write piece)
        with pytest.raises(OSError) as e:
            off.sync_write_events()
        assert any("callback of a raised" in n for n in getattr(e.value, "__notes__", []))


def test_an_interrupt_in_a_callback_loses_no_error_and_skips_no_callback(
    disk_dir: Path,
) -> None:
    fault = {"kind": "error", "errno": errno.EIO, "nth": 1, "count": 1, "writes": True,
             "reads": False}
    with with_faults(fault, DiskOffloader, disk_dir, backend="threads") as off:
        z = torch.randn(1000)
        off.async_write(z)  # fails: the only write in flight
        with pytest.raises(ValueError, match="write failed"):
            off.sync_read(z)  # waits for it, keeps its error for the next write wait
        ran: list[str] = []

        def interrupt() -> None:
            raise KeyboardInterrupt

        a, c = torch.randn(1000), torch.randn(1000)
        off.async_write(a, interrupt)
        off.async_write(c, lambda: ran.append("c"))
        with pytest.raises(KeyboardInterrupt):
            off.sync_write_events()
        assert ran == ["c"] and off.is_offloaded(a) and off.is_offloaded(c)
        with pytest.raises(OSError) as e:
            off.sync_write_events()  # z's error, kept through the interrupt
        assert e.value.errno == errno.EIO


def test_a_zero_size_tensor_of_foreign_memory_is_offloaded_without_a_resize(
    off: DiskOffloader,
) -> None:
    import numpy

    z = torch.from_numpy(numpy.empty((0,), numpy.float32))  # a storage that cannot resize
    y = torch.randn(1000)
    ran: list[str] = []
    off.async_write(z)
    off.async_write(y, lambda: ran.append("y"))
    off.sync_write_events()
    assert ran == ["y"] and off.is_offloaded(y) and off.is_offloaded(z)
    off.sync_readv([z, y])
    assert z.numel() == 0 and y.numel() == 1000


# ---- out of space and close() with writes in flight --------------------------------------------


def test_out_of_space_raises_from_the_wait_on_every_filesystem(small_fs: Path) -> None:
    """One rule: async_write never raises an I/O error itself (where the filesystem reserves
    space up front as where the write runs out), the wait does, and the tensor keeps its memory
    and data."""
    with DiskOffloader(small_fs, backend="threads") as off:
        big = random_tensor((8 << 20,), torch.uint8, seed=1)  # twice the filesystem
        big0 = big.clone()
        off.async_write(big)  # must not raise
        assert not off.is_offloaded(big)
        with pytest.raises(OSError) as e:
            off.sync_write_events()
        assert e.value.errno == errno.ENOSPC
        assert not offloaded(big) and same_bytes(big, big0) and not off.is_offloaded(big)
        assert off.stored_bytes == 0
        # sync_write raises the same way; a vector fails as a whole, keeping every tensor.
        with pytest.raises(OSError) as e:
            off.sync_write(big)
        assert e.value.errno == errno.ENOSPC and same_bytes(big, big0)
        small = random_tensor((100_000,), torch.uint8, seed=2)
        small0 = small.clone()
        off.async_writev([small, big])
        with pytest.raises(OSError) as e:
            off.synchronize()
        assert e.value.errno == errno.ENOSPC
        assert same_bytes(small, small0) and same_bytes(big, big0)
        # What fits is offloaded and read back once the space is free again.
        off.sync_write(small)
        assert offloaded(small)
        off.sync_read(small)
        assert same_bytes(small, small0)


def test_injected_out_of_space_raises_from_the_wait(disk_dir: Path, copier: str) -> None:
    fault = {"kind": "error", "errno": errno.ENOSPC, "nth": 1, "count": 1, "reads": False}
    with with_faults(fault, DiskOffloader, disk_dir, backend="threads",
                     _device_copier=copier) as off:
        x = torch.randn(300_000)
        x0 = x.clone()
        off.async_write(x)
        with pytest.raises(OSError) as e:
            off.sync_write_events()
        assert e.value.errno == errno.ENOSPC and torch.equal(x, x0) and not offloaded(x)


def test_close_with_writes_in_flight_keeps_every_tensor(disk_dir: Path, copier: str) -> None:
    """A write not waited for when the offloader closes is cancelled once done: the tensor keeps
    its memory and data, as is_offloaded() said; its callback does not run and nothing is
    reported lost. Tensors written and waited for are still lost, with the warning."""
    off = DiskOffloader(disk_dir, backend="threads", _device_copier=copier)
    stored = torch.randn(1000)
    off.sync_write(stored)
    tensors = [random_tensor((n,), torch.uint8, seed=n) for n in (1, 4097, 1 << 20, 3 << 20)]
    copies = [t.clone() for t in tensors]
    ran: list[int] = []
    off.async_write(tensors[0], lambda: ran.append(0))
    off.async_writev(tensors[1:], lambda: ran.append(1))
    assert not any(off.is_offloaded(t) for t in tensors)
    with pytest.warns(OffloadedDataLostWarning) as record:
        off.close()
    assert [str(w.message) for w in record] == [
        "DiskOffloader closed with 1 tensor(s) still offloaded; their data is gone"
    ]
    assert offloaded(stored) and ran == []
    for t, c in zip(tensors, copies):
        assert not offloaded(t) and same_bytes(t, c)
        t.add_(1)  # the memory is the tensor's again


def test_close_with_a_failed_write_in_flight_keeps_the_tensor(disk_dir: Path) -> None:
    fault = {"kind": "error", "errno": errno.EIO, "nth": 1, "count": 1, "reads": False}
    off = with_faults(fault, DiskOffloader, disk_dir, backend="threads")
    x = torch.randn(300_000)
    x0 = x.clone()
    off.async_write(x)
    with pytest.warns(OffloadedDataLostWarning, match="1 operation"):
        off.close()
    assert torch.equal(x, x0)


class _FirstPieceThenRefused:
    """An offloader's device route that starts the first tensor's piece of a call and then
    refuses the call (as out of memory starting the second one would)."""

    def __init__(self, device: Any) -> None:
        self._device = device

    def __getattr__(self, name: str) -> Any:
        return getattr(self._device, name)

    def submit(self, kind: str, keys: list[int], spans: list[Any]) -> None:
        self._device.submit(kind, keys[:1], spans[:1])
        raise MemoryError("injected: the second piece could not start")


def test_a_read_refused_after_its_first_piece_started_loses_no_tensor(disk_dir: Path) -> None:
    """The first tensor's read had ended, its copy on disk freed, when the refusal freed its
    memory too: its data was gone while is_offloaded() still said True."""
    with DiskOffloader(disk_dir, _device_copier="memcpy") as off:
        a, b = torch.randn(70_000), torch.randn(50_001)
        a0, b0 = a.clone(), b.clone()
        off.sync_writev([a, b])
        off._device = _FirstPieceThenRefused(off._device)
        with pytest.raises(MemoryError, match="injected"):
            off.async_readv([a, b])
        assert not off.is_offloaded(a) and torch.equal(a, a0)  # read back
        assert off.is_offloaded(b) and b.untyped_storage().nbytes() == 0  # still on disk
        off._device = off._device._device
        off.sync_read(b)
        assert torch.equal(b, b0)
        assert off.stored_bytes == 0


def test_a_write_refused_after_its_first_piece_started_stores_nothing(disk_dir: Path) -> None:
    with DiskOffloader(disk_dir, _device_copier="memcpy") as off:
        a, b = torch.randn(70_000), torch.randn(50_001)
        a0, b0 = a.clone(), b.clone()
        off._device = _FirstPieceThenRefused(off._device)
        with pytest.raises(MemoryError, match="injected"):
            off.async_writev([a, b])
        off._device = off._device._device
        assert not off.is_offloaded(a) and not off.is_offloaded(b)
        assert torch.equal(a, a0) and torch.equal(b, b0)
        assert off.stored_bytes == 0


@pytest.mark.parametrize("make", [DiskOffloader, tensornvme.DiskOffloader],
                         ids=["tensortier", "tensornvme"])
def test_backing_files_are_the_owners_only(
    disk_dir: Path, make: Callable[..., DiskOffloader]
) -> None:
    """Parked weights and optimizer state are readable by their owner alone (mode 0600), as
    shared tensors' memory is, whatever the umask lets files be (0022: 0644 by default)."""
    previous = os.umask(0o022)
    try:
        with make(str(disk_dir / "offload")) as off:
            t = random_tensor((1000,), torch.float32)
            off.sync_write(t)
            assert off.paths
            for path in off.paths:
                assert os.stat(path).st_mode & 0o777 == 0o600, path
            off.sync_read(t)
    finally:
        os.umask(previous)


def test_an_object_owning_its_offloader_and_passing_its_method_as_callback_is_collected(
        disk_dir: Path) -> None:
    """A cycle through a pending write's callback (layer -> offloader -> entry -> bound method
    -> layer) is garbage the collector frees, with the offloader's threads and files."""
    import weakref

    class Layer:
        def __init__(self, i: int) -> None:
            self.offloader = DiskOffloader(disk_dir / f"layer{i}")
            self.weight = torch.arange(1024, dtype=torch.float32)
            self.offloader.async_write(self.weight, callback=self.written)

        def written(self) -> None:
            pass

    refs = [weakref.ref(Layer(i)) for i in range(4)]
    gc.collect()
    assert [r() for r in refs] == [None] * 4
    for i in range(4):
        assert list((disk_dir / f"layer{i}").iterdir()) == []


# Ctrl-C during the offloaders' calls, in a process of its own (a read into freed memory
# corrupts its heap): every tensor comes back whole, interrupted or not. One process per call
# runs every kind of offloader in turn (a process costs seconds of torch's import).
OFFLOADER_KINDS = textwrap.dedent("""
    import os, sys, torch, tensortier
    from tensortier.compat.tensornvme import DiskOffloader as Strict
    KINDS = ("lenient", "strict", "device")
    def offloader(kind, root):
        if kind == "strict":
            return Strict(root)
        # "device": every tensor takes the CUDA tensors' path (a memcpy stands in for CUDA)
        return tensortier.DiskOffloader(root, _device_copier="memcpy" if kind == "device" else "cuda")
    """)
CTRL_C_SCRIPT = INTERRUPTED_CALLS + OFFLOADER_KINDS + textwrap.dedent("""
    def hits_of(kind, call, root):
        off = offloader(kind, root)
        method = getattr(off, "async_read" if call == "read" else "sync_write")
        hits = 0
        for it in range(160):
            x = torch.randn(1 << 20)
            x0 = x.clone()
            if call == "read":
                off.sync_write(x)
            hits += interrupted(lambda: method(x), 5e-5, it)
            off.synchronize()
            if off.is_offloaded(x):
                off.sync_read(x)
            assert x.untyped_storage().nbytes() == x0.nbytes and torch.equal(x, x0), (kind, it)
            if call == "write":  # an interrupted write was recorded: its tensor's memory is kept
                assert not off.is_offloaded(x)
                stale = x
                hits += interrupted(lambda: method(stale), 5e-5, it)
                del stale, x  # the tensor's memory may go now, unless the offloader holds it
                off.synchronize()
        off.close()
        return hits
    call, root = sys.argv[1], sys.argv[2]
    for kind in KINDS:
        print(kind, "interrupted", hits_of(kind, call, os.path.join(root, kind)))
    """)


@pytest.mark.parametrize("call", ["read", "write"])
def test_ctrl_c_in_an_offloader_call_loses_no_tensor(tmp_path: Path, call: str) -> None:
    """A read Ctrl-C interrupted once it had started had its tensor's memory freed under it
    and was forgotten (the data gone, then heap corruption); TensorNVMe's write so interrupted
    was left readable by no call ("tensor not found")."""
    out = exits_cleanly(CTRL_C_SCRIPT, call, str(tmp_path), timeout=600)
    assert [line.split()[:2] for line in out.splitlines()] == [
        [kind, "interrupted"] for kind in ("lenient", "strict", "device")], out


EVERY_POINT_SCRIPT = INTERRUPTED_POINTS + OFFLOADER_KINDS + textwrap.dedent("""
    def points_of(kind, call, root):
        package = os.path.dirname(tensortier.__file__)
        off = offloader(kind, root)
        method = getattr(off, "async_read" if call == "read" else "async_write")
        point = 0
        while True:
            point += 1
            x = torch.randn(1 << 16)
            x0 = x.clone()
            if call == "read":
                off.sync_write(x)
            if not interrupted_at(lambda: method(x), point, package):
                break
            off.synchronize()
            if off.is_offloaded(x):
                off.sync_read(x)
            assert x.untyped_storage().nbytes() == x0.nbytes and torch.equal(x, x0), (kind, point)
            # Nothing is left offloaded that no tensor can read back.
            assert off.stored_bytes == 0, (kind, point, off.stored_bytes)
        off.synchronize()
        if off.is_offloaded(x):
            off.sync_read(x)
        assert torch.equal(x, x0), kind
        off.close()
        return point - 1
    call, root = sys.argv[1], sys.argv[2]
    for kind in KINDS:
        print(kind, "points", points_of(kind, call, os.path.join(root, kind)))
    """)


@pytest.mark.parametrize("call", ["read", "write"])
@pytest.mark.skipif(sys.version_info < (3, 11),
                    reason="where a signal is handled is modelled on 3.11's instructions")
def test_ctrl_c_at_every_point_of_an_offloader_call(tmp_path: Path, call: str) -> None:
    """Ctrl-C at each point of the call's Python where a signal can be handled, in turn. A write
    interrupted after it had started ran unrecorded (its memory not kept alive, its data left on
    disk for no tensor); a read of a CUDA tensor (the memcpy stand-in) was recorded but not
    started, so its tensor stayed "already being read" for good."""
    out = exits_cleanly(EVERY_POINT_SCRIPT, call, str(tmp_path), timeout=300)
    lines = [line.split() for line in out.splitlines()]
    kinds = ("lenient", "strict", "device")
    assert [line[:2] for line in lines] == [[kind, "points"] for kind in kinds], out
    # Each call runs dozens of lines of Python: a count of a few means the interrupts missed.
    assert all(int(line[2]) >= 10 for line in lines), out
