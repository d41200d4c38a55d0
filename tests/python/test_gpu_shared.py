"""Shared tensors in device memory on a real GPU: two processes on one GPU (a FileStore between
them) create a tensor in device memory, write their own rows through CUDA views and read every
row; gathers and scatters match ``index_select``/``index_copy_``; host memory is registered with
CUDA and viewed from the GPU in place; the WholeMemory seed's ``is_host=False`` path runs.
Skipped without torch CUDA; scripts/gpu-test.sh requires them to run there."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from faults import require_faults

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda)"),
]

RANK_PROLOGUE = """
import os
import torch
import torch.distributed as dist
from tensortier import shared
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(0)
store = dist.FileStore(os.environ["STORE_PATH"], world)
group = shared.Group(rank=rank, world_size=world, store=store, timeout=60)
"""


def run_ranks(body: str, tmp_path: Path, world: int = 2) -> None:
    env = dict(os.environ, WORLD_SIZE=str(world), STORE_PATH=str(tmp_path / "store"))
    code = textwrap.dedent(RANK_PROLOGUE) + textwrap.dedent(body)
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=dict(env, RANK=str(r)),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(world)
    ]
    errors = []
    try:
        for r, p in enumerate(procs):
            _, err = p.communicate(timeout=240)
            if p.returncode != 0:
                errors.append(f"rank {r} exited {p.returncode}:\n{err[-3000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("layout", ["continuous", "chunked"])
def test_device_memory_shared_by_two_processes(tmp_path: Path, layout: str) -> None:
    run_ranks(
        f"""
        layout = {layout!r}
        for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.uint8):
            rows, cols = 100003, 7
            t = group.create_tensor((rows, cols), dtype, device="cuda", layout=layout)
            assert t.memory == "device" and t.stats["device"] == 0
            want = (torch.arange(rows * cols) % 97).to(dtype).reshape(rows, cols).cuda()
            local, (begin, end) = t.local()
            assert local.is_cuda and local.shape == (end - begin, cols)
            local.copy_(want[begin:end])
            torch.cuda.synchronize()
            group.barrier()
            view = t.view("cuda")
            whole = view if isinstance(view, torch.Tensor) else torch.cat(view)
            assert torch.equal(whole, want), (layout, dtype)
            idx = torch.randint(0, rows, (4099,), generator=torch.Generator().manual_seed(rank))
            assert torch.equal(t.gather(idx), want.index_select(0, idx.cuda()))
            group.barrier()
            if rank == 0:
                new = torch.full((len(idx), cols), 5).to(dtype).cuda()
                t.scatter(idx, new)
                want.index_copy_(0, idx.cuda(), new)
                torch.cuda.synchronize()
            group.barrier()
            if rank == 0:
                view = t.view("cuda")
                whole = view if isinstance(view, torch.Tensor) else torch.cat(view)
                assert torch.equal(whole, want), "scatter"
            group.barrier()
            t.close()
        group.close()
        """,
        tmp_path,
    )


def test_device_rows_go_to_and_from_files_through_a_bounded_host_slab(tmp_path: Path) -> None:
    """store_files and load_files of device rows move them a few rows at a time through one
    pinned host slab (made small here through the test seam: several slabs per rank, the last
    one short)."""
    require_faults()
    run_ranks(
        f"""
        from tensortier import _testing
        _testing.set_device_slab_bytes(4096)
        rows, cols = 1001, 7
        want = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols).cuda()
        t = group.create_tensor((rows, cols), torch.float32, device="cuda")
        local, (begin, end) = t.local()
        local.copy_(want[begin:end])
        torch.cuda.synchronize()
        names = t.store_files({str(tmp_path / "rows")!r})
        with open(names[rank], "rb") as f:
            assert f.read() == want[begin:end].cpu().numpy().tobytes(), "store_files"
        u = group.create_tensor((rows, cols), torch.float32, device="cuda")
        u.load_files(names)
        group.barrier()
        assert torch.equal(u.view("cuda"), want), "load_files"
        group.barrier()
        group.close()
        """,
        tmp_path,
    )


def test_registered_host_memory_viewed_from_the_gpu(tmp_path: Path) -> None:
    run_ranks(
        """
        t = group.create_tensor((4097, 3), torch.float32)
        assert t.stats["cuda_registered"], t.stats["cuda_registered_reason"]
        local, (begin, end) = t.local()
        local.copy_(torch.arange(begin, end, dtype=torch.float32).unsqueeze(1).expand(-1, 3))
        group.barrier()
        on_gpu = t.view("cuda")
        assert on_gpu.is_cuda and on_gpu.data_ptr() == t.view().data_ptr()
        assert torch.equal(on_gpu[:, 0].cpu(), torch.arange(4097, dtype=torch.float32))
        group.barrier()
        group.close()
        """,
        tmp_path,
    )


def test_wholememory_device_memory(tmp_path: Path) -> None:
    run_ranks(
        """
        from tensortier.compat import wholememory as wm
        wm.init_lib()
        wm.mp_init(rank, world, store=store)
        t = wm.create_tensor([1001, 4], [], torch.float32, False, [])
        assert t.is_cuda and t.shape == (1001, 4)
        if rank == 1:
            t[1000] = 3.0
        torch.cuda.synchronize()
        store.set(f"written{rank}", "1")
        store.wait(["written0", "written1"])
        view = wm.get_tensor_view(t, torch.device("cuda:0"))
        assert view.data_ptr() == t.data_ptr() and view[1000, 0].item() == 3.0
        wm.finalize_lib()
        """,
        tmp_path,
    )


def test_wholememory_seed_example_in_device_memory(tmp_path: Path) -> None:
    examples = Path(__file__).resolve().parents[2] / "examples" / "shared"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(examples / "wholememory_seed.py"), "--rows", "1000", "--device"],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "written by ranks [0, 1, 0, 1]" in proc.stdout, proc.stdout
