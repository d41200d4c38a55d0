"""tensortier.load(..., mmap=True): tensors that map the checkpoint file copy-on-write."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest
import torch

import tensortier
from tensortier import checkpoint

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
    st.save_file(out, disk_dir / "again.safetensors")
    torch.save(out, disk_dir / "again.pt")
    again = torch.load(disk_dir / "again.pt", weights_only=True)
    assert all(same(again[k], sd[k]) for k in sd)
    assert (disk_dir / "again.pt").stat().st_size < path.stat().st_size + (1 << 20)


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
    text = json.dumps(header).encode() + b" "
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


def test_dtype_conversion_and_shards(disk_dir: Path) -> None:
    sd = make_shards(disk_dir)
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
            records = checkpoint._zip_records(str(path))
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
            checkpoint._map_file(f, str(path), [("a", 0, size)])  # the whole file: fine
            with pytest.raises(ValueError, match="file ended early.*'a'"):
                checkpoint._map_file(f, str(path), [("a", size - 8, 16)])
        finally:
            f.close()
    with open(path, "r+b") as fh:
        fh.truncate(size - 100)
    with pytest.raises(ValueError, match="m.safetensors"):
        tensortier.load(path, mmap=True)


def test_bad_arguments(disk_dir: Path) -> None:
    path = disk_dir / "m.safetensors"
    tensortier.save({"a": torch.randn(10)}, path)
    with pytest.raises(TypeError, match="mmap must be a bool"):
        tensortier.load(path, mmap="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="device='cpu'|CUDA|cuda"):
        tensortier.load(path, device="cuda:0", mmap=True)


def test_no_readahead_hint_beyond_available_memory(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = disk_dir / "m.safetensors"
    sd = {"a": torch.randn(100_000)}
    tensortier.save(sd, path)
    advised: list[int] = []
    real_mmap = __import__("mmap").mmap

    class Spy(real_mmap):  # type: ignore[misc, valid-type]
        def madvise(self, option: int, *args: int) -> None:
            advised.append(option)
            super().madvise(option, *args)

    monkeypatch.setattr("mmap.mmap", Spy)
    monkeypatch.setattr(checkpoint, "_available_memory", lambda: 1 << 40)
    assert torch.equal(tensortier.load(path, mmap=True)["a"], sd["a"])
    assert advised == [__import__("mmap").MADV_WILLNEED]
    advised.clear()
    monkeypatch.setattr(checkpoint, "_available_memory", lambda: 4096)
    assert torch.equal(tensortier.load(path, mmap=True)["a"], sd["a"])
    assert advised == []
