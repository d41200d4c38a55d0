"""tensortier.dcp.Writer's write side: staging for dcp.async_save (host memory reused from save
to save, never while a save still reads it), errors naming the state dict's key, CUDA state
dicts (on a GPU only), and examples/dcp/train.py killed and resumed for real."""

from __future__ import annotations

import gc
import os
import re
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tensortier import _core
from tensortier import dcp as tdcp

ROOT = Path(__file__).resolve().parents[2]


def state(version: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(version)
    return {
        "w": torch.randn(3000, generator=g),  # a page and more: 4 KiB aligned in the arena
        "b": torch.arange(5, dtype=torch.int16) + version,
        "t": torch.randn(4, 6, generator=g, dtype=torch.float64).t(),  # not contiguous
        "empty": torch.empty(0, 2),
        "nested": {"m": torch.full((7,), float(version)), "lr": 0.1 * version,
                   "ids": [1, 2, version]},
        "step": version,
    }


def load(ckpt: Path) -> dict[str, Any]:
    got = {"w": torch.zeros(3000), "b": torch.zeros(5, dtype=torch.int16),
           "t": torch.zeros(6, 4, dtype=torch.float64), "empty": torch.zeros(0, 2),
           "nested": {"m": torch.zeros(7), "lr": 0.0, "ids": []}, "step": 0}
    dcp.load(got, storage_reader=dcp.FileSystemReader(ckpt), no_dist=True)
    return got


def assert_state(got: dict[str, Any], version: int) -> None:
    want = state(version)
    for k in ("w", "b", "t", "empty"):
        assert torch.equal(got[k], want[k]), k
    assert torch.equal(got["nested"]["m"], want["nested"]["m"])
    assert got["nested"]["lr"] == want["nested"]["lr"] and got["step"] == version
    assert list(got["nested"]["ids"]) == want["nested"]["ids"]


def test_stage_copies_into_reused_host_memory() -> None:
    gc.collect()
    sd = state(1)
    staged = tdcp._staging._stage(sd)
    sd["w"].add_(1)  # training goes on: the staged copy keeps the values at stage time
    sd["nested"]["m"].zero_()
    sd["nested"]["ids"].append(9)
    assert_state(staged, 1)
    # (no tensor in an assert statement: pytest's rewriting would keep it, and its memory, alive)
    contiguous, aligned = staged["t"].is_contiguous(), staged["w"].data_ptr() % 4096 == 0
    assert contiguous and aligned
    first = _core.staging_arena_count()
    again = tdcp._staging._stage(state(2))  # the first copy is alive: new memory
    assert _core.staging_arena_count() == first + 1
    assert_state(staged, 1)
    assert_state(again, 2)
    used = {staged["w"].data_ptr(), again["w"].data_ptr()}
    del staged, again
    third = tdcp._staging._stage(state(3))  # both free: one of them is reused
    assert third["w"].data_ptr() in used
    assert _core.staging_arena_count() == first + 1
    assert_state(third, 3)


def test_a_save_on_another_thread_keeps_the_gc_state_the_main_thread_sets(tmp_path: Path) -> None:
    """Collection is paused from the main thread only: a save running on another thread (as
    async_save's write does) must not turn collection back on after the training loop turned
    it off meanwhile, nor off while it runs."""
    from tensortier._runtime import gc_paused

    entered, leave = threading.Event(), threading.Event()

    def background() -> None:
        with gc_paused():
            entered.set()
            leave.wait(30)
        dcp.save({"w": torch.ones(8)}, storage_writer=tdcp.Writer(tmp_path / "bg"), no_dist=True)

    assert gc.isenabled()
    t = threading.Thread(target=background)
    t.start()
    try:
        assert entered.wait(30)
        assert gc.isenabled()  # not paused from the other thread
        gc.disable()  # the training loop manages collection itself
        leave.set()
        t.join(60)
        assert not t.is_alive()
        assert not gc.isenabled()  # the save left the loop's choice alone
    finally:
        leave.set()
        gc.enable()
    with gc_paused():  # on the main thread: paused within, as it was after
        assert not gc.isenabled()
    assert gc.isenabled()


def test_memory_a_save_wrote_goes_to_the_next_stage(tmp_path: Path) -> None:
    """Once a save has written its file, the next stage reuses its memory (pages faulted in),
    though the caller still holds a view of the first copy: that view then shows the new
    values. The checkpoint keeps the values staged for it."""
    gc.collect()
    big = 1 << 20  # larger than any earlier test's arena: only this test's fits
    writer = tdcp.Writer(tmp_path / "a")
    staged = writer.stage({"w": torch.full((big,), 1.0), "step": 1})
    first = staged["w"].data_ptr()
    kept = staged["w"][:4]
    dcp.save(staged, storage_writer=writer, no_dist=True)
    assert gc.isenabled()  # paused only while the Writer builds its many small objects
    count = _core.staging_arena_count()
    again = writer.stage({"w": torch.full((big,), 2.0), "step": 2})
    same = again["w"].data_ptr() == first
    assert same and _core.staging_arena_count() == count
    assert kept.tolist() == [2.0] * 4
    got = {"w": torch.zeros(big), "step": 0}
    dcp.load(got, storage_reader=dcp.FileSystemReader(tmp_path / "a"), no_dist=True)
    ones = bool((got["w"] == 1.0).all())
    assert ones and got["step"] == 1
    del staged, again, kept


def test_async_save_while_another_still_writes(tmp_path: Path) -> None:
    """A second async_save starts while the first's write is held: each checkpoint holds the
    values of its own stage, and the training loop's state changed in between."""
    go = threading.Event()

    class HeldWriter(tdcp.Writer):
        def write_data(self, plan: Any, planner: Any) -> Any:
            assert go.wait(60)
            return super().write_data(plan, planner)

    sd = state(1)
    first = dcp.async_save(sd, storage_writer=HeldWriter(tmp_path / "a"), no_dist=True)
    for k, v in state(2).items():  # a training step: in place, as an optimizer does
        if isinstance(v, torch.Tensor):
            sd[k].copy_(v)
    sd["nested"] = state(2)["nested"]
    sd["step"] = 2
    second = dcp.async_save(sd, storage_writer=tdcp.Writer(tmp_path / "b"), no_dist=True)
    second.result(timeout=60)
    assert not first.done()
    go.set()
    first.result(timeout=60)
    assert_state(load(tmp_path / "a"), 1)
    assert_state(load(tmp_path / "b"), 2)
    got = load(tmp_path / "b")
    dcp.load(got, storage_reader=tdcp.Reader(tmp_path / "b"), no_dist=True)
    assert_state(got, 2)


def _held_stage(monkeypatch: pytest.MonkeyPatch, copy: Any) -> None:
    """Writer.stage's copy step replaced by copy(the real one), on the thread it runs on."""
    begin = tdcp._writer._stage_begin

    def held(sd: Any) -> Any:
        finish = begin(sd)
        return lambda: copy(finish)

    monkeypatch.setattr(tdcp._writer, "_stage_begin", held)


def test_async_staging_returns_before_the_copy(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Writer(async_staging=True): async_save returns (an AsyncSaveResponse) while the copy is
    held on another thread; non-tensor values are those of the call, tensors those once the
    staging completes, and the state may change after that."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

    release, copying = threading.Event(), threading.Event()
    threads: list[str] = []

    def copy(finish: Any) -> Any:
        threads.append(threading.current_thread().name)
        copying.set()
        assert release.wait(60)
        return finish()

    _held_stage(monkeypatch, copy)
    sd = state(1)
    writer = tdcp.Writer(tmp_path / "a", async_staging=True)
    response = dcp.async_save(sd, storage_writer=writer, no_dist=True)
    try:
        assert isinstance(response, AsyncSaveResponse)
        assert copying.wait(60)
        assert not response.staging_completion.done()
        assert not response.upload_completion.done()
        sd["nested"]["ids"].append(9)  # taken at the call
        sd["step"] = 5
    finally:
        release.set()
    response.staging_completion.result(timeout=60)
    writer.synchronize_staging()
    sd["w"].add_(1)  # an optimizer step, once staged
    sd["nested"]["m"].zero_()
    response.upload_completion.result(timeout=60)
    assert threads == ["tensortier-dcp-stage"]
    assert_state(load(tmp_path / "a"), 1)
    got = load(tmp_path / "a")
    dcp.load(got, storage_reader=tdcp.Reader(tmp_path / "a"), no_dist=True)
    assert_state(got, 1)


def test_async_staging_copy_that_fails_fails_the_save(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy's error reaches staging_completion and the save's future; the checkpoint in
    the directory stays whole."""
    ckpt = tmp_path / "ckpt"
    dcp.save(state(1), storage_writer=tdcp.Writer(ckpt), no_dist=True)
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}

    returned = threading.Event()

    def copy(finish: Any) -> None:
        # After async_save has returned: torch reports a staging future that failed before
        # then as completed.
        assert returned.wait(60)
        raise OSError(5, "staging copy failed")

    _held_stage(monkeypatch, copy)
    response = dcp.async_save(state(2), storage_writer=tdcp.Writer(ckpt, async_staging=True),
                              no_dist=True)
    returned.set()
    with pytest.raises(OSError, match="staging copy failed"):
        response.staging_completion.result(timeout=60)
    with pytest.raises((OSError, CheckpointException), match="staging copy failed"):
        response.upload_completion.result(timeout=60)
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
    assert_state(load(ckpt), 1)


def test_values_that_cannot_be_saved_name_their_key(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    dcp.save(state(1), storage_writer=tdcp.Writer(ckpt), no_dist=True)
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    with open(tmp_path / "f", "w") as f:
        bad = [
            ({"model": {"q": torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)}},
             r"model\.q: tensors of torch\.qint8 cannot be saved"),
            ({"w": torch.ones(2), "opt": {"fn": lambda x: x}},
             r"opt\.fn: cannot be saved: pickling it failed"),
            ({"w": torch.ones(2), "log": f}, r"log: cannot be saved: pickling it failed"),
        ]
        written: list[bool] = []

        class Watched(tdcp.Writer):
            def write_data(self, *args: Any, **kwargs: Any) -> Any:
                written.append(True)
                return super().write_data(*args, **kwargs)

        for sd, message in bad:
            written.clear()
            with pytest.raises(CheckpointException, match=message):
                dcp.save(sd, storage_writer=Watched(ckpt), no_dist=True)
            # A tensor no file stores is refused in DCP's planning step: with more ranks, no
            # rank writes (a value that does not pickle is found by its rank as it writes).
            assert written == ([] if "tensors of" in message else [True]), message
    # The old checkpoint is whole; nothing of the failed saves is left.
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
    assert_state(load(ckpt), 1)


@pytest.mark.gpu
def test_tensors_not_writable_in_place_are_copied_a_budget_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plain dcp.save copies views that are not contiguous (and, on a GPU, device tensors)
    to host memory as the write reaches them: at most about the staging budget of copies
    alive at once, not the state dict; a copy that fails fails the save, leaving the old
    checkpoint."""
    from tensortier.checkpoint import _format

    budget = 1 << 20
    monkeypatch.setattr(_format, "_STAGING_BYTES", budget)
    alive, peak, copies = [0], [0], [0]
    real = tdcp._writer._host_copies

    def counted(tensors: list[Any]) -> list[Any]:
        out = real(tensors)
        for t in out:
            copies[0] += 1
            alive[0] += t.nbytes
            weakref.finalize(t, lambda n=t.nbytes: alive.__setitem__(0, alive[0] - n))
        peak[0] = max(peak[0], alive[0])
        return out

    monkeypatch.setattr(tdcp._writer, "_host_copies", counted)
    views = {f"v{i}": torch.randn(256, 512).t() for i in range(8)}  # 512 KiB each
    sd = {**state(1), **views}
    ckpt = tmp_path / "ckpt"
    dcp.save(sd, storage_writer=tdcp.Writer(ckpt), no_dist=True)
    assert copies[0] == 9  # the 8 views and state()'s "t"
    assert peak[0] <= budget + (512 << 10), peak[0]
    got = {k: torch.zeros_like(v) for k, v in views.items()}
    dcp.load(got, storage_reader=dcp.FileSystemReader(ckpt), no_dist=True)  # torch's reader
    for k, v in views.items():
        assert torch.equal(got[k], v), k
    assert_state(load(ckpt), 1)

    def failing(tensors: list[Any]) -> list[Any]:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(tdcp._writer, "_host_copies", failing)
    with pytest.raises(CheckpointException, match="illegal memory access"):
        dcp.save({**state(2), **views}, storage_writer=tdcp.Writer(ckpt), no_dist=True)
    assert_state(load(ckpt), 1)
    assert not [p.name for p in ckpt.iterdir() if ".tmp-" in p.name]  # no temporary file


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_state_dict_saves_and_async_saves(tmp_path: Path) -> None:
    sd = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in state(1).items()}
    dcp.save(sd, storage_writer=tdcp.Writer(tmp_path / "sync"), no_dist=True)
    assert_state(load(tmp_path / "sync"), 1)
    fut = dcp.async_save(sd, storage_writer=tdcp.Writer(tmp_path / "async"), no_dist=True)
    sd["w"].add_(1)  # after staging: the checkpoint keeps the staged values
    fut.result(timeout=120)
    assert_state(load(tmp_path / "async"), 1)
    sd["w"].sub_(1)
    response = dcp.async_save(sd, storage_writer=tdcp.Writer(tmp_path / "zoc", async_staging=True),
                              no_dist=True)
    response.staging_completion.result(timeout=120)  # the device copies are done
    sd["w"].add_(1)
    response.upload_completion.result(timeout=120)
    assert_state(load(tmp_path / "zoc"), 1)
    staged = tdcp._staging._stage(sd)
    assert staged["w"].is_pinned()


def run_example(ckpt: Path, *extra: str, until: str | None = None,
                timeout: float = 60) -> str:
    """Runs examples/dcp/train.py (2 ranks spawned) in a process group of its own; with
    `until`, kills the whole group (SIGKILL) once a line matches it. Returns the output."""
    cmd = [sys.executable, str(ROOT / "examples" / "dcp" / "train.py"), str(ckpt), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []
    killer = threading.Timer(timeout, os.killpg, (proc.pid, signal.SIGKILL))
    killer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if until and re.search(until, line):
                os.killpg(proc.pid, signal.SIGKILL)
                break
        proc.wait(timeout=timeout)
    finally:
        killer.cancel()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    out = "".join(lines)
    if until is None:
        assert proc.returncode == 0, out[-3000:]
    return out


def test_example_is_killed_and_resumes_with_identical_state(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    # Killed (the whole job, SIGKILL) once rank 0 has seen checkpoint 4 committed, while the
    # save of step 6 may be under way.
    first = run_example(ckpt, "--steps", "40", "--every", "2", "--step-seconds", "0.05",
                        until=r"rank 0 committed step 4 ")
    saved = {(r, s): d for r, s, d in
             re.findall(r"rank (\d) committed step (\d+) digest ([0-9a-f]{16})", first)}
    assert ("0", "4") in saved, first[-3000:]
    second = run_example(ckpt, "--steps", "6", "--every", "2")
    resumed = re.findall(r"rank (\d) resumed step (\d+) digest ([0-9a-f]{16})", second)
    assert len(resumed) == 2, second[-3000:]
    for rank, step, digest in resumed:
        assert int(step) >= 4
        if (rank, step) in saved:
            assert digest == saved[(rank, step)], second[-3000:]
    # A step whose commit rank 0 printed: both ranks resumed the same step.
    assert resumed[0][1] == resumed[1][1]
    assert any((r, s) in saved for r, s, _ in resumed)
