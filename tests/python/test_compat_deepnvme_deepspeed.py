"""DeepSpeed's own DeepNVMe unit tests (tests/unit/v1/nvme/test_aio.py and
test_pinned_manager.py, tests/unit/v1/pin_memory/test_pin_memory_op.py), the cases that run without an accelerator, against
tensortier.compat.deepnvme. Their assertions are kept as DeepSpeed wrote them: return values of
the calls and of wait(), the handle's getters, the files' bytes and what is_pinned says."""

from __future__ import annotations

import filecmp
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tensortier.compat.deepnvme import AsyncIOBuilder, PinMemoryBuilder

KILO_BYTE = 1024
BLOCK_SIZE = KILO_BYTE
QUEUE_DEPTH = 2
IO_SIZE = 4 * BLOCK_SIZE
IO_PARALLEL = 2


def _handle(single_submit: bool = True, overlap_events: bool = True, parallel: int = IO_PARALLEL):  # type: ignore[no-untyped-def]
    return AsyncIOBuilder().load().aio_handle(BLOCK_SIZE, QUEUE_DEPTH, single_submit,
                                              overlap_events, parallel)


def _ref_write(tmpdir: Path, index: int = 0, num_bytes: int = IO_SIZE) -> tuple[str, bytes]:
    ref_file = str(tmpdir / f"_py_random_0_{index}.pt")
    ref_buffer = os.urandom(num_bytes)
    with open(ref_file, "wb") as f:
        f.write(ref_buffer)
    return ref_file, ref_buffer


def _write_file_and_tensor(tmpdir: Path, ref_buffer: bytes, h, locked: bool, index: int = 0):  # type: ignore[no-untyped-def]
    test_file = str(tmpdir / f"_aio_write_random_0_{index}.pt")
    if not locked:
        return test_file, torch.ByteTensor(list(ref_buffer))
    tmp_buffer = torch.ByteTensor(list(ref_buffer))
    test_buffer = h.new_cpu_locked_tensor(len(ref_buffer), tmp_buffer)
    test_buffer.data.copy_(tmp_buffer)
    return test_file, test_buffer


def _validate_handle_state(h, single_submit: bool, overlap_events: bool) -> None:  # type: ignore[no-untyped-def]
    assert h.get_single_submit() == single_submit
    assert h.get_overlap_events() == overlap_events
    assert h.get_intra_op_parallelism() == IO_PARALLEL
    assert h.get_block_size() == BLOCK_SIZE
    assert h.get_queue_depth() == QUEUE_DEPTH


def _read_buffer(h, locked: bool):  # type: ignore[no-untyped-def]
    if locked:
        return h.new_cpu_locked_tensor(IO_SIZE, torch.empty(0, dtype=torch.uint8))
    return torch.empty(IO_SIZE, dtype=torch.uint8, device="cpu")


@pytest.mark.parametrize("use_unpinned_tensor", [True, False])
@pytest.mark.parametrize("single_submit", [True, False])
@pytest.mark.parametrize("overlap_events", [True, False])
@pytest.mark.parametrize("asynchronous", [False, True], ids=["parallel", "async"])
def test_read(disk_dir: Path, use_unpinned_tensor: bool, single_submit: bool,
              overlap_events: bool, asynchronous: bool) -> None:
    h = _handle(single_submit, overlap_events)
    aio_buffer = _read_buffer(h, locked=not use_unpinned_tensor)
    _validate_handle_state(h, single_submit, overlap_events)
    ref_file, _ = _ref_write(disk_dir)
    if asynchronous:
        assert h.async_pread(aio_buffer, ref_file, 0) == 0
        assert h.wait() == 1
    else:
        assert h.sync_pread(aio_buffer, ref_file, 0) == 1
    with open(ref_file, "rb") as f:
        assert list(f.read()) == aio_buffer.tolist()
    if not use_unpinned_tensor:
        assert h.free_cpu_locked_tensor(aio_buffer)


@pytest.mark.parametrize("use_unpinned_tensor", [True, False])
@pytest.mark.parametrize("single_submit", [True, False])
@pytest.mark.parametrize("overlap_events", [True, False])
@pytest.mark.parametrize("asynchronous", [False, True], ids=["parallel", "async"])
def test_write(disk_dir: Path, use_unpinned_tensor: bool, single_submit: bool,
               overlap_events: bool, asynchronous: bool) -> None:
    ref_file, ref_buffer = _ref_write(disk_dir)
    h = _handle(single_submit, overlap_events)
    aio_file, aio_buffer = _write_file_and_tensor(disk_dir, ref_buffer, h,
                                                  locked=not use_unpinned_tensor)
    _validate_handle_state(h, single_submit, overlap_events)
    if asynchronous:
        assert h.async_pwrite(aio_buffer, aio_file, 0) == 0
        assert h.wait() == 1
    else:
        assert h.sync_pwrite(aio_buffer, aio_file, 0) == 1
    if not use_unpinned_tensor:
        assert h.free_cpu_locked_tensor(aio_buffer)
    assert os.path.isfile(aio_file)
    filecmp.clear_cache()
    assert filecmp.cmp(ref_file, aio_file, shallow=False)


@pytest.mark.parametrize("use_unpinned_tensor", [True, False])
@pytest.mark.parametrize("async_queue", [2, 3])
def test_async_queue_read(disk_dir: Path, use_unpinned_tensor: bool, async_queue: int) -> None:
    ref_files = [_ref_write(disk_dir, i)[0] for i in range(async_queue)]
    h = _handle()
    aio_buffers = [_read_buffer(h, locked=not use_unpinned_tensor) for _ in range(async_queue)]
    _validate_handle_state(h, True, True)
    for i in range(async_queue):
        assert h.async_pread(aio_buffers[i], ref_files[i], 0) == 0
    assert h.wait() == async_queue
    for i in range(async_queue):
        with open(ref_files[i], "rb") as f:
            assert list(f.read()) == aio_buffers[i].tolist()
    if not use_unpinned_tensor:
        for t in aio_buffers:
            assert h.free_cpu_locked_tensor(t)


@pytest.mark.parametrize("use_unpinned_tensor", [True, False])
@pytest.mark.parametrize("async_queue", [2, 3])
def test_async_queue_write(disk_dir: Path, use_unpinned_tensor: bool, async_queue: int) -> None:
    refs = [_ref_write(disk_dir, i) for i in range(async_queue)]
    h = _handle()
    written = [_write_file_and_tensor(disk_dir, refs[i][1], h, not use_unpinned_tensor, i)
               for i in range(async_queue)]
    _validate_handle_state(h, True, True)
    for aio_file, aio_buffer in written:
        assert h.async_pwrite(aio_buffer, aio_file, 0) == 0
    assert h.wait() == async_queue
    if not use_unpinned_tensor:
        for _, t in written:
            assert h.free_cpu_locked_tensor(t)
    for (ref_file, _), (aio_file, _) in zip(refs, written):
        assert os.path.isfile(aio_file)
        filecmp.clear_cache()
        assert filecmp.cmp(ref_file, aio_file, shallow=False)


PARTITIONS = [[1, 1, 1], [1, 1, 2], [1, 2, 1], [2, 1, 1]]


@pytest.mark.parametrize("file_partitions", PARTITIONS, ids=str)
@pytest.mark.parametrize("use_fd", [False, True])
def test_offset_write(disk_dir: Path, file_partitions: list[int], use_fd: bool) -> None:
    ref_file = str(disk_dir / "_py_random_0_0.pt")
    aio_file = str(disk_dir / "_aio_random_0_0.pt")
    file_size = sum(file_partitions) * BLOCK_SIZE
    h = _handle()
    data_buffer = h.new_cpu_locked_tensor(file_size, torch.empty(0, dtype=torch.uint8))
    data_buffer.copy_(torch.frombuffer(bytearray(os.urandom(file_size)), dtype=torch.uint8))
    offsets = [sum(file_partitions[:i]) * BLOCK_SIZE for i in range(len(file_partitions))]
    with open(ref_file, "wb") as ref_fd:
        for i, offset in enumerate(offsets):
            src_buffer = torch.narrow(data_buffer, 0, offset, file_partitions[i] * BLOCK_SIZE)
            ref_fd.write(src_buffer.numpy().tobytes())
            ref_fd.flush()
            if use_fd:
                aio_fd = os.open(aio_file, flags=os.O_DIRECT | os.O_CREAT | os.O_WRONLY)
                try:
                    status = h.async_pwrite(buffer=src_buffer, fd=aio_fd, file_offset=offset)
                    assert status == 0
                    assert h.wait() == 1
                finally:
                    os.close(aio_fd)
            else:
                status = h.async_pwrite(buffer=src_buffer, filename=aio_file, file_offset=offset)
                assert status == 0
                assert h.wait() == 1
            filecmp.clear_cache()
            assert filecmp.cmp(ref_file, aio_file, shallow=False)
    assert h.free_cpu_locked_tensor(data_buffer)


@pytest.mark.parametrize("file_partitions", PARTITIONS, ids=str)
def test_offset_read(disk_dir: Path, file_partitions: list[int]) -> None:
    file_size = sum(file_partitions) * BLOCK_SIZE
    ref_file, _ = _ref_write(disk_dir, 0, file_size)
    h = _handle()
    data_buffer = h.new_cpu_locked_tensor(file_size, torch.empty(0, dtype=torch.uint8))
    offsets = [sum(file_partitions[:i]) * BLOCK_SIZE for i in range(len(file_partitions))]
    with open(ref_file, "rb") as ref_fd:
        for i, offset in enumerate(offsets):
            ref_fd.seek(offset)
            bytes_to_read = file_partitions[i] * BLOCK_SIZE
            ref_buf = list(ref_fd.read(bytes_to_read))
            dst_tensor = torch.narrow(data_buffer, 0, 0, bytes_to_read)
            assert h.sync_pread(dst_tensor, ref_file, offset) == 1
            assert dst_tensor.tolist() == ref_buf
    assert h.free_cpu_locked_tensor(data_buffer)


# ---- test_pinned_manager.py: one pinned-tensor manager per process ------------------------

NUM_ELEMS = 4 * BLOCK_SIZE


def _pin_handle():  # type: ignore[no-untyped-def]
    return AsyncIOBuilder().load().aio_handle(BLOCK_SIZE, QUEUE_DEPTH, False, False, 1)


def test_narrow_of_locked_buffer_is_pinned() -> None:
    handle = _pin_handle()
    buffer = handle.new_cpu_locked_tensor(NUM_ELEMS, torch.empty(0, dtype=torch.float))
    try:
        assert handle.is_pinned(buffer)
        assert handle.is_pinned(buffer.narrow(0, BLOCK_SIZE, BLOCK_SIZE))
    finally:
        handle.free_cpu_locked_tensor(buffer)


def test_buffer_is_shared_across_handles() -> None:
    handle_a = _pin_handle()
    handle_b = _pin_handle()
    buffer = handle_a.new_cpu_locked_tensor(NUM_ELEMS, torch.empty(0, dtype=torch.float))
    try:
        assert handle_b.is_pinned(buffer)
    finally:
        handle_a.free_cpu_locked_tensor(buffer)


def test_a_locked_buffer_is_freed_through_any_handle_and_any_tensor_at_its_address() -> None:
    """DeepNVMe's manager frees by address, whichever handle allocated the buffer."""
    handle_a = _pin_handle()
    handle_b = _pin_handle()
    buffer = handle_a.new_cpu_locked_tensor(NUM_ELEMS, torch.empty(0, dtype=torch.float))
    assert handle_b.free_cpu_locked_tensor(buffer.view(torch.uint8))
    assert not handle_a.is_pinned(buffer) and not handle_b.is_pinned(buffer)
    assert not handle_a.free_cpu_locked_tensor(buffer)  # freed already
    empty = handle_a.new_cpu_locked_tensor(0, torch.empty(0, dtype=torch.float))
    assert not handle_b.free_cpu_locked_tensor(torch.empty(0))  # another zero-byte tensor
    assert handle_b.free_cpu_locked_tensor(empty)


def test_unmanaged_buffer_is_not_pinned() -> None:
    handle = _pin_handle()
    assert not handle.is_pinned(torch.empty(NUM_ELEMS, dtype=torch.float))


def test_pin_handle_buffer_recognized_by_aio_handle() -> None:
    """Buffers of the pin_memory op share the process-wide manager with async_io."""
    pin_handle = PinMemoryBuilder().load().pin_handle()
    aio_handle = _pin_handle()
    buffer = pin_handle.new_cpu_locked_tensor(NUM_ELEMS, torch.empty(0, dtype=torch.float))
    try:
        assert pin_handle.is_pinned(buffer)
        assert aio_handle.is_pinned(buffer)
        assert aio_handle.is_pinned(buffer.narrow(0, BLOCK_SIZE, BLOCK_SIZE))
    finally:
        pin_handle.free_cpu_locked_tensor(buffer)


def test_aio_handle_buffer_recognized_by_pin_handle() -> None:
    pin_handle = PinMemoryBuilder().load().pin_handle()
    aio_handle = _pin_handle()
    buffer = aio_handle.new_cpu_locked_tensor(NUM_ELEMS, torch.empty(0, dtype=torch.float))
    try:
        assert aio_handle.is_pinned(buffer)
        assert pin_handle.is_pinned(buffer)
    finally:
        aio_handle.free_cpu_locked_tensor(buffer)


def test_pin_handle_alloc_free_and_is_pinned() -> None:
    """test_pin_memory_op.py: pin_memory works without async_io."""
    handle = PinMemoryBuilder().load().pin_handle()
    buffer = handle.new_cpu_locked_tensor(NUM_ELEMS, torch.empty(0, dtype=torch.float))
    try:
        assert handle.is_pinned(buffer)
        assert handle.is_pinned(buffer.narrow(0, 16, 16))
        assert not handle.is_pinned(torch.empty(NUM_ELEMS, dtype=torch.float))
    finally:
        assert handle.free_cpu_locked_tensor(buffer) is True


# ---- test_aio_gil.py: one handle shared by threads -----------------------------------------


@pytest.mark.parametrize("op", ["sync_pread", "pread", "sync_pwrite", "pwrite"])
def test_concurrent_blocking_calls_on_a_shared_handle(disk_dir: Path, op: str) -> None:
    """DeepNVMe holds the handle's mutex from the start of a blocking call to the end of its
    wait: each of several threads' calls returns 1, once its own operation is done (not 0 when
    another thread's wait took it). Threads switch as often as Python allows, to meet the calls
    at every point; a deadline bounds the test."""
    threads, rounds = 8, 2000
    h = _handle(parallel=1)
    payloads = [os.urandom(BLOCK_SIZE) for _ in range(threads)]
    paths = [str(disk_dir / f"shared-{i}.bin") for i in range(threads)]
    for path, payload in zip(paths, payloads):
        with open(path, "wb") as f:
            f.write(payload)
    failures: list[str] = []
    start = threading.Barrier(threads, timeout=60)

    def run(i: int) -> None:
        try:
            source = torch.frombuffer(bytearray(payloads[i]), dtype=torch.uint8)
            buffer = torch.zeros(BLOCK_SIZE, dtype=torch.uint8)
            start.wait()
            for _ in range(rounds):
                if op == "sync_pread":
                    status = h.sync_pread(buffer, paths[i], 0)
                elif op == "pread":
                    status = h.pread(buffer, paths[i], False, False, 0)
                elif op == "sync_pwrite":
                    status = h.sync_pwrite(source, paths[i], 0)
                else:
                    status = h.pwrite(source, paths[i], False, False, 0)
                if status != 1:
                    failures.append(f"{op} returned {status}")
                    return
                if "read" in op and bytes(buffer.numpy()) != payloads[i]:
                    failures.append(f"{op} returned before its data was read")
                    return
        except Exception as e:  # noqa: BLE001 - reported below
            failures.append(repr(e))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        workers = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=120)
    finally:
        sys.setswitchinterval(interval)
    assert not any(w.is_alive() for w in workers), "a blocking call hung"
    assert not failures, failures[:3]
    for path, payload in zip(paths, payloads):
        with open(path, "rb") as f:
            assert f.read() == payload


@pytest.mark.parametrize("operation_name", ["pread", "pwrite", "sync_pread", "sync_pwrite"])
def test_blocking_aio_releases_gil(disk_dir: Path, operation_name: str) -> None:
    """A thread waiting for the GIL runs while blocking calls wait (DeepSpeed's test, with a
    locked tensor where it takes CUDA-pinned memory)."""
    payload = os.urandom(BLOCK_SIZE)
    source_path = disk_dir / "source.bin"
    source_path.write_bytes(payload)
    target_path = disk_dir / "target.bin"
    handle = _handle()

    def invoke(buffer: torch.Tensor, filename: str) -> int:
        if operation_name == "pread":
            return handle.pread(buffer, filename, False, False, 0)
        if operation_name == "pwrite":
            return handle.pwrite(buffer, filename, False, False, 0)
        if operation_name == "sync_pread":
            return handle.sync_pread(buffer, filename, 0)
        return handle.sync_pwrite(buffer, filename, 0)

    buffer = handle.new_cpu_locked_tensor(BLOCK_SIZE, torch.empty(0, dtype=torch.uint8))
    if "pread" in operation_name:
        buffer.zero_()
        filename = str(source_path)
    else:
        buffer.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        filename = str(target_path)
        assert invoke(buffer, filename) == 1

    peer_ready = threading.Event()
    peer_ran = threading.Event()
    gate = threading.Lock()
    gate.acquire()

    def run_peer() -> None:
        peer_ready.set()
        with gate:
            peer_ran.set()

    peer = threading.Thread(target=run_peer, daemon=True)
    peer.start()
    assert peer_ready.wait(timeout=30)
    original_switch_interval = sys.getswitchinterval()
    try:
        sys.setswitchinterval(60)
        gate.release()
        # Calls until the peer has run: a call from the page cache takes microseconds, and on a
        # loaded machine the peer may not be scheduled within 32 of them (it was not, once).
        # Held across the calls, the GIL would keep the peer out for the 60 s switch interval.
        deadline = time.monotonic() + 20
        while not peer_ran.is_set() and time.monotonic() < deadline:
            assert invoke(buffer, filename) == 1
        assert peer_ran.is_set(), f"{operation_name} held the GIL across all blocking calls"
    finally:
        sys.setswitchinterval(original_switch_interval)
        if gate.locked():
            gate.release()
        peer.join(timeout=30)
    assert not peer.is_alive()
    if "pread" in operation_name:
        assert bytes(buffer.tolist()) == payload
    else:
        assert target_path.read_bytes() == payload
    assert handle.free_cpu_locked_tensor(buffer)


def test_concurrent_unpinned_read_and_locked_tensor_management(disk_dir: Path) -> None:
    payload = os.urandom(BLOCK_SIZE)
    source_path = disk_dir / "source.bin"
    source_path.write_bytes(payload)
    buffer = torch.zeros(BLOCK_SIZE, dtype=torch.uint8)
    example_tensor = torch.empty(1, dtype=torch.uint8)
    handle = _handle()
    start = threading.Barrier(3, timeout=30)
    errors: list[BaseException] = []

    def run_reads() -> None:
        try:
            start.wait()
            for _ in range(32):
                assert handle.sync_pread(buffer, str(source_path), 0) == 1
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    def manage_locked_tensors() -> None:
        try:
            start.wait()
            for _ in range(32):
                locked_tensor = handle.new_cpu_locked_tensor(BLOCK_SIZE, example_tensor)
                assert handle.free_cpu_locked_tensor(locked_tensor)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    workers = [threading.Thread(target=run_reads, daemon=True),
               threading.Thread(target=manage_locked_tensors, daemon=True)]
    for worker in workers:
        worker.start()
    start.wait()
    for worker in workers:
        worker.join(timeout=60)
    assert not errors
    assert all(not worker.is_alive() for worker in workers)
    assert bytes(buffer.tolist()) == payload


@pytest.mark.parametrize("parallel", [1, 4])
def test_the_swappers_call_sequence(disk_dir: Path, parallel: int) -> None:
    """The calls ZeRO-Infinity's swappers make (runtime/swap_tensor): a read handle and a write
    handle, one locked buffer cut into swap buffers of `numel` rounded up to the handle's
    alignment (narrow views at unaligned addresses), a round of async_pwrite of every swap
    buffer then ``assert wait() == n``, then async_pread of them all from the other handle into
    other swap buffers, ``assert wait() == n``; a second round with other values rewrites the
    files in place. Every element comes back, the padding included."""
    dtype = torch.float16
    read_h, write_h = _handle(False, True, parallel), _handle(False, True, parallel)
    numel_alignment = 1024 * parallel // torch.empty((), dtype=dtype).element_size()
    numels = [1, 999, 4097, 65536 + 3, 200_001]
    aligned = [-(-n // numel_alignment) * numel_alignment for n in numels]
    buffer = read_h.new_cpu_locked_tensor(2 * sum(aligned) + 7, torch.empty(0, dtype=dtype))
    assert write_h.is_pinned(buffer) and read_h.is_pinned(buffer)
    # Out of one locked buffer (DeepSpeed's SwapBufferPool): views past an odd first element.
    views, start = [], 7
    for length in aligned * 2:
        views.append(buffer.narrow(0, start, length))
        start += length
    out_views, in_views = views[: len(numels)], views[len(numels):]
    assert all(write_h.is_pinned(v) for v in views)
    paths = [str(disk_dir / f"param_{i}.tensor.swp") for i in range(len(numels))]
    for round_ in range(2):
        for i, v in enumerate(out_views):
            v.copy_(torch.arange(v.numel(), dtype=torch.float32).remainder(2039).to(dtype) + i
                    + 100 * round_)
        for v, p in zip(out_views, paths):
            assert write_h.async_pwrite(v, p, 0) == 0
        assert write_h.wait() == len(paths)
        for v in in_views:
            v.fill_(-1)
        for v, p in zip(in_views, paths):
            assert read_h.async_pread(v, p, 0) == 0
        assert read_h.wait() == len(paths)
        for v_in, v_out, p, length in zip(in_views, out_views, paths, aligned):
            assert torch.equal(v_in, v_out)
            assert os.path.getsize(p) == length * 2
    assert read_h.wait() == 0 and write_h.wait() == 0
    assert read_h.free_cpu_locked_tensor(buffer)
    read_h.close()
    write_h.close()
