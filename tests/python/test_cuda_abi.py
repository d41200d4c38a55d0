"""tensortier declares the CUDA driver's and cuFile's ABI by hand (no CUDA headers at build time).
These tests hold those declarations against NVIDIA's own cuda.h and cufile.h, from the
``nvidia-cuda-runtime`` and ``nvidia-cufile`` wheels that scripts/setup.sh installs: a wrong
constant, struct layout, signature or exported name fails here, not on the first GPU machine."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "tests" / "cpp" / "abi" / "cuda_abi_check.cpp"


def _require(what: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{what}: scripts/setup.sh installs it")
    pytest.skip(f"{what} (scripts/setup.sh installs it)")


def _nvidia_include() -> Path | None:
    """The folder of the nvidia wheels' headers holding both cuda.h and cufile.h."""
    spec = importlib.util.find_spec("nvidia")
    roots = spec.submodule_search_locations if spec is not None else None
    for root in roots or []:
        for include in sorted(Path(root).glob("*/include")):
            if (include / "cuda.h").is_file() and (include / "cufile.h").is_file():
                return include
    return None


def test_declarations_match_the_real_headers() -> None:
    include = _nvidia_include()
    if include is None:
        _require("NVIDIA's cuda.h and cufile.h are not installed (nvidia-cuda-runtime, "
                 "nvidia-cufile)")
    compiler = os.environ.get("CXX") or shutil.which("c++")
    if compiler is None:
        _require("no C++ compiler")
    run = subprocess.run(
        [compiler, "-std=c++20", "-fsyntax-only", "-Wall", "-Wextra", "-Werror",
         f"-I{ROOT / 'include'}", f"-I{include}", str(CHECK)],
        capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, f"{CHECK.name} against {include}:\n{run.stderr}"


def _resolved_names(source: Path) -> set[str]:
    return set(re.findall(r'DlSym\(\s*handle_,\s*library_,\s*"(\w+)"', source.read_text()))


def test_the_check_covers_every_resolved_name() -> None:
    """The names the loaders pass to dlsym are exactly the ones the check holds against the
    headers' name mapping (`cuMemAlloc` -> `cuMemAlloc_v2`)."""
    checked = set(re.findall(r'TT_ENTRY\(\s*\w+,\s*[\w.]+,\s*"(\w+)"\)', CHECK.read_text()))
    resolved = (_resolved_names(ROOT / "src" / "cuda" / "cuda_driver.cpp")
                | _resolved_names(ROOT / "src" / "cuda" / "cufile.cpp"))
    assert len(resolved) == 34, sorted(resolved)
    assert checked == resolved, (sorted(checked - resolved), sorted(resolved - checked))
