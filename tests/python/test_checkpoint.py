"""tensortier.save / load / load_into: round trips, alignment, compatibility with safetensors and
torch.save/torch.load, shard indexes, dtype and device options, load_into."""

from __future__ import annotations

import errno
import json
import os
import struct
import subprocess
import sys
import threading
import time
import warnings
import zipfile
import zlib
from pathlib import Path

import pytest
import torch

import internals
import tensortier
from tensortier import _core, IOHandle, checkpoint
from tensortier.checkpoint import _dtype, _format, _reading, loading_into, mapping

# scripts/setup.sh installs safetensors: a missing one must fail the suite, not skip it.
import safetensors.torch as st  # noqa: E402
from safetensors import safe_open  # noqa: E402

# Every dtype safetensors can store (and this torch has).
ST_DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint16, torch.uint32, torch.uint64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu,
]
# What safetensors.torch itself reads and writes (no E8M0 in its table).
ST_PACKAGE_DTYPES = [d for d in ST_DTYPES if d is not torch.float8_e8m0fnu]
TORCH_DTYPES = ST_DTYPES + [torch.complex128]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Random bytes viewed as `dtype` (every bit pattern, NaNs included); bool gets 0/1."""
    numel = 1
    for s in shape:
        numel *= s
    if dtype == torch.bool:
        return torch.randint(0, 2, shape).bool()
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN-safe)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().view(-1).view(torch.uint8),
                       b.contiguous().view(-1).view(torch.uint8))


def mixed_state_dict() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    sd = {f"t.{i}.{str(d).split('.')[-1]}": random_tensor((37 + i, 3), d)
          for i, d in enumerate(ST_DTYPES)}
    sd["big.weight"] = torch.randn(512, 1024)  # 2 MiB: page-multiple, own aligned buffer
    sd["big.bf16"] = torch.randn(1024, 1536).to(torch.bfloat16)
    sd["ids"] = torch.arange(5000, dtype=torch.int64)
    sd["scalar"] = torch.tensor(2.5)
    sd["empty"] = torch.empty(0, 4)
    sd["bias"] = torch.randn(7)
    return sd


@pytest.fixture(params=["threads", "auto", "staged"])
def io(request: pytest.FixtureRequest) -> IOHandle:
    """"staged": every direct read into new tensors goes through the engine's bounce buffers
    (and no read is served from the page cache, so the files just written are read direct)."""
    if request.param == "staged":
        handle = IOHandle("auto", chunk_size=256 << 10, stage_reads="on", page_cache_check=False)
    else:
        handle = IOHandle(request.param, chunk_size=256 << 10)
    with handle:
        yield handle


@pytest.fixture
def small_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """Exercise the grouping, staging and aligned-allocation paths with small tensors."""
    monkeypatch.setattr(_format, "_GROUP_BYTES", 64 << 10)
    monkeypatch.setattr(_format, "_STAGING_BYTES", 32 << 10)
    monkeypatch.setattr(_format, "_ALIGNED_ALLOC_MIN", 4096)


def header_of(path: Path) -> tuple[int, dict]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


# ---- safetensors -------------------------------------------------------------------------------


def test_safetensors_round_trip_every_dtype(io: IOHandle, disk_dir: Path, small_groups: None
                                            ) -> None:
    sd = mixed_state_dict()
    path = disk_dir / "m.safetensors"
    tensortier.save(sd, path, _io=io)
    out = tensortier.load(path, _io=io)
    assert set(out) == set(sd)
    for k in sd:
        assert same(out[k], sd[k]), k
    assert out["scalar"].shape == () and out["empty"].shape == (0, 4)


class _RecordingIO(IOHandle):
    """An IOHandle that keeps the stats of the reads of new tensors' large pieces it made: the
    pipeline's groups (``_core.read_pieces``, through `monkeypatch`) and its batch reads."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.reads: list[tensortier.IOFuture] = []
        self.group_stats: list[dict] = []
        real = _core.read_pieces
        mine = self._core()

        def spy(engine: object, *args: object, **kwargs: object) -> list[dict]:
            stats = real(engine, *args, **kwargs)
            if engine is mine:
                self.group_stats.extend(stats)
            return stats

        monkeypatch.setattr(_core, "read_pieces", spy)

    def pread_batch_async(self, pieces, *, stage_reads=False):  # type: ignore[no-untyped-def]
        fut = super().pread_batch_async(pieces, stage_reads=stage_reads)
        self.reads.append(fut)
        return fut

    def stats(self) -> list[dict]:
        return self.group_stats + [f.result().stats for f in self.reads]


def _drop_from_cache(path: Path) -> None:
    """Drops the file's pages from the page cache, so that the next load reads the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.parametrize("name", ["m.safetensors", "m.pt"])
def test_cold_cpu_loads_stage_reads_into_new_tensors(
    disk_dir: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loads to CPU ask the engine to stage their direct reads (new tensors are small-page
    memory); with staging on, the bytes come through bounce buffers and land exactly."""
    sd = mixed_state_dict()
    path = disk_dir / name
    tensortier.save(sd, path)
    _drop_from_cache(path)
    with _RecordingIO(monkeypatch, stage_reads="on", page_cache_check=False) as io:
        out = tensortier.load(path, _io=io)
        dst = {k: torch.zeros_like(v) for k, v in sd.items()}
        tensortier.load_into(dst, path, _io=io)
        stats = io.stats()
    assert all(same(out[k], sd[k]) and same(dst[k], sd[k]) for k in sd)
    # Every direct byte went through bounce buffers: for load's tensors (placed at their file
    # offset modulo the page) by staging; load_into's targets may break the O_DIRECT alignment
    # rules anyway, which bounces them with or without staging.
    assert len(stats) >= 2, stats
    assert all(st["bounced_bytes"] == st["direct_bytes"] > 0 for st in stats), stats
    assert stats[0]["staged_bytes"] > 0, stats[0]


@pytest.mark.parametrize("name", ["big.safetensors", "big.pt"])
def test_auto_staging_without_copy_threads_reads_straight_into_memory_never_touched(
    disk_dir: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With stage_reads="auto" and no copy threads, a load's new tensors that are fresh memory
    (40 MiB: beyond glibc's mmap threshold, a mapping of their own) are read into directly,
    never staged: the copy out of staging buffers would fault in every page on the engine's
    workers."""
    monkeypatch.setenv("TENSORTIER_COPY_THREADS", "0")
    sd = {"w": random_tensor(((40 << 20) // 2,), torch.bfloat16), "b": torch.randn(7)}
    path = disk_dir / name
    tensortier.save(sd, path)
    _drop_from_cache(path)
    with _RecordingIO(monkeypatch, stage_reads="auto", page_cache_check=False) as io:
        assert io.options["copy_threads"] == 0
        out = tensortier.load(path, _io=io)
        stats = io.stats()
    assert all(same(out[k], sd[k]) for k in sd)
    assert sum(st["direct_bytes"] for st in stats) >= 40 << 20, stats
    assert all(st["staged_bytes"] == 0 for st in stats), stats


@pytest.mark.parametrize("name", ["big.safetensors", "big.pt"])
def test_auto_staging_with_copy_threads_stages_memory_never_touched_where_the_disk_asks(
    disk_dir: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With copy threads (the default) the faults of the copy out are theirs: under "auto" a
    load's fresh tensors are staged exactly where the disk cuts direct reads into scattered
    memory short (the same files as with stage_reads="on", whose staging is the reference);
    the bytes land exactly either way."""
    monkeypatch.delenv("TENSORTIER_COPY_THREADS", raising=False)
    sd = {"w": random_tensor(((40 << 20) // 2,), torch.bfloat16), "b": torch.randn(7)}
    path = disk_dir / name
    tensortier.save(sd, path)
    staged = {}
    for mode in ("on", "auto"):
        _drop_from_cache(path)
        with _RecordingIO(monkeypatch, stage_reads=mode, page_cache_check=False) as io:
            assert io.options["copy_threads"] == 2
            out = tensortier.load(path, _io=io)
            stats = io.stats()
        assert all(same(out[k], sd[k]) for k in sd), mode
        staged[mode] = sum(st["staged_bytes"] for st in stats)
    assert staged["on"] >= 40 << 20, staged
    check = subprocess.run([str(Path(sys.executable).parent / "tensortier"), "check",
                            str(disk_dir)], capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stderr
    auto_stages = "STAGE_READS=auto): staged through the engine's bounce buffers, copied out by 2"
    assert staged["auto"] == (staged["on"] if auto_stages in check.stdout else 0), check.stdout


@pytest.mark.parametrize("stage_reads", ["auto", "on", "off"])
@pytest.mark.parametrize("name", ["ro.safetensors", "ro.pt"])
def test_load_into_read_only_memory_raises_efault(
    disk_dir: Path, tmp_path: Path, name: str, stage_reads: str
) -> None:
    """A target backed by a read-only mapping (its file in the page cache, so that it looks
    faulted in) fails with EFAULT naming the checkpoint, whether the read is staged, bounced or
    direct: the copy out of a bounce buffer must not kill the process."""
    import numpy as np

    n = 1 << 20
    path = disk_dir / name
    tensortier.save({"w": torch.ones(n, dtype=torch.uint8)}, path)
    backing = tmp_path / "backing.bin"
    backing.write_bytes(bytes(n))  # cached by this write
    array = np.memmap(backing, mode="r", shape=(n,), dtype=np.uint8)
    with warnings.catch_warnings():  # torch warns (once) that the array is not writable
        warnings.simplefilter("ignore", UserWarning)
        target = torch.from_numpy(array)
    with IOHandle(stage_reads=stage_reads, page_cache_check=False) as io:
        with pytest.raises(OSError) as err:
            tensortier.load_into({"w": target}, path, _io=io)
    assert err.value.errno == errno.EFAULT, err.value
    assert str(path) in str(err.value)
    assert not array.any()  # nothing written


def test_safetensors_alignment(disk_dir: Path) -> None:
    sd = mixed_state_dict()
    path = disk_dir / "m.safetensors"
    tensortier.save(sd, path)
    data_start, header = header_of(path)
    assert data_start % 4096 == 0
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    assert set(entries) == set(sd)
    spans = sorted(tuple(v["data_offsets"]) for v in entries.values())
    pos = 0
    for b, e in spans:  # tiles the data section, as the format requires
        assert b == pos
        pos = e
    assert os.path.getsize(path) == data_start + pos
    for k, v in entries.items():
        b, e = v["data_offsets"]
        if (e - b) % 4096 == 0:  # page-multiple tensors start on page boundaries
            assert (data_start + b) % 4096 == 0, k
        itemsize = sd[k].element_size()
        assert (data_start + b) % itemsize == 0, k  # everything naturally aligned


def test_safetensors_compat_both_ways(disk_dir: Path) -> None:
    sd = {k: v for k, v in mixed_state_dict().items()
          if v.dtype in ST_PACKAGE_DTYPES}
    ours = disk_dir / "ours.safetensors"
    tensortier.save(sd, ours, metadata={"format": "pt", "who": "tensortier"})
    theirs = st.load_file(ours)
    assert set(theirs) == set(sd)
    for k in sd:
        assert same(theirs[k], sd[k]), k
    with safe_open(ours, "pt") as f:
        assert f.metadata() == {"format": "pt", "who": "tensortier"}
    tensortier.save(sd, ours)
    with safe_open(ours, "pt") as f:
        assert f.metadata() == {"format": "pt"}  # added, as transformers expects it

    ref = disk_dir / "ref.safetensors"  # written by the safetensors package: not aligned
    st.save_file(sd, ref, metadata={"a": "b"})
    out = tensortier.load(ref)
    assert list(out) != [] and set(out) == set(sd)
    for k in sd:
        assert same(out[k], sd[k]), k


def test_safetensors_unaligned_writer(disk_dir: Path, small_groups: None) -> None:
    # A header whose length is not a multiple of 8 and odd-sized tensors: every offset unaligned.
    sd = {"a": torch.arange(3, dtype=torch.uint8), "b": torch.randn(3000),
          "c": torch.randint(0, 255, (100001,), dtype=torch.uint8)}
    header = {"a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
              "c": {"dtype": "U8", "shape": [100001], "data_offsets": [3, 100004]},
              "b": {"dtype": "F32", "shape": [3000], "data_offsets": [100004, 112004]}}
    text = json.dumps(header).encode() + b" "
    path = disk_dir / "odd.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for k in ("a", "c", "b"):
            f.write(sd[k].numpy().tobytes())
    assert st.load_file(path)["b"].equal(sd["b"])
    out = tensortier.load(path)
    for k in sd:
        assert same(out[k], sd[k]), k


def test_safetensors_non_contiguous_saved_contiguous(disk_dir: Path, small_groups: None) -> None:
    base = torch.randn(300, 200)
    sd = {"t": base.t(), "strided": torch.randn(100, 100)[::3, 1::2],
          "exp": torch.ones(5).expand(4, 5)}
    path = disk_dir / "nc.safetensors"
    tensortier.save(sd, path)
    out = tensortier.load(path)
    for k in sd:
        assert out[k].is_contiguous() and torch.equal(out[k], sd[k]), k
    assert torch.equal(st.load_file(path)["t"], sd["t"])


def test_safetensors_shared_tensors_refused(disk_dir: Path) -> None:
    w = torch.randn(10, 10)
    path = disk_dir / "s.safetensors"
    with pytest.raises(ValueError, match=r"share memory.*'a'.*'b'|share memory.*'b'.*'a'"):
        tensortier.save({"a": w, "b": w, "c": torch.zeros(2)}, path)
    with pytest.raises(ValueError, match="share memory"):
        tensortier.save({"a": w, "row": w[3]}, path)
    with pytest.raises(RuntimeError, match="share memory"):  # what safetensors' save_file raises
        tensortier.save({"a": w, "b": w}, path)
    assert not path.exists() and os.listdir(disk_dir) == []
    # disjoint views of one storage are fine (as in safetensors)
    tensortier.save({"top": w[:5], "bottom": w[5:]}, path)
    out = tensortier.load(path)
    assert torch.equal(out["top"], w[:5]) and torch.equal(out["bottom"], w[5:])


def test_safetensors_rejects_non_tensors(disk_dir: Path) -> None:
    path = disk_dir / "x.safetensors"
    with pytest.raises(TypeError, match="'step'.*format='torch'"):
        tensortier.save({"w": torch.ones(2), "step": 3}, path)
    with pytest.raises(TypeError, match="c128.*format='torch'"):
        tensortier.save({"c128": torch.ones(2, dtype=torch.complex128)}, path)
    with pytest.raises(TypeError, match="metadata"):
        tensortier.save({"w": torch.ones(2)}, path, metadata={"a": 1})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="format"):
        tensortier.save({"w": torch.ones(2)}, path, format="npz")
    assert os.listdir(disk_dir) == []


@pytest.mark.parametrize("name, fmt", [("checkpoint_latest", "torch"), ("model.pkl", "torch"),
                                       ("ckpt.pt.tmp", "torch"), ("epoch_3", "torch"),
                                       ("x.safetensors.tmp", "safetensors")])
def test_a_name_whose_suffix_names_no_format(disk_dir: Path, name: str, fmt: str) -> None:
    """torch.save writes any name: so does save, a torch file (what torch.load reads), unless
    the suffix before names a format (the temporary name of a save-then-rename)."""
    sd = {"w": torch.arange(6.0)}
    tensortier.save(sd, disk_dir / name)
    is_zip = (disk_dir / name).read_bytes()[:4] == b"PK\x03\x04"
    assert is_zip == (fmt == "torch")
    if fmt == "torch":
        assert torch.equal(torch.load(disk_dir / name, weights_only=True)["w"], sd["w"])
    else:
        assert torch.equal(st.load_file(str(disk_dir / name))["w"], sd["w"])
    assert torch.equal(tensortier.load(disk_dir / name)["w"], sd["w"])


def test_torch_save_and_load_options_code_passes_on(disk_dir: Path) -> None:
    """torch.save's pickle_protocol, pickle_module and zip-format flags, and torch.load's
    pickle_module and encoding, as code forwarding them to torch passes them: taken, or refused
    as torch would refuse them under weights_only."""
    import pickle

    path = disk_dir / "opts.pt"
    sd = {"w": torch.arange(4.0)}
    tensortier.save(sd, path, pickle_protocol=4, _use_new_zipfile_serialization=True,
                    _disable_byteorder_record=True, pickle_module=pickle)
    assert torch.equal(torch.load(path, weights_only=True)["w"], sd["w"])
    assert torch.equal(tensortier.load(path, encoding="latin1")["w"], sd["w"])
    with pytest.raises(ValueError, match="legacy"):
        tensortier.save(sd, path, _use_new_zipfile_serialization=False)
    with pytest.raises(ValueError, match="pickle_protocol"):
        tensortier.save(sd, path, pickle_protocol=1)
    with pytest.raises(ValueError, match="standard pickle module"):
        tensortier.save(sd, path, pickle_module=json)
    with pytest.raises(ValueError, match="weights_only=False"):  # torch.load would unpickle all
        tensortier.load(path, pickle_module=pickle)
    with pytest.raises(RuntimeError, match="explicit pickle_module"):
        tensortier.load(path, pickle_module=pickle, weights_only=True)
