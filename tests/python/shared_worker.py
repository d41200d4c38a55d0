"""One rank of a multi-process shared-tensor test: ``python shared_worker.py SCENARIO OUTDIR``,
started by torchrun, by torch.multiprocessing.spawn (``spawn_entry``) or as a plain subprocess
(RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set by the test). Each rank writes
OUTDIR/rank<N>.json: {"ok": true, ...} or {"ok": false, "error": ...}."""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import sys
import time
import traceback
from typing import Any, Callable

import torch

import tensortier.shared as shared
from tensortier import _core

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
]


def expected(shape: tuple[int, ...], dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """The full tensor every rank's writes add up to (distinct per element where the dtype
    allows)."""
    n = 1
    for d in shape:
        n *= d
    base = (torch.arange(n, dtype=torch.int64) * 7 + salt) % 101
    if dtype == torch.bool:
        return (base % 2 == 1).view(shape)
    return base.to(dtype).view(shape)


def check_tensor(group: shared.Group, shape: tuple[int, ...], dtype: torch.dtype, layout: str) -> None:
    rank, world = group.rank, group.world_size
    t = group.create_tensor(shape, dtype, layout=layout)
    want = expected(shape, dtype)
    local, (begin, end) = t.local()
    assert t.partitions[rank] == (begin, end)
    assert sum(e - b for b, e in t.partitions) == shape[0]
    local.copy_(want[begin:end])  # each rank writes only its rows
    group.barrier()
    view = t.view()
    whole = view if isinstance(view, torch.Tensor) else torch.cat(view)
    assert torch.equal(whole, want), f"{layout} {dtype}: view differs"
    gen = torch.Generator().manual_seed(rank)
    idx = torch.randint(0, shape[0], (3 * shape[0] + 1,), generator=gen) if shape[0] else torch.empty(0, dtype=torch.int64)
    assert torch.equal(t.gather(idx), want.index_select(0, idx)), f"{layout} {dtype}: gather"
    group.barrier()
    # Every rank scatters its own set of rows (rank, rank + world, ...), in reverse order.
    mine = torch.arange(rank, max(rank, shape[0]), world).flip(0)
    values = expected((mine.numel(), *shape[1:]), dtype, salt=rank + 1)
    t.scatter(mine, values)
    group.barrier()
    private = want.clone()
    for r in range(world):
        rows = torch.arange(r, max(r, shape[0]), world).flip(0)
        private.index_copy_(0, rows, expected((rows.numel(), *shape[1:]), dtype, salt=r + 1))
    view = t.view()
    whole = view if isinstance(view, torch.Tensor) else torch.cat(view)
    assert torch.equal(whole, private), f"{layout} {dtype}: scatter"
    group.barrier()
    t.close()


def scenario_layouts(group: shared.Group, result: dict[str, Any]) -> None:
    for layout in ("continuous", "chunked"):
        for dtype in DTYPES:
            check_tensor(group, (1001, 3), dtype, layout)  # unequal partitions
        check_tensor(group, (5, 1), torch.float32, layout)  # zero-size partitions
        check_tensor(group, (0, 4), torch.int32, layout)  # no rows at all
        check_tensor(group, (4099,), torch.int16, layout)  # 1-D
    result["socket"] = group._core.socket_name


def scenario_errors(group: shared.Group, result: dict[str, Any]) -> None:
    rank = group.rank
    t = group.create_tensor((10, 2), torch.float32, name="table")
    again = group.attach("table")
    if rank == 0:
        t.view()[3, 1] = 5.0
    group.barrier()
    assert again.view()[3, 1].item() == 5.0
    # Disagreeing ranks: every rank raises ValueError naming the odd one.
    try:
        group.create_tensor((10 + (rank == 1), 2), torch.float32)
        raise AssertionError("no error for disagreeing shapes")
    except ValueError as e:
        assert "rank 1 asked for shape=[11,2]" in str(e), str(e)
    try:
        group.create_tensor((4, 2), torch.float32 if rank else torch.int32)
        raise AssertionError("no error for disagreeing dtypes")
    except ValueError as e:
        assert "dtype=torch.int32" in str(e) and "rank 0 asked" in str(e), str(e)
    # Arguments one rank refuses (in Python, and in C++): that rank raises its own error, the
    # others a ValueError naming it at once (they used to wait out the timeout, then blame a
    # closed group), and the next calls still pair up.
    for refused in ({"layout": "sideways"}, {"shape": (-4, 2)}):
        try:
            arguments = {"shape": (4, 2), "dtype": torch.float32}
            group.create_tensor(**{**arguments, **(refused if rank == 1 else {})})
            raise AssertionError(f"no error for a create refused on rank 1: {refused}")
        except ValueError as e:
            if rank != 1:
                assert "create_tensor was refused on rank 1: " in str(e), str(e)
    group.barrier()
    # Bad indices and values raise like index_select / index_copy_ would, writing nothing.
    for bad in ([10], [-1]):
        try:
            t.gather(torch.tensor(bad))
            raise AssertionError("no IndexError")
        except IndexError:
            pass
    try:
        t.scatter(torch.tensor([0]), torch.zeros(1, 2, dtype=torch.float64))
        raise AssertionError("no TypeError")
    except TypeError:
        pass
    try:
        t.scatter(torch.tensor([0, 1]), torch.zeros(1, 2))
        raise AssertionError("no ValueError")
    except ValueError:
        pass
    # Another user's process is refused by this rank's partition server.
    if rank == 0:
        # A forked child that becomes user 65534: exec'ing the interpreter as that user is not
        # possible where the interpreter lives under /root (mode 0700).
        assert fork_as_other(group._core.socket_name) == 0, "another user's process was served"
        assert group._core.refused_peers == 1
    group.barrier()
    view = t.view()
    group.close()
    for call in (lambda: t.gather(torch.tensor([0])), t.local, lambda: group.create_tensor((1,), torch.int8)):
        try:
            call()
            raise AssertionError("no error after close")
        except RuntimeError as e:
            assert "closed" in str(e)
    view.fill_(1)  # views taken before close keep their memory
    result["socket"] = group._core.socket_name


def scenario_seed(group_unused: Any, result: dict[str, Any]) -> None:
    from tensortier.compat import wholememory as wm

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # The seed's calls, as it writes them.
    wm.init_lib()
    wm.mp_init(rank, size)
    a = wm.create_tensor([7, 3], [], torch.float32, True, [])
    b = wm.create_tensor([4, 5], [], torch.float32, True, [])
    bb = wm.get_tensor_view(b, torch.device("cpu"))
    bb[rank] = rank + 1.0
    a[rank::size] = 10.0 * rank
    b1 = b + 1
    try:
        wm.create_tensor([4, 5], [], torch.float32, False, [])
        raise AssertionError("device memory without a driver")
    except RuntimeError as e:
        assert "no CUDA driver was found" in str(e), str(e)
    try:
        wm.get_tensor_view(b, torch.device("cuda:0"))
        raise AssertionError("cuda view without a driver")
    except RuntimeError as e:
        assert "no CUDA driver was found" in str(e), str(e)
    wm._group.barrier()  # type: ignore[union-attr]
    for r in range(size):
        assert bb[r].eq(r + 1.0).all(), bb
        assert a[r::size].eq(10.0 * r).all(), a
    assert b1.shape == (4, 5)
    del a, b, bb
    wm.finalize_lib()
    try:
        wm.create_tensor([1], [], torch.float32, True, [])
        raise AssertionError("create after finalize")
    except RuntimeError:
        pass


def scenario_killed(group: shared.Group, result: dict[str, Any]) -> None:
    t = group.create_tensor((64, 4), torch.float32)
    t.local()[0].fill_(group.rank)
    group.barrier()
    if group.rank == group.world_size - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        group.create_tensor((64, 4), torch.float32)
        raise AssertionError("no error with a dead rank")
    except TimeoutError as e:
        result["waited"] = time.monotonic() - start
        assert f"rank {group.world_size - 1} of {group.world_size} did not arrive" in str(e), str(e)
    # The memory the dead rank owned is still mapped here and readable.
    whole = t.view()
    assert isinstance(whole, torch.Tensor)
    begin, _ = t.partitions[group.world_size - 1]
    if begin < 64:
        assert whole[begin].eq(group.world_size - 1).all()
    result["socket"] = group._core.socket_name


def scenario_store_host(group: shared.Group, result: dict[str, Any]) -> None:
    """Rank 0 serves the store (no torchrun agent). Rank SHARED_TEST_VICTIM kills itself after
    the first tensor; the next collective raises on every survivor within the timeout: a
    ConnectionError naming rank 0 when it was the victim (the store went with it), else a
    TimeoutError naming the dead rank (rank 0 keeps the store until the survivors are done)."""
    victim = int(os.environ["SHARED_TEST_VICTIM"])
    t = group.create_tensor((64, 4), torch.float32)
    t.local()[0].fill_(group.rank)
    group.barrier()
    # The victim dies once every rank is out of the barrier (else rank 0's death could fail
    # the barrier itself on a slow rank: right, but not the call this test times).
    store = group._torch_store
    store.add("test/past_barrier", 1)
    if group.rank == victim:
        deadline = time.monotonic() + 60
        while store.add("test/past_barrier", 0) < group.world_size and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        group.create_tensor((64, 4), torch.float32)
        raise AssertionError("no error with a dead rank")
    except (TimeoutError, ConnectionError) as e:
        result["waited"] = time.monotonic() - start
        result["error_type"] = type(e).__name__
        result["message"] = str(e)
    result["socket"] = group._core.socket_name


def scenario_owners(group: shared.Group, result: dict[str, Any]) -> None:
    """Creates named tensors for a process outside the group (scenario_attacher) to attach,
    then checks that process's writes."""
    store = group._torch_store
    c = group.create_tensor((1001, 3), torch.float64, name="late_c")
    k = group.create_tensor((5, 2), torch.int16, layout="chunked", name="late_k")
    for t, shape, dtype in ((c, (1001, 3), torch.float64), (k, (5, 2), torch.int16)):
        local, (begin, end) = t.local()
        local.copy_(expected(shape, dtype)[begin:end])
    group.barrier()
    store.set("test/ready", b"")
    store.wait(["test/wrote"], datetime.timedelta(seconds=60))
    assert torch.equal(c.gather(torch.tensor([0, 1000])), torch.full((2, 3), -1.0, dtype=torch.float64))
    assert torch.equal(k.gather(torch.tensor([4])), torch.full((1, 2), -2, dtype=torch.int16))
    group.barrier()
    result["socket"] = group._core.socket_name


def scenario_attacher(group_unused: Any, result: dict[str, Any]) -> None:
    """A process outside the owners' group (started after it, with the same MASTER_ADDR and
    MASTER_PORT): attaches by name, reads the owners' rows, writes, and keeps its mapping
    after the owners exit."""
    c = shared.attach("late_c", timeout=20)
    k = shared.attach("late_k", timeout=20)
    assert c.shape == (1001, 3) and c.dtype == torch.float64 and c.layout == "continuous"
    assert torch.equal(c.view(), expected((1001, 3), torch.float64))
    assert torch.equal(torch.cat(k.view()), expected((5, 2), torch.int16))
    for call in (c.local, lambda: c.load_files(["/dev/null"]), lambda: c.store_files("/tmp/x")):
        try:
            call()
            raise AssertionError("a collective call from outside the group")
        except ValueError as e:
            assert "outside" in str(e), str(e)
    # Another user's process is refused (SO_PEERCRED) before anything is mapped.
    if os.geteuid() == 0:
        assert fork_as_other("", attach_name="late_c") == 0, "another user attached"
    c.scatter(torch.tensor([1000, 0]), torch.full((2, 3), -1.0, dtype=torch.float64))
    k.view()[-1][-1] = -2  # the last row, owned by the last owner with rows
    host = _core.shared_env_store(False, None, 20.0)[0]
    host.set("test/wrote", b"")
    host.wait(["test/owners_exited"], datetime.timedelta(seconds=60))
    # The owners are gone: the memory is still mapped here, readable and writable.
    view = c.view()
    assert view[0, 0].item() == -1.0 and view[5, 1].item() == expected((1001, 3), torch.float64)[5, 1].item()
    view[3] = 4.0
    assert c.gather(torch.tensor([3]))[0, 0].item() == 4.0
    try:
        shared.attach("late_c", store=host, timeout=5)
        raise AssertionError("attached a tensor whose owners exited")
    except ConnectionError:
        pass
    try:
        shared.attach("never", timeout=1)
        raise AssertionError("attached a tensor nobody created")
    except TimeoutError:
        pass
    c.close()
    try:
        c.gather(torch.tensor([0]))
        raise AssertionError("gather after close")
    except RuntimeError:
        pass
    assert view[3, 0].item() == 4.0  # views taken before close keep their memory


def scenario_distributed(group_unused: Any, result: dict[str, Any]) -> None:
    """The distributed layout over Gloo: rows move by all-to-all; gather/scatter are collective."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    group = shared.Group()  # the default group's store
    rank, world = group.rank, group.world_size
    for dtype in DTYPES:
        shape = (1001, 3)
        t = group.create_tensor(shape, dtype, layout="distributed")
        want = expected(shape, dtype)
        local, (begin, end) = t.local()
        local.copy_(want[begin:end])
        gen = torch.Generator().manual_seed(rank)
        idx = torch.randint(0, shape[0], (257 * (rank + 1),), generator=gen)  # unequal batches
        assert torch.equal(t.gather(idx), want.index_select(0, idx)), f"distributed {dtype}: gather"
        mine = torch.arange(rank, shape[0], world).flip(0)
        t.scatter(mine, expected((mine.numel(), 3), dtype, salt=rank + 1))
        private = want.clone()
        for r in range(world):
            rows = torch.arange(r, shape[0], world).flip(0)
            private.index_copy_(0, rows, expected((rows.numel(), 3), dtype, salt=r + 1))
        every = torch.arange(shape[0])
        assert torch.equal(t.gather(every), private), f"distributed {dtype}: scatter"
        assert torch.equal(t.gather(torch.empty(0, dtype=torch.int64)), private[:0])
    # Batches that grow, shrink and vanish, one rank's far past its request slots while the
    # others' fit: the slots of each pair follow the counts on both ends.
    shape = (777, 5)
    t = group.create_tensor(shape, torch.float64, layout="distributed")
    want = expected(shape, torch.float64)
    local, (begin, end) = t.local()
    local.copy_(want[begin:end])
    gen = torch.Generator().manual_seed(100 + rank)
    for step, n in enumerate([300, 300, 2, 0, 5000 if rank == 0 else 3, 40, 40, 1, 700]):
        idx = torch.randint(0, shape[0], (n,), generator=gen)
        assert torch.equal(t.gather(idx), want.index_select(0, idx)), f"batch {step} of {n}"
    for step, n in enumerate([10, 300 if rank == 1 else 2, 0, 3]):
        for r in range(world):  # every rank's writes of this step, rows r, r + world, ...
            rows = torch.arange(r, shape[0], world)[: (300 if r == 1 else 2) if step == 1 else n]
            values = expected((rows.numel(), 5), torch.float64, salt=10 * step + r)
            if r == rank:
                t.scatter(rows, values)
            want.index_copy_(0, rows, values)
        assert torch.equal(t.gather(torch.arange(shape[0])), want), f"scatter step {step}"
    # One rank's bad index: every rank raises, none is left waiting in a collective.
    t = group.create_tensor((5, 2), torch.float32, layout="distributed")
    try:
        t.gather(torch.tensor([5 if rank == world - 1 else 0]))
        raise AssertionError("no IndexError")
    except IndexError as e:
        assert f"rank {world - 1} passed an index out of range" in str(e), str(e)
    # One rank's call refused for its arguments (values of another dtype): it raises its own
    # error, every other rank raises naming it, and the next calls pair up as before.
    try:
        t.scatter(torch.tensor([rank]), torch.ones(1, 2, dtype=torch.float64 if rank == 0
                                                   else torch.float32))
        raise AssertionError("no error")
    except TypeError as e:
        assert rank == 0, f"rank {rank}: {e}"
    except ValueError as e:
        assert rank != 0 and "rank 0 refused its gather or scatter" in str(e), str(e)
    # A failure after the checks, before the round (out of memory copying the values): the
    # same, not the other ranks waiting out their timeout.
    class CopyFails(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func is torch.Tensor.contiguous:
                raise RuntimeError("out of memory copying the values (injected)")
            return super().__torch_function__(func, types, args, kwargs or {})

    values = torch.ones(1, 2)
    try:
        t.scatter(torch.tensor([rank]), values.as_subclass(CopyFails) if rank == 1 else values)
        raise AssertionError("no error")
    except RuntimeError as e:
        assert rank == 1 and "injected" in str(e), f"rank {rank}: {e}"
    except ValueError as e:
        assert rank != 1 and "rank 1 refused its gather or scatter" in str(e), str(e)
    t.scatter(torch.tensor([rank]), torch.full((1, 2), float(rank)))
    got = t.gather(torch.arange(world))
    assert torch.equal(got[:, 0], torch.arange(world, dtype=torch.float32)), got
    # A rank whose tensor was closed still takes part in the round: it raises RuntimeError, the
    # others ValueError naming it (they waited in the all-to-all until it exited).
    u = group.create_tensor((4, 2), torch.float32, layout="distributed")
    if rank == world - 1:
        u.close()
    for call in (lambda: u.gather(torch.tensor([0])),
                 lambda: u.scatter(torch.tensor([0]), torch.ones(1, 2))):
        try:
            call()
            raise AssertionError("no error")
        except RuntimeError as e:
            assert rank == world - 1 and "closed" in str(e), f"rank {rank}: {e}"
        except ValueError as e:
            assert rank != world - 1, f"rank {rank}: {e}"
            assert f"rank {world - 1} refused its gather or scatter" in str(e), str(e)
    try:
        t.gather("rows" if rank == world - 1 else torch.tensor([0]))
        raise AssertionError("no error")
    except TypeError as e:
        assert rank == world - 1, f"rank {rank}: {e}"
    except ValueError as e:
        assert f"rank {world - 1} refused its gather or scatter" in str(e), str(e)
    try:
        group.create_tensor((5 + (rank == 0), 2), torch.float32, layout="distributed")
        raise AssertionError("no ValueError")
    except ValueError as e:
        assert "rank 0 asked for shape=[6,2]" in str(e), str(e)
    try:
        t.view()
        raise AssertionError("a whole view of a distributed tensor")
    except ValueError:
        pass
    group.close()
    try:
        t.gather(torch.tensor([0]))
        raise AssertionError("gather after close")
    except RuntimeError:
        pass
    result["socket"] = group._core.socket_name
    dist.destroy_process_group()


def scenario_files(group: shared.Group, result: dict[str, Any]) -> None:
    """load_files / store_files / load_checkpoint give back the source's bytes, every layout."""
    from safetensors.torch import save_file

    rank, world = group.rank, group.world_size
    outdir = os.environ["SHARED_TEST_DIR"]
    shape = (1001, 3)  # 12-byte rows: unaligned file offsets between partitions
    want = expected(shape, torch.float32)
    pieces = [want[:400], want[400:401], want[401:]]  # three files, cut anywhere
    paths = [os.path.join(outdir, f"rows{i}.bin") for i in range(3)]
    if rank == 0:
        for piece, path in zip(pieces, paths):
            piece.numpy().tofile(path)
        save_file({"other": torch.zeros(3), "feat": want, "tail": torch.ones(5)}, os.path.join(outdir, "ckpt.safetensors"))
        torch.save({"feat": want}, os.path.join(outdir, "ckpt.pt"))
    group.barrier()
    for layout in ("continuous", "chunked"):
        t = group.create_tensor(shape, torch.float32, layout=layout)
        t.load_files(paths)
        view = t.view()
        whole = view if isinstance(view, torch.Tensor) else torch.cat(view)
        assert torch.equal(whole, want), f"{layout}: load_files"
        names = t.store_files(os.path.join(outdir, f"store_{layout}"))
        u = group.create_tensor(shape, torch.float32, layout=layout)
        u.load_files(names)
        assert torch.equal(u.gather(torch.arange(shape[0])), want), f"{layout}: store/load"
        v = group.create_tensor(shape, torch.float32, layout=layout)
        v.load_checkpoint(os.path.join(outdir, "ckpt.safetensors"), "feat")
        assert torch.equal(v.gather(torch.arange(shape[0])), want), f"{layout}: checkpoint"
        for bad, exc in ((lambda: v.load_checkpoint(os.path.join(outdir, "ckpt.safetensors"), "other"), ValueError),
                         (lambda: v.load_checkpoint(os.path.join(outdir, "ckpt.safetensors"), "nope"), KeyError),
                         (lambda: v.load_checkpoint(os.path.join(outdir, "ckpt.pt"), "other"), KeyError),
                         (lambda: v.load_files(paths[:2]), ValueError)):
            try:
                bad()
                raise AssertionError("no error")
            except exc:
                pass
    result["socket"] = group._core.socket_name


def deflated_copy(src: str, dst: str) -> None:
    """`src` (a torch.save zip) rewritten with every entry compressed (deflate)."""
    import zipfile

    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info.filename))


def scenario_torch_checkpoints(group: shared.Group, result: dict[str, Any]) -> None:
    """load_checkpoint from torch.save files: every dtype, odd and tiny row counts (unequal and
    empty partitions), nested keys, a contiguous slice of a bigger storage; equal to
    torch.load(path)[key]. Strided tensors, compressed entries, legacy files and missing keys
    are refused on every rank."""
    rank = group.rank
    outdir = os.environ["SHARED_TEST_DIR"]
    path = os.path.join(outdir, "all.pt")
    shapes = [(1001, 3), (2, 5), (7,), (0, 3)]
    if rank == 0:
        state: dict[str, Any] = {}
        for dtype in DTYPES:
            for shape in shapes:
                state[f"{dtype}_{shape}".replace("torch.", "")] = expected(shape, dtype)
        base = expected((50, 4), torch.float32, salt=3)
        state["nested"] = {"emb": {"weight": expected((333, 2), torch.int64)}, "step": 7}
        state["slice"] = base[10:31]  # storage offset 40 elements, contiguous rows
        state["strided"] = base[:, :2]  # rows are not contiguous
        state["transposed"] = base.t()
        torch.save(state, path)
        deflated_copy(path, os.path.join(outdir, "deflated.pt"))
        torch.save({"x": torch.ones(4, 2)}, os.path.join(outdir, "legacy.pt"),
                   _use_new_zipfile_serialization=False)
    group.barrier()
    loaded = torch.load(path)
    for layout in ("continuous", "chunked"):
        for dtype in DTYPES:
            for shape in shapes:
                key = f"{dtype}_{shape}".replace("torch.", "")
                t = group.create_tensor(shape, dtype, layout=layout)
                t.load_checkpoint(path, key)
                got = t.gather(torch.arange(shape[0]))
                assert torch.equal(got, loaded[key]), f"{layout} {key}"
                t.close()
        for key, want in (("nested.emb.weight", loaded["nested"]["emb"]["weight"]), ("slice", loaded["slice"])):
            t = group.create_tensor(tuple(want.shape), want.dtype, layout=layout)
            t.load_checkpoint(path, key)
            assert torch.equal(t.gather(torch.arange(want.shape[0])), want), f"{layout} {key}"
            t.close()
    t = group.create_tensor((50, 2), torch.float32)
    for bad_key, says in (("strided", "do not give contiguous rows"), ("transposed", "do not give contiguous rows")):
        try:
            t.load_checkpoint(path, bad_key)
            raise AssertionError(f"{bad_key}: no error")
        except ValueError as e:
            assert f"'{bad_key}'" in str(e) and says in str(e), str(e)
    try:
        t.load_checkpoint(path, "float32_(7,)")  # another shape
        raise AssertionError("no error for another shape")
    except ValueError as e:
        assert "float32 of shape (7,)" in str(e), str(e)
    try:
        t.load_checkpoint(path, "nope")
        raise AssertionError("no KeyError")
    except KeyError as e:
        assert "'nope'" in e.args[0] and "'float32_(7,)'" in e.args[0] and "52 in all" in e.args[0], e.args[0]
    try:
        t.load_checkpoint(os.path.join(outdir, "deflated.pt"), "slice")
        raise AssertionError("a compressed entry was read")
    except ValueError as e:
        assert "'slice'" in str(e) and "compress" in str(e).lower(), str(e)
    try:
        t.load_checkpoint(os.path.join(outdir, "legacy.pt"), "x")
        raise AssertionError("a legacy file was read")
    except ValueError as e:
        assert "legacy" in str(e), str(e)
    result["socket"] = group._core.socket_name


def scenario_two_jobs(group_unused: Any, result: dict[str, Any]) -> None:
    """One of two jobs of 2 processes that meet through the same TCPStore (served by the test),
    job B starting its group after job A made its own and a tensor: each group's keys are its
    own (B's collectives never read A's), and B attaches A's named tensor. With
    SHARED_TEST_PRIVATE_GROUP set, job A's rank 0 first makes a group on another store (its
    other groups do not shift its keys on this store)."""
    job, rank = os.environ["SHARED_TEST_JOB"], int(os.environ["RANK"])
    host = _core.shared_env_store(False, None, 20.0)[0]  # the jobs' store, for the test's own keys
    if job == "A":
        if rank == 0 and os.environ.get("SHARED_TEST_PRIVATE_GROUP"):
            with shared.Group(rank=0, world_size=1, store=torch.distributed.HashStore(), timeout=5) as alone:
                alone.create_tensor((3,), torch.int8)
        group = shared.Group(timeout=20)
        a = group.create_tensor((10, 2), torch.float32, name="a_feat")
        local, (begin, end) = a.local()
        local.copy_(expected((10, 2), torch.float32)[begin:end])
        group.barrier()
        host.set(f"test/a_ready/{rank}", b"")
        host.wait(["test/b_done/0", "test/b_done/1"], datetime.timedelta(seconds=60))
        assert torch.equal(a.view(), expected((10, 2), torch.float32)), "job A's rows changed"
        group.barrier()  # A's own collectives still pair with A's
    else:
        host.wait(["test/a_ready/0", "test/a_ready/1"], datetime.timedelta(seconds=60))
        group = shared.Group(timeout=20)
        b = group.create_tensor((20, 3), torch.int64, layout="chunked", name="b_feat")
        local, (begin, end) = b.local()
        local.copy_(expected((20, 3), torch.int64, salt=5)[begin:end])
        group.barrier()
        assert torch.equal(torch.cat(b.view()), expected((20, 3), torch.int64, salt=5))
        a = group.attach("a_feat")  # made by the other job's group: attached from outside
        assert a.shape == (10, 2) and torch.equal(a.view(), expected((10, 2), torch.float32))
        group.barrier()
        host.set(f"test/b_done/{rank}", b"")
    result["socket"] = group._core.socket_name
    group.close()


def scenario_threads(group_unused: Any, result: dict[str, Any]) -> None:
    """Several threads of every rank gather and scatter one distributed tensor at once, each
    rank's calls pairing with whatever calls the other ranks make at that moment (a gather
    with a scatter, batches that outgrow their slots): every result is exact.

    Rows [0, 400) are read only; rows [400, 960) are split between the (rank, thread) pairs,
    each writing only its own; every thread writes the same values to rows [960, 1000). A
    thread reads back its own rows (its writes are done when its scatter returns)."""
    import threading

    import torch.distributed as dist

    threads, calls = 4, 24
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    group = shared.Group(timeout=60)
    rank, world = group.rank, group.world_size
    rows, cols = 1000, 3
    for dtype in (torch.float64, torch.int16):
        t = group.create_tensor((rows, cols), dtype, layout="distributed")
        want = expected((rows, cols), dtype)
        local, (begin, end) = t.local()
        local.copy_(want[begin:end])
        dist.barrier()
        common = torch.arange(960, 1000)
        common_values = expected((common.numel(), cols), dtype, salt=50)

        def owned(r: int, k: int) -> torch.Tensor:
            return torch.arange(400 + r * threads + k, 960, world * threads)

        def value(row_ids: torch.Tensor, step: int) -> torch.Tensor:
            return expected((row_ids.numel(), cols), dtype, salt=step) + row_ids[:, None].to(dtype)

        errors: list[str] = []

        def work(k: int) -> None:
            gen = torch.Generator().manual_seed(1000 * rank + k)
            mine = owned(rank, k)
            current = want.index_select(0, mine)
            for step in range(calls):
                try:
                    if step == calls - 1 or step % 3 == 2:
                        pick = torch.randperm(mine.numel(), generator=gen)[: 1 + step * 3]
                        if step == calls - 1:
                            pick = torch.arange(mine.numel())
                        new = value(mine[pick], step)
                        t.scatter(mine[pick], new)
                        current.index_copy_(0, pick, new)
                    elif step % 6 == 1:
                        t.scatter(common, common_values)
                    else:
                        n = [0, 5, 700, 40, 3000, 1][(step + k + rank) % 6]  # some outgrow slots
                        ro = torch.randint(0, 400, (n,), generator=gen)
                        pos = torch.randint(0, mine.numel(), (n // 4,), generator=gen)
                        got = t.gather(torch.cat([ro, mine[pos], common[:2]]))
                        assert torch.equal(got[:n], want.index_select(0, ro)), "read-only rows"
                        assert torch.equal(got[n : n + pos.numel()], current.index_select(0, pos)), "own rows"
                        for row, at in ((got[-2], 0), (got[-1], 1)):
                            assert torch.equal(row, want[960 + at]) or torch.equal(row, common_values[at]), "common rows"
                except BaseException as e:  # go on making calls: the other ranks wait for them
                    errors.append(f"thread {k} step {step}: {type(e).__name__}: {e}")

        pool = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
        for th in pool:
            th.start()
        for th in pool:
            th.join()
        assert not errors, "\n".join(errors[:5])
        dist.barrier()
        final = want.clone()
        final[960:] = common_values
        for r in range(world):
            for k in range(threads):
                ids = owned(r, k)
                final[ids] = value(ids, calls - 1)
        assert torch.equal(t.gather(torch.arange(rows)), final), f"{dtype}: final rows"
    result["socket"] = group._core.socket_name
    group.close()
    dist.destroy_process_group()


SCENARIOS: dict[str, Callable[[Any, dict[str, Any]], None]] = {
    "files": scenario_files,
    "torch_checkpoints": scenario_torch_checkpoints,
    "distributed": scenario_distributed,
    "layouts": scenario_layouts,
    "errors": scenario_errors,
    "seed": scenario_seed,
    "killed": scenario_killed,
    "store_host": scenario_store_host,
    "owners": scenario_owners,
    "attacher": scenario_attacher,
    "two_jobs": scenario_two_jobs,
    "threads": scenario_threads,
}


def run(scenario: str, outdir: str, rank: int | None = None, world: int | None = None, store: Any = None) -> None:
    result: dict[str, Any] = {"ok": False, "pid": os.getpid()}
    rank_for_file = rank if rank is not None else int(os.environ["RANK"])
    try:
        group = None
        if scenario not in ("seed", "distributed", "attacher", "two_jobs", "threads"):
            group = shared.Group(rank=rank, world_size=world, store=store, timeout=float(os.environ.get("SHARED_TEST_TIMEOUT", "20")))
        SCENARIOS[scenario](group, result)
        result["ok"] = True
    except BaseException as e:  # report everything, the test prints it
        result["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    with open(os.path.join(outdir, f"rank{rank_for_file}.json"), "w") as f:
        json.dump(result, f)


def spawn_entry(index: int, scenario: str, outdir: str, world: int, port: int) -> None:
    """torch.multiprocessing.spawn's target: the store is the test's TCPStore (a client here)."""
    import datetime

    store = torch.distributed.TCPStore("127.0.0.1", port, world, is_master=False, timeout=datetime.timedelta(seconds=30))
    run(scenario, outdir, rank=index, world=world, store=store)


class SlowStore(torch.distributed.Store):
    """A store whose reads each take 0.3 s longer, as a descheduled rank on a busy node sees."""

    def __init__(self, store: Any) -> None:
        super().__init__()
        self.store = store

    def set(self, key: str, value: Any) -> None:
        self.store.set(key, value)

    def get(self, key: str) -> bytes:
        import time

        time.sleep(0.3)
        return self.store.get(key)

    def add(self, key: str, amount: int) -> int:
        return self.store.add(key, amount)

    def wait(self, *args: Any) -> None:
        self.store.wait(*args)

    def check(self, *args: Any) -> bool:
        return self.store.check(*args)

    def set_timeout(self, timeout: Any) -> None:
        self.store.set_timeout(timeout)

    @property
    def timeout(self) -> Any:
        return self.store.timeout


def spawn_hosting_entry(index: int, outdir: str, world: int, port: int) -> None:
    """torch.multiprocessing.spawn's target for a job whose rank 0 serves the TCPStore it gives
    its group (as init_process_group's env:// rendezvous does): the job's last call is a
    barrier, which rank 0 leaves first, then exits; the other ranks read the store slowly."""
    import datetime

    result: dict[str, Any] = {"ok": False, "pid": os.getpid()}
    try:
        store = torch.distributed.TCPStore("127.0.0.1", port, world, is_master=index == 0,
                                           timeout=datetime.timedelta(seconds=30),
                                           wait_for_workers=False)
        group = shared.Group(rank=index, world_size=world,
                             store=store if index == 0 else SlowStore(store), timeout=30)
        group.create_tensor((1000, 8), torch.float32)
        group.barrier()
        result["ok"] = True
    except BaseException as e:  # report everything, the test prints it
        result["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    with open(os.path.join(outdir, f"rank{index}.json"), "w") as f:
        json.dump(result, f)


def fork_as_other(name: str, timeout: float = 30.0, attach_name: str | None = None) -> int:
    """Runs fetch_as_other (or, given `attach_name`, attach_as_other) in a forked child as user
    and group 65534; returns its exit code."""
    import time

    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            code = attach_as_other(attach_name) if attach_name else fetch_as_other(name)
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise AssertionError("the other user's process did not finish in time")
        time.sleep(0.05)


def attach_as_other(name: str) -> int:
    """Attaches `name` as this (other) user: 0 when refused with PermissionError."""
    try:
        shared.attach(name, timeout=10)
    except PermissionError:
        return 0
    return 1


def fetch_as_other(name: str) -> int:
    """Connects to a partition server as this (other) user: 0 when refused without a descriptor."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect("\0" + name)
    key = b"table"
    try:
        s.sendall(len(key).to_bytes(4, "little") + key)
        data, ancdata, _, _ = s.recvmsg(1, socket.CMSG_SPACE(4))
    except (ConnectionResetError, BrokenPipeError):
        return 0
    return 1 if data or ancdata else 0


def main(args: list[str]) -> None:
    """ranks.ForkServer's entry, in a rank forked from the server: ``run(scenario, outdir)``."""
    import tempfile

    tempfile.tempdir = None  # the job's TMPDIR, set after the server imported this module
    run(args[0], args[1])


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2])
