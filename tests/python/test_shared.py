"""Shared tensors across real processes: started as torchrun starts them, by
torch.multiprocessing.spawn, and as plain processes that a test kills. Each rank runs a scenario
of shared_worker.py and reports in a JSON file; the test checks every rank's report and that
nothing the processes made was left behind (in /dev/shm by name, in their private TMPDIR, their
abstract sockets): what other programs on the machine make there is not looked at."""

from __future__ import annotations

import datetime
import errno
import gc
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import ranks
import tensortier
import tensortier.shared as shared
from conftest import exits_cleanly
from faults import shrinking_after_size
from ranks import free_port
from tensortier import _core

WORKER = Path(__file__).with_name("shared_worker.py")
TIMEOUT = 120  # seconds a whole multi-process run may take on a loaded machine


def abstract_sockets() -> set[str]:
    with open("/proc/net/unix") as f:
        return {line.split()[-1] for line in f.readlines()[1:] if line.split()[-1].startswith("@tensortier.")}


def shm_entries(pids: list[int] | None = None) -> set[str]:
    """The entries of /dev/shm our processes may have made: tensortier's name prefix, and torch's
    shared-memory files of processes `pids` (torch_<pid>_...). Other programs' entries (another
    job's buffers, Python's multiprocessing semaphores) are none of ours."""
    names = os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []
    prefixes = ("tensortier",) + tuple(f"torch_{pid}_" for pid in pids or [])
    return {n for n in names if n.startswith(prefixes)}


def reports(outdir: Path, world: int) -> list[dict[str, Any]]:
    out = []
    for r in range(world):
        path = outdir / f"rank{r}.json"
        out.append(json.loads(path.read_text()) if path.exists() else {"ok": False, "error": "no report"})
    return out


def env_for(tmp: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    private_tmp = tmp / "private_tmp"
    private_tmp.mkdir(exist_ok=True)
    env["TMPDIR"] = str(private_tmp)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(WORKER.parent), env.get("PYTHONPATH", "")]))
    env.update(extra)
    return env


def assert_nothing_left(tmp: Path, shm_before: set[str], sockets: list[str],
                        pids: list[int] | None = None) -> None:
    """Nothing that our processes (`pids`) made is left: in /dev/shm by name, in their private
    TMPDIR, or among abstract sockets (theirs by name)."""
    assert shm_entries(pids) - shm_before == set()
    # torchrun's agent keeps its own log folder (torchelastic_*) there: not ours.
    left_files = [p.name for p in (tmp / "private_tmp").iterdir() if not p.name.startswith("torchelastic_")]
    assert left_files == []
    left = abstract_sockets()
    for name in sockets:
        assert "@" + name not in left


def check_reports(tmp: Path, outdir: Path, world: int, shm_before: set[str],
                  output: str) -> list[dict[str, Any]]:
    """Every rank's report says it passed, and nothing its process made is left."""
    results = reports(outdir, world)
    for r, res in enumerate(results):
        assert res["ok"], f"rank {r}: {res.get('error')}\n{output}"
    assert_nothing_left(tmp, shm_before, [res["socket"] for res in results if "socket" in res],
                        [res["pid"] for res in results if "pid" in res])
    return results


def run_torchrun(tmp: Path, scenario: str, world: int, **extra: str) -> list[dict[str, Any]]:
    outdir = tmp / "out"
    outdir.mkdir()
    shm_before = shm_entries()
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={world}", str(WORKER), scenario, str(outdir),
    ]
    proc = subprocess.run(cmd, env=env_for(tmp, **extra), capture_output=True, text=True, timeout=TIMEOUT)
    results = check_reports(tmp, outdir, world, shm_before,
                            f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return results


@pytest.fixture(scope="module")
def forked() -> Iterator[ranks.ForkServer]:
    """A fork server that has imported shared_worker (and torch): a job's ranks start in well
    under a second, where torchrun starts an interpreter per rank and one for its agent."""
    with ranks.ForkServer("shared_worker") as server:
        yield server


def run_ranks(tmp: Path, scenario: str, world: int, launcher: str,
              forked: ranks.ForkServer, **extra: str) -> list[dict[str, Any]]:
    """Runs `scenario` in `world` ranks, started by torchrun (``launcher="torchrun"``: one such
    run per scenario checks the real launcher) or forked from `forked` (rank 0 then serves the
    store, as in a job started without torchrun's agent)."""
    if launcher == "torchrun":
        return run_torchrun(tmp, scenario, world, **extra)
    outdir = tmp / "out"
    shm_before = shm_entries()
    done = forked.run(outdir, world, [scenario, str(outdir)], TIMEOUT,
                      **env_for(tmp, **extra))
    logs = "\n".join((outdir / f"rank{r}.log").read_text(errors="replace")[-2000:]
                     for r in range(world) if (outdir / f"rank{r}.log").exists())
    results = check_reports(tmp, outdir, world, shm_before, logs)
    assert done == {"returncodes": [0] * world, "timed_out": False}, f"{done}\n{logs}"
    return results


@pytest.mark.parametrize("world,launcher", [(2, "fork"), (3, "torchrun"), (4, "fork")])
def test_every_layout_and_dtype_under_torchrun(tmp_path: Path, world: int, launcher: str,
                                               forked: ranks.ForkServer) -> None:
    run_ranks(tmp_path, "layouts", world, launcher, forked)


def test_misuse_attach_other_user_and_close_under_torchrun(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to start a process as another user")
    run_torchrun(tmp_path, "errors", 3)


def test_load_and_store_files_and_checkpoints_under_torchrun(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    run_torchrun(tmp_path, "files", 3, SHARED_TEST_DIR=str(data))


@pytest.mark.parametrize("world,launcher", [(2, "fork"), (3, "torchrun")])
def test_load_checkpoint_from_torch_save_files_under_torchrun(
        tmp_path: Path, world: int, launcher: str, forked: ranks.ForkServer) -> None:
    data = tmp_path / "data"
    data.mkdir()
    run_ranks(tmp_path, "torch_checkpoints", world, launcher, forked, SHARED_TEST_DIR=str(data))


@pytest.mark.parametrize("world,launcher", [(2, "fork"), (3, "torchrun")])
def test_distributed_layout_over_gloo_under_torchrun(
        tmp_path: Path, world: int, launcher: str, forked: ranks.ForkServer) -> None:
    run_ranks(tmp_path, "distributed", world, launcher, forked)


@pytest.mark.parametrize("world,launcher", [(2, "fork"), (3, "torchrun")])
def test_wholememory_seed_calls_under_torchrun(
        tmp_path: Path, world: int, launcher: str, forked: ranks.ForkServer) -> None:
    run_ranks(tmp_path, "seed", world, launcher, forked)


def assert_spawned_ranks_pass(ctx: Any, outdir: Path, world: int) -> None:
    """Waits for torch.multiprocessing.spawn's processes (killed past TIMEOUT), then asserts
    each rank's report says it passed."""
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=TIMEOUT)
    while not ctx.join(timeout=1):
        if datetime.datetime.now() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("spawned ranks did not finish in time")
    for r, res in enumerate(reports(outdir, world)):
        assert res["ok"], f"rank {r}: {res.get('error')}"


def test_every_layout_under_multiprocessing_spawn(tmp_path: Path) -> None:
    import shared_worker  # noqa: F401  (the spawned processes import it by name)

    world = 2
    port = free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, world + 1, is_master=True,
                                       timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    outdir = tmp_path / "out"
    outdir.mkdir()
    import torch.multiprocessing as mp

    ctx = mp.spawn(shared_worker.spawn_entry, args=("layouts", str(outdir), world, port),
                   nprocs=world, join=False)
    assert_spawned_ranks_pass(ctx, outdir, world)
    del store


def test_rank_zero_serving_a_store_it_was_given_outlives_the_last_barrier(tmp_path: Path) -> None:
    """Rank 0 serves the TCPStore its group was given (as under mp.spawn with
    init_process_group) and leaves the job's last barrier first: it waits at exit until the
    others have left, so that a rank still reading the barrier's keys keeps the store."""
    import shared_worker  # noqa: F401  (the spawned processes import it by name)
    import torch.multiprocessing as mp

    world = 2
    outdir = tmp_path / "out"
    outdir.mkdir()
    ctx = mp.spawn(shared_worker.spawn_hosting_entry, args=(str(outdir), world, free_port()),
                   nprocs=world, join=False)
    assert_spawned_ranks_pass(ctx, outdir, world)


@pytest.mark.parametrize("world", [2, 4])
def test_killed_rank_every_survivor_raises_and_nothing_is_left(tmp_path: Path, world: int) -> None:
    """The last rank kills itself (SIGKILL) after the first tensor; the next collective raises
    TimeoutError on every survivor within the group's timeout."""
    outdir = tmp_path / "out"
    outdir.mkdir()
    shm_before = shm_entries()
    port = free_port()
    # The test serves the store, as torchrun's agent does: a survivor that finishes first
    # must not take the store away from the others.
    store = torch.distributed.TCPStore("127.0.0.1", port, world + 1, is_master=True,
                                       timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    procs = start_ranks(tmp_path, "killed", world, port, outdir, SHARED_TEST_TIMEOUT="4",
                        TORCHELASTIC_USE_AGENT_STORE="True")
    outputs = finish(procs)
    del store
    assert procs[-1].returncode == -signal.SIGKILL
    results = reports(outdir, world)
    for r in range(world - 1):
        assert results[r]["ok"], f"rank {r}: {results[r].get('error')}\n{outputs[r][-2000:]}"
        assert results[r]["waited"] < 30
    assert_nothing_left(tmp_path, shm_before, [res["socket"] for res in results[:-1]],
                        [p.pid for p in procs])


def start_ranks(tmp: Path, scenario: str, world: int, port: int, outdir: Path,
                **extra: str) -> list[subprocess.Popen[bytes]]:
    return ranks.start_ranks([str(WORKER), scenario, str(outdir)], world, port, env_for(tmp),
                             **extra)


def finish(procs: list[subprocess.Popen[bytes]]) -> list[str]:
    """Each process's output once it exits (all killed after TIMEOUT seconds, even on failure)."""
    return ranks.finish(procs, TIMEOUT)


@pytest.mark.parametrize("world,victim", [(3, 0), (3, 2), (2, 1)])
def test_rank_zero_serving_the_store_survivors_raise_within_the_timeout(
    tmp_path: Path, world: int, victim: int
) -> None:
    """Rank 0 serves the TCPStore itself (no torchrun agent). When rank 0 is killed the store
    goes with it: every survivor raises ConnectionError naming rank 0 at once. When another
    rank is killed, every survivor (rank 0 included) raises TimeoutError naming it, and rank 0
    keeps the store until the others are done."""
    outdir = tmp_path / "out"
    outdir.mkdir()
    shm_before = shm_entries()
    timeout = 4
    procs = start_ranks(tmp_path, "store_host", world, free_port(), outdir,
                        SHARED_TEST_TIMEOUT=str(timeout), SHARED_TEST_VICTIM=str(victim))
    outputs = finish(procs)
    assert procs[victim].returncode == -signal.SIGKILL
    results = reports(outdir, world)
    for r in range(world):
        if r == victim:
            continue
        res = results[r]
        assert res["ok"], f"rank {r}: {res.get('error')}\n{outputs[r][-2000:]}"
        assert res["waited"] < timeout + 20
        assert procs[r].returncode == 0, outputs[r][-2000:]
        if victim == 0:
            assert res["error_type"] == "ConnectionResetError", res
            assert "store the processes meet through is gone: rank 0" in res["message"], res
            assert "Exception raised from" not in res["message"], res  # no C++ backtrace
        else:
            assert res["error_type"] == "TimeoutError", res
            assert f"rank {victim} of {world} did not arrive" in res["message"], res
    assert_nothing_left(tmp_path, shm_before, [res["socket"] for res in results if "socket" in res],
                        [p.pid for p in procs])


def test_attach_from_a_process_outside_the_group(tmp_path: Path) -> None:
    """A process started after the group (same MASTER_ADDR/MASTER_PORT, no rank of its own)
    attaches by name: it reads the owners' rows, its writes are seen by them, its mapping
    stays valid after they exit; another user's process is refused."""
    outdir = tmp_path / "out"
    outdir.mkdir()
    shm_before = shm_entries()
    port = free_port()
    world = 3
    store = torch.distributed.TCPStore("127.0.0.1", port, None, is_master=True,
                                       timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    test_keys = torch.distributed.PrefixStore("tensortier/attempt_0", store)
    owners = start_ranks(tmp_path, "owners", world, port, outdir, TORCHELASTIC_USE_AGENT_STORE="True")
    attacher: list[subprocess.Popen[bytes]] = []
    try:
        test_keys.wait(["test/ready"], datetime.timedelta(seconds=TIMEOUT))
        env = env_for(tmp_path, RANK=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        attacher.append(subprocess.Popen([sys.executable, str(WORKER), "attacher", str(outdir)],
                                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        owner_out = finish(owners)
        test_keys.set("test/owners_exited", b"")
        attacher_out = finish(attacher)
    finally:
        for p in owners + attacher:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = reports(outdir, world + 1)
    for r in range(world):
        assert results[r]["ok"], f"owner {r}: {results[r].get('error')}\n{owner_out[r][-2000:]}"
    assert results[world]["ok"], f"attacher: {results[world].get('error')}\n{attacher_out[0][-2000:]}"
    del test_keys, store
    assert_nothing_left(tmp_path, shm_before, [res["socket"] for res in results[:world]],
                        [p.pid for p in owners + attacher])


def test_group_without_a_rendezvous_says_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="rank"):
        shared.Group()
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        shared.Group(rank=0, world_size=2)  # a group of one needs no store: one of two does
    with pytest.raises(ValueError, match="not in a group"):
        shared.Group(rank=2, world_size=2)
    with pytest.raises(TypeError, match="torch.distributed.Store"):
        shared.Group(rank=0, world_size=1, store=object())
    with pytest.raises(ValueError, match="timeout"):
        shared.Group(rank=0, world_size=1, timeout=0)


def test_one_process_group_with_a_hash_store() -> None:
    store = torch.distributed.HashStore()
    with shared.Group(rank=0, world_size=1, store=store, timeout=5) as group:
        t = group.create_tensor((5, 2), torch.float64, layout="chunked", name="t")
        t.scatter([4, 0], torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64))
        assert torch.equal(t.gather([0, 4]), torch.tensor([[3.0, 4.0], [1.0, 2.0]], dtype=torch.float64))
        assert t.stats["local_bytes"] == 80
        assert t.stats["huge_pages"] is False and t.stats["huge_pages_reason"]
        assert t.stats["shmem_huge_pages"] is False
        assert "MiB per rank" in t.stats["shmem_huge_pages_reason"]
        with pytest.raises(ValueError, match="layout"):
            group.create_tensor((1,), torch.float32, layout="striped")
        for not_a_name in (None, b"chunked"):
            with pytest.raises(ValueError, match=f"layout must be .*, not {re.escape(repr(not_a_name))}$"):
                group.create_tensor((1,), torch.float32, layout=not_a_name)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="init_process_group"):
            group.create_tensor((1,), torch.float32, layout="distributed")
        with pytest.raises(ValueError, match="at least one dimension"):
            group.create_tensor((), torch.float32)
        with pytest.raises(ValueError, match="negative"):
            group.create_tensor((-1, 2), torch.float32)
        with pytest.raises(TypeError, match="dtype"):
            group.create_tensor((1,), "float32")  # type: ignore[arg-type]
        with pytest.raises(RuntimeError, match="no CUDA driver was found"):
            group.create_tensor((1,), torch.float32, device="cuda")
        with pytest.raises(TimeoutError):
            shared.Group(rank=0, world_size=1, store=store, timeout=5).attach("nope")
    with pytest.raises(RuntimeError, match="closed"):
        t.gather([0])


def test_collective_calls_leave_the_store_no_bigger() -> None:
    """Each call's entries are removed once every rank has made the next call: a loop of
    barriers (a training loop's) does not grow the store; a store that cannot remove keys
    only keeps them."""
    store = torch.distributed.HashStore()
    with shared.Group(rank=0, world_size=1, store=store, timeout=5) as group:
        group.barrier()
        before = store.num_keys()
        for _ in range(200):
            group.barrier()
        assert store.num_keys() <= before + 1, (before, store.num_keys())

    class NoDelete(torch.distributed.Store):  # a store of the user's, without delete_key
        def __init__(self) -> None:
            super().__init__()
            self.inner = torch.distributed.HashStore()

        def set(self, key: str, value: Any) -> None:
            self.inner.set(key, value)

        def get(self, key: str) -> bytes:
            return self.inner.get(key)

        def add(self, key: str, amount: int) -> int:
            return self.inner.add(key, amount)

        def check(self, keys: list[str]) -> bool:
            return self.inner.check(keys)

        def wait(self, *args: Any) -> None:
            self.inner.wait(*args)

    with shared.Group(rank=0, world_size=1, store=NoDelete(), timeout=5) as group:
        for _ in range(3):
            group.barrier()


@pytest.mark.parametrize("layout", ["continuous", "chunked"])
def test_share_memory_keeps_a_view_part_of_the_shared_tensor(layout: str) -> None:
    """share_memory_() (and Module.share_memory()) would move a view's memory into new shared
    memory: on a view of a shared tensor it is a no-op, and is_shared() is true, as for torch's
    own shared memory. Other tensors are shared as torch shares them."""
    store = torch.distributed.HashStore()
    with shared.Group(rank=0, world_size=1, store=store, timeout=5) as group:
        t = group.create_tensor((64, 4), torch.float32, layout=layout, name="table")
        whole = t.view()
        view = (whole if layout == "continuous" else whole[0])[8:16]
        address = view.data_ptr()
        assert view.is_shared()
        assert view.share_memory_() is view and view.data_ptr() == address
        module = torch.nn.Module()
        module.weight = torch.nn.Parameter(view, requires_grad=False)
        module.share_memory()
        assert module.weight.data_ptr() == address
        view.fill_(5.0)
        assert torch.equal(t.gather([8]), torch.full((1, 4), 5.0))
    other = torch.zeros(3)
    assert not other.is_shared()
    other.share_memory_()
    assert other.is_shared()


@pytest.mark.parametrize("layout", ["continuous", "chunked"])
def test_a_view_sent_to_another_process_stays_part_of_the_shared_tensor(layout: str) -> None:
    """torch.multiprocessing's pickling would move a view's memory into new shared memory and
    swap it under the view in place, detaching it from the shared tensor without a word: the
    other process gets a copy (as it always did) and the view stays where it is, shared."""
    import queue as queue_module

    from multiprocessing.reduction import ForkingPickler

    store = torch.distributed.HashStore()
    with shared.Group(rank=0, world_size=1, store=store, timeout=5) as group:
        t = group.create_tensor((64, 4), torch.float32, layout=layout, name="table")
        whole = t.view()
        view = (whole if layout == "continuous" else whole[0])[8:16]
        view.fill_(2.0)
        address = view.data_ptr()
        sent = ForkingPickler.loads(ForkingPickler.dumps(view))
        assert torch.equal(sent, view) and sent.data_ptr() != address
        q = torch.multiprocessing.get_context("spawn").Queue()
        q.put(view)  # pickled on the queue's feeder thread
        try:
            assert torch.equal(q.get(timeout=30), view)
        except queue_module.Empty:
            pytest.fail("the view never arrived")
        assert view.data_ptr() == address  # not moved: writes still reach the shared tensor
        view.fill_(3.0)
        assert torch.equal(t.gather([8]), torch.full((1, 4), 3.0))
        q.close()
        q.join_thread()


@pytest.mark.parametrize("layout", ["continuous", "chunked"])
def test_an_empty_list_of_indices_is_an_empty_batch(layout: str) -> None:
    """`[]` (an empty batch, which torch makes a float tensor) gathers no rows and scatters
    none, as an empty int64 tensor does; what is not indices is a TypeError saying so."""
    store = torch.distributed.HashStore()
    with shared.Group(rank=0, world_size=1, store=store, timeout=5) as group:
        t = group.create_tensor((4, 3), torch.int32, layout=layout)
        t.scatter([1], torch.tensor([[1, 2, 3]], dtype=torch.int32))
        for empty in ([], (), torch.tensor([], dtype=torch.int64)):
            got = t.gather(empty)
            assert got.shape == (0, 3) and got.dtype == torch.int32
            t.scatter(empty, torch.zeros(0, 3, dtype=torch.int32))
        assert torch.equal(t.gather([1]), torch.tensor([[1, 2, 3]], dtype=torch.int32))
        for bad in (None, "ab", [[1], [2, 3]]):
            with pytest.raises(TypeError, match="indices must be"):
                t.gather(bad)
        with pytest.raises(TypeError, match="indices must be integers, not torch.float32"):
            t.gather([1.0])
        # A mask in torch's indexing (t[mask]), which index_select refuses: never row numbers.
        for mask in (torch.tensor([1, 0], dtype=torch.uint8), torch.tensor([True, False])):
            with pytest.raises(TypeError, match="are a mask in torch's indexing"):
                t.gather(mask)
            with pytest.raises(TypeError, match="are a mask in torch's indexing"):
                t.scatter(mask, torch.zeros(2, 3, dtype=torch.int32))


@pytest.mark.parametrize("layout", ["continuous", "chunked"])
def test_scatter_writes_the_values_a_view_shows_as_index_copy_does(layout: str) -> None:
    """A conj or neg view's memory holds other numbers than its values; values that are rows of
    the tensor itself are read before any row is written."""
    store = torch.distributed.HashStore()
    with shared.Group(rank=0, world_size=1, store=store, timeout=5) as group:
        t = group.create_tensor((4, 2), torch.complex64, layout=layout)
        x = torch.tensor([[1 + 2j, 3 - 4j]], dtype=torch.complex64)
        t.scatter([0], x.conj())
        assert torch.equal(t.gather([0]), x.conj().resolve_conj())
        t.scatter([1], x._neg_view())
        assert torch.equal(t.gather([1]), -x)
        f = group.create_tensor((4, 2), torch.float32, layout=layout)
        f.scatter([0, 1, 2, 3], torch.arange(8, dtype=torch.float32).reshape(4, 2))
        rows = f.view() if layout == "continuous" else f.view()[0]  # one rank: one part
        expected = rows.clone().index_copy_(0, torch.tensor([1, 2]), rows[0:2].clone())
        f.scatter([1, 2], rows[0:2])
        assert torch.equal(f.gather([0, 1, 2, 3]), expected)


def test_load_checkpoint_detects_the_format_as_tensortier_load_does(tmp_path: Path) -> None:
    """A safetensors file whose header length starts with the byte 0x80 (a pickle's first byte)
    is safetensors, by the detection tensortier.load and the CLI use; a shard index and a file
    that is no checkpoint are refused with what they are."""
    values = torch.arange(10, dtype=torch.float32).reshape(5, 2)
    header = json.dumps({"w": {"dtype": "F32", "shape": [5, 2], "data_offsets": [0, 40]}})
    header = header.ljust(0x180).encode()  # 8-byte length 80 01 00 ...
    path = tmp_path / "w.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + values.numpy().tobytes())
    assert tensortier.load(path)["w"].equal(values)
    index = tmp_path / "m.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"w": path.name}}))
    other = tmp_path / "notes.txt"
    other.write_bytes(b"\x80" + b"not a pickle")
    store = torch.distributed.HashStore()
    with shared.Group(rank=0, world_size=1, store=store, timeout=5) as group:
        t = group.create_tensor((5, 2), torch.float32, layout="chunked", name="w")
        t.load_checkpoint(path, "w")
        assert torch.equal(t.gather([0, 1, 2, 3, 4]), values)
        with pytest.raises(ValueError, match="shard index"):
            t.load_checkpoint(index, "w")
        with pytest.raises(ValueError) as refused:
            tensortier.load(other)
        with pytest.raises(ValueError, match=re.escape(str(refused.value))):
            t.load_checkpoint(other, "w")


@pytest.mark.parametrize("kind", ["file", "hash"])
def test_a_name_that_never_appears_times_out_on_every_store_kind(tmp_path: Path, kind: str) -> None:
    """FileStore's wait raises a plain RuntimeError on a timeout, HashStore's a DistStoreError:
    both are a TimeoutError here, told apart from other failures without reading messages."""
    store = (torch.distributed.FileStore(str(tmp_path / "store"), 1) if kind == "file"
             else torch.distributed.HashStore())
    with shared.Group(rank=0, world_size=1, store=store, timeout=1) as group:
        t = group.create_tensor((3,), torch.int32, name="there")
        with pytest.raises(TimeoutError, match="no shared tensor named 'nope'"):
            group.attach("nope")
        with pytest.raises(TimeoutError, match="no shared tensor named 'nope'"):
            shared.attach("nope", store=store, timeout=0.5)
        other = shared.attach("there", store=store, timeout=1)  # from outside: no rank here
        t.view()[2] = 7
        assert other.view()[2].item() == 7 and other.gather([2]).item() == 7
        with pytest.raises(ValueError, match="outside its group"):
            other.local()
    with pytest.raises(TypeError, match="torch.distributed.Store"):
        shared.attach("there", store=object())
    with pytest.raises(ValueError, match="name"):
        shared.attach("", store=store)


def test_attach_without_a_store_to_reach_raises_connection_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # nothing serves it
    with pytest.raises(ConnectionError, match="cannot reach the TCPStore at 127.0.0.1:.* within 1 s"):
        shared.attach("feat", timeout=1)
    monkeypatch.delenv("MASTER_PORT")
    with pytest.raises(ValueError, match="MASTER_ADDR and MASTER_PORT"):
        shared.attach("feat", timeout=1)
GATHER_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
]


@pytest.mark.parametrize("layout", ["continuous", "chunked"])
def test_small_batch_gather_equals_index_select_for_every_dtype(layout: str) -> None:
    # Row sizes not a multiple of 8 or 64 bytes; batches shorter and longer than the prefetch
    # distance; the lean path (contiguous int64 on the CPU) and the converting path.
    store = torch.distributed.HashStore()
    with shared.Group(rank=0, world_size=1, store=store, timeout=5) as group:
        gen = torch.Generator().manual_seed(3)
        for dtype in GATHER_DTYPES:
            for cols in (1, 3, 33):
                t = group.create_tensor((1001, cols), dtype, layout=layout)
                want = (torch.randint(0, 100, (1001, cols), generator=gen) % 2 == 1
                        if dtype == torch.bool
                        else torch.randint(0, 100, (1001, cols), generator=gen).to(dtype))
                t.local()[0].copy_(want)
                for n in (0, 1, 7, 9, 1024):
                    idx = torch.randint(0, 1001, (n,), generator=gen)
                    assert torch.equal(t.gather(idx), want.index_select(0, idx)), (dtype, cols, n)
                idx = torch.randint(0, 1001, (64,), generator=gen)
                assert torch.equal(t.gather(idx.to(torch.int32)), want.index_select(0, idx))
                assert torch.equal(t.gather(idx[::2]), want.index_select(0, idx[::2]))
                assert torch.equal(t.gather(idx.tolist()), want.index_select(0, idx))
                t.close()
        t = group.create_tensor((10, 4), torch.float32, layout=layout)
        for bad in ([0, 10], [-1], [3, 2**40]):
            with pytest.raises(IndexError, match=f"index {bad[-1]} .*out of range"):
                t.gather(torch.tensor(bad))
        with pytest.raises(ValueError, match="one-dimensional"):
            t.gather(torch.zeros((2, 2), dtype=torch.int64))
        with pytest.raises(TypeError, match="integers"):
            t.gather(torch.zeros(2))
        t.close()
        with pytest.raises(RuntimeError, match="closed"):
            t.gather(torch.tensor([0]))


EXAMPLE_RUNS = {
    "wholememory_seed.py": (["--rows", "1000"], "written by ranks [0, 1, 0, 1]"),
    "gnn_feature_gather.py": (["--nodes", "5000", "--steps", "3"], "rows/s"),
}


@pytest.mark.parametrize("script", sorted(EXAMPLE_RUNS))
def test_example_runs_under_torchrun(tmp_path: Path, script: str) -> None:
    examples = Path(__file__).resolve().parents[2] / "examples" / "shared"
    args, says = EXAMPLE_RUNS[script]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(examples / script), *args],
        env=env_for(tmp_path), capture_output=True, text=True, timeout=TIMEOUT,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert says in proc.stdout, proc.stdout


def test_wholememory_argument_handling_in_one_process() -> None:
    from tensortier.compat import wholememory as wm

    with pytest.raises(RuntimeError, match="init_lib"):
        wm.mp_init(0, 1, store=torch.distributed.HashStore())
    wm.init_lib()
    with pytest.raises(RuntimeError, match="mp_init"):
        wm.create_tensor([2], [], torch.float32, True, [])
    wm.mp_init(0, 1, store=torch.distributed.HashStore())
    try:
        with pytest.raises(RuntimeError, match="already"):
            wm.mp_init(0, 1, store=torch.distributed.HashStore())
        t = wm.create_tensor([3, 4], [4, 1], torch.int64, True, [0])  # explicit contiguous stride
        assert t.shape == (3, 4) and t.dtype == torch.int64 and t.is_contiguous()
        t[2, 3] = 9
        view = wm.get_tensor_view(t, torch.device("cpu"))
        assert view[2, 3].item() == 9 and view.data_ptr() == t.data_ptr()
        with pytest.raises(ValueError, match="contiguous stride"):
            wm.create_tensor([3, 4], [1, 3], torch.float32, True, [])
        with pytest.raises(ValueError, match="every rank"):
            wm.create_tensor([3, 4], [], torch.float32, True, [0, 1])
        with pytest.raises(ValueError, match="returned by create_tensor"):
            wm.get_tensor_view(torch.zeros(2), torch.device("cpu"))
        with pytest.raises(RuntimeError, match="no CUDA driver was found"):
            wm.get_tensor_view(t, torch.device("cuda:0"))
    finally:
        wm.finalize_lib()
    wm.finalize_lib()  # twice is harmless
    with pytest.raises(RuntimeError, match="init_lib"):
        wm.get_tensor_view(t, torch.device("cpu"))
    assert t[2, 3].item() == 9  # the tensor keeps its memory after finalize


def test_example_device_memory_without_a_driver_says_so(tmp_path: Path) -> None:
    """The seed's is_host=False path (--device) on a machine without a CUDA driver: every rank
    fails with an error naming the missing driver (on a GPU it runs: tests/python/test_gpu_shared.py)."""
    if _core.cuda_driver()["available"]:
        pytest.skip("a CUDA driver is present")
    examples = Path(__file__).resolve().parents[2] / "examples" / "shared"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(examples / "wholememory_seed.py"), "--rows", "1000", "--device"],
        env=env_for(tmp_path), capture_output=True, text=True, timeout=TIMEOUT,
    )
    assert proc.returncode != 0
    assert proc.stderr.count("no CUDA driver was found") >= 2, proc.stderr[-3000:]


@pytest.mark.parametrize("private_group", [False, True])
def test_two_jobs_on_one_store_keep_their_keys_apart(tmp_path: Path, private_group: bool) -> None:
    """Two jobs of 2 processes meet through one TCPStore; job B makes its group after job A
    made its own (and, with `private_group`, after A's rank 0 made a group on another store
    first): B's collectives never read A's keys, both jobs' rows stay right, and B attaches A's
    named tensor."""
    shm_before = shm_entries()
    port = free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, None, is_master=True,
                                       timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    extra = {"TORCHELASTIC_USE_AGENT_STORE": "True", "SHARED_TEST_PRIVATE_GROUP": "1" if private_group else ""}
    outdirs = {job: tmp_path / f"out_{job}" for job in "AB"}
    procs: dict[str, list[subprocess.Popen[bytes]]] = {}
    try:
        for job, outdir in outdirs.items():
            outdir.mkdir()
            procs[job] = start_ranks(tmp_path, "two_jobs", 2, port, outdir, SHARED_TEST_JOB=job, **extra)
        outputs = {job: finish(p) for job, p in procs.items()}
    finally:
        for p in [p for ps in procs.values() for p in ps]:
            if p.poll() is None:
                p.kill()
                p.wait()
    sockets = []
    for job, outdir in outdirs.items():
        for r, res in enumerate(reports(outdir, 2)):
            assert res["ok"], f"job {job} rank {r}: {res.get('error')}\n{outputs[job][r][-2000:]}"
            sockets.append(res["socket"])
    assert len(set(sockets)) == 4  # every process served on its own socket
    del store
    assert_nothing_left(tmp_path, shm_before, sockets,
                        [p.pid for ps in procs.values() for p in ps])


def test_ranks_that_create_groups_out_of_order_are_told_so() -> None:
    """The group keys are counted per store: rank 0 of 2 gave up on two groups (rank 1 never
    came); rank 1's first group then cannot pair with rank 0's third and says why, at once."""
    store = torch.distributed.HashStore()
    for _ in range(2):
        with pytest.raises(TimeoutError, match="rank 1 of 2 did not arrive"):
            shared.Group(rank=0, world_size=2, store=store, timeout=0.5)
    with pytest.raises(ValueError, match="rank 0 has created 2 already: every rank must create its groups"):
        shared.Group(rank=1, world_size=2, store=store, timeout=5)
    # Groups of another size, or on another store, have counts of their own.
    with shared.Group(rank=0, world_size=1, store=store, timeout=5) as alone:
        assert alone.create_tensor((2,), torch.int8).gather([1]).item() == 0


@pytest.mark.parametrize("world", [2, 3])
def test_threads_gather_and_scatter_one_distributed_tensor_at_once(
        tmp_path: Path, world: int, forked: ranks.ForkServer) -> None:
    results = run_ranks(tmp_path, "threads", world, "fork", forked)
    assert all("socket" in res for res in results)


def test_nothing_left_checks_look_only_at_what_our_processes_make(tmp_path: Path) -> None:
    """Another program's entry in /dev/shm (a multiprocessing semaphore of another job) made while
    our processes ran is not blamed on them; one under tensortier's prefix, or torch's file of one
    of our processes, is."""
    (tmp_path / "private_tmp").mkdir()
    shm_before = shm_entries()
    made = []
    try:
        for name in (f"sem.mp-other-job-{os.getpid()}", f"torch_{os.getpid() + 1}_other"):
            made.append(Path("/dev/shm") / name)
            made[-1].write_bytes(b"")
        assert_nothing_left(tmp_path, shm_before, [], [os.getpid()])
        for name in (f"tensortier-left-{os.getpid()}", f"torch_{os.getpid()}_left"):
            made.append(Path("/dev/shm") / name)
            made[-1].write_bytes(b"")
            with pytest.raises(AssertionError):
                assert_nothing_left(tmp_path, shm_before, [], [os.getpid()])
            made.pop().unlink()
    finally:
        for path in made:
            path.unlink(missing_ok=True)


def test_attach_refuses_a_store_record_that_is_no_tensor_or_needs_more_than_is_served() -> None:
    """The record attach reads is anyone's writing (a TCPStore has no authentication): a field
    no tensor has, or a shape needing more memory than the owners serve, is a ValueError naming
    the field, never a crash (SIGBUS, a segfault), uninitialised bytes or a MemoryError."""
    store = torch.distributed.HashStore()
    with shared.Group(rank=0, world_size=1, store=store, timeout=5) as group:
        t = group.create_tensor((10, 4), torch.float32, name="t")
        t.view()[9] = 3.0
        key = "tensortier/shared/named/t"
        good = store.get(key).decode()
        cases = [
            (good.replace("shape=[10,4]", "shape=[-5,4]"), "shape has a negative dimension"),
            (good.replace("shape=[10,4]", "shape=[100000,4]"), "needs 1601536 bytes in rank 0"),
            (good.replace("element_size=4", "element_size=0"), "element_size must be positive"),
            (good.replace("element_size=4", "element_size=8"),
             "element_size 8 is not the size of torch.float32 (4)"),
            (good.replace(" 1 shape=", " 2147483647 shape="), "world_size 2147483647 is not in"),
            (good.replace("shape=[10,4]", "shape=[99999999999999999999,4]"), "shape '9999"),
        ]
        for record, says in cases:
            assert record != good
            store.set(key, record)
            with pytest.raises(ValueError, match=re.escape(says)):
                shared.attach("t", store=store, timeout=2)
        store.set(key, good)
        again = shared.attach("t", store=store, timeout=2)
        assert torch.equal(again.gather([9]), torch.full((1, 4), 3.0))


def wholememory_shared_memory() -> tuple[int, int]:
    """This process's descriptors and mappings of shared tensors' memory."""
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds += "memfd:tensortier-shared" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed since
            pass
    with open("/proc/self/maps") as f:
        maps = sum("memfd:tensortier-shared" in line for line in f)
    return fds, maps


def test_wholememory_tensors_nobody_references_release_their_memory() -> None:
    """compat.wholememory keeps only weak references: a dropped tensor (and the views taken of it)
    gives back its memory and descriptors before finalize_lib(), as torch tensors do; one still
    referenced keeps them, and get_tensor_view still finds it."""
    from tensortier.compat import wholememory as wm

    wm.init_lib()
    wm.mp_init(0, 1, store=torch.distributed.HashStore())
    try:
        before = wholememory_shared_memory()
        kept = wm.create_tensor([16, 4], [], torch.float32, True, [])
        kept[3] = 7.0
        held = wholememory_shared_memory()
        assert held[0] > before[0] and held[1] > before[1]
        for _ in range(30):
            t = wm.create_tensor([4096, 256], [], torch.float32, True, [])
            v = wm.get_tensor_view(t, torch.device("cpu"))
            v[0, 0] = 1.0
            assert wm.get_tensor_view(v, torch.device("cpu"))[0, 0].item() == 1.0
            del t, v
        assert wholememory_shared_memory() == held
        assert wm.get_tensor_view(kept, torch.device("cpu"))[3, 1].item() == 7.0
        del kept
        assert wholememory_shared_memory() == before
    finally:
        wm.finalize_lib()


def test_wholememory_views_of_empty_tensors_are_their_own() -> None:
    """Empty tensors all have data pointer 0: get_tensor_view finds each by the tensor itself."""
    from tensortier.compat import wholememory as wm

    wm.init_lib()
    wm.mp_init(0, 1, store=torch.distributed.HashStore())
    try:
        a = wm.create_tensor([0, 4], [], torch.float32, True, [])
        b = wm.create_tensor([0, 8], [], torch.int64, True, [])
        va = wm.get_tensor_view(a, torch.device("cpu"))
        vb = wm.get_tensor_view(b, torch.device("cpu"))
        assert (va.shape, va.dtype) == ((0, 4), torch.float32)
        assert (vb.shape, vb.dtype) == ((0, 8), torch.int64)
    finally:
        wm.finalize_lib()


def test_wholememory_views_of_aliases_of_a_created_tensor() -> None:
    """An alias of a created tensor (view, detach, reshape) shares its memory: get_tensor_view
    takes it, as WholeMemory's lookup by memory did."""
    from tensortier.compat import wholememory as wm

    wm.init_lib()
    wm.mp_init(0, 1, store=torch.distributed.HashStore())
    try:
        t = wm.create_tensor([16, 4], [], torch.float32, True, [])
        t.copy_(torch.arange(64, dtype=torch.float32).view(16, 4))
        for alias in (t.view(-1), t.detach(), t.reshape(8, 8)):
            view = wm.get_tensor_view(alias, torch.device("cpu"))
            assert view.shape == (16, 4) and torch.equal(view, t)
        with pytest.raises(ValueError, match="create_tensor"):
            wm.get_tensor_view(torch.zeros(16, 4), torch.device("cpu"))
        for part in (t[2:5], t[:, 1], t[:8]):  # not the whole: refused, never widened
            with pytest.raises(ValueError, match="not a part"):
                wm.get_tensor_view(part, torch.device("cpu"))
    finally:
        wm.finalize_lib()


def test_a_rank_that_closed_its_group_fails_the_others_calls_at_once() -> None:
    """A rank that closes its group (or exits) without making a collective call the others
    make: they raise ConnectionAbortedError naming it within seconds, not at the timeout."""
    closed = threading.Event()

    def body(group: shared.Group) -> Any:
        if group.rank == 1:
            group.close()
            closed.set()
            return None
        closed.wait(30)
        start = time.monotonic()
        with pytest.raises(ConnectionAbortedError, match="rank 1 of 2 closed its group") as e:
            group.barrier()
        return time.monotonic() - start, e.value

    results = run_ranks_in_threads(2, body, timeout=60)
    waited, _ = results[0]
    assert waited < 30, waited  # the group's timeout is 60 s


@pytest.mark.parametrize("call", ["store_files", "load_files", "load_checkpoint"])
def test_a_rank_whose_tensor_was_closed_fails_the_others_file_calls_at_once(
        tmp_path: Path, call: str) -> None:
    """A rank that closed its tensor (its group still open) and makes the same file call: it
    raises RuntimeError, and the others raise at once naming it, not at the timeout."""
    rows = torch.arange(32, dtype=torch.float32).view(8, 4)
    rows.numpy().tofile(tmp_path / "rows.bin")
    import safetensors.torch as st

    st.save_file({"t": rows}, tmp_path / "rows.safetensors")
    args = {"store_files": (str(tmp_path / "out"),), "load_files": ([tmp_path / "rows.bin"],),
            "load_checkpoint": (tmp_path / "rows.safetensors", "t")}[call]

    def body(group: shared.Group) -> Any:
        t = group.create_tensor((8, 4), torch.float32)
        if group.rank == 1:
            t.close()
        start = time.monotonic()
        try:
            getattr(t, call)(*args)
        except RuntimeError as e:
            group.barrier()  # the closed rank stays in its group until the others know
            return time.monotonic() - start, str(e)
        return None

    results = run_ranks_in_threads(2, body, timeout=60)
    (waited, seen), (_, own) = results
    assert waited < 30, waited  # the group's timeout is 60 s
    assert seen == f"{call} failed on rank 1: RuntimeError: {own}"
    assert own == f"{call}: the shared tensor was closed (finalized)"


def run_ranks_in_threads(world: int, body: Any, timeout: float) -> list[Any]:
    """Runs `body(group)` for every rank of a group of `world` threads of this process over one
    HashStore; returns what each returned or raised."""
    store = torch.distributed.HashStore()
    results: list[Any] = [None] * world

    def run(rank: int) -> None:
        try:
            with shared.Group(rank=rank, world_size=world, store=store, timeout=timeout) as group:
                results[rank] = body(group)
        except BaseException as e:  # reported to the test
            results[rank] = e

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(3 * timeout)
    assert not any(th.is_alive() for th in threads), "ranks did not finish"
    return results


def test_every_rank_of_a_mismatched_collective_call_raises() -> None:
    """Ranks 0 and 2 create a tensor while rank 1 calls barrier(): all three raise ValueError
    naming who called what (rank 1's barrier used to return normally)."""

    def body(group: shared.Group) -> str:
        try:
            if group.rank == 1:
                group.barrier()
            else:
                group.create_tensor((10, 4), torch.float32)
        except ValueError as e:
            group.barrier()  # the group goes on
            return str(e)
        return "no error"

    for rank, said in enumerate(run_ranks_in_threads(3, body, 20)):
        assert isinstance(said, str), f"rank {rank}: {said!r}"
        assert "rank 1 called barrier" in said and "rank 0,2 called create_tensor" in said, (rank, said)


def test_a_rank_failing_load_files_or_store_files_fails_every_rank_at_once(tmp_path: Path) -> None:
    """Rank 1's file shrinks between stat and read: rank 1 raises its OSError and the others a
    RuntimeError naming rank 1 with its error's text, at once (they used to wait out the timeout,
    then blame rank 1 for not arriving). Then rank 1 cannot write its part of store_files."""
    want = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    path, shrinking = tmp_path / "rows", tmp_path / "rows_of_rank_1"
    path.write_bytes(want.numpy().tobytes())
    shrinking.write_bytes(want.numpy().tobytes())
    timeout = 30.0

    def body(group: shared.Group) -> list[tuple[str, str, float]]:
        t = group.create_tensor((10, 4), torch.float32, layout="chunked")  # rows on every rank
        said = []
        for call in (lambda: t.load_files([shrinking if group.rank == 1 else path]),
                     lambda: t.store_files(tmp_path / ("missing/x" if group.rank == 1 else "x"))):
            start = time.monotonic()
            try:
                call()
                said.append(("no error", "", 0.0))
            except Exception as e:
                said.append((type(e).__name__, str(e), time.monotonic() - start))
        return said

    with shrinking_after_size(shrinking):
        results = run_ranks_in_threads(3, body, timeout)
    for rank, said in enumerate(results):
        assert isinstance(said, list), f"rank {rank}: {said!r}"
        (load_type, load_text, load_waited), (store_type, store_text, store_waited) = said
        assert load_waited < timeout / 2 and store_waited < timeout / 2, (rank, said)
        if rank == 1:
            assert load_type == "OSError" and "shrank" in load_text, said
            assert store_type == "FileNotFoundError", said
        else:
            assert load_type == "RuntimeError", (rank, said)
            assert "load_files failed on rank 1: OSError: " in load_text and "shrank" in load_text, said
            assert store_type == "RuntimeError" and "store_files failed on rank 1: " in store_text, said


def test_a_tensor_larger_than_the_machine_s_memory_is_an_error_not_the_oom_killer() -> None:
    """Every page of a rank's part is faulted in at creation: more than the machine's memory is
    refused up front (ENOMEM naming the tensor and its size) before any page is touched."""
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGESIZE")
    rows = 2 * memory // (1 << 20) + 1
    with shared.Group(rank=0, world_size=1, store=torch.distributed.HashStore(), timeout=5) as g:
        with pytest.raises(OSError) as refused:
            g.create_tensor((rows, 1 << 18), torch.float32, name="too-big")
        assert refused.value.errno == errno.ENOMEM
        said = str(refused.value)
        assert str(rows * (1 << 20)) in said and "'too-big'" in said, said
        assert "this machine's memory" in said or "cgroup memory limit" in said, said
        with pytest.raises(OSError, match="'\\(unnamed\\)'"):
            g.create_tensor((rows, 1 << 18), torch.float32)
        with pytest.raises(ValueError, match="too large"):
            g.create_tensor((4, 1 << 63), torch.float32, name="past-int64")
        small = g.create_tensor((4, 2), torch.float32, name="fits")  # the group still works
        assert torch.equal(small.gather([0, 3]), torch.zeros(2, 2))


def test_a_group_dropped_without_close_counts_itself_out() -> None:
    """Rank 1 drops its group without close(): it counts itself out of the store at once, as
    close() does, so the rank serving the store does not wait for it at exit (it used to wait
    out the timeout while rank 1 went on)."""
    store = torch.distributed.HashStore()
    groups: list[Any] = [None, None]

    def make(rank: int) -> None:
        groups[rank] = shared.Group(rank=rank, world_size=2, store=store, timeout=30)

    threads = [threading.Thread(target=make, args=(r,), daemon=True) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(90)
    assert all(isinstance(g, shared.Group) for g in groups), groups
    leave_key = groups[0]._core.leave_key
    assert store.add(leave_key, 0) == 0
    groups[1] = None  # dropped, never closed
    gc.collect()
    assert store.add(leave_key, 0) == 1
    groups[0].close()


def test_ctrl_c_ends_the_store_host_s_wait_at_exit_for_a_dead_rank(tmp_path: Path) -> None:
    """Rank 0 serves the store and, at exit, waits (up to the group's timeout) for the others to
    count themselves out; rank 1 died without doing so. Ctrl-C (SIGINT) ends that wait at once
    instead of being held until the timeout."""
    port = free_port()
    rank_code = (
        "import datetime, os, sys, torch, tensortier.shared as shared\n"
        "rank, port = int(sys.argv[1]), int(sys.argv[2])\n"
        "store = torch.distributed.TCPStore('127.0.0.1', port, 2, is_master=rank == 0,\n"
        "                                   timeout=datetime.timedelta(seconds=60))\n"
        "group = shared.Group(rank=rank, world_size=2, store=store, timeout=300)\n"
        "if rank == 1:\n"
        "    os._exit(0)  # dead: never counts itself out\n"
        "print('exiting', flush=True)\n"
    )
    env = env_for(tmp_path)
    procs = [subprocess.Popen([sys.executable, "-c", rank_code, str(r), str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    try:
        assert procs[1].wait(TIMEOUT) == 0
        assert procs[0].stdout is not None
        assert procs[0].stdout.readline() == "exiting\n"
        time.sleep(1)  # into the wait at exit
        assert procs[0].poll() is None, "rank 0 did not wait for rank 1 at exit"
        procs[0].send_signal(signal.SIGINT)
        start = time.monotonic()
        _, err = procs[0].communicate(timeout=60)
        assert time.monotonic() - start < 30, "Ctrl-C did not end the wait"
        assert "KeyboardInterrupt" in err, err[-2000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


FORK_CHILD_EXITS = """
import os, subprocess, sys, threading, time, torch, torch.multiprocessing as mp
import tensortier.shared as shared

OUTSIDE = "import tensortier.shared as s; print(s.attach('feat', timeout=20).view().sum().item())"

def child_uses_the_group(g, t):
    # A collective call from the child would stand in for its parent's rank, and an attach use
    # the parent's store connection: refused, before anything is done (no file stored).
    prefix = os.path.join(os.path.dirname(os.path.abspath(__file__)), "child_rows")
    code = 0
    for call in (g.barrier, lambda: t.store_files(prefix), lambda: g.attach("feat")):
        try:
            call()
            code = code or 4
        except RuntimeError as e:
            code = code or (0 if "a child made by fork()" in str(e) else 3)
    if any(n.startswith("child_rows") for n in os.listdir(os.path.dirname(prefix))):
        code = code or 5
    # Closing the child's copy, from another thread as a DataLoader worker's may: no abort.
    closing = threading.Thread(target=g.close)
    closing.start()
    closing.join()
    return code

def run(rank, world, port, forker, child):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    g = shared.Group(rank=rank, world_size=world, timeout=20)
    t = g.create_tensor((16,), torch.float32, name="feat")
    g.barrier()
    if rank == forker:
        pid = os.fork()
        if pid == 0:
            # Python's exit path: the atexit handlers it inherited run
            sys.exit(child_uses_the_group(g, t) if child == "use" else 0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
    g.barrier()
    t.scatter([rank], torch.ones(1))
    g.barrier()
    assert t.gather([0, 1]).sum().item() == 2.0
    if rank == 0:  # every rank still serves its rows to processes outside the group
        r = subprocess.run([sys.executable, "-c", OUTSIDE], capture_output=True, text=True,
                           timeout=60)
        assert r.stdout.strip() == "2.0", r.stdout + r.stderr
    g.barrier()
    g.close()

if __name__ == "__main__":
    mp.spawn(run, args=(2, int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]), nprocs=2)
"""


@pytest.mark.parametrize("forker,child", [(0, "exit"), (1, "exit"), (1, "use")])
def test_a_forked_child_s_exit_leaves_the_parent_s_group(tmp_path: Path, forker: int,
                                                         child: str) -> None:
    """A child made by os.fork() that exits through Python's exit path (sys.exit) runs the
    atexit handlers it inherited and drops its copy of the group: neither may close the
    parent's group, stop the parent's partition server (processes outside the group still
    attach), or make the rank serving the store wait for the others. A child that makes a
    collective call gets a RuntimeError (it is not the rank: its barrier would stand in for its
    parent's), and one that closes its copy from another thread exits normally."""
    script = tmp_path / "fork_child.py"
    script.write_text(FORK_CHILD_EXITS)
    r = subprocess.run([sys.executable, str(script), str(free_port()), str(forker), child],
                       env=env_for(tmp_path), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]


ATTACH_AFTER_INIT_PROCESS_GROUP = """
import os, subprocess, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
import tensortier.shared as shared

OUTSIDE = "import tensortier.shared as s; print(s.attach('feat', timeout=20).view()[:, 0].tolist())"

def run(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    g = shared.Group(timeout=30)
    t = g.create_tensor((4, 1), torch.float32, name="feat")
    t.view()[:, 0] = 7
    g.barrier()
    if rank == 0:
        r = subprocess.run([sys.executable, "-c", OUTSIDE], capture_output=True, text=True,
                           timeout=60)
        assert r.stdout.strip() == "[7.0, 7.0, 7.0, 7.0]", r.stdout + r.stderr
    g.barrier()
    g.close()
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(run, args=(2, int(sys.argv[1])), nprocs=2)
"""


def test_attach_finds_a_tensor_of_a_job_that_initialised_torch_distributed(
        tmp_path: Path) -> None:
    """Most jobs call init_process_group (env://) before making a Group: a process outside the
    job attaches by name through MASTER_ADDR:MASTER_PORT, as for a job that did not."""
    script = tmp_path / "attach_after_pg.py"
    script.write_text(ATTACH_AFTER_INIT_PROCESS_GROUP)
    r = subprocess.run([sys.executable, str(script), str(free_port())], env=env_for(tmp_path),
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]


GROUPS_ONE_AFTER_ANOTHER = """
import os, sys, torch, torch.multiprocessing as mp
import tensortier.shared as shared
from tensortier.compat import wholememory as wm

def run(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    first = shared.Group(rank=rank, world_size=world, timeout=30)
    first.create_tensor((10,), torch.float32)
    first.barrier()
    first.close()
    a = shared.Group(rank=rank, world_size=world, timeout=30)  # two at once
    b = shared.Group(rank=rank, world_size=world, timeout=30)
    ta = a.create_tensor((world,), torch.float32)
    tb = b.create_tensor((world,), torch.float32)
    ta.scatter([rank], torch.tensor([1.0]))
    tb.scatter([rank], torch.tensor([2.0]))
    a.barrier()
    b.barrier()
    assert ta.gather(list(range(world))).tolist() == [1.0] * world
    assert tb.gather(list(range(world))).tolist() == [2.0] * world
    a.close()
    b.close()
    for _ in range(2):  # WholeMemory: finalize_lib(), then init_lib() and mp_init() again
        wm.init_lib()
        wm.mp_init(rank, world)
        wm.create_tensor([4], [], torch.bool, True, [])
        wm.finalize_lib()

if __name__ == "__main__":
    mp.spawn(run, args=(2, int(sys.argv[1])), nprocs=2)
"""


def test_groups_one_after_another_and_at_once_meet_through_one_store(tmp_path: Path) -> None:
    """Without torchrun or init_process_group (MASTER_ADDR and MASTER_PORT only), rank 0
    serves the TCPStore once: a second group, two at once, and WholeMemory's finalize_lib()
    then mp_init() again meet through it rather than serving the port again (EADDRINUSE)."""
    script = tmp_path / "groups.py"
    script.write_text(GROUPS_ONE_AFTER_ANOTHER)
    r = subprocess.run([sys.executable, str(script), str(free_port())], env=env_for(tmp_path),
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]


WHOLEMEMORY_ALONE = """
import torch
from tensortier import shared
from tensortier.compat import wholememory as wm
wm.init_lib()
wm.mp_init(0, 1)
b = wm.create_tensor([4, 5], [], torch.float32, True, [])
view = wm.get_tensor_view(b, torch.device("cpu"))
view.fill_(2.0)
assert torch.equal(view + 1, torch.full((4, 5), 3.0))
del b, view
wm.finalize_lib()
with shared.Group(rank=0, world_size=1) as group:
    t = group.create_tensor((3,), torch.int64, name="alone")
    t.view().fill_(7)
    assert t.gather([2]).tolist() == [7]
print("ok")
"""


def test_a_group_of_one_needs_no_store(tmp_path: Path) -> None:
    """WholeMemory's single-process example (mp_init(0, 1) in a plain process, no torchrun) and
    a Group of one without a store run: a group of one meets no one (it raised for want of
    MASTER_ADDR and MASTER_PORT)."""
    script = tmp_path / "alone.py"
    script.write_text(WHOLEMEMORY_ALONE)
    env = env_for(tmp_path)
    for variable in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        env.pop(variable, None)
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout[-2000:] + r.stderr[-3000:]


def test_pickling_a_tensor_or_a_group_says_to_attach_by_name() -> None:
    import pickle

    store = torch.distributed.HashStore()
    with shared.Group(rank=0, world_size=1, store=store, timeout=5) as group:
        t = group.create_tensor((4,), torch.float32, name="feat")
        with pytest.raises(TypeError, match=r"send the name, and shared.attach\(name\)"):
            pickle.dumps(t)
        with pytest.raises(TypeError, match="Group cannot be pickled"):
            pickle.dumps(group)


def test_arguments_of_the_wrong_type_are_type_errors_naming_them() -> None:
    """A rank, world size, timeout or name of the wrong type: TypeError naming the argument
    and the type given (not pybind's listing of a signature, nor a failed comparison)."""
    store = torch.distributed.HashStore()
    for kw, message in [({"rank": 0.0}, "rank must be an int, not float"),
                        ({"rank": True}, "rank must be an int, not bool"),
                        ({"world_size": "1"}, "world_size must be an int, not str"),
                        ({"timeout": "10"}, "timeout must be seconds .* not str")]:
        with pytest.raises(TypeError, match=message):
            shared.Group(**{"rank": 0, "world_size": 1, "store": store, **kw})
    import numpy as np

    with shared.Group(rank=np.int64(0), world_size=torch.tensor(1), store=store,
                      timeout=np.float32(5)) as group:
        assert (group.rank, group.world_size, group.timeout) == (0, 1, 5.0)
        for name, error, message in [(5, TypeError, "name must be a str, not int"),
                                     (b"t", TypeError, "name must be a str, not bytes"),
                                     ("", ValueError, "name must be a non-empty str")]:
            with pytest.raises(error, match=message):
                group.create_tensor((4, 4), torch.float32, name=name)
            with pytest.raises(error, match=message):
                shared.attach(name, store=store, timeout=1)


def test_a_world_size_beyond_a_group_s_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"world_size 1099511627776 is more than a group can"):
        shared.Group(rank=0, world_size=2**40, store=torch.distributed.HashStore(), timeout=2)


ENDLESS_TIMEOUTS = """
import datetime, os, sys, torch, torch.multiprocessing as mp
import tensortier.shared as shared

def run(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    timeout = float("inf") if rank == 0 else datetime.timedelta.max
    with shared.Group(rank=rank, world_size=world, timeout=timeout) as g:
        assert g.timeout == 365 * 24 * 3600.0, g.timeout
        t = g.create_tensor((8, 4), torch.float32, name="feat")
        t.local()[0].fill_(rank + 1)
        g.barrier()
        want = sum((end - begin) * 4 * (r + 1) for r, (begin, end) in enumerate(t.partitions))
        assert t.view().sum().item() == want, (t.view(), t.partitions)

if __name__ == "__main__":
    mp.spawn(run, args=(2, int(sys.argv[1])), nprocs=2)
"""


def test_timeouts_of_more_than_a_year_wait_without_end(tmp_path: Path) -> None:
    """timeout=inf and datetime.timedelta.max are waits without end (a year at most, which
    the waits take as none): the group works, not an overflow failing one rank at once while
    the other waits for it."""
    script = tmp_path / "endless.py"
    script.write_text(ENDLESS_TIMEOUTS)
    r = subprocess.run([sys.executable, str(script), str(free_port())], env=env_for(tmp_path),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]


def test_a_name_longer_than_an_attach_request_holds_is_refused_when_created() -> None:
    store = torch.distributed.HashStore()
    with shared.Group(rank=0, world_size=1, store=store, timeout=5) as group:
        longest = "n" * 4096
        kept = group.create_tensor((4,), torch.float32, name=longest)
        assert group.attach(longest).shape == kept.shape == (4,)
        with pytest.raises(ValueError, match="name is 4097 bytes long; .* at most 4096"):
            group.create_tensor((4,), torch.float32, name="n" * 4097)


def test_threads_of_one_rank_create_tensors_at_once() -> None:
    """Threads of a rank each creating unnamed tensors: each gets a tensor of its own. The
    name came from the group's count of collective calls read after the call, which another
    thread's calls had moved meanwhile (ValueError: a shared tensor named '#258' exists)."""
    import torch.distributed as dist

    group = shared.Group(rank=0, world_size=1, store=dist.HashStore())
    errors: list[str] = []

    def create(value: int) -> None:
        for _ in range(60):
            try:
                t = group.create_tensor((100, 8), torch.float32)
                t.view().fill_(value)
                assert float(t.view().sum()) == value * 800
                t.close()
            except Exception as e:  # noqa: BLE001 - collected for the assertion
                errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    group.close()
    assert not any(t.is_alive() for t in threads)
    assert errors == []


def test_close_while_threads_create_tensors() -> None:
    """Group.close() from one thread while others create tensors: those calls end with the
    group's 'closed' error (the server they mapped from was freed under them: a segfault)."""
    script = textwrap.dedent("""
        import threading, time, torch, torch.distributed as dist
        import tensortier.shared as shared
        group = shared.Group(rank=0, world_size=1, store=dist.HashStore())
        errors = []
        def create(value):
            for _ in range(2000):
                try:
                    t = group.create_tensor((1000, 8), torch.float32)
                    t.view().fill_(value)
                    t.close()
                except Exception as e:
                    errors.append(str(e))
                    return
        threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        group.close()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        assert all("closed" in e for e in errors), errors[:3]
        """)
    exits_cleanly(script, runs=3)
