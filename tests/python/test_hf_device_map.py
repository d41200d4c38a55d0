"""tensortier.hf with accelerate's ``device_map`` on a machine without a GPU: "auto" and an
explicit CPU map are read by tensortier.load; a map that offloads to disk is left to
transformers, and the model is the same either way."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tensortier import hf  # noqa: E402
from test_hf import assert_same, inputs, make, ours, reads  # noqa: E402,F401

LLAMA = transformers.LlamaForCausalLM


@pytest.mark.skipif(torch.cuda.is_available(), reason="'auto' places on the GPU there")
@pytest.mark.parametrize("device_map", ["auto", {"": "cpu"}, "cpu"])
def test_cpu_device_maps_are_read_by_tensortier(tmp_path: Path, reads: list[str],
                                                device_map: object) -> None:
    make("llama", tmp_path, "20KB")
    theirs = LLAMA.from_pretrained(tmp_path, device_map=device_map)
    mine = ours(reads, LLAMA, tmp_path, device_map=device_map)
    assert getattr(mine, "hf_device_map", None) == getattr(theirs, "hf_device_map", None)
    assert_same(mine, theirs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="'auto' places on the GPU there")
def test_disk_offload_is_left_to_transformers(tmp_path: Path, reads: list[str]) -> None:
    make("llama", tmp_path / "model", "20KB")
    kwargs = dict(device_map="auto", max_memory={"cpu": "60KB"})
    theirs = LLAMA.from_pretrained(tmp_path / "model", offload_folder=tmp_path / "a", **kwargs)
    mine = hf.from_pretrained(LLAMA, tmp_path / "model", offload_folder=tmp_path / "b", **kwargs)
    assert reads == []  # accelerate's offload hooks read the offloaded weights themselves
    assert set(theirs.hf_device_map.values()) == {"cpu", "disk"}
    assert mine.hf_device_map == theirs.hf_device_map
    a, b = mine.state_dict(), theirs.state_dict()
    assert a.keys() == b.keys()
    for name, tensor in a.items():
        assert tensor.device == b[name].device, name
        if tensor.device.type != "meta":
            assert torch.equal(tensor, b[name]), name
    with torch.no_grad():
        assert torch.equal(mine(**inputs(mine)).logits, theirs(**inputs(theirs)).logits)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_device_map_without_cuda_raises_what_transformers_raises(tmp_path: Path) -> None:
    """torch's own error (not a damaged-shard error): code that catches it keeps working."""
    make("llama", tmp_path, "20KB")
    with pytest.raises(BaseException) as theirs:
        LLAMA.from_pretrained(tmp_path, device_map="cuda")
    with pytest.raises(type(theirs.value)) as mine:
        hf.from_pretrained(LLAMA, tmp_path, device_map="cuda")
    assert type(mine.value) is type(theirs.value) and str(mine.value) == str(theirs.value)
