"""The extension exports its module init and nothing of the library it links statically.

A toolchain that links libstdc++ statically (some GCC builds do by default) put libstdc++'s
symbols in the extension's dynamic symbol table; torch, imported first, loads libstdc++.so, which
then interposed on some of them, and std::ostream crashed in the other copy's locale facets.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

import tensortier._core as core


def exported_symbols(path: str) -> list[str]:
    """The symbols `path` defines in its dynamic symbol table."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("needs nm (binutils)")
    out = subprocess.run([nm, "-D", "--defined-only", path], check=True, capture_output=True,
                         text=True, timeout=60).stdout
    return [line.split()[-1] for line in out.splitlines() if line.strip()]


def test_core_exports_nothing_of_the_static_libraries() -> None:
    symbols = exported_symbols(core.__file__)
    assert "PyInit__core" in symbols
    ours = [s for s in symbols if s.startswith(("_ZN10tensortier", "_ZNK10tensortier"))]
    assert ours == [], f"{len(ours)} library symbols exported, e.g. {ours[:3]}"
    runtime = [s for s in symbols if s.startswith(("_ZNSt6locale", "_ZNSo", "_ZNKSt7codecvt"))]
    assert runtime == [], f"libstdc++'s own symbols exported: {runtime[:3]}"
