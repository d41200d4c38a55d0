"""Exit status of the `tensortier` tool: 2 with the command's usage line for a command line a
command cannot run, 1 for damaged files and failed I/O, as getopt and argparse tools do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tensortier

BIN = Path(os.environ.get("TENSORTIER_CLI", Path(sys.executable).parent / "tensortier"))


def run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN), *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def assert_usage_error(r: subprocess.CompletedProcess[str], command: str, says: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert lines[0].startswith(f"tensortier {command}: ") and says in lines[0], r.stderr
    assert lines[1].startswith(f"usage: tensortier {command}"), r.stderr
    assert lines[-1] == f"(tensortier {command} --help for more)", r.stderr
    assert r.stdout == "", r.stdout


@pytest.fixture
def checkpoint(disk_dir: Path) -> Path:
    path = disk_dir / "m.safetensors"
    tensortier.save({"w": torch.arange(6.0)}, path, checksum=True)
    return path


@pytest.fixture
def class_root(disk_dir: Path) -> Path:
    root = disk_dir / "root"
    (root / "c").mkdir(parents=True)
    (root / "c" / "a.jpg").write_bytes(b"a")
    return root


def test_tool_without_a_known_command() -> None:
    r = run()
    assert r.returncode == 2 and r.stderr.startswith("usage: tensortier <command>"), r.stderr
    r = run("frobnicate")
    assert r.returncode == 2 and "unknown command 'frobnicate'" in r.stderr, r.stderr
    r = run("help", "frobnicate")  # as git and cargo: an error, not the general help
    assert r.returncode == 2 and "unknown command 'frobnicate'" in r.stderr, r.stderr


def test_version_takes_no_arguments_and_help_names_a_command() -> None:
    for args in (("--version", "extra"), ("--version", "--bogus"), ("version", "x")):
        r = run(*args)
        assert r.returncode == 2 and "takes no arguments" in r.stderr, (args, r.stderr)
    r = run("--version")
    assert r.returncode == 0 and r.stdout.startswith("tensortier "), r.stdout
    for command in ("check", "info", "verify", "convert", "bench", "bench-files", "extents"):
        r = run("help", command)
        assert r.returncode == 0 and r.stdout == run(command, "--help").stdout, command
        assert r.stdout.startswith(f"usage: tensortier {command}"), r.stdout


def test_check_usage_errors(disk_dir: Path) -> None:
    assert_usage_error(run("check", disk_dir, disk_dir), "check", "check takes one directory")
    assert_usage_error(run("check", "--deep", disk_dir), "check",
                       "unknown option '--deep' (the command takes none)")
    assert_usage_error(run("check", "-v"), "check", "unknown option '-v'")


def test_info_verify_convert_usage_errors(checkpoint: Path, disk_dir: Path) -> None:
    out = disk_dir / "out.pt"
    cases = [
        (("info",), "info", "info takes one FILE"),
        (("info", checkpoint, checkpoint), "info", "info takes one FILE"),
        (("info", checkpoint, "--shapes"), "info", "--shapes needs a value"),
        (("info", checkpoint, "--shapes", "many"), "info", "--shapes: 'many' is not a number"),
        (("info", checkpoint, "--shapes=-1"), "info", "--shapes: '-1' is not a number"),
        (("info", "--all", checkpoint), "info", "unknown option '--all' (known: --shapes)"),
        (("info", "-s", "3", checkpoint), "info", "unknown option '-s'"),
        (("verify",), "verify", "verify takes one FILE"),
        (("verify", checkpoint, checkpoint), "verify", "verify takes one FILE"),
        (("verify", "--quick", checkpoint), "verify", "unknown option '--quick'"),
        (("convert",), "convert", "convert takes IN and OUT"),
        (("convert", checkpoint), "convert", "convert takes IN and OUT"),
        (("convert", checkpoint, out, out), "convert", "convert takes IN and OUT"),
        (("convert", "--force", checkpoint, out), "convert", "unknown option '--force'"),
    ]
    for args, command, says in cases:
        assert_usage_error(run(*args), command, says)
    assert not out.exists()


def test_bench_usage_errors(disk_dir: Path) -> None:
    d = ("--dir", disk_dir)
    cases = [
        (("stray",), "bench takes options only, not 'stray'"),
        (("--frobnicate",), "unknown option '--frobnicate'"),
        (("--size", "lots"), "--size: 'lots' is not a size like 4096, 64K, 1M or 2G"),
        (("--size",), "--size needs a value"),
        (("--threads", "x"), "--threads: 'x' is not a number"),
        (("--mode", "fast"), "--mode must be write, read, both or randread"),
        (("--size", "0"), "--size must be > 0"),
        (("--block-size", "1000"), "--block-size a multiple of 4K"),
        (("--ops", "0"), "--ops must be > 0"),
        (("--warm", "--mode", "write"), "--warm times reads"),
        (("--sweep", "--size", "64K"), "at least 256K"),
        (("--json=yes",), "unknown option '--json=yes'"),
        # The engine's ranges, from the settings table, named by the option.
        (("--threads", "0"), "--threads: workers (TENSORTIER_WORKERS): 0 is out of range"),
        (("--queue-depth", "0"), "--queue-depth: queue_depth (TENSORTIER_QUEUE_DEPTH): 0 is out"),
        (("--queue-depth", "5000"), "--queue-depth: queue_depth (TENSORTIER_QUEUE_DEPTH): 5000"),
        (("--backend", "spdk"), "backend: 'spdk' is not one of auto, io_uring, libaio, threads"),
    ]
    for args, says in cases:
        assert_usage_error(run("bench", *d, *args), "bench", says)
    assert not list(disk_dir.iterdir())  # nothing was run
    # A bad TENSORTIER_* variable is the environment's, not the command line's: status 1.
    r = subprocess.run([str(BIN), "bench", *map(str, d), "--size", "1M"], capture_output=True,
                       text=True, timeout=300, env={**os.environ, "TENSORTIER_WORKERS": "0"})
    assert r.returncode == 1 and "TENSORTIER_WORKERS" in r.stderr, r.stderr
    assert "usage:" not in r.stderr, r.stderr


def test_bench_refuses_a_missing_dir_naming_it(disk_dir: Path) -> None:
    """As fio's --directory: a typo does not make a folder and time whatever disk holds it."""
    missing = disk_dir / "no" / "such"
    r = run("bench", "--dir", missing, "--size", "1M")
    assert_usage_error(r, "bench", f"--dir '{missing}' is not a directory")
    assert not (disk_dir / "no").exists()
    a_file = disk_dir / "f"
    a_file.write_bytes(b"x")
    assert_usage_error(run("bench", "--dir", a_file, "--size", "1M"), "bench",
                       f"--dir '{a_file}' is not a directory")
    assert a_file.read_bytes() == b"x"


def test_bench_files_usage_errors(class_root: Path) -> None:
    cases = [
        ((), "bench-files takes one ROOT folder"),
        ((class_root, class_root), "bench-files takes one ROOT folder"),
        ((class_root, "--epochs", "0"), "--epochs must be at least 1"),
        ((class_root, "--batch-size", "0"), "--batch-size must be at least 1"),
        ((class_root, "--prefetch", "0"), "--prefetch must be at least 1"),
        ((class_root, "--open-threads", "0"), "--open-threads must be at least 1"),
        # Before ROOT is looked at: the command line is wrong whatever ROOT holds.
        ((class_root / "missing", "--batch-size", "0"), "--batch-size must be at least 1"),
        ((class_root, "--batch-size", "-3"), "--batch-size: '-3' is not a number"),
        ((class_root, "--prefetch", str(1 << 30)), "--prefetch: 1073741824 is too large"),
        ((class_root, "--fast"), "unknown option '--fast'"),
    ]
    for args, says in cases:
        assert_usage_error(run("bench-files", *args), "bench-files", says)


def test_extents_usage_errors(disk_dir: Path) -> None:
    cases = [
        ((), "extents needs a command: build or verify"),
        (("shrink",), "unknown extents command 'shrink'"),
        (("build",), "extents build takes one ROOT"),
        (("build", disk_dir), "extents build needs -o MAP"),
        (("build", disk_dir, "-o"), "--output needs a value"),
        (("build", disk_dir, disk_dir, "-o", disk_dir / "m.json"), "extents build takes one ROOT"),
        (("build", disk_dir, "-o", disk_dir / "m.json", "--all"), "unknown option '--all'"),
        (("verify",), "extents verify takes one MAP"),
        (("verify", "a.json", "b.json"), "extents verify takes one MAP"),
    ]
    for args, says in cases:
        r = run("extents", *args)
        assert_usage_error(r, "extents", says)
        # Both forms of the command are shown.
        assert "       tensortier extents verify MAP" in r.stderr.splitlines()[2], r.stderr
    assert not (disk_dir / "m.json").exists()


def test_damaged_files_and_failed_io_stay_status_1(disk_dir: Path, checkpoint: Path) -> None:
    missing = disk_dir / "missing.safetensors"
    garbage = disk_dir / "garbage.safetensors"
    garbage.write_bytes(b"\xff" * 100)
    for args in (("info", missing), ("info", garbage), ("verify", missing), ("verify", garbage),
                 ("convert", missing, disk_dir / "o.pt"), ("convert", garbage, disk_dir / "o.pt"),
                 ("extents", "verify", missing), ("bench-files", disk_dir / "no-root")):
        r = run(*args)
        assert r.returncode == 1, (args, r.stderr)
        assert "usage:" not in r.stderr, (args, r.stderr)
    # A well-formed command line still runs.
    assert run("info", checkpoint).returncode == 0


def test_double_dash_ends_the_options(disk_dir: Path, checkpoint: Path) -> None:
    """A file whose name starts with a dash is named after `--`, as with getopt."""
    dashed = disk_dir / "-m.safetensors"
    checkpoint.rename(dashed)
    r = subprocess.run([str(BIN), "info", "--", dashed.name], capture_output=True, text=True,
                       timeout=300, cwd=disk_dir)
    assert r.returncode == 0 and "safetensors" in r.stdout, r.stderr
    r = subprocess.run([str(BIN), "info", dashed.name], capture_output=True, text=True,
                       timeout=300, cwd=disk_dir)
    assert_usage_error(r, "info", f"unknown option '{dashed.name}'")
    # A file named --help, after `--`, is a file: not a request for help.
    checkpoint_named_help = disk_dir / "--help"
    dashed.rename(checkpoint_named_help)
    r = subprocess.run([str(BIN), "info", "--", "--help"], capture_output=True, text=True,
                       timeout=300, cwd=disk_dir)
    assert r.returncode == 0 and "safetensors" in r.stdout and "usage:" not in r.stdout, (
        r.stdout + r.stderr)


def test_help_states_the_exit_statuses() -> None:
    r = run("help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    assert "Exit status: 0 on success; 2 for a command line a command cannot run" in text
    assert "1 for anything else (a damaged file, a failed read or write" in text
    for command, says in (("check", "2 when DIR is not a directory or the command line is wrong"),
                          ("verify", "2 when the command line is wrong"),
                          ("extents", "1 otherwise (2: a usage error)")):
        r = run(command, "--help")
        assert r.returncode == 0 and says in " ".join(r.stdout.split()), r.stdout
