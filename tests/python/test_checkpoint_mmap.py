"""tensortier.load(..., mmap=True): tensors that map the checkpoint file copy-on-write."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

import internals
import tensortier
from tensortier.checkpoint import mapping, safetensors, unpickler

pytest.importorskip("safetensors")
import safetensors.torch as st  # noqa: E402

from test_checkpoint import TORCH_DTYPES, make_shards, mixed_state_dict, random_tensor, same  # noqa: E402


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def storage_is_file_mapping(t: torch.Tensor, path: Path) -> bool:
    """Whether `t`'s memory lies in a shared-file mapping of `path` (per /proc/self/maps)."""
    address = t.data_ptr()
    real = str(path.resolve())
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return len(fields) == 6 and fields[5].strip() == real
    return False


@pytest.mark.parametrize("name", ["m.safetensors", "m.pt"])
def test_round_trip_every_dtype_maps_the_file(disk_dir: Path, name: str) -> None:
    sd = mixed_state_dict()
    if name.endswith(".pt"):
        sd["complex128"] = random_tensor((5, 3), torch.complex128)
    path = disk_dir / name
    tensortier.save(sd, path, checksum=True)
    before = digest(path)
    out = tensortier.load(path, mmap=True, verify=True)
    assert list(out) == list(sd) if name.endswith(".pt") else set(out) == set(sd)
    for k in sd:
        assert same(out[k], sd[k]), k
        if sd[k].numel():
            assert storage_is_file_mapping(out[k], path), k
            # A storage of exactly its bytes: saving one tensor saves only its bytes.
            assert out[k].untyped_storage().nbytes() == sd[k].nbytes, k
    # Writes stay private: the file is unchanged and a copy load sees the old values.
    out["big.weight"].fill_(7.0)
    assert digest(path) == before
    assert same(tensortier.load(path)["big.weight"], sd["big.weight"])


def test_mapped_tensors_are_independent_for_other_writers(disk_dir: Path) -> None:
    # safetensors refuses tensors that share memory: mapped tensors must not look shared.
    sd = mixed_state_dict()
    path = disk_dir / "m.safetensors"
    tensortier.save(sd, path)
    out = tensortier.load(path, mmap=True)
    assert sum(t.untyped_storage().nbytes() for t in out.values()) == sum(
        t.nbytes for t in sd.values()
    )
    st.save_file(out, disk_dir / "again.safetensors")
    again = st.load_file(disk_dir / "again.safetensors")
    assert all(same(again[k], sd[k]) for k in sd)


def test_torch_sharing_and_structure(disk_dir: Path) -> None:
    w = torch.randn(64, 32)
    obj = {"w": w, "rows": w[3:9], "t": w.t(), "step": 12, "name": "adam",
           "nested": [{"m": torch.arange(10)}, (w[0],)]}
    path = disk_dir / "s.pt"
    tensortier.save(obj, path)
    out = tensortier.load(path, mmap=True)
    assert out["step"] == 12 and out["name"] == "adam"
    assert torch.equal(out["rows"], w[3:9]) and torch.equal(out["t"], w.t())
    assert torch.equal(out["nested"][0]["m"], torch.arange(10))
    ptr = out["w"].untyped_storage().data_ptr()
    assert out["rows"].untyped_storage().data_ptr() == ptr
    assert out["nested"][1][0].untyped_storage().data_ptr() == ptr
    out["w"][3, 0] = 1234.0  # shared after load as before
    assert out["rows"][0, 0] == 1234.0


def test_torch_save_files_and_every_dtype(disk_dir: Path) -> None:
    sd = {str(d).split(".")[-1]: random_tensor((11, 3), d) for d in TORCH_DTYPES}
    path = disk_dir / "torch.pt"
    torch.save(sd, path)  # records 64-byte aligned, not page aligned
    out = tensortier.load(path, mmap=True, verify=True)
    for k in sd:
        assert same(out[k], sd[k]), k


def test_foreign_unaligned_offsets_are_copied(disk_dir: Path) -> None:
    # Offsets that are not multiples of the element size (legal in safetensors files).
    sd = {"a": torch.arange(3, dtype=torch.uint8), "b": torch.randn(3000),
          "c": torch.arange(5, dtype=torch.int64)}
    header = {"a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
              "b": {"dtype": "F32", "shape": [3000], "data_offsets": [3, 12003]},
              "c": {"dtype": "I64", "shape": [5], "data_offsets": [12003, 12043]}}
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % 8)  # data starts 8-aligned: b at +3, c at +12003
    path = disk_dir / "odd.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for k in ("a", "b", "c"):
            f.write(sd[k].numpy().tobytes())
    out = tensortier.load(path, mmap=True)
    for k in sd:
        assert same(out[k], sd[k]), k
        assert out[k].data_ptr() % out[k].element_size() == 0, k
    assert storage_is_file_mapping(out["a"], path)
    assert not storage_is_file_mapping(out["b"], path)
    assert not storage_is_file_mapping(out["c"], path)


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_dtype_conversion_and_shards(disk_dir: Path, fmt: str) -> None:
    sd = make_shards(disk_dir, fmt)
    out = tensortier.load(next(disk_dir.glob("*.index.json")), mmap=True, dtype=torch.bfloat16)
    assert set(out) == set(sd)
    for k in sd:
        assert out[k].dtype == torch.bfloat16 and torch.equal(out[k], sd[k].to(torch.bfloat16))


def test_replaced_file_keeps_the_old_bytes(disk_dir: Path) -> None:
    path = disk_dir / "m.safetensors"
    tensortier.save({"a": torch.zeros(4096)}, path)
    out = tensortier.load(path, mmap=True)
    tensortier.save({"a": torch.ones(4096)}, path)  # temporary file + rename: a new inode
    assert torch.equal(out["a"], torch.zeros(4096))
    assert torch.equal(tensortier.load(path, mmap=True)["a"], torch.ones(4096))


def test_verify_detects_a_flipped_byte(disk_dir: Path) -> None:
    for name in ("m.safetensors", "m.pt"):
        path = disk_dir / name
        tensortier.save({"a": torch.randn(1000)}, path, checksum=True)
        raw = bytearray(path.read_bytes())
        if name.endswith(".safetensors"):
            offset = 4096 + 100
        else:
            records = internals._zip_records(str(path))
            offset = next(r.offset for n, r in records.items() if n.endswith("data/0")) + 100
        raw[offset] ^= 0x40
        path.write_bytes(bytes(raw))
        with pytest.raises(ValueError, match="checksum"):
            tensortier.load(path, mmap=True, verify=True)


def test_ranges_past_the_end_are_errors_not_sigbus(disk_dir: Path) -> None:
    path = disk_dir / "m.safetensors"
    tensortier.save({"a": torch.randn(1000)}, path)
    size = path.stat().st_size
    with tensortier.IOHandle() as io:
        f = io.open(path)
        try:
            budget = internals._Readahead()
            internals._map_file(f, str(path), [("a", 0, size)], budget)  # the whole file: fine
            with pytest.raises(ValueError, match="file ended early.*'a'"):
                internals._map_file(f, str(path), [("a", size - 8, 16)], budget)
            with pytest.raises(ValueError, match="'a' has offset -8"):
                internals._map_file(f, str(path), [("a", -8, 16)], budget)
        finally:
            f.close()


@pytest.mark.parametrize("name", ["m.safetensors", "m.pt"])
def test_file_truncated_after_its_header_was_read(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    # Another process truncates the file between parsing and mapping: an error, not a SIGBUS
    # when a tensor is touched.
    path = disk_dir / name
    tensortier.save({"a": torch.randn(100_000)}, path)
    parser = "_read_st_header" if name.endswith(".safetensors") else "_torch_records"
    real = getattr(internals, parser)

    def parse_then_truncate(*args: object, **kwargs: object) -> object:
        parsed = real(*args, **kwargs)
        os.truncate(path, 8192)
        return parsed

    monkeypatch.setattr(safetensors if parser == "_read_st_header" else unpickler, parser,
                        parse_then_truncate)
    with pytest.raises(ValueError, match=f"{name}: file ended early"):
        tensortier.load(path, mmap=True)


def test_big_endian_torch_file(disk_dir: Path) -> None:
    sd = {"f": torch.randn(1000), "i": torch.arange(-50, 50, dtype=torch.int64),
          "h": torch.randn(33).to(torch.bfloat16)}
    src = disk_dir / "little.pt"
    torch.save(sd, src)
    big = disk_dir / "big.pt"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(big, "w") as zout:
        keys = {}
        for info in zin.infolist():
            data = zin.read(info.filename)
            if info.filename.endswith("byteorder"):
                data = b"big"
            elif "/data/" in info.filename:
                keys[info.filename] = data
                continue
            zout.writestr(info.filename, data)
        # Storages in key order hold f, i, h (torch numbers them as it meets them).
        for (name, data), t in zip(sorted(keys.items()), sd.values()):
            n = t.element_size()
            swapped = b"".join(data[k : k + n][::-1] for k in range(0, len(data), n))
            zout.writestr(name, swapped)
    expected = torch.load(big, weights_only=True)  # torch's own reading of it
    assert all(torch.equal(expected[k], sd[k]) for k in sd)
    before = digest(big)
    for mapped in (False, True):
        out = tensortier.load(big, mmap=mapped)
        for k in sd:
            assert same(out[k], sd[k]), (k, mapped)
    # Mapped shared (torch's MAP_SHARED setting), verified, given to a callable: the swap never
    # reaches the file, the CRC-32s are of the stored bytes, the callable gets native values.
    import mmap as mmap_module

    seen: list[Any] = []

    def keep(storage: Any, location: str) -> Any:
        seen.append(storage)
        return storage

    with torch.serialization.set_default_mmap_options(mmap_module.MAP_SHARED):
        for kwargs in ({}, {"verify": True}, {"map_location": keep},
                       {"map_location": keep, "verify": True}):
            for _ in range(2):
                out = tensortier.load(big, mmap=True, **kwargs)
                for k in sd:
                    assert same(out[k], sd[k]), (k, kwargs)
                assert digest(big) == before, kwargs
    assert len(seen) == 4 * len(sd)
    if torch.cuda.is_available():  # swapped on the GPU
        out = tensortier.load(big, device="cuda")
        for k in sd:
            assert out[k].is_cuda and same(out[k].cpu(), sd[k]), k
    assert digest(big) == before


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bool, torch.int16, torch.bfloat16,
                                   torch.float32, torch.int64, torch.float64, torch.complex64,
                                   torch.complex128])
def test_swap_bytes_matches_torchs_byteswap(dtype: torch.dtype) -> None:
    """Big-endian files loaded to a GPU are swapped there by tensor operations (torch's
    byteswap writes through the storage's pointer on the host); same bytes as torch's."""

    raw = torch.randint(0, 256, (37 * dtype.itemsize,), dtype=torch.uint8)
    ours, theirs = raw.clone(), raw.clone()
    internals._swap_bytes(ours.untyped_storage(), dtype)
    theirs.untyped_storage().byteswap(dtype)
    assert torch.equal(ours, theirs)
    if dtype.itemsize > 1:
        assert not torch.equal(ours, raw)


def test_readahead_budget(disk_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    advised: list[tuple[int, int]] = []
    real = os.posix_fadvise

    def spy(fd: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_WILLNEED:
            advised.append((offset, length))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", spy)
    path = disk_dir / "m.safetensors"
    sd = {"a": torch.randn(100_000), "b": torch.randn(3)}
    tensortier.save(sd, path)
    monkeypatch.setattr(mapping, "_available_memory", lambda: 1 << 40)
    assert torch.equal(tensortier.load(path, mmap=True)["a"], sd["a"])
    assert advised == [(4096, 400_012)]  # exactly the tensors' bytes
    advised.clear()
    monkeypatch.setattr(mapping, "_available_memory", lambda: 4096)
    assert torch.equal(tensortier.load(path, mmap=True)["a"], sd["a"])
    assert advised == []
    # One budget for all shards of an index: room for the first shard only.
    shards = make_shards(disk_dir)
    shard_bytes = 3 * 64 * 16 * 4
    monkeypatch.setattr(mapping, "_available_memory", lambda: 2 * shard_bytes + 100)
    out = tensortier.load(next(disk_dir.glob("*.index.json")), mmap=True)
    assert all(torch.equal(out[k], shards[k]) for k in shards)
    assert [length for _, length in advised] == [shard_bytes]
    advised.clear()

    def failing(fd: int, offset: int, length: int, advice: int) -> None:
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "posix_fadvise", failing)  # only a hint: the load goes on
    monkeypatch.setattr(mapping, "_available_memory", lambda: 1 << 40)
    assert torch.equal(tensortier.load(path, mmap=True)["a"], sd["a"])


def test_bad_arguments(disk_dir: Path) -> None:
    path = disk_dir / "m.safetensors"
    tensortier.save({"a": torch.randn(10)}, path)
    with pytest.raises(TypeError, match="mmap must be a bool"):
        tensortier.load(path, mmap="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="CUDA|cuda"):  # no GPU here: CUDA's own error first
        tensortier.load(path, device="cuda:0", mmap=True)


def test_mmap_with_a_cuda_device_is_refused(disk_dir: Path, monkeypatch: pytest.MonkeyPatch
                                             ) -> None:
    path = disk_dir / "m.safetensors"
    tensortier.save({"a": torch.randn(10)}, path)
    monkeypatch.setattr(mapping, "_target_device", lambda device: torch.device("cuda", 0))
    with pytest.raises(ValueError, match="mmap=True .* needs device='cpu'"):
        tensortier.load(path, device="cuda:0", mmap=True)


def test_verify_needs_checksums(disk_dir: Path) -> None:
    path = disk_dir / "m.safetensors"
    tensortier.save({"a": torch.randn(10)}, path)  # checksum=False: none stored
    with pytest.raises(ValueError, match="verify=True but"):
        tensortier.load(path, mmap=True, verify=True)
    if hasattr(torch.serialization, "set_crc32_options"):  # torch files carry CRCs by default
        before = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
        try:
            tensortier.save({"a": torch.randn(10)}, disk_dir / "m.pt")
        finally:
            torch.serialization.set_crc32_options(before)
        with pytest.raises(ValueError, match="verify=True but"):
            tensortier.load(disk_dir / "m.pt", mmap=True, verify=True)


def test_no_descriptor_or_mapping_outlives_the_tensors(disk_dir: Path) -> None:
    paths = []
    for i in range(3):
        paths.append(disk_dir / f"m{i}.safetensors")
        tensortier.save({"a": torch.randn(5000), "b": torch.randn(3000)}, paths[-1])
    paths.append(disk_dir / "m.pt")
    tensortier.save({"a": torch.randn(5000)}, paths[-1])

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    def mapped() -> int:
        with open("/proc/self/maps") as f:
            return sum(1 for line in f if any(str(p.resolve()) in line for p in paths))

    before = fds()
    loaded = [tensortier.load(p, mmap=True) for p in paths]
    assert fds() == before  # torch maps, then closes its descriptor
    assert mapped() == len(paths)
    keep = loaded[0]["b"]
    del loaded
    assert mapped() == 1  # the file of the tensor still alive
    assert torch.isfinite(keep).all()
    del keep
    assert mapped() == 0


@pytest.mark.parametrize("name", ["m.safetensors", "m.pt"])
def test_mmap_none_follows_torchs_setting_as_torch_load_does(disk_dir: Path, name: str) -> None:
    """torch.load's mmap defaults to None: torch.utils.serialization.config.load.mmap decides.
    Code passing mmap=None on (or setting the config) gets what torch.load gives."""
    from torch.utils.serialization import config

    path = disk_dir / name
    sd = {"a": torch.randn(1024)}
    tensortier.save(sd, path)
    out = tensortier.load(path, mmap=None)
    assert torch.equal(out["a"], sd["a"]) and not storage_is_file_mapping(out["a"], path)
    with config.patch({"load.mmap": True}):
        if name.endswith(".pt"):
            assert storage_is_file_mapping(torch.load(path, mmap=None)["a"], path)
        for out in (tensortier.load(path), tensortier.load(path, mmap=None)):
            assert torch.equal(out["a"], sd["a"]) and storage_is_file_mapping(out["a"], path)
        # Where a mapping cannot serve the load, the setting does not make it an error.
        out = tensortier.load(path, map_location={"cpu": "cpu"})
        assert not storage_is_file_mapping(out["a"], path)
        assert tensortier.load(path, device="meta")["a"].is_meta
        assert not storage_is_file_mapping(tensortier.load(path, mmap=False)["a"], path)


@pytest.mark.parametrize("name", ["m.safetensors", "m.pt"])
def test_map_shared_writes_reach_the_file_as_torch_loads_do(disk_dir: Path, name: str) -> None:
    """torch.serialization.set_default_mmap_options(mmap.MAP_SHARED) makes torch.load(mmap=True)
    map the file shared, so that writes to the tensors reach it; ours follow the same setting."""
    import mmap as mmap_module

    path = disk_dir / name
    sd = {"a": torch.arange(4096, dtype=torch.float32), "b": torch.ones(3, dtype=torch.int64)}
    tensortier.save(sd, path)
    with torch.serialization.set_default_mmap_options(mmap_module.MAP_SHARED):
        out = tensortier.load(path, mmap=True)
        assert storage_is_file_mapping(out["a"], path)
        out["a"].fill_(5.0)
        if name.endswith(".pt"):  # torch's own load, under the same setting, as the reference
            torch.load(path, mmap=True)["b"].fill_(9)
        else:
            out["b"].fill_(9)
        del out
    again = tensortier.load(path)
    assert torch.equal(again["a"], torch.full((4096,), 5.0))
    assert torch.equal(again["b"], torch.full((3,), 9))
    assert torch.equal(torch.load(path)["a"], again["a"])
    # Back to the default: private again.
    out = tensortier.load(path, mmap=True)
    out["a"].fill_(1.0)
    del out
    assert torch.equal(tensortier.load(path)["a"], torch.full((4096,), 5.0))


@pytest.mark.parametrize("name", ["m.safetensors", "m.pt"])
def test_map_location_dicts_and_callables_with_mmap(disk_dir: Path, name: str) -> None:
    """torch.load(mmap=True) takes any map_location: a dict or callable that keeps storages on
    the CPU keeps them mapped; a callable sees the mapped storage; another device is asked for
    (and refused here without CUDA, as torch refuses it)."""
    path = disk_dir / name
    sd = {"a": torch.arange(4096, dtype=torch.float32), "b": torch.ones(3, dtype=torch.int64)}
    tensortier.save(sd, path)
    seen: list[str] = []

    def keep(storage: Any, location: str) -> Any:
        seen.append(location)
        return storage

    for where in ({"cpu": "cpu"}, {"cuda:0": "cpu"}, keep):
        out = tensortier.load(path, mmap=True, map_location=where)
        if name.endswith(".pt"):
            theirs = torch.load(path, mmap=True, map_location=where)
            assert all(torch.equal(theirs[k], sd[k]) for k in sd)
        for k in sd:
            assert torch.equal(out[k], sd[k]), (where, k)
            assert storage_is_file_mapping(out[k], path), (where, k)
    assert seen and set(seen) == {"cpu"}
    meta = tensortier.load(path, mmap=True, map_location={"cpu": "meta"})
    assert all(t.is_meta and t.shape == sd[k].shape for k, t in meta.items())
    if not torch.cuda.is_available():
        with pytest.raises(tensortier.UnavailableDeviceError):
            tensortier.load(path, mmap=True, map_location={"cpu": "cuda"})
