"""The settings table as Python sees it: tensortier.defaults(), TENSORTIER_GDS read by C++, and
the README's table, which must match the code."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import tensortier
from tensortier import _core
from tensortier.compat import tensornvme

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(tensortier.__file__).resolve().parent


@pytest.fixture(autouse=True)
def _no_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("TENSORTIER_")]:
        monkeypatch.delenv(name)


def test_readme_table_matches_the_code() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORTIER_")}
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "settings_table.py"), "--check"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr


def test_readme_table_lists_every_variable_with_its_default() -> None:
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("<!-- settings:begin -->"):readme.index("<!-- settings:end -->")]
    rows = tensortier.defaults()
    for row in rows:
        assert f"| `{row['env']}` | `{row['default']}` | {row['allowed']} |" in table, row["env"]
    assert len(re.findall(r"^\| `TENSORTIER_", table, re.M)) == len(rows)


def test_defaults_has_every_setting_with_its_fields() -> None:
    rows = {row["env"]: row for row in tensortier.defaults()}
    for env in ("TENSORTIER_BACKEND", "TENSORTIER_CHUNK_SIZE", "TENSORTIER_QUEUE_DEPTH",
                "TENSORTIER_WORKERS", "TENSORTIER_MAX_INFLIGHT", "TENSORTIER_PAGE_CACHE_CHECK",
                "TENSORTIER_STAGE_READS", "TENSORTIER_BOUNCE_IDLE_MS", "TENSORTIER_HUGE_PAGES",
                "TENSORTIER_GDS", "TENSORTIER_BOUNCE_SLOTS", "TENSORTIER_BOUNCE_SLOT_SIZE",
                "TENSORTIER_BOUNCE_RINGS", "TENSORTIER_CUDA_LIBRARY",
                "TENSORTIER_CUFILE_LIBRARY", "TENSORTIER_MAX_STAGED", "TENSORTIER_COPY_THREADS"):
        row = rows.pop(env)
        assert set(row) == {"name", "env", "value", "default", "allowed", "description",
                            "from_environment"}
        assert row["from_environment"] is False and row["description"] and row["allowed"]
    assert rows == {}


def test_defaults_show_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TENSORTIER_GDS", "true")
    monkeypatch.setenv("TENSORTIER_BOUNCE_SLOT_SIZE", "16M")
    rows = {row["env"]: row for row in tensortier.defaults()}
    assert rows["TENSORTIER_GDS"]["value"] == "on" and rows["TENSORTIER_GDS"]["from_environment"]
    assert rows["TENSORTIER_BOUNCE_SLOT_SIZE"]["value"] == "16 MiB"


@pytest.mark.parametrize("env,value", [("TENSORTIER_HUGE_PAGES", "maybe"),
                                       ("TENSORTIER_BOUNCE_RINGS", "0"),
                                       ("TENSORTIER_CHUNK_SIZE", "5000")])
def test_a_bad_value_is_a_value_error_naming_the_variable(monkeypatch: pytest.MonkeyPatch,
                                                          env: str, value: str) -> None:
    monkeypatch.setenv(env, value)
    with pytest.raises(ValueError, match=f"{env}={value} is invalid: .*allowed: "):
        tensortier.defaults()


def test_gds_is_read_by_the_library(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _core.gds_mode(None) == "off"
    monkeypatch.setenv("TENSORTIER_GDS", "auto")
    assert _core.gds_mode(None) == "auto"
    assert _core.gds_mode("require") == "on"
    monkeypatch.setenv("TENSORTIER_GDS", "yes")
    with tensortier.IOHandle() as io:
        assert io.options["gds"] == "on"


def test_the_package_reads_no_setting_itself() -> None:
    """Every TENSORTIER_* variable is read by the C++ table; none by Python code."""
    reads = re.compile(r"(environ|getenv)[^\n]{0,40}TENSORTIER_")
    found = [f"{p.relative_to(PACKAGE)}: {m.group(0)}" for p in PACKAGE.rglob("*.py")
             for m in reads.finditer(p.read_text())]
    assert found == []


@pytest.mark.parametrize("option,value,says", [
    ("bounce_slot_size", 5000, r"bounce_slot_size \(TENSORTIER_BOUNCE_SLOT_SIZE\): 5000 is out "
                               r"of range \(allowed: 4K to 1T, a multiple of 4K\)"),
    ("bounce_slots", 4097, r"bounce_slots \(TENSORTIER_BOUNCE_SLOTS\): 4097 is out of range"),
    ("bounce_rings", 5000, r"bounce_rings \(TENSORTIER_BOUNCE_RINGS\): 5000 is out of range"),
    ("bounce_slots", 0, "bounce_slots must be a positive integer"),
])
def test_a_bad_bounce_option_is_refused_when_the_handle_is_made(option: str, value: int,
                                                                says: str) -> None:
    # Not at the first CUDA transfer, which may come much later (or never, on this machine).
    with pytest.raises(ValueError, match=says):
        tensortier.IOHandle(**{option: value})


@pytest.mark.parametrize("env,value", [("TENSORTIER_BOUNCE_SLOTS", "5000"),
                                       ("TENSORTIER_BOUNCE_SLOT_SIZE", "5000"),
                                       ("TENSORTIER_BOUNCE_RINGS", "0")])
def test_a_bad_bounce_variable_is_refused_when_a_handle_is_made(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, env: str, value: str) -> None:
    monkeypatch.setenv(env, value)
    with pytest.raises(ValueError, match=f"{env}={value} is invalid: .*allowed: "):
        tensortier.IOHandle()
    with pytest.raises(ValueError, match=f"{env}={value} is invalid: .*allowed: "):
        tensortier.DiskOffloader(str(tmp_path / "off"))
    with pytest.raises(ValueError, match=f"{env}={value} is invalid: .*allowed: "):
        tensornvme.DiskOffloader(str(tmp_path / "off"))


def test_the_bounce_options_a_handle_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TENSORTIER_BOUNCE_SLOTS", "3")
    with tensortier.IOHandle(bounce_slot_size=1 << 20) as io:
        assert io._device.ring_options == (3, 1 << 20, 4)
    # A combination of valid values can still be too much: refused at once too.
    with pytest.raises(ValueError, match="over 1 TiB"):
        tensortier.IOHandle(bounce_slots=4096, bounce_slot_size=1 << 30, bounce_rings=1)
