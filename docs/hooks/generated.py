"""MkDocs hook: fills the generated parts of the site when it is built, so that none of them is
pasted by hand.

- ``<!-- generated: cli-reference -->``: ``tensortier --help`` and the ``--help`` of every command
  it lists, run now (the CLI is ``$TENSORTIER_CLI``, else the ``tensortier`` beside the Python
  running MkDocs, else the one on ``PATH``).
- ``<!-- generated: settings-table -->``: the settings table, from ``tensortier.defaults()`` through
  ``scripts/settings_table.py``'s ``render()`` (the code that writes README.md's table).
- ``<!-- generated: benchmarks -->``: BENCHMARKS.md, its image paths made relative to the page.

A generator that fails fails the build.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"<!-- generated: ([a-z-]+) -->")


def _cli() -> str:
    if os.environ.get("TENSORTIER_CLI"):
        return os.environ["TENSORTIER_CLI"]
    beside = Path(sys.executable).parent / "tensortier"
    if beside.exists():
        return str(beside)
    found = shutil.which("tensortier")
    if found is None:
        raise RuntimeError("docs: no tensortier CLI found (install the package, or set "
                           "TENSORTIER_CLI) for the CLI reference")
    return found


def _help(cli: str, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORTIER_")}
    r = subprocess.run([cli, *args, "--help"], capture_output=True, text=True, timeout=60, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"docs: `tensortier {' '.join(args)} --help` exited {r.returncode}: "
                           f"{r.stderr.strip()}")
    return r.stdout.rstrip("\n")


def commands(top: str) -> list[tuple[str, ...]]:
    """The commands `tensortier --help` lists under "commands:", each as its words
    (``("extents", "build")``), in the order listed; ``help`` and options left out."""
    found: list[tuple[str, ...]] = []
    in_commands = False
    for line in top.splitlines():
        if line.strip() == "commands:":
            in_commands = True
            continue
        if in_commands and not line.strip():
            break
        m = re.match(r"^  (\S.*)$", line)
        if not in_commands or m is None:
            continue
        synopsis = re.split(r"\s{2,}", m.group(1))[0]  # the description follows a gap
        for alternative in synopsis.split("|"):
            words = []
            for word in alternative.split():
                if not re.fullmatch(r"[a-z][a-z-]*", word):
                    break
                words.append(word)
            if words and words[0] != "help" and tuple(words) not in found:
                found.append(tuple(words))
    if not found:
        raise RuntimeError("docs: `tensortier --help` lists no commands")
    return found


def cli_reference() -> str:
    cli = _cli()
    top = _help(cli)
    parts = ["## `tensortier --help`", "", "```text", top, "```", ""]
    for words in commands(top):
        name = " ".join(words)
        parts += [f"## `tensortier {name}`", "", "```text", _help(cli, *words), "```", ""]
    return "\n".join(parts)


def settings_table() -> str:
    spec = importlib.util.spec_from_file_location("settings_table",
                                                  ROOT / "scripts" / "settings_table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    saved = dict(os.environ)
    try:
        return module.render()  # it clears TENSORTIER_* variables: put them back after
    finally:
        os.environ.clear()
        os.environ.update(saved)


def benchmarks() -> str:
    text = (ROOT / "BENCHMARKS.md").read_text()
    return text.replace("](docs/img/", "](img/")


GENERATORS = {"cli-reference": cli_reference, "settings-table": settings_table,
              "benchmarks": benchmarks}


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ANN001 (MkDocs' types)
    def fill(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in GENERATORS:
            raise RuntimeError(f"docs: {page.file.src_path}: unknown generated part {name!r}")
        return GENERATORS[name]()

    return MARKER.sub(fill, markdown)
