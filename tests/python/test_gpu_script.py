"""scripts/gpu-test.sh, which only a GPU machine runs in full: its shell parses, --help works,
and a call whose --budget cannot fit a step ends in time with a summary that says so (the
device machine sends back only what the call wrote before its limit)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu-test.sh"


def run(*args: str, out: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable,
               BENCH_DIR=str(out / "bench"))
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          env=env, timeout=120, cwd=REPO)


def test_the_script_parses_and_has_help(tmp_path: Path) -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    r = run("--help", out=tmp_path)
    assert r.returncode == 0 and "--budget" in r.stdout and "bench-checkpoint" in r.stdout
    r = run("--bogus", out=tmp_path)
    assert r.returncode == 2 and "unknown argument" in r.stderr


def test_a_step_that_cannot_fit_the_budget_is_not_run(tmp_path: Path) -> None:
    r = run("bench", "--budget", "20", out=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    summary = (tmp_path / "summary.txt").read_text()
    # build first (or, where an earlier run built, the bench itself): neither fits in 20 s
    assert "NOT RUN build" in summary or "NOT RUN GPU benchmark" in summary, summary
    assert "O_DIRECT:" in summary and "/proc/driver/nvidia-fs:" in summary  # machine facts
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.txt"]  # few files back
