"""IOHandle: round trips, alignment cases, every dtype, bad input, faults, concurrency."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch

import tensortier
from tensortier import IOHandle

from conftest import exits_cleanly, INTERRUPTED_CALLS, require_backend
from faults import require_faults, with_faults

BACKENDS = [p["backend"] for p in tensortier.probe_backends(".") if p["available"]]

ALL_DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.complex64, torch.complex128, torch.uint16, torch.uint32, torch.uint64,
    torch.float8_e4m3fn, torch.float8_e5m2,
]


def random_tensor(n: int, dtype: torch.dtype) -> torch.Tensor:
    """Random bytes viewed as `dtype` (covers every bit pattern, NaNs included)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8)
    return raw.view(dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.fixture(params=BACKENDS)
def io(request: pytest.FixtureRequest) -> IOHandle:
    with IOHandle(request.param, chunk_size=64 << 10) as handle:
        yield handle


def test_backends_available() -> None:
    """Every backend compiled in works here (the other tests run only those that do); a kernel
    that refuses one skips this outside CI."""
    assert "threads" in BACKENDS  # always works
    for row in tensortier.probe_backends("."):
        if row["compiled_in"]:
            if not row["available"]:
                require_backend(row["backend"])
            assert row["available"], row
            assert row["buffered_ok"], row


def test_a_probe_directory_that_cannot_take_a_file_is_an_oserror(disk_dir: Path) -> None:
    """Not "no I/O backend works": the directory is the problem, and the error says so."""
    with pytest.raises(FileNotFoundError, match="missing"):
        IOHandle(probe_dir=disk_dir / "missing")
    (disk_dir / "file").write_bytes(b"x")
    with pytest.raises(NotADirectoryError):
        IOHandle(probe_dir=disk_dir / "file")


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_round_trip_every_dtype(io: IOHandle, disk_dir: Path, dtype: torch.dtype) -> None:
    t = random_tensor(12345, dtype)
    path = disk_dir / "t.bin"
    assert io.pwrite(t, path) == t.numel() * t.element_size()
    u = torch.empty_like(t)
    assert io.pread(u, path) == t.numel() * t.element_size()
    assert same_bytes(t, u)


@pytest.mark.parametrize(
    "offset,length,address_shift",
    [(0, 1 << 20, 0), (4097, 1 << 20, 0), (0, (1 << 20) + 13, 0), (8192, 1 << 20, 3),
     (1, 1, 0), (123, 0, 0), (4095, 4098, 1), ((5 << 30) + 77, 10000, 5)],
    ids=["aligned", "unaligned-offset", "unaligned-length", "unaligned-address", "one-byte",
         "zero-length", "straddling", "beyond-4GiB-sparse"],
)
def test_alignment_cases(io: IOHandle, disk_dir: Path, offset: int, length: int,
                         address_shift: int) -> None:
    path = disk_dir / "a.bin"
    src = torch.randint(0, 256, (length + address_shift,), dtype=torch.uint8)
    assert io.pwrite(src[address_shift:], path, offset) == length
    dst = torch.zeros(length + address_shift, dtype=torch.uint8)
    fut = io.pread_async(dst[address_shift:], path, offset)
    assert fut.wait() == length
    assert torch.equal(src[address_shift:], dst[address_shift:])
    stats = fut.result().stats
    assert stats["transferred_bytes"] == length
    assert stats["direct_bytes"] + stats["buffered_bytes"] == length
    if length:
        assert os.path.getsize(path) == offset + length


def test_unaligned_address_uses_bounce(disk_dir: Path) -> None:
    with IOHandle("threads", page_cache_check=False) as io:
        path = disk_dir / "b.bin"
        src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
        io.pwrite(src, path)
        dst = torch.zeros((1 << 20) + 1, dtype=torch.uint8)
        fut = io.pread_async(dst[1:], path)
        fut.wait()
        assert fut.result().stats["bounced_bytes"] > 0
        assert torch.equal(src, dst[1:])



def test_the_engine_names_its_operations() -> None:
    """The extension's words for an engine operation; anything else is named in the error."""
    with IOHandle("threads") as io:
        with pytest.raises(ValueError, match=r"^op must be 'read' or 'write', not 'Read'$"):
            io._core().submit("Read", [], False)

@pytest.mark.parametrize("backend", BACKENDS)
def test_staged_reads_land_exactly_and_are_counted(backend: str, disk_dir: Path) -> None:
    """stage_reads=True reads go through the engine's huge-page buffers where the handle's
    setting allows ("on" always, "off" never), and land exactly as direct reads do."""
    path = disk_dir / "staged.bin"
    src = random_tensor((3 << 20) + 4321, torch.uint8)
    with IOHandle(backend, stage_reads="off", chunk_size=1 << 20) as writer:
        writer.pwrite(src, path)
    for setting, asked, staged in (("on", True, True), ("on", False, False),
                                   ("off", True, False)):
        with IOHandle(backend, stage_reads=setting, chunk_size=1 << 20,
                      page_cache_check=False) as io:
            assert io.options["stage_reads"] == setting
            f = io.open(path)
            # Page-aligned memory (O_DIRECT would take it as it is) and a tensor's.
            sizes = (len(src) - 4096, 4096, 1, 70000)
            outs = [tensortier.aligned_empty(n, torch.uint8) for n in sizes[:3]]
            outs.append(torch.empty(sizes[3], dtype=torch.uint8))
            offsets = [4096, 8192, len(src) - 1, 5000]
            fut = io.pread_batch_async(list(zip(outs, [f] * 4, offsets)), stage_reads=asked)
            fut.wait()
            for out, offset in zip(outs, offsets):
                assert same_bytes(out, src[offset:offset + len(out)])
            stats = fut.result().stats
            assert stats["direct_bytes"] > 0
            assert (stats["staged_bytes"] > 0) == staged, (setting, asked, stats)
            assert stats["staged_bytes"] <= stats["bounced_bytes"] <= stats["direct_bytes"]


def test_stage_reads_setting_comes_from_the_environment_and_is_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TENSORTIER_STAGE_READS", raising=False)
    with IOHandle() as io:
        assert io.options["stage_reads"] == "auto"
    with IOHandle(stage_reads=True) as on, IOHandle(stage_reads=False) as off:
        assert (on.options["stage_reads"], off.options["stage_reads"]) == ("on", "off")
    monkeypatch.setenv("TENSORTIER_STAGE_READS", "0")
    with IOHandle() as io:
        assert io.options["stage_reads"] == "off"
    assert any(row["env"] == "TENSORTIER_STAGE_READS" for row in tensortier.defaults())
    with pytest.raises(ValueError, match="stage_reads"):
        IOHandle(stage_reads="sometimes")
    # Words in any case, as the environment's are taken.
    with IOHandle(stage_reads="AUTO") as auto, IOHandle(backend="THREADS") as threads:
        assert (auto.options["stage_reads"], threads.options["backend"]) == ("auto", "threads")
        assert threads.backend == "threads"
    with pytest.raises(ValueError, match="backend: 'io-uring' is not one of auto, io_uring"):
        IOHandle(backend="io-uring")
    monkeypatch.setenv("TENSORTIER_STAGE_READS", "always")
    with pytest.raises(ValueError, match="TENSORTIER_STAGE_READS"):
        IOHandle()


def _bounce_bytes_become(io: IOHandle, expected: int, timeout: float = 20.0) -> bool:
    """Polls until `io` holds `expected` bytes of bounce buffers; False after `timeout` s."""
    deadline = time.monotonic() + timeout
    while io.bounce_bytes != expected:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


@pytest.mark.parametrize("backend", BACKENDS)
def test_bounce_buffers_are_kept_for_the_next_burst_then_freed(
    backend: str, disk_dir: Path
) -> None:
    """A burst of reads into memory O_DIRECT cannot use makes one bounce buffer per chunk in
    flight; an idle worker keeps them for bounce_idle_ms, then frees all but two."""
    chunk, burst = 1 << 20, 8 << 20
    path = disk_dir / "bounce.bin"
    src = random_tensor(burst, torch.uint8)
    with IOHandle(backend) as writer:
        writer.pwrite(src, path)
    settings = dict(chunk_size=chunk, workers=1, max_inflight_bytes=burst, page_cache_check=False)
    for idle_ms in (60_000, 0):
        with IOHandle(backend, bounce_idle_ms=idle_ms, **settings) as io:
            assert io.options["bounce_idle_ms"] == idle_ms
            assert io.bounce_bytes == 0
            f = io.open(path)
            if not f.direct:
                pytest.skip(f"no O_DIRECT here: {f.direct_fallback_reason}")
            dst = torch.empty(burst + 1, dtype=torch.uint8)[1:]  # odd address: bounced
            n = burst // chunk
            for repeat in range(2):
                fut = io.pread_async(dst, f)
                fut.wait()
                assert fut.result().stats["bounced_bytes"] == burst
                assert same_bytes(dst, src)
                # Kept: the second burst reuses all n. Freed down to two: it makes n - 2 again.
                made = n if idle_ms or repeat == 0 else n + (n - 2)
                assert io._core().bounce_allocations == made
                if idle_ms:
                    assert io.bounce_bytes == burst
                else:
                    assert _bounce_bytes_become(io, 2 * chunk), io.bounce_bytes


def test_bounce_idle_setting_comes_from_the_environment_and_is_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TENSORTIER_BOUNCE_IDLE_MS", raising=False)
    with IOHandle() as io:
        assert io.options["bounce_idle_ms"] == 1000
    assert any(row["env"] == "TENSORTIER_BOUNCE_IDLE_MS" and row["value"] == "1000"
               for row in tensortier.defaults())
    monkeypatch.setenv("TENSORTIER_BOUNCE_IDLE_MS", "40")
    with IOHandle() as io, IOHandle(bounce_idle_ms=7) as given:
        assert (io.options["bounce_idle_ms"], given.options["bounce_idle_ms"]) == (40, 7)
    for bad in (-1, 3_600_001, 1.5, True, "10"):
        with pytest.raises(ValueError, match="bounce_idle_ms"):
            IOHandle(bounce_idle_ms=bad)  # type: ignore[arg-type]
    monkeypatch.setenv("TENSORTIER_BOUNCE_IDLE_MS", "1s")
    with pytest.raises(ValueError, match="TENSORTIER_BOUNCE_IDLE_MS"):
        IOHandle()


def test_read_past_eof(io: IOHandle, disk_dir: Path) -> None:
    path = disk_dir / "short.bin"
    path.write_bytes(b"x" * 10000)
    buf = bytearray(b"\xee" * 50000)
    fut = io.pread_async(buf, path, 4000)
    assert fut.wait() == 6000
    assert fut.result().stats["eof"]
    assert buf[:6000] == b"x" * 6000
    assert buf[6000:] == b"\xee" * 44000  # untouched
    assert io.pread(bytearray(10), path, 20000) == 0


def test_fallback_when_o_direct_refused(no_direct_dir: Path) -> None:
    with IOHandle() as io:
        f = io.open(no_direct_dir / "f.bin", "w")
        assert not f.direct
        assert "O_DIRECT" in f.direct_fallback_reason
        t = random_tensor(100000, torch.float32)
        assert io.pwrite(t, f) == 400000
        u = torch.empty_like(t)
        fut = io.pread_async(u, f)
        fut.wait()
        assert same_bytes(t, u)
        stats = fut.result().stats
        assert stats["direct_fallback"] and stats["direct_bytes"] == 0


def test_page_cache_resident_data_read_buffered(disk_dir: Path) -> None:
    path = disk_dir / "warm.bin"
    data = os.urandom(8 << 20)
    path.write_bytes(data)  # buffered write: resident in the page cache
    with IOHandle(chunk_size=1 << 20) as io:
        buf = bytearray(len(data))
        fut = io.pread_async(buf, path)
        fut.wait()
        stats = fut.result().stats
        assert buf == data
        assert stats["cached_bytes"] == len(data) and stats["direct_bytes"] == 0
        f = io.open(path, "r")
        f.datasync()
        f.drop_cache()
        fut = io.pread_async(buf, f)
        fut.wait()
        assert fut.result().stats["cached_bytes"] == 0
        assert fut.result().stats["direct_bytes"] == len(data)
        assert buf == data


def test_batch_scatter_gather(io: IOHandle, disk_dir: Path) -> None:
    files = [io.open(disk_dir / f"f{i}.bin", "w") for i in range(3)]
    pieces = [(os.urandom(1000 + 517 * i), files[i % 3], 20000 * (i // 3)) for i in range(30)]
    fut = io.pwrite_batch_async(pieces)
    assert fut.wait() == sum(len(p[0]) for p in pieces)
    outs = [bytearray(len(p[0])) for p in pieces]
    fut = io.pread_batch_async([(o, p[1], p[2]) for o, p in zip(outs, pieces)])
    fut.wait()
    assert fut.result().segment_bytes == [len(p[0]) for p in pieces]
    assert all(bytes(o) == p[0] for o, p in zip(outs, pieces))


def test_numpy_memoryview_and_dlpack(io: IOHandle, disk_dir: Path) -> None:
    path = disk_dir / "np.bin"
    a = np.arange(10000, dtype=np.float64)
    io.pwrite(a, path)
    b = np.zeros_like(a)
    io.pread(memoryview(b), path)
    assert np.array_equal(a, b)

    class DlpackOnly:  # exposes only __dlpack__, like a CPU CuPy/JAX array
        def __init__(self, arr: np.ndarray) -> None:
            self.arr = arr

        def __dlpack__(self, **kwargs):  # type: ignore[no-untyped-def]
            return self.arr.__dlpack__(**kwargs)

        def __dlpack_device__(self):  # type: ignore[no-untyped-def]
            return self.arr.__dlpack_device__()

    c = np.zeros_like(a)
    io.pread(DlpackOnly(c), path)
    assert np.array_equal(a, c)


def test_aligned_empty() -> None:
    t = tensortier.aligned_empty((3, 1000), torch.float32)
    assert t.shape == (3, 1000) and t.dtype == torch.float32
    assert t.data_ptr() % 4096 == 0
    t.fill_(1.5)
    assert float(t.sum()) == 4500.0
    assert tensortier.aligned_empty(0).numel() == 0
    with pytest.raises(ValueError):
        tensortier.aligned_empty((-1, 2))
    assert tensortier.aligned_empty(range(1, 4)).shape == (1, 2, 3)
    assert tensortier.aligned_empty(torch.Size([2, 3]), torch.int16).shape == (2, 3)
    for bad in (2.5, (2, "x"), "12"):
        with pytest.raises(TypeError, match="shape must be"):
            tensortier.aligned_empty(bad)
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        tensortier.aligned_empty(4, "float32")


@pytest.mark.parametrize("nbytes", [1, 4097, 9 << 20])
def test_aligned_empty_resident_has_its_pages_before_first_use(
    nbytes: int, resident_bytes: Callable[[torch.Tensor], int]
) -> None:
    lazy = tensortier.aligned_empty(nbytes, reused=True)
    assert resident_bytes(lazy) == 0  # before the next mapping, which a huge page may span
    resident = tensortier.aligned_empty(nbytes, reused=True, resident=True)
    assert resident_bytes(resident) == -(-nbytes // 4096) * 4096
    assert int(resident.count_nonzero()) == 0  # still zero-filled
    assert tensortier.aligned_empty(0, resident=True).numel() == 0


def test_aligned_empty_too_large_is_memory_error() -> None:
    with pytest.raises(MemoryError, match=str(1 << 60)):
        tensortier.aligned_empty(1 << 60, resident=True)
    # Byte counts past what a size_t holds: the same MemoryError, not pybind11's TypeError.
    for shape, dtype in [((1 << 62,), torch.float32), ((1 << 32, 1 << 32), torch.uint8),
                         ((1 << 70,), torch.uint8)]:
        with pytest.raises(MemoryError, match="cannot allocate"):
            tensortier.aligned_empty(shape, dtype)


_HUGE_PAGE_PROBE = """
import sys, tensortier
def vm_flags(address):
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not line.startswith("VmFlags"):
                lo, _, hi = head.partition("-")
                try:
                    inside = int(lo, 16) <= address < int(hi, 16)
                except ValueError:
                    pass
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    return []
once = tensortier.aligned_empty(8 << 20)
reused = tensortier.aligned_empty(8 << 20, reused=True)
print("hg" in vm_flags(once.data_ptr()), "hg" in vm_flags(reused.data_ptr()))
print(tensortier._core.huge_pages_policy())
"""


@pytest.mark.parametrize(
    "value, expect", [("1", "True True"), ("0", "False False"), (None, None)]
)
def test_huge_pages_policy(value: str | None, expect: str | None) -> None:
    """Reused buffers ask for huge pages; buffers filled once do unless the VM reports free
    pages to its host; TENSORTIER_HUGE_PAGES overrides both (MADV_HUGEPAGE shows as "hg")."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TENSORTIER_HUGE_PAGES"}
    if value is not None:
        env["TENSORTIER_HUGE_PAGES"] = value
    out = subprocess.run([sys.executable, "-c", _HUGE_PAGE_PROBE], env=env, capture_output=True,
                         text=True, check=True).stdout.splitlines()
    if expect is not None:
        assert out[0] == expect and out[1] == f"TENSORTIER_HUGE_PAGES={value}"
    else:
        reports = "reports free pages" in out[1]
        assert out[0] == ("False True" if reports else "True True"), out


def test_huge_pages_bad_value() -> None:
    import subprocess
    import sys

    env = dict(os.environ, TENSORTIER_HUGE_PAGES="maybe")
    proc = subprocess.run([sys.executable, "-c", _HUGE_PAGE_PROBE], env=env,
                          capture_output=True, text=True)
    assert proc.returncode != 0
    assert "ValueError: TENSORTIER_HUGE_PAGES=maybe is invalid" in proc.stderr
    assert "(allowed: auto, 0, 1; also true/on/yes for 1, false/off/no for 0)" in proc.stderr
    # The engine settles the policy when it starts: an error there, not on a worker thread.
    probe = ("import tensortier\ntry:\n    tensortier.IOHandle()\nexcept ValueError as e:\n"
             "    print('ValueError', e)\n")
    proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "ValueError TENSORTIER_HUGE_PAGES=maybe is invalid" in proc.stdout


def test_bad_input(disk_dir: Path) -> None:
    path = disk_dir / "x.bin"
    path.write_bytes(b"0" * 100)
    with IOHandle() as io:
        with pytest.raises(ValueError, match="not contiguous"):
            io.pread(torch.zeros(10, 10).t(), path)
        with pytest.raises(ValueError, match="read-only"):
            io.pread(b"immutable", path)
        with pytest.raises(ValueError, match="offset"):
            io.pread(bytearray(4), path, -1)
        with pytest.raises(TypeError, match="offset"):
            io.pread(bytearray(4), path, 1.5)  # type: ignore[arg-type]
        with pytest.raises(FileNotFoundError) as e:
            io.pread(bytearray(4), disk_dir / "missing.bin")
        assert e.value.errno == errno.ENOENT and "missing.bin" in str(e.value)
        with pytest.raises(TypeError, match="not a tensor"):
            io.pread(12345, path)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="file must be"):
            io.pread(bytearray(4), 42)  # type: ignore[arg-type]
        ro = io.open(path, "r")
        with pytest.raises(OSError) as e:
            io.pwrite(b"abc", ro)
        assert e.value.errno == errno.EBADF
        with pytest.raises(ValueError, match="mode"):
            io.open(path, "x")
        with pytest.raises(TypeError, match="mode must be a str"):
            io.open(path, 3)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="direct must be True or False"):
            io.open(path, "r", direct="yes")  # type: ignore[arg-type]
        assert io.open(path, "r", direct=0).direct is False
        with pytest.raises(IsADirectoryError):
            io.open(disk_dir, "r")
        # A batch's pieces are (buffer, file, offset): a buffer given alone (a tensor or array of
        # three elements unpacks as one) or a piece short of its offset says so, naming it.
        for bad in ([torch.zeros(3)], [np.zeros(3)], [(bytearray(4), path)], [bytearray(4)]):
            with pytest.raises(TypeError, match=r"piece 0 .*\(buffer, file, offset\)"):
                io.pread_batch_async(bad)
        with pytest.raises(TypeError, match=r"piece 1 "):
            io.pwrite_batch_async([(b"ab", path, 0), (b"cd", path)])
    with pytest.raises(ValueError, match="closed"):
        io.pread(bytearray(4), path)
    with pytest.raises(ValueError, match="backend"):
        IOHandle("nvme-magic")
    with pytest.raises(ValueError, match="chunk_size"):
        IOHandle(chunk_size=1000)
    with pytest.raises(ValueError, match="queue_depth"):
        IOHandle(queue_depth=0)
    # Wrong types name the argument (not pybind's listing of the binding's signature).
    with pytest.raises(TypeError, match="backend must be a str"):
        IOHandle(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="stage_reads must be"):
        IOHandle(stage_reads=2.5)  # type: ignore[arg-type]
    # 0 and 1 are off and on, as for the flags (what a config file hands over).
    for flag, word in ((1, "on"), (0, "off"), (np.bool_(True), "on")):
        with IOHandle(stage_reads=flag) as io:  # type: ignore[arg-type]
            assert io.options["stage_reads"] == word


def test_environment_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TENSORTIER_CHUNK_SIZE", "2M")
    monkeypatch.setenv("TENSORTIER_WORKERS", "3")
    with IOHandle() as io:
        assert io.options["chunk_size"] == 2 << 20 and io.options["workers"] == 3
    rows = {r["env"]: r["value"] for r in tensortier.defaults()}
    assert rows["TENSORTIER_CHUNK_SIZE"] == "2 MiB"
    monkeypatch.setenv("TENSORTIER_QUEUE_DEPTH", "many")
    with pytest.raises(ValueError, match="TENSORTIER_QUEUE_DEPTH"):
        IOHandle()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("err", [errno.EIO, errno.ENOSPC])
def test_injected_errors_raise_and_handle_stays_usable(disk_dir: Path, backend: str,
                                                       err: int) -> None:
    path = disk_dir / "fault.bin"
    data = os.urandom(3 << 20)
    fault = {"kind": "error", "errno": err, "nth": 2, "writes": err == errno.ENOSPC,
             "reads": err == errno.EIO}
    with with_faults(fault, IOHandle, backend, chunk_size=1 << 20) as io:
        if err == errno.EIO:
            path.write_bytes(data)
            with pytest.raises(OSError) as e:
                io.pread(bytearray(len(data)), path)
        else:
            with pytest.raises(OSError) as e:
                io.pwrite(data, path)
        assert e.value.errno == err
        assert e.value.filename == str(path)
        assert "offset" in str(e.value) and "length" in str(e.value)
        # The fault was one request; the same handle works afterwards.
        io.pwrite(data, path)
        buf = bytearray(len(data))
        assert io.pread(buf, path) == len(data) and buf == data


@pytest.mark.parametrize("short_bytes", [0, 1000])
def test_injected_short_io_is_continued(disk_dir: Path, short_bytes: int) -> None:
    path = disk_dir / "short.bin"
    data = os.urandom((2 << 20) + 333)
    fault = {"kind": "short", "nth": 1, "count": 4, "short_bytes": short_bytes}
    with with_faults(fault, IOHandle, "threads", chunk_size=1 << 20, page_cache_check=False) as io:
        fut = io.pwrite_async(data, path, 7)
        assert fut.wait() == len(data)
        assert fut.result().stats["resubmits"] > 0
        buf = bytearray(len(data))
        assert io.pread(buf, path, 7) == len(data)
        assert buf == data


def test_wait_all_raises_unseen_error(disk_dir: Path) -> None:
    path = disk_dir / "w.bin"
    path.write_bytes(os.urandom(1 << 20))
    with with_faults({"kind": "error", "nth": 1, "writes": False}, IOHandle, "threads") as io:
        io.pread_async(bytearray(1 << 20), path)
        with pytest.raises(OSError):
            io.wait_all()
        io.wait_all()  # seen once: not raised again


def test_gil_released_during_io(disk_dir: Path) -> None:
    path = disk_dir / "slow.bin"
    path.write_bytes(b"z" * 4096)
    ticks = 0
    stop = threading.Event()

    def spin() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            time.sleep(0.001)

    with with_faults({"kind": "delay", "delay_us": 300000, "nth": 1}, IOHandle, "threads") as io:
        spinner = threading.Thread(target=spin)
        spinner.start()
        start_ticks = ticks
        io.pread(bytearray(4096), path)  # blocks ~0.3 s inside C++
        during = ticks - start_ticks
        stop.set()
        spinner.join()
    assert during > 10  # the other thread ran while we waited


def test_concurrent_threads(disk_dir: Path) -> None:
    path = disk_dir / "conc.bin"
    n_threads, per_thread, size = 6, 20, 50000
    with IOHandle() as io:
        f = io.open(path, "w")

        def worker(k: int) -> None:
            for i in range(per_thread):
                off = (k * per_thread + i) * size
                payload = bytes([(k * 31 + i) % 256]) * size
                io.pwrite(payload, f, off)
                back = bytearray(size)
                assert io.pread(back, f, off) == size
                assert back == payload

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        whole = bytearray(n_threads * per_thread * size)
        assert io.pread(whole, f) == len(whole)
        for k in range(n_threads):
            for i in range(per_thread):
                off = (k * per_thread + i) * size
                assert whole[off:off + size] == bytes([(k * 31 + i) % 256]) * size


def test_dropped_future_keeps_buffer_alive(disk_dir: Path) -> None:
    path = disk_dir / "drop.bin"
    path.write_bytes(os.urandom(4 << 20))
    with IOHandle() as io:
        for _ in range(20):
            io.pread_async(bytearray(4 << 20), path)  # buffer referenced only by the future
        io.wait_all()


def test_a_finished_read_of_a_path_holds_no_descriptor(disk_dir: Path) -> None:
    """A file opened for a path closes when the read ends, not when its future is waited (every
    un-waited read held two descriptors: EMFILE after ~500 under ulimit -n 1024); KvikIO's
    futures hold none either."""
    path = disk_dir / "src.bin"
    path.write_bytes(os.urandom(1 << 20))
    with IOHandle() as io:
        before = len(os.listdir("/proc/self/fd"))
        futures = [io.pread_async(bytearray(100), path, i * 100) for i in range(200)]
        deadline = time.monotonic() + 60
        while not all(f.done() for f in futures) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(f.done() for f in futures)
        # The engine lets go of a piece's file just after it reports the piece: a moment.
        while len(os.listdir("/proc/self/fd")) > before + 10 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(os.listdir("/proc/self/fd")) <= before + 10
        assert [f.wait() for f in futures] == [100] * 200


def test_a_file_is_a_context_manager_and_says_when_closed(disk_dir: Path) -> None:
    """``with io.open(path) as f:`` closes f, as Python's files and KvikIO's CuFile do; a closed
    File raises ValueError, as a closed Python file does."""
    path = disk_dir / "f.bin"
    path.write_bytes(b"abc")
    with IOHandle() as io:
        with io.open(path, "r") as f:
            assert f.size() == 3 and not f.closed
        assert f.closed
        properties = [lambda name=name: getattr(f, name) for name in (
            "path", "writable", "direct", "direct_fallback_reason", "offset_alignment",
            "memory_alignment")]
        for call in (f.size, f.fileno, f.datasync, f.drop_cache, lambda: f.truncate(0),
                     lambda: f.allocate(0, 1), *properties):
            with pytest.raises(ValueError, match="I/O operation on closed file"):
                call()
        with pytest.raises(ValueError):
            io.pread(bytearray(3), f)
    assert path.read_bytes() == b"abc"


# ---- errors are raised once, never lost ---------------------------------------------------------


def test_error_of_a_dropped_future_is_raised_by_wait_all(disk_dir: Path) -> None:
    """A failed operation whose future was dropped unwaited: its error is raised by the next
    wait_all() (and close()), even after later operations pruned finished futures."""
    path = disk_dir / "dropped.bin"
    path.write_bytes(os.urandom(1 << 20))
    fault = {"kind": "error", "errno": errno.EIO, "nth": 1, "writes": False}
    io = with_faults(fault, IOHandle, "threads")
    io.pread_async(bytearray(1 << 20), path)  # fails; the future is dropped at once
    time.sleep(0.2)
    io.pwrite(b"x" * 10, path, 0)  # a later submission prunes finished futures
    with pytest.raises(OSError) as e:
        io.wait_all()
    assert e.value.errno == errno.EIO
    io.wait_all()  # raised once
    io.close()


def test_notes_where_python_has_no_add_note() -> None:
    """Python 3.10 (supported) has no BaseException.add_note and prints no __notes__."""
    from tensortier._notes import add_note

    class Old:  # stands in for a Python 3.10 exception
        pass

    old = Old()
    with pytest.warns(RuntimeWarning, match="closing the IOHandle raised"):
        add_note(old, "closing the IOHandle raised: EIO")
    assert old.__notes__ == ["closing the IOHandle raised: EIO"]  # type: ignore[attr-defined]
    e = ValueError("x")
    add_note(e, "a note")
    assert e.__notes__ == ["a note"]


def test_boolean_settings_take_bools_and_0_1_but_not_words(disk_dir: Path) -> None:
    import numpy

    for value in (True, False, 1, 0, numpy.True_, numpy.False_):
        IOHandle("threads", page_cache_check=value, direct=value).close()
    for value in ("no", "yes", 2, 0.5):
        with pytest.raises(TypeError, match="page_cache_check must be True or False"):
            IOHandle("threads", page_cache_check=value)


def test_a_failing_with_block_keeps_its_exception_over_a_dropped_operations(
    disk_dir: Path,
) -> None:
    """The block's own exception is what propagates; the error of an operation it dropped is
    a note on it (without the block failing, close() raises that error as before)."""
    path = disk_dir / "dropped.bin"
    path.write_bytes(os.urandom(1 << 20))
    fault = {"kind": "error", "errno": errno.EIO, "nth": 1, "writes": False}
    with pytest.raises(KeyError) as e:
        with with_faults(fault, IOHandle, "threads") as io:
            io.pread_async(bytearray(1 << 20), path)  # fails; the future is dropped
            time.sleep(0.2)
            raise KeyError("the block's own error")
    assert any("closing the IOHandle raised" in n and ("EIO" in n or "Input/output" in n)
               for n in getattr(e.value, "__notes__", [])), getattr(e.value, "__notes__", None)
    with pytest.raises(OSError):
        with with_faults(fault, IOHandle, "threads") as io:
            io.pread_async(bytearray(1 << 20), path)


def test_an_error_already_raised_is_not_raised_again(disk_dir: Path) -> None:
    """An error the caller caught from wait() is not raised again by wait_all(), close() or the
    context manager's exit."""
    path = disk_dir / "seen.bin"
    path.write_bytes(os.urandom(8192))
    fault = {"kind": "error", "errno": errno.EIO, "nth": 1, "writes": False}
    with with_faults(fault, IOHandle, "threads") as io:
        fut = io.pread_async(bytearray(8192), path)
        with pytest.raises(OSError):
            fut.wait()
        with pytest.raises(OSError):  # the future itself still says so
            fut.result()
        io.wait_all()
    # A second failure, not waited for: close() raises it.
    io = with_faults(fault, IOHandle, "threads")
    io.pread_async(bytearray(8192), path)
    with pytest.raises(OSError):
        io.close()


def test_a_tensor_whose_storage_is_swapped_meanwhile_keeps_the_memory(disk_dir: Path) -> None:
    """``t.set_(...)`` (or ``param.data = ...``) while a read into `t` runs must not free the
    memory the engine writes: another tensor could get it."""
    n = 32 << 10
    path = disk_dir / "swap.bin"
    path.write_bytes(b"\xab" * n)
    with with_faults({"kind": "delay", "delay_us": 300_000, "nth": 1}, IOHandle, "threads") as io:
        t = torch.empty(n, dtype=torch.uint8)
        fut = io.pread_async(t, path)
        old = t.untyped_storage()
        t.set_(torch.empty(0, dtype=torch.uint8))
        del old
        others = [torch.zeros(n, dtype=torch.uint8) for _ in range(8)]  # would reuse it
        assert fut.wait() == n
        assert all(int(o.count_nonzero()) == 0 for o in others)


def test_conjugate_and_negative_views_are_refused(disk_dir: Path) -> None:
    """Their memory holds the conjugates (negatives) of their values: writing would store other
    numbers, reading into them would change them."""
    x = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    with IOHandle("threads") as io:
        for view, word in ((x.conj(), "conjugate"), (x.imag._neg_view(), "negative")):
            with pytest.raises(ValueError, match=f"{word} view.*resolve"):
                io.pwrite(view, disk_dir / "v.bin")
            with pytest.raises(ValueError, match=word):
                io.pread(view, disk_dir / "v.bin")
        io.pwrite(x.conj().resolve_conj(), disk_dir / "v.bin")
        back = torch.empty_like(x)
        io.pread(back, disk_dir / "v.bin")
        assert torch.equal(back, x.conj())


def test_offset_and_buffer_argument_errors(disk_dir: Path) -> None:
    np = pytest.importorskip("numpy")
    path = disk_dir / "o.bin"
    with IOHandle("threads") as io:
        assert io.pwrite(b"abcd", path, np.int64(3)) == 4  # numpy integers are offsets
        with pytest.raises(ValueError, match="2\\*\\*63"):
            io.pwrite(b"abcd", path, 2**64)
        with pytest.raises(TypeError, match="offset must be an int"):
            io.pwrite(b"abcd", path, 1.5)
        with pytest.raises(TypeError, match="not a tensor"):
            io.pwrite(torch.UntypedStorage(16), path)
        with pytest.raises(ValueError, match="layout"):
            io.pwrite(torch.eye(3).to_sparse(), path)


# ---- fork -----------------------------------------------------------------------------------


FORK_CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    import torch, tensortier
    d = sys.argv[1]
    io = tensortier.IOHandle("threads")
    io.pwrite(torch.arange(1000), os.path.join(d, "parent.bin"))
    pending = io.pread_async(torch.empty(1000, dtype=torch.int64), os.path.join(d, "parent.bin"))
    off = tensortier.DiskOffloader(os.path.join(d, "off"))
    t = torch.randn(10000)
    ref = t.clone()
    off.sync_write(t)
    backing = sorted(os.listdir(os.path.join(d, "off")))
    pid = os.fork()
    if pid == 0:
        signal.alarm(20)  # a hang ends as SIGALRM
        code = 0
        try:
            io.pwrite(torch.ones(10), os.path.join(d, "child.bin"))
            code = 1
        except ValueError as e:
            if "fork" not in str(e):
                code = 2
        del pending  # an inherited future: dropping it must not wait for the parent's I/O
        io.close()
        sys.exit(code)  # atexit closes the inherited offloader: the parent's files stay
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status), f"the child hung or crashed: {status}"
    assert os.WEXITSTATUS(status) == 0, os.WEXITSTATUS(status)
    assert sorted(os.listdir(os.path.join(d, "off"))) == backing
    off.sync_read(t)
    assert torch.equal(t, ref)
    io.wait_all()
    print("ok")
    """
)


def test_a_forked_child_neither_hangs_nor_touches_the_parents_state(disk_dir: Path) -> None:
    """A child made by fork() (DataLoader workers, multiprocessing) inherits IOHandles and
    DiskOffloaders whose threads it does not have: using one raises, dropping or closing one
    neither waits (that hung) nor removes the parent's files (atexit did)."""
    done = subprocess.run(
        [sys.executable, "-c", FORK_CHILD, str(disk_dir)],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "ok"


def test_a_batch_whose_cuda_piece_fails_starts_nothing(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every CUDA piece's buffer and stream are made before any piece starts: one failing leaves
    nothing running, nothing pending and nothing written. (A CUDA piece the transfer refuses
    once others started is test_fake_driver.py's: those that started stay recorded.)"""
    from tensortier import io as io_module

    marker = torch.empty(0)  # stands for a CUDA tensor
    monkeypatch.setattr(io_module, "is_cuda_tensor", lambda b: b is marker)

    def refuse(b: object, own_stream: bool = False) -> None:
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(io_module, "device_buffer", refuse)
    path = disk_dir / "partial.bin"
    with IOHandle(backend="threads") as io:
        with pytest.raises(RuntimeError, match="out of memory"):
            io.pwrite_batch_async([(torch.arange(1 << 16, dtype=torch.int32), path, 0),
                                   (marker, path, 1 << 20)])
        assert len(io._pending) == 0
    assert path.stat().st_size == 0


INTERRUPT_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    # Ctrl-C as an interactive process gets it, whatever disposition or mask the parent left.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    import tensortier
    from tensortier._testing import with_faults
    path = sys.argv[1]
    data = os.urandom(1 << 20)
    with open(path, "wb") as f:
        f.write(data)
    io = with_faults({"kind": "delay", "delay_us": 10_000_000, "nth": 1}, tensortier.IOHandle,
                     "threads")
    buf = bytearray(len(data))
    fut = io.pread_async(buf, path)
    threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    start = time.monotonic()
    try:
        fut.wait()
        print("not interrupted")
    except KeyboardInterrupt:
        print(f"interrupted after {time.monotonic() - start:.2f}")
    assert fut.wait() == len(data) and buf == data  # the read went on, into memory kept alive
    io.close()
    """
)


def test_ctrl_c_interrupts_a_wait(disk_dir: Path) -> None:
    """A wait answers Ctrl-C at once (the C++ wait ignored signals until the operation was
    over); the operation goes on and can be waited for again."""
    require_faults()
    done = subprocess.run(
        [sys.executable, "-c", INTERRUPT_SCRIPT, str(disk_dir / "slow.bin")],
        capture_output=True, text=True, timeout=60, start_new_session=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    words = done.stdout.split()
    assert words[:2] == ["interrupted", "after"], done.stdout
    # Well before the 10 s the read takes (a loaded machine runs the timer late).
    assert float(words[2]) < 5, done.stdout


def test_an_interrupt_is_never_an_operations_outcome(disk_dir: Path, alarm_interrupt) -> None:  # type: ignore[no-untyped-def]
    """Ctrl-C arriving as the operation finishes: the next result() gives the result, not the
    KeyboardInterrupt again."""
    path = disk_dir / "ki.bin"
    path.write_bytes(b"x" * 4096)
    with with_faults({"kind": "delay", "delay_us": 300_000, "nth": 1}, IOHandle, "threads") as io:
        buf = bytearray(4096)
        fut = io.pread_async(buf, path)
        alarm_interrupt(0.1, linger=0.4)  # the read is over when the interrupt is raised
        with pytest.raises(KeyboardInterrupt):
            fut.result()
        assert fut.result().bytes == 4096 and buf == b"x" * 4096


def _fifo_file(io: IOHandle, disk_dir: Path) -> "tensortier.File":
    fifo = disk_dir / "fifo"
    os.mkfifo(fifo)
    return io.open(fifo, "r+", direct=False)  # its reads fail (ESPIPE), none reaching a backend


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_fifo_is_read_and_written_by_no_backend(disk_dir: Path, backend: str) -> None:
    """A FIFO has no offsets: io_uring and libaio would wait in its read for a writer forever
    (and Ctrl-C could not end the process), and "write" bytes into it that nobody asked for.
    Every backend raises ESPIPE for both, naming the file."""
    fifo = disk_dir / "fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a write could go somewhere
    try:
        with IOHandle(backend) as io:
            for call in (io.pread, io.pwrite):
                with pytest.raises(OSError) as e:
                    call(bytearray(4096), str(fifo))
                assert e.value.errno == errno.ESPIPE and e.value.filename == str(fifo)
                assert "FIFO" in str(e.value)
        try:  # nothing was written into it: nothing to read (EOF once no writer is left)
            left = os.read(reader, 4096)
        except BlockingIOError:
            left = b""
        assert left == b""
    finally:
        os.close(reader)


def test_an_interrupted_wait_all_loses_no_error(disk_dir: Path, alarm_interrupt) -> None:  # type: ignore[no-untyped-def]
    path = disk_dir / "slow.bin"
    path.write_bytes(b"x" * 4096)
    io = with_faults({"kind": "delay", "delay_us": 500_000, "nth": 1}, IOHandle, "threads",
                     workers=1)
    io.pread_async(bytearray(4096), _fifo_file(io, disk_dir), 0)  # fails; future dropped
    io.pread_async(bytearray(4096), path)  # slow
    alarm_interrupt(0.2)
    with pytest.raises(KeyboardInterrupt):
        io.wait_all()
    with pytest.raises(OSError) as e:
        io.wait_all()
    assert e.value.errno == errno.ESPIPE
    io.close()  # raised once: not again


def test_an_error_is_raised_once_with_wait_all_on_another_thread(disk_dir: Path) -> None:
    """A wait_all() running on another thread while a new operation fails must not take that
    error from the engine as well: it is raised once, by the next wait_all()."""
    path = disk_dir / "g.bin"
    path.write_bytes(b"x" * 8192)
    io = with_faults({"kind": "delay", "delay_us": 500_000, "nth": 1}, IOHandle, "threads")
    io.pread_async(bytearray(4096), path)  # slow
    outcome: list[str] = []

    def wait_all() -> None:
        try:
            io.wait_all()
            outcome.append("ok")
        except OSError as e:
            outcome.append(f"errno {e.errno}")

    waiter = threading.Thread(target=wait_all)
    waiter.start()
    time.sleep(0.15)
    io.pread_async(bytearray(4096), _fifo_file(io, disk_dir), 0)  # fails meanwhile
    waiter.join()
    raised = 0 if outcome == ["ok"] else 1
    try:
        io.wait_all()
    except OSError as e:
        assert e.errno == errno.ESPIPE
        raised += 1
    io.close()
    assert raised == 1, outcome


def test_several_errors_are_counted_on_the_first(disk_dir: Path) -> None:
    with IOHandle("threads") as io:
        fifo = _fifo_file(io, disk_dir)
        for _ in range(3):
            io.pread_async(bytearray(16), fifo, 0)
        with pytest.raises(OSError) as e:
            io.wait_all()
        assert "2 other operation(s)" in "".join(getattr(e.value, "__notes__", []))


def test_a_read_counts_as_an_in_place_change_for_autograd(disk_dir: Path) -> None:
    """As ``copy_`` into it would: backward through a tensor changed by a read raises instead of
    computing a gradient from the new values."""
    path = disk_dir / "v.bin"
    path.write_bytes(torch.ones(4).numpy().tobytes())
    w = torch.zeros(4, requires_grad=True)
    with IOHandle("threads") as io:
        with torch.no_grad():
            x = w.clone()
        x.requires_grad_()
        y = (x * x).sum()  # saves x for backward
        before = x._version
        io.pread(x.detach(), path)  # the data of x, changed in place
        assert x._version > before
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.backward()


def test_dropping_a_handle_with_io_in_flight_releases_the_gil(disk_dir: Path) -> None:
    """Dropping an IOHandle without close() waits for its I/O in the engine's destructor: other
    Python threads must keep running meanwhile (the default holder waited with the GIL held)."""
    path = disk_dir / "drop.bin"
    path.write_bytes(b"x" * 8192)
    io = with_faults({"kind": "delay", "delay_us": 500_000, "nth": 1}, IOHandle, "threads")
    buf = bytearray(8192)
    fut = io.pread_async(buf, path)  # kept: its own wait is not what is measured
    ticks = 0
    stop = threading.Event()

    def count() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            time.sleep(0.001)

    counter = threading.Thread(target=count)
    counter.start()
    time.sleep(0.05)
    start, before = time.monotonic(), ticks
    io._pending.clear()
    engine, io._engine = io._engine, None
    del engine  # ~Engine waits for the delayed read
    elapsed = time.monotonic() - start
    during = ticks - before
    stop.set()
    counter.join()
    assert elapsed > 0.2, "the read was over before the engine was dropped"
    assert during > 20, f"{during} ticks of another thread in {elapsed:.2f} s"
    assert fut.wait() == 8192 and buf == b"x" * 8192


def test_a_device_transfers_result_says_why_gds_was_not_gpudirect() -> None:
    """A CUDA tensor's transfer result carries its pieces' gds_reason up (a bounce piece: why
    GDS was not used; a "gds" one: cuFile's compatibility mode), as the README says."""
    from tensortier import _core
    from tensortier.io import IOFuture

    def piece(path: str, reason: str) -> _core.DeviceJob:
        return _core.DeviceJob(4096, path, reason)  # a job done already

    compat = "cuFile compatibility mode (not GPUDirect): no nvidia-fs"
    r = IOFuture(_core.Operation(None, [piece("gds", ""), piece("gds", compat)], [True, True]), [])
    assert r.result().stats["path"] == "gds"
    assert r.result().stats["gds_reason"] == compat
    r = IOFuture(_core.Operation(None, [piece("gds", "")], [True]), [])
    assert r.result().stats["gds_reason"] == ""


def test_out_of_space_is_raised_once_by_the_wait_on_every_filesystem(small_fs: Path) -> None:
    """One rule for out of space: pwrite_async never raises it itself, whether the filesystem
    refuses the space when the engine reserves it at submission (tmpfs, ext4) or while the
    write runs (ext2); the future's wait() raises it, or wait_all()/close() for a dropped
    future, exactly once."""
    path = small_fs / "big.bin"
    big = torch.zeros(8 << 20, dtype=torch.uint8)  # twice the filesystem
    io = IOHandle("threads")
    try:
        fut = io.pwrite_async(big, path)  # must not raise
        with pytest.raises(OSError) as e:
            fut.wait()
        assert e.value.errno == errno.ENOSPC and e.value.filename == str(path)
        with pytest.raises(OSError):  # the same outcome again, from the same future
            fut.result()
        io.wait_all()  # already raised to its waiter: not again
        with pytest.raises(OSError) as e:
            io.pwrite(big, small_fs / "sync.bin")
        assert e.value.errno == errno.ENOSPC
        io.wait_all()
        # A dropped future: its error comes from the next wait_all(), once.
        io.pwrite_async(big, small_fs / "dropped.bin")
        with pytest.raises(OSError) as e:
            io.wait_all()
        assert e.value.errno == errno.ENOSPC
        io.wait_all()
        # The handle still works; what fits is written (the failed writes kept no space).
        small = torch.arange(100_000, dtype=torch.int32)
        assert io.pwrite(small, small_fs / "small.bin") == small.numel() * 4
        back = torch.empty_like(small)
        io.pread(back, small_fs / "small.bin")
        assert torch.equal(back, small)
        # ... and a dropped one's error from close(), once.
        io.pwrite_async(big, small_fs / "dropped2.bin")
        with pytest.raises(OSError) as e:
            io.close()
        assert e.value.errno == errno.ENOSPC
    finally:
        io.close()


def test_a_write_refused_its_space_leaves_the_file_and_the_filesystem_as_they_were(
    small_fs: Path,
) -> None:
    """Where the engine reserves a write's range up front (tmpfs, ext4), a reservation the
    filesystem refuses gives back what it got: ext4 grows the file by what fit before saying
    ENOSPC, which left the file grown and the filesystem full after a write that moved no
    byte. (ext2 refuses while the write runs: what was written stays, as with pwrite(2).)"""
    if small_fs.name == "ext2":
        pytest.skip("ext2 has no fallocate: the write itself runs out of space")
    path = small_fs / "kept.bin"
    path.write_bytes(b"k" * 5000)
    free = shutil.disk_usage(small_fs).free
    big = torch.ones(8 << 20, dtype=torch.uint8)  # twice the filesystem
    with IOHandle("threads") as io:
        for offset in (0, 4096, 5000, 12288):
            with pytest.raises(OSError) as e:
                io.pwrite(big, path, offset)
            assert e.value.errno == errno.ENOSPC
            # The size comes back to where it was (ext4: to the write's offset, a hole, past it).
            assert 5000 <= path.stat().st_size <= max(5000, offset), offset
            assert path.read_bytes()[:5000] == b"k" * 5000
            # (ext4 may keep a block or two of its own bookkeeping)
            assert shutil.disk_usage(small_fs).free >= free - (64 << 10), offset
        # A new file is left empty, and the space is there for the next write.
        with pytest.raises(OSError):
            io.pwrite(big, small_fs / "new.bin")
        assert (small_fs / "new.bin").stat().st_size == 0
        small = torch.arange(200_000, dtype=torch.int32)  # 800 KB: fits only if given back
        assert io.pwrite(small, small_fs / "small.bin") == small.numel() * 4


def test_a_batch_refused_its_space_gives_back_every_piece_it_reserved(small_fs: Path) -> None:
    """The engine reserves a batch's extending writes piece by piece before writing any: when a
    later piece is refused, the earlier ones, which got their space and moved their files'
    sizes, give it back too (nothing was written), each only within its own range and never
    below the size its file had before."""
    if small_fs.name == "ext2":
        pytest.skip("ext2 has no fallocate: the write itself runs out of space")
    kept = small_fs / "kept.bin"
    kept.write_bytes(b"k" * 5000)
    free = shutil.disk_usage(small_fs).free
    fits = torch.ones(1 << 20, dtype=torch.uint8)  # a quarter of the filesystem
    big = torch.ones(8 << 20, dtype=torch.uint8)  # twice the filesystem
    batches = {
        "two files": [(fits, small_fs / "a.bin", 0), (big, small_fs / "b.bin", 0)],
        "one file": [(fits, small_fs / "c.bin", 0), (big, small_fs / "c.bin", 1 << 20)],
        "a file with data": [(fits, kept, 4096), (big, kept, 4096 + (1 << 20))],
    }
    with IOHandle("threads") as io:
        for what, pieces in batches.items():
            with pytest.raises(OSError) as e:
                io.pwrite_batch_async(pieces).wait()
            assert e.value.errno == errno.ENOSPC, what
            for _, path, _ in pieces:
                size = path.stat().st_size
                assert size == (5000 if path == kept else 0), (what, path, size)
            # (ext4 may keep a block or two of its own bookkeeping)
            assert shutil.disk_usage(small_fs).free >= free - (64 << 10), what
        assert kept.read_bytes() == b"k" * 5000
        # The space is there for the next write: all but 256 KiB of what was free.
        most = torch.ones((free - (256 << 10)) // 4096 * 4096, dtype=torch.uint8)
        assert io.pwrite(most, small_fs / "most.bin") == most.numel()


def test_a_batch_refused_its_space_gives_back_a_piece_before_a_gap(small_fs: Path) -> None:
    """Two pieces of one file with a gap between them: when the later one is refused, ext4 has
    moved the size into it, and the size comes back only to that piece's offset (below it, a
    concurrent write may have reserved the gap). The earlier piece, now inside the file, gives
    back its blocks all the same: the file holds no data and takes no space."""
    if small_fs.name == "ext2":
        pytest.skip("ext2 has no fallocate: the write itself runs out of space")
    free = shutil.disk_usage(small_fs).free
    fits = torch.ones(1 << 20, dtype=torch.uint8)  # a quarter of the filesystem
    big = torch.ones(8 << 20, dtype=torch.uint8)  # twice the filesystem
    gapped = small_fs / "gapped.bin"
    with IOHandle("threads") as io:
        with pytest.raises(OSError) as e:
            io.pwrite_batch_async([(fits, gapped, 0), (big, gapped, 2 << 20)]).wait()
        assert e.value.errno == errno.ENOSPC
        st = gapped.stat()
        assert st.st_size in (0, 2 << 20)
        assert st.st_blocks * 512 <= 64 << 10, st.st_blocks
        assert gapped.read_bytes() == bytes(st.st_size)
        # (ext4 may keep a block or two of its own bookkeeping)
        assert shutil.disk_usage(small_fs).free >= free - (64 << 10)
        most = torch.ones((free - (256 << 10)) // 4096 * 4096, dtype=torch.uint8)
        assert io.pwrite(most, small_fs / "most.bin") == most.numel()


def _pids_cgroup_root() -> Path | None:
    """The cgroup v1 pids hierarchy, where this process may make groups (root), else None."""
    root = Path("/sys/fs/cgroup/pids")
    if os.geteuid() != 0 or not (root / "cgroup.procs").exists() or not os.access(root, os.W_OK):
        return None
    return root


def test_copy_threads_that_cannot_start_raise_oserror_naming_the_setting() -> None:
    """A process out of threads (a pids cgroup here: root is exempt from RLIMIT_NPROC) gets an
    OSError(EAGAIN) that says the copy threads could not start and how to go without them, not
    a "no I/O backend works" blaming every backend; with TENSORTIER_COPY_THREADS=0 and room for
    the workers the handle starts."""
    root = _pids_cgroup_root()
    if root is None:
        pytest.skip("needs root and the cgroup v1 pids controller")
    group = root / f"tensortier-test-{os.getpid()}"
    try:
        group.mkdir()
    except OSError as e:  # a read-only cgroup mount (containers)
        pytest.skip(f"cannot make a pids cgroup: {e}")
    child = textwrap.dedent(f"""
        import errno, os, re
        import tensortier
        from tensortier import IOHandle
        threads = int(re.search(r"Threads:\\s+(\\d+)", open("/proc/self/status").read())[1])
        limit = "{group}/pids.max"
        open(limit, "w").write(str(threads + 1))  # one copy thread of the two
        try:
            IOHandle(backend="threads", workers=1, queue_depth=2).close()
            print("started")
        except OSError as e:
            print("oserror", e.errno == errno.EAGAIN, str(e))
        os.environ["TENSORTIER_COPY_THREADS"] = "0"
        open(limit, "w").write(str(threads + 2))  # a worker, one of its two I/O threads
        try:
            IOHandle(backend="threads", workers=1, queue_depth=2).close()
            print("started")
        except OSError as e:
            print("oserror", e.errno == errno.EAGAIN, str(e))
        open(limit, "w").write(str(threads + 3))  # a worker and its two I/O threads
        IOHandle(backend="threads", workers=1, queue_depth=2).close()
        print("started without copy threads")
    """)
    try:
        r = subprocess.run(
            [sys.executable, "-c", child], capture_output=True, text=True, timeout=120,
            env={**{k: v for k, v in os.environ.items() if not k.startswith("TENSORTIER_")},
                 "OMP_NUM_THREADS": "1"},
            preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())))
    finally:
        group.rmdir()
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("oserror True"), r.stdout
    assert "copy threads" in lines[0] and "TENSORTIER_COPY_THREADS" in lines[0], r.stdout
    # The I/O threads' pool: stopped, not aborted, and the message names the setting.
    assert lines[1].startswith("oserror True"), r.stdout
    assert "I/O threads" in lines[1] and "TENSORTIER_QUEUE_DEPTH" in lines[1], r.stdout
    assert lines[2] == "started without copy threads", r.stdout


def test_ctrl_c_in_an_async_read_loses_no_operation(disk_dir: Path) -> None:
    """Ctrl-C landing in pread_async after the engine took the read (before the handle had
    recorded it) dropped the memory the read was filling: heap corruption. Now the read goes on,
    recorded, its memory kept alive: the next wait_all() finishes it, and no read is lost."""
    script = INTERRUPTED_CALLS + textwrap.dedent("""
        import sys, torch, tensortier
        io = tensortier.IOHandle()
        path = sys.argv[1] + "/data.bin"
        data = torch.randn(1 << 22)
        io.pwrite(data, path)
        hits = 0
        for it in range(200):
            into = torch.zeros_like(data)
            box = []
            hits += interrupted(lambda: box.append(io.pread_async(into, path)), 2e-5, it)
            if box:
                assert box[0].wait() == data.nbytes
                assert torch.equal(into, data), it
            del into  # a read still filling it once freed would corrupt the heap
        io.wait_all()
        io.close()
        print("interrupted", hits)
        """)
    assert exits_cleanly(script, str(disk_dir), timeout=300).startswith("interrupted")
