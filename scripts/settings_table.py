#!/usr/bin/env python3
"""Writes the README's settings table from the C++ settings table (tensortier.defaults()).

    python scripts/settings_table.py           # rewrite the table in README.md
    python scripts/settings_table.py --check   # exit 1 when README.md's table is out of date

The table sits between the markers <!-- settings:begin --> and <!-- settings:end -->.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

BEGIN = "<!-- settings:begin -->"
END = "<!-- settings:end -->"
README = Path(__file__).resolve().parent.parent / "README.md"


def render() -> str:
    """The markdown table of every setting: variable, default, allowed values, meaning."""
    # The table shows built-in defaults: a variable set in this environment must not leak in.
    for name in [n for n in os.environ if n.startswith("TENSORTIER_")]:
        del os.environ[name]
    import tensortier

    lines = ["| variable | default | allowed | meaning |", "|---|---|---|---|"]
    for row in tensortier.defaults():
        cells = (f"`{row['env']}`", f"`{row['default']}`", row["allowed"], row["description"])
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def with_table(readme: str, table: str) -> str:
    """`readme` with the text between the markers replaced by `table`."""
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{README}: the markers {BEGIN} and {END} are missing")
    return readme[: start + len(BEGIN)] + "\n" + table + readme[end:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when README.md differs")
    args = parser.parse_args()
    current = README.read_text()
    wanted = with_table(current, render())
    if args.check:
        if current != wanted:
            print(f"{README}: the settings table differs from the code; run "
                  f"{Path(__file__).name} to rewrite it", file=sys.stderr)
            return 1
        return 0
    if current != wanted:
        README.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
