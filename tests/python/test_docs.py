"""Every code block of the documentation runs: the fenced ``python``, ``bash``/``sh`` and
``console`` blocks of docs/**/*.md, README.md and BENCHMARKS.md (which the site includes).

The blocks of one page run in order in one temporary directory, as a reader would type them:
the Python blocks share one namespace (a later block sees an earlier one's names), the shell
blocks run in bash with the package's ``tensortier`` first on ``PATH`` and ``set -euo pipefail``.
A ``console`` block is a list of ``$ command`` lines, each followed by the output it must print
(stdout and stderr together; a line ``...`` stands for any lines, ``...`` within a line for any
text). A block that cannot run here says so on the line before it::

    <!-- skip: needs a GPU -->

and is reported as skipped with that reason. Other fences (``text``, ``json``) are not run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
PYTHON_LANGS = {"python", "py"}
SHELL_LANGS = {"bash", "sh", "shell"}
CONSOLE_LANGS = {"console"}
RUN_LANGS = PYTHON_LANGS | SHELL_LANGS | CONSOLE_LANGS
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
SKIP = re.compile(r"^\s*<!--\s*skip:\s*(?P<reason>.+?)\s*-->\s*$")
RUN_TIMEOUT_S = 300


@dataclass
class Block:
    page: str  # relative to the repository
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    skip: str | None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    found = sorted((REPO / "docs").rglob("*.md")) if (REPO / "docs").is_dir() else []
    return found + [REPO / "README.md", REPO / "BENCHMARKS.md"]


def blocks_of(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, with the skip reason written before each."""
    lines = path.read_text().splitlines()
    page = str(path.relative_to(REPO))
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, fence = m.group("indent"), m.group("fence")
        lang = (m.group("info").split() or [""])[0].lower()
        body = []
        j = i + 1
        while j < len(lines):
            close = lines[j].strip()
            if close.startswith(fence[0] * len(fence)) and set(close) == {fence[0]}:
                break
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j])
            j += 1
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        skip = SKIP.match(lines[k]) if k >= 0 else None
        found.append(Block(page, i + 1, lang, "\n".join(body) + "\n",
                           skip.group("reason") if skip else None))
        i = j + 1
    return found


ALL_BLOCKS = [b for p in pages() for b in blocks_of(p)]
RUN_BLOCKS = [b for b in ALL_BLOCKS if b.lang in RUN_LANGS]


def console_script(code: str) -> tuple[str, list[tuple[str, list[str]]]]:
    """A bash script running a console block's commands, each after a marker line, and the
    (command, expected output lines) pairs."""
    steps: list[tuple[str, list[str]]] = []
    for line in code.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        elif steps:
            steps[-1][1].append(line)
        elif line.strip():
            raise ValueError(f"console block: output before the first '$ ' command: {line!r}")
    script = ["exec 2>&1"]
    for n, (command, _) in enumerate(steps):
        # The marker keeps the previous command's status, for an `echo $?` that follows.
        script += [f"__rc=$?; printf '@@docs-step-{n}@@\\n'; (exit $__rc)", command]
    return "\n".join(script) + "\n", steps


def output_pattern(expected: list[str]) -> re.Pattern[str]:
    parts = []
    for line in expected:
        if line == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            parts.append(re.escape(line).replace(r"\.\.\.", r"[^\n]*") + r"\n")
    return re.compile("".join(parts))


# The runner: one interpreter for all pages, so that torch is imported once. Each page runs in a
# directory of its own with a namespace of its own (a later block sees an earlier one's names).
# It reads the pages' blocks as JSON and writes one result per block.
RUNNER = r'''
import json, linecache, os, subprocess, sys, traceback
pages = json.load(open(sys.argv[1]))
results = {}
base = os.getcwd()
for n, (page, blocks) in enumerate(pages.items()):
    work = os.path.join(base, str(n))
    os.mkdir(work)
    os.chdir(work)
    namespace = {"__name__": "__main__"}
    failed = False
    results[page] = []
    for b in blocks:
        if failed:
            results[page].append({"ok": False,
                                  "error": "not run: an earlier block of the page failed"})
            continue
        try:
            if b["kind"] == "python":
                # Tracebacks show the block's lines (line n of the block "page:fence").
                linecache.cache[b["id"]] = (len(b["code"]), None, b["code"].splitlines(True),
                                            b["id"])
                exec(compile(b["code"], b["id"], "exec"), namespace)
                sys.stdout.flush(); sys.stderr.flush()
                results[page].append({"ok": True})
            else:
                r = subprocess.run(["bash", "-c", b["code"]], capture_output=True, text=True,
                                   timeout=b["timeout"])
                results[page].append({"ok": r.returncode == 0 or b["kind"] == "console",
                                      "rc": r.returncode, "stdout": r.stdout, "stderr": r.stderr})
        except BaseException:
            results[page].append({"ok": False, "error": traceback.format_exc()})
        failed = not results[page][-1]["ok"]
    namespace.clear()
json.dump(results, open(sys.argv[2], "w"))
'''

_results: dict[str, dict[int, dict[str, Any]]] = {}
_runner_error: str | None = None


def payload_of(block: Block) -> dict[str, Any]:
    if block.lang in PYTHON_LANGS:
        return {"id": block.id, "kind": "python", "code": block.code}
    if block.lang in SHELL_LANGS:
        return {"id": block.id, "kind": "shell", "timeout": 60,
                "code": "set -euo pipefail\n" + block.code}
    script, _ = console_script(block.code)
    return {"id": block.id, "kind": "console", "timeout": 60, "code": script}


def results_of(page: str) -> dict[int, dict[str, Any]]:
    """Runs every runnable block of every page once, in order; `page`'s results by the line
    of each block's opening fence."""
    global _runner_error
    if _runner_error is not None:  # the runner is not started again for each block
        raise AssertionError(_runner_error)
    if not _results:
        try:
            _run_all()
        except Exception as e:
            _runner_error = f"the block runner failed: {e}"
            raise
    return _results.get(page, {})


def _run_all() -> None:
    """Runs the blocks of every page in one interpreter; fills _results."""
    todo: dict[str, list[Block]] = {}
    for b in RUN_BLOCKS:
        if b.skip is None:
            todo.setdefault(b.page, []).append(b)
    base = REPO / "build"  # the repository's disk, which takes O_DIRECT (as tests' disk_dir)
    base.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORTIER_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["COLUMNS"] = "100"
    with tempfile.TemporaryDirectory(dir=base, prefix="docs-") as d:
        blocks_file, results_file = Path(d) / "blocks.json", Path(d) / "results.json"
        blocks_file.write_text(json.dumps(
            {name: [payload_of(b) for b in blocks] for name, blocks in todo.items()}))
        work = Path(d) / "work"
        work.mkdir()
        r = subprocess.run([sys.executable, "-c", RUNNER, str(blocks_file), str(results_file)],
                           cwd=work, env=env, capture_output=True, text=True,
                           timeout=RUN_TIMEOUT_S)
        if not results_file.exists():
            raise AssertionError(f"the block runner died (exit {r.returncode}):\n"
                                 f"{r.stdout}\n{r.stderr}")
        found = json.loads(results_file.read_text())
    for name, blocks in todo.items():
        _results[name] = {b.line: res for b, res in zip(blocks, found[name])}


@pytest.mark.parametrize("block", RUN_BLOCKS, ids=[b.id for b in RUN_BLOCKS])
def test_block_runs(block: Block) -> None:
    if block.skip is not None:
        pytest.skip(block.skip)
    result = results_of(block.page)[block.line]
    assert "error" not in result, f"{block.id}:\n{result['error']}"
    if block.lang in CONSOLE_LANGS:
        _, steps = console_script(block.code)
        out = result["stdout"]
        chunks = re.split(r"^@@docs-step-(\d+)@@\n", out, flags=re.M)
        got = {int(chunks[i]): chunks[i + 1] for i in range(1, len(chunks) - 1, 2)}
        for n, (command, expected) in enumerate(steps):
            actual = got.get(n, "<not run>")
            assert output_pattern(expected).fullmatch(actual), (
                f"{block.id}: `{command}` printed:\n{actual}\nexpected:\n" + "\n".join(expected))
    else:
        assert result["ok"], (f"{block.id}: exit {result.get('rc')}\n"
                              f"{result.get('stdout', '')}\n{result.get('stderr', '')}")


def test_skips_give_a_reason_and_precede_a_block() -> None:
    """A skip marker stands right before the runnable block it skips (a stray one would
    silently skip nothing)."""
    for path in pages():
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if not SKIP.match(line):
                continue
            k = i + 1
            while k < len(lines) and not lines[k].strip():
                k += 1
            m = FENCE.match(lines[k]) if k < len(lines) else None
            lang = (m.group("info").split() or [""])[0].lower() if m else ""
            assert lang in RUN_LANGS, f"{path.relative_to(REPO)}:{i + 1}: skip before no block"


def test_no_page_cites_a_missing_document() -> None:
    """Markdown links to files of the repository point at files that exist."""
    link = re.compile(r"\]\((?!https?://|#|mailto:)([^)#\s]+)")
    for path in pages():
        for target in link.findall(path.read_text()):
            assert (path.parent / target).exists(), f"{path.relative_to(REPO)}: {target}"


def test_no_file_cites_a_document_missing_from_the_repository() -> None:
    """A name such as DESIGN.md or STYLE.md in any tracked file is a file of the repository."""
    r = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, timeout=60)
    if r.returncode != 0:
        pytest.skip("not a git checkout")
    tracked = [Path(p) for p in r.stdout.decode().split("\0") if p]
    names = {p.name for p in tracked}
    cited = re.compile(r"\b([A-Z][A-Z0-9_-]*\.md)\b")
    missing = []
    for rel in tracked:
        path = REPO / rel
        if path == Path(__file__).resolve() or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        missing += [f"{rel}: {name}" for name in set(cited.findall(text)) if name not in names]
    assert missing == []


@pytest.mark.parametrize("module", ["tensortier", "tensortier.offload", "tensortier.shared",
                                    "tensortier.data", "tensortier.dcp", "tensortier.hf"])
def test_api_reference_lists_every_public_name(module: str) -> None:
    """docs/api.md has a `::: module.name` entry for each name in the module's __all__ (or a
    `::: tensortier.name` one, for a name the package itself exports)."""
    import importlib

    import tensortier

    listed = set(re.findall(r"^::: (\S+)", (REPO / "docs" / "api.md").read_text(), re.M))
    mod = importlib.import_module(module)
    missing = [f"{module}.{name}" for name in mod.__all__
               if f"{module}.{name}" not in listed
               and not (f"tensortier.{name}" in listed
                        and getattr(tensortier, name, None) is getattr(mod, name))]
    assert missing == []


def test_cli_reference_finds_every_command() -> None:
    """The site's hook finds each command `tensortier --help` lists, `extents`' two included."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_hooks",
                                                  REPO / "docs" / "hooks" / "generated.py")
    assert spec is not None and spec.loader is not None
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    top = subprocess.run([str(Path(sys.executable).parent / "tensortier"), "--help"],
                         capture_output=True, text=True, timeout=60).stdout
    section = top.split("commands:\n", 1)[1].split("\n\n", 1)[0]
    listed = {line.split()[0] for line in section.splitlines() if re.match(r"  [a-z]", line)}
    found = hooks.commands(top)
    assert {words[0] for words in found} == listed - {"help"}
    assert ("extents", "build") in found and ("extents", "verify") in found
