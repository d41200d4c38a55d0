"""Shared fixtures: scratch directories on the real disk (O_DIRECT needs one) and on a
filesystem that refuses O_DIRECT (ramfs, mounted when we are root)."""

from __future__ import annotations

import contextlib

import ctypes
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

REPO = Path(__file__).resolve().parents[2]


def require_backend(name: str) -> None:
    """Skips the calling test where the kernel refuses backend `name` (io_uring under a
    container's seccomp profile, gVisor or kernel.io_uring_disabled), except on CI, whose
    machines must run every backend compiled in."""
    import tensortier

    try:
        tensortier.IOHandle(backend=name).close()
    except OSError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"{name} does not run here: {e}")


def _uses_gpu(item: pytest.Item) -> bool:
    """Whether a test exercises CUDA: a test_gpu_* module, a skip for want of CUDA, or CUDA in
    its name or parameters."""
    if Path(str(item.fspath)).name.startswith("test_gpu_"):
        return True
    if any("cuda" in str(m.kwargs.get("reason", "")).lower() for m in item.iter_markers("skipif")):
        return True
    return any(word in item.nodeid.lower() for word in ("cuda", "gpu"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """TENSORTIER_GPU_TESTS_ONLY=1 (scripts/gpu-test.sh --gpu-only) keeps only the tests that
    exercise CUDA, so that a short lease of a GPU machine runs what only it can run."""
    if not os.environ.get("TENSORTIER_GPU_TESTS_ONLY"):
        return
    keep = [item for item in items if _uses_gpu(item)]
    config.hook.pytest_deselected(items=[item for item in items if not _uses_gpu(item)])
    items[:] = keep


@pytest.fixture
def disk_dir() -> Iterator[Path]:
    """A temporary directory on the repository's filesystem (a real disk, O_DIRECT capable)."""
    base = REPO / "build"
    base.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=base, prefix="pytest-") as d:
        yield Path(d)


@pytest.fixture
def no_direct_dir() -> Iterator[Path]:
    """A directory on ramfs, which refuses O_DIRECT (tmpfs accepts it since Linux 6.6)."""
    libc = ctypes.CDLL(None, use_errno=True)
    with tempfile.TemporaryDirectory(prefix="tensortier-ramfs-") as d:
        if libc.mount(b"none", d.encode(), b"ramfs", 0, None) != 0:
            pytest.skip(f"cannot mount ramfs: {os.strerror(ctypes.get_errno())}")
        try:
            yield Path(d)
        finally:
            libc.umount2(d.encode(), 2)  # MNT_DETACH


def _resident_bytes(tensor: Any) -> int:
    """Bytes of a CPU tensor's pages that are in memory now (mincore, page by page)."""
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    start = tensor.data_ptr() - tensor.data_ptr() % mmap.PAGESIZE
    end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
    pages = -(-(end - start) // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    length = ctypes.c_size_t(pages * mmap.PAGESIZE)
    if libc.mincore(ctypes.c_void_p(start), length, vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(v & 1 for v in vec) * mmap.PAGESIZE


@pytest.fixture
def resident_bytes() -> Callable[[Any], int]:
    """mincore over a tensor's memory: how many of its bytes' pages are resident."""
    return _resident_bytes


def _nvidia_wheel_file(pattern: str) -> Path | None:
    """The first file matching `pattern` under the ``nvidia`` namespace package of NVIDIA's pip
    wheels (e.g. ``*/lib/libcufile.so.0``), or None."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    roots = spec.submodule_search_locations if spec is not None else None
    for root in roots or []:
        for found in sorted(Path(root).glob(pattern)):
            return found
    return None


def _required_wheel_file(pattern: str, wheel: str) -> Path:
    found = _nvidia_wheel_file(pattern)
    if found is None:
        if os.environ.get("CI"):  # a missing install step must not pass as a skip
            pytest.fail(f"{wheel} is not installed: scripts/setup.sh installs it")
        pytest.skip(f"{wheel} is not installed (scripts/setup.sh installs it)")
    return found


@pytest.fixture
def nvidia_libcufile() -> Path:
    """NVIDIA's libcufile.so.0 from the nvidia-cufile wheel (not on the loader's path)."""
    return _required_wheel_file("*/lib/libcufile.so.0", "nvidia-cufile")


@pytest.fixture
def nvidia_include() -> Path:
    """The include folder of NVIDIA's wheels holding cuda.h (nvidia-cuda-runtime) and cufile.h
    (nvidia-cufile)."""
    cufile_h = _required_wheel_file("*/include/cufile.h", "nvidia-cufile")
    if not (cufile_h.parent / "cuda.h").is_file():
        _required_wheel_file("*/include/cuda.h", "nvidia-cuda-runtime")
        pytest.fail(f"cuda.h and cufile.h are in different folders: {cufile_h.parent}")
    return cufile_h.parent


@pytest.fixture(params=["tmpfs", "ext2", "ext4"])
def small_fs(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB filesystem mounted on a fresh directory: tmpfs (reserves space with fallocate),
    ext4 (fallocate too) and ext2 (no fallocate: ENOSPC comes from the write itself), each on
    a loop device over an image file made here. Needs root; unmounted (and the loop device
    freed) even when the test fails."""
    fstype = str(request.param)
    if os.geteuid() != 0:
        pytest.skip("mounting a filesystem needs root")
    mnt = tmp_path / fstype
    mnt.mkdir()
    if fstype == "tmpfs":
        command = ["mount", "-t", "tmpfs", "-o", "size=4m", "none", str(mnt)]
    else:
        image = tmp_path / f"{fstype}.img"
        with open(image, "wb") as f:
            f.truncate(4 << 20)
        made = subprocess.run([f"mkfs.{fstype}", "-q", "-F", str(image)], capture_output=True,
                              text=True, timeout=60)
        if made.returncode != 0:
            pytest.skip(f"mkfs.{fstype}: {made.stderr.strip()}")
        # -o loop: mount sets up the loop device and frees it at unmount (autoclear).
        command = ["mount", "-t", fstype, "-o", "loop", str(image), str(mnt)]
    with mounted(command, mnt, fstype):
        yield mnt


@contextlib.contextmanager
def mounted(command: list[str], mnt: Path, what: str) -> Iterator[Path]:
    """Within: `command` (a mount onto `mnt`) has run; the test skips where it fails (`what`
    names the mount in the reason). Unmounted even when the test fails."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        pytest.skip(f"cannot mount {what}: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True, timeout=60)


def exits_cleanly(script: str, *args: str, runs: int = 1, timeout: float = 120) -> str:
    """Runs `script` (python -c) `runs` times: each must exit 0, never abort or hang (a daemon
    thread still working in tensortier when the main thread ends, a heap corrupted). Returns
    the last run's output."""
    import sys

    out = ""
    for _ in range(runs):
        r = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                           timeout=timeout)
        assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
        out = r.stdout
    return out


@pytest.fixture
def alarm_interrupt():  # type: ignore[no-untyped-def]
    """Calls `arm(seconds, linger)`: SIGALRM then raises KeyboardInterrupt after `linger` s (a
    handler that logs before raising; the operation may finish meanwhile)."""
    import signal

    def handler(signum: int, frame: object) -> None:
        time.sleep(state["linger"])
        raise KeyboardInterrupt

    state = {"linger": 0.0}
    old = signal.signal(signal.SIGALRM, handler)

    def arm(seconds: float, linger: float = 0.0) -> None:
        state["linger"] = linger
        signal.setitimer(signal.ITIMER_REAL, seconds)

    yield arm
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old)


# A loop whose calls a timer interrupts at moments that move through them (a SIGALRM handler
# raising KeyboardInterrupt, once, only while the call runs): prefixed to the scripts of the
# Ctrl-C tests, which run in a process of their own (a lost operation corrupts its heap).
INTERRUPTED_POINTS = """
import sys, dis
_SIGNAL_POINTS = {dis.opmap[name] for name in ("RESUME", "JUMP_BACKWARD") if name in dis.opmap}
_CALLS = {dis.opmap[name] for name in ("CALL", "CALL_KW", "CALL_FUNCTION_EX") if name in dis.opmap}
def interrupted_at(call, n, package):
    '''call() with KeyboardInterrupt raised at the n-th point of `package`'s Python where the
    interpreter handles a pending signal (after a call returns, at a function's start, at a
    loop's jump back); True when it was raised (False: the call ran through fewer).'''
    count = 0
    def tracer(frame, event, arg):
        nonlocal count
        if not frame.f_code.co_filename.startswith(package):
            return None
        frame.f_trace_opcodes = True
        if event == "opcode":
            code = frame.f_code.co_code
            here = code[frame.f_lasti]
            # The instruction before this one (CACHE entries skipped: they are not executed).
            before = frame.f_lasti - 2
            while before >= 0 and code[before] == dis.opmap.get("CACHE", -1):
                before -= 2
            if here in _SIGNAL_POINTS or (before >= 0 and code[before] in _CALLS):
                count += 1
                if count == n:
                    raise KeyboardInterrupt
        return tracer
    sys.settrace(tracer)
    try:
        call()
    except KeyboardInterrupt:
        return True
    finally:
        sys.settrace(None)
    return False
"""


INTERRUPTED_CALLS = """
import signal
armed = False
def _interrupt(*args):
    global armed
    if armed:
        armed = False
        raise KeyboardInterrupt
signal.signal(signal.SIGALRM, _interrupt)
def interrupted(call, step, it):
    '''call() with the timer set to go off `step` * (it % 40 + 1) s into it; True when it was
    interrupted.'''
    global armed
    try:
        try:
            armed = True
            signal.setitimer(signal.ITIMER_REAL, step * (it % 40 + 1))
            call()
        finally:
            armed = False
            signal.setitimer(signal.ITIMER_REAL, 0)
    except KeyboardInterrupt:
        return True
    return False
"""
