"""The `tensortier` command-line tool as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import tensortier

BIN = Path(os.environ.get("TENSORTIER_CLI", Path(sys.executable).parent / "tensortier"))


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN), *args], capture_output=True, text=True, timeout=300)


def test_check_notes_tensortier_variables_that_name_no_setting(disk_dir: Path) -> None:
    env = {**os.environ, "TENSORTIER_CHUNKSIZE": "5000", "TENSORTIER_NOTHING_LIKE_IT": "1"}
    r = subprocess.run([str(BIN), "check", str(disk_dir)], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert ("note: TENSORTIER_CHUNKSIZE is set but names no setting (did you mean "
            "TENSORTIER_CHUNK_SIZE?)") in r.stdout, r.stdout
    assert ("note: TENSORTIER_NOTHING_LIKE_IT is set but names no setting (it has no effect)"
            in r.stdout), r.stdout
    assert "note: TENSORTIER_CHUNK_SIZE " not in r.stdout


def test_check_reports_backends(disk_dir: Path) -> None:
    r = run("check", str(disk_dir))
    assert r.returncode == 0, r.stderr
    for name in ("io_uring", "libaio", "threads"):
        assert name in r.stdout
    assert "auto ->" in r.stdout and "CUDA driver" in r.stdout and "cuFile" in r.stdout
    assert "TENSORTIER_CHUNK_SIZE" in r.stdout
    assert "GDS with TENSORTIER_GDS=auto: " in r.stdout
    assert "reads into new tensors (TENSORTIER_STAGE_READS=auto):" in r.stdout
    for setting, says in (("on", "staged through the engine's bounce buffers"),
                          ("off", ": direct")):
        r = subprocess.run([str(BIN), "check", str(disk_dir)], capture_output=True, text=True,
                           timeout=300, env={**os.environ, "TENSORTIER_STAGE_READS": setting})
        assert f"TENSORTIER_STAGE_READS={setting}): " in r.stdout and says in r.stdout, r.stdout


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="a CUDA driver is installed here")
def test_check_says_why_gds_auto_uses_the_ring(disk_dir: Path, nvidia_libcufile: Path) -> None:
    """Without libcufile, and with one (NVIDIA's, from the nvidia-cufile wheel) but no driver."""
    env = {**os.environ, "TENSORTIER_CUFILE_LIBRARY": "/nonexistent/libcufile.so.0"}
    r = subprocess.run([str(BIN), "check", str(disk_dir)], capture_output=True, text=True,
                       timeout=300, env=env)
    assert "cuFile (/nonexistent/libcufile.so.0): not found" in r.stdout, r.stdout
    assert ("GDS with TENSORTIER_GDS=auto: the bounce ring: /nonexistent/libcufile.so.0 not "
            "found") in r.stdout, r.stdout
    env["TENSORTIER_CUFILE_LIBRARY"] = str(nvidia_libcufile)
    r = subprocess.run([str(BIN), "check", str(disk_dir)], capture_output=True, text=True,
                       timeout=300, env=env)
    assert f"cuFile ({nvidia_libcufile}): found" in r.stdout, r.stdout
    assert "GDS with TENSORTIER_GDS=auto: the bounce ring: no usable CUDA driver" in r.stdout


@pytest.mark.parametrize("variable, value", [
    ("TENSORTIER_GDS", "bogus"), ("TENSORTIER_BOUNCE_SLOTS", "x"),
    ("TENSORTIER_BOUNCE_SLOT_SIZE", "3"), ("TENSORTIER_BOUNCE_RINGS", "0"),
])
def test_check_rejects_bad_cuda_settings(disk_dir: Path, variable: str, value: str) -> None:
    """Settings the CUDA paths read are checked by `check` too, not only at a first transfer."""
    r = subprocess.run([str(BIN), "check", str(disk_dir)], capture_output=True, text=True,
                       timeout=300, env={**os.environ, variable: value})
    assert r.returncode == 1 and variable in r.stderr, r.stdout + r.stderr


def test_check_prints_the_cuda_settings_in_effect(disk_dir: Path) -> None:
    env = {**os.environ, "TENSORTIER_GDS": "auto", "TENSORTIER_BOUNCE_SLOTS": "3"}
    r = subprocess.run([str(BIN), "check", str(disk_dir)], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert "GDS for CUDA tensors (TENSORTIER_GDS): auto\n" in r.stdout, r.stdout
    assert "3 x 8 MiB pinned per transfer" in r.stdout, r.stdout
    env["TENSORTIER_GDS"] = "true"  # a word both check and the Python API take, as 'on'
    r = subprocess.run([str(BIN), "check", str(disk_dir)], capture_output=True, text=True,
                       timeout=300, env=env)
    assert "(TENSORTIER_GDS): on\n" in r.stdout, r.stdout
    from tensortier._core import gds_mode as _gds_mode

    assert _gds_mode("true") == "on" and _gds_mode("false") == "off"
    env.pop("TENSORTIER_GDS")
    r = subprocess.run([str(BIN), "check", str(disk_dir)], capture_output=True, text=True,
                       timeout=300, env=env)
    assert "(TENSORTIER_GDS): off (default)" in r.stdout, r.stdout


@pytest.mark.parametrize("command", ["check", "info", "verify", "convert", "bench"])
def test_every_command_has_help(command: str) -> None:
    for flag in ("--help", "-h"):
        r = run(command, flag)
        assert r.returncode == 0 and r.stdout.startswith(f"usage: tensortier {command}"), (
            r.stdout + r.stderr)


def test_help_and_version() -> None:
    r = run("help")
    assert r.returncode == 0 and "torch.save zip <-> safetensors" in r.stdout
    for variable in ("TENSORTIER_CHUNK_SIZE", "TENSORTIER_HUGE_PAGES", "TENSORTIER_GDS",
                     "TENSORTIER_BOUNCE_SLOTS", "TENSORTIER_CUFILE_LIBRARY"):
        assert variable in r.stdout
    import tensortier

    r = run("--version")
    assert r.returncode == 0 and r.stdout == f"tensortier {tensortier.__version__}\n"


def test_check_makes_files_of_its_own_and_leaves_none(disk_dir: Path) -> None:
    """A planted link where check used to make its probe file is not followed (the target is
    not truncated), and a bad setting, which fails check, leaves nothing behind."""
    directory = disk_dir / "shared"
    directory.mkdir()
    victim = disk_dir / "victim"
    victim.write_bytes(b"keep me")
    (directory / ".tensortier-check-align").symlink_to(victim)
    env = {**os.environ, "TENSORTIER_CHUNK_SIZE": "5000"}
    r = subprocess.run([str(BIN), "check", str(directory)], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 1 and "TENSORTIER_CHUNK_SIZE=5000 is invalid" in r.stderr, r.stderr
    assert "could not tell (TENSORTIER_CHUNK_SIZE=5000" in r.stdout, r.stdout
    assert "O_DIRECT: could not test" not in r.stdout, r.stdout
    assert victim.read_bytes() == b"keep me"
    assert sorted(p.name for p in directory.iterdir()) == [".tensortier-check-align"]


def test_check_tests_a_read_only_directory_by_reading(tmp_path: Path) -> None:
    """A data set's read-only mount takes no probe file: the backends are tested by reading a
    file already there, and check says that writes were not tested (exit 1: a save there would
    fail), not that no backend works."""
    from conftest import mounted

    if os.geteuid() != 0:
        pytest.skip("mounting a filesystem needs root")
    mnt = tmp_path / "data"
    mnt.mkdir()
    with mounted(["mount", "-t", "tmpfs", "-o", "size=1m", "none", str(mnt)], mnt, "tmpfs"):
        (mnt / "class0").mkdir()
        (mnt / "class0" / "a.jpg").write_bytes(os.urandom(10_000))
        remount = subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True,
                                 text=True, timeout=60)
        assert remount.returncode == 0, remount.stderr
        r = run("check", str(mnt))
        # Reads work; writes (a save, an offload) would not: a problem to report, exactly.
        assert r.returncode == 1, r.stdout + r.stderr
        assert "no I/O backend works" not in r.stderr
        assert "reads only: the directory takes no files" in r.stdout, r.stdout
        assert f"reads of {mnt}/class0/a.jpg tested; writes not (Read-only file system)" in (
            r.stdout), r.stdout
        assert f"by reading {mnt}/class0/a.jpg" in r.stdout or "O_DIRECT: not available" in (
            r.stdout), r.stdout
        assert f"{mnt} takes no files (read-only, or not this user's)" in r.stderr, r.stderr
        probes = tensortier.probe_backends(mnt)
        assert any(p["buffered_ok"] and not p["writes_tested"] for p in probes), probes


def test_output_lost_to_a_full_disk_fails_the_command() -> None:
    """`tensortier ... > out` on a full disk exits 1 and says so, as GNU tools do."""
    with open("/dev/full", "w") as full:
        r = subprocess.run([str(BIN), "--version"], stdout=full, stderr=subprocess.PIPE,
                           text=True, timeout=60)
    assert r.returncode == 1 and "write error on standard output" in r.stderr, r.stderr


def test_check_rejects_missing_dir(disk_dir: Path) -> None:
    r = run("check", str(disk_dir / "nope"))
    assert r.returncode != 0 and "not a directory" in r.stderr


@pytest.mark.parametrize("backend", ["auto", "threads"])
def test_bench_json(disk_dir: Path, backend: str) -> None:
    r = run("bench", "--dir", str(disk_dir), "--size", "64M", "--block-size", "1M",
            "--queue-depth", "8", "--threads", "2", "--backend", backend, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["write_gbps"] > 0 and out["read_gbps"] > 0
    assert out["write_stats"]["bytes"] == out["read_stats"]["bytes"] > 0
    assert not list(disk_dir.iterdir())  # scratch file removed


def test_bench_randread_and_warm(disk_dir: Path) -> None:
    r = run("bench", "--dir", str(disk_dir), "--size", "32M", "--block-size", "4K",
            "--mode", "randread", "--ops", "2000", "--queue-depth", "64", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["randread_iops"] > 0
    r = run("bench", "--dir", str(disk_dir), "--size", "32M", "--mode", "read", "--warm", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["warm"] and out["warm_stats"]["cached_bytes"] > 0


def test_bench_rejects_bad_options(disk_dir: Path) -> None:
    r = run("bench", "--dir", str(disk_dir), "--size", "lots")
    assert r.returncode != 0 and "--size" in r.stderr
    r = run("bench", "--frobnicate")
    assert r.returncode != 0 and "unknown option" in r.stderr
    r = run("bench", "--dir", str(disk_dir), "stray")  # a positional ran a 1 GiB benchmark
    assert r.returncode != 0 and "options only" in r.stderr
    r = run("bench", "--dir", str(disk_dir), "--warm", "--mode", "write")
    assert r.returncode != 0 and "--warm times reads" in r.stderr
    r = run("bench", "--dir", str(disk_dir), "--sweep", "--size", "64K")
    assert r.returncode != 0 and "at least 256K" in r.stderr
    assert not (disk_dir / "tensortier-bench.dat").exists()


def test_bench_removes_only_the_scratch_file_it_made(disk_dir: Path) -> None:
    """A file that was there before the run (`--mode read --file data.bin` to time reading
    one's own file) is the user's: it stays, with its contents. The file a run makes goes,
    when the run fails too."""
    data = disk_dir / "data.bin"
    payload = os.urandom(2 << 20)
    data.write_bytes(payload)
    for mode in ("read", "randread"):
        r = run("bench", "--dir", str(disk_dir), "--file", "data.bin", "--size", "1M",
                "--mode", mode, "--ops", "10", "--json")
        assert r.returncode == 0, r.stderr
        assert data.read_bytes() == payload, mode
    assert sorted(p.name for p in disk_dir.iterdir()) == ["data.bin"]


def test_bench_never_writes_over_a_users_file(disk_dir: Path) -> None:
    """A file that was there before the run, and that bench did not make, is never written:
    the write modes and --sweep refuse it (they used to replace it with random bytes, and
    --sweep did so under --mode read)."""
    data = disk_dir / "mine.bin"
    payload = os.urandom(1 << 20)
    data.write_bytes(payload)
    for options in (("--mode", "both"), ("--mode", "write"), ("--mode", "read", "--sweep"), ()):
        r = run("bench", "--dir", str(disk_dir), "--file", "mine.bin", "--size", "256K", *options)
        assert r.returncode == 2, (options, r.stdout + r.stderr)
        assert f"'{data}' is not a file bench wrote (it was there before" in r.stderr
        assert data.read_bytes() == payload, options
    assert sorted(p.name for p in disk_dir.iterdir()) == ["mine.bin"]


def test_bench_knows_its_own_scratch_file_from_an_earlier_run(disk_dir: Path) -> None:
    """A scratch file kept (--keep) or left by a killed run is bench's: the next run writes
    it and removes it, instead of taking it for the user's."""
    r = run("bench", "--dir", str(disk_dir), "--size", "1M", "--keep", "--json")
    assert r.returncode == 0, r.stderr
    scratch = disk_dir / "tensortier-bench.dat"
    if not scratch.exists() or not _has_bench_mark(scratch):
        pytest.skip("this filesystem keeps no user extended attributes")
    r = run("bench", "--dir", str(disk_dir), "--size", "1M", "--json")
    assert r.returncode == 0, r.stderr
    assert not scratch.exists()
    # Data of the user's copied into a file bench kept makes it the user's again.
    r = run("bench", "--dir", str(disk_dir), "--size", "1M", "--keep", "--json")
    assert r.returncode == 0 and _has_bench_mark(scratch), r.stderr
    payload = os.urandom(1 << 20)
    with open(scratch, "r+b") as f:
        f.write(payload)
    r = run("bench", "--dir", str(disk_dir), "--size", "1M", "--mode", "read", "--json")
    assert r.returncode == 0 and scratch.read_bytes() == payload, r.stderr  # read, kept
    r = run("bench", "--dir", str(disk_dir), "--size", "1M")
    assert r.returncode == 2 and "is not a file bench wrote" in r.stderr, r.stderr
    assert scratch.read_bytes() == payload


def _has_bench_mark(path: Path) -> bool:
    try:
        return len(os.getxattr(path, "user.tensortier.bench")) > 0
    except OSError:
        return False


def test_an_interrupted_bench_removes_its_scratch_file(disk_dir: Path) -> None:
    """Ctrl-C (SIGINT) or a kill (SIGTERM) in the middle of a run removes the scratch file, as
    the end of a run does, and the process ends by the signal."""
    import signal
    import time

    scratch = disk_dir / "tensortier-bench.dat"
    for sig in (signal.SIGINT, signal.SIGTERM):
        proc = subprocess.Popen([str(BIN), "bench", "--dir", str(disk_dir), "--size", "8G",
                                 "--mode", "write"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 60
            while not scratch.exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert scratch.exists(), "the run made no scratch file"
            proc.send_signal(sig)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == -sig, (proc.returncode, proc.stderr.read() if proc.stderr else "")
        assert not scratch.exists(), sig
        if proc.stderr:
            proc.stderr.close()
    # A signal the process was started ignoring (nohup's SIGHUP) stays ignored.
    proc = subprocess.Popen(["nohup", str(BIN), "bench", "--dir", str(disk_dir), "--size", "64M",
                             "--json"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not scratch.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        proc.send_signal(signal.SIGHUP)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and json.loads(out)["size"] == 64 << 20, proc.returncode
    assert not scratch.exists()


def test_bench_takes_the_engine_settings_from_the_environment(disk_dir: Path) -> None:
    """TENSORTIER_BACKEND, _CHUNK_SIZE, _QUEUE_DEPTH and _WORKERS are bench's defaults where
    set (they were ignored); its options still win."""
    env = {**os.environ, "TENSORTIER_BACKEND": "threads", "TENSORTIER_CHUNK_SIZE": "64K",
           "TENSORTIER_QUEUE_DEPTH": "4", "TENSORTIER_WORKERS": "1"}
    command = [str(BIN), "bench", "--dir", str(disk_dir), "--size", "1M", "--json"]
    r = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["backend"], out["block_size"], out["queue_depth"], out["threads"]) == (
        "threads", 65536, 4, 1), out
    r = subprocess.run([*command, "--block-size", "128K"], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0 and json.loads(r.stdout)["block_size"] == 131072, r.stderr


def test_bench_never_fills_a_users_file_smaller_than_size(disk_dir: Path) -> None:
    """Reading one's own file with a --size larger than it: refused naming the file, whose
    contents stay (the run used to fill it up to --size with the benchmark's bytes)."""
    data = disk_dir / "mine.bin"
    payload = os.urandom(100_000)
    data.write_bytes(payload)
    for mode in ("read", "randread"):
        r = run("bench", "--dir", str(disk_dir), "--file", "mine.bin", "--size", "1M",
                "--mode", mode, "--ops", "10")
        assert r.returncode == 1, r.stdout + r.stderr
        assert f"'{data}' holds 100000 bytes, fewer than --size 1048576" in r.stderr, r.stderr
        assert data.read_bytes() == payload, mode
    assert sorted(p.name for p in disk_dir.iterdir()) == ["mine.bin"]


def test_bench_out_of_space_removes_its_scratch_file(small_fs: Path) -> None:
    """A run that fails after making its scratch file (out of space) removes it: a full
    filesystem is not left full of it."""
    for mode in ("write", "read", "randread"):
        r = run("bench", "--dir", str(small_fs), "--size", "64M", "--mode", mode, "--ops", "10")
        assert r.returncode != 0 and "No space left" in r.stderr, (mode, r.stderr)
        assert not (small_fs / "tensortier-bench.dat").exists(), mode


def test_bench_table_shows_iops_for_random_reads_only(disk_dir: Path) -> None:
    r = run("bench", "--dir", str(disk_dir), "--size", "16M", "--mode", "randread",
            "--ops", "200")
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line.split() for line in r.stdout.splitlines()[2:]}
    assert rows["randread"][5].isdigit(), r.stdout
    r = run("bench", "--dir", str(disk_dir), "--size", "16M")
    rows = {line.split()[0]: line.split() for line in r.stdout.splitlines()[2:]}
    assert rows["write"][5] == "-" and rows["read"][5] == "-", r.stdout


def test_count_options_refuse_signs_and_spaces(disk_dir: Path) -> None:
    (disk_dir / "c").mkdir()
    (disk_dir / "c" / "a.jpg").write_bytes(b"a")
    # strtoull reads "-3" as 2^64 - 3 and skips leading blanks: neither is a count.
    for value in ("-3", "-0", " 5", "+5"):
        r = run("bench-files", str(disk_dir), "--batch-size", value)
        assert r.returncode != 0
        assert f"--batch-size: '{value}' is not a number" in r.stderr, r.stderr
    r = run("bench-files", str(disk_dir), "--batch-size", "2", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["batch_size"] == 2
    # A seed is any 64-bit number, as FileReader's.
    r = run("bench-files", str(disk_dir), "--shuffle", "--seed", str(2**64 - 1), "--json")
    assert r.returncode == 0, r.stderr
    r = run("bench-files", str(disk_dir), "--shuffle", "--seed", str(2**64))
    assert r.returncode == 2 and f"--seed: {2**64} is too large" in r.stderr, r.stderr


def test_bench_files_reads_what_file_reader_reads_with_its_filters_and_lists(
        disk_dir: Path) -> None:
    """bench-files takes FileReader's file_filters, dir_filters and file_list: a tree of .bin
    files, which the reader reads with file_filters=["*.bin"], was refused ("no files")."""
    from tensortier.data import FileReader

    root = disk_dir / "set"
    for label, name in enumerate(("cats", "dogs", "eels")):
        (root / name).mkdir(parents=True)
        for i in range(label + 2):
            (root / name / f"{i}.bin").write_bytes(os.urandom(100 + i))
        (root / name / "notes.TXT").write_bytes(b"x")

    def files_read(*options: str) -> int:
        r = run("bench-files", *options, "--json")
        assert r.returncode == 0, r.stderr
        return int(json.loads(r.stdout)["files"])

    assert files_read(str(root), "--file-filters", "*.bin") == len(
        FileReader(file_root=root, file_filters=["*.bin"]).files) == 9
    assert files_read(str(root), "--file-filters", "*.bin,*.txt") == 12
    assert files_read(str(root), "--file-filters", "*.TXT", "--case-sensitive-filter") == 3
    assert files_read(str(root), "--file-filters", "*.bin", "--dir-filters", "d*,e*") == 7
    listing = disk_dir / "list.txt"
    listing.write_text("set/cats/0.bin 0\nset/dogs/2.bin 1\n")
    assert files_read("--file-list", str(listing)) == 2
    r = run("bench-files", str(root))
    assert r.returncode == 1 and "no files" in r.stderr.lower(), r.stderr
    r = run("bench-files")
    assert r.returncode == 2 and "one ROOT folder" in r.stderr, r.stderr


def test_verify_and_info_read_a_file_holding_numpy_arrays(tmp_path: Path) -> None:
    """An HF Trainer's rng_state.pth holds np.random.get_state(): its objects are listed as
    values, never called, and every zip entry's CRC-32 is checked."""
    import torch

    np = pytest.importorskip("numpy")
    path = tmp_path / "rng_state.pth"
    torch.save({"numpy": np.random.get_state(), "cpu": torch.arange(4)}, path)
    r = run("verify", str(path))
    assert r.returncode == 0, r.stderr
    assert "structure OK (torch.save zip, 1 tensor)" in r.stdout, r.stdout
    assert "data OK" in r.stdout, r.stdout
    r = run("info", str(path))
    assert r.returncode == 0, r.stderr
    assert "tensors:   1" in r.stdout, r.stdout


def test_verify_and_info_list_tensors_in_dict_and_list_subclasses(tmp_path: Path) -> None:
    """A defaultdict or a user's dict/list subclass gets its items as pickle gives them
    (SETITEMS, APPENDS on the object): listed under their keys, every CRC-32 checked."""
    path = tmp_path / "subclasses.pt"
    script = ("import collections, sys, torch\n"
              "class Named(dict): pass\n"
              "class Rows(list): pass\n"
              "d = collections.defaultdict(list); d['a'].append(torch.ones(3))\n"
              "torch.save({'dd': d, 'named': Named(w=torch.zeros(2)), 'rows': Rows([torch.ones(1)]),"
              " 'n': 7}, sys.argv[1])\n")
    subprocess.run([sys.executable, "-c", script, str(path)], check=True, timeout=120)
    r = run("verify", str(path))
    assert r.returncode == 0, r.stderr
    assert "structure OK (torch.save zip, 3 tensors)" in r.stdout, r.stdout
    r = run("info", str(path))
    assert r.returncode == 0, r.stderr
    for name in ("dd.a.0", "named.w", "rows.0"):
        assert name in r.stdout, r.stdout


def test_verify_reads_a_pickled_dataclass_as_trainer_saves_its_arguments(
        tmp_path: Path) -> None:
    """An HF Trainer's training_args.bin is torch.save of a dataclass instance."""
    path = tmp_path / "training_args.bin"
    script = ("import dataclasses, sys, torch\n"
              "@dataclasses.dataclass\n"
              "class TrainingArguments:\n"
              "    output_dir: str = 'out'\n"
              "    learning_rate: float = 5e-5\n"
              "torch.save(TrainingArguments(), sys.argv[1])\n")
    subprocess.run([sys.executable, "-c", script, str(path)], check=True, timeout=120)
    r = run("verify", str(path))
    assert r.returncode == 0, r.stderr
    assert "structure OK (torch.save zip, 0 tensors)" in r.stdout, r.stdout
