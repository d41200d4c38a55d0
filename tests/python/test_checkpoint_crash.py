"""Crash consistency: saves over an existing checkpoint killed with SIGKILL at random moments.

A process saving ~210 MiB with ``tensortier.save`` (or converting with ``tensortier convert``)
over an existing checkpoint is killed at a random moment between the start of the save and past
its expected end. Afterwards the path must hold the complete old or the complete new checkpoint
(loaded with ``verify=True`` and compared value by value, and checked by ``tensortier verify``),
the directory nothing but the checkpoint, the temporary files of killed saves and the files that
were there before; the next save must remove those temporary files and nothing else.

The delays are drawn from ``random.Random(seed)``; the seed is printed and is taken from
``TENSORTIER_CRASH_SEED`` when set, so a failure is rerun with the same kill moments (as far as
timing on a loaded machine repeats). ``TENSORTIER_CRASH_KILLS`` changes the number of kills.
"""

from __future__ import annotations

import collections
import os
import random
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import tensortier
from tensortier import _core

sys.path.insert(0, str(Path(__file__).parent))
import crash_worker  # noqa: E402
from conftest import exits_cleanly  # noqa: E402

WORKER = Path(__file__).with_name("crash_worker.py")
BIN = Path(os.environ.get("TENSORTIER_CLI", Path(sys.executable).parent / "tensortier"))
# Seconds a worker may take to import torch and build its tensors, and a save or a check to
# run, on a loaded 2-core machine under sanitizers: generous, as only a hang should hit them.
START_TIMEOUT_S = 120.0
SAVE_TIMEOUT_S = 120.0
KILLS = int(os.environ.get("TENSORTIER_CRASH_KILLS", "20"))
CONVERT_KILLS = max(1, KILLS * 2 // 5)
# Kill moments are uniform over [0, LATE * the measured duration of an uninterrupted save]: a
# quarter of a save's time past its end, so some kills land after the rename.
LATE = 1.25


def crash_seed() -> int:
    seed = int(os.environ.get("TENSORTIER_CRASH_SEED", str(random.SystemRandom().randrange(2**31))))
    print(f"crash test seed: {seed} (rerun with TENSORTIER_CRASH_SEED={seed})")
    return seed


@pytest.fixture(scope="module")
def versions() -> dict[int, dict[str, torch.Tensor]]:
    return {v: crash_worker.state(v) for v in (0, 1)}


class Worker:
    """crash_worker.py: one process that forks a child per save. Reads its output unbuffered
    (select() then os.read), so that no line waits in a buffer select() cannot see. Killed and
    reaped on close, failures included."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )
        self.pending = b""
        self.children: set[int] = set()
        assert self.line(START_TIMEOUT_S) == "ready"

    def line(self, timeout: float) -> str | None:
        """The next line the worker or its children print, or None after `timeout` seconds."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                raise AssertionError(f"the worker exited {self.proc.wait(SAVE_TIMEOUT_S)}")
            self.pending += chunk
        text, self.pending = self.pending.split(b"\n", 1)
        return text.decode()

    def command(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{text}\n".encode())
        self.proc.stdin.flush()

    def start_save(self, path: Path, version: int) -> int:
        """Starts a save of `version` to `path`; returns the saving child's pid."""
        assert not any(c.isspace() for c in str(path))
        self.command(f"save {path} {version}")
        reply = self.line(START_TIMEOUT_S)
        assert reply is not None and reply.startswith("started "), reply
        pid = int(reply.split()[1])
        self.children.add(pid)
        return pid

    def save_or_kill(self, pid: int, delay: float) -> bool:
        """Waits `delay` seconds for child `pid` to finish its save, else SIGKILLs it; reaps it
        (so that its pid and temporary file are stale). True when it finished first."""
        saved = False
        deadline = time.monotonic() + delay
        while not saved:
            reply = self.line(max(0.0, deadline - time.monotonic()))
            if reply is None:
                break
            saved = reply == f"saved {pid}"
        if not saved:
            os.kill(pid, signal.SIGKILL)
        self.command(f"reap {pid}")
        while (reply := self.line(SAVE_TIMEOUT_S)) is not None:
            saved = saved or reply == f"saved {pid}"
            if reply.startswith(f"reaped {pid} "):
                self.children.discard(pid)
                status = int(reply.split()[2])
                assert status in (0, -signal.SIGKILL), f"save {pid} exited {status}"
                return saved
        raise AssertionError(f"the worker did not reap {pid} in {SAVE_TIMEOUT_S:.0f} s")

    def save(self, path: Path, version: int) -> float:
        """An uninterrupted save; returns its duration in seconds."""
        start = time.monotonic()
        pid = self.start_save(path, version)
        assert self.save_or_kill(pid, SAVE_TIMEOUT_S), f"the save to {path} did not finish"
        return time.monotonic() - start

    def close(self) -> None:
        for pid in self.children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


@pytest.fixture
def worker() -> Iterator[Worker]:
    w = Worker()
    try:
        yield w
    finally:
        w.close()


def cli(*args: object, timeout: float = SAVE_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    if not BIN.is_file():
        pytest.skip(f"no tensortier binary at {BIN}")
    return subprocess.run([str(BIN), *map(str, args)], capture_output=True, text=True,
                          errors="replace", timeout=timeout)


def held_version(path: Path, versions: dict[int, dict[str, torch.Tensor]], context: str) -> int:
    """Which version `path` holds whole (its checksums verified by the library and the CLI);
    fails when it holds anything else."""
    assert path.is_file(), f"{context}: {path.name} is gone"
    try:
        got = tensortier.load(path, verify=True)
    except (OSError, ValueError) as e:
        raise AssertionError(f"{context}: {path.name} does not load with verify=True: {e}") from e
    matches = [
        v for v, want in versions.items()
        if sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    ]
    assert len(matches) == 1, (
        f"{context}: {path.name} holds neither version whole: names {list(got)[:8]}")
    r = cli("verify", path)
    assert r.returncode == 0, f"{context}: tensortier verify {path.name}: {r.stdout}{r.stderr}"
    return matches[0]


def temporaries(directory: Path, name: str) -> set[str]:
    return {n for n in os.listdir(directory) if n.startswith(f".{name}.tmp-")}


def plant_bystanders(directory: Path, name: str) -> set[str]:
    """Files a save into `directory`/`name` must leave alone: another checkpoint, another
    path's temporary file, and a temporary file of this same path whose writer (this test
    process) is alive."""
    live = Path(_core.temporary_path_prefix(str(directory / name)) + "0123abcd")
    files = {
        directory / "other.safetensors": b"not touched",
        directory / f".other{Path(name).suffix}.tmp-1-2-3-deadbeef": b"another path's",
        directory / "notes.txt": b"kept",
        live: b"a live save's",
    }
    for path, data in files.items():
        path.write_bytes(data)
    return {p.name for p in files}


def kill_after(proc: subprocess.Popen[bytes], delay: float) -> bool:
    """SIGKILLs `proc` `delay` seconds from now (and reaps it, so that its pid is free and its
    temporary file stale); True when it finished on its own first."""
    try:
        proc.wait(delay)
        return True
    except subprocess.TimeoutExpired:
        pass
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return proc.returncode == 0


def check_directory(directory: Path, name: str, bystanders: set[str], killed: set[int],
                    context: str) -> set[str]:
    """The directory holds the checkpoint, the bystanders and temporary files of killed
    processes (named by their pids), nothing else; returns those temporary files."""
    files = set(os.listdir(directory))
    left = temporaries(directory, name) - bystanders
    strangers = files - left - bystanders - {name}
    assert not strangers, f"{context}: unexpected files {sorted(strangers)}"
    for tmp in left:
        pid = int(tmp[len(f".{name}.tmp-"):].split("-")[0])
        assert pid in killed, f"{context}: {tmp} is no killed save's temporary file"
    return left


@pytest.mark.parametrize("name", ["model.safetensors", "model.pt"])
def test_a_killed_save_leaves_the_old_or_the_new_checkpoint(
    disk_dir: Path, worker: Worker, versions: dict[int, dict[str, torch.Tensor]], name: str
) -> None:
    seed = crash_seed()
    rng = random.Random(seed)
    path = disk_dir / name
    bystanders = plant_bystanders(disk_dir, name)
    worker.save(path, 0)
    duration = worker.save(path, 1)  # a save over an existing checkpoint, timed
    held = held_version(path, versions, "uninterrupted save")
    assert held == 1
    outcomes: collections.Counter[str] = collections.Counter()
    killed: set[int] = set()
    leftovers_seen = 0
    for i in range(KILLS):
        delay = rng.uniform(0, LATE * duration)
        context = f"seed {seed}, kill {i} at {delay:.3f} s of a {duration:.3f} s save"
        new = 1 - held
        pid = worker.start_save(path, new)
        if not worker.save_or_kill(pid, delay):
            killed.add(pid)
        held_now = held_version(path, versions, context)
        outcomes["new" if held_now == new else "old"] += 1
        left = check_directory(disk_dir, name, bystanders, killed, context)
        if held_now == new:
            # This save got to its rename, so it had removed the killed saves' files first.
            assert left == set(), f"{context}: the save left earlier temporary files {left}"
        leftovers_seen = max(leftovers_seen, len(left))
        held = held_now
    print(f"{name}: {KILLS} kills over {duration:.3f} s saves: {dict(outcomes)}, "
          f"at most {leftovers_seen} temporary files left at once")
    # The next save, uninterrupted, removes what killed saves left and nothing else.
    worker.save(path, 1 - held)
    assert held_version(path, versions, f"seed {seed}, the save after the kills") == 1 - held
    assert set(os.listdir(disk_dir)) == bystanders | {name}


def test_a_killed_convert_leaves_the_old_or_the_new_checkpoint(
    disk_dir: Path, versions: dict[int, dict[str, torch.Tensor]]
) -> None:
    seed = crash_seed()
    rng = random.Random(seed)
    if not BIN.is_file():
        pytest.skip(f"no tensortier binary at {BIN}")
    sources = {}
    for v in (0, 1):
        for suffix in (".safetensors", ".pt"):
            sources[v, suffix] = disk_dir / f"source{v}{suffix}"
            tensortier.save(versions[v], sources[v, suffix], checksum=True)
    for out_suffix, in_suffix in ((".pt", ".safetensors"), (".safetensors", ".pt")):
        name = f"converted{out_suffix}"
        path = disk_dir / name
        before = set(os.listdir(disk_dir))
        assert cli("convert", sources[0, in_suffix], path).returncode == 0
        start = time.monotonic()
        r = cli("convert", sources[1, in_suffix], path)
        duration = time.monotonic() - start
        assert r.returncode == 0, r.stderr
        held = held_version(path, versions, f"{name}: uninterrupted convert")
        assert held == 1
        bystanders = before | plant_bystanders(disk_dir, name)
        killed: set[int] = set()
        outcomes: collections.Counter[str] = collections.Counter()
        for i in range(CONVERT_KILLS):
            delay = rng.uniform(0, LATE * duration)
            context = (f"seed {seed}, {name}: kill {i} at {delay:.3f} s of a {duration:.3f} s "
                       "convert")
            new = 1 - held
            proc = subprocess.Popen([str(BIN), "convert", str(sources[new, in_suffix]), str(path)],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                if not kill_after(proc, delay):
                    killed.add(proc.pid)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            held_now = held_version(path, versions, context)
            outcomes["new" if held_now == new else "old"] += 1
            left = check_directory(disk_dir, name, bystanders, killed, context)
            if held_now == new:
                assert left == set(), f"{context}: convert left earlier temporary files {left}"
            held = held_now
        print(f"{name}: {CONVERT_KILLS} kills over {duration:.3f} s converts: {dict(outcomes)}")
        r = cli("convert", sources[1 - held, in_suffix], path)
        assert r.returncode == 0, r.stderr
        assert held_version(path, versions, f"seed {seed}, convert after the kills") == 1 - held
        assert set(os.listdir(disk_dir)) == bystanders | {name}


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_ctrl_c_during_a_save_fails_it_and_keeps_the_old_checkpoint(disk_dir: Path,
                                                                    suffix: str) -> None:
    """SIGINT while the C++ write runs is raised once it returns: the save then reports the
    failure it is, and the old checkpoint stays; a save that returned wrote the new one."""
    import threading

    path = disk_dir / f"ck{suffix}"
    tensortier.save({"old": torch.zeros(10)}, path)
    sd = {f"t{i}": torch.ones(1 << 20) for i in range(48)}  # 192 MiB: the write takes a while
    timer = threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    interrupted = False
    try:
        tensortier.save(sd, path)
    except KeyboardInterrupt:
        interrupted = True
    else:
        try:
            timer.join()
            time.sleep(0.5)  # a signal that comes after the save lands here
        except KeyboardInterrupt:
            pass
    timer.join()
    keys = list(tensortier.load(path))
    assert keys == (["old"] if interrupted else list(sd)), (interrupted, keys[:3])
    assert not [p for p in disk_dir.iterdir() if ".tmp-" in p.name]


def test_a_daemon_thread_loading_at_exit_does_not_abort_the_process(disk_dir: Path) -> None:
    """A daemon thread loading with a progress bar (whose updates take the GIL back between the
    reads' groups) while the main thread exits: the process exits with its own status, never
    std::terminate from a thread Python ends as it takes the GIL back."""
    path = disk_dir / "ck.safetensors"
    tensortier.save({f"t{i}": torch.full((1 << 20,), float(i)) for i in range(64)}, path)
    script = ("import random, sys, threading, time\n"
              "import tensortier\n"
              "started = threading.Event()\n"
              "def load():\n"
              "    while True:\n"
              "        started.set()\n"
              "        tensortier.load(sys.argv[1], progress=True)\n"
              "threading.Thread(target=load, daemon=True).start()\n"
              "assert started.wait(60)\n"
              "time.sleep(random.random() * 0.2)\n")
    exits_cleanly(script, str(path), runs=4)
