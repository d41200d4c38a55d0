"""tensortier declares the CUDA driver's and cuFile's ABI by hand (no CUDA headers at build time).
These tests hold those declarations against NVIDIA's own cuda.h and cufile.h, from the
``nvidia-cuda-runtime`` and ``nvidia-cufile`` wheels that scripts/setup.sh installs: a wrong
constant, struct layout, signature or exported name fails here, not on the first GPU machine."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "tests" / "cpp" / "abi" / "cuda_abi_check.cpp"


def test_declarations_match_the_real_headers(nvidia_include: Path) -> None:
    compiler = os.environ.get("CXX") or shutil.which("c++")
    if compiler is None:
        if os.environ.get("CI"):
            pytest.fail("no C++ compiler")
        pytest.skip("no C++ compiler")
    run = subprocess.run(
        [compiler, "-std=c++20", "-fsyntax-only", "-Wall", "-Wextra", "-Werror",
         f"-I{ROOT / 'include'}", f"-I{nvidia_include}", str(CHECK)],
        capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, f"{CHECK.name} against {nvidia_include}:\n{run.stderr}"


def _resolved(source: Path, api: str) -> set[tuple[str, str]]:
    """(exported name, `api`.member) for each DlSym call of `source`."""
    pairs = re.findall(r'DlSym\(\s*handle_,\s*library_,\s*"(\w+)",\s*api_\.(\w+)',
                       source.read_text())
    return {(name, f"{api}.{member}") for name, member in pairs}


def test_the_check_covers_every_resolved_name() -> None:
    """Each (exported name, API member) pair the loaders pass to dlsym is one the check holds
    against the headers' name mapping (`cuMemAlloc` -> `cuMemAlloc_v2`), and no other."""
    checked = {(name, f"{api}.{member}") for api, member, name in re.findall(
        r'TT_ENTRY\(\s*\w+,\s*k(Cuda|CuFile)\.(\w+),\s*"(\w+)"\)', CHECK.read_text())}
    resolved = (_resolved(ROOT / "src" / "cuda" / "cuda_driver.cpp", "Cuda")
                | _resolved(ROOT / "src" / "cuda" / "cufile.cpp", "CuFile"))
    assert len(resolved) == 45, sorted(resolved)
    assert checked == resolved, (sorted(checked - resolved), sorted(resolved - checked))
