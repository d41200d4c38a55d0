"""tensortier.save / load / load_into: round trips, alignment, compatibility with safetensors and
torch.save/torch.load, shard indexes, dtype and device options, load_into."""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
import subprocess
import sys
import threading
import time
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import Any

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


def test_metadata_kept_and_checksums_in_metadata(disk_dir: Path) -> None:
    sd = {"w": torch.randn(100), "b": torch.zeros(0)}
    path = disk_dir / "m.safetensors"
    tensortier.save(sd, path, metadata={"step": "12", "note": "ünïcode"}, checksum=True)
    _, header = header_of(path)
    md = header["__metadata__"]
    assert md["step"] == "12" and md["note"] == "ünïcode"
    sums = json.loads(md[checkpoint.CHECKSUM_KEY])
    assert set(sums) == {"w", "b"}
    assert all(len(v) == 16 for v in sums.values())
    assert int(sums["w"], 16) == tensortier._core.xxh64(sd["w"].numpy())
    assert int(sums["b"], 16) == tensortier._core.xxh64(b"")
    assert tensortier.load(path, verify=True)["w"].equal(sd["w"])


@pytest.mark.parametrize("name", ["m.safetensors", "m.pt"])
def test_filesystem_without_o_direct(no_direct_dir: Path, name: str) -> None:
    sd = mixed_state_dict()
    path = no_direct_dir / name
    tensortier.save(sd, path, checksum=True)
    out = tensortier.load(path, verify=True)
    for k in sd:
        assert same(out[k], sd[k]), k
    target = {k: torch.empty_like(v) for k, v in sd.items()}
    tensortier.load_into(target, path, verify=True)
    assert all(same(target[k], sd[k]) for k in sd)


# ---- torch format ------------------------------------------------------------------------------


def test_torch_round_trip_every_dtype(io: IOHandle, disk_dir: Path, small_groups: None) -> None:
    sd = {str(d): random_tensor((41, 5), d) for d in TORCH_DTYPES}
    sd["scalar"] = torch.tensor(7, dtype=torch.int64)
    sd["empty"] = torch.empty(0, 3, dtype=torch.bfloat16)
    sd["big"] = torch.randn(300, 1000)
    path = disk_dir / "m.pt"
    tensortier.save(sd, path, _io=io)
    for out in (tensortier.load(path, _io=io), torch.load(path, weights_only=True)):
        assert set(out) == set(sd)
        for k in sd:
            assert same(out[k], sd[k]), k


def test_torch_structure_sharing_and_alignment(disk_dir: Path, small_groups: None) -> None:
    emb = torch.randn(1000, 64)
    sd = {
        "model": {"emb.weight": emb, "head.weight": emb, "row": emb[10], "tr": emb.t()},
        "optimizer": {"step": 10, "lr": 1e-3, "betas": (0.9, 0.999), "names": ["a", "b"],
                      "state": {0: {"exp_avg": torch.zeros(3)}}, "none": None, "flag": True},
        "epoch": 3,
        "param": torch.nn.Parameter(torch.randn(4)),
    }
    path = disk_dir / "ckpt.pt"
    tensortier.save(sd, path)
    for out in (tensortier.load(path), torch.load(path, weights_only=True)):
        m = out["model"]
        assert torch.equal(m["emb.weight"], emb) and torch.equal(m["tr"], emb.t())
        ptr = m["emb.weight"].untyped_storage().data_ptr()
        assert all(m[k].untyped_storage().data_ptr() == ptr for k in m)  # still shared
        assert m["row"].storage_offset() == 10 * 64 and torch.equal(m["row"], emb[10])
        assert out["optimizer"]["betas"] == (0.9, 0.999)
        assert out["optimizer"]["state"][0]["exp_avg"].equal(torch.zeros(3))
        assert {k: out["optimizer"][k] for k in ("step", "lr", "names", "none", "flag")} == {
            "step": 10, "lr": 1e-3, "names": ["a", "b"], "none": None, "flag": True}
        assert out["epoch"] == 3
        assert isinstance(out["param"], torch.nn.Parameter) and out["param"].equal(sd["param"])
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None  # real CRCs by default, as torch.save writes
        for info in z.infolist():
            if "/data/" in info.filename:
                with open(path, "rb") as f:
                    f.seek(info.header_offset + 26)
                    n, x = struct.unpack("<HH", f.read(4))
                assert (info.header_offset + 30 + n + x) % 4096 == 0, info.filename
                assert info.compress_type == zipfile.ZIP_STORED


def test_torch_compat_torch_save_to_load(disk_dir: Path) -> None:
    sd = {"a": torch.randn(100, 3), "b": [torch.arange(4), {"c": "text"}], "d": torch.ones(2)}
    sd["view"] = sd["a"][5:]
    path = disk_dir / "ref.pt"
    torch.save(sd, path)  # 64-byte storage alignment, CRCs
    out = tensortier.load(path, verify=True)
    assert torch.equal(out["a"], sd["a"]) and torch.equal(out["b"][0], sd["b"][0])
    assert out["b"][1] == {"c": "text"}
    assert out["view"].untyped_storage().data_ptr() == out["a"].untyped_storage().data_ptr()
    # a single tensor, not a dict
    torch.save(torch.arange(10), disk_dir / "t.pt")
    assert torch.equal(tensortier.load(disk_dir / "t.pt"), torch.arange(10))


def test_torch_checksums_are_zip_crcs(disk_dir: Path) -> None:
    # Sizes around the CRC's folded path (256 bytes, 64-byte strides) and a multi-MiB one.
    sd = {"a": torch.randn(1000), "b": torch.arange(100), "c": torch.randn(3 << 20),
          "d": torch.ones(257, dtype=torch.uint8), "e": torch.zeros(0)}
    for checksum in (True, False):  # CRCs by default, as torch.save writes them
        path = disk_dir / f"c{checksum}.pt"
        tensortier.save(sd, path, checksum=checksum)
        with zipfile.ZipFile(path) as z:
            assert z.testzip() is None  # every CRC right, data descriptors included
            for info in z.infolist():
                assert info.CRC == zlib.crc32(z.read(info)), info.filename
        tensortier.load(path, verify=True)


def test_torch_crcs_follow_torchs_crc32_option(disk_dir: Path) -> None:
    if not hasattr(torch.serialization, "set_crc32_options"):
        pytest.skip(f"torch {torch.__version__} has no set_crc32_options")
    sd = {"a": torch.randn(1000)}
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        plain = disk_dir / "plain.pt"
        tensortier.save(sd, plain)  # as torch.save then: no CRCs, so nothing to verify
        with pytest.raises(ValueError, match="no CRC-32"):
            tensortier.load(plain, verify=True)
        forced = disk_dir / "forced.pt"
        tensortier.save({**sd, "step": 12345}, forced, checksum=True)
        assert tensortier.load(forced, verify=True)["a"].equal(sd["a"])
        with zipfile.ZipFile(forced) as z:
            assert z.testzip() is None  # data.pkl and torch's other records too
            assert all(info.CRC != 0 for info in z.infolist())
    finally:
        torch.serialization.set_crc32_options(before)


# ---- options -------------------------------------------------------------------------------------


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_dtype_conversion_frees_each_original_once_converted(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Converting a loaded checkpoint needs room for one more group of tensors, not a second
    copy of all of them (on a GPU, a 60 GB fp32 checkpoint loaded as bf16 must not need 90 GB).
    safetensors files are read ~64 MiB at a time, each group converted before the next is read:
    memory holds the converted tensors plus one group. torch files (storages may be shared)
    are read whole, then converted a tensor at a time: memory must not grow from one
    conversion to the next."""

    mib = 1 << 20
    sd = {f"w{i}": torch.randn(16 * mib + i) for i in range(8)}  # 64 MiB each
    sd["tied"] = sd["w0"]  # one tensor under two names: loaded as one, converted once
    resident: list[int] = []
    real_convert = internals._convert

    def measuring_convert(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        resident.append(_resident_bytes())
        return real_convert(t, dtype)

    monkeypatch.setattr(_dtype, "_convert", measuring_convert)
    for name in ("c.safetensors", "c.pt"):
        if name.endswith(".pt"):
            tensortier.save(sd, disk_dir / name)
        else:
            tensortier.save({k: v for k, v in sd.items() if k != "tied"}, disk_dir / name)
        tensortier.load(disk_dir / name)  # the engine's buffers made, the pages cached
        resident.clear()
        before = _resident_bytes()
        out = tensortier.load(disk_dir / name, dtype=torch.bfloat16)
        steps = [(r - before) // mib for r in resident]
        assert len(resident) == 8, name
        if name.endswith(".safetensors"):
            # At step k: k converted tensors (32 MiB each) and the original being converted;
            # reading all originals first would hold 512 MiB at the first step.
            assert max(resident) - before <= 7 * 32 * mib + 64 * mib + 64 * mib, (name, steps)
        else:
            # Each step frees a 64 MiB original and makes a 32 MiB copy; keeping the
            # originals would grow by 32 MiB a step (224 MiB by the last).
            assert resident[-1] <= resident[0] + 32 * mib, (name, steps)
        for k, v in out.items():
            assert v.dtype == torch.bfloat16 and torch.equal(v, sd[k].bfloat16()), (name, k)
        if name.endswith(".pt"):
            assert out["tied"] is out["w0"]
        del out


def test_convert_in_place_keeps_shared_objects_shared() -> None:

    t = torch.randn(4)
    inner = [t, torch.arange(3)]
    obj = {"a": t, "b": inner, "c": (t, inner), "d": inner, "s": "text"}
    out = internals._convert_in_place(obj, torch.float16)
    assert out is obj and out["b"] is inner and out["d"] is inner and out["c"][1] is inner
    assert out["a"].dtype == torch.float16 and out["a"] is out["b"][0] is out["c"][0]
    assert out["b"][1].dtype == torch.int64 and out["s"] == "text"


def test_dtype_conversion(disk_dir: Path) -> None:
    sd = {"w": torch.randn(10), "h": torch.randn(3).half(), "i": torch.arange(3),
          "m": torch.tensor([True, False]), "c": torch.ones(2, dtype=torch.complex64)}
    for name in ("m.safetensors", "m.pt"):
        tensortier.save(sd, disk_dir / name)
        out = tensortier.load(disk_dir / name, dtype=torch.bfloat16)
        assert out["w"].dtype == torch.bfloat16 and torch.equal(out["w"], sd["w"].bfloat16())
        assert out["h"].dtype == torch.bfloat16
        assert out["i"].dtype == torch.int64 and out["m"].dtype == torch.bool
        assert out["c"].dtype == torch.complex64
    with pytest.raises(TypeError, match="dtype"):
        tensortier.load(disk_dir / "m.pt", dtype="float16")


def test_loaded_tensors_own_exact_page_placed_storages(disk_dir: Path) -> None:
    """Large loaded tensors sit at file offset mod page (read O_DIRECT, no bounce), each in a
    storage of exactly its bytes that outlives everything else, and save again normally."""
    import gc

    from safetensors.torch import load_file, save_file

    sd = {"big": torch.randn(300_000), "odd": torch.randn(262_145).double(),
          "small": torch.arange(5)}
    tensortier.save(sd, disk_dir / "m.safetensors")
    entries, _ = internals._read_st_header(str(disk_dir / "m.safetensors"))
    out = tensortier.load(disk_dir / "m.safetensors")
    for e in entries:
        t = out[e.name]
        assert t.untyped_storage().nbytes() == e.nbytes, e.name
        if e.nbytes >= _format._ALIGNED_ALLOC_MIN:
            assert t.data_ptr() % 4096 == e.offset % 4096, e.name
    gc.collect()
    out["big"].add_(1)
    assert torch.equal(out["big"], sd["big"] + 1)
    save_file(out, str(disk_dir / "again.safetensors"))
    torch.save(out, disk_dir / "again.pt")
    assert torch.equal(load_file(str(disk_dir / "again.safetensors"))["odd"], sd["odd"])
    assert torch.equal(torch.load(disk_dir / "again.pt", weights_only=True)["odd"], sd["odd"])


def test_dtype_conversion_keeps_state_dict_metadata(disk_dir: Path) -> None:
    """module.state_dict() carries `_metadata` (module versions load_state_dict uses)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    tensortier.save(model.state_dict(), disk_dir / "m.pt")
    want = torch.load(disk_dir / "m.pt", weights_only=True)._metadata
    for dtype in (None, torch.bfloat16):
        out = tensortier.load(disk_dir / "m.pt", dtype=dtype)
        assert out._metadata == want and out._metadata["1"]["version"] == 2
    model.load_state_dict(tensortier.load(disk_dir / "m.pt", dtype=torch.float32))


def test_cuda_without_gpu_is_a_clear_error(disk_dir: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    tensortier.save({"w": torch.ones(2)}, disk_dir / "m.safetensors")
    with pytest.raises(ValueError, match="CUDA is not available.*device='cpu'"):
        tensortier.load(disk_dir / "m.safetensors", device="cuda:0")
    with pytest.raises(ValueError, match="not supported"):
        tensortier.load(disk_dir / "m.safetensors", device="mps")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_load_to_cuda(disk_dir: Path, small_groups: None) -> None:
    sd = mixed_state_dict()
    sd["huge"] = torch.randn(3 << 20)  # 12 MiB: several pinned-buffer chunks
    for name in ("m.safetensors", "m.pt"):
        tensortier.save(sd, disk_dir / name, checksum=True)
        for verify in (False, True):
            out = tensortier.load(disk_dir / name, device="cuda:0", verify=verify)
            for k in sd:
                assert out[k].device.type == "cuda", k
                assert same(out[k].cpu(), sd[k]), k


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_load_to_cuda_with_dtype_peaks_at_the_converted_bytes_plus_a_group(
    disk_dir: Path,
) -> None:
    """An fp32 file loaded as bf16 onto the GPU: GPU memory holds the bf16 tensors plus one
    ~64 MiB group of fp32 originals, never the whole file in fp32."""
    mib = 1 << 20
    sd = {f"w{i}": torch.randn(16 * mib + i) for i in range(8)}  # 64 MiB each
    sd["ids"] = torch.arange(1000)  # int64: kept as saved
    tensortier.save(sd, disk_dir / "m.safetensors")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = tensortier.load(disk_dir / "m.safetensors", device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    converted = sum(v.numel() * v.element_size() for v in out.values())
    assert converted < 8 * 32 * mib + mib
    peak = torch.cuda.max_memory_allocated() - base
    assert peak <= converted + 64 * mib + 4 * mib, (peak // mib, converted // mib)
    for k, v in sd.items():
        want = v.bfloat16() if v.is_floating_point() else v
        assert out[k].dtype == want.dtype and torch.equal(out[k].cpu(), want), k


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_load_into_cuda_module(disk_dir: Path) -> None:
    src = torch.nn.Linear(64, 32)
    tensortier.save(src.state_dict(), disk_dir / "m.safetensors")
    dst = torch.nn.Linear(64, 32).cuda()
    tensortier.load_into(dst, disk_dir / "m.safetensors")
    assert torch.equal(dst.weight.cpu(), src.weight.detach())


class _FakeStream:
    created: list[_FakeStream] = []
    current = object()  # what the fake torch.cuda.current_stream returns

    def __init__(self, device: object = None) -> None:
        self.waited_for: list[object] = []
        _FakeStream.created.append(self)

    def wait_stream(self, other: object) -> None:
        self.waited_for.append(other)

    def synchronize(self) -> None:
        pass


class _FakeEvent:
    def record(self, stream: object = None) -> None:
        pass

    def synchronize(self) -> None:
        pass


def test_device_staging_logic_on_cpu(disk_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pinned-buffer path of verified CUDA loads (page skew, checksums, two buffers in
    turn), run with CPU stand-ins for the pinned buffers, streams and events, so it is tested
    without a GPU."""
    import contextlib

    monkeypatch.setattr(_reading, "_pinned_buffer", lambda n: tensortier.aligned_empty(n))
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _FakeStream.current)
    _FakeStream.created.clear()
    sd = {"odd": torch.arange(3, dtype=torch.uint8), "big": torch.randn(100000),
          "empty": torch.empty(0), "mid": torch.randn(5000).double()}
    path = disk_dir / "m.safetensors"
    tensortier.save(sd, path, checksum=True)
    entries, metadata = internals._read_st_header(str(path))
    sums = internals._parse_checksums(str(path), metadata, [e.name for e in entries])
    io = internals._default_io()
    f = io.open(path, "r")
    out = {e.name: torch.full((e.nbytes // e.dtype.itemsize,), 7, dtype=torch.uint8).view(e.dtype)
           if e.dtype.itemsize == 1 else torch.zeros(e.nbytes // e.dtype.itemsize, dtype=e.dtype)
           for e in entries}
    pieces = [internals._Piece(e.name, f, e.offset, e.nbytes, out[e.name],
                                ("xxh64", sums[e.name]))
              for e in entries]
    progress = internals._Progress("x", sum(p.nbytes for p in pieces), False)
    internals._read_device_checked(io, pieces, progress, str(path))
    assert progress.done == sum(p.nbytes for p in pieces)
    # The copy stream waits for the current stream (where the destinations were allocated).
    assert [s.waited_for for s in _FakeStream.created] == [[_FakeStream.current]]
    for e in entries:
        assert same(out[e.name].view(e.shape), sd[e.name]), e.name


def test_progress_bar(disk_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tensortier.save({"w": torch.randn(1000)}, disk_dir / "m.safetensors")
    tensortier.load(disk_dir / "m.safetensors")  # stderr is not a TTY: no bar
    assert capsys.readouterr().err == ""
    tensortier.load(disk_dir / "m.safetensors", progress=True)
    err = capsys.readouterr().err
    assert "loading m.safetensors" in err and err.count("100.0%") == 1, err
    assert err.endswith("\n")


def test_a_progress_bar_without_stderr_is_not_shown(
        disk_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pythonw, or a daemon started with 2>&-: sys.stderr is None."""
    tensortier.save({"w": torch.randn(1000)}, disk_dir / "m.pt")
    monkeypatch.setattr(sys, "stderr", None)
    assert torch.equal(tensortier.load(disk_dir / "m.pt", progress=True)["w"],
                       torch.load(disk_dir / "m.pt")["w"])


# ---- shard indexes ---------------------------------------------------------------------------


def make_shards(d: Path, fmt: str = "safetensors") -> dict[str, torch.Tensor]:
    sd = {f"layer.{i}.weight": torch.randn(64, 16) for i in range(6)}
    names = list(sd)
    weight_map = {}
    for s, chunk in enumerate((names[:3], names[3:])):
        ext = "safetensors" if fmt == "safetensors" else "bin"
        shard = f"model-{s + 1:05d}-of-00002.{ext}"
        part = {k: sd[k] for k in chunk}
        if fmt == "safetensors":
            st.save_file(part, d / shard)
        else:
            torch.save(part, d / shard)
        weight_map.update({k: shard for k in chunk})
    idx = d / f"model.{'safetensors' if fmt == 'safetensors' else 'bin'}.index.json"
    index = {"metadata": {"total_size": 6 * 64 * 16 * 4}, "weight_map": weight_map}
    idx.write_text(json.dumps(index))
    return sd


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_an_index_replaced_while_read_is_read_as_one_version(
        disk_dir: Path, fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model directory another process saves again (swapped in by one rename) after the
    first shard was read: every shard comes from the version whose index was read, not a mix."""
    from tensortier.checkpoint import loading

    old, new = disk_dir / "m", disk_dir / "m.new"
    old.mkdir()
    new.mkdir()
    torch.manual_seed(0)
    want = make_shards(old, fmt)
    torch.manual_seed(1)
    make_shards(new, fmt)
    real = loading._load_kind
    swapped: list[bool] = []

    def load_kind(path: str, kind: str, *args: Any) -> Any:
        out = real(path, kind, *args)
        if kind != "index" and not swapped:  # after the first shard: the other version in
            os.rename(old, disk_dir / "m.old")
            os.rename(new, old)
            swapped.append(True)
        return out

    monkeypatch.setattr(loading, "_load_kind", load_kind)
    out = tensortier.load(next(old.glob("*.index.json")))
    assert swapped
    assert all(torch.equal(out[k], want[k]) for k in want)


def _swap_after_the_first_shard(monkeypatch: pytest.MonkeyPatch, old: Path,
                                new: Path) -> list[str]:
    """Makes the load swap directory `new` in for `old` (by renames, as a save does) once it
    has read its first shard; returns the shards it reads, in order."""
    from tensortier.checkpoint import loading

    real = loading._load_kind
    shards_read: list[str] = []

    def load_kind(path: str, kind: str, *args: Any) -> Any:
        out = real(path, kind, *args)
        if kind != "index":
            shards_read.append(path)
            if len(shards_read) == 1:
                os.rename(old, old.parent / "m.old")
                os.rename(new, old)
        return out

    monkeypatch.setattr(loading, "_load_kind", load_kind)
    return shards_read


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_an_index_of_more_shards_than_held_open_replaced_while_read_is_read_again(
        disk_dir: Path, fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An index of more shards than are opened together (each opened as it is read), its
    directory saved again after the first shard was read: the second shard read is the new
    version's, so the index is read again and the load is the new version whole."""
    from tensortier.checkpoint import _reading

    monkeypatch.setattr(_reading, "_MAX_PREOPENED", 1)
    old, new = disk_dir / "m", disk_dir / "m.new"
    old.mkdir()
    new.mkdir()
    torch.manual_seed(0)
    make_shards(old, fmt)
    torch.manual_seed(1)
    want = make_shards(new, fmt)
    shards_read = _swap_after_the_first_shard(monkeypatch, old, new)
    out = tensortier.load(next(old.glob("*.index.json")))
    assert len(shards_read) == 4  # two shards, twice
    assert out.keys() == want.keys() and all(torch.equal(out[k], want[k]) for k in want)


def test_an_index_of_more_shards_than_held_open_split_otherwise_is_read_again(
        disk_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same with a save that splits the tensors otherwise under the same shard names: the
    second shard read lacks what the old index puts there; the index is read again."""
    from safetensors.torch import save_file

    from tensortier.checkpoint import _reading

    monkeypatch.setattr(_reading, "_MAX_PREOPENED", 1)
    old, new = disk_dir / "m", disk_dir / "m.new"
    for d, split in ((old, [["a"], ["b"]]), (new, [["a", "b"], ["c"]])):
        d.mkdir()
        weight_map = {}
        for i, names in enumerate(split):
            shard = f"model-{i + 1:05d}-of-00002.safetensors"
            save_file({n: torch.full((3,), float(ord(n) + len(d.name))) for n in names},
                      str(d / shard))
            weight_map.update({n: shard for n in names})
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    shards_read = _swap_after_the_first_shard(monkeypatch, old, new)
    out = tensortier.load(old / "model.safetensors.index.json")
    assert sorted(out) == ["a", "b", "c"]
    assert all(torch.equal(out[n], torch.full((3,), float(ord(n) + len("m.new")))) for n in out)


def test_an_index_of_more_shards_than_held_open_whose_shards_went_is_read_again(
        disk_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same with a save whose shards have other names: the second shard is gone when it
    is read; the index is read again, not a FileNotFoundError."""
    from tensortier.checkpoint import _reading

    monkeypatch.setattr(_reading, "_MAX_PREOPENED", 1)
    old, new = disk_dir / "m", disk_dir / "m.new"
    old.mkdir()
    new.mkdir()
    torch.manual_seed(0)
    make_shards(old)
    torch.manual_seed(1)
    want = make_shards(new)
    for shard in sorted(new.glob("*.safetensors")):
        shard.rename(new / shard.name.replace("of-00002", "of-00009"))
    idx = new / "model.safetensors.index.json"
    idx.write_text(idx.read_text().replace("of-00002", "of-00009"))
    shards_read = _swap_after_the_first_shard(monkeypatch, old, new)
    out = tensortier.load(old / "model.safetensors.index.json")
    assert len(shards_read) == 3  # one of the old shards, then the two new ones
    assert out.keys() == want.keys() and all(torch.equal(out[k], want[k]) for k in want)


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_an_index_replaced_while_its_shards_were_opened_is_read_again(
        disk_dir: Path, fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save swapped in after the first shard was opened and before the second: the shards
    held are of two versions. The index is read again, and the load is the new version whole."""
    old, new = disk_dir / "m", disk_dir / "m.new"
    old.mkdir()
    new.mkdir()
    torch.manual_seed(0)
    make_shards(old, fmt)
    torch.manual_seed(1)
    want = make_shards(new, fmt)
    from tensortier._runtime import default_io

    opened: list[str] = []
    io = default_io()
    real = io._file_system

    class SwappingFileSystem:
        def __init__(self) -> None:
            self._real = real

        def __getattr__(self, name: str) -> Any:
            return getattr(self._real, name)

        def open(self, path: str, *args: Any) -> Any:
            file = self._real.open(path, *args)
            opened.append(path)
            if len(opened) == 1:
                os.rename(old, disk_dir / "m.old")
                os.rename(new, old)
            return file

    monkeypatch.setattr(io, "_file_system", SwappingFileSystem())
    out = tensortier.load(next(old.glob("*.index.json")))
    assert len(opened) == 4  # two shards, twice
    assert out.keys() == want.keys() and all(torch.equal(out[k], want[k]) for k in want)


def test_an_index_replaced_by_one_of_other_shard_names_is_read_again(
        disk_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save whose shards have other names (three shards where there were two) swapped in
    after the index was read: its shards are not there; the index is read again."""
    from tensortier.checkpoint import loading

    old, new = disk_dir / "m", disk_dir / "m.new"
    old.mkdir()
    new.mkdir()
    torch.manual_seed(0)
    make_shards(old)
    torch.manual_seed(1)
    want = make_shards(new)
    for shard in sorted(new.glob("*.safetensors")):  # other names, the same tensors
        shard.rename(new / shard.name.replace("of-00002", "of-00009"))
    idx = new / "model.safetensors.index.json"
    idx.write_text(idx.read_text().replace("of-00002", "of-00009"))
    real = _core.shard_index_walk
    walked: list[bool] = []

    def walk(path: str) -> Any:
        out = real(path)
        if not walked:
            os.rename(old, disk_dir / "m.old")
            os.rename(new, old)
        walked.append(True)
        return out

    monkeypatch.setattr(_core, "shard_index_walk", walk)
    out = tensortier.load(old / "model.safetensors.index.json")
    assert len(walked) == 2
    assert out.keys() == want.keys() and all(torch.equal(out[k], want[k]) for k in want)


def test_an_index_replaced_at_every_opening_is_an_error_naming_it(
        disk_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Saves that keep replacing the directory while it is opened: after three tries, an
    OSError (EAGAIN) naming the index, never a mix."""
    from tensortier.checkpoint import loading

    d = disk_dir / "m"
    d.mkdir()
    make_shards(d)
    idx = next(d.glob("*.index.json"))
    real = loading._opened_together

    def opened_together(io: Any, paths: Any) -> Any:
        os.replace(idx, disk_dir / "i.json")  # the same bytes under a new inode
        shutil.copyfile(disk_dir / "i.json", idx)
        return real(io, paths)

    monkeypatch.setattr(loading, "_opened_together", opened_together)
    with pytest.raises(OSError, match="replaced by another save") as e:
        tensortier.load(idx)
    assert e.value.errno == errno.EAGAIN and str(idx) in str(e.value)


def test_an_index_of_more_shards_than_descriptors_left_is_read_one_by_one(
        disk_dir: Path) -> None:
    """An index of fewer shards than are opened together, but more than the process has
    descriptors left (a low RLIMIT_NOFILE): its shards are opened as they are read, not an
    EMFILE failure."""
    from safetensors.torch import save_file

    weight_map = {}
    for i in range(60):
        save_file({f"t{i}": torch.full((3,), float(i))}, str(disk_dir / f"s{i}.safetensors"))
        weight_map[f"t{i}"] = f"s{i}.safetensors"
    index = disk_dir / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": weight_map}))
    code = (
        "import os, resource, sys, tensortier\n"
        "tensortier.load(sys.argv[1])  # the engine's own descriptors are made first\n"
        "n = len(os.listdir('/proc/self/fd')) + 20\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))\n"
        "out = tensortier.load(sys.argv[1])\n"
        "print(len(out), sum(float(t[0]) for t in out.values()))\n")
    r = subprocess.run([sys.executable, "-c", code, str(index)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["60", str(float(sum(range(60))))]


def _index_of_one_tensor_per_shard(d: Path, fmt: str, n: int) -> Path:
    """An index of `n` shards of `fmt` (safetensors ones with checksums), shard i holding t<i>,
    3 values of i."""
    weight_map = {}
    ext = "safetensors" if fmt == "safetensors" else "bin"
    for i in range(n):
        shard = f"s{i}.{ext}"
        tensortier.save({f"t{i}": torch.full((3,), float(i))}, d / shard, format=fmt,
                        checksum=fmt == "safetensors")
        weight_map[f"t{i}"] = shard
    index = d / f"model.{ext}.index.json"
    index.write_text(json.dumps({"weight_map": weight_map}))
    return index


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_load_into_an_index_of_more_shards_than_descriptors_left(disk_dir: Path,
                                                                 fmt: str) -> None:
    """load_into holds each shard open from its parse to its reads only where all fit: with
    fewer descriptors left than shards, each is opened again for its reads (and checked)."""
    index = _index_of_one_tensor_per_shard(disk_dir, fmt, 60)
    code = (
        "import os, resource, sys, torch, tensortier\n"
        "targets = {f't{i}': torch.zeros(3) for i in range(60)}\n"
        "tensortier.load_into(targets, sys.argv[1])  # the engine's descriptors made first\n"
        "n = len(os.listdir('/proc/self/fd')) + 20\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))\n"
        "targets = {f't{i}': torch.zeros(3) for i in range(60)}\n"
        "tensortier.load_into(targets, sys.argv[1], verify=True)\n"
        "print(len(os.listdir('/proc/self/fd')) <= n - 20 + 1,\n"
        "      sum(float(t.sum()) for t in targets.values()))\n")
    r = subprocess.run([sys.executable, "-c", code, str(index)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["True", str(3.0 * sum(range(60)))]


@pytest.mark.parametrize("change", ["replaced", "removed", "chmod"])
def test_load_into_a_shard_replaced_between_its_parse_and_its_reads_is_an_error(
        disk_dir: Path, monkeypatch: pytest.MonkeyPatch, change: str) -> None:
    """With too many shards to hold open, a shard is closed once parsed: if another save
    replaces or removes it before its reads, the load stops (EAGAIN, naming it) instead of
    reading the new file's bytes at the old file's offsets. A removed shard raised
    FileNotFoundError; a chmod (which moves only the file's ctime) was taken for a new file."""
    from tensortier.checkpoint import _reading, loading_into

    monkeypatch.setattr(_reading, "_MAX_PREOPENED", 1)
    index = _index_of_one_tensor_per_shard(disk_dir, "safetensors", 3)
    real = loading_into._Files.parsed

    def parsed_then_change(files: Any, path: str) -> None:
        real(files, path)  # closed, what it was noted
        if path.endswith("s1.safetensors"):
            if change == "replaced":
                from safetensors.torch import save_file
                save_file({"t1": torch.full((3,), 7.0), "pad": torch.ones(100)}, path + ".new")
                os.rename(path + ".new", path)
            elif change == "removed":
                os.unlink(path)
            else:
                os.chmod(path, 0o600)

    monkeypatch.setattr(loading_into._Files, "parsed", parsed_then_change)
    targets = {f"t{i}": torch.zeros(3) for i in range(3)}
    if change == "chmod":
        tensortier.load_into(targets, index)
        assert torch.equal(targets["t1"], tensortier.load(disk_dir / "s1.safetensors")["t1"])
        return
    with pytest.raises(OSError, match=f"{change} by another save") as e:
        tensortier.load_into(targets, index)
    assert e.value.errno == errno.EAGAIN and e.value.filename == str(disk_dir / "s1.safetensors")
    assert not torch.equal(targets["t1"], torch.full((3,), 7.0))


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_hf_index(disk_dir: Path, fmt: str) -> None:
    sd = make_shards(disk_dir, fmt)
    idx = next(disk_dir.glob("*.index.json"))
    out = tensortier.load(idx)
    assert set(out) == set(sd) and all(torch.equal(out[k], sd[k]) for k in sd)
    model = {k: torch.zeros_like(v) for k, v in sd.items()}
    tensortier.load_into(model, idx)
    assert all(torch.equal(model[k], sd[k]) for k in sd)


def test_hf_index_errors(disk_dir: Path) -> None:
    make_shards(disk_dir)
    idx = disk_dir / "model.safetensors.index.json"
    index = json.loads(idx.read_text())
    index["weight_map"]["ghost"] = "model-00001-of-00002.safetensors"
    idx.write_text(json.dumps(index))
    with pytest.raises(ValueError, match="ghost"):
        tensortier.load(idx)
    idx.write_text(json.dumps({"weight_map": {"a": "../elsewhere.safetensors"}}))
    with pytest.raises(ValueError, match="outside"):
        tensortier.load(idx)
    idx.write_text("{not json")
    with pytest.raises(ValueError, match="JSON"):
        tensortier.load(idx)
    idx.write_text(json.dumps({"weight_map": {"a": "missing.safetensors"}}))
    with pytest.raises(FileNotFoundError):
        tensortier.load(idx)
    # A name listed twice: json keeps the last, which shard holds it is a guess: refused.
    idx.write_text('{"weight_map": {"a": "x.safetensors", "a": "y.safetensors"}}')
    with pytest.raises(ValueError, match="listed twice"):
        tensortier.load(idx)


# ---- load_into ---------------------------------------------------------------------------------


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(100, 32)
        self.lin = torch.nn.Linear(32, 64)
        self.norm = torch.nn.LayerNorm(64)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)


@pytest.mark.parametrize("name", ["n.safetensors", "n.pt"])
def test_load_into_module_reads_in_place(disk_dir: Path, name: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(1)
    src = Net()
    src.steps.fill_(7)
    tensortier.save(src.state_dict(), disk_dir / name, checksum=True)
    dst = Net()
    before = {k: v.data_ptr() for k, v in dst.state_dict().items()}

    def no_alloc(*args: object, **kwargs: object) -> None:
        raise AssertionError("load_into allocated a tensor")

    monkeypatch.setattr(mapping, "_host_alloc", no_alloc)
    result = tensortier.load_into(dst, disk_dir / name, verify=True)
    assert result == tensortier.IncompatibleKeys([], [])
    after = dst.state_dict()
    assert {k: v.data_ptr() for k, v in after.items()} == before
    for k, v in src.state_dict().items():
        assert torch.equal(after[k], v), k
    assert dst.steps.item() == 7


def test_load_into_strictness(disk_dir: Path) -> None:
    sd = {"a": torch.randn(4), "b": torch.randn(2, 2)}
    path = disk_dir / "s.safetensors"
    tensortier.save(sd, path)
    target = {"a": torch.zeros(4), "c": torch.zeros(1)}
    with pytest.raises(ValueError,
                       match=r'Missing key\(s\) in state_dict: "c"\. \n\tUnexpected key\(s\) '
                             r'in state_dict: "b"\.'):
        tensortier.load_into(target, path)
    assert torch.equal(target["a"], torch.zeros(4))  # nothing read on error
    with pytest.raises(ValueError, match="Missing key"):  # a truthy strict, as torch takes it
        tensortier.load_into(target, path, strict="yes")
    res = tensortier.load_into(target, path, strict=False)
    assert res.missing_keys == ["c"] and res.unexpected_keys == ["b"]
    assert torch.equal(target["a"], sd["a"])
    with pytest.raises(ValueError, match=r"size mismatch for a: copying a param with shape "
                                         r"torch.Size\(\[4\]\) from checkpoint"):
        tensortier.load_into({"a": torch.zeros(5), "b": torch.zeros(2, 2)}, path)
    with pytest.raises(TypeError, match="Module or a mapping"):
        tensortier.load_into([torch.zeros(4)], path)


@pytest.mark.parametrize("name", ["m.safetensors", "m.pt"])
def test_load_into_converts_dtypes_like_load_state_dict(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """A half model from a float checkpoint (and back): converted as load_state_dict's copy_
    does, through temporaries a bounded group at a time, the same-dtype ones read in place."""
    src = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Linear(200, 100))
    src.register_buffer("steps", torch.tensor(12345))  # int64 into int32: converted too
    path = disk_dir / name
    tensortier.save(src.state_dict(), path, checksum=True)
    dst = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Linear(200, 100)).half()
    dst.register_buffer("steps", torch.tensor(0, dtype=torch.int32))
    dst[1].bias.data = dst[1].bias.data.float()  # one target of the file's dtype: in place
    bias_memory = dst[1].bias.data_ptr()
    want = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Linear(200, 100)).half()
    want.register_buffer("steps", torch.tensor(0, dtype=torch.int32))
    want[1].bias.data = want[1].bias.data.float()
    want.load_state_dict(src.state_dict())
    groups: list[int] = []
    real = internals._byte_groups

    def spy(staged: list) -> object:
        for group in real(staged):
            groups.append(sum(s.nbytes for s in group))
            yield group

    monkeypatch.setattr(_format, "_GROUP_BYTES", 100_000)
    monkeypatch.setattr(loading_into, "_byte_groups", spy)
    tensortier.load_into(dst, path, verify=True)
    for k, v in want.state_dict().items():
        got = dst.state_dict()[k]
        assert got.dtype == v.dtype and torch.equal(got, v), k
    assert dst[1].bias.data_ptr() == bias_memory
    largest = 300 * 200 * 4
    assert len(groups) >= 3 and max(groups) <= max(100_000, largest), groups


def test_load_into_tied_weights_and_non_contiguous_targets(disk_dir: Path) -> None:
    emb = torch.randn(10, 4)
    path = disk_dir / "tied.safetensors"
    tensortier.save({"emb.weight": emb}, path)  # stored once, as HF save_model does
    shared = torch.zeros(10, 4)
    target = {"emb.weight": shared, "head.weight": shared}
    assert tensortier.load_into(target, path) == ([], [])
    assert torch.equal(shared, emb)
    nc = torch.zeros(4, 10).t()  # non-contiguous target: read through a temporary
    tensortier.load_into({"emb.weight": nc}, path)
    assert torch.equal(nc, emb)


@pytest.mark.parametrize("name", ["untied.safetensors", "untied.pt"])
def test_load_into_tied_targets_from_untied_files_keeps_what_load_state_dict_keeps(
    disk_dir: Path, name: str
) -> None:
    """A model whose head is tied to its embedding, loaded from a file where the two differ:
    load_state_dict copies each name in turn, so the name last in the model's order wins."""
    model = torch.nn.ModuleDict({"emb": torch.nn.Embedding(6, 4), "head": torch.nn.Linear(4, 6)})
    model["head"].weight = model["emb"].weight
    path = disk_dir / name
    sd = {"emb.weight": torch.full((6, 4), 1.0), "head.weight": torch.full((6, 4), 2.0),
          "head.bias": torch.zeros(6)}
    tensortier.save(sd, path)
    reference = torch.nn.ModuleDict(
        {"emb": torch.nn.Embedding(6, 4), "head": torch.nn.Linear(4, 6)})
    reference["head"].weight = reference["emb"].weight
    reference.load_state_dict(sd)
    tensortier.load_into(model, path)
    assert torch.equal(model["emb"].weight, reference["emb"].weight)
    assert model["emb"].weight[0, 0].item() == 2.0


def test_load_into_from_torch_views(disk_dir: Path) -> None:
    base = torch.randn(20, 30)
    sd = {"full": base, "t": base.t(), "part": base[5:10]}
    path = disk_dir / "v.pt"
    tensortier.save(sd, path, checksum=True)
    target = {k: torch.zeros_like(v).contiguous() for k, v in sd.items()}
    tensortier.load_into(target, path, verify=True)
    for k in sd:
        assert torch.equal(target[k], sd[k]), k
    with zipfile.ZipFile(path) as z:
        info = z.getinfo("archive/data/0")
    with open(path, "r+b") as f:  # corrupt the one storage all three views share
        f.seek(info.header_offset + 26)
        n, x = struct.unpack("<HH", f.read(4))
        f.seek(info.header_offset + 30 + n + x + 100)
        f.write(b"\xff\xff")
    for name in ("t", "full", "part"):
        with pytest.raises(ValueError, match="entry '.*data/0': CRC-32 checksum mismatch"):
            tensortier.load_into({name: target[name]}, path, strict=False, verify=True)
    torch.save({"x": 1, "w": torch.ones(2)}, disk_dir / "mixed.pt")
    with pytest.raises(tensortier.StateDictMismatchError, match='Unexpected key.*"x"'):
        tensortier.load_into({"w": torch.zeros(2)}, disk_dir / "mixed.pt")  # as load_state_dict
    with pytest.raises(ValueError, match="'x' is an int.*tensortier.load"):
        tensortier.load_into({"x": torch.zeros(2), "w": torch.zeros(2)}, disk_dir / "mixed.pt")


def test_conjugate_and_negative_views(disk_dir: Path) -> None:
    """torch.save keeps a conjugate (or negative) view's storage as it is, with a flag: its
    values are not its bytes. load_into applies the flag as torch.load does; save to
    safetensors writes the values (as safetensors.torch.save_file does)."""
    x = torch.tensor([1 + 2j, 3 - 4j, -5 + 0.5j], dtype=torch.complex64)
    y = x.clone()  # torch.save refuses complex and float views of one storage
    sd = {"c": x.conj(), "n": y.conj().imag, "plain": x}
    assert sd["n"].is_neg()
    torch.save(sd, disk_dir / "v.pt")
    want = torch.load(disk_dir / "v.pt", weights_only=True)
    assert torch.equal(want["c"], x.conj()) and torch.equal(want["n"], -x.imag)
    for loaded in (tensortier.load(disk_dir / "v.pt"), tensortier.load(disk_dir / "v.pt", mmap=True)):
        for k in sd:
            assert torch.equal(loaded[k], want[k]), k
    for verify in (False, True):
        target = {k: torch.zeros_like(v.resolve_conj().resolve_neg()) for k, v in sd.items()}
        tensortier.load_into(target, disk_dir / "v.pt", verify=verify)
        for k in sd:
            assert torch.equal(target[k], want[k]), (k, verify)
            assert not target[k].is_conj() and not target[k].is_neg()
    tensortier.save({"c": x.conj(), "n": x.imag.neg()._neg_view()}, disk_dir / "v.safetensors")
    st = pytest.importorskip("safetensors.torch")
    back = st.load_file(str(disk_dir / "v.safetensors"))
    assert torch.equal(back["c"], x.conj().resolve_conj())
    assert torch.equal(back["n"], x.imag)


def test_dtype_conversion_keeps_parameters_and_leaves(disk_dir: Path) -> None:
    """load(dtype=...) gives what loading in that dtype would: a Parameter stays a Parameter,
    requires_grad is kept, and no tensor has autograd history (an optimizer takes them)."""
    sd = {
        "p": torch.nn.Parameter(torch.randn(3)),
        "frozen": torch.nn.Parameter(torch.randn(3), requires_grad=False),
        "leaf": torch.randn(3).requires_grad_(),
        "plain": torch.randn(3),
    }
    torch.save(sd, disk_dir / "p.pt")
    for mapped in (False, True):
        out = tensortier.load(disk_dir / "p.pt", dtype=torch.float16, mmap=mapped)
        for k, v in sd.items():
            o = out[k]
            assert o.dtype == torch.float16 and o.is_leaf and o.grad_fn is None, k
            assert o.requires_grad == v.requires_grad, k
            assert type(o) is type(v), k
            assert torch.equal(o.detach(), v.detach().half()), k
        torch.optim.SGD([out["p"], out["leaf"]], lr=0.1)


def test_concurrent_torch_saves_leave_torch_settings_as_they_were(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Our torch-format saves set torch's storage alignment while they run (a per-thread config
    patch): saves overlapping on several threads each write 4 KiB-aligned storages, and the
    setting is what it was afterwards."""
    from torch.utils.serialization import config as ser_config

    before = ser_config.save.storage_alignment
    sd = {f"w{i}": torch.randn(1000 + i) for i in range(20)}
    errors: list[BaseException] = []

    def save(n: int) -> None:
        try:
            for k in range(3):
                tensortier.save(sd, disk_dir / f"c{n}-{k}.pt")
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    real_save = torch.save

    def slow_save(*args: object, **kwargs: object) -> None:
        time.sleep(0.02)  # saves overlap for sure (the metadata pickling alone is quick)
        real_save(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "save", slow_save)
    threads = [threading.Thread(target=save, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    monkeypatch.undo()
    assert not errors, errors
    assert ser_config.save.storage_alignment == before
    for n in range(4):
        for k in range(3):
            path = disk_dir / f"c{n}-{k}.pt"
            raw = path.read_bytes()
            with zipfile.ZipFile(path) as z:
                for info in z.infolist():
                    if "/data/" in info.filename:
                        at = info.header_offset  # the local header's own name and extra lengths
                        name_len, extra_len = struct.unpack_from("<HH", raw, at + 26)
                        assert (at + 30 + name_len + extra_len) % 4096 == 0, (path, info.filename)
            out = torch.load(path, weights_only=True)
            assert all(torch.equal(out[k2], v) for k2, v in sd.items())


@pytest.mark.parametrize("dtype", ["int32", "bool", "complex64", "uint8"])
def test_load_refuses_a_dtype_it_would_not_convert_to(disk_dir: Path, dtype: str) -> None:
    path = disk_dir / "f.safetensors"
    tensortier.save({"w": torch.ones(3)}, path)
    with pytest.raises(ValueError, match="floating-point"):
        tensortier.load(path, dtype=getattr(torch, dtype))


def _nested_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.is_nested and len(a.unbind()) == len(b.unbind()) and all(
        same(x, y) for x, y in zip(a.unbind(), b.unbind()))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_nested_tensors_are_rebuilt_from_their_data(disk_dir: Path) -> None:
    """A nested tensor's sizes, strides and offsets are tensors its rebuild reads while the
    pickle loads: their storages are read then, not after (it read uninitialised memory: wrong
    shapes, or 'Storage size calculation overflowed'). Big-endian files too."""
    parts = [torch.randn(3, 5), torch.randn(7, 5), torch.randn(1, 5), torch.randn(40, 5)]
    sd = {"n": torch.nested.nested_tensor(parts), "w": torch.randn(1000)}
    path = disk_dir / "nested.pt"
    torch.save(sd, path)
    options: list[dict[str, object]] = [{}, {"verify": True}, {"mmap": True}]
    if torch.cuda.is_available():
        options.append({"device": "cuda"})
    for kwargs in options:
        for _ in range(3):  # fresh allocations each time: garbage would differ
            out = tensortier.load(path, **kwargs)
            assert _nested_equal(out["n"].cpu(), sd["n"]), kwargs
            assert same(out["w"].cpu(), sd["w"]), kwargs
    big = disk_dir / "nested-big.pt"
    with zipfile.ZipFile(path) as zin, zipfile.ZipFile(big, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            if info.filename.endswith("byteorder"):
                data = b"big"
            elif "/data/" in info.filename:
                # Storages in the order torch met them: the float buffer (0), then the nested
                # tensor's int64 sizes, strides and offsets, then w (float).
                n = 4 if info.filename.rsplit("/", 1)[1] in ("0", "4") else 8
                data = b"".join(data[k : k + n][::-1] for k in range(0, len(data), n))
            zout.writestr(info.filename, data)
    assert _nested_equal(torch.load(big, weights_only=True)["n"], sd["n"])  # built right
    for kwargs in options:  # mapped: swapped before the rebuild reads them (it read them raw)
        out = tensortier.load(big, **kwargs)
        assert _nested_equal(out["n"].cpu(), sd["n"]), kwargs
        assert same(out["w"].cpu(), sd["w"]), kwargs
    # Without CRC-32s (all zero), verify=True says so; these storages are read (and swapped)
    # while unpickling, where a CRC check said "checksum mismatch ... corrupt".
    data = bytearray(big.read_bytes())
    for signature, at in ((b"PK\x03\x04", 14), (b"PK\x01\x02", 16)):
        i = 0
        while (i := data.find(signature, i)) >= 0:
            data[i + at : i + at + 4] = bytes(4)
            i += 4
    no_crcs = disk_dir / "nested-big-no-crcs.pt"
    no_crcs.write_bytes(bytes(data))
    for mapped in (False, True):
        with pytest.raises(ValueError, match="stores no CRC-32"):
            tensortier.load(no_crcs, verify=True, mmap=mapped)


def test_a_dtype_converting_load_keeps_tuple_types_and_tensor_attributes(disk_dir: Path) -> None:
    """load(dtype=...) gives what torch.load gives but for the dtype: torch.Size stays a Size
    (it became a tuple), and a tensor's Python attributes stay (they were dropped)."""
    t = torch.ones(2)
    t.note = "x"  # type: ignore[attr-defined]
    p = torch.nn.Parameter(torch.ones(3))
    p.tag = 7  # type: ignore[attr-defined]
    sd = {"shape": torch.Size([2, 3]), "w": t, "p": p, "pair": (torch.ones(1), 2)}
    path = disk_dir / "s.pt"
    torch.save(sd, path)
    for mapped in (False, True):
        out = tensortier.load(path, dtype=torch.float16, mmap=mapped)
        assert type(out["shape"]) is torch.Size and out["shape"] == torch.Size([2, 3])
        assert out["w"].dtype == torch.float16 and out["w"].__dict__ == {"note": "x"}
        assert isinstance(out["p"], torch.nn.Parameter) and out["p"].tag == 7
        assert type(out["pair"]) is tuple and out["pair"][0].dtype == torch.float16


@pytest.mark.filterwarnings("ignore::UserWarning")  # quantized and nested tensors' deprecations
def test_quantized_and_nested_tensors_save_and_load(disk_dir: Path) -> None:
    """Quantized and nested tensors refuse torch's skip_data: save writes them through
    torch.save itself (it refused them), durably as any save; loads read them, mapped too
    (a per-channel one was refused with mmap=True)."""
    q = torch.quantize_per_tensor(torch.randn(40), 0.1, 3, torch.qint8)
    qc = torch.quantize_per_channel(torch.randn(4, 6), torch.tensor([0.1, 0.2, 0.3, 0.4]),
                                    torch.tensor([1, 2, 3, 4]), 0, torch.quint8)
    n = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(5, 3)])
    sd = {"q": q, "qc": qc, "n": n, "w": torch.randn(100)}

    def check(out: dict[str, torch.Tensor]) -> None:
        assert torch.equal(out["q"].int_repr(), q.int_repr()) and out["q"].q_scale() == 0.1
        assert torch.equal(out["qc"].int_repr(), qc.int_repr())
        assert torch.equal(out["qc"].q_per_channel_scales(), qc.q_per_channel_scales())
        assert torch.equal(out["qc"].q_per_channel_zero_points(), qc.q_per_channel_zero_points())
        assert _nested_equal(out["n"], n) and same(out["w"], sd["w"])

    path = disk_dir / "q.pt"
    path.write_bytes(b"old")
    tensortier.save(sd, path, checksum=True)
    assert not [p for p in disk_dir.iterdir() if p.name != "q.pt"]  # no temporary left
    check(torch.load(path, weights_only=True))
    for kwargs in ({}, {"verify": True}, {"mmap": True}):
        check(tensortier.load(path, **kwargs))


@pytest.mark.skipif(not hasattr(torch, "float4_e2m1fn_x2"), reason="this torch has no float4")
def test_safetensors_f4_is_torchs_packed_float4(disk_dir: Path) -> None:
    """safetensors' F4 counts 4-bit values, torch's float4_e2m1fn_x2 bytes of two: shapes
    differ in the last dimension (both were refused)."""
    raw = torch.randint(0, 256, (4, 6), dtype=torch.uint8)
    t = raw.view(torch.float4_e2m1fn_x2)
    theirs, ours = disk_dir / "theirs.safetensors", disk_dir / "ours.safetensors"
    st.save_file({"a": t, "b": torch.ones(2)}, theirs)
    tensortier.save({"a": t, "b": torch.ones(2)}, ours, checksum=True)
    for path in (theirs, ours):
        with safe_open(str(path), "pt") as f:
            assert f.get_tensor("a").shape == (4, 6)
        data = path.read_bytes()
        header = json.loads(data[8 : 8 + struct.unpack("<Q", data[:8])[0]])
        assert header["a"]["dtype"] == "F4" and header["a"]["shape"] == [4, 12]
        for kwargs in ({}, {"mmap": True}):
            out = tensortier.load(path, **kwargs)
            assert out["a"].dtype == torch.float4_e2m1fn_x2 and out["a"].shape == (4, 6)
            assert torch.equal(out["a"].view(torch.uint8), raw)
    assert torch.equal(tensortier.load(ours, verify=True)["a"].view(torch.uint8), raw)
    with pytest.raises(ValueError, match="0-dimensional"):
        tensortier.save({"a": raw[0, 0].view(torch.float4_e2m1fn_x2)}, disk_dir / "x.safetensors")


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
