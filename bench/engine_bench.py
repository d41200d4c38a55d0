#!/usr/bin/env python3
"""I/O engine benchmark: tensortier against fio and plain Python file I/O, in one run.

Every tool runs as a subprocess that prints one JSON object. Each repeat runs the tools in a
rotated order (repeat r starts with tool r mod n); the report gives the median of the repeats and
the ratio tensortier median / baseline median, checked against the targets of the product spec.
Throughput on the shared disk of our machines only means something as such a ratio.

Scenarios (``--scenario``, default all):
  seq   SIZE sequential write (O_DIRECT, fsync included) then cold read. tensortier vs fio with
        default buffers, fio with huge-page buffers (``--iomem=mmaphuge``, else ``shmhuge``,
        skipped if neither works) and plain Python. Targets: >= 0.95x fio, >= 2.5x Python.
  rand  Random O_DIRECT reads of 4K and 128K blocks at queue depth 64, a fixed number of ops,
        over one file written beforehand (untimed). tensortier vs fio. Target: >= 0.9x fio IOPS.
  warm  Sequential read of a file in the page cache (each tool reads it once untimed first).
        tensortier ``--warm`` vs fio buffered (psync and io_uring with default buffers, psync
        with ``--iomem=mmap``); Python is shown for reference. Target: >= 0.9x fio.

Examples:
  python bench/engine_bench.py                          # everything, defaults (2G, 3 repeats)
  python bench/engine_bench.py --quick                  # smoke test (256M, fewer ops)
  python bench/engine_bench.py --tools fio,python --quick --scenario seq
Exit status: 0, or 1 if tensortier was selected and failed (or a scenario could not be set up).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/_benchlib.py, from any directory
from _benchlib import GB, format_size, log, name_list, parse_size, tool_version  # noqa: E402

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
PYIO_SCRIPT = BENCH_DIR / "pyio_baseline.py"

SUBJECT = "tensortier"
TOOL_FAMILIES = ("tensortier", "fio", "python")
SCENARIOS = ("seq", "rand", "warm")
# fio huge-page buffer memory, in order of preference (our virtio disk splits a request at the
# physical-contiguity boundaries of its buffer: buffer memory decides request sizes here).
HUGE_IOMEM = ("mmaphuge", "shmhuge")
STDERR_TAIL = 2000  # characters of a failed tool's stderr kept in the report


# --------------------------------------------------------------------------- argument types


def int_list(text: str) -> list[int]:
    """argparse type: comma-separated positive integers."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"need positive integers: {text!r}")
    return values


def size_list(text: str) -> list[int]:
    """argparse type: comma-separated sizes, e.g. '4K,128K'."""
    return [parse_size(part) for part in text.split(",") if part.strip()]


# --------------------------------------------------------------------------- runners


@dataclass(frozen=True)
class IoShape:
    """What one run moves: file size, request size and requests in flight."""

    size: int
    block_size: int
    queue_depth: int


@dataclass
class Invocation:
    """One finished tool process: its command line, the JSON object it printed, its stderr."""

    command: str
    output: dict[str, Any]
    stderr: str


@dataclass
class Measurement:
    """The metrics of one timed run of a tool (one or more processes)."""

    values: dict[str, float]
    raw: list[dict[str, Any]] = field(default_factory=list)
    commands: list[str] = field(default_factory=list)

    def merge(self, other: Measurement, rename: Callable[[str], str] = str) -> None:
        """Add ``other``'s values (keys passed through ``rename``), raw objects and commands."""
        self.values.update({rename(k): v for k, v in other.values.items()})
        self.raw.extend(other.raw)
        self.commands.extend(other.commands)


class ToolError(Exception):
    """A tool could not run or did not report what it should; carries its command and stderr."""

    def __init__(
        self,
        reason: str,
        command: str = "",
        stderr: str = "",
        output: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.command = command
        self.stderr = stderr[-STDERR_TAIL:]
        self.output = output  # what a failed tool still printed as JSON, if anything

    def summary(self) -> str:
        """One line for a table: the reason and the first line of stderr."""
        first = next((line for line in self.stderr.splitlines() if line.strip()), "")
        return f"{self.reason}: {first.strip()}" if first else self.reason

    def describe(self) -> str:
        """Multi-line text for the console: reason, command, stderr."""
        lines = [self.reason]
        if self.command:
            lines.append(f"  command: {self.command}")
        if self.stderr.strip():
            lines.append("  stderr:\n    " + self.stderr.strip().replace("\n", "\n    "))
        return "\n".join(lines)


def parse_json_object(stdout: str) -> dict[str, Any]:
    """Return the JSON object in ``stdout``, skipping any text lines printed before it."""
    start = stdout.find("{")
    if start < 0:
        raise ValueError("no JSON object on stdout")
    obj = json.loads(stdout[start:])
    if not isinstance(obj, dict):
        raise ValueError("stdout JSON is not an object")
    return obj


def number(inv: Invocation, *keys: str) -> float:
    """The number at ``output[keys[0]][keys[1]]...``; ToolError if missing or not a number."""
    value: Any = inv.output
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ToolError(f"output has no number at {'.'.join(keys)}", inv.command, inv.stderr)
    return float(value)


def measure_keys(inv: Invocation, *keys: str) -> Measurement:
    """A Measurement of the top-level numbers ``keys``, keeping the whole output object."""
    return Measurement({k: number(inv, k) for k in keys}, [inv.output], [inv.command])


class Runner:
    """One tool (or tool configuration) under test.

    Subclasses build the command lines; ``_run_json`` runs them. Every operation returns a
    Measurement with the canonical keys ``write_gbps``, ``read_gbps`` or ``randread_iops``,
    or raises ToolError. Operations a tool does not take part in raise NotImplementedError.
    """

    family: str = ""

    def __init__(self, name: str, timeout: float) -> None:
        self.name = name
        self.timeout = timeout

    def _run_json(self, argv: list[str]) -> Invocation:
        """Run ``argv``; return its stdout JSON object or raise ToolError with its stderr."""
        command = shlex.join(argv)
        try:
            proc = subprocess.run(
                argv, capture_output=True, text=True, timeout=self.timeout, check=False
            )
        except FileNotFoundError:
            raise ToolError(f"{argv[0]}: command not found", command) from None
        except PermissionError as e:
            raise ToolError(f"{argv[0]}: {e.strerror}", command) from None
        except subprocess.TimeoutExpired as e:
            partial = e.stderr or b""
            stderr = partial.decode(errors="replace") if isinstance(partial, bytes) else partial
            raise ToolError(f"timed out after {self.timeout:.0f} s", command, stderr) from None
        output: dict[str, Any] | None = None
        parse_error = ""
        try:
            output = parse_json_object(proc.stdout)
        except ValueError as e:
            parse_error = str(e)
        if proc.returncode != 0:
            status = proc.returncode
            reason = f"killed by signal {-status}" if status < 0 else f"exit status {status}"
            raise ToolError(reason, command, proc.stderr, output)
        if output is None:
            raise ToolError(f"bad JSON output: {parse_error}", command, proc.stderr + proc.stdout)
        return Invocation(command, output, proc.stderr)

    def seq(self, path: Path, shape: IoShape) -> Measurement:
        """Write ``shape.size`` bytes sequentially to a new ``path``, then read them cold."""
        raise NotImplementedError

    def randread(self, path: Path, shape: IoShape, ops: int) -> Measurement:
        """Time ``ops`` random O_DIRECT reads of ``shape.block_size`` over the existing ``path``."""
        raise NotImplementedError

    def warm_read(self, path: Path, shape: IoShape) -> Measurement:
        """Make the existing ``path`` resident in the page cache, then time reading it."""
        raise NotImplementedError


class TensortierRunner(Runner):
    """The ``tensortier bench`` CLI."""

    family = "tensortier"

    def __init__(
        self, binary: Path | None, searched: str, threads: int, backend: str, timeout: float
    ) -> None:
        super().__init__("tensortier", timeout)
        self.binary = binary
        self.searched = searched
        self.threads = threads
        self.backend = backend

    def _bench(self, path: Path, shape: IoShape, mode: str, *extra: str) -> Invocation:
        if self.binary is None:
            raise ToolError(f"tensortier binary not found (looked for {self.searched})")
        # fmt: off
        argv = [
            str(self.binary), "bench",
            "--dir", str(path.parent), "--file", path.name,
            "--size", format_size(shape.size), "--block-size", format_size(shape.block_size),
            "--queue-depth", str(shape.queue_depth), "--threads", str(self.threads),
            "--backend", self.backend, "--mode", mode, "--json", *extra,
        ]
        # fmt: on
        return self._run_json(argv)

    def seq(self, path: Path, shape: IoShape) -> Measurement:
        return measure_keys(self._bench(path, shape, "both"), "write_gbps", "read_gbps")

    def randread(self, path: Path, shape: IoShape, ops: int) -> Measurement:
        inv = self._bench(path, shape, "randread", "--ops", str(ops), "--keep")
        return measure_keys(inv, "randread_iops")

    def warm_read(self, path: Path, shape: IoShape) -> Measurement:
        return measure_keys(self._bench(path, shape, "read", "--warm", "--keep"), "read_gbps")


def fio_job(output: dict[str, Any] | None) -> dict[str, Any] | None:
    """The first job object of fio's JSON output, or None."""
    jobs = output.get("jobs") if output else None
    if isinstance(jobs, list) and jobs and isinstance(jobs[0], dict):
        return jobs[0]
    return None


def fio_job_error(job: dict[str, Any] | None) -> str | None:
    """'fio job error 12 (Cannot allocate memory)' if the job failed, else None."""
    errno = job.get("error", 0) if job else 0
    if not errno:
        return None
    text = os.strerror(errno) if isinstance(errno, int) else str(errno)
    return f"fio job error {errno} ({text})"


class FioRunner(Runner):
    """fio, one job (numjobs=1, iodepth=QD), with a given I/O engine and buffer memory."""

    family = "fio"

    def __init__(
        self,
        name: str,
        binary: str,
        timeout: float,
        ioengine: str = "io_uring",
        iomem: str | None = None,
    ) -> None:
        super().__init__(name, timeout)
        self.binary = binary
        self.ioengine = ioengine
        self.iomem = iomem

    def _job(self, path: Path, shape: IoShape, rw: str, direct: bool, *extra: str) -> Invocation:
        """Run one fio job; return it with ``output`` narrowed to the job's JSON object."""
        iodepth = 1 if self.ioengine in ("psync", "sync", "pvsync") else shape.queue_depth
        # fmt: off
        argv = [
            self.binary, f"--name={self.name}-{rw}", f"--filename={path}", f"--rw={rw}",
            f"--size={shape.size}", f"--bs={shape.block_size}", f"--iodepth={iodepth}",
            "--numjobs=1", f"--ioengine={self.ioengine}", f"--direct={int(direct)}",
            "--output-format=json", *extra,
        ]
        # fmt: on
        if self.iomem:
            argv.append(f"--iomem={self.iomem}")
        try:
            inv = self._run_json(argv)
        except ToolError as e:
            job_error = fio_job_error(fio_job(e.output))
            if job_error:  # fio can crash after a job fails; the job's errno says why
                e.reason = f"{e.reason}, {job_error}"
            raise
        job = fio_job(inv.output)
        if job is None:
            raise ToolError("fio output has no jobs", inv.command, inv.stderr)
        job_error = fio_job_error(job)
        if job_error:
            raise ToolError(job_error, inv.command, inv.stderr)
        return Invocation(inv.command, job, inv.stderr)

    @staticmethod
    def _summary(inv: Invocation, direction: str) -> dict[str, Any]:
        """The few fio figures worth keeping in the results file."""
        stats = inv.output.get(direction, {})
        keep = ("io_bytes", "bw_bytes", "iops", "runtime", "total_ios")
        return {"job": inv.output.get("jobname"), **{k: stats.get(k) for k in keep}}

    def _measure(self, inv: Invocation, direction: str, key: str, stat: str) -> Measurement:
        """``stat`` (bw_bytes, reported in GB/s, or iops) of ``direction`` as metric ``key``."""
        value = number(inv, direction, stat)
        value = value / GB if stat == "bw_bytes" else value
        return Measurement({key: value}, [self._summary(inv, direction)], [inv.command])

    def check(self, path: Path, shape: IoShape) -> None:
        """Raise ToolError unless this configuration (buffer memory included) can run a write."""
        probe = IoShape(shape.block_size, shape.block_size, shape.queue_depth)
        try:
            self._job(path, probe, "write", True)
        finally:
            path.unlink(missing_ok=True)

    def seq(self, path: Path, shape: IoShape) -> Measurement:
        write = self._job(path, shape, "write", True, "--end_fsync=1")
        result = self._measure(write, "write", "write_gbps", "bw_bytes")
        read = self._job(path, shape, "read", True)
        result.merge(self._measure(read, "read", "read_gbps", "bw_bytes"))
        return result

    def randread(self, path: Path, shape: IoShape, ops: int) -> Measurement:
        # io_size = ops * bs with norandommap gives exactly `ops` reads, even past the file size.
        extra = ("--randrepeat=0", "--norandommap", f"--io_size={ops * shape.block_size}")
        inv = self._job(path, shape, "randread", True, *extra)
        return self._measure(inv, "read", "randread_iops", "iops")

    def warm_read(self, path: Path, shape: IoShape) -> Measurement:
        # invalidate=0: by default fio drops the file's pages before the job starts.
        self._job(path, shape, "read", False, "--invalidate=0")  # brings the file in, untimed
        inv = self._job(path, shape, "read", False, "--invalidate=0")
        return self._measure(inv, "read", "read_gbps", "bw_bytes")


class PythonRunner(Runner):
    """Plain Python file I/O, run as ``bench/pyio_baseline.py`` in a child interpreter."""

    family = "python"

    def __init__(self, timeout: float) -> None:
        super().__init__("python", timeout)

    def _pyio(self, path: Path, shape: IoShape, mode: str, *extra: str) -> Invocation:
        # fmt: off
        argv = [
            sys.executable, str(PYIO_SCRIPT), "--mode", mode, "--file", str(path),
            "--size", str(shape.size), "--block-size", str(shape.block_size), *extra,
        ]
        # fmt: on
        return self._run_json(argv)

    def write(self, path: Path, shape: IoShape) -> None:
        """Write a test file (fsynced, pages dropped); used to set up shared files, untimed."""
        self._pyio(path, shape, "write")

    def seq(self, path: Path, shape: IoShape) -> Measurement:
        return measure_keys(self._pyio(path, shape, "both"), "write_gbps", "read_gbps")

    def warm_read(self, path: Path, shape: IoShape) -> Measurement:
        return measure_keys(self._pyio(path, shape, "read", "--warm"), "read_gbps")


# --------------------------------------------------------------------------- scenarios


@dataclass(frozen=True)
class Metric:
    """One reported figure: its key in samples and JSON, its table label and unit."""

    key: str
    label: str
    unit: str  # "GB/s" or "IOPS"


@dataclass
class Contestant:
    """A runner in a scenario; ``target`` is the minimum ratio tensortier / this tool."""

    runner: Runner
    target: float | None = None
    skip_reason: str | None = None


@dataclass
class Scenario:
    """What to measure: the contestants, one timed run of a runner, setup and the files used."""

    name: str
    description: str
    params: dict[str, Any]
    metrics: list[Metric]
    contestants: list[Contestant]
    measure: Callable[[Runner], Measurement]
    files: list[Path]
    prepare: Callable[[], None] = lambda: None


@dataclass
class ToolOutcome:
    """Everything one contestant produced in a scenario."""

    name: str
    family: str
    target: float | None
    status: str = "ok"  # ok | failed | skipped
    error: str | None = None  # full text: reason, command, stderr
    summary: str | None = None  # one line of ``error`` for the table
    samples: dict[str, list[float]] = field(default_factory=dict)
    raw: list[dict[str, Any]] = field(default_factory=list)
    commands: list[str] = field(default_factory=list)

    def add(self, m: Measurement) -> None:
        """Record one timed run."""
        for key, value in m.values.items():
            self.samples.setdefault(key, []).append(value)
        self.raw.extend(m.raw)
        self.commands.extend(m.commands)

    def median(self, key: str) -> float | None:
        """Median of the samples of ``key``; None if there are none or the tool failed."""
        values = self.samples.get(key)
        return statistics.median(values) if values and self.status == "ok" else None


@dataclass
class Comparison:
    """tensortier's median against one baseline's median for one metric."""

    metric: str
    baseline: str
    ratio: float | None
    target: float | None

    @property
    def verdict(self) -> str:
        """pass / miss against the target, or '-' (no target) / 'n/a' (no ratio)."""
        if self.target is None:
            return "-"
        if self.ratio is None:
            return "n/a"
        return "pass" if self.ratio >= self.target else "miss"


@dataclass
class ScenarioResult:
    """A finished scenario: outcomes per tool, run orders, comparisons, setup error if any."""

    scenario: Scenario
    outcomes: dict[str, ToolOutcome]
    orders: list[list[str]]
    error: str | None = None

    def comparisons(self) -> list[Comparison]:
        """Ratios tensortier / baseline for every metric and baseline."""
        subject = self.outcomes.get(SUBJECT)
        result = []
        for metric in self.scenario.metrics:
            top = subject.median(metric.key) if subject else None
            for outcome in self.outcomes.values():
                if outcome.name == SUBJECT:
                    continue
                base = outcome.median(metric.key)
                ratio = top / base if top is not None and base else None
                result.append(Comparison(metric.key, outcome.name, ratio, outcome.target))
        return result

    def subject_failed(self) -> bool:
        """True if tensortier took part and failed, or the scenario could not be set up."""
        subject = self.outcomes.get(SUBJECT)
        return self.error is not None or (subject is not None and subject.status == "failed")


def remove_files(paths: Sequence[Path]) -> None:
    """Delete test files that exist."""
    for path in paths:
        path.unlink(missing_ok=True)


def rotated(items: Sequence[Contestant], repeat: int) -> list[Contestant]:
    """The run order of ``repeat``: start with item ``repeat mod n``, keep the cycle."""
    k = repeat % len(items) if items else 0
    return [*items[k:], *items[:k]]


def format_values(values: dict[str, float]) -> str:
    """'write_gbps=1.52 read_gbps=2.01' for progress lines."""
    return " ".join(f"{k}={v:.3f}" if v < 1000 else f"{k}={v:.0f}" for k, v in values.items())


def run_scenario(scenario: Scenario, repeats: int) -> ScenarioResult:
    """Run every contestant ``repeats`` times in rotated order; a failing tool stops alone."""
    outcomes = {
        c.runner.name: ToolOutcome(c.runner.name, c.runner.family, c.target)
        for c in scenario.contestants
    }
    for c in scenario.contestants:
        if c.skip_reason:
            outcome = outcomes[c.runner.name]
            outcome.status, outcome.error, outcome.summary = "skipped", c.skip_reason, c.skip_reason
    active = [c for c in scenario.contestants if not c.skip_reason]
    result = ScenarioResult(scenario, outcomes, [])
    try:
        log(f"[{scenario.name}] {scenario.description}")
        scenario.prepare()
        for repeat in range(repeats):
            order = rotated(active, repeat)
            result.orders.append([c.runner.name for c in order])
            for c in order:
                outcome = outcomes[c.runner.name]
                if outcome.status != "ok":
                    continue
                start = time.monotonic()
                try:
                    measurement = scenario.measure(c.runner)
                except ToolError as e:
                    outcome.status, outcome.summary = "failed", e.summary()
                    outcome.error = e.describe()
                    log(f"[{scenario.name}] {c.runner.name} FAILED: {e.describe()}")
                    continue
                outcome.add(measurement)
                took = time.monotonic() - start
                log(
                    f"[{scenario.name}] repeat {repeat + 1}/{repeats} {c.runner.name:<15}"
                    f"{format_values(measurement.values)}  ({took:.1f} s)"
                )
    except ToolError as e:
        result.error = f"setup failed: {e.describe()}"
        log(f"[{scenario.name}] {result.error}")
    finally:
        remove_files(scenario.files)
    return result


@dataclass
class Settings:
    """Resolved command-line settings."""

    directory: Path
    size: int
    block_size: int
    queue_depth: int
    threads: int
    backend: str
    repeats: int
    rand_block_sizes: list[int]
    rand_ops: list[int]
    rand_queue_depth: int
    scenarios: list[str]
    tools: list[str]
    tensortier: Path | None
    tensortier_searched: str
    fio: str
    timeout: float
    json_out: Path


def rand_metric_key(key: str, block_size: int) -> str:
    """Metric key of a random-read case: 'randread_iops' at 4K -> 'randread_iops_4K'."""
    return f"{key}_{format_size(block_size)}"


class ScenarioFactory:
    """Builds the scenarios from the settings and the selected tools."""

    def __init__(self, s: Settings) -> None:
        self.s = s
        self.tensortier = TensortierRunner(
            s.tensortier, s.tensortier_searched, s.threads, s.backend, s.timeout
        )
        self.python = PythonRunner(s.timeout)
        self.huge_iomem_errors: dict[str, str] = {}

    def _selected(self, contestants: list[Contestant]) -> list[Contestant]:
        return [c for c in contestants if c.runner.family in self.s.tools]

    def _fio(self, name: str, **kwargs: Any) -> FioRunner:
        return FioRunner(name, self.s.fio, self.s.timeout, **kwargs)

    def _seq_shape(self) -> IoShape:
        return IoShape(self.s.size, self.s.block_size, self.s.queue_depth)

    def _huge_page_fio(self) -> Contestant:
        """fio with huge-page buffers: the first of HUGE_IOMEM that runs, else a skipped entry."""
        probe_path = self.s.directory / "fio-iomem-probe.dat"
        failures: list[str] = []
        for iomem in HUGE_IOMEM:
            runner = self._fio(f"fio-{iomem}", iomem=iomem)
            try:
                runner.check(probe_path, self._seq_shape())
                return Contestant(runner, target=0.95)
            except ToolError as e:
                self.huge_iomem_errors[iomem] = e.describe()
                failures.append(f"--iomem={iomem}: {e.summary()}")
                log(f"[seq] fio --iomem={iomem} does not run: {e.summary()}")
        reason = "; ".join(failures) + " (no huge pages? see bench/README.md)"
        return Contestant(self._fio(f"fio-{HUGE_IOMEM[0]}"), skip_reason=reason)

    def seq(self) -> Scenario:
        """Sequential write then cold read, one file per tool, deleted around every run."""
        shape = self._seq_shape()
        contestants = [Contestant(self.tensortier), Contestant(self._fio("fio"), target=0.95)]
        if "fio" in self.s.tools:
            contestants.append(self._huge_page_fio())
        contestants = self._selected([*contestants, Contestant(self.python, target=2.5)])
        paths = {c.runner.name: self.s.directory / f"seq-{c.runner.name}.dat" for c in contestants}

        def measure(runner: Runner) -> Measurement:
            path = paths[runner.name]
            path.unlink(missing_ok=True)
            try:
                return runner.seq(path, shape)
            finally:
                path.unlink(missing_ok=True)

        return Scenario(
            "seq",
            f"sequential write then cold read, {format_size(shape.size)}, "
            f"bs {format_size(shape.block_size)}, qd {shape.queue_depth}",
            {"size": shape.size, "block_size": shape.block_size, "queue_depth": shape.queue_depth},
            [Metric("write_gbps", "write", "GB/s"), Metric("read_gbps", "cold read", "GB/s")],
            contestants,
            measure,
            list(paths.values()),
        )

    def rand(self) -> Scenario:
        """Random O_DIRECT reads per block size over one shared file written once, untimed."""
        path = self.s.directory / "rand.dat"
        qd = self.s.rand_queue_depth
        cases = list(zip(self.s.rand_block_sizes, self.s.rand_ops, strict=True))
        contestants = self._selected(
            [Contestant(self.tensortier), Contestant(self._fio("fio"), target=0.9)]
        )

        def measure(runner: Runner) -> Measurement:
            result = Measurement({})
            for bs, ops in cases:
                m = runner.randread(path, IoShape(self.s.size, bs, qd), ops)
                result.merge(m, rename=functools.partial(rand_metric_key, block_size=bs))
            return result

        return Scenario(
            "rand",
            f"random O_DIRECT reads over {format_size(self.s.size)}, qd {qd}, "
            + ", ".join(f"{ops} x {format_size(bs)}" for bs, ops in cases),
            {
                "size": self.s.size,
                "queue_depth": qd,
                "cases": [{"block_size": bs, "ops": ops} for bs, ops in cases],
            },
            [
                Metric(rand_metric_key("randread_iops", bs), f"{format_size(bs)} randread", "IOPS")
                for bs, _ in cases
            ],
            contestants,
            measure,
            [path],
            prepare=lambda: self.python.write(path, IoShape(self.s.size, self.s.block_size, qd)),
        )

    def warm(self) -> Scenario:
        """Page-cache reads of one shared file; each runner warms it itself before timing."""
        path = self.s.directory / "warm.dat"
        shape = self._seq_shape()
        contestants = self._selected(
            [
                Contestant(self.tensortier),
                Contestant(self._fio("fio-psync", ioengine="psync"), target=0.9),
                Contestant(self._fio("fio-uring", ioengine="io_uring"), target=0.9),
                # fio's default (malloc) buffers copy from the page cache ~5x slower here than
                # mmap'ed ones, so this is the baseline that shows the limit.
                Contestant(self._fio("fio-psync-mmap", ioengine="psync", iomem="mmap"), target=0.9),
                Contestant(self.python),
            ]
        )
        return Scenario(
            "warm",
            f"page-cache read, {format_size(shape.size)}, bs {format_size(shape.block_size)}, "
            f"qd {shape.queue_depth}",
            {"size": shape.size, "block_size": shape.block_size, "queue_depth": shape.queue_depth},
            [Metric("read_gbps", "warm read", "GB/s")],
            contestants,
            lambda runner: runner.warm_read(path, shape),
            [path],
            prepare=lambda: self.python.write(path, shape),
        )

    def build(self, name: str) -> Scenario:
        """The scenario called ``name``."""
        builders: dict[str, Callable[[], Scenario]] = {
            "seq": self.seq,
            "rand": self.rand,
            "warm": self.warm,
        }
        return builders[name]()


# --------------------------------------------------------------------------- report


def format_value(value: float, unit: str) -> str:
    """A figure in its unit: GB/s with 3 decimals, IOPS as a whole number."""
    return f"{value:,.0f}" if unit == "IOPS" else f"{value:.3f}"


def cell(text: str) -> str:
    """Text made safe for one Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_table(result: ScenarioResult, repeats: int) -> str:
    """The Markdown report of one scenario."""
    sc = result.scenario
    lines = [f"## {sc.name}: {sc.description}, {repeats} repeats", ""]
    if result.error:
        lines += [f"**{cell(result.error.splitlines()[0])}**", ""]
    lines += [
        f"| metric | tool | median | samples | {SUBJECT} / tool | target | result |",
        "|---|---|---:|---|---:|---:|---|",
    ]
    comparisons = {(c.metric, c.baseline): c for c in result.comparisons()}
    for metric in sc.metrics:
        for outcome in result.outcomes.values():
            head = f"| {metric.label} {metric.unit} | {outcome.name} |"
            if outcome.status != "ok":
                lines.append(f"{head} {outcome.status} | (see below) | | | |")
                continue
            samples = outcome.samples.get(metric.key, [])
            median = outcome.median(metric.key)
            cells = [
                format_value(median, metric.unit) if median is not None else "-",
                ", ".join(format_value(v, metric.unit) for v in samples),
            ]
            cmp = comparisons.get((metric.key, outcome.name))
            if cmp is None:
                cells += ["-", "-", "-"]
            else:
                cells += [
                    f"{cmp.ratio:.2f}x" if cmp.ratio is not None else "n/a",
                    f">= {cmp.target}x" if cmp.target is not None else "-",
                    cmp.verdict,
                ]
            lines.append(f"{head} {' | '.join(cells)} |")
    lines += [f"\nRun order per repeat: {' / '.join(', '.join(o) for o in result.orders)}"]
    lines += notes(result)
    return "\n".join(lines) + "\n"


def notes(result: ScenarioResult) -> list[str]:
    """Lines under the table: why tools failed or were skipped; tensortier without O_DIRECT."""
    lines = [
        f"- {o.name} {o.status}: {o.summary}" for o in result.outcomes.values() if o.status != "ok"
    ]
    subject = result.outcomes.get(SUBJECT)
    if subject is not None and result.scenario.name != "warm":
        buffered = sum(1 for raw in subject.raw if raw.get("direct") is False)
        if buffered:
            lines.append(f"- tensortier reported direct=false in {buffered} run(s) (no O_DIRECT)")
    return ["", *lines] if lines else []


def results_json(
    results: list[ScenarioResult], s: Settings, factory: ScenarioFactory
) -> dict[str, Any]:
    """Everything the run produced, for ``--json-out``."""

    def scenario_json(r: ScenarioResult) -> dict[str, Any]:
        return {
            "description": r.scenario.description,
            "params": r.scenario.params,
            "error": r.error,
            "run_order": r.orders,
            "tools": {
                name: {
                    "family": o.family,
                    "status": o.status,
                    "error": o.error,
                    "target_ratio": o.target,
                    "samples": o.samples,
                    "medians": {k: o.median(k) for k in o.samples},
                    "commands": o.commands,
                    "outputs": o.raw,
                }
                for name, o in r.outcomes.items()
            },
            "ratios": [
                {
                    "metric": c.metric,
                    "baseline": c.baseline,
                    "ratio": c.ratio,
                    "target": c.target,
                    "result": c.verdict,
                }
                for c in r.comparisons()
            ],
        }

    return {
        "command": shlex.join(["python", *sys.argv]),
        "python": sys.executable,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "kernel": platform.release(),
        "fio_version": tool_version([s.fio, "--version"]),
        "tensortier_binary": str(s.tensortier) if s.tensortier else None,
        "settings": {
            "dir": str(s.directory),
            "size": s.size,
            "block_size": s.block_size,
            "queue_depth": s.queue_depth,
            "threads": s.threads,
            "backend": s.backend,
            "repeats": s.repeats,
            "rand_block_sizes": s.rand_block_sizes,
            "rand_ops": s.rand_ops,
            "rand_queue_depth": s.rand_queue_depth,
            "scenarios": s.scenarios,
            "tools": s.tools,
        },
        "fio_huge_iomem_errors": factory.huge_iomem_errors,
        "scenarios": {r.scenario.name: scenario_json(r) for r in results},
    }


# --------------------------------------------------------------------------- command line

QUICK_SIZE = "256M"
DEFAULT_SIZE = "2G"
QUICK_RAND_OPS = [4000, 2000]
DEFAULT_RAND_OPS = [20000, 8000]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line; sizes accept K/M/G suffixes (powers of 1024)."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Sizes take K/M/G suffixes (powers of 1024). See bench/README.md.",
    )
    p.add_argument(
        "--tensortier", type=Path, help="CLI path (default: .venv/bin/tensortier, then PATH)"
    )
    p.add_argument("--fio", default="fio", help="fio binary (default: fio)")
    p.add_argument(
        "--dir", type=Path, default=REPO_ROOT / "tensortier-bench", help="test directory"
    )
    p.add_argument(
        "--size", type=parse_size, help=f"file size (default {DEFAULT_SIZE}, --quick {QUICK_SIZE})"
    )
    p.add_argument(
        "--block-size", type=parse_size, default=parse_size("1M"), help="seq/warm block size"
    )
    p.add_argument("--queue-depth", type=int, default=32, help="seq/warm queue depth (default 32)")
    p.add_argument("--threads", type=int, default=2, help="tensortier --threads (default 2)")
    p.add_argument("--backend", default="auto", help="tensortier --backend (default auto)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per tool (default 3)")
    p.add_argument("--rand-block-sizes", type=size_list, default=size_list("4K,128K"))
    p.add_argument("--rand-ops", type=int_list, help="ops per rand block size (default 20000,8000)")
    p.add_argument("--rand-queue-depth", type=int, default=64)
    p.add_argument(
        "--scenario", type=name_list(SCENARIOS, "choose from"), default=list(SCENARIOS)
    )
    p.add_argument(
        "--tools", type=name_list(TOOL_FAMILIES, "choose from"), default=list(TOOL_FAMILIES)
    )
    p.add_argument("--quick", action="store_true", help=f"smoke test: {QUICK_SIZE}, fewer ops")
    p.add_argument("--timeout", type=float, default=600, help="seconds per tool process")
    p.add_argument("--json-out", type=Path, default=BENCH_DIR / "results" / "engine_bench.json")
    args = p.parse_args(argv)
    for name in ("queue_depth", "threads", "repeats", "rand_queue_depth"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def find_tensortier(explicit: Path | None) -> tuple[Path | None, str]:
    """The tensortier CLI to run, and a description of where it was looked for."""
    if explicit is not None:
        return (explicit if explicit.is_file() else None), str(explicit)
    default = REPO_ROOT / ".venv" / "bin" / "tensortier"
    if default.is_file():
        return default, str(default)
    on_path = shutil.which("tensortier")
    return (Path(on_path) if on_path else None), f"{default} and PATH"


def resolve_settings(args: argparse.Namespace) -> Settings:
    """Apply --quick and the defaults that depend on it; check list lengths."""
    rand_ops = args.rand_ops or (QUICK_RAND_OPS if args.quick else DEFAULT_RAND_OPS)
    if len(rand_ops) != len(args.rand_block_sizes):
        raise SystemExit("error: --rand-ops needs one count per --rand-block-sizes entry")
    tensortier, searched = find_tensortier(args.tensortier)
    return Settings(
        directory=args.dir.resolve(),
        size=args.size or parse_size(QUICK_SIZE if args.quick else DEFAULT_SIZE),
        block_size=args.block_size,
        queue_depth=args.queue_depth,
        threads=args.threads,
        backend=args.backend,
        repeats=args.repeats,
        rand_block_sizes=args.rand_block_sizes,
        rand_ops=rand_ops,
        rand_queue_depth=args.rand_queue_depth,
        scenarios=[name for name in SCENARIOS if name in args.scenario],
        tools=args.tools,
        tensortier=tensortier.resolve() if tensortier else None,
        tensortier_searched=searched,
        fio=args.fio,
        timeout=args.timeout,
        json_out=args.json_out,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the selected scenarios, print the tables, write the JSON; see the module doc."""
    s = resolve_settings(parse_args(argv))
    created_dir = not s.directory.exists()
    s.directory.mkdir(parents=True, exist_ok=True)
    factory = ScenarioFactory(s)
    results: list[ScenarioResult] = []
    try:
        for name in s.scenarios:
            results.append(run_scenario(factory.build(name), s.repeats))
    except KeyboardInterrupt:
        log("interrupted; test files removed")
        return 130
    finally:
        if created_dir and not any(s.directory.iterdir()):
            s.directory.rmdir()
    for result in results:
        print(markdown_table(result, s.repeats))
    s.json_out.parent.mkdir(parents=True, exist_ok=True)
    s.json_out.write_text(json.dumps(results_json(results, s, factory), indent=2) + "\n")
    print(f"Results: {s.json_out}")
    if SUBJECT in s.tools and any(r.subject_failed() for r in results):
        log("tensortier failed: see the errors above")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
