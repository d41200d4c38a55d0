"""tensortier.load / save / load_into follow torch.load / torch.save / load_state_dict's
conventions: their errors, map_location and weights_only, file-like objects."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tensortier


def _load_state_dict_error(module: torch.nn.Module, sd: dict[str, torch.Tensor]) -> str:
    with pytest.raises(RuntimeError) as info:
        module.load_state_dict(sd)
    return str(info.value)


@pytest.mark.parametrize("name", ["m.safetensors", "m.pt"])
def test_load_into_strict_raises_load_state_dicts_runtime_error(
    disk_dir: Path, name: str
) -> None:
    """The same RuntimeError, with load_state_dict's lines in its order, plus the file."""
    saved = {"weight": torch.randn(3, 2), "extra": torch.randn(5)}
    path = disk_dir / name
    tensortier.save(saved, path)
    model = torch.nn.Linear(2, 2)
    expected = _load_state_dict_error(torch.nn.Linear(2, 2), saved)
    with pytest.raises(RuntimeError) as info:
        tensortier.load_into(model, path)
    got = str(info.value)
    assert got.startswith(expected + "\n\t"), got
    assert str(path) in got.splitlines()[-1]
    assert isinstance(info.value, tensortier.StateDictMismatchError)
    assert isinstance(info.value, ValueError)  # what callers caught before


def test_load_into_missing_unexpected_and_mapping_target(disk_dir: Path) -> None:
    path = disk_dir / "s.safetensors"
    tensortier.save({"weight": torch.randn(2, 2), "x": torch.randn(1)}, path)
    expected = _load_state_dict_error(torch.nn.Linear(2, 2), {"weight": torch.randn(2, 2),
                                                               "x": torch.randn(1)})
    with pytest.raises(RuntimeError) as info:
        tensortier.load_into(torch.nn.Linear(2, 2), path)
    assert str(info.value).startswith(expected + "\n\t")
    assert "strict=False" in str(info.value)
    with pytest.raises(RuntimeError, match=r"^Error\(s\) in loading state_dict for dict:"):
        tensortier.load_into({"weight": torch.zeros(2, 2)}, path)


def test_load_into_size_mismatch_raises_even_when_not_strict(disk_dir: Path) -> None:
    """load_state_dict(strict=False) still refuses shape mismatches: so does load_into."""
    path = disk_dir / "s.pt"
    saved = {"weight": torch.randn(3, 2)}
    tensortier.save(saved, path)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError) as theirs:
        torch.nn.Linear(2, 2).load_state_dict(saved, strict=False)
    with pytest.raises(RuntimeError) as ours:
        tensortier.load_into(model, path, strict=False)
    assert str(ours.value).startswith(str(theirs.value) + "\n\t")
    assert "strict=False" not in str(ours.value)
