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


def read_line(proc: subprocess.Popen[str], timeout: float) -> str:
    """The next line `proc` prints, waiting at most `timeout` seconds."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise AssertionError(f"worker {proc.pid} printed nothing in {timeout:.0f} s")
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout)
        assert proc.stderr is not None
        raise AssertionError(f"worker {proc.pid} exited {proc.returncode}: {proc.stderr.read()}")
    return line.strip()


class Workers:
    """Started workers: a few are always importing and building their tensors while the test
    checks what the last one left, so each kill costs little more than the save and the
    checks. Every process started here is killed and reaped on close, failures included."""

    AHEAD = 3  # workers started ahead of need

    def __init__(self) -> None:
        self.started: list[subprocess.Popen[str]] = []
        self.waiting: collections.deque[subprocess.Popen[str]] = collections.deque()

    def _start(self) -> None:
        proc = subprocess.Popen(
            [sys.executable, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )
        self.started.append(proc)
        self.waiting.append(proc)

    def go(self, path: Path, version: int) -> subprocess.Popen[str]:
        """A ready worker, told to save `version` to `path` (and the next ones started)."""
        while len(self.waiting) < self.AHEAD:
            self._start()
        proc = self.waiting.popleft()
        assert read_line(proc, START_TIMEOUT_S) == "ready"
        assert proc.stdin is not None
        proc.stdin.write(f"{path} {version}\n")
        proc.stdin.flush()
        return proc

    def close(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()


@pytest.fixture
def workers() -> Iterator[Workers]:
    w = Workers()
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


def wait_saved(proc: subprocess.Popen[str]) -> float:
    """Seconds from now until `proc` says its save is done (it must finish)."""
    start = time.monotonic()
    assert read_line(proc, SAVE_TIMEOUT_S) == "saved"
    seconds = time.monotonic() - start
    assert proc.wait(SAVE_TIMEOUT_S) == 0
    return seconds


def kill_after(proc: subprocess.Popen[str], delay: float) -> bool:
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
    disk_dir: Path, workers: Workers, versions: dict[int, dict[str, torch.Tensor]], name: str
) -> None:
    seed = crash_seed()
    rng = random.Random(seed)
    path = disk_dir / name
    bystanders = plant_bystanders(disk_dir, name)
    wait_saved(workers.go(path, 0))
    duration = wait_saved(workers.go(path, 1))  # a save over an existing checkpoint, timed
    held = held_version(path, versions, "uninterrupted save")
    assert held == 1
    outcomes: collections.Counter[str] = collections.Counter()
    killed: set[int] = set()
    leftovers_seen = 0
    for i in range(KILLS):
        delay = rng.uniform(0, LATE * duration)
        context = f"seed {seed}, kill {i} at {delay:.3f} s of a {duration:.3f} s save"
        new = 1 - held
        proc = workers.go(path, new)
        finished = kill_after(proc, delay)
        if not finished:
            killed.add(proc.pid)
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
    wait_saved(workers.go(path, 1 - held))
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
